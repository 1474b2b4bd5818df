//! Deadlock-free admission over real sockets: a handshaked writer sends
//! four requests of four chunks, each in two batches carrying upstream
//! LMCache's async fields (`req_id`, `total_chunks`, `is_last_batch`), to a
//! receiver with eight pages. Batch by batch, the four first batches take
//! every page and every second batch waits for pages that never come.
//! With reservations, two requests are admitted whole and complete, the
//! other two are refused at once (the receiver's page wait is 60 s here:
//! a parked request would time this test out), and every page comes back.

mod common;

use ascend_pd::channel::handshake::{self, Hello};
use ascend_pd::channel::{self as chan, TransferChannel};
use ascend_pd::config::{ChannelKind, Role, TransferMode};
use ascend_pd::memory::{BufferRef, PagePool, RegisteredBuffer};
use ascend_pd::protocol::{AllocRequest, AscendAllocResponse, Message, PushNotice, PushOutcome};
use ascend_pd::Receiver;
use common::*;
use std::sync::Arc;
use std::time::Duration;
use uuid::Uuid;

fn refs(resp: &AscendAllocResponse) -> Vec<BufferRef> {
    resp.remote_indexes
        .iter()
        .zip(&resp.remote_buffer_uuids)
        .map(|(&page, u)| BufferRef {
            uuid: Uuid::parse_str(u).unwrap(),
            page: page as u32,
        })
        .collect()
}

#[test]
fn multi_batch_requests_are_admitted_whole_or_refused_at_once_never_half() {
    let mut rc = receiver_config(ChannelKind::Tcp, TransferMode::Push, 8);
    rc.alloc_fail_backoff_ttl = Duration::from_secs(60);
    let r = Receiver::start(&rc, 0).unwrap();
    let layout = rc.chunk_layout();

    // A writer that did ascend-pd's handshake (so it may be granted pages).
    let page = layout.page_bytes();
    let pool = PagePool::new(RegisteredBuffer::host(page, page, false).unwrap());
    let node = "admission-writer";
    let channel: Arc<dyn TransferChannel> = chan::open(
        ChannelKind::Tcp,
        "127.0.0.1",
        node,
        &[Arc::clone(&pool)],
        None,
    )
    .unwrap();
    let ctx = zmq::Context::new();
    let hello = Hello::local(
        node,
        Role::Sender,
        TransferMode::Push,
        Duration::from_secs(60),
        channel.as_ref(),
    );
    let init = format!("tcp://127.0.0.1:{}", rc.init_port(0).unwrap());
    handshake::connect(
        &ctx,
        &init,
        channel.as_ref(),
        &hello,
        Duration::from_secs(20),
    )
    .unwrap();

    // One request socket (route) per request.
    let sockets: Vec<(String, zmq::Socket)> = (1..=4)
        .map(|i| {
            let route = format!("{node}#{i}");
            let s = ctx.socket(zmq::REQ).unwrap();
            s.set_identity(route.as_bytes()).unwrap();
            s.set_rcvtimeo(20_000).unwrap();
            s.connect(&format!("tcp://127.0.0.1:{}", rc.alloc_port(0).unwrap()))
                .unwrap();
            (route, s)
        })
        .collect();
    let batch = |i: usize, b: usize| AllocRequest {
        keys: vec![
            format!("adm-r{i}@{}", 2 * b),
            format!("adm-r{i}@{}", 2 * b + 1),
        ],
        fmt: layout.fmt.code(),
        shape: layout.full_shape().iter().map(|&d| d as u64).collect(),
        dtype: layout.dtype.name().into(),
        last_chunk_toks: layout.tokens as u64,
        req_id: Some(format!("adm-r{i}")),
        is_last_batch: Some(b == 1),
        total_chunks: Some(4),
    };
    let ask = |i: usize, b: usize| {
        let s = &sockets[i - 1].1;
        s.send(Message::AllocRequest(batch(i, b)).encode(), 0)
            .unwrap();
        let reply = s.recv_bytes(0).expect("answered, not parked");
        AscendAllocResponse::decode(&reply).unwrap()
    };
    let notice = |i: usize, resp: &AscendAllocResponse| {
        // Stands in for the write: the pages land (their bytes are not
        // checked here).
        let (route, s) = &sockets[i - 1];
        let n = PushNotice {
            route: route.clone(),
            outcome: PushOutcome::Landed,
            refs: refs(resp),
        };
        s.send(n.encode(), 0).unwrap();
        s.recv_bytes(0).unwrap();
    };

    // Every first batch before any second one.
    let first: Vec<AscendAllocResponse> = (1..=4).map(|i| ask(i, 0)).collect();
    assert!(
        !first[0].alloc_failed && !first[1].alloc_failed,
        "{first:?}"
    );
    assert!(first[2].alloc_failed && first[3].alloc_failed, "{first:?}");
    let st = r.stats();
    assert_eq!((st.reservations, st.admission_refused), (2, 2));
    assert_eq!(st.waiting_for_pages, 0, "nobody was parked");
    for i in 1..=2 {
        notice(i, &first[i - 1]);
    }
    // The admitted requests' second batches draw on their reservations.
    for i in 1..=2 {
        let second = ask(i, 1);
        assert!(!second.alloc_failed, "r{i}: {second:?}");
        assert_eq!(second.remote_indexes.len(), 2);
        notice(i, &second);
    }
    let st = r.stats();
    assert_eq!(
        st.reservations, 0,
        "their last batches ended the reservations"
    );
    assert_eq!(st.store.resident, 8);
    // Loaded and removed: every page back; a refused request now fits.
    for i in 1..=2 {
        for c in 0..4 {
            r.remove(&format!("adm-r{i}@{c}"));
        }
    }
    assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver");
    let again = ask(3, 0);
    assert!(!again.alloc_failed, "{again:?}");
    assert_eq!(r.stats().reservations, 1);
}

/// The same for pull-eager: a pull sender announcing each request in two
/// notifications that carry `req_id`, `total_chunks` and `is_last_batch`.
/// The first notifications of two requests reserve the receiver's eight
/// pages; the other two are refused at once (not parked for the 60 s page
/// wait); the admitted ones' second notifications are read into their
/// reservations, and every page comes back.
#[test]
fn multi_notification_pulls_are_admitted_whole_or_refused_at_once() {
    use ascend_pd::channel::{Access, GrantTag};
    use ascend_pd::protocol::PullId;
    use std::time::Instant;

    let mut rc = receiver_config(ChannelKind::Tcp, TransferMode::PullEager, 8);
    rc.alloc_fail_backoff_ttl = Duration::from_secs(60);
    let r = Receiver::start(&rc, 0).unwrap();
    let layout = rc.chunk_layout();
    let page = layout.page_bytes();
    // The puller's pool: 4 pages every key reads from, filled with a pattern.
    let pool = PagePool::new(RegisteredBuffer::host(4 * page, page, false).unwrap());
    let node = "127.0.0.1:1/p1r0-admission";
    let channel: Arc<dyn TransferChannel> = chan::open(
        ChannelKind::Tcp,
        "127.0.0.1",
        node,
        &[Arc::clone(&pool)],
        None,
    )
    .unwrap();
    let ctx = zmq::Context::new();
    let hello = Hello::local(
        node,
        Role::Sender,
        TransferMode::PullEager,
        Duration::from_secs(60),
        channel.as_ref(),
    );
    let init = format!("tcp://127.0.0.1:{}", rc.init_port(0).unwrap());
    let a = handshake::connect(
        &ctx,
        &init,
        channel.as_ref(),
        &hello,
        Duration::from_secs(20),
    )
    .unwrap();
    let meta = ascend_pd::memory::ChunkMeta::full(layout);
    let mut held = pool.allocate_batch(&[meta; 4]).unwrap();
    for (i, p) in held.iter_mut().enumerate() {
        ascend_pd::memory::pattern::fill(p.host_bytes_mut().unwrap(), i as u64);
    }
    let refs: Vec<BufferRef> = held.iter().map(|p| p.buffer_ref()).collect();
    channel
        .grant(a.peer, Access::Read, GrantTag::UNTAGGED, &refs)
        .unwrap();
    let uuid = refs[0].uuid;
    let done_url = format!("127.0.0.1:{}", free_port());
    // One request socket (route) per request, as a sender's are: a socket
    // made per message under one identity could be refused by the
    // receiver's ROUTER while the last one's disconnect is in flight.
    let sockets: Vec<zmq::Socket> = (1..=4)
        .map(|i| {
            let s = ctx.socket(zmq::REQ).unwrap();
            s.set_identity(format!("{node}#{i}").as_bytes()).unwrap();
            s.set_rcvtimeo(20_000).unwrap();
            s.connect(&format!("tcp://127.0.0.1:{}", rc.alloc_port(0).unwrap()))
                .unwrap();
            s
        })
        .collect();
    let notify = |i: usize, b: usize| {
        let keys = vec![
            format!("pull-r{i}@{}", 2 * b),
            format!("pull-r{i}@{}", 2 * b + 1),
        ];
        let pull_id = PullId::due_in_this_process(Instant::now() + Duration::from_secs(50));
        let mut n = pull_notif(
            layout,
            pull_id.encode(),
            &keys,
            (
                uuid,
                vec![refs[2 * b].page as u64, refs[2 * b + 1].page as u64],
            ),
            node,
            done_url.clone(),
        );
        n.req_id = Some(format!("pull-r{i}"));
        n.total_chunks = Some(4);
        n.is_last_batch = Some(b == 1);
        let s = &sockets[i - 1];
        s.send(Message::PullReadyNotif(n).encode(), 0).unwrap();
        let reply = s.recv_bytes(0).expect("answered, not parked");
        ascend_pd::protocol::PullReadyDoneAck::decode(&reply).unwrap()
    };
    let first: Vec<_> = (1..=4).map(|i| notify(i, 0)).collect();
    assert!(
        !first[0].alloc_failed && !first[1].alloc_failed,
        "{first:?}"
    );
    assert!(first[2].alloc_failed && first[3].alloc_failed, "{first:?}");
    let st = r.stats();
    assert_eq!((st.reservations, st.admission_refused), (2, 2));
    assert_eq!(st.waiting_for_pages, 0, "nobody was parked");
    for i in 1..=2 {
        let second = notify(i, 1);
        assert!(!second.alloc_failed, "r{i}: {second:?}");
    }
    assert_eq!(
        r.stats().reservations,
        0,
        "the last notifications ended them"
    );
    // Every chunk is read, byte for byte, from the page its key named.
    for i in 1..=2 {
        for c in 0..4 {
            let k = format!("pull-r{i}@{c}");
            let m = r.get_wait(&k, Duration::from_secs(20)).expect("read");
            assert!(
                ascend_pd::memory::pattern::first_mismatch(m.host_bytes().unwrap(), c as u64)
                    .is_none(),
                "{k}"
            );
        }
    }
    for i in 1..=2 {
        for c in 0..4 {
            r.remove(&format!("pull-r{i}@{c}"));
        }
    }
    assert!(eventually(Duration::from_secs(10), || r
        .stats()
        .pools
        .cpu
        .unwrap()
        .allocated
        == 0));
    assert_no_pages(r.stats().pools.cpu.unwrap(), "receiver");
    // A refused request fits now.
    let again = notify(3, 0);
    assert!(!again.alloc_failed, "{again:?}");
    assert_eq!(r.stats().reservations, 1);
    drop(held);
}
