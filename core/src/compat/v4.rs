//! Data format 4, frozen: the log entry and the snapshot's state as the builds
//! before named formats wrote them. Do not change anything here (the golden
//! encodings test holds these bytes); a new format gets a module of its own.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use super::v5::ClusterPolicy;
use super::v8::{Job, JobSpec, JobsRef};
use super::{frozen_commands, frozen_state};
use crate::command::{JobChange, NodeStateChange, Placement, Preemption};
use crate::model::{JobId, JobState, Node};
use crate::policy::Use;
use crate::spec::NodeSpec;
use crate::state::{UsageBucket, UseKey};

// A format-4 log entry: a format-4 command (format 4's policy is format 5's),
// or (never written by a format-4 build) an envelope holding an entry of a
// later format. The envelope takes the first variant index format 4 never
// used, so a format-4 build refuses such an entry instead of misreading it.
frozen_commands!(
    format: 4,
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
    ],
    // `raw_bytes` writes the body as serde writes a `Vec<u8>`, in one copy.
    extra: [Envelope { format: u32, #[serde(with = "crate::format::raw_bytes")] body: Vec<u8> }],
);

frozen_state!(
    format: 4,
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
);
