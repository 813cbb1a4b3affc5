use std::collections::BTreeMap;

use proptest::prelude::*;

use super::*;
use crate::stream_walk::{ShardReader, StreamWalk, Walked, remaining_streams};

/// Items of shard `s` are `s * 1000 + i`.
fn item(shard: usize, i: u64) -> u64 {
    shard as u64 * 1000 + i
}

fn config(shards: usize, buffer: usize) -> StreamConfig {
    StreamConfig {
        shards,
        shuffle: true,
        seed: 11,
        shuffle_buffer: buffer,
        batch_size: 3,
        even_batches: true,
        drop_last: false,
    }
}

/// A walk over shards of the given lengths.
fn walk(
    lens: &[u64],
    config: &StreamConfig,
    epoch: u64,
    streams: Vec<StreamCursor>,
) -> Vec<(u64, Walked)> {
    let lens = lens.to_vec();
    type Opened = std::io::Result<ShardReader<'static, u64, std::io::Error>>;
    let open = move |shard: usize, skip: u64| -> Opened {
        let len = lens[shard];
        Ok(Box::new((skip..len).map(move |i| Ok(item(shard, i)))))
    };
    StreamWalk::new((config.clone(), epoch), streams, open)
        .collect::<Result<Vec<_>, _>>()
        .unwrap_or_else(|e| panic!("shard {}: {}", e.shard, e.source))
}

fn all_items(lens: &[u64]) -> Vec<u64> {
    let mut all: Vec<u64> = lens
        .iter()
        .enumerate()
        .flat_map(|(s, &n)| (0..n).map(move |i| item(s, i)))
        .collect();
    all.sort_unstable();
    all
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

#[test]
fn shards_are_dealt_round_robin_without_overlap() {
    for shards in 1..10 {
        for world in 1..=shards.min(4) {
            let cfg = config(shards, 1);
            for epoch in 0..3 {
                let dealt: Vec<Vec<usize>> = (0..world)
                    .map(|rank| stream_shards(&cfg, epoch, (world, rank)))
                    .collect();
                let mut all: Vec<usize> = dealt.concat();
                all.sort_unstable();
                assert_eq!(all, (0..shards).collect::<Vec<_>>());
                for (rank, mine) in dealt.iter().enumerate() {
                    let more = usize::from(rank < shards % world);
                    assert_eq!(
                        mine.len(),
                        shards / world + more,
                        "{shards} shards, {world}"
                    );
                }
            }
        }
    }
    assert!(check_world(&config(3, 1), 4).is_err());
    assert!(check_world(&config(4, 1), 4).is_ok());
}

#[test]
fn block_orders_are_permutations_that_differ_by_block_and_rank() {
    let cfg = config(4, 8);
    let at = |rank, block| StreamCursor {
        block,
        ..StreamCursor::start(2, rank)
    };
    let a = block_order(&cfg, 0, &at(0, 0), 50);
    assert_eq!(
        sorted(a.iter().map(|&i| i as u64).collect()),
        (0..50).collect::<Vec<_>>()
    );
    assert_ne!(a, block_order(&cfg, 0, &at(0, 1), 50));
    assert_ne!(a, block_order(&cfg, 0, &at(1, 0), 50));
    assert_ne!(a, block_order(&cfg, 1, &at(0, 0), 50));
    assert_eq!(a, block_order(&cfg, 0, &at(0, 0), 50));
    let plain = StreamConfig {
        shuffle: false,
        ..cfg
    };
    assert_eq!(block_order(&plain, 0, &at(0, 0), 5), [0, 1, 2, 3, 4]);
}

/// The order is part of the resume contract: a checkpoint continues in it.
#[test]
fn stream_order_is_frozen() {
    let mut digest: u64 = 0xcbf2_9ce4_8422_2325;
    let mut eat = |v: u64| {
        for b in v.to_le_bytes() {
            digest = (digest ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
        }
    };
    let lens = [7, 0, 13, 5, 9];
    for world in 1..=3 {
        for buffer in [1, 4, 100] {
            for epoch in 0..2 {
                for rank in 0..world {
                    let cfg = config(lens.len(), buffer);
                    for (item, _) in
                        walk(&lens, &cfg, epoch, vec![StreamCursor::start(world, rank)])
                    {
                        eat(item);
                    }
                }
            }
        }
    }
    assert_eq!(digest, 12_877_810_944_332_748_597);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(200))]

    /// Every item is read once per epoch over the processes, and from the cursor after any
    /// item a new walk reads exactly the rest.
    #[test]
    fn walks_read_every_item_once_and_resume_from_any_item(
        lens in prop::collection::vec(0u64..20, 1..8),
        world in 1usize..4,
        buffer in 1usize..12,
        epoch in 0u64..3,
    ) {
        prop_assume!(lens.len() >= world);
        let cfg = config(lens.len(), buffer);
        let mut read = Vec::new();
        for rank in 0..world {
            let streams = vec![StreamCursor::start(world, rank)];
            let mine = walk(&lens, &cfg, epoch, streams.clone());
            for k in 0..mine.len() {
                let rest = walk(&lens, &cfg, epoch, remaining_streams(&streams, mine[k].1));
                let expected: Vec<u64> = mine[k + 1..].iter().map(|(i, _)| *i).collect();
                prop_assert_eq!(rest.iter().map(|(i, _)| *i).collect::<Vec<_>>(), expected);
            }
            read.extend(mine.into_iter().map(|(i, _)| i));
        }
        prop_assert_eq!(sorted(read), all_items(&lens));
    }

    /// Processes stopped anywhere and dealt to another number of processes, twice: every item
    /// of the epoch is read once over the three runs.
    #[test]
    fn streams_dealt_to_other_world_sizes_read_the_rest_once(
        lens in prop::collection::vec(0u64..20, 3..8),
        worlds in (1usize..4, 1usize..4, 1usize..4),
        buffer in 1usize..12,
        stops in prop::collection::vec(0usize..60, 8),
    ) {
        let cfg = config(lens.len(), buffer);
        let mut states: Vec<StreamState> = (0..worlds.0)
            .map(|rank| StreamState::epoch_start(cfg.clone(), 1, (worlds.0, rank)))
            .collect();
        let mut read = Vec::new();
        let mut stops = stops.into_iter().cycle();
        for next_world in [worlds.1, worlds.2] {
            for state in &mut states {
                let mine = walk(&lens, &cfg, 1, state.streams.clone());
                let stop = stops.next().unwrap_or(0).min(mine.len());
                if stop > 0 {
                    state.streams = remaining_streams(&state.streams, mine[stop - 1].1);
                    state.batches = stop;
                }
                read.extend(mine[..stop].iter().map(|(i, _)| *i));
            }
            states = deal(&states, next_world).map_err(|e| TestCaseError::fail(e.to_string()))?;
            prop_assert_eq!(states.len(), next_world);
        }
        for state in &states {
            read.extend(walk(&lens, &cfg, 1, state.streams.clone()).into_iter().map(|(i, _)| i));
        }
        prop_assert_eq!(sorted(read), all_items(&lens));
    }

    /// The agreement: with even batches every process gets as many batches as the longest
    /// share has, else as many as the shortest (with drop_last: full ones); the length told
    /// before each batch is exact when said to be, else a lower bound at least the lookahead.
    #[test]
    fn agreement_matches_the_shares(
        items in prop::collection::vec(0usize..40, 1..5),
        lookahead in 1usize..5,
        even_batches: bool,
        drop_last: bool,
    ) {
        let cfg = StreamConfig { even_batches, drop_last, ..config(8, 1) };
        let b = cfg.batch_size;
        let batches: Vec<usize> = items.iter().map(|n| n.div_ceil(b)).collect();
        let full: Vec<usize> = items.iter().map(|n| n / b).collect();
        let expected = if drop_last {
            full.iter().copied().min().unwrap_or(0)
        } else if even_batches {
            batches.iter().copied().max().unwrap_or(0)
        } else {
            batches.iter().copied().min().unwrap_or(0)
        };
        let mut k = 0;
        loop {
            let reports: Vec<Ahead> = (0..items.len())
                .map(|r| {
                    let left = batches[r].saturating_sub(k);
                    let ready = left.min(lookahead);
                    let full_left = full[r].saturating_sub(k).min(ready);
                    // A stream whose batches fill the lookahead exactly may or may not have said
                    // it ended yet, unless its last is short (no batch follows a short one).
                    let short = full_left < ready;
                    let ended = left < lookahead || (left == lookahead && (k % 2 == 0 || short));
                    Ahead { ready, full: full_left, ended, failed: false }
                })
                .collect();
            let agreed = agree(&cfg, lookahead, &reports);
            if agreed.remaining == 0 {
                break;
            }
            if agreed.exact {
                prop_assert_eq!(k + agreed.remaining, expected);
            } else {
                prop_assert!(k + lookahead <= expected);
                prop_assert!(agreed.remaining >= lookahead);
            }
            k += 1;
            prop_assert!(k <= expected);
        }
        prop_assert_eq!(k, expected);
    }
}

#[test]
fn dealing_at_an_epoch_start_starts_each_process_own_deal() {
    let cfg = config(6, 4);
    let saved: Vec<StreamState> = (0..2)
        .map(|rank| StreamState::epoch_start(cfg.clone(), 3, (2, rank)))
        .collect();
    let dealt = deal(&saved, 3).unwrap();
    let starts: BTreeMap<usize, StreamCursor> = dealt
        .iter()
        .enumerate()
        .map(|(r, s)| (r, s.streams[0]))
        .collect();
    for (rank, cursor) in starts {
        assert_eq!(cursor, StreamCursor::start(3, rank));
    }
    let mut other = saved.clone();
    other[1].epoch = 4;
    assert!(deal(&other, 3).is_err());
}
