//! Which Arrow files a path stands for: one file, a Hugging Face `save_to_disk` folder (its
//! `state.json` names the files), a `DatasetDict` folder (refused, naming its splits), or a
//! folder of `.arrow` files.

use std::path::{Path, PathBuf};

use serde::Deserialize;

use crate::DataError;

/// `state.json` of a `datasets.Dataset` saved with `save_to_disk`: the part we read.
#[derive(Deserialize)]
struct State {
    #[serde(rename = "_data_files")]
    data_files: Vec<DataFile>,
}

#[derive(Deserialize)]
struct DataFile {
    filename: String,
}

/// `dataset_dict.json` of a `datasets.DatasetDict`.
#[derive(Deserialize)]
struct DatasetDict {
    splits: Vec<String>,
}

/// The Arrow files `path` stands for, in order.
pub(super) fn data_files(path: &Path) -> Result<Vec<PathBuf>, DataError> {
    if !path.is_dir() {
        // A file (or nothing: opening it says so, with the path).
        return Ok(vec![path.to_path_buf()]);
    }
    let state = path.join("state.json");
    if state.is_file() {
        let state: State = read_json(&state)?;
        return state
            .data_files
            .into_iter()
            .map(|f| {
                // Only names inside the folder: a state.json never sends us elsewhere.
                let name = Path::new(&f.filename);
                match name.file_name() {
                    Some(base) if base == name.as_os_str() => Ok(path.join(name)),
                    _ => Err(DataError::Folder {
                        path: path.to_path_buf(),
                        reason: format!(
                            "its state.json names {:?}, not a file of the folder",
                            f.filename
                        ),
                    }),
                }
            })
            .collect();
    }
    let dict = path.join("dataset_dict.json");
    if dict.is_file() {
        let dict: DatasetDict = read_json(&dict)?;
        return Err(DataError::Folder {
            path: path.to_path_buf(),
            reason: format!(
                "it is a Hugging Face DatasetDict with the splits {}: open one of them (open_split, \
                 or the path {})",
                dict.splits.join(", "),
                path.join(dict.splits.first().map_or("train", String::as_str))
                    .display()
            ),
        });
    }
    crate::files::files_in(
        path,
        "",
        &["arrow"],
        "Arrow files (*.arrow) and no state.json or dataset_dict.json",
    )
}

/// The `.arrow` files of `folder` whose names start with `prefix`, in name order.
pub(super) fn prefixed(folder: &Path, prefix: &str) -> Result<Vec<PathBuf>, DataError> {
    crate::files::files_in(
        folder,
        prefix,
        &["arrow"],
        "Arrow files (*.arrow) with the prefix asked for",
    )
}

/// The folder of split `split` of the `DatasetDict` saved at `path`.
pub(super) fn split(path: &Path, split: &str) -> Result<PathBuf, DataError> {
    let dict: DatasetDict = read_json(&path.join("dataset_dict.json"))?;
    if dict.splits.iter().any(|s| s == split) {
        Ok(path.join(split))
    } else {
        Err(DataError::Folder {
            path: path.to_path_buf(),
            reason: format!(
                "it has no split {split:?} (its splits: {})",
                dict.splits.join(", ")
            ),
        })
    }
}

fn read_json<T: serde::de::DeserializeOwned>(path: &Path) -> Result<T, DataError> {
    let text = std::fs::read_to_string(path).map_err(|e| DataError::io(path, e))?;
    serde_json::from_str(&text).map_err(|e| DataError::Folder {
        path: path.to_path_buf(),
        reason: format!("it is not the JSON Hugging Face datasets writes: {e}"),
    })
}
