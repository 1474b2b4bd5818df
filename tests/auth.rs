//! The deployment secret (issue 11): peers prove it in the channel
//! handshake and on every tcp transfer connection; a wrong or missing
//! secret fails on both sides with an error naming `pd_auth_secret_file`,
//! refusals never carry the buffer table, and a tcp client acts only as
//! the node it proved, under that node's grants. Real sockets on loopback.

mod common;

use ascend_pd::auth::{Secret, SECRET_KEY};
use ascend_pd::backend::{PutOutcome, Receiver, Sender};
use ascend_pd::channel::handshake::{self, HandshakeEvent, HandshakeServer, Hello};
use ascend_pd::channel::{
    self as chan, Access, ChannelError, GrantTag, PeerId, ReadOp, TransferChannel, WriteOp,
};
use ascend_pd::config::{ChannelKind, Role, TransferMode};
use ascend_pd::layout::{ChunkLayout, Dtype, MemFormat};
use ascend_pd::memory::{pattern, BufferRef, ChunkMeta, MemObj, PagePool, RegisteredBuffer};
use common::*;
use std::sync::Arc;
use std::time::Duration;

const PAGE: usize = 4096;
const PAGES: usize = 4;

fn secret(byte: u8) -> Secret {
    Secret::from_bytes(&[byte; 32]).unwrap()
}

fn layout() -> ChunkLayout {
    ChunkLayout {
        fmt: MemFormat::Kv2Ltd,
        layers: 1,
        tokens: 1,
        hidden: PAGE / 4,
        dtype: Dtype::BFloat16,
    }
}

struct Side {
    pool: Arc<PagePool>,
    channel: Arc<dyn TransferChannel>,
}

fn side(kind: ChannelKind, node: &str, auth: Option<Secret>) -> Side {
    let buf = RegisteredBuffer::host(PAGES * PAGE, PAGE, kind == ChannelKind::Shm).unwrap();
    let pool = PagePool::new(buf);
    let channel = chan::open(kind, "127.0.0.1", node, &[Arc::clone(&pool)], auth).unwrap();
    Side { pool, channel }
}

/// A listening side whose pages are all granted (read and write) to
/// whoever attaches; its handshake events come out of the receiver.
struct Listener {
    side: Side,
    server: HandshakeServer,
    events: crossbeam_channel::Receiver<HandshakeEvent>,
    _ctx: zmq::Context,
    _pages: Vec<MemObj>,
}

fn listen(kind: ChannelKind, auth: Option<Secret>) -> Listener {
    let side = side(kind, "listener", auth);
    let mut pages = side
        .pool
        .allocate_batch(&[ChunkMeta::full(layout()); PAGES])
        .unwrap();
    for (i, p) in pages.iter_mut().enumerate() {
        pattern::fill(p.host_bytes_mut().unwrap(), i as u64);
    }
    let refs: Vec<BufferRef> = pages.iter().map(|p| p.buffer_ref()).collect();
    let ctx = zmq::Context::new();
    let (tx, events) = crossbeam_channel::unbounded();
    let hello = Hello::local(
        "listener",
        Role::Receiver,
        TransferMode::Push,
        Duration::from_secs(60),
        side.channel.as_ref(),
    );
    let granting = Arc::clone(&side.channel);
    let server = HandshakeServer::spawn_with(
        &ctx,
        "tcp://127.0.0.1:*",
        Arc::clone(&side.channel),
        hello,
        tx,
        Box::new(move |a| {
            granting
                .grant(a.peer, Access::ReadWrite, GrantTag::UNTAGGED, &refs)
                .map(|_| ())
        }),
    )
    .unwrap();
    Listener {
        side,
        server,
        events,
        _ctx: ctx,
        _pages: pages,
    }
}

fn connect(l: &Listener, s: &Side, node: &str) -> Result<handshake::Agreement, ChannelError> {
    let ctx = zmq::Context::new();
    let hello = Hello::local(
        node,
        Role::Sender,
        TransferMode::Push,
        Duration::from_secs(60),
        s.channel.as_ref(),
    );
    handshake::connect(
        &ctx,
        l.server.url(),
        s.channel.as_ref(),
        &hello,
        Duration::from_secs(10),
    )
}

fn next_event(l: &Listener) -> HandshakeEvent {
    l.events
        .recv_timeout(Duration::from_secs(10))
        .expect("the listener reports every handshake")
}

/// Reads the listener's page `page` into one of ours; the bytes it holds.
fn read_page(s: &Side, peer: PeerId, remote: BufferRef) -> Result<MemObj, ChannelError> {
    let page = s
        .pool
        .allocate_batch(&[ChunkMeta::full(layout())])
        .unwrap()
        .remove(0);
    let mut back = s.channel.read(peer, vec![ReadOp::chunk(page, remote)])?;
    Ok(back.remove(0))
}

#[test]
fn the_same_secret_on_both_sides_attaches_and_moves_every_byte() {
    for kind in [ChannelKind::Tcp, ChannelKind::Shm] {
        let l = listen(kind, Some(secret(1)));
        let s = side(kind, "sender", Some(secret(1)));
        let a = connect(&l, &s, "sender").unwrap();
        assert!(matches!(next_event(&l), HandshakeEvent::Attached(_)));
        let uuid = a.remote.buffers[0].uuid;
        let got = read_page(&s, a.peer, BufferRef { uuid, page: 2 }).unwrap();
        assert_eq!(
            pattern::first_mismatch(got.host_bytes().unwrap(), 2),
            None,
            "{kind:?}"
        );
        // And a write, verified on the far side by reading it back.
        let mut mine = got;
        pattern::fill(mine.host_bytes_mut().unwrap(), 99);
        let to = BufferRef { uuid, page: 1 };
        s.channel
            .write(
                a.peer,
                GrantTag::UNTAGGED,
                vec![WriteOp::chunk(mine.seal(), to)],
            )
            .unwrap();
        let back = read_page(&s, a.peer, to).unwrap();
        assert_eq!(
            pattern::first_mismatch(back.host_bytes().unwrap(), 99),
            None
        );
        assert_eq!(l.side.channel.grant_stats().unauthenticated, 0);
    }
}

#[test]
fn a_wrong_secret_fails_on_both_sides_naming_the_key() {
    let l = listen(ChannelKind::Tcp, Some(secret(1)));
    let s = side(ChannelKind::Tcp, "sender", Some(secret(2)));
    let e = connect(&l, &s, "sender").unwrap_err().to_string();
    assert!(e.contains(SECRET_KEY) && e.contains("differs"), "{e}");
    match next_event(&l) {
        HandshakeEvent::Refused { error, .. } => {
            let e = error.to_string();
            assert!(e.contains(SECRET_KEY), "{e}");
        }
        other => panic!("{other:?}"),
    }
}

#[test]
fn a_secret_on_one_side_only_is_refused_both_ways_naming_the_key() {
    // The listener requires it; the connecting side has none.
    let l = listen(ChannelKind::Tcp, Some(secret(1)));
    let s = side(ChannelKind::Tcp, "sender", None);
    let e = connect(&l, &s, "sender").unwrap_err().to_string();
    assert!(e.contains(SECRET_KEY) && e.contains("requires"), "{e}");
    assert!(matches!(
        next_event(&l),
        HandshakeEvent::Refused { node: None, .. }
    ));
    // The connecting side has one; the listener runs without.
    let l = listen(ChannelKind::Tcp, None);
    let s = side(ChannelKind::Tcp, "sender", Some(secret(1)));
    let e = connect(&l, &s, "sender").unwrap_err().to_string();
    assert!(e.contains(SECRET_KEY) && e.contains("without"), "{e}");
    match next_event(&l) {
        HandshakeEvent::Refused { error, .. } => {
            assert!(error.to_string().contains(SECRET_KEY), "{error}")
        }
        other => panic!("{other:?}"),
    }
}

/// Someone who learnt the table and the transfer address (say, by watching
/// the network) and skips the handshake: the tcp server refuses the
/// connection before serving anything, and counts it.
#[test]
fn a_tcp_client_without_the_secret_cannot_reach_a_page() {
    let l = listen(ChannelKind::Tcp, Some(secret(1)));
    let s = side(ChannelKind::Tcp, "sender", Some(secret(1)));
    let a = connect(&l, &s, "sender").unwrap();
    let uuid = a.remote.buffers[0].uuid;
    for (name, auth) in [("no-secret", None), ("wrong-secret", Some(secret(3)))] {
        // Posing as the node that holds the grants.
        let intruder = side(ChannelKind::Tcp, "sender", auth);
        let peer = intruder
            .channel
            .attach("listener", &a.remote.buffers, &a.remote.endpoint)
            .unwrap();
        let e = read_page(&intruder, peer, BufferRef { uuid, page: 0 })
            .unwrap_err()
            .to_string();
        assert!(e.contains(SECRET_KEY), "{name}: {e}");
    }
    // The client gives up as soon as the server's answer shows it cannot
    // authenticate; the server counts the refusal when its read of the
    // missing proof ends, on its own thread, a moment later.
    assert!(
        eventually(Duration::from_secs(10), || l
            .side
            .channel
            .grant_stats()
            .unauthenticated
            == 2),
        "{:?}",
        l.side.channel.grant_stats()
    );
    // The real peer is still served.
    assert!(read_page(&s, a.peer, BufferRef { uuid, page: 0 }).is_ok());
}

/// A client that proved the secret as node A is served only under A's
/// grants: pages granted to B stay out of its reach.
#[test]
fn an_authenticated_tcp_client_reaches_only_its_own_grants() {
    let secret = secret(1);
    let owner = side(ChannelKind::Tcp, "owner", Some(secret.clone()));
    let mut pages = owner
        .pool
        .allocate_batch(&[ChunkMeta::full(layout()); 2])
        .unwrap();
    for (i, p) in pages.iter_mut().enumerate() {
        pattern::fill(p.host_bytes_mut().unwrap(), 10 + i as u64);
    }
    let table = owner.channel.local_table();
    let endpoint = owner.channel.endpoint();
    // The owner grants page 0 to A and page 1 to B (as a handshake would).
    let (a, b) = (
        side(ChannelKind::Tcp, "node-a", Some(secret.clone())),
        side(ChannelKind::Tcp, "node-b", Some(secret.clone())),
    );
    let a_at_owner = owner
        .channel
        .attach("node-a", &a.channel.local_table(), &a.channel.endpoint())
        .unwrap();
    let b_at_owner = owner
        .channel
        .attach("node-b", &b.channel.local_table(), &b.channel.endpoint())
        .unwrap();
    let r0 = pages[0].buffer_ref();
    let r1 = pages[1].buffer_ref();
    owner
        .channel
        .grant(a_at_owner, Access::Read, GrantTag::UNTAGGED, &[r0])
        .unwrap();
    owner
        .channel
        .grant(b_at_owner, Access::Read, GrantTag::UNTAGGED, &[r1])
        .unwrap();
    let a_peer = a.channel.attach("owner", &table, &endpoint).unwrap();
    let b_peer = b.channel.attach("owner", &table, &endpoint).unwrap();
    let got = read_page(&a, a_peer, r0).unwrap();
    assert_eq!(pattern::first_mismatch(got.host_bytes().unwrap(), 10), None);
    let e = read_page(&a, a_peer, r1).unwrap_err().to_string();
    assert!(e.contains("refused") && e.contains("node-a"), "{e}");
    let got = read_page(&b, b_peer, r1).unwrap();
    assert_eq!(pattern::first_mismatch(got.host_bytes().unwrap(), 11), None);
    let st = owner.channel.grant_stats();
    assert_eq!((st.refused, st.unauthenticated), (1, 0));
    drop(pages);
}

/// The backend end to end: both workers read the secret from their
/// config's file (or the environment), and a push lands every byte; a
/// sender with another secret fails its put with an error naming the key,
/// and the receiver's pools are untouched.
#[test]
fn workers_with_the_same_secret_file_push_and_a_stranger_is_refused() {
    let dir = std::env::temp_dir().join(format!("apd-auth-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let (good, bad) = (dir.join("good"), dir.join("bad"));
    std::fs::write(&good, "a deployment secret of some length\n").unwrap();
    std::fs::write(&bad, "another secret, not the deployment's\n").unwrap();
    let mut rc = receiver_config(ChannelKind::Tcp, TransferMode::Push, 8);
    rc.auth_secret_file = Some(good.clone());
    let r = Receiver::start(&rc, 0).unwrap();
    let mut sc = sender_config(ChannelKind::Tcp, TransferMode::Push, 8);
    sc.auth_secret_file = Some(good);
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    let ks = keys("authed", 3);
    let c = chunks(&s, &ks, CHUNK);
    let out = s.put(&ks, &c, &spec_for(&rc, "authed", false)).unwrap();
    assert!(
        matches!(out, PutOutcome::Pushed { written: 3, .. }),
        "{out:?}"
    );
    for k in &ks {
        let got = r.get_wait(k, Duration::from_secs(10)).expect(k);
        assert!(holds(&got, k), "{k}");
    }

    let mut stranger = sender_config(ChannelKind::Tcp, TransferMode::Push, 8);
    stranger.auth_secret_file = Some(bad);
    let st = Sender::start(&stranger, 0, Default::default()).unwrap();
    let ks2 = keys("stranger", 2);
    let c2 = chunks(&st, &ks2, CHUNK);
    let e = st
        .put(&ks2, &c2, &spec_for(&rc, "stranger", false))
        .unwrap_err()
        .to_string();
    assert!(e.contains(SECRET_KEY), "{e}");
    assert!(!r.contains(&ks2[0]));
    drop((c, c2));
    for k in &ks {
        assert!(r.remove(k));
    }
    assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// The tcp transfer server serves at most `max_server_connections` at once
/// (a thread each): connections inside a request cannot make it start
/// more; the next client is refused with a message naming the cap,
/// counted, and served once a slot is free.
#[test]
fn the_tcp_server_refuses_connections_over_its_cap_by_name_and_recovers() {
    use ascend_pd::channel::tcp::{TcpChannel, TcpOptions};
    let buf = RegisteredBuffer::host(PAGES * PAGE, PAGE, false).unwrap();
    let pool = PagePool::new(buf);
    let owner = TcpChannel::bind(
        "127.0.0.1",
        "owner",
        &[Arc::clone(&pool)],
        TcpOptions {
            max_server_connections: 3,
            ..TcpOptions::default()
        },
    )
    .unwrap();
    let mut page = pool.allocate_batch(&[ChunkMeta::full(layout())]).unwrap();
    pattern::fill(page[0].host_bytes_mut().unwrap(), 77);
    let r0 = page[0].buffer_ref();
    let a = side(ChannelKind::Tcp, "node-a", None);
    let a_at_owner = owner
        .attach("node-a", &a.channel.local_table(), &a.channel.endpoint())
        .unwrap();
    owner
        .grant(a_at_owner, Access::Read, GrantTag::UNTAGGED, &[r0])
        .unwrap();
    // Three connections inside a request (half a header sent) take every
    // slot: idle connections would give theirs up to a new client.
    let squatters: Vec<std::net::TcpStream> = (0..3)
        .map(|_| {
            use std::io::{Read, Write};
            let mut c = std::net::TcpStream::connect(owner.local_addr()).unwrap();
            c.write_all(&chan::tcp::fuzzing::hello("squatter", [1; 16]))
                .unwrap();
            let mut answer = [0u8; 5];
            c.read_exact(&mut answer).unwrap();
            c.write_all(b"APD").unwrap();
            c
        })
        .collect();
    // Each squatter counts as inside a request once its server thread has
    // read its first byte (before that it is idle, and evictable).
    assert!(eventually(Duration::from_secs(20), || owner
        .served_connections()
        == (0, 3)));
    let peer = a
        .channel
        .attach("owner", &owner.local_table(), &owner.endpoint())
        .unwrap();
    let e = read_page(&a, peer, r0).unwrap_err().to_string();
    assert!(
        e.contains("maximum of connections") && e.contains("max_server_connections"),
        "{e}"
    );
    assert!(owner.grant_stats().busy >= 1);
    // Their slots come back when they go; the client is then served.
    drop(squatters);
    assert!(eventually(Duration::from_secs(10), || read_page(
        &a, peer, r0
    )
    .is_ok_and(|got| pattern::first_mismatch(
        got.host_bytes().unwrap(),
        77
    )
    .is_none())));
    drop(page);
}

/// A client that trickles its connection hello a byte at a time cannot
/// hold a serving slot: the hello (and proof) must come whole within 5 s,
/// however often bytes arrive, or the server answers with the reason and
/// closes.
#[test]
fn a_tcp_client_trickling_its_hello_is_cut_off() {
    use ascend_pd::channel::tcp::{TcpChannel, TcpOptions};
    use std::io::{Read, Write};
    let buf = RegisteredBuffer::host(PAGES * PAGE, PAGE, false).unwrap();
    let owner = TcpChannel::bind(
        "127.0.0.1",
        "owner",
        &[PagePool::new(buf)],
        TcpOptions::default(),
    )
    .unwrap();
    let mut c = std::net::TcpStream::connect(owner.local_addr()).unwrap();
    c.set_read_timeout(Some(Duration::from_millis(1))).unwrap();
    // A hello announcing a 1000-byte node id: 1022 bytes in all, one
    // every 50 ms would take 51 s.
    let mut hello = b"APDH".to_vec();
    hello.extend_from_slice(&1000u16.to_le_bytes());
    hello.extend(std::iter::repeat_n(b'n', 1000));
    hello.extend_from_slice(&[0u8; 16]);
    let start = std::time::Instant::now();
    let mut answer = Vec::new();
    for b in &hello {
        if c.write_all(&[*b]).is_err() {
            break;
        }
        let mut got = [0u8; 256];
        match c.read(&mut got) {
            Ok(0) => break,
            Ok(n) => answer.extend_from_slice(&got[..n]),
            Err(_) => {}
        }
        if !answer.is_empty() && answer.len() >= 8 {
            break;
        }
        std::thread::sleep(Duration::from_millis(50));
    }
    assert!(
        start.elapsed() < Duration::from_secs(30),
        "the server waited for the whole trickle"
    );
    c.set_read_timeout(Some(Duration::from_secs(2))).unwrap();
    let _ = c.read_to_end(&mut answer);
    assert_eq!(answer.first(), Some(&1), "an error reply: {answer:?}");
    let text = String::from_utf8_lossy(&answer[8..]);
    assert!(text.contains("too long"), "{text}");
}
