//! Moving leadership to another voter: a Raft procedure, kept here with the
//! rest of Raft, not in the API handler that asks for it.
//!
//! The leader waits until the target holds the whole log, stops sending
//! heartbeats so the followers' leader lease runs out (a [`HeartbeatPause`],
//! which restores them however the procedure ends: an answer, an error, or
//! the caller's future dropped), asks the target to stand for election, and
//! waits for it to win. A write arriving mid-transfer refreshes the
//! followers' lease and can spoil one attempt, so a few are made.
//!
//! [`HeartbeatPause`]: super::HeartbeatPause

use std::future::Future;
use std::time::Duration;

use super::{RaftNode, RaftRole};

/// How long the target may take to catch up with the log.
const CATCH_UP_TIMEOUT: Duration = Duration::from_secs(5);
/// How long the target may take to win its election.
const ELECTION_TIMEOUT: Duration = Duration::from_secs(3);
/// Attempts at a transfer (see the module docs), one after another (each
/// waits for the log and the election itself).
const ATTEMPTS_MAX: u64 = 3;
const ATTEMPTS: gangway_proto::retry::Retry = gangway_proto::retry::Retry::new(ATTEMPTS_MAX, Duration::ZERO);
/// Margin past the followers' lease before the target is asked to stand.
const LEASE_MARGIN: Duration = Duration::from_millis(50);

/// Leadership moved: who leads now, in which term.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Moved {
    pub leader_id: u64,
    pub term: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransferError {
    #[error("to: replica {0} is not a voter")]
    NotVoter(u64),
    #[error("replica {0} did not catch up with the log in time")]
    NotCaughtUp(u64),
    #[error("replica {winner} won the election instead of {to}; run the transfer again")]
    OtherWon { winner: u64, to: u64 },
    #[error("leadership did not move to replica {0}; retry when the cluster is quieter")]
    DidNotMove(u64),
}

/// Moves leadership from this replica (the leader) to voter `to`.
/// `ask_to_stand` asks the target to start an election (an RPC to it) and
/// says whether it was asked.
pub async fn transfer_leadership<F, Fut>(node: &RaftNode, to: u64, mut ask_to_stand: F) -> Result<Moved, TransferError>
where
    F: FnMut() -> Fut,
    Fut: Future<Output = bool>,
{
    let status = node.status();
    if to == status.id {
        return Ok(Moved { leader_id: to, term: status.term });
    }
    if !status.voters.contains(&to) {
        return Err(TransferError::NotVoter(to));
    }
    let lease = Duration::from_millis(node.timing.election_timeout_max_ms);
    let mut tries = ATTEMPTS.tries();
    while tries.next().await {
        // The target must hold the whole log, or it cannot win.
        let caught_up =
            node.wait_for(CATCH_UP_TIMEOUT, |s| s.matched.get(&to).copied().flatten() >= s.last_log_index).await;
        if !caught_up {
            return Err(TransferError::NotCaughtUp(to));
        }
        let paused = node.pause_heartbeats();
        tokio::time::sleep(lease + LEASE_MARGIN).await;
        let won = ask_to_stand().await
            && node
                .wait_for(ELECTION_TIMEOUT, |s| {
                    s.leader_id == Some(to) || s.leader_id.is_some_and(|l| l != status.id && s.term > status.term)
                })
                .await;
        drop(paused);
        let now = node.status();
        if won && now.leader_id == Some(to) {
            return Ok(Moved { leader_id: to, term: now.term });
        }
        if now.leader_id != Some(status.id) && now.role != RaftRole::Leader {
            if let Some(winner) = now.leader_id {
                return Err(TransferError::OtherWon { winner, to });
            }
        }
    }
    Err(TransferError::DidNotMove(to))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A transfer makes ATTEMPTS_MAX attempts, without a pause between
    /// (each waits for the log and the election), and no more.
    #[tokio::test]
    async fn a_transfer_makes_attempts_max_attempts() {
        assert_eq!(gangway_proto::retry::count_tries(ATTEMPTS).await, ATTEMPTS_MAX);
        assert_eq!(ATTEMPTS.span(), Duration::ZERO);
    }
}
