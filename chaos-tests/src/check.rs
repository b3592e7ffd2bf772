//! Checkers: independent judgments over the history, the final state of every
//! replica and the agents' execution records. Each returns its violations (an
//! empty list passes).

use std::collections::{BTreeMap, BTreeSet};

use gangway_proto::v1 as pb;

use crate::history::{Cancel, CancelOutcome, Outcome, Query, QueryOutcome, Submit};

/// One line an agent's job wrote: `start|end NODE JOB ATTEMPT GPUS TIME_NS`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ExecRecord {
    pub start: bool,
    pub node: String,
    pub job: u64,
    pub attempt: u32,
    pub gpus: Vec<u32>,
    pub time_ns: u128,
}

/// Parses the records jobs wrote under `dir` (one file per node).
pub fn read_records(dir: &std::path::Path) -> Vec<ExecRecord> {
    let mut out = Vec::new();
    let Ok(entries) = std::fs::read_dir(dir) else { return out };
    for e in entries.flatten() {
        let Ok(text) = std::fs::read_to_string(e.path()) else { continue };
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() != 6 {
                continue;
            }
            let (Ok(job), Ok(attempt), Ok(time_ns)) = (f[2].parse(), f[3].parse(), f[5].parse()) else { continue };
            out.push(ExecRecord {
                start: f[0] == "start",
                node: f[1].to_string(),
                job,
                attempt,
                gpus: f[4].split(',').filter_map(|g| g.parse().ok()).collect(),
                time_ns,
            });
        }
    }
    out
}

/// Checker 1: every acknowledged submit is in the final state; every job
/// there was submitted (acknowledged or unknown); each submit made at most
/// one job.
pub fn submits_accounted_for(history: &[Submit], jobs: &[pb::Job]) -> Vec<String> {
    let mut v = Vec::new();
    let by_name: BTreeMap<&str, Vec<&pb::Job>> = jobs.iter().fold(BTreeMap::new(), |mut m, j| {
        m.entry(j.spec.as_ref().map_or("", |s| s.name.as_str())).or_insert_with(Vec::new).push(j);
        m
    });
    let mut known: BTreeSet<String> = BTreeSet::new();
    for s in history {
        let name = format!("chaos-{}", s.key);
        let found = by_name.get(name.as_str()).map_or(0, Vec::len);
        if found > 1 {
            v.push(format!("submit {} created {found} jobs", s.key));
        }
        match &s.outcome {
            Outcome::Ok(id) if !by_name.get(name.as_str()).is_some_and(|js| js.iter().any(|j| j.id == *id)) => {
                v.push(format!("acknowledged submit {} (job {id}) is missing", s.key));
            }
            Outcome::Fail(why) if found > 0 => v.push(format!("refused submit {} ({why}) created a job", s.key)),
            _ => {}
        }
        known.insert(name);
    }
    for j in jobs {
        let name = j.spec.as_ref().map_or("", |s| s.name.as_str());
        if !known.contains(name) {
            v.push(format!("job {} ({name}) was never submitted", j.id));
        }
    }
    v
}

/// When one attempt of a job ran on a GPU: (start ns, end ns, job, attempt).
type Span = (u128, u128, u64, u32);

/// Checker 2: no GPU runs two tasks at once, from the agents' own records.
pub fn no_gpu_double_use(records: &[ExecRecord]) -> Vec<String> {
    // (node, gpu) → intervals
    let mut spans: BTreeMap<(String, u32), Vec<Span>> = BTreeMap::new();
    for r in records.iter().filter(|r| r.start) {
        let end = records
            .iter()
            .find(|e| !e.start && e.node == r.node && e.job == r.job && e.attempt == r.attempt)
            .map_or(u128::MAX, |e| e.time_ns);
        for g in &r.gpus {
            spans.entry((r.node.clone(), *g)).or_default().push((r.time_ns, end, r.job, r.attempt));
        }
    }
    let mut v = Vec::new();
    for ((node, gpu), mut list) in spans {
        list.sort();
        for w in list.windows(2) {
            if w[1].0 < w[0].1 {
                v.push(format!(
                    "GPU {gpu} on {node}: job {} attempt {} overlaps job {} attempt {}",
                    w[0].2, w[0].3, w[1].2, w[1].3
                ));
            }
        }
    }
    v
}

/// Checkers 3 and 4: gangs start whole (every node of a completed 2-node job ran the
/// same attempt) and one attempt of a job runs at a time, once per node.
pub fn gangs_whole_and_attempts_fenced(jobs: &[pb::Job], records: &[ExecRecord]) -> Vec<String> {
    let mut v = Vec::new();
    for j in jobs.iter().filter(|j| j.state == pb::JobState::Completed as i32) {
        let nodes = j.spec.as_ref().and_then(|s| s.nodes).unwrap_or(1) as usize;
        let ran: BTreeSet<&str> = records
            .iter()
            .filter(|r| r.start && r.job == j.id && r.attempt == j.attempt)
            .map(|r| r.node.as_str())
            .collect();
        if ran.len() != nodes {
            v.push(format!("job {} completed attempt {} on {} of its {nodes} nodes", j.id, j.attempt, ran.len()));
        }
    }
    let mut starts: BTreeMap<(u64, u32, &str), usize> = BTreeMap::new();
    for r in records.iter().filter(|r| r.start) {
        *starts.entry((r.job, r.attempt, r.node.as_str())).or_default() += 1;
    }
    for ((job, attempt, node), n) in starts {
        if n > 1 {
            v.push(format!("job {job} attempt {attempt} started {n} times on {node}"));
        }
    }
    v
}

/// Checker 4: at most one attempt of a job runs at a time: the span of each
/// attempt (first start to last end, across its nodes) never overlaps another's.
pub fn attempts_never_overlap(records: &[ExecRecord]) -> Vec<String> {
    let mut spans: BTreeMap<(u64, u32), (u128, u128)> = BTreeMap::new();
    for r in records {
        let e = spans.entry((r.job, r.attempt)).or_insert((u128::MAX, 0));
        if r.start {
            e.0 = e.0.min(r.time_ns);
        } else {
            e.1 = e.1.max(r.time_ns);
        }
    }
    let mut v = Vec::new();
    let list: Vec<_> = spans.into_iter().collect();
    for w in list.windows(2) {
        let (((job_a, att_a), (_, end_a)), ((job_b, att_b), (start_b, _))) = (&w[0], &w[1]);
        // An attempt that never recorded its end still runs: it overlaps what follows.
        let end_a = if *end_a == 0 { u128::MAX } else { *end_a };
        if job_a == job_b && *start_b < end_a {
            v.push(format!("job {job_a}: attempt {att_b} started while attempt {att_a} still ran"));
        }
    }
    v
}

/// Checker 5: every replica holds the same jobs in the same states.
pub fn replicas_converged(per_replica: &[Vec<pb::Job>]) -> Vec<String> {
    let view =
        |jobs: &Vec<pb::Job>| -> Vec<(u64, i32, u32)> { jobs.iter().map(|j| (j.id, j.state, j.attempt)).collect() };
    let first = per_replica.first().map(view).unwrap_or_default();
    per_replica
        .iter()
        .enumerate()
        .skip(1)
        .filter(|(_, jobs)| view(jobs) != first)
        .map(|(i, jobs)| format!("replica {} differs from replica 1 ({} vs {} jobs)", i + 1, jobs.len(), first.len()))
        .collect()
}

/// Checker 7: controller faults alone never fail a node: nothing was requeued or lost
/// because a node was declared down.
pub fn no_false_node_failures(jobs: &[pb::Job], nodes: &[pb::Node]) -> Vec<String> {
    let mut v: Vec<String> = nodes
        .iter()
        .filter(|n| n.state != pb::NodeState::Up as i32)
        .map(|n| format!("node {} is {:?} ({})", n.name, n.state, n.state_reason))
        .collect();
    for j in jobs {
        if j.attempt > 1 || j.state == pb::JobState::NodeFail as i32 {
            v.push(format!("job {} ran {} attempts ({}): a node was declared failed", j.id, j.attempt, j.reason));
        }
    }
    v
}

/// Checker 8: resources are conserved: what nodes count as allocated is exactly what
/// running jobs hold.
pub fn resources_conserved(jobs: &[pb::Job], nodes: &[pb::Node]) -> Vec<String> {
    let mut cpus: BTreeMap<&str, u32> = BTreeMap::new();
    let mut gpus: BTreeMap<&str, usize> = BTreeMap::new();
    // Suspended jobs keep their allocation.
    let holds = |s: i32| s == pb::JobState::Running as i32 || s == pb::JobState::Suspended as i32;
    for j in jobs.iter().filter(|j| holds(j.state)) {
        for a in &j.allocation {
            *cpus.entry(a.node.as_str()).or_default() += a.cpus;
            *gpus.entry(a.node.as_str()).or_default() += a.gpus.len();
        }
    }
    let mut v = Vec::new();
    for n in nodes {
        let held = n.gpus.iter().filter(|g| g.allocated_to.is_some()).count();
        let (c, g) = (cpus.get(n.name.as_str()).copied().unwrap_or(0), gpus.get(n.name.as_str()).copied().unwrap_or(0));
        if n.cpus_alloc != c || held != g || n.cpus_alloc > n.cpus {
            v.push(format!(
                "node {}: {} CPUs / {held} GPUs allocated, running jobs hold {c} / {g} (capacity {} CPUs)",
                n.name, n.cpus_alloc, n.cpus
            ));
        }
    }
    v
}

fn finished(state: i32) -> bool {
    !matches!(
        pb::JobState::try_from(state),
        Ok(pb::JobState::Pending | pb::JobState::Running | pb::JobState::Suspended | pb::JobState::Unspecified)
    )
}

/// Checker 4, cancels: an acknowledged cancel leaves its job Cancelled, and no
/// later attempt of it ever starts on a node; a cancel refused because the job
/// had finished finds it finished in the final state.
pub fn cancels_took_effect(cancels: &[Cancel], jobs: &[pb::Job], records: &[ExecRecord]) -> Vec<String> {
    let by_id: BTreeMap<u64, &pb::Job> = jobs.iter().map(|j| (j.id, j)).collect();
    let mut v = Vec::new();
    for c in cancels {
        let Some(job) = by_id.get(&c.job) else {
            if !matches!(c.outcome, CancelOutcome::Unknown(_)) {
                v.push(format!("cancelled job {} is missing from the final state", c.job));
            }
            continue;
        };
        match c.outcome {
            CancelOutcome::Ok { attempt } => {
                if job.state != pb::JobState::Cancelled as i32 {
                    v.push(format!("job {}: cancel acknowledged, but it ended {:?}", c.job, job.state()));
                }
                if let Some(r) = records.iter().find(|r| r.start && r.job == c.job && r.attempt > attempt) {
                    v.push(format!(
                        "job {}: attempt {} started on {} after a cancel at attempt {attempt}",
                        c.job, r.attempt, r.node
                    ));
                }
            }
            CancelOutcome::AlreadyFinished if !finished(job.state) => {
                v.push(format!("job {}: a cancel was refused as finished, but it ended {:?}", c.job, job.state()));
            }
            _ => {}
        }
    }
    v
}

/// Checker 4, as clients see it: reads are linearizable and each job's history
/// is monotone. A query begun after a submit was acknowledged finds the job; one
/// begun after a cancel was acknowledged finds it Cancelled; of two queries of
/// one job, the later (begun after the earlier ended) never sees a lower
/// attempt, nor anything but the same finished state once one was seen.
pub fn reads_linearizable_and_monotone(submits: &[Submit], cancels: &[Cancel], queries: &[Query]) -> Vec<String> {
    let acked: BTreeMap<u64, std::time::Instant> = submits
        .iter()
        .filter_map(|s| match s.outcome {
            Outcome::Ok(id) => Some((id, s.completed)),
            _ => None,
        })
        .collect();
    let mut v = Vec::new();
    let mut per_job: BTreeMap<u64, Vec<&Query>> = BTreeMap::new();
    for q in queries {
        let after_submit = acked.get(&q.job).is_some_and(|t| *t < q.invoked);
        match &q.outcome {
            QueryOutcome::NotFound(why) if after_submit => {
                v.push(format!("job {}: a query after its acknowledged submit found nothing ({why})", q.job));
            }
            QueryOutcome::Found { state, .. } => {
                let cancelled_before = cancels.iter().any(|c| {
                    c.job == q.job && matches!(c.outcome, CancelOutcome::Ok { .. }) && c.completed < q.invoked
                });
                if cancelled_before && *state != pb::JobState::Cancelled as i32 {
                    v.push(format!("job {}: a query after its acknowledged cancel saw state {state}", q.job));
                }
                per_job.entry(q.job).or_default().push(q);
            }
            _ => {}
        }
    }
    for (job, qs) in per_job {
        for a in &qs {
            for b in qs.iter().filter(|b| a.completed < b.invoked) {
                let (QueryOutcome::Found { state: sa, attempt: aa }, QueryOutcome::Found { state: sb, attempt: ab }) =
                    (&a.outcome, &b.outcome)
                else {
                    continue;
                };
                if ab < aa {
                    v.push(format!("job {job}: attempt went back from {aa} to {ab} between two queries"));
                }
                if finished(*sa) && sb != sa {
                    v.push(format!("job {job}: state {sa} (finished) was followed by state {sb}"));
                }
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    fn rec(start: bool, node: &str, job: u64, attempt: u32, gpus: &[u32], t: u128) -> ExecRecord {
        ExecRecord { start, node: node.into(), job, attempt, gpus: gpus.to_vec(), time_ns: t }
    }

    fn job(id: u64, name: &str, state: pb::JobState, attempt: u32) -> pb::Job {
        pb::Job {
            id,
            state: state as i32,
            attempt,
            spec: Some(pb::JobSpec { name: name.into(), nodes: Some(1), ..Default::default() }),
            ..Default::default()
        }
    }

    #[test]
    fn overlapping_gpu_use_is_caught() {
        let ok = [rec(true, "n1", 1, 1, &[0], 10), rec(false, "n1", 1, 1, &[0], 20), rec(true, "n1", 2, 1, &[0], 20)];
        assert!(no_gpu_double_use(&ok).is_empty());
        let bad =
            [rec(true, "n1", 1, 1, &[0, 1], 10), rec(false, "n1", 1, 1, &[0, 1], 30), rec(true, "n1", 2, 1, &[1], 20)];
        assert_eq!(no_gpu_double_use(&bad).len(), 1);
    }

    #[test]
    fn lost_invented_and_duplicated_jobs_are_caught() {
        let now = Instant::now();
        let s = |key: &str, outcome| Submit { key: key.into(), invoked: now, completed: now, outcome };
        let history = [s("a", Outcome::Ok(1)), s("b", Outcome::Ok(2)), s("c", Outcome::Unknown("timeout".into()))];
        let jobs = [job(1, "chaos-a", pb::JobState::Completed, 1), job(3, "chaos-x", pb::JobState::Completed, 1)];
        let v = submits_accounted_for(&history, &jobs);
        assert!(v.iter().any(|m| m.contains("b (job 2) is missing")), "{v:?}");
        assert!(v.iter().any(|m| m.contains("never submitted")), "{v:?}");
        let twice = [job(1, "chaos-a", pb::JobState::Completed, 1), job(2, "chaos-a", pb::JobState::Completed, 1)];
        assert!(submits_accounted_for(&history[..1], &twice).iter().any(|m| m.contains("created 2 jobs")));
    }

    #[test]
    fn divergence_half_gangs_and_repeated_attempts_are_caught() {
        let a = vec![job(1, "chaos-a", pb::JobState::Completed, 1)];
        let b = vec![job(1, "chaos-a", pb::JobState::Running, 1)];
        assert_eq!(replicas_converged(&[a.clone(), b]).len(), 1);
        assert!(replicas_converged(&[a.clone(), a.clone()]).is_empty());
        let mut gang = job(5, "chaos-g", pb::JobState::Completed, 1);
        gang.spec.as_mut().unwrap().nodes = Some(2);
        let half = [rec(true, "n1", 5, 1, &[0], 1)];
        assert_eq!(gangs_whole_and_attempts_fenced(&[gang.clone()], &half).len(), 1);
        let twice = [rec(true, "n1", 5, 1, &[0], 1), rec(true, "n2", 5, 1, &[0], 1), rec(true, "n1", 5, 1, &[0], 2)];
        assert!(gangs_whole_and_attempts_fenced(&[gang], &twice).iter().any(|m| m.contains("started 2 times")));
    }

    #[test]
    fn ineffective_cancels_and_non_linearizable_reads_are_caught() {
        let t0 = Instant::now();
        let at = |ms| t0 + std::time::Duration::from_millis(ms);
        let cancel = |job, outcome| Cancel { job, invoked: at(10), completed: at(20), outcome };
        let jobs = [job(1, "chaos-a", pb::JobState::Completed, 1), job(2, "chaos-b", pb::JobState::Cancelled, 1)];
        let recs = [rec(true, "n1", 2, 1, &[0], 1), rec(true, "n1", 2, 2, &[0], 2)];
        let v = cancels_took_effect(
            &[cancel(1, CancelOutcome::Ok { attempt: 1 }), cancel(2, CancelOutcome::Ok { attempt: 1 })],
            &jobs,
            &recs,
        );
        assert!(v.iter().any(|m| m.contains("job 1: cancel acknowledged")), "{v:?}");
        assert!(v.iter().any(|m| m.contains("attempt 2 started")), "{v:?}");
        assert!(cancels_took_effect(&[cancel(1, CancelOutcome::AlreadyFinished)], &jobs, &[]).is_empty());

        let submits = [Submit { key: "a".into(), invoked: at(0), completed: at(5), outcome: Outcome::Ok(1) }];
        let q = |from, to, outcome| Query { job: 1, invoked: at(from), completed: at(to), outcome };
        let found = |state: pb::JobState, attempt| QueryOutcome::Found { state: state as i32, attempt };
        let ok = [q(6, 7, found(pb::JobState::Pending, 1)), q(8, 9, found(pb::JobState::Completed, 2))];
        assert!(reads_linearizable_and_monotone(&submits, &[], &ok).is_empty());
        let lost = [q(6, 7, QueryOutcome::NotFound("gone".into()))];
        assert_eq!(reads_linearizable_and_monotone(&submits, &[], &lost).len(), 1);
        let back = [q(6, 7, found(pb::JobState::Running, 2)), q(8, 9, found(pb::JobState::Running, 1))];
        assert_eq!(reads_linearizable_and_monotone(&submits, &[], &back).len(), 1);
        let revived = [q(6, 7, found(pb::JobState::Completed, 1)), q(8, 9, found(pb::JobState::Running, 1))];
        assert_eq!(reads_linearizable_and_monotone(&submits, &[], &revived).len(), 1);
        let after_cancel = [q(30, 31, found(pb::JobState::Running, 1))];
        let acked_cancel = [cancel(1, CancelOutcome::Ok { attempt: 1 })];
        assert_eq!(reads_linearizable_and_monotone(&submits, &acked_cancel, &after_cancel).len(), 1);
    }
}
