//! `gangway simulate`: replays a workload trace (Standard Workload Format,
//! optionally gzipped) through the core's scheduler and state machine in virtual
//! time, and prints wait, bounded slowdown and utilization per policy.

use std::io::Read;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use gangway_core::sched::Policy;
use gangway_core::sim::{parse_swf, simulate, SimConfig};

/// Jobs one simulation may replay: the largest trace we ship has ~200,000.
const SIM_JOBS_MAX: usize = 1_000_000;
/// Compressed traces are decompressed into memory; 1 GiB is far above any trace.
const TRACE_BYTES_MAX: u64 = 1 << 30;

#[derive(Args)]
pub struct SimulateArgs {
    /// An SWF trace (.swf or .swf.gz), e.g. ../shared/traces/swf/KTH-SP2-1996-2.1-cln.swf.gz
    #[arg(long)]
    trace: PathBuf,
    /// Policies to compare: fifo, first-fit, easy.
    #[arg(long, value_delimiter = ',', default_value = "fifo,first-fit,easy")]
    policy: Vec<String>,
    /// Nodes in the simulated machine (default: the trace's MaxProcs / cpus-per-node).
    #[arg(long)]
    nodes: Option<u32>,
    #[arg(long, default_value_t = 1)]
    cpus_per_node: u32,
    /// Replay only the first N jobs.
    #[arg(long)]
    limit: Option<usize>,
}

pub fn run(a: SimulateArgs) -> anyhow::Result<()> {
    let file = std::fs::File::open(&a.trace).with_context(|| format!("trace: cannot open {}", a.trace.display()))?;
    let mut text = String::new();
    if a.trace.extension().is_some_and(|e| e == "gz") {
        flate2::read::GzDecoder::new(file).take(TRACE_BYTES_MAX).read_to_string(&mut text)
    } else {
        file.take(TRACE_BYTES_MAX).read_to_string(&mut text)
    }
    .with_context(|| format!("trace: cannot read {}", a.trace.display()))?;
    let (mut trace, max_procs) = parse_swf(&text);
    if let Some(n) = a.limit {
        trace.truncate(n);
    }
    if trace.is_empty() {
        bail!("trace: {} holds no usable jobs", a.trace.display());
    }
    if trace.len() > SIM_JOBS_MAX {
        bail!("trace: at most {SIM_JOBS_MAX} jobs (use --limit)");
    }
    let cpn = a.cpus_per_node.max(1);
    let nodes = match (a.nodes, max_procs) {
        (Some(n), _) => n,
        (None, Some(p)) => p.div_ceil(cpn),
        (None, None) => bail!("nodes: the trace names no MaxProcs; give --nodes"),
    };
    println!("trace {}: {} jobs on {nodes} nodes × {cpn} CPUs", a.trace.display(), trace.len());
    println!(
        "{:>10} {:>8} {:>8} {:>14} {:>12} {:>12} {:>10} {:>9}",
        "policy", "jobs", "skipped", "mean wait s", "mean bsld", "p95 bsld", "util %", "wall s"
    );
    for p in &a.policy {
        let policy = match p.as_str() {
            "fifo" => Policy::Fifo,
            "first-fit" => Policy::FirstFit,
            "easy" => Policy::Easy,
            other => bail!("policy: '{other}' is not a policy (fifo, first-fit, easy)"),
        };
        let started = Instant::now();
        let r = simulate(&trace, &SimConfig { nodes, cpus_per_node: cpn, policy });
        println!(
            "{:>10} {:>8} {:>8} {:>14.0} {:>12.2} {:>12.2} {:>10.1} {:>9.2}",
            p,
            r.jobs,
            r.skipped,
            r.mean_wait_s,
            r.mean_bounded_slowdown,
            r.p95_bounded_slowdown,
            r.utilization * 100.0,
            started.elapsed().as_secs_f64()
        );
    }
    Ok(())
}
