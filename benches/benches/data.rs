//! How fast the data sources feed a training step, on one thread: batches of 32 windows of
//! 129 bytes (the transformer example's default), item by item as a loader worker reads them
//! and turned into tensors by the example's batcher.
//!
//! ```text
//! cargo bench -p accelerate-benches --bench data
//! ```
//!
//! - `token_windows`: token files (llm.c's format) at random windows, as a shuffled epoch
//!   reads them.
//! - `parquet_windows`: Parquet files (a `text` column, snappy, row groups of 4,096 rows) in
//!   the order a loader reading in pieces visits them (`PieceLayout::epoch_order`, blocks of
//!   8,192 rows), decoding each row group as it comes.
//! - `parquet_stream`: the same Parquet files read as a stream (row groups as shards, a
//!   shuffle buffer of 8,192 rows), as a stream loader's reader thread walks them.
//! - `embedded_text`: the in-memory windows, for reference.
//! - `order/*`: what an epoch order of 1 Mi items costs, whole or a position at a time: the
//!   drawn order (Fisher-Yates, made whole when an epoch starts, 8 bytes per item), the keyed
//!   order (a Feistel bijection computed at each position) and the piece order's cursor
//!   (pieces of 8,192 items, blocks of 65,536), read forward as a loader reads them.
//!
//! The transformer example's step consumes 32 windows in about 0.5 s on this machine kind
//! (6,000-8,000 tokens/s): a source that builds a batch in 25 ms feeds it 20 times over.

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use accelerate_burn::burn::data::dataloader::batcher::Batcher;
use accelerate_burn::burn::data::dataset::Dataset;
use accelerate_burn::burn::tensor::Device;
use accelerate_burn::stream::{DatasetShards, StreamSource};
use accelerate_core::sampler::{KeyedOrder, SplitMix64, epoch_order};
use accelerate_core::{PieceLayout, StreamConfig, StreamCursor, StreamWalk};
use accelerate_examples::text::{
    self, ByteWindows, RowFormat, RowWindows, TextBatch, TextBatcher, TextWindows,
};
use criterion::{Criterion, Throughput, criterion_group, criterion_main};

const BATCH: usize = 32;
const CONTEXT: usize = 128;

fn batches(c: &mut Criterion) {
    let dir = tempfile::tempdir().expect("a temporary folder");
    let tokens = dir.path().join("tokens");
    let parquet = dir.path().join("parquet");
    for folder in [&tokens, &parquet] {
        std::fs::create_dir(folder).expect("a folder");
    }
    text::write_token_files(&tokens, usize::MAX).expect("token files");
    text::write_text_rows(&parquet, RowFormat::Parquet, CONTEXT + 1, (20_000, 4096))
        .expect("Parquet files");
    let device = Device::default();
    let token_windows = ByteWindows::open(&tokens, "train", CONTEXT, None).expect("token files");
    let parquet_windows =
        RowWindows::open(&parquet, "train", RowFormat::Parquet, (CONTEXT, None)).expect("Parquet");
    let (train, _) = text::train_validation_split().expect("the text");
    let embedded = TextWindows::new(train, CONTEXT, None);
    let order = PieceLayout::new(parquet_windows.pieces().unwrap_or_default(), 8192)
        .epoch_order(true, 1, 0);

    let mut group = c.benchmark_group("data");
    group.throughput(Throughput::Elements(BATCH as u64));
    let mut rng = SplitMix64::new(7);
    group.bench_function("token_windows/batch_of_32", |b| {
        b.iter(|| {
            let indices = (0..BATCH).map(|_| rng.below(token_windows.len() as u64) as usize);
            batch_of(&token_windows, indices, &device)
        })
    });
    let mut next = 0usize;
    group.bench_function("parquet_windows/batch_of_32", |b| {
        b.iter(|| {
            let indices = (0..BATCH).map(|_| {
                next = (next + 1) % order.len();
                order[next]
            });
            batch_of(&parquet_windows, indices, &device)
        })
    });
    let pieces = parquet_windows.pieces().unwrap_or_default();
    let shards = DatasetShards::new(parquet_windows.clone(), &pieces).expect("the row groups");
    let config = StreamConfig {
        shards: shards.shards(),
        shuffle: true,
        seed: 1,
        shuffle_buffer: 8192,
        batch_size: BATCH,
        even_batches: true,
        drop_last: false,
    };
    let epoch = || {
        let start = vec![StreamCursor::start(1, 0)];
        StreamWalk::new((config.clone(), 0), start, |shard, skip| {
            shards.read(shard, skip)
        })
    };
    let mut walk = epoch();
    group.bench_function("parquet_stream/batch_of_32", |b| {
        b.iter(|| {
            let mut items = Vec::with_capacity(BATCH);
            while items.len() < BATCH {
                match walk.next() {
                    Some(item) => items.push(item.expect("a row").0),
                    None => walk = epoch(),
                }
            }
            TextBatcher.batch(items, &device)
        })
    });
    group.bench_function("embedded_text/batch_of_32", |b| {
        b.iter(|| {
            let indices = (0..BATCH).map(|_| rng.below(embedded.len() as u64) as usize);
            batch_of(&embedded, indices, &device)
        })
    });
    group.finish();
}

/// The windows at `indices`, read item by item and turned into tensors, as a loader worker
/// builds a batch.
fn batch_of(
    windows: &dyn Dataset<Vec<u8>>,
    indices: impl Iterator<Item = usize>,
    device: &Device,
) -> TextBatch {
    let items = indices
        .map(|i| windows.get(i))
        .collect::<Result<Vec<_>, _>>()
        .expect("a window");
    TextBatcher.batch(items, device)
}

fn orders(c: &mut Criterion) {
    const ITEMS: usize = 1 << 20;
    let mut group = c.benchmark_group("order");
    group.throughput(Throughput::Elements(ITEMS as u64));
    let mut epoch = 0;
    group.bench_function("drawn/whole_epoch_of_1Mi", |b| {
        b.iter(|| {
            epoch += 1;
            epoch_order(ITEMS, true, 1, epoch)
        })
    });
    group.bench_function("keyed/1Mi_positions", |b| {
        b.iter(|| {
            epoch += 1;
            let keyed = KeyedOrder::new(ITEMS, 1, epoch);
            (0..ITEMS).fold(0usize, |sum, p| sum ^ keyed.at(p))
        })
    });
    let layout = PieceLayout::new(vec![8192; ITEMS / 8192], 65_536);
    group.bench_function("pieces/1Mi_positions", |b| {
        b.iter(|| {
            epoch += 1;
            let mut cursor = layout.cursor(true, 1, epoch);
            (0..ITEMS).fold(0usize, |sum, p| sum ^ cursor.at(p))
        })
    });
    group.finish();
}

criterion_group!(benches, batches, orders);
criterion_main!(benches);
