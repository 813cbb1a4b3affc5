//! The UCI handwritten digits, as scikit-learn ships them, embedded in the binary.
//!
//! 1,797 images of 8x8 pixels with values 0..16. The split is fixed: every fifth image is a
//! test image (360), the rest train (1,437). Attribution and licence: `data/README.md`.

use std::io::Read;

use accelerate_burn::{Autocast, burn};
use anyhow::{Context, bail};
use burn::data::dataloader::batcher::Batcher;
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

/// Pixels per image.
pub const PIXELS: usize = 64;
/// Digit classes.
pub const CLASSES: usize = 10;

const CSV_GZ: &[u8] = include_bytes!("../data/digits.csv.gz");

/// One image and its label.
#[derive(Debug, Clone, PartialEq)]
pub struct Digit {
    /// Pixel values 0..16, row by row.
    pub pixels: [f32; PIXELS],
    /// The digit, 0..9.
    pub label: u8,
}

/// A batch: images scaled to 0..1 and their labels.
#[derive(Debug, Clone)]
pub struct DigitBatch {
    /// `[batch, 64]` pixel values in 0..1.
    pub images: Tensor<2>,
    /// `[batch]` labels.
    pub targets: Tensor<1, Int>,
}

/// Under mixed precision the images follow the compute dtype (the labels are integers).
impl Autocast for DigitBatch {
    fn autocast(self, dtype: DType) -> Self {
        Self {
            images: self.images.autocast(dtype),
            targets: self.targets,
        }
    }
}

/// All 1,797 digits, in the file's order.
pub fn load() -> anyhow::Result<Vec<Digit>> {
    let mut csv = String::new();
    flate2::read::GzDecoder::new(CSV_GZ)
        .read_to_string(&mut csv)
        .context("decompressing the embedded digits.csv.gz")?;
    csv.lines()
        .enumerate()
        .map(|(i, line)| parse_line(line).with_context(|| format!("digits.csv line {}", i + 1)))
        .collect()
}

fn parse_line(line: &str) -> anyhow::Result<Digit> {
    let values = line
        .split(',')
        .map(|v| v.trim().parse::<f32>())
        .collect::<Result<Vec<_>, _>>()?;
    if values.len() != PIXELS + 1 {
        bail!("expected {} values, found {}", PIXELS + 1, values.len());
    }
    let label = values[PIXELS];
    if !(0.0..CLASSES as f32).contains(&label) {
        bail!("label {label} is not a digit");
    }
    let mut pixels = [0.0; PIXELS];
    pixels.copy_from_slice(&values[..PIXELS]);
    Ok(Digit {
        pixels,
        label: label as u8,
    })
}

/// The fixed split: (train, test), every fifth image (from the first) a test image.
pub fn train_test_split() -> anyhow::Result<(Vec<Digit>, Vec<Digit>)> {
    let (test, train): (Vec<_>, Vec<_>) = load()?
        .into_iter()
        .enumerate()
        .partition(|(i, _)| i % 5 == 0);
    let strip = |v: Vec<(usize, Digit)>| v.into_iter().map(|(_, d)| d).collect();
    Ok((strip(train), strip(test)))
}

/// Turns digits into a [`DigitBatch`].
#[derive(Debug, Clone, Copy, Default)]
pub struct DigitBatcher;

impl Batcher<Digit, DigitBatch> for DigitBatcher {
    fn batch(&self, items: Vec<Digit>, device: &Device) -> DigitBatch {
        let n = items.len();
        let pixels: Vec<f32> = items
            .iter()
            .flat_map(|d| d.pixels.iter().map(|p| p / 16.0))
            .collect();
        let labels: Vec<i64> = items.iter().map(|d| i64::from(d.label)).collect();
        DigitBatch {
            images: Tensor::from_data(TensorData::new(pixels, [n, PIXELS]), device),
            targets: Tensor::from_data(TensorData::new(labels, [n]), device),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_embedded_data_set_is_complete() {
        let all = load().unwrap();
        assert_eq!(all.len(), 1797);
        let mut per_class = [0; CLASSES];
        for d in &all {
            per_class[d.label as usize] += 1;
            assert!(d.pixels.iter().all(|&p| (0.0..=16.0).contains(&p)));
        }
        assert!(
            per_class.iter().all(|&n| (170..190).contains(&n)),
            "{per_class:?}"
        );
    }
}
