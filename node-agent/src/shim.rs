//! The task shim (`gangway task-shim`), like slurmstepd or a container shim: it
//! is the task's process-group leader, runs the real command, waits for it and
//! writes its exit status to a file. Because the shim, not the agent, is the
//! command's parent, an agent can exit or crash and a restarted agent re-adopts
//! the task and still learns how it ended.
//!
//! The shim survives SIGTERM/SIGINT/SIGHUP/SIGQUIT/SIGUSR1/SIGUSR2/SIGALRM
//! (they are meant for the command, and reach it through the process group), so it outlives the command's graceful
//! shutdown; SIGKILL of the group ends both.

use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Runs `argv`, waits, records `exit N` or `signal S` in `exit_file`, and
/// returns the exit code the shim itself should exit with.
pub fn run(exit_file: &Path, argv: &[String]) -> i32 {
    let ignored = Arc::new(AtomicBool::new(false));
    use signal_hook::consts::*;
    // Every signal meant for the command (stops, Slurm's --signal warnings)
    // reaches it through the process group; the shim must outlive them.
    for sig in [SIGTERM, SIGINT, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2, SIGALRM] {
        let _ = signal_hook::flag::register(sig, ignored.clone());
    }
    let Some((program, args)) = argv.split_first() else {
        eprintln!("task-shim: nothing to run");
        return 127;
    };
    let status = match std::process::Command::new(program).args(args).status() {
        Ok(s) => s,
        Err(e) => {
            eprintln!("task-shim: cannot start {program}: {e}");
            let _ = write_atomic(exit_file, "exit 127\n");
            return 127;
        }
    };
    use std::os::unix::process::ExitStatusExt;
    let (record, code) = match (status.code(), status.signal()) {
        (Some(c), _) => (format!("exit {c}\n"), c),
        (None, Some(s)) => (format!("signal {s}\n"), 128 + s),
        _ => ("exit 1\n".to_string(), 1),
    };
    let _ = write_atomic(exit_file, &record);
    code
}

/// Writes the exit file in place: the agent created it (owned by the job's
/// user) because the shim, running as that user, may not create files in the
/// agent's state directory.
fn write_atomic(path: &Path, text: &str) -> std::io::Result<()> {
    std::fs::write(path, text)
}

/// Reads a shim's exit file: (exit code, signal).
pub fn read_exit(path: &Path) -> Option<(Option<i32>, Option<i32>)> {
    let text = std::fs::read_to_string(path).ok()?;
    let (kind, n) = text.trim().split_once(' ')?;
    let n: i32 = n.parse().ok()?;
    match kind {
        "exit" => Some((Some(n), None)),
        "signal" => Some((None, Some(n))),
        _ => None,
    }
}
