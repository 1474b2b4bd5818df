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
//! deadline is converted with it, see `protocol::lease`). [`probe_clock`]
//! measures it again later on the same socket.

use super::{BufferDesc, ChannelError, Endpoint, PeerId, PeerTable, TransferChannel};
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
        Hello {
            version: HANDSHAKE_VERSION,
            node: node.to_string(),
            role,
            mode,
            channel: channel.kind(),
            lease,
            buffers: channel.local_table(),
            endpoint: channel.endpoint(),
            clock_us: 0,
        }
    }

    /// Checks that `remote` can talk to `self`; returns the agreed lease.
    pub fn agree(&self, remote: &Hello) -> Result<Duration, ChannelError> {
        if remote.version != self.version {
            return Err(ChannelError::Handshake(format!(
                "peer {} speaks handshake version {}, this side {}; run the same ascend-pd version on both",
                remote.node, remote.version, self.version
            )));
        }
        if remote.mode != self.mode {
            return Err(ChannelError::ModeMismatch {
                local: self.mode.name().into(),
                remote: remote.mode.name().into(),
                peer: remote.node.clone(),
            });
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
        PeerTable::new(&remote.buffers)?;
        Ok(self.lease.min(remote.lease))
    }

    /// Encodes as a msgpack map, with `error` when refusing.
    pub fn encode(&self, error: Option<&str>) -> Vec<u8> {
        let mut w = Writer::with_capacity(256);
        // Nine fields and `error` (nil when accepting).
        w.map_len(10).expect("small map");
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
        }
        s(&mut w, "error");
        match error {
            Some(e) => s(&mut w, e),
            None => w.nil(),
        }
        w.into_bytes()
    }

    /// Decodes and validates a received hello; also returns the peer's `error`, if any.
    pub fn decode(bytes: &[u8]) -> Result<(Hello, Option<String>), ChannelError> {
        decode_hello(bytes).map_err(|e| ChannelError::Handshake(format!("malformed hello: {e}")))
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

fn decode_hello(bytes: &[u8]) -> Result<(Hello, Option<String>), String> {
    let mut r = Reader::new(bytes);
    let n = r.map_len().map_err(|e| raw(e, "<top>"))?;
    let (mut version, mut node, mut role, mut mode, mut channel, mut lease) =
        (None, None, None, None, None, None);
    let mut clock_us = None;
    let mut buffers = None;
    let mut endpoint = None;
    let mut error = None;
    for _ in 0..n {
        let key = r.str().map_err(|e| raw(e, "<key>"))?;
        match key {
            "v" => version = Some(r.uint().map_err(|e| raw(e, key))?),
            "node" => node = Some(r.str().map_err(|e| raw(e, key))?.to_string()),
            "role" => {
                let v = r.str().map_err(|e| raw(e, key))?;
                role = Some(Role::from_str(v).map_err(|_| format!("unknown role {v:?}"))?);
            }
            "mode" => {
                let v = r.str().map_err(|e| raw(e, key))?;
                mode = Some(match v {
                    "push" => TransferMode::Push,
                    "pull-eager" => TransferMode::PullEager,
                    "pull-delay" => TransferMode::PullDelay,
                    _ => return Err(format!("unknown mode {v:?}")),
                });
            }
            "channel" => {
                let v = r.str().map_err(|e| raw(e, key))?;
                channel =
                    Some(ChannelKind::from_str(v).map_err(|_| format!("unknown channel {v:?}"))?);
            }
            "lease_ms" => lease = Some(Duration::from_millis(r.uint().map_err(|e| raw(e, key))?)),
            "clock_us" => clock_us = Some(r.uint().map_err(|e| raw(e, key))?),
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
    };
    Ok((hello, error))
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

fn decode_endpoint(r: &mut Reader<'_>) -> Result<Endpoint, String> {
    let n = r.map_len().map_err(|e| raw(e, "endpoint"))?;
    let (mut pid, mut fds, mut tcp) = (None, None, None);
    let (mut root, mut session, mut device, mut watch) = (None, None, None, None);
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
            _ => r.skip_value().map_err(|e| raw(e, key))?,
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
    match (pid, fds, tcp, hccl) {
        (Some(pid), Some(fds), None, None) => Ok(Endpoint::Shm { pid, fds }),
        (None, None, Some(addr), None) => Ok(Endpoint::Tcp { addr }),
        (None, None, None, Some(h)) => Ok(h),
        _ => Err("endpoint must be one of {pid, fds} (shm), {tcp} (tcp) or {hccl_*} (hccl)".into()),
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
    // Channels that need a fresh endpoint per connection (hccl's root info) offer one.
    let offered = channel.offer()?.map(|endpoint| Hello {
        endpoint,
        ..local.clone()
    });
    let mut local = offered.unwrap_or_else(|| local.clone());
    let sent = Instant::now();
    local.clock_us = crate::wire::micros(sent);
    sock.send(local.encode(None), 0).map_err(|e| match e {
        zmq::Error::EAGAIN => ChannelError::Timeout {
            what: format!("handshake send to {url}"),
            after: timeout,
        },
        source => ChannelError::Zmq {
            context: format!("handshake send to {url}"),
            source,
        },
    })?;
    let reply = sock.recv_bytes(0).map_err(|e| match e {
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
    })?;
    let received = Instant::now();
    let (remote, error) = Hello::decode(&reply)?;
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
    Ok(Agreement {
        peer,
        remote,
        lease,
        exchange: Some((sent, received)),
    })
}

/// Measures the peer's clock again over its handshake socket at `url`:
/// returns when our probe left, when the answer arrived, and the peer's
/// clock read in between (µs, its own epoch).
pub fn probe_clock(
    ctx: &zmq::Context,
    url: &str,
    timeout: Duration,
) -> Result<(Instant, Instant, u64), ChannelError> {
    let sock = req_socket(ctx, url, timeout)?;
    let mut w = Writer::with_capacity(16);
    w.map_len(1).expect("1");
    w.str("clock_probe").expect("short");
    w.bool(true);
    let sent = Instant::now();
    let timeout_err = |what: &str| ChannelError::Timeout {
        what: format!("clock probe {what} {url}"),
        after: timeout,
    };
    sock.send(w.into_bytes(), 0)
        .map_err(|_| timeout_err("to"))?;
    let reply = sock.recv_bytes(0).map_err(|_| timeout_err("answer from"))?;
    let received = Instant::now();
    let bad = || ChannelError::Handshake(format!("malformed clock probe answer from {url}"));
    let mut r = Reader::new(&reply);
    if r.map_len().map_err(|_| bad())? != 1 || r.str().map_err(|_| bad())? != "clock_us" {
        return Err(bad());
    }
    let clock = r.uint().map_err(|_| bad())?;
    Ok((sent, received, clock))
}

/// Whether `frame` is a clock probe; the answer to it.
fn clock_probe_answer(frame: &[u8]) -> Option<Vec<u8>> {
    let mut r = Reader::new(frame);
    if r.map_len().ok()? != 1 || r.str().ok()? != "clock_probe" {
        return None;
    }
    let mut w = Writer::with_capacity(16);
    w.map_len(1).expect("1");
    w.str("clock_us").expect("short");
    w.uint(crate::wire::micros(Instant::now()));
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
    while !stop.load(Ordering::Acquire) {
        match sock.poll(zmq::POLLIN, 100) {
            Ok(0) => continue,
            Ok(_) => {}
            Err(_) => break,
        }
        let Ok(frame) = sock.recv_bytes(0) else {
            continue;
        };
        if let Some(answer) = clock_probe_answer(&frame) {
            let _ = sock.send(answer, 0);
            continue;
        }
        let (reply, event) = match Hello::decode(&frame) {
            Err(error) => (
                local.encode(Some(&error.to_string())),
                HandshakeEvent::Refused { node: None, error },
            ),
            Ok((remote, _)) => {
                let outcome = local.agree(&remote).and_then(|lease| {
                    let a = channel
                        .attach(&remote.node, &remote.buffers, &remote.endpoint)
                        .map(|peer| Agreement {
                            peer,
                            remote: remote.clone(),
                            lease,
                            exchange: None,
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
                        (answer.encode(None), HandshakeEvent::Attached(a))
                    }
                    Err(error) => (
                        local.encode(Some(&error.to_string())),
                        HandshakeEvent::Refused {
                            node: Some(remote.node.clone()),
                            error,
                        },
                    ),
                }
            }
        };
        // A REQ peer that vanished leaves nothing to reply to; keep serving.
        let _ = sock.send(reply, 0);
        let _ = events.send(event);
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
        }
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
}
