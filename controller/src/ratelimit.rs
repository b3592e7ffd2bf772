//! Per-identity budgets: a token bucket per caller for writes, so one user's
//! runaway submit loop cannot crowd everyone else out of the log, and one for
//! the work of reads, so a thousand array tasks polling `squeue` cannot take
//! the replica that answers them.
//!
//! Writes: admins have a budget of their own, far above a user's (an
//! operator's scripts and `gangway bench submit`, not a person's loop, but
//! still not without end: every write is kept by every replica); replicas
//! and agents are not limited (the cluster's own traffic). The leader counts every write, its own
//! callers' and those followers forward, so a user's rate holds for the whole
//! cluster; a new leader starts with full buckets.
//!
//! Reads ([`ReadLimiter`]) are charged by their work, in *read units*: one per
//! job or node a read looks at, one per [`READ_BYTES_PER_UNIT`] bytes it
//! answers, and [`READ_BASE_UNITS`] for the call itself. A read is let in
//! while its caller's bucket is not empty and charged what it did afterwards
//! (the cost of a listing is known only once it ran; each read's work is
//! bounded, so a bucket's debt is too). The replica that does the work
//! charges it, to the caller's own identity (a follower's forwarded reads are
//! charged on the leader). Only replicas and agents are exempt.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects, clippy::cast_possible_truncation))]

use std::collections::BTreeMap;
use std::time::{Duration, Instant};

/// Writes per second one identity may sustain: far above any person or CI
/// pipeline (sbatch loops submit tens per second) and a fraction of what the
/// cluster commits (~9,000/s on a 2-core machine), so others keep their share.
pub const WRITES_PER_S: f64 = 500.0;
/// Writes one identity may make in a burst, above the sustained rate: a job
/// array's worth of separate submits, or a script cancelling a few thousand jobs.
pub const WRITES_BURST: f64 = 2_000.0;
/// Bytes of writes (job specs, mostly) one identity may sustain per second:
/// what a person or a pipeline submits is kilobytes a job (64 jobs a second
/// of 4 KiB scripts, past the burst; arrays are one spec); a spec at the
/// limit (2 MiB) gets one every 8 s. Every byte written is synced to disk by
/// every replica before the write is acknowledged, and everyone's later
/// writes and linearizable reads wait while it is (a 2 MiB entry is ~45 ms
/// on the 2-core VM, whose three replicas share one disk). So this bounds
/// how much of the log's time, and how fast the replicas' memory, one user
/// can take; the proposer's large-write lane bounds it for all users
/// together (`proposer::LARGE_WRITE_BYTES`). `gangway bench storm`'s
/// maximum-size specs measure what is left (see the README).
pub const WRITE_BYTES_PER_S: f64 = 256.0 * 1024.0;
/// Bytes of writes one identity may make in a burst above that rate: a
/// thousand submits of 4 KiB, two specs at the limit.
pub const WRITE_BYTES_BURST: f64 = 4.0 * 1024.0 * 1024.0;
/// Writes per second one admin may sustain: an operator's scripts and
/// `gangway bench submit` (~7,000 a second on the 2-core VM) fit; a leaked
/// admin certificate still cannot write without end.
pub const ADMIN_WRITES_PER_S: f64 = 10_000.0;
/// Writes one admin may make in a burst above that rate: a restore's or a
/// migration's resubmits.
pub const ADMIN_WRITES_BURST: f64 = 50_000.0;
/// Bytes of writes per second one admin may sustain (64 times a user's).
pub const ADMIN_WRITE_BYTES_PER_S: f64 = 16.0 * 1024.0 * 1024.0;
/// Bytes of writes one admin may make in a burst above that rate.
pub const ADMIN_WRITE_BYTES_BURST: f64 = 64.0 * 1024.0 * 1024.0;
/// Identities tracked at once; the least recently seen is forgotten first (a
/// forgotten identity starts with a full bucket, which is the generous side).
pub const IDENTITIES_MAX: usize = 10_000;

/// The metadata key of the retry hint on RESOURCE_EXHAUSTED (milliseconds),
/// which `gangway_proto::client` obeys.
pub use gangway_proto::client::RETRY_AFTER_METADATA_KEY;

/// Read units one identity may spend per second on one replica. A listing
/// of 20,000 jobs costs about 60,000 (each job looked at and ~400 bytes of
/// it answered): squeue over such a queue every second fits, and at about a
/// microsecond of CPU per unit one identity is held to a fraction of a core.
pub const READ_UNITS_PER_S: f64 = 200_000.0;
/// Read units in a full bucket: a few whole listings of a large queue at once.
pub const READ_UNITS_BURST: f64 = 1_000_000.0;
/// Units a read's admission reserves from its caller's bucket (about a
/// page of a listing), settled against what it did when it is charged: a
/// thousand reads arriving together are let in only as far as the bucket
/// holds a page for each.
pub const READ_RESERVED_UNITS: u64 = 1_000;
/// Units every read costs, whatever it looked at (a Get of one job).
pub const READ_BASE_UNITS: u64 = 10;
/// Bytes answered per read unit.
pub const READ_BYTES_PER_UNIT: usize = 128;

/// The longest wait a refusal names: the longest the client library waits
/// out (a longer hint would make it give up at once). Refused callers of one
/// identity are given turns one after another (see [`Bucket::turn`]); past
/// this far ahead they are all told this.
pub const HINT_MAX: Duration = gangway_proto::client::RETRY_AFTER_MAX;

#[derive(Debug, Clone, Copy)]
struct Bucket {
    tokens: f64,
    at: Instant,
    /// When the next refused caller of this identity is told to come back.
    /// Each refusal takes a turn and moves this on by that caller's share of
    /// the rate, so a thousand pollers refused together come back spread
    /// over the time their bucket needs for them, not all at once a few
    /// milliseconds later (each refusal costs the replica a little too).
    turn: Option<Instant>,
    /// What this identity's calls cost lately (an average of the units
    /// charged): the share a turn is spaced by.
    usual: f64,
}

impl Bucket {
    fn full(burst: f64, now: Instant) -> Bucket {
        Bucket { tokens: burst, at: now, turn: None, usual: 0.0 }
    }

    /// A refused caller's turn: no sooner than `ready_in` seconds from now
    /// (when the bucket holds enough again) and after every caller refused
    /// before it; the turn after it is `share` seconds later.
    fn take_turn(&mut self, now: Instant, ready_in: f64, share: f64) -> Duration {
        // Rates are checked finite and at least 1 where they are set; a NaN
        // here would still only mean "now".
        let (ready_in, share) =
            (if ready_in.is_nan() { 0.0 } else { ready_in }, if share.is_nan() { 0.0 } else { share });
        let ready = now.checked_add(Duration::from_secs_f64(ready_in.clamp(0.0, HINT_MAX.as_secs_f64())));
        let turn = match (self.turn, ready) {
            (Some(t), Some(r)) if t > r => t,
            (_, Some(r)) => r,
            (t, None) => t.unwrap_or(now),
        };
        let wait = turn.saturating_duration_since(now);
        if wait >= HINT_MAX {
            return HINT_MAX;
        }
        self.turn = turn.checked_add(Duration::from_secs_f64(share.clamp(0.0, HINT_MAX.as_secs_f64())));
        wait.max(Duration::from_millis(1))
    }
}

/// Refills `bucket` up to `now`.
fn refill(bucket: &mut Bucket, now: Instant, rate: f64, burst: f64) {
    let elapsed = now.saturating_duration_since(bucket.at).as_secs_f64();
    bucket.tokens = (bucket.tokens + elapsed * rate).min(burst);
    bucket.at = now;
}

/// The bucket of `identity`, made full if new; the least recently used one
/// is forgotten when IDENTITIES_MAX are tracked.
fn bucket_of<'a>(
    buckets: &'a mut BTreeMap<String, Bucket>,
    identity: &str,
    now: Instant,
    burst: f64,
) -> &'a mut Bucket {
    if !buckets.contains_key(identity) && buckets.len() >= IDENTITIES_MAX {
        if let Some(oldest) = buckets.iter().min_by_key(|(_, b)| b.at).map(|(k, _)| k.clone()) {
            buckets.remove(&oldest);
        }
    }
    buckets.entry(identity.to_string()).or_insert(Bucket::full(burst, now))
}

/// Per-identity budgets for the work of reads (see the module docs).
pub struct ReadLimiter {
    buckets: std::sync::Mutex<BTreeMap<String, Bucket>>,
    rate: f64,
    burst: f64,
}

impl ReadLimiter {
    /// `rate` units per second, `burst` in a full bucket (both at least 1).
    pub fn new(rate: f64, burst: f64) -> ReadLimiter {
        ReadLimiter { buckets: Default::default(), rate: rate.max(1.0), burst: burst.max(1.0) }
    }

    pub fn rate(&self) -> (f64, f64) {
        (self.rate, self.burst)
    }

    /// Lets a read of `identity` in while its bucket is not empty, or says
    /// how long until it is.
    pub fn admit(&self, identity: &str, now: Instant) -> Result<(), Duration> {
        let mut buckets = self.buckets.lock().expect("rate limiter lock");
        let bucket = bucket_of(&mut buckets, identity, now, self.burst);
        refill(bucket, now, self.rate, self.burst);
        if bucket.tokens > 0.0 {
            // Reserved now, so that many reads arriving together are not
            // all let in on the same tokens; settled when the read is charged.
            bucket.tokens -= READ_RESERVED_UNITS as f64;
            Ok(())
        } else {
            let share = bucket.usual.max(READ_RESERVED_UNITS as f64) / self.rate;
            Err(bucket.take_turn(now, (1.0 - bucket.tokens) / self.rate, share))
        }
    }

    /// A turn for a read of `identity` refused for another reason (its
    /// places in the read lane were all taken): when to come back, after the
    /// others refused before it (see `Bucket::turn`).
    pub fn turn(&self, identity: &str, now: Instant) -> Duration {
        let mut buckets = self.buckets.lock().expect("rate limiter lock");
        let bucket = bucket_of(&mut buckets, identity, now, self.burst);
        refill(bucket, now, self.rate, self.burst);
        let share = bucket.usual.max(READ_RESERVED_UNITS as f64) / self.rate;
        bucket.take_turn(now, (1.0 - bucket.tokens).max(0.0) / self.rate, share)
    }

    /// Charges what a read of `identity` did (less what its admission
    /// reserved). The debt is bounded by one full bucket: a read's work is
    /// bounded, and a caller deep in debt is refused until it is paid.
    pub fn charge(&self, identity: &str, units: u64, now: Instant) {
        self.settle(identity, units, now, true);
    }

    fn settle(&self, identity: &str, units: u64, now: Instant, learn: bool) {
        let mut buckets = self.buckets.lock().expect("rate limiter lock");
        let bucket = bucket_of(&mut buckets, identity, now, self.burst);
        refill(bucket, now, self.rate, self.burst);
        let owed = units as f64 - READ_RESERVED_UNITS as f64;
        bucket.tokens = (bucket.tokens - owed).clamp(-self.burst, self.burst);
        if learn {
            bucket.usual = bucket.usual * 0.9 + (units as f64).min(self.burst) * 0.1;
        }
    }

    /// Gives back what an admission reserved for a read this replica did not
    /// do (it forwarded it: the leader charges it).
    pub fn refund(&self, identity: &str, now: Instant) {
        self.settle(identity, 0, now, false);
    }
}

/// The read units of a read that looked at `examined` jobs or nodes and
/// answered `bytes`.
pub fn read_units(examined: usize, bytes: usize) -> u64 {
    let units = examined.saturating_add(bytes / READ_BYTES_PER_UNIT);
    READ_BASE_UNITS.saturating_add(u64::try_from(units).unwrap_or(u64::MAX))
}

pub struct WriteLimiter {
    buckets: std::sync::Mutex<BTreeMap<String, (Bucket, Bucket)>>,
    rate: f64,
    burst: f64,
    bytes_rate: f64,
    bytes_burst: f64,
}

impl Default for WriteLimiter {
    fn default() -> Self {
        WriteLimiter::new(WRITES_PER_S, WRITES_BURST)
    }
}

impl WriteLimiter {
    /// `rate` writes per second, bursts of `burst` (both at least 1), and
    /// WRITE_BYTES_PER_S bytes, bursts of WRITE_BYTES_BURST.
    pub fn new(rate: f64, burst: f64) -> WriteLimiter {
        WriteLimiter::with_bytes(rate, burst, WRITE_BYTES_PER_S, WRITE_BYTES_BURST)
    }

    /// Also the bytes per second and in a burst (all at least 1).
    pub fn with_bytes(rate: f64, burst: f64, bytes_rate: f64, bytes_burst: f64) -> WriteLimiter {
        WriteLimiter {
            buckets: Default::default(),
            rate: rate.max(1.0),
            burst: burst.max(1.0),
            bytes_rate: bytes_rate.max(1.0),
            bytes_burst: bytes_burst.max(1.0),
        }
    }

    pub fn rate(&self) -> (f64, f64) {
        (self.rate, self.burst)
    }

    pub fn bytes_rate(&self) -> (f64, f64) {
        (self.bytes_rate, self.bytes_burst)
    }

    /// Takes one write of `bytes` for `identity`, or returns how long to wait
    /// before retrying (the write is taken from neither bucket then).
    pub fn check(&self, identity: &str, bytes: usize, now: Instant) -> Result<(), Duration> {
        let mut buckets = self.buckets.lock().expect("rate limiter lock");
        if !buckets.contains_key(identity) && buckets.len() >= IDENTITIES_MAX {
            if let Some(oldest) = buckets.iter().min_by_key(|(_, b)| b.0.at).map(|(k, _)| k.clone()) {
                buckets.remove(&oldest);
            }
        }
        let fresh = |burst| Bucket::full(burst, now);
        let (count, size) =
            buckets.entry(identity.to_string()).or_insert_with(|| (fresh(self.burst), fresh(self.bytes_burst)));
        refill(count, now, self.rate, self.burst);
        refill(size, now, self.bytes_rate, self.bytes_burst);
        // A write larger than the whole burst waits for a full bucket.
        let bytes = (bytes as f64).min(self.bytes_burst);
        // Refused callers take turns (see `Bucket::turn`), on the count's bucket.
        if count.tokens < 1.0 {
            return Err(count.take_turn(now, (1.0 - count.tokens) / self.rate, 1.0 / self.rate));
        }
        if size.tokens < bytes {
            let ready_in = (bytes - size.tokens) / self.bytes_rate;
            return Err(count.take_turn(now, ready_in, bytes / self.bytes_rate));
        }
        count.tokens -= 1.0;
        size.tokens -= bytes;
        Ok(())
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
            assert!(l.check("alice", 100, t0).is_ok());
        }
        // One past the burst: refused, with a hint of one token's time.
        let wait = l.check("alice", 100, t0).unwrap_err();
        assert!(wait > Duration::ZERO && wait <= Duration::from_secs_f64(1.0 / WRITES_PER_S) * 2);
        // Others are not affected.
        assert!(l.check("bob", 100, t0).is_ok());
        // A second later, a second's worth is back.
        let t1 = t0 + Duration::from_secs(1);
        for _ in 0..WRITES_PER_S as usize {
            assert!(l.check("alice", 100, t1).is_ok());
        }
        assert!(l.check("alice", 100, t1).is_err());
    }

    #[test]
    fn bytes_are_limited_besides_writes() {
        let l = WriteLimiter::default();
        let t0 = Instant::now();
        // A spec whose bytes the rate refills within the longest hint.
        let spec = 1024 * 1024;
        assert!(Duration::from_secs_f64(spec as f64 / WRITE_BYTES_PER_S) < HINT_MAX);
        let fit = (WRITE_BYTES_BURST / spec as f64) as usize;
        for _ in 0..fit {
            assert!(l.check("alice", spec, t0).is_ok());
        }
        // One past the bytes' burst: refused for the time its bytes take.
        let wait = l.check("alice", spec, t0).unwrap_err();
        let want = Duration::from_secs_f64(spec as f64 / WRITE_BYTES_PER_S);
        assert!(wait <= want && wait > want / 2, "{wait:?}");
        // Small writes of others go on; a refused write took nothing.
        assert!(l.check("bob", 100, t0).is_ok());
        assert!(l.check("alice", spec, t0 + wait).is_ok());
        // A write larger than the burst waits for a full bucket, not forever.
        assert!(l.check("carol", usize::MAX, t0).is_ok());
        // A spec at the limit refills in longer than the longest hint: the
        // hint is the longest, and the retry then hears the rest.
        let limit = gangway_core::limits::JOB_SPEC_BYTES_MAX;
        let dave = |t| l.check("dave", limit, t);
        while dave(t0).is_ok() {}
        assert_eq!(dave(t0).unwrap_err(), HINT_MAX);
        let rest = dave(t0 + HINT_MAX).unwrap_err();
        assert!(rest > Duration::ZERO && rest < HINT_MAX, "{rest:?}");
    }

    #[test]
    fn reads_are_let_in_while_the_bucket_holds_and_charged_what_they_did() {
        let l = ReadLimiter::new(READ_UNITS_PER_S, READ_UNITS_BURST);
        let t0 = Instant::now();
        // A full bucket takes a read that costs more than it holds: reads
        // are charged after they ran.
        assert!(l.admit("alice", t0).is_ok());
        l.charge("alice", READ_UNITS_BURST as u64 + 1 + READ_RESERVED_UNITS, t0);
        // One unit past the bucket: the next read waits until it is paid.
        let wait = l.admit("alice", t0).unwrap_err();
        assert!(wait > Duration::ZERO && wait <= Duration::from_millis(10), "{wait:?}");
        assert!(l.admit("alice", t0 + wait).is_ok());
        // The debt is bounded by one bucket, however much is charged.
        l.charge("bob", u64::MAX, t0);
        let wait = l.admit("bob", t0).unwrap_err();
        assert!(wait <= Duration::from_secs_f64(READ_UNITS_BURST / READ_UNITS_PER_S) + Duration::from_millis(1));
        // Others are not affected.
        assert!(l.admit("carol", t0).is_ok());
        // A herd arriving together is let in only as far as the bucket
        // holds a reservation for each; a forwarded read gives it back.
        let small = ReadLimiter::new(1.0, 10.0 * READ_RESERVED_UNITS as f64);
        let admitted = (0..100).filter(|_| small.admit("herd", t0).is_ok()).count();
        assert_eq!(admitted, 10);
        small.refund("herd", t0);
        assert!(small.admit("herd", t0).is_ok());
        assert_eq!(read_units(0, 0), READ_BASE_UNITS);
        assert_eq!(read_units(100, READ_BYTES_PER_UNIT * 3), READ_BASE_UNITS + 103);
        assert_eq!(read_units(usize::MAX, usize::MAX), READ_BASE_UNITS.saturating_add(u64::MAX));
    }

    /// Callers refused together are told to come back one after another,
    /// each a share of the rate after the one before, not all at once; the
    /// hint never passes HINT_MAX; a caller who waits its turn gets in.
    #[test]
    fn refused_callers_take_turns() {
        let t0 = Instant::now();
        let reads = ReadLimiter::new(1_000.0, READ_RESERVED_UNITS as f64);
        assert!(reads.admit("herd", t0).is_ok());
        let hints: Vec<Duration> = (0..5).map(|_| reads.admit("herd", t0).unwrap_err()).collect();
        // The bucket is empty: the first turn is when it holds a unit again
        // (1 ms), each next one a reservation's worth (1 s) later.
        assert_eq!(hints[0], Duration::from_millis(1));
        for (i, w) in hints.windows(2).enumerate() {
            assert_eq!(w[1].saturating_sub(w[0]), Duration::from_secs(1), "turn {i}");
        }
        let far: Vec<Duration> = (0..5).map(|_| reads.admit("herd", t0).unwrap_err()).collect();
        assert!(far.iter().all(|w| *w == HINT_MAX), "{far:?}");
        assert!(reads.admit("herd", t0 + hints[1]).is_ok(), "the second in line gets in at its turn");
        // Turns follow what the identity's reads usually cost.
        let costly = ReadLimiter::new(1_000.0, 1_000_000.0);
        for _ in 0..50 {
            costly.charge("big", 4 * READ_RESERVED_UNITS, t0);
        }
        {
            let mut buckets = costly.buckets.lock().unwrap();
            let big = buckets.get_mut("big").unwrap();
            assert!((3_600.0..=4_000.0).contains(&big.usual), "{}", big.usual);
            big.tokens = 0.0;
        }
        let (a, b) = (costly.admit("big", t0).unwrap_err(), costly.admit("big", t0).unwrap_err());
        assert!(b.saturating_sub(a) > Duration::from_secs(3), "{a:?} then {b:?}");
        // A read refused by its lane waits its turn in the same line.
        let c = reads.turn("herd", t0);
        assert_eq!(c, HINT_MAX);
        let fresh = ReadLimiter::new(1_000.0, 1_000_000.0);
        let (a, b) = (fresh.turn("lane", t0), fresh.turn("lane", t0));
        assert_eq!((a, b), (Duration::from_millis(1), Duration::from_secs(1)));
        // Writes too: the k-th refused writer waits about k writes' time.
        let writes = WriteLimiter::new(100.0, 1.0);
        assert!(writes.check("w", 1, t0).is_ok());
        let (a, b) = (writes.check("w", 1, t0).unwrap_err(), writes.check("w", 1, t0).unwrap_err());
        assert_eq!(b.saturating_sub(a), Duration::from_millis(10));
        // Another identity is not in the line.
        assert!(writes.check("v", 1, t0).is_ok());
    }

    #[test]
    fn identities_are_bounded() {
        let l = WriteLimiter::default();
        let t0 = Instant::now();
        for i in 0..IDENTITIES_MAX + 10 {
            assert!(l.check(&format!("u{i}"), 1, t0 + Duration::from_micros(i as u64)).is_ok());
        }
        assert_eq!(l.buckets.lock().unwrap().len(), IDENTITIES_MAX);
    }
}
