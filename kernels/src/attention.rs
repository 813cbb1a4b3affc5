//! Self-attention in tiles, flash-style: `softmax(scale * q k^T, masked) v` for each (batch,
//! head) with the `[seq, seq]` probabilities living only in that tile's buffer, forward and
//! backward. The forward pass keeps two numbers per query row (the row's maximum and the
//! inverse of its denominator), from which the backward pass recomputes the very same
//! probabilities, so a training step never holds the `[batch, heads, seq, seq]` tensor that
//! the separate products and softmax keep for backward.
//!
//! Layouts are those of a transformer's one QKV product: `qkv` is `[batch, seq, 3, heads,
//! head_dim]` row-major (query, key and value side by side per token, as `[batch, seq, 3 *
//! d_model]`), the context `[batch, seq, heads, head_dim]` (`[batch, seq, d_model]`, what the
//! output projection takes): no head split or merge copies either way.
//!
//! The arithmetic per row is [`crate::softmax`]'s (scale, fill of masked scores, the quiet
//! softmax), the products the `gemm` crate's on one thread. Each tile is one task with a fixed
//! order, so the bits do not depend on the number of threads.
//!
//! A tile runs in blocks of query rows, and each block stops at the last key any of its rows
//! attends to (rounded up to whole lanes): under a causal mask the blocks above the diagonal,
//! about a third of the products and exponentials, are never computed. Skipping is exact: it
//! happens only where every skipped probability is exactly 0 (`exp(fill - max)` underflows, as
//! for burn-nn's fill of -1e4), so the skipped terms would have added nothing; a block with a
//! fully masked row, or a fill too close to its scores, runs over every key.
//!
//! ```
//! use accelerate_kernels::attention::{SelfAttention, backward, forward};
//!
//! // One sequence of two tokens, one head of width 1: q = k = v = the token's value.
//! let attention = SelfAttention { batch: 1, seq: 2, heads: 1, head_dim: 1, scale: 1.0, quiet: false, mask: None };
//! let qkv = [0.0, 0.0, 1.0, /* token 1 */ 0.0, 0.0, 3.0];
//! let (context, stats) = forward(&attention, &qkv);
//! assert_eq!(context, [2.0, 2.0]); // zero scores: each token averages the values
//! let dqkv = backward(&attention, &qkv, &stats, &[1.0, 0.0]);
//! assert_eq!(dqkv[2], 0.5); // the first token's context took half of each value
//! ```

// The outputs are allocated without clearing (`fresh::written_by`); each unsafe block says why
// every element is written.
#![allow(unsafe_code)]

use rayon::prelude::*;

use std::mem::MaybeUninit;
use std::ops::Range;

use crate::fresh::written_by;

use crate::LANES;
use crate::matmul::{Mat, matmul};
use crate::rows::{exp, lane_sum_and_dot};
use crate::softmax::{normalise_row, softmax_max};

/// Query rows per block of a tile: small enough that a causal mask lets most blocks stop well
/// short of the last key, large enough that each block's products pay for their calls.
const QUERY_BLOCK: usize = 32;

/// Which scores are masked: a byte per (query, key) pair for each sequence (nonzero: masked),
/// `[batch, seq, seq]`, the same for every head (Burn's broadcast attention or padding mask);
/// or `[seq, seq]`, one plane every sequence shares (a causal mask, which Burn expands over the
/// batch without copying).
#[derive(Debug, Clone, Copy)]
pub struct Mask<'a> {
    /// The mask bytes, `batch * seq * seq` of them, or `seq * seq` shared by every sequence.
    pub masked: &'a [u8],
    /// The value a masked score takes before the softmax (burn-nn's `min_float`, -1e4).
    pub fill: f32,
}

/// One self-attention call: its sizes, the scores' scale, the softmax and the mask.
#[derive(Debug, Clone, Copy)]
pub struct SelfAttention<'a> {
    /// Sequences.
    pub batch: usize,
    /// Tokens per sequence (queries and keys).
    pub seq: usize,
    /// Heads.
    pub heads: usize,
    /// Width of each head.
    pub head_dim: usize,
    /// The factor raw scores `q . k` are multiplied by (`1 / sqrt(head_dim)`).
    pub scale: f32,
    /// Quiet softmax (`e^x / (1 + sum e^x)`) instead of softmax.
    pub quiet: bool,
    /// Masked scores, if any.
    pub mask: Option<Mask<'a>>,
}

/// Numbers the forward pass keeps per query row: its maximum and its inverse denominator.
pub const STATS_PER_ROW: usize = 2;

impl SelfAttention<'_> {
    /// `d_model`, the width of the query, key, value and context of one token.
    fn width(&self) -> usize {
        self.heads * self.head_dim
    }

    /// Checks every buffer's length.
    fn check(&self, qkv: usize, context: usize, stats: usize, what: &str) {
        let tokens = self.batch * self.seq;
        let expect = [
            (qkv, tokens * 3 * self.width(), "qkv"),
            (context, tokens * self.width(), what),
            (stats, tokens * self.heads * STATS_PER_ROW, "stats"),
        ];
        for (got, want, name) in expect {
            assert_eq!(got, want, "attention: {got} values of {name} for {self:?}");
        }
        if let Some(mask) = &self.mask {
            let plane = self.seq * self.seq;
            assert!(
                [self.batch * plane, plane].contains(&mask.masked.len()),
                "attention: {} mask bytes for {self:?}",
                mask.masked.len()
            );
        }
    }

    /// The view of head `head`'s `part` (0 query, 1 key, 2 value) of sequence `b` in `qkv`.
    fn part<'q>(&self, qkv: &'q [f32], b: usize, head: usize, part: usize) -> Mat<'q> {
        let width = self.width();
        let offset = b * self.seq * 3 * width + part * width + head * self.head_dim;
        Mat::rows_of(qkv, offset, [self.seq, self.head_dim], 3 * width)
    }

    /// Head `head`'s view of sequence `b` in a `[batch, seq, heads, head_dim]` buffer.
    fn head_of<'c>(&self, context: &'c [f32], b: usize, head: usize) -> Mat<'c> {
        let offset = b * self.seq * self.width() + head * self.head_dim;
        Mat::rows_of(context, offset, [self.seq, self.head_dim], self.width())
    }

    /// The mask row of query `i` of sequence `b`.
    fn mask_row(&self, b: usize, i: usize) -> Option<(&[u8], f32)> {
        self.mask.map(|mask| {
            let start = self.mask_row_start(&mask, b, i);
            (&mask.masked[start..start + self.seq], mask.fill)
        })
    }

    /// Where the mask row of query `i` of sequence `b` starts in `mask`'s bytes.
    fn mask_row_start(&self, mask: &Mask<'_>, b: usize, i: usize) -> usize {
        let plane = if mask.masked.len() == self.seq * self.seq {
            0
        } else {
            b
        };
        (plane * self.seq + i) * self.seq
    }

    /// How many keys (from the first) the query rows `rows` of sequence `b` need: up to the
    /// last one any of them attends to, rounded up to whole lanes; every key without a mask or
    /// when a row attends to none.
    fn keys_for(&self, b: usize, rows: Range<usize>) -> usize {
        let Some(mask) = &self.mask else {
            return self.seq;
        };
        let mut end = 0;
        for i in rows {
            let start = self.mask_row_start(mask, b, i);
            match mask.masked[start..start + self.seq]
                .iter()
                .rposition(|&m| m == 0)
            {
                Some(last) => end = end.max(last + 1),
                None => return self.seq,
            }
        }
        end.next_multiple_of(LANES).min(self.seq)
    }

    /// Whether a row whose softmax maximum is `max` gives its masked keys a probability of
    /// exactly 0 (then leaving out masked keys changes no sum).
    fn masked_keys_vanish(&self, max: f32) -> bool {
        self.mask.is_none_or(|mask| exp(mask.fill - max) == 0.0)
    }

    /// The scaled, masked scores of query rows `rows` of head `head` of sequence `b` against the
    /// first `keys` keys, into `scores` (rows `keys` apart).
    fn block_scores(
        &self,
        qkv: &[f32],
        (b, head): (usize, usize),
        rows: Range<usize>,
        keys: usize,
        scores: &mut [f32],
    ) {
        let q = self.part(qkv, b, head, 0).rows_from(rows.start, rows.len());
        let k = self.part(qkv, b, head, 1).rows_from(0, keys);
        matmul(scores, 0, keys, q, k.t(), 1.0, false);
        for (i, row) in rows.zip(scores.chunks_exact_mut(keys)) {
            match self.mask_row(b, i) {
                Some((masked, fill)) => {
                    for (s, &m) in row.iter_mut().zip(masked) {
                        *s = if m != 0 { fill } else { *s * self.scale };
                    }
                }
                None => row.iter_mut().for_each(|s| *s *= self.scale),
            }
        }
    }
}

/// The context of every head (`[batch, seq, heads, head_dim]`) and each query row's
/// statistics (`[batch, heads, seq, 2]`, for [`backward`]).
///
/// # Panics
/// When a buffer's length does not match the sizes.
pub fn forward(attention: &SelfAttention<'_>, qkv: &[f32]) -> (Vec<f32>, Vec<f32>) {
    let a = attention;
    let tokens = a.batch * a.seq;
    let (context_len, stats_len) = (tokens * a.width(), tokens * a.heads * STATS_PER_ROW);
    a.check(qkv.len(), context_len, stats_len, "context");
    let mut stats = vec![0.0; stats_len];
    let (seq, width) = (a.seq, a.width());
    if seq == 0 || width == 0 {
        return (vec![0.0; context_len], stats);
    }
    let fill = |context: &mut [MaybeUninit<f32>]| {
        context
            .par_chunks_mut(seq * width)
            .zip(stats.par_chunks_mut(a.heads * seq * STATS_PER_ROW))
            .enumerate()
            .for_each(|(b, (context, stats))| {
                let tiles: Vec<(Vec<f32>, Vec<f32>)> = (0..a.heads)
                    .into_par_iter()
                    .map(|head| forward_tile(a, qkv, b, head))
                    .collect();
                for (head, (tile, tile_stats)) in tiles.into_iter().enumerate() {
                    scatter(context, &tile, head * a.head_dim, width, a.head_dim);
                    let at = head * seq * STATS_PER_ROW;
                    stats[at..at + tile_stats.len()].copy_from_slice(&tile_stats);
                }
            });
    };
    // SAFETY: each sequence's `seq x width` chunk receives every head's `seq x head_dim` tile
    // in the head's columns, and the heads' columns make up the width: every element is written.
    let context = unsafe { written_by(context_len, fill) };
    (context, stats)
}

/// One head of one sequence: its context `[seq, head_dim]` and its rows' statistics.
fn forward_tile(a: &SelfAttention<'_>, qkv: &[f32], b: usize, head: usize) -> (Vec<f32>, Vec<f32>) {
    let (seq, dim) = (a.seq, a.head_dim);
    let mut context = vec![0.0; seq * dim];
    let mut stats = vec![0.0; seq * STATS_PER_ROW];
    let mut probs = vec![0.0; QUERY_BLOCK.min(seq) * seq];
    for start in (0..seq).step_by(QUERY_BLOCK) {
        let rows = start..(start + QUERY_BLOCK).min(seq);
        let mut keys = a.keys_for(b, rows.clone());
        let block = &mut probs[..rows.len() * seq];
        a.block_scores(qkv, (b, head), rows.clone(), keys, block);
        let vanish = |row: &[f32]| a.masked_keys_vanish(softmax_max(row, a.quiet));
        if keys < seq && !block[..rows.len() * keys].chunks_exact(keys).all(vanish) {
            keys = seq;
            a.block_scores(qkv, (b, head), rows.clone(), keys, block);
        }
        let block = &mut block[..rows.len() * keys];
        for (row, stat) in block
            .chunks_exact_mut(keys)
            .zip(stats[start * STATS_PER_ROW..].chunks_exact_mut(STATS_PER_ROW))
        {
            let (max, inverse) = normalise_row(row, a.quiet);
            stat.copy_from_slice(&[max, inverse]);
        }
        matmul(
            &mut context,
            start * dim,
            dim,
            Mat::rows_of(block, 0, [rows.len(), keys], keys),
            a.part(qkv, b, head, 2).rows_from(0, keys),
            1.0,
            false,
        );
    }
    (context, stats)
}

/// Copies the `[rows, cols]` tile into `dst` (row stride `stride`) from column `column` on.
fn scatter(dst: &mut [MaybeUninit<f32>], tile: &[f32], column: usize, stride: usize, cols: usize) {
    for (row, values) in tile.chunks_exact(cols).enumerate() {
        let start = row * stride + column;
        for (d, &v) in dst[start..start + cols].iter_mut().zip(values) {
            d.write(v);
        }
    }
}

/// The gradient of `qkv` (as a new vector) from the context's gradient `dcontext` (`[batch, seq,
/// heads, head_dim]`) and the statistics [`forward`] kept: the probabilities are recomputed
/// tile by tile, `dv = p^T do`, `dp = do v^T`, `ds = scale * p * (dp - sum(p * dp))` (0 where
/// masked, as `mask_fill` passes no gradient), `dq = ds k`, `dk = ds^T q`.
///
/// # Panics
/// When a buffer's length does not match the sizes.
pub fn backward(
    attention: &SelfAttention<'_>,
    qkv: &[f32],
    stats: &[f32],
    dcontext: &[f32],
) -> Vec<f32> {
    let a = attention;
    a.check(qkv.len(), dcontext.len(), stats.len(), "dcontext");
    let (seq, width) = (a.seq, a.width());
    if seq == 0 || width == 0 {
        return vec![0.0; qkv.len()];
    }
    let fill = |dqkv: &mut [MaybeUninit<f32>]| {
        dqkv.par_chunks_mut(seq * 3 * width)
            .enumerate()
            .for_each(|(b, dqkv)| {
                let tiles: Vec<[Vec<f32>; 3]> = (0..a.heads)
                    .into_par_iter()
                    .map(|head| {
                        let at = (b * a.heads + head) * seq * STATS_PER_ROW;
                        let stats = &stats[at..at + seq * STATS_PER_ROW];
                        backward_tile(a, qkv, stats, dcontext, b, head)
                    })
                    .collect();
                for (head, parts) in tiles.iter().enumerate() {
                    for (part, tile) in parts.iter().enumerate() {
                        let column = part * width + head * a.head_dim;
                        scatter(dqkv, tile, column, 3 * width, a.head_dim);
                    }
                }
            });
    };
    // SAFETY: each sequence's `seq x 3 width` chunk receives, for every head, its `seq x
    // head_dim` tiles of dq, dk and dv in their columns, which make up the three widths: every
    // element is written.
    unsafe { written_by(qkv.len(), fill) }
}

/// One head of one sequence's `[dq, dk, dv]`, each `[seq, head_dim]`.
fn backward_tile(
    a: &SelfAttention<'_>,
    qkv: &[f32],
    stats: &[f32],
    dcontext: &[f32],
    b: usize,
    head: usize,
) -> [Vec<f32>; 3] {
    let (seq, dim) = (a.seq, a.head_dim);
    let dout = a.head_of(dcontext, b, head);
    let (q, k, v) = (
        a.part(qkv, b, head, 0),
        a.part(qkv, b, head, 1),
        a.part(qkv, b, head, 2),
    );
    let (mut dq, mut dk, mut dv) = (
        vec![0.0; seq * dim],
        vec![0.0; seq * dim],
        vec![0.0; seq * dim],
    );
    let mut probs = vec![0.0; QUERY_BLOCK.min(seq) * seq];
    let mut dscores = vec![0.0; QUERY_BLOCK.min(seq) * seq];
    for start in (0..seq).step_by(QUERY_BLOCK) {
        let rows = start..(start + QUERY_BLOCK).min(seq);
        let n = rows.len();
        let block_stats = &stats[start * STATS_PER_ROW..rows.end * STATS_PER_ROW];
        // The forward pass's maxima decide, so the skipped probabilities are exactly 0 here too.
        let mut keys = a.keys_for(b, rows.clone());
        if !block_stats
            .chunks_exact(STATS_PER_ROW)
            .all(|stat| a.masked_keys_vanish(stat[0]))
        {
            keys = seq;
        }
        let p = &mut probs[..n * keys];
        a.block_scores(qkv, (b, head), rows.clone(), keys, p);
        for (row, stat) in p
            .chunks_exact_mut(keys)
            .zip(block_stats.chunks_exact(STATS_PER_ROW))
        {
            let (max, inverse) = (stat[0], stat[1]);
            for p in row.iter_mut() {
                *p = exp(*p - max) * inverse;
            }
        }
        let p = Mat::rows_of(&probs[..n * keys], 0, [n, keys], keys);
        let dout = dout.rows_from(start, n);
        matmul(&mut dv, 0, dim, p.t(), dout, 1.0, start > 0);
        let ds = &mut dscores[..n * keys];
        matmul(ds, 0, keys, dout, v.rows_from(0, keys).t(), 1.0, false);
        for (i, (ds, p)) in rows
            .clone()
            .zip(ds.chunks_exact_mut(keys).zip(probs.chunks_exact(keys)))
        {
            let (_, dot) = lane_sum_and_dot(ds, p);
            for (ds, &p) in ds.iter_mut().zip(p) {
                *ds = a.scale * p * (*ds - dot);
            }
            if let Some((masked, _)) = a.mask_row(b, i) {
                for (ds, &m) in ds.iter_mut().zip(masked) {
                    if m != 0 {
                        *ds = 0.0;
                    }
                }
            }
        }
        let ds = Mat::rows_of(&dscores[..n * keys], 0, [n, keys], keys);
        matmul(
            &mut dq,
            start * dim,
            dim,
            ds,
            k.rows_from(0, keys),
            1.0,
            false,
        );
        matmul(
            &mut dk,
            0,
            dim,
            ds.t(),
            q.rows_from(start, n),
            1.0,
            start > 0,
        );
    }
    [dq, dk, dv]
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_same_on_1_2_3_threads, bits, uniform};

    /// The context and the gradient of qkv in f64, the textbook way: scores, mask, softmax,
    /// products, and the softmax's Jacobian.
    fn reference(a: &SelfAttention<'_>, qkv: &[f32], dcontext: &[f32]) -> (Vec<f64>, Vec<f64>) {
        let (seq, dim, width) = (a.seq, a.head_dim, a.width());
        let at = |b: usize, i: usize, part: usize, h: usize, c: usize| {
            ((b * seq + i) * 3 + part) * width + h * dim + c
        };
        let mut context = vec![0.0; a.batch * seq * width];
        let mut dqkv = vec![0.0; qkv.len()];
        for b in 0..a.batch {
            for h in 0..a.heads {
                let x = |i, part, c| f64::from(qkv[at(b, i, part, h, c)]);
                let dout =
                    |i: usize, c: usize| f64::from(dcontext[(b * seq + i) * width + h * dim + c]);
                for i in 0..seq {
                    let masked = |j: usize| {
                        a.mask
                            .map(|m| (m.masked[(b * seq + i) * seq + j] != 0, m.fill))
                    };
                    let s: Vec<f64> = (0..seq)
                        .map(|j| match masked(j) {
                            Some((true, fill)) => f64::from(fill),
                            _ => {
                                (0..dim).map(|c| x(i, 0, c) * x(j, 1, c)).sum::<f64>()
                                    * f64::from(a.scale)
                            }
                        })
                        .collect();
                    let max = s.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                    let e: Vec<f64> = s.iter().map(|v| (v - max).exp()).collect();
                    let denominator =
                        e.iter().sum::<f64>() + if a.quiet { (-max).exp() } else { 0.0 };
                    let p: Vec<f64> = e.iter().map(|v| v / denominator).collect();
                    for c in 0..dim {
                        context[(b * seq + i) * width + h * dim + c] =
                            (0..seq).map(|j| p[j] * x(j, 2, c)).sum();
                    }
                    let dp: Vec<f64> = (0..seq)
                        .map(|j| (0..dim).map(|c| dout(i, c) * x(j, 2, c)).sum())
                        .collect();
                    let dot: f64 = (0..seq).map(|j| p[j] * dp[j]).sum();
                    for j in 0..seq {
                        let ds = if matches!(masked(j), Some((true, _))) {
                            0.0
                        } else {
                            f64::from(a.scale) * p[j] * (dp[j] - dot)
                        };
                        for c in 0..dim {
                            dqkv[at(b, i, 0, h, c)] += ds * x(j, 1, c);
                            dqkv[at(b, j, 1, h, c)] += ds * x(i, 0, c);
                            dqkv[at(b, j, 2, h, c)] += p[j] * dout(i, c);
                        }
                    }
                }
            }
        }
        (context, dqkv)
    }

    /// The context and the gradient of qkv, through [`forward`] and [`backward`] into fresh
    /// buffers.
    fn forward_and_backward(
        a: &SelfAttention<'_>,
        qkv: &[f32],
        dcontext: &[f32],
    ) -> (Vec<f32>, Vec<f32>) {
        let (context, stats) = forward(a, qkv);
        let dqkv = backward(a, qkv, &stats, dcontext);
        (context, dqkv)
    }

    fn assert_close(ours: &[f32], want: &[f64], what: &str) {
        assert_eq!(ours.len(), want.len(), "{what}: lengths");
        for (i, (&o, &w)) in ours.iter().zip(want).enumerate() {
            let tolerance = 1e-5 * w.abs().max(1.0);
            assert!(
                (f64::from(o) - w).abs() <= tolerance,
                "{what}[{i}]: {o}, want {w}"
            );
        }
    }

    /// A causal mask with the last query of each sequence masked everywhere (uniform weights,
    /// as Burn's fill gives).
    fn causal_mask(batch: usize, seq: usize) -> Vec<u8> {
        let mut masked = vec![0; batch * seq * seq];
        for b in 0..batch {
            for i in 0..seq {
                for j in 0..seq {
                    let row_fully_masked = i + 1 == seq && seq > 1;
                    masked[(b * seq + i) * seq + j] = u8::from(j > i || row_fully_masked);
                }
            }
        }
        masked
    }

    /// Context and gradients equal the f64 definition within 1e-5 over odd shapes, batch 1 and
    /// sequence 1, with and without a mask, softmax and quiet softmax; and the same bits on
    /// 1, 2 and 3 threads.
    #[test]
    fn tiles_equal_the_definition_and_do_not_depend_on_threads() {
        for (batch, seq, heads, head_dim) in
            [(1, 1, 1, 1), (2, 5, 3, 4), (3, 17, 2, 8), (1, 33, 4, 16)]
        {
            let width = heads * head_dim;
            let qkv = uniform(batch * seq * 3 * width, 11, 1.5);
            let dcontext = uniform(batch * seq * width, 12, 1.0);
            let masked = causal_mask(batch, seq);
            for (mask, quiet) in [(false, false), (true, false), (false, true), (true, true)] {
                let a = SelfAttention {
                    batch,
                    seq,
                    heads,
                    head_dim,
                    scale: 1.0 / (head_dim as f32).sqrt(),
                    quiet,
                    mask: mask.then_some(Mask {
                        masked: &masked,
                        fill: -1.0e4,
                    }),
                };
                let what = format!(
                    "{batch}x{seq}, {heads} heads of {head_dim}, mask {mask}, quiet {quiet}"
                );
                let run = || {
                    let (context, dqkv) = forward_and_backward(&a, &qkv, &dcontext);
                    (bits(&context), bits(&dqkv))
                };
                let (context, dqkv) = run();
                let (want_context, want_dqkv) = reference(&a, &qkv, &dcontext);
                let floats = |b: Vec<u32>| b.into_iter().map(f32::from_bits).collect::<Vec<_>>();
                assert_close(&floats(context), &want_context, &format!("context, {what}"));
                assert_close(&floats(dqkv), &want_dqkv, &format!("dqkv, {what}"));
                assert_same_on_1_2_3_threads(run);
            }
        }
    }

    /// Sequences longer than a block under a causal mask: the blocks that stop short of the
    /// last key (burn-nn's fill of -1e4) and those that run over every key (a fully masked
    /// row, or a fill of -0.5, whose masked probabilities are not 0) equal the definition.
    #[test]
    fn blocks_that_skip_masked_keys_equal_the_definition() {
        let (batch, seq, heads, head_dim) = (2, 100, 2, 8);
        let width = heads * head_dim;
        let qkv = uniform(batch * seq * 3 * width, 13, 1.5);
        let dcontext = uniform(batch * seq * width, 14, 1.0);
        let masked = causal_mask(batch, seq);
        for (fill, quiet) in [(-1.0e4, false), (-1.0e4, true), (-0.5, false)] {
            let a = SelfAttention {
                batch,
                seq,
                heads,
                head_dim,
                scale: 1.0 / (head_dim as f32).sqrt(),
                quiet,
                mask: Some(Mask {
                    masked: &masked,
                    fill,
                }),
            };
            let (context, dqkv) = forward_and_backward(&a, &qkv, &dcontext);
            let (want_context, want_dqkv) = reference(&a, &qkv, &dcontext);
            let what = format!("fill {fill}, quiet {quiet}");
            assert_close(&context, &want_context, &format!("context, {what}"));
            assert_close(&dqkv, &want_dqkv, &format!("dqkv, {what}"));
        }
    }

    /// One `[seq, seq]` plane for every sequence gives the bits of the same plane repeated over
    /// the batch (what Burn's expanded causal mask is, without the copy).
    #[test]
    fn a_shared_mask_plane_equals_the_plane_repeated() {
        let (batch, seq, heads, head_dim) = (3, 40, 2, 8);
        let width = heads * head_dim;
        let qkv = uniform(batch * seq * 3 * width, 15, 1.5);
        let dcontext = uniform(batch * seq * width, 16, 1.0);
        let repeated = causal_mask(batch, seq);
        let shared = causal_mask(1, seq);
        let run = |masked: &[u8]| {
            let a = SelfAttention {
                batch,
                seq,
                heads,
                head_dim,
                scale: 0.3,
                quiet: false,
                mask: Some(Mask {
                    masked,
                    fill: -1.0e4,
                }),
            };
            let (context, dqkv) = forward_and_backward(&a, &qkv, &dcontext);
            (bits(&context), bits(&dqkv))
        };
        assert_eq!(run(&shared), run(&repeated));
    }

    #[test]
    #[should_panic(expected = "attention: 5 values of qkv")]
    fn a_qkv_of_the_wrong_length_says_so() {
        let a = SelfAttention {
            batch: 1,
            seq: 2,
            heads: 1,
            head_dim: 1,
            scale: 1.0,
            quiet: false,
            mask: None,
        };
        forward(&a, &[0.0; 5]);
    }
}
