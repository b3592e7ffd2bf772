//! A Raft log entry's bytes, decoded as every replica decodes them and, when
//! they hold a command, applied to a small live cluster: decoding never
//! panics, and apply never panics and keeps every invariant.
#![no_main]

use std::sync::OnceLock;

use gangway_core::format::{from_bytes, Payload};
use gangway_core::spec::GpuSpec;
use gangway_core::{Command, JobSpec, NodeSpec, State};
use libfuzzer_sys::fuzz_target;

fn base() -> &'static State {
    static BASE: OnceLock<State> = OnceLock::new();
    BASE.get_or_init(|| {
        let mut s = State::default();
        let mut i = 0;
        let mut apply = |s: &mut State, c: Command| {
            i += 1;
            s.apply(i, &c);
        };
        for n in 0..2 {
            let gpus = (0..4)
                .map(|g| GpuSpec { uuid: format!("G{n}{g}"), model: "h100".into(), mem_mb: 81_920, nvlink_island: 0 })
                .collect();
            let spec = NodeSpec {
                name: format!("n{n}"),
                addr: String::new(),
                cpus: 16,
                mem_mb: 65_536,
                gpus,
                topology: vec!["z".into(), format!("r{n}")],
                labels: Default::default(),
            };
            apply(&mut s, Command::RegisterNode { spec, now_ms: 1 });
        }
        for k in 0..3 {
            let spec = JobSpec {
                user: "alice".into(),
                command: vec!["true".into()],
                nodes: 1,
                cpus_per_task: 2,
                gpus_per_node: 2,
                array: if k == 2 { "0-2".into() } else { String::new() },
                ..JobSpec::default()
            };
            apply(&mut s, Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 2 });
        }
        if s.format < 5 {
            apply(&mut s, Command::SetDataFormat { format: 5, now_ms: 3 });
        }
        s
    })
}

fuzz_target!(|data: &[u8]| {
    let Ok(payload) = from_bytes::<Payload>(data) else { return };
    let Some(cmd) = payload.command else { return };
    let mut s = base().clone();
    s.apply(100, &cmd);
    if let Err(e) = s.check_invariants() {
        panic!("{} broke an invariant: {e}", cmd.name());
    }
});
