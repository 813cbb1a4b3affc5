//! Backend kinds: which Burn backend a process trains on, chosen by cargo feature.
//!
//! | marker | feature | device of local rank `r` | float dtypes |
//! |---|---|---|---|
//! | `Cuda` | `cuda` | `cuda(r)` | f32, f16, bf16 |
//! | `Wgpu` | `wgpu` | the default adapter | f32; f16 where the adapter has it |
//! | `Flex` | `flex` (default) | the CPU | f32, f16, bf16 |
//! | `NdArray` | `ndarray` | the CPU | f32 |
//!
//! A marker that is not compiled in does not exist: `Accelerator::<Cuda>` without the `cuda`
//! feature is a compile error, not a run-time surprise. [`DefaultBackend`] is the best enabled
//! kind, in the order cuda, wgpu, flex, ndarray.

use burn::tensor::{DType, Device};

use crate::error::AccelerateError;

#[cfg(feature = "cuda-backend")]
mod cuda;
#[cfg(feature = "flex")]
mod flex;
pub mod fusion;
#[cfg(feature = "ndarray")]
mod ndarray;
#[cfg(feature = "wgpu-backend")]
mod wgpu;

#[cfg(feature = "cuda-backend")]
pub use cuda::Cuda;
#[cfg(feature = "flex")]
pub use flex::Flex;
#[cfg(feature = "ndarray")]
pub use ndarray::NdArray;
#[cfg(feature = "wgpu-backend")]
pub use wgpu::Wgpu;

/// A kind of Burn backend that an [`Accelerator`](crate::Accelerator) can train on.
pub trait AcceleratorBackend: 'static + Send + Sync {
    /// Short name, as printed by `accelerate-rs env` and in errors ("flex", "cuda", ...).
    const NAME: &'static str;

    /// True when the backend's tensors are cubecl buffers on which accelerate-rs runs its own
    /// device kernels (fp16 unscale-and-check, half-precision gradient packing) instead of
    /// Burn operations or host passes. Only the `wgpu` and `cuda` markers set it.
    const DEVICE_KERNELS: bool = false;

    /// True when [`Sharded`](crate::Sharded) units (ZeRO-3) can gather on this backend: its
    /// Burn backend has our gather operation (flex, ndarray, and cubecl's wgpu and cuda, with
    /// or without Burn's fusion).
    const SHARDED_UNITS: bool = false;

    /// The (non-autodiff) device of the process with local rank `local_rank`.
    fn device(local_rank: usize) -> Result<Device, AccelerateError>;

    /// The floating-point dtypes `device` can compute in, as Burn reports them.
    fn float_dtypes(device: &Device) -> Vec<DType> {
        [DType::F32, DType::F16, DType::BF16]
            .into_iter()
            .filter(|&dtype| device.supports_dtype(dtype))
            .collect()
    }
}

/// The best backend kind enabled in this build: cuda, then wgpu, then flex, then ndarray.
#[cfg(feature = "cuda-backend")]
pub type DefaultBackend = Cuda;
/// The best backend kind enabled in this build: cuda, then wgpu, then flex, then ndarray.
#[cfg(all(not(feature = "cuda-backend"), feature = "wgpu-backend"))]
pub type DefaultBackend = Wgpu;
/// The best backend kind enabled in this build: cuda, then wgpu, then flex, then ndarray.
#[cfg(all(
    not(feature = "cuda-backend"),
    not(feature = "wgpu-backend"),
    feature = "flex"
))]
pub type DefaultBackend = Flex;
/// The best backend kind enabled in this build: cuda, then wgpu, then flex, then ndarray.
#[cfg(all(
    not(feature = "cuda-backend"),
    not(feature = "wgpu-backend"),
    not(feature = "flex"),
    feature = "ndarray"
))]
pub type DefaultBackend = NdArray;

/// Names of the backend kinds compiled into this build, best first.
// Each push is behind its own feature, which `vec![...]` cannot express.
#[allow(clippy::vec_init_then_push)]
pub fn enabled_backends() -> Vec<&'static str> {
    let mut names = Vec::new();
    #[cfg(feature = "cuda-backend")]
    names.push(Cuda::NAME);
    #[cfg(feature = "wgpu-backend")]
    names.push(Wgpu::NAME);
    #[cfg(feature = "flex")]
    names.push(Flex::NAME);
    #[cfg(feature = "ndarray")]
    names.push(NdArray::NAME);
    names
}
