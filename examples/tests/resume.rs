//! Checkpoints with real processes on 127.0.0.1: a run stopped after update k (mid-epoch,
//! fp16 with a moving loss scale, dropout, gradient accumulation, AdamW and a schedule) and
//! resumed from its checkpoint ends bit-identical to a run that never stopped, on 1 and 2
//! processes; a process killed in the middle of a save leaves the previous checkpoint the
//! latest; another world size is refused unless asked for; a save never replaces a user's
//! directory; after a resume from an older checkpoint, rotation keeps the new run's.

mod common;

use std::path::Path;

use accelerate_burn::burn;
use accelerate_burn::{
    Accelerator, Checkpoint, CheckpointSnapshot, DataLoader, DefaultBackend, FusedOptimizer,
    MixedPrecision, ScalerConfig,
};
use accelerate_core::checkpoint::{CheckpointRotation, partial_dir, read_manifest};
use accelerate_examples::digits::{self, DigitBatcher};
use accelerate_examples::{Mlp, MlpConfig};
use burn::data::dataset::InMemDataset;
use burn::lr_scheduler::linear::LinearLrSchedulerConfig;
use burn::module::Module;
use burn::optim::AdamWConfig;
use common::{
    env_number, line, param_bits, params_labelled, print_params, print_params_as, run, run_child,
};
use serde::{Serialize, Serializer};

const SAMPLES: usize = 240;

fn env(key: &str) -> String {
    std::env::var(key).unwrap_or_default()
}

/// A user object that kills its process when a checkpoint serialises it.
struct Bomb;

impl Serialize for Bomb {
    fn serialize<S: Serializer>(&self, _: S) -> Result<S::Ok, S::Error> {
        eprintln!("the bomb goes off in the middle of save_state");
        std::process::abort();
    }
}

/// Trains 2 epochs; with `TEST_STOP=k`, saves a checkpoint after update k and exits; with
/// `TEST_RESUME=1`, first loads the project's latest checkpoint (`TEST_RESUME_FROM=dir`: that
/// one); with `TEST_BOMB=k`, dies in the middle of the save after update k; `TEST_SAVES=a,b`
/// also saves after those updates; `TEST_SAVE_INTO=dir` saves with `save_state(dir)` instead
/// of an automatically named checkpoint; `TEST_LIMIT=n` keeps n checkpoints (default 2);
/// `TEST_RESAVE=dir` saves into `dir` right after the load and exits. `TEST_OPTIM` picks the
/// optimizer: `burn`, `fused`, or the fused one at ZeRO stage 1 (`zero`), 2 (`zero2`) or 3
/// (`zero3`: the MLP is one sharded unit; `zero3burn` with Burn's AdamW). `TEST_SNAPSHOT=files`
/// keeps a background save's snapshot in the checkpoint's files instead of memory.
fn train() -> anyhow::Result<()> {
    let precision = match env("TEST_PRECISION").as_str() {
        "fp16" => MixedPrecision::Fp16,
        _ => MixedPrecision::No,
    };
    let snapshot = match env("TEST_SNAPSHOT").as_str() {
        "files" => CheckpointSnapshot::Files,
        _ => CheckpointSnapshot::Memory,
    };
    let acc = Accelerator::<DefaultBackend>::builder()
        .checkpoint_snapshot(snapshot)
        .seed(11)
        .gradient_accumulation_steps(2)
        .mixed_precision(precision)
        // Grows every 2 clean steps, so the scale rises, overflows and backs off in a short run.
        .loss_scaler(ScalerConfig {
            init_scale: 16384.0,
            growth_interval: 2,
            ..ScalerConfig::default()
        })
        .project_dir(env("TEST_DIR"))
        .checkpoint_total_limit(match env_number::<usize>("TEST_LIMIT") {
            0 => 2,
            n => n,
        })
        .resume_with_different_world_size(env("TEST_ANY_WORLD") == "1")
        .zero_stage(match env("TEST_OPTIM").as_str() {
            "zero" => 1,
            "zero2" => 2,
            "zero3" | "zero3burn" => 3,
            _ => 0,
        })
        .build()?;
    let model = MlpConfig::new(digits::PIXELS, vec![32], digits::CLASSES)
        .with_dropout(0.2)
        .init(&acc.device());
    if env("TEST_OPTIM").starts_with("zero3") {
        let sharded = acc.shard(model)?;
        train_with(&acc, sharded, |m| m.gather())
    } else {
        train_with(&acc, model, Mlp::clone)
    }
}

/// The loop of [`train`] for a model `whole` turns into the MLP (a collective at ZeRO-3).
fn train_with<M: Module>(
    acc: &Accelerator<DefaultBackend>,
    model: M,
    whole: impl Fn(&M) -> Mlp,
) -> anyhow::Result<()> {
    let data: Vec<_> = digits::load()?.into_iter().take(SAMPLES).collect();
    let train = DataLoader::builder(DigitBatcher)
        .batch_size(8)
        .shuffle(3)
        .build(InMemDataset::new(data));
    let (model, mut optim, train) = match env("TEST_OPTIM").as_str() {
        "fused" | "zero" | "zero2" | "zero3" => {
            let fused = FusedOptimizer::adamw(&AdamWConfig::new())?;
            acc.prepare((model, fused, train))?
        }
        _ => acc.prepare((model, AdamWConfig::new().init(), train))?,
    };
    let schedule = LinearLrSchedulerConfig::new(3e-3, 1e-4, 40)
        .init()
        .map_err(anyhow::Error::msg)?;
    let mut sched = acc.prepare_scheduler(schedule);
    let mut model = model;
    // At ZeRO-3 an average of the weights rides along in the checkpoints, sharded like the
    // model (`Checkpoint::module`): it must resume exactly too.
    let with_ema = env("TEST_OPTIM").starts_with("zero3");
    let mut ema = model.clone().no_grad();
    let (mut batches_seen, mut skipped) = (0u64, 0u64);
    let resume_from = env("TEST_RESUME_FROM");
    if env("TEST_RESUME") == "1" || !resume_from.is_empty() {
        let restored = match resume_from.as_str() {
            "" => acc.load_latest_checkpoint(model, &mut optim, Some(&mut sched))?,
            dir => acc.load_state(dir, model, &mut optim, Some(&mut sched))?,
        };
        model = restored.model;
        if with_ema {
            ema = restored.info.module("ema", ema)?;
        }
        batches_seen = restored.info.object("batches_seen")?.unwrap_or(0);
        println!("RESUMED {} {batches_seen}", restored.info.updates);
        let resave = env("TEST_RESAVE");
        if !resave.is_empty() {
            let checkpoint = Checkpoint::new(&model, &optim)
                .scheduler(&sched)
                .object("batches_seen", &batches_seen);
            let checkpoint = match with_ema {
                true => checkpoint.module("ema", &ema),
                false => checkpoint,
            };
            acc.save_state(&resave, &checkpoint)?;
            return Ok(());
        }
    }
    let (stop, bomb) = (
        env_number::<u64>("TEST_STOP"),
        env_number::<u64>("TEST_BOMB"),
    );
    let saves: Vec<u64> = env("TEST_SAVES")
        .split(',')
        .filter_map(|n| n.parse().ok())
        .collect();
    let save_into = env("TEST_SAVE_INTO");
    for epoch in train.epoch()..2 {
        train.set_epoch(epoch);
        for batch in train.iter() {
            let batch = batch?;
            let loss = acc
                .autocast(&model, |m, c| {
                    whole(m).forward_loss(c.input(batch.images), batch.targets)
                })
                .loss;
            let grads = acc.backward(loss, &model)?;
            let lr = sched.step();
            model = optim.step(lr, model, grads)?;
            if with_ema && acc.sync_gradients() {
                ema = acc.ema_update(ema, &model, 0.9)?;
            }
            skipped += u64::from(acc.sync_gradients() && acc.optimizer_step_was_skipped());
            batches_seen += 1;
            if !acc.sync_gradients() {
                continue;
            }
            let updates = optim.updates();
            if updates == stop || updates == bomb || saves.contains(&updates) {
                let checkpoint = Checkpoint::new(&model, &optim)
                    .scheduler(&sched)
                    .object("batches_seen", &batches_seen);
                let checkpoint = match with_ema {
                    true => checkpoint.module("ema", &ema),
                    false => checkpoint,
                };
                let checkpoint = match updates == bomb && acc.is_main_process() {
                    true => checkpoint.object("bomb", &Bomb),
                    false => checkpoint,
                };
                let dir = match save_into.as_str() {
                    "" => acc.save_checkpoint(&checkpoint)?,
                    dir => acc.save_state(dir, &checkpoint)?,
                };
                println!("SAVED {}", dir.display());
                if updates == stop {
                    return Ok(());
                }
            }
        }
    }
    println!("UPDATES {}", optim.updates());
    println!("SEEN {batches_seen}");
    println!("SCALE {:?}", acc.loss_scale());
    println!("SKIPPED {skipped}");
    print_params(&whole(&model));
    if with_ema {
        print_params_as("EMA", &whole(&ema));
    }
    Ok(())
}

#[test]
fn child() {
    run_child(|scenario| match scenario {
        "train" => train(),
        other => anyhow::bail!("unknown scenario {other}"),
    });
}

fn stderr(output: &std::process::Output) -> String {
    String::from_utf8_lossy(&output.stderr).into_owned()
}

fn assert_ok(outputs: &[std::process::Output]) {
    for (rank, output) in outputs.iter().enumerate() {
        assert!(output.status.success(), "rank {rank}: {}", stderr(output));
    }
}

fn run_in(dir: &Path, world: usize, extra: &[(&str, &str)]) -> Vec<std::process::Output> {
    let mut env: Vec<(&str, String)> = vec![("TEST_DIR", dir.display().to_string())];
    env.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    run("train", world, &env)
}

/// The bit-identical resume contract, for `world` processes: epochs of 30 batches (1 process)
/// or 15 per rank (2: the last accumulation window of each epoch is short).
fn resume_is_bit_identical(world: usize, stop: &str, optimizer: &str) {
    resume_is_bit_identical_with(world, stop, optimizer, &[]);
}

/// [`resume_is_bit_identical`] with `extra` variables for every run (the stopped run also
/// saves two updates before `stop`, and goes on training after that save).
fn resume_is_bit_identical_with(world: usize, stop: &str, optimizer: &str, extra: &[(&str, &str)]) {
    for precision in ["none", "fp16"] {
        let tmp = tempfile::tempdir().unwrap();
        let mut common = vec![("TEST_PRECISION", precision), ("TEST_OPTIM", optimizer)];
        common.extend_from_slice(extra);
        let whole = run_in(tmp.path(), world, &common);
        assert_ok(&whole);

        let dir = tmp.path().join("resumed");
        let earlier = stop
            .parse::<u64>()
            .unwrap_or(2)
            .saturating_sub(2)
            .to_string();
        let mut stopping = common.clone();
        stopping.extend([("TEST_STOP", stop), ("TEST_SAVES", earlier.as_str())]);
        let stopped = run_in(&dir, world, &stopping);
        assert_ok(&stopped);
        let mut resuming = common.clone();
        resuming.push(("TEST_RESUME", "1"));
        let resumed = run_in(&dir, world, &resuming);
        assert_ok(&resumed);

        for rank in 0..world {
            let context = format!("{world} processes, {precision}, {optimizer}, rank {rank}");
            assert_resumed_like(
                (&resumed[rank], &whole[rank]),
                stop,
                &["UPDATES ", "SEEN ", "SCALE "],
                optimizer.starts_with("zero3"),
                &context,
            );
        }
        if precision == "fp16" {
            // The scale grew and backed off, so the scaler's state was exercised.
            assert_ne!(line(&whole[0], "SCALE "), "Some(16384.0)");
            assert!(line(&whole[0], "SKIPPED ") != "0", "no step overflowed");
        }
    }
}

#[test]
fn a_resumed_single_process_run_ends_bit_identical() {
    // 15 updates per epoch: update 20 is in the middle of the second epoch.
    resume_is_bit_identical(1, "20", "burn");
    resume_is_bit_identical(1, "20", "fused");
}

// Two processes, one test per optimizer (CI's GPU step picks the ones with device paths by
// name). 8 updates per epoch (the last of 1 batch): update 11 is in the middle of the second.

#[test]
fn a_resumed_two_process_run_ends_bit_identical_with_burns_optimizer() {
    resume_is_bit_identical(2, "11", "burn");
}

/// Fused without ZeRO: on wgpu and cuda the flat state lives on the GPU and is copied down
/// for the checkpoint.
#[test]
fn a_resumed_two_process_run_ends_bit_identical_with_the_fused_optimizer() {
    resume_is_bit_identical(2, "11", "fused");
}

/// ZeRO-1: each rank saves and restores its shard of the optimizer state. ZeRO-2: the same
/// files; the window's sum held as shards starts afresh after the load.
#[test]
fn a_resumed_two_process_run_ends_bit_identical_at_zero_1_and_2() {
    resume_is_bit_identical(2, "11", "zero");
    resume_is_bit_identical(2, "11", "zero2");
}

/// Hybrid sharding (4 processes in shard groups of 2): the first group's ranks save their
/// shards of the optimizer state (ZeRO-2) or of the model and the state (ZeRO-3), the second
/// group's hold the same and write none, and a resumed run of the same groups ends bit for bit
/// where the uninterrupted one ends.
#[test]
fn a_resumed_hybrid_run_ends_bit_identical_at_zero_2_and_3() {
    let groups = [("ACCELERATE_SHARD_GROUP_SIZE", "2")];
    resume_is_bit_identical_with(4, "5", "zero2", &groups);
    resume_is_bit_identical_with(4, "5", "zero3", &groups);
}

/// ZeRO-3: each rank saves its shards of the model and of the fused optimizer's state.
#[test]
fn a_resumed_two_process_run_ends_bit_identical_at_zero_3() {
    resume_is_bit_identical(2, "11", "zero3");
}

/// ZeRO-3 with Burn's optimizer: each rank saves its shards of the model and Burn's record of
/// its shards' state.
#[test]
fn a_resumed_two_process_run_ends_bit_identical_at_zero_3_with_burns_optimizer() {
    resume_is_bit_identical(2, "11", "zero3burn");
}

/// ZeRO-3 checkpoints are cut again for another number of processes, exactly: a 2-process
/// run saves after update 5 and goes on to the end; 4 processes load that checkpoint (each
/// parameter and its optimizer state put together from 2 ranks' shards and cut in 4) and
/// save it again at once; 2 processes resume from the 4 ranks' checkpoint and end bit for
/// bit where the uninterrupted 2-process run ended (the data order continues from the
/// global position, dropout from the same seeds). The same through 4 processes in hybrid
/// shard groups of 2: each group cuts the 2 ranks' shards for itself, the first group alone
/// writes its 2 shards (the second holds the same), and 2 processes resume from them.
#[test]
fn a_zero_3_checkpoint_of_4_processes_resumes_on_2_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let (two, four) = (tmp.path().join("two"), tmp.path().join("four"));
    let zero3 = ("TEST_OPTIM", "zero3");
    let any = ("TEST_ANY_WORLD", "1");
    let two_s = two.display().to_string();
    let four_s = four.display().to_string();
    let whole = run_in(
        &tmp.path().join("run"),
        2,
        &[zero3, ("TEST_SAVES", "5"), ("TEST_SAVE_INTO", &two_s)],
    );
    assert_ok(&whole);
    let hybrid = tmp.path().join("hybrid");
    let hybrid_s = hybrid.display().to_string();
    for (dir, group, files) in [(&four_s, "4", 4), (&hybrid_s, "2", 2)] {
        let resaved = run_in(
            &tmp.path().join(format!("run4-{group}")),
            4,
            &[
                zero3,
                any,
                ("TEST_RESUME_FROM", &two_s),
                ("TEST_RESAVE", dir),
                ("ACCELERATE_SHARD_GROUP_SIZE", group),
            ],
        );
        assert_ok(&resaved);
        let dir = std::path::Path::new(dir);
        let manifest = read_manifest(dir).unwrap();
        assert_eq!(manifest.world_size, 4);
        let shards = |prefix: &str| {
            manifest
                .files
                .iter()
                .filter(|f| f.name.starts_with(prefix))
                .count()
        };
        let counted = (shards("zero3_model_"), shards("zero3_optimizer_"));
        assert_eq!(counted, (files, files), "shard groups of {group}");
        assert!(
            !dir.join("model.safetensors").exists(),
            "no rank holds the whole model"
        );
    }
    // Burn's optimizer records its shards as they were cut: another world size is refused.
    let burn = ("TEST_OPTIM", "zero3burn");
    let saved = tmp.path().join("burn");
    assert_ok(&run_in(&saved, 2, &[burn, ("TEST_STOP", "5")]));
    let refused = run_in(&saved, 1, &[burn, any, ("TEST_RESUME", "1")]);
    assert!(
        stderr(&refused[0]).contains("saved by 2 processes, loaded by 1"),
        "{}",
        stderr(&refused[0])
    );
    for (name, dir) in [("four", &four_s), ("hybrid", &hybrid_s)] {
        let resumed = run_in(
            &tmp.path().join(format!("run2-{name}")),
            2,
            &[zero3, any, ("TEST_RESUME_FROM", dir)],
        );
        assert_ok(&resumed);
        for rank in 0..2 {
            let context = format!("from {name}, rank {rank}");
            let pair = (&resumed[rank], &whole[rank]);
            assert_resumed_like(pair, "5", &["UPDATES ", "SEEN "], true, &context);
        }
    }
}

/// Asserts that the `resumed` run of a pair (resumed, uninterrupted) resumed after update
/// `stop` and ended as the uninterrupted one: the lines of `keys`, the parameters bit for bit,
/// and with `ema` the average printed beside them.
fn assert_resumed_like(
    (resumed, whole): (&std::process::Output, &std::process::Output),
    stop: &str,
    keys: &[&str],
    ema: bool,
    context: &str,
) {
    assert!(
        line(resumed, "RESUMED ").starts_with(&format!("{stop} ")),
        "{context}"
    );
    for key in keys {
        assert_eq!(line(resumed, key), line(whole, key), "{key}{context}");
    }
    assert!(
        param_bits(resumed) == param_bits(whole),
        "parameters differ: {context}"
    );
    if ema {
        let bits = |output| -> Vec<u32> {
            let values = params_labelled(output, "EMA");
            values.iter().map(|v| v.to_bits()).collect()
        };
        assert_eq!(bits(resumed), bits(whole), "EMA: {context}");
    }
}

#[test]
fn a_process_killed_mid_save_leaves_the_previous_checkpoint_the_latest() {
    let tmp = tempfile::tempdir().unwrap();
    let first = run_in(tmp.path(), 2, &[("TEST_STOP", "3")]);
    assert_ok(&first);
    let crashed = run_in(tmp.path(), 2, &[("TEST_RESUME", "1"), ("TEST_BOMB", "6")]);
    assert!(!crashed[0].status.success(), "rank 0 should have died");
    assert!(
        stderr(&crashed[0]).contains("the bomb goes off"),
        "{}",
        stderr(&crashed[0])
    );
    // The surviving rank fails too, and says which peer is gone.
    assert!(!crashed[1].status.success());
    assert!(
        stderr(&crashed[1]).contains("rank 0"),
        "{}",
        stderr(&crashed[1])
    );

    let rotation = CheckpointRotation::new(tmp.path(), None);
    let half = partial_dir(&rotation.path_for(6));
    assert!(
        half.join("model.safetensors").exists(),
        "the save got as far as the model"
    );
    assert!(
        read_manifest(&half).is_err(),
        "a half-written checkpoint must not load"
    );
    assert!(!rotation.path_for(6).exists());
    assert_eq!(rotation.latest(), Some(rotation.path_for(3)));

    // Resuming takes the previous checkpoint and trains to the end.
    let resumed = run_in(tmp.path(), 2, &[("TEST_RESUME", "1")]);
    assert_ok(&resumed);
    assert!(line(&resumed[0], "RESUMED ").starts_with("3 "));
}

/// Background saves (`ACCELERATE_ASYNC_CHECKPOINTS`): the snapshot is what the run held at
/// the save, whatever the training did while it was written, so resuming from it ends
/// bit-identical to a run that never stopped; the stopped run's last save is committed as the
/// process ends. With Burn's optimizer (its record serialised to memory):
#[test]
fn a_background_save_resumes_bit_identically_with_burns_optimizer() {
    resume_is_bit_identical_with(2, "6", "burn", &[(ASYNC, "true")]);
}

/// ... with the fused optimizer (its flat state copied), its snapshot in memory or in the
/// checkpoint's files:
#[test]
fn a_background_save_resumes_bit_identically_with_the_fused_optimizer() {
    resume_is_bit_identical_with(2, "6", "fused", &[(ASYNC, "true")]);
    resume_is_bit_identical_with(
        2,
        "6",
        "fused",
        &[(ASYNC, "true"), ("TEST_SNAPSHOT", "files")],
    );
}

/// ... and at ZeRO-3 (every rank writes its shards of the model, the EMA and the state):
#[test]
fn a_background_save_resumes_bit_identically_at_zero_3() {
    resume_is_bit_identical_with(2, "6", "zero3", &[(ASYNC, "true")]);
}

/// Checkpoints saved in the background.
const ASYNC: &str = "ACCELERATE_ASYNC_CHECKPOINTS";

/// The fault hook of a background save (`rank:point[:fail]`).
const FAULT: &str = "ACCELERATE_FAULT_BACKGROUND_SAVE_AT";

/// A process killed at each point of a background save (before each file it writes, before
/// its marker, before the commit), on either rank, with the snapshot in memory and in the
/// checkpoint's files: the checkpoint being written never loads, the previous one stays the
/// latest, and resuming from it ends bit-identical to a run that never stopped.
#[test]
fn a_background_save_killed_at_any_point_resumes_from_the_last_committed_checkpoint() {
    for snapshot in ["memory", "files"] {
        killed_at_every_point(snapshot);
    }
}

fn killed_at_every_point(snapshot: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let common = [
        ("TEST_OPTIM", "fused"),
        (ASYNC, "true"),
        ("TEST_SNAPSHOT", snapshot),
    ];
    let whole = run_in(&tmp.path().join("whole"), 2, &common);
    assert_ok(&whole);
    let rotation = |dir: &Path| CheckpointRotation::new(dir, None);
    // Rank 0 writes the model, the optimizer state, the scheduler, its loop state and the
    // training state, then its marker, then commits; rank 1 its loop state and marker.
    let points = [(0, 7), (1, 2)];
    let mut killed = 0;
    for (rank, count) in points {
        for point in 1..=count {
            let dir = tmp.path().join(format!("rank{rank}_point{point}"));
            let first = run_in(
                &dir,
                2,
                &[common[0], common[1], common[2], ("TEST_STOP", "3")],
            );
            assert_ok(&first);
            let fault = format!("{rank}:{point}");
            let crashed = run_in(
                &dir,
                2,
                &[
                    common[0],
                    common[1],
                    common[2],
                    ("TEST_RESUME", "1"),
                    ("TEST_SAVES", "6"),
                    (FAULT, &fault),
                ],
            );
            let context = format!("{snapshot}: killed at point {point} of rank {rank}");
            assert!(!crashed[rank].status.success(), "{context}: it survived");
            assert!(
                stderr(&crashed[rank]).contains(FAULT),
                "{context}: {}",
                stderr(&crashed[rank])
            );
            killed += 1;
            let saving = rotation(&dir).path_for(6);
            assert!(!saving.exists(), "{context}: the killed save was committed");
            assert!(read_manifest(&partial_dir(&saving)).is_err(), "{context}");
            assert_eq!(
                rotation(&dir).latest(),
                Some(rotation(&dir).path_for(3)),
                "{context}"
            );
            let resumed = run_in(
                &dir,
                2,
                &[common[0], common[1], common[2], ("TEST_RESUME", "1")],
            );
            assert_ok(&resumed);
            for r in 0..2 {
                assert_resumed_like(
                    (&resumed[r], &whole[r]),
                    "3",
                    &["UPDATES ", "SEEN "],
                    false,
                    &format!("{context}, rank {r}"),
                );
            }
        }
    }
    assert_eq!(killed, 9);
}

/// A background write that fails on one rank is reported by the next call that touches
/// checkpoints, on every rank, naming the rank and the file; nothing is committed and the
/// previous checkpoint stays the latest.
#[test]
fn a_failed_background_write_is_reported_at_the_next_save_naming_rank_and_file() {
    let tmp = tempfile::tempdir().unwrap();
    let common = [("TEST_OPTIM", "fused"), (ASYNC, "true")];
    assert_ok(&run_in(
        tmp.path(),
        2,
        &[common[0], common[1], ("TEST_STOP", "3")],
    ));
    // Rank 1's first point of each save is its loop state: the save after 6 fails there,
    // and the save after 9 reports it (before starting: it fails too).
    let failing = [
        common[0],
        common[1],
        ("TEST_RESUME", "1"),
        ("TEST_SAVES", "6,9"),
        (FAULT, "1:1:fail"),
    ];
    let outputs = run_in(tmp.path(), 2, &failing);
    for (rank, output) in outputs.iter().enumerate() {
        let out = String::from_utf8_lossy(&output.stdout);
        assert!(!output.status.success(), "rank {rank} did not fail: {out}");
        assert!(
            out.contains("SAVED") && !out.contains("UPDATES"),
            "rank {rank}: {out}"
        );
        let err = stderr(output);
        assert!(
            err.contains("rank 1: ") && err.contains("rank_1.json") && err.contains("injected"),
            "rank {rank}: {err}"
        );
        assert!(
            err.contains("checkpoint_6: writing the checkpoint in the background failed"),
            "rank {rank}: {err}"
        );
    }
    let rotation = CheckpointRotation::new(tmp.path(), None);
    assert!(!rotation.path_for(6).exists());
    assert!(!partial_dir(&rotation.path_for(6)).exists(), "left behind");
    assert!(!rotation.path_for(9).exists());
    assert_eq!(rotation.latest(), Some(rotation.path_for(3)));
}

#[test]
fn another_world_size_is_refused_unless_asked_for() {
    let tmp = tempfile::tempdir().unwrap();
    assert_ok(&run_in(tmp.path(), 2, &[("TEST_STOP", "5")]));
    let refused = run_in(tmp.path(), 1, &[("TEST_RESUME", "1")]);
    assert!(!refused[0].status.success());
    let err = stderr(&refused[0]);
    assert!(
        err.contains("saved by 2 processes and this job has 1"),
        "{err}"
    );
    assert!(err.contains("resume_with_different_world_size"), "{err}");

    // Opted in: the single process continues the epoch from the global position (5 updates
    // of 2 rounds of 16 samples = 160 of 240 samples of epoch 0) and sees every other sample.
    let resumed = run_in(
        tmp.path(),
        1,
        &[("TEST_RESUME", "1"), ("TEST_ANY_WORLD", "1")],
    );
    assert_ok(&resumed);
    // Per-process batches seen by rank 0 before (10) plus: 80 samples left of epoch 0 = 10
    // batches of 8, then 30 of epoch 1.
    assert_eq!(line(&resumed[0], "SEEN "), "50");

    // ZeRO-1 and ZeRO-2 shards saved by 2 processes are reassembled for 1.
    for stage in ["zero", "zero2"] {
        let tmp = tempfile::tempdir().unwrap();
        let zero = ("TEST_OPTIM", stage);
        assert_ok(&run_in(tmp.path(), 2, &[("TEST_STOP", "5"), zero]));
        let resumed = run_in(
            tmp.path(),
            1,
            &[("TEST_RESUME", "1"), ("TEST_ANY_WORLD", "1"), zero],
        );
        assert_ok(&resumed);
        assert_eq!(line(&resumed[0], "SEEN "), "50", "{stage}");
    }
}

#[test]
fn a_save_never_replaces_a_users_directory_and_replaces_its_own_checkpoint() {
    // The same rule when the save is written and committed in the background.
    for mode in ["false", "true"] {
        never_replaces_a_users_directory(mode);
    }
}

fn never_replaces_a_users_directory(asynchronous: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let output = tmp.path().join("output");
    std::fs::create_dir(&output).unwrap();
    std::fs::write(output.join("train.log"), "the user's log").unwrap();
    let into = ("TEST_SAVE_INTO", output.to_str().unwrap());
    let refused = run_in(
        tmp.path(),
        2,
        &[("TEST_STOP", "3"), into, (ASYNC, asynchronous)],
    );
    for (rank, result) in refused.iter().enumerate() {
        assert!(!result.status.success(), "rank {rank} saved");
        let err = stderr(result);
        assert!(
            err.contains("holds files but no accelerate-rs manifest.json"),
            "{err}"
        );
        assert!(err.contains(output.to_str().unwrap()), "{err}");
    }
    let names: Vec<_> = std::fs::read_dir(&output).unwrap().collect();
    assert_eq!(names.len(), 1, "only the user's file: {names:?}");
    assert_eq!(
        std::fs::read_to_string(output.join("train.log")).unwrap(),
        "the user's log"
    );
    assert!(!partial_dir(&output).exists());

    // Into a directory of its own: saved, then replaced by a later save of the same name.
    let ckpt = tmp.path().join("ckpt");
    let into = ("TEST_SAVE_INTO", ckpt.to_str().unwrap());
    assert_ok(&run_in(
        tmp.path(),
        2,
        &[("TEST_STOP", "3"), into, (ASYNC, asynchronous)],
    ));
    assert_eq!(read_manifest(&ckpt).unwrap().updates, 3);
    assert_ok(&run_in(
        tmp.path(),
        2,
        &[("TEST_STOP", "5"), into, (ASYNC, asynchronous)],
    ));
    assert_eq!(read_manifest(&ckpt).unwrap().updates, 5);
    let old = accelerate_core::checkpoint::old_dir(&ckpt);
    assert!(!old.exists() && !partial_dir(&ckpt).exists());
}

#[test]
fn after_a_resume_from_an_older_checkpoint_rotation_keeps_the_new_run() {
    // Rotation follows the commit, also when the main process commits in the background.
    for mode in ["false", "true"] {
        rotation_keeps_the_new_run(mode);
    }
}

fn rotation_keeps_the_new_run(asynchronous: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let rotation = CheckpointRotation::new(tmp.path(), None);
    assert_ok(&run_in(
        tmp.path(),
        2,
        &[
            ("TEST_SAVES", "3"),
            ("TEST_STOP", "6"),
            (ASYNC, asynchronous),
        ],
    ));
    assert_eq!(rotation.latest(), Some(rotation.path_for(6)));
    // The user goes back to update 3 (the run after it diverged) and saves after update 4,
    // keeping one checkpoint: the new one stays, the abandoned run's checkpoint_6 goes.
    let from = rotation.path_for(3).display().to_string();
    let resumed = run_in(
        tmp.path(),
        2,
        &[
            ("TEST_RESUME_FROM", from.as_str()),
            ("TEST_STOP", "4"),
            ("TEST_LIMIT", "1"),
            (ASYNC, asynchronous),
        ],
    );
    assert_ok(&resumed);
    assert!(line(&resumed[0], "RESUMED ").starts_with("3 "));
    let kept: Vec<u64> = rotation.list().into_iter().map(|(n, _)| n).collect();
    assert_eq!(kept, vec![4]);
    assert!(!rotation.path_for(6).exists());
    let latest = run_in(
        tmp.path(),
        2,
        &[
            ("TEST_RESUME", "1"),
            ("TEST_STOP", "5"),
            (ASYNC, asynchronous),
        ],
    );
    assert_ok(&latest);
    assert!(line(&latest[0], "RESUMED ").starts_with("4 "));
}

#[test]
fn a_save_killed_between_its_two_renames_resumes_the_previous_checkpoint() {
    // The next save's commit and rotation tidy up, also in the background.
    for mode in ["false", "true"] {
        killed_between_renames(mode);
    }
}

fn killed_between_renames(asynchronous: &str) {
    let tmp = tempfile::tempdir().unwrap();
    let rotation = CheckpointRotation::new(tmp.path(), None);
    assert_ok(&run_in(tmp.path(), 2, &[("TEST_STOP", "3")]));
    // What a kill between the renames of a save of checkpoint_3 leaves on a file system
    // without an atomic exchange: the previous checkpoint moved aside, the new one complete
    // but still partial.
    let dir = rotation.path_for(3);
    let old = accelerate_core::checkpoint::old_dir(&dir);
    std::fs::rename(&dir, &old).unwrap();
    std::fs::create_dir(partial_dir(&dir)).unwrap();
    for entry in std::fs::read_dir(&old).unwrap() {
        let entry = entry.unwrap();
        if entry.file_type().unwrap().is_file() {
            std::fs::copy(entry.path(), partial_dir(&dir).join(entry.file_name())).unwrap();
        }
    }
    assert_eq!(rotation.latest(), Some(old.clone()));
    // Resuming takes the previous checkpoint; the next rotation (one kept) removes it and
    // the crashed save's partial directory.
    let resumed = run_in(
        tmp.path(),
        2,
        &[
            ("TEST_RESUME", "1"),
            ("TEST_SAVES", "5"),
            ("TEST_LIMIT", "1"),
            (ASYNC, asynchronous),
        ],
    );
    assert_ok(&resumed);
    assert!(line(&resumed[0], "RESUMED ").starts_with("3 "));
    let kept: Vec<u64> = rotation.list().into_iter().map(|(n, _)| n).collect();
    assert_eq!(kept, vec![5]);
    assert!(!old.exists() && !partial_dir(&dir).exists());
}
