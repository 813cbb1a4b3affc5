//! The TensorBoard tracker: one event file per run start in the log directory (`tensorboard
//! --logdir <dir>` merges them by step), holding scalars, texts (the text dashboard) and the
//! run's configuration with its end status (the hparams dashboard, whose metric columns
//! TensorBoard fills from the scalars beside it).

use std::fs::File;
use std::io::BufWriter;
use std::path::{Path, PathBuf};
use std::time::SystemTime;

use prost::Message;

use super::event_file::{
    self, DT_FLOAT, DT_STRING, Event, HParamsPluginData, Kind, PluginData, ProtoValue, Session,
    SessionEndInfo, SessionStartInfo, Summary, SummaryMetadata, TensorProto, TensorShape, Value,
    What,
};
use super::{ConfigValue, GeneralTracker, RunInfo, RunStatus, TrackerError};

/// Writes TensorBoard event files in one directory.
pub struct TensorBoardTracker {
    dir: PathBuf,
    file: Option<(PathBuf, BufWriter<File>)>,
}

impl TensorBoardTracker {
    /// A tracker whose event file is created in `dir` when the run starts.
    pub fn new(dir: &Path) -> Self {
        Self {
            dir: dir.to_path_buf(),
            file: None,
        }
    }

    /// Writes `what` at `step` and flushes, so the dashboard shows it at once.
    fn write(&mut self, step: u64, what: What) -> Result<(), TrackerError> {
        let Some((path, out)) = self.file.as_mut() else {
            return Err(TrackerError::Config {
                tracker: "tensorboard".into(),
                what: "a value was logged before the run started".into(),
                hint: "start the run first",
            });
        };
        let event = Event {
            wall_time: now_secs(),
            step: i64::try_from(step).unwrap_or(i64::MAX),
            what: Some(what),
        };
        let result = event_file::write_event(out, &event).and_then(|()| {
            use std::io::Write;
            out.flush()
        });
        result.map_err(|source| TrackerError::Io {
            tracker: "tensorboard".into(),
            path: path.clone(),
            source,
        })
    }

    fn write_session(&mut self, tag: &str, session: Session) -> Result<(), TrackerError> {
        let content = HParamsPluginData {
            version: 0,
            data: Some(session),
        };
        let value = Value {
            tag: tag.into(),
            // What TensorBoard's own hparams summaries carry: a float scalar placeholder.
            tensor: Some(TensorProto {
                dtype: DT_FLOAT,
                tensor_shape: Some(TensorShape {}),
                float_val: vec![0.0],
                string_val: Vec::new(),
            }),
            metadata: Some(plugin("hparams", content.encode_to_vec())),
            simple_value: None,
        };
        self.write(0, What::Summary(Summary { value: vec![value] }))
    }
}

fn plugin(name: &str, content: Vec<u8>) -> SummaryMetadata {
    SummaryMetadata {
        plugin_data: Some(PluginData {
            plugin_name: name.into(),
            content,
        }),
    }
}

fn now_secs() -> f64 {
    SystemTime::now()
        .duration_since(SystemTime::UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

impl GeneralTracker for TensorBoardTracker {
    fn name(&self) -> &str {
        "tensorboard"
    }

    fn start(&mut self, run: &RunInfo) -> Result<(), TrackerError> {
        let io = |path: &Path| {
            let path = path.to_path_buf();
            move |source| TrackerError::Io {
                tracker: "tensorboard".into(),
                path,
                source,
            }
        };
        std::fs::create_dir_all(&self.dir).map_err(io(&self.dir))?;
        let micros = SystemTime::now()
            .duration_since(SystemTime::UNIX_EPOCH)
            .map_or(0, |d| d.as_micros());
        let path = self.dir.join(format!(
            "events.out.tfevents.{micros}.accelerate-rs.{}.{}",
            std::process::id(),
            run.rank
        ));
        let file = crate::output_file::create(&path).map_err(io(&path))?;
        self.file = Some((path, BufWriter::new(file)));
        self.write(0, What::FileVersion("brain.Event:2".into()))?;
        let hparams = run
            .config
            .iter()
            .map(|(key, value)| {
                let kind = match value {
                    ConfigValue::Bool(b) => Kind::Bool(*b),
                    ConfigValue::Int(i) => Kind::Number(*i as f64),
                    ConfigValue::Float(x) => Kind::Number(*x),
                    ConfigValue::Text(s) => Kind::Text(s.clone()),
                };
                (key.clone(), ProtoValue { kind: Some(kind) })
            })
            .collect();
        let start = SessionStartInfo {
            hparams,
            group_name: run.run_name.clone().unwrap_or_default(),
            start_time_secs: now_secs(),
        };
        self.write_session("_hparams_/session_start_info", Session::Start(start))
    }

    fn log(&mut self, step: u64, metrics: &[(&str, f64)]) -> Result<(), TrackerError> {
        let value = metrics
            .iter()
            .map(|(name, value)| Value {
                tag: (*name).into(),
                simple_value: Some(*value as f32),
                tensor: None,
                metadata: None,
            })
            .collect();
        self.write(step, What::Summary(Summary { value }))
    }

    fn log_text(&mut self, step: u64, name: &str, text: &str) -> Result<(), TrackerError> {
        let value = Value {
            tag: name.into(),
            simple_value: None,
            tensor: Some(TensorProto {
                dtype: DT_STRING,
                tensor_shape: Some(TensorShape {}),
                float_val: Vec::new(),
                string_val: vec![text.as_bytes().to_vec()],
            }),
            metadata: Some(plugin("text", Vec::new())),
        };
        self.write(step, What::Summary(Summary { value: vec![value] }))
    }

    fn finish(&mut self, status: RunStatus) -> Result<(), TrackerError> {
        let end = SessionEndInfo {
            status: if status == RunStatus::Finished { 1 } else { 2 },
            end_time_secs: now_secs(),
        };
        self.write_session("_hparams_/session_end_info", Session::End(end))?;
        self.file = None;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scalars_texts_and_hparams_are_events_tensorboard_reads() {
        let tmp = tempfile::tempdir().unwrap();
        let mut tb = TensorBoardTracker::new(tmp.path());
        let mut run = RunInfo::new("p");
        run.set_config(&serde_json::json!({"lr": 0.5, "name": "small", "fused": true}));
        tb.start(&run).unwrap();
        tb.log(1, &[("loss", 0.5), ("lr", 1e-3)]).unwrap();
        tb.log_text(2, "sample", "to be or not").unwrap();
        tb.finish(RunStatus::Finished).unwrap();

        let files: Vec<PathBuf> = std::fs::read_dir(tmp.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .collect();
        assert_eq!(files.len(), 1);
        let events = event_file::read_events(&std::fs::read(&files[0]).unwrap());
        assert_eq!(events.len(), 5, "{events:?}");
        assert_eq!(
            events[0].what,
            Some(What::FileVersion("brain.Event:2".into()))
        );
        let summary = |i: usize| match &events[i].what {
            Some(What::Summary(s)) => s.value[0].clone(),
            other => panic!("{other:?}"),
        };
        let session = |i: usize| {
            let value = summary(i);
            let data = value.metadata.unwrap().plugin_data.unwrap();
            assert_eq!(data.plugin_name, "hparams");
            HParamsPluginData::decode(&data.content[..])
                .unwrap()
                .data
                .unwrap()
        };
        let Session::Start(start) = session(1) else {
            panic!("no session start")
        };
        assert_eq!(start.hparams["lr"].kind, Some(Kind::Number(0.5)));
        assert_eq!(start.hparams["name"].kind, Some(Kind::Text("small".into())));
        assert_eq!(start.hparams["fused"].kind, Some(Kind::Bool(true)));
        assert_eq!(events[2].step, 1);
        assert_eq!(summary(2).simple_value, Some(0.5));
        let text = summary(3);
        assert_eq!(
            text.tensor.unwrap().string_val,
            vec![b"to be or not".to_vec()]
        );
        assert_eq!(
            text.metadata.unwrap().plugin_data.unwrap().plugin_name,
            "text"
        );
        let Session::End(end) = session(4) else {
            panic!("no session end")
        };
        assert_eq!(end.status, 1);
    }
}
