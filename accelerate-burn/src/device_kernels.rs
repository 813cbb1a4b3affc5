//! Our cubecl kernels ([`accelerate_kernels::cube`]) on Burn's GPU tensors, through a Burn
//! backend extension: gradients are unscaled and checked for overflow, narrowed to half
//! precision for the wire, and fed to the fused optimizer update, on the device where they
//! already are. Only backends whose
//! [`AcceleratorBackend::DEVICE_KERNELS`](crate::AcceleratorBackend::DEVICE_KERNELS) is true
//! (wgpu, cuda) come here; the others keep the host kernels or Burn's own operations.

use accelerate_kernels::cube::Half;
use burn::backend::tensor::{FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, backend_extension};
use burn::tensor::{DType, Device, Int, Tensor, TensorData};

use accelerate_kernels::optim::{AdamHyper, SgdHyper};

use crate::error::AccelerateError;

/// The device kernels as Burn operations: tensors in, tensors out, so that under Burn's fusion
/// (the `fusion` feature) each is one lazy operation in the fused stream, ordered with the
/// operations around it, and its buffers are resolved through the fusion client.
#[backend_extension(Cube: cfg(feature = "device-kernels"), Fusion: cfg(feature = "fusion"))]
pub(crate) trait GradientKernels: Backend {
    /// `grad` times `inv_scale` (in place where its buffer is not shared), and `flag` (one
    /// zeroed integer) set to non-zero if any result is not finite. One flag collects many
    /// calls and is read once.
    #[fusion(meta = |grad, flag, _inv_scale| (grad.clone(), flag.clone()))]
    fn unscale_and_flag(
        grad: FloatTensor<Self>,
        flag: IntTensor<Self>,
        inv_scale: f32,
    ) -> (FloatTensor<Self>, IntTensor<Self>);

    /// `values` times `scale`, narrowed to f16 or bf16 and packed two to a word: a u32
    /// tensor of `values.len().div_ceil(2)` elements whose bytes are the halves in order.
    #[fusion(meta = |values, _bf16, _scale| burn::backend::fusion::custom::TensorSpec::new(
        burn::tensor::Shape::new([values.shape.num_elements().div_ceil(2)]),
        burn::tensor::DType::U32,
    ))]
    fn narrow_to_half(values: FloatTensor<Self>, bf16: bool, scale: f32) -> IntTensor<Self>;

    /// The `len` f32 values of `packed` (halves two to a u32 word, as `narrow_to_half` makes
    /// them), on `packed`'s device.
    #[fusion(meta = |_packed, len, _bf16| burn::backend::fusion::custom::TensorSpec::new(
        burn::tensor::Shape::new([*len]),
        burn::tensor::DType::F32,
    ))]
    fn widen_from_half(packed: IntTensor<Self>, len: usize, bf16: bool) -> FloatTensor<Self>;

    /// One fused optimizer update over flat buffers: the new parameters (a new buffer) and the
    /// three state slots, updated in place (slots the optimizer does not use are placeholders,
    /// returned as they came). Everything comes out in f32.
    #[fusion(meta = |params, _grads, first, second, third, _plan| {
        let f32 = |spec: &burn::backend::fusion::custom::TensorSpec| {
            burn::backend::fusion::custom::TensorSpec::new(
                spec.shape.clone(),
                burn::tensor::DType::F32,
            )
        };
        (f32(params), f32(first), f32(second), f32(third))
    })]
    fn fused_update(
        params: FloatTensor<Self>,
        grads: FloatTensor<Self>,
        first: FloatTensor<Self>,
        second: FloatTensor<Self>,
        third: FloatTensor<Self>,
        plan: FusedPlan,
    ) -> (
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
        FloatTensor<Self>,
    );
}

/// What one fused update does to each segment of the flat buffers.
#[derive(Debug, Clone)]
pub(crate) struct FusedPlan {
    /// The update and its hyperparameters.
    pub rule: UpdateRule,
    /// fp16 unscale times the clipping factor.
    pub grad_scale: f32,
    /// Values in the flat buffers (the state's length).
    pub len: usize,
    /// The flat index of the first value of `params`: 0 when it spans the buffers, a
    /// segment's offset when it is that segment's own tensor.
    pub params_offset: usize,
    /// The same for `grads`.
    pub grads_offset: usize,
    /// The segments to update (every segment of the flat buffers, in order, or the one that
    /// `params` holds).
    pub segments: Vec<PlannedSegment>,
}

/// Which update the kernels run, with their hyperparameters.
#[derive(Debug, Clone)]
pub(crate) enum UpdateRule {
    /// Adam or AdamW, with optional AMSGrad.
    Adam {
        /// The hyperparameters.
        hyper: AdamHyper,
        /// Keep the running maximum of the second moment.
        amsgrad: bool,
    },
    /// SGD with optional decay and momentum.
    Sgd(SgdHyper),
}

impl UpdateRule {
    /// State buffers the update reads and writes.
    pub(crate) fn state_buffers(&self) -> usize {
        match self {
            Self::Adam { amsgrad, .. } => 2 + usize::from(*amsgrad),
            Self::Sgd(hyper) => usize::from(hyper.momentum.is_some()),
        }
    }
}

/// One parameter tensor's range of the flat buffers and what its update does.
#[derive(Debug, Clone, Copy)]
pub(crate) struct PlannedSegment {
    /// First element.
    pub offset: usize,
    /// Elements.
    pub len: usize,
    /// `(step, learning rate)`; `None`: no gradient, the values are copied unchanged.
    pub update: Option<(i32, f64)>,
}

mod cube {
    use accelerate_kernels::cube::{self as kernels, FlatBuffers, Half, NonFiniteFlag};
    use burn::tensor::{DType, Shape};
    use burn_cubecl::CubeBackend;
    use burn_cubecl::kernel::{cast, into_contiguous};
    use burn_cubecl::tensor::CubeTensor;

    use super::{FusedPlan, GradientKernels, PlannedSegment, UpdateRule};

    /// `tensor` as contiguous f32 values that this call may overwrite.
    fn writable_f32(tensor: CubeTensor) -> CubeTensor {
        let tensor = contiguous_f32(tensor);
        if tensor.can_mut() {
            tensor
        } else {
            tensor.copy()
        }
    }

    /// `tensor` as contiguous f32 values.
    fn contiguous_f32(tensor: CubeTensor) -> CubeTensor {
        let tensor = if tensor.dtype == DType::F32 {
            tensor
        } else {
            cast(tensor, DType::F32)
        };
        if tensor.is_contiguous() {
            tensor
        } else {
            into_contiguous(tensor)
        }
    }

    fn half(bf16: bool) -> Half {
        if bf16 { Half::Bf16 } else { Half::F16 }
    }

    impl GradientKernels for CubeBackend {
        fn unscale_and_flag(
            grad: CubeTensor,
            flag: CubeTensor,
            inv_scale: f32,
        ) -> (CubeTensor, CubeTensor) {
            let dtype = grad.dtype;
            // A buffer another tensor still reads must not change under it.
            let values = writable_f32(grad);
            let len = values.meta.shape().num_elements();
            let device_flag = NonFiniteFlag::from_handle(flag.handle.clone());
            kernels::unscale_and_flag(
                &values.client,
                values.handle.clone(),
                len,
                inv_scale,
                &device_flag,
            );
            let values = if dtype == DType::F32 {
                values
            } else {
                cast(values, dtype)
            };
            (values, flag)
        }

        fn narrow_to_half(values: CubeTensor, bf16: bool, scale: f32) -> CubeTensor {
            let values = contiguous_f32(values);
            let len = values.meta.shape().num_elements();
            let packed = kernels::narrow_to_half(
                &values.client,
                values.handle.clone(),
                len,
                half(bf16),
                scale,
            );
            CubeTensor::new_contiguous(
                values.client.clone(),
                values.device.clone(),
                Shape::new([len.div_ceil(2)]),
                packed,
                DType::U32,
            )
        }

        fn fused_update(
            params: CubeTensor,
            grads: CubeTensor,
            first: CubeTensor,
            second: CubeTensor,
            third: CubeTensor,
            plan: FusedPlan,
        ) -> (CubeTensor, CubeTensor, CubeTensor, CubeTensor) {
            let params = contiguous_f32(params);
            let grads = contiguous_f32(grads);
            let state = [
                writable_f32(first),
                writable_f32(second),
                writable_f32(third),
            ];
            let client = params.client.clone();
            let params_len = params.meta.shape().num_elements();
            let grads_len = grads.meta.shape().num_elements();
            let out = client.empty(params_len * 4);
            let buffers = FlatBuffers {
                params: params.handle.clone(),
                grads: grads.handle.clone(),
                state: state[..plan.rule.state_buffers()]
                    .iter()
                    .map(|t| t.handle.clone())
                    .collect(),
                out: out.clone(),
                len: plan.len,
                params_range: plan.params_offset..plan.params_offset + params_len,
                grads_range: plan.grads_offset..plan.grads_offset + grads_len,
            };
            for &PlannedSegment {
                offset: start,
                len: count,
                update,
            } in &plan.segments
            {
                match (update, &plan.rule) {
                    (None, _) => kernels::copy_params(&client, &buffers, start, count),
                    (Some((time, lr)), UpdateRule::Adam { hyper, amsgrad }) => {
                        kernels::adam_step(
                            &client,
                            &buffers,
                            start,
                            count,
                            time,
                            lr,
                            plan.grad_scale,
                            hyper,
                            *amsgrad,
                        );
                    }
                    (Some((time, lr)), UpdateRule::Sgd(hyper)) => {
                        kernels::sgd_step(
                            &client,
                            &buffers,
                            start,
                            count,
                            time == 1,
                            lr,
                            plan.grad_scale,
                            hyper,
                        );
                    }
                }
            }
            let updated = CubeTensor::new_contiguous(
                client,
                params.device.clone(),
                params.meta.shape().clone(),
                out,
                DType::F32,
            );
            let [first, second, third] = state;
            (updated, first, second, third)
        }

        fn widen_from_half(packed: CubeTensor, len: usize, bf16: bool) -> CubeTensor {
            // Made by `from_data` or by `narrow_to_half`: contiguous u32 words.
            let packed = if packed.is_contiguous() {
                packed
            } else {
                into_contiguous(packed)
            };
            let output =
                kernels::widen_from_half(&packed.client, packed.handle.clone(), len, half(bf16));
            CubeTensor::new_contiguous(
                packed.client.clone(),
                packed.device.clone(),
                Shape::new([len]),
                output,
                DType::F32,
            )
        }
    }
}

/// A non-finite flag in device memory that [`unscale`](Self::unscale) sets; any number of
/// tensors, one 4-byte read at the end.
pub(crate) struct OverflowFlag(Tensor<1, Int>);

impl OverflowFlag {
    /// A cleared flag on `device` (a plain device: gradients carry no autodiff).
    pub(crate) fn new(device: &Device) -> Self {
        Self(Tensor::zeros([1], device))
    }

    /// `grad` times `inv_scale` (in place where its buffer is not shared), setting the flag if
    /// any result is not finite. One kernel.
    pub(crate) fn unscale<const D: usize>(&mut self, grad: Tensor<D>, inv_scale: f32) -> Tensor<D> {
        // The clone shares the flag's buffer, which the kernel sets atomically.
        let (grad, flag) = <Dispatch as GradientKernels>::unscale_and_flag(
            grad.into_dispatch(),
            self.0.clone().into_dispatch(),
            inv_scale,
        );
        self.0 = Tensor::from_dispatch(flag);
        Tensor::from_dispatch(grad)
    }

    /// Waits for the kernels and says whether any value was not finite.
    pub(crate) fn found(self) -> bool {
        self.0.into_data().iter::<i64>().any(|v| v != 0)
    }
}

/// `values` times `scale`, narrowed to `half` on the device: the bytes of a `[f16]`/`[bf16]`
/// slice, read back once the narrowing (and whatever it waits on) has run.
pub(crate) fn narrow_to_half(
    values: Tensor<1>,
    half: Half,
    scale: f32,
    rank: usize,
) -> Result<Vec<u8>, AccelerateError> {
    let len = values.dims()[0];
    let words = Tensor::<1, Int>::from_dispatch(<Dispatch as GradientKernels>::narrow_to_half(
        values.into_dispatch(),
        half == Half::Bf16,
        scale,
    ));
    let data = words.try_into_data().map_err(|e| AccelerateError::Tensor {
        rank,
        op: "narrowing gradients on the device",
        detail: e.to_string(),
    })?;
    data.as_bytes()
        .get(..len * 2)
        .map(<[u8]>::to_vec)
        .ok_or_else(|| AccelerateError::Tensor {
            rank,
            op: "narrowing gradients on the device",
            detail: format!("{} bytes came back for {len} halves", data.as_bytes().len()),
        })
}

/// The f32 values of `packed` (`half` bytes) on `device`.
pub(crate) fn widen_from_half(packed: &[u8], half: Half, device: &Device) -> Tensor<1> {
    let len = packed.len() / 2;
    // Whole words: an odd count leaves the last word's high half unread.
    let mut words = vec![0u32; len.div_ceil(2)];
    bytemuck::cast_slice_mut::<u32, u8>(&mut words)[..len * 2].copy_from_slice(&packed[..len * 2]);
    let words = Tensor::<1, Int>::from_data(
        TensorData::new(words, [len.div_ceil(2)]),
        (device, DType::U32),
    );
    Tensor::from_dispatch(<Dispatch as GradientKernels>::widen_from_half(
        words.into_dispatch(),
        len,
        half == Half::Bf16,
    ))
}

/// One fused update on the device: the new parameters and the updated state (as many tensors
/// as came in).
pub(crate) fn fused_update(
    params: Tensor<1>,
    grads: Tensor<1>,
    state: Vec<Tensor<1>>,
    plan: FusedPlan,
) -> (Tensor<1>, Vec<Tensor<1>>) {
    let used = state.len();
    let device = params.device();
    let mut slots = state.into_iter();
    let mut slot = || {
        slots
            .next()
            // Never read (its comptime flag is off): `empty` launches no fill kernel.
            .unwrap_or_else(|| Tensor::<1>::empty([1], &device))
            .into_dispatch()
    };
    let (first, second, third) = (slot(), slot(), slot());
    let (params, first, second, third) = <Dispatch as GradientKernels>::fused_update(
        params.into_dispatch(),
        grads.into_dispatch(),
        first,
        second,
        third,
        plan,
    );
    let state = [first, second, third]
        .into_iter()
        .take(used)
        .map(Tensor::from_dispatch)
        .collect();
    (Tensor::from_dispatch(params), state)
}
