//! What the real-engine runners (`vllm_e2e.rs`, `vllm_oldest.rs`) share:
//! running a step loudly, and installing this checkout's package into a
//! vLLM environment as a user does.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The checkout.
pub fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// Runs `cmd`, failing the test (naming `what`) unless it succeeds.
pub fn run(what: &str, cmd: &mut Command) {
    eprintln!("vllm e2e: {what}: {cmd:?}");
    let status = cmd
        .status()
        .unwrap_or_else(|e| panic!("{what}: cannot start {cmd:?}: {e}"));
    assert!(status.success(), "{what} failed ({status}): {cmd:?}");
}

/// `pip install ./python` into the environment of `python` (which builds
/// the library with cargo and ships it inside the package).
pub fn install_package(python: &Path) {
    run(
        "pip install ./python",
        Command::new(python)
            .args([
                "-m",
                "pip",
                "install",
                "-q",
                "--no-deps",
                "--force-reinstall",
            ])
            .arg(root().join("python"))
            .env_remove("ASCEND_PD_LIB"),
    );
}
