//! Outgoing Raft RPCs over tonic: openraft messages encoded with bincode inside a
//! `RaftPayload`. Connection failures are reported as `Unreachable`, so openraft
//! backs off instead of hammering a dead peer.

use std::time::Duration;

use gangway_proto::v1::raft_service_client::RaftServiceClient;
use gangway_proto::v1::RaftPayload;
use gangway_raft_store::codec::{decode, encode};
use gangway_raft_store::TypeConfig;
use openraft::error::{InstallSnapshotError, NetworkError, RPCError, RaftError, RemoteError, Unreachable};
use openraft::network::{Backoff, RPCOption, RaftNetwork, RaftNetworkFactory};
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse, VoteRequest,
    VoteResponse,
};
use openraft::BasicNode;
use serde::de::DeserializeOwned;
use tonic::transport::Channel;

use super::RAFT_MESSAGE_BYTES_MAX;

/// Pause between attempts to reach an unreachable peer: short, so a restarted
/// replica rejoins quickly; openraft calls this only after a failure.
const UNREACHABLE_BACKOFF: Duration = Duration::from_millis(200);
const CONNECT_TIMEOUT: Duration = Duration::from_secs(1);
/// Entry bytes one append RPC carries (at least one entry, whatever its
/// size). openraft 0.9 gives an append RPC one heartbeat interval (50 ms) to
/// cross, be written, synced and answered, and resends a batch that timed
/// out whole: a follower that fell behind on big entries (64 half-megabyte
/// scripts are 32 MB) would be sent the same batch forever and never catch
/// up. Past this the rest goes in the next RPC (openraft's PartialSuccess).
const APPEND_RPC_BYTES_MAX: usize = 2 << 20;
/// What an entry other than a command weighs here (membership, blank).
const ENTRY_BYTES_OTHER: usize = 256;

/// How many of `entries`, from the first, one append RPC carries: as many as
/// fit in `budget` bytes, and at least one.
pub fn entries_within(entries: &[openraft::Entry<TypeConfig>], budget: usize) -> usize {
    let mut bytes = 0usize;
    for (i, e) in entries.iter().enumerate() {
        bytes = bytes.saturating_add(match &e.payload {
            openraft::EntryPayload::Normal(p) => p.command.as_ref().map_or(p.unread.len(), |c| c.approx_bytes()),
            _ => ENTRY_BYTES_OTHER,
        });
        if bytes > budget {
            return i.max(1);
        }
    }
    entries.len()
}

pub struct Network {
    pub security: gangway_proto::tls::Security,
}

impl RaftNetworkFactory<TypeConfig> for Network {
    type Network = PeerClient;

    async fn new_client(&mut self, target: u64, node: &BasicNode) -> PeerClient {
        // Peers must hold server certificates: a node or user certificate can
        // never receive the log or a vote.
        let expect = gangway_proto::tls::Expect::Server;
        // The peer port when the replica has one (see `ReplicaAddr`).
        let addr = crate::config::ReplicaAddr::peer_of(&node.addr);
        let client = self.security.channel(&addr, expect, CONNECT_TIMEOUT).ok().map(|ch| {
            RaftServiceClient::new(ch)
                .max_decoding_message_size(RAFT_MESSAGE_BYTES_MAX)
                .max_encoding_message_size(RAFT_MESSAGE_BYTES_MAX)
        });
        PeerClient { target, addr, client }
    }
}

pub struct PeerClient {
    target: u64,
    addr: String,
    /// None when the peer's address does not parse (reported on every call).
    client: Option<RaftServiceClient<Channel>>,
}

#[derive(Debug, thiserror::Error)]
#[error("raft RPC to replica {target} at {addr}: {message}")]
struct TransportError {
    target: u64,
    addr: String,
    message: String,
}

impl PeerClient {
    async fn call<Req, Resp, E>(
        &mut self,
        kind: &'static str,
        req: &Req,
        option: &RPCOption,
    ) -> Result<Resp, RPCError<u64, BasicNode, RaftError<u64, E>>>
    where
        Req: serde::Serialize,
        Resp: DeserializeOwned,
        E: std::error::Error + DeserializeOwned,
    {
        let err = |message: String| TransportError { target: self.target, addr: self.addr.clone(), message };
        let Some(client) = self.client.as_mut() else {
            return Err(RPCError::Unreachable(Unreachable::new(&err("address does not parse".into()))));
        };
        let mut request = tonic::Request::new(RaftPayload { data: encode(req) });
        request.set_timeout(option.hard_ttl());
        let started = std::time::Instant::now();
        let response = match kind {
            "append" => client.append_entries(request).await,
            "vote" => client.vote(request).await,
            _ => client.install_snapshot(request).await,
        };
        // The round trip to the peer, its own append and fsync included
        // (etcd's peer round-trip time).
        metrics::histogram!("gangway_raft_rpc_seconds", "rpc" => kind).record(started.elapsed().as_secs_f64());
        let payload = match response {
            Ok(r) => r.into_inner(),
            Err(status) if status.code() == tonic::Code::Unavailable => {
                return Err(RPCError::Unreachable(Unreachable::new(&err(status.message().to_string()))))
            }
            Err(status) => return Err(RPCError::Network(NetworkError::new(&err(status.to_string())))),
        };
        let result: Result<Resp, RaftError<u64, E>> =
            decode(&payload.data).map_err(|e| RPCError::Network(NetworkError::new(&err(e.to_string()))))?;
        result.map_err(|e| RPCError::RemoteError(RemoteError::new(self.target, e)))
    }
}

impl RaftNetwork<TypeConfig> for PeerClient {
    async fn append_entries(
        &mut self,
        mut rpc: AppendEntriesRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<AppendEntriesResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        let keep = entries_within(&rpc.entries, APPEND_RPC_BYTES_MAX);
        let cut = keep < rpc.entries.len();
        rpc.entries.truncate(keep);
        let last = rpc.entries.last().map(|e| e.log_id);
        let answer = self.call("append", &rpc, &option).await?;
        Ok(match answer {
            // The follower has what was sent: the leader sends on from there.
            AppendEntriesResponse::Success if cut => AppendEntriesResponse::PartialSuccess(last),
            other => other,
        })
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<TypeConfig>,
        option: RPCOption,
    ) -> Result<InstallSnapshotResponse<u64>, RPCError<u64, BasicNode, RaftError<u64, InstallSnapshotError>>> {
        self.call("snapshot", &gangway_raft_store::codec::SnapshotChunk::from(rpc), &option).await
    }

    async fn vote(
        &mut self,
        rpc: VoteRequest<u64>,
        option: RPCOption,
    ) -> Result<VoteResponse<u64>, RPCError<u64, BasicNode, RaftError<u64>>> {
        self.call("vote", &rpc, &option).await
    }

    fn backoff(&self) -> Backoff {
        Backoff::new(std::iter::repeat(UNREACHABLE_BACKOFF))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::payload::Payload;

    fn entry(index: u64, script_bytes: usize) -> openraft::Entry<TypeConfig> {
        use gangway_core::JobSpec as Spec;
        let spec = Spec { script: "x".repeat(script_bytes).into(), ..Default::default() };
        let cmd = gangway_core::Command::SubmitJob {
            spec,
            identity: "client:a".into(),
            idempotency_key: String::new(),
            now_ms: 0,
        };
        openraft::Entry {
            log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
            payload: openraft::EntryPayload::Normal(Payload::new(cmd, gangway_core::format::FORMAT_NEWEST)),
        }
    }

    #[test]
    fn an_append_rpc_carries_a_bounded_prefix_and_always_one_entry() {
        let half_mb: Vec<_> = (1..=64).map(|i| entry(i, 512 * 1024)).collect();
        let n = entries_within(&half_mb, APPEND_RPC_BYTES_MAX);
        assert!((2..=4).contains(&n), "{n} half-megabyte entries in one RPC");
        let huge = vec![entry(1, 4 << 20), entry(2, 10)];
        assert_eq!(entries_within(&huge, APPEND_RPC_BYTES_MAX), 1, "one entry over the budget still goes");
        let small: Vec<_> = (1..=64).map(|i| entry(i, 100)).collect();
        assert_eq!(entries_within(&small, APPEND_RPC_BYTES_MAX), 64);
        assert_eq!(entries_within(&[], APPEND_RPC_BYTES_MAX), 0);
    }
}
