//! Models and data for the accelerate-rs examples, kept apart from the training scripts so that
//! each script shows only the training loop: the plain Burn loop plus the Accelerator lines.
//!
//! - [`digits`]: the UCI handwritten digits (8x8 images, 10 classes), shipped in `data/`.
//! - [`synthetic`]: generated 784-dimensional samples labelled by a fixed random linear teacher.
//! - [`text`]: Shakespeare's plays as bytes, shipped in `data/`, in windows for a language model.
//! - [`Mlp`]: the multi-layer perceptron the digits and synthetic scripts train.
//! - [`transformer`]: the decoder-only transformer language model of `transformer_lm`.
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
pub mod text;
pub mod transformer;

pub use mlp::{Mlp, MlpConfig, Prediction};
