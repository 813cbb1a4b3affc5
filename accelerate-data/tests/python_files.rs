//! Files written by the programs people prepare data with (numpy, nanoGPT's and llm.c's
//! scripts, pyarrow, Hugging Face `datasets`: `write_files.py`), read back sample by sample;
//! and the same files damaged: an error naming the file, never a panic.

#[path = "../../tests-support/tools.rs"]
mod tools;

use std::path::{Path, PathBuf};
use std::process::Command;

use accelerate_data::{ArrowDataset, ArrowRow, DataError, ParquetDataset, TokenShards, TokenType};
use burn::data::dataset::Dataset;

/// The files of `write_files.py`, written once per test binary.
fn python_files() -> Option<&'static Path> {
    static FILES: std::sync::OnceLock<Option<tempfile::TempDir>> = std::sync::OnceLock::new();
    FILES
        .get_or_init(|| {
            // One import for both: `datasets` brings pyarrow and numpy.
            let python = tools::python_with("datasets")?;
            let dir = tempfile::tempdir().unwrap();
            let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/write_files.py");
            tools::output_of(
                Command::new(python).arg(script).arg(dir.path()),
                "write_files.py",
            );
            Some(dir)
        })
        .as_ref()
        .map(tempfile::TempDir::path)
}

/// What `write_files.py` puts in row `i` of its tables.
fn expected_row(i: usize) -> (String, i64, Vec<i64>) {
    (
        format!("row {i} ").repeat(i % 7),
        (i % 5) as i64,
        (i as i64..(i + i % 9) as i64).collect(),
    )
}

#[test]
fn token_files_of_numpy_nanogpt_and_llmc_give_back_their_tokens() {
    let Some(dir) = python_files() else { return };
    let cases: [(&str, TokenType, u32); 5] = [
        ("u16.npy", TokenType::U16, 1),
        ("u32.npy", TokenType::U32, 70_000),
        ("i64.npy", TokenType::I64, 1),
        ("nanogpt.bin", TokenType::U16, 1),
        ("llmc.bin", TokenType::U16, 1),
    ];
    for (name, ty, step) in cases {
        let corpus = TokenShards::open(dir.join(name)).unwrap();
        assert_eq!(corpus.tokens(), 1000, "{name}");
        assert_eq!(corpus.shards()[0].token_type(), ty, "{name}");
        let windows = corpus.windows(100);
        // 999 targets: 9 windows of 100.
        assert_eq!(windows.len(), 9, "{name}");
        for w in 0..windows.len() {
            let expected: Vec<u32> = (w * 100..=w * 100 + 100).map(|t| t as u32 * step).collect();
            assert_eq!(windows.get(w).unwrap(), expected, "{name} window {w}");
        }
    }
}

/// llm.c's documents (an end-of-text token before each) come back one by one, and cut in
/// items of at most 4 tokens, every token once.
#[test]
fn documents_of_an_llmc_file_give_back_each_document() {
    let Some(dir) = python_files() else { return };
    let corpus = TokenShards::open(dir.join("llmc_documents.bin")).unwrap();
    let documents = corpus.documents(50256, usize::MAX).unwrap();
    assert_eq!(documents.len(), 20);
    for d in 0..20u32 {
        let expected: Vec<u32> = (10 * d..=10 * d + d).collect();
        assert_eq!(documents.get(d as usize).unwrap(), expected, "document {d}");
    }
    let cut = corpus.documents(50256, 4).unwrap();
    let tokens: Vec<u32> = (0..cut.len()).flat_map(|i| cut.get(i).unwrap()).collect();
    let whole: Vec<u32> = (0..20).flat_map(|d| documents.get(d).unwrap()).collect();
    assert_eq!(tokens, whole);
    assert!((0..cut.len()).all(|i| cut.tokens_of(i) <= 4));
    assert_eq!(
        cut.len(),
        (0..20).map(|d: usize| (d + 1).div_ceil(4)).sum::<usize>()
    );
}

/// Every row of `data` is the row `write_files.py` wrote.
fn assert_rows(data: &impl Dataset<ArrowRow>, rows: usize, what: &str) {
    assert_eq!(data.len(), rows, "{what}");
    for i in 0..rows {
        let row = data.get(i).unwrap();
        let (text, label, ids) = expected_row(i);
        assert_eq!(row.text("text").unwrap(), text, "{what} row {i}");
        assert_eq!(row.int("label").unwrap(), label, "{what} row {i}");
        assert_eq!(row.ints("input_ids").unwrap(), ids, "{what} row {i}");
    }
}

#[test]
fn arrow_files_and_datasets_folders_give_back_every_row() {
    let Some(dir) = python_files() else { return };
    for file in ["file.arrow", "stream.arrow"] {
        assert_rows(&ArrowDataset::open(dir.join(file)).unwrap(), 2500, file);
    }
    // save_to_disk with three files, as int32 token ids and a class label.
    let hf = ArrowDataset::open(dir.join("hf")).unwrap();
    assert_eq!(hf.column_names(), ["text", "label", "input_ids"]);
    assert_rows(&hf, 2500, "save_to_disk folder");
    let train = ArrowDataset::open_split(dir.join("hf_dict"), "train").unwrap();
    assert_rows(&train, 2500, "DatasetDict train");
    assert_rows(
        &ArrowDataset::open_split(dir.join("hf_dict"), "test").unwrap(),
        10,
        "DatasetDict test",
    );
    // Selected columns only.
    let text_only = hf.select(&["text"]).unwrap();
    assert_eq!(text_only.column_names(), ["text"]);
    assert!(text_only.get(3).unwrap().int("label").is_err());
}

#[test]
fn what_cannot_be_read_is_said_with_the_file_and_what_to_do() {
    let Some(dir) = python_files() else { return };
    let error = ArrowDataset::open(dir.join("hf_dict")).unwrap_err();
    assert!(error.to_string().contains("splits train, test"), "{error}");
    let error = ArrowDataset::open(dir.join("hf"))
        .unwrap()
        .select(&["text", "labels"])
        .unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(&error, DataError::MissingColumn { column, .. } if column == "labels"),
        "{message}"
    );
    assert!(message.contains("data-00000-of-00003.arrow"), "{message}");
    assert!(message.contains("text, label, input_ids"), "{message}");
    let row = ArrowDataset::open(dir.join("file.arrow"))
        .unwrap()
        .get(0)
        .unwrap();
    let error = row.ints("text").unwrap_err();
    assert!(
        error.to_string().contains("not a list of integers"),
        "{error}"
    );
}

/// A copy of `name` with `damage` done to its bytes.
fn damaged(
    dir: &Path,
    name: &str,
    damage: impl FnOnce(&mut Vec<u8>),
) -> (tempfile::TempDir, PathBuf) {
    let mut bytes = std::fs::read(dir.join(name)).unwrap();
    damage(&mut bytes);
    let tmp = tempfile::tempdir().unwrap();
    let path = tmp.path().join(Path::new(name).file_name().unwrap());
    std::fs::write(&path, bytes).unwrap();
    (tmp, path)
}

#[test]
fn a_truncated_or_corrupt_arrow_file_is_an_error_naming_it() {
    let Some(dir) = python_files() else { return };
    // The footer's length field pointing before the file's start.
    let (_tmp, path) = damaged(dir, "file.arrow", |b| {
        let at = b.len() - 10;
        b[at..at + 4].copy_from_slice(&i32::MAX.to_le_bytes());
    });
    let error = ArrowDataset::open(&path).unwrap_err();
    assert!(matches!(error, DataError::Arrow { .. }), "{error}");
    assert!(error.to_string().contains("file.arrow"), "{error}");
    // Cut short: the stream format in the middle of a record batch.
    let (_tmp, path) = damaged(dir, "stream.arrow", |b| b.truncate(b.len() * 2 / 3));
    let error = ArrowDataset::open(&path).unwrap_err();
    assert!(error.to_string().contains("stream.arrow"), "{error}");
}

/// Bytes flipped anywhere in the files: each open either fails with an error or gives rows
/// whose every value reads as a value or an error. (arrow-rs validates what it decodes; we
/// check what we slice.)
#[test]
fn damaged_arrow_files_never_panic() {
    let Some(dir) = python_files() else { return };
    let mut seed = 0x9e37_79b9_7f4a_7c15u64;
    let mut next = move || {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        seed
    };
    for name in ["file.arrow", "stream.arrow"] {
        let len = std::fs::metadata(dir.join(name)).unwrap().len() as usize;
        for _ in 0..150 {
            let flips: Vec<(usize, u8)> = (0..1 + next() % 4)
                .map(|_| ((next() % len as u64) as usize, next() as u8))
                .collect();
            let (_tmp, path) = damaged(dir, name, |b| {
                for &(at, byte) in &flips {
                    b[at] ^= byte | 1;
                }
            });
            if let Ok(data) = ArrowDataset::open(&path) {
                for i in 0..data.len() {
                    let row = data.get(i).unwrap();
                    let _ = (row.text("text"), row.int("label"), row.ints("input_ids"));
                }
            }
        }
    }
}

#[test]
fn truncated_token_files_name_the_file_and_both_lengths() {
    let Some(dir) = python_files() else { return };
    for name in ["llmc.bin", "u16.npy"] {
        let (_tmp, path) = damaged(dir, name, |b| b.truncate(b.len() - 3));
        let error = TokenShards::open(&path).unwrap_err();
        assert!(
            matches!(error, DataError::Truncated { .. }),
            "{name}: {error}"
        );
        assert!(error.to_string().contains(name), "{error}");
    }
}

#[test]
fn parquet_files_of_pyarrow_and_datasets_give_back_every_row_by_row_group() {
    let Some(dir) = python_files() else { return };
    let hub = ParquetDataset::open_prefixed(dir.join("hub/data"), "train").unwrap();
    assert_eq!(
        hub.pieces(),
        [300, 300, 300, 300, 100, 300, 300, 300, 300],
        "two files of row groups of 300"
    );
    assert_rows(&hub, 2500, "hub layout (snappy, zstd)");
    // Read backwards: every row group decoded again after the cache let it go.
    let small_cache = ParquetDataset::open(dir.join("hub/data"))
        .unwrap()
        .cache_row_groups(1);
    for i in (0..2500).rev().step_by(7) {
        assert_eq!(
            small_cache.get(i).unwrap().int("label").unwrap(),
            (i % 5) as i64
        );
    }
    assert_rows(
        &ParquetDataset::open(dir.join("hf.parquet")).unwrap(),
        2500,
        "to_parquet",
    );
    let text = hub.select(&["text"]).unwrap();
    assert_eq!(
        text.get(2499).unwrap().text("text").unwrap(),
        expected_row(2499).0
    );
    assert!(text.get(0).unwrap().int("label").is_err());
}

#[test]
fn a_parquet_file_without_the_column_or_cut_short_is_an_error_naming_it() {
    let Some(dir) = python_files() else { return };
    let error = ParquetDataset::open(dir.join("hf.parquet"))
        .unwrap()
        .select(&["content"])
        .unwrap_err();
    let message = error.to_string();
    assert!(
        matches!(error, DataError::MissingColumn { .. }),
        "{message}"
    );
    assert!(
        message.contains("hf.parquet") && message.contains("text, label, input_ids"),
        "{message}"
    );
    let name = "hub/data/train-00001-of-00002.parquet";
    let (_tmp, path) = damaged(dir, name, |b| b.truncate(b.len() - 100));
    let error = ParquetDataset::open(&path).unwrap_err();
    assert!(matches!(error, DataError::Parquet { .. }), "{error}");
    assert!(
        error.to_string().contains("train-00001-of-00002.parquet"),
        "{error}"
    );
}

/// Bytes flipped in the pages of a Parquet file: each row reads as a value or an error
/// naming the file and row group, never a panic.
#[test]
fn damaged_parquet_files_never_panic() {
    let Some(dir) = python_files() else { return };
    let name = "hub/data/train-00000-of-00002.parquet";
    let len = std::fs::metadata(dir.join(name)).unwrap().len() as usize;
    let mut seed = 0x2545_f491_4f6c_dd1du64;
    for _ in 0..100 {
        seed ^= seed << 13;
        seed ^= seed >> 7;
        seed ^= seed << 17;
        let (at, byte) = ((seed % len as u64) as usize, (seed >> 32) as u8 | 1);
        let (_tmp, path) = damaged(dir, name, |b| b[at] ^= byte);
        if let Ok(data) = ParquetDataset::open(&path) {
            for i in (0..data.len()).step_by(50) {
                if let Ok(row) = data.row(i) {
                    let _ = (row.text("text"), row.int("label"), row.ints("input_ids"));
                }
            }
        }
    }
}
