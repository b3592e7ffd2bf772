//! Runs the site's power programs for elastic node pools (Slurm's
//! `ResumeProgram` and `SuspendProgram`): the leader's tick decides which
//! nodes to power up and down (`gangway_core::duties::power_decisions`);
//! this runs `PROGRAM HOSTLIST`, one call at a time, each within
//! [`PROGRAM_TIMEOUT`]. The programs are this replica's configuration
//! (`--resume-program`, `--suspend-program`), never the replicated policy:
//! editing the policy must not run code on a controller.
//!
//! A program that fails or times out is logged and counted
//! (`gangway_power_program_failures_total`); a node it did not power up is
//! marked down after its pool's `resume_timeout_s`, and its jobs requeued.

use std::path::PathBuf;
use std::process::Stdio;
use std::time::Duration;

use tokio::sync::mpsc;

/// One program call may take this long (Slurm's `ResumeTimeout` bounds the
/// boot itself; the program only starts it): then it is killed.
pub const PROGRAM_TIMEOUT: Duration = Duration::from_secs(120);
/// Calls waiting to run: beyond this (programs much slower than the ticks
/// that ask for them) a call is dropped and logged, and its nodes time out.
pub const PROGRAM_QUEUE_MAX: usize = 256;

pub use crate::config::PowerPrograms;

/// A power-up or power-down of some nodes.
#[derive(Debug)]
struct Call {
    up: bool,
    nodes: Vec<String>,
}

/// Queues calls for the runner task; dropping it ends the runner (the
/// leader's duties ended) once the queued calls ran.
pub struct PowerRunner {
    tx: mpsc::Sender<Call>,
    programs: PowerPrograms,
}

impl PowerRunner {
    pub fn start(programs: PowerPrograms) -> PowerRunner {
        let (tx, mut rx) = mpsc::channel::<Call>(PROGRAM_QUEUE_MAX);
        let p = programs.clone();
        tokio::spawn(async move {
            while let Some(call) = rx.recv().await {
                let program = if call.up { p.resume.as_ref() } else { p.suspend.as_ref() };
                if let Some(program) = program {
                    run(program, &call).await;
                }
            }
        });
        PowerRunner { tx, programs }
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
        if let Err(e) = self.tx.try_send(Call { up, nodes }) {
            metrics::counter!("gangway_power_program_failures_total").increment(1);
            tracing::error!(error = %e, "power program queue full: call dropped");
        }
    }
}

async fn run(program: &PathBuf, call: &Call) {
    let list = gangway_proto::hostlist::compress(&call.nodes);
    let verb = if call.up { "up" } else { "down" };
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
