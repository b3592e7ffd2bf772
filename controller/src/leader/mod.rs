//! Leader duties: started when this replica becomes leader, stopped the moment it
//! is not: the leader's tick (scheduling, time limits, node liveness; decided by
//! the core's `duties::leader_tick`), the bootstrap admins, the data format move
//! and, after a restore, the cluster's new history.
//!
//! Related code: `duties.rs`, `gangway_core::duties`.

pub mod duties;
pub mod power;

use std::sync::Arc;
use std::time::Duration;

use gangway_core::policy::ROLES_FORMAT;
use gangway_core::{Command, Outcome};
use gangway_proto::retry::Retry;
use tokio::task::JoinHandle;

use crate::shared::Replica;

/// How often the replica checks whether it leads. Duties start at most this late
/// after an election (a new leader's grace period starts then too).
const LEADER_POLL_INTERVAL: Duration = Duration::from_millis(100);

pub fn spawn_leader_watch(replica: Arc<Replica>) -> JoinHandle<()> {
    tokio::spawn(async move {
        let mut duties: Option<JoinHandle<()>> = None;
        loop {
            let leading = replica.node.is_leader();
            match (&duties, leading) {
                (None, true) => {
                    tracing::info!(id = replica.node.id, "became leader: starting leader duties");
                    let r = replica.clone();
                    duties = Some(tokio::spawn(async move {
                        tokio::join!(duties::run(r.clone()), async {
                            // In order: the format move reads the policy the
                            // bootstrap wrote (its switches are a
                            // compare-and-set on it).
                            // A restored cluster serves no history-bearing
                            // call until its history is drawn: first.
                            draw_history(r.clone()).await;
                            bootstrap_admins(r.clone()).await;
                            upgrade_data_format(r).await;
                        });
                    }));
                }
                (Some(handle), false) => {
                    tracing::info!(id = replica.node.id, "lost leadership: stopping leader duties");
                    handle.abort();
                    duties = None;
                }
                _ => {}
            }
            tokio::time::sleep(LEADER_POLL_INTERVAL).await;
        }
    })
}

/// How often the leader asks the members which data formats their builds
/// read, while the cluster is not at this build's newest: a rolling upgrade
/// takes minutes, so a few seconds' delay after the last replica is replaced
/// costs nothing, and each check is one small call per member.
const FORMAT_CHECK_INTERVAL: Duration = Duration::from_secs(2);

/// Moves the cluster to this build's newest data format once every member
/// (voters and learners) runs a build that reads it: the cluster version of
/// etcd. Until then every entry and snapshot stays in the format the oldest
/// build reads, so replicas can be replaced one at a time under load. A member
/// that cannot be asked counts as not ready.
async fn upgrade_data_format(replica: Arc<Replica>) {
    use gangway_core::format::FORMAT_NEWEST;
    loop {
        if replica.node.state().read().format >= FORMAT_NEWEST {
            return;
        }
        let me = replica.node.status();
        let mut ready = true;
        for (id, addr) in &me.addrs {
            if *id == me.id {
                continue;
            }
            let newest = match crate::api::admin::probe_replica(&replica, addr).await {
                // A build from before the field reads format 4 only.
                Ok(s) => s.newest_data_format.max(gangway_core::format::FORMAT_BASE),
                Err(_) => 0,
            };
            if newest < FORMAT_NEWEST {
                tracing::debug!(replica = id, newest, "a member does not read the newest data format yet");
                ready = false;
                break;
            }
        }
        if ready {
            let set = Command::SetDataFormat { format: FORMAT_NEWEST, now_ms: crate::now_ms() };
            // The switches move into the policy in the same entry as the
            // format, so no request meets the cluster between the two rules.
            let cmd = match carried_switches(&replica) {
                Some(update) => Command::Batch(vec![set, update]),
                None => set,
            };
            // Proposed on its own, not through the batching proposer: batches do not nest.
            match replica.node.propose(cmd, FORMAT_WRITE_TIMEOUT).await {
                Ok(a) => {
                    let (moved, seeded) = match &a.outcome {
                        Outcome::Batch(parts) => (
                            parts.first().is_some_and(|p| matches!(p.outcome, Outcome::DataFormatSet { .. })),
                            parts.get(1).is_some_and(|p| matches!(p.outcome, Outcome::PolicyUpdated { .. })),
                        ),
                        Outcome::DataFormatSet { .. } => (true, true),
                        _ => (false, false),
                    };
                    if moved {
                        tracing::info!(
                            format = FORMAT_NEWEST,
                            "every replica reads the newest data format: the cluster moved to it"
                        );
                        if !seeded {
                            // A policy edit raced the move: carry the switches on their own.
                            carry_switches(&replica).await;
                        }
                        return;
                    }
                    tracing::debug!(outcome = ?a.outcome, "the data format change was not applied");
                }
                Err(e) => tracing::debug!(error = %e, "the data format change was not committed"),
            }
        }
        tokio::time::sleep(FORMAT_CHECK_INTERVAL).await;
    }
}

/// How long the leader waits for its data format change to commit.
const FORMAT_WRITE_TIMEOUT: Duration = Duration::from_secs(5);

/// Before data format 6, whether jobs may run as root and whether users see
/// only their own jobs were each replica's flags (`--allow-root-jobs`,
/// `--private-jobs`); from format 6 the replicated policy decides. The leader
/// that moves the cluster to format 6 carries its own flags into the policy
/// (set, never cleared), so an upgrade keeps the cluster's behaviour. None
/// when there is nothing to carry (or the cluster is past the move).
fn carried_switches(replica: &Replica) -> Option<Command> {
    let state = replica.node.state().read();
    if state.format >= ROLES_FORMAT {
        return None;
    }
    switches_update(replica, &state)
}

/// The policy with this replica's switches set in it, as an update by this
/// server (compare-and-set on the current version), or None when it already
/// has them.
fn switches_update(replica: &Replica, state: &gangway_core::State) -> Option<Command> {
    let mut policy = state.policy.clone();
    policy.allow_root_jobs |= replica.allow_root_jobs;
    policy.private_jobs |= replica.private_jobs;
    if policy == state.policy {
        return None;
    }
    Some(Command::UpdatePolicy {
        policy,
        expected_version: Some(state.policy.version),
        // Only two switches change: never refuse them for quotas set with --force.
        force: true,
        identity: format!("server:{}", replica.node.id),
        now_ms: crate::now_ms(),
    })
}

/// Carries the switches (see [`carried_switches`]) after the move, retrying
/// edits that raced it.
async fn carry_switches(replica: &Replica) {
    let mut tries = BOOTSTRAP.tries();
    while tries.next().await {
        let Some(update) = switches_update(replica, &replica.node.state().read()) else { return };
        match replica.proposer.propose(update).await {
            Ok(a) if matches!(a.outcome, Outcome::PolicyUpdated { .. }) => {
                tracing::info!("the replica's --allow-root-jobs/--private-jobs were carried into the policy");
                return;
            }
            Ok(a) => tracing::debug!(outcome = ?a.outcome, "carrying the switches into the policy was refused"),
            Err(e) => tracing::debug!(error = %e, "carrying the switches into the policy was not committed"),
        }
    }
    tracing::warn!(
        "could not carry --allow-root-jobs/--private-jobs into the policy; set them with `gangway admin set`"
    );
}

/// After a restore from a backup, the history is the one every replica
/// derived from the file, which another restore of the same file would
/// share: the first leader draws a new one at random, once
/// ([`Command::DrawHistory`]). Until then the cluster serves no event
/// stream, heartbeat or accounting report (`api::settled_history`), so it
/// is the leader's first duty, retried [`DRAW_ATTEMPTS_MAX`] times; a leader
/// after this one tries again.
async fn draw_history(replica: Arc<Replica>) {
    let mut tries = DRAW.tries();
    while tries.next().await {
        {
            let state = replica.node.state().read();
            if !state.history_pending || state.format < gangway_core::format::FRESH_HISTORY_FORMAT {
                return;
            }
        }
        let (high, low) = uuid::Uuid::new_v4().as_u64_pair();
        let history = high ^ low.rotate_left(32);
        let cmd = Command::DrawHistory { history, now_ms: crate::now_ms() };
        match replica.proposer.propose(cmd).await {
            Ok(a) => match a.outcome {
                Outcome::HistoryDrawn { history } => {
                    tracing::info!(history, "a restored cluster: its first leader drew its history");
                    return;
                }
                // Drawn by another leader meanwhile, or 0 or the derived one drawn (retried).
                other => tracing::debug!(outcome = ?other, "the history was not drawn"),
            },
            Err(e) => tracing::debug!(error = %e, "the history draw was not committed"),
        }
    }
    tracing::warn!(
        attempts = DRAW_ATTEMPTS_MAX,
        "a restored cluster's history was not drawn: agents and the accounting service wait; the next leader tries again"
    );
}

/// Tries to draw a restored cluster's history, [`BOOTSTRAP_RETRY`] apart: a
/// minute, far past an election's first commit (the draw is the leader's
/// first write). A leader that cannot commit for that long cannot mark
/// nodes down either; its agents, unanswered meanwhile, retry, and stop
/// their tasks as they would with no controller at all.
const DRAW_ATTEMPTS_MAX: u64 = 241;
const DRAW: Retry = Retry::new(DRAW_ATTEMPTS_MAX, BOOTSTRAP_RETRY);

/// Attempts to commit the bootstrap admins (and to carry the switches):
/// five seconds, past an election's first commit; a new leader retries
/// from scratch.
const BOOTSTRAP_ATTEMPTS_MAX: u64 = 21;
const BOOTSTRAP_RETRY: Duration = Duration::from_millis(250);
const BOOTSTRAP: Retry = Retry::new(BOOTSTRAP_ATTEMPTS_MAX, BOOTSTRAP_RETRY);

/// When the policy names no admin, the leader makes the bootstrap admins
/// (`--bootstrap-admin`) admins, as a committed policy change by this server:
/// a new cluster gets its first admin, and a cluster whose admins were all
/// removed gets one back. With admins already named it does nothing.
async fn bootstrap_admins(replica: Arc<Replica>) {
    if replica.bootstrap_admins.is_empty() {
        return;
    }
    let mut tries = BOOTSTRAP.tries();
    while tries.next().await {
        let (mut policy, version) = {
            let state = replica.node.state().read();
            if !state.policy.admins.is_empty() {
                return;
            }
            (state.policy.clone(), state.policy.version)
        };
        policy.admins = replica.bootstrap_admins.clone();
        let cmd = gangway_core::Command::UpdatePolicy {
            policy,
            expected_version: Some(version),
            force: false,
            identity: format!("server:{}", replica.node.id),
            now_ms: crate::now_ms(),
        };
        match replica.proposer.propose(cmd).await {
            Ok(applied) => match applied.outcome {
                gangway_core::Outcome::Refused(r) if r.kind != gangway_core::RefusalKind::Stale => {
                    tracing::error!(reason = %r.message, "the bootstrap admins were refused");
                    return;
                }
                gangway_core::Outcome::Refused(_) => {}
                _ => {
                    tracing::info!(admins = ?replica.bootstrap_admins, "bootstrap admins committed");
                    return;
                }
            },
            Err(e) => tracing::debug!(error = ?e, "bootstrap admins not committed yet"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The leader's first writes are tried for as long as their reasons
    /// say, and no more: BOOTSTRAP_ATTEMPTS_MAX tries over five seconds,
    /// DRAW_ATTEMPTS_MAX over a minute.
    #[tokio::test]
    async fn a_leaders_first_writes_are_tried_for_their_spans() {
        use gangway_proto::retry::count_tries;
        assert_eq!(count_tries(BOOTSTRAP).await, BOOTSTRAP_ATTEMPTS_MAX);
        assert_eq!(BOOTSTRAP.span(), Duration::from_secs(5));
        assert_eq!(count_tries(DRAW).await, DRAW_ATTEMPTS_MAX);
        assert_eq!(DRAW.span(), Duration::from_secs(60));
    }
}
