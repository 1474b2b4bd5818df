//! ascend-pd as vLLM's KV connector, proven with real vLLM engines.
//!
//! Builds (once; reused while `tests/vllm/setup-venv.sh` is unchanged) a
//! project-local Python environment `.venv-vllm` with vLLM's CPU build,
//! installs this checkout's Python package into it with `pip install
//! ./python` (which builds the library with cargo and ships it inside the
//! package), then runs `tests/vllm/test_units.py` (the connector's pieces,
//! the KV layouts against vLLM's own CPU kernel) and
//! `tests/vllm/test_contract.py` (the connector's contract with vLLM's
//! scheduler, without engines), `tests/vllm/test_e2e.py` (prefill and
//! decode engines in separate processes, `vllm serve` behind
//! `python -m ascend_pd.proxy`, a killed prefill),
//! `tests/vllm/test_kv_identity.py` (LoRA, faults and the router-native
//! flow with real engines), `tests/vllm/test_router.py` (vllm-router from
//! the package registry in front of `vllm serve` engines, in a venv of its
//! own), `tests/vllm/test_quickstart.py` (README.md's same-host 1P1D
//! quickstart block run as written: `examples/vllm/`'s scripts, the
//! `configs/vllm/` YAMLs, `vllm serve` and vllm-router),
//! `tests/vllm/test_ops.py` (the `vllm:ascend_pd_*` series scraped
//! from `vllm serve`'s `/metrics`, two `kv_both` engines), and
//! `tests/vllm/test_restart.py` (a prefill restarted under load drains),
//! `tests/vllm/test_engine_bench.py` (benchmarks/engine_bench.py, small,
//! its report checked) and the proxy's own tests under pytest.
//!
//! Nothing is skipped: a missing python3 (or its venv module) fails the
//! test with the command that installs it. Takes several minutes: each
//! engine needs about half a minute to start on two cores.

mod vllm_env;

use std::path::PathBuf;
use std::process::Command;
use vllm_env::{install_package, pytest_results, root, run};

fn venv() -> PathBuf {
    std::env::var_os("ASCEND_PD_VLLM_VENV")
        .map(PathBuf::from)
        .unwrap_or_else(|| root().join(".venv-vllm"))
}

#[test]
fn two_vllm_engines_move_kv_through_the_connector_in_every_mode() {
    let py = std::env::var("PYTHON").unwrap_or_else(|_| "python3".into());
    let has_venv = Command::new(&py)
        .args(["-c", "import venv, ensurepip"])
        .status()
        .is_ok_and(|s| s.success());
    assert!(
        has_venv,
        "{py} with its venv module is needed to build the vLLM test environment: \
         `apt-get install python3 python3-venv` (or set PYTHON)"
    );
    let root = root();
    let venv = venv();
    run(
        "build the vLLM test environment",
        Command::new("bash")
            .arg(root.join("tests/vllm/setup-venv.sh"))
            .env("ASCEND_PD_VLLM_VENV", &venv),
    );
    let vpy = venv.join("bin/python");
    // This checkout's package, as a user installs it.
    install_package(&vpy);
    pytest_results(
        &vpy,
        "vllm-e2e",
        &[
            "vllm/test_units.py",
            "vllm/test_contract.py",
            "vllm/test_e2e.py",
            "vllm/test_kv_identity.py",
            "vllm/test_router.py",
            "vllm/test_quickstart.py",
            "vllm/test_ops.py",
            "vllm/test_restart.py",
            "vllm/test_engine_bench.py",
            "python/test_proxy.py",
        ],
        &[],
        &[
            "push",
            "push-layerwise",
            "pull-eager",
            "pull-delay",
            "fault",
            "serve",
            "lora-push",
            "lora-pull-delay",
            "partial-prefix",
            "router-flow-push",
            "router-flow-pull-delay",
            "router-flow-faults",
            "router-push",
            "router-pull-eager",
            "router-pull-delay",
            "router-push-layerwise",
            "router-2p1d",
            "quickstart",
            "abort-before-load",
            "abort-after-load-started",
            "lease-outlived",
            "prefill-killed-mid-transfer",
            "metrics",
            "kv-both",
            "prefill-restart",
            "engine-bench",
        ],
    );
}
