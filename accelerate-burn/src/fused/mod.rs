//! Fused optimizers over flat parameters, and ZeRO-1 and ZeRO-2.
//!
//! With a [`FusedOptimizer`] (or Burn's AdamW, Adam or SGD config given to `prepare`, when
//! the fused update computes the same thing; see [`crate::OptimizerSource`]), the optimizer
//! state of the trainable float parameters lives in flat buffers in module visit order (frozen
//! parameters are left out), built at prepare. The model's own f32 parameters are the master
//! copy: the update reads and writes them one parameter at a time, each moved out of the model
//! and back (a model with parameters in another dtype keeps an f32 copy in a flat buffer).
//! Several processes without ZeRO average a completed accumulation window's gradients in one
//! flat gradient buffer (in f32 or the half-precision wire); one process updates from the
//! gradients as backward returned them. Clipping only records a factor; the optimizer step is
//! one fused pass of `accelerate_kernels::optim` per parameter (gradient scale = fp16 unscale x
//! clip factor, moments and parameter in place).
//!
//! On wgpu and cuda (without ZeRO) the state lives on the GPU instead and the update is our
//! cubecl kernel, one launch per parameter tensor, writing each parameter's new values to a
//! tensor of its own, so nothing crosses to the host (the norm only when clipping or fp16 needs
//! it; with several processes, the gradients the collectives average).
//!
//! ZeRO-1 (`AcceleratorBuilder::zero_stage(1)`): each rank keeps its 1/N of the optimizer
//! state. A window's gradients are reduce-scattered into this rank's 1/N straight from
//! backward's tensors, a column of every shard at a time (no flat copy of them); each rank
//! updates its part of each parameter in the model's own tensor and broadcasts it into the
//! other ranks' (no master copy, no second copy of the parameters).
//!
//! ZeRO-2 (`zero_stage(2)`): the same buffers, but every micro-batch's gradients are
//! reduce-scattered at once into this rank's shard of the window's sum (so a window of k
//! micro-batches communicates k times, as DeepSpeed's ZeRO-2 does: the sum held as shards has
//! to leave each process before the next backward pass; ZeRO-1 keeps the whole local sum, as
//! Burn tensors, and communicates once). The model's own parameters stay whole on every rank
//! (Burn's forward pass needs them), and Burn's backward pass still returns every gradient at
//! once (Burn has no per-parameter hooks), so the peak of one backward pass holds one whole
//! gradient. ZeRO-2 runs on the host on every backend.
//!
//! This module holds the optimizer's description; the buffers and the update are the flat
//! gradient reducer's (`reducer::flat`), built by `prepare`.

mod config;
mod held;

pub use config::FusedOptimizer;
pub use held::HeldBytes;
