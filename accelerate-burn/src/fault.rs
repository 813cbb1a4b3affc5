//! Fault injection for tests: a variable `<rank>:<n>` makes rank `<rank>` abort before the
//! n-th time a communication thread of its would communicate, so that tests can kill a rank in
//! the middle of overlapped communication.

/// The count that variable `var` names for `rank`, if any.
pub(crate) fn fault_at(var: &str, rank: usize) -> Option<u64> {
    let text = std::env::var(var).ok()?;
    let (r, n) = text.trim().split_once(':')?;
    (r.parse() == Ok(rank)).then(|| n.parse().ok()).flatten()
}
