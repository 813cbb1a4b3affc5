//! Throughput of the flat-buffer kernels in GB/s (bytes read, plus bytes written for scaling).

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use accelerate_kernels::{scale_in_place, sum_of_squares};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};
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

criterion_group!(benches, kernels);
criterion_main!(benches);
