//! Shakespeare's plays as bytes, embedded in the binary, for byte-level language modelling.
//!
//! 4,850,382 bytes of ASCII text; the first 90 % train, the rest validate. A sample is a
//! window of `context + 1` bytes starting at a multiple of `context` (windows overlap by one
//! byte, so every byte but the first is predicted once per epoch). Attribution and licence:
//! `data/README.md`.

use std::io::Read;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use accelerate_burn::burn;
use accelerate_data::{
    ArrowDataset, ArrowRow, ParquetDataset, TokenShardWriter, TokenShards, TokenType, TokenWindows,
};
use anyhow::Context;
use arrow_array::{RecordBatch, StringArray};
use arrow_ipc::writer::FileWriter;
use arrow_schema::{DataType, Field, Schema};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::{Device, Int, Tensor, TensorData};
use parquet::arrow::ArrowWriter;
use parquet::basic::Compression;
use parquet::file::properties::WriterProperties;

/// Byte-level vocabulary.
pub const VOCAB: usize = 256;

const TEXT_GZ: &[u8] = include_bytes!("../data/shakespeare.txt.gz");

/// Every byte of the corpus.
pub fn load() -> anyhow::Result<Vec<u8>> {
    let mut text = Vec::with_capacity(5 << 20);
    flate2::read::GzDecoder::new(TEXT_GZ)
        .read_to_end(&mut text)
        .context("decompressing the embedded shakespeare.txt.gz")?;
    Ok(text)
}

/// Bytes of text shared between a data set and its loader threads.
pub type SharedText = Arc<Vec<u8>>;

/// The fixed split: (train, validation), the first 90 % of the bytes and the rest.
pub fn train_validation_split() -> anyhow::Result<(SharedText, SharedText)> {
    let mut train = load()?;
    let validation = train.split_off(train.len() * 9 / 10);
    Ok((Arc::new(train), Arc::new(validation)))
}

/// The windows of one text: item `i` is the `context + 1` bytes from `i * context`.
#[derive(Debug, Clone)]
pub struct TextWindows {
    text: SharedText,
    context: usize,
    len: usize,
}

impl TextWindows {
    /// The windows of `text` (at most `limit` of them, from the start).
    pub fn new(text: SharedText, context: usize, limit: Option<usize>) -> Self {
        let all = text.len().saturating_sub(1) / context.max(1);
        Self {
            len: limit.map_or(all, |l| l.min(all)),
            text,
            context: context.max(1),
        }
    }
}

impl TextWindows {
    /// Each window's bytes in the text, in order.
    pub fn starts(&self) -> impl Iterator<Item = std::ops::Range<usize>> + '_ {
        (0..self.len).map(|i| i * self.context..i * self.context + self.context + 1)
    }
}

impl Dataset<Vec<u8>> for TextWindows {
    /// Panics when `index >= len()`, as Burn's data sets do.
    fn get(&self, index: usize) -> Result<Vec<u8>, DatasetError> {
        assert!(index < self.len, "window {index} of {}", self.len);
        let start = index * self.context;
        Ok(self.text[start..start + self.context + 1].to_vec())
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// Writes the fixed split as llm.c token files in `dir` (which must exist): `train_000000.bin`,
/// `train_000001.bin`, ... of at most `tokens_per_file` tokens each, then `val_000000.bin`, ...
/// Returns the files written. Never replaces a file.
pub fn write_token_files(dir: &Path, tokens_per_file: usize) -> anyhow::Result<Vec<PathBuf>> {
    write_repeated_token_files(dir, tokens_per_file, 1)
}

/// [`write_token_files`] with the training text written `repeat` times over: a corpus of any
/// size, for measuring what a larger corpus costs.
pub fn write_repeated_token_files(
    dir: &Path,
    tokens_per_file: usize,
    repeat: usize,
) -> anyhow::Result<Vec<PathBuf>> {
    let (train, validation) = train_validation_split()?;
    let per_file = tokens_per_file.max(2);
    let mut written = Vec::new();
    for (split, text, times) in [("train", &train, repeat.max(1)), ("val", &validation, 1)] {
        let tokens = text
            .iter()
            .map(|&b| u32::from(b))
            .cycle()
            .take(text.len() * times);
        let mut file: Option<TokenShardWriter> = None;
        let mut chunk = Vec::with_capacity(1 << 16);
        for token in tokens {
            chunk.push(token);
            if chunk.len() == chunk.capacity() {
                write_chunk(dir, split, per_file, &mut file, &mut written, &mut chunk)?;
            }
        }
        write_chunk(dir, split, per_file, &mut file, &mut written, &mut chunk)?;
        if let Some(file) = file.take() {
            written.push(file.finish()?);
        }
    }
    Ok(written)
}

/// Appends `chunk` to the split's files, starting a new file whenever one is full.
fn write_chunk(
    dir: &Path,
    split: &str,
    per_file: usize,
    file: &mut Option<TokenShardWriter>,
    written: &mut Vec<PathBuf>,
    chunk: &mut Vec<u32>,
) -> anyhow::Result<()> {
    let mut rest: &[u32] = chunk;
    while !rest.is_empty() {
        if file
            .as_ref()
            .is_some_and(|f| f.tokens() as usize >= per_file)
            && let Some(full) = file.take()
        {
            written.push(full.finish()?);
        }
        if file.is_none() {
            let index = written.iter().filter(|p| is_split(p, split)).count();
            let path = dir.join(format!("{split}_{index:06}.bin"));
            *file = Some(TokenShardWriter::create(&path, TokenType::U16)?);
        }
        let Some(current) = file.as_mut() else {
            continue;
        };
        let room = per_file - current.tokens() as usize;
        let (now, later) = rest.split_at(room.min(rest.len()));
        current.write(now)?;
        rest = later;
    }
    chunk.clear();
    Ok(())
}

/// Whether `path` is one of `split`'s files.
fn is_split(path: &Path, split: &str) -> bool {
    path.file_name()
        .and_then(|n| n.to_str())
        .is_some_and(|n| n.starts_with(&format!("{split}_")))
}

/// Token windows of byte tokens (ids below 256) as the byte windows [`TextBatcher`] takes,
/// the first `limit` of them at most.
#[derive(Debug, Clone)]
pub struct ByteWindows {
    windows: TokenWindows,
    len: usize,
}

impl ByteWindows {
    /// The windows of `context` inputs of the files of `dir` named `prefix*` (`train`, `val`).
    pub fn open(
        dir: &Path,
        prefix: &str,
        context: usize,
        limit: Option<usize>,
    ) -> anyhow::Result<Self> {
        let windows = TokenShards::open_prefixed(dir, prefix)?.windows(context);
        let len = limit.map_or(windows.len(), |l| l.min(windows.len()));
        Ok(Self { windows, len })
    }
}

impl Dataset<Vec<u8>> for ByteWindows {
    fn get(&self, index: usize) -> Result<Vec<u8>, DatasetError> {
        assert!(index < self.len, "window {index} of {}", self.len);
        self.windows
            .get(index)?
            .into_iter()
            .map(|token| {
                u8::try_from(token).map_err(|_| {
                    DatasetError::new(std::io::Error::other(format!(
                        "token {token} in window {index} is not a byte: this model reads byte \
                         tokens (write the files with --example prepare_data)"
                    )))
                })
            })
            .collect()
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// How [`write_text_rows`] stores its rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RowFormat {
    /// Parquet files, snappy-compressed, one row group per `rows_per_group` rows.
    Parquet,
    /// Arrow IPC files (file format), one record batch per `rows_per_group` rows.
    Arrow,
}

impl RowFormat {
    /// The files' extension.
    pub fn extension(self) -> &'static str {
        match self {
            Self::Parquet => "parquet",
            Self::Arrow => "arrow",
        }
    }
}

/// Writes the fixed split as row files in `dir` (which must exist), the Hugging Face hub's way:
/// `train-00000-of-0000n.parquet` (or `.arrow`), ... then `validation-...`, one `text` column
/// whose rows are the windows of `row_bytes` bytes every `row_bytes - 1` bytes (overlapping by
/// one, as [`TextWindows`] with context `row_bytes - 1`), `rows_per_file` rows per file in row
/// groups (record batches) of `rows_per_group`. Returns the files written. Never replaces a
/// file.
pub fn write_text_rows(
    dir: &Path,
    format: RowFormat,
    row_bytes: usize,
    (rows_per_file, rows_per_group): (usize, usize),
) -> anyhow::Result<Vec<PathBuf>> {
    let (train, validation) = train_validation_split()?;
    let schema = Arc::new(Schema::new(vec![Field::new("text", DataType::Utf8, false)]));
    let properties = WriterProperties::builder()
        .set_compression(Compression::SNAPPY)
        .set_max_row_group_row_count(Some(rows_per_group.max(1)))
        .build();
    let mut written = Vec::new();
    for (split, text) in [("train", &train), ("validation", &validation)] {
        let rows: Vec<&str> = TextWindows::new(Arc::clone(text), row_bytes.max(2) - 1, None)
            .starts()
            .map(|range| std::str::from_utf8(&text[range]))
            .collect::<Result<_, _>>()?;
        let files: Vec<&[&str]> = rows.chunks(rows_per_file.max(1)).collect();
        for (index, rows) in files.iter().enumerate() {
            let name = format!("{split}-{index:05}-of-{:05}", files.len());
            let path = dir.join(name).with_extension(format.extension());
            let file = std::fs::File::create_new(&path)
                .with_context(|| format!("creating {}", path.display()))?;
            let batch = |rows: &[&str]| {
                let column = Arc::new(StringArray::from(rows.to_vec()));
                RecordBatch::try_new(Arc::clone(&schema), vec![column])
            };
            match format {
                RowFormat::Parquet => {
                    let mut writer =
                        ArrowWriter::try_new(file, Arc::clone(&schema), Some(properties.clone()))?;
                    writer.write(&batch(rows)?)?;
                    writer.close()?;
                }
                RowFormat::Arrow => {
                    let mut writer = FileWriter::try_new(file, &schema)?;
                    for group in rows.chunks(rows_per_group.max(1)) {
                        writer.write(&batch(group)?)?;
                    }
                    writer.finish()?;
                }
            }
            written.push(path);
        }
    }
    Ok(written)
}

/// Rows of a Parquet or Arrow corpus's `text` column as the byte windows [`TextBatcher`]
/// takes: the first `context + 1` bytes of each row (rows must be that long), the first
/// `limit` rows at most. Parquet is read in pieces (its row groups): give
/// [`pieces`](Self::pieces) to the loader; Arrow files are memory-mapped and read at random.
#[derive(Clone)]
pub struct RowWindows {
    rows: Arc<dyn Dataset<ArrowRow>>,
    pieces: Option<Vec<usize>>,
    context: usize,
    len: usize,
}

impl RowWindows {
    /// The files of `dir` named `prefix*` (`train`, `validation`) in `format`.
    pub fn open(
        dir: &Path,
        prefix: &str,
        format: RowFormat,
        (context, limit): (usize, Option<usize>),
    ) -> anyhow::Result<Self> {
        let (rows, pieces): (Arc<dyn Dataset<ArrowRow>>, _) = match format {
            RowFormat::Parquet => {
                let rows = ParquetDataset::open_prefixed(dir, prefix)?.select(&["text"])?;
                let pieces = rows.pieces();
                (Arc::new(rows), Some(pieces))
            }
            RowFormat::Arrow => {
                let rows = ArrowDataset::open_prefixed(dir, prefix)?.select(&["text"])?;
                (Arc::new(rows), None)
            }
        };
        let len = limit.map_or(rows.len(), |l| l.min(rows.len()));
        Ok(Self {
            rows,
            pieces,
            context,
            len,
        })
    }

    /// Rows per row group, for the loader's `pieces` (Parquet; `None` for Arrow).
    pub fn pieces(&self) -> Option<Vec<usize>> {
        self.pieces.clone()
    }

    fn window(&self, row: &ArrowRow) -> Result<Vec<u8>, DatasetError> {
        let text = row.text("text")?.as_bytes();
        match text.get(..self.context + 1) {
            Some(window) => Ok(window.to_vec()),
            None => Err(DatasetError::new(std::io::Error::other(format!(
                "a row of {} holds {} bytes, fewer than the {} of a window (write rows at \
                 least --context + 1 bytes long)",
                row.path().display(),
                text.len(),
                self.context + 1
            )))),
        }
    }
}

impl Dataset<Vec<u8>> for RowWindows {
    fn get(&self, index: usize) -> Result<Vec<u8>, DatasetError> {
        assert!(index < self.len, "row {index} of {}", self.len);
        self.window(&self.rows.get(index)?)
    }

    fn len(&self) -> usize {
        self.len
    }
}

/// A batch of sequences: each target is the input shifted by one byte.
#[derive(Debug, Clone)]
pub struct TextBatch {
    /// `[batch, context]` bytes.
    pub inputs: Tensor<2, Int>,
    /// `[batch, context]` the byte after each input byte.
    pub targets: Tensor<2, Int>,
}

/// Turns windows into a [`TextBatch`].
#[derive(Debug, Clone, Copy, Default)]
pub struct TextBatcher;

impl Batcher<Vec<u8>, TextBatch> for TextBatcher {
    fn batch(&self, items: Vec<Vec<u8>>, device: &Device) -> TextBatch {
        let rows = items.len();
        let context = items.first().map_or(0, |w| w.len().saturating_sub(1));
        let mut inputs = Vec::with_capacity(rows * context);
        let mut targets = Vec::with_capacity(rows * context);
        for window in &items {
            inputs.extend(window[..context].iter().map(|&b| i64::from(b)));
            targets.extend(window[1..=context].iter().map(|&b| i64::from(b)));
        }
        TextBatch {
            inputs: Tensor::from_data(TensorData::new(inputs, [rows, context]), device),
            targets: Tensor::from_data(TensorData::new(targets, [rows, context]), device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_corpus_is_the_documented_text() {
        let text = load().unwrap();
        assert_eq!(text.len(), 4_850_382);
        assert!(text.iter().all(|b| b.is_ascii()));
        let (train, validation) = train_validation_split().unwrap();
        assert_eq!(train.len() + validation.len(), text.len());
        assert_eq!(train.len(), 4_365_343);
    }

    #[test]
    fn windows_overlap_by_one_byte_and_stop_inside_the_text() {
        let windows = TextWindows::new(Arc::new((0..=20).collect()), 4, None);
        assert_eq!(windows.len(), 5);
        assert_eq!(windows.get(0).unwrap(), [0, 1, 2, 3, 4]);
        assert_eq!(windows.get(4).unwrap(), [16, 17, 18, 19, 20]);
        assert_eq!(TextWindows::new(Arc::new(vec![0; 21]), 4, Some(2)).len(), 2);
    }

    #[test]
    fn parquet_and_arrow_files_of_the_text_give_back_its_windows() {
        let dir = tempfile::tempdir().unwrap();
        let (train, _) = train_validation_split().unwrap();
        let embedded = TextWindows::new(train, 128, None);
        for format in [RowFormat::Parquet, RowFormat::Arrow] {
            let files = write_text_rows(dir.path(), format, 129, (20_000, 4096)).unwrap();
            // 34,104 training windows in 2 files, 3,789 validation windows in 1.
            assert_eq!(files.len(), 3, "{files:?}");
            let from_files = RowWindows::open(dir.path(), "train", format, (128, None)).unwrap();
            assert_eq!(from_files.len(), embedded.len());
            if format == RowFormat::Parquet {
                let pieces = from_files.pieces().unwrap();
                assert_eq!(pieces.iter().sum::<usize>(), embedded.len());
                assert_eq!(pieces[..5], [4096, 4096, 4096, 4096, 3616]);
            }
            for i in [0, 1, 20_000, embedded.len() - 1] {
                assert_eq!(from_files.get(i).unwrap(), embedded.get(i).unwrap());
            }
        }
    }

    #[test]
    fn the_files_written_never_replace_a_users_file() {
        let dir = tempfile::tempdir().unwrap();
        let parquet = dir.path().join("train-00000-of-00001.parquet");
        let arrow = dir.path().join("train-00000-of-00001.arrow");
        let tokens = dir.path().join("train_000000.bin");
        for path in [&parquet, &arrow, &tokens] {
            std::fs::write(path, b"the user's").unwrap();
        }
        for format in [RowFormat::Parquet, RowFormat::Arrow] {
            assert!(write_text_rows(dir.path(), format, 129, (usize::MAX, 4096)).is_err());
        }
        assert!(write_token_files(dir.path(), usize::MAX).is_err());
        for path in [&parquet, &arrow, &tokens] {
            assert_eq!(std::fs::read(path).unwrap(), b"the user's");
        }
    }

    #[test]
    fn token_files_of_the_text_give_back_its_windows() {
        let dir = tempfile::tempdir().unwrap();
        let files = write_token_files(dir.path(), usize::MAX).unwrap();
        assert_eq!(files.len(), 2);
        let (train, _) = train_validation_split().unwrap();
        let from_files = ByteWindows::open(dir.path(), "train", 128, None).unwrap();
        let embedded = TextWindows::new(train, 128, None);
        assert_eq!(from_files.len(), embedded.len());
        for i in [0, 1, embedded.len() / 2, embedded.len() - 1] {
            assert_eq!(from_files.get(i).unwrap(), embedded.get(i).unwrap());
        }
    }
}
