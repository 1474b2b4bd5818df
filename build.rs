//! Links libstdc++ (needed by libzmq, which the zmq crate builds from C++
//! source) statically into the cdylib `libascend_pd.so`, so the library, and
//! the wheel that ships it, need no libstdc++ on the host: the manylinux
//! floor is then glibc's alone, not GCC's (GLIBCXX_3.4.30 is GCC 12's).
//!
//! `-static-libstdc++` cannot do it: rustc links with `cc -nodefaultlibs`
//! and the cc crate (in zeromq-src's build script) asks for an explicit
//! `-lstdc++`, which the flag leaves alone. Instead the cdylib's link gets a
//! `-L` directory, searched before the compiler's own, that holds only a
//! `libstdc++.a` (a symlink to the C++ compiler's), so `-lstdc++` finds the
//! archive. Its symbols stay local: the cdylib's version script exports
//! only the `apd_*` functions. libgcc_s stays a shared dependency (Rust's
//! std asks for it, and every manylinux policy allows it). The rlib, the
//! tests and ascend-bench are linked as before.
use std::env;
use std::path::{Path, PathBuf};
use std::process::Command;

fn main() {
    println!("cargo:rerun-if-changed=build.rs");
    let target = env::var("TARGET").unwrap_or_default();
    let tu = target.replace('-', "_");
    for v in [
        "CXX".to_string(),
        format!("CXX_{target}"),
        format!("CXX_{tu}"),
        "TARGET_CXX".into(),
    ] {
        println!("cargo:rerun-if-env-changed={v}");
    }
    if env::var("CARGO_CFG_TARGET_OS").as_deref() != Ok("linux")
        || env::var("CARGO_CFG_TARGET_ENV").as_deref() != Ok("gnu")
    {
        return;
    }
    match static_libstdcxx(&target, &tu) {
        Ok(dir) => println!("cargo:rustc-cdylib-link-arg=-L{}", dir.display()),
        Err(e) => println!("cargo:warning=libascend_pd.so links libstdc++ dynamically: {e}"),
    }
}

/// The C++ compiler the cc crate uses for `target` (the same lookup, short
/// of its per-triple defaults for cross targets).
fn cxx(target: &str, tu: &str) -> Option<String> {
    let host = env::var("HOST").unwrap_or_default();
    [
        format!("CXX_{target}"),
        format!("CXX_{tu}"),
        "TARGET_CXX".into(),
        "CXX".into(),
    ]
    .iter()
    .find_map(|v| env::var(v).ok().filter(|s| !s.trim().is_empty()))
    .or_else(|| {
        if target == host {
            Some("c++".into())
        } else {
            None
        }
    })
}

fn static_libstdcxx(target: &str, tu: &str) -> Result<PathBuf, String> {
    let cxx = cxx(target, tu).ok_or("no C++ compiler named for a cross target (CXX_<target>)")?;
    // CXX may carry arguments ("ccache g++", "g++ -m64"): a program and its
    // arguments, as the cc crate splits them.
    let mut words = cxx.split_whitespace();
    let prog = words.next().ok_or("CXX is empty")?;
    let out = Command::new(prog)
        .args(words)
        .arg("-print-file-name=libstdc++.a")
        .output()
        .map_err(|e| format!("{cxx} -print-file-name=libstdc++.a: {e}"))?;
    let archive = PathBuf::from(String::from_utf8_lossy(&out.stdout).trim());
    if !out.status.success() || !archive.is_absolute() || !archive.is_file() {
        return Err(format!(
            "{cxx} has no libstdc++.a (install libstdc++-<version>-dev)"
        ));
    }
    let dir = Path::new(&env::var("OUT_DIR").map_err(|e| e.to_string())?).join("static-libstdcxx");
    std::fs::create_dir_all(&dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let link = dir.join("libstdc++.a");
    let _ = std::fs::remove_file(&link);
    std::os::unix::fs::symlink(&archive, &link).map_err(|e| format!("{}: {e}", link.display()))?;
    Ok(dir)
}
