//! The digits example, run as a test: it must reach 95 % test accuracy.

#[allow(dead_code)]
#[path = "../digits.rs"]
mod digits_example;

use accelerate_burn::MixedPrecision;

#[test]
fn digits_example_reaches_95_percent() {
    let report = digits_example::train(30, Some(MixedPrecision::No), None).unwrap();
    assert_eq!(report.updates, 30 * 1437_u64.div_ceil(32));
    assert!(
        report.accuracy >= 0.95,
        "test accuracy {:.2} % is below 95 %",
        100.0 * report.accuracy
    );
}

/// bf16 and fp16 (with dynamic loss scaling) reach 94 %, and their last-epoch training loss
/// stays within 0.02 of f32's.
#[test]
fn digits_trains_in_bf16_and_fp16() {
    let f32_run = digits_example::train(30, Some(MixedPrecision::No), None).unwrap();
    for precision in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
        let run = digits_example::train(30, Some(precision), None).unwrap();
        assert!(
            run.accuracy >= 0.94,
            "{precision:?}: test accuracy {:.2} %",
            100.0 * run.accuracy
        );
        let gap = (run.final_loss - f32_run.final_loss).abs();
        assert!(
            gap <= 0.02,
            "{precision:?}: final loss {} vs f32 {}",
            run.final_loss,
            f32_run.final_loss
        );
    }
}

/// With a project directory the example logs each epoch, checkpoints, and a second start
/// resumes from the last checkpoint instead of training again.
#[test]
fn digits_logs_checkpoints_and_resumes_in_its_project_directory() {
    let tmp = tempfile::tempdir().unwrap();
    let project = Some(tmp.path().to_path_buf());
    let first = digits_example::train(3, Some(MixedPrecision::No), project.clone()).unwrap();
    let checkpoints = tmp.path().join("checkpoints");
    let mut kept: Vec<String> = std::fs::read_dir(&checkpoints)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    kept.sort();
    // 45 updates per epoch; the total limit keeps the last 2.
    assert_eq!(kept, ["checkpoint_135", "checkpoint_90"]);
    let csv = std::fs::read_to_string(tmp.path().join("logs/metrics.csv")).unwrap();
    assert_eq!(
        csv.lines().filter(|l| l.contains("train/loss")).count(),
        3,
        "{csv}"
    );
    assert!(
        std::fs::read_dir(tmp.path().join("logs"))
            .unwrap()
            .any(|e| e
                .unwrap()
                .file_name()
                .to_string_lossy()
                .starts_with("events.out.tfevents."))
    );

    // Five epochs in all: the second start trains only epochs 4 and 5.
    let second = digits_example::train(5, Some(MixedPrecision::No), project).unwrap();
    assert_eq!(first.updates, 135);
    assert_eq!(second.updates, 225);
    let csv = std::fs::read_to_string(tmp.path().join("logs/metrics.csv")).unwrap();
    let steps: Vec<&str> = csv
        .lines()
        .skip(1)
        .map(|l| l.split(',').next().unwrap())
        .collect();
    assert_eq!(steps, ["1", "2", "3", "4", "5"]);
}
