//! Regenerates `ascend-sys/src/sys.rs`, the committed bindgen output.
//!
//! Source headers: a CANN install when `ASCEND_HOME_PATH` or
//! `ASCEND_TOOLKIT_HOME` points at one that has `include/acl/acl.h`,
//! otherwise our own declarations in `ascend-sys/cann-headers`, laid out as
//! a CANN 8.5 install is: `include/acl/acl.h` (with the runtime's
//! `ACL_ERROR_RT_*` codes as macros in `include/acl/error_codes/`),
//! `include/hccl/{hccl,hccl_types}.h`, and the one-sided API in
//! `pkg_inc/hccl/hccl_one_sided_services.h`, which includes a
//! `hccl_mem_defs.h` the package does not install (`gen/shim` supplies
//! ours when the tree has none). Both are read by the same code, so CI's
//! drift check exercises the real-header path. Older installs that declare
//! the one-sided API under `include/hccl` are found too.
//!
//! HIXL's client/server API always comes from our own plain-C declaration,
//! `cann-headers/include/hixl/ascend_pd_hixl_cs.h` (the vendor's
//! `hixl_cs.h` is C++, which bindgen is not asked to parse here).
//!
//! The output has four parts: the types and constants, then one
//! dynamic-loading struct per library (`AclLib` over libascendcl.so,
//! `HcclLib` over libhccl.so, `HixlLib` over libcann_hixl.so). Nothing
//! links against CANN at build time.
//!
//! bindgen is built with its `runtime` feature, so building this binary needs
//! no libclang; running it does (Debian: `apt-get install libclang-dev`).
//!
//! Usage: `cargo run -p ascend-sys-gen [-- --out <path>]`.

use std::env;
use std::fs;
use std::path::{Path, PathBuf};
use std::process::ExitCode;

use bindgen::{Builder, EnumVariation, Formatter};

/// ACL runtime functions the product calls (required at load time unless
/// `loader.rs` says otherwise).
const ACL_FUNCTIONS: &[&str] = &[
    "aclInit",
    "aclFinalize",
    "aclrtSetDevice",
    "aclrtResetDevice",
    "aclrtGetDeviceCount",
    "aclrtGetSocName",
    "aclrtGetMemInfo",
    "aclrtMalloc",
    "aclrtFree",
    "aclrtMallocHost",
    "aclrtFreeHost",
    "aclrtMemcpy",
    "aclrtMemcpyAsync",
    "aclrtMemset",
    "aclrtCreateStream",
    "aclrtDestroyStream",
    "aclrtSynchronizeStream",
    "aclrtCreateEvent",
    "aclrtRecordEvent",
    "aclrtQueryEventStatus",
    "aclrtSynchronizeEvent",
    "aclrtStreamWaitEvent",
    "aclrtDestroyEvent",
    "aclGetRecentErrMsg",
];

/// HCCL functions the product calls (the one-sided ones are optional at run time).
const HCCL_FUNCTIONS: &[&str] = &[
    "HcclGetRootInfo",
    "HcclCommInitRootInfo",
    "HcclCommDestroy",
    "HcclGetErrorString",
    "HcclRegisterMem",
    "HcclDeregisterMem",
    "HcclExchangeMemDesc",
    "HcclEnableMemAccess",
    "HcclDisableMemAccess",
    "HcclBatchPut",
    "HcclBatchGet",
];

/// HIXL client/server functions (libcann_hixl.so; optional at run time).
const HIXL_FUNCTIONS: &[&str] = &[
    "HixlCSServerCreate",
    "HixlCSServerRegMem",
    "HixlCSServerListen",
    "HixlCSServerUnregMem",
    "HixlCSServerDestroy",
    "HixlCSClientCreate",
    "HixlCSClientConnect",
    "HixlCSClientGetRemoteMem",
    "HixlCSClientRegMem",
    "HixlCSClientUnregMem",
    "HixlCSClientBatchPutAsync",
    "HixlCSClientBatchGetAsync",
    "HixlCSClientBatchPutSync",
    "HixlCSClientBatchGetSync",
    "HixlCSClientQueryCompleteStatus",
    "HixlCSClientDestroy",
];

/// Our own plain-C declaration of the HIXL CS API, relative to the crate.
/// Always this file: the vendor's hixl_cs.h is C++ and is never parsed.
const HIXL_HEADER: &str = "cann-headers/include/hixl/ascend_pd_hixl_cs.h";

const TYPES: &[&str] = &[
    "aclError",
    "aclrtStream",
    "aclrtEvent",
    "aclrtMemcpyKind",
    "aclrtMemMallocPolicy",
    "aclrtEventRecordedStatus",
    "aclrtMemAttr",
    "HcclResult",
    "HcclDataType",
    "HcclMemType",
    "HcclComm",
    "HcclRootInfo",
    "HcclRootInfoDef",
    "HcclMemDesc",
    "HcclMemDescs",
    "HcclMem",
    "HcclOneSideOpDesc",
    "CommProtocol",
    "CommAddrType",
    "CommAddr",
    "EndpointLocType",
    "EndpointLoc",
    "EndpointDesc",
    "CommMemType",
    "CommMem",
    "HixlServerHandle",
    "HixlClientHandle",
    "CompleteHandle",
    "MemHandle",
    "HixlStatus",
    "HixlServerConfig",
    "HixlClientConfig",
    "HixlClientDesc",
    "HixlServerDesc",
    "HixlOneSideOpDesc",
    "HixlCompleteStatus",
];

const VARS: &[&str] = &[
    "ACL_SUCCESS",
    "ACL_ERROR_INVALID_PARAM",
    "ACL_ERROR_UNINITIALIZE",
    "ACL_ERROR_REPEAT_INITIALIZE",
    "ACL_ERROR_INVALID_FILE",
    "ACL_ERROR_REPEAT_FINALIZE",
    "ACL_ERROR_BAD_ALLOC",
    "ACL_ERROR_RT_PARAM_INVALID",
    "ACL_ERROR_RT_INVALID_DEVICEID",
    "ACL_ERROR_RT_CONTEXT_NULL",
    "ACL_ERROR_RT_STREAM_CONTEXT",
    "ACL_ERROR_RT_INVALID_HANDLE",
    "ACL_ERROR_RT_FEATURE_NOT_SUPPORT",
    "ACL_ERROR_RT_MEMORY_ALLOCATION",
    "ACL_ERROR_RT_MEMORY_FREE",
    "ACL_ERROR_RT_INTERNAL_ERROR",
    "ACL_ERROR_RT_STREAM_SYNC_TIMEOUT",
    "ACL_ERROR_RT_EVENT_SYNC_TIMEOUT",
    "HCCL_ROOT_INFO_BYTES",
    "HCCL_MEM_DESC_LENGTH",
    "HIXL_SUCCESS",
    "HIXL_PARAM_INVALID",
    "HIXL_TIMEOUT",
    "HIXL_FAILED",
];

const PREAMBLE: &str = "\
// @generated by ascend-sys-gen (ascend-sys/gen). Do not edit by hand:
// regenerate with `cargo run -p ascend-sys-gen`; CI checks for drift with
// ascend-sys/check-bindings.sh.
";

/// Where the declarations come from: the root of a CANN install (or of our
/// own tree laid out like one) and what to call it in messages.
struct Source {
    root: PathBuf,
    what: String,
}

fn exact(names: &[&str]) -> String {
    format!("^({})$", names.join("|"))
}

fn find_source(crate_dir: &Path) -> Source {
    for var in ["ASCEND_HOME_PATH", "ASCEND_TOOLKIT_HOME"] {
        if let Some(root) = env::var_os(var).filter(|v| !v.is_empty()) {
            let root = PathBuf::from(root);
            if root.join("include/acl/acl.h").is_file() {
                return Source {
                    what: format!("CANN headers under {} (${var})", root.display()),
                    root,
                };
            }
            eprintln!(
                "note: {var} is set but {} has no include/acl/acl.h; using ascend-sys/cann-headers",
                root.display()
            );
        }
    }
    let root = crate_dir.join("cann-headers");
    Source {
        what: format!("our declarations under {}", root.display()),
        root,
    }
}

/// The header that declares the one-sided API: CANN 8.5's
/// `pkg_inc/hccl/hccl_one_sided_services.h`, else any header under
/// `include/hccl` that declares `HcclBatchPut` (older layouts).
fn find_one_sided_header(root: &Path) -> Option<PathBuf> {
    let pkg = root.join("pkg_inc/hccl/hccl_one_sided_services.h");
    if pkg.is_file() {
        return Some(pkg);
    }
    let mut entries: Vec<PathBuf> = fs::read_dir(root.join("include/hccl"))
        .ok()?
        .filter_map(|e| e.ok().map(|e| e.path()))
        .filter(|p| p.extension().is_some_and(|x| x == "h"))
        .collect();
    entries.sort();
    entries.into_iter().find(|p| {
        fs::read_to_string(p)
            .map(|text| text.contains("HcclBatchPut"))
            .unwrap_or(false)
    })
}

/// Writes the wrapper header bindgen parses; returns its path and the
/// clang include arguments (the shim directory last, so an install's own
/// `hccl_mem_defs.h` wins).
fn wrapper(
    source: &Source,
    shim: &Path,
    hixl_header: &Path,
    scratch: &Path,
) -> std::io::Result<(PathBuf, Vec<String>)> {
    let mut text = String::from("#include <acl/acl.h>\n#include <hccl/hccl.h>\n");
    match find_one_sided_header(&source.root) {
        Some(h) => text.push_str(&format!("#include \"{}\"\n", h.display())),
        None => eprintln!(
            "note: neither pkg_inc/hccl/hccl_one_sided_services.h nor a header under \
             include/hccl declares HcclBatchPut in {}; the one-sided functions will be \
             missing from the output",
            source.root.display()
        ),
    }
    text.push_str(&format!("#include \"{}\"\n", hixl_header.display()));
    let path = scratch.join("ascend_pd_bindgen_wrapper.h");
    fs::write(&path, text)?;
    let dirs = [
        source.root.join("include"),
        source.root.join("include/hccl"),
        source.root.join("pkg_inc"),
        source.root.join("pkg_inc/hccl"),
        shim.to_path_buf(),
    ];
    Ok((
        path,
        dirs.iter().map(|d| format!("-I{}", d.display())).collect(),
    ))
}

/// Gives the ACL status macros (`#define ACL_ERROR_RT_... 107000` in CANN
/// 8.5) the C type of `aclError`, as the `static const int` codes have, so
/// every code is an `i32` whichever form the headers use.
#[derive(Debug)]
struct AclCodesAreInt;

impl bindgen::callbacks::ParseCallbacks for AclCodesAreInt {
    fn int_macro(&self, name: &str, _value: i64) -> Option<bindgen::callbacks::IntKind> {
        name.starts_with("ACL_")
            .then_some(bindgen::callbacks::IntKind::Int)
    }
}

fn base_builder(header: &Path, clang_args: &[String]) -> Builder {
    Builder::default()
        .header(header.to_string_lossy())
        .clang_args(clang_args)
        .formatter(Formatter::Prettyplease)
        .default_enum_style(EnumVariation::Consts)
        .prepend_enum_name(false)
        .size_t_is_usize(true)
        .layout_tests(true)
        .derive_default(true)
        .derive_debug(false)
        .generate_comments(false)
        .use_core()
        .parse_callbacks(Box::new(AclCodesAreInt))
}

fn generate(
    source: &Source,
    shim: &Path,
    hixl_header: &Path,
    scratch: &Path,
) -> Result<String, Box<dyn std::error::Error>> {
    let (header, args) = wrapper(source, shim, hixl_header, scratch)?;

    let types = base_builder(&header, &args)
        .allowlist_type(exact(TYPES))
        .allowlist_var(exact(VARS))
        .generate()?
        .to_string();

    let acl = base_builder(&header, &args)
        .allowlist_function(exact(ACL_FUNCTIONS))
        .allowlist_recursively(false)
        .dynamic_library_name("AclLib")
        .dynamic_link_require_all(false)
        .generate()?
        .to_string();

    let hccl = base_builder(&header, &args)
        .allowlist_function(exact(HCCL_FUNCTIONS))
        .allowlist_recursively(false)
        .dynamic_library_name("HcclLib")
        .dynamic_link_require_all(false)
        .generate()?
        .to_string();

    let hixl = base_builder(&header, &args)
        .allowlist_function(exact(HIXL_FUNCTIONS))
        .allowlist_recursively(false)
        .dynamic_library_name("HixlLib")
        .dynamic_link_require_all(false)
        .generate()?
        .to_string();

    Ok(format!(
        "{PREAMBLE}\n// ---- types and constants ----\n\n{types}\n// ---- libascendcl.so ----\n\n{acl}\n// ---- libhccl.so ----\n\n{hccl}\n// ---- libcann_hixl.so ----\n\n{hixl}"
    ))
}

fn main() -> ExitCode {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("gen lives inside ascend-sys")
        .to_path_buf();
    let mut out = crate_dir.join("src/sys.rs");
    let mut args = env::args().skip(1);
    while let Some(arg) = args.next() {
        match arg.as_str() {
            "--out" => match args.next() {
                Some(p) => out = PathBuf::from(p),
                None => {
                    eprintln!("--out needs a path");
                    return ExitCode::from(2);
                }
            },
            "-h" | "--help" => {
                println!(
                    "usage: ascend-sys-gen [--out <path>]  (default: {})",
                    out.display()
                );
                return ExitCode::SUCCESS;
            }
            other => {
                eprintln!("unknown argument {other:?}; try --help");
                return ExitCode::from(2);
            }
        }
    }

    let source = find_source(&crate_dir);
    eprintln!("generating from {}", source.what);
    let shim = crate_dir.join("gen/shim");
    let scratch = env::temp_dir().join(format!("ascend-sys-gen-{}", std::process::id()));
    if let Err(e) = fs::create_dir_all(&scratch) {
        eprintln!("cannot create {}: {e}", scratch.display());
        return ExitCode::FAILURE;
    }
    let hixl_header = crate_dir.join(HIXL_HEADER);
    let result = generate(&source, &shim, &hixl_header, &scratch);
    let _ = fs::remove_dir_all(&scratch);
    match result.and_then(|text| fs::write(&out, text).map_err(Into::into)) {
        Ok(()) => {
            eprintln!("wrote {}", out.display());
            ExitCode::SUCCESS
        }
        Err(e) => {
            eprintln!("binding generation failed: {e}");
            eprintln!(
                "(bindgen needs libclang at run time; on Debian: apt-get install libclang-dev)"
            );
            ExitCode::FAILURE
        }
    }
}
