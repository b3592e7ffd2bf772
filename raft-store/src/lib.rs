//! openraft storage for Gangway on RocksDB: the Raft log, Raft metadata and the
//! state-machine snapshots live in one RocksDB per controller, in three column
//! families; the state machine itself ([`gangway_core::State`]) lives in memory.
//!
//! ```text
//!  openraft ──append──► LogStore ──WriteBatch (no sync)──► RocksDB WAL
//!                           └──callback──► GroupCommitter thread ──flush_wal(sync)──► callbacks
//!  openraft ──apply───► StateMachineStore ──► State::apply ──► events (broadcast)
//! ```
//!
//! Durability: votes are synced before `save_vote` returns; log entries are
//! acknowledged to openraft only after an fsync that covers them, and every append
//! waiting at that moment shares one fsync (group commit).
//!
//! Architecture Invariant: this crate and `controller/src/raft` are the only places
//! that name openraft types.
//!
//! Related code: `controller/src/raft` (network and the Raft instance).

pub mod backup;
pub mod codec;
mod db;
mod log_store;
mod state_machine;
pub mod views;

use std::io::Cursor;

pub use db::{open, StoreError, Stores};
pub use log_store::LogStore;
pub use state_machine::{
    SharedState, StateCopy, StateMachineStore, ViewBehind, COPY_TAIL_BYTES_MAX, COPY_TAIL_COMMANDS_MAX,
};
pub use views::{View, ViewStats};

/// A controller replica's id in the Raft group.
pub type NodeId = u64;

/// What a replica's entry is answered with: the core's outcome for a normal
/// entry, nothing for Raft's own blank and membership entries.
pub type Response = Option<gangway_core::Applied>;

openraft::declare_raft_types!(
    /// Gangway's openraft type configuration.
    pub TypeConfig:
        D = gangway_core::payload::Payload,
        R = Response,
        NodeId = NodeId,
        Node = openraft::BasicNode,
        SnapshotData = Cursor<Vec<u8>>,
);

/// The openraft types the controller uses, named once here.
pub mod typ {
    pub use openraft;
    pub type Raft = openraft::Raft<super::TypeConfig>;
    pub type Entry = openraft::Entry<super::TypeConfig>;
    pub type BasicNode = openraft::BasicNode;
}
