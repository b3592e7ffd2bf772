//! AgentService: node agents register their inventory and send heartbeats.
//! Registration is replicated; heartbeats stay in the leader's memory (only a
//! resulting state change, such as a node going Down, is committed).

use std::sync::Arc;

use gangway_core::{Command, Outcome};
use gangway_proto::v1::agent_service_client::AgentServiceClient;
use gangway_proto::v1::agent_service_server::AgentService;
use gangway_proto::v1::*;
use tonic::{Request, Response, Status};

use super::convert::node_spec_from_proto;
use super::{status_from_spec, unexpected, CallCtx, Routed};
use crate::replica::Replica;

pub struct AgentApi {
    pub replica: Arc<Replica>,
}

#[tonic::async_trait]
impl AgentService for AgentApi {
    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterResponse>, Status> {
        let ctx = CallCtx::of(&req)?;
        let msg = req.into_inner();
        let spec = node_spec_from_proto(msg.clone()).map_err(status_from_spec)?;
        let name = spec.name.clone();
        let cmd = Command::RegisterNode { spec, now_ms: crate::now_ms() };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move { AgentServiceClient::new(ch).register(r).await })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::NodeRegistered { .. } => {
                    self.replica.record_heartbeat(&name);
                    Ok(Response::new(RegisterResponse {
                        heartbeat_interval_ms: self.replica.timing.agent_heartbeat_interval_ms,
                    }))
                }
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn heartbeat(&self, req: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        let ctx = CallCtx::of(&req)?;
        let msg = req.into_inner();
        if !self.replica.node.is_leader() {
            let leader = self.replica.node.remote_leader();
            return self
                .replica
                .forward(&ctx, leader, msg, |ch, r| async move { AgentServiceClient::new(ch).heartbeat(r).await })
                .await;
        }
        let known = self.replica.node.state().read().nodes.contains_key(&msg.name);
        if known {
            self.replica.record_heartbeat(&msg.name);
        }
        Ok(Response::new(HeartbeatResponse { known }))
    }
}
