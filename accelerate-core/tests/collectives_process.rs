//! Collectives between real processes on 127.0.0.1, over shared memory and over TCP: the test
//! binary starts copies of itself as ranks (the `child` test below, which does nothing unless
//! `ACCELERATE_TEST_CHILD` names a scenario).

mod common;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accelerate_core::ProcessState;
use accelerate_core::comm::transport::shm::segment_path;
use accelerate_core::comm::{GroupOptions, ProcessGroup, Reduction};
use half::{bf16, f16};

const SCENARIO: &str = "ACCELERATE_TEST_CHILD";

/// The body of a rank; exits the process with 0 on success, 3 on a collective error.
#[test]
fn child() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    let state = ProcessState::from_env().unwrap();
    let options = GroupOptions::from_env().unwrap();
    let result = (|| -> Result<(), accelerate_core::CommError> {
        let mut group = ProcessGroup::new(&state, &options)?;
        println!("FORMED {}", group.transport());
        match scenario.as_str() {
            "all" => {
                common::check_all::<f32>(&mut group, &common::LENS);
                common::check_all::<f16>(&mut group, &[0, 1, 13, 1021]);
                common::check_all::<bf16>(&mut group, &[0, 1, 13, 1021]);
                // Several shared-memory segments and ring windows.
                let len = 5_000_003;
                let mut big = common::input::<f32>(group.rank(), len);
                group.all_reduce(&mut big, Reduction::Sum)?;
                assert_eq!(
                    big,
                    common::reduced::<f32>(group.world_size(), len, Reduction::Sum)
                );
                let shared = common::check_shared::<f32>(&mut group, &[0, 1, 13, 1021, 100_003]);
                common::check_shared::<bf16>(&mut group, &[7, 4099]);
                println!("SHARED {shared}");
            }
            "mismatch" => {
                let mut buf = vec![1.0_f32; 100 + group.rank()];
                group.all_reduce(&mut buf, Reduction::Sum)?;
            }
            "victim" => {
                // The last rank stops calling and waits to be killed; the others keep going.
                if group.rank() == group.world_size() - 1 {
                    println!("WAITING");
                    std::thread::sleep(Duration::from_secs(60));
                    return Ok(());
                }
                let mut buf = vec![1.0_f32; 1 << 20];
                loop {
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

fn free_port() -> u16 {
    TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port()
}

struct Job {
    children: Vec<Child>,
    token: String,
    port: u16,
}

/// Starts rank `rank` of a `world`-rank job at `port` with `token`, running `scenario`.
fn spawn_rank(
    scenario: &str,
    transport: &str,
    (rank, world): (usize, usize),
    (port, token): (u16, &str),
    extra: &[(&str, &str)],
) -> Child {
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, scenario)
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", world.to_string())
        .env("LOCAL_RANK", rank.to_string())
        .env("LOCAL_WORLD_SIZE", world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ACCELERATE_TRANSPORT", transport)
        .env("ACCELERATE_JOB_TOKEN", token)
        .env("ACCELERATE_TIMEOUT", "60")
        .env("ACCELERATE_RENDEZVOUS_TIMEOUT", "30")
        .env("ACCELERATE_SHM_SLOT_BYTES", "65536")
        .env("ACCELERATE_RING_SEGMENT_BYTES", "65536")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in extra {
        cmd.env(k, v);
    }
    cmd.spawn().unwrap()
}

/// Starts ranks `ranks` of a `world`-rank job running `scenario`.
fn start(
    scenario: &str,
    transport: &str,
    world: usize,
    ranks: &[usize],
    extra: &[(&str, &str)],
) -> Job {
    let port = free_port();
    let token = format!("test-{}-{port}", std::process::id());
    let children = ranks
        .iter()
        .map(|&rank| spawn_rank(scenario, transport, (rank, world), (port, &token), extra))
        .collect();
    Job {
        children,
        token,
        port,
    }
}

impl Job {
    fn segment(&self) -> std::path::PathBuf {
        segment_path(&self.token, &format!("127.0.0.1:{}", self.port))
    }

    /// Waits for every rank (at most `limit`), returning (exit code, stdout, stderr) per rank.
    fn finish(mut self, limit: Duration) -> Vec<(i32, String, String)> {
        let deadline = Instant::now() + limit;
        let mut out = Vec::new();
        for child in &mut self.children {
            loop {
                if let Some(status) = child.try_wait().unwrap() {
                    let mut stdout = String::new();
                    let mut stderr = String::new();
                    use std::io::Read;
                    child
                        .stdout
                        .take()
                        .unwrap()
                        .read_to_string(&mut stdout)
                        .unwrap();
                    child
                        .stderr
                        .take()
                        .unwrap()
                        .read_to_string(&mut stderr)
                        .unwrap();
                    out.push((status.code().unwrap_or(-1), stdout, stderr));
                    break;
                }
                if Instant::now() > deadline {
                    for c in &mut self.children {
                        let _ = c.kill();
                    }
                    panic!("the job did not finish within {limit:?}");
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
        out
    }
}

impl Drop for Job {
    fn drop(&mut self) {
        for c in &mut self.children {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

fn assert_all_ok(results: &[(i32, String, String)], transport: &str) {
    for (rank, (code, stdout, stderr)) in results.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {stdout}\n{stderr}");
        assert!(
            stdout.contains(&format!("FORMED {transport}")),
            "rank {rank}: {stdout}"
        );
        // Shared buffers live in shared memory exactly when the group does.
        let shared = format!("SHARED {}", transport == "shm");
        assert!(stdout.contains(&shared), "rank {rank}: {stdout}");
    }
}

/// Files in /dev/shm whose names start with the job's segment name (its shared buffers too).
fn leftovers(segment: &std::path::Path) -> Vec<std::path::PathBuf> {
    let prefix = segment.file_name().unwrap().to_string_lossy().into_owned();
    std::fs::read_dir("/dev/shm")
        .map(|dir| {
            dir.flatten()
                .map(|e| e.path())
                .filter(|p| {
                    p.file_name()
                        .is_some_and(|n| n.to_string_lossy().starts_with(&prefix))
                })
                .collect()
        })
        .unwrap_or_default()
}

#[test]
fn collectives_match_the_reference_over_shared_memory() {
    for world in 2..=4 {
        let job = start("all", "shm", world, &(0..world).collect::<Vec<_>>(), &[]);
        let segment = job.segment();
        let results = job.finish(Duration::from_secs(120));
        assert_all_ok(&results, "shm");
        assert_eq!(leftovers(&segment), Vec::<std::path::PathBuf>::new());
    }
}

#[test]
fn collectives_match_the_reference_over_tcp() {
    for world in 2..=4 {
        let job = start("all", "tcp", world, &(0..world).collect::<Vec<_>>(), &[]);
        assert_all_ok(&job.finish(Duration::from_secs(120)), "tcp");
    }
}

#[test]
fn a_wrong_job_token_is_refused() {
    let timeout = [("ACCELERATE_RENDEZVOUS_TIMEOUT", "3")];
    let job = start("all", "auto", 2, &[0], &timeout);
    // Rank 1 of the same job, with another token.
    let intruder = Job {
        children: vec![spawn_rank(
            "all",
            "auto",
            (1, 2),
            (job.port, "not-the-token"),
            &timeout,
        )],
        token: "not-the-token".into(),
        port: job.port,
    };
    let theirs = intruder.finish(Duration::from_secs(30));
    let ours = job.finish(Duration::from_secs(30));
    assert_eq!(theirs[0].0, 3);
    assert!(
        theirs[0].2.contains("job token mismatch"),
        "{}",
        theirs[0].2
    );
    assert_eq!(ours[0].0, 3);
    assert!(ours[0].2.contains("ranks 1 never arrived"), "{}", ours[0].2);
    assert!(
        ours[0].2.contains("job token mismatch for rank 1"),
        "{}",
        ours[0].2
    );
}

#[test]
fn a_rank_that_never_arrives_is_listed() {
    let job = start(
        "all",
        "auto",
        3,
        &[0, 1],
        &[("ACCELERATE_RENDEZVOUS_TIMEOUT", "2")],
    );
    let results = job.finish(Duration::from_secs(30));
    for (code, _, stderr) in &results {
        assert_eq!(*code, 3, "{stderr}");
        assert!(stderr.contains("ranks 2 never arrived"), "{stderr}");
        assert!(
            stderr.contains("127.0.0.1:"),
            "the error names the address: {stderr}"
        );
    }
}

#[test]
fn mismatched_sizes_fail_on_both_ranks() {
    for transport in ["shm", "tcp"] {
        let results = start("mismatch", transport, 2, &[0, 1], &[]).finish(Duration::from_secs(60));
        for (rank, (code, _, stderr)) in results.iter().enumerate() {
            assert_eq!(*code, 3, "{transport} rank {rank}: {stderr}");
            assert!(
                stderr.contains("all_reduce #0 (100 x f32, sum)"),
                "{transport} rank {rank}: {stderr}"
            );
            assert!(
                stderr.contains("all_reduce #0 (101 x f32, sum)"),
                "{transport} rank {rank}: {stderr}"
            );
        }
    }
}

#[test]
fn a_killed_rank_fails_the_others_promptly_naming_it() {
    for transport in ["shm", "tcp"] {
        let mut job = start("victim", transport, 3, &[0, 1, 2], &[]);
        let segment = job.segment();
        // Wait until the victim has joined and stopped calling.
        let stdout = job.children[2].stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        let waiting = lines.any(|l| l.map(|l| l == "WAITING").unwrap_or(false));
        assert!(waiting, "{transport}: the victim never got ready");
        std::thread::sleep(Duration::from_millis(300));
        job.children[2].kill().unwrap();
        let killed = Instant::now();
        let _ = job.children[2].wait();
        let survivors: Vec<Child> = job.children.drain(..2).collect();
        let results = Job {
            children: survivors,
            token: job.token.clone(),
            port: job.port,
        }
        .finish(Duration::from_secs(30));
        let elapsed = killed.elapsed();
        assert!(
            elapsed < Duration::from_secs(10),
            "{transport}: survivors took {elapsed:?}"
        );
        for (rank, (code, _, stderr)) in results.iter().enumerate() {
            assert_eq!(*code, 3, "{transport} rank {rank}: {stderr}");
            assert!(
                stderr.contains("rank 2"),
                "{transport} rank {rank}: {stderr}"
            );
        }
        assert_eq!(leftovers(&segment), Vec::<std::path::PathBuf>::new());
    }
}

#[test]
fn ranks_started_by_slurm_form_a_group_without_our_launcher() {
    let port = free_port();
    let token = format!("slurm-{}-{port}", std::process::id());
    let children = (0..2)
        .map(|rank| {
            Command::new(std::env::current_exe().unwrap())
                .args(["child", "--exact", "--nocapture", "--test-threads=1"])
                .env(SCENARIO, "all")
                .env("SLURM_PROCID", rank.to_string())
                .env("SLURM_NTASKS", "2")
                .env("SLURM_LOCALID", rank.to_string())
                .env("SLURM_NODEID", "0")
                .env("SLURM_STEP_TASKS_PER_NODE", "2")
                .env("SLURM_JOB_NODELIST", "localhost")
                .env("MASTER_ADDR", "127.0.0.1")
                .env("MASTER_PORT", port.to_string())
                .env("ACCELERATE_JOB_TOKEN", &token)
                .env("ACCELERATE_SHM_SLOT_BYTES", "65536")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap()
        })
        .collect();
    let results = Job {
        children,
        token,
        port,
    }
    .finish(Duration::from_secs(120));
    assert_all_ok(&results, "shm");
}
