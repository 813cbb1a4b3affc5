//! The TensorBoard tracker's event files, read back by TensorBoard's own event reader (from
//! PyPI; `.ci/run` installs it): scalars at their steps, the text, and the run's
//! configuration and end status in the hparams plugin's records.

#[path = "../../tests-support/tools.rs"]
mod tools;

use accelerate_core::tracking::{GeneralTracker, RunInfo, RunStatus, TensorBoardTracker};

#[test]
fn tensorboard_reads_our_scalars_texts_and_hparams() {
    let Some(python) = tools::python_with("tensorboard") else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let mut tb = TensorBoardTracker::new(dir.path());
    let mut run = RunInfo::new("p");
    run.run_name = Some("small".into());
    run.set_config(&serde_json::json!({"lr": 0.25, "optimizer": "adamw", "fused": true}));
    tb.start(&run).unwrap();
    for step in 1..=3u64 {
        tb.log(step, &[("train/loss", 1.0 / step as f64)]).unwrap();
    }
    tb.log_text(3, "sample", "to be or not to be").unwrap();
    tb.finish(RunStatus::Finished).unwrap();

    let script = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
from tensorboard.plugins.hparams import plugin_data_pb2
from tensorboard.util import tensor_util
ea = EventAccumulator(sys.argv[1], size_guidance={"tensors": 0, "scalars": 0})
ea.Reload()
hp = ea.PluginTagToContent("hparams")
start = plugin_data_pb2.HParamsPluginData.FromString(hp["_hparams_/session_start_info"])
end = plugin_data_pb2.HParamsPluginData.FromString(hp["_hparams_/session_end_info"])
values = {}
for key, value in start.session_start_info.hparams.items():
    values[key] = getattr(value, value.WhichOneof("kind"))
text = tensor_util.make_ndarray(ea.Tensors("sample")[0].tensor_proto).item().decode()
print(json.dumps({
    "loss": [[s.step, s.value] for s in ea.Scalars("train/loss")],
    "hparams": values, "group": start.session_start_info.group_name,
    "status": end.session_end_info.status, "text": text,
    "text_plugin": sorted(ea.PluginTagToContent("text")),
}))
"#;
    let out = tools::output_of(
        std::process::Command::new(python)
            .args(["-c", script])
            .arg(dir.path())
            .current_dir(dir.path()),
        "reading the events with TensorBoard",
    );
    let seen: serde_json::Value = serde_json::from_slice(&out).unwrap();
    assert_eq!(
        seen["loss"],
        serde_json::json!([[1, 1.0], [2, 0.5], [3, 1.0f32 / 3.0]])
    );
    assert_eq!(
        seen["hparams"],
        serde_json::json!({"lr": 0.25, "optimizer": "adamw", "fused": true})
    );
    assert_eq!(seen["group"], "small");
    // STATUS_SUCCESS.
    assert_eq!(seen["status"], 1);
    assert_eq!(seen["text"], "to be or not to be");
    assert_eq!(seen["text_plugin"], serde_json::json!(["sample"]));
}
