//! The stages one job goes through in a pass ([`Pass::consider`]): gate,
//! limits, place, power up, preempt, feasible, reserve, each a method that
//! may stop it with its [`Pending`] reason, as Nomad's feasibility → rank →
//! select stack reads; with the shape cache and the pass's budgets as types
//! of their own.
//!
//! Related code: `mod.rs` (the pass's state and the stages' building
//! blocks: `gate`, `quota`, `feasible`, `place_single`, `record`,
//! `reserve`), `preempt.rs` (the victim search).

use std::collections::{BTreeMap, BTreeSet};

use super::*;
use crate::state::{State, UseKey};

/// What the stages made of one job.
pub(super) enum Verdict {
    /// Placed: it starts with this plan.
    Started,
    /// It waits, for this reason; later jobs are considered.
    Waits(Pending),
    /// It waits, and nothing behind it may start (FIFO).
    BlocksQueue(Pending),
}

/// Request shapes that failed to place this pass. Within one pass free
/// resources only shrink and reservations only grow, so a shape that failed
/// keeps failing for jobs at least as long: a pass over a million pending
/// jobs of a few shapes places each shape once.
#[derive(Default)]
pub(super) struct ShapeCache<'s> {
    /// Fingerprint → [(shape, shortest run estimate that failed, why)].
    failed: BTreeMap<u64, Vec<(ShapeKey<'s>, u64, Miss)>>,
}

impl<'s> ShapeCache<'s> {
    /// Why `key` will fail for a job expected to run `est_s`, if it will.
    fn known(&self, fp: u64, key: &ShapeKey<'s>, est_s: u64) -> Option<Miss> {
        let same = self.failed.get(&fp)?;
        same.iter().find(|(k, _, _)| k == key).filter(|(_, l, _)| est_s >= *l).map(|(_, _, m)| *m)
    }

    /// Records that `key` failed for a job expected to run `est_s`.
    fn remember(&mut self, fp: u64, key: ShapeKey<'s>, est_s: u64, miss: Miss) {
        let same = self.failed.entry(fp).or_default();
        match same.iter_mut().find(|(k, _, _)| *k == key) {
            Some(e) => *e = (key, e.1.min(est_s), miss),
            None => same.push((key, est_s, miss)),
        }
    }

    /// Records that no node set could ever hold `key`, however short.
    fn impossible(&mut self, fp: u64, key: &ShapeKey<'s>) {
        if let Some(e) = self.failed.get_mut(&fp).and_then(|v| v.iter_mut().find(|(k, _, _)| k == key)) {
            e.1 = 0;
            e.2 = Miss::Impossible;
        }
    }
}

/// What a pass may still spend on the costly stages (each a walk over the
/// nodes, or many): the per-pass limits, counted down.
pub(super) struct Budgets {
    /// Reservations a pass makes (EASY's depth; none for the others).
    reservations_max: usize,
    reservations_tried: usize,
    preempt_attempts: usize,
    wake_attempts: usize,
    possible_checks: usize,
}

/// One job's trip through the stages: what the pass knows of it so far.
struct Trial<'s> {
    /// Its required topology depth, if any.
    depth: Option<usize>,
    est_s: u64,
    /// When it would end if started now.
    end_ms: u64,
    /// More than the whole cluster has free: the cheapest test.
    too_big: bool,
    key: ShapeKey<'s>,
    fp: u64,
    /// The shape's failure this pass, if it failed already (or too big).
    known: Option<Miss>,
    /// A placement was attempted (not answered by the cache).
    attempted: bool,
}

impl<'s, 'o> Pass<'s, 'o> {
    pub(super) fn new(state: &'s State, opts: &'o Options<'o>, extra: Option<&'s Job>) -> Pass<'s, 'o> {
        let view = View::of(state, opts.now_ms);
        let free = view.free.clone();
        let node_index = view.nodes.iter().enumerate().map(|(i, n)| (n.name.as_str(), i)).collect();
        let mut array_running: BTreeMap<JobId, u32> = BTreeMap::new();
        let mut running_names = BTreeSet::new();
        for j in state.running.iter().filter_map(|id| state.jobs.get(id)) {
            if let Some(a) = j.array {
                crate::incr(array_running.entry(a.array_job_id).or_default());
            }
            running_names.insert((j.spec.user.as_str(), j.spec.name.as_str()));
        }
        // One bucket per free GPU count, 0 to 32.
        let mut buckets = vec![BTreeSet::new(); 33];
        for (i, f) in free.iter().enumerate().filter(|(_, f)| f.cpus > 0) {
            if let Some(b) = buckets.get_mut(f.gpus.count_ones() as usize) {
                b.insert(i);
            }
        }
        let mut borrowing = BTreeSet::new();
        for (name, a) in &state.policy.accounts {
            let used = state.running_use.get(&UseKey::Account(name.clone())).map_or(0, |u| u.gpus);
            if a.borrow_gpus > 0 && a.quota.max_running_gpus.is_some_and(|q| used > u64::from(q)) {
                borrowing.insert(name.as_str());
            }
        }
        let p = &state.policy;
        let reservations_max = if opts.policy == Policy::Easy { p.backfill_reservations.max(1) as usize } else { 0 };
        Pass {
            state,
            extra,
            opts,
            holds: vec![None; view.nodes.len()],
            dormant: view.dormant(),
            free_cpus: free.iter().map(|f| u64::from(f.cpus)).sum(),
            free_gpus: free.iter().map(|f| u64::from(f.gpus.count_ones())).sum(),
            view,
            free,
            node_index,
            array_running,
            running_names,
            plan_use: BTreeMap::new(),
            plan_licenses: BTreeMap::new(),
            plan_license_scopes: BTreeMap::new(),
            reserved: Vec::new(),
            borrowing,
            buckets,
            cache: ShapeCache::default(),
            budgets: Budgets {
                reservations_max,
                reservations_tried: 0,
                preempt_attempts: 0,
                wake_attempts: 0,
                possible_checks: 0,
            },
            can_preempt: p.qos.values().any(|q| !q.preempt.is_empty())
                || p.accounts.values().any(|a| a.borrow_gpus > 0),
            has_quotas: p.accounts.values().any(|a| !a.quota.is_empty())
                || p.users.values().any(|u| !u.quota.is_empty())
                || p.qos.values().any(|q| !q.per_user.is_empty()),
            has_resv: !state.reservations.is_empty(),
            plan: Plan::default(),
        }
    }

    /// A full cluster starts nothing more once the top jobs have their
    /// reservations (preemption and powering up aside): the rest keep their
    /// reasons.
    pub(super) fn full(&self) -> bool {
        self.free_cpus == 0
            && self.budgets.reservations_tried >= self.budgets.reservations_max
            && !self.can_preempt
            && self.dormant.is_empty()
    }

    /// One job through the stages, each of which may stop it: gate, limits,
    /// place (on what is free now), power up (a pool's powered-down nodes),
    /// preempt (evict victims for it), feasible (could any nodes ever hold
    /// it: asked only once placing and preempting failed, since it looks at
    /// every node), reserve (the top jobs' earliest starts, which later jobs
    /// backfill around).
    pub(super) fn consider(&mut self, job: &'s Job, prio: Option<&Prioritizer>) -> Verdict {
        if let Some(why) = self.gate(job).or_else(|| self.limits(job)) {
            return Verdict::Waits(why);
        }
        let mut trial = self.trial(job);
        let miss = match self.place_now(job, &mut trial) {
            Ok(members) => return self.start(job, members, trial.end_ms, false),
            Err(miss) => miss,
        };
        if let Some(verdict) = self.power_up(job, &trial, miss) {
            return verdict;
        }
        if let Some(verdict) = self.preempt_for(job, &trial, prio) {
            return verdict;
        }
        if !trial.too_big {
            self.cache.remember(trial.fp, trial.key, trial.est_s, miss);
        }
        self.wait_or_reserve(job, &trial, miss)
    }

    /// Stage 2, limits before resources (as Slurm reports them): licenses
    /// in use, license limits, and the quotas at the smallest the job can be.
    fn limits(&self, job: &Job) -> Option<Pending> {
        if !job.spec.licenses.is_empty() && !self.licenses_free(job) {
            return Some(Pending::Licenses);
        }
        if let Some(scope) = self.license_limit(job) {
            return Some(match scope {
                crate::policy::LicenseScope::Account(_) => Pending::AssocGrpLicense,
                crate::policy::LicenseScope::Qos(_) => Pending::QosGrpLicense,
            });
        }
        let min = Use { gpus: job.gpus(), cpus: job.cpus(), jobs: 1 };
        self.has_quotas.then(|| self.quota(job, min)).flatten()
    }

    /// What the pass knows of `job` before placing it: its shape, and
    /// whether that shape failed already.
    fn trial(&self, job: &'s Job) -> Trial<'s> {
        let now = self.opts.now_ms;
        let depth = required_depth(self.state, job, now);
        let est_s = self.estimate_s(job);
        let too_big = job.spec.total_cpus() > self.free_cpus || job.spec.total_gpus() > self.free_gpus;
        let key = ShapeKey::of(job, depth, self.has_resv);
        let (fp, known) = if too_big {
            (0, Some(Miss::Resources))
        } else {
            let fp = key.fingerprint();
            (fp, self.cache.known(fp, &key, est_s))
        };
        let end_ms = now.saturating_add(est_s.saturating_mul(1000));
        Trial { depth, est_s, end_ms, too_big, key, fp, known, attempted: false }
    }

    /// Stage 3, place on what is free now (a shape that failed this pass is
    /// not tried again; past the attempts' budget none is).
    fn place_now(&mut self, job: &Job, trial: &mut Trial<'s>) -> Result<Vec<Member>, Miss> {
        if let Some(miss) = trial.known {
            return Err(miss);
        }
        if self.plan.place_attempts >= PLACE_ATTEMPTS_PER_PASS_MAX {
            return Err(Miss::Resources);
        }
        trial.attempted = true;
        crate::incr(&mut self.plan.place_attempts);
        let holds = (self.budgets.reservations_tried > 0).then_some((self.holds.as_slice(), trial.end_ms));
        if job.spec.nodes_max() == 1 && job.spec.components.is_empty() {
            self.place_single(job, holds)
        } else {
            self.view.place(job, &self.free, holds, trial.depth, self.opts.now_ms)
        }
    }

    /// Starts `job` on `members` (after waking them, for powered-down pool
    /// nodes), unless the placement would exceed a quota.
    fn start(&mut self, job: &'s Job, members: Vec<Member>, end_ms: u64, wake: bool) -> Verdict {
        if self.has_quotas {
            if let Some(why) = self.quota(job, view::members_use(&members)) {
                return Verdict::Waits(why);
            }
        }
        if wake {
            self.wake(&members);
        }
        self.record(job, members, end_ms);
        Verdict::Started
    }

    /// Stage 4, power up: a pool's powered-down nodes, only for a job the up
    /// ones cannot hold.
    fn power_up(&mut self, job: &'s Job, trial: &Trial<'s>, miss: Miss) -> Option<Verdict> {
        if miss == Miss::Impossible
            || self.dormant.is_empty()
            || self.budgets.wake_attempts >= WAKE_ATTEMPTS_PER_PASS_MAX
        {
            return None;
        }
        crate::incr(&mut self.budgets.wake_attempts);
        let held = self.budgets.reservations_tried > 0;
        let members = self.place_waking(job, trial.depth, trial.end_ms, held)?;
        Some(self.start(job, members, trial.end_ms, true))
    }

    /// Stage 5, preempt: running victims whose space lets it start (a
    /// placement over a quota evicts nobody).
    fn preempt_for(&mut self, job: &'s Job, trial: &Trial<'s>, prio: Option<&Prioritizer>) -> Option<Verdict> {
        let prio = prio?;
        if self.budgets.preempt_attempts >= PREEMPT_ATTEMPTS_PER_PASS_MAX || !self.may_preempt(job) {
            return None;
        }
        // Every attempt counts, found or not: each may try many placements.
        crate::incr(&mut self.budgets.preempt_attempts);
        let (victims, members) = self.preempt(job, trial.depth, prio)?;
        if self.has_quotas && self.quota(job, view::members_use(&members)).is_some() {
            return None;
        }
        let given = self.evict(&victims, job.id);
        self.record(job, members.clone(), trial.end_ms);
        self.keep_for_yielded(&given, &members);
        Some(Verdict::Started)
    }

    /// Stages 6 and 7 for a job that cannot start now: feasible (a job no
    /// node set could ever hold neither blocks FIFO nor takes a reservation
    /// slot), then reserve (a top job gets the earliest start that will
    /// hold it; later jobs may only backfill around it).
    fn wait_or_reserve(&mut self, job: &Job, trial: &Trial<'s>, miss: Miss) -> Verdict {
        if miss == Miss::Impossible {
            return Verdict::Waits(Pending::BadConstraints);
        }
        let b = &self.budgets;
        let none_reserved = b.reservations_tried == 0;
        let reason = |reserved: bool| match miss {
            Miss::Impossible => Pending::BadConstraints,
            Miss::Topology => Pending::Topology,
            Miss::Resources if reserved || none_reserved => Pending::Resources,
            Miss::Resources => Pending::Priority,
        };
        // A job too big for what is free still gets its reservation if it is a top job.
        let known_fail = trial.known.is_some() && !(trial.too_big && b.reservations_tried < b.reservations_max);
        let may_reserve = b.reservations_tried < b.reservations_max && !known_fail;
        let wants_slot = self.opts.policy == Policy::Fifo || may_reserve;
        // Beyond the reservation candidates, a shape's first failure this
        // pass is checked too (within a budget; the cache then answers for
        // the same shape).
        let check =
            wants_slot || (trial.attempted && !trial.too_big && b.possible_checks < POSSIBLE_CHECKS_PER_PASS_MAX);
        if check && !wants_slot {
            crate::incr(&mut self.budgets.possible_checks);
        }
        // A preferred level relaxes later: only a required one makes a job impossible.
        let hard_depth = trial.depth.filter(|_| job.spec.topology.required);
        if check && !self.feasible(job, hard_depth) {
            if !trial.too_big {
                self.cache.impossible(trial.fp, &trial.key);
            }
            return Verdict::Waits(Pending::BadConstraints);
        }
        if self.opts.policy == Policy::Fifo {
            return Verdict::BlocksQueue(reason(true));
        }
        if !may_reserve {
            return Verdict::Waits(reason(false));
        }
        crate::incr(&mut self.budgets.reservations_tried);
        if let Some(start) = self.reserve(job, trial.depth) {
            self.plan.reservations.push((job.id, start));
        }
        Verdict::Waits(reason(true))
    }
}
