//! Batches concurrent writes into one Raft entry.
//!
//! openraft 0.9 appends and syncs each proposed entry before taking the next, so
//! one entry per client write caps a replica at one fsync per write. The proposer
//! queues writes from all API handlers; while earlier batches are in flight, new
//! writes accumulate, and the next batch carries all of them as one
//! `Command::Batch` entry: one append, one fsync, one replication round. Each
//! caller gets its own command's outcome back.

use std::sync::Arc;

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

struct Pending {
    cmd: Command,
    reply: oneshot::Sender<Result<Applied, ProposeError>>,
}

pub struct Proposer {
    tx: mpsc::Sender<Pending>,
}

impl Proposer {
    /// Starts the batching loop; it ends when the proposer is dropped.
    pub fn start(node: Arc<RaftNode>) -> Proposer {
        let (tx, rx) = mpsc::channel(PROPOSAL_QUEUE_MAX);
        tokio::spawn(batch_loop(node, rx));
        Proposer { tx }
    }

    /// Replicates `cmd` (batched with concurrent writes) and returns its outcome.
    pub async fn propose(&self, cmd: Command) -> Result<Applied, ProposeError> {
        let (reply, rx) = oneshot::channel();
        self.tx
            .send(Pending { cmd, reply })
            .await
            .map_err(|_| ProposeError::Unavailable("this replica is stopping".into()))?;
        rx.await.unwrap_or_else(|_| Err(ProposeError::Unavailable("this replica is stopping".into())))
    }
}

async fn batch_loop(node: Arc<RaftNode>, mut rx: mpsc::Receiver<Pending>) {
    let slots = Arc::new(Semaphore::new(BATCHES_IN_FLIGHT_MAX));
    while let Some(first) = rx.recv().await {
        // Wait for a free slot first: writes arriving meanwhile join this batch.
        let Ok(permit) = slots.clone().acquire_owned().await else { return };
        let mut bytes = first.cmd.approx_bytes();
        let mut batch = vec![first];
        while batch.len() < BATCH_COMMANDS_MAX && bytes < BATCH_BYTES_MAX {
            match rx.try_recv() {
                Ok(p) => {
                    bytes += p.cmd.approx_bytes();
                    batch.push(p);
                }
                Err(_) => break,
            }
        }
        metrics::histogram!("gangway_proposal_batch_size").record(batch.len() as f64);
        let node = node.clone();
        tokio::spawn(async move {
            let _permit = permit;
            propose_batch(&node, batch).await;
        });
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
