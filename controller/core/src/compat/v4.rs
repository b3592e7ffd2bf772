//! Data format 4, frozen: the log entry and the snapshot's state as the builds
//! before named formats wrote them. Do not change anything here (the golden
//! encodings test holds these bytes); a new format gets a module of its own.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use crate::command::{Command, JobChange, NodeStateChange, Placement, Preemption};
use crate::model::{Job, JobId, JobState, Node};
use crate::policy::{ClusterPolicy, Use};
use crate::spec::{JobSpec, NodeSpec};
use crate::state::{UsageBucket, UseKey};

/// Declares format 4's command enum, variant for variant as `Command` had them
/// (a variant's position is its encoding; `Batch`, a tuple variant, sat at
/// position 6 between the two lists), with the conversions to and from today's.
macro_rules! frozen_commands {
    (
        [$($a:ident { $($af:ident : $at:ty),* $(,)? }),* $(,)?],
        [$($b:ident { $($bf:ident : $bt:ty),* $(,)? }),* $(,)?] $(,)?
    ) => {
        /// A format-4 log entry: a format-4 command, or (never written by a
        /// format-4 build) an envelope holding an entry of a later format. The
        /// envelope takes the first variant index format 4 never used, so a
        /// format-4 build refuses such an entry instead of misreading it.
        #[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
        pub enum Wire {
            $($a { $($af: $at),* },)*
            Batch(#[serde(deserialize_with = "crate::command::batch_items")] Vec<Command>),
            $($b { $($bf: $bt),* },)*
            Envelope { format: u32, body: Vec<u8> },
        }

        impl Wire {
            /// `c` as format 4 wrote it, or why it cannot be.
            pub fn from_command(c: &Command) -> Result<Wire, String> {
                Ok(match c.clone() {
                    $(Command::$a { $($af),* } => Wire::$a { $($af),* },)*
                    $(Command::$b { $($bf),* } => Wire::$b { $($bf),* },)*
                    Command::Batch(cmds) => match cmds.iter().find(|c| c.since_format() > 4) {
                        Some(c) => return Err(format!("{} cannot be written in data format 4", c.name())),
                        None => Wire::Batch(cmds),
                    },
                    other => return Err(format!("{} cannot be written in data format 4", other.name())),
                })
            }

            /// The command a bare format-4 entry holds; None for an envelope
            /// (`format::Payload` opens those).
            pub fn into_command(self) -> Option<Command> {
                Some(match self {
                    $(Wire::$a { $($af),* } => Command::$a { $($af),* },)*
                    $(Wire::$b { $($bf),* } => Command::$b { $($bf),* },)*
                    Wire::Batch(cmds) => Command::Batch(cmds),
                    Wire::Envelope { .. } => return None,
                })
            }
        }
    };
}

frozen_commands!(
    [
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
    [
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
        },
        SetGpuHealth { node: String, gpu: u32, healthy: bool, reason: String, now_ms: u64 },
        UpdatePolicy {
            policy: ClusterPolicy,
            expected_version: Option<u64>,
            force: bool,
            identity: String,
            now_ms: u64,
        },
        UpdateJob { job_id: JobId, change: JobChange, identity: String, now_ms: u64 },
        ApplySchedule { preemptions: Vec<Preemption>, placements: Vec<Placement>, now_ms: u64 },
        JobCheckpointed { job_id: JobId, attempt: u32, now_ms: u64 },
    ],
);

/// Format 4's state, field for field (format 5 appended `format`).
#[derive(Deserialize)]
pub struct State {
    next_job_id: JobId,
    jobs: BTreeMap<JobId, Job>,
    pending: BTreeSet<JobId>,
    running: BTreeSet<JobId>,
    finished: VecDeque<JobId>,
    nodes: BTreeMap<String, Node>,
    idempotency: BTreeMap<(String, String), JobId>,
    idempotency_expiry: BTreeSet<(u64, String, String)>,
    clock_ms: u64,
    policy: ClusterPolicy,
    usage: BTreeMap<String, VecDeque<UsageBucket>>,
    running_use: BTreeMap<UseKey, Use>,
    active_jobs: BTreeMap<UseKey, u64>,
    dependents: BTreeMap<JobId, BTreeSet<JobId>>,
}

/// Format 4's state, borrowed from today's for encoding.
#[derive(Serialize)]
pub struct StateRef<'a> {
    next_job_id: &'a JobId,
    jobs: &'a BTreeMap<JobId, Job>,
    pending: &'a BTreeSet<JobId>,
    running: &'a BTreeSet<JobId>,
    finished: &'a VecDeque<JobId>,
    nodes: &'a BTreeMap<String, Node>,
    idempotency: &'a BTreeMap<(String, String), JobId>,
    idempotency_expiry: &'a BTreeSet<(u64, String, String)>,
    clock_ms: &'a u64,
    policy: &'a ClusterPolicy,
    usage: &'a BTreeMap<String, VecDeque<UsageBucket>>,
    running_use: &'a BTreeMap<UseKey, Use>,
    active_jobs: &'a BTreeMap<UseKey, u64>,
    dependents: &'a BTreeMap<JobId, BTreeSet<JobId>>,
}

impl<'a> From<&'a crate::State> for StateRef<'a> {
    fn from(s: &'a crate::State) -> Self {
        StateRef {
            next_job_id: &s.next_job_id,
            jobs: &s.jobs,
            pending: &s.pending,
            running: &s.running,
            finished: &s.finished,
            nodes: &s.nodes,
            idempotency: &s.idempotency,
            idempotency_expiry: &s.idempotency_expiry,
            clock_ms: &s.clock_ms,
            policy: &s.policy,
            usage: &s.usage,
            running_use: &s.running_use,
            active_jobs: &s.active_jobs,
            dependents: &s.dependents,
        }
    }
}

impl From<State> for crate::State {
    fn from(s: State) -> Self {
        crate::State {
            next_job_id: s.next_job_id,
            jobs: s.jobs,
            pending: s.pending,
            running: s.running,
            finished: s.finished,
            nodes: s.nodes,
            idempotency: s.idempotency,
            idempotency_expiry: s.idempotency_expiry,
            clock_ms: s.clock_ms,
            policy: s.policy,
            usage: s.usage,
            running_use: s.running_use,
            active_jobs: s.active_jobs,
            dependents: s.dependents,
            format: 4,
            ..crate::State::default()
        }
    }
}
