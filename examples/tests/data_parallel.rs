//! Data-parallel training with real processes on 127.0.0.1: the digits MLP trained on 2 and 3
//! processes ends where 1 process given the same global batches ends; evaluation gathers
//! exactly the data set's samples; processes that built different models are told so.
//!
//! The test binary starts copies of itself as the ranks (the `child` test, which does nothing
//! unless `ACCELERATE_TEST_CHILD` names a scenario).

mod common;
#[path = "../../tests-support/netns.rs"]
mod netns;
#[path = "../../tests-support/slurm.rs"]
mod slurm_cluster;
#[path = "../../tests-support/tools.rs"]
mod tools;

use accelerate_burn::burn;
use accelerate_burn::metrics::MeanMetric;
use accelerate_burn::{
    AccelerateError, Accelerator, AcceleratorBackend, DataLoader, DefaultBackend, FusedOptimizer,
    MixedPrecision, Reduction, ScalerConfig,
};
use accelerate_core::memory_estimate::MemoryEstimate;
use accelerate_examples::digits::{self, DigitBatcher};
use accelerate_examples::{Mlp, MlpConfig};
use anyhow::Context;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::module::Module;
use burn::optim::{AdamWConfig, SgdConfig};
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{Device, Int, Tensor, TensorData};
use common::{
    env_number, largest_difference, line, param_bits, param_bits_in, parameters, params,
    params_labelled, print_params, print_params_as, run, run_child,
};
use slurm_cluster::SlurmCluster;

/// Samples trained on: divisible by the global batch of every world size tested (8 x 1, 2, 3).
const SAMPLES: usize = 240;
const PER_RANK_BATCH: usize = 8;

/// The default backend with our device kernels turned off: on wgpu and cuda, the host path
/// that the device path must equal.
struct HostKernels;

impl AcceleratorBackend for HostKernels {
    const NAME: &'static str = DefaultBackend::NAME;

    fn device(local_rank: usize) -> Result<Device, AccelerateError> {
        DefaultBackend::device(local_rank)
    }
}

fn precision(name: &str) -> MixedPrecision {
    match std::env::var(name).as_deref() {
        Ok("bf16") => MixedPrecision::Bf16,
        Ok("fp16") => MixedPrecision::Fp16,
        _ => MixedPrecision::No,
    }
}

/// Trains the digits MLP for 2 epochs with SGD; batch `TEST_BATCH` per process, gradients
/// sent in `TEST_WIRE` precision, loss scaling with `TEST_MIXED=fp16` (the forward pass stays
/// f32, so only the scaling differs).
fn train<B: AcceleratorBackend>() -> anyhow::Result<()> {
    let acc = Accelerator::<B>::builder()
        .seed(7)
        .gradient_accumulation_steps(env_number::<usize>("TEST_ACCUMULATION").max(1))
        .gradient_communication(precision("TEST_WIRE"))
        .mixed_precision(precision("TEST_MIXED"))
        .loss_scaler(ScalerConfig {
            init_scale: 1024.0,
            ..ScalerConfig::default()
        })
        .build()?;
    println!("FORMED {}", acc.transport());
    println!("FUSION {}", accelerate_burn::backend::fusion::active());
    let hidden = if env_number::<usize>("TEST_ODD_MODEL") == acc.process_index() + 1 {
        33
    } else {
        32
    };
    let model = MlpConfig::new(digits::PIXELS, vec![hidden], digits::CLASSES).init(&acc.device());
    let data: Vec<_> = digits::load()?.into_iter().take(SAMPLES).collect();
    let train = DataLoader::builder(DigitBatcher)
        .batch_size(env_number::<usize>("TEST_BATCH"))
        .shuffle(3)
        .build(InMemDataset::new(data));
    let (mut model, mut optim, train) = acc.prepare((model, SgdConfig::new().init(), train))?;
    for epoch in 0..2 {
        train.set_epoch(epoch);
        for batch in train.iter() {
            let batch = batch?;
            let loss = model.forward_loss(batch.images, batch.targets).loss;
            let grads = acc.backward(loss, &model)?;
            model = optim.step(0.05, model, grads)?;
        }
    }
    println!("UPDATES {}", optim.updates());
    print_params(&model);
    Ok(())
}

/// Trains the digits MLP for 2 epochs with a fused AdamW (ZeRO stage `TEST_ZERO`; at stage 3
/// the MLP is one sharded unit, and `TEST_OPTIM=burn` steps Burn's AdamW instead), gradient
/// accumulation 2 and clipping at 1.0; batch `TEST_BATCH` per process, gradients sent in
/// `TEST_WIRE` precision, the forward pass in `TEST_AUTOCAST` precision.
fn fused() -> anyhow::Result<()> {
    let stage = env_number::<usize>("TEST_ZERO") as u8;
    let acc = Accelerator::<DefaultBackend>::builder()
        .seed(7)
        .gradient_accumulation_steps(2)
        .zero_stage(stage)
        .gradient_communication(precision("TEST_WIRE"))
        .mixed_precision(precision("TEST_AUTOCAST"))
        .build()?;
    println!("FORMED {}", acc.transport());
    println!(
        "SHARD_GROUP {} {}",
        acc.shard_group_size(),
        acc.shard_transport()
    );
    println!("FUSION {}", accelerate_burn::backend::fusion::active());
    let model = MlpConfig::new(digits::PIXELS, vec![32], digits::CLASSES).init(&acc.device());
    if stage != 3 {
        return train_fused(&acc, model, Mlp::clone).map(drop);
    }
    let sharded = train_fused(&acc, acc.shard(model)?, |m| m.gather())?;
    println!("GATHERS {}", acc.sharded_gathers());
    let [.., zero3] = acc.memory_estimates(&sharded, 2);
    println!("UNIT {}", zero3.largest_unit);
    // The trained model's weights, whole, as plain Burn and the hub read them, and its
    // logits on a probe for the reader to compare.
    if let Ok(dir) = std::env::var("TEST_WEIGHTS") {
        let dir = std::path::Path::new(&dir);
        acc.save_model(&sharded, dir)?;
        acc.save_model_sharded(&sharded, dir.join("sharded"), 4096)?;
        let logits = sharded.gather().forward(probe(&acc.device()));
        print_tensor("LOGITS", logits);
        // Read back into another sharded MLP: each rank reads its shards of the file.
        let fresh = MlpConfig::new(digits::PIXELS, vec![32], digits::CLASSES).init(&acc.device());
        let loaded = acc.load_model(acc.shard(fresh)?, dir)?;
        print_params_as("LOADED", &loaded.gather());
    }
    Ok(())
}

/// A trunk and two heads, the head chosen by the data: even digits go through `even`, odd
/// ones through `odd`. A batch of one parity leaves the other head out of backward (no
/// gradient at all, not a zero one), as an expert or a task head chosen by the data would.
#[derive(Module, Debug)]
struct TwoHeads {
    trunk: burn::nn::Linear,
    even: burn::nn::Linear,
    odd: burn::nn::Linear,
}

impl TwoHeads {
    fn new(device: &Device) -> Self {
        let linear = |inputs, outputs| burn::nn::LinearConfig::new(inputs, outputs).init(device);
        Self {
            trunk: linear(digits::PIXELS, 16),
            even: linear(16, digits::CLASSES),
            odd: linear(16, digits::CLASSES),
        }
    }

    /// The mean cross-entropy over the batch, each row scored by its parity's head; a head
    /// no row chose is not called.
    fn loss(&self, images: Tensor<2>, targets: Tensor<1, Int>) -> Tensor<1> {
        let device = images.device();
        let features = burn::tensor::activation::relu(self.trunk.forward(images));
        let labels: Vec<i64> = targets.clone().into_data().iter::<i64>().collect();
        let mut sum: Option<Tensor<1>> = None;
        for (head, parity) in [(&self.even, 0), (&self.odd, 1)] {
            let rows: Vec<i64> = (0..labels.len() as i64)
                .filter(|&row| labels[row as usize] % 2 == parity)
                .collect();
            if rows.is_empty() {
                continue;
            }
            let count = rows.len();
            let rows = Tensor::<1, Int>::from_data(TensorData::new(rows, [count]), &device);
            let logits = head.forward(features.clone().select(0, rows.clone()));
            let mean = burn::nn::loss::CrossEntropyLossConfig::new()
                .init(&device)
                .forward(logits, targets.clone().select(0, rows));
            let part = mean * count as f32;
            sum = Some(match sum {
                Some(sum) => sum + part,
                None => part,
            });
        }
        sum.map_or_else(
            || Tensor::zeros([1], &device),
            |sum| sum / labels.len() as f32,
        )
    }
}

/// [`TwoHeads`] trained with a fused optimizer (`TEST_OPTIM`: `adamw` or `sgd` with momentum)
/// at ZeRO stage `TEST_ZERO`, accumulation 2, clipping at 1.0, batch `TEST_BATCH` per process,
/// on 320 digits in blocks of `TEST_BLOCK` even ones then `TEST_BLOCK` odd ones, in order: on 2
/// processes with batch `TEST_BLOCK`, rank 0 only ever sees even digits and rank 1 odd ones.
fn heads() -> anyhow::Result<()> {
    let acc = Accelerator::<DefaultBackend>::builder()
        .seed(7)
        .gradient_accumulation_steps(2)
        .zero_stage(env_number::<usize>("TEST_ZERO") as u8)
        .build()?;
    let block = env_number::<usize>("TEST_BLOCK");
    let digits = digits::load()?;
    let (even, odd): (Vec<_>, Vec<_>) = digits.into_iter().partition(|d| d.label % 2 == 0);
    let mut data = Vec::new();
    for (evens, odds) in even
        .chunks_exact(block)
        .zip(odd.chunks_exact(block))
        .take(320 / (2 * block))
    {
        data.extend_from_slice(evens);
        data.extend_from_slice(odds);
    }
    let train = DataLoader::builder(DigitBatcher)
        .batch_size(env_number::<usize>("TEST_BATCH"))
        .build(InMemDataset::new(data));
    let model = TwoHeads::new(&acc.device());
    let (mut model, mut optim, train) = match std::env::var("TEST_OPTIM").as_deref() {
        // Burn's own AdamW, its gradients averaged by the accelerator's pipe.
        Ok("burn") => acc.prepare((
            model,
            AdamWConfig::new().with_weight_decay(0.01).init(),
            train,
        ))?,
        Ok("sgd") => {
            let momentum = burn::optim::momentum::MomentumConfig::new();
            let sgd = FusedOptimizer::sgd(&SgdConfig::new().with_momentum(Some(momentum)))?;
            acc.prepare((model, sgd, train))?
        }
        _ => {
            let adamw = FusedOptimizer::adamw(&AdamWConfig::new().with_weight_decay(0.01))?;
            acc.prepare((model, adamw, train))?
        }
    };
    for epoch in 0..2 {
        train.set_epoch(epoch);
        for batch in train.iter() {
            let batch = batch?;
            let loss = model.loss(batch.images, batch.targets);
            let mut grads = acc.backward(loss, &model)?;
            acc.clip_grad_norm(&model, &mut grads, 1.0)?;
            model = optim.step(3e-3, model, grads)?;
        }
    }
    println!("UPDATES {}", optim.updates());
    print_params(&model);
    Ok(())
}

/// Casts every float parameter it maps to f64.
struct ToF64;

impl burn::module::ModuleMapper for ToF64 {
    fn map_float<const D: usize>(
        &mut self,
        param: burn::module::Param<Tensor<D>>,
    ) -> burn::module::Param<Tensor<D>> {
        param.map(|tensor| tensor.cast(burn::tensor::FloatDType::F64))
    }
}

/// One ZeRO-3 step of the digits MLP where rank 1's shards are f64, which a gather cannot
/// send (a local failure, as a read error would be): prints `BACKWARD <error>`.
fn bad_shard() -> anyhow::Result<()> {
    let acc = Accelerator::<DefaultBackend>::builder()
        .seed(7)
        .zero_stage(3)
        .build()?;
    let device = acc.device();
    let model =
        acc.shard(MlpConfig::new(digits::PIXELS, vec![32], digits::CLASSES).init(&device))?;
    let odd = acc.process_index() == 1;
    let model = if odd { model.map(&mut ToF64) } else { model };
    let (model, _optim) = acc.prepare((model, SgdConfig::new().init()))?;
    let mut images = probe(&device);
    if odd {
        images = images.cast(burn::tensor::FloatDType::F64);
    }
    let targets = Tensor::<1, Int>::zeros([8], &device);
    let loss = model.gather().forward_loss(images, targets).loss;
    match acc.backward(loss, &model) {
        Ok(_) => println!("BACKWARD ok"),
        Err(e) => println!("BACKWARD {e}"),
    }
    Ok(())
}

/// A fixed batch of 8 inputs for the digits MLP.
fn probe(device: &Device) -> Tensor<2> {
    let values: Vec<f32> = (0..8 * digits::PIXELS)
        .map(|i| (i * 7 % 17) as f32 / 17.0)
        .collect();
    Tensor::from_data(TensorData::new(values, [8, digits::PIXELS]), device)
}

/// Prints `tensor`'s values as hex bit patterns on a line starting with `label`.
fn print_tensor(label: &str, tensor: Tensor<2>) {
    let bits: Vec<String> = tensor
        .into_data()
        .iter::<f32>()
        .map(|v| format!("{:08x}", v.to_bits()))
        .collect();
    println!("{label} {}", bits.join(","));
}

/// The loop of [`fused`] for a model `whole` turns into the MLP (a collective at stage 3).
fn train_fused<M: Module>(
    acc: &Accelerator<DefaultBackend>,
    model: M,
    whole: impl Fn(&M) -> Mlp,
) -> anyhow::Result<M> {
    let data: Vec<_> = digits::load()?.into_iter().take(SAMPLES).collect();
    let train = DataLoader::builder(DigitBatcher)
        .batch_size(env_number::<usize>("TEST_BATCH"))
        .shuffle(3)
        .build(InMemDataset::new(data));
    let config = AdamWConfig::new().with_weight_decay(0.01);
    let (mut model, mut optim, train) = if std::env::var("TEST_OPTIM").as_deref() == Ok("burn") {
        acc.prepare((model, config.init(), train))?
    } else {
        acc.prepare((model, FusedOptimizer::adamw(&config)?, train))?
    };
    for epoch in 0..2 {
        train.set_epoch(epoch);
        for batch in train.iter() {
            let batch = batch?;
            let loss = acc
                .autocast(&model, |m, c| {
                    whole(m).forward_loss(c.input(batch.images), batch.targets)
                })
                .loss;
            let mut grads = acc.backward(loss, &model)?;
            acc.clip_grad_norm(&model, &mut grads, 1.0)?;
            model = optim.step(3e-3, model, grads)?;
        }
    }
    println!("UPDATES {}", optim.updates());
    println!("STATE_BYTES {}", optim.state_bytes().unwrap_or(0));
    println!("ON_DEVICE {}", optim.state_on_device().unwrap_or(false));
    let held = optim.held_bytes().unwrap_or_default();
    println!(
        "HELD {} {} {}",
        held.master_parameters, held.gradients, held.optimizer_state
    );
    print_params(&whole(&model));
    Ok(model)
}

/// fp16 training where rank 1's loss is infinite at step 3: every rank must skip exactly that
/// step, leave parameters and optimizer state untouched, and halve the loss scale.
fn overflow() -> anyhow::Result<()> {
    let acc = Accelerator::<DefaultBackend>::builder()
        .seed(7)
        .mixed_precision(MixedPrecision::Fp16)
        // Small enough that no step overflows by itself (65,536 does on the first steps).
        .loss_scaler(ScalerConfig {
            init_scale: 256.0,
            ..ScalerConfig::default()
        })
        .build()?;
    let model = MlpConfig::new(digits::PIXELS, vec![32], digits::CLASSES).init(&acc.device());
    let data: Vec<_> = digits::load()?.into_iter().take(SAMPLES).collect();
    let train = DataLoader::builder(DigitBatcher)
        .batch_size(PER_RANK_BATCH)
        .shuffle(3)
        .build(InMemDataset::new(data));
    let (mut model, mut optim, train) = acc.prepare((model, AdamWConfig::new().init(), train))?;
    for (step, batch) in train.iter().enumerate().take(6) {
        let batch = batch?;
        let mut loss = acc
            .autocast(&model, |m, c| {
                m.forward_loss(c.input(batch.images), batch.targets)
            })
            .loss;
        if step == 3 && acc.process_index() == 1 {
            loss = loss.mul_scalar(f32::INFINITY);
        }
        let (params_before, state_before, scale_before) = (
            parameters(&model),
            optim
                .inner()
                .context("a Burn optimizer")?
                .into_bytes()?
                .to_vec(),
            acc.loss_scale().unwrap_or(0.0),
        );
        let grads = acc.backward(loss, &model)?;
        model = optim.step(1e-3, model, grads)?;
        let skipped = acc.optimizer_step_was_skipped();
        println!("STEP {step} skipped {skipped}");
        if step == 3 {
            let unchanged = parameters(&model) == params_before
                && optim
                    .inner()
                    .context("a Burn optimizer")?
                    .into_bytes()?
                    .to_vec()
                    == state_before;
            println!("UNCHANGED {unchanged}");
            println!(
                "SCALE {scale_before} -> {}",
                acc.loss_scale().unwrap_or(0.0)
            );
        }
    }
    println!("UPDATES {}", optim.updates());
    Ok(())
}

/// Micro-batch sizes of the token-weighting scenario, per rank, per window: very uneven, and
/// 60 samples per window in total.
const UNEVEN: [[usize; 2]; 2] = [[2, 30], [20, 8]];

/// Three windows of SGD on the digits MLP, the samples of each window spread over the ranks'
/// micro-batches as [`UNEVEN`] says (one process, no accumulation: each window's 60 samples
/// as one batch); `TEST_SUMMED=1` hands `backward_sum` each micro-batch's summed loss and
/// sample count, else `backward` gets the micro-batch mean.
fn uneven() -> anyhow::Result<()> {
    let acc = Accelerator::<DefaultBackend>::builder()
        .seed(7)
        .gradient_accumulation_steps(if acc_world() == 1 { 1 } else { 2 })
        .build()?;
    let world = acc.num_processes();
    let model = MlpConfig::new(digits::PIXELS, vec![32], digits::CLASSES).init(&acc.device());
    let (mut model, mut optim) = acc.prepare((model, SgdConfig::new().init()))?;
    // A second model with its own (fused) optimizer, stepped after the first on every
    // micro-batch: its windows and its reduction are its own.
    let second = MlpConfig::new(digits::PIXELS, vec![16], digits::CLASSES).init(&acc.device());
    let (mut second, mut second_optim) = acc.prepare((second, AdamWConfig::new()))?;
    let data = digits::load()?;
    let summed = env_number::<usize>("TEST_SUMMED") == 1;
    for window in 0..3 {
        let mut start = window * 60;
        let mut parts: Vec<(usize, usize)> = Vec::new();
        for (rank, sizes) in UNEVEN.iter().enumerate() {
            for &size in sizes {
                if world == 1 || rank == acc.process_index() {
                    parts.push((start, size));
                }
                start += size;
            }
        }
        if world == 1 {
            parts = vec![(window * 60, 60)];
        }
        for (start, size) in parts {
            let batch = DigitBatcher.batch(data[start..start + size].to_vec(), &acc.device());
            let backward = |loss: Tensor<1>, model: &Mlp| {
                if summed {
                    acc.backward_sum(loss.mul_scalar(size as f64), size as u64, model)
                } else {
                    acc.backward(loss, model)
                }
            };
            let loss = model.forward_loss(batch.images.clone(), batch.targets.clone());
            let grads = backward(loss.loss, &model)?;
            model = optim.step(0.1, model, grads)?;
            let loss = second.forward_loss(batch.images, batch.targets);
            let grads = backward(loss.loss, &second)?;
            second = second_optim.step(1e-3, second, grads)?;
        }
    }
    println!("UPDATES {} {}", optim.updates(), second_optim.updates());
    print_params(&model);
    print_params_as("SECOND", &second);
    Ok(())
}

fn acc_world() -> usize {
    env_number::<usize>("WORLD_SIZE").max(1)
}

/// Indices as a batch, to see which samples each process evaluated.
#[derive(Clone)]
struct Indices;

impl Batcher<usize, Tensor<1, Int>> for Indices {
    fn batch(&self, items: Vec<usize>, device: &Device) -> Tensor<1, Int> {
        let n = items.len();
        let values: Vec<i64> = items.into_iter().map(|i| i as i64).collect();
        Tensor::from_data(TensorData::new(values, [n]), device)
    }
}

/// Evaluates 10 samples in batches of 4 and prints what `gather_for_metrics` returned, plus
/// the answers of the other cross-process helpers.
fn evaluate() -> anyhow::Result<()> {
    let acc = Accelerator::<DefaultBackend>::from_env()?;
    let eval = DataLoader::builder(Indices)
        .batch_size(4)
        .build(InMemDataset::new((0..10).collect::<Vec<usize>>()));
    let eval = acc.prepare_eval_data_loader(eval)?;
    let mut seen = Vec::new();
    let mut mean = MeanMetric::new();
    for batch in eval.iter() {
        let batch = batch?;
        mean.update(&acc, batch.clone().float())?;
        let gathered = acc.gather_for_metrics(batch)?;
        seen.extend(gathered.into_data().iter::<i64>());
    }
    let mean = mean.compute(&acc)?;
    println!("METRIC {} over {}", mean.value, mean.weight);
    let seen: Vec<String> = seen.iter().map(i64::to_string).collect();
    println!("GATHERED {}", seen.join(","));
    let rank = acc.process_index() as f32;
    let total = acc.reduce(
        Tensor::<1>::from_floats([rank, 1.0], &acc.device()),
        Reduction::Sum,
    )?;
    println!(
        "REDUCED {:?}",
        total.into_data().iter::<f32>().collect::<Vec<_>>()
    );
    let share = acc.split_between_processes(&(0..7).collect::<Vec<u32>>());
    println!("SHARE {share:?}");
    if acc.process_index() == 1 {
        acc.set_trigger();
    }
    println!("TRIGGER {}", acc.check_trigger()?);
    println!("TRIGGER AGAIN {}", acc.check_trigger()?);
    let ragged = Tensor::<1>::ones([acc.process_index() + 1], &acc.device());
    let padded = acc.pad_across_processes(ragged, 0, -1.0)?;
    println!(
        "PADDED {:?}",
        padded.into_data().iter::<f32>().collect::<Vec<_>>()
    );
    acc.wait_for_everyone()?;
    Ok(())
}

#[test]
fn child() {
    run_child(|scenario| match scenario {
        "train" if std::env::var_os("TEST_HOST_KERNELS").is_some() => train::<HostKernels>(),
        "train" => train::<DefaultBackend>(),
        "fused" => fused(),
        "evaluate" => evaluate(),
        "overflow" => overflow(),
        "uneven" => uneven(),
        "heads" => heads(),
        "bad_shard" => bad_shard(),
        other => anyhow::bail!("unknown scenario {other}"),
    });
}

/// Tolerance 1e-6: a rank's gradient is the mean over its batch, and the all-reduce averages
/// those means, which is the mean over the global batch in another summation order. Only the
/// rounding differs; after 30-60 SGD updates the largest parameter difference seen was
/// 1.5e-8 (2 processes, no accumulation).
#[test]
fn two_and_three_processes_learn_what_one_learns_from_the_same_global_batches() {
    for accumulation in [1usize, 2] {
        for world in [2usize, 3] {
            let acc = accumulation.to_string();
            let single = run(
                "train",
                1,
                &[
                    ("TEST_BATCH", (PER_RANK_BATCH * world).to_string()),
                    ("TEST_ACCUMULATION", acc.clone()),
                ],
            );
            let reference = params(&single[0]);
            let updates = line(&single[0], "UPDATES ");
            let ranks = run(
                "train",
                world,
                &[
                    ("TEST_BATCH", PER_RANK_BATCH.to_string()),
                    ("TEST_ACCUMULATION", acc.clone()),
                ],
            );
            for (rank, output) in ranks.iter().enumerate() {
                assert_eq!(line(output, "UPDATES "), updates, "rank {rank}");
                let worst = largest_difference(&params(output), &reference);
                assert!(
                    worst <= 1e-6,
                    "world {world}, accumulation {accumulation}, rank {rank}: largest difference {worst}"
                );
            }
            // Every rank holds the same parameters, bit for bit.
            assert!(
                ranks
                    .windows(2)
                    .all(|w| param_bits(&w[0]) == param_bits(&w[1]))
            );
        }
    }
}

/// Two hosts (network namespaces with their own addresses and host names, one Slurm node
/// each) x 2 processes, started by a real `srun` that only knows the node list: the four
/// ranks, two talking over the veth link, learn what one process learns from the same global
/// batches, within the same 1e-6 as on one host, and agree bit for bit.
#[test]
fn four_processes_on_two_hosts_under_srun_learn_what_one_learns() {
    if !tools::slurm_ready() {
        return;
    }
    // 240 samples: 10 global batches of 4 x 6.
    let per_rank = 6;
    let single = run("train", 1, &[("TEST_BATCH", (per_rank * 4).to_string())]);

    let id = std::process::id();
    let subnet = format!("10.{}.{}", 150 + id % 50, id / 50 % 250);
    let nodes: Vec<String> = (0..2)
        .map(|m| format!("accrs-dp-{m}=accrs-dp-{id}-{m}={subnet}.{}", m + 1))
        .collect();
    // The script creates the two namespaces and removes them when the cluster stops.
    let cluster = SlurmCluster::start(2, &nodes);
    let mut srun = cluster.srun(2, 2);
    srun.arg("--output").arg(cluster.path("rank-%t.out"));
    let out = common::as_ranks(&mut srun, "train")
        .env("TEST_BATCH", per_rank.to_string())
        .env("ACCELERATE_JOB_TOKEN", format!("dp-slurm-{id}"))
        .env("ACCELERATE_RENDEZVOUS_TIMEOUT", "60")
        .output()
        .unwrap();
    let logs: Vec<String> = (0..4)
        .map(|rank| {
            std::fs::read_to_string(cluster.path(&format!("rank-{rank}.out"))).unwrap_or_default()
        })
        .collect();
    assert_ranks_learned(&out, &logs, "FORMED tcp+shm", &single[0]);
}

/// Checks a job of ranks on two hosts against `single`, the one-process run on the same global
/// batches: the launcher `out` succeeded, each rank's log (`logs`) says `formed` and made the
/// same number of updates, every parameter is within 1e-6, and the ranks agree bit for bit.
fn assert_ranks_learned(
    out: &std::process::Output,
    logs: &[String],
    formed: &str,
    single: &std::process::Output,
) {
    assert!(
        out.status.success(),
        "{}\n{}\n{logs:#?}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let reference = params(single);
    let updates = line(single, "UPDATES ");
    let bits: Vec<Vec<u32>> = logs.iter().map(|log| param_bits_in(log)).collect();
    for (rank, log) in logs.iter().enumerate() {
        assert!(log.contains(formed), "rank {rank}: {log}");
        assert!(
            log.contains(&format!("UPDATES {updates}")),
            "rank {rank}: {log}"
        );
        let ours: Vec<f32> = bits[rank].iter().map(|b| f32::from_bits(*b)).collect();
        let worst = largest_difference(&ours, &reference);
        eprintln!("rank {rank} on its host: largest difference from one process {worst:e}");
        assert!(worst <= 1e-6, "rank {rank}: largest difference {worst}");
    }
    assert!(bits.windows(2).all(|w| w[0] == w[1]), "ranks differ");
}

#[test]
fn evaluation_gathers_every_sample_once_in_order() {
    let outputs = run("evaluate", 3, &[]);
    for (rank, output) in outputs.iter().enumerate() {
        assert!(
            output.status.success(),
            "rank {rank}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        // 10 samples, rounds of 12: the last round repeats 2 samples, which are dropped.
        assert_eq!(
            line(output, "GATHERED "),
            "0,1,2,3,4,5,6,7,8,9",
            "rank {rank}"
        );
        // The metric adds each process's batches without the repeated samples.
        assert_eq!(line(output, "METRIC "), "4.5 over 10");
        assert_eq!(line(output, "REDUCED "), "[3.0, 3.0]");
        assert_eq!(line(output, "TRIGGER "), "true");
        assert_eq!(line(output, "TRIGGER AGAIN "), "false");
        let padded = format!(
            "{:?}",
            (0..3)
                .map(|i| if i <= rank { 1.0 } else { -1.0 })
                .collect::<Vec<f32>>()
        );
        assert_eq!(line(output, "PADDED "), padded);
    }
    let shares: Vec<String> = outputs.iter().map(|o| line(o, "SHARE ")).collect();
    assert_eq!(shares, ["[0, 1, 2]", "[3, 4]", "[5, 6]"]);
}

/// Tolerance 1e-6 (the sums and the division happen in another order than in one batch's
/// mean; 1.5e-8 observed): two processes whose micro-batches hold 2 and 30, and 20 and 8
/// samples, with `backward_sum`, learn what one process learns from the 60 samples of each
/// window at once. With per-micro-batch means they do not (9.6e-3 away observed). A second
/// model with its own fused optimizer, stepped after the first on each micro-batch, keeps its
/// own windows and learns alike (2.2e-8 observed).
#[test]
fn summed_losses_over_uneven_micro_batches_on_two_processes_equal_one_big_batch() {
    let single = &run("uneven", 1, &[])[0];
    let (reference, second) = (params(single), params_labelled(single, "SECOND"));
    let summed = run("uneven", 2, &[("TEST_SUMMED", "1".to_string())]);
    let means = run("uneven", 2, &[]);
    for rank in 0..2 {
        assert_eq!(line(&summed[rank], "UPDATES "), "3 3", "rank {rank}");
        let worst = largest_difference(&params(&summed[rank]), &reference);
        assert!(worst <= 1e-6, "rank {rank}: largest difference {worst}");
        let worst = largest_difference(&params_labelled(&summed[rank], "SECOND"), &second);
        assert!(
            worst <= 1e-6,
            "rank {rank}: second model's largest difference {worst}"
        );
        let biased = largest_difference(&params(&means[rank]), &reference);
        assert!(
            biased > 1e-3,
            "rank {rank}: per-micro-batch means differ by only {biased}"
        );
    }
}

#[test]
fn processes_that_built_different_models_all_fail_saying_so() {
    let outputs = run(
        "train",
        2,
        &[("TEST_BATCH", "8".into()), ("TEST_ODD_MODEL", "2".into())],
    );
    for (rank, output) in outputs.iter().enumerate() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert_eq!(output.status.code(), Some(3), "rank {rank}: {stderr}");
        let line = stderr
            .lines()
            .find(|l| l.starts_with("ERROR "))
            .unwrap_or("");
        assert!(
            line.contains("build the same model"),
            "rank {rank}: {stderr}"
        );
    }
    let rank1 = String::from_utf8_lossy(&outputs[1].stderr);
    assert!(
        rank1.contains("parameter #0 has shape [64, 33] here and [64, 32] on rank 0"),
        "{rank1}"
    );
    let rank0 = String::from_utf8_lossy(&outputs[0].stderr);
    assert!(
        rank0.contains("ranks 1 built a different model than rank 0"),
        "{rank0}"
    );
}

#[test]
fn an_overflow_on_one_rank_skips_that_step_on_both() {
    let outputs = run("overflow", 2, &[]);
    for (rank, output) in outputs.iter().enumerate() {
        assert!(
            output.status.success(),
            "rank {rank}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        for step in 0..6 {
            let skipped = line(output, &format!("STEP {step} skipped "));
            assert_eq!(skipped, (step == 3).to_string(), "rank {rank} step {step}");
        }
        assert_eq!(line(output, "UNCHANGED "), "true", "rank {rank}");
        assert_eq!(line(output, "SCALE "), "256 -> 128", "rank {rank}");
        assert_eq!(line(output, "UPDATES "), "5", "rank {rank}");
    }
}

/// Gradients sent in bf16 or fp16 (half the bytes) train close to f32 ones: parameters stay
/// within 1e-3 of the single-process f32 run after 30 updates (bf16 keeps 8 significant bits,
/// so each averaged gradient is off by up to 0.4 %; the largest difference seen was 7.9e-5).
#[test]
fn half_precision_gradient_communication_stays_close_to_f32() {
    let single = run("train", 1, &[("TEST_BATCH", "16".into())]);
    let reference = params(&single[0]);
    for wire in ["bf16", "fp16"] {
        let ranks = run(
            "train",
            2,
            &[("TEST_BATCH", "8".into()), ("TEST_WIRE", wire.into())],
        );
        let worst = largest_difference(&params(&ranks[0]), &reference);
        assert!(worst <= 1e-3, "{wire}: largest difference {worst}");
        assert!(
            worst > 0.0,
            "{wire}: the gradients did not travel in half precision"
        );
        assert_eq!(
            param_bits(&ranks[1]),
            param_bits(&ranks[0]),
            "{wire}: ranks disagree"
        );
    }
}

/// The fused optimizer's flat gradients travel in bf16 or fp16 too, all-reduced (ZeRO 0) or
/// reduce-scattered (ZeRO 1): parameters stay within 1e-3 of the single-process f32 run (the
/// same bound as with Burn's optimizer above; Adam normalises each step, so a gradient off by
/// 0.4 % moves a parameter by at most that share of the learning rate), differ from it (the
/// halves really travelled), and agree bit for bit across ranks.
#[test]
fn half_precision_gradient_communication_works_with_the_fused_optimizer() {
    let single = run(
        "fused",
        1,
        &[
            ("TEST_BATCH", (2 * PER_RANK_BATCH).to_string()),
            ("TEST_ZERO", "0".into()),
        ],
    );
    assert!(
        single[0].status.success(),
        "{}",
        String::from_utf8_lossy(&single[0].stderr)
    );
    let reference = params(&single[0]);
    for (wire, zero) in [("bf16", "0"), ("fp16", "0"), ("bf16", "1")] {
        let ranks = run(
            "fused",
            2,
            &[
                ("TEST_BATCH", PER_RANK_BATCH.to_string()),
                ("TEST_ZERO", zero.into()),
                ("TEST_WIRE", wire.into()),
            ],
        );
        for (rank, output) in ranks.iter().enumerate() {
            assert!(
                output.status.success(),
                "{wire}, zero {zero}, rank {rank}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let worst = largest_difference(&params(&ranks[0]), &reference);
        eprintln!("fused, {wire} wire, ZeRO {zero}: largest difference {worst:e}");
        assert!(
            worst <= 1e-3,
            "{wire}, zero {zero}: largest difference {worst}"
        );
        assert!(
            worst > 0.0,
            "{wire}, zero {zero}: the gradients did not travel in half precision"
        );
        assert_eq!(
            param_bits(&ranks[1]),
            param_bits(&ranks[0]),
            "{wire}, zero {zero}: ranks disagree"
        );
    }
}

/// On wgpu and cuda, half-precision gradient buckets are narrowed, widened and unscaled by our
/// cubecl kernels on the device; the parameters after 30 updates on 2 processes must equal,
/// bit for bit, those of the host path (the same backend with the device kernels turned off),
/// with bf16 and fp16 on the wire and with fp16 loss scaling. (On the CPU backends both runs
/// take the host path, so the test exists only in builds with a GPU backend: CI runs it on
/// wgpu over lavapipe.)
#[cfg(any(feature = "wgpu-backend", feature = "cuda-backend"))]
#[test]
fn device_kernels_average_half_precision_gradients_exactly_like_the_host() {
    for (wire, mixed) in [("bf16", "no"), ("fp16", "no"), ("fp16", "fp16")] {
        let env = |host: bool| {
            let mut env = vec![
                ("TEST_BATCH", "8".to_string()),
                ("TEST_WIRE", wire.to_string()),
                ("TEST_MIXED", mixed.to_string()),
            ];
            if host {
                env.push(("TEST_HOST_KERNELS", "1".to_string()));
            }
            env
        };
        let device = run("train", 2, &env(false));
        let host = run("train", 2, &env(true));
        assert_eq!(
            param_bits(&device[0]),
            param_bits(&host[0]),
            "wire {wire}, mixed {mixed}"
        );
        assert_eq!(
            line(&device[0], "UPDATES "),
            "30",
            "wire {wire}, mixed {mixed}"
        );
    }
}

/// Burn's kernel fusion (on in the `wgpu` and `cuda` builds, as a plain Burn user has it)
/// against the same build with its fusers taken out (`ACCELERATE_FUSION=false`): 30 updates
/// of Burn's SGD on 1 process with fp16 loss scaling (our unscale-and-check kernel), and the
/// fused AdamW with ZeRO-1, accumulation, clipping and bf16 gradients on the wire (our
/// narrowing, widening and update kernels) on 2 processes. Our kernels are the same in both
/// runs, Burn's are not: its fused kernels (element-wise chains, reductions fused into their
/// inputs) round in places the separate ones do not, so the parameters agree within 1e-6
/// (observed on lavapipe: 1.5e-8 after 30 SGD updates), and ranks agree bit for bit.
#[cfg(all(
    feature = "fusion",
    any(feature = "wgpu-backend", feature = "cuda-backend")
))]
#[test]
fn fusion_on_and_off_train_to_the_same_parameters() {
    type Case = (&'static str, usize, Vec<(&'static str, String)>);
    let cases: [Case; 2] = [
        (
            "train",
            1,
            vec![
                ("TEST_BATCH", (2 * PER_RANK_BATCH).to_string()),
                ("TEST_MIXED", "fp16".into()),
            ],
        ),
        (
            "fused",
            2,
            vec![
                ("TEST_BATCH", PER_RANK_BATCH.to_string()),
                ("TEST_ZERO", "1".into()),
                ("TEST_WIRE", "bf16".into()),
            ],
        ),
    ];
    for (scenario, world, env) in cases {
        let outcome = |on: bool| {
            let mut env = env.clone();
            env.push(("ACCELERATE_FUSION", on.to_string()));
            let ranks = run(scenario, world, &env);
            for (rank, output) in ranks.iter().enumerate() {
                assert!(
                    output.status.success(),
                    "{scenario}, fusion {on}, rank {rank}: {}",
                    String::from_utf8_lossy(&output.stderr)
                );
                assert_eq!(line(output, "FUSION "), on.to_string(), "{scenario}");
                assert_eq!(
                    param_bits(output),
                    param_bits(&ranks[0]),
                    "{scenario}, fusion {on}: rank {rank} disagrees with rank 0"
                );
            }
            ranks
        };
        let (on, off) = (outcome(true), outcome(false));
        if scenario == "train" {
            assert_eq!(line(&on[0], "UPDATES "), "30", "{scenario}");
        }
        let worst = largest_difference(&params(&on[0]), &params(&off[0]));
        eprintln!("{scenario}: fusion on against off, largest difference {worst:e}");
        assert!(worst <= 1e-6, "{scenario}: largest difference {worst}");
    }
}

/// A parameter that only some ranks' batches reach: rank 0 sees even digits only and trains
/// one head, rank 1 odd digits and the other. The fused optimizers (AdamW and SGD with
/// momentum) at ZeRO 0, 1 and 2, and Burn's AdamW (whose gradients the accelerator's pipe
/// averages, a head's with the other rank's zeros), on 2 processes end where 1 process ends on
/// the same global batches (both heads in every batch), within the 1e-6 of the other
/// N-equals-1 tests, and the ranks hold the same bits: every rank updates both heads and counts
/// their steps alike.
#[test]
fn a_head_that_only_one_rank_uses_trains_as_on_one_process_and_ranks_agree() {
    let env = |optim: &str, zero: &str, batch: usize| {
        vec![
            ("TEST_OPTIM", optim.to_string()),
            ("TEST_ZERO", zero.to_string()),
            ("TEST_BLOCK", PER_RANK_BATCH.to_string()),
            ("TEST_BATCH", batch.to_string()),
        ]
    };
    for optim in ["adamw", "sgd", "burn"] {
        let single = run("heads", 1, &env(optim, "0", 2 * PER_RANK_BATCH));
        let reference = params(&single[0]);
        let stages: &[&str] = if optim == "burn" {
            &["0"]
        } else {
            &["0", "1", "2"]
        };
        for &zero in stages {
            let ranks = run("heads", 2, &env(optim, zero, PER_RANK_BATCH));
            for (rank, output) in ranks.iter().enumerate() {
                assert_eq!(
                    line(output, "UPDATES "),
                    line(&single[0], "UPDATES "),
                    "{optim}, zero {zero}, rank {rank}"
                );
                let worst = largest_difference(&params(output), &reference);
                assert!(
                    worst <= 1e-6,
                    "{optim}, zero {zero}, rank {rank}: largest difference {worst}"
                );
            }
            assert_eq!(
                param_bits(&ranks[0]),
                param_bits(&ranks[1]),
                "{optim}, zero {zero}: the ranks' parameters differ"
            );
        }
    }
}

/// A ZeRO-3 rank whose shard cannot be gathered (here f64, as a read error would) takes part
/// in the collective with zeros, so its peer is not left waiting for the collective's
/// timeout (which would end rank 0 with a timeout, not the cause), and both ranks' backward
/// fails naming rank 1 and the cause.
#[test]
fn a_rank_whose_gather_fails_locally_makes_every_rank_fail_naming_it() {
    let ranks = run("bad_shard", 2, &[("ACCELERATE_TIMEOUT", "120".to_string())]);
    for (rank, output) in ranks.iter().enumerate() {
        let said = line(output, "BACKWARD ");
        assert!(
            said.contains("rank 1: a sharded parameter is F64"),
            "rank {rank}: {said}"
        );
    }
}

/// ZeRO-1 on 2 and 3 processes against the unsharded fused AdamW on 1 process with the same
/// global batches (accumulation 2, clipping): the same parameters up to summation order
/// (tolerance 1e-6: averages are summed in another order, and Adam's division by sqrt(v)
/// amplifies last-bit differences; observed at most 4.8e-8 on 2 and 9.3e-8 on 3 processes),
/// the same parameters bit for bit on every rank, and 1/N of the optimizer state per rank.
#[test]
fn zero_1_on_two_and_three_processes_equals_one_unsharded_process() {
    for world in [2usize, 3] {
        assert_zero_equals_one_process(1, world, PER_RANK_BATCH, "no", "fused");
    }
}

/// ZeRO-2 (the gradients and master parameters sharded too, each micro-batch reduce-scattered
/// into the window's sum) on 2 and 4 processes against the unsharded fused AdamW on 1 process
/// with the same global batches, with accumulation 2 and global clipping: within 1e-6 (as
/// ZeRO-1; the window's sum is now taken after averaging, in another order), bit for bit
/// across ranks, 1/N of the optimizer state per rank. (4 processes take 6 samples each: 240
/// samples are 10 global batches of 24.)
#[test]
fn zero_2_on_two_and_four_processes_equals_one_unsharded_process() {
    for (world, per_rank) in [(2usize, PER_RANK_BATCH), (4, 6)] {
        assert_zero_equals_one_process(2, world, per_rank, "no", "fused");
    }
}

/// Under bf16 autocast a batch split over processes rounds its forward pass differently from
/// one batch (the loss's mean, the products' rows), so N processes are not one process
/// there, at any stage. What ZeRO-2 must not add is an error of its own: on the same N
/// processes, ZeRO-2 ends within 1e-6 of the unsharded fused optimizer (the same sums in
/// another order), with accumulation 2 and global clipping.
#[test]
fn zero_2_under_bf16_autocast_equals_the_unsharded_optimizer_on_the_same_processes() {
    for (world, per_rank) in [(2usize, PER_RANK_BATCH), (4, 6)] {
        let train = |stage: &str| {
            let ranks = run(
                "fused",
                world,
                &[
                    ("TEST_BATCH", per_rank.to_string()),
                    ("TEST_ZERO", stage.into()),
                    ("TEST_AUTOCAST", "bf16".into()),
                ],
            );
            for (rank, output) in ranks.iter().enumerate() {
                assert!(
                    output.status.success(),
                    "ZeRO-{stage}, {world} processes, rank {rank}: {}",
                    String::from_utf8_lossy(&output.stderr)
                );
            }
            ranks
        };
        let (unsharded, sharded) = (train("0"), train("2"));
        let reference = params(&unsharded[0]);
        for (rank, output) in sharded.iter().enumerate() {
            let worst = largest_difference(&params(output), &reference);
            eprintln!("bf16, ZeRO-2 against ZeRO-0, {world} processes, rank {rank}: {worst:e}");
            assert!(worst <= 1e-6, "{world} processes, rank {rank}: {worst}");
        }
        assert!(
            sharded
                .windows(2)
                .all(|w| param_bits(&w[0]) == param_bits(&w[1]))
        );
    }
}

/// ZeRO-3 (the MLP one sharded unit: each process holds 1/N of every parameter, gathers
/// them for the forward pass and again in backward, and gets its shard of the averaged
/// gradient from the gathers' reduce-scatters) on 2 and 4 processes against the unsharded
/// fused AdamW on 1 process with the same global batches, with accumulation 2 and global
/// clipping: within 1e-6, bit for bit across ranks, 1/N of master parameters, gradients and
/// optimizer state per rank. Burn's own AdamW steps the shards as well (each shard is a whole
/// parameter to it).
#[test]
fn zero_3_on_two_and_four_processes_equals_one_unsharded_process() {
    for (world, per_rank) in [(2usize, PER_RANK_BATCH), (4, 6)] {
        assert_zero_equals_one_process(3, world, per_rank, "no", "fused");
    }
    assert_zero_equals_one_process(3, 2, PER_RANK_BATCH, "no", "burn");
}

/// Hybrid sharding: 4 processes in two shard groups of 2 (each holds half of ZeRO's state,
/// and each shard's gradients are averaged across the two groups) at ZeRO-1, 2 and 3 against
/// the unsharded fused AdamW on 1 process with the same global batches: within 1e-6 (the
/// average of the groups' averages, another summation order), bit for bit across all 4
/// ranks, 1/2 of the state per rank. Burn's AdamW steps hybrid ZeRO-3's shards too.
#[test]
fn hybrid_sharding_in_groups_of_two_equals_one_unsharded_process() {
    for stage in [1, 2, 3] {
        assert_hybrid_equals_one_process(stage, (4, 2), 6, "no", "fused");
    }
    assert_hybrid_equals_one_process(3, (4, 2), 6, "no", "burn");
}

/// Hybrid sharding across two hosts (network namespaces, 2 processes on each, TCP between
/// them): with `shard_group_size` `host` each shard group is one host's processes over its
/// shared memory, where ZeRO's gathers and reduce-scatters stay; only each shard's averaged
/// gradients cross to the other host. ZeRO-2 and ZeRO-3 end within 1e-6 of one process with
/// the same global batches, bit for bit across the 4 ranks; ZeRO-3's averages across the
/// hosts, run on a thread during backward, give the same bits as run at once
/// (`overlap_communication` off).
#[test]
fn hybrid_sharding_by_host_across_two_hosts_equals_one_process() {
    let Some(hosts) = netns::TwoHosts::new("hybrid") else {
        return;
    };
    let per_rank = 6;
    let single = run(
        "fused",
        1,
        &[
            ("TEST_BATCH", (4 * per_rank).to_string()),
            ("TEST_ZERO", "0".into()),
        ],
    );
    assert!(single[0].status.success());
    let reference = params(&single[0]);
    let namespaces = [0, 0, 1, 1].map(|machine| hosts.namespaces[machine].clone());
    let mut zero_3 = Vec::new();
    for (stage, overlap) in [("2", "true"), ("3", "true"), ("3", "false")] {
        let env = [
            ("TEST_BATCH", per_rank.to_string()),
            ("TEST_ZERO", stage.to_string()),
            ("ACCELERATE_SHARD_GROUP_SIZE", "host".to_string()),
            ("ACCELERATE_OVERLAP_COMMUNICATION", overlap.to_string()),
        ];
        let ranks = common::run_on_hosts(&namespaces, &hosts.addresses[0], "fused", &env);
        for (rank, output) in ranks.iter().enumerate() {
            assert!(
                output.status.success(),
                "ZeRO-{stage}, rank {rank}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
            assert_eq!(line(output, "FORMED "), "tcp+shm", "rank {rank}");
            assert_eq!(line(output, "SHARD_GROUP "), "2 shm", "rank {rank}");
            let worst = largest_difference(&params(output), &reference);
            eprintln!("hybrid ZeRO-{stage} on 2 hosts x 2, rank {rank}: {worst:e}");
            assert!(worst <= 1e-6, "ZeRO-{stage}, rank {rank}: {worst}");
        }
        assert!(
            ranks
                .windows(2)
                .all(|w| param_bits(&w[0]) == param_bits(&w[1])),
            "ZeRO-{stage}: ranks disagree"
        );
        if stage == "3" {
            zero_3.push(param_bits(&ranks[0]));
        }
    }
    assert_eq!(
        zero_3[0], zero_3[1],
        "the replicas' thread changed the bits"
    );
    assert_eq!(
        (hosts.leftovers(0), hosts.leftovers(1)),
        (String::new(), String::new())
    );
}

/// A rank that dies while its averages across the replicas run beside backward (rank 3 aborts
/// on its replicas' thread, in the middle of a backward pass) ends the job: its replica peer
/// (rank 1) and its shard group's peer (rank 2) fail naming rank 3 as the job numbers it, and
/// every other rank fails too, none left waiting.
#[test]
fn a_rank_dying_in_hybrid_sharding_fails_every_rank_naming_it() {
    let ranks = run(
        "fused",
        4,
        &[
            ("TEST_BATCH", "6".to_string()),
            ("TEST_ZERO", "3".to_string()),
            ("ACCELERATE_SHARD_GROUP_SIZE", "2".to_string()),
            ("ACCELERATE_FAULT_REPLICAS_AT", "3:5".to_string()),
        ],
    );
    let stderr = |rank: usize| String::from_utf8_lossy(&ranks[rank].stderr).into_owned();
    assert!(
        stderr(3).contains("aborting before average 5"),
        "{}",
        stderr(3)
    );
    for (rank, output) in ranks.iter().enumerate().take(3) {
        assert_eq!(
            output.status.code(),
            Some(3),
            "rank {rank}: {}",
            stderr(rank)
        );
    }
    for rank in [1, 2] {
        eprintln!(
            "rank {rank}: {}",
            stderr(rank).trim_end().lines().last().unwrap_or("")
        );
        assert!(
            stderr(rank).contains("rank 3"),
            "rank {rank} does not name rank 3: {}",
            stderr(rank)
        );
    }
}

/// Under bf16 autocast the shards are gathered in bf16 (half the bytes) and the gradients
/// averaged in f32: ZeRO-3 ends within 1e-6 of the unsharded fused optimizer on the same
/// processes (see the ZeRO-2 test above for why not of one process).
#[test]
fn zero_3_under_bf16_autocast_equals_the_unsharded_optimizer_on_the_same_processes() {
    let train = |stage: &str| {
        let ranks = run(
            "fused",
            2,
            &[
                ("TEST_BATCH", PER_RANK_BATCH.to_string()),
                ("TEST_ZERO", stage.into()),
                ("TEST_AUTOCAST", "bf16".into()),
            ],
        );
        for (rank, output) in ranks.iter().enumerate() {
            assert!(
                output.status.success(),
                "ZeRO-{stage}, rank {rank}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        ranks
    };
    let (unsharded, sharded) = (train("0"), train("3"));
    let reference = params(&unsharded[0]);
    for (rank, output) in sharded.iter().enumerate() {
        let worst = largest_difference(&params(output), &reference);
        eprintln!("bf16, ZeRO-3 against ZeRO-0, 2 processes, rank {rank}: {worst:e}");
        assert!(worst <= 1e-6, "rank {rank}: {worst}");
    }
    assert_eq!(param_bits(&sharded[0]), param_bits(&sharded[1]));
}

/// A ZeRO-3 model trained on 2 processes is saved whole, each parameter gathered in turn:
/// plain Burn loads `save_model`'s file into the unsharded MLP with the parameters the ranks
/// gathered, bit for bit, `merge-weights` of `save_model_sharded`'s shards gives the logits
/// the sharded model gave, and `load_model` reads the file back into a sharded MLP.
#[test]
fn a_zero_3_model_saves_whole_weights_that_plain_burn_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let ranks = run(
        "fused",
        2,
        &[
            ("TEST_BATCH", PER_RANK_BATCH.to_string()),
            ("TEST_ZERO", "3".into()),
            ("TEST_WEIGHTS", tmp.path().display().to_string()),
        ],
    );
    for (rank, output) in ranks.iter().enumerate() {
        assert!(
            output.status.success(),
            "rank {rank}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
    let device = Device::default();
    let load = |path: &std::path::Path| {
        let mut mlp = MlpConfig::new(digits::PIXELS, vec![32], digits::CLASSES).init(&device);
        let mut store = SafetensorsStore::from_file(path);
        mlp.load_from(&mut store).unwrap();
        mlp
    };
    let whole = load(&tmp.path().join("model.safetensors"));
    let bits: Vec<u32> = parameters(&whole).iter().map(|v| v.to_bits()).collect();
    assert_eq!(bits, param_bits(&ranks[0]));
    for (rank, output) in ranks.iter().enumerate() {
        let loaded = params_labelled(output, "LOADED");
        let loaded: Vec<u32> = loaded.iter().map(|v| v.to_bits()).collect();
        assert_eq!(loaded, bits, "rank {rank}: load_model into a sharded model");
    }

    let sharded = tmp.path().join("sharded");
    assert!(sharded.join("model.safetensors.index.json").exists());
    let merged = tmp.path().join("merged");
    accelerate_core::weights::merge_sharded(&sharded, &merged).unwrap();
    let merged = load(&merged.join("model.safetensors"));
    let logits: Vec<String> = merged
        .forward(probe(&device))
        .into_data()
        .iter::<f32>()
        .map(|v| format!("{:08x}", v.to_bits()))
        .collect();
    assert_eq!(logits.join(","), line(&ranks[0], "LOGITS "));
}

/// ZeRO-3 across two hosts (network namespaces joined by a veth link, one process on each,
/// our TCP engine between them): the sharded MLP's gathers and reduce-scatters give, bit for
/// bit, what the same 2 processes give over shared memory on one host (two ranks: every sum
/// is a + b either way).
#[test]
fn zero_3_on_two_hosts_over_tcp_equals_shared_memory_bit_for_bit() {
    let Some(hosts) = netns::TwoHosts::new("zero3") else {
        return;
    };
    let env = vec![
        ("TEST_BATCH", PER_RANK_BATCH.to_string()),
        ("TEST_ZERO", "3".to_string()),
    ];
    let shm = run("fused", 2, &env);
    let tcp = common::run_on_hosts(&hosts.namespaces, &hosts.addresses[0], "fused", &env);
    common::assert_tcp_ranks_equal(&tcp, &shm);
    assert_eq!(
        (hosts.leftovers(0), hosts.leftovers(1)),
        (String::new(), String::new())
    );
}

/// Elements of each rank's shards of the digits MLP at ZeRO-3 over `world` processes: every
/// parameter (64x32 and 32x10 weights, 32 and 10 biases) is cut on its own, padded to whole
/// elements.
fn mlp_shard_elements(world: usize) -> usize {
    [64 * 32, 32, 32 * 10, 10]
        .iter()
        .map(|numel: &usize| numel.div_ceil(world))
        .sum()
}

/// Trains the `fused` scenario at ZeRO stage `stage` on `world` processes of `per_rank`
/// samples each, and unsharded on one process with their global batch, and asserts that they
/// agree (see the tests above); `optim` is `fused` or `burn` (Burn's AdamW: no buffers of
/// ours to count).
fn assert_zero_equals_one_process(
    stage: u8,
    world: usize,
    per_rank: usize,
    autocast: &str,
    optim: &str,
) {
    assert_hybrid_equals_one_process(stage, (world, world), per_rank, autocast, optim);
}

/// As [`assert_zero_equals_one_process`], the shards cut across groups of `group` of the
/// `world` processes (hybrid sharding, `ACCELERATE_SHARD_GROUP_SIZE`; `group == world` is
/// plain ZeRO): each process holds 1/`group` of the state.
fn assert_hybrid_equals_one_process(
    stage: u8,
    (world, group): (usize, usize),
    per_rank: usize,
    autocast: &str,
    optim: &str,
) {
    let global = (per_rank * world).to_string();
    let single = run(
        "fused",
        1,
        &[
            ("TEST_BATCH", global),
            ("TEST_ZERO", "0".into()),
            ("TEST_AUTOCAST", autocast.into()),
            ("TEST_OPTIM", optim.into()),
        ],
    );
    assert!(
        single[0].status.success(),
        "{}",
        String::from_utf8_lossy(&single[0].stderr)
    );
    let reference = params(&single[0]);
    let unsharded: usize = line(&single[0], "STATE_BYTES ").parse().unwrap();
    let counted = optim == "fused";
    // AdamW: two moments of 2,410 parameters.
    assert_eq!(unsharded, if counted { 2 * reference.len() * 4 } else { 0 });
    // The estimate is the host path's; on a GPU backend one process's buffers live on the
    // device, where the model views the master parameters and gradients last one step.
    let whole = MemoryEstimate::new(reference.len() as u64, 2, 1, 0);
    let on_device = line(&single[0], "ON_DEVICE ") == "true";
    let (master, gradients) = if on_device {
        (0, 0)
    } else {
        (whole.master_parameters, whole.gradients)
    };
    if counted {
        assert_eq!(
            line(&single[0], "HELD "),
            format!("{master} {gradients} {}", whole.optimizer_state)
        );
    }
    let ranks = run(
        "fused",
        world,
        &[
            ("TEST_BATCH", per_rank.to_string()),
            ("TEST_ZERO", stage.to_string()),
            ("TEST_AUTOCAST", autocast.into()),
            ("TEST_OPTIM", optim.into()),
            ("ACCELERATE_SHARD_GROUP_SIZE", group.to_string()),
        ],
    );
    let case = format!(
        "ZeRO-{stage}, {world} processes in shard groups of {group}, autocast {autocast}, \
         {optim} optimizer"
    );
    for (rank, output) in ranks.iter().enumerate() {
        assert!(
            output.status.success(),
            "{case}, rank {rank}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(line(output, "UPDATES "), line(&single[0], "UPDATES "));
        let worst = largest_difference(&params(output), &reference);
        eprintln!("{case}, rank {rank}: largest difference {worst:e}");
        assert!(
            worst <= 1e-6,
            "{case}, rank {rank}: largest difference {worst}"
        );
        if stage == 3 {
            // Forward gathers each of the 4 parameters once per micro-batch; backward gathers
            // again the output weight (its input is tracked): 5 per micro-batch, and 4 for
            // the parameters printed at the end.
            let micro_batches = 2 * SAMPLES / (per_rank * world);
            assert_eq!(
                line(output, "GATHERS "),
                (5 * micro_batches + 4).to_string()
            );
            // The whole MLP is one unit: whole while it runs, with its gradients.
            assert_eq!(line(output, "UNIT "), (8 * reference.len()).to_string());
        }
        if !counted {
            continue;
        }
        let bytes: usize = line(output, "STATE_BYTES ").parse().unwrap();
        // Each rank holds its shard of the padded range: 1/N of its shard group's N,
        // rounded up to whole elements (at stage 3 each parameter's own).
        let padded = reference.len().div_ceil(group) * group;
        let shard = if stage == 3 {
            4 * mlp_shard_elements(group)
        } else {
            4 * padded / group
        };
        assert_eq!(bytes, 2 * shard, "{case}, rank {rank}");
        assert!((bytes * group) as f64 <= unsharded as f64 * 1.001);
        // What the buffers keep between steps is what `estimate-memory` says: no master copy
        // (the model's f32 parameters are updated in place), no gradients under ZeRO-1 (its
        // shard is averaged inside backward's tensors, let go after the step), the shard of
        // the window's sum under ZeRO-2 (this run accumulates), and at ZeRO-3 none (the update
        // reads the shards' gradients from backward).
        // On a GPU backend ZeRO-1/2's host path keeps the master shard in host memory (the
        // model's parameters are on the device).
        let estimate = MemoryEstimate::new(reference.len() as u64, 2, group as u64, stage);
        let gpu = matches!(
            accelerate_burn::backend::enabled_backends().first(),
            Some(&"wgpu" | &"cuda")
        );
        if stage >= 1 {
            let kept = if stage == 2 { shard as u64 } else { 0 };
            assert_eq!((estimate.master_parameters, estimate.gradients), (0, kept));
            assert_eq!(estimate.optimizer_state, 2 * shard as u64);
        }
        // At ZeRO-3 a GPU backend's buffers of the shards live on the device as one process's
        // do there (the model views the master parameters).
        let (master, gradients) = match stage == 3 && line(output, "ON_DEVICE ") == "true" {
            true => (0, 0),
            false if gpu && (stage == 1 || stage == 2) => (shard as u64, estimate.gradients),
            false => (estimate.master_parameters, estimate.gradients),
        };
        assert_eq!(
            line(output, "HELD "),
            format!("{master} {gradients} {}", estimate.optimizer_state),
            "{case}, rank {rank}: held bytes"
        );
    }
    assert!(
        ranks
            .windows(2)
            .all(|w| param_bits(&w[0]) == param_bits(&w[1])),
        "{case}: ranks disagree"
    );
}

/// What each rank of an `mpirun --output-filename DIR` job printed, in rank order (Open MPI
/// writes rank r's output under `DIR/<job>/rank.<r>/stdout`).
#[cfg(feature = "mpi")]
fn mpi_logs(dir: &std::path::Path, ranks: usize) -> Vec<String> {
    fn find(dir: &std::path::Path, rank: usize) -> Option<std::path::PathBuf> {
        for entry in std::fs::read_dir(dir).ok()?.flatten() {
            let path = entry.path();
            if path.ends_with(format!("rank.{rank}")) {
                return Some(path.join("stdout"));
            }
            if path.is_dir()
                && let Some(found) = find(&path, rank)
            {
                return Some(found);
            }
        }
        None
    }
    (0..ranks)
        .map(|r| {
            find(dir, r)
                .and_then(|p| std::fs::read_to_string(p).ok())
                .unwrap_or_default()
        })
        .collect()
}

/// The worker's command line and variables for an `mpirun` job training digits.
#[cfg(feature = "mpi")]
fn mpi_worker(mpirun: &mut std::process::Command, dir: &std::path::Path, per_rank: usize) {
    mpi_worker_of(mpirun, dir, per_rank, "train");
}

/// The worker's command line and variables for an `mpirun` job running `scenario`.
#[cfg(feature = "mpi")]
fn mpi_worker_of(
    mpirun: &mut std::process::Command,
    dir: &std::path::Path,
    per_rank: usize,
    scenario: &str,
) {
    mpirun.arg("--output-filename").arg(dir);
    common::as_ranks(mpirun, scenario)
        .env("TEST_BATCH", per_rank.to_string())
        .env_remove("ACCELERATE_TRANSPORT");
}

/// The digits MLP under a real `mpirun -np 2` on the MPI engine (picked by `auto`) learns,
/// bit for bit, what the same 2 processes learn over our shared-memory engine (with two ranks
/// every sum is a + b either way), and what one process learns within 1e-6.
#[cfg(feature = "mpi")]
#[test]
fn mpi_two_processes_learn_what_shared_memory_learns_bit_for_bit() {
    let Some(mut mpirun) = tools::mpirun(2) else {
        return;
    };
    let single = run(
        "train",
        1,
        &[("TEST_BATCH", (2 * PER_RANK_BATCH).to_string())],
    );
    let shm = run("train", 2, &[("TEST_BATCH", PER_RANK_BATCH.to_string())]);
    let dir = tempfile::tempdir().unwrap();
    mpi_worker(&mut mpirun, dir.path(), PER_RANK_BATCH);
    assert_mpi_job_matches(&mut mpirun, dir.path(), &shm, &single[0]);
}

/// ZeRO-2 and ZeRO-3 under a real `mpirun -np 2` on the MPI engine: its reduce-scatters and
/// all-gathers (at stage 3 the sharded MLP's gathers in forward and backward) give, bit for
/// bit, what the same 2 processes give over our shared-memory engine (two ranks: every sum is
/// a + b either way), and one unsharded process's parameters within 1e-6.
#[cfg(feature = "mpi")]
#[test]
fn mpi_zero_2_and_3_on_two_processes_equal_shared_memory_bit_for_bit() {
    let zero = |stage: &str, batch: usize| {
        vec![
            ("TEST_BATCH", batch.to_string()),
            ("TEST_ZERO", stage.to_string()),
            ("TEST_AUTOCAST", "no".to_string()),
        ]
    };
    let single = run("fused", 1, &zero("0", 2 * PER_RANK_BATCH));
    for stage in ["2", "3"] {
        let Some(mut mpirun) = tools::mpirun(2) else {
            return;
        };
        let shm = run("fused", 2, &zero(stage, PER_RANK_BATCH));
        let dir = tempfile::tempdir().unwrap();
        mpi_worker_of(&mut mpirun, dir.path(), PER_RANK_BATCH, "fused");
        mpirun.env("TEST_ZERO", stage).env("TEST_AUTOCAST", "no");
        assert_mpi_job_matches(&mut mpirun, dir.path(), &shm, &single[0]);
    }
}

/// Runs the `mpirun` job of 2 ranks writing under `dir` and asserts that each rank formed the
/// MPI engine, ended with the parameters of the same rank of `shm` bit for bit, and within
/// 1e-6 of `single`'s.
#[cfg(feature = "mpi")]
fn assert_mpi_job_matches(
    mpirun: &mut std::process::Command,
    dir: &std::path::Path,
    shm: &[std::process::Output],
    single: &std::process::Output,
) {
    let out = mpirun.output().unwrap();
    let logs = mpi_logs(dir, 2);
    assert!(
        out.status.success(),
        "{}\n{}\n{logs:#?}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    let reference = params(single);
    for (rank, log) in logs.iter().enumerate() {
        assert!(log.contains("FORMED mpi"), "rank {rank}: {log}");
        assert_eq!(param_bits_in(log), param_bits(&shm[rank]), "rank {rank}");
        let ours: Vec<f32> = param_bits_in(log).into_iter().map(f32::from_bits).collect();
        let worst = largest_difference(&ours, &reference);
        assert!(worst <= 1e-6, "rank {rank}: largest difference {worst}");
    }
}

/// Two hosts (network namespaces with their own addresses and host names) x 2 processes on
/// the MPI engine, started by one `mpirun` on host 0 that reaches host 1 through its rsh agent
/// (a script entering the other namespace, where a cluster would use ssh), Open MPI's TCP
/// between the hosts: the four ranks learn what one process learns within 1e-6, and agree bit
/// for bit.
#[cfg(feature = "mpi")]
#[test]
fn mpi_four_processes_on_two_hosts_learn_what_one_learns() {
    let Some(hosts) = netns::TwoHosts::new("mpi") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let Some(mut launcher) = hosts.mpirun(2, dir.path()) else {
        return;
    };
    let per_rank = 6;
    let single = run("train", 1, &[("TEST_BATCH", (per_rank * 4).to_string())]);
    mpi_worker(&mut launcher, &dir.path().join("out"), per_rank);
    let out = launcher.output().unwrap();
    let logs = mpi_logs(&dir.path().join("out"), 4);
    assert_ranks_learned(&out, &logs, "FORMED mpi", &single[0]);
    for machine in 0..2 {
        assert_eq!(hosts.leftovers(machine), "", "host {machine}");
    }
}
