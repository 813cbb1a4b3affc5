//! Models and data for the accelerate-rs examples, kept apart from the training scripts so that
//! each script shows only the training loop: the plain Burn loop plus the Accelerator lines.
//!
//! - [`digits`]: the UCI handwritten digits (8x8 images, 10 classes), shipped in `data/`.
//! - [`synthetic`]: generated 784-dimensional samples labelled by a fixed random linear teacher.
//! - [`Mlp`]: the multi-layer perceptron both scripts train.
//!
//! ```
//! let (train, test) = accelerate_examples::digits::train_test_split()?;
//! assert_eq!((train.len(), test.len()), (1437, 360));
//! # Ok::<(), anyhow::Error>(())
//! ```

#![forbid(unsafe_code)]

pub mod digits;
mod mlp;
pub mod synthetic;

pub use mlp::{Mlp, MlpConfig, Prediction, correct};
