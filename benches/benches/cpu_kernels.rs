//! Our fused CPU kernels against Burn's composition, forward and backward under autodiff on
//! Flex, at the transformer example's shapes (32 sequences of 128 tokens, d_model 256, 4 heads,
//! MLP 1024, byte vocabulary): one layer norm, one causal self-attention (the whole module:
//! projections, scores, softmax, context; `fused` is `forward`, `flash` `forward_context`), one
//! feed-forward network (its GELU and second layer one operation in ours), one GELU, one
//! cross-entropy, one linear layer (self-attention's QKV projection, 256 to 768, with its
//! weight and bias gradients). Each group's `loss_alone`
//! row is the weighted sum and its backward without the op, which both other rows include.
//! Bytes counted: the op's input read and output written forward, input, output gradient and
//! input gradient backward.

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use accelerate_burn::burn;
use accelerate_burn::nn;
use burn::tensor::{Device, Distribution, Int, Tensor};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const DIMS: [usize; 3] = [32, 128, 256];
const TOKENS: usize = DIMS[0] * DIMS[1];

/// One forward and backward of `forward` on a fresh leaf copy of `x`, with a weighted sum as
/// the loss (so the backward pass's every term counts).
fn step<const D: usize, const E: usize>(
    x: &Tensor<D>,
    weights: &Tensor<E>,
    forward: &dyn Fn(Tensor<D>) -> Tensor<E>,
) -> Option<Tensor<D>> {
    let input = x.clone().detach().require_grad();
    let grads = (forward(input.clone()) * weights.clone()).sum().backward();
    let dx = input.grad(&grads);
    let _ = x.device().sync();
    dx
}

fn layer_norm(c: &mut Criterion) {
    let device = Device::default().autodiff();
    let x = Tensor::<3>::random(DIMS, Distribution::Normal(0.0, 1.0), &device);
    let weights = Tensor::<3>::random(DIMS, Distribution::Normal(0.0, 1.0), &device);
    let ours = nn::LayerNormConfig::new(DIMS[2]).init(&device);
    let theirs = burn::nn::LayerNormConfig::new(DIMS[2]).init(&device);
    let mut group = c.benchmark_group("layer_norm_fwd_bwd");
    group.sample_size(20);
    group.throughput(Throughput::Bytes(16 * (TOKENS * DIMS[2]) as u64));
    group.bench_function("burn_nn", |b| {
        b.iter(|| step(&x, &weights, &|x| theirs.forward(x)))
    });
    group.bench_function("fused", |b| {
        b.iter(|| step(&x, &weights, &|x| ours.forward(x)))
    });
    group.bench_function("loss_alone", |b| b.iter(|| step(&x, &weights, &|x| x)));
    group.finish();
}

fn attention(c: &mut Criterion) {
    use burn::nn::attention::generate_autoregressive_mask;
    let device = Device::default().autodiff();
    let [batch, seq, d_model] = DIMS;
    let x = Tensor::<3>::random(DIMS, Distribution::Normal(0.0, 1.0), &device);
    let weights = Tensor::<3>::random(DIMS, Distribution::Normal(0.0, 1.0), &device);
    let mask = generate_autoregressive_mask(batch, seq, &device);
    let theirs = burn::nn::attention::MultiHeadAttentionConfig::new(d_model, 4)
        .with_dropout(0.0)
        .init(&device);
    let ours = nn::MultiHeadAttentionConfig::new(d_model, 4)
        .with_dropout(0.0)
        .init(&device);
    let mut group = c.benchmark_group("self_attention_fwd_bwd");
    group.sample_size(10);
    // The score tensor dominates: [batch, heads, seq, seq].
    group.throughput(Throughput::Bytes(16 * (batch * 4 * seq * seq) as u64));
    group.bench_function("burn_nn", |b| {
        b.iter(|| {
            step(&x, &weights, &|x| {
                let input = burn::nn::attention::MhaInput::self_attn(x).mask_attn(mask.clone());
                theirs.forward(input).context
            })
        })
    });
    group.bench_function("fused", |b| {
        b.iter(|| {
            step(&x, &weights, &|x| {
                ours.forward(nn::MhaInput::self_attn(x).mask_attn(mask.clone()))
                    .context
            })
        })
    });
    group.bench_function("flash", |b| {
        b.iter(|| {
            step(&x, &weights, &|x| {
                ours.forward_context(nn::MhaInput::self_attn(x).mask_attn(mask.clone()))
            })
        })
    });
    group.bench_function("loss_alone", |b| b.iter(|| step(&x, &weights, &|x| x)));
    group.finish();
}

fn feed_forward(c: &mut Criterion) {
    let device = Device::default().autodiff();
    let [_, _, d_model] = DIMS;
    let x = Tensor::<3>::random(DIMS, Distribution::Normal(0.0, 1.0), &device);
    let weights = Tensor::<3>::random(DIMS, Distribution::Normal(0.0, 1.0), &device);
    let theirs = burn::nn::transformer::PositionWiseFeedForwardConfig::new(d_model, 4 * d_model)
        .with_dropout(0.0)
        .init(&device);
    let ours = nn::PositionWiseFeedForwardConfig::new(d_model, 4 * d_model)
        .with_dropout(0.0)
        .init(&device);
    let mut group = c.benchmark_group("feed_forward_fwd_bwd");
    group.sample_size(10);
    // The hidden activation dominates: [tokens, 4 d_model].
    group.throughput(Throughput::Bytes(16 * (TOKENS * 4 * d_model) as u64));
    group.bench_function("burn_nn", |b| {
        b.iter(|| step(&x, &weights, &|x| theirs.forward(x)))
    });
    group.bench_function("fused", |b| {
        b.iter(|| step(&x, &weights, &|x| ours.forward(x)))
    });
    group.bench_function("loss_alone", |b| b.iter(|| step(&x, &weights, &|x| x)));
    group.finish();
}

fn linear(c: &mut Criterion) {
    let device = Device::default().autodiff();
    let [batch, seq, d_model] = DIMS;
    let x = Tensor::<3>::random(DIMS, Distribution::Normal(0.0, 1.0), &device);
    let out = [batch, seq, 3 * d_model];
    let weights = Tensor::<3>::random(out, Distribution::Normal(0.0, 1.0), &device);
    let w = Tensor::<2>::random(
        [d_model, 3 * d_model],
        Distribution::Normal(0.0, 0.05),
        &device,
    )
    .require_grad();
    let b =
        Tensor::<1>::random([3 * d_model], Distribution::Normal(0.0, 0.05), &device).require_grad();
    let mut group = c.benchmark_group("linear_fwd_bwd");
    group.sample_size(20);
    // Input and output forward; output gradient, input gradient and weight gradient backward.
    group.throughput(Throughput::Bytes(4 * (TOKENS * (3 * d_model) * 3) as u64));
    group.bench_function("burn", |bench| {
        bench.iter(|| {
            step(&x, &weights, &|x| {
                burn::tensor::module::linear(x, w.clone(), Some(b.clone()))
            })
        })
    });
    group.bench_function("fused", |bench| {
        bench.iter(|| step(&x, &weights, &|x| nn::linear(x, w.clone(), Some(b.clone()))))
    });
    group.bench_function("loss_alone", |bench| {
        bench.iter(|| step(&weights, &weights, &|y| y))
    });
    group.finish();
}

fn gelu(c: &mut Criterion) {
    let device = Device::default().autodiff();
    let dims = [TOKENS, 4 * DIMS[2]];
    let x = Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), &device);
    let weights = Tensor::<2>::random(dims, Distribution::Normal(0.0, 1.0), &device);
    let mut group = c.benchmark_group("gelu_fwd_bwd");
    group.sample_size(20);
    group.throughput(Throughput::Bytes(16 * (dims[0] * dims[1]) as u64));
    group.bench_function("burn", |b| {
        b.iter(|| step(&x, &weights, &burn::tensor::activation::gelu))
    });
    group.bench_function("fused", |b| b.iter(|| step(&x, &weights, &nn::gelu)));
    group.bench_function("loss_alone", |b| b.iter(|| step(&x, &weights, &|x| x)));
    group.finish();
}

fn cross_entropy(c: &mut Criterion) {
    use burn::tensor::activation::log_softmax;
    let device = Device::default().autodiff();
    let dims = [TOKENS, 256];
    let logits = Tensor::<2>::random(dims, Distribution::Normal(0.0, 2.0), &device);
    let targets = Tensor::<1, Int>::random([TOKENS], Distribution::Uniform(0.0, 256.0), &device);
    let weights = Tensor::<1>::random([TOKENS], Distribution::Normal(0.0, 1.0), &device);
    let mut group = c.benchmark_group("cross_entropy_fwd_bwd");
    group.sample_size(20);
    group.throughput(Throughput::Bytes(12 * (dims[0] * dims[1]) as u64));
    group.bench_function("burn", |b| {
        b.iter(|| {
            step(&logits, &weights, &|x| {
                log_softmax(x, 1)
                    .gather(1, targets.clone().reshape([TOKENS, 1]))
                    .reshape([TOKENS])
                    .neg()
            })
        })
    });
    group.bench_function("fused", |b| {
        b.iter(|| {
            step(&logits, &weights, &|x| {
                nn::cross_entropy(x, targets.clone())
            })
        })
    });
    group.finish();
}

criterion_group!(
    benches,
    layer_norm,
    attention,
    feed_forward,
    gelu,
    cross_entropy,
    linear
);
criterion_main!(benches);
