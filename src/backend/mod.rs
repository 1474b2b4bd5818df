//! The I/O shell around the sans-IO protocol core: ZMQ sockets, threads and
//! the transfer channel.
//!
//! - [`Sender`] (prefill): `put(keys, chunks, spec)` in push, pull-eager or
//!   pull-delay mode, a PULL socket for PullDoneSignal and a TTL sweeper
//!   around the protocol's sender core.
//! - [`Receiver`] (decode): the handshake socket and the request (ROUTER)
//!   socket, eager reads, the load path, a PUSH pool for PullDoneSignal and
//!   a sweeper around the protocol's receiver core.
//!
//! Every socket wait is bounded; one slow or dead peer holds only its own
//! lock, never the others'. What to send and which pages to grant or
//! release is decided by [`crate::protocol`]; this module only moves frames
//! and bytes.

mod counters;
pub mod pools;
mod receiver;
pub(crate) mod register;
mod sender;
pub(crate) mod zmq_io;

pub use crate::protocol::PutOutcome;
pub use counters::{MessageCounters, MessageKind};
pub use receiver::{FetchError, Receiver, ReceiverStats};
pub use sender::{DirectLayer, LayerSource, Sender, SenderStats, SenderTimeouts, TransferSpec};

use crate::channel::ChannelError;
use crate::config::ConfigError;
use crate::memory::MemoryError;
use crate::protocol::PutRejected;
use std::time::Duration;

/// Why a backend call failed.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum BackendError {
    /// The configuration cannot run this backend.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// A configuration problem found when starting (names the key and the fix).
    #[error("{0}")]
    Setup(String),
    /// Memory could not be had.
    #[error(transparent)]
    Memory(#[from] MemoryError),
    /// The transfer channel failed.
    #[error(transparent)]
    Channel(#[from] ChannelError),
    /// A side-channel socket failed.
    #[error("{context}: {source}")]
    Zmq {
        /// What was being done.
        context: String,
        /// The ZMQ error.
        #[source]
        source: zmq::Error,
    },
    /// A peer did not answer in time (its REQ socket was replaced).
    #[error(
        "{what}: no reply within {after:?} (the request socket was reset; is the peer alive?)"
    )]
    Timeout {
        /// What was waited for.
        what: String,
        /// How long.
        after: Duration,
    },
    /// A peer answered with something that is not the expected message.
    #[error("{peer}: bad reply: {detail}")]
    BadReply {
        /// Which peer.
        peer: String,
        /// What was wrong.
        detail: String,
    },
    /// The caller's input is unusable (named, nothing was sent).
    #[error("invalid input: {0}")]
    InvalidInput(String),
    /// Pull backpressure did not clear in time, or the batch can never fit.
    #[error("backpressure: {0}")]
    Backpressure(String),
    /// The receiver refused our push notice: the chunks are not resident
    /// there (the allocation expired, or the notice named the wrong pages).
    #[error("{peer} refused the push notice: {why}")]
    NoticeRefused {
        /// Which peer.
        peer: String,
        /// Its reason.
        why: String,
    },
    /// A layer-wise save ended before the engine handed over every layer:
    /// the receiver dropped what it allocated, nothing of it is loadable.
    #[error("layer-wise save: layer {layer} of {layers} never came ({why}); the receiver dropped the request's pages")]
    LayerMissing {
        /// The first layer not written.
        layer: usize,
        /// Layers of the model.
        layers: usize,
        /// Why.
        why: String,
    },
    /// The backend is shutting down.
    #[error("the backend is closed")]
    Closed,
}

impl From<PutRejected> for BackendError {
    fn from(r: PutRejected) -> Self {
        match r {
            PutRejected::InvalidInput(m) => BackendError::InvalidInput(m),
            PutRejected::Backpressure(m) => BackendError::Backpressure(m),
            PutRejected::BadReply { peer, detail } => BackendError::BadReply { peer, detail },
            PutRejected::NoticeRefused { peer, why } => BackendError::NoticeRefused { peer, why },
            PutRejected::LayerMissing { layer, layers, why } => {
                BackendError::LayerMissing { layer, layers, why }
            }
        }
    }
}

/// A worker's node id: how peers, grants and routes name it.
///
/// A receiver is `host:alloc_port` (one process binds that port). A sender
/// is `host:done_port/p<pid>r<rank>-<nonce>`: unique per process and TP
/// rank (two push senders on one host have no port of their own) and per
/// start (a restarted process gets a new nonce).
#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct NodeId {
    id: String,
    rank: usize,
}

impl NodeId {
    pub(crate) fn sender(host: &str, done_port: Option<u16>, rank: usize) -> NodeId {
        let nonce = uuid::Uuid::new_v4().as_u64_pair().0 as u32;
        NodeId {
            id: format!(
                "{host}:{}/p{}r{rank}-{nonce:08x}",
                done_port.unwrap_or(0),
                std::process::id()
            ),
            rank,
        }
    }

    pub(crate) fn receiver(host: &str, alloc_port: u16, rank: usize) -> NodeId {
        NodeId {
            id: format!("{host}:{alloc_port}"),
            rank,
        }
    }

    pub(crate) fn as_str(&self) -> &str {
        &self.id
    }

    pub(crate) fn rank(&self) -> usize {
        self.rank
    }
}

/// What both roles open before their own sockets: the pools, the transfer
/// channel over them (named `node`), a ZMQ context, the message counters
/// and a push thread (`push_thread`) whose dropped sends count as timeouts.
pub(crate) struct Opened {
    pub(crate) alloc: crate::memory::DualAllocator,
    pub(crate) pools: Vec<std::sync::Arc<crate::memory::PagePool>>,
    pub(crate) channel: std::sync::Arc<dyn crate::channel::TransferChannel>,
    pub(crate) ctx: zmq::Context,
    pub(crate) counters: std::sync::Arc<counters::MessageCounters>,
    pub(crate) pushes: zmq_io::PushPool,
}

impl Opened {
    pub(crate) fn open(
        config: &crate::config::PdConfig,
        host: &str,
        node: &NodeId,
        push_thread: &str,
    ) -> Result<Opened, BackendError> {
        // A bare `npu` device means NPU <rank>; CANN is loaded only if a pool needs it.
        let alloc = pools::allocator_for(config, node.rank() as u32)?;
        // One copy pool per process: the first worker to start sizes it.
        crate::memory::copy_pool::configure(config.copy_threads());
        let pools: Vec<_> = alloc.pools().cloned().collect();
        let secret = crate::auth::Secret::from_env_or(config.auth_secret_file.as_deref())
            .map_err(|e| BackendError::Setup(e.to_string()))?;
        let at = listeners(config, host, node.rank());
        let channel = crate::channel::open_configured(config, &at, node.as_str(), &pools, secret)?;
        let ctx = zmq::Context::new();
        let counters = std::sync::Arc::new(counters::MessageCounters::default());
        let c2 = std::sync::Arc::clone(&counters);
        let pushes = zmq_io::PushPool::spawn(&ctx, push_thread, move |_| {
            c2.bump(counters::MessageKind::Timeout);
        })?;
        Ok(Opened {
            alloc,
            pools,
            channel,
            ctx,
            counters,
            pushes,
        })
    }
}

/// Where TP rank `rank`'s channel listeners bind (`pd_bind_host`) and
/// which host peers are told (`advertise`, the worker's `pd_peer_host`),
/// on the ports the config fixes (0: free).
pub(crate) fn listeners(
    config: &crate::config::PdConfig,
    advertise: &str,
    rank: usize,
) -> crate::channel::Listeners {
    let at = |port: u16| crate::channel::ListenAt {
        bind: config
            .bind_host
            .clone()
            .unwrap_or_else(|| advertise.to_string()),
        advertise: advertise.to_string(),
        port,
    };
    crate::channel::Listeners {
        data: at(config.data_port(rank)),
        liveness: at(config.liveness_port(rank)),
        hixl_port: config.hixl_port(rank),
    }
}

/// The ZMQ URL a listener of `config` binds on `port`.
pub(crate) fn bind_url(config: &crate::config::PdConfig, advertise: &str, port: u16) -> String {
    let host = config.bind_host.as_deref().unwrap_or(advertise);
    if host.contains(':') && !host.starts_with('[') {
        format!("tcp://[{host}]:{port}")
    } else {
        format!("tcp://{host}:{port}")
    }
}

impl BackendError {
    fn zmq(context: impl Into<String>) -> impl FnOnce(zmq::Error) -> BackendError {
        let context = context.into();
        move |source| BackendError::Zmq { context, source }
    }
}

/// Refuses a config for the wrong role, or one that does not validate
/// (every problem, each naming its key and fix).
pub(crate) fn check_config(
    config: &crate::config::PdConfig,
    role: crate::config::Role,
) -> Result<(), BackendError> {
    if config.role != role {
        return Err(BackendError::Setup(format!(
            "pd_role: this is a {} config, but a {} was started with it",
            config.role.name(),
            role.name()
        )));
    }
    config.validate().map(|_| ()).map_err(|problems| {
        BackendError::Setup(
            problems
                .iter()
                .map(|p| p.to_string())
                .collect::<Vec<_>>()
                .join("; "),
        )
    })
}

/// Locks `m`, carrying on after a panic elsewhere poisoned it (every
/// critical section here leaves its data consistent).
pub(crate) fn lock<T>(m: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|p| p.into_inner())
}

/// Waits on `cv` with `guard` until notified, at most until `deadline`
/// (`None`: no deadline) and, when `recheck` is set, at most that long (for
/// a loop that also polls). `None` once the deadline has passed: the
/// caller's last check was its answer.
pub(crate) fn wait_until<'a, T>(
    cv: &std::sync::Condvar,
    guard: std::sync::MutexGuard<'a, T>,
    deadline: Option<std::time::Instant>,
    recheck: Option<std::time::Duration>,
) -> Option<std::sync::MutexGuard<'a, T>> {
    let now = std::time::Instant::now();
    let left = match deadline {
        Some(d) if now >= d => return None,
        Some(d) => d - now,
        None => std::time::Duration::MAX,
    };
    let left = recheck.map_or(left, |r| left.min(r));
    Some(
        cv.wait_timeout(guard, left)
            .unwrap_or_else(|p| p.into_inner())
            .0,
    )
}

/// The message of a caught panic.
pub(crate) fn panic_text(p: &(dyn std::any::Any + Send)) -> String {
    p.downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| p.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "a panic without a message".into())
}

/// Starts a named backend thread.
pub(crate) fn spawn(
    name: &str,
    f: impl FnOnce() + Send + 'static,
) -> Result<std::thread::JoinHandle<()>, BackendError> {
    std::thread::Builder::new()
        .name(name.into())
        .spawn(f)
        .map_err(|e| BackendError::Setup(format!("spawning {name}: {e}")))
}

#[cfg(test)]
mod node_id_tests {
    use super::NodeId;
    use crate::config::MAX_HOST_BYTES;

    /// The longest host config allows still gives routes ZMQ accepts as
    /// routing ids (1 to 255 bytes): the node id plus `#<u64 epoch>`.
    #[test]
    fn the_longest_allowed_host_fits_a_zmq_routing_id() {
        let host = "h".repeat(MAX_HOST_BYTES);
        let node = NodeId::sender(&host, Some(u16::MAX), 99_999);
        let route = format!("{}#{}", node.as_str(), u64::MAX);
        // This process's pid may be shorter than the longest (u32::MAX).
        let pid_slack = u32::MAX.to_string().len() - std::process::id().to_string().len();
        assert!(
            route.len() + pid_slack <= 255,
            "{} bytes: {route}",
            route.len()
        );
        // Two starts of one process are two nodes.
        assert_ne!(NodeId::sender("h", None, 0), NodeId::sender("h", None, 0));
    }
}
