//! The AMX path: `c` in blocks of 32 x 32 from four tile registers of 16 x 16 f32 (`tmm0` to
//! `tmm3`), two tiles of `a` and two of `b` loaded per k-block of 32 values (`tmm4` to `tmm7`),
//! and one `tdpbf16ps` per result tile: 16 x 16 x 32 multiply-adds an instruction, each pair
//! of bf16 products exact in f32 and added into the f32 accumulators (the rounding of
//! `vdpbf16ps`; subnormal inputs and results are flushed to zero).
//!
//! `b` is packed as on the AVX512_BF16 path (panels of 16 columns, one pair of a column per
//! lane, a step a row), padded to whole k-blocks, so that 16 steps of a panel are a tile; `a`
//! is packed so that a tile's row holds one row's 16 pairs of a k-block ([`pack_a_tiles`]).
//!
//! The tile registers are Rust's nowhere else: the compiler neither reads nor writes them, so
//! the configuration loaded at the start of a block holds until its release at the end. The
//! crate's unsafe code for this path: the `asm!` blocks, each with the lengths it relies on
//! asserted, and the tile stores (`super::store_tile`, which checks its contract).

#![allow(unsafe_code)]

use std::arch::asm;
use std::mem::MaybeUninit;
use std::ops::Range;

use rayon::prelude::*;

use super::{Bf16Path, HalfElement, HalfMat, NR, PARALLEL_FROM, pack, store_tile};
use crate::element::Element;

/// Rows of a tile, result columns of a tile (16 f32), and steps (pairs of `k`) of a k-block.
const TILE: usize = 16;
/// Rows one task computes: a fixed split, whatever the number of threads.
const BLOCK_ROWS: usize = 4 * TILE;
/// Lanes of one packed tile: `TILE` rows of `TILE` pairs, 1 KiB.
const TILE_LANES: usize = TILE * TILE;

/// Palette 1, tiles 0 to 7 each 16 rows of 64 bytes (the layout `ldtilecfg` reads).
#[repr(C, align(64))]
struct TileConfig {
    palette: u8,
    start_row: u8,
    reserved: [u8; 14],
    bytes_per_row: [u16; 16],
    rows: [u8; 16],
}

static CONFIG: TileConfig = TileConfig {
    palette: 1,
    start_row: 0,
    reserved: [0; 14],
    bytes_per_row: [64, 64, 64, 64, 64, 64, 64, 64, 0, 0, 0, 0, 0, 0, 0, 0],
    rows: [16, 16, 16, 16, 16, 16, 16, 16, 0, 0, 0, 0, 0, 0, 0, 0],
};

/// The tiles configured on this thread, released when dropped (a thread holding tile state
/// makes every context switch save 8 KiB more).
struct Tiles;

impl Tiles {
    fn configure() -> Self {
        assert!(
            Bf16Path::Amx.available(),
            "the AMX tiles on a CPU or process without them"
        );
        // SAFETY: the CPU has AMX-TILE and Linux lent this process the tile state (asserted
        // above); `CONFIG` is a valid 64-byte configuration, read and not written.
        unsafe { asm!("ldtilecfg [{}]", in(reg) &raw const CONFIG, options(nostack, readonly)) };
        Self
    }
}

impl Drop for Tiles {
    fn drop(&mut self) {
        // SAFETY: tiles were configured by `configure` on this thread; releasing them touches
        // no memory.
        unsafe { asm!("tilerelease", options(nostack, nomem)) };
    }
}

/// `c = a b` (+ `bias` on every row), row-major, each element rounded once to `O`. Writes
/// every element of `c`: the blocks cut `c` into whole rows, the pairs of panels of `b` cover
/// every column and the panels of `a` every row of a block, and each 16 x 16 result tile is
/// stored for all its rows and columns that lie inside `c`.
///
/// # Panics
/// When the CPU or process cannot run the path, or `c` is not `a.rows x b.cols`.
pub(super) fn product<T: HalfElement, O: Element>(
    a: HalfMat<'_, T>,
    b: HalfMat<'_, T>,
    bias: Option<&[f32]>,
    c: &mut [MaybeUninit<O>],
) {
    let (m, n, k) = (a.rows, b.cols, a.cols);
    assert_eq!(c.len(), m * n, "an AMX product's result has the wrong size");
    let steps = k.div_ceil(2);
    let blocks = steps.div_ceil(TILE);
    let panel_len = blocks * TILE_LANES;
    let mut packed_b = Vec::new();
    pack::pack_b(b, (steps, blocks * TILE), 2, &mut packed_b);
    // The kernel takes two panels of `b` at a time: an odd last one is paired with zeros.
    if (packed_b.len() / panel_len) % 2 == 1 {
        packed_b.resize(packed_b.len() + panel_len, 0);
    }
    let block = |(index, rows_out): (usize, &mut [MaybeUninit<O>])| {
        let start = index * BLOCK_ROWS;
        let rows = start..(start + BLOCK_ROWS).min(m);
        let mut packed_a = Vec::new();
        pack_a_tiles(a, rows.clone(), blocks, &mut packed_a);
        let tiles = Tiles::configure();
        let mut out = [[[0.0f32; NR]; TILE]; 4];
        for (p, b_pair) in packed_b.chunks(2 * panel_len).enumerate() {
            for (t, a_pair) in packed_a.chunks(2 * panel_len).enumerate() {
                kernel(&tiles, a_pair, b_pair, blocks, &mut out);
                // Result tile `2 * r + h`: rows `r` of the pair of `a`, columns `h` of `b`'s.
                for (q, tile) in out.iter().enumerate() {
                    let first = (2 * t + q / 2) * TILE;
                    let col = (2 * p + q % 2) * NR;
                    if first >= rows.len() || col >= n {
                        continue;
                    }
                    let (height, width) = (TILE.min(rows.len() - first), NR.min(n - col));
                    let bias = bias.map(|bias| &bias[col..col + width]);
                    let at = first * n + col;
                    if width == NR {
                        store_tile(
                            Bf16Path::Avx512,
                            &tile[..height],
                            &mut rows_out[at..],
                            n,
                            bias,
                        );
                        continue;
                    }
                    for (i, row) in tile[..height].iter().enumerate() {
                        let out = &mut rows_out[at + i * n..][..width];
                        crate::cast::store_sum(out, &row[..width], bias);
                    }
                }
            }
        }
    };
    if m.saturating_mul(n).saturating_mul(k) >= PARALLEL_FROM {
        c.par_chunks_mut(BLOCK_ROWS * n).enumerate().for_each(block);
    } else {
        c.chunks_mut(BLOCK_ROWS * n).enumerate().for_each(block);
    }
}

/// The 32 x 32 block of two panels of `a` (`a_pair`) by two panels of `b` (`b_pair`), each
/// `blocks` k-blocks of one tile, into `out` (tile `2 * r + h`: rows of `a`'s panel `r` by
/// columns of `b`'s panel `h`).
///
/// # Panics
/// When a pair of panels is shorter than `2 * blocks` tiles, or `blocks` is 0.
fn kernel(
    _tiles: &Tiles,
    a_pair: &[u32],
    b_pair: &[u32],
    blocks: usize,
    out: &mut [[[f32; NR]; TILE]; 4],
) {
    let panel_len = blocks * TILE_LANES;
    assert!(blocks > 0 && a_pair.len() >= 2 * panel_len && b_pair.len() >= 2 * panel_len);
    let (a0, a1) = (a_pair.as_ptr(), a_pair[panel_len..].as_ptr());
    let (b0, b1) = (b_pair.as_ptr(), b_pair[panel_len..].as_ptr());
    let [c0, c1, c2, c3] = out.each_mut().map(|tile| tile.as_mut_ptr());
    // SAFETY: the tiles are configured on this thread (`_tiles`): 16 rows of 64 bytes each.
    // Each of the four panels holds `blocks` tiles of 1 KiB one after another (asserted
    // above), read 64 bytes a row with a stride of 64; each result tile is 16 rows of 16 f32
    // (1 KiB), written with the same stride.
    unsafe {
        asm!(
            "tilezero tmm0",
            "tilezero tmm1",
            "tilezero tmm2",
            "tilezero tmm3",
            "2:",
            "tileloadd tmm4, [{a0} + {stride}]",
            "tileloadd tmm5, [{a1} + {stride}]",
            "tileloadd tmm6, [{b0} + {stride}]",
            "tileloadd tmm7, [{b1} + {stride}]",
            "tdpbf16ps tmm0, tmm4, tmm6",
            "tdpbf16ps tmm1, tmm4, tmm7",
            "tdpbf16ps tmm2, tmm5, tmm6",
            "tdpbf16ps tmm3, tmm5, tmm7",
            "add {a0}, 1024",
            "add {a1}, 1024",
            "add {b0}, 1024",
            "add {b1}, 1024",
            "dec {blocks}",
            "jnz 2b",
            "tilestored [{c0} + {stride}], tmm0",
            "tilestored [{c1} + {stride}], tmm1",
            "tilestored [{c2} + {stride}], tmm2",
            "tilestored [{c3} + {stride}], tmm3",
            a0 = inout(reg) a0 => _,
            a1 = inout(reg) a1 => _,
            b0 = inout(reg) b0 => _,
            b1 = inout(reg) b1 => _,
            blocks = inout(reg) blocks => _,
            stride = in(reg) 64usize,
            c0 = in(reg) c0,
            c1 = in(reg) c1,
            c2 = in(reg) c2,
            c3 = in(reg) c3,
            options(nostack),
        );
    }
}

/// Rows `rows` of `a` as the AMX path's panels of [`TILE`] rows (an even number of them, the
/// last ones zero): panel `p`, k-block `kb` is one tile of `TILE` rows of `TILE` pairs, lane
/// `(row i, step s)` at `kb * TILE * TILE + i * TILE + s % TILE` with `kb = s / TILE`; steps
/// past `k` are zero up to `blocks` k-blocks.
fn pack_a_tiles<T: HalfElement>(
    a: HalfMat<'_, T>,
    rows: Range<usize>,
    blocks: usize,
    packed: &mut Vec<u32>,
) {
    let panel_len = blocks * TILE * TILE;
    let panels = rows.len().div_ceil(2 * TILE) * 2;
    packed.clear();
    packed.resize(panels * panel_len, 0);
    let k_len = a.cols;
    let steps = k_len.div_ceil(2);
    let at = |i: usize, s: usize| (s / TILE) * TILE * TILE + i * TILE + s % TILE;
    if rows.len() > 1 && pack::run(&a, false, 0, rows.start, rows.len()).is_some() {
        pack_transposed_tiles(a, rows, blocks, packed);
        return;
    }
    for (p, panel) in packed.chunks_mut(panel_len).enumerate() {
        let first = rows.start + p * TILE;
        if first >= rows.end {
            break;
        }
        let height = TILE.min(rows.end - first);
        if let Some(runs) = pack::runs_along_k(&a, true, first..first + height, k_len) {
            // A row-major `a`: each row's pairs of a k-block are one tile row, copied whole.
            for (i, run) in runs.iter().enumerate() {
                let (pairs, last) = run.as_chunks::<2>();
                let tile_rows = panel
                    .chunks_exact_mut(TILE * TILE)
                    .map(|t| &mut t[i * TILE..]);
                for (row, pairs) in tile_rows.zip(pairs.chunks(TILE)) {
                    for (o, pair) in row.iter_mut().zip(pairs) {
                        *o = pack::pair_lane(pair[0], pair[1]);
                    }
                }
                if let [lo] = last {
                    panel[at(i, steps - 1)] = u32::from(lo.bits());
                }
            }
        } else {
            for i in 0..height {
                for s in 0..steps {
                    panel[at(i, s)] = pack::lane(|k| a.at(first + i, k), 2 * s, k_len, 2);
                }
            }
        }
    }
}

/// [`pack_a_tiles`] for a transposed `a` (`X^T`, whose rows are `X`'s columns): each step's
/// values of all `rows` lie in one run of `X`'s row. k-block by k-block, the block's steps are
/// read whole (every cache line used once, by every panel), gathered step by step into one
/// tile per panel, and written row by row.
fn pack_transposed_tiles<T: HalfElement>(
    a: HalfMat<'_, T>,
    rows: Range<usize>,
    blocks: usize,
    packed: &mut [u32],
) {
    const MAX_PANELS: usize = BLOCK_ROWS / TILE;
    let k_len = a.cols;
    let steps = k_len.div_ceil(2);
    let panel_len = blocks * TILE * TILE;
    let height = rows.len();
    assert!(height <= MAX_PANELS * TILE, "an AMX block of {height} rows");
    let mut gathered = [[[0u32; TILE]; TILE]; MAX_PANELS];
    for kb in 0..blocks {
        let block_steps = TILE.min(steps.saturating_sub(kb * TILE));
        for j in 0..TILE {
            let (lo, hi): (&[T], &[T]) = if j < block_steps {
                let k = 2 * (kb * TILE + j);
                let lo = pack::run(&a, false, k, rows.start, height).unwrap_or_default();
                let hi = if k + 1 < k_len {
                    pack::run(&a, false, k + 1, rows.start, height).unwrap_or_default()
                } else {
                    &[]
                };
                (lo, hi)
            } else {
                (&[], &[])
            };
            for (p, tile) in gathered.iter_mut().enumerate() {
                let lanes = &mut tile[j];
                lanes.fill(0);
                let from = (p * TILE).min(lo.len());
                for (o, l) in lanes.iter_mut().zip(&lo[from..]) {
                    *o = u32::from(l.bits());
                }
                let from = (p * TILE).min(hi.len());
                for (o, h) in lanes.iter_mut().zip(&hi[from..]) {
                    *o |= u32::from(h.bits()) << 16;
                }
            }
        }
        for (p, tile) in gathered.iter().enumerate() {
            let Some(out) = packed.get_mut(p * panel_len + kb * TILE * TILE..) else {
                break;
            };
            for (i, row) in out.chunks_exact_mut(TILE).take(TILE).enumerate() {
                // `i < TILE` already; said so that `lanes[i]` needs no bounds check.
                let i = i % TILE;
                for (o, lanes) in row.iter_mut().zip(tile) {
                    *o = lanes[i];
                }
            }
        }
    }
}
