//! Throughput of the flat-buffer kernels in GB/s (bytes read, plus bytes written for scaling).

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use accelerate_kernels::amp::unscale_and_check;
use accelerate_kernels::reduce::{reduce_bf16, reduce_f16, reduce_f32};
use accelerate_kernels::{ReduceOp, scale_in_place, sum_of_squares};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use half::{bf16, f16};
use std::hint::black_box;

fn kernels(c: &mut Criterion) {
    let mut group = c.benchmark_group("kernels");
    for elements in [1usize << 16, 1 << 21, 1 << 24] {
        let mut values: Vec<f32> = (0..elements).map(|i| (i % 97) as f32 * 0.01).collect();
        let bytes = (elements * 4) as u64;
        group.throughput(Throughput::Bytes(bytes));
        group.bench_function(format!("sum_of_squares/{elements}"), |b| {
            b.iter(|| black_box(sum_of_squares(black_box(&values))))
        });
        group.throughput(Throughput::Bytes(2 * bytes));
        group.bench_function(format!("scale_in_place/{elements}"), |b| {
            b.iter(|| scale_in_place(black_box(&mut values), black_box(1.0)))
        });
    }
    group.finish();
}

/// Sum of two 16 MiB operands (beyond L2, mostly within this machine's L3), per dtype:
/// bytes counted are both operands read plus the result written.
fn reductions(c: &mut Criterion) {
    let mut group = c.benchmark_group("reduce_sum_16MiB");
    let bytes = 16usize << 20;
    group.throughput(Throughput::Bytes(3 * bytes as u64));
    let n32 = bytes / 4;
    let (mut a, b) = (vec![1.0_f32; n32], vec![0.0_f32; n32]);
    group.bench_function("f32", |bench| {
        bench.iter(|| reduce_f32(black_box(&mut a), black_box(&b), ReduceOp::Sum))
    });
    let n16 = bytes / 2;
    let (mut a, b) = (vec![f16::ONE; n16], vec![f16::ZERO; n16]);
    group.bench_function("f16", |bench| {
        bench.iter(|| reduce_f16(black_box(&mut a), black_box(&b), ReduceOp::Sum))
    });
    let (mut a, b) = (vec![bf16::ONE; n16], vec![bf16::ZERO; n16]);
    group.bench_function("bf16", |bench| {
        bench.iter(|| reduce_bf16(black_box(&mut a), black_box(&b), ReduceOp::Sum))
    });
    group.finish();
}

/// The fused unscale-and-check pass of fp16 training over 16 MiB of f32 gradients (bytes read
/// plus bytes written).
fn unscale(c: &mut Criterion) {
    let mut group = c.benchmark_group("amp");
    let mut grads = vec![1.0_f32; 4 << 20];
    group.throughput(Throughput::Bytes(2 * 4 * grads.len() as u64));
    group.bench_function("unscale_and_check_16MiB", |b| {
        b.iter(|| black_box(unscale_and_check(black_box(&mut grads), 1.0)))
    });
    group.finish();
}

criterion_group!(benches, kernels, reductions, unscale);
criterion_main!(benches);
