//! Burn's ndarray CPU backend (deprecated in Burn 0.22 in favour of flex; kept for users who
//! still build on it).

use burn::tensor::Device;

use super::AcceleratorBackend;
use crate::error::AccelerateError;

/// Burn's `ndarray` CPU backend (f32 only for training). Every local rank uses the CPU.
#[derive(Debug, Clone, Copy, Default)]
pub struct NdArray;

impl AcceleratorBackend for NdArray {
    const NAME: &'static str = "ndarray";
    const SHARDED_UNITS: bool = true;

    #[allow(deprecated)]
    fn device(_local_rank: usize) -> Result<Device, AccelerateError> {
        Ok(Device::ndarray())
    }
}
