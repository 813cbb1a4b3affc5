//! Collectives between real processes on 127.0.0.1, over shared memory and over TCP: the test
//! binary starts copies of itself as ranks (the `child` test below, which does nothing unless
//! `ACCELERATE_TEST_CHILD` names a scenario).

mod common;
#[path = "../../tests-support/tools.rs"]
mod tools;

use std::io::{BufRead, BufReader};
use std::net::TcpListener;
use std::path::Path;
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accelerate_core::ProcessState;
use accelerate_core::comm::transport::shm::segment_path;
use accelerate_core::comm::{GroupOptions, ProcessGroup, Reduction};
use half::{bf16, f16};

const SCENARIO: &str = "ACCELERATE_TEST_CHILD";

/// `steps` checked all-reduces of 1000 values, rank 0 arriving `late` to each.
fn train_steps(
    group: &mut ProcessGroup,
    steps: usize,
    late: Duration,
) -> Result<(), accelerate_core::CommError> {
    for _ in 0..steps {
        if group.rank() == 0 {
            std::thread::sleep(late);
        }
        let mut grads = common::input::<f32>(group.rank(), 1000);
        group.all_reduce(&mut grads, Reduction::Sum)?;
        assert_eq!(
            grads,
            common::reduced::<f32>(group.world_size(), 1000, Reduction::Sum)
        );
    }
    Ok(())
}

/// The body of a rank; exits the process with 0 on success, 3 on a collective error.
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
            "split" => {
                // Hybrid sharding's groups of 4 ranks: pairs, and the pairs' counterparts, each
                // checked against the reference with the job's collectives in between.
                let mut shards = group.split(&[vec![0, 1], vec![2, 3]])?;
                let mut replicas = group.split(&[vec![0, 2], vec![1, 3]])?;
                for _ in 0..2 {
                    common::check_all::<f32>(&mut shards, &[0, 1, 13, 1021, 100_003]);
                    train_steps(&mut group, 1, Duration::ZERO)?;
                    common::check_all::<f32>(&mut replicas, &[0, 1, 13, 1021, 100_003]);
                    common::check_all::<bf16>(&mut shards, &[7, 4099]);
                }
                println!(
                    "SPLIT {} {} {} {}",
                    shards.rank(),
                    shards.transport(),
                    replicas.rank(),
                    replicas.transport()
                );
                println!("SHARED {}", group.transport() == "shm");
            }
            "split_disagree" => {
                // Ranks 2 and 3 disagree within their pair, then stay alive a while: ranks 0
                // and 1, waiting for them in a collective of the job, can learn why only from
                // what the pair's failure told the job's group.
                let mut pair = group.split(&[vec![0, 1], vec![2, 3]])?;
                if group.rank() >= 2 {
                    let mut buf = vec![1.0_f32; 10 + pair.rank()];
                    let failed = pair.all_reduce(&mut buf, Reduction::Sum);
                    std::thread::sleep(Duration::from_secs(2));
                    failed?;
                }
                let mut buf = vec![1.0_f32; 4];
                group.all_reduce(&mut buf, Reduction::Sum)?;
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
            "train" => {
                // What a training loop does: many same-sized all-reduces, checked.
                train_steps(&mut group, 20, Duration::ZERO)?;
                println!("TRAINED");
            }
            "late_broadcast" => {
                // Rank 1 "evaluates" for 20 s, far past the heartbeat, while rank 0 already
                // sends it 64 MiB: rank 1's socket fills and its kernel advertises a zero
                // window all that time, alive.
                if group.rank() == 1 {
                    std::thread::sleep(Duration::from_secs(20));
                }
                let len = 16 << 20;
                let mut values: Vec<f32> = if group.rank() == 0 {
                    (0..len).map(|i| (i % 1000) as f32).collect()
                } else {
                    vec![0.0; len]
                };
                group.broadcast(&mut values, 0)?;
                assert!(
                    values
                        .iter()
                        .enumerate()
                        .all(|(i, &v)| v == (i % 1000) as f32)
                );
                println!("TRAINED");
            }
            "late_train" => {
                // Rank 0 arrives 200 ms late to each of a few all-reduces: the others wait in
                // the barrier long enough for its liveness checks to run.
                train_steps(&mut group, 5, Duration::from_millis(200))?;
                println!("TRAINED");
            }
            "fail_first_attempt" => {
                // torchrun's first attempt loses rank 1 mid-job; the agent restarts everyone.
                let attempt = std::env::var("TORCHELASTIC_RESTART_COUNT").unwrap_or_default();
                if attempt == "0" && group.rank() == 1 {
                    println!("FAILING ON PURPOSE");
                    std::process::exit(7);
                }
                let mut grads = common::input::<f32>(group.rank(), 1000);
                group.all_reduce(&mut grads, Reduction::Sum)?;
                assert_eq!(
                    grads,
                    common::reduced::<f32>(group.world_size(), 1000, Reduction::Sum)
                );
                println!("TRAINED in attempt {attempt}");
            }
            "stall" => {
                // Rank 0 waits in a collective while the last rank "computes" for a long time.
                println!("READY");
                if group.rank() == group.world_size() - 1 {
                    std::thread::sleep(Duration::from_secs(120));
                }
            }
            "nccl" => {
                // The NCCL agreement: each rank loads libnccl as a worker would, rank 0's
                // communicator id reaches every rank, or every rank takes the host path.
                use accelerate_core::nccl::{self, NcclLibrary};
                let mode = accelerate_core::ConfigOverrides::default()
                    .resolve_with(&accelerate_core::state::ProcessEnv)
                    .unwrap()
                    .nccl;
                let library = NcclLibrary::find(&accelerate_core::state::ProcessEnv);
                if let Ok(library) = &library {
                    println!("LIBRARY {} {}", library.version(), library.path().display());
                }
                let local = library.as_ref().map_err(|e| e.to_string());
                match nccl::agree(&mut group, mode, local) {
                    Ok(Some(id)) => {
                        let hex: String = id.0.iter().map(|b| format!("{b:02x}")).collect();
                        println!("NCCL {hex}");
                    }
                    Ok(None) => println!("HOST"),
                    Err(e) => {
                        eprintln!("ERROR {e}");
                        std::process::exit(3);
                    }
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
        segment_path(self.token.as_bytes(), &format!("127.0.0.1:{}", self.port))
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
                    // A test may have taken a stream to watch it.
                    if let Some(mut out) = child.stdout.take() {
                        out.read_to_string(&mut stdout).unwrap();
                    }
                    if let Some(mut err) = child.stderr.take() {
                        err.read_to_string(&mut stderr).unwrap();
                    }
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

/// Groups split from a job of 4 (pairs, and the pairs' counterparts: hybrid sharding's
/// shard and replica groups) run every collective right, interleaved with the job's, over
/// shared memory (a segment of their own per pair, none left behind) and over TCP (the job's
/// connections).
#[test]
fn split_groups_match_the_reference_over_shared_memory_and_tcp() {
    for transport in ["shm", "tcp"] {
        let job = start("split", transport, 4, &[0, 1, 2, 3], &[]);
        let segment = job.segment();
        let results = job.finish(Duration::from_secs(120));
        assert_all_ok(&results, transport);
        for (rank, (_, stdout, _)) in results.iter().enumerate() {
            let expected = format!("SPLIT {} {transport} {} {transport}", rank % 2, rank / 2);
            assert!(stdout.contains(&expected), "rank {rank}: {stdout}");
        }
        assert_eq!(leftovers(&segment), Vec::<std::path::PathBuf>::new());
    }
}

/// A group split from the job that fails tells the job: ranks waiting for its ranks in a
/// collective of the whole job (over shared memory) fail with its error, whole with its hint,
/// naming the calls the pair disagreed on, not with "rank 2 is gone" once its process exits.
#[test]
fn a_split_groups_failure_is_told_to_the_ranks_waiting_in_the_job() {
    let results = start(
        "split_disagree",
        "shm",
        4,
        &[0, 1, 2, 3],
        &[("ACCELERATE_TIMEOUT", "20")],
    )
    .finish(Duration::from_secs(60));
    for (rank, (code, _, stderr)) in results.iter().enumerate() {
        assert_eq!(*code, 3, "rank {rank}: {stderr}");
        assert!(
            stderr.contains("all_reduce #0 (10 x f32, sum)")
                && stderr.contains("all_reduce #0 (11 x f32, sum)"),
            "rank {rank}: {stderr}"
        );
    }
    for (rank, (_, _, stderr)) in results.iter().enumerate().take(2) {
        // Told by rank 2 or 3, or by the other of ranks 0 and 1, whichever looked first.
        assert!(
            stderr.contains("failed: mismatch on rank") && stderr.contains("hint: every rank"),
            "rank {rank}: {stderr}"
        );
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
        theirs[0].2.contains("did not accept this rank's job token"),
        "{}",
        theirs[0].2
    );
    assert_eq!(ours[0].0, 3);
    assert!(ours[0].2.contains("ranks 1 never arrived"), "{}", ours[0].2);
    assert!(
        ours[0].2.contains("1 connections failed to authenticate"),
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

/// A client of rank 0's rendezvous port that misbehaves in one way.
fn attack(port: u16, how: &'static str, token: String) -> std::thread::JoinHandle<()> {
    use accelerate_core::comm::auth::{self, Claim, Purpose};
    use std::io::{Read, Write};
    std::thread::spawn(move || {
        let connect = || loop {
            if let Ok(s) = std::net::TcpStream::connect(("127.0.0.1", port)) {
                break s;
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        let mut s = connect();
        let deadline = Instant::now() + Duration::from_secs(20);
        let claim = Claim {
            purpose: Purpose::Rendezvous,
            rank: 1,
            world_size: 2,
        };
        match how {
            "garbage" => {
                let _ = s.write_all(&[0xA5; 200]);
            }
            "slow-drip" => {
                // One byte every 200 ms for 20 s: a whole rendezvous' worth of stalling.
                for _ in 0..100 {
                    if s.write_all(b"{").is_err() {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(200));
                }
            }
            "oversized" => {
                // 8 MiB without a line end or a valid frame.
                let _ = s.write_all(&vec![b'7'; 8 << 20]);
            }
            "wrong-token" => {
                let _ = auth::join(&mut s, b"a guess", claim, deadline);
            }
            "replay" => {
                // A legitimate answer, recorded, then replayed on a new connection.
                let mut challenge = [0u8; auth::CHALLENGE_BYTES];
                s.read_exact(&mut challenge).unwrap();
                let answer = auth::answer(token.as_bytes(), &challenge, claim, &[7; 32]);
                drop(s);
                let mut again = connect();
                let mut fresh = [0u8; auth::CHALLENGE_BYTES];
                again.read_exact(&mut fresh).unwrap();
                let _ = again.write_all(&answer);
                let mut proof = [0u8; auth::PROOF_BYTES];
                assert!(
                    again.read_exact(&mut proof).is_err(),
                    "rank 0 answered a replayed handshake"
                );
                return;
            }
            other => panic!("unknown attack {other}"),
        }
        // Hold the connection open, as a stalled client would.
        std::thread::sleep(Duration::from_secs(5));
    })
}

/// The ports rank 0 of `job` listens on once it has opened both its rendezvous and its peer
/// listener (what it has after 20 s at most).
fn rendezvous_and_peer_ports(job: &Job) -> Vec<u16> {
    let rank0 = job.children[0].id();
    let waited = Instant::now();
    loop {
        let ports = listening_ports(rank0);
        if ports.len() >= 2 || waited.elapsed() > Duration::from_secs(20) {
            return ports;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// The TCP ports process `pid` listens on (from `/proc`: its socket inodes, matched against
/// the kernel's table of listening sockets).
fn listening_ports(pid: u32) -> Vec<u16> {
    let inodes: Vec<String> = std::fs::read_dir(format!("/proc/{pid}/fd"))
        .map(|fds| {
            fds.filter_map(Result::ok)
                .filter_map(|fd| std::fs::read_link(fd.path()).ok())
                .filter_map(|link| {
                    let link = link.to_string_lossy().into_owned();
                    Some(
                        link.strip_prefix("socket:[")?
                            .strip_suffix(']')?
                            .to_string(),
                    )
                })
                .collect()
        })
        .unwrap_or_default();
    let table = std::fs::read_to_string("/proc/net/tcp").unwrap_or_default();
    table
        .lines()
        .skip(1)
        .filter_map(|line| {
            let fields: Vec<&str> = line.split_whitespace().collect();
            let (local, state, inode) = (fields.get(1)?, fields.get(3)?, fields.get(9)?);
            let port = u16::from_str_radix(local.rsplit_once(':')?.1, 16).ok()?;
            (*state == "0A" && inodes.iter().any(|i| i == inode)).then_some(port)
        })
        .collect()
}

/// 200 silent connections and a connect flood at rank 0's rendezvous port and at its peer
/// listener while the group forms: the other rank still gets in, the job forms and trains.
#[test]
fn silent_connections_and_a_connect_flood_do_not_hold_the_set_up() {
    let timeout = [("ACCELERATE_RENDEZVOUS_TIMEOUT", "60")];
    let mut job = start("train", "tcp", 2, &[0], &timeout);
    let ports = rendezvous_and_peer_ports(&job);
    assert!(ports.contains(&job.port), "{ports:?}");
    let peer_listener = ports.iter().copied().find(|&p| p != job.port);
    let peer_listener = peer_listener.unwrap_or_else(|| panic!("no peer listener: {ports:?}"));
    let targets = [job.port, peer_listener];
    // Bounded connects: the peer listener accepts nothing until the rendezvous is over, so
    // once its backlog is full the kernel stops answering.
    let connect = |port: u16| {
        let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
        std::net::TcpStream::connect_timeout(&addr, Duration::from_millis(200)).ok()
    };
    let silent: Vec<std::net::TcpStream> = targets
        .iter()
        .flat_map(|&port| (0..200).filter_map(move |_| connect(port)))
        .collect();
    assert!(
        silent.len() >= 200,
        "only {} connections opened",
        silent.len()
    );
    let flood_until = Instant::now() + Duration::from_secs(5);
    let flood = std::thread::spawn(move || {
        let mut opened = 0u64;
        while Instant::now() < flood_until {
            for port in targets {
                opened += u64::from(connect(port).is_some());
            }
        }
        opened
    });
    std::thread::sleep(Duration::from_millis(200));
    job.children.push(spawn_rank(
        "train",
        "tcp",
        (1, 2),
        (job.port, &job.token),
        &timeout,
    ));
    let results = job.finish(Duration::from_secs(90));
    assert!(flood.join().unwrap() > 100, "the flood never got going");
    drop(silent);
    for (rank, (code, stdout, stderr)) in results.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {stdout}\n{stderr}");
        assert!(stdout.contains("FORMED tcp"), "rank {rank}: {stdout}");
        assert!(stdout.contains("TRAINED"), "rank {rank}: {stdout}");
    }
}

/// The variable naming the ports the `flooder` test floods (comma-separated).
const FLOOD: &str = "ACCELERATE_TEST_FLOOD";

/// The body of a flooding local user: as many silent connections to each port of [`FLOOD`]
/// as the servers keep, reopened as soon as one is closed, from two threads per port, until
/// killed (two minutes at most).
#[test]
fn flooder() {
    let Ok(ports) = std::env::var(FLOOD) else {
        return;
    };
    let ports: Vec<u16> = ports.split(',').filter_map(|p| p.parse().ok()).collect();
    let until = Instant::now() + Duration::from_secs(120);
    let held = std::sync::Arc::new(std::sync::atomic::AtomicUsize::new(0));
    for &port in ports.iter().chain(&ports) {
        let held = held.clone();
        std::thread::spawn(move || {
            let addr = std::net::SocketAddr::from(([127, 0, 0, 1], port));
            let mut open: Vec<std::net::TcpStream> = Vec::new();
            while Instant::now() < until {
                if let Ok(s) = std::net::TcpStream::connect(addr)
                    && s.set_nonblocking(true).is_ok()
                {
                    open.push(s);
                }
                // Keep what the server still holds: a closed connection reads end of file.
                if open.len() >= 48 {
                    open.retain(|s| {
                        let mut byte = [0u8; 1];
                        matches!(s.peek(&mut byte), Err(e) if e.kind() == std::io::ErrorKind::WouldBlock)
                    });
                    held.fetch_max(open.len(), std::sync::atomic::Ordering::Relaxed);
                }
                if open.len() >= 300 {
                    std::thread::sleep(Duration::from_millis(1));
                }
            }
        });
    }
    while held.load(std::sync::atomic::Ordering::Relaxed) < 32 {
        std::thread::sleep(Duration::from_millis(10));
    }
    println!("HOLDING");
    std::thread::sleep(until.saturating_duration_since(Instant::now()));
}

/// Another local user (nobody) holds every slot it may of rank 0's rendezvous and peer
/// listener for as long as the job takes, reopening each connection the servers close. On
/// one host every process is 127.0.0.1, so a cap per address let it starve the job's own
/// ranks; counted per local user (the kernel's owner of the connecting socket), the job's
/// second rank still gets in at once and the job forms and trains. Needs root (to be
/// another user); skipped otherwise.
#[test]
fn another_local_users_flood_does_not_hold_the_set_up() {
    use std::os::unix::process::CommandExt;
    if !nix::unistd::geteuid().is_root() {
        eprintln!("skipped: only root can run a flooder as another user");
        return;
    }
    let mut job = start(
        "train",
        "tcp",
        2,
        &[0],
        &[("ACCELERATE_RENDEZVOUS_TIMEOUT", "30")],
    );
    let ports = rendezvous_and_peer_ports(&job);
    assert!(ports.len() >= 2, "{ports:?}");
    let list: Vec<String> = ports.iter().map(u16::to_string).collect();
    let mut flooder = Command::new(std::env::current_exe().unwrap());
    flooder
        .args(["flooder", "--exact", "--nocapture", "--test-threads=1"])
        .env(FLOOD, list.join(","))
        .env_remove(SCENARIO)
        .uid(65534)
        .gid(65534)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    // Killed when dropped, whatever happens below.
    let mut flood = Job {
        children: vec![flooder.spawn().unwrap()],
        token: String::new(),
        port: 0,
    };
    let stdout = flood.children[0].stdout.take().unwrap();
    let holding = BufReader::new(stdout)
        .lines()
        .map_while(Result::ok)
        .find(|line| line.contains("HOLDING"));
    assert!(
        holding.is_some(),
        "the flooder never held the servers' slots"
    );
    job.children.push(spawn_rank(
        "train",
        "tcp",
        (1, 2),
        (job.port, &job.token),
        // Time enough to join a job that nobody floods (a few milliseconds), not enough to
        // wait for slots another user holds (5 to 9 s when a cap per address let it).
        &[("ACCELERATE_RENDEZVOUS_TIMEOUT", "4")],
    ));
    let results = job.finish(Duration::from_secs(60));
    assert!(
        flood.children[0].try_wait().unwrap().is_none(),
        "the flooder stopped before the job formed"
    );
    drop(flood);
    for (rank, (code, stdout, stderr)) in results.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {stdout}\n{stderr}");
        assert!(stdout.contains("FORMED tcp"), "rank {rank}: {stdout}");
        assert!(stdout.contains("TRAINED"), "rank {rank}: {stdout}");
    }
}

#[test]
fn hostile_clients_delay_nobody_and_the_job_still_forms_and_trains() {
    for transport in ["tcp", "shm"] {
        let timeout = [("ACCELERATE_RENDEZVOUS_TIMEOUT", "60")];
        let mut job = start("train", transport, 2, &[0], &timeout);
        let attackers: Vec<_> = ["slow-drip", "garbage", "oversized", "wrong-token", "replay"]
            .into_iter()
            .map(|how| attack(job.port, how, job.token.clone()))
            .collect();
        std::thread::sleep(Duration::from_millis(500));
        let started = Instant::now();
        job.children.push(spawn_rank(
            "train",
            transport,
            (1, 2),
            (job.port, &job.token),
            &timeout,
        ));
        let results = job.finish(Duration::from_secs(60));
        // The slow-drip client holds its connection for 20 s; the job does not wait for it.
        let took = started.elapsed();
        assert!(took < Duration::from_secs(15), "{transport}: {took:?}");
        for (rank, (code, stdout, stderr)) in results.iter().enumerate() {
            assert_eq!(*code, 0, "{transport} rank {rank}: {stdout}\n{stderr}");
            assert!(
                stdout.contains("TRAINED"),
                "{transport} rank {rank}: {stdout}"
            );
            assert!(
                stdout.contains(&format!("FORMED {transport}")),
                "{transport} rank {rank}: {stdout}"
            );
        }
        for attacker in attackers {
            attacker.join().unwrap();
        }
    }
}

#[test]
fn ranks_with_different_settings_fail_on_every_rank_naming_both() {
    for (var, theirs) in [
        ("ACCELERATE_SHM_SLOT_BYTES", "131072"),
        ("ACCELERATE_RING_SEGMENT_BYTES", "8192"),
    ] {
        let mut job = start("all", "auto", 2, &[0], &[]);
        job.children.push(spawn_rank(
            "all",
            "auto",
            (1, 2),
            (job.port, &job.token),
            &[(var, theirs)],
        ));
        let results = job.finish(Duration::from_secs(60));
        for (rank, (code, _, stderr)) in results.iter().enumerate() {
            assert_eq!(*code, 3, "rank {rank}: {stderr}");
            assert!(stderr.contains("mismatch on rank"), "rank {rank}: {stderr}");
            assert!(stderr.contains("=65536"), "rank {rank}: {stderr}");
            assert!(
                stderr.contains(&format!("{var}={theirs}")),
                "rank {rank}: {stderr}"
            );
        }
    }
}

/// Starts ranks of a job without `ACCELERATE_JOB_TOKEN`, as torchrun or a user by hand would.
fn spawn_tokenless(port: u16, rank: usize, local_world: usize, uid: Option<u32>) -> Child {
    use std::os::unix::process::CommandExt;
    let mut cmd = Command::new(std::env::current_exe().unwrap());
    cmd.args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, "train")
        .env_remove("ACCELERATE_JOB_TOKEN")
        .env("RANK", rank.to_string())
        .env("WORLD_SIZE", "2")
        .env("LOCAL_RANK", (rank % local_world).to_string())
        .env("LOCAL_WORLD_SIZE", local_world.to_string())
        .env("MASTER_ADDR", "127.0.0.1")
        .env("MASTER_PORT", port.to_string())
        .env("ACCELERATE_RENDEZVOUS_TIMEOUT", "8")
        .env("ACCELERATE_SHM_SLOT_BYTES", "65536")
        .env("ACCELERATE_RING_SEGMENT_BYTES", "65536")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    if let Some(uid) = uid {
        // Another local account: a private runtime directory of its own.
        cmd.uid(uid).gid(uid).env_remove("XDG_RUNTIME_DIR");
    }
    cmd.spawn().unwrap()
}

#[test]
fn a_job_without_a_token_shares_a_private_secret_that_another_user_cannot_read() {
    let port = free_port();
    let mut children = vec![spawn_tokenless(port, 0, 2, None)];
    // Running as root, a second account (nobody) copies the job's variables and tries first.
    let intruder = nix::unistd::geteuid().is_root().then(|| Job {
        children: vec![spawn_tokenless(port, 1, 2, Some(65534))],
        token: String::new(),
        port,
    });
    std::thread::sleep(Duration::from_millis(300));
    children.push(spawn_tokenless(port, 1, 2, None));
    let results = Job {
        children,
        token: String::new(),
        port,
    }
    .finish(Duration::from_secs(60));
    for (rank, (code, stdout, stderr)) in results.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {stdout}\n{stderr}");
        assert!(stdout.contains("TRAINED"), "rank {rank}: {stdout}");
    }
    if let Some(intruder) = intruder {
        let (code, stdout, stderr) = intruder.finish(Duration::from_secs(30)).remove(0);
        assert_eq!(code, 3, "the other user joined: {stdout}\n{stderr}");
        assert!(!stdout.contains("FORMED"), "{stdout}");
        let _ = std::fs::remove_dir(std::env::temp_dir().join("accelerate-rs-65534"));
    }
}

#[test]
fn a_job_spanning_hosts_without_a_token_refuses_to_start() {
    let port = free_port();
    let started = Instant::now();
    let results = Job {
        children: vec![spawn_tokenless(port, 0, 1, None)],
        token: String::new(),
        port,
    }
    .finish(Duration::from_secs(30));
    let (code, _, stderr) = &results[0];
    assert_eq!(*code, 3, "{stderr}");
    assert!(stderr.contains("spans hosts"), "{stderr}");
    assert!(stderr.contains("openssl rand -hex 16"), "{stderr}");
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "it waited instead"
    );
}

/// `sh -c script` in new `namespaces` (`unshare` flags), or `None` when this is not root.
fn in_namespaces(namespaces: &[&str], script: &str, envs: &[(&str, String)]) -> Option<Child> {
    if !tools::ready(
        &["unshare", "ip"],
        true,
        "apt-get install util-linux iproute2",
    ) {
        return None;
    }
    let mut cmd = Command::new("unshare");
    cmd.args(namespaces)
        .args(["sh", "-c", script])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped());
    for (k, v) in envs {
        cmd.env(k, v);
    }
    Some(cmd.spawn().unwrap())
}

/// What a rank started inside namespaces ([`in_namespaces`]) runs with: this test binary as
/// `EXE`, `scenario`, rank `rank` of `world` on 127.0.0.1:`port`, and the job token.
fn namespaced_rank_env(
    scenario: &str,
    (rank, world): (usize, usize),
    (port, token): (u16, &str),
) -> Vec<(&'static str, String)> {
    vec![
        (
            "EXE",
            std::env::current_exe().unwrap().display().to_string(),
        ),
        (SCENARIO, scenario.to_string()),
        ("RANK", rank.to_string()),
        ("WORLD_SIZE", world.to_string()),
        ("LOCAL_RANK", rank.to_string()),
        ("LOCAL_WORLD_SIZE", world.to_string()),
        ("MASTER_ADDR", "127.0.0.1".into()),
        ("MASTER_PORT", port.to_string()),
        ("ACCELERATE_JOB_TOKEN", token.to_string()),
        ("ACCELERATE_RENDEZVOUS_TIMEOUT", "30".into()),
    ]
}

/// Rank 0 with its own /dev/shm of `size` (a private mount namespace: nothing to clean up,
/// the mount ends with the process), rank 1 on the host's.
fn job_with_private_shm(size: &str) -> Option<Vec<(i32, String, String)>> {
    let port = free_port();
    let token = format!("tmpfs-{}-{port}", std::process::id());
    let script = format!(
        "mount -t tmpfs -o size={size} tmpfs /dev/shm && exec \"$EXE\" child --exact --nocapture \
         --test-threads=1"
    );
    let mut envs = namespaced_rank_env("train", (0, 2), (port, &token));
    envs.extend([
        ("ACCELERATE_SHM_SLOT_BYTES", (4 << 20).to_string()),
        ("ACCELERATE_RING_SEGMENT_BYTES", "65536".into()),
    ]);
    let rank0 = in_namespaces(&["--mount", "--propagation", "private"], &script, &envs)?;
    let rank1 = spawn_rank(
        "train",
        "auto",
        (1, 2),
        (port, &token),
        &[("ACCELERATE_SHM_SLOT_BYTES", "4194304")],
    );
    Some(
        Job {
            children: vec![rank0, rank1],
            token,
            port,
        }
        .finish(Duration::from_secs(60)),
    )
}

/// A live rank 20 s late to a 64 MiB broadcast, with a 6 s heartbeat: rank 0 waits for it (its
/// kernel acknowledges and answers zero-window probes) instead of declaring its host gone.
#[test]
fn a_rank_late_to_a_large_broadcast_is_waited_for_not_declared_dead() {
    let job = start(
        "late_broadcast",
        "tcp",
        2,
        &[0, 1],
        &[
            ("ACCELERATE_HEARTBEAT_TIMEOUT", "6"),
            ("ACCELERATE_TIMEOUT", "120"),
        ],
    );
    let results = job.finish(Duration::from_secs(100));
    for (rank, (code, stdout, stderr)) in results.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {stdout}\n{stderr}");
        assert!(stdout.contains("TRAINED"), "rank {rank}: {stdout}");
    }
}

/// Rank 1 in a PID namespace of its own (a second container of a pod: /dev/shm shared, pids
/// not), rank 0 late to every collective: the ranks cannot see each other's pids, and the
/// shared-memory job still trains instead of reporting a peer that exited.
#[test]
fn ranks_in_separate_pid_namespaces_train_over_shared_memory() {
    let port = free_port();
    let token = format!("pidns-{}-{port}", std::process::id());
    let script = "exec \"$EXE\" child --exact --nocapture --test-threads=1";
    let mut envs = namespaced_rank_env("late_train", (1, 2), (port, &token));
    // What `spawn_rank` gives rank 0.
    envs.extend([
        ("ACCELERATE_TRANSPORT", "shm".into()),
        ("ACCELERATE_TIMEOUT", "60".into()),
        ("ACCELERATE_SHM_SLOT_BYTES", "65536".into()),
        ("ACCELERATE_RING_SEGMENT_BYTES", "65536".into()),
    ]);
    // --mount-proc: /proc shows only the new namespace, as in a container.
    let Some(rank1) = in_namespaces(&["--pid", "--fork", "--mount-proc"], script, &envs) else {
        return;
    };
    let rank0 = spawn_rank("late_train", "shm", (0, 2), (port, &token), &[]);
    let results = Job {
        children: vec![rank0, rank1],
        token,
        port,
    }
    .finish(Duration::from_secs(90));
    for (rank, (code, stdout, stderr)) in results.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {stdout}\n{stderr}");
        assert!(stdout.contains("FORMED shm"), "rank {rank}: {stdout}");
        assert!(stdout.contains("TRAINED"), "rank {rank}: {stdout}");
    }
}

#[test]
fn a_full_dev_shm_falls_back_to_tcp_with_one_warning() {
    // 1 MiB cannot hold two ranks' 4 MiB slots: space is reserved up front, so this is ENOSPC
    // at creation, not a SIGBUS in the first large collective.
    let Some(results) = job_with_private_shm("1m") else {
        return;
    };
    for (rank, (code, stdout, stderr)) in results.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {stdout}\n{stderr}");
        assert!(stdout.contains("FORMED tcp"), "rank {rank}: {stdout}");
        assert!(stdout.contains("TRAINED"), "rank {rank}: {stdout}");
    }
    let rank0 = format!("{}{}", results[0].1, results[0].2);
    assert_eq!(
        rank0.matches("shared memory unavailable").count(),
        1,
        "{rank0}"
    );
    assert!(rank0.contains("No space left on device"), "{rank0}");
}

#[test]
fn ranks_that_do_not_share_dev_shm_fall_back_to_tcp() {
    // Same host name and boot id, separate /dev/shm (as containers can be): the probe sees it.
    let Some(results) = job_with_private_shm("64m") else {
        return;
    };
    for (rank, (code, stdout, stderr)) in results.iter().enumerate() {
        assert_eq!(*code, 0, "rank {rank}: {stdout}\n{stderr}");
        assert!(stdout.contains("FORMED tcp"), "rank {rank}: {stdout}");
    }
    let rank0 = format!("{}{}", results[0].1, results[0].2);
    assert!(rank0.contains("rank 1 cannot use it"), "{rank0}");
}

/// Runs a 2-rank TCP job inside a private network namespace, cuts its loopback link once both
/// ranks are past forming (every packet dropped: a host gone without a FIN), and reports how
/// long rank 0 took to give up, and what it said. Runs inside the namespace.
#[test]
fn cut_link_conductor() {
    if std::env::var("ACCELERATE_TEST_CONDUCTOR").is_err() {
        return;
    }
    let mut job = start(
        "stall",
        "tcp",
        2,
        &[0, 1],
        &[
            ("ACCELERATE_HEARTBEAT_TIMEOUT", "6"),
            ("ACCELERATE_TIMEOUT", "300"),
        ],
    );
    for child in &mut job.children {
        let stdout = child.stdout.take().unwrap();
        let mut lines = BufReader::new(stdout).lines();
        assert!(lines.any(|l| l.map(|l| l == "READY").unwrap_or(false)));
    }
    std::thread::sleep(Duration::from_millis(500));
    // Every packet to 127.0.0.1 now goes to a blackhole route, silently, both ways: what a
    // cut cable looks like to both ends. (A qdisc that drops would look like local congestion,
    // which TCP retries forever.)
    let cut = Command::new("sh")
        .args([
            "-c",
            "ip rule del pref 0 lookup local && ip rule add pref 100 lookup local && \
             ip rule add pref 10 to 127.0.0.1 blackhole",
        ])
        .status()
        .unwrap();
    assert!(cut.success());
    let started = Instant::now();
    let mut rank0 = job.children.remove(0);
    let status = loop {
        if let Some(status) = rank0.try_wait().unwrap() {
            break status;
        }
        assert!(
            started.elapsed() < Duration::from_secs(60),
            "rank 0 never gave up"
        );
        std::thread::sleep(Duration::from_millis(50));
    };
    let mut stderr = String::new();
    use std::io::Read;
    rank0
        .stderr
        .take()
        .unwrap()
        .read_to_string(&mut stderr)
        .unwrap();
    println!("GAVE_UP_AFTER {:.1}", started.elapsed().as_secs_f64());
    println!("EXIT {}", status.code().unwrap_or(-1));
    println!("STDERR {}", stderr.replace('\n', " "));
}

#[test]
fn a_host_that_vanishes_is_reported_within_the_heartbeat_timeout() {
    let exe = std::env::current_exe().unwrap().display().to_string();
    let Some(conductor) = in_namespaces(
        &["--net"],
        "ip link set lo up && exec \"$EXE\" cut_link_conductor --exact --nocapture \
         --test-threads=1",
        &[("EXE", exe), ("ACCELERATE_TEST_CONDUCTOR", "1".into())],
    ) else {
        return;
    };
    let out = conductor.wait_with_output().unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let took: f64 = stdout
        .lines()
        .find_map(|l| l.split("GAVE_UP_AFTER ").nth(1))
        .and_then(|v| v.trim().parse().ok())
        .unwrap_or_else(|| panic!("{stdout}"));
    // ACCELERATE_HEARTBEAT_TIMEOUT=6, the collective timeout 300: reported by the heartbeat.
    assert!(took < 15.0, "rank 0 took {took} s: {stdout}");
    assert!(stdout.contains("EXIT 3"), "{stdout}");
    assert!(stdout.contains("rank 1 is gone"), "{stdout}");
    assert!(
        stdout.contains("no sign of life from its host 127.0.0.1:"),
        "{stdout}"
    );
}

/// Runs `scenario` under another launcher (`launcher` with its arguments; the ranks are this
/// test binary) with none of our variables set; asserts it succeeded and returns its stdout.
fn under_launcher(launcher: &mut Command, scenario: &str) -> String {
    // The launchers' own temporary files (torchrun's torchelastic_* log directories, Open
    // MPI's session directory) go here and leave with it.
    let tmp = tempfile::tempdir().unwrap();
    succeeded(with_ranks(launcher, scenario, tmp.path()).output().unwrap())
}

/// `launcher` starting this test binary's `scenario` as its ranks, with none of our variables
/// set and its temporary files in `tmp`.
fn with_ranks<'a>(launcher: &'a mut Command, scenario: &str, tmp: &Path) -> &'a mut Command {
    launcher
        .env("TMPDIR", tmp)
        .arg(std::env::current_exe().unwrap())
        .args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, scenario)
        .env("ACCELERATE_RENDEZVOUS_TIMEOUT", "30")
        .env_remove("ACCELERATE_JOB_TOKEN")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
}

/// The stdout of a launcher that must have succeeded.
fn succeeded(out: std::process::Output) -> String {
    let stdout = String::from_utf8_lossy(&out.stdout).into_owned();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    stdout
}

/// Open MPI's `mpirun` on one host, with no variable set by hand: the ranks read Open MPI's
/// own environment, rank 0 picks a port and tells the others through the job's private file.
#[test]
fn mpirun_starts_a_job_with_no_variable_set_by_hand() {
    let Some(mut mpirun) = tools::mpirun(2) else {
        return;
    };
    let stdout = under_launcher(&mut mpirun, "train");
    assert_eq!(stdout.matches("FORMED shm").count(), 2, "{stdout}");
    assert_eq!(stdout.matches("TRAINED").count(), 2, "{stdout}");
}

/// torchrun on one host, with no variable set by hand: torchrun's agent holds MASTER_PORT for
/// its own store, so rank 0 picks a port and tells the others through the job's private file.
#[test]
fn torchrun_starts_a_job_with_no_variable_set_by_hand() {
    let Some(torchrun) = tools::torchrun() else {
        return;
    };
    let mut torchrun = Command::new(torchrun);
    let stdout = under_launcher(
        torchrun.args(["--nproc-per-node", "2", "--no-python"]),
        "train",
    );
    assert_eq!(stdout.matches("FORMED shm").count(), 2, "{stdout}");
    assert_eq!(stdout.matches("TRAINED").count(), 2, "{stdout}");
}

/// Two torchrun jobs of one user on one host, each started with `--master-port` (torchrun then
/// names both runs `none`), at the same time: each forms its own group of 2 and trains.
#[test]
fn two_torchrun_jobs_with_master_ports_at_once_stay_apart() {
    let Some(torchrun) = tools::torchrun() else {
        return;
    };
    let tmp = tempfile::tempdir().unwrap();
    // Two ports free now (both held until both are known, so they differ); each torchrun's
    // agent binds its own for its store.
    let held: Vec<TcpListener> = (0..2)
        .map(|_| TcpListener::bind("127.0.0.1:0").unwrap())
        .collect();
    let ports: Vec<String> = held
        .iter()
        .map(|l| l.local_addr().unwrap().port().to_string())
        .collect();
    drop(held);
    let jobs: Vec<_> = ports
        .iter()
        .map(|port| {
            let mut command = Command::new(&torchrun);
            command.args([
                "--nproc-per-node",
                "2",
                "--master-port",
                port,
                "--no-python",
            ]);
            with_ranks(&mut command, "train", tmp.path())
                .spawn()
                .unwrap()
        })
        .collect();
    for job in jobs {
        let stdout = succeeded(job.wait_with_output().unwrap());
        assert_eq!(stdout.matches("FORMED shm").count(), 2, "{stdout}");
        assert_eq!(stdout.matches("TRAINED").count(), 2, "{stdout}");
    }
}

/// torchrun with `--max-restarts`: a rank fails in the first attempt, the agent stops the
/// others and starts every worker again; the new attempt forms a new group (not the stale
/// one) and finishes.
#[test]
fn torchrun_restarts_the_workers_after_a_failure_and_the_job_finishes() {
    let Some(torchrun) = tools::torchrun() else {
        return;
    };
    let mut torchrun = Command::new(torchrun);
    torchrun.args([
        "--nproc-per-node",
        "2",
        "--max-restarts",
        "1",
        "--no-python",
    ]);
    let stdout = under_launcher(&mut torchrun, "fail_first_attempt");
    assert_eq!(stdout.matches("FAILING ON PURPOSE").count(), 1, "{stdout}");
    assert_eq!(
        stdout.matches("TRAINED in attempt 1").count(),
        2,
        "{stdout}"
    );
    assert!(!stdout.contains("TRAINED in attempt 0"), "{stdout}");
}

/// NCCL's bootstrap socket on loopback.
const LOOPBACK_NCCL: (&str, &str) = ("NCCL_SOCKET_IFNAME", "lo");

/// libnccl as the workers will find it (the `nvidia-nccl-cu13` wheel of the torch environment
/// on PATH under CI), or a skip.
fn nccl_library_ready() -> bool {
    match accelerate_core::nccl::NcclLibrary::find(&accelerate_core::state::ProcessEnv) {
        Ok(_) => true,
        Err(e) => tools::skip(&format!(
            "libnccl (.ci/run's torch environment has it): {e}"
        )),
    }
}

#[test]
fn rank_zeros_nccl_id_reaches_every_rank_over_the_authenticated_group() {
    if !nccl_library_ready() {
        return;
    }
    // NCCL's bootstrap listens where NCCL_SOCKET_IFNAME says: loopback, like every test.
    let results =
        start("nccl", "tcp", 2, &[0, 1], &[LOOPBACK_NCCL]).finish(Duration::from_secs(60));
    let ids: Vec<&str> = results
        .iter()
        .enumerate()
        .map(|(rank, (code, stdout, stderr))| {
            assert_eq!(*code, 0, "rank {rank}: {stdout}\n{stderr}");
            assert!(stdout.contains("LIBRARY 2."), "rank {rank}: {stdout}");
            let line = stdout
                .lines()
                .find(|l| l.starts_with("NCCL "))
                .unwrap_or_else(|| panic!("rank {rank} did not choose NCCL: {stdout}\n{stderr}"));
            &line[5..]
        })
        .collect();
    // 128 bytes made by libnccl on rank 0 (its bootstrap address: not all zero), the same
    // bytes on rank 1.
    assert_eq!(ids[0].len(), 2 * accelerate_core::nccl::UNIQUE_ID_BYTES);
    assert!(ids[0].chars().any(|c| c != '0'), "{}", ids[0]);
    assert_eq!(ids[0], ids[1]);
}

#[test]
fn a_rank_without_libnccl_takes_the_whole_job_to_the_host_path_or_fails_it_when_required() {
    for mode in ["auto", "require"] {
        let port = free_port();
        let token = format!("test-{}-{port}", std::process::id());
        let mode_env = ("ACCELERATE_NCCL", mode);
        let missing = ("ACCELERATE_NCCL_LIBRARY", "/nonexistent/libnccl.so.2");
        let job = Job {
            children: vec![
                spawn_rank(
                    "nccl",
                    "tcp",
                    (0, 2),
                    (port, &token),
                    &[mode_env, LOOPBACK_NCCL],
                ),
                spawn_rank(
                    "nccl",
                    "tcp",
                    (1, 2),
                    (port, &token),
                    &[mode_env, missing, LOOPBACK_NCCL],
                ),
            ],
            token,
            port,
        };
        let results = job.finish(Duration::from_secs(60));
        for (rank, (code, stdout, stderr)) in results.iter().enumerate() {
            if mode == "auto" {
                assert_eq!(*code, 0, "rank {rank}: {stdout}\n{stderr}");
                assert!(stdout.contains("HOST"), "rank {rank}: {stdout}");
            } else {
                assert_eq!(*code, 3, "rank {rank}: {stdout}\n{stderr}");
                assert!(
                    stderr.contains("NCCL is required")
                        && stderr.contains("rank 1 cannot use it")
                        && stderr.contains("/nonexistent/libnccl.so.2"),
                    "rank {rank}: {stderr}"
                );
            }
        }
        if mode == "auto" {
            // One warning, on the main process, naming the rank and what it lacked.
            let warned = |s: &str| s.contains("WARN") && s.contains("not with NCCL");
            assert!(warned(&results[0].2), "{}", results[0].2);
            assert!(
                results[0].2.contains("rank 1 cannot use it"),
                "{}",
                results[0].2
            );
            assert!(!warned(&results[1].2), "{}", results[1].2);
        }
    }
}
