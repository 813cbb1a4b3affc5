//! The digits example, run as a test: it must reach 95 % test accuracy.

#[allow(dead_code)]
#[path = "../digits.rs"]
mod digits_example;

#[test]
fn digits_example_reaches_95_percent() {
    let report = digits_example::train(30).unwrap();
    assert_eq!(report.updates, 30 * 1437_u64.div_ceil(32));
    assert!(
        report.accuracy >= 0.95,
        "test accuracy {:.2} % is below 95 %",
        100.0 * report.accuracy
    );
}
