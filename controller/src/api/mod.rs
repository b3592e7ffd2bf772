//! The gRPC API edge: request metadata, routing to the leader, protobuf ⇄ core
//! conversion, and the one place errors become gRPC statuses.
//!
//! Every write is proposed locally; if this replica is not the leader, the
//! original request is forwarded once to the leader (a forwarded request is
//! never forwarded again, so leadership changes cannot make it loop). Reads are
//! linearizable (confirmed by the leader) unless the caller sets `stale`.

pub mod admin;
pub mod agent;
pub mod convert;
pub mod jobs;
pub mod nodes;

use std::future::Future;

use gangway_core::{Refusal, RefusalKind, SpecError};
use gangway_proto::IDENTITY_METADATA_KEY;
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use crate::raft::ProposeError;
use crate::replica::Replica;

/// Marks a request a replica forwarded to the leader.
pub const FORWARDED_METADATA_KEY: &str = "gangway-forwarded";
/// Identity used when a request carries none (dev clusters have no auth yet).
pub const DEFAULT_IDENTITY: &str = "anonymous";
/// Identities are short principal names such as `dev:alice`.
const IDENTITY_BYTES_MAX: usize = 256;

/// Who is calling, and whether a replica already forwarded the call.
#[derive(Debug, Clone)]
pub struct CallCtx {
    pub identity: String,
    pub forwarded: bool,
}

impl CallCtx {
    pub fn of<T>(req: &Request<T>) -> Result<CallCtx, Status> {
        let md = req.metadata();
        let identity = match md.get(IDENTITY_METADATA_KEY) {
            None => DEFAULT_IDENTITY.to_string(),
            Some(v) => {
                let s = v.to_str().map_err(|_| {
                    Status::invalid_argument(format!("{IDENTITY_METADATA_KEY}: must be printable ASCII"))
                })?;
                if s.is_empty() || s.len() > IDENTITY_BYTES_MAX {
                    return Err(Status::invalid_argument(format!(
                        "{IDENTITY_METADATA_KEY}: must be 1 to {IDENTITY_BYTES_MAX} bytes"
                    )));
                }
                s.to_string()
            }
        };
        Ok(CallCtx { identity, forwarded: md.get(FORWARDED_METADATA_KEY).is_some() })
    }

    /// The user name in the identity (`dev:alice` → `alice`).
    pub fn user(&self) -> &str {
        self.identity.rsplit(':').next().unwrap_or(&self.identity)
    }
}

/// Where a call was served.
pub enum Routed<T, R> {
    Local(T),
    Forwarded(Response<R>),
}

impl Replica {
    /// Sends `msg` to the leader at `leader_addr` with `call`.
    pub async fn forward<M, R, F, Fut>(
        &self,
        ctx: &CallCtx,
        leader_addr: Option<String>,
        msg: M,
        call: F,
    ) -> Result<Response<R>, Status>
    where
        F: FnOnce(Channel, Request<M>) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
    {
        if ctx.forwarded {
            return Err(Status::unavailable("leadership moved while the request was forwarded; retry"));
        }
        let Some(addr) = leader_addr else {
            return Err(Status::unavailable("no leader is elected right now; retry"));
        };
        let channel = self.channel_to(&addr)?;
        let mut req = Request::new(msg);
        let md = req.metadata_mut();
        md.insert(FORWARDED_METADATA_KEY, "1".parse().expect("static ascii"));
        if let Ok(v) = ctx.identity.parse() {
            md.insert(IDENTITY_METADATA_KEY, v);
        }
        req.set_timeout(crate::replica::FORWARD_TIMEOUT);
        metrics::counter!("gangway_api_forwarded_total").increment(1);
        call(channel, req).await.map_err(|s| {
            if gangway_proto::client::is_transport_failure(&s) && s.code() != tonic::Code::Unavailable {
                Status::unavailable(format!("the leader at {addr} did not answer ({}); retry", s.message()))
            } else {
                s
            }
        })
    }

    /// Proposes `cmd` here if leader, otherwise forwards `msg` with `call`.
    pub async fn write_or_forward<M, R, F, Fut>(
        &self,
        ctx: &CallCtx,
        cmd: gangway_core::Command,
        msg: M,
        call: F,
    ) -> Result<Routed<gangway_core::Applied, R>, Status>
    where
        F: FnOnce(Channel, Request<M>) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
    {
        match self.proposer.propose(cmd).await {
            Ok(applied) => Ok(Routed::Local(applied)),
            Err(ProposeError::NotLeader { leader_addr }) => {
                Ok(Routed::Forwarded(self.forward(ctx, leader_addr, msg, call).await?))
            }
            Err(e) => Err(status_from_propose(e)),
        }
    }

    /// For a read: returns `None` when it may be served from local state (stale
    /// read, or this replica is the leader and confirmed it), else forwards.
    pub async fn read_or_forward<M, R, F, Fut>(
        &self,
        ctx: &CallCtx,
        stale: bool,
        msg: M,
        call: F,
    ) -> Result<Option<Response<R>>, Status>
    where
        F: FnOnce(Channel, Request<M>) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
    {
        if stale {
            return Ok(None);
        }
        match self.node.ensure_linearizable(crate::replica::WRITE_TIMEOUT).await {
            Ok(()) => Ok(None),
            Err(ProposeError::NotLeader { leader_addr }) => Ok(Some(self.forward(ctx, leader_addr, msg, call).await?)),
            Err(e) => Err(status_from_propose(e)),
        }
    }
}

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
