//! The documents of a token corpus: the stretches of tokens between end-of-text tokens, found
//! once when the corpus is opened and read one positional read each.

use burn::data::dataset::{Dataset, DatasetError};

use super::{TokenShard, TokenShards};
use crate::DataError;

/// Tokens per read while the documents are found.
const SCAN_TOKENS: usize = 1 << 20;

/// A map-style data set of documents: item `i` is the tokens of one document, a stretch of
/// tokens between two end-of-text tokens (or a file's start or end: documents never cross
/// files). The delimiters belong to no item (llm.c puts one before each document, nanoGPT one
/// after: both read the same); an empty stretch gives no item; a document longer than
/// `max_tokens` gives several items of at most `max_tokens` tokens, in order, so no token is
/// lost.
///
/// Opening reads every file once, a mebi-token at a time, to find the documents. Memory: 12
/// bytes per item (where it starts and how long it is; 60 MB for 5 M documents, a 10 GB corpus
/// of 1,000-token documents in 16 bits), and one item per read.
///
/// ```
/// use accelerate_data::{TokenShardWriter, TokenShards, TokenType};
/// use burn::data::dataset::Dataset;
///
/// let dir = tempfile::tempdir()?;
/// let mut shard = TokenShardWriter::create(dir.path().join("train_0.bin"), TokenType::U16)?;
/// // GPT-2's end-of-text token (50256) before each document, as llm.c writes it.
/// shard.write(&[50256, 10, 11, 12, 50256, 20, 50256, 30, 31, 32, 33, 34])?;
/// shard.finish()?;
///
/// let documents = TokenShards::open(dir.path())?.documents(50256, 4)?;
/// assert_eq!(documents.len(), 4);
/// assert_eq!(documents.get(0).unwrap(), [10, 11, 12]);
/// assert_eq!(documents.get(2).unwrap(), [30, 31, 32, 33]); // cut at 4 tokens
/// assert_eq!(documents.get(3).unwrap(), [34]);
/// # Ok::<(), Box<dyn std::error::Error>>(())
/// ```
#[derive(Debug, Clone)]
pub struct TokenDocuments {
    corpus: TokenShards,
    /// Items before each file, and in all (one more entry than files).
    file_items: Vec<usize>,
    /// Each item's first token, within its file.
    starts: Vec<u64>,
    /// Each item's tokens.
    lens: Vec<u32>,
}

impl TokenDocuments {
    /// The documents of `corpus` delimited by `end_of_text`, cut into items of at most
    /// `max_tokens` tokens (at least 1; `usize::MAX`: whole documents, up to 4 Gi tokens).
    pub fn new(
        corpus: TokenShards,
        end_of_text: u32,
        max_tokens: usize,
    ) -> Result<Self, DataError> {
        Self::scanned(corpus, end_of_text, max_tokens, SCAN_TOKENS)
    }

    /// [`new`](Self::new), reading `scan_tokens` tokens at a time.
    fn scanned(
        corpus: TokenShards,
        end_of_text: u32,
        max_tokens: usize,
        scan_tokens: usize,
    ) -> Result<Self, DataError> {
        let max = u64::try_from(max_tokens.clamp(1, u32::MAX as usize)).unwrap_or(1);
        let mut documents = Self {
            file_items: vec![0],
            starts: Vec::new(),
            lens: Vec::new(),
            corpus: corpus.clone(),
        };
        for shard in corpus.shards() {
            let mut document_start = 0u64;
            let mut first = 0u64;
            while first < shard.len() {
                let count = (shard.len() - first).min(scan_tokens.max(1) as u64);
                // `count` is at most `scan_tokens`, a usize.
                let tokens = shard.read(first, count as usize)?;
                for (at, _) in (first..).zip(&tokens).filter(|(_, t)| **t == end_of_text) {
                    documents.push(document_start..at, max);
                    document_start = at + 1;
                }
                first += count;
            }
            documents.push(document_start..shard.len(), max);
            documents.file_items.push(documents.starts.len());
        }
        Ok(documents)
    }

    /// Adds the items of the document `tokens` (of the file being read).
    fn push(&mut self, tokens: std::ops::Range<u64>, max: u64) {
        let mut at = tokens.start;
        while at < tokens.end {
            let len = (tokens.end - at).min(max);
            self.starts.push(at);
            // `max` fits in a u32.
            self.lens.push(len as u32);
            at += len;
        }
    }

    /// Items per file, in order: a loader's `pieces`, so that each process reads its own
    /// files.
    pub fn pieces(&self) -> Vec<usize> {
        self.file_items.windows(2).map(|w| w[1] - w[0]).collect()
    }

    /// Tokens of item `index` (0 past the end).
    pub fn tokens_of(&self, index: usize) -> usize {
        self.lens.get(index).map_or(0, |&len| len as usize)
    }

    /// The file of item `index`.
    fn shard_of(&self, index: usize) -> Option<&TokenShard> {
        self.corpus
            .shards()
            .get(super::file_of(&self.file_items, index)?)
    }
}

impl Dataset<Vec<u32>> for TokenDocuments {
    /// Panics when `index >= len()`, as Burn's data sets do.
    fn get(&self, index: usize) -> Result<Vec<u32>, DatasetError> {
        let (Some(shard), Some(&start)) = (self.shard_of(index), self.starts.get(index)) else {
            panic!("document {index} of {}", self.len());
        };
        Ok(shard.read(start, self.tokens_of(index))?)
    }

    fn len(&self) -> usize {
        self.starts.len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::TokenType;
    use crate::tokens::tests::shard;

    #[test]
    fn documents_are_the_stretches_between_delimiters_in_any_read_size() {
        let dir = tempfile::tempdir().unwrap();
        const EOT: u32 = 7;
        let files = [
            shard(
                dir.path(),
                "a_0.bin",
                &[1, 2, EOT, EOT, 3, EOT, 4, 4, 4, 4, 4],
                TokenType::U16,
            ),
            shard(dir.path(), "a_1.bin", &[EOT, 5, 6], TokenType::U32),
            shard(dir.path(), "a_2.bin", &[EOT], TokenType::U16),
            shard(dir.path(), "a_3.bin", &[8, 9], TokenType::U16),
        ];
        let corpus = TokenShards::from_files(files, TokenType::U16).unwrap();
        let expected: [&[u32]; 6] = [&[1, 2], &[3], &[4, 4, 4], &[4, 4], &[5, 6], &[8, 9]];
        for scan in [1, 2, 3, 1000] {
            let documents = TokenDocuments::scanned(corpus.clone(), EOT, 3, scan).unwrap();
            let items: Vec<Vec<u32>> = (0..documents.len())
                .map(|i| documents.get(i).unwrap())
                .collect();
            assert_eq!(items, expected, "reading {scan} tokens at a time");
            assert_eq!(documents.pieces(), [4, 1, 0, 1]);
        }
        let whole = corpus.documents(EOT, usize::MAX).unwrap();
        assert_eq!(whole.get(2).unwrap(), [4, 4, 4, 4, 4]);
        assert_eq!(whole.tokens_of(2), 5);
    }
}
