//! The link model seen through HIXL: with `ASCEND_PD_EMU_LINK=a2-roce`,
//! batches issued through `HixlCSClientBatchPutAsync` / `...GetAsync` show
//! up on the `hixl` counters of `ascend_emu_link_stats` at the table's
//! modeled rates (the `comm` counters stay 0). Server and client run in
//! this one process, so its link counters see exactly this test's
//! batches. No assertion depends on wall time.

use std::ffi::{c_char, c_int, CStr};
use std::time::{Duration, Instant};

use ascend_emu::link::{Direction, Path, Table, LINK_ENV};
use ascend_sys::{
    Acl, HixlClient, HixlEndpoint, HixlOp, HixlProtocol, HixlServer, HixlTransfer,
    HixlTransferState, MemKind,
};

const KIB: u64 = 1024;
const MIB: u64 = 1024 * KIB;
const WAIT: Duration = Duration::from_secs(30);
const BUF: usize = 8 << 20;

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct PathStats {
    ops: u64,
    bytes: u64,
    busy_seconds: f64,
}

#[repr(C)]
#[derive(Debug, Clone, Copy, Default)]
struct LinkStats {
    link: [c_char; 32],
    modeled_end_seconds: f64,
    comm: PathStats,
    hixl: PathStats,
}

const _: () = assert!(std::mem::size_of::<LinkStats>() == 88);

type StatsFn = unsafe extern "C" fn(*mut LinkStats, c_int) -> c_int;

fn close(a: f64, b: f64) -> bool {
    (a - b).abs() <= 1e-9 * a.abs().max(b.abs()).max(1.0)
}

/// Reads the counters through the library the loader mapped.
fn read_stats(lib: &libloading::Library, reset: bool) -> (String, LinkStats) {
    // SAFETY: the emulator exports this symbol with exactly StatsFn's signature.
    let f: libloading::Symbol<StatsFn> = unsafe { lib.get(b"ascend_emu_link_stats\0") }.unwrap();
    let mut s = LinkStats::default();
    // SAFETY: s is a valid, writable LinkStats (layout mirrors the emulator's).
    assert_eq!(unsafe { f(&mut s, c_int::from(reset)) }, 0);
    // SAFETY: the emulator leaves the name NUL-terminated within the array.
    let name = unsafe { CStr::from_ptr(s.link.as_ptr()) };
    (name.to_string_lossy().into_owned(), s)
}

fn wait_done(client: &HixlClient, t: HixlTransfer) {
    let deadline = Instant::now() + WAIT;
    let mut t = t;
    loop {
        match client.query(t).unwrap() {
            (HixlTransferState::Completed, None) => return,
            (HixlTransferState::Waiting, Some(back)) => {
                assert!(Instant::now() < deadline, "transfer still waiting");
                t = back;
                std::thread::sleep(Duration::from_millis(1));
            }
            other => panic!("unexpected query answer {other:?}"),
        }
    }
}

#[test]
fn hixl_batches_are_counted_on_the_hixl_path_at_the_modeled_rate() {
    // Set before the emulator first reads it; this is the binary's only test.
    std::env::set_var(LINK_ENV, "a2-roce");
    let dir = ascend_emu::install_dir().unwrap();
    let acl = Acl::init_from_dir(&dir).unwrap();
    // SAFETY: loads the file the loader already mapped; its initialisers
    // have run, and nothing here unloads it while the emulator is in use.
    let lib = unsafe { libloading::Library::new(acl.library_path()) }.unwrap();
    let hixl = acl.hixl().unwrap();
    let dev = acl.device(0).unwrap();
    let ep = HixlEndpoint {
        protocol: HixlProtocol::Roce,
        device_phy_id: 0,
        ipv4: Some(std::net::Ipv4Addr::LOCALHOST),
    };

    let server = HixlServer::create(&hixl, "127.0.0.1", 0, &[ep]).unwrap();
    let far = dev.alloc(BUF).unwrap();
    far.fill(0, BUF, 0).unwrap();
    // SAFETY: `far` outlives the server, which is dropped explicitly at the end.
    let far_id =
        unsafe { server.register("far", MemKind::Device, far.as_ptr().cast(), BUF) }.unwrap();
    server.listen(4).unwrap();

    let client = HixlClient::create(&hixl, "127.0.0.1", server.port().unwrap(), &ep, &ep).unwrap();
    let near = dev.alloc(BUF).unwrap();
    let bytes: Vec<u8> = (0..BUF).map(|i| (i % 251) as u8).collect();
    near.copy_from_host(0, &bytes).unwrap();
    // SAFETY: `near` outlives the client, which is dropped explicitly at the end.
    let near_id =
        unsafe { client.register("near", MemKind::Device, near.as_ptr().cast(), BUF) }.unwrap();
    client.connect(WAIT).unwrap();
    // SAFETY: the server is a HixlServer, which tags every region.
    let remote = unsafe { client.remote_mems_tagged(WAIT) }.unwrap();
    assert_eq!(remote.len(), 1, "{remote:?}");
    let there = remote[0].addr;

    let (name, before) = read_stats(&lib, false);
    assert_eq!(name, "a2-roce");
    assert_eq!((before.hixl.ops, before.comm.ops), (0, 0));

    // 64 puts of 128 KiB: the table's 23.5 GB/s for HIXL on A2 RoCE.
    let puts: Vec<HixlOp> = (0..64u64)
        .map(|i| HixlOp {
            remote: there + i * 128 * KIB,
            local: near
                .as_ptr()
                .cast::<u8>()
                .wrapping_add((i * 128 * KIB) as usize),
            len: 128 * KIB,
        })
        .collect();
    // SAFETY: all ranges lie in the registered 8 MiB buffers, which outlive
    // the wait below.
    let t = unsafe { client.put_async(&puts) }.unwrap();
    wait_done(&client, t);
    let (_, s) = read_stats(&lib, false);
    assert_eq!((s.hixl.ops, s.hixl.bytes), (64, 8 * MIB));
    assert!(
        close(s.hixl.bytes as f64 / s.hixl.busy_seconds / 1e9, 23.5),
        "{s:?}"
    );
    assert!(close(s.modeled_end_seconds, s.hixl.busy_seconds));
    assert_eq!((s.comm.ops, s.comm.bytes), (0, 0));
    let mut landed = vec![0u8; BUF];
    far.copy_to_host(0, &mut landed).unwrap();
    assert!(landed == bytes, "every put byte landed");

    // Then 4 gets of 2 MiB back into the client, at 23.7 GB/s.
    near.fill(0, BUF, 0).unwrap();
    let gets: Vec<HixlOp> = (0..4u64)
        .map(|i| HixlOp {
            remote: there + i * 2 * MIB,
            local: near
                .as_ptr()
                .cast::<u8>()
                .wrapping_add((i * 2 * MIB) as usize),
            len: 2 * MIB,
        })
        .collect();
    // SAFETY: as above; nothing reads `near` until the transfer completed.
    let t = unsafe { client.get_async(&gets) }.unwrap();
    wait_done(&client, t);
    let (_, g) = read_stats(&lib, true);
    let link = Table::builtin().link("a2-roce").unwrap();
    let get_secs = 4.0
        * link
            .op_seconds(Path::Hixl, Direction::Read, 2 * MIB)
            .unwrap();
    assert!(close(get_secs, 8.0 * MIB as f64 / 23.7e9));
    assert_eq!((g.hixl.ops, g.hixl.bytes), (68, 16 * MIB));
    assert!(close(g.hixl.busy_seconds, s.hixl.busy_seconds + get_secs));
    assert!(close(g.modeled_end_seconds, g.hixl.busy_seconds));
    let mut back = vec![0u8; BUF];
    near.copy_to_host(0, &mut back).unwrap();
    assert!(back == bytes, "every got byte came back");

    // The read above also reset the counters.
    let (_, z) = read_stats(&lib, false);
    assert_eq!((z.hixl.ops, z.hixl.bytes), (0, 0));

    client.unregister(near_id).unwrap();
    drop(client);
    server.unregister(far_id).unwrap();
    drop(server);
}
