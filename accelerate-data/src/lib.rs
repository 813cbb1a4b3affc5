//! Training data larger than memory, in the formats it lives in, for accelerate-rs and any Burn
//! training loop: tokenized corpora as token files (llm.c and nanoGPT `.bin`, numpy `.npy`)
//! served as fixed-length windows or as documents between end-of-text tokens, Arrow IPC files
//! and Hugging Face `datasets` folders (`save_to_disk`) served row by row, and Parquet files
//! (the Hugging Face hub's layout) read by row group. Each is a Burn map-style [`Dataset`], so
//! accelerate-burn's `DataLoader` shuffles it, splits it across processes and resumes it to the
//! sample exactly as it does an in-memory one; for Parquet, its `pieces` option makes each
//! process read its own row groups. A process holds a few samples, a few row groups and an
//! index of the files, never the corpus; with the loader's keyed shuffle order
//! (`ShuffleOrder::Keyed`) or its pieces, the loader's own memory does not grow with the corpus
//! either.
//!
//! ```
//! use accelerate_data::{TokenShardWriter, TokenShards, TokenType};
//! use burn::data::dataset::Dataset;
//!
//! let dir = tempfile::tempdir()?;
//! let mut shard = TokenShardWriter::create(dir.path().join("train_000000.bin"), TokenType::U16)?;
//! shard.write(&(0..1000).collect::<Vec<u32>>())?;
//! shard.finish()?;
//!
//! // Windows of 64 inputs and their next tokens: 999 targets make 15 windows.
//! let windows = TokenShards::open_prefixed(dir.path(), "train")?.windows(64);
//! assert_eq!(windows.len(), 15);
//! assert_eq!(windows.get(1)?[..3], [64, 65, 66]);
//! # Ok::<(), Box<dyn std::error::Error>>(())
//! ```
//!
//! [`Dataset`]: burn::data::dataset::Dataset

mod arrow;
mod error;
mod files;
mod row_groups;
mod tokens;

pub use arrow::{ArrowDataset, ArrowRow};
pub use error::DataError;
pub use row_groups::{DEFAULT_CACHED_ROW_GROUPS, ParquetDataset};
pub use tokens::{
    TokenDocuments, TokenShard, TokenShardWriter, TokenShards, TokenType, TokenWindows,
};

/// Burn, as this crate uses it (the [`Dataset`](burn::data::dataset::Dataset) trait).
pub use burn;
