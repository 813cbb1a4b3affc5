//! A linear layer, `y = x W + b`, on f32 rows: the forward product with the bias in the same
//! pass, and the three gradients (`dx = dy W^T`, `dW = x^T dy`, `db` the column sums of `dy`).
//!
//! Burn's `linear` on Flex gets the products right but not what surrounds them: every output
//! is zero-filled, then copied once more to meet the storage's alignment, on the calling thread,
//! before the parallel product starts; the bias is a separate broadcast pass and its gradient a
//! single-threaded reduction. Here the product writes straight into a fresh buffer (nothing
//! cleared first, nothing copied after), the bias is added in a parallel pass, and the bias
//! gradient is a parallel pass over column blocks. The weight may be any strided view (a transposed
//! embedding for tied output layers), as the `gemm` crate packs it either way.
//!
//! The same bits on any number of threads: the products split the output, never the depth
//! (see `matmul`), and each column of the bias gradient is summed by one task in row order.
//!
//! ```
//! use accelerate_kernels::linear::{self, Weight};
//!
//! // x: 2 rows of 3; W: 3 x 2; b: 2.
//! let x = [1.0, 2.0, 3.0, 4.0, 5.0, 6.0];
//! let w = [1.0, 0.0, 0.0, 1.0, 1.0, 1.0];
//! let y = linear::forward(&x, Weight::rows_of(&w, 3, 2), Some(&[0.5, -0.5]));
//! assert_eq!(y, [4.5, 4.5, 10.5, 10.5]);
//! let dy = [1.0, 0.0, 0.0, 1.0];
//! assert_eq!(linear::bias_grad(&dy, 2), [1.0, 1.0]);
//! assert_eq!(linear::weight_grad(&x, &dy, 3, 2), [1.0, 4.0, 2.0, 5.0, 3.0, 6.0]);
//! ```

use rayon::prelude::*;

use crate::element::{DType, Element};
use crate::matmul::{self, Mat};

/// Rows of `dy` per bias-gradient task: enough to pay for a task, few enough that a step's
/// `[tokens, d_out]` gradients give both cores dozens of tasks.
const BIAS_ROWS_PER_TASK: usize = 128;

/// Output rows per task when the bias is added to the product.
const ROWS_PER_TASK: usize = 64;

/// A `d_in x d_out` weight matrix inside a slice: element `(i, o)` is
/// `data[offset + i * row_stride + o * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct Weight<'a> {
    /// The buffer the weight lives in.
    pub data: &'a [f32],
    /// Where element `(0, 0)` is.
    pub offset: usize,
    /// Input features (rows).
    pub d_in: usize,
    /// Output features (columns).
    pub d_out: usize,
    /// Distance between rows.
    pub row_stride: usize,
    /// Distance between columns.
    pub col_stride: usize,
}

impl<'a> Weight<'a> {
    /// A row-major `d_in x d_out` weight filling the start of `data`.
    pub fn rows_of(data: &'a [f32], d_in: usize, d_out: usize) -> Self {
        Self {
            data,
            offset: 0,
            d_in,
            d_out,
            row_stride: d_out,
            col_stride: 1,
        }
    }

    fn mat(self) -> Mat<'a> {
        Mat {
            data: self.data,
            offset: self.offset,
            rows: self.d_in,
            cols: self.d_out,
            row_stride: self.row_stride,
            col_stride: self.col_stride,
        }
    }
}

/// The rows of a row-major matrix of `values` with `width` columns.
///
/// # Panics
/// When `values` is not a whole number of rows.
fn rows<E>(values: &[E], width: usize, what: &str) -> usize {
    if width == 0 {
        assert!(
            values.is_empty(),
            "linear: {what} has values but no columns"
        );
        return 0;
    }
    assert!(
        values.len().is_multiple_of(width),
        "linear: {what} has {} values, not rows of {width}",
        values.len()
    );
    values.len() / width
}

/// `x W + b`, row-major `[rows, d_out]`, for `x` row-major `[rows, d_in]`.
///
/// # Panics
/// When `x` is not rows of `d_in`, the bias is not `d_out` wide, or the weight reaches past its
/// slice.
pub fn forward(x: &[f32], weight: Weight<'_>, bias: Option<&[f32]>) -> Vec<f32> {
    let n = rows(x, weight.d_in, "x");
    let x = Mat::rows_of(x, 0, [n, weight.d_in], weight.d_in);
    let mut y = matmul::product(x, weight.mat());
    if let Some(bias) = bias {
        assert_eq!(
            bias.len(),
            weight.d_out,
            "linear: a bias of {} for {} outputs",
            bias.len(),
            weight.d_out
        );
        if weight.d_out > 0 {
            y.par_chunks_mut(ROWS_PER_TASK * weight.d_out)
                .for_each(|block| {
                    for row in block.chunks_exact_mut(weight.d_out) {
                        row.iter_mut().zip(bias).for_each(|(y, b)| *y += b);
                    }
                });
        }
    }
    y
}

/// `dy W^T`, row-major `[rows, d_in]`: the gradient of `x` for `dy` row-major `[rows, d_out]`.
///
/// # Panics
/// When `dy` is not rows of `d_out`, or the weight reaches past its slice.
pub fn input_grad(dy: &[f32], weight: Weight<'_>) -> Vec<f32> {
    let n = rows(dy, weight.d_out, "dy");
    matmul::product(
        Mat::rows_of(dy, 0, [n, weight.d_out], weight.d_out),
        weight.mat().t(),
    )
}

/// `x^T dy`, row-major `[d_in, d_out]`: the gradient of the weight.
///
/// # Panics
/// When `x` and `dy` are not rows of `d_in` and `d_out`, or not as many rows.
pub fn weight_grad(x: &[f32], dy: &[f32], d_in: usize, d_out: usize) -> Vec<f32> {
    let n = rows(x, d_in, "x");
    assert_eq!(
        rows(dy, d_out, "dy"),
        n,
        "linear: x and dy have different numbers of rows"
    );
    matmul::product(
        Mat::rows_of(x, 0, [n, d_in], d_in).t(),
        Mat::rows_of(dy, 0, [n, d_out], d_out),
    )
}

/// The column sums of `dy` (row-major, `d_out` wide; f32, or bf16/f16 summed in f32): the
/// gradient of the bias.
///
/// Each task sums a fixed block of rows (contiguous memory, which the prefetcher streams), then
/// the blocks' sums are added in block order: the same bits on any number of threads.
///
/// # Panics
/// When `dy` is not rows of `d_out`.
pub fn bias_grad<E: Element>(dy: &[E], d_out: usize) -> Vec<f32> {
    rows(dy, d_out, "dy");
    if d_out == 0 {
        return Vec::new();
    }
    let partials: Vec<Vec<f32>> = dy
        .par_chunks(BIAS_ROWS_PER_TASK * d_out)
        .map(|block| {
            let (mut sums, mut wide) = (vec![0.0; d_out], vec![0.0f32; d_out]);
            for row in block.chunks_exact(d_out) {
                // Half precision widened first (f16 with F16C), then summed: the same values.
                let row: &[f32] = match bytemuck::try_cast_slice::<E, f32>(row) {
                    Ok(row) if E::DTYPE == DType::F32 => row,
                    _ => {
                        crate::cast::widen_into(row, &mut wide);
                        &wide
                    }
                };
                sums.iter_mut().zip(row).for_each(|(sum, v)| *sum += v);
            }
            sums
        })
        .collect();
    let mut sums = vec![0.0; d_out];
    for partial in &partials {
        sums.iter_mut().zip(partial).for_each(|(sum, v)| *sum += v);
    }
    sums
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::test_support::{assert_same_on_1_2_3_threads, bits, uniform};

    /// The textbook definitions in f64.
    fn reference(x: &[f32], w: &[f32], d_in: usize, d_out: usize) -> Vec<f64> {
        x.chunks_exact(d_in)
            .flat_map(|row| {
                (0..d_out).map(move |o| {
                    (0..d_in)
                        .map(|i| f64::from(row[i]) * f64::from(w[i * d_out + o]))
                        .sum::<f64>()
                })
            })
            .collect()
    }

    fn assert_close(got: &[f32], want: &[f64], what: &str) {
        assert_eq!(got.len(), want.len(), "{what}: length");
        for (i, (g, w)) in got.iter().zip(want).enumerate() {
            let tolerance = 1e-5 * (1.0 + w.abs());
            assert!(
                (f64::from(*g) - w).abs() <= tolerance,
                "{what}[{i}]: {g} against {w}"
            );
        }
    }

    /// Odd shapes, one row, one input, one output, and a product large enough to be split.
    const SHAPES: [[usize; 3]; 6] = [
        [1, 1, 1],
        [1, 7, 5],
        [13, 1, 9],
        [17, 33, 1],
        [37, 65, 129],
        [300, 200, 190],
    ];

    #[test]
    fn forward_and_gradients_match_the_definitions() {
        for [n, d_in, d_out] in SHAPES {
            let x = uniform(n * d_in, 1, 1.0);
            let w = uniform(d_in * d_out, 2, 0.5);
            let b = uniform(d_out, 3, 0.5);
            let dy = uniform(n * d_out, 4, 1.0);
            let weight = Weight::rows_of(&w, d_in, d_out);
            let mut want = reference(&x, &w, d_in, d_out);
            for (i, v) in want.iter_mut().enumerate() {
                *v += f64::from(b[i % d_out]);
            }
            assert_close(&forward(&x, weight, Some(&b)), &want, "y");
            // dx = dy W^T: the reference with W^T as the weight.
            let wt: Vec<f32> = (0..d_out * d_in)
                .map(|j| w[(j % d_in) * d_out + j / d_in])
                .collect();
            assert_close(
                &input_grad(&dy, weight),
                &reference(&dy, &wt, d_out, d_in),
                "dx",
            );
            // dW = x^T dy: the reference over x^T's rows.
            let xt: Vec<f32> = (0..d_in * n).map(|j| x[(j % n) * d_in + j / n]).collect();
            assert_close(
                &weight_grad(&x, &dy, d_in, d_out),
                &reference(&xt, &dy, n, d_out),
                "dW",
            );
            let db: Vec<f64> = (0..d_out)
                .map(|o| (0..n).map(|r| f64::from(dy[r * d_out + o])).sum())
                .collect();
            assert_close(&bias_grad(&dy, d_out), &db, "db");
        }
    }

    /// A tied output layer's weight: the transpose of a `[vocab, d_model]` embedding, no copy.
    /// The bias gradient of bf16 and f16 gradients is, bit for bit, that of the same values
    /// widened to f32 (summed in f32 in the same order).
    #[test]
    fn half_bias_gradients_are_sums_in_f32() {
        let (n, d_out) = (3 * BIAS_ROWS_PER_TASK + 5, 37);
        let dy = uniform(n * d_out, 21, 3.0);
        let bf: Vec<half::bf16> = dy.iter().map(|&v| half::bf16::from_f32(v)).collect();
        let wide: Vec<f32> = bf.iter().map(|v| v.to_f32()).collect();
        assert_eq!(bits(&bias_grad(&bf, d_out)), bits(&bias_grad(&wide, d_out)));
        let h: Vec<half::f16> = dy.iter().map(|&v| half::f16::from_f32(v)).collect();
        let wide: Vec<f32> = h.iter().map(|v| v.to_f32()).collect();
        assert_eq!(bits(&bias_grad(&h, d_out)), bits(&bias_grad(&wide, d_out)));
    }

    #[test]
    fn a_transposed_weight_view_is_read_in_place() {
        let (n, d_in, d_out) = (9, 6, 11);
        let embedding = uniform(d_out * d_in, 5, 1.0);
        let x = uniform(n * d_in, 6, 1.0);
        let dy = uniform(n * d_out, 7, 1.0);
        let view = Weight {
            data: &embedding,
            offset: 0,
            d_in,
            d_out,
            row_stride: 1,
            col_stride: d_in,
        };
        // The same weight copied out row-major, and the embedding itself as dx's weight.
        let copy: Vec<f32> = (0..d_in * d_out)
            .map(|j| embedding[(j % d_out) * d_in + j / d_out])
            .collect();
        assert_close(
            &forward(&x, view, None),
            &reference(&x, &copy, d_in, d_out),
            "y",
        );
        assert_close(
            &input_grad(&dy, view),
            &reference(&dy, &embedding, d_out, d_in),
            "dx",
        );
    }

    #[test]
    fn the_same_bits_on_any_number_of_threads() {
        let [n, d_in, d_out] = [300, 200, 190];
        let x = uniform(n * d_in, 8, 1.0);
        let w = uniform(d_in * d_out, 9, 0.5);
        let b = uniform(d_out, 10, 0.5);
        let dy = uniform(n * d_out, 11, 1.0);
        assert_same_on_1_2_3_threads(|| {
            let weight = Weight::rows_of(&w, d_in, d_out);
            [
                bits(&forward(&x, weight, Some(&b))),
                bits(&input_grad(&dy, weight)),
                bits(&weight_grad(&x, &dy, d_in, d_out)),
                bits(&bias_grad(&dy, d_out)),
            ]
        });
    }

    #[test]
    #[should_panic(expected = "linear: x has 7 values, not rows of 3")]
    fn a_ragged_input_is_refused() {
        let w = [0.0; 6];
        forward(&[0.0; 7], Weight::rows_of(&w, 3, 2), None);
    }

    #[test]
    #[should_panic(expected = "matmul: b reaches")]
    fn a_weight_past_its_slice_is_refused() {
        let w = [0.0; 5];
        forward(&[0.0; 3], Weight::rows_of(&w, 3, 2), None);
    }
}
