//! One Burn training loop, written once, that runs on a laptop CPU, a GPU, or many processes:
//! the user keeps a plain Rust loop and an [`Accelerator`] adds device placement,
//! data-parallel gradient averaging across processes (started by `accelerate-rs launch`, torchrun,
//! SLURM or MPI), gradient accumulation, global gradient clipping and safe model saving.
//!
//! ```
//! use accelerate_burn::{Accelerator, DataLoader, DefaultBackend};
//! use burn::data::dataloader::batcher::Batcher;
//! use burn::data::dataset::InMemDataset;
//! use burn::nn::{Linear, LinearConfig};
//! use burn::optim::SgdConfig;
//! use burn::tensor::{Device, Tensor};
//!
//! #[derive(Clone)]
//! struct Pairs;
//! impl Batcher<[f32; 2], (Tensor<2>, Tensor<2>)> for Pairs {
//!     fn batch(&self, items: Vec<[f32; 2]>, device: &Device) -> (Tensor<2>, Tensor<2>) {
//!         let x: Vec<f32> = items.iter().map(|p| p[0]).collect();
//!         let y: Vec<f32> = items.iter().map(|p| p[1]).collect();
//!         let n = items.len();
//!         (
//!             Tensor::<1>::from_floats(x.as_slice(), device).reshape([n, 1]),
//!             Tensor::<1>::from_floats(y.as_slice(), device).reshape([n, 1]),
//!         )
//!     }
//! }
//!
//! // Learn y = 3x from 64 points.
//! let data: Vec<[f32; 2]> = (0..64).map(|i| [i as f32 / 64.0, 3.0 * i as f32 / 64.0]).collect();
//! let acc = Accelerator::<DefaultBackend>::from_env()?;
//! let model: Linear = LinearConfig::new(1, 1).init(&acc.device());
//! let loader = DataLoader::builder(Pairs).batch_size(16).shuffle(0).build(InMemDataset::new(data));
//! let (mut model, mut optim, train) = acc.prepare((model, SgdConfig::new(), loader))?;
//! for epoch in 0..200 {
//!     train.set_epoch(epoch);
//!     for batch in train.iter() {
//!         let (x, y) = batch?;
//!         let loss = (model.forward(x) - y).square().mean();
//!         let grads = acc.backward(loss, &model)?;
//!         model = optim.step(0.5, model, grads)?;
//!     }
//! }
//! let w: f32 = model.weight.val().into_scalar();
//! assert!((w - 3.0).abs() < 0.05, "learned weight {w}");
//! # Ok::<(), accelerate_burn::AccelerateError>(())
//! ```
//!
//! - [`Accelerator`]: the facade; [`AcceleratorBuilder`] for settings in code.
//! - [`backend`]: backend kinds by feature; [`DefaultBackend`] is the best one enabled.
//! - [`DataLoader`] / [`PreparedDataLoader`]: batches on the device, a reproducible order,
//!   each process's share of every round, built ahead on a background thread.
//! - Cross-process helpers on [`Accelerator`]: `gather`, `gather_for_metrics`, `reduce`,
//!   `pad_across_processes`, `wait_for_everyone`, `main_process_first`,
//!   `split_between_processes`, `set_trigger` / `check_trigger`.
//! - [`Gradients`]: what `backward` returns (not due, ready, held by a fused optimizer, or
//!   skipped), consumed by [`PreparedOptimizer::step`].
//! - [`PreparedOptimizer`] / [`PreparedScheduler`]: one step per accumulation window.
//! - [`metrics`]: evaluation metrics (mean loss, accuracy, perplexity, bits per byte) summed
//!   over batches and processes, without the samples `even_batches` repeated.
//! - [`selftest`]: the checks `accelerate-rs test` runs on every process.
//! - [`fused`]: fused AdamW / Adam / SGD over flat parameters, ZeRO-1 and ZeRO-2.
//! - [`Sharded`] / [`Unit`]: ZeRO-3, a model's units sharded over the processes
//!   ([`Accelerator::shard`]) and gathered for their forward pass; [`WholeUnit`]: a unit kept
//!   whole ([`Accelerator::unit`]) whose gradients are averaged while backward goes on.
//! - [`checkpoint`]: `save_state` / `load_state` with exact resume, atomic saves, rotation.
//! - `save_model` / `save_model_sharded` / `load_model` on [`Accelerator`]: the weights alone,
//!   one safetensors file or the Hugging Face hub's shards and index.
//! - [`nn`]: burn-nn modules (layer norm) with fused CPU kernels for training on Flex.
//! - `learner` (feature `train`): burn-train's `Learner` on the accelerator, through
//!   `AcceleratorStrategy`, a custom training strategy for `SupervisedTraining`.
//!
//! # Feature flags
//!
//! | feature | backend | notes |
//! |---|---|---|
//! | `flex` (default) | Burn's CPU backend | f32, f16, bf16; multi-threaded, SIMD |
//! | `ndarray` | Burn's ndarray backend | f32 |
//! | `wgpu` | Burn's wgpu backend | Vulkan / Metal / DX12; f16 where the adapter has it |
//! | `cuda` | Burn's CUDA backend | local rank `r` uses `cuda(r)` |
//! | `train` | (any) | burn-train's Learner on the accelerator (`learner`) |

// Deny rather than forbid: the `nccl` feature's device module (raw CUDA contexts, streams and
// device addresses handed to NCCL) is the one place allowed unsafe code.
#![deny(unsafe_code)]

mod accelerator;
pub mod backend;
mod buffers;
pub mod checkpoint;
#[cfg(feature = "flex")]
mod cpu_kernels;
mod data;
#[cfg(feature = "device-kernels")]
mod device_kernels;
mod error;
mod fault;
mod file_dtypes;
pub mod fused;
mod group;
#[cfg(feature = "train")]
pub mod learner;
mod loader_link;
pub mod metrics;
mod model_slot;
mod nccl;
pub mod nn;
mod optim;
mod overlap;
mod params;
mod phases;
mod precision;
mod prefetch;
mod reducer;
mod replicate;
pub mod selftest;
mod sharded;
mod stage_error;
pub mod stream;
mod training_loop;

pub use accelerator::{Accelerator, AcceleratorBuilder, MODEL_FILE};
pub use accelerator::{OptimizerSource, Prepare};
pub use backend::{AcceleratorBackend, DefaultBackend, enabled_backends};
pub use checkpoint::{Checkpoint, CheckpointInfo, CheckpointSnapshot, Restored};
pub use data::{BatchIter, DEFAULT_PREFETCH, DataLoader, DataLoaderBuilder, PreparedDataLoader};
pub use error::AccelerateError;
pub use fused::{FusedOptimizer, HeldBytes};
pub use optim::{PreparedOptimizer, PreparedScheduler};
pub use precision::{Autocast, Caster};
pub use reducer::{Gradients, GradientsStatus};
pub use sharded::{Sharded, Unit, WholeUnit};

pub use accelerate_core::comm::Reduction;
pub use accelerate_core::sampler::ShuffleOrder;
pub use accelerate_core::trace::StepWindow;
pub use accelerate_core::tracking::{GeneralTracker, RunInfo, RunStatus, TrackerError};
pub use accelerate_core::{
    AcceleratorConfig, MixedPrecision, NcclMode, ProcessState, ScalerConfig, Tracker,
};
/// The Burn this crate is built on, re-exported so users match its version.
pub use burn;

#[cfg(feature = "cuda-backend")]
pub use backend::Cuda;
#[cfg(feature = "flex")]
pub use backend::Flex;
#[cfg(feature = "ndarray")]
pub use backend::NdArray;
#[cfg(feature = "wgpu-backend")]
pub use backend::Wgpu;

/// The crate's README, whose examples run as doctests so that what crates.io shows compiles.
#[cfg(doctest)]
#[doc = include_str!("../README.md")]
pub struct ReadmeDoctests;
