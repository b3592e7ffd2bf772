//! The node agent's decisions, as a state machine with no I/O: [`AgentCore`]
//! takes what happened (a leader's answer, a task's exit, the passing of time)
//! and returns what to do ([`Action`]s). The agent's async loop
//! (`node-agent/src/lib.rs`) carries events in and performs the actions (it
//! persists fences, starts and signals processes); the whole-cluster
//! simulation (`sim/`) drives the same machine in virtual time.
//!
//! What it decides:
//! - **Fences.** An answer from a leader older than one already obeyed is
//!   ignored; an attempt at or below one already launched here is never
//!   launched again (it is reported lost), also across agent restarts (the
//!   fences are persisted before a launch).
//! - **Self-fence.** An agent that has not reached a leader for half the
//!   node-down timeout stops its tasks (killed by three quarters of it), so they
//!   are gone before the leader can declare the node down and start them
//!   elsewhere. Contact is timed from when a heartbeat was *sent*.
//! - **Reconcile.** Tasks the leader no longer wants stop (a preempted job's
//!   with its QOS grace); ordered tasks start, unless a stopping task still
//!   holds their GPUs (the order comes again).
//! - **Exits** are reported oldest first, bounded; a task the node stopped on
//!   its own is reported lost (to be requeued) unless it had ended cleanly.
//!
//! Times are milliseconds on the agent's own monotonic clock.

use std::collections::{BTreeMap, BTreeSet, VecDeque};

use crate::model::JobId;
use crate::model::TaskKey;

/// Exit reports kept for delivery while the controllers are unreachable; beyond
/// this the oldest are dropped (the leader then learns of them as lost tasks).
pub const PENDING_EXITS_MAX: usize = 10_000;
/// Jobs whose launch fence is remembered. Beyond it the oldest (lowest) job
/// ids are forgotten: job ids only grow, and orders for such old jobs come only
/// from long-deposed leaders.
pub const FENCES_MAX: usize = 100_000;
/// One call attempt's deadline is this share of the node-down timeout (within
/// the bounds below), so an agent whose controller went silent tries the next
/// one long before the leader could declare its node down.
const CALL_TIMEOUT_SHARE: u64 = 4;
const CALL_TIMEOUT_MIN_MS: u64 = 500;
const CALL_TIMEOUT_MAX_MS: u64 = 10_000;
/// Node-down timeout assumed until a controller says otherwise at registration.
pub const DOWN_TIMEOUT_DEFAULT_MS: u64 = 10_000;
/// Heartbeats an agent sends within its self-fence window (half the
/// node-down timeout) at least, so losing one or two never fences a healthy
/// node: the longest interval a leader may ask for is that window over this.
pub const HEARTBEATS_PER_FENCE_WINDOW_MIN: u64 = 3;
/// The shortest heartbeat interval an agent obeys (a leader asking for less
/// would have its own fleet flood it).
pub const HEARTBEAT_INTERVAL_MIN_MS: u64 = 100;
/// The shortest deadline of one heartbeat call (see
/// [`AgentCore::heartbeat_call_timeout_ms`]).
pub const HEARTBEAT_CALL_TIMEOUT_MIN_MS: u64 = 2_000;
/// The interval before any leader has named one.
pub const HEARTBEAT_INTERVAL_DEFAULT_MS: u64 = 1_000;

/// The longest heartbeat interval that keeps [`HEARTBEATS_PER_FENCE_WINDOW_MIN`]
/// heartbeats inside the self-fence window of `down_timeout_ms`.
pub fn heartbeat_interval_cap_ms(down_timeout_ms: u64) -> u64 {
    (down_timeout_ms / 2 / HEARTBEATS_PER_FENCE_WINDOW_MIN).max(HEARTBEAT_INTERVAL_MIN_MS)
}

/// What the agent persists so that a restart never launches an attempt twice.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Fences {
    /// The cluster history `max_term` counts in (`State::history`: a
    /// cluster restored from a backup counts terms and log indexes afresh).
    pub history: u64,
    /// Highest leader term whose orders this agent followed.
    pub max_term: u64,
    /// Job id → the highest attempt launched here.
    pub attempts: BTreeMap<JobId, u32>,
}

/// One task's exit, as reported to the leader.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Exit {
    pub task: TaskKey,
    pub exit_code: Option<i32>,
    pub signal: Option<i32>,
    pub reason: String,
    /// The node lost the task (cut off, agent restarted): requeue per policy.
    pub lost: bool,
    pub peak_mem_mb: Option<u64>,
    /// What the task used, where the agent measured it.
    pub usage: Option<crate::model::TaskUsage>,
}

impl Exit {
    /// A task that ran and ended with `exit_code` or by `signal`.
    pub fn ended(task: TaskKey, exit_code: Option<i32>, signal: Option<i32>) -> Exit {
        Exit { task, exit_code, signal, reason: String::new(), lost: false, peak_mem_mb: None, usage: None }
    }

    /// A task that never ran here, and why (`lost`: the node's fault).
    pub fn not_run(task: TaskKey, reason: String, lost: bool) -> Exit {
        Exit { task, exit_code: None, signal: None, reason, lost, peak_mem_mb: None, usage: None }
    }

    fn clean(&self) -> bool {
        self.exit_code == Some(0) && self.signal.is_none()
    }
}

/// A leader's answer to a heartbeat, reduced to what the decisions need.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Answer {
    pub known: bool,
    pub term: u64,
    /// The log index of the state the orders come from.
    pub index: u64,
    pub desired: Vec<TaskKey>,
    /// Tasks to start and the GPUs each gets here.
    pub launch: Vec<(TaskKey, Vec<u32>)>,
    /// Tasks to stop with a grace of their own (seconds).
    pub stops: Vec<(TaskKey, u32)>,
    /// Desired tasks whose job is suspended; the others run.
    pub suspended: Vec<TaskKey>,
    /// Desired tasks' last requested signal (delivered once per number).
    pub signals: Vec<(TaskKey, crate::model::JobSignal)>,
    /// The heartbeat interval the leader asks for now (0: not named; it
    /// stretches as the fleet grows, see `duties::heartbeat_interval_ms`).
    pub heartbeat_interval_ms: u64,
    /// The cluster history `term` and `index` count in (`State::history`).
    pub history: u64,
}

/// What the agent's shell does, in order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Action {
    /// Write [`AgentCore::fences`] to disk (synced) before what follows; if
    /// that fails, the launches that follow must not happen (report each with
    /// [`AgentCore::launch_failed`]).
    PersistFences,
    /// Start the ordered task (its order is in the answer).
    Launch(TaskKey),
    /// Signal the task now and kill it after `grace_ms` (a suspended task
    /// is continued, so that it can act on the signal).
    Stop { task: TaskKey, grace_ms: u64 },
    /// Stop every process of the task where it stands (its job was
    /// suspended); its time-limit warning waits.
    Suspend(TaskKey),
    /// Continue a suspended task.
    Resume(TaskKey),
    /// Send the task a signal (`scancel --signal`).
    Signal { task: TaskKey, signal: i32, target: crate::command::SignalTarget },
}

/// What the agent says to the leader next (see [`AgentCore::next_call`]).
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Call {
    Register,
    Exit(Exit),
    Heartbeat { running: Vec<TaskKey>, seen_index: u64 },
}

/// The agent's decisions and the little state they need.
#[derive(Debug, Clone)]
pub struct AgentCore {
    fences: Fences,
    /// Tasks running here (launched or adopted, their exit not yet taken).
    tasks: BTreeMap<TaskKey, Task>,
    pending: VecDeque<Exit>,
    registered: bool,
    down_timeout_ms: u64,
    /// When the last heartbeat a leader answered was sent.
    last_contact_ms: u64,
    stop_grace_ms: u64,
    /// The highest index of orders acted on (sent with each heartbeat).
    seen_index: u64,
    /// How long to wait between heartbeats, as the leader last asked
    /// (bounded by the self-fence window).
    interval_ms: u64,
}

#[derive(Debug, Clone, Default)]
struct Task {
    gpus: Vec<u32>,
    /// Asked to stop (its kill deadline runs).
    stopping: bool,
    /// Stopped by the node on its own (cut off from every controller).
    lost: bool,
    /// Whether the task is suspended here; None when not known (adopted
    /// from a previous agent process): the next answer says, and is obeyed.
    suspended: Option<bool>,
    /// The number of the last signal request delivered (or known when the
    /// task started here); None for an adopted task: the next answer's is
    /// taken as known, not delivered again.
    signal_seen: Option<u64>,
}

impl Task {
    /// Whether its processes may be running on its GPUs: not known to be
    /// suspended (a stopping task is woken to end).
    fn active(&self) -> bool {
        self.stopping || self.suspended != Some(true)
    }
}

impl AgentCore {
    /// A starting agent with the fences it persisted; `now_ms` counts as
    /// contact (an agent that starts has not been cut off yet).
    pub fn new(fences: Fences, stop_grace_ms: u64, now_ms: u64) -> AgentCore {
        AgentCore {
            fences,
            tasks: BTreeMap::new(),
            pending: VecDeque::new(),
            registered: false,
            down_timeout_ms: DOWN_TIMEOUT_DEFAULT_MS,
            last_contact_ms: now_ms,
            stop_grace_ms,
            seen_index: 0,
            interval_ms: HEARTBEAT_INTERVAL_DEFAULT_MS,
        }
    }

    /// How long the shell waits between heartbeats: what the leader asked
    /// for, never so long that fewer than [`HEARTBEATS_PER_FENCE_WINDOW_MIN`]
    /// fit in the self-fence window.
    pub fn heartbeat_interval_ms(&self) -> u64 {
        self.interval_ms
    }

    fn told_interval(&mut self, ms: u64) {
        if ms > 0 {
            let cap = heartbeat_interval_cap_ms(self.down_timeout_ms);
            self.interval_ms = ms.clamp(HEARTBEAT_INTERVAL_MIN_MS.min(cap), cap);
        }
    }

    /// The highest log index of orders this agent has acted on: the running
    /// tasks it reports reflect every order up to it.
    pub fn seen_index(&self) -> u64 {
        self.seen_index
    }

    pub fn fences(&self) -> &Fences {
        &self.fences
    }

    pub fn registered(&self) -> bool {
        self.registered
    }

    /// When the last heartbeat a leader answered was sent.
    pub fn last_contact_ms(&self) -> u64 {
        self.last_contact_ms
    }

    pub fn stop_grace_ms(&self) -> u64 {
        self.stop_grace_ms
    }

    /// The self-fence's deadlines as of now, for the tasks' shims (see
    /// `node-agent/src/lease.rs`): stop at `.0`, kill by `.1`. A task that
    /// outlives this agent obeys them, as the agent would have.
    pub fn lease(&self) -> (u64, u64) {
        let stop_at = self.last_contact_ms.saturating_add(self.down_timeout_ms / 2);
        (stop_at, stop_at.saturating_add(self.fence_grace_ms()))
    }

    /// The grace of a task the self-fence stops.
    fn fence_grace_ms(&self) -> u64 {
        self.stop_grace_ms.min(self.down_timeout_ms / 4)
    }

    /// The deadline of one call to the controllers.
    pub fn call_timeout_ms(&self) -> u64 {
        (self.down_timeout_ms / CALL_TIMEOUT_SHARE).clamp(CALL_TIMEOUT_MIN_MS, CALL_TIMEOUT_MAX_MS)
    }

    /// The deadline of one heartbeat call: no longer than an interval (an
    /// answer slower than that is from a leader too busy or hung to count on;
    /// the next replica is tried), so a long interval and a hung leader do
    /// not together use up the self-fence window. Never under
    /// HEARTBEAT_CALL_TIMEOUT_MIN_MS, for a busy leader's slow answers.
    pub fn heartbeat_call_timeout_ms(&self) -> u64 {
        self.call_timeout_ms().min(self.interval_ms.max(HEARTBEAT_CALL_TIMEOUT_MIN_MS))
    }

    /// Tasks running here, for the heartbeat.
    pub fn running(&self) -> Vec<TaskKey> {
        self.tasks.keys().copied().collect()
    }

    /// GPU index → the job whose task holds it: the running one, where a
    /// suspended task was allotted the same GPU before it.
    pub fn gpu_jobs(&self) -> BTreeMap<u32, JobId> {
        let (asleep, awake): (Vec<_>, Vec<_>) = self.tasks.iter().partition(|(_, t)| !t.active());
        asleep.into_iter().chain(awake).flat_map(|((job, _), t)| t.gpus.iter().map(move |g| (*g, *job))).collect()
    }

    /// A task found running at start (it outlived the previous agent process).
    pub fn adopt(&mut self, task: TaskKey, gpus: Vec<u32>) {
        self.tasks.insert(task, Task { gpus, suspended: None, signal_seen: None, ..Task::default() });
    }

    /// A controller accepted the registration sent at `sent_ms`, naming its
    /// node-down timeout and the heartbeat interval (0: not named).
    pub fn registered_at(&mut self, sent_ms: u64, down_timeout_ms: u64, interval_ms: u64) {
        if down_timeout_ms > 0 {
            self.down_timeout_ms = down_timeout_ms;
        }
        self.told_interval(interval_ms);
        self.last_contact_ms = self.last_contact_ms.max(sent_ms);
        self.registered = true;
    }

    /// The agent's next call to the leader: register while it is not
    /// registered; else the oldest task exit waiting to be reported (out of
    /// the queue while in flight: give it back with
    /// [`AgentCore::report_failed`] if the call fails); else a heartbeat
    /// with what runs here and the orders it acted on. The node agent makes
    /// these calls until a register or a heartbeat (one round), the
    /// simulation one per round: the decision is this one.
    pub fn next_call(&mut self) -> Call {
        if !self.registered {
            return Call::Register;
        }
        match self.take_report() {
            Some(exit) => Call::Exit(exit),
            None => Call::Heartbeat { running: self.running(), seen_index: self.seen_index },
        }
    }

    /// Takes the oldest exit waiting to be reported, to send it; give it
    /// back with [`AgentCore::report_failed`] if the call fails. (Out of the
    /// queue while in flight, so exits arriving meanwhile never push it out.)
    pub fn take_report(&mut self) -> Option<Exit> {
        self.pending.pop_front()
    }

    /// A report could not be delivered: it goes first again.
    pub fn report_failed(&mut self, exit: Exit) {
        if self.pending.len() >= PENDING_EXITS_MAX {
            self.pending.pop_back();
        }
        self.pending.push_front(exit);
    }

    pub fn reports_pending(&self) -> usize {
        self.pending.len()
    }

    fn queue_report(&mut self, exit: Exit) {
        if self.pending.len() >= PENDING_EXITS_MAX {
            self.pending.pop_front();
        }
        self.pending.push_back(exit);
    }

    /// A task ended (its process exited, or it was found gone). A task the
    /// node stopped on its own is reported lost, to be requeued, unless it
    /// had ended cleanly. An exit for a task not tracked here (a launch that
    /// failed, already reported) is still reported.
    pub fn task_exited(&mut self, mut exit: Exit) {
        let stopped_here = self.tasks.remove(&exit.task).is_some_and(|t| t.lost);
        if stopped_here && !exit.clean() {
            exit.lost = true;
            exit.reason = "stopped by its node: cut off from every controller".into();
        }
        self.queue_report(exit);
    }

    /// A launch the core decided could not be carried out. `lost`: the node,
    /// not the job, is at fault (its fences or lease could not be written),
    /// so the job is requeued rather than failed.
    pub fn launch_failed(&mut self, task: TaskKey, reason: String, lost: bool) {
        self.tasks.remove(&task);
        self.queue_report(Exit::not_run(task, reason, lost));
    }

    /// A leader's answer to the heartbeat sent at `sent_ms`.
    pub fn answered(&mut self, sent_ms: u64, answer: &Answer) -> Vec<Action> {
        let mut actions = Vec::new();
        if !answer.known {
            // The controller does not know this node (or marked it down).
            self.registered = false;
            return actions;
        }
        // A cluster restored from a backup counts terms and log indexes
        // afresh, in a history of its own: the old history's no longer
        // order anything. (The attempts still fence: a restored cluster
        // numbers new jobs past the lost one's, and runs an old job again
        // only at a higher attempt.)
        let new_history = answer.history != self.fences.history;
        if new_history {
            self.fences.history = answer.history;
            self.fences.max_term = 0;
            self.seen_index = 0;
        }
        // An answer from a leader older than one already obeyed is stale, and
        // so is one computed from a state older than orders already acted on
        // (a new leader still applying the log): it could restart an attempt
        // that state has not yet seen requeued. (0: a leader from before the
        // index was sent.)
        if answer.term < self.fences.max_term || (answer.index != 0 && answer.index < self.seen_index) {
            return actions;
        }
        let mut persist = new_history || answer.term > self.fences.max_term;
        self.fences.max_term = answer.term;
        self.told_interval(answer.heartbeat_interval_ms);
        // Contact counts from when the heartbeat left, never from when the
        // answer came back: the leader heard it no earlier than that.
        self.last_contact_ms = self.last_contact_ms.max(sent_ms);
        let desired: BTreeSet<TaskKey> = answer.desired.iter().copied().collect();
        self.stop_undesired(&desired, answer, &mut actions);
        // Suspension before launches: a job suspended for a preemptor (QOS
        // preempt mode SUSPEND) stops before the preemptor starts on its GPUs.
        let suspended: BTreeSet<TaskKey> = answer.suspended.iter().copied().collect();
        self.reconcile_suspension(&desired, &suspended, answer, &mut actions);
        let launches = self.launch_ordered(&desired, answer);
        persist |= !launches.is_empty();
        if persist {
            actions.push(Action::PersistFences);
        }
        actions.extend(launches);
        // And again for the tasks launched just now: one whose job is already
        // suspended is stopped right after it starts.
        self.reconcile_suspension(&desired, &suspended, answer, &mut actions);
        self.seen_index = self.seen_index.max(answer.index);
        actions
    }

    /// Stops every task the answer no longer wants (not stopping already),
    /// each with the grace its stop order gives (a preempted job's QOS
    /// grace) or the agent's.
    fn stop_undesired(&mut self, desired: &BTreeSet<TaskKey>, answer: &Answer, actions: &mut Vec<Action>) {
        for (task, t) in &mut self.tasks {
            if desired.contains(task) || t.stopping {
                continue;
            }
            let grace_ms = answer
                .stops
                .iter()
                .find(|(k, _)| k == task)
                .map_or(self.stop_grace_ms, |(_, grace_s)| u64::from(*grace_s).saturating_mul(1000));
            t.stopping = true;
            actions.push(Action::Stop { task: *task, grace_ms });
        }
    }

    /// The launches the answer orders that may start now, their fences
    /// recorded (the caller persists them before launching): not one
    /// already here or not desired, not one whose GPUs a task still holds,
    /// and never an attempt this node already launched (reported lost).
    fn launch_ordered(&mut self, desired: &BTreeSet<TaskKey>, answer: &Answer) -> Vec<Action> {
        let mut launches = Vec::new();
        for (task, gpus) in &answer.launch {
            if self.tasks.contains_key(task) || !desired.contains(task) {
                continue;
            }
            // A preempted task may still hold these GPUs during its grace:
            // the new task starts once it is gone (the order comes again). A
            // suspended task runs nothing on them.
            if self.tasks.values().any(|t| t.active() && t.gpus.iter().any(|g| gpus.contains(g))) {
                continue;
            }
            // A refused fence means this attempt already ran here and its task
            // is gone (it died with a previous agent process): lost, not failed.
            let (job, attempt) = *task;
            if let Some(&seen) = self.fences.attempts.get(&job) {
                // Its exit is waiting to be reported: the leader has not heard
                // yet, nothing was lost.
                if seen == attempt && self.pending.iter().any(|e| e.task == *task) {
                    continue;
                }
                if seen >= attempt {
                    let reason = format!(
                        "task lost: refused launch of job {job} attempt {attempt}: attempt {seen} was already \
                         launched on this node"
                    );
                    self.queue_report(Exit::not_run(*task, reason, true));
                    continue;
                }
            }
            self.fences.attempts.insert(job, attempt);
            while self.fences.attempts.len() > FENCES_MAX {
                self.fences.attempts.pop_first();
            }
            // A signal requested before the task started is not its own.
            let seen = answer.signals.iter().find(|(k, _)| k == task).map_or(0, |(_, s)| s.seq);
            let t = Task { gpus: gpus.clone(), suspended: Some(false), signal_seen: Some(seen), ..Task::default() };
            self.tasks.insert(*task, t);
            launches.push(Action::Launch(*task));
        }
        launches
    }

    /// Suspends and resumes the desired tasks as `suspended` says, and
    /// delivers their new signal requests. A task resumes only once no other
    /// running or stopping task holds one of its GPUs (a preemptor it was
    /// suspended for may still be stopping): the order comes again.
    fn reconcile_suspension(
        &mut self,
        desired: &BTreeSet<TaskKey>,
        suspended: &BTreeSet<TaskKey>,
        answer: &Answer,
        actions: &mut Vec<Action>,
    ) {
        let busy: BTreeMap<u32, TaskKey> =
            self.tasks.iter().filter(|(_, t)| t.active()).flat_map(|(k, t)| t.gpus.iter().map(|g| (*g, *k))).collect();
        for (task, t) in &mut self.tasks {
            if t.stopping || !desired.contains(task) {
                continue;
            }
            let want = suspended.contains(task);
            let blocked = !want && t.gpus.iter().any(|g| busy.get(g).is_some_and(|k| k != task));
            if t.suspended != Some(want) && !blocked {
                t.suspended = Some(want);
                actions.push(if want { Action::Suspend(*task) } else { Action::Resume(*task) });
            }
            if let Some((_, s)) = answer.signals.iter().find(|(k, _)| k == task) {
                match t.signal_seen {
                    Some(seen) if s.seq > seen => {
                        actions.push(Action::Signal { task: *task, signal: s.signal, target: s.target });
                    }
                    _ => {}
                }
                t.signal_seen = Some(t.signal_seen.map_or(s.seq, |seen| seen.max(s.seq)));
            }
        }
    }

    /// The passing of time: the self-fence. Returns the tasks to stop.
    pub fn tick(&mut self, now_ms: u64) -> Vec<Action> {
        let mut actions = Vec::new();
        if now_ms.saturating_sub(self.last_contact_ms) < self.down_timeout_ms / 2 {
            return actions;
        }
        let grace_ms = self.fence_grace_ms();
        for (task, t) in &mut self.tasks {
            let first = !t.lost;
            t.lost = true;
            // A task already stopping for an order is stopped again with the
            // (possibly shorter) fence grace.
            if first {
                t.stopping = true;
                actions.push(Action::Stop { task: *task, grace_ms });
            }
        }
        actions
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn answer(term: u64, desired: &[TaskKey], launch: &[(TaskKey, &[u32])]) -> Answer {
        Answer {
            known: true,
            term,
            index: 0,
            desired: desired.to_vec(),
            launch: launch.iter().map(|(k, g)| (*k, g.to_vec())).collect(),
            stops: Vec::new(),
            suspended: Vec::new(),
            signals: Vec::new(),
            heartbeat_interval_ms: 0,
            history: 0,
        }
    }

    /// A cluster restored from a backup counts terms and indexes afresh in
    /// a new history: an agent that obeyed term 7 at index 500 of the lost
    /// one obeys the new one's term 1 at index 20, fenced again from there,
    /// while within one history an older term or index is still ignored and
    /// an attempt launched here in the old history is never launched again.
    #[test]
    fn a_restored_clusters_new_history_starts_the_term_and_index_fences_afresh() {
        let mut a = AgentCore::new(Fences::default(), 5_000, 0);
        a.registered_at(0, 10_000, 0);
        let mut old = answer(7, &[(3, 1)], &[((3, 1), &[0])]);
        old.index = 500;
        assert_eq!(a.answered(100, &old), vec![Action::PersistFences, Action::Launch((3, 1))]);
        a.task_exited(Exit::ended((3, 1), Some(0), None));
        // The restored cluster: term 1, index 20, its own history.
        let mut new = answer(1, &[(9, 1)], &[((9, 1), &[0])]);
        (new.index, new.history) = (20, 0xfeed);
        assert_eq!(a.answered(200, &new), vec![Action::PersistFences, Action::Launch((9, 1))]);
        assert_eq!((a.fences().history, a.fences().max_term, a.seen_index()), (0xfeed, 1, 20));
        // Within it, an older index is stale again.
        let mut stale = answer(1, &[(9, 1), (10, 1)], &[((10, 1), &[1])]);
        (stale.index, stale.history) = (19, 0xfeed);
        assert_eq!(a.answered(300, &stale), vec![]);
        // An old job relaunched at the attempt it ran here is refused (lost).
        let mut again = answer(2, &[(9, 1), (3, 1)], &[((3, 1), &[1])]);
        (again.index, again.history) = (30, 0xfeed);
        assert_eq!(a.answered(400, &again), vec![Action::PersistFences], "a newer term, no launch");
        assert_eq!(a.fences().attempts.get(&3), Some(&1));
    }

    /// The calls an agent makes, in the order the core decides them:
    /// register first; then each exit waiting (one given back after a
    /// failed call goes first again); then a heartbeat with what runs here
    /// and the orders it acted on.
    #[test]
    fn the_next_call_is_registration_then_exits_then_a_heartbeat() {
        let mut a = AgentCore::new(Fences::default(), 5_000, 0);
        assert_eq!(a.next_call(), Call::Register);
        a.registered_at(0, 10_000, 0);
        let mut ans = answer(3, &[(7, 1), (8, 1)], &[((7, 1), &[0]), ((8, 1), &[1])]);
        ans.index = 40;
        a.answered(100, &ans);
        assert_eq!(a.next_call(), Call::Heartbeat { running: vec![(7, 1), (8, 1)], seen_index: 40 });
        a.task_exited(Exit::ended((7, 1), Some(0), None));
        a.task_exited(Exit::ended((8, 1), Some(1), None));
        let Call::Exit(first) = a.next_call() else { panic!("an exit waits") };
        assert_eq!(first.task, (7, 1));
        a.report_failed(first);
        assert!(matches!(a.next_call(), Call::Exit(e) if e.task == (7, 1)), "a failed report goes first again");
        assert!(matches!(a.next_call(), Call::Exit(e) if e.task == (8, 1)));
        assert_eq!(a.next_call(), Call::Heartbeat { running: vec![], seen_index: 40 });
    }

    /// Each signal request reaches a task once; one made before the task
    /// started, or known to an adopted task's first answer, is not sent.
    #[test]
    fn a_signal_request_is_delivered_once_per_task() {
        use crate::command::SignalTarget;
        use crate::model::JobSignal;
        let sig = |seq| JobSignal { seq, signal: 10, target: SignalTarget::Batch };
        let mut a = AgentCore::new(Fences::default(), 5_000, 0);
        a.registered_at(0, 10_000, 0);
        let mut ans = answer(3, &[(7, 1)], &[((7, 1), &[0])]);
        ans.signals = vec![((7, 1), sig(1))];
        assert_eq!(a.answered(100, &ans), vec![Action::PersistFences, Action::Launch((7, 1))], "older than the task");
        ans.launch.clear();
        assert_eq!(a.answered(200, &ans), vec![]);
        ans.signals = vec![((7, 1), sig(2))];
        let want = Action::Signal { task: (7, 1), signal: 10, target: SignalTarget::Batch };
        assert_eq!(a.answered(300, &ans), vec![want]);
        assert_eq!(a.answered(400, &ans), vec![], "once");
        let mut b = AgentCore::new(Fences::default(), 5_000, 0);
        b.registered_at(0, 10_000, 0);
        b.adopt((7, 1), vec![]);
        let got = b.answered(100, &ans);
        assert!(!got.iter().any(|a| matches!(a, Action::Signal { .. })), "an adopted task takes it as sent: {got:?}");
        ans.signals = vec![((7, 1), sig(3))];
        assert!(b.answered(200, &ans).iter().any(|a| matches!(a, Action::Signal { .. })));
    }

    /// A suspended job's task is stopped once and continued once; a task
    /// launched into a suspended job is stopped right after its launch; an
    /// adopted task's suspension is unknown, so the first answer is obeyed
    /// either way; a task being stopped is left to its stop.
    #[test]
    fn suspension_follows_the_leader_once_per_change() {
        let mut a = AgentCore::new(Fences::default(), 5_000, 0);
        a.registered_at(0, 10_000, 0);
        a.answered(100, &answer(3, &[(7, 1)], &[((7, 1), &[0])]));
        let mut ans = answer(3, &[(7, 1)], &[]);
        ans.suspended = vec![(7, 1)];
        assert_eq!(a.answered(200, &ans), vec![Action::Suspend((7, 1))]);
        assert_eq!(a.answered(300, &ans), vec![], "already suspended");
        assert_eq!(a.answered(400, &answer(3, &[(7, 1)], &[])), vec![Action::Resume((7, 1))]);
        assert_eq!(a.answered(500, &answer(3, &[(7, 1)], &[])), vec![]);
        // Launched into a suspended job.
        let mut ans = answer(3, &[(8, 1)], &[((8, 1), &[1])]);
        ans.suspended = vec![(8, 1)];
        assert_eq!(
            a.answered(600, &ans),
            vec![
                Action::Stop { task: (7, 1), grace_ms: 5_000 },
                Action::PersistFences,
                Action::Launch((8, 1)),
                Action::Suspend((8, 1))
            ]
        );
        // Adopted: told explicitly, suspended or not.
        let mut b = AgentCore::new(Fences::default(), 5_000, 0);
        b.registered_at(0, 10_000, 0);
        b.adopt((9, 1), vec![]);
        b.adopt((10, 1), vec![]);
        let mut ans = answer(3, &[(9, 1), (10, 1)], &[]);
        ans.suspended = vec![(10, 1)];
        assert_eq!(
            b.answered(100, &ans),
            vec![Action::Resume((9, 1)), Action::Suspend((10, 1)), Action::PersistFences]
        );
        // Not desired any more: stopped, never resumed or suspended after.
        assert_eq!(b.answered(200, &answer(3, &[(10, 1)], &[])).len(), 2, "stop 9, resume 10");
        assert_eq!(b.answered(300, &answer(3, &[], &[])), vec![Action::Stop { task: (10, 1), grace_ms: 5_000 }]);
        assert_eq!(b.answered(400, &ans), vec![]);
    }

    /// QOS preempt mode SUSPEND: the victim stops before its preemptor
    /// starts on the same GPUs, and continues only once no running or
    /// stopping task holds them.
    #[test]
    fn a_victim_suspended_for_a_preemptor_shares_its_gpus_only_while_stopped() {
        let mut a = AgentCore::new(Fences::default(), 5_000, 0);
        a.registered_at(0, 10_000, 0);
        a.answered(100, &answer(3, &[(7, 1)], &[((7, 1), &[0, 1])]));
        let mut ans = answer(3, &[(7, 1), (8, 1)], &[((8, 1), &[0, 1])]);
        ans.suspended = vec![(7, 1)];
        assert_eq!(
            a.answered(200, &ans),
            vec![Action::Suspend((7, 1)), Action::PersistFences, Action::Launch((8, 1))],
            "suspended first, then the preemptor starts on its GPUs"
        );
        assert_eq!(a.gpu_jobs(), BTreeMap::from([(0, 8), (1, 8)]), "the GPUs' metrics name the running job");
        // The preemptor is cancelled: stopping, it still runs on the GPUs.
        let back = answer(3, &[(7, 1)], &[]);
        assert_eq!(a.answered(300, &back), vec![Action::Stop { task: (8, 1), grace_ms: 5_000 }]);
        assert_eq!(a.answered(400, &back), vec![], "no resume while the preemptor holds the GPUs");
        a.task_exited(Exit::ended((8, 1), None, Some(15)));
        assert_eq!(a.answered(500, &back), vec![Action::Resume((7, 1))]);
        // A task suspended by the operator (not sharing) still blocks nothing
        // it does not hold, and a launch onto a running task's GPUs waits.
        let ans = answer(3, &[(7, 1), (9, 1)], &[((9, 1), &[1])]);
        assert_eq!(a.answered(600, &ans), vec![], "GPU 1 is the running job 7's");
    }

    /// The leader stretches the interval as its fleet grows; the agent obeys
    /// within the bounds that keep its self-fence from firing between two
    /// heartbeats, and a stale leader's interval is ignored like its orders.
    #[test]
    fn the_heartbeat_interval_follows_the_leader_within_the_fence_window() {
        let mut a = AgentCore::new(Fences::default(), 5_000, 0);
        assert_eq!(a.heartbeat_interval_ms(), HEARTBEAT_INTERVAL_DEFAULT_MS);
        a.registered_at(0, 30_000, 2_000);
        assert_eq!(a.heartbeat_interval_ms(), 2_000);
        let mut ans = answer(3, &[], &[]);
        ans.heartbeat_interval_ms = 4_000;
        a.answered(100, &ans);
        assert_eq!(a.heartbeat_interval_ms(), 4_000);
        // Longer than a third of the fence window (15 s): capped.
        ans.heartbeat_interval_ms = 60_000;
        a.answered(200, &ans);
        assert_eq!(a.heartbeat_interval_ms(), 5_000);
        ans.heartbeat_interval_ms = 1;
        a.answered(300, &ans);
        assert_eq!(a.heartbeat_interval_ms(), HEARTBEAT_INTERVAL_MIN_MS);
        // Not named: unchanged. From an older term: ignored.
        ans.heartbeat_interval_ms = 0;
        a.answered(400, &ans);
        assert_eq!(a.heartbeat_interval_ms(), HEARTBEAT_INTERVAL_MIN_MS);
        let mut stale = answer(2, &[], &[]);
        stale.heartbeat_interval_ms = 3_000;
        a.answered(500, &stale);
        assert_eq!(a.heartbeat_interval_ms(), HEARTBEAT_INTERVAL_MIN_MS);
        // Every interval it obeys leaves that many heartbeats in the window,
        // and a heartbeat sent at the longest interval to a hung leader gives
        // up with a quarter of the window left to reach another replica.
        for timeout in [1_000, 10_000, 30_000, 300_000] {
            let cap = heartbeat_interval_cap_ms(timeout);
            assert!(cap * HEARTBEATS_PER_FENCE_WINDOW_MIN <= (timeout / 2).max(HEARTBEAT_INTERVAL_MIN_MS * 3));
            if timeout >= 10_000 {
                let mut b = AgentCore::new(Fences::default(), 5_000, 0);
                b.registered_at(0, timeout, u64::MAX);
                assert_eq!(b.heartbeat_interval_ms(), cap);
                assert!(cap + b.heartbeat_call_timeout_ms() <= timeout / 2 * 3 / 4, "{timeout}");
            }
        }
    }

    /// A task that ended here and whose exit waits to be reported is ordered
    /// again by a leader that has not heard yet: no second, "lost" report.
    #[test]
    fn an_order_for_an_ended_task_not_yet_reported_is_no_loss() {
        let mut a = AgentCore::new(Fences::default(), 5_000, 0);
        a.registered_at(0, 10_000, 0);
        a.answered(100, &answer(3, &[(7, 1)], &[((7, 1), &[0])]));
        a.task_exited(Exit::ended((7, 1), Some(0), None));
        assert_eq!(a.answered(200, &answer(3, &[(7, 1)], &[((7, 1), &[0])])), vec![]);
        assert_eq!(a.reports_pending(), 1, "only the exit itself");
        let report = a.take_report().unwrap();
        assert!(!report.lost && report.exit_code == Some(0), "{report:?}");
        // Once reported, an order for it again means it was lost.
        a.answered(300, &answer(3, &[(7, 1)], &[((7, 1), &[0])]));
        assert!(a.take_report().is_some_and(|e| e.lost));
    }

    #[test]
    fn an_attempt_launches_once_and_stale_terms_are_ignored() {
        let mut a = AgentCore::new(Fences::default(), 5_000, 0);
        a.registered_at(0, 10_000, 0);
        let acts = a.answered(100, &answer(3, &[(7, 1)], &[((7, 1), &[0])]));
        assert_eq!(acts, vec![Action::PersistFences, Action::Launch((7, 1))]);
        // The task ends; the same order again (a lagging leader) is refused:
        // its exit, not yet reported, is all the leader needs.
        a.task_exited(Exit::ended((7, 1), Some(1), None));
        let acts = a.answered(200, &answer(3, &[(7, 1)], &[((7, 1), &[0])]));
        assert!(acts.is_empty(), "{acts:?}");
        let first = a.take_report().unwrap();
        assert!(!first.lost, "the task's own exit");
        assert!(a.take_report().is_none());
        // Ordered again once reported: the attempt ran here and is gone, lost.
        assert!(a.answered(250, &answer(3, &[(7, 1)], &[((7, 1), &[0])])).is_empty());
        assert!(a.take_report().is_some_and(|e| e.lost && e.task == (7, 1)));
        // A restart keeps the fence.
        let mut b = AgentCore::new(a.fences().clone(), 5_000, 300);
        assert!(b.answered(400, &answer(3, &[(7, 1)], &[((7, 1), &[0])])).is_empty());
        // An older term changes nothing, not even contact; nor does an answer
        // from a state older than one already acted on.
        assert!(b.answered(500, &answer(2, &[], &[((8, 1), &[1])])).is_empty());
        assert_eq!(b.last_contact_ms(), 400);
        let mut newer = answer(3, &[(8, 1)], &[((8, 1), &[1])]);
        newer.index = 50;
        assert_eq!(b.answered(600, &newer).len(), 2);
        let mut older = answer(3, &[(9, 1)], &[((9, 1), &[2])]);
        older.index = 49;
        assert!(b.answered(700, &older).is_empty());
        assert_eq!((b.seen_index(), b.last_contact_ms()), (50, 600));
    }

    #[test]
    fn cut_off_agents_stop_their_tasks_before_the_leader_gives_up_on_them() {
        let mut a = AgentCore::new(Fences::default(), 30_000, 0);
        a.registered_at(0, 10_000, 0);
        a.answered(1_000, &answer(1, &[(1, 0)], &[((1, 0), &[0, 1])]));
        assert!(a.tick(5_999).is_empty());
        assert_eq!(a.tick(6_000), vec![Action::Stop { task: (1, 0), grace_ms: 2_500 }]);
        assert!(a.tick(7_000).is_empty(), "stopped once");
        // Its unclean end is reported lost; a clean one would not be.
        a.task_exited(Exit::ended((1, 0), None, Some(15)));
        assert!(a.take_report().is_some_and(|e| e.lost));
    }

    #[test]
    fn gpus_of_a_stopping_task_delay_the_next_launch() {
        let mut a = AgentCore::new(Fences::default(), 5_000, 0);
        a.answered(0, &answer(1, &[(1, 0)], &[((1, 0), &[0])]));
        let mut ans = answer(1, &[(2, 0)], &[((2, 0), &[0])]);
        ans.stops = vec![((1, 0), 30)];
        assert_eq!(a.answered(10, &ans), vec![Action::Stop { task: (1, 0), grace_ms: 30_000 }]);
        a.task_exited(Exit::ended((1, 0), None, Some(15)));
        assert_eq!(a.answered(20, &ans), vec![Action::PersistFences, Action::Launch((2, 0))]);
    }

    /// The exits waiting for delivery and the launch fences remembered stop
    /// at their limits: at each, nothing is dropped; one past it, the oldest
    /// exit (or, for a report given back, the newest) and the lowest job's
    /// fence make way.
    #[test]
    fn exits_waiting_and_fences_remembered_stop_at_their_limits() {
        let mut a = AgentCore::new(Fences::default(), 5_000, 0);
        let exit = |job: usize| Exit::ended((job as JobId, 1), Some(0), None);
        for job in 1..=PENDING_EXITS_MAX {
            a.task_exited(exit(job));
        }
        assert_eq!(a.reports_pending(), PENDING_EXITS_MAX);
        assert_eq!(a.pending.front().map(|e| e.task), Some((1, 1)), "at the limit the oldest is kept");
        a.task_exited(exit(PENDING_EXITS_MAX + 1));
        assert_eq!(a.reports_pending(), PENDING_EXITS_MAX, "one past it");
        let oldest = a.take_report().expect("a report waits");
        assert_eq!(oldest.task, (2, 1), "the oldest made way");
        a.task_exited(exit(PENDING_EXITS_MAX + 2));
        a.report_failed(oldest);
        assert_eq!(a.reports_pending(), PENDING_EXITS_MAX);
        assert_eq!(a.pending.front().map(|e| e.task), Some((2, 1)), "a report given back goes first");
        assert_eq!(a.pending.back().map(|e| e.task), Some((PENDING_EXITS_MAX as JobId + 1, 1)), "the newest made way");

        // Fences: one launch onto FENCES_MAX - 1 remembered jobs, then one more.
        let fences = Fences { attempts: (1..FENCES_MAX as JobId).map(|j| (j, 1)).collect(), ..Fences::default() };
        let mut a = AgentCore::new(fences, 5_000, 0);
        a.registered_at(0, 10_000, 0);
        let top = FENCES_MAX as JobId;
        assert_eq!(a.answered(10, &answer(1, &[(top, 1)], &[((top, 1), &[])])).last(), Some(&Action::Launch((top, 1))));
        assert_eq!((a.fences().attempts.len(), a.fences().attempts.first_key_value()), (FENCES_MAX, Some((&1, &1))));
        let past = top + 1;
        assert_eq!(
            a.answered(20, &answer(1, &[(top, 1), (past, 1)], &[((past, 1), &[])])).last(),
            Some(&Action::Launch((past, 1)))
        );
        assert_eq!((a.fences().attempts.len(), a.fences().attempts.first_key_value()), (FENCES_MAX, Some((&2, &1))));
    }
}
