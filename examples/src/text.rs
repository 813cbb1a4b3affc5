//! Shakespeare's plays as bytes, embedded in the binary, for byte-level language modelling.
//!
//! 4,850,382 bytes of ASCII text; the first 90 % train, the rest validate. A sample is a
//! window of `context + 1` bytes starting at a multiple of `context` (windows overlap by one
//! byte, so every byte but the first is predicted once per epoch). Attribution and licence:
//! `data/README.md`.

use std::io::Read;
use std::sync::Arc;

use accelerate_burn::burn;
use anyhow::Context;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::{Dataset, DatasetError};
use burn::tensor::{Device, Int, Tensor, TensorData};

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
}
