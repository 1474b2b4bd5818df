//! HIXL client/server between two real processes on the emulator, through
//! the real loader: the server (a child: this test binary re-run as the
//! ignored `hixl_server_child` test) registers device and host memory and
//! listens on an ephemeral loopback port; the client (this process)
//! registers its own memory, connects, fetches the server's regions and
//! moves bytes both ways, every byte checked on both sides. Then the
//! rules: registration order, whole-batch refusal that leaves memory
//! untouched, and a dead server failing the client cleanly.
//!
//! The processes talk over the child's stdin / stdout (`HIXL-` lines).
//! Every wait has a deadline.

mod common;

use std::io::{BufRead, BufReader, Write};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

use ascend_sys::{
    Error, HixlClient, HixlEndpoint, HixlOp, HixlProtocol, HixlServer, HixlTransfer,
    HixlTransferState, MemKind, HIXL_LIBRARY,
};
use common::{emulator, pattern};

const ROLE_ENV: &str = "ASCEND_SYS_TEST_HIXL_SERVER";
const WAIT: Duration = Duration::from_secs(30);

const PARAM_INVALID: u32 = 103_900;
const FAILED: u32 = 503_900;

/// Server device buffer: [0, half) source for the client's gets, [half,
/// len) landing for its puts.
const SRV_DEV: usize = 1 << 20;
/// Server host buffer: all source for the client's gets.
const SRV_HOST: usize = 256 << 10;
const CHUNK: usize = 4096;
/// Client buffers: device source for puts, device landing for gets, host
/// landing for gets.
const CLI_SRC: usize = SRV_DEV / 2;
const CLI_LAND: usize = SRV_DEV / 2;
const CLI_HOST: usize = SRV_HOST;

const SEED_SRV_DEV: u64 = 11;
const SEED_SRV_HOST: u64 = 12;
const SEED_CLI_SRC: u64 = 21;
/// Byte the client's landing buffers start with (never in a pattern run
/// long enough to fake a match).
const SENTINEL: u8 = 0xee;

fn endpoint(device_phy_id: u32) -> HixlEndpoint {
    HixlEndpoint {
        protocol: HixlProtocol::Roce,
        device_phy_id,
        ipv4: Some(std::net::Ipv4Addr::LOCALHOST),
    }
}

/// Where the client's put chunk `i` of `n` lands in the server's landing half.
fn scatter(i: usize, n: usize) -> usize {
    (i * 37 + 11) % n
}

fn hixl_code(err: &Error) -> u32 {
    err.hixl_status()
        .unwrap_or_else(|| panic!("expected a HIXL error, got {err:?}"))
}

/// Polls a transfer until HIXL reports it completed.
fn wait_done(client: &HixlClient, t: HixlTransfer) {
    let deadline = Instant::now() + WAIT;
    let mut t = t;
    loop {
        match client.query(t).unwrap() {
            (HixlTransferState::Completed, None) => return,
            (HixlTransferState::Waiting, Some(back)) => {
                assert!(
                    Instant::now() < deadline,
                    "transfer still waiting after {WAIT:?}"
                );
                t = back;
                std::thread::sleep(Duration::from_millis(1));
            }
            other => panic!("unexpected query answer {other:?}"),
        }
    }
}

// ------------------------------------------------------------ server (child)

#[test]
#[ignore = "the server of hixl_between_two_processes; started by that test"]
fn hixl_server_child() {
    if std::env::var_os(ROLE_ENV).is_none() {
        panic!("started by hixl_between_two_processes only");
    }
    let acl = emulator();
    let dev = acl.device(0).unwrap();
    let hixl = acl.hixl().unwrap();
    let server = HixlServer::create(&hixl, "127.0.0.1", 0, &[endpoint(0)]).unwrap();
    let devbuf = dev.alloc(SRV_DEV).unwrap();
    devbuf
        .copy_from_host(0, &pattern(SEED_SRV_DEV, SRV_DEV / 2))
        .unwrap();
    devbuf.fill(SRV_DEV / 2, SRV_DEV / 2, 0).unwrap();
    let mut host = dev.alloc_host(SRV_HOST).unwrap();
    host.as_mut_slice()
        .copy_from_slice(&pattern(SEED_SRV_HOST, SRV_HOST));
    // SAFETY: both buffers live until the end of this function, after the
    // server is dropped.
    let ids = unsafe {
        [
            server
                .register("srv-dev", MemKind::Device, devbuf.as_ptr().cast(), SRV_DEV)
                .unwrap(),
            server
                .register("srv-host", MemKind::Host, host.as_ptr().cast(), SRV_HOST)
                .unwrap(),
        ]
    };
    // An empty tag is refused before HIXL sees it.
    // SAFETY: refused; nothing keeps the address.
    let err =
        unsafe { server.register("", MemKind::Host, host.as_ptr().cast(), SRV_HOST) }.unwrap_err();
    assert!(err.to_string().contains("non-empty tag"), "{err}");
    // The port is the emulator's to pick (port 0) and known after listen.
    assert!(server.port().is_err(), "no port before listen");
    server.listen(16).unwrap();
    // Registering after listen is refused, naming the rule.
    let late = dev.alloc(CHUNK).unwrap();
    // SAFETY: refused; nothing keeps the address.
    let err = unsafe { server.register("late", MemKind::Device, late.as_ptr().cast(), CHUNK) }
        .unwrap_err();
    assert_eq!(hixl_code(&err), PARAM_INVALID);
    assert!(
        err.to_string().contains("before HixlCSServerListen"),
        "{err}"
    );
    println!("HIXL-PORT {}", server.port().unwrap());

    for line in std::io::stdin().lock().lines() {
        match line.unwrap().trim() {
            "check" => {
                let n = CLI_SRC / CHUNK;
                let sent = pattern(SEED_CLI_SRC, CLI_SRC);
                let mut got = vec![0u8; SRV_DEV / 2];
                devbuf.copy_to_host(SRV_DEV / 2, &mut got).unwrap();
                let bad = (0..n).find(|&i| {
                    let at = scatter(i, n) * CHUNK;
                    got[at..at + CHUNK] != sent[i * CHUNK..(i + 1) * CHUNK]
                });
                let mut src = vec![0u8; SRV_DEV / 2];
                devbuf.copy_to_host(0, &mut src).unwrap();
                let sources_kept = src == pattern(SEED_SRV_DEV, SRV_DEV / 2)
                    && host.as_slice() == &pattern(SEED_SRV_HOST, SRV_HOST)[..];
                match (bad, sources_kept) {
                    (None, true) => println!("HIXL-CHECK ok"),
                    (Some(i), _) => println!("HIXL-CHECK bad put chunk {i}"),
                    (None, false) => println!("HIXL-CHECK bad: a source was written"),
                }
            }
            "exit" => break,
            _ => {}
        }
    }
    for id in ids {
        server.unregister(id).unwrap();
    }
    drop(server);
    println!("HIXL-EXIT ok");
}

// ------------------------------------------------------------ client (parent)

struct ServerProcess {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    /// Everything the child printed, for failure messages.
    log: std::sync::Arc<std::sync::Mutex<String>>,
}

impl ServerProcess {
    fn start() -> ServerProcess {
        let mut child = Command::new(std::env::current_exe().unwrap())
            .args([
                "--exact",
                "hixl_server_child",
                "--include-ignored",
                "--nocapture",
                "--test-threads=1",
            ])
            .env(ROLE_ENV, "1")
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let stdin = child.stdin.take().unwrap();
        let log = std::sync::Arc::new(std::sync::Mutex::new(String::new()));
        let (tx, lines) = mpsc::channel();
        let out = child.stdout.take().unwrap();
        let keep = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(out).lines().map_while(Result::ok) {
                keep.lock().unwrap().push_str(&format!("{line}\n"));
                // The harness may print "test ... " in front on the same line.
                if let Some(at) = line.find("HIXL-") {
                    if tx.send(line[at..].to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let err = child.stderr.take().unwrap();
        let keep = log.clone();
        std::thread::spawn(move || {
            for line in BufReader::new(err).lines().map_while(Result::ok) {
                keep.lock().unwrap().push_str(&format!("{line}\n"));
            }
        });
        ServerProcess {
            child,
            stdin,
            lines,
            log,
        }
    }

    /// The next `HIXL-` line, or a failure with the child's output.
    fn expect(&self, prefix: &str) -> String {
        match self.lines.recv_timeout(WAIT) {
            Ok(line) if line.starts_with(prefix) => line[prefix.len()..].trim().to_string(),
            other => panic!(
                "expected {prefix} from the server, got {other:?}; its output:\n{}",
                self.log.lock().unwrap()
            ),
        }
    }

    fn say(&mut self, what: &str) {
        writeln!(self.stdin, "{what}").unwrap();
        self.stdin.flush().unwrap();
    }
}

impl Drop for ServerProcess {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

#[test]
fn hixl_between_two_processes() {
    let acl = emulator();
    let dev = acl.device(1).unwrap();
    let hixl = acl.hixl().unwrap();
    assert!(hixl.is_emulator());
    assert_eq!(
        hixl.library_path().file_name().unwrap().to_str(),
        Some(HIXL_LIBRARY)
    );
    assert_eq!(acl.hixl_library_path(), Some(hixl.library_path()));

    let mut server = ServerProcess::start();
    let port: u16 = server.expect("HIXL-PORT").parse().unwrap();

    let client = HixlClient::create(&hixl, "127.0.0.1", port, &endpoint(1), &endpoint(0)).unwrap();
    let src = dev.alloc(CLI_SRC).unwrap();
    src.copy_from_host(0, &pattern(SEED_CLI_SRC, CLI_SRC))
        .unwrap();
    let land = dev.alloc(CLI_LAND).unwrap();
    land.fill(0, CLI_LAND, SENTINEL).unwrap();
    let mut host = dev.alloc_host(CLI_HOST).unwrap();
    host.as_mut_slice().fill(SENTINEL);

    // Only emulator-allocated memory is registrable.
    let mut plain = vec![0u8; CHUNK];
    // SAFETY: refused; nothing keeps the address.
    let err =
        unsafe { client.register("heap", MemKind::Host, plain.as_mut_ptr(), CHUNK) }.unwrap_err();
    assert_eq!(hixl_code(&err), PARAM_INVALID);
    assert!(
        err.to_string().contains("not memory from aclrtMalloc"),
        "{err}"
    );
    // An empty tag is refused before HIXL sees it.
    // SAFETY: refused; nothing keeps the address.
    let err =
        unsafe { client.register("", MemKind::Device, src.as_ptr().cast(), CLI_SRC) }.unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(err.to_string().contains("non-empty tag"), "{err}");
    // SAFETY: the buffers outlive the client (dropped at the end of the test).
    let ids = unsafe {
        [
            client
                .register("cli-src", MemKind::Device, src.as_ptr().cast(), CLI_SRC)
                .unwrap(),
            client
                .register("cli-land", MemKind::Device, land.as_ptr().cast(), CLI_LAND)
                .unwrap(),
            client
                .register("cli-host", MemKind::Host, host.as_ptr().cast(), CLI_HOST)
                .unwrap(),
        ]
    };
    client.connect(WAIT).unwrap();
    // Registering after connect is refused, naming the rule.
    let late = dev.alloc(CHUNK).unwrap();
    // SAFETY: refused; nothing keeps the address.
    let err = unsafe { client.register("late", MemKind::Device, late.as_ptr().cast(), CHUNK) }
        .unwrap_err();
    assert_eq!(hixl_code(&err), PARAM_INVALID);
    assert!(
        err.to_string().contains("before HixlCSClientConnect"),
        "{err}"
    );
    // No transfer before the remote memory was fetched.
    let early = [HixlOp {
        remote: 0x1000,
        local: src.as_ptr().cast(),
        len: 1,
    }];
    // SAFETY: refused before anything moves.
    let err = unsafe { client.put_async(&early) }.unwrap_err();
    assert_eq!(hixl_code(&err), PARAM_INVALID);
    assert!(
        err.to_string().contains("HixlCSClientGetRemoteMem"),
        "{err}"
    );

    // SAFETY: the server is a HixlServer, which tags every region.
    let mut remote = unsafe { client.remote_mems_tagged(WAIT) }.unwrap();
    remote.sort_by(|a, b| a.tag.cmp(&b.tag));
    // The safe form lists the same regions, and the server's own one (the
    // emulator registers one, as HIXL does): with several regions and a
    // tag list HIXL does not give the length of, it reads no tag, so it
    // cannot tell the server's own region apart.
    let plain = client.remote_mems(WAIT).unwrap();
    assert_eq!(plain.len(), remote.len() + 1, "{plain:?}");
    assert!(plain.iter().all(|m| m.tag.is_empty()), "{plain:?}");
    for r in &remote {
        assert!(
            plain
                .iter()
                .any(|m| (m.addr, m.len, m.kind) == (r.addr, r.len, r.kind)),
            "{r:?} missing from {plain:?}"
        );
    }
    assert_eq!(remote.len(), 2, "{remote:?}");
    let (r_dev, r_host) = (&remote[0], &remote[1]);
    assert_eq!(
        (r_dev.tag.as_str(), r_dev.kind, r_dev.len),
        ("srv-dev", MemKind::Device, SRV_DEV as u64)
    );
    assert_eq!(
        (r_host.tag.as_str(), r_host.kind, r_host.len),
        ("srv-host", MemKind::Host, SRV_HOST as u64)
    );

    // Put: the client's device source, chunk by chunk, scattered into the
    // server's landing half.
    let n = CLI_SRC / CHUNK;
    let puts: Vec<HixlOp> = (0..n)
        .map(|i| HixlOp {
            remote: r_dev.addr + (SRV_DEV / 2 + scatter(i, n) * CHUNK) as u64,
            // SAFETY (address arithmetic only): inside the source buffer.
            local: src.as_ptr().cast::<u8>().wrapping_add(i * CHUNK),
            len: CHUNK as u64,
        })
        .collect();
    // Get: the server's device source into the client's landing buffer,
    // chunks in reverse order.
    let m = CLI_LAND / CHUNK;
    let dev_gets: Vec<HixlOp> = (0..m)
        .map(|i| HixlOp {
            remote: r_dev.addr + (i * CHUNK) as u64,
            local: land.as_ptr().cast::<u8>().wrapping_add((m - 1 - i) * CHUNK),
            len: CHUNK as u64,
        })
        .collect();
    // Get: the server's host memory into the client's host buffer, uneven sizes.
    let mut host_gets = Vec::new();
    let mut off = 0usize;
    while off < SRV_HOST {
        let len = (1000 + off % 3000).min(SRV_HOST - off);
        host_gets.push(HixlOp {
            remote: r_host.addr + off as u64,
            local: host.as_ptr().cast::<u8>().wrapping_add(off),
            len: len as u64,
        });
        off += len;
    }
    assert!(puts.len() + dev_gets.len() + host_gets.len() > 300);
    // SAFETY: every local range is in registered client memory, every remote
    // range in a region the server registered; the local buffers are read
    // only after the transfers completed, and outlive the client.
    let transfers = unsafe {
        [
            client.put_async(&puts).unwrap(),
            client.get_async(&dev_gets).unwrap(),
            client.get_async(&host_gets).unwrap(),
        ]
    };
    // Fetching the remote regions again is refused while a transfer has
    // not been queried completed (HIXL re-imports the memory under it)...
    let err = client.remote_mems(WAIT).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(err.to_string().contains("queried completed"), "{err}");
    for t in transfers {
        wait_done(&client, t);
    }
    // ... and allowed again once every one has.
    // SAFETY: the server is a HixlServer, which tags every region.
    let mut again = unsafe { client.remote_mems_tagged(WAIT) }.unwrap();
    again.sort_by(|a, b| a.tag.cmp(&b.tag));
    assert_eq!(again, remote);
    let srv_dev = pattern(SEED_SRV_DEV, SRV_DEV / 2);
    let mut got = vec![0u8; CLI_LAND];
    land.copy_to_host(0, &mut got).unwrap();
    for i in 0..m {
        let at = (m - 1 - i) * CHUNK;
        assert_eq!(
            &got[at..at + CHUNK],
            &srv_dev[i * CHUNK..(i + 1) * CHUNK],
            "device get, op {i}"
        );
    }
    assert!(
        host.as_slice() == &pattern(SEED_SRV_HOST, SRV_HOST)[..],
        "host gets"
    );
    let mut kept = vec![0u8; CLI_SRC];
    src.copy_to_host(0, &mut kept).unwrap();
    assert!(
        kept == pattern(SEED_CLI_SRC, CLI_SRC),
        "the put source is untouched"
    );
    server.say("check");
    assert_eq!(server.expect("HIXL-CHECK"), "ok");

    // The synchronous form: the first four gets again, into fresh sentinels.
    land.fill(0, CLI_LAND, SENTINEL).unwrap();
    // SAFETY: as above; the call returns once the batch completed.
    unsafe { client.get_sync(&dev_gets[..4], WAIT) }.unwrap();
    land.copy_to_host(0, &mut got).unwrap();
    for i in 0..4 {
        let at = (m - 1 - i) * CHUNK;
        assert_eq!(
            &got[at..at + CHUNK],
            &srv_dev[i * CHUNK..(i + 1) * CHUNK],
            "sync get, op {i}"
        );
    }
    assert!(got[..(m - 4) * CHUNK].iter().all(|&b| b == SENTINEL));

    refusals_leave_memory_untouched(&client, &land, r_dev.addr, &mut server);

    // A transfer belongs to its client: another client refuses to query
    // it before HIXL sees it (HIXL would free it as one of its own).
    let other = HixlClient::create_with_traffic_class(
        &hixl,
        "127.0.0.1",
        port,
        &endpoint(1),
        &endpoint(0),
        96,
        3,
    )
    .unwrap();
    // SAFETY: the first put again (same bytes to the same place); the
    // source is never written and outlives the client.
    let t = unsafe { client.put_async(&puts[..1]) }.unwrap();
    let err = other.query(t).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(err.to_string().contains("client that started it"), "{err}");
    drop(other);
    // The dropped transfer was never queried: it counts for good.
    let err = client.remote_mems(WAIT).unwrap_err();
    assert!(err.to_string().contains("1 transfer(s)"), "{err}");

    // The server process dies: a client connected before fails cleanly
    // when it asks for the remote memory, and batches fail (HIXL_FAILED)
    // and leave the client failed.
    let second = HixlClient::create(&hixl, "127.0.0.1", port, &endpoint(1), &endpoint(0)).unwrap();
    second.connect(WAIT).unwrap();
    server.child.kill().unwrap();
    server.child.wait().unwrap();
    let err = second.remote_mems(WAIT).unwrap_err();
    assert_eq!(hixl_code(&err), FAILED, "{err}");
    assert!(err.to_string().contains("closed the connection"), "{err}");

    // SAFETY: refused before anything moves (the server's memory is gone).
    let err = unsafe { client.get_async(&dev_gets[..1]) }.unwrap_err();
    assert_eq!(hixl_code(&err), FAILED, "{err}");
    assert!(err.to_string().contains("is gone"), "{err}");
    // SAFETY: refused: the client is failed now.
    let err = unsafe { client.get_async(&dev_gets[..1]) }.unwrap_err();
    assert_eq!(hixl_code(&err), FAILED, "{err}");
    assert!(err.to_string().contains("failed state"), "{err}");

    // And a new client finds nobody listening.
    let third = HixlClient::create(&hixl, "127.0.0.1", port, &endpoint(1), &endpoint(0)).unwrap();
    // As HIXL: one attempt, a refusal fails at once (FAILED, not a
    // TIMEOUT after retrying for the whole timeout).
    let err = third.connect(WAIT).unwrap_err();
    assert_eq!(hixl_code(&err), FAILED, "{err}");
    assert!(err.to_string().contains("is it listening"), "{err}");

    // A registration belongs to its client: another one refuses it before
    // HIXL sees it, and the id is gone either way (taken by value).
    let [first, rest @ ..] = ids;
    let err = third.unregister(first).unwrap_err();
    assert!(matches!(err, Error::InvalidArgument(_)), "{err:?}");
    assert!(err.to_string().contains("that registered it"), "{err}");
    for id in rest {
        client.unregister(id).unwrap();
    }
    drop(client);
}

/// Batches with one bad op are refused whole, before anything moves; the
/// client stays usable (HIXL_PARAM_INVALID does not fail it).
fn refusals_leave_memory_untouched(
    client: &HixlClient,
    land: &ascend_sys::DeviceBuffer,
    r_dev: u64,
    server: &mut ServerProcess,
) {
    land.fill(0, CLI_LAND, SENTINEL).unwrap();
    let good = HixlOp {
        remote: r_dev,
        local: land.as_ptr().cast(),
        len: CHUNK as u64,
    };
    // One byte past the end of the server's device region.
    let past_end = HixlOp {
        remote: r_dev + SRV_DEV as u64 - 8,
        local: land.as_ptr().cast::<u8>().wrapping_add(CHUNK),
        len: 16,
    };
    // SAFETY: refused before anything moves.
    let err = unsafe { client.get_async(&[good, past_end]) }.unwrap_err();
    assert_eq!(hixl_code(&err), PARAM_INVALID);
    assert!(
        err.to_string().contains("op 1") && err.to_string().contains("outside every region"),
        "{err}"
    );
    // A put whose first op writes the server's landing half and whose
    // second op reads unregistered local memory.
    let stray = land.device().alloc(CHUNK).unwrap();
    let put_good = HixlOp {
        remote: r_dev + (SRV_DEV / 2) as u64,
        local: land.as_ptr().cast(),
        len: CHUNK as u64,
    };
    let unregistered = HixlOp {
        remote: r_dev,
        local: stray.as_ptr().cast(),
        len: CHUNK as u64,
    };
    // SAFETY: refused before anything moves.
    let err = unsafe { client.put_async(&[put_good, unregistered]) }.unwrap_err();
    assert_eq!(hixl_code(&err), PARAM_INVALID);
    assert!(
        err.to_string().contains("not inside memory registered"),
        "{err}"
    );
    // An empty batch is HIXL's PARAM_INVALID too.
    // SAFETY: no ops.
    let err = unsafe { client.put_async(&[]) }.unwrap_err();
    assert_eq!(hixl_code(&err), PARAM_INVALID);

    let mut got = vec![0u8; CLI_LAND];
    land.copy_to_host(0, &mut got).unwrap();
    assert!(
        got.iter().all(|&b| b == SENTINEL),
        "a refused get moved bytes"
    );
    // The server's landing half still holds exactly the earlier puts.
    server.say("check");
    assert_eq!(server.expect("HIXL-CHECK"), "ok");

    // Still usable: the good op alone goes through.
    // SAFETY: valid ranges; waited for before reading.
    let t = unsafe { client.get_async(&[good]) }.unwrap();
    wait_done(client, t);
    land.copy_to_host(0, &mut got[..CHUNK]).unwrap();
    assert_eq!(&got[..CHUNK], &pattern(SEED_SRV_DEV, CHUNK)[..]);
}
