//! `gangway-sim`: runs the deterministic whole-cluster simulation.
//!
//! ```text
//! gangway-sim --seed 42 --trace      one seed, its trace printed
//! gangway-sim --seeds 10000          seeds 1..=10000 (or --first N), a summary
//! gangway-sim --seeds 1000 --swarm   each seed with its own fault mix
//! ```
//! A failing seed prints its violations; rerunning it with `--seed` reproduces
//! the run exactly.

use std::process::ExitCode;

use gangway_sim::{run_seed, Bug, Config};

fn usage() -> ExitCode {
    eprintln!(
        "usage: gangway-sim [--seed N | --seeds COUNT [--first N]] [--trace] [--shim] [--swarm] [--nodes N] [--jobs N] \
         [--bug no-self-fence|forget-fences|no-completing-wait|no-shim-lease|answer-silent-nodes|evict-first]"
    );
    ExitCode::from(2)
}

fn main() -> ExitCode {
    let mut args = std::env::args().skip(1);
    let mut cfg = Config::default();
    let (mut first, mut count, mut trace) = (1u64, 200u64, false);
    while let Some(a) = args.next() {
        let mut num = |what: &str| -> Option<u64> {
            let v = args.next().and_then(|v| v.parse().ok());
            if v.is_none() {
                eprintln!("{what}: needs a number");
            }
            v
        };
        match a.as_str() {
            "--seed" => {
                let Some(s) = num("--seed") else { return usage() };
                (first, count) = (s, 1);
            }
            "--seeds" => {
                let Some(n) = num("--seeds") else { return usage() };
                count = n;
            }
            "--first" => {
                let Some(n) = num("--first") else { return usage() };
                first = n;
            }
            "--nodes" => {
                let Some(n) = num("--nodes").and_then(|n| u32::try_from(n).ok()).filter(|n| (1..=64).contains(n))
                else {
                    return usage();
                };
                cfg.nodes = n;
            }
            "--jobs" => {
                let Some(n) = num("--jobs").and_then(|n| u32::try_from(n).ok()).filter(|n| (1..=10_000).contains(n))
                else {
                    return usage();
                };
                cfg.jobs = n;
            }
            "--trace" => trace = true,
            "--shim" => cfg.shim = true,
            "--swarm" => cfg.swarm = true,
            "--bug" => {
                let Some(bug) = args.next().as_deref().and_then(Bug::parse) else { return usage() };
                cfg.bug = Some(bug);
            }
            _ => return usage(),
        }
    }
    let started = std::time::Instant::now();
    let (mut failed, mut events, mut sim_ms) = (0u64, 0u64, 0u64);
    for seed in first..first.saturating_add(count) {
        let r = run_seed(seed, &cfg, trace);
        events += r.events;
        sim_ms += r.sim_ms;
        if trace {
            print!("{}", r.trace);
        }
        if !r.violations.is_empty() {
            failed += 1;
            println!("seed {seed}: FAILED ({} violations; rerun with --seed {seed} --trace)", r.violations.len());
            for v in &r.violations {
                println!("  {v}");
            }
        } else if count == 1 {
            println!(
                "seed {seed}: ok: {} jobs completed, {} ended otherwise, {} launches, {} preempted ({} of them \
                 suspended), {} suspended by the operator, {} nodes marked down, {} elections, {} log entries, {} events, {:.0} s simulated",
                r.jobs_completed,
                r.jobs_failed,
                r.launches,
                r.preempted,
                r.preempt_suspended,
                r.suspended,
                r.nodes_marked_down,
                r.elections,
                r.entries,
                r.events,
                r.sim_ms as f64 / 1000.0
            );
        }
    }
    let secs = started.elapsed().as_secs_f64();
    println!(
        "{count} seeds from {first}: {failed} failed; {:.1} seeds/s, {:.0} events/s, {:.0}x real time",
        count as f64 / secs,
        events as f64 / secs,
        sim_ms as f64 / 1000.0 / secs
    );
    if failed > 0 {
        ExitCode::FAILURE
    } else {
        ExitCode::SUCCESS
    }
}
