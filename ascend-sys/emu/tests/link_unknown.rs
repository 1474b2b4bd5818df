//! An `ASCEND_PD_EMU_LINK` that names no modeled link is refused, with the
//! known values named, by the stats call, `HcclBatchPut` and HIXL's batch
//! calls (its own test binary: the emulator reads the variable once per
//! process).

use std::ffi::{c_char, c_int, c_void, CStr};

use ascend_emu::link::LINK_ENV;

const ACL_ERROR_INVALID_PARAM: c_int = 100_000;
const HCCL_E_PARA: u32 = 1;

type StatsFn = unsafe extern "C" fn(*mut [u8; 88], c_int) -> c_int;
type RecentFn = unsafe extern "C" fn() -> *const c_char;
type PutFn = unsafe extern "C" fn(*mut c_void, u32, *mut c_void, u32, *mut c_void) -> u32;
type HixlAsyncFn = unsafe extern "C" fn(*mut c_void, u32, *const [u64; 3], *mut *mut c_void) -> u32;
type HixlSyncFn = unsafe extern "C" fn(*mut c_void, u32, *const [u64; 3], u32) -> u32;
const HIXL_PARAM_INVALID: u32 = 103_900;

fn recent(lib: &libloading::Library) -> String {
    // SAFETY: the emulator exports aclGetRecentErrMsg with this signature.
    let f: libloading::Symbol<RecentFn> = unsafe { lib.get(b"aclGetRecentErrMsg\0") }.unwrap();
    // SAFETY: no arguments; returns NULL or a NUL-terminated string that
    // stays valid until this thread's next call.
    let p = unsafe { f() };
    assert!(!p.is_null(), "a failure leaves a message");
    // SAFETY: non-null and NUL-terminated (see above).
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

fn names_every_link(text: &str) {
    assert!(
        text.contains("a2-nvlink") && text.contains(LINK_ENV),
        "{text}"
    );
    for name in ["a2-roce", "a2-hccs", "a3-hccs", "a3-roce"] {
        assert!(text.contains(name), "{text}");
    }
}

#[test]
fn an_unknown_link_is_refused_naming_the_known_ones() {
    std::env::set_var(LINK_ENV, "a2-nvlink");
    let path = ascend_emu::library_path().unwrap();
    // SAFETY: the emulator library has no initialisers that need more than
    // a normal dlopen; it stays loaded for the whole test.
    let lib = unsafe { libloading::Library::new(&path) }.unwrap();

    // SAFETY: exported with this signature (the struct is 88 bytes; the
    // buffer is never read because the call fails).
    let stats: libloading::Symbol<StatsFn> =
        unsafe { lib.get(b"ascend_emu_link_stats\0") }.unwrap();
    let mut out = [0u8; 88];
    // SAFETY: out is a writable buffer the size of AscendEmuLinkStats.
    assert_eq!(unsafe { stats(&mut out, 0) }, ACL_ERROR_INVALID_PARAM);
    names_every_link(&recent(&lib));

    // SAFETY: exported with HcclBatchPut's signature; no ops, so no pointer
    // is read, and the link is checked before anything else.
    let put: libloading::Symbol<PutFn> = unsafe { lib.get(b"HcclBatchPut\0") }.unwrap();
    let null = std::ptr::null_mut();
    // SAFETY: as above.
    assert_eq!(unsafe { put(null, 1, null, 0, null) }, HCCL_E_PARA);
    names_every_link(&recent(&lib));

    // HIXL: one op (remote, local, len), no client; the link is checked
    // before the client, so the refusal names the links.
    let op = [0x1000u64, 0x2000, 16];
    let mut handle = std::ptr::null_mut();
    for name in [
        &b"HixlCSClientBatchPutAsync\0"[..],
        &b"HixlCSClientBatchGetAsync\0"[..],
    ] {
        // SAFETY: exported with HixlAsyncFn's signature (HixlOneSideOpDesc
        // is three 64-bit words).
        let f: libloading::Symbol<HixlAsyncFn> = unsafe { lib.get(name) }.unwrap();
        // SAFETY: op is one valid descriptor; handle a valid out-parameter.
        assert_eq!(unsafe { f(null, 1, &op, &mut handle) }, HIXL_PARAM_INVALID);
        names_every_link(&recent(&lib));
    }
    for name in [
        &b"HixlCSClientBatchPutSync\0"[..],
        &b"HixlCSClientBatchGetSync\0"[..],
    ] {
        // SAFETY: exported with HixlSyncFn's signature.
        let f: libloading::Symbol<HixlSyncFn> = unsafe { lib.get(name) }.unwrap();
        // SAFETY: op is one valid descriptor.
        assert_eq!(unsafe { f(null, 1, &op, 1000) }, HIXL_PARAM_INVALID);
        names_every_link(&recent(&lib));
    }
}
