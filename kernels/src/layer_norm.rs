//! Layer normalisation over the last dimension of a row-major `[rows, width]` buffer, forward
//! and backward, each in one parallel pass over the rows.
//!
//! Burn's autodiff takes `layer_norm` apart into about a dozen element-wise and reduction
//! operations forward and as many backward, most of them full passes over the tensor on one
//! core. Here a row (a few hundred floats, in L1 cache) is read twice forward (its mean, then
//! its centred second moment: two passes are exact where a one-pass variance loses digits) and
//! written once; backward reads it once more for the two row sums of the input gradient.
//!
//! The results do not depend on the number of threads: rows are split into fixed chunks of
//! [`ROWS_PER_CHUNK`], each row is computed by one thread in a fixed order, and the parameter
//! gradients (sums over rows) are summed per chunk and then over the chunks in chunk order.
//!
//! ```
//! use accelerate_kernels::layer_norm::{forward, backward, Shape};
//!
//! let shape = Shape { rows: 2, width: 3 };
//! let x = [1.0, 2.0, 3.0, -1.0, 0.0, 1.0];
//! let (gamma, beta) = ([1.0; 3], [0.0; 3]);
//! let (y, stats) = forward(shape, &x, &gamma, Some(&beta[..]), 1e-5);
//! assert!((y[0] + 1.2247).abs() < 1e-3 && y[1].abs() < 1e-6);
//!
//! let mut grad = [1.0; 6]; // dy, then dx
//! let (mut dgamma, mut dbeta) = ([0.0; 3], [0.0; 3]);
//! backward(shape, &x, &gamma, &stats, &mut grad, &mut dgamma, &mut dbeta);
//! assert_eq!(dbeta, [2.0; 3]); // the sum of dy over the rows
//! assert!(grad.iter().all(|g| g.abs() < 1e-5)); // a constant shift does not change y
//! ```

// The output is allocated without clearing (`fresh::written_by`); the unsafe block says why
// every element is written.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use rayon::prelude::*;

use crate::fresh::written_by;

pub use crate::rows::Shape;
use crate::rows::{lane_centred_squares, lane_sum, lane_sum_and_dot};

/// Rows per parallel task: fixed, so the parameter gradients' summation order (and bits) does
/// not depend on the thread count; small enough that a transformer's batch gives every core
/// work (4,096 tokens make 128 tasks).
pub const ROWS_PER_CHUNK: usize = 32;

/// `y = (x - mean) / sqrt(var + epsilon) * gamma + beta` for every row, with the biased
/// variance (Burn's and PyTorch's `LayerNorm`), returned with each row's mean and reciprocal
/// standard deviation (`2 * rows` values: `[mean_0, rstd_0, mean_1, ...]`), which [`backward`]
/// needs.
///
/// # Panics
/// When a buffer's length does not match `shape` (`x`: `rows * width`; `gamma`, `beta`:
/// `width`): callers size them from the tensors' shapes.
pub fn forward(
    shape: Shape,
    x: &[f32],
    gamma: &[f32],
    beta: Option<&[f32]>,
    epsilon: f32,
) -> (Vec<f32>, Vec<f32>) {
    let Shape { rows, width } = shape;
    assert_eq!(x.len(), rows * width, "x");
    assert_eq!(gamma.len(), width, "gamma");
    assert!(beta.is_none_or(|b| b.len() == width), "beta");
    let mut stats = vec![0.0; 2 * rows];
    if width == 0 {
        return (Vec::new(), stats);
    }
    let chunk = ROWS_PER_CHUNK * width;
    let fill = |y: &mut [MaybeUninit<f32>]| {
        y.par_chunks_mut(chunk)
            .zip(x.par_chunks(chunk))
            .zip(stats.par_chunks_mut(2 * ROWS_PER_CHUNK))
            .for_each(|((y, x), stats)| {
                for ((y, x), stat) in y
                    .chunks_exact_mut(width)
                    .zip(x.chunks_exact(width))
                    .zip(stats.chunks_exact_mut(2))
                {
                    let n = width as f32;
                    let mean = lane_sum(x) / n;
                    let var = lane_centred_squares(x, mean) / n;
                    let rstd = 1.0 / (var + epsilon).sqrt();
                    stat[0] = mean;
                    stat[1] = rstd;
                    // Zipped iterators: equal lengths are known, so the loops vectorise.
                    match beta {
                        Some(beta) => {
                            for (((y, &x), &g), &b) in y.iter_mut().zip(x).zip(gamma).zip(beta) {
                                y.write((x - mean) * rstd * g + b);
                            }
                        }
                        None => {
                            for ((y, &x), &g) in y.iter_mut().zip(x).zip(gamma) {
                                y.write((x - mean) * rstd * g);
                            }
                        }
                    }
                }
            });
    };
    // SAFETY: `y` and `x` split into the same chunks of whole rows (`rows * width` values
    // each), every row of `y` is zipped with a row of `x` and a `gamma` (and `beta`) of `width`
    // values, so every element is written.
    let y = unsafe { written_by(rows * width, fill) };
    (y, stats)
}

/// The gradients of [`forward`] for the output gradient `dy`, which `grad` holds and which
/// becomes `dx` in place (each row is read before it is written: no second buffer of the
/// activation's size), and the gradients of `gamma` and `beta` (overwritten; `dbeta` is the sum
/// of `dy` over rows). With `xhat = (x - mean) * rstd` and `g = dy * gamma`:
/// `dx = rstd * (g - mean(g) - xhat * mean(g * xhat))`, `dgamma = sum(dy * xhat)`.
///
/// # Panics
/// When a buffer's length does not match `shape`, as for [`forward`].
pub fn backward(
    shape: Shape,
    x: &[f32],
    gamma: &[f32],
    stats: &[f32],
    grad: &mut [f32],
    dgamma: &mut [f32],
    dbeta: &mut [f32],
) {
    let Shape { rows, width } = shape;
    assert_eq!(x.len(), rows * width, "x");
    assert_eq!(grad.len(), rows * width, "dy");
    assert_eq!(gamma.len(), width, "gamma");
    assert_eq!(dgamma.len(), width, "dgamma");
    assert_eq!(dbeta.len(), width, "dbeta");
    assert_eq!(stats.len(), 2 * rows, "stats");
    dgamma.fill(0.0);
    dbeta.fill(0.0);
    if width == 0 || rows == 0 {
        return;
    }
    let chunk = ROWS_PER_CHUNK * width;
    // Each task: its rows' dx, and its partial dgamma and dbeta (2 * width), summed below in
    // chunk order.
    let partials: Vec<Vec<f32>> = grad
        .par_chunks_mut(chunk)
        .zip(x.par_chunks(chunk))
        .zip(stats.par_chunks(2 * ROWS_PER_CHUNK))
        .map(|((grad, x), stats)| {
            let mut partial = vec![0.0_f32; 2 * width];
            let (pg, pb) = partial.split_at_mut(width);
            let mut g = vec![0.0_f32; width];
            let mut xhat = vec![0.0_f32; width];
            for ((row, x), stat) in grad
                .chunks_exact_mut(width)
                .zip(x.chunks_exact(width))
                .zip(stats.chunks_exact(2))
            {
                // `row` holds this row's dy until the last loop overwrites it with dx.
                let (mean, rstd) = (stat[0], stat[1]);
                for (((((xh, gi), pg), pb), &x), (&dy, &gamma)) in xhat
                    .iter_mut()
                    .zip(g.iter_mut())
                    .zip(pg.iter_mut())
                    .zip(pb.iter_mut())
                    .zip(x)
                    .zip(row.iter().zip(gamma))
                {
                    *xh = (x - mean) * rstd;
                    *gi = dy * gamma;
                    *pg += dy * *xh;
                    *pb += dy;
                }
                let (sum_g, sum_gx) = lane_sum_and_dot(&g, &xhat);
                let n = width as f32;
                let (mean_g, mean_gx) = (sum_g / n, sum_gx / n);
                for ((dx, &g), &xh) in row.iter_mut().zip(&g).zip(&xhat) {
                    *dx = rstd * (g - mean_g - xh * mean_gx);
                }
            }
            partial
        })
        .collect();
    for partial in &partials {
        let (pg, pb) = partial.split_at(width);
        for i in 0..width {
            dgamma[i] += pg[i];
            dbeta[i] += pb[i];
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_same_on_1_2_3_threads, bits, uniform};

    /// Layer norm in f64, the textbook way (forward output; gradients by the formula's parts).
    fn reference(
        shape: Shape,
        x: &[f32],
        gamma: &[f32],
        beta: &[f32],
        dy: &[f32],
        eps: f64,
    ) -> (Vec<f64>, Vec<f64>, Vec<f64>, Vec<f64>) {
        let Shape { rows, width } = shape;
        let n = width as f64;
        let mut y = vec![0.0; rows * width];
        let mut dx = vec![0.0; rows * width];
        let mut dgamma = vec![0.0; width];
        let mut dbeta = vec![0.0; width];
        for r in 0..rows {
            let row = &x[r * width..(r + 1) * width];
            let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / n;
            let var = row
                .iter()
                .map(|&v| (f64::from(v) - mean).powi(2))
                .sum::<f64>()
                / n;
            let rstd = 1.0 / (var + eps).sqrt();
            let xhat: Vec<f64> = row.iter().map(|&v| (f64::from(v) - mean) * rstd).collect();
            let d = &dy[r * width..(r + 1) * width];
            let g: Vec<f64> = (0..width)
                .map(|i| f64::from(d[i]) * f64::from(gamma[i]))
                .collect();
            let mean_g = g.iter().sum::<f64>() / n;
            let mean_gx = (0..width).map(|i| g[i] * xhat[i]).sum::<f64>() / n;
            for i in 0..width {
                y[r * width + i] = xhat[i] * f64::from(gamma[i]) + f64::from(beta[i]);
                dx[r * width + i] = rstd * (g[i] - mean_g - xhat[i] * mean_gx);
                dgamma[i] += f64::from(d[i]) * xhat[i];
                dbeta[i] += f64::from(d[i]);
            }
        }
        (y, dx, dgamma, dbeta)
    }

    fn data(n: usize, seed: u32) -> Vec<f32> {
        uniform(n, seed, 2.0)
    }

    fn close(got: &[f32], want: &[f64], scale: f64, what: &str) {
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let tolerance = 1e-5 * (w.abs() + scale);
            assert!(
                (f64::from(g) - w).abs() <= tolerance,
                "{what}[{i}]: {g} against {w}"
            );
        }
    }

    #[test]
    fn forward_and_backward_match_an_f64_reference_on_odd_shapes() {
        for (rows, width) in [(1, 1), (1, 7), (3, 16), (33, 17), (65, 256), (100, 1000)] {
            let shape = Shape { rows, width };
            let x = data(rows * width, 1);
            let gamma = data(width, 2);
            let beta = data(width, 3);
            let dy = data(rows * width, 4);
            let (y, stats) = forward(shape, &x, &gamma, Some(&beta), 1e-5);
            let (mut dx, mut dgamma, mut dbeta) = (dy.clone(), vec![0.0; width], vec![0.0; width]);
            backward(shape, &x, &gamma, &stats, &mut dx, &mut dgamma, &mut dbeta);
            let (ry, rdx, rdgamma, rdbeta) = reference(shape, &x, &gamma, &beta, &dy, 1e-5);
            // Sums over many rows carry the rounding of each addend: scaled by the row count.
            close(&y, &ry, 1.0, "y");
            close(&dx, &rdx, 1.0, "dx");
            close(&dgamma, &rdgamma, rows as f64, "dgamma");
            close(&dbeta, &rdbeta, rows as f64, "dbeta");
        }
    }

    #[test]
    fn results_are_the_same_bits_on_any_number_of_threads() {
        let shape = Shape {
            rows: 300,
            width: 96,
        };
        let x = data(shape.rows * shape.width, 5);
        let gamma = data(shape.width, 6);
        let dy = data(shape.rows * shape.width, 7);
        assert_same_on_1_2_3_threads(|| {
            let (y, stats) = forward(shape, &x, &gamma, None, 1e-5);
            let (mut dx, mut dg, mut db) =
                (dy.clone(), vec![0.0; shape.width], vec![0.0; shape.width]);
            backward(shape, &x, &gamma, &stats, &mut dx, &mut dg, &mut db);
            (bits(&y), bits(&dx), bits(&dg), bits(&db))
        });
    }

    #[test]
    fn a_constant_row_normalises_to_beta() {
        let shape = Shape { rows: 1, width: 5 };
        let (y, stats) = forward(shape, &[3.0; 5], &[2.0; 5], Some(&[0.5; 5]), 1e-5);
        assert_eq!(y, [0.5; 5]);
        assert_eq!(stats[0], 3.0);
    }
}
