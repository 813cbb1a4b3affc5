//! The harness of the multi-process tests: the test binary starts copies of itself as the
//! ranks (its `child` test does nothing unless [`SCENARIO`] names one), on 127.0.0.1.

#![allow(dead_code)]

use std::net::TcpListener;
use std::process::{Child, Command, Output, Stdio};

use accelerate_burn::burn;
use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::Tensor;

/// The variable naming the scenario a child process runs.
pub const SCENARIO: &str = "ACCELERATE_TEST_CHILD";

/// The body of a test file's `child` test: runs the scenario that [`SCENARIO`] names with
/// `run` (nothing when it is unset, as under a plain `cargo test`), then exits the process: 0
/// on success, 3 after printing `ERROR <e>` on stderr.
pub fn run_child(run: impl FnOnce(&str) -> anyhow::Result<()>) {
    let Ok(scenario) = std::env::var(SCENARIO) else {
        return;
    };
    if let Err(e) = run(&scenario) {
        eprintln!("ERROR {e}");
        std::process::exit(3);
    }
    std::process::exit(0);
}

/// The number in variable `key` (a scenario's setting), 0 when unset or unparsable.
pub fn env_number<T: std::str::FromStr + Default>(key: &str) -> T {
    std::env::var(key)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or_default()
}

/// Every float parameter of `model`, in visit order.
pub fn parameters<M: Module>(model: &M) -> Vec<f32> {
    struct Collect(Vec<f32>);
    impl ModuleVisitor for Collect {
        fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<D>>) {
            self.0.extend(param.val().into_data().iter::<f32>());
        }
    }
    let mut c = Collect(Vec::new());
    model.visit(&mut c);
    c.0
}

/// Prints `model`'s parameters as hex bit patterns on a `PARAMS` line (read by [`params`]).
pub fn print_params<M: Module>(model: &M) {
    print_params_as("PARAMS", model);
}

/// Prints `model`'s parameters as hex bit patterns on a line starting with `label` (read by
/// [`params_labelled`]).
pub fn print_params_as<M: Module>(label: &str, model: &M) {
    let bits: Vec<String> = parameters(model)
        .iter()
        .map(|v| format!("{:08x}", v.to_bits()))
        .collect();
    println!("{label} {}", bits.join(","));
}

/// The parameters a worker printed with [`print_params_as`] under `label`.
pub fn params_labelled(output: &Output, label: &str) -> Vec<f32> {
    line(output, &format!("{label} "))
        .trim()
        .split(',')
        .map(|h| f32::from_bits(u32::from_str_radix(h, 16).unwrap()))
        .collect()
}

/// Runs `scenario` on `world` processes (or one process without launcher variables) and
/// returns each rank's output.
pub fn run(scenario: &str, world: usize, env: &[(&str, String)]) -> Vec<Output> {
    run_under(&|_| Vec::new(), scenario, world, env)
}

/// As [`run`], rank `r` started by `wrapper(r)` (a program and its arguments, given the
/// rank's command line after them: `prlimit --data=N`, `ip netns exec NS`), or directly when
/// it is empty.
pub fn run_under(
    wrapper: &dyn Fn(usize) -> Vec<String>,
    scenario: &str,
    world: usize,
    env: &[(&str, String)],
) -> Vec<Output> {
    spawn_under(wrapper, scenario, world, env)
        .into_iter()
        .map(|c| c.wait_with_output().unwrap())
        .collect()
}

/// As [`run_under`], without waiting: the ranks' processes, their output piped.
pub fn spawn_under(
    wrapper: &dyn Fn(usize) -> Vec<String>,
    scenario: &str,
    world: usize,
    env: &[(&str, String)],
) -> Vec<Child> {
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    (0..world)
        .map(|rank| {
            let exe = std::env::current_exe().unwrap();
            let wrapper = wrapper(rank);
            let mut cmd = match wrapper.split_first() {
                Some((program, args)) => {
                    let mut cmd = Command::new(program);
                    cmd.args(args).arg(exe);
                    cmd
                }
                None => Command::new(exe),
            };
            cmd.args(["child", "--exact", "--nocapture", "--test-threads=1"])
                .env(SCENARIO, scenario)
                .env("ACCELERATE_TIMEOUT", "60")
                .env("ACCELERATE_RENDEZVOUS_TIMEOUT", "60")
                .env("ACCELERATE_JOB_TOKEN", format!("dp-{port}"))
                .env("RAYON_NUM_THREADS", "1")
                .stdout(Stdio::piped())
                .stderr(Stdio::piped());
            if world > 1 {
                cmd.env("RANK", rank.to_string())
                    .env("WORLD_SIZE", world.to_string())
                    .env("LOCAL_RANK", rank.to_string())
                    .env("LOCAL_WORLD_SIZE", world.to_string())
                    .env("MASTER_ADDR", "127.0.0.1")
                    .env("MASTER_PORT", port.to_string());
            }
            for (k, v) in env {
                cmd.env(k, v);
            }
            cmd.spawn().unwrap()
        })
        .collect()
}

/// `launcher` (torchrun, mpirun, srun) starting this test binary's `scenario` as its ranks:
/// one thread each, collectives bounded in time, and no rendezvous address of ours (the
/// launcher's own environment says where rank 0 is).
pub fn as_ranks<'a>(launcher: &'a mut Command, scenario: &str) -> &'a mut Command {
    launcher
        .arg(std::env::current_exe().unwrap())
        .args(["child", "--exact", "--nocapture", "--test-threads=1"])
        .env(SCENARIO, scenario)
        .env("ACCELERATE_TIMEOUT", "60")
        .env("RAYON_NUM_THREADS", "1")
        .env_remove("MASTER_ADDR")
        .env_remove("MASTER_PORT")
}

/// Runs `scenario` on hosts made of network namespaces: rank `r` in `namespaces[r]`, with the
/// namespace's name as host name (the ranks of one namespace are one host and share memory),
/// numbered on it in rank order; rank 0's host reached at `master`; `env` as for [`run`].
pub fn run_on_hosts(
    namespaces: &[String],
    master: &str,
    scenario: &str,
    env: &[(&str, String)],
) -> Vec<Output> {
    let mut env = env.to_vec();
    env.push(("MASTER_ADDR", master.to_string()));
    let on_host = |rank: usize| {
        let namespace = &namespaces[rank];
        let local_rank = namespaces[..rank]
            .iter()
            .filter(|n| *n == namespace)
            .count();
        let local_world = namespaces.iter().filter(|n| *n == namespace).count();
        (namespace, local_rank, local_world)
    };
    let host = |rank: usize| {
        let (namespace, local_rank, local_world) = on_host(rank);
        let script = format!(
            "hostname {namespace} && export LOCAL_RANK={local_rank} \
             LOCAL_WORLD_SIZE={local_world} && exec \"$0\" \"$@\""
        );
        [
            "ip", "netns", "exec", namespace, "unshare", "--uts", "sh", "-c", &script,
        ]
        .map(String::from)
        .to_vec()
    };
    run_under(&host, scenario, namespaces.len(), &env)
}

/// Every rank of `tcp` (a job across hosts) succeeded, formed our TCP engine and ended with
/// the parameters of the same rank of `shm` (the job on one host), bit for bit.
pub fn assert_tcp_ranks_equal(tcp: &[Output], shm: &[Output]) {
    for (rank, output) in tcp.iter().enumerate() {
        assert!(
            output.status.success(),
            "rank {rank}: {}",
            String::from_utf8_lossy(&output.stderr)
        );
        assert_eq!(line(output, "FORMED "), "tcp", "rank {rank}");
        assert_eq!(param_bits(output), param_bits(&shm[rank]), "rank {rank}");
    }
}

/// The rest of the first line a worker printed starting with `prefix`.
pub fn line(output: &Output, prefix: &str) -> String {
    lines(output, prefix).into_iter().next().unwrap_or_else(|| {
        panic!(
            "no {prefix} line in:\n{}\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    })
}

/// The rest of every line a worker printed starting with `prefix`, in order.
pub fn lines(output: &Output, prefix: &str) -> Vec<String> {
    String::from_utf8_lossy(&output.stdout)
        .lines()
        // The test harness prints "test child ... " in front of the first line.
        .map(|l| l.strip_prefix("test child ... ").unwrap_or(l))
        .filter_map(|l| l.strip_prefix(prefix))
        .map(String::from)
        .collect()
}

/// The largest absolute difference between two parameter lists of the same length.
pub fn largest_difference(ours: &[f32], reference: &[f32]) -> f32 {
    assert_eq!(ours.len(), reference.len(), "parameter counts differ");
    ours.iter()
        .zip(reference)
        .map(|(a, b)| (a - b).abs())
        .fold(0.0_f32, f32::max)
}

/// The parameters a worker printed, as values (for comparisons within a tolerance).
pub fn params(output: &Output) -> Vec<f32> {
    param_bits(output).into_iter().map(f32::from_bits).collect()
}

/// The parameters a worker printed, as bit patterns (for "bit for bit" comparisons, which
/// `==` on floats would blur: 0.0 equals -0.0 and NaN equals nothing).
pub fn param_bits(output: &Output) -> Vec<u32> {
    param_bits_in(&format!("PARAMS {}", line(output, "PARAMS ")))
}

/// The parameters printed in `log` (a worker's output), as bit patterns.
pub fn param_bits_in(log: &str) -> Vec<u32> {
    log.lines()
        .find_map(|l| l.split("PARAMS ").nth(1))
        .unwrap_or_else(|| panic!("no PARAMS line in:\n{log}"))
        .trim()
        .split(',')
        .map(|h| u32::from_str_radix(h, 16).unwrap())
        .collect()
}
