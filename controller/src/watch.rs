//! Node watches: the agents' `WatchNode` streams and the one task per replica
//! that wakes them. The task reads the replica's applied events and asks the
//! core's `duties::PokeBook` which nodes each concerns; only those nodes'
//! streams are poked. (One broadcast subscriber per agent, each reading every
//! event, cost the replica a wakeup per event per agent: with thousands of
//! agents every job that ended woke the whole fleet.)

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};

use gangway_core::duties::PokeBook;
use gangway_raft_store::SharedState;
use tokio::sync::{broadcast, watch};
use tonic::Status;

/// Nodes one replica keeps watch channels for (the core's node limit): a
/// claimed name past it is refused, so a caller inventing names cannot grow
/// the map without bound.
const WATCHED_NODES_MAX: usize = gangway_core::limits::NODES_MAX;
/// Events read before the state is locked once to look them all up: bounds
/// the lock's hold time while a burst of events is drained together.
const EVENTS_PER_LOOKUP_MAX: usize = 1024;

/// One watch channel per watched node, holding the log index of the latest
/// change that concerns it. A `watch` channel keeps only the newest value,
/// so a burst of changes costs a watching agent one wakeup.
#[derive(Default)]
pub struct NodeWatches {
    nodes: Mutex<BTreeMap<String, watch::Sender<u64>>>,
}

impl NodeWatches {
    /// A receiver woken on every change concerning `node`.
    pub fn subscribe(&self, node: &str) -> Result<watch::Receiver<u64>, Status> {
        let mut nodes = self.nodes.lock().expect("node watches lock");
        if let Some(tx) = nodes.get(node) {
            return Ok(tx.subscribe());
        }
        if nodes.len() >= WATCHED_NODES_MAX {
            // Channels nobody listens to any more make room first.
            nodes.retain(|_, tx| tx.receiver_count() > 0);
            if nodes.len() >= WATCHED_NODES_MAX {
                return Err(Status::resource_exhausted(format!(
                    "name: this replica already watches {WATCHED_NODES_MAX} nodes, the cluster's limit"
                )));
            }
        }
        let (tx, rx) = watch::channel(0);
        nodes.insert(node.to_string(), tx);
        Ok(rx)
    }

    /// A watch of `node` ended: its channel goes once nobody listens.
    pub fn unsubscribed(&self, node: &str) {
        let mut nodes = self.nodes.lock().expect("node watches lock");
        if nodes.get(node).is_some_and(|tx| tx.receiver_count() == 0) {
            nodes.remove(node);
        }
    }

    fn poke(&self, node: &str, index: u64) {
        if let Some(tx) = self.nodes.lock().expect("node watches lock").get(node) {
            tx.send_replace(index);
        }
    }
}

/// Adds what `events` already holds to `batch`, up to
/// [`EVENTS_PER_LOOKUP_MAX`] in all (what is left waits for the next batch;
/// a lag is found by the next `recv`).
fn fill_batch<T: Clone>(batch: &mut Vec<T>, events: &mut broadcast::Receiver<T>) {
    while batch.len() < EVENTS_PER_LOOKUP_MAX {
        match events.try_recv() {
            Ok(ev) => batch.push(ev),
            Err(_) => break,
        }
    }
}

/// Wakes the `watches` of the nodes each change applied to `shared`
/// concerns, until `closed` completes (the replica closes).
pub fn spawn_poker(
    shared: Arc<SharedState>,
    watches: Arc<NodeWatches>,
    closed: impl std::future::Future<Output = ()> + Send + 'static,
) -> tokio::task::JoinHandle<()> {
    tokio::spawn(async move {
        // Subscribed before the resync: a change applied in between is both
        // in the state read and among the events.
        let mut events = shared.subscribe();
        let mut book = PokeBook::default();
        book.resync(&shared.read());
        tokio::pin!(closed);
        let mut batch = Vec::with_capacity(EVENTS_PER_LOOKUP_MAX);
        loop {
            let first = tokio::select! {
                got = events.recv() => got,
                _ = &mut closed => return,
            };
            match first {
                Ok(ev) => batch.push(ev),
                // Missed events: relearn the running jobs' nodes. Their agents
                // learn what they missed at their next heartbeat; waking the
                // whole fleet at once would flood a leader that is already
                // behind.
                Err(broadcast::error::RecvError::Lagged(missed)) => {
                    tracing::debug!(missed, "node pokes missed events; relearning running jobs");
                    book.resync(&shared.read());
                    continue;
                }
                Err(broadcast::error::RecvError::Closed) => return,
            }
            fill_batch(&mut batch, &mut events);
            // The view that holds what these events did (the events are sent
            // as apply makes them, a moment before that view is published):
            // the nodes a job just placed are found, and the agents poked
            // heartbeat against a view that already has their orders.
            let state = match shared.read_fresh().await {
                Ok(view) => view,
                Err(_) => shared.read(),
            };
            let pokes: Vec<(String, u64)> = {
                batch
                    .drain(..)
                    .flat_map(|ev| book.nodes_to_poke(&ev, &state).into_iter().map(move |n| (n, ev.index())))
                    .collect()
            };
            for (node, index) in pokes {
                watches.poke(&node, index);
            }
        }
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A replica watches WATCHED_NODES_MAX nodes; one more name is refused
    /// with an error naming the field and the limit, until a watch nobody
    /// listens to any more makes room.
    #[test]
    fn watched_nodes_are_bounded_at_the_clusters_limit() {
        let watches = NodeWatches::default();
        let mut held: Vec<_> =
            (0..WATCHED_NODES_MAX).map(|i| watches.subscribe(&format!("n{i}")).expect("within the limit")).collect();
        assert!(watches.subscribe("n0").is_ok(), "a watched node is watched again");
        let e = watches.subscribe("one-more").unwrap_err();
        assert_eq!(e.code(), tonic::Code::ResourceExhausted);
        assert!(e.message().starts_with("name:") && e.message().contains(&WATCHED_NODES_MAX.to_string()), "{e}");
        drop(held.pop());
        assert!(watches.subscribe("one-more").is_ok(), "an abandoned watch made room");
    }

    /// One lookup takes EVENTS_PER_LOOKUP_MAX events at most: that many are
    /// taken whole, one more waits in the channel for the next batch.
    #[test]
    fn a_batch_holds_at_most_events_per_lookup_max() {
        for (queued, left) in [(EVENTS_PER_LOOKUP_MAX, false), (EVENTS_PER_LOOKUP_MAX + 1, true)] {
            let (tx, mut rx) = broadcast::channel(EVENTS_PER_LOOKUP_MAX + 1);
            for i in 0..queued {
                tx.send(i).unwrap();
            }
            let mut batch = vec![rx.try_recv().unwrap()];
            fill_batch(&mut batch, &mut rx);
            assert_eq!(batch, (0..EVENTS_PER_LOOKUP_MAX).collect::<Vec<_>>());
            assert_eq!(rx.try_recv().ok(), left.then_some(EVENTS_PER_LOOKUP_MAX));
        }
    }
}
