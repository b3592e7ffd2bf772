//! The Raft instance of one replica and the operations the API needs from it.
//! With `raft-store`, this is the only place that names openraft types: the rest
//! of the controller sees [`RaftNode`], [`ProposeError`] and plain values.
//!
//! Related code: `network.rs` (outgoing Raft RPCs), `service.rs` (incoming),
//! `transfer.rs` (moving leadership to another voter).

pub mod network;
pub mod service;
pub mod transfer;

use std::collections::{BTreeMap, BTreeSet};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use gangway_core::{Applied, Command};
use gangway_raft_store::typ::{BasicNode, Raft};
use gangway_raft_store::{SharedState, Stores};
use openraft::error::{ChangeMembershipError, ClientWriteError, RaftError};
use openraft::{ChangeMembers, Config, ServerState, SnapshotPolicy};

use crate::config::Timing;

/// Raft messages can batch many entries; this bounds one message. It is far above
/// `MAX_PAYLOAD_ENTRIES` × a typical command, and above a batch of the largest
/// (1 MiB script) commands that fits in one message.
pub const RAFT_MESSAGE_BYTES_MAX: usize = 512 * 1024 * 1024;
/// Entries per AppendEntries message: large batches make replication cheap under
/// load. One entry is a proposer batch of at most BATCH_BYTES_MAX plus the one
/// command that crossed it (a spec of at most JOB_SPEC_BYTES_MAX, with room),
/// and this many of the largest still fit in one message: a follower catching
/// up is never sent a message the transport refuses (it would be resent forever).
const MAX_PAYLOAD_ENTRIES: u64 = 64;
const _: () = assert!(
    (MAX_PAYLOAD_ENTRIES as usize)
        * (gangway_core::command::BATCH_BYTES_MAX + 2 * gangway_core::limits::JOB_SPEC_BYTES_MAX)
        <= RAFT_MESSAGE_BYTES_MAX
);

#[derive(Debug, Clone, thiserror::Error)]
pub enum ProposeError {
    /// This replica is not the leader; the leader's address, if known.
    #[error("not the leader")]
    NotLeader { leader_addr: Option<String> },
    /// The request could not be completed now (no quorum, shutting down); retry.
    #[error("{0}")]
    Unavailable(String),
    /// The cluster refused the change (e.g. an invalid membership change).
    #[error("{0}")]
    Refused(String),
}

/// A replica's part in Raft right now (openraft's server state, in Gangway's words).
pub use gangway_proto::ReplicaRole as RaftRole;

/// A replica's view of itself, for status reporting.
#[derive(Debug, Clone)]
pub struct RaftStatus {
    pub id: u64,
    pub role: RaftRole,
    pub term: u64,
    pub leader_id: Option<u64>,
    pub last_log_index: Option<u64>,
    pub committed_index: Option<u64>,
    pub applied_index: Option<u64>,
    pub snapshot_index: Option<u64>,
    pub voters: BTreeSet<u64>,
    pub learners: BTreeSet<u64>,
    pub addrs: BTreeMap<u64, String>,
    /// Leader only: the highest log index each member is known to hold.
    pub matched: BTreeMap<u64, Option<u64>>,
}

/// How long one leadership confirmation may take (a quorum that does not
/// answer): the readers waiting for it are refused UNAVAILABLE, and retry.
const CONFIRM_TIMEOUT: Duration = Duration::from_secs(10);

/// A confirmed round lets reads skip the next rounds for this fraction of the
/// election timeout (its minimum), counted from when the round *started*:
/// the read lease. Why that is safe: the round succeeded, so a quorum took a
/// message this leader sent after it started, and each of them then refuses
/// to vote for anyone else for openraft's leader lease
/// (`election_timeout_max`) and starts no election of its own before that
/// plus an election timeout; so no other leader can exist, and no write can
/// be acknowledged without this replica, until at least the round's start
/// plus `election_timeout_min`. Half of that leaves the other half for
/// clock rates and for a read that checks the lease just before it expires
/// (etcd and TiKV serve reads on the same kind of lease). Under load a
/// round then runs about once per lease instead of once per burst of reads.
///
/// The leader's own vote is the exception: openraft 0.9 refreshes a
/// leader's vote time only when it is elected, so a leader may grant its
/// vote to a higher-term candidate at once (a leadership transfer asks for
/// that; so can a candidate that hears nothing from it), and the candidate
/// with it has a quorum without the followers the round refreshed. So a
/// read on the lease asks openraft's core, in the same queue its vote
/// requests are handled in, whether this replica still holds its own vote
/// of that term (a granted vote replaces it before the candidate can win),
/// and no lease is taken or used while heartbeats are paused for a transfer.
pub const READ_LEASE_DIVISOR: u32 = 2;

/// How long a confirmed round covers later reads (see [`READ_LEASE_DIVISOR`]).
pub fn read_lease(timing: &Timing) -> Duration {
    Duration::from_millis(timing.election_timeout_min_ms.min(timing.election_timeout_max_ms)) / READ_LEASE_DIVISOR
}

/// Whether a read may skip the confirmation round: this replica still leads
/// in the term a round was confirmed in, and that round's lease has not run
/// out. (Everything a client was told is written was applied here before it
/// was told, and the confirmed round made sure the earlier terms' entries
/// were; so the newest view holds every write acknowledged before the read.)
pub fn lease_covers(lease: Option<(u64, Instant)>, leads_in_term: Option<u64>, now: Instant) -> bool {
    match (lease, leads_in_term) {
        (Some((term, until)), Some(current)) => term == current && now < until,
        _ => false,
    }
}

/// Threads of the runtime Raft runs on (see [`RaftRuntime`]): its core,
/// replication to each follower and the state machine's apply.
pub const RAFT_THREADS: usize = 2;

/// The runtime openraft's tasks run on: its own, so a flood of users'
/// requests queued on the API's workers never delays an election, a
/// replication round or an apply. Shut down in the background when the
/// node is dropped (a runtime may not block inside another).
struct RaftRuntime(Option<tokio::runtime::Runtime>);

impl Drop for RaftRuntime {
    fn drop(&mut self) {
        if let Some(rt) = self.0.take() {
            rt.shutdown_background();
        }
    }
}

pub struct RaftNode {
    pub id: u64,
    raft: Raft,
    /// Dropped after `raft` (fields drop in order).
    _runtime: RaftRuntime,
    state: Arc<SharedState>,
    committed_index: Arc<AtomicU64>,
    pub timing: Timing,
    /// Whether this replica sends heartbeats as leader (off only while a
    /// leadership transfer lets its lease run out; see [`HeartbeatPause`]).
    heartbeats: std::sync::atomic::AtomicBool,
    /// Linearizable reads waiting for a leadership confirmation share one
    /// (see [`RaftNode::ensure_linearizable`]).
    reads: ReadRounds,
}

/// Leadership confirmations for linearizable reads, one at a time, each
/// serving every read that arrived before it started (etcd batches its
/// ReadIndex requests the same way). A confirmation is a round of messages to
/// every follower: without this a thousand readers would ask for a thousand
/// rounds at once, and the leader's heartbeats to its followers would queue
/// behind them until it lost its quorum.
#[derive(Default)]
struct ReadRounds {
    /// Reads that arrived so far (each takes the next number).
    arrived: AtomicU64,
    /// The last round: the arrivals it covers (those numbered up to it) and
    /// its outcome. Held while a round runs, so the next readers wait for it.
    last: tokio::sync::Mutex<(u64, Option<Result<(), ProposeError>>)>,
    /// The read lease the last confirmed round gave: its term, and until
    /// when (see [`READ_LEASE_DIVISOR`]). Only read and replaced, never
    /// held across an await.
    lease: std::sync::Mutex<Option<(u64, Instant)>>,
}

/// Heartbeats paused for as long as this lives (a leadership transfer lets
/// the followers' lease run out): however the transfer ends (an answer, an
/// error, a cancelled call dropping it mid-way), they resume.
#[must_use = "heartbeats resume when the pause is dropped"]
pub struct HeartbeatPause<'a> {
    node: &'a RaftNode,
}

impl Drop for HeartbeatPause<'_> {
    fn drop(&mut self) {
        self.node.set_heartbeats(true);
    }
}

impl RaftNode {
    pub async fn start(
        id: u64,
        timing: Timing,
        stores: Stores,
        security: gangway_proto::tls::Security,
    ) -> anyhow::Result<RaftNode> {
        let config = Config {
            cluster_name: "gangway".into(),
            heartbeat_interval: timing.heartbeat_interval_ms,
            election_timeout_min: timing.election_timeout_min_ms,
            election_timeout_max: timing.election_timeout_max_ms,
            snapshot_policy: SnapshotPolicy::LogsSinceLast(timing.snapshot_logs_since_last),
            max_in_snapshot_log_to_keep: timing.logs_kept_after_snapshot,
            max_payload_entries: MAX_PAYLOAD_ENTRIES,
            ..Config::default()
        }
        .validate()?;
        let state = stores.state_machine.shared();
        let committed_index = stores.log.committed_index();
        let runtime = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(RAFT_THREADS)
            .thread_name(format!("gangway-raft-{id}"))
            .enable_all()
            .build()?;
        // Created on its runtime, so every task openraft spawns (and every
        // connection its network opens) runs there.
        let network = network::Network { security };
        let raft = runtime
            .spawn(async move { Raft::new(id, Arc::new(config), network, stores.log, stores.state_machine).await })
            .await
            .map_err(|e| anyhow::anyhow!("starting Raft: {e}"))??;
        let heartbeats = std::sync::atomic::AtomicBool::new(true);
        Ok(RaftNode {
            id,
            raft,
            _runtime: RaftRuntime(Some(runtime)),
            state,
            committed_index,
            timing,
            heartbeats,
            reads: ReadRounds::default(),
        })
    }

    pub fn state(&self) -> &Arc<SharedState> {
        &self.state
    }

    /// Runs `work` on Raft's own runtime (the peer port's server runs there,
    /// so a flood of users' requests never delays a peer's append).
    pub fn spawn_on_raft<F>(&self, work: F) -> tokio::task::JoinHandle<F::Output>
    where
        F: std::future::Future + Send + 'static,
        F::Output: Send + 'static,
    {
        match &self._runtime.0 {
            Some(rt) => rt.spawn(work),
            None => tokio::spawn(work),
        }
    }

    pub(crate) fn raft(&self) -> &Raft {
        &self.raft
    }

    pub async fn is_initialized(&self) -> bool {
        self.raft.is_initialized().await.unwrap_or(false)
    }

    /// Forms a new cluster of `peers` (first start only).
    pub async fn initialize(&self, peers: &BTreeMap<u64, String>) -> anyhow::Result<()> {
        let members: BTreeMap<u64, BasicNode> =
            peers.iter().map(|(id, addr)| (*id, BasicNode { addr: addr.clone() })).collect();
        match self.raft.initialize(members).await {
            Ok(()) => Ok(()),
            // Another start already initialized this replica's log: nothing to do.
            Err(RaftError::APIError(openraft::error::InitializeError::NotAllowed(_))) => Ok(()),
            Err(e) => Err(anyhow::anyhow!("forming the cluster: {e}")),
        }
    }

    fn leader_addr(&self, leader_id: Option<u64>) -> Option<String> {
        let leader = leader_id?;
        let m = self.raft.metrics().borrow().membership_config.clone();
        m.membership().get_node(&leader).map(|n| crate::config::ReplicaAddr::api_of(&n.addr))
    }

    fn map_write_error(&self, e: RaftError<u64, ClientWriteError<u64, BasicNode>>) -> ProposeError {
        match e {
            RaftError::APIError(ClientWriteError::ForwardToLeader(f)) => ProposeError::NotLeader {
                leader_addr: f
                    .leader_node
                    .map(|n| crate::config::ReplicaAddr::api_of(&n.addr))
                    .or_else(|| self.leader_addr(f.leader_id)),
            },
            // Another membership change (or the leader's first entry) is still
            // committing: retryable, and the client library retries it.
            RaftError::APIError(ClientWriteError::ChangeMembershipError(e @ ChangeMembershipError::InProgress(_))) => {
                ProposeError::Unavailable(format!("{e}; retry"))
            }
            RaftError::APIError(ClientWriteError::ChangeMembershipError(e)) => ProposeError::Refused(e.to_string()),
            RaftError::Fatal(f) => ProposeError::Unavailable(format!("this replica is stopping: {f}")),
        }
    }

    /// Replicates `cmd` and returns what applying it did. Leader only. It is
    /// written in the cluster's data format, which every member reads.
    pub async fn propose(&self, cmd: Command, timeout: Duration) -> Result<Applied, ProposeError> {
        let format = self.state.read().format;
        // Never write an entry some replicas cannot read (the API refuses
        // such requests first; this holds for every caller).
        if let Err(e) = cmd.writable_in(format) {
            if self.is_leader() {
                return Err(ProposeError::Refused(e));
            }
        }
        let fut = self.raft.client_write(gangway_core::payload::Payload::new(cmd, format));
        match tokio::time::timeout(timeout, fut).await {
            Err(_) => Err(ProposeError::Unavailable(
                "the write was not committed in time (no quorum?); its outcome is unknown, retry with the same idempotency key".into(),
            )),
            Ok(Ok(resp)) => Ok(resp.data.expect("a normal entry is answered with an outcome")),
            Ok(Err(e)) => Err(self.map_write_error(e)),
        }
    }

    /// Waits until this replica, as leader, has applied everything committed
    /// before the call: a read after this is linearizable. Concurrent reads
    /// share confirmations: a round that started after a read arrived
    /// answers for it, and one round runs at a time.
    pub async fn ensure_linearizable(&self, timeout: Duration) -> Result<(), ProposeError> {
        if self.lease_holds().await {
            metrics::counter!("gangway_linearizable_reads_total", "by" => "lease").increment(1);
            return Ok(());
        }
        metrics::counter!("gangway_linearizable_reads_total", "by" => "round").increment(1);
        let mine = self.reads.arrived.fetch_add(1, Ordering::SeqCst).saturating_add(1);
        let shared = async {
            let mut last = self.reads.last.lock().await;
            if last.0 >= mine {
                if let Some(outcome) = &last.1 {
                    return outcome.clone();
                }
            }
            // Every read that arrived so far is covered by a round that
            // starts now.
            let covers = self.reads.arrived.load(Ordering::SeqCst);
            let (started, term) = (Instant::now(), self.leads_in_term());
            let outcome = self.confirm_leadership().await;
            if outcome.is_ok() && term.is_some() && self.leads_in_term() == term && self.heartbeats_on() {
                let until = started.checked_add(read_lease(&self.timing)).unwrap_or(started);
                if let (Some(term), Ok(mut lease)) = (term, self.reads.lease.lock()) {
                    *lease = Some((term, until));
                }
            }
            *last = (covers, Some(outcome.clone()));
            outcome
        };
        match tokio::time::timeout(timeout, shared).await {
            Ok(outcome) => outcome,
            Err(_) => Err(ProposeError::Unavailable("leadership could not be confirmed in time; retry".into())),
        }
    }

    /// One leadership confirmation: a round to a quorum, then the wait until
    /// everything committed before it is applied here.
    async fn confirm_leadership(&self) -> Result<(), ProposeError> {
        match tokio::time::timeout(CONFIRM_TIMEOUT, self.raft.ensure_linearizable()).await {
            Err(_) => Err(ProposeError::Unavailable("leadership could not be confirmed in time; retry".into())),
            Ok(Ok(_)) => Ok(()),
            Ok(Err(RaftError::APIError(openraft::error::CheckIsLeaderError::ForwardToLeader(f)))) => {
                Err(ProposeError::NotLeader {
                    leader_addr: f
                        .leader_node
                        .map(|n| crate::config::ReplicaAddr::api_of(&n.addr))
                        .or_else(|| self.leader_addr(f.leader_id)),
                })
            }
            Ok(Err(RaftError::APIError(e))) => Err(ProposeError::Unavailable(e.to_string())),
            Ok(Err(RaftError::Fatal(f))) => Err(ProposeError::Unavailable(format!("this replica is stopping: {f}"))),
        }
    }

    /// Whether the last confirmed round's read lease still covers a read
    /// now: in time, no transfer under way, and this replica still holding
    /// its own committed vote of the lease's term in openraft's core (see
    /// [`READ_LEASE_DIVISOR`]).
    pub async fn lease_holds(&self) -> bool {
        let lease = self.reads.lease.lock().map(|l| *l).unwrap_or(None);
        if !self.heartbeats_on() || !lease_covers(lease, self.leads_in_term(), Instant::now()) {
            return false;
        }
        let (me, term) = (self.id, lease.map_or(0, |l| l.0));
        let own_vote = self
            .raft
            .with_raft_state(move |st| {
                let vote = st.vote_ref();
                st.server_state == ServerState::Leader
                    && vote.is_committed()
                    && vote.leader_id().voted_for() == Some(me)
                    && vote.leader_id().get_term() == term
            })
            .await;
        own_vote.unwrap_or(false) && lease_covers(lease, self.leads_in_term(), Instant::now())
    }

    /// This replica's term while it leads (None while it does not).
    fn leads_in_term(&self) -> Option<u64> {
        let m = self.raft.metrics();
        let m = m.borrow();
        (m.state == ServerState::Leader && m.current_leader == Some(self.id)).then_some(m.current_term)
    }

    pub fn is_leader(&self) -> bool {
        let m = self.raft.metrics();
        let m = m.borrow();
        m.state == ServerState::Leader && m.current_leader == Some(self.id)
    }

    /// Whether this replica is leader and a quorum acknowledged it within
    /// `within`. A leader cut off from the other replicas keeps its role until
    /// it hears of a newer term; this tells it that it may already be deposed.
    pub fn leads_with_quorum(&self, within: Duration) -> bool {
        let m = self.raft.metrics();
        let m = m.borrow();
        m.state == ServerState::Leader
            && m.current_leader == Some(self.id)
            && m.millis_since_quorum_ack.is_some_and(|ms| u128::from(ms) <= within.as_millis())
    }

    /// Whether the cluster's membership names a peer port for this replica
    /// (its Raft messages go there, not to its API port).
    pub fn membership_names_peer_port(&self) -> bool {
        let m = self.raft.metrics().borrow().membership_config.clone();
        m.membership()
            .get_node(&self.id)
            .is_some_and(|n| crate::config::ReplicaAddr::parse(&n.addr).is_ok_and(|a| a.split))
    }

    /// Whether the replica a server certificate names (`server:NAME`) is a
    /// member of the cluster as this replica knows it (voter or learner), or
    /// this replica knows no membership yet (it is forming or joining).
    /// Membership, not the certificate's expiry, decides: a removed
    /// replica's certificate opens nothing from the moment its removal is
    /// in this replica's log.
    pub fn admits_server(&self, name: &str) -> bool {
        let m = self.raft.metrics();
        let m = m.borrow();
        let membership = m.membership_config.membership();
        let mut nodes = membership.nodes().peekable();
        if nodes.peek().is_none() {
            return true;
        }
        name.parse::<u64>().is_ok_and(|id| membership.get_node(&id).is_some())
    }

    /// The known leader's address when it is another replica.
    pub fn remote_leader(&self) -> Option<String> {
        let leader = self.raft.metrics().borrow().current_leader;
        match leader {
            Some(l) if l != self.id => self.leader_addr(Some(l)),
            _ => None,
        }
    }

    pub fn status(&self) -> RaftStatus {
        let m = self.raft.metrics().borrow().clone();
        let membership = m.membership_config.membership();
        let voters: BTreeSet<u64> = membership.voter_ids().collect();
        let learners: BTreeSet<u64> = membership.learner_ids().collect();
        let addrs = membership.nodes().map(|(id, n)| (*id, crate::config::ReplicaAddr::api_of(&n.addr))).collect();
        let role = match m.state {
            ServerState::Leader => RaftRole::Leader,
            ServerState::Follower => RaftRole::Follower,
            ServerState::Candidate => RaftRole::Candidate,
            ServerState::Learner => RaftRole::Learner,
            ServerState::Shutdown => RaftRole::Shutdown,
        };
        let committed = self.committed_index.load(Ordering::Relaxed);
        RaftStatus {
            id: self.id,
            role,
            term: m.current_term,
            leader_id: m.current_leader,
            last_log_index: m.last_log_index,
            committed_index: (committed > 0).then_some(committed),
            applied_index: m.last_applied.map(|l| l.index),
            snapshot_index: m.snapshot.map(|l| l.index),
            voters,
            learners,
            addrs,
            matched: m
                .replication
                .as_ref()
                .map(|r| r.iter().map(|(id, l)| (*id, l.map(|l| l.index))).collect())
                .unwrap_or_default(),
        }
    }

    /// Waits (bounded) until the metrics satisfy `pred`.
    pub async fn wait_for(&self, timeout: Duration, pred: impl Fn(&RaftStatus) -> bool) -> bool {
        let deadline = tokio::time::Instant::now() + timeout;
        let mut rx = self.raft.metrics();
        loop {
            if pred(&self.status()) {
                return true;
            }
            if tokio::time::timeout_at(deadline, rx.changed()).await.is_err() {
                return pred(&self.status());
            }
        }
    }

    pub async fn add_learner(&self, id: u64, addr: String) -> Result<u64, ProposeError> {
        let r = self.raft.add_learner(id, BasicNode { addr }, true).await.map_err(|e| self.map_write_error(e))?;
        Ok(r.log_id.index)
    }

    pub async fn promote(&self, id: u64) -> Result<u64, ProposeError> {
        let r = self
            .raft
            .change_membership(ChangeMembers::AddVoterIds(BTreeSet::from([id])), false)
            .await
            .map_err(|e| self.map_write_error(e))?;
        Ok(r.log_id.index)
    }

    pub async fn remove_member(&self, id: u64) -> Result<u64, ProposeError> {
        let status = self.status();
        let change = if status.voters.contains(&id) {
            ChangeMembers::RemoveVoters(BTreeSet::from([id]))
        } else if status.learners.contains(&id) {
            ChangeMembers::RemoveNodes(BTreeSet::from([id]))
        } else {
            return Err(ProposeError::Refused(format!("id: replica {id} is not a member of the cluster")));
        };
        let r = self.raft.change_membership(change, false).await.map_err(|e| self.map_write_error(e))?;
        Ok(r.log_id.index)
    }

    fn set_heartbeats(&self, enabled: bool) {
        self.heartbeats.store(enabled, std::sync::atomic::Ordering::SeqCst);
        self.raft.runtime_config().heartbeat(enabled);
    }

    /// Stops heartbeats until the returned guard is dropped (and ends the
    /// read lease: the transfer's target may win with this replica's vote).
    pub fn pause_heartbeats(&self) -> HeartbeatPause<'_> {
        self.set_heartbeats(false);
        if let Ok(mut lease) = self.reads.lease.lock() {
            *lease = None;
        }
        HeartbeatPause { node: self }
    }

    /// Whether heartbeats are on (they are, except during a transfer).
    pub fn heartbeats_on(&self) -> bool {
        self.heartbeats.load(std::sync::atomic::Ordering::SeqCst)
    }

    pub async fn trigger_election(&self) -> Result<(), ProposeError> {
        self.raft.trigger().elect().await.map_err(|e| ProposeError::Unavailable(e.to_string()))
    }

    /// Builds a snapshot now and waits (bounded) until it exists; returns its index.
    pub async fn snapshot(&self, timeout: Duration) -> Result<u64, ProposeError> {
        let applied = self.status().applied_index.unwrap_or(0);
        self.raft.trigger().snapshot().await.map_err(|e| ProposeError::Unavailable(e.to_string()))?;
        if self.wait_for(timeout, |s| s.snapshot_index.unwrap_or(0) >= applied).await {
            Ok(self.status().snapshot_index.unwrap_or(0))
        } else {
            Err(ProposeError::Unavailable("the snapshot did not finish in time".into()))
        }
    }

    pub async fn shutdown(&self) {
        let _ = self.raft.shutdown().await;
    }

    /// Resolves when Raft has stopped on a fatal error (a storage error, a
    /// panic in the state machine), with its description; never on a normal
    /// shutdown.
    pub async fn fatal(&self) -> String {
        let mut rx = self.raft.metrics();
        loop {
            if let Err(e) = &rx.borrow_and_update().running_state {
                if !matches!(e, openraft::error::Fatal::Stopped) {
                    return e.to_string();
                }
            }
            if rx.changed().await.is_err() {
                return std::future::pending().await;
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_read_lease_covers_reads_only_in_its_term_and_before_it_ends() {
        let now = Instant::now();
        let until = now + Duration::from_millis(100);
        assert!(lease_covers(Some((3, until)), Some(3), now));
        // One instant past its end, in another term, or not leading: a round.
        assert!(!lease_covers(Some((3, until)), Some(3), until));
        assert!(!lease_covers(Some((3, until)), Some(4), now));
        assert!(!lease_covers(Some((3, until)), None, now));
        assert!(!lease_covers(None, Some(3), now));
    }

    #[test]
    fn the_read_lease_ends_well_before_any_other_replica_may_lead() {
        // Followers refuse other candidates for election_timeout_max after
        // hearing from the leader, and campaign no sooner than that plus an
        // election timeout: the lease must end before the shortest of these.
        for timing in [
            Timing::default(),
            Timing { election_timeout_min_ms: 150, election_timeout_max_ms: 300, ..Timing::default() },
            Timing { election_timeout_min_ms: 1000, election_timeout_max_ms: 200, ..Timing::default() },
        ] {
            let lease = read_lease(&timing);
            let shortest = timing.election_timeout_min_ms.min(timing.election_timeout_max_ms);
            assert!(lease.as_millis() * 2 <= u128::from(shortest), "{timing:?}: {lease:?}");
            assert!(!lease.is_zero());
        }
    }
}
