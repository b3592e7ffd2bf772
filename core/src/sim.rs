//! The trace simulator: the same `sched` and `State::apply` the leader runs,
//! driven in virtual time by a workload trace, so a policy can be measured
//! offline (wait time, bounded slowdown, utilization).
//!
//! Each trace job becomes a submission at its submit time; the scheduler plans
//! after every batch of events and the plan is applied as the leader applies
//! it (one `ApplySchedule`, preemptions included); a started job finishes after
//! its run time (or at its requested time limit, if it would run longer).

// Float-to-integer casts saturate in Rust (never panic); the report's
// percentiles and SWF's decimal fields rely on that.
#![allow(clippy::cast_possible_truncation)]

use std::collections::{BTreeMap, VecDeque};

use crate::command::Command;
use crate::model::{Job, JobId, JobState};
use crate::sched::{plan, Options, Order, Policy};
use crate::spec::{GpuSpec, JobSpec, NodeSpec};
use crate::state::{Outcome, State};

/// One job of a trace (Standard Workload Format fields, cleaned).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TraceJob {
    pub submit_s: u64,
    pub run_s: u64,
    /// Processors requested: the job asks for this many nodes of one CPU each,
    /// or fewer, fuller nodes when `cpus_per_node` > 1.
    pub procs: u32,
    /// The user's time limit estimate (run time when the trace has none).
    pub req_s: u64,
    /// The trace's user id (SWF field 12; 0 when unknown).
    pub user: i64,
    /// GPUs requested (GPU traces); 0 for CPU traces, which use `procs`.
    pub gpus: u32,
}

/// How the simulated scheduler decides.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SimPolicy {
    /// Strict first come, first served.
    Fcfs,
    /// Submit order, skipping what does not fit (no reservation).
    FirstFit,
    /// EASY backfilling on users' time limits.
    Easy,
    /// EASY with run times predicted from each user's history (the mean of
    /// their last two run times, capped by the limit; Tsafrir et al.'s EASY++
    /// predictor): tighter reservations, more backfilling.
    EasyLearned,
}

impl SimPolicy {
    pub fn parse(s: &str) -> Option<SimPolicy> {
        Some(match s {
            "fcfs" | "fifo" => SimPolicy::Fcfs,
            "first-fit" => SimPolicy::FirstFit,
            "easy" => SimPolicy::Easy,
            "easy-learned" => SimPolicy::EasyLearned,
            _ => return None,
        })
    }

    pub fn name(self) -> &'static str {
        match self {
            SimPolicy::Fcfs => "fcfs",
            SimPolicy::FirstFit => "first-fit",
            SimPolicy::Easy => "easy",
            SimPolicy::EasyLearned => "easy-learned",
        }
    }
}

#[derive(Debug, Clone, Copy)]
pub struct SimConfig {
    pub nodes: u32,
    pub cpus_per_node: u32,
    /// GPUs per node (GPU traces); 0 for CPU machines.
    pub gpus_per_node: u32,
    pub policy: SimPolicy,
}

/// Run times remembered per user for the learned predictor.
const HISTORY_PER_USER: usize = 2;

#[derive(Debug, Clone, PartialEq)]
pub struct SimReport {
    pub jobs: usize,
    /// Jobs that can never fit the machine (skipped).
    pub skipped: usize,
    pub mean_wait_s: f64,
    pub p50_wait_s: f64,
    pub p95_wait_s: f64,
    pub mean_bounded_slowdown: f64,
    pub p95_bounded_slowdown: f64,
    /// Busy CPU-seconds over capacity from the first submit to the last finish.
    pub utilization: f64,
    pub makespan_s: u64,
}

/// Bounded slowdown threshold (the literature's tau = 10 s).
const BSLD_TAU_S: f64 = 10.0;

/// Progress reports per replay: one each hundredth of the trace's jobs.
const PROGRESS_STEPS: usize = 100;

/// Replays `trace` on a machine of `cfg.nodes` nodes.
pub fn simulate(trace: &[TraceJob], cfg: &SimConfig) -> SimReport {
    simulate_with_progress(trace, cfg, &mut |_, _| {})
}

/// As [`simulate`], calling `progress(submitted, total)` as jobs arrive (at
/// most PROGRESS_STEPS times).
pub fn simulate_with_progress(
    trace: &[TraceJob],
    cfg: &SimConfig,
    progress: &mut dyn FnMut(usize, usize),
) -> SimReport {
    let mut state = State::default();
    let mut index = 0u64;
    let mut apply = |state: &mut State, cmd: Command| {
        crate::incr(&mut index);
        state.apply(index, &cmd)
    };
    let cpn = cfg.cpus_per_node.max(1);
    for n in 0..cfg.nodes {
        let spec = NodeSpec {
            name: format!("n{n:05}"),
            addr: String::new(),
            cpus: cpn,
            mem_mb: 1024,
            gpus: (0..cfg.gpus_per_node)
                .map(|g| GpuSpec { uuid: format!("n{n}-{g}"), model: "gpu".into(), mem_mb: 1, nvlink_island: 0 })
                .collect(),
            topology: Vec::new(),
            labels: BTreeMap::new(),
        };
        apply(&mut state, Command::RegisterNode { spec, now_ms: 0 });
    }
    // Submissions in time order; jobs wider than the machine are skipped.
    let mut arrivals: Vec<(u64, usize)> = Vec::new();
    let mut skipped = 0;
    let gpn = cfg.gpus_per_node;
    // A job's shape on this machine: (nodes, cpus per node, gpus per node).
    let shape = |j: &TraceJob| -> (u32, u32, u32) {
        if gpn > 0 && j.gpus > 0 {
            let nodes = j.gpus.div_ceil(gpn);
            (nodes, 1, j.gpus.div_ceil(nodes))
        } else {
            let nodes = j.procs.div_ceil(cpn);
            (nodes, j.procs.div_ceil(nodes.max(1)), 0)
        }
    };
    // Resource units for utilization: GPUs on a GPU machine, else CPUs.
    let units = |j: &TraceJob| if gpn > 0 { u64::from(j.gpus) } else { u64::from(j.procs) };
    for (i, j) in trace.iter().enumerate() {
        let nodes = shape(j).0;
        if (j.procs == 0 && j.gpus == 0) || nodes > cfg.nodes || (gpn == 0 && j.gpus > 0) {
            crate::incr(&mut skipped);
        } else {
            arrivals.push((j.submit_s, i));
        }
    }
    arrivals.sort_unstable();
    let mut job_of: BTreeMap<JobId, usize> = BTreeMap::new();
    let mut started: BTreeMap<usize, u64> = BTreeMap::new();
    let mut ends: BTreeMap<u64, Vec<(JobId, u32)>> = BTreeMap::new();
    let mut next = 0;
    let first_submit = arrivals.first().map(|a| a.0).unwrap_or(0);
    let mut last_end = first_submit;
    let mut busy_cpu_s: f64 = 0.0;
    let (policy, estimated) = match cfg.policy {
        SimPolicy::Fcfs => (Policy::Fifo, false),
        SimPolicy::FirstFit => (Policy::FirstFit, false),
        SimPolicy::Easy => (Policy::Easy, false),
        SimPolicy::EasyLearned => (Policy::Easy, true),
    };
    // User → their last run times (learned predictor).
    let mut history: BTreeMap<String, VecDeque<u64>> = BTreeMap::new();
    let mut reported = 0usize;
    loop {
        let t_arrival = arrivals.get(next).map(|a| a.0);
        let t_end = ends.keys().next().copied();
        let t = match (t_arrival, t_end) {
            (None, None) => break,
            (Some(a), None) => a,
            (None, Some(e)) => e,
            (Some(a), Some(e)) => a.min(e),
        };
        if let Some(done) = ends.remove(&t) {
            for (job_id, attempt) in done {
                let cmd = Command::JobFinished {
                    job_id,
                    attempt,
                    state: JobState::Completed,
                    exit_code: Some(0),
                    reason: String::new(),
                    now_ms: t.saturating_mul(1000),
                };
                let Some(job) = state.jobs.get(&job_id) else { continue };
                let user = job.spec.user.clone();
                let ran = t.saturating_sub(job.start_time_ms.unwrap_or(0) / 1000);
                apply(&mut state, cmd);
                let h = history.entry(user).or_default();
                h.push_back(ran);
                if h.len() > HISTORY_PER_USER {
                    h.pop_front();
                }
                last_end = last_end.max(t);
            }
        }
        if next >= reported.saturating_add((arrivals.len() / PROGRESS_STEPS).max(1)) {
            reported = next;
            progress(next, arrivals.len());
        }
        while let Some(&(_, k)) = arrivals.get(next).filter(|a| a.0 == t) {
            crate::incr(&mut next);
            let Some(j) = trace.get(k) else { continue };
            let (nodes, cpus, gpus) = shape(j);
            let spec = JobSpec {
                user: format!("u{}", j.user),
                command: vec!["job".into()],
                nodes,
                cpus_per_task: cpus,
                gpus_per_node: gpus,
                time_limit_s: j.req_s.clamp(1, crate::limits::TIME_LIMIT_S_MAX),
                ..JobSpec::default()
            };
            let cmd = Command::SubmitJob {
                spec,
                identity: "trace".into(),
                idempotency_key: String::new(),
                now_ms: t.saturating_mul(1000),
            };
            if let Outcome::Submitted { job_id, .. } = apply(&mut state, cmd).outcome {
                job_of.insert(job_id, k);
            }
        }
        // A machine with nothing free starts nothing: skip the pass.
        let free_cpus: u64 =
            state.nodes.values().map(|n| u64::from(n.cpus.saturating_sub(n.cpus_alloc))).fold(0, u64::saturating_add);
        if free_cpus == 0 {
            continue;
        }
        let predict = |job: &Job| -> u64 {
            match history.get(&job.spec.user) {
                Some(h) if !h.is_empty() => h
                    .iter()
                    .fold(0u64, |a, b| a.saturating_add(*b))
                    .checked_div(h.len() as u64)
                    .unwrap_or(0)
                    .clamp(1, job.spec.time_limit_s),
                _ => job.spec.time_limit_s,
            }
        };
        let opts = Options {
            policy,
            order: Order::Submit,
            now_ms: t.saturating_mul(1000),
            estimate_s: if estimated { Some(&predict) } else { None },
            stopping: None,
        };
        // The leader's path: the whole plan, preemptions included, as one
        // ApplySchedule entry.
        let p = plan(&state, &opts);
        if p.placements.is_empty() && p.preemptions.is_empty() {
            continue;
        }
        let cmd = Command::ApplySchedule {
            preemptions: p.preemptions,
            placements: p.placements,
            now_ms: t.saturating_mul(1000),
        };
        if let Outcome::ScheduleApplied { started: ids, .. } = apply(&mut state, cmd).outcome {
            for id in ids {
                let Some((&i, j)) = job_of.get(&id).and_then(|i| Some((i, trace.get(*i)?))) else { continue };
                let run = j.run_s.min(j.req_s).max(1);
                started.insert(i, t);
                busy_cpu_s += run.saturating_mul(units(j)) as f64;
                let attempt = state.jobs.get(&id).map_or(0, |job| job.attempt);
                ends.entry(t.saturating_add(run)).or_default().push((id, attempt));
            }
        }
    }
    let mut waits = Vec::new();
    let mut bslds = Vec::new();
    for (j, &start) in started.iter().filter_map(|(&i, start)| Some((trace.get(i)?, start))) {
        let wait = start.saturating_sub(j.submit_s) as f64;
        let run = j.run_s.min(j.req_s).max(1) as f64;
        waits.push(wait);
        bslds.push(((wait + run) / run.max(BSLD_TAU_S)).max(1.0));
    }
    bslds.sort_by(f64::total_cmp);
    let mut sorted_waits = waits.clone();
    sorted_waits.sort_by(f64::total_cmp);
    let pct = |v: &[f64], q: f64| v.get(((v.len() as f64 - 1.0) * q).round() as usize).copied().unwrap_or(0.0);
    let n = waits.len().max(1) as f64;
    let makespan_s = last_end.saturating_sub(first_submit);
    let capacity_units = cfg.nodes.saturating_mul(if gpn > 0 { gpn } else { cpn });
    let capacity = f64::from(capacity_units) * makespan_s.max(1) as f64;
    SimReport {
        jobs: started.len(),
        skipped,
        mean_wait_s: waits.iter().sum::<f64>() / n,
        p50_wait_s: pct(&sorted_waits, 0.5),
        p95_wait_s: pct(&sorted_waits, 0.95),
        mean_bounded_slowdown: bslds.iter().sum::<f64>() / n,
        p95_bounded_slowdown: bslds.get(((bslds.len() as f64 - 1.0) * 0.95).round() as usize).copied().unwrap_or(1.0),
        utilization: busy_cpu_s / capacity,
        makespan_s,
    }
}

/// Parses Standard Workload Format text: `;` comment lines, then 18 fields per
/// job. Cleans as usual: jobs with run time or processors ≤ 0 are dropped; a
/// missing requested time is replaced by the run time. Also returns the
/// machine size from the header (MaxProcs, else MaxNodes) when present.
pub fn parse_swf(text: &str) -> (Vec<TraceJob>, Option<u32>) {
    let mut jobs = Vec::new();
    let mut max_procs = None;
    for line in text.lines() {
        let line = line.trim();
        if let Some(h) = line.strip_prefix(';') {
            if let Some(v) = h.trim().strip_prefix("MaxProcs:") {
                max_procs = v.trim().parse().ok();
            } else if let Some(v) = h.trim().strip_prefix("MaxNodes:") {
                max_procs = max_procs.or(v.trim().parse().ok());
            }
            continue;
        }
        let f: Vec<i64> = line.split_whitespace().filter_map(|x| x.parse::<f64>().ok().map(|v| v as i64)).collect();
        // SWF fields: 2 submit, 4 run time, 5 allocated processors, 8 requested
        // processors, 9 requested time (1-based), 12 user.
        let [_, submit, _, run, alloc, _, _, req_procs, req_time, ..] = f[..] else { continue };
        let user = f.get(11).copied().unwrap_or(0);
        let procs = if req_procs > 0 { req_procs } else { alloc };
        if run <= 0 || procs <= 0 || submit < 0 {
            continue;
        }
        let req = if req_time > 0 { req_time.max(run) } else { run };
        jobs.push(TraceJob {
            submit_s: submit as u64,
            run_s: run as u64,
            procs: u32::try_from(procs).unwrap_or(u32::MAX),
            req_s: req as u64,
            user,
            gpus: 0,
        });
    }
    (jobs, max_procs)
}

/// Parses a GPU job trace: the Tiresias CSV (`job_id,num_gpu,submit_time,
/// iterations,model_name,duration,interval`) or the Gavel TSV (job type,
/// command, steps arg, needs data dir, total steps, arrival time, GPUs; its run
/// time is total steps × `gavel_step_ms`, an assumption since the trace holds
/// no durations). Jobs have no time limit estimate: their run time is used.
pub fn parse_gpu_trace(text: &str, gavel_step_ms: u64) -> Result<Vec<TraceJob>, String> {
    let mut jobs = Vec::new();
    for (n, line) in text.lines().enumerate() {
        let line = line.trim_end();
        if line.is_empty() || line.starts_with("job_id") || line.starts_with('#') {
            continue;
        }
        let bad = |what: &str| format!("line {}: {what}", n.saturating_add(1));
        let (gpus, submit, run) = if line.contains('\t') {
            let f: Vec<&str> = line.split('\t').collect();
            let [_, _, _, _, steps, arrival, gpus, ..] = f[..] else {
                return Err(bad("a Gavel line has 7 tab-separated fields"));
            };
            let steps: u64 = steps.trim().parse().map_err(|_| bad("total steps is not a number"))?;
            let arrival: f64 = arrival.trim().parse().map_err(|_| bad("arrival time is not a number"))?;
            let gpus: u32 = gpus.trim().parse().map_err(|_| bad("GPUs is not a number"))?;
            (gpus, arrival as u64, (steps.saturating_mul(gavel_step_ms) / 1000).max(1))
        } else {
            let f: Vec<&str> = line.split(',').collect();
            let [_, gpus, submit, _, _, run, ..] = f[..] else {
                return Err(bad("a Tiresias line has at least 6 comma-separated fields"));
            };
            let gpus: u32 = gpus.trim().parse().map_err(|_| bad("num_gpu is not a number"))?;
            let submit: u64 = submit.trim().parse().map_err(|_| bad("submit_time is not a number"))?;
            let run: u64 = run.trim().parse().map_err(|_| bad("duration is not a number"))?;
            (gpus, submit, run.max(1))
        };
        if gpus == 0 {
            continue;
        }
        jobs.push(TraceJob { submit_s: submit, run_s: run, procs: gpus, req_s: run, user: 0, gpus });
    }
    Ok(jobs)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn replays_a_small_trace_and_first_fit_starts_small_jobs_in_gaps() {
        // 4 processors: job 1 takes 3 of them for 100 s; job 2 needs all 4; job 3
        // needs 1 for 10 s. FIFO keeps job 3 behind job 2; first fit starts it at
        // once in the free processor.
        let swf = "; MaxProcs: 4\n\
                   1 0 -1 100 3 -1 -1 3 100 -1 1\n\
                   2 1 -1 100 4 -1 -1 4 100 -1 1\n\
                   3 2 -1 10 1 -1 -1 1 10 -1 1\n\
                   4 3 -1 -1 1 -1 -1 1 10 -1 1\n";
        let (trace, max) = parse_swf(swf);
        assert_eq!((trace.len(), max), (3, Some(4)), "a job with no run time is dropped");
        let cfg = |policy| SimConfig { nodes: 4, cpus_per_node: 1, gpus_per_node: 0, policy };
        let fifo = simulate(&trace, &cfg(SimPolicy::Fcfs));
        let ff = simulate(&trace, &cfg(SimPolicy::FirstFit));
        assert_eq!((fifo.jobs, ff.jobs), (3, 3));
        // Waits: FIFO 0 + 99 + 198; first fit 0 + 99 + 0.
        assert!((fifo.mean_wait_s - 99.0).abs() < 1e-9, "{fifo:?}");
        assert!((ff.mean_wait_s - 33.0).abs() < 1e-9, "{ff:?}");
        assert_eq!((fifo.makespan_s, ff.makespan_s), (210, 200));
        assert!(ff.utilization > 0.0 && ff.utilization <= 1.0);
    }

    #[test]
    fn gpu_traces_place_multi_node_gangs() {
        let csv = "job_id,num_gpu,submit_time,iterations,model_name,duration,interval\n\
                   0,16,0,1,m,100,1\n\
                   1,4,0,1,m,50,1\n";
        let trace = parse_gpu_trace(csv, 100).unwrap();
        assert_eq!(trace.len(), 2);
        let r = simulate(&trace, &SimConfig { nodes: 2, cpus_per_node: 8, gpus_per_node: 8, policy: SimPolicy::Easy });
        // The 16-GPU gang takes both nodes; the 4-GPU job waits until t=100.
        assert_eq!(r.jobs, 2);
        assert!((r.mean_wait_s - 50.0).abs() < 1e-9, "{r:?}");
        assert!(parse_gpu_trace("0,x,0,1,m,1,1", 100).unwrap_err().contains("num_gpu"));
    }
}
