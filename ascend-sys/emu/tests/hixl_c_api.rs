//! The emulated HIXL C API called directly (the raw `HixlLib` table over
//! the library the loader mapped), for the rules the safe wrappers keep
//! out of reach: NULL arguments, empty batches, querying a completed
//! handle again, the 4096 unqueried transfers of a host-endpoint client
//! (and no limit on a device-endpoint one), the list lifetime of
//! `HixlCSClientGetRemoteMem`, endpoint matching, the synchronous calls.
//! Server and client run in this one process.

use std::ffi::{c_char, c_void, CStr};
use std::ptr::null_mut;

use ascend_sys::sys::{self, CommMem, EndpointDesc, HixlLib, HixlOneSideOpDesc};
use ascend_sys::{Acl, DeviceBuffer, HixlEndpoint, HixlProtocol};

const OK: u32 = sys::HIXL_SUCCESS;
const PARAM_INVALID: u32 = sys::HIXL_PARAM_INVALID;
const FAILED: u32 = sys::HIXL_FAILED;
const RESOURCE_EXHAUSTED: u32 = ascend_sys::result::HIXL_RESOURCE_EXHAUSTED;
const WAIT_MS: u32 = 30_000;

struct Api {
    hixl: HixlLib,
    lib: libloading::Library,
}

impl Api {
    /// The text of the latest failure on this thread.
    fn recent(&self) -> String {
        type RecentFn = unsafe extern "C" fn() -> *const c_char;
        // SAFETY: the emulator exports aclGetRecentErrMsg with this signature.
        let f: libloading::Symbol<RecentFn> =
            unsafe { self.lib.get(b"aclGetRecentErrMsg\0") }.unwrap();
        // SAFETY: no arguments; NULL or a string valid until the next call.
        let p = unsafe { f() };
        assert!(!p.is_null(), "a failure leaves a message");
        // SAFETY: non-null and NUL-terminated.
        unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
    }

    fn expect_refusal(&self, code: u32, want: u32, text: &str) {
        assert_eq!(code, want);
        let msg = self.recent();
        assert!(msg.contains(text), "{msg:?} should mention {text:?}");
    }
}

fn endpoint(dev: u32) -> EndpointDesc {
    HixlEndpoint {
        protocol: HixlProtocol::Roce,
        device_phy_id: dev,
        ipv4: Some(std::net::Ipv4Addr::LOCALHOST),
    }
    .to_raw()
}

/// A RoCE endpoint at another address (RoCE endpoints match by address).
fn elsewhere(dev: u32) -> EndpointDesc {
    HixlEndpoint {
        protocol: HixlProtocol::Roce,
        device_phy_id: dev,
        ipv4: Some(std::net::Ipv4Addr::new(127, 0, 0, 5)),
    }
    .to_raw()
}

fn mem(buf: &DeviceBuffer) -> CommMem {
    CommMem {
        type_: sys::COMM_MEM_TYPE_DEVICE,
        addr: buf.as_ptr(),
        size: buf.len() as u64,
    }
}

fn op(remote: u64, local: &DeviceBuffer, at: usize, len: u64) -> HixlOneSideOpDesc {
    HixlOneSideOpDesc {
        remote_buf: remote as usize as *mut c_void,
        local_buf: local.as_ptr().cast::<u8>().wrapping_add(at).cast(),
        len,
    }
}

#[test]
fn the_c_api_keeps_hixls_rules() {
    let acl = Acl::init_from_dir(ascend_emu::install_dir().unwrap()).unwrap();
    let dev = acl.device(0).unwrap();
    let path = acl.hixl().unwrap().library_path().to_path_buf();
    // SAFETY: the library the loader already mapped (initialisers ran);
    // both handles keep it loaded for the whole test.
    let api = Api {
        hixl: unsafe { HixlLib::new(&path) }.unwrap(),
        lib: unsafe { libloading::Library::new(&path) }.unwrap(),
    };
    let h = &api.hixl;
    let f = |r: &Result<_, libloading::Error>| r.is_ok();
    assert!(f(&h.HixlCSClientBatchPutSync) && f(&h.HixlCSClientBatchGetSync));
    // SAFETY (for every call below): arguments are valid pointers to live
    // locals, live handles, or deliberately NULL where the emulator is
    // expected to refuse them.
    unsafe {
        let server_create = h.HixlCSServerCreate.as_ref().unwrap();
        let ip = c"127.0.0.1";
        let offered = [endpoint(0)];
        let mut sdesc = sys::HixlServerDesc {
            endpoint_list: offered.as_ptr(),
            server_ip: ip.as_ptr(),
            server_port: 0,
            endpoint_list_num: 1,
            ..Default::default()
        };
        let sconf = sys::HixlServerConfig::default();
        let mut server = null_mut();
        api.expect_refusal(
            server_create(&sdesc, std::ptr::null(), &mut server),
            PARAM_INVALID,
            "config is NULL",
        );
        sdesc.endpoint_list_num = 0;
        api.expect_refusal(
            server_create(&sdesc, &sconf, &mut server),
            PARAM_INVALID,
            "offers no endpoint",
        );
        sdesc.endpoint_list_num = 1;
        assert_eq!(server_create(&sdesc, &sconf, &mut server), OK);

        let far = dev.alloc(1 << 20).unwrap();
        let far2 = dev.alloc(4096).unwrap();
        let mut id = null_mut();
        let reg = h.HixlCSServerRegMem.as_ref().unwrap();
        // A NULL tag is allowed (no tag), and an empty one is no tag
        // either. The untagged region is the lower-addressed one, so that
        // a tag list listing it would start with its (empty) tag.
        let (tag_far, tag_far2) = if far2.addr() < far.addr() {
            (c"far", c"")
        } else {
            (c"", c"far")
        };
        let ptr = |t: &CStr| {
            if t.is_empty() {
                std::ptr::null()
            } else {
                t.as_ptr()
            }
        };
        assert_eq!(reg(server, ptr(tag_far), &mem(&far), &mut id), OK);
        let mut id2 = null_mut();
        assert_eq!(reg(server, tag_far2.as_ptr(), &mem(&far2), &mut id2), OK);
        // Overlapping an earlier registration is refused.
        let mut id3 = null_mut();
        api.expect_refusal(
            reg(server, c"again".as_ptr(), &mem(&far), &mut id3),
            PARAM_INVALID,
            "overlaps",
        );
        let port_fn: libloading::Symbol<unsafe extern "C" fn(*mut c_void, *mut u32) -> u32> =
            api.lib.get(b"ascend_emu_hixl_server_port\0").unwrap();
        let mut port = 0u32;
        api.expect_refusal(port_fn(server, &mut port), PARAM_INVALID, "not listening");
        assert_eq!((h.HixlCSServerListen.as_ref().unwrap())(server, 8), OK);
        assert_eq!(port_fn(server, &mut port), OK);
        assert!(port > 0);

        // Clients.
        let client_create = h.HixlCSClientCreate.as_ref().unwrap();
        let (local, wanted, not_offered) = (endpoint(1), endpoint(0), elsewhere(0));
        let mut cdesc = sys::HixlClientDesc {
            local_endpoint: &local,
            remote_endpoint: &not_offered,
            server_ip: ip.as_ptr(),
            server_port: port,
            ..Default::default()
        };
        let cconf = sys::HixlClientConfig::default();
        let mut client = null_mut();
        api.expect_refusal(
            client_create(&cdesc, std::ptr::null(), &mut client),
            PARAM_INVALID,
            "config is NULL",
        );
        let connect = h.HixlCSClientConnect.as_ref().unwrap();
        let destroy = h.HixlCSClientDestroy.as_ref().unwrap();
        // A remote endpoint the server does not offer: connect fails.
        assert_eq!(client_create(&cdesc, &cconf, &mut client), OK);
        api.expect_refusal(
            connect(client, WAIT_MS),
            FAILED,
            "offers no endpoint matching",
        );
        assert_eq!(destroy(client), OK);
        cdesc.server_port = 0;
        api.expect_refusal(
            client_create(&cdesc, &cconf, &mut client),
            PARAM_INVALID,
            "port 0",
        );
        cdesc.server_port = port;
        cdesc.remote_endpoint = &wanted;
        assert_eq!(client_create(&cdesc, &cconf, &mut client), OK);

        let near = dev.alloc(1 << 20).unwrap();
        near.fill(0, near.len(), 0x5a).unwrap();
        let mut nid = null_mut();
        let creg = h.HixlCSClientRegMem.as_ref().unwrap();
        assert_eq!(creg(client, c"near".as_ptr(), &mem(&near), &mut nid), OK);

        let get_remote = h.HixlCSClientGetRemoteMem.as_ref().unwrap();
        let (mut mems, mut tags, mut n) = (null_mut(), null_mut(), 0u32);
        api.expect_refusal(
            get_remote(client, &mut mems, &mut tags, &mut n, WAIT_MS),
            PARAM_INVALID,
            "not connected",
        );
        assert_eq!(connect(client, WAIT_MS), OK);
        api.expect_refusal(connect(client, WAIT_MS), PARAM_INVALID, "already connected");
        assert_eq!(
            get_remote(client, &mut mems, &mut tags, &mut n, WAIT_MS),
            OK
        );
        // Our two regions and the server's own (tagged `_hixl_builtin_...`,
        // as a real HIXL server's are).
        assert_eq!(n, 3);
        let list = std::slice::from_raw_parts(mems, 3);
        let regions: Vec<(u64, u64)> = list.iter().map(|m| (m.addr as u64, m.size)).collect();
        assert!(regions.contains(&(far.addr(), 1 << 20)), "{regions:?}");
        assert!(regions.contains(&(far2.addr(), 4096)), "{regions:?}");
        // As HIXL: only tagged regions add a tag, in region order, so the
        // tag list holds two pointers for three regions (reading three
        // would over-read). The untagged region lies below the tagged one
        // of ours, so a list that gave it a tag would be out of step.
        let expected: Vec<&str> = list
            .iter()
            .filter_map(|m| {
                let addr = m.addr as u64;
                if addr == far.addr() || addr == far2.addr() {
                    (addr == far.addr().max(far2.addr())).then_some("far")
                } else {
                    Some("_hixl_builtin_emu_flag")
                }
            })
            .collect();
        assert_eq!(expected.len(), 2);
        let read_tags = |tags: *mut *mut c_char| -> Vec<String> {
            assert!(!tags.is_null());
            std::slice::from_raw_parts(tags, 2)
                .iter()
                .map(|&p| CStr::from_ptr(p).to_string_lossy().into_owned())
                .collect()
        };
        assert_eq!(read_tags(tags), expected);
        // A second call frees the first lists (never read them again) and
        // hands out fresh ones with the same contents.
        let (mut mems2, mut tags2, mut n2) = (null_mut(), null_mut(), 0u32);
        assert_eq!(
            get_remote(client, &mut mems2, &mut tags2, &mut n2, WAIT_MS),
            OK
        );
        assert_eq!(n2, 3);
        let list2 = std::slice::from_raw_parts(mems2, 3);
        let again: Vec<(u64, u64)> = list2.iter().map(|m| (m.addr as u64, m.size)).collect();
        assert_eq!(again, regions);
        assert_eq!(read_tags(tags2), expected);

        let put = h.HixlCSClientBatchPutAsync.as_ref().unwrap();
        let query = h.HixlCSClientQueryCompleteStatus.as_ref().unwrap();
        let mut t = null_mut();
        let one = [op(far.addr(), &near, 0, 64)];
        api.expect_refusal(
            put(client, 0, one.as_ptr(), &mut t),
            PARAM_INVALID,
            "list_num is 0",
        );
        api.expect_refusal(
            put(client, 1, std::ptr::null(), &mut t),
            PARAM_INVALID,
            "desc_list is NULL",
        );

        // Completed frees the handle: querying it again is refused.
        assert_eq!(put(client, 1, one.as_ptr(), &mut t), OK);
        let mut status = sys::HIXL_COMPLETE_STATUS_WAITING;
        while status != sys::HIXL_COMPLETE_STATUS_COMPLETED {
            assert_eq!(query(client, t, &mut status), OK);
            assert!(
                status == sys::HIXL_COMPLETE_STATUS_WAITING
                    || status == sys::HIXL_COMPLETE_STATUS_COMPLETED
            );
        }
        api.expect_refusal(
            query(client, t, &mut status),
            PARAM_INVALID,
            "never query it again",
        );

        // A client on a device endpoint: no limit on ops or on transfers
        // waiting to be queried (HIXL's 4096 counts a host client's
        // unqueried transfers, see below).
        let many: Vec<HixlOneSideOpDesc> = (0..2048)
            .map(|i| op(far.addr() + i * 8, &near, (i * 8) as usize, 8))
            .collect();
        let mut over = many.clone();
        over.extend_from_slice(&many);
        over.push(one[0]);
        let (mut a, mut b, mut c, mut d) = (null_mut(), null_mut(), null_mut(), null_mut());
        assert_eq!(put(client, 2048, many.as_ptr(), &mut a), OK);
        assert_eq!(put(client, 2048, many.as_ptr(), &mut b), OK);
        assert_eq!(put(client, 1, one.as_ptr(), &mut c), OK);
        assert_eq!(put(client, over.len() as u32, over.as_ptr(), &mut d), OK);
        for handle in [a, b, c, d] {
            let mut s = sys::HIXL_COMPLETE_STATUS_WAITING;
            while s != sys::HIXL_COMPLETE_STATUS_COMPLETED {
                assert_eq!(query(client, handle, &mut s), OK);
            }
        }
        let mut landed = vec![0u8; 2048 * 8];
        far.copy_to_host(0, &mut landed).unwrap();
        assert!(landed.iter().all(|&x| x == 0x5a), "every put byte landed");

        // A client on a host endpoint: at most 4096 transfers wait to be
        // queried completed; one more is RESOURCE_EXHAUSTED (not a
        // failure: after a query it goes on).
        let mut host_local = endpoint(1);
        host_local.loc.locType = sys::ENDPOINT_LOC_TYPE_HOST;
        host_local.loc.__bindgen_anon_1 = sys::EndpointLoc__bindgen_ty_1 {
            host: sys::EndpointLoc__bindgen_ty_1__bindgen_ty_2 { id: 0 },
        };
        let hdesc = sys::HixlClientDesc {
            local_endpoint: &host_local,
            ..cdesc
        };
        let mut hclient = null_mut();
        assert_eq!(client_create(&hdesc, &cconf, &mut hclient), OK);
        let hnear = dev.alloc(4096).unwrap();
        hnear.fill(0, hnear.len(), 0x5a).unwrap();
        let mut hid = null_mut();
        assert_eq!(creg(hclient, c"hnear".as_ptr(), &mem(&hnear), &mut hid), OK);
        assert_eq!(connect(hclient, WAIT_MS), OK);
        let (mut hm, mut ht, mut hn) = (null_mut(), null_mut(), 0u32);
        assert_eq!(get_remote(hclient, &mut hm, &mut ht, &mut hn, WAIT_MS), OK);
        let hone = [op(far.addr(), &hnear, 0, 64)];
        let mut pending: Vec<*mut c_void> = (0..4096)
            .map(|_| {
                let mut t = null_mut();
                assert_eq!(put(hclient, 1, hone.as_ptr(), &mut t), OK);
                t
            })
            .collect();
        let mut extra = null_mut();
        api.expect_refusal(
            put(hclient, 1, hone.as_ptr(), &mut extra),
            RESOURCE_EXHAUSTED,
            "query them",
        );
        let first = pending.remove(0);
        let mut s = sys::HIXL_COMPLETE_STATUS_WAITING;
        while s != sys::HIXL_COMPLETE_STATUS_COMPLETED {
            assert_eq!(query(hclient, first, &mut s), OK);
        }
        assert_eq!(put(hclient, 1, hone.as_ptr(), &mut extra), OK);
        pending.push(extra);
        for handle in pending {
            let mut s = sys::HIXL_COMPLETE_STATUS_WAITING;
            while s != sys::HIXL_COMPLETE_STATUS_COMPLETED {
                assert_eq!(query(hclient, handle, &mut s), OK);
            }
        }
        assert_eq!(destroy(hclient), OK);

        // The synchronous calls: put a pattern, get it back elsewhere.
        let pattern: Vec<u8> = (0..4096u32).map(|i| (i * 7 % 256) as u8).collect();
        near.copy_from_host(0, &pattern).unwrap();
        let put_sync = h.HixlCSClientBatchPutSync.as_ref().unwrap();
        let get_sync = h.HixlCSClientBatchGetSync.as_ref().unwrap();
        let up = [op(far2.addr(), &near, 0, 4096)];
        assert_eq!(put_sync(client, 1, up.as_ptr(), WAIT_MS), OK);
        let down = [op(far2.addr(), &near, 8192, 4096)];
        assert_eq!(get_sync(client, 1, down.as_ptr(), WAIT_MS), OK);
        let mut back = vec![0u8; 4096];
        near.copy_to_host(8192, &mut back).unwrap();
        assert_eq!(back, pattern);
        api.expect_refusal(
            get_sync(client, 0, down.as_ptr(), WAIT_MS),
            PARAM_INVALID,
            "list_num is 0",
        );

        assert_eq!((h.HixlCSClientUnregMem.as_ref().unwrap())(client, nid), OK);
        api.expect_refusal(
            (h.HixlCSClientUnregMem.as_ref().unwrap())(client, nid),
            PARAM_INVALID,
            "not a live registration",
        );
        assert_eq!(destroy(client), OK);
        api.expect_refusal(destroy(client), PARAM_INVALID, "not a live HIXL client");
        let unreg = h.HixlCSServerUnregMem.as_ref().unwrap();
        assert_eq!(unreg(server, id), OK);
        assert_eq!(unreg(server, id2), OK);
        assert_eq!((h.HixlCSServerDestroy.as_ref().unwrap())(server), OK);
        api.expect_refusal(
            (h.HixlCSServerDestroy.as_ref().unwrap())(server),
            PARAM_INVALID,
            "not a live HIXL server",
        );
    }
}
