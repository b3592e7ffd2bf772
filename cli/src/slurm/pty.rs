//! `srun --pty`: this terminal, relayed to a task's pseudo-terminal on a
//! node through its agent's step service (`Attach`). While the step runs the
//! local terminal is raw, so every key (Ctrl-C, Ctrl-Z, arrows) reaches the
//! remote terminal, which turns them into signals and input as a local one
//! would; size changes follow (SIGWINCH), and the signals srun itself gets
//! are passed on. Input that is not a terminal is relayed too, its end as
//! the remote terminal's end-of-file.

use std::io::{Read, Write};

use gangway_proto::v1::step_event::Kind;
use gangway_proto::v1::step_input::Kind as Input;
use gangway_proto::v1::{StepEvent, StepInput, StepRequest, WindowSize};

/// Input messages waiting to be sent: a few reads of a terminal (typing
/// never fills it; a fast pipe waits for the network instead of growing).
const INPUT_QUEUE_MAX: usize = 64;
/// The queue of input messages to the agent: [`INPUT_QUEUE_MAX`].
fn input_queue() -> (tokio::sync::mpsc::Sender<StepInput>, tokio::sync::mpsc::Receiver<StepInput>) {
    tokio::sync::mpsc::channel(INPUT_QUEUE_MAX)
}

/// Bytes read from srun's input at a time (the agent takes up to 64 KiB).
const INPUT_CHUNK_BYTES: usize = 4096;

/// The local terminal in raw mode until dropped, then as it was.
struct RawTerminal {
    saved: rustix::termios::Termios,
}

impl RawTerminal {
    fn enter() -> std::io::Result<RawTerminal> {
        use rustix::termios::{tcgetattr, tcsetattr, OptionalActions};
        let stdin = std::io::stdin();
        let saved = tcgetattr(&stdin)?;
        let mut raw = saved.clone();
        raw.make_raw();
        tcsetattr(&stdin, OptionalActions::Now, &raw)?;
        Ok(RawTerminal { saved })
    }
}

impl Drop for RawTerminal {
    fn drop(&mut self) {
        let _ = rustix::termios::tcsetattr(std::io::stdin(), rustix::termios::OptionalActions::Now, &self.saved);
    }
}

fn window() -> Option<WindowSize> {
    let w = rustix::termios::tcgetwinsize(std::io::stdin()).ok()?;
    Some(WindowSize { rows: w.ws_row.into(), cols: w.ws_col.into() })
}

fn input(kind: Input) -> StepInput {
    StepInput { kind: Some(kind) }
}

/// How a terminal step ended: the task's exit code (128 + signal when
/// killed), or the agent's reason it could not run or was lost.
pub struct Ended {
    pub code: i32,
    pub error: String,
}

/// Runs `req` (one task) on `node`'s terminal through `channel` and relays
/// until it ends. `credential` goes with the call (a secured cluster).
pub async fn attach(
    node: &str,
    channel: tonic::transport::Channel,
    mut req: StepRequest,
    credential: Option<tonic::metadata::MetadataValue<tonic::metadata::Ascii>>,
) -> anyhow::Result<Ended> {
    use gangway_proto::v1::step_service_client::StepServiceClient;
    let tty = rustix::termios::isatty(std::io::stdin());
    req.window = if tty { window() } else { None };
    let (to_agent, queue) = input_queue();
    to_agent.send(input(Input::Start(req))).await.map_err(|_| anyhow::anyhow!("srun: the step's input closed"))?;
    let mut call = tonic::Request::new(tokio_stream::wrappers::ReceiverStream::new(queue));
    if let Some(c) = credential {
        call.metadata_mut().insert(gangway_proto::step_cred::STEP_CREDENTIAL_METADATA_KEY, c);
    }
    let mut events = StepServiceClient::new(channel)
        .attach(call)
        .await
        .map_err(|s| anyhow::anyhow!("srun: {node} refused the step: {}", s.message()))?
        .into_inner();
    // From here on every key goes to the remote terminal.
    let raw = if tty { Some(RawTerminal::enter()?) } else { None };
    // Reads block: a thread of its own, ended by the input's end (or with
    // the process, when the step ends first).
    let typing = to_agent.clone();
    std::thread::spawn(move || {
        let mut buf = vec![0u8; INPUT_CHUNK_BYTES];
        let mut stdin = std::io::stdin().lock();
        // Bounded by the input: it ends, or srun exits.
        loop {
            let kind = match stdin.read(&mut buf) {
                Ok(0) | Err(_) => Input::Eof(true),
                Ok(n) => Input::Stdin(buf[..n].to_vec()),
            };
            let last = matches!(kind, Input::Eof(_));
            if typing.blocking_send(input(kind)).is_err() || last {
                return;
            }
        }
    });
    use tokio::signal::unix::{signal, SignalKind};
    let mut resized = signal(SignalKind::window_change())?;
    // The signals srun passes on, as the terminal signals that mean the
    // same (in raw mode the keys that make SIGINT and SIGQUIT are plain
    // input, so these come from elsewhere: kill, a closed window). SIGTERM
    // is a hangup there, as when an ssh client goes; a second one ends srun.
    let mut passed = Vec::new();
    for (kind, number) in [
        (SignalKind::interrupt(), nix::libc::SIGINT),
        (SignalKind::quit(), nix::libc::SIGQUIT),
        (SignalKind::terminate(), nix::libc::SIGHUP),
        (SignalKind::hangup(), nix::libc::SIGHUP),
    ] {
        passed.push((signal(kind)?, number));
    }
    let mut hangups = 0u32;
    let mut out = std::io::stdout();
    // Bounded by the step: its stream ends when the task does.
    let ended = loop {
        // Sizes and signals never wait for room: a full queue (the agent
        // busy with typed-ahead input) drops them rather than stall output.
        let got = tokio::select! {
            event = events.message() => event,
            _ = resized.recv() => {
                if let Some(w) = window().filter(|_| tty) {
                    let _ = to_agent.try_send(input(Input::Window(w)));
                }
                continue;
            }
            number = next_signal(&mut passed) => {
                if number == nix::libc::SIGHUP {
                    hangups += 1;
                    if hangups > 1 {
                        break Ended { code: 128 + nix::libc::SIGHUP, error: "srun hung up".into() };
                    }
                }
                let _ = to_agent.try_send(input(Input::Signal(number)));
                continue;
            }
        };
        match got {
            Ok(Some(StepEvent { kind: Some(Kind::Output(o)) })) => {
                let _ = out.write_all(&o.data);
                let _ = out.flush();
            }
            Ok(Some(StepEvent { kind: Some(Kind::End(e)) })) => {
                let code = e.exit_code.unwrap_or_else(|| e.signal.map_or(1, |s| 128 + s));
                break Ended { code, error: e.error };
            }
            Ok(Some(_)) => {}
            Ok(None) => break Ended { code: 1, error: format!("lost contact with {node}'s agent") },
            Err(s) => break Ended { code: 1, error: format!("lost contact with {node}'s agent: {}", s.message()) },
        }
    };
    drop(raw);
    Ok(ended)
}

/// The next of the passed-on signals srun receives (its number).
async fn next_signal(passed: &mut [(tokio::signal::unix::Signal, i32)]) -> i32 {
    let waits = passed.iter_mut().map(|(s, n)| {
        let n = *n;
        Box::pin(async move {
            s.recv().await;
            n
        })
    });
    futures::future::select_all(waits).await.0
}

#[cfg(test)]
mod tests {
    use super::*;

    /// INPUT_QUEUE_MAX messages wait for the network; the reader of one
    /// more waits for room instead of the queue growing.
    #[test]
    fn input_waits_past_input_queue_max_messages() {
        let (tx, mut rx) = input_queue();
        for _ in 0..INPUT_QUEUE_MAX {
            assert!(tx.try_send(StepInput::default()).is_ok());
        }
        assert!(matches!(tx.try_send(StepInput::default()), Err(tokio::sync::mpsc::error::TrySendError::Full(_))));
        assert!(rx.try_recv().is_ok());
        assert!(tx.try_send(StepInput::default()).is_ok());
    }
}
