//! burn-train's Learner with and without the accelerator, one process, interleaved: the same
//! model, data, metrics and optimizer, trained by burn-train's own single-device strategy
//! (Burn's data loader) and by `AcceleratorStrategy` (our loaders), in alternating rounds of
//! whole `SupervisedTraining::launch` calls, so both see the same machine state.
//!
//! ```text
//! cargo bench -p accelerate-benches --bench learner [-- ROUNDS] [only-plain|only-accelerated]
//! ```

#[allow(dead_code)]
#[path = "../../examples/digits_learner.rs"]
mod digits_learner;

use std::sync::Arc;
use std::time::Instant;

use accelerate_burn::burn;
use accelerate_burn::learner::{AcceleratorStrategy, SilentRenderer};
use accelerate_burn::{Accelerator, AcceleratorBackend, DataLoader, DefaultBackend};
use accelerate_examples::digits::{self, DigitBatcher};
use burn::data::dataloader::DataLoaderBuilder;
use burn::data::dataset::InMemDataset;
use burn::optim::AdamWConfig;
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{Learner, SupervisedTraining};
use digits_learner::Model;

/// Epochs per launch: 45 training and 6 validation batches each.
const EPOCHS: usize = 5;

fn main() -> anyhow::Result<()> {
    let rounds: usize = std::env::args()
        .skip(1)
        .find_map(|a| a.parse().ok())
        .unwrap_or(20);
    // `only-plain` / `only-accelerated`: that one alone, for a profiler.
    let only = std::env::args().find_map(|a| match a.as_str() {
        "only-plain" => Some(true),
        "only-accelerated" => Some(false),
        _ => None,
    });
    // PREFETCH=N: our loaders build N batches ahead on a thread (default: on the training
    // thread, as Burn's loader does).
    let prefetch: Option<usize> = std::env::var("PREFETCH").ok().and_then(|v| v.parse().ok());
    let ahead = |loader: accelerate_burn::DataLoaderBuilder<_, _>| match prefetch {
        Some(n) => loader.prefetch(n),
        None => loader,
    };
    let (train_set, test_set) = digits::train_test_split()?;
    let device = DefaultBackend::device(0)?;
    let acc = Arc::new(Accelerator::<DefaultBackend>::builder().seed(42).build()?);

    let plain = |dir: &std::path::Path| {
        let train = DataLoaderBuilder::new(DigitBatcher)
            .batch_size(32)
            .shuffle(42)
            .set_device(device.clone())
            .build(InMemDataset::new(train_set.clone()));
        let valid = DataLoaderBuilder::new(DigitBatcher)
            .batch_size(60)
            .set_device(device.clone())
            .build(InMemDataset::new(test_set.clone()));
        let result = SupervisedTraining::new(dir, train, valid)
            .metrics((AccuracyMetric::new(), LossMetric::new()))
            .num_epochs(EPOCHS)
            .renderer(Box::new(SilentRenderer))
            .with_application_logger(None)
            .launch(Learner::new(
                Model::new(&device.clone().autodiff(), 128),
                AdamWConfig::new().init(),
                3e-3,
            ));
        assert!(result.error.is_none(), "{:?}", result.error);
    };
    let accelerated = |dir: &std::path::Path| -> anyhow::Result<()> {
        let train = acc.learner_loader(
            ahead(DataLoader::builder(DigitBatcher).batch_size(32).shuffle(42))
                .build(InMemDataset::new(train_set.clone())),
        )?;
        let valid = acc.learner_eval_loader(
            ahead(DataLoader::builder(DigitBatcher).batch_size(60))
                .build(InMemDataset::new(test_set.clone())),
        )?;
        let result = SupervisedTraining::new(dir, train, valid)
            .metrics((AccuracyMetric::new(), LossMetric::new()))
            .num_epochs(EPOCHS)
            .renderer(Box::new(SilentRenderer))
            .with_application_logger(None)
            .with_training_strategy(AcceleratorStrategy::new(Arc::clone(&acc)).into())
            .launch(Learner::new(
                Model::new(&acc.device(), 128),
                AdamWConfig::new().init(),
                3e-3,
            ));
        assert!(result.error.is_none(), "{:?}", result.error);
        Ok(())
    };

    let tmp = tempfile::tempdir()?;
    let (mut plain_ms, mut accelerated_ms) = (Vec::new(), Vec::new());
    for round in 0..rounds + 2 {
        // Alternate which goes first; the first two rounds warm up.
        for is_plain in [round % 2 == 0, round % 2 == 1] {
            if only.is_some_and(|only_plain| only_plain != is_plain) {
                continue;
            }
            let dir = tmp.path().join(format!("{round}-{is_plain}"));
            let started = Instant::now();
            if is_plain {
                plain(&dir);
            } else {
                accelerated(&dir)?;
            }
            let ms = started.elapsed().as_secs_f64() * 1e3;
            if round >= 2 {
                if is_plain {
                    &mut plain_ms
                } else {
                    &mut accelerated_ms
                }
                .push(ms);
            }
        }
    }
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    if only.is_some() {
        println!("alone: {:.1} ms", mean(&plain_ms) + mean(&accelerated_ms));
        return Ok(());
    }
    let diffs: Vec<f64> = accelerated_ms
        .iter()
        .zip(&plain_ms)
        .map(|(a, p)| a - p)
        .collect();
    let d = mean(&diffs);
    let sd = (diffs.iter().map(|x| (x - d).powi(2)).sum::<f64>() / (diffs.len() - 1).max(1) as f64)
        .sqrt();
    let se = sd / (diffs.len() as f64).sqrt();
    let (p, a) = (mean(&plain_ms), mean(&accelerated_ms));
    let median = |v: &[f64]| {
        let mut v = v.to_vec();
        v.sort_by(f64::total_cmp);
        v[v.len() / 2]
    };
    println!(
        "rounds: {rounds} (digits MLP 64-128-10, {EPOCHS} epochs of 45 batches of 32 per launch)"
    );
    println!(
        "burn-train's strategy: {p:.1} ms (median {:.1})",
        median(&plain_ms)
    );
    println!(
        "AcceleratorStrategy:   {a:.1} ms (median {:.1})",
        median(&accelerated_ms)
    );
    println!(
        "overhead: {:+.2} % (paired difference {d:+.2} ms, 95 % interval +/- {:.2} ms)",
        100.0 * (a - p) / p,
        1.96 * se
    );
    Ok(())
}
