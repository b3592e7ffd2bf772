//! Leader duties: started when this replica becomes leader, stopped the moment it
//! is not. Today that is node liveness; the scheduler and dispatch join it.
//!
//! Related code: `liveness.rs`.

pub mod liveness;

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
                    duties = Some(tokio::spawn(liveness::run(replica.clone())));
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
