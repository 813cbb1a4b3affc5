//! The optimizer step alone on `mlp_synthetic`'s model (1.87 M parameters): Burn's AdamW
//! (`ModuleOptimizer::step`) against the fused kernel over flat buffers. Bytes counted per
//! step: parameters, first and second moments read and written, gradients read (28 B per
//! parameter).

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use accelerate_burn::burn;
use accelerate_burn::{Accelerator, DefaultBackend, ProcessState};
use accelerate_examples::MlpConfig;
use accelerate_examples::synthetic::{CLASSES, FEATURES};
use accelerate_kernels::optim::adam_step;
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Distribution, Int, Tensor};
use criterion::{BatchSize, Criterion, Throughput, criterion_group, criterion_main};

fn optimizer(c: &mut Criterion) {
    let acc = Accelerator::<DefaultBackend>::builder()
        .process_state(ProcessState::single())
        .seed(0)
        .build()
        .expect("the default backend runs here");
    let device = acc.device();
    let model = MlpConfig::new(FEATURES, vec![1024, 1024], CLASSES).init(&device);
    let params = model.num_params();
    let x = Tensor::random([128, FEATURES], Distribution::Default, &device);
    let y = Tensor::<1, Int>::random([128], Distribution::Uniform(0.0, CLASSES as f64), &device);
    // Gradients come from a copy with the same parameter ids, built outside the timing.
    let source = model.clone();
    let fresh_grads = || {
        let loss = source.forward_loss(x.clone(), y.clone()).loss;
        GradientsParams::from_grads(loss.backward(), &source)
    };

    let mut group = c.benchmark_group("optimizer_step");
    group.sample_size(30);
    group.throughput(Throughput::Bytes(28 * params as u64));
    let mut optim = AdamWConfig::new().init();
    let mut current = Some(model);
    group.bench_function("burn_adamw", |b| {
        b.iter_batched(
            fresh_grads,
            |grads| {
                let model = current.take().expect("put back below");
                let model = optim.step(1e-3, model, grads);
                let _ = device.sync();
                current = Some(model);
            },
            BatchSize::PerIteration,
        )
    });

    let hyper = accelerate_benches::BURN_ADAMW;
    let mut p = vec![0.01f32; params];
    let g = vec![0.001f32; params];
    let (mut m, mut v) = (vec![0.0f32; params], vec![0.0f32; params]);
    let mut time = 0;
    group.bench_function("fused_adamw_kernel", |b| {
        b.iter(|| {
            time += 1;
            adam_step(&mut p, &g, &mut m, &mut v, None, time, 1e-3, 1.0, &hyper);
        })
    });
    group.finish();
}

criterion_group!(benches, optimizer);
criterion_main!(benches);
