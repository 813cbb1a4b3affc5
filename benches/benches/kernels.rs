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

/// The three products of a linear layer 256 -> 768 over 4,096 tokens (the transformer
/// example's QKV shapes), bf16 operands into f32: forward `x W`, input gradient `dY W^T`,
/// weight gradient `X^T dY`; on each path this CPU can take (AMX tiles, `vdpbf16ps`, AVX-512
/// or AVX2 FMAs on widened panels, widened then the f32 product), f16 operands on the path
/// this CPU gives them (fp16 autocast's products), and the f32 product of the same shapes.
/// Throughput counts 2 flops per multiply-add.
fn matmul_bf16(c: &mut Criterion) {
    use accelerate_kernels::bf16_matmul::{Bf16Mat, Bf16Path, F16Mat, matmul_bf16_on, matmul_f16};
    use accelerate_kernels::linear::{Weight, forward, input_grad, weight_grad};
    let (tokens, d_in, d_out) = (4096usize, 256usize, 768usize);
    let value = |i: usize| ((i * 7919 % 1000) as f32 - 500.0) * 1e-3;
    let x32: Vec<f32> = (0..tokens * d_in).map(value).collect();
    let w32: Vec<f32> = (0..d_in * d_out).map(|i| value(i + 3)).collect();
    let dy32: Vec<f32> = (0..tokens * d_out).map(|i| value(i + 5)).collect();
    let half = |v: &[f32]| -> Vec<bf16> { v.iter().map(|&x| bf16::from_f32(x)).collect() };
    let (x, w, dy) = (half(&x32), half(&w32), half(&dy32));
    let mut group = c.benchmark_group("matmul_bf16_linear_256_768_4096");
    group.sample_size(20);
    group.throughput(Throughput::Elements((2 * tokens * d_in * d_out) as u64));
    for path in [
        Bf16Path::Amx,
        Bf16Path::Avx512Bf16,
        Bf16Path::Avx512,
        Bf16Path::Avx2,
        Bf16Path::Widened,
    ] {
        if !path.available() {
            continue;
        }
        let name = format!("{path:?}");
        group.bench_function(format!("{name}/forward"), |b| {
            b.iter(|| {
                matmul_bf16_on(
                    path,
                    Bf16Mat::row_major(black_box(&x), tokens, d_in),
                    Bf16Mat::row_major(&w, d_in, d_out),
                )
            })
        });
        group.bench_function(format!("{name}/input_grad"), |b| {
            b.iter(|| {
                matmul_bf16_on(
                    path,
                    Bf16Mat::row_major(black_box(&dy), tokens, d_out),
                    Bf16Mat::row_major(&w, d_in, d_out).t(),
                )
            })
        });
        group.bench_function(format!("{name}/weight_grad"), |b| {
            b.iter(|| {
                matmul_bf16_on(
                    path,
                    Bf16Mat::row_major(black_box(&x), tokens, d_in).t(),
                    Bf16Mat::row_major(&dy, tokens, d_out),
                )
            })
        });
    }
    let f16s = |v: &[f32]| -> Vec<f16> { v.iter().map(|&x| f16::from_f32(x)).collect() };
    let (x16, w16, dy16) = (f16s(&x32), f16s(&w32), f16s(&dy32));
    group.bench_function("f16/forward", |b| {
        b.iter(|| {
            matmul_f16(
                F16Mat::row_major(black_box(&x16), tokens, d_in),
                F16Mat::row_major(&w16, d_in, d_out),
            )
        })
    });
    group.bench_function("f16/input_grad", |b| {
        b.iter(|| {
            matmul_f16(
                F16Mat::row_major(black_box(&dy16), tokens, d_out),
                F16Mat::row_major(&w16, d_in, d_out).t(),
            )
        })
    });
    group.bench_function("f16/weight_grad", |b| {
        b.iter(|| {
            matmul_f16(
                F16Mat::row_major(black_box(&x16), tokens, d_in).t(),
                F16Mat::row_major(&dy16, tokens, d_out),
            )
        })
    });
    let weight = Weight::rows_of(&w32, d_in, d_out);
    group.bench_function("f32/forward", |b| {
        b.iter(|| forward(black_box(&x32), weight, None))
    });
    group.bench_function("f32/input_grad", |b| {
        b.iter(|| input_grad(black_box(&dy32), weight))
    });
    group.bench_function("f32/weight_grad", |b| {
        b.iter(|| weight_grad(black_box(&x32), &dy32, d_in, d_out))
    });
    group.finish();
}

criterion_group!(benches, kernels, reductions, unscale, matmul_bf16);
criterion_main!(benches);
