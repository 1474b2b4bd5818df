//! The I/O shell around the sans-IO protocol core: ZMQ sockets, threads and
//! the transfer channel.
//!
//! - [`Sender`] (prefill): `put(keys, chunks, spec)` in push, pull-eager or
//!   pull-delay mode, a PULL socket for PullDoneSignal, a TTL sweeper, the
//!   circuit breaker and backpressure.
//! - [`Receiver`] (decode): the handshake and allocation REP sockets, the
//!   key store, eager reads, pull-delay proxies and a plain fetch path, a
//!   PUSH pool for PullDoneSignal, and a sweeper.
//!
//! Every socket wait is bounded; one slow or dead peer holds only its own
//! lock, never the others'. Bookkeeping decisions are made by
//! [`crate::protocol`]; this module only moves frames and bytes.

mod counters;
pub mod pools;
mod receiver;
mod sender;
mod zmq_io;

pub use counters::{MessageCounters, MessageKind};
pub use receiver::{FetchError, Receiver, ReceiverStats};
pub use sender::{PutOutcome, Sender, SenderStats, SenderTimeouts, TransferSpec};

use crate::channel::ChannelError;
use crate::config::ConfigError;
use crate::memory::MemoryError;
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
    #[error("invalid put: {0}")]
    InvalidInput(String),
    /// Pull backpressure did not clear in time, or the batch can never fit.
    #[error("backpressure: {0}")]
    Backpressure(String),
    /// The backend is shutting down.
    #[error("the backend is closed")]
    Closed,
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
