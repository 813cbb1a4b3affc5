//! `accelerate_burn::nn` against burn-nn: the same outputs and gradients within 1e-5 relative
//! over a sweep of shapes, under autodiff and without, and checkpoints that load both ways.

use accelerate_burn::burn;
use accelerate_burn::nn;
use burn::module::{Module, Param};
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{Device, Distribution, FloatDType, Tensor, TensorData};

/// Largest element-wise difference relative to the larger magnitude (floored at 1, so values
/// near zero are compared absolutely).
fn assert_close(ours: TensorData, theirs: TensorData, tolerance: f32, what: &str) {
    let (a, b) = (
        ours.convert::<f32>().try_into_vec::<f32>().unwrap(),
        theirs.convert::<f32>().try_into_vec::<f32>().unwrap(),
    );
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        let scale = x.abs().max(y.abs()).max(1.0);
        assert!(
            (x - y).abs() <= tolerance * scale,
            "{what}[{i}]: ours {x}, burn-nn's {y}"
        );
    }
}

/// Both modules with the same (random) gamma and beta, each its own parameters.
fn pair(d_model: usize, bias: bool, device: &Device) -> (nn::LayerNorm, burn::nn::LayerNorm) {
    let gamma = Tensor::<1>::random([d_model], Distribution::Uniform(0.5, 1.5), device).into_data();
    let beta = Tensor::<1>::random([d_model], Distribution::Uniform(-0.5, 0.5), device).into_data();
    let param =
        |data: &TensorData| Param::from_tensor(Tensor::<1>::from_data(data.clone(), device));
    let mut ours = nn::LayerNormConfig::new(d_model)
        .with_bias(bias)
        .init(device);
    let mut theirs = burn::nn::LayerNormConfig::new(d_model)
        .with_bias(bias)
        .init(device);
    ours.gamma = param(&gamma);
    theirs.gamma = param(&gamma);
    if bias {
        ours.beta = Some(param(&beta));
        theirs.beta = Some(param(&beta));
    }
    (ours, theirs)
}

#[test]
fn layer_norm_outputs_and_gradients_equal_burn_nn() {
    let device = Device::default().autodiff();
    for (dims, bias) in [
        ([1, 1, 1], true),
        ([1, 1, 7], true),
        ([2, 3, 16], false),
        ([1, 5, 256], true),
        ([4, 33, 17], true),
        ([3, 70, 96], false),
    ] {
        let d_model = dims[2];
        let (ours, theirs) = pair(d_model, bias, &device);
        let input = Tensor::<3>::random(dims, Distribution::Normal(0.3, 2.0), &device);
        let weights = Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &device);
        let run = |forward: &dyn Fn(Tensor<3>) -> Tensor<3>| {
            let x = input.clone().detach().require_grad();
            let y = forward(x.clone());
            // A loss whose gradient is not uniform, so every term of the backward pass counts.
            let grads = (y.clone() * weights.clone()).sum().backward();
            (y, x.grad(&grads).unwrap(), grads)
        };
        let (y_ours, dx_ours, g_ours) = run(&|x| ours.forward(x));
        let (y_theirs, dx_theirs, g_theirs) = run(&|x| theirs.forward(x));
        let what = format!("{dims:?} bias {bias}");
        assert_close(
            y_ours.into_data(),
            y_theirs.into_data(),
            1e-5,
            &format!("{what} y"),
        );
        assert_close(
            dx_ours.into_data(),
            dx_theirs.into_data(),
            1e-5,
            &format!("{what} dx"),
        );
        let dgamma = |g, p: &Param<Tensor<1>>| p.val().grad(g).unwrap().into_data();
        assert_close(
            dgamma(&g_ours, &ours.gamma),
            dgamma(&g_theirs, &theirs.gamma),
            1e-5,
            &format!("{what} dgamma"),
        );
        if let (Some(b_ours), Some(b_theirs)) = (&ours.beta, &theirs.beta) {
            assert_close(
                dgamma(&g_ours, b_ours),
                dgamma(&g_theirs, b_theirs),
                1e-5,
                &format!("{what} dbeta"),
            );
        }
    }
}

#[test]
fn layer_norm_without_autodiff_and_in_half_precision_follows_burn_nn() {
    let device = Device::default();
    let (ours, theirs) = pair(64, true, &device);
    let x = Tensor::<2>::random([9, 64], Distribution::Normal(0.0, 3.0), &device);
    assert_close(
        ours.forward(x.clone()).into_data(),
        theirs.forward(x.clone()).into_data(),
        1e-5,
        "f32 without autodiff",
    );
    // Half precision: computed in f32 and rounded once, so within the type's precision of
    // burn-nn's f32 result.
    for (dtype, tolerance) in [(FloatDType::F16, 2e-3), (FloatDType::BF16, 1.6e-2)] {
        if !device.supports_dtype(dtype) {
            continue; // a GPU adapter without the type (lavapipe in CI has no f16 arithmetic)
        }
        let half = ours.forward(x.clone().cast(dtype));
        assert_eq!(half.dtype(), dtype.into());
        assert_close(
            half.into_data(),
            theirs.forward(x.clone()).into_data(),
            tolerance,
            &format!("{dtype:?}"),
        );
    }
}

/// The record layouts are the same: a checkpoint of either loads into the other.
#[test]
fn layer_norm_checkpoints_load_both_ways() {
    let device = Device::default();
    let tmp = tempfile::tempdir().unwrap();
    let (ours, theirs) = pair(24, true, &device);
    let x = Tensor::<2>::random([3, 24], Distribution::Normal(0.0, 1.0), &device);

    let path = tmp.path().join("ours.safetensors");
    ours.save_into(&mut SafetensorsStore::from_file(&path))
        .unwrap();
    let mut loaded = burn::nn::LayerNormConfig::new(24).init(&device);
    loaded
        .load_from(&mut SafetensorsStore::from_file(&path))
        .unwrap();
    assert_close(
        loaded.forward(x.clone()).into_data(),
        ours.forward(x.clone()).into_data(),
        1e-5,
        "ours into burn-nn",
    );

    let path = tmp.path().join("theirs.safetensors");
    theirs
        .save_into(&mut SafetensorsStore::from_file(&path))
        .unwrap();
    let mut loaded = nn::LayerNormConfig::new(24).init(&device);
    loaded
        .load_from(&mut SafetensorsStore::from_file(&path))
        .unwrap();
    assert_close(
        loaded.forward(x.clone()).into_data(),
        theirs.forward(x).into_data(),
        1e-5,
        "burn-nn into ours",
    );
    // Same number of parameters, same names.
    assert_eq!(loaded.num_params(), theirs.num_params());
}

/// burn-nn's encoder (pre-norm and post-norm, causal mask) saved and loaded into ours: the same
/// outputs and input gradients within 1e-5, under autodiff.
#[test]
fn transformer_encoders_load_burn_nn_weights_and_compute_the_same() {
    use burn::nn::attention::generate_autoregressive_mask;
    let device = Device::default().autodiff();
    let tmp = tempfile::tempdir().unwrap();
    for norm_first in [true, false] {
        let theirs = burn::nn::transformer::TransformerEncoderConfig::new(32, 64, 4, 2)
            .with_dropout(0.0)
            .with_norm_first(norm_first)
            .init(&device);
        let path = tmp.path().join(format!("encoder-{norm_first}.safetensors"));
        theirs
            .save_into(&mut SafetensorsStore::from_file(&path))
            .unwrap();
        let mut ours = nn::TransformerEncoderConfig::new(32, 64, 4, 2)
            .with_dropout(0.0)
            .with_norm_first(norm_first)
            .init(&device);
        ours.load_from(&mut SafetensorsStore::from_file(&path))
            .unwrap();
        assert_eq!(ours.num_params(), theirs.num_params());

        let input = Tensor::<3>::random([3, 10, 32], Distribution::Normal(0.0, 1.0), &device);
        let mask = generate_autoregressive_mask(3, 10, &device);
        let x = input.clone().require_grad();
        let y_ours =
            ours.forward(nn::TransformerEncoderInput::new(x.clone()).mask_attn(mask.clone()));
        let dx_ours = x
            .grad(&(y_ours.clone() * y_ours.clone()).sum().backward())
            .unwrap();
        let x = input.require_grad();
        let y_theirs = theirs.forward(
            burn::nn::transformer::TransformerEncoderInput::new(x.clone()).mask_attn(mask),
        );
        let dx_theirs = x
            .grad(&(y_theirs.clone() * y_theirs.clone()).sum().backward())
            .unwrap();
        assert_close(
            y_ours.into_data(),
            y_theirs.into_data(),
            1e-5,
            "encoder output",
        );
        assert_close(
            dx_ours.into_data(),
            dx_theirs.into_data(),
            1e-5,
            "encoder dx",
        );
    }
}

#[test]
#[should_panic(
    expected = "layer_norm: gamma has 3 elements for an input whose last dimension is 4"
)]
fn a_layer_norm_of_the_wrong_width_says_so() {
    let device = Device::default();
    let _ = nn::layer_norm(
        Tensor::<2>::zeros([2, 4], &device),
        Tensor::<1>::ones([3], &device),
        None,
        1e-5,
    );
}

/// A module's weights copied into another of the same record layout, through a checkpoint.
fn copy_weights<A: Module, B: Module>(from: &A, into: &mut B, dir: &std::path::Path, name: &str) {
    let path = dir.join(format!("{name}.safetensors"));
    from.save_into(&mut SafetensorsStore::from_file(&path))
        .unwrap();
    into.load_from(&mut SafetensorsStore::from_file(&path))
        .unwrap();
}

/// Multi-head attention against burn-nn's, weights loaded from burn-nn's checkpoint: context,
/// weights, the input's gradient and every projection's gradient within 1e-5, over batch 1,
/// sequence 1, odd sizes, cross-attention, padding and attention masks, quiet softmax.
/// `forward` (context and weights) and `forward_context` (self-attention as one flash-style
/// operation on Flex) against burn-nn: context, weights, dx and every projection's gradients
/// within 1e-5, with and without gradient checkpointing.
#[test]
fn multi_head_attention_equals_burn_nn_with_and_without_masks() {
    let plain = Device::default().autodiff();
    for device in [plain.clone(), plain.gradient_checkpointing()] {
        for context_only in [false, true] {
            multi_head_attention_equals_burn_nn_on(&device, context_only);
        }
    }
}

fn multi_head_attention_equals_burn_nn_on(device: &Device, context_only: bool) {
    use burn::nn::attention as theirs_mha;
    use burn::tensor::Bool;
    let device = device.clone();
    let tmp = tempfile::tempdir().unwrap();
    // (batch, seq, keys, d_model, heads, quiet, self-attention)
    for (case, (batch, seq, keys, d_model, heads, quiet, self_attn)) in [
        (1, 1, 1, 8, 2, false, true),
        (2, 7, 7, 12, 3, false, true),
        (3, 16, 16, 32, 4, true, true),
        (2, 5, 9, 16, 4, false, false),
        (1, 33, 33, 20, 5, false, true),
    ]
    .into_iter()
    .enumerate()
    {
        let theirs = theirs_mha::MultiHeadAttentionConfig::new(d_model, heads)
            .with_dropout(0.0)
            .with_quiet_softmax(quiet)
            .init(&device);
        let mut ours = nn::MultiHeadAttentionConfig::new(d_model, heads)
            .with_dropout(0.0)
            .with_quiet_softmax(quiet)
            .init(&device);
        copy_weights(&theirs, &mut ours, tmp.path(), &format!("mha-{case}"));
        assert_eq!(ours.num_params(), theirs.num_params());

        let query = Tensor::<3>::random(
            [batch, seq, d_model],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        let memory = Tensor::<3>::random(
            [batch, keys, d_model],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        let causal = theirs_mha::generate_autoregressive_mask(batch, seq, &device);
        // The last key of every sequence but the first is padding.
        let mut pad = vec![false; batch * keys];
        for b in 1..batch {
            pad[b * keys + keys - 1] = true;
        }
        let pad = Tensor::<2, Bool>::from_data(TensorData::new(pad, [batch, keys]), &device);
        let weights_of_output = Tensor::<3>::random(
            [batch, seq, d_model],
            Distribution::Normal(0.0, 1.0),
            &device,
        );
        for masks in 0..4 {
            let with_pad = masks & 1 == 1;
            let with_attn = masks & 2 == 2 && seq == keys;
            let what = format!(
                "case {case} masks pad {with_pad} attn {with_attn} context only {context_only}"
            );
            let x = query.clone().require_grad();
            let m = memory.clone().require_grad();
            let mut input = if self_attn {
                nn::MhaInput::self_attn(x.clone())
            } else {
                nn::MhaInput::new(x.clone(), m.clone(), m.clone())
            };
            let mut their_input = if self_attn {
                theirs_mha::MhaInput::self_attn(x.clone())
            } else {
                theirs_mha::MhaInput::new(x.clone(), m.clone(), m.clone())
            };
            if with_pad {
                input = input.mask_pad(pad.clone());
                their_input = their_input.mask_pad(pad.clone());
            }
            if with_attn {
                input = input.mask_attn(causal.clone());
                their_input = their_input.mask_attn(causal.clone());
            }
            let (context_ours, weights_ours) = if context_only {
                (ours.forward_context(input), None)
            } else {
                let out = ours.forward(input);
                (out.context, Some(out.weights))
            };
            let g_ours = (context_ours.clone() * weights_of_output.clone())
                .sum()
                .backward();
            let out_theirs = theirs.forward(their_input);
            let g_theirs = (out_theirs.context.clone() * weights_of_output.clone())
                .sum()
                .backward();
            assert_close(
                context_ours.into_data(),
                out_theirs.context.into_data(),
                1e-5,
                &format!("{what} context"),
            );
            if let Some(weights) = weights_ours {
                assert_close(
                    weights.into_data(),
                    out_theirs.weights.into_data(),
                    1e-5,
                    &format!("{what} weights"),
                );
            }
            assert_close(
                x.grad(&g_ours).unwrap().into_data(),
                x.grad(&g_theirs).unwrap().into_data(),
                1e-5,
                &format!("{what} dx"),
            );
            for (name, mine, their) in [
                ("query", &ours.query, &theirs.query),
                ("key", &ours.key, &theirs.key),
                ("value", &ours.value, &theirs.value),
                ("output", &ours.output, &theirs.output),
            ] {
                assert_close(
                    mine.weight.val().grad(&g_ours).unwrap().into_data(),
                    their.weight.val().grad(&g_theirs).unwrap().into_data(),
                    1e-5,
                    &format!("{what} d{name}.weight"),
                );
                let bias = |l: &burn::nn::Linear, g| {
                    l.bias.as_ref().unwrap().val().grad(g).unwrap().into_data()
                };
                assert_close(
                    bias(mine, &g_ours),
                    bias(their, &g_theirs),
                    1e-5,
                    &format!("{what} d{name}.bias"),
                );
            }
        }
    }
}

/// GELU and cross-entropy against Burn's: values and gradients within 1e-5, with and without
/// autodiff, odd shapes; the cross-entropy's targets cover the first and last class.
#[test]
fn gelu_and_cross_entropy_equal_burns() {
    let device = Device::default().autodiff();
    gelu_and_cross_entropy_equal_burns_on(&device);
}

/// Under gradient checkpointing the GELU is recomputed in the backward pass (memory-bound, as
/// Burn's): the same values and gradients.
#[test]
fn gelu_and_cross_entropy_equal_burns_under_gradient_checkpointing() {
    let device = Device::default().autodiff().gradient_checkpointing();
    gelu_and_cross_entropy_equal_burns_on(&device);
}

fn gelu_and_cross_entropy_equal_burns_on(device: &Device) {
    use burn::tensor::Int;
    use burn::tensor::activation::log_softmax;
    let device = device.clone();
    for dims in [[1, 1], [1, 7], [17, 3], [33, 256], [64, 1000]] {
        let [rows, classes] = dims;
        let input = Tensor::<2>::random(dims, Distribution::Normal(0.0, 3.0), &device);
        let weights = Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), &device);
        let x = input.clone().require_grad();
        let y = nn::gelu(x.clone());
        let dx = x
            .grad(&(y.clone() * weights.clone()).sum().backward())
            .unwrap();
        let x_theirs = input.clone().require_grad();
        let y_theirs = burn::tensor::activation::gelu(x_theirs.clone());
        let dx_theirs = x_theirs
            .grad(&(y_theirs.clone() * weights.clone()).sum().backward())
            .unwrap();
        assert_close(
            y.into_data(),
            y_theirs.into_data(),
            1e-5,
            &format!("gelu {dims:?}"),
        );
        assert_close(
            dx.into_data(),
            dx_theirs.into_data(),
            1e-5,
            &format!("gelu' {dims:?}"),
        );

        let targets: Vec<i64> = (0..rows)
            .map(|r| if r % 2 == 0 { 0 } else { (classes - 1) as i64 })
            .map(|t| (t + rows as i64 / 3) % classes as i64)
            .collect();
        let targets = Tensor::<1, Int>::from_data(TensorData::new(targets, [rows]), &device);
        let row_weights = Tensor::<1>::random([rows], Distribution::Normal(0.0, 1.0), &device);
        let x = input.clone().require_grad();
        let losses = nn::cross_entropy(x.clone(), targets.clone());
        let dx = x
            .grad(&(losses.clone() * row_weights.clone()).sum().backward())
            .unwrap();
        let x_theirs = input.clone().require_grad();
        let losses_theirs = log_softmax(x_theirs.clone(), 1)
            .gather(1, targets.clone().reshape([rows, 1]))
            .reshape([rows])
            .neg();
        let dx_theirs = x_theirs
            .grad(&(losses_theirs.clone() * row_weights).sum().backward())
            .unwrap();
        assert_close(
            losses.into_data(),
            losses_theirs.into_data(),
            1e-5,
            &format!("cross_entropy {dims:?}"),
        );
        assert_close(
            dx.into_data(),
            dx_theirs.into_data(),
            1e-5,
            &format!("cross_entropy' {dims:?}"),
        );
        // Without autodiff: the same values.
        let plain = nn::cross_entropy(input.clone().inner(), targets.inner());
        assert_eq!(plain.dims(), [rows]);
    }
}

/// Every element within 1e-5 of the largest magnitude of Burn's tensor. A product's element
/// is a sum of hundreds of terms that may cancel (a weight gradient of 0.25 from terms of
/// magnitude 1), and ours and Burn's add them in different orders, so an element-wise relative
/// bound would measure the cancellation, not the operation; this is the usual normwise one.
fn assert_close_normwise(ours: TensorData, theirs: TensorData, what: &str) {
    let (a, b) = (
        ours.convert::<f32>().try_into_vec::<f32>().unwrap(),
        theirs.convert::<f32>().try_into_vec::<f32>().unwrap(),
    );
    assert_eq!(a.len(), b.len(), "{what}: lengths");
    let scale = b.iter().fold(1.0_f32, |m, v| m.max(v.abs()));
    for (i, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            (x - y).abs() <= 1e-5 * scale,
            "{what}[{i}]: ours {x}, Burn's {y} (largest magnitude {scale})"
        );
    }
}

#[test]
fn linear_equals_burns() {
    linear_equals_burns_on(&Device::default().autodiff());
}

/// Under gradient checkpointing the product's output is kept (compute-bound): the same values
/// and gradients.
#[test]
fn linear_equals_burns_under_gradient_checkpointing() {
    linear_equals_burns_on(&Device::default().autodiff().gradient_checkpointing());
}

/// `nn::linear` against `burn::tensor::module::linear`: outputs and the gradients of the input,
/// the weight and the bias within 1e-5 (normwise), over odd shapes, batch 1, with and without a bias, a
/// 3-d input, and a tied embedding's transposed weight read in place; without autodiff too.
fn linear_equals_burns_on(device: &Device) {
    use burn::tensor::module::linear;
    let device = device.clone();
    for ([batch, seq, d_in, d_out], bias, transposed) in [
        ([1, 1, 1, 1], true, false),
        ([1, 3, 7, 5], false, false),
        ([2, 17, 33, 1], true, false),
        ([3, 5, 64, 129], true, true),
        ([4, 32, 96, 256], false, true),
        ([2, 64, 256, 768], true, false),
    ] {
        let what = format!(
            "{:?} bias {bias} transposed {transposed}",
            [batch, seq, d_in, d_out]
        );
        let input =
            Tensor::<3>::random([batch, seq, d_in], Distribution::Normal(0.0, 1.0), &device);
        // A transposed weight: the transpose of a [d_out, d_in] tensor, as a tied output layer's.
        let stored = if transposed {
            [d_out, d_in]
        } else {
            [d_in, d_out]
        };
        let weight = Tensor::<2>::random(stored, Distribution::Normal(0.0, 0.2), &device);
        let b = Tensor::<1>::random([d_out], Distribution::Normal(0.0, 1.0), &device);
        let dy = Tensor::<3>::random([batch, seq, d_out], Distribution::Normal(0.0, 1.0), &device);
        let run = |ours: bool| {
            let x = input.clone().require_grad();
            let w = weight.clone().require_grad();
            let bias_param = b.clone().require_grad();
            let view = if transposed {
                w.clone().transpose()
            } else {
                w.clone()
            };
            let bias_arg = bias.then(|| bias_param.clone());
            let y = if ours {
                nn::linear(x.clone(), view, bias_arg)
            } else {
                linear(x.clone(), view, bias_arg)
            };
            let grads = (y.clone() * dy.clone()).sum().backward();
            let db = bias.then(|| bias_param.grad(&grads).unwrap().into_data());
            (
                y.into_data(),
                x.grad(&grads).unwrap().into_data(),
                w.grad(&grads).unwrap().into_data(),
                db,
            )
        };
        let (y, dx, dw, db) = run(true);
        let (y_theirs, dx_theirs, dw_theirs, db_theirs) = run(false);
        assert_close_normwise(y, y_theirs, &format!("y {what}"));
        assert_close_normwise(dx, dx_theirs, &format!("dx {what}"));
        assert_close_normwise(dw, dw_theirs, &format!("dW {what}"));
        if let (Some(db), Some(db_theirs)) = (db, db_theirs) {
            assert_close_normwise(db, db_theirs, &format!("db {what}"));
        }
        // Without autodiff: the same values.
        let view = if transposed {
            weight.clone().transpose()
        } else {
            weight.clone()
        };
        let bias_arg = bias.then(|| b.clone().inner());
        assert_close_normwise(
            nn::linear(
                input.clone().inner(),
                view.clone().inner(),
                bias_arg.clone(),
            )
            .into_data(),
            linear(input.clone().inner(), view.inner(), bias_arg).into_data(),
            &format!("plain y {what}"),
        );
    }
}

/// `nn::linear` in bf16 and in f16 (autocast's types: half-precision products accumulated in
/// f32, each result rounded once) against Burn's f32 linear layer of the same values: outputs
/// and the gradients of the input, the weight and the bias within one rounding of the type
/// (2^-8 for bf16, 2^-11 for f16, normwise), every result in the type, over odd shapes, with
/// and without a bias, a transposed weight. On Flex (NdArray has no bf16).
#[cfg(feature = "flex")]
#[test]
fn linear_in_half_precision_is_an_f32_product_of_the_same_values_rounded_once() {
    for (half, dtype, rounding) in [
        (FloatDType::BF16, burn::tensor::DType::BF16, 2f64.powi(-8)),
        (FloatDType::F16, burn::tensor::DType::F16, 2f64.powi(-11)),
    ] {
        linear_in_half_is_an_f32_product_rounded_once(half, dtype, rounding);
    }
}

#[cfg(feature = "flex")]
fn linear_in_half_is_an_f32_product_rounded_once(
    half_type: FloatDType,
    half_dtype: burn::tensor::DType,
    rounding: f64,
) {
    let device = Device::default().autodiff();
    for ([batch, seq, d_in, d_out], bias, transposed) in [
        ([1, 1, 1, 1], true, false),
        ([1, 3, 7, 5], false, false),
        ([2, 17, 33, 1], true, true),
        ([3, 5, 64, 129], true, true),
        ([2, 64, 256, 768], true, false),
    ] {
        let what = format!(
            "{:?} bias {bias} transposed {transposed}",
            [batch, seq, d_in, d_out]
        );
        let half = |t: Tensor<3>| t.cast(half_type);
        let input = half(Tensor::random(
            [batch, seq, d_in],
            Distribution::Normal(0.0, 1.0),
            &device,
        ));
        let stored = if transposed {
            [d_out, d_in]
        } else {
            [d_in, d_out]
        };
        let weight =
            Tensor::<2>::random(stored, Distribution::Normal(0.0, 0.2), &device).cast(half_type);
        let b =
            Tensor::<1>::random([d_out], Distribution::Normal(0.0, 1.0), &device).cast(half_type);
        let dy = half(Tensor::random(
            [batch, seq, d_out],
            Distribution::Normal(0.0, 1.0),
            &device,
        ));
        let run = |dtype: FloatDType, ours: bool| {
            let x = input.clone().cast(dtype).require_grad();
            let w = weight.clone().cast(dtype).require_grad();
            let bias_param = b.clone().cast(dtype).require_grad();
            let view = if transposed {
                w.clone().transpose()
            } else {
                w.clone()
            };
            let bias_arg = bias.then(|| bias_param.clone());
            let y = if ours {
                nn::linear(x.clone(), view, bias_arg)
            } else {
                burn::tensor::module::linear(x.clone(), view, bias_arg)
            };
            let grads = (y.clone() * dy.clone().cast(dtype)).sum().backward();
            let mut out = vec![
                y,
                x.grad(&grads).unwrap(),
                w.grad(&grads).unwrap().reshape([1, 1, -1]),
            ];
            if bias {
                out.push(bias_param.grad(&grads).unwrap().reshape([1, 1, -1]));
            }
            out
        };
        let ours = run(half_type, true);
        let reference = run(FloatDType::F32, false);
        for (name, (ours, reference)) in ["y", "dx", "dW", "db"]
            .iter()
            .zip(ours.into_iter().zip(reference))
        {
            assert_eq!(ours.dtype(), half_dtype, "{name} {what}");
            let ours: Vec<f32> = ours
                .cast(FloatDType::F32)
                .into_data()
                .iter::<f32>()
                .collect();
            let reference: Vec<f32> = reference.into_data().iter::<f32>().collect();
            let (mut diff, mut norm) = (0.0f64, 0.0f64);
            for (a, r) in ours.iter().zip(&reference) {
                diff += f64::from(a - r).powi(2);
                norm += f64::from(*r).powi(2);
            }
            let relative = (diff / norm.max(f64::MIN_POSITIVE)).sqrt();
            assert!(
                relative <= rounding,
                "{half_type:?} {name} {what}: {relative:e}"
            );
        }
    }
}

/// f64 tensors are not ours to compute: Burn's `linear` runs, with its result.
#[test]
fn linear_of_other_float_types_is_burns() {
    let device = Device::default();
    let x =
        Tensor::<2>::random([5, 3], Distribution::Normal(0.0, 1.0), &device).cast(FloatDType::F64);
    let w =
        Tensor::<2>::random([3, 4], Distribution::Normal(0.0, 1.0), &device).cast(FloatDType::F64);
    let ours = nn::linear(x.clone(), w.clone(), None);
    let theirs = burn::tensor::module::linear(x, w, None);
    assert_eq!(ours.dtype(), burn::tensor::DType::F64);
    assert_eq!(ours.into_data(), theirs.into_data());
}

#[test]
#[should_panic(expected = "linear: input of width 3 for a weight of 4 x 2")]
fn a_linear_input_of_the_wrong_width_says_so() {
    let device = Device::default();
    let x = Tensor::<2>::zeros([5, 3], &device);
    let w = Tensor::<2>::zeros([4, 2], &device);
    nn::linear(x, w, None);
}

/// The feed-forward network's record is burn-nn's (both ways), and it computes the same.
#[test]
fn feed_forward_networks_load_both_ways_and_compute_the_same() {
    let device = Device::default();
    let tmp = tempfile::tempdir().unwrap();
    let theirs = burn::nn::transformer::PositionWiseFeedForwardConfig::new(24, 40)
        .with_dropout(0.0)
        .init(&device);
    let mut ours = nn::PositionWiseFeedForwardConfig::new(24, 40)
        .with_dropout(0.0)
        .init(&device);
    copy_weights(&theirs, &mut ours, tmp.path(), "theirs");
    let x = Tensor::<3>::random([2, 5, 24], Distribution::Normal(0.0, 1.0), &device);
    assert_close(
        ours.forward(x.clone()).into_data(),
        theirs.forward(x.clone()).into_data(),
        1e-5,
        "burn-nn into ours",
    );
    let mut back = burn::nn::transformer::PositionWiseFeedForwardConfig::new(24, 40)
        .with_dropout(0.0)
        .init(&device);
    copy_weights(&ours, &mut back, tmp.path(), "ours");
    assert_close(
        back.forward(x.clone()).into_data(),
        ours.forward(x).into_data(),
        1e-5,
        "ours into burn-nn",
    );
}

/// Without dropout the network's GELU and second layer are one operation that keeps only the
/// GELU's input for the backward pass: its output and every gradient equal burn-nn's network
/// within 1e-5, with and without gradient checkpointing.
#[test]
fn feed_forward_networks_train_as_burn_nns() {
    let plain = Device::default().autodiff();
    for device in [plain.clone(), plain.gradient_checkpointing()] {
        for dims in [[1, 1, 24], [2, 5, 24], [3, 17, 24]] {
            let theirs = burn::nn::transformer::PositionWiseFeedForwardConfig::new(24, 40)
                .with_dropout(0.0)
                .init(&device);
            let ours = nn::PositionWiseFeedForwardConfig::new(24, 40)
                .with_dropout(0.0)
                .init(&device)
                .load_record(theirs.clone().into_record());
            let input = Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let dy = Tensor::<3>::random(dims, Distribution::Normal(0.0, 1.0), &device);
            let x = input.clone().require_grad();
            let y = ours.forward(x.clone());
            let grads = (y.clone() * dy.clone()).sum().backward();
            let x_theirs = input.clone().require_grad();
            let y_theirs = theirs.forward(x_theirs.clone());
            let grads_theirs = (y_theirs.clone() * dy).sum().backward();

            let what = format!("{dims:?}");
            let close = |a, b, name: &str| assert_close(a, b, 1e-5, &format!("{name} {what}"));
            close(y.into_data(), y_theirs.into_data(), "y");
            let dx = |x: &Tensor<3>, grads| x.grad(grads).unwrap().into_data();
            close(dx(&x, &grads), dx(&x_theirs, &grads_theirs), "dx");
            let pairs = [
                (&ours.linear_inner, &theirs.linear_inner),
                (&ours.linear_outer, &theirs.linear_outer),
            ];
            for (layer, (mine, burns)) in pairs.into_iter().enumerate() {
                let weight = |l: &burn::nn::Linear, g| l.weight.grad(g).unwrap().into_data();
                let bias =
                    |l: &burn::nn::Linear, g| l.bias.as_ref().unwrap().grad(g).unwrap().into_data();
                close(
                    weight(mine, &grads),
                    weight(burns, &grads_theirs),
                    &format!("dW{layer}"),
                );
                close(
                    bias(mine, &grads),
                    bias(burns, &grads_theirs),
                    &format!("db{layer}"),
                );
            }
        }
    }
}

#[test]
#[should_panic(expected = "cross_entropy: 3 targets for 2 rows of logits")]
fn a_cross_entropy_with_too_few_targets_says_so() {
    let device = Device::default();
    let _ = nn::cross_entropy(
        Tensor::<2>::zeros([2, 4], &device),
        Tensor::<1, burn::tensor::Int>::zeros([3], &device),
    );
}
