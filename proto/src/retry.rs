//! Bounded retries and polls: every loop that tries again after a pause
//! runs through a [`Retry`], so each has a named limit, a pause, and one
//! tested shape (the first try at once, then one per pause, and none past
//! the limit). A site's reason for its limit is a span — "longer than an
//! election", "longer than any time limit" — which [`Retry::span`] states
//! so that a test can hold the site to it.

use std::time::Duration;

/// At most `attempts` tries, `pause` apart.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Retry {
    pub attempts: u64,
    pub pause: Duration,
}

impl Retry {
    pub const fn new(attempts: u64, pause: Duration) -> Retry {
        Retry { attempts, pause }
    }

    /// The time the pauses take in all: how long a site keeps trying for
    /// (the tries' own time comes on top).
    pub fn span(&self) -> Duration {
        let pauses = u32::try_from(self.attempts.saturating_sub(1)).unwrap_or(u32::MAX);
        self.pause.saturating_mul(pauses)
    }

    /// The tries, counted: `while tries.next().await { ... }`.
    pub fn tries(self) -> Tries {
        Tries { retry: self, done: 0 }
    }
}

/// The tries of one [`Retry`] under way.
#[derive(Debug)]
pub struct Tries {
    retry: Retry,
    done: u64,
}

impl Tries {
    /// Whether another try may be made: true at once for the first, after
    /// the pause for each next one, and false (without a pause) once
    /// `attempts` were made.
    pub async fn next(&mut self) -> bool {
        if self.done >= self.retry.attempts {
            return false;
        }
        if self.done > 0 && !self.retry.pause.is_zero() {
            tokio::time::sleep(self.retry.pause).await;
        }
        self.done = self.done.saturating_add(1);
        true
    }

    /// Tries made so far (the one under way included).
    pub fn made(&self) -> u64 {
        self.done
    }

    /// Whether the try under way is the first (a site logs its first failure
    /// once, not on every retry).
    pub fn first(&self) -> bool {
        self.done == 1
    }
}

/// Tries `retry` makes when every one fails (for tests of a site's limit:
/// none past it), with its pauses skipped.
#[doc(hidden)]
pub async fn count_tries(retry: Retry) -> u64 {
    let mut tries = Retry { pause: Duration::ZERO, ..retry }.tries();
    let mut made = 0u64;
    while tries.next().await {
        made = made.saturating_add(1);
    }
    made
}

#[cfg(test)]
mod tests {
    use super::*;

    #[tokio::test]
    async fn a_retry_makes_its_attempts_and_none_past_them() {
        for attempts in [0, 1, 2, 7] {
            assert_eq!(count_tries(Retry::new(attempts, Duration::from_secs(3600))).await, attempts);
        }
        // Succeeding on the last allowed try is in time; one past, never tried.
        let mut tries = Retry::new(3, Duration::ZERO).tries();
        let mut seen = Vec::new();
        while tries.next().await {
            seen.push((tries.made(), tries.first()));
        }
        assert_eq!(seen, [(1, true), (2, false), (3, false)]);
        assert!(!tries.next().await, "a try past the limit");
        assert_eq!(tries.made(), 3);
    }

    #[tokio::test]
    async fn the_first_try_is_at_once_and_the_rest_a_pause_apart() {
        let soon = Duration::from_secs(60);
        let mut tries = Retry::new(2, Duration::from_secs(3600)).tries();
        assert_eq!(tokio::time::timeout(soon, tries.next()).await, Ok(true), "the first try waited");
        // The second waits for its hour's pause.
        assert!(tokio::time::timeout(Duration::from_millis(50), tries.next()).await.is_err());
        // Giving up does not wait.
        let mut tries = Retry::new(1, Duration::from_secs(3600)).tries();
        assert!(tries.next().await);
        assert_eq!(tokio::time::timeout(soon, tries.next()).await, Ok(false), "giving up waited");
    }

    #[test]
    fn a_span_is_the_pauses_between_tries() {
        assert_eq!(Retry::new(0, Duration::from_secs(1)).span(), Duration::ZERO);
        assert_eq!(Retry::new(1, Duration::from_secs(1)).span(), Duration::ZERO);
        assert_eq!(Retry::new(120, Duration::from_secs(1)).span(), Duration::from_secs(119));
        // Saturates rather than overflowing.
        assert_eq!(Retry::new(u64::MAX, Duration::MAX).span(), Duration::MAX);
    }
}
