//! Every chaos scenario once, as the CI smoke set: real multi-host clusters
//! (network namespaces), seeded faults under a client workload, every checker.
//! A failure prints the command that reproduces it with the same seed and
//! keeps the logs, the history summary and the agents' execution records.
//!
//! `CHAOS_SEED` picks the fault schedule, `CHAOS_DURATION_S` the length of the
//! loaded phase (defaults: 1 and 12 s). `gangway-chaos` runs them by name, for
//! longer and over many seeds.

use std::time::Duration;

use gangway_chaos_tests::scenario;

fn env_u64(name: &str, default: u64) -> u64 {
    std::env::var(name).ok().and_then(|v| v.parse().ok()).unwrap_or(default)
}

async fn smoke(name: &str) {
    let s = scenario::find(name).expect("a known scenario");
    let seed = env_u64("CHAOS_SEED", 1);
    let duration = Duration::from_secs(env_u64("CHAOS_DURATION_S", 12));
    match scenario::run_kept_on_failure(s, seed, duration).await {
        Ok(r) if r.violations.is_empty() => println!("{}", r.summary),
        Ok(r) => panic!("{} violations:\n{}\n{}", r.violations.len(), r.violations.join("\n"), r.summary),
        Err(e) => panic!("{name} seed {seed} could not be judged: {e:#}"),
    }
}

/// Leader SIGKILLed and restarted, a random replica SIGKILLed, leader paused
/// (SIGSTOP/SIGCONT), leader isolated by iptables, a majority SIGKILLed and
/// restarted, a replica replaced (a new one joins, a follower is removed).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_faults() {
    smoke("leader-faults").await;
}

/// Majority/minority splits, a bridge, one-way loss, random packet loss, an
/// agent cut off from every controller (a real node failure: its tasks stop
/// and are requeued), every replica restarted at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn partitions() {
    smoke("partitions").await;
}

/// Five replicas: leader and random replicas killed, three of five killed
/// (no quorum) then restarted, the leader and a follower split from the other
/// three, a bridge, a pause, a replica replaced.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn five_replicas() {
    smoke("five-replicas").await;
}

/// A rolling upgrade under load: three replicas start on the previous data
/// format's build (`GANGWAY_PREVIOUS_BIN`, built by `make previous`) and are
/// replaced one at a time by this build while clients submit, cancel and read
/// and leaders are killed; then the cluster moves to the newest format. Every
/// checker judges the history across the mixed-build phase.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn rolling_upgrade() {
    smoke("rolling-upgrade").await;
}
