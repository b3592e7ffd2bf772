//! Incoming Raft RPCs: decode, hand to openraft, encode the result (including
//! openraft's own errors, which the sender turns back into `RemoteError`).

use std::sync::Arc;

use gangway_proto::v1::raft_service_server::RaftService;
use gangway_proto::v1::RaftPayload;
use gangway_raft_store::codec::{decode, encode};
use tonic::{Request, Response, Status};

use super::RaftNode;
use crate::audit::AuditLog;

pub struct RaftRpc {
    pub node: Arc<RaftNode>,
    pub audit: Arc<crate::audit::AuditLog>,
}

fn bad_payload(e: impl std::fmt::Display) -> Status {
    Status::invalid_argument(format!("raft payload does not decode: {e}"))
}

/// Only controller replicas (server certificates) take part in Raft: an agent
/// or user certificate could otherwise vote, append entries or install a
/// snapshot.
fn require_server<T>(req: &Request<T>, node: &RaftNode, audit: &AuditLog) -> Result<Option<String>, Status> {
    use gangway_proto::tls::{PeerAuth, Role};
    match gangway_proto::tls::peer_of(req) {
        PeerAuth::Insecure => Ok(None),
        PeerAuth::Verified(p) if p.role == Role::Server && !node.admits_server(&p.name) => {
            metrics::counter!("gangway_api_denied_total", "reason" => "unauthenticated").increment(1);
            audit.record_refused(&p.encode(), "raft", "unauthenticated", "not a member of this cluster");
            Err(Status::unauthenticated(format!(
                "{p} is not a member of this cluster: a removed replica's certificate opens nothing"
            )))
        }
        PeerAuth::Verified(p) if p.role == Role::Server => Ok(Some(p.name)),
        PeerAuth::Verified(p) => {
            metrics::counter!("gangway_api_denied_total", "reason" => "permission").increment(1);
            audit.record_refused(&p.encode(), "raft", "denied", "not a controller replica");
            Err(Status::permission_denied(format!("permission: {p} is not a controller replica; Raft is for servers")))
        }
        PeerAuth::Anonymous | PeerAuth::Unusable(_) => {
            metrics::counter!("gangway_api_denied_total", "reason" => "unauthenticated").increment(1);
            let ip = req.extensions().get::<gangway_proto::tls::PeerInfo>().and_then(|p| p.remote).map(|a| a.ip());
            audit.record_anonymous(ip, "raft", "unauthenticated", "no server certificate");
            Err(Status::unauthenticated("Raft needs a server certificate signed by the cluster's CA"))
        }
    }
}

/// An encoded vote request from `candidate` at `term`, as a replica sends it:
/// for tests that check who may send what (and tools probing a replica).
pub fn encoded_vote_request(candidate: u64, term: u64) -> Vec<u8> {
    encode(&openraft::raft::VoteRequest::new(openraft::Vote::new(term, candidate), None))
}

/// A replica's certificate speaks only for that replica: the sender a Raft
/// message names must be the id in the certificate it came with.
fn same_replica(cert: Option<String>, claimed: Option<u64>, audit: &AuditLog) -> Result<(), Status> {
    let Some(cert) = cert else { return Ok(()) };
    if claimed.map(|id| id.to_string()) == Some(cert.clone()) {
        return Ok(());
    }
    metrics::counter!("gangway_api_denied_total", "reason" => "permission").increment(1);
    let target = claimed.map_or_else(|| "none".to_string(), |c| format!("replica {c}"));
    let server = format!("server:{cert}");
    audit.record_denied(
        &server,
        &server,
        "raft as another replica",
        &target,
        "denied",
        "sender id differs from the certificate's",
    );
    Err(Status::permission_denied(format!(
        "permission: server {cert}'s certificate cannot send Raft messages as replica {}",
        claimed.map_or_else(|| "none".to_string(), |c| c.to_string())
    )))
}

#[tonic::async_trait]
impl RaftService for RaftRpc {
    async fn append_entries(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let sender = require_server(&req, &self.node, &self.audit)?;
        let rpc: openraft::raft::AppendEntriesRequest<gangway_raft_store::TypeConfig> =
            decode(&req.into_inner().data).map_err(bad_payload)?;
        same_replica(sender, rpc.vote.leader_id().voted_for(), &self.audit)?;
        let started = std::time::Instant::now();
        let result = self.node.raft().append_entries(rpc).await;
        // A follower's part of a replication round: its append and fsync.
        metrics::histogram!("gangway_raft_append_handled_seconds").record(started.elapsed().as_secs_f64());
        Ok(Response::new(RaftPayload { data: encode(&result) }))
    }

    async fn vote(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let sender = require_server(&req, &self.node, &self.audit)?;
        let rpc: openraft::raft::VoteRequest<u64> = decode(&req.into_inner().data).map_err(bad_payload)?;
        same_replica(sender, rpc.vote.leader_id().voted_for(), &self.audit)?;
        let result = self.node.raft().vote(rpc).await;
        Ok(Response::new(RaftPayload { data: encode(&result) }))
    }

    async fn install_snapshot(&self, req: Request<RaftPayload>) -> Result<Response<RaftPayload>, Status> {
        let sender = require_server(&req, &self.node, &self.audit)?;
        let rpc: openraft::raft::InstallSnapshotRequest<gangway_raft_store::TypeConfig> =
            decode::<gangway_raft_store::codec::SnapshotChunk>(&req.into_inner().data).map_err(bad_payload)?.into();
        same_replica(sender, rpc.vote.leader_id().voted_for(), &self.audit)?;
        let result = self.node.raft().install_snapshot(rpc).await;
        Ok(Response::new(RaftPayload { data: encode(&result) }))
    }
}
