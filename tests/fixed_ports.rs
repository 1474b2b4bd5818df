//! Every port chosen by the operator: a prefill and a decode over the tcp
//! channel, in pull-eager mode, with every listener placed by
//! `pd_base_port` (the decode's query socket by its own key), bound on all
//! interfaces (`pd_bind_host: 0.0.0.0`) and advertised as loopback. A
//! request's bytes arrive whole, and the process's listening sockets
//! (read from `/proc`) are exactly the configured ports: nothing listens
//! on a port the operator did not choose.
//!
//! This file holds one test so no other test's sockets share the process.

mod common;

use ascend_pd::config::{ChannelKind, PortList, TransferMode, PORT_STRIDE};
use ascend_pd::kv::{KvCache, KvCacheSpec};
use ascend_pd::memory::pattern;
use ascend_pd::requests::{
    Availability, LoadQueue, LoadRequest, Outcome, SaveQueue, SaveRequest, SharedKvCache,
};
use ascend_pd::{Receiver, Sender};
use common::*;
use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::Duration;

const TOKENS: usize = 2 * CHUNK + 3;
const BLOCK: usize = 16;

/// A base whose whole block (both roles, rank 0) binds now.
fn free_base() -> u16 {
    for _ in 0..200 {
        let base = free_port();
        if base.checked_add(PORT_STRIDE).is_none() {
            continue;
        }
        let all_free = (0..PORT_STRIDE).all(|i| {
            std::net::TcpListener::bind(("0.0.0.0", base + i)).is_ok()
                && std::net::TcpListener::bind(("127.0.0.1", base + i)).is_ok()
        });
        if all_free {
            return base;
        }
    }
    panic!("no block of {PORT_STRIDE} free ports found");
}

/// The TCP ports this process listens on, from `/proc/net/tcp{,6}` and
/// the sockets among its own file descriptors; each must be bound on all
/// interfaces.
fn listening_ports() -> BTreeSet<u16> {
    let mut ours = BTreeSet::new();
    for fd in std::fs::read_dir("/proc/self/fd").unwrap().flatten() {
        if let Ok(target) = std::fs::read_link(fd.path()) {
            let t = target.to_string_lossy().to_string();
            if let Some(inode) = t.strip_prefix("socket:[").and_then(|s| s.strip_suffix(']')) {
                ours.insert(inode.to_string());
            }
        }
    }
    let mut ports = BTreeSet::new();
    for table in ["/proc/net/tcp", "/proc/net/tcp6"] {
        let Ok(text) = std::fs::read_to_string(table) else {
            continue;
        };
        for line in text.lines().skip(1) {
            let cols: Vec<&str> = line.split_whitespace().collect();
            // local_address, st (0A: LISTEN), inode.
            let (Some(local), Some(state), Some(inode)) = (cols.get(1), cols.get(3), cols.get(9))
            else {
                continue;
            };
            if *state != "0A" || !ours.contains(*inode) {
                continue;
            }
            let (addr, port) = local.rsplit_once(':').unwrap();
            // pd_bind_host: 0.0.0.0 (all zeros in either table).
            assert!(
                addr.bytes().all(|b| b == b'0'),
                "{table}: a listener bound {addr}, not 0.0.0.0 (pd_bind_host)"
            );
            ports.insert(u16::from_str_radix(port, 16).unwrap());
        }
    }
    ports
}

#[test]
fn a_pair_with_every_port_fixed_listens_on_those_ports_only() {
    let before = listening_ports();
    assert!(
        before.is_empty(),
        "the test process already listens: {before:?}"
    );
    let base = free_base();
    // Its own key, outside the base's block.
    let query = std::iter::repeat_with(free_port)
        .find(|p| !(base..base + PORT_STRIDE).contains(p))
        .unwrap();
    let mut rc = receiver_config(ChannelKind::Tcp, TransferMode::PullEager, 16);
    let mut sc = sender_config(ChannelKind::Tcp, TransferMode::PullEager, 16);
    rc.peer_init_port = None;
    rc.peer_alloc_port = None;
    rc.peer_query_port = Some(PortList::Single(query));
    sc.pull_done_port = None;
    for c in [&mut rc, &mut sc] {
        c.base_port = Some(base);
        c.bind_host = Some("0.0.0.0".into());
        c.peer_host = Some("127.0.0.1".into());
        c.validate().unwrap();
    }
    // The table the configs promise (what check-config prints).
    let mut want: BTreeSet<u16> = BTreeSet::new();
    for c in [&rc, &sc] {
        for (listener, port) in c.port_table(0) {
            assert_ne!(port, 0, "{listener:?} has no fixed port");
            assert!(want.insert(port), "{listener:?} shares port {port}");
        }
    }
    assert_eq!(
        want,
        [
            base,
            base + 1,
            query,
            base + 3,
            base + 10,
            base + 11,
            base + 13
        ]
        .into_iter()
        .collect(),
        "receiver: init, alloc, query, data; sender: done, register, data"
    );

    let receiver = Arc::new(Receiver::start(&rc, 0).unwrap());
    let sender = Arc::new(Sender::start(&sc, 0, Default::default()).unwrap());
    let saves = SaveQueue::new(Arc::clone(&sender)).unwrap();
    let loads = LoadQueue::new(Arc::clone(&receiver)).unwrap();
    assert_eq!(saves.register_port(), base + 11);

    // One request through the pair: the receiver reaches the sender's tcp
    // server at the advertised address, and every byte arrives.
    let spec = KvCacheSpec::for_layout(&sc.chunk_layout(), 8, BLOCK);
    let prefill = SharedKvCache::new(KvCache::host(spec).unwrap());
    {
        let mut c = prefill.lock();
        let mut plane = vec![0u8; spec.plane_bytes()];
        for l in 0..spec.layers {
            for p in 0..spec.planes() {
                pattern::fill(&mut plane, (l * 7 + p + 1) as u64);
                c.write(spec.offset(l, p, 0), &plane).unwrap();
            }
        }
    }
    let keys: Vec<String> = (0..TOKENS.div_ceil(CHUNK))
        .map(|i| format!("fixed@{i}"))
        .collect();
    let to = ascend_pd::backend::TransferSpec {
        req_id: "fixed".into(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: PortList::Single(rc.init_port(0).unwrap()),
        receiver_alloc_port: PortList::Single(rc.alloc_port(0).unwrap()),
        is_last_prefill: true,
        receiver_rank: None,
    };
    saves
        .submit(
            SaveRequest {
                keys: keys.clone(),
                slot_mapping: (0..TOKENS as i64).collect(),
                spec: to,
            },
            &prefill,
        )
        .unwrap();
    assert!(
        eventually(Duration::from_secs(30), || loads.available(&keys)
            == Availability::Ready),
        "never loadable"
    );
    // Every listener is up now: the set is exactly the table.
    assert_eq!(
        listening_ports(),
        want,
        "listening sockets vs the port table"
    );
    let decode = SharedKvCache::new(KvCache::host(spec).unwrap());
    let slots: Vec<i64> = (0..TOKENS).map(|t| (spec.slots() - 1 - t) as i64).collect();
    loads
        .submit(
            LoadRequest {
                req_id: "fixed".into(),
                keys: keys.clone(),
                slot_mapping: slots.clone(),
            },
            &decode,
        )
        .unwrap();
    let got = poll_until(|| loads.poll(), 1);
    assert_eq!(got[0].outcome, Outcome::Done, "{got:?}");
    let done = poll_until(|| saves.poll(), 1);
    assert_eq!(done[0].outcome, Outcome::Done, "{done:?}");
    {
        let (mut src, mut dst) = (prefill.lock(), decode.lock());
        for l in 0..spec.layers {
            for p in 0..spec.planes() {
                for (t, slot) in slots.iter().enumerate() {
                    assert_eq!(
                        src.token(l, p, t).unwrap(),
                        dst.token(l, p, *slot as usize).unwrap(),
                        "token {t} layer {l} plane {p}"
                    );
                }
            }
        }
    }
    assert_eq!(listening_ports(), want, "after the transfer");
    assert!(sender.drain(Duration::from_secs(30)));
    assert_no_pages_left(&receiver, &sender);
}

fn assert_no_pages_left(receiver: &Receiver, sender: &Sender) {
    assert!(
        eventually(Duration::from_secs(30), || {
            let s = receiver.stats().pools.cpu.unwrap();
            s.free == s.total && s.pinned == 0 && s.quarantined == 0
        }),
        "receiver pool {:?}",
        receiver.stats().pools
    );
    let s = sender.stats().pools.cpu.unwrap();
    assert!(
        s.free == s.total && s.pinned == 0 && s.quarantined == 0,
        "sender pool {s:?}"
    );
}
