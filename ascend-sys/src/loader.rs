//! Finding and opening libascendcl.so and libhccl.so at run time.
//!
//! Search order (first hit wins): `ASCEND_PD_CANN_LIB_DIR`,
//! `$ASCEND_HOME_PATH/lib64`, `$ASCEND_TOOLKIT_HOME/lib64`,
//! `/usr/local/Ascend/ascend-toolkit/latest/lib64`, then the system loader
//! (`LD_LIBRARY_PATH`, ld.so.cache). libhccl.so is looked for in the
//! directory libascendcl.so came from first.
//!
//! The HCCL one-sided functions (register, exchange, enable, batch put/get)
//! live in `libhcomm.so` from CANN 8.5 on, which `libhccl.so` links against;
//! they are looked up through `libhccl.so` first and, when it does not
//! resolve them, in `libhcomm.so` next to it. [`CannLibraries::one_sided_path`]
//! says which library served them.
//!
//! `libcann_hixl.so` (HIXL, optional) is opened on first use
//! ([`crate::Acl::hixl`]): next to libascendcl.so first, then in the same
//! order; when the libraries are the emulator, only next to it.
//!
//! `ASCEND_PD_CANN_LIB_DIR=emulator` loads the CANN emulator (ascend-emu)
//! instead, and only it (see [`crate::emulator`]).

use std::path::{Path, PathBuf};
use std::sync::{Arc, OnceLock};

use crate::error::{Error, LoadAttempt, Result};
use crate::hixl::{HixlShared, HIXL_LIBRARY};
use crate::sys;

/// File name of the ACL runtime library.
pub const ACL_LIBRARY: &str = "libascendcl.so";
/// File name of the HCCL library.
pub const HCCL_LIBRARY: &str = "libhccl.so";
/// File name of the library that implements the one-sided API from CANN 8.5.
pub const HCOMM_LIBRARY: &str = "libhcomm.so";
/// Environment variable naming a directory to load both libraries from.
pub const LIB_DIR_ENV: &str = "ASCEND_PD_CANN_LIB_DIR";
/// Where the CANN toolkit installs by default.
pub const DEFAULT_TOOLKIT_LIB_DIR: &str = "/usr/local/Ascend/ascend-toolkit/latest/lib64";

/// One place the loader looks.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SearchLocation {
    /// A directory; `source` says where it came from (an env var or the default).
    Dir {
        /// The directory.
        dir: PathBuf,
        /// Why it is searched, e.g. `"ASCEND_HOME_PATH"`.
        source: &'static str,
    },
    /// An environment variable that would name a directory but is not set.
    Unset(&'static str),
    /// The system dynamic loader's own search (bare library name).
    SystemLoader,
    /// `ASCEND_PD_CANN_LIB_DIR=emulator`: the CANN emulator, and nothing else.
    Emulator,
}

/// The search locations in order, as the current environment defines them.
pub fn search_locations() -> Vec<SearchLocation> {
    let mut out = Vec::new();
    let env_dir = |var: &'static str, suffix: &str| match std::env::var_os(var) {
        Some(v) if !v.is_empty() => SearchLocation::Dir {
            dir: PathBuf::from(v).join(suffix),
            source: var,
        },
        _ => SearchLocation::Unset(var),
    };
    let emulator =
        std::env::var_os(LIB_DIR_ENV).is_some_and(|v| v == crate::emulator::LIB_DIR_VALUE);
    if emulator {
        out.push(SearchLocation::Emulator);
        return out;
    }
    out.push(env_dir(LIB_DIR_ENV, ""));
    out.push(env_dir("ASCEND_HOME_PATH", "lib64"));
    out.push(env_dir("ASCEND_TOOLKIT_HOME", "lib64"));
    out.push(SearchLocation::Dir {
        dir: PathBuf::from(DEFAULT_TOOLKIT_LIB_DIR),
        source: "default install location",
    });
    out.push(SearchLocation::SystemLoader);
    out
}

/// Functions every supported CANN provides; a library lacking one is refused.
fn missing_acl_symbol(lib: &sys::AclLib) -> Option<&'static str> {
    let required: [(&'static str, bool); 21] = [
        ("aclInit", lib.aclInit.is_ok()),
        ("aclFinalize", lib.aclFinalize.is_ok()),
        ("aclrtSetDevice", lib.aclrtSetDevice.is_ok()),
        ("aclrtResetDevice", lib.aclrtResetDevice.is_ok()),
        ("aclrtGetDeviceCount", lib.aclrtGetDeviceCount.is_ok()),
        ("aclrtMalloc", lib.aclrtMalloc.is_ok()),
        ("aclrtFree", lib.aclrtFree.is_ok()),
        ("aclrtMallocHost", lib.aclrtMallocHost.is_ok()),
        ("aclrtFreeHost", lib.aclrtFreeHost.is_ok()),
        ("aclrtMemcpy", lib.aclrtMemcpy.is_ok()),
        ("aclrtMemcpyAsync", lib.aclrtMemcpyAsync.is_ok()),
        ("aclrtMemset", lib.aclrtMemset.is_ok()),
        ("aclrtCreateStream", lib.aclrtCreateStream.is_ok()),
        ("aclrtDestroyStream", lib.aclrtDestroyStream.is_ok()),
        ("aclrtSynchronizeStream", lib.aclrtSynchronizeStream.is_ok()),
        ("aclrtCreateEvent", lib.aclrtCreateEvent.is_ok()),
        ("aclrtRecordEvent", lib.aclrtRecordEvent.is_ok()),
        ("aclrtQueryEventStatus", lib.aclrtQueryEventStatus.is_ok()),
        ("aclrtSynchronizeEvent", lib.aclrtSynchronizeEvent.is_ok()),
        ("aclrtStreamWaitEvent", lib.aclrtStreamWaitEvent.is_ok()),
        ("aclrtDestroyEvent", lib.aclrtDestroyEvent.is_ok()),
    ];
    // Optional: aclGetRecentErrMsg (without it errors carry only their
    // code), aclrtGetSocName and aclrtGetMemInfo (selftest reports).
    required.iter().find(|(_, ok)| !ok).map(|(name, _)| *name)
}

/// HCCL functions needed for any communicator; the one-sided API is optional.
fn missing_hccl_symbol(lib: &sys::HcclLib) -> Option<&'static str> {
    let required: [(&'static str, bool); 4] = [
        ("HcclGetRootInfo", lib.HcclGetRootInfo.is_ok()),
        ("HcclCommInitRootInfo", lib.HcclCommInitRootInfo.is_ok()),
        ("HcclCommDestroy", lib.HcclCommDestroy.is_ok()),
        ("HcclGetErrorString", lib.HcclGetErrorString.is_ok()),
    ];
    required.iter().find(|(_, ok)| !ok).map(|(name, _)| *name)
}

/// HIXL functions ascend-pd needs; the synchronous batch calls are optional.
fn missing_hixl_symbol(lib: &sys::HixlLib) -> Option<&'static str> {
    let required: [(&'static str, bool); 14] = [
        ("HixlCSServerCreate", lib.HixlCSServerCreate.is_ok()),
        ("HixlCSServerRegMem", lib.HixlCSServerRegMem.is_ok()),
        ("HixlCSServerListen", lib.HixlCSServerListen.is_ok()),
        ("HixlCSServerUnregMem", lib.HixlCSServerUnregMem.is_ok()),
        ("HixlCSServerDestroy", lib.HixlCSServerDestroy.is_ok()),
        ("HixlCSClientCreate", lib.HixlCSClientCreate.is_ok()),
        ("HixlCSClientConnect", lib.HixlCSClientConnect.is_ok()),
        (
            "HixlCSClientGetRemoteMem",
            lib.HixlCSClientGetRemoteMem.is_ok(),
        ),
        ("HixlCSClientRegMem", lib.HixlCSClientRegMem.is_ok()),
        ("HixlCSClientUnregMem", lib.HixlCSClientUnregMem.is_ok()),
        (
            "HixlCSClientBatchPutAsync",
            lib.HixlCSClientBatchPutAsync.is_ok(),
        ),
        (
            "HixlCSClientBatchGetAsync",
            lib.HixlCSClientBatchGetAsync.is_ok(),
        ),
        (
            "HixlCSClientQueryCompleteStatus",
            lib.HixlCSClientQueryCompleteStatus.is_ok(),
        ),
        ("HixlCSClientDestroy", lib.HixlCSClientDestroy.is_ok()),
    ];
    required.iter().find(|(_, ok)| !ok).map(|(name, _)| *name)
}

/// Whether a table resolves every one-sided function.
fn has_one_sided(lib: &sys::HcclLib) -> bool {
    lib.HcclRegisterMem.is_ok()
        && lib.HcclDeregisterMem.is_ok()
        && lib.HcclExchangeMemDesc.is_ok()
        && lib.HcclEnableMemAccess.is_ok()
        && lib.HcclDisableMemAccess.is_ok()
        && lib.HcclBatchPut.is_ok()
        && lib.HcclBatchGet.is_ok()
}

/// Outcome of trying to load one library from one candidate.
enum Tried<T> {
    Loaded(T, PathBuf),
    /// Not there or not loadable; keep searching.
    Skipped(LoadAttempt),
    /// Loaded but unusable; stop and report.
    Refused(Error),
}

fn try_open<T>(
    candidate: PathBuf,
    file_must_exist: bool,
    open: impl FnOnce(&Path) -> std::result::Result<T, libloading::Error>,
    check: impl FnOnce(&T) -> Option<&'static str>,
) -> Tried<T> {
    if file_must_exist && !candidate.exists() {
        let outcome = match candidate.parent() {
            Some(dir) if !dir.is_dir() => "directory does not exist",
            _ => "no such file",
        };
        return Tried::Skipped(LoadAttempt {
            path: candidate,
            outcome: outcome.into(),
        });
    }
    match open(&candidate) {
        Err(e) => Tried::Skipped(LoadAttempt {
            path: candidate,
            outcome: e.to_string(),
        }),
        Ok(lib) => match check(&lib) {
            Some(symbol) => Tried::Refused(Error::MissingSymbol {
                path: candidate,
                symbol,
            }),
            None => Tried::Loaded(lib, candidate),
        },
    }
}

fn open_acl(path: &Path) -> std::result::Result<sys::AclLib, libloading::Error> {
    // SAFETY: loading runs the library's initialisers. We only load files
    // named libascendcl.so from locations the user configured (or CANN's
    // default install), i.e. the CANN runtime or the emulator.
    unsafe { sys::AclLib::new(path) }
}

fn open_hccl(path: &Path) -> std::result::Result<sys::HcclLib, libloading::Error> {
    // SAFETY: as in open_acl, for libhccl.so.
    unsafe { sys::HcclLib::new(path) }
}

fn open_hixl(path: &Path) -> std::result::Result<sys::HixlLib, libloading::Error> {
    // SAFETY: as in open_acl, for libcann_hixl.so.
    unsafe { sys::HixlLib::new(path) }
}

/// Searches `candidates` (`None` = system loader) for `library`.
fn search<T>(
    library: &'static str,
    candidates: &[Option<PathBuf>],
    unset: &[&'static str],
    open: fn(&Path) -> std::result::Result<T, libloading::Error>,
    check: fn(&T) -> Option<&'static str>,
) -> Result<(T, PathBuf)> {
    let mut attempts: Vec<LoadAttempt> = unset
        .iter()
        .map(|var| LoadAttempt {
            path: PathBuf::from(format!("${var}")),
            outcome: "not set".into(),
        })
        .collect();
    for c in candidates {
        let (path, must_exist) = match c {
            Some(dir) => (dir.join(library), true),
            None => (PathBuf::from(library), false),
        };
        match try_open(path, must_exist, open, check) {
            Tried::Loaded(lib, path) => return Ok((lib, path)),
            Tried::Skipped(a) => attempts.push(a),
            Tried::Refused(e) => return Err(e),
        }
    }
    Err(Error::LibraryNotFound { library, attempts })
}

/// Why libhccl.so is not usable, kept so every HCCL call can report it.
#[derive(Debug, Clone)]
enum HcclMissing {
    NotFound(Vec<LoadAttempt>),
    MissingSymbol(PathBuf, &'static str),
}

impl HcclMissing {
    fn from_error(e: Error) -> Self {
        match e {
            Error::LibraryNotFound { attempts, .. } => HcclMissing::NotFound(attempts),
            Error::MissingSymbol { path, symbol } => HcclMissing::MissingSymbol(path, symbol),
            other => HcclMissing::NotFound(vec![LoadAttempt {
                path: PathBuf::from(HCCL_LIBRARY),
                outcome: other.to_string(),
            }]),
        }
    }

    fn to_error(&self) -> Error {
        match self {
            HcclMissing::NotFound(attempts) => Error::LibraryNotFound {
                library: HCCL_LIBRARY,
                attempts: attempts.clone(),
            },
            HcclMissing::MissingSymbol(path, symbol) => Error::MissingSymbol {
                path: path.clone(),
                symbol,
            },
        }
    }
}

/// Why libcann_hixl.so is not usable, kept so every later request reports it.
#[derive(Debug, Clone)]
enum HixlMissing {
    NotFound(Vec<LoadAttempt>),
    MissingSymbol(PathBuf, &'static str),
}

/// What [`Error::Unsupported`] says when libcann_hixl.so is nowhere to be found.
pub(crate) const HIXL_NOT_FOUND: &str =
    "libcann_hixl.so (HIXL; it ships with CANN 9.1 or later, or as the separate hixl package: \
     install it into the CANN lib64 directory next to libascendcl.so, or into a directory of \
     the CANN search order such as ASCEND_PD_CANN_LIB_DIR)";

impl HixlMissing {
    fn to_error(&self) -> Error {
        match self {
            HixlMissing::NotFound(_) => Error::Unsupported(HIXL_NOT_FOUND),
            HixlMissing::MissingSymbol(path, symbol) => Error::MissingSymbol {
                path: path.clone(),
                symbol,
            },
        }
    }
}

/// The opened CANN libraries. libascendcl.so is required; libhccl.so is
/// optional until a communicator is needed; libcann_hixl.so is opened on
/// first request only.
pub struct CannLibraries {
    acl: sys::AclLib,
    acl_path: PathBuf,
    hccl: std::result::Result<(sys::HcclLib, PathBuf), HcclMissing>,
    /// libhcomm.so, opened only when libhccl.so does not resolve the
    /// one-sided functions and libhcomm.so does.
    hcomm: Option<(sys::HcclLib, PathBuf)>,
    /// The candidates searched, in order, for libraries other than
    /// libascendcl.so (`None` = the system loader), and the unset
    /// variables among the search locations.
    candidates: Vec<Option<PathBuf>>,
    unset: Vec<&'static str>,
    /// libcann_hixl.so, once asked for.
    hixl: OnceLock<std::result::Result<Arc<HixlShared>, HixlMissing>>,
}

impl std::fmt::Debug for CannLibraries {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CannLibraries")
            .field("acl_path", &self.acl_path)
            .field("hccl_path", &self.hccl_path())
            .field("one_sided_path", &self.one_sided_path())
            .field("hixl_path", &self.hixl_path())
            .finish()
    }
}

impl CannLibraries {
    /// Opens both libraries from `dir` only (no other location is tried).
    pub fn open_dir(dir: impl AsRef<Path>) -> Result<CannLibraries> {
        let dir = dir.as_ref().to_path_buf();
        let candidates = [Some(dir)];
        let (acl, acl_path) = search(ACL_LIBRARY, &candidates, &[], open_acl, missing_acl_symbol)?;
        let hccl = search(
            HCCL_LIBRARY,
            &candidates,
            &[],
            open_hccl,
            missing_hccl_symbol,
        )
        .map_err(HcclMissing::from_error);
        Ok(CannLibraries::assemble(
            acl,
            acl_path,
            hccl,
            candidates.to_vec(),
            Vec::new(),
        ))
    }

    fn assemble(
        acl: sys::AclLib,
        acl_path: PathBuf,
        hccl: std::result::Result<(sys::HcclLib, PathBuf), HcclMissing>,
        candidates: Vec<Option<PathBuf>>,
        unset: Vec<&'static str>,
    ) -> CannLibraries {
        let hcomm = match &hccl {
            Ok((lib, path)) if !has_one_sided(lib) => open_hcomm_near(path),
            _ => None,
        };
        CannLibraries {
            acl,
            acl_path,
            hccl,
            hcomm,
            candidates,
            unset,
            hixl: OnceLock::new(),
        }
    }

    /// Opens the libraries from the first location in [`search_locations`]
    /// that has them; with `ASCEND_PD_CANN_LIB_DIR=emulator`, the emulator.
    pub fn open_default() -> Result<CannLibraries> {
        let locations = search_locations();
        if locations.contains(&SearchLocation::Emulator) {
            return CannLibraries::open_dir(crate::emulator::install_dir()?);
        }
        let unset: Vec<&'static str> = locations
            .iter()
            .filter_map(|l| match l {
                SearchLocation::Unset(v) => Some(*v),
                _ => None,
            })
            .collect();
        let candidates: Vec<Option<PathBuf>> = locations
            .iter()
            .filter_map(|l| match l {
                SearchLocation::Dir { dir, .. } => Some(Some(dir.clone())),
                SearchLocation::SystemLoader => Some(None),
                SearchLocation::Unset(_) | SearchLocation::Emulator => None,
            })
            .collect();
        let (acl, acl_path) = search(
            ACL_LIBRARY,
            &candidates,
            &unset,
            open_acl,
            missing_acl_symbol,
        )?;
        // Prefer the HCCL next to the ACL runtime we got, then the usual order.
        let mut hccl_candidates = Vec::new();
        if acl_path.is_absolute() {
            hccl_candidates.push(acl_path.parent().map(Path::to_path_buf));
        }
        for c in &candidates {
            if !hccl_candidates.contains(c) {
                hccl_candidates.push(c.clone());
            }
        }
        let hccl = search(
            HCCL_LIBRARY,
            &hccl_candidates,
            &unset,
            open_hccl,
            missing_hccl_symbol,
        )
        .map_err(HcclMissing::from_error);
        Ok(CannLibraries::assemble(
            acl,
            acl_path,
            hccl,
            hccl_candidates,
            unset,
        ))
    }

    /// The libascendcl.so that was loaded.
    pub fn acl_path(&self) -> &Path {
        &self.acl_path
    }

    /// The libhccl.so that was loaded, if one was.
    pub fn hccl_path(&self) -> Option<&Path> {
        self.hccl.as_ref().ok().map(|(_, p)| p.as_path())
    }

    /// Why HCCL is unusable, or `Ok` if it loaded.
    pub fn hccl_status(&self) -> Result<()> {
        self.hccl_lib().map(drop)
    }

    /// The library that serves the HCCL one-sided functions: libhccl.so, or
    /// libhcomm.so when only it resolves them; `None` when neither does.
    pub fn one_sided_path(&self) -> Option<&Path> {
        if let Some((_, path)) = &self.hcomm {
            return Some(path);
        }
        match &self.hccl {
            Ok((lib, path)) if has_one_sided(lib) => Some(path),
            _ => None,
        }
    }

    /// True when the libraries are the CANN emulator (ascend-emu), however
    /// they were reached (the emulator is loaded through links named like
    /// CANN's libraries).
    pub fn is_emulator(&self) -> bool {
        crate::emulator::is_emulator_library(&self.acl_path)
    }

    /// libcann_hixl.so, opened on the first call (next to libascendcl.so
    /// first, then where libhccl.so was searched; the emulator: only next
    /// to it) and kept. Absent: [`Error::Unsupported`] saying what to
    /// install; lacking a required function: [`Error::MissingSymbol`].
    pub(crate) fn hixl(&self) -> Result<Arc<HixlShared>> {
        self.hixl
            .get_or_init(|| self.open_hixl())
            .clone()
            .map_err(|m| m.to_error())
    }

    /// Loads libcann_hixl.so if not done yet (see [`crate::Acl::hixl`]);
    /// `Ok` when it is usable, otherwise why not.
    pub fn hixl_status(&self) -> Result<()> {
        self.hixl().map(drop)
    }

    /// The libcann_hixl.so that was loaded, if it has been asked for and
    /// loaded.
    pub fn hixl_path(&self) -> Option<&Path> {
        match self.hixl.get() {
            Some(Ok(shared)) => Some(shared.path()),
            _ => None,
        }
    }

    /// Where libcann_hixl.so was looked for and why each place failed,
    /// once it has been asked for and was not found (empty otherwise).
    pub fn hixl_attempts(&self) -> Vec<LoadAttempt> {
        match self.hixl.get() {
            Some(Err(HixlMissing::NotFound(attempts))) => attempts.clone(),
            _ => Vec::new(),
        }
    }

    fn open_hixl(&self) -> std::result::Result<Arc<HixlShared>, HixlMissing> {
        let mut candidates = Vec::new();
        if self.acl_path.is_absolute() {
            candidates.push(self.acl_path.parent().map(Path::to_path_buf));
        }
        if !self.is_emulator() {
            for c in &self.candidates {
                if !candidates.contains(c) {
                    candidates.push(c.clone());
                }
            }
        }
        let unset = if self.is_emulator() {
            &[][..]
        } else {
            &self.unset[..]
        };
        match search(
            HIXL_LIBRARY,
            &candidates,
            unset,
            open_hixl,
            missing_hixl_symbol,
        ) {
            Ok((lib, path)) => Ok(Arc::new(HixlShared::new(lib, path, self.is_emulator()))),
            Err(Error::MissingSymbol { path, symbol }) => {
                Err(HixlMissing::MissingSymbol(path, symbol))
            }
            Err(Error::LibraryNotFound { attempts, .. }) => Err(HixlMissing::NotFound(attempts)),
            Err(other) => Err(HixlMissing::NotFound(vec![LoadAttempt {
                path: PathBuf::from(HIXL_LIBRARY),
                outcome: other.to_string(),
            }])),
        }
    }

    /// The table the one-sided functions are called through.
    pub(crate) fn one_sided_lib(&self) -> Result<&sys::HcclLib> {
        match &self.hcomm {
            Some((lib, _)) => Ok(lib),
            None => self.hccl_lib(),
        }
    }

    pub(crate) fn acl(&self) -> &sys::AclLib {
        &self.acl
    }

    pub(crate) fn hccl_lib(&self) -> Result<&sys::HcclLib> {
        self.hccl
            .as_ref()
            .map(|(lib, _)| lib)
            .map_err(HcclMissing::to_error)
    }
}

/// libhcomm.so in the directory of `hccl` (or by the system loader when
/// `hccl` is a bare name), if it opens and resolves the one-sided API.
fn open_hcomm_near(hccl: &Path) -> Option<(sys::HcclLib, PathBuf)> {
    let candidate = match hccl.parent().filter(|d| !d.as_os_str().is_empty()) {
        Some(dir) => dir.join(HCOMM_LIBRARY),
        None => PathBuf::from(HCOMM_LIBRARY),
    };
    if candidate.is_absolute() && !candidate.exists() {
        return None;
    }
    let lib = open_hccl(&candidate).ok()?;
    has_one_sided(&lib).then_some((lib, candidate))
}

/// True when libascendcl.so can be found and opened (with all required
/// symbols) by the default search. Loads and unloads the library; does not
/// initialise the runtime and never fails.
pub fn available() -> bool {
    CannLibraries::open_default().is_ok()
}
