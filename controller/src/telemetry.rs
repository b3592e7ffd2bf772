//! The controller's Prometheus metrics. Gauges are read from the replica when
//! scraped (Raft role and indexes, jobs by state, pending jobs by reason, nodes
//! and GPUs by state, per-account usage and fair share); counters and
//! histograms are recorded through the `metrics` facade as things happen
//! (proposals, scheduling passes, placements, preemptions, queue waits, node
//! failures). Every replica serves its own view; pending reasons and fair share
//! are the leader's.

use std::sync::Arc;

use gangway_core::{GpuHealth, JobState, NodeState};
use gangway_proto::telemetry::{self, Gauges};
use tokio::net::TcpListener;

use crate::shared::Replica;

/// Installs the recorder and describes the facade's metrics (HELP lines);
/// counters start at zero so they exist (and `rate()` works) before they move.
/// Idempotent; every replica start calls it.
pub fn describe() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(describe_once);
}

fn describe_once() {
    telemetry::recorder();
    for c in [
        "gangway_jobs_submitted_total",
        "gangway_jobs_started_total",
        "gangway_jobs_preempted_total",
        "gangway_nodes_marked_down_total",
        "gangway_api_forwarded_total",
    ] {
        metrics::counter!(c).increment(0);
    }
    use metrics::{describe_counter, describe_histogram, Unit};
    describe_counter!(
        "gangway_jobs_submitted_total",
        "Jobs accepted by submit (duplicates by idempotency key not counted)."
    );
    describe_counter!("gangway_jobs_started_total", "Jobs placed by the scheduler and started.");
    describe_counter!(
        "gangway_linearizable_reads_total",
        "Linearizable reads on the leader, by how leadership was confirmed: a round to a quorum, or a round's read lease."
    );
    describe_counter!("gangway_jobs_preempted_total", "Jobs preempted to make room for others.");
    describe_counter!("gangway_nodes_marked_down_total", "Nodes the leader declared down for missing heartbeats.");
    describe_counter!("gangway_api_forwarded_total", "API calls a follower forwarded to the leader.");
    describe_counter!("gangway_commands_applied_total", "Replicated commands applied, by command.");
    describe_histogram!("gangway_schedule_pass_seconds", Unit::Seconds, "Duration of one scheduling pass.");
    describe_histogram!(
        "gangway_proposal_seconds",
        Unit::Seconds,
        "Time from proposing a command to its commit and apply."
    );
    describe_histogram!("gangway_job_queue_wait_seconds", Unit::Seconds, "Time jobs waited from submit to start.");
    describe_histogram!("gangway_proposal_batch_size", "Commands proposed together in one Raft entry batch.");
    describe_histogram!("gangway_raft_group_commit_batch", "Log entries written with one fsync.");
    describe_histogram!("gangway_raft_wal_fsync_seconds", Unit::Seconds, "Duration of one Raft log fsync.");
    describe_histogram!(
        "gangway_raft_rpc_seconds",
        Unit::Seconds,
        "Round trip of a Raft RPC to a peer (for append: its write and fsync included), by rpc."
    );
    describe_histogram!(
        "gangway_raft_append_handled_seconds",
        Unit::Seconds,
        "Time a follower took to append and sync the entries of one append RPC."
    );
    describe_counter!(
        "gangway_api_denied_total",
        "Calls refused, by reason (unauthenticated, permission, rate, read_budget, busy, streams)."
    );
    describe_counter!(
        "gangway_read_units_total",
        "Read units charged to callers' read budgets on this replica (a job or node looked at, 128 bytes answered, \
         10 per call)."
    );
    describe_counter!(
        "gangway_connections_shed_total",
        "Connections closed right after their handshake: past the listener's total or their principal's or \
         network prefix's share."
    );
    describe_counter!(
        "gangway_connections_idle_closed_total",
        "Connections closed after nothing was read on them for the idle limit."
    );
    describe_counter!(
        "gangway_tls_handshakes_shed_total",
        "Connections closed before their TLS handshake: every handshake slot, or their prefix's share, was taken."
    );
    describe_counter!("gangway_tls_handshake_failures_total", "TLS handshakes that failed or timed out.");
    metrics::describe_gauge!(
        "gangway_scheduler_state_clones",
        "Times the leader cloned the whole state for its scheduler since it began leading (1: every pass since \
         caught up by applying commands)."
    );
}

/// How long ago the oldest remembered idempotency key was given (keys
/// expire IDEMPOTENCY_TTL_MS after they are given), on the replicated clock.
fn idempotency_window_ms(state: &gangway_core::State) -> u64 {
    state.idempotency_expiry.first().map_or(0, |(expires, _, _)| {
        let given = expires.saturating_sub(gangway_core::limits::IDEMPOTENCY_TTL_MS);
        state.clock_ms.saturating_sub(given)
    })
}

/// Jobs in each state, in `JobState::ALL`'s order.
fn count_by_state(states: impl Iterator<Item = JobState>) -> [u64; JobState::ALL.len()] {
    let mut by_state = [0u64; JobState::ALL.len()];
    for state in states {
        if let Some(n) = JobState::ALL.iter().position(|s| *s == state).and_then(|i| by_state.get_mut(i)) {
            *n = n.saturating_add(1);
        }
    }
    by_state
}

/// The text a scrape of this replica returns.
pub fn render(replica: &Replica) -> String {
    let mut g = Gauges::default();
    let st = replica.node.status();
    g.set("gangway_raft_term", "This replica's current Raft term.", &[], st.term as f64);
    g.set(
        "gangway_raft_leader",
        "1 when this replica is the leader.",
        &[],
        if st.role == crate::raft::RaftRole::Leader { 1.0 } else { 0.0 },
    );
    g.set(
        "gangway_raft_leader_id",
        "The replica this one follows as leader (0: none known).",
        &[],
        st.leader_id.unwrap_or(0) as f64,
    );
    let idx = |v: Option<u64>| v.unwrap_or(0) as f64;
    g.set("gangway_raft_last_log_index", "Index of the last entry in this replica's log.", &[], idx(st.last_log_index));
    g.set("gangway_raft_commit_index", "Highest log index known committed.", &[], idx(st.committed_index));
    g.set("gangway_raft_applied_index", "Highest log index applied to the state machine.", &[], idx(st.applied_index));
    g.set("gangway_raft_voters", "Voting members of the controller cluster.", &[], st.voters.len() as f64);
    if let Some(not_after) = replica.cert_not_after() {
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
        g.set(
            "gangway_tls_cert_expiry_seconds",
            "Seconds until this replica's TLS certificate expires (negative: expired).",
            &[],
            (not_after - now) as f64,
        );
    }

    let views = replica.node.state().view_stats();
    g.set(
        "gangway_state_views_published",
        "Views of the applied state published to readers.",
        &[],
        views.published as f64,
    );
    g.set(
        "gangway_state_view_clones",
        "Views cloned: because readers still held every spare view due for reuse, or to make up the spares after a \
         start or a rebuild.",
        &[],
        views.clones as f64,
    );
    g.set(
        "gangway_state_view_lag_entries",
        "Log entries applied but not yet in the view readers see.",
        &[],
        replica.node.state().applied_index().saturating_sub(replica.node.state().read().index()) as f64,
    );
    g.set(
        "gangway_api_streams_open",
        "Users' streams (watch, events, audit) open on this replica.",
        &[],
        replica.streams.open() as f64,
    );
    g.set(
        "gangway_node_watches_open",
        "Agents' WatchNode streams open on this replica.",
        &[],
        replica.node_watches.open() as f64,
    );

    let reasons = replica.pending_reasons();
    let state = replica.node.state().read();
    let by_state = count_by_state(state.jobs.values().map(|j| j.state));
    for (s, n) in JobState::ALL.iter().zip(by_state) {
        let state_name = s.as_str().to_ascii_lowercase();
        g.set("gangway_jobs", "Jobs by state (finished jobs while retained).", &[("state", &state_name)], n as f64);
    }
    // The finished jobs the state keeps (at most FINISHED_JOBS_RETAINED_MAX),
    // not every job.
    let accounted = state.accounted_index;
    let unaccounted = if accounted == 0 {
        0
    } else {
        let waiting = |id: &u64| state.jobs.get(id).and_then(|j| j.finished_index).is_some_and(|i| i > accounted);
        state.finished.iter().filter(|id| waiting(id)).count()
    };
    let help = format!(
        "Finished jobs the accounting store does not have yet (0 without an accounting service). The state keeps \
         them up to {} finished jobs or {} GiB of their specs in all; past that the oldest go unrecorded.",
        gangway_core::limits::FINISHED_JOBS_RETAINED_MAX,
        gangway_core::limits::FINISHED_BYTES_RETAINED_MAX >> 30
    );
    g.set("gangway_unaccounted_finished_jobs", &help, &[], unaccounted as f64);
    let help = format!(
        "Idempotency keys remembered (at most {} per identity and {} in all; past a cap the oldest is forgotten).",
        gangway_core::limits::IDEMPOTENCY_KEYS_PER_IDENTITY_MAX,
        gangway_core::limits::IDEMPOTENCY_KEYS_MAX
    );
    g.set("gangway_idempotency_keys", &help, &[], state.idempotency.len() as f64);
    g.set(
        "gangway_idempotency_window_seconds",
        "How long ago the oldest remembered idempotency key was given: a retried submit older than this makes a new \
         job. A day while the caps hold; less once a cap forgets keys early (0 when none is remembered).",
        &[],
        idempotency_window_ms(&state) as f64 / 1000.0,
    );
    let mut pending_by_reason: std::collections::BTreeMap<&str, u64> = Default::default();
    for id in &state.pending {
        *pending_by_reason.entry(reasons.get(id).map_or("None", |r| r.as_str())).or_default() += 1;
    }
    for (reason, n) in pending_by_reason {
        g.set(
            "gangway_pending_jobs",
            "Pending jobs by the scheduler's reason (the leader's last pass).",
            &[("reason", reason)],
            n as f64,
        );
    }
    let (mut up, mut drain, mut down, mut powered_down, mut powering_up) = (0, 0, 0, 0, 0);
    let (mut idle, mut busy, mut sick) = (0, 0, 0);
    for n in state.nodes.values() {
        match n.state {
            NodeState::Up => up += 1,
            NodeState::Drain => drain += 1,
            NodeState::Down => down += 1,
            NodeState::PoweredDown => powered_down += 1,
            NodeState::PoweringUp => powering_up += 1,
        }
        for gpu in &n.gpus {
            match (gpu.health, gpu.allocated_to) {
                (GpuHealth::Quarantined, _) => sick += 1,
                (_, Some(_)) => busy += 1,
                _ => idle += 1,
            }
        }
    }
    for (s, n) in
        [("up", up), ("drain", drain), ("down", down), ("powered_down", powered_down), ("powering_up", powering_up)]
    {
        g.set("gangway_nodes", "Nodes by state.", &[("state", s)], f64::from(n));
    }
    for (s, n) in [("idle", idle), ("allocated", busy), ("quarantined", sick)] {
        g.set("gangway_gpus", "GPUs by state (quarantined: failed health checks).", &[("state", s)], f64::from(n));
    }
    let mut running_gpus: std::collections::BTreeMap<&str, u64> = Default::default();
    for j in state.jobs.values().filter(|j| j.state == JobState::Running) {
        let held: usize = j.allocation.iter().flat_map(|a| &a.nodes).map(|n| n.gpus.len()).sum();
        *running_gpus.entry(j.spec.account.as_str()).or_default() += held as u64;
    }
    let shares = gangway_core::sched::fair_share(&state, crate::now_ms());
    for (account, s) in &shares {
        let l = [("account", account.as_str())];
        g.set(
            "gangway_account_gpu_seconds",
            "Decayed GPU-seconds an account used (the fair-share input).",
            &l,
            s.gpu_hours * 3600.0,
        );
        g.set("gangway_account_fairshare_factor", "Fair-share factor 2^(-usage/shares), 0 to 1.", &l, s.factor);
        let running = running_gpus.get(account.as_str()).copied().unwrap_or(0);
        g.set("gangway_account_running_gpus", "GPUs an account's running jobs hold.", &l, running as f64);
    }
    drop(state);
    g.finish()
}

/// Serves this replica's metrics on `listener` until the returned task is
/// aborted; with `tls`, over TLS to clients with a certificate of the CA.
pub fn serve(
    replica: Arc<Replica>,
    listener: TcpListener,
    tls: Option<telemetry::MetricsTls>,
) -> tokio::task::JoinHandle<()> {
    describe();
    let render = Arc::new(move || render(&replica));
    tokio::spawn(telemetry::serve(listener, render, tls))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every state is counted, the last one (DEADLINE) included: the count
    /// had one slot fewer than there are states, and a scrape with a job
    /// past its deadline panicked.
    #[test]
    fn every_job_state_is_counted() {
        let counts = count_by_state(JobState::ALL.iter().copied().chain([JobState::Deadline]));
        let mut want = [1u64; JobState::ALL.len()];
        want[JobState::ALL.len() - 1] = 2;
        assert_eq!(counts, want);
    }

    #[test]
    fn the_idempotency_window_is_the_age_of_the_oldest_key() {
        use gangway_core::limits::IDEMPOTENCY_TTL_MS;
        let mut state = gangway_core::State::default();
        state.clock_ms = 50_000;
        assert_eq!(idempotency_window_ms(&state), 0, "no key: no window");
        for (given, key) in [(20_000, "b"), (30_000, "a")] {
            state.idempotency_expiry.insert((given + IDEMPOTENCY_TTL_MS, "alice".into(), key.into()));
        }
        assert_eq!(idempotency_window_ms(&state), 30_000);
    }
}
