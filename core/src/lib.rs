//! Gangway's pure core: the replicated model and its deterministic state machine.
//!
//! ```text
//!  API edge ──validate──► Command ──Raft log──► State::apply ──► Applied { outcome, events }
//!                                                   │
//!                                   snapshot::encode/decode (versioned)
//! ```
//!
//! Nothing here does I/O, reads a clock or spawns a thread: the leader stamps time
//! into each [`Command`], and every replica that applies the same commands in the
//! same order reaches byte-identical state. `clippy.toml` in this crate bans the
//! usual sources of non-determinism, and a test rejects any I/O dependency.
//!
//! Related code: `raft-store` (drives `apply` from the Raft log),
//! `controller/src/api` (turns protobuf into [`JobSpec`] and validates it).

// Apply is total: no input may overflow arithmetic into a panic on every
// replica (a committed entry is replayed forever). Outside tests, every
// operation that can overflow is checked or saturating.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects, clippy::cast_possible_truncation))]
// Nor may anything else panic, in apply or in the leader's scheduling pass
// (the next leader would run the same pass over the same state): no
// `expect`, `unwrap`, index or slice that can miss (of a string too),
// `panic!`, `unreachable!` or `unimplemented!` (`todo!` is denied everywhere). A state that breaks an invariant is skipped or refused,
// never a crash (`State::check_invariants` finds it in the fuzzer and the
// simulation). The few exceptions give their reason and are counted in
// tests/core.rs (`PANIC_EXCEPTIONS`).
#![cfg_attr(
    not(test),
    deny(
        clippy::expect_used,
        clippy::unwrap_used,
        clippy::indexing_slicing,
        clippy::string_slice,
        clippy::panic,
        clippy::unreachable,
        clippy::unimplemented
    )
)]

pub mod agent;
pub mod command;
pub mod compat;
pub mod duties;
pub mod fit;
pub mod format;
pub mod inventory;
pub mod limits;
pub mod model;
pub mod payload;
pub mod policy;
pub mod reservation;
pub mod sched;
pub mod share;
pub mod sim;
pub mod snapshot;
pub mod spec;
pub mod state;

pub use command::{Command, NodeStateChange};
pub use model::{Allocation, Gpu, GpuHealth, Job, JobId, JobState, Node, NodeAllocation, NodeState, StopCause};
pub use share::Share;
pub use spec::{JobSpec, NodeSpec, SpecError};
pub use state::{Applied, Event, JobEvent, NodeChange, Outcome, Refusal, RefusalKind, State};

/// Counters the core keeps: adding one saturates, so no input can make a
/// replica panic on overflow.
pub(crate) trait Counter: Copy {
    fn plus_one(self) -> Self;
}

macro_rules! counter {
    ($($t:ty),*) => {$(impl Counter for $t {
        fn plus_one(self) -> Self {
            self.saturating_add(1)
        }
    })*};
}
counter!(u8, u16, u32, u64, usize);

/// Adds one to a counter, saturating.
pub(crate) fn incr<T: Counter>(n: &mut T) {
    *n = n.plus_one();
}
