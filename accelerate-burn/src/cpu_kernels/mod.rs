//! Our CPU kernels ([`accelerate_kernels`]' layer norm, attention softmax, flash-style
//! self-attention, cross-entropy, GELU, linear layer, and the GELU inside a linear layer) on Burn's Flex
//! tensors, with our own backward nodes on `Autodiff<Flex>`, through a
//! Burn backend extension.
//!
//! Burn's autodiff has no backward pass of its own for layer norm, softmax or log-softmax: it
//! runs the backend trait's default decompositions, each step a tracked operation with its own
//! backward, so one layer norm costs about thirty passes over its tensor when training and an
//! attention softmax about nineteen, most of them on one core. Here each is one parallel pass
//! forward and one backward; self-attention and the GELU before a linear layer also keep less for
//! backward (the attention weights and the GELU's output are recomputed). One file per operation: its forward on Flex, its backward node,
//! and its tracked form under autodiff.
//!
//! Only Flex tensors (plain or under autodiff) come here: [`crate::nn`] checks the device and
//! the type first and uses Burn's own operations everywhere else, so calling these on another
//! backend (which panics) cannot happen. f32 everywhere; bf16 and f16 (autocast's types) in the
//! linear layer (half-precision products), the GELU (chunks computed in f32), layer norm and
//! self-attention (computed in f32 between parallel casts, kept in their own type) and the
//! casts themselves; the other operations are called on f32 (`nn` casts around them).

mod add;
mod cast;
mod cross_entropy;
mod gelu;
mod gelu_linear;
mod layer_norm;
mod linear;
mod self_attention;
mod softmax;
mod tensors;
mod weight_cat;

use tensors::{
    Half, contiguous, flex_tensor, half_tensor, half_values, owned_contiguous, row_shape, values,
};

use burn::backend::autodiff::Autodiff;
use burn::backend::autodiff::checkpoint::strategy::CheckpointStrategy;
use burn::backend::tensor::{BoolTensor, FloatTensor, IntTensor};
use burn::backend::{Backend, Dispatch, Flex, backend_extension};
use burn::tensor::{Bool, FloatDType, Int, Tensor};

/// The fused CPU operations, as Burn operations.
#[backend_extension(Flex, Autodiff)]
pub(crate) trait CpuKernels: Backend {
    /// Layer norm over the last dimension of `x` (f32, bf16 or f16, as `gamma` and `beta`):
    /// `(x - mean) / sqrt(var + epsilon) * gamma + beta`, with the biased variance, as Burn's `layer_norm`.
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self>;

    /// `softmax(scores * scale)` over the last dimension of `[batch, heads, seq, keys]` scores
    /// (quiet: Burn's `quiet_softmax`).
    fn fused_softmax(scores: FloatTensor<Self>, scale: f64, quiet: bool) -> FloatTensor<Self>;

    /// As [`CpuKernels::fused_softmax`], with the scores where `mask` (`[batch, seq, keys]`,
    /// the same for every head) is true replaced by `fill` before the softmax, as burn-nn's
    /// attention does with `mask_fill`.
    fn fused_masked_softmax(
        scores: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        scale: f64,
        fill: f64,
        quiet: bool,
    ) -> FloatTensor<Self>;

    /// Self-attention over one QKV product `qkv` `[batch, seq, 3 * d_model]` (query, key,
    /// value side by side, each `heads` heads wide): the context `[batch, seq, d_model]`,
    /// `softmax(q k^T * scale) v` per head, without keeping the attention weights.
    fn fused_self_attention(
        qkv: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        quiet: bool,
    ) -> FloatTensor<Self>;

    /// As [`CpuKernels::fused_self_attention`], the scores where `mask` (`[batch, seq, seq]`,
    /// the same for every head) is true replaced by `fill` before the softmax.
    fn fused_masked_self_attention(
        qkv: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        heads: usize,
        scale: f64,
        fill: f64,
        quiet: bool,
    ) -> FloatTensor<Self>;

    /// Each row's softmax cross-entropy, `[rows]`, of `logits` `[rows, classes]` against
    /// `targets` `[rows]`.
    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self>;

    /// The exact GELU, `x * Φ(x)`.
    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self>;

    /// `linear(gelu(x), weight, bias)`, keeping only `x` for the backward pass (the GELU is
    /// recomputed there).
    fn fused_gelu_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `x weight + bias` over the last dimension of `x` (`weight` `[d_in, d_out]`, any strides).
    fn fused_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `x weight` over the last dimension of `x` (`weight` `[d_in, d_out]`, any strides).
    fn fused_linear_without_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// The columns of three 2-d weights of the same rows side by side, recomputed for the
    /// backward pass instead of kept.
    fn fused_weight_cat(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        c: FloatTensor<Self>,
    ) -> FloatTensor<Self>;

    /// `x` (f32, bf16 or f16) converted to `dtype`, in parallel; its gradient is cast back.
    fn fused_cast(x: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self>;

    /// `a + b` of one shape (no broadcasting): two bf16 or f16 tensors added in parallel,
    /// Burn's add otherwise.
    fn fused_add(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self>;
}

impl CpuKernels for Flex {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        layer_norm::forward(&x, &gamma, &beta, epsilon).0
    }

    fn fused_softmax(scores: FloatTensor<Self>, scale: f64, quiet: bool) -> FloatTensor<Self> {
        softmax::forward(&scores, None, softmax::Settings::new(scale, 0.0, quiet))
    }

    fn fused_masked_softmax(
        scores: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        scale: f64,
        fill: f64,
        quiet: bool,
    ) -> FloatTensor<Self> {
        let settings = softmax::Settings::new(scale, fill, quiet);
        softmax::forward(&scores, Some(&softmax::mask_bytes(&mask)), settings)
    }

    fn fused_self_attention(
        qkv: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        quiet: bool,
    ) -> FloatTensor<Self> {
        let settings = self_attention::Settings::new(heads, scale, 0.0, quiet);
        self_attention::forward(&qkv, None, settings).0
    }

    fn fused_masked_self_attention(
        qkv: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        heads: usize,
        scale: f64,
        fill: f64,
        quiet: bool,
    ) -> FloatTensor<Self> {
        let settings = self_attention::Settings::new(heads, scale, fill, quiet);
        self_attention::forward(
            &qkv,
            Some(&self_attention::attention_mask_bytes(&mask)),
            settings,
        )
        .0
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        cross_entropy::forward(&logits, &cross_entropy::target_classes(&targets)).0
    }

    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        gelu::forward(&x)
    }

    fn fused_gelu_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        gelu_linear::forward(&x, &weight, &bias)
    }

    fn fused_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        linear::forward(&x, &weight, Some(&bias))
    }

    fn fused_linear_without_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        linear::forward(&x, &weight, None)
    }

    fn fused_weight_cat(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        c: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        weight_cat::forward([&a, &b, &c])
    }

    fn fused_cast(x: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> {
        cast::forward(&x, dtype)
    }

    fn fused_add(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        add::forward(&a, &b)
    }
}

impl<C: CheckpointStrategy> CpuKernels for Autodiff<Flex, C> {
    fn fused_layer_norm(
        x: FloatTensor<Self>,
        gamma: FloatTensor<Self>,
        beta: FloatTensor<Self>,
        epsilon: f64,
    ) -> FloatTensor<Self> {
        layer_norm::tracked::<C>(x, gamma, beta, epsilon)
    }

    fn fused_softmax(scores: FloatTensor<Self>, scale: f64, quiet: bool) -> FloatTensor<Self> {
        softmax::tracked::<C>(scores, None, softmax::Settings::new(scale, 0.0, quiet))
    }

    fn fused_masked_softmax(
        scores: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        scale: f64,
        fill: f64,
        quiet: bool,
    ) -> FloatTensor<Self> {
        softmax::tracked::<C>(
            scores,
            Some(mask),
            softmax::Settings::new(scale, fill, quiet),
        )
    }

    fn fused_self_attention(
        qkv: FloatTensor<Self>,
        heads: usize,
        scale: f64,
        quiet: bool,
    ) -> FloatTensor<Self> {
        let settings = self_attention::Settings::new(heads, scale, 0.0, quiet);
        self_attention::tracked::<C>(qkv, None, settings)
    }

    fn fused_masked_self_attention(
        qkv: FloatTensor<Self>,
        mask: BoolTensor<Self>,
        heads: usize,
        scale: f64,
        fill: f64,
        quiet: bool,
    ) -> FloatTensor<Self> {
        let settings = self_attention::Settings::new(heads, scale, fill, quiet);
        self_attention::tracked::<C>(qkv, Some(mask), settings)
    }

    fn fused_cross_entropy(
        logits: FloatTensor<Self>,
        targets: IntTensor<Self>,
    ) -> FloatTensor<Self> {
        cross_entropy::tracked::<C>(logits, targets)
    }

    fn fused_gelu(x: FloatTensor<Self>) -> FloatTensor<Self> {
        gelu::tracked::<C>(x)
    }

    fn fused_gelu_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        gelu_linear::tracked::<C>(x, weight, bias)
    }

    fn fused_linear(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
        bias: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        linear::tracked::<C>(x, weight, Some(bias))
    }

    fn fused_linear_without_bias(
        x: FloatTensor<Self>,
        weight: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        linear::tracked::<C>(x, weight, None)
    }

    fn fused_weight_cat(
        a: FloatTensor<Self>,
        b: FloatTensor<Self>,
        c: FloatTensor<Self>,
    ) -> FloatTensor<Self> {
        weight_cat::tracked::<C>(a, b, c)
    }

    fn fused_cast(x: FloatTensor<Self>, dtype: FloatDType) -> FloatTensor<Self> {
        cast::tracked::<C>(x, dtype)
    }

    fn fused_add(a: FloatTensor<Self>, b: FloatTensor<Self>) -> FloatTensor<Self> {
        add::tracked::<C>(a, b)
    }
}

/// The fused layer norm of dispatch tensors (f32, bf16 or f16 on Flex, plain or under autodiff).
pub(crate) fn layer_norm<const D: usize>(
    x: Tensor<D>,
    gamma: Tensor<1>,
    beta: Tensor<1>,
    epsilon: f64,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CpuKernels>::fused_layer_norm(
        x.into_dispatch(),
        gamma.into_dispatch(),
        beta.into_dispatch(),
        epsilon,
    ))
}

/// The fused attention softmax of f32 scores `[batch, heads, seq, keys]` on Flex, masked where
/// `mask` (`[batch, seq, keys]`) is true.
pub(crate) fn attention_softmax(
    scores: Tensor<4>,
    mask: Option<Tensor<3, Bool>>,
    scale: f64,
    fill: f64,
    quiet: bool,
) -> Tensor<4> {
    let scores = scores.into_dispatch();
    Tensor::from_dispatch(match mask {
        Some(mask) => <Dispatch as CpuKernels>::fused_masked_softmax(
            scores,
            mask.into_dispatch(),
            scale,
            fill,
            quiet,
        ),
        None => <Dispatch as CpuKernels>::fused_softmax(scores, scale, quiet),
    })
}

/// The fused self-attention of a QKV product `[batch, seq, 3 * d_model]` (f32, bf16 or f16) on Flex: the
/// context `[batch, seq, d_model]`, masked where `mask` (`[batch, seq, seq]`) is true.
pub(crate) fn self_attention(
    qkv: Tensor<3>,
    mask: Option<Tensor<3, Bool>>,
    heads: usize,
    scale: f64,
    fill: f64,
    quiet: bool,
) -> Tensor<3> {
    let qkv = qkv.into_dispatch();
    Tensor::from_dispatch(match mask {
        Some(mask) => <Dispatch as CpuKernels>::fused_masked_self_attention(
            qkv,
            mask.into_dispatch(),
            heads,
            scale,
            fill,
            quiet,
        ),
        None => <Dispatch as CpuKernels>::fused_self_attention(qkv, heads, scale, quiet),
    })
}

/// The fused cross-entropy of f32 `logits` `[rows, classes]` on Flex: each row's loss.
pub(crate) fn cross_entropy(logits: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
    Tensor::from_dispatch(<Dispatch as CpuKernels>::fused_cross_entropy(
        logits.into_dispatch(),
        targets.into_dispatch(),
    ))
}

/// The fused GELU of an f32, bf16 or f16 tensor on Flex.
pub(crate) fn gelu<const D: usize>(x: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CpuKernels>::fused_gelu(x.into_dispatch()))
}

/// `linear(gelu(x), weight, bias)` of f32 dispatch tensors on Flex, the GELU recomputed in the
/// backward pass instead of kept.
pub(crate) fn gelu_linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Tensor<1>,
) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CpuKernels>::fused_gelu_linear(
        x.into_dispatch(),
        weight.into_dispatch(),
        bias.into_dispatch(),
    ))
}

/// `x weight (+ bias)` of f32 dispatch tensors on Flex, `x` `[..., d_in]`, `weight` `[d_in,
/// d_out]` (a transposed view is read in place).
pub(crate) fn linear<const D: usize>(
    x: Tensor<D>,
    weight: Tensor<2>,
    bias: Option<Tensor<1>>,
) -> Tensor<D> {
    let (x, weight) = (x.into_dispatch(), weight.into_dispatch());
    Tensor::from_dispatch(match bias {
        Some(bias) => <Dispatch as CpuKernels>::fused_linear(x, weight, bias.into_dispatch()),
        None => <Dispatch as CpuKernels>::fused_linear_without_bias(x, weight),
    })
}

/// The columns of three f32 2-d weights on Flex side by side (`[d_in, a + b + c]`), recomputed
/// for the backward pass instead of kept.
pub(crate) fn weight_cat(a: Tensor<2>, b: Tensor<2>, c: Tensor<2>) -> Tensor<2> {
    Tensor::from_dispatch(<Dispatch as CpuKernels>::fused_weight_cat(
        a.into_dispatch(),
        b.into_dispatch(),
        c.into_dispatch(),
    ))
}

/// A float dispatch tensor on Flex (f32, bf16 or f16) converted to `dtype` in parallel.
pub(crate) fn cast<const D: usize>(x: Tensor<D>, dtype: FloatDType) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CpuKernels>::fused_cast(
        x.into_dispatch(),
        dtype,
    ))
}

/// `a + b` of two float dispatch tensors on Flex (bf16 or f16 of one shape added in parallel).
pub(crate) fn add<const D: usize>(a: Tensor<D>, b: Tensor<D>) -> Tensor<D> {
    Tensor::from_dispatch(<Dispatch as CpuKernels>::fused_add(
        a.into_dispatch(),
        b.into_dispatch(),
    ))
}

#[cfg(test)]
mod tests {
    use burn::tensor::{Bool, DType, Device, Distribution, FloatDType, Tensor, TensorData};

    /// `op` on `x` and its gradients under `dy`: the output's bytes, then each input's
    /// gradient's bytes.
    fn run<const D: usize, const E: usize>(
        inputs: &[Tensor<D>],
        dy: &Tensor<E>,
        op: impl Fn(Vec<Tensor<D>>) -> Tensor<E>,
    ) -> Vec<TensorData> {
        let inputs: Vec<Tensor<D>> = inputs.iter().map(|t| t.clone().require_grad()).collect();
        let y = op(inputs.clone());
        let grads = (y.clone() * dy.clone()).sum().backward();
        let mut out = vec![y.into_data()];
        out.extend(
            inputs
                .iter()
                .map(|t| t.grad(&grads).expect("a gradient").into_data()),
        );
        out
    }

    fn assert_same_bytes(ours: Vec<TensorData>, reference: Vec<TensorData>, what: &str) {
        assert_eq!(ours.len(), reference.len());
        for (i, (a, b)) in ours.iter().zip(&reference).enumerate() {
            assert_eq!(a.dtype(), b.dtype(), "{what}: tensor {i}'s type");
            assert_eq!(a.as_bytes(), b.as_bytes(), "{what}: tensor {i}");
        }
    }

    /// The GELU, layer norm and self-attention of bf16 and f16 tensors, which read and keep
    /// them in their own type, give bit for bit what casting to f32, running the f32 kernel
    /// and casting back gives, forward and for every gradient.
    #[test]
    fn half_precision_kernels_equal_the_f32_kernels_between_casts() {
        let device = Device::default().autodiff();
        let f32 = FloatDType::F32;
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            let half = DType::from(dtype);
            let random = |dims: [usize; 3], std: f64| {
                Tensor::<3>::random(dims, Distribution::Normal(0.0, std), &device).cast(dtype)
            };
            let x = random([3, 19, 40], 2.0);
            let dy = random([3, 19, 40], 1.0);
            let ours = run(std::slice::from_ref(&x), &dy, |t| super::gelu(t[0].clone()));
            let reference = run(std::slice::from_ref(&x), &dy, |t| {
                super::gelu(super::cast(t[0].clone(), f32)).cast(dtype)
            });
            assert_same_bytes(ours, reference, &format!("gelu {half:?}"));

            let gamma = random([1, 1, 40], 1.0);
            let beta = random([1, 1, 40], 1.0);
            let inputs = [x.clone(), gamma, beta];
            let width = |t: &Tensor<3>| t.clone().reshape([40]);
            let ours = run(&inputs, &dy, |t| {
                super::layer_norm(t[0].clone(), width(&t[1]), width(&t[2]), 1e-5)
            });
            let reference = run(&inputs, &dy, |t| {
                let wide = |t: &Tensor<3>| super::cast(t.clone(), f32);
                super::layer_norm(wide(&t[0]), width(&wide(&t[1])), width(&wide(&t[2])), 1e-5)
                    .cast(dtype)
            });
            assert_same_bytes(ours, reference, &format!("layer norm {half:?}"));

            let (seq, heads, d_model) = (13, 2, 8);
            let qkv = random([2, seq, 3 * d_model], 1.0);
            let dcontext = random([2, seq, d_model], 1.0);
            let causal = Tensor::<2, Bool>::tril_mask([seq, seq], 0, &device)
                .reshape([1, seq, seq])
                .expand([2, seq, seq]);
            let attend = |qkv: Tensor<3>| {
                super::self_attention(qkv, Some(causal.clone()), heads, 0.5, -1e4, false)
            };
            let ours = run(std::slice::from_ref(&qkv), &dcontext, |t| {
                attend(t[0].clone())
            });
            let reference = run(std::slice::from_ref(&qkv), &dcontext, |t| {
                attend(super::cast(t[0].clone(), f32)).cast(dtype)
            });
            assert_same_bytes(ours, reference, &format!("self-attention {half:?}"));
        }
    }

    /// Our sum of two bf16 or f16 tensors (a residual connection) gives Burn's `a + b` bit for
    /// bit, forward and for both gradients, also when one operand is a transposed view.
    #[test]
    fn half_precision_sums_equal_burns_add() {
        let device = Device::default().autodiff();
        for dtype in [FloatDType::BF16, FloatDType::F16] {
            let random = |dims: [usize; 3]| {
                Tensor::<3>::random(dims, Distribution::Normal(0.0, 3.0), &device).cast(dtype)
            };
            let inputs = [random([3, 700, 40]), random([3, 700, 40])];
            let dy = random([3, 700, 40]);
            let ours = run(&inputs, &dy, |t| super::add(t[0].clone(), t[1].clone()));
            let reference = run(&inputs, &dy, |t| t[0].clone() + t[1].clone());
            assert_same_bytes(ours, reference, &format!("add {dtype:?}"));
            let transposed = random([3, 40, 700]);
            let inputs = [inputs[0].clone(), transposed];
            let ours = run(&inputs, &dy, |t| {
                super::add(t[0].clone(), t[1].clone().swap_dims(1, 2))
            });
            let reference = run(&inputs, &dy, |t| {
                t[0].clone() + t[1].clone().swap_dims(1, 2)
            });
            assert_same_bytes(
                ours,
                reference,
                &format!("add of a transposed view {dtype:?}"),
            );
        }
    }
}
