//! The exported C symbols: the ACL runtime and HCCL subset declared in
//! ascend-sys/cann-headers, with CANN's signatures. Each entry point checks its
//! pointers, converts arguments and calls into `runtime` / `hccl`; none of
//! them calls another exported symbol (a host program could interpose those).

// The C contract of every function is CANN's, documented in
// ascend-sys/cann-headers; the emulator checks what it can (NULL, handles,
// address ranges) and otherwise trusts pointers exactly as CANN does.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_int, c_void, CStr};

use crate::hccl::{self, OneSidedOp, MEM_DESC_BYTES, ROOT_INFO_BYTES};
use crate::runtime;
use crate::status::*;

/// `HcclRootInfo`.
#[repr(C)]
pub struct HcclRootInfo {
    pub internal: [u8; ROOT_INFO_BYTES],
}

/// `HcclMemDesc`.
#[repr(C)]
pub struct HcclMemDesc {
    pub desc: [u8; MEM_DESC_BYTES],
}

/// `HcclMemDescs`.
#[repr(C)]
pub struct HcclMemDescs {
    pub array: *mut HcclMemDesc,
    pub array_length: u32,
}

/// `HcclMem`.
#[repr(C)]
pub struct HcclMem {
    pub mem_type: u32,
    pub addr: *mut c_void,
    pub size: u64,
}

/// `HcclOneSideOpDesc`.
#[repr(C)]
pub struct HcclOneSideOpDesc {
    pub local_addr: *mut c_void,
    pub remote_addr: *mut c_void,
    pub count: u64,
    pub data_type: u32,
}

const _: () = {
    assert!(std::mem::size_of::<HcclRootInfo>() == 4108);
    assert!(std::mem::size_of::<HcclMemDesc>() == 512);
    assert!(std::mem::size_of::<HcclMemDescs>() == 16);
    assert!(std::mem::size_of::<HcclMem>() == 24);
    assert!(std::mem::size_of::<HcclOneSideOpDesc>() == 32);
};

fn out_ptr<T>(p: *mut T, what: &str) -> Result<*mut T, Failure> {
    if p.is_null() {
        Err(Failure::acl(
            ACL_ERROR_INVALID_PARAM,
            format!("{what} is NULL"),
        ))
    } else {
        Ok(p)
    }
}

fn hccl_ptr<T>(p: *const T, what: &str) -> Result<*const T, Failure> {
    if p.is_null() {
        Err(Failure::hccl(HCCL_E_PTR, format!("{what} is NULL")))
    } else {
        Ok(p)
    }
}

// ---------------------------------------------------------------- ACL

#[no_mangle]
pub unsafe extern "C" fn aclInit(config_path: *const c_char) -> c_int {
    let config = if config_path.is_null() {
        None
    } else {
        // SAFETY: the caller passes a NUL-terminated path (CANN contract).
        Some(unsafe { CStr::from_ptr(config_path) })
    };
    acl_status("aclInit", runtime::init(config))
}

#[no_mangle]
pub extern "C" fn aclFinalize() -> c_int {
    acl_status("aclFinalize", runtime::finalize())
}

#[no_mangle]
pub extern "C" fn aclrtSetDevice(device_id: i32) -> c_int {
    acl_status("aclrtSetDevice", runtime::set_device(device_id))
}

#[no_mangle]
pub extern "C" fn aclrtResetDevice(device_id: i32) -> c_int {
    acl_status("aclrtResetDevice", runtime::reset_device(device_id))
}

#[no_mangle]
pub unsafe extern "C" fn aclrtGetDeviceCount(count: *mut u32) -> c_int {
    let r = out_ptr(count, "count").and_then(|p| {
        let n = runtime::device_count()?;
        // SAFETY: p is non-null and points to a u32 the caller owns.
        unsafe { p.write(n) };
        Ok(())
    });
    acl_status("aclrtGetDeviceCount", r)
}

#[no_mangle]
pub extern "C" fn aclrtGetSocName() -> *const c_char {
    runtime::soc_name().as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn aclrtGetMemInfo(attr: u32, free: *mut usize, total: *mut usize) -> c_int {
    let r = out_ptr(free, "free")
        .and_then(|f| Ok((f, out_ptr(total, "total")?)))
        .and_then(|(f, t)| {
            let (free_bytes, total_bytes) = runtime::mem_info(attr)?;
            // SAFETY: both are non-null and point to size_t slots the caller owns.
            unsafe {
                f.write(free_bytes);
                t.write(total_bytes);
            }
            Ok(())
        });
    acl_status("aclrtGetMemInfo", r)
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMalloc(dev_ptr: *mut *mut c_void, size: usize, policy: u32) -> c_int {
    let r = out_ptr(dev_ptr, "devPtr").and_then(|p| {
        let base = runtime::malloc(size, policy)?;
        // SAFETY: p is non-null and points to a pointer slot the caller owns.
        unsafe { p.write(base as *mut c_void) };
        Ok(())
    });
    acl_status("aclrtMalloc", r)
}

#[no_mangle]
pub extern "C" fn aclrtFree(dev_ptr: *mut c_void) -> c_int {
    acl_status("aclrtFree", runtime::free(dev_ptr as usize))
}

#[no_mangle]
pub unsafe extern "C" fn aclrtMallocHost(host_ptr: *mut *mut c_void, size: usize) -> c_int {
    let r = out_ptr(host_ptr, "hostPtr").and_then(|p| {
        let base = runtime::malloc_host(size)?;
        // SAFETY: p is non-null and points to a pointer slot the caller owns.
        unsafe { p.write(base as *mut c_void) };
        Ok(())
    });
    acl_status("aclrtMallocHost", r)
}

#[no_mangle]
pub extern "C" fn aclrtFreeHost(host_ptr: *mut c_void) -> c_int {
    acl_status("aclrtFreeHost", runtime::free_host(host_ptr as usize))
}

#[no_mangle]
pub extern "C" fn aclrtMemcpy(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: u32,
) -> c_int {
    acl_status(
        "aclrtMemcpy",
        runtime::memcpy(dst as usize, dest_max, src as usize, count, kind),
    )
}

#[no_mangle]
pub extern "C" fn aclrtMemcpyAsync(
    dst: *mut c_void,
    dest_max: usize,
    src: *const c_void,
    count: usize,
    kind: u32,
    stream: *mut c_void,
) -> c_int {
    acl_status(
        "aclrtMemcpyAsync",
        runtime::memcpy_async(
            dst as usize,
            dest_max,
            src as usize,
            count,
            kind,
            stream as usize,
        ),
    )
}

#[no_mangle]
pub extern "C" fn aclrtMemset(
    dev_ptr: *mut c_void,
    max_count: usize,
    value: i32,
    count: usize,
) -> c_int {
    acl_status(
        "aclrtMemset",
        runtime::memset(dev_ptr as usize, max_count, value, count),
    )
}

#[no_mangle]
pub unsafe extern "C" fn aclrtCreateStream(stream: *mut *mut c_void) -> c_int {
    let r = out_ptr(stream, "stream").and_then(|p| {
        let h = runtime::create_stream()?;
        // SAFETY: p is non-null and points to a handle slot the caller owns.
        unsafe { p.write(h as *mut c_void) };
        Ok(())
    });
    acl_status("aclrtCreateStream", r)
}

#[no_mangle]
pub extern "C" fn aclrtDestroyStream(stream: *mut c_void) -> c_int {
    acl_status(
        "aclrtDestroyStream",
        runtime::destroy_stream(stream as usize),
    )
}

#[no_mangle]
pub extern "C" fn aclrtSynchronizeStream(stream: *mut c_void) -> c_int {
    acl_status(
        "aclrtSynchronizeStream",
        runtime::synchronize_stream(stream as usize),
    )
}

#[no_mangle]
pub unsafe extern "C" fn aclrtCreateEvent(event: *mut *mut c_void) -> c_int {
    let r = out_ptr(event, "event").and_then(|p| {
        let h = runtime::create_event()?;
        // SAFETY: p is non-null and points to a handle slot the caller owns.
        unsafe { p.write(h as *mut c_void) };
        Ok(())
    });
    acl_status("aclrtCreateEvent", r)
}

#[no_mangle]
pub extern "C" fn aclrtRecordEvent(event: *mut c_void, stream: *mut c_void) -> c_int {
    acl_status(
        "aclrtRecordEvent",
        runtime::record_event(event as usize, stream as usize),
    )
}

#[no_mangle]
pub unsafe extern "C" fn aclrtQueryEventStatus(event: *mut c_void, status: *mut u32) -> c_int {
    let r = out_ptr(status, "status").and_then(|p| {
        let s = runtime::query_event(event as usize)?;
        // SAFETY: p is non-null and points to a status slot the caller owns.
        unsafe { p.write(s) };
        Ok(())
    });
    acl_status("aclrtQueryEventStatus", r)
}

#[no_mangle]
pub extern "C" fn aclrtSynchronizeEvent(event: *mut c_void) -> c_int {
    acl_status(
        "aclrtSynchronizeEvent",
        runtime::synchronize_event(event as usize),
    )
}

#[no_mangle]
pub extern "C" fn aclrtStreamWaitEvent(stream: *mut c_void, event: *mut c_void) -> c_int {
    acl_status(
        "aclrtStreamWaitEvent",
        runtime::stream_wait_event(stream as usize, event as usize),
    )
}

#[no_mangle]
pub extern "C" fn aclrtDestroyEvent(event: *mut c_void) -> c_int {
    acl_status("aclrtDestroyEvent", runtime::destroy_event(event as usize))
}

#[no_mangle]
pub extern "C" fn aclGetRecentErrMsg() -> *const c_char {
    take_recent()
}

// ---------------------------------------------------------------- HCCL

#[no_mangle]
pub unsafe extern "C" fn HcclGetRootInfo(root_info: *mut HcclRootInfo) -> u32 {
    let r = hccl_ptr(root_info, "rootInfo").and_then(|p| {
        // SAFETY: non-null and points to a caller-owned HcclRootInfo.
        let info = unsafe { &mut (*p.cast_mut()).internal };
        hccl::get_root_info(info)
    });
    hccl_status("HcclGetRootInfo", r)
}

#[no_mangle]
pub unsafe extern "C" fn HcclCommInitRootInfo(
    n_ranks: u32,
    root_info: *const HcclRootInfo,
    rank: u32,
    comm: *mut *mut c_void,
) -> u32 {
    let r = hccl_ptr(root_info, "rootInfo")
        .and_then(|ri| hccl_ptr(comm, "comm").map(|c| (ri, c)))
        .and_then(|(ri, c)| {
            // SAFETY: non-null and points to a caller-owned HcclRootInfo.
            let info = unsafe { &(*ri).internal };
            let h = hccl::comm_init_root_info(n_ranks, info, rank)?;
            // SAFETY: c is non-null and points to a handle slot the caller owns.
            unsafe { c.cast_mut().write(h as *mut c_void) };
            Ok(())
        });
    hccl_status("HcclCommInitRootInfo", r)
}

#[no_mangle]
pub extern "C" fn HcclCommDestroy(comm: *mut c_void) -> u32 {
    hccl_status("HcclCommDestroy", hccl::comm_destroy(comm as usize))
}

#[no_mangle]
pub extern "C" fn HcclGetErrorString(code: u32) -> *const c_char {
    hccl_error_text(code).as_ptr()
}

#[no_mangle]
pub unsafe extern "C" fn HcclRegisterMem(
    comm: *mut c_void,
    remote_rank: u32,
    mem_type: c_int,
    addr: *mut c_void,
    size: u64,
    desc: *mut HcclMemDesc,
) -> u32 {
    let r = hccl_ptr(desc, "desc").and_then(|d| {
        let bytes = hccl::register_mem(comm as usize, remote_rank, mem_type, addr as usize, size)?;
        // SAFETY: d is non-null and points to a caller-owned HcclMemDesc.
        unsafe { (*d.cast_mut()).desc = bytes };
        Ok(())
    });
    hccl_status("HcclRegisterMem", r)
}

#[no_mangle]
pub unsafe extern "C" fn HcclDeregisterMem(comm: *mut c_void, desc: *mut HcclMemDesc) -> u32 {
    let r = hccl_ptr(desc, "desc").and_then(|d| {
        // SAFETY: non-null and points to a caller-owned HcclMemDesc.
        let bytes = unsafe { &(*d).desc };
        hccl::deregister_mem(comm as usize, bytes)
    });
    hccl_status("HcclDeregisterMem", r)
}

#[no_mangle]
pub unsafe extern "C" fn HcclExchangeMemDesc(
    comm: *mut c_void,
    remote_rank: u32,
    local: *mut HcclMemDescs,
    _timeout: c_int,
    remote: *mut HcclMemDescs,
    actual_num: *mut u32,
) -> u32 {
    let r = (|| {
        let local = hccl_ptr(local, "local")?;
        let remote = hccl_ptr(remote, "remote")?;
        let actual = hccl_ptr(actual_num, "actualNum")?;
        // SAFETY: both HcclMemDescs are non-null and caller-owned.
        let (local, remote) = unsafe { (&*local, &*remote) };
        let local_descs: Vec<[u8; MEM_DESC_BYTES]> = if local.array_length == 0 {
            Vec::new()
        } else {
            hccl_ptr(local.array, "local->array")?;
            // SAFETY: the caller's array holds arrayLength descriptors.
            unsafe { std::slice::from_raw_parts(local.array, local.array_length as usize) }
                .iter()
                .map(|d| d.desc)
                .collect()
        };
        let capacity = if remote.array.is_null() {
            0
        } else {
            remote.array_length as usize
        };
        let got = hccl::exchange_mem_desc(comm as usize, remote_rank, &local_descs, capacity)?;
        for (i, d) in got.iter().enumerate() {
            // SAFETY: i < capacity, which the caller's array can hold.
            unsafe { (*remote.array.add(i)).desc = *d };
        }
        // SAFETY: actual is non-null and caller-owned.
        unsafe { actual.cast_mut().write(got.len() as u32) };
        Ok(())
    })();
    hccl_status("HcclExchangeMemDesc", r)
}

#[no_mangle]
pub unsafe extern "C" fn HcclEnableMemAccess(
    comm: *mut c_void,
    remote_mem_desc: *mut HcclMemDesc,
    remote_mem: *mut HcclMem,
) -> u32 {
    let r = (|| {
        let d = hccl_ptr(remote_mem_desc, "remoteMemDesc")?;
        let out = hccl_ptr(remote_mem, "remoteMem")?;
        // SAFETY: non-null and points to a caller-owned HcclMemDesc.
        let bytes = unsafe { &(*d).desc };
        let mem = hccl::enable_mem_access(comm as usize, bytes)?;
        // SAFETY: out is non-null and caller-owned.
        unsafe {
            out.cast_mut().write(HcclMem {
                mem_type: mem.mem_type,
                addr: mem.addr as *mut c_void,
                size: mem.size,
            })
        };
        Ok(())
    })();
    hccl_status("HcclEnableMemAccess", r)
}

#[no_mangle]
pub unsafe extern "C" fn HcclDisableMemAccess(
    comm: *mut c_void,
    remote_mem_desc: *mut HcclMemDesc,
) -> u32 {
    let r = hccl_ptr(remote_mem_desc, "remoteMemDesc").and_then(|d| {
        // SAFETY: non-null and points to a caller-owned HcclMemDesc.
        let bytes = unsafe { &(*d).desc };
        hccl::disable_mem_access(comm as usize, bytes)
    });
    hccl_status("HcclDisableMemAccess", r)
}

unsafe fn batch_ops<'a>(
    desc: *const HcclOneSideOpDesc,
    n: u32,
) -> Result<&'a [HcclOneSideOpDesc], Failure> {
    if n == 0 {
        return Ok(&[]);
    }
    // Checked before the array is read, as the runtime does.
    let limit = runtime::batch_op_limit();
    if n as usize > limit {
        return Err(Failure::hccl(
            HCCL_E_PARA,
            format!(
                "descNum {n} exceeds the {limit} ops one call accepts on {}",
                runtime::soc_name().to_string_lossy()
            ),
        ));
    }
    let desc = hccl_ptr(desc, "desc")?;
    // SAFETY: the caller's array holds descNum entries (CANN contract).
    Ok(unsafe { std::slice::from_raw_parts(desc, n as usize) })
}

fn convert(ops: &[HcclOneSideOpDesc]) -> Vec<OneSidedOp> {
    ops.iter()
        .map(|o| OneSidedOp {
            local: o.local_addr as usize,
            remote: o.remote_addr as usize,
            count: o.count,
            data_type: o.data_type,
        })
        .collect()
}

#[no_mangle]
pub unsafe extern "C" fn HcclBatchPut(
    comm: *mut c_void,
    remote_rank: u32,
    desc: *mut HcclOneSideOpDesc,
    desc_num: u32,
    stream: *mut c_void,
) -> u32 {
    // SAFETY: forwarded CANN contract on desc/desc_num.
    let r = unsafe { batch_ops(desc, desc_num) }.and_then(|ops| {
        hccl::batch(
            comm as usize,
            remote_rank,
            &convert(ops),
            stream as usize,
            true,
        )
    });
    hccl_status("HcclBatchPut", r)
}

#[no_mangle]
pub unsafe extern "C" fn HcclBatchGet(
    comm: *mut c_void,
    remote_rank: u32,
    desc: *mut HcclOneSideOpDesc,
    desc_num: u32,
    stream: *mut c_void,
) -> u32 {
    // SAFETY: forwarded CANN contract on desc/desc_num.
    let r = unsafe { batch_ops(desc, desc_num) }.and_then(|ops| {
        hccl::batch(
            comm as usize,
            remote_rank,
            &convert(ops),
            stream as usize,
            false,
        )
    });
    hccl_status("HcclBatchGet", r)
}

// ---------------------------------------------------- emulator only

/// Counters of one path of the modeled link (see [`AscendEmuLinkStats`]).
#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
pub struct AscendEmuLinkPathStats {
    /// One-sided ops accounted on the link.
    pub ops: u64,
    /// Bytes those ops moved.
    pub bytes: u64,
    /// Modeled seconds the link was busy with them (never wall time).
    pub busy_seconds: f64,
}

/// What `ascend_emu_link_stats` reports.
#[repr(C)]
#[derive(Debug, Clone, Copy)]
pub struct AscendEmuLinkStats {
    /// The modeled link's name (`ASCEND_PD_EMU_LINK`), NUL-terminated;
    /// empty when no link is modeled (then every counter is 0).
    pub link: [c_char; 32],
    /// Modeled time at which the link has finished every op accounted.
    pub modeled_end_seconds: f64,
    /// HCCL communication domain (`HcclBatchPut` / `HcclBatchGet`).
    pub comm: AscendEmuLinkPathStats,
    /// HIXL's `hixl_cs` path (`HixlCSClientBatch*`).
    pub hixl: AscendEmuLinkPathStats,
}

const _: () = {
    assert!(std::mem::size_of::<AscendEmuLinkPathStats>() == 24);
    assert!(std::mem::size_of::<AscendEmuLinkStats>() == 88);
};

/// Emulator only, no CANN counterpart: this process's modeled-link
/// counters (see the `link` module). With `reset` non-zero the counters and
/// the link's clock start again from zero after being read. Returns 0, or
/// `ACL_ERROR_INVALID_PARAM` when `out` is NULL or `ASCEND_PD_EMU_LINK`
/// names no known link (the text, naming the known links, is then in
/// `aclGetRecentErrMsg`).
#[no_mangle]
pub unsafe extern "C" fn ascend_emu_link_stats(
    out: *mut AscendEmuLinkStats,
    reset: c_int,
) -> c_int {
    let r = out_ptr(out, "out").and_then(|out| {
        let model = crate::link::from_env()
            .map_err(|e| Failure::acl(ACL_ERROR_INVALID_PARAM, e.to_string()))?;
        let mut clock = crate::link::process_clock()
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        let path = |p| {
            let s = clock.stats(p);
            AscendEmuLinkPathStats {
                ops: s.ops,
                bytes: s.bytes,
                busy_seconds: s.busy_seconds,
            }
        };
        let mut stats = AscendEmuLinkStats {
            link: [0; 32],
            modeled_end_seconds: clock.free_at(),
            comm: path(crate::link::Path::Comm),
            hixl: path(crate::link::Path::Hixl),
        };
        if let Some(l) = model {
            // Names are short ASCII (checked by the table's parser); the
            // last byte stays NUL.
            for (d, b) in stats.link.iter_mut().zip(l.name().bytes().take(31)) {
                *d = b as c_char;
            }
        }
        if reset != 0 {
            *clock = Default::default();
        }
        // SAFETY: out is non-null and points to a caller-owned struct.
        unsafe { out.write(stats) };
        Ok(())
    });
    acl_status("ascend_emu_link_stats", r)
}

/// Emulator only, no CANN counterpart: makes the next `times`
/// `aclrtMemcpyAsync` copies whose source or destination overlaps
/// `[addr, addr + len)` fail. `at` 1: the call refuses the copy (nothing is
/// queued); `at` 2: the copy is queued but fails on its stream without
/// moving a byte, and the stream's next `aclrtSynchronizeStream` reports
/// it, as does `aclrtSynchronizeEvent` of every event recorded on that
/// stream after it until then; `at` 3: the copy runs, but the stream's next
/// `aclrtSynchronizeStream` (and the next `aclrtSynchronizeEvent` of an
/// event recorded on it meanwhile) fails at once, before the stream's work
/// ran (a wait that errs while the device still copies). `times` 0 clears
/// the faults armed over
/// exactly that range. Returns 0, or `ACL_ERROR_INVALID_PARAM` (the text in
/// `aclGetRecentErrMsg`).
#[no_mangle]
pub extern "C" fn ascend_emu_inject_copy_fault(
    addr: u64,
    len: u64,
    at: c_int,
    times: u32,
) -> c_int {
    acl_status(
        "ascend_emu_inject_copy_fault",
        crate::fault::inject(addr, len, at, times),
    )
}
