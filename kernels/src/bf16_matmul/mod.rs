//! Matrix products of bf16 operands with f32 accumulation, for mixed-precision training on the
//! CPU: `c = a b` with `a` and `b` bf16 (any strides, so the transposed operands of a linear
//! layer's backward need no copy) and `c` f32, row-major.
//!
//! Five paths, one answer up to f32 rounding:
//! - [`Bf16Path::Amx`]: both operands packed in pairs along `k`, and blocks of 32 x 32 from
//!   four AMX tile registers, each `tdpbf16ps` 16 x 16 x 32 multiply-adds (a `vdpbf16ps` does
//!   32). Taken on Intel CPUs with AMX-BF16 (Sapphire Rapids and later) where Linux lends the
//!   process the tile registers.
//! - [`Bf16Path::Avx512Bf16`]: both operands packed in pairs along `k` (one 32-bit lane holds
//!   `a[i][k], a[i][k+1]`), and a 24 x 16 microkernel of `vdpbf16ps`, which multiplies both
//!   halves of a pair exactly and adds them into f32 accumulators: 32 multiply-adds per
//!   instruction. Taken on AMD CPUs with AVX512_BF16 (Zen 4 and later), where it issues at
//!   the rate of an f32 FMA: twice its multiply-adds.
//! - [`Bf16Path::Avx512`]: both operands widened to f32 as they are packed, and a 24 x 16
//!   microkernel of AVX-512 FMAs. Taken on Intel CPUs with AVX-512 but no AMX tiles (or with
//!   them capped by `ACCELERATE_CPU_ISA=avx512bf16`): there (Sapphire and Emerald Rapids)
//!   `vdpbf16ps` issues at half the rate of two FMA ports (measured: RESULTS, issue 60), and
//!   the `gemm` crate's f32 kernels use 256-bit registers on stable Rust. f16 operands take
//!   this path on every AVX-512 CPU.
//! - [`Bf16Path::Avx2`]: the same packing and tile, computed in four bands of 6 rows with
//!   256-bit FMAs: x86 CPUs with AVX2, FMA and F16C but no AVX-512 (or forced with
//!   `ACCELERATE_CPU_ISA=avx2`, see [`crate::isa`]). The same FMAs in the same order as the
//!   AVX-512 path: the same bits.
//! - [`Bf16Path::Widened`] (every other CPU, or forced with `ACCELERATE_CPU_ISA=portable`):
//!   both operands widened to f32 and the f32 product of [`linear`](crate::linear) run.
//!
//! Rows are split among threads in fixed blocks of [`BLOCK_ROWS`] (64 on the AMX path), and
//! every element is summed in the same order in any block, so the bits do not depend on the
//! number of threads.
//!
//! [`matmul_half_to`] writes the result in any [`Element`] type, a bias added first, each
//! value rounded once as its tile is stored: a linear layer's half-precision activations come
//! out of the product with no f32 copy and no pass of their own.

// The result is allocated without clearing (`fresh::written_by`); the unsafe blocks say why
// every element is written.
#![allow(unsafe_code)]

use std::mem::MaybeUninit;

use half::{bf16, f16};
use rayon::prelude::*;

use crate::element::Element;
use crate::fresh::written_by;

#[cfg(target_arch = "x86_64")]
mod amx;
#[cfg(target_arch = "x86_64")]
mod avx2;
#[cfg(target_arch = "x86_64")]
mod avx512;
mod pack;
#[cfg(target_arch = "x86_64")]
mod transpose;

/// Rows of the microkernel's tile.
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const MR: usize = 24;
/// Columns of the microkernel's tile (one AVX-512 register of f32).
#[cfg_attr(not(target_arch = "x86_64"), allow(dead_code))]
const NR: usize = 16;
/// Rows one task computes: a fixed split, whatever the number of threads.
pub const BLOCK_ROWS: usize = 2 * MR;
/// Products below this many multiply-adds run on the calling thread (as the f32 products do).
const PARALLEL_FROM: usize = 192 * 192 * 192;

/// The half-precision element types the products take: bf16 and f16 (widened exactly by
/// [`Element::to_f32`]).
pub trait HalfElement: Element {
    /// The value's bits.
    fn bits(self) -> u16;
}

impl HalfElement for bf16 {
    #[inline(always)]
    fn bits(self) -> u16 {
        self.to_bits()
    }
}

impl HalfElement for f16 {
    #[inline(always)]
    fn bits(self) -> u16 {
        self.to_bits()
    }
}

/// A read-only matrix view of half-precision values: element `(r, c)` is
/// `data[offset + r * row_stride + c * col_stride]`.
#[derive(Debug, Clone, Copy)]
pub struct HalfMat<'a, T> {
    /// The buffer the matrix lives in.
    pub data: &'a [T],
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

/// A bf16 matrix view.
pub type Bf16Mat<'a> = HalfMat<'a, bf16>;
/// An f16 matrix view.
pub type F16Mat<'a> = HalfMat<'a, f16>;

impl<'a, T: HalfElement> HalfMat<'a, T> {
    /// A row-major `rows x cols` matrix filling `data` from its start.
    pub fn row_major(data: &'a [T], rows: usize, cols: usize) -> Self {
        Self {
            data,
            offset: 0,
            rows,
            cols,
            row_stride: cols,
            col_stride: 1,
        }
    }

    /// The transposed view (no copy).
    pub fn t(self) -> Self {
        Self {
            rows: self.cols,
            cols: self.rows,
            row_stride: self.col_stride,
            col_stride: self.row_stride,
            ..self
        }
    }

    /// Element `(r, c)`.
    fn at(&self, r: usize, c: usize) -> T {
        self.data[self.offset + r * self.row_stride + c * self.col_stride]
    }

    /// Panics unless every element lies inside `data`.
    fn check(&self, name: &str) {
        if self.rows == 0 || self.cols == 0 {
            return;
        }
        let last = (self.rows - 1)
            .checked_mul(self.row_stride)
            .and_then(|r| r.checked_add((self.cols - 1).checked_mul(self.col_stride)?))
            .and_then(|x| x.checked_add(self.offset));
        assert!(
            last.is_some_and(|last| last < self.data.len()),
            "matmul_bf16: {name} ({}x{}, strides {}/{}, from {}) reaches past its {} values",
            self.rows,
            self.cols,
            self.row_stride,
            self.col_stride,
            self.offset,
            self.data.len()
        );
    }
}

/// Which kernel a bf16 product runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bf16Path {
    /// AMX tiles (`tdpbf16ps`) on operands packed in pairs (AMX-BF16).
    Amx,
    /// `vdpbf16ps` on operands packed in pairs (AVX512_BF16).
    Avx512Bf16,
    /// AVX-512 FMAs on operands widened to f32 as they are packed.
    Avx512,
    /// AVX2 FMAs on operands widened to f32 as they are packed (the same bits as `Avx512`).
    Avx2,
    /// Operands widened to f32, then the f32 product.
    Widened,
}

impl Bf16Path {
    /// The fastest path this CPU takes, within the cap of `ACCELERATE_CPU_ISA`.
    pub fn detect() -> Self {
        use crate::isa::{Isa, current, dot_products_at_fma_rate};
        match current() {
            Isa::Amx => Self::Amx,
            Isa::Avx512Bf16 if dot_products_at_fma_rate() => Self::Avx512Bf16,
            Isa::Avx512Bf16 | Isa::Avx512 => Self::Avx512,
            Isa::Avx2 => Self::Avx2,
            Isa::Portable => Self::Widened,
        }
    }

    /// True when this CPU can run the path.
    pub fn available(self) -> bool {
        use crate::isa::{Isa, detected};
        match self {
            Self::Widened => true,
            Self::Avx2 => detected() >= Isa::Avx2,
            Self::Avx512 => detected() >= Isa::Avx512,
            Self::Avx512Bf16 => detected() >= Isa::Avx512Bf16,
            Self::Amx => detected() >= Isa::Amx,
        }
    }
}

/// `a b` as a new row-major `a.rows x b.cols` f32 matrix, on the path [`Bf16Path::detect`]
/// chooses, spread over the current rayon pool when large enough.
///
/// # Panics
/// When the shapes do not chain, or a view reaches past its slice.
pub fn matmul_bf16(a: Bf16Mat<'_>, b: Bf16Mat<'_>) -> Vec<f32> {
    matmul_bf16_on(Bf16Path::detect(), a, b)
}

/// `a b` for f16 operands, as [`matmul_bf16`]: FMAs over operands widened as they are packed
/// (AVX-512 or AVX2: the pair products multiply bf16 only), else widened then the f32 product.
///
/// # Panics
/// As [`matmul_bf16`].
pub fn matmul_f16(a: F16Mat<'_>, b: F16Mat<'_>) -> Vec<f32> {
    matmul_half_on(Bf16Path::detect(), a, b)
}

/// [`matmul_bf16`] on `path` (the widened one where this CPU cannot run it): what the tests
/// and benchmarks use to compare the paths in one process.
///
/// # Panics
/// As [`matmul_bf16`].
pub fn matmul_bf16_on(path: Bf16Path, a: Bf16Mat<'_>, b: Bf16Mat<'_>) -> Vec<f32> {
    matmul_half_on(path, a, b)
}

/// `a b` of half-precision operands on `path`, as f32; f16 operands take the FMA path for the
/// pair paths (`vdpbf16ps` and `tdpbf16ps` multiply bf16 only).
///
/// # Panics
/// As [`matmul_bf16`].
pub fn matmul_half_on<T: HalfElement>(
    path: Bf16Path,
    a: HalfMat<'_, T>,
    b: HalfMat<'_, T>,
) -> Vec<f32> {
    matmul_half_to(path, a, b, None)
}

/// `a b`, plus `bias` (one f32 per column of `b`) on every row when given, on `path`
/// ([`Bf16Path::detect`] for the fastest), each element summed in f32 and rounded once to `O`.
///
/// ```
/// use accelerate_kernels::bf16_matmul::{Bf16Mat, Bf16Path, matmul_half_to};
/// use half::bf16;
///
/// let a: Vec<bf16> = [1.0f32, 2.0, 3.0, 4.0].map(bf16::from_f32).to_vec();
/// let identity: Vec<bf16> = [1.0f32, 0.0, 0.0, 1.0].map(bf16::from_f32).to_vec();
/// let y: Vec<bf16> = matmul_half_to(
///     Bf16Path::detect(),
///     Bf16Mat::row_major(&a, 2, 2),
///     Bf16Mat::row_major(&identity, 2, 2),
///     Some(&[0.5, -1.0]),
/// );
/// assert_eq!(y, [1.5f32, 1.0, 3.5, 3.0].map(bf16::from_f32));
/// ```
///
/// # Panics
/// As [`matmul_bf16`], and when `bias` is not `b.cols` long.
pub fn matmul_half_to<T: HalfElement, O: Element>(
    path: Bf16Path,
    a: HalfMat<'_, T>,
    b: HalfMat<'_, T>,
    bias: Option<&[f32]>,
) -> Vec<O> {
    let pairs_allowed = std::any::TypeId::of::<T>() == std::any::TypeId::of::<bf16>();
    let pairs = matches!(path, Bf16Path::Amx | Bf16Path::Avx512Bf16);
    let path = if pairs && !pairs_allowed {
        Bf16Path::Avx512
    } else {
        path
    };
    assert_eq!(
        a.cols, b.rows,
        "matmul_bf16: {}x{} by {}x{}",
        a.rows, a.cols, b.rows, b.cols
    );
    a.check("a");
    b.check("b");
    if let Some(bias) = bias {
        assert_eq!(
            bias.len(),
            b.cols,
            "matmul_bf16: a bias of {} for {} columns",
            bias.len(),
            b.cols
        );
    }
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let len = m.checked_mul(n).expect("a product's size fits usize");
    if len == 0 || k == 0 {
        return (0..len)
            .map(|i| O::from_f32(bias.map_or(0.0, |bias| bias[i % n])))
            .collect();
    }
    match path {
        #[cfg(target_arch = "x86_64")]
        Bf16Path::Amx if path.available() => {
            let fill = |c: &mut [MaybeUninit<O>]| amx::product(a, b, bias, c);
            // SAFETY: `amx::product` writes every element of `c` (see there).
            unsafe { written_by(len, fill) }
        }
        #[cfg(target_arch = "x86_64")]
        Bf16Path::Avx512Bf16 | Bf16Path::Avx512 | Bf16Path::Avx2 if path.available() => {
            let fill = |c: &mut [MaybeUninit<O>]| packed(a, b, path, bias, c);
            // SAFETY: `packed` writes every element of `c` (see there).
            unsafe { written_by(len, fill) }
        }
        _ => {
            let c = widened(a, b);
            let fill = |out: &mut [MaybeUninit<O>]| {
                out.par_chunks_mut(n)
                    .zip(c.par_chunks(n))
                    .for_each(|(out, row)| crate::cast::store_sum(out, row, bias));
            };
            // SAFETY: `out` and `c` both hold `m` rows of `n`, and `store_sum` writes every
            // value of its row.
            unsafe { written_by(len, fill) }
        }
    }
}

/// The widened path: both operands widened to f32 (in parallel, in their own memory order),
/// then the f32 product.
fn widened<T: HalfElement>(a: HalfMat<'_, T>, b: HalfMat<'_, T>) -> Vec<f32> {
    let (a32, a_t) = widen(a);
    let (b32, b_t) = widen(b);
    crate::matmul::product(as_mat(&a32, a, a_t), as_mat(&b32, b, b_t))
}

/// The f32 view of `x` widened by [`widen`] into `values` (`transposed`: stored as `x^T`).
fn as_mat<'v, T: HalfElement>(
    values: &'v [f32],
    x: HalfMat<'_, T>,
    transposed: bool,
) -> crate::matmul::Mat<'v> {
    let stored = if transposed { x.t() } else { x };
    let mat = crate::matmul::Mat::rows_of(values, 0, [stored.rows, stored.cols], stored.cols);
    if transposed { mat.t() } else { mat }
}

/// `x` widened to f32 as a row-major buffer of `x`, or of `x^T` when `x` is stored column by
/// column (then `true`): read in memory order, one task per row of the buffer.
fn widen<T: HalfElement>(x: HalfMat<'_, T>) -> (Vec<f32>, bool) {
    let transposed = x.row_stride == 1 && x.col_stride != 1;
    let stored = if transposed { x.t() } else { x };
    let fill =
        |out: &mut [MaybeUninit<f32>]| {
            out.par_chunks_mut(stored.cols.max(1)).enumerate().for_each(
                |(r, row)| match pack::run(&stored, true, r, 0, stored.cols) {
                    Some(values) => crate::cast::cast_into(values, row),
                    None => {
                        for (c, o) in row.iter_mut().enumerate() {
                            o.write(stored.at(r, c).to_f32());
                        }
                    }
                },
            );
        };
    // SAFETY: the buffer is `rows` rows of `cols`, and each task writes every value of its
    // row (a run of `cols` values, or one value per column).
    let values = unsafe { written_by(stored.rows * stored.cols, fill) };
    (values, transposed)
}

/// The packed paths into `c` (`a.rows x b.cols`, row-major): `b` packed once, then blocks of
/// [`BLOCK_ROWS`] rows, each packing its rows of `a` and computing its tiles with `path`'s
/// microkernel, each tile stored (+ `bias`) rounded to `O`. Writes every element of `c`: the
/// blocks cut `c` into whole rows, the panels of `b` cover every column and the panels of `a`
/// every row of a block, and each tile stores all its rows and columns that lie inside `c`.
#[cfg(target_arch = "x86_64")]
fn packed<T: HalfElement, O: Element>(
    a: HalfMat<'_, T>,
    b: HalfMat<'_, T>,
    path: Bf16Path,
    bias: Option<&[f32]>,
    c: &mut [MaybeUninit<O>],
) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    let per_lane = pack::per_lane(path);
    let steps = k.div_ceil(per_lane);
    let mut packed_b = pack::take_buffer();
    pack::pack_b(b, (steps, steps), per_lane, &mut packed_b);
    let block = |(index, rows_out): (usize, &mut [MaybeUninit<O>])| {
        let start = index * BLOCK_ROWS;
        let rows = start..(start + BLOCK_ROWS).min(m);
        let mut packed_a = pack::take_buffer();
        pack::pack_a(a, rows.clone(), steps, per_lane, &mut packed_a);
        let mut tile = [0.0f32; MR * NR];
        for (p, b_panel) in packed_b.chunks(steps * NR).enumerate() {
            let cols = p * NR..((p + 1) * NR).min(n);
            let bias = bias.map(|bias| &bias[cols.clone()]);
            for (t, a_panel) in packed_a.chunks(steps * MR).enumerate() {
                compute_tile(path, a_panel, b_panel, steps, &mut tile);
                let first = t * MR;
                let count = MR.min(rows.len() - first);
                if count == MR && cols.len() == NR {
                    store_tile(
                        path,
                        tile.as_chunks::<NR>().0,
                        &mut rows_out[first * n + cols.start..],
                        n,
                        bias,
                    );
                    continue;
                }
                for i in 0..count {
                    let out = &mut rows_out[(first + i) * n..][cols.clone()];
                    crate::cast::store_sum(out, &tile[i * NR..i * NR + cols.len()], bias);
                }
            }
        }
        pack::give_back(packed_a);
    };
    if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_FROM {
        c.par_chunks_mut(BLOCK_ROWS * n).enumerate().for_each(block);
    } else {
        c.chunks_mut(BLOCK_ROWS * n).enumerate().for_each(block);
    }
    pack::give_back(packed_b);
}

/// The tile `a_panel b_panel` (`steps` steps along `k`) into `tile` (row-major, `MR x NR`),
/// with `path`'s microkernel.
///
/// # Panics
/// When a panel is shorter than `steps` steps, or the CPU cannot run the path.
#[cfg(target_arch = "x86_64")]
fn compute_tile(
    path: Bf16Path,
    a_panel: &[u32],
    b_panel: &[u32],
    steps: usize,
    tile: &mut [f32; MR * NR],
) {
    match path {
        Bf16Path::Avx2 => avx2::tile(a_panel, b_panel, steps, tile),
        _ => avx512::tile(path, a_panel, b_panel, steps, tile),
    }
}

/// A whole tile (rows of `NR` f32) plus `bias` (its `NR` columns' values) rounded once
/// to `O` into `rows` (row `i` at `rows[i * stride..][..NR]`), with `path`'s registers:
/// 256-bit on the AVX2 path, 512-bit on the AVX-512 ones.
///
/// # Panics
/// When `rows` is shorter than `(tile.len() - 1) * stride + NR`, `bias` shorter than `NR`,
/// or the CPU cannot run the path (the packed paths are only chosen where it can).
#[cfg(target_arch = "x86_64")]
fn store_tile<O: Element>(
    path: Bf16Path,
    tile: &[[f32; NR]],
    rows: &mut [MaybeUninit<O>],
    stride: usize,
    bias: Option<&[f32]>,
) {
    let needed = (tile.len().max(1) - 1)
        .checked_mul(stride)
        .and_then(|r| r.checked_add(NR));
    assert!(
        needed.is_some_and(|needed| rows.len() >= needed),
        "a tile reaches past `c`"
    );
    assert!(
        bias.is_none_or(|bias| bias.len() >= NR),
        "a tile's bias is short"
    );
    assert!(
        path != Bf16Path::Widened && path.available(),
        "a {path:?} tile store on a CPU without it"
    );
    let rows = rows.as_mut_ptr();
    // SAFETY: the CPU runs `path` (AVX2 and F16C, or AVX-512F), `rows` holds every row's NR
    // values and `bias` NR values (all asserted above).
    unsafe {
        match path {
            Bf16Path::Avx2 => avx2::store_tile(tile, rows, stride, bias),
            // The AMX path stores through AVX-512 registers (every AMX CPU has AVX-512F).
            _ => avx512::store_tile(tile, rows, stride, bias),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Deterministic values of both signs and many magnitudes (none subnormal).
    fn values(len: usize, seed: u64) -> Vec<bf16> {
        let mut state = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
        (0..len)
            .map(|_| {
                state ^= state << 13;
                state ^= state >> 7;
                state ^= state << 17;
                let unit = (state >> 40) as f32 / (1u64 << 24) as f32;
                let scale = [0.01f32, 0.5, 1.0, 3.0, 40.0][(state % 5) as usize];
                bf16::from_f32((unit - 0.5) * scale)
            })
            .collect()
    }

    /// Each element against an f64 product of the same bf16 values: products of bf16 are
    /// exact in f32, so the only error is f32 summation, at most `(k + 1) u` of the sum of
    /// absolute terms (`u = 2^-24`; `vdpbf16ps` rounds a pair's sum, then its addition; an
    /// FMA rounds once per step).
    fn check<T: HalfElement>(path: Bf16Path, a: HalfMat<'_, T>, b: HalfMat<'_, T>) {
        let c = matmul_half_on(path, a, b);
        let (m, n, k) = (a.rows, b.cols, a.cols);
        assert_eq!(c.len(), m * n);
        let bound_factor = (k as f64 + 1.0) * 2f64.powi(-24) * 1.01;
        for r in 0..m {
            for col in 0..n {
                let (mut exact, mut magnitude) = (0.0f64, 0.0f64);
                for i in 0..k {
                    let wide = |v: T| f64::from(v.to_f32());
                    let term = wide(a.at(r, i)) * wide(b.at(i, col));
                    exact += term;
                    magnitude += term.abs();
                }
                let got = f64::from(c[r * n + col]);
                assert!(
                    (got - exact).abs() <= bound_factor * magnitude,
                    "{path:?} {m}x{k} by {k}x{n}, ({r}, {col}): {got} for {exact} (bound {})",
                    bound_factor * magnitude
                );
            }
        }
    }

    fn paths() -> Vec<Bf16Path> {
        [
            Bf16Path::Amx,
            Bf16Path::Avx512Bf16,
            Bf16Path::Avx512,
            Bf16Path::Avx2,
            Bf16Path::Widened,
        ]
        .into_iter()
        .filter(|p| p.available())
        .collect()
    }

    /// Odd sizes, `k` odd and not a multiple of 32, single rows and columns, tiles cut at
    /// every edge, and the transposed operands of a linear layer's backward.
    #[test]
    fn products_match_an_f64_reference_of_the_bf16_values() {
        let shapes = [
            (1, 1, 1),
            (1, 33, 7),
            (13, 29, 65),
            (12, 32, 64),
            (25, 70, 3),
            (49, 31, 130),
            (2, 100, 257),
            (97, 65, 1),
        ];
        for path in paths() {
            for (m, n, k) in shapes {
                let a = values(m * k, 1);
                let b = values(k * n, 2);
                let a_t = values(k * m, 3);
                let b_t = values(n * k, 4);
                check(
                    path,
                    Bf16Mat::row_major(&a, m, k),
                    Bf16Mat::row_major(&b, k, n),
                );
                // x W^T (b stored n x k) and X^T dY (a stored k x m).
                check(
                    path,
                    Bf16Mat::row_major(&a, m, k),
                    Bf16Mat::row_major(&b_t, n, k).t(),
                );
                check(
                    path,
                    Bf16Mat::row_major(&a_t, k, m).t(),
                    Bf16Mat::row_major(&b, k, n),
                );
            }
        }
    }

    /// f16 operands (fp16 autocast): every path, the pair path taking the FMAs (products of
    /// f16 are exact in f32 too: 11-bit significands).
    #[test]
    fn f16_products_match_an_f64_reference_of_the_f16_values() {
        let f16s =
            |v: Vec<bf16>| -> Vec<f16> { v.iter().map(|x| f16::from_f32(x.to_f32())).collect() };
        for path in paths() {
            for (m, n, k) in [(1, 1, 1), (13, 29, 65), (49, 31, 130), (2, 100, 257)] {
                let a = f16s(values(m * k, 8));
                let b = f16s(values(k * n, 9));
                let b_t = f16s(values(n * k, 10));
                check(
                    path,
                    HalfMat::row_major(&a, m, k),
                    HalfMat::row_major(&b, k, n),
                );
                check(
                    path,
                    HalfMat::row_major(&a, m, k),
                    HalfMat::row_major(&b_t, n, k).t(),
                );
            }
        }
    }

    /// A product large enough to be split among threads gives the same bits on 1, 2 and 3
    /// threads, on every path.
    #[test]
    fn the_bits_do_not_depend_on_the_number_of_threads() {
        let (m, n, k) = (203, 190, 201);
        let a = values(m * k, 5);
        let b = values(k * n, 6);
        for path in paths() {
            let on = |threads: usize| -> Vec<u32> {
                let pool = rayon::ThreadPoolBuilder::new()
                    .num_threads(threads)
                    .build()
                    .unwrap();
                pool.install(|| {
                    matmul_bf16_on(
                        path,
                        Bf16Mat::row_major(&a, m, k),
                        Bf16Mat::row_major(&b, k, n),
                    )
                })
                .iter()
                .map(|v| v.to_bits())
                .collect()
            };
            let one = on(1);
            assert_eq!(one, on(2), "{path:?}");
            assert_eq!(one, on(3), "{path:?}");
        }
    }

    /// Packing buffers reused from earlier products, full of garbage (NaN lanes), change no
    /// bit of a product with partial panels of both operands and an odd `k` (every lane that
    /// reaches a result is written: the pairs' zeros past `k`, AMX's steps past `k`), for bf16
    /// and f16 operands on every path.
    #[test]
    fn reused_packing_buffers_leave_no_trace() {
        let (m, n, k) = (29, 21, 37);
        let a = values(m * k, 16);
        let b = values(k * n, 17);
        let f16s =
            |x: &[bf16]| -> Vec<f16> { x.iter().map(|v| f16::from_f32(v.to_f32())).collect() };
        let (a16, b16) = (f16s(&a), f16s(&b));
        let bits = |c: Vec<f32>| c.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let products = |path| {
            (
                bits(matmul_half_on(
                    path,
                    Bf16Mat::row_major(&a, m, k),
                    Bf16Mat::row_major(&b, k, n),
                )),
                bits(matmul_half_on(
                    path,
                    HalfMat::row_major(&a16, m, k),
                    HalfMat::row_major(&b16, k, n),
                )),
            )
        };
        for path in paths() {
            // On a thread of its own: its buffers hold nothing yet.
            let fresh = std::thread::scope(|s| s.spawn(|| products(path)).join().unwrap());
            let soiled = std::thread::scope(|s| {
                s.spawn(|| {
                    let pool = rayon::ThreadPoolBuilder::new()
                        .num_threads(1)
                        .build()
                        .unwrap();
                    pool.install(|| {
                        for _ in 0..pack::KEPT_BUFFERS {
                            pack::give_back(vec![u32::MAX; 1 << 16]);
                        }
                        products(path)
                    })
                })
                .join()
                .unwrap()
            });
            assert_eq!(fresh, soiled, "{path:?}");
        }
    }

    /// The AVX2 and AVX-512 FMA paths give the same bits (the same FMAs along `k`, in the
    /// same order), for bf16 and f16 operands, across tile, block and chunk edges, transposed
    /// too.
    #[test]
    fn the_avx2_and_avx512_paths_give_the_same_bits() {
        if !Bf16Path::Avx512.available() {
            return;
        }
        let (m, n, k) = (101, 37, 300);
        let a = values(m * k, 14);
        let b = values(n * k, 15);
        let bits = |c: Vec<f32>| c.iter().map(|v| v.to_bits()).collect::<Vec<_>>();
        let (a, b) = (
            Bf16Mat::row_major(&a, m, k),
            Bf16Mat::row_major(&b, n, k).t(),
        );
        let on = |path| bits(matmul_half_on(path, a, b));
        assert_eq!(on(Bf16Path::Avx2), on(Bf16Path::Avx512), "bf16");
        let f16s =
            |x: &[bf16]| -> Vec<f16> { x.iter().map(|v| f16::from_f32(v.to_f32())).collect() };
        let (a16, b16) = (f16s(a.data), f16s(b.data));
        let (a, b) = (
            HalfMat::row_major(&a16, m, k),
            HalfMat::row_major(&b16, n, k).t(),
        );
        let on = |path| bits(matmul_half_on(path, a, b));
        assert_eq!(on(Bf16Path::Avx2), on(Bf16Path::Avx512), "f16");
    }

    /// A result written in bf16 or f16 with a bias is, bit for bit, the f32 result plus the
    /// bias rounded once, on every path (across tile and block edges: 77 rows, 35 columns).
    #[test]
    fn half_results_are_the_f32_sum_plus_the_bias_rounded_once() {
        let (m, n, k) = (77, 35, 19);
        let a = values(m * k, 11);
        let b = values(k * n, 12);
        let bias: Vec<f32> = values(n, 13).iter().map(|v| v.to_f32()).collect();
        for path in paths() {
            let (a, b) = (Bf16Mat::row_major(&a, m, k), Bf16Mat::row_major(&b, k, n));
            let sums = matmul_half_on(path, a, b);
            let plus = |i: usize| sums[i] + bias[i % n];
            let got: Vec<bf16> = matmul_half_to(path, a, b, Some(&bias));
            let want: Vec<bf16> = (0..m * n).map(|i| bf16::from_f32(plus(i))).collect();
            assert_eq!(got, want, "{path:?} bf16");
            let got: Vec<f16> = matmul_half_to(path, a, b, Some(&bias));
            let want: Vec<f16> = (0..m * n).map(|i| f16::from_f32(plus(i))).collect();
            assert_eq!(got, want, "{path:?} f16");
            let got: Vec<f32> = matmul_half_to(path, a, b, None);
            assert_eq!(got, sums, "{path:?} f32");
        }
        let empty: Vec<bf16> = matmul_half_to(
            Bf16Path::detect(),
            Bf16Mat::row_major(&a[..0], 2, 0),
            Bf16Mat::row_major(&a[..0], 0, 2),
            Some(&[1.0, -2.0]),
        );
        assert_eq!(empty, [1.0f32, -2.0, 1.0, -2.0].map(bf16::from_f32));
    }

    #[test]
    fn empty_products_are_zeros_and_bad_views_are_refused() {
        let a = values(6, 7);
        let zero_k = matmul_bf16(
            Bf16Mat::row_major(&a[..0], 2, 0),
            Bf16Mat::row_major(&a[..0], 0, 3),
        );
        assert_eq!(zero_k, vec![0.0; 6]);
        let refused = std::panic::catch_unwind(|| {
            matmul_bf16(Bf16Mat::row_major(&a, 2, 3), Bf16Mat::row_major(&a, 3, 3))
        });
        assert!(refused.is_err(), "a 3x3 view of 6 values");
    }
}
