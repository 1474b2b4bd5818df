//! The channel handshake over the peer-init ZMQ socket
//! (`pd_peer_init_port[rank]`).
//!
//! The connecting side (a sender) sends a [`Hello`] on a REQ socket; the
//! listening side (a receiver) answers with its own `Hello` on REP, plus an
//! `error` when it refuses. Both sides then hold each other's buffer table
//! and channel endpoint and [`TransferChannel::attach`] the peer. The hello
//! is versioned msgpack (never pickle); every field of a received hello is
//! validated, and the two sides must agree on version, channel and transfer
//! mode. The pull lease is the shorter of the two proposals.
//!
//! Each hello carries its sender's monotonic clock (`clock_us`, read as it
//! is sent); with the instants the connecting side sent its hello and got
//! the answer, that bounds the two clocks' offset (the pull lease's
//! deadline is converted with it, see `protocol::lease`). [`probe`]
//! measures it again later on the same socket.

use super::{BufferDesc, ChannelError, Endpoint, PeerId, PeerTable, TransferChannel};
use crate::auth::{self, End, Nonce, Proof, Secret, Session, Step, SECRET_ENV, SECRET_KEY};
use crate::config::{ChannelKind, Role, TransferMode};
use crate::memory::DeviceKind;
use crate::wire::{RawError, Reader, Writer};
use crossbeam_channel::Sender;
use std::str::FromStr;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::thread::JoinHandle;
use std::time::{Duration, Instant};
use uuid::Uuid;

/// Version of the hello format; both sides must send the same.
pub const HANDSHAKE_VERSION: u64 = 3;

/// Cap on buffers in one table (a worker has two pools; this only bounds garbage).
const MAX_BUFFERS: usize = 64;

/// The largest frame the handshake socket accepts: a hello of
/// 64 buffers (the most it may list) is a few KiB; ZMQ drops anything longer (and
/// its connection) before buffering it.
pub const MAX_HELLO_BYTES: i64 = 256 * 1024;

/// One side's half of the handshake.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Hello {
    /// Format version ([`HANDSHAKE_VERSION`]).
    pub version: u64,
    /// The node's id (a sender's `sender_id`, `host:port`).
    pub node: String,
    /// Sender or receiver.
    pub role: Role,
    /// The transfer mode this side runs.
    pub mode: TransferMode,
    /// The channel kind.
    pub channel: ChannelKind,
    /// Proposed pull lease: the receiver never reads a pull's pages after it;
    /// the sender never frees them before it.
    pub lease: Duration,
    /// The buffer table.
    pub buffers: Vec<BufferDesc>,
    /// How to reach the buffers.
    pub endpoint: Endpoint,
    /// The sender's monotonic clock when the hello left (µs, its own epoch).
    pub clock_us: u64,
    /// Which start of the peer this is: it changes when the process (or
    /// the sender/receiver in it) restarts, and only then. Derived from
    /// the buffer table, whose uuids are new at every start; 0 from a peer
    /// that does not send it.
    pub incarnation: u64,
    /// How this side splits KV heads over TP ranks; `None` from a peer that
    /// does not send it (taken as the same TP size on both sides).
    pub tp: Option<TpInfo>,
    /// The ascend-pd release this side runs ([`LIB_VERSION`]); `None` from
    /// a release that did not send it.
    pub lib: Option<String>,
    /// What this side's KV is (`pd_model_identity`); `None` when unset.
    pub model: Option<String>,
}

/// The release of this library, sent in every hello.
pub const LIB_VERSION: &str = env!("CARGO_PKG_VERSION");

/// The longest `lib` or `model` a hello may carry.
const MAX_IDENTITY_BYTES: usize = 1024;

/// Whether two releases can talk: the same major version, and for 0.x
/// the same minor (semver's rule for what may break).
pub fn releases_compatible(a: &str, b: &str) -> bool {
    let key = |v: &str| -> Option<(u64, u64)> {
        let mut it = v.split(['.', '-', '+']);
        let major = it.next()?.parse().ok()?;
        let minor = it.next()?.parse().ok()?;
        Some(if major == 0 { (0, minor) } else { (major, 0) })
    };
    match (key(a), key(b)) {
        (Some(x), Some(y)) => x == y,
        _ => a == b,
    }
}

/// A side's tensor-parallel split, carried in the hello so a receiver knows
/// which heads a sender's chunks hold (see [`crate::layout::tp`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TpInfo {
    /// This side's TP size (`tp_size`).
    pub tp: usize,
    /// The TP size it expects of the other side (`pd_peer_tp_size`).
    pub peer_tp: usize,
    /// This side's TP rank.
    pub rank: usize,
    /// The model's KV heads (1 for a replicated MLA latent).
    pub total_heads: usize,
    /// Every rank holds every head (MLA).
    pub replicated: bool,
}

impl TpInfo {
    /// The split `config` describes, for TP rank `rank`.
    pub fn of(config: &crate::config::PdConfig, rank: usize) -> Option<TpInfo> {
        let plan = config.tp_plan().ok()?;
        Some(TpInfo {
            tp: config.tp_size,
            peer_tp: config.peer_tp(),
            rank,
            total_heads: plan.total_heads,
            replicated: plan.replicated,
        })
    }

    /// The heads a sender of `sender` sends a receiver of `self`, or why
    /// the two cannot be paired.
    pub fn piece_from(&self, sender: &TpInfo) -> Result<crate::layout::tp::HeadRange, String> {
        if sender.tp != self.peer_tp || sender.peer_tp != self.tp {
            return Err(format!(
                "the sender runs tp_size {} expecting a decode TP of {}; this receiver runs \
                 tp_size {} expecting a prefill TP of {}: set pd_peer_tp_size on each side to \
                 the other side's tp_size",
                sender.tp, sender.peer_tp, self.tp, self.peer_tp
            ));
        }
        if sender.total_heads != self.total_heads || sender.replicated != self.replicated {
            return Err(format!(
                "the sender's model has {} KV head(s){} in all, this receiver's {}{}: set \
                 kv_num_heads (per rank) and use_mla to the same model on both sides",
                sender.total_heads,
                if sender.replicated { " (MLA)" } else { "" },
                self.total_heads,
                if self.replicated { " (MLA)" } else { "" },
            ));
        }
        let plan =
            crate::layout::tp::TpPlan::new(sender.tp, self.tp, self.total_heads, self.replicated)?;
        plan.piece(sender.rank, self.rank).ok_or_else(|| {
            format!(
                "prefill rank {} (of TP {}) holds none of decode rank {}'s {} (of TP {}): \
                 connect each prefill rank to the decode ranks whose heads it holds",
                sender.rank,
                sender.tp,
                self.rank,
                plan.decode_heads(self.rank),
                self.tp
            )
        })
    }
}

/// The incarnation of a side whose buffers are `buffers` (see
/// [`Hello::incarnation`]): their uuids folded together.
pub fn incarnation_of(buffers: &[BufferDesc]) -> u64 {
    buffers.iter().fold(0x9e37_79b9_7f4a_7c15, |acc, b| {
        let (hi, lo) = b.uuid.as_u64_pair();
        (acc ^ hi).rotate_left(17) ^ lo
    })
}

/// What both sides agreed on.
#[derive(Clone, Debug)]
pub struct Agreement {
    /// The local id of the attached peer.
    pub peer: PeerId,
    /// The peer's hello.
    pub remote: Hello,
    /// The agreed lease (the shorter proposal).
    pub lease: Duration,
    /// Connecting side: when our hello left and when the answer arrived
    /// (the answer's `clock_us` was read in between).
    pub exchange: Option<(Instant, Instant)>,
    /// With a deployment secret: the keys that seal every later
    /// side-channel frame of this attachment (see [`crate::auth::Session`]).
    pub session: Option<Arc<Session>>,
}

impl Hello {
    /// Our hello for `channel`.
    pub fn local(
        node: &str,
        role: Role,
        mode: TransferMode,
        lease: Duration,
        channel: &dyn TransferChannel,
    ) -> Hello {
        let buffers = channel.local_table();
        Hello {
            version: HANDSHAKE_VERSION,
            node: node.to_string(),
            role,
            mode,
            channel: channel.kind(),
            lease,
            incarnation: incarnation_of(&buffers),
            tp: None,
            lib: Some(LIB_VERSION.to_string()),
            model: None,
            buffers,
            endpoint: channel.endpoint(),
            clock_us: 0,
        }
    }

    /// This hello with `tp` (see [`TpInfo::of`]).
    pub fn with_tp(self, tp: Option<TpInfo>) -> Hello {
        Hello { tp, ..self }
    }

    /// This hello naming its KV `model` (`pd_model_identity`).
    pub fn with_model(self, model: Option<String>) -> Hello {
        Hello { model, ..self }
    }

    /// Checks that `remote` can talk to `self`; returns the agreed lease.
    pub fn agree(&self, remote: &Hello) -> Result<Duration, ChannelError> {
        if remote.version != self.version {
            return Err(ChannelError::Handshake(format!(
                "peer {} speaks handshake version {}, this side {}; run the same ascend-pd version on both",
                remote.node, remote.version, self.version
            )));
        }
        if let (Some(ours), Some(theirs)) = (&self.lib, &remote.lib) {
            if !releases_compatible(ours, theirs) {
                return Err(ChannelError::Handshake(format!(
                    "peer {} runs ascend-pd {theirs}, this side {ours}: releases of another \
                     minor version (major, after 1.0) may not understand each other; run the \
                     same ascend-pd release on prefill and decode",
                    remote.node
                )));
            }
        }
        if let (Some(ours), Some(theirs)) = (&self.model, &remote.model) {
            if ours != theirs {
                return Err(ChannelError::Handshake(format!(
                    "peer {} serves KV of model {theirs:?}, this side {ours:?} \
                     (pd_model_identity): their KV is not interchangeable; point prefill and \
                     decode at the same model files, revision, dtype and KV cache dtype",
                    remote.node
                )));
            }
        }
        if remote.mode != self.mode {
            return Err(ChannelError::ModeMismatch {
                local: self.mode.name().into(),
                remote: remote.mode.name().into(),
                peer: remote.node.clone(),
            });
        }
        if let Some(e) = path_mismatch(self.channel, remote.channel) {
            return Err(ChannelError::Handshake(format!(
                "peer {}: {e}",
                remote.node
            )));
        }
        if remote.channel != self.channel {
            return Err(ChannelError::Handshake(format!(
                "peer {} uses transfer_channel {}, this side {}; set the same transfer_channel on both",
                remote.node,
                remote.channel.name(),
                self.channel.name()
            )));
        }
        if remote.role == self.role {
            return Err(ChannelError::Handshake(format!(
                "peer {} is also a {}; a sender must talk to a receiver",
                remote.node,
                remote.role.name()
            )));
        }
        if let (Some(ours), Some(theirs)) = (&self.tp, &remote.tp) {
            let paired = match self.role {
                Role::Receiver => ours.piece_from(theirs),
                Role::Sender => theirs.piece_from(ours),
            };
            paired.map_err(|e| {
                ChannelError::Handshake(format!("peer {}: TP mismatch: {e}", remote.node))
            })?;
        }
        PeerTable::new(&remote.buffers)?;
        Ok(self.lease.min(remote.lease))
    }

    /// Encodes as a msgpack map, with `error` when refusing.
    pub fn encode(&self, error: Option<&str>) -> Vec<u8> {
        self.encode_sealed(error, None)
    }

    /// Encodes, and with `seal` ends the map with the proof over every byte
    /// before it (see [`crate::auth`]).
    fn encode_sealed(&self, error: Option<&str>, seal: Option<&Seal<'_>>) -> Vec<u8> {
        let mut w = Writer::with_capacity(256);
        // Ten fields and `error` (nil when accepting), then the seal's.
        let sealed = seal.map_or(0, |s| 1 + usize::from(s.send_nonce.is_some()));
        let tp = usize::from(self.tp.is_some());
        let ids = usize::from(self.lib.is_some()) + usize::from(self.model.is_some());
        w.map_len(11 + tp + ids + sealed).expect("small map");
        let s = |w: &mut Writer, v: &str| w.str(v).expect("short string");
        s(&mut w, "v");
        w.uint(self.version);
        s(&mut w, "node");
        s(&mut w, &self.node);
        s(&mut w, "role");
        s(&mut w, self.role.name());
        s(&mut w, "mode");
        s(&mut w, self.mode.name());
        s(&mut w, "channel");
        s(&mut w, self.channel.name());
        s(&mut w, "lease_ms");
        w.uint(self.lease.as_millis().min(u128::from(u64::MAX)) as u64);
        s(&mut w, "clock_us");
        w.uint(self.clock_us);
        s(&mut w, "incarnation");
        w.uint(self.incarnation);
        if let Some(t) = &self.tp {
            s(&mut w, "tp");
            w.array_len(5).expect("5");
            for v in [
                t.tp,
                t.peer_tp,
                t.rank,
                t.total_heads,
                usize::from(t.replicated),
            ] {
                w.uint(v as u64);
            }
        }
        if let Some(lib) = &self.lib {
            s(&mut w, "lib");
            s(&mut w, lib);
        }
        if let Some(model) = &self.model {
            s(&mut w, "model");
            s(&mut w, model);
        }
        s(&mut w, "buffers");
        w.array_len(self.buffers.len()).expect("few buffers");
        for b in &self.buffers {
            w.array_len(5).expect("5");
            s(&mut w, &b.uuid.simple().to_string());
            w.uint(b.base);
            w.uint(b.len);
            w.uint(b.page_size);
            s(&mut w, &b.device.to_string());
        }
        s(&mut w, "endpoint");
        match &self.endpoint {
            Endpoint::Shm { pid, fds } => {
                w.map_len(2).expect("2");
                s(&mut w, "pid");
                w.uint(u64::from(*pid));
                s(&mut w, "fds");
                w.array_len(fds.len()).expect("few fds");
                for fd in fds {
                    w.int(i64::from(*fd));
                }
            }
            Endpoint::Tcp { addr } => {
                w.map_len(1).expect("1");
                s(&mut w, "tcp");
                s(&mut w, addr);
            }
            Endpoint::Hccl {
                root_info,
                session,
                device,
                watch,
            } => {
                w.map_len(4).expect("4");
                s(&mut w, "hccl_root");
                s(&mut w, &hex(root_info));
                s(&mut w, "hccl_session");
                w.uint(*session);
                s(&mut w, "hccl_device");
                w.uint(u64::from(*device));
                s(&mut w, "hccl_watch");
                s(&mut w, watch);
            }
            Endpoint::Hixl {
                session,
                server,
                device,
                watch,
            } => {
                w.map_len(6).expect("6");
                s(&mut w, "hixl_session");
                w.uint(*session);
                s(&mut w, "hixl_server");
                s(&mut w, server);
                s(&mut w, "hixl_protocol");
                s(&mut w, protocol_name(device.protocol));
                s(&mut w, "hixl_device");
                w.uint(u64::from(device.device_phy_id));
                // Empty: no RoCE address configured.
                s(&mut w, "hixl_ipv4");
                s(
                    &mut w,
                    &device.ipv4.map_or_else(String::new, |ip| ip.to_string()),
                );
                s(&mut w, "hixl_watch");
                s(&mut w, watch);
            }
        }
        s(&mut w, "error");
        match error {
            Some(e) => s(&mut w, e),
            None => w.nil(),
        }
        if let Some(seal) = seal {
            if let Some(n) = &seal.send_nonce {
                s(&mut w, "auth_nonce");
                s(&mut w, &auth::hex(n));
            }
            let proof = seal
                .secret
                .prove(seal.step, &[&seal.nonces.0, &seal.nonces.1, w.as_bytes()]);
            s(&mut w, "auth");
            s(&mut w, &auth::hex(&proof));
        }
        w.into_bytes()
    }

    /// Decodes and validates a received hello; also returns the peer's `error`, if any.
    pub fn decode(bytes: &[u8]) -> Result<(Hello, Option<String>), ChannelError> {
        decode_hello(bytes)
            .map(|d| (d.hello, d.error))
            .map_err(|e| ChannelError::Handshake(format!("malformed hello: {e}")))
    }
}

/// Why two sides whose channels are HCCL's comm path and the HIXL path
/// cannot talk (`transfer_channel: hccl` runs either, by `pd_hccl_path`):
/// `None` for any other pair.
fn path_mismatch(ours: ChannelKind, theirs: ChannelKind) -> Option<String> {
    let path = |k: ChannelKind| match k {
        ChannelKind::Hccl => Some("HCCL's comm path (pd_hccl_path: comm, or auto without HIXL)"),
        ChannelKind::Hixl => {
            Some("the HIXL path (pd_hccl_path: hixl or auto with HIXL, or transfer_channel: hixl)")
        }
        _ => None,
    };
    match (path(ours)?, path(theirs)?) {
        _ if ours == theirs => None,
        (a, b) => Some(format!(
            "this side runs {a}, the peer {b}; both ends must run the same path: set the same \
             pd_hccl_path on both (comm or hixl), or install HIXL (libcann_hixl.so) on both so \
             auto picks it"
        )),
    }
}

/// How a hello is sealed: the proof for `step` over the two nonces (in
/// order) and the hello's bytes; a connecting side also names the
/// listening side's nonce (`send_nonce`), so the listener finds its challenge.
struct Seal<'a> {
    secret: &'a Secret,
    step: Step,
    nonces: (Nonce, Nonce),
    send_nonce: Option<Nonce>,
}

/// The seal found at the end of a received hello.
#[derive(Debug)]
struct SealSeen {
    nonce: Option<Nonce>,
    proof: Proof,
    /// Bytes of the hello the proof covers (all before the `auth` key).
    covered: usize,
}

impl SealSeen {
    fn verify(&self, secret: &Secret, step: Step, nonces: (&Nonce, &Nonce), frame: &[u8]) -> bool {
        secret.verify(
            step,
            &[nonces.0, nonces.1, &frame[..self.covered]],
            &self.proof,
        )
    }
}

struct Decoded {
    hello: Hello,
    error: Option<String>,
    seal: Option<SealSeen>,
}

/// A refusal: why, and (once the peer is authenticated, or when no secret
/// is in use) what this side runs, so a mode mismatch is named alike on
/// both sides. Never a buffer table, an address or an endpoint.
fn refusal(local: Option<&Hello>, error: &str) -> Vec<u8> {
    let mut w = Writer::with_capacity(64 + error.len());
    let s = |w: &mut Writer, v: &str| w.str(v).expect("short string");
    match local {
        Some(h) => {
            w.map_len(7).expect("7");
            s(&mut w, "v");
            w.uint(h.version);
            s(&mut w, "node");
            s(&mut w, &h.node);
            s(&mut w, "refused");
            w.bool(true);
            s(&mut w, "role");
            s(&mut w, h.role.name());
            s(&mut w, "mode");
            s(&mut w, h.mode.name());
            s(&mut w, "channel");
            s(&mut w, h.channel.name());
        }
        None => {
            w.map_len(3).expect("3");
            s(&mut w, "v");
            w.uint(HANDSHAKE_VERSION);
            s(&mut w, "refused");
            w.bool(true);
        }
    }
    s(&mut w, "error");
    s(&mut w, error);
    w.into_bytes()
}

/// Why the listening side refused, if `reply` is a refusal.
pub fn refusal_reason(reply: &[u8]) -> Option<String> {
    decode_refusal(reply).map(|r| r.error)
}

/// A received refusal.
struct Refusal {
    error: String,
    /// The refusing side's node and mode, when it said.
    node: Option<String>,
    mode: Option<TransferMode>,
}

fn decode_refusal(bytes: &[u8]) -> Option<Refusal> {
    let mut r = Reader::new(bytes);
    let n = r.map_len().ok()?;
    let (mut refused, mut error, mut node, mut mode) = (false, None, None, None);
    for _ in 0..n {
        match r.str().ok()? {
            "refused" => refused = r.bool().ok()?,
            "error" => error = Some(r.str().ok()?.to_string()),
            "node" => node = Some(r.str().ok()?.to_string()),
            "mode" => mode = parse_mode(r.str().ok()?).ok(),
            _ => r.skip_value().ok()?,
        }
    }
    refused.then_some(())?;
    Some(Refusal {
        error: error?,
        node,
        mode,
    })
}

fn parse_mode(v: &str) -> Result<TransferMode, String> {
    match v {
        "push" => Ok(TransferMode::Push),
        "pull-eager" => Ok(TransferMode::PullEager),
        "pull-delay" => Ok(TransferMode::PullDelay),
        _ => Err(format!("unknown mode {v:?}")),
    }
}

/// A one-entry map `{key: value}` (the authentication steps' frames).
fn single(key: &str, value: &str) -> Vec<u8> {
    let mut w = Writer::with_capacity(16 + key.len() + value.len());
    w.map_len(1).expect("1");
    w.str(key).expect("short");
    w.str(value).expect("short");
    w.into_bytes()
}

/// The value of a one-entry map `{key: value}`, if `frame` is one.
fn single_value<'a>(frame: &'a [u8], key: &str) -> Option<&'a str> {
    let mut r = Reader::new(frame);
    if r.map_len().ok()? != 1 || r.str().ok()? != key {
        return None;
    }
    let v = r.str().ok()?;
    (r.remaining() == 0).then_some(v)
}

/// The listening side's answer to a challenge: `{auth_nonce, auth_proof}`.
fn challenge_answer(nonce: &Nonce, proof: &Proof) -> Vec<u8> {
    let mut w = Writer::with_capacity(160);
    w.map_len(2).expect("2");
    w.str("auth_nonce").expect("short");
    w.str(&auth::hex(nonce)).expect("short");
    w.str("auth_proof").expect("short");
    w.str(&auth::hex(proof)).expect("short");
    w.into_bytes()
}

fn decode_challenge_answer(frame: &[u8]) -> Option<(Nonce, Proof)> {
    let mut r = Reader::new(frame);
    if r.map_len().ok()? != 2 || r.str().ok()? != "auth_nonce" {
        return None;
    }
    let nonce = auth::unhex(r.str().ok()?)?;
    if r.str().ok()? != "auth_proof" {
        return None;
    }
    let proof = auth::unhex(r.str().ok()?)?;
    (r.remaining() == 0).then_some((nonce, proof))
}

/// Challenges a listening side answered and whose hello has not come yet,
/// by its nonce. Bounded: a flood of challenges cannot grow it.
#[derive(Debug, Default)]
pub(crate) struct Challenges {
    open: std::collections::HashMap<Nonce, (Nonce, Instant)>,
}

/// Most open challenges kept at once.
pub(crate) const MAX_OPEN_CHALLENGES: usize = 1024;
/// How long a challenge waits for its hello.
pub(crate) const CHALLENGE_TTL: Duration = Duration::from_secs(30);

impl Challenges {
    /// Records our nonce `ours` for the peer's `theirs`; false when too
    /// many are open (after dropping the expired).
    pub(crate) fn open(&mut self, now: Instant, ours: Nonce, theirs: Nonce) -> bool {
        if self.open.len() >= MAX_OPEN_CHALLENGES {
            self.open.retain(|_, (_, until)| *until > now);
        }
        if self.open.len() >= MAX_OPEN_CHALLENGES {
            return false;
        }
        self.open.insert(ours, (theirs, now + CHALLENGE_TTL));
        true
    }

    /// The peer's nonce of the open challenge `ours` (used once).
    pub(crate) fn take(&mut self, now: Instant, ours: &Nonce) -> Option<Nonce> {
        match self.open.remove(ours) {
            Some((theirs, until)) if until > now => Some(theirs),
            _ => None,
        }
    }
}

fn raw(e: RawError, field: &str) -> String {
    format!("field {field}: {e:?}")
}

fn parse_device(s: &str) -> Option<DeviceKind> {
    match s {
        "cpu" => Some(DeviceKind::Cpu),
        _ => s.strip_prefix("npu:")?.parse().ok().map(DeviceKind::Npu),
    }
}

fn decode_hello(bytes: &[u8]) -> Result<Decoded, String> {
    let mut r = Reader::new(bytes);
    let n = r.map_len().map_err(|e| raw(e, "<top>"))?;
    let (mut seal_nonce, mut seal) = (None, None);
    let (mut version, mut node, mut role, mut mode, mut channel, mut lease) =
        (None, None, None, None, None, None);
    let mut clock_us = None;
    let mut incarnation = None;
    let mut tp = None;
    let (mut lib, mut model) = (None, None);
    let mut buffers = None;
    let mut endpoint = None;
    let mut error = None;
    for i in 0..n {
        let at = r.pos();
        let key = r.str().map_err(|e| raw(e, "<key>"))?;
        match key {
            "auth_nonce" => {
                let v = r.str().map_err(|e| raw(e, key))?;
                seal_nonce = Some(auth::unhex(v).ok_or("auth_nonce is not 32 hex digits")?);
            }
            "auth" => {
                if i + 1 != n {
                    return Err("auth must be the last field".into());
                }
                let v = r.str().map_err(|e| raw(e, key))?;
                let proof = auth::unhex(v).ok_or("auth is not 64 hex digits")?;
                seal = Some((proof, at));
            }
            "v" => version = Some(r.uint().map_err(|e| raw(e, key))?),
            "node" => node = Some(r.str().map_err(|e| raw(e, key))?.to_string()),
            "role" => {
                let v = r.str().map_err(|e| raw(e, key))?;
                role = Some(Role::from_str(v).map_err(|_| format!("unknown role {v:?}"))?);
            }
            "mode" => {
                mode = Some(parse_mode(r.str().map_err(|e| raw(e, key))?)?);
            }
            "channel" => {
                let v = r.str().map_err(|e| raw(e, key))?;
                channel =
                    Some(ChannelKind::from_str(v).map_err(|_| format!("unknown channel {v:?}"))?);
            }
            "lease_ms" => lease = Some(Duration::from_millis(r.uint().map_err(|e| raw(e, key))?)),
            "clock_us" => clock_us = Some(r.uint().map_err(|e| raw(e, key))?),
            "incarnation" => incarnation = Some(r.uint().map_err(|e| raw(e, key))?),
            "lib" | "model" => {
                let v = r.str().map_err(|e| raw(e, key))?;
                if v.is_empty() || v.len() > MAX_IDENTITY_BYTES {
                    return Err(format!(
                        "{key} of {} bytes (1..={MAX_IDENTITY_BYTES})",
                        v.len()
                    ));
                }
                match key {
                    "lib" => lib = Some(v.to_string()),
                    _ => model = Some(v.to_string()),
                }
            }
            "buffers" => {
                let count = r.array_len().map_err(|e| raw(e, key))?;
                if count > MAX_BUFFERS {
                    return Err(format!("{count} buffers (at most {MAX_BUFFERS})"));
                }
                let mut v = Vec::with_capacity(count);
                for i in 0..count {
                    let f = format!("buffers[{i}]");
                    if r.array_len().map_err(|e| raw(e, &f))? != 5 {
                        return Err(format!("{f}: expected 5 entries"));
                    }
                    let u = r.str().map_err(|e| raw(e, &f))?;
                    let uuid = Uuid::parse_str(u).map_err(|e| format!("{f}: uuid {u:?}: {e}"))?;
                    let base = r.uint().map_err(|e| raw(e, &f))?;
                    let len = r.uint().map_err(|e| raw(e, &f))?;
                    let page_size = r.uint().map_err(|e| raw(e, &f))?;
                    let d = r.str().map_err(|e| raw(e, &f))?;
                    let device = parse_device(d).ok_or_else(|| format!("{f}: device {d:?}"))?;
                    v.push(BufferDesc {
                        uuid,
                        base,
                        len,
                        page_size,
                        device,
                    });
                }
                buffers = Some(v);
            }
            "endpoint" => endpoint = Some(decode_endpoint(&mut r)?),
            "tp" => {
                if r.array_len().map_err(|e| raw(e, key))? != 5 {
                    return Err("tp is not [tp, peer_tp, rank, total_heads, replicated]".into());
                }
                let mut v = [0usize; 5];
                for x in &mut v {
                    let n = r.uint().map_err(|e| raw(e, key))?;
                    *x = usize::try_from(n).map_err(|_| format!("tp value {n} is too large"))?;
                }
                if v[0] == 0 || v[1] == 0 || v[2] >= v[0] || v[3] == 0 || v[4] > 1 {
                    return Err(format!("tp {v:?} is not a valid split"));
                }
                tp = Some(TpInfo {
                    tp: v[0],
                    peer_tp: v[1],
                    rank: v[2],
                    total_heads: v[3],
                    replicated: v[4] == 1,
                });
            }
            "error" => {
                if r.peek_marker() == Some(rmp::Marker::Null) {
                    r.skip_value().map_err(|e| raw(e, key))?;
                } else {
                    error = Some(r.str().map_err(|e| raw(e, key))?.to_string());
                }
            }
            _ => r.skip_value().map_err(|e| raw(e, key))?,
        }
    }
    if r.remaining() != 0 {
        return Err(format!("{} trailing bytes", r.remaining()));
    }
    let missing = |f: &str| format!("missing field {f}");
    let hello = Hello {
        version: version.ok_or_else(|| missing("v"))?,
        node: node.ok_or_else(|| missing("node"))?,
        role: role.ok_or_else(|| missing("role"))?,
        mode: mode.ok_or_else(|| missing("mode"))?,
        channel: channel.ok_or_else(|| missing("channel"))?,
        lease: lease.ok_or_else(|| missing("lease_ms"))?,
        buffers: buffers.ok_or_else(|| missing("buffers"))?,
        endpoint: endpoint.ok_or_else(|| missing("endpoint"))?,
        clock_us: clock_us.ok_or_else(|| missing("clock_us"))?,
        incarnation: incarnation.unwrap_or(0),
        tp,
        lib,
        model,
    };
    Ok(Decoded {
        hello,
        error,
        seal: seal.map(|(proof, covered)| SealSeen {
            nonce: seal_nonce,
            proof,
            covered,
        }),
    })
}

/// Lowercase hex (the codec has no bin type; root infos travel as str).
fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

/// Decodes a received root info: empty, or exactly `ROOT_INFO_LEN` bytes.
fn unhex_root(s: &str) -> Result<Vec<u8>, String> {
    if !s.is_empty() && s.len() != 2 * ascend_sys::ROOT_INFO_LEN {
        return Err(format!(
            "hccl_root is {} hex digits; expected 0 or {}",
            s.len(),
            2 * ascend_sys::ROOT_INFO_LEN
        ));
    }
    (0..s.len())
        .step_by(2)
        .map(|i| {
            s.get(i..i + 2)
                .and_then(|d| u8::from_str_radix(d, 16).ok())
                .ok_or_else(|| format!("hccl_root: bad hex at {i}"))
        })
        .collect()
}

/// The wire name of a HIXL endpoint's protocol.
fn protocol_name(p: ascend_sys::HixlProtocol) -> &'static str {
    match p {
        ascend_sys::HixlProtocol::Roce => "roce",
        ascend_sys::HixlProtocol::Hccs => "hccs",
    }
}

/// The fields of a hixl endpoint, as they arrive.
#[derive(Default)]
struct HixlFields {
    session: Option<u64>,
    server: Option<String>,
    protocol: Option<ascend_sys::HixlProtocol>,
    device: Option<u32>,
    ipv4: Option<Option<std::net::Ipv4Addr>>,
    watch: Option<String>,
}

impl HixlFields {
    /// Reads the value of `key` if it is a hixl field; false otherwise.
    fn read(&mut self, key: &str, r: &mut Reader<'_>) -> Result<bool, String> {
        let text = |r: &mut Reader<'_>| r.str().map(str::to_string).map_err(|e| raw(e, key));
        match key {
            "hixl_session" => self.session = Some(r.uint().map_err(|e| raw(e, key))?),
            "hixl_server" => self.server = Some(text(r)?),
            "hixl_protocol" => {
                self.protocol = Some(match text(r)?.as_str() {
                    "roce" => ascend_sys::HixlProtocol::Roce,
                    "hccs" => ascend_sys::HixlProtocol::Hccs,
                    p => return Err(format!("hixl_protocol {p:?}: expected roce or hccs")),
                })
            }
            "hixl_device" => {
                let d = r.uint().map_err(|e| raw(e, key))?;
                self.device =
                    Some(u32::try_from(d).map_err(|_| format!("hixl_device {d} out of range"))?);
            }
            "hixl_ipv4" => {
                let v = text(r)?;
                self.ipv4 = Some(match v.as_str() {
                    "" => None,
                    ip => Some(
                        ip.parse()
                            .map_err(|_| format!("hixl_ipv4 {ip:?} is not IPv4"))?,
                    ),
                });
            }
            "hixl_watch" => self.watch = Some(text(r)?),
            _ => return Ok(false),
        }
        Ok(true)
    }

    /// The endpoint, when every field (or none) came.
    fn endpoint(self) -> Result<Option<Endpoint>, String> {
        match self {
            HixlFields {
                session: None,
                server: None,
                protocol: None,
                device: None,
                ipv4: None,
                watch: None,
            } => Ok(None),
            HixlFields {
                session: Some(session),
                server: Some(server),
                protocol: Some(protocol),
                device: Some(device_phy_id),
                ipv4: Some(ipv4),
                watch: Some(watch),
            } => Ok(Some(Endpoint::Hixl {
                session,
                server,
                device: ascend_sys::HixlEndpoint {
                    protocol,
                    device_phy_id,
                    ipv4,
                },
                watch,
            })),
            _ => Err(
                "hixl endpoint needs hixl_session, hixl_server, hixl_protocol, \
                      hixl_device, hixl_ipv4 and hixl_watch"
                    .into(),
            ),
        }
    }
}

fn decode_endpoint(r: &mut Reader<'_>) -> Result<Endpoint, String> {
    let n = r.map_len().map_err(|e| raw(e, "endpoint"))?;
    let (mut pid, mut fds, mut tcp) = (None, None, None);
    let (mut root, mut session, mut device, mut watch) = (None, None, None, None);
    let mut hixl = HixlFields::default();
    for _ in 0..n {
        let key = r.str().map_err(|e| raw(e, "endpoint"))?;
        match key {
            "pid" => {
                let p = r.uint().map_err(|e| raw(e, key))?;
                pid = Some(u32::try_from(p).map_err(|_| format!("pid {p} out of range"))?);
            }
            "fds" => {
                let count = r.array_len().map_err(|e| raw(e, key))?;
                if count > MAX_BUFFERS {
                    return Err(format!("{count} fds (at most {MAX_BUFFERS})"));
                }
                let mut v = Vec::with_capacity(count);
                for _ in 0..count {
                    let fd = r.sint().map_err(|e| raw(e, key))?;
                    v.push(i32::try_from(fd).map_err(|_| format!("fd {fd} out of range"))?);
                }
                fds = Some(v);
            }
            "tcp" => tcp = Some(r.str().map_err(|e| raw(e, key))?.to_string()),
            "hccl_root" => root = Some(unhex_root(r.str().map_err(|e| raw(e, key))?)?),
            "hccl_session" => session = Some(r.uint().map_err(|e| raw(e, key))?),
            "hccl_device" => {
                let d = r.uint().map_err(|e| raw(e, key))?;
                device = Some(u32::try_from(d).map_err(|_| format!("device {d} out of range"))?);
            }
            "hccl_watch" => watch = Some(r.str().map_err(|e| raw(e, key))?.to_string()),
            _ => {
                if !hixl.read(key, r)? {
                    r.skip_value().map_err(|e| raw(e, key))?
                }
            }
        }
    }
    let hccl = match (root, session, device, watch) {
        (None, None, None, None) => None,
        (Some(root_info), Some(session), Some(device), Some(watch)) => Some(Endpoint::Hccl {
            root_info,
            session,
            device,
            watch,
        }),
        _ => {
            return Err(
                "hccl endpoint needs hccl_root, hccl_session, hccl_device and hccl_watch".into(),
            )
        }
    };
    let hixl = hixl.endpoint()?;
    let device = match (hccl, hixl) {
        (Some(_), Some(_)) => None,
        (h, x) => h.or(x),
    };
    match (pid, fds, tcp, device) {
        (Some(pid), Some(fds), None, None) => Ok(Endpoint::Shm { pid, fds }),
        (None, None, Some(addr), None) => Ok(Endpoint::Tcp { addr }),
        (None, None, None, Some(h)) => Ok(h),
        _ => Err(
            "endpoint must be one of {pid, fds} (shm), {tcp} (tcp), {hccl_*} (hccl) or \
             {hixl_*} (hixl)"
                .into(),
        ),
    }
}

/// A REQ socket connected to `url` whose sends and receives give up after
/// `timeout` and which drops unsent frames when closed.
fn req_socket(
    ctx: &zmq::Context,
    url: &str,
    timeout: Duration,
) -> Result<zmq::Socket, ChannelError> {
    let zerr = |context: &str| {
        let context = format!("{context} {url}");
        move |source| ChannelError::Zmq { context, source }
    };
    let sock = ctx
        .socket(zmq::REQ)
        .map_err(zerr("creating REQ socket for"))?;
    let ms = i32::try_from(timeout.as_millis()).unwrap_or(i32::MAX);
    sock.set_linger(0).map_err(zerr("configuring"))?;
    sock.set_rcvtimeo(ms).map_err(zerr("configuring"))?;
    sock.set_sndtimeo(ms).map_err(zerr("configuring"))?;
    sock.connect(url).map_err(zerr("connecting to"))?;
    Ok(sock)
}

/// Connects to a listening peer at `url` (`tcp://host:port`), exchanges
/// hellos and attaches it. Fails within `timeout` if the peer never answers.
pub fn connect(
    ctx: &zmq::Context,
    url: &str,
    channel: &dyn TransferChannel,
    local: &Hello,
    timeout: Duration,
) -> Result<Agreement, ChannelError> {
    let sock = req_socket(ctx, url, timeout)?;
    let exchange = |frame: Vec<u8>| -> Result<Vec<u8>, ChannelError> {
        sock.send(frame, 0).map_err(|e| match e {
            zmq::Error::EAGAIN => ChannelError::Timeout {
                what: format!("handshake send to {url}"),
                after: timeout,
            },
            source => ChannelError::Zmq {
                context: format!("handshake send to {url}"),
                source,
            },
        })?;
        sock.recv_bytes(0).map_err(|e| match e {
            zmq::Error::EAGAIN => ChannelError::Timeout {
                what: format!(
                    "handshake with {url} (is the receiver running and listening on that init port?)"
                ),
                after: timeout,
            },
            source => ChannelError::Zmq {
                context: format!("handshake reply from {url}"),
                source,
            },
        })
    };
    // With a secret, the listener proves it first: our table leaves only then.
    let nonces = match channel.auth() {
        None => None,
        Some(secret) => {
            let ours = auth::nonce();
            let answer = exchange(single("auth_challenge", &auth::hex(&ours)))?;
            let Some((theirs, proof)) = decode_challenge_answer(&answer) else {
                return Err(refused_by(url, &answer, local));
            };
            if !secret.verify(Step::HandshakeServer, &[&ours, &theirs], &proof) {
                let why = format!(
                    "{url} did not prove it holds the deployment secret: its {SECRET_KEY} \
                     differs from this side's (use the same secret file on every worker)"
                );
                // Tell it, so both sides report the mismatch; its answer does not matter.
                let _ = exchange(single("auth_failed", &why));
                return Err(ChannelError::Handshake(why));
            }
            Some((secret, ours, theirs))
        }
    };
    // Channels that need a fresh endpoint per connection (hccl's root info) offer one.
    let offered = channel.offer()?.map(|endpoint| Hello {
        endpoint,
        ..local.clone()
    });
    let mut local = offered.unwrap_or_else(|| local.clone());
    let sent = Instant::now();
    local.clock_us = crate::wire::micros(sent);
    let seal = nonces.map(|(secret, ours, theirs)| Seal {
        secret,
        step: Step::HandshakeHello,
        nonces: (theirs, ours),
        send_nonce: Some(theirs),
    });
    let reply = exchange(local.encode_sealed(None, seal.as_ref()))?;
    let received = Instant::now();
    let decoded = match decode_hello(&reply) {
        Ok(d) => d,
        Err(_) if decode_refusal(&reply).is_some() => return Err(refused_by(url, &reply, &local)),
        Err(e) => {
            return Err(ChannelError::Handshake(format!(
                "malformed hello from {url}: {e}"
            )))
        }
    };
    if let Some((secret, ours, theirs)) = nonces {
        let proven = decoded
            .seal
            .as_ref()
            .is_some_and(|s| s.verify(secret, Step::HandshakeAnswer, (&ours, &theirs), &reply));
        if !proven {
            return Err(ChannelError::Handshake(format!(
                "the answer of {url} carries no valid proof of the deployment secret ({SECRET_KEY}); \
                 it was altered on the way, or the peer does not hold the secret"
            )));
        }
    }
    let (remote, error) = (decoded.hello, decoded.error);
    // A mode mismatch gets the same typed error on both sides.
    let lease = local.agree(&remote)?;
    if let Some(e) = error {
        return Err(ChannelError::Handshake(format!(
            "peer {} refused: {e}",
            remote.node
        )));
    }
    let peer = channel.attach(&remote.node, &remote.buffers, &remote.endpoint)?;
    // hccl finishes its setup in the background; report a failure here.
    if let Err(e) = channel.wait_ready(peer) {
        channel.detach(peer);
        return Err(e);
    }
    let session = nonces.map(|(secret, ours, theirs)| {
        Arc::new(Session::derive(
            secret,
            End::Sender,
            &ours,
            &theirs,
            &local.node,
            &remote.node,
        ))
    });
    Ok(Agreement {
        peer,
        remote,
        lease,
        exchange: Some((sent, received)),
        session,
    })
}

/// The error for a refusal (or an unreadable answer) from `url`: a mode
/// mismatch is typed as on the refusing side.
fn refused_by(url: &str, reply: &[u8], local: &Hello) -> ChannelError {
    match decode_refusal(reply) {
        Some(Refusal {
            mode: Some(mode),
            node,
            ..
        }) if mode != local.mode => ChannelError::ModeMismatch {
            local: local.mode.name().into(),
            remote: mode.name().into(),
            peer: node.unwrap_or_else(|| url.to_string()),
        },
        Some(Refusal { error, node, .. }) => ChannelError::Handshake(format!(
            "{} refused: {error}",
            node.as_deref().unwrap_or(url)
        )),
        None => ChannelError::Handshake(format!(
            "{url} answered with something that is neither a hello nor a refusal"
        )),
    }
}

/// What a clock / incarnation probe of a listening side found.
#[derive(Clone, Copy, Debug)]
pub struct Probed {
    /// When the probe left.
    pub sent: Instant,
    /// When the (authentic) answer arrived.
    pub received: Instant,
    /// The peer's monotonic clock, read in between (µs, its own epoch).
    pub clock_us: u64,
    /// The peer's incarnation (see [`Hello::incarnation`]); `None` when it
    /// does not say (an older peer).
    pub incarnation: Option<u64>,
}

/// Asks the side listening at `url` for its clock and incarnation, without
/// attaching (so an attachment, and reads in flight under it, stay alone).
///
/// With `secret`, the probe carries a fresh nonce and only an answer whose
/// proof covers it ([`Step::ClockAnswer`]) is taken: any other answer is
/// dropped (`on_forged` is called for each) and the wait goes on, bounded
/// by `timeout`. Without, the first answer is taken, as before.
pub fn probe(
    ctx: &zmq::Context,
    url: &str,
    timeout: Duration,
    secret: Option<&Secret>,
    on_forged: &mut dyn FnMut(),
) -> Result<Probed, ChannelError> {
    let zerr = |context: &str| {
        let context = format!("{context} {url}");
        move |source| ChannelError::Zmq { context, source }
    };
    // A DEALER speaks to the REP socket as a REQ would, but can drop a
    // forged answer and keep waiting for the real one.
    let sock = ctx
        .socket(zmq::DEALER)
        .map_err(zerr("creating the probe socket for"))?;
    sock.set_linger(0).map_err(zerr("configuring"))?;
    sock.set_maxmsgsize(MAX_HELLO_BYTES)
        .map_err(zerr("configuring"))?;
    sock.connect(url).map_err(zerr("connecting to"))?;
    let nonce = secret.map(|_| auth::nonce());
    let mut w = Writer::with_capacity(64);
    w.map_len(1 + usize::from(nonce.is_some())).expect("small");
    w.str("clock_probe").expect("short");
    w.bool(true);
    if let Some(n) = &nonce {
        w.str("auth_nonce").expect("short");
        w.str(&auth::hex(n)).expect("short");
    }
    let timeout_err = |what: &str| ChannelError::Timeout {
        what: format!("clock probe {what} {url}"),
        after: timeout,
    };
    let sent = Instant::now();
    let deadline = sent + timeout;
    let ms = |d: Duration| i32::try_from(d.as_millis()).unwrap_or(i32::MAX).max(1);
    sock.set_sndtimeo(ms(timeout))
        .map_err(zerr("configuring"))?;
    sock.send_multipart([&[][..], w.as_bytes()], 0)
        .map_err(|_| timeout_err("to"))?;
    loop {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return Err(timeout_err("answer from"));
        }
        sock.set_rcvtimeo(ms(left)).map_err(zerr("configuring"))?;
        let parts = sock
            .recv_multipart(0)
            .map_err(|_| timeout_err("answer from"))?;
        let received = Instant::now();
        let reply = match <[Vec<u8>; 2]>::try_from(parts) {
            Ok([empty, reply]) if empty.is_empty() => reply,
            _ => {
                on_forged();
                continue;
            }
        };
        let answer = decode_clock_answer(&reply);
        let Some(secret) = secret else {
            let (clock_us, incarnation, _) = answer.ok_or_else(|| {
                ChannelError::Handshake(format!("malformed clock probe answer from {url}"))
            })?;
            return Ok(Probed {
                sent,
                received,
                clock_us,
                incarnation,
            });
        };
        let nonce = nonce.expect("made with the secret");
        match answer {
            Some((clock_us, incarnation, Some(proof)))
                if secret.verify(
                    Step::ClockAnswer,
                    &[&clock_answer_covers(&nonce, clock_us, incarnation)],
                    &proof,
                ) =>
            {
                return Ok(Probed {
                    sent,
                    received,
                    clock_us,
                    incarnation,
                })
            }
            _ => {
                log::debug!(
                    "dropped a clock probe answer from {url} that does not prove the secret"
                );
                on_forged();
            }
        }
    }
}

/// What a probe answer's proof covers: the probe's nonce, the clock and the
/// incarnation (0 for none), each of fixed length.
fn clock_answer_covers(nonce: &Nonce, clock: u64, incarnation: Option<u64>) -> Vec<u8> {
    let mut v = nonce.to_vec();
    v.extend_from_slice(&clock.to_le_bytes());
    v.extend_from_slice(&incarnation.unwrap_or(0).to_le_bytes());
    v
}

/// The peer's clock, incarnation and proof from a clock probe's answer
/// `{clock_us[, incarnation[, auth_proof]]}` (older peers send the clock only).
fn decode_clock_answer(reply: &[u8]) -> Option<(u64, Option<u64>, Option<Proof>)> {
    let mut r = Reader::new(reply);
    let n = r.map_len().ok()?;
    if !(1..=3).contains(&n) || r.str().ok()? != "clock_us" {
        return None;
    }
    let clock = r.uint().ok()?;
    let incarnation = if n >= 2 {
        if r.str().ok()? != "incarnation" {
            return None;
        }
        Some(r.uint().ok()?)
    } else {
        None
    };
    let proof = if n == 3 {
        if r.str().ok()? != "auth_proof" {
            return None;
        }
        Some(auth::unhex(r.str().ok()?)?)
    } else {
        None
    };
    (r.remaining() == 0).then_some((clock, incarnation, proof))
}

/// Whether `frame` is a clock probe; the answer to it, which also names
/// our incarnation, and with `secret` proves it over the probe's nonce (a
/// probe without one is refused: only the same deployment may ask).
fn clock_probe_answer(frame: &[u8], incarnation: u64, secret: Option<&Secret>) -> Option<Vec<u8>> {
    let mut r = Reader::new(frame);
    let n = r.map_len().ok()?;
    if !(1..=2).contains(&n) || r.str().ok()? != "clock_probe" {
        return None;
    }
    r.bool().ok()?;
    let nonce = if n == 2 {
        if r.str().ok()? != "auth_nonce" {
            return None;
        }
        Some(auth::unhex::<{ auth::NONCE_LEN }>(r.str().ok()?)?)
    } else {
        None
    };
    let clock = crate::wire::micros(Instant::now());
    let proof = match (secret, nonce) {
        (None, _) => None,
        (Some(secret), Some(nonce)) => Some(secret.prove(
            Step::ClockAnswer,
            &[&clock_answer_covers(&nonce, clock, Some(incarnation))],
        )),
        (Some(_), None) => {
            return Some(refusal(
                None,
                &format!(
                    "this side requires the deployment secret: a clock probe must carry a nonce \
                     (set {SECRET_KEY} on the probing side)"
                ),
            ))
        }
    };
    let mut w = Writer::with_capacity(128);
    w.map_len(2 + usize::from(proof.is_some())).expect("small");
    w.str("clock_us").expect("short");
    w.uint(clock);
    w.str("incarnation").expect("short");
    w.uint(incarnation);
    if let Some(p) = proof {
        w.str("auth_proof").expect("short");
        w.str(&auth::hex(&p)).expect("short");
    }
    Some(w.into_bytes())
}

/// What the listening side reports for each incoming handshake.
#[derive(Debug)]
pub enum HandshakeEvent {
    /// A peer was attached.
    Attached(Agreement),
    /// A hello was refused (the peer was told why).
    Refused {
        /// The peer's node id, if the hello could be read.
        node: Option<String>,
        /// Why.
        error: ChannelError,
    },
}

/// The listening side: a thread serving hellos on a REP socket.
pub struct HandshakeServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
    url: String,
}

impl HandshakeServer {
    /// Binds `url` (`tcp://host:port`) and serves hellos until dropped.
    /// Each outcome is sent to `events`.
    pub fn spawn(
        ctx: &zmq::Context,
        url: &str,
        channel: Arc<dyn TransferChannel>,
        local: Hello,
        events: Sender<HandshakeEvent>,
    ) -> Result<HandshakeServer, ChannelError> {
        Self::spawn_with(ctx, url, channel, local, events, Box::new(|_| Ok(())))
    }

    /// Like [`HandshakeServer::spawn`], running `on_attach` for each
    /// attached peer before the answer goes out (so what it sets up, e.g.
    /// grants, is in place before the peer can act); its error refuses the
    /// hello and detaches the peer.
    pub fn spawn_with(
        ctx: &zmq::Context,
        url: &str,
        channel: Arc<dyn TransferChannel>,
        local: Hello,
        events: Sender<HandshakeEvent>,
        on_attach: OnAttach,
    ) -> Result<HandshakeServer, ChannelError> {
        let sock = ctx.socket(zmq::REP).map_err(|source| ChannelError::Zmq {
            context: format!("creating REP socket for {url}"),
            source,
        })?;
        sock.set_linger(0).ok();
        sock.set_maxmsgsize(MAX_HELLO_BYTES)
            .map_err(|source| ChannelError::Zmq {
                context: format!("capping the frame size of the handshake socket {url}"),
                source,
            })?;
        sock.bind(url).map_err(|source| ChannelError::Zmq {
            context: format!("binding the handshake socket {url} (is the init port in use?)"),
            source,
        })?;
        let bound = sock
            .get_last_endpoint()
            .ok()
            .and_then(|e| e.ok())
            .unwrap_or_else(|| url.to_string());
        let stop = Arc::new(AtomicBool::new(false));
        let stop2 = Arc::clone(&stop);
        let thread = std::thread::Builder::new()
            .name("pd-handshake".into())
            .spawn(move || serve(sock, channel, local, events, on_attach, stop2))
            .map_err(|source| ChannelError::Io {
                context: "spawning the handshake thread".into(),
                source,
            })?;
        Ok(HandshakeServer {
            stop,
            thread: Some(thread),
            url: bound,
        })
    }

    /// The bound endpoint (with the real port when bound to port 0).
    pub fn url(&self) -> &str {
        &self.url
    }
}

impl Drop for HandshakeServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// What [`HandshakeServer::spawn_with`] runs for each attached peer.
pub type OnAttach = Box<dyn Fn(&Agreement) -> Result<(), ChannelError> + Send>;

fn serve(
    sock: zmq::Socket,
    channel: Arc<dyn TransferChannel>,
    local: Hello,
    events: Sender<HandshakeEvent>,
    on_attach: OnAttach,
    stop: Arc<AtomicBool>,
) {
    let mut challenges = Challenges::default();
    while !stop.load(Ordering::Acquire) {
        match sock.poll(zmq::POLLIN, 100) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(_) => break,
        }
        let Ok(frame) = sock.recv_bytes(0) else {
            continue;
        };
        if let Some(answer) = clock_probe_answer(&frame, local.incarnation, channel.auth()) {
            let _ = sock.send(answer, 0);
            continue;
        }
        let (reply, event) = answer_frame(
            &frame,
            channel.as_ref(),
            &local,
            &on_attach,
            &mut challenges,
        );
        // A REQ peer that vanished leaves nothing to reply to; keep serving.
        let _ = sock.send(reply, 0);
        if let Some(event) = event {
            let _ = events.send(event);
        }
    }
}

/// The listening side's answer to one frame, and what to report.
fn answer_frame(
    frame: &[u8],
    channel: &dyn TransferChannel,
    local: &Hello,
    on_attach: &OnAttach,
    challenges: &mut Challenges,
) -> (Vec<u8>, Option<HandshakeEvent>) {
    let secret = channel.auth();
    let refuse = |node: Option<String>, error: ChannelError, tell: Option<&Hello>| {
        let reply = refusal(tell, &error.to_string());
        (reply, Some(HandshakeEvent::Refused { node, error }))
    };
    let unauthenticated = |why: String| {
        refuse(
            None,
            ChannelError::Handshake(format!("not authenticated: {why}")),
            None,
        )
    };
    if let Some(theirs) = single_value(frame, "auth_challenge") {
        let Some(secret) = secret else {
            return refuse(
                None,
                ChannelError::Handshake(format!(
                    "the connecting side has {SECRET_KEY} set, but this side runs without a \
                     deployment secret: set the same secret file on both (or on neither)"
                )),
                None,
            );
        };
        let Some(theirs) = auth::unhex::<{ auth::NONCE_LEN }>(theirs) else {
            return unauthenticated("malformed challenge".into());
        };
        let ours = auth::nonce();
        if !challenges.open(Instant::now(), ours, theirs) {
            return unauthenticated(format!(
                "more than {MAX_OPEN_CHALLENGES} handshakes in progress; try again later"
            ));
        }
        let proof = secret.prove(Step::HandshakeServer, &[&theirs, &ours]);
        return (challenge_answer(&ours, &proof), None);
    }
    if let Some(why) = single_value(frame, "auth_failed") {
        let error = ChannelError::Handshake(format!(
            "the connecting side could not verify this side's proof ({why}); the two {SECRET_KEY} \
             files differ"
        ));
        return refuse(None, error, None);
    }
    let decoded = match decode_hello(frame) {
        Ok(d) => d,
        Err(e) => {
            let error = ChannelError::Handshake(format!("malformed hello: {e}"));
            // Only an authenticated peer learns what this side runs.
            return refuse(None, error, secret.is_none().then_some(local));
        }
    };
    let nonces = match (secret, &decoded.seal) {
        (None, None) => None,
        (None, Some(_)) => {
            return unauthenticated(format!(
                "the hello is sealed but this side runs without {SECRET_KEY}: set the same secret \
                 file on both (or on neither)"
            ))
        }
        (Some(_), None) => {
            return unauthenticated(format!(
                "this side requires the deployment secret: set {SECRET_KEY} (or {SECRET_ENV}) on \
                 the connecting side to the same secret file"
            ))
        }
        (Some(secret), Some(seal)) => {
            let ours = seal
                .nonce
                .and_then(|n| challenges.take(Instant::now(), &n).map(|t| (n, t)));
            let Some((ours, theirs)) = ours else {
                return unauthenticated("the hello answers no open challenge of this side".into());
            };
            if !seal.verify(secret, Step::HandshakeHello, (&ours, &theirs), frame) {
                return unauthenticated(format!(
                    "the hello's proof does not verify: the connecting side's {SECRET_KEY} differs \
                     from this side's, or the hello was altered on the way"
                ));
            }
            Some((secret, ours, theirs))
        }
    };
    let remote = decoded.hello;
    let outcome = local.agree(&remote).and_then(|lease| {
        let a = channel
            .attach(&remote.node, &remote.buffers, &remote.endpoint)
            .map(|peer| Agreement {
                peer,
                remote: remote.clone(),
                lease,
                exchange: None,
                session: nonces.map(|(secret, ours, theirs)| {
                    Arc::new(Session::derive(
                        secret,
                        End::Receiver,
                        &theirs,
                        &ours,
                        &remote.node,
                        &local.node,
                    ))
                }),
            })?;
        if let Err(e) = on_attach(&a) {
            channel.detach(a.peer);
            return Err(e);
        }
        Ok(a)
    });
    match outcome {
        Ok(a) => {
            let mut answer = local.clone();
            if let Some(endpoint) = channel.answer(&remote.endpoint) {
                answer.endpoint = endpoint;
            }
            // Read as late as possible: the connecting side
            // bounds our clock by when the answer arrives.
            answer.clock_us = crate::wire::micros(Instant::now());
            let seal = nonces.map(|(secret, ours, theirs)| Seal {
                secret,
                step: Step::HandshakeAnswer,
                nonces: (theirs, ours),
                send_nonce: None,
            });
            (
                answer.encode_sealed(None, seal.as_ref()),
                Some(HandshakeEvent::Attached(a)),
            )
        }
        Err(error) => refuse(Some(remote.node.clone()), error, Some(local)),
    }
}

/// The handshake's other decoders, for the fuzz tests (`tests/fuzz.rs`);
/// hellos and refusals go through [`Hello::decode`] and [`refusal_reason`].
#[doc(hidden)]
pub mod fuzzing {
    use super::*;

    /// A challenge's answer `{auth_nonce, auth_proof}`.
    pub fn challenge_answer(nonce: &Nonce, proof: &Proof) -> Vec<u8> {
        super::challenge_answer(nonce, proof)
    }

    /// Decodes a challenge's answer.
    pub fn decode_challenge_answer(frame: &[u8]) -> Option<(Nonce, Proof)> {
        super::decode_challenge_answer(frame)
    }

    /// A one-entry frame `{key: value}` (a challenge, an `auth_failed`).
    pub fn single(key: &str, value: &str) -> Vec<u8> {
        super::single(key, value)
    }

    /// The value of a one-entry frame.
    pub fn single_value<'a>(frame: &'a [u8], key: &str) -> Option<&'a str> {
        super::single_value(frame, key)
    }

    /// Whether the listening side takes `frame` for a clock probe.
    pub fn is_clock_probe(frame: &[u8]) -> bool {
        clock_probe_answer(frame, 0, None).is_some()
    }

    /// The clock of a clock probe's answer.
    pub fn decode_clock_answer(reply: &[u8]) -> Option<u64> {
        super::decode_clock_answer(reply).map(|(clock, ..)| clock)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hello(endpoint: Endpoint) -> Hello {
        Hello {
            version: HANDSHAKE_VERSION,
            node: "n".into(),
            role: Role::Sender,
            mode: TransferMode::Push,
            channel: ChannelKind::Tcp,
            lease: Duration::from_millis(1500),
            buffers: vec![],
            endpoint,
            clock_us: 7,
            incarnation: 11,
            tp: None,
            lib: Some(LIB_VERSION.into()),
            model: Some("tiny-llama@0a1b".into()),
        }
    }

    #[test]
    fn the_release_and_the_model_round_trip_and_mismatches_are_refused_by_name() {
        let ours = hello(Endpoint::Tcp {
            addr: "1.2.3.4:5".into(),
        });
        let (back, _) = Hello::decode(&ours.encode(None)).unwrap();
        assert_eq!(back, ours);
        let theirs = |lib: Option<&str>, model: Option<&str>| Hello {
            role: Role::Receiver,
            node: "peer".into(),
            lib: lib.map(Into::into),
            model: model.map(Into::into),
            ..ours.clone()
        };
        // Another model: refused from either side, naming both and the key.
        for (a, b) in [
            (&ours, &theirs(Some(LIB_VERSION), Some("other@ffff"))),
            (&theirs(Some(LIB_VERSION), Some("other@ffff")), &ours),
        ] {
            let e = a.agree(b).unwrap_err().to_string();
            assert!(
                e.contains("other@ffff") && e.contains("tiny-llama@0a1b"),
                "{e}"
            );
            assert!(e.contains("pd_model_identity"), "{e}");
        }
        // Another minor release: refused, naming both.
        let e = ours
            .agree(&theirs(Some("0.99.0"), Some("tiny-llama@0a1b")))
            .unwrap_err()
            .to_string();
        assert!(e.contains("0.99.0") && e.contains(LIB_VERSION), "{e}");
        assert!(e.contains("same ascend-pd release"), "{e}");
        // A patch release, or a peer that names no model: accepted.
        let patch = format!("{LIB_VERSION}-post1");
        assert!(ours.agree(&theirs(Some(&patch), None)).is_ok());
        assert!(ours.agree(&theirs(None, Some("tiny-llama@0a1b"))).is_ok());
        assert!(releases_compatible("0.1.0", "0.1.7"));
        assert!(!releases_compatible("0.1.0", "0.2.0"));
        assert!(releases_compatible("1.2.0", "1.9.1"));
        assert!(!releases_compatible("1.2.0", "2.0.0"));
        // An empty or oversized identity is malformed.
        let mut bad = ours.clone();
        bad.model = Some("x".repeat(MAX_IDENTITY_BYTES + 1));
        assert!(Hello::decode(&bad.encode(None)).is_err());
    }

    #[test]
    fn tcp_and_shm_endpoints_encode_as_before() {
        // Bytes of the endpoint map as version 1 has always written them.
        let tcp = hello(Endpoint::Tcp {
            addr: "1.2.3.4:5".into(),
        })
        .encode(None);
        let want_tcp = b"\xa8endpoint\x81\xa3tcp\xa91.2.3.4:5\xa5error\xc0";
        assert!(tcp.ends_with(want_tcp), "{tcp:x?}");
        let shm = hello(Endpoint::Shm {
            pid: 7,
            fds: vec![3, 4],
        })
        .encode(None);
        let want_shm = b"\xa8endpoint\x82\xa3pid\x07\xa3fds\x92\x03\x04\xa5error\xc0";
        assert!(shm.ends_with(want_shm), "{shm:x?}");
        for bytes in [tcp, shm] {
            Hello::decode(&bytes).unwrap();
        }
    }

    #[test]
    fn hccl_endpoints_round_trip_and_bad_root_lengths_are_refused() {
        for root_info in [
            vec![],
            (0..ascend_sys::ROOT_INFO_LEN).map(|i| i as u8).collect(),
        ] {
            let ep = Endpoint::Hccl {
                root_info,
                session: 0xdead_beef_0123,
                device: 3,
                watch: "127.0.0.1:9".into(),
            };
            let (back, err) = Hello::decode(&hello(ep.clone()).encode(None)).unwrap();
            assert_eq!((back.endpoint, err), (ep, None));
        }
        let bad = hello(Endpoint::Hccl {
            root_info: vec![1, 2, 3],
            session: 1,
            device: 0,
            watch: "x:1".into(),
        })
        .encode(None);
        let e = Hello::decode(&bad).unwrap_err().to_string();
        assert!(e.contains("hccl_root is 6 hex digits"), "{e}");
    }

    #[test]
    fn hixl_endpoints_round_trip_and_incomplete_ones_are_refused() {
        for ipv4 in [None, Some("10.1.2.3".parse().unwrap())] {
            for protocol in [
                ascend_sys::HixlProtocol::Roce,
                ascend_sys::HixlProtocol::Hccs,
            ] {
                let ep = Endpoint::Hixl {
                    session: 0x0123_4567_89ab_cdef,
                    server: "127.0.0.1:26000".into(),
                    device: ascend_sys::HixlEndpoint {
                        protocol,
                        device_phy_id: 5,
                        ipv4,
                    },
                    watch: "127.0.0.1:4000".into(),
                };
                let h = hello(ep);
                let (back, err) = Hello::decode(&h.encode(None)).unwrap();
                assert_eq!((back, err), (h, None));
            }
        }
        // A field missing, or an unknown protocol.
        let full = hello(Endpoint::Hixl {
            session: 1,
            server: "127.0.0.1:26000".into(),
            device: ascend_sys::HixlEndpoint {
                protocol: ascend_sys::HixlProtocol::Roce,
                device_phy_id: 0,
                ipv4: None,
            },
            watch: "127.0.0.1:4000".into(),
        })
        .encode(None);
        let swap = |from: &str, to: &str| {
            let (a, b) = (from.as_bytes(), to.as_bytes());
            assert_eq!(a.len(), b.len());
            let at = full.windows(a.len()).position(|w| w == a).expect(from);
            let mut v = full.clone();
            v[at..at + a.len()].copy_from_slice(b);
            Hello::decode(&v).unwrap_err().to_string()
        };
        let e = swap("hixl_watch", "hixl_xxxxx");
        assert!(e.contains("hixl endpoint needs"), "{e}");
        let e = swap("roce", "rdma");
        assert!(e.contains("hixl_protocol"), "{e}");
    }

    #[test]
    fn comm_and_hixl_ends_are_refused_naming_pd_hccl_path() {
        let mut ours = hello(Endpoint::Tcp { addr: "a:1".into() });
        ours.channel = ChannelKind::Hixl;
        let mut theirs = ours.clone();
        theirs.role = Role::Receiver;
        theirs.channel = ChannelKind::Hccl;
        let e = ours.agree(&theirs).unwrap_err().to_string();
        assert!(
            e.contains("pd_hccl_path") && e.contains("HIXL path") && e.contains("comm path"),
            "{e}"
        );
        // Other channel pairs keep their own message.
        theirs.channel = ChannelKind::Tcp;
        let e = ours.agree(&theirs).unwrap_err().to_string();
        assert!(
            e.contains("set the same transfer_channel") && !e.contains("pd_hccl_path"),
            "{e}"
        );
        theirs.channel = ChannelKind::Hixl;
        assert!(ours.agree(&theirs).is_ok());
    }

    #[test]
    fn challenges_are_used_once_expire_and_stay_bounded() {
        let t0 = Instant::now();
        let mut c = Challenges::default();
        assert!(c.open(t0, [1; 16], [2; 16]));
        assert_eq!(c.take(t0, &[1; 16]), Some([2; 16]));
        assert_eq!(c.take(t0, &[1; 16]), None, "used once");
        assert!(c.open(t0, [3; 16], [4; 16]));
        assert_eq!(c.take(t0 + CHALLENGE_TTL, &[3; 16]), None, "expired");
        for i in 0..MAX_OPEN_CHALLENGES {
            let mut n = [0u8; 16];
            n[..8].copy_from_slice(&(i as u64).to_le_bytes());
            assert!(c.open(t0, n, n));
        }
        assert!(!c.open(t0, [9; 16], [9; 16]), "full");
        assert!(
            c.open(
                t0 + CHALLENGE_TTL + Duration::from_secs(1),
                [9; 16],
                [9; 16]
            ),
            "the expired make room"
        );
    }

    #[test]
    fn a_sealed_hello_verifies_only_unaltered_and_with_the_same_secret() {
        let secret = Secret::from_bytes(&[5; 32]).unwrap();
        let h = hello(Endpoint::Tcp {
            addr: "1.2.3.4:5".into(),
        });
        let seal = Seal {
            secret: &secret,
            step: Step::HandshakeHello,
            nonces: ([1; 16], [2; 16]),
            send_nonce: Some([1; 16]),
        };
        let bytes = h.encode_sealed(None, Some(&seal));
        let d = decode_hello(&bytes).unwrap();
        assert_eq!(d.hello, h);
        let seen = d.seal.unwrap();
        assert_eq!(seen.nonce, Some([1; 16]));
        assert!(seen.verify(&secret, Step::HandshakeHello, (&[1; 16], &[2; 16]), &bytes));
        let other = Secret::from_bytes(&[6; 32]).unwrap();
        assert!(!seen.verify(&other, Step::HandshakeHello, (&[1; 16], &[2; 16]), &bytes));
        assert!(!seen.verify(&secret, Step::HandshakeAnswer, (&[1; 16], &[2; 16]), &bytes));
        // Another endpoint, same length: the proof no longer holds.
        let at = bytes.windows(9).position(|w| w == b"1.2.3.4:5").unwrap();
        let mut altered = bytes.clone();
        altered[at..at + 9].copy_from_slice(b"6.6.6.6:6");
        assert_eq!(altered.len(), bytes.len());
        let d = decode_hello(&altered).unwrap();
        assert!(!d.seal.unwrap().verify(
            &secret,
            Step::HandshakeHello,
            (&[1; 16], &[2; 16]),
            &altered
        ));
    }

    #[test]
    fn refusals_name_the_reason_and_carry_no_table() {
        let h = hello(Endpoint::Tcp {
            addr: "1.2.3.4:5".into(),
        });
        for tell in [None, Some(&h)] {
            let bytes = refusal(tell, "no");
            assert!(decode_hello(&bytes).is_err());
            assert_eq!(refusal_reason(&bytes).as_deref(), Some("no"));
            let text = String::from_utf8_lossy(&bytes);
            assert!(
                !text.contains("1.2.3.4") && !text.contains("buffers"),
                "{text}"
            );
        }
        let r = decode_refusal(&refusal(Some(&h), "no")).unwrap();
        assert_eq!(
            (r.mode, r.node.as_deref()),
            (Some(TransferMode::Push), Some("n"))
        );
    }

    #[test]
    fn the_tp_split_round_trips_and_mismatched_splits_are_refused_by_name() {
        let tp = |tp, peer_tp, rank| TpInfo {
            tp,
            peer_tp,
            rank,
            total_heads: 8,
            replicated: false,
        };
        let sender = Hello {
            tp: Some(tp(2, 1, 1)),
            ..hello(Endpoint::Tcp {
                addr: "127.0.0.1:1".into(),
            })
        };
        let back = decode_hello(&sender.encode(None)).unwrap().hello;
        assert_eq!(back.tp, sender.tp);
        // Without it (an older peer) the field is absent, not an error.
        let plain = hello(Endpoint::Tcp {
            addr: "127.0.0.1:1".into(),
        });
        assert_eq!(decode_hello(&plain.encode(None)).unwrap().hello.tp, None);

        let receiver = Hello {
            role: Role::Receiver,
            tp: Some(tp(1, 2, 0)),
            ..sender.clone()
        };
        assert!(receiver.agree(&sender).is_ok());
        assert_eq!(
            tp(1, 2, 0).piece_from(&tp(2, 1, 1)).unwrap(),
            crate::layout::tp::HeadRange { start: 4, end: 8 }
        );
        // The receiver thinks the prefill TP is 4.
        let wrong = Hello {
            tp: Some(tp(1, 4, 0)),
            ..receiver.clone()
        };
        let e = wrong.agree(&sender).unwrap_err().to_string();
        assert!(e.contains("pd_peer_tp_size"), "{e}");
        // Another model size.
        let other = Hello {
            tp: Some(TpInfo {
                total_heads: 16,
                ..tp(1, 2, 0)
            }),
            ..receiver
        };
        let e = other.agree(&sender).unwrap_err().to_string();
        assert!(
            e.contains("8 KV head(s)") && e.contains("kv_num_heads"),
            "{e}"
        );
        // A decode rank holding none of the sender's heads.
        let e = tp(2, 2, 0).piece_from(&tp(2, 2, 1)).unwrap_err();
        assert!(e.contains("holds none of decode rank 0"), "{e}");
    }
}
