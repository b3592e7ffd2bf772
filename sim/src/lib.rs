//! A deterministic simulation of a whole Gangway cluster, in one thread, from
//! one seed (TigerBeetle's VOPR, FoundationDB's simulator): the core's own
//! decisions — `State::apply`, the leader's `duties::leader_tick` and
//! `duties::on_heartbeat`, each agent's `agent::AgentCore` and its
//! `next_call` — run as production runs them, against a
//! simulated clock, network, replicated log and tasks, while faults are
//! injected, and the chaos checkers judge every run.
//!
//! ```text
//!  clients ──submit/cancel (retries, same key)──►┐
//!  agents (AgentCore) ──register/heartbeat/exit──►  leader ── propose ──► log ── commit ──► State::apply
//!        ▲             ◄── answers (node_orders) ──┘   ▲ leader_tick every 200 ms
//!        └ tasks: timers that finish, fail, hang       └ elections: new term, unacked entries lost
//! ```
//!
//! Faults (until `Config::heal_ms`, then the cluster must settle), injected
//! at the I/O seams as TigerBeetle's VOPR does: at the network, messages
//! dropped, duplicated and delayed (so reordered), agents cut off from the
//! controllers, clients' requests lost; at the process, agents crashing and
//! restarting from the fences on their disk (their tasks die with them, or
//! outlive them under a shim), leader elections losing unacknowledged
//! entries; at the devices, GPUs failing and recovering; at the clock (swarm
//! runs), agents whose clocks run fast or slow. With
//! `Config::swarm` each seed draws its own rates and leaves some kinds out
//! altogether ("swarm testing": a run that stresses a few faults hard finds
//! what an even mix of all of them hides); without it every seed uses the
//! same mix ([`Faults::FIXED`]), which the pinned seeds of the tests assume.
//!
//! The messages are production's: the agent's heartbeat and the leader's
//! answer go through `gangway_proto::orders`, the codec the controller and
//! the node agent use. What the simulation abstracts: the Raft layer itself
//! (one committed log; `raft-store`'s tests and the chaos suite cover
//! replication), tonic and the processes.
//!
//! Checked on every step: the state's own invariants, one attempt of a job
//! running at a time, no GPU held by two running tasks, whole gangs; at the
//! end: every acknowledged submit kept (one job per idempotency key), no
//! invented jobs, every job finished after healing (liveness), and no node
//! declared down unless its agent was really cut off or down.

#![allow(clippy::cast_possible_truncation)]

use std::collections::{BTreeMap, BTreeSet};
use std::fmt::Write as _;

use gangway_core::agent::{Action, AgentCore, Call, Exit, Fences};
use gangway_core::command::{Command, JobChange};
use gangway_core::duties::{
    gpu_health_changes, heartbeat_interval_ms, leader_tick, on_heartbeat, silence_ms, Heard, HeardBook, Heartbeat,
    HeartbeatReply, LeaderMemory, TaskKey, TaskReport,
};
use gangway_core::limits::NODES_MAX;
use gangway_core::model::{JobId, JobState, NodeState};
use gangway_core::spec::{GpuSpec, JobSpec, NodeSpec};
use gangway_core::state::{Outcome, State};
use gangway_proto::orders::{answer_from_proto, heartbeat_from_proto, heartbeat_to_proto, orders_to_proto};
use gangway_proto::v1 as pb;

/// The leader's side of a heartbeat, as `duties::on_heartbeat` has it: the
/// simulation calls it through [`Config::on_heartbeat`], so a test can hand
/// it a deliberately broken one and see the checkers catch it.
pub type OnHeartbeat = fn(&State, u64, u64, u64, &Heartbeat) -> HeartbeatReply;

/// A deliberately broken cluster, to show the checkers catch what they should.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Bug {
    /// Agents never run their self-fence: a cut-off node keeps its tasks.
    NoSelfFence,
    /// Agents forget their launch fences when they restart.
    ForgetFences,
    /// The leader takes every node's tasks for ended: a requeued job starts
    /// again at once, while its previous attempt may still be stopping.
    NoCompletingWait,
    /// Task shims ignore the agent's lease: a task outlives a crashed agent.
    NoShimLease,
    /// The leader answers heartbeats from nodes silent past the timeout
    /// (which it may already be declaring down) with orders.
    AnswerSilentNodes,
    /// Apply evicts a plan's preemption victims before checking the
    /// placements they were evicted for (the rule before data format 7): a
    /// stale plan evicts for nothing.
    EvictFirst,
}

impl Bug {
    pub fn parse(s: &str) -> Option<Bug> {
        Some(match s {
            "no-self-fence" => Bug::NoSelfFence,
            "forget-fences" => Bug::ForgetFences,
            "no-completing-wait" => Bug::NoCompletingWait,
            "no-shim-lease" => Bug::NoShimLease,
            "answer-silent-nodes" => Bug::AnswerSilentNodes,
            "evict-first" => Bug::EvictFirst,
            _ => return None,
        })
    }
}

/// One simulated cluster.
#[derive(Debug, Clone)]
pub struct Config {
    pub nodes: u32,
    pub gpus_per_node: u32,
    pub jobs: u32,
    /// Faults happen before this time (ms); then the cluster heals.
    pub heal_ms: u64,
    /// Every job must have finished by this time (ms).
    pub deadline_ms: u64,
    /// Tasks outlive a crashed agent (the real agent's `task-shim`).
    pub shim: bool,
    pub bug: Option<Bug>,
    /// Events the run may process ([`EVENTS_MAX`]); past them it is stuck.
    pub events_max: u64,
    /// Each seed draws its own fault rates ([`Faults::draw`]) instead of
    /// [`Faults::FIXED`].
    pub swarm: bool,
    /// The leader's heartbeat decision: production's `duties::on_heartbeat`.
    pub on_heartbeat: OnHeartbeat,
}

/// The fault rates of one run: per thousand messages (or client requests,
/// or entries), and how many of each fault event at most (each run draws
/// from 0 to that many).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Faults {
    /// Messages between agents and the leader lost.
    pub drop_per_mille: u64,
    /// Messages delivered twice.
    pub dup_per_mille: u64,
    /// Messages delayed 200 ms to 3 s (so reordered).
    pub slow_per_mille: u64,
    /// Client submits lost on the way.
    pub client_loss_per_mille: u64,
    /// Unacknowledged entries that survive an election (a majority held
    /// them); the others are lost.
    pub kept_at_election_per_mille: u64,
    pub elections_max: u64,
    pub crashes_max: u64,
    pub cuts_max: u64,
    pub gpu_faults_max: u64,
    /// How far each agent's clock may run fast or slow against the
    /// leader's, per thousand (each agent draws its own rate): the agents'
    /// leases, self-fences, timeouts and intervals are measured by it.
    pub clock_drift_per_mille_max: u64,
}

impl Faults {
    /// The mix every seed has without swarm testing.
    pub const FIXED: Faults = Faults {
        drop_per_mille: 30,
        dup_per_mille: 20,
        slow_per_mille: 30,
        client_loss_per_mille: 30,
        kept_at_election_per_mille: 500,
        elections_max: 3,
        crashes_max: 3,
        cuts_max: 4,
        gpu_faults_max: 2,
        clock_drift_per_mille_max: 0,
    };

    /// A mix drawn from `seed` (its own stream, so the run's other draws
    /// stay): each kind of fault is left out with probability 1/2, else its
    /// rate or count is drawn up to about three times the fixed mix's.
    pub fn draw(seed: u64) -> Faults {
        let mut rng = Rng(seed ^ 0x5A4A_12F0_0D5E_ED01);
        // Left out: every entry a majority may hold survives an election.
        let kept = if rng.chance(500) { 1000 } else { rng.range(0, 1000) };
        let mut some = |max: u64| if rng.chance(500) { 0 } else { rng.range(1, max) };
        Faults {
            drop_per_mille: some(100),
            dup_per_mille: some(60),
            slow_per_mille: some(100),
            client_loss_per_mille: some(100),
            kept_at_election_per_mille: kept,
            elections_max: some(6),
            crashes_max: some(6),
            cuts_max: some(8),
            gpu_faults_max: some(4),
            // Real clocks drift by parts per million: 5% is far past them,
            // well inside the self-fence's margin (half the node-down timeout).
            clock_drift_per_mille_max: some(CLOCK_DRIFT_PER_MILLE_MAX),
        }
    }
}

impl Default for Config {
    fn default() -> Self {
        Config {
            nodes: 4,
            gpus_per_node: 4,
            jobs: 40,
            heal_ms: 90_000,
            deadline_ms: 600_000,
            shim: false,
            bug: None,
            events_max: EVENTS_MAX,
            swarm: false,
            on_heartbeat,
        }
    }
}

/// The QOS of most jobs: preemptible.
const QOS_BATCH: &str = "batch";
/// The QOS of a few jobs: may preempt batch and scavenger jobs.
const QOS_URGENT: &str = "urgent";
/// The QOS of some jobs: suspended when preempted (preempt mode SUSPEND),
/// resumed once their CPUs and GPUs are free again.
const QOS_SCAVENGER: &str = "scavenger";
/// One job in this many that is not urgent is a scavenger.
const SCAVENGER_EVERY: usize = 5;
/// Jobs submitted urgent, per thousand: enough that most runs preempt.
const URGENT_PER_MILLE: u64 = 150;
/// The grace a preempted batch job gets before its kill.
const PREEMPT_GRACE_S: u32 = 5;
/// The identity, an operator, that suspends and resumes jobs.
const SIM_OPERATOR: &str = "sim-operator";
/// One job in this many is suspended for a while.
const SUSPEND_EVERY: usize = 16;
/// One job in this many is heterogeneous: a batch job with a second
/// component of its own shape (placed with the first, all or nothing).
const HET_EVERY: usize = 12;
/// When after its submit a job is suspended (it may be running by then),
/// and for how long (a resume is retried this often until it took).
const SUSPEND_AFTER_MS: u64 = 4_000;
const SUSPENDED_FOR_MS: u64 = 3_000;

/// The result of one seed.
#[derive(Debug, Clone, Default)]
pub struct Report {
    pub seed: u64,
    /// Broken invariants (empty: the run passed).
    pub violations: Vec<String>,
    /// Virtual time simulated (ms).
    pub sim_ms: u64,
    pub events: u64,
    pub entries: u64,
    pub jobs_completed: u32,
    pub jobs_failed: u32,
    pub launches: u32,
    pub nodes_marked_down: u32,
    pub elections: u32,
    /// Running jobs evicted for a preemptor.
    pub preempted: u32,
    /// Running jobs suspended (and later resumed) by the operator.
    pub suspended: u32,
    /// Preemption victims suspended (preempt mode SUSPEND), not stopped.
    pub preempt_suspended: u32,
    /// Heterogeneous jobs that completed.
    pub het_completed: u32,
    /// The run's fault mix.
    pub faults: Option<Faults>,
    /// The run's trace, one line per notable event (kept when asked).
    pub trace: String,
}

/// Timing of the simulated cluster (the real defaults).
const HEARTBEAT_MS: u64 = 1_000;
const DOWN_TIMEOUT_MS: u64 = 10_000;
const LEADER_TICK_MS: u64 = 200;
const FENCE_TICK_MS: u64 = 100;
const RETRY_PAUSE_MS: u64 = 1_000;
const STOP_GRACE_MS: u64 = 5_000;
const CLIENT_RETRY_MS: u64 = 3_000;
/// A message this late counts as lost (an agent's call times out sooner).
const LATE_MS: u64 = 2_000;
/// How long the cluster runs on after the last job finished.
const SETTLE_MS: u64 = 15_000;
/// Events one run may process: a run that needs more is stuck in a loop.
const EVENTS_MAX: u64 = 5_000_000;
/// Trace bytes kept per run (about 20,000 lines); the line that reaches it
/// is the last.
const TRACE_BYTES_MAX: usize = 20_000 * 80;

/// The most an agent's clock runs fast or slow in a swarm run, per
/// thousand (see [`Faults::clock_drift_per_mille_max`]).
const CLOCK_DRIFT_PER_MILLE_MAX: u64 = 50;

/// SplitMix64: small, fast, and the same on every machine.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in lo..=hi.
    fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.next() % (hi - lo + 1)
    }

    /// True with probability `per_mille`/1000.
    fn chance(&mut self, per_mille: u64) -> bool {
        self.next() % 1000 < per_mille
    }
}

#[derive(Debug, Clone)]
enum Req {
    Register,
    Heartbeat(pb::HeartbeatRequest),
    Exit(Exit),
}

#[derive(Debug, Clone)]
enum Resp {
    Registered,
    Answer(pb::HeartbeatResponse),
    ExitAck,
    /// No leader (or it cannot commit): the agent retries.
    Unavailable,
}

#[derive(Debug, Clone)]
enum Ev {
    LeaderTick,
    AgentRound {
        node: usize,
        life: u32,
    },
    FenceTick {
        node: usize,
        life: u32,
    },
    /// The node's task shims check the agent's lease.
    ShimTick {
        node: usize,
    },
    CallTimeout {
        node: usize,
        call: u64,
    },
    ToLeader {
        node: usize,
        call: u64,
        req: Req,
    },
    ToAgent {
        node: usize,
        call: u64,
        resp: Resp,
    },
    Commit {
        id: u64,
    },
    TaskEnds {
        node: usize,
        task: TaskKey,
        gen: u64,
    },
    Election,
    NewLeader,
    Crash {
        node: usize,
    },
    Restart {
        node: usize,
    },
    Cut {
        node: usize,
        until: u64,
    },
    GpuFault {
        node: usize,
        gpu: usize,
        until: u64,
    },
    Submit {
        key: usize,
    },
    SubmitAck {
        key: usize,
        job: JobId,
    },
    Cancel {
        key: usize,
    },
    /// An operator suspends (or resumes) the client's job.
    Suspend {
        key: usize,
        suspend: bool,
    },
}

/// Who waits for a proposal's outcome.
#[derive(Debug, Clone)]
enum ReplyTo {
    Agent { node: usize, call: u64, resp: Resp },
    Client { key: usize },
    Nobody,
}

struct Proposal {
    term: u64,
    cmd: Command,
    reply: ReplyTo,
}

/// A task as a process on a node: what really runs.
#[derive(Debug, Clone)]
struct Process {
    gpus: Vec<u32>,
    end_ms: u64,
    exit_code: Option<i32>,
    signal: Option<i32>,
    /// Ignores SIGTERM (ends only at the kill).
    stubborn: bool,
    gen: u64,
    /// Suspended: the run time it had left (u64::MAX: it hangs); its end
    /// waits for the resume.
    paused_left: Option<u64>,
}

struct Agent {
    name: String,
    core: Option<AgentCore>,
    /// The fences on the node's disk.
    disk: Fences,
    /// Bumped at each crash: events of an earlier life are ignored.
    life: u32,
    /// The outstanding call: (id, sent at, what).
    waiting: Option<(u64, u64, &'static str)>,
    /// The last answer's launch list (GPUs per task).
    launch_gpus: BTreeMap<TaskKey, Vec<u32>>,
    processes: BTreeMap<TaskKey, Process>,
    healthy: Vec<bool>,
    cut_until: u64,
    /// Exits of tasks that ended while the agent was down (their shims wrote
    /// them down; the next agent reports them).
    orphan_exits: Vec<Exit>,
    /// The exit report being sent (out of the core's queue meanwhile).
    in_flight: Option<Exit>,
    /// The lease file: (stop at, kill by), written at each contact.
    lease: (u64, u64),
    /// When the node was last crashed or cut off (the end of that fault).
    fault_end_ms: u64,
    crashed: bool,
    /// How fast its clock runs against the leader's, per thousand (0: alike).
    drift: i64,
}

struct Leader {
    up: bool,
    term: u64,
    since: u64,
    heard: HeardBook,
    memory: LeaderMemory,
}

impl Leader {
    /// A new leader: nothing heard yet, nothing remembered.
    fn new(term: u64, since: u64) -> Leader {
        Leader { up: true, term, since, heard: HeardBook::default(), memory: LeaderMemory::default() }
    }
}

pub struct World {
    cfg: Config,
    faults: Faults,
    rng: Rng,
    now: u64,
    seq: u64,
    queue: BTreeMap<(u64, u64), Ev>,
    state: State,
    index: u64,
    leader: Leader,
    inflight: BTreeMap<u64, Proposal>,
    next_id: u64,
    agents: Vec<Agent>,
    /// Client key → the job its acknowledged submit named.
    acked: BTreeMap<usize, JobId>,
    /// Idempotency key → the job every committed submit with it named.
    committed_keys: BTreeMap<String, JobId>,
    submitted: BTreeSet<usize>,
    /// Every (job, attempt, node) ever launched: an attempt runs at most once on a node.
    launched: BTreeSet<(JobId, u32, usize)>,
    report: Report,
    keep_trace: bool,
}

impl World {
    pub fn new(seed: u64, cfg: Config, keep_trace: bool) -> World {
        let agents = (0..cfg.nodes)
            .map(|n| Agent {
                name: format!("node{n}"),
                core: None,
                disk: Fences::default(),
                life: 0,
                waiting: None,
                launch_gpus: BTreeMap::new(),
                processes: BTreeMap::new(),
                healthy: vec![true; cfg.gpus_per_node as usize],
                cut_until: 0,
                orphan_exits: Vec::new(),
                in_flight: None,
                lease: (u64::MAX, u64::MAX),
                fault_end_ms: 0,
                crashed: false,
                drift: 0,
            })
            .collect::<Vec<_>>();
        let mut state = State::default();
        // The newest format: the simulation judges the current rules.
        state.format = if cfg.bug == Some(Bug::EvictFirst) {
            gangway_core::format::PLAN_APPLY_FORMAT.saturating_sub(1)
        } else {
            gangway_core::format::FORMAT_NEWEST
        };
        // Urgent jobs preempt batch ones (requeued, with a grace), so every
        // run also exercises preemption: plan apply, stops, the Completing wait.
        state.policy.qos.insert(
            QOS_BATCH.into(),
            gangway_core::policy::Qos { preempt_grace_s: PREEMPT_GRACE_S, ..Default::default() },
        );
        // The clients' operator suspends and resumes some jobs.
        state.policy.operators.push(SIM_OPERATOR.into());
        state.policy.qos.insert(
            QOS_URGENT.into(),
            gangway_core::policy::Qos {
                priority: 100,
                preempt: vec![QOS_BATCH.into(), QOS_SCAVENGER.into()],
                ..Default::default()
            },
        );
        state.policy.qos.insert(
            QOS_SCAVENGER.into(),
            gangway_core::policy::Qos {
                preempt_mode: gangway_core::policy::PreemptMode::Suspend,
                ..Default::default()
            },
        );
        let faults = if cfg.swarm { Faults::draw(seed) } else { Faults::FIXED };
        let mut agents = agents;
        if faults.clock_drift_per_mille_max > 0 {
            // Their own stream: the run's other draws stay as they are.
            let mut rng = Rng(seed ^ 0x00C1_0C4D_121F_7000);
            let max = faults.clock_drift_per_mille_max;
            for a in &mut agents {
                a.drift = rng.range(0, 2 * max) as i64 - max as i64;
            }
        }
        World {
            faults,
            rng: Rng(seed ^ 0x005E_ED0F_6A96_3A77),
            now: 0,
            seq: 0,
            queue: BTreeMap::new(),
            state,
            index: 0,
            leader: Leader::new(1, 0),
            inflight: BTreeMap::new(),
            next_id: 0,
            agents,
            acked: BTreeMap::new(),
            committed_keys: BTreeMap::new(),
            submitted: BTreeSet::new(),
            launched: BTreeSet::new(),
            report: Report { seed, faults: Some(faults), ..Report::default() },
            keep_trace,
            cfg,
        }
    }

    /// What agent `node`'s clock reads now.
    fn agent_now(&self, node: usize) -> u64 {
        let drift = self.agents[node].drift;
        let t = i128::from(self.now) * i128::from(1000 + drift) / 1000;
        u64::try_from(t).unwrap_or(0)
    }

    /// How long `ms` of agent `node`'s clock takes in the leader's time.
    fn agent_span(&self, node: usize, ms: u64) -> u64 {
        if ms == u64::MAX {
            return ms;
        }
        let drift = self.agents[node].drift;
        let t = i128::from(ms) * 1000 / i128::from(1000 + drift);
        u64::try_from(t).unwrap_or(u64::MAX)
    }

    fn at(&mut self, delay: u64, ev: Ev) {
        self.seq += 1;
        self.queue.insert((self.now + delay, self.seq), ev);
    }

    fn trace(&mut self, line: impl FnOnce() -> String) {
        if self.keep_trace && self.report.trace.len() < TRACE_BYTES_MAX {
            let _ = writeln!(self.report.trace, "{:>7} {}", self.now, line());
        }
    }

    fn violation(&mut self, what: String) {
        self.trace(|| format!("VIOLATION {what}"));
        if self.report.violations.len() < 20 {
            self.report.violations.push(format!("t={}ms: {what}", self.now));
        }
    }

    fn faulty(&self) -> bool {
        self.now < self.cfg.heal_ms
    }

    /// A network delay: mostly short, sometimes long while faults run.
    fn delay(&mut self) -> u64 {
        if self.faulty() && self.rng.chance(self.faults.slow_per_mille) {
            self.rng.range(200, 3_000)
        } else {
            self.rng.range(1, 20)
        }
    }

    /// Sends a message between an agent and the leader: dropped while the
    /// agent is cut off, sometimes dropped or duplicated while faults run.
    fn send(&mut self, node: usize, ev: Ev) {
        if self.agents[node].cut_until > self.now {
            return;
        }
        // A message lost, or late enough to time its call out, is a fault of
        // this node's network: the leader may then rightly declare it down.
        if self.faulty() && self.rng.chance(self.faults.drop_per_mille) {
            self.agents[node].fault_end_ms = self.agents[node].fault_end_ms.max(self.now);
            return;
        }
        let copies = if self.faulty() && self.rng.chance(self.faults.dup_per_mille) { 2 } else { 1 };
        for _ in 0..copies {
            let d = self.delay();
            if d >= LATE_MS {
                self.agents[node].fault_end_ms = self.agents[node].fault_end_ms.max(self.now + d);
            }
            self.at(d, ev.clone());
        }
    }

    /// Runs the seed to its end.
    pub fn run(mut self) -> Report {
        self.schedule_start();
        let mut events = 0u64;
        let mut settle_until = None;
        while let Some(((t, _), ev)) = self.queue.pop_first() {
            self.now = t;
            events += 1;
            if events > self.cfg.events_max {
                let max = self.cfg.events_max;
                self.violation(format!("more than {max} events: the run does not settle"));
                break;
            }
            self.step(ev);
            // Once every job has finished, the cluster runs on a while
            // (tasks being stopped end) before the final checks.
            match settle_until {
                Some(t) if self.now >= t => break,
                None if self.now > self.cfg.heal_ms && self.all_done() => settle_until = Some(self.now + SETTLE_MS),
                _ => {}
            }
            if self.now > self.cfg.deadline_ms {
                let open: Vec<String> = self
                    .state
                    .jobs
                    .values()
                    .filter(|j| !j.state.is_finished())
                    .take(5)
                    .map(|j| format!("{} {} ({})", j.id, j.state.as_str(), j.reason))
                    .collect();
                let missing = match open.is_empty() {
                    true => format!(
                        "{} of {} submits made, {} acknowledged",
                        self.submitted.len(),
                        self.cfg.jobs,
                        self.acked.len()
                    ),
                    false => open.join("; "),
                };
                self.violation(format!("liveness: jobs unfinished long after healing: {missing}"));
                break;
            }
        }
        self.final_checks();
        self.report.sim_ms = self.now;
        self.report.events = events;
        self.report.entries = self.index;
        self.report
    }

    fn all_done(&self) -> bool {
        self.submitted.len() == self.cfg.jobs as usize
            && self.acked.len() == self.cfg.jobs as usize
            && self.state.jobs.values().all(|j| j.state.is_finished())
    }

    fn schedule_start(&mut self) {
        self.at(0, Ev::LeaderTick);
        for node in 0..self.agents.len() {
            self.start_agent(node);
            if self.cfg.shim {
                self.at(FENCE_TICK_MS, Ev::ShimTick { node });
            }
        }
        for key in 0..self.cfg.jobs as usize {
            let t = self.rng.range(500, self.cfg.heal_ms * 3 / 4);
            self.at(t, Ev::Submit { key });
        }
        // Faults, spread over the faulty period.
        let n = self.agents.len();
        let f = self.faults;
        for _ in 0..self.rng.range(0, f.elections_max) {
            let t = self.rng.range(1_000, self.cfg.heal_ms - 1_000);
            self.at(t, Ev::Election);
        }
        for _ in 0..self.rng.range(0, f.crashes_max) {
            let node = self.rng.range(0, n as u64 - 1) as usize;
            let t = self.rng.range(1_000, self.cfg.heal_ms - 5_000);
            self.at(t, Ev::Crash { node });
        }
        for _ in 0..self.rng.range(0, f.cuts_max) {
            let node = self.rng.range(0, n as u64 - 1) as usize;
            let t = self.rng.range(1_000, self.cfg.heal_ms - 25_000);
            let long = self.rng.range(1_000, 25_000);
            self.at(t, Ev::Cut { node, until: t + long });
        }
        for _ in 0..self.rng.range(0, f.gpu_faults_max) {
            let node = self.rng.range(0, n as u64 - 1) as usize;
            let gpu = self.rng.range(0, u64::from(self.cfg.gpus_per_node.max(1)) - 1) as usize;
            let t = self.rng.range(1_000, self.cfg.heal_ms - 10_000);
            let long = self.rng.range(2_000, 10_000);
            self.at(t, Ev::GpuFault { node, gpu, until: t + long });
        }
    }

    fn start_agent(&mut self, node: usize) {
        let a = &mut self.agents[node];
        a.crashed = false;
        a.waiting = None;
        let now = self.agent_now(node);
        let a = &mut self.agents[node];
        let mut core = AgentCore::new(a.disk.clone(), STOP_GRACE_MS, now);
        // Tasks that outlived the agent (under a shim) are adopted.
        for (key, p) in &a.processes {
            core.adopt(*key, p.gpus.clone());
        }
        for exit in std::mem::take(&mut a.orphan_exits) {
            core.task_exited(exit);
        }
        a.core = Some(core);
        let life = a.life;
        self.at(0, Ev::AgentRound { node, life });
        self.at(FENCE_TICK_MS, Ev::FenceTick { node, life });
    }

    fn step(&mut self, ev: Ev) {
        match ev {
            Ev::LeaderTick => self.leader_tick(),
            Ev::AgentRound { node, life } => {
                if self.agents[node].life == life {
                    self.agent_round(node);
                }
            }
            Ev::FenceTick { node, life } => {
                if self.agents[node].life == life && !self.agents[node].crashed {
                    if self.cfg.bug != Some(Bug::NoSelfFence) {
                        let now = self.agent_now(node);
                        let actions = self.agents[node].core.as_mut().map(|c| c.tick(now)).unwrap_or_default();
                        self.perform(node, actions);
                    }
                    let tick = self.agent_span(node, FENCE_TICK_MS);
                    self.at(tick, Ev::FenceTick { node, life });
                }
            }
            Ev::ShimTick { node } => {
                let (stop_at, kill_at) = self.agents[node].lease;
                // The shims read the lease by the node's own clock.
                let now = self.agent_now(node);
                if now >= stop_at && self.cfg.bug != Some(Bug::NoShimLease) {
                    let tasks: Vec<TaskKey> = self.agents[node].processes.keys().copied().collect();
                    for task in tasks {
                        self.stop(node, task, kill_at.saturating_sub(now));
                    }
                }
                let tick = self.agent_span(node, FENCE_TICK_MS);
                self.at(tick, Ev::ShimTick { node });
            }
            Ev::CallTimeout { node, call } => {
                if self.agents[node].waiting.is_some_and(|w| w.0 == call) {
                    self.agents[node].waiting = None;
                    let a = &mut self.agents[node];
                    if let (Some(exit), Some(core)) = (a.in_flight.take(), a.core.as_mut()) {
                        core.report_failed(exit);
                    }
                    let life = self.agents[node].life;
                    let pause = self.agent_span(node, RETRY_PAUSE_MS);
                    self.at(pause, Ev::AgentRound { node, life });
                }
            }
            Ev::ToLeader { node, call, req } => self.leader_receives(node, call, req),
            Ev::ToAgent { node, call, resp } => self.agent_receives(node, call, resp),
            Ev::Commit { id } => {
                if let Some(p) = self.inflight.remove(&id) {
                    if p.term == self.leader.term && self.leader.up {
                        self.apply(p);
                    }
                }
            }
            Ev::TaskEnds { node, task, gen } => self.task_ends(node, task, gen),
            Ev::Election => {
                if self.leader.up {
                    self.report.elections += 1;
                    self.leader.up = false;
                    // Entries a majority already holds survive; the rest are lost.
                    let ids: Vec<u64> = self.inflight.keys().copied().collect();
                    for id in ids {
                        let p = self.inflight.remove(&id).expect("listed");
                        if self.rng.chance(self.faults.kept_at_election_per_mille) {
                            self.apply(p);
                        }
                    }
                    let t = self.rng.range(300, 3_000);
                    self.trace(|| "leader lost: election".into());
                    self.at(t, Ev::NewLeader);
                }
            }
            Ev::NewLeader => {
                self.leader = Leader::new(self.leader.term + 1, self.now);
                let term = self.leader.term;
                self.trace(|| format!("new leader, term {term}"));
            }
            Ev::Crash { node } => {
                if !self.agents[node].crashed {
                    self.trace(|| format!("agent {node} crashes"));
                    let a = &mut self.agents[node];
                    a.crashed = true;
                    a.core = None;
                    a.in_flight = None;
                    a.life += 1;
                    a.waiting = None;
                    if !self.cfg.shim {
                        a.processes.clear();
                    }
                    if self.cfg.bug == Some(Bug::ForgetFences) {
                        a.disk = Fences::default();
                    }
                    let t = self.rng.range(500, 25_000);
                    let a = &mut self.agents[node];
                    a.fault_end_ms = a.fault_end_ms.max(self.now + t);
                    self.at(t, Ev::Restart { node });
                }
            }
            Ev::Restart { node } => {
                self.trace(|| format!("agent {node} restarts"));
                self.start_agent(node);
            }
            Ev::Cut { node, until } => {
                self.trace(|| format!("agent {node} cut off until {until}"));
                let a = &mut self.agents[node];
                a.cut_until = a.cut_until.max(until);
                a.fault_end_ms = a.fault_end_ms.max(until);
            }
            Ev::GpuFault { node, gpu, until } => {
                if until > self.now {
                    self.agents[node].healthy[gpu] = false;
                    self.at(until - self.now, Ev::GpuFault { node, gpu, until: 0 });
                } else {
                    self.agents[node].healthy[gpu] = true;
                }
            }
            Ev::Submit { key } => self.client_submit(key),
            Ev::SubmitAck { key, job } => {
                if let Some(prev) = self.acked.insert(key, job) {
                    if prev != job {
                        self.violation(format!("submit {key} acknowledged as job {prev} and as job {job}"));
                    }
                }
            }
            Ev::Cancel { key } => {
                if let Some(job) = self.acked.get(&key).copied() {
                    let cmd = Command::CancelJob { job_id: job, identity: "sim".into(), now_ms: self.now };
                    self.propose(cmd, ReplyTo::Nobody);
                }
            }
            Ev::Suspend { key, suspend } => {
                if let Some(job) = self.acked.get(&key).copied() {
                    let change = if suspend { JobChange::Suspend } else { JobChange::Resume };
                    let cmd =
                        Command::UpdateJob { job_id: job, change, identity: SIM_OPERATOR.into(), now_ms: self.now };
                    self.propose(cmd, ReplyTo::Nobody);
                }
                // The resume is retried until it took (a proposal can be lost).
                let suspended =
                    self.acked.get(&key).and_then(|j| self.state.jobs.get(j)).is_some_and(|j| j.is_suspended());
                if suspend || suspended {
                    self.at(SUSPENDED_FOR_MS, Ev::Suspend { key, suspend: false });
                }
            }
        }
    }

    // ------------------------------------------------------------ the leader

    fn propose(&mut self, cmd: Command, reply: ReplyTo) {
        if !self.leader.up {
            self.reply_unavailable(reply);
            return;
        }
        self.next_id += 1;
        let id = self.next_id;
        self.inflight.insert(id, Proposal { term: self.leader.term, cmd, reply });
        let d = self.rng.range(2, 15);
        self.at(d, Ev::Commit { id });
    }

    fn reply_unavailable(&mut self, reply: ReplyTo) {
        if let ReplyTo::Agent { node, call, .. } = reply {
            self.send(node, Ev::ToAgent { node, call, resp: Resp::Unavailable });
        }
    }

    fn apply(&mut self, p: Proposal) {
        self.index += 1;
        self.observe_before(&p.cmd);
        let applied = self.state.apply(self.index, &p.cmd);
        if let Err(e) = self.state.check_invariants() {
            self.violation(format!("state invariant after {}: {e}", p.cmd.name()));
        }
        match (&p.cmd, &applied.outcome) {
            (Command::SubmitJob { idempotency_key, .. }, Outcome::Submitted { job_id, .. }) => {
                if let Some(prev) = self.committed_keys.insert(idempotency_key.clone(), *job_id) {
                    if prev != *job_id {
                        self.violation(format!("key {idempotency_key} made jobs {prev} and {job_id}"));
                    }
                }
            }
            (Command::ApplySchedule { preemptions, .. }, Outcome::ScheduleApplied { started, preempted, .. }) => {
                let (started, preempted) = (started.clone(), preempted.clone());
                self.trace(|| format!("started {started:?}, preempted {preempted:?}"));
                // Plan apply: a victim is evicted only for a placement that started.
                for v in preemptions.iter().filter(|v| preempted.contains(&v.job_id)) {
                    if !started.contains(&v.for_job) {
                        self.violation(format!("job {} evicted for job {}, which did not start", v.job_id, v.for_job));
                    }
                }
                self.report.preempted = self.report.preempted.saturating_add(preempted.len() as u32);
                let suspended = preemptions
                    .iter()
                    .filter(|v| v.mode == gangway_core::policy::PreemptMode::Suspend && preempted.contains(&v.job_id))
                    .count();
                self.report.preempt_suspended = self.report.preempt_suspended.saturating_add(suspended as u32);
            }
            (Command::UpdateJob { change: JobChange::Suspend, .. }, Outcome::JobUpdated { .. }) => {
                self.report.suspended = self.report.suspended.saturating_add(1);
            }
            (Command::RegisterNode { .. } | Command::SubmitJob { .. }, _) => {}
            (cmd, outcome) => {
                let line = format!("{cmd:?} -> {outcome:?}");
                self.trace(|| line);
            }
        }
        match p.reply {
            ReplyTo::Agent { node, call, resp } => self.send(node, Ev::ToAgent { node, call, resp }),
            ReplyTo::Client { key } => {
                if let Outcome::Submitted { job_id, .. } = applied.outcome {
                    let d = self.delay();
                    self.at(d, Ev::SubmitAck { key, job: job_id });
                }
            }
            ReplyTo::Nobody => {}
        }
    }

    /// Checks that need the state before a command applies.
    fn observe_before(&mut self, cmd: &Command) {
        if let Command::SetNodeState { name, change: gangway_core::NodeStateChange::Down, reason, .. } = cmd {
            self.report.nodes_marked_down += 1;
            let Some(node) = self.agents.iter().position(|a| &a.name == name) else { return };
            let a = &self.agents[node];
            // A node may be declared down only when its agent was really away
            // (crashed or cut off) within the timeout, plus the longest delay.
            let away = a.crashed || a.cut_until > self.now || a.fault_end_ms + DOWN_TIMEOUT_MS + 3_000 >= self.now;
            let line = format!("node {name} marked down ({reason})");
            self.trace(|| line.clone());
            if !away && self.state.nodes.get(name).is_some_and(|n| n.state != NodeState::Down) {
                self.violation(format!("{line}, but its agent was never away: a false node failure"));
            }
        }
    }

    fn leader_tick(&mut self) {
        self.at(LEADER_TICK_MS, Ev::LeaderTick);
        if !self.leader.up {
            return;
        }
        let Leader { heard, memory, since, .. } = &mut self.leader;
        let last = |n: &str| heard.last(n);
        let claim_ended = self.cfg.bug == Some(Bug::NoCompletingWait);
        let runs = |n: &str, job: JobId| {
            if claim_ended {
                return Some(TaskReport { seen_index: u64::MAX, at: u64::MAX, listed: false });
            }
            heard.runs(n, job)
        };
        let heard = Heard {
            now: self.now,
            leader_since: *since,
            down_timeout_ms: DOWN_TIMEOUT_MS,
            index: self.index,
            last: &last,
            runs: &runs,
        };
        let tick = leader_tick(&self.state, self.now, Some(&heard), memory, gangway_core::sched::Policy::Easy);
        for cmd in tick.commands {
            self.propose(cmd, ReplyTo::Nobody);
        }
    }

    fn leader_receives(&mut self, node: usize, call: u64, req: Req) {
        if !self.leader.up {
            self.send(node, Ev::ToAgent { node, call, resp: Resp::Unavailable });
            return;
        }
        let name = self.agents[node].name.clone();
        match req {
            Req::Register => {
                let spec = NodeSpec {
                    name: name.clone(),
                    addr: String::new(),
                    cpus: 64,
                    mem_mb: 65_536,
                    gpus: (0..self.cfg.gpus_per_node)
                        .map(|g| GpuSpec {
                            uuid: format!("{name}-{g}"),
                            model: "sim".into(),
                            mem_mb: 80_000,
                            nvlink_island: 0,
                        })
                        .collect(),
                    topology: Vec::new(),
                    labels: BTreeMap::new(),
                };
                self.leader.heard.record(&name, self.now, None, NODES_MAX);
                let cmd = Command::RegisterNode { spec, now_ms: self.now };
                self.propose(cmd, ReplyTo::Agent { node, call, resp: Resp::Registered });
            }
            Req::Heartbeat(msg) => {
                // The leader's side is the production one (`duties`), fed
                // through production's codec: the simulation only carries
                // the messages.
                let hb = heartbeat_from_proto(&msg);
                for cmd in gpu_health_changes(&self.state, &hb, self.now, usize::MAX) {
                    self.propose(cmd, ReplyTo::Nobody);
                }
                let silence = silence_ms(self.now, self.leader.since, self.leader.heard.last(&name));
                // The injected bug: silent nodes answered as if never silent.
                let down = if self.cfg.bug == Some(Bug::AnswerSilentNodes) { u64::MAX } else { DOWN_TIMEOUT_MS };
                let resp = match (self.cfg.on_heartbeat)(&self.state, self.index, silence, down, &hb) {
                    HeartbeatReply::RegisterAgain => Resp::Answer(pb::HeartbeatResponse {
                        known: false,
                        term: self.leader.term,
                        history: self.state.history,
                        ..Default::default()
                    }),
                    HeartbeatReply::Behind { .. } => Resp::Unavailable,
                    HeartbeatReply::Orders { orders, seen_index, jobs } => {
                        self.leader.heard.record(&name, self.now, Some((seen_index, jobs)), NODES_MAX);
                        let from = gangway_proto::orders::From {
                            term: self.leader.term,
                            index: self.index,
                            history: self.state.history,
                            heartbeat_interval_ms: heartbeat_interval_ms(
                                self.state.nodes.len(),
                                HEARTBEAT_MS,
                                DOWN_TIMEOUT_MS,
                            ),
                        };
                        // The controller's launch orders carry the job's
                        // spec too; the simulated tasks need their GPUs.
                        let launch = orders
                            .launch_gpus(&self.state, &name)
                            .into_iter()
                            .map(|((job_id, attempt), gpus)| pb::LaunchOrder {
                                job_id,
                                attempt,
                                gpus,
                                ..Default::default()
                            })
                            .collect();
                        Resp::Answer(orders_to_proto(&orders, from, launch))
                    }
                };
                self.send(node, Ev::ToAgent { node, call, resp });
            }
            Req::Exit(e) => {
                let cmd = Command::TaskExited {
                    job_id: e.task.0,
                    attempt: e.task.1,
                    node: name,
                    exit_code: e.exit_code,
                    signal: e.signal,
                    reason: e.reason,
                    lost: e.lost,
                    peak_mem_mb: None,
                    usage: e.usage,
                    now_ms: self.now,
                };
                self.propose(cmd, ReplyTo::Agent { node, call, resp: Resp::ExitAck });
            }
        }
    }

    // ------------------------------------------------------------ the agents

    fn agent_round(&mut self, node: usize) {
        let a = &mut self.agents[node];
        if a.crashed || a.waiting.is_some() {
            return;
        }
        let Some(core) = &mut a.core else { return };
        // The node agent's decision (`AgentCore::next_call`), one call a round.
        let req = match core.next_call() {
            Call::Register => Req::Register,
            Call::Exit(exit) => {
                a.in_flight = Some(exit.clone());
                Req::Exit(exit)
            }
            Call::Heartbeat { running, seen_index } => {
                let health = a.healthy.iter().enumerate().map(|(g, ok)| pb::GpuHealthReport {
                    index: g as u32,
                    healthy: *ok,
                    reason: if *ok { String::new() } else { "simulated GPU fault".into() },
                });
                let history = core.fences().history;
                Req::Heartbeat(heartbeat_to_proto(&a.name, running, seen_index, history, health.collect()))
            }
        };
        let timeout = core.call_timeout_ms();
        self.next_id += 1;
        let call = self.next_id;
        let what = match &req {
            Req::Register => "register",
            Req::Heartbeat { .. } => "heartbeat",
            Req::Exit(_) => "exit",
        };
        let sent = self.agent_now(node);
        self.agents[node].waiting = Some((call, sent, what));
        self.trace(|| format!("{node} sends {what} {call}"));
        self.send(node, Ev::ToLeader { node, call, req });
        let timeout = self.agent_span(node, timeout);
        self.at(timeout, Ev::CallTimeout { node, call });
    }

    fn agent_receives(&mut self, node: usize, call: u64, resp: Resp) {
        let Some((waiting, sent, _)) = self.agents[node].waiting else { return };
        if waiting != call || self.agents[node].crashed {
            return;
        }
        self.agents[node].waiting = None;
        let life = self.agents[node].life;
        self.trace(|| format!("{node} answered {call}: {resp:?}"));
        let unsent = self.agents[node].in_flight.take();
        let Some(core) = self.agents[node].core.as_mut() else { return };
        let next = match resp {
            Resp::Unavailable => {
                if let Some(exit) = unsent {
                    core.report_failed(exit);
                }
                RETRY_PAUSE_MS
            }
            Resp::Registered => {
                core.registered_at(
                    sent,
                    DOWN_TIMEOUT_MS,
                    heartbeat_interval_ms(self.state.nodes.len(), HEARTBEAT_MS, DOWN_TIMEOUT_MS),
                );
                self.agents[node].lease = core.lease();
                0
            }
            Resp::ExitAck => 0,
            Resp::Answer(resp) => {
                // Read back as the node agent reads it.
                let answer = answer_from_proto(&resp);
                let actions = core.answered(sent, &answer);
                let again = !core.registered() || core.reports_pending() > 0;
                let interval = core.heartbeat_interval_ms();
                let lease = core.lease();
                self.agents[node].lease = lease;
                for (key, gpus) in &answer.launch {
                    self.agents[node].launch_gpus.insert(*key, gpus.clone());
                }
                self.perform(node, actions);
                if again {
                    0
                } else {
                    interval
                }
            }
        };
        let next = self.agent_span(node, next);
        self.at(next, Ev::AgentRound { node, life });
    }

    fn perform(&mut self, node: usize, actions: Vec<Action>) {
        for action in actions {
            match action {
                Action::PersistFences => {
                    let fences = self.agents[node].core.as_ref().map(|c| c.fences().clone()).unwrap_or_default();
                    self.agents[node].disk = fences;
                }
                Action::Launch(task) => self.launch(node, task),
                Action::Stop { task, grace_ms } => self.stop(node, task, grace_ms),
                Action::Suspend(task) => self.suspend(node, task),
                Action::Resume(task) => self.resume(node, task),
                // The simulated tasks are timers: a signal changes nothing.
                Action::Signal { .. } => {}
            }
        }
    }

    /// SIGSTOP: the task's end waits, with the run time it had left.
    fn suspend(&mut self, node: usize, task: TaskKey) {
        self.next_id += 1;
        let (gen, now) = (self.next_id, self.now);
        let Some(p) = self.agents[node].processes.get_mut(&task) else { return };
        if p.paused_left.is_none() {
            p.paused_left = Some(if p.end_ms == u64::MAX { u64::MAX } else { p.end_ms.saturating_sub(now) });
            p.end_ms = u64::MAX;
            p.gen = gen;
        }
    }

    /// SIGCONT: the task runs the time it had left.
    fn resume(&mut self, node: usize, task: TaskKey) {
        self.next_id += 1;
        let (gen, now) = (self.next_id, self.now);
        // GPU exclusivity: it continues only on GPUs no running process holds.
        let procs = &self.agents[node].processes;
        let gpus = procs.get(&task).map(|p| p.gpus.clone()).unwrap_or_default();
        let clash: Vec<TaskKey> = procs
            .iter()
            .filter(|(k, p)| **k != task && p.paused_left.is_none() && p.gpus.iter().any(|g| gpus.contains(g)))
            .map(|(k, _)| *k)
            .collect();
        for key in clash {
            self.violation(format!("task {task:?} resumed on GPUs {gpus:?} that running task {key:?} holds"));
        }
        let Some(p) = self.agents[node].processes.get_mut(&task) else { return };
        let Some(left) = p.paused_left.take() else { return };
        if left != u64::MAX {
            p.end_ms = now + left;
            p.gen = gen;
            self.at(left, Ev::TaskEnds { node, task, gen });
        }
    }

    fn launch(&mut self, node: usize, task: TaskKey) {
        let gpus = self.agents[node].launch_gpus.get(&task).cloned().unwrap_or_default();
        let mut broken = Vec::new();
        if !self.launched.insert((task.0, task.1, node)) {
            broken.push(format!("job {} attempt {} launched twice on {}", task.0, task.1, self.agents[node].name));
        }
        // One attempt at a time: no other attempt of the job runs anywhere.
        for a in &self.agents {
            for key in a.processes.keys().filter(|k| k.0 == task.0 && k.1 != task.1) {
                broken.push(format!(
                    "job {} attempt {} launched on {} while attempt {} still runs on {}",
                    task.0, task.1, self.agents[node].name, key.1, a.name
                ));
            }
        }
        // GPU exclusivity on the node: a suspended process runs nothing on
        // its GPUs (a preemptor takes them while its victim is suspended).
        for (key, p) in &self.agents[node].processes {
            if p.paused_left.is_none() && p.gpus.iter().any(|g| gpus.contains(g)) {
                broken.push(format!("task {task:?} given GPUs {gpus:?} that task {key:?} still holds"));
            }
        }
        for msg in broken {
            self.violation(msg);
        }
        self.report.launches += 1;
        let run = self.rng.range(500, 40_000);
        let roll = self.rng.next() % 100;
        let (exit_code, stubborn) = (if roll < 10 { Some(1) } else { Some(0) }, roll.is_multiple_of(7));
        // A few tasks hang until their time limit.
        let end_ms = if roll >= 95 { u64::MAX } else { self.now + run };
        self.next_id += 1;
        let gen = self.next_id;
        let p = Process { gpus, end_ms, exit_code, signal: None, stubborn, gen, paused_left: None };
        self.trace(|| format!("{} launches {task:?}", node));
        self.agents[node].processes.insert(task, p);
        if end_ms != u64::MAX {
            self.at(run, Ev::TaskEnds { node, task, gen });
        }
    }

    /// Stops a task with `grace_ms` of its node's clock.
    fn stop(&mut self, node: usize, task: TaskKey, grace_ms: u64) {
        let grace_ms = self.agent_span(node, grace_ms);
        self.next_id += 1;
        let gen = self.next_id;
        let now = self.now;
        let reaction = self.rng.range(0, 500);
        let Some(p) = self.agents[node].processes.get_mut(&task) else { return };
        // A stop continues a suspended task first (SIGCONT), so it can act.
        p.paused_left = None;
        let end = if p.stubborn { now + grace_ms } else { now + reaction.min(grace_ms) };
        if end >= p.end_ms {
            return;
        }
        p.end_ms = end;
        p.gen = gen;
        p.exit_code = None;
        p.signal = Some(if p.stubborn { 9 } else { 15 });
        self.at(end - now, Ev::TaskEnds { node, task, gen });
    }

    fn task_ends(&mut self, node: usize, task: TaskKey, gen: u64) {
        let a = &mut self.agents[node];
        if a.processes.get(&task).is_none_or(|p| p.gen != gen) {
            return;
        }
        let p = a.processes.remove(&task).expect("checked");
        let life = a.life;
        let idle = a.waiting.is_none();
        let exit = Exit::ended(task, p.exit_code, p.signal);
        let Some(core) = a.core.as_mut() else {
            a.orphan_exits.push(exit);
            return;
        };
        core.task_exited(exit);
        if idle {
            self.at(0, Ev::AgentRound { node, life });
        }
    }

    // ------------------------------------------------------------ clients

    fn client_submit(&mut self, key: usize) {
        if self.acked.contains_key(&key) {
            return;
        }
        self.submitted.insert(key);
        let gang = self.rng.chance(250);
        let gpus = self.rng.range(1, u64::from(self.cfg.gpus_per_node.max(1))) as u32;
        let spec = JobSpec {
            user: format!("u{}", key % 3),
            command: vec!["train".into()],
            nodes: if gang { 2 } else { 1 },
            gpus_per_node: gpus,
            cpus_per_task: 1,
            time_limit_s: self.rng.range(45, 90),
            requeue: true,
            qos: if self.rng.chance(URGENT_PER_MILLE) { QOS_URGENT } else { QOS_BATCH }.into(),
            ..JobSpec::default()
        };
        let mut spec = spec;
        // Decided by the key, not the random stream (the other draws stay).
        if key % SCAVENGER_EVERY == SCAVENGER_EVERY / 2 && spec.qos == QOS_BATCH {
            spec.qos = QOS_SCAVENGER.into();
        }
        if key % HET_EVERY == HET_EVERY / 3 {
            spec.batch = true;
            spec.components = vec![gangway_core::spec::HetComponent {
                nodes: 1,
                gpus_per_node: 1,
                ..gangway_core::spec::HetComponent::default()
            }];
        }
        let cmd =
            Command::SubmitJob { spec, identity: "sim".into(), idempotency_key: format!("k{key}"), now_ms: self.now };
        // The client's request reaches the leader after a delay, or not at all.
        if !(self.faulty() && self.rng.chance(self.faults.client_loss_per_mille)) {
            self.propose(cmd, ReplyTo::Client { key });
        }
        // Retry with the same key until acknowledged.
        self.at(CLIENT_RETRY_MS, Ev::Submit { key });
        // Some jobs are suspended for a while (decided by the key, not the
        // random stream, so the other draws of a seed stay as they were).
        if key % SUSPEND_EVERY == SUSPEND_EVERY / 2 {
            self.at(SUSPEND_AFTER_MS, Ev::Suspend { key, suspend: true });
        }
        if self.rng.chance(50) {
            let t = self.rng.range(1_000, 20_000);
            self.at(t, Ev::Cancel { key });
        }
    }

    // ------------------------------------------------------------ the end

    fn final_checks(&mut self) {
        for (key, job) in self.acked.clone() {
            match self.state.jobs.get(&job) {
                None => self.violation(format!("acknowledged submit {key} (job {job}) is gone")),
                Some(j) if j.spec.command != ["train"] => self.violation(format!("job {job} is not submit {key}'s")),
                Some(_) => {}
            }
        }
        let made: BTreeSet<JobId> = self.committed_keys.values().copied().collect();
        let invented: Vec<JobId> = self.state.jobs.keys().filter(|id| !made.contains(id)).copied().collect();
        for id in invented {
            self.violation(format!("job {id} exists but no submit made it"));
        }
        for j in self.state.jobs.values() {
            if j.state == JobState::Completed && !j.spec.components.is_empty() {
                self.report.het_completed += 1;
            }
            match j.state {
                JobState::Completed => self.report.jobs_completed += 1,
                s if s.is_finished() => self.report.jobs_failed += 1,
                _ => {}
            }
        }
        // After healing and settling, no task runs that the state does not want.
        if self.report.violations.is_empty() {
            for a in &self.agents {
                for key in a.processes.keys() {
                    if self.state.jobs.get(&key.0).is_some_and(|j| j.state != JobState::Running) {
                        let msg = format!("{} still runs task {key:?} of a finished job", a.name);
                        self.report.violations.push(msg);
                    }
                }
            }
        }
    }
}

/// Runs one seed.
pub fn run_seed(seed: u64, cfg: &Config, keep_trace: bool) -> Report {
    World::new(seed, cfg.clone(), keep_trace).run()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn failing(cfg: &Config, seeds: std::ops::RangeInclusive<u64>) -> Vec<u64> {
        seeds.filter(|s| !run_seed(*s, cfg, false).violations.is_empty()).collect()
    }

    /// A leader whose heartbeat decision echoes the agent's running tasks
    /// as desired: a plausible bug in `on_heartbeat` (the agent stops what
    /// is not desired, so nothing cancelled, preempted or requeued stops).
    fn echoes_running(state: &State, index: u64, silence: u64, down: u64, hb: &Heartbeat) -> HeartbeatReply {
        let mut reply = on_heartbeat(state, index, silence, down, hb);
        if let HeartbeatReply::Orders { orders, .. } = &mut reply {
            for task in &hb.running {
                if !orders.desired.contains(task) {
                    orders.desired.push(*task);
                }
            }
        }
        reply
    }

    /// The simulation runs the production heartbeat decision: one broken on
    /// purpose is caught by the checkers within a few seeds, while the real
    /// one passes those seeds.
    #[test]
    fn a_broken_on_heartbeat_is_caught() {
        let broken = Config { on_heartbeat: echoes_running, ..Config::default() };
        let caught = (1..=10).find(|s| !run_seed(*s, &broken, false).violations.is_empty());
        let Some(seed) = caught else { panic!("an on_heartbeat that stops nothing passed 10 seeds") };
        let v = run_seed(seed, &broken, false).violations;
        // Caught as tasks that still run, or as requeued jobs that wait
        // for ever for their last attempt to stop.
        assert!(v.iter().any(|v| v.contains("still run") || v.contains("liveness")), "seed {seed}: {v:?}");
        assert!(run_seed(seed, &Config::default(), false).violations.is_empty());
    }

    /// Swarm testing: each seed its own fault mix, some kinds left out; every
    /// seed holds every invariant, and the mixes differ.
    #[test]
    fn swarm_seeds_hold_every_invariant() {
        let cfg = Config { swarm: true, ..Config::default() };
        let mut mixes = BTreeSet::new();
        for seed in 1..=100 {
            let r = run_seed(seed, &cfg, false);
            assert!(
                r.violations.is_empty(),
                "seed {seed}: {:?} (gangway-sim --swarm --seed {seed} --trace)",
                r.violations
            );
            let f = r.faults.expect("a mix");
            mixes.insert((f.drop_per_mille, f.crashes_max, f.cuts_max));
        }
        assert!(mixes.len() > 50, "only {} fault mixes in 100 seeds", mixes.len());
        assert_eq!(Faults::draw(5), Faults::draw(5), "a seed's mix is its own");
        assert_eq!(run_seed(5, &Config::default(), false).faults, Some(Faults::FIXED));
    }

    /// The clock seam is real: agents whose clocks run 60% slow self-fence
    /// after the leader has declared them down (half the node-down timeout
    /// of theirs is more than the whole of the leader's), which the
    /// checkers catch; at the swarm's most, 5%, the same seeds pass.
    #[test]
    fn a_clock_past_the_fences_margin_is_caught() {
        let run = |seed: u64, drift: i64| {
            let mut w = World::new(seed, Config::default(), false);
            for a in &mut w.agents {
                a.drift = drift;
            }
            w.run().violations
        };
        let caught = (1..=30).find(|s| run(*s, -600).iter().any(|v| v.contains(" still runs on ")));
        let Some(seed) = caught else { panic!("agents with clocks 60% slow passed 30 seeds") };
        let max = CLOCK_DRIFT_PER_MILLE_MAX as i64;
        assert_eq!(run(seed, -max), Vec::<String>::new(), "seed {seed} at the swarm's slowest clocks");
        assert_eq!(run(seed, max), Vec::<String>::new(), "seed {seed} at the swarm's fastest clocks");
    }

    /// CI's share of the seeds (`make sim SEEDS=N` runs more).
    #[test]
    fn every_seed_holds_every_invariant() {
        let cfg = Config::default();
        let (mut suspended, mut het, mut yielded) = (0, 0, 0);
        for seed in 1..=200 {
            let r = run_seed(seed, &cfg, false);
            assert!(r.violations.is_empty(), "seed {seed}: {:?} (gangway-sim --seed {seed} --trace)", r.violations);
            assert!(r.jobs_completed > 0, "seed {seed} completed nothing");
            suspended += r.suspended;
            het += r.het_completed;
            yielded += r.preempt_suspended;
        }
        assert!(yielded >= 50, "only {yielded} preemption victims were suspended in 200 seeds");
        assert!(suspended >= 50, "the operator suspended only {suspended} running jobs in 200 seeds");
        assert!(het >= 100, "only {het} heterogeneous jobs completed in 200 seeds");
        let shim = Config { shim: true, ..Config::default() };
        assert_eq!(failing(&shim, 1..=50), Vec::<u64>::new(), "with task shims");
    }

    #[test]
    fn a_seed_replays_exactly() {
        let cfg = Config { shim: true, ..Config::default() };
        let (a, b) = (run_seed(7, &cfg, true), run_seed(7, &cfg, true));
        assert!(!a.trace.is_empty());
        assert_eq!(a.trace, b.trace);
        assert_eq!((a.events, a.entries, a.launches), (b.events, b.entries, b.launches));
        assert_ne!(a.trace, run_seed(8, &cfg, true).trace);
    }

    /// A run that needs more than its events allow is stopped as stuck: a
    /// seed's run within exactly its count passes, one event fewer fails;
    /// the default allows EVENTS_MAX.
    #[test]
    fn a_run_past_its_events_is_stuck() {
        assert_eq!(Config::default().events_max, EVENTS_MAX);
        let whole = run_seed(3, &Config::default(), false);
        assert!(whole.violations.is_empty() && whole.events < EVENTS_MAX, "{:?}", whole.violations);
        let exact = Config { events_max: whole.events, ..Config::default() };
        assert_eq!(run_seed(3, &exact, false).violations, Vec::<String>::new());
        let short = Config { events_max: whole.events - 1, ..Config::default() };
        let v = run_seed(3, &short, false).violations;
        assert!(
            v.iter().any(|v| v.ends_with(&format!("more than {} events: the run does not settle", whole.events - 1))),
            "{v:?}"
        );
    }

    /// A trace grows until it holds TRACE_BYTES_MAX bytes: the line that
    /// reaches them is kept, the next is not.
    #[test]
    fn a_trace_keeps_about_trace_bytes_max_bytes() {
        let mut w = World::new(1, Config::default(), true);
        // "      0 x\n": ten bytes a line.
        for _ in 0..TRACE_BYTES_MAX / 10 - 1 {
            w.trace(|| "x".to_string());
        }
        assert_eq!(w.report.trace.len(), TRACE_BYTES_MAX - 10);
        w.trace(|| "x".to_string());
        assert_eq!(w.report.trace.len(), TRACE_BYTES_MAX, "the line that reaches the limit is kept");
        w.trace(|| "x".to_string());
        assert_eq!(w.report.trace.len(), TRACE_BYTES_MAX, "one line past the limit was kept");
    }

    /// The checker each deliberate bug must trip (a part of its violation):
    /// a broken cluster caught by some other check would not show that its
    /// own checker works.
    fn checker_of(bug: Bug) -> &'static str {
        match bug {
            // An attempt that should have stopped still runs when the next starts.
            Bug::NoSelfFence | Bug::NoCompletingWait | Bug::NoShimLease => " still runs on ",
            Bug::ForgetFences => " launched twice on ",
            Bug::EvictFirst => ", which did not start",
            Bug::AnswerSilentNodes => "a false node failure",
        }
    }

    fn caught_by_its_checker(seed: u64, cfg: &Config, bug: Bug) -> bool {
        run_seed(seed, cfg, false).violations.iter().any(|v| v.contains(checker_of(bug)))
    }

    /// Each deliberately broken cluster is caught by its own checker within a
    /// few dozen seeds, and the seeds that found the real bugs stay fixed.
    #[test]
    fn broken_clusters_are_caught() {
        let broken = |bug, shim| Config { bug: Some(bug), shim, ..Config::default() };
        for (bug, shim, within) in [
            (Bug::NoSelfFence, false, 60),
            (Bug::ForgetFences, false, 20),
            (Bug::NoCompletingWait, false, 10),
            (Bug::NoShimLease, true, 60),
            (Bug::EvictFirst, false, 10),
        ] {
            let cfg = broken(bug, shim);
            let found = (1..=within).find(|s| caught_by_its_checker(*s, &cfg, bug));
            assert!(found.is_some(), "{bug:?} not caught by its checker ({:?}) within {within} seeds", checker_of(bug));
        }
        // Requeued jobs started while their previous attempt was still
        // stopping (before `duties::stopping_jobs`), tasks outlived a crashed
        // agent (before the shim's lease), and stale plans evicted victims for
        // placements apply then refused (before data format 7, about one seed
        // in 400): the seeds that show it. Seeds were re-pinned when
        // preemption joined the simulation, and again when suspension did
        // (each changes every run).
        // (Orders to a node being declared down, found once in 10,000 seeds
        // before `duties::may_answer`, are too rare to pin to a seed as the
        // simulation changes: scenario 23 checks that rule.) Each must trip
        // its own checker: the stale-plan seeds were re-pinned when 1844 and
        // 306 came to be caught only by the liveness check (three submits
        // never acknowledged), not by the eviction check.
        let pinned: [(Bug, bool, &[u64]); 4] = [
            (Bug::NoCompletingWait, false, &[1, 4, 5]),
            (Bug::NoShimLease, true, &[2, 6]),
            (Bug::EvictFirst, true, &[1, 2]),
            (Bug::EvictFirst, false, &[5, 465]),
        ];
        for (bug, shim, seeds) in pinned {
            for &seed in seeds {
                assert!(caught_by_its_checker(seed, &broken(bug, shim), bug), "{bug:?} seed {seed}");
                let fixed = Config { shim, ..Config::default() };
                assert!(run_seed(seed, &fixed, false).violations.is_empty(), "seed {seed} broke again");
            }
        }
    }
}
