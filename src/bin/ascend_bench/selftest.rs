//! `ascend-bench selftest`: one command for a person with an Ascend machine
//! (or the emulator) that checks, in order, what ascend-pd needs from CANN,
//! and prints a pass/fail table with the runtime's own error text and, for
//! each failure, the likely cause and the fix. `--json` keeps the results
//! for a bug report.
//!
//! `selftest-peer` is the second HCCL rank it starts (hidden command).

use anyhow::{anyhow, bail, Context, Result};
use ascend_pd::memory::pattern;
use ascend_sys::{Acl, Comm, Device, DeviceBuffer, OneSidedOp, RemoteMem, RootInfo, Stream};
use std::io::{BufRead, BufReader, Write};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};

/// Bytes per op of the one-sided step.
const OP_BYTES: usize = 4096;
/// Alignment HCCS wants for registered memory.
const ALIGN: u64 = 2 << 20;
/// Longest any single wait of the selftest may take.
const WAIT: Duration = Duration::from_secs(60);

/// What became of one check.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Outcome {
    Pass,
    Fail,
    Skip,
}

impl Outcome {
    fn name(self) -> &'static str {
        match self {
            Outcome::Pass => "pass",
            Outcome::Fail => "FAIL",
            Outcome::Skip => "skip",
        }
    }
}

/// One row of the report.
struct Step {
    name: &'static str,
    outcome: Outcome,
    detail: String,
    /// Likely cause and fix, for a failure.
    hint: Option<&'static str>,
}

const HINT_CANN: &str = "CANN was not found: source <CANN>/set_env.sh (sets ASCEND_HOME_PATH) or \
     set ASCEND_PD_CANN_LIB_DIR=<CANN>/lib64; without hardware, add --emulator";
const HINT_EMU: &str = "the emulator library is not built: run `cargo build --release` in the \
     ascend-pd workspace (it builds libascend_emu.so next to ascend-bench)";
const HINT_DEVICES: &str = "the HCCL step needs two visible devices: pick them with --devices A,B \
     (see `npu-smi info`) and check ASCEND_RT_VISIBLE_DEVICES";
const HINT_ALIGN: &str = "HCCS transfers want registered memory on 2 MiB boundaries; this runtime \
     returned an unaligned buffer, so one-sided transfers may be refused or slow";
const HINT_COPY: &str = "the runtime moved bytes wrongly or refused a copy: check the driver and \
     firmware match this CANN version (`npu-smi info`, CANN release notes)";
const HINT_ONE_SIDED: &str = "this CANN has no HCCL one-sided API (HcclBatchPut and friends, \
     CANN 8.x; in 8.5+ in libhcomm.so): the hccl channel cannot work here, use --channel tcp";
const HINT_HCCL: &str =
    "HCCL could not connect the two devices or move bytes between them: on one \
     server the pair must be linked by HCCS (a PCIe-only pair needs HCCL_INTRA_ROCE_ENABLE=1, as \
     do host-memory one-sided transfers); across servers /etc/hccn.conf must give each device an \
     address (hccn_tool); HCCL_CONNECT_TIMEOUT bounds the rendezvous";
const HINT_TCP: &str = "the tcp channel could not stage NPU pages through pinned host memory: \
     see the output above (aclrtMallocHost limits, loopback firewall)";
const HINT_HIXL: &str = "the HIXL transfer did not verify every byte: see its output above; \
     HIXL wants each device's endpoint (pd_hixl_protocol, pd_hixl_device_ip from hccn_tool) and \
     a reachable server port (pd_hixl_port); pd_hccl_path: comm runs the hccl channel without it";
const HINT_RUN: &str = "the 1P1D run did not verify every byte: see its output above; rerun with \
     ASCEND_PD_LOG=debug and attach the output";

/// The HIXL steps, in order (optional: skipped, not failed, without HIXL).
const HIXL_STEPS: [&str; 3] = [
    "HIXL library (libcann_hixl.so)",
    "hixl loopback transfer (2 processes)",
    "1P1D run --device npu --channel hixl",
];

/// `ascend-bench selftest`.
#[derive(clap::Parser, Debug)]
#[command(about = "checks in order what ascend-pd needs from CANN, with the likely fix")]
struct SelftestCli {
    /// The two NPUs to use.
    #[arg(long, default_value = "0,1")]
    devices: String,
    /// Write the machine-readable report here.
    #[arg(long, value_name = "FILE")]
    json: Option<String>,
}

/// `ascend-bench selftest [--devices A,B] [--json FILE]`
pub fn selftest_main(args: &[String]) -> Result<bool> {
    let Some(a) = crate::args::parse::<SelftestCli>("selftest", args)? else {
        return Ok(true);
    };
    let (devices, json) = (a.devices, a.json);
    let devices: Vec<u32> = devices
        .split(',')
        .map(|d| d.trim().parse::<u32>())
        .collect::<Result<_, _>>()
        .map_err(|_| anyhow!("--devices {devices:?}: expected two device ids, e.g. 0,1"))?;
    let &[d0, d1] = devices.as_slice() else {
        bail!("--devices: expected exactly two device ids, e.g. 0,1");
    };
    if d0 == d1 {
        bail!("--devices {d0},{d1}: the two HCCL ranks need two different devices");
    }

    let mut steps = Vec::new();
    let mut push = |name, r: Result<String, (String, &'static str)>| {
        let ok = r.is_ok();
        steps.push(match r {
            Ok(detail) => Step {
                name,
                outcome: Outcome::Pass,
                detail,
                hint: None,
            },
            Err((detail, hint)) => Step {
                name,
                outcome: Outcome::Fail,
                detail,
                hint: Some(hint),
            },
        });
        ok
    };

    let acl = Acl::init();
    let libs_ok = push(
        "CANN libraries",
        match &acl {
            Ok(acl) => Ok(describe_libraries(acl)),
            Err(e @ ascend_sys::Error::EmulatorNotFound { .. }) => Err((e.to_string(), HINT_EMU)),
            Err(e) => Err((e.to_string(), HINT_CANN)),
        },
    );
    let runtime = match (&acl, libs_ok) {
        (Ok(acl), true) => Some(acl.clone()),
        _ => None,
    };
    if let Some(acl) = runtime {
        let devs_ok = push("devices", check_devices(&acl, d0, d1));
        if devs_ok {
            let dev = acl.device(d0)?;
            push("aclrtMalloc/aclrtMallocHost 2 MiB", check_alignment(&dev));
            push("copies host<->device, device<->device", check_copies(&dev));
            push("stream/event ordering", check_ordering(&dev));
            if acl.one_sided_supported() {
                push(
                    "HCCL one-sided put/get (2 processes)",
                    check_hccl(&acl, d0, d1),
                );
            } else {
                push(
                    "HCCL one-sided put/get (2 processes)",
                    Err((
                        "the loaded HCCL lacks the one-sided functions".into(),
                        HINT_ONE_SIDED,
                    )),
                );
            }
        }
        push(
            "tcp channel staging an NPU pool",
            run_self(
                &[
                    "channel",
                    "--channel=tcp",
                    "--device=npu",
                    "--chunks=16",
                    "--chunk-bytes=1048576",
                    "--reps=1",
                ],
                HINT_TCP,
            ),
        );
        push(
            "1P1D run --device npu --channel hccl",
            run_self(
                &[
                    "run",
                    "--channel=hccl",
                    "--device=npu",
                    "--modes=push,pull-eager,pull-delay",
                    "--requests=2",
                    "--prompt-tokens=512",
                ],
                HINT_RUN,
            ),
        );
        match acl.hixl() {
            Ok(hixl) => {
                push(
                    HIXL_STEPS[0],
                    Ok(format!("{}", hixl.library_path().display())),
                );
                push(
                    HIXL_STEPS[1],
                    run_self(
                        &[
                            "channel",
                            "--channel=hixl",
                            "--device=npu",
                            "--chunks=16",
                            "--chunk-bytes=1048576",
                            "--reps=1",
                        ],
                        HINT_HIXL,
                    ),
                );
                push(
                    HIXL_STEPS[2],
                    run_self(
                        &[
                            "run",
                            "--channel=hixl",
                            "--device=npu",
                            "--modes=push,pull-eager,pull-delay",
                            "--requests=2",
                            "--prompt-tokens=512",
                        ],
                        HINT_HIXL,
                    ),
                );
            }
            // Optional: without HIXL the hccl channel runs its comm path.
            Err(e) => {
                for (i, name) in HIXL_STEPS.into_iter().enumerate() {
                    steps.push(Step {
                        name,
                        outcome: Outcome::Skip,
                        detail: if i == 0 {
                            format!(
                                "{e} (optional: transfer_channel: hccl then runs HCCL's comm \
                                 path; transfer_channel: hixl cannot run)"
                            )
                        } else {
                            "not run: HIXL did not load".into()
                        },
                        hint: None,
                    });
                }
            }
        }
    }
    let all = [
        "CANN libraries",
        "devices",
        "aclrtMalloc/aclrtMallocHost 2 MiB",
        "copies host<->device, device<->device",
        "stream/event ordering",
        "HCCL one-sided put/get (2 processes)",
        "tcp channel staging an NPU pool",
        "1P1D run --device npu --channel hccl",
        HIXL_STEPS[0],
        HIXL_STEPS[1],
        HIXL_STEPS[2],
    ];
    for name in all {
        if !steps.iter().any(|s| s.name == name) {
            steps.push(Step {
                name,
                outcome: Outcome::Skip,
                detail: "not run: an earlier step failed".into(),
                hint: None,
            });
        }
    }
    steps.sort_by_key(|s| all.iter().position(|n| *n == s.name));
    // HIXL is optional: its steps skipped because it did not load still pass.
    let hixl_absent = steps
        .iter()
        .any(|s| s.name == HIXL_STEPS[0] && s.outcome == Outcome::Skip);
    let passed = steps.iter().all(|s| {
        s.outcome == Outcome::Pass
            || (hixl_absent && HIXL_STEPS.contains(&s.name) && s.outcome == Outcome::Skip)
    });
    let emulator = acl.as_ref().is_ok_and(Acl::is_emulator);
    print_table(&steps, emulator, passed);
    if let Some(path) = json {
        let doc = serde_json::json!({
            "runtime": match &acl {
                Ok(a) if a.is_emulator() => "emulator",
                Ok(_) => "cann",
                Err(_) => "none",
            },
            "note": "nothing in ascend-pd has been run on Ascend hardware by its authors",
            "devices": [d0, d1],
            "passed": passed,
            "steps": steps.iter().map(|s| serde_json::json!({
                "name": s.name,
                "result": s.outcome.name().to_lowercase(),
                "detail": s.detail,
                "hint": s.hint,
            })).collect::<Vec<_>>(),
        });
        std::fs::write(&path, serde_json::to_string_pretty(&doc)? + "\n")
            .with_context(|| format!("writing {path}"))?;
        eprintln!("wrote {path}");
    }
    Ok(passed)
}

fn print_table(steps: &[Step], emulator: bool, passed: bool) {
    println!(
        "ascend-pd selftest{}",
        if emulator {
            " on the CANN EMULATOR (not CANN; proves nothing about hardware)"
        } else {
            ""
        }
    );
    let width = steps.iter().map(|s| s.name.len()).max().unwrap_or(0);
    for s in steps {
        let detail = s
            .detail
            .replace('\n', &format!("\n  {:<width$}        ", ""));
        println!("  {:<width$}  {}  {detail}", s.name, s.outcome.name());
        if let Some(h) = s.hint {
            println!("  {:<width$}        fix: {h}", "");
        }
    }
    println!(
        "{}",
        if passed {
            "selftest passed"
        } else {
            "selftest FAILED"
        }
    );
}

fn describe_libraries(acl: &Acl) -> String {
    let who = if acl.is_emulator() {
        "CANN emulator (ascend-emu)"
    } else {
        "CANN"
    };
    let path = |p: Option<&std::path::Path>| {
        p.map_or_else(|| "absent".to_string(), |p| p.display().to_string())
    };
    format!(
        "{who}: acl {}; hccl {}; one-sided API from {}",
        acl.library_path().display(),
        path(acl.hccl_library_path()),
        path(acl.one_sided_library_path()),
    )
}

fn check_devices(acl: &Acl, d0: u32, d1: u32) -> Result<String, (String, &'static str)> {
    let n = acl
        .device_count()
        .map_err(|e| (e.to_string(), HINT_DEVICES))?;
    let soc = acl.soc_name().unwrap_or_else(|| "unknown SoC".into());
    if d0.max(d1) >= n {
        return Err((
            format!(
                "{n} device(s) visible ({soc}); --devices {d0},{d1} needs {}",
                d0.max(d1) + 1
            ),
            HINT_DEVICES,
        ));
    }
    let mut mem = Vec::new();
    for d in [d0, d1] {
        let info = acl.device(d).and_then(|dev| dev.mem_info());
        mem.push(match info {
            Ok((free, total)) => format!("dev {d}: {} of {} MiB free", free >> 20, total >> 20),
            Err(e) => format!("dev {d}: memory unknown ({e})"),
        });
    }
    Ok(format!("{n} device(s), {soc}; {}", mem.join(", ")))
}

fn check_alignment(dev: &Device) -> Result<String, (String, &'static str)> {
    let err = |e: ascend_sys::Error| (e.to_string(), HINT_ALIGN);
    let d = dev.alloc(4 << 20).map_err(err)?;
    let h = dev.alloc_host(4 << 20).map_err(err)?;
    let (da, ha) = (d.addr() % ALIGN == 0, h.addr() % ALIGN == 0);
    let text = format!("device {:#x}, host {:#x}", d.addr(), h.addr());
    if da && ha {
        Ok(format!("{text}: both 2 MiB aligned"))
    } else {
        Err((format!("{text}: not 2 MiB aligned"), HINT_ALIGN))
    }
}

fn check_copies(dev: &Device) -> Result<String, (String, &'static str)> {
    let err = |e: ascend_sys::Error| (e.to_string(), HINT_COPY);
    let len = 8 << 20;
    let mut src = vec![0u8; len];
    pattern::fill(&mut src, 0x5e1f);
    let a = dev.alloc(len).map_err(err)?;
    let b = dev.alloc(len).map_err(err)?;
    let t = Instant::now();
    a.copy_from_host(0, &src).map_err(err)?;
    b.copy_from_device(0, &a, 0, len).map_err(err)?;
    let mut back = vec![0u8; len];
    b.copy_to_host(0, &mut back).map_err(err)?;
    let took = t.elapsed();
    match pattern::first_mismatch(&back, 0x5e1f) {
        None => Ok(format!(
            "{} MiB H2D, D2D, D2H verified in {:.1} ms",
            len >> 20,
            took.as_secs_f64() * 1e3
        )),
        Some(at) => Err((format!("byte {at} differs after H2D, D2D, D2H"), HINT_COPY)),
    }
}

fn check_ordering(dev: &Device) -> Result<String, (String, &'static str)> {
    let err = |e: ascend_sys::Error| (e.to_string(), HINT_COPY);
    let len = 4 << 20;
    let mut host = dev.alloc_host(len).map_err(err)?;
    pattern::fill(host.as_mut_slice(), 0x0bde);
    let back = dev.alloc_host(len).map_err(err)?;
    let mid = dev.alloc(len).map_err(err)?;
    let (s1, s2) = (
        dev.create_stream().map_err(err)?,
        dev.create_stream().map_err(err)?,
    );
    let ev = dev.create_event().map_err(err)?;
    // SAFETY: all three buffers outlive both streams' work, which is
    // synchronised below before any of them is read or dropped.
    unsafe {
        s1.copy_host_to_device(&mid, 0, &host, 0, len)
            .map_err(err)?;
        s1.record(&ev).map_err(err)?;
        s2.wait_event(&ev).map_err(err)?;
        s2.copy_device_to_host(&back, 0, &mid, 0, len)
            .map_err(err)?;
    }
    s2.completion().and_then(|c| c.wait(WAIT)).map_err(err)?;
    s1.synchronize().map_err(err)?;
    match pattern::first_mismatch(back.as_slice(), 0x0bde) {
        None => Ok("copy on stream 2 waited for stream 1's event; bytes verified".into()),
        Some(at) => Err((
            format!("byte {at} differs: stream 2 ran before the event it waited on"),
            HINT_COPY,
        )),
    }
}

/// Rank 0 here, rank 1 in a `selftest-peer` child on the other device.
/// Puts then gets back batches of 1, 64 and (op limit + 44) ops, device and
/// host memory, every byte compared.
fn check_hccl(acl: &Acl, d0: u32, d1: u32) -> Result<String, (String, &'static str)> {
    hccl_rank0(acl, d0, d1).map_err(|e| (format!("{e:#}"), HINT_HCCL))
}

fn hccl_rank0(acl: &Acl, d0: u32, d1: u32) -> Result<String> {
    let dev = acl.device(d0)?;
    let root = dev.hccl_root_info()?;
    let hex: String = root.as_bytes().iter().map(|b| format!("{b:02x}")).collect();
    let exe = std::env::current_exe().context("locating ascend-bench")?;
    let mut child = Command::new(exe)
        .args([
            "selftest-peer",
            &format!("--device={d1}"),
            &format!("--root={hex}"),
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .context("starting the second HCCL rank")?;
    let result = (|| -> Result<String> {
        let comm = Comm::init_two_ranks(&dev, &root, 0)?;
        let limit = comm.batch_op_limit();
        let sizes = [1usize, 64, limit + 44];
        let max = *sizes.iter().max().expect("sizes");
        let span = max * OP_BYTES;
        let src = Arc::new(dev.alloc(span)?);
        let back = Arc::new(dev.alloc(span)?);
        let mut host = dev.alloc_host(span)?;
        let mut bytes = vec![0u8; span];
        pattern::fill(&mut bytes, 0xacce55);
        src.copy_from_host(0, &bytes)?;
        host.as_mut_slice().copy_from_slice(&bytes);
        let host = Arc::new(host);
        let regs = [
            comm.register_device_buffer(&src)?,
            comm.register_device_buffer(&back)?,
            comm.register_host_buffer(&host)?,
        ];
        let remote = comm.exchange_descriptors(&regs.iter().collect::<Vec<_>>(), 4)?;
        // Both ranks enable every region of the other, in order (over HCCS
        // this is an exchange both must make); the first is the target.
        let mut enabled = remote
            .iter()
            .map(|d| comm.enable_access(d))
            .collect::<Result<Vec<_>, _>>()?;
        if enabled.is_empty() {
            bail!("the peer registered no memory");
        }
        let peer = enabled.swap_remove(0);
        if peer.len() < span as u64 {
            bail!("the peer registered {} bytes, {span} needed", peer.len());
        }
        let stream = dev.create_stream()?;
        let mut lines = Vec::new();
        for n in sizes {
            let t = Instant::now();
            round_trip(&comm, &stream, src.addr(), &back, &peer, n)?;
            lines.push(format!("{n} ops {:.1} ms", t.elapsed().as_secs_f64() * 1e3));
        }
        // Host memory as the source of a put (HCCL_INTRA_ROCE_ENABLE on one server).
        round_trip(&comm, &stream, host.addr(), &back, &peer, 16).context("host-memory put")?;
        lines.push("host-memory put ok".into());
        // Barrier: the peer may leave once we are done with its memory.
        comm.exchange_descriptors(&[], 0)?;
        drop((peer, enabled, regs));
        Ok(format!(
            "devices {d0}<->{d1}, {OP_BYTES}-byte ops, limit {limit} per call: {} (put + get, verified)",
            lines.join(", ")
        ))
    })();
    // The peer exits after the barrier; on failure it is killed.
    if result.is_err() {
        let _ = child.kill();
    }
    drop(child.stdin.take());
    let status = child.wait()?;
    let mut out = String::new();
    if let Some(s) = child.stdout.take() {
        for line in BufReader::new(s).lines().map_while(Result::ok) {
            out.push_str(&line);
        }
    }
    let detail = result?;
    if !status.success() {
        bail!("the second rank failed: {out}");
    }
    Ok(detail)
}

/// Puts `n` ops from `local` into the peer (reversed), gets them back into
/// `back`, and compares with the source pattern.
fn round_trip(
    comm: &Comm,
    stream: &Stream,
    local: u64,
    back: &DeviceBuffer,
    peer: &RemoteMem,
    n: usize,
) -> Result<()> {
    let at = |i: usize| (i * OP_BYTES) as u64;
    let puts: Vec<OneSidedOp> = (0..n)
        .map(|i| OneSidedOp {
            local_addr: local + at(i),
            remote_addr: peer.addr() + at(n - 1 - i),
            len: OP_BYTES as u64,
        })
        .collect();
    let gets: Vec<OneSidedOp> = (0..n)
        .map(|i| OneSidedOp {
            local_addr: back.addr() + at(i),
            remote_addr: peer.addr() + at(n - 1 - i),
            len: OP_BYTES as u64,
        })
        .collect();
    back.fill(0, n * OP_BYTES, 0)?;
    // SAFETY: every local range lies in memory registered on `comm` and
    // every remote one in the enabled region `peer` (checked to be large
    // enough); all of them outlive the completions, waited on at once.
    unsafe {
        comm.batch_put(stream, &puts)?.wait(WAIT)?;
        comm.batch_get(stream, &gets)?.wait(WAIT)?;
    }
    let mut got = vec![0u8; n * OP_BYTES];
    back.copy_to_host(0, &mut got)?;
    if let Some(byte) = pattern::first_mismatch(&got, 0xacce55) {
        bail!("batch of {n} ops: byte {byte} came back wrong");
    }
    Ok(())
}

/// `ascend-bench selftest-peer --device D --root HEX`: rank 1 of the HCCL
/// step; registers memory, exchanges, and leaves after rank 0's barrier.
/// `ascend-bench selftest-peer` (started by `selftest`).
#[derive(clap::Parser, Debug)]
#[command(about = "rank 1 of the selftest's HCCL step (started by `selftest`)")]
struct SelftestPeerCli {
    #[arg(long, default_value_t = 1)]
    device: u32,
    #[arg(long, default_value = "")]
    root: String,
}

pub fn peer_main(args: &[String]) -> Result<()> {
    let Some(a) = crate::args::parse::<SelftestPeerCli>("selftest-peer", args)? else {
        return Ok(());
    };
    let (device, hex) = (a.device, a.root);
    let bytes: Vec<u8> = (0..hex.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(hex.get(i..i + 2).unwrap_or("zz"), 16))
        .collect::<Result<_, _>>()
        .map_err(|_| anyhow!("--root: not hex"))?;
    let root = RootInfo::from_bytes(&bytes)?;
    let dev = Acl::init()?.device(device)?;
    let comm = Comm::init_two_ranks(&dev, &root, 1)?;
    let span = (comm.batch_op_limit() + 44) * OP_BYTES;
    // Three regions, as rank 0 registers; the first is what it writes.
    let target = Arc::new(dev.alloc(span)?);
    let spare = Arc::new(dev.alloc(span)?);
    let host = Arc::new(dev.alloc_host(span)?);
    let regs = [
        comm.register_device_buffer(&target)?,
        comm.register_device_buffer(&spare)?,
        comm.register_host_buffer(&host)?,
    ];
    let remote = comm.exchange_descriptors(&regs.iter().collect::<Vec<_>>(), 4)?;
    let enabled = remote
        .iter()
        .map(|d| comm.enable_access(d))
        .collect::<Result<Vec<_>, _>>()?;
    comm.exchange_descriptors(&[], 0)?;
    drop((enabled, regs));
    println!("done");
    std::io::stdout().flush()?;
    Ok(())
}

/// Runs this binary with `args` as a child; pass when it exits 0.
fn run_self(args: &[&str], hint: &'static str) -> Result<String, (String, &'static str)> {
    let exe = std::env::current_exe().map_err(|e| (e.to_string(), hint))?;
    let t = Instant::now();
    let out = Command::new(exe)
        .args(args)
        .stdin(Stdio::null())
        .output()
        .map_err(|e| (e.to_string(), hint))?;
    let text =
        String::from_utf8_lossy(&out.stdout).into_owned() + &String::from_utf8_lossy(&out.stderr);
    if out.status.success() {
        // Both commands exit non-zero unless every byte was verified.
        Ok(format!(
            "`ascend-bench {}` passed in {:.1} s, every byte verified",
            args.join(" "),
            t.elapsed().as_secs_f64()
        ))
    } else {
        let tail: Vec<&str> = text.lines().rev().take(8).collect();
        let tail: Vec<&str> = tail.into_iter().rev().collect();
        Err((
            format!(
                "`ascend-bench {}` failed ({}): {}",
                args.join(" "),
                out.status,
                tail.join(" | ")
            ),
            hint,
        ))
    }
}
