//! The microkernel of the AVX512_BF16 path: one 24 x 16 tile of `c` from a panel of 24 rows of
//! `a` and a panel of 16 columns of `b`, both packed in pairs along `k`. Per pair of `k`: one
//! load of `b`'s 16 pairs, and for each of the 24 rows one `vdpbf16ps` of its pair, broadcast,
//! into 24 f32 accumulators that stay in registers (of 32) for the whole `k`.
//! The panels are read one step at a time as arrays (`[u32; 24]` of `a`, `[u32; 16]` of `b`),
//! so the loops hold no index checks and no asserted pointer arithmetic, in the dev profile
//! too. The crate's unsafe code for this path: the tiles' stores (their contract checked by
//! `super::store_tile`), a register transmuted from an array of its size, and the calls into
//! the feature-gated functions after the CPU was checked.

#![allow(unsafe_code)]

use std::any::TypeId;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use half::{bf16, f16};

use super::{Bf16Path, MR, NR};
use crate::element::Element;

/// The tile `a_panel b_panel` (`steps` steps along `k`) into `tile` (row-major, `MR x NR`),
/// with `path`'s microkernel: `vdpbf16ps` on pairs, or FMAs on f32 lanes.
///
/// # Panics
/// When a panel is shorter than `steps` steps, or the CPU cannot run the path (the callers
/// checked both: a path is only chosen where it is available).
pub(super) fn tile(
    path: Bf16Path,
    a_panel: &[u32],
    b_panel: &[u32],
    steps: usize,
    tile: &mut [f32; MR * NR],
) {
    assert!(a_panel.len() >= steps * MR && b_panel.len() >= steps * NR);
    assert!(path.available(), "the {path:?} tile on a CPU without it");
    match path {
        // SAFETY: the CPU has AVX-512F and AVX512_BF16 (asserted above).
        Bf16Path::Avx512Bf16 => unsafe { tile_avx512(a_panel, b_panel, steps, tile) },
        // SAFETY: the CPU has AVX-512F (asserted above).
        _ => unsafe { tile_fma(a_panel, b_panel, steps, tile) },
    }
}

/// A whole tile (rows of `NR` f32) plus `bias` (its `NR` columns' values) rounded once
/// to `O` into `rows`: row `i` at `rows.add(i * stride)`, `NR` values. One vector load, add,
/// conversion and store per row (f16 by `vcvtps2ph`, bf16 by integer rounding to nearest
/// even, NaN kept quiet), where rounding value by value cost the fp16 step 9 % of its time
/// (measured). Reached through `super::store_tile`, which checks the contract.
///
/// # Safety
/// The CPU must have AVX-512F; `rows` must be valid for writes of
/// `(tile.len() - 1) * stride + NR` values of `O`, and `bias` hold at least `NR` values.
#[target_feature(enable = "avx512f")]
pub(super) unsafe fn store_tile<O: Element>(
    tile: &[[f32; NR]],
    rows: *mut MaybeUninit<O>,
    stride: usize,
    bias: Option<&[f32]>,
) {
    let bias = bias.map(|bias| f32x16(&bias[..NR].as_chunks::<NR>().0[0]));
    let is = |t: TypeId| TypeId::of::<O>() == t;
    for (i, row) in tile.iter().enumerate() {
        let mut v = f32x16(row);
        if let Some(bias) = bias {
            v = _mm512_add_ps(v, bias);
        }
        // SAFETY (the stores): row `i < tile.len()` of `rows` starts at `i * stride` and holds NR
        // values of `O` (the caller's contract); `O` is the type its id says, whose size is
        // the store's: 64 bytes of f32, 32 of f16 or bf16.
        unsafe {
            let out = rows.add(i * stride);
            if is(TypeId::of::<f32>()) {
                _mm512_storeu_ps(out.cast(), v);
            } else if is(TypeId::of::<f16>()) {
                let half = _mm512_cvtps_ph::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(v);
                _mm256_storeu_si256(out.cast(), half);
            } else if is(TypeId::of::<bf16>()) {
                _mm256_storeu_si256(out.cast(), bf16_round(v));
            } else {
                let mut wide = [0.0f32; NR];
                _mm512_storeu_ps(wide.as_mut_ptr(), v);
                for (j, w) in wide.into_iter().enumerate() {
                    (*out.add(j)).write(O::from_f32(w));
                }
            }
        }
    }
}

/// 16 f32 rounded to bf16 (to nearest, ties to even; a NaN's top half, quieted), as
/// `convert::f32_to_bf16_bits` rounds one.
#[inline]
#[target_feature(enable = "avx512f")]
fn bf16_round(v: __m512) -> __m256i {
    let bits = _mm512_castps_si512(v);
    let odd = _mm512_and_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(1));
    let rounded = _mm512_srli_epi32::<16>(_mm512_add_epi32(
        bits,
        _mm512_add_epi32(odd, _mm512_set1_epi32(0x7fff)),
    ));
    let nan = _mm512_or_si512(_mm512_srli_epi32::<16>(bits), _mm512_set1_epi32(0x40));
    let is_nan = _mm512_cmp_ps_mask::<_CMP_UNORD_Q>(v, v);
    _mm512_cvtepi32_epi16(_mm512_mask_blend_epi32(is_nan, rounded, nan))
}

/// The microkernel itself. The 24 accumulators are named one by one: held in an array,
/// LLVM kept some of them on the stack and reloaded them every pair (2.4x slower). One
/// register of `b` per pair, so each row's broadcast pair is used once and folds into its
/// `vdpbf16ps` as an embedded broadcast (`{1to16}`, which only the last operand takes: the
/// pair of `b` goes first, the product being the same): no broadcast instruction of its own
/// competes with the products for the vector pipes.
#[target_feature(enable = "avx512f,avx512bf16")]
fn tile_avx512(a_panel: &[u32], b_panel: &[u32], pairs: usize, tile: &mut [f32; MR * NR]) {
    const _: () = assert!(
        MR == 24 && NR == 16,
        "the kernel below is written for 24 x 16"
    );
    let mut c0 = _mm512_setzero_ps();
    let mut c1 = _mm512_setzero_ps();
    let mut c2 = _mm512_setzero_ps();
    let mut c3 = _mm512_setzero_ps();
    let mut c4 = _mm512_setzero_ps();
    let mut c5 = _mm512_setzero_ps();
    let mut c6 = _mm512_setzero_ps();
    let mut c7 = _mm512_setzero_ps();
    let mut c8 = _mm512_setzero_ps();
    let mut c9 = _mm512_setzero_ps();
    let mut c10 = _mm512_setzero_ps();
    let mut c11 = _mm512_setzero_ps();
    let mut c12 = _mm512_setzero_ps();
    let mut c13 = _mm512_setzero_ps();
    let mut c14 = _mm512_setzero_ps();
    let mut c15 = _mm512_setzero_ps();
    let mut c16 = _mm512_setzero_ps();
    let mut c17 = _mm512_setzero_ps();
    let mut c18 = _mm512_setzero_ps();
    let mut c19 = _mm512_setzero_ps();
    let mut c20 = _mm512_setzero_ps();
    let mut c21 = _mm512_setzero_ps();
    let mut c22 = _mm512_setzero_ps();
    let mut c23 = _mm512_setzero_ps();
    let a_steps = a_panel[..pairs * MR].as_chunks::<MR>().0;
    let b_steps = b_panel[..pairs * NR].as_chunks::<NR>().0;
    for (at, b) in a_steps.iter().zip(b_steps) {
        let b0 = as_bf16(load_bits(b));
        let pair = as_bf16(_mm512_set1_epi32(at[0] as i32));
        c0 = _mm512_dpbf16_ps(c0, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[1] as i32));
        c1 = _mm512_dpbf16_ps(c1, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[2] as i32));
        c2 = _mm512_dpbf16_ps(c2, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[3] as i32));
        c3 = _mm512_dpbf16_ps(c3, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[4] as i32));
        c4 = _mm512_dpbf16_ps(c4, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[5] as i32));
        c5 = _mm512_dpbf16_ps(c5, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[6] as i32));
        c6 = _mm512_dpbf16_ps(c6, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[7] as i32));
        c7 = _mm512_dpbf16_ps(c7, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[8] as i32));
        c8 = _mm512_dpbf16_ps(c8, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[9] as i32));
        c9 = _mm512_dpbf16_ps(c9, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[10] as i32));
        c10 = _mm512_dpbf16_ps(c10, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[11] as i32));
        c11 = _mm512_dpbf16_ps(c11, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[12] as i32));
        c12 = _mm512_dpbf16_ps(c12, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[13] as i32));
        c13 = _mm512_dpbf16_ps(c13, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[14] as i32));
        c14 = _mm512_dpbf16_ps(c14, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[15] as i32));
        c15 = _mm512_dpbf16_ps(c15, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[16] as i32));
        c16 = _mm512_dpbf16_ps(c16, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[17] as i32));
        c17 = _mm512_dpbf16_ps(c17, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[18] as i32));
        c18 = _mm512_dpbf16_ps(c18, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[19] as i32));
        c19 = _mm512_dpbf16_ps(c19, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[20] as i32));
        c20 = _mm512_dpbf16_ps(c20, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[21] as i32));
        c21 = _mm512_dpbf16_ps(c21, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[22] as i32));
        c22 = _mm512_dpbf16_ps(c22, b0, pair);
        let pair = as_bf16(_mm512_set1_epi32(at[23] as i32));
        c23 = _mm512_dpbf16_ps(c23, b0, pair);
    }
    let rows = [
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19,
        c20, c21, c22, c23,
    ];
    for (i, row) in rows.into_iter().enumerate() {
        // SAFETY: row `i` of `tile` holds NR = 16 values: one store.
        unsafe { _mm512_storeu_ps(tile[i * NR..(i + 1) * NR].as_mut_ptr(), row) };
    }
}

/// The FMA microkernel on lanes of f32 bits: per step along `k`, one load of `b`'s 16
/// values and for each of the 24 rows one FMA of its value, broadcast (folded into the FMA as
/// its memory operand), into 24 accumulators held in registers.
#[target_feature(enable = "avx512f")]
fn tile_fma(a_panel: &[u32], b_panel: &[u32], steps: usize, tile: &mut [f32; MR * NR]) {
    let mut c0 = _mm512_setzero_ps();
    let mut c1 = _mm512_setzero_ps();
    let mut c2 = _mm512_setzero_ps();
    let mut c3 = _mm512_setzero_ps();
    let mut c4 = _mm512_setzero_ps();
    let mut c5 = _mm512_setzero_ps();
    let mut c6 = _mm512_setzero_ps();
    let mut c7 = _mm512_setzero_ps();
    let mut c8 = _mm512_setzero_ps();
    let mut c9 = _mm512_setzero_ps();
    let mut c10 = _mm512_setzero_ps();
    let mut c11 = _mm512_setzero_ps();
    let mut c12 = _mm512_setzero_ps();
    let mut c13 = _mm512_setzero_ps();
    let mut c14 = _mm512_setzero_ps();
    let mut c15 = _mm512_setzero_ps();
    let mut c16 = _mm512_setzero_ps();
    let mut c17 = _mm512_setzero_ps();
    let mut c18 = _mm512_setzero_ps();
    let mut c19 = _mm512_setzero_ps();
    let mut c20 = _mm512_setzero_ps();
    let mut c21 = _mm512_setzero_ps();
    let mut c22 = _mm512_setzero_ps();
    let mut c23 = _mm512_setzero_ps();
    // Lanes are f32 bits: the panels read as f32, one array a step.
    let a_steps = bytemuck::cast_slice::<u32, f32>(&a_panel[..steps * MR])
        .as_chunks::<MR>()
        .0;
    let b_steps = b_panel[..steps * NR].as_chunks::<NR>().0;
    for (at, b) in a_steps.iter().zip(b_steps) {
        let b0 = _mm512_castsi512_ps(load_bits(b));
        c0 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[0]), c0);
        c1 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[1]), c1);
        c2 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[2]), c2);
        c3 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[3]), c3);
        c4 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[4]), c4);
        c5 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[5]), c5);
        c6 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[6]), c6);
        c7 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[7]), c7);
        c8 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[8]), c8);
        c9 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[9]), c9);
        c10 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[10]), c10);
        c11 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[11]), c11);
        c12 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[12]), c12);
        c13 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[13]), c13);
        c14 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[14]), c14);
        c15 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[15]), c15);
        c16 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[16]), c16);
        c17 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[17]), c17);
        c18 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[18]), c18);
        c19 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[19]), c19);
        c20 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[20]), c20);
        c21 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[21]), c21);
        c22 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[22]), c22);
        c23 = _mm512_fmadd_ps(b0, _mm512_set1_ps(at[23]), c23);
    }
    let rows = [
        c0, c1, c2, c3, c4, c5, c6, c7, c8, c9, c10, c11, c12, c13, c14, c15, c16, c17, c18, c19,
        c20, c21, c22, c23,
    ];
    for (i, row) in rows.into_iter().enumerate() {
        // SAFETY: row `i` of `tile` holds NR = 16 values: one store.
        unsafe { _mm512_storeu_ps(tile[i * NR..(i + 1) * NR].as_mut_ptr(), row) };
    }
}

/// 16 lanes as one register (an unaligned load: `[u32; 16]` has u32's alignment). A plain
/// transmute: `_mm512_loadu_si512` copies through memory with an asserted
/// `copy_nonoverlapping`, which the dev profile keeps: a store and a reload of the register
/// every step, ahead of its 24 products (with the asserted pointer offsets, about a sixth of
/// the FMA kernel's samples).
#[inline]
#[target_feature(enable = "avx512f")]
fn load_bits(lanes: &[u32; 16]) -> __m512i {
    // SAFETY: both are 64 bytes of plain bits; every bit pattern is valid for both.
    unsafe { std::mem::transmute::<[u32; 16], __m512i>(*lanes) }
}

/// 16 f32 as one register, as [`load_bits`] loads lanes.
#[inline]
#[target_feature(enable = "avx512f")]
fn f32x16(values: &[f32; 16]) -> __m512 {
    // SAFETY: both are 64 bytes of f32 values; every bit pattern is valid for both.
    unsafe { std::mem::transmute::<[f32; 16], __m512>(*values) }
}

/// The same 512 bits seen as 32 bf16 values.
#[target_feature(enable = "avx512f,avx512bf16")]
fn as_bf16(bits: __m512i) -> __m512bh {
    // SAFETY: both are 64-byte vectors of plain bits; every bit pattern is a valid value.
    unsafe { std::mem::transmute::<__m512i, __m512bh>(bits) }
}
