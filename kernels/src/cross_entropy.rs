//! Softmax cross-entropy of rows of logits against one target class per row, forward and
//! backward, each in one parallel pass over the rows.
//!
//! `log_softmax(logits).gather(targets).neg()` in Burn's autodiff is the log-softmax's
//! decomposition (max, subtract, exp, sum, log, subtract) and a gather, each tracked: a dozen
//! passes over the `[tokens, vocabulary]` logits forward and backward. Here the forward pass
//! reads each row twice (its maximum, then its sum of exponentials) and keeps one number per
//! row, the log-sum-exp; backward writes `softmax - one_hot` times the row's loss gradient in
//! one pass.
//!
//! Each row is computed by one thread in a fixed order: the bits do not depend on the number of
//! threads.
//!
//! ```
//! use accelerate_kernels::cross_entropy::{backward, forward};
//! use accelerate_kernels::rows::Shape;
//!
//! let shape = Shape { rows: 1, width: 2 };
//! let (mut losses, mut lse) = ([0.0], [0.0]);
//! forward(shape, &[0.0, 0.0], &[1], &mut losses, &mut lse);
//! assert!((losses[0] - 2.0_f32.ln()).abs() < 1e-6); // two equally likely classes
//!
//! let mut dlogits = [0.0; 2];
//! backward(shape, &[0.0, 0.0], &[1], &lse, &[1.0], &mut dlogits);
//! assert!((dlogits[0] - 0.5).abs() < 1e-6 && (dlogits[1] + 0.5).abs() < 1e-6);
//! ```

use rayon::prelude::*;

use crate::rows::{Shape, exp, lane_max, lane_sum};

/// Rows per parallel task (fixed, so the same bits on any number of threads).
pub const ROWS_PER_CHUNK: usize = 16;

/// Checks the lengths and every target; panics naming the first that does not fit.
fn check(shape: Shape, logits: usize, targets: &[i64], per_row: &[(usize, &str)]) {
    assert_eq!(logits, shape.rows * shape.width, "logits for {shape:?}");
    assert_eq!(targets.len(), shape.rows, "targets for {shape:?}");
    for &(len, what) in per_row {
        assert_eq!(len, shape.rows, "{what} for {shape:?}");
    }
    if let Some((row, target)) = targets
        .iter()
        .enumerate()
        .find(|&(_, &t)| usize::try_from(t).map_or(true, |t| t >= shape.width))
    {
        panic!(
            "cross-entropy: target {target} of row {row} is not a class of {} (0..{})",
            shape.width, shape.width
        );
    }
}

/// Each row's loss `logsumexp(row) - row[target]` into `losses`, and its log-sum-exp into
/// `lse` (what [`backward`] needs).
///
/// # Panics
/// When a buffer's length does not match `shape` (`logits`: `rows * width`; `targets`,
/// `losses`, `lse`: `rows`), or a target is not in `0..width`.
pub fn forward(shape: Shape, logits: &[f32], targets: &[i64], losses: &mut [f32], lse: &mut [f32]) {
    check(
        shape,
        logits.len(),
        targets,
        &[(losses.len(), "losses"), (lse.len(), "lse")],
    );
    let width = shape.width;
    if width == 0 {
        return;
    }
    losses
        .par_chunks_mut(ROWS_PER_CHUNK)
        .zip(lse.par_chunks_mut(ROWS_PER_CHUNK))
        .zip(logits.par_chunks(ROWS_PER_CHUNK * width))
        .zip(targets.par_chunks(ROWS_PER_CHUNK))
        .for_each(|(((losses, lse), logits), targets)| {
            let mut shifted = vec![0.0_f32; width];
            for (((loss, lse), row), &target) in losses
                .iter_mut()
                .zip(lse.iter_mut())
                .zip(logits.chunks_exact(width))
                .zip(targets)
            {
                let max = lane_max(row);
                for (e, &x) in shifted.iter_mut().zip(row) {
                    *e = exp(x - max);
                }
                *lse = max + lane_sum(&shifted).ln();
                // `check` put every target in 0..width.
                let picked = usize::try_from(target).map_or(0.0, |t| row[t]);
                *loss = *lse - picked;
            }
        });
}

/// The logits' gradient `dlogits` (overwritten) for the losses' gradient `dlosses`:
/// `dloss * (softmax(row) - one_hot(target))`, from the log-sum-exp [`forward`] kept.
///
/// # Panics
/// As [`forward`].
pub fn backward(
    shape: Shape,
    logits: &[f32],
    targets: &[i64],
    lse: &[f32],
    dlosses: &[f32],
    dlogits: &mut [f32],
) {
    check(
        shape,
        logits.len(),
        targets,
        &[(lse.len(), "lse"), (dlosses.len(), "dlosses")],
    );
    assert_eq!(dlogits.len(), logits.len(), "dlogits for {shape:?}");
    let width = shape.width;
    if width == 0 {
        return;
    }
    let chunk = ROWS_PER_CHUNK * width;
    dlogits
        .par_chunks_mut(chunk)
        .zip(logits.par_chunks(chunk))
        .zip(targets.par_chunks(ROWS_PER_CHUNK))
        .zip(
            lse.par_chunks(ROWS_PER_CHUNK)
                .zip(dlosses.par_chunks(ROWS_PER_CHUNK)),
        )
        .for_each(|(((dlogits, logits), targets), (lse, dlosses))| {
            for ((((d, row), &target), &lse), &dloss) in dlogits
                .chunks_exact_mut(width)
                .zip(logits.chunks_exact(width))
                .zip(targets)
                .zip(lse)
                .zip(dlosses)
            {
                for (d, &x) in d.iter_mut().zip(row) {
                    *d = dloss * exp(x - lse);
                }
                if let Some(d) = usize::try_from(target).ok().and_then(|t| d.get_mut(t)) {
                    *d -= dloss;
                }
            }
        });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_same_on_1_2_3_threads, bits, uniform};

    fn data(n: usize, seed: u32) -> Vec<f32> {
        uniform(n, seed, 10.0)
    }

    #[test]
    fn matches_an_f64_reference_on_odd_shapes() {
        for (rows, width) in [(1, 1), (1, 5), (17, 3), (33, 256), (40, 1000)] {
            let shape = Shape { rows, width };
            let logits = data(rows * width, 1);
            let targets: Vec<i64> = (0..rows).map(|r| ((r * 7 + 3) % width) as i64).collect();
            let dlosses = data(rows, 2);
            let (mut losses, mut lse) = (vec![0.0; rows], vec![0.0; rows]);
            forward(shape, &logits, &targets, &mut losses, &mut lse);
            let mut dlogits = vec![0.0; rows * width];
            backward(shape, &logits, &targets, &lse, &dlosses, &mut dlogits);
            for r in 0..rows {
                let row: Vec<f64> = logits[r * width..(r + 1) * width]
                    .iter()
                    .map(|&x| f64::from(x))
                    .collect();
                let max = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let want_lse = max + row.iter().map(|x| (x - max).exp()).sum::<f64>().ln();
                let t = targets[r] as usize;
                let want = want_lse - row[t];
                let got = f64::from(losses[r]);
                assert!((got - want).abs() <= 1e-5 * (want.abs() + 1.0), "loss {r}");
                for (j, &x) in row.iter().enumerate() {
                    let p = (x - want_lse).exp() - if j == t { 1.0 } else { 0.0 };
                    let want = f64::from(dlosses[r]) * p;
                    let got = f64::from(dlogits[r * width + j]);
                    // Where p is near 1, `p - 1` cancels (in f32 as in Burn): absolute error
                    // against the gradient's scale, |dloss|.
                    let tolerance = 1e-5 * want.abs() + 1e-6 * f64::from(dlosses[r]).abs();
                    assert!(
                        (got - want).abs() <= tolerance,
                        "d[{r},{j}]: {got} against {want}"
                    );
                }
            }
        }
    }

    #[test]
    fn results_are_the_same_bits_on_any_number_of_threads() {
        let shape = Shape {
            rows: 100,
            width: 77,
        };
        let logits = data(shape.rows * shape.width, 3);
        let targets: Vec<i64> = (0..shape.rows).map(|r| (r % 77) as i64).collect();
        let dlosses = vec![1.0; shape.rows];
        assert_same_on_1_2_3_threads(|| {
            let (mut losses, mut lse) = (vec![0.0; shape.rows], vec![0.0; shape.rows]);
            forward(shape, &logits, &targets, &mut losses, &mut lse);
            let mut d = vec![0.0; logits.len()];
            backward(shape, &logits, &targets, &lse, &dlosses, &mut d);
            (bits(&losses), bits(&d))
        });
    }

    #[test]
    #[should_panic(expected = "target 3 of row 1 is not a class of 3")]
    fn a_target_outside_the_vocabulary_is_named() {
        let shape = Shape { rows: 2, width: 3 };
        forward(shape, &[0.0; 6], &[0, 3], &mut [0.0; 2], &mut [0.0; 2]);
    }

    #[test]
    #[should_panic(expected = "target -1 of row 0")]
    fn a_negative_target_is_named() {
        let shape = Shape { rows: 1, width: 3 };
        forward(shape, &[0.0; 3], &[-1], &mut [0.0], &mut [0.0]);
    }
}
