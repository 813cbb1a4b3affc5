//! What the kernels' tests share: reproducible data, bit patterns, and the same computation on
//! one, two and three threads.

use std::fmt::Debug;

/// `n` values spread over `[-half_width, half_width)` on a grid of 20,000 steps, from an
/// xorshift stream seeded by `seed` (the same values on every run and machine).
pub(crate) fn uniform(n: usize, seed: u32, half_width: f32) -> Vec<f32> {
    let mut s = seed.wrapping_mul(2_654_435_761).wrapping_add(1);
    let step = 10_000.0 / half_width;
    (0..n)
        .map(|_| {
            s ^= s << 13;
            s ^= s >> 17;
            s ^= s << 5;
            (s % 20_000) as f32 / step - half_width
        })
        .collect()
}

/// The bit patterns of `values`, for comparisons that mean "the same bits".
pub(crate) fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Runs `run` in rayon pools of 1, 2 and 3 threads and asserts the three results are equal.
pub(crate) fn assert_same_on_1_2_3_threads<R: PartialEq + Debug + Send>(
    run: impl Fn() -> R + Sync,
) {
    let on = |threads: usize| {
        rayon::ThreadPoolBuilder::new()
            .num_threads(threads)
            .build()
            .unwrap()
            .install(&run)
    };
    let one = on(1);
    assert_eq!(on(2), one);
    assert_eq!(on(3), one);
}
