//! The hot loops of accelerate-rs, over flat `f32` buffers, with no I/O and no Burn.
//!
//! Gradients, once gathered into one flat buffer, are reduced, measured and rescaled here.
//! Every loop is written in fixed-width lanes so that the compiler vectorises it on the target
//! (checked by the criterion benchmark `kernels`), and each has a plain scalar reference that the
//! tests compare against on odd lengths.
//!
//! - [`norm`]: sum of squares and global L2 norm, f32 lanes with f64 block totals.
//! - [`layer_norm`]: layer normalisation forward and backward, one parallel pass each,
//!   the same bits on any number of threads.
//! - [`bf16_matmul`]: products of bf16 and f16 matrices with f32 accumulation (`vdpbf16ps`,
//!   or AVX-512 or AVX2 FMAs on operands widened as they are packed, else the f32 product of
//!   widened operands); [`isa`] says which path runs.
//! - [`linear`]: a linear layer's product with its bias, and its three gradients, without the
//!   zero-fill and alignment copy around Burn's products.
//! - [`softmax`]: attention's scaled, masked softmax, forward and backward.
//! - [`attention`]: self-attention in (batch, head) tiles, flash-style: the probabilities
//!   recomputed in backward, never kept.
//! - [`cross_entropy`]: softmax cross-entropy against target classes, forward and backward.
//! - [`gelu`]: the exact GELU and its derivative with a vectorised `erfc`.
//! - [`rows`]: what the row-wise kernels share (shapes, fixed-lane sums, a vectorisable `exp`).
//! - [`scale`]: in-place scaling and the gradient-clipping coefficient.
//! - [`amp`]: the fused unscale-and-check pass of dynamic loss scaling.
//! - [`optim`]: fused, in-place AdamW / Adam / SGD updates (the formulas of Burn's optimizers).
//! - [`convert`]: branch-free f32 <-> f16/bf16 conversions that vectorise.
//! - [`cast`]: whole buffers converted between f32, bf16 and f16 in parallel.
//! - [`add`]: element-wise sums in any element type, rounded once, in parallel (residual
//!   connections in bf16/f16).
//! - [`element`]: the element types of the collectives and the reduction operators.
//! - [`reduce`]: element-wise sum, max and min for f32, f16 and bf16 (halves combined in f32).
//! - [`schedule`]: ring, recursive-doubling and binomial-tree schedules of the collectives.
//! - `cube` (feature `cubecl`): [`amp`] and [`convert`] as cubecl kernels, for gradients that
//!   live on a GPU.
//!
//! ```
//! use accelerate_kernels::{l2_norm, clip_coefficient, scale_in_place};
//!
//! let mut grads = vec![3.0_f32, 4.0];
//! let norm = l2_norm(&grads);
//! assert_eq!(norm, 5.0);
//! let coefficient = clip_coefficient(norm, 1.0);
//! scale_in_place(&mut grads, coefficient);
//! assert!((l2_norm(&grads) - 1.0).abs() < 1e-6);
//! ```

pub mod add;
pub mod amp;
pub mod attention;
pub mod bf16_matmul;
pub mod cast;
pub mod convert;
pub mod cross_entropy;
#[cfg(feature = "cubecl")]
// Kernel launches take raw buffer handles; each unsafe block states the lengths it relies on.
#[allow(unsafe_code)]
pub mod cube;
pub mod element;
mod fresh;
pub mod gelu;
pub mod isa;
pub mod layer_norm;
pub mod linear;
mod matmul;
pub mod norm;
pub mod optim;
pub mod reduce;
pub mod rows;
pub mod scale;
pub mod schedule;
pub mod softmax;
#[cfg(test)]
mod test_support;
#[cfg(target_arch = "x86_64")]
mod x86;

pub use norm::{l2_norm, sum_of_squares};
pub use reduce::{DType, Element, ReduceOp};
pub use scale::{clip_coefficient, scale_in_place};

/// Number of independent accumulators in the lane-blocked loops: wide enough for AVX-512 and
/// for two AVX2 registers, so the loop-carried dependency does not limit throughput.
pub(crate) const LANES: usize = 16;

/// The crate's README, whose examples run as doctests so that what crates.io shows compiles.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
