//! HCCL between two real processes on the emulator: root-info rendezvous,
//! registration of device and host memory, descriptor exchange, batch
//! put/get of many descriptors both ways, and refusal of out-of-range access.
//!
//! The parent test is rank 0; it re-runs this test binary as rank 1 (the
//! ignored `rank1_child` test), handing over the root info in the
//! environment. Every wait has a deadline.

mod common;

use std::io::Read;
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

use ascend_sys::{Comm, Error, MemKind, OneSidedOp, RootInfo};
use common::{emulator, pattern};

const ROLE_ENV: &str = "ASCEND_SYS_TEST_RANK1_ROOT_INFO";
const WAIT: Duration = Duration::from_secs(30);

const DEV_LEN: usize = 1 << 20; // [0, half) source, [half, len) landing for the peer's puts
const HOST_LEN: usize = 512 << 10; // [0, half) source, [half, len) landing for my gets
const LAND_LEN: usize = 512 << 10; // device: [0, half) peer's host puts, [half, len) my gets
const CHUNK: usize = 4096;

fn seed(rank: u32, what: u64) -> u64 {
    u64::from(rank) * 1000 + what
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Vec<u8> {
    (0..s.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap())
        .collect()
}

/// Where chunk `i` of a scattered transfer of `n` chunks lands.
fn scatter(i: usize, n: usize) -> usize {
    (i * 37 + 11) % n
}

fn hccl_code(err: &Error) -> u32 {
    match err {
        Error::Hccl { code, .. } => *code,
        other => panic!("expected an HCCL error, got {other:?}"),
    }
}

/// Runs one rank end to end; both processes run the same steps.
fn run_rank(rank: u32, root: &RootInfo) {
    let peer = 1 - rank;
    let dev = emulator().device(rank).unwrap();
    let comm = Comm::init_two_ranks(&dev, root, rank).unwrap();
    assert_eq!((comm.rank(), comm.peer_rank()), (rank, peer));
    let stream = dev.create_stream().unwrap();

    let devbuf = Arc::new(dev.alloc(DEV_LEN).unwrap());
    devbuf
        .copy_from_host(0, &pattern(seed(rank, 1), DEV_LEN / 2))
        .unwrap();
    devbuf.fill(DEV_LEN / 2, DEV_LEN / 2, 0).unwrap();
    let mut host = dev.alloc_host(HOST_LEN).unwrap();
    host.as_mut_slice()[..HOST_LEN / 2].copy_from_slice(&pattern(seed(rank, 2), HOST_LEN / 2));
    let host = Arc::new(host);
    let land = Arc::new(dev.alloc(LAND_LEN).unwrap());
    land.fill(0, LAND_LEN, 0).unwrap();

    let regs = [
        comm.register_device_buffer(&devbuf).unwrap(),
        comm.register_host_buffer(&host).unwrap(),
        comm.register_device_buffer(&land).unwrap(),
    ];
    assert_eq!(regs[1].kind(), MemKind::Host);
    let remote_descs = comm
        .exchange_descriptors(&regs.iter().collect::<Vec<_>>(), 8)
        .unwrap();
    assert_eq!(remote_descs.len(), 3);
    let remote: Vec<_> = remote_descs
        .iter()
        .map(|d| comm.enable_access(d).unwrap())
        .collect();
    let (r_dev, r_host, r_land) = (&remote[0], &remote[1], &remote[2]);
    assert_eq!(
        (r_dev.kind(), r_dev.len()),
        (MemKind::Device, DEV_LEN as u64)
    );
    assert_eq!(
        (r_host.kind(), r_host.len()),
        (MemKind::Host, HOST_LEN as u64)
    );
    assert_eq!(r_land.len(), LAND_LEN as u64);

    // Put: my device source, scattered chunk by chunk into the peer's landing half.
    let n = DEV_LEN / 2 / CHUNK;
    let dev_puts: Vec<OneSidedOp> = (0..n)
        .map(|i| OneSidedOp {
            local_addr: devbuf.addr() + (i * CHUNK) as u64,
            remote_addr: r_dev.addr() + (DEV_LEN / 2 + scatter(i, n) * CHUNK) as u64,
            len: CHUNK as u64,
        })
        .collect();
    // Put: my host source into the first half of the peer's device landing buffer.
    let host_puts: Vec<OneSidedOp> = (0..HOST_LEN / 2 / CHUNK)
        .map(|i| OneSidedOp {
            local_addr: host.addr() + (i * CHUNK) as u64,
            remote_addr: r_land.addr() + (i * CHUNK) as u64,
            len: CHUNK as u64,
        })
        .collect();
    // Get: the peer's host source into my host landing half (uneven sizes).
    let mut host_gets = Vec::new();
    let mut off = 0usize;
    while off < HOST_LEN / 2 {
        let len = (1000 + off % 3000).min(HOST_LEN / 2 - off);
        host_gets.push(OneSidedOp {
            local_addr: host.addr() + (HOST_LEN / 2 + off) as u64,
            remote_addr: r_host.addr() + off as u64,
            len: len as u64,
        });
        off += len;
    }
    // Get: the peer's device source into the second half of my landing buffer.
    let dev_gets: Vec<OneSidedOp> = (0..LAND_LEN / 2 / CHUNK)
        .map(|i| OneSidedOp {
            local_addr: land.addr() + (LAND_LEN / 2 + i * CHUNK) as u64,
            remote_addr: r_dev.addr() + (i * CHUNK) as u64,
            len: CHUNK as u64,
        })
        .collect();
    assert!(dev_puts.len() + host_puts.len() + host_gets.len() + dev_gets.len() > 300);

    // SAFETY: all local ranges are inside registered buffers and all remote
    // ranges inside enabled regions; the registrations, regions and buffers
    // outlive the completions waited on below, and the host landing half is
    // read only after they complete.
    let completions = unsafe {
        [
            comm.batch_put(&stream, &dev_puts).unwrap(),
            comm.batch_put(&stream, &host_puts).unwrap(),
            comm.batch_get(&stream, &host_gets).unwrap(),
            comm.batch_get(&stream, &dev_gets).unwrap(),
        ]
    };
    for c in &completions {
        c.wait(WAIT).unwrap();
    }
    // Barrier: after it, the peer's puts into my memory have completed too.
    assert!(comm.exchange_descriptors(&[], 0).unwrap().is_empty());

    let peer_dev = pattern(seed(peer, 1), DEV_LEN / 2);
    let peer_host = pattern(seed(peer, 2), HOST_LEN / 2);
    let mut got = vec![0u8; DEV_LEN / 2];
    devbuf.copy_to_host(DEV_LEN / 2, &mut got).unwrap();
    for i in 0..n {
        let at = scatter(i, n) * CHUNK;
        assert_eq!(
            &got[at..at + CHUNK],
            &peer_dev[i * CHUNK..(i + 1) * CHUNK],
            "put chunk {i}"
        );
    }
    let mut landed = vec![0u8; LAND_LEN];
    land.copy_to_host(0, &mut landed).unwrap();
    assert_eq!(
        &landed[..LAND_LEN / 2],
        &peer_host[..],
        "host-to-device puts"
    );
    assert_eq!(
        &landed[LAND_LEN / 2..],
        &peer_dev[..LAND_LEN / 2],
        "device gets"
    );
    assert_eq!(
        &host.as_slice()[HOST_LEN / 2..],
        &peer_host[..],
        "host gets"
    );
    assert_eq!(
        &host.as_slice()[..HOST_LEN / 2],
        &pattern(seed(rank, 2), HOST_LEN / 2)[..],
        "sources untouched"
    );

    // Both sides have checked their memory; the peer's may be written again.
    assert!(comm.exchange_descriptors(&[], 0).unwrap().is_empty());
    op_limit_steps(&comm, &stream, &devbuf, &land, r_dev, rank);

    // Out of range: one byte past the peer's device region.
    let past_end = [OneSidedOp {
        local_addr: devbuf.addr(),
        remote_addr: r_dev.addr() + DEV_LEN as u64 - 8,
        len: 16,
    }];
    // SAFETY: the call is refused before any transfer is queued.
    let err = unsafe { comm.batch_put(&stream, &past_end) }.unwrap_err();
    assert_eq!(hccl_code(&err), 1);
    assert!(
        err.to_string().contains("outside every region of rank"),
        "{err}"
    );

    // Local memory that is not registered.
    let stray = dev.alloc(CHUNK).unwrap();
    let unregistered = [OneSidedOp {
        local_addr: stray.addr(),
        remote_addr: r_dev.addr(),
        len: CHUNK as u64,
    }];
    // SAFETY: refused before any transfer is queued.
    let err = unsafe { comm.batch_get(&stream, &unregistered) }.unwrap_err();
    assert_eq!(hccl_code(&err), 1);
    assert!(
        err.to_string().contains("not inside memory registered"),
        "{err}"
    );

    // A region whose access was disabled is out of reach again.
    let host_addr = r_host.addr();
    drop(remote);
    let after_disable = [OneSidedOp {
        local_addr: host.addr() + (HOST_LEN / 2) as u64,
        remote_addr: host_addr,
        len: 64,
    }];
    // SAFETY: refused before any transfer is queued.
    let err = unsafe { comm.batch_get(&stream, &after_disable) }.unwrap_err();
    assert_eq!(hccl_code(&err), 1, "{err}");

    // A batch with no failures queued nothing out of order: the stream is clean.
    stream.synchronize().unwrap();
    registration_limit_step(&comm, &dev);
    // Final barrier so neither side tears down while the other still checks.
    assert!(comm.exchange_descriptors(&[], 0).unwrap().is_empty());
}

/// Batches above the runtime's per-call op limit: split and delivered byte
/// for byte; unsplit, refused with the runtime's code; split with a later
/// call refused, reported by the completion after the queued part ran.
fn op_limit_steps(
    comm: &Comm,
    stream: &ascend_sys::Stream,
    devbuf: &Arc<ascend_sys::DeviceBuffer>,
    land: &Arc<ascend_sys::DeviceBuffer>,
    r_dev: &ascend_sys::RemoteMem,
    rank: u32,
) {
    const SMALL: usize = 512;
    // The emulator reports an Atlas A2 SoC: 256 ops per call, as CANN 8.5.
    assert_eq!(comm.batch_op_limit(), ascend_sys::BATCH_OP_LIMIT);
    let n = 300;
    assert!(n > comm.batch_op_limit());
    // Put 300 small ops of my device source into the peer's landing half,
    // in reverse order; get 600 of the peer's source into my landing buffer.
    let puts: Vec<OneSidedOp> = (0..n)
        .map(|i| OneSidedOp {
            local_addr: devbuf.addr() + (i * SMALL) as u64,
            remote_addr: r_dev.addr() + (DEV_LEN / 2 + (n - 1 - i) * SMALL) as u64,
            len: SMALL as u64,
        })
        .collect();
    let m = 600;
    let gets: Vec<OneSidedOp> = (0..m)
        .map(|i| OneSidedOp {
            local_addr: land.addr() + (i * SMALL) as u64,
            remote_addr: r_dev.addr() + (i * SMALL) as u64,
            len: SMALL as u64,
        })
        .collect();
    // SAFETY: every range is inside registered / enabled memory that outlives
    // the completions, which are waited on before anything is read.
    let done = unsafe {
        [
            comm.batch_put(stream, &puts).unwrap(),
            comm.batch_get(stream, &gets).unwrap(),
        ]
    };
    for d in &done {
        d.wait(WAIT).unwrap();
    }
    assert!(comm.exchange_descriptors(&[], 0).unwrap().is_empty());
    let peer_src = pattern(seed(1 - rank, 1), DEV_LEN / 2);
    let mut got = vec![0u8; n * SMALL];
    devbuf.copy_to_host(DEV_LEN / 2, &mut got).unwrap();
    for i in 0..n {
        let at = (n - 1 - i) * SMALL;
        assert_eq!(
            &got[at..at + SMALL],
            &peer_src[i * SMALL..(i + 1) * SMALL],
            "split put, op {i}"
        );
    }
    let mut got = vec![0u8; m * SMALL];
    land.copy_to_host(0, &mut got).unwrap();
    assert_eq!(&got[..], &peer_src[..m * SMALL], "split get");

    // Unsplit (limit raised past the runtime's): the runtime refuses the
    // whole call with HCCL_E_PARA, and nothing is queued.
    comm.set_batch_op_limit(1000);
    // SAFETY: refused before any transfer is queued.
    let err = unsafe { comm.batch_put(stream, &puts) }.unwrap_err();
    assert_eq!(hccl_code(&err), 1, "{err}");
    assert!(err.to_string().contains("exceeds the 256 ops"), "{err}");

    // Split in calls of 100, the second call refused (its last op runs past
    // the peer's region): the first 100 ops ran; the completion says so.
    comm.set_batch_op_limit(100);
    let mut bad = puts[..150].to_vec();
    bad[149].remote_addr = r_dev.addr() + DEV_LEN as u64 - 8;
    // SAFETY: the valid ops are as above; the invalid one is refused by the
    // runtime before its call queues anything.
    let done = unsafe { comm.batch_put(stream, &bad) }.unwrap();
    match done.wait(WAIT).unwrap_err() {
        Error::BatchPartlyQueued {
            call,
            queued,
            total,
            cause,
        } => {
            assert_eq!((call, queued, total), ("HcclBatchPut", 100, 150));
            assert!(cause.contains("outside every region"), "{cause}");
        }
        other => panic!("expected a partly queued batch, got {other:?}"),
    }
    assert!(done.is_complete().unwrap());
    comm.set_batch_op_limit(ascend_sys::BATCH_OP_LIMIT);
    assert!(comm.exchange_descriptors(&[], 0).unwrap().is_empty());
}

/// The 257th registration on one communicator is refused, naming the limit;
/// dropping registrations makes room again.
fn registration_limit_step(comm: &Comm, dev: &ascend_sys::Device) {
    let before = comm.registrations();
    let mut extra = Vec::new();
    while comm.registrations() < ascend_sys::REGISTRATION_LIMIT {
        let b = Arc::new(dev.alloc(CHUNK).unwrap());
        extra.push(comm.register_device_buffer(&b).unwrap());
    }
    let b = Arc::new(dev.alloc(CHUNK).unwrap());
    let err = comm.register_device_buffer(&b).unwrap_err();
    match &err {
        Error::Limit { asked, limit, .. } => assert_eq!((*asked, *limit), (257, 256)),
        other => panic!("expected the registration limit, got {other:?}"),
    }
    assert!(err.to_string().contains("HCCL_E_UNAVAIL"), "{err}");
    drop(extra);
    assert_eq!(comm.registrations(), before);
    drop(comm.register_device_buffer(&b).unwrap());
}

#[test]
#[ignore = "rank 1 of hccl_between_two_processes; started by that test"]
fn rank1_child() {
    let root = std::env::var(ROLE_ENV).expect("started by hccl_between_two_processes");
    let root = RootInfo::from_bytes(&unhex(&root)).unwrap();
    run_rank(1, &root);
}

#[test]
fn hccl_between_two_processes() {
    let dev = emulator().device(0).unwrap();
    let root = dev.hccl_root_info().unwrap();
    assert_eq!(root.as_bytes().len(), 4108);

    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([
            "--exact",
            "rank1_child",
            "--include-ignored",
            "--nocapture",
            "--test-threads=1",
        ])
        .env(ROLE_ENV, hex(root.as_bytes()))
        .env("HCCL_CONNECT_TIMEOUT", "30")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let mut out = child.stdout.take().unwrap();
    let mut err = child.stderr.take().unwrap();
    let collect = std::thread::spawn(move || {
        let mut text = String::new();
        let _ = out.read_to_string(&mut text);
        let _ = err.read_to_string(&mut text);
        text
    });

    let me = std::thread::spawn(move || run_rank(0, &root));
    let deadline = Instant::now() + Duration::from_secs(90);
    let mut child_status = None;
    let mut rank0_done_at: Option<Instant> = None;
    let failure = loop {
        if child_status.is_none() {
            child_status = child.try_wait().unwrap();
        }
        match child_status {
            Some(status) if !status.success() => break Some(format!("rank 1 failed ({status})")),
            Some(_) if me.is_finished() => break None,
            _ => {}
        }
        if me.is_finished() && child_status.is_none() {
            // Rank 0 is done (or failed); rank 1 gets a short grace period.
            let since = *rank0_done_at.get_or_insert_with(Instant::now);
            if since.elapsed() > Duration::from_secs(10) {
                break Some("rank 1 did not finish after rank 0 did".to_string());
            }
        }
        if Instant::now() >= deadline {
            break Some("two-process test timed out".to_string());
        }
        std::thread::sleep(Duration::from_millis(10));
    };
    if child_status.is_none() {
        let _ = child.kill();
    }
    let _ = child.wait();
    if me.is_finished() {
        if let Err(panic) = me.join() {
            eprintln!("rank 1 output:\n{}", collect.join().unwrap());
            std::panic::resume_unwind(panic);
        }
    }
    if let Some(failure) = failure {
        panic!("{failure}; rank 1 output:\n{}", collect.join().unwrap());
    }
    let log = collect.join().unwrap();
    assert!(
        log.contains("test rank1_child ... ok"),
        "rank 1 must have run its checks:\n{log}"
    );
}
