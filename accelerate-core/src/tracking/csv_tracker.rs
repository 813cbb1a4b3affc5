//! The CSV tracker: `metrics.csv` in the log directory, in long form (`step,metric,value,
//! time_s`, one row per value, so metrics may come and go between steps), written and
//! flushed as each value arrives; a resumed run appends to it.

use std::fs::File;
use std::path::{Path, PathBuf};
use std::time::Instant;

use super::{GeneralTracker, RunInfo, RunStatus, TrackerError};

/// Name of the CSV file in the log directory.
pub const CSV_FILE: &str = "metrics.csv";

/// Writes `metrics.csv` in one directory.
pub struct CsvTracker {
    path: PathBuf,
    writer: csv::Writer<File>,
    started: Instant,
}

impl CsvTracker {
    /// Opens `dir/metrics.csv` (the directory is created if needed; an existing file is
    /// appended to, without a second header).
    pub fn create(dir: &Path) -> Result<Self, TrackerError> {
        let path = dir.join(CSV_FILE);
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TrackerError::Io {
                tracker: "csv".into(),
                path,
                source,
            }
        };
        std::fs::create_dir_all(dir).map_err(io(dir))?;
        let fresh = !path.exists();
        let file = crate::output_file::append(&path).map_err(io(&path))?;
        let mut tracker = Self {
            writer: csv::Writer::from_writer(file),
            path,
            started: Instant::now(),
        };
        if fresh {
            tracker.write(|w| w.write_record(["step", "metric", "value", "time_s"]))?;
        }
        Ok(tracker)
    }

    /// Writes with `f`, then flushes.
    fn write(
        &mut self,
        f: impl FnOnce(&mut csv::Writer<File>) -> csv::Result<()>,
    ) -> Result<(), TrackerError> {
        let failed = |source: std::io::Error| TrackerError::Io {
            tracker: "csv".into(),
            path: self.path.clone(),
            source,
        };
        f(&mut self.writer).map_err(|e| failed(e.into()))?;
        self.writer.flush().map_err(failed)
    }
}

impl GeneralTracker for CsvTracker {
    fn name(&self) -> &str {
        "csv"
    }

    fn start(&mut self, _run: &RunInfo) -> Result<(), TrackerError> {
        Ok(())
    }

    fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), TrackerError> {
        let time = format!("{:.3}", self.started.elapsed().as_secs_f64());
        self.write(|w| {
            for (name, value) in metrics {
                w.write_record([&step.to_string(), *name, &value.to_string(), &time])?;
            }
            Ok(())
        })
    }

    fn finish(&mut self, _status: RunStatus) -> Result<(), TrackerError> {
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rows_are_written_as_values_arrive_and_a_resumed_run_appends() {
        let tmp = tempfile::tempdir().unwrap();
        let mut csv = CsvTracker::create(tmp.path()).unwrap();
        csv.log(1, &[("loss", 0.5), ("lr, base", 1e-3)]).unwrap();
        csv.log(2, &[("loss", 0.25)]).unwrap();
        let text = std::fs::read_to_string(tmp.path().join(CSV_FILE)).unwrap();
        let rows: Vec<&str> = text.lines().collect();
        assert_eq!(rows[0], "step,metric,value,time_s");
        assert!(rows[1].starts_with("1,loss,0.5,"), "{text}");
        assert!(rows[2].starts_with("1,\"lr, base\",0.001,"), "{text}");
        assert!(rows[3].starts_with("2,loss,0.25,"), "{text}");

        drop(csv);
        let mut again = CsvTracker::create(tmp.path()).unwrap();
        again.log(3, &[("loss", 0.125)]).unwrap();
        let text = std::fs::read_to_string(tmp.path().join(CSV_FILE)).unwrap();
        assert_eq!(text.matches("step,metric").count(), 1);
        assert!(text.lines().last().unwrap().starts_with("3,loss,0.125,"));
    }
}
