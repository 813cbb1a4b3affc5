//! A worker's output, relayed line by line with its `[rank N]` prefix: whole lines under the
//! terminal stream's lock, so the lines of several workers never interleave, and the same
//! lines (without the prefix) into the rank's log file when there is one; printed around the
//! launcher's progress bar when it draws one.

use std::fs::File;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

/// Relays one stream of one worker, line by line, with its rank prefix.
pub(super) fn relay(
    stream: impl Read + Send + 'static,
    prefix: String,
    to_stderr: bool,
    log: Option<Arc<Mutex<File>>>,
    bar: indicatif::ProgressBar,
) -> JoinHandle<()> {
    std::thread::spawn(move || {
        let mut reader = BufReader::new(stream);
        let mut line = Vec::new();
        loop {
            line.clear();
            match reader.read_until(b'\n', &mut line) {
                Ok(0) | Err(_) => return,
                Ok(_) => {}
            }
            if line.last() != Some(&b'\n') {
                line.push(b'\n');
            }
            let mut out = Vec::with_capacity(prefix.len() + line.len());
            out.extend_from_slice(prefix.as_bytes());
            out.extend_from_slice(&line);
            // One write of a whole line under the stream's lock: lines never interleave.
            // Around the launcher's progress bar, when it draws one.
            let _ = bar.suspend(|| {
                if to_stderr {
                    std::io::stderr().lock().write_all(&out)
                } else {
                    std::io::stdout().lock().write_all(&out)
                }
            });
            if let Some(log) = &log {
                let _ = log
                    .lock()
                    .unwrap_or_else(PoisonError::into_inner)
                    .write_all(&line);
            }
        }
    })
}
