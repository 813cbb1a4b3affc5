//! The FMA paths' packing of runs along `k`: each block of 8 runs x 8 steps widened to f32 in
//! registers (F16C for f16, a shift for bf16) and transposed with AVX2 shuffles, so that the
//! panel's lanes `out[s * width + i]` are written 8 at a time. Placing one value at a time
//! from `width` streams, after a separate widening pass for f16, was most of the fp16 step's
//! packing (RESULTS, issue 60 part seven). A lane holds exactly the value `to_f32` gives, so
//! the bits of every product are unchanged.
//!
//! The crate's unsafe code for it: the call into the feature-gated function once the CPU was
//! checked, and that function's unaligned loads and stores, inside bounds asserted first.

#![allow(unsafe_code)]

use std::any::TypeId;
use std::arch::x86_64::*;

use half::f16;

use super::HalfElement;
use crate::isa::{Isa, detected};

/// Runs and steps of one block.
const BLOCK: usize = 8;

/// Writes `out[s * width + i]` = run `i`'s value `s` widened (its f32 bits) for the runs in
/// whole groups of 8 and the steps in whole blocks of 8, where the CPU has AVX2 and F16C;
/// returns how many runs and steps it did (each a multiple of 8; (0, 0) without AVX2): the
/// caller places the rest.
///
/// # Panics
/// When `out` has fewer than `steps` steps of `width` lanes, `width` is less than the number
/// of runs, or a run is shorter than `steps`.
pub(super) fn place_widened<T: HalfElement>(
    out: &mut [u32],
    width: usize,
    runs: &[&[T]],
    steps: usize,
) -> (usize, usize) {
    let runs_done = runs.len() / BLOCK * BLOCK;
    let steps_done = steps / BLOCK * BLOCK;
    if runs_done == 0 || steps_done == 0 || detected() < Isa::Avx2 {
        return (0, 0);
    }
    assert!(runs.len() <= width && out.len() >= steps * width);
    assert!(runs.iter().all(|run| run.len() >= steps));
    let is_f16 = TypeId::of::<T>() == TypeId::of::<f16>();
    for (group, runs) in runs[..runs_done].chunks_exact(BLOCK).enumerate() {
        let bits: [&[u16]; BLOCK] = std::array::from_fn(|i| bytemuck::cast_slice(runs[i]));
        // SAFETY: the CPU has AVX2 and F16C (`detected`); the block's reads end at step
        // `steps_done <= steps` of runs at least `steps` long, and its writes at lane
        // `(steps_done - 1) * width + group * 8 + 8 <= steps * width <= out.len()`
        // (asserted above: the runs fit in `width`).
        unsafe { place_group(out, width, group * BLOCK, &bits, steps_done, is_f16) };
    }
    (runs_done, steps_done)
}

/// The 8 runs `bits` (f16 or bf16 bits) of lanes `first..first + 8`, steps `0..steps` (a
/// multiple of 8).
///
/// # Safety
/// The CPU must have AVX2 and F16C; every run must hold `steps` values, and `out` at least
/// `(steps - 1) * width + first + 8` lanes.
#[target_feature(enable = "avx2,f16c")]
unsafe fn place_group(
    out: &mut [u32],
    width: usize,
    first: usize,
    bits: &[&[u16]; BLOCK],
    steps: usize,
    is_f16: bool,
) {
    let widen = |run: &[u16], s: usize| -> __m256 {
        // SAFETY: `s + 8 <= steps <= run.len()` (the caller's contract): 16 bytes in bounds.
        let halves = unsafe { _mm_loadu_si128(run.as_ptr().add(s).cast()) };
        if is_f16 {
            _mm256_cvtph_ps(halves)
        } else {
            // bf16 is the top half of an f32.
            _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(halves)))
        }
    };
    let out = out.as_mut_ptr().cast::<f32>();
    for s in (0..steps).step_by(BLOCK) {
        let rows: [__m256; BLOCK] = std::array::from_fn(|i| widen(bits[i], s));
        for (j, column) in transpose(rows).into_iter().enumerate() {
            // SAFETY: lane `(s + j) * width + first + 8 <= (steps - 1) * width + first + 8`,
            // within `out` (the caller's contract); u32 and f32 have one size and alignment.
            unsafe { _mm256_storeu_ps(out.add((s + j) * width + first), column) };
        }
    }
}

/// The 8 x 8 transpose: lane `i` of the result's register `j` is lane `j` of `rows[i]`.
#[inline]
#[target_feature(enable = "avx2")]
fn transpose(r: [__m256; BLOCK]) -> [__m256; BLOCK] {
    let t0 = _mm256_unpacklo_ps(r[0], r[1]);
    let t1 = _mm256_unpackhi_ps(r[0], r[1]);
    let t2 = _mm256_unpacklo_ps(r[2], r[3]);
    let t3 = _mm256_unpackhi_ps(r[2], r[3]);
    let t4 = _mm256_unpacklo_ps(r[4], r[5]);
    let t5 = _mm256_unpackhi_ps(r[4], r[5]);
    let t6 = _mm256_unpacklo_ps(r[6], r[7]);
    let t7 = _mm256_unpackhi_ps(r[6], r[7]);
    let u0 = _mm256_shuffle_ps::<0x44>(t0, t2);
    let u1 = _mm256_shuffle_ps::<0xEE>(t0, t2);
    let u2 = _mm256_shuffle_ps::<0x44>(t1, t3);
    let u3 = _mm256_shuffle_ps::<0xEE>(t1, t3);
    let u4 = _mm256_shuffle_ps::<0x44>(t4, t6);
    let u5 = _mm256_shuffle_ps::<0xEE>(t4, t6);
    let u6 = _mm256_shuffle_ps::<0x44>(t5, t7);
    let u7 = _mm256_shuffle_ps::<0xEE>(t5, t7);
    [
        _mm256_permute2f128_ps::<0x20>(u0, u4),
        _mm256_permute2f128_ps::<0x20>(u1, u5),
        _mm256_permute2f128_ps::<0x20>(u2, u6),
        _mm256_permute2f128_ps::<0x20>(u3, u7),
        _mm256_permute2f128_ps::<0x31>(u0, u4),
        _mm256_permute2f128_ps::<0x31>(u1, u5),
        _mm256_permute2f128_ps::<0x31>(u2, u6),
        _mm256_permute2f128_ps::<0x31>(u3, u7),
    ]
}
