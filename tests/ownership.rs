//! Pages owned by their transfers: one end-to-end test per way a byte could
//! land in a page someone else owns (issue 10), over real sockets and
//! channels on loopback, hccl on the CANN emulator (nothing here ran on
//! Ascend hardware). Every test ends with the pools back at their start:
//! nothing allocated, pinned or quarantined.

mod common;

use ascend_pd::backend::{PutOutcome, Receiver, Sender};
use ascend_pd::channel::handshake::{self, Hello};
use ascend_pd::channel::{self as chan, TransferChannel, WriteOp};
use ascend_pd::config::{ChannelKind, PdConfig, Role, TransferMode};
use ascend_pd::memory::npu::AclRuntime;
use ascend_pd::memory::{
    pattern, BufferRef, ChunkMeta, MemObj, PagePool, PoolStats, RegisteredBuffer, SealedMemObj,
};
use ascend_pd::protocol::{
    notice, AllocRequest, AscendAllocResponse, Message, PushNotice, PushOutcome,
};
use common::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

const KINDS: [ChannelKind; 3] = [ChannelKind::Shm, ChannelKind::Tcp, ChannelKind::Hccl];

fn emulator() -> AclRuntime {
    let dir = ascend_emu::install_dir().expect("the emulator is built as a dev-dependency");
    AclRuntime::from_dir(&dir).expect("the emulator loads")
}

fn pool_stats(r: &Receiver) -> PoolStats {
    r.stats().pools.cpu.expect("host pools")
}

/// A push sender driven by hand: a real channel and handshake, and a raw
/// REQ socket (named like a real sender's) for its AllocRequest and notice,
/// so the test decides when its one-sided write happens.
struct LateWriter {
    channel: Arc<dyn TransferChannel>,
    peer: chan::PeerId,
    /// The receiver's hello (its table and transfer endpoint).
    remote: Hello,
    node: String,
    req: zmq::Socket,
    route: String,
    chunks: Vec<SealedMemObj>,
    _pool: Arc<PagePool>,
    _ctx: zmq::Context,
}

impl LateWriter {
    fn start(kind: ChannelKind, rc: &PdConfig, keys: &[String], seed: u64) -> LateWriter {
        let layout = rc.chunk_layout();
        let page = layout.page_bytes();
        let buf = match kind {
            ChannelKind::Hccl => {
                RegisteredBuffer::pinned_host(&emulator(), 0, keys.len() * page, page)
            }
            _ => RegisteredBuffer::host(keys.len() * page, page, kind == ChannelKind::Shm),
        }
        .unwrap();
        let pool = PagePool::new(buf);
        let mut pages = pool
            .allocate_batch(&vec![ChunkMeta::full(layout); keys.len()])
            .unwrap();
        for (i, p) in pages.iter_mut().enumerate() {
            pattern::fill(
                p.host_bytes_mut().unwrap(),
                pattern::page_seed(seed, i as u64),
            );
        }
        let node = format!("late-writer-{seed}");
        let channel = chan::open(kind, "127.0.0.1", &node, &[Arc::clone(&pool)], None).unwrap();
        let ctx = zmq::Context::new();
        let hello = Hello::local(
            &node,
            Role::Sender,
            TransferMode::Push,
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
        let route = format!("{node}#1");
        let req = route_socket(&ctx, rc, &route);
        LateWriter {
            channel,
            peer: a.peer,
            remote: a.remote,
            node,
            req,
            route,
            chunks: pages.into_iter().map(MemObj::seal).collect(),
            _pool: pool,
            _ctx: ctx,
        }
    }

    /// Asks for pages for `keys`; returns the pages granted.
    fn allocate(&self, rc: &PdConfig, keys: &[String]) -> Vec<BufferRef> {
        let layout = rc.chunk_layout();
        let req = AllocRequest {
            keys: keys.to_vec(),
            fmt: layout.fmt.code(),
            shape: layout.full_shape().iter().map(|&d| d as u64).collect(),
            dtype: layout.dtype.name().into(),
            last_chunk_toks: layout.tokens as u64,
            ..Default::default()
        };
        self.req
            .send(Message::AllocRequest(req).encode(), 0)
            .unwrap();
        let resp = AscendAllocResponse::decode(&self.req.recv_bytes(0).unwrap()).unwrap();
        assert!(!resp.alloc_failed, "{resp:?}");
        resp.remote_indexes
            .iter()
            .zip(&resp.remote_buffer_uuids)
            .map(|(&page, u)| BufferRef {
                uuid: Uuid::parse_str(u).unwrap(),
                page: page as u32,
            })
            .collect()
    }

    /// The one-sided write into `refs`, whenever the test says.
    fn write(&self, refs: &[BufferRef]) -> Result<(), chan::ChannelError> {
        self.channel.write(self.peer, self.tag(), self.ops(0, refs))
    }

    /// Writes our chunks from `first` on into `refs`, under the current route.
    fn write_from(&self, first: usize, refs: &[BufferRef]) -> Result<(), chan::ChannelError> {
        self.channel
            .write(self.peer, self.tag(), self.ops(first, refs))
    }

    /// Writes of our chunks from `first` on into `refs`.
    fn ops(&self, first: usize, refs: &[BufferRef]) -> Vec<WriteOp> {
        self.chunks[first..]
            .iter()
            .zip(refs)
            .map(|(c, r)| WriteOp::chunk(c.clone(), *r))
            .collect()
    }

    /// The grant tag of the current route's allocation.
    fn tag(&self) -> chan::GrantTag {
        chan::GrantTag::of_route(&self.route).expect("<node>#<n>")
    }

    /// A new request socket on the next route, as a real sender opens
    /// after a write that did not land.
    fn next_route(&mut self, rc: &PdConfig) {
        let n: u64 = self.route.rsplit_once('#').unwrap().1.parse().unwrap();
        self.route = format!("{}#{}", self.node, n + 1);
        self.req = route_socket(&self._ctx, rc, &self.route);
    }

    /// The notice ending the allocation of `refs`; the receiver's answer.
    fn notice(&self, outcome: PushOutcome, refs: &[BufferRef]) -> Result<(), String> {
        let n = PushNotice {
            route: self.route.clone(),
            outcome,
            refs: refs.to_vec(),
        };
        self.req.send(n.encode(), 0).unwrap();
        notice::decode_reply(&self.req.recv_bytes(0).unwrap()).unwrap()
    }
}

/// A REQ socket to the receiver's allocation port, named `route`.
fn route_socket(ctx: &zmq::Context, rc: &PdConfig, route: &str) -> zmq::Socket {
    let req = ctx.socket(zmq::REQ).unwrap();
    req.set_identity(route.as_bytes()).unwrap();
    req.set_rcvtimeo(10_000).unwrap();
    req.connect(&format!("tcp://127.0.0.1:{}", rc.alloc_port(0).unwrap()))
        .unwrap();
    req
}

fn wait_until(what: &str, mut f: impl FnMut() -> bool) {
    assert!(
        eventually(Duration::from_secs(20), &mut f),
        "timed out waiting: {what}"
    );
}

/// Defect 1. A writer that was granted two pages writes them only after
/// `pd_push_landing_timeout`. Meanwhile another sender's request B wants
/// those pages. tcp: the pages came back once the grant was revoked, B
/// lands in them, and the late write is refused and counted — B's bytes
/// never change. shm / hccl cannot refuse a one-sided write: the pages stay
/// quarantined (B is refused for lack of pages), the late write lands in
/// pages nobody else owns, and only the writer's notice brings them back;
/// then B goes through. Either way every byte of B is verified.
#[test]
fn a_push_write_delayed_past_the_landing_timeout_never_changes_another_requests_bytes() {
    let _rt = emulator();
    for kind in KINDS {
        let mut rc = receiver_config(kind, TransferMode::Push, 2);
        rc.push_landing_timeout = Duration::from_millis(300);
        let r = Receiver::start(&rc, 0).unwrap();
        let late_keys = keys(&format!("late-{}", kind.name()), 2);
        let w1 = LateWriter::start(kind, &rc, &late_keys, 7);
        let refs = w1.allocate(&rc, &late_keys);
        assert_eq!(pool_stats(&r).allocated, 2);

        // The deadline passes with no notice: the keys go, the grant is revoked.
        wait_until("the late keys to be dropped", || !r.contains(&late_keys[0]));
        let mut sc = sender_config(kind, TransferMode::Push, 4);
        sc.alloc_fail_backoff_ttl = Duration::from_millis(200);
        let s = Sender::start(&sc, 0, Default::default()).unwrap();
        let b_keys = keys(&format!("b-{}", kind.name()), 2);
        let b = chunks(&s, &b_keys, CHUNK);
        let spec = spec_for(&rc, "b", false);
        if kind == ChannelKind::Tcp {
            // Refused from the revoke on: the pages are free again, B takes them.
            wait_until("the revoked pages to return", || {
                pool_stats(&r).allocated == 0
            });
            let out = s.put(&b_keys, &b, &spec).unwrap();
            assert!(
                matches!(out, PutOutcome::Pushed { written: 2, .. }),
                "{out:?}"
            );
            let e = w1
                .write(&refs)
                .expect_err("a write after the revoke must be refused");
            assert!(e.to_string().contains("refused"), "{e}");
            assert!(r.stats().grants.refused >= 1);
        } else {
            // Nothing can stop the writer: the pages stay out of everyone's reach.
            let st = pool_stats(&r);
            assert_eq!((st.allocated, st.quarantined), (2, 2), "{kind:?}");
            assert_eq!(
                s.put(&b_keys, &b, &spec).unwrap(),
                PutOutcome::ReceiverAllocFailed
            );
            // The late write lands in quarantined pages; the writer's notice
            // (too late to land) proves it is done, so they come back.
            w1.write(&refs).unwrap();
            let answer = w1.notice(PushOutcome::Landed, &refs);
            assert!(answer.unwrap_err().contains("too late"), "{kind:?}");
            wait_until("the quarantined pages to return", || {
                pool_stats(&r).quarantined == 0
            });
            std::thread::sleep(Duration::from_millis(250));
            let out = s.put(&b_keys, &b, &spec).unwrap();
            assert!(
                matches!(out, PutOutcome::Pushed { written: 2, .. }),
                "{kind:?} {out:?}"
            );
        }
        for k in &b_keys {
            let got = r.get_wait(k, Duration::from_secs(10)).expect(k);
            assert!(holds(&got, k), "{kind:?}: {k} changed");
        }
        assert!(!r.contains(&late_keys[0]) && !r.contains(&late_keys[1]));
        drop((b, w1));
        for k in &b_keys {
            assert!(r.remove(k));
        }
        let st = pool_stats(&r);
        assert_eq!(
            (st.allocated, st.pinned, st.quarantined),
            (0, 0, 0),
            "{kind:?}"
        );
    }
}

/// A TCP relay that passes a connection's first `pass` bytes (the tcp
/// channel's hello) and holds the rest until released: a connection whose
/// queued bytes reach the server late, as they do when a client gives up
/// on a connection (or the network stalls) after writing them.
struct HoldingRelay {
    addr: std::net::SocketAddr,
    held: Arc<std::sync::atomic::AtomicUsize>,
    release: std::sync::mpsc::Sender<()>,
}

impl HoldingRelay {
    fn start(target: std::net::SocketAddr, pass: usize) -> HoldingRelay {
        use std::io::{Read, Write};
        use std::sync::atomic::Ordering;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap();
        let held = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let (release, released) = std::sync::mpsc::channel::<()>();
        let counted = Arc::clone(&held);
        std::thread::spawn(move || {
            let (mut client, _) = listener.accept().unwrap();
            let mut server = std::net::TcpStream::connect(target).unwrap();
            let (mut back_from, mut back_to) =
                (server.try_clone().unwrap(), client.try_clone().unwrap());
            std::thread::spawn(move || {
                let _ = std::io::copy(&mut back_from, &mut back_to);
                let _ = back_to.shutdown(std::net::Shutdown::Write);
            });
            let mut hello = vec![0u8; pass];
            client.read_exact(&mut hello).unwrap();
            server.write_all(&hello).unwrap();
            // Everything after the hello waits in here until released.
            let (tx, rx) = std::sync::mpsc::channel::<Vec<u8>>();
            std::thread::spawn(move || {
                let mut buf = vec![0u8; 64 * 1024];
                while let Ok(n @ 1..) = client.read(&mut buf) {
                    counted.fetch_add(n, Ordering::SeqCst);
                    if tx.send(buf[..n].to_vec()).is_err() {
                        break;
                    }
                }
            });
            let _ = released.recv();
            for bytes in rx {
                if server.write_all(&bytes).is_err() {
                    break;
                }
            }
            let _ = server.shutdown(std::net::Shutdown::Write);
        });
        HoldingRelay {
            addr,
            held,
            release,
        }
    }

    fn held(&self) -> usize {
        self.held.load(std::sync::atomic::Ordering::SeqCst)
    }
}

/// Review finding (tcp). A writer's request for page P sat unread on a
/// connection (the writer gave up on it: a timeout, a stalled network),
/// the writer reported its push aborted, and the receiver — its server
/// thread idle between requests — gave P back and granted it to the same
/// writer for its next push. The old request, delivered late, named the
/// right node, page and access, and its stale bytes landed over the new
/// push's. Now every write carries its allocation's tag (the route's
/// number, never reused after a write that did not land), and the late
/// one is refused: the new push keeps every byte.
#[test]
fn a_write_delivered_late_on_a_dropped_tcp_connection_never_lands_under_the_pages_next_grant() {
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::Push, 1);
    let r = Receiver::start(&rc, 0).unwrap();
    let ks = keys("relayed", 2);
    let mut w = LateWriter::start(ChannelKind::Tcp, &rc, &ks, 21);
    let chan::Endpoint::Tcp { addr } = &w.remote.endpoint else {
        panic!("a tcp receiver advertises a tcp endpoint")
    };
    let relay = HoldingRelay::start(addr.parse().unwrap(), 6 + w.node.len() + 16);
    let relayed = w
        .channel
        .attach(
            "receiver-via-relay",
            &w.remote.buffers,
            &chan::Endpoint::Tcp {
                addr: relay.addr.to_string(),
            },
        )
        .unwrap();

    // Push 1 (route #1): its write of chunk 0 is stuck in the relay.
    let first = w.allocate(&rc, &ks[..1]);
    let stale = w
        .channel
        .submit_write(relayed, w.tag(), w.ops(0, &first))
        .unwrap();
    let page = rc.chunk_layout().page_bytes();
    wait_until("the stale write to be queued", || relay.held() >= page);
    assert_eq!(w.notice(PushOutcome::Aborted, &first), Ok(()));
    wait_until("the aborted page to return", || {
        pool_stats(&r).allocated == 0
    });

    // Push 2 (route #2) gets the same page and writes chunk 1 into it.
    w.next_route(&rc);
    let second = w.allocate(&rc, &ks[1..]);
    assert_eq!(second, first, "a one-page pool grants the same page again");
    w.write_from(1, &second).unwrap();

    // Now the stale request arrives: refused, counted, nothing written.
    let refused = r.stats().grants.refused;
    relay.release.send(()).unwrap();
    let late = stale.wait();
    let e = late.result.expect_err("the stale write must be refused");
    assert!(e.to_string().contains("refused"), "{e}");
    assert_eq!(r.stats().grants.refused, refused + 1);
    drop(late.pages);

    assert_eq!(w.notice(PushOutcome::Landed, &second), Ok(()));
    let got = r.get_wait(&ks[1], Duration::from_secs(10)).expect("landed");
    let want = pattern::page_seed(21, 1);
    assert_eq!(
        pattern::first_mismatch(got.host_bytes().unwrap(), want),
        None,
        "the second push's bytes changed"
    );
    drop(got);
    assert!(r.remove(&ks[1]));
    let st = pool_stats(&r);
    assert_eq!((st.allocated, st.pinned, st.quarantined), (0, 0, 0));
}

/// A revoked grant whose writer never reports: its pages come back only
/// when the channel can tell the writer no longer touches them. tcp: at
/// once (later writes are refused). hccl: when the writer closes its side
/// (its channel, and with it the communicator, goes away). shm: not while
/// the writer process lives, whatever it does with its channel — only its
/// notice (or its exit) proves it done.
#[test]
fn revoked_pages_return_only_when_the_writer_can_no_longer_touch_them() {
    let _rt = emulator();
    for kind in KINDS {
        let mut rc = receiver_config(kind, TransferMode::Push, 2);
        rc.push_landing_timeout = Duration::from_millis(200);
        let r = Receiver::start(&rc, 0).unwrap();
        let ks = keys(&format!("silent-{}", kind.name()), 2);
        let w = LateWriter::start(kind, &rc, &ks, 3);
        let refs = w.allocate(&rc, &ks);
        wait_until("the keys to be dropped", || !r.contains(&ks[0]));
        match kind {
            ChannelKind::Tcp => {
                wait_until("tcp to give the pages back", || {
                    pool_stats(&r).allocated == 0
                });
                drop(w);
            }
            ChannelKind::Hccl => {
                std::thread::sleep(Duration::from_millis(600));
                assert_eq!(
                    pool_stats(&r).quarantined,
                    2,
                    "the writer still holds its link"
                );
                drop(w);
                wait_until("hccl to see the writer close", || {
                    pool_stats(&r).allocated == 0
                });
            }
            _ => {
                // The channel gone, the process alive: still quarantined.
                let LateWriter {
                    channel,
                    req,
                    route,
                    _ctx,
                    ..
                } = w;
                drop(channel);
                std::thread::sleep(Duration::from_millis(600));
                assert_eq!(pool_stats(&r).quarantined, 2, "shm cannot tell");
                let n = PushNotice {
                    route,
                    outcome: PushOutcome::Aborted,
                    refs,
                };
                req.send(n.encode(), 0).unwrap();
                let answer = notice::decode_reply(&req.recv_bytes(0).unwrap()).unwrap();
                assert_eq!(answer, Ok(()));
                wait_until("the notice to free the pages", || {
                    pool_stats(&r).allocated == 0
                });
            }
        }
        let st = pool_stats(&r);
        assert_eq!((st.allocated, st.quarantined), (0, 0), "{kind:?}");
        assert_eq!(r.stats().store.allocations_quarantined, 0);
    }
}

/// Defect 4. Two push senders on one host used to share the node id
/// `host:0`: the second one's handshake replaced the first one's attachment
/// (over hccl, closing its communicator). Now each has its own, and both
/// deliver every byte, interleaved.
#[test]
fn two_push_senders_on_one_host_over_hccl_both_deliver() {
    let _rt = emulator();
    let rc = receiver_config(ChannelKind::Hccl, TransferMode::Push, 32);
    let r = Receiver::start(&rc, 0).unwrap();
    let sc = sender_config(ChannelKind::Hccl, TransferMode::Push, 16);
    let s1 = Sender::start(&sc, 0, Default::default()).unwrap();
    let s2 = Sender::start(&sc, 0, Default::default()).unwrap();
    assert_ne!(s1.node(), s2.node());
    let mut all = Vec::new();
    for (i, s) in [&s1, &s2, &s1, &s2].into_iter().enumerate() {
        let ks = keys(&format!("two-{i}"), 3);
        let c = chunks(s, &ks, 5);
        let out = s.put(&ks, &c, &spec_for(&rc, "two", false)).unwrap();
        assert!(
            matches!(out, PutOutcome::Pushed { written: 3, .. }),
            "put {i}: {out:?}"
        );
        all.extend(ks);
    }
    for k in &all {
        let got = r.get_wait(k, Duration::from_secs(10)).expect(k);
        assert!(holds(&got, k), "{k}");
        drop(got);
        assert!(r.remove(k));
    }
    assert_eq!(r.stats().peers, 2);
    let st = pool_stats(&r);
    assert_eq!((st.allocated, st.quarantined), (0, 0));
}

/// Defect 5 (margin). The read margin used to be min(receiver TTL / 10, 5 s)
/// whatever the agreed lease, so a sender with a 2 s TTL against a
/// receiver's default 360 s had every read refused. Now the margin is a
/// share of the agreed (2 s) lease: requests loaded within it load, one
/// loaded after it fails cleanly, and (tcp) no read ever reaches the sender
/// after it released the pages.
#[test]
fn a_two_second_sender_ttl_against_the_receivers_default_loads_or_fails_cleanly() {
    for kind in [ChannelKind::Shm, ChannelKind::Tcp] {
        for mode in [TransferMode::PullEager, TransferMode::PullDelay] {
            let what = format!("{kind:?} {mode:?}");
            let rc = receiver_config(kind, mode, 32);
            assert_eq!(rc.pull_pending_ttl, Duration::from_secs(360));
            let r = Receiver::start(&rc, 0).unwrap();
            let mut sc = sender_config(kind, mode, 32);
            sc.pull_pending_ttl = Duration::from_secs(2);
            let s = Sender::start(&sc, 0, Default::default()).unwrap();
            let cfg = r_layout_cache(&rc);
            for i in 0..3 {
                let ks = keys(&format!("ttl-{i}"), 4);
                let c = chunks(&s, &ks, 9);
                s.put(&ks, &c, &spec_for(&rc, "ttl", true)).unwrap();
                drop(c);
                if mode == TransferMode::PullEager {
                    for k in &ks {
                        let got = r.get_wait(k, Duration::from_secs(10));
                        assert!(got.is_some_and(|g| holds(&g, k)), "{what}: {k}");
                    }
                } else {
                    // One slot per token: the last chunk holds 9.
                    let (mut cache, mut slots) = cfg(ks.len() * CHUNK);
                    slots.truncate((ks.len() - 1) * CHUNK + 9);
                    let report = r
                        .load(&ks, &slots, &mut cache)
                        .unwrap_or_else(|e| panic!("{what}: {e}"));
                    assert_eq!(report.loaded, ks, "{what}");
                }
                for k in &ks {
                    r.remove(k);
                }
            }
            if mode == TransferMode::PullDelay {
                // Past the lease: the proxies are unreadable, the load fails
                // by name, the pull's Done still goes out.
                let ks = keys("ttl-late", 2);
                let c = chunks(&s, &ks, CHUNK);
                s.put(&ks, &c, &spec_for(&rc, "late", true)).unwrap();
                drop(c);
                std::thread::sleep(Duration::from_millis(2100));
                let (mut cache, slots) = cfg(ks.len() * CHUNK);
                let e = r.load(&ks, &slots, &mut cache).unwrap_err().to_string();
                assert!(e.contains("lease expired"), "{what}: {e}");
            }
            assert!(s.drain(Duration::from_secs(10)), "{what}");
            assert_eq!(
                s.stats().grants.refused,
                0,
                "{what}: a read came after the release"
            );
            let sp = s.stats().pools.cpu.unwrap();
            assert_eq!(
                (sp.allocated, sp.pinned, sp.quarantined),
                (0, 0, 0),
                "{what}"
            );
            let rp = pool_stats(&r);
            assert_eq!((rp.allocated, rp.quarantined), (0, 0), "{what}");
        }
    }
}

/// A host KV cache for the receiver's layout with room for `tokens`
/// tokens, and a slot mapping filling it in order.
fn r_layout_cache(rc: &PdConfig) -> impl Fn(usize) -> (ascend_pd::kv::KvCache, Vec<i64>) {
    let layout = rc.chunk_layout();
    move |tokens| {
        let blocks = tokens.div_ceil(8);
        let spec = ascend_pd::kv::KvCacheSpec::for_layout(&layout, blocks, 8);
        (
            ascend_pd::kv::KvCache::host(spec).unwrap(),
            (0..tokens as i64).collect(),
        )
    }
}

/// Defect 5 (delayed delivery). The receiver used to start a pull's lease
/// when it read the notification, so one that had waited (then in its
/// queue, now for pages) was read after the sender released the pages.
/// Here a sender with a 1 s lease announces a request the receiver has no
/// pages for; the notification waits for pages past the sender's lease. It
/// is refused on its first retry after the read window closed, and nothing
/// of it is read — although pages come free before its page wait ends.
#[test]
fn a_notification_that_waits_for_pages_past_its_lease_is_refused_not_read() {
    let mut rc = receiver_config(ChannelKind::Tcp, TransferMode::PullEager, 4);
    rc.alloc_fail_backoff_ttl = Duration::from_secs(30);
    let r = Receiver::start(&rc, 0).unwrap();
    // Three of the receiver's four pages hold a request.
    let s0 = Sender::start(
        &sender_config(ChannelKind::Tcp, TransferMode::PullEager, 16),
        0,
        Default::default(),
    )
    .unwrap();
    let first = keys("first", 3);
    let c = chunks(&s0, &first, CHUNK);
    s0.put(&first, &c, &spec_for(&rc, "first", false)).unwrap();
    drop(c);
    for k in &first {
        assert!(r.get_wait(k, Duration::from_secs(10)).is_some(), "{k}");
    }
    // Two pages under a 1 s lease: the notification waits for them.
    let mut sc = sender_config(ChannelKind::Tcp, TransferMode::PullEager, 16);
    sc.pull_pending_ttl = Duration::from_secs(1);
    let s1 = Sender::start(&sc, 0, Default::default()).unwrap();
    let late = keys("delayed", 2);
    let c = chunks(&s1, &late, CHUNK);
    let out = std::thread::scope(|scope| {
        let put = scope.spawn(|| s1.put(&late, &c, &spec_for(&rc, "delayed", false)));
        assert!(eventually(Duration::from_secs(10), || r
            .stats()
            .waiting_for_pages
            == 1));
        // Pages come free only after the sender's lease is over.
        std::thread::sleep(Duration::from_millis(1200));
        for k in &first {
            r.remove(k);
        }
        put.join().unwrap().unwrap()
    });
    assert_eq!(out, PutOutcome::ReceiverAllocFailed);
    drop(c);
    // Never read: not stored, refused for its lease (not for want of
    // pages), and the sender's server saw no request for it.
    std::thread::sleep(Duration::from_millis(300));
    assert!(late.iter().all(|k| !r.contains(k)));
    assert_eq!(s1.stats().grants.refused, 0);
    let store = r.stats().store;
    assert_eq!((store.rejected_pull_notifs, store.alloc_failures), (1, 0));
    assert_eq!(r.stats().bytes_read, 3 * sc.page_bytes());
    for s in [&s0, &s1] {
        assert!(s.drain(Duration::from_secs(10)));
        let sp = s.stats().pools.cpu.unwrap();
        assert_eq!((sp.allocated, sp.pinned, sp.quarantined), (0, 0, 0));
    }
    let rp = pool_stats(&r);
    assert_eq!((rp.allocated, rp.quarantined), (0, 0));
}

/// A tcp "sender" whose transfer server takes every read request and then
/// stalls until told to answer (with garbage).
struct StallingSender {
    release: crossbeam_channel::Sender<()>,
    /// Read requests taken so far (none answered before the release).
    requests: Arc<std::sync::atomic::AtomicUsize>,
    served: std::thread::JoinHandle<usize>,
    keys: Vec<String>,
    _ctx: zmq::Context,
    _ch: Arc<dyn TransferChannel>,
}

impl StallingSender {
    fn announce(rc: &PdConfig, keys: Vec<String>, lease: Duration) -> StallingSender {
        Self::announce_as(rc, "stalling", keys, lease)
    }

    /// The same for the receiver's mode (`rc`), as the sender `node`.
    fn announce_as(
        rc: &PdConfig,
        node: &str,
        keys: Vec<String>,
        lease: Duration,
    ) -> StallingSender {
        use ascend_pd::channel::handshake::HANDSHAKE_VERSION;
        use ascend_pd::channel::{BufferDesc, Endpoint};
        use ascend_pd::memory::DeviceKind;
        use std::io::{Read, Write};
        let layout = rc.chunk_layout();
        let page = layout.page_bytes() as u64;
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = listener.local_addr().unwrap().to_string();
        let (release, released) = crossbeam_channel::bounded::<()>(1);
        let requests = Arc::new(std::sync::atomic::AtomicUsize::new(0));
        let counted = Arc::clone(&requests);
        // Every connection the receiver opens: take its hello and read
        // requests, answer none until released.
        let serve = move |mut conn: std::net::TcpStream| -> Vec<usize> {
            conn.set_read_timeout(Some(Duration::from_secs(20)))
                .unwrap();
            let mut hello = [0u8; 6];
            // Ports picked by free_port() elsewhere in this binary can be
            // handed out again to this listener: a stray connection (a ZMQ
            // peer of another test, say) is dropped, not a test failure.
            if conn.read_exact(&mut hello).is_err() || &hello[..4] != b"APDH" {
                return Vec::new();
            }
            // The node id and the client's nonce; we run without a secret.
            let mut node = vec![0u8; u16::from_le_bytes([hello[4], hello[5]]) as usize + 16];
            if conn.read_exact(&mut node).is_err() {
                return Vec::new();
            }
            conn.write_all(b"APDA\0").unwrap();
            let mut lens = Vec::new();
            let mut req = [0u8; 48];
            conn.set_read_timeout(Some(Duration::from_millis(300)))
                .unwrap();
            while conn.read_exact(&mut req).is_ok() {
                counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
                lens.push(u64::from_le_bytes(req[32..40].try_into().unwrap()) as usize);
            }
            lens
        };
        let served = std::thread::spawn(move || {
            listener.set_nonblocking(true).unwrap();
            let mut conns = Vec::new();
            loop {
                match listener.accept() {
                    Ok((c, _)) => {
                        c.set_nonblocking(false).unwrap();
                        let reader = c.try_clone().unwrap();
                        let serve = serve.clone();
                        conns.push((c, std::thread::spawn(move || serve(reader))));
                    }
                    Err(_) if released.try_recv().is_ok() => break,
                    Err(_) => std::thread::sleep(Duration::from_millis(10)),
                }
            }
            let mut n = 0;
            for (mut c, h) in conns {
                for len in h.join().unwrap() {
                    let _ = c.write_all(&[0u8; 8]);
                    let _ = c.write_all(&vec![0xA5; len]);
                    n += 1;
                }
            }
            n
        });
        let uuid = Uuid::new_v4();
        // Our side of the handshake needs a channel to attach the receiver to.
        let pool =
            PagePool::new(RegisteredBuffer::host(page as usize, page as usize, false).unwrap());
        let ch = chan::open(ChannelKind::Tcp, "127.0.0.1", node, &[pool], None).unwrap();
        let hello = Hello {
            version: HANDSHAKE_VERSION,
            node: node.into(),
            role: Role::Sender,
            mode: rc.mode(),
            channel: ChannelKind::Tcp,
            lease,
            buffers: vec![BufferDesc {
                uuid,
                base: 0x10_0000,
                len: keys.len() as u64 * page,
                page_size: page,
                device: DeviceKind::Cpu,
            }],
            endpoint: Endpoint::Tcp { addr },
            clock_us: 0,
            incarnation: 0,
            tp: None,
            lib: None,
            model: None,
        };
        let ctx = zmq::Context::new();
        let init = format!("tcp://127.0.0.1:{}", rc.init_port(0).unwrap());
        handshake::connect(&ctx, &init, ch.as_ref(), &hello, Duration::from_secs(10)).unwrap();
        let pull_id = ascend_pd::protocol::PullId::due_in_this_process(Instant::now() + lease);
        let notif = pull_notif(
            layout,
            pull_id.encode(),
            &keys,
            (uuid, (0..keys.len() as u64).collect()),
            node,
            format!("127.0.0.1:{}", free_port()),
        );
        let ack = announce_pull(&ctx, rc, notif);
        assert!(!ack.alloc_failed, "{ack:?}");
        StallingSender {
            release,
            requests,
            served,
            keys,
            _ctx: ctx,
            _ch: ch,
        }
    }
}

/// Defect 2. A load whose first sender group's read is still running when
/// its lease ends gives that read up; the pages it was reading into stay
/// with the transfer (quarantined) — the next group reads into pages of its
/// own. When the stalled transfer finally writes its garbage, it lands in
/// those quarantined pages, never in the next group's data or the cache.
#[test]
fn an_abandoned_pipeline_read_never_corrupts_the_next_group() {
    abandoned_read(false);
    abandoned_read(true);
}

/// Staged: the given-up read keeps its two staging pages (quarantined)
/// until the stalled transfer ends. Direct (tcp into the host cache): the
/// read waits no longer than the lease, then its connection is dropped, so
/// what the stalled sender sends later lands nowhere; no page was lent.
fn abandoned_read(direct: bool) {
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::PullDelay, 16);
    let r = Receiver::start(&rc, 0).unwrap();
    let stalling = StallingSender::announce(&rc, keys("stall", 2), Duration::from_millis(1500));
    let s = Sender::start(
        &sender_config(ChannelKind::Tcp, TransferMode::PullDelay, 16),
        0,
        Default::default(),
    )
    .unwrap();
    let good = keys("good", 4);
    let c = chunks(&s, &good, CHUNK);
    s.put(&good, &c, &spec_for(&rc, "good", false)).unwrap();
    drop(c);
    let mut all = stalling.keys.clone();
    all.extend(good.iter().cloned());
    let cfg = r_layout_cache(&rc);
    let (mut cache, slots) = cfg(all.len() * CHUNK);
    let e = r
        .load_with(
            &all,
            &slots,
            &mut cache,
            &ascend_pd::pipeline::LoadOptions {
                max_depth: 2,
                direct,
                ..Default::default()
            },
        )
        .unwrap_err();
    let text = e.to_string();
    let ascend_pd::pipeline::LoadError::Incomplete { failed, report } = e else {
        panic!("{text}")
    };
    assert_eq!(report.loaded, good, "{text}");
    assert_eq!(failed.len(), 2, "{text}");
    assert!(failed[0].reason.contains("lease"), "{text}");
    // The given-up staged read still holds its two pages; a direct one
    // took none.
    let st = pool_stats(&r);
    let held = if direct { (0, 0) } else { (2, 2) };
    assert_eq!((st.allocated, st.quarantined), held, "{st:?}");
    assert_eq!(report.direct, if direct { 4 } else { 0 }, "{text}");
    let check = |cache: &mut ascend_pd::kv::KvCache| {
        let spec = *cache.spec();
        let tb = spec.token_bytes();
        for (i, k) in all.iter().enumerate() {
            let mut chunk = vec![0u8; rc.chunk_layout().page_bytes()];
            pattern::fill(&mut chunk, seed_of(k));
            for t in 0..CHUNK {
                let slot = slots[i * CHUNK + t] as usize;
                for plane in 0..spec.planes() {
                    for layer in 0..spec.layers {
                        let got = cache.token(layer, plane, slot).unwrap();
                        if i < 2 {
                            assert!(
                                got.iter().all(|&b| b == 0),
                                "{k}: a failed chunk reached the cache"
                            );
                        } else {
                            let at = ((plane * spec.layers + layer) * CHUNK + t) * tb;
                            assert_eq!(got, &chunk[at..at + tb], "{k} token {t}");
                        }
                    }
                }
            }
        }
    };
    check(&mut cache);
    // Now the stalled transfer delivers its garbage: into its own pages only.
    stalling.release.send(()).unwrap();
    // (A direct read asks for each run of a chunk: more requests, same bytes.)
    let served = stalling.served.join().unwrap();
    assert!(if direct { served >= 2 } else { served == 2 }, "{served}");
    wait_until("the stalled read to give its pages back", || {
        pool_stats(&r).allocated == 0
    });
    check(&mut cache);
    assert_eq!(pool_stats(&r).quarantined, 0);
    assert!(s.drain(Duration::from_secs(10)));
}

/// Eager reads are started and watched by one thread, never a thread per
/// pull, and a sender that stalls its reads holds up nobody else: with ten
/// pulls whose senders stall every read in flight at once, a real
/// sender's pull is read and lands before any stalled read gives up.
/// The stalled ones fail at their lease's end without a byte stored, and
/// every page comes back.
#[test]
fn stalled_eager_pulls_never_hold_up_another_senders_read() {
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::PullEager, 16);
    let r = Receiver::start(&rc, 0).unwrap();
    let stalled: Vec<StallingSender> = (0..10)
        .map(|i| {
            StallingSender::announce_as(
                &rc,
                &format!("stalling-{i}"),
                vec![format!("stalled-{i}")],
                Duration::from_millis(2500),
            )
        })
        .collect();
    let in_flight = || {
        stalled
            .iter()
            .map(|s| s.requests.load(std::sync::atomic::Ordering::SeqCst))
            .sum::<usize>()
    };
    assert!(eventually(Duration::from_secs(5), || in_flight() == 10));
    let readers = std::fs::read_dir("/proc/self/task")
        .unwrap()
        .filter_map(|t| std::fs::read_to_string(t.ok()?.path().join("comm")).ok())
        .filter(|name| name.trim() == "pd-eager-read")
        .count();
    assert_eq!(readers, 1);
    // A real sender's pull lands while all ten are still stalled.
    let s = Sender::start(
        &sender_config(ChannelKind::Tcp, TransferMode::PullEager, 16),
        0,
        Default::default(),
    )
    .unwrap();
    let good = keys("good", 2);
    let c = chunks(&s, &good, CHUNK);
    s.put(&good, &c, &spec_for(&rc, "good", true)).unwrap();
    drop(c);
    for k in &good {
        let got = r.get_wait(k, Duration::from_secs(10)).expect(k);
        assert!(holds(&got, k), "{k}");
    }
    assert_eq!(
        r.stats().store.failed_reads,
        0,
        "landed only after the stalls ended"
    );
    for k in &good {
        assert!(r.remove(k));
    }
    assert!(s.drain(Duration::from_secs(10)));
    // The leases end: the stalled reads are given up (their pages stay
    // with the transfers until those end).
    std::thread::sleep(Duration::from_millis(2600));
    assert!(eventually(Duration::from_secs(5), || r
        .stats()
        .store
        .failed_reads
        == 10));
    for st in stalled {
        st.release.send(()).unwrap();
        st.served.join().unwrap();
    }
    assert!(
        eventually(Duration::from_secs(10), || {
            let p = pool_stats(&r);
            (p.allocated, p.quarantined) == (0, 0)
        }),
        "{:?} {:?}",
        pool_stats(&r),
        r.stats().store
    );
    // Only the good pull's bytes were read; nothing stalled was stored.
    assert_eq!(r.stats().bytes_read, 2 * rc.page_bytes());
    assert_eq!(r.stats().store.resident, 0);
}

/// One stalled prefill never blocks another request's load into the same
/// engine cache: the load queue used to hold the cache's lock for a whole
/// load, network reads included, so every load of this decode worker
/// waited for the stalled sender's lease. Now the stalled request's load
/// is still running when the other one is done, every byte in place.
#[test]
fn a_stalled_senders_load_does_not_hold_up_another_requests_load() {
    use ascend_pd::requests::{Availability, LoadQueue, LoadRequest, Outcome, SharedKvCache};
    let rc = receiver_config(ChannelKind::Tcp, TransferMode::PullDelay, 16);
    let r = Arc::new(Receiver::start(&rc, 0).unwrap());
    let stalling = StallingSender::announce(&rc, keys("stall", 2), Duration::from_secs(60));
    let s = Sender::start(
        &sender_config(ChannelKind::Tcp, TransferMode::PullDelay, 16),
        0,
        Default::default(),
    )
    .unwrap();
    let good = keys("good", 2);
    let c = chunks(&s, &good, CHUNK);
    s.put(&good, &c, &spec_for(&rc, "good", false)).unwrap();
    drop(c);
    let loads = LoadQueue::new(Arc::clone(&r)).unwrap();
    assert!(eventually(Duration::from_secs(30), || loads
        .available(&good)
        == Availability::Ready));
    let (cache, slots) = r_layout_cache(&rc)(4 * CHUNK);
    let cache = SharedKvCache::new(cache);
    let load = |id: &str, keys: &[String], slots: &[i64]| {
        loads
            .submit(
                LoadRequest {
                    req_id: id.into(),
                    keys: keys.to_vec(),
                    slot_mapping: slots.to_vec(),
                },
                &cache,
            )
            .unwrap()
    };
    load("stalled", &stalling.keys, &slots[..2 * CHUNK]);
    wait_until("the stalled read to start", || {
        stalling.requests.load(std::sync::atomic::Ordering::SeqCst) > 0
    });
    load("good", &good, &slots[2 * CHUNK..]);
    let done = poll_until(|| loads.poll(), 1);
    assert_eq!(done.len(), 1, "the good load waited for the stalled one");
    assert_eq!(done[0].req_id, "good");
    assert_eq!(done[0].outcome, Outcome::Done, "{done:?}");
    assert_eq!(loads.in_flight(), (0, 1), "the stalled load still runs");

    // The stalled sender answers; its load ends too, and the good
    // request's bytes are where they belong.
    stalling.release.send(()).unwrap();
    let done = poll_until(|| loads.poll(), 1);
    assert_eq!(done.len(), 1);
    assert_eq!(done[0].req_id, "stalled");
    let mut cache = cache.lock();
    let spec = *cache.spec();
    let tb = spec.token_bytes();
    for (i, k) in good.iter().enumerate() {
        let mut chunk = vec![0u8; rc.chunk_layout().page_bytes()];
        pattern::fill(&mut chunk, seed_of(k));
        for t in 0..CHUNK {
            let slot = slots[(2 + i) * CHUNK + t] as usize;
            for plane in 0..spec.planes() {
                for layer in 0..spec.layers {
                    let at = ((plane * spec.layers + layer) * CHUNK + t) * tb;
                    let got = cache.token(layer, plane, slot).unwrap();
                    assert_eq!(got, &chunk[at..at + tb], "{k} token {t}");
                }
            }
        }
    }
    drop(cache);
    let _ = stalling.served.join();
    wait_until("every page back", || {
        let st = pool_stats(&r);
        st.allocated == 0 && st.quarantined == 0
    });
    assert!(s.drain(Duration::from_secs(10)));
}
