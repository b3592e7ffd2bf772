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
                        tokio::join!(liveness::run(r.clone()), scheduler::run(r.clone()), bootstrap_admins(r));
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
