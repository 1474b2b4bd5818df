//! Loader errors: missing directory, missing library, missing symbols.

use std::path::{Path, PathBuf};

use ascend_sys::{CannLibraries, Error};

fn scratch_dir(name: &str) -> std::path::PathBuf {
    let dir = std::env::temp_dir().join(format!("ascend-sys-test-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

/// A shared library every Linux test machine has, lacking every CANN symbol:
/// the C library this test process itself runs on, as `/proc/self/maps`
/// names it. (A fixed list of paths would take the first that exists, which
/// is another architecture's libc on a multiarch host or under qemu-user.)
fn libc_path() -> PathBuf {
    let maps = std::fs::read_to_string("/proc/self/maps").expect("reading /proc/self/maps");
    maps.lines()
        .filter_map(|l| l.split_whitespace().nth(5))
        .map(Path::new)
        .find(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n == "libc.so.6" || (n.starts_with("libc-") && n.ends_with(".so")))
        })
        .map(Path::to_path_buf)
        .expect("a libc.so.6 mapped into this process, to stand in for a wrong library")
}

#[test]
fn missing_directory_lists_the_path_tried_and_the_fix() {
    let dir = Path::new("/nonexistent/ascend-pd/lib64");
    let err = CannLibraries::open_dir(dir).unwrap_err();
    match &err {
        Error::LibraryNotFound { library, attempts } => {
            assert_eq!(*library, "libascendcl.so");
            assert_eq!(attempts.len(), 1);
            assert_eq!(attempts[0].path, dir.join("libascendcl.so"));
            assert_eq!(attempts[0].outcome, "directory does not exist");
        }
        other => panic!("unexpected {other:?}"),
    }
    let text = err.to_string();
    assert!(
        text.contains("/nonexistent/ascend-pd/lib64/libascendcl.so: directory does not exist"),
        "{text}"
    );
    assert!(text.contains("set ASCEND_PD_CANN_LIB_DIR"), "{text}");
}

#[test]
fn empty_directory_says_no_such_file() {
    let dir = scratch_dir("empty");
    let err = CannLibraries::open_dir(&dir).unwrap_err();
    let Error::LibraryNotFound { attempts, .. } = &err else {
        panic!("unexpected {err:?}")
    };
    assert_eq!(attempts[0].outcome, "no such file");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_library_without_the_acl_symbols_is_refused_by_name() {
    let dir = scratch_dir("wrong-acl");
    std::os::unix::fs::symlink(libc_path(), dir.join("libascendcl.so")).unwrap();
    let err = CannLibraries::open_dir(&dir).unwrap_err();
    match &err {
        Error::MissingSymbol { path, symbol } => {
            assert_eq!(*symbol, "aclInit");
            assert_eq!(path, &dir.join("libascendcl.so"));
        }
        other => panic!("unexpected {other:?}"),
    }
    assert!(err.to_string().contains("lacks required symbol aclInit"));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn acl_without_a_usable_hccl_still_loads_and_reports_why_hccl_is_missing() {
    let emu = ascend_emu::library_path().unwrap();
    let dir = scratch_dir("acl-only");
    std::os::unix::fs::symlink(&emu, dir.join("libascendcl.so")).unwrap();
    let libs = CannLibraries::open_dir(&dir).unwrap();
    assert_eq!(libs.acl_path(), dir.join("libascendcl.so"));
    assert_eq!(libs.hccl_path(), None);
    let err = libs.hccl_status().unwrap_err();
    assert!(
        matches!(
            &err,
            Error::LibraryNotFound {
                library: "libhccl.so",
                ..
            }
        ),
        "{err:?}"
    );

    std::os::unix::fs::symlink(libc_path(), dir.join("libhccl.so")).unwrap();
    let libs = CannLibraries::open_dir(&dir).unwrap();
    let err = libs.hccl_status().unwrap_err();
    assert!(
        matches!(
            &err,
            Error::MissingSymbol {
                symbol: "HcclGetRootInfo",
                ..
            }
        ),
        "{err:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn install_dir_names_both_libraries_as_one_file() {
    let dir = ascend_emu::install_dir().unwrap();
    let acl = std::fs::canonicalize(dir.join("libascendcl.so")).unwrap();
    let hccl = std::fs::canonicalize(dir.join("libhccl.so")).unwrap();
    assert_eq!(
        acl, hccl,
        "both names must resolve to the one emulator image"
    );
    let libs = CannLibraries::open_dir(&dir).unwrap();
    assert!(libs.hccl_status().is_ok());
    assert_eq!(libs.hccl_path(), Some(dir.join("libhccl.so").as_path()));
}

#[test]
fn search_locations_follow_the_documented_order() {
    let locations = ascend_sys::search_locations();
    let sources: Vec<String> = locations
        .iter()
        .map(|l| match l {
            ascend_sys::SearchLocation::Dir { source, .. } => source.to_string(),
            ascend_sys::SearchLocation::Unset(var) => var.to_string(),
            ascend_sys::SearchLocation::SystemLoader => "system".to_string(),
            ascend_sys::SearchLocation::Emulator => "emulator".to_string(),
        })
        .collect();
    assert_eq!(
        sources,
        [
            "ASCEND_PD_CANN_LIB_DIR",
            "ASCEND_HOME_PATH",
            "ASCEND_TOOLKIT_HOME",
            "default install location",
            "system"
        ]
    );
}

/// CANN 8.5 layout: libhccl.so has the communicator functions, the
/// one-sided ones live in libhcomm.so. Here libhccl.so is a stub compiled
/// from C with only the four required functions; libhcomm.so is the
/// emulator. The loader must serve the one-sided API from libhcomm.so and
/// say so.
#[test]
fn one_sided_functions_fall_back_to_libhcomm() {
    let dir = scratch_dir("hcomm");
    let src = dir.join("stub.c");
    std::fs::write(
        &src,
        "int HcclGetRootInfo(void *r) { (void)r; return 5; }\n\
         int HcclCommInitRootInfo(unsigned n, const void *r, unsigned k, void **c) \
         { (void)n; (void)r; (void)k; (void)c; return 5; }\n\
         int HcclCommDestroy(void *c) { (void)c; return 5; }\n\
         const char *HcclGetErrorString(int c) { (void)c; return \"stub\"; }\n",
    )
    .unwrap();
    let status = std::process::Command::new("cc")
        .args(["-shared", "-fPIC", "-o"])
        .arg(dir.join("libhccl.so"))
        .arg(&src)
        .status()
        .expect("a C compiler (cc) is needed to build the stub libhccl.so");
    assert!(status.success());
    let emu = ascend_emu::library_path().unwrap();
    std::os::unix::fs::symlink(&emu, dir.join("libascendcl.so")).unwrap();

    // Without libhcomm.so: HCCL loads, the one-sided API is absent.
    let libs = CannLibraries::open_dir(&dir).unwrap();
    assert!(libs.hccl_status().is_ok());
    assert_eq!(libs.one_sided_path(), None);

    std::os::unix::fs::symlink(&emu, dir.join("libhcomm.so")).unwrap();
    let libs = CannLibraries::open_dir(&dir).unwrap();
    assert_eq!(libs.hccl_path(), Some(dir.join("libhccl.so").as_path()));
    assert_eq!(
        libs.one_sided_path(),
        Some(dir.join("libhcomm.so").as_path())
    );
    assert!(libs.is_emulator());
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_emulator_directory_serves_everything_from_libhccl() {
    let libs = CannLibraries::open_dir(ascend_emu::install_dir().unwrap()).unwrap();
    assert!(libs.is_emulator());
    assert_eq!(libs.one_sided_path(), libs.hccl_path());
}

#[test]
fn hixl_is_optional_and_its_absence_says_what_to_install() {
    let emu = ascend_emu::library_path().unwrap();
    let dir = scratch_dir("no-hixl");
    std::os::unix::fs::symlink(&emu, dir.join("libascendcl.so")).unwrap();
    std::os::unix::fs::symlink(&emu, dir.join("libhccl.so")).unwrap();
    let libs = CannLibraries::open_dir(&dir).unwrap();
    // Everything else loads and works without it.
    assert!(libs.hccl_status().is_ok());
    assert!(libs.one_sided_path().is_some());
    let err = libs.hixl_status().unwrap_err();
    assert!(matches!(&err, Error::Unsupported(_)), "{err:?}");
    let text = err.to_string();
    assert!(
        text.contains("libcann_hixl.so")
            && text.contains("CANN 9.1")
            && text.contains("hixl package"),
        "{text}"
    );
    assert_eq!(libs.hixl_path(), None);
    let tried = libs.hixl_attempts();
    assert_eq!(tried.len(), 1, "{tried:?}");
    assert_eq!(tried[0].path, dir.join("libcann_hixl.so"));
    assert_eq!(tried[0].outcome, "no such file");

    // A libcann_hixl.so without the HIXL functions is refused by name.
    std::os::unix::fs::symlink(libc_path(), dir.join("libcann_hixl.so")).unwrap();
    let libs = CannLibraries::open_dir(&dir).unwrap();
    let err = libs.hixl_status().unwrap_err();
    assert!(
        matches!(
            &err,
            Error::MissingSymbol {
                symbol: "HixlCSServerCreate",
                ..
            }
        ),
        "{err:?}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn the_emulator_directory_serves_hixl_from_the_same_file() {
    let dir = ascend_emu::install_dir().unwrap();
    let libs = CannLibraries::open_dir(&dir).unwrap();
    assert_eq!(libs.hixl_path(), None, "not loaded before it is asked for");
    libs.hixl_status().unwrap();
    assert_eq!(
        libs.hixl_path(),
        Some(dir.join("libcann_hixl.so").as_path())
    );
    assert_eq!(
        std::fs::canonicalize(dir.join("libcann_hixl.so")).unwrap(),
        std::fs::canonicalize(dir.join("libascendcl.so")).unwrap()
    );
}
