//! Upstream LMCache's newer messages from a real upstream-style peer: a
//! Python msgspec + pyzmq client (tests/python/upstream_peer.py) sends a
//! `CacheQueryRequest` (on the allocation socket and on
//! `pd_peer_query_port`) and an async-style `AllocRequest` to a real
//! `ascend-bench receiver` process holding two keys, and checks the
//! replies and the receiver's message counters.

mod common;

use ascend_pd::config::{ChannelKind, PortList, TransferMode};
use ascend_pd::Sender;
use common::*;
use std::io::{BufRead, BufReader};
use std::path::PathBuf;
use std::process::{Command, Stdio};

#[test]
fn a_msgspec_peer_gets_cache_query_and_async_alloc_replies_from_a_receiver_process() {
    // The project's test environment has msgspec and pyzmq.
    let py = python();
    let mode = TransferMode::Push;
    let mut rc = receiver_config(ChannelKind::Shm, mode, 16);
    let query = free_port();
    rc.peer_query_port = Some(PortList::Single(query));
    let dir = std::env::temp_dir().join(format!("apd-upstream-peer-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let yaml = dir.join("receiver.yaml");
    std::fs::write(&yaml, rc.to_effective_yaml()).unwrap();
    let metrics = free_port();
    let mut recv = Command::new(env!("CARGO_BIN_EXE_ascend-bench"))
        .args(["receiver", "--config"])
        .arg(&yaml)
        .args(["--metrics-port", &metrics.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let mut out = BufReader::new(recv.stdout.take().unwrap());
    let mut line = String::new();
    out.read_line(&mut line).unwrap();
    assert!(line.contains("receiver_ready"), "{line}");

    // Two keys stored on the receiver (no ProxyNotif: they stay).
    let s = Sender::start(
        &sender_config(ChannelKind::Shm, mode, 16),
        0,
        Default::default(),
    )
    .unwrap();
    let k = keys("upstream-held", 2);
    let c = chunks(&s, &k, CHUNK);
    s.put(&k, &c, &spec_for(&rc, "held", false)).unwrap();
    drop(c);

    let script = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/python/upstream_peer.py");
    let alloc = rc.peer_alloc_port.clone().unwrap().for_rank(0).unwrap();
    let peer = Command::new(&py)
        .arg(&script)
        .arg(alloc.to_string())
        .arg(metrics.to_string())
        // The put above sent one AllocRequest.
        .arg("1")
        .args(&k)
        .arg(query.to_string())
        .output()
        .unwrap();
    let _ = recv.kill();
    let _ = recv.wait();
    let _ = std::fs::remove_dir_all(&dir);
    let stdout = String::from_utf8_lossy(&peer.stdout);
    assert!(
        peer.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&peer.stderr)
    );
    assert!(stdout.contains("upstream peer: OK"), "{stdout}");
    assert_eq!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count(),
        10,
        "{stdout}"
    );
}
