//! `gangway dev`: a whole cluster in one process, for trying Gangway out: three
//! controller replicas (real Raft, real RocksDB, real gRPC on loopback) and
//! simulated GPU nodes that register and heartbeat.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context};
use clap::Args;

/// Replicas a dev cluster may have (Raft groups are 1, 3 or 5 in practice).
const DEV_REPLICAS_MAX: u64 = 5;
/// Simulated nodes a dev cluster may have: all run in this one process.
const DEV_AGENTS_MAX: usize = 64;
/// How long to wait for the first leader before giving up.
const LEADER_WAIT: Duration = Duration::from_secs(15);

#[derive(Args)]
pub struct DevArgs {
    /// Keep the cluster's data here (default: a temporary directory removed on exit).
    #[arg(long)]
    data_dir: Option<PathBuf>,
    /// First port; replicas listen on consecutive ports from here.
    #[arg(long, default_value_t = 50051)]
    port: u16,
    /// Controller replicas (1, 3 or 5).
    #[arg(long, default_value_t = 3)]
    replicas: u64,
    /// Simulated nodes.
    #[arg(long, default_value_t = 2)]
    nodes: usize,
    /// GPUs on each simulated node.
    #[arg(long, default_value = "8xh100-80gb")]
    fake_gpus: String,
    /// First Prometheus metrics port: replicas, then nodes, on consecutive
    /// ports from here (0: no metrics).
    #[arg(long, default_value_t = 9464)]
    metrics_port: u16,
}

pub async fn run(a: DevArgs, identity: &str) -> anyhow::Result<()> {
    if a.replicas == 0 || a.replicas > DEV_REPLICAS_MAX {
        bail!("replicas: must be between 1 and {DEV_REPLICAS_MAX}, got {}", a.replicas);
    }
    if a.nodes > DEV_AGENTS_MAX {
        bail!("nodes: must be at most {DEV_AGENTS_MAX}, got {}", a.nodes);
    }
    gangway_node_agent::inventory::parse_fake_gpus(&a.fake_gpus, "check").map_err(anyhow::Error::msg)?;
    let (tmp, root) = match &a.data_dir {
        Some(d) => (None, d.clone()),
        None => {
            let t = tempfile::Builder::new().prefix("gangway-dev-").tempdir().context("creating a temp dir")?;
            let p = t.path().to_path_buf();
            (Some(t), p)
        }
    };
    let mut listeners = Vec::new();
    let mut peers = BTreeMap::new();
    for id in 1..=a.replicas {
        let port = a.port.checked_add((id - 1) as u16).context("port: too high")?;
        let addr = format!("127.0.0.1:{port}");
        let l = tokio::net::TcpListener::bind(&addr).await.with_context(|| {
            format!("port {port} is in use (is a dev cluster already running? pick another with --port)")
        })?;
        listeners.push((id, l));
        peers.insert(id, addr);
    }
    // Metrics listeners first, so a port in use fails before anything starts.
    let mut metrics = Vec::new();
    if a.metrics_port != 0 {
        for i in 0..a.replicas as usize + a.nodes {
            let port = a.metrics_port.checked_add(i as u16).context("metrics-port: too high")?;
            let l = tokio::net::TcpListener::bind(("127.0.0.1", port)).await.with_context(|| {
                format!("metrics port {port} is in use (pick another with --metrics-port, 0 for none)")
            })?;
            metrics.push(l);
        }
    }
    let metrics_addrs: Vec<String> =
        metrics.iter().filter_map(|l| l.local_addr().ok()).map(|a| a.to_string()).collect();
    let mut node_metrics = metrics.split_off(metrics.len().min(a.replicas as usize));
    let mut metric_tasks = Vec::new();
    let mut handles = Vec::new();
    for (id, listener) in listeners {
        let config = gangway_controller::ReplicaConfig {
            id,
            advertise_addr: peers[&id].clone(),
            peers: peers.clone(),
            data_dir: root.join(format!("replica-{id}")),
            join: false,
            timing: gangway_controller::Timing::default(),
        };
        let h = gangway_controller::replica::start(config, listener).await?;
        if !metrics.is_empty() {
            metric_tasks.push(gangway_controller::telemetry::serve(h.replica.clone(), metrics.remove(0)));
        }
        handles.push(h);
    }
    let first = handles[0].replica.node.clone();
    if !first.wait_for(LEADER_WAIT, |s| s.leader_id.is_some()).await {
        bail!("no leader was elected within {}s", LEADER_WAIT.as_secs());
    }
    let endpoints: Vec<String> = peers.values().cloned().collect();
    let (stop_tx, _) = tokio::sync::broadcast::channel::<()>(1);
    let mut agents = Vec::new();
    for i in 1..=a.nodes {
        let name = format!("dev-node-{i}");
        let state_dir = root.join(format!("agent-{name}"));
        let config = gangway_node_agent::AgentConfig {
            gpus: gangway_node_agent::inventory::parse_fake_gpus(&a.fake_gpus, &name).map_err(anyhow::Error::msg)?,
            mem_mb: 512 * 1024,
            topology: vec!["zone-a".into(), format!("rack-{}", (i - 1) / 4 + 1)],
            identity: identity.to_string(),
            gpu_hold_down: std::time::Duration::from_secs(10),
            shim: std::env::current_exe().ok(),
            ..gangway_node_agent::AgentConfig::simulated(endpoints.clone(), &name, state_dir)
        };
        // The agent binds its own metrics port: hand this one back just before.
        let config = match (!node_metrics.is_empty()).then(|| node_metrics.remove(0)) {
            Some(l) => {
                let addr = l.local_addr()?.to_string();
                drop(l);
                gangway_node_agent::AgentConfig { metrics_listen: Some(addr), ..config }
            }
            None => config,
        };
        let mut stop = stop_tx.subscribe();
        agents.push(tokio::spawn(gangway_node_agent::run(config, async move {
            let _ = stop.recv().await;
        })));
    }
    let joined = endpoints.join(",");
    println!(
        "Gangway dev cluster is up: {} controller replicas, {} simulated nodes ({} each).",
        a.replicas, a.nodes, a.fake_gpus
    );
    println!("  endpoints: {joined}");
    match &tmp {
        Some(_) => println!("  data:      {} (removed when you stop the cluster)", root.display()),
        None => println!("  data:      {}", root.display()),
    }
    if !metrics_addrs.is_empty() {
        let (c, n) = metrics_addrs.split_at(metrics_addrs.len().min(a.replicas as usize));
        println!("  metrics:   controllers http://{}/metrics", c.join("/metrics, http://"));
        if !n.is_empty() {
            println!("             nodes       http://{}/metrics", n.join("/metrics, http://"));
        }
    }
    if a.port != 50051 {
        println!("  (not the default port: export GANGWAY_ENDPOINTS={joined})");
    }
    println!();
    // Show the command the way this binary was invoked (e.g. `bin/gangway`).
    let me =
        std::env::args().next().filter(|a| a.contains('/') && !a.starts_with('/')).unwrap_or_else(|| "gangway".into());
    println!("Try, in another terminal:");
    println!("  {me} submit -N 2 --gpus-per-node h100:4 -- sh -c 'echo rank $RANK of $WORLD_SIZE on $SLURMD_NODENAME'");
    println!("  {me} queue");
    println!("  {me} nodes");
    println!("  {me} cluster status");
    println!("Jobs run as real processes on this machine; output goes to slurm-<jobid>.out in the submit directory.");
    println!(
        "Inject a GPU fault: echo '3 xid 79' > {}/agent-dev-node-1/gpu-faults (empty the file to recover)",
        root.display()
    );
    println!("Ctrl-C stops the cluster.");
    crate::commands::shutdown_signal().await;
    println!("stopping...");
    let _ = stop_tx.send(());
    for agent in agents {
        let _ = tokio::time::timeout(Duration::from_secs(2), agent).await;
    }
    for t in metric_tasks {
        t.abort();
    }
    for h in handles {
        h.shutdown().await;
    }
    drop(tmp);
    Ok(())
}
