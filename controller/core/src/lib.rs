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

pub mod agent;
pub mod command;
pub mod compat;
pub mod duties;
pub mod fit;
pub mod format;
pub mod limits;
pub mod model;
pub mod policy;
pub mod reservation;
pub mod sched;
pub mod share;
pub mod sim;
pub mod snapshot;
pub mod spec;
pub mod state;

pub use command::{Command, NodeStateChange};
pub use model::{Allocation, Gpu, GpuHealth, Job, JobId, JobState, Node, NodeAllocation, NodeState};
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
