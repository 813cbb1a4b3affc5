//! The checks `accelerate-rs test` runs on every process of a job: collectives against values
//! computed locally, the same data order on every rank, and a few training steps that leave
//! every rank with the same parameters. Each check reports what it found, not just pass/fail.
//! The `accelerate-selftest` binary runs them on each process; [`report`] holds the lines it
//! adds to `accelerate-rs env`.

pub mod report;

use accelerate_core::comm::Reduction;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::nn::{Linear, LinearConfig};
use burn::optim::SgdConfig;
use burn::tensor::{Device, Tensor, TensorData};

use crate::accelerator::Accelerator;
use crate::backend::AcceleratorBackend;
use crate::data::DataLoader;
use crate::error::AccelerateError;

/// The outcome of one check on this process.
#[derive(Debug, Clone, PartialEq)]
pub struct CheckOutcome {
    /// What was checked.
    pub name: &'static str,
    /// `Ok(summary)` or what differed.
    pub result: Result<String, Discrepancy>,
}

/// What a check found different from what it expected, in a sentence with the values.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct Discrepancy(pub String);

/// Runs every check on this process (every process of the job must call it) and returns the
/// outcomes in order. A collective that fails outright ends the run with its error.
pub fn run_checks<B: AcceleratorBackend>(
    acc: &Accelerator<B>,
) -> Result<Vec<CheckOutcome>, AccelerateError> {
    Ok(vec![
        CheckOutcome {
            name: "all-reduce, broadcast and all-gather against local references",
            result: collectives(acc)?,
        },
        CheckOutcome {
            name: "every rank draws the same epoch order and a disjoint share of it",
            result: sampler(acc)?,
        },
        CheckOutcome {
            name: "training steps leave every rank with the same parameters",
            result: training(acc)?,
        },
    ])
}

fn collectives<B: AcceleratorBackend>(
    acc: &Accelerator<B>,
) -> Result<Result<String, Discrepancy>, AccelerateError> {
    let (rank, world) = (acc.process_index(), acc.num_processes());
    // Integers below 2^24 are exact in f32, so the sums must match exactly. The length spans
    // several chunks of every algorithm.
    let len = 1 << 20;
    let mut buf: Vec<f32> = (0..len).map(|i| ((i % 1000) * (rank + 1)) as f32).collect();
    acc.comm().lock().all_reduce(&mut buf, Reduction::Sum)?;
    let factor = world * (world + 1) / 2;
    if let Some(i) = (0..len).find(|&i| buf[i] != ((i % 1000) * factor) as f32) {
        return Ok(Err(Discrepancy(format!(
            "all-reduce sum of {len} floats: element {i} is {}, expected {}",
            buf[i],
            (i % 1000) * factor
        ))));
    }
    let mut root = vec![rank as f32; 1000];
    acc.comm().lock().broadcast(&mut root, world - 1)?;
    if root.iter().any(|&v| v != (world - 1) as f32) {
        return Ok(Err(Discrepancy(format!(
            "broadcast from rank {}: got {:?}",
            world - 1,
            &root[..4]
        ))));
    }
    let gathered = acc.gather(Tensor::<1>::from_floats([rank as f32, 10.0], &acc.device()))?;
    let gathered: Vec<f32> = gathered.into_data().iter::<f32>().collect();
    let expected: Vec<f32> = (0..world).flat_map(|r| [r as f32, 10.0]).collect();
    if gathered != expected {
        return Ok(Err(Discrepancy(format!(
            "gather: got {gathered:?}, expected {expected:?}"
        ))));
    }
    let max = acc.reduce(
        Tensor::<1>::from_floats([rank as f32], &acc.device()),
        Reduction::Max,
    )?;
    let max: f32 = max.into_scalar();
    if max != (world - 1) as f32 {
        return Ok(Err(Discrepancy(format!(
            "reduce max: got {max}, expected {}",
            world - 1
        ))));
    }
    Ok(Ok(format!(
        "{len} floats summed exactly over {world} processes ({} transport)",
        acc.comm().lock().transport()
    )))
}

/// Hands a batch's data-set items (their own indices) back as they are.
#[derive(Clone)]
struct Indices;

impl Batcher<usize, Vec<usize>> for Indices {
    fn batch(&self, items: Vec<usize>, _device: &Device) -> Vec<usize> {
        items
    }
}

/// What the prepared loaders really hand out: each rank iterates epoch 3 of a shuffled loader
/// over 1,000 items that are their own indices, the ranks' batches are gathered, and round by
/// round (rank 0's batch, rank 1's, ...) they must visit every item exactly once, then only
/// repeat items (the padding that evens out the last round).
fn sampler<B: AcceleratorBackend>(
    acc: &Accelerator<B>,
) -> Result<Result<String, Discrepancy>, AccelerateError> {
    const LEN: usize = 1000;
    let loader = DataLoader::builder(Indices)
        .batch_size(7)
        .shuffle(42)
        .build(InMemDataset::new((0..LEN).collect::<Vec<usize>>()));
    let prepared = acc.prepare_eval_data_loader(loader)?;
    prepared.set_epoch(3);
    let mine: Vec<Vec<usize>> = prepared.iter().collect::<Result<_, _>>()?;
    let all: Vec<Vec<Vec<usize>>> = acc.comm().lock().all_gather_object(&mine)?;
    if let Some(r) = all.iter().position(|batches| batches.len() != mine.len()) {
        return Ok(Err(Discrepancy(format!(
            "rank {r} got {} batches, this rank {}",
            all[r].len(),
            mine.len()
        ))));
    }
    let visited: Vec<usize> = (0..mine.len())
        .flat_map(|round| {
            all.iter()
                .flat_map(move |batches| batches[round].iter().copied())
        })
        .collect();
    let mut seen = vec![false; LEN];
    for (position, &item) in visited.iter().enumerate() {
        match seen.get(item) {
            None => {
                return Ok(Err(Discrepancy(format!(
                    "item {item} is not in the data set"
                ))));
            }
            Some(true) if position < LEN => {
                return Ok(Err(Discrepancy(format!(
                    "item {item} comes twice among the epoch's first {LEN} samples: the ranks \
                     disagree on the epoch order or their shares overlap"
                ))));
            }
            Some(false) if position >= LEN => {
                return Ok(Err(Discrepancy(format!(
                    "item {item} first comes in the padding of the last round"
                ))));
            }
            _ => seen[item] = true,
        }
    }
    if visited.len() < LEN {
        return Ok(Err(Discrepancy(format!(
            "the ranks' batches hold {} samples, not all {LEN}",
            visited.len()
        ))));
    }
    let fingerprint = visited
        .iter()
        .fold(0u64, |h, &i| h.wrapping_mul(31).wrapping_add(i as u64));
    Ok(Ok(format!(
        "{} samples in {} batches on this rank; the {} ranks' batches visit all {LEN} once \
         (order {fingerprint:016x}), then {} of padding",
        mine.iter().map(Vec::len).sum::<usize>(),
        mine.len(),
        all.len(),
        visited.len() - LEN
    )))
}

/// Pairs (x, 2x + 1) as a batch.
#[derive(Clone)]
struct Line;

impl Batcher<f32, (Tensor<2>, Tensor<2>)> for Line {
    fn batch(&self, items: Vec<f32>, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let n = items.len();
        let y: Vec<f32> = items.iter().map(|x| 2.0 * x + 1.0).collect();
        (
            Tensor::from_data(TensorData::new(items, [n, 1]), device),
            Tensor::from_data(TensorData::new(y, [n, 1]), device),
        )
    }
}

fn training<B: AcceleratorBackend>(
    acc: &Accelerator<B>,
) -> Result<Result<String, Discrepancy>, AccelerateError> {
    let model: Linear = LinearConfig::new(1, 1).init(&acc.device());
    let data: Vec<f32> = (0..64).map(|i| i as f32 / 64.0).collect();
    let loader = DataLoader::builder(Line)
        .batch_size(4)
        .shuffle(5)
        .build(InMemDataset::new(data));
    let (mut model, mut optim, train) = acc.prepare((model, SgdConfig::new().init(), loader))?;
    let mut losses = Vec::new();
    for batch in train.iter().take(5) {
        let (x, y) = batch?;
        let loss = (model.forward(x) - y).square().mean();
        losses.push(
            acc.reduce(loss.clone().detach(), Reduction::Mean)?
                .into_scalar::<f32>(),
        );
        let grads = acc.backward(loss, &model)?;
        model = optim.step(0.1, model, grads)?;
    }
    let mine: Vec<u32> = crate::params::values(&model)
        .into_iter()
        .flat_map(crate::params::to_host_f32)
        .map(f32::to_bits)
        .collect();
    let all: Vec<Vec<u32>> = acc.comm().lock().all_gather_object(&mine)?;
    if let Some(r) = all.iter().position(|p| p != &all[0]) {
        return Ok(Err(Discrepancy(format!(
            "after {} steps rank {r} holds other parameters than rank 0",
            losses.len()
        ))));
    }
    if losses.len() < 2 || losses.last() >= losses.first() {
        return Ok(Err(Discrepancy(format!(
            "the mean loss did not fall: {losses:?}"
        ))));
    }
    Ok(Ok(format!(
        "{} steps, mean loss {:.4} -> {:.4}, parameters identical bit for bit",
        losses.len(),
        losses[0],
        losses[losses.len() - 1]
    )))
}
