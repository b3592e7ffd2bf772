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
/// The console login link `gangway dev` prints is good for a working day.
const DEV_CONSOLE_TOKEN_LIFETIME: Duration = Duration::from_secs(12 * 3600);
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
    /// First web console port: replicas serve /ui/ on consecutive ports
    /// from here, plain HTTP on loopback (0: no console).
    #[arg(long, default_value_t = 8080)]
    ui_port: u16,
    /// Users see only their own jobs (the policy's private_jobs).
    #[arg(long)]
    private_jobs: bool,
}

/// The replicas and simulated nodes a dev cluster may have.
fn check_shape(replicas: u64, nodes: usize) -> anyhow::Result<()> {
    if replicas == 0 || replicas > DEV_REPLICAS_MAX {
        bail!("replicas: must be between 1 and {DEV_REPLICAS_MAX}, got {replicas}");
    }
    if nodes > DEV_AGENTS_MAX {
        bail!("nodes: must be at most {DEV_AGENTS_MAX}, got {nodes}");
    }
    Ok(())
}

pub async fn run(a: DevArgs, identity: &str, tls: &crate::tls::TlsArgs) -> anyhow::Result<()> {
    check_shape(a.replicas, a.nodes)?;
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
    let mut consoles = Vec::new();
    if a.ui_port != 0 {
        for i in 0..a.replicas {
            let port = a.ui_port.checked_add(i as u16).context("ui-port: too high")?;
            let l = tokio::net::TcpListener::bind(("127.0.0.1", port))
                .await
                .with_context(|| format!("console port {port} is in use (pick another with --ui-port, 0 for none)"))?;
            consoles.push(l);
        }
    }
    let console_addrs: Vec<String> =
        consoles.iter().filter_map(|l| l.local_addr().ok()).map(|a| a.to_string()).collect();
    let pki = if tls.insecure { None } else { Some(DevPki::create(a.port, a.replicas, a.nodes)?) };
    // Bearer tokens for the console (and anyone else): signed with a key in
    // the throwaway PKI directory (`gangway token create --key DIR/token-key.pem`).
    let tokens = match &pki {
        Some(p) => {
            let (_, public) = gangway_proto::token::create_key(&p.dir).map_err(anyhow::Error::msg)?;
            gangway_proto::token::TokenVerifier::load(&gangway_proto::token::TokenConfig {
                public_keys: vec![public],
                jwks: None,
                issuer: Some(gangway_proto::token::DEFAULT_ISSUER.into()),
                audience: Some(gangway_proto::token::DEFAULT_AUDIENCE.into()),
                revoked: None,
            })
            .map_err(|e| anyhow::anyhow!("tokens: {e}"))?
        }
        None => None,
    };
    let server_security = |id: u64| match &pki {
        Some(p) => p.security(&format!("server-{id}")),
        None => Ok(gangway_proto::tls::Security::Insecure),
    };
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
            security: server_security(id)?,
            // The one who started the dev cluster runs it: admin, and their
            // jobs run as them (root too, when that is who they are).
            bootstrap_admins: vec![crate::tls::login_name()],
            accounting_identities: Vec::new(),
            allow_root_jobs: nix::unistd::geteuid().is_root(),
            tokens: tokens.clone(),
            private_jobs: a.private_jobs,
            restore: None,
            power: Default::default(),
            accounting: None,
        };
        let h = gangway_controller::replica::start(config, listener).await?;
        if !metrics.is_empty() {
            metric_tasks.push(gangway_controller::telemetry::serve(h.replica.clone(), metrics.remove(0), None));
        }
        if !consoles.is_empty() {
            let t = gangway_controller::ui::Transport::Plain;
            metric_tasks.push(
                gangway_controller::ui::serve(h.replica.clone(), consoles.remove(0), t).map_err(anyhow::Error::msg)?,
            );
        }
        handles.push(h);
    }
    let first = handles[0].replica.node.clone();
    if !first.wait_for(LEADER_WAIT, |s| s.leader_id.is_some()).await {
        bail!("no leader was elected within {}s", LEADER_WAIT.as_secs());
    }
    // You are the dev cluster's admin from its first command on.
    let deadline = std::time::Instant::now() + LEADER_WAIT;
    while handles[0].replica.node.state().read().policy.admins.is_empty() {
        if std::time::Instant::now() > deadline {
            bail!("the dev cluster's admin was not committed within {}s", LEADER_WAIT.as_secs());
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
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
            security: match &pki {
                Some(p) => p.security(&format!("agent-{name}"))?,
                None => gangway_proto::tls::Security::Insecure,
            },
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
    if let Some(first) = console_addrs.first() {
        let login = match &pki {
            Some(p) => {
                let key = p.dir.join("token-key.pem");
                let t = gangway_proto::token::create(
                    &key,
                    &crate::tls::login_name(),
                    DEV_CONSOLE_TOKEN_LIFETIME,
                    gangway_proto::token::DEFAULT_ISSUER,
                    gangway_proto::token::DEFAULT_AUDIENCE,
                )
                .map_err(anyhow::Error::msg)?;
                format!("#token={t}")
            }
            None => String::new(),
        };
        println!("  console:   http://{first}/ui/{login}");
        if console_addrs.len() > 1 {
            println!("             (every replica serves it: http://{}/ui/)", console_addrs[1..].join("/ui/, http://"));
        }
    }
    match &pki {
        Some(p) => println!(
            "  TLS:       mutual TLS with a throwaway CA in {} (removed when you stop the cluster); \
             the CLI finds it, you are admin {}",
            p.dir.display(),
            crate::tls::login_name()
        ),
        None => println!("  TLS:       none (--insecure): anyone who can reach these ports controls this cluster"),
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
    crate::daemons::shutdown_signal().await;
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
    drop(pki);
    Ok(())
}

/// The dev cluster's throwaway CA and certificates, where the CLI looks for
/// them ([`crate::tls::dev_tls_dir`]); removed when the cluster stops.
struct DevPki {
    dir: PathBuf,
}

impl DevPki {
    fn create(port: u16, replicas: u64, nodes: usize) -> anyhow::Result<DevPki> {
        use gangway_proto::tls::{Principal, Role};
        use std::os::unix::fs::{DirBuilderExt, MetadataExt};
        let mine = |p: &std::path::Path| -> anyhow::Result<bool> {
            match std::fs::symlink_metadata(p) {
                Err(_) => Ok(false),
                // Someone else's, or a link: not ours to use or remove.
                Ok(m) if !m.is_dir() || m.uid() != nix::unistd::getuid().as_raw() || m.mode() & 0o077 != 0 => {
                    bail!(
                        "{} exists and is not this user's private directory; remove it or use --insecure",
                        p.display()
                    )
                }
                Ok(_) => Ok(true),
            }
        };
        let base = crate::tls::dev_tls_base();
        if !mine(&base)? {
            std::fs::DirBuilder::new()
                .mode(0o700)
                .create(&base)
                .with_context(|| format!("creating {}", base.display()))?;
        }
        // One per first port: dev clusters on other ports keep theirs. One
        // left on this port by a cluster that did not stop cleanly is stale
        // (this cluster holds the port now).
        let dir = crate::tls::dev_tls_dir(port);
        if mine(&dir)? {
            std::fs::remove_dir_all(&dir).with_context(|| format!("removing the stale {}", dir.display()))?;
        }
        std::fs::DirBuilder::new().mode(0o700).create(&dir).with_context(|| format!("creating {}", dir.display()))?;
        let mut principals = Vec::new();
        for id in 1..=replicas {
            principals.push(Principal::new(Role::Server, &id.to_string()).map_err(anyhow::Error::msg)?);
        }
        for i in 1..=nodes {
            principals.push(Principal::new(Role::Agent, &format!("dev-node-{i}")).map_err(anyhow::Error::msg)?);
        }
        let user = crate::tls::login_name();
        principals.push(Principal::new(Role::Client, &user).map_err(|e| anyhow::anyhow!("user name: {e}"))?);
        gangway_proto::pki::throwaway(&dir, &principals).map_err(|e| anyhow::anyhow!("dev TLS: {e}"))?;
        Ok(DevPki { dir })
    }

    fn security(&self, stem: &str) -> anyhow::Result<gangway_proto::tls::Security> {
        let files = gangway_proto::tls::TlsFiles::in_dir(&self.dir, stem);
        Ok(gangway_proto::tls::Security::Tls(
            gangway_proto::tls::Credentials::load(files).map_err(|e| anyhow::anyhow!("dev TLS: {e}"))?,
        ))
    }
}

impl Drop for DevPki {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.dir);
        // The base goes too when no other dev cluster uses it.
        if let Some(base) = self.dir.parent() {
            let _ = std::fs::remove_dir(base);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A dev cluster has 1 to DEV_REPLICAS_MAX replicas and at most
    /// DEV_AGENTS_MAX simulated nodes; one past either is refused, naming it.
    #[test]
    fn a_dev_cluster_stops_at_its_limits() {
        assert!(check_shape(DEV_REPLICAS_MAX, DEV_AGENTS_MAX).is_ok());
        let e = check_shape(DEV_REPLICAS_MAX + 1, 1).unwrap_err().to_string();
        assert!(e.starts_with("replicas:") && e.contains(&DEV_REPLICAS_MAX.to_string()), "{e}");
        assert!(check_shape(0, 1).unwrap_err().to_string().starts_with("replicas:"));
        let e = check_shape(3, DEV_AGENTS_MAX + 1).unwrap_err().to_string();
        assert!(e.starts_with("nodes:") && e.contains(&DEV_AGENTS_MAX.to_string()), "{e}");
    }
}
