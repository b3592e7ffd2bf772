//! The controller replica: the shell around the pure core.
//!
//! ```text
//!  gRPC (tonic) ──► api::{jobs,nodes,admin,agent} ──validate──► Replica::propose ──► raft ──► raft-store
//!        ▲                     │ not leader?                         (openraft)          (RocksDB)
//!        └──── forward ◄───────┘
//!  leader::duties (only while leader): node liveness → SetNodeState(Down)
//! ```
//!
//! Related code: `controller/core` (model and `apply`), `raft-store` (storage),
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

/// Milliseconds since the Unix epoch: the time a leader stamps into commands.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
