//! Arrow files as a map-style data set: Arrow IPC files and the folders Hugging Face
//! `datasets` writes with `save_to_disk`, memory-mapped, each row an item.
//!
//! Memory: the files are mapped, not read; what the process holds is one small record per
//! record batch (Hugging Face writes 1,000 rows per batch), and the pages the rows it reads
//! bring into the page cache.

mod folder;
mod ipc;
mod row;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use burn::data::dataset::{Dataset, DatasetError};

pub use row::ArrowRow;

use crate::DataError;

/// The record batches of one file.
#[derive(Debug)]
struct Part {
    path: Arc<Path>,
    batches: Vec<RecordBatch>,
    /// Rows before each batch of this file.
    starts: Vec<usize>,
}

/// Rows of Arrow IPC files, in file order then row order. The files are memory-mapped and
/// decoded in place; the process holds one small record per record batch and the pages the
/// rows it reads bring in.
///
/// ```
/// use accelerate_data::ArrowDataset;
/// use burn::data::dataset::Dataset;
/// # use std::sync::Arc;
/// # use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
/// # let dir = tempfile::tempdir()?;
/// # let path = dir.path().join("imdb-train.arrow");
/// # let batch = RecordBatch::try_from_iter([
/// #     ("text", Arc::new(StringArray::from(vec!["a fine film", "dull"])) as ArrayRef),
/// #     ("label", Arc::new(Int64Array::from(vec![1, 0])) as ArrayRef),
/// # ])?;
/// # let file = std::fs::File::create(&path)?;
/// # let mut writer = arrow_ipc::writer::FileWriter::try_new(file, &batch.schema())?;
/// # writer.write(&batch)?;
/// # writer.finish()?;
///
/// // An Arrow file as pyarrow writes it, or a folder written by `datasets`' `save_to_disk`.
/// let train = ArrowDataset::open(&path)?.select(&["text", "label"])?;
/// let first = train.get(0)?;
/// assert_eq!((first.text("text")?, first.int("label")?), ("a fine film", 1));
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct ArrowDataset {
    parts: Arc<[Part]>,
    schema: SchemaRef,
    /// Rows before each file, and in all (one more entry than files).
    starts: Vec<usize>,
    /// The columns kept by [`select`](Self::select), as indices of the files' schema.
    projection: Option<Arc<[usize]>>,
}

impl ArrowDataset {
    /// An Arrow IPC file (`.arrow`, `.feather`, `.ipc`), a folder written by Hugging Face
    /// `save_to_disk` (its `state.json` lists the files), or a folder of `.arrow` files. A
    /// `DatasetDict` folder is refused with its splits named: open one with
    /// [`open_split`](Self::open_split).
    pub fn open(path: impl AsRef<Path>) -> Result<Self, DataError> {
        let files = folder::data_files(path.as_ref())?;
        Self::from_files(files)
    }

    /// The split `split` (`"train"`, `"test"`) of a `DatasetDict` saved with `save_to_disk`.
    pub fn open_split(path: impl AsRef<Path>, split: &str) -> Result<Self, DataError> {
        Self::open(folder::split(path.as_ref(), split)?)
    }

    /// The `.arrow` files of `folder` whose names start with `prefix` (`"train"`,
    /// `"validation"`), in name order: the hub's `train-00000-of-00002.arrow`, ...
    pub fn open_prefixed(folder: impl AsRef<Path>, prefix: &str) -> Result<Self, DataError> {
        Self::from_files(folder::prefixed(folder.as_ref(), prefix)?)
    }

    /// These IPC files, in this order; all must share one schema.
    pub fn from_files(files: impl IntoIterator<Item = PathBuf>) -> Result<Self, DataError> {
        let mut parts = Vec::new();
        let mut starts = vec![0usize];
        let mut schema: Option<(SchemaRef, PathBuf)> = None;
        for path in files {
            let file = ipc::read(&path)?;
            match &schema {
                None => schema = Some((Arc::clone(&file.schema), path.clone())),
                Some((first, first_path)) if first.fields() != file.schema.fields() => {
                    return Err(DataError::Folder {
                        path,
                        reason: format!(
                            "its columns ({}) differ from those of {} ({}): files of one data \
                             set share their columns",
                            names(&file.schema),
                            first_path.display(),
                            names(first)
                        ),
                    });
                }
                Some(_) => {}
            }
            let mut rows = 0usize;
            let batch_starts = file
                .batches
                .iter()
                .map(|b| {
                    let start = rows;
                    rows += b.num_rows();
                    start
                })
                .collect();
            let total = starts.last().copied().unwrap_or(0) + rows;
            starts.push(total);
            parts.push(Part {
                path: path.into(),
                batches: file.batches,
                starts: batch_starts,
            });
        }
        let (schema, _) = schema.ok_or_else(|| DataError::NoFiles {
            path: PathBuf::new(),
            what: "Arrow files (none were given)",
        })?;
        Ok(Self {
            parts: parts.into(),
            schema,
            starts,
            projection: None,
        })
    }

    /// The columns of every row (all of them until [`select`](Self::select)).
    pub fn column_names(&self) -> Vec<String> {
        let all = self.schema.fields().iter().map(|f| f.name().clone());
        match &self.projection {
            None => all.collect(),
            Some(kept) => kept
                .iter()
                .map(|&i| self.schema.field(i).name().clone())
                .collect(),
        }
    }

    /// The files' schema (all columns, whatever [`select`](Self::select) kept).
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Keeps only `columns` in the rows; a name the files do not have is an error naming the
    /// file and the columns it has.
    pub fn select(mut self, columns: &[&str]) -> Result<Self, DataError> {
        let first = self.parts.first().map(|p| p.path.to_path_buf());
        let indices = column_indices(&self.schema, columns, first.unwrap_or_default())?;
        self.projection = Some(indices.into());
        Ok(self)
    }

    /// Row `index` (over all files), or `None` beyond the last.
    pub fn row(&self, index: usize) -> Option<ArrowRow> {
        let file = self
            .starts
            .partition_point(|&s| s <= index)
            .checked_sub(1)?;
        let part = self.parts.get(file)?;
        let within = index.checked_sub(self.starts[file])?;
        let batch = part
            .starts
            .partition_point(|&s| s <= within)
            .checked_sub(1)?;
        let row = within.checked_sub(part.starts[batch])?;
        let record = part.batches.get(batch)?;
        if row >= record.num_rows() {
            return None;
        }
        let record = match &self.projection {
            None => record.clone(),
            Some(kept) => record.project(kept).ok()?,
        };
        Some(ArrowRow::new(record, row, within, Arc::clone(&part.path)))
    }
}

impl Dataset<ArrowRow> for ArrowDataset {
    /// Panics when `index >= len()`, as Burn's data sets do.
    fn get(&self, index: usize) -> Result<ArrowRow, DatasetError> {
        match self.row(index) {
            Some(row) => Ok(row),
            None => panic!("row {index} of {}", self.len()),
        }
    }

    fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }
}

/// The indices of `columns` in `schema`; a name it lacks is an error naming `path` (the first
/// file) and the columns it has.
pub(crate) fn column_indices(
    schema: &SchemaRef,
    columns: &[&str],
    path: PathBuf,
) -> Result<Vec<usize>, DataError> {
    columns
        .iter()
        .map(|&name| {
            schema.index_of(name).map_err(|_| DataError::MissingColumn {
                path: path.clone(),
                column: name.to_string(),
                available: names(schema),
            })
        })
        .collect()
}

/// A schema's column names, comma-separated.
pub(crate) fn names(schema: &SchemaRef) -> String {
    let names: Vec<&str> = schema.fields().iter().map(|f| f.name().as_str()).collect();
    names.join(", ")
}
