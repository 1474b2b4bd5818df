//! Status codes to `Result`s, with the library's own text and the call that
//! failed, plus thin checked wrappers over the raw calls (the cudarc
//! "result" layer). Everything above this module works with `Result`s only.

use std::ffi::{c_char, CStr};

use crate::error::{Error, Result};
use crate::loader::CannLibraries;
use crate::sys;

/// Name of a known ACL status code.
pub fn acl_error_name(code: i32) -> Option<&'static str> {
    Some(match code {
        sys::ACL_SUCCESS => "ACL_SUCCESS",
        sys::ACL_ERROR_INVALID_PARAM => "ACL_ERROR_INVALID_PARAM",
        sys::ACL_ERROR_UNINITIALIZE => "ACL_ERROR_UNINITIALIZE",
        sys::ACL_ERROR_REPEAT_INITIALIZE => "ACL_ERROR_REPEAT_INITIALIZE",
        sys::ACL_ERROR_INVALID_FILE => "ACL_ERROR_INVALID_FILE",
        sys::ACL_ERROR_REPEAT_FINALIZE => "ACL_ERROR_REPEAT_FINALIZE",
        sys::ACL_ERROR_BAD_ALLOC => "ACL_ERROR_BAD_ALLOC",
        sys::ACL_ERROR_RT_PARAM_INVALID => "ACL_ERROR_RT_PARAM_INVALID",
        sys::ACL_ERROR_RT_INVALID_DEVICEID => "ACL_ERROR_RT_INVALID_DEVICEID",
        sys::ACL_ERROR_RT_CONTEXT_NULL => "ACL_ERROR_RT_CONTEXT_NULL",
        sys::ACL_ERROR_RT_STREAM_CONTEXT => "ACL_ERROR_RT_STREAM_CONTEXT",
        sys::ACL_ERROR_RT_INVALID_HANDLE => "ACL_ERROR_RT_INVALID_HANDLE",
        sys::ACL_ERROR_RT_FEATURE_NOT_SUPPORT => "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
        sys::ACL_ERROR_RT_MEMORY_ALLOCATION => "ACL_ERROR_RT_MEMORY_ALLOCATION",
        sys::ACL_ERROR_RT_MEMORY_FREE => "ACL_ERROR_RT_MEMORY_FREE",
        sys::ACL_ERROR_RT_INTERNAL_ERROR => "ACL_ERROR_RT_INTERNAL_ERROR",
        sys::ACL_ERROR_RT_STREAM_SYNC_TIMEOUT => "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT",
        sys::ACL_ERROR_RT_EVENT_SYNC_TIMEOUT => "ACL_ERROR_RT_EVENT_SYNC_TIMEOUT",
        _ => return None,
    })
}

/// Name of an HCCL status code: every `HcclResult` of CANN 8.5, including
/// `HCCL_E_RESERVED` (1042, the end marker).
pub fn hccl_error_name(code: u32) -> Option<&'static str> {
    Some(match code {
        sys::HCCL_SUCCESS => "HCCL_SUCCESS",
        sys::HCCL_E_PARA => "HCCL_E_PARA",
        sys::HCCL_E_PTR => "HCCL_E_PTR",
        sys::HCCL_E_MEMORY => "HCCL_E_MEMORY",
        sys::HCCL_E_INTERNAL => "HCCL_E_INTERNAL",
        sys::HCCL_E_NOT_SUPPORT => "HCCL_E_NOT_SUPPORT",
        sys::HCCL_E_NOT_FOUND => "HCCL_E_NOT_FOUND",
        sys::HCCL_E_UNAVAIL => "HCCL_E_UNAVAIL",
        sys::HCCL_E_SYSCALL => "HCCL_E_SYSCALL",
        sys::HCCL_E_TIMEOUT => "HCCL_E_TIMEOUT",
        sys::HCCL_E_OPEN_FILE_FAILURE => "HCCL_E_OPEN_FILE_FAILURE",
        sys::HCCL_E_TCP_CONNECT => "HCCL_E_TCP_CONNECT",
        sys::HCCL_E_ROCE_CONNECT => "HCCL_E_ROCE_CONNECT",
        sys::HCCL_E_TCP_TRANSFER => "HCCL_E_TCP_TRANSFER",
        sys::HCCL_E_ROCE_TRANSFER => "HCCL_E_ROCE_TRANSFER",
        sys::HCCL_E_RUNTIME => "HCCL_E_RUNTIME",
        sys::HCCL_E_DRV => "HCCL_E_DRV",
        sys::HCCL_E_PROFILING => "HCCL_E_PROFILING",
        sys::HCCL_E_CCE => "HCCL_E_CCE",
        sys::HCCL_E_NETWORK => "HCCL_E_NETWORK",
        sys::HCCL_E_AGAIN => "HCCL_E_AGAIN",
        sys::HCCL_E_REMOTE => "HCCL_E_REMOTE",
        sys::HCCL_E_SUSPENDING => "HCCL_E_SUSPENDING",
        sys::HCCL_E_OPRETRY_FAIL => "HCCL_E_OPRETRY_FAIL",
        sys::HCCL_E_OOM => "HCCL_E_OOM",
        sys::HCCL_E_IN_STATUS => "HCCL_E_IN_STATUS",
        sys::HCCL_E_RESERVED => "HCCL_E_RESERVED",
        _ => return None,
    })
}

/// HIXL's status codes beyond the four of its C header: the internal
/// `hixl::Status` values of hicann/hixl v9.1.0 (`include/hixl/hixl_types.h`)
/// that its C functions can return as they are.
pub const HIXL_NOT_CONNECTED: u32 = 103_902;
/// See [`HIXL_NOT_CONNECTED`].
pub const HIXL_ALREADY_CONNECTED: u32 = 103_903;
/// See [`HIXL_NOT_CONNECTED`].
pub const HIXL_NOTIFY_FAILED: u32 = 103_904;
/// See [`HIXL_NOT_CONNECTED`].
pub const HIXL_UNSUPPORTED: u32 = 103_905;
/// See [`HIXL_NOT_CONNECTED`]; what a host-endpoint client answers when too
/// many transfers have not been queried completed.
pub const HIXL_RESOURCE_EXHAUSTED: u32 = 203_900;

/// Name of a HIXL status: the four codes of HIXL's C header and the
/// further `hixl::Status` codes it can pass through. HIXL may also pass a
/// raw ACL or HCCL code through from the layer below, which has no HIXL
/// name (`None`).
pub fn hixl_status_name(code: u32) -> Option<&'static str> {
    Some(match code {
        sys::HIXL_SUCCESS => "HIXL_SUCCESS",
        sys::HIXL_PARAM_INVALID => "HIXL_PARAM_INVALID",
        sys::HIXL_TIMEOUT => "HIXL_TIMEOUT",
        sys::HIXL_FAILED => "HIXL_FAILED",
        HIXL_NOT_CONNECTED => "HIXL_NOT_CONNECTED",
        HIXL_ALREADY_CONNECTED => "HIXL_ALREADY_CONNECTED",
        HIXL_NOTIFY_FAILED => "HIXL_NOTIFY_FAILED",
        HIXL_UNSUPPORTED => "HIXL_UNSUPPORTED",
        HIXL_RESOURCE_EXHAUSTED => "HIXL_RESOURCE_EXHAUSTED",
        _ => return None,
    })
}

const NO_MESSAGE: &str = "(the library gave no further message)";

/// Turns an ACL status into a `Result`; `recent` supplies the runtime's text.
pub(crate) fn acl_result(
    call: &'static str,
    code: sys::aclError,
    recent: impl FnOnce() -> Option<String>,
) -> Result<()> {
    if code == sys::ACL_SUCCESS {
        return Ok(());
    }
    let text = recent().filter(|t| !t.trim().is_empty());
    let message = match (acl_error_name(code), text) {
        (Some(name), Some(t)) => format!("{name}: {t}"),
        (Some(name), None) => format!("{name} {NO_MESSAGE}"),
        (None, Some(t)) => t,
        (None, None) => NO_MESSAGE.to_string(),
    };
    Err(Error::Acl {
        call,
        code,
        message,
    })
}

/// Turns an HCCL status into a `Result`; `describe` is `HcclGetErrorString`,
/// `recent` the runtime's latest text.
pub(crate) fn hccl_result(
    call: &'static str,
    code: sys::HcclResult,
    describe: impl FnOnce(sys::HcclResult) -> Option<String>,
    recent: impl FnOnce() -> Option<String>,
) -> Result<()> {
    if code == sys::HCCL_SUCCESS {
        return Ok(());
    }
    let name = hccl_error_name(code).unwrap_or("unknown HcclResult");
    let description = match describe(code) {
        Some(d) if !d.is_empty() => format!("{name}, {d}"),
        _ => name.to_string(),
    };
    Err(Error::Hccl {
        call,
        code,
        description,
        message: recent()
            .filter(|t| !t.trim().is_empty())
            .unwrap_or_else(|| NO_MESSAGE.to_string()),
    })
}

/// Turns a HIXL status into a `Result`; `recent` supplies the latest text.
pub(crate) fn hixl_result(
    call: &'static str,
    code: sys::HixlStatus,
    recent: impl FnOnce() -> Option<String>,
) -> Result<()> {
    if code == sys::HIXL_SUCCESS {
        return Ok(());
    }
    Err(Error::Hixl {
        call,
        code,
        name: hixl_status_name(code).unwrap_or("unknown HixlStatus"),
        message: recent()
            .filter(|t| !t.trim().is_empty())
            .unwrap_or_else(|| NO_MESSAGE.to_string()),
    })
}

/// Copies a C string returned by a library call.
///
/// # Safety
/// `p` is NULL or points to a NUL-terminated string valid for this call.
unsafe fn owned(p: *const c_char) -> Option<String> {
    if p.is_null() {
        return None;
    }
    // SAFETY: non-null and NUL-terminated per this function's contract.
    Some(unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned())
}

/// Reads a function pointer out of the generated table.
pub(crate) fn func<T: Copy>(
    entry: &std::result::Result<T, libloading::Error>,
    name: &'static str,
) -> Result<T> {
    entry
        .as_ref()
        .map(|f| *f)
        .map_err(|_| Error::Unsupported(name))
}

impl CannLibraries {
    /// `aclGetRecentErrMsg` for the calling thread.
    pub(crate) fn recent_error(&self) -> Option<String> {
        let f = func(&self.acl().aclGetRecentErrMsg, "aclGetRecentErrMsg").ok()?;
        // SAFETY: aclGetRecentErrMsg takes no arguments and returns NULL or a
        // string valid until the next call on this thread.
        unsafe { owned(f()) }
    }

    /// Checks an ACL status.
    pub(crate) fn acl_check(&self, call: &'static str, code: sys::aclError) -> Result<()> {
        acl_result(call, code, || self.recent_error())
    }

    /// Checks an HCCL status.
    pub(crate) fn hccl_check(&self, call: &'static str, code: sys::HcclResult) -> Result<()> {
        let describe = |c| {
            let lib = self.hccl_lib().ok()?;
            let f = func(&lib.HcclGetErrorString, "HcclGetErrorString").ok()?;
            // SAFETY: HcclGetErrorString returns NULL or a static string.
            unsafe { owned(f(c)) }
        };
        hccl_result(call, code, describe, || self.recent_error())
    }
}

/// Calls an ACL function from the table and checks its status:
/// `acl_call!(libs, aclrtSetDevice(id))`. Must be used inside `unsafe`.
macro_rules! acl_call {
    ($libs:expr, $name:ident ( $($arg:expr),* $(,)? )) => {{
        let libs: &$crate::loader::CannLibraries = $libs;
        match $crate::result::func(&libs.acl().$name, stringify!($name)) {
            Ok(f) => libs.acl_check(stringify!($name), f($($arg),*)),
            Err(e) => Err(e),
        }
    }};
}

/// Calls an HCCL function from the table and checks its status; an absent
/// library or symbol is an error, never a panic.
macro_rules! hccl_call {
    ($libs:expr, $name:ident ( $($arg:expr),* $(,)? )) => {{
        let libs: &$crate::loader::CannLibraries = $libs;
        match libs
            .hccl_lib()
            .and_then(|h| $crate::result::func(&h.$name, stringify!($name)))
        {
            Ok(f) => libs.hccl_check(stringify!($name), f($($arg),*)),
            Err(e) => Err(e),
        }
    }};
}

/// As [`hccl_call`], for the one-sided functions: called through the
/// library that serves them (libhccl.so, or libhcomm.so on CANN 8.5+).
macro_rules! hccl_one_sided_call {
    ($libs:expr, $name:ident ( $($arg:expr),* $(,)? )) => {{
        let libs: &$crate::loader::CannLibraries = $libs;
        match libs
            .one_sided_lib()
            .and_then(|h| $crate::result::func(&h.$name, stringify!($name)))
        {
            Ok(f) => libs.hccl_check(stringify!($name), f($($arg),*)),
            Err(e) => Err(e),
        }
    }};
}

pub(crate) use {acl_call, hccl_call, hccl_one_sided_call};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn success_is_ok_and_never_asks_for_text() {
        assert!(acl_result("aclInit", 0, || panic!("not needed")).is_ok());
        assert!(hccl_result("HcclBatchPut", 0, |_| panic!(), || panic!()).is_ok());
    }

    #[test]
    fn acl_failure_carries_call_code_name_and_text() {
        let err = acl_result("aclrtMemcpy", 107_000, || {
            Some("count 64 exceeds destMax 32".into())
        })
        .unwrap_err();
        match &err {
            Error::Acl {
                call,
                code,
                message,
            } => {
                assert_eq!(*call, "aclrtMemcpy");
                assert_eq!(*code, 107_000);
                assert_eq!(
                    message,
                    "ACL_ERROR_RT_PARAM_INVALID: count 64 exceeds destMax 32"
                );
            }
            other => panic!("unexpected {other:?}"),
        }
        assert_eq!(
            err.to_string(),
            "aclrtMemcpy failed with ACL error 107000: ACL_ERROR_RT_PARAM_INVALID: count 64 exceeds destMax 32"
        );
    }

    #[test]
    fn unknown_acl_code_without_text_still_says_what_failed() {
        let err = acl_result("aclrtFree", 999_999, || Some("  ".into())).unwrap_err();
        assert_eq!(
            err.to_string(),
            "aclrtFree failed with ACL error 999999: (the library gave no further message)"
        );
    }

    #[test]
    fn hccl_failure_uses_error_string_and_recent_text() {
        let err = hccl_result(
            "HcclBatchGet",
            1,
            |c| Some(format!("parameter error ({c})")),
            || Some("op 3: remote range outside enabled regions".into()),
        )
        .unwrap_err();
        assert_eq!(
            err.to_string(),
            "HcclBatchGet failed with HCCL error 1 (HCCL_E_PARA, parameter error (1)): \
             op 3: remote range outside enabled regions"
        );
        assert_eq!(hccl_error_name(9), Some("HCCL_E_TIMEOUT"));
        assert_eq!(hccl_error_name(23), Some("HCCL_E_OPRETRY_FAIL"));
        assert_eq!(hccl_error_name(24), Some("HCCL_E_OOM"));
        assert_eq!(hccl_error_name(1041), Some("HCCL_E_IN_STATUS"));
        assert_eq!(hccl_error_name(1042), Some("HCCL_E_RESERVED"));
        assert_eq!(hccl_error_name(25), None);
        // Every value 0..=24 of CANN 8.5 has a name; 25..1041 are unused.
        assert!((0..=24).all(|c| hccl_error_name(c).is_some()));
    }

    #[test]
    fn hixl_failure_names_status_and_keeps_text() {
        let err = hixl_result("HixlCSClientBatchGetAsync", 103_900, || {
            Some("op 2: remote range outside every region".into())
        })
        .unwrap_err();
        assert_eq!(err.hixl_status(), Some(103_900));
        assert_eq!(
            err.to_string(),
            "HixlCSClientBatchGetAsync failed with HIXL status 103900 (HIXL_PARAM_INVALID): \
             op 2: remote range outside every region"
        );
        let err = hixl_result("HixlCSClientConnect", 7, || None).unwrap_err();
        assert_eq!(
            err.to_string(),
            "HixlCSClientConnect failed with HIXL status 7 (unknown HixlStatus): \
             (the library gave no further message)"
        );
        assert!(hixl_result("HixlCSServerListen", 0, || None).is_ok());
        assert_eq!(hixl_status_name(103_901), Some("HIXL_TIMEOUT"));
        assert_eq!(hixl_status_name(503_900), Some("HIXL_FAILED"));
        assert_eq!(hixl_status_name(203_900), Some("HIXL_RESOURCE_EXHAUSTED"));
        assert_eq!(hixl_status_name(103_902), Some("HIXL_NOT_CONNECTED"));
        assert_eq!(hixl_status_name(103_903), Some("HIXL_ALREADY_CONNECTED"));
        assert_eq!(hixl_status_name(103_904), Some("HIXL_NOTIFY_FAILED"));
        assert_eq!(hixl_status_name(103_905), Some("HIXL_UNSUPPORTED"));
        assert_eq!(hixl_status_name(103_906), None);
    }

    #[test]
    fn absent_symbol_is_unsupported_not_a_panic() {
        let missing: std::result::Result<fn(), libloading::Error> =
            Err(libloading::Error::DlSymUnknown);
        let err = func(&missing, "HcclBatchPut").unwrap_err();
        assert!(matches!(err, Error::Unsupported("HcclBatchPut")));
        assert_eq!(
            err.to_string(),
            "HcclBatchPut is not provided by the loaded CANN libraries (unsupported by this CANN version)"
        );
    }
}
