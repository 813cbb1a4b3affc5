//! Writing token files in llm.c's format (a 1 KiB header, then the tokens), which llm.c,
//! nanoGPT's forks and [`TokenShards`](super::TokenShards) read.

use std::fs::File;
use std::io::{BufWriter, Seek, SeekFrom, Write};
use std::path::{Path, PathBuf};

use super::TokenType;
use crate::DataError;

/// Writes one llm.c `.bin` file: 16-bit tokens (header version 1) or 32-bit (version 7).
/// Creates the file new (never replaces one) and writes the header's token count at
/// [`finish`](Self::finish).
#[derive(Debug)]
pub struct TokenShardWriter {
    path: PathBuf,
    file: BufWriter<File>,
    ty: TokenType,
    tokens: u64,
}

impl TokenShardWriter {
    /// Creates `path` for tokens of `ty` ([`TokenType::U16`] or [`TokenType::U32`]).
    pub fn create(path: impl AsRef<Path>, ty: TokenType) -> Result<Self, DataError> {
        let path = path.as_ref().to_path_buf();
        if !matches!(ty, TokenType::U16 | TokenType::U32) {
            return Err(DataError::TokenFormat {
                path,
                reason: format!("llm.c's format holds 16- or 32-bit tokens, not {ty:?}"),
            });
        }
        let file = File::create_new(&path).map_err(|e| match e.kind() {
            std::io::ErrorKind::AlreadyExists => DataError::Exists { path: path.clone() },
            _ => DataError::io(&path, e),
        })?;
        let mut writer = Self {
            path,
            file: BufWriter::with_capacity(1 << 20, file),
            ty,
            tokens: 0,
        };
        writer.header()?;
        Ok(writer)
    }

    /// The 256 header words: magic, version, token count, zeros.
    fn header(&mut self) -> Result<(), DataError> {
        let (magic, version) = match self.ty {
            TokenType::U16 => (20240520i32, 1i32),
            _ => (20240801, 7),
        };
        let count = i32::try_from(self.tokens).map_err(|_| DataError::Content {
            path: self.path.clone(),
            reason: format!(
                "{} tokens: llm.c's header counts at most {} per file (write several files)",
                self.tokens,
                i32::MAX
            ),
        })?;
        let mut header = [0u8; 1024];
        for (i, word) in [magic, version, count].into_iter().enumerate() {
            header[i * 4..i * 4 + 4].copy_from_slice(&word.to_le_bytes());
        }
        self.file
            .write_all(&header)
            .map_err(|e| DataError::io(&self.path, e))
    }

    /// Appends `tokens`; a token wider than the file's type is an error.
    pub fn write(&mut self, tokens: &[u32]) -> Result<(), DataError> {
        for &token in tokens {
            let written = match self.ty {
                TokenType::U16 => u16::try_from(token)
                    .map(|t| self.file.write_all(&t.to_le_bytes()))
                    .ok(),
                _ => Some(self.file.write_all(&token.to_le_bytes())),
            };
            match written {
                Some(result) => result.map_err(|e| DataError::io(&self.path, e))?,
                None => {
                    return Err(DataError::Content {
                        path: self.path.clone(),
                        reason: format!("token {token} does not fit 16 bits (write a U32 file)"),
                    });
                }
            }
        }
        self.tokens += tokens.len() as u64;
        Ok(())
    }

    /// Tokens written so far.
    pub fn tokens(&self) -> u64 {
        self.tokens
    }

    /// Writes the header's token count and flushes the file to disk; returns its path.
    pub fn finish(mut self) -> Result<PathBuf, DataError> {
        self.file
            .seek(SeekFrom::Start(0))
            .map_err(|e| DataError::io(&self.path, e))?;
        self.header()?;
        let file = self
            .file
            .into_inner()
            .map_err(|e| DataError::io(&self.path, e.into_error()))?;
        file.sync_all().map_err(|e| DataError::io(&self.path, e))?;
        Ok(self.path)
    }
}
