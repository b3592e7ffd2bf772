//! The controller replica: the shell around the pure core.
//!
//! ```text
//!  gRPC (tonic) ──► api::{jobs,nodes,admin,agent} ──validate──► Replica::propose ──► raft ──► raft-store
//!        ▲                     │ not leader?                         (openraft)          (RocksDB)
//!        └──── forward ◄───────┘
//!  leader::duties (only while leader): node liveness → SetNodeState(Down)
//! ```
//!
//! Related code: `core` (model and `apply`), `raft-store` (storage),
//! `proto` (wire types and the client library), `cli` (the `gangway` binary).

pub mod accounting;
pub mod admission;
pub mod api;
pub mod audit;
pub mod config;
pub mod heartbeats;
pub mod lanes;
pub mod leader;
pub mod proposer;
pub mod raft;
pub mod ratelimit;
pub mod replica;
pub mod shared;
pub mod telemetry;
pub mod ui;
pub mod watch;

pub use config::{ReplicaConfig, Timing};
pub use replica::ReplicaHandle;
pub use shared::Replica;

pub use gangway_core::duties::format_duration_s;

/// The monotonic instant `d` from now; one past the clock's range is a year
/// from now instead (never an overflow panic, never a deadline already past).
pub fn deadline_in(d: std::time::Duration) -> tokio::time::Instant {
    const FAR: std::time::Duration = std::time::Duration::from_secs(365 * 24 * 3600);
    let now = tokio::time::Instant::now();
    now.checked_add(d).or_else(|| now.checked_add(FAR)).unwrap_or(now)
}

/// Milliseconds since the Unix epoch: the time a leader stamps into commands.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
