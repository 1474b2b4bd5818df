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

/// Runs pytest with `python` on `files` (relative to `tests/`, run from
/// `tests/vllm`) plus `extra` arguments, against the installed package
/// (not the source tree or a stray library), logging to a fresh directory
/// named for `name`; then requires a result for each of `keys` in the
/// results report the suites write.
pub fn pytest_results(python: &Path, name: &str, files: &[&str], extra: &[&str], keys: &[&str]) {
    let root = root();
    let logs = std::env::temp_dir().join(format!("apd-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&logs).unwrap();
    let results = logs.join("results.json");
    let mut cmd = Command::new(python);
    cmd.args(["-m", "pytest", "-v", "-s", "-p", "no:cacheprovider"]);
    for f in files {
        cmd.arg(root.join("tests").join(f));
    }
    run(
        &format!("pytest ({name})"),
        cmd.args(extra)
            .current_dir(root.join("tests/vllm"))
            .env_remove("ASCEND_PD_LIB")
            .env_remove("PYTHONPATH")
            .env("APD_VLLM_LOG_DIR", &logs)
            .env("APD_VLLM_RESULTS", &results),
    );
    let report = std::fs::read_to_string(&results).unwrap_or_default();
    eprintln!("{name} results ({}):\n{report}", results.display());
    for key in keys {
        assert!(
            report.contains(&format!("\"{key}\"")),
            "no result for {key} in {}",
            results.display()
        );
    }
    let _ = std::fs::remove_dir_all(&logs);
}
