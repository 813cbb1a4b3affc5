//! Keeping the processes' models identical: the start (every rank checks it built rank 0's
//! model, then takes rank 0's parameter values and ids) and every update (gradients averaged
//! over the ranks, in buckets, in module visit order).
//!
//! Parameters are matched across processes by visit order, never by `ParamId` (Burn draws ids
//! at random per process); after [`broadcast_parameters`] the ids agree too, so optimizer
//! records and checkpoints line up.

use std::collections::HashMap;

use accelerate_core::MixedPrecision;
use accelerate_core::comm::{ProcessGroup, Reduction};
use accelerate_kernels::amp::unscale_and_check;
use accelerate_kernels::convert;
use burn::module::{Module, ModuleMapper, ModuleVisitor, Param, ParamId};
use burn::optim::GradientsParams;
use burn::tensor::{DType, Tensor, TensorData};
use half::{bf16, f16};

use crate::error::AccelerateError;

/// Ids and shapes of `model`'s float parameters, in visit order.
pub(crate) fn parameters<M: Module>(model: &M) -> Vec<(u64, Vec<usize>)> {
    struct Collect(Vec<(u64, Vec<usize>)>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0
                .push((param.id.val(), param.lazy_shape().as_slice().to_vec()));
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}

/// What differs between this rank's parameter shapes and rank 0's, if anything.
fn describe_difference(mine: &[Vec<usize>], rank0: &[Vec<usize>]) -> Option<String> {
    if mine.len() != rank0.len() {
        return Some(format!(
            "this process's model has {} float parameters, rank 0's has {}",
            mine.len(),
            rank0.len()
        ));
    }
    mine.iter().zip(rank0).position(|(a, b)| a != b).map(|i| {
        format!(
            "parameter #{i} has shape {:?} here and {:?} on rank 0",
            mine[i], rank0[i]
        )
    })
}

/// Checks that every rank built the same model (float parameter shapes, in visit order), then
/// gives every rank rank 0's parameter values and ids. A mismatch is an error on every rank.
pub(crate) fn broadcast_parameters<M: Module>(
    model: M,
    group: &mut ProcessGroup,
) -> Result<M, AccelerateError> {
    let rank = group.rank();
    let params = parameters(&model);
    let shapes: Vec<Vec<usize>> = params.iter().map(|(_, s)| s.clone()).collect();
    let rank0_shapes: Vec<Vec<usize>> = group.broadcast_object(Some(&shapes), 0)?;
    let difference = describe_difference(&shapes, &rank0_shapes);
    let mut differs = vec![0.0_f32; group.world_size()];
    group.all_gather(&[f32::from(u8::from(difference.is_some()))], &mut differs)?;
    let bad: Vec<String> = differs
        .iter()
        .enumerate()
        .filter(|(_, d)| **d != 0.0)
        .map(|(r, _)| r.to_string())
        .collect();
    if !bad.is_empty() {
        let detail = difference.unwrap_or_else(|| {
            format!(
                "ranks {} built a different model than rank 0",
                bad.join(", ")
            )
        });
        return Err(AccelerateError::ModelMismatch { rank, detail });
    }

    let ids: Vec<u64> = params.iter().map(|(id, _)| *id).collect();
    let ids: Vec<u64> = group.broadcast_object(Some(&ids), 0)?;
    let total: usize = shapes.iter().map(|s| s.iter().product::<usize>()).sum();
    let mut flat = if rank == 0 {
        flatten(&model)
    } else {
        vec![0.0; total]
    };
    group.broadcast(&mut flat, 0)?;

    struct Load {
        flat: Vec<f32>,
        offset: usize,
        ids: std::vec::IntoIter<u64>,
    }
    impl ModuleMapper for Load {
        fn map_float<const D: usize>(&mut self, param: Param<Tensor<D>>) -> Param<Tensor<D>> {
            let (id, tensor, mapper) = param.consume();
            let dims = tensor.dims();
            let n: usize = dims.iter().product();
            let values = self.flat[self.offset..self.offset + n].to_vec();
            self.offset += n;
            let mut value = Tensor::<D>::from_data(TensorData::new(values, dims), &tensor.device());
            if tensor.dtype() != DType::F32 {
                value = value.cast(tensor.dtype());
            }
            if tensor.is_require_grad() {
                value = value.require_grad();
            }
            let id = self.ids.next().map_or(id, ParamId::from);
            Param::from_mapped_value(id, value, mapper)
        }
    }
    Ok(model.map(&mut Load {
        flat,
        offset: 0,
        ids: ids.into_iter(),
    }))
}

/// Every float parameter's values, as f32, concatenated in visit order.
/// Every float parameter of `model` as f32, concatenated in visit order.
pub(crate) fn flatten<M: Module>(model: &M) -> Vec<f32> {
    struct Flatten(Vec<f32>);
    impl ModuleVisitor for Flatten {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            let data = param.val().into_data().convert::<f32>();
            self.0.extend(data.iter::<f32>());
        }
    }
    let mut f = Flatten(Vec::new());
    model.visit(&mut f);
    f.0
}

/// Averages `grads` over the ranks: in visit order, gradients are concatenated into buckets of
/// at most `bucket_bytes` (f32), each bucket is all-reduced as one buffer, and the results are
/// put back. With `inv_scale` (fp16 loss scaling) each bucket is also unscaled in the same
/// host pass, and the result says whether any gradient is not finite. Every rank must hold
/// gradients for the same parameters (a collective mismatch error says so otherwise).
pub(crate) fn average_gradients<M: Module>(
    grads: &mut GradientsParams,
    model: &M,
    group: &mut ProcessGroup,
    bucket_bytes: usize,
    wire: MixedPrecision,
    inv_scale: Option<f32>,
    device_kernels: bool,
) -> Result<bool, AccelerateError> {
    // Take every gradient out, flattened, in visit order.
    struct Take<'a> {
        grads: &'a mut GradientsParams,
        flat: Vec<(ParamId, Tensor<1>, DType)>,
    }
    impl ModuleVisitor for Take<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.grads.remove::<D>(param.id) {
                let n = grad.shape().num_elements();
                let dtype = grad.dtype();
                self.flat.push((param.id, grad.reshape([n]), dtype));
            }
        }
    }
    let mut take = Take {
        grads,
        flat: Vec::new(),
    };
    model.visit(&mut take);
    let flat = take.flat;

    let mut reduced: HashMap<ParamId, Tensor<1>> = HashMap::with_capacity(flat.len());
    let mut overflow = false;
    let mut pending: Vec<(ParamId, Tensor<1>, DType)> = Vec::new();
    let mut pending_bytes = 0;
    let mut entries = flat.into_iter().peekable();
    while let Some(entry) = entries.next() {
        pending_bytes += entry.1.shape().num_elements() * 4;
        pending.push(entry);
        if pending_bytes >= bucket_bytes || entries.peek().is_none() {
            overflow |= all_reduce_bucket(
                std::mem::take(&mut pending),
                group,
                wire,
                inv_scale,
                device_kernels,
                &mut reduced,
            )?;
            pending_bytes = 0;
        }
    }

    struct Put<'a> {
        grads: &'a mut GradientsParams,
        reduced: HashMap<ParamId, Tensor<1>>,
    }
    impl ModuleVisitor for Put<'_> {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            if let Some(grad) = self.reduced.remove(&param.id) {
                let dims = param.lazy_shape();
                self.grads.register::<D>(param.id, grad.reshape(dims));
            }
        }
    }
    model.visit(&mut Put { grads, reduced });
    Ok(overflow)
}

/// Averages `values` over the ranks, travelling in `wire` precision.
fn average(
    values: &mut [f32],
    group: &mut ProcessGroup,
    wire: MixedPrecision,
) -> Result<(), AccelerateError> {
    match wire {
        MixedPrecision::No => group.all_reduce(values, Reduction::Mean)?,
        MixedPrecision::Bf16 => {
            let mut half = vec![bf16::ZERO; values.len()];
            convert::f32_to_bf16_slice(values, &mut half);
            group.all_reduce(&mut half, Reduction::Mean)?;
            convert::bf16_to_f32_slice(&half, values);
        }
        MixedPrecision::Fp16 => {
            // Divide before summing: f16's range is small, and a sum over many ranks could
            // overflow where the mean would not.
            accelerate_kernels::scale_in_place(values, 1.0 / group.world_size() as f32);
            let mut half = vec![f16::ZERO; values.len()];
            convert::f32_to_f16_slice(values, &mut half);
            group.all_reduce(&mut half, Reduction::Sum)?;
            convert::f16_to_f32_slice(&half, values);
        }
    }
    Ok(())
}

/// [`average`] for a bucket that stays on a cubecl device: narrowed there (after dividing by
/// the world size for fp16, as on the host), reduced on the host in half precision, widened
/// and unscaled there. The same numbers as the host path, bit for bit.
#[cfg(feature = "device-kernels")]
fn average_on_device(
    joined: Tensor<1>,
    group: &mut ProcessGroup,
    wire: MixedPrecision,
    inv_scale: Option<f32>,
) -> Result<(Tensor<1>, bool), AccelerateError> {
    use crate::device_kernels;
    use accelerate_kernels::cube::Half;

    let rank = group.rank();
    let (half, scale, reduction) = match wire {
        MixedPrecision::Fp16 => (Half::F16, 1.0 / group.world_size() as f32, Reduction::Sum),
        _ => (Half::Bf16, 1.0, Reduction::Mean),
    };
    let (joined, bytes) = device_kernels::narrow_to_half(joined, half, scale, rank)?;
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
    let joined = device_kernels::widen_from_half(joined, bytes, half);
    match inv_scale {
        Some(inv) => {
            let mut flag = device_kernels::OverflowFlag::new(&joined.device());
            let joined = flag.unscale(joined, inv);
            Ok((joined, flag.found()))
        }
        None => Ok((joined, false)),
    }
}

/// Without a cubecl backend in the build there is no device path: a backend that claims
/// device kernels anyway gets an error, not a silent host fallback.
#[cfg(not(feature = "device-kernels"))]
fn average_on_device(
    _joined: Tensor<1>,
    group: &mut ProcessGroup,
    _wire: MixedPrecision,
    _inv_scale: Option<f32>,
) -> Result<(Tensor<1>, bool), AccelerateError> {
    Err(AccelerateError::Tensor {
        rank: group.rank(),
        op: "averaging gradients on the device",
        detail: "this backend claims DEVICE_KERNELS, but this build has no `wgpu` or `cuda` \
                 feature"
            .into(),
    })
}

/// All-reduces one bucket; with `inv_scale`, also unscales it and returns whether any value
/// is not finite. With `device_kernels` (a cubecl backend) and a half-precision wire, the
/// bucket is narrowed, widened and unscaled on the device, so only half-precision bytes cross
/// to the host and back.
fn all_reduce_bucket(
    bucket: Vec<(ParamId, Tensor<1>, DType)>,
    group: &mut ProcessGroup,
    wire: MixedPrecision,
    inv_scale: Option<f32>,
    device_kernels: bool,
    reduced: &mut HashMap<ParamId, Tensor<1>>,
) -> Result<bool, AccelerateError> {
    let Some(device) = bucket.first().map(|(_, t, _)| t.device()) else {
        return Ok(false);
    };
    let sizes: Vec<usize> = bucket
        .iter()
        .map(|(_, t, _)| t.shape().num_elements())
        .collect();
    let tensors: Vec<Tensor<1>> = bucket
        .iter()
        .map(|(_, t, _)| t.clone().cast(DType::F32))
        .collect();
    let joined = Tensor::cat(tensors, 0);
    let (joined, overflow) = if device_kernels && wire != MixedPrecision::No {
        average_on_device(joined, group, wire, inv_scale)?
    } else {
        let len = joined.shape().num_elements();
        // Already f32 (each part was cast above).
        let mut values: Vec<f32> = joined.into_data().iter::<f32>().collect();
        average(&mut values, group, wire)?;
        let overflow = inv_scale.is_some_and(|inv| unscale_and_check(&mut values, inv));
        let joined = Tensor::<1>::from_data(TensorData::new(values, [len]), &device);
        (joined, overflow)
    };
    let mut offset = 0;
    for ((id, _, dtype), n) in bucket.into_iter().zip(sizes) {
        let mut part = joined.clone().narrow(0, offset, n);
        if dtype != DType::F32 {
            part = part.cast(dtype);
        }
        reduced.insert(id, part);
        offset += n;
    }
    Ok(overflow)
}
