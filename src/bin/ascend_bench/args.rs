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
