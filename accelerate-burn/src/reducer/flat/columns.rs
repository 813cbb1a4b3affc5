//! ZeRO's two collectives on the host without a copy of the whole flat range: the gradients
//! reduce-scattered straight from each parameter's own tensor, and the updated shards
//! all-gathered straight into each parameter's own buffer, a column at a time.
//!
//! Rank `r`'s shard is the padded flat range `[r*S, (r+1)*S)`. Column `k` is the same slice
//! `[k*C, (k+1)*C)` of every shard, so one reduce-scatter (or all-gather) of a column gives
//! each rank column `k` of its own shard, and the shards end as one call over the whole
//! range leaves them, bit for bit (every engine reduces an element in an order set by the
//! ranks alone). A flat copy would hold 4 bytes per parameter beside Burn's gradients (or
//! beside the new parameters) for the length of the call.

use std::ops::Range;

use accelerate_kernels::reduce::{ReduceOp, reduce_f32};
use burn::tensor::{Tensor, TensorData};

use super::cut::Cut;
use super::plan::FlatPlan;
use crate::error::AccelerateError;
use crate::params;
use crate::reducer::wire::Wire;

/// f32 elements one column moves per call, over all the ranks together (4 MiB).
const COLUMN_ELEMENTS: usize = 1 << 20;

/// Each segment's gradient on the host as f32, as backward returned it (`None` where a
/// parameter got none): no flat copy.
pub(crate) struct SegmentGrads(Vec<Option<TensorData>>);

impl SegmentGrads {
    /// The gradients of `plan`'s segments, in order. A tensor is moved, not cloned, so a
    /// uniquely owned one hands its data over uncopied.
    pub fn take(grads: impl Iterator<Item = Option<Tensor<1>>>) -> Self {
        Self(
            grads
                .map(|grad| grad.map(|grad| params::into_f32(grad.into_data())))
                .collect(),
        )
    }

    /// None at all (before the first step).
    pub fn none() -> Self {
        Self(Vec::new())
    }

    /// Segment `index`'s gradient, if it got one.
    pub fn segment(&self, index: usize) -> Option<&[f32]> {
        self.0.get(index)?.as_ref()?.as_slice::<f32>().ok()
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        self.0.iter().flatten().map(|data| data.bytes().len()).sum()
    }

    /// The sum of the squares of every gradient, segment by segment.
    pub fn sum_of_squares(&self) -> f64 {
        (0..self.0.len())
            .filter_map(|index| self.segment(index))
            .map(accelerate_kernels::sum_of_squares)
            .sum()
    }

    /// This rank's shard of the gradients, each segment's part as it holds it.
    fn shard_parts<'a>(&'a self, plan: &'a FlatPlan) -> impl Iterator<Item = &'a [f32]> + 'a {
        (0..self.0.len()).filter_map(move |index| self.segment(index)?.get(plan.shard_part(index)?))
    }

    /// The sum of the squares of this rank's shard of the gradients.
    pub fn shard_sum_of_squares(&self, plan: &FlatPlan) -> f64 {
        self.shard_parts(plan)
            .map(accelerate_kernels::sum_of_squares)
            .sum()
    }

    /// Multiplies this rank's shard of the gradients by `factor`.
    pub fn scale_shard(&mut self, plan: &FlatPlan, factor: f32) {
        for (index, data) in self.0.iter_mut().enumerate() {
            if let (Some(data), Some(part)) = (data, plan.shard_part(index))
                && let Ok(values) = data.as_mut_slice::<f32>()
                && let Some(values) = values.get_mut(part)
            {
                accelerate_kernels::scale_in_place(values, factor);
            }
        }
    }

    /// This rank's shard of the gradients as one vector (zeros where no gradient or padding
    /// is).
    pub fn shard_values(&self, plan: &FlatPlan) -> Vec<f32> {
        let mut shard = vec![0.0; plan.shard.len()];
        self.fill(plan, plan.shard.clone(), &mut shard);
        shard
    }

    /// Copies `values`, the flat range `range`, over the segments' gradients there.
    fn write(&mut self, plan: &FlatPlan, range: Range<usize>, values: &[f32]) {
        for (index, part, within) in plan.pieces(range) {
            let target = self.0.get_mut(index).and_then(Option::as_mut);
            if let Some(target) = target.and_then(|d| d.as_mut_slice::<f32>().ok()) {
                target[part].copy_from_slice(&values[within]);
            }
        }
    }

    /// Copies the flat range `range` into `out` (zeros where no gradient or padding is).
    fn fill(&self, plan: &FlatPlan, range: Range<usize>, out: &mut [f32]) {
        out.fill(0.0);
        for (index, part, within) in plan.pieces(range) {
            if let Some(values) = self.segment(index) {
                out[within].copy_from_slice(&values[part]);
            }
        }
    }
}

/// How the padded flat range is cut into columns over `world` ranks.
struct Columns {
    world: usize,
    /// Elements of one shard (`S`).
    shard: usize,
    /// Elements of one column of a shard (`C`; the last one may be shorter).
    width: usize,
}

impl Columns {
    fn new(padded: usize, world: usize) -> Self {
        let world = world.max(1);
        let shard = padded / world;
        let width = (COLUMN_ELEMENTS / world).clamp(1, shard.max(1));
        Self {
            world,
            shard,
            width,
        }
    }

    /// Column `k` within a shard.
    fn range(&self, k: usize) -> Range<usize> {
        let start = k * self.width;
        start..(start + self.width).min(self.shard)
    }

    fn count(&self) -> usize {
        self.shard.div_ceil(self.width)
    }

    /// Column `k` of rank `r`'s shard, in the flat range.
    fn of_rank(&self, r: usize, k: usize) -> Range<usize> {
        let column = self.range(k);
        r * self.shard + column.start..r * self.shard + column.end
    }

    /// For each column, the segments whose last elements it carries (their data is let go
    /// once it is sent).
    fn last_uses(&self, plan: &FlatPlan) -> Vec<Vec<usize>> {
        let mut last = vec![Vec::new(); self.count()];
        for (index, segment) in plan.segments.iter().enumerate() {
            let column = (0..self.world)
                .filter_map(|r| {
                    let start = segment.offset.max(r * self.shard);
                    let end = (segment.offset + segment.len).min((r + 1) * self.shard);
                    (start < end).then(|| (end - 1 - r * self.shard) / self.width)
                })
                .max();
            if let Some(column) = column.filter(|&c| c < last.len()) {
                last[column].push(index);
            }
        }
        last
    }
}

/// Averages `grads` over the processes into `shard`, this rank's part (`plan.shard`) of the
/// flat range: replacing what it holds, or added to it with `add` (a window's sum). Each
/// segment's data is let go after the last column that carries it.
pub(super) fn reduce_scatter(
    plan: &FlatPlan,
    mut grads: SegmentGrads,
    shard: &mut [f32],
    add: bool,
    wire: &mut Wire,
    cut: Cut<'_>,
) -> Result<(), AccelerateError> {
    if !cut.shard.is_distributed() && cut.replicas.is_none() {
        // One process's shard is all of it (ZeRO kept for one GPU where NCCL was required).
        if add {
            reduce_f32(shard, &grads.shard_values(plan), ReduceOp::Sum);
        } else {
            grads.fill(plan, plan.shard.clone(), shard);
        }
        return Ok(());
    }
    by_columns(
        plan,
        &mut grads,
        wire,
        cut,
        |_| false,
        |_, column, mine| {
            let target = &mut shard[column];
            if add {
                reduce_f32(target, mine, ReduceOp::Sum);
            } else {
                target.copy_from_slice(mine);
            }
        },
    )
}

/// Averages `grads` over the processes where they are: this rank's part of each gradient (its
/// shard, `plan.shard`) ends as the average, in the gradient's own tensor; the other parts are
/// left as sent, and a gradient with no part in the shard is let go after the last column
/// that carries it. No buffer of the shard's length: the formula's 8P + 8P/N at ZeRO-1.
/// Returns the gradients kept.
pub(super) fn reduce_scatter_in_place(
    plan: &FlatPlan,
    mut grads: SegmentGrads,
    wire: &mut Wire,
    cut: Cut<'_>,
) -> Result<SegmentGrads, AccelerateError> {
    // A segment of the shard that got no gradient here receives the average all the same (a
    // peer's may have one).
    grads.0.resize_with(plan.segments.len(), || None);
    for (index, (segment, data)) in plan.segments.iter().zip(grads.0.iter_mut()).enumerate() {
        if data.is_none() && plan.shard_part(index).is_some() {
            *data = Some(TensorData::new(vec![0.0_f32; segment.len], [segment.len]));
        }
    }
    if !cut.shard.is_distributed() && cut.replicas.is_none() {
        // One process's shard is all of it, averaged already.
        return Ok(grads);
    }
    // This rank's own column is read for the last time when it is sent: later columns are
    // others', so the average can take its place.
    let keep = |index| plan.shard_part(index).is_some();
    let shard_start = plan.shard.start;
    by_columns(plan, &mut grads, wire, cut, keep, |grads, column, mine| {
        grads.write(
            plan,
            shard_start + column.start..shard_start + column.end,
            mine,
        );
    })?;
    Ok(grads)
}

/// The column loop of both reduce-scatters: column `k` of every rank's shard is filled from
/// `grads` and reduced (mean) into this rank's, which `deliver` receives with its range within
/// the shard; each segment's data is let go after the last column that carries it, unless
/// `keep(index)`.
fn by_columns(
    plan: &FlatPlan,
    grads: &mut SegmentGrads,
    wire: &mut Wire,
    cut: Cut<'_>,
    keep: impl Fn(usize) -> bool,
    mut deliver: impl FnMut(&mut SegmentGrads, Range<usize>, &[f32]),
) -> Result<(), AccelerateError> {
    let columns = Columns::new(plan.padded, cut.shard.world_size());
    let last_uses = columns.last_uses(plan);
    // One column's input and this rank's result, reused by every column; `fill` writes every
    // element.
    let (mut input, mut mine) = (Vec::new(), Vec::new());
    for (k, done) in last_uses.iter().enumerate() {
        let width = columns.range(k).len();
        input.resize(width * columns.world, 0.0);
        for (r, piece) in input.chunks_exact_mut(width).enumerate() {
            grads.fill(plan, columns.of_rank(r, k), piece);
        }
        mine.resize(width, 0.0);
        cut.shard
            .timed(|group| wire.reduce_scatter_mean(&mut input, &mut mine, None, group))?;
        cut.across_replicas(&mut mine, wire)?;
        deliver(grads, columns.range(k), &mine);
        for &index in done {
            if !keep(index) {
                grads.0[index] = None;
            }
        }
    }
    Ok(())
}

/// Every rank's `shard` (its part of the flat range) put together, one vector per segment of
/// `plan`.
pub(super) fn all_gather(
    plan: &FlatPlan,
    shard: &[f32],
    cut: Cut<'_>,
) -> Result<Vec<Vec<f32>>, AccelerateError> {
    let comm = cut.shard;
    let mut out: Vec<Vec<f32>> = plan.segments.iter().map(|s| vec![0.0; s.len]).collect();
    let world = if comm.is_distributed() {
        comm.world_size()
    } else {
        1
    };
    let columns = Columns::new(plan.padded, world);
    let mut gathered = Vec::new();
    for k in 0..columns.count() {
        let column = columns.range(k);
        let width = column.len();
        let mine = &shard[column];
        if world > 1 {
            gathered.resize(width * world, 0.0);
            comm.timed(|group| group.all_gather(mine, &mut gathered))?;
        } else {
            gathered.clear();
            gathered.extend_from_slice(mine);
        }
        for (r, piece) in gathered.chunks_exact(width).enumerate() {
            scatter(plan, columns.of_rank(r, k), piece, &mut out);
        }
    }
    Ok(out)
}

/// Copies `values`, the flat range `range`, into the segments' vectors (padding dropped).
fn scatter(plan: &FlatPlan, range: Range<usize>, values: &[f32], out: &mut [Vec<f32>]) {
    for (index, part, within) in plan.pieces(range) {
        if let Some(target) = out.get_mut(index) {
            target[part].copy_from_slice(&values[within]);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::reducer::flat::Segment;

    fn plan(lens: &[usize], world: usize, rank: usize) -> FlatPlan {
        let mut offset = 0;
        let segments = lens
            .iter()
            .enumerate()
            .map(|(i, &len)| {
                let segment = Segment {
                    id: i as u64,
                    path: format!("p{i}"),
                    shape: vec![len],
                    offset,
                    len,
                };
                offset += len;
                segment
            })
            .collect::<Vec<_>>();
        let padded = offset.div_ceil(world) * world;
        let shard = padded / world;
        FlatPlan {
            entries: (0..segments.len()).collect(),
            times: vec![0; segments.len()],
            has_grad: vec![false; segments.len()],
            segments,
            len: offset,
            padded,
            shard: rank * shard..(rank + 1) * shard,
        }
    }

    #[test]
    fn columns_cover_every_shard_once_and_each_segment_ends_in_one() {
        let plan = plan(&[5, 1, 9, 3], 3, 0);
        let columns = Columns {
            world: 3,
            shard: plan.padded / 3,
            width: 2,
        };
        let mut seen = vec![0; plan.padded];
        for k in 0..columns.count() {
            for r in 0..3 {
                for i in columns.of_rank(r, k) {
                    seen[i] += 1;
                }
            }
        }
        assert!(seen.iter().all(|&n| n == 1), "{seen:?}");
        let ends: Vec<usize> = columns.last_uses(&plan).concat();
        let mut sorted = ends.clone();
        sorted.sort_unstable();
        assert_eq!(sorted, vec![0, 1, 2, 3]);
    }

    #[test]
    fn a_shard_averaged_in_place_is_read_from_the_gradients_own_tensors() {
        use crate::reducer::flat::grads::ShardGrads;
        // 7 elements over 2 ranks, padded to 8: rank 1's shard is 4..8, the last three of
        // segment 1 and one element of padding; segment 0 has no part in it.
        let plan = plan(&[3, 4], 2, 1);
        assert_eq!(plan.shard_part(0), None);
        assert_eq!(plan.shard_part(1), Some(1..4));
        let mut grads = SegmentGrads(vec![
            Some(TensorData::new(vec![9.0f32; 3], [3])),
            Some(TensorData::new(vec![5.0f32, 6.0, 7.0, 8.0], [4])),
        ]);
        grads.write(&plan, 4..8, &[1.0, 2.0, 3.0, 4.0]);
        assert_eq!(grads.segment(1), Some(&[5.0, 1.0, 2.0, 3.0][..]));
        assert_eq!(grads.shard_values(&plan), vec![1.0, 2.0, 3.0, 0.0]);
        let mut shard = ShardGrads::InSegments(grads);
        assert_eq!(shard.part(&plan, 1, 0..3), Some(&[1.0, 2.0, 3.0][..]));
        assert_eq!(shard.sum_of_squares(&plan), 14.0);
        shard.scale(&plan, 2.0);
        assert_eq!(shard.part(&plan, 1, 1..3), Some(&[4.0, 6.0][..]));
        shard.release();
        assert_eq!(shard.bytes(), 0);
    }

    #[test]
    fn a_column_reads_and_writes_the_segments_it_crosses() {
        let plan = plan(&[3, 4], 2, 0);
        let grads = SegmentGrads(vec![
            Some(TensorData::new(vec![1.0f32, 2.0, 3.0], [3])),
            None,
        ]);
        let mut out = vec![9.0; 4];
        grads.fill(&plan, 1..5, &mut out);
        assert_eq!(out, vec![2.0, 3.0, 0.0, 0.0]);
        let mut segments = vec![vec![0.0; 3], vec![0.0; 4]];
        scatter(&plan, 2..8, &[1.0, 2.0, 3.0, 4.0, 5.0, 6.0], &mut segments);
        assert_eq!(
            segments,
            vec![vec![0.0, 0.0, 1.0], vec![2.0, 3.0, 4.0, 5.0]]
        );
    }
}
