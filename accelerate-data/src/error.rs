//! The one error type of this crate: what went wrong, in which file, and what to do.

use std::path::PathBuf;

use arrow_schema::ArrowError;

/// A data file that cannot be opened or read as the format it claims.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// The operating system refused a read.
    #[error("cannot read {}: {source}", .path.display())]
    Io {
        /// The file or folder.
        path: PathBuf,
        /// The system's error.
        #[source]
        source: std::io::Error,
    },
    /// A token file whose header is not one we read.
    #[error(
        "{} is not a token file we can read: {reason} (we read llm.c's .bin with its \
         header, raw little-endian .bin arrays and numpy .npy files)", .path.display())]
    TokenFormat {
        /// The file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A file shorter than its header says.
    #[error(
        "{} is truncated: its header promises {expected} bytes, the file holds {found} \
         (it was cut short while written or copied: write it again)", .path.display())]
    Truncated {
        /// The file.
        path: PathBuf,
        /// Bytes the header describes.
        expected: u64,
        /// Bytes on disk.
        found: u64,
    },
    /// A folder with nothing to read.
    #[error("{} holds no {what}", .path.display())]
    NoFiles {
        /// The folder.
        path: PathBuf,
        /// The files looked for.
        what: &'static str,
    },
    /// A token outside the range a consumer accepts, or a sample outside a file.
    #[error("{}: {reason}", .path.display())]
    Content {
        /// The file.
        path: PathBuf,
        /// What was found.
        reason: String,
    },
    /// Arrow's reader refused part of a file.
    #[error(
        "{}{}: {source} (the Arrow file is corrupt or not an Arrow IPC file: write it again)",
        .path.display(),
        .batch.map(|b| format!(", record batch {b}")).unwrap_or_default()
    )]
    Arrow {
        /// The file.
        path: PathBuf,
        /// The record batch, when one was being read.
        batch: Option<usize>,
        /// Arrow's error.
        #[source]
        source: ArrowError,
    },
    /// The Parquet reader refused part of a file.
    #[error(
        "{}{}: {source} (the Parquet file is corrupt or not a Parquet file: write it again)",
        .path.display(),
        .row_group.map(|g| format!(", row group {g}")).unwrap_or_default()
    )]
    Parquet {
        /// The file.
        path: PathBuf,
        /// The row group, when one was being read.
        row_group: Option<usize>,
        /// The reader's error.
        #[source]
        source: parquet::errors::ParquetError,
    },
    /// A column asked for by name that the data does not have.
    #[error("{} has no column `{column}` (its columns: {available})", .path.display())]
    MissingColumn {
        /// The file.
        path: PathBuf,
        /// The name asked for.
        column: String,
        /// The names it has, comma-separated.
        available: String,
    },
    /// A column read as a type it does not hold.
    #[error("column `{column}` of {} holds {found}, not {expected}", .path.display())]
    ColumnType {
        /// The file.
        path: PathBuf,
        /// The column.
        column: String,
        /// Its Arrow type.
        found: String,
        /// What the caller read it as.
        expected: &'static str,
    },
    /// A null where a value was needed.
    #[error("row {row} of column `{column}` in {} is null", .path.display())]
    Null {
        /// The file.
        path: PathBuf,
        /// The column.
        column: String,
        /// The row within the file.
        row: usize,
    },
    /// A Hugging Face `datasets` folder that is not one data set.
    #[error("{}: {reason}", .path.display())]
    Folder {
        /// The folder.
        path: PathBuf,
        /// What it holds instead, and what to open.
        reason: String,
    },
    /// A write that would replace a file this crate did not create.
    #[error("{} exists: choose another name or remove it yourself (we never replace a file)", .path.display())]
    Exists {
        /// The file.
        path: PathBuf,
    },
}

impl DataError {
    pub(crate) fn io(path: impl Into<PathBuf>, source: std::io::Error) -> Self {
        Self::Io {
            path: path.into(),
            source,
        }
    }
}

impl From<DataError> for burn::data::dataset::DatasetError {
    fn from(error: DataError) -> Self {
        Self::new(error)
    }
}
