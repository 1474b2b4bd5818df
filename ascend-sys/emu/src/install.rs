//! Finding the emulator's shared library and presenting it under the names
//! the CANN loader looks for.

use std::io;
use std::path::{Path, PathBuf};

/// File name cargo gives the emulator's cdylib.
pub const LIBRARY_FILE: &str = "libascend_emu.so";

/// Locates the built emulator library (`libascend_emu.so`).
///
/// `ASCEND_EMU_LIB` (a path to the file) wins. Otherwise the cargo target
/// directory is searched relative to the running executable: a test binary
/// lives in `target/<profile>/deps`, an example in
/// `target/<profile>/examples`, a binary in `target/<profile>`; the library
/// is in `target/<profile>` or its `deps`. When several copies exist the
/// newest is used.
pub fn library_path() -> io::Result<PathBuf> {
    if let Some(p) = std::env::var_os("ASCEND_EMU_LIB").filter(|p| !p.is_empty()) {
        let p = PathBuf::from(p);
        return if p.is_file() {
            Ok(p)
        } else {
            Err(io::Error::new(
                io::ErrorKind::NotFound,
                format!("ASCEND_EMU_LIB={} is not a file", p.display()),
            ))
        };
    }
    let exe = std::env::current_exe()?;
    let mut tried = Vec::new();
    let mut best: Option<(std::time::SystemTime, PathBuf)> = None;
    for dir in exe.ancestors().skip(1).take(3) {
        for candidate in [dir.join(LIBRARY_FILE), dir.join("deps").join(LIBRARY_FILE)] {
            if let Ok(modified) = candidate.metadata().and_then(|m| m.modified()) {
                if best.as_ref().is_none_or(|(t, _)| modified > *t) {
                    best = Some((modified, candidate.clone()));
                }
            }
            tried.push(candidate);
        }
    }
    best.map(|(_, p)| p).ok_or_else(|| {
        let list: Vec<String> = tried.iter().map(|p| p.display().to_string()).collect();
        io::Error::new(
            io::ErrorKind::NotFound,
            format!(
                "{LIBRARY_FILE} not found (tried {}); build it with `cargo build -p ascend-emu` \
                 or set ASCEND_EMU_LIB",
                list.join(", ")
            ),
        )
    })
}

/// Returns a directory holding `libascendcl.so` and `libhccl.so`, both
/// symlinks to the one emulator library, ready for
/// `ASCEND_PD_CANN_LIB_DIR` or an explicit-directory loader.
///
/// Symlinks, not copies: the dynamic loader recognises both names as the
/// same file and maps it once, so ACL and HCCL share one emulator state
/// (copies would be two libraries with two separate states). The directory
/// lives under the system temp dir, named after the library path, and is
/// reused by later calls and runs.
pub fn install_dir() -> io::Result<PathBuf> {
    // Tests call this from many threads at once: build the directory once
    // per process (later callers get the same answer).
    static DIR: std::sync::Mutex<Option<PathBuf>> = std::sync::Mutex::new(None);
    let mut cached = DIR.lock().unwrap_or_else(|p| p.into_inner());
    if let Some(d) = cached.as_ref() {
        return Ok(d.clone());
    }
    let dir = make_install_dir()?;
    *cached = Some(dir.clone());
    Ok(dir)
}

fn make_install_dir() -> io::Result<PathBuf> {
    let lib = library_path()?.canonicalize()?;
    let dir = std::env::temp_dir().join(format!(
        "ascend-emu-{}-{:016x}",
        // SAFETY: getuid has no preconditions and cannot fail.
        unsafe { libc::getuid() },
        fnv1a(lib.as_os_str().as_encoded_bytes())
    ));
    std::fs::create_dir_all(&dir)?;
    for name in ["libascendcl.so", "libhccl.so"] {
        link(&lib, &dir.join(name))?;
    }
    Ok(dir)
}

/// Points `at` to `target`, atomically replacing whatever is there.
fn link(target: &Path, at: &Path) -> io::Result<()> {
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
