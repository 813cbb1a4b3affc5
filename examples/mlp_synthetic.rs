//! One epoch of an MLP 784-1024-1024-10 on generated data (batch 128, AdamW 1e-3): the
//! throughput benchmark of a plain Burn loop plus the Accelerator lines.
//!
//! ```text
//! cargo run --example mlp_synthetic
//! ```
//!
//! Arguments: `--samples N` (default 60000); `--burn-optimizer` for Burn's AdamW
//! (`AdamWConfig::new().init()`) instead of the fused update that `prepare` picks for
//! `AdamWConfig::new()` (with `ACCELERATE_ZERO_STAGE=1` and several processes, ZeRO-1; at
//! `ACCELERATE_ZERO_STAGE=3` the MLP is one sharded unit). Prints samples per second over all
//! processes,
//! excluding the first 10 steps (warm-up), the final loss, and with several processes
//! (`accelerate-rs launch -n 2 --example mlp_synthetic`) the time per step spent averaging
//! gradients.

use accelerate_burn::burn;
use accelerate_burn::{Accelerator, DataLoader, DefaultBackend, Unit};
use accelerate_examples::synthetic::{self, SampleBatcher, TeacherDataset};
use accelerate_examples::{Mlp, MlpConfig};
use anyhow::Context;
use burn::optim::AdamWConfig;

const BATCH: usize = 128;
const WARM_UP_STEPS: usize = 10;

fn main() -> anyhow::Result<()> {
    let samples: usize = match std::env::args().skip_while(|a| a != "--samples").nth(1) {
        Some(n) => n.parse().context("--samples expects a number")?,
        None => 60_000,
    };
    run(samples, std::env::args().any(|a| a == "--burn-optimizer"))
}

/// Trains one epoch of `samples` samples (with Burn's AdamW when `burn_optimizer`, else the
/// fused one) and prints the throughput line.
pub fn run(samples: usize, burn_optimizer: bool) -> anyhow::Result<()> {
    let acc = Accelerator::<DefaultBackend>::builder().seed(0).build()?;
    let model = MlpConfig::new(synthetic::FEATURES, vec![1024, 1024], synthetic::CLASSES)
        .init(&acc.device());
    if acc.config().zero_stage == 3 {
        train(&acc, acc.shard(model)?, samples, burn_optimizer)
    } else {
        train(&acc, model, samples, burn_optimizer)
    }
}

/// The loop of [`run`] for the MLP as `model` holds it (whole, or one sharded unit).
fn train<U: Unit<Mlp>>(
    acc: &Accelerator<DefaultBackend>,
    model: U,
    samples: usize,
    burn_optimizer: bool,
) -> anyhow::Result<()> {
    let train = DataLoader::builder(SampleBatcher)
        .batch_size(BATCH)
        .shuffle(0)
        .build(TeacherDataset::new(samples, 0));
    let (mut model, mut optim, train) = if burn_optimizer {
        acc.prepare((model, AdamWConfig::new().init(), train))?
    } else {
        acc.prepare((model, AdamWConfig::new(), train))?
    };

    let mut timed = None;
    let mut last_loss = f32::NAN;
    let mut timed_steps = 0u32;
    for (step, batch) in train.iter().enumerate() {
        if step == WARM_UP_STEPS {
            timed = Some((std::time::Instant::now(), 0usize, acc.communication_time()));
        }
        let batch = batch?;
        let n = batch.targets.dims()[0];
        let loss = acc
            .autocast(&model, |m, c| {
                m.whole()
                    .forward_loss(c.input(batch.features), batch.targets)
            })
            .loss;
        let grads = acc.backward(loss.clone(), &model)?;
        model = optim.step(1e-3, model, grads)?;
        if let Some((_, seen, _)) = timed.as_mut() {
            *seen += n;
            timed_steps += 1;
        }
        last_loss = loss.into_scalar::<f32>();
    }
    match timed {
        Some((started, seen, comm_before)) => {
            let seconds = started.elapsed().as_secs_f64();
            let processes = acc.num_processes();
            let comm = (acc.communication_time() - comm_before).as_secs_f64();
            acc.print(format!(
                "{:.0} samples/s ({:.2} ms/step) over {} samples on {processes} process(es) (first {WARM_UP_STEPS} steps excluded), final loss {last_loss:.4}, {} in {:?}, {} AdamW",
                (seen * processes) as f64 / seconds,
                1e3 * seconds / f64::from(timed_steps),
                seen * processes,
                acc.backend_name(),
                acc.compute_dtype(),
                if burn_optimizer { "Burn's" } else { "fused" },
            ));
            if processes > 1 {
                acc.print(format!(
                    "communication: {:.2} ms of {:.2} ms per step",
                    1e3 * comm / f64::from(timed_steps),
                    1e3 * seconds / f64::from(timed_steps),
                ));
            }
        }
        None => acc.print(format!(
            "too few samples to time (fewer than {WARM_UP_STEPS} steps); final loss {last_loss:.4}"
        )),
    }
    Ok(())
}
