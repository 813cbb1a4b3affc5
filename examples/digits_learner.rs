//! Trains an MLP on the UCI handwritten digits with burn-train's Learner, in the shape of
//! Burn's guide (a model with `TrainStep` / `InferenceStep`, a batcher, `SupervisedTraining`),
//! plus the lines that put it on the accelerator: the two loaders and the training strategy.
//!
//! ```text
//! cargo run --example digits_learner                      # one process
//! accelerate-rs launch -n 2 --example digits_learner      # two processes, same result
//! ```
//!
//! Arguments: `--epochs N` (default 10), `--dir DIR` (where the Learner writes its metrics and
//! checkpoints; default a temporary directory), `--resume` (continue from the last complete
//! checkpoint in DIR), `--accumulation K`, `--clip NORM`, `--batch-size N` (per process; default 32),
//! `--width N` (of the hidden layer; default 128), `--early-stop N` (when the validation loss has
//! not improved for N epochs).

use std::path::PathBuf;
use std::sync::Arc;

use accelerate_burn::burn;
use accelerate_burn::learner::{
    AcceleratorStrategy, durable_checkpointers, latest_learner_checkpoint,
};
use accelerate_burn::{Accelerator, DataLoader, DefaultBackend};
use accelerate_examples::digits::{self, DigitBatch, DigitBatcher};
use anyhow::Context;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor};
use burn::train::metric::store::{Aggregate, Direction, Split};
use burn::train::metric::{AccuracyMetric, LossMetric};
use burn::train::{
    ClassificationOutput, InferenceStep, Learner, LearningResult, MetricEarlyStoppingStrategy,
    StoppingCondition, SupervisedTraining, TrainOutput, TrainStep,
};

/// The model, as Burn's guide writes one.
#[derive(Module, Debug)]
pub struct Model {
    hidden: Linear,
    activation: Relu,
    output: Linear,
}

impl Model {
    /// A 64-`width`-10 perceptron on `device`.
    pub fn new(device: &Device, width: usize) -> Self {
        Self {
            hidden: LinearConfig::new(digits::PIXELS, width).init(device),
            activation: Relu::new(),
            output: LinearConfig::new(width, digits::CLASSES).init(device),
        }
    }

    /// Class scores and the batch's mean cross-entropy.
    pub fn forward_classification(
        &self,
        images: Tensor<2>,
        targets: Tensor<1, Int>,
    ) -> ClassificationOutput {
        let output = self
            .output
            .forward(self.activation.forward(self.hidden.forward(images)));
        let loss = CrossEntropyLossConfig::new()
            .init(&output.device())
            .forward(output.clone(), targets.clone());
        ClassificationOutput::new(loss, output, targets)
    }
}

impl TrainStep for Model {
    type Input = DigitBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: DigitBatch) -> TrainOutput<ClassificationOutput> {
        let item = self.forward_classification(batch.images, batch.targets);
        TrainOutput::new(self, item.loss.backward(), item)
    }
}

impl InferenceStep for Model {
    type Input = DigitBatch;
    type Output = ClassificationOutput;

    fn step(&self, batch: DigitBatch) -> ClassificationOutput {
        self.forward_classification(batch.images, batch.targets)
    }
}

/// How to train.
#[derive(Clone)]
pub struct Settings {
    /// Epochs in all (a resumed run continues to this one).
    pub epochs: usize,
    /// Where the Learner writes metrics and checkpoints.
    pub dir: PathBuf,
    /// Continue from the last complete checkpoint in `dir`, if there is one.
    pub resume: bool,
    /// Batches per optimizer step.
    pub accumulation: Option<usize>,
    /// Global gradient clipping.
    pub clip: Option<f32>,
    /// Items per batch and process.
    pub batch_size: usize,
    /// Width of the hidden layer.
    pub width: usize,
    /// Stop when the validation loss has not improved (in this direction) for this many
    /// epochs.
    pub early_stop: Option<(Direction, usize)>,
    /// Validation items per batch and process.
    pub valid_batch_size: usize,
    /// Training images used (from the start of the training split; all when `None`).
    pub train_items: Option<usize>,
}

/// Trains with `settings` and returns the Learner's result and the accelerator.
pub fn train(
    settings: &Settings,
) -> anyhow::Result<(LearningResult<Model>, Arc<Accelerator<DefaultBackend>>)> {
    let (mut train_set, test_set) = digits::train_test_split()?;
    if let Some(n) = settings.train_items {
        train_set.truncate(n);
    }
    // accelerate: the accelerator, and the loaders that give each process its share (the
    // training batches in bf16 under `mixed_precision: bf16`).
    let acc = Arc::new(Accelerator::<DefaultBackend>::builder().seed(42).build()?);
    let train = acc.learner_loader_autocast(
        DataLoader::builder(DigitBatcher)
            .batch_size(settings.batch_size)
            .shuffle(42)
            .build(InMemDataset::new(train_set)),
    )?;
    let valid = acc.learner_eval_loader(
        DataLoader::builder(DigitBatcher)
            .batch_size(settings.valid_batch_size)
            .build(InMemDataset::new(test_set)),
    )?;

    acc.set_seed(7);
    let model = Model::new(&acc.device(), settings.width);
    let mut strategy = AcceleratorStrategy::new(Arc::clone(&acc));
    if let Some(max_norm) = settings.clip {
        strategy = strategy.clip_grad_norm(max_norm);
    }
    let resume_from = settings
        .resume
        .then(|| latest_learner_checkpoint(&settings.dir))
        .flatten();
    let (model_checkpoints, optim_checkpoints, scheduler_checkpoints) =
        durable_checkpointers(&settings.dir);
    let mut training = SupervisedTraining::new(&settings.dir, train, valid)
        .metrics((AccuracyMetric::new(), LossMetric::new()))
        // accelerate: checkpoints that a kill never leaves half-written.
        .with_custom_checkpointers(model_checkpoints, optim_checkpoints, scheduler_checkpoints)
        .num_epochs(settings.epochs)
        .summary();
    // accelerate: progress drawn by the main process only, and the strategy.
    let renderer = strategy.renderer(training.interrupter(), resume_from);
    training = training
        .renderer(renderer)
        .with_training_strategy(strategy.into());
    if let Some((direction, n_epochs)) = settings.early_stop {
        training = training.early_stopping(MetricEarlyStoppingStrategy::new(
            &LossMetric::new(),
            Aggregate::Mean,
            direction,
            Split::Valid,
            StoppingCondition::NoImprovementSince { n_epochs },
        ));
    }
    if let Some(accumulation) = settings.accumulation {
        training = training.grads_accumulation(accumulation);
    }
    if let Some(epoch) = resume_from {
        acc.print(format!("resuming after epoch {epoch}"));
        training = training.checkpoint(epoch);
    }
    let result = training.launch(Learner::new(model, AdamWConfig::new().init(), 3e-3));
    if let Some(error) = &result.error {
        anyhow::bail!("training failed: {error}");
    }
    Ok((result, acc))
}

fn main() -> anyhow::Result<()> {
    let arg = |name: &str| std::env::args().skip_while(|a| a != name).nth(1);
    let number = |name: &str| -> anyhow::Result<Option<usize>> {
        arg(name)
            .map(|v| {
                v.parse()
                    .with_context(|| format!("{name} expects a number"))
            })
            .transpose()
    };
    // A directory of our own only when none is given.
    let dir = match arg("--dir") {
        Some(dir) => PathBuf::from(dir),
        None => tempfile_dir()?,
    };
    let settings = Settings {
        epochs: number("--epochs")?.unwrap_or(10),
        dir,
        resume: std::env::args().any(|a| a == "--resume"),
        accumulation: number("--accumulation")?,
        clip: arg("--clip")
            .map(|v| v.parse().context("--clip expects a number"))
            .transpose()?,
        batch_size: number("--batch-size")?.unwrap_or(32),
        valid_batch_size: 60,
        width: number("--width")?.unwrap_or(128),
        early_stop: number("--early-stop")?.map(|epochs| (Direction::Lowest, epochs)),
        train_items: None,
    };
    let (_result, acc) = train(&settings)?;
    acc.print(format!(
        "trained {} epochs on {} process(es); metrics and checkpoints in {}",
        settings.epochs,
        acc.num_processes(),
        settings.dir.display()
    ));
    Ok(())
}

/// A directory for the Learner's files when none is given: under the system's temporary
/// directory, one per job (every process of a job writes to the main process's).
fn tempfile_dir() -> anyhow::Result<PathBuf> {
    let job = std::env::var("ACCELERATE_JOB_TOKEN")
        .or_else(|_| std::env::var("MASTER_PORT"))
        .unwrap_or_else(|_| std::process::id().to_string());
    let dir = std::env::temp_dir().join(format!("digits-learner-{job}"));
    std::fs::create_dir_all(&dir).with_context(|| format!("creating {}", dir.display()))?;
    Ok(dir)
}
