//! AVX2 + F16C versions of the half-precision reductions and conversions, an AVX2 build of the
//! fused Adam update and AVX2 and AVX-512 builds of the GELU: the crate's unsafe code for CPU
//! features (the rest: gemm calls in `matmul`, outputs allocated uncleared by `fresh` for the
//! GELU, layer norm and attention, cubecl launches). Each is entered only through a `try_` wrapper, after [`has_avx2_f16c`] (or the
//! GELU's own check) confirmed the CPU supports it; the helpers carry `#[target_feature]`, so
//! the compiler itself refuses a call from code not compiled for those features. Each computes exactly what its portable twin in `reduce`/`convert` computes (the tests
//! compare them bit for bit on odd lengths).
//!
//! This module sits below the code that dispatches to it: it reads only the leaves it builds
//! for AVX2 ([`element`](crate::element), `gelu::chunk`, `optim::lanes`), and the half-precision
//! loops do the full groups of 8 and return how many they did, leaving the tail to the
//! portable loop of their caller in [`reduce`](crate::reduce).
//!
//! One loop step handles 8 elements: widen both operands to f32 (`vcvtph2ps` for f16, a zero
//! extension and shift for bf16), combine, and narrow once with round-to-nearest-even
//! (`vcvtps2ph`, or integer rounding for bf16). Tails shorter than 8 are left to the caller's
//! portable loop.

#![allow(unsafe_code)]

use std::arch::x86_64::*;
use std::mem::MaybeUninit;
use std::sync::atomic::{AtomicU8, Ordering};

use half::{bf16, f16};

use crate::element::ReduceOp;
use crate::gelu::chunk as gelu;
use crate::optim::lanes::{AdamConstants, Lanes, adam_lanes};

/// True when this CPU has AVX2 and F16C (checked once, then cached).
fn has_avx2_f16c() -> bool {
    static STATE: AtomicU8 = AtomicU8::new(0);
    match STATE.load(Ordering::Relaxed) {
        1 => true,
        2 => false,
        _ => {
            let yes = is_x86_feature_detected!("avx2") && is_x86_feature_detected!("f16c");
            STATE.store(if yes { 1 } else { 2 }, Ordering::Relaxed);
            yes
        }
    }
}

/// The portable Adam update (`optim::adam_lanes`, inlined here) compiled for AVX2: 8 lanes per
/// instruction instead of SSE's 4, for its divisions and square root above all. The same
/// IEEE operations in the same order (no FMA contraction), so the same bits.
#[target_feature(enable = "avx2")]
fn adam_lanes_avx2<const DECOUPLED: bool, const FIRST: bool>(
    lanes: Lanes<'_>,
    grad_scale: f32,
    c: &AdamConstants,
) {
    adam_lanes::<DECOUPLED, FIRST>(lanes, grad_scale, c);
}

/// The portable GELU loop (`gelu::forward_chunk`, inlined) compiled for AVX2 and FMA: the same
/// operations in the same order (its `mul_add`s become FMA instructions), so the same bits, in
/// 8 lanes.
#[target_feature(enable = "avx2,fma")]
fn gelu_forward_avx2(x: &[f32], y: &mut [MaybeUninit<f32>]) {
    gelu::forward_chunk(x, y);
}

/// The portable GELU derivative loop (`gelu::backward_chunk`) compiled for AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
fn gelu_backward_avx2(x: &[f32], dy: &[f32], dx: &mut [MaybeUninit<f32>]) {
    gelu::backward_chunk(x, dy, dx);
}

/// The GELU recomputed with its derivative (`gelu::recompute_backward_chunk`) compiled for
/// AVX2 and FMA.
#[target_feature(enable = "avx2,fma")]
fn gelu_recompute_backward_avx2(x: &[f32], y: &mut [MaybeUninit<f32>], grad: &mut [f32]) {
    gelu::recompute_backward_chunk(x, y, grad);
}

/// The GELU loop compiled for AVX-512 (and FMA): 16 lanes and 32 registers, so the `erfc`
/// polynomial's constants stay in registers (AVX2's 16 cannot hold them and the loop reloads
/// them). The same operations in the same order, so the same bits.
#[target_feature(enable = "avx512f,fma")]
fn gelu_forward_avx512(x: &[f32], y: &mut [MaybeUninit<f32>]) {
    gelu::forward_chunk(x, y);
}

/// The GELU derivative loop compiled for AVX-512 and FMA.
#[target_feature(enable = "avx512f,fma")]
fn gelu_backward_avx512(x: &[f32], dy: &[f32], dx: &mut [MaybeUninit<f32>]) {
    gelu::backward_chunk(x, dy, dx);
}

/// The GELU recomputed with its derivative, compiled for AVX-512 and FMA.
#[target_feature(enable = "avx512f,fma")]
fn gelu_recompute_backward_avx512(x: &[f32], y: &mut [MaybeUninit<f32>], grad: &mut [f32]) {
    gelu::recompute_backward_chunk(x, y, grad);
}

/// The widest vector build of the GELU loops this CPU runs (checked once, then cached).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum GeluBuild {
    Avx512,
    Avx2,
    Portable,
}

fn gelu_build() -> GeluBuild {
    static STATE: AtomicU8 = AtomicU8::new(0);
    match STATE.load(Ordering::Relaxed) {
        1 => GeluBuild::Avx512,
        2 => GeluBuild::Avx2,
        3 => GeluBuild::Portable,
        _ => {
            // Every vector build fuses its multiply-adds: without FMA the portable loop runs.
            let fma = is_x86_feature_detected!("fma");
            let build = if fma && is_x86_feature_detected!("avx512f") {
                GeluBuild::Avx512
            } else if fma && has_avx2_f16c() {
                GeluBuild::Avx2
            } else {
                GeluBuild::Portable
            };
            let code = match build {
                GeluBuild::Avx512 => 1,
                GeluBuild::Avx2 => 2,
                GeluBuild::Portable => 3,
            };
            STATE.store(code, Ordering::Relaxed);
            build
        }
    }
}

/// Runs the GELU in the widest vector build the CPU has (true); false: the caller runs the
/// portable loop.
pub(crate) fn try_gelu_forward(x: &[f32], y: &mut [MaybeUninit<f32>]) -> bool {
    match gelu_build() {
        // SAFETY: the CPU has AVX-512F and FMA (checked by `gelu_build`), the callee's requirements.
        GeluBuild::Avx512 => unsafe { gelu_forward_avx512(x, y) },
        // SAFETY: the CPU has AVX2 and FMA (checked by `gelu_build`), the callee's requirements.
        GeluBuild::Avx2 => unsafe { gelu_forward_avx2(x, y) },
        GeluBuild::Portable => return false,
    }
    true
}

/// Runs the GELU derivative in the widest vector build, as [`try_gelu_forward`].
pub(crate) fn try_gelu_backward(x: &[f32], dy: &[f32], dx: &mut [MaybeUninit<f32>]) -> bool {
    match gelu_build() {
        // SAFETY: the CPU has AVX-512F and FMA (checked by `gelu_build`), the callee's requirements.
        GeluBuild::Avx512 => unsafe { gelu_backward_avx512(x, dy, dx) },
        // SAFETY: the CPU has AVX2 and FMA (checked by `gelu_build`), the callee's requirements.
        GeluBuild::Avx2 => unsafe { gelu_backward_avx2(x, dy, dx) },
        GeluBuild::Portable => return false,
    }
    true
}

/// Runs the GELU and its derivative in one pass in the widest vector build, as
/// [`try_gelu_forward`].
pub(crate) fn try_gelu_recompute_backward(
    x: &[f32],
    y: &mut [MaybeUninit<f32>],
    grad: &mut [f32],
) -> bool {
    match gelu_build() {
        // SAFETY: the CPU has AVX-512F and FMA (checked by `gelu_build`), the callee's requirements.
        GeluBuild::Avx512 => unsafe { gelu_recompute_backward_avx512(x, y, grad) },
        // SAFETY: the CPU has AVX2 and FMA (checked by `gelu_build`), the callee's requirements.
        GeluBuild::Avx2 => unsafe { gelu_recompute_backward_avx2(x, y, grad) },
        GeluBuild::Portable => return false,
    }
    true
}

/// Runs the Adam update on AVX2 when the CPU has it (`None`); hands the chunk back otherwise.
pub(crate) fn try_adam_lanes<'a, const DECOUPLED: bool, const FIRST: bool>(
    lanes: Lanes<'a>,
    grad_scale: f32,
    c: &AdamConstants,
) -> Option<Lanes<'a>> {
    if !has_avx2_f16c() {
        return Some(lanes);
    }
    // SAFETY: the CPU has AVX2 (checked above), the one requirement of the callee.
    unsafe { adam_lanes_avx2::<DECOUPLED, FIRST>(lanes, grad_scale, c) };
    None
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn combine(op: ReduceOp, a: __m256, b: __m256) -> __m256 {
    // `vmaxps`/`vminps` return the second operand when either is NaN; where `b` is NaN take
    // `a` instead, which gives f32::max/min's rule: a NaN loses to a number.
    let b_is_nan = _mm256_cmp_ps::<_CMP_UNORD_Q>(b, b);
    match op {
        ReduceOp::Sum => _mm256_add_ps(a, b),
        ReduceOp::Max => _mm256_blendv_ps(_mm256_max_ps(a, b), a, b_is_nan),
        ReduceOp::Min => _mm256_blendv_ps(_mm256_min_ps(a, b), a, b_is_nan),
    }
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn f16_widen(v: __m128i) -> __m256 {
    _mm256_cvtph_ps(v)
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn f16_narrow(v: __m256) -> __m128i {
    _mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(v)
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
fn bf16_widen(v: __m128i) -> __m256 {
    _mm256_castsi256_ps(_mm256_slli_epi32::<16>(_mm256_cvtepu16_epi32(v)))
}

#[inline]
#[target_feature(enable = "avx2,f16c")]
pub(crate) fn bf16_narrow(v: __m256) -> __m128i {
    let bits = _mm256_castps_si256(v);
    // Round to nearest even: add 0x7fff plus the lowest kept bit, then drop 16 bits.
    let odd = _mm256_and_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(1));
    let rounded = _mm256_srli_epi32::<16>(_mm256_add_epi32(
        bits,
        _mm256_add_epi32(odd, _mm256_set1_epi32(0x7fff)),
    ));
    // NaN: keep the top half, quieted.
    let nan = _mm256_or_si256(_mm256_srli_epi32::<16>(bits), _mm256_set1_epi32(0x40));
    let is_nan = _mm256_castps_si256(_mm256_cmp_ps::<_CMP_UNORD_Q>(v, v));
    let out = _mm256_blendv_epi8(rounded, nan, is_nan);
    // Pack the eight 32-bit lanes (each < 65536) into 16-bit lanes, in order.
    let packed = _mm256_packus_epi32(out, out);
    _mm256_castsi256_si128(_mm256_permute4x64_epi64::<0b1000>(packed))
}

// Registers are read from and written to arrays of their size by value (`transmute`), not
// with `_mm*_loadu_*`/`_mm*_storeu_*`: those copy through memory with an asserted
// `copy_nonoverlapping`, which the dev profile (debug assertions on, as the README's commands
// build) keeps, so each load became a store and a reload on the stack beside its checks
// (measured: more than half of the f16 widening's samples, a sixth of the products').

/// 8 f32 as one register.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn f32x8(values: &[f32; 8]) -> __m256 {
    // SAFETY: both are 32 bytes of plain bits; every bit pattern is valid for both.
    unsafe { std::mem::transmute::<[f32; 8], __m256>(*values) }
}

/// A register as 8 f32.
#[inline]
#[target_feature(enable = "avx")]
pub(crate) fn f32s(v: __m256) -> [f32; 8] {
    // SAFETY: as in `f32x8`, the other way.
    unsafe { std::mem::transmute::<__m256, [f32; 8]>(v) }
}

/// 8 half-precision values (their bits) as one register.
#[inline]
fn bits8(values: &[u16; 8]) -> __m128i {
    // SAFETY: both are 16 bytes of plain bits; every bit pattern is valid for both.
    unsafe { std::mem::transmute::<[u16; 8], __m128i>(*values) }
}

/// A register as 8 half-precision values' bits.
#[inline]
fn halves(v: __m128i) -> [u16; 8] {
    // SAFETY: as in `bits8`, the other way.
    unsafe { std::mem::transmute::<__m128i, [u16; 8]>(v) }
}

/// `f(acc[i..i+8], other[i..i+8])` stored into `acc` for every full group of 8 elements;
/// returns how many elements were done (the caller finishes the tail).
#[inline(always)]
fn combine_lanes(acc: &mut [u16], other: &[u16], f: impl Fn(__m128i, __m128i) -> __m128i) -> usize {
    let (acc, other) = (acc.as_chunks_mut::<8>().0, other.as_chunks::<8>().0);
    for (a, b) in acc.iter_mut().zip(other) {
        *a = halves(f(bits8(a), bits8(b)));
    }
    8 * acc.len().min(other.len())
}

/// `values[i..i+8] = f(values[i..i+8])` for every full group of 8 elements; returns how many
/// elements were done (the caller finishes the tail).
#[inline(always)]
fn map_lanes(values: &mut [u16], f: impl Fn(__m128i) -> __m128i) -> usize {
    let values = values.as_chunks_mut::<8>().0;
    for v in values.iter_mut() {
        *v = halves(f(bits8(v)));
    }
    8 * values.len()
}

/// `acc[i] = op(acc[i], other[i])` on f16 values, combined in f32 and rounded once.
/// Only the full groups of 8 elements: returns how many it did (the caller does the rest).
///
/// # Safety
///
/// The CPU must support AVX2 and F16C (see `has_avx2_f16c`).
#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce_f16_avx2(acc: &mut [f16], other: &[f16], op: ReduceOp) -> usize {
    combine_lanes(as_bits_mut(acc), as_bits(other), |x, y| {
        f16_narrow(combine(op, f16_widen(x), f16_widen(y)))
    })
}

/// `acc[i] = op(acc[i], other[i])` on bf16 values, combined in f32 and rounded once.
/// Only the full groups of 8 elements: returns how many it did (the caller does the rest).
///
/// # Safety
///
/// The CPU must support AVX2 (see `has_avx2_f16c`).
#[target_feature(enable = "avx2,f16c")]
unsafe fn reduce_bf16_avx2(acc: &mut [bf16], other: &[bf16], op: ReduceOp) -> usize {
    combine_lanes(as_bits_mut(acc), as_bits(other), |x, y| {
        bf16_narrow(combine(op, bf16_widen(x), bf16_widen(y)))
    })
}

/// Multiplies f16 values by `factor` in f32, rounding once.
/// Only the full groups of 8 elements: returns how many it did (the caller does the rest).
///
/// # Safety
///
/// The CPU must support AVX2 and F16C (see `has_avx2_f16c`).
#[target_feature(enable = "avx2,f16c")]
unsafe fn scale_f16_avx2(values: &mut [f16], factor: f32) -> usize {
    let f = _mm256_set1_ps(factor);
    map_lanes(as_bits_mut(values), |x| {
        f16_narrow(_mm256_mul_ps(f16_widen(x), f))
    })
}

/// Multiplies bf16 values by `factor` in f32, rounding once.
/// Only the full groups of 8 elements: returns how many it did (the caller does the rest).
///
/// # Safety
///
/// The CPU must support AVX2 (see `has_avx2_f16c`).
#[target_feature(enable = "avx2,f16c")]
unsafe fn scale_bf16_avx2(values: &mut [bf16], factor: f32) -> usize {
    let f = _mm256_set1_ps(factor);
    map_lanes(as_bits_mut(values), |x| {
        bf16_narrow(_mm256_mul_ps(bf16_widen(x), f))
    })
}

fn as_bits<T: bytemuck::Pod>(values: &[T]) -> &[u16] {
    bytemuck::cast_slice(values)
}

fn as_bits_mut<T: bytemuck::Pod>(values: &mut [T]) -> &mut [u16] {
    bytemuck::cast_slice_mut(values)
}

/// Runs the AVX2 + F16C `reduce` on the full groups of 8 f16 values when the CPU has them;
/// returns how many elements it did (0 without them): the caller's portable loop does the rest.
pub(crate) fn reduce_f16_lanes(acc: &mut [f16], other: &[f16], op: ReduceOp) -> usize {
    if !has_avx2_f16c() {
        return 0;
    }
    // SAFETY: the CPU supports AVX2 and F16C (checked above).
    unsafe { reduce_f16_avx2(acc, other, op) }
}

/// As [`reduce_f16_lanes`], for bf16.
pub(crate) fn reduce_bf16_lanes(acc: &mut [bf16], other: &[bf16], op: ReduceOp) -> usize {
    if !has_avx2_f16c() {
        return 0;
    }
    // SAFETY: the CPU supports AVX2 and F16C (checked above).
    unsafe { reduce_bf16_avx2(acc, other, op) }
}

/// Scales the full groups of 8 f16 values on AVX2 + F16C when the CPU has them; returns how
/// many elements it did, as [`reduce_f16_lanes`].
pub(crate) fn scale_f16_lanes(values: &mut [f16], factor: f32) -> usize {
    if !has_avx2_f16c() {
        return 0;
    }
    // SAFETY: the CPU supports AVX2 and F16C (checked above).
    unsafe { scale_f16_avx2(values, factor) }
}

/// As [`scale_f16_lanes`], for bf16.
pub(crate) fn scale_bf16_lanes(values: &mut [bf16], factor: f32) -> usize {
    if !has_avx2_f16c() {
        return 0;
    }
    // SAFETY: the CPU supports AVX2 and F16C (checked above).
    unsafe { scale_bf16_avx2(values, factor) }
}

/// Widens the full groups of 8 f16 values of `src` into `dst` (as long) with F16C when the
/// CPU has it; returns how many it did (0 without): the caller converts the rest.
pub(crate) fn widen_f16_lanes(src: &[f16], dst: &mut [f32]) -> usize {
    if !has_avx2_f16c() {
        return 0;
    }
    // SAFETY: the CPU supports AVX2 and F16C (checked above).
    unsafe { widen_f16_f16c(as_bits(src), dst) }
}

/// `dst[i] = src[i]` widened, 8 values per `vcvtph2ps`; returns how many it did.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C (see `has_avx2_f16c`).
#[target_feature(enable = "avx2,f16c")]
unsafe fn widen_f16_f16c(src: &[u16], dst: &mut [f32]) -> usize {
    let (src, dst) = (src.as_chunks::<8>().0, dst.as_chunks_mut::<8>().0);
    for (s, d) in src.iter().zip(dst.iter_mut()) {
        *d = f32s(f16_widen(bits8(s)));
    }
    8 * src.len().min(dst.len())
}

/// `out[i] = row[i] + bias[i]` (or `row[i]`) rounded to f16 for the full groups of 8 values
/// with F16C when the CPU has it, read straight from `row` (a product's tile) and written
/// once; returns how many it did (0 without): the caller rounds the rest.
pub(crate) fn store_f16_lanes(
    row: &[f32],
    bias: Option<&[f32]>,
    out: &mut [MaybeUninit<f16>],
) -> usize {
    if !has_avx2_f16c() {
        return 0;
    }
    // SAFETY: the CPU supports AVX2 and F16C (checked above).
    unsafe { store_f16_f16c(row, bias, out) }
}

/// [`store_f16_lanes`]' loop: one `vaddps` and one `vcvtps2ph` per 8 values.
///
/// # Safety
///
/// The CPU must support AVX2 and F16C (see `has_avx2_f16c`).
#[target_feature(enable = "avx2,f16c")]
unsafe fn store_f16_f16c(row: &[f32], bias: Option<&[f32]>, out: &mut [MaybeUninit<f16>]) -> usize {
    let n = row
        .len()
        .min(out.len())
        .min(bias.map_or(usize::MAX, <[f32]>::len));
    let body = n - n % 8;
    let rows = row[..body].as_chunks::<8>().0;
    let outs = out[..body].as_chunks_mut::<8>().0;
    let biases = bias.map(|bias| bias[..body].as_chunks::<8>().0);
    for (i, (r, o)) in rows.iter().zip(outs.iter_mut()).enumerate() {
        let mut v = f32x8(r);
        if let Some(bias) = biases.and_then(|biases| biases.get(i)) {
            v = _mm256_add_ps(v, f32x8(bias));
        }
        // SAFETY: 16 bytes of f16 bits, and `MaybeUninit<f16>` has f16's layout.
        *o = unsafe {
            std::mem::transmute::<[u16; 8], [MaybeUninit<f16>; 8]>(halves(f16_narrow(v)))
        };
    }
    body
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::fresh::written_by;
    use crate::test_support::{bits, uniform};

    /// The three GELU loops of one build on `x` and `dy`: output, derivative, and the one-pass
    /// recomputation's output and gradient, as bit patterns.
    type Gelu = fn(&[f32], &[f32]) -> [Vec<u32>; 4];

    /// The loops `forward`, `backward` and `recompute` of one build, run on `x` and `dy`.
    fn outputs(
        x: &[f32],
        dy: &[f32],
        forward: impl Fn(&[f32], &mut [MaybeUninit<f32>]),
        backward: impl Fn(&[f32], &[f32], &mut [MaybeUninit<f32>]),
        recompute: impl Fn(&[f32], &mut [MaybeUninit<f32>], &mut [f32]),
    ) -> [Vec<u32>; 4] {
        let n = x.len();
        let mut grad = dy.to_vec();
        // SAFETY: each loop writes every element of its output (as long as its input).
        let (y, dx, ry) = unsafe {
            (
                written_by(n, |y| forward(x, y)),
                written_by(n, |dx| backward(x, dy, dx)),
                written_by(n, |ry| recompute(x, ry, &mut grad)),
            )
        };
        [bits(&y), bits(&dx), bits(&ry), bits(&grad)]
    }

    fn portable(x: &[f32], dy: &[f32]) -> [Vec<u32>; 4] {
        outputs(
            x,
            dy,
            gelu::forward_chunk,
            gelu::backward_chunk,
            gelu::recompute_backward_chunk,
        )
    }

    fn avx2(x: &[f32], dy: &[f32]) -> [Vec<u32>; 4] {
        // SAFETY (each call): only run where the CPU has AVX2 and FMA (checked by the test).
        outputs(
            x,
            dy,
            |x, y| unsafe { gelu_forward_avx2(x, y) },
            |x, dy, dx| unsafe { gelu_backward_avx2(x, dy, dx) },
            |x, y, grad| unsafe { gelu_recompute_backward_avx2(x, y, grad) },
        )
    }

    fn avx512(x: &[f32], dy: &[f32]) -> [Vec<u32>; 4] {
        // SAFETY (each call): only run where the CPU has AVX-512F and FMA (checked by the test).
        outputs(
            x,
            dy,
            |x, y| unsafe { gelu_forward_avx512(x, y) },
            |x, dy, dx| unsafe { gelu_backward_avx512(x, dy, dx) },
            |x, y, grad| unsafe { gelu_recompute_backward_avx512(x, y, grad) },
        )
    }

    /// Every GELU build this CPU can run (AVX-512, AVX2) gives the portable loop's bits, so a
    /// machine that takes another path trains to the same numbers.
    #[test]
    fn every_gelu_build_gives_the_portable_bits() {
        let run = |build: Gelu, x: &[f32], dy: &[f32]| build(x, dy);
        for n in [1, 15, 16, 17, 1000] {
            let (x, dy) = (uniform(n, 31, 6.0), uniform(n, 32, 1.0));
            let want = run(portable, &x, &dy);
            let fma = is_x86_feature_detected!("fma");
            let builds: [(&str, bool, Gelu); 2] = [
                ("avx2", fma && is_x86_feature_detected!("avx2"), avx2),
                ("avx512", fma && is_x86_feature_detected!("avx512f"), avx512),
            ];
            for (name, _, build) in builds.into_iter().filter(|(_, has, _)| *has) {
                assert_eq!(run(build, &x, &dy), want, "{name}, {n} values");
            }
        }
    }
}
