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
