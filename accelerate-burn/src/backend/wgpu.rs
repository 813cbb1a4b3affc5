//! Burn's wgpu backend (WGSL through naga): Vulkan, Metal or DX12 adapters, and Mesa's
//! software Vulkan (lavapipe) on machines without a GPU.

use std::error::Error;
use std::sync::{Arc, OnceLock};

use burn::tensor::Device;

use super::AcceleratorBackend;
use crate::error::AccelerateError;

/// Burn's `wgpu` backend on the default adapter.
#[derive(Debug, Clone, Copy, Default)]
pub struct Wgpu;

impl AcceleratorBackend for Wgpu {
    const NAME: &'static str = "wgpu";
    const DEVICE_KERNELS: bool = true;
    const SHARDED_UNITS: bool = true;

    fn device(_local_rank: usize) -> Result<Device, AccelerateError> {
        // The lazy constructor panics on first use when no adapter exists; the options' `init`
        // reports it instead. It may run once per process, so its outcome is kept.
        // Burn's error is not `Clone`, so the kept outcome shares it.
        static DEVICE: OnceLock<Result<Device, Arc<dyn Error + Send + Sync>>> = OnceLock::new();
        DEVICE
            .get_or_init(|| {
                Device::wgpu_options()
                    .init()
                    .map_err(|e| Arc::new(e) as Arc<dyn Error + Send + Sync>)
            })
            .clone()
            .map_err(|e| AccelerateError::BackendUnavailable {
                backend: Self::NAME,
                reason: e.to_string(),
                hint: "install a Vulkan driver (on Debian: mesa-vulkan-drivers libvulkan1), \
                       or build with `--features flex`",
            })
    }
}
