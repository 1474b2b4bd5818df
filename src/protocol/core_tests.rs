//! Deterministic tests of the sans-IO protocol core: sender pull bookkeeping,
//! breaker, receiver key store, and the races between them. Time is a base
//! `Instant` plus `Duration`s; memory comes from real [`PagePool`]s, and
//! every test that allocates checks the pool is back at its start.

use std::sync::Arc;
use std::time::{Duration, Instant};

use uuid::Uuid;

use super::*;
use crate::memory::{
    ChunkLayout, ChunkMeta, Dtype, MemFormat, MemObj, MemoryError, PagePool, PoolStats,
    RegisteredBuffer,
};

// ------------------------------------------------------------------ helpers

/// 16-byte pages: [2, 1, 4, 2] int8.
fn layout() -> ChunkLayout {
    ChunkLayout {
        fmt: MemFormat::Kv2Ltd,
        layers: 1,
        tokens: 4,
        hidden: 2,
        dtype: Dtype::Int8,
    }
}

fn pool(pages: usize) -> Arc<PagePool> {
    let page = layout().page_bytes();
    PagePool::new(RegisteredBuffer::host(pages * page, page, false).unwrap())
}

fn alloc(pool: &Arc<PagePool>, n: usize) -> Vec<MemObj> {
    pool.allocate_batch(&vec![ChunkMeta::full(layout()); n])
        .unwrap()
}

/// The pool holds nothing: no page allocated or pinned.
fn assert_idle(pool: &PagePool) {
    let s = pool.stats();
    assert_eq!(
        (s.allocated, s.pinned, s.free),
        (0, 0, s.total),
        "pool not back at start: {s:?}"
    );
}

fn stats(pool: &PagePool) -> (usize, usize) {
    let PoolStats {
        allocated, pinned, ..
    } = pool.stats();
    (allocated, pinned)
}

fn ack(already: &[u64], failed: bool) -> PullReadyDoneAck {
    PullReadyDoneAck {
        already_sent_indexes: already.to_vec(),
        alloc_failed: failed,
    }
}

const TTL: Duration = Duration::from_secs(360);
const LEASE: Duration = Duration::from_secs(30);
const S: Duration = Duration::from_secs(1);

fn pending() -> PullPending {
    PullPending::default()
}

fn keys(names: &[&str]) -> Vec<String> {
    names.iter().map(|s| s.to_string()).collect()
}

fn receiver() -> KeyStore {
    KeyStore::new(ReceiverConfig {
        layout: layout(),
        push_landing_timeout: Duration::from_secs(5),
        lease_read_margin: Duration::from_secs(1),
    })
}

fn alloc_request(k: &[&str], last: u64) -> AllocRequest {
    AllocRequest {
        keys: keys(k),
        fmt: FMT_KV_2LTD,
        shape: vec![2, 1, 4, 2],
        dtype: "int8".into(),
        last_chunk_toks: last,
    }
}

/// A notification advertising `pages` of a sender pool under `k`.
fn notif(pull_id: &str, k: &[&str], pages: &[MemObj]) -> PullReadyNotif {
    PullReadyNotif {
        pull_id: pull_id.into(),
        keys: keys(k),
        sender_buffer_uuids: pages
            .iter()
            .map(|p| p.buffer_ref().uuid.simple().to_string())
            .collect(),
        sender_mem_indexes: pages.iter().map(|p| u64::from(p.page())).collect(),
        sender_id: "prefill:7600".into(),
        sender_done_url: "127.0.0.1:7700".into(),
        fmt: FMT_KV_2LTD,
        shape: vec![2, 1, 4, 2],
        dtype: "int8".into(),
        last_chunk_toks: 4,
    }
}

/// A notification for remote pages that need not exist locally.
fn remote_notif(pull_id: &str, k: &[&str]) -> PullReadyNotif {
    let u = Uuid::new_v4().simple().to_string();
    PullReadyNotif {
        pull_id: pull_id.into(),
        keys: keys(k),
        sender_buffer_uuids: vec![u; k.len()],
        sender_mem_indexes: (0..k.len() as u64).collect(),
        sender_id: "prefill:7600".into(),
        sender_done_url: "127.0.0.1:7700".into(),
        fmt: FMT_KV_2LTD,
        shape: vec![2, 1, 4, 2],
        dtype: "int8".into(),
        last_chunk_toks: 4,
    }
}

fn pool_alloc(
    pool: &Arc<PagePool>,
) -> impl FnOnce(&[ChunkMeta]) -> Result<Vec<MemObj>, MemoryError> + '_ {
    move |m| pool.allocate_batch(m)
}

// ============================================================ sender side

#[test]
fn insert_pins_and_done_releases_every_page() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut pp = pending();
    let pages = alloc(&pool, 3);
    assert!(matches!(
        pp.insert("p1", "r:7400", "req1", pages, t0, LEASE).unwrap(),
        InsertOutcome::Pending
    ));
    assert_eq!(stats(&pool), (3, 3));
    assert_eq!(pp.pinned_pages(), 3);
    assert!(matches!(
        pp.on_ack("p1", &ack(&[], false), t0 + S),
        AckOutcome::Accepted {
            unpinned_early: 0,
            still_pinned: 3,
            invalid_indexes: 0
        }
    ));
    match pp.on_done("p1", t0 + 2 * S) {
        DoneOutcome::Released(r) => {
            assert_eq!((r.pull_id.as_str(), r.req_id.as_str()), ("p1", "req1"));
            assert_eq!(r.peer, "r:7400");
            assert_eq!(r.reason, ReleaseReason::Done);
            assert!(r.acked);
            assert_eq!(r.pages.len(), 3);
            assert!(r.pages.iter().all(|p| !p.is_pinned()));
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(pp.pinned_pages(), 0);
    assert!(pp.is_empty());
    assert_idle(&pool);
    let c = pp.counters();
    assert_eq!((c.inserted, c.done_released, c.pulls_pending), (1, 1, 0));
}

#[test]
fn race_done_before_ack() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    pp.insert("p1", "r", "q", alloc(&pool, 2), t0, LEASE)
        .unwrap();
    // The receiver's PUSH overtakes the REP reply.
    let DoneOutcome::Released(r) = pp.on_done("p1", t0 + S) else {
        panic!("done must release");
    };
    assert!(!r.acked);
    drop(r);
    assert_idle(&pool);
    // The late ack finds it released; nothing more happens.
    match pp.on_ack("p1", &ack(&[0], false), t0 + 2 * S) {
        AckOutcome::AlreadyReleased {
            reason: ReleaseReason::Done,
            alloc_failed: false,
        } => {}
        other => panic!("{other:?}"),
    }
    assert_eq!(pp.counters().done_before_ack, 1);
    assert_idle(&pool);
}

#[test]
fn race_done_after_ttl_sweep_is_not_a_double_free() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    pp.insert("p1", "r", "q", alloc(&pool, 2), t0, LEASE)
        .unwrap();
    assert!(pp.sweep(t0 + TTL - S, TTL).is_empty());
    assert_eq!(stats(&pool), (2, 2));
    let swept = pp.sweep(t0 + TTL, TTL);
    assert_eq!(swept.len(), 1);
    assert_eq!(swept[0].pull_id, "p1");
    assert_eq!(swept[0].pages, 2);
    assert_idle(&pool);
    // The receiver's Done arrives after the sweep: recognised, nothing freed again.
    assert!(matches!(
        pp.on_done("p1", t0 + TTL + S),
        DoneOutcome::AlreadyReleased(ReleaseReason::Expired)
    ));
    let c = pp.counters();
    assert_eq!(
        (c.expired, c.done_already_released, c.done_early),
        (1, 1, 0)
    );
    assert_eq!(c.sweeps, 2);
    assert_idle(&pool);
}

#[test]
fn done_for_unknown_pull_is_early_and_matches_a_later_insert() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    assert!(matches!(pp.on_done("ghost", t0), DoneOutcome::Early));
    assert_eq!(pp.counters().early_done_size, 1);
    // An insert of that id is released at once: nothing pinned.
    match pp
        .insert("ghost", "r", "q", alloc(&pool, 2), t0 + S, LEASE)
        .unwrap()
    {
        InsertOutcome::AlreadyDone(r) => {
            assert_eq!(r.reason, ReleaseReason::EarlyDone);
            assert_eq!(r.pages.len(), 2);
            assert_eq!(stats(&pool), (2, 0));
        }
        other => panic!("{other:?}"),
    }
    assert!(!pp.contains("ghost"));
    assert_idle(&pool);
    let c = pp.counters();
    assert_eq!(
        (c.done_early, c.early_done_matched, c.early_done_size),
        (1, 1, 0)
    );
}

#[test]
fn early_done_expires_after_its_lifetime() {
    let t0 = Instant::now();
    let pool = pool(2);
    let limits = PullPendingLimits::default();
    let mut pp = PullPending::new(limits);
    pp.on_done("x", t0);
    let later = t0 + limits.early_done_lifetime;
    assert!(matches!(
        pp.insert("x", "r", "q", alloc(&pool, 1), later, LEASE)
            .unwrap(),
        InsertOutcome::Pending
    ));
    assert!(matches!(pp.on_done("x", later), DoneOutcome::Released(_)));
    assert_idle(&pool);
}

#[test]
fn duplicate_done_is_harmless_and_counted() {
    let t0 = Instant::now();
    let pool = pool(2);
    let mut pp = pending();
    pp.insert("p", "r", "q", alloc(&pool, 2), t0, LEASE)
        .unwrap();
    assert!(matches!(pp.on_done("p", t0), DoneOutcome::Released(_)));
    for _ in 0..3 {
        assert!(matches!(
            pp.on_done("p", t0 + S),
            DoneOutcome::AlreadyReleased(ReleaseReason::Done)
        ));
    }
    let c = pp.counters();
    assert_eq!((c.done_released, c.done_already_released), (1, 3));
    assert_eq!(c.early_done_size, 0);
    assert_idle(&pool);
}

#[test]
fn alloc_failed_ack_releases_pins_and_breaker_opens_then_closes() {
    let t0 = Instant::now();
    let backoff = Duration::from_secs(2);
    let pool = pool(4);
    let mut pp = pending();
    let mut breaker = CircuitBreaker::new();
    let peer = "decode:7400";
    assert!(breaker.allows(peer, t0));
    pp.insert("p", peer, "q", alloc(&pool, 3), t0, LEASE)
        .unwrap();
    let out = pp.on_ack("p", &ack(&[], true), t0 + S);
    assert!(out.opens_breaker());
    match out {
        AckOutcome::AllocFailed(r) => {
            assert_eq!(r.reason, ReleaseReason::AllocFailed);
            assert_eq!(r.peer, peer);
            assert_eq!(r.pages.len(), 3);
        }
        other => panic!("{other:?}"),
    }
    // Released at once: nothing pinned or allocated any more.
    assert_idle(&pool);
    breaker.open(peer, t0 + S, backoff);
    assert!(!breaker.allows(peer, t0 + S));
    assert!(!breaker.allows(peer, t0 + S + backoff - Duration::from_millis(1)));
    assert!(breaker.allows(peer, t0 + S + backoff));
    let c = SenderCounters::snapshot(&pp, &breaker);
    assert_eq!(
        (c.breaker.opens, c.breaker.skips, c.breaker.closes),
        (1, 2, 1)
    );
    assert_eq!(c.pulls.acks_alloc_failed, 1);
    assert_eq!(c.pulls.pinned_pages, 0);
    // A late Done for it is a duplicate, not an early one.
    assert!(matches!(
        pp.on_done("p", t0 + 2 * S),
        DoneOutcome::AlreadyReleased(ReleaseReason::AllocFailed)
    ));
}

#[test]
fn ack_already_sent_unpins_those_pages_early() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut pp = pending();
    pp.insert("p", "r", "q", alloc(&pool, 4), t0, LEASE)
        .unwrap();
    match pp.on_ack("p", &ack(&[1, 3, 3, 9], false), t0 + S) {
        AckOutcome::Accepted {
            unpinned_early,
            still_pinned,
            invalid_indexes,
        } => assert_eq!((unpinned_early, still_pinned, invalid_indexes), (2, 2, 1)),
        other => panic!("{other:?}"),
    }
    // The two unpinned pages were dropped by the table: back in the pool.
    assert_eq!(stats(&pool), (2, 2));
    assert_eq!(pp.pinned_pages(), 2);
    // A duplicate ack changes nothing.
    assert!(matches!(
        pp.on_ack("p", &ack(&[0], false), t0 + S),
        AckOutcome::DuplicateAck
    ));
    assert_eq!(pp.pinned_pages(), 2);
    let DoneOutcome::Released(r) = pp.on_done("p", t0 + 2 * S) else {
        panic!()
    };
    assert_eq!(r.pages.len(), 2);
    drop(r);
    assert_idle(&pool);
    assert_eq!(pp.counters().pages_unpinned_at_ack, 2);
}

#[test]
fn ack_with_every_key_already_sent_releases_the_pull() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    pp.insert("p", "r", "q", alloc(&pool, 2), t0, LEASE)
        .unwrap();
    assert!(matches!(
        pp.on_ack("p", &ack(&[0, 1], false), t0),
        AckOutcome::AllAlreadySent(ReleasedPull { ref pages, .. }) if pages.is_empty()
    ));
    assert_idle(&pool);
    assert!(matches!(
        pp.on_done("p", t0 + S),
        DoneOutcome::AlreadyReleased(ReleaseReason::AllAlreadySent)
    ));
    assert_eq!(pp.counters().released_all_already_sent, 1);
}

#[test]
fn ttl_sweep_respects_the_lease() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    let short_ttl = Duration::from_secs(1);
    let long_lease = Duration::from_secs(10);
    pp.insert("p", "r", "q", alloc(&pool, 2), t0, long_lease)
        .unwrap();
    // TTL passed, lease not: the receiver may still read, nothing released.
    assert!(pp.sweep(t0 + Duration::from_secs(5), short_ttl).is_empty());
    assert!(pp
        .sweep(t0 + long_lease - Duration::from_millis(1), short_ttl)
        .is_empty());
    assert_eq!(stats(&pool), (2, 2));
    assert_eq!(pp.next_expiry(short_ttl), Some(t0 + long_lease));
    assert_eq!(pp.sweep(t0 + long_lease, short_ttl).len(), 1);
    assert_idle(&pool);

    // TTL longer than the lease: released at the TTL.
    pp.insert("p2", "r", "q", alloc(&pool, 1), t0, long_lease)
        .unwrap();
    let ttl = Duration::from_secs(20);
    assert!(pp.sweep(t0 + Duration::from_secs(19), ttl).is_empty());
    assert_eq!(pp.sweep(t0 + ttl, ttl)[0].pull_id, "p2");
    assert_idle(&pool);
    assert_eq!(pp.next_expiry(ttl), None);
}

#[test]
fn req_failure_releases_only_when_the_notif_never_left() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut pp = pending();
    pp.insert("sent-not", "r", "q", alloc(&pool, 2), t0, LEASE)
        .unwrap();
    pp.insert("maybe", "r", "q", alloc(&pool, 2), t0, LEASE)
        .unwrap();
    pp.insert("maybe-done", "r", "q", alloc(&pool, 1), t0, LEASE)
        .unwrap();
    match pp.on_req_failed("sent-not", Delivery::NotSent, t0 + S) {
        ReqFailedOutcome::Released(r) => assert_eq!(r.reason, ReleaseReason::ReqFailed),
        other => panic!("{other:?}"),
    }
    assert_eq!(stats(&pool), (3, 3));
    // Delivery unknown: the receiver may read until the lease; held until then.
    match pp.on_req_failed("maybe", Delivery::Unknown, t0 + S) {
        ReqFailedOutcome::HeldUntilLease { until } => assert_eq!(until, t0 + LEASE),
        other => panic!("{other:?}"),
    }
    pp.on_req_failed("maybe-done", Delivery::Unknown, t0 + S);
    assert!(pp.sweep(t0 + LEASE - S, TTL).is_empty());
    assert_eq!(stats(&pool), (3, 3));
    // The receiver did get "maybe-done" and signals Done before the lease.
    assert!(matches!(
        pp.on_done("maybe-done", t0 + 2 * S),
        DoneOutcome::Released(_)
    ));
    assert_eq!(stats(&pool), (2, 2));
    // At the lease end (well before the TTL) the rest is released.
    let swept = pp.sweep(t0 + LEASE, TTL);
    assert_eq!(swept.len(), 1);
    assert_eq!(swept[0].pull_id, "maybe");
    assert_idle(&pool);
    assert!(matches!(
        pp.on_req_failed("maybe", Delivery::NotSent, t0 + LEASE),
        ReqFailedOutcome::Unknown
    ));
    let c = pp.counters();
    assert_eq!((c.req_failed_released, c.req_failed_held), (1, 2));
}

#[test]
fn early_done_set_is_bounded() {
    let t0 = Instant::now();
    let cap = 16;
    let mut pp = PullPending::new(PullPendingLimits {
        early_done_capacity: cap,
        ..PullPendingLimits::default()
    });
    for i in 0..cap * 10 {
        assert!(matches!(
            pp.on_done(&format!("{i:032x}"), t0),
            DoneOutcome::Early
        ));
        assert!(pp.counters().early_done_size <= cap);
    }
    assert_eq!(pp.counters().early_done_size, cap);
    assert_eq!(pp.counters().done_early, (cap * 10) as u64);
    // The youngest are the ones kept.
    let pool = pool(2);
    let youngest = format!("{:032x}", cap * 10 - 1);
    let oldest = format!("{:032x}", 0);
    assert!(matches!(
        pp.insert(&youngest, "r", "q", alloc(&pool, 1), t0, LEASE)
            .unwrap(),
        InsertOutcome::AlreadyDone(_)
    ));
    assert!(matches!(
        pp.insert(&oldest, "r", "q", alloc(&pool, 1), t0, LEASE)
            .unwrap(),
        InsertOutcome::Pending
    ));
    pp.on_done(&oldest, t0);
    assert_idle(&pool);
}

#[test]
fn insert_rejects_duplicate_and_empty_ids_without_pinning() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut pp = pending();
    pp.insert("p", "r", "q", alloc(&pool, 1), t0, LEASE)
        .unwrap();
    let dup = pp
        .insert("p", "r", "q", alloc(&pool, 2), t0, LEASE)
        .unwrap_err();
    assert_eq!(dup, InsertError::DuplicatePullId("p".into()));
    assert_eq!(dup.to_string(), "pull_id \"p\" is already pending");
    assert_eq!(
        pp.insert("", "r", "q", alloc(&pool, 1), t0, LEASE)
            .unwrap_err(),
        InsertError::EmptyPullId
    );
    // Only the first insert's page is held.
    assert_eq!(stats(&pool), (1, 1));
    pp.on_done("p", t0);
    assert_idle(&pool);
}

#[test]
fn ack_for_unknown_pull_still_reports_alloc_failed() {
    let t0 = Instant::now();
    let mut pp = pending();
    let out = pp.on_ack("nope", &ack(&[], true), t0);
    assert!(matches!(out, AckOutcome::Unknown { alloc_failed: true }));
    assert!(out.opens_breaker());
    assert!(!pp.on_ack("nope", &ack(&[], false), t0).opens_breaker());
}

// ========================================================== receiver side

#[test]
fn push_allocates_new_keys_and_reports_pages_and_uuids() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut ks = receiver();
    let reply = ks.on_alloc_request(
        &alloc_request(&["a", "b", "c"], 3),
        "s:1",
        t0,
        pool_alloc(&pool),
    );
    assert!(matches!(
        reply.verdict,
        Verdict::Accepted { new: 3, present: 0 }
    ));
    let r = &reply.response;
    assert!(!r.alloc_failed);
    assert!(r.already_sent_indexes.is_empty());
    assert_eq!(r.remote_indexes, vec![0, 1, 2]);
    let uuid = pool.uuid().simple().to_string();
    assert_eq!(
        r.remote_buffer_uuids,
        vec![uuid.clone(), uuid.clone(), uuid]
    );
    assert_eq!(stats(&pool), (3, 0));
    // Not landed: never handed to the load path as valid.
    assert!(matches!(ks.get("a", t0), Lookup::NotReady));
    assert_eq!(ks.state("c"), Some(KeyState::PendingPush));
    assert_eq!(ks.pending_push_peer("a"), Some("s:1"));
    // The last chunk is partial (3 of 4 tokens).
    let landed = ks.mark_landed(&keys(&["a", "b", "zz"]));
    assert_eq!(landed.landed, 2);
    assert_eq!(landed.not_pending, vec!["zz".to_string()]);
    match ks.get("a", t0) {
        Lookup::Resident(p) => assert_eq!(p.tokens(), 4),
        other => panic!("{other:?}"),
    }
    // Landing by page ref.
    let c_ref = crate::memory::BufferRef {
        uuid: pool.uuid(),
        page: 2,
    };
    assert_eq!(ks.mark_landed_refs(&[c_ref]).landed, 1);
    match ks.get("c", t0) {
        Lookup::Resident(p) => assert_eq!((p.tokens(), p.byte_len()), (3, 12)),
        other => panic!("{other:?}"),
    }
    assert_eq!(ks.mark_landed_refs(&[c_ref]).not_pending.len(), 1);
    let c = ks.counters();
    assert_eq!((c.resident, c.pending_push, c.landed), (3, 0, 3));
    // Removing resident keys returns their pages.
    for k in ["a", "b", "c"] {
        let removed = ks.remove(k).unwrap();
        assert_eq!(removed.state, KeyState::Resident);
    }
    assert!(ks.remove("a").is_none());
    assert_idle(&pool);
}

#[test]
fn dedup_partition_counts_every_state_as_present() {
    let t0 = Instant::now();
    let pool = pool(8);
    let mut ks = receiver();
    // resident "r", pending push "pp", pending read "pr", proxy "px".
    ks.on_alloc_request(&alloc_request(&["r", "pp"], 4), "s", t0, pool_alloc(&pool));
    ks.mark_landed(&keys(&["r"]));
    let sender_pool = self::pool(4);
    let sp = alloc(&sender_pool, 1);
    let eager = ks.on_pull_eager(&notif("e1", &["pr"], &sp), t0, LEASE, pool_alloc(&pool));
    assert!(eager.read.is_some());
    ks.on_pull_delay(&remote_notif("d1", &["px"]), t0, LEASE);
    assert_eq!(ks.state("r"), Some(KeyState::Resident));
    assert_eq!(ks.state("pp"), Some(KeyState::PendingPush));
    assert_eq!(ks.state("pr"), Some(KeyState::PendingRead));
    assert_eq!(ks.state("px"), Some(KeyState::Proxy));

    let p = ks.partition(&keys(&["new0", "r", "pp", "new1", "pr", "px"]));
    assert_eq!(p.present, vec![1, 2, 4, 5]);
    assert_eq!(p.new, vec![0, 3]);

    // A push for the same keys allocates only the new ones and reports the rest.
    let before = stats(&pool).0;
    let reply = ks.on_alloc_request(
        &alloc_request(&["new0", "r", "pp", "new1", "pr", "px"], 4),
        "s",
        t0,
        pool_alloc(&pool),
    );
    assert_eq!(reply.response.already_sent_indexes, vec![1, 2, 4, 5]);
    assert_eq!(reply.response.remote_indexes.len(), 2);
    assert_eq!(stats(&pool).0, before + 2);
    assert_eq!(ks.counters().dedup_hits, 4);
    assert!(ks.contains("new1"));

    drop(eager);
    for k in ["r", "pp", "pr", "px", "new0", "new1"] {
        ks.remove(k).unwrap();
    }
    drop(sp);
    assert_idle(&pool);
    assert_idle(&sender_pool);
}

#[test]
fn push_rollback_on_alloc_failure_leaves_nothing() {
    let t0 = Instant::now();
    let pool = pool(2);
    let start = pool.stats();
    let mut ks = receiver();
    // Three new keys, two pages: all or nothing.
    let reply = ks.on_alloc_request(
        &alloc_request(&["a", "b", "c"], 4),
        "s",
        t0,
        pool_alloc(&pool),
    );
    assert!(matches!(
        reply.verdict,
        Verdict::AllocFailed(MemoryError::Exhausted { .. })
    ));
    assert_eq!(
        reply.response,
        AscendAllocResponse {
            already_sent_indexes: vec![],
            remote_indexes: vec![],
            remote_buffer_uuids: vec![],
            alloc_failed: true
        }
    );
    assert!(ks.is_empty());
    assert_eq!(ks.counters().alloc_failures, 1);
    assert_eq!(stats(&pool), (start.allocated, start.pinned));

    // An allocator that hands out some pages then fails: they are returned.
    let partial = |m: &[ChunkMeta]| -> Result<Vec<MemObj>, MemoryError> {
        let got = pool.allocate_batch(&m[..1])?;
        assert_eq!(stats(&pool).0, 1);
        drop(got);
        Err(MemoryError::InvalidGeometry("injected".into()))
    };
    let reply = ks.on_alloc_request(&alloc_request(&["a", "b"], 4), "s", t0, partial);
    assert!(reply.response.alloc_failed);
    // An allocator returning the wrong number of pages is a failure too.
    let short = |_: &[ChunkMeta]| Ok(alloc(&pool, 1));
    let reply = ks.on_alloc_request(&alloc_request(&["a", "b"], 4), "s", t0, short);
    assert!(reply.response.alloc_failed);
    assert!(reply
        .verdict
        .to_string_lossy()
        .contains("returned 1 page(s) for 2"));
    assert!(ks.is_empty());
    assert_eq!(ks.counters().alloc_failures, 3);
    assert_idle(&pool);

    // A present key is kept across a failed message (it was not part of the rollback).
    ks.on_alloc_request(&alloc_request(&["keep"], 4), "s", t0, pool_alloc(&pool));
    let reply = ks.on_alloc_request(
        &alloc_request(&["keep", "x", "y"], 4),
        "s",
        t0,
        pool_alloc(&pool),
    );
    assert!(reply.response.alloc_failed);
    assert_eq!(ks.len(), 1);
    assert_eq!(stats(&pool).0, 1);
    ks.remove("keep");
    assert_idle(&pool);
}

trait VerdictText {
    fn to_string_lossy(&self) -> String;
}

impl VerdictText for Verdict {
    fn to_string_lossy(&self) -> String {
        match self {
            Verdict::AllocFailed(e) => e.to_string(),
            Verdict::Rejected(e) => e.to_string(),
            Verdict::Accepted { .. } => "accepted".into(),
        }
    }
}

#[test]
fn invalid_messages_are_rejected_without_allocating() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut ks = receiver();
    let never = |_: &[ChunkMeta]| -> Result<Vec<MemObj>, MemoryError> {
        panic!("allocator must not run for an invalid message")
    };
    let mut bad = alloc_request(&["a"], 4);
    bad.shape = vec![2, 1, 8, 2];
    let reply = ks.on_alloc_request(&bad, "s", t0, never);
    assert!(reply.response.alloc_failed);
    assert!(matches!(
        reply.verdict,
        Verdict::Rejected(InvalidMessage::LayoutMismatch { .. })
    ));
    assert!(reply
        .verdict
        .to_string_lossy()
        .starts_with("AllocRequest.shape"));
    let reply = ks.on_alloc_request(&alloc_request(&["a", "a"], 4), "s", t0, never);
    assert!(reply
        .verdict
        .to_string_lossy()
        .contains("keys[1]: duplicate"));
    let reply = ks.on_alloc_request(&alloc_request(&["a"], 5), "s", t0, never);
    assert!(reply.verdict.to_string_lossy().contains("last_chunk_toks"));

    let mut n = remote_notif("p", &["a", "b"]);
    n.sender_mem_indexes.pop();
    let reply = ks.on_pull_eager(&n, t0, LEASE, never);
    assert!(reply.ack.alloc_failed);
    assert!(reply.read.is_none() && reply.done.is_empty());
    assert!(reply
        .verdict
        .to_string_lossy()
        .contains("PullReadyNotif.sender_mem_indexes"));
    let mut n = remote_notif("p", &["a"]);
    n.sender_buffer_uuids[0] = "zz".into();
    assert!(ks.on_pull_delay(&n, t0, LEASE).ack.alloc_failed);
    let c = ks.counters();
    assert_eq!((c.rejected_alloc_requests, c.rejected_pull_notifs), (3, 2));
    assert!(ks.is_empty());
    assert_idle(&pool);
}

#[test]
fn pending_push_reclaimed_after_deadline_returns_its_pages() {
    let t0 = Instant::now();
    let pool = pool(4);
    let mut ks = receiver();
    let timeout = ks.config().push_landing_timeout;
    ks.on_alloc_request(&alloc_request(&["a", "b"], 4), "s", t0, pool_alloc(&pool));
    ks.on_alloc_request(
        &alloc_request(&["c"], 4),
        "s",
        t0 + 2 * S,
        pool_alloc(&pool),
    );
    ks.mark_landed(&keys(&["b"]));
    assert_eq!(stats(&pool).0, 3);
    assert!(ks
        .sweep(t0 + timeout - Duration::from_millis(1))
        .reclaimed_pushes
        .is_empty());
    let report = ks.sweep(t0 + timeout);
    assert_eq!(report.reclaimed_pushes, vec!["a".to_string()]);
    // "a" is gone (its page is back), "b" landed and stays, "c" is younger.
    assert_eq!(stats(&pool).0, 2);
    assert!(matches!(ks.get("a", t0), Lookup::Missing));
    assert_eq!(
        ks.mark_landed(&keys(&["a"])).not_pending,
        vec!["a".to_string()]
    );
    let a_ref = crate::memory::BufferRef {
        uuid: pool.uuid(),
        page: 0,
    };
    assert_eq!(ks.mark_landed_refs(&[a_ref]).landed, 0);
    assert_eq!(
        ks.sweep(t0 + 2 * S + timeout).reclaimed_pushes,
        vec!["c".to_string()]
    );
    assert_eq!(ks.counters().reclaimed_pushes, 2);
    ks.remove("b");
    assert_idle(&pool);
}

#[test]
fn pull_eager_ack_then_read_then_done_once() {
    let t0 = Instant::now();
    let sender_pool = pool(4);
    let recv_pool = pool(4);
    let mut ks = receiver();
    let sp = alloc(&sender_pool, 2);
    let reply = ks.on_pull_eager(
        &notif("e", &["a", "b"], &sp),
        t0,
        LEASE,
        pool_alloc(&recv_pool),
    );
    assert_eq!(reply.ack, ack(&[], false));
    // No Done with the ack: it only comes from the read's completion.
    assert!(reply.done.is_empty());
    let read = reply.read.unwrap();
    assert_eq!(read.pull_id, "e");
    assert_eq!(read.read_by, t0 + LEASE - S);
    assert_eq!(read.items.len(), 2);
    assert_eq!(read.items[1].remote, sp[1].buffer_ref());
    assert_eq!(read.items[0].bytes, 16);
    assert!(matches!(ks.get("a", t0), Lookup::NotReady));
    assert_eq!(ks.counters().eager_reads_open, 1);
    drop(read);
    let done = ks.on_read_complete("e", true).unwrap();
    assert_eq!(done.signal.pull_id, "e");
    assert_eq!(done.done_url, "127.0.0.1:7700");
    assert!(ks.on_read_complete("e", true).is_none());
    assert!(matches!(ks.get("b", t0), Lookup::Resident(_)));
    assert_eq!(ks.counters().dones_emitted, 1);
    ks.remove("a");
    ks.remove("b");
    drop(sp);
    assert_idle(&recv_pool);
    assert_idle(&sender_pool);
}

#[test]
fn pull_eager_failed_or_late_read_drops_keys_and_still_sends_done() {
    let t0 = Instant::now();
    let recv_pool = pool(4);
    let mut ks = receiver();
    let reply = ks.on_pull_eager(
        &remote_notif("f", &["a"]),
        t0,
        LEASE,
        pool_alloc(&recv_pool),
    );
    drop(reply.read);
    assert!(ks.on_read_complete("f", false).is_some());
    assert!(!ks.contains("a"));
    assert_idle(&recv_pool);

    // A read that never completes: the sweep gives up at the lease and sends Done.
    let reply = ks.on_pull_eager(
        &remote_notif("g", &["b", "c"]),
        t0,
        LEASE,
        pool_alloc(&recv_pool),
    );
    let read = reply.read.unwrap();
    assert!(ks.sweep(t0 + LEASE - S).done.is_empty());
    let report = ks.sweep(t0 + LEASE);
    assert_eq!(report.done.len(), 1);
    let mut failed = report.failed_reads.clone();
    failed.sort();
    assert_eq!(failed, keys(&["b", "c"]));
    // The shell's read handle still holds the pages until it lets go.
    assert_eq!(stats(&recv_pool).0, 2);
    drop(read);
    assert!(ks.on_read_complete("g", true).is_none());
    assert!(ks.is_empty());
    assert_eq!(ks.counters().failed_reads, 3);
    assert_idle(&recv_pool);

    // Nothing new to read: the Done rides with the reply, after the ack.
    ks.on_alloc_request(&alloc_request(&["x"], 4), "s", t0, pool_alloc(&recv_pool));
    let reply = ks.on_pull_eager(
        &remote_notif("h", &["x"]),
        t0,
        LEASE,
        pool_alloc(&recv_pool),
    );
    assert_eq!(reply.ack.already_sent_indexes, vec![0]);
    assert!(reply.read.is_none());
    assert_eq!(reply.done.len(), 1);
    ks.remove("x");
    // Alloc failure in eager mode: ack says so, nothing kept.
    let small = pool(1);
    let reply = ks.on_pull_eager(
        &remote_notif("i", &["y", "z"]),
        t0,
        LEASE,
        pool_alloc(&small),
    );
    assert!(reply.ack.alloc_failed && reply.read.is_none());
    assert!(ks.is_empty());
    assert_idle(&small);
    assert_idle(&recv_pool);
}

#[test]
fn pull_delay_lookups_and_pins_do_not_consume_proxies() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let reply = ks.on_pull_delay(&remote_notif("d", &["a", "b"]), t0, LEASE);
    assert_eq!(reply.ack, ack(&[], false));
    assert!(reply.done.is_empty() && reply.read.is_none());
    // Many lookups: still there.
    for _ in 0..3 {
        match ks.get("a", t0) {
            Lookup::Proxy(p) => {
                assert_eq!(p.byte_len(), 16);
                assert_eq!(p.handle.pull_id, "d");
            }
            other => panic!("{other:?}"),
        }
    }
    let p = ks.begin_proxy_read("a", t0).unwrap();
    // Pinned for a read: still in the store, still a proxy, context untouched.
    assert_eq!(ks.state("a"), Some(KeyState::Proxy));
    assert_eq!(ks.context("d").unwrap().outstanding(), 2);
    // A failed pin (not a proxy / missing) changes nothing either.
    assert!(matches!(
        ks.begin_proxy_read("zz", t0),
        Err(ProxyReadError::Missing(_))
    ));
    assert!(ks
        .end_proxy_read(&p.handle, ReadOutcome::Consumed)
        .is_none());
    assert!(!ks.contains("a"));
    // A repeated end is harmless.
    assert!(ks
        .end_proxy_read(&p.handle, ReadOutcome::Consumed)
        .is_none());
    let c = ks.counters();
    assert_eq!(
        (c.proxies, c.proxies_outstanding, c.contexts_open),
        (1, 1, 1)
    );
    // Evicting the last proxy resolves the pull: exactly one Done.
    let removed = ks.remove("b").unwrap();
    assert_eq!(removed.state, KeyState::Proxy);
    assert!(removed.page.is_none());
    assert_eq!(removed.done.unwrap().signal.pull_id, "d");
    assert!(ks.context("d").is_none());
    assert_eq!(ks.counters().dones_emitted, 1);
    assert_eq!(ks.counters().contexts_open, 0);
}

#[test]
fn pull_delay_done_exactly_once_across_consume_discard_mixes() {
    let t0 = Instant::now();
    let names = ["k0", "k1", "k2", "k3"];
    for mask in 0..16u32 {
        let mut ks = receiver();
        let id = format!("pull{mask}");
        ks.on_pull_delay(&remote_notif(&id, &names), t0, LEASE);
        let mut dones = 0;
        for (i, k) in names.iter().enumerate() {
            let d = if mask & (1 << i) != 0 {
                let p = ks.begin_proxy_read(k, t0).unwrap();
                let outcome = if i % 2 == 0 {
                    ReadOutcome::Consumed
                } else {
                    ReadOutcome::Failed
                };
                let d = ks.end_proxy_read(&p.handle, outcome);
                // Repeats never emit a second Done.
                assert!(ks
                    .end_proxy_read(&p.handle, ReadOutcome::Consumed)
                    .is_none());
                d
            } else {
                ks.remove(k).unwrap().done
            };
            dones += d.iter().count();
            assert!(ks.remove(k).is_none());
        }
        assert_eq!(dones, 1, "mask {mask}");
        assert!(ks.is_empty());
        assert!(ks.sweep(t0 + LEASE * 2).done.is_empty());
        assert_eq!(ks.counters().dones_emitted, 1);
    }
}

#[test]
fn eviction_during_a_proxy_read_defers_the_done() {
    let t0 = Instant::now();
    let mut ks = receiver();
    ks.on_pull_delay(&remote_notif("d", &["a"]), t0, LEASE);
    let p = ks.begin_proxy_read("a", t0).unwrap();
    // Evicted while the read is in flight: gone from the store, but no Done
    // (the sender must keep its pages until the read ends).
    let removed = ks.remove("a").unwrap();
    assert!(removed.done.is_none());
    assert!(!ks.contains("a"));
    assert_eq!(ks.counters().proxies_outstanding, 1);
    let done = ks.end_proxy_read(&p.handle, ReadOutcome::Consumed).unwrap();
    assert_eq!(done.signal.pull_id, "d");
    assert_eq!(ks.counters().contexts_open, 0);
}

#[test]
fn proxies_past_the_lease_are_expired_never_read() {
    let t0 = Instant::now();
    let mut ks = receiver();
    let margin = ks.config().lease_read_margin;
    ks.on_pull_delay(&remote_notif("d", &["a", "b", "c"]), t0, LEASE);
    let b = ks.begin_proxy_read("b", t0).unwrap();
    let c = ks.begin_proxy_read("c", t0).unwrap();
    assert!(ks
        .end_proxy_read(&c.handle, ReadOutcome::Consumed)
        .is_none());
    // Within the read margin before the lease: reported expired, pins refused.
    let edge = t0 + LEASE - margin;
    assert!(matches!(
        ks.get("a", edge - Duration::from_millis(1)),
        Lookup::Proxy(_)
    ));
    assert!(matches!(ks.get("a", edge), Lookup::Expired));
    assert!(matches!(
        ks.begin_proxy_read("a", edge),
        Err(ProxyReadError::LeaseExpired(_))
    ));
    // Sweep at the lease: "a" discarded; "b" is mid-read, so no Done yet.
    let report = ks.sweep(t0 + LEASE);
    assert_eq!(report.expired_proxies, keys(&["a", "b"]));
    assert!(report.done.is_empty());
    assert!(ks.is_empty());
    // A second sweep does not count them again.
    assert!(ks.sweep(t0 + LEASE + S).expired_proxies.is_empty());
    let done = ks.end_proxy_read(&b.handle, ReadOutcome::Failed).unwrap();
    assert_eq!(done.signal.pull_id, "d");
    let c = ks.counters();
    assert_eq!(
        (c.expired_proxies, c.dones_emitted, c.contexts_open),
        (2, 1, 0)
    );
}

#[test]
fn expired_proxy_is_replaced_by_a_new_message_for_its_key() {
    let t0 = Instant::now();
    let pool = pool(2);
    let mut ks = receiver();
    ks.on_pull_delay(&remote_notif("old", &["a"]), t0, LEASE);
    // Before the sweep ran, a push for "a" arrives after the lease.
    let reply = ks.on_alloc_request(
        &alloc_request(&["a"], 4),
        "s",
        t0 + LEASE,
        pool_alloc(&pool),
    );
    assert!(reply.response.already_sent_indexes.is_empty());
    assert_eq!(reply.response.remote_indexes.len(), 1);
    assert_eq!(reply.done.len(), 1);
    assert_eq!(reply.done[0].signal.pull_id, "old");
    assert_eq!(ks.state("a"), Some(KeyState::PendingPush));
    assert!(ks.context("old").is_none());
    ks.remove("a");
    assert_idle(&pool);
}

#[test]
fn pull_delay_rejects_a_reused_pull_id_and_empty_pulls_are_done_at_once() {
    let t0 = Instant::now();
    let mut ks = receiver();
    ks.on_pull_delay(&remote_notif("d", &["a"]), t0, LEASE);
    let reply = ks.on_pull_delay(&remote_notif("d", &["b"]), t0, LEASE);
    assert!(reply.ack.alloc_failed);
    assert!(reply
        .verdict
        .to_string_lossy()
        .contains("PullReadyNotif.pull_id: \"d\" is already in use"));
    assert!(!ks.contains("b"));
    // Every key already present: no context, Done right after the ack.
    let reply = ks.on_pull_delay(&remote_notif("e", &["a"]), t0, LEASE);
    assert_eq!(reply.ack.already_sent_indexes, vec![0]);
    assert_eq!(reply.done.len(), 1);
    assert!(ks.context("e").is_none());
    assert_eq!(ks.counters().contexts_open, 1);
}

// ============================================================ both sides

/// One pull-eager transfer between a sender core and a receiver core, with
/// the receiver's Done overtaking its ack, and an alloc failure that opens
/// the breaker.
#[test]
fn sender_and_receiver_cores_pull_eager_end_to_end() {
    let t0 = Instant::now();
    let sender_pool = pool(10);
    let recv_pool = pool(3);
    let mut pp = pending();
    let mut breaker = CircuitBreaker::new();
    let bp = Backpressure::new(sender_pool.stats().total, 20.0);
    assert_eq!(bp.high_water(), 8);
    let mut ks = receiver();
    let peer = "decode:7400";

    // Pull 1: two chunks.
    assert!(breaker.allows(peer, t0));
    assert_eq!(bp.check(pp.pinned_pages(), 2), Admission::Admit);
    let pages = alloc(&sender_pool, 2);
    let n1 = notif("p1", &["a", "b"], &pages);
    pp.insert("p1", peer, "req1", pages, t0, LEASE).unwrap();
    let reply = ks.on_pull_eager(&n1, t0, LEASE, pool_alloc(&recv_pool));
    let frame = reply.ack.encode();
    let read = reply.read.unwrap();
    // "Read": copy nothing, just complete.
    drop(read);
    let done = ks.on_read_complete("p1", true).unwrap();
    // Done overtakes the ack on the wire.
    let sig = PullDoneSignal::decode(&done.signal.encode()).unwrap();
    assert!(matches!(
        pp.on_done(&sig.pull_id, t0 + S),
        DoneOutcome::Released(_)
    ));
    let ack1 = PullReadyDoneAck::decode(&frame).unwrap();
    assert!(matches!(
        pp.on_ack("p1", &ack1, t0 + S),
        AckOutcome::AlreadyReleased { .. }
    ));
    assert_idle(&sender_pool);
    assert_eq!(stats(&recv_pool), (2, 0));

    // Pull 2: "a" is already there, "c" and "d" need 2 pages, the receiver has 1.
    let pages = alloc(&sender_pool, 3);
    let n2 = notif("p2", &["a", "c", "d"], &pages);
    pp.insert("p2", peer, "req2", pages, t0 + 2 * S, LEASE)
        .unwrap();
    assert_eq!(bp.check(pp.pinned_pages(), 6), Admission::Wait);
    assert_eq!(bp.check(pp.pinned_pages(), 9), Admission::TooLarge);
    let reply = ks.on_pull_eager(&n2, t0 + 2 * S, LEASE, pool_alloc(&recv_pool));
    assert!(reply.ack.alloc_failed);
    let out = pp.on_ack("p2", &reply.ack, t0 + 2 * S);
    assert!(out.opens_breaker());
    drop(out);
    breaker.open(peer, t0 + 2 * S, Duration::from_secs(2));
    assert_idle(&sender_pool);
    assert!(!breaker.allows(peer, t0 + 3 * S));
    assert!(breaker.allows(peer, t0 + 4 * S));
    // The receiver kept only pull 1's keys.
    assert_eq!(ks.len(), 2);
    assert_eq!(stats(&recv_pool), (2, 0));
    ks.remove("a");
    ks.remove("b");
    assert_idle(&recv_pool);
}
