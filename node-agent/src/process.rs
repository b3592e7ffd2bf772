//! A task's processes: its process groups (its own, and its steps'), the
//! members of each read from /proc, and the signals the supervisor sends
//! them: Slurm's warning, SIGSTOP and SIGCONT for suspension (in passes,
//! so processes forked meanwhile are caught), and the shims and srun told
//! apart from the task's own processes.
//!
//! Related code: `supervisor.rs` (what decides to send them), `cgroup.rs`
//! (a task's cgroup, whose members are stopped too).

use nix::sys::signal::{killpg, Signal};
use nix::unistd::Pid;

/// Who gets Slurm's `--signal` warning on this node.
#[derive(Debug, Clone, Copy)]
pub(crate) enum WarnTarget {
    /// The whole task (a job that runs its command on every node).
    Group,
    /// The batch shell only (`--signal=B:...`).
    BatchShell,
    /// Everything of the batch job's task here but its shell and srun: the
    /// steps' tasks and the script's other commands (on a step host, its
    /// steps' tasks but not the waiting shell).
    AllButBatchShell,
}

/// Sends the warning to a task's `groups` (its own first, then its step
/// tasks').
pub(crate) fn send_warning(groups: &[Pid], sig: Signal, target: WarnTarget, shim: bool) {
    let pgid = groups[0];
    // Under the shim the batch shell is the shim's child; without, the task.
    let shell = || {
        if shim {
            group_members(pgid)?.into_iter().find(|(_, ppid)| *ppid == pgid.as_raw()).map(|(pid, _)| pid)
        } else {
            Some(pgid.as_raw())
        }
    };
    match target {
        WarnTarget::Group => {
            for g in groups {
                let _ = killpg(*g, sig);
            }
        }
        WarnTarget::BatchShell => {
            if let Some(pid) = shell() {
                let _ = nix::sys::signal::kill(Pid::from_raw(pid), sig);
            }
        }
        WarnTarget::AllButBatchShell => {
            let shell = shell();
            for g in groups {
                for (pid, _) in group_members(*g).unwrap_or_default() {
                    if Some(pid) != shell && !is_srun(pid) {
                        let _ = nix::sys::signal::kill(Pid::from_raw(pid), sig);
                    }
                }
            }
        }
    }
}

/// Passes over a suspended task's process groups: each stops the members
/// the passes before it missed (processes forked meanwhile); a task whose
/// processes are all stopped cannot fork, so the second pass usually finds
/// none.
pub(crate) const SUSPEND_PASSES_MAX: usize = 8;

/// Stops every process of `groups` and of the task's cgroup (on cgroup v2
/// hosts: also what left the groups, such as a daemon that called setsid)
/// where it stands (SIGSTOP), `spare` excepted (the shims, which must still
/// see the lease and their command's exit). Without /proc, whole groups
/// are stopped.
pub(crate) fn stop_processes(groups: &[Pid], cgroup: Option<&std::path::Path>, spare: &[Pid]) {
    let find = || {
        let mut pids: Vec<i32> = crate::cgroup::Cgroups::procs(cgroup);
        // One walk of /proc for every group.
        match groups_members(groups) {
            Some(members) => pids.extend(members),
            None => {
                for g in groups {
                    let _ = killpg(*g, Signal::SIGSTOP);
                }
            }
        }
        pids
    };
    stop_in_passes(find, spare, |pid| {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGSTOP);
    });
}

/// The passes of [`stop_processes`], at most [`SUSPEND_PASSES_MAX`]: each
/// stops (`stop`) what `find` lists that no pass before it stopped, `spare`
/// excepted, until a pass stops nothing new.
pub(crate) fn stop_in_passes(mut find: impl FnMut() -> Vec<i32>, spare: &[Pid], mut stop: impl FnMut(i32)) {
    let mut stopped = std::collections::BTreeSet::new();
    for _ in 0..SUSPEND_PASSES_MAX {
        let mut new = 0usize;
        for pid in find() {
            if !spare.contains(&Pid::from_raw(pid)) && stopped.insert(pid) {
                stop(pid);
                new = new.saturating_add(1);
            }
        }
        if new == 0 {
            break;
        }
    }
}

/// Continues every process of `groups` and of the task's cgroup (SIGCONT).
pub(crate) fn continue_processes(groups: &[Pid], cgroup: Option<&std::path::Path>) {
    for g in groups {
        let _ = killpg(*g, Signal::SIGCONT);
    }
    for pid in crate::cgroup::Cgroups::procs(cgroup) {
        let _ = nix::sys::signal::kill(Pid::from_raw(pid), Signal::SIGCONT);
    }
}

/// Whether `pid` runs srun (`srun ...` or `gangway srun ...`), which passes
/// Slurm's warning to its tasks rather than taking it.
pub(crate) fn is_srun(pid: i32) -> bool {
    let Ok(cmdline) = std::fs::read(format!("/proc/{pid}/cmdline")) else { return false };
    let mut args = cmdline.split(|b| *b == 0).map(|a| a.rsplit(|b| *b == b'/').next().unwrap_or(a));
    matches!((args.next(), args.next()), (Some(b"srun"), _) | (Some(b"gangway"), Some(b"srun")))
}

/// The running (not zombie) processes of group `pgid`, as (pid, parent pid);
/// None without /proc.
pub(crate) fn group_members(pgid: Pid) -> Option<Vec<(i32, i32)>> {
    members_where(|g| g == pgid.as_raw())
}

/// The running processes of any of `groups`, in one walk of /proc; None
/// without /proc.
pub(crate) fn groups_members(groups: &[Pid]) -> Option<Vec<i32>> {
    let wanted: std::collections::BTreeSet<i32> = groups.iter().map(|g| g.as_raw()).collect();
    Some(members_where(|g| wanted.contains(&g))?.into_iter().map(|(pid, _)| pid).collect())
}

/// The running (not zombie) processes whose process group `in_group`
/// accepts, as (pid, parent pid); None without /proc.
pub(crate) fn members_where(in_group: impl Fn(i32) -> bool) -> Option<Vec<(i32, i32)>> {
    let entries = std::fs::read_dir("/proc").ok()?;
    let members = entries
        .flatten()
        .filter_map(|e| {
            let pid: i32 = e.file_name().to_str()?.parse().ok()?;
            let stat = std::fs::read_to_string(e.path().join("stat")).ok()?;
            // `pid (comm) state ppid pgrp ...`; comm may hold spaces and parentheses.
            let (_, rest) = stat.rsplit_once(')')?;
            let f: Vec<&str> = rest.split_whitespace().collect();
            let (ppid, pgrp): (i32, i32) = (f.get(1)?.parse().ok()?, f.get(2)?.parse().ok()?);
            (in_group(pgrp) && !matches!(f[0], "Z" | "X")).then_some((pid, ppid))
        })
        .collect();
    Some(members)
}

/// Whether any process of group `pgid` is still running. Zombies do not
/// count: an orphan's zombie waits for PID 1 to reap it, and some container
/// inits never do. Without /proc: whether the group can be signalled.
pub(crate) fn group_alive(pgid: Pid) -> bool {
    match group_members(pgid) {
        Some(m) => !m.is_empty(),
        None => killpg(pgid, None).is_ok(),
    }
}

/// Whether `pid` is a task shim (a task's, or a kept step task's).
pub(crate) fn is_shim(pid: i32) -> bool {
    std::fs::read(format!("/proc/{pid}/cmdline")).is_ok_and(|c| String::from_utf8_lossy(&c).contains("task-shim"))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A suspend stops what each pass finds, for SUSPEND_PASSES_MAX passes
    /// at most: a process first found by the last pass is stopped; one that
    /// would be found by the pass after it is not looked for; a pass that
    /// finds nothing new ends it early.
    #[test]
    fn a_suspend_makes_at_most_suspend_passes_max_passes() {
        // A task that forks one process more before every pass.
        let (mut passes, mut stopped) = (0, Vec::new());
        stop_in_passes(
            || {
                passes += 1;
                (1..=passes).collect()
            },
            &[],
            |pid| stopped.push(pid),
        );
        assert_eq!(passes, SUSPEND_PASSES_MAX as i32);
        assert_eq!(stopped, (1..=SUSPEND_PASSES_MAX as i32).collect::<Vec<_>>());
        assert!(!stopped.contains(&(SUSPEND_PASSES_MAX as i32 + 1)));
        // One that stopped forking: the second pass finds nothing new.
        let mut passes = 0;
        stop_in_passes(
            || {
                passes += 1;
                vec![1, 2]
            },
            &[],
            |_| {},
        );
        assert_eq!(passes, 2);
    }
}
