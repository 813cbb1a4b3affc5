//! Where libnccl is looked for ([`candidates`]), and which files are refused before loading
//! (a library another user could have replaced). No FFI here: the search reads the
//! environment and the file system only.

use std::path::{Path, PathBuf};

use crate::env_vars::{self, EnvSource};

/// The file names libnccl goes by: the soname every package ships first.
const FILE_NAMES: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

/// One place libnccl may be, and why we look there.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Candidate {
    /// A full path, or a bare file name for the dynamic loader's own search.
    pub path: PathBuf,
    /// Where the candidate came from ("ACCELERATE_NCCL_LIBRARY", "pip wheel under ...").
    pub origin: String,
}

/// Where libnccl is looked for, in order. `ACCELERATE_NCCL_LIBRARY` (a file or a directory),
/// when set, is the only place: a path the user named is never silently replaced. Otherwise:
/// `NCCL_HOME`/`NCCL_ROOT`/`CUDA_HOME`, `LD_LIBRARY_PATH`, the `nvidia-nccl-cu*` wheel of an
/// active virtual environment or conda prefix, of a Python environment whose `bin` is on
/// `PATH`, of the user's and the system's site-packages, then the dynamic loader's own search
/// (`ld.so.cache`, `/usr/lib`) by file name. Candidates that do not exist are left out, except
/// the file names of the last step.
pub fn candidates(env: &(impl EnvSource + ?Sized)) -> Vec<Candidate> {
    let mut out: Vec<Candidate> = Vec::new();
    let mut push = |path: PathBuf, origin: String| {
        if !out.iter().any(|c| c.path == path) {
            out.push(Candidate { path, origin });
        }
    };
    if let Some(named) = env.var(env_vars::NCCL_LIBRARY) {
        let named = PathBuf::from(named.trim());
        let origin = env_vars::NCCL_LIBRARY.to_string();
        if named.is_dir() {
            for name in FILE_NAMES {
                push(named.join(name), origin.clone());
            }
        } else {
            push(named, origin);
        }
        return out;
    }
    let in_dir = |dir: &Path| FILE_NAMES.map(|name| dir.join(name));
    for key in ["NCCL_HOME", "NCCL_ROOT", "CUDA_HOME"] {
        if let Some(root) = env.var(key) {
            for lib in ["lib", "lib64"] {
                for path in in_dir(&Path::new(root.trim()).join(lib)) {
                    if path.is_file() {
                        push(path, key.to_string());
                    }
                }
            }
        }
    }
    if let Some(dirs) = env.var("LD_LIBRARY_PATH") {
        // Relative entries name whatever directory the job was started in: never searched.
        for dir in std::env::split_paths(&dirs).filter(|d| d.is_absolute()) {
            for path in in_dir(&dir) {
                if path.is_file() {
                    push(path, "LD_LIBRARY_PATH".into());
                }
            }
        }
    }
    for (root, origin) in python_roots(env) {
        for path in wheel_libraries(&root) {
            push(path, format!("pip wheel nvidia-nccl ({origin})"));
        }
    }
    for name in FILE_NAMES {
        push(PathBuf::from(name), "the dynamic loader's search".into());
    }
    out
}

/// Python installations whose site-packages may hold an `nvidia-nccl-cu*` wheel, with why.
fn python_roots(env: &(impl EnvSource + ?Sized)) -> Vec<(PathBuf, String)> {
    let mut roots = Vec::new();
    for key in ["VIRTUAL_ENV", "CONDA_PREFIX"] {
        if let Some(root) = env.var(key) {
            roots.push((PathBuf::from(root.trim()), key.to_string()));
        }
    }
    // A virtual environment used without activation: its bin directory on PATH (how torchrun
    // and CI run), recognised by the python next to it.
    if let Some(path) = env.var("PATH") {
        for dir in std::env::split_paths(&path).filter(|d| d.is_absolute()) {
            if (dir.join("python3").exists() || dir.join("python").exists())
                && let Some(root) = dir.parent()
            {
                roots.push((
                    root.to_path_buf(),
                    format!("python on PATH in {}", dir.display()),
                ));
            }
        }
    }
    if let Some(home) = env.var("HOME") {
        roots.push((Path::new(home.trim()).join(".local"), "user site".into()));
    }
    for system in ["/usr/local", "/usr"] {
        roots.push((PathBuf::from(system), "system site".into()));
    }
    roots
}

/// `<root>/lib/python3.*/{site,dist}-packages/nvidia/nccl/lib/libnccl.so.2` and Debian's
/// version-less `lib/python3/dist-packages`, where they exist.
fn wheel_libraries(root: &Path) -> Vec<PathBuf> {
    let lib = root.join("lib");
    let Ok(entries) = std::fs::read_dir(&lib) else {
        return Vec::new();
    };
    let mut pythons: Vec<PathBuf> = entries
        .filter_map(Result::ok)
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("python3"))
        })
        .collect();
    // Newest Python first, so that a machine with several finds the same one every time.
    pythons.sort();
    pythons.reverse();
    pythons
        .into_iter()
        .flat_map(|python| {
            ["site-packages", "dist-packages"]
                .map(|packages| python.join(packages).join("nvidia/nccl/lib/libnccl.so.2"))
        })
        .filter(|path| path.is_file())
        .collect()
}

/// Why the library at `path` must not be loaded: it, or the directory holding it, can be
/// replaced by another user (world-writable, a directory without the sticky bit). `None` for
/// a bare file name (the dynamic loader's own, system-managed search) or a safe file.
pub(super) fn writable_by_others(path: &Path) -> Option<String> {
    use std::os::unix::fs::PermissionsExt;
    if path.parent().is_none_or(|p| p.as_os_str().is_empty()) {
        return None;
    }
    let mode = |p: &Path| std::fs::metadata(p).ok().map(|m| m.permissions().mode());
    const OTHERS_WRITE: u32 = 0o002;
    const STICKY: u32 = 0o1000;
    if mode(path).is_some_and(|m| m & OTHERS_WRITE != 0) {
        return Some(
            "the file is writable by every user, so anyone could have replaced it; hint: \
             chmod o-w it, or use another copy"
                .into(),
        );
    }
    let dir = path.parent()?;
    if mode(dir).is_some_and(|m| m & OTHERS_WRITE != 0 && m & STICKY == 0) {
        return Some(format!(
            "its directory {} is writable by every user, so anyone could have replaced it; \
             hint: chmod o-w the directory, or use another copy",
            dir.display()
        ));
    }
    None
}
