//! One layer norm of the transformer example's residual stream (32 sequences of 128 tokens,
//! d_model 256), forward and backward under autodiff on Flex: burn-nn's `LayerNorm` (Burn's
//! decomposition) against `accelerate_burn::nn::LayerNorm` (our fused kernels). Bytes counted:
//! the input read and the output written forward, the input, output gradient and input gradient
//! backward (16 B per element). `loss_alone` is the weighted sum and its backward without a
//! norm, which both other rows include.

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use accelerate_burn::burn;
use accelerate_burn::nn;
use burn::tensor::{Device, Distribution, Tensor};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const DIMS: [usize; 3] = [32, 128, 256];

fn layer_norm(c: &mut Criterion) {
    let device = Device::default().autodiff();
    let x = Tensor::<3>::random(DIMS, Distribution::Normal(0.0, 1.0), &device);
    let weights = Tensor::<3>::random(DIMS, Distribution::Normal(0.0, 1.0), &device);
    let ours = nn::LayerNormConfig::new(DIMS[2]).init(&device);
    let theirs = burn::nn::LayerNormConfig::new(DIMS[2]).init(&device);
    let step = |forward: &dyn Fn(Tensor<3>) -> Tensor<3>| {
        let input = x.clone().detach().require_grad();
        let grads = (forward(input.clone()) * weights.clone()).sum().backward();
        let dx = input.grad(&grads);
        let _ = device.sync();
        dx
    };
    let mut group = c.benchmark_group("layer_norm_fwd_bwd");
    group.sample_size(20);
    group.throughput(Throughput::Bytes(
        16 * DIMS.iter().product::<usize>() as u64,
    ));
    group.bench_function("burn_nn", |b| b.iter(|| step(&|x| theirs.forward(x))));
    group.bench_function("fused", |b| b.iter(|| step(&|x| ours.forward(x))));
    // The loss and its backward alone (what both rows above also pay).
    group.bench_function("loss_alone", |b| b.iter(|| step(&|x| x)));
    group.finish();
}

criterion_group!(benches, layer_norm);
criterion_main!(benches);
