//! Starting and supervising the worker processes of one machine (what `accelerate-rs launch`
//! does).
//!
//! Each worker gets the process contract of the architecture: `RANK`, `WORLD_SIZE`,
//! `LOCAL_RANK`, `LOCAL_WORLD_SIZE`, `NODE_RANK`, `MASTER_ADDR`, `MASTER_PORT`, and a job token
//! (`ACCELERATE_JOB_TOKEN`, fresh and random for a single machine). Every line a worker prints
//! is relayed with a `[rank N]` prefix, whole lines at a time, so lines never interleave. When
//! a worker fails, the others are stopped (SIGTERM to each worker's process group, SIGKILL
//! after a grace period) and the launch fails naming the rank and how it ended. A signal that
//! stops the launcher (SIGINT from Ctrl-C, SIGTERM from `timeout`, systemd, Slurm or
//! Kubernetes, SIGHUP from a closed terminal) is forwarded to the workers as the same signal,
//! with the same SIGKILL after the grace period, and the launch ends with 128 + that signal.
//! Each worker runs in its own process group, so the processes it started are stopped with it.

use std::net::TcpListener;
use std::path::PathBuf;
use std::process::{Child, Command, ExitStatus, Stdio};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::launch_settings::LaunchSettings;
use crate::state::contract::{DEFAULT_MASTER_PORT, WorkerIdentity};
#[doc(inline)]
pub use crate::state::follow_launcher;

pub mod progress;
mod relay;

use progress::ProgressDisplay;
use relay::relay;

/// What to start, and how. Its `Debug` output hides the values of variables whose names say
/// they hold a secret (`*TOKEN*`, `*SECRET*`, `*PASSWORD*`, `*KEY*`).
#[derive(Clone)]
pub struct LaunchConfig {
    /// The program each worker runs.
    pub program: PathBuf,
    /// Its arguments.
    pub args: Vec<String>,
    /// The job's shape (processes, machines, rank 0's address; a port of 0 picks a free one,
    /// on one machine only), restarts, and what the workers get (precision, devices).
    pub settings: LaunchSettings,
    /// When set, each rank's output is also written to `rank_N.log` in this directory.
    pub log_dir: Option<PathBuf>,
    /// Extra environment for every worker (configuration such as `ACCELERATE_*`), after the
    /// variables of `settings`.
    pub env: Vec<(String, String)>,
    /// How long stopped workers get between SIGTERM and SIGKILL.
    pub grace: Duration,
    /// Whether the launcher of the main process shows the run's progress (a bar on a
    /// terminal, else a line every `ACCELERATE_PROGRESS_EVERY` seconds) from what the main
    /// process logs.
    pub progress: bool,
}

impl std::fmt::Debug for LaunchConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let secret = |key: &str| {
            let key = key.to_ascii_uppercase();
            ["TOKEN", "SECRET", "PASSWORD", "KEY"]
                .iter()
                .any(|word| key.contains(word))
        };
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| {
                let shown = if secret(k) {
                    crate::comm::secret::REDACTED
                } else {
                    v.as_str()
                };
                (k.as_str(), shown)
            })
            .collect();
        f.debug_struct("LaunchConfig")
            .field("program", &self.program)
            .field("args", &self.args)
            .field("settings", &self.settings)
            .field("log_dir", &self.log_dir)
            .field("env", &env)
            .field("grace", &self.grace)
            .field("progress", &self.progress)
            .finish()
    }
}

impl Default for LaunchConfig {
    fn default() -> Self {
        Self {
            program: PathBuf::new(),
            args: Vec::new(),
            settings: LaunchSettings {
                main_process_port: DEFAULT_MASTER_PORT,
                ..LaunchSettings::default()
            },
            log_dir: None,
            env: Vec::new(),
            grace: Duration::from_secs(5),
            progress: true,
        }
    }
}

/// Why a launch failed.
#[derive(Debug, thiserror::Error)]
pub enum LaunchError {
    /// The options contradict each other.
    #[error("{0}")]
    Config(String),
    /// The rendezvous port is taken.
    #[error(
        "port {port} on {ip} is already in use, so rank 0 could not serve the rendezvous there. \
         hint: pass --main-process-port 0 to pick a free port, or stop what holds it"
    )]
    PortBusy {
        /// The address.
        ip: String,
        /// The port.
        port: u16,
    },
    /// A worker could not be started.
    #[error("could not start rank {rank} ({program}): {source}")]
    Spawn {
        /// The rank.
        rank: usize,
        /// The program.
        program: String,
        /// The system's error.
        source: std::io::Error,
    },
    /// A log file could not be written.
    #[error("log file {path}: {source}")]
    Log {
        /// The file.
        path: PathBuf,
        /// The system's error.
        source: std::io::Error,
    },
    /// A worker failed; the others were stopped.
    #[error("rank {rank} (pid {pid}) {how}; the other workers were stopped")]
    WorkerFailed {
        /// The first rank that failed.
        rank: usize,
        /// Its process id.
        pid: u32,
        /// "exited with status 1", "was killed by signal 9 (SIGKILL)".
        how: String,
        /// The exit code to pass on (128 + signal for a signal).
        code: i32,
    },
    /// The launcher received a signal that stops it; the workers got the same signal and
    /// were stopped.
    #[error("interrupted by {}; the workers were stopped", signal_name(*signal))]
    Interrupted {
        /// The signal's number.
        signal: i32,
    },
}

impl LaunchError {
    /// The exit code `accelerate-rs launch` ends with.
    pub fn exit_code(&self) -> i32 {
        match self {
            LaunchError::WorkerFailed { code, .. } => *code,
            LaunchError::Interrupted { signal } => 128 + signal,
            _ => 1,
        }
    }
}

/// The signal `interrupted` holds, if one arrived.
fn received(interrupted: &AtomicUsize) -> Option<i32> {
    match interrupted.load(Ordering::SeqCst) {
        0 => None,
        signal => Some(i32::try_from(signal).unwrap_or(15)),
    }
}

/// A signal's name (`SIGTERM`), or its number when it has none.
fn signal_name(signal: i32) -> String {
    nix::sys::signal::Signal::try_from(signal)
        .map_or_else(|_| format!("signal {signal}"), |s| s.as_str().to_string())
}

/// Describes how a process ended, and the exit code to pass on.
pub fn describe_exit(status: ExitStatus) -> (String, i32) {
    use std::os::unix::process::ExitStatusExt;
    if let Some(code) = status.code() {
        return (format!("exited with status {code}"), code);
    }
    let signal = status.signal().unwrap_or(0);
    let name = nix::sys::signal::Signal::try_from(signal)
        .map(|s| format!(" ({})", s.as_str()))
        .unwrap_or_default();
    (format!("was killed by signal {signal}{name}"), 128 + signal)
}

/// A fresh job token: 128 bits from the operating system's generator.
fn fresh_token() -> Result<String, LaunchError> {
    let bytes: [u8; 16] = crate::comm::auth::random_bytes()
        .map_err(|e| LaunchError::Config(format!("cannot draw a job token: {e}")))?;
    Ok(crate::comm::secret::hex(&bytes))
}

struct Worker {
    rank: usize,
    child: Child,
    relays: Vec<JoinHandle<()>>,
}

fn signal_group(pid: u32, signal: nix::sys::signal::Signal) {
    let pgid = nix::unistd::Pid::from_raw(pid as i32);
    let _ = nix::sys::signal::killpg(pgid, signal);
}

impl LaunchConfig {
    /// The job token set for the workers or in the launcher's environment, if any.
    fn given_token(&self) -> Option<String> {
        self.env
            .iter()
            .find(|(k, _)| k == crate::env_vars::JOB_TOKEN)
            .map(|(_, v)| v.clone())
            .or_else(|| std::env::var(crate::env_vars::JOB_TOKEN).ok())
            .filter(|t| !t.is_empty())
    }

    fn validate(&self) -> Result<(), LaunchError> {
        if self.settings.num_processes == 0 {
            return Err(LaunchError::Config(
                "--num-processes must be at least 1".into(),
            ));
        }
        if self
            .settings
            .num_processes
            .checked_mul(self.settings.num_machines)
            .is_none_or(|world| world > crate::state::MAX_WORLD_SIZE)
        {
            return Err(LaunchError::Config(format!(
                "{} processes on each of {} machines is more than the {} ranks a job may have",
                self.settings.num_processes,
                self.settings.num_machines,
                crate::state::MAX_WORLD_SIZE
            )));
        }
        if self.settings.num_machines == 0
            || self.settings.machine_rank >= self.settings.num_machines
        {
            return Err(LaunchError::Config(format!(
                "--machine-rank {} must be below --num-machines {}",
                self.settings.machine_rank, self.settings.num_machines
            )));
        }
        if self.settings.num_machines > 1 && self.settings.main_process_port == 0 {
            return Err(LaunchError::Config(
                "--main-process-port 0 (pick a free port) works on one machine only: every \
                 machine must be given rank 0's port"
                    .into(),
            ));
        }
        if self.settings.num_machines > 1 && self.given_token().is_none() {
            return Err(LaunchError::Config(format!(
                "a job on {} machines needs the same secret on every machine, and {var} is not \
                 set. hint: `export {var}=$(openssl rand -hex 16)` and copy that value to every \
                 machine",
                self.settings.num_machines,
                var = crate::env_vars::JOB_TOKEN
            )));
        }
        Ok(())
    }

    /// The port rank 0 will serve on: a free one for 0, else the given one after checking
    /// (on rank 0's machine) that it is free.
    fn rendezvous_port(&self) -> Result<u16, LaunchError> {
        if self.settings.main_process_port == 0 {
            return TcpListener::bind((self.settings.main_process_ip.as_str(), 0))
                .and_then(|l| l.local_addr())
                .map(|a| a.port())
                .map_err(|e| {
                    LaunchError::Config(format!(
                        "cannot find a free port on {}: {e}",
                        self.settings.main_process_ip
                    ))
                });
        }
        if self.settings.machine_rank == 0
            && let Err(e) = TcpListener::bind((
                self.settings.main_process_ip.as_str(),
                self.settings.main_process_port,
            ))
            && e.kind() == std::io::ErrorKind::AddrInUse
        {
            return Err(LaunchError::PortBusy {
                ip: self.settings.main_process_ip.clone(),
                port: self.settings.main_process_port,
            });
        }
        Ok(self.settings.main_process_port)
    }

    fn spawn(
        &self,
        local_rank: usize,
        port: u16,
        token: &str,
        progress: Option<&ProgressDisplay>,
    ) -> Result<Worker, LaunchError> {
        use std::os::unix::process::CommandExt;
        let rank = self.settings.machine_rank * self.settings.num_processes + local_rank;
        let identity = WorkerIdentity {
            rank,
            world_size: self.settings.num_processes * self.settings.num_machines,
            local_rank,
            local_world_size: self.settings.num_processes,
            node_rank: self.settings.machine_rank,
            master_addr: self.settings.main_process_ip.clone(),
            master_port: port,
        };
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args)
            .envs(identity.vars())
            .envs(self.settings.worker_env())
            .envs(self.env.iter().map(|(k, v)| (k, v)))
            .stdin(Stdio::null())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            // Its own process group: what the worker starts is stopped with it, and a
            // terminal's Ctrl-C reaches the launcher, which forwards it.
            .process_group(0);
        if let Some(progress) = progress.filter(|_| rank == 0) {
            cmd.env(crate::env_vars::PROGRESS_FILE, progress.file());
        }
        cmd.env(crate::env_vars::JOB_TOKEN, token).env(
            crate::env_vars::LAUNCHER_PID,
            std::process::id().to_string(),
        );
        let mut child = cmd.spawn().map_err(|source| LaunchError::Spawn {
            rank,
            program: self.program.display().to_string(),
            source,
        })?;
        let log = match &self.log_dir {
            Some(dir) => {
                let path = dir.join(format!("rank_{rank}.log"));
                let file = std::fs::create_dir_all(dir)
                    .and_then(|()| crate::output_file::create(&path))
                    .map_err(|source| LaunchError::Log { path, source })?;
                Some(Arc::new(Mutex::new(file)))
            }
            None => None,
        };
        let prefix = format!("[rank {rank}] ");
        let bar = progress.map_or_else(indicatif::ProgressBar::hidden, ProgressDisplay::bar);
        let mut relays = Vec::new();
        if let Some(out) = child.stdout.take() {
            relays.push(relay(out, prefix.clone(), false, log.clone(), bar.clone()));
        }
        if let Some(err) = child.stderr.take() {
            relays.push(relay(err, prefix, true, log, bar));
        }
        Ok(Worker {
            rank,
            child,
            relays,
        })
    }

    /// Starts the workers once and supervises them until all succeed, one fails, or
    /// `interrupted` holds a signal number (0: none).
    fn run_once(&self, interrupted: &AtomicUsize) -> Result<(), LaunchError> {
        let port = self.rendezvous_port()?;
        // One machine: a fresh token. Several: each machine's launcher must present the same
        // one, so it comes from the environment (checked in `validate`).
        let token = match self.given_token() {
            Some(token) if self.settings.num_machines > 1 => token,
            _ => fresh_token()?,
        };
        // The launcher of the main process shows its progress.
        let mut progress = None;
        if self.progress && self.settings.machine_rank == 0 {
            use std::io::IsTerminal;
            match ProgressDisplay::new(std::io::stderr().is_terminal()) {
                Ok(display) => progress = Some(display),
                Err(err) => tracing::debug!("no progress display: {err}"),
            }
        }
        let mut workers = Vec::with_capacity(self.settings.num_processes);
        for local_rank in 0..self.settings.num_processes {
            match self.spawn(local_rank, port, &token, progress.as_ref()) {
                Ok(worker) => workers.push(worker),
                Err(e) => {
                    self.stop(&mut workers, nix::sys::signal::Signal::SIGTERM);
                    return Err(e);
                }
            }
        }
        let mut running: Vec<bool> = vec![true; workers.len()];
        let outcome = loop {
            if let Some(signal) = received(interrupted) {
                break Err(LaunchError::Interrupted { signal });
            }
            let mut failure = None;
            for (i, worker) in workers.iter_mut().enumerate() {
                if !running[i] {
                    continue;
                }
                if let Ok(Some(status)) = worker.child.try_wait() {
                    running[i] = false;
                    if !status.success() && failure.is_none() {
                        let (how, code) = describe_exit(status);
                        failure = Some(LaunchError::WorkerFailed {
                            rank: worker.rank,
                            pid: worker.child.id(),
                            how,
                            code,
                        });
                    }
                }
            }
            if let Some(failure) = failure {
                break Err(failure);
            }
            if running.iter().all(|r| !r) {
                break Ok(());
            }
            if let Some(progress) = progress.as_mut() {
                progress.poll();
            }
            std::thread::sleep(Duration::from_millis(20));
        };
        if let Some(progress) = progress {
            progress.finish();
        }
        // A signal to the launcher is passed on as itself; a failure stops the others politely.
        let signal = match &outcome {
            Err(LaunchError::Interrupted { signal }) => nix::sys::signal::Signal::try_from(*signal)
                .unwrap_or(nix::sys::signal::Signal::SIGTERM),
            _ => nix::sys::signal::Signal::SIGTERM,
        };
        self.stop(&mut workers, signal);
        outcome
    }

    /// Stops every worker still running (`signal`, then SIGKILL after the grace period),
    /// clears their process groups, and waits for their output to drain.
    fn stop(&self, workers: &mut [Worker], signal: nix::sys::signal::Signal) {
        for worker in workers.iter_mut() {
            if matches!(worker.child.try_wait(), Ok(None)) {
                signal_group(worker.child.id(), signal);
            }
        }
        let deadline = crate::wait::deadline_after(self.grace);
        while Instant::now() < deadline
            && workers
                .iter_mut()
                .any(|w| matches!(w.child.try_wait(), Ok(None)))
        {
            std::thread::sleep(Duration::from_millis(20));
        }
        for worker in workers.iter_mut() {
            // Whatever is left of the group (the worker, or processes it started) goes now.
            signal_group(worker.child.id(), nix::sys::signal::Signal::SIGKILL);
            let _ = worker.child.wait();
        }
        for worker in workers.iter_mut() {
            for relay in worker.relays.drain(..) {
                let _ = relay.join();
            }
        }
    }
}

/// Runs the job: starts the workers, supervises them, and restarts the whole group up to
/// `max_restarts` times after a failure.
///
/// `interrupted` is set by the caller's signal handlers to the number of a signal that should
/// stop the job (0 while none has arrived).
pub fn launch(config: &LaunchConfig, interrupted: &AtomicUsize) -> Result<(), LaunchError> {
    config.validate()?;
    let mut attempt = 0;
    loop {
        match config.run_once(interrupted) {
            Err(LaunchError::WorkerFailed { rank, how, .. })
                if attempt < config.settings.max_restarts && received(interrupted).is_none() =>
            {
                attempt += 1;
                tracing::warn!(
                    "accelerate-rs launch: rank {rank} {how}; restarting every worker \
                     (restart {attempt} of {})",
                    config.settings.max_restarts
                );
            }
            outcome => return outcome,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exits_are_described_with_their_code() {
        use std::os::unix::process::ExitStatusExt;
        assert_eq!(
            describe_exit(ExitStatus::from_raw(1 << 8)),
            ("exited with status 1".into(), 1)
        );
        assert_eq!(
            describe_exit(ExitStatus::from_raw(9)),
            ("was killed by signal 9 (SIGKILL)".into(), 137)
        );
    }

    #[test]
    fn tokens_are_fresh() {
        assert_ne!(fresh_token().unwrap(), fresh_token().unwrap());
        assert_eq!(fresh_token().unwrap().len(), 32);
    }

    #[test]
    fn contradictory_options_are_refused() {
        let bad = LaunchConfig {
            settings: LaunchSettings {
                num_machines: 2,
                machine_rank: 2,
                ..LaunchConfig::default().settings
            },
            ..LaunchConfig::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("--machine-rank 2")
        );
        let bad = LaunchConfig {
            settings: LaunchSettings {
                num_machines: 2,
                main_process_port: 0,
                ..LaunchConfig::default().settings
            },
            ..LaunchConfig::default()
        };
        assert!(
            bad.validate()
                .unwrap_err()
                .to_string()
                .contains("one machine only")
        );
        if std::env::var(crate::env_vars::JOB_TOKEN).is_err() {
            let bad = LaunchConfig {
                settings: LaunchSettings {
                    num_machines: 2,
                    main_process_port: 29500,
                    ..LaunchConfig::default().settings
                },
                ..LaunchConfig::default()
            };
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains("openssl rand -hex 16"), "{err}");
        }
        let bad = LaunchConfig {
            settings: LaunchSettings {
                num_processes: 0,
                ..LaunchConfig::default().settings
            },
            ..LaunchConfig::default()
        };
        assert!(bad.validate().is_err());
        // From a config file or a flag: a world no job has, or one whose rank numbers overflow,
        // is refused before any worker is spawned or allocated for.
        for (num_processes, num_machines) in
            [(usize::MAX, 2), ((1 << 20) + 1, 1), (1 << 11, 1 << 10)]
        {
            let bad = LaunchConfig {
                settings: LaunchSettings {
                    num_processes,
                    num_machines,
                    main_process_port: 29500,
                    ..LaunchConfig::default().settings
                },
                ..LaunchConfig::default()
            };
            let err = bad.validate().unwrap_err().to_string();
            assert!(err.contains("ranks a job may have"), "{err}");
        }
    }
}
