//! Unit tests of the pass; scenario files in tests/scenarios cover features end to end.

use super::*;
use crate::command::Command;
use crate::spec::{GpuSpec, JobSpec, NodeSpec};
use crate::Outcome;

fn node(name: &str, gpus: u32) -> NodeSpec {
    NodeSpec {
        name: name.into(),
        addr: String::new(),
        cpus: 8,
        mem_mb: 1024,
        gpus: (0..gpus)
            .map(|i| GpuSpec {
                uuid: format!("{name}-{i}"),
                model: "h100-80gb".into(),
                mem_mb: 1,
                nvlink_island: i / 4,
            })
            .collect(),
        topology: vec![],
        labels: Default::default(),
    }
}

fn submit(s: &mut State, nodes: u32, gpus: u32) {
    let spec =
        JobSpec { user: "u".into(), command: vec!["true".into()], nodes, gpus_per_node: gpus, ..JobSpec::default() };
    s.apply(1, &Command::SubmitJob { spec, identity: "u".into(), idempotency_key: String::new(), now_ms: 1 });
}

/// The placements of a pass under `policy` in submit order.
fn schedule_with(s: &State, policy: Policy, now_ms: u64) -> Vec<crate::command::Placement> {
    plan(s, &Options { order: Order::Submit, ..Options::new(policy, now_ms) }).placements
}

/// The placements of a first-fit pass in submit order.
fn first_fit(s: &State) -> Vec<crate::command::Placement> {
    schedule_with(s, Policy::FirstFit, s.clock_ms)
}

#[test]
fn gangs_fit_whole_and_skip_what_does_not_fit() {
    let mut s = State::default();
    s.apply(1, &Command::RegisterNode { spec: node("a", 8), now_ms: 1 });
    s.apply(1, &Command::RegisterNode { spec: node("b", 8), now_ms: 1 });
    submit(&mut s, 2, 8); // job 1: both nodes whole
    submit(&mut s, 3, 1); // job 2: 3 nodes, never fits
    submit(&mut s, 1, 2); // job 3: waits for job 1
    let plan = first_fit(&s);
    assert_eq!(plan.iter().map(|p| p.job_id).collect::<Vec<_>>(), vec![1]);
    let out = s.apply(2, &Command::ApplySchedule { preemptions: vec![], placements: plan, now_ms: 2 }).outcome;
    assert!(matches!(out, Outcome::ScheduleApplied { ref started, .. } if started == &vec![1]));
    assert!(first_fit(&s).is_empty(), "nothing else fits while job 1 holds every GPU");
    s.check_invariants().unwrap();
}

#[test]
fn easy_backfills_only_what_cannot_delay_the_reserved_job() {
    let mut s = State::default();
    for n in ["a", "b"] {
        s.apply(1, &Command::RegisterNode { spec: node(n, 0), now_ms: 0 });
    }
    let submit_t = |s: &mut State, nodes: u32, limit_s: u64| {
        let spec = JobSpec {
            user: "u".into(),
            command: vec!["true".into()],
            nodes,
            cpus_per_task: 8,
            time_limit_s: limit_s,
            ..JobSpec::default()
        };
        s.apply(1, &Command::SubmitJob { spec, identity: "u".into(), idempotency_key: String::new(), now_ms: 0 });
    };
    submit_t(&mut s, 1, 100); // job 1: runs on one node until t=100
    let plan = schedule_with(&s, Policy::Easy, 0);
    s.apply(2, &Command::ApplySchedule { preemptions: vec![], placements: plan, now_ms: 0 });
    submit_t(&mut s, 2, 100); // job 2: needs both nodes: reserved at t=100
    submit_t(&mut s, 1, 500); // job 3: would hold the free node past t=100
    submit_t(&mut s, 1, 50); // job 4: ends by t=50, before the reservation
    let easy: Vec<u64> = schedule_with(&s, Policy::Easy, 0).iter().map(|p| p.job_id).collect();
    assert_eq!(easy, vec![4], "only the job that ends before the reservation may backfill");
    let ff: Vec<u64> = schedule_with(&s, Policy::FirstFit, 0).iter().map(|p| p.job_id).collect();
    assert_eq!(ff, vec![3], "first fit takes the free node and delays job 2");
    let fifo: Vec<u64> = schedule_with(&s, Policy::Fifo, 0).iter().map(|p| p.job_id).collect();
    assert!(fifo.is_empty(), "FIFO starts nothing behind the blocked job 2");
}

#[test]
fn gpus_come_from_one_nvlink_island_when_possible() {
    let mut s = State::default();
    s.apply(1, &Command::RegisterNode { spec: node("a", 8), now_ms: 1 });
    submit(&mut s, 1, 3);
    submit(&mut s, 1, 4);
    let plan = first_fit(&s);
    assert_eq!(plan[0].nodes[0].gpus, vec![0, 1, 2]);
    assert_eq!(plan[1].nodes[0].gpus, vec![4, 5, 6, 7], "the second job gets the untouched island");
}

#[test]
fn pick_gpus_prefers_the_tightest_island() {
    // Islands 0-3 and 4-7; 0,1 and 4 are taken.
    let islands = [0b0000_1111, 0b1111_0000];
    let avail = 0b1110_1100;
    assert_eq!(view::pick_gpus(avail, 2, &islands), Some(0b0000_1100), "island 0 has exactly 2 left");
    assert_eq!(view::pick_gpus(avail, 3, &islands), Some(0b1110_0000));
    assert_eq!(view::pick_gpus(avail, 5, &islands).map(u32::count_ones), Some(5));
    assert_eq!(view::pick_gpus(avail, 6, &islands), None);
}

/// A cluster in the newest data format under `policy`, with `nodes`.
fn cluster(policy: crate::policy::ClusterPolicy, nodes: &[NodeSpec]) -> State {
    let mut s = State::default();
    s.apply(1, &Command::SetDataFormat { format: crate::format::FORMAT_NEWEST, now_ms: 0 });
    let update =
        Command::UpdatePolicy { policy, expected_version: None, force: true, identity: "server:1".into(), now_ms: 0 };
    let out = s.apply(2, &update).outcome;
    assert!(matches!(out, Outcome::PolicyUpdated { .. }), "{out:?}");
    for n in nodes {
        s.apply(3, &Command::RegisterNode { spec: n.clone(), now_ms: 0 });
    }
    s
}

/// Submits a one-node job of `qos` for `cpus` CPUs and `gpus` GPUs on `nodes` nodes.
fn submit_shape(s: &mut State, qos: &str, nodes: u32, cpus: u32, gpus: u32) {
    let spec = JobSpec {
        user: "u".into(),
        command: vec!["true".into()],
        nodes,
        cpus_per_task: cpus,
        gpus_per_node: gpus,
        qos: qos.into(),
        ..JobSpec::default()
    };
    let out = s.apply(4, &Command::SubmitJob { spec, identity: "u".into(), idempotency_key: String::new(), now_ms: 0 });
    assert!(matches!(out.outcome, Outcome::Submitted { .. }), "{:?}", out.outcome);
}

/// Starts every pending job a first-fit pass places.
fn start_all(s: &mut State) {
    let placements = first_fit(s);
    let out = s.apply(5, &Command::ApplySchedule { preemptions: vec![], placements, now_ms: 0 }).outcome;
    assert!(matches!(out, Outcome::ScheduleApplied { ref rejected, .. } if rejected.is_empty()), "{out:?}");
    assert!(s.pending.is_empty(), "every job runs");
}

/// A policy where QOS `high` preempts QOS `low`.
fn preempting() -> crate::policy::ClusterPolicy {
    use crate::policy::Qos;
    let mut p = crate::policy::ClusterPolicy::default();
    p.qos.insert("low".into(), Qos::default());
    p.qos.insert("high".into(), Qos { priority: 10, preempt: vec!["low".into()], ..Qos::default() });
    p
}

/// A pass tries PREEMPT_ATTEMPTS_PER_PASS_MAX preemptors: that many each
/// evict a victim and start; one more waits for the next pass.
#[test]
fn a_pass_tries_its_preempt_attempts_max_and_no_more() {
    // Full nodes: a victim of one GPU for every preemptor and one more.
    let nodes: Vec<NodeSpec> =
        (0..(PREEMPT_ATTEMPTS_PER_PASS_MAX + 1).div_ceil(8)).map(|i| node(&format!("n{i}"), 8)).collect();
    let mut s = cluster(preempting(), &nodes);
    for _ in 0..nodes.len() * 8 {
        submit_shape(&mut s, "low", 1, 1, 1);
    }
    start_all(&mut s);
    for count in [PREEMPT_ATTEMPTS_PER_PASS_MAX, PREEMPT_ATTEMPTS_PER_PASS_MAX + 1] {
        let mut s = s.clone();
        for _ in 0..count {
            submit_shape(&mut s, "high", 1, 1, 1);
        }
        let plan = plan(&s, &Options::new(Policy::FirstFit, 0));
        assert_eq!(
            (plan.preemptions.len(), plan.placements.len()),
            (PREEMPT_ATTEMPTS_PER_PASS_MAX, PREEMPT_ATTEMPTS_PER_PASS_MAX)
        );
        assert_eq!(plan.reasons.len(), count - PREEMPT_ATTEMPTS_PER_PASS_MAX, "{:?}", plan.reasons);
    }
}

/// A preemptor may evict preempt::VICTIMS_PER_JOB_MAX victims; one that
/// needs one more evicts nobody.
#[test]
fn a_preemptor_evicts_at_most_its_victims_max() {
    for need in [preempt::VICTIMS_PER_JOB_MAX, preempt::VICTIMS_PER_JOB_MAX + 1] {
        let mut big = node("a", 0);
        big.cpus = need as u32;
        let mut s = cluster(preempting(), &[big]);
        for _ in 0..need {
            submit_shape(&mut s, "low", 1, 1, 0);
        }
        start_all(&mut s);
        submit_shape(&mut s, "high", 1, need as u32, 0);
        let plan = plan(&s, &Options::new(Policy::FirstFit, 0));
        let evicted = if need <= preempt::VICTIMS_PER_JOB_MAX { need } else { 0 };
        assert_eq!((plan.preemptions.len(), plan.placements.len()), (evicted, usize::from(evicted > 0)));
    }
}

/// A pass tries WAKE_ATTEMPTS_PER_PASS_MAX jobs on powered-down pool
/// nodes: that many start there; one more waits for the next pass.
#[test]
fn a_pass_wakes_nodes_for_its_wake_attempts_max_and_no_more() {
    let mut policy = crate::policy::ClusterPolicy::default();
    let names: Vec<String> = (0..=WAKE_ATTEMPTS_PER_PASS_MAX).map(|i| format!("p{i:03}")).collect();
    let pool = crate::policy::NodePool { nodes: names, cpus: 1, ..crate::policy::NodePool::default() };
    policy.pools.insert("cloud".into(), pool);
    let s = cluster(policy, &[]);
    for count in [WAKE_ATTEMPTS_PER_PASS_MAX, WAKE_ATTEMPTS_PER_PASS_MAX + 1] {
        let mut s = s.clone();
        for _ in 0..count {
            submit_shape(&mut s, "", 1, 1, 0);
        }
        let plan = plan(&s, &Options::new(Policy::FirstFit, 0));
        assert_eq!(plan.placements.len(), WAKE_ATTEMPTS_PER_PASS_MAX);
        assert_eq!(plan.reasons.len(), count - WAKE_ATTEMPTS_PER_PASS_MAX, "{:?}", plan.reasons);
    }
}

/// A pass checks POSSIBLE_CHECKS_PER_PASS_MAX failed shapes beyond the
/// reservation candidates for whether they could ever run: that many read
/// BadConstraints; one more keeps the plain reason until a later pass.
#[test]
fn a_pass_checks_its_possible_checks_max_shapes_and_no_more() {
    let two: Vec<NodeSpec> = ["a", "b"]
        .map(|n| {
            let mut n = node(n, 0);
            n.cpus = 1000;
            n
        })
        .into();
    let s = cluster(crate::policy::ClusterPolicy::default(), &two);
    for count in [POSSIBLE_CHECKS_PER_PASS_MAX, POSSIBLE_CHECKS_PER_PASS_MAX + 1] {
        let mut s = s.clone();
        // Three nodes (never: there are two), each shape its own.
        for cpus in 1..=count {
            submit_shape(&mut s, "", 3, cpus as u32, 0);
        }
        let plan = plan(&s, &Options::new(Policy::FirstFit, 0));
        let bad = plan.reasons.iter().filter(|(_, r)| *r == Pending::BadConstraints).count();
        assert_eq!((bad, plan.reasons.len()), (POSSIBLE_CHECKS_PER_PASS_MAX, count), "{:?}", plan.reasons.last());
    }
}
