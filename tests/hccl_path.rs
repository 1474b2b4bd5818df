//! `pd_hccl_path`: which path `transfer_channel: hccl` runs. Under the
//! CANN emulator (which provides HIXL) `auto` opens the HIXL path and says
//! so in the log; `comm` forces HCCL's communicator path; and two ends on
//! different paths are refused in the handshake, on both sides, by an
//! error naming `pd_hccl_path`. Nothing here ran on Ascend hardware.

use ascend_pd::channel::handshake::{self, HandshakeEvent, HandshakeServer, Hello};
use ascend_pd::channel::{self as chan, ChannelError, TransferChannel};
use ascend_pd::config::{ChannelKind, HcclPath, PdConfig, Role, TransferMode};
use ascend_pd::memory::npu::AclRuntime;
use ascend_pd::memory::{PagePool, RegisteredBuffer};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::Duration;

const PAGE: usize = 64 << 10;

/// Every log line of this process, kept for the assertions.
struct Captured(Mutex<Vec<String>>);

impl log::Log for Captured {
    fn enabled(&self, _: &log::Metadata<'_>) -> bool {
        true
    }
    fn log(&self, record: &log::Record<'_>) {
        if record.level() <= log::Level::Info {
            let mut lines = self.0.lock().unwrap_or_else(|p| p.into_inner());
            lines.push(record.args().to_string());
        }
    }
    fn flush(&self) {}
}

fn logs() -> &'static Captured {
    static LOGS: OnceLock<&'static Captured> = OnceLock::new();
    LOGS.get_or_init(|| {
        let c: &'static Captured = Box::leak(Box::new(Captured(Mutex::new(Vec::new()))));
        log::set_logger(c).expect("the only logger of this test binary");
        log::set_max_level(log::LevelFilter::Info);
        c
    })
}

fn logged(words: &str) -> bool {
    logs()
        .0
        .lock()
        .unwrap_or_else(|p| p.into_inner())
        .iter()
        .any(|l| l.contains(words))
}

fn runtime() -> &'static AclRuntime {
    static RT: OnceLock<AclRuntime> = OnceLock::new();
    RT.get_or_init(|| {
        let dir = ascend_emu::install_dir().expect("the emulator is a dev-dependency");
        AclRuntime::from_dir(&dir).expect("the emulator loads")
    })
}

/// A config for `transfer_channel: hccl` with `path`.
fn config(role: Role, path: HcclPath) -> PdConfig {
    let mut c = PdConfig::with_defaults(role);
    c.transfer_channel = ChannelKind::Hccl;
    c.hccl_path = path;
    c
}

/// The channel `config` opens over one pinned host pool of the emulator.
fn open(config: &PdConfig, node: &str) -> Arc<dyn TransferChannel> {
    let buf = RegisteredBuffer::pinned_host(runtime(), 0, 4 * PAGE, PAGE).unwrap();
    let pool = PagePool::new(buf);
    chan::open_configured(
        config,
        &chan::Listeners::any("127.0.0.1"),
        node,
        &[pool],
        None,
    )
    .unwrap()
}

#[test]
fn auto_runs_the_hixl_path_where_hixl_loads_and_says_so() {
    logs();
    let ch = open(&config(Role::Sender, HcclPath::Auto), "auto");
    assert_eq!(ch.kind(), ChannelKind::Hixl);
    assert!(
        logged(
            "transfer_channel hccl runs the HIXL path: pd_hccl_path is auto and HIXL loaded from"
        ),
        "{:?}",
        logs().0.lock().unwrap()
    );
}

#[test]
fn comm_forces_hccls_communicator_path() {
    logs();
    let ch = open(&config(Role::Sender, HcclPath::Comm), "comm");
    assert_eq!(ch.kind(), ChannelKind::Hccl);
    assert!(logged(
        "transfer_channel hccl runs HCCL's comm path, as pd_hccl_path: comm asks"
    ));
    let ch = open(&config(Role::Sender, HcclPath::Hixl), "hixl");
    assert_eq!(ch.kind(), ChannelKind::Hixl);
}

/// A listening side on `listen` and a connecting side on `connect`: the
/// connecting side's error, and what the listening side reported.
fn pair(listen: HcclPath, connect: HcclPath) -> (ChannelError, String) {
    let ctx = zmq::Context::new();
    let rx_ch = open(&config(Role::Receiver, listen), "decoder");
    let (tx, events) = crossbeam_channel::unbounded();
    let hello = Hello::local(
        "decoder",
        Role::Receiver,
        TransferMode::Push,
        Duration::from_secs(30),
        rx_ch.as_ref(),
    );
    let server = HandshakeServer::spawn(&ctx, "tcp://127.0.0.1:*", rx_ch, hello, tx).unwrap();
    let tx_ch = open(&config(Role::Sender, connect), "prefill");
    let hello = Hello::local(
        "prefill",
        Role::Sender,
        TransferMode::Push,
        Duration::from_secs(30),
        tx_ch.as_ref(),
    );
    let e = handshake::connect(
        &ctx,
        server.url(),
        tx_ch.as_ref(),
        &hello,
        Duration::from_secs(10),
    )
    .expect_err("different paths must not attach");
    let seen = match events.recv_timeout(Duration::from_secs(10)).unwrap() {
        HandshakeEvent::Refused { error, .. } => error.to_string(),
        HandshakeEvent::Attached(a) => panic!("attached {}", a.remote.node),
    };
    (e, seen)
}

#[test]
fn ends_on_different_paths_are_refused_naming_pd_hccl_path() {
    for (listen, connect) in [
        (HcclPath::Comm, HcclPath::Auto),
        (HcclPath::Hixl, HcclPath::Comm),
    ] {
        let (e, theirs) = pair(listen, connect);
        let ours = e.to_string();
        for text in [&ours, &theirs] {
            assert!(
                text.contains("pd_hccl_path")
                    && text.contains("HIXL path")
                    && text.contains("comm path"),
                "{listen:?} vs {connect:?}: {text}"
            );
        }
        assert!(matches!(e, ChannelError::Handshake(_)), "{e:?}");
    }
    // The same path on both ends attaches.
    let ctx = zmq::Context::new();
    let rx_ch = open(&config(Role::Receiver, HcclPath::Auto), "decoder-ok");
    let (tx, _events) = crossbeam_channel::unbounded();
    let hello = |ch: &dyn TransferChannel, node: &str, role| {
        Hello::local(node, role, TransferMode::Push, Duration::from_secs(30), ch)
    };
    let h = hello(rx_ch.as_ref(), "decoder-ok", Role::Receiver);
    let server = HandshakeServer::spawn(&ctx, "tcp://127.0.0.1:*", rx_ch, h, tx).unwrap();
    let tx_ch = open(&config(Role::Sender, HcclPath::Hixl), "prefill-ok");
    let h = hello(tx_ch.as_ref(), "prefill-ok", Role::Sender);
    let a = handshake::connect(
        &ctx,
        server.url(),
        tx_ch.as_ref(),
        &h,
        Duration::from_secs(10),
    )
    .unwrap();
    assert_eq!(a.remote.channel, ChannelKind::Hixl);
}
