//! Data format 5, frozen: the policy, the log entry and the snapshot's state
//! as format 5 encoded them. Do not change anything here (the golden
//! encodings test holds these bytes); a new format gets a module of its own.
//!
//! Format 6 appended the roles, the user map and the job switches to the
//! policy; everything else in a format-5 entry or state is today's type.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use serde::{Deserialize, Serialize};

use super::v8::{Job, JobSpec, JobsRef};
use super::{frozen_commands, frozen_state};
use crate::command::{JobChange, NodeStateChange, Placement, Preemption};
use crate::model::{JobId, JobState, Node};
use crate::policy::{Account, Partition, PriorityWeights, Qos, Use, User};
use crate::spec::NodeSpec;
use crate::state::{UsageBucket, UseKey};

/// The policy of formats 4 and 5, field for field.
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
}

/// Declares the conversions between this policy and today's.
macro_rules! policy_fields {
    ($($f:ident),*) => {
        impl From<ClusterPolicy> for crate::policy::ClusterPolicy {
            fn from(p: ClusterPolicy) -> Self {
                crate::policy::ClusterPolicy { $($f: p.$f,)* ..crate::policy::ClusterPolicy::default() }
            }
        }

        /// Lossy: the fields of later formats are left out (a state of
        /// format 5 never holds them; see `TryFrom` for commands).
        impl From<&crate::policy::ClusterPolicy> for ClusterPolicy {
            fn from(p: &crate::policy::ClusterPolicy) -> Self {
                ClusterPolicy { $($f: p.$f.clone(),)* }
            }
        }
    };
}

policy_fields!(
    version,
    topology_levels,
    partitions,
    accounts,
    users,
    qos,
    priority,
    fairshare_half_life_s,
    backfill_reservations,
    enforce_users,
    admins
);

/// A policy as format 5 writes it, or why it cannot be: it uses fields of
/// a later format.
impl TryFrom<crate::policy::ClusterPolicy> for ClusterPolicy {
    type Error = String;

    fn try_from(p: crate::policy::ClusterPolicy) -> Result<Self, String> {
        let needs = p.needs_format();
        if needs > 5 {
            return Err(format!("a policy with roles, a user map or job switches needs data format {needs}"));
        }
        Ok(ClusterPolicy::from(&p))
    }
}

frozen_commands!(
    format: 5,
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
    ],
    extra: [],
);

frozen_state!(
    format: 5,
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
);
