//! Waits that people and files set: seconds parsed and bounded, and deadlines that cannot
//! overflow whatever the configured wait.
//!
//! ```
//! use std::time::Duration;
//! use accelerate_core::wait;
//!
//! assert_eq!(wait::seconds("2.5"), Some(Duration::from_millis(2500)));
//! assert_eq!(wait::seconds("1e20"), None); // longer than any job: refused, not a panic
//! let far = wait::deadline_after(Duration::MAX); // capped at MAX_WAIT from now
//! assert!(far > std::time::Instant::now());
//! ```

use std::time::{Duration, Instant};

/// The longest wait anything accepts: 30 days.
pub const MAX_WAIT: Duration = Duration::from_secs(30 * 24 * 3600);

/// `text` as a number of seconds from 0 to [`MAX_WAIT`]; `None` for anything else (negative,
/// not finite, not a number, or longer).
pub fn seconds(text: &str) -> Option<Duration> {
    seconds_f64(text.trim().parse().ok()?)
}

/// `value` seconds, from 0 to [`MAX_WAIT`]; `None` for anything else (negative, not finite, or
/// longer).
pub fn seconds_f64(value: f64) -> Option<Duration> {
    (value.is_finite() && (0.0..=MAX_WAIT.as_secs_f64()).contains(&value))
        .then(|| Duration::from_secs_f64(value))
}

/// The instant `wait` from now, `wait` capped at [`MAX_WAIT`] (an `Instant` plus a
/// duration near `Duration::MAX` would panic).
pub fn deadline_after(wait: Duration) -> Instant {
    let now = Instant::now();
    now.checked_add(wait.min(MAX_WAIT)).unwrap_or(now)
}
