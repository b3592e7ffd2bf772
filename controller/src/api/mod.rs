//! The gRPC API edge: who the caller is and what they may do (`caller.rs`),
//! routing to the leader (`routing.rs`), protobuf ⇄ core conversion
//! (`convert.rs`), and the one place errors become gRPC statuses (here).
//!
//! Every write is proposed locally; if this replica is not the leader, the
//! original request is forwarded once to the leader (a forwarded request is
//! never forwarded again, so leadership changes cannot make it loop). Reads are
//! linearizable (confirmed by the leader) unless the caller sets `stale`.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects, clippy::cast_possible_truncation))]

pub mod admin;
pub mod agent;
mod caller;
pub mod convert;
pub mod jobs;
pub mod nodes;
mod routing;

pub use caller::*;
pub use routing::{Read, Routed};

use gangway_core::{Refusal, RefusalKind, SpecError};
use tonic::Status;

use crate::raft::ProposeError;

pub fn status_from_propose(e: ProposeError) -> Status {
    match e {
        ProposeError::NotLeader { leader_addr } => Status::unavailable(format!(
            "this replica is not the leader (leader: {}); retry",
            leader_addr.as_deref().unwrap_or("unknown")
        )),
        ProposeError::Unavailable(m) => Status::unavailable(m),
        ProposeError::Refused(m) => Status::failed_precondition(m),
    }
}

/// The cluster's history, once settled. A cluster restored from a backup
/// serves nothing that names its history (event streams, heartbeats, the
/// accounting service's reports) until its first leader has drawn one and
/// this replica has applied it (`Command::DrawHistory`): no client follows
/// the history derived from the backup, which another restore of the file
/// would share, and none sees the history change under it.
pub fn settled_history(state: &gangway_core::State) -> Result<u64, Status> {
    if state.history_pending {
        return Err(Status::unavailable(
            "history: this cluster was restored from a backup and its leader has not drawn its history yet (it \
             does at its election); retry in a moment",
        ));
    }
    Ok(state.history)
}

pub fn status_from_refusal(r: &Refusal) -> Status {
    match r.kind {
        RefusalKind::NotFound => Status::not_found(r.message.clone()),
        RefusalKind::InvalidArgument => Status::invalid_argument(r.message.clone()),
        RefusalKind::FailedPrecondition => Status::failed_precondition(r.message.clone()),
        RefusalKind::Stale => Status::aborted(r.message.clone()),
        RefusalKind::PermissionDenied => Status::permission_denied(r.message.clone()),
        RefusalKind::ResourceExhausted => Status::resource_exhausted(r.message.clone()),
    }
}

pub fn status_from_spec(e: SpecError) -> Status {
    Status::invalid_argument(e.to_string())
}

/// An outcome the handler did not expect for its command: a bug, reported as such.
pub fn unexpected(outcome: &gangway_core::Outcome) -> Status {
    match outcome {
        gangway_core::Outcome::Refused(r) => status_from_refusal(r),
        other => Status::internal(format!("unexpected outcome {other:?}")),
    }
}
