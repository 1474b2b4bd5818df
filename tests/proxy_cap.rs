//! Issue 25 item 8: a pull-delay sender pins a page of its pool per proxy
//! it holds on a receiver, so the receiver caps its proxies by its pages —
//! but by the pages the transfer channel verified it registered, not the
//! table it declares (a sender declaring an enormous table made the
//! receiver store proxies without bound). Each channel, with a sender that
//! declares more than it registered: shm refuses the table at attach, hccl
//! at setup (the cap is then 0), and tcp, which cannot verify a table,
//! bounds it by the receiver's own pages (at least 1024). Real sockets on
//! loopback; hccl against the CANN emulator.

mod common;

use ascend_pd::backend::Receiver;
use ascend_pd::channel::handshake::{self, Hello};
use ascend_pd::channel::{
    self as chan, Access, BufferDesc, ChannelError, Completion, Endpoint, GrantId, GrantStats,
    GrantTag, PeerId, ReadOp, TransferChannel, WriteOp,
};
use ascend_pd::config::{ChannelKind, PdConfig, Role, TransferMode};
use ascend_pd::memory::npu::AclRuntime;
use ascend_pd::memory::{BufferRef, MemObj, PagePool, RegisteredBuffer, SealedMemObj};
use ascend_pd::protocol::{Message, PullId, PullReadyDoneAck};
use common::*;
use std::sync::Arc;
use std::time::{Duration, Instant};
use uuid::Uuid;

const LEASE: Duration = Duration::from_secs(60);

fn emulator() -> AclRuntime {
    let dir = ascend_emu::install_dir().expect("the emulator is built as a dev-dependency");
    AclRuntime::from_dir(&dir).expect("the emulator loads")
}

/// A hand-made pull-delay sender: a real channel of `kind` over a pool of
/// `pages` pages, attached to the receiver with a hello whose table
/// `declare` may inflate (and whose endpoint it may change).
struct Liar {
    node: String,
    /// Announcements so far (each goes on a REQ socket of its own route).
    sent: std::cell::Cell<u32>,
    uuid: Uuid,
    ctx: zmq::Context,
    _pool: Arc<PagePool>,
    _channel: Arc<dyn TransferChannel>,
}

fn attach_liar(
    kind: ChannelKind,
    rc: &PdConfig,
    node: &str,
    pages: usize,
    declare: impl FnOnce(&mut Hello),
) -> Result<Liar, ChannelError> {
    attach_through(kind, rc, node, pages, declare, |c| c)
}

/// [`attach_liar`] with the channel the handshake uses wrapped by `wrap`.
fn attach_through(
    kind: ChannelKind,
    rc: &PdConfig,
    node: &str,
    pages: usize,
    declare: impl FnOnce(&mut Hello),
    wrap: impl FnOnce(Arc<dyn TransferChannel>) -> Arc<dyn TransferChannel>,
) -> Result<Liar, ChannelError> {
    let page = rc.page_bytes() as usize;
    let buf = match kind {
        k if k.needs_acl_memory() => {
            RegisteredBuffer::pinned_host(&emulator(), 0, pages * page, page)
        }
        _ => RegisteredBuffer::host(pages * page, page, kind == ChannelKind::Shm),
    }
    .unwrap();
    let pool = PagePool::new(buf);
    let channel = wrap(chan::open(kind, "127.0.0.1", node, &[Arc::clone(&pool)], None).unwrap());
    let mut hello = Hello::local(node, Role::Sender, rc.mode(), LEASE, channel.as_ref());
    let uuid = hello.buffers[0].uuid;
    declare(&mut hello);
    let ctx = zmq::Context::new();
    let init = format!("tcp://127.0.0.1:{}", rc.init_port(0).unwrap());
    handshake::connect(
        &ctx,
        &init,
        channel.as_ref(),
        &hello,
        Duration::from_secs(20),
    )?;
    Ok(Liar {
        node: node.into(),
        sent: std::cell::Cell::new(0),
        uuid,
        ctx,
        _pool: pool,
        _channel: channel,
    })
}

impl Liar {
    /// Announces `keys` at pages `first..` of its real buffer; whether the
    /// receiver took them.
    fn announce(&self, rc: &PdConfig, keys: &[String], first: u64) -> bool {
        let notif = pull_notif(
            rc.chunk_layout(),
            PullId::due_in_this_process(Instant::now() + LEASE).encode(),
            keys,
            (self.uuid, (first..first + keys.len() as u64).collect()),
            &self.node,
            format!("127.0.0.1:{}", free_port()),
        );
        // A socket per announcement, each under a route of its own (a
        // ROUTER ignores a new peer with the identity of one it still has).
        self.sent.set(self.sent.get() + 1);
        let req = self.ctx.socket(zmq::REQ).unwrap();
        req.set_identity(format!("{}#{}", self.node, self.sent.get()).as_bytes())
            .unwrap();
        req.set_rcvtimeo(20_000).unwrap();
        req.connect(&format!("tcp://127.0.0.1:{}", rc.alloc_port(0).unwrap()))
            .unwrap();
        req.send(Message::PullReadyNotif(notif).encode(), 0)
            .unwrap();
        let ack = PullReadyDoneAck::decode(&req.recv_bytes(0).unwrap()).unwrap();
        !ack.alloc_failed
    }
}

fn receiver(kind: ChannelKind) -> (Receiver, PdConfig) {
    let mut rc = receiver_config(kind, TransferMode::PullDelay, 4);
    // A notification may wait for the channel to verify its sender (hccl's
    // setup): this bounds the wait, it is never waited out.
    rc.alloc_fail_backoff_ttl = Duration::from_secs(30);
    (Receiver::start(&rc, 0).unwrap(), rc)
}

/// The receiver holds exactly `held` (as proxies), none of `refused`, and
/// no page of its own.
#[track_caller]
fn holds(r: &Receiver, held: &[String], refused: &[String], rejected: u64) {
    assert!(held.iter().all(|k| r.contains(k)), "accepted proxies stay");
    assert!(
        refused.iter().all(|k| !r.contains(k)),
        "nothing refused is stored"
    );
    assert_eq!(r.stats().store.rejected_pull_notifs, rejected);
    let p = r.stats().pools.cpu.unwrap();
    assert_eq!((p.allocated, p.pinned, p.quarantined), (0, 0, 0), "{p:?}");
}

/// tcp: nothing can verify what a sender's own process serves, so a
/// sender declaring 2^20 pages (on a 1-page pool) holds no more proxies
/// than the receiver's own pages, at least 1024 (the old cap: 2^20).
#[test]
fn a_tcp_sender_declaring_a_huge_table_is_capped_by_the_receivers_own_bound() {
    let (r, rc) = receiver(ChannelKind::Tcp);
    let liar = attach_liar(ChannelKind::Tcp, &rc, "tcp-liar", 1, |h| {
        h.buffers[0].len = h.buffers[0].page_size << 20;
    })
    .unwrap();
    let first = keys("tcp-cap-a", 1000);
    assert!(liar.announce(&rc, &first, 0), "within the cap");
    let over = keys("tcp-cap-b", 100);
    assert!(!liar.announce(&rc, &over, 1000), "1100 > 1024: refused");
    holds(&r, &first, &over, 1);
    // What fits under the cap still goes.
    let rest = keys("tcp-cap-c", 24);
    assert!(liar.announce(&rc, &rest, 2000));
    holds(&r, &rest, &over, 1);
}

/// hccl: setup proves the table inside memory the sender registered, no
/// two buffers overlapping. A sender listing its one real 4-page pool 50
/// times under other uuids (204 pages declared, all inside registered
/// memory) fails that setup, so none of its pages are verified and every
/// notification is refused; before, it could hold 204 proxies.
#[test]
fn an_hccl_sender_aliasing_its_pool_gets_no_proxies() {
    emulator();
    // hixl checks the table against the regions the peer's HIXL server
    // reported, as hccl does against the regions it enabled.
    for kind in [ChannelKind::Hccl, ChannelKind::Hixl] {
        let (r, rc) = receiver(kind);
        let liar = attach_liar(kind, &rc, &format!("{}-liar", kind.name()), 4, |h| {
            let real = h.buffers[0];
            h.buffers.extend((0..50).map(|_| BufferDesc {
                uuid: Uuid::new_v4(),
                ..real
            }));
        })
        .unwrap();
        let ks = keys(&format!("{}-alias", kind.name()), 8);
        assert!(
            !liar.announce(&rc, &ks, 0),
            "{kind:?}: refused: nothing verified"
        );
        holds(&r, &[], &ks, 1);
    }
}

/// hccl, honest: the cap is the pages setup verified (4), and a
/// notification that arrives while the receiver's setup may still run
/// waits for it rather than being refused.
#[test]
fn an_honest_hccl_sender_holds_as_many_proxies_as_its_registered_pages() {
    emulator();
    for kind in [ChannelKind::Hccl, ChannelKind::Hixl] {
        let (r, rc) = receiver(kind);
        let name = |what: &str| format!("{}-{what}", kind.name());
        let sender = attach_liar(kind, &rc, &name("honest"), 4, |_| {}).unwrap();
        let ks = keys(&name("honest"), 4);
        assert!(sender.announce(&rc, &ks, 0), "{kind:?}: within its 4 pages");
        let over = keys(&name("over"), 1);
        assert!(
            !sender.announce(&rc, &over, 0),
            "{kind:?}: a fifth proxy: refused"
        );
        holds(&r, &ks, &over, 1);
    }
}

/// shm: every buffer of the table is mapped from its own sealed memfd of
/// exactly its size, so a table larger than what the sender registered is
/// refused at attach: a buffer larger than its memfd, or one memfd listed
/// for two buffers (the second is new).
#[test]
fn an_shm_sender_declaring_more_than_it_mapped_is_refused_at_attach() {
    let (r, rc) = receiver(ChannelKind::Shm);
    let e = attach_liar(ChannelKind::Shm, &rc, "shm-liar", 2, |h| {
        h.buffers[0].len *= 1000;
    })
    .err()
    .expect("refused");
    assert!(e.to_string().contains("were announced"), "{e}");
    let e = attach_liar(ChannelKind::Shm, &rc, "shm-alias", 2, |h| {
        let real = h.buffers[0];
        h.buffers.push(BufferDesc {
            uuid: Uuid::new_v4(),
            ..real
        });
        if let Endpoint::Shm { fds, .. } = &mut h.endpoint {
            fds.push(fds[0]);
        }
    })
    .err()
    .expect("refused");
    assert!(e.to_string().contains("one memfd"), "{e}");
    // An honest one is capped at its 2 mapped pages.
    let honest = attach_liar(ChannelKind::Shm, &rc, "shm-honest", 2, |_| {}).unwrap();
    let ks = keys("shm-honest", 2);
    assert!(honest.announce(&rc, &ks, 0));
    let over = keys("shm-over", 1);
    assert!(!honest.announce(&rc, &over, 0));
    holds(&r, &ks, &over, 1);
}

/// A channel that holds its `attach` until told to go: the peer's side of
/// an hccl setup then waits for our liveness link.
struct HeldAttach {
    inner: Arc<dyn TransferChannel>,
    entered: crossbeam_channel::Sender<()>,
    go: crossbeam_channel::Receiver<()>,
}

impl TransferChannel for HeldAttach {
    fn kind(&self) -> ChannelKind {
        self.inner.kind()
    }
    fn local_table(&self) -> Vec<BufferDesc> {
        self.inner.local_table()
    }
    fn endpoint(&self) -> Endpoint {
        self.inner.endpoint()
    }
    fn offer(&self) -> Result<Option<Endpoint>, ChannelError> {
        self.inner.offer()
    }
    fn answer(&self, offered: &Endpoint) -> Option<Endpoint> {
        self.inner.answer(offered)
    }
    fn wait_ready(&self, peer: PeerId) -> Result<(), ChannelError> {
        self.inner.wait_ready(peer)
    }
    fn attach(
        &self,
        node: &str,
        table: &[BufferDesc],
        endpoint: &Endpoint,
    ) -> Result<PeerId, ChannelError> {
        self.entered.send(()).unwrap();
        self.go.recv().unwrap();
        self.inner.attach(node, table, endpoint)
    }
    fn detach(&self, peer: PeerId) {
        self.inner.detach(peer)
    }
    fn submit_read(
        &self,
        peer: PeerId,
        ops: Vec<ReadOp>,
    ) -> Result<Completion<MemObj>, ChannelError> {
        self.inner.submit_read(peer, ops)
    }
    fn submit_write(
        &self,
        peer: PeerId,
        tag: GrantTag,
        ops: Vec<WriteOp>,
    ) -> Result<Completion<SealedMemObj>, ChannelError> {
        self.inner.submit_write(peer, tag, ops)
    }
    fn grant(
        &self,
        peer: PeerId,
        access: Access,
        tag: GrantTag,
        pages: &[BufferRef],
    ) -> Result<GrantId, ChannelError> {
        self.inner.grant(peer, access, tag, pages)
    }
    fn release(&self, grant: GrantId) -> bool {
        self.inner.release(grant)
    }
    fn revoke(&self, grant: GrantId) {
        self.inner.revoke(grant)
    }
    fn is_quiescent(&self, grant: GrantId) -> bool {
        self.inner.is_quiescent(grant)
    }
    fn grant_stats(&self) -> GrantStats {
        self.inner.grant_stats()
    }
    fn auth(&self) -> Option<&ascend_pd::auth::Secret> {
        self.inner.auth()
    }
}

/// hccl: a notification that arrives while the receiver's setup with its
/// sender still runs (nothing verified yet) waits for it, as for pages,
/// and is then taken; it is not refused for a cap of 0.
#[test]
fn an_hccl_notification_before_the_receivers_setup_finished_waits_for_it() {
    emulator();
    let (r, rc) = receiver(ChannelKind::Hccl);
    let (entered_tx, entered) = crossbeam_channel::bounded(1);
    let (go, go_rx) = crossbeam_channel::bounded(1);
    let held = |inner| {
        Arc::new(HeldAttach {
            inner,
            entered: entered_tx,
            go: go_rx,
        }) as Arc<dyn TransferChannel>
    };
    let ks = keys("hccl-early", 3);
    std::thread::scope(|scope| {
        let attaching = scope.spawn(|| {
            attach_through(ChannelKind::Hccl, &rc, "hccl-early", 4, |_| {}, held).unwrap()
        });
        // The receiver attached us (it does before it answers) and its
        // setup waits for our liveness link, which we do not open yet.
        entered.recv_timeout(Duration::from_secs(20)).unwrap();
        let early = Liar {
            node: "hccl-early".into(),
            sent: std::cell::Cell::new(100),
            uuid: Uuid::nil(),
            ctx: zmq::Context::new(),
            _pool: PagePool::new(RegisteredBuffer::host(4096, 4096, false).unwrap()),
            _channel: chan::open(ChannelKind::Tcp, "127.0.0.1", "x", &[], None).unwrap(),
        };
        let (rc2, ks2) = (&rc, &ks);
        // Its pages are never read: the buffer it names does not matter.
        let announced = scope.spawn(move || early.announce(rc2, ks2, 0));
        let waited = eventually(Duration::from_secs(20), || {
            r.stats().waiting_for_pages == 1 || announced.is_finished()
        }) && !announced.is_finished();
        go.send(()).unwrap();
        let _sender = attaching.join().unwrap();
        let taken = announced.join().unwrap();
        assert!(waited, "the notification waits for the setup");
        assert!(taken, "taken once the setup verified its pages");
        holds(&r, &ks, &[], 0);
    });
}
