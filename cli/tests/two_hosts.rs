//! Two hosts on one machine: two network namespaces joined by a veth link, each with its own
//! address and host name, each running `accelerate-rs launch --num-machines 2 --machine-rank r`.
//! The namespaces are created and removed by the tests (removed on drop, also when a test
//! fails); they need root, and are skipped with a message without it.

use std::io::{BufRead, BufReader};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use accelerate_core::comm::{GroupOptions, ProcessGroup, Reduction};

#[path = "../../tests-support/netns.rs"]
mod netns;
#[path = "../../tests-support/slurm.rs"]
mod slurm_cluster;
#[path = "../../tests-support/tools.rs"]
mod tools;

use netns::TwoHosts;
use slurm_cluster::SlurmCluster;

const SCENARIO: &str = "ACCELERATE_TEST_TWO_HOSTS";

/// A worker: forms the group, then `train` (20 checked all-reduces) or `late` (2 s of
/// "compute" before a barrier). Exits 3 on a collective error. Does nothing unless started
/// by the tests below.
#[test]
fn worker() {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    if scenario == "overwrite_store" {
        overwrite_store();
        return;
    }
    // A test whose third party must already be writing into torchrun's store when the ranks
    // read it (it can connect only once torchrun has started the store, as the ranks do) gives
    // it this head start.
    if let Some(ms) = std::env::var("TEST_FORM_DELAY_MS")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
    {
        std::thread::sleep(Duration::from_millis(ms));
    }
    let result = (|| -> Result<(), accelerate_core::CommError> {
        let state = accelerate_core::ProcessState::from_env().unwrap();
        let mut group = ProcessGroup::new(&state, &GroupOptions::from_env().unwrap())?;
        println!("FORMED {} on {}", group.transport(), hostname());
        let (rank, n) = (group.rank(), group.world_size());
        if scenario == "train" {
            // 400 KB a step: past the small-buffer cut-off, so a hierarchical group really
            // goes through shared memory: along rails when the length splits evenly between a
            // host's ranks, through its leader when it does not; sums and means (exact in f32
            // for these values: integers below 2^24, divided by a power of two).
            for step in 0..20 {
                let len = if step % 2 == 0 { 100_000 } else { 100_003 };
                let reduction = if step % 4 < 2 {
                    Reduction::Sum
                } else {
                    Reduction::Mean
                };
                let mut grads: Vec<f32> =
                    (0..len).map(|i| (i * (rank + 1) + step) as f32).collect();
                group.all_reduce(&mut grads, reduction)?;
                let expected: Vec<f32> = (0..len)
                    .map(|i| {
                        let sum: f32 = (0..n).map(|r| (i * (r + 1) + step) as f32).sum();
                        if reduction == Reduction::Mean {
                            sum / n as f32
                        } else {
                            sum
                        }
                    })
                    .collect();
                assert_eq!(grads, expected, "step {step}");
            }
            println!("TRAINED");
        } else if scenario == "bench" {
            // One element more makes the length odd: the hierarchical engine then goes
            // through each host's leader instead of along rails.
            let odd = usize::from(std::env::var_os("TEST_BENCH_ODD").is_some());
            for size in [4usize << 10, 1 << 20, 16 << 20, 64 << 20] {
                let mut buf = vec![0.0f32; size / 4 + odd];
                let iters = ((256 << 20) / size).clamp(5, 200);
                for _ in 0..3 {
                    group.all_reduce(&mut buf, Reduction::Sum)?;
                }
                let mut times: Vec<f64> = (0..iters)
                    .map(|_| {
                        let started = Instant::now();
                        group
                            .all_reduce(&mut buf, Reduction::Sum)
                            .map(|()| started.elapsed().as_secs_f64())
                    })
                    .collect::<Result<_, _>>()?;
                times.sort_by(f64::total_cmp);
                let median = times[times.len() / 2];
                let busbw = size as f64 / median / 1e9 * 2.0 * (n - 1) as f64 / n as f64;
                if rank == 0 {
                    println!("BENCH {size} {:.1} us {busbw:.3} GB/s", median * 1e6);
                }
            }
        } else {
            println!("READY");
            std::thread::sleep(Duration::from_secs(2));
        }
        group.barrier()
    })();
    if let Err(e) = result {
        eprintln!("ERROR {e}");
        std::process::exit(3);
    }
}

/// A third party that reaches torchrun's store on host 0: writes an address of its choosing
/// where rank 0 publishes its own, every millisecond for 60 s.
fn overwrite_store() {
    use accelerate_core::comm::torch_store::TorchStore;
    let main_ip = std::env::var("MAIN_IP").unwrap();
    let store_addr = format!("{main_ip}:29500");
    // torchrun names a run started with --master-port `none`; the job id adds the store.
    let key = format!("accelerate-rs/none.0@{store_addr}/rendezvous");
    let until = Instant::now() + Duration::from_secs(60);
    let mut store = loop {
        match TorchStore::connect(&store_addr, Instant::now() + Duration::from_secs(2)) {
            Ok(store) => break store,
            Err(_) if Instant::now() < until => std::thread::sleep(Duration::from_millis(10)),
            Err(e) => panic!("torchrun's store never came up: {e}"),
        }
    };
    println!("OVERWRITING {key}");
    while Instant::now() < until {
        if let Err(e) = store.set(&key, b"10.9.9.9:29999 00") {
            // The store dropped this connection, or the job ended and took the store with it
            // (the test then kills this process): connect again and keep overwriting, so a
            // connection lost early cannot leave the job unattacked.
            println!("SET FAILED ({e}); reconnecting");
            match TorchStore::connect(&store_addr, Instant::now() + Duration::from_secs(2)) {
                Ok(again) => store = again,
                Err(_) => std::thread::sleep(Duration::from_millis(10)),
            }
            continue;
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

fn hostname() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .unwrap_or_default()
        .trim()
        .to_string()
}

/// Our launcher, two workers a host (the worker's command line follows).
const ACCELERATE_LAUNCH: &str = "\"$ACCELERATE\" launch --num-machines 2 \
    --machine-rank \"$MACHINE\" -n 2 --main-process-ip \"$MAIN_IP\" --main-process-port 29500 \
    --grace-period 2 --";

/// torchrun, two workers a host, node 0's agent hosting the store (static rendezvous).
const TORCHRUN: &str = "\"$TORCHRUN\" --nnodes 2 --node-rank \"$MACHINE\" --nproc-per-node 2 \
    --master-addr \"$MAIN_IP\" --master-port 29500 --no-python";

/// What the tests here start on a host.
trait Launch {
    /// `accelerate-rs launch` of 2 workers on host `machine`.
    fn launch(&self, machine: usize, scenario: &str, token: &str, extra: &[(&str, &str)]) -> Child;
    /// `launcher` followed by the worker, in host `machine`'s namespace.
    fn start(
        &self,
        machine: usize,
        launcher: &str,
        scenario: &str,
        token: &str,
        extra: &[(&str, &str)],
    ) -> Child;
}

impl Launch for TwoHosts {
    /// `accelerate-rs launch` of 2 workers on host `machine`, with its own host name (and, with
    /// `SHM_SIZE` in `extra`, its own /dev/shm of that size).
    fn launch(&self, machine: usize, scenario: &str, token: &str, extra: &[(&str, &str)]) -> Child {
        self.start(machine, ACCELERATE_LAUNCH, scenario, token, extra)
    }

    /// Starts `launcher` (a shell command run after the host name and /dev/shm are set) in host
    /// `machine`'s namespace, with the test's variables.
    fn start(
        &self,
        machine: usize,
        launcher: &str,
        scenario: &str,
        token: &str,
        extra: &[(&str, &str)],
    ) -> Child {
        let mut cmd = Command::new("ip");
        cmd.args(["netns", "exec", &self.namespaces[machine]])
            .args([
                "unshare",
                "--uts",
                "--mount",
                "--propagation",
                "private",
                "sh",
                "-c",
            ])
            .arg(format!(
                "hostname \"$HOST_NAME\" && \
             if [ -n \"$SHM_SIZE\" ]; then mount -t tmpfs -o size=$SHM_SIZE tmpfs /dev/shm; fi && \
             exec {launcher} \"$EXE\" worker --exact --nocapture --test-threads=1"
            ))
            .env("HOST_NAME", format!("accrs-host-{machine}"))
            .env("ACCELERATE", env!("CARGO_BIN_EXE_accelerate-rs"))
            .env("MACHINE", machine.to_string())
            .env("MAIN_IP", &self.addresses[0])
            .env("EXE", std::env::current_exe().unwrap())
            .env(SCENARIO, scenario)
            .env("ACCELERATE_JOB_TOKEN", token)
            .env("ACCELERATE_RENDEZVOUS_TIMEOUT", "30")
            .stdout(Stdio::piped())
            .stderr(Stdio::piped());
        for (k, v) in extra {
            cmd.env(k, v);
        }
        if token.is_empty() {
            cmd.env_remove("ACCELERATE_JOB_TOKEN");
        }
        cmd.spawn().unwrap()
    }
}

/// Waits for the launchers of both hosts (at most `limit` each) and checks that each
/// succeeded with its two workers trained over `transport` on their own host, and that nothing
/// is left running on either host. Returns everything the launchers printed.
fn both_trained(
    hosts: &TwoHosts,
    launchers: Vec<Child>,
    limit: Duration,
    transport: &str,
) -> String {
    let mut output = String::new();
    for (machine, launcher) in launchers.into_iter().enumerate() {
        let (code, stdout, stderr) = finish(launcher, limit);
        assert_eq!(code, 0, "machine {machine}: {stdout}\n{stderr}");
        assert_eq!(
            stdout.matches("TRAINED").count(),
            2,
            "machine {machine}: {stdout}"
        );
        let host = format!("FORMED {transport} on accrs-host-{machine}");
        assert_eq!(
            stdout.matches(&host).count(),
            2,
            "machine {machine}: {stdout}"
        );
        output.push_str(&stdout);
        output.push_str(&stderr);
    }
    assert_eq!(hosts.leftovers(0), "");
    assert_eq!(hosts.leftovers(1), "");
    output
}

/// Waits for a launcher (at most `limit`): its exit code, stdout, stderr.
fn finish(mut child: Child, limit: Duration) -> (i32, String, String) {
    let deadline = Instant::now() + limit;
    loop {
        if child.try_wait().unwrap().is_some() {
            let out = child.wait_with_output().unwrap();
            return (
                out.status.code().unwrap_or(-1),
                String::from_utf8_lossy(&out.stdout).into_owned(),
                String::from_utf8_lossy(&out.stderr).into_owned(),
            );
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            panic!("a launcher did not finish within {limit:?}");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Reads `child`'s stdout until `count` lines contain `marker`, then hands the rest to a thread
/// that keeps it drained.
fn wait_for(child: &mut Child, marker: &str, count: usize) {
    let mut lines = BufReader::new(child.stdout.take().unwrap()).lines();
    let mut seen = 0;
    while seen < count {
        let line = lines.next().expect("the workers ended early").unwrap();
        seen += usize::from(line.contains(marker));
    }
    std::thread::spawn(move || lines.for_each(drop));
}

#[test]
fn two_hosts_of_two_processes_form_one_group_and_train() {
    let Some(hosts) = TwoHosts::new("train") else {
        return;
    };
    let token = format!("two-hosts-{}", std::process::id());
    let launchers: Vec<Child> = (0..2)
        .map(|m| hosts.launch(m, "train", &token, &[]))
        .collect();
    both_trained(&hosts, launchers, Duration::from_secs(60), "tcp+shm");
}

/// torchrun for the tests here, and a directory of its own for its log directories
/// (torchelastic_*), which leave with it.
struct Torchrun {
    path: String,
    /// Held for its removal when the test ends.
    _tmp: tempfile::TempDir,
    tmp_path: String,
}

impl Torchrun {
    /// `None` (the test skips, or fails under CI) when torchrun is not installed.
    fn find() -> Option<Self> {
        let path = tools::torchrun()?.display().to_string();
        let tmp = tempfile::tempdir().unwrap();
        let tmp_path = tmp.path().display().to_string();
        Some(Self {
            path,
            _tmp: tmp,
            tmp_path,
        })
    }

    /// The variables `TORCHRUN` (see [`TORCHRUN`]) and `TMPDIR`.
    fn env(&self) -> [(&str, &str); 2] {
        [("TORCHRUN", &self.path), ("TMPDIR", &self.tmp_path)]
    }
}

/// torchrun on each host (`--nnodes 2`), nothing set by hand but the job token: rank 0
/// publishes its address in torchrun's store, and the group is the same as under our launcher.
#[test]
fn torchrun_on_two_hosts_forms_one_group_and_trains() {
    let Some(torchrun) = Torchrun::find() else {
        return;
    };
    let Some(hosts) = TwoHosts::new("torchrun") else {
        return;
    };
    let token = format!("torchrun-{}", std::process::id());
    let extra = torchrun.env();
    let launchers: Vec<Child> = (0..2)
        .map(|m| hosts.start(m, TORCHRUN, "train", &token, &extra))
        .collect();
    both_trained(&hosts, launchers, Duration::from_secs(90), "tcp+shm");
}

/// A third party overwriting rank 0's address in torchrun's store: the address carries no
/// signature of the job token, so every rank refuses it, names the cause, and the job ends
/// (no rank connects to the address written there, none waits for its timeout).
#[test]
fn torchrun_refuses_an_address_in_its_store_that_rank_0_did_not_sign() {
    let Some(torchrun) = Torchrun::find() else {
        return;
    };
    let Some(hosts) = TwoHosts::new("torchrun-forged") else {
        return;
    };
    let token = format!("torchrun-forged-{}", std::process::id());
    let [path, tmp] = torchrun.env();
    let extra = [path, tmp, ("ACCELERATE_RENDEZVOUS_TIMEOUT", "60")];
    // The third party runs on host 1, as any other host of the network could.
    let mut intruder = hosts.start(1, "", "overwrite_store", &token, &extra);
    // The ranks wait 2 s before they read the store, so that the third party is overwriting it
    // by then even on a loaded machine (its first connection can be refused while torchrun
    // sets the store up; a CI run lost that race once).
    let mut workers = extra.to_vec();
    workers.push(("TEST_FORM_DELAY_MS", "2000"));
    let launchers: Vec<Child> = (0..2)
        .map(|m| hosts.start(m, TORCHRUN, "train", &token, &workers))
        .collect();
    let started = Instant::now();
    let results: Vec<_> = launchers
        .into_iter()
        .map(|l| finish(l, Duration::from_secs(90)))
        .collect();
    let _ = intruder.kill();
    let intruder = intruder.wait_with_output().unwrap();
    let took = started.elapsed();
    let intruder_said = String::from_utf8_lossy(&intruder.stdout);
    assert!(
        intruder_said.contains("OVERWRITING"),
        "{}",
        String::from_utf8_lossy(&intruder.stderr)
    );
    for (machine, (code, stdout, stderr)) in results.iter().enumerate() {
        assert_ne!(
            *code, 0,
            "machine {machine} trained: {stdout}\nthe intruder: {intruder_said}"
        );
        assert!(!stdout.contains("TRAINED"), "machine {machine}: {stdout}");
        assert!(
            stderr.contains("not rank 0's address signed with this job's ACCELERATE_JOB_TOKEN"),
            "machine {machine}: {stderr}"
        );
    }
    // Refused at once, not at the 60 s rendezvous timeout.
    assert!(took < Duration::from_secs(55), "took {took:?}");
    assert_eq!(hosts.leftovers(0), "");
    assert_eq!(hosts.leftovers(1), "");
}

/// Without a job token, a job torchrun spans over hosts refuses to start, saying why.
#[test]
fn torchrun_on_two_hosts_without_a_token_is_refused_with_a_hint() {
    let Some(torchrun) = Torchrun::find() else {
        return;
    };
    let Some(hosts) = TwoHosts::new("torchrun-notoken") else {
        return;
    };
    let extra = torchrun.env();
    let launchers: Vec<Child> = (0..2)
        .map(|m| hosts.start(m, TORCHRUN, "train", "", &extra))
        .collect();
    for (machine, launcher) in launchers.into_iter().enumerate() {
        let (code, stdout, stderr) = finish(launcher, Duration::from_secs(90));
        assert_ne!(code, 0, "machine {machine}: {stdout}\n{stderr}");
        assert!(
            stderr.contains("torchrun runs it on 2 hosts") && stderr.contains("openssl rand"),
            "machine {machine}: {stderr}"
        );
    }
}

/// Slurm with one node in each namespace: `srun -N 2 -n 4` on the first, and the ranks find
/// rank 0 from Slurm's own node list (no MASTER_ADDR/PORT; the token exported, as srun passes
/// the environment on).
#[test]
fn srun_on_two_hosts_finds_rank_0_from_the_node_list() {
    if !tools::slurm_ready() {
        return;
    }
    let Some(hosts) = TwoHosts::new("slurm") else {
        return;
    };
    let nodes: Vec<String> = (0..2)
        .map(|m| {
            format!(
                "accrs-host-{m}={}={}",
                hosts.namespaces[m], hosts.addresses[m]
            )
        })
        .collect();
    let cluster = SlurmCluster::start(2, &nodes);
    let out = cluster
        .srun(2, 2)
        .arg(std::env::current_exe().unwrap())
        .args(["worker", "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, "train")
        .env(
            "ACCELERATE_JOB_TOKEN",
            format!("slurm-{}", std::process::id()),
        )
        .env("ACCELERATE_RENDEZVOUS_TIMEOUT", "30")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{stdout}\n{stderr}");
    assert_eq!(stdout.matches("TRAINED").count(), 4, "{stdout}");
    for machine in 0..2 {
        let host = format!("FORMED tcp+shm on accrs-host-{machine}");
        assert_eq!(stdout.matches(&host).count(), 2, "{stdout}");
    }
    drop(cluster);
    assert_eq!(hosts.leftovers(0), "");
    assert_eq!(hosts.leftovers(1), "");
}

#[test]
fn a_link_cut_between_hosts_fails_every_rank_within_the_heartbeat_timeout() {
    let Some(hosts) = TwoHosts::new("cut") else {
        return;
    };
    let token = format!("cut-{}", std::process::id());
    let extra = [
        ("ACCELERATE_HEARTBEAT_TIMEOUT", "6"),
        ("ACCELERATE_TIMEOUT", "300"),
    ];
    let mut launchers: Vec<Child> = (0..2)
        .map(|m| hosts.launch(m, "late", &token, &extra))
        .collect();
    for launcher in &mut launchers {
        wait_for(launcher, "READY", 2);
    }
    // Host 1's end of the link goes down: from host 0, host 1 simply stops answering.
    hosts.ip(1, &["link", "set", "veth1", "down"]);
    let cut = Instant::now();
    let results: Vec<_> = launchers
        .into_iter()
        .map(|l| finish(l, Duration::from_secs(60)))
        .collect();
    let took = cut.elapsed();
    println!("from the cut to the last launcher's exit: {took:?}");
    // 2 s of "compute", then the 6 s heartbeat, against a 300 s collective timeout.
    assert!(took < Duration::from_secs(20), "took {took:?}");
    for (machine, (code, _, stderr)) in results.iter().enumerate() {
        assert_ne!(*code, 0, "machine {machine}: {stderr}");
        assert!(stderr.contains("barrier"), "machine {machine}: {stderr}");
    }
    let all: String = results.iter().map(|r| r.2.clone()).collect();
    assert!(all.contains("no sign of life from its host"), "{all}");
    assert_eq!(hosts.leftovers(0), "");
    assert_eq!(hosts.leftovers(1), "");
}

#[test]
fn killing_every_process_of_one_host_fails_the_other_naming_them() {
    let Some(hosts) = TwoHosts::new("kill") else {
        return;
    };
    let token = format!("kill-{}", std::process::id());
    let mut launchers: Vec<Child> = (0..2)
        .map(|m| hosts.launch(m, "late", &token, &[]))
        .collect();
    for launcher in &mut launchers {
        wait_for(launcher, "READY", 2);
    }
    let status = Command::new("sh")
        .args([
            "-c",
            &format!("ip netns pids {} | xargs kill -9", hosts.namespaces[1]),
        ])
        .status()
        .unwrap();
    assert!(status.success());
    let killed = Instant::now();
    let (code, _, stderr) = finish(launchers.remove(0), Duration::from_secs(60));
    // Their 2 s of "compute", then at once: the kernel closed the dead processes' sockets.
    assert!(
        killed.elapsed() < Duration::from_secs(10),
        "{:?}",
        killed.elapsed()
    );
    assert_eq!(code, 3, "{stderr}");
    assert!(
        stderr.contains("rank 2") || stderr.contains("rank 3"),
        "{stderr}"
    );
    let _ = finish(launchers.remove(0), Duration::from_secs(10));
    assert_eq!(hosts.leftovers(0), "");
}

#[test]
fn a_wrong_or_missing_token_from_the_other_host_is_refused_at_start() {
    let Some(hosts) = TwoHosts::new("token") else {
        return;
    };
    // No token at all: the launcher refuses before starting anything, with the fix.
    let (code, _, stderr) = finish(hosts.launch(1, "train", "", &[]), Duration::from_secs(30));
    assert_ne!(code, 0);
    assert!(stderr.contains("openssl rand -hex 16"), "{stderr}");
    assert_eq!(stderr.trim().lines().count(), 1, "{stderr}");
    let extra = [("ACCELERATE_RENDEZVOUS_TIMEOUT", "4")];
    let host0 = hosts.launch(0, "train", "the-token", &extra);
    let host1 = hosts.launch(1, "train", "another-token", &extra);
    let (code1, _, stderr1) = finish(host1, Duration::from_secs(30));
    let (code0, _, stderr0) = finish(host0, Duration::from_secs(30));
    assert_ne!(code1, 0);
    assert!(
        stderr1.contains("did not accept this rank's job token"),
        "{stderr1}"
    );
    assert_ne!(code0, 0);
    assert!(stderr0.contains("failed to authenticate"), "{stderr0}");
}

/// All-reduce over the two hosts, flat TCP against hierarchical (shared memory inside each
/// host; along rails, and through each host's leader), and with `--features mpi` the MPI
/// engine, 2 x 2 ranks: `cargo test -p accelerate-cli --test two_hosts -- --ignored --nocapture`
/// (root).
#[test]
#[ignore = "a benchmark: prints figures, asserts nothing"]
fn flat_against_hierarchical_all_reduce() {
    let Some(hosts) = TwoHosts::new("bench") else {
        return;
    };
    let ways = [
        ("flat", vec![("ACCELERATE_HIERARCHICAL", "false")]),
        ("rails", vec![("ACCELERATE_HIERARCHICAL", "true")]),
        (
            "leaders",
            vec![("ACCELERATE_HIERARCHICAL", "true"), ("TEST_BENCH_ODD", "1")],
        ),
    ];
    for round in 0..2 {
        for (way, extra) in &ways {
            let token = format!("bench-{}-{round}-{way}", std::process::id());
            let launchers: Vec<Child> = (0..2)
                .map(|m| hosts.launch(m, "bench", &token, extra))
                .collect();
            for launcher in launchers {
                let (code, stdout, stderr) = finish(launcher, Duration::from_secs(600));
                assert_eq!(code, 0, "{stdout}\n{stderr}");
                for line in stdout.lines().filter(|l| l.contains("BENCH")) {
                    println!("round {round} {way}: {line}");
                }
            }
        }
        // The MPI engine over the same link: Open MPI's shared memory inside each host, its
        // TCP between them, its own algorithms (a build with `--features mpi`).
        #[cfg(feature = "mpi")]
        {
            let dir = tempfile::tempdir().unwrap();
            let mut mpirun = hosts.mpirun(2, dir.path()).expect("mpirun");
            let child = mpirun
                .arg(std::env::current_exe().unwrap())
                .args(["worker", "--exact", "--nocapture", "--test-threads=1"])
                .env(SCENARIO, "bench")
                .env("ACCELERATE_TRANSPORT", "mpi")
                // Four ranks spin on this machine's two cores: without yielding, Open MPI
                // waits out scheduler slices (8 ms for 4 KiB). Ours sleep while they wait.
                .env("OMPI_MCA_mpi_yield_when_idle", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped())
                .spawn()
                .unwrap();
            let (code, stdout, stderr) = finish(child, Duration::from_secs(600));
            assert_eq!(code, 0, "{stdout}\n{stderr}");
            for line in stdout.lines().filter(|l| l.contains("BENCH")) {
                println!("round {round} mpi: {line}");
            }
        }
    }
}

#[test]
fn a_host_without_room_in_dev_shm_makes_the_group_all_reduce_flat() {
    let Some(hosts) = TwoHosts::new("full") else {
        return;
    };
    let token = format!("full-{}", std::process::id());
    let slots = ("ACCELERATE_SHM_SLOT_BYTES", "4194304");
    let launchers = [
        hosts.launch(0, "train", &token, &[slots]),
        hosts.launch(1, "train", &token, &[slots, ("SHM_SIZE", "1m")]),
    ];
    let output = both_trained(&hosts, launchers.into(), Duration::from_secs(60), "tcp");
    let warnings = output.matches("shared memory unavailable").count();
    assert_eq!(warnings, 1, "one warning, from the host that has no room");
}
