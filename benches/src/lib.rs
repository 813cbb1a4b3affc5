//! Shared set-up for the accelerate-rs benchmarks: one training step of `mlp_synthetic`'s model
//! (or the transformer example's) written as a plain Burn loop and as the accelerated loop, on
//! identical inputs.
//!
//! ```
//! use accelerate_benches::StepBench;
//! let mut bench = StepBench::new(4);
//! bench.plain_step();
//! bench.accelerated_step();
//! ```

#![forbid(unsafe_code)]

#[cfg(feature = "device")]
pub mod device_kernels;
#[cfg(feature = "nccl")]
pub mod nccl_bandwidth;

use accelerate_burn::burn;
use accelerate_burn::{
    Accelerator, Caster, DefaultBackend, FusedOptimizer, MixedPrecision, PreparedOptimizer,
    ProcessState,
};
use accelerate_examples::synthetic::{CLASSES, FEATURES};
use accelerate_examples::transformer::{TransformerLm, TransformerLmConfig};
use accelerate_examples::{Mlp, MlpConfig};
use accelerate_kernels::optim::AdamHyper;
use burn::module::Module;
use burn::optim::{AdamWConfig, GradientsParams, ModuleOptimizer};
use burn::tensor::{Device, Distribution, Int, Tensor};

/// Burn's `AdamWConfig::new()` settings, as the fused kernels take them.
pub const BURN_ADAMW: AdamHyper = AdamHyper {
    beta_1: 0.9,
    beta_2: 0.999,
    epsilon: 1e-5,
    weight_decay: 1e-4,
    decoupled: true,
};

/// A model the step benchmarks train, with its fixed batch.
pub trait BenchModel: Module {
    /// The batch every step uses.
    type Batch: Clone;

    /// The mean loss of `batch`, with float inputs cast by `caster` when given (autocast).
    fn bench_loss(&self, batch: Self::Batch, caster: Option<&Caster>) -> Tensor<1>;
}

impl BenchModel for Mlp {
    type Batch = (Tensor<2>, Tensor<1, Int>);

    fn bench_loss(&self, (x, y): Self::Batch, caster: Option<&Caster>) -> Tensor<1> {
        let x = match caster {
            Some(caster) => caster.input(x),
            None => x,
        };
        self.forward_loss(x, y).loss
    }
}

impl BenchModel for TransformerLm {
    type Batch = (Tensor<2, Int>, Tensor<2, Int>);

    fn bench_loss(&self, (inputs, targets): Self::Batch, _: Option<&Caster>) -> Tensor<1> {
        let tokens = targets.dims().iter().product::<usize>();
        self.sequence_losses(inputs, targets)
            .sum()
            .div_scalar(tokens as f64)
    }
}

/// Two copies of the benchmark model, one per loop, and a fixed batch.
pub struct StepBench<M: BenchModel = Mlp> {
    acc: Accelerator<DefaultBackend>,
    plain: Option<(M, ModuleOptimizer)>,
    accelerated: Option<(M, PreparedOptimizer)>,
    batch: M::Batch,
}

fn bench_accelerator(precision: MixedPrecision) -> Accelerator<DefaultBackend> {
    Accelerator::<DefaultBackend>::builder()
        .process_state(ProcessState::single())
        .mixed_precision(precision)
        .seed(0)
        .build()
        .expect("the default backend runs on this machine")
}

impl StepBench<Mlp> {
    /// Models 784-1024-1024-10 with AdamW and a random batch of `batch` samples.
    pub fn new(batch: usize) -> Self {
        Self::with_precision(batch, MixedPrecision::No)
    }

    /// The same, with the accelerated loop computing in `precision`.
    pub fn with_precision(batch: usize, precision: MixedPrecision) -> Self {
        Self::with_options(batch, precision, false)
    }

    /// The same, with the accelerated loop using the fused AdamW when `fused`.
    pub fn with_options(batch: usize, precision: MixedPrecision, fused: bool) -> Self {
        let acc = bench_accelerator(precision);
        let device: Device = acc.device();
        let model = MlpConfig::new(FEATURES, vec![1024, 1024], CLASSES).init(&device);
        let x = Tensor::random([batch, FEATURES], Distribution::Default, &device);
        let y =
            Tensor::<1, Int>::random([batch], Distribution::Uniform(0.0, CLASSES as f64), &device);
        Self::prepared(acc, model, (x, y), fused)
    }
}

impl StepBench<TransformerLm> {
    /// The transformer example's default model (context 128, 4 layers, d_model 256) with
    /// AdamW and a random batch of `sequences` byte sequences; the accelerated loop uses the
    /// fused AdamW when `fused`.
    pub fn transformer(sequences: usize, fused: bool) -> Self {
        let acc = bench_accelerator(MixedPrecision::No);
        let device: Device = acc.device();
        let context = 128;
        let model = TransformerLmConfig::new(256, context, 4, 256, 4, 1024).init(&device);
        let bytes = |device: &Device| {
            Tensor::<2, Int>::random(
                [sequences, context],
                Distribution::Uniform(0.0, 256.0),
                device,
            )
        };
        let batch = (bytes(&device), bytes(&device));
        Self::prepared(acc, model, batch, fused)
    }
}

impl<M: BenchModel> StepBench<M> {
    fn prepared(acc: Accelerator<DefaultBackend>, model: M, batch: M::Batch, fused: bool) -> Self {
        let plain = (model.clone(), AdamWConfig::new().init());
        let accelerated = if fused {
            let adamw = FusedOptimizer::adamw(&AdamWConfig::new()).expect("AdamW is fused");
            acc.prepare((model, adamw))
        } else {
            acc.prepare((model, AdamWConfig::new().init()))
        }
        .expect("a single-process prepare cannot fail");
        Self {
            acc,
            plain: Some(plain),
            accelerated: Some(accelerated),
            batch,
        }
    }

    /// One step of the plain Burn loop: forward, backward, optimizer step.
    pub fn plain_step(&mut self) {
        let (model, mut optim) = self
            .plain
            .take()
            .expect("state is put back after each step");
        let loss = model.bench_loss(self.batch.clone(), None);
        let grads = GradientsParams::from_grads(loss.backward(), &model);
        let model = optim.step(1e-3, model, grads);
        self.plain = Some((model, optim));
    }

    /// Builds the low-precision view of the model and drops it (the cost autocast adds).
    pub fn cast_view(&self) {
        if let Some((model, _)) = &self.accelerated {
            self.acc.autocast(model, |_, _| ());
        }
    }

    /// One step of the accelerated loop: the same, through the accelerator (and its autocast).
    pub fn accelerated_step(&mut self) {
        let (model, mut optim) = self
            .accelerated
            .take()
            .expect("state is put back after each step");
        let batch = self.batch.clone();
        let loss = self
            .acc
            .autocast(&model, |m, c| m.bench_loss(batch, Some(c)));
        let grads = self
            .acc
            .backward(loss, &model)
            .expect("single process backward");
        let model = optim
            .step(1e-3, model, grads)
            .expect("an update is due every step");
        self.accelerated = Some((model, optim));
    }

    /// Waits for queued device work, so a timed step includes its own computation.
    pub fn sync(&self) {
        let _ = self.acc.device().sync();
    }
}
