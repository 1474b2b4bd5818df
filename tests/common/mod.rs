//! Shared pieces of the backend tests: configs on free loopback ports,
//! chunks filled with a verifiable pattern.

#![allow(dead_code)]

use ascend_pd::backend::{Receiver, Sender, TransferSpec};
use ascend_pd::config::{
    BufferDevice, ChannelKind, HcclPath, PdConfig, PortList, Role, TransferMode,
};
use ascend_pd::memory::{pattern, MemObj, Page, PoolStats, SealedMemObj};
use std::time::Duration;

/// A free loopback port outside the ephemeral range, never handed out
/// twice in this process (see [`ascend_pd::config::loopback_port`]).
pub fn free_port() -> u16 {
    ascend_pd::config::loopback_port().unwrap()
}

/// Tokens per chunk in these tests.
pub const CHUNK: usize = 16;

fn base(role: Role, channel: ChannelKind, mode: TransferMode, pages: u64) -> PdConfig {
    let mut c = PdConfig::with_defaults(role);
    c.transfer_channel = channel;
    // hccl tests test HCCL's comm path (auto would run the HIXL path, which
    // the emulator provides); hixl is its own channel kind.
    c.hccl_path = HcclPath::Comm;
    c.buffer_device = BufferDevice::Cpu;
    c.chunk_size = CHUNK;
    c.kv.num_layers = 2;
    c.kv.num_kv_heads = 2;
    c.kv.head_size = 16;
    c.kv.hidden_size = 32;
    c.buffer_size = pages * c.page_bytes();
    c.pull_mode = mode.is_pull();
    c.delay_pull = mode == TransferMode::PullDelay;
    c.peer_host = Some("127.0.0.1".into());
    c
}

/// A receiver config on fresh ports.
pub fn receiver_config(channel: ChannelKind, mode: TransferMode, pages: u64) -> PdConfig {
    let mut c = base(Role::Receiver, channel, mode, pages);
    c.peer_init_port = Some(PortList::Single(free_port()));
    c.peer_alloc_port = Some(PortList::Single(free_port()));
    c
}

/// A sender config on a fresh done port, with a proxy address nobody listens on.
pub fn sender_config(channel: ChannelKind, mode: TransferMode, pages: u64) -> PdConfig {
    let mut c = base(Role::Sender, channel, mode, pages);
    c.proxy_host = Some("127.0.0.1".into());
    c.proxy_port = Some(free_port());
    c.pull_done_port = Some(PortList::Single(free_port()));
    c
}

/// The transfer spec pointing at a receiver config.
pub fn spec_for(r: &PdConfig, req_id: &str, last: bool) -> TransferSpec {
    TransferSpec {
        req_id: req_id.into(),
        receiver_host: "127.0.0.1".into(),
        receiver_init_port: r.peer_init_port.clone().unwrap(),
        receiver_alloc_port: r.peer_alloc_port.clone().unwrap(),
        is_last_prefill: last,
        receiver_rank: None,
    }
}

/// A key's pattern seed.
pub fn seed_of(key: &str) -> u64 {
    key.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
    })
}

/// Chunks for `keys` from the sender's pool, the last one `last_tokens`
/// long, filled with each key's pattern and sealed for sending.
pub fn chunks(s: &Sender, keys: &[String], last_tokens: usize) -> Vec<SealedMemObj> {
    let mut tokens = vec![CHUNK; keys.len()];
    *tokens.last_mut().unwrap() = last_tokens;
    let mut objs = s.allocate(&tokens).unwrap();
    for (o, k) in objs.iter_mut().zip(keys) {
        pattern::fill(o.host_bytes_mut().unwrap(), seed_of(k));
    }
    objs.into_iter().map(MemObj::seal).collect()
}

/// Whether `obj` holds `key`'s pattern, all of its bytes.
pub fn holds(obj: &Page, key: &str) -> bool {
    pattern::first_mismatch(obj.host_bytes().unwrap(), seed_of(key)).is_none()
}

/// Keys `prefix-0 .. prefix-(n-1)`.
pub fn keys(prefix: &str, n: usize) -> Vec<String> {
    (0..n).map(|i| format!("{prefix}-{i}")).collect()
}

/// Polls `f` until true or `timeout`.
pub fn eventually(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let deadline = std::time::Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if std::time::Instant::now() >= deadline {
            return false;
        }
        std::thread::sleep(Duration::from_millis(10));
    }
}

/// Starts a receiver and a sender for `mode` over `channel`.
pub fn pair(channel: ChannelKind, mode: TransferMode, pages: u64) -> (Receiver, PdConfig, Sender) {
    let rc = receiver_config(channel, mode, pages);
    let r = Receiver::start(&rc, 0).unwrap();
    let sc = sender_config(channel, mode, pages);
    let s = Sender::start(&sc, 0, Default::default()).unwrap();
    (r, rc, s)
}

/// Asserts a pool holds nothing: no page allocated, pinned or quarantined.
#[track_caller]
pub fn assert_no_pages(s: PoolStats, what: &str) {
    assert_eq!(
        (s.allocated, s.pinned, s.quarantined),
        (0, 0, 0),
        "{what}: pages still out: {s:?}"
    );
}

/// A `PullReadyNotif` for full chunks of `layout`, one per key, at
/// `indexes` of the sender pool `uuid`.
pub fn pull_notif(
    layout: ascend_pd::layout::ChunkLayout,
    pull_id: String,
    keys: &[String],
    (uuid, indexes): (uuid::Uuid, Vec<u64>),
    sender_id: &str,
    done_url: String,
) -> ascend_pd::protocol::PullReadyNotif {
    ascend_pd::protocol::PullReadyNotif {
        pull_id,
        keys: keys.to_vec(),
        sender_buffer_uuids: vec![uuid.simple().to_string(); keys.len()],
        sender_mem_indexes: indexes,
        sender_id: sender_id.into(),
        sender_done_url: done_url,
        fmt: layout.fmt.code(),
        shape: layout.full_shape().iter().map(|&d| d as u64).collect(),
        dtype: layout.dtype.name().into(),
        last_chunk_toks: layout.tokens as u64,
        ..Default::default()
    }
}

/// Sends `notif` to the receiver of config `rc` (TP rank 0) on a REQ
/// socket named like a sender's route (`<sender_id>#0`), as a pull sender
/// would, and returns its ack.
pub fn announce_pull(
    ctx: &zmq::Context,
    rc: &PdConfig,
    notif: ascend_pd::protocol::PullReadyNotif,
) -> ascend_pd::protocol::PullReadyDoneAck {
    let req = ctx.socket(zmq::REQ).unwrap();
    req.set_identity(format!("{}#0", notif.sender_id).as_bytes())
        .unwrap();
    req.set_rcvtimeo(10_000).unwrap();
    req.connect(&format!("tcp://127.0.0.1:{}", rc.alloc_port(0).unwrap()))
        .unwrap();
    req.send(
        ascend_pd::protocol::Message::PullReadyNotif(notif).encode(),
        0,
    )
    .unwrap();
    ascend_pd::protocol::PullReadyDoneAck::decode(&req.recv_bytes(0).unwrap()).unwrap()
}

/// `libascend_pd.so` of this build profile, built on first use (`cargo
/// test` builds the rlib only) — for the C and Python tests.
pub fn cdylib() -> std::path::PathBuf {
    static LIB: std::sync::OnceLock<std::path::PathBuf> = std::sync::OnceLock::new();
    LIB.get_or_init(|| {
        let cargo = std::env::var("CARGO").unwrap_or_else(|_| "cargo".into());
        let mut cmd = std::process::Command::new(cargo);
        cmd.args(["build", "--lib", "--message-format=json-render-diagnostics"])
            .current_dir(env!("CARGO_MANIFEST_DIR"))
            .stderr(std::process::Stdio::inherit());
        if !cfg!(debug_assertions) {
            cmd.arg("--release");
        }
        let out = cmd.output().expect("running cargo build --lib");
        assert!(out.status.success(), "cargo build --lib failed");
        let text = String::from_utf8_lossy(&out.stdout);
        text.lines()
            .filter(|l| l.contains("\"compiler-artifact\"") && l.contains("\"cdylib\""))
            .flat_map(|l| l.split('"'))
            .find(|s| s.ends_with("libascend_pd.so"))
            .map(std::path::PathBuf::from)
            .expect("cargo build --lib reports libascend_pd.so")
    })
    .clone()
}

/// Fails the test calling it: `what` is missing, and `fix` says how to
/// get it. A test never passes by skipping what it could not run.
pub fn missing_tool(what: &str, fix: &str) -> ! {
    panic!("{what} is missing: {fix}");
}

/// The project-local Python environment the Python tests run in (numpy,
/// msgspec, pyzmq), built on first use under `target/py-venv` by
/// `tests/python/setup-venv.sh` (or `ASCEND_PD_PYTHON`, which must have
/// them). Fails the test, naming the fix, when it cannot be had.
pub fn python() -> String {
    static PY: std::sync::OnceLock<String> = std::sync::OnceLock::new();
    PY.get_or_init(|| {
        if let Ok(py) = std::env::var("ASCEND_PD_PYTHON") {
            let ok = std::process::Command::new(&py)
                .args(["-c", "import numpy, msgspec, zmq"])
                .status()
                .is_ok_and(|s| s.success());
            if !ok {
                missing_tool(
                    &format!("numpy, msgspec or pyzmq in ASCEND_PD_PYTHON={py}"),
                    "install them there, or unset ASCEND_PD_PYTHON to use the project's own \
                     environment (target/py-venv)",
                );
            }
            return py;
        }
        let script =
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/python/setup-venv.sh");
        let out = std::process::Command::new("bash")
            .arg(&script)
            .stderr(std::process::Stdio::inherit())
            .output()
            .unwrap_or_else(|e| missing_tool("bash", &format!("install bash ({e})")));
        if !out.status.success() {
            missing_tool(
                "the Python test environment (target/py-venv)",
                "see the error above: it needs python3 with venv and the package index (pip)",
            );
        }
        String::from_utf8_lossy(&out.stdout)
            .lines()
            .last()
            .expect("setup-venv.sh prints the python path")
            .to_string()
    })
    .clone()
}

/// An engine's paged NPU cache as vLLM-Ascend allocates it: one zeroed
/// device tensor per layer and K/V plane of `spec`, and their references
/// for `KvCache::wrap_npu` (the tensors must outlive the cache).
pub fn npu_tensors(
    dev: &ascend_sys::Device,
    spec: &ascend_pd::kv::KvCacheSpec,
) -> (Vec<ascend_sys::DeviceBuffer>, Vec<ascend_pd::kv::KvTensor>) {
    let tensors: Vec<ascend_sys::DeviceBuffer> = (0..spec.layers * spec.planes())
        .map(|_| {
            let b = dev.alloc(spec.plane_bytes()).unwrap();
            b.fill(0, spec.plane_bytes(), 0).unwrap();
            b
        })
        .collect();
    let refs = tensors
        .iter()
        .map(|b| ascend_pd::kv::KvTensor {
            addr: b.addr(),
            bytes: b.len(),
        })
        .collect();
    (tensors, refs)
}

/// Polls `f` until it has returned `n` completions in all, or 60 s passed;
/// returns what it got.
pub fn poll_until(
    f: impl Fn() -> Vec<ascend_pd::requests::Completion>,
    n: usize,
) -> Vec<ascend_pd::requests::Completion> {
    let end = std::time::Instant::now() + Duration::from_secs(60);
    let mut got = Vec::new();
    while got.len() < n && std::time::Instant::now() < end {
        got.extend(f());
        std::thread::sleep(Duration::from_millis(2));
    }
    got
}

/// Where a fault injected into the emulator's asynchronous copies strikes
/// (see its `ascend_emu_inject_copy_fault`).
#[derive(Clone, Copy, Debug)]
pub enum CopyFault {
    /// `aclrtMemcpyAsync` refuses the copy.
    Queue = 1,
    /// The copy fails on its stream; the stream's next synchronisation,
    /// and events recorded on it after the copy, report it.
    Run = 2,
    /// The copy runs, but the stream's next synchronisation (and that of
    /// an event recorded on it meanwhile) fails at once, before it ran.
    Sync = 3,
}

/// Makes the next `times` asynchronous copies touching `[addr, addr +
/// len)` fail at `at`, in the emulator `acl` runs on.
pub fn inject_copy_fault(acl: &ascend_sys::Acl, addr: u64, len: usize, at: CopyFault, times: u32) {
    type InjectFn = unsafe extern "C" fn(u64, u64, std::ffi::c_int, u32) -> std::ffi::c_int;
    assert!(
        acl.is_emulator(),
        "faults are injected into the emulator only"
    );
    // SAFETY: the file is the emulator library the loader already mapped;
    // this takes another reference to that mapping for the call.
    let lib = unsafe { libloading::Library::new(acl.library_path()) }.unwrap();
    // SAFETY: the emulator exports the symbol with exactly this signature.
    let inject = unsafe { lib.get::<InjectFn>(b"ascend_emu_inject_copy_fault\0") }.unwrap();
    // SAFETY: plain values; the emulator only records them.
    let rc = unsafe { inject(addr, len as u64, at as std::ffi::c_int, times) };
    assert_eq!(
        rc, 0,
        "ascend_emu_inject_copy_fault({addr:#x}, {len}, {at:?}, {times})"
    );
}
