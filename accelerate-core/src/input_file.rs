//! Files we read that a user or an earlier run wrote (config files, checkpoint manifests):
//! read up to a limit, so a wrong path (a device such as `/dev/zero`, a multi-gigabyte file)
//! is an error naming the limit, not an allocation of its size.
//!
//! ```
//! let tmp = tempfile::tempdir()?;
//! let path = tmp.path().join("config.toml");
//! std::fs::write(&path, "num_processes = 2\n")?;
//! assert_eq!(accelerate_core::input_file::read_at_most(&path, 1024)?.len(), 18);
//! assert!(accelerate_core::input_file::read_at_most(&path, 8).is_err());
//! # Ok::<(), std::io::Error>(())
//! ```

use std::io::Read;
use std::path::Path;

/// The bytes of `path`, or an `InvalidData` error when it holds more than `max` bytes.
pub fn read_at_most(path: &Path, max: u64) -> std::io::Result<Vec<u8>> {
    let mut bytes = Vec::new();
    std::fs::File::open(path)?
        .take(max.saturating_add(1))
        .read_to_end(&mut bytes)?;
    if bytes.len() as u64 > max {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidData,
            format!("larger than the {max} bytes such a file may hold"),
        ));
    }
    Ok(bytes)
}

/// [`read_at_most`] as UTF-8 text.
pub fn read_text_at_most(path: &Path, max: u64) -> std::io::Result<String> {
    String::from_utf8(read_at_most(path, max)?)
        .map_err(|_| std::io::Error::new(std::io::ErrorKind::InvalidData, "not UTF-8 text"))
}
