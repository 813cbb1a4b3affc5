//! Tokenized corpora as files of token ids (llm.c / nanoGPT `.bin`, numpy `.npy`), served as
//! fixed-length windows or as documents between end-of-text tokens.
//!
//! A file is never read whole: a window is one positional read (`pread`) of its tokens, so a
//! process holds a few windows whatever the corpus size. Not a memory map on purpose: the pages
//! of a map count in the process's resident memory as they are touched (over an epoch, the
//! whole corpus) and in its address space (so `RLIMIT_AS` caps the corpus); the page cache
//! serves repeated reads either way.

mod documents;
mod format;
mod write;

use std::fs::File;
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use burn::data::dataset::{Dataset, DatasetError};

pub use documents::TokenDocuments;
pub use format::TokenType;
pub use write::TokenShardWriter;

use crate::DataError;
use format::{HEAD_BYTES, LayoutError};

/// One file of tokens, open for reading.
#[derive(Debug)]
pub struct TokenShard {
    path: PathBuf,
    file: File,
    start: u64,
    tokens: u64,
    ty: TokenType,
}

impl TokenShard {
    /// Opens `path`, reading its header; a file with no header we know is a raw array of
    /// `raw`.
    pub fn open(path: impl AsRef<Path>, raw: TokenType) -> Result<Self, DataError> {
        let path = path.as_ref().to_path_buf();
        let file = File::open(&path).map_err(|e| DataError::io(&path, e))?;
        let len = file.metadata().map_err(|e| DataError::io(&path, e))?.len();
        let mut head = vec![0u8; HEAD_BYTES.min(usize::try_from(len).unwrap_or(HEAD_BYTES))];
        file.read_exact_at(&mut head, 0)
            .map_err(|e| DataError::io(&path, e))?;
        let layout = format::layout(&head, len, raw).map_err(|e| match e {
            LayoutError::Format(reason) => DataError::TokenFormat {
                path: path.clone(),
                reason,
            },
            LayoutError::Truncated { expected, found } => DataError::Truncated {
                path: path.clone(),
                expected,
                found,
            },
        })?;
        Ok(Self {
            path,
            file,
            start: layout.start,
            tokens: layout.tokens,
            ty: layout.ty,
        })
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Tokens in the file.
    pub fn len(&self) -> u64 {
        self.tokens
    }

    /// True when the file holds no token.
    pub fn is_empty(&self) -> bool {
        self.tokens == 0
    }

    /// How its tokens are stored.
    pub fn token_type(&self) -> TokenType {
        self.ty
    }

    /// Tokens `first..first + count`, read from the file now.
    pub fn read(&self, first: u64, count: usize) -> Result<Vec<u32>, DataError> {
        let size = self.ty.size();
        let beyond = || DataError::Content {
            path: self.path.clone(),
            reason: format!(
                "tokens {first}..{first}+{count} are beyond its {} tokens",
                self.tokens
            ),
        };
        let end = first.checked_add(count as u64).ok_or_else(beyond)?;
        if end > self.tokens {
            return Err(beyond());
        }
        let mut bytes = vec![0u8; count.checked_mul(size).ok_or_else(beyond)?];
        // first * size <= tokens * size, which the layout checked against the file's length.
        self.file
            .read_exact_at(&mut bytes, self.start + first * size as u64)
            .map_err(|e| DataError::io(&self.path, e))?;
        bytes
            .chunks_exact(size)
            .enumerate()
            .map(|(i, token)| {
                self.ty.decode(token).ok_or_else(|| DataError::Content {
                    path: self.path.clone(),
                    reason: format!(
                        "token {} is negative or wider than 32 bits",
                        first + i as u64
                    ),
                })
            })
            .collect()
    }
}

/// The token files of a corpus, in order.
#[derive(Debug, Clone)]
pub struct TokenShards {
    shards: Arc<[TokenShard]>,
}

/// The file names [`TokenShards::open`] takes from a folder.
const TOKEN_EXTENSIONS: [&str; 2] = ["bin", "npy"];

impl TokenShards {
    /// A file, or every `.bin` and `.npy` file of a folder in name order (llm.c's
    /// `fineweb_train_000001.bin`, ...). Raw `.bin` files (nanoGPT's) hold 16-bit tokens; see
    /// [`open_with`](Self::open_with) for others.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, DataError> {
        Self::open_with(path, TokenType::U16)
    }

    /// [`open`](Self::open), reading files without a header as arrays of `raw`.
    pub fn open_with(path: impl AsRef<Path>, raw: TokenType) -> Result<Self, DataError> {
        let path = path.as_ref();
        let files = if path.is_dir() {
            token_files(path, "")?
        } else {
            vec![path.to_path_buf()]
        };
        Self::from_files(files, raw)
    }

    /// The files of `folder` whose names start with `prefix` (`"train"`, `"val"`), in name
    /// order.
    pub fn open_prefixed(folder: impl AsRef<Path>, prefix: &str) -> Result<Self, DataError> {
        Self::from_files(token_files(folder.as_ref(), prefix)?, TokenType::U16)
    }

    /// These files, in this order.
    pub fn from_files(
        files: impl IntoIterator<Item = PathBuf>,
        raw: TokenType,
    ) -> Result<Self, DataError> {
        let shards = files
            .into_iter()
            .map(|f| TokenShard::open(f, raw))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(Self {
            shards: shards.into(),
        })
    }

    /// The files.
    pub fn shards(&self) -> &[TokenShard] {
        &self.shards
    }

    /// Tokens in all files.
    pub fn tokens(&self) -> u64 {
        self.shards.iter().map(TokenShard::len).sum()
    }

    /// The corpus as windows of `context + 1` tokens (inputs and their next tokens), see
    /// [`TokenWindows`].
    pub fn windows(&self, context: usize) -> TokenWindows {
        TokenWindows::new(self.clone(), context)
    }

    /// The corpus as documents delimited by `end_of_text`, in items of at most `max_tokens`
    /// tokens, see [`TokenDocuments`] (reads every file once).
    pub fn documents(
        &self,
        end_of_text: u32,
        max_tokens: usize,
    ) -> Result<TokenDocuments, DataError> {
        TokenDocuments::new(self.clone(), end_of_text, max_tokens)
    }
}

/// The files of `folder` with a token extension whose names start with `prefix`, sorted.
fn token_files(folder: &Path, prefix: &str) -> Result<Vec<PathBuf>, DataError> {
    let what = if prefix.is_empty() {
        "token files (*.bin, *.npy)"
    } else {
        "token files (*.bin, *.npy) with the prefix asked for"
    };
    crate::files::files_in(folder, prefix, &TOKEN_EXTENSIONS, what)
}

/// A map-style data set of windows: item `i` is `context + 1` consecutive tokens, windows
/// starting every `context` tokens within a file (consecutive windows share one token, so every
/// token but a file's first is a target once per epoch) and never crossing files.
///
/// Memory: one offset per file. Give it to a `DataLoader` as any Burn data set: the sampler
/// shuffles, shards and resumes it exactly.
#[derive(Debug, Clone)]
pub struct TokenWindows {
    corpus: TokenShards,
    context: usize,
    /// Windows before each file, and in all (one more entry than files).
    starts: Vec<usize>,
}

impl TokenWindows {
    /// The windows of `corpus` with `context` inputs each (at least 1).
    pub fn new(corpus: TokenShards, context: usize) -> Self {
        let context = context.max(1);
        let mut starts = vec![0usize];
        let mut total = 0usize;
        for shard in corpus.shards() {
            let windows = shard.len().saturating_sub(1) / context as u64;
            total = total.saturating_add(usize::try_from(windows).unwrap_or(usize::MAX));
            starts.push(total);
        }
        Self {
            corpus,
            context,
            starts,
        }
    }

    /// Inputs per window (the window holds one token more).
    pub fn context(&self) -> usize {
        self.context
    }

    /// The window `index` as (file, first token).
    fn locate(&self, index: usize) -> Option<(&TokenShard, u64)> {
        let file = file_of(&self.starts, index)?;
        let shard = self.corpus.shards().get(file)?;
        let within = index.checked_sub(self.starts[file])?;
        (index < self.starts[file + 1]).then_some((shard, within as u64 * self.context as u64))
    }
}

/// The file holding item `index`, given the items before each file (`starts`, from 0): the
/// last file whose first item is at or before `index`.
fn file_of(starts: &[usize], index: usize) -> Option<usize> {
    starts.partition_point(|&s| s <= index).checked_sub(1)
}

impl Dataset<Vec<u32>> for TokenWindows {
    /// Panics when `index >= len()`, as Burn's data sets do.
    fn get(&self, index: usize) -> Result<Vec<u32>, DatasetError> {
        let Some((shard, first)) = self.locate(index) else {
            panic!("window {index} of {}", self.len());
        };
        Ok(shard.read(first, self.context + 1)?)
    }

    fn len(&self) -> usize {
        self.starts.last().copied().unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(super) fn shard(dir: &Path, name: &str, tokens: &[u32], ty: TokenType) -> PathBuf {
        let path = dir.join(name);
        let mut writer = TokenShardWriter::create(&path, ty).unwrap();
        writer.write(tokens).unwrap();
        writer.finish().unwrap();
        path
    }

    #[test]
    fn windows_overlap_by_one_token_and_never_cross_files() {
        let dir = tempfile::tempdir().unwrap();
        shard(
            dir.path(),
            "a.bin",
            &(0..10).collect::<Vec<_>>(),
            TokenType::U16,
        );
        shard(
            dir.path(),
            "b.bin",
            &(100..107).collect::<Vec<_>>(),
            TokenType::U32,
        );
        let windows = TokenShards::open(dir.path()).unwrap().windows(3);
        // a: 9 targets -> 3 windows; b: 6 targets -> 2 windows.
        assert_eq!(windows.len(), 5);
        assert_eq!(windows.get(0).unwrap(), [0, 1, 2, 3]);
        assert_eq!(windows.get(2).unwrap(), [6, 7, 8, 9]);
        assert_eq!(windows.get(3).unwrap(), [100, 101, 102, 103]);
        assert_eq!(windows.get(4).unwrap(), [103, 104, 105, 106]);
    }

    #[test]
    fn a_truncated_file_is_named_with_both_lengths() {
        let dir = tempfile::tempdir().unwrap();
        let path = shard(dir.path(), "cut.bin", &[1, 2, 3, 4], TokenType::U16);
        let file = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
        file.set_len(1024 + 5).unwrap();
        let error = TokenShards::open(&path).unwrap_err();
        assert!(
            matches!(&error, DataError::Truncated { path: p, expected: 1032, found: 1029 } if p == &path),
            "{error}"
        );
        assert!(error.to_string().contains("cut.bin"), "{error}");
    }

    #[test]
    fn the_writer_never_replaces_a_file() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("mine.bin");
        std::fs::write(&path, b"the user's").unwrap();
        let error = TokenShardWriter::create(&path, TokenType::U16).unwrap_err();
        assert!(matches!(error, DataError::Exists { .. }), "{error}");
        assert_eq!(std::fs::read(&path).unwrap(), b"the user's");
    }

    #[test]
    fn an_empty_folder_says_what_it_looked_for() {
        let dir = tempfile::tempdir().unwrap();
        let error = TokenShards::open(dir.path()).unwrap_err();
        assert!(error.to_string().contains("*.npy"), "{error}");
    }
}
