//! Sharded units (ZeRO-3) in one process: the gather and its backward change no number, so a
//! model of sharded units trains bit for bit as the same model unsharded; resharding after
//! forward gathers again in backward; a sharded model is refused where whole parameters are
//! needed. (Several processes: examples/tests/data_parallel.rs.)

use accelerate_burn::{
    AccelerateError, Accelerator, AcceleratorBackend, DefaultBackend, FusedOptimizer, ProcessState,
    Sharded, Unit,
};
use burn::module::{Module, Param, ParamId};
use burn::nn::{BatchNorm, BatchNormConfig, Initializer, Linear, LinearConfig, Relu};
use burn::optim::AdamWConfig;
use burn::store::{ModuleSnapshot, SafetensorsStore};
use burn::tensor::{Bool, DType, Device, Int, Tensor, TensorData};

#[path = "../../tests-support/tools.rs"]
mod tools;

const FEATURES: usize = 6;
const HIDDEN: usize = 16;

#[derive(Module, Debug)]
struct Net {
    hidden: Linear,
    out: Linear,
    act: Relu,
}

#[derive(Module, Debug)]
struct ShardedNet {
    hidden: Sharded<Linear>,
    out: Sharded<Linear>,
    act: Relu,
}

impl Net {
    fn new(device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(FEATURES, HIDDEN).init(device),
            out: LinearConfig::new(HIDDEN, 1).init(device),
            act: Relu::new(),
        }
    }

    /// The same shapes with every weight zero (not what any draw of the random stream
    /// gives, whatever other tests seed meanwhile).
    fn zeros(device: &Device) -> Self {
        let zeros = |d_in, d_out| {
            LinearConfig::new(d_in, d_out)
                .with_initializer(Initializer::Zeros)
                .init(device)
        };
        Self {
            hidden: zeros(FEATURES, HIDDEN),
            out: zeros(HIDDEN, 1),
            act: Relu::new(),
        }
    }

    fn loss(&self, (x, y): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
        let h = self.act.forward(self.hidden.forward(x));
        (self.out.forward(h) - y).square().mean()
    }
}

impl ShardedNet {
    fn new(acc: &Accelerator<DefaultBackend>, net: Net) -> Result<Self, AccelerateError> {
        Ok(Self {
            hidden: acc.shard(net.hidden)?,
            out: acc.shard(net.out)?,
            act: net.act,
        })
    }

    /// The hidden layer gathered after its input (`gather_for`), the output layer at the
    /// bottom of the graph (`gather`): the two give the same numbers.
    fn loss(&self, (x, y): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
        let h = self.act.forward(self.hidden.gather_for(&x).forward(x));
        (self.out.gather().forward(h) - y).square().mean()
    }

    fn whole(&self) -> Net {
        Net {
            hidden: self.hidden.gather(),
            out: self.out.gather(),
            act: Relu::new(),
        }
    }
}

fn bits(net: &Net) -> Vec<u32> {
    let mut out = Vec::new();
    for linear in [&net.hidden, &net.out] {
        let mut tensors = vec![linear.weight.val().into_data()];
        tensors.extend(linear.bias.as_ref().map(|b| b.val().into_data()));
        for data in tensors {
            out.extend(data.iter::<f32>().map(f32::to_bits));
        }
    }
    out
}

fn batch(step: usize, device: &Device) -> (Tensor<2>, Tensor<2>) {
    let rows = 8;
    let x: Vec<f32> = (0..rows * FEATURES)
        .map(|i| (((i + step * 7) * 31 % 23) as f32) / 11.0 - 1.0)
        .collect();
    let y: Vec<f32> = (0..rows).map(|i| ((i + step) as f32 * 0.7).sin()).collect();
    (
        Tensor::from_data(TensorData::new(x, [rows, FEATURES]), device),
        Tensor::from_data(TensorData::new(y, [rows, 1]), device),
    )
}

fn accelerator(stage: u8, accumulation: usize) -> Accelerator<DefaultBackend> {
    Accelerator::builder()
        .process_state(ProcessState::single())
        .zero_stage(stage)
        .gradient_accumulation_steps(accumulation)
        .seed(5)
        .build()
        .unwrap()
}

/// On one process a gather is a copy and its backward's mean over one rank multiplies by 1:
/// a model of sharded units takes the same steps as the unsharded model, bit for bit, with
/// Burn's AdamW and with the fused one, with accumulation and global clipping.
#[test]
fn sharded_units_on_one_process_train_bit_for_bit_as_the_unsharded_model() {
    for fused in [false, true] {
        let (plain_acc, sharded_acc) = (accelerator(0, 2), accelerator(3, 2));
        let initial = Net::new(&plain_acc.device());
        let optimizer = || -> FusedOptimizer {
            FusedOptimizer::adamw(&AdamWConfig::new().with_weight_decay(0.01)).unwrap()
        };

        let (mut plain, mut plain_optim) = if fused {
            plain_acc.prepare((initial.clone(), optimizer())).unwrap()
        } else {
            plain_acc
                .prepare((
                    initial.clone(),
                    AdamWConfig::new().with_weight_decay(0.01).init(),
                ))
                .unwrap()
        };
        let sharded = ShardedNet::new(&sharded_acc, initial).unwrap();
        let (mut sharded, mut sharded_optim) = if fused {
            sharded_acc.prepare((sharded, optimizer())).unwrap()
        } else {
            sharded_acc
                .prepare((sharded, AdamWConfig::new().with_weight_decay(0.01).init()))
                .unwrap()
        };
        for step in 0..12 {
            let mut grads = plain_acc
                .backward(plain.loss(batch(step, &plain_acc.device())), &plain)
                .unwrap();
            let plain_norm = plain_acc.clip_grad_norm(&plain, &mut grads, 0.5).unwrap();
            plain = plain_optim.step(1e-2, plain, grads).unwrap();

            let mut grads = sharded_acc
                .backward(sharded.loss(batch(step, &sharded_acc.device())), &sharded)
                .unwrap();
            let sharded_norm = sharded_acc
                .clip_grad_norm(&sharded, &mut grads, 0.5)
                .unwrap();
            sharded = sharded_optim.step(1e-2, sharded, grads).unwrap();
            assert_eq!(
                plain_norm.map(f32::to_bits),
                sharded_norm.map(f32::to_bits),
                "fused {fused}, step {step}: gradient norms"
            );
        }
        assert_eq!(sharded_optim.updates(), 6);
        assert_eq!(
            bits(&plain),
            bits(&sharded.whole()),
            "fused {fused}: parameters"
        );
    }
}

/// A layer and its batch norm: a unit whose running statistics forward updates.
#[derive(Module, Debug)]
struct NormBlock {
    linear: Linear,
    norm: BatchNorm,
}

/// A [`NormBlock`] unit, whole or sharded, and an output layer.
#[derive(Module, Debug)]
struct NormNet<L: Module = NormBlock> {
    block: L,
    out: Linear,
}

impl NormNet {
    fn new(device: &Device) -> Self {
        Self {
            block: NormBlock {
                linear: LinearConfig::new(FEATURES, HIDDEN).init(device),
                norm: BatchNormConfig::new(HIDDEN).init(device),
            },
            out: LinearConfig::new(HIDDEN, 1).init(device),
        }
    }
}

impl<L: Unit<NormBlock>> NormNet<L> {
    fn output(&self, x: Tensor<2>) -> Tensor<2> {
        let block = self.block.whole();
        self.out
            .forward(block.norm.forward(block.linear.forward(x)))
    }

    fn loss(&self, (x, y): (Tensor<2>, Tensor<2>)) -> Tensor<1> {
        (self.output(x) - y).square().mean()
    }

    /// The running mean and variance, bit patterns.
    fn statistics(&self) -> Vec<u32> {
        let norm = self.block.whole().norm;
        [norm.running_mean.value(), norm.running_var.value()]
            .into_iter()
            .flat_map(|state| state.into_data().iter::<f32>().collect::<Vec<_>>())
            .map(f32::to_bits)
            .collect()
    }
}

/// A batch norm inside a sharded unit keeps its running statistics: they are buffers, left
/// whole on every process, updated by each forward pass and kept from one gather to the next
/// (FSDP does not shard buffers either). The sharded model trains, keeps its statistics and
/// evaluates bit for bit as the unsharded one, with Burn's and the fused AdamW; its saved file
/// carries them, into plain Burn and back into a sharded model.
#[test]
fn a_batch_norm_in_a_sharded_unit_keeps_its_running_statistics() {
    for fused in [false, true] {
        let (plain_acc, sharded_acc) = (accelerator(0, 1), accelerator(3, 1));
        let device = plain_acc.device();
        let initial = NormNet::new(&device);
        let sharded = NormNet {
            block: sharded_acc.shard(initial.block.clone()).unwrap(),
            out: initial.out.clone(),
        };
        let adamw = AdamWConfig::new();
        let (mut plain, mut plain_optim, mut sharded, mut sharded_optim) = if fused {
            let (p, po) = plain_acc
                .prepare((initial, FusedOptimizer::adamw(&adamw).unwrap()))
                .unwrap();
            let (s, so) = sharded_acc
                .prepare((sharded, FusedOptimizer::adamw(&adamw).unwrap()))
                .unwrap();
            (p, po, s, so)
        } else {
            let (p, po) = plain_acc.prepare((initial, adamw.init())).unwrap();
            let (s, so) = sharded_acc.prepare((sharded, adamw.init())).unwrap();
            (p, po, s, so)
        };
        let untrained = plain.statistics();
        for step in 0..6 {
            let grads = plain_acc
                .backward(plain.loss(batch(step, &device)), &plain)
                .unwrap();
            plain = plain_optim.step(1e-2, plain, grads).unwrap();
            let grads = sharded_acc
                .backward(sharded.loss(batch(step, &device)), &sharded)
                .unwrap();
            sharded = sharded_optim.step(1e-2, sharded, grads).unwrap();
            assert_eq!(
                plain.statistics(),
                sharded.statistics(),
                "fused {fused}, step {step}: running statistics"
            );
        }
        assert_ne!(plain.statistics(), untrained, "the statistics never moved");
        let (x, _) = batch(99, &device);
        let evaluated = |output: Tensor<2>| -> Vec<u32> {
            output.into_data().iter::<f32>().map(f32::to_bits).collect()
        };
        assert_eq!(
            evaluated(plain.valid().output(x.clone().inner())),
            evaluated(sharded.valid().output(x.inner())),
            "fused {fused}: evaluation with the running statistics"
        );
        let dir = tempfile::tempdir().unwrap();
        let file = sharded_acc.save_model(&sharded, dir.path()).unwrap();
        let mut into_plain = NormNet::new(&device);
        into_plain
            .load_from(&mut SafetensorsStore::from_file(&file))
            .unwrap();
        assert_eq!(into_plain.statistics(), plain.statistics());
        let fresh = NormNet {
            block: sharded_acc.shard(NormNet::new(&device).block).unwrap(),
            out: LinearConfig::new(HIDDEN, 1).init(&device),
        };
        let loaded = sharded_acc.load_model(fresh, &file).unwrap();
        assert_eq!(loaded.statistics(), plain.statistics(), "fused {fused}");
    }
}

/// Resharding (the default) frees the gathered weights after forward and gathers again the
/// one a backward pass needs: the output layer's weight, whose input is tracked (the hidden
/// layer's weight is not needed by its backward, whose input is data, nor are the biases).
/// Without it, only the forward's gathers run; both give the same gradients.
#[test]
fn resharding_after_forward_gathers_again_in_backward_only_what_backward_needs() {
    let mut gradients = Vec::new();
    for reshard in [true, false] {
        let acc = accelerator(3, 1);
        let device = acc.device();
        let net = ShardedNet::new(&acc, Net::new(&device)).unwrap();
        let net = ShardedNet {
            hidden: net.hidden.reshard_after_forward(reshard),
            out: net.out.reshard_after_forward(reshard),
            act: net.act,
        };
        let net = acc.prepare_model(net).unwrap();
        let loss = net.loss(batch(0, &device));
        assert_eq!(acc.sharded_gathers(), 4, "reshard {reshard}: forward");
        let grads = acc.backward(loss, &net).unwrap();
        let expected = if reshard { 5 } else { 4 };
        assert_eq!(
            acc.sharded_gathers(),
            expected,
            "reshard {reshard}: backward"
        );
        gradients.push(
            grads
                .to_params()
                .map(|g| g.len())
                .expect("Burn's gradients"),
        );
    }
    assert_eq!(gradients, [4, 4]);
}

/// Sharded units belong to ZeRO-3, and ZeRO-3 needs them.
#[test]
fn sharding_is_zero_3_and_zero_3_needs_sharded_units() {
    let acc = accelerator(2, 1);
    let err = acc.shard(Net::new(&acc.device())).unwrap_err().to_string();
    assert!(err.contains("zero_stage(3)"), "{err}");

    let acc = accelerator(3, 1);
    let Err(err) = acc.prepare((Net::new(&acc.device()), AdamWConfig::new().init())) else {
        panic!("a model without sharded units was prepared at stage 3");
    };
    let err = err.to_string();
    assert!(err.contains("no sharded unit"), "{err}");
}

/// A model of sharded units is saved whole, a parameter gathered at a time, under the paths
/// of the unsharded model: plain Burn loads `save_model`'s file, and `merge-weights` of
/// `save_model_sharded`'s shards, into the unsharded model, bit for bit; `load_model` reads
/// either into another sharded model (each process only its shard of each parameter).
#[test]
fn a_sharded_model_saves_whole_files_plain_burn_loads() {
    let acc = accelerator(3, 1);
    let net = ShardedNet::new(&acc, Net::new(&acc.device())).unwrap();
    let expected = bits(&net.whole());
    let dir = tempfile::tempdir().unwrap();
    let file = acc.save_model(&net, dir.path()).unwrap();
    let load = |path: &std::path::Path| {
        let mut store = SafetensorsStore::from_file(path);
        let mut plain = Net::new(&Device::default());
        plain.load_from(&mut store).unwrap();
        bits(&plain)
    };
    assert_eq!(load(&file), expected);

    // 16 x 6 + 16 + 16 + 1 floats in shards of at most 128 bytes.
    let sharded = dir.path().join("sharded");
    let files = acc.save_model_sharded(&net, &sharded, 128).unwrap();
    assert!(files.len() > 2, "{files:?}");
    let merged = dir.path().join("merged");
    accelerate_core::weights::merge_sharded(&sharded, &merged).unwrap();
    assert_eq!(load(&merged.join("model.safetensors")), expected);

    for source in [file, sharded] {
        let fresh = ShardedNet::new(&acc, Net::zeros(&acc.device())).unwrap();
        assert_ne!(bits(&fresh.whole()), expected);
        let loaded = acc.load_model(fresh, &source).unwrap();
        assert_eq!(bits(&loaded.whole()), expected, "{}", source.display());
    }
    let other = ShardedNet::new(&acc, Net::new(&acc.device())).unwrap();
    let err = acc
        .load_model(other, dir.path().join("nothing.safetensors"))
        .unwrap_err()
        .to_string();
    assert!(err.contains("nothing.safetensors"), "{err}");
}

impl Net {
    /// Every weight and bias `value` (deterministic whatever other tests draw meanwhile).
    fn constant(device: &Device, value: f64) -> Self {
        let constant = |d_in, d_out| {
            LinearConfig::new(d_in, d_out)
                .with_initializer(Initializer::Constant { value })
                .init(device)
        };
        Self {
            hidden: constant(FEATURES, HIDDEN),
            out: constant(HIDDEN, 1),
            act: Relu::new(),
        }
    }
}

/// Two models with sharded units, each with its own fused AdamW, saved together (the second
/// as a pair, `Checkpoint::pair`) after 4 steps and resumed: both end bit for bit where an
/// uninterrupted run of 8 steps ends.
#[test]
fn a_pair_of_sharded_models_resumes_bit_for_bit() {
    let dir = tempfile::tempdir().unwrap();
    let checkpoint = dir.path().join("checkpoint");
    let train = |steps: std::ops::Range<usize>, save: bool, resume: bool| {
        let acc = accelerator(3, 1);
        let device = acc.device();
        let adamw = || FusedOptimizer::adamw(&AdamWConfig::new()).unwrap();
        let a = ShardedNet::new(&acc, Net::constant(&device, 0.05)).unwrap();
        let b = ShardedNet::new(&acc, Net::constant(&device, -0.03)).unwrap();
        let (mut a, mut optim_a) = acc.prepare((a, adamw())).unwrap();
        let (mut b, mut optim_b) = acc.prepare((b, adamw())).unwrap();
        if resume {
            let restored = acc.load_state(&checkpoint, a, &mut optim_a, None).unwrap();
            a = restored.model;
            b = acc
                .load_pair(&restored.info, "second", b, &mut optim_b, None)
                .unwrap();
        }
        for step in steps {
            let grads = acc.backward(a.loss(batch(step, &device)), &a).unwrap();
            a = optim_a.step(1e-2, a, grads).unwrap();
            let grads = acc
                .backward(b.loss(batch(step + 100, &device)), &b)
                .unwrap();
            b = optim_b.step(1e-2, b, grads).unwrap();
        }
        if save {
            let both = accelerate_burn::Checkpoint::new(&a, &optim_a).pair("second", &b, &optim_b);
            acc.save_state(&checkpoint, &both).unwrap();
        }
        (bits(&a.whole()), bits(&b.whole()))
    };
    let whole = train(0..8, false, false);
    train(0..4, true, false);
    let resumed = train(4..8, false, true);
    assert_eq!(resumed.0, whole.0, "the checkpoint's model");
    assert_eq!(resumed.1, whole.1, "the pair");
    let files: Vec<String> = std::fs::read_dir(checkpoint.join("second"))
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        files.iter().any(|f| f.starts_with("zero3_model_")),
        "{files:?}"
    );
    assert!(
        !files.contains(&"model.safetensors".to_string()),
        "{files:?}"
    );
}

/// Saving a model with sharded units never writes over a model someone else put in the
/// directory (a hub download): with their whole file, a sharded save stops; with their
/// index, a whole save stops; their files stay as they were.
#[test]
fn a_sharded_model_is_never_saved_over_someone_elses_model() {
    let acc = accelerator(3, 1);
    let net = ShardedNet::new(&acc, Net::constant(&acc.device(), 0.1)).unwrap();

    let theirs = tempfile::tempdir().unwrap();
    let whole = theirs.path().join("model.safetensors");
    std::fs::write(&whole, b"their weights").unwrap();
    let err = acc
        .save_model_sharded(&net, theirs.path(), 128)
        .unwrap_err()
        .to_string();
    assert!(err.contains("did not write"), "{err}");
    assert_eq!(std::fs::read(&whole).unwrap(), b"their weights");
    assert_eq!(std::fs::read_dir(theirs.path()).unwrap().count(), 1);

    let theirs = tempfile::tempdir().unwrap();
    let index = theirs.path().join("model.safetensors.index.json");
    let text =
        br#"{"metadata":{"total_size":4},"weight_map":{"w":"model-00001-of-00002.safetensors"}}"#;
    std::fs::write(&index, text).unwrap();
    let err = acc.save_model(&net, theirs.path()).unwrap_err().to_string();
    assert!(err.contains("did not write"), "{err}");
    assert_eq!(std::fs::read(&index).unwrap(), text);
    assert_eq!(std::fs::read_dir(theirs.path()).unwrap().count(), 1);
}

/// `Net` with an Int and a Bool parameter beside its floats (a step counter, a mask).
#[derive(Module, Debug)]
struct Counted {
    net: Net,
    steps: Param<Tensor<1, Int>>,
    mask: Param<Tensor<2, Bool>>,
}

/// `Counted` with its layers sharded.
#[derive(Module, Debug)]
struct ShardedCounted {
    net: ShardedNet,
    steps: Param<Tensor<1, Int>>,
    mask: Param<Tensor<2, Bool>>,
}

/// An Int and a Bool parameter: `[3, 1, 4, 1, 5]` and a diagonal mask, or zeros and false.
fn counters(device: &Device, set: bool) -> (Param<Tensor<1, Int>>, Param<Tensor<2, Bool>>) {
    let steps: Vec<i64> = if set { vec![3, 1, 4, 1, 5] } else { vec![0; 5] };
    let mask = [set, false, false, set];
    (
        Param::initialized(
            ParamId::new(),
            Tensor::from_data(TensorData::new(steps, [5]), device),
        ),
        Param::initialized(
            ParamId::new(),
            Tensor::from_data(TensorData::new(mask.to_vec(), [2, 2]), device),
        ),
    )
}

/// Every value of a counted model: float bits, then the Int values, then the Bool values.
fn counted_values(
    net: &Net,
    steps: &Param<Tensor<1, Int>>,
    mask: &Param<Tensor<2, Bool>>,
) -> (Vec<u32>, Vec<i64>, Vec<bool>) {
    (
        bits(net),
        steps.val().into_data().iter::<i64>().collect(),
        mask.val().into_data().iter::<bool>().collect(),
    )
}

/// A model with sharded units and Int and Bool parameters keeps them through its files:
/// `save_model` writes every tensor plain Burn's save writes (plain Burn's strict load reads
/// it back whole), `save_model_sharded`'s shards load into another sharded model, and a file
/// plain Burn saved from the unsharded model loads into the sharded one.
#[test]
fn a_sharded_model_keeps_its_int_and_bool_parameters_in_every_file() {
    let acc = accelerator(3, 1);
    let device = acc.device();
    let (steps, mask) = counters(&device, true);
    let model = ShardedCounted {
        net: ShardedNet::new(&acc, Net::new(&device)).unwrap(),
        steps,
        mask,
    };
    let expected = counted_values(&model.net.whole(), &model.steps, &model.mask);
    let fresh = || {
        let (steps, mask) = counters(&device, false);
        ShardedCounted {
            net: ShardedNet::new(&acc, Net::zeros(&device)).unwrap(),
            steps,
            mask,
        }
    };
    let dir = tempfile::tempdir().unwrap();

    let file = acc.save_model(&model, dir.path()).unwrap();
    let (steps, mask) = counters(&Device::default(), false);
    let mut plain = Counted {
        net: Net::zeros(&Device::default()),
        steps,
        mask,
    };
    plain
        .load_from(&mut SafetensorsStore::from_file(&file))
        .unwrap();
    assert_eq!(
        counted_values(&plain.net, &plain.steps, &plain.mask),
        expected
    );

    let sharded = dir.path().join("sharded");
    let files = acc.save_model_sharded(&model, &sharded, 128).unwrap();
    assert!(files.len() > 2, "{files:?}");

    let burns = dir.path().join("burns.safetensors");
    plain
        .save_into(&mut SafetensorsStore::from_file(&burns))
        .unwrap();

    for source in [file, sharded, burns] {
        let loaded = acc.load_model(fresh(), &source).unwrap();
        assert_eq!(
            counted_values(&loaded.net.whole(), &loaded.steps, &loaded.mask),
            expected,
            "{}",
            source.display()
        );
    }
}

/// Every float value of `net` rounded once to `dtype` (BF16 or F16) and back, in `bits`'s
/// order.
fn rounded(net: &Net, dtype: DType) -> Vec<f32> {
    bits(net)
        .into_iter()
        .map(|b| {
            let v = f32::from_bits(b);
            match dtype {
                DType::BF16 => half::bf16::from_f32(v).to_f32(),
                _ => half::f16::from_f32(v).to_f32(),
            }
        })
        .collect()
}

/// The safetensors dtype of every tensor in the file at `path`.
fn file_dtypes(path: &std::path::Path) -> Vec<String> {
    let header = accelerate_core::weights::read_header(path).unwrap();
    header.tensors.values().map(|t| t.dtype.clone()).collect()
}

/// `export_dtype(BF16 | F16)`: `save_model`, `save_model_sharded` (and `merge-weights` of its
/// shards) and the whole save of a model with sharded units write every float tensor in that
/// dtype, each value the f32 one rounded to nearest even once: half the bytes. Plain Burn
/// loads the file into its f32 model, `load_model` reads it back, and Python's safetensors
/// reads the same values.
#[test]
fn models_export_in_half_precision_that_plain_burn_and_python_read() {
    for (dtype, name) in [(DType::BF16, "BF16"), (DType::F16, "F16")] {
        let acc = Accelerator::<DefaultBackend>::builder()
            .process_state(ProcessState::single())
            .zero_stage(3)
            .export_dtype(dtype)
            .build()
            .unwrap();
        let device = acc.device();
        let net = Net::new(&device);
        let expected = rounded(&net, dtype);
        let dir = tempfile::tempdir().unwrap();
        let sharded_net = ShardedNet::new(&acc, Net::new(&device)).unwrap();
        let sharded_expected = rounded(&sharded_net.whole(), dtype);

        let whole = acc.save_model(&net, dir.path().join("whole")).unwrap();
        let shards = dir.path().join("shards");
        let shard_files = acc.save_model_sharded(&net, &shards, 256).unwrap();
        assert!(shard_files.len() > 2, "{shard_files:?}");
        let merged = dir.path().join("merged");
        accelerate_core::weights::merge_sharded(&shards, &merged).unwrap();
        let zero3 = acc
            .save_model(&sharded_net, dir.path().join("zero3"))
            .unwrap();
        let f32_bytes = (bits(&net).len() * 4) as u64;
        for file in [&whole, &merged.join("model.safetensors"), &zero3] {
            let dtypes = file_dtypes(file);
            assert!(dtypes.iter().all(|d| d == name), "{file:?}: {dtypes:?}");
            let size = std::fs::metadata(file).unwrap().len();
            assert!(size < f32_bytes / 2 + 1024, "{file:?}: {size} bytes");
        }
        for file in shard_files
            .iter()
            .filter(|f| f.extension().is_some_and(|e| e == "safetensors"))
        {
            assert!(file_dtypes(file).iter().all(|d| d == name), "{file:?}");
        }
        // Plain Burn loads the tensors as they are stored: bf16/f16 parameters, on a backend
        // that has the dtype (ndarray has neither).
        let merged = merged.join("model.safetensors");
        let plain_device = Device::default();
        if DefaultBackend::float_dtypes(&plain_device).contains(&dtype) {
            for (file, want) in [
                (&whole, &expected),
                (&merged, &expected),
                (&zero3, &sharded_expected),
            ] {
                let mut plain = Net::zeros(&plain_device);
                plain
                    .load_from(&mut SafetensorsStore::from_file(file))
                    .unwrap();
                assert_eq!(plain.hidden.weight.val().dtype(), dtype, "{file:?}");
                let got: Vec<f32> = bits(&plain).into_iter().map(f32::from_bits).collect();
                assert_eq!(&got, want, "{name} {file:?}");
            }
        }
        // Ours gives each parameter the model's own dtype (f32 here), whole and into sharded
        // units, from the file and from the shards.
        for source in [&whole, &shards, &merged] {
            let loaded = acc.load_model(Net::zeros(&device), source).unwrap();
            assert_eq!(loaded.hidden.weight.val().dtype(), DType::F32);
            let got: Vec<f32> = bits(&loaded).into_iter().map(f32::from_bits).collect();
            assert_eq!(got, expected, "{name} {source:?}");
            let fresh = ShardedNet::new(&acc, Net::zeros(&device)).unwrap();
            let loaded = acc.load_model(fresh, source).unwrap();
            let got: Vec<f32> = bits(&loaded.whole())
                .into_iter()
                .map(f32::from_bits)
                .collect();
            assert_eq!(got, expected, "{name} {source:?} into sharded units");
        }
        // Python's safetensors: the tensors in order of `bits` (weights, biases).
        if let Some(python) = tools::python_with("safetensors") {
            let script = "import sys, torch\nfrom safetensors import safe_open\n\
                with safe_open(sys.argv[1], framework='pt') as f:\n\
                \tfor k in ['hidden.weight', 'hidden.bias', 'out.weight', 'out.bias']:\n\
                \t\tt = f.get_tensor(k)\n\
                \t\tprint(k, t.dtype, ' '.join(repr(v) for v in t.float().flatten().tolist()))\n";
            let out = std::process::Command::new(python)
                .args(["-c", script])
                .arg(&whole)
                .output()
                .unwrap();
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{}",
                String::from_utf8_lossy(&out.stderr)
            );
            let torch_dtype = match dtype {
                DType::BF16 => "torch.bfloat16",
                _ => "torch.float16",
            };
            let mut values = Vec::new();
            for line in text.lines() {
                let mut parts = line.split_whitespace();
                let (_, got_dtype) = (parts.next(), parts.next());
                assert_eq!(got_dtype, Some(torch_dtype), "{line}");
                values.extend(parts.map(|v| v.parse::<f32>().unwrap()));
            }
            assert_eq!(values, expected, "{name}: Python read other values");
        }
    }
}
