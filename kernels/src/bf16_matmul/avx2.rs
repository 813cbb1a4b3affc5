//! The microkernel of the AVX2 path, for x86 CPUs without AVX-512 (most laptops and
//! desktops): the same 24 x 16 tile from the same packed panels of f32 lanes as the AVX-512
//! FMA path, computed as four bands of 6 rows, each band's 6 x 16 accumulators in 12 of the
//! 16 ymm registers for the whole `k` (the shape of the `gemm` crate's AVX2 f32 kernel). Each
//! element is the same chain of FMAs along `k` as on the AVX-512 path, so both give the same
//! bits. The bands run over `k` in chunks of [`CHUNK`] steps, so that each band finds the
//! chunk of `b`'s panel in L1 (a long `k`, as in a weight gradient's `X^T dY`, put the whole
//! panel out of it: 4 reads from L2 per step, measured 1.6x slower); an accumulator stored at
//! the end of a chunk and loaded back at the start of the next keeps its bits.
//! The crate's unsafe code for this path: the tile's stores (their contract checked by
//! `super::store_tile`), and the calls into the feature-gated functions after the CPU was
//! checked.

#![allow(unsafe_code)]

use std::any::TypeId;
use std::arch::x86_64::*;
use std::mem::MaybeUninit;

use half::{bf16, f16};

use super::{Bf16Path, MR, NR};
use crate::element::Element;
use crate::x86::{f32s, f32x8};

/// Rows of one band: 6 rows x 2 registers of 8 = 12 accumulators, with the two registers of
/// `b` and one broadcast of `a`, 15 of the 16 ymm registers.
const BAND: usize = 6;
/// Steps along `k` of one chunk: 8 KiB of `b`'s panel and 12 KiB of `a`'s, in a 32 KiB L1.
const CHUNK: usize = 128;

/// The tile `a_panel b_panel` (`steps` steps along `k`, f32 lanes) into `tile` (row-major,
/// `MR x NR`), four bands of [`BAND`] rows.
///
/// # Panics
/// When a panel is shorter than `steps` steps, or the CPU has no AVX2 and FMA (the callers
/// only choose this path where it is available).
pub(super) fn tile(a_panel: &[u32], b_panel: &[u32], steps: usize, tile: &mut [f32; MR * NR]) {
    const _: () = assert!(
        MR == 4 * BAND && NR == 16,
        "4 bands of 6 rows, 2 x 8 columns"
    );
    assert!(a_panel.len() >= steps * MR && b_panel.len() >= steps * NR);
    assert!(
        Bf16Path::Avx2.available(),
        "the AVX2 tile on a CPU without it"
    );
    for start in (0..steps).step_by(CHUNK) {
        let len = CHUNK.min(steps - start);
        let (a, b) = (&a_panel[start * MR..], &b_panel[start * NR..]);
        let resume = start > 0;
        // SAFETY: the CPU has AVX2 and FMA (asserted above).
        unsafe {
            band::<0>(a, b, len, resume, tile);
            band::<BAND>(a, b, len, resume, tile);
            band::<{ 2 * BAND }>(a, b, len, resume, tile);
            band::<{ 3 * BAND }>(a, b, len, resume, tile);
        }
    }
}

/// Rows `FIRST..FIRST + BAND` of the tile, added to what the tile holds when `resume` (the
/// chunks after the first), else from zero. The panels are read as arrays of one step each
/// (registers loaded by value, see `crate::x86::f32x8`), and the band's rows are a constant:
/// no index is checked and no pointer offset asserted in the loop (the dev profile asserts
/// every `ptr::add` and every `_mm256_loadu_ps`'s copy: measured 1.4x slower). The 12
/// accumulators are named one by one, as the AVX-512 kernels' are: held in an array, LLVM
/// kept some on the stack.
#[target_feature(enable = "avx2,fma")]
fn band<const FIRST: usize>(
    a_panel: &[u32],
    b_panel: &[u32],
    steps: usize,
    resume: bool,
    tile: &mut [f32; MR * NR],
) {
    const { assert!(FIRST + BAND <= MR) };
    let rows = bytemuck::cast_slice_mut::<f32, [[f32; 8]; 2]>(tile);
    let start = |row: &[f32; 8]| {
        if resume {
            f32x8(row)
        } else {
            _mm256_setzero_ps()
        }
    };
    let mut c00 = start(&rows[FIRST][0]);
    let mut c01 = start(&rows[FIRST][1]);
    let mut c10 = start(&rows[FIRST + 1][0]);
    let mut c11 = start(&rows[FIRST + 1][1]);
    let mut c20 = start(&rows[FIRST + 2][0]);
    let mut c21 = start(&rows[FIRST + 2][1]);
    let mut c30 = start(&rows[FIRST + 3][0]);
    let mut c31 = start(&rows[FIRST + 3][1]);
    let mut c40 = start(&rows[FIRST + 4][0]);
    let mut c41 = start(&rows[FIRST + 4][1]);
    let mut c50 = start(&rows[FIRST + 5][0]);
    let mut c51 = start(&rows[FIRST + 5][1]);
    // Lanes are f32 bits: the panels read as f32, one array a step.
    let a_steps = bytemuck::cast_slice::<u32, f32>(a_panel)
        .as_chunks::<MR>()
        .0;
    let b_steps = bytemuck::cast_slice::<u32, [[f32; 8]; 2]>(&b_panel[..steps * NR]);
    for (a, [b0, b1]) in a_steps.iter().zip(b_steps) {
        let (b0, b1) = (f32x8(b0), f32x8(b1));
        let x = _mm256_set1_ps(a[FIRST]);
        c00 = _mm256_fmadd_ps(b0, x, c00);
        c01 = _mm256_fmadd_ps(b1, x, c01);
        let x = _mm256_set1_ps(a[FIRST + 1]);
        c10 = _mm256_fmadd_ps(b0, x, c10);
        c11 = _mm256_fmadd_ps(b1, x, c11);
        let x = _mm256_set1_ps(a[FIRST + 2]);
        c20 = _mm256_fmadd_ps(b0, x, c20);
        c21 = _mm256_fmadd_ps(b1, x, c21);
        let x = _mm256_set1_ps(a[FIRST + 3]);
        c30 = _mm256_fmadd_ps(b0, x, c30);
        c31 = _mm256_fmadd_ps(b1, x, c31);
        let x = _mm256_set1_ps(a[FIRST + 4]);
        c40 = _mm256_fmadd_ps(b0, x, c40);
        c41 = _mm256_fmadd_ps(b1, x, c41);
        let x = _mm256_set1_ps(a[FIRST + 5]);
        c50 = _mm256_fmadd_ps(b0, x, c50);
        c51 = _mm256_fmadd_ps(b1, x, c51);
    }
    let sums = [
        (c00, c01),
        (c10, c11),
        (c20, c21),
        (c30, c31),
        (c40, c41),
        (c50, c51),
    ];
    for (row, (left, right)) in rows[FIRST..FIRST + BAND].iter_mut().zip(sums) {
        *row = [f32s(left), f32s(right)];
    }
}

/// A whole tile (rows of `NR` f32) plus `bias` (its `NR` columns' values) rounded once
/// to `O` into `rows` (row `i` at `rows.add(i * stride)`, `NR` values), 8 values an
/// instruction: f16 by `vcvtps2ph`, bf16 by integer rounding to nearest even, as the AVX-512
/// store rounds. Reached through `super::store_tile`, which checks the contract.
///
/// # Safety
/// The CPU must have AVX2 and F16C; `rows` must be valid for writes of
/// `(tile.len() - 1) * stride + NR` values of `O`, and `bias` hold at least `NR` values.
#[target_feature(enable = "avx2,f16c")]
pub(super) unsafe fn store_tile<O: Element>(
    tile: &[[f32; NR]],
    rows: *mut MaybeUninit<O>,
    stride: usize,
    bias: Option<&[f32]>,
) {
    let bias = bias.map(|bias| bias[..NR].as_chunks::<8>().0);
    let is = |t: TypeId| TypeId::of::<O>() == t;
    for (i, row) in tile.iter().enumerate() {
        for (h, values) in row.as_chunks::<8>().0.iter().enumerate() {
            let mut v = f32x8(values);
            if let Some(bias) = bias {
                v = _mm256_add_ps(v, f32x8(&bias[h]));
            }
            // SAFETY (the stores): row `i < tile.len()` of `rows` starts at `i * stride` and holds
            // NR values of `O` (the caller's contract), 8 of them from `8 * h`; `O` is the
            // type its id says, whose size is the store's: 32 bytes of f32, 16 of f16 or bf16.
            unsafe {
                let out = rows.add(i * stride + 8 * h);
                if is(TypeId::of::<f32>()) {
                    _mm256_storeu_ps(out.cast(), v);
                } else if is(TypeId::of::<f16>()) {
                    _mm_storeu_si128(out.cast(), crate::x86::f16_narrow(v));
                } else if is(TypeId::of::<bf16>()) {
                    _mm_storeu_si128(out.cast(), crate::x86::bf16_narrow(v));
                } else {
                    for (j, w) in f32s(v).into_iter().enumerate() {
                        (*out.add(j)).write(O::from_f32(w));
                    }
                }
            }
        }
    }
}
