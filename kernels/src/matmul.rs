//! Strided f32 matrix products through the `gemm` crate (Burn's Flex uses the same one): on
//! one thread for the products inside our fused kernels' tiles (each called from one rayon
//! task), and over the rayon pool for a linear layer's whole products. Either way every element
//! is summed in the same order whatever the number of threads: gemm splits the rows and columns
//! of the destination among threads, never the depth, and its depth blocking depends only on
//! the shapes and the caches. The unsafe calls are here, after the views' extents were checked
//! against their slices.

#![allow(unsafe_code)]

/// A read-only matrix view: element `(r, c)` is `data[offset + r * row_stride + c * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Mat<'a> {
    /// The buffer the matrix lives in.
    pub data: &'a [f32],
    /// Where element `(0, 0)` is.
    pub offset: usize,
    /// Rows.
    pub rows: usize,
    /// Columns.
    pub cols: usize,
    /// Distance between rows.
    pub row_stride: usize,
    /// Distance between columns.
    pub col_stride: usize,
}

impl<'a> Mat<'a> {
    /// `rows x cols` values of `data` from `offset`, rows `row_stride` apart, each row's
    /// values adjacent.
    pub(crate) fn rows_of(
        data: &'a [f32],
        offset: usize,
        [rows, cols]: [usize; 2],
        row_stride: usize,
    ) -> Self {
        Self {
            data,
            offset,
            rows,
            cols,
            row_stride,
            col_stride: 1,
        }
    }

    /// Rows `start..start + count` of the view (no copy).
    pub(crate) fn rows_from(self, start: usize, count: usize) -> Self {
        Self {
            offset: self.offset + start * self.row_stride,
            rows: count,
            ..self
        }
    }

    /// The transposed view (no copy).
    pub(crate) fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }
}

/// One past the largest index a `rows x cols` view at `offset` reaches (`offset` when empty).
fn extent(offset: usize, rows: usize, cols: usize, row_stride: usize, col_stride: usize) -> usize {
    if rows == 0 || cols == 0 {
        return offset;
    }
    offset + (rows - 1) * row_stride + (cols - 1) * col_stride + 1
}

/// `dst = a b` (or `dst += a b` when `accumulate`), times `factor`, for a row-major `dst` of
/// `a.rows x b.cols` with row stride `dst_row_stride` from `dst_offset`.
///
/// # Panics
/// When the shapes do not chain, or a view reaches past its slice.
pub(crate) fn matmul(
    dst: &mut [f32],
    dst_offset: usize,
    dst_row_stride: usize,
    a: Mat<'_>,
    b: Mat<'_>,
    factor: f32,
    accumulate: bool,
) {
    assert_eq!(
        a.cols, b.rows,
        "matmul: {}x{} by {}x{}",
        a.rows, a.cols, b.rows, b.cols
    );
    let (m, n, k) = (a.rows, b.cols, a.cols);
    check_operands(a, b);
    let dst_extent = extent(dst_offset, m, n, dst_row_stride, 1);
    assert!(
        dst_extent <= dst.len(),
        "matmul: dst reaches {dst_extent} of {} values",
        dst.len()
    );
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            for row in 0..m {
                let start = dst_offset + row * dst_row_stride;
                dst[start..start + n].fill(0.0);
            }
        }
        return;
    }
    // SAFETY: every element the three views address lies inside its slice (checked above), and
    // the destination is borrowed mutably and so aliases neither operand.
    unsafe {
        call_gemm(
            dst.as_mut_ptr().add(dst_offset),
            dst_row_stride,
            accumulate,
            a,
            b,
            factor,
            gemm::Parallelism::None,
        );
    }
}

/// Products below this many multiply-adds run on the calling thread (Burn's Flex uses the same
/// threshold): splitting them costs more than it saves. The bits are the same either way.
const PARALLEL_FROM: usize = 192 * 192 * 192;

/// `a b` as a new row-major `a.rows x b.cols` matrix, the product spread over the current
/// rayon pool when it is large enough. The bits do not depend on the number of threads.
///
/// # Panics
/// When the shapes do not chain, or a view reaches past its slice.
pub(crate) fn product(a: Mat<'_>, b: Mat<'_>) -> Vec<f32> {
    assert_eq!(
        a.cols, b.rows,
        "matmul: {}x{} by {}x{}",
        a.rows, a.cols, b.rows, b.cols
    );
    check_operands(a, b);
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let len = m.checked_mul(n).expect("a product's size fits usize");
    if k == 0 || len == 0 {
        return vec![0.0; len];
    }
    let parallelism = if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_FROM {
        gemm::Parallelism::Rayon(0)
    } else {
        gemm::Parallelism::None
    };
    // Zeros first: gemm 0.19 writes every destination element without reading it when
    // `read_dst` is false, but does not document that, so it is never handed uninitialised
    // memory. Clearing the 17.6 MB a linear layer's forward and backward write here cost about
    // 3 % of that op (RESULTS, issue 59).
    let mut dst = vec![0.0; len];
    // SAFETY: the operands were checked to lie inside their slices; `dst` holds the `m x n`
    // values and is a separate allocation.
    unsafe {
        call_gemm(dst.as_mut_ptr(), n, false, a, b, 1.0, parallelism);
    }
    dst
}

/// `dst (+)= factor a b` for a row-major destination at `dst` with rows `dst_row_stride` apart.
///
/// # Safety
/// `a` and `b` lie inside their slices, and `dst` is valid for writes (and, when `accumulate`,
/// reads) of `a.rows x b.cols` values at that stride, aliasing neither operand.
unsafe fn call_gemm(
    dst: *mut f32,
    dst_row_stride: usize,
    accumulate: bool,
    a: Mat<'_>,
    b: Mat<'_>,
    factor: f32,
    parallelism: gemm::Parallelism,
) {
    let stride = |s: usize| isize::try_from(s).expect("a stride within a slice fits isize");
    // SAFETY: the caller's contract; the offsets are inside the operands' slices.
    unsafe {
        gemm::gemm(
            a.rows,
            b.cols,
            a.cols,
            dst,
            1,
            stride(dst_row_stride),
            accumulate,
            a.data.as_ptr().add(a.offset),
            stride(a.col_stride),
            stride(a.row_stride),
            b.data.as_ptr().add(b.offset),
            stride(b.col_stride),
            stride(b.row_stride),
            1.0,
            factor,
            false,
            false,
            false,
            parallelism,
        );
    }
}

/// Asserts that each operand's view lies inside its slice.
fn check_operands(a: Mat<'_>, b: Mat<'_>) {
    for (view, len, what) in [
        (
            extent(a.offset, a.rows, a.cols, a.row_stride, a.col_stride),
            a.data.len(),
            "a",
        ),
        (
            extent(b.offset, b.rows, b.cols, b.row_stride, b.col_stride),
            b.data.len(),
            "b",
        ),
    ] {
        assert!(view <= len, "matmul: {what} reaches {view} of {len} values");
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Strided and transposed views against the textbook triple loop.
    #[test]
    fn strided_products_match_the_definition() {
        let data: Vec<f32> = (0..200).map(|i| (i % 17) as f32 - 8.0).collect();
        // a: 3x5 with row stride 7 from 2; b: the transpose of a 4x5 view, row stride 9 from 40.
        let a = Mat {
            data: &data,
            offset: 2,
            rows: 3,
            cols: 5,
            row_stride: 7,
            col_stride: 1,
        };
        let b = Mat {
            data: &data,
            offset: 40,
            rows: 4,
            cols: 5,
            row_stride: 9,
            col_stride: 1,
        }
        .t();
        let mut dst = vec![1.0; 3 * 6];
        matmul(&mut dst, 1, 6, a, b, 0.5, true);
        for r in 0..3 {
            for c in 0..4 {
                let want: f32 = (0..5)
                    .map(|i| data[2 + r * 7 + i] * data[40 + c * 9 + i])
                    .sum::<f32>()
                    * 0.5
                    + 1.0;
                assert_eq!(dst[1 + r * 6 + c], want, "({r}, {c})");
            }
        }
        assert_eq!(dst[0], 1.0, "outside the view untouched");
    }

    #[test]
    #[should_panic(expected = "matmul: b reaches")]
    fn a_view_past_its_slice_is_refused() {
        let data = [0.0; 8];
        let a = Mat {
            data: &data,
            offset: 0,
            rows: 2,
            cols: 2,
            row_stride: 2,
            col_stride: 1,
        };
        let b = Mat {
            data: &data,
            offset: 6,
            rows: 2,
            cols: 2,
            row_stride: 2,
            col_stride: 1,
        };
        matmul(&mut [0.0; 4], 0, 2, a, b, 1.0, false);
    }
}
