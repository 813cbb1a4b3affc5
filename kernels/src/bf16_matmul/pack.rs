//! Packing of the half-precision products' operands: `a` in panels of [`MR`] rows and `b` in
//! panels of [`NR`] columns, each step along `k` one 32-bit lane per row or column (a pair of
//! bf16 for `vdpbf16ps`, one value widened to f32 for the FMAs), read in contiguous runs
//! wherever the operand's strides allow.
//!
//! A packed operand is written whole, its padding included, into a buffer each thread keeps
//! between products ([`take_buffer`], [`give_back`]): a fresh zeroed one per block of rows
//! and per product cost the allocator's clearing (`memset`, 4.5-4.9 % of a weight gradient's
//! profile; RESULTS, issue 60 part seven). The FMA paths' lanes (one value widened to f32
//! each) are transposed 8 x 8 in registers where the CPU has AVX2 (`transpose`).

use std::cell::RefCell;
use std::ops::Range;

use rayon::prelude::*;

use super::{Bf16Path, HalfElement, HalfMat, MR, NR};

/// Buffers a thread keeps for packing: at most this many (an operand of each kind).
pub(super) const KEPT_BUFFERS: usize = 2;

thread_local! {
    /// This thread's packing buffers between products.
    static BUFFERS: RefCell<Vec<Vec<u32>>> = const { RefCell::new(Vec::new()) };
}

/// A packing buffer of this thread's, with whatever it held (the packing overwrites it).
pub(super) fn take_buffer() -> Vec<u32> {
    BUFFERS
        .try_with(|kept| kept.borrow_mut().pop())
        .ok()
        .flatten()
        .unwrap_or_default()
}

/// Keeps `buffer` for this thread's next product (the largest ones, up to [`KEPT_BUFFERS`]).
pub(super) fn give_back(buffer: Vec<u32>) {
    let _ = BUFFERS.try_with(|kept| {
        let mut kept = kept.borrow_mut();
        kept.push(buffer);
        kept.sort_by_key(|b| std::cmp::Reverse(b.capacity()));
        kept.truncate(KEPT_BUFFERS);
    });
}

/// Values of `k` one packed 32-bit lane holds on `path`: a pair of bf16 for `vdpbf16ps`, one
/// value widened to f32 for the FMAs.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn per_lane(path: Bf16Path) -> usize {
    if matches!(path, Bf16Path::Avx512Bf16 | Bf16Path::Amx) {
        2
    } else {
        1
    }
}

/// The 32-bit lane of a pair of values along `k`, as `vdpbf16ps` and `tdpbf16ps` read it:
/// the first in the low half.
#[inline(always)]
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn pair_lane<T: HalfElement>(lo: T, hi: T) -> u32 {
    u32::from(lo.bits()) | (u32::from(hi.bits()) << 16)
}

/// The 32-bit lane of values `k` and `k + 1` (zero past the end) of one row or column: the
/// pair (`k` in the low half) when `per_lane` is 2, else value `k` as f32 bits.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn lane<T: HalfElement>(
    value: impl Fn(usize) -> T,
    k: usize,
    len: usize,
    per_lane: usize,
) -> u32 {
    let lo = value(k);
    if per_lane == 1 {
        return lo.to_f32().to_bits();
    }
    let hi = if k + 1 < len {
        value(k + 1)
    } else {
        <T as bytemuck::Zeroable>::zeroed()
    };
    pair_lane(lo, hi)
}

/// Values `from..from + len` of row `index` of `m` (`along_row`) or of its column `index`, as
/// one slice when they lie next to each other in memory.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn run<'a, T: HalfElement>(
    m: &HalfMat<'a, T>,
    along_row: bool,
    index: usize,
    from: usize,
    len: usize,
) -> Option<&'a [T]> {
    let (step, start) = if along_row {
        (
            m.col_stride,
            m.offset + index * m.row_stride + from * m.col_stride,
        )
    } else {
        (
            m.row_stride,
            m.offset + index * m.col_stride + from * m.row_stride,
        )
    };
    (step == 1 || len <= 1)
        .then(|| m.data.get(start..start + len))
        .flatten()
}

/// Lanes from two runs of values (`hi` absent past the end of `k`, or with one value a lane):
/// `out[o]` for each value `o`.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn put_lanes<T: HalfElement>(out: &mut [u32], lo: &[T], hi: Option<&[T]>, per_lane: usize) {
    let slots = out.iter_mut();
    match (per_lane, hi) {
        (1, _) => slots.zip(lo).for_each(|(o, v)| *o = v.to_f32().to_bits()),
        (_, Some(hi)) => slots
            .zip(lo.iter().zip(hi))
            .for_each(|(o, (&l, &h))| *o = pair_lane(l, h)),
        (_, None) => slots.zip(lo).for_each(|(o, l)| *o = u32::from(l.bits())),
    }
}

/// Lanes of `runs` (each the values of one row or column of an operand along `k`, all of
/// length `k_len`) laid out step by step: `out[s * width + i]` is step `s` of run `i`. Written
/// in step order (each output lane once, in sequence) while every run is read forward: a
/// panel's rows of `a` (or columns of `b`) are `width` streams the prefetcher follows, where
/// writing one run at a time scattered every lane `width` apart.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
fn put_runs<T: HalfElement>(
    out: &mut [u32],
    width: usize,
    runs: &[&[T]],
    k_len: usize,
    per_lane: usize,
) {
    let steps = k_len.div_ceil(per_lane);
    if per_lane == 1 {
        // Blocks of 8 runs x 8 steps widened and transposed in registers; the rest one value
        // at a time.
        #[cfg(target_arch = "x86_64")]
        let (runs_done, steps_done) = super::transpose::place_widened(out, width, runs, steps);
        #[cfg(not(target_arch = "x86_64"))]
        let (runs_done, steps_done) = (0, 0);
        for (s, out) in out.chunks_exact_mut(width).take(steps).enumerate() {
            let from = if s < steps_done { runs_done } else { 0 };
            for (o, run) in out[from..runs.len()].iter_mut().zip(&runs[from..]) {
                *o = run[s].to_f32().to_bits();
            }
        }
        return;
    }
    for (s, out) in out.chunks_exact_mut(width).take(steps).enumerate() {
        let out = &mut out[..runs.len()];
        if 2 * s + 1 < k_len {
            for (o, run) in out.iter_mut().zip(runs) {
                *o = pair_lane(run[2 * s], run[2 * s + 1]);
            }
        } else {
            // An odd `k`'s last step: its pair ends in zero.
            for (o, run) in out.iter_mut().zip(runs) {
                *o = u32::from(run[2 * s].bits());
            }
        }
    }
}

/// The runs along `k` of `m`'s rows `lines` (`along_row`) or of its columns `lines`: each
/// line's `len` values in one slice, when they lie contiguous in memory.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn runs_along_k<'a, T: HalfElement>(
    m: &HalfMat<'a, T>,
    along_row: bool,
    lines: Range<usize>,
    len: usize,
) -> Option<Vec<&'a [T]>> {
    if len < 2 {
        return None;
    }
    lines.map(|line| run(m, along_row, line, 0, len)).collect()
}

/// `b` as panels of [`NR`] columns into `packed` (every lane written, whatever it held):
/// panel `p` holds, for each step along `k`, the lanes of columns `p * NR ..` (zeros past the
/// last column), then zeros up to `padded` steps.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn pack_b<T: HalfElement>(
    b: HalfMat<'_, T>,
    (steps, padded): (usize, usize),
    per_lane: usize,
    packed: &mut Vec<u32>,
) {
    let panels = b.cols.div_ceil(NR);
    packed.resize(panels * padded * NR, 0);
    let fill = |(p, panel): (usize, &mut [u32])| {
        let width = NR.min(b.cols - p * NR);
        let columns = p * NR..p * NR + width;
        // The padding: columns past the last one, and steps past `k`.
        let (lanes, beyond) = panel.split_at_mut(steps * NR);
        beyond.fill(0);
        if width < NR {
            lanes
                .chunks_exact_mut(NR)
                .for_each(|step| step[width..].fill(0));
        }
        // Columns of `b` read in runs where each lies contiguous (`W^T` of an input gradient).
        if let Some(runs) = runs_along_k(&b, false, columns, b.rows) {
            put_runs(panel, NR, &runs, b.rows, per_lane);
            return;
        }
        for s in 0..steps {
            let k = s * per_lane;
            let hi = (per_lane == 2 && k + 1 < b.rows).then_some(k + 1);
            let out = &mut panel[s * NR..s * NR + width];
            // Rows of `b` read in runs where its columns lie contiguous (a row-major `b`).
            match (
                run(&b, true, k, p * NR, width),
                hi.map(|h| run(&b, true, h, p * NR, width)),
            ) {
                (Some(lo), None) => put_lanes(out, lo, None, per_lane),
                (Some(lo), Some(Some(hi))) => put_lanes(out, lo, Some(hi), per_lane),
                _ => {
                    for (j, o) in out.iter_mut().enumerate() {
                        *o = lane(|k| b.at(k, p * NR + j), k, b.rows, per_lane);
                    }
                }
            }
        }
    };
    packed
        .par_chunks_mut(padded * NR)
        .enumerate()
        .for_each(fill);
}

/// Rows `rows` of `a` as panels of [`MR`] rows into `packed` (every lane written, whatever it
/// held): for each step along `k`, the lanes of each row (zeros past the last row).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
pub(super) fn pack_a<T: HalfElement>(
    a: HalfMat<'_, T>,
    rows: Range<usize>,
    steps: usize,
    per_lane: usize,
    packed: &mut Vec<u32>,
) {
    let panels = rows.len().div_ceil(MR);
    packed.resize(panels * steps * MR, 0);
    let k_len = a.cols;
    for (p, panel) in packed.chunks_mut(steps * MR).enumerate() {
        let height = MR.min(rows.len() - p * MR);
        let first = rows.start + p * MR;
        if height < MR {
            panel
                .chunks_exact_mut(MR)
                .for_each(|step| step[height..].fill(0));
        }
        if let Some(runs) = runs_along_k(&a, true, first..first + height, k_len) {
            // A row-major `a`: each row's `k` values in one run.
            put_runs(panel, MR, &runs, k_len, per_lane);
        } else if run(&a, false, 0, first, height).is_some() && height > 1 {
            // A transposed `a` (X^T): each step's values of the panel's rows in one run.
            for s in 0..steps {
                let k = s * per_lane;
                let out = &mut panel[s * MR..s * MR + height];
                let lo = run(&a, false, k, first, height).unwrap_or_default();
                let hi = (per_lane == 2 && k + 1 < k_len)
                    .then(|| run(&a, false, k + 1, first, height).unwrap_or_default());
                put_lanes(out, lo, hi, per_lane);
            }
        } else {
            for i in 0..height {
                for s in 0..steps {
                    panel[s * MR + i] = lane(|k| a.at(first + i, k), s * per_lane, k_len, per_lane);
                }
            }
        }
    }
}
