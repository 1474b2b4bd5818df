//! One conformance suite for every transfer channel, against a real peer
//! process (`ascend-bench channel-peer`) over loopback: every byte is
//! verified, bad references move nothing, a dead or silent peer is an
//! error in bounded time, and a mode mismatch is named on both sides.
//!
//! `hccl` and NPU pools run on the CANN emulator (`ascend-sys/emu`), in this
//! process and in the peer (`ASCEND_PD_CANN_LIB_DIR`); NPU pages are checked
//! by copying them to the host through ascend-sys. Nothing here ran on
//! Ascend hardware.

use ascend_pd::channel::handshake::{self, Hello};
use ascend_pd::channel::{
    self as chan, ChannelError, DirectRead, DirectWrite, GrantTag, PeerId, ReadOp, TransferChannel,
    WriteOp,
};
use ascend_pd::config::{ChannelKind, Role, TransferMode};
use ascend_pd::memory::npu::{self, AclRuntime};
use ascend_pd::memory::{
    pattern, BufferRef, ChunkLayout, ChunkMeta, DeviceKind, DeviceMemory, Dtype, MemFormat, MemObj,
    MemoryError, NpuRuntime, Page, PagePool, RegisteredBuffer, SealedMemObj,
};
use std::io::{BufRead, BufReader, Read, Write};
use std::path::PathBuf;
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::{Arc, OnceLock};
use std::time::{Duration, Instant};
use uuid::Uuid;

const KINDS: [ChannelKind; 4] = [
    ChannelKind::Shm,
    ChannelKind::Tcp,
    ChannelKind::Hccl,
    ChannelKind::Hixl,
];
/// The channels that move NPU pages.
const NPU_KINDS: [ChannelKind; 3] = [ChannelKind::Tcp, ChannelKind::Hccl, ChannelKind::Hixl];
const PAGE: usize = 64 << 10;
const PEER_SEED: u64 = 0xfeed;

/// Where a pool lives.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Dev {
    Cpu,
    /// NPU 0 of the emulator.
    Npu,
}

impl Dev {
    fn name(self) -> &'static str {
        match self {
            Dev::Cpu => "cpu",
            Dev::Npu => "npu",
        }
    }
}

fn emulator_dir() -> &'static PathBuf {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| ascend_emu::install_dir().expect("the emulator is a dev-dependency"))
}

/// This process's CANN runtime: the emulator.
fn runtime() -> &'static AclRuntime {
    static RT: OnceLock<AclRuntime> = OnceLock::new();
    RT.get_or_init(|| AclRuntime::from_dir(emulator_dir()).expect("the emulator loads"))
}

/// A pool for `kind` on `dev`: memfd for shm, ACL-pinned host for hccl,
/// emulated NPU memory for `Dev::Npu`.
fn pool_on(kind: ChannelKind, dev: Dev, bytes: usize, page: usize) -> Arc<PagePool> {
    let buf = match (dev, kind) {
        (Dev::Npu, _) => RegisteredBuffer::npu(runtime(), 0, bytes, page).unwrap(),
        (Dev::Cpu, k) if k.needs_acl_memory() => {
            RegisteredBuffer::pinned_host(runtime(), 0, bytes, page).unwrap()
        }
        (Dev::Cpu, _) => RegisteredBuffer::host(bytes, page, kind == ChannelKind::Shm).unwrap(),
    };
    PagePool::new(buf)
}

/// The first `len` bytes of a page, wherever it lives.
fn page_bytes(o: &Page, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    npu::read_page(o, 0, &mut v).unwrap();
    v
}

struct Peer {
    child: Child,
    url: String,
    out: BufReader<ChildStdout>,
}

impl Peer {
    fn spawn(kind: ChannelKind, pages: usize, page: usize, mode: &str, node: &str) -> Peer {
        Peer::spawn_on(kind, Dev::Cpu, pages, page, mode, node)
    }

    fn spawn_on(
        kind: ChannelKind,
        dev: Dev,
        pages: usize,
        page: usize,
        mode: &str,
        node: &str,
    ) -> Peer {
        let mut child = Command::new(env!("CARGO_BIN_EXE_ascend-bench"))
            .env("ASCEND_PD_CANN_LIB_DIR", emulator_dir())
            .args([
                "channel-peer",
                &format!("--channel={}", kind.name()),
                &format!("--pages={pages}"),
                &format!("--page-bytes={page}"),
                &format!("--seed={PEER_SEED}"),
                &format!("--mode={mode}"),
                &format!("--node={node}"),
                &format!("--device={}", dev.name()),
            ])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .spawn()
            .unwrap();
        let mut out = BufReader::new(child.stdout.take().unwrap());
        let mut line = String::new();
        out.read_line(&mut line).unwrap();
        let url = line.strip_prefix("READY ").expect(&line).trim().to_string();
        Peer { child, url, out }
    }

    fn line(&mut self) -> String {
        let mut l = String::new();
        self.out.read_line(&mut l).unwrap();
        l
    }

    fn kill(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Peer {
    fn drop(&mut self) {
        if let Some(mut s) = self.child.stdin.take() {
            let _ = s.flush();
        }
        self.kill();
    }
}

fn layout(bytes: usize) -> ChunkLayout {
    ChunkLayout {
        fmt: MemFormat::Kv2Ltd,
        layers: 1,
        tokens: 1,
        hidden: bytes / 4,
        dtype: Dtype::BFloat16,
    }
}

struct Local {
    pool: Arc<PagePool>,
    channel: Arc<dyn TransferChannel>,
    objs: Vec<MemObj>,
}

fn local(kind: ChannelKind, pages: usize) -> Local {
    local_on(kind, Dev::Cpu, pages)
}

fn local_on(kind: ChannelKind, dev: Dev, pages: usize) -> Local {
    let pool = pool_on(kind, dev, pages * PAGE, PAGE);
    let objs = pool
        .allocate_batch(&vec![ChunkMeta::full(layout(PAGE)); pages])
        .unwrap();
    let channel = chan::open(kind, "127.0.0.1", NODE, &[Arc::clone(&pool)], None).unwrap();
    Local {
        pool,
        channel,
        objs,
    }
}

/// The node id these tests present to the peer.
const NODE: &str = "tester";

fn hello(ch: &dyn TransferChannel, mode: TransferMode) -> Hello {
    Hello::local(NODE, Role::Sender, mode, Duration::from_secs(30), ch)
}

fn connect(ctx: &zmq::Context, l: &Local, peer: &Peer) -> (PeerId, Uuid) {
    let a = handshake::connect(
        ctx,
        &peer.url,
        l.channel.as_ref(),
        &hello(l.channel.as_ref(), TransferMode::Push),
        Duration::from_secs(10),
    )
    .unwrap();
    (a.peer, a.remote.buffers[0].uuid)
}

/// Reads into `pages` (which the ops own), page `i` from the peer's page `page(i)`.
fn reads(pages: Vec<MemObj>, uuid: Uuid, page: impl Fn(usize) -> u32) -> Vec<ReadOp> {
    pages
        .into_iter()
        .enumerate()
        .map(|(i, local)| ReadOp {
            local,
            remote: BufferRef {
                uuid,
                page: page(i),
            },
            local_offset: 0,
            remote_offset: 0,
            len: PAGE,
        })
        .collect()
}

/// Writes of sealed `pages`, page `i` to the peer's page `page(i)`, `len(i)` bytes.
fn writes(
    pages: &[SealedMemObj],
    uuid: Uuid,
    page: impl Fn(usize) -> u32,
    len: impl Fn(usize) -> usize,
) -> Vec<WriteOp> {
    pages
        .iter()
        .enumerate()
        .map(|(i, p)| WriteOp {
            local: p.clone(),
            remote: BufferRef {
                uuid,
                page: page(i),
            },
            local_offset: 0,
            remote_offset: 0,
            len: len(i),
        })
        .collect()
}

fn host(o: &MemObj) -> &[u8] {
    o.host_bytes().unwrap()
}

fn peer_page_ok(o: &MemObj, page: u32, len: usize) -> bool {
    pattern::first_mismatch(
        &page_bytes(o, len),
        pattern::page_seed(PEER_SEED, u64::from(page)),
    )
    .is_none()
}

/// Waits (bounded) until `pool` holds nothing: no page allocated or quarantined.
fn settles(pool: &PagePool) -> bool {
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let s = pool.stats();
        if s.allocated == 0 && s.quarantined == 0 {
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn batches_of_1_to_64_ops_move_every_byte_both_ways() {
    for kind in KINDS {
        let peer = Peer::spawn(kind, 64, PAGE, "push", "peer");
        let ctx = zmq::Context::new();
        let mut l = local(kind, 128);
        let (pid, uuid) = connect(&ctx, &l, &peer);

        // Reads of batches of 1, 7 and 64 ops, every byte checked against the peer's pattern.
        for n in [1usize, 7, 64] {
            let pages: Vec<MemObj> = l.objs.drain(..n).collect();
            let back = l
                .channel
                .read(pid, reads(pages, uuid, |i| (63 - i) as u32))
                .unwrap();
            for (i, o) in back.iter().enumerate() {
                assert!(
                    peer_page_ok(o, (63 - i) as u32, PAGE),
                    "{kind:?} n={n} i={i}"
                );
            }
            l.objs.splice(0..0, back);
        }

        // Writes, full pages and a partial last chunk, then read back into other pages.
        let seed = 0xabc;
        let mut src: Vec<MemObj> = l.objs.drain(..64).collect();
        for (i, o) in src.iter_mut().enumerate() {
            pattern::fill(
                o.host_bytes_mut().unwrap(),
                pattern::page_seed(seed, i as u64),
            );
        }
        let src: Vec<SealedMemObj> = src.into_iter().map(MemObj::seal).collect();
        let partial = PAGE / 3 + 5;
        let len = |i: usize| if i == 63 { partial } else { PAGE };
        l.channel
            .write(
                pid,
                GrantTag::UNTAGGED,
                writes(&src, uuid, |i| i as u32, len),
            )
            .unwrap();
        let back_pages: Vec<MemObj> = l.objs.drain(..64).collect();
        let back = l
            .channel
            .read(pid, reads(back_pages, uuid, |i| i as u32))
            .unwrap();
        for (i, b) in back.iter().enumerate() {
            assert_eq!(
                pattern::first_mismatch(&host(b)[..len(i)], pattern::page_seed(seed, i as u64)),
                None,
                "{kind:?} page {i}"
            );
            if i == 63 {
                // Only the partial chunk's bytes travelled: the rest of the page is untouched.
                let full = host(b);
                let mut expect = vec![0u8; PAGE];
                pattern::fill(&mut expect, pattern::page_seed(PEER_SEED, 63));
                assert_eq!(&full[partial..], &expect[partial..], "{kind:?}");
            }
        }
        drop((src, back));
        assert!(settles(&l.pool), "{kind:?}");
    }
}

#[test]
fn submitted_reads_can_be_awaited_out_of_order_and_give_their_pages_back() {
    for kind in KINDS {
        let peer = Peer::spawn(kind, 48, PAGE, "push", "peer");
        let ctx = zmq::Context::new();
        let mut l = local(kind, 48);
        let (pid, uuid) = connect(&ctx, &l, &peer);
        let mut batches: Vec<_> = (0..3)
            .map(|b| {
                let pages: Vec<MemObj> = l.objs.drain(..16).collect();
                let ops = reads(pages, uuid, |i| (b * 16 + i) as u32);
                Some(l.channel.submit_read(pid, ops).unwrap())
            })
            .collect();
        for b in [2usize, 0, 1] {
            let mut c = batches[b].take().unwrap();
            let done = c.wait_timeout(Duration::from_secs(20)).expect("finished");
            done.result.unwrap();
            assert_eq!(done.pages.len(), 16, "{kind:?}: the pages come back");
            for (i, o) in done.pages.iter().enumerate() {
                assert!(
                    peer_page_ok(o, (b * 16 + i) as u32, PAGE),
                    "{kind:?} batch {b}"
                );
            }
            // A finished completion has nothing more to give.
            assert!(c.poll().is_some_and(|d| d.pages.is_empty()));
        }
        assert!(settles(&l.pool), "{kind:?}");
    }
}

#[test]
fn bad_references_are_rejected_and_nothing_is_written() {
    for kind in KINDS {
        let peer = Peer::spawn(kind, 4, PAGE, "push", "peer");
        let ctx = zmq::Context::new();
        let mut l = local(kind, 4);
        let (pid, uuid) = connect(&ctx, &l, &peer);
        let back: Vec<MemObj> = l.objs.split_off(2);
        for o in &mut l.objs {
            o.host_bytes_mut().unwrap().fill(0xEE);
        }
        let src: Vec<SealedMemObj> = l.objs.drain(..).map(MemObj::seal).collect();
        let op = |i: usize, uuid: Uuid, page: u32, len: usize| WriteOp {
            local: src[i].clone(),
            remote: BufferRef { uuid, page },
            local_offset: 0,
            remote_offset: 0,
            len,
        };
        let cases: Vec<(Vec<WriteOp>, &str)> = vec![
            (
                vec![op(0, uuid, 0, PAGE), op(1, Uuid::new_v4(), 1, PAGE)],
                "unknown buffer",
            ),
            (
                vec![op(0, uuid, 0, PAGE), op(1, uuid, 4, PAGE)],
                "page 4 out of range",
            ),
            (
                vec![op(0, uuid, 0, PAGE), op(1, uuid, 1, PAGE + 1)],
                "exceed",
            ),
        ];
        for (ops, words) in cases {
            let e = l.channel.write(pid, GrantTag::UNTAGGED, ops).unwrap_err();
            let text = e.to_string();
            assert!(
                text.contains("op 1") && text.contains(words),
                "{kind:?}: {text}"
            );
            assert!(
                matches!(e, ChannelError::BadRef { op: 1, .. }),
                "{kind:?}: {e:?}"
            );
        }
        // Op 0 of every rejected batch was valid, but nothing moved: peer pages 0 and 1 keep the pattern.
        let back = l
            .channel
            .read(pid, reads(back, uuid, |i| i as u32))
            .unwrap();
        assert!(peer_page_ok(&back[0], 0, PAGE), "{kind:?}");
        assert!(peer_page_ok(&back[1], 1, PAGE), "{kind:?}");
        // Unknown peers are refused by name.
        let e = l.channel.read(PeerId(9999), vec![]).unwrap_err();
        assert!(e.to_string().contains("peer#9999 is not attached"), "{e}");
        drop((src, back));
        assert!(settles(&l.pool), "{kind:?}");
    }
}

#[test]
fn a_peer_killed_mid_batch_is_an_error_in_bounded_time() {
    let cases = [
        (ChannelKind::Shm, Dev::Cpu),
        (ChannelKind::Tcp, Dev::Cpu),
        (ChannelKind::Hccl, Dev::Cpu),
        (ChannelKind::Hixl, Dev::Cpu),
        (ChannelKind::Tcp, Dev::Npu),
        (ChannelKind::Hccl, Dev::Npu),
        (ChannelKind::Hixl, Dev::Npu),
    ];
    for (kind, dev) in cases {
        let mut peer = Peer::spawn_on(kind, dev, 64, 1 << 20, "push", "peer");
        let ctx = zmq::Context::new();
        let pool = pool_on(kind, dev, 64 << 20, 1 << 20);
        let objs: Vec<SealedMemObj> = pool
            .allocate_batch(&vec![ChunkMeta::full(layout(1 << 20)); 64])
            .unwrap()
            .into_iter()
            .map(MemObj::seal)
            .collect();
        let channel = chan::open(kind, "127.0.0.1", NODE, &[Arc::clone(&pool)], None).unwrap();
        let a = handshake::connect(
            &ctx,
            &peer.url,
            channel.as_ref(),
            &hello(channel.as_ref(), TransferMode::Push),
            Duration::from_secs(10),
        )
        .unwrap();
        let uuid = a.remote.buffers[0].uuid;
        // Writes share their sealed sources, so many batches can be in flight.
        let ops = |n: usize| writes(&objs[..n], uuid, |i| i as u32, |_| 1 << 20);
        let mut inflight: Vec<_> = (0..8)
            .map(|_| {
                channel
                    .submit_write(a.peer, GrantTag::UNTAGGED, ops(64))
                    .unwrap()
            })
            .collect();
        std::thread::sleep(Duration::from_millis(5));
        peer.kill();
        let start = Instant::now();
        for c in &mut inflight {
            c.wait_timeout(Duration::from_secs(15)).expect("no hang");
        }
        // Whatever finished before the kill, the next batch must fail.
        let e = channel
            .write(a.peer, GrantTag::UNTAGGED, ops(4))
            .expect_err("a batch to a dead peer must fail");
        assert!(
            matches!(
                e,
                ChannelError::PeerGone { .. } | ChannelError::Timeout { .. }
            ),
            "{kind:?} {dev:?}: {e}"
        );
        assert!(e.to_string().contains("peer"), "{kind:?} {dev:?}: {e}");
        if kind.needs_acl_memory() {
            // HCCL and HIXL copies into a dead peer's mapping succeed in the
            // emulator: the liveness link is what must catch it.
            assert!(
                matches!(e, ChannelError::PeerGone { .. })
                    && e.to_string().contains("liveness link"),
                "{dev:?}: {e}"
            );
        }
        assert!(start.elapsed() < Duration::from_secs(30));
        drop(inflight);
        drop(objs);
        assert!(
            settles(&pool),
            "{kind:?} {dev:?}: pages returned: {:?}",
            pool.stats()
        );
    }
}

/// `gone_peers` names a peer only once its process is gone: never while
/// it runs, and, after a kill, within a few seconds where the channel can
/// tell (shm: the pidfd; hccl: the liveness link). tcp cannot tell.
#[test]
fn a_peer_is_reported_gone_only_once_its_process_is() {
    for kind in KINDS {
        let mut peer = Peer::spawn(kind, 4, PAGE, "push", "peer");
        let ctx = zmq::Context::new();
        let l = local(kind, 4);
        let (id, _) = connect(&ctx, &l, &peer);
        let live = Instant::now() + Duration::from_millis(600);
        while Instant::now() < live {
            assert!(
                l.channel.gone_peers().is_empty(),
                "{kind:?}: a live peer reported gone"
            );
            std::thread::sleep(Duration::from_millis(50));
        }
        peer.kill();
        // tcp cannot tell: a short look suffices to show it says nothing.
        let window = match kind {
            ChannelKind::Tcp => Duration::from_secs(1),
            _ => Duration::from_secs(10),
        };
        let end = Instant::now() + window;
        let seen = loop {
            if l.channel.gone_peers() == vec![id] {
                break true;
            }
            if Instant::now() > end {
                break false;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        match kind {
            ChannelKind::Tcp => assert!(!seen, "tcp cannot tell"),
            _ => assert!(seen, "{kind:?}: the dead peer was not reported"),
        }
        l.channel.detach(id);
        assert!(l.channel.gone_peers().is_empty(), "{kind:?}: detached");
    }
}

#[test]
fn a_mode_mismatch_is_named_on_both_sides() {
    for kind in KINDS {
        let mut peer = Peer::spawn(kind, 2, PAGE, "pull-delay", "decoder-1");
        let ctx = zmq::Context::new();
        let l = local(kind, 2);
        let e = handshake::connect(
            &ctx,
            &peer.url,
            l.channel.as_ref(),
            &hello(l.channel.as_ref(), TransferMode::PullEager),
            Duration::from_secs(10),
        )
        .unwrap_err();
        let text = e.to_string();
        assert!(matches!(e, ChannelError::ModeMismatch { .. }), "{text}");
        assert!(
            text.contains("pull-eager") && text.contains("pull-delay"),
            "{text}"
        );
        assert!(text.contains("decoder-1"), "names the peer: {text}");
        let line = peer.line();
        assert!(line.starts_with("REFUSED"), "{line}");
        assert!(
            line.contains("pull-eager") && line.contains("pull-delay"),
            "{line}"
        );
    }
}

#[test]
fn a_silent_peer_is_a_timeout_not_a_hang() {
    let l = local(ChannelKind::Tcp, 1);
    let ctx = zmq::Context::new();
    // A bound port that never answers a hello.
    let silent = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("tcp://{}", silent.local_addr().unwrap());
    let start = Instant::now();
    let e = handshake::connect(
        &ctx,
        &url,
        l.channel.as_ref(),
        &hello(l.channel.as_ref(), TransferMode::Push),
        Duration::from_millis(300),
    )
    .unwrap_err();
    assert!(matches!(e, ChannelError::Timeout { .. }), "{e}");
    assert!(e.to_string().contains("no answer within 300ms"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(5));
}

#[test]
fn reconnecting_to_a_restarted_peer_replaces_the_old_connection() {
    for kind in KINDS {
        let ctx = zmq::Context::new();
        let l = local(kind, 2);
        let mut first = Peer::spawn(kind, 2, PAGE, "push", "decoder-0");
        let (old, _) = connect(&ctx, &l, &first);
        first.kill();
        let second = Peer::spawn(kind, 2, PAGE, "push", "decoder-0");
        let (new, uuid) = connect(&ctx, &l, &second);
        assert_ne!(old, new);
        let mut l = l;
        let page = l.objs.pop().unwrap();
        let e = l
            .channel
            .read(old, reads(vec![page], uuid, |_| 0))
            .unwrap_err();
        assert!(matches!(e, ChannelError::UnknownPeer(p) if p == old), "{e}");
        let page = l.objs.pop().unwrap();
        let back = l.channel.read(new, reads(vec![page], uuid, |_| 1)).unwrap();
        assert!(peer_page_ok(&back[0], 1, PAGE));
    }
}

/// A garbage frame on the init port is refused with a reason and nothing
/// else: no buffer table, no address, no endpoint (issue 11: it used to
/// get the whole table, and with it every page of the pools).
#[test]
fn a_malformed_hello_is_refused_without_the_table_and_the_server_keeps_serving() {
    let peer = Peer::spawn(ChannelKind::Tcp, 1, PAGE, "push", "peer");
    let ctx = zmq::Context::new();
    let mut l = local(ChannelKind::Tcp, 1);
    let a = handshake::connect(
        &ctx,
        &peer.url,
        l.channel.as_ref(),
        &hello(l.channel.as_ref(), TransferMode::Push),
        Duration::from_secs(10),
    )
    .unwrap();
    let chan::Endpoint::Tcp { addr } = &a.remote.endpoint else {
        panic!("tcp endpoint")
    };
    let secrets = [
        a.remote.buffers[0].uuid.simple().to_string(),
        addr.clone(),
        "buffers".into(),
        "endpoint".into(),
    ];
    let req = ctx.socket(zmq::REQ).unwrap();
    req.set_rcvtimeo(5000).unwrap();
    req.connect(&peer.url).unwrap();
    req.send(&b"\x93garbage"[..], 0).unwrap();
    let reply = req.recv_bytes(0).unwrap();
    assert!(Hello::decode(&reply).is_err(), "a refusal, not a hello");
    let text = String::from_utf8_lossy(&reply);
    assert!(text.contains("malformed hello"), "{text}");
    for s in &secrets {
        assert!(!text.contains(s.as_str()), "the refusal leaks {s}: {text}");
    }
    // The same server still attaches a well-formed peer.
    let (pid, uuid) = connect(&ctx, &l, &peer);
    let page = l.objs.pop().unwrap();
    let back = l.channel.read(pid, reads(vec![page], uuid, |_| 0)).unwrap();
    assert!(peer_page_ok(&back[0], 0, PAGE));
}

/// Host memory posing as device memory, only to reach the channels' refusal paths.
#[derive(Debug)]
struct FakeDeviceMemory(Vec<u8>);

impl DeviceMemory for FakeDeviceMemory {
    fn device_ptr(&self) -> u64 {
        self.0.as_ptr() as u64
    }
    fn len(&self) -> usize {
        self.0.len()
    }
    fn device_index(&self) -> u32 {
        0
    }
}

struct FakeNpu;

impl NpuRuntime for FakeNpu {
    fn alloc(&self, _device: u32, len: usize) -> Result<Box<dyn DeviceMemory>, MemoryError> {
        Ok(Box::new(FakeDeviceMemory(vec![0; len])))
    }
    fn describe(&self) -> String {
        "test double".into()
    }
}

#[test]
fn an_npu_pool_on_shm_is_a_clear_configuration_error() {
    let buf = RegisteredBuffer::npu(&FakeNpu, 0, PAGE, PAGE).unwrap();
    assert_eq!(buf.device(), DeviceKind::Npu(0));
    let pool = PagePool::new(buf);
    let e = chan::open(ChannelKind::Shm, "127.0.0.1", NODE, &[pool], None)
        .err()
        .unwrap();
    let text = e.to_string();
    assert!(
        text.contains("host memory only") && text.contains("pd_buffer_device: cpu"),
        "{text}"
    );
}

#[test]
fn cpu_and_npu_pools_move_every_byte_in_all_four_directions() {
    const PAGES: usize = 8;
    let dirs = [
        (Dev::Cpu, Dev::Cpu),
        (Dev::Cpu, Dev::Npu),
        (Dev::Npu, Dev::Cpu),
        (Dev::Npu, Dev::Npu),
    ];
    for kind in NPU_KINDS {
        for (mine, theirs) in dirs {
            let what = format!("{kind:?} local {mine:?} -> peer {theirs:?}");
            let peer = Peer::spawn_on(kind, theirs, PAGES, PAGE, "push", "peer");
            let ctx = zmq::Context::new();
            let l = local_on(kind, mine, 2 * PAGES);
            let start = l.pool.stats();
            let (pid, uuid) = connect(&ctx, &l, &peer);

            // Read every peer page into local pages in reverse order.
            let mut l = l;
            let pages: Vec<MemObj> = l.objs.drain(..PAGES).collect();
            let mut got = l
                .channel
                .read(pid, reads(pages, uuid, |i| (PAGES - 1 - i) as u32))
                .unwrap();
            for (i, o) in got.iter().enumerate() {
                assert!(
                    peer_page_ok(o, (PAGES - 1 - i) as u32, PAGE),
                    "{what}: read page {i}"
                );
            }

            // Write a new pattern (the last chunk partial), read it back elsewhere.
            let seed = 0x5eed;
            let mut buf = vec![0u8; PAGE];
            for (i, o) in got.iter_mut().enumerate() {
                pattern::fill(&mut buf, pattern::page_seed(seed, i as u64));
                npu::write_page(o, 0, &buf).unwrap();
            }
            let src: Vec<SealedMemObj> = got.into_iter().map(MemObj::seal).collect();
            let partial = PAGE / 3 + 5;
            let len = |i: usize| if i == PAGES - 1 { partial } else { PAGE };
            l.channel
                .write(
                    pid,
                    GrantTag::UNTAGGED,
                    writes(&src, uuid, |i| i as u32, len),
                )
                .unwrap();
            let back_pages: Vec<MemObj> = l.objs.drain(..PAGES).collect();
            let back = l
                .channel
                .read(pid, reads(back_pages, uuid, |i| i as u32))
                .unwrap();
            for (i, b) in back.iter().enumerate() {
                let got = page_bytes(b, PAGE);
                assert_eq!(
                    pattern::first_mismatch(&got[..len(i)], pattern::page_seed(seed, i as u64)),
                    None,
                    "{what}: page {i}"
                );
                if i == PAGES - 1 {
                    // Only the partial chunk travelled: the rest is still the peer's pattern.
                    let mut expect = vec![0u8; PAGE];
                    pattern::fill(&mut expect, pattern::page_seed(PEER_SEED, i as u64));
                    assert_eq!(&got[partial..], &expect[partial..], "{what}");
                }
            }

            // A bad reference after a valid op: refused, and the valid op moved nothing.
            let e = l
                .channel
                .write(
                    pid,
                    GrantTag::UNTAGGED,
                    writes(&src[..2], uuid, |i| (i * PAGES) as u32, |_| PAGE),
                )
                .unwrap_err();
            assert!(
                matches!(e, ChannelError::BadRef { op: 1, .. })
                    && e.to_string().contains("out of range"),
                "{what}: {e}"
            );
            let mut back = back;
            let one = back.pop().unwrap();
            let one = l.channel.read(pid, reads(vec![one], uuid, |_| 0)).unwrap();
            assert_eq!(
                pattern::first_mismatch(&page_bytes(&one[0], PAGE), pattern::page_seed(seed, 0)),
                None,
                "{what}: peer page 0 kept the written pattern"
            );

            drop((src, back, one));
            assert!(settles(&l.pool), "{what}: pages returned");
            assert_eq!(start.allocated, 2 * PAGES);
        }
    }
}

/// hccl and hixl read straight into NPU memory only once it is registered
/// with the channel (the emulator, like HCCL and HIXL, refuses a local
/// range outside registered memory), every byte lands where asked, and
/// dropping the registration deregisters it (hccl: on the communicator,
/// registering the same memory again then succeeds, which the emulator
/// refuses for memory still registered; hixl: the direct client that had
/// it is destroyed and the next read makes a new one).
#[test]
fn direct_reads_land_only_in_registered_npu_memory() {
    for kind in [ChannelKind::Hccl, ChannelKind::Hixl] {
        direct_reads_land_only_in_registered_npu_memory_on(kind);
    }
}

fn direct_reads_land_only_in_registered_npu_memory_on(kind: ChannelKind) {
    let peer = Peer::spawn_on(kind, Dev::Cpu, 4, PAGE, "push", "peer");
    let ctx = zmq::Context::new();
    let l = local_on(kind, Dev::Npu, 2);
    let (pid, uuid) = connect(&ctx, &l, &peer);
    let ch = l.channel.as_ref();
    let npu0 = DeviceKind::Npu(0);
    assert!(ch.reads_direct(npu0) && !ch.reads_direct(DeviceKind::Cpu));
    let id = ch.direct_registry().expect("registers direct targets");

    let dev = runtime().device(0).unwrap();
    let cache = dev.alloc(2 * PAGE).unwrap();
    cache.fill(0, 2 * PAGE, 0).unwrap();
    let base = cache.addr() as usize;
    // Peer page 3 (a slice of it) to the start, peer page 1 whole to the
    // second half.
    let ops = [
        DirectRead {
            remote: BufferRef { uuid, page: 3 },
            offset: 4096,
            dst: base,
            len: PAGE - 8192,
        },
        DirectRead {
            remote: BufferRef { uuid, page: 1 },
            offset: 0,
            dst: base + PAGE,
            len: PAGE,
        },
    ];
    let deadline = Instant::now() + Duration::from_secs(30);
    let read = |ops: &[DirectRead]| {
        // SAFETY: the ranges are inside `cache`, which only this test uses
        // and which outlives every call.
        unsafe { ch.read_direct(pid, ops, deadline) }
    };
    let err = read(&ops).unwrap_err().to_string();
    assert!(err.contains("not in memory registered"), "{err}");

    for round in 0..2 {
        // SAFETY: the region is `cache`, device memory of NPU 0 allocated by
        // the runtime, which outlives the registration.
        let reg = unsafe { ch.register_direct(npu0, &[(base, 2 * PAGE)]) }
            .unwrap()
            .expect("hands back a registration");
        assert_eq!(reg.channel(), id);
        // SAFETY: as above.
        let twice = unsafe { ch.register_direct(npu0, &[(base + PAGE, PAGE)]) };
        assert!(
            twice.unwrap_err().to_string().contains("overlaps"),
            "round {round}"
        );
        read(&ops).unwrap();
        let mut got = vec![0u8; 2 * PAGE];
        cache.copy_to_host(0, &mut got).unwrap();
        let mut want = vec![0u8; PAGE];
        pattern::fill(&mut want, pattern::page_seed(PEER_SEED, 3));
        assert!(
            got[..PAGE - 8192] == want[4096..PAGE - 4096],
            "round {round}: slice"
        );
        assert!(
            got[PAGE - 8192..PAGE].iter().all(|&b| b == 0),
            "round {round}: past the slice"
        );
        pattern::fill(&mut want, pattern::page_seed(PEER_SEED, 1));
        assert!(got[PAGE..] == want[..], "round {round}: whole page");
        // A range past the registered memory is refused before any byte moves.
        let past = [DirectRead {
            dst: base + PAGE + 1,
            ..ops[1]
        }];
        let err = read(&past).unwrap_err().to_string();
        assert!(err.contains("not in memory registered"), "{err}");
        cache.fill(0, 2 * PAGE, 0).unwrap();
        drop(reg);
        let err = read(&ops).unwrap_err().to_string();
        assert!(
            err.contains("not in memory registered"),
            "round {round}: {err}"
        );
    }
    // A cache registered after a direct read already connected (hixl:
    // after the direct client was made without it) is read into too.
    // SAFETY: as above.
    let first = unsafe { ch.register_direct(npu0, &[(base, 2 * PAGE)]) }.unwrap();
    read(&ops).unwrap();
    let later = dev.alloc(PAGE).unwrap();
    later.fill(0, PAGE, 0).unwrap();
    // SAFETY: `later` is device memory of NPU 0 that outlives the registration.
    let second = unsafe { ch.register_direct(npu0, &[(later.addr() as usize, PAGE)]) }.unwrap();
    let into_later = [DirectRead {
        dst: later.addr() as usize,
        ..ops[1]
    }];
    read(&into_later).unwrap();
    let mut got = vec![0u8; PAGE];
    later.copy_to_host(0, &mut got).unwrap();
    let mut want = vec![0u8; PAGE];
    pattern::fill(&mut want, pattern::page_seed(PEER_SEED, 1));
    assert!(got == want, "{kind:?}: the later cache got peer page 1");
    drop((first, second));
    // SAFETY: not registered (refused before anything happens).
    let host = unsafe { ch.register_direct(DeviceKind::Cpu, &[(base, PAGE)]) };
    assert!(host.unwrap_err().to_string().contains("NPU 0"));
    drop(l.objs);
    assert!(settles(&l.pool));
    drop(peer);
}

#[test]
fn hccl_refuses_pools_the_acl_runtime_did_not_allocate() {
    let buf = RegisteredBuffer::host(PAGE, PAGE, false).unwrap();
    let e = chan::open(
        ChannelKind::Hccl,
        "127.0.0.1",
        NODE,
        &[PagePool::new(buf)],
        None,
    )
    .err()
    .unwrap()
    .to_string();
    assert!(
        e.contains("allocated by the ACL runtime") && e.contains("transfer_channel: tcp"),
        "{e}"
    );
}

#[test]
fn a_peer_without_cann_says_how_to_fix_it() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_ascend-bench"))
        .env("ASCEND_PD_CANN_LIB_DIR", "/nonexistent/cann/lib64")
        .env_remove("ASCEND_HOME_PATH")
        .env_remove("ASCEND_TOOLKIT_HOME")
        .args(["channel-peer", "--channel=hccl", "--pages=1"])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut err = String::new();
    child
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut err)
        .unwrap();
    assert!(!child.wait().unwrap().success());
    for words in [
        "/nonexistent/cann/lib64",
        "ASCEND_PD_CANN_LIB_DIR",
        "pd_buffer_device: cpu",
    ] {
        assert!(err.contains(words), "{words}: {err}");
    }
}

/// Ranged writes (a layer-wise push sends one layer's K and V rows of each
/// chunk at a time): each moves exactly its bytes, at the same offset of
/// both pages, and leaves the rest of the peer's page as it was; a range
/// that ends past the page is refused before anything moves.
#[test]
fn ranged_writes_move_only_their_range_at_the_same_offset() {
    for kind in KINDS {
        let peer = Peer::spawn(kind, 8, PAGE, "push", "peer");
        let ctx = zmq::Context::new();
        let mut l = local(kind, 16);
        let (pid, uuid) = connect(&ctx, &l, &peer);
        let seed = 0x5eed;
        let mut src: Vec<MemObj> = l.objs.drain(..4).collect();
        for (i, o) in src.iter_mut().enumerate() {
            pattern::fill(
                o.host_bytes_mut().unwrap(),
                pattern::page_seed(seed, i as u64),
            );
        }
        let src: Vec<SealedMemObj> = src.into_iter().map(MemObj::seal).collect();
        // Two rows of each page, as K and V of one layer: (offset, len).
        let rows = |i: usize| [(64 * i + 8, 1000 + i), (PAGE / 2 + 3 * i, 4096)];
        let ops: Vec<WriteOp> = (0..4)
            .flat_map(|i| {
                let src = &src;
                rows(i).into_iter().map(move |(off, len)| {
                    WriteOp::range(
                        src[i].clone(),
                        BufferRef {
                            uuid,
                            page: i as u32,
                        },
                        off,
                        len,
                    )
                })
            })
            .collect();
        l.channel.write(pid, GrantTag::UNTAGGED, ops).unwrap();
        let back_pages: Vec<MemObj> = l.objs.drain(..4).collect();
        let back = l
            .channel
            .read(pid, reads(back_pages, uuid, |i| i as u32))
            .unwrap();
        for (i, b) in back.iter().enumerate() {
            let mut want = vec![0u8; PAGE];
            pattern::fill(&mut want, pattern::page_seed(PEER_SEED, i as u64));
            let mut ours = vec![0u8; PAGE];
            pattern::fill(&mut ours, pattern::page_seed(seed, i as u64));
            for (off, len) in rows(i) {
                want[off..off + len].copy_from_slice(&ours[off..off + len]);
            }
            assert!(host(b) == &want[..], "{kind:?} page {i}");
        }
        // Past the end of the page: refused, and the peer's page unchanged.
        let bad = vec![WriteOp::range(
            src[0].clone(),
            BufferRef { uuid, page: 5 },
            PAGE - 100,
            200,
        )];
        let e = l.channel.write(pid, GrantTag::UNTAGGED, bad).unwrap_err();
        assert!(matches!(e, ChannelError::BadRef { .. }), "{kind:?}: {e}");
        let check: Vec<MemObj> = back.into_iter().take(1).collect();
        let again = l.channel.read(pid, reads(check, uuid, |_| 5)).unwrap();
        assert!(peer_page_ok(&again[0], 5, PAGE), "{kind:?}");
        drop((src, again));
        l.objs.clear();
        assert!(settles(&l.pool), "{kind:?}");
    }
}

/// Direct writes (a push straight from the engine's KV cache): each range
/// of caller memory lands at its offset of the peer's page and nothing
/// else of the page changes — ranges that continue one another in the peer
/// page from scattered sources (a chunk's rows out of cache blocks), more
/// of them than one `writev` takes, and single ranges; a range past the
/// page is refused before anything moves; hccl says it cannot.
#[test]
fn direct_writes_send_caller_memory_into_the_peers_pages() {
    for kind in KINDS {
        let peer = Peer::spawn(kind, 8, PAGE, "push", "peer");
        let ctx = zmq::Context::new();
        let mut l = local(kind, 8);
        let (pid, uuid) = connect(&ctx, &l, &peer);
        let deadline = Instant::now() + Duration::from_secs(30);
        if kind.needs_acl_memory() {
            assert!(!l.channel.writes_direct(DeviceKind::Cpu));
            // SAFETY: no op, nothing read.
            let e = unsafe {
                l.channel
                    .write_direct(pid, GrantTag::UNTAGGED, &[], deadline)
            }
            .unwrap_err();
            assert!(matches!(e, ChannelError::Unsupported(_)), "{e}");
            continue;
        }
        assert!(l.channel.writes_direct(DeviceKind::Cpu), "{kind:?}");
        let seed = 0xd1ec7;
        let mut src = vec![0u8; 3 * PAGE];
        pattern::fill(&mut src, seed);
        // Page 0: 2000 rows of 32 bytes back to back in the peer's page,
        // taken from the source in reverse order (one request, 2000
        // segments). Page 1: three ranges apart. Page 2: one whole page.
        let row = 32;
        let mut ops: Vec<DirectWrite> = (0..2000)
            .map(|r| DirectWrite {
                src: src.as_ptr() as usize + (1999 - r) * row,
                remote: BufferRef { uuid, page: 0 },
                offset: 100 + r * row,
                len: row,
            })
            .collect();
        let apart = [
            (PAGE + 5, 7, 3000),
            (PAGE + 9000, 5000, 1),
            (2 * PAGE - 10, 9, 10),
        ];
        for &(from, off, len) in &apart {
            ops.push(DirectWrite {
                src: src.as_ptr() as usize + from,
                remote: BufferRef { uuid, page: 1 },
                offset: off,
                len,
            });
        }
        ops.push(DirectWrite {
            src: src.as_ptr() as usize + 2 * PAGE,
            remote: BufferRef { uuid, page: 2 },
            offset: 0,
            len: PAGE,
        });
        // SAFETY: every source range lies in `src`, which nothing writes
        // until the call returned.
        unsafe {
            l.channel
                .write_direct(pid, GrantTag::UNTAGGED, &ops, deadline)
        }
        .unwrap();
        let back_pages: Vec<MemObj> = l.objs.drain(..3).collect();
        let back = l
            .channel
            .read(pid, reads(back_pages, uuid, |i| i as u32))
            .unwrap();
        let theirs = |page: u64| {
            let mut v = vec![0u8; PAGE];
            pattern::fill(&mut v, pattern::page_seed(PEER_SEED, page));
            v
        };
        let mut want = theirs(0);
        for r in 0..2000 {
            let at = 100 + r * row;
            want[at..at + row].copy_from_slice(&src[(1999 - r) * row..(2000 - r) * row]);
        }
        assert!(host(&back[0]) == &want[..], "{kind:?} page 0");
        let mut want = theirs(1);
        for &(from, off, len) in &apart {
            want[off..off + len].copy_from_slice(&src[from..from + len]);
        }
        assert!(host(&back[1]) == &want[..], "{kind:?} page 1");
        assert!(host(&back[2]) == &src[2 * PAGE..], "{kind:?} page 2");
        // Past the end of page 5: refused, and the page unchanged.
        let bad = [DirectWrite {
            src: src.as_ptr() as usize,
            remote: BufferRef { uuid, page: 5 },
            offset: PAGE - 100,
            len: 200,
        }];
        // SAFETY: as above.
        let e = unsafe {
            l.channel
                .write_direct(pid, GrantTag::UNTAGGED, &bad, deadline)
        }
        .unwrap_err();
        assert!(matches!(e, ChannelError::BadRef { .. }), "{kind:?}: {e}");
        let check: Vec<MemObj> = back.into_iter().take(1).collect();
        let again = l.channel.read(pid, reads(check, uuid, |_| 5)).unwrap();
        assert!(peer_page_ok(&again[0], 5, PAGE), "{kind:?}");
        drop(again);
        l.objs.clear();
        assert!(settles(&l.pool), "{kind:?}");
    }
}

/// Whether `f` holds within `timeout`, polled.
fn within(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Issue "device error paths": our own setup with a peer failing was taken
/// as proof that the peer cannot write our pages, so a revoked grant to it
/// was quiescent at once. But the peer's setup may have gone through (hixl:
/// its client connected to our server and read our regions; hccl: it holds
/// our exchanged descriptors with access enabled) and it may write them.
/// Only the peer closing its end of the liveness link proves it cannot.
#[test]
fn our_failed_setup_is_no_proof_that_the_peer_cannot_write_our_pages() {
    for kind in [ChannelKind::Hixl, ChannelKind::Hccl] {
        let ours = local(kind, 2);
        let theirs = local(kind, 2);
        let offer = ours.channel.offer().unwrap().expect("an offer");
        let their_peer = theirs
            .channel
            .attach(NODE, &ours.channel.local_table(), &offer)
            .unwrap();
        let answer = theirs.channel.answer(&offer).expect("an answer");
        // Our copy of their table names a buffer they never registered:
        // our setup fails at its last check, after theirs could reach us.
        let mut table = theirs.channel.local_table();
        let mut ghost = table[0];
        ghost.uuid = Uuid::new_v4();
        ghost.base += ghost.len + (64 << 20);
        table.push(ghost);
        let our_peer = ours.channel.attach("theirs", &table, &answer).unwrap();
        let e = ours.channel.wait_ready(our_peer).unwrap_err().to_string();
        assert!(e.contains("not inside any memory"), "{kind:?}: {e}");
        theirs
            .channel
            .wait_ready(their_peer)
            .unwrap_or_else(|e| panic!("{kind:?}: their setup: {e}"));

        let page = ours.objs[0].buffer_ref();
        let grant = ours
            .channel
            .grant(our_peer, chan::Access::Write, GrantTag::UNTAGGED, &[page])
            .unwrap();
        ours.channel.revoke(grant);
        assert!(
            !within(Duration::from_millis(300), || ours
                .channel
                .is_quiescent(grant)),
            "{kind:?}: a revoked grant is quiescent while the peer may still write"
        );
        // They let go: their end of the liveness link closes.
        theirs.channel.detach(their_peer);
        assert!(
            within(Duration::from_secs(20), || ours.channel.is_quiescent(grant)),
            "{kind:?}: quiescent once the peer closed its end"
        );
    }
}

/// A peer detached while our setup with it still ran was taken as unable
/// to write our pages: a revoked grant to it was quiescent at once, though
/// the setup could still complete (or fail after the peer reached our
/// memory). It is not quiescent before the setup's outcome says so.
#[test]
fn a_peer_detached_during_its_setup_is_not_quiescent_at_once() {
    for kind in [ChannelKind::Hixl, ChannelKind::Hccl] {
        let ours = local(kind, 2);
        let theirs = local(kind, 2);
        // They offered but never attach our answer: our setup waits for
        // their liveness link (until its timeout).
        let offer = theirs.channel.offer().unwrap().expect("an offer");
        let peer = ours
            .channel
            .attach("theirs", &theirs.channel.local_table(), &offer)
            .unwrap();
        let page = ours.objs[0].buffer_ref();
        let grant = ours
            .channel
            .grant(peer, chan::Access::Write, GrantTag::UNTAGGED, &[page])
            .unwrap();
        ours.channel.revoke(grant);
        ours.channel.detach(peer);
        assert!(
            !within(Duration::from_millis(300), || ours
                .channel
                .is_quiescent(grant)),
            "{kind:?}: quiescent while the setup still runs"
        );
    }
}
