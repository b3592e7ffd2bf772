//! `gangway-chaos`: runs chaos scenarios by name against real multi-host
//! clusters on this machine (network namespaces; needs root and the `gangway`
//! binary next to this one, or `GANGWAY_BIN`), prints each run's summary and
//! the results table, and exits non-zero if any checker found a violation.
//!
//! ```text
//! gangway-chaos --scenario partitions --seed 7 --duration 30
//! gangway-chaos --scenario all --runs 5 --duration 60 --results chaos-results.md
//! ```

use std::time::Duration;

use clap::Parser;
use gangway_chaos_tests::scenario::{self, SCENARIOS};

#[derive(Parser)]
#[command(name = "gangway-chaos", about = "Fault-injection runs of real Gangway clusters, with checked invariants")]
struct Args {
    /// A scenario name, or `all`. `--list` names them.
    #[arg(long, default_value = "all")]
    scenario: String,
    /// The first run's seed (the fault schedule and the clients' choices).
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Runs per scenario, with seeds `seed`, `seed+1`, ...
    #[arg(long, default_value_t = 1)]
    runs: u64,
    /// Seconds of load with faults in each run (recovery comes after).
    #[arg(long, default_value_t = 12)]
    duration: u64,
    /// Also write the Markdown results table to this file.
    #[arg(long)]
    results: Option<std::path::PathBuf>,
    /// List the scenarios and exit.
    #[arg(long)]
    list: bool,
}

fn main() -> anyhow::Result<()> {
    let args = Args::parse();
    if args.list {
        for s in SCENARIOS {
            println!("{:<16} {}", s.name, s.about);
        }
        return Ok(());
    }
    let chosen: Vec<&scenario::Scenario> = if args.scenario == "all" {
        SCENARIOS.iter().collect()
    } else {
        match scenario::find(&args.scenario) {
            Some(s) => vec![s],
            None => {
                let names: Vec<&str> = SCENARIOS.iter().map(|s| s.name).collect();
                anyhow::bail!("--scenario: unknown scenario {:?}; known: all, {}", args.scenario, names.join(", "));
            }
        }
    };
    let duration = Duration::from_secs(args.duration);
    let seeds = scenario::check_runs(args.seed, args.runs, duration).map_err(anyhow::Error::msg)?;
    let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(4).enable_all().build()?;
    let mut reports = Vec::new();
    let mut failed = 0;
    for s in chosen {
        for seed in seeds.clone() {
            match rt.block_on(scenario::run_kept_on_failure(s, seed, duration)) {
                Ok(r) => {
                    println!("{}", r.summary);
                    for v in &r.violations {
                        println!("  VIOLATION: {v}");
                    }
                    failed += usize::from(!r.violations.is_empty());
                    reports.push(r);
                }
                Err(e) => {
                    println!("{} seed {seed}: could not be judged: {e:#}", s.name);
                    failed += 1;
                }
            }
        }
    }
    let table = scenario::results_table(&reports);
    println!("\n{table}");
    if let Some(path) = &args.results {
        std::fs::write(path, &table).map_err(|e| anyhow::anyhow!("--results: cannot write {}: {e}", path.display()))?;
    }
    anyhow::ensure!(failed == 0, "{failed} run(s) failed; each printed the command that reproduces it");
    Ok(())
}
