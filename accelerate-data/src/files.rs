//! Listing a folder's data files: by extension and name prefix, in name order.

use std::path::{Path, PathBuf};

use crate::DataError;

/// The files of `folder` whose extension is one of `extensions` and whose name starts with
/// `prefix`, sorted by name; none is an error saying `what` was looked for.
pub(crate) fn files_in(
    folder: &Path,
    prefix: &str,
    extensions: &[&str],
    what: &'static str,
) -> Result<Vec<PathBuf>, DataError> {
    let mut files = Vec::new();
    for entry in std::fs::read_dir(folder).map_err(|e| DataError::io(folder, e))? {
        let path = entry.map_err(|e| DataError::io(folder, e))?.path();
        let named = path
            .file_name()
            .and_then(|n| n.to_str())
            .is_some_and(|n| n.starts_with(prefix));
        let data_file = path
            .extension()
            .and_then(|e| e.to_str())
            .is_some_and(|e| extensions.contains(&e));
        if named && data_file && path.is_file() {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(DataError::NoFiles {
            path: folder.to_path_buf(),
            what,
        });
    }
    files.sort();
    Ok(files)
}
