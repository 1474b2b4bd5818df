//! The one error type of this crate.

use std::fmt;
use std::path::PathBuf;
use std::time::Duration;

/// Result alias used throughout ascend-sys.
pub type Result<T, E = Error> = std::result::Result<T, E>;

/// One place the loader looked for a library, and what happened there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadAttempt {
    /// The path (or bare library name, for the system loader) that was tried.
    pub path: PathBuf,
    /// Why it was not used.
    pub outcome: String,
}

impl fmt::Display for LoadAttempt {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}: {}", self.path.display(), self.outcome)
    }
}

fn list(attempts: &[LoadAttempt]) -> String {
    attempts
        .iter()
        .map(|a| format!("\n  - {a}"))
        .collect::<String>()
}

impl Error {
    /// The `HixlStatus` of a failed HIXL call, `None` for other errors.
    /// `HIXL_FAILED` and `HIXL_TIMEOUT` from a batch call leave a HIXL
    /// client unusable (recreate it); `HIXL_PARAM_INVALID` does not.
    pub fn hixl_status(&self) -> Option<u32> {
        match self {
            Error::Hixl { code, .. } => Some(*code),
            _ => None,
        }
    }
}

/// Everything that can go wrong in ascend-sys.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum Error {
    /// An ACL runtime call returned a failure status.
    #[error("{call} failed with ACL error {code}: {message}")]
    Acl {
        /// The C function that failed.
        call: &'static str,
        /// Its `aclError` status.
        code: i32,
        /// The runtime's own text (`aclGetRecentErrMsg`), or a note that it gave none.
        message: String,
    },
    /// An HCCL call returned a failure status.
    #[error("{call} failed with HCCL error {code} ({description}): {message}")]
    Hccl {
        /// The C function that failed.
        call: &'static str,
        /// Its `HcclResult` status.
        code: u32,
        /// `HcclGetErrorString` for the status.
        description: String,
        /// Detail from `aclGetRecentErrMsg`, or a note that there was none.
        message: String,
    },
    /// A HIXL call (`libcann_hixl.so`) returned a failure status.
    #[error("{call} failed with HIXL status {code} ({name}): {message}")]
    Hixl {
        /// The C function that failed.
        call: &'static str,
        /// Its `HixlStatus`.
        code: u32,
        /// The status's name (`HIXL_PARAM_INVALID`, ...; see
        /// [`crate::result::hixl_status_name`]), or "unknown HixlStatus".
        name: &'static str,
        /// Detail from `aclGetRecentErrMsg`, or a note that there was none
        /// (HIXL itself has no error-text function; it logs).
        message: String,
    },
    /// A CANN library could not be found or opened.
    #[error(
        "cannot load {library}; tried:{}\nfix: set ASCEND_PD_CANN_LIB_DIR to the directory that holds \
         libascendcl.so and libhccl.so (usually <CANN install>/lib64), or source the CANN set_env.sh \
         so that ASCEND_HOME_PATH is set",
        list(.attempts)
    )]
    LibraryNotFound {
        /// File name of the library (`libascendcl.so` or `libhccl.so`).
        library: &'static str,
        /// Every location tried, in order.
        attempts: Vec<LoadAttempt>,
    },
    /// A library was opened but lacks a symbol ascend-pd cannot work without.
    #[error("{} lacks required symbol {symbol}; is this a CANN library of a supported version?", .path.display())]
    MissingSymbol {
        /// The library file.
        path: PathBuf,
        /// The missing C function.
        symbol: &'static str,
    },
    /// The loaded CANN does not provide this (optional) function, e.g. an
    /// older release without the HCCL one-sided API.
    #[error("{0} is not provided by the loaded CANN libraries (unsupported by this CANN version)")]
    Unsupported(&'static str),
    /// The runtime is already loaded in this process from another place.
    #[error("CANN is already loaded in this process from {}; cannot also load it from {}", .loaded.display(), .requested.display())]
    AlreadyLoaded {
        /// Where the loaded libraries came from.
        loaded: PathBuf,
        /// The conflicting request.
        requested: PathBuf,
    },
    /// `ASCEND_PD_CANN_LIB_DIR=emulator` was asked for, but the emulator
    /// library is not built or not found.
    #[error(
        "the CANN emulator ({}) was asked for (ASCEND_PD_CANN_LIB_DIR=emulator or --emulator) but not found; tried:{}\nfix: build it with `cargo build --release -p ascend-emu` (or plain `cargo build --release` in the workspace), or set ASCEND_EMU_LIB to the file",
        crate::emulator::LIBRARY_FILE,
        list(.attempts)
    )]
    EmulatorNotFound {
        /// Every place looked at.
        attempts: Vec<LoadAttempt>,
    },
    /// A limit of the runtime would be crossed; refused before calling it.
    #[error("{what}: {asked} exceeds the limit of {limit} ({why})")]
    Limit {
        /// What was asked for.
        what: &'static str,
        /// How many.
        asked: usize,
        /// The most the runtime accepts.
        limit: usize,
        /// Where the limit comes from and what to do.
        why: String,
    },
    /// A one-sided batch was split into several runtime calls to respect the
    /// per-call op limit, and a later call failed after earlier ones were
    /// queued. Reported by the batch's completion, once the queued part has
    /// finished, so no memory is released while it may still be in use.
    #[error("{call} queued {queued} of {total} op(s), then failed: {cause}")]
    BatchPartlyQueued {
        /// `HcclBatchPut` or `HcclBatchGet`.
        call: &'static str,
        /// Ops queued before the failure.
        queued: usize,
        /// Ops in the batch.
        total: usize,
        /// The failing call's error, as text.
        cause: String,
    },
    /// A batch was queued but could not be tracked, and the stream could
    /// not be waited for: its memory may still be read or written by the
    /// device. The caller must never reuse that memory.
    #[error("{call} was queued but cannot be tracked ({cause}); its memory may still be in use")]
    BatchInFlight {
        /// `HcclBatchPut` or `HcclBatchGet`.
        call: &'static str,
        /// What failed.
        cause: String,
    },
    /// An argument was rejected before any library call was made.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// A wait did not finish in time.
    #[error("{what} did not complete within {timeout:?}")]
    Timeout {
        /// What was being waited for.
        what: &'static str,
        /// How long was waited.
        timeout: Duration,
    },
}
