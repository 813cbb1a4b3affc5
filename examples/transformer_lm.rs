//! Trains a byte-level transformer language model on Shakespeare's plays: a plain Burn loop
//! plus the Accelerator lines.
//!
//! ```text
//! cargo run --example transformer_lm -- --steps 300
//! accelerate-rs launch -n 2 --example transformer_lm -- --steps 300
//! ```
//!
//! Default model: context 128, 4 pre-LayerNorm layers, d_model 256, 4 heads, MLP 1024 (GELU),
//! learned positions, output layer tied to the token embedding, no dropout. AdamW (lr 3e-4,
//! betas 0.9/0.95, weight decay 0.1), 100 warm-up updates then a cosine down to lr/10, global
//! gradient clipping at 1.0, 32 sequences per process. Every flag is listed by `--help`.
//! Prints tokens/s and the training loss every `--log-every` updates, the validation loss and
//! bits per byte every `--eval-every` updates and at the end (of the model and of an
//! exponential moving average of its weights, `--ema-decay`), then a sampled continuation.
//! With `--project-dir DIR`: CSV and TensorBoard logs in `DIR/logs`, a checkpoint at every
//! evaluation or every `--checkpoint-every` updates (the last 2 kept; in the background with
//! `--async-checkpoints`), and a second start resumes from the latest one.
//! With `--data DIR`: trains on `DIR/train*` and validates on `DIR/val*` instead of the
//! embedded text: token files (byte tokens in llm.c's `.bin` or numpy's `.npy`), Parquet
//! files with a `text` column (each process reads its own row groups) or Arrow IPC files with
//! one; `--example prepare_data` writes each. `--keyed-order` shuffles in an order computed at
//! each position, whose memory does not grow with the corpus; `--stream` reads the training
//! windows with the stream loader instead (Parquet row groups, or stretches of 4,096 windows,
//! as its shards).

use std::path::PathBuf;
use std::sync::Arc;
use std::time::{Duration, Instant};

use accelerate_burn::burn;
use accelerate_burn::metrics::{MeanMetric, MetricValue};
use accelerate_burn::nn::TransformerEncoderLayer;
use accelerate_burn::stream::{DatasetShards, PreparedStreamLoader, StreamLoader};
use accelerate_burn::{
    AccelerateError, Accelerator, Checkpoint, DataLoader, DefaultBackend, MixedPrecision,
    PreparedDataLoader, Tracker,
};
use accelerate_burn::{ShuffleOrder, Unit};
use accelerate_core::sampler::SplitMix64;
use accelerate_core::throughput::{ThroughputMeter, transformer_flops_per_token};
use accelerate_examples::text::{
    self, ByteWindows, RowFormat, RowWindows, TextBatch, TextBatcher, TextWindows,
};
use accelerate_examples::transformer::{TransformerLm, TransformerLmConfig};
use anyhow::Context;
use burn::data::dataset::Dataset;
use burn::module::Module;
use burn::optim::AdamWConfig;
use burn::tensor::activation::softmax;
use burn::tensor::{Int, Tensor, TensorData};
use clap::Parser;
use indicatif::{ProgressBar, ProgressStyle};

/// Updates excluded from the tokens/s figure (allocation, first-touch of buffers).
const WARM_UP_UPDATES: u64 = 3;

/// The example's settings (each one a flag).
#[derive(Parser, Debug, Clone, serde::Serialize)]
#[command(
    about = "Trains a byte-level transformer language model on Shakespeare's plays",
    args_override_self = true
)]
pub struct Args {
    /// Optimizer updates to train for.
    #[arg(long, default_value_t = 300)]
    pub steps: u64,
    /// Stop after this many updates in total, keeping the schedule of --steps (to train a long
    /// run in pieces with --project-dir).
    #[arg(long)]
    pub stop_at: Option<u64>,
    /// Sequence length (bytes).
    #[arg(long, default_value_t = 128)]
    pub context: usize,
    /// Transformer layers.
    #[arg(long, default_value_t = 4)]
    pub layers: usize,
    /// Width of the residual stream.
    #[arg(long, default_value_t = 256)]
    pub d_model: usize,
    /// Attention heads.
    #[arg(long, default_value_t = 4)]
    pub heads: usize,
    /// Hidden width of each layer's MLP.
    #[arg(long, default_value_t = 1024)]
    pub mlp: usize,
    /// Sequences per process per update.
    #[arg(long, default_value_t = 32)]
    pub batch: usize,
    /// Peak learning rate.
    #[arg(long, default_value_t = 3e-4)]
    pub lr: f64,
    /// Updates of linear warm-up before the cosine decay.
    #[arg(long, default_value_t = 100)]
    pub warmup: u64,
    /// AdamW's decoupled weight decay.
    #[arg(long, default_value_t = 0.1)]
    pub weight_decay: f32,
    /// AdamW's beta 1.
    #[arg(long, default_value_t = 0.9)]
    pub beta1: f32,
    /// AdamW's beta 2.
    #[arg(long, default_value_t = 0.95)]
    pub beta2: f32,
    /// Largest global gradient norm (0: no clipping).
    #[arg(long, default_value_t = 1.0)]
    pub clip: f32,
    /// Compute precision: no, bf16 or fp16 (default: ACCELERATE_MIXED_PRECISION, else no).
    #[arg(long)]
    pub mixed_precision: Option<String>,
    /// Burn's AdamW (`AdamWConfig::init()`) instead of the fused update.
    #[arg(long)]
    pub burn_optimizer: bool,
    /// Shuffles the training windows in an order computed at each position (constant memory,
    /// for corpora larger than memory) instead of one drawn whole each epoch.
    #[arg(long)]
    pub keyed_order: bool,
    /// Reads the training windows as a stream (`accelerate_burn::stream`): shards are the
    /// Parquet row groups, else stretches of 4,096 windows, dealt to the processes; windows
    /// shuffled in blocks of 8,192.
    #[arg(long)]
    pub stream: bool,
    /// Decay of the exponential moving average of the weights, evaluated beside the model.
    #[arg(long, default_value_t = 0.99)]
    pub ema_decay: f64,
    /// Layer norms, attention, GELU and the loss computed as burn-nn and Burn do instead of
    /// our fused CPU kernels, for comparisons (each op's outputs and gradients agree within
    /// 1e-5).
    #[arg(long)]
    pub burn_nn_modules: bool,
    /// Recompute memory-bound activations in the backward pass (lower peak memory).
    #[arg(long)]
    pub gradient_checkpointing: bool,
    /// Logs, checkpoints and resume in this directory.
    #[arg(long)]
    pub project_dir: Option<PathBuf>,
    /// Updates between evaluations (and checkpoints, with --project-dir).
    #[arg(long, default_value_t = 100)]
    pub eval_every: u64,
    /// Updates between checkpoints with --project-dir (default: at every evaluation).
    #[arg(long)]
    pub checkpoint_every: Option<u64>,
    /// Saves checkpoints in the background (also ACCELERATE_ASYNC_CHECKPOINTS=true).
    #[arg(long)]
    pub async_checkpoints: bool,
    /// Validation sequences evaluated (from the start of the validation text).
    #[arg(long, default_value_t = 256)]
    pub eval_sequences: usize,
    /// Updates between progress lines.
    #[arg(long, default_value_t = 10)]
    pub log_every: u64,
    /// Bytes sampled after training (0: none).
    #[arg(long, default_value_t = 200)]
    pub sample_bytes: usize,
    /// The text the sample continues.
    #[arg(long, default_value = "HAMLET.\n")]
    pub prompt: String,
    /// Train on DIR/train* and validate on DIR/val* instead of the embedded text: token files
    /// (byte tokens), or Parquet (read by row group) or Arrow files whose `text` rows are
    /// windows of --context + 1 bytes, as `--example prepare_data` writes them.
    #[arg(long, value_name = "DIR")]
    pub data: Option<PathBuf>,
    /// Seed of the initial weights, the data order and the sample.
    #[arg(long, default_value_t = 0)]
    pub seed: u64,
    /// Threads building batches.
    #[arg(long, default_value_t = 2)]
    pub num_workers: usize,
}

/// What a training run achieved.
#[derive(Debug, Clone)]
pub struct Report {
    /// Optimizer updates applied in total (resumed ones included).
    pub updates: u64,
    /// Validation loss at the end.
    pub validation: MetricValue,
    /// Validation loss of the moving average of the weights at the end.
    pub validation_ema: MetricValue,
    /// Mean training loss per token over the last logging interval.
    pub train_loss: f64,
    /// Tokens per second over all processes (`NaN` when too few updates were timed).
    pub tokens_per_second: f64,
    /// Share of the timed training time spent waiting for a batch.
    pub data_wait_share: f64,
    /// Every parameter's bit pattern, in visit order.
    pub parameters: Vec<u32>,
    /// Checkpoints saved, and the mean time each save call held the training thread.
    pub checkpoints: (u64, Duration),
    /// Layer gradients averaged during backward (overlap; 0 without).
    pub overlapped_gradients: u64,
}

fn main() -> anyhow::Result<()> {
    train(&Args::parse())?;
    Ok(())
}

/// The learning rate of update `update` (from 0): linear warm-up, then a cosine to lr/10.
pub fn learning_rate(args: &Args, update: u64) -> f64 {
    if update < args.warmup {
        return args.lr * (update + 1) as f64 / args.warmup as f64;
    }
    let decay = args.steps.saturating_sub(args.warmup).max(1) as f64;
    let progress = ((update - args.warmup) as f64 / decay).min(1.0);
    let floor = args.lr / 10.0;
    floor + 0.5 * (args.lr - floor) * (1.0 + (std::f64::consts::PI * progress).cos())
}

/// Trains as `args` say, prints progress, and returns the [`Report`].
pub fn train(args: &Args) -> anyhow::Result<Report> {
    let data = datasets(args)?;
    let mut builder = Accelerator::<DefaultBackend>::builder().seed(args.seed);
    if let Some(precision) = &args.mixed_precision {
        let precision: MixedPrecision = precision
            .parse()
            .map_err(|e| anyhow::anyhow!("--mixed-precision {e}"))?;
        builder = builder.mixed_precision(precision);
    }
    if args.gradient_checkpointing {
        builder = builder.gradient_checkpointing(true);
    }
    if args.async_checkpoints {
        builder = builder.async_checkpoints(true);
    }
    let mut trackers = Vec::new();
    if let Some(dir) = &args.project_dir {
        builder = builder.project_dir(dir).checkpoint_total_limit(2);
        trackers.extend([Tracker::Csv, Tracker::TensorBoard]);
    }
    if Tracker::MLflow.is_configured() {
        trackers.push(Tracker::MLflow);
    }
    let acc = builder.log_with(&trackers).build()?;
    acc.init_trackers("transformer_lm", &args)?;
    acc.set_total_steps(args.stop_at.unwrap_or(args.steps).min(args.steps));

    let config = TransformerLmConfig::new(
        text::VOCAB,
        args.context,
        args.layers,
        args.d_model,
        args.heads,
        args.mlp,
    )
    .with_fused(!args.burn_nn_modules);
    let model = config.init(&acc.device());
    if acc.config().zero_stage == 3 {
        // ZeRO-3: each transformer layer is a sharded unit.
        run(args, &acc, &config, model.shard_layers(&acc)?, data)
    } else if acc.num_processes() > 1 {
        // Each layer a unit: its gradients are averaged while backward goes on
        // (ACCELERATE_OVERLAP_COMMUNICATION=false averages after backward, same bits).
        run(args, &acc, &config, model.unit_layers(&acc)?, data)
    } else {
        run(args, &acc, &config, model, data)
    }
}

/// Windows of `context + 1` bytes to train on and to validate on.
type Windows = Arc<dyn Dataset<Vec<u8>>>;

/// The training and validation windows, and the training data's pieces when it is read in
/// pieces (Parquet's row groups).
struct Corpus {
    train: Windows,
    validation: Windows,
    train_pieces: Option<Vec<usize>>,
}

/// The training and validation windows: of the embedded text, or of `--data`'s token files,
/// Parquet files or Arrow files.
fn datasets(args: &Args) -> anyhow::Result<Corpus> {
    let validation_limit = Some(args.eval_sequences);
    let Some(dir) = &args.data else {
        let (train, validation) = text::train_validation_split()?;
        return Ok(Corpus {
            train: Arc::new(TextWindows::new(train, args.context, None)),
            validation: Arc::new(TextWindows::new(validation, args.context, validation_limit)),
            train_pieces: None,
        });
    };
    // Parquet files make a Parquet corpus, else Arrow files an Arrow one, else token files.
    let mut rows = None;
    let files = std::fs::read_dir(dir).with_context(|| format!("--data {}", dir.display()))?;
    for file in files.flatten() {
        match file.path().extension().and_then(|e| e.to_str()) {
            Some("parquet") => rows = Some(RowFormat::Parquet),
            Some("arrow") => rows = rows.or(Some(RowFormat::Arrow)),
            _ => {}
        }
    }
    Ok(match rows {
        Some(format) => {
            let train = RowWindows::open(dir, "train", format, (args.context, None))?;
            let validation = (args.context, validation_limit);
            Corpus {
                train_pieces: train.pieces(),
                train: Arc::new(train),
                validation: Arc::new(RowWindows::open(dir, "val", format, validation)?),
            }
        }
        None => Corpus {
            train: Arc::new(ByteWindows::open(dir, "train", args.context, None)?),
            validation: Arc::new(ByteWindows::open(
                dir,
                "val",
                args.context,
                validation_limit,
            )?),
            train_pieces: None,
        },
    })
}

/// Windows per shard when a stream reads data that has no pieces of its own.
const STREAM_SHARD_WINDOWS: usize = 4096;

/// The training loader: map-style, or a stream (`--stream`).
enum TrainLoader {
    Windows(PreparedDataLoader<Vec<u8>, TextBatch>),
    Stream(PreparedStreamLoader<Vec<u8>, TextBatch>),
}

type Batches<'a> = Box<dyn Iterator<Item = Result<TextBatch, AccelerateError>> + 'a>;

impl TrainLoader {
    /// The training loader `args` ask for over `windows` (read in `pieces`, if any).
    fn prepare(
        args: &Args,
        acc: &Accelerator<DefaultBackend>,
        windows: Windows,
        pieces: Option<Vec<usize>>,
    ) -> anyhow::Result<Self> {
        if args.stream {
            let len = windows.len();
            let shards = pieces.unwrap_or_else(|| {
                (0..len)
                    .step_by(STREAM_SHARD_WINDOWS)
                    .map(|start| STREAM_SHARD_WINDOWS.min(len - start))
                    .collect()
            });
            let source = DatasetShards::new(windows, &shards).map_err(|e| anyhow::anyhow!(e))?;
            let loader = StreamLoader::builder(TextBatcher)
                .batch_size(args.batch)
                .shuffle(args.seed)
                .shuffle_buffer(8192)
                .build(source);
            return Ok(Self::Stream(acc.prepare_stream_loader(loader)?));
        }
        let mut train = DataLoader::builder(TextBatcher)
            .batch_size(args.batch)
            .shuffle(args.seed)
            .num_workers(args.num_workers);
        if args.keyed_order {
            train = train.shuffle_order(ShuffleOrder::Keyed);
        }
        if let Some(pieces) = pieces {
            // Parquet: each process reads its own row groups, shuffled in blocks of 8,192 rows.
            train = train.pieces(pieces, 8192);
        }
        Ok(Self::Windows(
            acc.prepare_data_loader(train.build(windows))?,
        ))
    }

    fn epoch(&self) -> u64 {
        match self {
            Self::Windows(loader) => loader.epoch(),
            Self::Stream(loader) => loader.epoch(),
        }
    }

    fn set_epoch(&self, epoch: u64) {
        match self {
            Self::Windows(loader) => loader.set_epoch(epoch),
            Self::Stream(loader) => loader.set_epoch(epoch),
        }
    }

    fn iter(&self) -> Batches<'_> {
        match self {
            Self::Windows(loader) => Box::new(loader.iter()),
            Self::Stream(loader) => Box::new(loader.iter()),
        }
    }
}

/// The training of [`train`] for a model whose layers are `L` (whole, or sharded).
fn run<L: Unit<TransformerEncoderLayer>>(
    args: &Args,
    acc: &Accelerator<DefaultBackend>,
    config: &TransformerLmConfig,
    model: TransformerLm<L>,
    corpus: Corpus,
) -> anyhow::Result<Report> {
    let validation = DataLoader::builder(TextBatcher)
        .batch_size(args.batch)
        .num_workers(args.num_workers)
        .build(corpus.validation);
    let adamw = AdamWConfig::new()
        .with_beta_1(args.beta1)
        .with_beta_2(args.beta2)
        .with_weight_decay(args.weight_decay);
    let (mut model, mut optim) = if args.burn_optimizer {
        acc.prepare((model, adamw.init()))?
    } else {
        acc.prepare((model, adamw))?
    };
    let train = TrainLoader::prepare(args, acc, corpus.train, corpus.train_pieces)?;
    let validation = acc.prepare_eval_data_loader(validation)?;
    let mut ema = model.clone().no_grad();
    if args.project_dir.is_some() {
        let restored = acc.load_latest_checkpoint(model, &mut optim, None)?;
        model = restored.model;
        ema = restored.info.module("ema", ema)?;
        if let Some(path) = restored.info.path {
            acc.print(format!("resumed from {}", path.display()));
        }
    }
    acc.print(format!(
        "{} parameters, {} processes x {} sequences of {} bytes per update, {} in {:?}",
        config.parameters(),
        acc.num_processes(),
        args.batch,
        args.context,
        acc.backend_name(),
        acc.compute_dtype(),
    ));

    let bar = if acc.is_main_process() {
        ProgressBar::new(args.steps)
    } else {
        ProgressBar::hidden()
    };
    bar.set_style(ProgressStyle::with_template(
        "{bar:40} {pos}/{len} updates {msg}",
    )?);
    bar.set_position(optim.updates());
    let tokens_per_update = (args.batch * args.context * acc.num_processes()) as f64;
    // The trackers' throughput figures (tokens/s, model FLOPs/s, MFU with
    // ACCELERATE_PEAK_FLOPS, peak memory), over each logging interval.
    let mut meter =
        ThroughputMeter::new(acc.num_processes()).flops_per_token(transformer_flops_per_token(
            config.parameters() as u64,
            args.layers as u64,
            args.d_model as u64,
            args.context as u64,
        ));
    let (mut timed, mut waited, mut timed_updates) = (Duration::ZERO, Duration::ZERO, 0u64);
    let (mut interval_loss, mut interval_tokens, mut train_loss) = (0.0, 0.0, f64::NAN);
    let mut validation_value = None;
    let (mut saves, mut saving) = (0u64, Duration::ZERO);
    let checkpoint_every = args.checkpoint_every.unwrap_or(args.eval_every).max(1);
    let last = args.stop_at.unwrap_or(args.steps).min(args.steps);
    // Model, optimizer state, corpus and loader threads are in place: what the peak adds to
    // this is the training step's (and evaluation's) own memory.
    let before_training = resident_memory();
    'epochs: for epoch in train.epoch().. {
        train.set_epoch(epoch);
        let mut batches = train.iter();
        loop {
            if optim.updates() >= last {
                break 'epochs;
            }
            let started = Instant::now();
            let Some(batch) = batches.next() else { break };
            let TextBatch { inputs, targets } = batch?;
            let got_batch = started.elapsed();
            let tokens = targets.dims().iter().product::<usize>() as u64;
            let loss_sum = acc
                .autocast(&model, |m, _| m.sequence_losses(inputs, targets))
                .sum();
            let mut grads = acc.backward_sum(loss_sum.clone(), tokens, &model)?;
            if args.clip > 0.0 {
                acc.clip_grad_norm(&model, &mut grads, args.clip)?;
            }
            let before = optim.updates();
            let lr = learning_rate(args, before);
            model = optim.step(lr, model, grads)?;
            ema = acc.ema_update(ema, &model, args.ema_decay)?;
            interval_loss += f64::from(loss_sum.into_scalar::<f32>());
            interval_tokens += tokens as f64;
            meter.record(tokens, args.batch as u64);
            if optim.updates() == WARM_UP_UPDATES {
                meter.restart();
            }
            if optim.updates() > WARM_UP_UPDATES {
                timed += started.elapsed();
                waited += got_batch;
                timed_updates += 1;
            }
            let updates = optim.updates();
            // A step fp16's loss scaler skipped (overflow) is no update: nothing to log,
            // evaluate or save again for the update before it (the first ones of an fp16 run
            // are skipped while the scale backs off, each repeating update 0's evaluation).
            if updates == before {
                continue;
            }
            bar.set_position(updates);
            if updates % args.log_every == 0 || updates == last {
                train_loss = interval_loss / interval_tokens;
                (interval_loss, interval_tokens) = (0.0, 0.0);
                let speed = tokens_per_update * timed_updates as f64 / timed.as_secs_f64();
                let line = format!(
                    "update {updates}/{}: train loss {train_loss:.4}, {speed:.0} tokens/s",
                    args.steps
                );
                bar.set_message(format!("loss {train_loss:.3}, {speed:.0} tokens/s"));
                bar.suspend(|| acc.print(&line));
                let mut metrics = vec![("train/loss", train_loss), ("train/tokens_per_s", speed)];
                metrics.extend(meter.metrics());
                metrics.extend(acc.device_memory_metrics());
                acc.log(&metrics, updates)?;
            }
            if updates % args.eval_every == 0 || updates == last {
                let value = evaluate(acc, &model, &validation)?;
                let averaged = evaluate(acc, &ema, &validation)?;
                bar.suspend(|| {
                    acc.print(format!(
                        "update {updates}: validation loss {:.4} ({:.3} bits per byte), with \
                         the moving average {:.4}",
                        value.value,
                        value.bits(),
                        averaged.value,
                    ))
                });
                acc.log(
                    &[
                        ("validation/loss", value.value),
                        ("validation/bpb", value.bits()),
                        ("validation/ema_loss", averaged.value),
                    ],
                    updates,
                )?;
                validation_value = Some((value, averaged));
                // Evaluation is not training throughput.
                meter.restart();
            }
            if args.project_dir.is_some() && (updates % checkpoint_every == 0 || updates == last) {
                let started = Instant::now();
                acc.save_checkpoint(&Checkpoint::new(&model, &optim).module("ema", &ema))?;
                saving += started.elapsed();
                saves += 1;
            }
        }
    }
    // A checkpoint still being written in the background: committed (or its error) now.
    acc.wait_for_checkpoint()?;
    bar.finish_and_clear();
    if saves > 0 {
        let step = timed.as_secs_f64() / timed_updates.max(1) as f64;
        let save = saving.as_secs_f64() / saves as f64;
        acc.print(format!(
            "{saves} checkpoints ({}): {:.1} ms of the training thread each, a saving step \
             {:.2}x a plain step ({:.1} ms)",
            match acc.config().async_checkpoints {
                true => "in the background",
                false => "synchronous",
            },
            1e3 * save,
            (step + save) / step,
            1e3 * step,
        ));
    }
    let (validation, validation_ema) = match validation_value {
        Some(values) => values,
        None => (
            evaluate(acc, &model, &validation)?,
            evaluate(acc, &ema, &validation)?,
        ),
    };
    let tokens_per_second = tokens_per_update * timed_updates as f64 / timed.as_secs_f64();
    let data_wait_share = waited.as_secs_f64() / timed.as_secs_f64();
    acc.print(format!(
        "validation loss {:.4} ({:.3} bits per byte; moving average {:.4}) after {} updates; \
         {tokens_per_second:.0} tokens/s, {:.2} % of it waiting for data; peak resident memory \
         {}",
        validation.value,
        validation.bits(),
        validation_ema.value,
        optim.updates(),
        100.0 * data_wait_share,
        match (peak_resident_memory(), before_training) {
            (Some(peak), Some(before)) => format!(
                "{} MiB ({} MiB above the {} MiB held before the first step)",
                peak / 1024,
                peak.saturating_sub(before) / 1024,
                before / 1024
            ),
            _ => "unknown".into(),
        },
    ));
    if acc.overlapped_gradients() > 0 {
        acc.print(format!(
            "{} layer gradients averaged during backward (overlap); {:.1} s communicating",
            acc.overlapped_gradients(),
            acc.communication_time().as_secs_f64()
        ));
    }
    if args.sample_bytes > 0 {
        // Every process gathers the layers (a collective); the main one samples.
        let whole = model.valid().whole();
        if acc.is_main_process() {
            let sample = continue_text(&whole, args, acc.device().inner());
            println!(
                "sample:\n{}{}",
                args.prompt,
                String::from_utf8_lossy(&sample)
            );
        }
    }
    Ok(Report {
        updates: optim.updates(),
        validation,
        validation_ema,
        train_loss,
        tokens_per_second,
        data_wait_share,
        parameters: parameter_bits(&model.whole()),
        overlapped_gradients: acc.overlapped_gradients(),
        checkpoints: (
            saves,
            u32::try_from(saves)
                .ok()
                .and_then(|n| saving.checked_div(n))
                .unwrap_or_default(),
        ),
    })
}

/// Validation loss per byte over the evaluated sequences of every process.
fn evaluate<L: Unit<TransformerEncoderLayer>>(
    acc: &Accelerator<DefaultBackend>,
    model: &TransformerLm<L>,
    validation: &PreparedDataLoader<Vec<u8>, TextBatch>,
) -> anyhow::Result<MetricValue> {
    // Off the autodiff device: on it every forward records a graph that nothing consumes, and
    // 256 sequences held 2.8 GiB of them at once.
    let model = model.valid();
    let mut loss = MeanMetric::new();
    for batch in validation.iter() {
        let TextBatch { inputs, targets } = batch?;
        let (inputs, targets) = (inputs.inner(), targets.inner());
        let [rows, context] = targets.dims();
        let tokens = Tensor::<1>::full([rows], context as f32, &targets.device());
        let sums = acc.autocast(&model, |m, _| m.sequence_losses(inputs, targets));
        loss.update_sums(acc, sums, tokens)?;
    }
    Ok(loss.compute(acc)?)
}

/// `args.sample_bytes` bytes continuing `args.prompt`, drawn at temperature 0.8.
fn continue_text(model: &TransformerLm, args: &Args, device: burn::tensor::Device) -> Vec<u8> {
    let mut bytes = args.prompt.as_bytes().to_vec();
    let mut random = SplitMix64::new(args.seed);
    for _ in 0..args.sample_bytes {
        let window = &bytes[bytes.len().saturating_sub(args.context)..];
        let tokens: Vec<i64> = window.iter().map(|&b| i64::from(b)).collect();
        let seq = tokens.len();
        let input = Tensor::<2, Int>::from_data(TensorData::new(tokens, [1, seq]), &device);
        let last = model
            .forward(input)
            .narrow(1, seq - 1, 1)
            .reshape([text::VOCAB]);
        let probs: Vec<f32> = softmax(last.div_scalar(0.8), 0)
            .into_data()
            .iter::<f32>()
            .collect();
        let mut draw = (random.next_u64() >> 11) as f64 / (1u64 << 53) as f64;
        let mut next = probs.len() - 1;
        for (byte, p) in probs.iter().enumerate() {
            draw -= f64::from(*p);
            if draw < 0.0 {
                next = byte;
                break;
            }
        }
        bytes.push(next as u8);
    }
    bytes.split_off(args.prompt.len())
}

/// This process's peak resident memory in KiB (Linux's `VmHWM`), if the system reports it.
fn peak_resident_memory() -> Option<u64> {
    status_kib("VmHWM:")
}

/// This process's resident memory now, in KiB (Linux's `VmRSS`).
fn resident_memory() -> Option<u64> {
    status_kib("VmRSS:")
}

fn status_kib(field: &str) -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with(field))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn parameter_bits(model: &TransformerLm) -> Vec<u32> {
    use burn::module::{ModuleVisitor, Param};
    struct Collect(Vec<u32>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0
                .extend(param.val().into_data().iter::<f32>().map(f32::to_bits));
        }
    }
    let mut collect = Collect(Vec::new());
    model.visit(&mut collect);
    collect.0
}
