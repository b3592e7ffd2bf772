//! One controller replica, wired: opens its store, starts Raft, serves the gRPC
//! API (plus health and reflection) on one port and Raft there or on a peer
//! port of its own, forms the cluster on first
//! start, and runs leader duties while it leads. Nothing imports this module
//! but the crate root; what the parts share is `shared.rs`.

use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;

use anyhow::Context;
use gangway_proto::limits::{AGENT_MESSAGE_BYTES_MAX, API_REQUEST_BYTES_MAX, API_RESPONSE_BYTES_MAX};
use gangway_proto::v1::admin_service_server::AdminServiceServer;
use gangway_proto::v1::agent_service_server::AgentServiceServer;
use gangway_proto::v1::job_service_server::JobServiceServer;
use gangway_proto::v1::node_service_server::NodeServiceServer;
use gangway_proto::v1::raft_service_server::RaftServiceServer;
use tokio::net::TcpListener;
use tokio::sync::oneshot;
use tokio::task::JoinHandle;
use tonic::transport::Server;

use crate::api::{admin::AdminApi, agent::AgentApi, jobs::JobApi, nodes::NodeApi};
use crate::config::ReplicaConfig;
use crate::raft::service::RaftRpc;
use crate::raft::{RaftNode, RAFT_MESSAGE_BYTES_MAX};
use crate::shared::Replica;

/// Opening the store retries while a previous instance in this process (a test
/// restarting a replica) still holds RocksDB's lock: 50 × 100 ms.
const STORE_OPEN_ATTEMPTS_MAX: usize = 50;
/// The pause between those attempts.
const STORE_OPEN_PAUSE: Duration = Duration::from_millis(100);
/// HTTP/2 streams (calls) one connection may have open at once. A
/// follower forwards its clients' writes over one connection and an agent
/// holds two; 256 leaves room for bursts, and bounds what one connection can
/// make the replica hold (each stream a task and its buffers).
pub const H2_STREAMS_PER_CONNECTION_MAX: u32 = 256;
/// Bytes of headers one request may carry, counted as HTTP/2 counts them
/// (name, value and 32 per field), less one: a list that reaches this is
/// answered 431. A bearer token or a step credential is a kilobyte or two
/// (hyper would take 16 MiB).
pub const H2_HEADER_LIST_BYTES_MAX: u32 = 64 * 1024;
/// Streams a client may open and reset before their handler ran, per
/// connection (the HTTP/2 "rapid reset" flood); past it the connection closes.
pub const H2_PENDING_RESETS_MAX: usize = 64;
/// How often the replica pings a connection's peer, and how long it waits
/// for the answer before closing it: a peer that vanished without closing
/// (a host that died, a cut cable) gives its connection back within a minute.
pub const H2_PING_INTERVAL: Duration = Duration::from_secs(30);
pub const H2_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// A gRPC server's task.
type ServerTask = JoinHandle<Result<(), tonic::transport::Error>>;

/// A running replica; `shutdown` stops it and releases its data dir.
pub struct ReplicaHandle {
    pub replica: Arc<Replica>,
    pub local_addr: SocketAddr,
    shutdown_tx: Option<oneshot::Sender<()>>,
    server: ServerTask,
    /// The peer port's server (Raft only), when the replica has one.
    peer_server: Option<(oneshot::Sender<()>, ServerTask)>,
    leader_watch: JoinHandle<()>,
    fatal_watch: JoinHandle<()>,
    /// Set when Raft stopped on a fatal error (the replica then says
    /// NOT_SERVING and [`ReplicaHandle::wait`] returns the error).
    fatal: tokio::sync::watch::Receiver<Option<String>>,
}

impl ReplicaHandle {
    pub async fn shutdown(mut self) {
        self.replica.close();
        self.leader_watch.abort();
        self.fatal_watch.abort();
        if let Some(tx) = self.shutdown_tx.take() {
            let _ = tx.send(());
        }
        let mut peer = self.peer_server.take().map(|(tx, task)| {
            let _ = tx.send(());
            task
        });
        self.replica.node.shutdown().await;
        // Open streams (watchers) would keep a graceful stop waiting: bound it.
        let servers = async {
            let _ = (&mut self.server).await;
            if let Some(p) = peer.as_mut() {
                let _ = p.await;
            }
        };
        let _ = tokio::time::timeout(Duration::from_secs(2), servers).await;
        self.server.abort();
        if let Some(p) = peer {
            p.abort();
        }
    }

    /// Waits until the server stops (it runs until `shutdown`), or until Raft
    /// stopped on a fatal error: a replica that cannot apply or store entries
    /// must not go on answering (its supervisor restarts it, or an operator
    /// replaces its data), so that is returned as an error.
    pub async fn wait(&mut self) -> anyhow::Result<()> {
        let mut fatal = self.fatal.clone();
        let peer = async {
            match &mut self.peer_server {
                Some((_, peer)) => peer.await,
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            r = &mut self.server => r.context("server task")?.context("gRPC server"),
            r = peer => {
                r.context("peer server task")?.context("gRPC server on the peer port")?;
                // It ends only when told to: an end now is a failure.
                anyhow::bail!("the peer port's server stopped (its listener failed)")
            }
            why = fatal.wait_for(Option::is_some) => {
                let why = why.map(|w| w.clone().unwrap_or_default()).unwrap_or_default();
                anyhow::bail!("this replica stopped on a fatal error and must be restarted: {why}")
            }
        }
    }

    /// The fatal error Raft stopped on, if it did.
    pub fn fatal_error(&self) -> Option<String> {
        self.fatal.borrow().clone()
    }
}

/// Writes a backup's state into the (empty) data directory as a member of a
/// new cluster of the configured peers.
fn seed_from_backup(config: &ReplicaConfig, file: &std::path::Path) -> anyhow::Result<()> {
    let bytes = std::fs::read(file).with_context(|| format!("restore: reading {}", file.display()))?;
    let backup = gangway_raft_store::backup::Backup::from_bytes(&bytes)
        .map_err(|e| anyhow::anyhow!("restore: {}: {e}", file.display()))?;
    if !config.peers.contains_key(&config.id) {
        anyhow::bail!("restore: --peers must include this replica's own id {}", config.id);
    }
    let restored = gangway_raft_store::backup::restore(&config.data_dir, &backup, &config.peers)
        .map_err(|e| anyhow::anyhow!("restore: {e}; once seeded, start the replica without --restore"))?;
    tracing::warn!(
        file = %file.display(),
        index = backup.index,
        taken_by = backup.taken_by,
        peers = ?config.peers,
        history = restored.history,
        next_job_id = restored.next_job_id,
        unaccounted_finished_jobs = restored.unaccounted,
        "restored from a backup: this replica starts a new cluster with the backup's state, in a history of its \
         own (an accounting service following the lost cluster stores every job this state holds again, and \
         follows the new history's events from there; jobs the lost cluster ran after the backup are only in \
         the accounting store)"
    );
    Ok(())
}

/// Blocks (between attempts, and in RocksDB): call it off the async workers.
fn open_store(dir: &std::path::Path) -> anyhow::Result<gangway_raft_store::Stores> {
    std::fs::create_dir_all(dir).with_context(|| format!("creating data dir {}", dir.display()))?;
    let mut last = None;
    for _ in 0..STORE_OPEN_ATTEMPTS_MAX {
        match gangway_raft_store::open(dir) {
            Ok(s) => return Ok(s),
            Err(e) if e.to_string().contains("lock") => {
                last = Some(e);
                std::thread::sleep(STORE_OPEN_PAUSE);
            }
            Err(e) => return Err(e.into()),
        }
    }
    let last = last.map_or_else(|| "no attempt made".to_string(), |e| e.to_string());
    anyhow::bail!("data dir {}: still locked after {STORE_OPEN_ATTEMPTS_MAX} attempts: {last}", dir.display())
}

/// A gRPC server with the limits every replica listener has: streams per
/// connection, header bytes, resets, and pings to find vanished peers.
fn server_builder() -> Server {
    Server::builder()
        .tcp_nodelay(true)
        .max_concurrent_streams(H2_STREAMS_PER_CONNECTION_MAX)
        .http2_max_header_list_size(H2_HEADER_LIST_BYTES_MAX)
        .http2_max_pending_accept_reset_streams(Some(H2_PENDING_RESETS_MAX))
        .http2_keepalive_interval(Some(H2_PING_INTERVAL))
        .http2_keepalive_timeout(Some(H2_PING_TIMEOUT))
}

/// Starts a replica serving everything, Raft included, on `listener`.
pub async fn start(config: ReplicaConfig, listener: TcpListener) -> anyhow::Result<ReplicaHandle> {
    start_with_peer_port(config, listener, None).await
}

/// Starts a replica serving its API on `listener` and, when given, Raft on
/// `peer` alone: a port whose TLS handshake fails without a client
/// certificate and that closes every connection not a replica's before a
/// byte of a request is read, served on Raft's own runtime. Its advertised
/// address must name the peer port (`HOST:PORT/PEERPORT`, see
/// `config::ReplicaAddr`) exactly when it has one.
pub async fn start_with_peer_port(
    config: ReplicaConfig,
    listener: TcpListener,
    peer: Option<TcpListener>,
) -> anyhow::Result<ReplicaHandle> {
    crate::telemetry::describe();
    let local_addr = listener.local_addr()?;
    let advertised =
        crate::config::ReplicaAddr::parse(&config.advertise_addr).map_err(|e| anyhow::anyhow!("advertise: {e}"))?;
    match (&peer, advertised.split) {
        (Some(_), false) => anyhow::bail!(
            "advertise: '{}' names no peer port, but this replica has one (--peer-listen): use HOST:PORT/PEERPORT",
            config.advertise_addr
        ),
        (None, true) => anyhow::bail!(
            "advertise: '{}' names a peer port, but this replica listens on none: give --peer-listen",
            config.advertise_addr
        ),
        _ => {}
    }
    // A new cluster's membership is --peers: this replica's entry must say
    // what it listens on, or its peers would send Raft where it is not served.
    if let Some(mine) = config.peers.get(&config.id).filter(|_| !config.join) {
        let mine = crate::config::ReplicaAddr::parse(mine).map_err(|e| anyhow::anyhow!("peers: {e}"))?;
        if mine.split != advertised.split || (mine.split && mine.peer != advertised.peer) {
            anyhow::bail!(
                "peers: replica {}'s address '{}' and --advertise '{}' must name the same peer port (or none)",
                config.id,
                mine.format(),
                config.advertise_addr
            );
        }
    }
    if let Some(file) = &config.restore {
        seed_from_backup(&config, file)?;
    }
    let dir = config.data_dir.clone();
    let stores = tokio::task::spawn_blocking(move || open_store(&dir)).await.context("opening the store")??;
    let node = Arc::new(RaftNode::start(config.id, config.timing.clone(), stores, config.security.clone()).await?);
    let replica = Arc::new(Replica::new(node.clone(), &config));

    let (mut health_reporter, health_service) = tonic_health::server::health_reporter();
    health_reporter.set_serving::<JobServiceServer<JobApi>>().await;
    health_reporter.set_serving::<NodeServiceServer<NodeApi>>().await;
    health_reporter.set_serving::<AdminServiceServer<AdminApi>>().await;
    health_reporter.set_serving::<AgentServiceServer<AgentApi>>().await;
    let reflection_v1 = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(gangway_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1()?;
    let reflection_v1alpha = tonic_reflection::server::Builder::configure()
        .register_encoded_file_descriptor_set(gangway_proto::FILE_DESCRIPTOR_SET)
        .register_encoded_file_descriptor_set(tonic_health::pb::FILE_DESCRIPTOR_SET)
        .build_v1alpha()?;

    let (shutdown_tx, shutdown_rx) = oneshot::channel::<()>();
    let mut gate = crate::admission::Gate::new(
        config.security.clone(),
        config.tokens.clone(),
        replica.audit.clone(),
        node.state().clone(),
    );
    if peer.is_some() {
        let node = node.clone();
        gate = gate.raft_elsewhere(move || node.membership_names_peer_port());
    }
    {
        let node = node.clone();
        gate = gate.members(move |name| node.admits_server(name));
    }
    let raft_service = || {
        RaftServiceServer::new(RaftRpc { node: node.clone(), audit: replica.audit.clone() })
            .max_decoding_message_size(RAFT_MESSAGE_BYTES_MAX)
            .max_encoding_message_size(RAFT_MESSAGE_BYTES_MAX)
    };
    let router = server_builder()
        // Every request meets the gate before its body is read.
        .layer(crate::admission::GateLayer(Arc::new(gate)))
        .add_service(health_service)
        .add_service(reflection_v1)
        .add_service(reflection_v1alpha)
        .add_service(raft_service())
        .add_service(
            JobServiceServer::new(JobApi { replica: replica.clone() })
                .max_decoding_message_size(API_REQUEST_BYTES_MAX)
                .max_encoding_message_size(API_RESPONSE_BYTES_MAX),
        )
        .add_service(
            NodeServiceServer::new(NodeApi { replica: replica.clone() })
                .max_decoding_message_size(API_REQUEST_BYTES_MAX)
                .max_encoding_message_size(API_RESPONSE_BYTES_MAX),
        )
        .add_service(
            AdminServiceServer::new(AdminApi { replica: replica.clone() })
                .max_decoding_message_size(API_REQUEST_BYTES_MAX)
                .max_encoding_message_size(API_RESPONSE_BYTES_MAX),
        )
        .add_service(
            AgentServiceServer::new(AgentApi { replica: replica.clone(), templates: Default::default() })
                .max_decoding_message_size(AGENT_MESSAGE_BYTES_MAX)
                .max_encoding_message_size(AGENT_MESSAGE_BYTES_MAX),
        );
    // Our own listener (bound by the caller) bypasses the builder's TCP options:
    // set TCP_NODELAY here, or Nagle plus delayed ACKs add tens of milliseconds to
    // every Raft round trip and response.
    if config.security.is_insecure() {
        tracing::warn!(
            "INSECURE: this replica serves plaintext gRPC and believes whoever callers say they are \
             (--insecure); anyone who can reach {local_addr} controls the cluster and runs jobs as any user"
        );
    }
    let incoming =
        gangway_proto::tls::incoming_gated(listener, &config.security).map_err(|e| anyhow::anyhow!("TLS: {e}"))?;
    let server = tokio::spawn(router.serve_with_incoming_shutdown(incoming, async {
        let _ = shutdown_rx.await;
    }));
    let peer_server = match peer {
        None => None,
        Some(listener) => {
            let (tx, rx) = oneshot::channel::<()>();
            let peer_router = server_builder().add_service(raft_service());
            tracing::info!(addr = ?listener.local_addr().ok(), "serving Raft on the peer port");
            // Accepted and handshaken here (anyone may try a handshake: that
            // work stays off Raft's runtime); replicas' connections are
            // served on Raft's runtime.
            let incoming = gangway_proto::tls::incoming_peer(listener, &config.security)
                .map_err(|e| anyhow::anyhow!("TLS (peer port): {e}"))?;
            if !node.membership_names_peer_port() && node.is_initialized().await {
                tracing::warn!(
                    "this replica has a peer port, but the cluster's membership still sends its Raft messages to its API \
                     port (which keeps taking them from replicas): move the cluster to peer ports by replacing \
                     replicas (gangway cluster add ID HOST:PORT/PEERPORT)"
                );
            }
            let task = node.spawn_on_raft(peer_router.serve_with_incoming_shutdown(incoming, async {
                let _ = rx.await;
            }));
            Some((tx, task))
        }
    };

    if !config.join && !node.is_initialized().await {
        if !config.peers.contains_key(&config.id) {
            anyhow::bail!("peers: must include this replica's own id {}", config.id);
        }
        node.initialize(&config.peers).await?;
        tracing::info!(id = config.id, peers = ?config.peers, "formed a new cluster");
    }
    let leader_watch = crate::leader::spawn_leader_watch(replica.clone());
    // Ends when the replica closes.
    crate::watch::spawn_poker(node.state().clone(), replica.watches.clone(), replica.closed());
    let (fatal_tx, fatal) = tokio::sync::watch::channel(None);
    let fatal_watch = tokio::spawn({
        let replica = replica.clone();
        async move {
            let why = replica.node.fatal().await;
            tracing::error!(
                error = %why,
                "FATAL: Raft stopped on this replica; it answers NOT_SERVING and stops (its peers go on)"
            );
            health_reporter.set_not_serving::<JobServiceServer<JobApi>>().await;
            health_reporter.set_not_serving::<NodeServiceServer<NodeApi>>().await;
            health_reporter.set_not_serving::<AdminServiceServer<AdminApi>>().await;
            health_reporter.set_not_serving::<AgentServiceServer<AgentApi>>().await;
            health_reporter.set_service_status("", tonic_health::ServingStatus::NotServing).await;
            replica.close();
            fatal_tx.send_replace(Some(why));
        }
    });
    Ok(ReplicaHandle {
        replica,
        local_addr,
        shutdown_tx: Some(shutdown_tx),
        server,
        peer_server,
        leader_watch,
        fatal_watch,
        fatal,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A store whose lock another holder keeps is tried
    /// STORE_OPEN_ATTEMPTS_MAX times, a pause apart, then refused naming the
    /// attempts; one released while it waits is opened.
    #[test]
    fn a_locked_store_is_tried_store_open_attempts_max_times() {
        let dir = tempfile::tempdir().unwrap();
        let held = gangway_raft_store::open(dir.path()).unwrap();
        let started = std::time::Instant::now();
        let err = open_store(dir.path()).err().expect("opened a locked store").to_string();
        assert!(started.elapsed() >= STORE_OPEN_PAUSE * STORE_OPEN_ATTEMPTS_MAX as u32, "gave up early");
        assert!(err.contains(&format!("still locked after {STORE_OPEN_ATTEMPTS_MAX} attempts")), "{err}");
        let releaser = std::thread::spawn(move || {
            std::thread::sleep(STORE_OPEN_PAUSE * 3);
            drop(held);
        });
        assert!(open_store(dir.path()).is_ok(), "a lock released while waiting");
        releaser.join().unwrap();
    }
}
