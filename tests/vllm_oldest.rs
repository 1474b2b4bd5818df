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
use vllm_env::{install_package, pytest_results, root, run};

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
    pytest_results(
        &vpy,
        &format!("vllm-{version}"),
        &[
            "vllm/test_units.py",
            "vllm/test_contract.py",
            "vllm/test_e2e.py",
        ],
        // Layer-wise push is the newest version's (it runs there); keeps
        // this run to about 8 minutes.
        &["-k", "not layerwise"],
        &["push", "pull-eager", "pull-delay", "fault", "serve"],
    );
}
