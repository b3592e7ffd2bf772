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
                        tokio::join!(liveness::run(r.clone()), scheduler::run(r));
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
