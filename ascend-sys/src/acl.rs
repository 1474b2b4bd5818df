//! The process-wide runtime handle and per-device contexts.

use std::cell::Cell;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use crate::error::{Error, Result};
use crate::loader::CannLibraries;
use crate::result::acl_call;
use crate::sys;

/// The runtime loaded by this process (CANN allows one `aclInit` per process).
static RUNTIME: Mutex<Option<Acl>> = Mutex::new(None);

thread_local! {
    /// Device last bound to this thread by [`Device::bind`].
    static BOUND_DEVICE: Cell<Option<i32>> = const { Cell::new(None) };
}

/// The initialised ACL runtime of this process.
///
/// There is one per process: the first successful [`Acl::init`] or
/// [`Acl::init_from_dir`] loads the libraries and calls `aclInit`; later
/// calls return the same runtime. `aclFinalize` is left to process exit,
/// because CANN does not support using the runtime again after it.
#[derive(Clone)]
pub struct Acl {
    inner: Arc<AclInner>,
}

struct AclInner {
    libs: CannLibraries,
}

impl std::fmt::Debug for Acl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Acl")
            .field("libs", &self.inner.libs)
            .finish()
    }
}

fn same_dir(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

impl Acl {
    /// Loads CANN from the default search locations (see
    /// [`crate::search_locations`]) and initialises it, or returns the
    /// runtime this process already initialised.
    pub fn init() -> Result<Acl> {
        Self::get_or_load(None)
    }

    /// Loads libascendcl.so and libhccl.so from `dir` only and initialises
    /// the runtime. If this process already loaded the runtime from `dir`,
    /// returns it; from anywhere else, fails with [`Error::AlreadyLoaded`].
    pub fn init_from_dir(dir: impl AsRef<Path>) -> Result<Acl> {
        Self::get_or_load(Some(dir.as_ref()))
    }

    /// The runtime if this process has already initialised one.
    pub fn get() -> Option<Acl> {
        RUNTIME.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    fn get_or_load(dir: Option<&Path>) -> Result<Acl> {
        let mut slot = RUNTIME.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(acl) = slot.as_ref() {
            if let Some(dir) = dir {
                let loaded = acl.library_dir();
                if !same_dir(&loaded, dir) {
                    return Err(Error::AlreadyLoaded {
                        loaded,
                        requested: dir.to_path_buf(),
                    });
                }
            }
            return Ok(acl.clone());
        }
        let libs = match dir {
            Some(d) => CannLibraries::open_dir(d)?,
            None => CannLibraries::open_default()?,
        };
        // SAFETY: aclInit accepts NULL for "no configuration file".
        let init = unsafe { acl_call!(&libs, aclInit(std::ptr::null())) };
        match init {
            Ok(()) => {}
            // Someone else in this process (e.g. a framework) initialised it.
            Err(Error::Acl { code, .. }) if code == sys::ACL_ERROR_REPEAT_INITIALIZE => {}
            Err(e) => return Err(e),
        }
        let acl = Acl {
            inner: Arc::new(AclInner { libs }),
        };
        *slot = Some(acl.clone());
        Ok(acl)
    }

    pub(crate) fn libs(&self) -> &CannLibraries {
        &self.inner.libs
    }

    /// The libascendcl.so in use.
    pub fn library_path(&self) -> &Path {
        self.inner.libs.acl_path()
    }

    /// The directory libascendcl.so was loaded from (its name alone when the
    /// system loader found it).
    pub fn library_dir(&self) -> PathBuf {
        let p = self.library_path();
        p.parent()
            .filter(|d| !d.as_os_str().is_empty())
            .map_or_else(|| p.to_path_buf(), Path::to_path_buf)
    }

    /// The libhccl.so in use, if it loaded.
    pub fn hccl_library_path(&self) -> Option<&Path> {
        self.inner.libs.hccl_path()
    }

    /// `Ok` when HCCL loaded with its required symbols; otherwise why not.
    pub fn hccl_status(&self) -> Result<()> {
        self.inner.libs.hccl_status()
    }

    /// True when the loaded HCCL has the one-sided API (register, exchange,
    /// enable, batch put/get), through libhccl.so or libhcomm.so.
    pub fn one_sided_supported(&self) -> bool {
        self.inner.libs.one_sided_path().is_some()
    }

    /// The library serving the one-sided API, if any (see
    /// [`CannLibraries::one_sided_path`]).
    pub fn one_sided_library_path(&self) -> Option<&Path> {
        self.inner.libs.one_sided_path()
    }

    /// True when this runtime is the CANN emulator, not CANN.
    pub fn is_emulator(&self) -> bool {
        self.inner.libs.is_emulator()
    }

    /// The SoC name (`aclrtGetSocName`, e.g. "Ascend910B3"), when the
    /// runtime has the function and answers.
    pub fn soc_name(&self) -> Option<String> {
        let f = self.libs().acl().aclrtGetSocName.as_ref().ok()?;
        // SAFETY: takes no arguments; returns NULL or a NUL-terminated
        // string owned by the runtime, copied here at once.
        let p = unsafe { f() };
        if p.is_null() {
            return None;
        }
        // SAFETY: non-null and NUL-terminated per the runtime's contract.
        let name = unsafe { std::ffi::CStr::from_ptr(p) };
        Some(name.to_string_lossy().into_owned())
    }

    /// Number of devices visible to this process.
    pub fn device_count(&self) -> Result<u32> {
        let mut n = 0u32;
        // SAFETY: n is a valid out-parameter for the duration of the call.
        unsafe { acl_call!(self.libs(), aclrtGetDeviceCount(&mut n))? };
        Ok(n)
    }

    /// A context for device `id`, bound to the calling thread.
    pub fn device(&self, id: u32) -> Result<Device> {
        let id = i32::try_from(id)
            .map_err(|_| Error::InvalidArgument(format!("device id {id} is too large")))?;
        let device = Device {
            inner: Arc::new(DeviceInner {
                acl: self.clone(),
                id,
            }),
        };
        device.bind()?;
        Ok(device)
    }
}

/// A device context. Cheap to clone; every object made from it (buffers,
/// streams, events, communicators) keeps it, and so the runtime, alive.
///
/// CANN binds devices per thread; every method binds this device to the
/// calling thread first (`aclrtSetDevice`, skipped when the thread already
/// has it), so these objects may be used from any thread.
#[derive(Clone)]
pub struct Device {
    inner: Arc<DeviceInner>,
}

struct DeviceInner {
    acl: Acl,
    id: i32,
}

impl std::fmt::Debug for Device {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Device")
            .field("id", &self.inner.id)
            .finish()
    }
}

impl Device {
    /// The device id.
    pub fn id(&self) -> u32 {
        self.inner.id as u32
    }

    /// The runtime this device belongs to.
    pub fn acl(&self) -> &Acl {
        &self.inner.acl
    }

    pub(crate) fn libs(&self) -> &CannLibraries {
        self.inner.acl.libs()
    }

    /// Free and total bytes of this device's memory (`aclrtGetMemInfo`
    /// for HBM).
    pub fn mem_info(&self) -> Result<(usize, usize)> {
        self.bind()?;
        let (mut free, mut total) = (0usize, 0usize);
        // SAFETY: both are valid out-parameters for the call.
        unsafe {
            acl_call!(
                self.libs(),
                aclrtGetMemInfo(sys::ACL_HBM_MEM, &mut free, &mut total)
            )?
        };
        Ok((free, total))
    }

    /// Makes this device current on the calling thread.
    ///
    /// The binding is cached per thread; code outside ascend-sys that calls
    /// `aclrtSetDevice` itself on the same thread should call this again.
    pub fn bind(&self) -> Result<()> {
        let id = self.inner.id;
        if BOUND_DEVICE.with(Cell::get) == Some(id) {
            return Ok(());
        }
        // SAFETY: aclrtSetDevice takes a plain device id.
        unsafe { acl_call!(self.libs(), aclrtSetDevice(id))? };
        BOUND_DEVICE.with(|b| b.set(Some(id)));
        Ok(())
    }
}
