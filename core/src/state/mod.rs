//! The deterministic state machine: [`State::apply`] turns one [`Command`] into an
//! [`Outcome`] and a list of [`JobEvent`]s.
//!
//! Apply is total: a command that cannot take effect (unknown job, stale plan, bad
//! spec) returns a [`Refusal`] and changes nothing, identically on every replica.
//! A broken invariant is a bug and panics: one replica crashing is better than
//! replicas silently diverging. [`State::check_invariants`] verifies everything
//! (tests call it after every apply).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::command::{Command, NodeStateChange};
use crate::format::{ACCOUNTING_FORMAT, IDEMPOTENCY_CAPS_FORMAT};
use crate::limits::*;
use crate::model::*;
use crate::policy::{ClusterPolicy, Use};
use crate::reservation::Reservation;
use crate::spec::{NodeSpec, SpecError};

mod admin;
mod deps;
#[cfg(test)]
mod idempotency_tests;
mod invariants;
mod pools;
mod reservations;
mod schedule;
mod steps;
mod submit;
mod update;
mod usage;
mod yielding;

pub use reservations::ReservationWait;
pub use submit::DepStatus;
pub use usage::{alloc_use, check_restored_usage, usage_bucket_width_ms, usage_from_runs, ChargedRun, UsageBucket};

/// Idempotency entries purged per applied command. Bounds the work of one apply;
/// entries expire at most as fast as submits create them, so this keeps up.
const IDEMPOTENCY_PURGE_PER_APPLY_MAX: usize = 64;

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefusalKind {
    NotFound,
    InvalidArgument,
    /// The object is not in a state that allows the command.
    FailedPrecondition,
    /// A replicated limit would be exceeded.
    ResourceExhausted,
    /// The command was based on an older state (plan or attempt superseded).
    Stale,
    /// The caller may not do this (not the owner, not an admin).
    PermissionDenied,
}

/// An expected refusal: a value, the same on every replica.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Refusal {
    pub kind: RefusalKind,
    pub message: String,
}

impl Refusal {
    fn new(kind: RefusalKind, message: impl Into<String>) -> Self {
        Refusal { kind, message: message.into() }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Outcome {
    Submitted {
        job_id: JobId,
        duplicate: bool,
    },
    Cancelled {
        job_id: JobId,
    },
    NodeRegistered {
        name: String,
    },
    NodeStateSet {
        name: String,
        state: NodeState,
    },
    PlanApplied {
        started: Vec<JobId>,
        rejected: Vec<(JobId, String)>,
    },
    JobFinished {
        job_id: JobId,
    },
    Refused(Refusal),
    /// One result per command of a `Command::Batch`, in order.
    Batch(Vec<Applied>),
    TaskRecorded {
        job_id: JobId,
    },
    GpuHealthSet {
        node: String,
        gpu: u32,
        healthy: bool,
    },
    PolicyUpdated {
        version: u64,
    },
    JobUpdated {
        job_id: JobId,
    },
    ScheduleApplied {
        preempted: Vec<JobId>,
        started: Vec<JobId>,
        rejected: Vec<(JobId, String)>,
    },
    StepStarted {
        job_id: JobId,
        step_id: u32,
    },
    StepEnded {
        job_id: JobId,
        step_id: u32,
    },
    CheckpointRecorded {
        job_id: JobId,
    },
    DataFormatSet {
        format: u32,
    },
    ReservationChanged {
        name: String,
    },
    UsageRestored {
        accounts: u32,
    },
    AccountingStored {
        index: u64,
    },
    /// The node inventory is at `version` now; `revoked` nodes went down.
    NodeInventorySet {
        version: u64,
        revoked: Vec<String>,
    },
    HistoryDrawn {
        history: u64,
    },
}

/// Whose use a counter tracks, for quotas.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum UseKey {
    /// An account, counting its sub-accounts' jobs too.
    Account(String),
    User(String),
    /// (QOS, user): QOS per-user limits.
    QosUser(String, String),
}

/// What happened to a node, for the event stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeChange {
    Registered,
    State(NodeState),
    Gpu { gpu: u32, healthy: bool },
}

/// Everything the event stream carries: job changes, node and GPU changes.
/// `index` is the log entry that caused it, so every replica numbers events
/// alike and a client can resume on any of them.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    Job(JobEvent),
    Node { index: u64, node: String, change: NodeChange, reason: String },
}

impl Event {
    pub fn index(&self) -> u64 {
        match self {
            Event::Job(e) => e.index,
            Event::Node { index, .. } => *index,
        }
    }
}

impl State {
    /// The events one applied command produced: its job events, then what it
    /// changed on nodes (read from the state just after applying it).
    pub fn events_of(&self, index: u64, applied: &Applied, out: &mut Vec<Event>) {
        out.extend(applied.events.iter().cloned().map(Event::Job));
        self.node_events_of(index, &applied.outcome, out);
    }

    fn node_events_of(&self, index: u64, outcome: &Outcome, out: &mut Vec<Event>) {
        let reason = |node: &str| self.nodes.get(node).map(|n| n.state_reason.clone()).unwrap_or_default();
        match outcome {
            Outcome::NodeRegistered { name } => out.push(Event::Node {
                index,
                node: name.clone(),
                change: NodeChange::Registered,
                reason: String::new(),
            }),
            Outcome::NodeStateSet { name, state } => out.push(Event::Node {
                index,
                node: name.clone(),
                change: NodeChange::State(*state),
                reason: reason(name),
            }),
            Outcome::GpuHealthSet { node, gpu, healthy } => {
                let why = self
                    .nodes
                    .get(node)
                    .and_then(|n| n.gpus.iter().find(|g| g.index == *gpu))
                    .map(|g| g.health_reason.clone())
                    .unwrap_or_default();
                out.push(Event::Node {
                    index,
                    node: node.clone(),
                    change: NodeChange::Gpu { gpu: *gpu, healthy: *healthy },
                    reason: why,
                })
            }
            Outcome::Batch(results) => {
                for r in results {
                    self.node_events_of(index, &r.outcome, out);
                }
            }
            _ => {}
        }
    }
}

/// A change to one job, streamed to watchers.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobEvent {
    pub index: u64,
    pub job_id: JobId,
    pub state: JobState,
    pub attempt: u32,
    pub reason: String,
    /// Some(true): the running job was suspended; Some(false): it was
    /// resumed; None: any other event.
    pub suspended: Option<bool>,
    /// The step this event is about, with its state (RUNNING when it
    /// started, its end state when it ended; `state` stays the job's);
    /// None: the job itself.
    pub step: Option<(u32, JobState)>,
    /// What a node's task of the finished job used arrived after the job
    /// ended (a cancel, a time limit, the batch host first): the job's
    /// record changed, not its state. Since format 13.
    #[serde(default)]
    pub usage: bool,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Applied {
    pub outcome: Outcome,
    pub events: Vec<JobEvent>,
}

impl Applied {
    fn refused(kind: RefusalKind, message: impl Into<String>) -> Applied {
        Applied { outcome: Outcome::Refused(Refusal::new(kind, message)), events: Vec::new() }
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct State {
    /// The id the next submitted job gets. Ids are never reused.
    pub next_job_id: JobId,
    pub jobs: BTreeMap<JobId, Job>,
    /// Pending jobs in submit order (the scheduler's queue).
    pub pending: BTreeSet<JobId>,
    pub running: BTreeSet<JobId>,
    /// Finished jobs, oldest first, for retention (see FINISHED_JOBS_RETAINED_MAX).
    pub finished: VecDeque<JobId>,
    pub nodes: BTreeMap<String, Node>,
    /// (identity, key) → job, for submit deduplication.
    pub idempotency: BTreeMap<(String, String), JobId>,
    /// (expiry time, identity, key), ordered by expiry for purging.
    pub idempotency_expiry: BTreeSet<(u64, String, String)>,
    /// Replicated clock: the highest `now_ms` applied. Leaders' clocks may disagree;
    /// this never goes backwards.
    pub clock_ms: u64,
    pub policy: ClusterPolicy,
    /// Historical usage per account, for fair share (oldest bucket first).
    pub usage: BTreeMap<String, VecDeque<UsageBucket>>,
    /// What running jobs hold, per account (with ancestors), user and QOS-user.
    pub running_use: BTreeMap<UseKey, Use>,
    /// Unfinished (pending + running) jobs per account (with ancestors), user and
    /// QOS-user, for submit limits.
    pub active_jobs: BTreeMap<UseKey, u64>,
    /// Job id → pending jobs whose dependencies wait on it (whole-array
    /// dependencies are filed under the array's job id).
    pub dependents: BTreeMap<JobId, BTreeSet<JobId>>,
    /// The cluster's data format (see `format`): what entries and snapshots
    /// are written in, and which rules `apply` follows. Only
    /// `Command::SetDataFormat` changes it. Since format 5.
    pub format: u32,
    /// Advance reservations by name. Since format 9.
    pub reservations: BTreeMap<String, Reservation>,
    /// The log index through which the accounting store holds every job
    /// (`Command::AccountingStored`; 0: no accounting service has said).
    /// Finished jobs after it are kept past `finished_jobs_kept`, up to the
    /// hard limits, until it has them. Since format 13.
    pub accounted_index: u64,
    /// Which history of the cluster this is: 0 for the one it started
    /// with, a new random number at every restore from a backup. Log
    /// indexes count within one history: an event's index names it only
    /// together with this. Not a field of the state's encoding: snapshots
    /// of format 15 on write it after the state (`format::HISTORY_FORMAT`).
    #[serde(skip)]
    pub history: u64,
    /// The log index this history began after: a restored cluster's first
    /// entry of its own follows the backup's index (0 for the first
    /// history). Written with `history`.
    #[serde(skip)]
    pub history_since: u64,
    /// A restore set `history` from the backup alone: the first leader
    /// draws it anew ([`Command::DrawHistory`]). Written after
    /// `history_since` from format 16 (`format::FRESH_HISTORY_FORMAT`).
    #[serde(skip)]
    pub history_pending: bool,
    /// Which nodes may register and what they may claim
    /// (`Command::SetNodeInventory`; empty: every node). Written after
    /// `history_pending` from format 17 (`format::NODE_ADMISSION_FORMAT`).
    #[serde(skip)]
    pub node_inventory: crate::inventory::NodeInventory,
    /// Jobs that started or finished during the current apply; their dependents
    /// are settled before apply returns. Always empty between applies.
    #[serde(skip)]
    pub(crate) dep_triggers: BTreeSet<JobId>,
    /// Bytes of spec (`JobSpec::size_bytes`) of each user's unfinished jobs,
    /// and of all of them (key ""), for the budgets. Derived from the jobs:
    /// kept up to date by `count_active`, rebuilt after a snapshot is decoded.
    #[serde(skip)]
    pub(crate) unfinished_bytes: BTreeMap<String, u64>,
    /// Bytes of spec the retained finished jobs hold. Derived like
    /// `unfinished_bytes`.
    #[serde(skip)]
    pub(crate) finished_bytes: u64,
    /// Seats of each license the running jobs hold. Derived from the jobs:
    /// kept by `count_running`, rebuilt after a snapshot is decoded.
    #[serde(skip)]
    pub(crate) licenses_used: BTreeMap<String, u64>,
    /// Seats held by running jobs per account or QOS with a license limit
    /// there (derived; see `ClusterPolicy::license_limits`).
    #[serde(skip)]
    pub(crate) licenses_held: BTreeMap<(crate::policy::LicenseScope, String), u64>,
    /// Unfinished jobs with a `--deadline`: the leader looks for missed
    /// deadlines only when there are any. Derived like `unfinished_bytes`.
    #[serde(skip)]
    pub(crate) deadline_jobs: BTreeSet<JobId>,
    /// Each user's unfinished (pending and running) jobs, so that a listing
    /// of one user's queue (`squeue --me`, `squeue -u`) looks at that user's
    /// jobs only, however long the whole queue. Derived like `deadline_jobs`.
    #[serde(skip)]
    pub(crate) active_by_user: BTreeMap<String, BTreeSet<JobId>>,
    /// Node → the reservations that hold it. Derived from the reservations:
    /// rebuilt whenever they change and after a snapshot is decoded.
    #[serde(skip)]
    pub(crate) reserved_nodes: BTreeMap<String, Vec<String>>,
    /// Running jobs suspended for a preemptor that gave up their CPUs and
    /// GPUs meanwhile (`Job::preempted_by`). Derived like `unfinished_bytes`.
    #[serde(skip)]
    pub(crate) yielded: BTreeSet<JobId>,
    /// Each identity's remembered idempotency keys, (expiry, key), oldest
    /// first: whose oldest to forget at the per-identity cap. Derived from
    /// `idempotency_expiry`: kept with it, rebuilt after a snapshot is decoded.
    #[serde(skip)]
    pub(crate) idempotency_by_identity: BTreeMap<String, BTreeSet<(u64, String)>>,
}

impl Default for State {
    fn default() -> Self {
        State {
            next_job_id: 1,
            jobs: BTreeMap::new(),
            pending: BTreeSet::new(),
            running: BTreeSet::new(),
            finished: VecDeque::new(),
            nodes: BTreeMap::new(),
            idempotency: BTreeMap::new(),
            idempotency_expiry: BTreeSet::new(),
            clock_ms: 0,
            policy: ClusterPolicy::default(),
            usage: BTreeMap::new(),
            running_use: BTreeMap::new(),
            active_jobs: BTreeMap::new(),
            dependents: BTreeMap::new(),
            format: crate::format::FORMAT_BASE,
            reservations: BTreeMap::new(),
            accounted_index: 0,
            history: 0,
            history_since: 0,
            history_pending: false,
            node_inventory: crate::inventory::NodeInventory::default(),
            dep_triggers: BTreeSet::new(),
            unfinished_bytes: BTreeMap::new(),
            finished_bytes: 0,
            licenses_used: BTreeMap::new(),
            licenses_held: BTreeMap::new(),
            deadline_jobs: BTreeSet::new(),
            active_by_user: BTreeMap::new(),
            reserved_nodes: BTreeMap::new(),
            yielded: BTreeSet::new(),
            idempotency_by_identity: BTreeMap::new(),
        }
    }
}

impl State {
    /// `user`'s unfinished (pending and running) jobs, by id.
    pub fn active_jobs_of(&self, user: &str) -> Option<&BTreeSet<JobId>> {
        self.active_by_user.get(user)
    }
}

/// Whether a node has a feature (see `crate::fit`).
pub use crate::fit::node_has_feature;

/// What applying a plan's gangs did: the jobs started, those refused (with
/// why), and their events.
struct Gangs {
    started: Vec<JobId>,
    rejected: Vec<(JobId, String)>,
    events: Vec<JobEvent>,
}

impl State {
    /// Applies one command at Raft log `index`.
    pub fn apply(&mut self, index: u64, cmd: &Command) -> Applied {
        self.clock_ms = self.clock_ms.max(cmd.now_ms());
        self.purge_idempotency();
        let mut applied = self.apply_one(index, cmd);
        // Victims suspended for a preemptor take their CPUs and GPUs back as
        // soon as whatever this command did freed them.
        if !self.yielded.is_empty() {
            applied.events.extend(self.resume_yielded(index));
        }
        applied.events.extend(self.settle_dependents(index));
        applied
    }

    fn apply_one(&mut self, index: u64, cmd: &Command) -> Applied {
        match cmd {
            Command::SubmitJob { spec, identity, idempotency_key, .. } => {
                self.apply_submit_job(index, spec, identity, idempotency_key)
            }
            Command::CancelJob { job_id, identity, .. } => self.apply_cancel_job(index, *job_id, identity),
            Command::RegisterNode { spec, .. } => self.apply_register_node(index, spec),
            Command::SetNodeState { name, change, reason, .. } => {
                self.apply_set_node_state(index, name, *change, reason)
            }
            Command::ApplyPlan { placements, .. } => self.apply_plan(index, placements),
            Command::JobFinished { job_id, attempt, state, exit_code, reason, .. } => {
                self.apply_job_finished(index, *job_id, *attempt, *state, *exit_code, reason)
            }
            Command::Batch(cmds) => self.apply_batch(index, cmds),
            Command::SetGpuHealth { node, gpu, healthy, reason, .. } => {
                self.apply_set_gpu_health(index, node, *gpu, *healthy, reason)
            }
            Command::TaskExited {
                job_id, attempt, node, exit_code, signal, reason, lost, peak_mem_mb, usage, ..
            } => {
                let exit = TaskExit {
                    exit_code: *exit_code,
                    signal: *signal,
                    end_ms: self.clock_ms,
                    peak_mem_mb: *peak_mem_mb,
                };
                self.apply_task_exited(index, *job_id, *attempt, node, exit, *usage, reason, *lost)
            }
            Command::RestoreUsage { usage, identity, .. } => self.apply_restore_usage(usage, identity),
            Command::AccountingStored { index: stored, identity, .. } => {
                self.apply_accounting_stored(index, *stored, identity)
            }
            Command::DrawHistory { history, .. } => self.apply_draw_history(*history),
            Command::SetNodeInventory { inventory, expected_version, identity, .. } => {
                self.apply_set_node_inventory(index, inventory, *expected_version, identity)
            }
            Command::UpdatePolicy { policy, expected_version, force, identity, .. } => {
                self.apply_update_policy(index, policy, *expected_version, *force, identity)
            }
            Command::UpdateJob { job_id, change, identity, .. } => {
                self.apply_update_job(index, *job_id, change, identity)
            }
            Command::ApplySchedule { preemptions, placements, .. } => {
                self.apply_schedule(index, preemptions, placements)
            }
            Command::JobCheckpointed { job_id, attempt, .. } => self.apply_job_checkpointed(*job_id, *attempt),
            Command::SetDataFormat { format, .. } => self.apply_set_data_format(*format),
            Command::ChangeReservation { change, identity, .. } => self.apply_change_reservation(change, identity),
            Command::StepStarted { job_id, attempt, name, nodes, tasks, .. } => {
                self.apply_step_started(index, *job_id, *attempt, name, nodes, *tasks)
            }
            Command::StepEnded { job_id, attempt, step_id, exit_code, signal, .. } => {
                self.apply_step_ended(index, *job_id, *attempt, *step_id, *exit_code, *signal)
            }
        }
    }

    fn apply_set_data_format(&mut self, format: u32) -> Applied {
        if format <= self.format {
            return Applied::refused(
                RefusalKind::Stale,
                format!("format: the cluster is at data format {} already", self.format),
            );
        }
        // (Whether this build reads `format` is not asked here: the entry was
        // written in that format, so a build that decoded it reads it; an
        // answer that depended on the build would diverge.)
        let before = std::mem::replace(&mut self.format, format);
        if before < crate::format::STOP_CAUSE_FORMAT && format >= crate::format::STOP_CAUSE_FORMAT {
            self.type_stop_causes();
        }
        Applied { outcome: Outcome::DataFormatSet { format }, events: Vec::new() }
    }

    fn apply_set_gpu_health(&mut self, index: u64, node: &str, gpu: u32, healthy: bool, reason: &str) -> Applied {
        let Some(n) = self.nodes.get_mut(node) else {
            return Applied::refused(RefusalKind::NotFound, format!("node {node} does not exist"));
        };
        let Some(g) = n.gpus.get_mut(gpu as usize) else {
            return Applied::refused(RefusalKind::NotFound, format!("gpu: node {node} has no GPU {gpu}"));
        };
        g.health = if healthy { GpuHealth::Healthy } else { GpuHealth::Quarantined };
        g.health_reason = if healthy { String::new() } else { reason.to_string() };
        let holder = if healthy { None } else { g.allocated_to };
        let mut holders: Vec<JobId> = holder.into_iter().collect();
        if !healthy {
            holders.extend(self.yielded_on_gpu(node, gpu));
        }
        let mut events = Vec::new();
        for job_id in holders {
            let why = format!("GPU {gpu} on {node} failed: {reason}");
            self.note_stop(job_id, StopCause::GpuFailed { node: node.to_string(), gpu });
            events.extend(self.requeue_or_end(index, job_id, node, JobState::Failed, why));
        }
        Applied { outcome: Outcome::GpuHealthSet { node: node.to_string(), gpu, healthy }, events }
    }

    #[allow(clippy::too_many_arguments)]
    fn apply_task_exited(
        &mut self,
        index: u64,
        job_id: JobId,
        attempt: u32,
        node: &str,
        exit: TaskExit,
        usage: Option<TaskUsage>,
        reason: &str,
        lost: bool,
    ) -> Applied {
        // Impossible figures (refused where the report came in) are not kept.
        let usage = usage.filter(|u| self.format >= ACCOUNTING_FORMAT && u.check().is_ok());
        let (exit_code, signal) = (exit.exit_code, exit.signal);
        // Checked at the API edge; from format 5 also here, so a report no
        // wait status could hold never enters the state.
        if self.format >= 5 {
            if let Err(e) = crate::limits::check_task_exit(exit_code, signal, reason) {
                return Applied::refused(RefusalKind::InvalidArgument, e.to_string());
            }
        }
        let Some(job) = self.jobs.get_mut(&job_id) else {
            return Applied::refused(RefusalKind::NotFound, format!("job {job_id} does not exist"));
        };
        // The task of a job that already ended (cancelled, out of time, its
        // batch host done): what it used is still kept, once per node of
        // its last attempt, and said with a `usage` event.
        let late = job.state.is_finished() && job.attempt == attempt && job.ran_on.iter().any(|n| n == node);
        if let Some(u) = usage.filter(|_| late && !job.task_usage.contains_key(node)) {
            job.task_usage.insert(node.to_string(), u);
            let state = job.state;
            let event = JobEvent {
                index,
                job_id,
                state,
                attempt,
                reason: String::new(),
                suspended: None,
                step: None,
                usage: true,
            };
            return Applied { outcome: Outcome::TaskRecorded { job_id }, events: vec![event] };
        }
        let on_node = job.allocation.as_ref().is_some_and(|a| a.nodes.iter().any(|n| n.node == node));
        if job.state != JobState::Running || job.attempt != attempt || !on_node {
            return Applied::refused(
                RefusalKind::Stale,
                format!("job {job_id} attempt {attempt} is not running on {node}"),
            );
        }
        if job.task_exits.contains_key(node) {
            return Applied::refused(RefusalKind::Stale, format!("job {job_id} task on {node} already reported"));
        }
        if lost {
            let outcome = Outcome::TaskRecorded { job_id };
            let why = format!("task on {node} was lost ({reason})");
            self.note_stop(job_id, StopCause::NodeFailed { node: node.to_string() });
            let events = self.requeue_or_end(index, job_id, node, JobState::NodeFail, why).into_iter().collect();
            return Applied { outcome, events };
        }
        let ok = exit.succeeded();
        job.task_exits.insert(node.to_string(), exit);
        if let Some(u) = usage {
            job.task_usage.insert(node.to_string(), u);
        }
        let nodes = job.allocation.as_ref().map_or(job.spec.total_nodes() as usize, |a| a.nodes.len());
        // Batch jobs end with their script, which runs on the first node; the
        // other nodes only hold the allocation for steps (a step host that ends
        // on its own took the allocation there with it: the job fails).
        let batch_host = job.allocation.as_ref().and_then(|a| a.nodes.first()).is_some_and(|n| n.node == node);
        let done = if job.spec.batch { batch_host } else { job.task_exits.len() == nodes };
        let outcome = Outcome::TaskRecorded { job_id };
        if !ok {
            let what = if job.spec.batch && !batch_host { "step host" } else { "task" };
            let why = if !reason.is_empty() {
                format!("{what} on {node}: {reason}")
            } else if let Some(sig) = signal {
                format!("{what} on {node} was killed by signal {sig}")
            } else {
                format!("{what} on {node} exited with code {}", exit_code.unwrap_or(-1))
            };
            let code = exit_code.or(signal.map(|s| 128_i32.saturating_add(s)));
            // Its own task ended it (a suspended victim's too): not a stop.
            job.stop_cause = None;
            let events = self.finish_job(index, job_id, JobState::Failed, code, why).into_iter().collect();
            return Applied { outcome, events };
        }
        if done {
            job.stop_cause = None;
            let events =
                self.finish_job(index, job_id, JobState::Completed, Some(0), String::new()).into_iter().collect();
            return Applied { outcome, events };
        }
        Applied { outcome, events: Vec::new() }
    }

    fn apply_batch(&mut self, index: u64, cmds: &[Command]) -> Applied {
        if cmds.len() > crate::command::BATCH_COMMANDS_MAX {
            return Applied::refused(
                RefusalKind::InvalidArgument,
                format!("batch: at most {} commands", crate::command::BATCH_COMMANDS_MAX),
            );
        }
        if cmds.iter().any(|c| matches!(c, Command::Batch(_))) {
            return Applied::refused(RefusalKind::InvalidArgument, "batch: batches do not nest");
        }
        let mut results = Vec::with_capacity(cmds.len());
        let mut events = Vec::new();
        for cmd in cmds {
            let applied = self.apply(index, cmd);
            events.extend(applied.events.iter().cloned());
            results.push(applied);
        }
        Applied { outcome: Outcome::Batch(results), events }
    }

    /// Forgets expired idempotency keys, and (from format 14) those past
    /// the total cap, oldest first: at most IDEMPOTENCY_PURGE_PER_APPLY_MAX
    /// per apply, so a state that grew past the cap before format 14 comes
    /// down over the following applies.
    fn purge_idempotency(&mut self) {
        let capped = self.format >= IDEMPOTENCY_CAPS_FORMAT;
        for _ in 0..IDEMPOTENCY_PURGE_PER_APPLY_MAX {
            let Some(first) = self.idempotency_expiry.first() else { break };
            let over = capped && self.idempotency_expiry.len() > IDEMPOTENCY_KEYS_MAX;
            if first.0 > self.clock_ms && !over {
                break;
            }
            let first = first.clone();
            self.forget_idempotency_key(&first);
        }
    }

    /// Remembers `identity`'s `key` for `job_id` until IDEMPOTENCY_TTL_MS
    /// from now. From format 14 it first makes room under the caps: the
    /// identity's oldest key at IDEMPOTENCY_KEYS_PER_IDENTITY_MAX, then the
    /// oldest of all at IDEMPOTENCY_KEYS_MAX (each at most
    /// IDEMPOTENCY_PURGE_PER_APPLY_MAX at a time).
    pub(crate) fn remember_idempotency_key(&mut self, identity: &str, key: &str, job_id: JobId) {
        if self.format >= IDEMPOTENCY_CAPS_FORMAT {
            for _ in 0..IDEMPOTENCY_PURGE_PER_APPLY_MAX {
                let oldest = match self.idempotency_by_identity.get(identity) {
                    Some(mine) if mine.len() >= IDEMPOTENCY_KEYS_PER_IDENTITY_MAX => mine.first().cloned(),
                    _ => None,
                };
                let Some((expires, oldest)) = oldest else { break };
                self.forget_idempotency_key(&(expires, identity.to_string(), oldest));
            }
            for _ in 0..IDEMPOTENCY_PURGE_PER_APPLY_MAX {
                if self.idempotency_expiry.len() < IDEMPOTENCY_KEYS_MAX {
                    break;
                }
                let Some(first) = self.idempotency_expiry.first().cloned() else { break };
                self.forget_idempotency_key(&first);
            }
        }
        let expires = self.clock_ms.saturating_add(IDEMPOTENCY_TTL_MS);
        let (identity, key) = (identity.to_string(), key.to_string());
        self.idempotency.insert((identity.clone(), key.clone()), job_id);
        self.idempotency_expiry.insert((expires, identity.clone(), key.clone()));
        self.idempotency_by_identity.entry(identity).or_default().insert((expires, key));
    }

    /// Forgets one remembered key, `(expiry, identity, key)`, from all three indexes.
    fn forget_idempotency_key(&mut self, entry: &(u64, String, String)) {
        let (expires, identity, key) = entry;
        self.idempotency_expiry.remove(entry);
        self.idempotency.remove(&(identity.clone(), key.clone()));
        if let Some(mine) = self.idempotency_by_identity.get_mut(identity) {
            mine.remove(&(*expires, key.clone()));
            if mine.is_empty() {
                self.idempotency_by_identity.remove(identity);
            }
        }
    }

    /// The unfinished job `identity` may `verb` (its owner or an admin), or the refusal.
    fn changeable_job(&self, job_id: JobId, identity: &str, verb: &str) -> Result<&Job, Applied> {
        let Some(job) = self.jobs.get(&job_id) else {
            return Err(Applied::refused(RefusalKind::NotFound, format!("job {job_id} does not exist")));
        };
        if job.state.is_finished() {
            return Err(Applied::refused(
                RefusalKind::FailedPrecondition,
                format!("job {job_id} already finished ({})", job.state.as_str()),
            ));
        }
        if !self.may_change(job, identity) {
            return Err(Applied::refused(
                RefusalKind::PermissionDenied,
                format!(
                    "permission: job {job_id} belongs to {}; only its owner, its account's coordinators, operators and admins may {verb} it",
                    job.spec.user
                ),
            ));
        }
        Ok(job)
    }

    fn apply_cancel_job(&mut self, index: u64, job_id: JobId, identity: &str) -> Applied {
        if let Err(refused) = self.changeable_job(job_id, identity, "cancel") {
            return refused;
        }
        let reason = format!("cancelled by {identity}");
        self.note_stop(job_id, StopCause::CancelledBy { identity: identity.to_string() });
        let events = self.finish_job(index, job_id, JobState::Cancelled, None, reason).into_iter().collect();
        Applied { outcome: Outcome::Cancelled { job_id }, events }
    }

    /// A job that lost a node or a GPU: requeued (on other nodes when it asked
    /// to be expedited) if it may run again, else ended as `state`.
    fn requeue_or_end(
        &mut self,
        index: u64,
        job_id: JobId,
        failed: &str,
        state: JobState,
        why: String,
    ) -> Option<JobEvent> {
        let job = self.jobs.get(&job_id)?;
        if job.spec.requeue && job.attempt < ATTEMPTS_MAX {
            let event = self.requeue_job(index, job_id, format!("requeued: {why}"))?;
            self.expedite(job_id, failed);
            Some(event)
        } else {
            self.finish_job(index, job_id, state, None, why)
        }
    }

    /// Moves a pending or running job to a finished state, releasing its
    /// allocation. None, changing nothing, for a job that does not exist or
    /// has finished already, or for a state that is not a finished one (the
    /// callers never ask for these: apply must not panic if one did).
    fn finish_job(
        &mut self,
        index: u64,
        job_id: JobId,
        state: JobState,
        exit_code: Option<i32>,
        reason: String,
    ) -> Option<JobEvent> {
        let now = self.clock_ms;
        let job = self.jobs.get_mut(&job_id).filter(|j| state.is_finished() && !j.state.is_finished())?;
        let allocation = job.allocation.take();
        // A suspended job that ends (cancelled, its node lost) keeps the
        // time it was suspended for accounting.
        job.suspended_ms = job.suspended_total_ms(now);
        job.suspended_at_ms = None;
        job.preempted_by = None;
        // Steps still running end with their job, as Slurm ends them.
        for step in job.steps.iter_mut().filter(|s| s.end_ms.is_none()) {
            step.end_ms = Some(now);
            step.state = JobState::Cancelled;
        }
        job.state = state;
        job.end_time_ms = Some(now);
        job.exit_code = exit_code;
        job.reason = reason.clone();
        let attempt = job.attempt;
        self.pending.remove(&job_id);
        self.running.remove(&job_id);
        if let Some(alloc) = allocation {
            self.release(job_id, &alloc);
        }
        self.count_active(job_id, false);
        self.forget_dependencies(job_id);
        self.dep_triggers.insert(job_id);
        self.finished.push_back(job_id);
        if let Some(job) = self.jobs.get_mut(&job_id) {
            self.finished_bytes = self.finished_bytes.saturating_add(job.retained_bytes() as u64);
            if self.format >= ACCOUNTING_FORMAT {
                job.finished_index = Some(index);
            }
        }
        self.purge_finished();
        Some(JobEvent { index, job_id, state, attempt, reason, suspended: None, step: None, usage: false })
    }

    /// Drops the oldest finished jobs past the limits. The first job of an
    /// array with unfinished elements is kept (it files whole-array
    /// dependencies); each purge looks at each kept job once. From format
    /// 13, a job the accounting store does not have yet (finished after
    /// `accounted_index`) is kept past `finished_jobs_kept`, though not past
    /// the hard limits, once an accounting service has said where it is;
    /// from format 15, past the hard limits too (new jobs are refused
    /// instead: [`State::accounting_backlog_full`]).
    pub(crate) fn purge_finished(&mut self) {
        let mut looks = self.finished.len();
        let hard_over = |s: &State| s.finished_past_hard_limits(0);
        let over = |s: &State| s.finished.len() > s.policy.finished_jobs_limit() || hard_over(s);
        let never_unaccounted = self.format >= crate::format::ACCOUNTING_BACKLOG_FORMAT;
        while over(self) && looks > 0 {
            looks = looks.saturating_sub(1);
            let Some(&old) = self.finished.front() else { break };
            if self.unaccounted(old) && (never_unaccounted || !hard_over(self)) {
                break;
            }
            self.finished.pop_front();
            if self.array_unfinished(old) {
                self.finished.push_back(old);
                continue;
            }
            if let Some(gone) = self.jobs.remove(&old) {
                self.finished_bytes = self.finished_bytes.saturating_sub(gone.retained_bytes() as u64);
            }
            self.dependents.remove(&old);
        }
    }

    /// Whether the finished jobs kept are past the hard limits (more than
    /// `FINISHED_JOBS_RETAINED_MAX` of them, or of their bytes), or would be
    /// with `more` of each.
    fn finished_past_hard_limits(&self, more: u64) -> bool {
        let jobs = u64::try_from(self.finished.len()).unwrap_or(u64::MAX).saturating_add(more);
        jobs > FINISHED_JOBS_RETAINED_MAX as u64
            || (self.format >= 5
                && self.finished_bytes.saturating_add(more) > crate::limits::FINISHED_BYTES_RETAINED_MAX)
    }

    /// Whether finished job `id` is one the accounting store does not have
    /// yet (an accounting service has said where it is, and `id` finished
    /// after that).
    fn unaccounted(&self, id: JobId) -> bool {
        self.accounted_index > 0
            && self.jobs.get(&id).and_then(|j| j.finished_index).is_some_and(|i| i > self.accounted_index)
    }

    /// From format 15: why new jobs are refused, when the finished jobs the
    /// accounting store does not have yet fill the hard limits (they are
    /// never dropped, so the state would grow without bound). None while
    /// there is room. (The finished jobs are kept oldest first: when the
    /// oldest is not stored, no purge can make room.)
    pub fn accounting_backlog_full(&self) -> Option<String> {
        if self.format < crate::format::ACCOUNTING_BACKLOG_FORMAT || !self.finished_past_hard_limits(1) {
            return None;
        }
        let oldest = *self.finished.front()?;
        if !self.unaccounted(oldest) {
            return None;
        }
        Some(format!(
            "accounting: the finished jobs the accounting store has not stored yet fill what the state keeps for it \
             ({FINISHED_JOBS_RETAINED_MAX} jobs or {} bytes of their specs; it has stored every job through log \
             index {}): new jobs are refused until `gangway accounting` stores them \
             (gangway_unaccounted_finished_jobs); an admin may let their records go with `gangway accounting \
             release-unstored`",
            crate::limits::FINISHED_BYTES_RETAINED_MAX,
            self.accounted_index
        ))
    }

    /// Puts a running job back in the queue, releasing its allocation; its next
    /// placement is a new attempt.
    /// After a requeue because `failed` failed: a `--requeue=expedite` job
    /// goes first, back onto its last attempt's other nodes (from format 9).
    fn expedite(&mut self, job_id: JobId, failed: &str) {
        if self.format < crate::format::SLURM_FEATURES_FORMAT {
            return;
        }
        if let Some(job) = self.jobs.get_mut(&job_id).filter(|j| j.spec.requeue_expedite) {
            job.expedite_nodes = Some(job.ran_on.iter().filter(|n| *n != failed).cloned().collect());
        }
    }

    /// Puts a running job back in the queue for its next attempt. None,
    /// changing nothing, for a job that is not running with an allocation.
    fn requeue_job(&mut self, index: u64, job_id: JobId, reason: String) -> Option<JobEvent> {
        let job = self.jobs.get_mut(&job_id).filter(|j| j.state == JobState::Running && j.allocation.is_some())?;
        let allocation = job.allocation.take()?;
        job.state = JobState::Pending;
        job.task_exits.clear();
        job.task_usage.clear();
        job.reason = reason.clone();
        job.expedite_nodes = None;
        job.steps.clear();
        job.next_step_id = 0;
        job.signal = None;
        // The next attempt asks for its whole limit again.
        if job.requested_limit_s > 0 {
            job.spec.time_limit_s = std::mem::take(&mut job.requested_limit_s);
        }
        let attempt = job.attempt;
        self.running.remove(&job_id);
        self.pending.insert(job_id);
        // Release first: usage is charged from the start time, less the
        // time the attempt was suspended.
        self.release(job_id, &allocation);
        if let Some(job) = self.jobs.get_mut(&job_id) {
            job.start_time_ms = None;
            job.suspended_at_ms = None;
            job.suspended_ms = 0;
            job.preempted_by = None;
        }
        Some(JobEvent {
            index,
            job_id,
            state: JobState::Pending,
            attempt,
            reason,
            suspended: None,
            step: None,
            usage: false,
        })
    }

    /// Gives back what an ending attempt holds: all of its allocation, or
    /// only its memory when it had yielded its CPUs and GPUs.
    fn release(&mut self, job_id: JobId, alloc: &Allocation) {
        self.charge_usage(job_id, alloc);
        self.count_running(job_id, alloc, false);
        let yielded = self.yielded.remove(&job_id);
        // The counters cannot go below zero on a consistent state
        // (`check_invariants` recounts them; the fuzzer and the simulation
        // check it after every command): saturating keeps apply total.
        for na in &alloc.nodes {
            let Some(node) = self.nodes.get_mut(&na.node) else { continue };
            node.mem_alloc_mb = node.mem_alloc_mb.saturating_sub(na.mem_mb);
            node.jobs.retain(|&j| j != job_id);
            if yielded {
                continue;
            }
            node.cpus_alloc = node.cpus_alloc.saturating_sub(na.cpus);
            for &g in &na.gpus {
                let Some(gpu) = node.gpus.get_mut(g as usize) else { continue };
                if gpu.allocated_to == Some(job_id) {
                    gpu.allocated_to = None;
                }
            }
        }
    }

    /// Whether the node inventory admits `spec` (from format 17; before
    /// it, every registration is admitted). The API edge asks this before
    /// proposing, so a refused agent's retries cost no log entries.
    pub fn admits(&self, spec: &NodeSpec) -> Result<(), SpecError> {
        if self.format < crate::format::NODE_ADMISSION_FORMAT {
            return Ok(());
        }
        self.node_inventory.admit(&crate::inventory::Claim::of_spec(spec)).map(drop)
    }

    fn apply_register_node(&mut self, index: u64, spec: &NodeSpec) -> Applied {
        if let Err(e) = spec.validate() {
            return Applied::refused(RefusalKind::InvalidArgument, e.to_string());
        }
        if let Err(e) = self.admits(spec) {
            return Applied::refused(RefusalKind::PermissionDenied, format!("permission: not admitted: {e}"));
        }
        if let Some(applied) = self.pool_node_registered(index, spec) {
            return applied;
        }
        let now = self.clock_ms;
        match self.nodes.get_mut(&spec.name) {
            Some(node) if !node.jobs.is_empty() => {
                // Work is placed on the old inventory: keep it, refresh the rest.
                node.addr = spec.addr.clone();
                node.topology = spec.topology.clone();
                node.labels = spec.labels.clone();
                if node.state == NodeState::Down {
                    node.state = NodeState::Up;
                    node.state_reason.clear();
                    node.state_changed_ms = now;
                }
            }
            Some(node) => {
                let mut fresh = Node::from_spec(spec, node.registered_ms);
                // A drain is an admin decision and survives re-registration.
                if node.state == NodeState::Drain {
                    fresh.state = NodeState::Drain;
                    fresh.state_reason = node.state_reason.clone();
                    fresh.state_changed_ms = node.state_changed_ms;
                } else if node.state == NodeState::Down {
                    fresh.state_changed_ms = now;
                } else {
                    fresh.state_changed_ms = node.state_changed_ms;
                }
                // Keep quarantines of GPUs that are still present.
                for g in &mut fresh.gpus {
                    if let Some(old) = node.gpus.iter().find(|o| o.uuid == g.uuid) {
                        g.health = old.health;
                        g.health_reason = old.health_reason.clone();
                    }
                }
                *node = fresh;
            }
            None => {
                if self.nodes.len() >= NODES_MAX {
                    return Applied::refused(
                        RefusalKind::ResourceExhausted,
                        format!("the cluster has {NODES_MAX} nodes, its limit"),
                    );
                }
                self.nodes.insert(spec.name.clone(), Node::from_spec(spec, now));
            }
        }
        Applied { outcome: Outcome::NodeRegistered { name: spec.name.clone() }, events: Vec::new() }
    }

    fn apply_set_node_state(&mut self, index: u64, name: &str, change: NodeStateChange, reason: &str) -> Applied {
        let now = self.clock_ms;
        if !self.nodes.contains_key(name) {
            return Applied::refused(RefusalKind::NotFound, format!("node {name} does not exist"));
        }
        let wanted = match change {
            NodeStateChange::Drain => NodeState::Drain,
            NodeStateChange::Resume => NodeState::Up,
            NodeStateChange::Down => NodeState::Down,
            NodeStateChange::PowerDown | NodeStateChange::PowerUp => return self.power_change(name, change, reason),
        };
        let Some(node) = self.nodes.get_mut(name) else {
            return Applied::refused(RefusalKind::NotFound, format!("node {name} does not exist"));
        };
        let new_state = match (wanted, node.state) {
            (NodeState::Drain | NodeState::Up, NodeState::PoweredDown | NodeState::PoweringUp) => {
                return Applied::refused(
                    RefusalKind::FailedPrecondition,
                    format!("node {name} is {}: it is up once its agent registers", node.state.as_str()),
                )
            }
            (NodeState::Drain, NodeState::Down) => {
                return Applied::refused(
                    RefusalKind::FailedPrecondition,
                    format!("node {name} is down; drain it once its agent has registered again"),
                )
            }
            (NodeState::Up, NodeState::Down) => {
                return Applied::refused(
                    RefusalKind::FailedPrecondition,
                    format!("node {name} is down; it comes back when its agent registers again"),
                )
            }
            (wanted, _) => wanted,
        };
        node.state = new_state;
        node.state_reason = reason.to_string();
        node.state_changed_ms = now;
        let events = if new_state == NodeState::Down {
            self.end_jobs_on(index, name, &format!("node {name} went down"))
        } else {
            Vec::new()
        };
        Applied { outcome: Outcome::NodeStateSet { name: name.to_string(), state: new_state }, events }
    }

    /// Requeues (or fails with NODE_FAIL) every job on node `name`, lost
    /// because `why`.
    fn end_jobs_on(&mut self, index: u64, name: &str, why: &str) -> Vec<JobEvent> {
        let mut events = Vec::new();
        let victims = self.nodes.get(name).map(|n| n.jobs.clone()).unwrap_or_default();
        for job_id in victims {
            self.note_stop(job_id, StopCause::NodeFailed { node: name.to_string() });
            events.extend(self.requeue_or_end(index, job_id, name, JobState::NodeFail, why.to_string()));
        }
        events
    }

    /// The number of topology path elements that identify a domain of `level`
    /// (None: no such level, or no level named).
    pub fn topology_depth(&self, level: &str) -> Option<usize> {
        if level.is_empty() {
            return None;
        }
        self.policy.topology_levels.iter().position(|l| l == level).map(|i| i.saturating_add(1))
    }

    fn apply_job_finished(
        &mut self,
        index: u64,
        job_id: JobId,
        attempt: u32,
        state: JobState,
        exit_code: Option<i32>,
        reason: &str,
    ) -> Applied {
        if !state.is_finished() {
            return Applied::refused(
                RefusalKind::InvalidArgument,
                format!("state: {} is not a finished state", state.as_str()),
            );
        }
        let Some(job) = self.jobs.get(&job_id) else {
            return Applied::refused(RefusalKind::NotFound, format!("job {job_id} does not exist"));
        };
        if state == JobState::Deadline && self.format < crate::format::SLURM_FEATURES_FORMAT {
            return Applied::refused(RefusalKind::InvalidArgument, "state: DEADLINE needs data format 9");
        }
        // A pending job ends DEADLINE once it can no longer end by its deadline.
        if state == JobState::Deadline {
            if job.state != JobState::Pending || job.attempt != attempt || !job.deadline_missed(self.clock_ms) {
                return Applied::refused(
                    RefusalKind::Stale,
                    format!("job {job_id} is not a pending job past its deadline"),
                );
            }
            let events = self.finish_job(index, job_id, state, exit_code, reason.to_string()).into_iter().collect();
            return Applied { outcome: Outcome::JobFinished { job_id }, events };
        }
        if job.state != JobState::Running || job.attempt != attempt {
            return Applied::refused(
                RefusalKind::Stale,
                format!(
                    "job {job_id} attempt {attempt} is not running (job is {} at attempt {})",
                    job.state.as_str(),
                    job.attempt
                ),
            );
        }
        if state == JobState::TimedOut {
            self.note_stop(job_id, StopCause::TimeLimit);
        }
        let events = self.finish_job(index, job_id, state, exit_code, reason.to_string()).into_iter().collect();
        Applied { outcome: Outcome::JobFinished { job_id }, events }
    }

    /// The move to format 18: a job preempted before it (requeued,
    /// suspended, or cancelled, whose tasks may still be stopping) gets the
    /// typed cause its reason's words held, so the leader still gives its
    /// tasks their grace. Bounded by the jobs the state holds.
    fn type_stop_causes(&mut self) {
        for id in self.pending.iter().chain(&self.running).chain(&self.finished) {
            let Some(job) = self.jobs.get_mut(id) else { continue };
            if let Some(by) = StopCause::legacy_preemptor(&job.reason) {
                job.stop_cause = Some(StopCause::Preempted { by });
            }
        }
    }

    /// Records why `job_id`'s attempt stops, from format 18 (before, a
    /// snapshot could not hold it, so a replica that installed one would
    /// differ from one that applied the entries).
    pub(super) fn note_stop(&mut self, job_id: JobId, cause: StopCause) {
        if self.format < crate::format::STOP_CAUSE_FORMAT {
            return;
        }
        if let Some(job) = self.jobs.get_mut(&job_id) {
            job.stop_cause = Some(cause);
        }
    }

    /// Counts a running job's seats in (or out of) the accounts and QOS with
    /// a limit on them.
    pub(super) fn count_held_licenses(&mut self, job_id: JobId, add: bool) {
        let Some(job) = self.jobs.get(&job_id) else { return };
        if job.spec.licenses.is_empty() {
            return;
        }
        let held: Vec<((crate::policy::LicenseScope, String), u64)> = self
            .policy
            .license_limits(&job.spec.account, &job.spec.qos)
            .into_iter()
            .filter_map(|(scope, name, _)| {
                job.spec.licenses.get(name).map(|&n| ((scope, name.to_string()), u64::from(n)))
            })
            .collect();
        for (key, n) in held {
            usage::count_seats(&mut self.licenses_held, key, n, add);
        }
    }

    /// The first account or QOS license limit `job` would pass if it started
    /// now, with `victims` stopped first and `planned(scope, license)` seats
    /// already promised to others: why, in words.
    pub fn license_limit_exceeded(
        &self,
        job: &Job,
        victims: &[&Job],
        planned: impl Fn(&crate::policy::LicenseScope, &str) -> u64,
    ) -> Option<String> {
        for (scope, name, max) in self.policy.license_limits(&job.spec.account, &job.spec.qos) {
            let Some(&want) = job.spec.licenses.get(name) else { continue };
            let key = (scope, name.to_string());
            let released: u64 = victims
                .iter()
                .filter(|v| {
                    self.policy
                        .license_limits(&v.spec.account, &v.spec.qos)
                        .iter()
                        .any(|(s, n, _)| *s == key.0 && *n == name)
                })
                .filter_map(|v| v.spec.licenses.get(name))
                .map(|&n| u64::from(n))
                .sum();
            let held = self.licenses_held.get(&key).copied().unwrap_or(0).saturating_sub(released);
            let used = held.saturating_add(planned(&key.0, name));
            if used.saturating_add(u64::from(want)) > u64::from(max) {
                return Some(format!(
                    "license {name}: {} may hold {max} seats at once; {used} are held and the job asks for {want}",
                    key.0.describe()
                ));
            }
        }
        None
    }
}
