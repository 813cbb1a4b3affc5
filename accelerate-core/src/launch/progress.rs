//! The progress line of `accelerate-rs launch`: the main process writes its latest update,
//! the total it trains for and its latest metrics into a small JSON file the launcher named
//! (`ACCELERATE_PROGRESS_FILE`, replaced atomically at each report); the launcher reads it a
//! few times a second and shows a bar with the loss, tokens/s and the time left on a terminal,
//! or a line every `ACCELERATE_PROGRESS_EVERY` seconds (default 30) otherwise (a log file, CI).

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use indicatif::{HumanDuration, ProgressBar, ProgressDrawTarget, ProgressStyle};
use serde::{Deserialize, Serialize};

use crate::env_vars;

/// What the main process reports.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Progress {
    /// Updates applied so far.
    pub step: u64,
    /// Updates the run trains for, when the script said.
    pub total: Option<u64>,
    /// The latest value of each metric logged.
    pub metrics: BTreeMap<String, f64>,
}

/// Writes `progress` where the launcher reads it, when this process was given a file (the
/// main process under `accelerate-rs launch`); otherwise does nothing. Failures are logged at
/// debug level only: progress is a courtesy, never a reason to stop training.
pub fn report(progress: &Progress) {
    let Some(path) = std::env::var_os(env_vars::PROGRESS_FILE).map(PathBuf::from) else {
        return;
    };
    let written = serde_json::to_vec(progress)
        .map_err(std::io::Error::other)
        .and_then(|bytes| {
            let tmp = path.with_extension("tmp");
            std::fs::write(&tmp, bytes)?;
            std::fs::rename(&tmp, &path)
        });
    if let Err(err) = written {
        tracing::debug!("progress file {}: {err}", path.display());
    }
}

/// The launcher's side: a directory of its own holding the file, and what it shows.
pub(super) struct ProgressDisplay {
    dir: PathBuf,
    bar: ProgressBar,
    /// Lines instead of a bar (not a terminal), at most one per this interval.
    lines_every: Option<Duration>,
    last_line: Option<Instant>,
    last_read: Instant,
    shown: Option<Progress>,
    /// The first report seen and when: the rate for the time left.
    first: Option<(Instant, u64)>,
}

impl ProgressDisplay {
    /// A display reading from a fresh directory under the system's temporary directory.
    pub(super) fn new(is_terminal: bool) -> std::io::Result<Self> {
        let stamp = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map_or(0, |d| d.as_nanos());
        let dir = std::env::temp_dir().join(format!(
            "accelerate-rs-progress-{}-{stamp}",
            std::process::id()
        ));
        std::fs::create_dir(&dir)?;
        let lines_every = (!is_terminal).then(|| {
            std::env::var(env_vars::PROGRESS_EVERY)
                .ok()
                .and_then(|s| s.trim().parse::<f64>().ok())
                .filter(|s| s.is_finite() && *s >= 0.0)
                .map_or(Duration::from_secs(30), Duration::from_secs_f64)
        });
        let bar = if is_terminal {
            let bar = ProgressBar::with_draw_target(None, ProgressDrawTarget::stderr());
            if let Ok(style) = ProgressStyle::with_template("{bar:30} {msg}") {
                bar.set_style(style);
            }
            bar
        } else {
            ProgressBar::hidden()
        };
        Ok(Self {
            dir,
            bar,
            lines_every,
            last_line: None,
            last_read: Instant::now(),
            shown: None,
            first: None,
        })
    }

    /// The file the main process writes (its `ACCELERATE_PROGRESS_FILE`).
    pub(super) fn file(&self) -> PathBuf {
        self.dir.join("progress.json")
    }

    /// The bar, for the output relays to print around (hidden when lines are printed).
    pub(super) fn bar(&self) -> ProgressBar {
        self.bar.clone()
    }

    /// Reads the file (at most four times a second) and shows what changed.
    pub(super) fn poll(&mut self) {
        if self.last_read.elapsed() < Duration::from_millis(250) {
            return;
        }
        self.last_read = Instant::now();
        self.read_and_show(false);
    }

    fn read_and_show(&mut self, last: bool) {
        let Some(progress) = read(&self.file()) else {
            return;
        };
        let now = Instant::now();
        let (since, first_step) = *self.first.get_or_insert((now, progress.step));
        let done = progress.step.saturating_sub(first_step);
        let left = progress.total.and_then(|total| {
            let per_step = now
                .duration_since(since)
                .checked_div(u32::try_from(done).ok()?)?;
            per_step.checked_mul(u32::try_from(total.saturating_sub(progress.step)).ok()?)
        });
        let message = describe(&progress, left);
        match self.lines_every {
            None => {
                if let Some(total) = progress.total {
                    self.bar.set_length(total);
                }
                self.bar.set_position(progress.step);
                self.bar.set_message(message);
            }
            Some(every) => {
                let changed = self.shown.as_ref() != Some(&progress);
                let due = self.last_line.is_none_or(|at| at.elapsed() >= every);
                if changed && (due || last) {
                    eprintln!("[progress] {message}");
                    self.last_line = Some(now);
                }
            }
        }
        self.shown = Some(progress);
    }

    /// Shows the last report (a line even if one was printed recently) and removes the file.
    pub(super) fn finish(mut self) {
        self.read_and_show(true);
        self.bar.finish_and_clear();
    }
}

impl Drop for ProgressDisplay {
    fn drop(&mut self) {
        // Only what this display created: its file, the temporary one, its directory.
        let _ = std::fs::remove_file(self.file());
        let _ = std::fs::remove_file(self.file().with_extension("tmp"));
        let _ = std::fs::remove_dir(&self.dir);
    }
}

fn read(path: &Path) -> Option<Progress> {
    serde_json::from_slice(&std::fs::read(path).ok()?).ok()
}

/// "step 40/100 (40 %): train/loss 2.3100, 4100 tokens/s, 1 minute left" (the step `acc.log`
/// was given: updates in the transformer example, epochs in digits).
fn describe(progress: &Progress, left: Option<Duration>) -> String {
    let mut parts = Vec::new();
    let mut head = format!("step {}", progress.step);
    if let Some(total) = progress.total.filter(|t| *t > 0) {
        let percent = progress.step.saturating_mul(100) / total;
        head = format!("step {}/{total} ({percent} %)", progress.step);
    }
    // Losses by that name first ("train/loss", "validation/loss"), then any other loss.
    let is_loss = |n: &str| n.rsplit('/').next() == Some("loss");
    let named = progress.metrics.iter().filter(|(n, _)| is_loss(n));
    let other = (progress.metrics.iter()).filter(|(n, _)| !is_loss(n) && n.contains("loss"));
    for (name, value) in named.chain(other).take(2) {
        parts.push(format!("{name} {value:.4}"));
    }
    let rate = ["perf/tokens_per_s", "perf/samples_per_s"]
        .iter()
        .find_map(|name| progress.metrics.get_key_value(*name))
        .or_else(|| {
            progress
                .metrics
                .iter()
                .find(|(n, _)| n.ends_with("tokens_per_s") || n.ends_with("samples_per_s"))
        });
    if let Some((name, value)) = rate {
        let unit = if name.ends_with("tokens_per_s") {
            "tokens/s"
        } else {
            "samples/s"
        };
        parts.push(format!("{value:.0} {unit}"));
    }
    if let Some(left) = left.filter(|_| progress.total.is_some_and(|t| progress.step < t)) {
        parts.push(format!("{} left", HumanDuration(left)));
    }
    if parts.is_empty() {
        head
    } else {
        format!("{head}: {}", parts.join(", "))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_report_reads_as_a_line_with_loss_rate_and_time_left() {
        let progress = Progress {
            step: 40,
            total: Some(100),
            metrics: [
                ("train/loss".to_string(), 2.31),
                ("validation/ema_loss".to_string(), 2.5),
                ("validation/loss".to_string(), 2.4),
                ("train/tokens_per_s".to_string(), 4000.0),
                ("perf/tokens_per_s".to_string(), 4100.4),
                ("memory/peak_resident_bytes".to_string(), 1e9),
            ]
            .into_iter()
            .collect(),
        };
        assert_eq!(
            describe(&progress, Some(Duration::from_secs(90))),
            "step 40/100 (40 %): train/loss 2.3100, validation/loss 2.4000, 4100 tokens/s, 2 \
             minutes left"
        );
        let bare = Progress {
            step: 3,
            total: None,
            metrics: BTreeMap::new(),
        };
        assert_eq!(describe(&bare, None), "step 3");
    }
}
