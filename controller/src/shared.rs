//! What one replica's API handlers, leader duties and telemetry share: its
//! Raft node, the proposer, its security and limits, the heartbeat memory and
//! the last scheduling pass's reasons. It imports none of them: `api`,
//! `leader` and `telemetry` import it, and `replica.rs` (which starts
//! everything) is wiring that nothing else imports.

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gangway_core::sched::Pending;
use tonic::transport::Channel;
use tonic::Status;

use crate::config::{ReplicaConfig, Timing};
use crate::raft::RaftNode;

/// A write waits this long for its commit before answering UNAVAILABLE (outcome
/// unknown; a retry with the same idempotency key is safe).
pub const WRITE_TIMEOUT: Duration = Duration::from_secs(10);
/// A forwarded call waits a little longer than the leader's own write timeout.
pub const FORWARD_TIMEOUT: Duration = Duration::from_secs(12);
/// Analyses one replica runs at once, leader or follower: scheduling analyses
/// (explain, test-submit, a listing's pending reasons computed on a replica
/// without the leader's) are a full pass each (~70 ms at 100,000 pending
/// jobs), and history queries hold a database connection for up to their
/// statement timeout. One pool for all, so together they keep the replica's
/// CPU and its writes for its log.
pub const ANALYSES_MAX: usize = 4;
/// Calls one caller may have on their way to the leader from one follower at
/// once: a follower forwards everyone's over one connection (its HTTP/2
/// streams are bounded), so no caller may take them all.
pub const FORWARDS_PER_CALLER_MAX: usize = 32;
/// Analyses one caller runs at once on one replica: the pool is everyone's,
/// so one caller never holds all of it.
pub const ANALYSES_PER_CALLER_MAX: usize = 1;
/// Users' streams (Watch, Events, Audit) one principal may hold open on one
/// replica: a few terminals and console tabs each, far below a flood.
pub const STREAMS_PER_PRINCIPAL_MAX: usize = 32;
/// Users' streams one replica serves at once: each is a task and a bounded
/// buffer (WATCH_STREAM_BUFFER_MAX events), so this bounds their memory.
pub const STREAMS_MAX: usize = 1_024;
/// An agent's WatchNode streams open at once on one replica: one per node,
/// and one more while a reconnect overlaps the old stream's end.
pub const NODE_WATCHES_PER_AGENT_MAX: usize = 2;
/// Peers, agents' leaders and forwarding targets this replica keeps channels to.
/// Clusters have 3–5 replicas; the bound only guards against address churn.
const CHANNELS_MAX: usize = 64;
/// Nodes whose heartbeat times the leader keeps in memory (matches the core's NODES_MAX).
const HEARTBEATS_MAX: usize = gangway_core::limits::NODES_MAX;

/// Channels to other replicas by address, at most [`CHANNELS_MAX`]: past
/// it the one used least recently is dropped (a lazy channel reconnects
/// when next asked for).
#[derive(Default)]
struct Channels {
    /// Each channel with the count of asks when it was last asked for.
    by_addr: BTreeMap<String, (Channel, u64)>,
    asks: u64,
}

impl Channels {
    fn get_or_make(&mut self, addr: &str, make: impl FnOnce() -> Result<Channel, Status>) -> Result<Channel, Status> {
        self.asks = self.asks.saturating_add(1);
        if let Some((ch, used)) = self.by_addr.get_mut(addr) {
            *used = self.asks;
            return Ok(ch.clone());
        }
        let ch = make()?;
        if self.by_addr.len() >= CHANNELS_MAX {
            let oldest = self.by_addr.iter().min_by_key(|(_, (_, used))| *used).map(|(a, _)| a.clone());
            if let Some(oldest) = oldest {
                self.by_addr.remove(&oldest);
            }
        }
        self.by_addr.insert(addr.to_string(), (ch.clone(), self.asks));
        Ok(ch)
    }
}

/// An analysis's places (see [`Replica::analysis_permit`]); given back when dropped.
pub struct AnalysisPermit {
    _pool: tokio::sync::OwnedSemaphorePermit,
    _mine: tokio::sync::OwnedSemaphorePermit,
}

pub struct Replica {
    pub node: Arc<RaftNode>,
    /// Batches API writes into Raft entries.
    pub proposer: crate::proposer::Proposer,
    /// The advertised address of this replica.
    pub addr: String,
    pub timing: Timing,
    /// How this replica talks to its peers and checks its callers.
    pub security: gangway_proto::tls::Security,
    /// Users that are admins even when the policy names none (`--bootstrap-admin`).
    pub bootstrap_admins: Vec<String>,
    /// Accounting services' identities (`--accounting-identity`).
    pub accounting_identities: Vec<String>,
    /// Whether jobs may run as root (`--allow-root-jobs`).
    pub allow_root_jobs: bool,
    /// Users see only their own jobs (`--private-jobs`).
    pub private_jobs: bool,
    /// Bearer tokens accepted (`--token-public-key`, `--token-jwks`).
    pub tokens: Option<Arc<gangway_proto::token::TokenVerifier>>,
    /// The programs that power elastic pools' nodes (run while leading).
    pub power: crate::config::PowerPrograms,
    /// The accounting database, for `JobService.History`.
    pub history: Option<crate::accounting::History>,
    /// What this replica refused, and the admin actions it allowed.
    pub audit: Arc<crate::audit::AuditLog>,
    /// Per-identity write rate limits (see `ratelimit`).
    pub writes: crate::ratelimit::WriteLimiter,
    /// Admins' writes: a budget of their own, far above a user's.
    pub admin_writes: crate::ratelimit::WriteLimiter,
    /// Per-identity budgets for the work of reads (see `ratelimit`).
    pub reads: crate::ratelimit::ReadLimiter,
    /// The read lane: users' read work, off the async workers (see `lanes`).
    pub read_pool: crate::lanes::ReadPool,
    /// Users' open streams, per principal and in total.
    pub streams: crate::lanes::StreamSlots,
    /// Agents' open WatchNode streams.
    pub node_watches: crate::lanes::StreamSlots,
    /// Analyses (scheduling passes, history queries): at most ANALYSES_MAX
    /// at once on this replica, ANALYSES_PER_CALLER_MAX of them one caller's.
    analyses: Arc<tokio::sync::Semaphore>,
    analyses_by_caller: crate::lanes::PerCaller,
    /// Each caller's forwards in flight (FORWARDS_PER_CALLER_MAX).
    pub forwards: crate::lanes::PerCaller,
    channels: Mutex<Channels>,
    /// Last heartbeat per node, in this replica's memory (meaningful on the leader).
    pub heartbeats: crate::heartbeats::Heartbeats,
    /// The agents' `WatchNode` streams, woken by `watch::spawn_poker`.
    pub watches: Arc<crate::watch::NodeWatches>,
    /// The last scheduling pass's pending reasons (on the leader), for `List`.
    pending_reasons: Mutex<Arc<BTreeMap<u64, Pending>>>,
    /// Set when the replica shuts down: open streams end, so clients reconnect
    /// elsewhere instead of waiting on a replica that is going away.
    closing: tokio::sync::watch::Sender<bool>,
}

impl Replica {
    pub fn new(node: Arc<RaftNode>, config: &ReplicaConfig) -> Replica {
        Replica {
            node: node.clone(),
            proposer: crate::proposer::Proposer::start(node.clone()),
            addr: config.advertise_addr.clone(),
            timing: config.timing.clone(),
            security: config.security.clone(),
            bootstrap_admins: config.bootstrap_admins.clone(),
            accounting_identities: config.accounting_identities.clone(),
            allow_root_jobs: config.allow_root_jobs,
            tokens: config.tokens.clone(),
            power: config.power.clone(),
            history: config.accounting.clone().map(crate::accounting::History::new),
            private_jobs: config.private_jobs,
            audit: Arc::new(crate::audit::AuditLog::default()),
            writes: crate::ratelimit::WriteLimiter::with_bytes(
                config.timing.user_writes_per_s,
                config.timing.user_write_burst,
                config.timing.user_write_bytes_per_s,
                config.timing.user_write_bytes_burst,
            ),
            admin_writes: crate::ratelimit::WriteLimiter::with_bytes(
                config.timing.admin_writes_per_s,
                config.timing.admin_write_burst,
                config.timing.admin_write_bytes_per_s,
                config.timing.admin_write_bytes_burst,
            ),
            reads: crate::ratelimit::ReadLimiter::new(
                config.timing.user_read_units_per_s,
                config.timing.user_read_burst,
            ),
            read_pool: crate::lanes::ReadPool::start(),
            streams: crate::lanes::StreamSlots::new("streams", STREAMS_PER_PRINCIPAL_MAX, STREAMS_MAX),
            node_watches: crate::lanes::StreamSlots::new(
                "node watches",
                NODE_WATCHES_PER_AGENT_MAX,
                gangway_core::limits::NODES_MAX.saturating_mul(NODE_WATCHES_PER_AGENT_MAX),
            ),
            analyses: Arc::new(tokio::sync::Semaphore::new(ANALYSES_MAX)),
            analyses_by_caller: crate::lanes::PerCaller::new(ANALYSES_PER_CALLER_MAX),
            forwards: crate::lanes::PerCaller::new(FORWARDS_PER_CALLER_MAX),
            channels: Mutex::new(Channels::default()),
            heartbeats: crate::heartbeats::Heartbeats::new(HEARTBEATS_MAX),
            watches: Arc::default(),
            pending_reasons: Mutex::new(Arc::new(BTreeMap::new())),
            closing: tokio::sync::watch::Sender::new(false),
        }
    }

    /// Ends open streams: the replica is going away.
    pub fn close(&self) {
        self.closing.send_replace(true);
    }

    /// One of the ANALYSES_MAX permits, and one of `caller`'s, or
    /// RESOURCE_EXHAUSTED (retry shortly). Held by the work itself (it may be
    /// moved into the read lane's work), so a caller that goes away does not
    /// give it back early.
    pub fn analysis_permit(&self, caller: &str, what: &str) -> Result<AnalysisPermit, tonic::Status> {
        let busy = |why: String| {
            metrics::counter!("gangway_api_denied_total", "reason" => "busy").increment(1);
            let mut s = tonic::Status::resource_exhausted(format!("{what}: {why}; retry in a second"));
            if let Ok(v) = "1000".parse() {
                s.metadata_mut().insert(crate::ratelimit::RETRY_AFTER_METADATA_KEY, v);
            }
            s
        };
        let mine = self.analyses_by_caller.try_take(caller).ok_or_else(|| {
            busy(format!("{caller} is already running {ANALYSES_PER_CALLER_MAX} analysis on this replica"))
        })?;
        let pool = self.analyses.clone().try_acquire_owned().map_err(|_| {
            busy(format!(
                "this replica is already running {ANALYSES_MAX} analyses (scheduling passes, history queries)"
            ))
        })?;
        Ok(AnalysisPermit { _pool: pool, _mine: mine })
    }

    /// Resolves once the replica is shutting down.
    pub fn closed(&self) -> impl std::future::Future<Output = ()> + Send + 'static {
        let mut rx = self.closing.subscribe();
        async move {
            let _ = rx.wait_for(|closing| *closing).await;
        }
    }

    /// Keeps the last scheduling pass's reasons.
    pub fn set_pending_reasons(&self, reasons: Vec<(u64, Pending)>) {
        *self.pending_reasons.lock().expect("reasons lock") = Arc::new(reasons.into_iter().collect());
    }

    /// The last scheduling pass's reasons (empty on a replica that does not lead).
    pub fn pending_reasons(&self) -> Arc<BTreeMap<u64, Pending>> {
        self.pending_reasons.lock().expect("reasons lock").clone()
    }

    /// A (lazily connected) channel to another replica's API.
    pub fn channel_to(&self, addr: &str) -> Result<Channel, Status> {
        let mut channels = self.channels.lock().expect("channels lock");
        channels.get_or_make(addr, || {
            self.security
                .channel(addr, gangway_proto::tls::Expect::Server, Duration::from_secs(1))
                .map_err(|e| Status::internal(format!("replica address {addr}: {e}")))
        })
    }

    /// When this replica's own certificate expires (Unix seconds).
    pub fn cert_not_after(&self) -> Option<i64> {
        self.security.credentials().and_then(|c| c.not_after())
    }

    /// How long ago the leader last heard from `node` (None on a follower).
    pub fn heartbeat_age_ms(&self, node: &str) -> Option<u64> {
        if !self.node.is_leader() {
            return None;
        }
        self.heartbeats.age_ms(node)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// CHANNELS_MAX channels are kept; one more address drops the one used
    /// least recently, and a known address reuses its channel.
    #[tokio::test]
    async fn channels_are_kept_for_at_most_channels_max_addresses() {
        let lazy = || Ok(tonic::transport::Endpoint::from_static("http://127.0.0.1:9").connect_lazy());
        let mut channels = Channels::default();
        for i in 0..CHANNELS_MAX {
            channels.get_or_make(&format!("10.0.0.{i}:7000"), lazy).unwrap();
        }
        assert_eq!(channels.by_addr.len(), CHANNELS_MAX);
        // The first is asked for again: the second is now the least recently used.
        channels.get_or_make("10.0.0.0:7000", || Err(Status::internal("made again"))).unwrap();
        channels.get_or_make("10.0.1.0:7000", lazy).unwrap();
        assert_eq!(channels.by_addr.len(), CHANNELS_MAX, "one past CHANNELS_MAX");
        assert!(channels.by_addr.contains_key("10.0.1.0:7000"));
        assert!(channels.by_addr.contains_key("10.0.0.0:7000"), "a channel in use was dropped");
        assert!(!channels.by_addr.contains_key("10.0.0.1:7000"), "the least recently used was kept");
        assert!(channels.get_or_make("10.0.2.0:7000", || Err(Status::internal("bad address"))).is_err());
        assert_eq!(channels.by_addr.len(), CHANNELS_MAX, "a failed channel takes no place");
    }

    /// The leader remembers heartbeats from HEARTBEATS_MAX nodes (as many as
    /// a cluster may register); one more name is not remembered.
    #[test]
    fn heartbeats_are_kept_for_at_most_the_nodes_a_cluster_has() {
        let heartbeats = crate::heartbeats::Heartbeats::new(HEARTBEATS_MAX);
        for i in 0..HEARTBEATS_MAX {
            heartbeats.record(&format!("n{i}"), None);
        }
        assert!(heartbeats.last_ms(&format!("n{}", HEARTBEATS_MAX - 1)).is_some());
        heartbeats.record("one-more", None);
        assert_eq!(heartbeats.last_ms("one-more"), None);
        heartbeats.record("n0", None);
        assert!(heartbeats.last_ms("n0").is_some(), "a node already known is still heard");
    }
}
