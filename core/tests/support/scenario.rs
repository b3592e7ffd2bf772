//! Data-driven scheduler scenarios: each `tests/scenarios/*.toml` file is a
//! cluster (nodes, policy) and a list of steps — submit, schedule (with the
//! expected plan and pending reasons), finish, hold/release, update policy —
//! run through the real `State::apply` and `sched::plan`. Every plan is applied
//! and must be accepted whole; invariants are checked after every step.
//!
//! Format (see any file in tests/scenarios for a full example):
//! ```toml
//! [policy]                 # optional ClusterPolicy (same as `gangway admin export`)
//! [[node]]                 # names = "n[1-4]", cpus, mem_mb, gpus = "8xh100", topology, labels
//! [[step]]                 # one of: submit / schedule / finish / hold / release / requeue / policy /
//!                          #   drain / resume / gpu_fault / gpu_ok / checkpoint (plus at_s, states)
//!                          #   or the leader's duties, with the core's own functions:
//!                          #   heartbeat = "n1" (running = [[job, attempt]], seen_index; expect launch,
//!                          #   desired, stops = { job = grace_s }, known), tick = true (leader_tick over
//!                          #   what the heartbeats said; expect started, reasons, down, timed_out),
//!                          #   new_leader = true (a leader of the next term that has heard nothing yet),
//!                          #   agent = "n1" (the node's `AgentCore`: one heartbeat round, or
//!                          #   restart / exit = [job, attempt, code] / agent_tick; expect actions,
//!                          #   term = an older leader's answer), reservation = { name, start_s, end_s,
//!                          #   nodes | gpus, users, accounts, flags, update } / delete_reservation = NAME
//!                          #   (plus limits = { job = seconds }, checked after any step)
//! ```

use std::collections::BTreeMap;

use std::collections::BTreeSet;

use gangway_core::agent::{Action, AgentCore, Exit, Fences};
use gangway_core::command::{Command, JobChange, NodeStateChange};
use gangway_core::duties::{
    leader_tick, may_answer, node_orders, silence_ms, Heard, HeardBook, LeaderMemory, NodeOrders,
};
use gangway_core::policy::{pattern_matches, ClusterPolicy};
use gangway_core::reservation::{ReservationChange, ReservationFlags, ReservationRequest};
use gangway_core::sched::{plan, Options, Order, Policy};
use gangway_core::spec::{parse_dependencies, GpuSpec, JobSpec, NodeSpec};
use gangway_core::{JobState, Outcome, State};
use toml::Value;

struct Run {
    name: String,
    state: State,
    index: u64,
    now_ms: u64,
    leader: Leader,
    /// The leader's term (a new leader takes the next).
    term: u64,
    /// Node agents, as `node-agent` runs them: their core and what they
    /// last persisted (a restart starts from it).
    agents: BTreeMap<String, (AgentCore, Fences)>,
}

/// The leader's memory, as `controller/src/leader` keeps it.
#[derive(Default)]
struct Leader {
    since_ms: u64,
    heard: HeardBook,
    memory: LeaderMemory,
}

/// The node-down timeout of the scenarios (the controller's default).
const DOWN_TIMEOUT_MS: u64 = 30_000;
/// The grace an agent gives a task it stops on its own (the agent's default).
const AGENT_STOP_GRACE_MS: u64 = 10_000;

impl Run {
    fn apply(&mut self, cmd: Command) -> Outcome {
        self.index += 1;
        let out = self.state.apply(self.index, &cmd).outcome;
        if let Err(e) = self.state.check_invariants() {
            panic!("{}: invariant broken after {}: {e}", self.name, cmd.name());
        }
        out
    }

    fn fail(&self, step: usize, msg: String) -> ! {
        panic!("scenario {} step {}: {msg}", self.name, step + 1)
    }
}

fn expand_names(pattern: &str) -> Vec<String> {
    // `n[1-4]` or `n[01-16]` or a plain name.
    let Some(open) = pattern.find('[') else { return vec![pattern.to_string()] };
    let close = pattern.find(']').expect("closing bracket");
    let (prefix, body, suffix) = (&pattern[..open], &pattern[open + 1..close], &pattern[close + 1..]);
    let (a, b) = body.split_once('-').expect("range a-b");
    let width = a.len();
    let (a, b): (u32, u32) = (a.parse().unwrap(), b.parse().unwrap());
    (a..=b).map(|i| format!("{prefix}{i:0width$}{suffix}")).collect()
}

fn node_specs(v: &Value) -> Vec<NodeSpec> {
    let mut out = Vec::new();
    for n in v.get("node").and_then(Value::as_array).cloned().unwrap_or_default() {
        let names = n.get("names").and_then(Value::as_str).expect("node.names");
        let gpus = n.get("gpus").and_then(Value::as_str).unwrap_or("");
        let (count, model) = match gpus.split_once('x') {
            Some((c, m)) => (c.parse::<u32>().expect("gpu count"), m.to_string()),
            None => (0, String::new()),
        };
        let island = n.get("island_size").and_then(Value::as_integer).unwrap_or(4) as u32;
        for name in expand_names(names) {
            let topology = n
                .get("topology")
                .and_then(Value::as_array)
                .map(|a| a.iter().map(|x| x.as_str().unwrap().to_string()).collect())
                .unwrap_or_default();
            let labels = n
                .get("labels")
                .and_then(Value::as_table)
                .map(|t| t.iter().map(|(k, v)| (k.clone(), v.as_str().unwrap_or("").to_string())).collect())
                .unwrap_or_default();
            out.push(NodeSpec {
                name: name.clone(),
                addr: String::new(),
                cpus: n.get("cpus").and_then(Value::as_integer).unwrap_or(64) as u32,
                mem_mb: n.get("mem_mb").and_then(Value::as_integer).unwrap_or(512 * 1024) as u64,
                gpus: (0..count)
                    .map(|i| GpuSpec {
                        uuid: format!("{name}-gpu{i}"),
                        model: model.clone(),
                        mem_mb: 81920,
                        nvlink_island: i / island.max(1),
                    })
                    .collect(),
                topology,
                labels,
            });
        }
    }
    out
}

fn int_map(v: Option<&Value>) -> BTreeMap<u64, Value> {
    v.and_then(Value::as_table)
        .map(|t| t.iter().map(|(k, v)| (k.parse::<u64>().expect("job id key"), v.clone())).collect())
        .unwrap_or_default()
}

fn ids(v: Option<&Value>) -> Option<Vec<u64>> {
    v.and_then(Value::as_array).map(|a| a.iter().map(|x| x.as_integer().expect("job id") as u64).collect())
}

/// Keys a scenario may use, by where they sit: a misspelt expectation must
/// fail the run, not silently check nothing.
const TOP_KEYS: &[&str] = &["policy", "node", "step"];
const NODE_KEYS: &[&str] = &["names", "gpus", "island_size", "topology", "labels", "cpus", "mem_mb"];
const STEP_KEYS: &[&str] = &[
    "at_s",
    "submit",
    "expect_error",
    "expect_id",
    "schedule",
    "order",
    "started",
    "preempted",
    "nodes",
    "gpus",
    "reasons",
    "reservations",
    "finish",
    "state",
    "update",
    "identity",
    "cancel",
    "hold",
    "admin_hold",
    "release",
    "requeue",
    "policy",
    "force",
    "drain",
    "resume",
    "gpu_fault",
    "gpu_ok",
    "checkpoint",
    "states",
    "heartbeat",
    "running",
    "seen_index",
    "launch",
    "desired",
    "stops",
    "known",
    "tick",
    "down",
    "timed_out",
    "new_leader",
    "agent",
    "actions",
    "term",
    "exit",
    "agent_tick",
    "restart",
    "reservation",
    "delete_reservation",
    "limits",
    "suspend",
    "resume_job",
    "suspended",
    "signal",
    "register",
    "power",
    "node_states",
    "powered_down",
    "power_up",
    "power_down",
    "cpus",
    "starts",
];
const UPDATE_KEYS: &[&str] = &["job", "priority", "nice", "time_limit_s"];

/// Panics naming the first key of `v` (a table) not in `allowed`.
fn known_keys(file: &std::path::Path, at: &str, v: &Value, allowed: &[&str]) {
    for key in v.as_table().into_iter().flat_map(|t| t.keys()) {
        assert!(
            allowed.contains(&key.as_str()),
            "{}: {at}: unknown key `{key}` (known: {})",
            file.display(),
            allowed.join(", ")
        );
    }
}

pub fn run_file(path: &std::path::Path) {
    let text = std::fs::read_to_string(path).unwrap();
    let doc: Value = toml::from_str(&text).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    known_keys(path, "the file", &doc, TOP_KEYS);
    for n in doc.get("node").and_then(Value::as_array).into_iter().flatten() {
        known_keys(path, "[[node]]", n, NODE_KEYS);
    }
    for (i, step) in doc.get("step").and_then(Value::as_array).into_iter().flatten().enumerate() {
        known_keys(path, &format!("step {}", i + 1), step, STEP_KEYS);
        if let Some(u) = step.get("update") {
            known_keys(path, &format!("step {} update", i + 1), u, UPDATE_KEYS);
        }
    }
    // The newest format: scenarios judge the current rules of apply.
    let mut state = State::default();
    state.format = gangway_core::format::FORMAT_NEWEST;
    let mut run = Run {
        name: path.file_name().unwrap().to_string_lossy().into_owned(),
        state,
        index: 0,
        now_ms: 0,
        leader: Leader::default(),
        term: 1,
        agents: BTreeMap::new(),
    };
    if let Some(p) = doc.get("policy") {
        let policy: ClusterPolicy = p.clone().try_into().unwrap_or_else(|e| panic!("{}: policy: {e}", run.name));
        let out = run.apply(Command::UpdatePolicy {
            policy,
            expected_version: None,
            force: false,
            // The scenario's author stands for the cluster (a server).
            identity: "server:scenario".into(),
            now_ms: 0,
        });
        assert!(matches!(out, Outcome::PolicyUpdated { .. }), "{}: policy refused: {out:?}", run.name);
    }
    for spec in node_specs(&doc) {
        let out = run.apply(Command::RegisterNode { spec, now_ms: 0 });
        assert!(matches!(out, Outcome::NodeRegistered { .. }), "{}: node refused: {out:?}", run.name);
    }
    let steps = doc.get("step").and_then(Value::as_array).cloned().unwrap_or_default();
    assert!(!steps.is_empty(), "{}: no steps", run.name);
    for (i, step) in steps.iter().enumerate() {
        if let Some(t) = step.get("at_s").and_then(Value::as_integer) {
            run.now_ms = t as u64 * 1000;
        }
        let now_ms = run.now_ms;
        if let Some(sub) = step.get("submit") {
            let mut table = sub.as_table().cloned().expect("submit table");
            let dep = table.remove("dependency").map(|d| d.as_str().unwrap().to_string());
            let identity = table.remove("identity").and_then(|v| v.as_str().map(String::from));
            let mut spec: JobSpec =
                Value::Table(table).try_into().unwrap_or_else(|e| run.fail(i, format!("spec: {e}")));
            if spec.user.is_empty() {
                spec.user = "alice".into();
            }
            if spec.command.is_empty() && spec.script.is_empty() {
                spec.command = vec!["true".into()];
            }
            if let Some(d) = dep {
                let (deps, singleton) = parse_dependencies(&d).unwrap_or_else(|e| run.fail(i, e.to_string()));
                spec.dependencies = deps;
                spec.singleton = singleton;
            }
            let identity = identity.unwrap_or_else(|| spec.user.clone());
            let out = run.apply(Command::SubmitJob { spec, identity, idempotency_key: String::new(), now_ms });
            match (step.get("expect_error").and_then(Value::as_str), &out) {
                (Some(field), Outcome::Refused(r)) => {
                    if !r.message.starts_with(&format!("{field}:")) && !r.message.contains(field) {
                        run.fail(i, format!("expected a refusal naming {field}, got: {}", r.message));
                    }
                }
                (Some(field), _) => run.fail(i, format!("expected a refusal naming {field}, got {out:?}")),
                (None, Outcome::Submitted { job_id, .. }) => {
                    if let Some(want) = step.get("expect_id").and_then(Value::as_integer) {
                        assert_eq!(*job_id, want as u64, "{} step {}", run.name, i + 1);
                    }
                }
                (None, _) => run.fail(i, format!("submit refused: {out:?}")),
            }
        } else if let Some(sched) = step.get("schedule") {
            let policy = match sched.as_str().unwrap_or("easy") {
                "easy" => Policy::Easy,
                "fifo" => Policy::Fifo,
                "first-fit" => Policy::FirstFit,
                other => run.fail(i, format!("unknown policy {other}")),
            };
            let order = if step.get("order").and_then(Value::as_str) == Some("submit") {
                Order::Submit
            } else {
                Order::Priority
            };
            let p1 = plan(&run.state, &Options { policy, order, now_ms, estimate_s: None, stopping: None });
            let p2 = plan(&run.state, &Options { policy, order, now_ms, estimate_s: None, stopping: None });
            assert_eq!(p1, p2, "{}: the same inputs must give the same plan", run.name);
            let started: Vec<u64> = p1.placements.iter().map(|p| p.job_id).collect();
            let preempted: Vec<u64> = p1.preemptions.iter().map(|p| p.job_id).collect();
            if let Some(want) = ids(step.get("started")) {
                let (mut a, mut b) = (started.clone(), want.clone());
                a.sort_unstable();
                b.sort_unstable();
                if a != b {
                    run.fail(i, format!("started {started:?}, expected {want:?}; reasons {:?}", p1.reasons));
                }
            }
            if let Some(want) = ids(step.get("preempted")) {
                let mut a = preempted.clone();
                a.sort_unstable();
                if a != want {
                    run.fail(i, format!("preempted {preempted:?}, expected {want:?}"));
                }
            }
            for (job, want) in int_map(step.get("nodes")) {
                let placed = p1
                    .placements
                    .iter()
                    .find(|p| p.job_id == job)
                    .unwrap_or_else(|| run.fail(i, format!("job {job} not placed")));
                let got: Vec<&str> = placed.nodes.iter().map(|n| n.node.as_str()).collect();
                let want_s = want.as_str().unwrap_or_else(|| run.fail(i, "nodes values are patterns".into()));
                // A pattern that every node must match, and (with `=`) the exact count.
                let (pat, count) = match want_s.split_once(" x") {
                    Some((p, c)) => (p, Some(c.parse::<usize>().unwrap())),
                    None => (want_s, None),
                };
                if !got.iter().all(|n| pattern_matches(pat, n)) || count.is_some_and(|c| c != got.len()) {
                    run.fail(i, format!("job {job} placed on {got:?}, expected {want_s}"));
                }
            }
            for (job, want) in int_map(step.get("gpus")) {
                let placed = p1
                    .placements
                    .iter()
                    .find(|p| p.job_id == job)
                    .unwrap_or_else(|| run.fail(i, format!("job {job} not placed")));
                let want: Vec<u32> = want.as_array().unwrap().iter().map(|x| x.as_integer().unwrap() as u32).collect();
                if placed.nodes[0].gpus != want {
                    run.fail(i, format!("job {job} got GPUs {:?}, expected {want:?}", placed.nodes[0].gpus));
                }
            }
            for (job, want) in int_map(step.get("reasons")) {
                let got = p1.reasons.iter().find(|(id, _)| *id == job).map(|(_, r)| r.as_str()).unwrap_or("(none)");
                if got != want.as_str().unwrap() {
                    run.fail(i, format!("job {job} reason {got}, expected {}", want.as_str().unwrap()));
                }
            }
            for (job, want) in int_map(step.get("reservations")) {
                let got = p1.reservations.iter().find(|(id, _)| *id == job).map(|(_, t)| *t / 1000);
                let want = want.as_integer().expect("reservation start in seconds") as u64;
                if got != Some(want) {
                    run.fail(i, format!("job {job} reserved at {got:?} s, expected {want} s; {:?}", p1.reservations));
                }
            }
            let n = started.len();
            let out =
                run.apply(Command::ApplySchedule { preemptions: p1.preemptions, placements: p1.placements, now_ms });
            match out {
                Outcome::ScheduleApplied { started, rejected, .. } => {
                    if !rejected.is_empty() || started.len() != n {
                        run.fail(i, format!("apply rejected part of the plan: {rejected:?}"));
                    }
                }
                other => run.fail(i, format!("plan refused: {other:?}")),
            }
        } else if let Some(fin) = step.get("finish") {
            let job_id = fin.as_integer().expect("finish = JOB") as u64;
            let state = match step.get("state").and_then(Value::as_str).unwrap_or("completed") {
                "completed" => JobState::Completed,
                "failed" => JobState::Failed,
                other => run.fail(i, format!("unknown state {other}")),
            };
            let attempt = run.state.jobs[&job_id].attempt;
            let out = run.apply(Command::JobFinished {
                job_id,
                attempt,
                state,
                exit_code: Some(if state == JobState::Completed { 0 } else { 1 }),
                reason: String::new(),
                now_ms,
            });
            assert!(matches!(out, Outcome::JobFinished { .. }), "{} step {}: {out:?}", run.name, i + 1);
        } else if let Some(u) = step.get("update") {
            let job_id = u.get("job").and_then(Value::as_integer).expect("update.job") as u64;
            let change = if let Some(p) = u.get("priority").and_then(Value::as_integer) {
                JobChange::SetPriority(Some(p as u32))
            } else if let Some(n) = u.get("nice").and_then(Value::as_integer) {
                JobChange::SetNice(n as i32)
            } else if let Some(t) = u.get("time_limit_s").and_then(Value::as_integer) {
                JobChange::SetTimeLimit(t as u64)
            } else {
                run.fail(i, "update needs priority, nice or time_limit_s".into())
            };
            let identity = step.get("identity").and_then(Value::as_str).unwrap_or("alice").to_string();
            let out = run.apply(Command::UpdateJob { job_id, change, identity, now_ms });
            if matches!(out, Outcome::Refused(_)) != step.get("expect_error").is_some() {
                run.fail(i, format!("unexpected outcome {out:?}"));
            }
        } else if let Some(job) = step.get("cancel") {
            let job_id = job.as_integer().unwrap() as u64;
            let identity = step.get("identity").and_then(Value::as_str).unwrap_or("alice").to_string();
            let out = run.apply(Command::CancelJob { job_id, identity, now_ms });
            if matches!(out, Outcome::Refused(_)) != step.get("expect_error").is_some() {
                run.fail(i, format!("unexpected outcome {out:?}"));
            }
        } else if let Some(job) = step
            .get("hold")
            .or(step.get("admin_hold"))
            .or(step.get("release"))
            .or(step.get("requeue"))
            .or(step.get("suspend"))
            .or(step.get("resume_job"))
            .or(step.get("signal"))
        {
            let job_id = job.as_integer().unwrap() as u64;
            let change = if step.get("admin_hold").is_some() {
                JobChange::Hold { admin: true }
            } else if step.get("hold").is_some() {
                JobChange::Hold { admin: false }
            } else if step.get("release").is_some() {
                JobChange::Release
            } else if step.get("suspend").is_some() {
                JobChange::Suspend
            } else if step.get("resume_job").is_some() {
                JobChange::Resume
            } else if step.get("signal").is_some() {
                JobChange::Signal { signal: 10, target: gangway_core::command::SignalTarget::Steps }
            } else {
                JobChange::Requeue { hold: false }
            };
            let identity = step.get("identity").and_then(Value::as_str).unwrap_or("alice").to_string();
            let out = run.apply(Command::UpdateJob { job_id, change, identity, now_ms });
            let refused = matches!(out, Outcome::Refused(_));
            if refused != step.get("expect_error").is_some() {
                run.fail(i, format!("unexpected outcome {out:?}"));
            }
        } else if let Some(p) = step.get("policy") {
            let policy: ClusterPolicy = p.clone().try_into().unwrap_or_else(|e| run.fail(i, format!("policy: {e}")));
            let force = step.get("force").and_then(Value::as_bool).unwrap_or(false);
            let out = run.apply(Command::UpdatePolicy {
                policy,
                expected_version: None,
                force,
                identity: "server:scenario".into(),
                now_ms,
            });
            match (step.get("expect_error").and_then(Value::as_str), &out) {
                (Some(want), Outcome::Refused(r)) if r.message.contains(want) => {}
                (None, Outcome::PolicyUpdated { .. }) => {}
                _ => run.fail(i, format!("unexpected policy outcome {out:?}")),
            }
        } else if let Some(node) = step.get("drain").or(step.get("resume")) {
            let change = if step.get("drain").is_some() { NodeStateChange::Drain } else { NodeStateChange::Resume };
            let name = node.as_str().expect("node name").to_string();
            let out = run.apply(Command::SetNodeState { name, change, reason: "scenario".into(), now_ms });
            assert!(matches!(out, Outcome::NodeStateSet { .. }), "{} step {}: {out:?}", run.name, i + 1);
        } else if let Some(gpu) = step.get("gpu_fault").or(step.get("gpu_ok")) {
            let (node, idx) = gpu.as_str().and_then(|g| g.split_once(':')).expect("gpu = \"NODE:INDEX\"");
            let out = run.apply(Command::SetGpuHealth {
                node: node.to_string(),
                gpu: idx.parse().expect("GPU index"),
                healthy: step.get("gpu_ok").is_some(),
                reason: "xid 79".into(),
                now_ms,
            });
            assert!(matches!(out, Outcome::GpuHealthSet { .. }), "{} step {}: {out:?}", run.name, i + 1);
        } else if let Some(job) = step.get("checkpoint") {
            let job_id = job.as_integer().unwrap() as u64;
            let attempt = run.state.jobs[&job_id].attempt;
            run.apply(Command::JobCheckpointed { job_id, attempt, now_ms });
        } else if let Some(node) = step.get("agent") {
            agent(&mut run, i, step, node.as_str().expect("agent = NODE"));
        } else if let Some(node) = step.get("heartbeat") {
            heartbeat(&mut run, i, step, node.as_str().expect("heartbeat = NODE"));
        } else if let Some(r) = step.get("reservation") {
            reservation(&mut run, i, step, r);
        } else if let Some(name) = step.get("delete_reservation") {
            let change = ReservationChange::Delete { name: name.as_str().expect("reservation name").to_string() };
            let identity = step.get("identity").and_then(Value::as_str).unwrap_or("server:scenario").to_string();
            let out = run.apply(Command::ChangeReservation { change, identity, now_ms });
            match (step.get("expect_error").and_then(Value::as_str), &out) {
                (Some(want), Outcome::Refused(r)) if r.message.contains(want) => {}
                (None, Outcome::ReservationChanged { .. }) => {}
                _ => run.fail(i, format!("unexpected outcome {out:?}")),
            }
        } else if step.get("tick").is_some() {
            tick(&mut run, i, step);
        } else if let Some(name) = step.get("register").and_then(Value::as_str) {
            // A pool node's agent registers, with the pool's hardware (or
            // `cpus` of its own).
            let (_, pool) = run.state.policy.pool_of(name).unwrap_or_else(|| run.fail(i, format!("{name}: no pool")));
            let mut spec = pool.node_spec(name);
            spec.addr = format!("{name}:7000");
            if let Some(c) = step.get("cpus").and_then(Value::as_integer) {
                spec.cpus = c as u32;
            }
            let out = run.apply(Command::RegisterNode { spec, now_ms });
            if matches!(out, Outcome::Refused(_)) != step.get("expect_error").is_some() {
                run.fail(i, format!("unexpected outcome {out:?}"));
            }
        } else if let Some(name) = step.get("power").and_then(Value::as_str) {
            let change = match step.get("state").and_then(Value::as_str) {
                Some("up") => NodeStateChange::PowerUp,
                _ => NodeStateChange::PowerDown,
            };
            let cmd = Command::SetNodeState { name: name.into(), change, reason: "scenario".into(), now_ms };
            let out = run.apply(cmd);
            if matches!(out, Outcome::Refused(_)) != step.get("expect_error").is_some() {
                run.fail(i, format!("unexpected outcome {out:?}"));
            }
        } else if step.get("new_leader").is_some() {
            run.leader = Leader { since_ms: now_ms, ..Leader::default() };
            run.term += 1;
        } else if step.get("at_s").is_none() {
            run.fail(
                i,
                "a step needs submit, schedule, finish, hold, release, requeue, policy, drain, resume, gpu_fault, \
                 gpu_ok, checkpoint, heartbeat, agent, tick or new_leader"
                    .into(),
            );
        }
        // Job time limits (seconds), checked after any step.
        for (job, want) in int_map(step.get("limits")) {
            let got = run.state.jobs.get(&job).map(|j| j.spec.time_limit_s);
            if got != want.as_integer().map(|w| w as u64) {
                run.fail(i, format!("job {job} has time limit {got:?} s, expected {want}"));
            }
        }
        // Job start times (seconds; -1: not started), checked after any step.
        for (job, want) in int_map(step.get("starts")) {
            let got = run.state.jobs.get(&job).and_then(|j| j.start_time_ms).map(|t| t / 1000);
            if got != want.as_integer().and_then(|w| u64::try_from(w).ok()) {
                run.fail(i, format!("job {job} started at {got:?} s, expected {want}"));
            }
        }
        // Node states, checked after any step.
        for (node, want) in step.get("node_states").and_then(Value::as_table).into_iter().flatten() {
            let got = run.state.nodes.get(node).map(|n| n.state.as_str()).unwrap_or("(gone)");
            if !got.eq_ignore_ascii_case(want.as_str().unwrap()) {
                run.fail(i, format!("node {node} is {got}, expected {}", want.as_str().unwrap()));
            }
        }
        // The suspended jobs, checked after any step.
        if let Some(want) = ids(step.get("suspended")) {
            let got: Vec<u64> = run.state.jobs.values().filter(|j| j.is_suspended()).map(|j| j.id).collect();
            if got != sorted(want.clone()) {
                run.fail(i, format!("suspended {got:?}, expected {want:?}"));
            }
        }
        // Job states, checked after any step.
        for (job, want) in int_map(step.get("states")) {
            let got = run.state.jobs.get(&job).map(|j| j.state.as_str()).unwrap_or("(gone)");
            if !got.eq_ignore_ascii_case(want.as_str().unwrap()) {
                run.fail(i, format!("job {job} is {got}, expected {}", want.as_str().unwrap()));
            }
        }
    }
}

/// `reservation = { name, start_s, end_s, nodes = "n[1-2]" | gpus, users, accounts, flags, partition }`:
/// created (or with `update = true`, replaced) by `identity` (default: a server).
fn reservation(run: &mut Run, i: usize, step: &Value, r: &Value) {
    let strs = |k: &str| -> Vec<String> {
        r.get(k).and_then(Value::as_array).into_iter().flatten().map(|v| v.as_str().unwrap().to_string()).collect()
    };
    let secs = |k: &str| r.get(k).and_then(Value::as_integer).map_or(0, |v| v as u64 * 1000);
    let request = ReservationRequest {
        name: r.get("name").and_then(Value::as_str).unwrap_or("resv").to_string(),
        start_ms: secs("start_s"),
        end_ms: secs("end_s"),
        nodes: r.get("nodes").and_then(Value::as_str).map(expand_names).unwrap_or_default(),
        gpus: r.get("gpus").and_then(Value::as_integer).unwrap_or(0) as u32,
        partition: r.get("partition").and_then(Value::as_str).unwrap_or("").to_string(),
        users: strs("users"),
        accounts: strs("accounts"),
        flags: ReservationFlags::parse(r.get("flags").and_then(Value::as_str).unwrap_or(""))
            .unwrap_or_else(|e| run.fail(i, e.to_string())),
    };
    let change = if r.get("update").and_then(Value::as_bool) == Some(true) {
        ReservationChange::Update(request)
    } else {
        ReservationChange::Create(request)
    };
    let identity = step.get("identity").and_then(Value::as_str).unwrap_or("server:scenario").to_string();
    let out = run.apply(Command::ChangeReservation { change, identity, now_ms: run.now_ms });
    match (step.get("expect_error").and_then(Value::as_str), &out) {
        (Some(want), Outcome::Refused(r)) if r.message.contains(want) => {}
        (None, Outcome::ReservationChanged { .. }) => {}
        _ => run.fail(i, format!("unexpected reservation outcome {out:?}")),
    }
}

fn sorted(mut v: Vec<u64>) -> Vec<u64> {
    v.sort_unstable();
    v
}

/// The leader hears a heartbeat from `node` (running `running`, having seen
/// `seen`): recorded as the controller records it, answered with
/// `duties::node_orders` unless the node is silent past the timeout.
fn leader_hears(run: &mut Run, node: &str, running: &BTreeSet<(u64, u32)>, seen: u64) -> NodeOrders {
    let silence = silence_ms(run.now_ms, run.leader.since_ms, run.leader.heard.last(node));
    let orders = if may_answer(silence, DOWN_TIMEOUT_MS) {
        node_orders(&run.state, node, running)
    } else {
        NodeOrders::default()
    };
    if orders.known {
        let jobs = running.iter().map(|t| t.0).collect();
        run.leader.heard.record(node, run.now_ms, Some((seen, jobs)), gangway_core::limits::NODES_MAX);
    }
    orders
}

/// A heartbeat from `node` reaches the leader: recorded as the controller
/// records it, answered with `duties::node_orders`.
fn heartbeat(run: &mut Run, i: usize, step: &Value, node: &str) {
    let running: BTreeSet<(u64, u32)> = step
        .get("running")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
        .map(|t| {
            let t = t.as_array().expect("running = [[job, attempt]]");
            (t[0].as_integer().unwrap() as u64, t[1].as_integer().unwrap() as u32)
        })
        .collect();
    let seen = step.get("seen_index").and_then(Value::as_integer).map_or(run.index, |s| s as u64);
    let orders = leader_hears(run, node, &running, seen);
    if let Some(want) = step.get("known").and_then(Value::as_bool) {
        if orders.known != want {
            run.fail(i, format!("known = {}, expected {want}", orders.known));
        }
    }
    if let Some(want) = ids(step.get("launch")) {
        let got = sorted(orders.launch.iter().map(|t| t.0).collect());
        if got != sorted(want.clone()) {
            run.fail(i, format!("launch {got:?}, expected {want:?}"));
        }
    }
    if let Some(want) = ids(step.get("desired")) {
        let got = sorted(orders.desired.iter().map(|t| t.0).collect());
        if got != sorted(want.clone()) {
            run.fail(i, format!("desired {got:?}, expected {want:?}"));
        }
    }
    if step.get("stops").is_some() {
        let want: BTreeMap<u64, u32> =
            int_map(step.get("stops")).into_iter().map(|(k, v)| (k, v.as_integer().unwrap() as u32)).collect();
        let got: BTreeMap<u64, u32> = orders.stops.iter().map(|s| (s.task.0, s.grace_s)).collect();
        if got != want {
            run.fail(i, format!("stops {got:?}, expected {want:?}"));
        }
    }
}

/// Node `node`'s agent, with the production `AgentCore`: `restart` (it
/// starts again from what it persisted), `exit = [job, attempt, code]` (a
/// task ends; the report reaches the leader and is applied), `agent_tick`
/// (time passes: the self-fence), or by default one heartbeat round (what it
/// runs and has seen go to the leader, which answers with `node_orders` as a
/// leader of `term`, default the current one). `actions` lists what the
/// agent does, in order: `persist`, `launch JOB.ATTEMPT`, `stop JOB.ATTEMPT
/// GRACE_MS`.
fn agent(run: &mut Run, i: usize, step: &Value, node: &str) {
    let now = run.now_ms;
    let (core, persisted) = run.agents.entry(node.to_string()).or_insert_with(|| {
        let mut core = AgentCore::new(Fences::default(), AGENT_STOP_GRACE_MS, now);
        core.registered_at(now, DOWN_TIMEOUT_MS, 0);
        (core, Fences::default())
    });
    let actions = if step.get("restart").is_some() {
        *core = AgentCore::new(persisted.clone(), AGENT_STOP_GRACE_MS, now);
        core.registered_at(now, DOWN_TIMEOUT_MS, 0);
        Vec::new()
    } else if let Some(exit) = step.get("exit").and_then(Value::as_array) {
        let n = |k: usize| exit[k].as_integer().expect("exit = [job, attempt, code]");
        let task = (n(0) as u64, n(1) as u32);
        core.task_exited(Exit::ended(task, Some(n(2) as i32), None));
        deliver_reports(run, node);
        return check_actions(run, i, step, Vec::new());
    } else if step.get("agent_tick").is_some() {
        core.tick(now)
    } else {
        let running: BTreeSet<(u64, u32)> = core.running().into_iter().collect();
        let seen = core.seen_index();
        let orders = leader_hears(run, node, &running, seen);
        let term = step.get("term").and_then(Value::as_integer).map_or(run.term, |t| t as u64);
        let answer = orders.answer(&run.state, node, term, run.index, 0);
        let (core, _) = run.agents.get_mut(node).expect("agent");
        let actions = core.answered(now, &answer);
        deliver_reports(run, node);
        actions
    };
    let (core, persisted) = run.agents.get_mut(node).expect("agent");
    if actions.contains(&Action::PersistFences) {
        *persisted = core.fences().clone();
    }
    check_actions(run, i, step, actions)
}

/// The agent's exit reports reach the leader and are applied.
fn deliver_reports(run: &mut Run, node: &str) {
    let (core, _) = run.agents.get_mut(node).expect("agent");
    let mut reports = Vec::new();
    while let Some(e) = core.take_report() {
        reports.push(e);
    }
    for e in reports {
        run.apply(Command::TaskExited {
            job_id: e.task.0,
            attempt: e.task.1,
            node: node.to_string(),
            exit_code: e.exit_code,
            signal: e.signal,
            reason: e.reason,
            lost: e.lost,
            peak_mem_mb: None,
            usage: None,
            now_ms: run.now_ms,
        });
    }
}

/// Compares what an agent did with the step's `actions`.
fn check_actions(run: &Run, i: usize, step: &Value, actions: Vec<Action>) {
    let Some(want) = step.get("actions").and_then(Value::as_array) else { return };
    let want: Vec<&str> = want.iter().map(|a| a.as_str().expect("actions = [\"...\"]")).collect();
    let got: Vec<String> = actions
        .iter()
        .map(|a| match a {
            Action::PersistFences => "persist".to_string(),
            Action::Launch((j, a)) => format!("launch {j}.{a}"),
            Action::Stop { task: (j, a), grace_ms } => format!("stop {j}.{a} {grace_ms}"),
            Action::Suspend((j, a)) => format!("suspend {j}.{a}"),
            Action::Resume((j, a)) => format!("resume {j}.{a}"),
            Action::Signal { task: (j, a), signal, .. } => format!("signal {j}.{a} {signal}"),
        })
        .collect();
    if got != want {
        run.fail(i, format!("agent actions {got:?}, expected {want:?}"));
    }
}

/// The leader's tick over what it heard: `duties::leader_tick`, whose
/// commands are applied as the leader proposes them.
fn tick(run: &mut Run, i: usize, step: &Value) {
    let l = &mut run.leader;
    let last = |n: &str| l.heard.last(n);
    let runs = |n: &str, job: u64| l.heard.runs(n, job);
    let heard = Heard {
        now: run.now_ms,
        leader_since: l.since_ms,
        down_timeout_ms: DOWN_TIMEOUT_MS,
        index: run.index,
        last: &last,
        runs: &runs,
    };
    let t = leader_tick(&run.state, run.now_ms, Some(&heard), &mut l.memory, Policy::Easy);
    let (mut started, mut down, mut timed_out, mut powered_down) = (Vec::new(), Vec::new(), Vec::new(), Vec::new());
    for cmd in &t.commands {
        match cmd {
            Command::ApplySchedule { placements, .. } => started.extend(placements.iter().map(|p| p.job_id)),
            Command::SetNodeState { name, change: NodeStateChange::Down, .. } => down.push(name.clone()),
            Command::SetNodeState { name, change: NodeStateChange::PowerDown, .. } => powered_down.push(name.clone()),
            Command::JobFinished { job_id, .. } => timed_out.push(*job_id),
            _ => {}
        }
    }
    for (job, want) in int_map(step.get("reasons")) {
        let got = t.reasons.iter().find(|(id, _)| *id == job).map(|(_, r)| r.as_str()).unwrap_or("(none)");
        if got != want.as_str().unwrap() {
            run.fail(i, format!("job {job} reason {got}, expected {}", want.as_str().unwrap()));
        }
    }
    for (key, got) in [("started", sorted(started)), ("timed_out", sorted(timed_out))] {
        if let Some(want) = ids(step.get(key)) {
            if got != sorted(want.clone()) {
                run.fail(i, format!("{key} {got:?}, expected {want:?}; reasons {:?}", t.reasons));
            }
        }
    }
    for (key, got) in
        [("down", &down), ("powered_down", &powered_down), ("power_up", &t.power_up), ("power_down", &t.power_down)]
    {
        if let Some(want) = step.get(key).and_then(Value::as_array) {
            let want: Vec<&str> = want.iter().map(|v| v.as_str().unwrap()).collect();
            if *got != want {
                run.fail(i, format!("{key} {got:?}, expected {want:?}"));
            }
        }
    }
    for cmd in t.commands {
        run.apply(cmd);
    }
}
