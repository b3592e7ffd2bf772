//! The heartbeat exchange's one codec, both ways: the agent's call (the
//! core's `agent::Call::Heartbeat`) into `HeartbeatRequest` and that into
//! what the leader's core reads (`duties::Heartbeat`); the leader's orders
//! (`duties::NodeOrders`) into `HeartbeatResponse`, and that into what the
//! agent's core reads (`agent::Answer`). The controller, the node agent and
//! the simulation all use these, so the simulation carries the messages
//! production sends. Launch orders are the controller's to build (they
//! carry the job's spec); the simulation's carry only their GPUs.

use gangway_core::agent::Answer;
use gangway_core::command::SignalTarget;
use gangway_core::duties::{Heartbeat, NodeOrders, TaskKey};
use gangway_core::model::JobSignal;

use crate::v1 as pb;

/// The proto form of a signal's target.
pub fn signal_target_to_proto(t: SignalTarget) -> pb::SignalTarget {
    match t {
        SignalTarget::Steps => pb::SignalTarget::Steps,
        SignalTarget::Batch => pb::SignalTarget::Batch,
        SignalTarget::Full => pb::SignalTarget::Full,
    }
}

/// A signal target from the wire: an unknown number is Slurm's default
/// (the steps), as an older peer that knew fewer targets meant.
pub fn signal_target_from_proto(t: i32) -> SignalTarget {
    match pb::SignalTarget::try_from(t) {
        Ok(pb::SignalTarget::Batch) => SignalTarget::Batch,
        Ok(pb::SignalTarget::Full) => SignalTarget::Full,
        Ok(pb::SignalTarget::Steps) | Err(_) => SignalTarget::Steps,
    }
}

/// The agent's heartbeat on the wire: the tasks it runs, the newest orders
/// it acted on (`seen_index`), its history and its GPUs' health.
pub fn heartbeat_to_proto(
    name: &str,
    running: impl IntoIterator<Item = TaskKey>,
    seen_index: u64,
    history: u64,
    gpu_health: Vec<pb::GpuHealthReport>,
) -> pb::HeartbeatRequest {
    pb::HeartbeatRequest {
        name: name.to_string(),
        running: running.into_iter().map(task_ref).collect(),
        gpu_health,
        seen_index,
        reads_nodelist: true,
        history: Some(history),
    }
}

/// A heartbeat as the leader's core reads it (its sizes were checked at the
/// API edge, `check_heartbeat`).
pub fn heartbeat_from_proto(m: &pb::HeartbeatRequest) -> Heartbeat {
    Heartbeat {
        node: m.name.clone(),
        running: m.running.iter().map(|t| (t.job_id, t.attempt)).collect(),
        seen_index: m.seen_index,
        history: m.history.unwrap_or(0),
        gpu_health: m.gpu_health.iter().map(|g| (g.index, g.healthy, g.reason.clone())).collect(),
    }
}

fn task_ref((job_id, attempt): TaskKey) -> pb::TaskRef {
    pb::TaskRef { job_id, attempt }
}

/// Where the orders come from: the leader's term, its state's log index and
/// history, and the heartbeat interval it asks for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct From {
    pub term: u64,
    pub index: u64,
    pub history: u64,
    pub heartbeat_interval_ms: u64,
}

/// `orders` as the answer to a heartbeat, with `launch` (built by the
/// controller from the jobs) as its launch orders. `members` is left empty.
pub fn orders_to_proto(orders: &NodeOrders, from: From, launch: Vec<pb::LaunchOrder>) -> pb::HeartbeatResponse {
    pb::HeartbeatResponse {
        known: orders.known,
        desired: orders.desired.iter().copied().map(task_ref).collect(),
        launch,
        term: from.term,
        stops: orders
            .stops
            .iter()
            .map(|s| pb::TaskStop { job_id: s.task.0, attempt: s.task.1, grace_s: s.grace_s, reason: s.reason.clone() })
            .collect(),
        index: from.index,
        heartbeat_interval_ms: from.heartbeat_interval_ms,
        suspended: orders.suspended.iter().copied().map(task_ref).collect(),
        signals: orders
            .signals
            .iter()
            .map(|((job_id, attempt), s)| pb::TaskSignal {
                job_id: *job_id,
                attempt: *attempt,
                seq: s.seq,
                signal: s.signal,
                target: signal_target_to_proto(s.target) as i32,
            })
            .collect(),
        history: from.history,
        members: Vec::new(),
    }
}

/// A heartbeat answer as the agent's core reads it.
pub fn answer_from_proto(resp: &pb::HeartbeatResponse) -> Answer {
    Answer {
        known: resp.known,
        term: resp.term,
        index: resp.index,
        history: resp.history,
        desired: resp.desired.iter().map(|t| (t.job_id, t.attempt)).collect(),
        launch: resp.launch.iter().map(|o| ((o.job_id, o.attempt), o.gpus.clone())).collect(),
        stops: resp.stops.iter().map(|s| ((s.job_id, s.attempt), s.grace_s)).collect(),
        suspended: resp.suspended.iter().map(|t| (t.job_id, t.attempt)).collect(),
        signals: resp
            .signals
            .iter()
            .map(|s| {
                let signal = JobSignal { seq: s.seq, signal: s.signal, target: signal_target_from_proto(s.target) };
                ((s.job_id, s.attempt), signal)
            })
            .collect(),
        heartbeat_interval_ms: resp.heartbeat_interval_ms,
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::duties::Stop;
    use proptest::prelude::*;

    fn task() -> impl Strategy<Value = TaskKey> {
        (any::<u64>(), any::<u32>())
    }

    fn target() -> impl Strategy<Value = SignalTarget> {
        prop_oneof![Just(SignalTarget::Steps), Just(SignalTarget::Batch), Just(SignalTarget::Full)]
    }

    proptest! {
        /// Whatever the leader orders, the agent's core reads the same: the
        /// answer through the wire is the core's own `NodeOrders::answer`
        /// (launches with their GPUs, stops with their grace, signals with
        /// their targets), for any tasks, graces, signals and indexes.
        #[test]
        fn orders_read_back_as_the_core_answers_them(
            known in any::<bool>(),
            desired in prop::collection::vec(task(), 0..8),
            launch in prop::collection::vec((task(), prop::collection::vec(0u32..16, 0..8)), 0..8),
            stops in prop::collection::vec((task(), any::<u32>(), "[a-z ]{0,12}"), 0..4),
            suspended in prop::collection::vec(task(), 0..4),
            signals in prop::collection::vec((task(), any::<u64>(), any::<i32>(), target()), 0..4),
            from in (any::<u64>(), any::<u64>(), any::<u64>(), any::<u64>()),
        ) {
            let orders = NodeOrders {
                known,
                desired: desired.clone(),
                launch: launch.iter().map(|(t, _)| *t).collect(),
                stops: stops
                    .iter()
                    .map(|(t, grace_s, reason)| Stop { task: *t, grace_s: *grace_s, reason: reason.clone() })
                    .collect(),
                suspended: suspended.clone(),
                signals: signals.iter().map(|(t, seq, signal, target)| (*t, JobSignal { seq: *seq, signal: *signal, target: *target })).collect(),
            };
            let from = From { term: from.0, index: from.1, history: from.2, heartbeat_interval_ms: from.3 };
            let launch_orders: Vec<pb::LaunchOrder> = launch
                .iter()
                .map(|((job_id, attempt), gpus)| pb::LaunchOrder { job_id: *job_id, attempt: *attempt, gpus: gpus.clone(), ..Default::default() })
                .collect();
            let wire = orders_to_proto(&orders, from, launch_orders);
            let bytes = prost::Message::encode_to_vec(&wire);
            let back: pb::HeartbeatResponse = prost::Message::decode(bytes.as_slice()).unwrap();
            let answer = answer_from_proto(&back);
            let want = Answer {
                known,
                term: from.term,
                index: from.index,
                history: from.history,
                desired,
                launch,
                stops: stops.iter().map(|(t, grace_s, _)| (*t, *grace_s)).collect(),
                suspended,
                signals: orders.signals.clone(),
                heartbeat_interval_ms: from.heartbeat_interval_ms,
            };
            prop_assert_eq!(answer, want);
        }

        /// Whatever the agent reports, the leader's core reads the same
        /// through the wire: its tasks, the orders it acted on, its history
        /// and its GPUs' health.
        #[test]
        fn a_heartbeat_reads_back_as_the_agent_sent_it(
            name in "[a-z0-9-]{1,16}",
            running in prop::collection::btree_set(task(), 0..8),
            seen_index in any::<u64>(),
            history in any::<u64>(),
            health in prop::collection::vec((0u32..64, any::<bool>(), "[a-z ]{0,12}"), 0..8),
        ) {
            let reports = health
                .iter()
                .map(|(index, healthy, reason)| pb::GpuHealthReport { index: *index, healthy: *healthy, reason: reason.clone() })
                .collect();
            let wire = heartbeat_to_proto(&name, running.iter().copied(), seen_index, history, reports);
            let bytes = prost::Message::encode_to_vec(&wire);
            let back: pb::HeartbeatRequest = prost::Message::decode(bytes.as_slice()).unwrap();
            let hb = heartbeat_from_proto(&back);
            prop_assert_eq!(hb, Heartbeat { node: name, running, seen_index, history, gpu_health: health });
        }
    }

    /// An unknown target number (a newer peer's) reads as the steps.
    #[test]
    fn an_unknown_signal_target_is_the_steps() {
        assert_eq!(signal_target_from_proto(99), SignalTarget::Steps);
        for t in [SignalTarget::Steps, SignalTarget::Batch, SignalTarget::Full] {
            assert_eq!(signal_target_from_proto(signal_target_to_proto(t) as i32), t);
        }
    }
}
