//! After the first step, the accelerated step allocates nothing that grows with the model
//! beyond what Burn's own step allocates. Checked with a counting global allocator: the bytes
//! allocated by one step of the plain Burn loop against the accelerated loop (Burn's AdamW and
//! the fused AdamW), for a model of 0.2 M and of 1.1 M parameters.
//!
//! Everything in this test binary runs in one test function, so no other test's allocations
//! are counted.

#![allow(unsafe_code)]

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use accelerate_burn::{Accelerator, DefaultBackend, FusedOptimizer, ProcessState};
use burn::module::Module;
use burn::nn::loss::CrossEntropyLossConfig;
use burn::nn::{Linear, LinearConfig, Relu};
use burn::optim::{AdamWConfig, GradientsParams};
use burn::tensor::{Device, Distribution, Int, Tensor};

/// The system allocator, counting the bytes it hands out.
struct Counting;

static ALLOCATED: AtomicU64 = AtomicU64::new(0);

// SAFETY: every call is forwarded unchanged to the system allocator, which upholds
// `GlobalAlloc`'s contract; the counter is a relaxed atomic that allocates nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc(layout) }
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        ALLOCATED.fetch_add(layout.size() as u64, Ordering::Relaxed);
        // SAFETY: forwarded with the caller's layout.
        unsafe { System.alloc_zeroed(layout) }
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        ALLOCATED.fetch_add(new_size as u64, Ordering::Relaxed);
        // SAFETY: `ptr` came from this allocator (that is, from `System`) with `layout`.
        unsafe { System.realloc(ptr, layout, new_size) }
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (that is, from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) }
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

#[derive(Module, Debug)]
struct Mlp {
    hidden: Linear,
    out: Linear,
    act: Relu,
}

impl Mlp {
    fn new(hidden: usize, device: &Device) -> Self {
        Self {
            hidden: LinearConfig::new(256, hidden).init(device),
            out: LinearConfig::new(hidden, 10).init(device),
            act: Relu::new(),
        }
    }

    fn loss(&self, x: Tensor<2>, y: Tensor<1, Int>) -> Tensor<1> {
        let logits = self.out.forward(self.act.forward(self.hidden.forward(x)));
        CrossEntropyLossConfig::new()
            .init(&logits.device())
            .forward(logits, y)
    }
}

/// Bytes allocated by `step`: the median of 7 runs after 3 unmeasured ones.
fn bytes_per_step(mut step: impl FnMut()) -> u64 {
    for _ in 0..3 {
        step();
    }
    let mut runs: Vec<u64> = (0..7)
        .map(|_| {
            let before = ALLOCATED.load(Ordering::Relaxed);
            step();
            ALLOCATED.load(Ordering::Relaxed) - before
        })
        .collect();
    runs.sort_unstable();
    runs[3]
}

/// Bytes per step of one training configuration.
struct Measured {
    /// Burn's forward and backward alone (no optimizer).
    backward: u64,
    /// The plain Burn loop with its AdamW.
    plain: u64,
    /// The accelerated loop with Burn's AdamW.
    burn: u64,
    /// The accelerated loop with the fused AdamW (and global clipping).
    fused: u64,
    /// The model's parameters.
    model: u64,
}

fn measure(hidden: usize) -> Measured {
    let acc = Accelerator::<DefaultBackend>::builder()
        .process_state(ProcessState::single())
        .seed(1)
        .build()
        .unwrap();
    let device = acc.device();
    let x = Tensor::<2>::random([32, 256], Distribution::Default, &device);
    let y = Tensor::<1, Int>::random([32], Distribution::Uniform(0.0, 10.0), &device);
    let model = Mlp::new(hidden, &device);
    let model_bytes = (model.num_params() * 4) as u64;

    let backward_bytes = bytes_per_step(|| {
        let grads =
            GradientsParams::from_grads(model.loss(x.clone(), y.clone()).backward(), &model);
        drop(grads);
    });

    let mut plain = Some((model.clone(), AdamWConfig::new().init()));
    let plain_bytes = bytes_per_step(|| {
        let (model, mut optim) = plain.take().unwrap();
        let grads =
            GradientsParams::from_grads(model.loss(x.clone(), y.clone()).backward(), &model);
        let model = optim.step(1e-3, model, grads);
        plain = Some((model, optim));
    });

    let mut burn = Some(
        acc.prepare((model.clone(), AdamWConfig::new().init()))
            .unwrap(),
    );
    let burn_bytes = bytes_per_step(|| {
        let (model, mut optim) = burn.take().unwrap();
        let grads = acc
            .backward(model.loss(x.clone(), y.clone()), &model)
            .unwrap();
        let model = optim.step(1e-3, model, grads).unwrap();
        burn = Some((model, optim));
    });

    let fused_acc = Accelerator::<DefaultBackend>::builder()
        .process_state(ProcessState::single())
        .build()
        .unwrap();
    let adamw = FusedOptimizer::adamw(&AdamWConfig::new()).unwrap();
    let mut fused = Some(fused_acc.prepare((model, adamw)).unwrap());
    let fused_bytes = bytes_per_step(|| {
        let (model, mut optim) = fused.take().unwrap();
        let mut grads = fused_acc
            .backward(model.loss(x.clone(), y.clone()), &model)
            .unwrap();
        fused_acc.clip_grad_norm(&model, &mut grads, 1.0).unwrap();
        let model = optim.step(1e-3, model, grads).unwrap();
        fused = Some((model, optim));
    });
    Measured {
        backward: backward_bytes,
        plain: plain_bytes,
        burn: burn_bytes,
        fused: fused_bytes,
        model: model_bytes,
    }
}

/// What the accelerated step may allocate beyond Burn's own step, whatever the model's size:
/// the visit-order list of gradients and Burn's gradient map rebuilt for its optimizer (a few
/// words per parameter tensor), the accelerator's bookkeeping. Far below one copy of the
/// smaller model's gradients (0.8 MB), which a host round trip or a per-step buffer would cost.
const OVERHEAD_BYTES: u64 = 32 * 1024;

#[test]
fn the_step_allocates_nothing_that_grows_with_the_model() {
    for hidden in [768, 4096] {
        let m = measure(hidden);
        eprintln!(
            "hidden {hidden} ({} parameter bytes), bytes allocated per step: Burn's forward and \
             backward {}, plain Burn loop {}, accelerated with Burn's AdamW {}, fused {}",
            m.model, m.backward, m.plain, m.burn, m.fused
        );
        assert!(
            m.burn <= m.plain + OVERHEAD_BYTES,
            "hidden {hidden}: the accelerated step allocated {} bytes, plain Burn {}",
            m.burn,
            m.plain
        );
        // The fused update runs in place over buffers built at prepare; beyond Burn's forward
        // and backward it allocates the new parameter tensors handed to the model, one copy.
        assert!(
            m.fused <= m.backward + m.model + OVERHEAD_BYTES,
            "hidden {hidden}: the fused step allocated {} bytes, Burn's backward {}, \
             parameters {}",
            m.fused,
            m.backward,
            m.model
        );
    }
}
