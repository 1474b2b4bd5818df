//! Finding the CANN emulator (`ascend-emu`, built from `ascend-sys/emu`)
//! and presenting it under the library names the loader looks for.
//!
//! `ASCEND_PD_CANN_LIB_DIR=emulator` (or `ascend-bench --emulator`) makes
//! the loader use it; whatever it serves is reported as the emulator, never
//! as CANN ([`crate::CannLibraries::is_emulator`]).

use std::path::{Path, PathBuf};

use crate::error::{Error, LoadAttempt, Result};

/// File name cargo gives the emulator's shared library.
pub const LIBRARY_FILE: &str = "libascend_emu.so";
/// The value of `ASCEND_PD_CANN_LIB_DIR` that selects the emulator.
pub const LIB_DIR_VALUE: &str = "emulator";
/// Environment variable naming the emulator library file itself.
pub const LIBRARY_ENV: &str = "ASCEND_EMU_LIB";

/// Locates the built emulator library.
///
/// `ASCEND_EMU_LIB` (a path to the file) wins. Otherwise the cargo target
/// directory is searched relative to the running executable: a test binary
/// lives in `target/<profile>/deps`, an example in
/// `target/<profile>/examples`, a binary in `target/<profile>`; the library
/// is in `target/<profile>` or its `deps`. When several copies exist the
/// newest is used.
pub fn library_path() -> Result<PathBuf> {
    if let Some(p) = std::env::var_os(LIBRARY_ENV).filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(not_found(vec![LoadAttempt {
                path: p,
                outcome: format!("named by {LIBRARY_ENV}, but not a file"),
            }]))
        };
    }
    let exe = std::env::current_exe().map_err(|e| {
        not_found(vec![LoadAttempt {
            path: PathBuf::from("<this executable>"),
            outcome: format!("cannot tell where this program lives: {e}"),
        }])
    })?;
    let mut tried = Vec::new();
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for dir in exe.ancestors().skip(1).take(3) {
        for candidate in [dir.join(LIBRARY_FILE), dir.join("deps").join(LIBRARY_FILE)] {
            match candidate.metadata().and_then(|m| m.modified()) {
                Ok(modified) => {
                    if best.as_ref().is_none_or(|(t, _)| modified > *t) {
                        best = Some((modified, candidate.clone()));
                    }
                }
                Err(e) => tried.push(LoadAttempt {
                    path: candidate,
                    outcome: e.to_string(),
                }),
            }
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| not_found(tried))
}

fn not_found(attempts: Vec<LoadAttempt>) -> Error {
    Error::EmulatorNotFound { attempts }
}

/// Returns a directory holding `libascendcl.so`, `libhccl.so` and
/// `libcann_hixl.so`, all symbolic links to the one emulator library, ready for
/// `ASCEND_PD_CANN_LIB_DIR` or [`crate::CannLibraries::open_dir`].
///
/// Links, not copies: the dynamic loader sees every name as one file and
/// maps it once, so ACL, HCCL and HIXL share one emulator state. The directory is
/// under the system temp dir, named after the library path, and reused by
/// later calls and runs.
pub fn install_dir() -> Result<PathBuf> {
    // Tests call this from many threads at once: build it once per process.
    static DIR: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
    let mut cached = DIR.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = cached.as_ref() {
        return Ok(d.clone());
    }
    let lib = library_path()?;
    let io = |what: &str, e: std::io::Error| {
        not_found(vec![LoadAttempt {
            path: lib.clone(),
            outcome: format!("{what}: {e}"),
        }])
    };
    let real = lib.canonicalize().map_err(|e| io("cannot resolve", e))?;
    let dir = std::env::temp_dir().join(format!(
        "ascend-emu-{}-{:016x}",
        // SAFETY: getuid has no preconditions and cannot fail.
        unsafe { libc::getuid() },
        fnv1a(real.as_os_str().as_encoded_bytes())
    ));
    std::fs::create_dir_all(&dir).map_err(|e| io("cannot create the link directory", e))?;
    for name in [crate::ACL_LIBRARY, crate::HCCL_LIBRARY, crate::HIXL_LIBRARY] {
        link(&real, &dir.join(name)).map_err(|e| io("cannot link it", e))?;
    }
    *cached = Some(dir.clone());
    Ok(dir)
}

/// True when `path` (a library that was loaded) is the emulator, through
/// whatever links lead to it.
pub fn is_emulator_library(path: &Path) -> bool {
    std::fs::canonicalize(path)
        .unwrap_or_else(|_| path.to_path_buf())
        .file_name()
        .is_some_and(|n| n.to_string_lossy().contains("ascend_emu"))
}

/// Points `at` to `target`, atomically replacing whatever is there.
fn link(target: &Path, at: &Path) -> std::io::Result<()> {
    if std::fs::read_link(at).is_ok_and(|t| t == target) {
        return Ok(());
    }
    // Unique per process and call, so concurrent installers never share it.
    static CALLS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
    let n = CALLS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
    let tmp = at.with_extension(format!("tmp{}-{n}", std::process::id()));
    let _ = std::fs::remove_file(&tmp);
    std::os::unix::fs::symlink(target, &tmp)?;
    std::fs::rename(&tmp, at)
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}
