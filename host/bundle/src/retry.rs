//! When to try again. Network errors and 5xx are worth retrying with exponential backoff; a 4xx
//! or a checksum mismatch will not get better by asking again, so they fail at once. The count
//! restarts whenever bytes arrive: a long download over a flaky link may drop many times, and
//! each drop that made progress is not a reason to give up.

use std::time::Duration;

#[derive(Debug, Clone)]
pub struct RetryPolicy {
    /// Retries after the first attempt without progress in between.
    pub retries: u32,
    /// Delay before the first retry; doubled for each further one.
    pub initial: Duration,
    pub max: Duration,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self { retries: 6, initial: Duration::from_millis(250), max: Duration::from_secs(8) }
    }
}

impl RetryPolicy {
    /// The delay before retry number `n` (1-based), or None when retries are used up.
    pub fn delay(&self, n: u32) -> Option<Duration> {
        if n == 0 || n > self.retries {
            return None;
        }
        let factor = 1u32.checked_shl(n - 1).unwrap_or(u32::MAX);
        Some(self.initial.saturating_mul(factor).min(self.max))
    }
}

/// Whether an HTTP status is worth another try.
pub fn retryable_status(status: u16) -> bool {
    status >= 500
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn doubles_up_to_the_cap_then_stops() {
        let p = RetryPolicy { retries: 5, initial: Duration::from_millis(100), max: Duration::from_millis(500) };
        let d: Vec<_> = (1..=6).map(|n| p.delay(n).map(|d| d.as_millis())).collect();
        assert_eq!(d, [Some(100), Some(200), Some(400), Some(500), Some(500), None]);
        assert!(retryable_status(500) && retryable_status(503));
        assert!(!retryable_status(404) && !retryable_status(416));
    }
}
