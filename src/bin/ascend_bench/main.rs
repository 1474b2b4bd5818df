//! `ascend-bench`: the main job of ascend-pd.
//!
//! Subcommands: `check-config FILE...` validates configurations. The 1P1D
//! benchmark (`run`, the default) arrives with the backend.

mod args;
mod channel;
mod check_config;

use std::process::ExitCode;

const USAGE: &str = "\
usage: ascend-bench [COMMAND]

commands:
  check-config FILE...   validate configs, print the effective values (defaults filled in)
  channel [--channel shm|tcp|hccl] [--device cpu|npu] [--op write|read]
          [--chunk-bytes N] [--chunks M] [--reps R] [--json FILE]
                         transfer-channel micro-benchmark between two processes,
                         with a same-run baseline (memcpy for shm/hccl, one TCP stream
                         for tcp); hccl and npu pools need CANN or the emulator
                         (ASCEND_PD_CANN_LIB_DIR)
  help                   this text

With no command, validates every file in configs/ (the 1P1D benchmark is not
built yet).";

fn main() -> ExitCode {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let (cmd, rest) = match args.split_first() {
        Some((c, r)) => (c.as_str(), r),
        None => ("", &[][..]),
    };
    let ok = match cmd {
        "check-config" => {
            if rest.is_empty() {
                eprintln!("error: check-config needs at least one FILE\n\n{USAGE}");
                return ExitCode::from(2);
            }
            check_config::run(rest, &mut std::io::stdout(), &mut std::io::stderr())
        }
        "" => {
            let files = match shipped_configs() {
                Ok(f) => f,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::FAILURE;
                }
            };
            eprintln!(
                "The 1P1D benchmark is not built yet; validating the {} files in configs/.",
                files.len()
            );
            check_config::run(&files, &mut std::io::stdout(), &mut std::io::stderr())
        }
        "channel" => match channel::bench_main(rest) {
            Ok(verified) => verified,
            Err(e) => {
                eprintln!("error: {e:#}");
                false
            }
        },
        "channel-peer" => match channel::peer_main(rest) {
            Ok(()) => true,
            Err(e) => {
                eprintln!("error: {e:#}");
                false
            }
        },
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

/// `configs/*.yaml` of the source tree (or of the working directory).
fn shipped_configs() -> Result<Vec<String>, String> {
    let dir = ["configs", concat!(env!("CARGO_MANIFEST_DIR"), "/configs")]
        .into_iter()
        .find(|d| std::path::Path::new(d).is_dir())
        .ok_or("no configs/ directory here or in the source tree")?;
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .map_err(|e| format!("cannot list {dir}: {e}"))?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "yaml" || x == "yml"))
        .map(|p| p.display().to_string())
        .collect();
    files.sort();
    Ok(files)
}
