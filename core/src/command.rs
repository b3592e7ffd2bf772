//! The Raft log payload: every change to the replicated state is one [`Command`].
//!
//! **Append-only**: commands are encoded by variant position, and old log entries
//! and snapshots must decode forever. Add new variants at the end; never reorder,
//! remove or change the fields of an existing one (add a new variant instead).
//! Every command carries `now_ms`, stamped by the leader: the state machine never
//! reads a clock.

use serde::{Deserialize, Serialize};

use std::collections::BTreeMap;

use crate::model::UsageBucket;
use crate::model::{JobId, JobState, NodeAllocation, TaskUsage};
use crate::policy::{ClusterPolicy, PreemptMode};
use crate::reservation::ReservationChange;
use crate::spec::{JobSpec, NodeSpec};

/// One gang placement in a plan: the whole allocation for the job's next attempt.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Placement {
    pub job_id: JobId,
    /// Must be the job's current attempt + 1; an older plan is stale and refused.
    pub attempt: u32,
    pub nodes: Vec<NodeAllocation>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum NodeStateChange {
    /// Stop placing new work; running work finishes.
    Drain,
    /// Undo a drain (or bring a Down node back after the agent re-registered).
    Resume,
    /// The agent is gone: its running jobs fail with NODE_FAIL.
    Down,
    /// Power an idle node of an elastic pool down (the leader runs the
    /// suspend program). Since format 12.
    PowerDown,
    /// Power a powered-down node of a pool up ahead of work (the leader runs
    /// the resume program). Since format 12.
    PowerUp,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Command {
    SubmitJob {
        spec: JobSpec,
        /// Caller identity from the request metadata.
        identity: String,
        /// Client-chosen key; a retried submit with the same (identity, key) returns
        /// the first job instead of creating another. Empty: no deduplication.
        idempotency_key: String,
        now_ms: u64,
    },
    CancelJob {
        job_id: JobId,
        identity: String,
        now_ms: u64,
    },
    RegisterNode {
        spec: NodeSpec,
        now_ms: u64,
    },
    SetNodeState {
        name: String,
        change: NodeStateChange,
        reason: String,
        now_ms: u64,
    },
    /// A plan without preemptions, as builds before `ApplySchedule` wrote it.
    /// No build proposes it any more (the leader writes every plan as an
    /// `ApplySchedule`); it stays so logs that hold it replay, and applies as
    /// an `ApplySchedule` with no victims would.
    ApplyPlan {
        placements: Vec<Placement>,
        now_ms: u64,
    },
    JobFinished {
        job_id: JobId,
        attempt: u32,
        /// One of the finished states.
        state: JobState,
        exit_code: Option<i32>,
        reason: String,
        now_ms: u64,
    },
    /// Several commands proposed together as one log entry (one fsync, one
    /// replication round), applied in order. Never nested.
    Batch(#[serde(deserialize_with = "batch_items")] Vec<Command>),
    /// One node's task of a job attempt ended (reported by that node's agent).
    /// The job completes when every node's task succeeded and fails at the first
    /// task that did not.
    TaskExited {
        job_id: JobId,
        attempt: u32,
        node: String,
        exit_code: Option<i32>,
        signal: Option<i32>,
        /// Why, when the task did not run to its own exit (e.g. launch failed).
        reason: String,
        /// The node lost the task (cut off, agent restarted): requeue per policy.
        lost: bool,
        /// Peak memory of the task, where the node could measure it.
        peak_mem_mb: Option<u64>,
        /// What the task used, as its agent measured it. Since format 13.
        usage: Option<TaskUsage>,
        now_ms: u64,
    },
    /// One GPU's health changed: quarantined GPUs get no new work, and the job
    /// holding one is requeued (or failed) per its policy; the node's other GPUs
    /// stay schedulable.
    SetGpuHealth {
        node: String,
        gpu: u32,
        healthy: bool,
        reason: String,
        now_ms: u64,
    },
    /// Replaces the cluster policy whole, validated as a whole. With
    /// `expected_version`, refused unless the policy is still at that version
    /// (read-modify-write without lost updates). `force` allows quotas below
    /// current use.
    UpdatePolicy {
        policy: ClusterPolicy,
        expected_version: Option<u64>,
        force: bool,
        identity: String,
        now_ms: u64,
    },
    /// Changes one unfinished job (hold, release, priority, nice, requeue, time limit).
    UpdateJob {
        job_id: JobId,
        change: JobChange,
        identity: String,
        now_ms: u64,
    },
    /// A plan with preemptions: the victims stop (requeued or cancelled) and the
    /// placements that needed their space start, in one entry, so a failover
    /// mid-way neither loses the placement nor evicts twice.
    ApplySchedule {
        preemptions: Vec<Preemption>,
        placements: Vec<Placement>,
        now_ms: u64,
    },
    /// The running attempt of a job saved a checkpoint.
    JobCheckpointed {
        job_id: JobId,
        attempt: u32,
        now_ms: u64,
    },
    /// Moves the cluster to a newer data format (see `format`): proposed by the
    /// leader once every member's build reads it; entries and snapshots are
    /// written in it from then on. Since format 5.
    SetDataFormat {
        format: u32,
        now_ms: u64,
    },
    /// Creates, changes or deletes an advance reservation (admins and
    /// operators). Since format 9.
    ChangeReservation {
        change: ReservationChange,
        identity: String,
        now_ms: u64,
    },
    /// An srun step of a running job attempt started on `nodes` (empty:
    /// every node of the job), with `tasks` tasks; sent by srun, vouched for
    /// by the job's step credential. It gets the attempt's next step id.
    /// Since format 10.
    StepStarted {
        job_id: JobId,
        attempt: u32,
        name: String,
        nodes: Vec<String>,
        tasks: u32,
        now_ms: u64,
    },
    /// A step ended: its worst task's exit code, or the signal that ended
    /// one. Since format 10.
    StepEnded {
        job_id: JobId,
        attempt: u32,
        step_id: u32,
        exit_code: Option<i32>,
        signal: Option<i32>,
        now_ms: u64,
    },
    /// Replaces the historical usage behind fair share with `usage` (account
    /// → buckets, oldest first), rebuilt from the accounting store after a
    /// disaster restore (`gangway accounting rebuild-fairshare`). Admins only.
    /// Since format 13.
    RestoreUsage {
        usage: BTreeMap<String, Vec<UsageBucket>>,
        identity: String,
        now_ms: u64,
    },
    /// The accounting store holds every job through log index `index`
    /// (reported by `gangway accounting`, an operator): finished jobs up to
    /// it may go from the state. Since format 13.
    AccountingStored {
        index: u64,
        identity: String,
        now_ms: u64,
    },
    /// The history a cluster restored from a backup counts in from here on,
    /// drawn at random by its first leader (`State::history_pending`): two
    /// restores from the same file derive the same history, and only a
    /// number no replica could compute alone tells them apart. Since format 16.
    DrawHistory {
        history: u64,
        now_ms: u64,
    },
    /// Replaces the node inventory (which nodes may register and what they
    /// may claim; `crate::inventory`). Admins only; refused unless the
    /// inventory is still at `expected_version` when given. Nodes it no
    /// longer admits go down. Since format 17.
    SetNodeInventory {
        inventory: crate::inventory::NodeInventory,
        expected_version: Option<u64>,
        identity: String,
        now_ms: u64,
    },
}

/// One victim of a preemption.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Preemption {
    pub job_id: JobId,
    /// The victim's running attempt; a later attempt is not touched.
    pub attempt: u32,
    pub mode: PreemptMode,
    /// The job the space is for.
    pub for_job: JobId,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum JobChange {
    /// Keep the job from starting; `admin` holds can only be released by admins.
    Hold {
        admin: bool,
    },
    Release,
    /// Set (or with None, clear) an absolute priority that replaces the computed one.
    SetPriority(Option<u32>),
    SetNice(i32),
    /// Stop a running job and put it back in the queue (optionally held).
    Requeue {
        hold: bool,
    },
    SetTimeLimit(u64),
    /// Stop every task of a running job where it stands (SIGSTOP), keeping
    /// its allocation; its time limit's clock pauses (Slurm's `scontrol
    /// suspend`). Operators and admins. Since format 10.
    Suspend,
    /// Continue a suspended job's tasks (SIGCONT). Since format 10.
    Resume,
    /// Send a running job's tasks `signal` on every node (Slurm's `scancel
    /// --signal`): to every process but the batch shell and srun (`All`,
    /// steps only), the batch shell only (`Batch`), or all (`Full`). Its
    /// owner and admins. Since format 10.
    Signal {
        signal: i32,
        target: SignalTarget,
    },
}

pub use crate::model::SignalTarget;

/// Commands in one batch: enough to absorb a burst from thousands of clients in
/// one entry, small enough that applying one batch stays well under a millisecond.
pub const BATCH_COMMANDS_MAX: usize = 1024;
/// Approximate bytes in one batch: keeps one log entry (and one AppendEntries
/// message) a few MiB even when scripts are large.
pub const BATCH_BYTES_MAX: usize = 4 * 1024 * 1024;

impl Command {
    /// A cheap upper estimate of the command's encoded size, for batching.
    pub fn approx_bytes(&self) -> usize {
        const FIXED: usize = 256;
        match self {
            // Every field counted: a batch's estimate must bound its encoding.
            Command::SubmitJob { spec, .. } => FIXED.saturating_add(spec.size_bytes()),
            Command::RegisterNode { spec, .. } => FIXED
                .saturating_add(spec.gpus.len().saturating_mul(128))
                .saturating_add(spec.labels.len().saturating_mul(64)),
            Command::ApplyPlan { placements, .. } => FIXED.saturating_add(placements.len().saturating_mul(256)),
            Command::ApplySchedule { placements, preemptions, .. } => FIXED
                .saturating_add(placements.len().saturating_mul(256))
                .saturating_add(preemptions.len().saturating_mul(64)),
            Command::UpdatePolicy { policy, .. } => FIXED
                .saturating_add(policy.accounts.len().saturating_mul(128))
                .saturating_add(
                    policy.coordinators.values().map(Vec::len).fold(0, usize::saturating_add).saturating_mul(256),
                )
                .saturating_add(policy.user_map.len().saturating_mul(128))
                .saturating_add(policy.operators.len().saturating_mul(64))
                .saturating_add(policy.users.len().saturating_mul(128))
                .saturating_add(policy.partitions.len().saturating_mul(512))
                .saturating_add(policy.qos.len().saturating_mul(256))
                .saturating_add(policy.licenses.len().saturating_mul(64)),
            Command::Batch(cmds) => cmds.iter().map(Command::approx_bytes).fold(0, usize::saturating_add),
            Command::SetNodeInventory { inventory, .. } => FIXED
                .saturating_add(
                    inventory.retired.iter().map(|n| n.len().saturating_add(16)).fold(0, usize::saturating_add),
                )
                .saturating_add(
                    inventory
                        .classes
                        .values()
                        .map(|c| {
                            c.nodes
                                .iter()
                                .map(|n| n.len().saturating_add(16))
                                .fold(512, usize::saturating_add)
                                .saturating_add(c.labels.len().saturating_mul(2 * crate::limits::NAME_BYTES_MAX))
                        })
                        .fold(0, usize::saturating_add),
                ),
            Command::StepStarted { name, nodes, .. } => FIXED
                .saturating_add(name.len())
                .saturating_add(nodes.iter().map(|n| n.len().saturating_add(16)).fold(0, usize::saturating_add)),
            Command::ChangeReservation {
                change: ReservationChange::Create(r) | ReservationChange::Update(r), ..
            } => FIXED.saturating_add(r.name.len()).saturating_add(r.partition.len()).saturating_add(
                [&r.nodes, &r.users, &r.accounts]
                    .into_iter()
                    .flatten()
                    .map(|n| n.len().saturating_add(16))
                    .fold(0, usize::saturating_add),
            ),
            _ => FIXED,
        }
    }

    pub fn now_ms(&self) -> u64 {
        match self {
            Command::SubmitJob { now_ms, .. }
            | Command::CancelJob { now_ms, .. }
            | Command::RegisterNode { now_ms, .. }
            | Command::SetNodeState { now_ms, .. }
            | Command::ApplyPlan { now_ms, .. }
            | Command::JobFinished { now_ms, .. } => *now_ms,
            Command::Batch(cmds) => cmds.iter().map(Command::now_ms).max().unwrap_or(0),
            Command::TaskExited { now_ms, .. } => *now_ms,
            Command::SetGpuHealth { now_ms, .. }
            | Command::UpdatePolicy { now_ms, .. }
            | Command::UpdateJob { now_ms, .. }
            | Command::ApplySchedule { now_ms, .. }
            | Command::JobCheckpointed { now_ms, .. }
            | Command::SetDataFormat { now_ms, .. }
            | Command::ChangeReservation { now_ms, .. }
            | Command::StepStarted { now_ms, .. }
            | Command::StepEnded { now_ms, .. }
            | Command::RestoreUsage { now_ms, .. }
            | Command::AccountingStored { now_ms, .. }
            | Command::DrawHistory { now_ms, .. }
            | Command::SetNodeInventory { now_ms, .. } => *now_ms,
        }
    }

    pub fn name(&self) -> &'static str {
        match self {
            Command::SubmitJob { .. } => "submit_job",
            Command::CancelJob { .. } => "cancel_job",
            Command::RegisterNode { .. } => "register_node",
            Command::SetNodeState { .. } => "set_node_state",
            Command::ApplyPlan { .. } => "apply_plan",
            Command::JobFinished { .. } => "job_finished",
            Command::Batch(_) => "batch",
            Command::TaskExited { .. } => "task_exited",
            Command::SetGpuHealth { .. } => "set_gpu_health",
            Command::UpdatePolicy { .. } => "update_policy",
            Command::UpdateJob { .. } => "update_job",
            Command::ApplySchedule { .. } => "apply_schedule",
            Command::JobCheckpointed { .. } => "job_checkpointed",
            Command::SetDataFormat { .. } => "set_data_format",
            Command::ChangeReservation { .. } => "change_reservation",
            Command::StepStarted { .. } => "step_started",
            Command::StepEnded { .. } => "step_ended",
            Command::RestoreUsage { .. } => "restore_usage",
            Command::AccountingStored { .. } => "accounting_stored",
            Command::DrawHistory { .. } => "draw_history",
            Command::SetNodeInventory { .. } => "set_node_inventory",
        }
    }
}

/// Batches nested deeper than this do not decode. Real entries nest one level
/// (a batch of commands; `apply` refuses a batch inside a batch); without a
/// bound, a crafted entry of nested batches would overflow the stack of every
/// replica that decodes it (the fuzz target `entry_apply` found this).
pub const BATCH_DECODE_DEPTH_MAX: u32 = 8;

std::thread_local! {
    static BATCH_DEPTH: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Decodes a batch's commands, refusing nesting past BATCH_DECODE_DEPTH_MAX.
/// (Generic: frozen formats' batches hold their own command types.)
pub(crate) fn batch_items<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: serde::Deserializer<'de>,
    T: Deserialize<'de>,
{
    struct Level;
    impl Drop for Level {
        fn drop(&mut self) {
            BATCH_DEPTH.with(|n| n.set(n.get().saturating_sub(1)));
        }
    }
    let depth = BATCH_DEPTH.with(|n| {
        let depth = n.get().saturating_add(1);
        n.set(depth);
        depth
    });
    let _level = Level;
    if depth > BATCH_DECODE_DEPTH_MAX {
        return Err(serde::de::Error::custom(format!("batches nest deeper than {BATCH_DECODE_DEPTH_MAX}")));
    }
    Vec::<T>::deserialize(d)
}
