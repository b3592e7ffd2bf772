//! NodeService: list and inspect nodes, drain and resume them.

use std::sync::Arc;

use gangway_core::{Command, NodeStateChange, Outcome};
use gangway_proto::v1::node_service_client::NodeServiceClient;
use gangway_proto::v1::node_service_server::NodeService;
use gangway_proto::v1::*;
use tonic::{Request, Response, Status};

use super::convert::node_to_proto;
use super::{unexpected, CallCtx, Read, Routed, Viewer};
use crate::shared::Replica;

pub struct NodeApi {
    pub replica: Arc<Replica>,
}

impl NodeApi {
    fn node(&self, state: &gangway_core::State, name: &str, sees: Sees) -> Result<Node, Status> {
        let node = state.nodes.get(name).ok_or_else(|| Status::not_found(format!("node {name} does not exist")))?;
        let resv = state.active_reservations(crate::now_ms());
        let r = resv.get(name).copied();
        let sees = |id: u64| match &sees {
            Sees::All => true,
            Sees::Job(job) => id == *job,
            Sees::Viewer(v) => state.jobs.get(&id).is_some_and(|j| v.visible(j)),
        };
        Ok(shown(node_to_proto(node, self.replica.heartbeat_age_ms(name), r), &sees))
    }

    fn sees(&self, ctx: &CallCtx) -> Sees {
        match self.job_viewer(ctx) {
            None => Sees::All,
            Some(v) => Sees::Viewer(v),
        }
    }

    /// Whose jobs `ctx` may see on nodes: `None` for everyone's.
    fn job_viewer(&self, ctx: &CallCtx) -> Option<Viewer> {
        (!self.sees_jobs(ctx)).then(|| self.replica.viewer(ctx))
    }

    /// Whether `ctx` sees which jobs run where: with private jobs, only
    /// operators, admins and servers do.
    fn sees_jobs(&self, ctx: &CallCtx) -> bool {
        !self.replica.private_jobs() || self.replica.is_operator(ctx)
    }

    async fn set_state(
        &self,
        ctx: CallCtx,
        name: String,
        change: NodeStateChange,
        reason: String,
        forward_msg: Forward,
    ) -> Result<Response<Node>, Status> {
        if name.is_empty() {
            return Err(Status::invalid_argument("name: must not be empty"));
        }
        let cmd = Command::SetNodeState { name: name.clone(), change, reason, now_ms: crate::now_ms() };
        let routed = match forward_msg {
            Forward::Drain(m) => {
                self.replica
                    .write_or_forward(&ctx, cmd, m, |ch, r| async move { NodeServiceClient::new(ch).drain(r).await })
                    .await?
            }
            Forward::Resume(m) => {
                self.replica
                    .write_or_forward(&ctx, cmd, m, |ch, r| async move { NodeServiceClient::new(ch).resume(r).await })
                    .await?
            }
            Forward::Power(m) => {
                self.replica
                    .write_or_forward(&ctx, cmd, m, |ch, r| async move { NodeServiceClient::new(ch).power(r).await })
                    .await?
            }
        };
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::NodeStateSet { .. } => {
                    let state = self.replica.fresh_view().await?;
                    Ok(Response::new(self.node(&state, &name, Sees::All)?))
                }
                other => Err(unexpected(&other)),
            },
        }
    }
}

/// A node with only the jobs the caller may see: the others are left out of
/// its job list and not named on the GPUs they hold (which still show as
/// allocated).
fn shown(mut n: Node, sees: &dyn Fn(u64) -> bool) -> Node {
    n.jobs.retain(|j| sees(*j));
    for g in &mut n.gpus {
        if g.allocated_to.is_some_and(|j| !sees(j)) {
            g.allocated_to = None;
        }
    }
    n
}

/// Whose jobs a caller sees on nodes.
enum Sees {
    All,
    /// A job's process, through its step credential: its own job's.
    Job(u64),
    Viewer(Viewer),
}

enum Forward {
    Drain(DrainRequest),
    Resume(ResumeRequest),
    Power(PowerRequest),
}

#[tonic::async_trait]
impl NodeService for NodeApi {
    async fn list(&self, req: Request<ListNodesRequest>) -> Result<Response<ListNodesResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        let after_name = msg.after_name.clone();
        if after_name.len() > gangway_core::limits::NAME_BYTES_MAX {
            return Err(Status::invalid_argument(format!(
                "after_name: at most {} bytes (no node has a longer name)",
                gangway_core::limits::NAME_BYTES_MAX
            )));
        }
        let state = match self
            .replica
            .read_or_forward(&ctx, msg.stale, msg, |ch, r| async move { NodeServiceClient::new(ch).list(r).await })
            .await?
        {
            Read::Here(view) => view,
            Read::Forwarded(resp) => return Ok(resp),
        };
        let viewer = self.job_viewer(&ctx);
        let sees = |id: u64| viewer.as_ref().is_none_or(|v| state.jobs.get(&id).is_some_and(|j| v.visible(j)));
        // Paged by size, in name order: the answer stays under every client's
        // receive limit however many nodes the cluster has.
        let (mut nodes, mut budget, mut next_after_name) =
            (Vec::new(), gangway_proto::limits::PageBudget::list(), String::new());
        let from = std::ops::Bound::Excluded(after_name.clone());
        let range = if after_name.is_empty() {
            state.nodes.range::<String, _>(..)
        } else {
            state.nodes.range::<String, _>((from, std::ops::Bound::Unbounded))
        };
        let resv = state.active_reservations(crate::now_ms());
        for n in range.map(|(_, n)| n) {
            let r = resv.get(n.name.as_str()).copied();
            let pn = shown(node_to_proto(n, self.replica.heartbeat_age_ms(&n.name), r), &sees);
            if !budget.take(prost::Message::encoded_len(&pn)) {
                next_after_name = nodes.last().map(|p: &Node| p.name.clone()).unwrap_or_default();
                break;
            }
            nodes.push(pn);
        }
        self.replica.charge_read(&ctx, crate::ratelimit::read_units(nodes.len(), budget.used()));
        Ok(Response::new(ListNodesResponse { nodes, next_after_name }))
    }

    async fn get(&self, req: Request<GetNodeRequest>) -> Result<Response<Node>, Status> {
        // srun inside a job asks where a node of its job's step service is now
        // (after that node's agent restarted): its step credential suffices
        // for the nodes it names, served from this replica's state.
        if let Some(claims) = self.replica.step_caller(&req)? {
            let name = req.into_inner().name;
            if !claims.nodes.iter().any(|n| n == &name) {
                return Err(Status::permission_denied(format!(
                    "permission: the step credential of job {} does not name node {name}",
                    claims.job_id
                )));
            }
            // Its own job's placement is what it asks for; the policy's
            // private jobs hide everyone else's.
            let sees = if self.replica.private_jobs() { Sees::Job(claims.job_id) } else { Sees::All };
            return Ok(Response::new(self.node(&self.replica.node.state().read(), &name, sees)?));
        }
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        let name = msg.name.clone();
        let state = match self
            .replica
            .read_or_forward(&ctx, msg.stale, msg, |ch, r| async move { NodeServiceClient::new(ch).get(r).await })
            .await?
        {
            Read::Here(view) => view,
            Read::Forwarded(resp) => return Ok(resp),
        };
        self.replica.charge_read(&ctx, crate::ratelimit::READ_BASE_UNITS);
        Ok(Response::new(self.node(&state, &name, self.sees(&ctx))?))
    }

    async fn drain(&self, req: Request<DrainRequest>) -> Result<Response<Node>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_operator(&ctx, "drain nodes")?;
        let msg = req.into_inner();
        let reason = if msg.reason.is_empty() { format!("drained by {}", ctx.identity) } else { msg.reason.clone() };
        self.set_state(ctx, msg.name.clone(), NodeStateChange::Drain, reason, Forward::Drain(msg)).await
    }

    async fn resume(&self, req: Request<ResumeRequest>) -> Result<Response<Node>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_operator(&ctx, "resume nodes")?;
        let msg = req.into_inner();
        self.set_state(ctx, msg.name.clone(), NodeStateChange::Resume, String::new(), Forward::Resume(msg)).await
    }

    async fn power(&self, req: Request<PowerRequest>) -> Result<Response<Node>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_operator(&ctx, "power nodes up and down")?;
        let msg = req.into_inner();
        let (change, verb) =
            if msg.up { (NodeStateChange::PowerUp, "up") } else { (NodeStateChange::PowerDown, "down") };
        let reason =
            if msg.reason.is_empty() { format!("powered {verb} by {}", ctx.identity) } else { msg.reason.clone() };
        if reason.len() > gangway_core::limits::REASON_BYTES_MAX {
            return Err(Status::invalid_argument(format!(
                "reason: at most {} bytes",
                gangway_core::limits::REASON_BYTES_MAX
            )));
        }
        self.set_state(ctx, msg.name.clone(), change, reason, Forward::Power(msg)).await
    }
}
