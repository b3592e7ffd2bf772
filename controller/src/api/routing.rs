//! Routing: where a call is served. A write is proposed on this replica and,
//! when it is not the leader, the original request is forwarded once to the
//! leader with the caller's verified identity; a read is served here when it
//! may be (stale, or this replica leads and confirmed it with a quorum) and
//! forwarded otherwise. A forwarded request is never forwarded again.

use std::future::Future;
use std::sync::Arc;

use gangway_core::RefusalKind;
use gangway_proto::{FORWARDED_FOR_METADATA_KEY, IDENTITY_METADATA_KEY};
use tonic::transport::Channel;
use tonic::{Request, Response, Status};

use gangway_proto::tls::Role;
use gangway_raft_store::View;

use super::{status_from_propose, CallCtx, Caller, FORWARDED_JOB_METADATA_KEY, FORWARDED_METADATA_KEY};
use crate::raft::ProposeError;
use crate::ratelimit::RETRY_AFTER_METADATA_KEY;
use crate::shared::Replica;

/// Where a call was served.
pub enum Routed<T, R> {
    Local(T),
    Forwarded(Response<R>),
}

/// Where a read is served: here, from this view, or by the leader.
pub enum Read<R> {
    Here(Arc<View>),
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
        // A caller's forwards in flight from this replica are bounded: the
        // connection to the leader is everyone's.
        let _forwarding = match &ctx.caller {
            Caller::Verified(p) if p.role == Role::Server => None,
            _ => Some(self.forwards.try_take(&ctx.identity).ok_or_else(|| {
                metrics::counter!("gangway_api_denied_total", "reason" => "busy").increment(1);
                let mut s = Status::resource_exhausted(format!(
                    "{} already has {} calls on their way to the leader from this replica; retry in a moment",
                    ctx.identity,
                    crate::shared::FORWARDS_PER_CALLER_MAX
                ));
                if let Ok(v) = "50".parse() {
                    s.metadata_mut().insert(RETRY_AFTER_METADATA_KEY, v);
                }
                s
            })?),
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
        self.limit_writes(ctx, name, cmd.approx_bytes())?;
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

    /// For a read: the view to serve it from here (a stale read: the newest
    /// published view; otherwise, as leader, one that includes everything
    /// committed before the call), or the leader's answer. The caller's read
    /// budget must not be empty (see [`Replica::admit_read`]); the handler
    /// charges what the read did ([`Replica::charge_read`]).
    pub async fn read_or_forward<M, R, F, Fut>(
        &self,
        ctx: &CallCtx,
        stale: bool,
        msg: M,
        call: F,
    ) -> Result<Read<R>, Status>
    where
        F: FnOnce(Channel, Request<M>) -> Fut,
        Fut: Future<Output = Result<Response<R>, Status>>,
    {
        self.admit_read(ctx)?;
        if stale {
            return Ok(Read::Here(self.node.state().read()));
        }
        match self.node.ensure_linearizable(crate::shared::WRITE_TIMEOUT).await {
            Ok(()) => Ok(Read::Here(self.fresh_view().await?)),
            Err(ProposeError::NotLeader { leader_addr }) => {
                // The leader does the work and charges it.
                if Self::reads_budgeted(ctx) {
                    self.reads.refund(&ctx.identity, std::time::Instant::now());
                }
                Ok(Read::Forwarded(self.forward(ctx, leader_addr, msg, call).await?))
            }
            Err(e) => Err(status_from_propose(e)),
        }
    }

    /// A view that includes everything this replica had applied when called:
    /// what a handler reads after its own write was applied here.
    pub async fn fresh_view(&self) -> Result<Arc<View>, Status> {
        self.node.state().read_fresh().await.map_err(|e| Status::unavailable(e.to_string()))
    }

    /// Whether reads by `ctx` are charged to a budget: everyone's but the
    /// cluster's own (replicas, agents).
    fn reads_budgeted(ctx: &CallCtx) -> bool {
        match &ctx.caller {
            Caller::Claimed(_) => true,
            // An agent reading users' services (not its own heartbeats) is
            // charged like anyone: a node's certificate is no free pass.
            Caller::Verified(p) => p.role != Role::Server,
        }
    }

    /// Lets a read in while its caller's read budget is not empty, or
    /// refuses it with RESOURCE_EXHAUSTED and when to retry.
    pub fn admit_read(&self, ctx: &CallCtx) -> Result<(), Status> {
        if !Self::reads_budgeted(ctx) {
            return Ok(());
        }
        let Err(wait) = self.reads.admit(&ctx.identity, std::time::Instant::now()) else { return Ok(()) };
        metrics::counter!("gangway_api_denied_total", "reason" => "read_budget").increment(1);
        let (rate, burst) = self.reads.rate();
        let ms = wait.as_millis().max(1);
        let mut s = Status::resource_exhausted(format!(
            "read budget: {} may spend {rate} read units per second on this replica (a full bucket holds \
             {burst}; a unit is a job or node looked at, or 128 bytes answered); retry in {ms} ms",
            ctx.identity
        ));
        if let Ok(v) = ms.to_string().parse() {
            s.metadata_mut().insert(RETRY_AFTER_METADATA_KEY, v);
        }
        Err(s)
    }

    /// Runs a read's work on the read lane (`lanes::ReadPool`) over the
    /// newest view when the work starts (never older than one the caller
    /// was given: views only move forward, so a read waiting for its turn
    /// holds none), and charges `ctx` the units `work` says it spent. `hold`
    /// (an analysis permit) is held by the work until it ends.
    pub async fn on_read_lane<T, H, F>(
        self: &Arc<Self>,
        ctx: &CallCtx,
        what: &str,
        hold: H,
        work: F,
    ) -> Result<T, Status>
    where
        T: Send + 'static,
        H: Send + 'static,
        F: FnOnce(&View) -> (T, u64) + Send + 'static,
    {
        let (replica, caller) = (self.clone(), ctx.clone());
        let ran = self
            .read_pool
            .run(&ctx.identity, what, hold, move || {
                let view = replica.node.state().read();
                let (out, units) = work(&view);
                replica.charge_read(&caller, units);
                out
            })
            .await;
        match ran {
            // Refused by the lane (the caller's places, or the queue, all
            // taken): come back at a turn in the caller's line, so that a
            // thousand pollers refused together do not return together.
            Err(mut s) if s.code() == tonic::Code::ResourceExhausted && Self::reads_budgeted(ctx) => {
                let turn = self.reads.turn(&ctx.identity, std::time::Instant::now());
                let lane = gangway_proto::client::retry_after(&s).map_or(0, |d| d.as_millis());
                if let Ok(v) = turn.as_millis().max(lane).to_string().parse() {
                    s.metadata_mut().insert(RETRY_AFTER_METADATA_KEY, v);
                }
                Err(s)
            }
            other => other,
        }
    }

    /// Charges `units` of read work to `ctx`'s budget.
    pub fn charge_read(&self, ctx: &CallCtx, units: u64) {
        if Self::reads_budgeted(ctx) {
            metrics::counter!("gangway_read_units_total").increment(units);
            self.reads.charge(&ctx.identity, units, std::time::Instant::now());
        }
    }
}
