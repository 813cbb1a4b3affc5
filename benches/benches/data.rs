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
//! - `embedded_text`: the in-memory windows, for reference.
//!
//! The transformer example's step consumes 32 windows in about 0.5 s on this machine kind
//! (6,000-8,000 tokens/s): a source that builds a batch in 25 ms feeds it 20 times over.

// criterion_group! generates an undocumented function.
#![allow(missing_docs)]

use accelerate_burn::burn::data::dataloader::batcher::Batcher;
use accelerate_burn::burn::data::dataset::Dataset;
use accelerate_burn::burn::tensor::Device;
use accelerate_core::PieceLayout;
use accelerate_core::sampler::SplitMix64;
use accelerate_examples::text::{self, ByteWindows, ParquetWindows, TextBatcher, TextWindows};
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
    text::write_parquet_files(&parquet, CONTEXT + 1, 20_000, 4096).expect("Parquet files");
    let device = Device::default();
    let token_windows = ByteWindows::open(&tokens, "train", CONTEXT, None).expect("token files");
    let parquet_windows = ParquetWindows::open(&parquet, "train", CONTEXT, None).expect("Parquet");
    let (train, _) = text::train_validation_split().expect("the text");
    let embedded = TextWindows::new(train, CONTEXT, None);
    let order = PieceLayout::new(parquet_windows.pieces(), 8192).epoch_order(true, 1, 0);

    let mut group = c.benchmark_group("data");
    group.throughput(Throughput::Elements(BATCH as u64));
    let mut rng = SplitMix64::new(7);
    group.bench_function("token_windows/batch_of_32", |b| {
        b.iter(|| {
            let items = (0..BATCH)
                .map(|_| token_windows.get(rng.below(token_windows.len() as u64) as usize))
                .collect::<Result<Vec<_>, _>>()
                .expect("a window");
            TextBatcher.batch(items, &device)
        })
    });
    let mut next = 0usize;
    group.bench_function("parquet_windows/batch_of_32", |b| {
        b.iter(|| {
            let items = (0..BATCH)
                .map(|_| {
                    next = (next + 1) % order.len();
                    parquet_windows.get(order[next])
                })
                .collect::<Result<Vec<_>, _>>()
                .expect("a row");
            TextBatcher.batch(items, &device)
        })
    });
    group.bench_function("embedded_text/batch_of_32", |b| {
        b.iter(|| {
            let items = (0..BATCH)
                .map(|_| embedded.get(rng.below(embedded.len() as u64) as usize))
                .collect::<Result<Vec<_>, _>>()
                .expect("a window");
            TextBatcher.batch(items, &device)
        })
    });
    group.finish();
}

criterion_group!(benches, batches);
criterion_main!(benches);
