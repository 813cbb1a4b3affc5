//! Finding libnccl and loading it at run time, with the handful of its functions we call.
//!
//! Why not cudarc's loader: it tries `libnccl.so`, `libnccl.so.<cuda major>` and a few older
//! suffixes, but not `libnccl.so.2`, which is the name both Debian's `libnccl2` and the
//! `nvidia-nccl-cu12`/`-cu13` wheels ship (the wheels ship nothing else), and it cannot be told
//! a path. So we search the known names and places ourselves, load by full path, and keep the
//! library (and the function pointers taken from it) alive in one [`NcclLibrary`].

// FFI into libnccl (and `dladdr`): the only unsafe code of the NCCL path besides the
// reducer's device pointers; each call says why it is sound.
#![allow(unsafe_code)]

use std::ffi::{CStr, c_char, c_int, c_void};
use std::path::{Path, PathBuf};

use crate::env_vars::EnvSource;

use super::NcclError;
use super::search::writable_by_others;
pub use super::search::{Candidate, candidates};

/// Bytes of an NCCL unique id (`NCCL_UNIQUE_ID_BYTES`).
pub const UNIQUE_ID_BYTES: usize = 128;

/// `ncclUniqueId`, passed by value to `ncclCommInitRankConfig`.
#[repr(C)]
#[derive(Clone, Copy)]
pub(crate) struct RawUniqueId {
    pub internal: [c_char; UNIQUE_ID_BYTES],
}

/// The leading fields of `ncclConfig_t` (stable since NCCL 2.14). NCCL copies `size` bytes of
/// the caller's struct over its defaults, so a prefix leaves every later field at NCCL's
/// default; the fifth int is written (as "undefined") so the struct has no padding bytes.
#[repr(C)]
pub(crate) struct ConfigPrefix {
    pub size: usize,
    pub magic: u32,
    pub version: u32,
    pub blocking: c_int,
    pub cga_cluster_size: c_int,
}

/// `NCCL_CONFIG_UNDEF_INT`.
pub(crate) const CONFIG_UNDEF_INT: c_int = c_int::MIN;
/// `ncclConfig_t::magic`.
pub(crate) const CONFIG_MAGIC: u32 = 0xcafe_beef;

/// `ncclResult_t::ncclSuccess`.
pub(crate) const NCCL_SUCCESS: c_int = 0;
/// `ncclResult_t::ncclInProgress` (non-blocking communicators).
pub(crate) const NCCL_IN_PROGRESS: c_int = 7;

type GetVersion = unsafe extern "C" fn(*mut c_int) -> c_int;
type GetUniqueId = unsafe extern "C" fn(*mut RawUniqueId) -> c_int;
type GetErrorString = unsafe extern "C" fn(c_int) -> *const c_char;
type CommInitRankConfig =
    unsafe extern "C" fn(*mut *mut c_void, c_int, RawUniqueId, c_int, *mut ConfigPrefix) -> c_int;
type CommGetAsyncError = unsafe extern "C" fn(*mut c_void, *mut c_int) -> c_int;
type CommHandle = unsafe extern "C" fn(*mut c_void) -> c_int;
type AllReduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    c_int,
    *mut c_void,
    *mut c_void,
) -> c_int;
type ReduceScatter = AllReduce;
type AllGather = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    c_int,
    *mut c_void,
    *mut c_void,
) -> c_int;

/// The functions of libnccl we call, taken once at load.
#[derive(Clone, Copy)]
pub(crate) struct Api {
    pub get_version: GetVersion,
    pub get_unique_id: GetUniqueId,
    pub get_error_string: GetErrorString,
    pub comm_init_rank_config: CommInitRankConfig,
    pub comm_get_async_error: CommGetAsyncError,
    pub comm_abort: CommHandle,
    pub comm_destroy: CommHandle,
    pub all_reduce: AllReduce,
    pub reduce_scatter: ReduceScatter,
    pub all_gather: AllGather,
}

/// An NCCL release, as `ncclGetVersion` reports it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct NcclVersion {
    /// Major version (2 for every release since 2017).
    pub major: u32,
    /// Minor version.
    pub minor: u32,
    /// Patch level.
    pub patch: u32,
}

impl NcclVersion {
    /// Decodes `ncclGetVersion`'s integer: `major * 10000 + minor * 100 + patch` since 2.9,
    /// `major * 1000 + minor * 100 + patch` before.
    pub fn from_code(code: u32) -> Self {
        if code >= 20_900 {
            Self {
                major: code / 10_000,
                minor: code / 100 % 100,
                patch: code % 100,
            }
        } else {
            Self {
                major: code / 1000,
                minor: code / 100 % 10,
                patch: code % 100,
            }
        }
    }

    /// The integer `NCCL_VERSION(major, minor, patch)` makes (2.9 and later), as config
    /// structs carry it.
    pub fn code(self) -> u32 {
        self.major * 10_000 + self.minor * 100 + self.patch
    }
}

impl std::fmt::Display for NcclVersion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}.{}.{}", self.major, self.minor, self.patch)
    }
}

/// libnccl, loaded: its path, its version and the functions we call.
pub struct NcclLibrary {
    path: PathBuf,
    origin: String,
    version: NcclVersion,
    pub(crate) api: Api,
    // Last: the function pointers in `api` are valid while this lives.
    _library: libloading::Library,
}

impl std::fmt::Debug for NcclLibrary {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NcclLibrary")
            .field("path", &self.path)
            .field("origin", &self.origin)
            .field("version", &self.version)
            .finish_non_exhaustive()
    }
}

impl NcclLibrary {
    /// Loads the first of [`candidates`] that loads and has NCCL's functions; the error lists
    /// every place tried and why each failed.
    pub fn find(env: &(impl EnvSource + ?Sized)) -> Result<Self, NcclError> {
        let mut tried = Vec::new();
        for candidate in candidates(env) {
            match Self::load(&candidate.path, &candidate.origin) {
                Ok(library) => return Ok(library),
                Err(e) => tried.push(format!(
                    "{} ({}): {e}",
                    candidate.path.display(),
                    candidate.origin
                )),
            }
        }
        Err(NcclError::NotFound { tried })
    }

    /// Loads libnccl from `path` (a full path, or a file name for the dynamic loader's search).
    pub fn load(path: &Path, origin: &str) -> Result<Self, NcclError> {
        let failed = |reason: String| NcclError::Load {
            path: path.to_path_buf(),
            reason,
        };
        if let Some(reason) = writable_by_others(path) {
            return Err(failed(reason));
        }
        // SAFETY: loading runs libnccl's initialisers, which only set up its own state (NCCL
        // reads its environment lazily, at the first communicator).
        let library =
            unsafe { libloading::Library::new(path) }.map_err(|e| failed(e.to_string()))?;
        // SAFETY: each symbol is read with the signature nccl.h declares for it (NCCL 2.x ABI).
        let api = unsafe { read_api(&library) }.map_err(|e| failed(e.to_string()))?;
        let mut code: c_int = 0;
        // SAFETY: `ncclGetVersion` writes one int through a valid pointer.
        let rc = unsafe { (api.get_version)(&mut code) };
        if rc != NCCL_SUCCESS {
            return Err(failed(format!("ncclGetVersion returned {rc}")));
        }
        let version = NcclVersion::from_code(code.max(0) as u32);
        if version
            < (NcclVersion {
                major: 2,
                minor: 14,
                patch: 0,
            })
        {
            return Err(failed(format!(
                "NCCL {version} is too old: non-blocking communicators (which let a stuck \
                 collective be aborted) need 2.14 or later"
            )));
        }
        let resolved =
            loaded_path(api.get_version as *const c_void).unwrap_or_else(|| path.to_path_buf());
        Ok(Self {
            path: resolved,
            origin: origin.to_string(),
            version,
            api,
            _library: library,
        })
    }

    /// The file loaded (resolved through the dynamic loader when found by name).
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Why this file was found (see [`candidates`]).
    pub fn origin(&self) -> &str {
        &self.origin
    }

    /// The NCCL release.
    pub fn version(&self) -> NcclVersion {
        self.version
    }

    /// A new communicator id (`ncclGetUniqueId`): rank 0 makes one for each communicator and
    /// every rank joins with it. Needs no GPU: the id names rank 0's bootstrap socket.
    pub fn unique_id(&self) -> Result<UniqueId, NcclError> {
        let mut raw = RawUniqueId {
            internal: [0; UNIQUE_ID_BYTES],
        };
        // SAFETY: writes 128 bytes into `raw`.
        let rc = unsafe { (self.api.get_unique_id)(&mut raw) };
        self.check("ncclGetUniqueId", rc)?;
        Ok(UniqueId(raw.internal.map(|c| c as u8)))
    }

    /// NCCL's words for result code `code`.
    pub fn error_string(&self, code: c_int) -> String {
        // SAFETY: returns a pointer to a static C string (or null).
        let text = unsafe { (self.api.get_error_string)(code) };
        if text.is_null() {
            return format!("NCCL error {code}");
        }
        // SAFETY: non-null, NUL-terminated and static, per nccl.h.
        unsafe { CStr::from_ptr(text) }
            .to_string_lossy()
            .into_owned()
    }

    /// `Ok` for `ncclSuccess`, else an error naming `function` with NCCL's words.
    pub(crate) fn check(&self, function: &'static str, code: c_int) -> Result<(), NcclError> {
        if code == NCCL_SUCCESS {
            Ok(())
        } else {
            Err(NcclError::Call {
                function,
                code,
                message: self.error_string(code),
            })
        }
    }
}

/// The functions we call, from `library`.
///
/// # Safety
/// `library` must be libnccl 2.x; the pointers are valid while it is loaded.
unsafe fn read_api(library: &libloading::Library) -> Result<Api, libloading::Error> {
    // SAFETY: forwarded to the caller; each type is the one nccl.h declares.
    unsafe {
        Ok(Api {
            get_version: symbol(library, b"ncclGetVersion\0")?,
            get_unique_id: symbol(library, b"ncclGetUniqueId\0")?,
            get_error_string: symbol(library, b"ncclGetErrorString\0")?,
            comm_init_rank_config: symbol(library, b"ncclCommInitRankConfig\0")?,
            comm_get_async_error: symbol(library, b"ncclCommGetAsyncError\0")?,
            comm_abort: symbol(library, b"ncclCommAbort\0")?,
            comm_destroy: symbol(library, b"ncclCommDestroy\0")?,
            all_reduce: symbol(library, b"ncclAllReduce\0")?,
            reduce_scatter: symbol(library, b"ncclReduceScatter\0")?,
            all_gather: symbol(library, b"ncclAllGather\0")?,
        })
    }
}

/// Reads symbol `name` of `library` as a `T` (a function pointer type).
///
/// # Safety
/// `T` must be the symbol's real type; the result is valid while `library` is loaded.
unsafe fn symbol<T: Copy>(
    library: &libloading::Library,
    name: &[u8],
) -> Result<T, libloading::Error> {
    // SAFETY: forwarded to the caller.
    unsafe { library.get::<T>(name).map(|s| *s) }
}

/// The file the dynamic loader mapped `address` from.
fn loaded_path(address: *const c_void) -> Option<PathBuf> {
    let mut info = std::mem::MaybeUninit::<libc::Dl_info>::zeroed();
    // SAFETY: `dladdr` fills `info` for an address inside a loaded object and returns 0
    // otherwise; `dli_fname` then points at the loader's own string for that object.
    unsafe {
        if libc::dladdr(address, info.as_mut_ptr()) == 0 {
            return None;
        }
        let info = info.assume_init();
        if info.dli_fname.is_null() {
            return None;
        }
        let name = CStr::from_ptr(info.dli_fname).to_str().ok()?;
        Some(std::fs::canonicalize(name).unwrap_or_else(|_| PathBuf::from(name)))
    }
}

/// An NCCL communicator id: 128 opaque bytes made by rank 0 and given to every rank.
#[derive(Clone, Copy, PartialEq, Eq)]
pub struct UniqueId(pub [u8; UNIQUE_ID_BYTES]);

impl UniqueId {
    pub(crate) fn raw(&self) -> RawUniqueId {
        RawUniqueId {
            internal: self.0.map(|b| b as c_char),
        }
    }
}

impl std::fmt::Debug for UniqueId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // Rank 0's bootstrap address and a random magic: anyone holding it can join the
        // communicator, so logs get a prefix only.
        write!(
            f,
            "UniqueId({:02x}{:02x}{:02x}{:02x}..)",
            self.0[0], self.0[1], self.0[2], self.0[3]
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::env_vars;

    #[test]
    fn a_library_anyone_could_replace_is_not_loaded() {
        use std::os::unix::fs::PermissionsExt;
        let tmp = tempfile::tempdir().unwrap();
        let lib = tmp.path().join("libnccl.so.2");
        std::fs::write(&lib, b"not really a library").unwrap();
        std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o666)).unwrap();
        let err = NcclLibrary::load(&lib, "test").unwrap_err().to_string();
        assert!(err.contains("writable by every user"), "{err}");
        std::fs::set_permissions(&lib, std::fs::Permissions::from_mode(0o644)).unwrap();
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o777)).unwrap();
        let err = NcclLibrary::load(&lib, "test").unwrap_err().to_string();
        assert!(err.contains("its directory"), "{err}");
        std::fs::set_permissions(tmp.path(), std::fs::Permissions::from_mode(0o700)).unwrap();
    }

    #[test]
    fn version_codes_decode_both_schemes() {
        let v = NcclVersion::from_code(23_007);
        assert_eq!((v.major, v.minor, v.patch), (2, 30, 7));
        assert_eq!(v.code(), 23_007);
        assert_eq!(v.to_string(), "2.30.7");
        let old = NcclVersion::from_code(2_804);
        assert_eq!((old.major, old.minor, old.patch), (2, 8, 4));
    }

    #[test]
    fn config_prefix_has_no_padding() {
        // NCCL copies `size` bytes over its defaults: padding would be copied as values.
        assert_eq!(std::mem::size_of::<ConfigPrefix>(), 8 + 4 * 4);
        assert_eq!(std::mem::size_of::<RawUniqueId>(), UNIQUE_ID_BYTES);
    }

    #[test]
    fn a_named_library_is_the_only_candidate() {
        let dir = tempfile::tempdir().unwrap();
        let env = [(env_vars::NCCL_LIBRARY, dir.path().to_str().unwrap())];
        let found = candidates(&env[..]);
        assert_eq!(found.len(), 2, "{found:?}");
        assert!(found.iter().all(|c| c.path.starts_with(dir.path())));
        let err = NcclLibrary::find(&env[..]).unwrap_err().to_string();
        assert!(
            err.contains("libnccl.so.2") && err.contains(env_vars::NCCL_LIBRARY),
            "{err}"
        );
    }

    #[test]
    fn wheels_are_found_in_virtual_environments_and_on_path() {
        let root = tempfile::tempdir().unwrap();
        let lib = root
            .path()
            .join("lib/python3.11/site-packages/nvidia/nccl/lib");
        std::fs::create_dir_all(&lib).unwrap();
        std::fs::write(lib.join("libnccl.so.2"), b"not a library").unwrap();
        std::fs::create_dir_all(root.path().join("bin")).unwrap();
        std::fs::write(root.path().join("bin/python3"), b"").unwrap();
        let bin = root.path().join("bin");
        for env in [
            vec![("VIRTUAL_ENV", root.path().to_str().unwrap())],
            vec![("PATH", bin.to_str().unwrap())],
        ] {
            let found = candidates(&env[..]);
            let wheel = found
                .iter()
                .position(|c| c.path == lib.join("libnccl.so.2"));
            let by_name = found
                .iter()
                .position(|c| c.path == Path::new("libnccl.so.2"));
            assert!(wheel.is_some() && by_name.is_some(), "{found:?}");
            // The wheel is tried before the loader's search, and a file that is not a
            // library is reported, not fatal.
            assert!(wheel < by_name);
            let err = NcclLibrary::load(&lib.join("libnccl.so.2"), "test").unwrap_err();
            assert!(err.to_string().contains("libnccl.so.2"), "{err}");
        }
    }
}
