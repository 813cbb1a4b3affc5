//! What each ZeRO stage holds per process, measured by a counting global allocator in real
//! processes on 127.0.0.1: the transformer (12.7 M parameters, one 16-token sequence a step)
//! trained a few steps at stages 0 to 3 on 2 and 4 processes, the peak of live heap bytes
//! over the steps above what the process held before the model existed, against the issue's
//! formula (P parameters, N processes, AdamW in f32): stage 0 16P, stage 1 8P + 8P/N, stage 2
//! 4P + 12P/N, stage 3 16P/N plus the largest unit gathered with its gradient (8 bytes per
//! parameter of it).
//!
//! Every child process runs one scenario alone, so the counter sees its allocations only.

#![allow(unsafe_code)]

mod common;

use std::alloc::{GlobalAlloc, Layout, System};
use std::sync::atomic::{AtomicU64, Ordering};

use accelerate_burn::Unit;
use accelerate_burn::burn;
use accelerate_burn::nn::TransformerEncoderLayer;
use accelerate_burn::{Accelerator, DefaultBackend, FusedOptimizer};
use accelerate_examples::transformer::{TransformerLm, TransformerLmConfig};
use burn::optim::AdamWConfig;
use burn::tensor::{Int, Tensor, TensorData};
use common::{env_number, line, run, run_child, run_under};

/// The system allocator, counting the bytes live and their peak.
struct Counting;

static LIVE: AtomicU64 = AtomicU64::new(0);
static PEAK: AtomicU64 = AtomicU64::new(0);

fn grew(bytes: usize) {
    let live = LIVE.fetch_add(bytes as u64, Ordering::Relaxed) + bytes as u64;
    PEAK.fetch_max(live, Ordering::Relaxed);
}

fn shrank(bytes: usize) {
    LIVE.fetch_sub(bytes as u64, Ordering::Relaxed);
}

// SAFETY: every call is forwarded unchanged to the system allocator, which upholds
// `GlobalAlloc`'s contract; the counters are relaxed atomics that allocate nothing.
unsafe impl GlobalAlloc for Counting {
    unsafe fn alloc(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let ptr = unsafe { System.alloc(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn alloc_zeroed(&self, layout: Layout) -> *mut u8 {
        // SAFETY: forwarded with the caller's layout.
        let ptr = unsafe { System.alloc_zeroed(layout) };
        if !ptr.is_null() {
            grew(layout.size());
        }
        ptr
    }

    unsafe fn realloc(&self, ptr: *mut u8, layout: Layout, new_size: usize) -> *mut u8 {
        // SAFETY: `ptr` came from this allocator (that is, from `System`) with `layout`.
        let moved = unsafe { System.realloc(ptr, layout, new_size) };
        if !moved.is_null() {
            grew(new_size);
            shrank(layout.size());
        }
        moved
    }

    unsafe fn dealloc(&self, ptr: *mut u8, layout: Layout) {
        // SAFETY: `ptr` came from this allocator (that is, from `System`) with `layout`.
        unsafe { System.dealloc(ptr, layout) };
        shrank(layout.size());
    }
}

#[global_allocator]
static GLOBAL: Counting = Counting;

/// The measured transformer: 4 layers of 3.2 M parameters, embeddings of 0.14 M.
fn config() -> TransformerLmConfig {
    TransformerLmConfig::new(256, 16, 4, 512, 4, 2048)
}

/// Parameters of one layer of [`config`] (the largest unit at stage 3).
fn layer_parameters() -> u64 {
    let (d, m) = (512u64, 2048u64);
    4 * (d * d + d) + (d * m + m) + (m * d + d) + 4 * d
}

/// A transformer of 16 layers of 1.77 M parameters (28.5 M in all), each layer 6 % of the
/// parameters: what ZeRO-2's units hold beside the formula is small here.
fn deep() -> TransformerLmConfig {
    TransformerLmConfig::new(256, 16, 16, 384, 4, 1536)
}

/// A transformer of 25.4 M parameters (8 layers of 3.2 M): about 484 MiB per process at
/// ZeRO-0 with the fused AdamW, 97 MiB (plus a layer) at ZeRO-3 on 4 processes.
fn large() -> TransformerLmConfig {
    TransformerLmConfig::new(256, 16, 8, 512, 4, 2048)
}

/// Trains `config` for `updates` updates of one 16-token sequence per process at stage
/// `TEST_ZERO` (its layers sharded at stage 3) with `TEST_OPTIM` (`fused`, the default, or
/// `burn`); with `report`, prints the live heap bytes above what the process held before the
/// model was built: held after the steps, and the peak during them.
fn train(config: TransformerLmConfig, updates: u64, report: bool) -> anyhow::Result<()> {
    let stage = env_number::<u8>("TEST_ZERO");
    let acc = Accelerator::<DefaultBackend>::builder()
        .seed(3)
        .zero_stage(stage)
        .build()?;
    let device = acc.device();
    let tokens: Vec<i64> = (0..17).map(|i| (i * 37 % 256) as i64).collect();
    let sequence = |range: std::ops::Range<usize>| {
        Tensor::<2, Int>::from_data(TensorData::new(tokens[range].to_vec(), [1, 16]), &device)
    };
    let batch = (sequence(0..16), sequence(1..17));
    let baseline = LIVE.load(Ordering::Relaxed);
    let model = config.init(&device);
    if stage == 3 {
        steps(&acc, model.shard_layers(&acc)?, &batch, updates)?;
    } else if std::env::var("TEST_UNITS").is_ok_and(|units| units != "0") {
        steps(&acc, model.unit_layers(&acc)?, &batch, updates)?;
    } else {
        steps(&acc, model, &batch, updates)?;
    }
    if report {
        let held = LIVE.load(Ordering::Relaxed).saturating_sub(baseline);
        let peak = PEAK.load(Ordering::Relaxed).saturating_sub(baseline);
        println!("HELD {held}");
        println!("PEAK {peak}");
    }
    Ok(())
}

/// The process group's shared buffers this process created (ZeRO-0's gradients, on shared
/// memory: mappings, which the allocator does not see), in bytes: the resident pages of the
/// mappings named `<group>-b<id>-r<rank>-p<this pid>`. Each process maps its peers' buffers
/// too, but those are theirs (counted by them). The group's message slots are left out: a
/// transport's fixed cost, whatever the model.
fn shared_buffer_bytes() -> u64 {
    let own = format!("-p{}", std::process::id());
    let smaps = std::fs::read_to_string("/proc/self/smaps").unwrap_or_default();
    let mut total = 0;
    let mut counting = false;
    for line in smaps.lines() {
        let mut fields = line.split_whitespace();
        let first = fields.next().unwrap_or_default();
        if first.contains('-') && !first.ends_with(':') {
            // A mapping's header: address range, permissions, offset, device, inode, path.
            let path = fields.nth(4).unwrap_or_default();
            counting = is_group_buffer(path) && path.ends_with(&own);
        } else if counting && first == "Rss:" {
            total += fields
                .next()
                .and_then(|kib| kib.parse::<u64>().ok())
                .unwrap_or(0)
                * 1024;
        }
    }
    total
}

/// Whether `path` names a process group's shared buffer (`...-b<id>-r<rank>-p<pid>`).
fn is_group_buffer(path: &str) -> bool {
    let mut parts = path.rsplit('-');
    let mut tagged = |tag: char| {
        parts.next().is_some_and(|p| {
            p.strip_prefix(tag)
                .is_some_and(|n| !n.is_empty() && n.bytes().all(|b| b.is_ascii_digit()))
        })
    };
    path.starts_with("/dev/shm/") && tagged('p') && tagged('r') && tagged('b')
}

/// Prepares `model` with AdamW and takes `updates` steps on `batch` (inputs, targets); the
/// peak counts from the first step.
fn steps<L: Unit<TransformerEncoderLayer>>(
    acc: &Accelerator<DefaultBackend>,
    model: TransformerLm<L>,
    (inputs, targets): &(Tensor<2, Int>, Tensor<2, Int>),
    updates: u64,
) -> anyhow::Result<()> {
    let adamw = AdamWConfig::new();
    let (mut model, mut optim) = if std::env::var("TEST_OPTIM").as_deref() == Ok("burn") {
        acc.prepare((model, adamw.init()))?
    } else {
        acc.prepare((model, FusedOptimizer::adamw(&adamw)?))?
    };
    PEAK.store(LIVE.load(Ordering::Relaxed), Ordering::Relaxed);
    for _ in 0..updates {
        let loss = model.sequence_losses(inputs.clone(), targets.clone()).sum();
        let grads = acc.backward(loss, &model)?;
        model = optim.step(1e-3, model, grads)?;
    }
    println!("UPDATES {}", optim.updates());
    // Measured while the optimizer (and its buffers) are alive.
    println!("MAPPED {}", shared_buffer_bytes());
    Ok(())
}

#[test]
fn child() {
    run_child(|scenario| match scenario {
        "scale" => train(large(), 2, false),
        "memory" => train(config(), 4, true),
        "deep" => train(deep(), 4, true),
        other => anyhow::bail!("unknown scenario {other}"),
    });
}

/// The formula's bytes per process at `stage` over `world` processes.
fn formula(stage: u8, world: u64) -> u64 {
    let p = config().parameters() as u64;
    match stage {
        0 => 16 * p,
        1 => 8 * p + 8 * p / world,
        2 => 4 * p + 12 * p / world,
        _ => 16 * p / world + 8 * layer_parameters(),
    }
}

/// The largest peak over the ranks of a `memory` or `deep` run (the allocator's, plus the
/// group's shared buffers), once every rank took its 4 updates.
fn worst_peak(ranks: &[std::process::Output], case: &str) -> u64 {
    let mut worst = 0u64;
    for (rank, output) in ranks.iter().enumerate() {
        assert!(
            output.status.success(),
            "{case}, rank {rank}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(line(output, "UPDATES "), "4");
        let peak: u64 = line(output, "PEAK ").parse().unwrap();
        let mapped: u64 = line(output, "MAPPED ").parse().unwrap();
        worst = worst.max(peak + mapped);
    }
    worst
}

/// ZeRO-2 on a model whose layers are units (`unit_layers`): each layer's gradients are
/// reduce-scattered into the shards as backward leaves the layer and let go, and backward
/// waits at the layer's edge until they are sent, so one layer's gradients exist at a time
/// beside the shards (Burn makes a unit's gradients together). On 2 and 4 processes:
/// - the 16-layer model (a layer 6 % of the parameters) holds 4P + 12P/N within 15 %;
/// - the 4-layer model of the test above (a layer 25 %) holds the formula plus one layer's
///   gradients (4 bytes per parameter of it) within 15 %, and less than ZeRO-2 after backward.
#[test]
fn zero_2_over_units_holds_its_formula() {
    for world in [2u64, 4] {
        let env = |units: bool| {
            vec![
                ("TEST_ZERO", "2".to_string()),
                ("TEST_UNITS", u8::from(units).to_string()),
            ]
        };
        let zero2 = |config: &TransformerLmConfig| {
            let p = config.parameters() as u64;
            4 * p + 12 * p / world
        };
        let case = format!("ZeRO-2 over 16 units, {world} processes");
        let deep_peak = worst_peak(&run("deep", world as usize, &env(true)), &case);
        let ratio = deep_peak as f64 / zero2(&deep()) as f64;
        eprintln!(
            "{case}: peak {:.1} MB, ratio {ratio:.3}",
            deep_peak as f64 / 1e6
        );
        assert!((0.9..=1.15).contains(&ratio), "{case}: ratio {ratio:.3}");

        let case = format!("ZeRO-2 over 4 units, {world} processes");
        let units = worst_peak(&run("memory", world as usize, &env(true)), &case);
        let after = worst_peak(&run("memory", world as usize, &env(false)), &case);
        let with_unit = zero2(&config()) + 4 * layer_parameters();
        let ratio = units as f64 / with_unit as f64;
        eprintln!(
            "{case}: peak {:.1} MB ({:.1} MB after backward), ratio {ratio:.3}",
            units as f64 / 1e6,
            after as f64 / 1e6
        );
        assert!((0.9..=1.15).contains(&ratio), "{case}: ratio {ratio:.3}");
        assert!(
            units < after,
            "{case}: {units} bytes, {after} after backward"
        );
    }
}

/// The bytes a fused optimizer's step holds at its peak at ZeRO-1 and ZeRO-2 on the host
/// path: the model (4P) and Burn's gradients (4P) whole, AdamW's two moments of this rank's
/// shard (8P/N): ZeRO-1's formula. This rank's shard of the averaged gradients is averaged
/// inside backward's tensors (no buffer of its own), and each rank's part of the update is
/// broadcast straight into the model's parameters (no master copy). ZeRO-2's formula needs
/// the gradients handed over as backward makes them: a model's units do
/// ([`zero_2_over_units_holds_its_formula`]).
fn host_path_zero_1_2(world: u64) -> u64 {
    let p = config().parameters() as u64;
    8 * p + 8 * p / world
}

/// Every stage's measured peak (the allocator's, plus ZeRO-0's shared gradient buffer)
/// against the formula on 2 and 4 processes (RESULTS has the table), with what the test holds
/// each to:
/// - a higher stage never needs more than a lower one (ZeRO-1 and ZeRO-2 hold the same
///   without accumulation: within 1 %);
/// - ZeRO-1 and ZeRO-2 within 10 % of what the host path holds (`host_path_zero_1_2`, 8P +
///   8P/N, ZeRO-1's formula; ZeRO-2's 4P + 12P/N needs Burn's backward to hand gradients over
///   one parameter at a time: see RESULTS);
/// - ZeRO-3, with Burn's AdamW or the fused one (neither keeps a copy of the shards beside the
///   model's), at most the formula (0.91 and 0.89 measured: the layers are gathered with
///   `gather_for`, so each gradient is reduce-scattered as soon as backward has left its
///   layer, and with resharding one parameter of a layer is whole in backward at a time, where
///   the formula counts the whole layer with its gradients);
/// - each ratio to the formula at most what RESULTS reports, rounded up by 0.05.
#[test]
fn per_process_memory_follows_the_zero_formula() {
    // (stage, optimizer, the largest ratio to the formula on 2 and on 4 processes).
    let cases = [
        (0u8, "fused", [1.33, 1.33]),
        (1, "fused", [1.11, 1.11]),
        (2, "fused", [1.32, 1.57]),
        (3, "fused", [0.96, 0.95]),
        (3, "burn", [0.96, 0.95]),
    ];
    for (column, world) in [2usize, 4].into_iter().enumerate() {
        let mut previous = u64::MAX;
        for (stage, optim, bounds) in cases {
            let ranks = run(
                "memory",
                world,
                &[
                    ("TEST_ZERO", stage.to_string()),
                    ("TEST_OPTIM", optim.into()),
                ],
            );
            let worst = worst_peak(&ranks, &format!("stage {stage}, {world} processes"));
            let expected = formula(stage, world as u64);
            let ratio = worst as f64 / expected as f64;
            let case = format!("ZeRO-{stage} ({optim}), {world} processes");
            eprintln!(
                "{case}: peak {:.1} MB, formula {:.1} MB, ratio {ratio:.3}",
                worst as f64 / 1e6,
                expected as f64 / 1e6
            );
            // ZeRO-1 and ZeRO-2 hold the same buffers here: within 1 % of each other.
            assert!(
                worst as f64 <= previous as f64 * 1.01,
                "{case}: {worst} bytes, more than the stage below ({previous})"
            );
            previous = worst;
            assert!(
                (0.80..=bounds[column]).contains(&ratio),
                "{case}: {worst} bytes against {expected} (ratio {ratio:.3})"
            );
            if stage == 1 || stage == 2 {
                let held = host_path_zero_1_2(world as u64);
                let ratio = worst as f64 / held as f64;
                assert!(
                    (0.95..=1.10).contains(&ratio),
                    "{case}: {worst} bytes against the host path's {held}"
                );
            }
        }
    }
}

/// Each process may use 240 MiB of data (RLIMIT_DATA, set by `prlimit` for the ranks alone):
/// the 25.4 M-parameter transformer, which needs about 484 MiB per process at ZeRO-0 (266 at
/// ZeRO-1 and ZeRO-2), trains at ZeRO-3 on 4 processes, and at ZeRO-0 every rank stops at
/// prepare with an out-of-memory error that says what it needs, the limit, and that ZeRO-3
/// fits.
#[test]
fn a_model_too_large_for_one_process_trains_at_zero_3_on_4_processes() {
    if std::process::Command::new("prlimit")
        .arg("--version")
        .output()
        .is_err()
    {
        assert!(
            std::env::var("ACCELERATE_REQUIRE_TEST_TOOLS").is_err(),
            "prlimit (util-linux) is not installed"
        );
        eprintln!("skipped: prlimit (util-linux) is not installed");
        return;
    }
    let wrapper = |_| vec!["prlimit".to_string(), format!("--data={}", 240u64 << 20)];
    let sharded = run_under(&wrapper, "scale", 4, &[("TEST_ZERO", "3".into())]);
    for (rank, output) in sharded.iter().enumerate() {
        assert!(
            output.status.success(),
            "ZeRO-3, rank {rank}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(line(output, "UPDATES "), "2");
    }
    let whole = run_under(&wrapper, "scale", 4, &[("TEST_ZERO", "0".into())]);
    for (rank, output) in whole.iter().enumerate() {
        assert!(!output.status.success(), "ZeRO-0, rank {rank} trained");
        let err = String::from_utf8_lossy(&output.stderr);
        assert!(
            err.contains(&format!("rank {rank}: out of memory"))
                && err.contains("240 MiB (RLIMIT_DATA)")
                && err.contains("hint: at zero_stage 3 with the model's layers sharded"),
            "ZeRO-0, rank {rank}: {err}"
        );
    }
}
