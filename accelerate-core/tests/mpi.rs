//! The MPI engine under a real `mpirun` (Open MPI), 2 to 4 ranks on this host: every
//! collective against the serial reference, with no variable set by hand (`auto` picks MPI);
//! ranks that make different calls told which; a killed, a frozen (SIGSTOP) and a late rank
//! each end the whole job with an error naming it, and nothing of the job is left running.
//! Built only with the `mpi` feature:
//!
//! ```text
//! cargo test -p accelerate-core --features mpi --test mpi
//! ```
//!
//! The test binary is the program `mpirun` starts: its `child` test does nothing unless
//! [`SCENARIO`] names a scenario.

mod common;
#[path = "../../tests-support/netns.rs"]
mod netns;
#[path = "../../tests-support/slurm.rs"]
mod slurm_cluster;
#[path = "../../tests-support/tools.rs"]
mod tools;

use std::process::{Output, Stdio};
use std::time::{Duration, Instant};

use accelerate_core::ProcessState;
use accelerate_core::comm::{GroupOptions, ProcessGroup, Reduction};
use half::{bf16, f16};

const SCENARIO: &str = "ACCELERATE_TEST_CHILD";
/// Marks every process of one job, to find leftovers.
const JOB: &str = "ACCELERATE_TEST_JOB";

#[test]
fn child() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let state = ProcessState::from_env().unwrap();
    let options = GroupOptions::from_env().unwrap();
    let result = (|| -> Result<(), accelerate_core::CommError> {
        let mut group = ProcessGroup::new(&state, &options)?;
        println!("FORMED {} rank {}", group.transport(), group.rank());
        let rank = group.rank();
        match scenario.as_str() {
            "suite" => {
                // Small all-reduces travel with their agreement block, large ones after it.
                common::check_all::<f32>(&mut group, &[0, 1, 13, 1021, 4099, 16_385, 100_003]);
                common::check_all::<f16>(&mut group, &[0, 1, 13, 1021, 40_001]);
                common::check_all::<bf16>(&mut group, &[0, 1, 13, 1021, 40_001]);
                common::check_shared::<f32>(&mut group, &[0, 13, 100_003]);
                println!("SUITE PASSED");
            }
            "mismatch_size" => {
                let mut buf = vec![1.0_f32; 10 + usize::from(rank == odd_rank())];
                group.all_reduce(&mut buf, Reduction::Sum)?;
            }
            "mismatch_op" => {
                // Same size and type: MPI completes it; the watchdogs (or the group's end)
                // find it on the board.
                let mut buf = vec![1.0_f32; 10];
                let op = if rank == odd_rank() {
                    Reduction::Max
                } else {
                    Reduction::Sum
                };
                group.all_reduce(&mut buf, op)?;
                drop(group);
                return Ok(());
            }
            "mismatch_kind" => {
                let mut buf = vec![1.0_f32; 10];
                if rank == odd_rank() {
                    group.broadcast(&mut buf, 0)?;
                } else {
                    group.all_reduce(&mut buf, Reduction::Sum)?;
                }
            }
            "killed" | "frozen" | "late" => {
                let mut buf = vec![1.0_f32; 1 << 16];
                for step in 0..1000 {
                    if rank == 1 && step == 5 {
                        println!("RANK 1 GOES {scenario}");
                        match scenario.as_str() {
                            "killed" => signal(nix::sys::signal::Signal::SIGKILL),
                            "frozen" => signal(nix::sys::signal::Signal::SIGSTOP),
                            _ => std::thread::sleep(Duration::from_secs(60)),
                        }
                    }
                    group.all_reduce(&mut buf, Reduction::Mean)?;
                }
            }
            other => panic!("unknown scenario {other}"),
        }
        group.barrier()
    })();
    match result {
        Ok(()) => std::process::exit(0),
        Err(e) => {
            eprintln!("ERROR {e}");
            std::process::exit(3);
        }
    }
}

/// The rank that makes another call in the mismatch scenarios (`TEST_ODD_RANK`, default 1).
fn odd_rank() -> usize {
    std::env::var("TEST_ODD_RANK")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1)
}

fn signal(signal: nix::sys::signal::Signal) {
    nix::sys::signal::raise(signal).unwrap();
}

/// Runs `scenario` under `mpirun -np np` with `env` (at most `limit`): its output, how long
/// it took, and whether any process of it is still running afterwards.
fn mpirun(
    np: usize,
    scenario: &str,
    env: &[(&str, &str)],
    limit: Duration,
) -> Option<(Output, Duration)> {
    let mut mpirun = tools::mpirun(np)?;
    let job = format!("{scenario}-{}", std::process::id());
    mpirun
        .arg(std::env::current_exe().unwrap())
        .args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, scenario)
        .env(JOB, &job)
        .env_remove("ACCELERATE_TRANSPORT")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in env {
        mpirun.env(k, v);
    }
    let started = Instant::now();
    let mut child = mpirun.spawn().unwrap();
    while child.try_wait().unwrap().is_none() {
        if started.elapsed() > limit {
            let _ = child.kill();
            panic!("mpirun ({scenario}) did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
    let took = started.elapsed();
    let output = child.wait_with_output().unwrap();
    let left = leftovers(&job);
    assert!(left.is_empty(), "processes of the job still run: {left:?}");
    Some((output, took))
}

/// Processes whose environment carries `JOB=job`.
fn leftovers(job: &str) -> Vec<u32> {
    let marker = format!("{JOB}={job}");
    // Give the launcher's last SIGKILLs a moment to land.
    std::thread::sleep(Duration::from_millis(300));
    std::fs::read_dir("/proc")
        .unwrap()
        .filter_map(|e| e.ok()?.file_name().to_str()?.parse::<u32>().ok())
        .filter(|pid| {
            std::fs::read(format!("/proc/{pid}/environ"))
                .is_ok_and(|env| env.split(|&b| b == 0).any(|v| v == marker.as_bytes()))
        })
        .collect()
}

fn text(output: &Output) -> String {
    format!(
        "{}\n{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

/// Every collective (all_reduce sum/mean/max/min, broadcast, all_gather, reduce_scatter,
/// barrier, the object collectives, shared buffers) on f32, f16 and bf16, small and large,
/// equals the serial reference on 2, 3 and 4 ranks; `auto` picked MPI under mpirun.
#[test]
fn every_collective_matches_the_serial_reference_on_2_3_and_4_ranks() {
    for np in [2, 3, 4] {
        let Some((output, _)) = mpirun(np, "suite", &[], Duration::from_secs(120)) else {
            return;
        };
        let all = text(&output);
        assert!(output.status.success(), "{np} ranks:\n{all}");
        assert_eq!(all.matches("FORMED mpi").count(), np, "{all}");
        assert_eq!(all.matches("SUITE PASSED").count(), np, "{all}");
    }
}

/// A rank that all-reduces 11 elements while the others reduce 10, that broadcasts while they
/// all-reduce, or that takes the maximum while they sum (a call MPI completes): the job fails,
/// and the error names the other rank and both calls.
#[test]
fn ranks_that_make_different_calls_are_told_which_and_what() {
    let cases = [
        (
            "mismatch_size",
            "called all_reduce #0 (10 x f32, sum)",
            "called all_reduce #0 (11 x f32, sum)",
        ),
        (
            "mismatch_kind",
            "called all_reduce #0 (10 x f32, sum)",
            "called broadcast #0 (10 x f32, root 0)",
        ),
        (
            "mismatch_op",
            "called all_reduce #0 (10 x f32, sum)",
            "called all_reduce #0 (10 x f32, max)",
        ),
    ];
    for (scenario, others, rank_1) in cases {
        let Some((output, _)) = mpirun(2, scenario, &[], Duration::from_secs(60)) else {
            return;
        };
        let all = text(&output);
        assert!(!output.status.success(), "{all}");
        let from_0 = format!("mismatch on rank 0: this rank {others}, rank 1 {rank_1}");
        let from_1 = format!("mismatch on rank 1: this rank {rank_1}, rank 0 {others}");
        assert!(
            all.contains(&from_0) || all.contains(&from_1),
            "{scenario}: neither\n  {from_0}\nnor\n  {from_1}\nin:\n{all}"
        );
    }
}

/// A rank killed mid-job (SIGKILL): mpirun ends every other rank and says which one died.
#[test]
fn a_killed_rank_ends_the_job_naming_it() {
    let Some((output, took)) = mpirun(3, "killed", &[], Duration::from_secs(60)) else {
        return;
    };
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    assert!(all.contains("RANK 1 GOES killed"), "{all}");
    assert!(
        all.contains("rank 1"),
        "the report does not name rank 1:\n{all}"
    );
    eprintln!("killed rank: the job ended after {took:?}");
}

/// A rank stopped mid-job (SIGSTOP: alive, silent): the others' watchdogs see its heartbeat
/// stop, end the job with MPI_Abort within the heartbeat timeout, and name it.
#[test]
fn a_frozen_rank_ends_the_job_within_the_heartbeat_timeout_naming_it() {
    let env = [
        ("ACCELERATE_HEARTBEAT_TIMEOUT", "2"),
        ("ACCELERATE_TIMEOUT", "120"),
    ];
    let Some((output, took)) = mpirun(3, "frozen", &env, Duration::from_secs(60)) else {
        return;
    };
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    assert!(all.contains("RANK 1 GOES frozen"), "{all}");
    assert!(
        all.contains("rank 1 is gone") && all.contains("no sign of life"),
        "no rank reported rank 1 silent:\n{all}"
    );
    assert!(all.contains("MPI_Abort"), "{all}");
    eprintln!("frozen rank: the job ended after {took:?}");
}

/// A rank that keeps computing (alive) past `ACCELERATE_TIMEOUT`: the others end the job at
/// the timeout, naming it as the rank that never arrived.
#[test]
fn a_rank_that_never_arrives_ends_the_job_at_the_timeout_naming_it() {
    let env = [("ACCELERATE_TIMEOUT", "3")];
    let Some((output, took)) = mpirun(2, "late", &env, Duration::from_secs(60)) else {
        return;
    };
    let all = text(&output);
    assert!(!output.status.success(), "{all}");
    assert!(
        all.contains("timed out on rank 0 of 2") && all.contains("rank 1 never arrived"),
        "{all}"
    );
    assert!(took < Duration::from_secs(30), "took {took:?}:\n{all}");
}

/// Two hosts (network namespaces) x 2 ranks under one `mpirun`: the progress board of a host
/// does not see the other, so calls are checked through MPI too. Every collective still
/// matches the reference, and a rank on host 1 that broadcasts while the others all-reduce is
/// named by the ranks of host 0 as well.
#[test]
fn across_two_hosts_calls_are_checked_through_mpi() {
    let Some(hosts) = netns::TwoHosts::new("mpi-core") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    for (scenario, succeeds) in [("suite", true), ("mismatch_kind", false)] {
        let mut mpirun = hosts.mpirun(2, dir.path()).expect("mpirun");
        let output = mpirun
            .arg(std::env::current_exe().unwrap())
            .args(["child", "--exact", "--nocapture", "--test-threads=1"])
            .env(SCENARIO, scenario)
            .env("TEST_ODD_RANK", "3")
            .env_remove("ACCELERATE_TRANSPORT")
            .output()
            .unwrap();
        let all = text(&output);
        assert_eq!(output.status.success(), succeeds, "{scenario}:\n{all}");
        if succeeds {
            assert_eq!(all.matches("SUITE PASSED").count(), 4, "{all}");
        } else {
            let named_from_host_0 = (0..2).any(|r| {
                all.contains(&format!(
                    "mismatch on rank {r}: this rank called all_reduce #0 (10 x f32, sum), \
                     rank 3 called broadcast #0 (10 x f32, root 0)"
                ))
            });
            assert!(named_from_host_0, "{all}");
        }
    }
    for machine in 0..2 {
        assert_eq!(hosts.leftovers(machine), "", "host {machine}");
    }
}

/// Slurm's own launcher with PMIx (`srun --mpi=pmix -n 2`, Debian's `mpi_pmix` plugin): MPI
/// starts from Slurm's PMIx server without mpirun, `auto` picks the MPI engine, and every
/// collective matches the reference.
#[test]
fn srun_with_pmix_starts_the_mpi_engine() {
    if !tools::slurm_ready() {
        return;
    }
    let cluster = slurm_cluster::SlurmCluster::start(2, &[]);
    let output = cluster
        .run(&["srun", "--mpi=pmix", "-n", "2", "--time", "5"])
        .arg(std::env::current_exe().unwrap())
        .args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, "suite")
        .env_remove("ACCELERATE_TRANSPORT")
        .output()
        .unwrap();
    let all = text(&output);
    assert!(output.status.success(), "{all}");
    assert_eq!(all.matches("FORMED mpi").count(), 2, "{all}");
    assert_eq!(all.matches("SUITE PASSED").count(), 2, "{all}");
}
