//! In-process multi-replica clusters on 127.0.0.1:0 with temp dirs: real Raft,
//! real RocksDB, real gRPC between replicas.

use std::collections::{BTreeMap, BTreeSet};
use std::time::Duration;

use gangway_controller::replica::{self, ReplicaHandle};
use gangway_controller::{ReplicaConfig, Timing};
use gangway_core::{snapshot, NodeState, State};
use gangway_proto::client::Client;
use gangway_proto::tls::Security;
use gangway_proto::v1 as pb;
use gangway_proto::v1::admin_service_client::AdminServiceClient;
use gangway_proto::v1::agent_service_client::AgentServiceClient;
use gangway_proto::v1::job_service_client::JobServiceClient;
use gangway_proto::v1::node_service_client::NodeServiceClient;
use tonic::Code;

/// Bound on every wait in these tests: far above what a healthy run needs.
const WAIT: Duration = Duration::from_secs(30);

struct TestCluster {
    dirs: BTreeMap<u64, tempfile::TempDir>,
    addrs: BTreeMap<u64, String>,
    handles: BTreeMap<u64, ReplicaHandle>,
    timing: BTreeMap<u64, Timing>,
    /// Every replica is seeded from this backup file at its first start.
    restore: Option<std::path::PathBuf>,
}

fn fast_timing() -> Timing {
    Timing { node_down_timeout_ms: 2_000, agent_heartbeat_interval_ms: 200, ..Timing::default() }
}

async fn bind(addr: &str) -> tokio::net::TcpListener {
    // A restarted replica rebinds its old port; the old socket may linger briefly.
    for _ in 0..100 {
        if let Ok(l) = tokio::net::TcpListener::bind(addr).await {
            return l;
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    panic!("cannot bind {addr}");
}

impl TestCluster {
    /// No replicas yet.
    fn empty() -> TestCluster {
        TestCluster {
            dirs: BTreeMap::new(),
            addrs: BTreeMap::new(),
            handles: BTreeMap::new(),
            timing: BTreeMap::new(),
            restore: None,
        }
    }

    async fn start(n: u64) -> TestCluster {
        Self::start_with(n, |_| fast_timing()).await
    }

    async fn start_with(n: u64, timing: impl Fn(u64) -> Timing) -> TestCluster {
        Self::start_full(n, timing, None).await
    }

    async fn start_full(n: u64, timing: impl Fn(u64) -> Timing, restore: Option<std::path::PathBuf>) -> TestCluster {
        let mut c = TestCluster { restore, ..TestCluster::empty() };
        let mut listeners = BTreeMap::new();
        for id in 1..=n {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            c.addrs.insert(id, l.local_addr().unwrap().to_string());
            c.dirs.insert(id, tempfile::tempdir().unwrap());
            c.timing.insert(id, timing(id));
            listeners.insert(id, l);
        }
        for (id, l) in listeners {
            let mut config = c.config(id, false);
            config.restore = c.restore.clone();
            let h = replica::start(config, l).await.unwrap();
            c.handles.insert(id, h);
        }
        c.wait_bootstrap_admin().await;
        c.wait_switches_carried().await;
        c
    }

    /// The history every replica counts in once a restored cluster's leader
    /// has drawn it (format 16).
    async fn wait_history_drawn(&self) -> u64 {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let states: Vec<(bool, u64)> = self
                .handles
                .values()
                .map(|h| {
                    let s = h.replica.node.state().read();
                    (s.history_pending, s.history)
                })
                .collect();
            if let Some(&(false, history)) = states.first() {
                if states.iter().all(|s| *s == (false, history)) {
                    return history;
                }
            }
            assert!(tokio::time::Instant::now() < deadline, "the history was never drawn everywhere: {states:?}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The leader carried the replicas' `--allow-root-jobs` into the policy
    /// (a commit after the format's): until then a root job is refused.
    async fn wait_switches_carried(&self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !self.handles.values().all(|h| h.replica.node.state().read().policy.allow_root_jobs) {
            assert!(tokio::time::Instant::now() < deadline, "the replicas' switches never reached the policy");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The first leader commits the bootstrap admin: tests act as it.
    async fn wait_bootstrap_admin(&self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        while !self.handles.values().any(|h| !h.replica.node.state().read().policy.admins.is_empty()) {
            assert!(tokio::time::Instant::now() < deadline, "the bootstrap admin was never committed");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    /// The cluster moved to this build's newest data format (and the leader
    /// carried the replicas' switches into the policy with it).
    async fn wait_newest_format(&self) {
        let deadline = tokio::time::Instant::now() + WAIT;
        let newest = gangway_core::format::FORMAT_NEWEST;
        // Every live replica: a call may reach any of them, and each checks
        // the format it has applied before it forwards.
        while !self.handles.values().all(|h| h.replica.node.state().read().format == newest) {
            assert!(tokio::time::Instant::now() < deadline, "the cluster never moved to data format {newest}");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn config(&self, id: u64, join: bool) -> ReplicaConfig {
        ReplicaConfig {
            power: Default::default(),
            accounting: None,
            id,
            advertise_addr: self.addrs[&id].clone(),
            peers: if join { BTreeMap::from([(id, self.addrs[&id].clone())]) } else { self.addrs.clone() },
            data_dir: self.dirs[&id].path().to_path_buf(),
            join,
            timing: self.timing[&id].clone(),
            // These tests exercise the cluster itself; the security tests run TLS.
            security: Security::Insecure,
            bootstrap_admins: vec!["tester".into()],
            accounting_identities: Vec::new(),
            allow_root_jobs: true,
            tokens: None,
            private_jobs: false,
            restore: None,
        }
    }

    async fn stop(&mut self, id: u64) {
        self.handles.remove(&id).expect("running").shutdown().await;
    }

    async fn restart(&mut self, id: u64) {
        let l = bind(&self.addrs[&id]).await;
        let h = replica::start(self.config(id, false), l).await.unwrap();
        self.handles.insert(id, h);
    }

    /// Starts a new empty replica that waits to be added.
    async fn start_joiner(&mut self, id: u64) {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        self.addrs.insert(id, l.local_addr().unwrap().to_string());
        self.dirs.insert(id, tempfile::tempdir().unwrap());
        self.timing.insert(id, fast_timing());
        let h = replica::start(self.config(id, true), l).await.unwrap();
        self.handles.insert(id, h);
    }

    /// The leader every running replica agrees on (a restarted ex-leader may
    /// briefly believe it still leads; agreement rules that out).
    async fn leader(&self) -> u64 {
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            for (id, h) in &self.handles {
                let agreed = self.handles.values().all(|o| o.replica.node.status().leader_id == Some(*id));
                if h.replica.node.is_leader() && agreed {
                    return *id;
                }
            }
            assert!(tokio::time::Instant::now() < deadline, "no leader elected");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
    }

    fn client_for(&self, ids: &[u64]) -> Client {
        let eps: Vec<String> = ids.iter().map(|id| self.addrs[id].clone()).collect();
        Client::new(&eps, "dev:tester", &Security::Insecure).unwrap()
    }

    fn client(&self) -> Client {
        let ids: Vec<u64> = self.handles.keys().copied().collect();
        self.client_for(&ids)
    }

    fn state(&self, id: u64) -> State {
        self.handles[&id].replica.node.state().read().state().clone()
    }

    /// Waits until every running replica has applied what any of them
    /// applied. (The leader's own applied index is not enough: a leader just
    /// elected may not have applied yet what its predecessor applied and
    /// answered.)
    async fn converge(&self) {
        self.leader().await;
        let target = self.handles.values().map(|h| h.replica.node.status().applied_index).max().flatten();
        for h in self.handles.values() {
            assert!(
                h.replica.node.wait_for(WAIT, |s| s.applied_index >= target).await,
                "replica {} did not catch up",
                h.replica.node.id
            );
            // And its readers see it.
            h.replica.node.state().read_fresh().await.unwrap();
        }
    }

    async fn shutdown(mut self) {
        let ids: Vec<u64> = self.handles.keys().copied().collect();
        for id in ids {
            self.stop(id).await;
        }
    }
}

fn spec(cmd: &str) -> pb::JobSpec {
    pb::JobSpec { command: vec![cmd.into()], workdir: "/tmp".into(), ..Default::default() }
}

async fn submit(client: &Client, spec: pb::JobSpec, key: &str) -> Result<pb::SubmitResponse, tonic::Status> {
    let req = pb::SubmitRequest { spec: Some(spec), idempotency_key: key.into() };
    client.job_submit(req.clone()).await.map(|r| r.into_inner())
}

async fn list_all(client: &Client) -> Vec<pb::Job> {
    let req = pb::ListJobsRequest { limit: 10_000, ..Default::default() };
    client.job_list(req.clone()).await.unwrap().into_inner().jobs
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn submit_via_follower_replicates_and_dedupes() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let follower = *c.handles.keys().find(|id| **id != leader).unwrap();
    let client = c.client_for(&[follower]);
    let first = submit(&client, spec("true"), "key-1").await.unwrap();
    let again = submit(&client, spec("true"), "key-1").await.unwrap();
    assert_eq!(first.job_id, again.job_id);
    assert!(!first.duplicate && again.duplicate);
    let other = submit(&client, spec("true"), "key-2").await.unwrap();
    assert_ne!(other.job_id, first.job_id);
    c.converge().await;
    let states: Vec<Vec<u8>> = c.handles.keys().map(|id| snapshot::encode(&c.state(*id))).collect();
    for id in c.handles.keys() {
        let s = c.state(*id);
        assert_eq!(s.jobs.len(), 2, "replica {id}");
        assert_eq!(s.jobs[&first.job_id].submitted_by, "dev:tester");
        assert_eq!(s.jobs[&first.job_id].spec.user, "tester");
    }
    assert!(states.windows(2).all(|w| w[0] == w[1]), "replicas diverged");
    // A linearizable read through a follower sees the write at once; a stale one is allowed.
    let req = pb::GetJobRequest { job_id: other.job_id, stale: false };
    let job = client.job_get(req).await.unwrap().into_inner();
    assert_eq!(job.state, pb::JobState::Pending as i32);
    // A client that knows both replicas, follower first: the follower's
    // forwarded answer names the leader, and the next call starts there.
    let both = c.client_for(&[follower, leader]);
    assert_eq!(both.preferred_endpoint(), c.addrs[&follower]);
    submit(&both, spec("true"), "key-3").await.unwrap();
    assert_eq!(both.preferred_endpoint(), c.addrs[&leader], "the forwarded answer named the leader");
    c.shutdown().await;
}

/// A replica's HTTP/2 limits, as a raw HTTP/2 client meets them: its
/// settings allow H2_STREAMS_PER_CONNECTION_MAX streams at once, and a
/// header list one byte short of H2_HEADER_LIST_BYTES_MAX (counted as
/// HTTP/2 counts them: name, value and 32 per field) is read, while one
/// that reaches it is answered 431 without reaching the service (the
/// server takes the setting as a bound never reached).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_bounds_http2_streams_and_header_lists() {
    use gangway_controller::replica::{H2_HEADER_LIST_BYTES_MAX, H2_STREAMS_PER_CONNECTION_MAX};
    let c = TestCluster::start(1).await;
    let addr = c.addrs[&1].clone();
    let tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
    let (send, mut conn) = h2::client::handshake(tcp).await.unwrap();
    // The server's settings arrive as the connection is driven.
    let deadline = tokio::time::Instant::now() + WAIT;
    while conn.max_concurrent_send_streams() != H2_STREAMS_PER_CONNECTION_MAX as usize {
        assert!(tokio::time::Instant::now() < deadline, "streams: {}", conn.max_concurrent_send_streams());
        let _ = tokio::time::timeout(Duration::from_millis(20), &mut conn).await;
    }
    tokio::spawn(conn);
    let path = "/gangway.v1.AdminService/GetReplicaStatus";
    let status_of = |list_bytes: usize| {
        let send = send.clone();
        let addr = addr.clone();
        async move {
            // :method, :scheme, :authority and :path, then the padding.
            let fixed = (7 + 4 + 32) + (7 + 4 + 32) + (10 + addr.len() + 32) + (5 + path.len() + 32) + (5 + 32);
            let req = http::Request::builder()
                .method("POST")
                .uri(format!("http://{addr}{path}"))
                .header("x-pad", "x".repeat(list_bytes - fixed))
                .body(())
                .unwrap();
            let mut send = send.ready().await.unwrap();
            let (answer, _) = send.send_request(req, true).unwrap();
            match tokio::time::timeout(WAIT, answer).await.expect("an answer") {
                Ok(resp) => resp.status().as_u16(),
                Err(e) => panic!("{list_bytes} bytes: {e}"),
            }
        }
    };
    let within = status_of(H2_HEADER_LIST_BYTES_MAX as usize - 1).await;
    assert_eq!(within, 200, "a header list within the limit was refused");
    assert_eq!(status_of(H2_HEADER_LIST_BYTES_MAX as usize).await, 431, "a header list that reaches the limit");
    c.shutdown().await;
}

/// The HTTP/2 "rapid reset" flood: a client that opens streams and resets
/// them before the server took them may do so H2_PENDING_RESETS_MAX times
/// in a row on one connection (it is then still served: a ping is
/// answered); one more and the connection is closed with ENHANCE_YOUR_CALM.
/// The frames are written raw, in one write, as a flood would send them.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_closes_a_connection_past_h2_pending_resets_max() {
    use gangway_controller::replica::H2_PENDING_RESETS_MAX;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let c = TestCluster::start(1).await;
    let addr = c.addrs[&1].clone();
    let frame = |kind: u8, flags: u8, stream: u32, payload: &[u8]| {
        let mut f = (payload.len() as u32).to_be_bytes()[1..].to_vec();
        f.extend([kind, flags]);
        f.extend(stream.to_be_bytes());
        f.extend(payload);
        f
    };
    // HPACK: :method POST, :scheme http (static entries), :path and
    // :authority as literals with indexed names.
    let path = b"/gangway.v1.AdminService/GetReplicaStatus";
    let mut block = vec![0x83, 0x86, 0x04, path.len() as u8];
    block.extend(path);
    block.extend([0x01, addr.len() as u8]);
    block.extend(addr.as_bytes());
    let (ping, ack, goaway, enhance_your_calm) = (6, 1, 7, 11u32);
    let flood = |resets: usize| {
        let mut out = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n".to_vec();
        out.extend(frame(4, 0, 0, &[]));
        for k in 0..resets as u32 {
            let stream = 2 * k + 1;
            out.extend(frame(1, 0x4 | 0x1, stream, &block));
            out.extend(frame(3, 0, stream, &8u32.to_be_bytes()));
        }
        out.extend(frame(ping, 0, 0, &[7; 8]));
        out
    };
    // The first of a ping's answer or a GOAWAY's error code.
    let outcome = |resets: usize| {
        let (addr, bytes) = (addr.clone(), flood(resets));
        async move {
            let mut tcp = tokio::net::TcpStream::connect(&addr).await.unwrap();
            tcp.write_all(&bytes).await.unwrap();
            let read = async {
                loop {
                    let mut head = [0u8; 9];
                    tcp.read_exact(&mut head).await.expect("the connection closed without a GOAWAY");
                    let len = u32::from_be_bytes([0, head[0], head[1], head[2]]) as usize;
                    let mut payload = vec![0u8; len];
                    tcp.read_exact(&mut payload).await.unwrap();
                    match (head[3], head[4]) {
                        (k, f) if k == ping && f & ack != 0 => return None,
                        (k, _) if k == goaway => {
                            return Some(u32::from_be_bytes([payload[4], payload[5], payload[6], payload[7]]))
                        }
                        _ => continue,
                    }
                }
            };
            tokio::time::timeout(WAIT, read).await.expect("an answer")
        }
    };
    assert_eq!(outcome(H2_PENDING_RESETS_MAX).await, None, "served after H2_PENDING_RESETS_MAX resets");
    assert_eq!(outcome(H2_PENDING_RESETS_MAX + 1).await, Some(enhance_your_calm), "one reset past the limit");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn bad_input_is_refused_with_field_and_nothing_is_logged() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let client = c.client();
    submit(&client, spec("true"), "warm").await.unwrap();
    c.converge().await;
    let before = c.handles[&leader].replica.node.status().last_log_index;
    let cases: Vec<(pb::JobSpec, &str)> = vec![
        (pb::JobSpec { nodes: Some(0), ..spec("true") }, "nodes"),
        (pb::JobSpec { nodes: Some(-3), ..spec("true") }, "nodes"),
        (pb::JobSpec { cpus_per_task: Some(-1), ..spec("true") }, "cpus_per_task"),
        (pb::JobSpec { gpus_per_node: Some(2), gpu_type: "H100:8".into(), ..spec("true") }, "gpu_type"),
        (pb::JobSpec { command: vec![], ..spec("true") }, "command"),
        (pb::JobSpec { time_limit_s: Some(400 * 86400), ..spec("true") }, "time_limit_s"),
        (pb::JobSpec { nodes: Some(100_000), ..spec("true") }, "nodes"),
        (pb::JobSpec { command: vec![], script: "x".repeat(1024 * 1024 + 1), ..spec("true") }, "script"),
        // What squeue and scontrol print to other users' terminals.
        (pb::JobSpec { comment: "x\x1b]0;owned\x07".into(), ..spec("true") }, "comment"),
        (pb::JobSpec { output: "/tmp/out\rfake".into(), ..spec("true") }, "output"),
    ];
    for (s, field) in cases {
        let err = submit(&client, s, "").await.unwrap_err();
        assert_eq!(err.code(), Code::InvalidArgument, "{field}: {err:?}");
        assert!(err.message().starts_with(&format!("{field}:")), "{field}: {}", err.message());
    }
    let err = submit(&client, spec("true"), &"k".repeat(500)).await.unwrap_err();
    assert_eq!(err.code(), Code::InvalidArgument);
    assert!(err.message().contains("idempotency_key"));
    assert_eq!(c.handles[&leader].replica.node.status().last_log_index, before, "a refused request reached the log");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn leader_failover_loses_no_acknowledged_submit() {
    let mut c = TestCluster::start(3).await;
    let client = c.client();
    let mut acked = BTreeSet::new();
    for i in 0..20 {
        acked.insert(submit(&client, spec("true"), &format!("pre-{i}")).await.unwrap().job_id);
    }
    let old = c.leader().await;
    // Submissions racing the failover: each either succeeds or fails retryably.
    let racing = {
        let eps: Vec<String> = c.addrs.values().cloned().collect();
        tokio::spawn(async move {
            let client = Client::new(&eps, "dev:tester", &Security::Insecure).unwrap();
            let mut ok = Vec::new();
            for i in 0..30 {
                match submit(&client, spec("true"), &format!("race-{i}")).await {
                    Ok(r) => ok.push(r.job_id),
                    Err(e) => assert!(gangway_proto::client::is_retryable(&e), "non-retryable failure: {e:?}"),
                }
            }
            ok
        })
    };
    tokio::time::sleep(Duration::from_millis(30)).await;
    c.stop(old).await;
    let new = c.leader().await;
    assert_ne!(new, old);
    acked.extend(racing.await.unwrap());
    let jobs = list_all(&c.client()).await;
    let present: BTreeSet<u64> = jobs.iter().map(|j| j.id).collect();
    assert!(acked.is_subset(&present), "lost: {:?}", acked.difference(&present).collect::<Vec<_>>());
    // Idempotency held across the failover: no key produced two jobs.
    assert!(jobs.len() <= 50, "{} jobs for 50 keys", jobs.len());
    c.restart(old).await;
    c.converge().await;
    assert!(snapshot::encode(&c.state(old)) == snapshot::encode(&c.state(new)), "replica states differ");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn lagging_replica_catches_up_by_snapshot_after_purge() {
    // Replicas 1 and 2 snapshot (and purge) every 20 entries and keep no log after
    // a snapshot; replica 3 never snapshots on its own, so a snapshot it holds
    // was installed from the leader.
    let mut c = TestCluster::start_with(3, |id| Timing {
        snapshot_logs_since_last: if id == 3 { 1_000_000 } else { 20 },
        logs_kept_after_snapshot: 0,
        ..fast_timing()
    })
    .await;
    // Replica 3 must be a follower: if it leads, restart it until another leads.
    let mut leader = c.leader().await;
    for _ in 0..5 {
        if leader != 3 {
            break;
        }
        c.stop(3).await;
        c.leader().await; // 1 and 2 elect a leader before 3 returns
        c.restart(3).await;
        leader = c.leader().await;
    }
    assert_ne!(leader, 3, "replica 3 kept winning elections");
    let lagger = 3;
    let client = c.client_for(&[leader]);
    c.stop(lagger).await;
    for i in 0..120 {
        submit(&client, spec("true"), &format!("k{i}")).await.unwrap();
    }
    c.converge().await;
    assert!(
        c.handles[&leader].replica.node.wait_for(WAIT, |s| s.snapshot_index.unwrap_or(0) > 20).await,
        "the leader never built a snapshot"
    );
    c.restart(lagger).await;
    c.converge().await;
    let st = c.handles[&lagger].replica.node.status();
    assert!(st.snapshot_index.is_some(), "replica 3 caught up without installing a snapshot");
    assert_eq!(c.state(lagger).jobs.len(), 120);
    assert!(snapshot::encode(&c.state(lagger)) == snapshot::encode(&c.state(leader)), "replica states differ");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn full_restart_restores_the_same_state() {
    let mut c = TestCluster::start(3).await;
    let client = c.client();
    // The jobs ask for a GPU the only node lacks: the scheduler leaves them
    // pending, so the state is quiet when it is captured.
    for i in 0..30 {
        submit(&client, pb::JobSpec { gpus_per_node: Some(1), ..spec("true") }, &format!("k{i}")).await.unwrap();
    }
    let reg = pb::RegisterRequest { name: "n1".into(), cpus: 8, mem_mb: 1024, ..Default::default() };
    client
        .call(|ch| {
            let r = client.request(reg.clone());
            async move { AgentServiceClient::new(ch).register(r).await }
        })
        .await
        .unwrap();
    let cancel = pb::CancelRequest { job_id: 3 };
    client.job_cancel(cancel).await.unwrap();
    c.converge().await;
    let before = snapshot::encode(&c.state(1));
    for id in 1..=3 {
        c.stop(id).await;
    }
    for id in 1..=3 {
        c.restart(id).await;
    }
    c.leader().await;
    c.converge().await;
    for id in 1..=3 {
        let mut s = c.state(id);
        // The node may have been marked down by the new leader (no agent runs):
        // compare everything else byte for byte.
        let mut b = snapshot::decode(&before).unwrap();
        for n in s.nodes.values_mut().chain(b.nodes.values_mut()) {
            n.state = NodeState::Up;
            n.state_reason.clear();
            n.state_changed_ms = 0;
        }
        s.clock_ms = 0;
        b.clock_ms = 0;
        assert!(snapshot::encode(&s) == snapshot::encode(&b), "replica {id} restored different state");
    }
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_stopping_leader_hands_leadership_over_first() {
    use gangway_controller::api::admin::hand_over_leadership;
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    // A follower has nothing to hand over.
    let follower = *[1, 2, 3].iter().find(|id| **id != leader).unwrap();
    assert!(hand_over_leadership(&c.handles[&follower].replica).await.is_none());
    // What `gangway controller` does on SIGTERM before it stops.
    // (Another replica may win the election; leadership has moved all the same.)
    let to = hand_over_leadership(&c.handles[&leader].replica).await.expect("the leader hands over");
    assert_ne!(to.expect("leadership moved"), leader);
    assert!(!c.handles[&leader].replica.node.is_leader(), "the stopping replica still leads");
    let now = c.leader().await;
    assert_ne!(now, leader, "leadership did not move");
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn membership_changes_and_leader_transfer() {
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    c.start_joiner(4).await;
    let client = c.client_for(&[1, 2, 3]);
    macro_rules! admin {
        ($m:ident, $req:expr) => {{
            let req = $req;
            client
                .call(|ch| {
                    let r = client.request(req.clone());
                    async move { AdminServiceClient::new(ch).$m(r).await }
                })
                .await
        }};
    }
    let m = admin!(add_learner, pb::AddLearnerRequest { id: 4, addr: c.addrs[&4].clone() }).unwrap().into_inner();
    assert_eq!((m.voters.clone(), m.learners.clone()), (vec![1, 2, 3], vec![4]));
    let err = admin!(promote, pb::PromoteRequest { id: 9 }).unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition, "{err:?}");
    let m = admin!(promote, pb::PromoteRequest { id: 4 }).unwrap().into_inner();
    assert_eq!(m.voters, vec![1, 2, 3, 4]);
    // Transfer leadership to a follower.
    let leader = c.leader().await;
    let target = *[1, 2, 3, 4].iter().find(|id| **id != leader).unwrap();
    let t = admin!(transfer_leader, pb::TransferLeaderRequest { to: target });
    match t {
        Ok(r) => assert_eq!(r.into_inner().leader_id, target),
        // Another replica may win the election; leadership must still have moved.
        Err(e) => assert_eq!(e.code(), Code::Aborted, "{e:?}"),
    }
    let now = c.leader().await;
    assert_ne!(now, leader, "leadership did not move");
    // A transfer whose call is dropped while the leader's heartbeats are
    // paused (its deadline passes during the lease wait) leaves them on.
    let other = *[1, 2, 3, 4].iter().find(|id| **id != now).unwrap();
    let ch = c.client_for(&[now]).channels()[0].clone();
    let mut cut = tonic::Request::new(pb::TransferLeaderRequest { to: other });
    cut.set_timeout(Duration::from_millis(300));
    let cancelled = AdminServiceClient::new(ch).transfer_leader(cut).await.unwrap_err();
    assert!(matches!(cancelled.code(), Code::Cancelled | Code::DeadlineExceeded), "{cancelled:?}");
    let deadline = tokio::time::Instant::now() + WAIT;
    while !c.handles[&now].replica.node.heartbeats_on() {
        assert!(tokio::time::Instant::now() < deadline, "a dropped transfer left the leader's heartbeats off");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let now = c.leader().await;
    // Removing the leader is refused; removing a follower works.
    let err = admin!(remove_member, pb::RemoveMemberRequest { id: now }).unwrap_err();
    assert_eq!(err.code(), Code::FailedPrecondition);
    let victim = *[1, 2, 3, 4].iter().find(|id| **id != now).unwrap();
    let m = admin!(remove_member, pb::RemoveMemberRequest { id: victim }).unwrap().into_inner();
    assert!(!m.voters.contains(&victim) && m.voters.len() == 3, "{m:?}");
    let leader_client = c.client_for(&[now]);
    let st = leader_client
        .call(|ch| {
            let r = leader_client.request(pb::ClusterStatusRequest {});
            async move { AdminServiceClient::new(ch).cluster_status(r).await }
        })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(st.leader_id, Some(now));
    assert_eq!(st.replicas.len(), 3);
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn silent_node_goes_down_and_failover_causes_no_false_alarm() {
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    let eps: Vec<String> = c.addrs.values().cloned().collect();
    let client = c.client();
    // "silent" registers once and never heartbeats.
    let reg = pb::RegisterRequest { name: "silent".into(), cpus: 4, mem_mb: 1024, ..Default::default() };
    client
        .call(|ch| {
            let r = client.request(reg.clone());
            async move { AgentServiceClient::new(ch).register(r).await }
        })
        .await
        .unwrap();
    // "alive" runs a real agent.
    let agent_dir = tempfile::tempdir().unwrap();
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let agent = tokio::spawn(gangway_node_agent::run(
        gangway_node_agent::AgentConfig {
            addr: String::new(),
            cpus: 4,
            mem_mb: 1024,
            gpus: gangway_node_agent::inventory::parse_fake_gpus("2xh100-80gb", "alive").unwrap(),
            stop_grace: Duration::from_secs(1),
            gpu_fault_file: None,
            gpu_load_file: None,
            ..gangway_node_agent::AgentConfig::simulated(eps, "alive", agent_dir.path().to_path_buf())
        },
        async {
            let _ = stop_rx.await;
        },
    ));
    let node_state = |c: &TestCluster, name: &str| -> Option<NodeState> {
        let id = *c.handles.keys().next().unwrap();
        c.state(id).nodes.get(name).map(|n| n.state)
    };
    eventually("silent node never marked down", || node_state(&c, "silent") == Some(NodeState::Down)).await;
    assert_eq!(node_state(&c, "alive"), Some(NodeState::Up));
    // Kill the leader; the heartbeating node must stay up through the failover and
    // for longer than the down timeout afterwards.
    let old = c.leader().await;
    c.stop(old).await;
    c.leader().await;
    let until = tokio::time::Instant::now() + Duration::from_millis(3 * 2_000);
    while tokio::time::Instant::now() < until {
        assert_eq!(node_state(&c, "alive"), Some(NodeState::Up), "false node failure after failover");
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    // Node API shows it, with the leader's heartbeat age.
    let req = pb::GetNodeRequest { name: "alive".into(), stale: false };
    let n = client.node_get(req.clone()).await.unwrap().into_inner();
    assert_eq!(n.gpus.len(), 2);
    assert!(n.last_heartbeat_age_ms.is_some());
    let _ = stop_tx.send(());
    agent.await.unwrap().unwrap();
    // A leader that lost its quorum keeps its role (it hears of no newer
    // term) but may already be deposed: it refuses heartbeats, so an agent
    // cut off from the real leader cannot count it as contact.
    let leader = c.leader().await;
    let follower = *c.handles.keys().find(|&&id| id != leader).unwrap();
    c.stop(follower).await;
    assert!(c.handles[&leader].replica.node.is_leader());
    let ch = tonic::transport::Endpoint::from_shared(format!("http://{}", c.addrs[&leader])).unwrap().connect_lazy();
    let hb = pb::HeartbeatRequest { name: "alive".into(), ..Default::default() };
    let mut refused = None;
    for _ in 0..50 {
        match AgentServiceClient::new(ch.clone()).heartbeat(client.request(hb.clone())).await {
            Err(s) if s.code() == tonic::Code::Unavailable => {
                refused = Some(s);
                break;
            }
            _ => tokio::time::sleep(Duration::from_millis(100)).await,
        }
    }
    let refused = refused.expect("a leader without a quorum kept answering heartbeats");
    assert!(refused.message().contains("quorum"), "{}", refused.message());
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn watch_health_and_reflection() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let addr = format!("http://{}", c.addrs[&1]);
    let channel = tonic::transport::Endpoint::from_shared(addr).unwrap().connect().await.unwrap();
    let mut stream =
        JobServiceClient::new(channel.clone()).watch(pb::WatchRequest { job_id: 0 }).await.unwrap().into_inner();
    let job = submit(&c.client(), spec("true"), "w").await.unwrap();
    let ev = tokio::time::timeout(WAIT, stream.message()).await.unwrap().unwrap().unwrap();
    assert_eq!((ev.job_id, ev.state), (job.job_id, pb::JobState::Pending as i32));
    // Standard health service.
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel.clone());
    let r = health
        .check(tonic_health::pb::HealthCheckRequest { service: "gangway.v1.JobService".into() })
        .await
        .unwrap()
        .into_inner();
    assert_eq!(r.status, tonic_health::pb::health_check_response::ServingStatus::Serving as i32);
    // Server reflection (what grpcurl uses) lists our services and health.
    use tonic_reflection::pb::v1::server_reflection_client::ServerReflectionClient;
    use tonic_reflection::pb::v1::server_reflection_request::MessageRequest;
    use tonic_reflection::pb::v1::server_reflection_response::MessageResponse;
    use tonic_reflection::pb::v1::ServerReflectionRequest;
    let req = ServerReflectionRequest {
        host: String::new(),
        message_request: Some(MessageRequest::ListServices(String::new())),
    };
    let mut replies = ServerReflectionClient::new(channel)
        .server_reflection_info(tokio_stream::iter(vec![req]))
        .await
        .unwrap()
        .into_inner();
    let reply = replies.message().await.unwrap().unwrap();
    let Some(MessageResponse::ListServicesResponse(list)) = reply.message_response else {
        panic!("unexpected reflection reply {reply:?}")
    };
    let names: BTreeSet<String> = list.service.into_iter().map(|s| s.name).collect();
    for svc in ["gangway.v1.JobService", "gangway.v1.NodeService", "gangway.v1.AdminService", "grpc.health.v1.Health"] {
        assert!(names.contains(svc), "reflection lacks {svc}: {names:?}");
    }
    c.shutdown().await;
}

// ------------------------------------------------------------------ jobs on real agents

struct TestAgent {
    stop: tokio::sync::oneshot::Sender<()>,
    task: tokio::task::JoinHandle<anyhow::Result<()>>,
}

impl TestAgent {
    fn start(c: &TestCluster, name: &str, gpus: &str, state_dir: &std::path::Path) -> TestAgent {
        Self::start_with(c, name, gpus, state_dir, None, None)
    }

    fn start_with(
        c: &TestCluster,
        name: &str,
        gpus: &str,
        state_dir: &std::path::Path,
        health_check: Option<(std::path::PathBuf, Duration)>,
        metrics_listen: Option<String>,
    ) -> TestAgent {
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let config = gangway_node_agent::AgentConfig {
            cpus: 8,
            mem_mb: 8192,
            gpus: gangway_node_agent::inventory::parse_fake_gpus(gpus, name).unwrap(),
            stop_grace: Duration::from_secs(1),
            gpu_hold_down: Duration::from_millis(500),
            health_check,
            metrics_listen,
            ..gangway_node_agent::AgentConfig::simulated(
                c.addrs.values().cloned().collect(),
                name,
                state_dir.to_path_buf(),
            )
        };
        let task = tokio::spawn(gangway_node_agent::run(config, async {
            let _ = stop_rx.await;
        }));
        TestAgent { stop, task }
    }

    async fn stop(self) {
        let _ = self.stop.send(());
        self.task.await.unwrap().unwrap();
    }
}

fn script_spec(script: &str, workdir: &std::path::Path) -> pb::JobSpec {
    pb::JobSpec {
        script: format!("#!/bin/sh\n{script}\n"),
        workdir: workdir.display().to_string(),
        user: "root".into(),
        ..Default::default()
    }
}

async fn get_job(client: &Client, job_id: u64) -> pb::Job {
    let req = pb::GetJobRequest { job_id, stale: false };
    client.job_get(req).await.unwrap().into_inner()
}

async fn wait_state(client: &Client, job_id: u64, state: pb::JobState) -> pb::Job {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let job = get_job(client, job_id).await;
        if job.state == state as i32 {
            return job;
        }
        assert!(tokio::time::Instant::now() < deadline, "job {job_id} never reached {state:?}: {job:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// Polls `cond` until it holds; fails the test with `what` after [`WAIT`].
async fn eventually(what: &str, mut cond: impl FnMut() -> bool) {
    let deadline = tokio::time::Instant::now() + WAIT;
    while !cond() {
        assert!(tokio::time::Instant::now() < deadline, "{what}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

fn pid_alive(pid: i32) -> bool {
    nix::sys::signal::kill(nix::unistd::Pid::from_raw(pid), None).is_ok()
}

async fn wait_file(path: &std::path::Path) -> String {
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        if let Ok(s) = std::fs::read_to_string(path) {
            if !s.trim().is_empty() {
                return s;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "{} never appeared", path.display());
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn gang_job_runs_on_both_nodes_with_consistent_environment() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let (d1, d2, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let a1 = TestAgent::start(&c, "gw-node-1", "4xh100-80gb", d1.path());
    let a2 = TestAgent::start(&c, "gw-node-2", "4xh100-80gb", d2.path());
    let client = c.client();
    let mut spec = script_spec(
        "env | grep -E '^(SLURM_|MASTER_|RANK=|WORLD_SIZE=|NODE_RANK=|LOCAL_RANK=|CUDA_VISIBLE_DEVICES=)' | sort > env-$SLURM_NODEID",
        work.path(),
    );
    spec.nodes = Some(2);
    spec.gpus_per_node = Some(2);
    spec.gpu_type = "h100".into();
    spec.name = "train".into();
    spec.output = "logs-%x-%j.%N.%t.out".into();
    let id = submit(&client, spec, "gang").await.unwrap().job_id;
    wait_state(&client, id, pb::JobState::Completed).await;
    for (rank, node) in [(0, "gw-node-1"), (1, "gw-node-2")] {
        let log = work.path().join(format!("logs-train-{id}.{node}.{rank}.out"));
        assert!(log.exists(), "{} missing", log.display());
    }
    let parse = |rank: u32| -> BTreeMap<String, String> {
        std::fs::read_to_string(work.path().join(format!("env-{rank}")))
            .unwrap()
            .lines()
            .filter_map(|l| l.split_once('=').map(|(k, v)| (k.to_string(), v.to_string())))
            .collect()
    };
    let (r0, r1) = (parse(0), parse(1));
    for key in [
        "MASTER_ADDR",
        "MASTER_PORT",
        "WORLD_SIZE",
        "SLURM_JOB_ID",
        "SLURM_JOB_NODELIST",
        "SLURM_NNODES",
        "SLURM_NTASKS",
    ] {
        assert_eq!(r0.get(key), r1.get(key), "{key} differs between ranks");
        assert!(r0.contains_key(key), "{key} missing");
    }
    assert_eq!(r0["SLURM_JOB_NODELIST"], "gw-node-[1-2]");
    assert_eq!(r0["WORLD_SIZE"], "2");
    assert_eq!((r0["RANK"].as_str(), r1["RANK"].as_str()), ("0", "1"));
    assert_eq!((r0["NODE_RANK"].as_str(), r1["NODE_RANK"].as_str()), ("0", "1"));
    assert_eq!(r0["CUDA_VISIBLE_DEVICES"].split(',').count(), 2);
    assert_eq!(r0["SLURM_JOB_ID"], id.to_string());
    a1.stop().await;
    a2.stop().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn cancel_and_time_limit_kill_the_whole_process_tree() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let (d1, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let agent = TestAgent::start(&c, "gw-node-1", "2xh100-80gb", d1.path());
    let client = c.client();
    // The script and its child both ignore SIGTERM: only SIGKILL of the group ends them.
    let id = submit(&client, script_spec("trap '' TERM; sleep 300 & echo $! > child.pid; wait", work.path()), "c")
        .await
        .unwrap()
        .job_id;
    wait_state(&client, id, pb::JobState::Running).await;
    let child: i32 = wait_file(&work.path().join("child.pid")).await.trim().parse().unwrap();
    assert!(pid_alive(child));
    let req = pb::CancelRequest { job_id: id };
    client.job_cancel(req).await.unwrap();
    eventually("the SIGTERM-ignoring child survived the cancel", || !pid_alive(child)).await;
    assert_eq!(get_job(&client, id).await.state, pb::JobState::Cancelled as i32);
    // A time limit ends the job the same way, after the --signal warning.
    let mut spec = script_spec(
        "trap 'echo warned > warned' USR1; (trap '' USR1; exec sleep 300) & echo $! > child2.pid; wait; wait",
        work.path(),
    );
    spec.time_limit_s = Some(2);
    spec.warn_signal = 10; // SIGUSR1
    spec.warn_before_s = 1;
    let id = submit(&client, spec, "t").await.unwrap().job_id;
    let job = wait_state(&client, id, pb::JobState::Timeout).await;
    assert!(job.reason.contains("time limit"), "{}", job.reason);
    let child: i32 = wait_file(&work.path().join("child2.pid")).await.trim().parse().unwrap();
    eventually("a timed-out job's process survived", || !pid_alive(child)).await;
    assert_eq!(std::fs::read_to_string(work.path().join("warned")).unwrap().trim(), "warned");
    agent.stop().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failed_launches_are_reported_and_an_attempt_never_runs_twice() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let (d1, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let agent = TestAgent::start(&c, "gw-node-1", "2xh100-80gb", d1.path());
    let client = c.client();
    // A working directory that does not exist fails the attempt with the reason.
    let bad = submit(&client, script_spec("true", std::path::Path::new("/nonexistent/gangway-dir")), "bad")
        .await
        .unwrap()
        .job_id;
    let job = wait_state(&client, bad, pb::JobState::Failed).await;
    assert!(job.reason.contains("does not exist"), "{}", job.reason);
    // A non-zero exit fails the job with its exit code.
    let failing = submit(&client, script_spec("exit 3", work.path()), "exit3").await.unwrap().job_id;
    let job = wait_state(&client, failing, pb::JobState::Failed).await;
    assert_eq!(job.exit_code, Some(3));
    // A running task, then the agent restarts (its tasks die with it): the leader
    // still wants attempt 1, the agent's fence refuses to start it again and
    // reports it lost, and the job is requeued as attempt 2. Each attempt ran once.
    let id = submit(&client, script_spec("echo $GANGWAY_ATTEMPT >> starts; sleep 300", work.path()), "once")
        .await
        .unwrap()
        .job_id;
    wait_state(&client, id, pb::JobState::Running).await;
    wait_file(&work.path().join("starts")).await;
    agent.stop().await;
    let agent = TestAgent::start(&c, "gw-node-1", "2xh100-80gb", d1.path());
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let starts = std::fs::read_to_string(work.path().join("starts")).unwrap();
        if starts.lines().count() >= 2 {
            assert_eq!(starts.lines().collect::<Vec<_>>(), vec!["1", "2"], "an attempt ran twice");
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the lost attempt was not requeued");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let job = get_job(&client, id).await;
    assert_eq!((job.state, job.attempt), (pb::JobState::Running as i32, 2));
    agent.stop().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn jobs_survive_a_leader_failover_and_an_isolated_agent_stops_its_tasks() {
    let mut c = TestCluster::start(3).await;
    c.leader().await;
    let (d1, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let agent = TestAgent::start(&c, "gw-node-1", "2xh100-80gb", d1.path());
    let client = c.client();
    // Kill the leader while a job runs: the job finishes normally.
    let id = submit(&client, script_spec("sleep 2; echo done > finished", work.path()), "f").await.unwrap().job_id;
    wait_state(&client, id, pb::JobState::Running).await;
    let old = c.leader().await;
    c.stop(old).await;
    c.leader().await;
    wait_state(&client, id, pb::JobState::Completed).await;
    assert_eq!(std::fs::read_to_string(work.path().join("finished")).unwrap().trim(), "done");
    let any = *c.handles.keys().next().unwrap();
    assert_eq!(c.state(any).nodes["gw-node-1"].state, NodeState::Up, "a failover marked the node down");
    c.restart(old).await;
    // Cut the agent off from every controller: it stops its task on its own.
    let id = submit(&client, script_spec("echo $$ > pid-$GANGWAY_ATTEMPT; exec sleep 300", work.path()), "iso")
        .await
        .unwrap()
        .job_id;
    wait_state(&client, id, pb::JobState::Running).await;
    let pid: i32 = wait_file(&work.path().join("pid-1")).await.trim().parse().unwrap();
    for id in 1..=3 {
        c.stop(id).await;
    }
    eventually("an isolated agent kept its task running", || !pid_alive(pid)).await;
    // Back online: the lost attempt is requeued and runs again as attempt 2.
    for id in 1..=3 {
        c.restart(id).await;
    }
    c.leader().await;
    wait_file(&work.path().join("pid-2")).await;
    let job = get_job(&c.client(), id).await;
    assert_eq!(job.attempt, 2);
    agent.stop().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_gpu_is_quarantined_alone_and_its_job_requeued() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let (d1, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let agent = TestAgent::start(&c, "gw-node-1", "2xh100-80gb", d1.path());
    let client = c.client();
    let mut spec = script_spec("echo $CUDA_VISIBLE_DEVICES >> gpus; sleep 300", work.path());
    spec.gpus_per_node = Some(1);
    let id = submit(&client, spec, "g").await.unwrap().job_id;
    wait_state(&client, id, pb::JobState::Running).await;
    let first_gpu = wait_file(&work.path().join("gpus")).await.trim().to_string();
    // Inject a fault on the GPU the job holds.
    std::fs::write(d1.path().join("gpu-faults"), format!("{first_gpu} xid 79: GPU has fallen off the bus\n")).unwrap();
    let node_of = |c: &TestCluster| {
        let any = *c.handles.keys().next().unwrap();
        c.state(any).nodes["gw-node-1"].clone()
    };
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let job = get_job(&client, id).await;
        if job.attempt == 2 && job.state == pb::JobState::Running as i32 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the job was not requeued off the failed GPU: {job:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let node = node_of(&c);
    let bad: u32 = first_gpu.parse().unwrap();
    assert_eq!(node.gpus[bad as usize].health, gangway_core::GpuHealth::Quarantined);
    assert!(node.gpus[bad as usize].health_reason.contains("xid 79"));
    assert_eq!(node.state, NodeState::Up, "one bad GPU must not take the node out");
    let job = get_job(&client, id).await;
    assert_ne!(job.allocation[0].gpus, vec![bad], "attempt 2 landed on the quarantined GPU");
    // Clear the fault: after the hold-down the GPU returns to service.
    std::fs::write(d1.path().join("gpu-faults"), "").unwrap();
    eventually("the GPU never recovered", || node_of(&c).gpus[bad as usize].health == gangway_core::GpuHealth::Healthy)
        .await;
    agent.stop().await;
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn failing_health_check_program_drains_the_node() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let d1 = tempfile::tempdir().unwrap();
    let program = d1.path().join("check.sh");
    std::fs::write(&program, "#!/bin/sh\necho 'scratch disk full'\nexit 1\n").unwrap();
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&program, std::fs::Permissions::from_mode(0o755)).unwrap();
    let agent = TestAgent::start_with(
        &c,
        "gw-node-1",
        "1xh100-80gb",
        d1.path(),
        Some((program, Duration::from_millis(200))),
        None,
    );
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let any = *c.handles.keys().next().unwrap();
        if let Some(n) = c.state(any).nodes.get("gw-node-1") {
            if n.state == NodeState::Drain {
                assert!(n.state_reason.contains("scratch disk full"), "{}", n.state_reason);
                break;
            }
        }
        assert!(tokio::time::Instant::now() < deadline, "the failing health check never drained the node");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    agent.stop().await;
    c.shutdown().await;
}

// ------------------------------------------------------------------ scheduling policy through the API

async fn update_job(
    client: &Client,
    job_id: u64,
    change: pb::update_job_request::Change,
) -> Result<pb::Job, tonic::Status> {
    let req = pb::UpdateJobRequest { job_id, change: change as i32, value: 0, ..Default::default() };
    client.job_update(req).await.map(|r| r.into_inner())
}

async fn explain(client: &Client, job_id: u64) -> pb::Explanation {
    let req = pb::ExplainRequest { job_id, stale: false };
    client.job_explain(req).await.unwrap().into_inner()
}

/// Policy updates (compare-and-set), hold/release with a pending reason,
/// dependencies and an array with a throttle, and a preemption that warns the
/// victim, waits for it to leave its GPUs, then starts the preemptor there —
/// all with real job processes on a real agent.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn policy_dependencies_arrays_and_preemption_on_a_real_agent() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    c.wait_newest_format().await;
    let (d1, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let agent = TestAgent::start(&c, "gw-node-1", "2xh100-80gb", d1.path());
    let client = c.client();
    let policy = serde_json::json!({
        "qos": {
            "low": { "priority": 0, "preempt_grace_s": 2 },
            "high": { "priority": 100, "preempt": ["low"] }
        },
        "accounts": { "ml": { "shares": 2 } },
        "users": { "root": { "accounts": ["ml"] } },
        "allow_root_jobs": true
    });
    async fn put(client: &Client, json: String, expected: Option<u64>) -> Result<pb::Policy, tonic::Status> {
        let req = pb::UpdatePolicyRequest { json, expected_version: expected, force: false };
        client.admin_update_policy(req.clone()).await.map(|r| r.into_inner())
    }
    // Version 1 is the bootstrap admin's, version 2 the move to format 6
    // (which carried --allow-root-jobs into the policy); this edit is based on it.
    let v1 = c.handles.values().next().unwrap().replica.node.state().read().policy.version;
    assert_eq!(v1, 2, "the bootstrap admin, then the carried switches");
    let v2 = put(&client, policy.to_string(), Some(v1)).await.unwrap();
    assert_eq!(v2.version, v1 + 1);
    // The imported policy names no admins: the current ones stay.
    assert!(v2.json.contains("\"admins\":[\"tester\"]"), "{}", v2.json);
    assert!(v2.json.contains("\"allow_root_jobs\":true"), "{}", v2.json);
    let stale = put(&client, policy.to_string(), Some(v1)).await.unwrap_err();
    assert_eq!(stale.code(), Code::Aborted, "{stale:?}");
    let bad = put(&client, r#"{"qos": {"high": {"preempt": ["nope"]}}}"#.into(), None).await.unwrap_err();
    assert_eq!(bad.code(), Code::InvalidArgument);
    assert!(bad.message().contains("qos.high.preempt"), "{}", bad.message());

    // Hold, then release: the pending reason says why.
    let mut held = script_spec("true", work.path());
    held.hold = true;
    let h = submit(&client, held, "held").await.unwrap().job_id;
    let e = explain(&client, h).await;
    assert_eq!(e.reason, "JobHeldUser", "{e:?}");
    update_job(&client, h, pb::update_job_request::Change::Release).await.unwrap();
    wait_state(&client, h, pb::JobState::Completed).await;

    // afterok runs after its parent; afternotok of a success is cancelled.
    let a = submit(&client, script_spec("sleep 0.3; echo a >> order", work.path()), "a").await.unwrap().job_id;
    let mut b = script_spec("echo b >> order", work.path());
    b.dependency = format!("afterok:{a}");
    let b = submit(&client, b, "b").await.unwrap().job_id;
    let mut n = script_spec("echo never >> order", work.path());
    n.dependency = format!("afternotok:{a}");
    let n = submit(&client, n, "n").await.unwrap().job_id;
    assert_eq!(explain(&client, b).await.reason, "Dependency");
    wait_state(&client, b, pb::JobState::Completed).await;
    let never = wait_state(&client, n, pb::JobState::Cancelled).await;
    assert!(never.reason.contains("DependencyNeverSatisfied"), "{}", never.reason);
    assert_eq!(std::fs::read_to_string(work.path().join("order")).unwrap(), "a\nb\n");

    // An array of 4 with at most one element at a time.
    let mut arr = script_spec("echo start >> arr; sleep 0.2; echo $SLURM_ARRAY_TASK_ID end >> arr", work.path());
    arr.array = "0-3%1".into();
    let resp = submit(&client, arr, "arr").await.unwrap();
    assert_eq!(resp.count, 4);
    for id in resp.job_id..resp.job_id + 4 {
        wait_state(&client, id, pb::JobState::Completed).await;
    }
    let log = std::fs::read_to_string(work.path().join("arr")).unwrap();
    assert_eq!(log, "start\n0 end\nstart\n1 end\nstart\n2 end\nstart\n3 end\n", "the throttle let elements overlap");
    assert!(work.path().join(format!("slurm-{}_3.out", resp.job_id)).exists(), "array output is slurm-%A_%a.out");

    // Preemption: a low-QOS job holds both GPUs; a high-QOS job takes them.
    let mut low = script_spec(
        "trap 'echo warned >> victim; sleep 0.5; echo left >> victim; exit 0' TERM; echo started >> victim; sleep 300 & wait",
        work.path(),
    );
    low.qos = "low".into();
    low.gpus_per_node = Some(2);
    let low = submit(&client, low, "low").await.unwrap().job_id;
    wait_state(&client, low, pb::JobState::Running).await;
    wait_file(&work.path().join("victim")).await;
    let mut high = script_spec("cat victim > seen-by-high", work.path());
    high.qos = "high".into();
    high.gpus_per_node = Some(2);
    let high = submit(&client, high, "high").await.unwrap().job_id;
    wait_state(&client, high, pb::JobState::Completed).await;
    let seen = std::fs::read_to_string(work.path().join("seen-by-high")).unwrap();
    assert!(seen.contains("warned") && seen.contains("left"), "the preemptor started before the victim left: {seen:?}");
    let victim = get_job(&client, low).await;
    assert_eq!(victim.preempted, 1, "{victim:?}");
    // The victim is requeued and runs again once the preemptor is done.
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let j = get_job(&client, low).await;
        if j.attempt == 2 && j.state == pb::JobState::Running as i32 {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "the preempted job never ran again: {j:?}");
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    let cancel = pb::CancelRequest { job_id: low };
    client.job_cancel(cancel).await.unwrap();
    agent.stop().await;
    c.shutdown().await;
}

/// A tool from the `prometheus` package; `make test` installs it (deploy/setup-debian.sh).
fn prometheus_tool(name: &str) -> std::path::PathBuf {
    let found = std::env::var_os("PATH")
        .into_iter()
        .flat_map(|p| std::env::split_paths(&p).collect::<Vec<_>>())
        .map(|d| d.join(name))
        .find(|p| p.is_file());
    found.unwrap_or_else(|| panic!("{name} is missing: install Debian's prometheus package (make test does)"))
}

/// A plain HTTP GET: the body of a 200 answer.
async fn http_get(addr: &str, path: &str) -> String {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut conn = tokio::net::TcpStream::connect(addr).await.unwrap();
    conn.write_all(format!("GET {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n\r\n").as_bytes())
        .await
        .unwrap();
    let mut raw = Vec::new();
    tokio::time::timeout(WAIT, conn.read_to_end(&mut raw)).await.unwrap().unwrap();
    let text = String::from_utf8_lossy(&raw).into_owned();
    let (head, body) = text.split_once("\r\n\r\n").unwrap();
    assert!(head.starts_with("HTTP/1.1 200"), "{head}");
    body.to_string()
}

fn url_encode(s: &str) -> String {
    s.bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'_' | b'-' | b'.' => (b as char).to_string(),
            _ => format!("%{b:02X}"),
        })
        .collect()
}

/// Prometheus' instant query: the first result's value, if any.
async fn prom_query(addr: &str, q: &str) -> Option<String> {
    let body = http_get(addr, &format!("/api/v1/query?query={}", url_encode(q))).await;
    let v: serde_json::Value = serde_json::from_str(&body).ok()?;
    v["data"]["result"][0]["value"][1].as_str().map(str::to_string)
}

/// Killed when the test ends, however it ends.
struct KillOnDrop(std::process::Child);

impl Drop for KillOnDrop {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

/// Controllers and agents serve metrics that Prometheus' own `promtool` accepts,
/// and a real Prometheus server scrapes them: one leader among the replicas, and
/// the GPU a job holds labelled with the job's id.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn metrics_pass_promtool_and_a_real_prometheus_scrapes_them() {
    let (promtool, prometheus) = (prometheus_tool("promtool"), prometheus_tool("prometheus"));
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let mut targets = BTreeMap::new();
    let mut serving = Vec::new();
    for (id, h) in &c.handles {
        let l = bind("127.0.0.1:0").await;
        targets.insert(*id, l.local_addr().unwrap().to_string());
        serving.push(gangway_controller::telemetry::serve(h.replica.clone(), l, None));
    }
    let agent_addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let (d1, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let agent = TestAgent::start_with(&c, "gw-metrics-1", "2xh100-80gb", d1.path(), None, Some(agent_addr.clone()));
    let client = c.client();
    let spec = pb::JobSpec { gpus_per_node: Some(1), ..script_spec("sleep 60", work.path()) };
    let id = submit(&client, spec, "metrics").await.unwrap().job_id;
    wait_state(&client, id, pb::JobState::Running).await;
    // Two GPUs while one is held: pending for Resources.
    let spec = pb::JobSpec { gpus_per_node: Some(2), ..script_spec("true", work.path()) };
    submit(&client, spec, "metrics-pending").await.unwrap();
    let wants = [
        "gangway_raft_leader 1",
        "gangway_jobs{state=\"running\"} 1",
        "gangway_gpus{state=\"allocated\"} 1",
        "gangway_pending_jobs{reason=\"Resources\"} 1",
        // No accounting service here: nothing waits for one.
        "gangway_unaccounted_finished_jobs 0",
    ];
    let mut leader_text = String::new();
    for _ in 0..100 {
        leader_text = http_get(&targets[&leader], "/metrics").await;
        if wants.iter().all(|w| leader_text.contains(w)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    for want in wants {
        assert!(leader_text.contains(want), "{want} missing from:\n{leader_text}");
    }
    assert!(leader_text.contains("gangway_jobs_started_total"), "{leader_text}");
    let held = format!("job_id=\"{id}\"}} 1");
    let mut agent_text = String::new();
    for _ in 0..100 {
        agent_text = http_get(&agent_addr, "/metrics").await;
        if agent_text.lines().any(|l| l.starts_with("gangway_gpu_allocated{") && l.ends_with(&held)) {
            break;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    assert!(agent_text.lines().any(|l| l.starts_with("gangway_gpu_allocated{") && l.ends_with(&held)), "{agent_text}");
    for text in [&leader_text, &agent_text] {
        use std::io::Write;
        let mut check = std::process::Command::new(&promtool)
            .args(["check", "metrics"])
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .stderr(std::process::Stdio::piped())
            .spawn()
            .unwrap();
        check.stdin.take().unwrap().write_all(text.as_bytes()).unwrap();
        let out = check.wait_with_output().unwrap();
        assert!(
            out.status.success(),
            "promtool check metrics: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }

    // The Grafana dashboard in deploy/ charts only metrics that exist (NVML's
    // readings are absent with simulated GPUs).
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    let dashboard = std::path::Path::new(&manifest).join("../deploy/grafana/gangway-dashboard.json");
    let dashboard: serde_json::Value = serde_json::from_str(&std::fs::read_to_string(dashboard).unwrap()).unwrap();
    let nvml_only = ["utilization_ratio", "temperature_celsius", "memory_used_bytes", "power_watts"];
    let mut charted = 0;
    for p in dashboard["panels"].as_array().unwrap() {
        for t in p["targets"].as_array().into_iter().flatten() {
            let expr = t["expr"].as_str().unwrap();
            for name in
                expr.split(|c: char| !(c.is_ascii_alphanumeric() || c == '_')).filter(|w| w.starts_with("gangway_"))
            {
                charted += 1;
                let exported = leader_text.contains(&format!("\n{name}")) || agent_text.contains(&format!("\n{name}"));
                assert!(
                    exported || nvml_only.iter().any(|n| name.ends_with(n)),
                    "the dashboard charts {name}, which is not exported"
                );
            }
        }
    }
    assert!(charted >= 20, "{charted}");

    // A real Prometheus scrapes the three replicas and the agent every second.
    let dir = tempfile::tempdir().unwrap();
    let mut all: Vec<String> = targets.values().cloned().collect();
    all.push(agent_addr.clone());
    let list: Vec<String> = all.iter().map(|t| format!("'{t}'")).collect();
    let config = dir.path().join("prometheus.yml");
    std::fs::write(
        &config,
        format!(
            "global:\n  scrape_interval: 1s\n  evaluation_interval: 1s\nscrape_configs:\n  - job_name: gangway\n    static_configs:\n      - targets: [{}]\n",
            list.join(", ")
        ),
    )
    .unwrap();
    let prom_addr = {
        let l = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        l.local_addr().unwrap().to_string()
    };
    let log = std::fs::File::create(dir.path().join("prometheus.log")).unwrap();
    let _prom = KillOnDrop(
        std::process::Command::new(&prometheus)
            .arg(format!("--config.file={}", config.display()))
            .arg(format!("--storage.tsdb.path={}", dir.path().join("data").display()))
            .arg(format!("--web.listen-address={prom_addr}"))
            .stdin(std::process::Stdio::null())
            .stdout(std::process::Stdio::null())
            .stderr(log)
            .spawn()
            .unwrap(),
    );
    let deadline = tokio::time::Instant::now() + Duration::from_secs(60);
    let queries = [
        ("count(up{job=\"gangway\"} == 1)".to_string(), "4"),
        ("sum(gangway_raft_leader)".to_string(), "1"),
        (format!("gangway_gpu_allocated{{job_id=\"{id}\"}}"), "1"),
        ("sum(gangway_nodes{state=\"up\"}) / 3".to_string(), "1"),
    ];
    for (q, want) in &queries {
        loop {
            let ready = tokio::net::TcpStream::connect(&prom_addr).await.is_ok();
            let got = if ready { prom_query(&prom_addr, q).await } else { None };
            if got.as_deref() == Some(*want) {
                break;
            }
            assert!(
                tokio::time::Instant::now() < deadline,
                "Prometheus never answered {q} with {want} (last: {got:?}); log in {}",
                dir.path().display()
            );
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
    }
    for t in serving {
        t.abort();
    }
    agent.stop().await;
    c.shutdown().await;
}

/// The event stream carries job and node events in log order, and a follower
/// whose replica dies resumes on another one without losing or repeating an
/// event; a stream can also start from a past index.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn events_stream_and_resume_across_a_replica_failure() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let victim = *c.handles.keys().find(|&&id| id != leader).unwrap();
    let (d1, work) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let agent = TestAgent::start(&c, "gw-events-1", "2xh100-80gb", d1.path());
    let client = c.client();
    // The follower streams from `victim` first (its first endpoint).
    let mut order: Vec<u64> = vec![victim];
    order.extend(c.handles.keys().filter(|&&id| id != victim));
    let follower = c.client_for(&order);
    let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<pb::ClusterEvent>::new()));
    let sink = seen.clone();
    let follow = tokio::spawn(async move {
        gangway_proto::events::follow(&follower, 0, |ev| {
            let mut s = sink.lock().unwrap();
            s.push(ev.clone());
            // Stop once the second job has finished.
            !(ev.kind == "finished" && s.iter().filter(|e| e.kind == "finished").count() == 2)
        })
        .await
    });
    tokio::time::sleep(Duration::from_millis(300)).await;
    let a = submit(&client, script_spec("sleep 1", work.path()), "ev-a").await.unwrap().job_id;
    wait_state(&client, a, pb::JobState::Running).await;
    c.stop(victim).await;
    wait_state(&client, a, pb::JobState::Completed).await;
    let b = submit(&client, script_spec("true", work.path()), "ev-b").await.unwrap().job_id;
    wait_state(&client, b, pb::JobState::Completed).await;
    if tokio::time::timeout(WAIT, follow).await.is_err() {
        panic!("the follower never saw both jobs finish: {:#?}", seen.lock().unwrap());
    }
    let events = seen.lock().unwrap().clone();
    let kinds =
        |job: u64| -> Vec<String> { events.iter().filter(|e| e.job_id == job).map(|e| e.kind.clone()).collect() };
    assert_eq!(kinds(a), ["submitted", "started", "finished"], "{events:#?}");
    assert_eq!(kinds(b), ["submitted", "started", "finished"], "{events:#?}");
    assert!(events.windows(2).all(|w| w[0].index <= w[1].index), "out of order: {events:#?}");

    // One job's events only (the console's job page): b's, from the first kept.
    let ch = c.client_for(&[leader]).channels()[0].clone();
    let mut only = JobServiceClient::new(ch)
        .events(client.request(pb::EventsRequest { from_index: 1, job_id: b, ..Default::default() }))
        .await
        .unwrap()
        .into_inner();
    let mut of_b = Vec::new();
    while of_b.len() < 4 {
        let ev = tokio::time::timeout(WAIT, only.message()).await.unwrap().unwrap().unwrap();
        of_b.push(ev.kind.clone());
        if ev.kind == "finished" {
            break;
        }
        assert!(ev.kind == "stream_start" || ev.job_id == b, "another job's event: {ev:?}");
    }
    assert_eq!(of_b, ["stream_start", "submitted", "started", "finished"]);

    // From a past index: the stream starts there (here, job a's start).
    let started = events.iter().find(|e| e.job_id == a && e.kind == "started").unwrap().index;
    c.restart(victim).await;
    let drained = pb::DrainRequest { name: "gw-events-1".into(), reason: "maintenance".into() };
    client.node_drain(drained.clone()).await.unwrap();
    let mut replay = Vec::new();
    gangway_proto::events::follow(&c.client(), started, |ev| {
        replay.push(ev.clone());
        ev.kind != "node_drain"
    })
    .await
    .unwrap();
    assert_eq!(replay[0].index, started, "{replay:#?}");
    assert_eq!(replay.iter().filter(|e| e.job_id == b).count(), 3, "{replay:#?}");
    let drain = replay.last().unwrap();
    assert_eq!((drain.node.as_str(), drain.reason.as_str()), ("gw-events-1", "maintenance"));

    // A replica restarted from a snapshot no longer knows the events before it:
    // asking it for them is OUT_OF_RANGE (not a silent gap).
    let leader = c.leader().await;
    let other = *c.handles.keys().find(|&&id| id != leader).unwrap();
    // A follower (perhaps the one just restarted) may still be catching up.
    let caught_up = c.handles[&other].replica.node.wait_for(WAIT, |s| s.applied_index >= Some(drain.index)).await;
    assert!(caught_up, "replica {other} never applied index {}", drain.index);
    let snap = c.handles[&other].replica.node.snapshot(WAIT).await.unwrap();
    assert!(snap >= started, "snapshot at {snap}, before {started}");
    c.stop(other).await;
    c.restart(other).await;
    let only = c.client_for(&[other]);
    let gone = gangway_proto::events::follow(&only, started, |_| false).await.unwrap_err();
    assert_eq!(gone.code(), tonic::Code::OutOfRange, "{gone:?}");
    assert!(gone.message().contains("no longer kept"), "{}", gone.message());
    agent.stop().await;
    c.shutdown().await;
}

/// Scheduling analyses (explain, test-submit) run at most ANALYSES_MAX at
/// once per replica: one past it is RESOURCE_EXHAUSTED with a retry hint, and
/// a freed permit lets the next one run. A test submission submits nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn scheduling_analyses_are_limited_per_replica() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let client = c.client_for(&[leader]);
    let work = tempfile::tempdir().unwrap();
    let job = submit(&client, script_spec("true", work.path()), "analysed").await.unwrap().job_id;
    let explain_once = |client: &Client| {
        let req = client.request(pb::ExplainRequest { job_id: job, ..Default::default() });
        let ch = client.channels()[0].clone();
        async move { JobServiceClient::new(ch).explain(req).await.map(drop) }
    };
    let test_once = |client: &Client| {
        let req =
            client.request(pb::SubmitRequest { spec: Some(script_spec("true", work.path())), ..Default::default() });
        let ch = client.channels()[0].clone();
        async move { JobServiceClient::new(ch).test_submit(req).await.map(drop) }
    };
    let replica = &c.handles[&leader].replica;
    // One caller holds one analysis at a time; the pool is everyone's.
    let one = replica.analysis_permit("holder-0", "held").unwrap();
    assert_eq!(replica.analysis_permit("holder-0", "held").err().unwrap().code(), Code::ResourceExhausted);
    drop(one);
    let held: Vec<_> = (0..gangway_controller::shared::ANALYSES_MAX)
        .map(|i| replica.analysis_permit(&format!("holder-{i}"), "held").unwrap())
        .collect();
    for r in [explain_once(&client).await, test_once(&client).await] {
        let e = r.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        assert!(e.message().contains("retry"), "{}", e.message());
    }
    drop(held);
    explain_once(&client).await.unwrap();
    test_once(&client).await.unwrap();
    let jobs = c.state(leader).jobs.len();
    assert_eq!(jobs, 1, "a test submission submitted something");
    c.shutdown().await;
}

// ---------------------------------------------------------------- security

/// The security matrix: every kind of RPC × every kind of caller, against the
/// leader and a follower, before and after a forced failover, over real mutual
/// TLS. Each cell is the gRPC outcome the caller must get.
mod security {
    use super::*;
    use gangway_proto::pki::{self, CertRequest};
    use gangway_proto::tls::{Credentials, Expect, Principal, Role, TlsFiles};
    use gangway_proto::v1::raft_service_client::RaftServiceClient;
    use tonic::transport::Channel;

    /// What a caller gets from a call.
    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Got {
        /// Past authentication and authorization (an answer, or a domain refusal).
        Allowed,
        /// UNAUTHENTICATED: nothing vouches for the caller.
        Unauthenticated,
        /// PERMISSION_DENIED: known, but not allowed this.
        Denied,
        /// The TLS handshake was refused (a certificate the CA did not sign, or expired).
        NoHandshake,
    }

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Caller {
        NoCert,
        ForeignCa,
        Expired,
        Alice,
        Bob,
        Admin,
        AgentX,
        AgentY,
        Server,
        /// No certificate, a bearer token for alice signed by the cluster's token key.
        TokenAlice,
        /// No certificate, a token signed by a key the cluster does not trust.
        ForgedToken,
        /// No certificate, a step credential (signed by a replica) of a job
        /// that does not run: it opens nothing.
        StaleStep,
        /// oscar, an operator in the policy.
        Operator,
        /// carol, coordinator of account `ml` (alice's).
        Coordinator,
        /// `alice@corp.example`, whom the policy's user map makes alice.
        MappedAlice,
        /// alice's certificate from the same CA, but for another cluster
        /// (`spiffe://other/client/alice`).
        OtherCluster,
        /// server 4's certificate: the CA signed it, but replica 4 is not a
        /// member (a removed replica's certificate reads the same).
        NonMemberServer,
        /// No certificate, the step credential of alice's running job (its
        /// launch order's, signed by the leader).
        LiveStep,
        /// No certificate, a step credential for alice's running job signed
        /// by a server of another cluster that shares the CA.
        ForeignClusterStep,
        /// No certificate, a step credential for alice's running job signed
        /// by server 4, which is not a member.
        NonMemberStep,
    }

    const CALLERS: [Caller; 20] = [
        Caller::NoCert,
        Caller::ForeignCa,
        Caller::Expired,
        Caller::Alice,
        Caller::Bob,
        Caller::Admin,
        Caller::AgentX,
        Caller::AgentY,
        Caller::Server,
        Caller::TokenAlice,
        Caller::ForgedToken,
        Caller::StaleStep,
        Caller::Operator,
        Caller::Coordinator,
        Caller::MappedAlice,
        Caller::OtherCluster,
        Caller::NonMemberServer,
        Caller::LiveStep,
        Caller::ForeignClusterStep,
        Caller::NonMemberStep,
    ];

    #[derive(Debug, Clone, Copy, PartialEq, Eq)]
    enum Rpc {
        RaftVote,
        RaftAppend,
        /// A well-formed vote request in the name of replica 3.
        RaftVoteAsReplica3,
        AddLearner,
        TransferLeader,
        UpdatePolicy,
        Snapshot,
        Drain,
        ClusterStatus,
        GetPolicy,
        ListNodes,
        GetNodeX,
        ListJobs,
        GetAlicesJob,
        Submit,
        SubmitAsRoot,
        SubmitAsOther,
        HoldAlicesJob,
        CancelMissingJob,
        RegisterNodeX,
        HeartbeatNodeX,
        ReportExitOnNodeX,
        Events,
        Audit,
        Backup,
        GetNodeInventory,
        SetNodeInventory,
        /// node-x registering 16 H100s where its class allows 8 CPUs and no GPU.
        RegisterNodeXClaiming16Gpus,
        /// A job pinned to node-x (`--nodelist`).
        SubmitPinned,
    }

    const RPCS: [Rpc; 29] = [
        Rpc::RaftVote,
        Rpc::RaftAppend,
        Rpc::RaftVoteAsReplica3,
        Rpc::AddLearner,
        Rpc::TransferLeader,
        Rpc::UpdatePolicy,
        Rpc::Snapshot,
        Rpc::Drain,
        Rpc::ClusterStatus,
        Rpc::GetPolicy,
        Rpc::ListNodes,
        Rpc::GetNodeX,
        Rpc::ListJobs,
        Rpc::GetAlicesJob,
        Rpc::Submit,
        Rpc::SubmitAsRoot,
        Rpc::SubmitAsOther,
        Rpc::HoldAlicesJob,
        Rpc::CancelMissingJob,
        Rpc::RegisterNodeX,
        Rpc::HeartbeatNodeX,
        Rpc::ReportExitOnNodeX,
        Rpc::Events,
        Rpc::Audit,
        Rpc::Backup,
        Rpc::GetNodeInventory,
        Rpc::SetNodeInventory,
        Rpc::RegisterNodeXClaiming16Gpus,
        Rpc::SubmitPinned,
    ];

    /// The rules: what each caller must get for each RPC.
    fn expected(rpc: Rpc, caller: Caller) -> Got {
        use Caller::*;
        // Raft knows only server certificates; tokens do not count there.
        if matches!(caller, TokenAlice | LiveStep)
            && matches!(rpc, Rpc::RaftVote | Rpc::RaftAppend | Rpc::RaftVoteAsReplica3)
        {
            return Got::Unauthenticated;
        }
        // A job's credential acts as its user, but changes no job and pins
        // no job to nodes (it would mint itself fresh credentials there).
        if caller == LiveStep && matches!(rpc, Rpc::HoldAlicesJob | Rpc::SubmitPinned) {
            return Got::Denied;
        }
        // Otherwise a token holder is the user it names, a mapped identity
        // the user it maps to, and a live credential its job's user.
        let caller = if matches!(caller, TokenAlice | MappedAlice | LiveStep) { Alice } else { caller };
        match caller {
            NoCert | ForgedToken | StaleStep | NonMemberServer | ForeignClusterStep | NonMemberStep => {
                return Got::Unauthenticated
            }
            ForeignCa | Expired | OtherCluster => return Got::NoHandshake,
            _ => {}
        }
        let allowed = |ok: bool| if ok { Got::Allowed } else { Got::Denied };
        let user = matches!(caller, Alice | Bob | Admin | Operator | Coordinator);
        match rpc {
            Rpc::RaftVote | Rpc::RaftAppend => allowed(caller == Server),
            // The server caller holds replica 1's certificate: it speaks for 1 only.
            Rpc::RaftVoteAsReplica3 => Got::Denied,
            Rpc::AddLearner
            | Rpc::TransferLeader
            | Rpc::Snapshot
            | Rpc::Audit
            | Rpc::Backup
            | Rpc::SetNodeInventory => allowed(matches!(caller, Admin | Server)),
            // Coordinators edit their accounts' part of the policy (the state
            // machine checks which part); operators drain nodes.
            Rpc::UpdatePolicy => allowed(matches!(caller, Admin | Server | Coordinator)),
            Rpc::Drain => allowed(matches!(caller, Admin | Server | Operator)),
            Rpc::ClusterStatus
            | Rpc::GetPolicy
            | Rpc::ListNodes
            | Rpc::GetNodeX
            | Rpc::ListJobs
            | Rpc::GetAlicesJob
            | Rpc::GetNodeInventory
            | Rpc::Events => Got::Allowed,
            // Not even node-x's own agent: the inventory admits no more.
            Rpc::RegisterNodeXClaiming16Gpus => Got::Denied,
            Rpc::Submit | Rpc::CancelMissingJob | Rpc::SubmitPinned => allowed(user),
            // Nobody runs jobs as root here, nor as someone else.
            Rpc::SubmitAsRoot => Got::Denied,
            Rpc::SubmitAsOther => Got::Denied,
            Rpc::HoldAlicesJob => allowed(matches!(caller, Alice | Admin | Operator | Coordinator)),
            Rpc::RegisterNodeX | Rpc::HeartbeatNodeX | Rpc::ReportExitOnNodeX => allowed(caller == AgentX),
        }
    }

    fn classify(r: Result<(), tonic::Status>) -> (Got, String) {
        match r {
            Ok(()) => (Got::Allowed, "ok".into()),
            Err(s) => {
                let got = match s.code() {
                    Code::Unauthenticated => Got::Unauthenticated,
                    Code::PermissionDenied => Got::Denied,
                    Code::Unavailable | Code::Unknown if s.message().contains("transport") => Got::NoHandshake,
                    // With TLS 1.3 a client learns that its certificate was
                    // refused only when the server tears the connection down.
                    Code::Cancelled => Got::NoHandshake,
                    Code::Unavailable if !s.message().contains("leader") => Got::NoHandshake,
                    _ => Got::Allowed,
                };
                (got, format!("{:?}: {}", s.code(), s.message()))
            }
        }
    }

    fn spec(user: &str) -> pb::JobSpec {
        pb::JobSpec {
            name: "matrix".into(),
            user: user.into(),
            command: vec!["true".into()],
            script: "#!/bin/sh\necho secret-script\n".into(),
            env: [("SECRET_TOKEN".to_string(), "hunter2".to_string())].into_iter().collect(),
            ..Default::default()
        }
    }

    /// A request with the caller's bearer token or step credential.
    fn req<T>(m: T, bearer: Option<&str>) -> tonic::Request<T> {
        let mut r = tonic::Request::new(m);
        r.set_timeout(Duration::from_secs(10));
        match bearer {
            Some(b) if b.starts_with("v1.") => {
                r.metadata_mut().insert(gangway_proto::step_cred::STEP_CREDENTIAL_METADATA_KEY, b.parse().unwrap());
            }
            Some(b) => {
                r.metadata_mut().insert("authorization", format!("Bearer {b}").parse().unwrap());
            }
            None => {}
        }
        r
    }

    async fn call(rpc: Rpc, ch: Channel, alices_job: u64, bearer: Option<&str>) -> Result<(), tonic::Status> {
        match rpc {
            Rpc::RaftVote => {
                RaftServiceClient::new(ch).vote(req(pb::RaftPayload { data: vec![1, 2, 3] }, bearer)).await.map(drop)
            }
            Rpc::RaftVoteAsReplica3 => {
                let data = gangway_controller::raft::service::encoded_vote_request(3, 1);
                RaftServiceClient::new(ch).vote(req(pb::RaftPayload { data }, bearer)).await.map(drop)
            }
            Rpc::RaftAppend => RaftServiceClient::new(ch)
                .append_entries(req(pb::RaftPayload { data: vec![9] }, bearer))
                .await
                .map(drop),
            Rpc::AddLearner => AdminServiceClient::new(ch)
                .add_learner(req(pb::AddLearnerRequest { id: 0, addr: "x".into() }, bearer))
                .await
                .map(drop),
            Rpc::TransferLeader => AdminServiceClient::new(ch)
                .transfer_leader(req(pb::TransferLeaderRequest { to: 99 }, bearer))
                .await
                .map(drop),
            Rpc::UpdatePolicy => AdminServiceClient::new(ch)
                .update_policy(req(pb::UpdatePolicyRequest { json: "not json".into(), ..Default::default() }, bearer))
                .await
                .map(drop),
            Rpc::Snapshot => AdminServiceClient::new(ch).snapshot(req(pb::SnapshotRequest {}, bearer)).await.map(drop),
            Rpc::Drain => NodeServiceClient::new(ch)
                .drain(req(pb::DrainRequest { name: "no-such-node".into(), reason: String::new() }, bearer))
                .await
                .map(drop),
            Rpc::ClusterStatus => {
                AdminServiceClient::new(ch).cluster_status(req(pb::ClusterStatusRequest {}, bearer)).await.map(drop)
            }
            Rpc::GetPolicy => AdminServiceClient::new(ch)
                .get_policy(req(pb::GetPolicyRequest { stale: false }, bearer))
                .await
                .map(drop),
            Rpc::GetNodeX => NodeServiceClient::new(ch)
                .get(req(pb::GetNodeRequest { name: "node-x".into(), stale: false }, bearer))
                .await
                .map(drop),
            Rpc::ListNodes => {
                NodeServiceClient::new(ch).list(req(pb::ListNodesRequest::default(), bearer)).await.map(drop)
            }
            Rpc::ListJobs => {
                JobServiceClient::new(ch).list(req(pb::ListJobsRequest::default(), bearer)).await.map(drop)
            }
            Rpc::GetAlicesJob => JobServiceClient::new(ch)
                .get(req(pb::GetJobRequest { job_id: alices_job, stale: false }, bearer))
                .await
                .map(drop),
            Rpc::Submit | Rpc::SubmitAsRoot | Rpc::SubmitAsOther | Rpc::SubmitPinned => {
                let user = match rpc {
                    Rpc::SubmitAsRoot => "root",
                    Rpc::SubmitAsOther => "mallory",
                    _ => "",
                };
                let mut spec = spec(user);
                if rpc == Rpc::SubmitPinned {
                    spec.nodelist = vec!["node-x".into()];
                }
                JobServiceClient::new(ch)
                    .submit(req(pb::SubmitRequest { spec: Some(spec), ..Default::default() }, bearer))
                    .await
                    .map(drop)
            }
            Rpc::HoldAlicesJob => JobServiceClient::new(ch)
                .update(req(
                    pb::UpdateJobRequest {
                        job_id: alices_job,
                        change: pb::update_job_request::Change::Hold as i32,
                        ..Default::default()
                    },
                    bearer,
                ))
                .await
                .map(drop),
            Rpc::CancelMissingJob => {
                JobServiceClient::new(ch).cancel(req(pb::CancelRequest { job_id: 999_999 }, bearer)).await.map(drop)
            }
            Rpc::RegisterNodeX => AgentServiceClient::new(ch)
                .register(req(
                    pb::RegisterRequest { name: "node-x".into(), cpus: 8, mem_mb: 8192, ..Default::default() },
                    bearer,
                ))
                .await
                .map(drop),
            Rpc::RegisterNodeXClaiming16Gpus => AgentServiceClient::new(ch)
                .register(req(
                    pb::RegisterRequest {
                        name: "node-x".into(),
                        cpus: 8,
                        mem_mb: 8192,
                        gpus: (0..16)
                            .map(|i| pb::GpuInventory {
                                uuid: format!("GPU-forged-{i}"),
                                model: "h100-80gb".into(),
                                mem_mb: 81920,
                                ..Default::default()
                            })
                            .collect(),
                        ..Default::default()
                    },
                    bearer,
                ))
                .await
                .map(drop),
            Rpc::GetNodeInventory => AdminServiceClient::new(ch)
                .get_node_inventory(req(pb::GetNodeInventoryRequest { stale: false }, bearer))
                .await
                .map(drop),
            Rpc::SetNodeInventory => AdminServiceClient::new(ch)
                .set_node_inventory(req(
                    pb::SetNodeInventoryRequest { json: "not json".into(), ..Default::default() },
                    bearer,
                ))
                .await
                .map(drop),
            Rpc::HeartbeatNodeX => AgentServiceClient::new(ch)
                .heartbeat(req(pb::HeartbeatRequest { name: "node-x".into(), ..Default::default() }, bearer))
                .await
                .map(drop),
            Rpc::ReportExitOnNodeX => AgentServiceClient::new(ch)
                .report_task_exit(req(
                    pb::TaskExitReport {
                        node: "node-x".into(),
                        job_id: 999_999,
                        attempt: 0,
                        exit_code: Some(0),
                        ..Default::default()
                    },
                    bearer,
                ))
                .await
                .map(drop),
            Rpc::Audit => {
                let mut s = AdminServiceClient::new(ch)
                    .audit(req(pb::AuditRequest { from_seq: 0 }, bearer))
                    .await?
                    .into_inner();
                match tokio::time::timeout(Duration::from_secs(1), s.message()).await {
                    Ok(Err(e)) => Err(e),
                    _ => Ok(()),
                }
            }
            Rpc::Backup => {
                let mut s = AdminServiceClient::new(ch).backup(req(pb::BackupRequest {}, bearer)).await?.into_inner();
                s.message().await.map(drop)
            }
            Rpc::Events => {
                let mut s = JobServiceClient::new(ch)
                    .events(req(pb::EventsRequest { from_index: 1, job_id: 0, ..Default::default() }, bearer))
                    .await?
                    .into_inner();
                // The first message (or the stream's refusal) is the answer.
                match tokio::time::timeout(Duration::from_secs(2), s.message()).await {
                    Ok(Err(e)) => Err(e),
                    _ => Ok(()),
                }
            }
        }
    }

    struct Pki {
        _dir: tempfile::TempDir,
        main: std::path::PathBuf,
        /// Certificates of cluster `other`, signed by the same CA.
        other: std::path::PathBuf,
        token_alice: String,
        forged_token: String,
        token_public_key: std::path::PathBuf,
        stale_step: String,
        /// The step credentials of alice's running job, once it runs: its
        /// own, and ones signed by another cluster's server and by server 4.
        steps: std::sync::OnceLock<[String; 3]>,
    }

    impl Pki {
        fn new() -> Pki {
            let dir = tempfile::tempdir().unwrap();
            let main = dir.path().join("main");
            let mut ps: Vec<Principal> =
                (1..=4).map(|id| Principal::new(Role::Server, &id.to_string()).unwrap()).collect();
            for (role, name) in [
                (Role::Agent, "node-x"),
                (Role::Agent, "node-y"),
                (Role::Client, "alice"),
                (Role::Client, "bob"),
                (Role::Client, "admin"),
                (Role::Client, "nobody"),
                (Role::Client, "oscar"),
                (Role::Client, "carol"),
                (Role::Client, "alice@corp.example"),
            ] {
                ps.push(Principal::new(role, name).unwrap());
            }
            pki::throwaway(&main, &ps).unwrap();
            // A client certificate from another CA, and an expired one from ours.
            let foreign = dir.path().join("foreign");
            pki::throwaway(&foreign, &[Principal::new(Role::Client, "alice").unwrap()]).unwrap();
            // The same CA's certificates for another cluster.
            let other_cluster = dir.path().join("other");
            std::fs::create_dir_all(&other_cluster).unwrap();
            for p in [Principal::new(Role::Client, "alice").unwrap(), Principal::new(Role::Server, "1").unwrap()] {
                let req =
                    CertRequest { principal: p, hosts: vec![], days: 1, backdate_days: 0, cluster: "other".into() };
                pki::create_cert(&main, &other_cluster, &req).unwrap();
            }
            let req = CertRequest {
                principal: Principal::new(Role::Client, "expired").unwrap(),
                hosts: vec![],
                days: 1,
                backdate_days: 3,
                cluster: "gangway".into(),
            };
            pki::create_cert(&main, &main, &req).unwrap();
            // The cluster's token key, and another that nobody trusts.
            let (key, token_public_key) = gangway_proto::token::create_key(&dir.path().join("token")).unwrap();
            let (other, _) = gangway_proto::token::create_key(&dir.path().join("other-token")).unwrap();
            let life = Duration::from_secs(600);
            let token_alice = gangway_proto::token::create(&key, "alice", life, "gangway", "gangway").unwrap();
            let forged_token = gangway_proto::token::create(&other, "admin", life, "gangway", "gangway").unwrap();
            let server = Credentials::load(TlsFiles::in_dir(&main, "server-1")).unwrap();
            let claims = gangway_proto::step_cred::StepClaims {
                job_id: 4242,
                attempt: 1,
                nodes: vec!["node-x".into()],
                expires_unix: u64::MAX / 2,
            };
            let stale_step = gangway_proto::step_cred::sign(&server, &claims).unwrap();
            Pki {
                main,
                other: other_cluster,
                _dir: dir,
                token_alice,
                forged_token,
                token_public_key,
                stale_step,
                steps: std::sync::OnceLock::new(),
            }
        }

        /// Records the running job's credential, and signs the two forged
        /// ones for the same claims.
        fn running_job(&self, live: String, job_id: u64, attempt: u32) {
            let claims = gangway_proto::step_cred::StepClaims {
                job_id,
                attempt,
                nodes: vec!["node-x".into()],
                expires_unix: u64::MAX / 2,
            };
            let sign =
                |files: TlsFiles| gangway_proto::step_cred::sign(&Credentials::load(files).unwrap(), &claims).unwrap();
            let foreign = sign(TlsFiles {
                ca: self.main.join("ca.pem"),
                cert: Some((self.other.join("server-1.pem"), self.other.join("server-1-key.pem"))),
            });
            let nonmember = sign(TlsFiles::in_dir(&self.main, "server-4"));
            self.steps.set([live, foreign, nonmember]).unwrap();
        }

        fn bearer(&self, caller: Caller) -> Option<&str> {
            match caller {
                Caller::TokenAlice => Some(&self.token_alice),
                Caller::ForgedToken => Some(&self.forged_token),
                Caller::StaleStep => Some(&self.stale_step),
                Caller::LiveStep => self.steps.get().map(|s| s[0].as_str()),
                Caller::ForeignClusterStep => self.steps.get().map(|s| s[1].as_str()),
                Caller::NonMemberStep => self.steps.get().map(|s| s[2].as_str()),
                _ => None,
            }
        }

        fn security(&self, caller: Caller) -> Security {
            let files = match caller {
                Caller::NoCert
                | Caller::TokenAlice
                | Caller::ForgedToken
                | Caller::StaleStep
                | Caller::LiveStep
                | Caller::ForeignClusterStep
                | Caller::NonMemberStep => TlsFiles { ca: self.main.join("ca.pem"), cert: None },
                Caller::ForeignCa => TlsFiles {
                    ca: self.main.join("ca.pem"),
                    cert: Some((
                        self.main.parent().unwrap().join("foreign/client-alice.pem"),
                        self.main.parent().unwrap().join("foreign/client-alice-key.pem"),
                    )),
                },
                Caller::Expired => TlsFiles::in_dir(&self.main, "client-expired"),
                Caller::Alice => TlsFiles::in_dir(&self.main, "client-alice"),
                Caller::Bob => TlsFiles::in_dir(&self.main, "client-bob"),
                Caller::Admin => TlsFiles::in_dir(&self.main, "client-admin"),
                Caller::AgentX => TlsFiles::in_dir(&self.main, "agent-node-x"),
                Caller::AgentY => TlsFiles::in_dir(&self.main, "agent-node-y"),
                Caller::Server => TlsFiles::in_dir(&self.main, "server-1"),
                Caller::Operator => TlsFiles::in_dir(&self.main, "client-oscar"),
                Caller::Coordinator => TlsFiles::in_dir(&self.main, "client-carol"),
                Caller::MappedAlice => TlsFiles::in_dir(&self.main, "client-alice@corp.example"),
                Caller::OtherCluster => TlsFiles {
                    ca: self.main.join("ca.pem"),
                    cert: Some((self.other.join("client-alice.pem"), self.other.join("client-alice-key.pem"))),
                },
                Caller::NonMemberServer => TlsFiles::in_dir(&self.main, "server-4"),
            };
            Security::Tls(Credentials::load(files).unwrap())
        }
    }

    /// A stand-in for node-x's agent: registers (8 CPUs, 8 GiB), heartbeats
    /// every 100 ms reporting what it was told to launch as running, and
    /// sends each launch order's job, attempt and step credential.
    fn fake_agent_x(
        eps: &[String],
        pki: &Pki,
    ) -> (tokio::task::JoinHandle<()>, tokio::sync::mpsc::Receiver<(u64, u32, String)>) {
        let agent = Client::new(eps, "ignored", &pki.security(Caller::AgentX)).unwrap();
        let (tx, rx) = tokio::sync::mpsc::channel(256);
        let task = tokio::spawn(async move {
            let mut running: Vec<pb::TaskRef> = Vec::new();
            let mut registered = false;
            loop {
                if !registered {
                    let r = agent
                        .call(|ch| {
                            let r = agent.request(pb::RegisterRequest {
                                name: "node-x".into(),
                                cpus: 8,
                                mem_mb: 8192,
                                ..Default::default()
                            });
                            async move { AgentServiceClient::new(ch).register(r).await }
                        })
                        .await;
                    registered = r.is_ok();
                } else {
                    let hb = pb::HeartbeatRequest {
                        name: "node-x".into(),
                        running: running.clone(),
                        reads_nodelist: true,
                        ..Default::default()
                    };
                    if let Ok(resp) = agent
                        .call(|ch| {
                            let r = agent.request(hb.clone());
                            async move { AgentServiceClient::new(ch).heartbeat(r).await }
                        })
                        .await
                    {
                        let resp = resp.into_inner();
                        registered = resp.known;
                        for o in resp.launch {
                            running.push(pb::TaskRef { job_id: o.job_id, attempt: o.attempt });
                            let _ = tx.try_send((o.job_id, o.attempt, o.step_credential));
                        }
                    }
                }
                tokio::time::sleep(Duration::from_millis(100)).await;
            }
        });
        (task, rx)
    }

    /// A job of the client's user with a script and a secret in its environment.
    async fn submit_secret_job(client: &Client) -> u64 {
        client
            .job_submit(pb::SubmitRequest { spec: Some(spec("")), ..Default::default() })
            .await
            .unwrap()
            .into_inner()
            .job_id
    }

    /// The policy of the roles tests: accounts `ml` (alice's; carol
    /// coordinates it) and `infra` (bob's), operator oscar,
    /// `alice@corp.example` mapped to alice, admin kept.
    fn roles_policy() -> serde_json::Value {
        serde_json::json!({
            "admins": ["admin"],
            "accounts": { "ml": {}, "infra": {} },
            "users": { "alice": { "accounts": ["ml"] }, "bob": { "accounts": ["infra"] } },
            "operators": ["oscar"],
            "coordinators": { "ml": ["carol"] },
            "user_map": { "alice@corp.example": "alice" }
        })
    }

    /// A policy document with `private_jobs` set.
    trait TapPrivate {
        fn tap_private(self, on: bool) -> serde_json::Value;
    }

    impl TapPrivate for serde_json::Value {
        fn tap_private(mut self, on: bool) -> serde_json::Value {
            self["private_jobs"] = serde_json::json!(on);
            self
        }
    }

    async fn set_policy(client: &Client, policy: serde_json::Value) -> Result<pb::Policy, tonic::Status> {
        let json = policy.to_string();
        client
            .admin_update_policy(pb::UpdatePolicyRequest { json: json.clone(), ..Default::default() })
            .await
            .map(|r| r.into_inner())
    }

    async fn set_inventory(client: &Client, inventory: serde_json::Value) -> Result<pb::NodeInventory, tonic::Status> {
        let json = inventory.to_string();
        client
            .admin_set_node_inventory(pb::SetNodeInventoryRequest { json: json.clone(), ..Default::default() })
            .await
            .map(|r| r.into_inner())
    }

    async fn get(c: &Client, job_id: u64) -> Result<pb::Job, tonic::Status> {
        c.call(|ch| {
            let r = c.request(pb::GetJobRequest { job_id, stale: false });
            async move { JobServiceClient::new(ch).get(r).await }
        })
        .await
        .map(|r| r.into_inner())
    }

    /// The ids of the jobs `c` is shown.
    async fn list(c: &Client) -> Vec<u64> {
        let jobs = c
            .call(|ch| {
                let r = c.request(pb::ListJobsRequest::default());
                async move { JobServiceClient::new(ch).list(r).await }
            })
            .await
            .unwrap()
            .into_inner()
            .jobs;
        jobs.iter().map(|j| j.id).collect()
    }

    async fn start_secure(pki: &Pki) -> TestCluster {
        start_secure_with(pki, false).await
    }

    async fn start_secure_with(pki: &Pki, private_jobs: bool) -> TestCluster {
        start_secure_timed(pki, private_jobs, fast_timing()).await
    }

    async fn start_secure_timed(pki: &Pki, private_jobs: bool, timing: Timing) -> TestCluster {
        let mut c = TestCluster::empty();
        let mut listeners = BTreeMap::new();
        for id in 1..=3u64 {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            c.addrs.insert(id, l.local_addr().unwrap().to_string());
            c.dirs.insert(id, tempfile::tempdir().unwrap());
            c.timing.insert(id, timing.clone());
            listeners.insert(id, l);
        }
        for (id, l) in listeners {
            let mut config = c.config(id, false);
            let creds = Credentials::load(TlsFiles::in_dir(&pki.main, &format!("server-{id}"))).unwrap();
            config.security = Security::Tls(creds);
            config.bootstrap_admins = vec!["admin".into()];
            config.allow_root_jobs = false;
            config.private_jobs = private_jobs;
            let tokens = gangway_proto::token::TokenConfig {
                public_keys: vec![pki.token_public_key.clone()],
                ..Default::default()
            };
            config.tokens = gangway_proto::token::TokenVerifier::load(&tokens).unwrap();
            c.handles.insert(id, replica::start(config, l).await.unwrap());
        }
        c.wait_bootstrap_admin().await;
        c
    }

    /// Raft on peer ports (`--peer-listen`): the cluster forms and
    /// replicates through them; the API port refuses Raft; a peer port
    /// finishes no handshake without a certificate and keeps no connection
    /// but a replica's, so nobody else gets a byte of a request read.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn raft_is_served_on_peer_ports_to_replicas_only() {
        let pki = Pki::new();
        let mut c = TestCluster::empty();
        let (mut listeners, mut peer_ports, mut members) = (BTreeMap::new(), BTreeMap::new(), BTreeMap::new());
        for id in 1..=3u64 {
            let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let p = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
            let api = l.local_addr().unwrap().to_string();
            members.insert(id, format!("{api}/{}", p.local_addr().unwrap().port()));
            c.addrs.insert(id, api);
            c.dirs.insert(id, tempfile::tempdir().unwrap());
            c.timing.insert(id, fast_timing());
            listeners.insert(id, l);
            peer_ports.insert(id, p);
        }
        let peer_addr = |id: u64| gangway_controller::config::ReplicaAddr::peer_of(&members[&id]);
        // A replica must advertise the peer port it has, and only one it has.
        let mut unsplit = c.config(1, false);
        unsplit.security = Security::Tls(Credentials::load(TlsFiles::in_dir(&pki.main, "server-1")).unwrap());
        let spare = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let spare_peer = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let mut mismatched = unsplit.clone();
        let err = replica::start_with_peer_port(unsplit, spare, Some(spare_peer)).await.err().expect("refused");
        assert!(err.to_string().contains("names no peer port"), "{err}");
        // ...and the address --peers gives it must say the same.
        mismatched.advertise_addr = format!("{}/1", c.addrs[&1]);
        let spare = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let spare_peer = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let err = replica::start_with_peer_port(mismatched, spare, Some(spare_peer)).await.err().expect("refused");
        assert!(err.to_string().contains("same peer port"), "{err}");
        for (id, l) in listeners {
            let mut config = c.config(id, false);
            config.advertise_addr = members[&id].clone();
            config.peers = members.clone();
            config.security =
                Security::Tls(Credentials::load(TlsFiles::in_dir(&pki.main, &format!("server-{id}"))).unwrap());
            config.bootstrap_admins = vec!["admin".into()];
            config.allow_root_jobs = false;
            let h = replica::start_with_peer_port(config, l, peer_ports.remove(&id)).await.unwrap();
            c.handles.insert(id, h);
        }
        c.wait_bootstrap_admin().await;
        // A write commits through the peer ports and reaches every replica.
        let eps: Vec<String> = c.addrs.values().cloned().collect();
        let alice = Client::new(&eps, "ignored", &pki.security(Caller::Alice)).unwrap();
        let job = submit_secret_job(&alice).await;
        let deadline = tokio::time::Instant::now() + WAIT;
        while !c.handles.values().all(|h| h.replica.node.state().read().jobs.contains_key(&job)) {
            assert!(tokio::time::Instant::now() < deadline, "job {job} never reached every replica");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        // Clients are told the leader's API address, never its peer port.
        let status = c.handles[&1].replica.node.status();
        assert_eq!(status.addrs, c.addrs, "membership addresses as clients see them");

        // Replica 1's certificate, speaking for replica 1.
        let vote = |ch: Channel| async move {
            let data = gangway_controller::raft::service::encoded_vote_request(1, 1);
            RaftServiceClient::new(ch).vote(tonic::Request::new(pb::RaftPayload { data })).await.map(drop)
        };
        let server = pki.security(Caller::Server);
        // The API port serves no Raft, not even to a replica.
        let api = server.channel(&c.addrs[&2], Expect::Server, WAIT).unwrap();
        let refused = vote(api).await.unwrap_err();
        assert_eq!(refused.code(), Code::FailedPrecondition, "{refused:?}");
        assert!(refused.message().contains("peer port"), "{refused:?}");
        // On the peer port a replica's message reaches Raft (a vote from a
        // stale term, answered and not granted)...
        let peer = server.channel(&peer_addr(2), Expect::Server, WAIT).unwrap();
        vote(peer).await.unwrap_or_else(|e| panic!("a replica's vote on the peer port: {e:?}"));
        // ...and nobody else's: no certificate fails the handshake, a user's
        // or an agent's certificate is closed before its request is read.
        for who in [Caller::NoCert, Caller::ForeignCa, Caller::Alice, Caller::Admin, Caller::AgentX] {
            let ch = pki.security(who).channel(&peer_addr(2), Expect::Server, WAIT).unwrap();
            let (got, detail) = classify(vote(ch).await);
            assert_eq!(got, Got::NoHandshake, "{who:?} on the peer port: {detail}");
        }

        // A replica joining with a peer port is added by that address, and
        // only by it: the one it advertises decides where Raft goes.
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let p = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        let api4 = l.local_addr().unwrap().to_string();
        let member4 = format!("{api4}/{}", p.local_addr().unwrap().port());
        c.addrs.insert(4, api4.clone());
        c.dirs.insert(4, tempfile::tempdir().unwrap());
        c.timing.insert(4, fast_timing());
        let mut config = c.config(4, true);
        config.advertise_addr = member4.clone();
        config.peers = BTreeMap::from([(4, member4.clone())]);
        config.security = Security::Tls(Credentials::load(TlsFiles::in_dir(&pki.main, "server-4")).unwrap());
        c.handles.insert(4, replica::start_with_peer_port(config, l, Some(p)).await.unwrap());
        let admin = Client::new(&eps, "ignored", &pki.security(Caller::Admin)).unwrap();
        let add = |addr: String| {
            let admin = &admin;
            async move {
                admin
                    .call(|ch| {
                        let r = admin.request(pb::AddLearnerRequest { id: 4, addr: addr.clone() });
                        async move { AdminServiceClient::new(ch).add_learner(r).await }
                    })
                    .await
            }
        };
        let wrong = add(api4.clone()).await.unwrap_err();
        assert_eq!(wrong.code(), Code::FailedPrecondition, "{wrong:?}");
        assert!(wrong.message().contains(&member4), "{wrong:?}");
        add(member4.clone()).await.unwrap();
        let deadline = tokio::time::Instant::now() + WAIT;
        while !c.handles[&4].replica.node.state().read().jobs.contains_key(&job) {
            assert!(tokio::time::Instant::now() < deadline, "the learner never caught up through its peer port");
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        for id in [1, 2, 3, 4] {
            c.stop(id).await;
        }
    }

    async fn run_matrix(
        pki: &Pki,
        c: &TestCluster,
        label: &str,
        alices_job: u64,
        table: &mut Vec<String>,
    ) -> (usize, Vec<String>) {
        let leader = c.leader().await;
        let follower = *c.handles.keys().find(|id| **id != leader).unwrap();
        let mut cells = 0;
        let mut wrong = Vec::new();
        for (target, id) in [("leader", leader), ("follower", follower)] {
            for rpc in RPCS {
                let mut row = format!("{label:<8} {target:<8} {:<18}", format!("{rpc:?}"));
                for caller in CALLERS {
                    let ch =
                        pki.security(caller).channel(&c.addrs[&id], Expect::Server, Duration::from_secs(2)).unwrap();
                    let (got, detail) = classify(call(rpc, ch, alices_job, pki.bearer(caller)).await);
                    let want = expected(rpc, caller);
                    cells += 1;
                    let mark = match got {
                        Got::Allowed => "allow",
                        Got::Unauthenticated => "unauth",
                        Got::Denied => "deny",
                        Got::NoHandshake => "no-tls",
                    };
                    row.push_str(&format!(" {:<7}", if got == want { mark.to_string() } else { format!("{mark}!") }));
                    if got != want {
                        wrong.push(format!(
                            "{label} {target} {rpc:?} as {caller:?}: want {want:?}, got {got:?} ({detail})"
                        ));
                    }
                }
                table.push(row);
            }
        }
        (cells, wrong)
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn security_matrix_holds_on_every_replica_across_failover() {
        let pki = Pki::new();
        let mut c = start_secure(&pki).await;
        let leader = c.leader().await;
        let eps: Vec<String> = c.addrs.values().cloned().collect();
        let alice = Client::new(&eps, "ignored", &pki.security(Caller::Alice)).unwrap();
        // The bootstrap admin was committed by the leader.
        let deadline = tokio::time::Instant::now() + WAIT;
        while c.state(leader).policy.admins != vec!["admin".to_string()] {
            assert!(tokio::time::Instant::now() < deadline, "the bootstrap admin was never committed");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // The roles: oscar operates, carol coordinates alice's account, and
        // alice's corporate identity runs as alice.
        c.wait_newest_format().await;
        let admin = Client::new(&eps, "ignored", &pki.security(Caller::Admin)).unwrap();
        set_policy(&admin, roles_policy()).await.unwrap();
        // Nodes are admitted: node-x and node-y may claim 8 CPUs, 8 GiB and no GPU.
        set_inventory(
            &admin,
            serde_json::json!({
                "classes": { "small": { "nodes": ["node-x", "node-y"], "cpus": 8, "mem_mb": 8192 } }
            }),
        )
        .await
        .unwrap();
        // node-x's agent (a stand-in: registers, heartbeats, keeps what it is
        // told to launch) runs alice's job, whose launch order carries its
        // step credential.
        let (fake_agent, mut launched) = fake_agent_x(&eps, &pki);
        // Alice's job runs as alice, whatever she claims to be otherwise.
        let job = submit_secret_job(&alice).await;
        let live = tokio::time::timeout(WAIT, async {
            loop {
                let (id, attempt, credential) = launched.recv().await.expect("the stand-in agent ended");
                if id == job {
                    break (attempt, credential);
                }
            }
        })
        .await
        .expect("alice's job was never launched on node-x");
        pki.running_job(live.1.clone(), job, live.0);
        let stored = c.state(leader).jobs[&job].clone();
        assert_eq!((stored.spec.user.as_str(), stored.submitted_by.as_str()), ("alice", "client:alice"));
        // Bob sees the job but not its script, command or environment; alice sees all.
        async fn get_job(client: &Client, job_id: u64) -> pb::JobSpec {
            let job = client.job_get(pb::GetJobRequest { job_id, stale: false }).await.unwrap().into_inner();
            job.spec.unwrap()
        }
        // Operators and coordinators see it, without its secrets; alice's
        // mapped identity sees them (it is alice).
        for who in [Caller::Bob, Caller::Operator, Caller::Coordinator] {
            let client = Client::new(&eps, "ignored", &pki.security(who)).unwrap();
            let spec = get_job(&client, job).await;
            assert!(spec.env.is_empty() && spec.script.is_empty() && spec.command.is_empty(), "{who:?}: {spec:?}");
        }
        for who in [Caller::Alice, Caller::MappedAlice] {
            let client = Client::new(&eps, "ignored", &pki.security(who)).unwrap();
            let spec = get_job(&client, job).await;
            assert_eq!(spec.env.get("SECRET_TOKEN").map(String::as_str), Some("hunter2"), "{who:?}");
        }
        assert_eq!(stored.spec.account, "ml", "alice's job charges the account carol coordinates");

        let mut table = vec![format!(
            "{:<8} {:<8} {:<18} {}",
            "phase",
            "replica",
            "rpc",
            CALLERS.iter().map(|c| format!("{:<7}", format!("{c:?}"))).collect::<Vec<_>>().join(" ")
        )];
        let (mut cells, mut wrong) = run_matrix(&pki, &c, "before", job, &mut table).await;
        // Forced failover: the leader goes, the rules hold on the new one.
        c.stop(leader).await;
        let (more, w) = run_matrix(&pki, &c, "after", job, &mut table).await;
        cells += more;
        wrong.extend(w);
        println!("{}", table.join("\n"));
        println!("security matrix: {cells} cells, {} wrong", wrong.len());
        assert!(wrong.is_empty(), "{} of {cells} cells wrong:\n{}", wrong.len(), wrong.join("\n"));
        // A job's credential reads its own job whole, and its user's other
        // jobs as anyone else would: without scripts and environments.
        let other = submit_secret_job(&alice).await;
        for id in c.handles.keys().copied().collect::<Vec<_>>() {
            let ch = pki.security(Caller::LiveStep).channel(&c.addrs[&id], Expect::Server, WAIT).unwrap();
            let read = |job_id: u64| {
                let ch = ch.clone();
                let bearer = pki.bearer(Caller::LiveStep);
                async move {
                    JobServiceClient::new(ch)
                        .get(req(pb::GetJobRequest { job_id, stale: false }, bearer))
                        .await
                        .unwrap()
                        .into_inner()
                        .spec
                        .unwrap()
                }
            };
            let own = read(job).await;
            assert_eq!(own.env.get("SECRET_TOKEN").map(String::as_str), Some("hunter2"), "replica {id}");
            let theirs = read(other).await;
            assert!(theirs.env.is_empty() && theirs.script.is_empty() && theirs.command.is_empty(), "{theirs:?}");
        }
        // Reservation lists hold for admins' jobs too: an admin forces a
        // job in explicitly, and a job's credential cannot.
        let now_ms = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_millis() as u64;
        let reserve = pb::ChangeReservationRequest {
            action: "create".into(),
            spec: Some(pb::ReservationSpec {
                name: "bobs".into(),
                start_ms: now_ms,
                end_ms: now_ms + 3_600_000,
                nodes: vec!["node-x".into()],
                users: vec!["bob".into()],
                flags: "IGNORE_JOBS".into(),
                ..Default::default()
            }),
        };
        admin
            .call(|ch| {
                let r = admin.request(reserve.clone());
                async move { AdminServiceClient::new(ch).change_reservation(r).await }
            })
            .await
            .unwrap();
        let in_bobs = |force: bool| {
            let mut spec = spec("");
            spec.reservation = "bobs".into();
            spec.force_reservation = force;
            pb::SubmitRequest { spec: Some(spec), ..Default::default() }
        };
        let submit_as = |who: Caller, force: bool| {
            let ch =
                pki.security(who).channel(&c.addrs[&c.handles.keys().next().copied().unwrap()], Expect::Server, WAIT);
            let r = req(in_bobs(force), pki.bearer(who));
            async move { JobServiceClient::new(ch.unwrap()).submit(r).await }
        };
        let refused = submit_as(Caller::Admin, false).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
        assert!(refused.message().contains("--force-reservation"), "{refused:?}");
        submit_as(Caller::Admin, true).await.expect("an admin who forces it runs in the reservation");
        submit_as(Caller::Bob, false).await.expect("a listed user runs in the reservation");
        let refused = submit_as(Caller::LiveStep, true).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "a job's credential forced a reservation: {refused:?}");
        assert!(submit_as(Caller::Alice, true).await.is_err(), "a user not listed ran in the reservation");
        // A job's credential works only from the job's nodes where they
        // registered addresses: node-x moved to 10.9.9.9, a call from here
        // (loopback) is refused; back on 127.0.0.1, it passes again.
        let agent_x = Client::new(&eps, "ignored", &pki.security(Caller::AgentX)).unwrap();
        let register_at = |addr: &'static str| {
            let agent_x = &agent_x;
            async move {
                agent_x
                    .call(|ch| {
                        let r = agent_x.request(pb::RegisterRequest {
                            name: "node-x".into(),
                            addr: addr.into(),
                            cpus: 8,
                            mem_mb: 8192,
                            ..Default::default()
                        });
                        async move { AgentServiceClient::new(ch).register(r).await }
                    })
                    .await
                    .unwrap()
            }
        };
        let list_as_job = || {
            let ch = pki.security(Caller::LiveStep).channel(
                &c.addrs[&c.handles.keys().next().copied().unwrap()],
                Expect::Server,
                WAIT,
            );
            let r = req(pb::ListJobsRequest::default(), pki.bearer(Caller::LiveStep));
            async move { JobServiceClient::new(ch.unwrap()).list(r).await }
        };
        register_at("10.9.9.9:6818").await;
        let deadline = tokio::time::Instant::now() + WAIT;
        let refused = loop {
            match list_as_job().await {
                Err(e) => break e,
                Ok(_) if tokio::time::Instant::now() < deadline => tokio::time::sleep(Duration::from_millis(50)).await,
                Ok(_) => panic!("a job's credential worked from none of its nodes"),
            }
        };
        assert_eq!(refused.code(), Code::Unauthenticated, "{refused:?}");
        assert!(refused.message().contains("none of the job's nodes"), "{refused:?}");
        register_at("127.0.0.1:6818").await;
        let deadline = tokio::time::Instant::now() + WAIT;
        while list_as_job().await.is_err() {
            assert!(tokio::time::Instant::now() < deadline, "the job's credential stayed refused from its node");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        // Nor may a job's credential steer a job off every node but some.
        let mut steered = spec("");
        steered.exclude = vec!["node-y".into()];
        let ch = pki.security(Caller::LiveStep).channel(
            &c.addrs[&c.handles.keys().next().copied().unwrap()],
            Expect::Server,
            WAIT,
        );
        let r = req(pb::SubmitRequest { spec: Some(steered), ..Default::default() }, pki.bearer(Caller::LiveStep));
        let refused = JobServiceClient::new(ch.unwrap()).submit(r).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
        fake_agent.abort();
        // The stopped leader is removed from the membership: from then on its
        // certificate, still valid for a year, opens nothing on either
        // replica left, not even what any user may read.
        let removed = leader;
        let removed_cert =
            Security::Tls(Credentials::load(TlsFiles::in_dir(&pki.main, &format!("server-{removed}"))).unwrap());
        // An event stream it opened before its removal ends with it.
        let live = *c.handles.keys().next().unwrap();
        let ch = removed_cert.channel(&c.addrs[&live], Expect::Server, WAIT).unwrap();
        let mut stream = JobServiceClient::new(ch)
            .events(pb::EventsRequest { from_index: 1, job_id: 0, ..Default::default() })
            .await
            .unwrap()
            .into_inner();
        admin
            .call(|ch| {
                let r = admin.request(pb::RemoveMemberRequest { id: removed });
                async move { AdminServiceClient::new(ch).remove_member(r).await }
            })
            .await
            .unwrap();
        let ended = tokio::time::timeout(WAIT, async {
            loop {
                match stream.message().await {
                    Ok(Some(_)) => continue,
                    Ok(None) => break None,
                    Err(e) => break Some(e),
                }
            }
        })
        .await
        .expect("a removed replica's stream stayed open");
        let e = ended.expect("the stream ended without saying why");
        assert_eq!(e.code(), Code::Unauthenticated, "{e:?}");
        assert!(e.message().contains("no longer a member"), "{e:?}");
        for id in c.handles.keys().copied().collect::<Vec<_>>() {
            let deadline = tokio::time::Instant::now() + WAIT;
            loop {
                let ch = removed_cert.channel(&c.addrs[&id], Expect::Server, WAIT).unwrap();
                let got = AdminServiceClient::new(ch).cluster_status(pb::ClusterStatusRequest {}).await;
                if matches!(&got, Err(s) if s.code() == Code::Unauthenticated) {
                    assert!(got.unwrap_err().message().contains("not a member"));
                    break;
                }
                assert!(
                    tokio::time::Instant::now() < deadline,
                    "replica {id} still takes a removed replica's certificate"
                );
                tokio::time::sleep(Duration::from_millis(50)).await;
            }
        }
        // The new leader's audit trail names who was refused what, and the
        // admin actions it allowed; only admins read it.
        let new_leader = c.leader().await;
        let admin_ch = pki.security(Caller::Admin).channel(&c.addrs[&new_leader], Expect::Server, WAIT).unwrap();
        let mut trail =
            AdminServiceClient::new(admin_ch).audit(pb::AuditRequest { from_seq: 0 }).await.unwrap().into_inner();
        let mut seen = Vec::new();
        while let Ok(Some(e)) =
            tokio::time::timeout(Duration::from_millis(500), trail.message()).await.unwrap_or(Ok(None))
        {
            seen.push(e);
        }
        let has = |caller: &str, outcome: &str, action: &str| {
            seen.iter().any(|e| e.caller.starts_with(caller) && e.outcome == outcome && e.action.contains(action))
        };
        assert!(has("client:bob", "denied", "update_job"), "bob's hold of alice's job is not in the trail");
        assert!(has("agent:node-y", "denied", "heartbeat"), "node-y heartbeating for node-x is not in the trail");
        assert!(has("client:alice", "denied", "raft"), "alice's Raft call is not in the trail");
        assert!(has("anonymous@127.0.0.1", "unauthenticated", ""), "anonymous calls are not in it");
        // ... at most their share a minute: a flood from one address cannot
        // push the rest out.
        let anonymous = seen.iter().filter(|e| e.caller.starts_with("anonymous@")).count();
        assert!(anonymous <= gangway_controller::audit::ANONYMOUS_PER_MINUTE_MAX as usize + 1, "{anonymous}");
        assert!(has("client:admin", "allowed", "change the policy"), "the admin's policy change is not in it");
        assert!(seen.windows(2).all(|w| w[1].seq > w[0].seq), "the trail is out of order");
        // Nobody but alice and the admin managed to touch alice's job, and no
        // job of root or of another user was ever stored.
        let s = c.state(new_leader);
        assert!(s.jobs.values().all(|j| j.spec.user != "root" && j.spec.user != "mallory"));
        for (_, h) in std::mem::take(&mut c.handles) {
            h.shutdown().await;
        }
    }

    /// Limits through the real API, one past each: a user's writes over their
    /// rate are refused with a retry hint while others go on; admins have a
    /// budget of their own, far above a user's, and are refused one past it;
    /// a list whose jobs exceed the response budget is paged by bytes and
    /// every page stays under every client's receive limit.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn write_rates_and_response_sizes_hold_at_their_limits() {
        const ADMIN_BURST: f64 = 30.0;
        let pki = Pki::new();
        let timing = Timing {
            user_writes_per_s: 1.0,
            user_write_burst: 5.0,
            admin_writes_per_s: 1.0,
            admin_write_burst: ADMIN_BURST,
            ..fast_timing()
        };
        let c = start_secure_timed(&pki, false, timing).await;
        let leader = c.leader().await;
        let eps: Vec<String> = c.addrs.values().cloned().collect();
        let client = |who| Client::new(&eps, "ignored", &pki.security(who)).unwrap();
        let (alice, bob, admin) = (client(Caller::Alice), client(Caller::Bob), client(Caller::Admin));
        let follower = *c.addrs.keys().find(|id| **id != leader).unwrap();
        let via = |id: u64| Client::new(&[c.addrs[&id].clone()], "ignored", &pki.security(Caller::Alice)).unwrap();
        let (alice_at_follower, alice_at_leader) = (via(follower), via(leader));
        async fn cancel(c: &Client, job_id: u64) -> Result<(), tonic::Status> {
            c.call(|ch| {
                let r = c.request(pb::CancelRequest { job_id });
                async move { JobServiceClient::new(ch).cancel(r).await }
            })
            .await
            .map(drop)
        }
        // The burst (5) passes (as NOT_FOUND: no such job), whichever replica
        // the writes reach (the leader counts them all); the sixth is over.
        for i in 0..5 {
            let at = if i % 2 == 0 { &alice_at_follower } else { &alice_at_leader };
            assert_eq!(cancel(at, 999_999).await.unwrap_err().code(), Code::NotFound);
        }
        // One call as it goes out (the client library would wait out the
        // hint and ask again).
        let once = alice_at_follower.request(pb::CancelRequest { job_id: 999_999 });
        let over = JobServiceClient::new(alice_at_follower.channels()[0].clone()).cancel(once).await.unwrap_err();
        assert_eq!(over.code(), Code::ResourceExhausted, "{over:?}");
        assert!(over.message().contains("rate:") && over.message().contains("retry in"), "{over:?}");
        let hint: u64 = over.metadata().get("retry-after-ms").unwrap().to_str().unwrap().parse().unwrap();
        assert!((1..=1_000).contains(&hint), "{hint}");
        // Another user has their own bucket; an admin has a larger one.
        assert_eq!(cancel(&bob, 999_999).await.unwrap_err().code(), Code::NotFound);
        for _ in 0..10 {
            assert_eq!(cancel(&admin, 999_999).await.unwrap_err().code(), Code::NotFound);
        }
        // The client library waits out the hint by itself: alice's next
        // write goes through (as NOT_FOUND) without her doing anything.
        assert_eq!(cancel(&alice, 999_999).await.unwrap_err().code(), Code::NotFound);

        // Lists page by bytes: twelve jobs of ~1 MiB scripts are more than one
        // response may carry (LIST_RESPONSE_BYTES_MAX).
        let script = format!("#!/bin/sh\n# {}\ntrue\n", "x".repeat(1_000_000));
        for _ in 0..12 {
            let spec = pb::JobSpec { script: script.clone(), hold: true, workdir: "/tmp".into(), ..Default::default() };
            submit(&admin, spec, "").await.unwrap();
        }
        let (mut after_id, mut seen, mut pages) = (0, 0, 0);
        loop {
            let r = admin
                .call(|ch| {
                    let r = admin.request(pb::ListJobsRequest { after_id, limit: 1_000, ..Default::default() });
                    async move { JobServiceClient::new(ch).list(r).await }
                })
                .await
                .unwrap()
                .into_inner();
            let bytes = prost::Message::encoded_len(&r);
            assert!(bytes <= gangway_proto::limits::API_RESPONSE_BYTES_MAX, "a page of {bytes} bytes");
            seen += r.jobs.len();
            pages += 1;
            if r.next_after_id == 0 {
                break;
            }
            after_id = r.next_after_id;
        }
        assert_eq!(seen, 12);
        assert!(pages >= 4, "12 MiB of jobs came in {pages} pages");

        // The admin made 22 writes (10 cancels, 12 submits) of its 30; a
        // few more have refilled at 1 a second. Past the burst it is refused
        // like a user, with a hint.
        let mut admin_writes = 22;
        let refused = loop {
            let once = admin.request(pb::CancelRequest { job_id: 999_999 });
            match JobServiceClient::new(admin.channels()[0].clone()).cancel(once).await {
                Err(s) if s.code() == Code::NotFound => admin_writes += 1,
                Err(s) => break s,
                Ok(_) => panic!("job 999999 does not exist"),
            }
            assert!(admin_writes < 60, "an admin wrote {admin_writes} times at a rate of 1 a second, a burst of 30");
        };
        assert_eq!(refused.code(), Code::ResourceExhausted, "{refused:?}");
        assert!(refused.message().contains("rate:") && refused.metadata().get("retry-after-ms").is_some());
        assert!(admin_writes as f64 >= ADMIN_BURST, "the admin was refused within its burst ({admin_writes})");
        c.shutdown().await;
    }

    /// A message of `target` bytes: `make(n)` with the padding `n` that gives it.
    fn padded<M: prost::Message>(target: usize, make: impl Fn(usize) -> M) -> M {
        let mut n = target;
        for _ in 0..8 {
            let len = make(n).encoded_len();
            if len == target {
                return make(n);
            }
            n = (n + target).checked_sub(len).expect("the padding can make the message that small");
        }
        panic!("no padding gives a message of {target} bytes");
    }

    /// Request sizes on a real replica over mTLS, at each limit and one
    /// byte past it: a small method (List) at `SMALL_REQUEST_BYTES_MAX`,
    /// Submit at `API_REQUEST_BYTES_MAX`, an agent's heartbeat at
    /// `AGENT_MESSAGE_BYTES_MAX`. At the limit the request reaches its
    /// handler (List and Submit refuse the oversized field by name, the
    /// heartbeat is answered); one past, it is refused naming
    /// the limit, and the replica serves on. The gate refuses with
    /// RESOURCE_EXHAUSTED where its limit is below the service's (small
    /// methods); where they are equal, tonic refuses first, from the frame's
    /// length before reading the message, with OUT_OF_RANGE.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn request_sizes_hold_at_their_limits_one_past_each() {
        use gangway_controller::admission::SMALL_REQUEST_BYTES_MAX;
        use gangway_proto::limits::{AGENT_MESSAGE_BYTES_MAX, API_REQUEST_BYTES_MAX};
        let pki = Pki::new();
        let c = start_secure(&pki).await;
        let leader = c.leader().await;
        let ch = |who| pki.security(who).channel(&c.addrs[&leader], Expect::Server, WAIT).unwrap();
        let list = |n: usize| pb::ListJobsRequest { name: "x".repeat(n), ..Default::default() };
        let submit = |n: usize| pb::SubmitRequest {
            spec: Some(pb::JobSpec { script: "x".repeat(n), workdir: "/tmp".into(), ..Default::default() }),
            ..Default::default()
        };
        let beat = |n: usize| pb::HeartbeatRequest {
            name: "node-x".into(),
            gpu_health: vec![pb::GpuHealthReport { index: 0, healthy: false, reason: "x".repeat(n) }],
            ..Default::default()
        };
        for one_past in [false, true] {
            let extra = usize::from(one_past);
            let got = [
                (
                    "List",
                    SMALL_REQUEST_BYTES_MAX,
                    JobServiceClient::new(ch(Caller::Alice))
                        .list(padded(SMALL_REQUEST_BYTES_MAX + extra, list))
                        .await
                        .map(drop),
                ),
                (
                    "Submit",
                    API_REQUEST_BYTES_MAX,
                    JobServiceClient::new(ch(Caller::Alice))
                        .submit(padded(API_REQUEST_BYTES_MAX + extra, submit))
                        .await
                        .map(drop),
                ),
                (
                    "Heartbeat",
                    AGENT_MESSAGE_BYTES_MAX,
                    AgentServiceClient::new(ch(Caller::AgentX))
                        .heartbeat(padded(AGENT_MESSAGE_BYTES_MAX + extra, beat))
                        .await
                        .map(drop),
                ),
            ];
            for (what, limit, got) in got {
                let by_gate = format!("request: at most {limit} bytes");
                let by_tonic = format!("the limit is: {limit} bytes");
                let refused = got.as_ref().err().filter(|e| {
                    (e.code() == Code::ResourceExhausted && e.message().contains(&by_gate))
                        || (e.code() == Code::OutOfRange && e.message().contains(&by_tonic))
                });
                if one_past {
                    refused.unwrap_or_else(|| panic!("{what} one byte past {limit}: {got:?}"));
                } else {
                    // Past the gate, each handler answers as for any such request.
                    let answered = match what {
                        "List" => got.as_ref().is_err_and(|e| e.message().starts_with("name: at most")),
                        "Submit" => got.as_ref().is_err_and(|e| e.message().starts_with("script: must be at most")),
                        _ => got.is_ok(),
                    };
                    assert!(refused.is_none() && answered, "{what} at its limit of {limit} bytes: {got:?}");
                }
            }
        }
        // The replica serves on.
        JobServiceClient::new(ch(Caller::Alice)).list(pb::ListJobsRequest::default()).await.unwrap();
        c.shutdown().await;
    }

    /// `--private-jobs`: another user's job does not exist for bob, on any
    /// replica; alice and the admin see it.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn private_jobs_read_as_not_found_for_others() {
        let pki = Pki::new();
        let mut c = start_secure_with(&pki, true).await;
        c.leader().await;
        let eps: Vec<String> = c.addrs.values().cloned().collect();
        let client = |who| Client::new(&eps, "ignored", &pki.security(who)).unwrap();
        let (alice, bob, admin) = (client(Caller::Alice), client(Caller::Bob), client(Caller::Admin));
        let job = submit_secret_job(&alice).await;
        assert_eq!(get(&bob, job).await.unwrap_err().code(), Code::NotFound);
        assert!(!list(&bob).await.contains(&job));
        let cancel = bob
            .call(|ch| {
                let r = bob.request(pb::CancelRequest { job_id: job });
                async move { JobServiceClient::new(ch).cancel(r).await }
            })
            .await
            .unwrap_err();
        assert_eq!(cancel.code(), Code::NotFound, "{cancel:?}");
        assert_eq!(get(&alice, job).await.unwrap().id, job);
        assert!(list(&alice).await.contains(&job) && list(&admin).await.contains(&job));
        // A dependency on alice's job answers bob as one on a long-gone job.
        let dep = pb::JobSpec { dependency: format!("afterok:{job}"), ..spec("") };
        let refused = bob
            .call(|ch| {
                let r = bob.request(pb::SubmitRequest { spec: Some(dep.clone()), ..Default::default() });
                async move { JobServiceClient::new(ch).submit(r).await }
            })
            .await
            .unwrap_err();
        assert!(refused.message().contains(&format!("job {job} was purged")), "{refused:?}");
        assert_eq!(get(&admin, job).await.unwrap().id, job);
        for (_, h) in std::mem::take(&mut c.handles) {
            h.shutdown().await;
        }
    }

    /// The roles and the private-jobs switch come from the replicated policy
    /// (no replica flag): a coordinator sees and manages the jobs of their
    /// account and edits only below it, an operator sees every job and drains
    /// nodes (audited), a user sees only their own, and a mapped identity
    /// submits and sees as the user it maps to. The switch turned off shows
    /// everything again.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn roles_and_private_jobs_come_from_the_replicated_policy() {
        let pki = Pki::new();
        let mut c = start_secure(&pki).await;
        c.leader().await;
        c.wait_newest_format().await;
        let eps: Vec<String> = c.addrs.values().cloned().collect();
        let client = |who| Client::new(&eps, "ignored", &pki.security(who)).unwrap();
        let (alice, bob, admin) = (client(Caller::Alice), client(Caller::Bob), client(Caller::Admin));
        let (oscar, carol, mapped) =
            (client(Caller::Operator), client(Caller::Coordinator), client(Caller::MappedAlice));
        let mut policy = roles_policy();
        policy["private_jobs"] = serde_json::json!(true);
        set_policy(&admin, policy.clone()).await.unwrap();
        async fn cancel(c: &Client, job_id: u64) -> Result<(), tonic::Status> {
            c.call(|ch| {
                let r = c.request(pb::CancelRequest { job_id });
                async move { JobServiceClient::new(ch).cancel(r).await }
            })
            .await
            .map(drop)
        }
        let a = submit_secret_job(&alice).await;
        let b = submit_secret_job(&bob).await;
        // The mapped identity's job runs as alice, in her account.
        let m = submit_secret_job(&mapped).await;
        let leader = c.leader().await;
        let stored = c.state(leader).jobs[&m].clone();
        assert_eq!((stored.spec.user.as_str(), stored.spec.account.as_str()), ("alice", "ml"));
        assert_eq!(stored.submitted_by, "client:alice@corp.example");
        // Who sees what.
        assert_eq!(list(&bob).await, vec![b]);
        assert_eq!(get(&bob, a).await.unwrap_err().code(), Code::NotFound);
        assert_eq!(list(&alice).await, vec![a, m]);
        assert_eq!(list(&mapped).await, vec![a, m], "the mapped identity is alice");
        assert_eq!(list(&carol).await, vec![a, m], "carol coordinates ml, not infra");
        assert_eq!(get(&carol, b).await.unwrap_err().code(), Code::NotFound);
        assert_eq!(list(&oscar).await, vec![a, b, m]);
        let seen = get(&oscar, b).await.unwrap().spec.unwrap();
        assert!(seen.env.is_empty() && seen.script.is_empty(), "operators do not read others' secrets: {seen:?}");
        // Carol cancels alice's job, not bob's (hidden from her).
        cancel(&carol, a).await.unwrap();
        assert_eq!(cancel(&carol, b).await.unwrap_err().code(), Code::NotFound);
        assert_eq!(get(&alice, a).await.unwrap().state, pb::JobState::Cancelled as i32);
        // Carol edits below ml, and nothing else.
        let mut sub = c.state(leader).policy.clone();
        sub.accounts
            .insert("ml-vision".into(), gangway_core::policy::Account { parent: "ml".into(), ..Default::default() });
        set_policy(&carol, serde_json::to_value(&sub).unwrap()).await.unwrap();
        let mut grab = c.state(leader).policy.clone();
        grab.private_jobs = false;
        let refused = set_policy(&carol, serde_json::to_value(&grab).unwrap()).await.unwrap_err();
        assert_eq!(refused.code(), Code::PermissionDenied, "{refused:?}");
        assert!(refused.message().contains("private_jobs"), "{}", refused.message());
        assert!(c.state(leader).policy.private_jobs, "a refused edit changed nothing");
        // Oscar drains (audited as an operator); bob cannot.
        async fn drain(cl: &Client) -> Result<(), tonic::Status> {
            cl.call(|ch| {
                let r = cl.request(pb::DrainRequest { name: "no-such-node".into(), reason: String::new() });
                async move { NodeServiceClient::new(ch).drain(r).await }
            })
            .await
            .map(drop)
        }
        assert_eq!(drain(&oscar).await.unwrap_err().code(), Code::NotFound);
        assert_eq!(drain(&bob).await.unwrap_err().code(), Code::PermissionDenied);
        assert_eq!(set_policy(&oscar, policy.clone()).await.unwrap_err().code(), Code::PermissionDenied);
        // The switch off: bob sees alice's jobs again (not their secrets).
        let mut open = c.state(leader).policy.clone();
        open.private_jobs = false;
        set_policy(&admin, serde_json::to_value(&open).unwrap()).await.unwrap();
        assert!(list(&bob).await.contains(&m));
        let spec = get(&bob, m).await.unwrap().spec.unwrap();
        assert!(spec.env.is_empty() && spec.script.is_empty(), "{spec:?}");
        // A stream bob opened while jobs were public follows the policy as
        // it changes: once they are private again, alice's new job is not in it.
        let alices_last = std::sync::Arc::new(std::sync::atomic::AtomicU64::new(u64::MAX));
        let seen = std::sync::Arc::new(std::sync::Mutex::new(Vec::<u64>::new()));
        let (bob2, last, sink) = (client(Caller::Bob), alices_last.clone(), seen.clone());
        let follow = tokio::spawn(async move {
            gangway_proto::events::follow(&bob2, 0, |ev| {
                sink.lock().unwrap().push(ev.job_id);
                ev.job_id <= last.load(std::sync::atomic::Ordering::SeqCst)
            })
            .await
        });
        tokio::time::sleep(Duration::from_millis(300)).await;
        set_policy(&admin, serde_json::to_value(&c.state(leader).policy).unwrap().tap_private(true)).await.unwrap();
        let x = submit_secret_job(&alice).await;
        alices_last.store(x, std::sync::atomic::Ordering::SeqCst);
        let y = submit_secret_job(&bob).await;
        tokio::time::timeout(WAIT, follow).await.expect("bob's stream never showed his job").unwrap().unwrap();
        let seen = seen.lock().unwrap().clone();
        assert!(seen.contains(&y) && !seen.contains(&x), "bob's stream: {seen:?} (alice's {x}, bob's {y})");
        for (_, h) in std::mem::take(&mut c.handles) {
            h.shutdown().await;
        }
    }

    /// A running job's credential acts as its user for everyday calls, never
    /// with admin rights (its user is an admin here), never for job changes or
    /// new credentials, and not at all once the attempt ended.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn a_jobs_credential_is_its_users_everyday_rights_while_it_runs() {
        let pki = Pki::new();
        let mut c = start_secure(&pki).await;
        let leader = c.leader().await;
        let eps: Vec<String> = c.addrs.values().cloned().collect();
        let admin = Client::new(&eps, "x", &pki.security(Caller::Admin)).unwrap();
        let nobody = Client::new(
            &eps,
            "x",
            &Security::Tls(Credentials::load(TlsFiles::in_dir(&pki.main, "client-nobody")).unwrap()),
        )
        .unwrap();
        // nobody is an admin too: its job still is not.
        let policy = serde_json::json!({ "admins": ["admin", "nobody"] }).to_string();
        admin
            .call(|ch| {
                let r = admin.request(pb::UpdatePolicyRequest { json: policy.clone(), ..Default::default() });
                async move { AdminServiceClient::new(ch).update_policy(r).await }
            })
            .await
            .unwrap();
        // A secured agent for node-x runs nobody's job.
        let state = tempfile::tempdir().unwrap();
        let (stop, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let agent_creds = Credentials::load(TlsFiles::in_dir(&pki.main, "agent-node-x")).unwrap();
        let config = gangway_node_agent::AgentConfig {
            security: Security::Tls(agent_creds),
            ..gangway_node_agent::AgentConfig::simulated(eps.clone(), "node-x", state.path().to_path_buf())
        };
        let agent = tokio::spawn(gangway_node_agent::run(config, async {
            let _ = stop_rx.await;
        }));
        let long =
            pb::JobSpec { command: vec!["sleep".into(), "60".into()], workdir: "/tmp".into(), ..Default::default() };
        let job = nobody
            .call(|ch| {
                let r = nobody.request(pb::SubmitRequest { spec: Some(long.clone()), ..Default::default() });
                async move { JobServiceClient::new(ch).submit(r).await }
            })
            .await
            .unwrap()
            .into_inner()
            .job_id;
        let deadline = tokio::time::Instant::now() + WAIT;
        while c.state(leader).jobs[&job].state != gangway_core::JobState::Running {
            assert!(tokio::time::Instant::now() < deadline, "nobody's job never ran");
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let credential = nobody
            .call(|ch| {
                let r = nobody.request(pb::StepCredentialRequest { job_id: job });
                async move { JobServiceClient::new(ch).step_credential(r).await }
            })
            .await
            .unwrap()
            .into_inner()
            .credential;
        // The certificate `nobody` now runs as daemon; the job's process,
        // already Unix user nobody, is not mapped a second time.
        c.wait_newest_format().await;
        let mapped = serde_json::json!({ "admins": ["admin", "nobody"], "user_map": { "nobody": "daemon" } });
        set_policy(&admin, mapped).await.unwrap();
        // The job's process: no certificate, only the credential; on a follower too.
        let follower = *c.handles.keys().find(|id| **id != leader).unwrap();
        for target in [leader, follower] {
            let plain = Security::Tls(Credentials::load(TlsFiles { ca: pki.main.join("ca.pem"), cert: None }).unwrap());
            let ch = plain.channel(&c.addrs[&target], Expect::Server, WAIT).unwrap();
            let cred = Some(credential.as_str());
            let code = |r: Result<(), tonic::Status>| r.err().map(|s| s.code());
            let list = JobServiceClient::new(ch.clone()).list(req(pb::ListJobsRequest::default(), cred)).await;
            assert!(list.is_ok(), "{list:?}");
            let submit = JobServiceClient::new(ch.clone())
                .submit(req(pb::SubmitRequest { spec: Some(spec("")), ..Default::default() }, cred))
                .await
                .unwrap()
                .into_inner();
            assert_eq!(c.state(leader).jobs[&submit.job_id].spec.user, "nobody", "not mapped again");
            let hold = JobServiceClient::new(ch.clone())
                .update(req(
                    pb::UpdateJobRequest {
                        job_id: job,
                        change: pb::update_job_request::Change::Hold as i32,
                        ..Default::default()
                    },
                    cred,
                ))
                .await
                .map(drop);
            assert_eq!(code(hold), Some(Code::PermissionDenied));
            let again = JobServiceClient::new(ch.clone())
                .step_credential(req(pb::StepCredentialRequest { job_id: job }, cred))
                .await
                .map(drop);
            assert_eq!(code(again), Some(Code::PermissionDenied));
            let policy = AdminServiceClient::new(ch.clone())
                .update_policy(req(pb::UpdatePolicyRequest { json: "{}".into(), ..Default::default() }, cred))
                .await
                .map(drop);
            assert_eq!(code(policy), Some(Code::PermissionDenied), "target {target}");
            let drain = NodeServiceClient::new(ch.clone())
                .drain(req(pb::DrainRequest { name: "node-x".into(), reason: String::new() }, cred))
                .await
                .map(drop);
            assert_eq!(code(drain), Some(Code::PermissionDenied));
        }
        // Once the attempt ends, the credential opens nothing.
        nobody
            .call(|ch| {
                let r = nobody.request(pb::CancelRequest { job_id: job });
                async move { JobServiceClient::new(ch).cancel(r).await }
            })
            .await
            .unwrap();
        let plain = Security::Tls(Credentials::load(TlsFiles { ca: pki.main.join("ca.pem"), cert: None }).unwrap());
        let ch = plain.channel(&c.addrs[&leader], Expect::Server, WAIT).unwrap();
        let after =
            JobServiceClient::new(ch).list(req(pb::ListJobsRequest::default(), Some(credential.as_str()))).await;
        assert_eq!(after.err().map(|s| s.code()), Some(Code::Unauthenticated));
        let _ = stop.send(());
        let _ = tokio::time::timeout(Duration::from_secs(5), agent).await;
        for (_, h) in std::mem::take(&mut c.handles) {
            h.shutdown().await;
        }
    }
}

// ------------------------------------------------- broken replicas get out of the way

/// Damages every RocksDB data file (write-ahead log and tables) in `dir`
/// early on, where damage is never a torn tail that recovery may drop; returns
/// how many files it damaged. In a WAL it flips bytes inside one record's
/// payload, which its checksum covers: damage that hit a record's length in
/// the WAL's last block would read as a write torn by a crash, and RocksDB
/// drops such a tail silently (the shorter-log test covers that case).
fn damage_store(dir: &std::path::Path) -> usize {
    let mut damaged = 0;
    for entry in std::fs::read_dir(dir).unwrap() {
        let path = entry.unwrap().path();
        let name = path.file_name().unwrap().to_string_lossy().to_string();
        if !(name.ends_with(".log") || name.ends_with(".sst")) {
            continue;
        }
        let mut bytes = std::fs::read(&path).unwrap();
        if bytes.len() < 4096 {
            continue;
        }
        let range = if name.ends_with(".log") {
            let Some(f) =
                wal_fragments(&bytes).into_iter().find(|f| f.start >= bytes.len() / 8 && f.payload().len() >= 16)
            else {
                panic!("no WAL record to damage in {}", path.display())
            };
            f.payload().start + 4..f.payload().start + 12
        } else {
            bytes.len() / 8..bytes.len() / 8 + 256
        };
        for b in &mut bytes[range] {
            *b ^= 0x5a;
        }
        std::fs::write(&path, bytes).unwrap();
        damaged += 1;
    }
    damaged
}

async fn membership_call<R, F, Fut>(client: &Client, req: R, f: F) -> Result<pb::MembershipResponse, tonic::Status>
where
    R: Clone,
    F: Fn(AdminServiceClient<tonic::transport::Channel>, tonic::Request<R>) -> Fut,
    Fut: std::future::Future<Output = Result<tonic::Response<pb::MembershipResponse>, tonic::Status>>,
{
    client.call(|ch| f(AdminServiceClient::new(ch), client.request(req.clone()))).await.map(|r| r.into_inner())
}

/// Removes replica `id` from the cluster, starts it again on an empty data
/// directory (same id and address) and adds it back: the runbook for a replica
/// whose store was damaged or lost.
async fn replace_with_empty(c: &mut TestCluster, id: u64, client: &Client) {
    membership_call(client, pb::RemoveMemberRequest { id }, |mut a, r| async move { a.remove_member(r).await })
        .await
        .unwrap();
    c.dirs.insert(id, tempfile::tempdir().unwrap());
    let l = bind(&c.addrs[&id]).await;
    c.handles.insert(id, replica::start(c.config(id, true), l).await.unwrap());
    let addr = c.addrs[&id].clone();
    membership_call(client, pb::AddLearnerRequest { id, addr }, |mut a, r| async move { a.add_learner(r).await })
        .await
        .unwrap();
    let m =
        membership_call(client, pb::PromoteRequest { id }, |mut a, r| async move { a.promote(r).await }).await.unwrap();
    assert!(m.voters.contains(&id), "{m:?}");
}

/// Three replicas holding 40 submitted jobs, all applied, and a follower.
async fn cluster_of_40_jobs_and_a_follower() -> (TestCluster, u64, u64) {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let client = c.client();
    for i in 0..40 {
        submit(&client, spec("true"), &format!("before-{i}")).await.unwrap();
    }
    c.converge().await;
    let victim = *[1, 2, 3].iter().find(|id| **id != leader).unwrap();
    (c, leader, victim)
}

/// `victim` holds the 50 jobs and exactly the leader's state.
fn assert_same_50_jobs(c: &TestCluster, victim: u64, leader: u64) {
    assert_eq!(c.state(victim).jobs.len(), 50);
    assert!(snapshot::encode(&c.state(victim)) == snapshot::encode(&c.state(leader)), "replica states differ");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_damaged_store_is_refused_at_start_and_the_replica_rejoins_empty() {
    let (mut c, leader, victim) = cluster_of_40_jobs_and_a_follower().await;
    c.stop(victim).await;
    let dir = c.dirs[&victim].path().to_path_buf();
    assert!(damage_store(&dir) > 0, "no RocksDB file to damage in {}", dir.display());
    let l = bind(&c.addrs[&victim]).await;
    let err = match replica::start(c.config(victim, false), l).await {
        Ok(_) => panic!("a replica started on a damaged store"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("is damaged") && err.contains("gangway cluster remove"), "unclear refusal: {err}");
    println!("refused as it should be: {err}");
    // The other two go on.
    let survivors: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != victim).collect();
    let client = c.client_for(&survivors);
    for i in 0..10 {
        submit(&client, spec("true"), &format!("during-{i}")).await.unwrap();
    }
    replace_with_empty(&mut c, victim, &client).await;
    c.converge().await;
    assert_same_50_jobs(&c, victim, leader);
    c.shutdown().await;
}

/// A follower whose store comes back shorter than it was (its WAL's tail cut,
/// as a torn write or a disk that lost its cache would leave it, so recovery
/// drops the last records it had acknowledged) rejoins and is replicated to
/// again: no replica stops, the leader least of all, and every replica ends
/// with the same state.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_follower_whose_log_came_back_shorter_rejoins_without_stopping_anyone() {
    let (mut c, _, victim) = cluster_of_40_jobs_and_a_follower().await;
    let client = c.client();
    let applied_before = c.handles[&victim].replica.node.status().applied_index;
    c.stop(victim).await;
    let dir = c.dirs[&victim].path().to_path_buf();
    let wal = std::fs::read_dir(&dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| p.extension().is_some_and(|e| e == "log"))
        .max_by_key(|p| std::fs::metadata(p).unwrap().len())
        .expect("a WAL file");
    // Cut after the last whole record before the final quarter: the log is
    // clean, just shorter (as a disk that lost its write cache leaves it).
    let bytes = std::fs::read(&wal).unwrap();
    let keep = wal_record_ends(&bytes).into_iter().rfind(|end| *end <= bytes.len() * 3 / 4);
    let keep = keep.filter(|k| *k > 0).expect("no whole WAL record in the first three quarters");
    std::fs::OpenOptions::new().write(true).open(&wal).unwrap().set_len(keep as u64).unwrap();
    c.restart(victim).await;
    for i in 0..10 {
        submit(&client, spec("true"), &format!("after-{i}")).await.unwrap();
    }
    c.converge().await;
    for (id, h) in &c.handles {
        assert!(h.fatal_error().is_none(), "replica {id} stopped: {:?}", h.fatal_error());
    }
    let leader = c.leader().await;
    assert_same_50_jobs(&c, victim, leader);
    assert!(c.handles[&victim].replica.node.status().applied_index > applied_before);
    c.shutdown().await;
}

/// One physical record of a RocksDB WAL (its format: 32 KiB blocks of
/// records with a 7-byte header, checksum, length and type: 1 full, 2 first,
/// 3 middle, 4 last fragment; a block's last < 7 bytes are padding).
struct WalFragment {
    start: usize,
    end: usize,
    kind: u8,
}

impl WalFragment {
    const HEADER: usize = 7;

    fn payload(&self) -> std::ops::Range<usize> {
        self.start + Self::HEADER..self.end
    }
}

/// The WAL's physical records, in order, up to the first that is not whole.
fn wal_fragments(bytes: &[u8]) -> Vec<WalFragment> {
    const BLOCK: usize = 32 * 1024;
    let mut fragments = Vec::new();
    let mut pos = 0;
    while pos + WalFragment::HEADER <= bytes.len() {
        if BLOCK - pos % BLOCK < WalFragment::HEADER {
            pos += BLOCK - pos % BLOCK;
            continue;
        }
        let len = usize::from(u16::from_le_bytes([bytes[pos + 4], bytes[pos + 5]]));
        let kind = bytes[pos + 6];
        let end = pos + WalFragment::HEADER + len;
        if kind == 0 || end > bytes.len() {
            break;
        }
        fragments.push(WalFragment { start: pos, end, kind });
        pos = end;
    }
    fragments
}

/// Where each whole logical record of a RocksDB WAL ends.
fn wal_record_ends(bytes: &[u8]) -> Vec<usize> {
    wal_fragments(bytes).into_iter().filter(|f| f.kind == 1 || f.kind == 4).map(|f| f.end).collect()
}

/// Mounts a tmpfs of `mib` MiB on `dir` (tests run as root, as CI does).
fn mount_tmpfs(dir: &std::path::Path, mib: u64) {
    let ok = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={mib}m"), "tmpfs"])
        .arg(dir)
        .status()
        .map(|s| s.success())
        .unwrap_or(false);
    assert!(ok, "cannot mount a tmpfs on {} (the disk-full test needs root)", dir.display());
}

fn remount_tmpfs(dir: &std::path::Path, mib: u64) {
    let s =
        std::process::Command::new("mount").args(["-o", &format!("remount,size={mib}m")]).arg(dir).status().unwrap();
    assert!(s.success());
}

struct Unmount(std::path::PathBuf);

impl Drop for Unmount {
    fn drop(&mut self) {
        let _ = std::process::Command::new("umount").arg("-l").arg(&self.0).status();
    }
}

/// Retries of one fill write whose commit outcome was unknown.
const FILL_SUBMIT_RETRIES_MAX: usize = 5;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_replica_whose_disk_fills_stops_and_recovers_once_space_is_freed() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let victim = *[1, 2, 3].iter().find(|id| **id != leader).unwrap();
    // Move the victim onto a small tmpfs.
    c.stop(victim).await;
    let dir = c.dirs[&victim].path().to_path_buf();
    let saved = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&dir).unwrap() {
        let e = e.unwrap();
        std::fs::rename(e.path(), saved.path().join(e.file_name())).unwrap();
    }
    mount_tmpfs(&dir, 24);
    let _unmount = Unmount(dir.clone());
    for e in std::fs::read_dir(saved.path()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.join(e.file_name())).unwrap();
    }
    c.restart(victim).await;
    c.converge().await;
    // The restarted victim may have won an election meanwhile: leadership
    // moves back to a replica with room, so the writes that fill the victim
    // are replicated to it, not written by it.
    let others: Vec<u64> = [1, 2, 3].into_iter().filter(|id| *id != victim).collect();
    let deadline = tokio::time::Instant::now() + WAIT;
    loop {
        let now = c.leader().await;
        if now != victim {
            break;
        }
        assert!(tokio::time::Instant::now() < deadline, "leadership never left the victim");
        let admin = c.client_for(&[victim]);
        let _ = admin
            .call(|ch| {
                let r = admin.request(pb::TransferLeaderRequest { to: others[0] });
                async move { AdminServiceClient::new(ch).transfer_leader(r).await }
            })
            .await;
    }
    // Fill it: large scripts, acknowledged by the other two once it is full.
    let client = c.client_for(&others);
    // Incompressible scripts: RocksDB compresses what it flushes, and a
    // repeated byte would shrink to nothing and never fill the disk.
    let big = |seed: u64| {
        let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
        let noise: String = (0..512 * 1024)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                char::from(b'a' + (x % 26) as u8)
            })
            .collect();
        format!("#!/bin/sh\n# {noise}\ntrue\n")
    };
    let mut acked = Vec::new();
    let mut fatal = None;
    for i in 0..400 {
        let s = pb::JobSpec { script: big(i), workdir: "/tmp".into(), ..Default::default() };
        // Half-megabyte writes synced on a busy 2-core machine may miss one
        // commit deadline: the outcome is unknown, so retry with the same key
        // (what a client does); the property here is the full replica.
        let mut tries = 0;
        let id = loop {
            match submit(&client, s.clone(), &format!("fill-{i}")).await {
                Ok(r) => break r.job_id,
                Err(e) if e.code() == Code::Unavailable && tries < FILL_SUBMIT_RETRIES_MAX => tries += 1,
                Err(e) => panic!("fill submit {i}: {e:?}"),
            }
        };
        acked.push(id);
        if let Some(why) = c.handles[&victim].fatal_error() {
            fatal = Some(why);
            break;
        }
    }
    // Give the victim a moment to hit the wall if the loop ended first.
    let leader = c.leader().await;
    let (ls, vs) = (c.handles[&leader].replica.node.status(), c.handles[&victim].replica.node.status());
    let what = format!(
        "the full replica {victim} stops ({} submits acknowledged; leader {leader} at log {:?}, matched for the \
         victim {:?}; the victim at term {} applied {:?})",
        acked.len(),
        ls.last_log_index,
        ls.matched.get(&victim),
        vs.term,
        vs.applied_index
    );
    eventually(&what, || c.handles[&victim].fatal_error().is_some()).await;
    let why = fatal.or_else(|| c.handles[&victim].fatal_error()).unwrap();
    println!("the full replica stopped: {why}; {} submits acknowledged", acked.len());
    // It says NOT_SERVING and its wait() ends with the error.
    let channel = tonic::transport::Endpoint::from_shared(format!("http://{}", c.addrs[&victim]))
        .unwrap()
        .connect()
        .await
        .unwrap();
    let mut health = tonic_health::pb::health_client::HealthClient::new(channel);
    for service in ["", "gangway.v1.JobService"] {
        let r =
            health.check(tonic_health::pb::HealthCheckRequest { service: service.into() }).await.unwrap().into_inner();
        assert_eq!(r.status, tonic_health::pb::health_check_response::ServingStatus::NotServing as i32, "{service}");
    }
    let mut h = c.handles.remove(&victim).unwrap();
    let err = tokio::time::timeout(WAIT, h.wait()).await.expect("wait() returns on a fatal error").unwrap_err();
    assert!(format!("{err:#}").contains("fatal"), "{err:#}");
    h.shutdown().await;
    // The others go on.
    for i in 0..5 {
        acked.push(submit(&client, spec("true"), &format!("after-{i}")).await.unwrap().job_id);
    }
    // Space freed: it restarts and catches up, and nothing acknowledged is lost.
    remount_tmpfs(&dir, 512);
    c.restart(victim).await;
    c.converge().await;
    let state = c.state(victim);
    for id in &acked {
        assert!(state.jobs.contains_key(id), "acknowledged job {id} is missing on the recovered replica");
    }
    assert!(snapshot::encode(&state) == snapshot::encode(&c.state(leader)), "replica states differ");
    c.shutdown().await;
}

/// Takes a backup through the API from replica `id` into `file`.
async fn take_backup(c: &TestCluster, id: u64, file: &std::path::Path) -> u64 {
    let client = c.client_for(&[id]);
    let mut stream = client.admin_backup(pb::BackupRequest {}).await.unwrap().into_inner();
    let (mut bytes, mut index, mut total) = (Vec::new(), 0, 0);
    while let Some(chunk) = stream.message().await.unwrap() {
        if bytes.is_empty() {
            (index, total) = (chunk.index, chunk.total_bytes);
        }
        bytes.extend_from_slice(&chunk.data);
    }
    assert_eq!(bytes.len() as u64, total);
    gangway_raft_store::backup::Backup::from_bytes(&bytes).unwrap();
    std::fs::write(file, &bytes).unwrap();
    index
}

/// Disaster recovery: two of three replicas' data directories are destroyed
/// for good; a new cluster restored from a backup holds every job
/// acknowledged before the backup, elects a leader and takes new work, and a
/// replica added later receives the restored state.
/// The read lease: a confirmed round gives one, a leadership transfer's
/// paused heartbeats end it and no round takes one meanwhile (the target may
/// win with the leader's own vote), and the next round after gives one again.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_read_lease_comes_from_a_confirmed_round_and_never_spans_a_transfer() {
    let c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let node = &c.handles[&leader].replica.node;
    node.ensure_linearizable(WAIT).await.unwrap();
    assert!(node.lease_holds().await, "a confirmed round gives a lease");
    let pause = node.pause_heartbeats();
    assert!(!node.lease_holds().await, "a transfer ends it");
    node.ensure_linearizable(WAIT).await.unwrap();
    assert!(!node.lease_holds().await, "and no round takes one while heartbeats are paused");
    drop(pause);
    node.ensure_linearizable(WAIT).await.unwrap();
    assert!(node.lease_holds().await, "the next round after gives one again");
    // Stores closed before the process exits (RocksDB aborts on open ones).
    c.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_cluster_that_lost_its_majority_is_restored_from_a_backup() {
    let mut c = TestCluster::start(3).await;
    let leader = c.leader().await;
    let client = c.client();
    let mut before = Vec::new();
    for i in 0..30 {
        before.push(submit(&client, spec("true"), &format!("b{i}")).await.unwrap().job_id);
    }
    let cancelled = before[3];
    client.job_cancel(pb::CancelRequest { job_id: cancelled }).await.unwrap();
    c.converge().await;
    let follower = *[1, 2, 3].iter().find(|id| **id != leader).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let file = dir.path().join("gangway.backup");
    let index = take_backup(&c, follower, &file).await;
    assert!(index > 0);
    let at_backup = c.state(follower);
    // Work after the backup is lost with the majority.
    for i in 0..5 {
        submit(&client, spec("true"), &format!("after-{i}")).await.unwrap();
    }
    for id in [1, 2, 3] {
        c.stop(id).await;
    }
    drop(c); // the data directories go: the majority is lost for good
             // A new cluster, every member restored from the same file.
    let mut r = TestCluster::start_full(3, |_| fast_timing(), Some(file.clone())).await;
    let new_leader = r.leader().await;
    r.converge().await;
    let restored = r.state(new_leader);
    for id in &before {
        assert!(restored.jobs.contains_key(id), "acknowledged job {id} is missing after the restore");
    }
    assert_eq!(restored.jobs.len(), at_backup.jobs.len());
    assert_eq!(restored.jobs[&cancelled].state, gangway_core::JobState::Cancelled);
    assert_eq!(restored.next_job_id, at_backup.next_job_id + gangway_raft_store::backup::RESTORE_JOB_ID_GAP);
    assert_eq!(restored.policy, at_backup.policy);
    // A history of its own, the same on every replica: the lost cluster's
    // log indexes past the backup name other entries than the new one's.
    // Derived from the file at first, then drawn by the first leader.
    let derived = gangway_raft_store::backup::restored_history(
        &gangway_raft_store::backup::Backup::from_bytes(&std::fs::read(&file).unwrap()).unwrap(),
        at_backup.history,
    );
    let drawn = r.wait_history_drawn().await;
    assert!(drawn != at_backup.history && drawn != derived && drawn != 0, "drawn {drawn}, derived {derived}");
    assert!(r.state(new_leader).format >= gangway_core::format::FRESH_HISTORY_FORMAT);
    assert_eq!(r.state(new_leader).history_since, index);
    // Another cluster restored from the same file draws another history.
    let other = TestCluster::start_full(3, |_| fast_timing(), Some(file.clone())).await;
    let other_history = other.wait_history_drawn().await;
    assert!(other_history != drawn && other_history != derived, "two restores of one file share {other_history}");
    other.shutdown().await;
    // Until its history is drawn, a restored replica serves nothing that
    // names one: here one member of three, alone, elects no leader.
    let mut lone = TestCluster { restore: Some(file.clone()), ..TestCluster::empty() };
    let mut listeners = BTreeMap::new();
    for id in 1..=3 {
        let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
        lone.addrs.insert(id, l.local_addr().unwrap().to_string());
        lone.dirs.insert(id, tempfile::tempdir().unwrap());
        lone.timing.insert(id, fast_timing());
        listeners.insert(id, l);
    }
    let start = |c: &TestCluster, id: u64| {
        let mut config = c.config(id, false);
        config.restore = c.restore.clone();
        config
    };
    let first = replica::start(start(&lone, 1), listeners.remove(&1).unwrap()).await.unwrap();
    lone.handles.insert(1, first);
    let one = lone.client_for(&[1]);
    let events = || {
        let r = one.request(pb::EventsRequest { from_index: 0, job_id: 0, history: None });
        let mut api = JobServiceClient::new(one.channels()[0].clone());
        async move { api.events(r).await.map(drop) }
    };
    let status = || {
        let r = one.request(pb::ReplicaStatusRequest {});
        let mut api = AdminServiceClient::new(one.channels()[0].clone());
        async move { api.get_replica_status(r).await.unwrap().into_inner() }
    };
    let pending = status().await;
    assert!(pending.history_pending && pending.history == derived, "{pending:?}");
    let refused = events().await.unwrap_err();
    assert_eq!(refused.code(), Code::Unavailable, "{refused:?}");
    assert!(refused.message().contains("not drawn its history"), "{refused:?}");
    for id in [2, 3] {
        let h = replica::start(start(&lone, id), listeners.remove(&id).unwrap()).await.unwrap();
        lone.handles.insert(id, h);
    }
    let lone_history = lone.wait_history_drawn().await;
    let settled = status().await;
    assert!(!settled.history_pending && settled.history == lone_history && lone_history != derived);
    events().await.unwrap();
    lone.shutdown().await;
    // It takes new work, numbering jobs past any the lost cluster issued.
    let client = r.client();
    let next = submit(&client, spec("true"), "new").await.unwrap().job_id;
    assert_eq!(next, at_backup.next_job_id + gangway_raft_store::backup::RESTORE_JOB_ID_GAP);
    // A restored store refuses a second restore.
    let l = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let mut again = r.config(1, false);
    again.restore = Some(file.clone());
    let err = match replica::start(again, l).await {
        Ok(_) => panic!("a second restore over a store started"),
        Err(e) => format!("{e:#}"),
    };
    assert!(err.contains("without --restore"), "{err}");
    // A replica added later gets the restored state from the leader.
    r.start_joiner(4).await;
    let addr = r.addrs[&4].clone();
    membership_call(
        &client,
        pb::AddLearnerRequest { id: 4, addr },
        |mut a, req| async move { a.add_learner(req).await },
    )
    .await
    .unwrap();
    r.converge().await;
    let joined = r.state(4);
    assert!(before.iter().all(|id| joined.jobs.contains_key(id)), "the joiner lacks restored jobs");
    assert!(snapshot::encode(&joined) == snapshot::encode(&r.state(new_leader)), "replica states differ");
    r.shutdown().await;
}

/// Node lists are paged by size as job lists are: nodes carrying many long
/// labels come in several pages, each under every client's receive limit, and
/// the client follows them to the whole list.
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn node_lists_are_paged_under_the_response_limit() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    let client = c.client();
    let labels: std::collections::HashMap<String, String> =
        (0..64).map(|i| (format!("label{i:02}"), format!("{i:02}{}", "v".repeat(250)))).collect();
    for n in 0..240 {
        let req = pb::RegisterRequest {
            name: format!("big-{n:03}"),
            cpus: 8,
            mem_mb: 1024,
            labels: labels.clone(),
            ..Default::default()
        };
        client
            .call(|ch| {
                let r = client.request(req.clone());
                async move { AgentServiceClient::new(ch).register(r).await }
            })
            .await
            .unwrap();
    }
    let first =
        client.node_list(pb::ListNodesRequest { stale: false, after_name: String::new() }).await.unwrap().into_inner();
    assert!(prost::Message::encoded_len(&first) <= gangway_proto::limits::API_RESPONSE_BYTES_MAX);
    assert!(!first.next_after_name.is_empty() && first.nodes.len() < 240, "{} nodes in one page", first.nodes.len());
    let all = client.list_nodes(false).await.unwrap();
    assert_eq!(all.len(), 240);
    let names: BTreeSet<&str> = all.iter().map(|n| n.name.as_str()).collect();
    assert_eq!(names.len(), 240, "a node came twice");
    c.shutdown().await;
}

/// A gang of more than 1,024 nodes on a real cluster: once the cluster is on
/// data format 8 it is placed whole, and each node's launch order names the
/// gang as one hostlist with the node's own rank and resources; the agent's
/// completion of the order expands it to every node. A small gang's order
/// still names its nodes one by one (what agents before format 8 read).
#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_gang_of_more_than_1024_nodes_launches_from_one_hostlist() {
    let c = TestCluster::start(3).await;
    c.leader().await;
    c.wait_newest_format().await;
    let client = c.client();
    const GANG: u32 = 1_100;
    let name = |n: u32| format!("g{n:04}");
    let mut registering = Vec::new();
    for chunk in (0..GANG + 4).collect::<Vec<u32>>().chunks(64) {
        registering.clear();
        for &n in chunk {
            let req = pb::RegisterRequest { name: name(n), cpus: 8, mem_mb: 1024, ..Default::default() };
            let client = &client;
            registering.push(async move {
                client
                    .call(|ch| {
                        let r = client.request(req.clone());
                        async move { AgentServiceClient::new(ch).register(r).await }
                    })
                    .await
            });
        }
        for r in futures::future::join_all(registering.drain(..)).await {
            r.unwrap();
        }
    }
    let gang = submit(&client, pb::JobSpec { nodes: Some(i64::from(GANG)), ..spec("true") }, "gang").await.unwrap();
    let pair = submit(&client, pb::JobSpec { nodes: Some(2), ..spec("true") }, "pair").await.unwrap();
    wait_state(&client, gang.job_id, pb::JobState::Running).await;
    wait_state(&client, pair.job_id, pb::JobState::Running).await;
    let alloc = |job_id: u64| {
        let s = c.state(c.handles.keys().copied().next().unwrap());
        s.jobs[&job_id].allocation.as_ref().unwrap().nodes.iter().map(|n| n.node.clone()).collect::<Vec<_>>()
    };
    let gang_nodes = alloc(gang.job_id);
    assert_eq!(gang_nodes.len(), GANG as usize);
    let heartbeat = |node: String, reads_nodelist: bool| {
        let client = &client;
        async move {
            let req = pb::HeartbeatRequest { name: node, reads_nodelist, ..Default::default() };
            client
                .call(|ch| {
                    let r = client.request(req.clone());
                    async move { AgentServiceClient::new(ch).heartbeat(r).await }
                })
                .await
                .unwrap()
                .into_inner()
        }
    };
    let mut ranks = BTreeSet::new();
    for node in [&gang_nodes[0], &gang_nodes[GANG as usize / 2], &gang_nodes[GANG as usize - 1]] {
        let answer = heartbeat(node.clone(), true).await;
        let mut order = answer.launch.into_iter().find(|o| o.job_id == gang.job_id).expect("a launch order");
        assert!(order.nodes.is_empty(), "a big gang's nodes travel as a hostlist");
        assert!(order.nodelist.len() < 64, "{} bytes of hostlist", order.nodelist.len());
        assert!(order.step_addrs.is_empty(), "no node has a step address");
        assert_eq!(gang_nodes[order.node_rank as usize], *node, "the rank is the node's place in the allocation");
        ranks.insert(order.node_rank);
        gangway_node_agent::launch::complete_order(&mut order).unwrap();
        let named: BTreeSet<&String> = order.nodes.iter().collect();
        assert_eq!(named, gang_nodes.iter().collect::<BTreeSet<_>>(), "the hostlist names the whole gang");
        assert_eq!(order.step_addrs.len(), GANG as usize);
        let env = gangway_node_agent::launch::task_env(&order, node);
        assert_eq!(env["SLURM_JOB_NUM_NODES"], GANG.to_string());
        assert_eq!(env["SLURM_JOB_NODELIST"], order.nodelist);
    }
    assert_eq!(ranks.len(), 3);
    // An agent that predates hostlist orders gets every node named.
    let answer = heartbeat(gang_nodes[7].clone(), false).await;
    let order = answer.launch.into_iter().find(|o| o.job_id == gang.job_id).expect("a launch order");
    assert!(order.nodelist.is_empty());
    assert_eq!(order.nodes.iter().collect::<BTreeSet<_>>(), gang_nodes.iter().collect::<BTreeSet<_>>());
    assert_eq!(order.step_addrs.len(), GANG as usize);
    let pair_nodes = alloc(pair.job_id);
    let answer = heartbeat(pair_nodes[1].clone(), true).await;
    let order = answer.launch.into_iter().find(|o| o.job_id == pair.job_id).expect("a launch order");
    assert_eq!(order.nodes, pair_nodes, "a small gang names its nodes");
    assert!(order.nodelist.is_empty());
    // A hostlist an agent must not act on: more nodes than a job may have.
    let mut bad = pb::LaunchOrder { nodelist: "x[0-99999]".into(), ..order };
    bad.nodes.clear();
    let e = gangway_node_agent::launch::complete_order(&mut bad).unwrap_err();
    assert!(e.contains("nodelist") && e.contains("more than a job may have"), "{e}");
    c.shutdown().await;
}

// ---------------------------------------------------------------- hostile callers

/// What one caller can do to a cluster (issue 32): every crafted request is
/// refused or answered within its bounds, no replica stops, and an agent's
/// heartbeats keep being answered meanwhile.
mod hostile {
    use super::*;

    /// Heartbeats of a registered node, every 200 ms, until `stop`: the
    /// longest stretch without an answer, and whether one was refused as
    /// unknown (the node declared down).
    async fn heartbeats_until(
        client: Client,
        node: &'static str,
        mut stop: tokio::sync::oneshot::Receiver<()>,
    ) -> (Duration, bool) {
        let (mut last_ok, mut longest, mut unknown) = (tokio::time::Instant::now(), Duration::ZERO, false);
        loop {
            let req = pb::HeartbeatRequest { name: node.into(), ..Default::default() };
            let r = client
                .call(|ch| {
                    let r = client.request(req.clone());
                    async move { AgentServiceClient::new(ch).heartbeat(r).await }
                })
                .await;
            let now = tokio::time::Instant::now();
            if let Ok(resp) = r {
                unknown |= !resp.into_inner().known;
                longest = longest.max(now - last_ok);
                last_ok = now;
            }
            tokio::select! {
                _ = &mut stop => return (longest.max(now - last_ok), unknown),
                _ = tokio::time::sleep(Duration::from_millis(200)) => {}
            }
        }
    }

    fn raw_list(
        ch: tonic::transport::Channel,
        c: &Client,
        req: pb::ListJobsRequest,
    ) -> impl std::future::Future<Output = Result<pb::ListJobsResponse, tonic::Status>> {
        let r = c.request(req);
        async move { JobServiceClient::new(ch).list(r).await.map(|r| r.into_inner()) }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn crafted_requests_are_refused_or_bounded_and_no_replica_stops() {
        // The default node-down timeout: an agent stops its tasks after half
        // of it (15 s) without an answer; that is the bound heartbeats must keep.
        let c = TestCluster::start_with(3, |_| Timing { agent_heartbeat_interval_ms: 200, ..Timing::default() }).await;
        let leader = c.leader().await;
        let client = c.client();
        let reg = pb::RegisterRequest { name: "steady".into(), cpus: 8, mem_mb: 1024, ..Default::default() };
        client
            .call(|ch| {
                let r = client.request(reg.clone());
                async move { AgentServiceClient::new(ch).register(r).await }
            })
            .await
            .unwrap();
        let work = tempfile::tempdir().unwrap();
        for i in 0..20 {
            let mut s = script_spec("true", work.path());
            s.hold = true;
            submit(&client, s, &format!("held-{i}")).await.unwrap();
        }
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel();
        let beats = tokio::spawn(heartbeats_until(c.client(), "steady", stop_rx));

        for (id, addr) in &c.addrs {
            let ch = c.client_for(&[*id]).channels()[0].clone();
            for stale in [false, true] {
                // The id past every other: nothing after it, and no overflow.
                let r = raw_list(
                    ch.clone(),
                    &client,
                    pb::ListJobsRequest { after_id: u64::MAX, stale, ..Default::default() },
                )
                .await
                .unwrap_or_else(|e| panic!("replica {id} at {addr}: {e:?}"));
                assert!(r.jobs.is_empty() && r.next_after_id == 0, "{} jobs, next {}", r.jobs.len(), r.next_after_id);
                let r = raw_list(
                    ch.clone(),
                    &client,
                    pb::ListJobsRequest { after_id: u64::MAX - 1, stale, ..Default::default() },
                )
                .await
                .unwrap();
                assert!(r.jobs.is_empty());
            }
            // One past the states a listing may name.
            let states = vec![pb::JobState::Running as i32; gangway_controller::api::jobs::LIST_STATES_MAX + 1];
            let e = raw_list(ch.clone(), &client, pb::ListJobsRequest { states, ..Default::default() })
                .await
                .map(|r| r.jobs.len())
                .unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument, "{e:?}");
            assert!(e.message().starts_with("states:"), "{}", e.message());
            // At the limit, repeated states are one filter.
            let states = vec![pb::JobState::Pending as i32; gangway_controller::api::jobs::LIST_STATES_MAX];
            let r = raw_list(ch.clone(), &client, pb::ListJobsRequest { states, ..Default::default() }).await.unwrap();
            assert_eq!(r.jobs.len(), 20);
            // The 8 MB listing of the report: refused before it is decoded,
            // by the gate's byte limit for small methods.
            let states = vec![pb::JobState::Running as i32; 8_000_000];
            let e = raw_list(
                ch.clone(),
                &client,
                pb::ListJobsRequest { states, stale: true, user: "x".into(), ..Default::default() },
            )
            .await
            .map(|r| r.jobs.len())
            .unwrap_err();
            assert_ne!(e.code(), Code::Ok);
            // A name longer than any job's.
            let e = raw_list(ch.clone(), &client, pb::ListJobsRequest { user: "u".repeat(300), ..Default::default() })
                .await
                .map(|r| r.jobs.len())
                .unwrap_err();
            assert!(e.code() == Code::InvalidArgument && e.message().starts_with("user:"), "{e:?}");
            let e = raw_list(ch.clone(), &client, pb::ListJobsRequest { limit: 10_001, ..Default::default() })
                .await
                .map(|r| r.jobs.len())
                .unwrap_err();
            assert_eq!(e.code(), Code::InvalidArgument);
            // History filters are bounded before anything else (this cluster
            // has no accounting database: a bounded request learns that).
            let hist = |req: pb::HistoryRequest| {
                let r = client.request(req);
                let ch = ch.clone();
                async move { JobServiceClient::new(ch).history(r).await.map(drop) }
            };
            let n = gangway_controller::api::jobs::HISTORY_FILTER_VALUES_MAX;
            let e =
                hist(pb::HistoryRequest { job_ids: (0..=n as u64).collect(), ..Default::default() }).await.unwrap_err();
            assert!(e.code() == Code::InvalidArgument && e.message().starts_with("job_ids:"), "{e:?}");
            let e =
                hist(pb::HistoryRequest { users: vec!["u".into(); n + 1], ..Default::default() }).await.unwrap_err();
            assert!(e.code() == Code::InvalidArgument && e.message().starts_with("users:"), "{e:?}");
            let e = hist(pb::HistoryRequest { states: vec![99], ..Default::default() }).await.unwrap_err();
            assert!(e.code() == Code::InvalidArgument && e.message().starts_with("states:"), "{e:?}");
            let e = hist(pb::HistoryRequest { job_ids: vec![1, u64::MAX], before_id: u64::MAX, ..Default::default() })
                .await
                .unwrap_err();
            assert_eq!(e.code(), Code::FailedPrecondition, "{e:?}");
        }

        // Explains on every replica at once: each answered or refused for
        // lack of a permit, none lost.
        let mut calls = Vec::new();
        let job = 1;
        for id in c.addrs.keys() {
            for _ in 0..(gangway_controller::shared::ANALYSES_MAX * 3) {
                let ch = c.client_for(&[*id]).channels()[0].clone();
                let r = client.request(pb::ExplainRequest { job_id: job, stale: true });
                calls.push(tokio::spawn(async move { JobServiceClient::new(ch).explain(r).await.map(drop) }));
            }
        }
        for call in calls {
            if let Err(e) = call.await.unwrap() {
                assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
            }
        }

        // Streams: one identity's share per replica, and the one past it refused.
        let ch = c.client_for(&[leader]).channels()[0].clone();
        let mut open = Vec::new();
        for _ in 0..gangway_controller::shared::STREAMS_PER_PRINCIPAL_MAX {
            let r = client.stream_request(pb::EventsRequest { from_index: 1, job_id: 0, ..Default::default() });
            open.push(JobServiceClient::new(ch.clone()).events(r).await.unwrap().into_inner());
        }
        let r = client.stream_request(pb::EventsRequest { from_index: 1, job_id: 0, ..Default::default() });
        let e = JobServiceClient::new(ch.clone()).events(r).await.unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        assert!(e.message().starts_with("streams:"), "{}", e.message());
        // Another identity is not affected.
        let other = Client::new(&[c.addrs[&leader].clone()], "dev:other", &Security::Insecure).unwrap();
        let mut theirs = JobServiceClient::new(ch.clone())
            .events(other.stream_request(pb::EventsRequest { from_index: 1, job_id: 0, ..Default::default() }))
            .await
            .unwrap()
            .into_inner();
        assert_eq!(theirs.message().await.unwrap().unwrap().kind, "stream_start");
        // A closed stream gives its slot back.
        drop(open.pop());
        let deadline = tokio::time::Instant::now() + WAIT;
        loop {
            let r = client.stream_request(pb::EventsRequest { from_index: 1, job_id: 0, ..Default::default() });
            match JobServiceClient::new(ch.clone()).events(r).await {
                Ok(s) => {
                    open.push(s.into_inner());
                    break;
                }
                Err(e) => assert!(tokio::time::Instant::now() < deadline, "the slot never came back: {e:?}"),
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        drop(open);

        // The heartbeats were answered throughout, and no replica stopped.
        stop_tx.send(()).unwrap();
        let (longest, unknown) = beats.await.unwrap();
        assert!(!unknown, "the node was declared down");
        assert!(
            longest < Duration::from_millis(Timing::default().node_down_timeout_ms / 2),
            "{longest:?} without a heartbeat answer"
        );
        for (id, h) in &c.handles {
            assert!(h.fatal_error().is_none(), "replica {id} stopped: {:?}", h.fatal_error());
            assert!(h.replica.node.state().read().nodes.contains_key("steady"));
        }
        c.shutdown().await;
    }

    /// A caller past its read budget is refused with when to retry; others
    /// are served, and the client library gives the refusal back rather than
    /// wait out a long hint.
    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn reads_past_a_callers_budget_are_refused_with_a_hint_and_others_are_served() {
        let timing = Timing { user_read_units_per_s: 1.0, user_read_burst: 20.0, ..fast_timing() };
        let c = TestCluster::start_with(1, |_| timing.clone()).await;
        let leader = c.leader().await;
        let at = |who: &str| Client::new(&[c.addrs[&leader].clone()], who, &Security::Insecure).unwrap();
        let (admin, alice, bob) = (c.client(), at("dev:alice"), at("dev:bob"));
        let work = tempfile::tempdir().unwrap();
        for i in 0..20 {
            let mut s = script_spec("true", work.path());
            s.hold = true;
            submit(&admin, s, &format!("b-{i}")).await.unwrap();
        }
        let ch = alice.channels()[0].clone();
        // A full bucket lets one listing in, charged after it ran (20 jobs
        // looked at and their bytes: more than the bucket holds).
        let first = raw_list(ch.clone(), &alice, pb::ListJobsRequest::default()).await.unwrap();
        assert_eq!(first.jobs.len(), 20);
        let e = raw_list(ch.clone(), &alice, pb::ListJobsRequest::default()).await.map(|r| r.jobs.len()).unwrap_err();
        assert_eq!(e.code(), Code::ResourceExhausted, "{e:?}");
        assert!(e.message().starts_with("read budget:"), "{}", e.message());
        let hint: u64 = e.metadata().get("retry-after-ms").unwrap().to_str().unwrap().parse().unwrap();
        assert!(hint > 1_000, "{hint}");
        // Bob has his own bucket.
        raw_list(bob.channels()[0].clone(), &bob, pb::ListJobsRequest::default()).await.unwrap();
        // A hint longer than a call waits out comes back as the refusal.
        let got = alice
            .call(|ch| {
                let r = alice.request(pb::GetJobRequest { job_id: 1, stale: true });
                async move { JobServiceClient::new(ch).get(r).await }
            })
            .await
            .unwrap_err();
        assert_eq!(got.code(), Code::ResourceExhausted);
        c.shutdown().await;
    }

    proptest::proptest! {
        #![proptest_config(proptest::prelude::ProptestConfig { cases: 48, failure_persistence: None, .. Default::default() })]

        /// Random listing and history requests — integer bounds, huge
        /// repeated fields, any enum value — sent to a real replica get an
        /// answer or a refusal, and the replica never stops.
        #[test]
        fn random_listings_get_an_answer_or_a_refusal(
            list in list_requests(),
            history in history_requests(),
        ) {
            let (rt, c) = &*RANDOM_CLUSTER;
            rt.block_on(async {
                let client = c.client();
                let ch = client.channels()[0].clone();
                let allowed = [Code::InvalidArgument, Code::ResourceExhausted, Code::FailedPrecondition, Code::OutOfRange];
                match raw_list(ch.clone(), &client, list.clone()).await {
                    Ok(r) => assert!(r.jobs.len() <= 10_000),
                    Err(e) => assert!(allowed.contains(&e.code()), "{list:?}: {e:?}"),
                }
                let r = client.request(history.clone());
                if let Err(e) = JobServiceClient::new(ch).history(r).await {
                    assert!(allowed.contains(&e.code()), "{e:?}");
                }
                for (id, h) in &c.handles {
                    assert!(h.fatal_error().is_none(), "replica {id} stopped");
                }
            });
        }
    }

    /// One replica for the random requests, shared by their cases.
    static RANDOM_CLUSTER: std::sync::LazyLock<(tokio::runtime::Runtime, TestCluster)> =
        std::sync::LazyLock::new(|| {
            let rt = tokio::runtime::Builder::new_multi_thread().worker_threads(2).enable_all().build().unwrap();
            let c = rt.block_on(async {
                let c = TestCluster::start(1).await;
                let client = c.client();
                let work = tempfile::tempdir().unwrap();
                for i in 0..5 {
                    let mut s = script_spec("true", work.path());
                    s.hold = true;
                    submit(&client, s, &format!("r-{i}")).await.unwrap();
                }
                c
            });
            (rt, c)
        });

    fn extreme_u64() -> impl proptest::strategy::Strategy<Value = u64> {
        use proptest::prelude::*;
        prop_oneof![Just(0u64), Just(1), Just(u64::MAX), Just(u64::MAX - 1), Just(u64::MAX / 2), any::<u64>()]
    }

    fn list_requests() -> impl proptest::strategy::Strategy<Value = pb::ListJobsRequest> {
        use proptest::prelude::*;
        (
            prop::collection::vec(prop_oneof![0i32..12, any::<i32>()], 0..200),
            prop_oneof![Just(String::new()), "[a-z]{1,8}", ".{0,400}"],
            any::<bool>(),
            prop_oneof![Just(0u32), Just(1), Just(10_000), Just(10_001), any::<u32>()],
            extreme_u64(),
            any::<bool>(),
        )
            .prop_map(|(states, user, stale, limit, after_id, explain)| pb::ListJobsRequest {
                states,
                user: user.clone(),
                name: user,
                stale,
                limit,
                after_id,
                explain,
                ..Default::default()
            })
    }

    fn history_requests() -> impl proptest::strategy::Strategy<Value = pb::HistoryRequest> {
        use proptest::prelude::*;
        (
            prop::collection::vec(extreme_u64(), 0..1_500),
            prop::collection::vec(".{0,300}", 0..40),
            prop::collection::vec(any::<i32>(), 0..40),
            extreme_u64(),
            extreme_u64(),
            any::<u32>(),
            extreme_u64(),
        )
            .prop_map(|(job_ids, users, states, ended_after_ms, started_before_ms, limit, before_id)| {
                pb::HistoryRequest {
                    job_ids,
                    users: users.clone(),
                    names: users,
                    states,
                    ended_after_ms,
                    started_before_ms,
                    limit,
                    before_id,
                    ..Default::default()
                }
            })
    }
}
