//! Fused optimizers over flat parameters, and ZeRO-1 and ZeRO-2.
//!
//! With a [`FusedOptimizer`] (or Burn's AdamW, Adam or SGD config given to `prepare`, when
//! the fused update computes the same thing; see [`crate::OptimizerSource`]), the trainable float parameters of the model live, as the f32
//! master copy, in one flat buffer in module visit order (frozen parameters are left out),
//! beside one flat gradient buffer and flat optimizer state, all built at prepare. A completed
//! accumulation window copies the gradients into the flat buffer once (averaging them across
//! processes there, in f32 or the half-precision wire); clipping only records a factor; the
//! optimizer step is one fused pass of `accelerate_kernels::optim` (gradient scale = fp16
//! unscale x clip factor, moments and parameter in place, no allocation), and the model
//! receives its new values in one upload per parameter tensor.
//!
//! On wgpu and cuda (without ZeRO) the state lives on the GPU instead and the update is our
//! cubecl kernel, one launch per parameter tensor, writing each parameter's new values to a
//! tensor of its own, so nothing crosses to the host (the norm only when clipping or fp16 needs
//! it; with several processes, the gradients the collectives average).
//!
//! ZeRO-1 (`AcceleratorBuilder::zero_stage(1)`): gradients are reduce-scattered instead of
//! all-reduced, each rank updates its 1/N of the flat parameters with its 1/N of the optimizer
//! state, and the updated parameters are all-gathered.
//!
//! ZeRO-2 (`zero_stage(2)`): each rank also keeps only its 1/N of the gradients and of the
//! f32 master parameters. Every micro-batch's gradients are reduce-scattered at once into this
//! rank's shard of the window's sum (so a window of k micro-batches communicates k times,
//! as DeepSpeed's ZeRO-2 does: the sum held as shards has to leave each process before the
//! next backward pass; ZeRO-1 keeps the whole local sum and communicates once). The whole flat
//! gradient and the gathered parameters exist only inside the call that uses them. The model's
//! own parameters stay whole on every rank (Burn's forward pass needs them), and Burn's
//! backward pass still returns every gradient at once (Burn has no per-parameter hooks), so the
//! peak of one backward pass holds one whole gradient. ZeRO-2 runs on the host on every
//! backend.
//!
//! This module holds the optimizer's description; the buffers and the update are the flat
//! gradient reducer's (`reducer::flat`), built by `prepare`.

mod config;
mod held;

pub use config::FusedOptimizer;
pub use held::HeldBytes;
