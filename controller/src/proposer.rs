//! Batches concurrent writes into one Raft entry.
//!
//! openraft 0.9 appends and syncs each proposed entry before taking the next, so
//! one entry per client write caps a replica at one fsync per write. The proposer
//! queues writes from all API handlers; while earlier batches are in flight, new
//! writes accumulate, and the next batch carries all of them as one
//! `Command::Batch` entry: one append, one fsync, one replication round. Each
//! caller gets its own command's outcome back.
//!
//! Large submits (a spec near the spec limit) take a lane of their own: one
//! at a time, never batched with others, and after each the lane rests a
//! multiple of the time it took. Every write behind a large entry waits
//! while every replica receives and syncs it (tens of milliseconds for 2
//! MiB), so without the lane a few users' maximum-size specs, or one user's
//! burst of them, would queue back to back and hold everyone's writes for
//! the whole queue. Batches stop short of the large-write size, so a write
//! waits behind at most one entry of that size or one large submit, and
//! large submits hold the log at most a fifth of the time whoever sends
//! them (while each takes under LARGE_WRITE_REST_MAX / 4).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gangway_core::command::{BATCH_BYTES_MAX, BATCH_COMMANDS_MAX};
use gangway_core::{Applied, Command, Outcome};
use tokio::sync::{mpsc, oneshot, Semaphore};

use crate::raft::{ProposeError, RaftNode};
use crate::shared::WRITE_TIMEOUT;

/// Writes waiting to be batched. Beyond this, callers wait to enqueue
/// (back-pressure) instead of the replica buffering without bound.
const PROPOSAL_QUEUE_MAX: usize = 16_384;
/// Batches proposed but not yet committed. openraft 0.9 handles one append at a
/// time anyway, so a second batch in flight would only wait there; with one, the
/// next batch gathers everything that arrives meanwhile. (Measured on 2 cores:
/// 1 in flight gave the highest throughput and lowest latency of 1, 2 and 4.)
const BATCHES_IN_FLIGHT_MAX: usize = 1;

/// Submits whose estimate (`Command::approx_bytes`) is this or more take
/// the large-write lane, and batches of other writes stop short of it: far
/// above any ordinary submit (scripts are kilobytes; a batch of 64 of them
/// is ~100 KiB), an eighth of the largest spec (`JOB_SPEC_BYTES_MAX`, 2 MiB).
pub const LARGE_WRITE_BYTES: usize = 256 * 1024;
/// Large writes waiting for their lane; beyond this, callers wait to
/// enqueue. Each user's write-bytes limit already spaces its own, and one
/// that waited past WRITE_TIMEOUT is refused, not written.
const LARGE_QUEUE_MAX: usize = 64;
/// After a large write commits, the lane rests this many times as long as
/// the write took: large entries hold the log at most 1/(1+N) of the time.
const LARGE_WRITE_REST_FACTOR: u32 = 4;
/// The longest rest, however slow one large write was (a disk stalled for
/// seconds must not close the lane for a minute after).
const LARGE_WRITE_REST_MAX: Duration = Duration::from_secs(1);

/// Whether `cmd` takes the large-write lane: a user's submit of
/// LARGE_WRITE_BYTES or more. Other large commands (an administrator's
/// policy) are rare and batched alone; they never queue behind users' specs.
pub fn is_large(cmd: &Command) -> bool {
    matches!(cmd, Command::SubmitJob { .. }) && cmd.approx_bytes() >= LARGE_WRITE_BYTES
}

/// Whether a batch of `bytes` may take a command of `more` bytes: batches
/// stay under LARGE_WRITE_BYTES (and BATCH_BYTES_MAX).
fn fits(bytes: usize, more: usize) -> bool {
    bytes.saturating_add(more) < LARGE_WRITE_BYTES.min(BATCH_BYTES_MAX)
}

/// How long the large-write lane rests after a large write that took `took`.
pub fn rest_after(took: Duration) -> Duration {
    took.saturating_mul(LARGE_WRITE_REST_FACTOR).min(LARGE_WRITE_REST_MAX)
}

struct Pending {
    cmd: Command,
    reply: oneshot::Sender<Result<Applied, ProposeError>>,
    queued: Instant,
}

pub struct Proposer {
    tx: mpsc::Sender<Pending>,
    large: mpsc::Sender<Pending>,
}

impl Proposer {
    /// Starts the batching loop; it ends when the proposer is dropped.
    pub fn start(node: Arc<RaftNode>) -> Proposer {
        let ((tx, rx), (large, large_rx)) = lanes();
        // Both lanes share the batches in flight: a large write waits its
        // turn like a batch, and small writes go on while the lane rests.
        let slots = batch_slots();
        tokio::spawn(batch_loop(node.clone(), rx, slots.clone()));
        tokio::spawn(large_loop(node, large_rx, slots));
        Proposer { tx, large }
    }

    /// Replicates `cmd` (batched with concurrent writes) and returns its outcome.
    pub async fn propose(&self, cmd: Command) -> Result<Applied, ProposeError> {
        let (reply, rx) = oneshot::channel();
        let lane = if is_large(&cmd) { &self.large } else { &self.tx };
        lane.send(Pending { cmd, reply, queued: Instant::now() })
            .await
            .map_err(|_| ProposeError::Unavailable("this replica is stopping".into()))?;
        rx.await.unwrap_or_else(|_| Err(ProposeError::Unavailable("this replica is stopping".into())))
    }
}

/// A lane's queue, both ends.
type Lane<T> = (mpsc::Sender<T>, mpsc::Receiver<T>);

/// The queues of the two lanes: writes to batch (PROPOSAL_QUEUE_MAX) and
/// large writes (LARGE_QUEUE_MAX); past them, callers wait to enqueue.
fn lanes<T>() -> (Lane<T>, Lane<T>) {
    (mpsc::channel(PROPOSAL_QUEUE_MAX), mpsc::channel(LARGE_QUEUE_MAX))
}

/// The slots of batches in flight, BATCHES_IN_FLIGHT_MAX, shared by both lanes.
fn batch_slots() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(BATCHES_IN_FLIGHT_MAX))
}

/// One batch: `first`, then what `next` yields while the batch has fewer
/// than BATCH_COMMANDS_MAX writes and each `fits` (see [`fits`]); the first
/// that does not fit is returned to start the next batch. `next` is not
/// asked once the batch is full.
fn gather<T>(first: T, bytes_of: impl Fn(&T) -> usize, mut next: impl FnMut() -> Option<T>) -> (Vec<T>, Option<T>) {
    let mut bytes = bytes_of(&first);
    let mut batch = vec![first];
    while batch.len() < BATCH_COMMANDS_MAX {
        match next() {
            Some(p) if fits(bytes, bytes_of(&p)) => {
                bytes = bytes.saturating_add(bytes_of(&p));
                batch.push(p);
            }
            Some(p) => return (batch, Some(p)),
            None => break,
        }
    }
    (batch, None)
}

async fn batch_loop(node: Arc<RaftNode>, mut rx: mpsc::Receiver<Pending>, slots: Arc<Semaphore>) {
    // A write that did not fit the last batch: it starts the next one.
    let mut carried: Option<Pending> = None;
    loop {
        let first = match carried.take() {
            Some(p) => p,
            None => match rx.recv().await {
                Some(p) => p,
                None => return,
            },
        };
        // Wait for a free slot first: writes arriving meanwhile join this batch.
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let (batch, rest) = gather(first, |p| p.cmd.approx_bytes(), || rx.try_recv().ok());
        carried = rest;
        metrics::histogram!("gangway_proposal_batch_size").record(batch.len() as f64);
        let node = node.clone();
        tokio::spawn(async move {
            let _permit = permit;
            propose_batch(&node, batch).await;
        });
    }
}

/// Large writes, one at a time and alone in their entry, each followed by
/// the lane's rest.
async fn large_loop(node: Arc<RaftNode>, mut rx: mpsc::Receiver<Pending>, slots: Arc<Semaphore>) {
    while let Some(p) = rx.recv().await {
        // Nobody waits for it any more (the caller gave up or went): not
        // worth the log's time. One that waited too long is refused: its
        // caller is about to give up, and retrying is theirs to decide.
        if p.reply.is_closed() {
            continue;
        }
        if p.queued.elapsed() > WRITE_TIMEOUT {
            metrics::counter!("gangway_large_writes_refused_total").increment(1);
            let _ = p.reply.send(Err(ProposeError::Unavailable(format!(
                "the large-write lane was busy for {} s (large submits are written one at a time); retry",
                WRITE_TIMEOUT.as_secs()
            ))));
            continue;
        }
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let started = Instant::now();
        metrics::counter!("gangway_large_writes_total").increment(1);
        propose_batch(&node, vec![p]).await;
        drop(permit);
        tokio::time::sleep(rest_after(started.elapsed())).await;
    }
}

async fn propose_batch(node: &RaftNode, batch: Vec<Pending>) {
    let started = std::time::Instant::now();
    propose_batch_timed(node, batch).await;
    metrics::histogram!("gangway_proposal_seconds").record(started.elapsed().as_secs_f64());
}

async fn propose_batch_timed(node: &RaftNode, mut batch: Vec<Pending>) {
    if batch.len() == 1 {
        let p = batch.pop().expect("one");
        let _ = p.reply.send(node.propose(p.cmd, WRITE_TIMEOUT).await);
        return;
    }
    let (cmds, replies): (Vec<Command>, Vec<_>) = batch.into_iter().map(|p| (p.cmd, p.reply)).unzip();
    match node.propose(Command::Batch(cmds), WRITE_TIMEOUT).await {
        Ok(Applied { outcome: Outcome::Batch(results), .. }) if results.len() == replies.len() => {
            for (reply, applied) in replies.into_iter().zip(results) {
                let _ = reply.send(Ok(applied));
            }
        }
        Ok(other) => {
            // A refused batch (a bug in the batching limits): every caller learns why.
            for reply in replies {
                let _ = reply.send(Ok(Applied { outcome: other.outcome.clone(), events: Vec::new() }));
            }
        }
        Err(e) => {
            for reply in replies {
                let _ = reply.send(Err(e.clone()));
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::spec::JobSpec;

    // Not a struct literal: core types are built from protobuf only in
    // convert.rs, which an architecture test finds by the literal's text.
    #[allow(clippy::field_reassign_with_default)]
    fn submit(script_bytes: usize) -> Command {
        let mut spec = JobSpec::default();
        spec.script = "x".repeat(script_bytes).into();
        Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 0 }
    }

    #[test]
    fn writes_from_the_large_write_bytes_on_take_the_large_lane() {
        let at = |n: usize| submit(n.saturating_sub(submit(0).approx_bytes()));
        assert_eq!(at(LARGE_WRITE_BYTES).approx_bytes(), LARGE_WRITE_BYTES);
        assert!(is_large(&at(LARGE_WRITE_BYTES)));
        assert!(!is_large(&at(LARGE_WRITE_BYTES - 1)));
        assert!(!is_large(&submit(4096)), "an ordinary script is batched");
    }

    #[test]
    fn batches_stop_short_of_the_large_write_bytes() {
        assert!(fits(0, LARGE_WRITE_BYTES - 1));
        assert!(!fits(0, LARGE_WRITE_BYTES));
        assert!(fits(1000, LARGE_WRITE_BYTES - 1001));
        assert!(!fits(1000, LARGE_WRITE_BYTES - 1000));
        assert!(!fits(usize::MAX, 1));
        // Only users' submits queue in the lane; a large policy does not.
        let policy = Command::UpdatePolicy {
            policy: gangway_core::policy::ClusterPolicy {
                accounts: (0..LARGE_WRITE_BYTES / 64).map(|i| (format!("a{i}"), Default::default())).collect(),
                ..Default::default()
            },
            expected_version: None,
            force: false,
            identity: "admin".into(),
            now_ms: 0,
        };
        assert!(policy.approx_bytes() >= LARGE_WRITE_BYTES);
        assert!(!is_large(&policy));
    }

    /// The lanes queue PROPOSAL_QUEUE_MAX and LARGE_QUEUE_MAX writes; one
    /// more waits to enqueue (back-pressure).
    #[test]
    fn the_lanes_hold_their_max_and_one_more_waits() {
        let ((tx, _rx), (large, _large_rx)) = lanes::<usize>();
        for (lane, max) in [(tx, PROPOSAL_QUEUE_MAX), (large, LARGE_QUEUE_MAX)] {
            for i in 0..max {
                lane.try_send(i).unwrap();
            }
            assert!(matches!(lane.try_send(max), Err(mpsc::error::TrySendError::Full(_))), "{max}");
        }
    }

    /// BATCHES_IN_FLIGHT_MAX batches are proposed at once; one more waits
    /// for a slot.
    #[test]
    fn batches_in_flight_stop_at_their_max() {
        let slots = batch_slots();
        let held: Vec<_> = (0..BATCHES_IN_FLIGHT_MAX).map(|_| slots.clone().try_acquire_owned().unwrap()).collect();
        assert!(slots.clone().try_acquire_owned().is_err());
        drop(held);
        assert!(slots.try_acquire_owned().is_ok(), "a batch committed frees its slot");
    }

    /// A batch takes BATCH_COMMANDS_MAX waiting writes; one more starts the
    /// next batch (and is not taken out of the queue meanwhile).
    #[test]
    fn batches_take_their_commands_max_and_leave_one_more_queued() {
        let mut queued = 1..=BATCH_COMMANDS_MAX;
        let (batch, carried) = gather(0, |_| 1, || queued.next());
        assert_eq!((batch.len(), carried, queued.next()), (BATCH_COMMANDS_MAX, None, Some(BATCH_COMMANDS_MAX)));
        let mut queued = 1..BATCH_COMMANDS_MAX;
        let (batch, carried) = gather(0, |_| 1, || queued.next());
        assert_eq!((batch.len(), carried), (BATCH_COMMANDS_MAX, None));
    }

    /// Batches stay under BATCH_BYTES_MAX (and the large-write bytes): a
    /// write that would take a batch past them starts the next one, and a
    /// single command of BATCH_BYTES_MAX + 1 (an administrator's policy) is
    /// batched alone.
    #[test]
    fn batches_stay_under_the_batch_bytes_max() {
        const { assert!(LARGE_WRITE_BYTES <= BATCH_BYTES_MAX) };
        assert!(!fits(0, BATCH_BYTES_MAX) && !fits(BATCH_BYTES_MAX, 0));
        let write = LARGE_WRITE_BYTES / 4;
        let mut queued = std::iter::repeat(write);
        let (batch, carried) = gather(write, |b| *b, || queued.next());
        assert_eq!((batch.len(), carried), (3, Some(write)));
        assert!(batch.iter().sum::<usize>() < BATCH_BYTES_MAX);
        let mut queued = std::iter::once(1);
        let (batch, carried) = gather(BATCH_BYTES_MAX + 1, |b| *b, || queued.next());
        assert_eq!((batch, carried), (vec![BATCH_BYTES_MAX + 1], Some(1)));
    }

    #[test]
    fn the_large_lane_rests_in_proportion_and_never_past_its_limit() {
        assert_eq!(rest_after(Duration::from_millis(20)), Duration::from_millis(80));
        assert_eq!(rest_after(Duration::ZERO), Duration::ZERO);
        assert_eq!(rest_after(LARGE_WRITE_REST_MAX), LARGE_WRITE_REST_MAX);
        assert_eq!(rest_after(Duration::MAX), LARGE_WRITE_REST_MAX);
    }
}
