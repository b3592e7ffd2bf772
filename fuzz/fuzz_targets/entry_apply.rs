//! A Raft log entry's bytes, decoded as every replica decodes them and, when
//! they hold a command, applied to a small live cluster at the newest data
//! format (so every command kind, reservations, steps, suspension, pools and
//! accounting included, reaches apply): decoding never panics, and apply
//! never panics and keeps every invariant. Seeds: every entry of the golden
//! file, in every format (`make fuzz` writes them from
//! core/tests/golden/encodings.txt).
#![no_main]

use std::sync::OnceLock;

use gangway_core::command::Placement;
use gangway_core::format::{from_bytes, FORMAT_NEWEST};
use gangway_core::model::NodeAllocation;
use gangway_core::payload::Payload;
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
            apply(
                &mut s,
                Command::SubmitJob { spec, identity: "alice".into(), idempotency_key: String::new(), now_ms: 2 },
            );
        }
        apply(&mut s, Command::SetDataFormat { format: FORMAT_NEWEST, now_ms: 3 });
        assert_eq!(s.format, FORMAT_NEWEST, "the base state moves to the newest format");
        // Job 1 runs on n0 (steps, suspension, signals and task exits have a
        // job to act on); the others stay pending.
        let alloc = NodeAllocation { node: "n0".into(), cpus: 2, mem_mb: 0, gpus: vec![0, 1] };
        let placement = Placement { job_id: 1, attempt: 1, nodes: vec![alloc] };
        apply(&mut s, Command::ApplySchedule { preemptions: Vec::new(), placements: vec![placement], now_ms: 4 });
        assert!(s.running.contains(&1), "job 1 runs in the base state");
        s.check_invariants().expect("the base state keeps every invariant");
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
