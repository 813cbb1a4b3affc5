//! One training step of `mlp_synthetic`'s model (784-1024-1024-10, batch 128, AdamW): the plain
//! Burn loop against the accelerated loop, in one process.

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use accelerate_benches::StepBench;
use accelerate_burn::MixedPrecision;
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

/// The accelerated step in f32, bf16 and fp16, and the cost of building the cast view.
fn precision(c: &mut Criterion) {
    let mut group = c.benchmark_group("precision");
    group.sample_size(20);
    for (name, precision) in [
        ("f32", MixedPrecision::No),
        ("bf16", MixedPrecision::Bf16),
        ("fp16", MixedPrecision::Fp16),
    ] {
        let mut bench = StepBench::with_precision(128, precision);
        group.bench_function(format!("step_{name}"), |b| {
            b.iter(|| {
                bench.accelerated_step();
                bench.sync();
            })
        });
        if precision != MixedPrecision::No {
            group.bench_function(format!("cast_view_{name}"), |b| {
                b.iter(|| {
                    bench.cast_view();
                    bench.sync();
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, train_step, precision);
criterion_main!(benches);
