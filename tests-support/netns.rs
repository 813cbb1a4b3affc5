//! Two hosts on one machine for the tests: two network namespaces joined by a veth link, each
//! with its own address. Created by [`TwoHosts::new`] and removed on drop with everything still
//! running in them, also when a test fails. Needs root and iproute2.
//! Included by the test crates of several packages (`#[path]`), hence no crate of its own.

#![allow(dead_code)]

use std::process::Command;

/// Two network namespaces joined by a veth link (`10.x.y.1/24` and `10.x.y.2/24`).
pub struct TwoHosts {
    /// The namespaces' names (`ip netns`).
    pub namespaces: [String; 2],
    /// Each host's address on the link.
    pub addresses: [String; 2],
}

impl TwoHosts {
    /// Creates the two hosts, named after `tag` and this process; `None` (skipped with a
    /// message) without root or iproute2, a failure under CI.
    pub fn new(tag: &str) -> Option<Self> {
        if !super::tools::ready(
            &["ip", "unshare", "nsenter"],
            true,
            "apt-get install iproute2",
        ) {
            return None;
        }
        let id = std::process::id();
        let namespaces = [format!("accrs-{tag}-{id}-a"), format!("accrs-{tag}-{id}-b")];
        let subnet = format!("10.{}.{}", 100 + id % 100, tag.len() * 17 % 250);
        let hosts = Self {
            namespaces,
            addresses: [format!("{subnet}.1"), format!("{subnet}.2")],
        };
        let [a, b] = &hosts.namespaces;
        let [ip_a, ip_b] = &hosts.addresses;
        let script = format!(
            "set -e; ip netns add {a}; ip netns add {b}; \
             ip link add veth0 netns {a} type veth peer name veth1 netns {b}; \
             ip -n {a} addr add {ip_a}/24 dev veth0; ip -n {b} addr add {ip_b}/24 dev veth1; \
             for n in {a} {b}; do ip -n $n link set lo up; done; \
             ip -n {a} link set veth0 up; ip -n {b} link set veth1 up"
        );
        let status = Command::new("sh").args(["-c", &script]).status().unwrap();
        assert!(status.success(), "could not create the two hosts");
        Some(hosts)
    }

    /// The subnet of the link, as Open MPI's `*_if_include` wants it.
    pub fn subnet(&self) -> String {
        let prefix = self.addresses[0].rsplit_once('.').map_or("", |(p, _)| p);
        format!("{prefix}.0/24")
    }

    /// Runs `ip -n <host machine's namespace> args`.
    pub fn ip(&self, machine: usize, args: &[&str]) {
        let status = Command::new("ip")
            .args(["-n", &self.namespaces[machine]])
            .args(args)
            .status()
            .unwrap();
        assert!(status.success(), "ip {args:?}");
    }

    /// Open MPI's `mpirun` on host 0 (host name `accrs-mpi-0`), placing `per_host` ranks on
    /// each host over the link; it starts its daemon on host 1 through an rsh agent (written
    /// into `dir`) that enters host 1's namespace where a cluster would use ssh. `None` without
    /// Open MPI. Add the program and its arguments.
    pub fn mpirun(&self, per_host: usize, dir: &std::path::Path) -> Option<Command> {
        let base = super::tools::mpirun(2 * per_host)?;
        // Open MPI runs `AGENT [options] HOST COMMAND...`; COMMAND is a shell command line.
        let agent = dir.join("rsh-agent.sh");
        let script = format!(
            "#!/bin/sh\nwhile [ \"${{1#-}}\" != \"$1\" ]; do shift; done\nhost=$1; shift\n\
             case $host in {b_ip}) ns={b}; name=accrs-mpi-1;; *) ns={a}; name=accrs-mpi-0;; esac\n\
             exec nsenter --net=/run/netns/$ns unshare --uts sh -c 'hostname \"$0\"; eval \"$1\"' \
             \"$name\" \"$*\"\n",
            a = self.namespaces[0],
            b = self.namespaces[1],
            b_ip = self.addresses[1],
        );
        std::fs::write(&agent, script).unwrap();
        std::fs::set_permissions(&agent, std::os::unix::fs::PermissionsExt::from_mode(0o755))
            .unwrap();
        let subnet = self.subnet();
        let placement = format!(
            "{}:{per_host},{}:{per_host}",
            self.addresses[0], self.addresses[1]
        );
        let mut mpirun = Command::new("nsenter");
        mpirun
            .arg(format!("--net=/run/netns/{}", self.namespaces[0]))
            .args([
                "unshare",
                "--uts",
                "sh",
                "-c",
                "hostname accrs-mpi-0 && exec \"$@\"",
                "sh",
            ])
            .arg(base.get_program())
            .args(base.get_args())
            .args(["-H", &placement, "--mca", "plm_rsh_agent"])
            .arg(&agent)
            .args(["--mca", "oob_tcp_if_include", &subnet])
            .args(["--mca", "btl_tcp_if_include", &subnet]);
        Some(mpirun)
    }

    /// Limits the link to `rate` (`tc`'s notation: `500mbit`) each way with `tc`'s token
    /// bucket filter (`tbf`), so that a test or a benchmark sees what a slower network costs
    /// (`benches/shaped-link.sh` does the same from the shell). Removed with the hosts.
    pub fn shape_link(&self, rate: &str) {
        for (machine, device) in ["veth0", "veth1"].into_iter().enumerate() {
            let status = Command::new("ip")
                .args([
                    "netns",
                    "exec",
                    &self.namespaces[machine],
                    "tc",
                    "qdisc",
                    "add",
                ])
                .args(["dev", device, "root", "tbf", "rate", rate])
                .args(["burst", "256kb", "latency", "100ms"])
                .status()
                .unwrap();
            assert!(
                status.success(),
                "tc could not shape {device} (no sch_tbf?)"
            );
        }
    }

    /// Processes still running in host `machine`'s network namespace.
    pub fn leftovers(&self, machine: usize) -> String {
        let out = Command::new("ip")
            .args(["netns", "pids", &self.namespaces[machine]])
            .output()
            .unwrap();
        String::from_utf8_lossy(&out.stdout).trim().to_string()
    }
}

impl Drop for TwoHosts {
    fn drop(&mut self) {
        for ns in &self.namespaces {
            // Anything left in a namespace goes with it.
            let _ = Command::new("sh")
                .args([
                    "-c",
                    &format!("ip netns pids {ns} | xargs -r kill -9; ip netns del {ns}"),
                ])
                .status();
        }
    }
}
