//! The accelerated loop in one process, against hand-written plain Burn loops.

use accelerate_burn::{
    AccelerateError, Accelerator, DataLoader, DefaultBackend, MODEL_FILE, ProcessState,
};
use accelerate_core::Launcher;
use accelerate_core::comm::GroupOptions;
use burn::data::dataloader::batcher::Batcher;
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::module::{Module, Param};
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamWConfig, GradientsParams, SgdConfig};
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{DType, Device, Tensor, TensorData};

const FEATURES: usize = 6;

#[derive(Module, Debug)]
struct Net {
    hidden: Linear,
    out: Linear,
    act: Relu,
}

impl Net {
    fn new(device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(FEATURES, 16).init(device),
            out: LinearConfig::new(16, 1).init(device),
            act: Relu::new(),
        }
    }

    fn forward(&self, x: Tensor<2>) -> Tensor<2> {
        self.out.forward(self.act.forward(self.hidden.forward(x)))
    }

    fn loss(&self, (x, y): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
        (self.forward(x) - y).square().mean()
    }

    fn values(&self) -> Vec<f32> {
        let mut out = Vec::new();
        for linear in [&self.hidden, &self.out] {
            out.extend(linear.weight.val().into_data().try_to_vec::<f32>().unwrap());
            if let Some(b) = &linear.bias {
                out.extend(b.val().into_data().try_to_vec::<f32>().unwrap());
            }
        }
        out
    }

    /// The parameters' bit patterns, for "bit for bit" comparisons (`==` on floats would
    /// equate 0.0 and -0.0).
    fn bits(&self) -> Vec<u32> {
        self.values().into_iter().map(f32::to_bits).collect()
    }
}

type Item = ([f32; FEATURES], f32);

#[derive(Clone, Copy)]
struct Rows;

impl Batcher<Item, (Tensor<2>, Tensor<2>)> for Rows {
    fn batch(&self, items: Vec<Item>, device: &Device) -> (Tensor<2>, Tensor<2>) {
        let n = items.len();
        let x: Vec<f32> = items.iter().flat_map(|(x, _)| *x).collect();
        let y: Vec<f32> = items.iter().map(|(_, y)| *y).collect();
        (
            Tensor::from_data(TensorData::new(x, [n, FEATURES]), device),
            Tensor::from_data(TensorData::new(y, [n, 1]), device),
        )
    }
}

fn items(n: usize) -> Vec<Item> {
    (0..n)
        .map(|i| {
            let x: [f32; FEATURES] =
                std::array::from_fn(|j| ((i * 31 + j * 17) % 23) as f32 / 11.0 - 1.0);
            let y = x
                .iter()
                .enumerate()
                .map(|(j, v)| v * (j as f32 - 2.5))
                .sum::<f32>();
            (x, y.sin())
        })
        .collect()
}

fn loader(n: usize, batch: usize) -> DataLoader<Item, (Tensor<2>, Tensor<2>)> {
    DataLoader::builder(Rows)
        .batch_size(batch)
        .shuffle(3)
        .build(InMemDataset::new(items(n)))
}

fn accelerator(accumulation: usize) -> Accelerator<DefaultBackend> {
    Accelerator::builder()
        .process_state(ProcessState::single())
        .gradient_accumulation_steps(accumulation)
        .seed(11)
        .build()
        .unwrap()
}

/// The largest absolute difference between two parameter lists.
fn largest_difference(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0_f32, f32::max)
}

fn assert_close(a: &[f32], b: &[f32], tol: f32) {
    assert_eq!(a.len(), b.len());
    let worst = largest_difference(a, b);
    assert!(worst <= tol, "largest difference {worst} > {tol}");
}

/// Tolerance 0: the accelerated loop issues the same Burn operations in the same order as the
/// plain loop (no accumulation means no extra arithmetic), and the CPU backend is
/// deterministic, so every parameter must be bit-identical.
#[test]
fn accelerated_loop_equals_plain_burn_loop_bit_for_bit() {
    let acc = accelerator(1);
    let device = acc.device();
    let initial = Net::new(&device);
    let data = loader(100, 8);
    let orders: Vec<Vec<usize>> = (0..2).map(|e| data.epoch_indices(e)).collect();

    // Plain Burn loop: same data, same order, same optimizer.
    let all = items(100);
    let mut plain = initial.clone();
    let mut plain_optim = AdamWConfig::new().init();
    for order in &orders {
        for chunk in order.chunks(8) {
            let batch = Rows.batch(chunk.iter().map(|&i| all[i]).collect(), &device);
            let grads = GradientsParams::from_grads(plain.loss(batch).backward(), &plain);
            plain = plain_optim.step(1e-2, plain, grads);
        }
    }

    let (mut model, mut optim, train) = acc
        .prepare((initial, AdamWConfig::new().init(), data))
        .unwrap();
    for epoch in 0..2 {
        train.set_epoch(epoch);
        for batch in train.iter() {
            let grads = acc.backward(model.loss(batch.unwrap()), &model).unwrap();
            model = optim.step(1e-2, model, grads).unwrap();
        }
    }
    assert_eq!(optim.updates(), 2 * 13);
    assert_eq!(model.bits(), plain.bits());
}

/// Tolerance 1e-6: four micro-batch means divided by 4 and summed equal the mean over the
/// whole batch up to f32 summation order.
#[test]
fn four_micro_batches_equal_one_batch_four_times_the_size() {
    let acc = accelerator(4);
    let device = acc.device();
    let initial = Net::new(&device);

    let mut big = initial.clone();
    let mut big_optim = SgdConfig::new().init();
    let whole = loader(32, 32).epoch_indices(0);
    let all = items(32);
    let batch = Rows.batch(whole.iter().map(|&i| all[i]).collect(), &device);
    let grads = GradientsParams::from_grads(big.loss(batch).backward(), &big);
    big = big_optim.step(0.1, big, grads);

    let (mut model, mut optim, train) = acc
        .prepare((initial, SgdConfig::new().init(), loader(32, 8)))
        .unwrap();
    let mut syncs = Vec::new();
    for batch in train.iter() {
        let grads = acc.backward(model.loss(batch.unwrap()), &model).unwrap();
        syncs.push(acc.sync_gradients());
        model = optim.step(0.1, model, grads).unwrap();
    }
    assert_eq!(syncs, [false, false, false, true]);
    assert_eq!(optim.updates(), 1);
    assert_close(&model.values(), &big.values(), 1e-6);
}

/// An epoch of 6 batches with accumulation 4 ends in a window of 2: its update must equal one
/// step on those 2 batches together (divided by 2, not by 4 as Accelerate does).
#[test]
fn a_short_last_window_is_weighted_by_its_real_size() {
    let acc = accelerator(4);
    let device = acc.device();
    let initial = Net::new(&device);
    let data = loader(48, 8);
    let order = data.epoch_indices(0);
    let all = items(48);
    let batch_of = |idx: &[usize]| Rows.batch(idx.iter().map(|&i| all[i]).collect(), &device);

    // Reference: one SGD step on batches 0-3 together, then one on batches 4-5 together.
    let mut reference = initial.clone();
    let mut ref_optim = SgdConfig::new().init();
    for window in [&order[..32], &order[32..]] {
        let grads =
            GradientsParams::from_grads(reference.loss(batch_of(window)).backward(), &reference);
        reference = ref_optim.step(0.1, reference, grads);
    }
    // Accelerate's weighting of the short window: half of the reference's gradient.
    let mut halved = initial.clone();
    let mut halved_optim = SgdConfig::new().init();
    for (window, weight) in [(&order[..32], 1.0), (&order[32..], 0.5)] {
        let loss = halved.loss(batch_of(window)).mul_scalar(weight);
        let grads = GradientsParams::from_grads(loss.backward(), &halved);
        halved = halved_optim.step(0.1, halved, grads);
    }

    let (mut model, mut optim, train) = acc
        .prepare((initial, SgdConfig::new().init(), data))
        .unwrap();
    for batch in train.iter() {
        let grads = acc.backward(model.loss(batch.unwrap()), &model).unwrap();
        model = optim.step(0.1, model, grads).unwrap();
    }
    assert_eq!(optim.updates(), 2);
    assert_close(&model.values(), &reference.values(), 1e-6);
    let gap = largest_difference(&model.values(), &halved.values());
    assert!(
        gap > 1e-4,
        "the /N weighting should differ visibly, gap {gap}"
    );
}

#[test]
fn global_clipping_matches_a_hand_computed_norm() {
    let acc = accelerator(1);
    let device = acc.device();
    let mut linear: Linear = LinearConfig::new(2, 1).init(&device);
    linear.weight = Param::from_tensor(Tensor::from_floats([[0.5], [-0.25]], &device));
    // loss = w . x + b with x = (3, 4): dL/dw = (3, 4), dL/db = 1, global norm sqrt(26).
    let x = Tensor::<2>::from_floats([[3.0, 4.0]], &device);
    let loss = linear.forward(x).sum();
    let mut grads = acc.backward(loss, &linear).unwrap();
    let norm = acc
        .clip_grad_norm(&linear, &mut grads, 1.0)
        .unwrap()
        .unwrap();
    assert!((norm - 26f32.sqrt()).abs() < 1e-5, "norm {norm}");
    // After clipping the global norm is max_norm (up to PyTorch's 1e-6 guard).
    let after = acc
        .clip_grad_norm(&linear, &mut grads, 1e9)
        .unwrap()
        .unwrap();
    assert!((after - 1.0).abs() < 1e-5, "norm after clipping {after}");
    let w: Vec<f32> = grads
        .to_params()
        .unwrap()
        .get::<2>(linear.weight.id)
        .unwrap()
        .into_data()
        .try_to_vec()
        .unwrap();
    let scale = 1.0 / 26f32.sqrt();
    assert_close(&w, &[3.0 * scale, 4.0 * scale], 1e-5);
    // A norm below the limit leaves gradients alone.
    let again = acc
        .clip_grad_norm(&linear, &mut grads, 10.0)
        .unwrap()
        .unwrap();
    assert!((again - 1.0).abs() < 1e-5);
}

/// A `Net` trained for one epoch of 40 items with AdamW.
fn trained_net(acc: &Accelerator<DefaultBackend>) -> Net {
    let (mut model, mut optim, train) = acc
        .prepare((
            Net::new(&acc.device()),
            AdamWConfig::new().init(),
            loader(40, 8),
        ))
        .unwrap();
    for batch in train.iter() {
        let grads = acc.backward(model.loss(batch.unwrap()), &model).unwrap();
        model = optim.step(1e-2, model, grads).unwrap();
    }
    model
}

/// Five items' inputs on `device`, to compare models' outputs.
fn probe_input(device: &Device) -> Tensor<2> {
    Tensor::<2>::from_data(
        TensorData::new(
            items(5).iter().flat_map(|(x, _)| *x).collect::<Vec<_>>(),
            [5, FEATURES],
        ),
        device,
    )
}

#[test]
fn saved_weights_load_into_a_fresh_plain_burn_model() {
    let acc = accelerator(1);
    let model = trained_net(&acc);
    let dir = tempfile::tempdir().unwrap();
    let path = acc.save_model(&model, dir.path()).unwrap();
    assert_eq!(path, dir.path().join(MODEL_FILE));

    // A plain Burn program: a new model on a plain device, loaded from the file.
    let plain_device = Device::default();
    let mut fresh = Net::new(&plain_device);
    let mut store = SafetensorsStore::from_file(&path);
    fresh.load_from(&mut store).unwrap();
    let x = probe_input(&plain_device);
    let ours = model.valid().forward(x.clone()).into_data();
    let theirs = fresh.forward(x).into_data();
    assert_eq!(
        ours.try_to_vec::<f32>().unwrap(),
        theirs.try_to_vec::<f32>().unwrap()
    );
    // Saving again over the file works (atomic replace).
    acc.save_model(&model, dir.path()).unwrap();
}

/// A `model.safetensors` that accelerate-rs did not write (a hub download, a plain Burn save)
/// is never replaced: `save_model`, and `save_model_sharded` of a model small enough for one
/// file, stop with an error naming the file and leave it byte for byte as it was.
#[test]
fn a_save_never_replaces_a_model_file_someone_else_wrote() {
    let acc = accelerator(1);
    let model = trained_net(&acc);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join(MODEL_FILE);
    // Plain Burn's own save: no mark of ours in its metadata.
    let mut store = SafetensorsStore::from_file(&path);
    model.valid().save_into(&mut store).unwrap();
    let before = std::fs::read(&path).unwrap();
    let whole = acc.save_model(&model, dir.path()).unwrap_err().to_string();
    let sharded = acc
        .save_model_sharded(&model, dir.path(), 1 << 30)
        .unwrap_err()
        .to_string();
    for err in [whole, sharded] {
        assert!(
            err.contains("did not write") && err.contains(MODEL_FILE),
            "{err}"
        );
    }
    assert_eq!(std::fs::read(&path).unwrap(), before);
    let entries: Vec<_> = std::fs::read_dir(dir.path()).unwrap().collect();
    assert_eq!(entries.len(), 1, "nothing written beside it");
}

/// A model saved in shards (the hub's layout) loads back through `load_model`, merges into one
/// file that plain Burn loads, and gives the same outputs bit for bit either way; a whole save
/// into the same directory replaces the shards; a missing shard is an error naming it.
#[test]
fn a_sharded_save_loads_back_and_merges_into_one_file_plain_burn_reads() {
    use accelerate_core::weights::{INDEX_FILE, merge_sharded};
    let acc = accelerator(1);
    let model = trained_net(&acc);
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("sharded");
    // Tensors of 384, 64, 64 and 4 bytes in shards of at most 100: [384], [64], [64, 4].
    let files = acc.save_model_sharded(&model, &dir, 100).unwrap();
    let names: Vec<String> = files
        .iter()
        .map(|f| f.file_name().unwrap().to_string_lossy().into_owned())
        .collect();
    assert_eq!(
        names,
        [
            "model-00001-of-00003.safetensors",
            "model-00002-of-00003.safetensors",
            "model-00003-of-00003.safetensors",
            INDEX_FILE
        ]
    );
    assert_eq!(
        std::fs::read_dir(&dir).unwrap().count(),
        4,
        "no staging left"
    );

    let plain_device = Device::default();
    let x = probe_input(&plain_device);
    let bits = |net: &Net| -> Vec<u32> {
        net.forward(x.clone())
            .into_data()
            .try_to_vec::<f32>()
            .unwrap()
            .into_iter()
            .map(f32::to_bits)
            .collect()
    };
    let ours = bits(&model.valid());
    let loaded = acc.load_model(Net::new(&plain_device), &dir).unwrap();
    assert_eq!(bits(&loaded), ours);

    // Merged offline into one file, which a plain Burn program loads.
    let merged = tmp.path().join("merged");
    let report = merge_sharded(&dir, &merged).unwrap();
    assert_eq!((report.files, report.tensors), (3, 4));
    let mut fresh = Net::new(&plain_device);
    fresh
        .load_from(&mut SafetensorsStore::from_file(&report.output))
        .unwrap();
    assert_eq!(bits(&fresh), ours);

    // A missing shard is named.
    let shard = dir.join("model-00002-of-00003.safetensors");
    let kept = std::fs::read(&shard).unwrap();
    std::fs::remove_file(&shard).unwrap();
    let err = acc
        .load_model(Net::new(&plain_device), &dir)
        .unwrap_err()
        .to_string();
    assert!(err.contains("model-00002-of-00003"), "{err}");
    std::fs::write(&shard, kept).unwrap();

    // Saved whole into the same directory: the shards and index go, the file loads.
    let path = acc.save_model(&model, &dir).unwrap();
    assert_eq!(std::fs::read_dir(&dir).unwrap().count(), 1);
    assert_eq!(
        bits(&acc.load_model(Net::new(&plain_device), &path).unwrap()),
        ours
    );
}

#[test]
fn the_scheduler_advances_once_per_update() {
    let acc = accelerator(3);
    let device = acc.device();
    let (mut model, mut optim, train) = acc
        .prepare((Net::new(&device), SgdConfig::new().init(), loader(64, 8)))
        .unwrap();
    // 1.0, 0.9, 0.8, ... one value per update.
    let schedule = LinearLrSchedulerConfig::new(1.0, 0.0, 10).init().unwrap();
    let mut scheduler = acc.prepare_scheduler(schedule);
    let mut lrs = Vec::new();
    for batch in train.iter() {
        let grads = acc.backward(model.loss(batch.unwrap()), &model).unwrap();
        let lr = scheduler.step();
        lrs.push(lr.base());
        model = optim.step(lr, model, grads).unwrap();
    }
    // 8 batches, windows of 3, 3, 2: three updates.
    assert_eq!(optim.updates(), 3);
    let expected = [1.0, 1.0, 1.0, 0.9, 0.9, 0.9, 0.8, 0.8];
    let lrs: Vec<f32> = lrs.iter().map(|&l| l as f32).collect();
    assert_close(&lrs, &expected, 1e-6);
}

#[test]
fn gradients_of_an_earlier_window_are_refused_not_applied() {
    let acc = accelerator(1);
    let device = acc.device();
    let (model, mut optim) = acc
        .prepare((Net::new(&device), SgdConfig::new().init()))
        .unwrap();
    let batch = Rows.batch(items(4), &device);
    let stale = acc.backward(model.loss(batch.clone()), &model).unwrap();
    let current = acc.backward(model.loss(batch), &model).unwrap();
    let err = optim.step(0.1, model.clone(), stale).unwrap_err();
    assert!(matches!(
        err,
        AccelerateError::UnexpectedGradients { rank: 0 }
    ));
    assert!(err.to_string().contains("acc.backward"), "{err}");
    assert_eq!(optim.updates(), 0, "nothing was applied");
    // The current window's gradients still step.
    optim.step(0.1, model, current).unwrap();
    assert_eq!(optim.updates(), 1);
}

#[test]
fn a_rank_whose_peers_never_come_fails_naming_the_address() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let state = ProcessState {
        rank: 1,
        world_size: 2,
        local_rank: 1,
        local_world_size: 2,
        node_rank: 0,
        master_addr: Some("127.0.0.1".into()),
        master_port: port,
        launcher: Launcher::Torchrun,
        job_id: None,
        agent_store: None,
    };
    let options = GroupOptions {
        rendezvous_timeout: std::time::Duration::from_millis(500),
        ..GroupOptions::default()
    };
    let err = Accelerator::<DefaultBackend>::builder()
        .process_state(state)
        .process_group_options(options)
        .build()
        .err()
        .unwrap();
    let message = err.to_string();
    assert!(message.contains(&format!("127.0.0.1:{port}")), "{message}");
    assert!(
        message.contains("rank 0 never accepted this rank"),
        "{message}"
    );
}

#[test]
fn batches_arrive_on_the_accelerator_device_and_process_queries_answer() {
    let acc = accelerator(1);
    assert!(acc.is_main_process() && acc.is_local_main_process());
    assert_eq!((acc.process_index(), acc.num_processes()), (0, 1));
    let train = acc.prepare_data_loader(loader(10, 4)).unwrap();
    assert_eq!(train.len(), 3);
    let batches: Vec<_> = train.iter().map(Result::unwrap).collect();
    assert_eq!(batches.len(), 3);
    for (x, _) in &batches {
        assert_eq!(x.device(), acc.device());
        assert!(x.device().is_autodiff());
    }
    assert_eq!(batches[2].0.dims(), [2, FEATURES]);
}

#[cfg(feature = "flex")]
#[test]
fn flex_computes_in_f32_f16_and_bf16() {
    let acc = accelerator(1);
    assert_eq!(acc.backend_name(), "flex");
    assert_eq!(acc.float_dtypes(), [DType::F32, DType::F16, DType::BF16]);
    let x = Tensor::<1>::from_floats([1.5, 2.0], &acc.device());
    for dtype in [DType::F16, DType::BF16] {
        let y = x.clone().cast(dtype);
        assert_eq!(y.dtype(), dtype);
        let sum: f32 = y.sum().cast(DType::F32).into_scalar();
        assert_eq!(sum, 3.5);
    }
}

/// A data set whose item 13 cannot be read.
struct Flaky;

impl burn::data::dataset::Dataset<Item> for Flaky {
    fn get(&self, index: usize) -> Result<Item, burn::data::dataset::DatasetError> {
        if index == 13 {
            return Err(burn::data::dataset::DatasetError::new(
                std::io::Error::other("item 13 is corrupt"),
            ));
        }
        Ok(items(20)[index])
    }

    fn len(&self) -> usize {
        20
    }
}

#[test]
fn prefetched_batches_equal_batches_built_in_the_loop() {
    let acc = accelerator(1);
    let eager = acc
        .prepare_data_loader(
            DataLoader::builder(Rows)
                .batch_size(6)
                .shuffle(9)
                .prefetch(0)
                .build(InMemDataset::new(items(50))),
        )
        .unwrap();
    let ahead = acc.prepare_data_loader(loader_with_seed(50, 6, 9)).unwrap();
    for epoch in 0..2 {
        eager.set_epoch(epoch);
        ahead.set_epoch(epoch);
        let a: Vec<Vec<f32>> = eager
            .iter()
            .map(|b| b.unwrap().0.into_data().iter::<f32>().collect())
            .collect();
        let b: Vec<Vec<f32>> = ahead
            .iter()
            .map(|b| b.unwrap().0.into_data().iter::<f32>().collect())
            .collect();
        assert_eq!(a.len(), 9);
        assert_eq!(a, b);
    }
    // Leaving an epoch early stops its prefetching; the next epoch starts cleanly.
    let first = ahead.iter().next().unwrap().unwrap();
    assert_eq!(first.0.dims(), [6, FEATURES]);
    assert_eq!(ahead.iter().count(), 9);
}

#[test]
fn a_data_set_error_names_the_batch_and_does_not_end_the_epoch() {
    let acc = accelerator(1);
    let train = acc
        .prepare_data_loader(DataLoader::builder(Rows).batch_size(5).build(Flaky))
        .unwrap();
    let results: Vec<_> = train.iter().collect();
    assert_eq!(results.len(), 4);
    let errors: Vec<String> = results
        .iter()
        .filter_map(|r| r.as_ref().err().map(ToString::to_string))
        .collect();
    assert_eq!(errors.len(), 1);
    assert!(errors[0].contains("batch 2 of epoch 0"), "{}", errors[0]);
    assert!(errors[0].contains("item 13 is corrupt"), "{}", errors[0]);
}

fn loader_with_seed(n: usize, batch: usize, seed: u64) -> DataLoader<Item, (Tensor<2>, Tensor<2>)> {
    DataLoader::builder(Rows)
        .batch_size(batch)
        .shuffle(seed)
        .build(InMemDataset::new(items(n)))
}

/// A backend kind whose device computes in f32 only, like ndarray.
struct F32Only;

impl accelerate_burn::AcceleratorBackend for F32Only {
    const NAME: &'static str = "f32-only";

    fn device(local_rank: usize) -> Result<Device, AccelerateError> {
        <DefaultBackend as accelerate_burn::AcceleratorBackend>::device(local_rank)
    }

    fn float_dtypes(_device: &Device) -> Vec<DType> {
        vec![DType::F32]
    }
}

#[test]
fn a_device_without_the_dtype_trains_in_f32_or_refuses_in_strict_mode() {
    use accelerate_burn::MixedPrecision;
    let acc = Accelerator::<F32Only>::builder()
        .process_state(ProcessState::single())
        .mixed_precision(MixedPrecision::Bf16)
        .build()
        .unwrap();
    assert_eq!(acc.compute_dtype(), DType::F32);
    assert_eq!(acc.loss_scale(), None);
    let (mut model, mut optim, train) = acc
        .prepare((
            Net::new(&acc.device()),
            SgdConfig::new().init(),
            loader(16, 8),
        ))
        .unwrap();
    for batch in train.iter() {
        let (x, y) = batch.unwrap();
        let loss = acc.autocast(&model, |m, c| m.loss((c.input(x), y)));
        assert_eq!(loss.dtype(), DType::F32);
        let grads = acc.backward(loss, &model).unwrap();
        model = optim.step(0.1, model, grads).unwrap();
    }
    assert_eq!(optim.updates(), 2);
    let err = Accelerator::<F32Only>::builder()
        .process_state(ProcessState::single())
        .mixed_precision(MixedPrecision::Fp16)
        .strict_mixed_precision(true)
        .build()
        .err()
        .unwrap();
    assert!(err.to_string().contains("cannot compute in F16"), "{err}");
}

#[cfg(feature = "flex")]
#[test]
fn autocast_computes_in_half_precision_and_returns_f32() {
    use accelerate_burn::MixedPrecision;
    for (precision, dtype) in [
        (MixedPrecision::Bf16, DType::BF16),
        (MixedPrecision::Fp16, DType::F16),
    ] {
        let acc = Accelerator::<DefaultBackend>::builder()
            .process_state(ProcessState::single())
            .mixed_precision(precision)
            // Scale 1: this untrained sum would overflow fp16 at the default 65,536.
            .loss_scaler(accelerate_burn::ScalerConfig {
                init_scale: 1.0,
                ..Default::default()
            })
            .build()
            .unwrap();
        assert_eq!(acc.compute_dtype(), dtype);
        let model = Net::new(&acc.device());
        let (x, _) = Rows.batch(items(4), &acc.device());
        let (inside, out) = acc.autocast(&model, |m, c| {
            let y = m.forward(c.input(x));
            (y.dtype(), y)
        });
        assert_eq!(inside, dtype);
        assert_eq!(out.dtype(), DType::F32);
        // Gradients land on the f32 master parameters.
        let loss = acc.autocast(&model, |m, c| {
            m.forward(c.input(Rows.batch(items(4), &acc.device()).0))
                .sum()
        });
        let grads = acc.backward(loss, &model).unwrap();
        let g = grads
            .to_params()
            .unwrap()
            .get::<2>(model.hidden.weight.id)
            .unwrap();
        assert_eq!(g.dtype(), DType::F32);
    }
}

#[cfg(feature = "ndarray")]
#[test]
fn ndarray_asked_for_bf16_trains_in_f32() {
    use accelerate_burn::{MixedPrecision, NdArray};
    let acc = Accelerator::<NdArray>::builder()
        .process_state(ProcessState::single())
        .mixed_precision(MixedPrecision::Bf16)
        .build()
        .unwrap();
    assert_eq!(acc.compute_dtype(), DType::F32);
    let model = Net::new(&acc.device());
    let (x, y) = Rows.batch(items(8), &acc.device());
    let loss = acc.autocast(&model, |m, c| m.loss((c.input(x), y)));
    assert_eq!(loss.dtype(), DType::F32);
    let grads = acc.backward(loss, &model).unwrap();
    assert!(
        grads
            .to_params()
            .unwrap()
            .get::<2>(model.hidden.weight.id)
            .is_some()
    );
}

/// Trains on the first `micro_batches` batches of the loader's current epoch.
fn train_updates(
    acc: &Accelerator<DefaultBackend>,
    model: Net,
    optim: &mut accelerate_burn::PreparedOptimizer,
    train: &accelerate_burn::PreparedDataLoader<Item, (Tensor<2>, Tensor<2>)>,
    micro_batches: usize,
) -> Net {
    let mut model = model;
    for batch in train.iter().take(micro_batches) {
        let grads = acc.backward(model.loss(batch.unwrap()), &model).unwrap();
        model = optim.step(0.01, model, grads).unwrap();
    }
    model
}

#[test]
fn a_checkpoint_restores_in_process_and_refuses_what_it_cannot_hold() {
    use accelerate_burn::Checkpoint;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");

    let acc = accelerator(2);
    let model = Net::new(&acc.device());
    let (model, mut optim, train) = acc
        .prepare((model, AdamWConfig::new().init(), loader(64, 4)))
        .unwrap();
    // Mid-window (3 micro-batches of windows of 2): refused, naming the fix.
    let model = train_updates(&acc, model, &mut optim, &train, 3);
    let err = acc
        .save_state(&dir, &Checkpoint::new(&model, &optim).object("note", &"hi"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("middle of an accumulation window"), "{err}");
    assert!(err.contains("sync_gradients"), "{err}");
    assert!(!dir.exists());
    // At a window boundary: saved (the epoch restarts: 2 more updates).
    let model = train_updates(&acc, model, &mut optim, &train, 4);
    acc.save_state(&dir, &Checkpoint::new(&model, &optim).object("note", &"hi"))
        .unwrap();

    // A fresh accelerator continues from it: same parameters, counters, objects.
    let acc2 = accelerator(2);
    let fresh = Net::new(&acc2.device());
    let (fresh, mut optim2, _train2) = acc2
        .prepare((fresh, AdamWConfig::new().init(), loader(64, 4)))
        .unwrap();
    let restored = acc2.load_state(&dir, fresh, &mut optim2, None).unwrap();
    assert_eq!(restored.model.values(), model.values());
    assert_eq!(restored.info.updates, 3);
    assert_eq!(optim2.updates(), 3);
    assert_eq!(
        restored.info.object::<String>("note").unwrap().as_deref(),
        Some("hi")
    );
    assert_eq!(restored.info.object::<String>("absent").unwrap(), None);
    assert!(restored.info.object::<u32>("note").is_err());

    // A model of another shape, or a directory that is not a checkpoint, is an error.
    #[derive(Module, Debug)]
    struct Other {
        only: Linear,
    }
    let other = Other {
        only: LinearConfig::new(FEATURES, 3).init(&acc2.device()),
    };
    let err = acc2
        .load_state(&dir, other, &mut optim2, None)
        .unwrap_err()
        .to_string();
    assert!(err.starts_with("rank 0: checkpoint "), "{err}");
    assert!(err.contains("does not fit this model"), "{err}");
    let err = acc2
        .load_state(tmp.path(), Net::new(&acc2.device()), &mut optim2, None)
        .unwrap_err()
        .to_string();
    assert!(err.contains("not a complete checkpoint"), "{err}");
    // Automatic naming needs a project directory.
    let err = acc2
        .save_checkpoint(&Checkpoint::new(&restored.model, &optim2))
        .unwrap_err()
        .to_string();
    assert!(err.contains("project_dir"), "{err}");
}

/// fp16 loss scaling in one process (on wgpu and cuda the unscale-and-check is our cubecl
/// kernel, elsewhere Burn's operations): gradients come back unscaled (at scale 1,024 they
/// agree with an unscaled run to f16 precision: tolerance 2e-3 relative to the largest, where
/// forgetting or repeating the division would be off by 1,024 times), and an infinite loss
/// skips exactly that step, leaves the parameters alone and halves the scale.
#[test]
fn fp16_gradients_come_back_unscaled_and_an_overflow_skips_exactly_that_step() {
    use accelerate_burn::{MixedPrecision, ScalerConfig};
    let build = |scale: f32| {
        Accelerator::<DefaultBackend>::builder()
            .process_state(ProcessState::single())
            .mixed_precision(MixedPrecision::Fp16)
            .seed(5)
            .loss_scaler(ScalerConfig {
                init_scale: scale,
                growth_interval: 1000,
                ..ScalerConfig::default()
            })
            .build()
            .unwrap()
    };
    // One model for both runs: drawn once, so that tests running in parallel (which reseed the
    // shared device generator) cannot give the two runs different weights.
    let initial = Net::new(&build(1.0).device());
    let first_gradient = |scale: f32| {
        let acc = build(scale);
        let (model, _optim, train) = acc
            .prepare((initial.clone(), SgdConfig::new().init(), loader(8, 8)))
            .unwrap();
        let batch = train.iter().next().unwrap().unwrap();
        let loss = acc.autocast(&model, |m, c| m.loss(c.input(batch)));
        let grads = acc.backward(loss, &model).unwrap();
        let g = grads
            .to_params()
            .unwrap()
            .get::<2>(model.hidden.weight.id)
            .unwrap();
        (
            acc.compute_dtype(),
            g.into_data().try_to_vec::<f32>().unwrap(),
        )
    };
    let claims_f16 = build(1.0).float_dtypes().contains(&DType::F16);
    let (dtype, unscaled) = first_gradient(1.0);
    if !claims_f16 {
        // This device cannot compute in f16 (ndarray): there is no loss scaling to test.
        assert_eq!(dtype, DType::F32);
        return;
    }
    assert_eq!(
        dtype,
        DType::F16,
        "the backend claims f16 but computes in {dtype:?}"
    );
    let (_, scaled) = first_gradient(1024.0);
    let largest = unscaled.iter().fold(0.0_f32, |m, v| m.max(v.abs()));
    assert!(largest > 0.0);
    assert_close(&scaled, &unscaled, 2e-3 * largest);

    let acc = build(1024.0);
    let (mut model, mut optim, train) = acc
        .prepare((
            Net::new(&acc.device()),
            SgdConfig::new().init(),
            loader(48, 8),
        ))
        .unwrap();
    for (step, batch) in train.iter().enumerate() {
        let batch = batch.unwrap();
        let mut loss = acc.autocast(&model, |m, c| m.loss(c.input(batch)));
        if step == 3 {
            loss = loss.mul_scalar(f32::INFINITY);
        }
        let before = model.bits();
        let grads = acc.backward(loss, &model).unwrap();
        model = optim.step(0.05, model, grads).unwrap();
        let skipped = acc.optimizer_step_was_skipped();
        assert_eq!(skipped, step == 3, "step {step}");
        let after = model.bits();
        assert!(
            after.iter().all(|v| f32::from_bits(*v).is_finite()),
            "step {step}"
        );
        assert_eq!(before == after, step == 3, "step {step}: parameters");
        let expected_scale = if step < 3 { 1024.0 } else { 512.0 };
        assert_eq!(acc.loss_scale(), Some(expected_scale), "step {step}");
    }
    assert_eq!(optim.updates(), 5);
}

/// Micro-batches of 1, 3, 20 and 8 rows, with `backward_sum` (a summed loss and its row
/// count): the update equals one step on the 32 rows together, to 1e-6 (f32 summation order
/// and dividing once instead of per row). The same micro-batches through `backward` (a mean
/// per micro-batch, each weighing a quarter) land elsewhere: more than 1e-3 away.
#[test]
fn summed_losses_weigh_every_row_of_a_window_alike() {
    let sizes = [1usize, 3, 20, 8];
    let all = items(32);
    let batch_of = |rows: &[Item], device: &Device| Rows.batch(rows.to_vec(), device);
    // One initial model for every run: the device's random stream is shared with the tests
    // running beside this one, so two `Net::new` need not draw the same weights.
    let acc = accelerator(1);
    let device = acc.device();
    let initial = Net::new(&device);
    let run = |summed: bool| {
        let acc = accelerator(4);
        let device = acc.device();
        let (mut model, mut optim) = acc.prepare((initial.clone(), SgdConfig::new())).unwrap();
        let mut start = 0;
        for size in sizes {
            let (x, y) = batch_of(&all[start..start + size], &device);
            start += size;
            let grads = if summed {
                let loss = (model.forward(x) - y).square().sum();
                acc.backward_sum(loss, size as u64, &model).unwrap()
            } else {
                acc.backward(model.loss((x, y)), &model).unwrap()
            };
            model = optim.step(0.1, model, grads).unwrap();
        }
        assert_eq!(optim.updates(), 1);
        model.values()
    };
    let mut big = initial.clone();
    let grads = GradientsParams::from_grads(big.loss(batch_of(&all, &device)).backward(), &big);
    big = SgdConfig::new().init().step(0.1, big, grads);

    assert_close(&run(true), &big.values(), 1e-6);
    let per_micro_batch = run(false);
    let worst = largest_difference(&per_micro_batch, &big.values());
    assert!(
        worst > 1e-3,
        "the per-micro-batch mean differs by only {worst}"
    );
}

#[test]
fn mean_and_summed_losses_cannot_share_a_window() {
    let acc = accelerator(2);
    let device = acc.device();
    let (model, _optim) = acc.prepare((Net::new(&device), SgdConfig::new())).unwrap();
    let batch = Rows.batch(items(4), &device);
    acc.backward(model.loss(batch.clone()), &model).unwrap();
    let err = acc
        .backward_sum(model.loss(batch).mul_scalar(4.0), 4, &model)
        .unwrap_err()
        .to_string();
    assert!(err.contains("began with backward (a mean loss)"), "{err}");
}

/// Balanced checkpointing recomputes element-wise activations in the backward pass; the
/// recomputation is the same arithmetic, so training is bit-identical with and without it.
#[test]
fn gradient_checkpointing_trains_bit_identically() {
    // One initial model for both runs, built on a plain autodiff device (Burn's default
    // strategy): prepare gives its parameters the prepared device's strategy, and drawing it
    // once keeps other tests' use of the shared random stream out of the comparison.
    let initial = Net::new(&Device::default().autodiff());
    let run = |initial: Net, checkpointing: bool| {
        let acc = Accelerator::<DefaultBackend>::builder()
            .process_state(ProcessState::single())
            .seed(11)
            .gradient_checkpointing(checkpointing)
            .build()
            .unwrap();
        assert_eq!(acc.config().gradient_checkpointing, checkpointing);
        let device = acc.device();
        assert_eq!(
            device
                .gradient_checkpointing_strategy()
                .is_some_and(|s| { s == burn::tensor::GradientCheckpointingStrategy::Balanced }),
            checkpointing
        );
        let (mut model, mut optim, train) = acc
            .prepare((initial, AdamWConfig::new(), loader(64, 8)))
            .unwrap();
        for batch in train.iter() {
            let grads = acc.backward(model.loss(batch.unwrap()), &model).unwrap();
            model = optim.step(1e-2, model, grads).unwrap();
        }
        model.bits()
    };
    let (with, without) = (run(initial.clone(), true), run(initial.clone(), false));
    assert_ne!(with, initial.bits(), "the runs trained");
    assert_eq!(with, without);
    // A model built on a plain device (no autodiff) trains alike once prepared.
    assert_eq!(run(initial.valid(), true), without);
}

/// One, two and three workers build the same batches, in the same order, bit for bit.
#[test]
fn batches_are_the_same_whatever_the_number_of_workers() {
    let acc = accelerator(1);
    let epochs = |workers: usize| {
        let train = acc
            .prepare_data_loader(
                DataLoader::builder(Rows)
                    .batch_size(6)
                    .shuffle(9)
                    .num_workers(workers)
                    .prefetch(4)
                    .build(InMemDataset::new(items(50))),
            )
            .unwrap();
        (0..2)
            .flat_map(|epoch| {
                train.set_epoch(epoch);
                train
                    .iter()
                    .map(|b| {
                        let (x, y) = b.unwrap();
                        let mut bits: Vec<u32> =
                            x.into_data().iter::<f32>().map(f32::to_bits).collect();
                        bits.extend(y.into_data().iter::<f32>().map(f32::to_bits));
                        bits
                    })
                    .collect::<Vec<_>>()
            })
            .collect::<Vec<_>>()
    };
    let one = epochs(1);
    assert_eq!(one.len(), 18);
    assert_eq!(epochs(2), one);
    assert_eq!(epochs(3), one);
}

/// A moving average of the weights: with decay 0.75, after one step it is
/// `0.75 * initial + 0.25 * trained` in f32, bit for bit; it saves beside the model and loads
/// back bit for bit; a name the checkpoint lacks, one that is no file name, or one that begins
/// as the checkpoint's own files do, is an error.
#[test]
fn a_moving_average_updates_saves_and_resumes_beside_the_model() {
    use accelerate_burn::Checkpoint;
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    let acc = accelerator(1);
    let (model, mut optim, train) = acc
        .prepare((Net::new(&acc.device()), SgdConfig::new(), loader(16, 4)))
        .unwrap();
    let initial = model.values();
    let ema = model.clone().no_grad();
    let model = train_updates(&acc, model, &mut optim, &train, 1);
    let ema = acc.ema_update(ema, &model, 0.75).unwrap();
    let expected: Vec<u32> = initial
        .iter()
        .zip(model.values())
        .map(|(a, m)| (a * 0.75 + m * 0.25).to_bits())
        .collect();
    assert_eq!(ema.bits(), expected);
    assert!(acc.ema_update(ema.clone(), &model, 1.5).is_err());

    acc.save_state(&dir, &Checkpoint::new(&model, &optim).module("ema", &ema))
        .unwrap();
    assert!(dir.join("module_ema.safetensors").is_file());
    let acc2 = accelerator(1);
    let (fresh, mut optim2) = acc2
        .prepare((Net::new(&acc2.device()), SgdConfig::new()))
        .unwrap();
    let restored = acc2.load_state(&dir, fresh, &mut optim2, None).unwrap();
    let blank = Net::new(&acc2.device()).no_grad();
    let loaded = restored.info.module("ema", blank.clone()).unwrap();
    assert_eq!(loaded.bits(), ema.bits());
    let err = restored
        .info
        .module("teacher", blank)
        .unwrap_err()
        .to_string();
    assert!(err.contains("no module named \"teacher\""), "{err}");
    let bad = acc
        .save_state(
            tmp.path().join("bad"),
            &Checkpoint::new(&model, &optim).module("a/b", &ema),
        )
        .unwrap_err()
        .to_string();
    assert!(bad.contains("not a file name"), "{bad}");
    // Names that begin as the checkpoint's own files do would share their paths (a pair
    // `zero3_burn_optimizer_0` is the directory of rank 0's ZeRO-3 Burn optimizer record).
    for name in ["zero3_burn_optimizer_0", "fused_optimizer_1", "rank_0"] {
        let as_module = Checkpoint::new(&model, &optim).module(name, &ema);
        let as_pair = Checkpoint::new(&model, &optim).pair(name, &ema, &optim);
        for (what, checkpoint) in [("module", as_module), ("pair", as_pair)] {
            let err = acc
                .save_state(tmp.path().join(name), &checkpoint)
                .unwrap_err()
                .to_string();
            assert!(
                err.contains("begins as the checkpoint's own"),
                "{what} {name}: {err}"
            );
        }
    }
}

/// Two models, each with its own prepared optimizer (Burn's SGD and the fused AdamW, the
/// second with a learning-rate schedule of its own), trained in one loop with windows of 2:
/// each keeps windows of its own (the second backward pass of a batch does not advance the
/// first model's window), each ends bit for bit where it ends trained alone, and a checkpoint
/// holding both (and the second's scheduler) resumes both bit for bit.
#[test]
fn two_models_with_their_own_optimizers_train_as_if_alone_and_resume_together() {
    use accelerate_burn::{Checkpoint, PreparedOptimizer};
    let device = Device::default().autodiff();
    let (first, second) = (Net::new(&device), Net::new(&device));
    let epochs = 2;
    let step = |acc: &Accelerator<DefaultBackend>,
                model: Net,
                optim: &mut PreparedOptimizer,
                batch: (Tensor<2>, Tensor<2>),
                lr: f64| {
        let grads = acc.backward(model.loss(batch), &model).unwrap();
        optim.step(lr, model, grads).unwrap()
    };
    // The second model's learning rate follows a schedule of its own optimizer's updates.
    let schedule = || LinearLrSchedulerConfig::new(1e-2, 1e-3, 10).init().unwrap();
    let alone = |initial: Net, fused: bool| {
        let acc = accelerator(2);
        let (mut model, mut optim, train) = if fused {
            acc.prepare((initial, AdamWConfig::new(), loader(40, 4)))
        } else {
            acc.prepare((initial, SgdConfig::new().init(), loader(40, 4)))
        }
        .unwrap();
        let mut scheduler = acc.prepare_scheduler(schedule());
        for epoch in 0..epochs {
            train.set_epoch(epoch);
            for batch in train.iter() {
                let lr = if fused { scheduler.step().base() } else { 1e-2 };
                model = step(&acc, model, &mut optim, batch.unwrap(), lr);
            }
        }
        (model.bits(), optim.updates())
    };
    // `Save(n, dir)`: save into `dir` after n updates and stop; `Resume(dir)`: continue from it.
    enum Run<'a> {
        Whole,
        Save(u64, &'a std::path::Path),
        Resume(&'a std::path::Path),
    }
    let together = |run: Run<'_>| {
        let acc = accelerator(2);
        let train = acc.prepare_data_loader(loader(40, 4)).unwrap();
        let (mut a, mut optim_a) = acc
            .prepare((first.clone(), SgdConfig::new().init()))
            .unwrap();
        let (mut b, mut optim_b) = acc.prepare((second.clone(), AdamWConfig::new())).unwrap();
        assert!(acc.prepare((b.clone(), SgdConfig::new())).is_err());
        let mut scheduler_b = acc.prepare_scheduler_for(&optim_b, schedule());
        if let Run::Resume(dir) = run {
            let restored = acc.load_state(dir, a, &mut optim_a, None).unwrap();
            a = restored.model;
            let scheduler = Some(&mut scheduler_b);
            b = acc
                .load_pair(&restored.info, "second", b, &mut optim_b, scheduler)
                .unwrap();
            let err = acc
                .load_pair(&restored.info, "third", b.clone(), &mut optim_b, None)
                .unwrap_err()
                .to_string();
            assert!(err.contains("as \"third\""), "{err}");
        }
        for epoch in train.epoch()..epochs {
            train.set_epoch(epoch);
            for batch in train.iter() {
                let batch = batch.unwrap();
                a = step(&acc, a, &mut optim_a, batch.clone(), 1e-2);
                let lr = scheduler_b.step().base();
                b = step(&acc, b, &mut optim_b, batch, lr);
                if let Run::Save(updates, dir) = run
                    && optim_a.updates() == updates
                    && acc.sync_gradients()
                {
                    let checkpoint = Checkpoint::new(&a, &optim_a).pair_with_scheduler(
                        "second",
                        &b,
                        &optim_b,
                        &scheduler_b,
                    );
                    acc.save_state(dir, &checkpoint).unwrap();
                    return None;
                }
            }
        }
        Some(((a.bits(), optim_a.updates()), (b.bits(), optim_b.updates())))
    };
    let (alone_a, alone_b) = (alone(first.clone(), false), alone(second.clone(), true));
    assert_eq!(alone_a.1, 10, "2 epochs of 10 batches in windows of 2");
    let uninterrupted = together(Run::Whole).unwrap();
    assert_eq!(uninterrupted, (alone_a, alone_b));

    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");
    assert!(together(Run::Save(3, &dir)).is_none());
    assert!(dir.join("second").join("model.safetensors").is_file());
    assert!(dir.join("second").join("scheduler.bpk").is_file());
    let resumed = together(Run::Resume(&dir)).unwrap();
    assert_eq!(resumed, uninterrupted);
}

/// Models built again after a restart have parameter ids of their own; loading a checkpoint
/// gives them the saved ones, and `backward` must then find each model's own optimizer under
/// those ids. With two models there is no one-model fallback to hide a miss: each resumed
/// model steps on bit for bit as the saved run did.
#[test]
fn rebuilt_models_are_found_by_backward_after_a_load() {
    use accelerate_burn::{Checkpoint, PreparedOptimizer};
    let device = Device::default().autodiff();
    let step = |acc: &Accelerator<DefaultBackend>,
                model: Net,
                optim: &mut PreparedOptimizer,
                batch: (Tensor<2>, Tensor<2>)| {
        let grads = acc.backward(model.loss(batch), &model).unwrap();
        optim.step(1e-2, model, grads).unwrap()
    };
    let batch = |acc: &Accelerator<DefaultBackend>| {
        let eval = acc.prepare_eval_data_loader(loader(40, 4)).unwrap();
        eval.iter().next().unwrap().unwrap()
    };
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("ckpt");

    let acc = accelerator(1);
    let (a, mut optim_a) = acc
        .prepare((Net::new(&device), SgdConfig::new().init()))
        .unwrap();
    let (b, mut optim_b) = acc
        .prepare((Net::new(&device), AdamWConfig::new()))
        .unwrap();
    let a = step(&acc, a, &mut optim_a, batch(&acc));
    let b = step(&acc, b, &mut optim_b, batch(&acc));
    let checkpoint = Checkpoint::new(&a, &optim_a).pair("second", &b, &optim_b);
    acc.save_state(&dir, &checkpoint).unwrap();
    drop(checkpoint);
    let saved_run = (
        step(&acc, a, &mut optim_a, batch(&acc)).bits(),
        step(&acc, b, &mut optim_b, batch(&acc)).bits(),
    );

    let acc = accelerator(1);
    let (a, mut optim_a) = acc
        .prepare((Net::new(&device), SgdConfig::new().init()))
        .unwrap();
    let (b, mut optim_b) = acc
        .prepare((Net::new(&device), AdamWConfig::new()))
        .unwrap();
    let restored = acc.load_state(&dir, a, &mut optim_a, None).unwrap();
    let b = acc
        .load_pair(&restored.info, "second", b, &mut optim_b, None)
        .unwrap();
    let a = step(&acc, restored.model, &mut optim_a, batch(&acc));
    let b = step(&acc, b, &mut optim_b, batch(&acc));
    assert_eq!((optim_a.updates(), optim_b.updates()), (2, 2));
    assert_eq!((a.bits(), b.bits()), saved_run);
}

/// A tracker of the user's own, registered on the builder: it gets the run's configuration
/// (the script's and the accelerator's `accelerate.*`), every value and text, and the end of
/// the run with the status the accelerator's end gives it; its failure is a warning unless
/// asked to be an error.
#[test]
fn a_users_tracker_gets_the_run_and_its_failures_are_fatal_only_when_asked() {
    use accelerate_burn::{GeneralTracker, RunInfo, RunStatus, TrackerError};
    use std::sync::{Arc, Mutex};

    struct Recorder(Arc<Mutex<Vec<String>>>, bool);
    impl GeneralTracker for Recorder {
        fn name(&self) -> &str {
            "recorder"
        }
        fn start(&mut self, run: &RunInfo) -> Result<(), TrackerError> {
            let keys: Vec<String> = run.config.iter().map(|(k, v)| format!("{k}={v}")).collect();
            self.0
                .lock()
                .unwrap()
                .push(format!("start {} {}", run.project, keys.join(" ")));
            Ok(())
        }
        fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), TrackerError> {
            self.0
                .lock()
                .unwrap()
                .push(format!("log {step} {metrics:?}"));
            match self.1 {
                true => Err(TrackerError::Other {
                    tracker: "recorder".into(),
                    message: "disk full".into(),
                }),
                false => Ok(()),
            }
        }
        fn log_text(&mut self, step: u64, name: &str, text: &str) -> Result<(), TrackerError> {
            self.0
                .lock()
                .unwrap()
                .push(format!("text {step} {name} {text}"));
            Ok(())
        }
        fn finish(&mut self, status: RunStatus) -> Result<(), TrackerError> {
            self.0.lock().unwrap().push(format!("finish {status:?}"));
            Ok(())
        }
    }

    for (failing, fatal) in [(false, false), (true, false), (true, true)] {
        let calls = Arc::new(Mutex::new(Vec::new()));
        let acc = Accelerator::<DefaultBackend>::builder()
            .process_state(ProcessState::single())
            .gradient_accumulation_steps(2)
            .add_tracker(Recorder(calls.clone(), failing))
            .tracker_errors_fatal(fatal)
            .build()
            .unwrap();
        acc.init_trackers("demo", &serde_json::json!({"lr": 0.5}))
            .unwrap();
        let logged = acc.log(&[("loss", 1.5)], 3);
        assert_eq!(logged.is_err(), fatal);
        if let Err(err) = logged {
            assert!(
                err.to_string()
                    .contains("rank 0: recorder tracker: disk full"),
                "{err}"
            );
        }
        acc.log_text("sample", "to be", 3).unwrap();
        drop(acc);
        let calls = calls.lock().unwrap();
        assert_eq!(calls.len(), 4, "{calls:?}");
        assert!(calls[0].starts_with("start demo "), "{}", calls[0]);
        for key in [
            "lr=0.5",
            "accelerate.num_processes=1",
            "accelerate.config.gradient_accumulation_steps=2",
        ] {
            assert!(calls[0].contains(key), "{key}: {}", calls[0]);
        }
        assert_eq!(calls[1], "log 3 [(\"loss\", 1.5)]");
        assert_eq!(calls[2], "text 3 sample to be");
        assert_eq!(calls[3], "finish Finished");
    }

    // A build refused for its settings leaves no log file behind.
    let dir = tempfile::tempdir().unwrap();
    let refused = Accelerator::<DefaultBackend>::builder()
        .process_state(ProcessState::single())
        .project_dir(dir.path())
        .log_with(&[accelerate_burn::Tracker::Csv])
        .checkpoint_total_limit(0)
        .build();
    assert!(refused.is_err());
    assert!(!dir.path().join("logs").exists());

    // MLflow without a server to talk to is an error at build, saying what to set.
    if std::env::var_os("MLFLOW_TRACKING_URI").is_none() {
        let err = Accelerator::<DefaultBackend>::builder()
            .process_state(ProcessState::single())
            .log_with(&[accelerate_burn::Tracker::MLflow])
            .build()
            .err()
            .unwrap();
        assert!(
            err.to_string().contains("MLFLOW_TRACKING_URI is not set"),
            "{err}"
        );
    }
}
