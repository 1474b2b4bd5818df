//! Command-line parsing with clap: each subcommand declares its flags as a
//! `#[derive(clap::Parser)]` struct and parses the arguments after its name.

use anyhow::{anyhow, Result};
use clap::error::ErrorKind;

/// Parses `args` (the arguments after the subcommand `command`) into `T`.
/// `--help` prints the subcommand's help and gives `None` (nothing to run);
/// a bad argument is an error naming it, with clap's suggestion.
pub fn parse<T: clap::Parser>(command: &str, args: &[String]) -> Result<Option<T>> {
    let argv = std::iter::once(format!("ascend-bench {command}")).chain(args.iter().cloned());
    match T::try_parse_from(argv) {
        Ok(t) => Ok(Some(t)),
        Err(e) if matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) => {
            print!("{e}");
            Ok(None)
        }
        Err(e) => {
            let text = e.to_string();
            let text = text.strip_prefix("error: ").unwrap_or(&text).trim_end();
            Err(anyhow!("{command}: {text}"))
        }
    }
}

/// How requests arrive: the open-loop flags `run` takes and passes on to
/// its sender processes.
#[derive(clap::Args, Clone, Debug)]
pub struct LoadArgs {
    /// Requests in flight per sender (1: closed loop, each request starts
    /// when the previous one loaded). Above 1, or with --rate or
    /// --duration, senders run open loop and save from an engine cache
    /// through the request API (several saves in flight).
    #[arg(long, default_value_t = 1)]
    pub concurrency: usize,
    /// Poisson arrivals per second per sender [default: as fast as
    /// --concurrency allows]; a request that finds no free slot waits, and
    /// its e2e latency counts from its arrival.
    #[arg(long, value_name = "R")]
    pub rate: Option<f64>,
    /// Keep requests arriving for S seconds instead of --requests.
    #[arg(long, value_name = "S")]
    pub duration: Option<f64>,
}
