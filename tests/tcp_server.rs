//! The tcp transfer server under peers that do not play along (issue 25,
//! items 7 and 8): a page's release waits for the reads still being sent
//! out of it, and connections that sit idle or trickle cannot keep a
//! legitimate client from being served. Real sockets on loopback, raw
//! clients speaking the wire format byte by byte.

mod common;

use ascend_pd::channel::tcp::{fuzzing, TcpChannel, TcpOptions};
use ascend_pd::channel::{Access, Endpoint, GrantTag, PeerId, TransferChannel};
use ascend_pd::layout::{ChunkLayout, Dtype, MemFormat};
use ascend_pd::memory::{pattern, ChunkMeta, PagePool, RegisteredBuffer};
use common::eventually;
use std::io::{Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::sync::Arc;
use std::time::Duration;

fn layout(page: usize) -> ChunkLayout {
    ChunkLayout {
        fmt: MemFormat::Kv2Ltd,
        layers: 1,
        tokens: 1,
        hidden: page / 4,
        dtype: Dtype::BFloat16,
    }
}

fn owner(page: usize, pages: usize, opts: TcpOptions) -> (Arc<PagePool>, TcpChannel) {
    let pool = PagePool::new(RegisteredBuffer::host(pages * page, page, false).unwrap());
    let ch = TcpChannel::bind("127.0.0.1", "owner", &[Arc::clone(&pool)], opts).unwrap();
    (pool, ch)
}

/// Attaches `node` at `owner` (its table and address do not matter: the
/// owner only serves it).
fn attach(owner: &TcpChannel, node: &str) -> PeerId {
    let nowhere = Endpoint::Tcp {
        addr: "127.0.0.1:9".into(),
    };
    owner.attach(node, &[], &nowhere).unwrap()
}

/// A raw client connection that said its hello as `node` and got the
/// open (no secret) answer.
fn hello(addr: SocketAddr, node: &str) -> TcpStream {
    let mut c = TcpStream::connect(addr).unwrap();
    c.set_read_timeout(Some(Duration::from_secs(30))).unwrap();
    c.write_all(&fuzzing::hello(node, [7; 16])).unwrap();
    let mut answer = [0u8; 5];
    c.read_exact(&mut answer).unwrap();
    assert_eq!(&answer, b"APDA\0", "the open answer");
    c
}

/// Item 7: the server kept sending a page out after `release` reported it
/// free, so the page could go to a new owner (who writes it) while its
/// bytes still went out to the old reader. A read in flight now counts
/// like a write: release says the page is not free, and the grant is
/// quiescent only once the read ended.
#[test]
fn releasing_a_page_while_a_tcp_read_of_it_is_in_flight_does_not_free_it() {
    // Far larger than what loopback socket buffers hold: the server is
    // still inside the page while the client does not read.
    const PAGE: usize = 64 << 20;
    let (pool, owner) = owner(PAGE, 1, TcpOptions::default());
    let mut page = pool.allocate(ChunkMeta::full(layout(PAGE))).unwrap();
    pattern::fill(page.host_bytes_mut().unwrap(), 5);
    let page = page.seal();
    let at = page.buffer_ref();
    let peer = attach(&owner, "reader");
    let grant = owner
        .grant(peer, Access::Read, GrantTag::UNTAGGED, &[at])
        .unwrap();
    let mut c = hello(owner.local_addr(), "reader");
    c.write_all(&fuzzing::request(false, at, 0, PAGE as u64, None))
        .unwrap();
    // The status-0 reply and the first bytes: the read is being served.
    let mut head = vec![0u8; 8 + 4096];
    c.read_exact(&mut head).unwrap();
    assert_eq!(head[0], 0, "status ok");
    assert!(pattern::first_mismatch(&head[8..], 5).is_none());

    assert!(
        !owner.release(grant),
        "release must not report the page free while a read is sent out of it"
    );
    assert!(!owner.is_quiescent(grant), "the read still runs");
    // The reader goes: the server's send fails, the read ends.
    drop(c);
    assert!(
        eventually(Duration::from_secs(30), || owner.is_quiescent(grant)),
        "the grant never settled after its read ended"
    );
    drop(page);
    let s = pool.stats();
    assert_eq!((s.allocated, s.quarantined), (0, 0), "{s:?}");
}

/// Item 8: a connection held a serving slot as long as it sent a byte
/// now and then (timeouts counted per read call), and an idle one until
/// its read timeout, so 256 of them kept every client out. Now a request
/// has one deadline in all, and at the cap a new client takes the slot of
/// the connection idle longest.
#[test]
fn a_legitimate_client_is_served_while_256_idle_and_trickling_connections_are_open() {
    const PAGE: usize = 4096;
    let opts = TcpOptions {
        // Short, so the tricklers' requests run out within the test.
        io_timeout: Duration::from_secs(2),
        ..TcpOptions::default()
    };
    assert_eq!(opts.max_server_connections, 256);
    let (pool, owner) = owner(PAGE, 1, opts.clone());
    let mut page = pool.allocate(ChunkMeta::full(layout(PAGE))).unwrap();
    pattern::fill(page.host_bytes_mut().unwrap(), 42);
    let page = page.seal();
    let at = page.buffer_ref();
    let addr = owner.local_addr();
    // 128 connections that said hello and then nothing ...
    let idle: Vec<TcpStream> = (0..128).map(|_| hello(addr, "idler")).collect();
    // ... and 128 that trickle a request, a byte at a time.
    let mut tricklers: Vec<TcpStream> = (0..128).map(|_| hello(addr, "trickler")).collect();
    let request = fuzzing::request(false, at, 0, PAGE as u64, None);
    for c in &mut tricklers {
        c.write_all(&request[..1]).unwrap();
    }
    let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
    let trickle = {
        let stop = Arc::clone(&stop);
        let mut conns: Vec<TcpStream> = tricklers.iter().map(|c| c.try_clone().unwrap()).collect();
        std::thread::spawn(move || {
            // One more header byte each, every 100 ms: each read call
            // makes progress, the request never completes.
            for i in 1..request.len() - 1 {
                if stop.load(std::sync::atomic::Ordering::Relaxed) {
                    break;
                }
                for c in &mut conns {
                    let _ = c.write_all(&request[i..i + 1]);
                }
                std::thread::sleep(Duration::from_millis(100));
            }
        })
    };

    // The legitimate client: a tcp channel granted the page.
    let client = TcpChannel::bind("127.0.0.1", "reader", &[], opts).unwrap();
    let peer_at_owner = owner
        .attach("reader", &client.local_table(), &client.endpoint())
        .unwrap();
    owner
        .grant(peer_at_owner, Access::Read, GrantTag::UNTAGGED, &[at])
        .unwrap();
    let peer = client
        .attach("owner", &owner.local_table(), &owner.endpoint())
        .unwrap();
    let dst = PagePool::new(RegisteredBuffer::host(PAGE, PAGE, false).unwrap());
    let obj = dst.allocate(ChunkMeta::full(layout(PAGE))).unwrap();
    let got = client
        .read(peer, vec![ascend_pd::channel::ReadOp::chunk(obj, at)])
        .expect("the legitimate client is served");
    assert!(pattern::first_mismatch(got[0].host_bytes().unwrap(), 42).is_none());
    assert_eq!(owner.grant_stats().busy, 0, "nobody was refused");

    // Every trickler is cut off at its request's deadline, whatever it sends.
    for (i, c) in tricklers.iter_mut().enumerate() {
        c.set_read_timeout(Some(Duration::from_secs(60))).unwrap();
        let mut rest = Vec::new();
        let cut = match c.read_to_end(&mut rest) {
            Ok(_) => true,
            Err(e) => !matches!(
                e.kind(),
                std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut
            ),
        };
        assert!(cut, "trickler {i} still held its slot");
        assert!(rest.is_empty(), "trickler {i} was served: {rest:?}");
    }
    stop.store(true, std::sync::atomic::Ordering::Relaxed);
    trickle.join().unwrap();
    drop((idle, got, page));
    assert_eq!(dst.stats().allocated, 0);
}
