//! The leader's decisions, as pure functions of the replicated state and what
//! the leader heard (openraft's Engine → Commands, raft-rs's Ready): which
//! commands its periodic work proposes ([`leader_tick`]) and what a node's
//! agent is told to run and stop ([`node_orders`]).
//!
//! The async shells in `controller/src/leader` and `controller/src/api/agent.rs`
//! carry inputs in and the results out; the whole-cluster simulation
//! (`sim/`, `gangway-sim`) drives the very same functions in virtual time.
//!
//! ```text
//!   State + Heard + now ──leader_tick──► Tick { commands (schedule, time limits, node down), reasons }
//!                 (Heard: when each node was last heard from, and what it runs)
//!   State + node + running + term ──node_orders──► NodeOrders { desired, launch, stops }
//! ```

use std::collections::{BTreeMap, BTreeSet};

use crate::command::{Command, NodeStateChange};
use crate::model::{Job, JobId, JobState, NodeState, StopCause};
use crate::sched;
use crate::state::State;

/// Jobs ended for their time limit per tick (bounds one tick's log entries).
pub const TIMEOUTS_PER_TICK_MAX: usize = 256;
/// Nodes marked Down per tick: bounds the work (and log entries) of one tick if
/// a whole rack goes silent at once; the rest follow on the next ticks.
pub const DOWN_PER_TICK_MAX: usize = 256;

/// What the leader heard from the nodes, in its own monotonic milliseconds
/// (never the wall clock the commands carry: a clock step must not make every
/// node look silent).
pub struct Heard<'a> {
    /// Monotonic now.
    pub now: u64,
    /// When this replica became leader: a new leader counts every node as heard
    /// from at that moment, so a controller failover never marks healthy nodes
    /// down (their agents reconnect and heartbeat well within the timeout).
    pub leader_since: u64,
    /// A node silent for longer than this is Down.
    pub down_timeout_ms: u64,
    /// The last heartbeat from a node, if any since this replica started.
    pub last: &'a dyn Fn(&str) -> Option<u64>,
    /// The log index the state reflects.
    pub index: u64,
    /// A node's latest task report (the heartbeat with the highest
    /// `seen_index`): that index, when it came, and whether it listed a task
    /// of the job. None: no report yet.
    pub runs: &'a dyn Fn(&str, JobId) -> Option<TaskReport>,
}

/// The leader's memory of what each node said (the controller keeps one
/// behind a lock, the simulation and the scenarios one each): when each node
/// was last heard from, and its latest task report. Times are the leader's
/// monotonic milliseconds.
#[derive(Debug, Clone, Default)]
pub struct HeardBook {
    nodes: BTreeMap<String, NodeHeard>,
}

#[derive(Debug, Clone, Default)]
struct NodeHeard {
    /// A heartbeat or a registration.
    at: u64,
    report: Option<Report>,
}

#[derive(Debug, Clone)]
struct Report {
    seen_index: u64,
    at: u64,
    jobs: BTreeSet<JobId>,
}

impl HeardBook {
    /// `node` was heard from at `now`; `running` is its heartbeat's
    /// `seen_index` and the jobs of the tasks it reported (None for a
    /// registration: a new agent, whose `seen_index` starts again, so its
    /// report is cleared). A report older than the one kept (a late
    /// heartbeat) is ignored. Beyond `nodes_max` nodes, new ones are not
    /// remembered.
    pub fn record(&mut self, node: &str, now: u64, running: Option<(u64, BTreeSet<JobId>)>, nodes_max: usize) {
        if self.nodes.len() >= nodes_max && !self.nodes.contains_key(node) {
            return;
        }
        let n = self.nodes.entry(node.to_string()).or_default();
        n.at = now;
        match running {
            Some((seen_index, jobs)) => {
                if n.report.as_ref().is_none_or(|r| seen_index >= r.seen_index) {
                    n.report = Some(Report { seen_index, at: now, jobs });
                }
            }
            None => n.report = None,
        }
    }

    /// When `node` was last heard from (see [`Heard::last`]).
    pub fn last(&self, node: &str) -> Option<u64> {
        self.nodes.get(node).map(|n| n.at)
    }

    /// What `node`'s latest report said of `job` (see [`Heard::runs`]).
    pub fn runs(&self, node: &str, job: JobId) -> Option<TaskReport> {
        let r = self.nodes.get(node)?.report.as_ref()?;
        Some(TaskReport { seen_index: r.seen_index, at: r.at, listed: r.jobs.contains(&job) })
    }
}

/// What one heartbeat said about one job (see [`Heard::runs`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TaskReport {
    /// The highest index of orders the agent had acted on (0: an agent from
    /// before the field).
    pub seen_index: u64,
    /// When the leader received it (monotonic ms).
    pub at: u64,
    /// It listed a task of the job as running.
    pub listed: bool,
}

/// What the leader remembers between ticks (in memory; a new leader starts
/// with none): for each requeued job, when it first saw it requeued and
/// whether its previous attempt has since been seen ended everywhere.
#[derive(Debug, Default)]
pub struct LeaderMemory {
    requeued: BTreeMap<JobId, Requeued>,
    /// Up pool nodes with no jobs: since when this leader has seen them idle.
    idle_since: BTreeMap<String, u64>,
    /// Pool nodes whose power program this leader asked to run, with the
    /// time of the state change it ran for (once per change: a new leader
    /// runs each again, as the programs must allow).
    powered: BTreeMap<String, u64>,
}

#[derive(Debug, Clone, Copy)]
struct Requeued {
    /// The job's attempt then (a new placement makes it another).
    attempt: u32,
    /// The log index and monotonic ms when first seen: both at or after the
    /// requeue.
    since_index: u64,
    since_ms: u64,
    /// Every node's task of that attempt was seen ended: the job may start,
    /// and stays free to until it does (a job released once must not go back
    /// to waiting while it waits for resources).
    released: bool,
}

/// One tick's decisions.
#[derive(Debug, Default)]
pub struct Tick {
    /// To propose, in order: at most one `ApplySchedule`, then time-limit
    /// ends, then nodes going Down.
    pub commands: Vec<Command>,
    /// Why examined pending jobs did not start (for listings).
    pub reasons: Vec<(JobId, crate::sched::Pending)>,
    /// Pool nodes to power up (the resume program) and down (the suspend
    /// program) now: each at most [`POWER_NODES_PER_TICK_MAX`].
    pub power_up: Vec<String>,
    pub power_down: Vec<String>,
}

/// The leader's periodic work at wall time `now_ms`: a scheduling pass, jobs
/// past their time limit, and (with `heard`) nodes silent for too long.
pub fn leader_tick(
    state: &State,
    now_ms: u64,
    heard: Option<&Heard<'_>>,
    memory: &mut LeaderMemory,
    policy: sched::Policy,
) -> Tick {
    let stopping = heard.map(|h| stopping_jobs(state, h, memory)).unwrap_or_default();
    let mut opts = sched::Options::new(policy, now_ms);
    opts.stopping = Some(&stopping);
    let mut plan = sched::plan(state, &opts);
    let mut commands = Vec::new();
    if !plan.placements.is_empty() || !plan.preemptions.is_empty() {
        commands.push(Command::ApplySchedule {
            preemptions: std::mem::take(&mut plan.preemptions),
            placements: std::mem::take(&mut plan.placements),
            now_ms,
        });
    }
    commands.extend(time_limit_ends(state, now_ms));
    commands.extend(deadline_ends(state, now_ms));
    if let Some(heard) = heard {
        commands.extend(silent_nodes(state, heard, now_ms));
    }
    let power = power_decisions(state, now_ms, memory);
    commands.extend(power.commands);
    Tick { commands, reasons: plan.reasons, power_up: power.up, power_down: power.down }
}

/// Power changes of elastic pools one tick proposes at most, and nodes one
/// program call names at most (the rest wait for the next tick).
pub const POWER_NODES_PER_TICK_MAX: usize = 256;

/// What [`power_decisions`] decided.
#[derive(Debug, Default)]
pub struct Power {
    /// Boot timeouts (Down) and idle nodes to power down (PowerDown).
    pub commands: Vec<Command>,
    /// Nodes whose machines the resume and suspend programs must power.
    pub up: Vec<String>,
    pub down: Vec<String>,
}

/// The elastic pools' duties (data format 12): a booting node past its
/// pool's `resume_timeout_s` goes down (its jobs requeued); an up node idle
/// for its pool's `suspend_after_s` is powered down; and the programs run
/// once per change for nodes that went booting, or powered down after they
/// had registered. Bounded by the pools' nodes.
pub fn power_decisions(state: &State, now_ms: u64, memory: &mut LeaderMemory) -> Power {
    let mut out = Power::default();
    if state.format < crate::format::ELASTIC_POOLS_FORMAT || state.policy.pools.is_empty() {
        memory.idle_since.clear();
        memory.powered.clear();
        return out;
    }
    let mut idle = BTreeMap::new();
    let mut powered = BTreeMap::new();
    for pool in state.policy.pools.values() {
        for name in &pool.nodes {
            let Some(n) = state.nodes.get(name) else { continue };
            let changed = n.state_changed_ms;
            match n.state {
                NodeState::PoweringUp => {
                    let waited = now_ms.saturating_sub(changed);
                    if waited > pool.resume_timeout_s.saturating_mul(1000)
                        && out.commands.len() < POWER_NODES_PER_TICK_MAX
                    {
                        out.commands.push(Command::SetNodeState {
                            name: name.clone(),
                            change: NodeStateChange::Down,
                            reason: format!(
                                "power up: its agent did not register within {} s (the pool's resume_timeout_s)",
                                pool.resume_timeout_s
                            ),
                            now_ms,
                        });
                    }
                    if memory.powered.get(name) != Some(&changed) && out.up.len() < POWER_NODES_PER_TICK_MAX {
                        out.up.push(name.clone());
                        powered.insert(name.clone(), changed);
                    } else if memory.powered.get(name) == Some(&changed) {
                        powered.insert(name.clone(), changed);
                    }
                }
                // Only a node that had registered has a machine to power down.
                NodeState::PoweredDown if n.ever_registered() => {
                    if memory.powered.get(name) != Some(&changed) && out.down.len() < POWER_NODES_PER_TICK_MAX {
                        out.down.push(name.clone());
                        powered.insert(name.clone(), changed);
                    } else if memory.powered.get(name) == Some(&changed) {
                        powered.insert(name.clone(), changed);
                    }
                }
                NodeState::Up if n.jobs.is_empty() && pool.suspend_after_s > 0 => {
                    let since = memory.idle_since.get(name).copied().unwrap_or(now_ms);
                    idle.insert(name.clone(), since);
                    let idle_ms = now_ms.saturating_sub(since);
                    if idle_ms >= pool.suspend_after_s.saturating_mul(1000)
                        && out.commands.len() < POWER_NODES_PER_TICK_MAX
                    {
                        out.commands.push(Command::SetNodeState {
                            name: name.clone(),
                            change: NodeStateChange::PowerDown,
                            reason: format!("idle for {} s (the pool's suspend_after_s)", idle_ms / 1000),
                            now_ms,
                        });
                    }
                }
                _ => {}
            }
        }
    }
    memory.idle_since = idle;
    memory.powered = powered;
    out
}

/// Requeued jobs not to start yet: a task of their previous attempt may still
/// run (stopping within its grace, or on a node not heard from since). A job
/// must never run two attempts at once: both would write the same
/// checkpoints and outputs (Slurm keeps such a job COMPLETING until every
/// node reports its end). Each node the previous attempt ran on must have
/// sent a report that reflects the requeue (its agent acted on orders from
/// a state that has the job requeued) and that does not list the job. A node
/// that is Down has fenced itself, so its tasks no longer count. Bounded by
/// the pending jobs and their nodes.
pub fn stopping_jobs(state: &State, heard: &Heard<'_>, memory: &mut LeaderMemory) -> BTreeSet<JobId> {
    let mut stopping = BTreeSet::new();
    let mut kept = BTreeMap::new();
    for id in &state.pending {
        let Some(job) = state.jobs.get(id) else { continue };
        if job.ran_on.is_empty() {
            continue;
        }
        let mut r = memory.requeued.get(id).copied().filter(|r| r.attempt == job.attempt).unwrap_or(Requeued {
            attempt: job.attempt,
            since_index: heard.index,
            since_ms: heard.now,
            released: false,
        });
        r.released = r.released
            || job.ran_on.iter().all(|node| {
                // Down, or powered down: its tasks are gone either way.
                if state.nodes.get(node).is_none_or(|n| matches!(n.state, NodeState::Down | NodeState::PoweredDown)) {
                    return true;
                }
                match (heard.runs)(node, *id) {
                    // An agent from before `seen_index`: a report received
                    // after the leader saw the requeue (weaker: a heartbeat
                    // can arrive late).
                    Some(t) if t.seen_index == 0 => !t.listed && t.at > r.since_ms,
                    Some(t) => !t.listed && t.seen_index >= r.since_index,
                    None => false,
                }
            });
        if !r.released {
            stopping.insert(*id);
        }
        kept.insert(*id, r);
    }
    memory.requeued = kept;
    stopping
}

/// Running jobs whose time limit has passed at `now_ms`, ended as TIMEOUT.
pub fn time_limit_ends(state: &State, now_ms: u64) -> Vec<Command> {
    state
        .running
        .iter()
        .filter_map(|id| state.jobs.get(id))
        // A suspended job's limit is paused (`limit_end_ms` is None).
        .filter(|j| j.limit_end_ms().is_some_and(|end| end <= now_ms))
        .take(TIMEOUTS_PER_TICK_MAX)
        .map(|j| Command::JobFinished {
            job_id: j.id,
            attempt: j.attempt,
            state: JobState::TimedOut,
            exit_code: None,
            reason: format!("time limit of {} reached", format_duration_s(j.spec.time_limit_s)),
            now_ms,
        })
        .collect()
}

/// Pending jobs that can no longer end by their `--deadline`, ended as
/// DEADLINE (Slurm's): a walk over the unfinished jobs that have one.
pub fn deadline_ends(state: &State, now_ms: u64) -> Vec<Command> {
    if state.format < crate::format::SLURM_FEATURES_FORMAT {
        return Vec::new();
    }
    state
        .deadline_jobs
        .iter()
        .filter_map(|id| state.jobs.get(id))
        .filter(|j| j.state == JobState::Pending && j.deadline_missed(now_ms))
        .take(TIMEOUTS_PER_TICK_MAX)
        .map(|j| Command::JobFinished {
            job_id: j.id,
            attempt: j.attempt,
            state: JobState::Deadline,
            exit_code: None,
            reason: "it can no longer end by its deadline".into(),
            now_ms,
        })
        .collect()
}

/// Nodes not Down that the leader has not heard from for longer than the
/// timeout, marked Down.
pub fn silent_nodes(state: &State, heard: &Heard<'_>, now_ms: u64) -> Vec<Command> {
    state
        .nodes
        .values()
        // A pool's powered-down or booting node has no agent to hear yet.
        .filter(|n| matches!(n.state, NodeState::Up | NodeState::Drain))
        .filter_map(|n| {
            let silent_ms = silence_ms(heard.now, heard.leader_since, (heard.last)(&n.name));
            (silent_ms > heard.down_timeout_ms).then(|| Command::SetNodeState {
                name: n.name.clone(),
                change: NodeStateChange::Down,
                reason: format!("no heartbeat for {}.{}s", silent_ms / 1000, silent_ms % 1000 / 100),
                now_ms,
            })
        })
        .take(DOWN_PER_TICK_MAX)
        .collect()
}

/// How long a node has been silent at `now`, as the leader counts it: from
/// its last heartbeat, or from when this leader took over if later.
pub fn silence_ms(now: u64, leader_since: u64, last: Option<u64>) -> u64 {
    now.saturating_sub(last.map_or(leader_since, |t| t.max(leader_since)))
}

/// Whether a heartbeat from a node silent for `silence_ms` may be answered
/// with orders. Past the node-down timeout it may not: the leader may already
/// have decided the node is Down (the command in flight), and orders now
/// would renew the agent's self-fence and start tasks that the Down then
/// requeues elsewhere while they run. The agent is told to register again
/// instead (`NodeOrders::default()`, not known), which grants no contact.
pub fn may_answer(silence_ms: u64, down_timeout_ms: u64) -> bool {
    silence_ms <= down_timeout_ms
}

pub use crate::model::TaskKey;

/// A heartbeat as the leader's core reads it
/// (`gangway_proto::orders::heartbeat_from_proto` turns the protobuf into
/// this, for the API and the simulation alike).
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Heartbeat {
    pub node: String,
    /// The tasks the agent runs.
    pub running: BTreeSet<TaskKey>,
    /// The log index of the orders the agent last acted on.
    pub seen_index: u64,
    /// The cluster history `seen_index` counts in (an agent that names none
    /// counts in the first, 0).
    pub history: u64,
    /// What the agent says of its GPUs: index, healthy, why not.
    pub gpu_health: Vec<(u32, bool, String)>,
}

/// What the leader does with a heartbeat (see [`on_heartbeat`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum HeartbeatReply {
    /// The node is unknown or Down, or silent past the node-down timeout
    /// (see [`may_answer`]): no orders; the agent registers again.
    RegisterAgain,
    /// The agent acted on orders from a state this leader has not applied
    /// yet (it just became leader): its report and its orders wait.
    Behind { index: u64, seen_index: u64 },
    /// Orders for the node; the shell records `seen_index` and the jobs the
    /// agent runs in its [`HeardBook`] as of now.
    Orders { orders: NodeOrders, seen_index: u64, jobs: BTreeSet<JobId> },
}

/// The GPU health changes a heartbeat reports against `state`
/// (level-triggered: only what differs), as commands the shell proposes
/// before it answers. `reason` is cut to `reason_max` bytes on a character
/// boundary.
pub fn gpu_health_changes(state: &State, hb: &Heartbeat, now_ms: u64, reason_max: usize) -> Vec<crate::Command> {
    let Some(node) = state.nodes.get(&hb.node) else { return Vec::new() };
    hb.gpu_health
        .iter()
        .filter_map(|(index, healthy, reason)| {
            let g = node.gpus.get(usize::try_from(*index).ok()?)?;
            let healthy_now = g.health == crate::model::GpuHealth::Healthy;
            (healthy_now != *healthy).then(|| crate::Command::SetGpuHealth {
                node: hb.node.clone(),
                gpu: *index,
                healthy: *healthy,
                reason: cut_on_char(reason, reason_max).to_string(),
                now_ms,
            })
        })
        .collect()
}

fn cut_on_char(s: &str, max: usize) -> &str {
    let mut end = s.len().min(max);
    while !s.is_char_boundary(end) {
        end = end.saturating_sub(1);
    }
    s.get(..end).unwrap_or("")
}

/// The leader's side of a heartbeat from a state at log `index`, the node
/// silent for `silence_ms` before it (see [`silence_ms`]): whether it may be
/// answered, whether the agent is ahead of this state, and its orders. The
/// controller's gRPC handler and the simulation both call this.
pub fn on_heartbeat(
    state: &State,
    index: u64,
    silence_ms: u64,
    down_timeout_ms: u64,
    hb: &Heartbeat,
) -> HeartbeatReply {
    let known = state.nodes.get(&hb.node).is_some_and(|n| n.state != NodeState::Down);
    if !known || !may_answer(silence_ms, down_timeout_ms) {
        return HeartbeatReply::RegisterAgain;
    }
    // An index of another history (the cluster was restored from a backup
    // since the agent last heard from it) says nothing about this one's
    // log: as from an agent that has acted on no orders yet.
    let seen_index = if hb.history != state.history { 0 } else { hb.seen_index };
    if seen_index > index {
        return HeartbeatReply::Behind { index, seen_index };
    }
    let jobs = hb.running.iter().map(|t| t.0).collect();
    HeartbeatReply::Orders { orders: node_orders(state, &hb.node, &hb.running), seen_index, jobs }
}

/// What one node's agent is told (see [`node_orders`]).
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct NodeOrders {
    /// False when the node is unknown or Down: the agent registers again.
    pub known: bool,
    /// Every task that should run here (including ones already ended here
    /// while their gang runs on elsewhere).
    pub desired: Vec<TaskKey>,
    /// Tasks to start: desired, not running and not ended here.
    pub launch: Vec<TaskKey>,
    /// Running tasks to stop with a grace other than the agent's own.
    pub stops: Vec<Stop>,
    /// Desired tasks whose job is suspended: stopped where they stand
    /// (the others run, and a suspended one is continued).
    pub suspended: Vec<TaskKey>,
    /// Desired tasks whose job was sent a signal (`scancel --signal`): the
    /// last request, which the agent delivers once.
    pub signals: Vec<(TaskKey, crate::model::JobSignal)>,
}

/// A task to stop with its own grace: a preempted job's, its QOS's grace
/// (the only stop that has one; other tasks stop with the agent's).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Stop {
    pub task: TaskKey,
    /// Seconds between the warning signal and the kill.
    pub grace_s: u32,
    pub reason: String,
}

impl NodeOrders {
    /// Each task to launch with the GPUs its job holds on `node`.
    pub fn launch_gpus(&self, state: &State, node: &str) -> Vec<(TaskKey, Vec<u32>)> {
        self.launch
            .iter()
            .filter_map(|key| {
                let job = state.jobs.get(&key.0)?;
                let mine = job.allocation.as_ref()?.nodes.iter().find(|a| a.node == node)?;
                Some((*key, mine.gpus.clone()))
            })
            .collect()
    }

    /// These orders as the agent's core reads them, from a leader of `term`
    /// whose state is at log `index`: what the wire codec
    /// (`gangway_proto::orders`) must give the agent, by its property test,
    /// and what the core's own scenario tests hand the agent's core (they
    /// cannot link the codec, which links the core).
    pub fn answer(
        &self,
        state: &State,
        node: &str,
        term: u64,
        index: u64,
        heartbeat_interval_ms: u64,
    ) -> crate::agent::Answer {
        let launch = self.launch_gpus(state, node);
        crate::agent::Answer {
            known: self.known,
            term,
            index,
            history: state.history,
            desired: self.desired.clone(),
            launch,
            stops: self.stops.iter().map(|s| (s.task, s.grace_s)).collect(),
            suspended: self.suspended.clone(),
            signals: self.signals.clone(),
            heartbeat_interval_ms,
        }
    }
}

/// Heartbeats per second the leader asks of its whole fleet at most: past
/// `base_ms × this` nodes the interval stretches with the fleet, as Nomad
/// scales its node TTLs to cap heartbeats per second. 2,000/s is what one
/// leader on a 2-core host answers with a p99 round trip well under 100 ms
/// while it also schedules and replicates (`gangway bench fleet`).
pub const FLEET_HEARTBEATS_PER_S_MAX: u64 = 2_000;

/// The heartbeat interval a leader of `nodes` nodes asks for: the configured
/// `base_ms`, stretched so the fleet sends at most
/// [`FLEET_HEARTBEATS_PER_S_MAX`] a second, and never longer than what
/// leaves an agent [`crate::agent::HEARTBEATS_PER_FENCE_WINDOW_MIN`]
/// heartbeats in its self-fence window (the node-down timeout does not
/// stretch: a dead node is still found within it).
pub fn heartbeat_interval_ms(nodes: usize, base_ms: u64, down_timeout_ms: u64) -> u64 {
    let spread = (nodes as u64).saturating_mul(1000).div_ceil(FLEET_HEARTBEATS_PER_S_MAX);
    base_ms.max(spread).min(crate::agent::heartbeat_interval_cap_ms(down_timeout_ms))
}

/// What `node` should run, given the tasks its agent reports running. Tasks
/// the agent runs that are not desired are stopped by the agent itself; those
/// of a preempted job get the grace of its QOS.
pub fn node_orders(state: &State, node: &str, running: &BTreeSet<TaskKey>) -> NodeOrders {
    // A powered-down node's agent registers again to be up (refused while
    // its power-down is recent: `State::apply_register_node`).
    let Some(n) = state.nodes.get(node).filter(|n| !matches!(n.state, NodeState::Down | NodeState::PoweredDown)) else {
        return NodeOrders::default();
    };
    let mut orders = NodeOrders { known: true, ..NodeOrders::default() };
    for job_id in &n.jobs {
        let Some(job) = state.jobs.get(job_id) else { continue };
        let key = (*job_id, job.attempt);
        orders.desired.push(key);
        if job.is_suspended() {
            orders.suspended.push(key);
        }
        if let Some(signal) = job.signal {
            orders.signals.push((key, signal));
        }
        // A task that already ended here stays desired (the gang still runs
        // elsewhere) but is never launched again.
        // A suspended job's tasks that have not started wait for its resume.
        // One whose nodes are still booting waits for them all (its clock
        // starts then too): a gang starts together.
        if !job.task_exits.contains_key(node)
            && !running.contains(&key)
            && job.allocation.is_some()
            && !job.is_suspended()
            && job.start_time_ms.is_some()
        {
            orders.launch.push(key);
        }
    }
    let desired: BTreeSet<TaskKey> = orders.desired.iter().copied().collect();
    for key in running.iter().filter(|k| !desired.contains(k)) {
        let Some(job) = state.jobs.get(&key.0) else { continue };
        if stopped_by_preemption(state.format, job) {
            orders.stops.push(Stop {
                task: *key,
                grace_s: state.policy.qos_of(&job.spec.qos).preempt_grace_s,
                reason: job.reason.clone(),
            });
        }
    }
    orders
}

/// Whether the job's last attempt was stopped to make room for another job,
/// in a state of data format `format`: its typed stop cause from format 18;
/// before, the words apply wrote in its reason
/// ([`StopCause::legacy_preemptor`]).
pub fn stopped_by_preemption(format: u32, job: &Job) -> bool {
    if format >= crate::format::STOP_CAUSE_FORMAT {
        return job.stop_cause.as_ref().and_then(StopCause::preempted_by).is_some();
    }
    StopCause::legacy_preemptor(&job.reason).is_some()
}

/// `H:MM:SS` (or `D-HH:MM:SS`) for messages about durations.
pub fn format_duration_s(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    if d > 0 {
        format!("{d}-{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h}:{m:02}:{s:02}")
    }
}

/// Which agents to wake when the state changes. A poke makes a watching
/// agent heartbeat at once rather than at its next interval, so it starts
/// and stops tasks promptly; it never carries orders (the heartbeat's answer
/// does), so a poke missed costs latency, never correctness. Only the nodes
/// a change concerns are woken: waking the whole fleet for every job that
/// ends would have every agent heartbeat for every exit in the cluster.
#[derive(Debug, Clone, Default)]
pub struct PokeBook {
    /// The nodes of each running job's attempt, learned when it started: a
    /// job that ends or is requeued no longer holds its allocation in the
    /// state. At most one entry per running job.
    running: BTreeMap<JobId, Vec<String>>,
}

impl PokeBook {
    /// Learns the nodes of every job running in `state` (at start, and after
    /// events were missed). Returns how many jobs it knows.
    pub fn resync(&mut self, state: &State) -> usize {
        self.running =
            state.running.iter().filter_map(|id| Some((*id, allocation_nodes(state.jobs.get(id)?)?))).collect();
        self.running.len()
    }

    /// The nodes to wake for `event`, read from `state` as it is at or after
    /// the event (sorted, no duplicates).
    pub fn nodes_to_poke(&mut self, event: &crate::state::Event, state: &State) -> Vec<String> {
        let ev = match event {
            crate::state::Event::Node { node, .. } => return vec![node.clone()],
            // A step's start or end changes nothing its nodes are told.
            crate::state::Event::Job(ev) if ev.step.is_some() => return Vec::new(),
            crate::state::Event::Job(ev) => ev,
        };
        let now_on = state
            .jobs
            .get(&ev.job_id)
            .filter(|j| j.state == JobState::Running && j.attempt == ev.attempt)
            .and_then(allocation_nodes);
        let mut nodes = match now_on {
            // Started (or changed while running): its nodes launch.
            Some(nodes) if ev.state == JobState::Running => {
                self.running.insert(ev.job_id, nodes.clone());
                nodes
            }
            // Ended, requeued, or no longer running as that attempt: the nodes
            // it ran on stop it. (A new submission was never running: none.)
            _ => self.running.remove(&ev.job_id).unwrap_or_default(),
        };
        nodes.sort_unstable();
        nodes.dedup();
        nodes
    }

    /// Whether it knows no running job's nodes.
    pub fn is_empty(&self) -> bool {
        self.running.is_empty()
    }
}

fn allocation_nodes(job: &Job) -> Option<Vec<String>> {
    Some(job.allocation.as_ref()?.nodes.iter().map(|n| n.node.clone()).collect())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::Node;
    use crate::policy::NodePool;
    use crate::spec::NodeSpec;

    /// A state whose one pool has `count` nodes in `node_state`, changed at
    /// 0; registered ones have an address.
    fn pool_of(count: usize, node_state: NodeState, registered: bool) -> State {
        let mut s = State { format: crate::format::FORMAT_NEWEST, ..State::default() };
        let names: Vec<String> = (0..count).map(|i| format!("p{i:04}")).collect();
        for name in &names {
            let spec = NodeSpec {
                name: name.clone(),
                addr: if registered { "10.0.0.1:1".into() } else { String::new() },
                cpus: 1,
                mem_mb: 1024,
                gpus: vec![],
                topology: vec![],
                labels: Default::default(),
            };
            let mut node = Node::from_spec(&spec, 0);
            (node.state, node.state_changed_ms) = (node_state, 0);
            s.nodes.insert(name.clone(), node);
        }
        let pool = NodePool { nodes: names, resume_timeout_s: 1, ..NodePool::default() };
        s.policy.pools.insert("cloud".into(), pool);
        s
    }

    /// One tick powers up, times out and powers down at most
    /// POWER_NODES_PER_TICK_MAX pool nodes each: that many all in one tick,
    /// one more on the next tick.
    #[test]
    fn power_decisions_take_their_nodes_max_per_tick_and_one_more_next_tick() {
        let now = 1_000_000;
        for count in [POWER_NODES_PER_TICK_MAX, POWER_NODES_PER_TICK_MAX + 1] {
            let later = count - POWER_NODES_PER_TICK_MAX;
            let booting = pool_of(count, NodeState::PoweringUp, false);
            let mut memory = LeaderMemory::default();
            let first = power_decisions(&booting, now, &mut memory);
            assert_eq!((first.up.len(), first.commands.len()), (POWER_NODES_PER_TICK_MAX, POWER_NODES_PER_TICK_MAX));
            assert!(first
                .commands
                .iter()
                .all(|c| matches!(c, Command::SetNodeState { change: NodeStateChange::Down, .. })));
            let next = power_decisions(&booting, now, &mut memory);
            assert_eq!(next.up, booting.policy.pools["cloud"].nodes[POWER_NODES_PER_TICK_MAX..].to_vec());
            let down = pool_of(count, NodeState::PoweredDown, true);
            let mut memory = LeaderMemory::default();
            assert_eq!(power_decisions(&down, now, &mut memory).down.len(), POWER_NODES_PER_TICK_MAX);
            assert_eq!(power_decisions(&down, now, &mut memory).down.len(), later);
            let idle = pool_of(count, NodeState::Up, true);
            let idle_since = idle.nodes.keys().map(|n| (n.clone(), 0)).collect();
            let mut memory = LeaderMemory { idle_since, ..LeaderMemory::default() };
            let commands = power_decisions(&idle, now, &mut memory).commands;
            assert_eq!(commands.len(), POWER_NODES_PER_TICK_MAX);
        }
    }
}
