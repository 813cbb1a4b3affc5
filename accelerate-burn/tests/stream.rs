//! Stream loaders in one process: every item once per epoch in a shuffle that follows the
//! seed, accumulation windows that end with the stream (whose length is never known ahead),
//! exact resume from a checkpoint, drop_last, and a failing shard named in the error.
//! (Several processes: examples/tests/parquet_loader.rs.)

use accelerate_burn::stream::{IterShards, StreamLoader};
use accelerate_burn::{Accelerator, Checkpoint, DefaultBackend, ProcessState};
use burn::data::dataloader::batcher::Batcher;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::{Device, Tensor, TensorData};

/// Shard lengths: 45 items, some shards empty.
const LENS: [usize; 6] = [7, 0, 13, 5, 9, 11];

/// Item `shard * 100 + i`, as a value.
fn source() -> IterShards<impl Fn(usize) -> Result<std::ops::Range<usize>, std::io::Error>> {
    IterShards::new(LENS.len(), |shard| {
        Ok(shard * 100..shard * 100 + LENS[shard])
    })
}

fn all_items() -> Vec<usize> {
    let mut all: Vec<usize> = (0..LENS.len())
        .flat_map(|s| s * 100..s * 100 + LENS[s])
        .collect();
    all.sort_unstable();
    all
}

/// A batch: the items, and a `[n, 1]` input made of them.
#[derive(Clone)]
struct Items;

impl Batcher<usize, (Vec<usize>, Tensor<2>)> for Items {
    fn batch(&self, items: Vec<usize>, device: &Device) -> (Vec<usize>, Tensor<2>) {
        let values: Vec<f32> = items.iter().map(|&i| i as f32 / 500.0).collect();
        let n = values.len();
        (
            items,
            Tensor::from_data(TensorData::new(values, [n, 1]), device),
        )
    }
}

fn loader(batch: usize) -> StreamLoader<usize, (Vec<usize>, Tensor<2>)> {
    StreamLoader::builder(Items)
        .batch_size(batch)
        .shuffle(3)
        .shuffle_buffer(6)
        .build(source())
}

fn accelerator(accumulation: usize, dir: &std::path::Path) -> Accelerator<DefaultBackend> {
    Accelerator::builder()
        .process_state(ProcessState::single())
        .gradient_accumulation_steps(accumulation)
        .project_dir(dir)
        .seed(1)
        .build()
        .unwrap()
}

fn sorted(mut v: Vec<usize>) -> Vec<usize> {
    v.sort_unstable();
    v
}

#[test]
fn each_epoch_reads_every_item_once_in_a_shuffle_of_the_seed_and_epoch() {
    let tmp = tempfile::tempdir().unwrap();
    let acc = accelerator(1, tmp.path());
    let train = acc.prepare(loader(4)).unwrap();
    let mut epochs = Vec::new();
    for epoch in 0..2 {
        train.set_epoch(epoch);
        let batches: Vec<Vec<usize>> = train.iter().map(|b| b.unwrap().0).collect();
        // 45 items in batches of 4: 11 full and one of 1 (one process: nothing to pad).
        assert_eq!(batches.len(), 12);
        assert_eq!(batches[11].len(), 1);
        let items = batches.concat();
        assert_eq!(sorted(items.clone()), all_items());
        epochs.push(items);
    }
    assert_ne!(epochs[0], epochs[1], "epochs are shuffled differently");
    // The same seed and epoch, the same order.
    let again = acc.prepare(loader(4)).unwrap();
    let items: Vec<usize> = again.iter().flat_map(|b| b.unwrap().0).collect();
    assert_eq!(items, epochs[0]);
    // drop_last leaves out the short batch.
    let dropping = acc
        .prepare(
            StreamLoader::builder(Items)
                .batch_size(4)
                .drop_last(true)
                .build(source()),
        )
        .unwrap();
    assert_eq!(dropping.iter().count(), 11);
}

/// 45 items in batches of 4 make 12 batches: with accumulation 5 the windows are 5, 5 and 2,
/// and the last window syncs at the stream's end though no length was known ahead.
#[test]
fn accumulation_windows_end_with_the_stream() {
    let tmp = tempfile::tempdir().unwrap();
    let acc = accelerator(5, tmp.path());
    let model: Linear = LinearConfig::new(1, 1).init(&acc.device());
    let (mut model, mut optim) = acc.prepare((model, SgdConfig::new().init())).unwrap();
    let train = acc.prepare(loader(4)).unwrap();
    let mut syncs = Vec::new();
    for batch in train.iter() {
        let loss = model.forward(batch.unwrap().1).mean();
        let grads = acc.backward(loss, &model).unwrap();
        syncs.push(acc.sync_gradients());
        model = optim.step(0.1, model, grads).unwrap();
    }
    let expected: Vec<bool> = (0..12).map(|i| i == 4 || i == 9 || i == 11).collect();
    assert_eq!(syncs, expected);
    assert_eq!(optim.updates(), 3);
}

/// Stopped after 5 batches and resumed from its checkpoint, the run reads exactly the rest
/// of the epoch, then the next epoch as the uninterrupted run does.
#[test]
fn a_resumed_stream_continues_exactly_where_it_stood() {
    let tmp = tempfile::tempdir().unwrap();
    let run = |stop: Option<usize>, resume: bool| -> Vec<Vec<usize>> {
        let acc = accelerator(1, tmp.path());
        let model: Linear = LinearConfig::new(1, 1).init(&acc.device());
        let (mut model, mut optim) = acc.prepare((model, SgdConfig::new().init())).unwrap();
        let train = acc.prepare(loader(4)).unwrap();
        if resume {
            model = acc
                .load_latest_checkpoint(model, &mut optim, None)
                .unwrap()
                .model;
        }
        let mut read = Vec::new();
        for epoch in train.epoch()..2 {
            train.set_epoch(epoch);
            for batch in train.iter() {
                let (items, input) = batch.unwrap();
                read.push(items);
                let grads = acc.backward(model.forward(input).mean(), &model).unwrap();
                model = optim.step(0.1, model, grads).unwrap();
                acc.save_checkpoint(&Checkpoint::new(&model, &optim))
                    .unwrap();
                if Some(read.len()) == stop {
                    return read;
                }
            }
        }
        read
    };
    let whole = run(None, false);
    assert_eq!(whole.len(), 24);
    std::fs::remove_dir_all(tmp.path().join("checkpoints")).unwrap();
    let head = run(Some(5), false);
    let tail = run(None, true);
    assert_eq!([head, tail].concat(), whole);

    // A loader that cuts the stream otherwise cannot continue it.
    let acc = accelerator(1, tmp.path());
    let model: Linear = LinearConfig::new(1, 1).init(&acc.device());
    let (model, mut optim) = acc.prepare((model, SgdConfig::new().init())).unwrap();
    let _train = acc.prepare(loader(5)).unwrap();
    let Err(err) = acc.load_latest_checkpoint(model, &mut optim, None) else {
        panic!("a loader with another batch size resumed the stream");
    };
    assert!(
        err.to_string().contains("differs from the saved one"),
        "{err}"
    );
}

#[test]
fn a_shard_that_cannot_be_read_is_an_error_naming_it() {
    let tmp = tempfile::tempdir().unwrap();
    let acc = accelerator(1, tmp.path());
    let broken = IterShards::new(4, |shard| match shard {
        2 => Err(std::io::Error::other("disk on fire")),
        _ => Ok(0..5usize),
    });
    let train = acc
        .prepare(StreamLoader::builder(Items).batch_size(2).build(broken))
        .unwrap();
    let err = train.iter().find_map(Result::err).expect("an error");
    let text = err.to_string();
    assert!(
        text.contains("shard 2") && text.contains("disk on fire"),
        "{text}"
    );
}
