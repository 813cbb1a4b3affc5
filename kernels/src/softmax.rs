//! Attention's scaled, masked softmax over the last dimension of row-major scores, forward and
//! backward, each in one parallel pass over the rows.
//!
//! Burn's autodiff runs `scores / sqrt(d_k)`, `mask_fill` and `softmax` as separate tracked
//! operations, and softmax itself as its default decomposition (max, subtract, exp, sum,
//! divide): about nineteen passes over the `[batch, heads, seq, seq]` score tensor in a training
//! step, most of them on one core. Here one pass forward writes the probabilities (kept for
//! backward, where a row of probabilities and its gradient give the score gradient in one more
//! pass), with the masked scores set to the fill value as `mask_fill` sets them, so the results
//! are Burn's: a row masked everywhere is uniform, as it is there.
//!
//! Rows are split into fixed chunks; each row is computed by one thread in a fixed order, so the
//! bits do not depend on the number of threads.
//!
//! ```
//! use accelerate_kernels::softmax::{Softmax, backward, forward};
//! use accelerate_kernels::rows::Shape;
//!
//! let shape = Shape { rows: 1, width: 3 };
//! let softmax = Softmax { scale: 1.0, quiet: false, mask: None };
//! let mut probs = [0.0; 3];
//! forward(shape, &softmax, &[1.0, 1.0, 1.0], &mut probs);
//! assert!(probs.iter().all(|p| (p - 1.0 / 3.0).abs() < 1e-6));
//!
//! let mut dscores = [0.0; 3];
//! backward(shape, &softmax, &probs, &[1.0, 1.0, 1.0], &mut dscores);
//! assert!(dscores.iter().all(|g| g.abs() < 1e-7)); // adding a constant to every score changes nothing
//! ```

use rayon::prelude::*;

use crate::rows::{Shape, exp, lane_max, lane_sum, lane_sum_and_dot};

/// Rows per parallel task: fixed (the bits do not depend on the thread count), and a
/// transformer's scores (`batch * heads * seq` rows) give every core many tasks.
pub const ROWS_PER_CHUNK: usize = 32;

/// Which scores are masked: a byte per score (nonzero: masked) laid out `[groups, seq, width]`
/// for scores `[groups, heads, seq, width]`, the same mask for every head of a group (Burn's
/// `[batch, 1, seq, seq]` broadcast of an attention or padding mask).
#[derive(Debug, Clone, Copy)]
pub struct Mask<'a> {
    /// The mask bytes, `groups * seq * width` of them.
    pub masked: &'a [u8],
    /// Heads sharing each group's mask.
    pub heads: usize,
    /// Rows of scores per head (the query length).
    pub seq: usize,
    /// The value a masked score takes before the softmax (burn-nn's `min_float`, -1e4).
    pub fill: f32,
}

impl Mask<'_> {
    /// The mask row of score row `row`.
    fn row_of(&self, row: usize, width: usize) -> &[u8] {
        let per_group = self.heads * self.seq;
        let start = (row / per_group * self.seq + row % self.seq) * width;
        &self.masked[start..start + width]
    }
}

/// What is computed on each row: `softmax(scores * scale)`, with masked scores replaced by the
/// fill value first; the quiet softmax adds 1 to the denominator (`e^x / (1 + sum e^x)`, so a
/// row can attend to nothing), as Burn's `quiet_softmax`.
#[derive(Debug, Clone, Copy)]
pub struct Softmax<'a> {
    /// The factor every score is multiplied by (`1 / sqrt(d_k)` in attention).
    pub scale: f32,
    /// Quiet softmax instead of softmax.
    pub quiet: bool,
    /// Masked scores, if any.
    pub mask: Option<Mask<'a>>,
}

impl Softmax<'_> {
    /// Checks the buffers against `shape`.
    fn check(&self, shape: Shape, lengths: &[(usize, &str)]) {
        let len = shape.rows * shape.width;
        for &(got, what) in lengths {
            assert_eq!(got, len, "{what}: {got} values for {shape:?}");
        }
        if let Some(mask) = &self.mask {
            let per_group = mask.heads * mask.seq;
            assert!(
                per_group > 0 && shape.rows.is_multiple_of(per_group),
                "mask: {shape:?} is not [groups, {}, {}, width]",
                mask.heads,
                mask.seq
            );
            assert_eq!(
                mask.masked.len(),
                shape.rows / per_group * mask.seq * shape.width,
                "mask bytes for {shape:?}"
            );
        }
    }
}

/// The probabilities of every row of `scores` into `probs` (see [`Softmax`]).
///
/// # Panics
/// When a buffer's length does not match `shape` (`scores`, `probs`: `rows * width`; the mask:
/// `rows / heads * width` bytes, `rows` a multiple of `heads * seq`).
pub fn forward(shape: Shape, softmax: &Softmax<'_>, scores: &[f32], probs: &mut [f32]) {
    softmax.check(shape, &[(scores.len(), "scores"), (probs.len(), "probs")]);
    let width = shape.width;
    if width == 0 {
        return;
    }
    let chunk = ROWS_PER_CHUNK * width;
    probs
        .par_chunks_mut(chunk)
        .zip(scores.par_chunks(chunk))
        .enumerate()
        .for_each(|(index, (probs, scores))| {
            for (offset, (p, s)) in probs
                .chunks_exact_mut(width)
                .zip(scores.chunks_exact(width))
                .enumerate()
            {
                let row = index * ROWS_PER_CHUNK + offset;
                match &softmax.mask {
                    Some(mask) => {
                        let masked = mask.row_of(row, width);
                        for ((p, &s), &m) in p.iter_mut().zip(s).zip(masked) {
                            *p = if m != 0 { mask.fill } else { s * softmax.scale };
                        }
                    }
                    None => {
                        for (p, &s) in p.iter_mut().zip(s) {
                            *p = s * softmax.scale;
                        }
                    }
                }
                normalise_row(p, softmax.quiet);
            }
        });
}

/// The maximum a row's softmax subtracts: the row's largest score, except that for a row of
/// -inf scores Burn's quiet softmax takes 0 (the row is then 0); the plain softmax gives NaN
/// there, as Burn's does.
pub(crate) fn softmax_max(row: &[f32], quiet: bool) -> f32 {
    let max = lane_max(row);
    if quiet && max == f32::NEG_INFINITY {
        0.0
    } else {
        max
    }
}

/// `row` (scaled, masked scores) into its probabilities, in place; returns the row's maximum
/// and inverse denominator (each probability is `exp(score - max) * inverse`, so
/// [`crate::attention`] recomputes the same bits from the two).
pub(crate) fn normalise_row(row: &mut [f32], quiet: bool) -> (f32, f32) {
    let max = softmax_max(row, quiet);
    for v in row.iter_mut() {
        *v = exp(*v - max);
    }
    let mut denominator = lane_sum(row);
    if quiet {
        denominator += exp(-max);
    }
    let inverse = 1.0 / denominator;
    for v in row.iter_mut() {
        *v *= inverse;
    }
    (max, inverse)
}

/// The gradient of the scores `dscores` (overwritten) from the probabilities [`forward`] wrote
/// and their gradient `dprobs`: `scale * p * (dp - sum(p * dp))`, 0 where masked (`mask_fill`
/// passes no gradient to what it replaced). The quiet softmax has the same Jacobian in terms
/// of its outputs.
///
/// # Panics
/// When a buffer's length does not match `shape`, as for [`forward`].
pub fn backward(
    shape: Shape,
    softmax: &Softmax<'_>,
    probs: &[f32],
    dprobs: &[f32],
    dscores: &mut [f32],
) {
    softmax.check(
        shape,
        &[
            (probs.len(), "probs"),
            (dprobs.len(), "dprobs"),
            (dscores.len(), "dscores"),
        ],
    );
    let width = shape.width;
    if width == 0 {
        return;
    }
    let chunk = ROWS_PER_CHUNK * width;
    dscores
        .par_chunks_mut(chunk)
        .zip(probs.par_chunks(chunk))
        .zip(dprobs.par_chunks(chunk))
        .enumerate()
        .for_each(|(index, ((dscores, probs), dprobs))| {
            for (offset, ((ds, p), dp)) in dscores
                .chunks_exact_mut(width)
                .zip(probs.chunks_exact(width))
                .zip(dprobs.chunks_exact(width))
                .enumerate()
            {
                let (_, dot) = lane_sum_and_dot(dp, p);
                let scale = softmax.scale;
                for ((ds, &p), &dp) in ds.iter_mut().zip(p).zip(dp) {
                    *ds = scale * p * (dp - dot);
                }
                if let Some(mask) = &softmax.mask {
                    let row = index * ROWS_PER_CHUNK + offset;
                    for (ds, &m) in ds.iter_mut().zip(mask.row_of(row, width)) {
                        if m != 0 {
                            *ds = 0.0;
                        }
                    }
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_same_on_1_2_3_threads, bits, uniform};

    fn data(n: usize, seed: u32) -> Vec<f32> {
        uniform(n, seed, 4.0)
    }

    /// The softmax and its gradient in f64, the textbook way.
    fn reference(
        shape: Shape,
        softmax: &Softmax<'_>,
        scores: &[f32],
        dprobs: &[f32],
    ) -> (Vec<f64>, Vec<f64>) {
        let Shape { rows, width } = shape;
        let mut probs = vec![0.0; rows * width];
        let mut dscores = vec![0.0; rows * width];
        for r in 0..rows {
            let masked = |j: usize| softmax.mask.is_some_and(|m| m.row_of(r, width)[j] != 0);
            let v: Vec<f64> = (0..width)
                .map(|j| match &softmax.mask {
                    Some(m) if masked(j) => f64::from(m.fill),
                    _ => f64::from(scores[r * width + j]) * f64::from(softmax.scale),
                })
                .collect();
            let max = v.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let e: Vec<f64> = v.iter().map(|x| (x - max).exp()).collect();
            let denominator =
                e.iter().sum::<f64>() + if softmax.quiet { (-max).exp() } else { 0.0 };
            let p: Vec<f64> = e.iter().map(|e| e / denominator).collect();
            let dot: f64 = (0..width)
                .map(|j| p[j] * f64::from(dprobs[r * width + j]))
                .sum();
            for j in 0..width {
                probs[r * width + j] = p[j];
                dscores[r * width + j] = if masked(j) {
                    0.0
                } else {
                    f64::from(softmax.scale) * p[j] * (f64::from(dprobs[r * width + j]) - dot)
                };
            }
        }
        (probs, dscores)
    }

    fn close(got: &[f32], want: &[f64], what: &str) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            assert!(
                (f64::from(g) - w).abs() <= 1e-5 * (w.abs() + 1e-3),
                "{what}[{i}]: {g} against {w}"
            );
        }
    }

    /// A causal mask `[groups, seq, seq]` with the first `padded` keys of group 0 masked too.
    fn causal(groups: usize, seq: usize, padded: usize) -> Vec<u8> {
        let mut mask = vec![0; groups * seq * seq];
        for g in 0..groups {
            for i in 0..seq {
                for j in 0..seq {
                    let masked = j > i || (g == 0 && j < padded);
                    mask[(g * seq + i) * seq + j] = u8::from(masked);
                }
            }
        }
        mask
    }

    #[test]
    fn matches_an_f64_reference_with_and_without_masks() {
        for (groups, heads, seq) in [(1, 1, 1), (1, 1, 7), (2, 3, 17), (3, 2, 40), (2, 4, 128)] {
            let shape = Shape {
                rows: groups * heads * seq,
                width: seq,
            };
            let scores = data(shape.rows * seq, 1);
            let dprobs = data(shape.rows * seq, 2);
            // Group 0's first two keys are masked for every query: its first two rows are
            // masked everywhere (uniform, as Burn's mask_fill and softmax make them).
            let mask = causal(groups, seq, 2.min(seq));
            for quiet in [false, true] {
                for masked in [false, true] {
                    let softmax = Softmax {
                        scale: 0.125,
                        quiet,
                        mask: masked.then_some(Mask {
                            masked: &mask,
                            heads,
                            seq,
                            fill: -1.0e4,
                        }),
                    };
                    let mut probs = vec![0.0; scores.len()];
                    forward(shape, &softmax, &scores, &mut probs);
                    let mut dscores = vec![0.0; scores.len()];
                    backward(shape, &softmax, &probs, &dprobs, &mut dscores);
                    let (want_p, want_ds) = reference(shape, &softmax, &scores, &dprobs);
                    close(&probs, &want_p, "probs");
                    close(&dscores, &want_ds, "dscores");
                }
            }
        }
    }

    #[test]
    fn results_are_the_same_bits_on_any_number_of_threads() {
        let (groups, heads, seq) = (3, 4, 50);
        let shape = Shape {
            rows: groups * heads * seq,
            width: seq,
        };
        let scores = data(shape.rows * seq, 3);
        let dprobs = data(shape.rows * seq, 4);
        let mask = causal(groups, seq, 0);
        let softmax = Softmax {
            scale: 0.3,
            quiet: false,
            mask: Some(Mask {
                masked: &mask,
                heads,
                seq,
                fill: -1.0e4,
            }),
        };
        assert_same_on_1_2_3_threads(|| {
            let mut probs = vec![0.0; scores.len()];
            forward(shape, &softmax, &scores, &mut probs);
            let mut dscores = vec![0.0; scores.len()];
            backward(shape, &softmax, &probs, &dprobs, &mut dscores);
            (bits(&probs), bits(&dscores))
        });
    }

    #[test]
    #[should_panic(expected = "mask bytes")]
    fn a_mask_of_the_wrong_size_is_refused() {
        let softmax = Softmax {
            scale: 1.0,
            quiet: false,
            mask: Some(Mask {
                masked: &[0; 3],
                heads: 1,
                seq: 2,
                fill: -1.0e4,
            }),
        };
        forward(
            Shape { rows: 2, width: 2 },
            &softmax,
            &[0.0; 4],
            &mut [0.0; 4],
        );
    }
}
