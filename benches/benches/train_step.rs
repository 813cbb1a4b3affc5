//! One training step of `mlp_synthetic`'s model (784-1024-1024-10, batch 128, AdamW): the plain
//! Burn loop against the accelerated loop, in one process.

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use accelerate_benches::StepBench;
use criterion::{Criterion, criterion_group, criterion_main};

fn train_step(c: &mut Criterion) {
    let mut bench = StepBench::new(128);
    let mut group = c.benchmark_group("train_step");
    group.sample_size(30);
    group.bench_function("plain_burn", |b| {
        b.iter(|| {
            bench.plain_step();
            bench.sync();
        })
    });
    group.bench_function("accelerated", |b| {
        b.iter(|| {
            bench.accelerated_step();
            bench.sync();
        })
    });
    group.finish();
}

criterion_group!(benches, train_step);
criterion_main!(benches);
