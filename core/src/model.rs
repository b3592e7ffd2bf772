//! The replicated model: jobs, nodes, GPUs and the allocations that bind them.
//!
//! Related code: [`crate::state`] changes these only through `apply`.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use crate::spec::{Dependency, JobSpec, NodeSpec};

pub type JobId = u64;

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum JobState {
    #[default]
    Pending,
    Running,
    Completed,
    Failed,
    Cancelled,
    TimedOut,
    NodeFail,
    /// It could no longer end by its `--deadline` (Slurm's DEADLINE). Since format 9.
    Deadline,
}

impl JobState {
    /// Every state, in lifecycle order.
    pub const ALL: [JobState; 8] = [
        JobState::Pending,
        JobState::Running,
        JobState::Completed,
        JobState::Failed,
        JobState::Cancelled,
        JobState::TimedOut,
        JobState::NodeFail,
        JobState::Deadline,
    ];

    pub fn is_finished(self) -> bool {
        !matches!(self, JobState::Pending | JobState::Running)
    }

    pub fn as_str(self) -> &'static str {
        match self {
            JobState::Pending => "PENDING",
            JobState::Running => "RUNNING",
            JobState::Completed => "COMPLETED",
            JobState::Failed => "FAILED",
            JobState::Cancelled => "CANCELLED",
            JobState::TimedOut => "TIMEOUT",
            JobState::NodeFail => "NODE_FAIL",
            JobState::Deadline => "DEADLINE",
        }
    }

    /// Parses the Slurm-style names `as_str` prints (case-insensitive).
    pub fn parse(s: &str) -> Option<JobState> {
        JobState::ALL.into_iter().find(|st| st.as_str().eq_ignore_ascii_case(s))
    }
}

/// The resources one attempt of a job holds on one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeAllocation {
    pub node: String,
    pub cpus: u32,
    pub mem_mb: u64,
    /// Indexes into the node's GPU list.
    pub gpus: Vec<u32>,
}

/// The resources granted to one attempt of a job, placed as a whole.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Allocation {
    pub attempt: u32,
    pub nodes: Vec<NodeAllocation>,
}

/// A job as the state holds it. `Default` is an empty pending job: the
/// constructors and the older formats' conversions name what they know and
/// take the rest from it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Job {
    pub id: JobId,
    pub spec: JobSpec,
    pub state: JobState,
    /// How many times the job has been started; a requeue increments it, and every
    /// order an agent receives is fenced by it.
    pub attempt: u32,
    /// The caller identity that submitted the job (from request metadata).
    pub submitted_by: String,
    pub submit_time_ms: u64,
    pub start_time_ms: Option<u64>,
    pub end_time_ms: Option<u64>,
    pub allocation: Option<Allocation>,
    pub exit_code: Option<i32>,
    /// Why the job is in its state (pending reason, failure cause, who cancelled).
    pub reason: String,
    /// The Raft log index of the submit: a replicated, totally ordered stamp.
    pub submit_index: u64,
    /// Per node of the current attempt's allocation: how its task ended.
    pub task_exits: BTreeMap<String, TaskExit>,
    /// The nodes the last attempt ran on (kept after the allocation is released,
    /// for `queue --all` and accounting).
    pub ran_on: Vec<String>,
    /// Set for an element of a job array.
    pub array: Option<ArrayElement>,
    /// Dependencies not yet satisfied (resolved to job ids at submit); the job
    /// is eligible when this is empty.
    pub deps_pending: Vec<Dependency>,
    /// Why the job is held; None: not held. Encoded as its Slurm reason
    /// text, as before the type existed (see [`HoldKind`]).
    #[serde(with = "hold_as_text")]
    pub held: Option<HoldKind>,
    /// Admin-set priority that replaces the computed one (Slurm's
    /// `scontrol update priority=`).
    pub priority_override: Option<u32>,
    /// When the running attempt last reported a checkpoint: preemption prefers
    /// victims that lose the least work since theirs.
    pub last_checkpoint_ms: Option<u64>,
    /// Times the job was preempted (requeued for another job).
    pub preempted: u32,
    /// The time limit asked for, when this attempt started with a shorter
    /// one (down to `--time-min`); a requeue gives it back. 0: not
    /// shortened. Since format 9.
    pub requested_limit_s: u64,
    /// Requeued with `--requeue=expedite` because a node failed: the nodes
    /// of its last attempt that did not fail (none for a one-node job). Its
    /// next attempt goes first and prefers them. None otherwise. Since
    /// format 9.
    pub expedite_nodes: Option<Vec<String>>,
    /// When the running attempt was suspended (`scontrol suspend`): its
    /// tasks are stopped and it keeps its allocation. None: not suspended.
    /// Since format 10.
    pub suspended_at_ms: Option<u64>,
    /// How long the current (or last) attempt spent suspended before, in
    /// milliseconds: its time limit and elapsed time leave it out (Slurm's
    /// `Suspended` time). Since format 10.
    pub suspended_ms: u64,
    /// The srun steps of the current (or last) attempt, oldest first: the
    /// last [`crate::limits::STEPS_PER_JOB_MAX`]. Since format 10.
    pub steps: Vec<Step>,
    /// The id the attempt's next step gets (sacct's `ID.0`, `ID.1`, ...).
    /// Since format 10.
    pub next_step_id: u32,
    /// The last `scancel --signal` of the current attempt: its number (each
    /// node's agent delivers each number once), the signal and its target.
    /// None: none yet. Since format 10.
    pub signal: Option<JobSignal>,
    /// The preemptor this running attempt was suspended for (QOS preempt
    /// mode SUSPEND): while set, the job is suspended and holds its memory,
    /// licenses and quota use but not its CPUs or GPUs, which `apply` gives
    /// back (resuming it) once they are free. Since format 12.
    pub preempted_by: Option<JobId>,
    /// What each node's task of the current (or last) attempt used, as its
    /// agent measured it (see [`TaskUsage`]). Since format 13.
    pub task_usage: BTreeMap<String, TaskUsage>,
    /// The log index of the entry that finished the job (None: unfinished,
    /// or finished before format 13), against `State::accounted_index`.
    pub finished_index: Option<u64>,
    /// Why the current or last attempt was stopped by something other than
    /// its own tasks (see [`StopCause`]); None: it was not, or it started
    /// again since. Set by `apply` from format 18
    /// (`format::STOP_CAUSE_FORMAT`), where a snapshot writes it after the
    /// node inventory; not in the job's own encoding, so the encodings of
    /// formats 13 to 17 are unchanged.
    #[serde(skip)]
    pub stop_cause: Option<StopCause>,
}

/// Why a job's attempt was stopped by something other than its own tasks: a
/// typed fact the leader's decisions read (a preempted task's grace, who may
/// see the preemptor), kept in the replicated state from format 18. People
/// read it as text ([`StopCause::describe`]), made where they read it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum StopCause {
    /// Preempted to make room for job `by`: requeued, suspended or cancelled,
    /// as its QOS's preempt mode says.
    Preempted { by: JobId },
    /// Its node failed under it: went down, or lost its task.
    NodeFailed { node: String },
    /// A GPU it held failed.
    GpuFailed { node: String, gpu: u32 },
    /// Its time limit passed.
    TimeLimit,
    /// Cancelled by `identity` (its owner, a coordinator, an operator).
    CancelledBy { identity: String },
    /// Put back in the queue by `identity`.
    RequeuedBy { identity: String },
}

impl StopCause {
    /// The words before the preemptor's id in a preempted job's reason
    /// (which the edge hides from a caller who may not see that job).
    pub const PREEMPTED_BY: &'static str = "preempted by job ";

    /// The words for it. `preemptor_shown` false leaves the preemptor's id
    /// out, for a caller who may not see that job.
    pub fn describe(&self, preemptor_shown: bool) -> String {
        match self {
            StopCause::Preempted { by } if preemptor_shown => format!("{}{by}", Self::PREEMPTED_BY),
            StopCause::Preempted { .. } => "preempted by another job".into(),
            StopCause::NodeFailed { node } => format!("node {node} failed"),
            StopCause::GpuFailed { node, gpu } => format!("GPU {gpu} on {node} failed"),
            StopCause::TimeLimit => "time limit reached".into(),
            StopCause::CancelledBy { identity } => format!("cancelled by {identity}"),
            StopCause::RequeuedBy { identity } => format!("requeued by {identity}"),
        }
    }

    /// The job a reason written before format 18 says its job was
    /// preempted for ("preempted by job 42", "requeued: preempted by job
    /// 42"): the only reading of that text left, for states older than
    /// [`crate::format::STOP_CAUSE_FORMAT`] and their move to it.
    pub fn legacy_preemptor(reason: &str) -> Option<JobId> {
        let (_, rest) = reason.split_once(Self::PREEMPTED_BY)?;
        let digits: String = rest.chars().take_while(char::is_ascii_digit).take(20).collect();
        digits.parse().ok()
    }

    /// The job it was preempted for, if it was.
    pub fn preempted_by(&self) -> Option<JobId> {
        match self {
            StopCause::Preempted { by } => Some(*by),
            _ => None,
        }
    }
}

/// A task: one job attempt's on one node (the node is the agent's own).
pub type TaskKey = (JobId, u32);

/// Usage charged to an account in one time bucket (for decayed fair share).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct UsageBucket {
    pub start_ms: u64,
    /// GPU-milliseconds and CPU-milliseconds of allocations that ended in the bucket.
    pub gpu_ms: u64,
    pub cpu_ms: u64,
}

/// Which processes of a job `scancel --signal` reaches (Slurm's default,
/// `--batch` and `--full`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum SignalTarget {
    /// Every process but the batch shell and srun (Slurm's default: the steps).
    Steps,
    /// The batch shell only.
    Batch,
    /// Every process of the job.
    Full,
}

/// A signal requested for a running job's tasks (see [`Job::signal`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct JobSignal {
    /// Counts the requests of the attempt, from 1.
    pub seq: u64,
    pub signal: i32,
    pub target: SignalTarget,
}

/// One srun step of a job attempt, as accounting shows it (`ID.N`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Step {
    pub id: u32,
    /// The command's program name.
    pub name: String,
    /// The nodes it ran on; empty: every node of the job's allocation.
    pub nodes: Vec<String>,
    pub tasks: u32,
    pub start_ms: u64,
    /// None while it runs.
    pub end_ms: Option<u64>,
    /// RUNNING, then COMPLETED, FAILED, or CANCELLED (still running when
    /// its job ended).
    pub state: JobState,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
}

impl Step {
    /// Bytes it holds in the state, for the retention budget.
    pub fn size_bytes(&self) -> usize {
        let fixed = 96usize.saturating_add(self.name.len());
        self.nodes.iter().map(|n| n.len().saturating_add(24)).fold(fixed, usize::saturating_add)
    }
}

/// Membership of a job in an array: elements are consecutive job ids starting
/// at `array_job_id` (Slurm's `%A`), each with its index (`%a`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ArrayElement {
    pub array_job_id: JobId,
    pub index: u32,
    /// Elements in the array.
    pub count: u32,
    /// Elements allowed to run at once (0: no limit).
    pub throttle: u32,
}

impl Job {
    /// GPUs the job holds (running) or asks for at its minimum size.
    pub fn gpus(&self) -> u64 {
        match &self.allocation {
            Some(a) => a.nodes.iter().map(|n| n.gpus.len() as u64).sum(),
            None => self.spec.total_gpus(),
        }
    }

    pub fn cpus(&self) -> u64 {
        match &self.allocation {
            Some(a) => a.nodes.iter().map(|n| u64::from(n.cpus)).sum(),
            None => self.spec.total_cpus(),
        }
    }

    /// Whether a pending job can no longer end by its deadline if it started
    /// at `now_ms` (with its shortest acceptable limit).
    pub fn deadline_missed(&self, now_ms: u64) -> bool {
        let s = &self.spec;
        s.deadline_ms > 0 && now_ms.saturating_add(self.min_limit_s().saturating_mul(1000)) > s.deadline_ms
    }

    /// Component `k` of a heterogeneous job (0: the job's own shape) as a
    /// job of its own, for placement: the component's shape with the job's
    /// time limits, reservation and topology, and nothing a placement does
    /// not read (no script, environment or steps: a scheduling pass may try
    /// many placements).
    pub fn component_job(&self, k: usize) -> Job {
        let spec = self.spec.component_shape(k);
        Job {
            id: self.id,
            spec,
            state: self.state,
            attempt: self.attempt,
            submit_time_ms: self.submit_time_ms,
            start_time_ms: self.start_time_ms,
            submit_index: self.submit_index,
            array: self.array,
            priority_override: self.priority_override,
            preempted: self.preempted,
            requested_limit_s: self.requested_limit_s,
            ..Job::default()
        }
    }

    /// The shortest time limit the job accepts (seconds): `--time-min`, or
    /// its whole limit.
    pub fn min_limit_s(&self) -> u64 {
        let s = &self.spec;
        if s.time_min_s > 0 {
            s.time_min_s.min(s.time_limit_s)
        } else {
            s.time_limit_s
        }
    }

    /// Bytes the job holds in the state once finished (its spec and its
    /// steps), for the retention budget.
    pub fn retained_bytes(&self) -> usize {
        self.steps.iter().map(Step::size_bytes).fold(self.spec.size_bytes(), usize::saturating_add)
    }

    pub fn is_suspended(&self) -> bool {
        self.suspended_at_ms.is_some()
    }

    /// Whether the job is suspended for a preemptor and has given up its
    /// CPUs and GPUs meanwhile (see [`Job::preempted_by`]).
    pub fn is_yielded(&self) -> bool {
        self.preempted_by.is_some()
    }

    /// Time the current (or last) attempt has spent suspended as of
    /// `now_ms`, the ongoing suspension included.
    pub fn suspended_total_ms(&self, now_ms: u64) -> u64 {
        let ongoing = self.suspended_at_ms.map_or(0, |at| now_ms.saturating_sub(at));
        self.suspended_ms.saturating_add(ongoing)
    }

    /// When the running attempt reaches its time limit: its start plus its
    /// limit plus the time it spent suspended. None while it is suspended
    /// (the limit's clock is paused) or before it started.
    pub fn limit_end_ms(&self) -> Option<u64> {
        if self.is_suspended() {
            return None;
        }
        let start = self.start_time_ms?;
        Some(start.saturating_add(self.spec.time_limit_s.saturating_mul(1000)).saturating_add(self.suspended_ms))
    }

    /// When the running attempt reaches its time limit if it runs on from
    /// `now_ms`: its start, its limit and the time it has been suspended
    /// (for a job that never was, its start plus its limit).
    pub fn expected_end_ms(&self, now_ms: u64) -> u64 {
        self.start_time_ms
            .unwrap_or(now_ms)
            .saturating_add(self.spec.time_limit_s.saturating_mul(1000))
            .saturating_add(self.suspended_total_ms(now_ms))
    }

    /// How long the attempt has run as of `now_ms` (its end, once ended),
    /// leaving out the time it was suspended.
    pub fn run_ms(&self, now_ms: u64) -> u64 {
        let Some(start) = self.start_time_ms else { return 0 };
        let end = self.end_time_ms.unwrap_or(now_ms);
        end.saturating_sub(start).saturating_sub(self.suspended_total_ms(end))
    }

    /// What the job's tasks used, summed over its nodes; None when no agent
    /// measured one (a job that never ran, or ran on a build before format 13).
    pub fn usage(&self) -> Option<JobUsage> {
        summarize_usage(self.task_usage.values())
    }

    /// `12` or `10_2` (array job id and index), as Slurm prints job ids.
    pub fn display_id(&self) -> String {
        match &self.array {
            Some(a) => format!("{}_{}", a.array_job_id, a.index),
            None => self.id.to_string(),
        }
    }
}

/// What one node's task used, measured by its agent (which runs as root and
/// reads the kernel's and NVML's figures, not the job's word): CPU time of
/// the task's processes, their peak resident memory, and the GPUs' load,
/// sampled while it ran. Since format 13.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskUsage {
    /// User and system CPU time of the task's processes (ms).
    pub cpu_ms: u64,
    /// Peak resident memory (MiB): the most its processes held at once, as
    /// sampled, or the cgroup's peak where there is one.
    pub mem_peak_mb: u64,
    /// GPU readings taken: one per GPU of the task per sample.
    pub gpu_samples: u32,
    /// The sum of those readings' utilization (percent, 0..=100 each).
    pub gpu_util_pct_sum: u64,
    /// The most memory one of its GPUs had in use (MiB).
    pub gpu_mem_peak_mb: u64,
}

/// The most CPU time one task may report: every CPU of the largest node
/// for a year (a task running longer reports once it ends).
pub const TASK_CPU_MS_MAX: u64 = 4096 * 366 * 86_400_000;
/// The most memory one node's task may report (MiB): 64 TiB.
pub const TASK_MEM_MB_MAX: u64 = 64 * 1024 * 1024;

impl TaskUsage {
    /// Whether the figures are possible: each GPU reading at most 100%, CPU
    /// time and memory within what a node could give.
    pub fn check(&self) -> Result<(), String> {
        if self.cpu_ms > TASK_CPU_MS_MAX {
            return Err(format!("usage.cpu_ms: must be at most {TASK_CPU_MS_MAX}"));
        }
        if self.mem_peak_mb > TASK_MEM_MB_MAX || self.gpu_mem_peak_mb > TASK_MEM_MB_MAX {
            return Err(format!("usage.mem_peak_mb, gpu_mem_peak_mb: must be at most {TASK_MEM_MB_MAX}"));
        }
        if self.gpu_util_pct_sum > u64::from(self.gpu_samples).saturating_mul(100) {
            return Err(format!(
                "usage.gpu_util_pct_sum: {} is more than 100% for each of {} readings",
                self.gpu_util_pct_sum, self.gpu_samples
            ));
        }
        Ok(())
    }
}

/// A job's use summed over its nodes' tasks (see [`Job::usage`]).
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct JobUsage {
    /// Nodes whose agent measured their task.
    pub nodes: u32,
    pub cpu_ms: u64,
    /// Peak memory summed over the nodes (each node's own peak).
    pub mem_peak_mb: u64,
    /// Mean GPU utilization over every reading (percent), if any was taken.
    pub gpu_util_pct: Option<f64>,
    pub gpu_mem_peak_mb: u64,
}

/// Sums tasks' use (see [`JobUsage`]); None for no task.
pub fn summarize_usage<'a>(tasks: impl IntoIterator<Item = &'a TaskUsage>) -> Option<JobUsage> {
    let mut u = JobUsage::default();
    let (mut samples, mut util) = (0u64, 0u64);
    for t in tasks {
        u.nodes = u.nodes.saturating_add(1);
        u.cpu_ms = u.cpu_ms.saturating_add(t.cpu_ms);
        u.mem_peak_mb = u.mem_peak_mb.saturating_add(t.mem_peak_mb);
        u.gpu_mem_peak_mb = u.gpu_mem_peak_mb.max(t.gpu_mem_peak_mb);
        samples = samples.saturating_add(u64::from(t.gpu_samples));
        util = util.saturating_add(t.gpu_util_pct_sum);
    }
    if u.nodes == 0 {
        return None;
    }
    u.gpu_util_pct = (samples > 0).then(|| (util as f64 / samples as f64).min(100.0));
    Some(u)
}

/// How one node's task of a job attempt ended, as its agent reported it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TaskExit {
    pub exit_code: Option<i32>,
    /// The signal that ended the task, if any.
    pub signal: Option<i32>,
    pub end_ms: u64,
    pub peak_mem_mb: Option<u64>,
}

impl TaskExit {
    pub fn succeeded(&self) -> bool {
        self.exit_code == Some(0) && self.signal.is_none()
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum GpuHealth {
    Healthy,
    /// Not used for new work (bad health report or admin action).
    Quarantined,
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Gpu {
    pub index: u32,
    pub uuid: String,
    pub model: String,
    pub mem_mb: u64,
    pub nvlink_island: u32,
    pub health: GpuHealth,
    /// Why the GPU is quarantined (empty when healthy).
    pub health_reason: String,
    /// The job whose running attempt holds this GPU.
    pub allocated_to: Option<JobId>,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
pub enum NodeState {
    Up,
    /// No new work is placed; running work finishes.
    Drain,
    /// The leader stopped hearing from the agent.
    Down,
    /// A node of an elastic pool, powered down (or not yet created): the
    /// scheduler may plan on it, which powers it up. Since format 12.
    PoweredDown,
    /// Powered up for work placed on it, its agent not registered yet. Since
    /// format 12.
    PoweringUp,
}

impl NodeState {
    pub fn as_str(self) -> &'static str {
        match self {
            NodeState::Up => "UP",
            NodeState::Drain => "DRAIN",
            NodeState::Down => "DOWN",
            NodeState::PoweredDown => "POWERED_DOWN",
            NodeState::PoweringUp => "POWERING_UP",
        }
    }

    /// Whether work may be placed on a node in this state: up, or a pool's
    /// node that is powered down or booting.
    pub fn takes_work(self) -> bool {
        matches!(self, NodeState::Up | NodeState::PoweredDown | NodeState::PoweringUp)
    }
}

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Node {
    pub name: String,
    pub addr: String,
    pub cpus: u32,
    pub mem_mb: u64,
    pub gpus: Vec<Gpu>,
    pub topology: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub state: NodeState,
    pub state_reason: String,
    pub registered_ms: u64,
    pub state_changed_ms: u64,
    /// CPUs held by running attempts (kept equal to the sum of allocations).
    pub cpus_alloc: u32,
    pub mem_alloc_mb: u64,
    /// Jobs with an allocation on this node: lets a node change find its jobs
    /// without scanning every job.
    pub jobs: Vec<JobId>,
}

impl Node {
    /// Whether an agent ever registered the node (a pool's node is in the
    /// state before: `registered_ms` 0, no address).
    pub fn ever_registered(&self) -> bool {
        self.registered_ms != 0 || !self.addr.is_empty()
    }

    pub fn from_spec(spec: &NodeSpec, now_ms: u64) -> Node {
        Node {
            name: spec.name.clone(),
            addr: spec.addr.clone(),
            cpus: spec.cpus,
            mem_mb: spec.mem_mb,
            gpus: spec
                .gpus
                .iter()
                .enumerate()
                .map(|(i, g)| Gpu {
                    index: u32::try_from(i).unwrap_or(u32::MAX),
                    uuid: g.uuid.clone(),
                    model: g.model.clone(),
                    mem_mb: g.mem_mb,
                    nvlink_island: g.nvlink_island,
                    health: GpuHealth::Healthy,
                    health_reason: String::new(),
                    allocated_to: None,
                })
                .collect(),
            topology: spec.topology.clone(),
            labels: spec.labels.clone(),
            state: NodeState::Up,
            state_reason: String::new(),
            registered_ms: now_ms,
            state_changed_ms: now_ms,
            cpus_alloc: 0,
            mem_alloc_mb: 0,
            jobs: Vec::new(),
        }
    }

    pub fn gpus_free(&self) -> usize {
        self.gpus.iter().filter(|g| g.allocated_to.is_none() && g.health == GpuHealth::Healthy).count()
    }
}

/// Why a job is held, kept from starting until released.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum HoldKind {
    /// Held by its user (`hold`, `--hold`, `requeue --hold`): they may release it.
    User,
    /// Held by an operator or admin: only they may release it.
    Admin,
    /// A dependency can never be met and the job asked to be kept
    /// (`--kill-on-invalid-dep=no`): held until someone releases or cancels it.
    DependencyNeverSatisfied,
}

impl HoldKind {
    /// Slurm's reason code, as `squeue` shows it and the state stores it.
    pub fn as_str(self) -> &'static str {
        match self {
            HoldKind::User => "JobHeldUser",
            HoldKind::Admin => "JobHeldAdmin",
            HoldKind::DependencyNeverSatisfied => "DependencyNeverSatisfied",
        }
    }

    /// The hold a stored reason code names. Only these three were ever
    /// written; any other text reads as a user hold, as the builds that
    /// stored text treated it (a user hold to the scheduler, releasable by
    /// its owner), so every build applies the same log alike.
    pub fn parse(text: &str) -> HoldKind {
        match text {
            "JobHeldAdmin" => HoldKind::Admin,
            "DependencyNeverSatisfied" => HoldKind::DependencyNeverSatisfied,
            _ => HoldKind::User,
        }
    }
}

/// `Option<HoldKind>` encoded as `Option<String>` (its reason code), so the
/// replicated bytes are those of the formats that stored the text.
pub(crate) mod hold_as_text {
    use serde::{Deserialize, Deserializer, Serialize, Serializer};

    use super::HoldKind;

    pub fn serialize<S: Serializer>(hold: &Option<HoldKind>, s: S) -> Result<S::Ok, S::Error> {
        hold.map(HoldKind::as_str).serialize(s)
    }

    pub fn deserialize<'de, D: Deserializer<'de>>(d: D) -> Result<Option<HoldKind>, D::Error> {
        Ok(Option::<String>::deserialize(d)?.map(|t| HoldKind::parse(&t)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A hold is stored as its reason code: each kind reads back as itself,
    /// and text no build wrote reads as the old builds treated it.
    #[test]
    fn hold_kinds_keep_their_stored_text() {
        for kind in [HoldKind::User, HoldKind::Admin, HoldKind::DependencyNeverSatisfied] {
            assert_eq!(HoldKind::parse(kind.as_str()), kind);
            let bytes = crate::format::to_bytes(&Some(kind.as_str()));
            #[derive(Serialize, Deserialize)]
            struct Held(#[serde(with = "hold_as_text")] Option<HoldKind>);
            assert_eq!(crate::format::to_bytes(&Held(Some(kind))), bytes, "{kind:?} encodes as its text");
            assert_eq!(crate::format::from_bytes::<Held>(&bytes).unwrap().0, Some(kind));
        }
        assert_eq!(HoldKind::parse("JobHeldSomethingElse"), HoldKind::User);
    }
}
