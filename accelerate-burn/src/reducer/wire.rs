//! Averaging gradients over the processes in the precision they travel in: f32, or bf16/fp16
//! (half the bytes; sums accumulate in f32 inside the collectives). Shared by every reducer
//! that averages on the host.

use accelerate_core::MixedPrecision;
use accelerate_core::comm::engine::even_counts;
use accelerate_core::comm::{ProcessGroup, Reduction, SharedBuffer};
use accelerate_kernels::convert;
use half::{bf16, f16};

use crate::error::AccelerateError;

/// How gradients travel, with the scratch buffers kept between steps (so a step allocates
/// nothing once they have grown to size).
pub(crate) struct Wire {
    /// The precision on the wire (`No`: f32).
    pub precision: MixedPrecision,
    f16: Vec<f16>,
    bf16: Vec<bf16>,
}

impl Wire {
    pub fn new(precision: MixedPrecision) -> Self {
        Self {
            precision,
            f16: Vec::new(),
            bf16: Vec::new(),
        }
    }

    /// Averages `values` over the ranks in place.
    pub fn all_reduce_mean(
        &mut self,
        values: &mut [f32],
        group: &mut ProcessGroup,
    ) -> Result<(), AccelerateError> {
        let n = values.len();
        match self.precision {
            MixedPrecision::No => group.all_reduce(values, Reduction::Mean)?,
            MixedPrecision::Bf16 => {
                let half = sized(&mut self.bf16, n, bf16::ZERO);
                convert::f32_to_bf16_slice(values, half);
                group.all_reduce(half, Reduction::Mean)?;
                convert::bf16_to_f32_slice(half, values);
            }
            MixedPrecision::Fp16 => {
                // Divide before summing: f16's range is small, and a sum over many ranks could
                // overflow where the mean would not.
                accelerate_kernels::scale_in_place(values, 1.0 / group.world_size() as f32);
                let half = sized(&mut self.f16, n, f16::ZERO);
                convert::f32_to_f16_slice(values, half);
                group.all_reduce(half, Reduction::Sum)?;
                convert::f16_to_f32_slice(half, values);
            }
        }
        Ok(())
    }

    /// Averages `values`, a buffer of the group's, over the ranks in place: on the f32 wire
    /// without staging copies where the group has shared memory.
    pub fn all_reduce_mean_shared(
        &mut self,
        values: &mut SharedBuffer<f32>,
        group: &mut ProcessGroup,
    ) -> Result<(), AccelerateError> {
        match self.precision {
            MixedPrecision::No => Ok(group.all_reduce_shared(values, Reduction::Mean)?),
            _ => self.all_reduce_mean(values, group),
        }
    }

    /// This rank's shard of the mean of `values` over the ranks, into `shard` (ZeRO): the
    /// chunks of `counts` elements per rank, or even ones. `values` is scaled in place on the
    /// fp16 wire.
    pub fn reduce_scatter_mean(
        &mut self,
        values: &mut [f32],
        shard: &mut [f32],
        counts: Option<&[usize]>,
        group: &mut ProcessGroup,
    ) -> Result<(), AccelerateError> {
        let (n, m) = (values.len(), shard.len());
        let even;
        let counts = match counts {
            Some(counts) => counts,
            None => {
                even = even_counts(n, group.world_size());
                &even[..]
            }
        };
        match self.precision {
            MixedPrecision::No => {
                group.reduce_scatter_counts(values, shard, counts, Reduction::Mean)?;
            }
            MixedPrecision::Bf16 => {
                let (all, mine) = sized(&mut self.bf16, n + m, bf16::ZERO).split_at_mut(n);
                convert::f32_to_bf16_slice(values, all);
                group.reduce_scatter_counts(all, mine, counts, Reduction::Mean)?;
                convert::bf16_to_f32_slice(mine, shard);
            }
            MixedPrecision::Fp16 => {
                accelerate_kernels::scale_in_place(values, 1.0 / group.world_size() as f32);
                let (all, mine) = sized(&mut self.f16, n + m, f16::ZERO).split_at_mut(n);
                convert::f32_to_f16_slice(values, all);
                group.reduce_scatter_counts(all, mine, counts, Reduction::Sum)?;
                convert::f16_to_f32_slice(mine, shard);
            }
        }
        Ok(())
    }
}

/// `buffer` holding exactly `len` elements (grown once, then reused).
fn sized<T: Copy>(buffer: &mut Vec<T>, len: usize, zero: T) -> &mut [T] {
    if buffer.len() < len {
        buffer.resize(len, zero);
    }
    &mut buffer[..len]
}

/// Averages one bucket that stays on a cubecl device: narrowed there (after dividing by the
/// world size for fp16, as on the host), reduced on the host in half precision, widened and
/// unscaled there. The same numbers as the host path, bit for bit. Returns the averaged
/// values and whether any is not finite (only measured with `inv_scale`).
#[cfg(feature = "device-kernels")]
pub(crate) fn average_on_device(
    joined: burn::tensor::Tensor<1>,
    group: &mut ProcessGroup,
    wire: MixedPrecision,
    inv_scale: Option<f32>,
) -> Result<(burn::tensor::Tensor<1>, bool), AccelerateError> {
    use crate::device_kernels;
    use accelerate_kernels::cube::Half;

    let rank = group.rank();
    let (half, scale, reduction) = match wire {
        MixedPrecision::Fp16 => (Half::F16, 1.0 / group.world_size() as f32, Reduction::Sum),
        _ => (Half::Bf16, 1.0, Reduction::Mean),
    };
    let device = joined.device();
    let bytes = device_kernels::narrow_to_half(joined, half, scale, rank)?;
    let bytes = match half {
        Half::F16 => {
            let mut values: Vec<f16> = bytemuck::pod_collect_to_vec(&bytes);
            group.all_reduce(&mut values, reduction)?;
            bytemuck::cast_slice(&values).to_vec()
        }
        Half::Bf16 => {
            let mut values: Vec<bf16> = bytemuck::pod_collect_to_vec(&bytes);
            group.all_reduce(&mut values, reduction)?;
            bytemuck::cast_slice(&values).to_vec()
        }
    };
    let joined = device_kernels::widen_from_half(&bytes, half, &device);
    match inv_scale {
        Some(inv) => {
            let mut flag = device_kernels::OverflowFlag::new(&joined.device());
            let joined = flag.unscale(joined, inv);
            Ok((joined, flag.found()))
        }
        None => Ok((joined, false)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A half-precision wire's scratch space grows to the largest call and stays: a smaller
    /// call after it (ZeRO's last, shorter column) still gets a result of its own length.
    #[test]
    fn a_smaller_reduce_scatter_after_a_larger_one_gets_its_own_length() {
        for precision in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
            let mut wire = Wire::new(precision);
            let mut group = ProcessGroup::single();
            for len in [8, 3] {
                let mut values: Vec<f32> = (0..len).map(|i| i as f32).collect();
                let mut shard = vec![0.0; len];
                wire.reduce_scatter_mean(&mut values, &mut shard, None, &mut group)
                    .unwrap();
                assert_eq!(shard, values, "{precision:?}, {len} elements");
            }
        }
    }
}
