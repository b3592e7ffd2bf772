//! `gangway simulate`: replays a workload trace (Standard Workload Format,
//! optionally gzipped) through the core's scheduler and state machine in virtual
//! time, and prints wait, bounded slowdown and utilization per policy.

use std::io::{IsTerminal, Read};
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context};
use clap::Args;
use gangway_core::sim::{parse_gpu_trace, parse_swf, simulate_with_progress, SimConfig, SimPolicy};

/// Jobs one simulation may replay: the largest trace we ship has ~200,000.
const SIM_JOBS_MAX: usize = 1_000_000;
/// Compressed traces are decompressed into memory; 1 GiB is far above any trace.
const TRACE_BYTES_MAX: u64 = 1 << 30;

#[derive(Args)]
pub struct SimulateArgs {
    /// A trace: SWF (.swf or .swf.gz, e.g. ../shared/traces/swf/KTH-SP2-1996-2.1-cln.swf.gz),
    /// a Tiresias GPU CSV or a Gavel GPU trace.
    #[arg(long)]
    trace: PathBuf,
    /// Trace format: swf, gpu-csv or gavel (default: from the file name).
    #[arg(long)]
    format: Option<String>,
    /// Policies to compare: fcfs, first-fit, easy, easy-learned.
    #[arg(long, value_delimiter = ',', default_value = "fcfs,easy,easy-learned")]
    policy: Vec<String>,
    /// The machine: NODES[xCPUS[xGPUS]] per node, e.g. 240 or 16x64x8
    /// (default: the SWF header's MaxProcs single-CPU nodes; 16x64x8 for GPU traces).
    #[arg(long)]
    cluster: Option<String>,
    /// Seconds per training step for Gavel traces (they hold steps, not durations).
    #[arg(long, default_value_t = 100)]
    gavel_step_ms: u64,
    /// Replay only the first N jobs.
    #[arg(long)]
    limit: Option<usize>,
    /// Print one JSON object per policy instead of a table.
    #[arg(long)]
    json: bool,
}

/// Parses NODES[xCPUS[xGPUS]].
fn parse_cluster(s: &str) -> anyhow::Result<(u32, u32, u32)> {
    let parts: Vec<&str> = s.split('x').collect();
    let num = |i: usize, what: &str, default: u32| -> anyhow::Result<u32> {
        match parts.get(i) {
            None => Ok(default),
            Some(p) => p
                .parse::<u32>()
                .map_err(|_| anyhow::anyhow!("cluster: {what} '{p}' is not a number (NODES[xCPUS[xGPUS]])")),
        }
    };
    if parts.len() > 3 {
        bail!("cluster: '{s}' is not NODES[xCPUS[xGPUS]]");
    }
    let (n, c, g) = (num(0, "nodes", 1)?, num(1, "CPUs per node", 1)?, num(2, "GPUs per node", 0)?);
    if n == 0 || c == 0 || g > 16 {
        bail!("cluster: nodes and CPUs must be at least 1 and GPUs per node at most 16");
    }
    Ok((n, c, g))
}

/// A trace's text, refused (never cut short, which would replay part of
/// it as if it were whole) past TRACE_BYTES_MAX.
fn read_trace(reader: impl Read, name: &str) -> anyhow::Result<String> {
    let mut bytes = Vec::new();
    reader.take(TRACE_BYTES_MAX + 1).read_to_end(&mut bytes).with_context(|| format!("trace: cannot read {name}"))?;
    // The size first: the byte past the limit may cut a character in two.
    if bytes.len() as u64 > TRACE_BYTES_MAX {
        bail!("trace: {name} holds more than {TRACE_BYTES_MAX} bytes (decompressed): replay a part of it");
    }
    String::from_utf8(bytes).with_context(|| format!("trace: {name} is not UTF-8 text"))
}

pub fn run(a: SimulateArgs) -> anyhow::Result<()> {
    let file = std::fs::File::open(&a.trace).with_context(|| format!("trace: cannot open {}", a.trace.display()))?;
    let shown = a.trace.display().to_string();
    let text = if a.trace.extension().is_some_and(|e| e == "gz") {
        read_trace(flate2::read::GzDecoder::new(file), &shown)?
    } else {
        read_trace(file, &shown)?
    };
    let name = a.trace.to_string_lossy().to_string();
    let format = a.format.clone().unwrap_or_else(|| {
        if name.ends_with(".csv") {
            "gpu-csv".into()
        } else if name.ends_with(".trace") {
            "gavel".into()
        } else {
            "swf".into()
        }
    });
    let (mut trace, max_procs) = match format.as_str() {
        "swf" => parse_swf(&text),
        "gpu-csv" | "gavel" => {
            (parse_gpu_trace(&text, a.gavel_step_ms).map_err(|e| anyhow::anyhow!("trace: {e}"))?, None)
        }
        other => bail!("format: '{other}' is not a trace format (swf, gpu-csv, gavel)"),
    };
    jobs_to_replay(&mut trace, a.limit, &shown)?;
    let gpu_trace = format != "swf";
    let (nodes, cpn, gpn) = match (&a.cluster, max_procs) {
        (Some(c), _) => parse_cluster(c)?,
        (None, _) if gpu_trace => (16, 64, 8),
        (None, Some(p)) => (p, 1, 0),
        (None, None) => bail!("cluster: the trace names no MaxProcs; give --cluster NODES[xCPUS[xGPUS]]"),
    };
    if gpu_trace && gpn == 0 {
        bail!("cluster: a GPU trace needs GPUs per node (NODESxCPUSxGPUS)");
    }
    let policies: Vec<SimPolicy> = a
        .policy
        .iter()
        .map(|p| {
            SimPolicy::parse(p)
                .ok_or_else(|| anyhow::anyhow!("policy: '{p}' is not a policy (fcfs, first-fit, easy, easy-learned)"))
        })
        .collect::<anyhow::Result<_>>()?;
    if !a.json {
        println!("trace {}: {} jobs on {nodes} nodes × {cpn} CPUs × {gpn} GPUs", a.trace.display(), trace.len());
        println!(
            "{:>13} {:>8} {:>8} {:>12} {:>10} {:>10} {:>10} {:>10} {:>7} {:>11} {:>8}",
            "policy",
            "jobs",
            "skipped",
            "mean wait s",
            "p50 wait",
            "p95 wait",
            "mean bsld",
            "p95 bsld",
            "util %",
            "makespan s",
            "wall s"
        );
    }
    for policy in policies {
        let started = Instant::now();
        let cfg = SimConfig { nodes, cpus_per_node: cpn, gpus_per_node: gpn, policy };
        let mut quarter = 0;
        let r = simulate_with_progress(&trace, &cfg, &mut |done, total| {
            progress(policy.name(), done, total, started, &mut quarter)
        });
        if std::io::stderr().is_terminal() {
            eprint!("\r{:60}\r", "");
        }
        let wall = started.elapsed().as_secs_f64();
        if a.json {
            let v = serde_json::json!({
                "trace": name, "policy": policy.name(), "nodes": nodes, "cpus_per_node": cpn, "gpus_per_node": gpn,
                "jobs": r.jobs, "skipped": r.skipped, "mean_wait_s": r.mean_wait_s, "p50_wait_s": r.p50_wait_s,
                "p95_wait_s": r.p95_wait_s, "mean_bounded_slowdown": r.mean_bounded_slowdown,
                "p95_bounded_slowdown": r.p95_bounded_slowdown, "utilization": r.utilization,
                "makespan_s": r.makespan_s, "wall_s": wall,
            });
            println!("{v}");
        } else {
            println!(
                "{:>13} {:>8} {:>8} {:>12.0} {:>10.0} {:>10.0} {:>10.2} {:>10.2} {:>7.1} {:>11} {:>8.2}",
                policy.name(),
                r.jobs,
                r.skipped,
                r.mean_wait_s,
                r.p50_wait_s,
                r.p95_wait_s,
                r.mean_bounded_slowdown,
                r.p95_bounded_slowdown,
                r.utilization * 100.0,
                r.makespan_s,
                wall
            );
        }
    }
    Ok(())
}

/// Shows a replay's progress on stderr: a line rewritten in place on a
/// terminal, otherwise a line at each quarter (logs stay short).
fn progress(policy: &str, done: usize, total: usize, started: Instant, quarter: &mut usize) {
    let pct = done * 100 / total.max(1);
    let secs = started.elapsed().as_secs_f64();
    if std::io::stderr().is_terminal() {
        eprint!("\r  {policy}: {pct:>3}% ({done} of {total} jobs, {secs:.1} s)");
    } else if done * 4 / total.max(1) > *quarter {
        *quarter = done * 4 / total.max(1);
        eprintln!("  {policy}: {pct}% ({done} of {total} jobs, {secs:.1} s)");
    }
}

/// The trace's first `limit` jobs (all without one): at least one, and at
/// most [`SIM_JOBS_MAX`].
fn jobs_to_replay<T>(trace: &mut Vec<T>, limit: Option<usize>, shown: &str) -> anyhow::Result<()> {
    if let Some(n) = limit {
        trace.truncate(n);
    }
    if trace.is_empty() {
        bail!("trace: {shown} holds no usable jobs");
    }
    if trace.len() > SIM_JOBS_MAX {
        bail!("trace: {shown} holds {} jobs; at most {SIM_JOBS_MAX} are replayed (use --limit)", trace.len());
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// SIM_JOBS_MAX jobs are replayed; one more is refused unless --limit
    /// cuts the trace to the limit.
    #[test]
    fn a_simulation_replays_sim_jobs_max_jobs_at_most() {
        let mut at = vec![(); SIM_JOBS_MAX];
        jobs_to_replay(&mut at, None, "t.swf").unwrap();
        let mut past = vec![(); SIM_JOBS_MAX + 1];
        let e = jobs_to_replay(&mut past, None, "t.swf").unwrap_err().to_string();
        assert!(e.starts_with("trace: t.swf") && e.contains(&SIM_JOBS_MAX.to_string()), "{e}");
        jobs_to_replay(&mut past, Some(SIM_JOBS_MAX), "t.swf").unwrap();
        assert_eq!(past.len(), SIM_JOBS_MAX);
        assert!(jobs_to_replay(&mut Vec::<()>::new(), None, "t.swf").is_err());
    }

    /// A trace of TRACE_BYTES_MAX bytes is read whole; one byte more is
    /// refused, never replayed cut short.
    #[test]
    fn a_trace_is_read_whole_or_refused() {
        let at = read_trace(std::io::repeat(b'x').take(TRACE_BYTES_MAX), "t.swf").unwrap();
        assert_eq!(at.len() as u64, TRACE_BYTES_MAX);
        drop(at);
        let e = read_trace(std::io::repeat(b'x').take(TRACE_BYTES_MAX + 1), "t.swf").unwrap_err().to_string();
        assert!(e.starts_with("trace: t.swf") && e.contains(&TRACE_BYTES_MAX.to_string()), "{e}");
    }
}
