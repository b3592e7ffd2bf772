//! A cluster of real `gangway` processes, one per test host: controllers on the
//! first hosts, agents (simulated GPUs, real job processes) on the rest. The
//! test process is the client, in the root namespace.
//!
//! Processes are killed (SIGKILL) and reaped on drop, before the network goes.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use anyhow::{bail, Context};
use gangway_proto::client::Client;
use gangway_proto::v1 as pb;
use gangway_proto::v1::admin_service_client::AdminServiceClient;
use nix::sys::signal::{kill, Signal};
use nix::unistd::Pid;

use crate::net::TestNet;

/// The controllers' gRPC port inside each host.
pub const PORT: u16 = 50051;
/// The replicas' node-down timeout: short, so an agent cut off in a run of
/// seconds gets fenced (half of it) and its node declared down, yet longer than
/// twice the worst quorum outage a scenario causes (a majority killed for 2 s,
/// restart and election), which running jobs must ride out.
pub const NODE_DOWN_TIMEOUT_MS: u64 = 10_000;

/// One `gangway` process on a test host, restartable with the same arguments.
pub struct Proc {
    pub host: usize,
    /// Removed from the membership: stopped for good, not a replica any more.
    pub retired: bool,
    args: Vec<String>,
    log: PathBuf,
    child: Option<Child>,
    /// Runs the previous data format's build (a rolling upgrade replaces it).
    pub previous: bool,
}

impl Proc {
    fn spawn(&mut self, exe: &Path, net: &TestNet) -> anyhow::Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = Command::new("ip")
            .args(["netns", "exec", &net.hosts[self.host].netns])
            .arg(exe)
            .args(&self.args)
            .env("GANGWAY_LOG", "info,openraft=warn")
            .stdin(Stdio::null())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("spawning a gangway process")?;
        self.child = Some(child);
        Ok(())
    }

    pub fn pid(&self) -> Option<Pid> {
        self.child.as_ref().map(|c| Pid::from_raw(c.id() as i32))
    }

    /// SIGKILL and reap.
    pub fn kill(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    pub fn pause(&self) {
        if let Some(p) = self.pid() {
            let _ = kill(p, Signal::SIGSTOP);
        }
    }

    pub fn resume(&self) {
        if let Some(p) = self.pid() {
            let _ = kill(p, Signal::SIGCONT);
        }
    }

    pub fn running(&self) -> bool {
        self.child.is_some()
    }
}

impl Drop for Proc {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

pub struct ChaosCluster {
    // Field order is drop order: processes go before the network.
    pub controllers: Vec<Proc>,
    pub agents: Vec<Proc>,
    pub net: TestNet,
    exe: PathBuf,
    /// The previous data format's build, for rolling upgrades.
    previous_exe: Option<PathBuf>,
    pub dir: PathBuf,
    pub endpoints: Vec<String>,
    /// The cluster runs with mutual TLS: a throwaway CA in DIR/tls.
    tls_dir: PathBuf,
    /// The test's own client (user root, the bootstrap admin).
    security: gangway_proto::tls::Security,
}

/// Replicas a chaos cluster may ever have (replacements included): each needs
/// a server certificate made up front.
const REPLICA_IDS_MAX: usize = 12;

/// The id of a cluster's replica at index `i` (ids count from 1), while
/// one has a certificate.
fn replica_id(i: usize) -> anyhow::Result<u64> {
    if i >= REPLICA_IDS_MAX {
        bail!("a chaos cluster has certificates for {REPLICA_IDS_MAX} replicas");
    }
    Ok(u64::try_from(i)?.saturating_add(1))
}

/// A CA and certificates for every replica, agent and the test client.
fn make_pki(dir: &Path, agents: usize) -> anyhow::Result<(PathBuf, gangway_proto::tls::Security)> {
    use gangway_proto::tls::{Credentials, Principal, Role, Security, TlsFiles};
    let tls = dir.join("tls");
    let mut ps = Vec::new();
    for id in 1..=REPLICA_IDS_MAX {
        ps.push(Principal::new(Role::Server, &id.to_string()).map_err(anyhow::Error::msg)?);
    }
    for a in 1..=agents {
        ps.push(Principal::new(Role::Agent, &format!("chaos-node-{a}")).map_err(anyhow::Error::msg)?);
    }
    ps.push(Principal::new(Role::Client, "root").map_err(anyhow::Error::msg)?);
    gangway_proto::pki::throwaway(&tls, &ps).map_err(anyhow::Error::msg)?;
    let creds = Credentials::load(TlsFiles::in_dir(&tls, "client-root")).map_err(anyhow::Error::msg)?;
    Ok((tls, Security::Tls(creds)))
}

/// Security flags every replica gets: its certificate, root as the bootstrap
/// admin, and root's jobs allowed (the workload runs as root here).
fn controller_tls_args(tls: &Path) -> Vec<String> {
    vec![
        "--tls-dir".into(),
        tls.display().to_string(),
        "--bootstrap-admin".into(),
        "root".into(),
        "--allow-root-jobs".into(),
    ]
}

/// The build of the previous data format (`make previous` builds it and sets
/// `GANGWAY_PREVIOUS_BIN`), for the rolling-upgrade scenario.
pub fn previous_exe() -> anyhow::Result<PathBuf> {
    let p = std::env::var("GANGWAY_PREVIOUS_BIN").map(PathBuf::from).map_err(|_| {
        anyhow::anyhow!(
            "GANGWAY_PREVIOUS_BIN is not set: the rolling upgrade needs the previous format's build \
             (`make previous` builds it; `make test` does so first)"
        )
    })?;
    anyhow::ensure!(p.is_file(), "GANGWAY_PREVIOUS_BIN={} is not a file", p.display());
    Ok(p)
}

/// The `gangway` binary next to this test binary (target/debug/gangway), or
/// `GANGWAY_BIN`.
pub fn gangway_exe() -> anyhow::Result<PathBuf> {
    if let Ok(p) = std::env::var("GANGWAY_BIN") {
        return Ok(PathBuf::from(p));
    }
    let me = std::env::current_exe()?;
    for dir in me.ancestors().skip(1).take(3) {
        let candidate = dir.join("gangway");
        if candidate.is_file() {
            return Ok(candidate);
        }
    }
    bail!(
        "cannot find the gangway binary near {}; build it (cargo build --bin gangway) or set GANGWAY_BIN",
        me.display()
    )
}

impl ChaosCluster {
    /// Starts `controllers` replicas and `agents` agents (4 simulated GPUs each),
    /// each on its own host, logging under `dir`. With `previous`, the
    /// replicas run the previous data format's build.
    pub fn start(controllers: usize, agents: usize, dir: &Path, previous: bool) -> anyhow::Result<ChaosCluster> {
        let exe = gangway_exe()?;
        let previous_exe = if previous { Some(previous_exe()?) } else { None };
        let net = TestNet::create(controllers + agents)?;
        let endpoints: Vec<String> = (0..controllers).map(|h| format!("{}:{PORT}", net.hosts[h].ip)).collect();
        let peers: Vec<String> = endpoints.iter().enumerate().map(|(i, e)| format!("{}={e}", i + 1)).collect();
        let peers = peers.join(",");
        let (tls_dir, security) = make_pki(dir, agents)?;
        let mut c = ChaosCluster {
            controllers: Vec::new(),
            agents: Vec::new(),
            net,
            exe,
            previous_exe,
            dir: dir.to_path_buf(),
            endpoints: endpoints.clone(),
            tls_dir,
            security,
        };
        for (h, endpoint) in endpoints.iter().enumerate() {
            let data = dir.join(format!("c{}", h + 1));
            let mut args = vec![
                "controller".to_string(),
                "--id".into(),
                (h + 1).to_string(),
                "--listen".into(),
                format!("0.0.0.0:{PORT}"),
                "--advertise".into(),
                endpoint.clone(),
                "--peers".into(),
                peers.clone(),
                "--data-dir".into(),
                data.display().to_string(),
                "--node-down-timeout-ms".into(),
                NODE_DOWN_TIMEOUT_MS.to_string(),
            ];
            args.extend(controller_tls_args(&c.tls_dir));
            let mut p =
                Proc { host: h, retired: false, args, log: dir.join(format!("c{}.log", h + 1)), child: None, previous };
            p.spawn(c.exe_of(&p), &c.net)?;
            c.controllers.push(p);
        }
        for a in 0..agents {
            let host = controllers + a;
            let args = vec![
                "agent".to_string(),
                "--controllers".into(),
                endpoints.join(","),
                "--name".into(),
                format!("chaos-node-{}", a + 1),
                "--fake-gpus".into(),
                "4xh100-80gb".into(),
                "--state-dir".into(),
                dir.join(format!("agent-{}", a + 1)).display().to_string(),
                // Other agents reach this one's step service here.
                "--addr".into(),
                c.net.hosts[host].ip.clone(),
                "--tls-dir".into(),
                c.tls_dir.display().to_string(),
                "--allow-root-jobs".into(),
            ];
            let mut p = Proc {
                host,
                retired: false,
                args,
                log: dir.join(format!("a{}.log", a + 1)),
                child: None,
                previous: false,
            };
            p.spawn(&c.exe, &c.net)?;
            c.agents.push(p);
        }
        Ok(c)
    }

    pub fn client(&self) -> anyhow::Result<Client> {
        Ok(Client::new(&self.endpoints, "chaos:root", &self.security)?)
    }

    /// Indexes of the controllers that are members (not retired).
    pub fn members(&self) -> Vec<usize> {
        (0..self.controllers.len()).filter(|&i| !self.controllers[i].retired).collect()
    }

    /// Starts a new replica on a new host with `--join` and makes it a voter
    /// (add learner, promote), then removes `remove` from the membership and
    /// stops it. Returns the new replica's index.
    pub async fn replace_member(&mut self, remove: usize) -> anyhow::Result<usize> {
        let i = self.controllers.len();
        let id = replica_id(i)?;
        let host = self.net.add_host()?;
        let endpoint = format!("{}:{PORT}", self.net.hosts[host].ip);
        let mut args = vec![
            "controller".to_string(),
            "--id".into(),
            id.to_string(),
            "--listen".into(),
            format!("0.0.0.0:{PORT}"),
            "--advertise".into(),
            endpoint.clone(),
            "--join".into(),
            "--data-dir".into(),
            self.dir.join(format!("c{id}")).display().to_string(),
            "--node-down-timeout-ms".into(),
            NODE_DOWN_TIMEOUT_MS.to_string(),
        ];
        args.extend(controller_tls_args(&self.tls_dir));
        let mut p =
            Proc { host, retired: false, args, log: self.dir.join(format!("c{id}.log")), child: None, previous: false };
        p.spawn(&self.exe, &self.net)?;
        self.controllers.push(p);
        self.endpoints.push(endpoint.clone());
        let client = self.client()?;
        let admin = |ch| AdminServiceClient::new(ch);
        let req = pb::AddLearnerRequest { id, addr: endpoint };
        client
            .call(|ch| {
                let mut r = client.request(req.clone());
                r.set_timeout(Duration::from_secs(60));
                async move { admin(ch).add_learner(r).await }
            })
            .await?;
        client
            .call(|ch| {
                let mut r = client.request(pb::PromoteRequest { id });
                r.set_timeout(Duration::from_secs(60));
                async move { admin(ch).promote(r).await }
            })
            .await?;
        let gone = (remove + 1) as u64;
        client
            .call(|ch| {
                let mut r = client.request(pb::RemoveMemberRequest { id: gone });
                r.set_timeout(Duration::from_secs(60));
                async move { admin(ch).remove_member(r).await }
            })
            .await?;
        self.controllers[remove].kill();
        self.controllers[remove].retired = true;
        Ok(i)
    }

    /// SIGKILLs agent `i`, waits `down`, and starts it again on its state.
    pub async fn restart_agent(&mut self, i: usize, down: Duration) -> anyhow::Result<()> {
        self.agents[i].kill();
        tokio::time::sleep(down).await;
        let (exe, net) = (self.exe.clone(), &self.net);
        self.agents[i].spawn(&exe, net)
    }

    pub fn restart_controller(&mut self, i: usize) -> anyhow::Result<()> {
        let exe = self.exe_of(&self.controllers[i]).to_path_buf();
        let net = &self.net;
        let p = &mut self.controllers[i];
        p.kill();
        p.spawn(&exe, net)
    }

    /// The binary a process runs: the previous format's build or this one.
    fn exe_of(&self, p: &Proc) -> &Path {
        match (&self.previous_exe, p.previous) {
            (Some(old), true) => old,
            _ => &self.exe,
        }
    }

    /// A rolling upgrade's step: the replica stops (SIGTERM, as an operator's
    /// `systemctl restart` does) and starts again on its data with this build.
    pub async fn upgrade_controller(&mut self, i: usize) -> anyhow::Result<()> {
        if let Some(pid) = self.controllers[i].pid() {
            let _ = kill(pid, Signal::SIGTERM);
        }
        let deadline = Instant::now() + Duration::from_secs(10);
        while let Some(c) = self.controllers[i].child.as_mut() {
            if c.try_wait()?.is_some() || Instant::now() > deadline {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        self.controllers[i].previous = false;
        self.restart_controller(i)
    }

    /// The replica every reachable replica names as leader (index into `controllers`).
    pub async fn leader(&self, within: Duration) -> anyhow::Result<usize> {
        let deadline = Instant::now() + within;
        loop {
            let mut votes = Vec::new();
            for i in self.members() {
                if !self.controllers[i].running() {
                    continue;
                }
                if let Some(s) = self.replica_status(i).await {
                    votes.push(s);
                }
            }
            if let Some(l) = votes.iter().find(|s| s.replica_role() == Some(gangway_proto::ReplicaRole::Leader)) {
                let agreed = votes.iter().all(|s| s.leader_id == Some(l.id));
                if agreed && votes.len() * 2 > self.members().len() {
                    return Ok(l.id as usize - 1);
                }
            }
            if Instant::now() > deadline {
                bail!("no leader agreed by a majority within {within:?}: {votes:?}");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// A channel to one replica only (no failover), for per-replica checks.
    pub fn channel_of(&self, controller: usize) -> anyhow::Result<tonic::transport::Channel> {
        self.security
            .channel(&self.endpoints[controller], gangway_proto::tls::Expect::Server, Duration::from_millis(500))
            .map_err(anyhow::Error::msg)
    }

    /// One replica's own view (role, term, indexes), if it answers in time.
    pub async fn replica_status(&self, controller: usize) -> Option<pb::ReplicaStatus> {
        let ch = self.channel_of(controller).ok()?;
        let mut req = tonic::Request::new(pb::ReplicaStatusRequest {});
        req.set_timeout(Duration::from_millis(500));
        let mut admin = AdminServiceClient::new(ch);
        let r = tokio::time::timeout(Duration::from_millis(700), admin.get_replica_status(req)).await;
        r.ok()?.ok().map(|r| r.into_inner())
    }

    /// Nodes as the cluster sees them (linearizable read).
    pub async fn nodes(&self) -> anyhow::Result<Vec<pb::Node>> {
        Ok(self.client()?.list_nodes(false).await?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Replicas get ids up to REPLICA_IDS_MAX, the certificates made up
    /// front; one more is refused before a host is added for it.
    #[test]
    fn replicas_have_ids_up_to_replica_ids_max() {
        assert_eq!(replica_id(0).unwrap(), 1);
        assert_eq!(replica_id(REPLICA_IDS_MAX - 1).unwrap(), REPLICA_IDS_MAX as u64);
        let err = replica_id(REPLICA_IDS_MAX).unwrap_err().to_string();
        assert_eq!(err, format!("a chaos cluster has certificates for {REPLICA_IDS_MAX} replicas"));
    }
}
