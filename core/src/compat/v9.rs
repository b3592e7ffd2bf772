//! Data format 9, frozen: the job and the snapshot's state as format 9
//! encoded them. Do not change anything here (the golden encodings test
//! holds these bytes); a new format gets a module of its own.
//!
//! Format 10 appended the suspension (when the job was suspended, how long
//! it was before) and the steps to the job, the job changes `Suspend` and
//! `Resume`, and the step commands; a format-9 entry is today's command
//! (the leader never writes those in format 9, see `Command::writable_in`,
//! and the entry's encoder refuses them).

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::v10::JobSpec;
use super::{frozen_jobs, frozen_state, frozen_struct, Frozen};
use crate::model::{Allocation, ArrayElement, HoldKind, JobId, JobState, Node, TaskExit};
use crate::policy::Use;
use crate::reservation::Reservation;
use crate::spec::Dependency;
use crate::state::{UsageBucket, UseKey};

/// A job of format 9, field for field.
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
}

frozen_struct!(Job => crate::model::Job { id, spec, state, attempt, submitted_by, submit_time_ms, start_time_ms, end_time_ms, allocation, exit_code, reason, submit_index, task_exits, ran_on, array, deps_pending, held, priority_override, last_checkpoint_ms, preempted, requested_limit_s, expedite_nodes });
frozen_jobs!(Job, "format 9");

frozen_state!(
    format: 9,
    policy: super::v10::ClusterPolicy,
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
