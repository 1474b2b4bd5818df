//! The exported HIXL client/server symbols (`HixlCS*`), with the C
//! signatures of ascend-sys/cann-headers/include/hixl/ascend_pd_hixl_cs.h
//! (the types are ascend-sys's generated ones), plus the emulator-only
//! `ascend_emu_hixl_server_port`. Each checks its pointers, converts
//! arguments and calls into `hixl`.

// The C contract of every function is HIXL's; the emulator checks what it
// can (NULL, handles, address ranges) and otherwise trusts pointers as
// HIXL does.
#![allow(clippy::missing_safety_doc)]

use std::ffi::{c_char, c_void, CStr};

use ascend_sys::sys::{
    CommMem, CompleteHandle, EndpointDesc, HixlClientConfig, HixlClientDesc, HixlClientHandle,
    HixlCompleteStatus, HixlOneSideOpDesc, HixlServerConfig, HixlServerDesc, HixlServerHandle,
    HixlStatus, MemHandle, HIXL_COMPLETE_STATUS_COMPLETED, HIXL_COMPLETE_STATUS_WAITING,
};

use crate::hixl::{self, Op};
use crate::status::*;

fn nonnull<T>(p: *const T, what: &str) -> Result<*const T, Failure> {
    if p.is_null() {
        Err(Failure::hixl(HIXL_PARAM_INVALID, format!("{what} is NULL")))
    } else {
        Ok(p)
    }
}

/// Copies a C string argument.
///
/// # Safety
/// `p` is NULL or a NUL-terminated string valid for the call.
unsafe fn string(p: *const c_char, what: &str) -> Result<String, Failure> {
    let p = nonnull(p, what)?;
    // SAFETY: non-null and NUL-terminated per the caller's contract.
    let s = unsafe { CStr::from_ptr(p) };
    s.to_str()
        .map(str::to_owned)
        .map_err(|_| Failure::hixl(HIXL_PARAM_INVALID, format!("{what} is not UTF-8")))
}

/// Reads a `CommMem` argument.
///
/// # Safety
/// `mem` is NULL or points to a valid `CommMem`.
unsafe fn comm_mem(mem: *const CommMem) -> Result<(i32, usize, u64), Failure> {
    let mem = nonnull(mem, "mem")?;
    // SAFETY: non-null and valid per the caller's contract.
    let m = unsafe { &*mem };
    Ok((m.type_, m.addr as usize, m.size))
}

/// Reads a batch's op list.
///
/// # Safety
/// `desc` is NULL or points to `n` valid descriptors.
unsafe fn ops(desc: *const HixlOneSideOpDesc, n: u32) -> Result<Vec<Op>, Failure> {
    if n == 0 {
        return Err(Failure::hixl(
            HIXL_PARAM_INVALID,
            "list_num is 0: a batch needs at least one op",
        ));
    }
    let desc = nonnull(desc, "desc_list")?;
    // SAFETY: non-null and holding n descriptors per the caller's contract.
    let list = unsafe { std::slice::from_raw_parts(desc, n as usize) };
    Ok(list
        .iter()
        .map(|d| Op {
            remote: d.remote_buf as usize,
            local: d.local_buf as usize,
            len: d.len,
        })
        .collect())
}

/// Writes an out-parameter.
///
/// # Safety
/// `out` is non-null and valid for a write of `T` (the C caller's
/// out-parameter, per HIXL's contract).
unsafe fn write_out<T>(out: *mut T, value: T) {
    // SAFETY: per this function's contract.
    unsafe { out.write(value) };
}

// ---------------------------------------------------------------- server

#[no_mangle]
pub unsafe extern "C" fn HixlCSServerCreate(
    server_desc: *const HixlServerDesc,
    config: *const HixlServerConfig,
    server_handle: *mut HixlServerHandle,
) -> HixlStatus {
    let r = (|| {
        let desc = nonnull(server_desc, "server_desc")?;
        nonnull(config, "config")?;
        let out = nonnull(server_handle, "server_handle")?;
        // SAFETY: non-null and valid per HIXL's contract.
        let desc = unsafe { &*desc };
        // SAFETY: as above, for the string it names.
        let ip = unsafe { string(desc.server_ip, "server_ip") }?;
        let n = desc.endpoint_list_num as usize;
        let endpoints: &[EndpointDesc] = if n == 0 {
            &[]
        } else {
            let list = nonnull(desc.endpoint_list, "endpoint_list")?;
            // SAFETY: the list holds endpoint_list_num endpoints per HIXL's contract.
            unsafe { std::slice::from_raw_parts(list, n) }
        };
        let h = hixl::server_create(&ip, desc.server_port, endpoints)?;
        // SAFETY: checked non-null above; the C caller's out-parameter.
        unsafe { write_out(out.cast_mut(), h as *mut c_void) };
        Ok(())
    })();
    hixl_status("HixlCSServerCreate", r)
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSServerRegMem(
    server_handle: HixlServerHandle,
    mem_tag: *const c_char,
    mem: *const CommMem,
    mem_handle: *mut MemHandle,
) -> HixlStatus {
    let r = (|| {
        let out = nonnull(mem_handle, "mem_handle")?;
        // The tag is optional (NULL: none).
        let tag = if mem_tag.is_null() {
            String::new()
        } else {
            // SAFETY: non-null and NUL-terminated per HIXL's contract.
            unsafe { string(mem_tag, "mem_tag") }?
        };
        // SAFETY: forwarded HIXL contract on mem.
        let (t, addr, size) = unsafe { comm_mem(mem) }?;
        let h = hixl::server_reg_mem(server_handle as usize, tag, t, addr, size)?;
        // SAFETY: checked non-null above; the C caller's out-parameter.
        unsafe { write_out(out.cast_mut(), h as *mut c_void) };
        Ok(())
    })();
    hixl_status("HixlCSServerRegMem", r)
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSServerListen(
    server_handle: HixlServerHandle,
    backlog: u32,
) -> HixlStatus {
    hixl_status(
        "HixlCSServerListen",
        hixl::server_listen(server_handle as usize, backlog),
    )
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSServerUnregMem(
    server_handle: HixlServerHandle,
    mem_handle: MemHandle,
) -> HixlStatus {
    hixl_status(
        "HixlCSServerUnregMem",
        hixl::server_unreg_mem(server_handle as usize, mem_handle as usize),
    )
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSServerDestroy(server_handle: HixlServerHandle) -> HixlStatus {
    hixl_status(
        "HixlCSServerDestroy",
        hixl::server_destroy(server_handle as usize),
    )
}

// ---------------------------------------------------------------- client

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientCreate(
    client_desc: *const HixlClientDesc,
    config: *const HixlClientConfig,
    client_handle: *mut HixlClientHandle,
) -> HixlStatus {
    let r = (|| {
        let desc = nonnull(client_desc, "client_desc")?;
        nonnull(config, "config")?;
        let out = nonnull(client_handle, "client_handle")?;
        // SAFETY: non-null and valid per HIXL's contract.
        let desc = unsafe { &*desc };
        // SAFETY: as above, for the string it names.
        let ip = unsafe { string(desc.server_ip, "server_ip") }?;
        let local = nonnull(desc.local_endpoint, "local_endpoint")?;
        let remote = nonnull(desc.remote_endpoint, "remote_endpoint")?;
        // SAFETY: both non-null and valid per HIXL's contract.
        let (local, remote) = unsafe { (&*local, &*remote) };
        let h = hixl::client_create(&ip, desc.server_port, local, remote)?;
        // SAFETY: checked non-null above; the C caller's out-parameter.
        unsafe { write_out(out.cast_mut(), h as *mut c_void) };
        Ok(())
    })();
    hixl_status("HixlCSClientCreate", r)
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientConnect(
    client_handle: HixlClientHandle,
    timeout_ms: u32,
) -> HixlStatus {
    hixl_status(
        "HixlCSClientConnect",
        hixl::client_connect(client_handle as usize, timeout_ms),
    )
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientGetRemoteMem(
    client_handle: HixlClientHandle,
    remote_mem_list: *mut *mut CommMem,
    mem_tag_list: *mut *mut *mut c_char,
    list_num: *mut u32,
    timeout_ms: u32,
) -> HixlStatus {
    let r = (|| {
        let mems_out = nonnull(remote_mem_list, "remote_mem_list")?;
        let tags_out = nonnull(mem_tag_list, "mem_tag_list")?;
        let n_out = nonnull(list_num, "list_num")?;
        let (mems, tags, n) = hixl::client_get_remote_mem(client_handle as usize, timeout_ms)?;
        // SAFETY: checked non-null above; the C caller's out-parameter.
        unsafe { write_out(mems_out.cast_mut(), mems) };
        // SAFETY: checked non-null above; the C caller's out-parameter.
        unsafe { write_out(tags_out.cast_mut(), tags) };
        // SAFETY: checked non-null above; the C caller's out-parameter.
        unsafe { write_out(n_out.cast_mut(), n) };
        Ok(())
    })();
    hixl_status("HixlCSClientGetRemoteMem", r)
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientRegMem(
    client_handle: HixlClientHandle,
    mem_tag: *const c_char,
    mem: *const CommMem,
    mem_handle: *mut MemHandle,
) -> HixlStatus {
    let r = (|| {
        let out = nonnull(mem_handle, "mem_handle")?;
        let tag = if mem_tag.is_null() {
            String::new()
        } else {
            // SAFETY: non-null and NUL-terminated per HIXL's contract.
            unsafe { string(mem_tag, "mem_tag") }?
        };
        // SAFETY: forwarded HIXL contract on mem.
        let (t, addr, size) = unsafe { comm_mem(mem) }?;
        let h = hixl::client_reg_mem(client_handle as usize, tag, t, addr, size)?;
        // SAFETY: checked non-null above; the C caller's out-parameter.
        unsafe { write_out(out.cast_mut(), h as *mut c_void) };
        Ok(())
    })();
    hixl_status("HixlCSClientRegMem", r)
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientUnregMem(
    client_handle: HixlClientHandle,
    mem_handle: MemHandle,
) -> HixlStatus {
    hixl_status(
        "HixlCSClientUnregMem",
        hixl::client_unreg_mem(client_handle as usize, mem_handle as usize),
    )
}

/// # Safety
/// As the batch calls below.
unsafe fn batch_async(
    call: &str,
    client_handle: HixlClientHandle,
    list_num: u32,
    desc_list: *const HixlOneSideOpDesc,
    complete_handle: *mut CompleteHandle,
    put: bool,
) -> HixlStatus {
    let r = (|| {
        let out = nonnull(complete_handle, "complete_handle")?;
        // SAFETY: forwarded HIXL contract on desc_list / list_num.
        let ops = unsafe { ops(desc_list, list_num) }?;
        let h = hixl::client_batch_async(client_handle as usize, &ops, put)?;
        // SAFETY: checked non-null above; the C caller's out-parameter.
        unsafe { write_out(out.cast_mut(), h as *mut c_void) };
        Ok(())
    })();
    hixl_status(call, r)
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientBatchPutAsync(
    client_handle: HixlClientHandle,
    list_num: u32,
    desc_list: *const HixlOneSideOpDesc,
    complete_handle: *mut CompleteHandle,
) -> HixlStatus {
    // SAFETY: forwarded HIXL contract.
    unsafe {
        batch_async(
            "HixlCSClientBatchPutAsync",
            client_handle,
            list_num,
            desc_list,
            complete_handle,
            true,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientBatchGetAsync(
    client_handle: HixlClientHandle,
    list_num: u32,
    desc_list: *const HixlOneSideOpDesc,
    complete_handle: *mut CompleteHandle,
) -> HixlStatus {
    // SAFETY: forwarded HIXL contract.
    unsafe {
        batch_async(
            "HixlCSClientBatchGetAsync",
            client_handle,
            list_num,
            desc_list,
            complete_handle,
            false,
        )
    }
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientBatchPutSync(
    client_handle: HixlClientHandle,
    list_num: u32,
    desc_list: *const HixlOneSideOpDesc,
    timeout_ms: u32,
) -> HixlStatus {
    // SAFETY: forwarded HIXL contract on desc_list / list_num.
    let r = unsafe { ops(desc_list, list_num) }
        .and_then(|ops| hixl::client_batch_sync(client_handle as usize, &ops, true, timeout_ms));
    hixl_status("HixlCSClientBatchPutSync", r)
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientBatchGetSync(
    client_handle: HixlClientHandle,
    list_num: u32,
    desc_list: *const HixlOneSideOpDesc,
    timeout_ms: u32,
) -> HixlStatus {
    // SAFETY: forwarded HIXL contract on desc_list / list_num.
    let r = unsafe { ops(desc_list, list_num) }
        .and_then(|ops| hixl::client_batch_sync(client_handle as usize, &ops, false, timeout_ms));
    hixl_status("HixlCSClientBatchGetSync", r)
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientQueryCompleteStatus(
    client_handle: HixlClientHandle,
    complete_handle: CompleteHandle,
    complete_status: *mut HixlCompleteStatus,
) -> HixlStatus {
    let r = (|| {
        let out = nonnull(complete_status, "complete_status")?;
        let done = hixl::client_query(client_handle as usize, complete_handle as usize)?;
        let status = if done {
            HIXL_COMPLETE_STATUS_COMPLETED
        } else {
            HIXL_COMPLETE_STATUS_WAITING
        };
        // SAFETY: checked non-null above; the C caller's out-parameter.
        unsafe { write_out(out.cast_mut(), status) };
        Ok(())
    })();
    hixl_status("HixlCSClientQueryCompleteStatus", r)
}

#[no_mangle]
pub unsafe extern "C" fn HixlCSClientDestroy(client_handle: HixlClientHandle) -> HixlStatus {
    hixl_status(
        "HixlCSClientDestroy",
        hixl::client_destroy(client_handle as usize),
    )
}

// ---------------------------------------------------- emulator only

/// Emulator only, no HIXL counterpart: the TCP port a listening server
/// bound, which is how a server created with port 0 (an ephemeral port)
/// tells its clients where to connect. `HIXL_PARAM_INVALID` before
/// `HixlCSServerListen`, for a NULL `port` or an unknown server.
#[no_mangle]
pub unsafe extern "C" fn ascend_emu_hixl_server_port(
    server_handle: HixlServerHandle,
    port: *mut u32,
) -> HixlStatus {
    let r = (|| {
        let out = nonnull(port, "port")?;
        let p = hixl::server_port(server_handle as usize)?;
        // SAFETY: checked non-null above; the C caller's out-parameter.
        unsafe { write_out(out.cast_mut(), p) };
        Ok(())
    })();
    hixl_status("ascend_emu_hixl_server_port", r)
}
