//! Scheduling: which pending jobs start where. A pure function of the state
//! (and the time), run by the leader and replayed by the simulator; `apply`
//! re-checks every placement (plans are optimistic).
//!
//! One pass:
//! ```text
//! view     = nodes in topology order + what each has free            (view.rs)
//! order    = pending jobs by partition tier, then multifactor priority (priority.rs)
//! for job in order:
//!     gates: held? dependencies? singleton? array throttle? quotas?  → reason
//!     shape already failed this pass?                                → skip in O(log n)
//!     place the whole gang now (tightest topology domain, best fit,
//!       not into what a reservation needs unless it ends first)       → placement
//!     else: the top job(s) get a reservation: the earliest time it
//!       fits as running jobs end (EASY backfill; depth from policy)   → holds on nodes
//! ```
//! The shape cache is what makes a pass over a million pending jobs cheap:
//! within one pass free resources only shrink and reservations only grow, so a
//! request shape that failed keeps failing for jobs at least as long.
//!
//! Related code: `explain.rs` (why one job waits), [`crate::sim`] (replays
//! traces through [`plan`]), [`crate::duties::leader_tick`] (the leader's
//! pass, which calls it), controller/src/leader/duties.rs (the loop).

use std::collections::{BTreeMap, BTreeSet};

use crate::command::{Placement, Preemption};
use crate::limits::ACTIVE_JOBS_MAX;
use crate::model::{HoldKind, Job, JobId, NodeAllocation};
use crate::policy::Use;
use crate::state::{State, UseKey};

mod explain;
mod preempt;
mod priority;
mod stages;
mod view;

pub use explain::{explain, explain_submission, Explanation};
pub use preempt::{VICTIMS_PER_JOB_MAX, VICTIM_CANDIDATES_MAX};
pub use priority::{fair_share, Factors, Prioritizer, Share, GPU_USAGE_WEIGHT};
use stages::{Budgets, ShapeCache, Verdict};
use view::{Free, Hold, Member, Miss, View};

/// Pending jobs examined per pass: every unfinished job may be pending.
pub const PENDING_EXAMINED_PER_PASS_MAX: usize = ACTIVE_JOBS_MAX;
/// Full placement attempts per pass (each scans every node): with the shape
/// cache most jobs never need one; this bounds a pass over a queue of all
/// different shapes.
pub const PLACE_ATTEMPTS_PER_PASS_MAX: usize = 20_000;
/// Gangs placed per plan: keeps one ApplySchedule entry small.
pub const PLACEMENTS_PER_PLAN_MAX: usize = 512;
/// Preemptors tried per pass (each tries up to VICTIM_CANDIDATES_MAX trial
/// placements).
pub const PREEMPT_ATTEMPTS_PER_PASS_MAX: usize = 16;
/// Jobs tried per pass on the up nodes plus powered-down pool nodes (each a
/// whole placement over the cluster, like a first attempt).
pub const WAKE_ATTEMPTS_PER_PASS_MAX: usize = 64;
/// Trial placements while sweeping future job ends for one reservation.
pub const RESERVATION_TRIES_MAX: usize = 256;
/// Shapes checked per pass for whether any node set could ever hold them,
/// beyond the reservation candidates (which are always checked): so a job that
/// can never run reads BadConstraints even deep in the queue, at a bounded cost
/// (one check is a walk over the nodes).
pub const POSSIBLE_CHECKS_PER_PASS_MAX: usize = 256;

/// How the queue is walked.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Policy {
    /// A job that does not fit is skipped and later jobs may start (no
    /// reservation: large jobs can wait long behind small ones).
    FirstFit,
    /// Strict order: nothing starts ahead of a job that does not fit.
    Fifo,
    /// EASY backfilling: the top job(s) that do not fit get a reservation at
    /// the earliest time enough resources free up (from running jobs' expected
    /// ends); later jobs start now only if they cannot delay it.
    Easy,
}

/// The order pending jobs are considered in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Order {
    /// Partition tier, then multifactor priority, then submit order.
    Priority,
    /// Submit order (what the scheduling literature calls FCFS).
    Submit,
}

/// Expected run time of a job, in seconds (default: its time limit).
pub type Estimator<'a> = &'a dyn Fn(&Job) -> u64;

/// Why a job a pass examined did not start, by the stage that stopped it
/// (gate → limits → place → power up → preempt → feasible → reserve, see
/// `Pass::consider`); `as_str` is
/// Slurm's reason code, as `squeue` shows it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub enum Pending {
    /// Gate: its previous attempt is still stopping somewhere.
    Completing,
    /// Gate: held, and by whom.
    Held(HoldKind),
    /// Gate: asked not to start yet (`--begin`).
    BeginTime,
    /// Gate: dependencies not met, or a singleton's namesake is running.
    Dependency,
    /// Gate: its array's throttle (`%N`) is reached.
    ArrayTaskLimit,
    /// Limits: its account tree's running quota.
    AssocGrpLimit,
    /// Limits: its user's running quota.
    AssocMaxLimit,
    /// Limits: its QOS's per-user quota.
    QosMaxPerUser,
    /// Feasible: no set of nodes could ever hold it (partition, features, sizes).
    BadConstraints,
    /// Place: enough nodes are free, but not within one required domain.
    Topology,
    /// Place: too little is free now (a top job: it may hold a reservation).
    Resources,
    /// Place: jobs ahead of it hold the reservations.
    Priority,
    /// Limits: the licenses it asks for are in use.
    Licenses,
    /// Limits: its account (or one above it) holds its license limit.
    AssocGrpLicense,
    /// Limits: its QOS holds its license limit.
    QosGrpLicense,
    /// Gate: its advance reservation has not started (or has too little
    /// time left for the job).
    Reservation,
    /// Gate: its advance reservation is gone or does not admit it.
    ReservationDeleted,
    /// Gate: it can no longer end by its deadline (the leader ends it).
    Deadline,
}

impl Pending {
    pub fn as_str(self) -> &'static str {
        match self {
            Pending::Completing => "Completing",
            Pending::Held(h) => h.as_str(),
            Pending::BeginTime => "BeginTime",
            Pending::Dependency => "Dependency",
            Pending::ArrayTaskLimit => "JobArrayTaskLimit",
            Pending::AssocGrpLimit => "AssocGrpLimit",
            Pending::AssocMaxLimit => "AssocMaxLimit",
            Pending::QosMaxPerUser => "QOSMaxPerUser",
            Pending::BadConstraints => "BadConstraints",
            Pending::Topology => "Topology",
            Pending::Resources => "Resources",
            Pending::Priority => "Priority",
            Pending::Licenses => "Licenses",
            Pending::AssocGrpLicense => "AssocGrpLicense",
            Pending::QosGrpLicense => "QOSGrpLicense",
            Pending::Reservation => "Reservation",
            Pending::ReservationDeleted => "ReservationDeleted",
            Pending::Deadline => "DeadLine",
        }
    }
}

pub struct Options<'a> {
    pub policy: Policy,
    pub order: Order,
    pub now_ms: u64,
    pub estimate_s: Option<Estimator<'a>>,
    /// Requeued jobs whose previous attempt still has tasks running somewhere
    /// (see `duties::stopping_jobs`): they wait, so no job ever runs two
    /// attempts at once (Slurm keeps such a job COMPLETING).
    pub stopping: Option<&'a BTreeSet<JobId>>,
}

impl Options<'_> {
    pub fn new(policy: Policy, now_ms: u64) -> Options<'static> {
        Options { policy, order: Order::Priority, now_ms, estimate_s: None, stopping: None }
    }
}

/// A pass's result.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct Plan {
    pub placements: Vec<Placement>,
    pub preemptions: Vec<Preemption>,
    /// Why examined jobs did not start.
    pub reasons: Vec<(JobId, Pending)>,
    /// Reservations made: (job, expected start ms).
    pub reservations: Vec<(JobId, u64)>,
    pub examined: usize,
    pub place_attempts: usize,
}

/// The request shape a placement outcome depends on (besides the job's end).
#[derive(Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
struct ShapeKey<'a> {
    // Numbers first: most comparisons end before reaching the strings.
    gpus: u32,
    nodes: u32,
    cpus: u32,
    mem_mb: u64,
    nodes_max: u32,
    exclusive: bool,
    depth: Option<usize>,
    /// A required level can make a shape impossible; a preferred one cannot.
    required: bool,
    partition: &'a str,
    gpu_type: &'a str,
    constraints: &'a [String],
    nodelist: &'a [String],
    exclude: &'a [String],
    /// With advance reservations, where a job may go depends on its
    /// reservation and (outside one) its shortest limit.
    reservation: &'a str,
    min_limit_s: u64,
    /// A heterogeneous job's further components (their shapes).
    components: &'a [crate::spec::HetComponent],
}

/// FNV-1a: a cheap, deterministic fingerprint for the shape cache (equal
/// fingerprints are confirmed by comparing the keys themselves).
fn fnv(h: u64, bytes: &[u8]) -> u64 {
    bytes.iter().fold(h, |h, b| (h ^ u64::from(*b)).wrapping_mul(0x100_0000_01b3))
}

impl<'a> ShapeKey<'a> {
    fn fingerprint(&self) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325;
        for n in [
            u64::from(self.gpus),
            u64::from(self.nodes),
            u64::from(self.cpus),
            self.mem_mb,
            u64::from(self.nodes_max),
            u64::from(self.exclusive),
            self.depth.map_or(u64::MAX, |d| d as u64),
            u64::from(self.required),
            self.min_limit_s,
        ] {
            h = fnv(h, &n.to_le_bytes());
        }
        h = fnv(fnv(h, self.partition.as_bytes()), &[0xff]);
        h = fnv(fnv(h, self.gpu_type.as_bytes()), &[0xff]);
        h = fnv(fnv(h, self.reservation.as_bytes()), &[0xfb]);
        for c in self.constraints {
            h = fnv(fnv(h, c.as_bytes()), &[0xfe]);
        }
        for (tag, names) in [(0xfd, self.nodelist), (0xfc, self.exclude)] {
            for n in names {
                h = fnv(fnv(h, n.as_bytes()), &[tag]);
            }
        }
        // Components are compared whole; their count tells them apart here.
        fnv(h, &(self.components.len() as u64).to_le_bytes())
    }

    fn of(job: &'a Job, depth: Option<usize>, reservations: bool) -> ShapeKey<'a> {
        let s = &job.spec;
        ShapeKey {
            reservation: &s.reservation,
            min_limit_s: if reservations { job.min_limit_s() } else { 0 },
            partition: &s.partition,
            gpu_type: &s.gpu_type,
            constraints: &s.constraints,
            nodelist: &s.nodelist,
            exclude: &s.exclude,
            exclusive: s.exclusive,
            nodes: s.nodes,
            nodes_max: s.nodes_max(),
            cpus: s.cpus_per_node(),
            mem_mb: s.mem_per_node_mb,
            gpus: s.gpus_per_node,
            depth,
            required: s.topology.required,
            components: &s.components,
        }
    }
}

/// The topology depth that must hold `job`'s gang now: a required level, or a
/// preferred one still within its wait.
pub(crate) fn required_depth(state: &State, job: &Job, now_ms: u64) -> Option<usize> {
    let t = &job.spec.topology;
    let depth = state.topology_depth(&t.level)?;
    let waited_ms = now_ms.saturating_sub(job.submit_time_ms);
    (t.required || waited_ms < t.wait_s.saturating_mul(1000)).then_some(depth)
}

struct Pass<'s, 'o> {
    state: &'s State,
    /// A job planned as if pending though not in the state (a test
    /// submission, see [`plan_with`]).
    extra: Option<&'s Job>,
    opts: &'o Options<'o>,
    view: View<'s>,
    free: Vec<Free>,
    holds: Vec<Option<Hold>>,
    node_index: BTreeMap<&'s str, usize>,
    /// Running (and planned) elements per array.
    array_running: BTreeMap<JobId, u32>,
    /// (user, name) of running (and planned) jobs, for singleton.
    running_names: BTreeSet<(&'s str, &'s str)>,
    /// Use added by this plan's placements, per quota key.
    plan_use: BTreeMap<UseKey, Use>,
    /// License seats this plan's placements take.
    plan_licenses: BTreeMap<&'s str, u64>,
    /// Seats this pass promised, per account or QOS with a license limit.
    plan_license_scopes: BTreeMap<(crate::policy::LicenseScope, &'s str), u64>,
    /// Nodes by free GPU count (index = free GPUs): single-node jobs take the
    /// best fit from the first bucket that holds a fitting node instead of
    /// scanning every node.
    buckets: Vec<BTreeSet<usize>>,
    /// Free CPUs and GPUs left in the whole cluster (cheap bounds before placing).
    free_cpus: u64,
    free_gpus: u64,
    /// Reservations made this pass: (expected start, expected end, where);
    /// later ones plan around them.
    reserved: Vec<(u64, u64, Vec<Member>)>,
    /// Accounts running beyond their own GPU quota on borrowed GPUs.
    borrowing: BTreeSet<&'s str>,
    /// Powered-down nodes of elastic pools and what each would have free:
    /// planned on only when the up nodes cannot hold a job (a boot is slow
    /// and costs), which moves them into `free`.
    dormant: BTreeMap<usize, Free>,
    cache: ShapeCache<'s>,
    budgets: Budgets,
    /// Some QOS may preempt, or some account borrows GPUs.
    can_preempt: bool,
    /// Some account, user or QOS has a quota.
    has_quotas: bool,
    /// Some advance reservation exists (shapes then differ by reservation).
    has_resv: bool,
    plan: Plan,
}

impl<'s, 'o> Pass<'s, 'o> {
    fn estimate_s(&self, job: &Job) -> u64 {
        match self.opts.estimate_s {
            Some(f) => f(job).clamp(1, job.spec.time_limit_s.max(1)),
            None => job.spec.time_limit_s,
        }
    }

    /// When a running job is expected to end (never before now). A
    /// suspended job's clock is paused: it is planned as if resumed now.
    fn running_end_ms(&self, job: &Job) -> u64 {
        let started = job.start_time_ms.unwrap_or(self.opts.now_ms);
        let start = started.saturating_add(job.suspended_total_ms(self.opts.now_ms));
        let limit_end = start.saturating_add(job.spec.time_limit_s.saturating_mul(1000));
        let est_end = start.saturating_add(self.estimate_s(job).saturating_mul(1000));
        // A job past its estimate runs until its limit at most.
        let end = if est_end > self.opts.now_ms { est_end } else { limit_end };
        end.max(self.opts.now_ms)
    }

    /// Stage 1, gate: what keeps `job` from starting whatever is free.
    fn gate(&self, job: &Job) -> Option<Pending> {
        if self.opts.stopping.is_some_and(|s| s.contains(&job.id)) {
            return Some(Pending::Completing);
        }
        if let Some(h) = job.held {
            return Some(Pending::Held(h));
        }
        if job.spec.begin_ms > self.opts.now_ms {
            return Some(Pending::BeginTime);
        }
        if job.spec.deadline_ms > 0 && job.deadline_missed(self.opts.now_ms) {
            return Some(Pending::Deadline);
        }
        if !job.spec.reservation.is_empty() {
            match self.state.reservation_gate(job, self.opts.now_ms) {
                Some(crate::state::ReservationWait::Deleted) => return Some(Pending::ReservationDeleted),
                Some(crate::state::ReservationWait::NotYet) => return Some(Pending::Reservation),
                None => {}
            }
            // Too little of the reservation is left for the job's shortest limit.
            let now = self.opts.now_ms;
            let end = self.state.reservations.get(&job.spec.reservation).and_then(|r| r.window(now)).map_or(0, |w| w.1);
            if now.saturating_add(job.min_limit_s().saturating_mul(1000)) > end {
                return Some(Pending::Reservation);
            }
        }
        if !job.deps_pending.is_empty() {
            return Some(Pending::Dependency);
        }
        if job.spec.singleton && self.running_names.contains(&(job.spec.user.as_str(), job.spec.name.as_str())) {
            return Some(Pending::Dependency);
        }
        if let Some(a) = job.array {
            if a.throttle > 0 && self.array_running.get(&a.array_job_id).copied().unwrap_or(0) >= a.throttle {
                return Some(Pending::ArrayTaskLimit);
            }
        }
        None
    }

    /// Stage 2, limits: the quota a placement of `extra` would exceed (state
    /// use + this plan's).
    fn quota(&self, job: &Job, extra: Use) -> Option<Pending> {
        self.state.quota_exceeded_with(job, extra, &self.plan_use).map(|why| {
            if why.starts_with("AssocGrp") {
                Pending::AssocGrpLimit
            } else if why.starts_with("AssocMax") {
                Pending::AssocMaxLimit
            } else {
                Pending::QosMaxPerUser
            }
        })
    }

    /// Stage 2, limits: whether the licenses `job` asks for are free (what
    /// running jobs and this plan's placements hold).
    fn licenses_free(&self, job: &Job) -> bool {
        job.spec.licenses.iter().all(|(name, &want)| {
            let total = u64::from(self.state.policy.licenses.get(name).copied().unwrap_or(0));
            let used = self.state.licenses_used.get(name).copied().unwrap_or(0);
            let used = used.saturating_add(self.plan_licenses.get(name.as_str()).copied().unwrap_or(0));
            used.saturating_add(u64::from(want)) <= total
        })
    }

    /// The account or QOS whose license limit keeps `job` from starting now
    /// (with what this pass already started).
    fn license_limit(&self, job: &Job) -> Option<crate::policy::LicenseScope> {
        if job.spec.licenses.is_empty() {
            return None;
        }
        let planned = |scope: &crate::policy::LicenseScope, name: &str| {
            self.plan_license_scopes.get(&(scope.clone(), name)).copied().unwrap_or(0)
        };
        self.state.license_limit_exceeded(job, &[], planned)?;
        // Which scope: the first one over, as apply would say it.
        self.state.policy.license_limits(&job.spec.account, &job.spec.qos).into_iter().find_map(|(scope, name, max)| {
            let want = u64::from(*job.spec.licenses.get(name)?);
            let key = (scope, name.to_string());
            let held = self.state.licenses_held.get(&key).copied().unwrap_or(0).saturating_add(planned(&key.0, name));
            (held.saturating_add(want) > u64::from(max)).then_some(key.0)
        })
    }

    /// Stage 6, feasible: whether enough nodes could ever hold `job`
    /// (ignoring what is in use; down and drained nodes count, they come
    /// back), within one domain of `depth` when that is required. The rules
    /// for one node are `crate::fit`, which `apply` shares.
    fn feasible(&self, job: &Job, depth: Option<usize>) -> bool {
        if !job.spec.components.is_empty() {
            // Each component on its own (they also need nodes of their own,
            // which placement finds out).
            return (0..job.spec.het_size()).all(|k| self.feasible(&job.component_job(k), depth));
        }
        let need = job.spec.nodes as usize;
        // A node list shorter than the gang: every listed node must exist
        // and be of the right kind (the others only complete it).
        let mut listed_domain = None;
        for name in &job.spec.nodelist {
            let Some(&i) = self.node_index.get(name.as_str()) else { return false };
            if self.view.hardware_reject(i, job).is_some() {
                return false;
            }
            if let Some(d) = depth.filter(|d| *d <= self.view.depth()) {
                let Some(dom) = self.view.domain_of(d, i) else { return false };
                if listed_domain.is_some_and(|l| l != dom) {
                    return false;
                }
                listed_domain = Some(dom);
            }
        }
        let ok = (0..self.view.nodes.len()).filter(|&i| self.view.hardware_reject(i, job).is_none());
        match depth {
            Some(d) if d <= self.view.depth() => {
                let mut per_domain: BTreeMap<usize, usize> = BTreeMap::new();
                for dom in ok.filter_map(|i| self.view.domain_of(d, i)) {
                    crate::incr(per_domain.entry(dom).or_default());
                }
                match listed_domain {
                    Some(l) => per_domain.get(&l).is_some_and(|&c| c >= need),
                    None => per_domain.values().any(|&c| c >= need),
                }
            }
            _ => ok.take(need).count() >= need,
        }
    }

    /// Whether `job` may preempt anything: its QOS names others, or it would
    /// take back GPUs a sibling account borrowed.
    fn may_preempt(&self, job: &Job) -> bool {
        let p = &self.state.policy;
        if p.qos.get(&job.spec.qos).is_some_and(|q| !q.preempt.is_empty()) {
            return true;
        }
        if self.borrowing.is_empty() {
            return false;
        }
        let parent = p.parent_of(&job.spec.account);
        self.borrowing.iter().any(|a| *a != job.spec.account && p.parent_of(a) == parent)
            && self.within_own_gpu_quota(job)
    }

    /// Where `job` would run with the powered-down nodes powered up too.
    fn place_waking(&self, job: &Job, depth: Option<usize>, end_ms: u64, held: bool) -> Option<Vec<Member>> {
        let mut trial = self.free.clone();
        for (&i, f) in &self.dormant {
            if let Some(t) = trial.get_mut(i) {
                *t = *f;
            }
        }
        let holds = held.then_some((self.holds.as_slice(), end_ms));
        self.view.place(job, &trial, holds, depth, self.opts.now_ms).ok()
    }

    /// Powers up the dormant nodes `members` name: their space joins `free`.
    fn wake(&mut self, members: &[Member]) {
        for m in members {
            if let Some(f) = self.dormant.remove(&m.node) {
                let Some(slot) = self.free.get_mut(m.node) else { continue };
                let before = std::mem::replace(slot, f);
                self.free_cpus = self.free_cpus.saturating_add(u64::from(f.cpus));
                self.free_gpus = self.free_gpus.saturating_add(u64::from(f.gpus.count_ones()));
                self.rebucket(m.node, before);
            }
        }
    }

    /// Moves node `i` to the bucket of what it has free now.
    /// (A free GPU count is at most 32 and there are 33 buckets.)
    fn rebucket(&mut self, i: usize, before: Free) {
        if let Some(b) = self.buckets.get_mut(before.gpus.count_ones() as usize) {
            b.remove(&i);
        }
        let Some(f) = self.free.get(i) else { return };
        if f.cpus > 0 {
            if let Some(b) = self.buckets.get_mut(f.gpus.count_ones() as usize) {
                b.insert(i);
            }
        }
    }

    /// Best fit for a one-node job: the first fitting node in the bucket with
    /// the fewest free GPUs that can hold it.
    fn place_single(&self, job: &Job, holds: Option<(&[Option<Hold>], u64)>) -> Result<Vec<Member>, Miss> {
        let s = &job.spec;
        for bucket in self.buckets.iter().skip(s.gpus_per_node as usize) {
            for &i in bucket {
                let (Some(f), Some(n)) = (self.free.get(i), self.view.nodes.get(i)) else { continue };
                if f.cpus < s.cpus_per_node() || f.mem_mb < s.mem_per_node_mb || !self.view.static_ok(i, job) {
                    continue;
                }
                let Some(m) = self.view.fit(i, job, f, view::type_mask(n, &s.gpu_type)) else { continue };
                if let Some((holds, end_ms)) = holds {
                    if !Hold::allows(holds.get(i).and_then(Option::as_ref), &m, end_ms) {
                        continue;
                    }
                }
                return Ok(vec![m]);
            }
        }
        Err(Miss::Resources)
    }

    /// Adds `job` on `members` to the plan (nothing when a member's node is
    /// not in the view).
    fn record(&mut self, job: &'s Job, members: Vec<Member>, end_ms: u64) {
        let nodes: Option<Vec<NodeAllocation>> = members
            .iter()
            .map(|m| {
                Some(NodeAllocation {
                    node: self.view.nodes.get(m.node)?.name.clone(),
                    cpus: m.cpus,
                    mem_mb: m.mem_mb,
                    gpus: (0..32).filter(|b| m.gpus & (1 << b) != 0).collect(),
                })
            })
            .collect();
        let Some(nodes) = nodes else { return };
        // What a job outliving a reservation takes comes out of that reservation's spare.
        for m in &members {
            if let Some(h) = self.holds.get_mut(m.node).and_then(Option::as_mut).filter(|h| end_ms > h.until_ms) {
                h.spare_cpus = h.spare_cpus.saturating_sub(m.cpus);
                h.spare_mem_mb = h.spare_mem_mb.saturating_sub(m.mem_mb);
                h.spare_gpus = h.spare_gpus.saturating_sub(m.gpus.count_ones());
            }
        }
        let before: Vec<Free> = members.iter().map(|m| self.free.get(m.node).copied().unwrap_or_default()).collect();
        View::take(&mut self.free, &members);
        for (m, b) in members.iter().zip(before) {
            self.rebucket(m.node, b);
        }
        self.free_cpus = self.free_cpus.saturating_sub(members.iter().map(|m| u64::from(m.cpus)).sum());
        self.free_gpus = self.free_gpus.saturating_sub(members.iter().map(|m| u64::from(m.gpus.count_ones())).sum());
        let u = view::members_use(&members);
        for k in self.state.use_keys_of(job) {
            self.plan_use.entry(k).or_default().add(u);
        }
        if let Some(a) = job.array {
            crate::incr(self.array_running.entry(a.array_job_id).or_default());
        }
        self.running_names.insert((job.spec.user.as_str(), job.spec.name.as_str()));
        for (name, &n) in &job.spec.licenses {
            let e = self.plan_licenses.entry(name.as_str()).or_default();
            *e = e.saturating_add(u64::from(n));
        }
        for (scope, name, _) in self.state.policy.license_limits(&job.spec.account, &job.spec.qos) {
            if let Some((name, &n)) = job.spec.licenses.get_key_value(name) {
                let e = self.plan_license_scopes.entry((scope, name.as_str())).or_default();
                *e = e.saturating_add(u64::from(n));
            }
        }
        self.plan.placements.push(Placement { job_id: job.id, attempt: job.attempt.saturating_add(1), nodes });
    }

    /// The earliest time `job` fits as running and planned jobs end, and where:
    /// marks holds on those nodes. Returns the expected start.
    fn reserve(&mut self, job: &Job, depth: Option<usize>) -> Option<u64> {
        let now = self.opts.now_ms;
        let mut events: Vec<(u64, usize, u32, u64, u32)> = Vec::new();
        for j in self.state.running.iter().filter_map(|id| self.state.jobs.get(id)) {
            let end = self.running_end_ms(j);
            for na in j.allocation.iter().flat_map(|a| a.nodes.iter()) {
                if let Some(&i) = self.node_index.get(na.node.as_str()) {
                    let mask = view::gpu_mask(&na.gpus);
                    events.push((end, i, na.cpus, na.mem_mb, mask));
                }
            }
        }
        for p in &self.plan.placements {
            let Some(j) = self.extra.filter(|e| e.id == p.job_id).or_else(|| self.state.jobs.get(&p.job_id)) else {
                continue;
            };
            let end = now.saturating_add(self.estimate_s(j).saturating_mul(1000));
            for na in &p.nodes {
                if let Some(&i) = self.node_index.get(na.node.as_str()) {
                    let mask = view::gpu_mask(&na.gpus);
                    events.push((end, i, na.cpus, na.mem_mb, mask));
                }
            }
        }
        // Earlier reservations of this pass take their nodes at their start
        // and give them back at their expected end.
        let mut takes: Vec<(u64, usize, u32, u64, u32)> = Vec::new();
        for (start, end, members) in &self.reserved {
            for m in members {
                takes.push((*start, m.node, m.cpus, m.mem_mb, m.gpus));
                events.push((*end, m.node, m.cpus, m.mem_mb, m.gpus));
            }
        }
        // An advance reservation's end is a time its nodes may take the job.
        for (i, resv) in self.view.node_resv.iter().enumerate() {
            for w in resv.iter().filter_map(|r| r.window(now)) {
                events.push((w.1, i, 0, 0, 0));
            }
        }
        events.sort_unstable_by_key(|e| (e.0, e.1));
        takes.sort_unstable_by_key(|e| (e.0, e.1));
        // Up and of the right kind; advance reservations are asked at each
        // candidate start (a node reserved now may be free later).
        let statics: Vec<bool> = self
            .view
            .nodes
            .iter()
            .enumerate()
            .map(|(i, n)| n.state.takes_work() && self.view.hardware_reject(i, job).is_none())
            .collect();
        let s = &job.spec;
        let fits = |f: &Free| {
            f.cpus >= s.cpus_per_node() && f.mem_mb >= s.mem_per_node_mb && f.gpus.count_ones() >= s.gpus_per_node
        };
        // Node `i` is of the right kind and could take a member (an unknown node cannot).
        let fits_at = |future: &[Free], i: usize| statics.get(i) == Some(&true) && future.get(i).is_some_and(fits);
        let mut future = self.free.clone();
        let mut fit_count = (0..future.len()).filter(|&i| fits_at(&future, i)).count();
        let mut tries = 0;
        let (mut k, mut next_take) = (0, 0);
        while (k < events.len() || next_take < takes.len()) && tries < RESERVATION_TRIES_MAX {
            let t = match (events.get(k), takes.get(next_take)) {
                (Some(e), Some(x)) => e.0.min(x.0),
                (Some(e), None) => e.0,
                (None, Some(x)) => x.0,
                (None, None) => break,
            };
            // Ends first, then starts, at the same instant.
            while let Some(&(_, i, cpus, mem, gpus)) = events.get(k).filter(|e| e.0 == t) {
                let before = fits_at(&future, i);
                self.view.give(&mut future, i, cpus, mem, gpus);
                if !before && fits_at(&future, i) {
                    crate::incr(&mut fit_count);
                }
                crate::incr(&mut k);
            }
            while let Some(&(_, i, cpus, mem, gpus)) = takes.get(next_take).filter(|x| x.0 <= t) {
                let before = fits_at(&future, i);
                if let Some(f) = future.get_mut(i) {
                    f.cpus = f.cpus.saturating_sub(cpus);
                    f.mem_mb = f.mem_mb.saturating_sub(mem);
                    f.gpus &= !gpus;
                }
                if before && !fits_at(&future, i) {
                    fit_count = fit_count.saturating_sub(1);
                }
                crate::incr(&mut next_take);
            }
            if fit_count < s.nodes as usize {
                continue;
            }
            crate::incr(&mut tries);
            // Advance reservations are checked for a start at `t`.
            if let Ok(members) = self.view.place(job, &future, None, depth, t) {
                for m in &members {
                    let (Some(f), Some(slot)) = (future.get(m.node), self.holds.get_mut(m.node)) else { continue };
                    let h = Hold {
                        until_ms: t,
                        spare_cpus: f.cpus.saturating_sub(m.cpus),
                        spare_mem_mb: f.mem_mb.saturating_sub(m.mem_mb),
                        spare_gpus: (f.gpus & !m.gpus).count_ones(),
                    };
                    *slot = Some(match slot.take() {
                        None => h,
                        Some(o) => Hold {
                            until_ms: o.until_ms.min(h.until_ms),
                            spare_cpus: o.spare_cpus.min(h.spare_cpus),
                            spare_mem_mb: o.spare_mem_mb.min(h.spare_mem_mb),
                            spare_gpus: o.spare_gpus.min(h.spare_gpus),
                        },
                    });
                }
                let end = t.saturating_add(self.estimate_s(job).saturating_mul(1000));
                self.reserved.push((t, end, members));
                return Some(t);
            }
        }
        None
    }
}

/// Pending jobs in submit order (at most PENDING_EXAMINED_PER_PASS_MAX). When
/// most kept jobs are pending, one sequential walk over all jobs is far cheaper
/// than a tree lookup per pending id.
fn pending_jobs(state: &State) -> Vec<&Job> {
    let n = state.pending.len().min(PENDING_EXAMINED_PER_PASS_MAX);
    if n.saturating_mul(4) >= state.jobs.len() {
        state.jobs.values().filter(|j| j.state == crate::model::JobState::Pending).take(n).collect()
    } else {
        state.pending.iter().take(n).filter_map(|id| state.jobs.get(id)).collect()
    }
}

/// Computes one pass's plan.
pub fn plan(state: &State, opts: &Options) -> Plan {
    plan_with(state, opts, None)
}

/// Computes one pass's plan as if `extra`, a job not in the state (with an
/// id the state has not used), were pending too: a submission's outcome
/// without applying it to a copy of the state.
///
/// Each pending job, in queue order, goes through the stages of
/// [`Pass::consider`] until one stops it, which gives its [`Pending`]
/// reason, as Nomad's feasibility → rank → select stack reads.
pub fn plan_with<'s>(state: &'s State, opts: &Options, extra: Option<&'s Job>) -> Plan {
    let mut pass = Pass::new(state, opts, extra);
    // Priorities are only needed to order the queue and to rank victims.
    let prio = (opts.order == Order::Priority || pass.can_preempt).then(|| Prioritizer::new(state, opts.now_ms));
    for job in queue(state, opts, extra, prio.as_ref()) {
        if pass.plan.placements.len() >= PLACEMENTS_PER_PLAN_MAX || pass.full() {
            break;
        }
        crate::incr(&mut pass.plan.examined);
        match pass.consider(job, prio.as_ref()) {
            Verdict::Started => {}
            Verdict::Waits(why) => pass.plan.reasons.push((job.id, why)),
            Verdict::BlocksQueue(why) => {
                pass.plan.reasons.push((job.id, why));
                break;
            }
        }
    }
    pass.plan
}

/// The pending jobs (and `extra`) in the order a pass considers them: by
/// partition tier and priority, or in submit order, walked lazily (FIFO
/// often stops at the first job).
fn queue<'s>(
    state: &'s State,
    opts: &Options,
    extra: Option<&'s Job>,
    prio: Option<&Prioritizer>,
) -> Box<dyn Iterator<Item = &'s Job> + 's> {
    match (prio, opts.order) {
        (Some(prio), Order::Priority) => {
            let mut keyed: Vec<(u32, f64, &Job)> = pending_jobs(state)
                .into_iter()
                .chain(extra)
                .map(|j| {
                    let (t, p) = prio.key(j);
                    (t, p, j)
                })
                .collect();
            keyed.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(b.1.total_cmp(&a.1)).then(a.2.id.cmp(&b.2.id)));
            Box::new(keyed.into_iter().map(|k| k.2))
        }
        _ => Box::new(
            state.pending.iter().take(PENDING_EXAMINED_PER_PASS_MAX).filter_map(|id| state.jobs.get(id)).chain(extra),
        ),
    }
}

#[cfg(test)]
mod tests;
