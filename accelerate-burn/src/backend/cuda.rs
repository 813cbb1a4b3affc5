//! Burn's CUDA backend: local rank `r` trains on `cuda(r)`.

use burn::tensor::Device;

use super::AcceleratorBackend;
use crate::error::AccelerateError;

/// Burn's `cuda` backend. The device of local rank `r` is `cuda(r)`.
#[derive(Debug, Clone, Copy, Default)]
pub struct Cuda;

impl AcceleratorBackend for Cuda {
    const NAME: &'static str = "cuda";
    const DEVICE_KERNELS: bool = true;
    const SHARDED_UNITS: bool = true;

    fn device(local_rank: usize) -> Result<Device, AccelerateError> {
        // Burn's CUDA device is lazy and panics on first use without a driver; look for one
        // first so that a machine without a GPU gets an error instead of a panic.
        let driver = ["/proc/driver/nvidia/version", "/dev/nvidiactl", "/dev/dxg"]
            .iter()
            .any(|path| std::path::Path::new(path).exists());
        if !driver {
            return Err(AccelerateError::BackendUnavailable {
                backend: Self::NAME,
                reason: "no NVIDIA driver found (no /proc/driver/nvidia/version or /dev/nvidiactl)"
                    .into(),
                hint: "run on a machine with an NVIDIA GPU, or build with `--features flex`",
            });
        }
        Ok(Device::cuda(local_rank))
    }
}
