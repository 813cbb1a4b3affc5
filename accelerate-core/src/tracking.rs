//! Metrics logging for the main process: a CSV file and TensorBoard event files under one
//! log directory, written as each value arrives so a run can be watched while it trains.
//!
//! The CSV is in long form, `step,metric,value,time_s` (one row per value), so metrics may
//! come and go between steps; a resumed run appends to it. TensorBoard gets one event file per
//! run start (`tensorboard --logdir <dir>` merges them by step). The event format is written
//! by the `syntaxdot-summary` crate.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use serde::{Deserialize, Serialize};
use syntaxdot_summary::SummaryWriter;

/// Name of the CSV file in the log directory.
pub const CSV_FILE: &str = "metrics.csv";

/// Where logged metrics go.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Tracker {
    /// `metrics.csv` in the log directory.
    Csv,
    /// TensorBoard event files in the log directory.
    TensorBoard,
}

/// A metrics file could not be written.
#[derive(Debug, thiserror::Error)]
#[error("metrics log {}: {source}", path.display())]
pub struct TrackingError {
    /// The file or directory.
    pub path: PathBuf,
    /// The cause.
    pub source: std::io::Error,
}

/// Writes metrics to the trackers chosen, in one directory.
pub struct MetricsLogger {
    dir: PathBuf,
    csv: Option<csv::Writer<File>>,
    tensorboard: Option<SummaryWriter<File>>,
    started: Instant,
}

impl std::fmt::Debug for MetricsLogger {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MetricsLogger")
            .field("dir", &self.dir)
            .field("csv", &self.csv.is_some())
            .field("tensorboard", &self.tensorboard.is_some())
            .finish()
    }
}

impl MetricsLogger {
    /// Opens the trackers in `dir` (created if needed; an existing CSV is appended to).
    pub fn create(dir: impl AsRef<Path>, trackers: &[Tracker]) -> Result<Self, TrackingError> {
        let dir = dir.as_ref().to_path_buf();
        let failed = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TrackingError { path, source }
        };
        std::fs::create_dir_all(&dir).map_err(failed(&dir))?;
        let csv = if trackers.contains(&Tracker::Csv) {
            let path = dir.join(CSV_FILE);
            let fresh = !path.exists();
            let file = crate::output_file::append(&path).map_err(failed(&path))?;
            let mut writer = csv::Writer::from_writer(file);
            if fresh {
                writer
                    .write_record(["step", "metric", "value", "time_s"])
                    .map_err(|e| TrackingError {
                        path: path.clone(),
                        source: e.into(),
                    })?;
                writer.flush().map_err(failed(&path))?;
            }
            Some(writer)
        } else {
            None
        };
        let tensorboard = if trackers.contains(&Tracker::TensorBoard) {
            let micros = std::time::SystemTime::now()
                .duration_since(std::time::UNIX_EPOCH)
                .map_or(0, |d| d.as_micros());
            let path = dir.join(format!(
                "events.out.tfevents.{micros}.accelerate-rs.{}",
                std::process::id()
            ));
            let file = crate::output_file::create(&path).map_err(failed(&path))?;
            Some(SummaryWriter::new(file).map_err(failed(&path))?)
        } else {
            None
        };
        Ok(Self {
            dir,
            csv,
            tensorboard,
            started: Instant::now(),
        })
    }

    /// The log directory.
    pub fn dir(&self) -> &Path {
        &self.dir
    }

    /// Records `metrics` at `step` in every tracker, and flushes them.
    pub fn log(&mut self, metrics: &[(&str, f64)], step: u64) -> Result<(), TrackingError> {
        let time = self.started.elapsed().as_secs_f64();
        if let Some(csv) = self.csv.as_mut() {
            let path = self.dir.join(CSV_FILE);
            for (name, value) in metrics {
                csv.write_record([
                    step.to_string(),
                    name.to_string(),
                    value.to_string(),
                    format!("{time:.3}"),
                ])
                .map_err(|e| TrackingError {
                    path: path.clone(),
                    source: e.into(),
                })?;
            }
            csv.flush()
                .map_err(|source| TrackingError { path, source })?;
        }
        if let Some(tb) = self.tensorboard.as_mut() {
            let step = i64::try_from(step).unwrap_or(i64::MAX);
            for (name, value) in metrics {
                tb.write_scalar(*name, step, *value as f32)
                    .map_err(|source| TrackingError {
                        path: self.dir.clone(),
                        source,
                    })?;
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Reads TFRecord framing (length, crc, payload, crc) and returns the payloads.
    fn records(bytes: &[u8]) -> Vec<&[u8]> {
        let mut out = Vec::new();
        let mut at = 0;
        while at + 12 <= bytes.len() {
            let len = u64::from_le_bytes(bytes[at..at + 8].try_into().unwrap()) as usize;
            out.push(&bytes[at + 12..at + 12 + len]);
            at += 12 + len + 4;
        }
        assert_eq!(at, bytes.len(), "trailing bytes");
        out
    }

    #[test]
    fn csv_rows_and_tensorboard_events_are_written_as_values_arrive() {
        let tmp = tempfile::tempdir().unwrap();
        let mut logger =
            MetricsLogger::create(tmp.path(), &[Tracker::Csv, Tracker::TensorBoard]).unwrap();
        logger.log(&[("loss", 0.5), ("lr, base", 1e-3)], 1).unwrap();
        logger.log(&[("loss", 0.25)], 2).unwrap();
        let csv = std::fs::read_to_string(tmp.path().join(CSV_FILE)).unwrap();
        let rows: Vec<&str> = csv.lines().collect();
        assert_eq!(rows[0], "step,metric,value,time_s");
        assert!(rows[1].starts_with("1,loss,0.5,"), "{csv}");
        assert!(rows[2].starts_with("1,\"lr, base\",0.001,"), "{csv}");
        assert!(rows[3].starts_with("2,loss,0.25,"), "{csv}");

        let events: Vec<PathBuf> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| {
                p.file_name()
                    .unwrap()
                    .to_str()
                    .unwrap()
                    .starts_with("events.out.tfevents.")
            })
            .collect();
        assert_eq!(events.len(), 1);
        let bytes = std::fs::read(&events[0]).unwrap();
        let records = records(&bytes);
        // The file-version event, then one event per value.
        assert_eq!(records.len(), 4);
        assert!(records[0].windows(9).any(|w| w == b"brain.Eve"));
        assert!(records[1].windows(4).any(|w| w == b"loss"));
        assert!(records[3].windows(4).any(|w| w == 0.25f32.to_le_bytes()));

        // A resumed run appends to the CSV without a second header.
        drop(logger);
        let mut again = MetricsLogger::create(tmp.path(), &[Tracker::Csv]).unwrap();
        again.log(&[("loss", 0.125)], 3).unwrap();
        let csv = std::fs::read_to_string(tmp.path().join(CSV_FILE)).unwrap();
        assert_eq!(csv.matches("step,metric").count(), 1);
        assert!(csv.lines().last().unwrap().starts_with("3,loss,0.125,"));
    }
}
