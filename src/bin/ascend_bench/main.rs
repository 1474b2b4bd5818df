//! `ascend-bench`: the main job of ascend-pd.
//!
//! With no command it runs the built-in 1P1D comparison of every mode on
//! this machine (`run` with defaults). Subcommands run real sender,
//! receiver and proxy processes, the channel micro-benchmark, and config
//! validation.

mod args;
mod channel;
mod check_config;
mod doctor;
mod engine;
mod link_model;
mod metrics;
mod report;
mod roles;
mod run;
mod selftest;
mod soak;

use std::process::ExitCode;

const USAGE: &str = "\
usage: ascend-bench [COMMAND]

commands:
  run [--config FILE] [--channel shm|tcp|hccl|hixl] [--device cpu|npu] [--depth N]
      [--modes push,pull-eager,pull-delay,pull-delay-offload]
      [--requests N] [--prompt-tokens N] [--senders P] [--receivers D] [--tp N]
      [--prefill-tp A --decode-tp B] [--block-size N] [--json FILE] [--plot FILE.svg]
                         nPmD comparison of the modes with real sender, receiver and
                         proxy processes on this machine; every byte is verified.
                         --prefill-tp/--decode-tp: different TP sizes (one a multiple
                         of the other); each decode rank's heads are checked.
                         hccl runs HCCL's comm path (pd_hccl_path: comm) in run,
                         channel and soak, so hccl and hixl compare the two paths.
                         --block-size: tokens per KV block of the engine caches
                         (default 128, vLLM-Ascend's).
                         The default (no command) is `run` with built-in settings.
  sender --config FILE (--receiver HOST --init-port P[,P] --alloc-port P[,P] |
         --to HOST/P[,P]/P[,P] ...) [--requests N] [--prompt-tokens N] [--rank R]
         [--prefix NAME] [--metrics-port M]
                         a prefill worker with a request generator
  receiver --config FILE [--rank R] [--notify-port P] [--requests N] [--kv-tokens N]
           [--depth N] [--prompt-tokens N] [--metrics-port M]
                         a decode worker; loads and verifies each request announced
                         by a ProxyNotif on --notify-port
  proxy --port N [--host H] [--forward HOST:PORT]... [--metrics-port M]
                         receives ProxyNotif from senders and forwards it to decoders
  channel [--channel shm|tcp|hccl|hixl] [--device cpu|npu] [--op write|read]
          [--chunk-bytes N] [--chunks M] [--reps R] [--json FILE]
                         transfer-channel micro-benchmark between two processes,
                         with a same-run baseline (memcpy for shm/hccl/hixl, one TCP
                         stream for tcp); hccl, hixl and npu pools need CANN or
                         --emulator
  selftest [--devices A,B] [--json FILE]
                         checks in order what ascend-pd needs from CANN (libraries,
                         devices, 2 MiB allocations, copies, stream/event ordering,
                         two-process HCCL one-sided put/get above the per-call op
                         limit, tcp staging an NPU pool, a 1P1D hccl run; then HIXL:
                         the library, a two-process hixl transfer, a 1P1D hixl run,
                         skipped without HIXL, which is optional); prints pass/fail
                         with the runtime's text and the likely fix
  soak [--requests N] [--seed S] [--channels shm,tcp[,hccl,hixl]] [--modes push,pull-eager,pull-delay]
       [--faults KIND,...] [--json FILE]
                         requests across modes and channels with seeded random faults
                         (malformed and oversized frames, lost and delayed side-channel
                         frames, readers stalled past the lease, exhausted pools, sender
                         and receiver processes killed and restarted); reports verified,
                         failed (with the reason), corrupted (must be 0) and leaked pages
                         (must be 0)
  check-config FILE...   validate configs, print the effective values (defaults filled in)
                         and each rank's listener ports
  doctor --config FILE [--rank R] [--receiver HOST:INIT:ALLOC] [--reach HOST:PORT]...
                         check a worker's deployment from where it runs: the config,
                         its bind address and fixed ports, peers answering, and (from a
                         prefill, with --receiver) a real handshake with the decode:
                         secret, model identity, release, mode, channel; names each fix
  help                   this text; `ascend-bench COMMAND --help` lists a command's flags

--emulator (any command) uses the CANN emulator instead of CANN, as does
ASCEND_PD_CANN_LIB_DIR=emulator; it needs the emulator built (`cargo build
--release` builds it). Whatever it serves is reported as the emulator.
ASCEND_PD_EMU_LINK=a2-roce|a2-hccs|a3-hccs|a3-roce (emulator, --channel hccl):
`run` and `channel` also report MODELED link figures (link_model, modeled_gbps,
link_ceiling_gbps), priced from vendor-published throughput, never measured.
--metrics-port serves counters in OpenMetrics text (Prometheus scrapes it) at http://HOST:PORT/metrics.
Long-running processes stop cleanly on SIGINT / SIGTERM.";

fn report(r: anyhow::Result<bool>) -> bool {
    r.unwrap_or_else(|e| {
        eprintln!("error: {e:#}");
        false
    })
}

fn main() -> ExitCode {
    // The library logs through `log`; ASCEND_PD_LOG takes env_logger filters
    // ("debug", "ascend_pd=debug", "off"), warnings by default.
    env_logger::Builder::from_env(env_logger::Env::new().filter_or("ASCEND_PD_LOG", "warn")).init();
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    // `--emulator` anywhere: load the CANN emulator, here and in every
    // process this one starts (they inherit the environment).
    let before = args.len();
    args.retain(|a| a != "--emulator");
    if args.len() != before {
        // Single-threaded here: nothing else reads the environment yet.
        std::env::set_var(ascend_sys::LIB_DIR_ENV, ascend_sys::emulator::LIB_DIR_VALUE);
    }
    // No command, or flags without one (`ascend-bench --json F`), means `run`.
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) if !c.starts_with("--") || c == "--help" => (c.as_str(), r),
        _ => ("run", &args[..]),
    };
    let ok = match cmd {
        "run" => report(run::run_main(rest)),
        "sender" => report(roles::sender_main(rest)),
        "receiver" => report(roles::receiver_main(rest)),
        "proxy" => report(roles::proxy_main(rest)),
        "channel" => report(channel::bench_main(rest)),
        "channel-peer" => report(channel::peer_main(rest).map(|()| true)),
        "selftest" => report(selftest::selftest_main(rest)),
        "soak" => report(soak::soak_main(rest)),
        "selftest-peer" => report(selftest::peer_main(rest).map(|()| true)),
        "doctor" => report(doctor::doctor_main(rest)),
        "check-config" if rest.iter().any(|a| a == "--help" || a == "-h") => {
            println!(
                "validate configs, print the effective values (defaults filled in) and each TP rank's \
                 listener ports; `pd_role: both` prints both halves\n\n\
                 Usage: ascend-bench check-config FILE...\n\n\
                 Exits non-zero if any FILE is invalid, after printing every error."
            );
            true
        }
        "check-config" => {
            if rest.is_empty() {
                eprintln!("error: check-config needs at least one FILE\n\n{USAGE}");
                return ExitCode::from(2);
            }
            check_config::run(rest, &mut std::io::stdout(), &mut std::io::stderr())
        }
        "help" | "-h" | "--help" => {
            println!("{USAGE}");
            true
        }
        other => {
            eprintln!("error: unknown command {other:?}\n\n{USAGE}");
            return ExitCode::from(2);
        }
    };
    if ok {
        ExitCode::SUCCESS
    } else {
        ExitCode::FAILURE
    }
}
