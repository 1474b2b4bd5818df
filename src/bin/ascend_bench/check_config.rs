//! `ascend-bench check-config FILE...`: load, validate and print each config.

use ascend_pd::config::PdConfig;
use std::io::Write;

/// Prints the effective configuration (or the errors) of every file.
/// Returns whether all of them are valid.
pub fn run(files: &[String], out: &mut impl Write, err: &mut impl Write) -> bool {
    let mut all_ok = true;
    for file in files {
        match PdConfig::load_roles(file) {
            Ok(halves) => {
                for loaded in halves {
                    let c = &loaded.config;
                    let _ = writeln!(
                        out,
                        "== {file}: valid ({} {}, {} over {})",
                        c.role.name(),
                        c.mode(),
                        c.buffer_device,
                        c.transfer_channel.name()
                    );
                    for w in &loaded.warnings {
                        let _ = writeln!(err, "warning: {file}: {w}");
                    }
                    let needs_cann = c.has_npu_pool() || c.transfer_channel.needs_acl_memory();
                    if needs_cann && !ascend_sys::available() {
                        let _ = writeln!(
                        err,
                        "warning: {file}: this config needs the CANN runtime ({}), which was not found on this machine; install CANN or set ASCEND_PD_CANN_LIB_DIR before running it (validation itself needs no NPU)",
                        if c.has_npu_pool() { format!("pd_buffer_device: {}", c.buffer_device) } else { format!("transfer_channel: {}", c.transfer_channel.name()) }
                    );
                    }
                    let _ = write!(out, "{}", c.to_effective_yaml());
                    let _ = write!(out, "{}", c.port_table_text());
                }
            }
            Err(e) => {
                all_ok = false;
                let _ = writeln!(out, "== {file}: INVALID");
                let _ = writeln!(err, "error: {e}");
            }
        }
    }
    all_ok
}
