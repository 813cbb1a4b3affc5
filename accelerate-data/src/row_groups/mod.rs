//! Parquet files (the Hugging Face hub's layout: `data/train-00000-of-00004.parquet`, ...)
//! read by row group: a data set of rows whose row groups are its pieces.
//!
//! Only the files' footers are read at open (row counts, schema). A row is served from its
//! row group, decoded whole when first asked for and kept in a small cache, so a loader that
//! reads the data in pieces (`DataLoader::builder(..).pieces(dataset.pieces(), shuffle_rows)`)
//! decodes each row group about once per epoch and each process decodes its own row groups.
//! Memory: the footers, and the cached row groups (see [`ParquetDataset::cache_row_groups`]).

mod cache;

use std::fs::File;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow_array::RecordBatch;
use arrow_schema::SchemaRef;
use burn::data::dataset::{Dataset, DatasetError};
use parquet::arrow::ProjectionMask;
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder,
};

use crate::{ArrowRow, DataError};
use cache::RowGroupCache;

/// Row groups kept decoded by default.
pub const DEFAULT_CACHED_ROW_GROUPS: usize = 8;

/// One file's footer.
#[derive(Debug)]
struct ParquetFile {
    path: Arc<Path>,
    metadata: ArrowReaderMetadata,
}

/// A row group: its file, its index there, and the rows before it in that file.
#[derive(Debug, Clone, Copy)]
struct Piece {
    file: usize,
    row_group: usize,
    first_row_in_file: usize,
}

/// Rows of Parquet files, in file order then row order, decoded a row group at a time: only
/// the footers are read at open, a row group is decoded whole when one of its rows is first
/// asked for and kept in a small cache ([`cache_row_groups`](Self::cache_row_groups)). Give
/// [`pieces`](Self::pieces) to the loader (`DataLoaderBuilder::pieces`) so that each process
/// reads its own row groups.
///
/// ```
/// use accelerate_data::ParquetDataset;
/// use burn::data::dataset::Dataset;
/// # use std::sync::Arc;
/// # use arrow_array::{ArrayRef, RecordBatch, StringArray};
/// # use parquet::{arrow::ArrowWriter, file::properties::WriterProperties};
/// # let dir = tempfile::tempdir()?;
/// # let text = StringArray::from(vec!["one", "two", "three"]);
/// # let batch = RecordBatch::try_from_iter([("text", Arc::new(text) as ArrayRef)])?;
/// # for i in 0..2 {
/// #     let file = std::fs::File::create(dir.path().join(format!("train-0000{i}-of-00002.parquet")))?;
/// #     let rows = WriterProperties::builder().set_max_row_group_row_count(Some(2)).build();
/// #     let mut writer = ArrowWriter::try_new(file, batch.schema(), Some(rows))?;
/// #     writer.write(&batch)?;
/// #     writer.close()?;
/// # }
///
/// // The hub's layout: data/train-00000-of-00002.parquet, data/train-00001-of-00002.parquet
/// let train = ParquetDataset::open_prefixed(dir.path(), "train")?.select(&["text"])?;
/// assert_eq!(train.len(), 6);
/// assert_eq!(train.pieces(), [2, 1, 2, 1]); // rows per row group: the loader's pieces
/// assert_eq!(train.get(5)?.text("text")?, "three");
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct ParquetDataset {
    files: Arc<[ParquetFile]>,
    pieces: Arc<[Piece]>,
    /// Rows before each row group, and in all (one more entry than row groups).
    starts: Arc<[usize]>,
    schema: SchemaRef,
    /// The columns decoded, as indices of the schema (all when `None`).
    projection: Option<Arc<[usize]>>,
    cache: Arc<RowGroupCache>,
}

impl ParquetDataset {
    /// A `.parquet` file, or every `.parquet` file of a folder in name order.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, DataError> {
        let path = path.as_ref();
        if path.is_dir() {
            Self::from_files(parquet_files(path, "")?)
        } else {
            Self::from_files([path.to_path_buf()])
        }
    }

    /// The `.parquet` files of `folder` whose names start with `prefix` (`"train"` for the
    /// hub's `train-00000-of-00004.parquet`), in name order.
    pub fn open_prefixed(folder: impl AsRef<Path>, prefix: &str) -> Result<Self, DataError> {
        Self::from_files(parquet_files(folder.as_ref(), prefix)?)
    }

    /// These files, in this order; all must share one schema.
    pub fn from_files(files: impl IntoIterator<Item = PathBuf>) -> Result<Self, DataError> {
        let (mut opened, mut pieces, mut starts) = (Vec::new(), Vec::new(), vec![0usize]);
        let mut schema: Option<SchemaRef> = None;
        for path in files {
            let file = File::open(&path).map_err(|e| DataError::io(&path, e))?;
            let metadata =
                unpanicked(|| ArrowReaderMetadata::load(&file, ArrowReaderOptions::new()))
                    .map_err(|source| parquet_error(&path, None, source))?;
            match &schema {
                None => schema = Some(Arc::clone(metadata.schema())),
                Some(first) if first.fields() != metadata.schema().fields() => {
                    return Err(DataError::Folder {
                        path,
                        reason: format!(
                            "its columns ({}) differ from those of the first file ({}): files \
                             of one data set share their columns",
                            crate::arrow::names(metadata.schema()),
                            crate::arrow::names(first)
                        ),
                    });
                }
                Some(_) => {}
            }
            let mut in_file = 0usize;
            for (row_group, group) in metadata.metadata().row_groups().iter().enumerate() {
                let rows = usize::try_from(group.num_rows()).map_err(|_| {
                    parquet_error(
                        &path,
                        Some(row_group),
                        parquet::errors::ParquetError::General(format!(
                            "its footer gives {} rows",
                            group.num_rows()
                        )),
                    )
                })?;
                pieces.push(Piece {
                    file: opened.len(),
                    row_group,
                    first_row_in_file: in_file,
                });
                in_file += rows;
                let total = starts.last().copied().unwrap_or(0) + rows;
                starts.push(total);
            }
            opened.push(ParquetFile {
                path: path.into(),
                metadata,
            });
        }
        let schema = schema.ok_or_else(|| DataError::NoFiles {
            path: PathBuf::new(),
            what: "Parquet files (none were given)",
        })?;
        Ok(Self {
            files: opened.into(),
            pieces: pieces.into(),
            starts: starts.into(),
            schema,
            projection: None,
            cache: Arc::new(RowGroupCache::new(DEFAULT_CACHED_ROW_GROUPS)),
        })
    }

    /// Decodes only `columns`; a name the files do not have is an error naming the first
    /// file and the columns it has.
    pub fn select(mut self, columns: &[&str]) -> Result<Self, DataError> {
        let first = self.files.first().map(|f| f.path.to_path_buf());
        let indices =
            crate::arrow::column_indices(&self.schema, columns, first.unwrap_or_default())?;
        self.projection = Some(indices.into());
        self.cache = Arc::new(RowGroupCache::new(self.cache.capacity()));
        Ok(self)
    }

    /// Keeps up to `row_groups` decoded row groups (default
    /// [`DEFAULT_CACHED_ROW_GROUPS`]); a loader's workers and its shuffle block should fit.
    pub fn cache_row_groups(mut self, row_groups: usize) -> Self {
        self.cache = Arc::new(RowGroupCache::new(row_groups.max(1)));
        self
    }

    /// Rows per row group, in data-set order: the pieces for `DataLoader`'s `pieces`.
    pub fn pieces(&self) -> Vec<usize> {
        self.starts.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// The files' schema (all columns).
    pub fn schema(&self) -> &SchemaRef {
        &self.schema
    }

    /// Row `index` (over all files).
    pub fn row(&self, index: usize) -> Result<ArrowRow, DataError> {
        let piece_index = self
            .starts
            .partition_point(|&s| s <= index)
            .saturating_sub(1);
        let (Some(piece), Some(&start)) =
            (self.pieces.get(piece_index), self.starts.get(piece_index))
        else {
            return Err(DataError::Content {
                path: PathBuf::new(),
                reason: format!("row {index} is beyond the data set's {} rows", self.len()),
            });
        };
        let batch = self.cache.get(piece_index, || self.decode(*piece))?;
        let row = index - start;
        let file = &self.files[piece.file];
        if row >= batch.num_rows() {
            return Err(DataError::Content {
                path: file.path.to_path_buf(),
                reason: format!(
                    "row group {} decoded to {} rows, not the {} its footer counts",
                    piece.row_group,
                    batch.num_rows(),
                    self.starts[piece_index + 1] - start
                ),
            });
        }
        Ok(ArrowRow::new(
            batch,
            row,
            piece.first_row_in_file + row,
            Arc::clone(&file.path),
        ))
    }

    /// The rows of `piece`, decoded.
    fn decode(&self, piece: Piece) -> Result<RecordBatch, DataError> {
        let file = &self.files[piece.file];
        let error = |source| parquet_error(&file.path, Some(piece.row_group), source);
        let reader = File::open(&file.path).map_err(|e| DataError::io(&*file.path, e))?;
        let mut builder =
            ParquetRecordBatchReaderBuilder::new_with_metadata(reader, file.metadata.clone())
                .with_row_groups(vec![piece.row_group])
                .with_batch_size(8192);
        if let Some(columns) = &self.projection {
            let mask = ProjectionMask::roots(builder.parquet_schema(), columns.iter().copied());
            builder = builder.with_projection(mask);
        }
        let batches = unpanicked(|| {
            builder
                .build()?
                .collect::<Result<Vec<_>, _>>()
                .map_err(Into::into)
        })
        .map_err(error)?;
        let schema = match batches.first() {
            Some(first) => first.schema(),
            None => match &self.projection {
                Some(columns) => {
                    Arc::new(self.schema.project(columns).map_err(|e| error(e.into()))?)
                }
                None => Arc::clone(&self.schema),
            },
        };
        arrow_select::concat::concat_batches(&schema, &batches).map_err(|source| DataError::Arrow {
            path: file.path.to_path_buf(),
            batch: Some(piece.row_group),
            source,
        })
    }
}

impl Dataset<ArrowRow> for ParquetDataset {
    fn get(&self, index: usize) -> Result<ArrowRow, DatasetError> {
        assert!(index < self.len(), "row {index} of {}", self.len());
        Ok(self.row(index)?)
    }

    fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }
}

/// `read`, with a panic inside the Parquet reader (on a corrupt file) turned into its error:
/// the reader's own checks are not ours to complete, and a corrupt file must stop the run
/// with its name, not take down a loader thread.
fn unpanicked<T>(
    read: impl FnOnce() -> Result<T, parquet::errors::ParquetError>,
) -> Result<T, parquet::errors::ParquetError> {
    std::panic::catch_unwind(std::panic::AssertUnwindSafe(read)).unwrap_or_else(|panic| {
        let what = panic
            .downcast_ref::<String>()
            .map(String::as_str)
            .or_else(|| panic.downcast_ref::<&str>().copied())
            .unwrap_or("no message");
        Err(parquet::errors::ParquetError::General(format!(
            "the Parquet reader failed on it ({what})"
        )))
    })
}

fn parquet_error(
    path: &Path,
    row_group: Option<usize>,
    source: parquet::errors::ParquetError,
) -> DataError {
    DataError::Parquet {
        path: path.to_path_buf(),
        row_group,
        source,
    }
}

/// The `.parquet` files of `folder` whose names start with `prefix`, sorted.
fn parquet_files(folder: &Path, prefix: &str) -> Result<Vec<PathBuf>, DataError> {
    crate::files::files_in(
        folder,
        prefix,
        &["parquet"],
        "Parquet files (*.parquet) with the prefix asked for",
    )
}
