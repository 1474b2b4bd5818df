//! The vLLM connector on the oldest vLLM it supports (0.23, the release
//! vllm-ascend 0.23.0.post1 pairs with), with real engines: builds (once;
//! reused while `tests/vllm/setup-venv.sh` is unchanged) `.venv-vllm-0.23`
//! with `APD_VLLM_VERSION=0.23.0`, installs this checkout's package into it,
//! and runs the connector's unit and contract tests and the end-to-end
//! modes (push, pull-eager, pull-delay, a killed prefill, `vllm serve`
//! behind the proxy's router-native flow). The newest version runs every
//! suite in `tests/vllm_e2e.rs`; docs/compatibility.md lists both.
//!
//! A separate test binary, so cargo runs it after (never beside) the
//! newest version's engines.

mod vllm_env;

use std::path::PathBuf;
use std::process::Command;
use vllm_env::{install_package, root, run};

const OLDEST: &str = "0.23.0";

#[test]
fn the_oldest_supported_vllm_moves_kv_in_every_mode() {
    let root = root();
    let venv = std::env::var_os("ASCEND_PD_VLLM_OLDEST_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root.join(".venv-vllm-0.23"));
    run(
        "build the oldest vLLM's test environment",
        Command::new("bash")
            .arg(root.join("tests/vllm/setup-venv.sh"))
            .env("APD_VLLM_VERSION", OLDEST)
            .env("ASCEND_PD_VLLM_VENV", &venv),
    );
    let vpy = venv.join("bin/python");
    let version = Command::new(&vpy)
        .args(["-c", "import vllm; print(vllm.__version__)"])
        .output()
        .expect("the venv's python runs");
    let version = String::from_utf8_lossy(&version.stdout).trim().to_string();
    assert!(
        version.starts_with("0.23"),
        "{} holds vLLM {version:?}, not {OLDEST}",
        venv.display()
    );
    install_package(&vpy);
    let logs = std::env::temp_dir().join(format!("apd-vllm-oldest-{}", std::process::id()));
    std::fs::create_dir_all(&logs).unwrap();
    let results = logs.join("results.json");
    run(
        "pytest on the oldest vLLM",
        Command::new(&vpy)
            .args(["-m", "pytest", "-v", "-s", "-p", "no:cacheprovider"])
            .arg(root.join("tests/vllm/test_units.py"))
            .arg(root.join("tests/vllm/test_contract.py"))
            .arg(root.join("tests/vllm/test_e2e.py"))
            // Layer-wise push is the newest version's (it runs there);
            // keeps this run to about 8 minutes.
            .args(["-k", "not layerwise"])
            .current_dir(root.join("tests/vllm"))
            .env_remove("ASCEND_PD_LIB")
            .env_remove("PYTHONPATH")
            .env("APD_VLLM_LOG_DIR", &logs)
            .env("APD_VLLM_RESULTS", &results),
    );
    let report = std::fs::read_to_string(&results).unwrap_or_default();
    eprintln!("vllm {version} results ({}):\n{report}", results.display());
    for mode in ["push", "pull-eager", "pull-delay", "fault", "serve"] {
        assert!(
            report.contains(&format!("\"{mode}\"")),
            "no result for {mode} on vLLM {version} in {}",
            results.display()
        );
    }
    let _ = std::fs::remove_dir_all(&logs);
}
