//! Incoming Raft RPCs: decode, hand to openraft, encode the result (including
//! openraft's own errors, which the sender turns back into `RemoteError`).

use std::sync::Arc;

use gangway_proto::v1::raft_service_server::RaftService;
use gangway_proto::v1::RaftPayload;
use gangway_raft_store::codec::{decode, encode};
use tonic::{Request, Response, Status};

use super::RaftNode;

pub struct RaftRpc {
    pub node: Arc<RaftNode>,
}

fn bad_payload(e: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("raft payload does not decode: {e}"))
}

/// Only controller replicas (server certificates) take part in Raft: an agent
/// or user certificate could otherwise vote, append entries or install a
/// snapshot.
fn require_server<T>(req: &Request<T>) -> Result<(), Status> {
    use gangway_proto::tls::{PeerAuth, Role};
    match gangway_proto::tls::peer_of(req) {
        PeerAuth::Insecure => Ok(()),
        PeerAuth::Verified(p) if p.role == Role::Server => Ok(()),
        PeerAuth::Verified(p) => {
            metrics::counter!("gangway_api_denied_total", "reason" => "permission").increment(1);
            tracing::warn!(target: "gangway::audit", caller = %p, action = "raft", outcome = "denied");
            Err(Status::permission_denied(format!("permission: {p} is not a controller replica; Raft is for servers")))
        }
        PeerAuth::Anonymous | PeerAuth::Unusable(_) => {
            metrics::counter!("gangway_api_denied_total", "reason" => "unauthenticated").increment(1);
            Err(Status::unauthenticated("Raft needs a server certificate signed by the cluster's CA"))
        }
    }
}

#[tonic::async_trait]
impl RaftService for RaftRpc {
    async fn append_entries(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        require_server(&req)?;
        let rpc = decode(&req.into_inner().data).map_err(bad_payload)?;
        let result = self.node.raft().append_entries(rpc).await;
        Ok(Response::new(RaftPayload { data: encode(&result) }))
    }

    async fn vote(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        require_server(&req)?;
        let rpc = decode(&req.into_inner().data).map_err(bad_payload)?;
        let result = self.node.raft().vote(rpc).await;
        Ok(Response::new(RaftPayload { data: encode(&result) }))
    }

    async fn install_snapshot(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        require_server(&req)?;
        let rpc = decode(&req.into_inner().data).map_err(bad_payload)?;
        let result = self.node.raft().install_snapshot(rpc).await;
        Ok(Response::new(RaftPayload { data: encode(&result) }))
    }
}
