//! Runs the site's power programs for elastic node pools (Slurm's
//! `ResumeProgram` and `SuspendProgram`): the leader's tick decides which
//! nodes to power up and down (`gangway_core::duties::power_decisions`);
//! this runs `PROGRAM HOSTLIST`, one call at a time (the nodes asked for
//! meanwhile merged into the next), each within [`PROGRAM_TIMEOUT`]. The programs are this replica's configuration
//! (`--resume-program`, `--suspend-program`), never the replicated policy:
//! editing the policy must not run code on a controller.
//!
//! A program that fails or times out is logged and counted
//! (`gangway_power_program_failures_total`); a node it did not power up is
//! marked down after its pool's `resume_timeout_s`, and its jobs requeued.

use std::collections::BTreeSet;
use std::path::PathBuf;
use std::process::Stdio;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gangway_core::NodeState;
use tokio::sync::Notify;

use crate::shared::Replica;

/// One program call may take this long (Slurm's `ResumeTimeout` bounds the
/// boot itself; the program only starts it): then it is killed.
pub const PROGRAM_TIMEOUT: Duration = Duration::from_secs(120);
/// Nodes one call names at most: its hostlist is one argument, which Linux
/// bounds (128 KiB); the rest wait for the next call.
pub const NODES_PER_CALL_MAX: usize = 1024;

pub use crate::config::PowerPrograms;

/// Nodes waiting for a program call, by direction: each call takes all of
/// one direction's (so calls merge, and nothing is dropped). Bounded by the
/// cluster's nodes: a name is in at most one of them.
#[derive(Default)]
struct Waiting {
    up: BTreeSet<String>,
    down: BTreeSet<String>,
}

/// Runs the calls the leader's ticks ask for, one at a time, while this
/// replica leads: dropping it (the duties ended) stops the runner and kills
/// a running program, so a deposed leader powers nothing.
pub struct PowerRunner {
    waiting: Arc<Mutex<Waiting>>,
    wake: Arc<Notify>,
    programs: PowerPrograms,
    task: tokio::task::JoinHandle<()>,
}

impl Drop for PowerRunner {
    fn drop(&mut self) {
        self.task.abort();
    }
}

impl PowerRunner {
    pub fn start(replica: Arc<Replica>) -> PowerRunner {
        let programs = replica.power.clone();
        let waiting: Arc<Mutex<Waiting>> = Arc::default();
        let wake = Arc::new(Notify::new());
        let (w, n, p) = (waiting.clone(), wake.clone(), programs.clone());
        let task = tokio::spawn(async move {
            loop {
                n.notified().await;
                loop {
                    let (up, down) = {
                        let mut w = w.lock().unwrap_or_else(|e| e.into_inner());
                        (take_some(&mut w.up), take_some(&mut w.down))
                    };
                    if up.is_empty() && down.is_empty() {
                        break;
                    }
                    for (is_up, nodes) in [(true, up), (false, down)] {
                        // Only nodes still in the state the call is for: a
                        // later change (a registration, a new placement)
                        // supersedes it.
                        let want = if is_up { NodeState::PoweringUp } else { NodeState::PoweredDown };
                        let nodes: Vec<String> = {
                            let state = replica.node.state().read();
                            nodes.into_iter().filter(|n| state.nodes.get(n).is_some_and(|x| x.state == want)).collect()
                        };
                        let program = if is_up { p.resume.as_ref() } else { p.suspend.as_ref() };
                        // The leadership may have ended since the tick asked.
                        if !replica.node.is_leader() {
                            return;
                        }
                        if let (false, Some(program)) = (nodes.is_empty(), program) {
                            run(program, is_up, &nodes).await;
                        }
                    }
                }
            }
        });
        PowerRunner { waiting, wake, programs, task }
    }

    /// Asks for `nodes` to be powered up (or down).
    pub fn request(&self, up: bool, nodes: Vec<String>) {
        if nodes.is_empty() {
            return;
        }
        let (program, flag) = if up {
            (&self.programs.resume, "--resume-program")
        } else {
            (&self.programs.suspend, "--suspend-program")
        };
        if program.is_none() {
            let verb = if up { "up" } else { "down" };
            tracing::warn!(nodes = ?nodes, "pool nodes to power {verb}, but this controller has no {flag}: do it by hand");
            return;
        }
        let mut w = self.waiting.lock().unwrap_or_else(|e| e.into_inner());
        for n in nodes {
            // The latest request for a node wins.
            if up {
                w.down.remove(&n);
                w.up.insert(n);
            } else {
                w.up.remove(&n);
                w.down.insert(n);
            }
        }
        drop(w);
        self.wake.notify_one();
    }
}

/// Takes up to [`NODES_PER_CALL_MAX`] names out of `set`.
fn take_some(set: &mut BTreeSet<String>) -> BTreeSet<String> {
    if set.len() <= NODES_PER_CALL_MAX {
        return std::mem::take(set);
    }
    let rest = set.split_off(&set.iter().nth(NODES_PER_CALL_MAX).cloned().unwrap_or_default());
    std::mem::replace(set, rest)
}

async fn run(program: &PathBuf, up: bool, nodes: &[String]) {
    let list = gangway_proto::hostlist::compress(nodes);
    let verb = if up { "up" } else { "down" };
    tracing::info!(program = %program.display(), nodes = %list, "powering nodes {verb}");
    // Its messages go to the controller's own log (stderr). Only its exit is
    // waited for: a program may leave a process running (an agent it started).
    let child = tokio::process::Command::new(program)
        .arg(&list)
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(Stdio::inherit())
        .kill_on_drop(true)
        .spawn();
    let mut child = match child {
        Ok(c) => c,
        Err(e) => {
            metrics::counter!("gangway_power_program_failures_total").increment(1);
            tracing::error!(program = %program.display(), error = %e, "power program could not start");
            return;
        }
    };
    match tokio::time::timeout(PROGRAM_TIMEOUT, child.wait()).await {
        Ok(Ok(status)) if status.success() => tracing::info!(nodes = %list, "power program done"),
        Ok(status) => {
            metrics::counter!("gangway_power_program_failures_total").increment(1);
            tracing::error!(program = %program.display(), nodes = %list, status = ?status, "power program failed");
        }
        Err(_) => {
            metrics::counter!("gangway_power_program_failures_total").increment(1);
            tracing::error!(program = %program.display(), nodes = %list, "power program timed out: killed");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A call names NODES_PER_CALL_MAX nodes; one more waits for the next call.
    #[test]
    fn a_call_names_at_most_nodes_per_call_max_nodes() {
        let mut set: BTreeSet<String> = (0..NODES_PER_CALL_MAX).map(|i| format!("n{i:05}")).collect();
        assert_eq!(take_some(&mut set).len(), NODES_PER_CALL_MAX);
        assert!(set.is_empty());
        let mut set: BTreeSet<String> = (0..=NODES_PER_CALL_MAX).map(|i| format!("n{i:05}")).collect();
        let first = take_some(&mut set);
        assert_eq!(first.len(), NODES_PER_CALL_MAX);
        assert_eq!(set.into_iter().collect::<Vec<_>>(), vec![format!("n{NODES_PER_CALL_MAX:05}")], "the last waits");
    }
}
