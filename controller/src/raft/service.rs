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

#[tonic::async_trait]
impl RaftService for RaftRpc {
    async fn append_entries(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(&req.into_inner().data).map_err(bad_payload)?;
        let result = self.node.raft().append_entries(rpc).await;
        Ok(Response::new(RaftPayload { data: encode(&result) }))
    }

    async fn vote(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(&req.into_inner().data).map_err(bad_payload)?;
        let result = self.node.raft().vote(rpc).await;
        Ok(Response::new(RaftPayload { data: encode(&result) }))
    }

    async fn install_snapshot(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let rpc = decode(&req.into_inner().data).map_err(bad_payload)?;
        let result = self.node.raft().install_snapshot(rpc).await;
        Ok(Response::new(RaftPayload { data: encode(&result) }))
    }
}
