//! The transformer example, run as a test on a small configuration: it learns, a run stopped
//! and resumed from its project directory ends bit-identical to one that never stopped, two
//! processes learn what one learns from the same global batches, and the fused kernels
//! train what burn-nn's do.

mod common;
#[path = "../../tests-support/netns.rs"]
mod netns;
#[path = "../../tests-support/tools.rs"]
mod tools;
#[allow(dead_code)]
#[path = "../transformer_lm.rs"]
mod transformer_example;

use accelerate_burn::burn::tensor::DType;
use accelerate_burn::{AcceleratorBackend, DefaultBackend};
use accelerate_examples::text::{RowFormat, write_text_rows};
use clap::Parser;
use common::{SCENARIO, env_number, largest_difference, line, param_bits, params, run};
use transformer_example::{Args, Report, learning_rate};

/// Trains one run at a time: the device's random stream (weight initialisation) is shared by
/// the whole test process, so runs side by side could draw each other's weights.
fn train(args: &Args) -> anyhow::Result<Report> {
    static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());
    let _alone = ONE_AT_A_TIME
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    transformer_example::train(args)
}

/// The small model on `args`, stopped after `stop_at` updates with its state in `project`,
/// then run again from there to the end: the resumed run's report.
fn stopped_then_resumed(args: &[&str], stop_at: u64, project: &str) -> Report {
    let stop = stop_at.to_string();
    let mut first = args.to_vec();
    first.extend(["--stop-at", &stop, "--project-dir", project]);
    assert_eq!(train(&small(&first)).unwrap().updates, stop_at);
    let mut resumed = args.to_vec();
    resumed.extend(["--project-dir", project]);
    train(&small(&resumed)).unwrap()
}

/// A model small enough to train for a few seconds in a test.
fn small(extra: &[&str]) -> Args {
    let mut argv = vec![
        "transformer_lm",
        "--context",
        "32",
        "--layers",
        "2",
        "--d-model",
        "32",
        "--heads",
        "2",
        "--mlp",
        "64",
        "--batch",
        "8",
        "--lr",
        "1e-2",
        "--warmup",
        "5",
        "--eval-sequences",
        "32",
        "--sample-bytes",
        "0",
    ];
    argv.extend_from_slice(extra);
    Args::parse_from(argv)
}

#[test]
fn the_schedule_warms_up_linearly_then_follows_a_cosine_to_a_tenth() {
    let args = Args::parse_from(["transformer_lm", "--steps", "1100", "--lr", "1e-3"]);
    assert!((learning_rate(&args, 0) - 1e-5).abs() < 1e-12);
    assert!((learning_rate(&args, 99) - 1e-3).abs() < 1e-12);
    assert!((learning_rate(&args, 600) - 5.5e-4).abs() < 1e-12);
    assert!((learning_rate(&args, 1100) - 1e-4).abs() < 1e-12);
}

/// From a uniform guess (ln 256 = 5.55 nats per byte) to below 3.30 nats in 150 updates of a
/// 2-layer model (3.17 observed): under the 3.34 nats of the text's byte frequencies alone, so
/// it predicts from context.
#[test]
fn the_small_transformer_learns_the_text() {
    let report = train(&small(&["--steps", "150", "--eval-every", "1000"])).unwrap();
    assert_eq!(report.updates, 150);
    assert!(
        report.validation.value < 3.30,
        "validation loss {}",
        report.validation.value
    );
    assert_eq!(report.validation.weight, 32.0 * 32.0);
    assert!(report.train_loss < 3.4, "train loss {}", report.train_loss);
}

/// The fused kernels (layer norm, attention softmax, GELU, cross-entropy) train what burn-nn's
/// modules do: 60 updates of the small model, the same
/// validation loss within 0.02 nats per byte (the bound for 300 updates of the default
/// model), the same initial weights.
#[test]
fn fused_modules_train_like_burn_nns() {
    let extra = ["--steps", "60", "--eval-every", "1000"];
    let fused = train(&small(&extra)).unwrap();
    let burn_nn = train(&small(&[&extra[..], &["--burn-nn-modules"]].concat())).unwrap();
    let gap = (fused.validation.value - burn_nn.validation.value).abs();
    assert!(
        gap < 0.02,
        "fused {} against burn-nn's {}",
        fused.validation.value,
        burn_nn.validation.value
    );
    assert_eq!(fused.parameters.len(), burn_nn.parameters.len());
}

#[test]
fn a_run_resumed_from_its_project_directory_ends_bit_identical() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    let whole = train(&small(&["--steps", "12", "--eval-every", "6"])).unwrap();
    let first = train(&small(&[
        "--steps",
        "12",
        "--eval-every",
        "6",
        "--stop-at",
        "6",
        "--project-dir",
        dir,
    ]))
    .unwrap();
    assert_eq!(first.updates, 6);
    let resumed = train(&small(&[
        "--steps",
        "12",
        "--eval-every",
        "6",
        "--project-dir",
        dir,
    ]))
    .unwrap();
    assert_eq!(resumed.updates, 12);
    assert!(resumed.parameters == whole.parameters, "parameters differ");
    assert_eq!(
        resumed.validation_ema.value.to_bits(),
        whole.validation_ema.value.to_bits()
    );
    assert_eq!(
        resumed.validation.value.to_bits(),
        whole.validation.value.to_bits()
    );
    assert!(tmp.path().join("logs/metrics.csv").exists());
}

/// The corpus read from token files on disk (llm.c's format, as `--example prepare_data`
/// writes it), or from Arrow IPC files whose `text` rows are the windows (3 training files of
/// record batches of 2,000 rows, read at random from the memory-mapped files), trains bit for
/// bit what the embedded text trains: the windows, their order and so every update are the
/// same. Several token files per split train too (windows never cross a file, so there are a
/// few fewer of them).
#[test]
fn training_from_token_or_arrow_files_equals_training_from_the_embedded_text() {
    let tmp = tempfile::tempdir().unwrap();
    let [one_file, many_files, arrow] = ["one", "many", "arrow"].map(|d| tmp.path().join(d));
    for dir in [&one_file, &many_files, &arrow] {
        std::fs::create_dir(dir).unwrap();
    }
    accelerate_examples::text::write_token_files(&one_file, usize::MAX).unwrap();
    let files = accelerate_examples::text::write_token_files(&many_files, 1 << 20).unwrap();
    assert_eq!(files.len(), 6, "{files:?}");
    let files = write_text_rows(&arrow, RowFormat::Arrow, 33, (60_000, 2_000)).unwrap();
    assert_eq!(files.len(), 4, "{files:?}");
    let steps = ["--steps", "8", "--eval-every", "4"];
    let embedded = train(&small(&steps)).unwrap();
    for dir in [&one_file, &arrow] {
        let mut from_files = steps.to_vec();
        from_files.extend(["--data", dir.to_str().unwrap()]);
        let from_files = train(&small(&from_files)).unwrap();
        assert!(
            from_files.parameters == embedded.parameters,
            "parameters differ: {}",
            dir.display()
        );
        assert_eq!(
            from_files.validation.value.to_bits(),
            embedded.validation.value.to_bits()
        );
    }
    let mut sharded = steps.to_vec();
    sharded.extend(["--data", many_files.to_str().unwrap()]);
    let sharded = train(&small(&sharded)).unwrap();
    assert_eq!(sharded.updates, 8);
    assert!(sharded.validation.value.is_finite());
}

/// The corpus as Parquet files (a `text` column, 3 files of row groups of 2,000 rows), read in
/// pieces and read as a stream (`--stream`, other batches): each trains, and a run stopped and
/// resumed from its project directory ends bit for bit where the run that never stopped ends.
#[test]
fn training_from_parquet_files_resumes_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("parquet");
    std::fs::create_dir(&data).unwrap();
    let files = write_text_rows(&data, RowFormat::Parquet, 33, (60_000, 2_000)).unwrap();
    assert_eq!(files.len(), 4, "{files:?}");
    let data = data.to_str().unwrap();
    let mut ends = Vec::new();
    // The map-style loader reading in pieces, and the stream loader (row groups as shards).
    for loader in [None, Some("--stream")] {
        let project = tmp.path().join(format!("project-{}", ends.len()));
        let project = project.to_str().unwrap();
        let mut steps = vec!["--steps", "12", "--eval-every", "6", "--data", data];
        steps.extend(loader);
        let whole = train(&small(&steps)).unwrap();
        assert!(
            whole.validation.value < 5.0,
            "{loader:?}: {}",
            whole.validation.value
        );
        let resumed = stopped_then_resumed(&steps, 6, project);
        assert_eq!(resumed.updates, 12);
        assert!(
            resumed.parameters == whole.parameters,
            "{loader:?}: parameters differ"
        );
        ends.push(whole.parameters);
    }
    assert!(ends[0] != ends[1], "--stream read the same batches");
}

/// fp16's first steps overflow while the loss scale backs off, and a skipped step is no
/// update: the run logs and evaluates each update once (it used to evaluate, log and save
/// update 0 again after every skipped step).
#[test]
fn skipped_fp16_steps_log_and_evaluate_nothing() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().to_str().unwrap();
    let args = [
        "--steps",
        "6",
        "--eval-every",
        "3",
        "--log-every",
        "1",
        "--mixed-precision",
        "fp16",
        "--project-dir",
        dir,
    ];
    let report = train(&small(&args)).unwrap();
    assert_eq!(report.updates, 6);
    let csv = std::fs::read_to_string(tmp.path().join("logs/metrics.csv")).unwrap();
    let steps = |metric: &str| -> Vec<u64> {
        csv.lines()
            .filter_map(|row| {
                let fields: Vec<&str> = row.split(',').collect();
                (fields.get(1) == Some(&metric)).then(|| fields[0].parse().unwrap())
            })
            .collect()
    };
    assert_eq!(steps("validation/loss"), [3, 6], "{csv}");
    assert_eq!(steps("train/loss"), [1, 2, 3, 4, 5, 6], "{csv}");
}

/// A rank of the multi-process test: 8 updates of the small model, `TEST_BATCH` sequences per
/// process; prints the parameters and the validation loss.
#[test]
fn child() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    assert_eq!(scenario, "transformer");
    let batch = env_number::<usize>("TEST_BATCH").to_string();
    let steps = match env_number::<usize>("TEST_STEPS") {
        0 => 8,
        steps => steps,
    }
    .to_string();
    let mut flags = vec![
        "--steps",
        steps.as_str(),
        "--eval-every",
        "1000",
        "--batch",
        batch.as_str(),
    ];
    let mixed = std::env::var("TEST_MIXED").unwrap_or_default();
    if !mixed.is_empty() {
        flags.extend(["--mixed-precision", mixed.as_str()]);
    }
    let data = std::env::var("TEST_DATA").unwrap_or_default();
    if !data.is_empty() {
        flags.extend(["--data", data.as_str()]);
    }
    if std::env::var_os("TEST_KEYED_ORDER").is_some() {
        flags.push("--keyed-order");
    }
    if std::env::var_os("TEST_BURN_OPTIMIZER").is_some() {
        flags.push("--burn-optimizer");
    }
    match train(&small(&flags)) {
        Ok(report) => {
            let bits: Vec<String> = report
                .parameters
                .iter()
                .map(|b| format!("{b:08x}"))
                .collect();
            println!("PARAMS {}", bits.join(","));
            println!("VALIDATION {}", report.validation.value);
            println!("OVERLAPPED {}", report.overlapped_gradients);
            std::process::exit(0);
        }
        Err(e) => {
            eprintln!("ERROR {e}");
            std::process::exit(3);
        }
    }
}

/// Tolerance 1e-6 (1.4e-7 observed): token sums are averaged in another order than in one
/// batch, and AdamW's division by the root of the second moment magnifies the last bits of
/// small gradients over 8 updates.
#[test]
fn two_processes_train_the_transformer_like_one_with_the_same_global_batches() {
    let single = run("transformer", 1, &[("TEST_BATCH", "16".to_string())]);
    assert_ranks_train_like(&single[0], 2, "0", &[]);
}

/// Overlap (each layer a unit whose gradients a communication thread averages while backward
/// goes on through the layers before it) trains the same bits as averaging after backward, on
/// two processes: fused AdamW over summed token losses, with accumulation windows of 2 and a
/// bf16 wire, Burn's AdamW in fp16 (loss scaling, its first steps skipped), and ZeRO-2 (each
/// layer's gradients reduce-scattered into the shards from the taps and let go; windows of 2
/// and an fp16 wire too; under bf16 autocast ZeRO-2 averages after backward, so nothing
/// overlaps there, unless the backend cannot compute in bf16 and trains in f32: lavapipe). On a GPU backend the fused optimizer's buffers live on the device
/// and average after backward (no overlap yet) except ZeRO-2's, on the host; Burn's optimizer
/// and ZeRO-2 overlap there without Burn's fusion (with it, the taps' reads end fused kernels
/// elsewhere than after backward, and results move: overlap stays off there).
#[test]
fn overlapped_communication_trains_the_same_bits_as_averaging_after_backward() {
    let batch = ("TEST_BATCH", "8".to_string());
    let settings: [&[(&str, &str)]; 6] = [
        &[],
        &[
            ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2"),
            ("ACCELERATE_GRADIENT_COMMUNICATION", "bf16"),
        ],
        &[
            ("TEST_BURN_OPTIMIZER", "1"),
            ("TEST_MIXED", "fp16"),
            ("ACCELERATE_FUSION", "false"),
        ],
        &[
            ("ACCELERATE_ZERO_STAGE", "2"),
            ("ACCELERATE_FUSION", "false"),
        ],
        &[
            ("ACCELERATE_ZERO_STAGE", "2"),
            ("ACCELERATE_FUSION", "false"),
            ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2"),
            ("ACCELERATE_GRADIENT_COMMUNICATION", "fp16"),
        ],
        &[
            ("ACCELERATE_ZERO_STAGE", "2"),
            ("ACCELERATE_FUSION", "false"),
            ("TEST_MIXED", "bf16"),
        ],
    ];
    for setting in settings {
        let on_host = setting
            .iter()
            .any(|(k, _)| *k == "TEST_BURN_OPTIMIZER" || *k == "ACCELERATE_ZERO_STAGE");
        let autocast_zero_2 =
            on_host && setting.contains(&("TEST_MIXED", "bf16")) && computes_in(DType::BF16);
        let overlaps = !autocast_zero_2
            && (on_host || !<DefaultBackend as AcceleratorBackend>::DEVICE_KERNELS);
        let [on, off] = ["true", "false"].map(|overlap| {
            let mut env = vec![
                batch.clone(),
                ("ACCELERATE_OVERLAP_COMMUNICATION", overlap.into()),
            ];
            env.extend(setting.iter().map(|&(k, v)| (k, v.to_string())));
            run("transformer", 2, &env)
        });
        assert_overlap_changed_no_bit(&on, &off, overlaps, &format!("{setting:?}"));
    }
}

/// Whether this build's backend computes in `dtype` on the first device (else the accelerator
/// trains in f32 when asked for it).
fn computes_in(dtype: DType) -> bool {
    <DefaultBackend as AcceleratorBackend>::device(0)
        .is_ok_and(|device| DefaultBackend::float_dtypes(&device).contains(&dtype))
}

/// Every rank of `on` (a job with overlap) and `off` (the same without) succeeded, `on`
/// averaged gradients during backward exactly when `overlaps`, and each rank ended with the
/// same parameters, bit for bit.
fn assert_overlap_changed_no_bit(
    on: &[std::process::Output],
    off: &[std::process::Output],
    overlaps: bool,
    context: &str,
) {
    for (rank, (on, off)) in on.iter().zip(off).enumerate() {
        for output in [on, off] {
            assert!(
                output.status.success(),
                "{context}, rank {rank}: {}",
                String::from_utf8_lossy(&output.stderr)
            );
        }
        let overlapped: u64 = line(on, "OVERLAPPED ").parse().unwrap_or(0);
        assert_eq!(
            overlapped > 0,
            overlaps,
            "{context}, rank {rank}: {overlapped}"
        );
        assert_eq!(line(off, "OVERLAPPED "), "0", "{context}");
        assert!(
            line(on, "PARAMS ") == line(off, "PARAMS "),
            "{context}: rank {rank}'s parameters differ with and without overlap"
        );
    }
}

/// Overlap across hosts: 4 processes, two in each of two network namespaces joined by a link
/// shaped to 200 Mbit/s (`tc`'s `tbf`), each its own host over our TCP engine, train the same
/// bits with and without overlap (the ring's two crossings carry every bucket); and so do
/// ZeRO-2's units, their pieces reduce-scattered onto their owners over the TCP ring, or
/// under hybrid sharding within each host and averaged across the hosts.
#[test]
fn overlap_over_a_shaped_link_between_two_hosts_trains_the_same_bits() {
    let Some(hosts) = netns::TwoHosts::new("overlap") else {
        return;
    };
    hosts.shape_link("200mbit");
    let namespaces = [0, 0, 1, 1].map(|machine| hosts.namespaces[machine].clone());
    let settings: [&[(&str, &str)]; 3] = [
        &[],
        &[
            ("ACCELERATE_ZERO_STAGE", "2"),
            ("ACCELERATE_FUSION", "false"),
        ],
        &[
            ("ACCELERATE_ZERO_STAGE", "2"),
            ("ACCELERATE_FUSION", "false"),
            ("ACCELERATE_SHARD_GROUP_SIZE", "host"),
        ],
    ];
    for setting in settings {
        let [on, off] = ["true", "false"].map(|overlap| {
            let mut env = vec![
                ("TEST_BATCH", "4".to_string()),
                ("ACCELERATE_OVERLAP_COMMUNICATION", overlap.to_string()),
            ];
            env.extend(setting.iter().map(|&(k, v)| (k, v.to_string())));
            common::run_on_hosts(&namespaces, &hosts.addresses[0], "transformer", &env)
        });
        let overlaps =
            !setting.is_empty() || !<DefaultBackend as AcceleratorBackend>::DEVICE_KERNELS;
        let context = format!("2 hosts x 2 processes, {setting:?}");
        assert_overlap_changed_no_bit(&on, &off, overlaps, &context);
    }
    assert_eq!(
        (hosts.leftovers(0), hosts.leftovers(1)),
        (String::new(), String::new())
    );
}

/// A rank that dies while its communication thread averages (an abort injected before its
/// third bucket, in the middle of a backward pass) ends the job: the other rank's `backward`
/// fails, naming rank 1, instead of waiting for it.
#[test]
fn a_rank_dying_in_overlapped_communication_fails_its_peer_naming_it() {
    if <DefaultBackend as AcceleratorBackend>::DEVICE_KERNELS {
        return;
    }
    let env = [
        ("TEST_BATCH", "8".to_string()),
        ("ACCELERATE_FAULT_OVERLAP_AT", "1:3".to_string()),
    ];
    let ranks = run("transformer", 2, &env);
    let stderr = |rank: usize| String::from_utf8_lossy(&ranks[rank].stderr).into_owned();
    assert!(!ranks[1].status.success(), "rank 1 lived on: {}", stderr(1));
    assert!(
        stderr(1).contains("aborting before bucket 3"),
        "{}",
        stderr(1)
    );
    assert_eq!(ranks[0].status.code(), Some(3), "{}", stderr(0));
    assert!(
        stderr(0).contains("rank 1"),
        "rank 0 does not name rank 1: {}",
        stderr(0)
    );
}

/// Two processes reading the corpus from token files or from Arrow files (`--data`) train
/// what one process trains from the embedded text: each reads its share of the windows from
/// the files.
#[test]
fn two_processes_train_from_token_or_arrow_files_like_one_from_the_embedded_text() {
    let tmp = tempfile::tempdir().unwrap();
    let [tokens, arrow] = ["tokens", "arrow"].map(|d| tmp.path().join(d));
    for dir in [&tokens, &arrow] {
        std::fs::create_dir(dir).unwrap();
    }
    accelerate_examples::text::write_token_files(&tokens, usize::MAX).unwrap();
    write_text_rows(&arrow, RowFormat::Arrow, 33, (60_000, 2_000)).unwrap();
    let single = run("transformer", 1, &[("TEST_BATCH", "16".to_string())]);
    for dir in [&tokens, &arrow] {
        let data = ("TEST_DATA", dir.to_str().unwrap().to_string());
        assert_ranks_train_like(&single[0], 2, "0", &[data]);
    }
}

/// The same in the keyed order (computed at each position, constant memory): two processes
/// reading token files train what one process trains from the embedded text.
#[test]
fn two_processes_train_from_token_files_in_a_keyed_order_like_one() {
    let tmp = tempfile::tempdir().unwrap();
    accelerate_examples::text::write_token_files(tmp.path(), usize::MAX).unwrap();
    let keyed = ("TEST_KEYED_ORDER", "1".to_string());
    let single = run(
        "transformer",
        1,
        &[("TEST_BATCH", "16".to_string()), keyed.clone()],
    );
    let data = ("TEST_DATA", tmp.path().to_str().unwrap().to_string());
    assert_ranks_train_like(&single[0], 2, "0", &[data, keyed]);
}

/// A run from token files in the keyed order, stopped and resumed from its project directory,
/// ends bit for bit where the run that never stopped ends, on other windows than the drawn
/// order's.
#[test]
fn training_from_token_files_in_a_keyed_order_resumes_bit_identically() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("tokens");
    std::fs::create_dir(&data).unwrap();
    accelerate_examples::text::write_token_files(&data, 1_000_000).unwrap();
    let (data, project) = (data.to_str().unwrap(), tmp.path().join("project"));
    let project = project.to_str().unwrap();
    let steps = ["--steps", "8", "--eval-every", "4", "--data", data];
    let drawn = train(&small(&steps)).unwrap();
    let mut keyed = steps.to_vec();
    keyed.push("--keyed-order");
    let whole = train(&small(&keyed)).unwrap();
    assert!(
        whole.parameters != drawn.parameters,
        "the keyed order changed nothing"
    );
    let resumed = stopped_then_resumed(&keyed, 4, project);
    assert_eq!(resumed.updates, 8);
    assert!(resumed.parameters == whole.parameters, "parameters differ");
}

/// `ACCELERATE_TRACE` on two processes: a timeline per rank holding the last 4 steps, whose
/// phases (waiting for data, forward, backward with its collectives, optimizer, the moving
/// average) cover at least
/// 95 % of each step's time (what they leave is the example's own bookkeeping between steps),
/// and whose gradient collectives carry their bytes.
#[test]
fn two_ranks_write_timelines_whose_phases_add_up_to_each_step() {
    let dir = tempfile::tempdir().unwrap();
    let env = [
        // Steps of tens of milliseconds: a scheduler's pause between two phases stays small.
        ("TEST_BATCH", "32".to_string()),
        ("ACCELERATE_TRACE", dir.path().display().to_string()),
        ("ACCELERATE_TRACE_STEPS", "4".to_string()),
    ];
    for output in run("transformer", 2, &env) {
        assert!(output.status.success(), "{output:?}");
    }
    for rank in 0..2 {
        let path = dir.path().join(format!("trace_rank_{rank}.json"));
        let trace: serde_json::Value =
            serde_json::from_slice(&std::fs::read(&path).unwrap()).unwrap();
        let events: Vec<&serde_json::Value> = trace["traceEvents"]
            .as_array()
            .unwrap()
            .iter()
            .filter(|e| e["ph"] == "X")
            .collect();
        assert!(events.iter().all(|e| e["pid"] == rank));
        let steps: Vec<&&serde_json::Value> =
            events.iter().filter(|e| e["name"] == "step").collect();
        let updates: Vec<u64> = steps
            .iter()
            .map(|s| s["args"]["update"].as_u64().unwrap())
            .collect();
        assert_eq!(updates, [5, 6, 7, 8], "rank {rank}");
        for step in steps {
            let (start, dur) = (step["ts"].as_f64().unwrap(), step["dur"].as_f64().unwrap());
            let inside = |e: &&&serde_json::Value| {
                let ts = e["ts"].as_f64().unwrap();
                ts >= start && ts + e["dur"].as_f64().unwrap() <= start + dur + 1.0
            };
            let phases: f64 = events
                .iter()
                .filter(|e| {
                    ["data_wait", "forward", "backward", "optimizer", "ema"]
                        .contains(&e["name"].as_str().unwrap())
                })
                .filter(inside)
                .map(|e| e["dur"].as_f64().unwrap())
                .sum();
            assert!(
                phases <= dur + 1.0 && phases >= 0.95 * dur,
                "rank {rank}: phases {phases} µs of a step of {dur} µs"
            );
            let gradient_bytes: u64 = events
                .iter()
                .filter(inside)
                .filter(|e| {
                    e["name"]
                        .as_str()
                        .is_some_and(|n| n.starts_with("all_reduce"))
                })
                .map(|e| e["args"]["bytes"].as_u64().unwrap())
                .sum();
            assert!(
                gradient_bytes > 10_000,
                "rank {rank}: {gradient_bytes} bytes reduced"
            );
        }
    }
}

/// ZeRO-2 (each rank holds 1/N of the gradients, master parameters and AdamW state) on 2 and 4
/// processes, the same tolerance as without it (the example's fused AdamW, global clipping).
#[test]
fn zero_2_on_two_and_four_processes_trains_the_transformer_like_one() {
    let single = run("transformer", 1, &[("TEST_BATCH", "16".to_string())]);
    for world in [2, 4] {
        assert_ranks_train_like(&single[0], world, "2", &[]);
    }
}

/// ZeRO-3: each transformer layer a sharded unit (1/N of its parameters per process,
/// gathered for its forward pass and again in backward; embeddings and the final norm whole)
/// on 2 and 4 processes, 30 updates with accumulation windows of 2 (token-weighted sums) and
/// global clipping: within 1e-6 of one process, bit for bit across ranks.
#[test]
fn zero_3_on_two_and_four_processes_trains_the_transformer_like_one() {
    let settings = [
        ("TEST_STEPS", "30".to_string()),
        ("ACCELERATE_GRADIENT_ACCUMULATION_STEPS", "2".to_string()),
    ];
    let mut single_env = vec![("TEST_BATCH", "16".to_string())];
    single_env.extend(settings.iter().cloned());
    let single = run("transformer", 1, &single_env);
    for world in [2, 4] {
        assert_ranks_train_like(&single[0], world, "3", &settings);
    }
}

/// Under bf16 autocast the sharded layers travel in bf16 and their gradients are averaged in
/// f32: ZeRO-3 ends within 1e-6 of the unsharded run on the same 2 processes (N processes
/// are not one process under bf16 at any stage: see the MLP's ZeRO-2 test).
#[test]
fn zero_3_under_bf16_autocast_trains_the_transformer_like_zero_0_on_the_same_processes() {
    let settings = [
        ("TEST_BATCH", "8".to_string()),
        ("TEST_MIXED", "bf16".to_string()),
    ];
    let mut unsharded_env = settings.to_vec();
    unsharded_env.push(("ACCELERATE_ZERO_STAGE", "0".to_string()));
    let unsharded = run("transformer", 2, &unsharded_env);
    assert!(
        unsharded[0].status.success(),
        "{}",
        String::from_utf8_lossy(&unsharded[0].stderr)
    );
    assert_ranks_train_like(&unsharded[0], 2, "3", &settings[1..]);
}

/// Trains on `world` processes at ZeRO stage `stage`, 16 / `world` sequences each, with the
/// `extra` settings, and asserts every rank ends within 1e-6 of `single` (and its validation
/// loss within 1e-4).
fn assert_ranks_train_like(
    single: &std::process::Output,
    world: usize,
    stage: &str,
    extra: &[(&str, String)],
) {
    let reference = params(single);
    let validation: f64 = line(single, "VALIDATION ").parse().unwrap();
    let mut env = vec![
        ("TEST_BATCH", (16 / world).to_string()),
        ("ACCELERATE_ZERO_STAGE", stage.to_string()),
    ];
    env.extend(extra.iter().cloned());
    let ranks = run("transformer", world, &env);
    for (rank, output) in ranks.iter().enumerate() {
        assert!(
            output.status.success(),
            "ZeRO-{stage}, {world} processes, rank {rank}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        let worst = largest_difference(&params(output), &reference);
        eprintln!("ZeRO-{stage}, {world} processes, rank {rank}: largest difference {worst:e}");
        assert!(
            worst <= 1e-6,
            "ZeRO-{stage}, {world} processes, rank {rank}: largest difference {worst}"
        );
        let theirs: f64 = line(output, "VALIDATION ").parse().unwrap();
        assert!(
            (theirs - validation).abs() <= 1e-4,
            "rank {rank}: validation loss {theirs} vs {validation}"
        );
    }
    assert!(
        ranks
            .windows(2)
            .all(|w| param_bits(&w[0]) == param_bits(&w[1])),
        "ZeRO-{stage}, {world} processes: the ranks' parameters differ"
    );
}
