//! Per-identity write rate limits: a token bucket per caller, so one user's
//! runaway submit loop cannot crowd everyone else out of the log. Writes only
//! (reads are cheap and answered locally); admins, replicas and agents are not
//! limited (the cluster's own traffic and its operators). The leader counts
//! every write, its own callers' and those followers forward, so a user's rate
//! holds for the whole cluster; a new leader starts with full buckets.

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Writes per second one identity may sustain: far above any person or CI
/// pipeline (sbatch loops submit tens per second) and a fraction of what the
/// cluster commits (~9,000/s on a 2-core machine), so others keep their share.
pub const WRITES_PER_S: f64 = 500.0;
/// Writes one identity may make in a burst, above the sustained rate: a job
/// array's worth of separate submits, or a script cancelling a few thousand jobs.
pub const WRITES_BURST: f64 = 2_000.0;
/// Identities tracked at once; the least recently seen is forgotten first (a
/// forgotten identity starts with a full bucket, which is the generous side).
pub const IDENTITIES_MAX: usize = 10_000;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
}

/// The pure part: refill at `rate` up to `burst`, then take one token or say
/// how long until one is there.
fn take(bucket: &mut Bucket, now: Instant, rate: f64, burst: f64) -> Result<(), Duration> {
    let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
    bucket.tokens = (bucket.tokens + elapsed * rate).min(burst);
    bucket.at = now;
    if bucket.tokens >= 1.0 {
        bucket.tokens -= 1.0;
        Ok(())
    } else {
        Err(Duration::from_secs_f64(((1.0 - bucket.tokens) / rate).min(60.0)))
    }
}

pub struct WriteLimiter {
    buckets: std::sync::Mutex<BTreeMap<String, Bucket>>,
    rate: f64,
    burst: f64,
}

impl Default for WriteLimiter {
    fn default() -> Self {
        WriteLimiter::new(WRITES_PER_S, WRITES_BURST)
    }
}

impl WriteLimiter {
    /// `rate` writes per second, bursts of `burst` (both at least 1).
    pub fn new(rate: f64, burst: f64) -> WriteLimiter {
        WriteLimiter { buckets: Default::default(), rate: rate.max(1.0), burst: burst.max(1.0) }
    }

    pub fn rate(&self) -> (f64, f64) {
        (self.rate, self.burst)
    }

    /// Takes one write for `identity`, or returns how long to wait before retrying.
    pub fn check(&self, identity: &str, now: Instant) -> Result<(), Duration> {
        let mut buckets = self.buckets.lock().expect("rate limiter lock");
        if !buckets.contains_key(identity) && buckets.len() >= IDENTITIES_MAX {
            if let Some(oldest) = buckets.iter().min_by_key(|(_, b)| b.at).map(|(k, _)| k.clone()) {
                buckets.remove(&oldest);
            }
        }
        let bucket = buckets.entry(identity.to_string()).or_insert(Bucket { tokens: self.burst, at: now });
        take(bucket, now, self.rate, self.burst)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_burst_then_the_sustained_rate_then_a_retry_hint() {
        let l = WriteLimiter::default();
        let t0 = Instant::now();
        for _ in 0..WRITES_BURST as usize {
            assert!(l.check("alice", t0).is_ok());
        }
        // One past the burst: refused, with a hint of one token's time.
        let wait = l.check("alice", t0).unwrap_err();
        assert!(wait > Duration::ZERO && wait <= Duration::from_secs_f64(1.0 / WRITES_PER_S) * 2);
        // Others are not affected.
        assert!(l.check("bob", t0).is_ok());
        // A second later, a second's worth is back.
        let t1 = t0 + Duration::from_secs(1);
        for _ in 0..WRITES_PER_S as usize {
            assert!(l.check("alice", t1).is_ok());
        }
        assert!(l.check("alice", t1).is_err());
    }

    #[test]
    fn identities_are_bounded() {
        let l = WriteLimiter::default();
        let t0 = Instant::now();
        for i in 0..IDENTITIES_MAX + 10 {
            assert!(l.check(&format!("u{i}"), t0 + Duration::from_micros(i as u64)).is_ok());
        }
        assert_eq!(l.buckets.lock().unwrap().len(), IDENTITIES_MAX);
    }
}
