//! Routing: where a call is served. A write is proposed on this replica and,
//! when it is not the leader, the original request is forwarded once to the
//! leader with the caller's verified identity; a read is served here when it
//! may be (stale, or this replica leads and confirmed it with a quorum) and
//! forwarded otherwise. A forwarded request is never forwarded again.

use std::future::Future;

use gangway_core::RefusalKind;
use gangway_proto::{FORWARDED_FOR_METADATA_KEY, IDENTITY_METADATA_KEY};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use super::{status_from_propose, CallCtx, Caller, FORWARDED_JOB_METADATA_KEY, FORWARDED_METADATA_KEY};
use crate::raft::ProposeError;
use crate::shared::Replica;

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
        match &ctx.caller {
            Caller::Claimed(identity) => {
                if let Ok(v) = identity.parse() {
                    md.insert(IDENTITY_METADATA_KEY, v);
                }
            }
            // The leader believes this only because our certificate says server.
            Caller::Verified(p) => {
                if let Ok(v) = p.encode().parse() {
                    md.insert(FORWARDED_FOR_METADATA_KEY, v);
                }
                // A job's process stays one at the leader.
                if let Some((job, attempt)) = ctx.via_job {
                    if let Ok(v) = format!("{job}.{attempt}").parse() {
                        md.insert(FORWARDED_JOB_METADATA_KEY, v);
                    }
                }
            }
        }
        req.set_timeout(crate::shared::FORWARD_TIMEOUT);
        metrics::counter!("gangway_api_forwarded_total").increment(1);
        let mut resp = call(channel, req).await.map_err(|s| {
            if gangway_proto::client::is_transport_failure(&s) && s.code() != tonic::Code::Unavailable {
                Status::unavailable(format!("the leader at {addr} did not answer ({}); retry", s.message()))
            } else {
                s
            }
        })?;
        // The caller goes to the leader directly next time.
        if let Ok(v) = addr.parse() {
            resp.metadata_mut().insert(gangway_proto::LEADER_METADATA_KEY, v);
        }
        Ok(resp)
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
        let name = cmd.name();
        self.limit_writes(ctx, name)?;
        match self.proposer.propose(cmd).await {
            Ok(applied) => {
                // Refusals the state machine makes for lack of permission
                // (another user's job, an admin-only change) are audited too.
                if let gangway_core::Outcome::Refused(r) = &applied.outcome {
                    if r.kind == RefusalKind::PermissionDenied {
                        metrics::counter!("gangway_api_denied_total", "reason" => "permission").increment(1);
                        ctx.audit(name, "denied", &r.message);
                    }
                }
                Ok(Routed::Local(applied))
            }
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
        match self.node.ensure_linearizable(crate::shared::WRITE_TIMEOUT).await {
            Ok(()) => Ok(None),
            Err(ProposeError::NotLeader { leader_addr }) => Ok(Some(self.forward(ctx, leader_addr, msg, call).await?)),
            Err(e) => Err(status_from_propose(e)),
        }
    }
}
