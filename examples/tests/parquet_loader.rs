//! A Parquet corpus read in pieces (its row groups) by real processes on 127.0.0.1: every row
//! read once per epoch by 1, 2 and 3 processes, each process reading mostly its own row
//! groups; a job SIGKILLed at a random batch and resumed ends bit-identical to one that never
//! stopped, having read exactly the rows it had left; resumed on another number of processes,
//! it reads what the saved job left, once. The same corpus read as a stream (row groups or
//! whole files as shards, unequal shares padded): every row once per epoch, a killed job
//! resumes bit-identically, and another number of processes continues what was left, once.

mod common;
#[path = "../../tests-support/tools.rs"]
mod tools;

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;
use std::process::Output;

use accelerate_burn::burn;
use accelerate_burn::stream::{DatasetShards, StreamLoader};
use accelerate_burn::{AccelerateError, Accelerator, Checkpoint, DataLoader, DefaultBackend};
use accelerate_data::{ArrowRow, ParquetDataset};
use accelerate_examples::MlpConfig;
use burn::data::dataloader::batcher::Batcher;
use burn::optim::AdamWConfig;
use burn::tensor::{Device, Int, Tensor, TensorData};
use common::{env_number, lines, param_bits, print_params, run, run_child};

/// Rows of the corpus, in row groups of 50 over two files (7 and 5 groups).
const ROWS: usize = 600;
const ROWS_PER_GROUP: usize = 50;
const FEATURES: usize = 8;
const CLASSES: usize = 5;
const EPOCHS: u64 = 2;

/// The corpus, written by pyarrow: `id`, `features` (8 floats), `label`.
const WRITE_CORPUS: &str = r#"
import sys
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

out = sys.argv[1]
ids = np.arange(600)
rng = np.random.default_rng(0)
table = pa.table({
    "id": ids,
    "features": list(rng.standard_normal((600, 8)).astype(np.float32)),
    "label": ids % 5,
})
pq.write_table(table.slice(0, 350), f"{out}/train-00000-of-00002.parquet", row_group_size=50)
pq.write_table(table.slice(350), f"{out}/train-00001-of-00002.parquet", row_group_size=50)
"#;

/// The corpus in a temporary folder, or `None` without pyarrow (skipped).
fn corpus() -> Option<tempfile::TempDir> {
    let python = tools::python_with("pyarrow")?;
    let dir = tempfile::tempdir().unwrap();
    tools::output_of(
        std::process::Command::new(python)
            .args(["-c", WRITE_CORPUS])
            .arg(dir.path()),
        "writing the corpus with pyarrow",
    );
    Some(dir)
}

/// A batch: features, labels and the rows' ids.
#[derive(Clone, Debug)]
struct RowBatch {
    features: Tensor<2>,
    labels: Tensor<1, Int>,
    ids: Vec<i64>,
}

#[derive(Clone, Copy)]
struct RowBatcher;

impl Batcher<ArrowRow, RowBatch> for RowBatcher {
    fn batch(&self, rows: Vec<ArrowRow>, device: &Device) -> RowBatch {
        let n = rows.len();
        let mut features = Vec::with_capacity(n * FEATURES);
        let (mut labels, mut ids) = (Vec::with_capacity(n), Vec::with_capacity(n));
        for row in &rows {
            features.extend(row.floats("features").unwrap());
            labels.push(row.int("label").unwrap());
            ids.push(row.int("id").unwrap());
        }
        RowBatch {
            features: Tensor::from_data(TensorData::new(features, [n, FEATURES]), device),
            labels: Tensor::from_data(TensorData::new(labels, [n]), device),
            ids,
        }
    }
}

fn env(key: &str) -> String {
    std::env::var(key).unwrap_or_default()
}

/// One rank of a job training an MLP on the corpus: prints the real rows of every batch
/// (`IDS <epoch> ...`), checkpoints after every update, stops after update `TEST_STOP`,
/// SIGKILLs itself on reaching batch `TEST_KILL_AT` (every rank: the whole job dies), and
/// resumes from the latest checkpoint with `TEST_RESUME=1`.
fn train() -> anyhow::Result<()> {
    let acc = Accelerator::<DefaultBackend>::builder()
        .seed(5)
        .project_dir(env("TEST_DIR"))
        .checkpoint_total_limit(2)
        .resume_with_different_world_size(env("TEST_ANY_WORLD") == "1")
        .build()?;
    let corpus = ParquetDataset::open_prefixed(env("TEST_DATA"), "train")?;
    let model = MlpConfig::new(FEATURES, vec![16], CLASSES).init(&acc.device());
    let (model, optim) = acc.prepare((model, AdamWConfig::new().init()))?;
    let pieces = corpus.pieces();
    match env("TEST_SHARDS").as_str() {
        // A stream: the row groups as shards, or the two files (350 and 250 rows).
        shards @ ("row_groups" | "files") => {
            let shards = match shards {
                "files" => vec![350, 250],
                _ => pieces,
            };
            let loader = StreamLoader::builder(RowBatcher)
                .batch_size(8)
                .shuffle(9)
                .shuffle_buffer(64)
                .even_batches(env("TEST_EVEN") != "0")
                .build(DatasetShards::new(corpus, &shards).map_err(|e| anyhow::anyhow!(e))?);
            let train = acc.prepare(loader)?;
            let epochs = (|| train.epoch(), |e| train.set_epoch(e));
            run_epochs(&acc, (model, optim), epochs, || -> Batches<'_> {
                Box::new(train.iter())
            })
        }
        _ => {
            let loader = DataLoader::builder(RowBatcher)
                .batch_size(8)
                .shuffle(9)
                .pieces(pieces, 64)
                .build(corpus);
            let train = acc.prepare_data_loader(loader)?;
            let epochs = (|| train.epoch(), |e| train.set_epoch(e));
            run_epochs(&acc, (model, optim), epochs, || -> Batches<'_> {
                Box::new(train.iter())
            })
        }
    }
}

type Batches<'a> = Box<dyn Iterator<Item = Result<RowBatch, AccelerateError>> + 'a>;

/// The training loop of [`train`], over a map-style or a stream loader (`epochs`: its epoch
/// and set_epoch).
fn run_epochs<'a>(
    acc: &Accelerator<DefaultBackend>,
    (mut model, mut optim): (accelerate_examples::Mlp, accelerate_burn::PreparedOptimizer),
    epochs: (impl Fn() -> u64, impl Fn(u64)),
    batches: impl Fn() -> Batches<'a>,
) -> anyhow::Result<()> {
    if env("TEST_RESUME") == "1" {
        let restored = acc.load_latest_checkpoint(model, &mut optim, None)?;
        model = restored.model;
        println!("RESUMED {}", restored.info.updates);
    }
    let (stop, kill_at) = (
        env_number::<u64>("TEST_STOP"),
        env_number::<u64>("TEST_KILL_AT"),
    );
    let mut seen = 0u64;
    for epoch in epochs.0()..EPOCHS {
        epochs.1(epoch);
        for batch in batches() {
            let batch = batch?;
            seen += 1;
            if seen == kill_at {
                // Mid-step, after the batch was read: as a node failure or a preemption.
                nix::sys::signal::raise(nix::sys::signal::Signal::SIGKILL)?;
            }
            let real = acc.rows_for_metrics(batch.ids.len());
            let ids: Vec<String> = batch.ids[..real].iter().map(i64::to_string).collect();
            println!("IDS {epoch} {}", ids.join(","));
            let gathered = acc.gather_for_metrics(batch.labels.clone())?;
            println!("GATHERED {epoch} {}", gathered.dims()[0]);
            let loss = model.forward_loss(batch.features, batch.labels).loss;
            let grads = acc.backward(loss, &model)?;
            model = optim.step(1e-2, model, grads)?;
            acc.save_checkpoint(&Checkpoint::new(&model, &optim))?;
            if optim.updates() == stop {
                return Ok(());
            }
        }
    }
    print_params(&model);
    Ok(())
}

#[test]
fn child() {
    run_child(|scenario| match scenario {
        "parquet" => train(),
        other => anyhow::bail!("unknown scenario {other}"),
    });
}

fn assert_ok(outputs: &[Output], what: &str) {
    for (rank, output) in outputs.iter().enumerate() {
        assert!(
            output.status.success(),
            "{what}, rank {rank}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
    }
}

/// Every rank's rows per epoch, in the order each read them.
fn rows_read(outputs: &[Output]) -> BTreeMap<u64, Vec<Vec<usize>>> {
    let mut epochs: BTreeMap<u64, Vec<Vec<usize>>> = BTreeMap::new();
    for (rank, output) in outputs.iter().enumerate() {
        for line in lines(output, "IDS ") {
            let (epoch, ids) = line.split_once(' ').unwrap_or((line.as_str(), ""));
            let ranks = epochs.entry(epoch.parse().unwrap()).or_default();
            ranks.resize(outputs.len(), Vec::new());
            ranks[rank].extend(
                ids.split(',')
                    .filter(|s| !s.is_empty())
                    .map(|s| s.parse::<usize>().unwrap()),
            );
        }
    }
    epochs
}

/// Rows `gather_for_metrics` returned to each rank per epoch (padding dropped): every rank
/// must count the corpus once per epoch.
fn assert_gathered_once_per_epoch(outputs: &[Output], what: &str) {
    for (rank, output) in outputs.iter().enumerate() {
        let mut per_epoch: BTreeMap<u64, usize> = BTreeMap::new();
        for line in lines(output, "GATHERED ") {
            let (epoch, rows) = line.split_once(' ').unwrap();
            *per_epoch.entry(epoch.parse().unwrap()).or_default() += rows.parse::<usize>().unwrap();
        }
        for (epoch, rows) in per_epoch {
            assert_eq!(rows, ROWS, "{what}: rank {rank}, epoch {epoch}");
        }
    }
}

fn sorted(mut ids: Vec<usize>) -> Vec<usize> {
    ids.sort_unstable();
    ids
}

#[test]
fn every_row_is_read_once_per_epoch_by_one_two_and_three_processes() {
    let Some(data) = corpus() else { return };
    for world in 1..=3 {
        let dir = tempfile::tempdir().unwrap();
        let outputs = job(data.path(), dir.path(), (world, "pieces"), &[]);
        assert_ok(&outputs, &format!("{world} processes"));
        assert_gathered_once_per_epoch(&outputs, &format!("{world} processes"));
        let epochs = rows_read(&outputs);
        assert_eq!(epochs.len(), EPOCHS as usize);
        for (epoch, ranks) in &epochs {
            let all = sorted(ranks.concat());
            assert_eq!(
                all,
                (0..ROWS).collect::<Vec<_>>(),
                "{world} processes, epoch {epoch}"
            );
            if world > 1 {
                // Each process reads its own row groups (its share, the ones it shares with a
                // neighbour, the last round's), not all 12.
                for (rank, ids) in ranks.iter().enumerate() {
                    let groups: BTreeSet<usize> =
                        ids.iter().map(|id| id / ROWS_PER_GROUP).collect();
                    assert!(
                        groups.len() < ROWS / ROWS_PER_GROUP,
                        "{world} processes, rank {rank} read row groups {groups:?}"
                    );
                }
            }
        }
    }
}

/// A job reading the corpus with `shards`: "pieces" (the map-style loader, row groups as
/// pieces), or as a stream with "row_groups" (12 shards) or "files" (2, of 350 and 250 rows).
fn job(
    data: &Path,
    dir: &Path,
    (world, shards): (usize, &str),
    extra: &[(&str, &str)],
) -> Vec<Output> {
    let mut vars = vec![
        ("TEST_DATA", data.display().to_string()),
        ("TEST_DIR", dir.display().to_string()),
        ("TEST_SHARDS", shards.to_string()),
    ];
    vars.extend(extra.iter().map(|(k, v)| (*k, v.to_string())));
    run("parquet", world, &vars)
}

#[test]
fn a_stream_reads_every_row_once_per_epoch_on_one_two_and_three_processes() {
    let Some(data) = corpus() else { return };
    for (world, shards) in [
        (1, "row_groups"),
        (2, "row_groups"),
        (3, "row_groups"),
        (2, "files"),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let outputs = job(data.path(), dir.path(), (world, shards), &[]);
        let what = format!("{world} processes, {shards} as shards");
        assert_ok(&outputs, &what);
        assert_gathered_once_per_epoch(&outputs, &what);
        let epochs = rows_read(&outputs);
        assert_eq!(epochs.len(), EPOCHS as usize, "{what}");
        for (epoch, ranks) in &epochs {
            let all = sorted(ranks.concat());
            assert_eq!(all, (0..ROWS).collect::<Vec<_>>(), "{what}, epoch {epoch}");
            // Each process reads whole shards of its own.
            if shards == "files" {
                for (rank, ids) in ranks.iter().enumerate() {
                    let files: BTreeSet<bool> = ids.iter().map(|&id| id < 350).collect();
                    assert_eq!(files.len(), 1, "{what}: rank {rank} read both files");
                }
            }
        }
        // Even batches: every process took as many steps, the longest share's (44 batches
        // of 8 for the file of 350 rows), the shorter share padded and the padding not
        // counted as rows.
        let steps: Vec<usize> = outputs.iter().map(|o| lines(o, "IDS ").len()).collect();
        assert!(
            steps.iter().all(|&n| n == steps[0]),
            "{what}: steps {steps:?}"
        );
        if shards == "files" {
            assert_eq!(steps[0], 44 * EPOCHS as usize, "{what}");
        }
    }
}

/// Without even batches the epoch ends when the first process runs out: the file of 250 rows
/// makes 32 batches (the last of 2 rows), so both processes take 32 steps, the other reading
/// 256 of its 350 rows, none twice.
#[test]
fn a_stream_without_even_batches_ends_when_the_first_process_runs_out() {
    let Some(data) = corpus() else { return };
    let dir = tempfile::tempdir().unwrap();
    let outputs = job(data.path(), dir.path(), (2, "files"), &[("TEST_EVEN", "0")]);
    assert_ok(&outputs, "uneven batches");
    for (epoch, ranks) in rows_read(&outputs) {
        let mut lens: Vec<usize> = ranks.iter().map(Vec::len).collect();
        lens.sort_unstable();
        assert_eq!(lens, [250, 256], "epoch {epoch}");
        let all = ranks.concat();
        let once: BTreeSet<usize> = all.iter().copied().collect();
        assert_eq!(once.len(), all.len(), "epoch {epoch}: a row read twice");
    }
    for output in &outputs {
        assert_eq!(lines(output, "IDS ").len(), 64);
    }
}

#[test]
fn a_stream_with_fewer_shards_than_processes_is_refused_on_every_rank() {
    let Some(data) = corpus() else { return };
    let dir = tempfile::tempdir().unwrap();
    let outputs = job(data.path(), dir.path(), (3, "files"), &[]);
    for (rank, output) in outputs.iter().enumerate() {
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success() && stderr.contains("2 shard(s) for 3 processes"),
            "rank {rank}: {stderr}"
        );
    }
}

/// A 2-process job over `layout` SIGKILLed at a random batch of its `batches` (both epochs),
/// then resumed: the parameters bit-identical to the uninterrupted job's, and the rows read
/// after the resume exactly the uninterrupted job's tail.
fn killed_and_resumed(layout: &str, batches: u64) {
    let Some(data) = corpus() else { return };
    let tmp = tempfile::tempdir().unwrap();
    let whole = job(data.path(), &tmp.path().join("whole"), (2, layout), &[]);
    assert_ok(&whole, "the uninterrupted job");
    // Anywhere in the two epochs but the first batch.
    let nanos = std::time::SystemTime::now()
        .duration_since(std::time::UNIX_EPOCH)
        .unwrap()
        .subsec_nanos() as u64;
    let kill_at = 2 + nanos % (batches - 2);
    eprintln!("{layout}: killing the job at batch {kill_at}");
    let dir = tmp.path().join("killed");
    let kill = [("TEST_KILL_AT", kill_at.to_string())];
    let kill: Vec<(&str, &str)> = kill.iter().map(|(k, v)| (*k, v.as_str())).collect();
    let killed = job(data.path(), &dir, (2, layout), &kill);
    assert!(
        killed.iter().all(|o| !o.status.success()),
        "the job was not killed"
    );
    let resumed = job(data.path(), &dir, (2, layout), &[("TEST_RESUME", "1")]);
    assert_ok(
        &resumed,
        &format!("{layout}: resumed after a kill at batch {kill_at}"),
    );
    for rank in 0..2 {
        assert!(
            param_bits(&resumed[rank]) == param_bits(&whole[rank]),
            "{layout}, rank {rank}: the parameters differ after a kill at batch {kill_at}"
        );
        // What the resumed job read is the tail of what the uninterrupted one read.
        let whole_rows: Vec<String> = lines(&whole[rank], "IDS ");
        let resumed_rows: Vec<String> = lines(&resumed[rank], "IDS ");
        assert_eq!(
            resumed_rows[..],
            whole_rows[whole_rows.len() - resumed_rows.len()..],
            "{layout}, rank {rank}, kill at batch {kill_at}"
        );
        // And before the kill it had read the head, so nothing was lost or read twice.
        let updates: usize = common::line(&resumed[rank], "RESUMED ").parse().unwrap();
        assert_eq!(
            updates + resumed_rows.len(),
            whole_rows.len(),
            "{layout}, rank {rank}"
        );
    }
}

/// A 2-process job over `layout` stopped after 13 updates and resumed on 1 and on 3
/// processes: the first epoch's rows read once over both jobs, the next epoch whole.
fn resumed_on_other_worlds(layout: &str) {
    let Some(data) = corpus() else { return };
    for world in [1, 3] {
        let tmp = tempfile::tempdir().unwrap();
        let stopped = job(data.path(), tmp.path(), (2, layout), &[("TEST_STOP", "13")]);
        assert_ok(&stopped, "the stopped job");
        let any_world = [("TEST_RESUME", "1"), ("TEST_ANY_WORLD", "1")];
        let resumed = job(data.path(), tmp.path(), (world, layout), &any_world);
        assert_ok(&resumed, &format!("{layout}: resumed on {world}"));
        let (before, after) = (rows_read(&stopped), rows_read(&resumed));
        let mut first_epoch = before[&0].concat();
        first_epoch.extend(after[&0].concat());
        assert_eq!(
            sorted(first_epoch),
            (0..ROWS).collect::<Vec<_>>(),
            "{layout}: 2 processes read 13 batches each, then {world}"
        );
        assert_eq!(sorted(after[&1].concat()), (0..ROWS).collect::<Vec<_>>());
    }
}

#[test]
fn a_job_killed_at_a_random_batch_resumes_bit_identically() {
    // 38 batches per epoch and rank.
    killed_and_resumed("pieces", 76);
}

#[test]
fn resumed_on_another_number_of_processes_it_reads_what_was_left_once() {
    resumed_on_other_worlds("pieces");
}

#[test]
fn a_stream_killed_at_a_random_batch_resumes_bit_identically() {
    // The files as shards: 44 batches per epoch and rank, the last 12 of one rank padding.
    killed_and_resumed("files", 88);
}

#[test]
fn a_stream_resumed_on_another_number_of_processes_reads_what_was_left_once() {
    resumed_on_other_worlds("row_groups");
}
