//! The link model seen through the emulator's C API: with
//! `ASCEND_PD_EMU_LINK=a2-roce`, batches issued through `HcclBatchPut` /
//! `HcclBatchGet` show up in `ascend_emu_link_stats` at the table's modeled
//! rates. Both ranks run in this one process (rank 1 on a thread), so the
//! process's link counters see exactly this test's batches. No assertion
//! depends on wall time.

use std::ffi::{c_char, c_int, CStr};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::Duration;

use ascend_emu::link::{Direction, Path, Table, LINK_ENV};
use ascend_sys::{Acl, Comm, OneSidedOp, RootInfo};

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

/// Reads the counters through the symbol of the library the loader mapped
/// (the same file, so the same emulator state).
fn read_stats(lib: &libloading::Library, reset: bool) -> (String, LinkStats) {
    // SAFETY: the emulator exports this symbol with exactly StatsFn's signature.
    let f: libloading::Symbol<StatsFn> = unsafe { lib.get(b"ascend_emu_link_stats\0") }.unwrap();
    let mut s = LinkStats::default();
    // SAFETY: s is a valid, writable LinkStats (layout mirrors the emulator's).
    let rc = unsafe { f(&mut s, c_int::from(reset)) };
    assert_eq!(rc, 0);
    // SAFETY: the emulator leaves the name NUL-terminated within the array.
    let name = unsafe { CStr::from_ptr(s.link.as_ptr()) };
    (name.to_string_lossy().into_owned(), s)
}

/// Rank 1: registers a landing buffer, exchanges, waits until rank 0 is done.
fn rank1(acl: Acl, root: RootInfo, done: mpsc::Receiver<()>) {
    let dev = acl.device(1).unwrap();
    let comm = Comm::init_two_ranks(&dev, &root, 1).unwrap();
    let land = Arc::new(dev.alloc(BUF).unwrap());
    land.fill(0, BUF, 0).unwrap();
    let reg = comm.register_device_buffer(&land).unwrap();
    let remote = comm.exchange_descriptors(&[&reg], 4).unwrap();
    let _access = comm.enable_access(&remote[0]).unwrap();
    done.recv_timeout(WAIT).unwrap();
}

#[test]
fn batches_through_hccl_are_counted_at_the_modeled_link_rate() {
    // Set before the emulator first reads it; this is the binary's only test.
    std::env::set_var(LINK_ENV, "a2-roce");
    let dir = ascend_emu::install_dir().unwrap();
    let acl = Acl::init_from_dir(&dir).unwrap();
    // SAFETY: loads the file the loader already mapped; its initialisers
    // have run, and nothing here unloads it while the emulator is in use.
    let lib = unsafe { libloading::Library::new(acl.library_path()) }.unwrap();

    let dev = acl.device(0).unwrap();
    let root = dev.hccl_root_info().unwrap();
    let (tx, rx) = mpsc::channel();
    let peer = {
        let (acl, root) = (acl.clone(), root.clone());
        std::thread::spawn(move || rank1(acl, root, rx))
    };
    let comm = Comm::init_two_ranks(&dev, &root, 0).unwrap();
    let src = Arc::new(dev.alloc(BUF).unwrap());
    src.fill(0, BUF, 7).unwrap();
    let reg = comm.register_device_buffer(&src).unwrap();
    let remote = comm.exchange_descriptors(&[&reg], 4).unwrap();
    let there = comm.enable_access(&remote[0]).unwrap();
    let stream = dev.create_stream().unwrap();

    let (name, before) = read_stats(&lib, false);
    assert_eq!(name, "a2-roce");
    assert_eq!(before.comm.ops, 0);

    // 64 puts of 128 KiB: the table's 5.7 GB/s.
    let puts: Vec<OneSidedOp> = (0..64u64)
        .map(|i| OneSidedOp {
            local_addr: src.addr() + i * 128 * KIB,
            remote_addr: there.addr() + i * 128 * KIB,
            len: 128 * KIB,
        })
        .collect();
    // SAFETY: both ranges lie in the registered / enabled 8 MiB buffers,
    // which outlive the wait below.
    unsafe { comm.batch_put(&stream, &puts) }
        .unwrap()
        .wait(WAIT)
        .unwrap();
    let (_, s) = read_stats(&lib, false);
    assert_eq!((s.comm.ops, s.comm.bytes), (64, 8 * MIB));
    assert!(close(s.comm.bytes as f64 / s.comm.busy_seconds / 1e9, 5.7));
    assert!(close(s.modeled_end_seconds, s.comm.busy_seconds));
    assert_eq!(s.hixl.ops, 0);

    // Then 4 gets of 2 MiB queue behind them, at 19.8 GB/s.
    let gets: Vec<OneSidedOp> = (0..4u64)
        .map(|i| OneSidedOp {
            local_addr: src.addr() + i * 2 * MIB,
            remote_addr: there.addr() + i * 2 * MIB,
            len: 2 * MIB,
        })
        .collect();
    // SAFETY: as above; nothing reads the local buffer until the wait ends.
    unsafe { comm.batch_get(&stream, &gets) }
        .unwrap()
        .wait(WAIT)
        .unwrap();
    let (_, t) = read_stats(&lib, true);
    let link = Table::builtin().link("a2-roce").unwrap();
    let get_secs = 4.0
        * link
            .op_seconds(Path::Comm, Direction::Read, 2 * MIB)
            .unwrap();
    assert!(close(get_secs, 8.0 * MIB as f64 / 19.8e9));
    assert_eq!((t.comm.ops, t.comm.bytes), (68, 16 * MIB));
    assert!(close(t.comm.busy_seconds, s.comm.busy_seconds + get_secs));
    assert!(close(t.modeled_end_seconds, t.comm.busy_seconds));

    // The read above also reset the counters.
    let (_, z) = read_stats(&lib, false);
    assert_eq!((z.comm.ops, z.comm.bytes), (0, 0));
    assert_eq!(z.modeled_end_seconds, 0.0);

    drop(there);
    tx.send(()).unwrap();
    peer.join().unwrap();
}
