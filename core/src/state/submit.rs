//! Submission: a [`JobSpec`] resolved against the policy (partition, account,
//! QOS, time limit, memory defaults), checked against submit limits, its
//! dependencies resolved to job ids, and — for an array — expanded into one job
//! per element. All checks run before anything changes.
//!
//! Related code: [`crate::policy`] (what is resolved against), `deps.rs`
//! (dependency tracking after submit).

use std::collections::BTreeMap;

use super::{Applied, JobEvent, Outcome, RefusalKind, State, UseKey};
use crate::limits::*;
use crate::model::{ArrayElement, Job, JobId, JobState};
use crate::policy::{Identity, IdentityKind, DEFAULT_QOS, ROLES_FORMAT};
use crate::spec::{parse_array, Dependency, DependencyKind, HetComponent, JobSpec, SpecError};

impl State {
    pub(super) fn apply_submit_job(&mut self, index: u64, spec: &JobSpec, identity: &str, key: &str) -> Applied {
        if !key.is_empty() {
            if let Some(&job_id) = self.idempotency.get(&(identity.to_string(), key.to_string())) {
                return Applied { outcome: Outcome::Submitted { job_id, duplicate: true }, events: Vec::new() };
            }
            if key.len() > IDEMPOTENCY_KEY_BYTES_MAX {
                return Applied::refused(
                    RefusalKind::InvalidArgument,
                    format!("idempotency_key: must be at most {IDEMPOTENCY_KEY_BYTES_MAX} bytes"),
                );
            }
        }
        let jobs = match self.prepare_submission(index, spec, identity) {
            Ok(jobs) => jobs,
            Err(refused) => return refused,
        };
        let first_id = self.next_job_id;
        let mut events = Vec::with_capacity(jobs.len());
        for job in jobs {
            let job_id = job.id;
            self.next_job_id = self.next_job_id.saturating_add(1);
            for d in &job.deps_pending {
                self.dependents.entry(d.job_id).or_default().insert(job_id);
            }
            self.jobs.insert(job_id, job);
            self.pending.insert(job_id);
            self.count_active(job_id, true);
            events.push(JobEvent {
                index,
                job_id,
                state: JobState::Pending,
                attempt: 0,
                reason: String::new(),
                suspended: None,
                step: None,
                usage: false,
            });
        }
        // Dependencies already met (a job that already started, say) settle now.
        let ids: Vec<JobId> = (first_id..self.next_job_id).collect();
        events.extend(self.settle_new(index, &ids));
        if !key.is_empty() {
            self.remember_idempotency_key(identity, key, first_id);
        }
        Applied { outcome: Outcome::Submitted { job_id: first_id, duplicate: false }, events }
    }

    /// The jobs a submission would create (one, or one per array element),
    /// with the ids they would get, or the refusal: every check `apply` makes
    /// on a submission, without changing anything. `apply` inserts them;
    /// `gangway submit --test-only` explains the first without a copy of the
    /// state.
    pub fn prepare_submission(&self, index: u64, spec: &JobSpec, identity: &str) -> Result<Vec<Job>, Applied> {
        // The spec as submitted, as the API edge checked it (defaults filled
        // in below add a few names, never enough to matter).
        if self.format >= 5 {
            if let Err(e) = crate::limits::check_spec_size(spec) {
                return Err(Applied::refused(RefusalKind::InvalidArgument, e.to_string()));
            }
        }
        if let Some(why) = self.accounting_backlog_full() {
            return Err(Applied::refused(RefusalKind::ResourceExhausted, why));
        }
        let spec = match self.resolve_spec(spec, identity) {
            Ok(s) => s,
            Err(e) => return Err(Applied::refused(RefusalKind::InvalidArgument, e.to_string())),
        };
        let array = if spec.array.is_empty() {
            None
        } else {
            match parse_array(&spec.array) {
                Ok(a) => Some(a),
                Err(e) => return Err(Applied::refused(RefusalKind::InvalidArgument, e.to_string())),
            }
        };
        let count = array.as_ref().map_or(1, |a| a.indexes.len());
        // Format 4 estimated a spec leaving fields out (one submit with a long
        // --exclude could copy gigabytes); format 5 counts every field.
        let spec_bytes = if self.format >= 5 { spec.size_bytes() } else { spec.approx_bytes() };
        if count > 1 && spec_bytes.saturating_mul(count) > ARRAY_SPEC_BYTES_MAX {
            return Err(Applied::refused(
                RefusalKind::InvalidArgument,
                format!("array: {count} copies of this job exceed {ARRAY_SPEC_BYTES_MAX} bytes; use fewer elements or a smaller script"),
            ));
        }
        if self.pending.len().saturating_add(self.running.len()).saturating_add(count) > ACTIVE_JOBS_MAX {
            return Err(Applied::refused(
                RefusalKind::ResourceExhausted,
                format!("the cluster holds {ACTIVE_JOBS_MAX} unfinished jobs, its limit; retry later"),
            ));
        }
        if let Some(why) = self.submit_limit_exceeded(&spec, count as u64) {
            return Err(Applied::refused(RefusalKind::ResourceExhausted, why));
        }
        if self.format >= 5 {
            if let Some(why) = self.budget_exceeded(&spec.user, spec_bytes, count) {
                return Err(Applied::refused(RefusalKind::ResourceExhausted, why));
            }
        }
        let first_id = self.next_job_id;
        // Resolve every element's dependencies before creating any job.
        let mut per_element_deps = Vec::with_capacity(count);
        let mut elements: BTreeMap<JobId, BTreeMap<u32, JobId>> = BTreeMap::new();
        // Each element's array index (None: not an array, one job).
        let element_indexes: Vec<Option<u32>> = match &array {
            Some(a) => a.indexes.iter().copied().map(Some).collect(),
            None => vec![None],
        };
        for &my_index in &element_indexes {
            match self.resolve_dependencies(&spec.dependencies, my_index, &mut elements) {
                Ok(d) => per_element_deps.push(d),
                Err(e) => return Err(Applied::refused(RefusalKind::InvalidArgument, e.to_string())),
            }
        }
        let mut jobs = Vec::with_capacity(count);
        for (k, (deps, my_index)) in per_element_deps.into_iter().zip(element_indexes).enumerate() {
            let job_id = first_id.saturating_add(k as u64);
            let mut element_spec = spec.clone();
            element_spec.dependencies = deps.clone();
            let job = Job {
                id: job_id,
                submitted_by: identity.to_string(),
                submit_time_ms: self.clock_ms,
                submit_index: index,
                array: array.as_ref().zip(my_index).map(|(a, index)| ArrayElement {
                    array_job_id: first_id,
                    index,
                    count: u32::try_from(count).unwrap_or(u32::MAX),
                    throttle: a.throttle,
                }),
                deps_pending: deps,
                held: spec.hold.then_some(crate::model::HoldKind::User),
                spec: element_spec,
                ..Job::default()
            };
            jobs.push(job);
        }
        Ok(jobs)
    }

    /// Validates a submission and fills in what the policy decides: partition,
    /// account, QOS, time limit and memory.
    pub fn resolve_spec(&self, spec: &JobSpec, identity: &str) -> Result<JobSpec, SpecError> {
        spec.validate_in(self.format)?;
        let policy = &self.policy;
        let mut s = spec.clone();
        let account = policy.resolve_account(&spec.user, &spec.account)?;
        s.account = account.to_string();
        let (_, part) = policy.resolve_partition(&spec.partition)?;
        s.qos = if !spec.qos.is_empty() {
            spec.qos.clone()
        } else if !part.default_qos.is_empty() {
            part.default_qos.clone()
        } else {
            DEFAULT_QOS.to_string()
        };
        if !policy.qos_exists(&s.qos) {
            return Err(SpecError::new("qos", format!("'{}' does not exist", s.qos)));
        }
        let qos = policy.qos_of(&s.qos);
        if s.time_limit_s == 0 {
            s.time_limit_s = if part.default_time_s > 0 { part.default_time_s } else { TIME_LIMIT_S_DEFAULT };
            // A heterogeneous job's default fits every component's partition.
            let others = s.components.iter().filter_map(|c| policy.resolve_partition(&c.partition).ok());
            let maxima = [part.max_time_s, qos.max_time_s].into_iter().chain(others.map(|(_, p)| p.max_time_s));
            for max in maxima {
                if max > 0 {
                    s.time_limit_s = s.time_limit_s.min(max);
                }
            }
        }
        if qos.max_time_s > 0 && s.time_limit_s > qos.max_time_s {
            return Err(SpecError::new(
                "time_limit_s",
                format!("{} s exceeds QOS {}'s maximum of {} s", s.time_limit_s, s.qos, qos.max_time_s),
            ));
        }
        self.resolve_shape(&mut s)?;
        // A heterogeneous job's further components: each in its partition.
        let mut components = Vec::with_capacity(s.components.len());
        for k in 1..s.het_size() {
            let mut c = s.component_shape(k);
            self.resolve_shape(&mut c).map_err(|e| SpecError::new(&format!("components[{k}].{}", e.field), e.rule))?;
            components.push(HetComponent::of(&c));
        }
        s.components = components;
        // Slurm's wording for both: "Invalid license specification", "Requested reservation is invalid".
        for (name, &want) in &s.licenses {
            let Some(&total) = policy.licenses.get(name) else {
                let known: Vec<&str> = policy.licenses.keys().map(String::as_str).collect();
                return Err(SpecError::new(
                    "licenses",
                    format!(
                        "invalid license specification: '{name}' is not a license of this cluster (licenses: {})",
                        if known.is_empty() { "none defined".to_string() } else { known.join(", ") }
                    ),
                ));
            };
            if want > total {
                return Err(SpecError::new(
                    "licenses",
                    format!("invalid license specification: {want} of {name} asked, the cluster has {total}"),
                ));
            }
        }
        if !s.reservation.is_empty() {
            let Some(r) = self.reservations.get(&s.reservation).filter(|r| r.window(self.clock_ms).is_some()) else {
                return Err(SpecError::new(
                    "reservation",
                    format!("requested reservation is invalid: {} does not exist", s.reservation),
                ));
            };
            if !r.admits(&s.user, &s.account, self.is_admin(identity)) {
                return Err(SpecError::new(
                    "reservation",
                    format!(
                        "access denied to requested reservation {} (user {}, account {})",
                        r.name, s.user, s.account
                    ),
                ));
            }
        }
        if s.time_min_s > s.time_limit_s {
            return Err(SpecError::new("time_min_s", "must not exceed the time limit"));
        }
        if s.deadline_ms > 0 && s.deadline_ms <= self.clock_ms.max(s.begin_ms) {
            return Err(SpecError::new(
                "deadline_ms",
                if s.deadline_ms <= self.clock_ms { "is in the past" } else { "must be after the begin time" },
            ));
        }
        if !s.topology.level.is_empty() && self.topology_depth(&s.topology.level).is_none() {
            let levels = policy.topology_levels.join(", ");
            return Err(SpecError::new(
                "topology.level",
                format!(
                    "'{}' is not a topology level of this cluster (levels: {})",
                    s.topology.level,
                    if levels.is_empty() { "none defined" } else { &levels }
                ),
            ));
        }
        if s.nice < 0 && !self.is_operator(identity) {
            return Err(SpecError::new("nice", "only operators and admins may set a negative nice value"));
        }
        if s.dependencies.iter().any(|d| d.kind == DependencyKind::AfterCorr) && s.array.is_empty() {
            return Err(SpecError::new("dependency", "aftercorr needs the job to be an array (--array)"));
        }
        Ok(s)
    }

    /// Fills in and checks what a job's partition decides about one
    /// component's shape (the whole job's, for an ordinary one): the
    /// partition's name, the accounts it allows, its longest time and
    /// largest gang, and memory defaults.
    fn resolve_shape(&self, s: &mut JobSpec) -> Result<(), SpecError> {
        let policy = &self.policy;
        let asked = std::mem::take(&mut s.partition);
        let (part_name, part) = policy.resolve_partition(&asked)?;
        s.partition = part_name.to_string();
        let account = s.account.as_str();
        if !part.allow_accounts.is_empty() && !part.allow_accounts.iter().any(|a| policy.is_under(account, a)) {
            return Err(SpecError::new(
                "account",
                format!(
                    "account '{account}' may not use partition {part_name} (allowed: {})",
                    part.allow_accounts.join(", ")
                ),
            ));
        }
        if part.max_time_s > 0 && s.time_limit_s > part.max_time_s {
            return Err(SpecError::new(
                "time_limit_s",
                format!("{} s exceeds partition {part_name}'s maximum of {} s", s.time_limit_s, part.max_time_s),
            ));
        }
        if part.max_nodes > 0 && s.nodes > part.max_nodes {
            return Err(SpecError::new(
                "nodes",
                format!("{} nodes exceed partition {part_name}'s maximum of {}", s.nodes, part.max_nodes),
            ));
        }
        if part.max_nodes > 0 {
            s.nodes_max = s.nodes_max().min(part.max_nodes);
        }
        if s.mem_per_node_mb == 0 {
            let cpus = u64::from(s.cpus_per_node());
            s.mem_per_node_mb = if s.mem_per_cpu_mb > 0 {
                cpus.saturating_mul(s.mem_per_cpu_mb)
            } else if s.gpus_per_node > 0 && part.default_mem_per_gpu_mb > 0 {
                u64::from(s.gpus_per_node).saturating_mul(part.default_mem_per_gpu_mb)
            } else {
                cpus.saturating_mul(part.default_mem_per_cpu_mb)
            };
            s.mem_per_cpu_mb = 0;
            if s.mem_per_node_mb > MEM_PER_NODE_MB_MAX {
                return Err(SpecError::new(
                    "mem_per_cpu_mb",
                    format!("memory per node would exceed {MEM_PER_NODE_MB_MAX} MiB"),
                ));
            }
        }
        Ok(())
    }

    /// The first submit limit (max_submitted_jobs of the account tree, the user,
    /// the QOS per user) that `count` more jobs would exceed.
    fn submit_limit_exceeded(&self, spec: &JobSpec, count: u64) -> Option<String> {
        let policy = &self.policy;
        let mut checks: Vec<(UseKey, Option<u32>, String)> = Vec::new();
        for a in policy.lineage(&spec.account) {
            let q = policy.accounts.get(a).and_then(|acc| acc.quota.max_submitted_jobs);
            checks.push((UseKey::Account(a.to_string()), q, format!("account {a}")));
        }
        let uq = policy.users.get(&spec.user).and_then(|u| u.quota.max_submitted_jobs);
        checks.push((UseKey::User(spec.user.clone()), uq, format!("user {}", spec.user)));
        let qq = policy.qos.get(&spec.qos).and_then(|q| q.per_user.max_submitted_jobs);
        checks.push((UseKey::QosUser(spec.qos.clone(), spec.user.clone()), qq, format!("QOS {} per user", spec.qos)));
        for (key, max, who) in checks {
            let Some(max) = max else { continue };
            let now = self.active_jobs.get(&key).copied().unwrap_or(0);
            if now.saturating_add(count) > u64::from(max) {
                return Some(format!(
                    "max_submitted_jobs: {who} may have {max} unfinished jobs; it has {now} and this adds {count}"
                ));
            }
        }
        None
    }

    /// Resolves dependencies to concrete job ids (array elements, aftercorr),
    /// refusing ones that name unknown jobs or can already never be met.
    /// `my_index` is this element's array index (aftercorr pairs by index).
    fn resolve_dependencies(
        &self,
        deps: &[Dependency],
        my_index: Option<u32>,
        elements: &mut BTreeMap<JobId, BTreeMap<u32, JobId>>,
    ) -> Result<Vec<Dependency>, SpecError> {
        let mut out: Vec<Dependency> = Vec::with_capacity(deps.len());
        for d in deps {
            let target = self.jobs.get(&d.job_id).ok_or_else(|| {
                let why = if d.job_id < self.next_job_id { "was purged from the queue" } else { "does not exist" };
                SpecError::new("dependency", format!("job {} {why}", d.job_id))
            })?;
            let head = target.array.map(|a| a.array_job_id);
            if head.is_some_and(|h| h != d.job_id) && (d.array_index.is_some() || d.kind == DependencyKind::AfterCorr) {
                return Err(SpecError::new(
                    "dependency",
                    format!("job {} is an array element; name the array ({})", d.job_id, head.unwrap_or(0)),
                ));
            }
            let element_index = match d.kind {
                DependencyKind::AfterCorr => {
                    if target.array.is_none() {
                        return Err(SpecError::new(
                            "dependency",
                            format!("aftercorr: job {} is not an array", d.job_id),
                        ));
                    }
                    my_index
                }
                _ => d.array_index,
            };
            let kind = if d.kind == DependencyKind::AfterCorr { DependencyKind::AfterOk } else { d.kind };
            let resolved = match element_index {
                Some(i) => {
                    let index = elements.entry(d.job_id).or_insert_with(|| self.array_elements(d.job_id));
                    let Some(&el) = index.get(&i) else {
                        if d.kind == DependencyKind::AfterCorr {
                            // No corresponding element: nothing to wait for (Slurm's behaviour).
                            continue;
                        }
                        return Err(SpecError::new("dependency", format!("array {} has no index {i}", d.job_id)));
                    };
                    Dependency { kind, job_id: el, array_index: Some(i) }
                }
                None => Dependency { kind, job_id: d.job_id, array_index: None },
            };
            if self.dependency_status(&resolved) == DepStatus::Never {
                let (shown, ended) = self
                    .jobs
                    .get(&resolved.job_id)
                    .map_or((resolved.job_id.to_string(), ""), |t| (t.display_id(), t.state.as_str()));
                return Err(SpecError::new(
                    "dependency",
                    format!("{}:{} can never be met (job {shown} ended {ended})", resolved.kind.as_str(), d.job_id),
                ));
            }
            if !out.contains(&resolved) {
                out.push(resolved);
            }
        }
        Ok(out)
    }

    /// Array index → job id for the array whose first job is `array_job_id`.
    pub fn array_elements(&self, array_job_id: JobId) -> BTreeMap<u32, JobId> {
        let Some(head) = self.jobs.get(&array_job_id).and_then(|j| j.array) else { return BTreeMap::new() };
        (array_job_id..array_job_id.saturating_add(u64::from(head.count)))
            .filter_map(|id| {
                let a = self.jobs.get(&id)?.array?;
                (a.array_job_id == array_job_id).then_some((a.index, id))
            })
            .collect()
    }

    /// Whether `identity` may change `job`: its owner, an operator or admin,
    /// or a coordinator of the job's account (or one above it).
    pub fn may_change(&self, job: &Job, identity: &str) -> bool {
        self.owns(job, identity) || self.is_operator(identity) || self.policy.coordinates(identity, &job.spec.account)
    }

    /// Whether `identity` owns `job`: the user the job runs as (after the
    /// policy's user map), or who submitted it.
    pub fn owns(&self, job: &Job, identity: &str) -> bool {
        let who = Identity::parse(identity);
        let user = self.policy.unix_user(who.name);
        // Before format 6 the rule had no agent exception: kept, so old and
        // new builds apply old entries alike.
        let person = self.format < ROLES_FORMAT || who.kind != IdentityKind::Agent;
        job.submitted_by == identity || (person && job.spec.user == user)
    }

    /// Admins are the identities and users the policy names, and the controller
    /// replicas themselves (`server:ID`, which only a server certificate
    /// yields). An empty list means no user is an admin: nothing is allowed by
    /// default; the first admin comes from the replicas' bootstrap.
    pub fn is_admin(&self, identity: &str) -> bool {
        let who = Identity::parse(identity);
        if who.kind == IdentityKind::Server {
            return true;
        }
        if self.format < ROLES_FORMAT {
            return self.policy.admins.iter().any(|a| a == identity || a == who.name);
        }
        self.policy.lists(&self.policy.admins, identity)
    }

    /// Operators, and admins (who may do all an operator may).
    pub fn is_operator(&self, identity: &str) -> bool {
        self.is_admin(identity) || self.policy.is_operator(identity)
    }

    /// The budget (see `limits`) that `count` more jobs of `spec_bytes` each
    /// for `user` would exceed, or None.
    fn budget_exceeded(&self, user: &str, spec_bytes: usize, count: usize) -> Option<String> {
        let jobs = self.active_jobs.get(&UseKey::User(user.to_string())).copied().unwrap_or(0);
        let mine = self.unfinished_bytes.get(user).copied().unwrap_or(0);
        let all = self.unfinished_bytes.get("").copied().unwrap_or(0);
        crate::limits::budget_exceeded(user, jobs, mine, all, spec_bytes, count)
    }

    /// Counts a job in (or out of) the unfinished-job counters of its account
    /// tree, user and QOS-user.
    pub(super) fn count_active(&mut self, job_id: JobId, add: bool) {
        let Some(job) = self.jobs.get(&job_id) else { return };
        let bytes = job.spec.size_bytes() as u64;
        if job.spec.deadline_ms > 0 {
            if add {
                self.deadline_jobs.insert(job_id);
            } else {
                self.deadline_jobs.remove(&job_id);
            }
        }
        if add {
            self.active_by_user.entry(job.spec.user.clone()).or_default().insert(job_id);
        } else if let Some(mine) = self.active_by_user.get_mut(&job.spec.user) {
            mine.remove(&job_id);
            if mine.is_empty() {
                self.active_by_user.remove(&job.spec.user);
            }
        }
        for who in [job.spec.user.clone(), String::new()] {
            let e = self.unfinished_bytes.entry(who.clone()).or_default();
            if add {
                *e = e.saturating_add(bytes);
            } else {
                // Saturating: this index is derived (check_invariants compares
                // it with a recount), and a drift must never stop every replica.
                *e = e.saturating_sub(bytes);
                if *e == 0 {
                    self.unfinished_bytes.remove(&who);
                }
            }
        }
        let keys = self.use_keys(job_id);
        for k in keys {
            let e = self.active_jobs.entry(k.clone()).or_default();
            if add {
                *e = e.saturating_add(1);
            } else {
                // Saturating, as above: check_invariants recounts these.
                *e = e.saturating_sub(1);
                if *e == 0 {
                    self.active_jobs.remove(&k);
                }
            }
        }
    }

    /// The counters a job's use is charged to.
    pub(super) fn use_keys(&self, job_id: JobId) -> Vec<UseKey> {
        self.jobs.get(&job_id).map(|job| self.use_keys_of(job)).unwrap_or_default()
    }

    /// The counters `job`'s use is charged to: its account and the account's
    /// ancestors, its user, its (QOS, user).
    pub fn use_keys_of(&self, job: &Job) -> Vec<UseKey> {
        let spec = &job.spec;
        let mut keys: Vec<UseKey> =
            self.policy.lineage(&spec.account).into_iter().map(|a| UseKey::Account(a.to_string())).collect();
        keys.push(UseKey::User(spec.user.clone()));
        keys.push(UseKey::QosUser(spec.qos.clone(), spec.user.clone()));
        keys
    }
}

/// Where one dependency stands.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum DepStatus {
    Satisfied,
    Waiting,
    Never,
}
