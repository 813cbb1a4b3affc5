//! Files we write for the user beside their work (rank logs, metrics): opened without
//! following a symbolic link planted at their name, so a launch or a logger never writes
//! through a link into a file somebody else chose.
//!
//! ```
//! let tmp = tempfile::tempdir()?;
//! let log = tmp.path().join("rank_0.log");
//! accelerate_core::output_file::create(&log)?;
//! # #[cfg(unix)] {
//! let link = tmp.path().join("rank_1.log");
//! std::os::unix::fs::symlink(tmp.path().join("elsewhere"), &link)?;
//! assert!(accelerate_core::output_file::create(&link).is_err());
//! assert!(!tmp.path().join("elsewhere").exists());
//! # }
//! # Ok::<(), std::io::Error>(())
//! ```

use std::fs::{File, OpenOptions};
use std::path::Path;

/// Creates (or truncates) `path` for writing; an error if `path` is a symbolic link.
pub fn create(path: &Path) -> std::io::Result<File> {
    no_follow(OpenOptions::new().write(true).create(true).truncate(true)).open(path)
}

/// Opens `path` for appending, creating it if absent; an error if `path` is a symbolic link.
pub fn append(path: &Path) -> std::io::Result<File> {
    no_follow(OpenOptions::new().create(true).append(true)).open(path)
}

#[cfg(unix)]
fn no_follow(options: &mut OpenOptions) -> &mut OpenOptions {
    use std::os::unix::fs::OpenOptionsExt;
    options.custom_flags(libc::O_NOFOLLOW)
}

#[cfg(not(unix))]
fn no_follow(options: &mut OpenOptions) -> &mut OpenOptions {
    options
}
