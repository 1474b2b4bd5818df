//! The proof that a worker can embed ascend-pd: the C pair (examples/c/)
//! and the Python pair (examples/python/) each run as two processes plus
//! `ascend-bench proxy`, move five requests in push, pull-eager and
//! pull-delay, cancel one on each side, verify every byte of the decode
//! KV cache and see every pool back at its start (the examples check
//! this themselves and exit non-zero otherwise; see
//! examples/README.md for the plan both pairs follow).

mod common;

use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdout, Command, Stdio};
use std::sync::mpsc;
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

const MODES: [(&str, bool, bool); 3] = [
    ("push", false, false),
    ("pull-eager", true, false),
    ("pull-delay", true, true),
];

struct Ports {
    init: u16,
    alloc: u16,
    proxy: u16,
    done: u16,
}

const GEOMETRY: &str = "enable_pd: True\nlocal_cpu: False\ntransfer_channel: \"shm\"\n\
pd_peer_host: \"127.0.0.1\"\npd_buffer_size: 4194304\npd_buffer_device: \"cpu\"\n\
chunk_size: 16\nkv_num_layers: 2\nkv_num_heads: 2\nkv_head_size: 16\nkv_dtype: \"float16\"\n";

/// Writes the receiver's and the sender's YAML for `mode` into `dir`.
fn configs(dir: &Path, pull: bool, delay: bool, p: &Ports) -> (PathBuf, PathBuf) {
    let flags = format!(
        "pd_pull_mode: {}\npd_delay_pull: {}\n",
        if pull { "True" } else { "False" },
        if delay { "True" } else { "False" }
    );
    let recv = dir.join("receiver.yaml");
    std::fs::write(
        &recv,
        format!(
            "{GEOMETRY}{flags}pd_role: \"receiver\"\npd_peer_init_port: {}\npd_peer_alloc_port: {}\n",
            p.init, p.alloc
        ),
    )
    .unwrap();
    let send = dir.join("sender.yaml");
    let mut text = format!(
        "{GEOMETRY}{flags}pd_role: \"sender\"\npd_proxy_host: \"127.0.0.1\"\npd_proxy_port: {}\n",
        p.proxy
    );
    if pull {
        text += &format!("pd_pull_done_port: {}\n", p.done);
    }
    std::fs::write(&send, text).unwrap();
    (recv, send)
}

/// Collects a child's stdout on a thread; lines also go to a channel.
fn collect(out: ChildStdout) -> (mpsc::Receiver<String>, std::thread::JoinHandle<String>) {
    let (tx, rx) = mpsc::channel();
    let t = std::thread::spawn(move || {
        let mut all = String::new();
        for line in BufReader::new(out).lines() {
            let Ok(line) = line else { break };
            all += &line;
            all.push('\n');
            let _ = tx.send(line);
        }
        all
    });
    (rx, t)
}

fn stderr_of(c: &mut Child) -> String {
    let mut s = String::new();
    if let Some(mut e) = c.stderr.take() {
        let _ = e.read_to_string(&mut s);
    }
    s
}

/// Waits for `c` to exit within `limit`; kills it otherwise.
fn wait(c: &mut Child, limit: Duration) -> Option<std::process::ExitStatus> {
    let end = Instant::now() + limit;
    loop {
        if let Some(st) = c.try_wait().unwrap() {
            return Some(st);
        }
        if Instant::now() > end {
            let _ = c.kill();
            let _ = c.wait();
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Runs one pair in one mode: proxy, decode (until "decode: ready"), then
/// prefill; closes decode's stdin once prefill exited.
fn run_pair(
    label: &str,
    mode: (&str, bool, bool),
    prefill: impl Fn(&Path, &Ports) -> Command,
    decode: impl Fn(&Path) -> Command,
) {
    let (name, pull, delay) = mode;
    let dir = std::env::temp_dir().join(format!(
        "apd-examples-{label}-{name}-{}",
        std::process::id()
    ));
    std::fs::create_dir_all(&dir).unwrap();
    let p = Ports {
        init: common::free_port(),
        alloc: common::free_port(),
        proxy: common::free_port(),
        done: common::free_port(),
    };
    let (recv_yaml, send_yaml) = configs(&dir, pull, delay, &p);

    let mut proxy = Command::new(env!("CARGO_BIN_EXE_ascend-bench"))
        .args(["proxy", "--port", &p.proxy.to_string()])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("starting ascend-bench proxy");
    let (proxy_lines, proxy_out) = collect(proxy.stdout.take().unwrap());

    let mut dec = decode(&recv_yaml)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{label} decode: {e}"));
    let (dec_lines, dec_out) = collect(dec.stdout.take().unwrap());
    let ready = Instant::now() + Duration::from_secs(30);
    loop {
        match dec_lines.recv_timeout(Duration::from_millis(100)) {
            Ok(l) if l.starts_with("decode: ready") => break,
            Ok(_) => {}
            Err(_) if Instant::now() > ready || dec.try_wait().unwrap().is_some() => {
                let _ = dec.kill();
                panic!(
                    "{label} {name}: decode never got ready: {}{}",
                    dec_out.join().unwrap(),
                    stderr_of(&mut dec)
                );
            }
            Err(_) => {}
        }
    }
    // The proxy must be listening before the first ProxyNotif.
    let _ = proxy_lines.recv_timeout(Duration::from_secs(10));

    let mut pre = prefill(&send_yaml, &p)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap_or_else(|e| panic!("{label} prefill: {e}"));
    let (_, pre_out) = collect(pre.stdout.take().unwrap());
    let pre_status = wait(&mut pre, Duration::from_secs(180));
    let pre_err = stderr_of(&mut pre);
    let pre_text = pre_out.join().unwrap();
    // The prefill is done: let the decode side finish.
    drop(dec.stdin.take());
    let dec_status = wait(&mut dec, Duration::from_secs(60));
    let dec_err = stderr_of(&mut dec);
    let dec_text = dec_out.join().unwrap();
    let _ = proxy.kill();
    let _ = proxy.wait();
    let proxy_text = proxy_out.join().unwrap();

    let report = format!(
        "--- prefill ({pre_status:?})\n{pre_text}{pre_err}\n--- decode ({dec_status:?})\n{dec_text}{dec_err}"
    );
    assert!(
        pre_status.is_some_and(|s| s.success()) && dec_status.is_some_and(|s| s.success()),
        "{label} {name} failed:\n{report}"
    );
    assert!(pre_text.contains("prefill: OK 5 saves"), "{report}");
    assert!(dec_text.contains("decode: OK 3 loads verified"), "{report}");
    // Every save carried the request's last chunk: the proxy heard of all five.
    let notifs = proxy_text.matches("\"proxy_notif\"").count();
    assert_eq!(
        notifs, 5,
        "{label} {name}: proxy saw {notifs} ProxyNotif\n{proxy_text}"
    );
    println!("=== {label} {name}\n{report}");
    let _ = std::fs::remove_dir_all(&dir);
}

fn build_c(name: &str, out_dir: &Path) -> PathBuf {
    let lib = common::cdylib();
    let libdir = lib.parent().unwrap();
    let exe = out_dir.join(name);
    let status = Command::new("cc")
        .args([
            "-std=c11",
            "-Wall",
            "-Wextra",
            "-Werror",
            "-pedantic",
            "-O1",
        ])
        .arg("-I")
        .arg(root().join("include"))
        .arg(root().join(format!("examples/c/{name}.c")))
        .arg("-o")
        .arg(&exe)
        .arg("-L")
        .arg(libdir)
        .arg("-lascend_pd")
        .arg(format!("-Wl,-rpath,{}", libdir.display()))
        .status()
        .expect("running cc");
    assert!(status.success(), "building examples/c/{name}.c");
    exe
}

#[test]
fn the_c_worker_pair_moves_cancels_and_verifies_in_every_mode() {
    let dir = std::env::temp_dir().join(format!("apd-examples-c-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let prefill = build_c("prefill", &dir);
    let decode = build_c("decode", &dir);
    for mode in MODES {
        run_pair(
            "c",
            mode,
            |yaml, p| {
                let mut c = Command::new(&prefill);
                c.arg(yaml)
                    .arg("127.0.0.1")
                    .arg(p.init.to_string())
                    .arg(p.alloc.to_string());
                c
            },
            |yaml| {
                let mut c = Command::new(&decode);
                c.arg(yaml);
                c
            },
        );
    }
}

/// The Python the examples run with: the project's test environment
/// (numpy, msgspec, pyzmq; see [`common::python`]).
fn python_with_numpy() -> String {
    common::python()
}

/// A system Python that can make virtual environments (for the pip test,
/// which installs the package into fresh ones).
fn python() -> String {
    std::env::var("PYTHON").unwrap_or_else(|_| "python3".into())
}

#[test]
fn the_python_worker_pair_moves_cancels_and_verifies_in_every_mode() {
    let py = python_with_numpy();
    let lib = common::cdylib();
    for mode in MODES {
        run_pair(
            "python",
            mode,
            |yaml, p| {
                let mut c = Command::new(&py);
                c.arg(root().join("examples/python/prefill.py"))
                    .arg(yaml)
                    .arg("127.0.0.1")
                    .arg(p.init.to_string())
                    .arg(p.alloc.to_string())
                    .env("ASCEND_PD_LIB", &lib);
                c
            },
            |yaml| {
                let mut c = Command::new(&py);
                c.arg(root().join("examples/python/decode.py"))
                    .arg(yaml)
                    .env("ASCEND_PD_LIB", &lib)
                    .env("PYTHONUNBUFFERED", "1");
                c
            },
        );
    }
}

/// Heterogeneous TP through the Python package: prefill TP 2 -> decode
/// TP 1 and 1 -> 2, each rank with its own numpy cache of its heads, saved
/// and loaded with the request API under plain keys and per-rank port
/// lists, then again through parked saves that every decode rank registers
/// for with every prefill rank (router-native flow, as vLLM's ranks do);
/// every loaded byte must be the decode rank's heads of the model, and
/// every pool back at its start; a decode of another TP size than the
/// prefill's pd_peer_tp_size is refused naming it (tests/python/hetero_tp.py).
#[test]
fn hetero_tp_python_workers_move_each_decode_ranks_heads_direct_and_parked() {
    let py = python_with_numpy();
    let lib = common::cdylib();
    for (a, b, mode) in [
        (2, 1, "push"),
        (2, 1, "pull-delay"),
        (1, 2, "pull-eager"),
        (1, 2, "pull-delay"),
    ] {
        let ports: Vec<String> = (0..2 * b + a + 3)
            .map(|_| common::free_port().to_string())
            .collect();
        let out = Command::new(&py)
            .arg(root().join("tests/python/hetero_tp.py"))
            .args([a.to_string(), b.to_string(), mode.to_string()])
            .args(&ports)
            .env("ASCEND_PD_LIB", &lib)
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("hetero_tp: OK"),
            "{a} -> {b} {mode}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

/// A layer-wise save through the Python package (tests/python/layerwise.py):
/// a sender and a receiver over loopback tcp, each layer written just
/// before it is handed over; not available before the last layer, every
/// loaded byte right; a save closed early fails and both pools are full
/// again.
#[test]
fn a_layer_wise_save_through_python_lands_every_byte_and_an_early_close_fails_it() {
    let py = python_with_numpy();
    let out = Command::new(&py)
        .arg(root().join("tests/python/layerwise.py"))
        .arg(common::free_port().to_string())
        .arg(common::free_port().to_string())
        .env("ASCEND_PD_LIB", common::cdylib())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success() && stdout.contains("layerwise: OK"),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
}

/// The router-native flow through the Python package
/// (tests/python/register.py), in push and pull-delay: a parked save
/// sends nothing until a decode registers, then every byte lands (less
/// the chunks the decode holds) and both pools are full again; an
/// unknown transfer is refused at once, an unregistered one expires
/// after pd_park_timeout, and with pd_auth_secret_file a registration
/// without the secret is dropped while the parked save waits for a
/// legit one.
#[test]
fn python_parked_saves_go_to_the_decode_that_registers_and_expire_or_drop_otherwise() {
    let py = python_with_numpy();
    let lib = common::cdylib();
    for mode in ["push", "pull-delay"] {
        let ports: Vec<String> = (0..13).map(|_| common::free_port().to_string()).collect();
        let out = Command::new(&py)
            .arg(root().join("tests/python/register.py"))
            .arg(mode)
            .args(&ports)
            .env("ASCEND_PD_LIB", &lib)
            .env_remove("ASCEND_PD_AUTH_SECRET_FILE")
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success() && stdout.contains("register: OK"),
            "{mode}: {stdout}{}",
            String::from_utf8_lossy(&out.stderr)
        );
    }
}

#[test]
fn bad_input_through_python_raises_the_librarys_message() {
    let py = python_with_numpy();
    let out = Command::new(&py)
        .arg(root().join("tests/python/errors.py"))
        .arg(common::free_port().to_string())
        .arg(common::free_port().to_string())
        .env("ASCEND_PD_LIB", common::cdylib())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        stdout.contains("all python bad-input checks passed"),
        "{stdout}"
    );
    assert!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count() >= 8,
        "{stdout}"
    );
}

/// A scratch directory removed when dropped, so a failed assertion
/// cleans up too.
struct ScratchDir(PathBuf);

impl ScratchDir {
    fn new(what: &str) -> Self {
        let dir = std::env::temp_dir().join(format!("apd-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        ScratchDir(dir)
    }
}

impl Drop for ScratchDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// Runs `cmd` (with `ASCEND_PD_LIB` and `PYTHONPATH` unset, so nothing
/// points at the checkout) and returns its stdout; panics with all its
/// output if it fails.
fn run_clean(what: &str, cmd: &mut Command) -> String {
    let started = Instant::now();
    let out = cmd
        .env_remove("ASCEND_PD_LIB")
        .env_remove("PYTHONPATH")
        .output()
        .unwrap_or_else(|e| panic!("{what}: {e}"));
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    assert!(
        out.status.success(),
        "{what} failed:\n{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    println!("{what}: {:.1} s", started.elapsed().as_secs_f64());
    stdout
}

/// A fresh venv in `dir` made by `py`; its Python.
fn venv(py: &str, dir: &Path) -> PathBuf {
    run_clean(
        &format!("{py} -m venv {}", dir.display()),
        Command::new(py).args(["-m", "venv"]).arg(dir),
    );
    dir.join("bin").join("python")
}

/// Asserts that the venv's Python, started outside the checkout with
/// `ASCEND_PD_LIB` unset, loads the library shipped in its own
/// site-packages/ascend_pd and that it speaks ABI version 1.
fn assert_loads_shipped_library(venv_python: &Path, cwd: &Path) {
    let stdout = run_clean(
        "importing the installed ascend_pd",
        Command::new(venv_python)
            .args([
                "-c",
                "import ascend_pd, sysconfig\n\
                 print(ascend_pd.library_path())\n\
                 print(sysconfig.get_paths()['platlib'])\n\
                 print(ascend_pd.abi_version())",
            ])
            .current_dir(cwd),
    );
    let lines: Vec<&str> = stdout.lines().collect();
    let [lib, platlib, abi] = lines[..] else {
        panic!("expected library path, site-packages and ABI version, got:\n{stdout}");
    };
    let canon = |p: &str| std::fs::canonicalize(p).unwrap_or_else(|e| panic!("{p}: {e}"));
    assert_eq!(
        canon(lib),
        canon(platlib).join("ascend_pd").join("libascend_pd.so"),
        "the package loaded another library than the one it ships"
    );
    assert_eq!(
        abi,
        ascend_pd::ffi::APD_ABI_VERSION.to_string(),
        "the installed package's library has another ABI than this checkout's: {stdout}"
    );
}

/// The README's install line works: `pip install ./python` into a fresh
/// venv builds libascend_pd with cargo (release, in the repository's
/// target/) and ships it inside the package, which then needs neither
/// `ASCEND_PD_LIB` nor the checkout. `pip wheel` makes a platform wheel
/// carrying the library that works the same from another fresh venv.
#[test]
fn the_python_package_installs_with_pip() {
    let py = python();
    let has_venv = Command::new(&py)
        .args(["-c", "import venv, ensurepip"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !has_venv {
        common::missing_tool(
            &format!("{py} -m venv (with ensurepip)"),
            "install python3-venv (Debian/Ubuntu: apt-get install python3-venv), or set PYTHON",
        );
    }
    let scratch = ScratchDir::new("pip");
    let elsewhere = scratch.0.join("elsewhere");
    std::fs::create_dir_all(&elsewhere).unwrap();

    // As the README says, from the checkout (build isolation fetches
    // setuptools-rust from the package index).
    let installed = venv(&py, &scratch.0.join("venv"));
    run_clean(
        "pip install ./python",
        Command::new(&installed)
            .args(["-m", "pip", "install", "./python"])
            .current_dir(root()),
    );
    assert_loads_shipped_library(&installed, &elsewhere);

    let wheels = scratch.0.join("wheels");
    run_clean(
        "pip wheel ./python",
        Command::new(&installed)
            .args(["-m", "pip", "wheel", "--no-deps", "./python", "-w"])
            .arg(&wheels)
            .current_dir(root()),
    );
    let names: Vec<String> = std::fs::read_dir(&wheels)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    let [wheel] = &names[..] else {
        panic!(
            "expected one wheel in {}, found {names:?}",
            wheels.display()
        );
    };
    // Any Python 3 (the library does not link libpython), this platform only.
    let tag = format!("-py3-none-linux_{}.whl", std::env::consts::ARCH);
    assert!(
        wheel.starts_with("ascend_pd-0.1.0-") && wheel.ends_with(&tag),
        "{wheel} is not a platform wheel ending in {tag}"
    );
    let from_wheel = venv(&py, &scratch.0.join("venv-wheel"));
    run_clean(
        "pip install the wheel",
        Command::new(&from_wheel)
            .args(["-m", "pip", "install", "--no-deps"])
            .arg(wheels.join(wheel))
            .current_dir(&elsewhere),
    );
    assert_loads_shipped_library(&from_wheel, &elsewhere);
}
