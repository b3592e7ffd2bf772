//! The node agent (`gangway agent`): finds the host's resources, registers the
//! node with the controllers and keeps heartbeating, following the leader
//! through failovers (replicas forward to the leader; the client library fails
//! over between replicas).
//!
//! This is the registration-and-heartbeat agent the controller needs today; job
//! launch, GPU health and fencing build on it (see ARCHITECTURE.md).
//!
//! Related code: `proto/src/client.rs` (failover), `controller/src/api/agent.rs`.

pub mod inventory;

use std::collections::BTreeMap;
use std::future::Future;
use std::time::Duration;

use gangway_proto::client::Client;
use gangway_proto::v1::agent_service_client::AgentServiceClient;
use gangway_proto::v1::{GpuInventory, HeartbeatRequest, RegisterRequest};

/// Pause after a failed register or heartbeat round (the client already retried
/// every replica); short so that the node is back quickly after an outage.
const RETRY_PAUSE: Duration = Duration::from_secs(1);
/// Bounds the heartbeat interval a controller can ask for.
const HEARTBEAT_INTERVAL_MIN_MS: u64 = 100;
const HEARTBEAT_INTERVAL_MAX_MS: u64 = 60_000;

#[derive(Debug, Clone)]
pub struct AgentConfig {
    pub controllers: Vec<String>,
    pub name: String,
    pub addr: String,
    pub cpus: u32,
    pub mem_mb: u64,
    pub gpus: Vec<GpuInventory>,
    pub topology: Vec<String>,
    pub labels: BTreeMap<String, String>,
    pub identity: String,
}

impl AgentConfig {
    fn register_request(&self) -> RegisterRequest {
        RegisterRequest {
            name: self.name.clone(),
            addr: self.addr.clone(),
            cpus: self.cpus,
            mem_mb: self.mem_mb,
            gpus: self.gpus.clone(),
            topology: self.topology.clone(),
            labels: self.labels.clone().into_iter().collect(),
        }
    }
}

/// Runs the agent until `shutdown` completes. Its loop is bounded by the agent's
/// life: one register/heartbeat round per interval.
pub async fn run(config: AgentConfig, shutdown: impl Future<Output = ()>) -> anyhow::Result<()> {
    let client = Client::new(&config.controllers, &config.identity)?;
    tokio::pin!(shutdown);
    let mut registered = false;
    let mut interval = Duration::from_secs(1);
    loop {
        let round = async {
            if !registered {
                let req = config.register_request();
                let resp = client
                    .call(|ch| {
                        let r = client.request(req.clone());
                        async move { AgentServiceClient::new(ch).register(r).await }
                    })
                    .await?;
                let ms =
                    resp.into_inner().heartbeat_interval_ms.clamp(HEARTBEAT_INTERVAL_MIN_MS, HEARTBEAT_INTERVAL_MAX_MS);
                interval = Duration::from_millis(ms);
                tracing::info!(node = %config.name, "registered");
                registered = true;
            } else {
                let req = HeartbeatRequest { name: config.name.clone() };
                let resp = client
                    .call(|ch| {
                        let r = client.request(req.clone());
                        async move { AgentServiceClient::new(ch).heartbeat(r).await }
                    })
                    .await?;
                if !resp.into_inner().known {
                    tracing::warn!(node = %config.name, "controller does not know this node: registering again");
                    registered = false;
                }
            }
            Ok::<_, tonic::Status>(())
        };
        let pause = match round.await {
            Ok(()) if registered => interval,
            Ok(()) => Duration::ZERO,
            Err(status) => {
                tracing::warn!(node = %config.name, error = %status.message(), "controllers unreachable; retrying");
                RETRY_PAUSE
            }
        };
        tokio::select! {
            _ = &mut shutdown => return Ok(()),
            _ = tokio::time::sleep(pause) => {}
        }
    }
}
