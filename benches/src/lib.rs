//! Shared set-up for the accelerate-rs benchmarks: one training step of `mlp_synthetic`'s model
//! written as a plain Burn loop and as the accelerated loop, on identical inputs.
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

use accelerate_burn::burn;
use accelerate_burn::{
    Accelerator, DefaultBackend, FusedOptimizer, MixedPrecision, PreparedOptimizer, ProcessState,
};
use accelerate_examples::synthetic::{CLASSES, FEATURES};
use accelerate_examples::{Mlp, MlpConfig};
use accelerate_kernels::optim::AdamHyper;
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

/// Two copies of the benchmark model, one per loop, and a fixed batch.
pub struct StepBench {
    acc: Accelerator<DefaultBackend>,
    plain: Option<(Mlp, ModuleOptimizer)>,
    accelerated: Option<(Mlp, PreparedOptimizer)>,
    x: Tensor<2>,
    y: Tensor<1, Int>,
}

impl StepBench {
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
        let acc = Accelerator::<DefaultBackend>::builder()
            .process_state(ProcessState::single())
            .mixed_precision(precision)
            .seed(0)
            .build()
            .expect("the default backend runs on this machine");
        let device: Device = acc.device();
        let model = MlpConfig::new(FEATURES, vec![1024, 1024], CLASSES).init(&device);
        let x = Tensor::random([batch, FEATURES], Distribution::Default, &device);
        let y =
            Tensor::<1, Int>::random([batch], Distribution::Uniform(0.0, CLASSES as f64), &device);
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
            x,
            y,
        }
    }

    /// One step of the plain Burn loop: forward, backward, optimizer step.
    pub fn plain_step(&mut self) {
        let (model, mut optim) = self
            .plain
            .take()
            .expect("state is put back after each step");
        let loss = model.forward_loss(self.x.clone(), self.y.clone()).loss;
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
        let (x, y) = (self.x.clone(), self.y.clone());
        let loss = self
            .acc
            .autocast(&model, |m, c| m.forward_loss(c.input(x), y))
            .loss;
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
