//! The digits example, run as a test: it must reach 95 % test accuracy.

#[allow(dead_code)]
#[path = "../digits.rs"]
mod digits_example;

use accelerate_burn::MixedPrecision;

#[test]
fn digits_example_reaches_95_percent() {
    let report = digits_example::train(30, Some(MixedPrecision::No)).unwrap();
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
    let f32_run = digits_example::train(30, Some(MixedPrecision::No)).unwrap();
    for precision in [MixedPrecision::Bf16, MixedPrecision::Fp16] {
        let run = digits_example::train(30, Some(precision)).unwrap();
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
