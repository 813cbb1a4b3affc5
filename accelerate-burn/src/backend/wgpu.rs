//! Burn's wgpu backend (WGSL through naga): Vulkan, Metal or DX12 adapters, and Mesa's
//! software Vulkan (lavapipe) on machines without a GPU.

use std::sync::OnceLock;

use burn::tensor::Device;

use super::AcceleratorBackend;
use crate::error::AccelerateError;

/// Burn's `wgpu` backend on the default adapter.
#[derive(Debug, Clone, Copy, Default)]
pub struct Wgpu;

impl AcceleratorBackend for Wgpu {
    const NAME: &'static str = "wgpu";
    const DEVICE_KERNELS: bool = true;

    fn device(_local_rank: usize) -> Result<Device, AccelerateError> {
        // The lazy constructor panics on first use when no adapter exists; the options' `init`
        // reports it instead. It may run once per process, so its outcome is kept.
        static DEVICE: OnceLock<Result<Device, String>> = OnceLock::new();
        DEVICE
            .get_or_init(|| Device::wgpu_options().init().map_err(|e| e.to_string()))
            .clone()
            .map_err(|reason| AccelerateError::BackendUnavailable {
                backend: Self::NAME,
                reason,
                hint: "install a Vulkan driver (on Debian: mesa-vulkan-drivers libvulkan1), \
                       or build with `--features flex`",
            })
    }
}
