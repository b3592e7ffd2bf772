//! The scenarios: a cluster shape and the faults it draws from, run under a
//! client workload, then healed and judged by every checker. Shared by the
//! test suite (tests/chaos.rs) and the `gangway-chaos` binary.

use std::path::Path;
use std::sync::Arc;
use std::time::{Duration, Instant};

use gangway_proto::v1 as pb;
use gangway_proto::v1::job_service_client::JobServiceClient;

use crate::check;
use crate::cluster::ChaosCluster;
use crate::history::{self, History, Outcome};
use crate::{workload, Rng};

/// Bound on every recovery wait: far above a healthy cluster's (leader in
/// ~1 s, queue drained in a few).
pub const RECOVER: Duration = Duration::from_secs(60);
/// Concurrent clients in the workload.
const CLIENTS: usize = 3;
/// No fault starts this close to the end of the loaded phase, so the last one
/// is over before healing begins.
const LAST_FAULT_BEFORE_END: Duration = Duration::from_secs(4);
/// The longest loaded phase the binary accepts: the history and the records
/// stay far below their caps.
pub const DURATION_MAX: Duration = Duration::from_secs(3600);
/// The shortest run: faults start only while more than
/// LAST_FAULT_BEFORE_END of load remains.
pub const DURATION_MIN: Duration = Duration::from_secs(5);
/// Runs per scenario in one invocation: a long matrix is still bounded.
pub const RUNS_MAX: u64 = 1000;

/// The seeds of `runs` runs from `seed`, each of `duration`, or what is wrong
/// with them, naming the flag.
pub fn check_runs(seed: u64, runs: u64, duration: Duration) -> Result<std::ops::Range<u64>, String> {
    if !(1..=RUNS_MAX).contains(&runs) {
        return Err(format!("--runs: must be 1 to {RUNS_MAX}"));
    }
    if !(DURATION_MIN..=DURATION_MAX).contains(&duration) {
        return Err(format!(
            "--duration: must be {} to {} seconds (faults start only while more than {} s of load remain)",
            DURATION_MIN.as_secs(),
            DURATION_MAX.as_secs(),
            LAST_FAULT_BEFORE_END.as_secs()
        ));
    }
    let end = seed.checked_add(runs).ok_or_else(|| format!("--seed: {seed} and {runs} runs pass the last seed"))?;
    Ok(seed..end)
}

/// The faults a scenario draws from, in its seeded order.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// The leader SIGKILLed, then restarted.
    KillLeader,
    /// A random replica (perhaps the leader) SIGKILLed, then restarted.
    KillRandom,
    /// The leader SIGSTOPped, then SIGCONTed: a paused ex-leader must not act.
    PauseLeader,
    /// The leader cut off from every host.
    IsolateLeader,
    /// The leader on the minority side of a split (alone, with 3 replicas).
    SplitLeaderAway,
    /// The leader and one follower cannot talk; the others see both.
    Bridge,
    /// A follower stops hearing the leader (the leader still hears it).
    OneWayLoss,
    /// An agent loses every controller for longer than half the node-down timeout.
    CutOffAgent,
    /// Every replica SIGKILLed, then all restarted (recovery from disk).
    RestartAll,
    /// The leader and enough followers to lose the quorum SIGKILLed together, then restarted.
    KillMajority,
    /// Every host drops a fifth of what it receives, at random.
    PacketLoss,
    /// A new replica joins (learner, then voter) and a follower is removed.
    ReplaceMember,
    /// An agent SIGKILLed, then restarted on its state: its tasks run on
    /// under their shims and are re-adopted (steps it started are ended).
    RestartAgent,
    /// The next replica still on the previous data format's build is stopped
    /// and started on its data with this build (a rolling upgrade's step);
    /// with none left, a random replica is killed and restarted.
    UpgradeNext,
}

pub struct Scenario {
    pub name: &'static str,
    pub about: &'static str,
    pub controllers: usize,
    pub agents: usize,
    pub faults: &'static [Fault],
    /// The replicas start on the previous data format's build.
    pub previous: bool,
}

impl Scenario {
    /// An agent cut off is a real node failure; other faults must never fail a node.
    fn fails_nodes(&self) -> bool {
        self.faults.contains(&Fault::CutOffAgent)
    }
}

pub const SCENARIOS: &[Scenario] = &[
    Scenario {
        name: "leader-faults",
        about: "3 replicas: leader killed, a random replica killed, leader paused, leader isolated, a majority killed, a replica replaced",
        controllers: 3,
        agents: 2,
        faults: &[
            Fault::KillLeader,
            Fault::KillRandom,
            Fault::PauseLeader,
            Fault::IsolateLeader,
            Fault::KillMajority,
            Fault::ReplaceMember,
        ],
        previous: false,
    },
    Scenario {
        name: "partitions",
        about: "3 replicas: leader split away, bridge, one-way loss, packet loss, an agent cut off or restarted, every replica restarted",
        controllers: 3,
        agents: 2,
        faults: &[
            Fault::SplitLeaderAway,
            Fault::Bridge,
            Fault::OneWayLoss,
            Fault::CutOffAgent,
            Fault::RestartAgent,
            Fault::RestartAll,
            Fault::PacketLoss,
        ],
        previous: false,
    },
    Scenario {
        name: "five-replicas",
        about: "5 replicas: leader killed, random replicas killed, 3 of 5 killed, leader with one follower split away, bridge, a replica replaced",
        controllers: 5,
        agents: 3,
        faults: &[
            Fault::KillLeader,
            Fault::KillRandom,
            Fault::KillMajority,
            Fault::SplitLeaderAway,
            Fault::Bridge,
            Fault::PauseLeader,
            Fault::ReplaceMember,
        ],
        previous: false,
    },
    Scenario {
        name: "rolling-upgrade",
        about: "3 replicas on the previous data format's build, replaced one at a time by this build under load \
                (leaders killed too); the cluster then moves to the newest format",
        controllers: 3,
        agents: 2,
        faults: &[Fault::UpgradeNext, Fault::UpgradeNext, Fault::KillLeader],
        previous: true,
    },
];

pub fn find(name: &str) -> Option<&'static Scenario> {
    SCENARIOS.iter().find(|s| s.name == name)
}

/// What one run saw; `violations` empty means every checker passed.
#[derive(Debug, Clone)]
pub struct Report {
    pub scenario: &'static str,
    pub seed: u64,
    /// Client operations: submits, cancels and queries.
    pub operations: usize,
    pub submits: usize,
    pub acknowledged: usize,
    pub faults: Vec<String>,
    pub violations: Vec<String>,
    /// The longest stretch in which no client operation succeeded.
    pub worst_gap: Duration,
    /// From healing to a leader, an empty queue and converged replicas.
    pub recovered: Duration,
    pub summary: String,
}

async fn eventually<F, Fut>(what: &str, mut cond: F) -> anyhow::Result<()>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = bool>,
{
    let deadline = Instant::now() + RECOVER;
    while !cond().await {
        anyhow::ensure!(Instant::now() < deadline, "{what} within {RECOVER:?}");
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    Ok(())
}

/// Every job one replica holds, read from its own state (stale read, no forwarding).
async fn jobs_of(c: &ChaosCluster, replica: usize) -> anyhow::Result<Vec<pb::Job>> {
    let mut all = Vec::new();
    let mut after_id = 0;
    loop {
        let mut req =
            tonic::Request::new(pb::ListJobsRequest { stale: true, limit: 10_000, after_id, ..Default::default() });
        req.set_timeout(Duration::from_secs(5));
        let resp = JobServiceClient::new(c.channel_of(replica)?).list(req).await?.into_inner();
        all.extend(resp.jobs);
        if resp.next_after_id == 0 {
            return Ok(all);
        }
        after_id = resp.next_after_id;
    }
}

async fn inject(c: &mut ChaosCluster, fault: Fault, rng: &mut Rng) -> anyhow::Result<String> {
    let leader = c.leader(RECOVER).await?;
    let host = c.controllers[leader].host;
    let members = c.members();
    let followers: Vec<usize> = members.iter().copied().filter(|&i| i != leader).collect();
    let others: Vec<usize> = followers.iter().map(|&i| c.controllers[i].host).collect();
    // Followers that go with the leader to make it lose its quorum, or to
    // leave it on the minority side: (n - 1) / 2 of them with the leader are a
    // minority; one more makes a majority.
    let minority_followers = (members.len() - 1) / 2 - 1;
    let pause = |ms| tokio::time::sleep(Duration::from_millis(ms));
    let pick = |rng: &mut Rng, from: &[usize]| from[rng.below(from.len() as u64) as usize];
    Ok(match fault {
        Fault::KillLeader => {
            c.controllers[leader].kill();
            pause(1500).await;
            c.restart_controller(leader)?;
            format!("kill leader {}", leader + 1)
        }
        Fault::KillRandom => {
            let i = pick(rng, &members);
            c.controllers[i].kill();
            pause(1500).await;
            c.restart_controller(i)?;
            format!("kill replica {}{}", i + 1, if i == leader { " (leader)" } else { "" })
        }
        Fault::PauseLeader => {
            c.controllers[leader].pause();
            pause(1500).await;
            c.controllers[leader].resume();
            format!("pause leader {}", leader + 1)
        }
        Fault::IsolateLeader => {
            c.net.isolate(host)?;
            pause(2500).await;
            c.net.heal()?;
            format!("isolate leader {}", leader + 1)
        }
        Fault::SplitLeaderAway => {
            let mut minority = vec![host];
            minority.extend(&others[..minority_followers]);
            c.net.partition(&minority, &others[minority_followers..])?;
            pause(3000).await;
            c.net.heal()?;
            format!("split leader {} with {minority_followers} follower(s) from the majority", leader + 1)
        }
        Fault::Bridge => {
            let far = pick(rng, &others);
            c.net.partition(&[host], &[far])?;
            pause(3000).await;
            c.net.heal()?;
            format!("bridge: leader {} cut from host {}", leader + 1, far + 1)
        }
        Fault::OneWayLoss => {
            let follower = pick(rng, &others);
            c.net.drop_between(follower, host)?;
            pause(3000).await;
            c.net.heal()?;
            format!("host {} stops hearing leader {}", follower + 1, leader + 1)
        }
        Fault::CutOffAgent => {
            // Past half the node-down timeout the agent stops its tasks; past all
            // of it the leader also declares the node down. Either, at random.
            let a = rng.below(c.agents.len() as u64) as usize;
            let down = crate::cluster::NODE_DOWN_TIMEOUT_MS;
            let ms = if rng.below(2) == 0 { down * 2 / 3 } else { down + 1500 };
            c.net.isolate(c.agents[a].host)?;
            pause(ms).await;
            c.net.heal()?;
            format!("agent {} cut off for {:.1} s", a + 1, ms as f64 / 1000.0)
        }
        Fault::KillMajority => {
            let victims: Vec<usize> =
                std::iter::once(leader).chain(followers.iter().copied().take(minority_followers + 1)).collect();
            for &i in &victims {
                c.controllers[i].kill();
            }
            pause(2000).await;
            for &i in &victims {
                c.restart_controller(i)?;
            }
            let names: Vec<String> = victims.iter().map(|i| (i + 1).to_string()).collect();
            format!("kill {} of {} replicas ({})", victims.len(), members.len(), names.join(", "))
        }
        Fault::ReplaceMember if c.controllers.len() == members.len() => {
            let follower = pick(rng, &followers);
            let new = c.replace_member(follower).await?;
            format!("replica {} joined, replica {} removed", new + 1, follower + 1)
        }
        Fault::ReplaceMember => {
            // One membership change per run: the clients keep their endpoint list.
            c.controllers[leader].pause();
            pause(1500).await;
            c.controllers[leader].resume();
            format!("pause leader {}", leader + 1)
        }
        Fault::PacketLoss => {
            for h in 0..c.net.hosts.len() {
                c.net.lossy(h, 0.2)?;
            }
            pause(3000).await;
            c.net.heal()?;
            "20% packet loss everywhere".to_string()
        }
        Fault::RestartAgent => {
            let a = rng.below(c.agents.len() as u64) as usize;
            c.restart_agent(a, Duration::from_millis(1000)).await?;
            format!("agent {} killed and restarted", a + 1)
        }
        Fault::UpgradeNext => match members.iter().copied().find(|&i| c.controllers[i].previous) {
            Some(i) => {
                c.upgrade_controller(i).await?;
                // The next step waits for this replica to rejoin, as an
                // operator's rolling restart checks health between steps.
                c.leader(RECOVER).await?;
                format!("replica {}{} upgraded", i + 1, if i == leader { " (leader)" } else { "" })
            }
            None => {
                let i = pick(rng, &members);
                c.controllers[i].kill();
                pause(1500).await;
                c.restart_controller(i)?;
                format!("kill replica {}{} (all upgraded)", i + 1, if i == leader { " (leader)" } else { "" })
            }
        },
        Fault::RestartAll => {
            for &i in &members {
                c.controllers[i].kill();
            }
            pause(1000).await;
            for &i in &members {
                c.restart_controller(i)?;
            }
            "restart every replica".to_string()
        }
    })
}

/// Runs `s` once: starts the cluster (logs under `dir`), loads it for
/// `duration` while injecting seeded faults, heals, waits for recovery and
/// runs every checker. An error is a run that could not be judged (no leader,
/// queue never drained): a failure too.
pub async fn run(s: &Scenario, seed: u64, duration: Duration, dir: &Path) -> anyhow::Result<Report> {
    let records = dir.join("records");
    std::fs::create_dir_all(&records)?;
    let mut c = ChaosCluster::start(s.controllers, s.agents, dir, s.previous)?;
    c.leader(RECOVER).await?;
    eventually("every agent registered", || async {
        c.nodes().await.is_ok_and(|n| n.iter().filter(|n| n.state == pb::NodeState::Up as i32).count() == s.agents)
    })
    .await?;

    let client = Arc::new(c.client()?);
    let history = Arc::new(History::default());
    let until = Instant::now() + duration;
    let load = tokio::spawn(workload::run(
        client.clone(),
        history.clone(),
        CLIENTS,
        until,
        records.display().to_string(),
        seed,
    ));

    let mut rng = Rng::new(seed);
    let mut faults = Vec::new();
    while Instant::now() + LAST_FAULT_BEFORE_END < until {
        tokio::time::sleep(Duration::from_millis(500 + rng.below(1000))).await;
        let fault = s.faults[rng.below(s.faults.len() as u64) as usize];
        faults.push(inject(&mut c, fault, &mut rng).await?);
    }
    // A rolling upgrade finishes: whatever still runs the previous build is
    // upgraded now, while the load runs.
    for i in c.members() {
        if c.controllers[i].previous {
            c.upgrade_controller(i).await?;
            c.leader(RECOVER).await?;
            faults.push(format!("replica {} upgraded", i + 1));
        }
    }
    load.await?;
    c.net.heal()?;
    let healed = Instant::now();

    // Liveness: a leader, and every submitted job runs to its end.
    c.leader(RECOVER).await?;
    eventually("the queue drained", || async {
        let client = &client;
        let r = client
            .call(|ch| {
                let req = client.request(pb::ListJobsRequest {
                    states: vec![pb::JobState::Pending as i32, pb::JobState::Running as i32],
                    limit: 10,
                    ..Default::default()
                });
                async move { JobServiceClient::new(ch).list(req).await }
            })
            .await;
        r.is_ok_and(|r| r.into_inner().jobs.is_empty())
    })
    .await?;
    // Convergence: every replica applies the same log.
    eventually("replicas applied the same index", || async {
        let mut applied = Vec::new();
        for i in c.members() {
            applied.push(c.replica_status(i).await.map(|s| s.applied_index));
        }
        applied.iter().all(|a| a.is_some() && *a == applied[0])
    })
    .await?;
    // Every node back Up.
    eventually("every node Up", || async {
        c.nodes().await.is_ok_and(|n| n.iter().all(|n| n.state == pb::NodeState::Up as i32))
    })
    .await?;
    let recovered = healed.elapsed();
    // After an upgrade, the leader moves the cluster to the newest format once
    // every replica runs a build that reads it.
    if s.previous {
        let newest = gangway_core::format::FORMAT_NEWEST;
        eventually("every replica at the newest data format", || async {
            let mut formats = Vec::new();
            for i in c.members() {
                formats.push(c.replica_status(i).await.map(|s| s.data_format));
            }
            formats.iter().all(|f| *f == Some(newest))
        })
        .await?;
    }

    let mut per_replica = Vec::new();
    for i in c.members() {
        per_replica.push(jobs_of(&c, i).await?);
    }
    let nodes = c.nodes().await?;
    let execs = check::read_records(&records);
    let (submits, cancels, queries) = (history.submits(), history.cancels(), history.queries());
    let jobs = &per_replica[0];
    let mut violations = Vec::new();
    violations.extend(check::submits_accounted_for(&submits, jobs));
    violations.extend(check::no_gpu_double_use(&execs));
    violations.extend(check::gangs_whole_and_attempts_fenced(jobs, &execs));
    violations.extend(check::attempts_never_overlap(&execs));
    violations.extend(check::cancels_took_effect(&cancels, jobs, &execs));
    violations.extend(check::reads_linearizable_and_monotone(&submits, &cancels, &queries));
    violations.extend(check::replicas_converged(&per_replica));
    if !s.fails_nodes() {
        violations.extend(check::no_false_node_failures(jobs, &nodes));
    }
    violations.extend(check::resources_conserved(jobs, &nodes));

    let acknowledged = submits.iter().filter(|s| matches!(s.outcome, Outcome::Ok(_))).count();
    let unknown = submits.iter().filter(|s| matches!(s.outcome, Outcome::Unknown(_))).count();
    let worst_gap = history::worst_gap(&history.spans());
    let operations = submits.len() + cancels.len() + queries.len();
    let summary = format!(
        "{} seed {seed}: {operations} operations ({} submits, {acknowledged} acknowledged, {unknown} unknown; \
         {} cancels; {} queries), {} jobs, {} execution records, worst gap {:.2} s, recovered in {:.1} s, \
         {} violations; faults: {}",
        s.name,
        submits.len(),
        cancels.len(),
        queries.len(),
        jobs.len(),
        execs.len(),
        worst_gap.as_secs_f64(),
        recovered.as_secs_f64(),
        violations.len(),
        faults.join(", ")
    );
    if acknowledged == 0 {
        violations.push("no submit was acknowledged".to_string());
    }
    std::fs::write(dir.join("summary.txt"), format!("{summary}\n{}\n", violations.join("\n")))?;
    Ok(Report {
        scenario: s.name,
        seed,
        operations,
        submits: submits.len(),
        acknowledged,
        faults,
        violations,
        worst_gap,
        recovered,
        summary,
    })
}

/// The command that replays one run with the same seed.
pub fn reproduce_command(scenario: &str, seed: u64, duration: Duration) -> String {
    format!("make chaos SCENARIO={scenario} SEED={seed} DURATION={}", duration.as_secs())
}

/// Runs `s` in a fresh temporary directory, removed when the run passes and
/// kept (with logs, history summary and execution records) when it does not.
pub async fn run_kept_on_failure(s: &Scenario, seed: u64, duration: Duration) -> anyhow::Result<Report> {
    let dir = tempfile::Builder::new().prefix(&format!("gangway-chaos-{}-", s.name)).tempdir()?;
    let result = run(s, seed, duration, dir.path()).await;
    let failed = match &result {
        Ok(r) => !r.violations.is_empty(),
        Err(_) => true,
    };
    if failed {
        let kept = dir.keep();
        eprintln!(
            "chaos scenario {} seed {seed} failed\n  logs, history summary and records kept in {}\n  reproduce: {}",
            s.name,
            kept.display(),
            reproduce_command(s.name, seed, duration)
        );
    }
    result
}

/// The results table: one row per scenario, over its runs.
pub fn results_table(reports: &[Report]) -> String {
    let mut out = String::from(
        "| scenario | runs | operations | faults injected | violations | worst failover gap | worst time to recover |\n\
         |---|---:|---:|---:|---:|---:|---:|\n",
    );
    for s in SCENARIOS {
        let rs: Vec<&Report> = reports.iter().filter(|r| r.scenario == s.name).collect();
        if rs.is_empty() {
            continue;
        }
        let max = |f: fn(&Report) -> Duration| rs.iter().map(|r| f(r)).max().unwrap_or_default().as_secs_f64();
        out.push_str(&format!(
            "| {} | {} | {} | {} | {} | {:.2} s | {:.1} s |\n",
            s.name,
            rs.len(),
            rs.iter().map(|r| r.operations).sum::<usize>(),
            rs.iter().map(|r| r.faults.len()).sum::<usize>(),
            rs.iter().map(|r| r.violations.len()).sum::<usize>(),
            max(|r| r.worst_gap),
            max(|r| r.recovered),
        ));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Runs and durations at their bounds are taken, one past is refused
    /// naming the flag; seeds never wrap.
    #[test]
    fn run_flags_are_bounded() {
        assert_eq!(check_runs(7, RUNS_MAX, DURATION_MAX), Ok(7..7 + RUNS_MAX));
        assert_eq!(check_runs(7, 1, DURATION_MIN), Ok(7..8));
        assert_eq!(check_runs(7, RUNS_MAX + 1, DURATION_MAX), Err(format!("--runs: must be 1 to {RUNS_MAX}")));
        assert!(check_runs(7, 0, DURATION_MAX).unwrap_err().starts_with("--runs:"));
        let past = DURATION_MAX + Duration::from_secs(1);
        assert!(check_runs(7, 1, past).unwrap_err().starts_with("--duration: must be 5 to 3600 seconds"));
        let short = DURATION_MIN - Duration::from_secs(1);
        assert!(check_runs(7, 1, short).unwrap_err().starts_with("--duration:"));
        assert!(check_runs(u64::MAX, 1, DURATION_MIN).unwrap_err().starts_with("--seed:"));
    }
}
