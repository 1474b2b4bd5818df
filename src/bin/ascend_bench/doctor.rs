//! `ascend-bench doctor --config F`: checks from one worker what a broken
//! deployment would otherwise show only as a decode that silently
//! recomputes. In order: the config validates; its bind address is one of
//! this machine's; every listener port it fixes can be bound; the peer
//! addresses given answer; and, from a prefill's config with `--receiver`,
//! a real handshake with that decode: the same deployment secret, the same
//! model identity, a compatible release, mode, channel and TP split. Each
//! failure names its fix; the exit code says whether all passed.

use anyhow::Result;
use ascend_pd::backend::TransferSpec;
use ascend_pd::config::{BufferDevice, PdConfig, PortList, Role};
use ascend_pd::Sender;
use std::io::Write;
use std::net::{TcpListener, TcpStream, ToSocketAddrs};
use std::time::Duration;

#[derive(clap::Parser, Debug)]
#[command(about = "check a worker's deployment: config, ports, peers, the handshake")]
struct DoctorCli {
    /// The worker's YAML config.
    #[arg(long, value_name = "FILE")]
    config: String,
    /// Its TP rank (which of each per-rank port list it uses).
    #[arg(long, default_value_t = 0)]
    rank: usize,
    /// A decode to hand-shake with from this prefill's config:
    /// HOST:INIT_PORT:ALLOC_PORT (its pd_peer_host and ports for this rank).
    #[arg(long, value_name = "HOST:INIT:ALLOC")]
    receiver: Option<String>,
    /// A peer address that must answer (the decode's or prefill's
    /// listeners as its check-config lists them); repeatable.
    #[arg(long, value_name = "HOST:PORT")]
    reach: Vec<String>,
}

/// One check's line.
struct Checks<'a, W: Write> {
    out: &'a mut W,
    failed: usize,
}

impl<W: Write> Checks<'_, W> {
    fn pass(&mut self, what: &str, detail: impl std::fmt::Display) {
        let _ = writeln!(self.out, "ok    {what}: {detail}");
    }

    fn fail(&mut self, what: &str, problem: impl std::fmt::Display, fix: &str) {
        self.failed += 1;
        let _ = writeln!(self.out, "FAIL  {what}: {problem}\n      fix: {fix}");
    }

    fn note(&mut self, what: &str, detail: impl std::fmt::Display) {
        let _ = writeln!(self.out, "--    {what}: {detail}");
    }
}

pub fn doctor_main(args: &[String]) -> Result<bool> {
    let Some(a) = crate::args::parse::<DoctorCli>("doctor", args)? else {
        return Ok(true);
    };
    let mut stdout = std::io::stdout();
    Ok(run(&a, &mut stdout))
}

fn run(a: &DoctorCli, out: &mut impl Write) -> bool {
    let mut c = Checks { out, failed: 0 };
    let halves = match PdConfig::load_roles(&a.config) {
        Ok(h) => h,
        Err(e) => {
            c.fail(
                "config",
                e,
                "correct the keys named above (`ascend-bench check-config` prints the effective values)",
            );
            return false;
        }
    };
    // `pd_role: both`: each half in turn (the sender's hand-shakes).
    let both = halves.len() > 1;
    for loaded in halves {
        check_worker(&mut c, a, loaded, both);
    }
    for addr in &a.reach {
        check_reach(&mut c, addr, "--reach");
    }
    let failed = c.failed;
    let _ = writeln!(
        c.out,
        "{}",
        match failed {
            0 => "all checks passed".to_string(),
            n => format!("{n} check(s) failed"),
        }
    );
    failed == 0
}

fn check_worker(
    c: &mut Checks<'_, impl Write>,
    a: &DoctorCli,
    loaded: ascend_pd::config::LoadedConfig,
    both: bool,
) {
    let config = {
        {
            let cfg = loaded.config;
            c.pass(
                "config",
                format!(
                    "{} valid ({} {}, {} over {})",
                    a.config,
                    cfg.role.name(),
                    cfg.mode(),
                    cfg.buffer_device,
                    cfg.transfer_channel.name()
                ),
            );
            for w in loaded.warnings {
                c.note("config warning", w);
            }
            cfg
        }
    };
    if a.rank >= config.tp_size {
        c.fail(
            "rank",
            format!("--rank {} but tp_size is {}", a.rank, config.tp_size),
            "give a rank below tp_size",
        );
        return;
    }
    check_listeners(c, &config, a.rank);
    match (&a.receiver, config.role) {
        (Some(r), Role::Sender) => check_receiver(c, &config, a.rank, r),
        (Some(_), Role::Receiver) if both => c.note(
            "handshake",
            "the receiver half is checked from the engines that send to it",
        ),
        (Some(_), Role::Receiver) => c.fail(
            "--receiver",
            "this is a receiver's config: only a sender hand-shakes with a receiver",
            "run the doctor with the prefill's config, or check a prefill with --reach",
        ),
        (None, Role::Sender) => c.note(
            "handshake",
            "not checked: give --receiver HOST:INIT:ALLOC (a decode's pd_peer_host and ports) to \
             check the secret, model identity and release against it",
        ),
        (None, Role::Receiver) => c.note(
            "handshake",
            "a decode is checked from its prefill: run `ascend-bench doctor --config <prefill.yaml> \
             --receiver <this host>:<init>:<alloc>` there",
        ),
    }
}

/// The bind address is local, and every fixed port of `rank` binds.
fn check_listeners(c: &mut Checks<'_, impl Write>, config: &PdConfig, rank: usize) {
    let host = config.bind_host();
    match TcpListener::bind((host, 0)) {
        Ok(_) => c.pass(
            "bind address",
            format!(
                "{host} (advertised to peers as {})",
                config.peer_host.as_deref().unwrap_or("127.0.0.1")
            ),
        ),
        Err(e) => {
            c.fail(
                "bind address",
                format!("cannot bind {host}: {e}"),
                "set pd_bind_host to an address of this machine (0.0.0.0 for every interface); \
                 pd_peer_host stays the address peers are told",
            );
            return;
        }
    }
    for (listener, port) in config.port_table(rank) {
        let what = format!("{} ({})", listener.key(), listener.what());
        if port == 0 {
            c.note(
                &what,
                "a free port picked at start (fix it with its key or pd_base_port where a \
                 firewall or container needs to know it)",
            );
            continue;
        }
        match TcpListener::bind((host, port)) {
            Ok(_) => c.pass(&what, format!("{host}:{port} binds")),
            Err(e) => c.fail(
                &what,
                format!("{host}:{port} cannot be bound: {e}"),
                &format!(
                    "stop what holds the port (`ss -ltnp 'sport = :{port}'`; a worker of this \
                     config already running holds it too), or set {}",
                    listener.key()
                ),
            ),
        }
    }
}

/// `addr` answers a TCP connect.
fn check_reach(c: &mut Checks<'_, impl Write>, addr: &str, what: &str) {
    let resolved = match addr.to_socket_addrs() {
        Ok(mut it) => it.next(),
        Err(_) => None,
    };
    let Some(sock) = resolved else {
        c.fail(
            what,
            format!("{addr:?} is not HOST:PORT or does not resolve"),
            "give HOST:PORT with a host this machine resolves",
        );
        return;
    };
    match TcpStream::connect_timeout(&sock, Duration::from_secs(3)) {
        Ok(_) => c.pass(what, format!("{addr} answers")),
        Err(e) => c.fail(
            what,
            format!("{addr} does not answer: {e}"),
            "start the peer, check its advertised host (pd_peer_host) and that a firewall or \
             container network lets this port through (fixed ports: pd_base_port)",
        ),
    }
}

/// The decode at `spec` (`HOST:INIT:ALLOC`) answers on both ports, then a
/// handshake from a sender built from `config` (a one-page CPU pool, free
/// ports, so it runs beside the real worker) agrees with it.
fn check_receiver(c: &mut Checks<'_, impl Write>, config: &PdConfig, rank: usize, spec: &str) {
    let parts: Vec<&str> = spec.rsplitn(3, ':').collect();
    let (Some(host), Some(Ok(init)), Some(Ok(alloc))) = (
        parts.get(2),
        parts.get(1).map(|p| p.parse::<u16>()),
        parts.first().map(|p| p.parse::<u16>()),
    ) else {
        c.fail(
            "--receiver",
            format!("{spec:?} is not HOST:INIT_PORT:ALLOC_PORT"),
            "give the decode's pd_peer_host and its pd_peer_init_port and pd_peer_alloc_port for this rank",
        );
        return;
    };
    let before = c.failed;
    check_reach(c, &format!("{host}:{init}"), "decode handshake port");
    check_reach(c, &format!("{host}:{alloc}"), "decode request port");
    if c.failed > before {
        return;
    }
    let mut probe = config.clone();
    // Beside the running worker: its own free ports and one CPU page.
    probe.base_port = None;
    probe.data_port = None;
    probe.liveness_port = None;
    probe.register_port = None;
    probe.hixl.port = 0;
    probe.bind_host = None;
    if probe.pull_mode {
        match ascend_pd::config::loopback_port() {
            Ok(p) => probe.pull_done_port = Some(PortList::Single(p)),
            Err(e) => {
                c.fail(
                    "handshake",
                    format!("no free port for the probe: {e}"),
                    "free a port",
                );
                return;
            }
        }
    }
    if probe.transfer_channel.needs_acl_memory() && !ascend_sys::available() {
        c.note(
            "handshake",
            format!(
                "not checked: transfer_channel {} needs the CANN runtime on this machine",
                probe.transfer_channel.name()
            ),
        );
        return;
    }
    if !probe.transfer_channel.needs_acl_memory() {
        probe.buffer_device = BufferDevice::Cpu;
        probe.use_cpu_offload = false;
    }
    probe.buffer_size = probe.page_bytes();
    probe.cpu_buffer_size = None;
    let sender = match Sender::start(&probe, rank, Default::default()) {
        Ok(s) => s,
        Err(e) => {
            c.fail(
                "handshake",
                format!("could not start a probe sender from this config: {e}"),
                "fix what the error names",
            );
            return;
        }
    };
    let to = TransferSpec {
        req_id: "ascend-bench-doctor".into(),
        receiver_host: host.to_string(),
        receiver_init_port: PortList::Single(init),
        receiver_alloc_port: PortList::Single(alloc),
        is_last_prefill: true,
        receiver_rank: None,
    };
    match sender.check_receiver(&to) {
        Ok(hello) => c.pass(
            "handshake",
            format!(
                "decode {} runs ascend-pd {}, model {}, {} over {}{}",
                hello.node,
                hello.lib.as_deref().unwrap_or("(older than 0.1)"),
                hello.model.as_deref().unwrap_or("(not named)"),
                hello.mode,
                hello.channel.name(),
                if sender.config().auth_secret_file.is_some()
                    || std::env::var_os(ascend_pd::auth::SECRET_ENV).is_some()
                {
                    ", the same deployment secret"
                } else {
                    ", unauthenticated (no pd_auth_secret_file)"
                }
            ),
        ),
        Err(e) => c.fail(
            "handshake",
            e,
            "make the two sides agree on what the error names (the same pd_auth_secret_file \
             content, model, ascend-pd release, transfer mode and channel)",
        ),
    }
    sender.close(Duration::ZERO);
}
