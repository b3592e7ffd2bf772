//! Terminal steps (`srun --pty`): a pseudo-terminal for one task, relayed
//! through the step service's `Attach` call. What the user types, the
//! terminal's size and forwarded signals come in; what the task writes to
//! its terminal goes back out. The task's shim makes the terminal its
//! session's controlling terminal, so job control, Ctrl-C (a byte the
//! terminal turns into SIGINT) and hangups behave as over ssh.

use std::os::fd::OwnedFd;

use gangway_proto::v1::step_event::Kind;
use gangway_proto::v1::step_input::Kind as Input;
use gangway_proto::v1::{StepEvent, StepInput, StepOutput, WindowSize};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::sync::mpsc;
use tonic::Status;

/// Rows and columns a terminal may have: far above any screen, and inside
/// the kernel's 16-bit fields.
const SIDE_MAX: u32 = 10_000;
/// A terminal's size when the client has none (its input is not a terminal).
const DEFAULT_ROWS: u16 = 24;
const DEFAULT_COLS: u16 = 80;
/// Bytes read from the terminal at a time (one output event).
const OUTPUT_CHUNK_BYTES: usize = 16 * 1024;
/// Bytes of input one message may carry (srun sends what one read of its
/// terminal gave; a larger message is refused, not buffered).
pub const INPUT_BYTES_MAX: usize = 64 * 1024;
/// After the task exits, how long output still in the terminal is read
/// while a process it left behind holds the terminal open.
const DRAIN_AFTER_EXIT: std::time::Duration = std::time::Duration::from_secs(2);

/// The signals a client may forward to a terminal step: those a terminal
/// itself makes (they are sent as root, so nothing a terminal could not do
/// is allowed); anything else is ignored.
const FORWARDED: [nix::sys::signal::Signal; 4] = {
    use nix::sys::signal::Signal::*;
    [SIGINT, SIGQUIT, SIGHUP, SIGWINCH]
};
/// How long the shim has to start the task's session (before the task's
/// process group is registered, so that nothing of it can escape a stop).
const SESSION_WAIT: std::time::Duration = std::time::Duration::from_secs(5);
const SESSION_POLL: std::time::Duration = std::time::Duration::from_millis(5);
const SESSION_POLLS: u128 = SESSION_WAIT.as_millis() / SESSION_POLL.as_millis();
/// Processes looked at when a session's leftovers are ended.
const PROCS_SCANNED_MAX: usize = 1 << 20;

/// The terminal size asked for, bounded; 24x80 where none is given.
pub fn winsize(w: Option<&WindowSize>) -> rustix::termios::Winsize {
    let side = |v: u32, default: u16| if v == 0 { default } else { v.min(SIDE_MAX) as u16 };
    let (rows, cols) = w.map_or((0, 0), |w| (w.rows, w.cols));
    rustix::termios::Winsize {
        ws_row: side(rows, DEFAULT_ROWS),
        ws_col: side(cols, DEFAULT_COLS),
        ws_xpixel: 0,
        ws_ypixel: 0,
    }
}

/// A new pseudo-terminal of `size`: (the agent's side; the task's side,
/// owned by the job's user when tasks switch to one, mode 0600, so that
/// only they and root can open it).
pub fn open(size: rustix::termios::Winsize, owner: Option<(u32, u32)>) -> std::io::Result<(OwnedFd, OwnedFd)> {
    use rustix::fs::{Mode, OFlags};
    use rustix::pty::OpenptFlags;
    let master = rustix::pty::openpt(OpenptFlags::RDWR | OpenptFlags::NOCTTY | OpenptFlags::CLOEXEC)?;
    rustix::pty::grantpt(&master)?;
    rustix::pty::unlockpt(&master)?;
    let name = rustix::pty::ptsname(&master, Vec::new())?;
    let slave = rustix::fs::open(name.as_c_str(), OFlags::RDWR | OFlags::NOCTTY | OFlags::CLOEXEC, Mode::empty())?;
    if let Some((uid, gid)) = owner {
        rustix::fs::fchown(
            &slave,
            Some(rustix::fs::Uid::from_raw_unchecked(uid)),
            Some(rustix::fs::Gid::from_raw_unchecked(gid)),
        )?;
        rustix::fs::fchmod(&slave, Mode::from_raw_mode(0o600))?;
    }
    rustix::termios::tcsetwinsize(&master, size)?;
    Ok((master, slave))
}

/// Relays a terminal step until its task ends: `input` into the terminal,
/// the terminal's output to `tx` as `rank`'s. The task's exit status, or
/// None when the client went away (its call or stream ended first) and the
/// caller must stop the task. The terminal is closed on return (its
/// session gets a hangup).
pub async fn relay(
    child: &mut tokio::process::Child,
    master: OwnedFd,
    mut input: tonic::Streaming<StepInput>,
    tx: &mpsc::Sender<Result<StepEvent, Status>>,
    rank: u32,
) -> Option<std::io::Result<std::process::ExitStatus>> {
    use tokio::net::unix::pipe;
    let task_group = child.id().map(|p| p as i32);
    // Non-blocking, driven by the runtime's reactor: no thread waits on it,
    // and dropping these closes the terminal for good.
    let ends = rustix::io::ioctl_fionbio(&master, true)
        .map_err(std::io::Error::from)
        .and_then(|()| Ok((master.try_clone()?, master.try_clone()?)))
        .and_then(|(r, w)| {
            Ok((pipe::Receiver::from_owned_fd_unchecked(r)?, pipe::Sender::from_owned_fd_unchecked(w)?))
        });
    let (mut reader, mut writer) = match ends {
        Ok(ends) => ends,
        Err(e) => return Some(Err(e)),
    };
    let mut buf = vec![0u8; OUTPUT_CHUNK_BYTES];
    // Input taken from the stream but not yet written: at most one message.
    let mut pending: Vec<u8> = Vec::new();
    let mut last_input = b'\n';
    // Room for one output event: the terminal is read only with it, so a
    // slow client slows the task's output without holding up its input.
    let mut room: Option<mpsc::Permit<'_, Result<StepEvent, Status>>> = None;
    let (mut input_open, mut output_open) = (true, true);
    let mut status: Option<std::io::Result<std::process::ExitStatus>> = None;
    let drain = tokio::time::sleep(std::time::Duration::from_secs(u32::MAX.into()));
    tokio::pin!(drain);
    // Bounded by the task's life, then by DRAIN_AFTER_EXIT.
    while status.is_none() || output_open {
        tokio::select! {
            reserved = tx.reserve(), if output_open && room.is_none() => match reserved {
                Ok(permit) => room = Some(permit),
                Err(_) => return None,
            },
            read = reader.read(&mut buf), if output_open && room.is_some() => match read {
                // EIO: nothing holds the task's side any more.
                Ok(0) | Err(_) => output_open = false,
                Ok(n) => {
                    let out = StepOutput { rank, stderr: false, data: buf[..n].to_vec() };
                    if let Some(permit) = room.take() {
                        permit.send(Ok(StepEvent { kind: Some(Kind::Output(out)) }));
                    }
                }
            },
            wrote = writer.write(&pending), if !pending.is_empty() => match wrote {
                Ok(n) => {
                    last_input = pending[..n].last().copied().unwrap_or(last_input);
                    drop(pending.drain(..n));
                }
                Err(_) => pending.clear(),
            },
            message = input.message(), if input_open && pending.is_empty() => match message {
                Ok(Some(StepInput { kind: Some(kind) })) => match kind {
                    // `pending` is empty here: a message too large leaves it so.
                    Input::Stdin(data) => pending = accepted_input(data).unwrap_or_default(),
                    Input::Window(w) => {
                        // The kernel tells the foreground processes (SIGWINCH).
                        let _ = rustix::termios::tcsetwinsize(&master, winsize(Some(&w)));
                    }
                    Input::Signal(s) if status.is_none() => forward(s, &master, task_group),
                    Input::Eof(true) => {
                        // End of file ends a line in progress first.
                        let eof = eof_char(&master);
                        pending = if last_input == b'\n' { vec![eof] } else { vec![eof, eof] };
                    }
                    Input::Signal(_) | Input::Eof(false) | Input::Start(_) => {}
                },
                Ok(Some(StepInput { kind: None })) => {}
                // The client went away: its task goes too (unless it ended).
                Ok(None) | Err(_) if status.is_none() => return None,
                Ok(None) | Err(_) => input_open = false,
            },
            ended = child.wait(), if status.is_none() => {
                status = Some(ended);
                drain.as_mut().reset(crate::tokio_deadline_in(DRAIN_AFTER_EXIT));
            }
            _ = &mut drain, if status.is_some() => break,
            _ = tx.closed() => return None,
        }
    }
    status
}

/// Input to write to the terminal: a message of at most [`INPUT_BYTES_MAX`]
/// bytes; a larger one is dropped (refused, not buffered).
fn accepted_input(data: Vec<u8>) -> Option<Vec<u8>> {
    if data.len() > INPUT_BYTES_MAX {
        tracing::warn!(bytes = data.len(), "terminal step: input message too large: dropped");
        return None;
    }
    Some(data)
}

/// Waits until `pid` (the shim) leads a session of its own, within
/// SESSION_WAIT; false if it never did (it ended, or failed).
pub async fn session_started(pid: i32) -> bool {
    for _ in 0..SESSION_POLLS {
        match stat_ids(pid) {
            Some((_, session)) if session == pid => return true,
            Some(_) => tokio::time::sleep(SESSION_POLL).await,
            None => return false,
        }
    }
    false
}

/// A live (not zombie) process's (process group, session), from /proc.
fn stat_ids(pid: i32) -> Option<(i32, i32)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // After the command name (which may hold anything): state, ppid, pgrp, session.
    let mut f = stat.rsplit_once(')')?.1.split_whitespace();
    if f.next()?.starts_with(['Z', 'X']) {
        return None;
    }
    let mut f = f.skip(1);
    Some((f.next()?.parse().ok()?, f.next()?.parse().ok()?))
}

/// The process groups of session `sid` (the task's shell, its jobs, what
/// they left behind).
pub fn session_groups(sid: i32) -> Vec<nix::unistd::Pid> {
    // Only groups with a live member of the session (the session's id may
    // be another process's by now).
    let mut groups = std::collections::BTreeSet::new();
    let names = std::fs::read_dir("/proc").into_iter().flatten().flatten().map(|e| e.file_name());
    for pid in scanned_pids(names) {
        if let Some((group, _)) = stat_ids(pid).filter(|(_, s)| *s == sid) {
            groups.insert(group);
        }
    }
    groups.into_iter().map(nix::unistd::Pid::from_raw).collect()
}

/// The pids among the first [`PROCS_SCANNED_MAX`] names of `/proc`'s entries.
fn scanned_pids(names: impl Iterator<Item = std::ffi::OsString>) -> impl Iterator<Item = i32> {
    names.take(PROCS_SCANNED_MAX).filter_map(|n| n.to_str()?.parse::<i32>().ok())
}

/// The terminal's end-of-file character (Ctrl-D unless changed).
fn eof_char(master: &OwnedFd) -> u8 {
    rustix::termios::tcgetattr(master).map(|t| t.special_codes[rustix::termios::SpecialCodeIndex::VEOF]).unwrap_or(4)
}

/// Sends a forwarded signal to the terminal's foreground processes and the
/// task's own process group (a shell that runs a command in the foreground
/// puts it in a group of its own).
fn forward(signal: i32, master: &OwnedFd, task_group: Option<i32>) {
    use nix::sys::signal::{killpg, Signal};
    let Some(sig) = Signal::try_from(signal).ok().filter(|s| FORWARDED.contains(s)) else {
        tracing::warn!(signal, "terminal step: a signal that is not forwarded was asked for");
        return;
    };
    let foreground = rustix::termios::tcgetpgrp(master).ok().map(|p| p.as_raw_nonzero().get());
    let mut groups: Vec<i32> = foreground.into_iter().chain(task_group).collect();
    groups.dedup();
    for g in groups {
        let _ = killpg(nix::unistd::Pid::from_raw(g), sig);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sizes_are_bounded_and_default_to_24_by_80() {
        let w = winsize(None);
        assert_eq!((w.ws_row, w.ws_col), (24, 80));
        let w = winsize(Some(&WindowSize { rows: 0, cols: 132 }));
        assert_eq!((w.ws_row, w.ws_col), (24, 132));
        let w = winsize(Some(&WindowSize { rows: u32::MAX, cols: 70_000 }));
        assert_eq!((w.ws_row, w.ws_col), (SIDE_MAX as u16, SIDE_MAX as u16));
    }

    #[test]
    fn a_terminal_has_the_size_asked_and_reads_what_its_task_writes() {
        let (master, slave) = open(winsize(Some(&WindowSize { rows: 33, cols: 101 })), None).unwrap();
        let got = rustix::termios::tcgetwinsize(&slave).unwrap();
        assert_eq!((got.ws_row, got.ws_col), (33, 101));
        rustix::io::write(&slave, b"hi\n").unwrap();
        // The line discipline may hand the bytes over in more than one read
        // (a CI run saw "hi" and then "\r\n"): read until all four came.
        let mut got = Vec::new();
        for _ in 0..16 {
            let mut buf = [0u8; 16];
            let n = rustix::io::read(&master, &mut buf).unwrap();
            got.extend_from_slice(&buf[..n]);
            if got.len() >= 4 {
                break;
            }
        }
        assert_eq!(got, b"hi\r\n", "the terminal's line discipline maps NL to CR NL");
        assert_eq!(eof_char(&master), 4);
    }

    /// An input message of INPUT_BYTES_MAX bytes is written to the terminal;
    /// one byte larger is dropped.
    #[test]
    fn input_messages_carry_at_most_input_bytes_max() {
        assert_eq!(accepted_input(vec![b'x'; INPUT_BYTES_MAX]).map(|d| d.len()), Some(INPUT_BYTES_MAX));
        assert_eq!(accepted_input(vec![b'x'; INPUT_BYTES_MAX + 1]), None);
    }

    /// Ending a session's leftovers looks at PROCS_SCANNED_MAX entries of
    /// /proc, the last of them included, and not at one more.
    #[test]
    fn a_session_scan_looks_at_most_at_procs_scanned_max_entries() {
        let names = |n: usize| (1..=n).map(|i| std::ffi::OsString::from(i.to_string()));
        let at: Vec<i32> = scanned_pids(names(PROCS_SCANNED_MAX)).collect();
        assert_eq!((at.len(), at.last()), (PROCS_SCANNED_MAX, Some(&(PROCS_SCANNED_MAX as i32))));
        let past: Vec<i32> = scanned_pids(names(PROCS_SCANNED_MAX + 1)).collect();
        assert_eq!((past.len(), past.last()), (PROCS_SCANNED_MAX, Some(&(PROCS_SCANNED_MAX as i32))));
        // Entries that are no process count too (the cap bounds the walk).
        let mixed = std::iter::once("self".into()).chain(names(PROCS_SCANNED_MAX));
        assert_eq!(scanned_pids(mixed).count(), PROCS_SCANNED_MAX - 1);
    }
}
