//! A throw-away Slurm cluster for tests (`scripts/slurm-cluster.sh`): started in a directory of
//! its own, stopped (and any namespaces it created removed) on drop, also when a test fails.
//! Included by the test crates of several packages (`#[path]`); check `tools::slurm_ready`
//! first.

#![allow(dead_code)]

use std::path::PathBuf;
use std::process::Command;

const SCRIPT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/../scripts/slurm-cluster.sh");

/// A running cluster.
pub struct SlurmCluster {
    dir: tempfile::TempDir,
}

impl SlurmCluster {
    /// Starts a cluster of `nodes` (`NAME=NETNS=IP` each; none: one node, this host) with
    /// `cpus` CPUs a node, and waits until every node is idle.
    pub fn start(cpus: usize, nodes: &[String]) -> Self {
        let dir = tempfile::Builder::new()
            .prefix("accrs-slurm-")
            .tempdir()
            .unwrap();
        let port = || {
            let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
            l.local_addr().unwrap().port().to_string()
        };
        let out = Command::new("bash")
            .arg(SCRIPT)
            .arg("start")
            .arg(dir.path())
            .args([port(), port(), cpus.to_string()])
            .args(nodes)
            .output()
            .unwrap();
        // Built before the check, so that a failed start is cleaned up too.
        let cluster = Self { dir };
        assert!(
            out.status.success(),
            "the Slurm cluster did not start: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        cluster
    }

    /// `args` on the first node against this cluster, run in its directory, without the job
    /// variables of the test's own environment.
    pub fn run(&self, args: &[&str]) -> Command {
        let mut cmd = Command::new("bash");
        cmd.arg(SCRIPT)
            .arg("run")
            .arg(self.dir.path())
            .args(args)
            .env_remove("ACCELERATE_JOB_TOKEN")
            .env_remove("MASTER_ADDR")
            .env_remove("MASTER_PORT")
            .current_dir(self.dir.path());
        cmd
    }

    /// `srun` across `nodes` nodes with `per_node` tasks on each, for at most 5 minutes, as
    /// [`run`](Self::run) starts it.
    pub fn srun(&self, nodes: usize, per_node: usize) -> Command {
        let total = nodes * per_node;
        let (nodes, total, per_node) = (nodes.to_string(), total.to_string(), per_node.to_string());
        self.run(&[
            "srun",
            "-N",
            &nodes,
            "-n",
            &total,
            "--ntasks-per-node",
            &per_node,
            "--time",
            "5",
        ])
    }

    /// A file in the cluster's directory.
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }
}

impl Drop for SlurmCluster {
    fn drop(&mut self) {
        let _ = Command::new("bash")
            .arg(SCRIPT)
            .arg("stop")
            .arg(self.dir.path())
            .status();
    }
}
