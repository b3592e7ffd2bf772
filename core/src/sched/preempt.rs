//! Preemption: a job that does not fit, whose QOS may preempt others' QOS,
//! takes the space of running victims — whole jobs only (gangs stop whole).
//!
//! Victims are chosen to lose the least work: fewest GPU-seconds (CPU-seconds
//! for CPU jobs) since each victim's last checkpoint (or start), then lowest
//! priority, then youngest. Victims are added in that order until the
//! preemptor fits, then any victim the placement does not need is dropped
//! again. The placement is computed in the freed space and committed with the
//! victims in one `ApplySchedule`, so a preemptor always starts where it
//! evicted (no thrashing) and a failover cannot evict twice.
//!
//! A victim whose QOS's preempt mode is SUSPEND is suspended instead and
//! gives only its CPUs and GPUs (its stopped processes keep their memory,
//! and it keeps its licenses and quota use); a job suspended already is no
//! such victim. It resumes once they are free again (`state/yielding.rs`).
//!
//! Borrowed quota is reclaimed the same way: a job whose account stays within
//! its own GPU quota may preempt jobs of sibling accounts that run beyond
//! theirs on borrowed GPUs, whatever their QOS.
//!
//! Related code: `mod.rs` calls [`Pass::preempt`] for jobs that did not fit;
//! `state/admin.rs` applies preemptions.

use super::view::Member;
use super::{Pass, Prioritizer};
use crate::command::Preemption;
use crate::model::{Job, JobId};
use crate::policy::PreemptMode;
use std::collections::BTreeMap;

/// Running jobs considered as victims for one preemptor: the cheapest ones by
/// lost work; bounds the trial placements.
pub const VICTIM_CANDIDATES_MAX: usize = 256;
/// Victims one preemptor may evict (a 1,024-node gang may need many small ones).
pub const VICTIMS_PER_JOB_MAX: usize = 128;

impl<'s> Pass<'s, '_> {
    /// Finds victims whose eviction lets `job` start, and where it would run.
    pub(super) fn preempt(
        &mut self,
        job: &'s Job,
        depth: Option<usize>,
        prio: &Prioritizer,
    ) -> Option<(Vec<&'s Job>, Vec<Member>)> {
        let state = self.state;
        let targets: &[String] = state.policy.qos.get(&job.spec.qos).map_or(&[], |q| q.preempt.as_slice());
        let reclaim = self.within_own_gpu_quota(job);
        if targets.is_empty() && !reclaim {
            return None;
        }
        let account = job.spec.account.as_str();
        let now = self.opts.now_ms;
        let mut victims: Vec<(u64, f64, u64, &'s Job)> = state
            .running
            .iter()
            .filter_map(|id| state.jobs.get(id))
            .filter(|v| {
                targets.contains(&v.spec.qos)
                    || (reclaim
                        && v.spec.account != account
                        && self.borrowing.contains(v.spec.account.as_str())
                        && state.policy.parent_of(&v.spec.account) == state.policy.parent_of(account))
            })
            .filter(|v| !self.plan.preemptions.iter().any(|p| p.job_id == v.id))
            // A suspended job has nothing to give by being suspended again.
            .filter(|v| !(v.is_yielded() || (v.is_suspended() && self.mode_of(v) == PreemptMode::Suspend)))
            .map(|v| {
                let since = v.last_checkpoint_ms.or(v.start_time_ms).unwrap_or(now);
                let secs = now.saturating_sub(since) / 1000;
                let weight = if v.gpus() > 0 { v.gpus().saturating_mul(1000) } else { v.cpus() };
                let lost = weight.saturating_mul(secs);
                (lost, prio.factors(v).total, u64::MAX.saturating_sub(v.start_time_ms.unwrap_or(0)), v)
            })
            .collect();
        victims.sort_by(|a, b| a.0.cmp(&b.0).then(a.1.total_cmp(&b.1)).then(a.2.cmp(&b.2)).then(a.3.id.cmp(&b.3.id)));
        victims.truncate(VICTIM_CANDIDATES_MAX);
        // A borrowing account gives back at most what it borrowed: its jobs
        // within its own quota are not reclaimed.
        let mut overage: std::collections::BTreeMap<&str, u64> = std::collections::BTreeMap::new();
        for a in &self.borrowing {
            let used = state.running_use.get(&crate::state::UseKey::Account(a.to_string())).map_or(0, |u| u.gpus);
            let own = state.policy.accounts.get(*a).and_then(|x| x.quota.max_running_gpus).unwrap_or(0);
            overage.insert(a, used.saturating_sub(u64::from(own)));
        }
        let mut trial = self.free.clone();
        let mut chosen: Vec<&'s Job> = Vec::new();
        let mut placed = None;
        for (_, _, _, v) in &victims {
            if chosen.len() >= VICTIMS_PER_JOB_MAX {
                break;
            }
            if !targets.contains(&v.spec.qos) {
                // A reclaim victim's account borrows, so it has an overage.
                let Some(left) = overage.get_mut(v.spec.account.as_str()) else { continue };
                if v.gpus() > *left {
                    continue;
                }
                *left = left.saturating_sub(v.gpus());
            }
            self.give_job(&mut trial, v);
            chosen.push(v);
            if let Ok(m) = self.view.place(job, &trial, None, depth, self.opts.now_ms) {
                placed = Some(m);
                break;
            }
        }
        let mut members = placed?;
        // Drop victims the placement does not touch, newest additions first.
        let mut k = chosen.len();
        while k > 0 {
            k = k.saturating_sub(1);
            let mut without = self.free.clone();
            for (i, v) in chosen.iter().enumerate() {
                if i != k {
                    self.give_job(&mut without, v);
                }
            }
            if let Ok(m) = self.view.place(job, &without, None, depth, self.opts.now_ms) {
                chosen.remove(k);
                members = m;
            }
        }
        Some((chosen, members))
    }

    /// Whether `job`'s account has a GPU quota that it would stay within: it
    /// may then reclaim GPUs its siblings borrowed.
    pub(super) fn within_own_gpu_quota(&self, job: &Job) -> bool {
        let p = &self.state.policy;
        let Some(max) = p.accounts.get(&job.spec.account).and_then(|a| a.quota.max_running_gpus) else { return false };
        let key = crate::state::UseKey::Account(job.spec.account.clone());
        let used = self
            .state
            .running_use
            .get(&key)
            .map_or(0, |u| u.gpus)
            .saturating_add(self.plan_use.get(&key).map_or(0, |u| u.gpus));
        let need = job.spec.total_gpus();
        need > 0 && used.saturating_add(need) <= u64::from(max)
    }

    /// How victim `v` would be preempted: its QOS's mode.
    fn mode_of(&self, v: &Job) -> PreemptMode {
        self.state.policy.qos_of(&v.spec.qos).preempt_mode
    }

    /// Returns what preempting victim `v` frees to `free`: all it holds, or
    /// its CPUs and GPUs when it is suspended (mode SUSPEND).
    fn give_job(&self, free: &mut [super::Free], v: &Job) {
        let whole = self.mode_of(v) != PreemptMode::Suspend;
        for na in v.allocation.iter().flat_map(|a| a.nodes.iter()) {
            if let Some(&i) = self.node_index.get(na.node.as_str()) {
                let mask = super::view::gpu_mask(&na.gpus);
                let mem_mb = if whole { na.mem_mb } else { 0 };
                self.view.give(free, i, na.cpus, mem_mb, mask);
            }
        }
    }

    /// Commits victims to the plan: their space becomes free for the
    /// preemptor. Returns what the suspended ones (mode SUSPEND) gave per
    /// node: [`Pass::keep_for_yielded`] takes back what the preemptor leaves.
    pub(super) fn evict(&mut self, victims: &[&'s Job], for_job: JobId) -> BTreeMap<usize, (u32, u32)> {
        let mut given: BTreeMap<usize, (u32, u32)> = BTreeMap::new();
        for v in victims {
            let mode = self.mode_of(v);
            let before = self.free.clone();
            let mut free = std::mem::take(&mut self.free);
            self.give_job(&mut free, v);
            self.free = free;
            self.free_cpus = self.free_cpus.saturating_add(v.cpus());
            self.free_gpus = self.free_gpus.saturating_add(v.gpus());
            for na in v.allocation.iter().flat_map(|a| a.nodes.iter()) {
                if let Some(&i) = self.node_index.get(na.node.as_str()) {
                    if let Some(&b) = before.get(i) {
                        self.rebucket(i, b);
                    }
                }
            }
            self.plan.preemptions.push(Preemption { job_id: v.id, attempt: v.attempt, mode, for_job });
            if mode == PreemptMode::Suspend {
                for na in v.allocation.iter().flat_map(|a| a.nodes.iter()) {
                    if let Some(&i) = self.node_index.get(na.node.as_str()) {
                        let g = given.entry(i).or_default();
                        *g = (g.0.saturating_add(na.cpus), g.1 | super::view::gpu_mask(&na.gpus));
                    }
                }
            }
        }
        given
    }

    /// After the preemptor is recorded: what suspended victims gave and it
    /// did not take stays theirs (kept for their resume, as the state keeps
    /// it), not free for the jobs planned after it. `given`: from
    /// [`Pass::evict`]; the preemptor took from the victims' CPUs first.
    pub(super) fn keep_for_yielded(&mut self, given: &BTreeMap<usize, (u32, u32)>, members: &[Member]) {
        for (&i, &(cpus, gpus)) in given {
            let took = members.iter().filter(|m| m.node == i).map(|m| m.cpus).fold(0u32, u32::saturating_add);
            let Some(f) = self.free.get_mut(i) else { continue };
            let before = *f;
            f.cpus = f.cpus.saturating_sub(cpus.saturating_sub(took));
            f.gpus &= !gpus;
            let after = *f;
            self.free_cpus = self.free_cpus.saturating_sub(u64::from(before.cpus.saturating_sub(after.cpus)));
            self.free_gpus = self
                .free_gpus
                .saturating_sub(u64::from(before.gpus.count_ones().saturating_sub(after.gpus.count_ones())));
            self.rebucket(i, before);
        }
    }
}
