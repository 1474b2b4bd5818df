//! Status codes the emulator returns and the per-thread "recent error" text
//! behind `aclGetRecentErrMsg`.
//!
//! Values are the ones CANN publishes (see ascend-sys/cann-headers). HCCL failures
//! also leave their text here, as CANN's shared error manager does.

use std::cell::RefCell;
use std::ffi::{c_char, CString};
use std::fmt;

pub(crate) const ACL_SUCCESS: i32 = 0;
pub(crate) const ACL_ERROR_INVALID_PARAM: i32 = 100_000;
pub(crate) const ACL_ERROR_UNINITIALIZE: i32 = 100_001;
pub(crate) const ACL_ERROR_REPEAT_INITIALIZE: i32 = 100_002;
pub(crate) const ACL_ERROR_INVALID_FILE: i32 = 100_003;
pub(crate) const ACL_ERROR_REPEAT_FINALIZE: i32 = 100_037;
pub(crate) const ACL_ERROR_RT_PARAM_INVALID: i32 = 107_000;
pub(crate) const ACL_ERROR_RT_INVALID_DEVICEID: i32 = 107_001;
pub(crate) const ACL_ERROR_RT_CONTEXT_NULL: i32 = 107_002;
pub(crate) const ACL_ERROR_RT_STREAM_CONTEXT: i32 = 107_003;
pub(crate) const ACL_ERROR_RT_INVALID_HANDLE: i32 = 107_017;
pub(crate) const ACL_ERROR_RT_MEMORY_ALLOCATION: i32 = 207_001;
pub(crate) const ACL_ERROR_RT_INTERNAL_ERROR: i32 = 507_000;

pub(crate) const HCCL_SUCCESS: u32 = 0;
pub(crate) const HCCL_E_PARA: u32 = 1;
pub(crate) const HCCL_E_PTR: u32 = 2;
pub(crate) const HCCL_E_INTERNAL: u32 = 4;
pub(crate) const HCCL_E_NOT_SUPPORT: u32 = 5;
pub(crate) const HCCL_E_NOT_FOUND: u32 = 6;
pub(crate) const HCCL_E_UNAVAIL: u32 = 7;
pub(crate) const HCCL_E_SYSCALL: u32 = 8;
pub(crate) const HCCL_E_TIMEOUT: u32 = 9;
pub(crate) const HCCL_E_TCP_CONNECT: u32 = 11;
pub(crate) const HCCL_E_TCP_TRANSFER: u32 = 13;
pub(crate) const HCCL_E_RUNTIME: u32 = 15;

pub(crate) const HIXL_SUCCESS: u32 = 0;
pub(crate) const HIXL_PARAM_INVALID: u32 = 103_900;
pub(crate) const HIXL_TIMEOUT: u32 = 103_901;
pub(crate) const HIXL_FAILED: u32 = 503_900;
pub(crate) const HIXL_RESOURCE_EXHAUSTED: u32 = 203_900;

/// A failed call: the status code to return and the text for the user.
#[derive(Debug, Clone, PartialEq, Eq)]
pub(crate) struct Failure {
    pub code: i64,
    pub message: String,
}

impl Failure {
    /// An ACL runtime failure.
    pub(crate) fn acl(code: i32, message: impl Into<String>) -> Self {
        Failure {
            code: i64::from(code),
            message: message.into(),
        }
    }

    /// An HCCL failure.
    pub(crate) fn hccl(code: u32, message: impl Into<String>) -> Self {
        Failure {
            code: i64::from(code),
            message: message.into(),
        }
    }
}

impl Failure {
    /// A HIXL failure.
    pub(crate) fn hixl(code: u32, message: impl Into<String>) -> Self {
        Failure {
            code: i64::from(code),
            message: message.into(),
        }
    }
}

impl fmt::Display for Failure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{} (code {})", self.message, self.code)
    }
}

thread_local! {
    /// Text of the latest failure on this thread, not yet handed out.
    static PENDING: RefCell<Option<CString>> = const { RefCell::new(None) };
    /// Text last handed out; kept so the returned pointer stays valid until
    /// the next `aclGetRecentErrMsg` call on this thread.
    static HANDED_OUT: RefCell<Option<CString>> = const { RefCell::new(None) };
}

fn remember(call: &str, failure: &Failure) {
    let text = format!("[ascend-emu] {call}: {}", failure.message).replace('\0', " ");
    let text = CString::new(text).unwrap_or_default();
    PENDING.with(|p| *p.borrow_mut() = Some(text));
}

/// Converts an ACL outcome into the status code, remembering the failure text.
pub(crate) fn acl_status(call: &str, outcome: Result<(), Failure>) -> i32 {
    match outcome {
        Ok(()) => ACL_SUCCESS,
        Err(f) => {
            remember(call, &f);
            i32::try_from(f.code).unwrap_or(ACL_ERROR_RT_INTERNAL_ERROR)
        }
    }
}

/// Converts an HCCL outcome into the status code, remembering the failure text.
pub(crate) fn hccl_status(call: &str, outcome: Result<(), Failure>) -> u32 {
    match outcome {
        Ok(()) => HCCL_SUCCESS,
        Err(f) => {
            remember(call, &f);
            u32::try_from(f.code).unwrap_or(HCCL_E_INTERNAL)
        }
    }
}

/// Converts a HIXL outcome into the status code, remembering the failure text.
pub(crate) fn hixl_status(call: &str, outcome: Result<(), Failure>) -> u32 {
    match outcome {
        Ok(()) => HIXL_SUCCESS,
        Err(f) => {
            remember(call, &f);
            u32::try_from(f.code).unwrap_or(HIXL_FAILED)
        }
    }
}

/// Hands out the pending failure text (NULL when there is none) and clears
/// it, so a later failure never shows an older message.
pub(crate) fn take_recent() -> *const c_char {
    let pending = PENDING.with(|p| p.borrow_mut().take());
    HANDED_OUT.with(|h| {
        let mut h = h.borrow_mut();
        *h = pending;
        h.as_ref().map_or(std::ptr::null(), |s| s.as_ptr())
    })
}

/// Text for `HcclGetErrorString`.
pub(crate) fn hccl_error_text(code: u32) -> &'static std::ffi::CStr {
    match code {
        0 => c"no error",
        1 => c"parameter error",
        2 => c"empty pointer",
        3 => c"memory error",
        4 => c"internal error",
        5 => c"not supported feature",
        6 => c"specific resource not found",
        7 => c"resource unavailable",
        8 => c"call system interface error",
        9 => c"timeout",
        10 => c"open file fail",
        11 => c"tcp connect fail",
        12 => c"roce connect fail",
        13 => c"tcp transfer fail",
        14 => c"roce transfer fail",
        15 => c"call runtime api fail",
        16 => c"call driver api fail",
        17 => c"call profiling api fail",
        18 => c"call cce api fail",
        19 => c"call network api fail",
        20 => c"try again",
        21 => c"error cqe",
        22 => c"communicator suspending",
        _ => c"unknown error",
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::ffi::CStr;

    #[test]
    fn recent_text_is_handed_out_once() {
        let code = acl_status(
            "aclrtFree",
            Err(Failure::acl(
                ACL_ERROR_RT_PARAM_INVALID,
                "not an allocation",
            )),
        );
        assert_eq!(code, ACL_ERROR_RT_PARAM_INVALID);
        let p = take_recent();
        assert!(!p.is_null());
        // SAFETY: take_recent returns a NUL-terminated string kept alive in
        // this thread's HANDED_OUT slot until the next call.
        let text = unsafe { CStr::from_ptr(p) }.to_str().unwrap().to_owned();
        assert_eq!(text, "[ascend-emu] aclrtFree: not an allocation");
        assert!(take_recent().is_null());
    }

    #[test]
    fn success_leaves_no_text() {
        assert_eq!(hccl_status("HcclCommDestroy", Ok(())), HCCL_SUCCESS);
        assert!(take_recent().is_null());
        assert_eq!(hccl_error_text(9).to_str().unwrap(), "timeout");
    }
}
