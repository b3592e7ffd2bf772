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

pub mod api;
pub mod audit;
pub mod config;
pub mod leader;
pub mod proposer;
pub mod raft;
pub mod ratelimit;
pub mod replica;
pub mod telemetry;

pub use config::{ReplicaConfig, Timing};
pub use replica::{Replica, ReplicaHandle};

/// `H:MM:SS` (or `D-HH:MM:SS`) for messages about durations.
pub fn format_duration_s(secs: u64) -> String {
    let (d, h, m, s) = (secs / 86400, secs / 3600 % 24, secs / 60 % 60, secs % 60);
    if d > 0 {
        format!("{d}-{h:02}:{m:02}:{s:02}")
    } else {
        format!("{h}:{m:02}:{s:02}")
    }
}

/// Milliseconds since the Unix epoch: the time a leader stamps into commands.
pub fn now_ms() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map(|d| d.as_millis() as u64).unwrap_or(0)
}
