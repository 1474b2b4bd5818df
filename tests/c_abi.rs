//! The C ABI from C: the committed header matches the code, compiles
//! clean as C11 and C++17, the shared library exports every function it
//! declares, and bad input from a C program gets a status and a message
//! naming the argument.

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn generated_header() -> String {
    let config = cbindgen::Config::from_file(root().join("cbindgen.toml")).expect("cbindgen.toml");
    let mut out = Vec::new();
    cbindgen::Builder::new()
        .with_config(config)
        .with_src(root().join("src/ffi/mod.rs"))
        .generate()
        .expect("cbindgen parses src/ffi")
        .write(&mut out);
    String::from_utf8(out).expect("UTF-8 header")
}

#[test]
fn the_committed_header_matches_the_code() {
    let path = root().join("include/ascend_pd.h");
    let fresh = generated_header();
    if std::env::var_os("ASCEND_PD_BLESS").is_some() {
        std::fs::write(&path, &fresh).unwrap();
        return;
    }
    let committed = std::fs::read_to_string(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "include/ascend_pd.h differs from what src/ffi generates: run \
         `ASCEND_PD_BLESS=1 cargo test --test c_abi` and commit the header"
    );
}

/// The functions the header declares.
fn declared_functions() -> Vec<String> {
    let header = std::fs::read_to_string(root().join("include/ascend_pd.h")).unwrap();
    header
        .lines()
        .filter(|l| !l.starts_with(' ') && !l.starts_with("typedef") && l.contains(" apd_"))
        .filter_map(|l| l.split(" apd_").nth(1))
        .map(|rest| format!("apd_{}", rest.split('(').next().unwrap()))
        .map(|s| s.trim_start_matches('*').to_string())
        .collect()
}

#[test]
fn the_library_exports_every_function_of_the_header() {
    let fns = declared_functions();
    assert!(fns.len() >= 20, "{fns:?}");
    let lib = common::cdylib();
    let Ok(out) = Command::new("nm")
        .args(["-D", "--defined-only"])
        .arg(&lib)
        .output()
    else {
        common::missing_tool("nm", "install binutils");
    };
    assert!(out.status.success());
    let symbols = String::from_utf8_lossy(&out.stdout);
    for f in &fns {
        assert!(
            symbols.lines().any(|l| l.ends_with(&format!(" T {f}"))),
            "{f} is declared in ascend_pd.h but not exported by {}",
            lib.display()
        );
    }
}

fn compile(compiler: &str, std: &str, src: &Path, out: &Path, extra: &[&str]) {
    let status = Command::new(compiler)
        .args([std, "-Wall", "-Wextra", "-Werror", "-pedantic"])
        .arg("-I")
        .arg(root().join("include"))
        .arg(src)
        .arg("-o")
        .arg(out)
        .args(extra)
        .status()
        .unwrap_or_else(|e| panic!("running {compiler}: {e}"));
    assert!(
        status.success(),
        "{compiler} {std} failed on {}",
        src.display()
    );
}

#[test]
fn the_header_compiles_clean_as_c11_and_cpp17() {
    let dir = tempfile_dir("header");
    let c = dir.join("use.c");
    std::fs::write(
        &c,
        "#include \"ascend_pd.h\"\nint main(void) { return apd_abi_version() == APD_ABI_VERSION ? 0 : 1; }\n",
    )
    .unwrap();
    let cpp = dir.join("use.cpp");
    std::fs::copy(&c, &cpp).unwrap();
    compile("cc", "-std=c11", &c, &dir.join("use_c.o"), &["-c"]);
    if Command::new("c++").arg("--version").output().is_err() {
        common::missing_tool("a C++ compiler (c++)", "install g++");
    }
    compile("c++", "-std=c++17", &cpp, &dir.join("use_cpp.o"), &["-c"]);
}

fn tempfile_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("apd-c-abi-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

#[test]
fn bad_input_from_c_gets_a_status_and_a_message_naming_the_argument() {
    let lib = common::cdylib();
    let dir = tempfile_dir("bad-input");
    let exe = dir.join("bad_input");
    let libdir = lib.parent().unwrap();
    compile(
        "cc",
        "-std=c11",
        &root().join("tests/c/bad_input.c"),
        &exe,
        &[
            "-L",
            libdir.to_str().unwrap(),
            "-lascend_pd",
            &format!("-Wl,-rpath,{}", libdir.display()),
        ],
    );
    let out = Command::new(&exe)
        .arg(common::free_port().to_string())
        .arg(common::free_port().to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "bad_input failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all bad-input checks passed"), "{stdout}");
    // Every check printed what it saw: at least this many ran.
    assert!(
        stdout.lines().filter(|l| l.starts_with("ok ")).count() >= 40,
        "{stdout}"
    );
}

#[test]
fn a_layer_wise_save_from_c_lands_every_byte_and_an_early_close_fails_it() {
    let lib = common::cdylib();
    let dir = tempfile_dir("layerwise");
    let exe = dir.join("layerwise");
    let libdir = lib.parent().unwrap();
    let examples = root().join("examples/c");
    compile(
        "cc",
        "-std=c11",
        &root().join("tests/c/layerwise.c"),
        &exe,
        &[
            "-I",
            examples.to_str().unwrap(),
            "-L",
            libdir.to_str().unwrap(),
            "-lascend_pd",
            &format!("-Wl,-rpath,{}", libdir.display()),
        ],
    );
    let out = Command::new(&exe)
        .arg(common::free_port().to_string())
        .arg(common::free_port().to_string())
        .arg(common::free_port().to_string())
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "layerwise failed:\n{stdout}\n{stderr}"
    );
    assert!(stdout.contains("all layer-wise checks passed"), "{stdout}");
    for needle in [
        "not available before the last layer",
        "loaded bytes match, every layer",
        "save closed early failed",
        "receiver pool back to full",
    ] {
        assert!(stdout.contains(needle), "{needle:?} missing:\n{stdout}");
    }
}
