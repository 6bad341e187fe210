//! When to try a remote request again: exponential backoff with a deadline.
//!
//! A request that fails for a reason that may pass (a connection refused or reset, a
//! timeout, a 5xx, a throttling answer) is tried again after a delay that doubles from
//! `initial` up to `max`, until the next attempt could not finish before `deadline`
//! from the first attempt. A failure that will not pass by trying again (the object
//! changed, is gone, or we may not read it) is not retried. Pure: the caller sleeps and
//! measures time.

use std::time::Duration;

/// Whether an error may pass by trying again.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Retry {
    /// Transient: connection errors, timeouts, 5xx, 429.
    Transient,
    /// Permanent: a changed object (412), not found, forbidden, a bad request.
    Permanent,
}

/// The shortest attempt worth making: no attempt is started with less time left.
pub const MIN_ATTEMPT: Duration = Duration::from_millis(100);

/// The backoff schedule and the deadline of one request.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RetryPolicy {
    /// The first delay.
    pub initial: Duration,
    /// The longest delay.
    pub max: Duration,
    /// How long a request may take in all, its retries included.
    pub deadline: Duration,
    /// How long one attempt may take (cut to what is left of the deadline).
    pub attempt_timeout: Duration,
}

/// What to do after a failed attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Next {
    /// Sleep this long, then try again with this attempt timeout.
    RetryAfter { delay: Duration, timeout: Duration },
    /// Stop: the error is final.
    GiveUp,
}

impl Default for RetryPolicy {
    fn default() -> Self {
        Self {
            initial: Duration::from_millis(100),
            max: Duration::from_secs(2),
            deadline: Duration::from_secs(30),
            attempt_timeout: Duration::from_secs(10),
        }
    }
}

impl RetryPolicy {
    /// A policy that gives up `deadline` after the first attempt starts.
    pub fn with_deadline(deadline: Duration) -> Self {
        let default = Self::default();
        Self {
            deadline,
            attempt_timeout: default.attempt_timeout.min(deadline),
            ..default
        }
    }

    /// The delay before attempt `attempt + 1` (`attempt` counts from 0 for the first).
    pub fn delay(&self, attempt: u32) -> Duration {
        let factor = 1u32.checked_shl(attempt.min(31)).unwrap_or(u32::MAX);
        self.initial.saturating_mul(factor).min(self.max)
    }

    /// The timeout of the first attempt.
    pub fn first_timeout(&self) -> Duration {
        self.attempt_timeout.min(self.deadline)
    }

    /// After attempt `attempt` failed with an error of kind `kind`, `elapsed` after the
    /// first attempt started: try again (after how long, with what timeout) or give up.
    /// The last delay is cut so that one more attempt of at least `MIN_ATTEMPT` fits
    /// before the deadline: a remote that comes back just before it is still reached.
    pub fn next(&self, attempt: u32, kind: Retry, elapsed: Duration) -> Next {
        if kind == Retry::Permanent {
            return Next::GiveUp;
        }
        let room = self.deadline.saturating_sub(elapsed);
        if room < MIN_ATTEMPT * 2 {
            return Next::GiveUp;
        }
        let delay = self.delay(attempt).min(room - MIN_ATTEMPT);
        let left = room - delay;
        Next::RetryAfter {
            delay,
            timeout: self.attempt_timeout.min(left),
        }
    }
}

/// How an HTTP status answers `Retry`: 408, 429 and 5xx may pass, others not.
pub fn status_retry(status: u16) -> Retry {
    match status {
        408 | 429 | 500..=599 => Retry::Transient,
        _ => Retry::Permanent,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ms(n: u64) -> Duration {
        Duration::from_millis(n)
    }

    #[test]
    fn delays_double_up_to_the_cap() {
        let policy = RetryPolicy::default();
        let delays: Vec<_> = (0..7).map(|a| policy.delay(a)).collect();
        assert_eq!(
            delays,
            [
                ms(100),
                ms(200),
                ms(400),
                ms(800),
                ms(1600),
                ms(2000),
                ms(2000)
            ]
        );
        assert_eq!(policy.delay(1000), ms(2000));
    }

    #[test]
    fn permanent_errors_are_not_retried() {
        let policy = RetryPolicy::default();
        assert_eq!(policy.next(0, Retry::Permanent, ms(0)), Next::GiveUp);
    }

    #[test]
    fn retries_stop_before_the_deadline_and_attempts_fit_in_it() {
        let policy = RetryPolicy::with_deadline(Duration::from_secs(5));
        // Simulate attempts that each fail at once: the schedule's delays add up to at
        // most the deadline, and every attempt's timeout ends by it.
        let mut elapsed = Duration::ZERO;
        let mut attempt = 0;
        while let Next::RetryAfter { delay, timeout } =
            policy.next(attempt, Retry::Transient, elapsed)
        {
            elapsed += delay;
            assert!(
                elapsed + timeout <= policy.deadline,
                "{attempt}: {elapsed:?}+{timeout:?}"
            );
            attempt += 1;
        }
        assert!(attempt >= 4, "only {attempt} retries in 5 s");
        // The last delay is cut to leave one short attempt just before the deadline.
        assert!(elapsed <= policy.deadline - MIN_ATTEMPT);
        assert!(elapsed >= policy.deadline - MIN_ATTEMPT * 2, "{elapsed:?}");
        assert_eq!(
            policy.next(9, Retry::Transient, ms(4700)),
            Next::RetryAfter {
                delay: ms(200),
                timeout: ms(100)
            }
        );
        // An attempt that timed out near the deadline is the last.
        assert_eq!(policy.next(0, Retry::Transient, ms(4850)), Next::GiveUp);
    }

    #[test]
    fn statuses_split_into_transient_and_permanent() {
        for status in [408, 429, 500, 502, 503, 504] {
            assert_eq!(status_retry(status), Retry::Transient, "{status}");
        }
        for status in [400, 401, 403, 404, 412, 416] {
            assert_eq!(status_retry(status), Retry::Permanent, "{status}");
        }
    }
}
