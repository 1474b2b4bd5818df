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

/// `check-config` prints each rank's listener ports: fixed by `pd_base_port`
/// or its own key, or `free` (picked at start).
#[test]
fn check_config_prints_the_port_table_of_every_rank() {
    let f = std::env::temp_dir().join(format!("apd-ports-{}.yaml", std::process::id()));
    std::fs::write(
        &f,
        "enable_pd: true\ntransfer_channel: tcp\npd_role: receiver\npd_peer_host: 10.0.0.2\n\
         pd_bind_host: 0.0.0.0\npd_base_port: 30000\ntp_size: 2\npd_buffer_size: 1\n\
         pd_buffer_device: cpu\n",
    )
    .unwrap();
    let (ok, out, err) = bench(&["check-config", f.to_str().unwrap()]);
    assert!(ok, "{out}{err}");
    assert!(
        out.contains("bound on 0.0.0.0, advertised as 10.0.0.2"),
        "{out}"
    );
    for (rank, port, key) in [
        (0, 30000, "pd_peer_init_port"),
        (0, 30001, "pd_peer_alloc_port"),
        (0, 30003, "pd_data_port"),
        (1, 30020, "pd_peer_init_port"),
        (1, 30023, "pd_data_port"),
    ] {
        let line = format!("# {rank:<5} {port:<6} {key}");
        assert!(out.contains(&line), "no {line:?} in {out}");
    }
    let _ = std::fs::remove_file(f);
}

mod doctor {
    use super::bench;
    use ascend_pd::config::{ChannelKind, PdConfig, PortList, Role};
    use ascend_pd::Receiver;

    fn free_port() -> u16 {
        ascend_pd::config::loopback_port().unwrap()
    }

    fn yaml(path: &std::path::Path, text: &str) -> String {
        std::fs::write(path, text).unwrap();
        path.to_str().unwrap().to_string()
    }

    fn sender_yaml(name: &str, model: &str, extra: &str) -> String {
        let p = std::env::temp_dir().join(format!("apd-doctor-{}-{name}.yaml", std::process::id()));
        yaml(
            &p,
            &format!(
                "enable_pd: true\ntransfer_channel: tcp\npd_role: sender\npd_peer_host: 127.0.0.1\n\
                 pd_proxy_host: 127.0.0.1\npd_proxy_port: {}\npd_buffer_size: 1\n\
                 pd_buffer_device: cpu\nkv_num_layers: 2\nkv_num_heads: 2\nkv_head_size: 16\n\
                 chunk_size: 16\npd_model_identity: {model}\n{extra}",
                free_port()
            ),
        )
    }

    /// A decode serving KV of `model` over tcp, push mode.
    fn decode(model: &str) -> (Receiver, String) {
        let mut c = PdConfig::with_defaults(Role::Receiver);
        c.transfer_channel = ChannelKind::Tcp;
        c.buffer_device = ascend_pd::config::BufferDevice::Cpu;
        c.chunk_size = 16;
        c.kv.num_layers = 2;
        c.kv.num_kv_heads = 2;
        c.kv.head_size = 16;
        c.kv.hidden_size = 32;
        c.buffer_size = 4 * c.page_bytes();
        c.peer_host = Some("127.0.0.1".into());
        let (init, alloc) = (free_port(), free_port());
        c.peer_init_port = Some(PortList::Single(init));
        c.peer_alloc_port = Some(PortList::Single(alloc));
        c.model_identity = Some(model.into());
        (
            Receiver::start(&c, 0).unwrap(),
            format!("127.0.0.1:{init}:{alloc}"),
        )
    }

    #[test]
    fn a_matching_decode_passes_every_check() {
        let (_r, at) = decode("tiny@1111");
        let cfg = sender_yaml("match", "tiny@1111", "");
        let (ok, out, err) = bench(&["doctor", "--config", &cfg, "--receiver", &at]);
        assert!(ok, "{out}{err}");
        assert!(out.contains("ok    handshake: decode 127.0.0.1:"), "{out}");
        assert!(out.contains("model tiny@1111"), "{out}");
        assert!(out.contains("all checks passed"), "{out}");
    }

    #[test]
    fn another_model_a_taken_port_and_a_silent_peer_fail_by_name() {
        let (_r, at) = decode("tiny@1111");
        // The port pd_data_port fixes is held by another process (here: us).
        let held = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = held.local_addr().unwrap().port();
        let silent = free_port();
        let cfg = sender_yaml("mismatch", "tiny@2222", &format!("pd_data_port: {port}\n"));
        let (ok, out, err) = bench(&[
            "doctor",
            "--config",
            &cfg,
            "--receiver",
            &at,
            "--reach",
            &format!("127.0.0.1:{silent}"),
        ]);
        assert!(!ok, "{out}{err}");
        assert!(
            out.contains(&format!(
                "FAIL  pd_data_port (tcp transfer server): 127.0.0.1:{port}"
            )),
            "{out}"
        );
        assert!(
            out.contains(&format!(
                "FAIL  --reach: 127.0.0.1:{silent} does not answer"
            )),
            "{out}"
        );
        let hs = out
            .lines()
            .skip_while(|l| !l.starts_with("FAIL  handshake"))
            .take(2)
            .collect::<Vec<_>>()
            .join("\n");
        assert!(
            hs.contains("tiny@1111") && hs.contains("tiny@2222"),
            "{out}"
        );
        assert!(hs.contains("pd_model_identity"), "{hs}");
        assert!(out.contains("3 check(s) failed"), "{out}");
        drop(held);
    }
}
