//! Copies run on the copy pool's threads: a request saved over shm through
//! the request API (a pull save gathers from an engine-owned host KV
//! cache; a push save writes from it straight into the receiver's pages)
//! and loaded back (scattered into another, or read into it) moves every
//! byte, and the pool's counters show the gather ran and that the copies ran on two
//! distinct pool threads with `pd_copy_threads: 2`, and on none with
//! `pd_copy_threads: 1` (copies inline on the calling thread).
//!
//! The pool is one per process, sized by the first worker that starts, so
//! each case runs in a process of its own: this binary (no libtest harness)
//! runs itself once per case, with `COPY_POOL_CASE` naming it.

mod common;

use ascend_pd::config::{ChannelKind, TransferMode};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::{copy_pool_stats, pattern};
use ascend_pd::requests::{LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest, SharedKvCache};
use ascend_pd::{Receiver, Sender};
use common::*;
use std::sync::Arc;
use std::time::Duration;

const CASE: &str = "COPY_POOL_CASE";
/// Tokens per chunk; with 16 layers of 1024 bf16 elements per token and
/// plane, a chunk is 8 MiB, the smallest batch the pool takes.
const TOKENS_PER_CHUNK: usize = 128;
const CHUNKS: usize = 3;

fn save_and_load(mode: TransferMode, copy_threads: u64) {
    let what = format!("{mode:?}, pd_copy_threads {copy_threads}");
    let big = |mut c: ascend_pd::config::PdConfig| {
        c.chunk_size = TOKENS_PER_CHUNK;
        c.kv.num_layers = 16;
        c.kv.num_kv_heads = 8;
        c.kv.head_size = 128;
        c.kv.hidden_size = 1024;
        c.buffer_size = (CHUNKS as u64 + 1) * c.page_bytes();
        c.copy_threads = Some(copy_threads);
        c
    };
    let rc = big(receiver_config(ChannelKind::Shm, mode, 1));
    let sc = big(sender_config(ChannelKind::Shm, mode, 1));
    assert_eq!(rc.page_bytes(), 8 << 20, "{what}: a chunk is 8 MiB");
    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();

    let tokens = CHUNKS * TOKENS_PER_CHUNK;
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), CHUNKS, TOKENS_PER_CHUNK);
    let mut prefill = KvCache::host(spec).unwrap();
    let mut plane = vec![0u8; spec.plane_bytes()];
    for layer in 0..spec.layers {
        for p in 0..spec.planes() {
            pattern::fill(&mut plane, (layer * 10 + p + 1) as u64);
            prefill.write(spec.offset(layer, p, 0), &plane).unwrap();
        }
    }
    let prefill = SharedKvCache::new(prefill);
    let decode = SharedKvCache::new(KvCache::host(spec).unwrap());
    let before = copy_pool_stats();

    let keys: Vec<String> = (0..CHUNKS).map(|i| format!("big@{i}")).collect();
    // The decode side keeps the tokens in reverse slot order.
    let to = |t: usize| (tokens - 1 - t) as i64;
    saves
        .submit(
            SaveRequest {
                keys: keys.clone(),
                slot_mapping: (0..tokens as i64).collect(),
                spec: spec_for(&rc, "big", true),
            },
            &prefill,
        )
        .unwrap();
    let done = poll_until(|| saves.poll(), 1);
    assert_eq!(done[0].outcome, Outcome::Done, "{what}: {done:?}");
    assert!(
        eventually(Duration::from_secs(60), || loads.available(&keys)
            == ascend_pd::requests::Availability::Ready),
        "{what}: never became loadable"
    );
    loads
        .submit(
            LoadRequest {
                req_id: "big".into(),
                keys: keys.clone(),
                slot_mapping: (0..tokens).map(to).collect(),
            },
            &decode,
        )
        .unwrap();
    let got = poll_until(|| loads.poll(), 1);
    assert_eq!(got[0].outcome, Outcome::Done, "{what}: {got:?}");
    {
        let (mut src, mut dst) = (prefill.lock(), decode.lock());
        for l in 0..spec.layers {
            for p in 0..spec.planes() {
                for t in 0..tokens {
                    assert_eq!(
                        src.token(l, p, t).unwrap(),
                        dst.token(l, p, to(t) as usize).unwrap(),
                        "{what}: token {t} layer {l} plane {p}"
                    );
                }
            }
        }
    }
    assert!(sender.drain(Duration::from_secs(60)), "{what}");

    let after = copy_pool_stats();
    let request_bytes = CHUNKS as u64 * rc.page_bytes();
    // A push lands in the receiver's pages and is scattered into the cache;
    // a pull-delay load reads the sender's pages straight into the cache.
    let scatters = mode == TransferMode::Push;
    // (a) The save took the request from the engine's cache: a pull save
    // gathered it into the sender's pages; a push save (direct, the
    // default) wrote it from the cache straight into the receiver's pages,
    // so it gathered nothing and used no sender page. A push's load
    // scattered it into the other cache.
    if scatters {
        assert!(saves.writes_direct(&prefill), "{what}");
        assert_eq!(after.gather_bytes, before.gather_bytes, "{what}: {after:?}");
        assert_eq!(sender.stats().bytes_written, request_bytes, "{what}");
        assert_eq!(sender.stats().pools.cpu.unwrap().high_water, 0, "{what}");
    } else {
        assert!(
            after.gather_bytes - before.gather_bytes >= request_bytes,
            "{what}: gathered {} of {request_bytes} bytes: {after:?}",
            after.gather_bytes - before.gather_bytes
        );
    }
    assert!(
        !scatters || after.scatter_bytes - before.scatter_bytes >= request_bytes,
        "{what}: scattered {} of {request_bytes} bytes: {after:?}",
        after.scatter_bytes - before.scatter_bytes
    );
    if copy_threads == 1 {
        // (c) No pool: every copy ran inline.
        assert_eq!(after.threads, 0, "{what}: {after:?}");
        assert_eq!(after.jobs, 0, "{what}: {after:?}");
        assert_eq!(after.pooled_bytes(), 0, "{what}: {after:?}");
        assert_eq!(after.gather_pooled_bytes, 0, "{what}: {after:?}");
        assert_eq!(after.scatter_pooled_bytes, 0, "{what}: {after:?}");
    } else {
        // (b) The copies ran on the pool, on at least two of its threads;
        // the gathers and scatters among them.
        assert_eq!(after.threads, copy_threads as usize, "{what}: {after:?}");
        assert!(after.jobs > before.jobs, "{what}: {after:?}");
        let by_thread: Vec<u64> = after
            .bytes_by_thread
            .iter()
            .zip(before.bytes_by_thread.iter().chain(std::iter::repeat(&0)))
            .map(|(a, b)| a - b)
            .collect();
        assert!(
            by_thread.iter().filter(|&&b| b > 0).count() >= 2,
            "{what}: copies ran on fewer than 2 pool threads: {by_thread:?}"
        );
        // Each copy moves the request once: pull, the gather and the shm
        // read; push, the direct write and the load's scatter.
        assert!(
            by_thread.iter().sum::<u64>() >= 2 * request_bytes,
            "{what}: {by_thread:?}"
        );
        assert!(
            scatters || after.gather_pooled_bytes - before.gather_pooled_bytes >= request_bytes,
            "{what}: {after:?}"
        );
        assert!(
            !scatters || after.scatter_pooled_bytes - before.scatter_pooled_bytes >= request_bytes,
            "{what}: {after:?}"
        );
    }
}

fn run_case(case: &str) {
    match case {
        "two-threads" => {
            save_and_load(TransferMode::Push, 2);
            save_and_load(TransferMode::PullDelay, 2);
        }
        "one-thread" => {
            save_and_load(TransferMode::Push, 1);
            save_and_load(TransferMode::PullDelay, 1);
        }
        other => panic!("unknown case {other}"),
    }
}

fn main() {
    if let Ok(case) = std::env::var(CASE) {
        run_case(&case);
        return;
    }
    let exe = std::env::current_exe().unwrap();
    let mut failed = Vec::new();
    for case in ["two-threads", "one-thread"] {
        println!("copy_pool: {case} ...");
        let status = std::process::Command::new(&exe)
            .env(CASE, case)
            .status()
            .unwrap();
        if status.success() {
            println!("copy_pool: {case} ok");
        } else {
            println!("copy_pool: {case} FAILED ({status})");
            failed.push(case);
        }
    }
    assert!(failed.is_empty(), "failed: {failed:?}");
    println!("copy_pool: 2 cases passed");
}
