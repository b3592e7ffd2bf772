//! Lanes: where a replica's work runs, so that users' reads can never take
//! what heartbeats and Raft need.
//!
//! - [`ReadPool`]: the work of users' reads (scanning a view for a listing,
//!   a scheduling analysis) runs on a few threads of its own, at a lower CPU
//!   priority than the async workers that answer heartbeats and carry Raft's
//!   messages, behind a bounded queue. A flood of listings then fills this
//!   queue and is refused (RESOURCE_EXHAUSTED), while the async workers stay
//!   free and, when the CPU is contended, the kernel gives them most of it.
//! - [`StreamSlots`]: long-lived streams (Watch, Events, Audit; agents'
//!   WatchNode) counted per principal and in total, each slot given back
//!   when its stream ends.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects, clippy::cast_possible_truncation))]

use std::collections::BTreeMap;
use std::sync::mpsc::{sync_channel, SyncSender, TrySendError};
use std::sync::{Arc, Mutex};

use tonic::Status;

/// Threads that run users' read work on one replica. Two keep a listing
/// flood to at most two cores' worth of runnable threads, and at the lower
/// priority below far less when anything else wants the CPU.
pub const READ_THREADS: usize = 2;
/// Read jobs waiting for a thread. A job is a bounded piece of work (one page
/// of a listing, one analysis), a few milliseconds; past this many waiting
/// the replica is saturated, and a caller is better told to retry than queued
/// behind seconds of others' work.
pub const READ_QUEUE_MAX: usize = 256;
/// The read threads' niceness: below the async workers (0), so that on a
/// busy machine the kernel runs heartbeats and Raft first (a nice-10 thread
/// gets about a tenth of a nice-0 one's share). Raising niceness needs no
/// privilege.
pub const READ_THREAD_NICE: i32 = 10;
/// Reads of one caller in the lane (queued or running) at once: the lane is
/// first come, first served, so without this a caller with a thousand
/// pollers would put a thousand reads ahead of everyone else's one. With it,
/// another caller's read waits behind at most this many of each caller's,
/// and one caller never holds every read thread: one stays free for the
/// others (with a thousand pollers of one user running, the other users'
/// listings waited up to 10 ms for a thread when a caller could take both).
pub const READS_PER_CALLER_MAX: usize = READ_THREADS - 1;
const _: () = assert!(READS_PER_CALLER_MAX >= 1 && READS_PER_CALLER_MAX < READ_THREADS);
/// How long a caller's read waits for one of its own places in the lane
/// before it is refused (RESOURCE_EXHAUSTED with a hint): long enough for a
/// caller's own parallel reads to take turns, short enough that a flood of
/// them is turned away rather than held.
pub const READ_TURN_WAIT_MAX: std::time::Duration = std::time::Duration::from_millis(500);
/// Callers whose places are tracked at once; past it the idle ones are
/// forgotten (a forgotten caller starts with all its places free).
pub const READ_CALLERS_TRACKED_MAX: usize = 10_000;

type Work = Box<dyn FnOnce() + Send>;

/// A few places per caller (each caller's share of something: the read
/// lane, analyses, forwards), the callers tracked bounded.
pub struct PerCaller {
    each: usize,
    places: Mutex<BTreeMap<String, Arc<tokio::sync::Semaphore>>>,
}

impl PerCaller {
    pub fn new(each: usize) -> PerCaller {
        PerCaller { each, places: Mutex::default() }
    }

    fn places_of(&self, caller: &str) -> Arc<tokio::sync::Semaphore> {
        let mut places = self.places.lock().expect("per-caller places lock");
        if !places.contains_key(caller) && places.len() >= READ_CALLERS_TRACKED_MAX {
            // Callers holding no place are forgotten (they start afresh).
            let each = self.each;
            places.retain(|_, s| Arc::strong_count(s) > 1 || s.available_permits() < each);
        }
        places.entry(caller.to_string()).or_insert_with(|| Arc::new(tokio::sync::Semaphore::new(self.each))).clone()
    }

    /// One of `caller`'s places now, if one is free.
    pub fn try_take(&self, caller: &str) -> Option<tokio::sync::OwnedSemaphorePermit> {
        self.places_of(caller).try_acquire_owned().ok()
    }

    /// One of `caller`'s places, waited for at most `wait`.
    pub async fn take_within(
        &self,
        caller: &str,
        wait: std::time::Duration,
    ) -> Option<tokio::sync::OwnedSemaphorePermit> {
        let places = self.places_of(caller);
        tokio::time::timeout(wait, places.acquire_owned()).await.ok().and_then(Result::ok)
    }
}

/// The read lane (see the module docs).
pub struct ReadPool {
    tx: SyncSender<Work>,
    /// Each caller's places in the lane (READS_PER_CALLER_MAX).
    turns: PerCaller,
}

impl ReadPool {
    pub fn start() -> ReadPool {
        let (tx, rx) = sync_channel::<Work>(READ_QUEUE_MAX);
        let rx = Arc::new(Mutex::new(rx));
        for i in 0..READ_THREADS {
            let rx = rx.clone();
            std::thread::Builder::new()
                .name(format!("gangway-reads-{i}"))
                .spawn(move || {
                    // This thread only (Linux niceness is per thread).
                    if let Err(e) = rustix::process::setpriority_process(None, READ_THREAD_NICE) {
                        tracing::debug!(error = %e, "read thread: niceness not raised");
                    }
                    loop {
                        // The lock is held only to take the next job.
                        let next = rx.lock().map(|r| r.recv());
                        match next {
                            Ok(Ok(work)) => work(),
                            // The pool was dropped (the replica stopped).
                            _ => return,
                        }
                    }
                })
                .expect("spawning a read thread");
        }
        ReadPool { tx, turns: PerCaller::new(READS_PER_CALLER_MAX) }
    }

    /// One of `caller`'s places in the lane, waited for at most
    /// READ_TURN_WAIT_MAX.
    async fn turn(&self, caller: &str, what: &str) -> Result<tokio::sync::OwnedSemaphorePermit, Status> {
        match self.turns.take_within(caller, READ_TURN_WAIT_MAX).await {
            Some(permit) => Ok(permit),
            None => {
                metrics::counter!("gangway_api_denied_total", "reason" => "busy").increment(1);
                let mut s = Status::resource_exhausted(format!(
                    "{what}: {caller} already has {READS_PER_CALLER_MAX} reads in this replica's read lane; retry \
                     in a moment"
                ));
                if let Ok(v) = "50".parse() {
                    s.metadata_mut().insert(crate::ratelimit::RETRY_AFTER_METADATA_KEY, v);
                }
                Err(s)
            }
        }
    }

    /// Runs `f` on the read lane for `caller` (its identity) and waits for
    /// it without holding an async worker: after one of the caller's places
    /// (READS_PER_CALLER_MAX); RESOURCE_EXHAUSTED when none comes in time or
    /// the queue is full. The caller's place and `hold` (an analysis permit)
    /// are held by the work itself, until it ends: a caller that goes away
    /// while its read waits or runs gets nothing back early (and work whose
    /// caller is gone before it starts is not done at all). `f` charges
    /// what it did itself, for the same reason.
    pub async fn run<T, H, F>(&self, caller: &str, what: &str, hold: H, f: F) -> Result<T, Status>
    where
        T: Send + 'static,
        H: Send + 'static,
        F: FnOnce() -> T + Send + 'static,
    {
        let turn = self.turn(caller, what).await?;
        let (done, rx) = tokio::sync::oneshot::channel();
        let work: Work = Box::new(move || {
            let _held = (turn, hold);
            if done.is_closed() {
                return;
            }
            let _ = done.send(f());
        });
        match self.tx.try_send(work) {
            Ok(()) => {}
            Err(TrySendError::Full(_)) => {
                metrics::counter!("gangway_api_denied_total", "reason" => "busy").increment(1);
                return Err(busy(what));
            }
            Err(TrySendError::Disconnected(_)) => return Err(Status::unavailable("this replica is stopping")),
        }
        rx.await.map_err(|_| Status::internal(format!("{what}: the read failed on this replica")))
    }
}

/// Every read thread is taken and READ_QUEUE_MAX reads wait: retry shortly.
fn busy(what: &str) -> Status {
    let mut s = Status::resource_exhausted(format!(
        "{what}: this replica is answering {READ_QUEUE_MAX} other reads; retry in a moment (or on another replica)"
    ));
    if let Ok(v) = "100".parse() {
        s.metadata_mut().insert(crate::ratelimit::RETRY_AFTER_METADATA_KEY, v);
    }
    s
}

/// Streams open at once, per principal and in total (see the module docs).
pub struct StreamSlots {
    what: &'static str,
    per_principal: usize,
    total: usize,
    open: Arc<Mutex<Open>>,
}

#[derive(Default)]
struct Open {
    by: BTreeMap<String, usize>,
    total: usize,
}

/// One open stream; its slot is given back when dropped.
pub struct StreamSlot {
    open: Arc<Mutex<Open>>,
    principal: String,
}

impl StreamSlots {
    pub fn new(what: &'static str, per_principal: usize, total: usize) -> StreamSlots {
        StreamSlots { what, per_principal, total, open: Arc::default() }
    }

    /// A slot for one more stream of `principal`, or RESOURCE_EXHAUSTED
    /// naming the limit it would pass.
    pub fn take(&self, principal: &str) -> Result<StreamSlot, Status> {
        let mut open = self.open.lock().expect("stream slots lock");
        let mine = open.by.get(principal).copied().unwrap_or(0);
        let why = if mine >= self.per_principal {
            Some(format!(
                "{principal} already has {mine} {} open on this replica (at most {})",
                self.what, self.per_principal
            ))
        } else if open.total >= self.total {
            Some(format!("this replica already serves {} {} (at most {})", open.total, self.what, self.total))
        } else {
            None
        };
        if let Some(why) = why {
            metrics::counter!("gangway_api_denied_total", "reason" => "streams").increment(1);
            return Err(Status::resource_exhausted(format!("streams: {why}; close one or retry later")));
        }
        let mine = open.by.entry(principal.to_string()).or_insert(0);
        *mine = mine.saturating_add(1);
        open.total = open.total.saturating_add(1);
        Ok(StreamSlot { open: self.open.clone(), principal: principal.to_string() })
    }

    /// Streams open now (telemetry, tests).
    pub fn open(&self) -> usize {
        self.open.lock().expect("stream slots lock").total
    }
}

impl Drop for StreamSlot {
    fn drop(&mut self) {
        let mut open = self.open.lock().expect("stream slots lock");
        open.total = open.total.saturating_sub(1);
        if let Some(n) = open.by.get_mut(&self.principal) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                open.by.remove(&self.principal);
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stream_slots_are_bounded_per_principal_and_in_total_and_given_back() {
        let slots = StreamSlots::new("event streams", 2, 3);
        let a1 = slots.take("alice").unwrap();
        let _a2 = slots.take("alice").unwrap();
        // One past alice's share.
        let e = slots.take("alice").err().unwrap();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().contains("at most 2"), "{}", e.message());
        let _b1 = slots.take("bob").unwrap();
        // One past the total.
        let e = slots.take("carol").err().unwrap();
        assert!(e.message().contains("at most 3"), "{}", e.message());
        drop(a1);
        assert_eq!(slots.open(), 2);
        let _c1 = slots.take("carol").unwrap();
    }

    /// The replica's own stream limits, with their real values: every
    /// principal up to its own, all of them up to the total, one past each
    /// refused.
    #[test]
    fn the_replicas_stream_limits_hold_one_past_each() {
        use crate::shared::{STREAMS_MAX, STREAMS_PER_PRINCIPAL_MAX};
        let slots = StreamSlots::new("streams", STREAMS_PER_PRINCIPAL_MAX, STREAMS_MAX);
        let mut held = Vec::new();
        for i in 0..STREAMS_MAX {
            held.push(slots.take(&format!("p{}", i / STREAMS_PER_PRINCIPAL_MAX)).unwrap());
        }
        // One past a principal's own: p0 holds its STREAMS_PER_PRINCIPAL_MAX.
        assert!(slots.take("p0").is_err());
        // One past the total, from a principal holding none.
        let e = slots.take("someone-new").err().unwrap();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        held.pop();
        assert!(slots.take("someone-new").is_ok(), "a slot given back is taken again");
    }

    /// A caller whose READS_PER_CALLER_MAX places are all taken waits for
    /// one at most READ_TURN_WAIT_MAX, then is refused with a hint to retry;
    /// another caller does not wait, and a place given back is taken.
    #[tokio::test]
    async fn a_read_waits_for_its_turn_at_most_read_turn_wait_max() {
        let pool = ReadPool::start();
        let (release, gate) = std::sync::mpsc::channel::<()>();
        let gate = Arc::new(Mutex::new(gate));
        let mut busy = Vec::new();
        for _ in 0..READS_PER_CALLER_MAX {
            let gate = gate.clone();
            let turn = pool.turns.try_take("alice").unwrap();
            busy.push(tokio::task::spawn_blocking(move || {
                let _turn = turn;
                gate.lock().unwrap().recv()
            }));
        }
        let started = std::time::Instant::now();
        let e = pool.run("alice", "list", (), || 1).await.unwrap_err();
        assert!(started.elapsed() >= READ_TURN_WAIT_MAX, "refused before READ_TURN_WAIT_MAX");
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().contains(&format!("already has {READS_PER_CALLER_MAX} reads")), "{}", e.message());
        assert!(e.metadata().get(crate::ratelimit::RETRY_AFTER_METADATA_KEY).is_some());
        assert_eq!(pool.run("bob", "list", (), || 2).await.unwrap(), 2, "another caller waited");
        // A place given back: alice's read goes on.
        let waiting = pool.run("alice", "list", (), || 3);
        release.send(()).unwrap();
        assert_eq!(waiting.await.unwrap(), 3);
        for _ in busy.iter().skip(1) {
            release.send(()).unwrap();
        }
        for b in busy {
            b.await.unwrap().unwrap();
        }
    }

    /// At most READ_CALLERS_TRACKED_MAX callers are remembered: at the
    /// limit all are kept; one more forgets those holding no place, while
    /// one holding a place keeps it (and its count).
    #[test]
    fn per_caller_places_forget_idle_callers_past_the_limit() {
        let lane = PerCaller::new(2);
        let held = lane.try_take("holder").unwrap();
        for i in 1..READ_CALLERS_TRACKED_MAX {
            drop(lane.try_take(&format!("c{i}")).unwrap());
        }
        let tracked = || lane.places.lock().unwrap().len();
        assert_eq!(tracked(), READ_CALLERS_TRACKED_MAX);
        drop(lane.try_take("c1").unwrap());
        assert_eq!(tracked(), READ_CALLERS_TRACKED_MAX, "a caller already known forgets no one");
        drop(lane.try_take("one-more").unwrap());
        assert_eq!(tracked(), 2, "the idle callers were forgotten, the holder kept");
        let _second = lane.try_take("holder").unwrap();
        assert!(lane.try_take("holder").is_none(), "the holder's place still counts");
        drop(held);
    }

    /// The replica's per-caller shares, with their real values: a caller's
    /// forwards to the leader and its analyses, and an agent's node watches,
    /// each taken up to its limit, one past it refused, another caller not.
    #[test]
    fn the_replicas_per_caller_shares_hold_one_past_each() {
        use crate::shared::{ANALYSES_PER_CALLER_MAX, FORWARDS_PER_CALLER_MAX, NODE_WATCHES_PER_AGENT_MAX};
        for each in [FORWARDS_PER_CALLER_MAX, ANALYSES_PER_CALLER_MAX] {
            let lane = PerCaller::new(each);
            let held: Vec<_> = (0..each).map(|_| lane.try_take("alice").unwrap()).collect();
            assert!(lane.try_take("alice").is_none(), "one past {each}");
            assert!(lane.try_take("bob").is_some());
            drop(held);
        }
        let watches = StreamSlots::new("node watches", NODE_WATCHES_PER_AGENT_MAX, 100);
        let held: Vec<_> = (0..NODE_WATCHES_PER_AGENT_MAX).map(|_| watches.take("node:n1").unwrap()).collect();
        let e = watches.take("node:n1").err().unwrap();
        assert!(e.message().contains(&format!("at most {NODE_WATCHES_PER_AGENT_MAX}")), "{}", e.message());
        drop(held);
    }

    /// A caller with many reads takes at most its places in the lane; the
    /// next waits its turn, and another caller's read is not behind them.
    #[tokio::test]
    async fn one_caller_takes_at_most_its_places_in_the_read_lane() {
        let pool = Arc::new(ReadPool::start());
        let gate = Arc::new(tokio::sync::Semaphore::new(0));
        let mut busy = Vec::new();
        for _ in 0..READS_PER_CALLER_MAX {
            let (pool, gate) = (pool.clone(), gate.clone());
            busy.push(tokio::spawn(async move {
                pool.run("flood", "test", (), move || {
                    let rt = tokio::runtime::Builder::new_current_thread().build().unwrap();
                    rt.block_on(async { gate.acquire().await.unwrap().forget() });
                })
                .await
            }));
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        // A thread is left for everyone else while the flood holds its places.
        assert_eq!(pool.run("someone", "test", (), || 6).await.unwrap(), 6);
        // One past the flood's places: refused after the wait, with a hint.
        let e = pool.run("flood", "test", (), || ()).await.unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.metadata().get(crate::ratelimit::RETRY_AFTER_METADATA_KEY).is_some());
        // Its places come back when its reads end; another caller has its own.
        gate.add_permits(READS_PER_CALLER_MAX);
        for b in busy {
            b.await.unwrap().unwrap();
        }
        assert_eq!(pool.run("someone", "test", (), || 7).await.unwrap(), 7);
        assert_eq!(pool.run("flood", "test", (), || 8).await.unwrap(), 8);
    }

    #[tokio::test]
    async fn the_read_lane_refuses_past_its_queue_instead_of_queueing_without_bound() {
        let pool = ReadPool::start();
        // Hold every thread until told.
        let (release_tx, release_rx) = std::sync::mpsc::channel::<()>();
        let release_rx = Arc::new(Mutex::new(release_rx));
        let mut held = Vec::new();
        let mut refused = 0;
        for _ in 0..READ_THREADS + READ_QUEUE_MAX + 1 {
            let rx = release_rx.clone();
            let caller: &'static str = Box::leak(format!("caller-{}", held.len() + refused).into_boxed_str());
            let f = pool.run(caller, "test", (), move || {
                let _ = rx.lock().unwrap().recv();
            });
            // Submitting happens on the first poll.
            let mut f = Box::pin(f);
            match futures::poll!(f.as_mut()) {
                std::task::Poll::Ready(Err(s)) => {
                    assert_eq!(s.code(), tonic::Code::ResourceExhausted);
                    refused += 1;
                }
                std::task::Poll::Ready(Ok(())) => panic!("finished while held"),
                std::task::Poll::Pending => held.push(f),
            }
            // A fresh coop budget for the next first poll.
            tokio::task::yield_now().await;
            // Let the threads take their first jobs before the queue fills.
            if held.len() == READ_THREADS {
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
        assert_eq!(refused, 1, "exactly the one past the threads and the queue is refused");
        for _ in 0..held.len() {
            release_tx.send(()).unwrap();
        }
        for f in held {
            f.await.unwrap();
        }
    }
}
