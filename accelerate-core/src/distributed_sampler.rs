//! `DistributedSampler`: which data-set indices each rank visits, batch by batch, in an epoch.
//!
//! Every rank computes the same epoch order ([`epoch_order`] of `(seed, epoch)`, or with
//! [`ShuffleOrder::Keyed`] the [`KeyedOrder`], computed at each position) without
//! communicating, and takes its share of each *round*: the next `world_size` batches of that
//! order, one per rank, in rank order. So concatenating the ranks' batches of a round, in rank
//! order, gives the round's stretch of the epoch order, which is what
//! `gather_for_metrics` relies on to return predictions in order.
//!
//! - Per-rank batches (default): each rank's batch has `batch_size` samples; the global batch
//!   is `batch_size x world_size`.
//! - `split_batches`: `batch_size` is the global batch, split evenly across ranks (it must be
//!   a multiple of the world size).
//!
//! The last round may be short. With `drop_last` it is dropped. Otherwise, with `even_batches`
//! (the default) and several ranks, it is filled by cycling from the start of the epoch order,
//! so every rank gets the same number of full batches, and [`RankBatch::padding`] says how
//! many of a batch's samples are such repeats; without `even_batches` (or with one rank, which
//! needs no evening out) it is cut in batch-sized pieces, so some ranks get a short batch or
//! none.
//!
//! Data read in pieces ([`SamplerConfig::pieces`]: Parquet row groups, files) follows the
//! [piece order](crate::piece_order) instead, and each rank reads a contiguous stretch of it:
//! of the epoch's `full` complete rounds, rank `r` takes the `full` batches starting at item
//! `r * full * batch`, so it reads its own pieces; the last round is dealt as above. The
//! number of batches, the padding and the last round are those of the round-robin order, but
//! a gathered round is no longer a stretch of the epoch order (every sample still comes once).
//! Resumed on another number of processes, such a loader continues with what the saved ranks
//! left ([`ConsumedShares::remainder`]), cut in the same way.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::piece_order::{ConsumedShares, PieceLayout, Positions};
use crate::rank_batches::{Cut, EpochItems};
pub use crate::rank_batches::{RankBatch, RankBatches};
use crate::sampler::{KeyedOrder, ShuffleOrder, epoch_order};

/// How the data is cut and shared.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerConfig {
    /// Items in the data set.
    pub len: usize,
    /// Samples per rank per batch, or per global batch with `split_batches`.
    pub batch_size: usize,
    /// Visit each epoch in a shuffled order (else in data-set order).
    pub shuffle: bool,
    /// Seed of the shuffled orders.
    pub seed: u64,
    /// Drop the last round when it is short.
    pub drop_last: bool,
    /// Fill a short last round by cycling from the epoch's start (ignored with `drop_last`).
    pub even_batches: bool,
    /// `batch_size` is the global batch, split across ranks.
    pub split_batches: bool,
    /// The data is read in these pieces: each rank reads a contiguous stretch of the piece
    /// order (see the module).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub pieces: Option<PieceLayout>,
    /// How a shuffled order is made (for the pieces' items: the [piece order] instead).
    ///
    /// [piece order]: crate::piece_order
    #[serde(default, skip_serializing_if = "is_drawn")]
    pub order: ShuffleOrder,
}

/// Checkpoints of runs from before [`ShuffleOrder`] read as [`ShuffleOrder::Drawn`].
fn is_drawn(order: &ShuffleOrder) -> bool {
    *order == ShuffleOrder::Drawn
}

impl SamplerConfig {
    /// `len` items in batches of `batch_size` per rank, shuffled with `seed`, even batches.
    pub fn new(len: usize, batch_size: usize, seed: u64) -> Self {
        Self {
            len,
            batch_size,
            shuffle: true,
            seed,
            drop_last: false,
            even_batches: true,
            split_batches: false,
            pieces: None,
            order: ShuffleOrder::Drawn,
        }
    }
}

/// The configuration cannot describe a valid sampler.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SamplerError {
    /// A batch must hold at least one sample.
    #[error("batch_size is 0: expected at least 1")]
    ZeroBatch,
    /// `split_batches` needs a global batch that divides evenly.
    #[error(
        "split_batches: batch_size {batch_size} is not a multiple of the world size \
         {world_size}. hint: use a batch size divisible by the number of processes"
    )]
    Uneven {
        /// The global batch size.
        batch_size: usize,
        /// Ranks.
        world_size: usize,
    },
    /// The rank is outside the world.
    #[error("rank {rank} is not below the world size {world_size}")]
    Rank {
        /// The rank given.
        rank: usize,
        /// Ranks.
        world_size: usize,
    },
    /// Pieces that do not add up to the data set.
    #[error(
        "the pieces hold {pieces} items in all but the data set has {len}. hint: give the \
         data set's own pieces (for example its row groups' lengths)"
    )]
    Pieces {
        /// Items in all pieces (saturated).
        pieces: usize,
        /// Items in the data set.
        len: usize,
    },
}

/// Where a rank is in the data: the epoch, and how many of its batches it consumed.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SamplerCursor {
    /// The epoch.
    pub epoch: u64,
    /// Batches of that epoch this rank has consumed.
    pub batches_consumed: usize,
}

/// One rank's view of the data, epoch by epoch.
#[derive(Debug, Clone)]
pub struct DistributedSampler {
    config: SamplerConfig,
    rank: usize,
    world_size: usize,
    epoch: u64,
}

impl DistributedSampler {
    /// The sampler of `rank` among `world_size` ranks.
    pub fn new(
        config: SamplerConfig,
        rank: usize,
        world_size: usize,
    ) -> Result<Self, SamplerError> {
        if config.batch_size == 0 {
            return Err(SamplerError::ZeroBatch);
        }
        if rank >= world_size {
            return Err(SamplerError::Rank { rank, world_size });
        }
        if config.split_batches && !config.batch_size.is_multiple_of(world_size) {
            return Err(SamplerError::Uneven {
                batch_size: config.batch_size,
                world_size,
            });
        }
        if let Some(pieces) = &config.pieces {
            let total = pieces.total().unwrap_or(usize::MAX);
            if total != config.len {
                return Err(SamplerError::Pieces {
                    pieces: total,
                    len: config.len,
                });
            }
        }
        Ok(Self {
            config,
            rank,
            world_size,
            epoch: 0,
        })
    }

    /// The configuration.
    pub fn config(&self) -> &SamplerConfig {
        &self.config
    }

    /// Selects the epoch whose order [`batches`](Self::batches) follows.
    pub fn set_epoch(&mut self, epoch: u64) {
        self.epoch = epoch;
    }

    /// The selected epoch.
    pub fn epoch(&self) -> u64 {
        self.epoch
    }

    /// Samples in one rank's full batch.
    pub fn rank_batch_size(&self) -> usize {
        self.rank_batch_size_at(self.world_size)
    }

    /// Samples in a round (one batch of every rank).
    pub fn global_batch_size(&self) -> usize {
        self.rank_batch_size() * self.world_size
    }

    /// Whether a short last round is padded: asked for, and needed (several ranks).
    fn pads(&self) -> bool {
        self.config.even_batches && !self.config.drop_last && self.world_size > 1
    }

    /// Batches this rank gets per epoch.
    pub fn len(&self) -> usize {
        self.len_of(self.config.len)
    }

    /// Batches this rank gets from `samples` samples of the epoch order.
    fn len_of(&self, samples: usize) -> usize {
        let round = self.global_batch_size();
        let (full, rest) = (samples / round, samples % round);
        let b = self.rank_batch_size();
        full + match rest {
            0 => 0,
            _ if self.config.drop_last => 0,
            _ if self.pads() => 1,
            rest => usize::from(rest > self.rank * b),
        }
    }

    /// True when this rank gets no batch in an epoch.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// This rank's batches of the selected epoch, from the start.
    pub fn batches(&self) -> RankBatches {
        self.batches_from(0)
    }

    /// This rank's batches of the selected epoch, skipping the first `skip` (resume).
    pub fn batches_from(&self, skip: usize) -> RankBatches {
        self.batches_of(Positions::range(0..self.config.len))
            .skipping(skip)
    }

    /// This rank's batches of the rest of the selected epoch once `start` samples of its order
    /// were consumed, over all ranks (resume with a different world size): the remaining
    /// samples are cut in rounds as a whole epoch is, and a short last round is padded from
    /// the epoch's start.
    pub fn batches_from_sample(&self, start: usize) -> RankBatches {
        self.batches_of(Positions::range(
            start.min(self.config.len)..self.config.len,
        ))
    }

    /// The epoch's order of items: [`epoch_order`], or the [piece order](crate::piece_order),
    /// which is made as it is read.
    fn epoch_items(&self) -> EpochItems {
        let (shuffle, seed) = (self.config.shuffle, self.config.seed);
        match &self.config.pieces {
            Some(pieces) => EpochItems::Pieces(pieces.cursor(shuffle, seed, self.epoch)),
            None if !shuffle => EpochItems::InOrder,
            None => match self.config.order {
                ShuffleOrder::Drawn => EpochItems::Listed(Arc::new(epoch_order(
                    self.config.len,
                    true,
                    seed,
                    self.epoch,
                ))),
                ShuffleOrder::Keyed => {
                    EpochItems::Keyed(KeyedOrder::new(self.config.len, seed, self.epoch))
                }
            },
        }
    }

    /// This rank's batches over `rest`, the positions of the epoch's order still to read.
    fn batches_of(&self, rest: Positions) -> RankBatches {
        let cut = Cut {
            rank: self.rank,
            batch: self.rank_batch_size(),
            world: self.world_size,
            count: self.len_of(rest.len()),
            contiguous: self.config.pieces.is_some(),
            pads: self.pads(),
        };
        RankBatches::new(cut, self.epoch_items(), rest, self.config.len)
    }

    /// For data read in pieces: this rank's batches after the runs of `consumed` read their
    /// shares (oldest first), without its first `skip` batches.
    pub fn batches_after(&self, consumed: &[ConsumedShares], skip: usize) -> RankBatches {
        let rest = consumed
            .iter()
            .fold(Positions::range(0..self.config.len), |rest, run| {
                run.remainder(&rest)
            });
        self.batches_of(rest).skipping(skip)
    }

    /// Batches per rank of [`batches_after`](Self::batches_after) with no skip.
    pub fn len_after(&self, consumed: &[ConsumedShares]) -> usize {
        self.len_of(self.remainder_len(consumed))
    }

    /// Padding of the last round of [`batches_after`](Self::batches_after), over all ranks.
    pub fn last_round_padding_after(&self, consumed: &[ConsumedShares]) -> usize {
        self.padding_of(self.remainder_len(consumed))
    }

    /// Items left after `consumed`: their count follows from the lengths alone.
    fn remainder_len(&self, consumed: &[ConsumedShares]) -> usize {
        consumed.iter().fold(self.config.len, |len, run| {
            let (world, b) = (run.world_size.max(1), run.rank_batch_size.max(1));
            len - world * run.batches.min(len / (world * b)) * b
        })
    }

    /// Items per batch on each rank of a run of `world_size` ranks with this configuration.
    pub fn rank_batch_size_at(&self, world_size: usize) -> usize {
        if self.config.split_batches {
            self.config.batch_size / world_size.max(1)
        } else {
            self.config.batch_size
        }
    }

    /// Batches this rank gets from the rest of the epoch once `start` samples were consumed.
    pub fn len_from_sample(&self, start: usize) -> usize {
        self.len_of(self.config.len.saturating_sub(start))
    }

    /// Padding samples in the last round after a start at sample `start` (see
    /// [`last_round_padding`](Self::last_round_padding)).
    pub fn last_round_padding_from_sample(&self, start: usize) -> usize {
        self.padding_of(self.config.len.saturating_sub(start))
    }

    /// Padding of the last round over `samples` samples, over all ranks.
    fn padding_of(&self, samples: usize) -> usize {
        let rest = samples % self.global_batch_size();
        if rest == 0 || !self.pads() {
            0
        } else {
            self.global_batch_size() - rest
        }
    }

    /// Padding samples in the whole last round (over all ranks): what `gather_for_metrics`
    /// drops from the end of the gathered round.
    pub fn last_round_padding(&self) -> usize {
        self.last_round_padding_from_sample(0)
    }

    /// The cursor after consuming `batches_consumed` batches of the selected epoch.
    pub fn cursor(&self, batches_consumed: usize) -> SamplerCursor {
        SamplerCursor {
            epoch: self.epoch,
            batches_consumed,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn all_configs() -> impl Iterator<Item = (SamplerConfig, usize)> {
        let lens = [0usize, 1, 2, 7, 10, 16, 31, 100];
        let batches = [1usize, 2, 3, 4, 8];
        lens.into_iter().flat_map(move |len| {
            batches.into_iter().flat_map(move |batch_size| {
                (1..=5usize).flat_map(move |world| {
                    (0..32u32).map(move |bits| {
                        let config = SamplerConfig {
                            len,
                            batch_size,
                            shuffle: bits & 1 != 0,
                            seed: 5,
                            drop_last: bits & 2 != 0,
                            even_batches: bits & 4 != 0,
                            split_batches: bits & 8 != 0,
                            pieces: None,
                            order: if bits & 16 != 0 {
                                ShuffleOrder::Keyed
                            } else {
                                ShuffleOrder::Drawn
                            },
                        };
                        (config, world)
                    })
                })
            })
        })
    }

    /// The epoch order `config` draws (without pieces).
    fn order_of(config: &SamplerConfig, epoch: u64) -> Vec<usize> {
        if config.shuffle && config.order == ShuffleOrder::Keyed {
            let keyed = KeyedOrder::new(config.len, config.seed, epoch);
            (0..config.len).map(|p| keyed.at(p)).collect()
        } else {
            epoch_order(config.len, config.shuffle, config.seed, epoch)
        }
    }

    fn samplers(
        config: &SamplerConfig,
        world: usize,
        epoch: u64,
    ) -> Option<Vec<DistributedSampler>> {
        (0..world)
            .map(|rank| {
                let mut s = DistributedSampler::new(config.clone(), rank, world).ok()?;
                s.set_epoch(epoch);
                Some(s)
            })
            .collect()
    }

    #[test]
    fn every_sample_once_per_epoch_and_gathered_in_order() {
        let mut checked = 0;
        for (config, world) in all_configs() {
            let Some(ranks) = samplers(&config, world, 3) else {
                assert!(config.split_batches && config.batch_size % world != 0);
                continue;
            };
            checked += 1;
            let order = order_of(&config, 3);
            let per_rank: Vec<Vec<RankBatch>> =
                ranks.iter().map(|s| s.batches().collect()).collect();
            for (s, batches) in ranks.iter().zip(&per_rank) {
                assert_eq!(s.len(), batches.len(), "{config:?} world {world}");
                assert!(batches.last().is_none_or(|b| b.last));
                assert_eq!(
                    batches.iter().filter(|b| b.last).count(),
                    usize::from(!batches.is_empty())
                );
            }
            if config.even_batches && !config.drop_last && world > 1 {
                let n = per_rank[0].len();
                assert!(
                    per_rank.iter().all(|b| b.len() == n),
                    "even: {config:?} world {world}"
                );
                let b = ranks[0].rank_batch_size();
                assert!(
                    per_rank
                        .iter()
                        .flatten()
                        .all(|batch| batch.indices.len() == b || config.len == 0)
                );
            }
            // Gather round by round in rank order, then drop the last round's padding.
            let rounds = per_rank.iter().map(Vec::len).max().unwrap_or(0);
            let mut gathered: Vec<usize> = Vec::new();
            for k in 0..rounds {
                for batches in &per_rank {
                    if let Some(batch) = batches.get(k) {
                        gathered.extend(&batch.indices);
                    }
                }
            }
            gathered.truncate(gathered.len() - ranks[0].last_round_padding());
            let expected_len = if config.drop_last {
                config.len - config.len % ranks[0].global_batch_size()
            } else {
                config.len
            };
            assert_eq!(gathered, order[..expected_len], "{config:?} world {world}");
            // The padding each batch reports adds up to the round's padding.
            let reported: usize = per_rank.iter().flatten().map(|b| b.padding).sum();
            assert_eq!(
                reported,
                ranks[0].last_round_padding(),
                "{config:?} world {world}"
            );
        }
        assert!(checked > 2000, "{checked} combinations checked");
    }

    #[test]
    fn every_process_draws_the_same_order() {
        let config = SamplerConfig::new(1000, 8, 42);
        let a = samplers(&config, 4, 7).unwrap();
        let b = samplers(&config, 4, 7).unwrap();
        for (x, y) in a.iter().zip(&b) {
            assert!(x.batches().eq(y.batches()));
        }
        let other_epoch = samplers(&config, 4, 8).unwrap();
        assert!(a[0].batches().ne(other_epoch[0].batches()));
    }

    #[test]
    fn batches_skipped_are_the_batches_made() {
        for (mut config, world) in all_configs().filter(|(_, w)| *w == 3) {
            for pieces in [false, true] {
                config.pieces = pieces.then(|| pieces_of(config.len));
                let Some(ranks) = samplers(&config, world, 1) else {
                    continue;
                };
                for s in &ranks {
                    let all: Vec<RankBatch> = s.batches().collect();
                    for step in 1..4 {
                        let made: Vec<RankBatch> =
                            all.iter().skip(1).step_by(step).cloned().collect();
                        assert!(s.batches().skip(1).step_by(step).eq(made), "{config:?}");
                    }
                }
            }
        }
    }

    #[test]
    fn resuming_from_a_cursor_continues_the_same_batches() {
        let mut s = DistributedSampler::new(SamplerConfig::new(103, 4, 1), 1, 3).unwrap();
        s.set_epoch(2);
        let all: Vec<RankBatch> = s.batches().collect();
        let cursor = s.cursor(5);
        let mut resumed = DistributedSampler::new(SamplerConfig::new(103, 4, 1), 1, 3).unwrap();
        resumed.set_epoch(cursor.epoch);
        assert!(
            resumed
                .batches_from(cursor.batches_consumed)
                .eq(all[5..].to_vec())
        );
    }

    #[test]
    fn split_batches_share_one_global_batch() {
        let config = SamplerConfig {
            split_batches: true,
            shuffle: false,
            ..SamplerConfig::new(16, 8, 0)
        };
        let ranks = samplers(&config, 2, 0).unwrap();
        assert_eq!(ranks[0].batches().next().unwrap().indices, [0, 1, 2, 3]);
        assert_eq!(ranks[1].batches().next().unwrap().indices, [4, 5, 6, 7]);
        let err = DistributedSampler::new(
            SamplerConfig {
                batch_size: 9,
                ..config
            },
            0,
            2,
        )
        .unwrap_err();
        assert!(
            err.to_string()
                .contains("not a multiple of the world size 2"),
            "{err}"
        );
    }

    #[test]
    fn even_batches_pad_by_cycling_and_say_so() {
        let config = SamplerConfig {
            shuffle: false,
            ..SamplerConfig::new(5, 2, 0)
        };
        let ranks = samplers(&config, 2, 0).unwrap();
        // Rounds of 4: [0 1 | 2 3], then [4 0 | 1 2] with 3 samples of padding.
        assert_eq!(
            ranks[0].batches().nth(1).unwrap(),
            RankBatch {
                indices: vec![4, 0],
                padding: 1,
                last: true
            }
        );
        assert_eq!(
            ranks[1].batches().nth(1).unwrap(),
            RankBatch {
                indices: vec![1, 2],
                padding: 2,
                last: true
            }
        );
        assert_eq!(ranks[0].last_round_padding(), 3);
    }

    #[test]
    fn resuming_from_a_sample_position_continues_the_epoch_order() {
        for (config, world) in all_configs() {
            let Some(before) = samplers(&config, world, 3) else {
                continue;
            };
            let rounds = before[0].len();
            for consumed in 0..=rounds {
                let start = (consumed * before[0].global_batch_size()).min(config.len);
                // Same world size: the same batches as skipping whole batches.
                for s in &before {
                    assert!(
                        s.batches_from_sample(start).eq(s.batches_from(consumed)),
                        "{config:?} world {world} consumed {consumed}"
                    );
                }
                // Another world size: the rest of the order, each sample once.
                for new_world in 1..=4 {
                    let Some(after) = samplers(&config, new_world, 3) else {
                        continue;
                    };
                    let mut seen: Vec<usize> = after
                        .iter()
                        .flat_map(|s| {
                            assert_eq!(
                                s.batches_from_sample(start).len(),
                                s.len_from_sample(start)
                            );
                            s.batches_from_sample(start).flat_map(|b| {
                                let real = b.indices.len() - b.padding;
                                b.indices.into_iter().take(real)
                            })
                        })
                        .collect();
                    seen.sort_unstable();
                    let mut rest = order_of(&config, 3)[start..].to_vec();
                    rest.sort_unstable();
                    if config.drop_last {
                        assert!(seen.len() <= rest.len());
                    } else {
                        assert_eq!(seen, rest, "{config:?} {world} -> {new_world} at {start}");
                    }
                }
            }
        }
    }

    /// Pieces of uneven lengths adding up to `len`.
    fn pieces_of(len: usize) -> PieceLayout {
        let mut lens = Vec::new();
        let (mut left, mut i) = (len, 0usize);
        while left > 0 {
            let piece = (1 + (i * 5) % 7).min(left);
            lens.push(piece);
            left -= piece;
            i += 1;
        }
        PieceLayout::new(lens, 6)
    }

    /// The real (non-padding) samples of each rank's batches, all ranks together, sorted.
    fn real_samples(batches: &[Vec<RankBatch>]) -> Vec<usize> {
        let mut real: Vec<usize> = batches
            .iter()
            .flatten()
            .flat_map(|b| b.indices[..b.indices.len() - b.padding].iter().copied())
            .collect();
        real.sort_unstable();
        real
    }

    #[test]
    fn data_read_in_pieces_gives_every_sample_once_from_contiguous_shares() {
        let mut checked = 0;
        for (mut config, world) in all_configs() {
            config.pieces = Some(pieces_of(config.len));
            let Some(ranks) = samplers(&config, world, 2) else {
                continue;
            };
            checked += 1;
            let per_rank: Vec<Vec<RankBatch>> =
                ranks.iter().map(|s| s.batches().collect()).collect();
            let round_robin = |rank| {
                let config = SamplerConfig {
                    pieces: None,
                    ..config.clone()
                };
                DistributedSampler::new(config, rank, world).unwrap()
            };
            for (rank, (s, batches)) in ranks.iter().zip(&per_rank).enumerate() {
                // As many batches and as much padding as the round-robin order.
                assert_eq!(
                    batches.len(),
                    round_robin(rank).len(),
                    "{config:?} world {world}"
                );
                assert_eq!(s.len(), batches.len());
            }
            let reported: usize = per_rank.iter().flatten().map(|b| b.padding).sum();
            assert_eq!(reported, round_robin(0).last_round_padding(), "{config:?}");
            let expected_len = if config.drop_last {
                config.len - config.len % ranks[0].global_batch_size()
            } else {
                config.len
            };
            let real = real_samples(&per_rank);
            if !config.drop_last {
                assert_eq!(
                    real,
                    (0..config.len).collect::<Vec<_>>(),
                    "{config:?} world {world}"
                );
            }
            assert_eq!(real.len(), expected_len, "{config:?} world {world}");
            // A rank's complete rounds are one stretch of the piece order.
            let order = config
                .pieces
                .as_ref()
                .unwrap()
                .epoch_order(config.shuffle, 5, 2);
            let full = config.len / ranks[0].global_batch_size();
            for (rank, batches) in per_rank.iter().enumerate() {
                let share: Vec<usize> = batches[..full]
                    .iter()
                    .flat_map(|b| b.indices.clone())
                    .collect();
                let b = ranks[0].rank_batch_size();
                assert_eq!(share, order[rank * full * b..(rank + 1) * full * b]);
            }
        }
        assert!(checked > 2000, "{checked} combinations checked");
    }

    #[test]
    fn data_read_in_pieces_resumed_on_another_world_size_reads_what_was_left_once() {
        for (mut config, old_world) in all_configs().filter(|(c, _)| !c.drop_last) {
            config.pieces = Some(pieces_of(config.len));
            let Some(old) = samplers(&config, old_world, 1) else {
                continue;
            };
            let old_batches: Vec<Vec<RankBatch>> =
                old.iter().map(|s| s.batches().collect()).collect();
            for consumed in 0..old[0].len() {
                for new_world in 1..=4 {
                    let Some(new) = samplers(&config, new_world, 1) else {
                        continue;
                    };
                    let run = [ConsumedShares {
                        world_size: old_world,
                        rank_batch_size: old[0].rank_batch_size(),
                        batches: consumed,
                    }];
                    let read: Vec<Vec<RankBatch>> =
                        old_batches.iter().map(|b| b[..consumed].to_vec()).collect();
                    let after: Vec<Vec<RankBatch>> = new
                        .iter()
                        .map(|s| s.batches_after(&run, 0).collect())
                        .collect();
                    for (s, batches) in new.iter().zip(&after) {
                        assert_eq!(s.len_after(&run), batches.len());
                    }
                    let mut all = real_samples(&read);
                    all.extend(real_samples(&after));
                    all.sort_unstable();
                    assert_eq!(
                        all,
                        (0..config.len).collect::<Vec<_>>(),
                        "{config:?}: {old_world} ranks read {consumed} batches, then {new_world}"
                    );
                    let padding: usize = after.iter().flatten().map(|b| b.padding).sum();
                    assert_eq!(padding, new[0].last_round_padding_after(&run));
                }
            }
        }
    }

    /// A digest of every rank's batches over every configuration, plain and in pieces, from
    /// the start, after a skip, after a sample position and after another run's shares.
    fn digest_of_all_batches() -> u64 {
        let mut hash = 0xcbf2_9ce4_8422_2325u64;
        let mut eat = |x: usize| {
            for b in (x as u64).to_le_bytes() {
                hash = (hash ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        for (mut config, world) in all_configs().filter(|(c, _)| c.order == ShuffleOrder::Drawn) {
            for pieces in [false, true] {
                config.pieces = pieces.then(|| pieces_of(config.len));
                let Some(ranks) = samplers(&config, world, 4) else {
                    continue;
                };
                let run = [ConsumedShares {
                    world_size: 3,
                    rank_batch_size: 2,
                    batches: 1,
                }];
                for s in &ranks {
                    let all = [
                        s.batches_from(0),
                        s.batches_from(1),
                        s.batches_from_sample(5),
                        s.batches_after(&run, 1),
                    ];
                    for batch in all.into_iter().flatten() {
                        batch.indices.iter().for_each(|&i| eat(i));
                        eat(batch.padding);
                        eat(usize::from(batch.last));
                        eat(usize::MAX);
                    }
                }
            }
        }
        hash
    }

    #[test]
    fn batches_are_frozen() {
        // Part of the resume contract: a change here breaks existing checkpoints' resume.
        assert_eq!(digest_of_all_batches(), 495_301_839_668_189_603);
    }
}
