//! A real MLflow tracking server for tests (`mlflow server`, from PyPI; `.ci/run` installs it
//! in its Python environment), bound to 127.0.0.1 on a free port, over a SQLite store and an
//! artifact folder in the test's own directory, killed with its workers when dropped; and
//! MLflow's own Python client to read runs back.
//! Included by the test crates of several packages (`#[path]`), beside `tools.rs`.

#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// A running `mlflow server`.
pub struct MlflowServer {
    child: Option<Child>,
    dir: PathBuf,
    port: u16,
}

/// A port nobody listens on now (the kernel's choice).
fn free_port() -> u16 {
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.local_addr().unwrap().port()
}

impl MlflowServer {
    /// Starts a server keeping its store in `dir`, once it answers `/health` (or `None`, when
    /// this machine has no `mlflow`: see `tools::ready`).
    pub fn start(dir: &Path) -> Option<Self> {
        if !super::tools::ready(&["mlflow"], false, "pip install mlflow") {
            return None;
        }
        let mut server = Self {
            child: None,
            dir: dir.to_path_buf(),
            port: free_port(),
        };
        server.restart();
        Some(server)
    }

    /// `http://127.0.0.1:<port>`.
    pub fn uri(&self) -> String {
        format!("http://127.0.0.1:{}", self.port)
    }

    /// Kills the server and its workers (the store stays).
    pub fn kill(&mut self) {
        if let Some(mut child) = self.child.take() {
            // The server's workers share its process group.
            let group = format!("-{}", child.id());
            let _ = Command::new("kill").args(["-KILL", "--", &group]).status();
            let _ = child.wait();
        }
    }

    /// Starts the server again on the same port and store, and waits until it answers.
    pub fn restart(&mut self) {
        use std::os::unix::process::CommandExt;
        self.kill();
        let db = format!("sqlite:///{}", self.dir.join("mlflow.db").display());
        let log = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(self.dir.join("server.log"))
            .unwrap();
        let child = Command::new("mlflow")
            .args(["server", "--host", "127.0.0.1", "--workers", "1"])
            .args(["--port", &self.port.to_string(), "--backend-store-uri", &db])
            .arg("--artifacts-destination")
            .arg(self.dir.join("artifacts"))
            // Its own directory: Python imports from the working directory first.
            .current_dir(&self.dir)
            .stdin(Stdio::null())
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .process_group(0)
            .spawn()
            .unwrap();
        self.child = Some(child);
        let deadline = Instant::now() + Duration::from_secs(120);
        while !self.healthy() {
            assert!(
                Instant::now() < deadline,
                "mlflow server did not answer within 120 s: {}",
                std::fs::read_to_string(self.dir.join("server.log")).unwrap_or_default()
            );
            std::thread::sleep(Duration::from_millis(200));
        }
    }

    fn healthy(&self) -> bool {
        use std::io::{Read, Write};
        let Ok(mut stream) = std::net::TcpStream::connect(("127.0.0.1", self.port)) else {
            return false;
        };
        let _ = stream.set_read_timeout(Some(Duration::from_secs(5)));
        let request = "GET /health HTTP/1.0\r\nHost: 127.0.0.1\r\n\r\n";
        let mut answer = String::new();
        stream.write_all(request.as_bytes()).is_ok()
            && stream.read_to_string(&mut answer).is_ok()
            && answer.starts_with("HTTP/1.1 200")
    }

    /// Runs `script` with MLflow's Python client pointed at this server and returns its
    /// standard output (the script prints JSON).
    pub fn python(&self, script: &str) -> String {
        let out = Command::new("python3")
            .args(["-c", script])
            .env("MLFLOW_TRACKING_URI", self.uri())
            .current_dir(&self.dir)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "python: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        String::from_utf8(out.stdout).unwrap()
    }
}

impl Drop for MlflowServer {
    fn drop(&mut self) {
        self.kill();
    }
}
