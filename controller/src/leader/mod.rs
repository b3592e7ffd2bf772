//! Leader duties: started when this replica becomes leader, stopped the moment it
//! is not: node liveness and the scheduling loop.
//!
//! Related code: `liveness.rs`, `scheduler.rs`.

pub mod liveness;
pub mod scheduler;

use std::sync::Arc;
use std::time::Duration;

use tokio::task::JoinHandle;

use crate::replica::Replica;

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
                        tokio::join!(
                            liveness::run(r.clone()),
                            scheduler::run(r.clone()),
                            bootstrap_admins(r.clone()),
                            upgrade_data_format(r)
                        );
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
            let cmd = gangway_core::Command::SetDataFormat { format: FORMAT_NEWEST, now_ms: crate::now_ms() };
            match replica.proposer.propose(cmd).await {
                Ok(a) if matches!(a.outcome, gangway_core::Outcome::DataFormatSet { .. }) => {
                    tracing::info!(
                        format = FORMAT_NEWEST,
                        "every replica reads the newest data format: the cluster moved to it"
                    );
                    return;
                }
                Ok(a) => tracing::debug!(outcome = ?a.outcome, "the data format change was not applied"),
                Err(e) => tracing::debug!(error = %e, "the data format change was not committed"),
            }
        }
        tokio::time::sleep(FORMAT_CHECK_INTERVAL).await;
    }
}

/// Attempts to commit the bootstrap admins; a new leader retries from scratch.
const BOOTSTRAP_ATTEMPTS_MAX: usize = 20;
const BOOTSTRAP_RETRY: Duration = Duration::from_millis(250);

/// When the policy names no admin, the leader makes the bootstrap admins
/// (`--bootstrap-admin`) admins, as a committed policy change by this server:
/// a new cluster gets its first admin, and a cluster whose admins were all
/// removed gets one back. With admins already named it does nothing.
async fn bootstrap_admins(replica: Arc<Replica>) {
    if replica.bootstrap_admins.is_empty() {
        return;
    }
    for _ in 0..BOOTSTRAP_ATTEMPTS_MAX {
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
        tokio::time::sleep(BOOTSTRAP_RETRY).await;
    }
}
