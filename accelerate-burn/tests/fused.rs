//! Fused optimizers against Burn's own, on the same model and batches: AdamW (with AMSGrad),
//! Adam with L2 decay, SGD with Nesterov momentum and decay; under a learning-rate schedule
//! and global clipping, over many steps.

use accelerate_burn::{
    AccelerateError, Accelerator, DataLoader, DefaultBackend, FusedOptimizer, MixedPrecision,
    ProcessState,
};
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::module::Module;
use burn::nn::Linear;
use burn::optim::decay::WeightDecayConfig;
use burn::optim::momentum::MomentumConfig;
use burn::optim::{AdamConfig, AdamWConfig, ModuleOptimizer, SgdConfig};
use burn::tensor::Device;

#[path = "support/tiny_net.rs"]
mod tiny_net;

use tiny_net::{Net, Rows, data, linear, values};

/// Trains 3 epochs (36 updates) with `optimizer`, a linear schedule and clipping at 0.5;
/// returns the parameters and the norms `clip_grad_norm` reported.
fn train<S: accelerate_burn::OptimizerSource>(
    optimizer: S,
    precision: MixedPrecision,
) -> Result<(Vec<f32>, Vec<f32>), AccelerateError> {
    let acc = Accelerator::<DefaultBackend>::builder()
        .process_state(ProcessState::single())
        .mixed_precision(precision)
        .seed(5)
        .build()?;
    let model = Net::new(&acc.device());
    let loader = DataLoader::builder(Rows)
        .batch_size(8)
        .shuffle(1)
        .build(InMemDataset::new(data(96)));
    let (mut model, mut optim, train) = acc.prepare((model, optimizer, loader))?;
    let schedule = LinearLrSchedulerConfig::new(2e-2, 1e-3, 36)
        .init()
        .expect("a valid schedule");
    let mut sched = acc.prepare_scheduler(schedule);
    let mut norms = Vec::new();
    for epoch in 0..3 {
        train.set_epoch(epoch);
        for batch in train.iter() {
            let batch = batch?;
            let loss = acc.autocast(&model, |m, c| m.loss((c.input(batch.0), c.input(batch.1))));
            let mut grads = acc.backward(loss, &model)?;
            if let Some(norm) = acc.clip_grad_norm(&model, &mut grads, 0.5)? {
                norms.push(norm);
            }
            model = optim.step(sched.step(), model, grads)?;
        }
    }
    if optim.is_fused() {
        // On wgpu and cuda the fused buffers and update live on the GPU; on the CPU backends,
        // on the host.
        use accelerate_burn::AcceleratorBackend;
        assert_eq!(
            optim.state_on_device(),
            Some(DefaultBackend::DEVICE_KERNELS)
        );
    }
    Ok((values(&model), norms))
}

fn compare(name: &str, burn: ModuleOptimizer, fused: FusedOptimizer) {
    compare_in(name, burn, fused, MixedPrecision::No);
}

fn compare_in(name: &str, burn: ModuleOptimizer, fused: FusedOptimizer, precision: MixedPrecision) {
    let (reference, reference_norms) = train(burn, precision).unwrap();
    let (ours, norms) = train(fused, precision).unwrap();
    assert_eq!(
        norms.len(),
        reference_norms.len(),
        "{name}: the same steps were skipped"
    );
    let worst_norm = norms
        .iter()
        .zip(&reference_norms)
        .map(|(a, b)| ((a - b) / b).abs())
        .fold(0.0f32, f32::max);
    let worst = ours
        .iter()
        .zip(&reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    eprintln!("{name}: largest parameter difference {worst:e}, norm {worst_norm:e}");
    assert!(
        worst <= 1e-5,
        "{name}: largest parameter difference {worst}"
    );
    assert!(
        worst_norm <= 1e-5,
        "{name}: gradient norms differ by {worst_norm}"
    );
}

/// Tolerance 1e-5 absolute on parameters of magnitude ~0.5 after 36 updates: the update
/// formulas are Burn's operation by operation, but the global norm is summed in another
/// order (f64 blocks on the host vs f32 on the device), so clipping factors differ in the last
/// bits and the difference compounds through the following steps. Observed: at most 8.9e-8
/// (AdamW, Adam), 6e-8 (AMSGrad), 1.5e-8 (SGD); norms within 1.2e-6 relative.
#[test]
fn fused_optimizers_follow_burns_over_many_steps() {
    compare(
        "AdamW",
        AdamWConfig::new().with_weight_decay(0.05).init(),
        FusedOptimizer::adamw(&AdamWConfig::new().with_weight_decay(0.05)).unwrap(),
    );
    compare(
        "AdamW + AMSGrad",
        AdamWConfig::new().with_amsgrad(true).init(),
        FusedOptimizer::adamw(&AdamWConfig::new().with_amsgrad(true)).unwrap(),
    );
    let adam = AdamConfig::new()
        .with_beta_2(0.99)
        .with_weight_decay(Some(WeightDecayConfig::new(0.01)));
    compare("Adam", adam.init(), FusedOptimizer::adam(&adam).unwrap());
    let sgd = SgdConfig::new()
        .with_weight_decay(Some(WeightDecayConfig::new(1e-3)))
        .with_momentum(Some(MomentumConfig::new().with_nesterov(true)));
    compare(
        "SGD + Nesterov",
        sgd.init(),
        FusedOptimizer::sgd(&sgd).unwrap(),
    );
    let plain = SgdConfig::new();
    compare("SGD", plain.init(), FusedOptimizer::sgd(&plain).unwrap());
}

/// fp16 with dynamic loss scaling: the fused step unscales inside the update pass and makes
/// the same skip decisions (a skipped step leaves no norm), so it follows Burn's optimizer
/// behind the accelerator's own unscaling.
#[test]
fn fused_adamw_follows_burns_in_fp16() {
    let config = AdamWConfig::new().with_weight_decay(0.05);
    compare_in(
        "AdamW fp16",
        config.init(),
        FusedOptimizer::adamw(&config).unwrap(),
        MixedPrecision::Fp16,
    );
}

/// Prepares `source` for a fresh model; returns whether the update is fused and the log lines
/// (debug level and above) that preparing wrote.
fn prepare_and_log<S: accelerate_burn::OptimizerSource>(source: S) -> (bool, String) {
    use std::sync::{Arc, Mutex};
    #[derive(Clone, Default)]
    struct Log(Arc<Mutex<Vec<u8>>>);
    impl std::io::Write for Log {
        fn write(&mut self, bytes: &[u8]) -> std::io::Result<usize> {
            self.0.lock().unwrap().extend_from_slice(bytes);
            Ok(bytes.len())
        }
        fn flush(&mut self) -> std::io::Result<()> {
            Ok(())
        }
    }
    let log = Log::default();
    let writer = log.clone();
    let subscriber = tracing_subscriber::fmt()
        .with_max_level(tracing::Level::DEBUG)
        .with_ansi(false)
        .with_writer(move || writer.clone())
        .finish();
    let fused = tracing::subscriber::with_default(subscriber, || {
        let acc = Accelerator::<DefaultBackend>::builder()
            .process_state(ProcessState::single())
            .build()
            .unwrap();
        let model = Net::new(&acc.device());
        let (_model, optim) = acc.prepare((model, source)).unwrap();
        optim.is_fused()
    });
    let text = String::from_utf8_lossy(&log.0.lock().unwrap()).into_owned();
    (fused, text)
}

fn bits(values: &[f32]) -> Vec<u32> {
    values.iter().map(|v| v.to_bits()).collect()
}

/// Burn's configs given to `prepare` take the fused update when it computes the same thing
/// (the very same run as asking for it by name, bit for bit), and Burn's optimizer, with one
/// debug message saying why, when it would not.
#[test]
fn burns_configs_get_the_fused_update_whenever_it_is_equivalent() {
    let adamw = AdamWConfig::new().with_weight_decay(0.05);
    let adam = AdamConfig::new().with_weight_decay(Some(WeightDecayConfig::new(0.01)));
    let sgd = SgdConfig::new().with_momentum(Some(MomentumConfig::new()));
    let by_config = [
        ("AdamW", prepare_and_log(adamw.clone())),
        ("Adam", prepare_and_log(adam)),
        ("SGD", prepare_and_log(sgd.clone())),
    ];
    for (name, (fused, log)) in &by_config {
        assert!(fused, "{name}: not fused");
        assert!(!log.contains("not the fused update"), "{name}: {log}");
    }
    let explicit = FusedOptimizer::adamw(&adamw).unwrap();
    assert_eq!(run_config(adamw), run_config(explicit));
    let explicit = FusedOptimizer::sgd(&sgd).unwrap();
    assert_eq!(run_config(sgd), run_config(explicit));

    use burn::grad_clipping::GradientClippingConfig;
    let clipped = AdamWConfig::new().with_grad_clipping(Some(GradientClippingConfig::Value(0.1)));
    let cautious = AdamWConfig::new().with_cautious_weight_decay(true);
    for (name, config, why) in [
        (
            "per-tensor clipping",
            clipped,
            "per-tensor gradient clipping",
        ),
        ("cautious decay", cautious, "cautious weight decay"),
    ] {
        let (fused, log) = prepare_and_log(config.clone());
        assert!(!fused, "{name}: fused");
        let said: Vec<&str> = log
            .lines()
            .filter(|l| l.contains("not the fused update"))
            .collect();
        assert_eq!(said.len(), 1, "{name}: one message, got {log}");
        assert!(
            said[0].contains("DEBUG") && said[0].contains(why),
            "{name}: {}",
            said[0]
        );
        // And it is Burn's optimizer exactly as `config.init()` gives it.
        assert_eq!(
            run_config(config.clone()),
            run_config(config.init()),
            "{name}"
        );
    }
}

fn run_config<S: accelerate_burn::OptimizerSource>(source: S) -> Vec<u32> {
    bits(&train(source, MixedPrecision::No).unwrap().0)
}

#[test]
fn what_is_not_fused_is_refused_with_a_hint() {
    use burn::grad_clipping::GradientClippingConfig;
    let err = FusedOptimizer::adamw(
        &AdamWConfig::new().with_grad_clipping(Some(GradientClippingConfig::Norm(1.0))),
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("clip_grad_norm"), "{err}");
}

#[test]
fn parameters_added_after_prepare_are_an_error() {
    let acc = Accelerator::<DefaultBackend>::builder()
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let fused = FusedOptimizer::sgd(&SgdConfig::new()).unwrap();
    let (model, mut optim) = acc.prepare((Net::new(&acc.device()), fused)).unwrap();
    let batch = Rows.batch(data(96)[..4].to_vec(), &acc.device());
    let grads = acc.backward(model.loss(batch.clone()), &model).unwrap();
    let model = optim.step(0.1, model, grads).unwrap();
    // The user swaps a layer for a new one (new parameters) after prepare.
    let model = Net {
        out: linear(32, 2, 3, &acc.device()),
        ..model
    };
    let err = acc
        .backward(model.loss(batch), &model)
        .unwrap_err()
        .to_string();
    assert!(err.contains("prepared with"), "{err}");
}

#[test]
fn a_second_optimizer_for_the_same_model_is_an_error_not_a_silent_no_op() {
    let acc = Accelerator::<DefaultBackend>::builder()
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let fused = FusedOptimizer::sgd(&SgdConfig::new()).unwrap();
    let (model, _fused) = acc.prepare((Net::new(&acc.device()), fused)).unwrap();
    // Refused when prepared, before any gradient could go to the wrong one.
    let err = acc
        .prepare_optimizer(&model, SgdConfig::new().init())
        .err()
        .unwrap()
        .to_string();
    assert!(err.contains("already prepared for this model"), "{err}");
}

#[derive(Module, Debug)]
struct WithUnused {
    net: Net,
    /// Never used by the loss: it gets no gradient.
    unused: Linear,
}

/// Trains 4 updates of AdamW on `net` alone; returns `unused` before and after, and `net`.
fn train_with_unused<S: accelerate_burn::OptimizerSource>(
    optimizer: S,
) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let acc = Accelerator::<DefaultBackend>::builder()
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let device = acc.device();
    let model = WithUnused {
        net: Net::new(&device),
        unused: linear(4, 3, 9, &device),
    };
    let unused_before = values(&model.unused);
    let (mut model, mut optim) = acc.prepare((model, optimizer)).unwrap();
    for i in 0..4 {
        let batch = Rows.batch(data(96)[i * 8..(i + 1) * 8].to_vec(), &device);
        let grads = acc.backward(model.net.loss(batch), &model).unwrap();
        model = optim.step(1e-2, model, grads).unwrap();
    }
    (unused_before, values(&model.unused), values(&model.net))
}

/// A parameter without a gradient (a layer the loss does not use) keeps its value exactly, as
/// with Burn's optimizer, and the others train as with Burn's (tolerance as above).
#[test]
fn a_parameter_without_a_gradient_is_left_exactly_as_it_was() {
    let (before, after, fused) =
        train_with_unused(FusedOptimizer::adamw(&AdamWConfig::new()).unwrap());
    assert_eq!(before, after);
    let (_, _, burn) = train_with_unused(AdamWConfig::new().init());
    let worst = fused
        .iter()
        .zip(&burn)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0f32, f32::max);
    assert!(worst <= 1e-5, "largest difference {worst}");
    assert_ne!(
        fused,
        values(&Net::new(&Device::default())),
        "nothing trained"
    );
}
