//! Node liveness on the leader: heartbeats live in memory; only the transition
//! to Down is committed. A new leader counts every node as heard from at the
//! moment it took over, so a controller failover never marks healthy nodes down
//! (their agents reconnect and heartbeat well within the timeout).

use std::sync::Arc;
use std::time::{Duration, Instant};

use gangway_core::{Command, NodeState, NodeStateChange};

use crate::replica::{Replica, WRITE_TIMEOUT};

/// How often the leader looks for silent nodes.
const LIVENESS_TICK: Duration = Duration::from_millis(500);
/// Nodes marked Down per tick: bounds the work (and log entries) of one tick if a
/// whole rack goes silent at once; the rest follow on the next ticks.
const DOWN_PER_TICK_MAX: usize = 256;

pub async fn run(replica: Arc<Replica>) {
    let leader_since = Instant::now();
    let timeout = Duration::from_millis(replica.timing.node_down_timeout_ms);
    loop {
        tokio::time::sleep(LIVENESS_TICK).await;
        let now = Instant::now();
        let silent: Vec<(String, Duration)> = {
            let state = replica.node.state().read();
            state
                .nodes
                .values()
                .filter(|n| n.state != NodeState::Down)
                .filter_map(|n| {
                    let heard = replica.last_heartbeat(&n.name).map_or(leader_since, |t| t.max(leader_since));
                    let silent_for = now.duration_since(heard);
                    (silent_for > timeout).then(|| (n.name.clone(), silent_for))
                })
                .take(DOWN_PER_TICK_MAX)
                .collect()
        };
        for (name, silent_for) in silent {
            let reason = format!("no heartbeat for {:.1}s", silent_for.as_secs_f64());
            tracing::warn!(node = %name, %reason, "marking node down");
            let cmd = Command::SetNodeState {
                name: name.clone(),
                change: NodeStateChange::Down,
                reason,
                now_ms: crate::now_ms(),
            };
            if let Err(e) = replica.node.propose(cmd, WRITE_TIMEOUT).await {
                tracing::warn!(node = %name, error = %e, "could not mark node down");
                break;
            }
            metrics::counter!("gangway_nodes_marked_down_total").increment(1);
        }
    }
}
