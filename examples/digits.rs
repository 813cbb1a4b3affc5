//! Trains an MLP on the UCI handwritten digits: a plain Burn loop plus the Accelerator lines.
//!
//! ```text
//! cargo run --example digits
//! ```
//!
//! Arguments: `--epochs N` (default 30); `--project-dir DIR` to log the loss to
//! `DIR/logs` (CSV and TensorBoard), save a checkpoint after every epoch (the last 2 kept) and,
//! when started again, resume from the latest one.

use std::path::PathBuf;

use accelerate_burn::burn;
use accelerate_burn::metrics::Accuracy;
use accelerate_burn::{
    Accelerator, Checkpoint, DataLoader, DefaultBackend, MixedPrecision, Tracker,
};
use accelerate_examples::MlpConfig;
use accelerate_examples::digits::{self, DigitBatcher};
use anyhow::Context;
use burn::data::dataset::InMemDataset;
use burn::optim::AdamWConfig;
use indicatif::{ProgressBar, ProgressStyle};

/// What a training run achieved.
pub struct Report {
    /// Fraction of the 360 test images classified correctly.
    pub accuracy: f64,
    /// Optimizer updates applied.
    pub updates: u64,
    /// Mean training loss of the last epoch.
    pub final_loss: f32,
}

fn main() -> anyhow::Result<()> {
    let epochs: u64 = match std::env::args().skip_while(|a| a != "--epochs").nth(1) {
        Some(n) => n.parse().context("--epochs expects a number")?,
        None => 30,
    };
    let project = std::env::args()
        .skip_while(|a| a != "--project-dir")
        .nth(1)
        .map(PathBuf::from);
    train(epochs, None, project)?;
    Ok(())
}

/// Trains for `epochs` epochs in `precision` (else ACCELERATE_MIXED_PRECISION), prints and
/// returns the test accuracy. With `project`, logs, checkpoints and resumes there.
pub fn train(
    epochs: u64,
    precision: Option<MixedPrecision>,
    project: Option<PathBuf>,
) -> anyhow::Result<Report> {
    let (train_set, test_set) = digits::train_test_split()?;

    let mut builder = Accelerator::<DefaultBackend>::builder().seed(42);
    if let Some(precision) = precision {
        builder = builder.mixed_precision(precision);
    }
    let mut trackers = Vec::new();
    if let Some(dir) = &project {
        builder = builder.project_dir(dir).checkpoint_total_limit(2);
        trackers.extend([Tracker::Csv, Tracker::TensorBoard]);
    }
    if Tracker::MLflow.is_configured() {
        trackers.push(Tracker::MLflow);
    }
    let acc = builder.log_with(&trackers).build()?;
    acc.init_trackers(
        "digits",
        &serde_json::json!({ "epochs": epochs, "hidden": 128 }),
    )?;
    // The loss is logged once per epoch: the launcher's progress line counts epochs.
    acc.set_total_steps(epochs);
    let device = acc.device();
    let model = MlpConfig::new(digits::PIXELS, vec![128], digits::CLASSES).init(&device);
    let optim = AdamWConfig::new();
    let train = DataLoader::builder(DigitBatcher)
        .batch_size(32)
        .shuffle(42)
        .build(InMemDataset::new(train_set));
    let test = DataLoader::builder(DigitBatcher)
        .batch_size(256)
        .build(InMemDataset::new(test_set));
    let (mut model, mut optim, train, test) = acc.prepare((model, optim, train, test))?;
    if project.is_some() {
        let restored = acc.load_latest_checkpoint(model, &mut optim, None)?;
        model = restored.model;
        if let Some(path) = restored.info.path {
            acc.print(format!("resumed from {}", path.display()));
        }
    }

    let started = std::time::Instant::now();
    let bar = if acc.is_main_process() {
        ProgressBar::new(epochs * train.len() as u64)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} steps, epoch {msg}",
    )?);
    let mut final_loss = 0.0;
    bar.set_position(train.epoch() * train.len() as u64);
    for epoch in train.epoch()..epochs {
        train.set_epoch(epoch);
        bar.set_message(format!("{}/{epochs}", epoch + 1));
        let mut epoch_loss = 0.0;
        for batch in train.iter() {
            let batch = batch?;
            let loss = acc
                .autocast(&model, |m, c| {
                    m.forward_loss(c.input(batch.images), batch.targets)
                })
                .loss;
            epoch_loss += loss.clone().into_scalar::<f32>();
            let grads = acc.backward(loss, &model)?;
            model = optim.step(3e-3, model, grads)?;
            bar.inc(1);
        }
        final_loss = epoch_loss / train.len() as f32;
        // To the trackers chosen above (none without a project directory or an MLflow server).
        acc.log(&[("train/loss", f64::from(final_loss))], epoch + 1)?;
        if project.is_some() {
            acc.save_checkpoint(&Checkpoint::new(&model, &optim))?;
        }
    }
    // With ACCELERATE_ASYNC_CHECKPOINTS the last checkpoint is committed (or fails) here.
    acc.wait_for_checkpoint()?;
    bar.finish_and_clear();
    let elapsed = started.elapsed();

    let model = acc.unwrap_model(model);
    let mut accuracy = Accuracy::new();
    for batch in test.iter() {
        let batch = batch?;
        accuracy.update(&acc, model.forward(batch.images), batch.targets)?;
    }
    let accuracy = accuracy.compute(&acc)?;
    let (right, total) = (
        (accuracy.value * accuracy.weight).round() as u64,
        accuracy.weight as u64,
    );
    acc.print(format!(
        "test accuracy: {:.2} % ({right}/{total}) after {epochs} epochs, {} updates, final loss \
         {final_loss:.4}, {:.1} s on {} in {:?}",
        100.0 * accuracy.value,
        optim.updates(),
        elapsed.as_secs_f64(),
        acc.backend_name(),
        acc.compute_dtype(),
    ));
    Ok(Report {
        accuracy: accuracy.value,
        updates: optim.updates(),
        final_loss,
    })
}
