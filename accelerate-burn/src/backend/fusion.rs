//! Burn's kernel fusion and autotune on the GPU backends: whether this build has them, and the
//! run-time switch that takes the fusers out of a build that has them.
//!
//! Burn's fusion is a compile-time type (`Fusion<CubeBackend>` when `burn/fusion` is on), so
//! the switch cannot remove the fused stream; it removes Burn's built-in fusers from its
//! registry before the stream starts, and every operation then runs as its own kernel. Burn
//! seals that registry at the first operation on a fused device, so the switch must come
//! first: it is applied when an accelerator is built, before the device's first use.

use crate::error::AccelerateError;

/// Whether this build's GPU backend fuses kernels (our `fusion` feature, part of `wgpu` and
/// `cuda`). False in builds with only CPU backends.
pub const COMPILED: bool = cfg!(all(feature = "fusion", feature = "device-kernels"));

/// Whether this build's GPU backend autotunes its kernels (our `autotune` feature, part of
/// `wgpu` and `cuda`). False in builds with only CPU backends.
pub const AUTOTUNE: bool = cfg!(all(feature = "autotune", feature = "device-kernels"));

/// Applies the configured fusion choice for this process: `on` keeps Burn's fusers (the
/// default, nothing to do), off takes them out. The first choice holds for the process.
pub(crate) fn choose(on: bool, rank: usize) -> Result<(), AccelerateError> {
    imp::choose(on, rank)
}

/// Whether fusion runs in this process: compiled in, and not switched off.
pub fn active() -> bool {
    COMPILED && !imp::switched_off()
}

#[cfg(all(feature = "fusion", feature = "device-kernels"))]
mod imp {
    use std::sync::Mutex;

    use burn_cubecl::fusion::{BUILTIN_NAMES, RegistryError, remove};

    use crate::error::AccelerateError;

    /// Whether the fusers were taken out; `None` until an accelerator chose.
    static CHOSEN: Mutex<Option<bool>> = Mutex::new(None);

    pub(super) fn switched_off() -> bool {
        matches!(*lock(), Some(false))
    }

    pub(super) fn choose(on: bool, rank: usize) -> Result<(), AccelerateError> {
        let mut chosen = lock();
        match (*chosen, on) {
            (Some(before), _) if before == on => Ok(()),
            (Some(false), true) => Err(AccelerateError::Misuse {
                rank,
                what: "fusion on was asked after an earlier accelerator of this process \
                       turned it off"
                    .into(),
                hint: "choose fusion once per process (ACCELERATE_FUSION or .fusion(..))",
            }),
            (None, true) | (Some(true), true) => {
                *chosen = Some(true);
                Ok(())
            }
            (_, false) => {
                for name in BUILTIN_NAMES {
                    remove(name).map_err(|e| match e {
                        RegistryError::ServiceRunning => AccelerateError::Misuse {
                            rank,
                            what: "fusion off was asked after the first tensor operation on \
                                   the GPU, when Burn's fusers can no longer be removed"
                                .into(),
                            hint: "build the Accelerator before creating any tensor, or set \
                                   ACCELERATE_FUSION=false in the environment",
                        },
                        other => AccelerateError::Misuse {
                            rank,
                            what: format!("turning fusion off: {other}"),
                            hint: "build without fusion instead (feature `wgpu-backend` or \
                                   `cuda-backend`)",
                        },
                    })?;
                }
                *chosen = Some(false);
                Ok(())
            }
        }
    }

    fn lock() -> std::sync::MutexGuard<'static, Option<bool>> {
        CHOSEN
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }
}

/// `tensor`, computed outside the fusion stream (by NCCL, for one), as a fused tensor of
/// `client`'s, the way Burn's fusion registers uploaded data: later operations of the stream
/// read it as they would any other tensor.
#[cfg(all(feature = "fusion", feature = "device-kernels"))]
pub(crate) fn register(
    client: &burn::backend::fusion::Client<burn_cubecl::fusion::FusionCubeRuntime>,
    tensor: burn_cubecl::tensor::CubeTensor,
) -> burn::backend::fusion::FusionTensor<burn_cubecl::fusion::FusionCubeRuntime> {
    use burn::backend::fusion::NoOp;
    use burn::backend::fusion::custom::{OperationIr, OperationOutput};
    use burn::backend::fusion::stream::StreamId;
    use burn::backend::ir::{BackendIr, InitOperationIr};
    use burn_cubecl::CubeBackend;

    let shape = tensor.meta.shape().clone();
    let dtype = tensor.dtype;
    let handle = CubeBackend::float_tensor_handle(tensor);
    let init = InitOperationIr::create(shape, dtype, || client.register_tensor_handle(handle));
    client
        .register(
            StreamId::current(),
            OperationIr::Init(init),
            NoOp::<CubeBackend>::new(),
        )
        .output()
}

#[cfg(not(all(feature = "fusion", feature = "device-kernels")))]
mod imp {
    use crate::error::AccelerateError;

    pub(super) fn switched_off() -> bool {
        false
    }

    pub(super) fn choose(_on: bool, _rank: usize) -> Result<(), AccelerateError> {
        Ok(())
    }
}
