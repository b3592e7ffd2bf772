//! `gangway bench sched`: the scheduler's speed on a synthetic cluster —
//! 10,000 nodes × 8 GPUs in a block/rack topology with a long queue of 1-GPU
//! jobs and 16–512-GPU gangs. Runs the core's `plan` and `apply` in process
//! (no network): what one leader pass costs.
//!
//! Reports: memory per pending job (resident set growth while submitting),
//! placement throughput while filling an empty cluster (passes planned and
//! applied until nothing more fits), and the time of one full pass over the
//! queue on the full cluster (every pending job examined).

use std::time::Instant;

use clap::Args;
use gangway_core::command::Command;
use gangway_core::policy::{Account, ClusterPolicy, User};
use gangway_core::sched::{plan, Options, Policy};
use gangway_core::spec::{GpuSpec, JobSpec, NodeSpec};
use gangway_core::{Outcome, State};

/// Passes while filling the cluster: with 512 gangs per plan this covers
/// well over 80,000 GPUs of placements.
const FILL_PASSES_MAX: usize = 2_000;

/// Runs scheduling passes (`pass()` plans, applies, and says how many it
/// placed) until one places nothing, [`FILL_PASSES_MAX`] at most: the
/// placements, the passes, and whether the cluster filled within them.
fn fill(mut pass: impl FnMut() -> anyhow::Result<usize>) -> anyhow::Result<(usize, usize, bool)> {
    let mut placed = 0usize;
    for passes in 1..=FILL_PASSES_MAX {
        match pass()? {
            0 => return Ok((placed, passes, true)),
            n => placed += n,
        }
    }
    Ok((placed, FILL_PASSES_MAX, false))
}

#[derive(Args)]
pub struct SchedArgs {
    #[arg(long, default_value_t = 10_000)]
    nodes: u32,
    #[arg(long, default_value_t = 8)]
    gpus_per_node: u32,
    /// Queue lengths to measure, in order.
    #[arg(long, value_delimiter = ',', default_value = "100000,1000000")]
    pending: Vec<usize>,
    /// Nodes per rack and racks per block.
    #[arg(long, default_value_t = 32)]
    rack_nodes: u32,
    #[arg(long, default_value_t = 16)]
    block_racks: u32,
}

fn rss_kb() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok())
        })
        .unwrap_or(0)
}

/// A deterministic job mix: 80% one-GPU jobs, 20% gangs of 2-64 full nodes.
fn job(i: usize, gpn: u32) -> JobSpec {
    let mut x = (i as u64).wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
    x ^= x >> 33;
    let user = format!("user{}", x % 50);
    let (nodes, gpus) = if x.is_multiple_of(5) {
        let gang_gpus = [16u32, 32, 64, 128, 256, 512][(x / 7 % 6) as usize];
        (gang_gpus.div_ceil(gpn), gpn)
    } else {
        (1, 1)
    };
    JobSpec {
        name: format!("train-{}", x % 1000),
        user,
        command: vec!["python".into(), "train.py".into()],
        workdir: "/home/u".into(),
        nodes,
        cpus_per_task: 4 * gpus,
        gpus_per_node: gpus,
        mem_per_node_mb: 16 * 1024 * u64::from(gpus),
        time_limit_s: [3600, 4 * 3600, 24 * 3600][(x / 11 % 3) as usize],
        ..JobSpec::default()
    }
}

/// The synthetic cluster: racks of `rack_nodes`, blocks of `block_racks`
/// racks, GPUs in NVLink islands of 4.
fn node_specs(a: &SchedArgs) -> Vec<NodeSpec> {
    (0..a.nodes)
        .map(|n| {
            let rack = n / a.rack_nodes;
            NodeSpec {
                name: format!("gpu{n:05}"),
                addr: String::new(),
                cpus: 128,
                mem_mb: 2 * 1024 * 1024,
                gpus: (0..a.gpus_per_node)
                    .map(|g| GpuSpec {
                        uuid: format!("GPU-{n}-{g}"),
                        model: "h100-80gb".into(),
                        mem_mb: 81920,
                        nvlink_island: g / 4,
                    })
                    .collect(),
                topology: vec![format!("block{}", rack / a.block_racks), format!("rack{rack}")],
                labels: Default::default(),
            }
        })
        .collect()
}

pub fn run(a: SchedArgs) -> anyhow::Result<()> {
    println!(
        "cluster: {} nodes × {} GPUs ({} GPUs), racks of {} nodes, blocks of {} racks; {} CPUs",
        a.nodes,
        a.gpus_per_node,
        a.nodes * a.gpus_per_node,
        a.rack_nodes,
        a.block_racks,
        std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1)
    );
    for &pending in &a.pending {
        measure(&a, pending)?;
    }
    small_job_fill(&a)
}

/// Placement throughput for single-GPU jobs: an empty cluster and a queue of
/// one-GPU jobs, planned and applied until the cluster is full.
fn small_job_fill(a: &SchedArgs) -> anyhow::Result<()> {
    let mut state = State::default();
    let mut index = 0u64;
    let mut apply = |state: &mut State, cmd: &Command| {
        index += 1;
        state.apply(index, cmd)
    };
    for spec in node_specs(a) {
        apply(&mut state, &Command::RegisterNode { spec, now_ms: 0 });
    }
    let total = (a.nodes * a.gpus_per_node) as usize;
    for i in 0..total + total / 4 {
        let spec = JobSpec {
            user: format!("user{}", i % 50),
            command: vec!["python".into(), "infer.py".into()],
            cpus_per_task: 4,
            gpus_per_node: 1,
            time_limit_s: 3600,
            ..JobSpec::default()
        };
        apply(
            &mut state,
            &Command::SubmitJob { spec, identity: "bench".into(), idempotency_key: String::new(), now_ms: i as u64 },
        );
    }
    let now = total as u64 * 2;
    let mut plan_s = 0.0;
    let (placed, passes, filled) = fill(|| {
        let t = Instant::now();
        let p = plan(&state, &Options::new(Policy::Easy, now));
        plan_s += t.elapsed().as_secs_f64();
        let n = p.placements.len();
        if n > 0 {
            apply(
                &mut state,
                &Command::ApplySchedule { preemptions: p.preemptions, placements: p.placements, now_ms: now },
            );
        }
        Ok(n)
    })?;
    println!(
        "\n1-GPU jobs on the empty cluster ({} queued): {placed} placed in {passes} passes{}, {:.0} ms planning = {:.0} placements/s",
        total + total / 4,
        if filled { "" } else { " (cut at FILL_PASSES_MAX)" },
        plan_s * 1000.0,
        placed as f64 / plan_s.max(1e-9)
    );
    Ok(())
}

fn measure(a: &SchedArgs, pending: usize) -> anyhow::Result<()> {
    let mut state = State::default();
    let mut index = 0u64;
    let mut apply = |state: &mut State, cmd: &Command| {
        index += 1;
        state.apply(index, cmd)
    };
    let mut policy = ClusterPolicy { topology_levels: vec!["block".into(), "rack".into()], ..ClusterPolicy::default() };
    for acct in 0..10 {
        policy.accounts.insert(format!("team{acct}"), Account { shares: 1 + acct, ..Account::default() });
    }
    for u in 0..50 {
        policy.users.insert(format!("user{u}"), User { accounts: vec![format!("team{}", u % 10)], ..User::default() });
    }
    let cmd = Command::UpdatePolicy {
        policy,
        expected_version: None,
        force: false,
        identity: "server:bench".into(),
        now_ms: 0,
    };
    anyhow::ensure!(matches!(apply(&mut state, &cmd).outcome, Outcome::PolicyUpdated { .. }), "policy refused");
    for spec in node_specs(a) {
        apply(&mut state, &Command::RegisterNode { spec, now_ms: 0 });
    }
    let rss_before = rss_kb();
    let t = Instant::now();
    for i in 0..pending {
        let spec = job(i, a.gpus_per_node);
        let cmd =
            Command::SubmitJob { spec, identity: "bench".into(), idempotency_key: String::new(), now_ms: i as u64 };
        apply(&mut state, &cmd);
    }
    let submit_s = t.elapsed().as_secs_f64();
    let rss_after = rss_kb();
    let per_job = (rss_after.saturating_sub(rss_before) * 1024) as f64 / pending as f64;
    println!(
        "\n{pending} pending jobs: submitted (applied) in {submit_s:.2} s; resident memory +{} MiB = {per_job:.0} bytes per pending job",
        rss_after.saturating_sub(rss_before) / 1024
    );
    // Fill the empty cluster: plan, apply, repeat until nothing more fits.
    let now = pending as u64 + 1000;
    let mut plan_s = 0.0;
    let mut first_pass = None;
    let (placed, passes, filled) = fill(|| {
        let t = Instant::now();
        let p = plan(&state, &Options::new(Policy::Easy, now));
        let dt = t.elapsed().as_secs_f64();
        plan_s += dt;
        first_pass.get_or_insert((dt, p.placements.len(), p.examined));
        let n = p.placements.len();
        if n > 0 {
            let out = apply(
                &mut state,
                &Command::ApplySchedule { preemptions: p.preemptions, placements: p.placements, now_ms: now },
            );
            if let Outcome::ScheduleApplied { rejected, .. } = out.outcome {
                anyhow::ensure!(rejected.is_empty(), "apply rejected planned gangs: {rejected:?}");
            }
        }
        Ok(n)
    })?;
    anyhow::ensure!(filled, "the cluster did not fill within {FILL_PASSES_MAX} passes");
    let gpus_used: usize =
        state.nodes.values().map(|n| n.gpus.iter().filter(|g| g.allocated_to.is_some()).count()).sum();
    let (fp_s, fp_n, fp_ex) = first_pass.unwrap_or((0.0, 0, 0));
    println!(
        "fill from empty: {placed} gangs placed in {passes} passes, {:.0} ms planning = {:.0} placements/s; {gpus_used} of {} GPUs in use \
         (first pass: {:.1} ms, {fp_n} placed, {fp_ex} examined)",
        plan_s * 1000.0,
        placed as f64 / plan_s.max(1e-9),
        a.nodes * a.gpus_per_node,
        fp_s * 1000.0
    );
    // One full pass over the whole queue on the full cluster.
    let mut times = Vec::new();
    let mut last = None;
    for _ in 0..3 {
        let t = Instant::now();
        let p = plan(&state, &Options::new(Policy::Easy, now + 1000));
        times.push(t.elapsed().as_secs_f64() * 1000.0);
        last = Some(p);
    }
    times.sort_by(|x, y| x.total_cmp(y));
    let p = last.expect("ran");
    // The part of a pass that orders the queue (priority factors and the sort).
    let t = Instant::now();
    let prio = gangway_core::sched::Prioritizer::new(&state, now + 1000);
    let t_prio = t.elapsed().as_secs_f64() * 1000.0;
    let mut keyed: Vec<(u32, f64, u64)> = state
        .jobs
        .values()
        .filter(|j| j.state == gangway_core::JobState::Pending)
        .map(|j| {
            let (tier, p) = prio.key(j);
            (tier, p, j.id)
        })
        .collect();
    let t_keys = t.elapsed().as_secs_f64() * 1000.0 - t_prio;
    keyed.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(b.1.total_cmp(&a.1)).then(a.2.cmp(&b.2)));
    let t_sort = t.elapsed().as_secs_f64() * 1000.0 - t_prio - t_keys;
    println!("  ordering alone: fair share {t_prio:.1} ms, priority keys {t_keys:.1} ms, sort {t_sort:.1} ms");
    println!(
        "full pass on the full cluster: median {:.1} ms (min {:.1}, max {:.1}) over {} pending jobs, {} examined, {} placement attempts, {} reservations",
        times[1],
        times[0],
        times[2],
        state.pending.len(),
        p.examined,
        p.place_attempts,
        p.reservations.len()
    );
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A fill that needs FILL_PASSES_MAX passes (the last placing nothing)
    /// fills; one that places on every pass is cut there.
    #[test]
    fn a_fill_takes_fill_passes_max_passes_at_most() {
        let mut left = FILL_PASSES_MAX - 1;
        let ends = fill(|| {
            let n = usize::from(left > 0);
            left = left.saturating_sub(1);
            Ok(n)
        })
        .unwrap();
        assert_eq!(ends, (FILL_PASSES_MAX - 1, FILL_PASSES_MAX, true));
        let mut calls = 0;
        let endless = fill(|| {
            calls += 1;
            Ok(2)
        });
        assert_eq!(endless.unwrap(), (2 * FILL_PASSES_MAX, FILL_PASSES_MAX, false));
        assert_eq!(calls, FILL_PASSES_MAX, "no pass past the limit");
    }
}
