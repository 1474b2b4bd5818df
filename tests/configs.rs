//! Every file in configs/ loads and validates, its name matches what it
//! configures, and `ascend-bench check-config` reports good and bad files.

use ascend_pd::config::{PdConfig, Role, TransferMode};
use std::path::{Path, PathBuf};
use std::process::Command;

fn shipped() -> Vec<PathBuf> {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs");
    let mut files: Vec<PathBuf> = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|x| x == "yaml"))
        .collect();
    files.sort();
    files
}

#[test]
fn every_shipped_config_is_valid_and_named_for_what_it_is() {
    let files = shipped();
    assert!(
        files.len() >= 16,
        "expected sender+receiver for 4 modes x 2 flavours, got {files:?}"
    );
    for f in &files {
        let name = f.file_stem().unwrap().to_str().unwrap();
        let loaded = PdConfig::load(f).unwrap_or_else(|e| panic!("{}: {e}", f.display()));
        let c = &loaded.config;
        let role = if name.contains("sender") {
            Role::Sender
        } else {
            Role::Receiver
        };
        assert_eq!(c.role, role, "{name}");
        let mode = if name.contains("pull-delay") {
            TransferMode::PullDelay
        } else if name.contains("pull-eager") {
            TransferMode::PullEager
        } else {
            TransferMode::Push
        };
        assert_eq!(c.mode(), mode, "{name}");
        assert_eq!(
            c.use_cpu_offload,
            name.contains("offload") && role == Role::Sender,
            "{name}"
        );
        assert_eq!(c.layerwise, name.contains("layerwise"), "{name}");
        if name.starts_with("loopback") {
            for host in [&c.peer_host, &c.proxy_host].into_iter().flatten() {
                assert_eq!(
                    host, "127.0.0.1",
                    "{name}: loopback configs stay on this host"
                );
            }
        }
        // The only accepted warning is the LMCache example's below-one-chunk NPU buffer.
        for w in &loaded.warnings {
            assert!(
                w.contains("rounded up to one page"),
                "{name}: unexpected warning {w}"
            );
        }
    }
    // Layer-wise push is a sender option, paired with the push receivers.
    for name in [
        "sender-push-layerwise.yaml",
        "loopback-push-layerwise-sender.yaml",
    ] {
        assert!(
            files.iter().any(|f| f.ends_with(name)),
            "configs/{name} is missing"
        );
    }
    // Each mode has both sides in both flavours.
    for mode in ["push", "pull-eager", "pull-delay", "pull-delay-offload"] {
        for side in ["sender", "receiver"] {
            for name in [
                format!("{side}-{mode}.yaml"),
                format!("loopback-{mode}-{side}.yaml"),
            ] {
                assert!(
                    files.iter().any(|f| f.ends_with(&name)),
                    "configs/{name} is missing"
                );
            }
        }
    }
}

fn bench(args: &[&str]) -> (bool, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_ascend-bench"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.success(),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn check_config_prints_effective_values_for_a_valid_file() {
    let f = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/sender-pull-delay-offload.yaml");
    let (ok, out, err) = bench(&["check-config", f.to_str().unwrap()]);
    assert!(ok, "{out}{err}");
    assert!(out.contains("valid (sender pull-delay"), "{out}");
    assert!(
        out.contains("pd_alloc_fail_backoff_ttl: 2.0"),
        "defaults filled in: {out}"
    );
    assert!(out.contains("pd_pull_done_port: [7600, 7601]"), "{out}");
    assert!(
        out.contains("pd_buffer_size: 33554432"),
        "rounded to one page: {out}"
    );
    assert!(
        err.contains("warning:") && err.contains("rounded up"),
        "{err}"
    );
    // This machine has no CANN (unless the environment points at one).
    if std::env::var_os("ASCEND_PD_CANN_LIB_DIR").is_none() && !ascend_sys::available() {
        assert!(err.contains("needs the CANN runtime"), "{err}");
        assert!(err.contains("ASCEND_PD_CANN_LIB_DIR"), "{err}");
    }
}

#[test]
fn check_config_fails_on_an_invalid_file_and_names_the_key() {
    let dir = std::env::temp_dir().join(format!("ascend-pd-cfg-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let bad = dir.join("bad.yaml");
    std::fs::write(
        &bad,
        "enable_pd: true\npd_role: receiver\npd_delay_pull: true\npd_buffer_size: 1024\n\
         pd_peer_host: h\npd_peer_init_port: 1\npd_peer_alloc_port: 2\n",
    )
    .unwrap();
    let syntax = dir.join("syntax.yaml");
    std::fs::write(&syntax, "enable_pd: true\npd_role: [x\n").unwrap();
    let good = Path::new(env!("CARGO_MANIFEST_DIR")).join("configs/loopback-push-receiver.yaml");
    let (ok, out, err) = bench(&[
        "check-config",
        good.to_str().unwrap(),
        bad.to_str().unwrap(),
        syntax.to_str().unwrap(),
    ]);
    assert!(!ok, "one invalid file must fail the run");
    assert!(out.contains("loopback-push-receiver.yaml: valid"), "{out}");
    assert!(out.contains("bad.yaml: INVALID"), "{out}");
    assert!(
        err.contains("pd_delay_pull:") && err.contains("pd_pull_mode: true"),
        "{err}"
    );
    assert!(err.contains("YAML syntax error at line"), "{err}");
    let (ok, _, err) = bench(&["check-config", "/nonexistent/x.yaml"]);
    assert!(
        !ok && err.contains("cannot read config /nonexistent/x.yaml"),
        "{err}"
    );
    let (ok, _, err) = bench(&["frobnicate"]);
    assert!(!ok && err.contains("unknown command"), "{err}");
    std::fs::remove_dir_all(&dir).ok();
}
