//! Burn's pure-Rust CPU backend, built with its `rayon` and `simd` features.

use burn::tensor::Device;

use super::AcceleratorBackend;
use crate::error::AccelerateError;

/// Burn's `flex` CPU backend (f32, f16, bf16). Every local rank uses the CPU.
#[derive(Debug, Clone, Copy, Default)]
pub struct Flex;

impl AcceleratorBackend for Flex {
    const NAME: &'static str = "flex";
    const SHARDED_UNITS: bool = true;

    fn device(_local_rank: usize) -> Result<Device, AccelerateError> {
        Ok(Device::flex())
    }
}
