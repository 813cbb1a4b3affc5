//! burn-train's Learner on the accelerator (feature `train`): a Burn user who trains with
//! `SupervisedTraining` / `Learner` gets processes, hosts, bf16 and global clipping by passing
//! [`AcceleratorStrategy`] as the custom training strategy and building the two loaders with
//! [`Accelerator::learner_loader`](crate::Accelerator::learner_loader) and
//! [`Accelerator::learner_eval_loader`](crate::Accelerator::learner_eval_loader).
//!
//! The strategy reuses the accelerator's reducers, sampler and process group; the Learner keeps
//! its optimizer, scheduler, metrics, renderer and checkpointer.

mod checkpoints;
mod loader;
mod outputs;
mod renderer;
mod strategy;

pub use checkpoints::{DurableCheckpointer, durable_checkpointers, latest_learner_checkpoint};
pub use loader::LearnerLoader;
pub use outputs::{GatherOutput, gather_loss};
pub use renderer::SilentRenderer;
pub use strategy::AcceleratorStrategy;
