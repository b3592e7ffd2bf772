//! Data formats 9 and 10, frozen: the job spec, the job, the policy, the log entry and the
//! snapshot's state as formats 9 and 10 encoded them (format 10 appended
//! variants and the job's suspension and steps, which today's job still
//! has). Do not change anything here (the golden encodings test holds
//! these bytes); a new format gets a module of its own.
//!
//! Format 11 appended the heterogeneous job's components to the job spec
//! (`JobSpec::components`) and license limits per account and QOS to the
//! policy; an entry of format 9 or 10 is this module's `Wire`, whose submit
//! carries this module's spec and whose policy update this module's policy.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::{frozen_commands, frozen_jobs, frozen_state, frozen_struct, Frozen};
use crate::command::{JobChange, NodeStateChange, Placement, Preemption};
use crate::model::{Allocation, ArrayElement, HoldKind, JobId, JobSignal, JobState, Node, Step, TaskExit};
use crate::policy::{Account, Partition, PriorityWeights, Qos, Use, User};
use crate::reservation::{Reservation, ReservationChange};
use crate::spec::{Dependency, NodeSpec, TopologyConstraint};
use crate::state::{UsageBucket, UseKey};

/// A job spec of formats 9 and 10, field for field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSpec {
    pub name: String,
    pub user: String,
    pub command: Vec<String>,
    pub script: String,
    pub workdir: String,
    pub partition: String,
    pub nodes: u32,
    pub tasks_per_node: u32,
    pub cpus_per_task: u32,
    pub mem_per_node_mb: u64,
    pub gpus_per_node: u32,
    pub gpu_type: String,
    pub time_limit_s: u64,
    pub env: BTreeMap<String, String>,
    pub requeue: bool,
    pub output: String,
    pub error: String,
    pub warn_signal: u8,
    pub warn_before_s: u32,
    pub warn_batch_shell: bool,
    pub account: String,
    pub qos: String,
    pub nodes_max: u32,
    pub mem_per_cpu_mb: u64,
    pub constraints: Vec<String>,
    pub exclusive: bool,
    pub topology: TopologyConstraint,
    pub dependencies: Vec<Dependency>,
    pub singleton: bool,
    pub kill_on_invalid_dep: bool,
    pub array: String,
    pub nice: i32,
    pub hold: bool,
    pub begin_ms: u64,
    pub comment: String,
    pub batch: bool,
    pub truncate_output: bool,
    pub nodelist: Vec<String>,
    pub exclude: Vec<String>,
    pub licenses: BTreeMap<String, u32>,
    pub reservation: String,
    pub time_min_s: u64,
    pub deadline_ms: u64,
    pub requeue_expedite: bool,
}

/// A job of format 10 (its spec is the frozen one).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    pub spec: JobSpec,
    pub state: JobState,
    pub attempt: u32,
    pub submitted_by: String,
    pub submit_time_ms: u64,
    pub start_time_ms: Option<u64>,
    pub end_time_ms: Option<u64>,
    pub allocation: Option<Allocation>,
    pub exit_code: Option<i32>,
    pub reason: String,
    pub submit_index: u64,
    pub task_exits: BTreeMap<String, TaskExit>,
    pub ran_on: Vec<String>,
    pub array: Option<ArrayElement>,
    pub deps_pending: Vec<Dependency>,
    #[serde(with = "crate::model::hold_as_text")]
    pub held: Option<HoldKind>,
    pub priority_override: Option<u32>,
    pub last_checkpoint_ms: Option<u64>,
    pub preempted: u32,
    pub requested_limit_s: u64,
    pub expedite_nodes: Option<Vec<String>>,
    pub suspended_at_ms: Option<u64>,
    pub suspended_ms: u64,
    pub steps: Vec<Step>,
    pub next_step_id: u32,
    pub signal: Option<JobSignal>,
}

frozen_struct!(JobSpec => crate::spec::JobSpec { name, user, command, script, workdir, partition, nodes, tasks_per_node, cpus_per_task, mem_per_node_mb, gpus_per_node, gpu_type, time_limit_s, env, requeue, output, error, warn_signal, warn_before_s, warn_batch_shell, account, qos, nodes_max, mem_per_cpu_mb, constraints, exclusive, topology, dependencies, singleton, kill_on_invalid_dep, array, nice, hold, begin_ms, comment, batch, truncate_output, nodelist, exclude, licenses, reservation, time_min_s, deadline_ms, requeue_expedite });
frozen_struct!(Job => crate::model::Job { id, spec, state, attempt, submitted_by, submit_time_ms, start_time_ms, end_time_ms, allocation, exit_code, reason, submit_index, task_exits, ran_on, array, deps_pending, held, priority_override, last_checkpoint_ms, preempted, requested_limit_s, expedite_nodes, suspended_at_ms, suspended_ms, steps, next_step_id, signal });
frozen_jobs!(Job, "formats 9 and 10");

/// The policy of formats 9 and 10, field for field.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterPolicy {
    pub version: u64,
    pub topology_levels: Vec<String>,
    pub partitions: BTreeMap<String, Partition>,
    pub accounts: BTreeMap<String, Account>,
    pub users: BTreeMap<String, User>,
    pub qos: BTreeMap<String, Qos>,
    pub priority: PriorityWeights,
    pub fairshare_half_life_s: u64,
    pub backfill_reservations: u32,
    pub enforce_users: bool,
    pub admins: Vec<String>,
    pub operators: Vec<String>,
    pub coordinators: BTreeMap<String, Vec<String>>,
    pub user_map: BTreeMap<String, String>,
    pub user_domains: Vec<String>,
    pub allow_root_jobs: bool,
    pub private_jobs: bool,
    pub licenses: BTreeMap<String, u32>,
}

frozen_struct!(ClusterPolicy => crate::policy::ClusterPolicy { version, topology_levels, partitions, accounts, users, qos, priority, fairshare_half_life_s, backfill_reservations, enforce_users, admins, operators, coordinators, user_map, user_domains, allow_root_jobs, private_jobs, licenses });

/// A policy as formats 9 and 10 write it, or why it cannot be: it uses
/// fields of a later format.
impl TryFrom<crate::policy::ClusterPolicy> for ClusterPolicy {
    type Error = String;

    fn try_from(p: crate::policy::ClusterPolicy) -> Result<Self, String> {
        let needs = p.needs_format();
        if needs > 10 {
            return Err(format!(
                "this policy needs data format {needs} (license limits per account or QOS need 11, a QOS preempt \
                 mode suspend 12)"
            ));
        }
        Ok(Frozen::freeze(p))
    }
}

impl From<ClusterPolicy> for crate::policy::ClusterPolicy {
    fn from(p: ClusterPolicy) -> Self {
        p.thaw()
    }
}

/// Lossy: the fields of later formats are left out (a state of format 9 or
/// 10 never holds them).
impl From<&crate::policy::ClusterPolicy> for ClusterPolicy {
    fn from(p: &crate::policy::ClusterPolicy) -> Self {
        Frozen::freeze(p.clone())
    }
}

frozen_commands!(
    format: 10,
    policy: ClusterPolicy,
    before_batch: [
        SubmitJob { spec: JobSpec, identity: String, idempotency_key: String, now_ms: u64 },
        CancelJob { job_id: JobId, identity: String, now_ms: u64 },
        RegisterNode { spec: NodeSpec, now_ms: u64 },
        SetNodeState { name: String, change: NodeStateChange, reason: String, now_ms: u64 },
        ApplyPlan { placements: Vec<Placement>, now_ms: u64 },
        JobFinished {
            job_id: JobId,
            attempt: u32,
            state: JobState,
            exit_code: Option<i32>,
            reason: String,
            now_ms: u64,
        },
    ],
    before_policy: [
        TaskExited {
            job_id: JobId,
            attempt: u32,
            node: String,
            exit_code: Option<i32>,
            signal: Option<i32>,
            reason: String,
            lost: bool,
            peak_mem_mb: Option<u64>,
            now_ms: u64,
        } later { usage: None },
        SetGpuHealth { node: String, gpu: u32, healthy: bool, reason: String, now_ms: u64 },
    ],
    after_policy: [
        UpdateJob { job_id: JobId, change: JobChange, identity: String, now_ms: u64 },
        ApplySchedule { preemptions: Vec<Preemption>, placements: Vec<Placement>, now_ms: u64 },
        JobCheckpointed { job_id: JobId, attempt: u32, now_ms: u64 },
        SetDataFormat { format: u32, now_ms: u64 },
        ChangeReservation { change: ReservationChange, identity: String, now_ms: u64 },
        StepStarted { job_id: JobId, attempt: u32, name: String, nodes: Vec<String>, tasks: u32, now_ms: u64 },
        StepEnded {
            job_id: JobId,
            attempt: u32,
            step_id: u32,
            exit_code: Option<i32>,
            signal: Option<i32>,
            now_ms: u64,
        },
    ],
    extra: [],
);

frozen_state!(
    format: 10,
    policy: ClusterPolicy,
    before_policy: [
        next_job_id: JobId,
        jobs: BTreeMap<JobId, Job> => JobsRef,
        pending: BTreeSet<JobId>,
        running: BTreeSet<JobId>,
        finished: VecDeque<JobId>,
        nodes: BTreeMap<String, Node>,
        idempotency: BTreeMap<(String, String), JobId>,
        idempotency_expiry: BTreeSet<(u64, String, String)>,
        clock_ms: u64,
    ],
    after_policy: [
        usage: BTreeMap<String, VecDeque<UsageBucket>>,
        running_use: BTreeMap<UseKey, Use>,
        active_jobs: BTreeMap<UseKey, u64>,
        dependents: BTreeMap<JobId, BTreeSet<JobId>>,
    ],
    stored_format: format,
    after_format: [reservations: BTreeMap<String, Reservation>],
);
