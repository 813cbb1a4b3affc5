//! Streams: data read shard by shard without knowing how many items it holds (a user's
//! iterator, Parquet row groups decoded in sequence), split across processes and resumable to
//! the item. This module owns the rules, pure functions of the configuration, like the
//! sampler's order:
//!
//! - **Shards to processes.** Epoch `e` shuffles the shard numbers with `(seed, e)` and deals
//!   them round-robin: process `r` of `W` reads the shards at positions `r, r + W, ...` of that
//!   order ([`stream_shards`]). When `W` does not divide the shards, the first
//!   `shards % W` processes get one more; fewer shards than processes is refused
//!   ([`check_world`]).
//! - **Shuffle buffer.** A process's items are shuffled in consecutive blocks of
//!   `shuffle_buffer` items (a block may span shards), each by a generator seeded from
//!   `(seed, epoch, world, rank, block)` ([`block_order`]). A block is re-derived by reading it
//!   again, so where a process stands ([`StreamCursor`]) is a few numbers, never items.
//! - **Batches agreed.** Processes hold unequal shares. Before every batch each one says how
//!   many batches it holds ready (up to a lookahead) and whether its stream ended
//!   ([`Ahead`]); [`agree`] turns what all of them said into how many batches the epoch still
//!   has, the same on every process, so no process waits for a batch that never comes.
//!   `even_batches` continues while any process has data (the others pad), otherwise the
//!   epoch ends when the first process runs out.
//! - **Another number of processes.** The saved processes' remaining streams are dealt
//!   round-robin to the new processes ([`deal`]); each continues them one after the other,
//!   exactly where they stood, so the epoch's items are still read once each.

use serde::{Deserialize, Serialize};

use crate::sampler::{SplitMix64, epoch_order, epoch_rng};

/// How a stream is cut into epochs, shards and batches; part of what a resume must match.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamConfig {
    /// Shards the source has.
    pub shards: usize,
    /// Whether shard order and items are shuffled.
    pub shuffle: bool,
    /// The seed of the shuffles.
    pub seed: u64,
    /// Items shuffled together (1: shards shuffled, items in shard order).
    pub shuffle_buffer: usize,
    /// Items per batch and process.
    pub batch_size: usize,
    /// Whether every process gets as many batches (padding where its data ran out).
    pub even_batches: bool,
    /// Whether short batches are dropped.
    pub drop_last: bool,
}

/// Where one process's stream stands: whose deal it follows and the first item of the block
/// being read (reading that block again re-derives its order).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamCursor {
    /// The world size of the deal (see [`stream_shards`]).
    pub world: usize,
    /// The rank in that deal.
    pub rank: usize,
    /// The block's first item: its shard's position in the dealt list...
    pub shard: usize,
    /// ...and its item in that shard.
    pub item: u64,
    /// The block's number in this stream (it seeds the block's order).
    pub block: u64,
    /// Items of the block already handed out.
    pub emitted: usize,
}

impl StreamCursor {
    /// The start of rank `rank`'s stream in a world of `world` processes.
    pub fn start(world: usize, rank: usize) -> Self {
        Self {
            world,
            rank,
            shard: 0,
            item: 0,
            block: 0,
            emitted: 0,
        }
    }
}

/// Where padding items are read: the epoch's shards in their shuffled order, from the start,
/// wrapping around.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct PaddingCursor {
    /// The position in the epoch's shard order.
    pub shard: usize,
    /// The next item of that shard.
    pub item: u64,
}

/// One process's position in a stream, saved in its checkpoint file.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct StreamState {
    /// How the stream was cut.
    pub config: StreamConfig,
    /// The epoch in progress (or the next one, at its start).
    pub epoch: u64,
    /// Batches this process handed out in the epoch.
    pub batches: usize,
    /// Where this process's next padding item is read.
    pub padding: PaddingCursor,
    /// The streams this process still reads in the epoch, the current one first.
    pub streams: Vec<StreamCursor>,
}

impl StreamState {
    /// The start of `epoch` for rank `rank` of `world`.
    pub fn epoch_start(config: StreamConfig, epoch: u64, (world, rank): (usize, usize)) -> Self {
        Self {
            config,
            epoch,
            batches: 0,
            padding: PaddingCursor::default(),
            streams: vec![StreamCursor::start(world, rank)],
        }
    }

    /// True when nothing of the epoch was read yet by rank `rank` of `world`: it still holds
    /// its own whole stream of that world.
    pub fn at_epoch_start(&self, (world, rank): (usize, usize)) -> bool {
        self.batches == 0 && self.streams[..] == [StreamCursor::start(world, rank)]
    }
}

/// A stream's rules that a process does not satisfy.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StreamError {
    /// More processes than shards: some would read nothing, every epoch.
    #[error(
        "the stream has {shards} shard(s) for {world} processes. hint: split the data into at \
         least as many shards (files, row groups) as processes"
    )]
    TooFewShards {
        /// Shards of the source.
        shards: usize,
        /// Processes.
        world: usize,
    },
    /// The saved processes' states do not belong to one stream position.
    #[error("the saved stream states disagree: {0}")]
    Inconsistent(String),
}

/// Refuses a world of more processes than shards.
pub fn check_world(config: &StreamConfig, world: usize) -> Result<(), StreamError> {
    if config.shards < world {
        return Err(StreamError::TooFewShards {
            shards: config.shards,
            world,
        });
    }
    Ok(())
}

/// The epoch's shard order (shuffled with `(seed, epoch)`, or in order).
pub fn shard_order(config: &StreamConfig, epoch: u64) -> Vec<usize> {
    epoch_order(config.shards, config.shuffle, config.seed, epoch)
}

/// The shards rank `rank` of `world` reads in `epoch`, in order: every `world`-th of the
/// epoch's shard order, from position `rank`.
pub fn stream_shards(
    config: &StreamConfig,
    epoch: u64,
    (world, rank): (usize, usize),
) -> Vec<usize> {
    shard_order(config, epoch)
        .into_iter()
        .skip(rank)
        .step_by(world.max(1))
        .collect()
}

/// The order in which a block of `len` items is handed out: positions `0..len` shuffled by
/// a generator seeded from `(seed, epoch, world, rank, block)`, or in order.
pub fn block_order(
    config: &StreamConfig,
    epoch: u64,
    cursor: &StreamCursor,
    len: usize,
) -> Vec<usize> {
    let mut order: Vec<usize> = (0..len).collect();
    if config.shuffle {
        let mut mix = epoch_rng(config.seed, epoch);
        let key = mix.next_u64()
            ^ (cursor.world as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15)
            ^ (cursor.rank as u64).wrapping_mul(0xC2B2_AE3D_27D4_EB4F)
            ^ cursor.block.wrapping_mul(0x1656_67B1_9E37_79F9);
        let mut rng = SplitMix64::new(SplitMix64::new(key).next_u64());
        for i in (1..len).rev() {
            let j = rng.below(i as u64 + 1) as usize;
            order.swap(i, j);
        }
    }
    order
}

/// What a process holds before a batch: batches ready (at most the lookahead), how many of
/// them are full, whether its stream ended (so no more come) and whether reading it failed.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Ahead {
    /// Batches ready, the next one first.
    pub ready: usize,
    /// Of them, full ones (all but possibly the last when the stream ended).
    pub full: usize,
    /// No batch comes after these (always so when the last one is short).
    pub ended: bool,
    /// Reading failed (every process ends the epoch with an error).
    pub failed: bool,
}

/// What the processes agreed before a batch.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Agreed {
    /// Batches the epoch still has, this one included (0: the epoch is over); when not
    /// `exact`, at least this many.
    pub remaining: usize,
    /// Whether `remaining` is the exact count.
    pub exact: bool,
}

/// The batches the epoch still has, from every process's report (in rank order; the same
/// result on every process). `lookahead`: the batches a process reads ahead when its stream
/// has not ended (reports of such processes hold that many).
pub fn agree(config: &StreamConfig, lookahead: usize, reports: &[Ahead]) -> Agreed {
    // Each process's own remaining batches: exact when its stream ended, else a lower bound.
    let own = |a: &Ahead| -> (usize, bool) {
        match (a.ended, config.drop_last) {
            (true, true) => (a.full, true),
            (true, false) => (a.ready, true),
            (false, _) => (lookahead.max(a.ready), false),
        }
    };
    let counts = reports.iter().map(own);
    if config.even_batches && !config.drop_last {
        // Until every process ran out.
        let all_ended = reports.iter().all(|a| a.ended);
        let most = counts.map(|(n, _)| n).max().unwrap_or(0);
        Agreed {
            remaining: most,
            exact: all_ended,
        }
    } else {
        // Until the first process runs out (with drop_last: of full batches).
        let fewest = counts.clone().map(|(n, _)| n).min().unwrap_or(0);
        let exact = counts.clone().any(|(n, exact)| exact && n == fewest);
        Agreed {
            remaining: fewest,
            exact,
        }
    }
}

/// The streams each of `world` new processes reads, from the states every saved process wrote
/// (in rank order): the epoch's unfinished streams in saved rank order, dealt round-robin.
/// When every saved process stood at the start of the epoch, each new process starts its own
/// deal instead.
pub fn deal(saved: &[StreamState], world: usize) -> Result<Vec<StreamState>, StreamError> {
    let Some(first) = saved.first() else {
        return Err(StreamError::Inconsistent("no process saved a state".into()));
    };
    if let Some((rank, other)) = saved
        .iter()
        .enumerate()
        .find(|(_, s)| s.config != first.config || s.epoch != first.epoch)
    {
        return Err(StreamError::Inconsistent(format!(
            "rank {rank} saved epoch {} of {:?}, rank 0 epoch {} of {:?}",
            other.epoch, other.config, first.epoch, first.config
        )));
    }
    let (config, epoch) = (first.config.clone(), first.epoch);
    let saved_world = saved.len();
    if saved
        .iter()
        .enumerate()
        .all(|(rank, s)| s.at_epoch_start((saved_world, rank)))
    {
        return Ok((0..world)
            .map(|rank| StreamState::epoch_start(config.clone(), epoch, (world, rank)))
            .collect());
    }
    let mut states: Vec<StreamState> = (0..world)
        .map(|_| StreamState {
            config: config.clone(),
            epoch,
            batches: 0,
            padding: PaddingCursor::default(),
            streams: Vec::new(),
        })
        .collect();
    let streams = saved.iter().flat_map(|s| s.streams.iter().copied());
    for (i, stream) in streams.enumerate() {
        states[i % world.max(1)].streams.push(stream);
    }
    Ok(states)
}

#[cfg(test)]
#[path = "stream_order_tests.rs"]
mod tests;
