//! `gangway doctor`: checks a host before it joins a cluster, and says what
//! to fix. Each check prints one line, `ok`, `warn` or `FAIL`, with the
//! numbers it measured; the command exits 1 when any check failed.
//!
//! Checks: the controllers' ports are reachable (TCP, within
//! [`CONNECT_TIMEOUT`]); their clocks against this host's; the certificates in the TLS directory load, chain
//! to its CA and are not about to expire; the cgroup version (the agent's
//! process-group fallback on v1); NVML and its GPUs; and the data
//! directory's fsync latency (Raft's log and the agent's fences wait on it).

use std::io::Write;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use clap::Args;

/// How long one controller may take to accept a connection.
pub const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// fsyncs timed in the data directory (4 KiB each): enough for a p99.
pub const FSYNC_SAMPLES: usize = 200;
/// An fsync p99 above this slows every commit (etcd's guidance: 10 ms).
pub const FSYNC_P99_WARN: Duration = Duration::from_millis(10);
/// A certificate expiring within this many days is a warning.
pub const CERT_WARN_DAYS: i64 = 30;
/// Clocks apart by more than this skew job start and end times, time limits
/// and logs between hosts (NTP keeps them within milliseconds).
pub const CLOCK_SKEW_WARN: Duration = Duration::from_millis(500);
/// Bearer tokens, step credentials and certificates are checked against the
/// clock, tokens with a minute's leeway: half of that fails the check.
pub const CLOCK_SKEW_FAIL: Duration = Duration::from_secs(30);

#[derive(Args)]
pub struct DoctorArgs {
    /// The directory the controller or agent keeps its data in (its fsync
    /// latency is measured there; default: the current directory).
    #[arg(long)]
    pub data_dir: Option<PathBuf>,
}

/// One check's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
enum Verdict {
    Ok,
    Warn,
    Fail,
}

struct Report {
    worst: Verdict,
}

impl Report {
    fn line(&mut self, v: Verdict, what: &str, detail: &str) {
        let tag = match v {
            Verdict::Ok => "ok  ",
            Verdict::Warn => "warn",
            Verdict::Fail => "FAIL",
        };
        println!("{tag}  {what:<13} {detail}");
        self.worst = self.worst.max(v);
    }
}

pub async fn run(a: DoctorArgs, endpoints: &[String], tls: &crate::tls::TlsArgs) -> anyhow::Result<()> {
    let mut r = Report { worst: Verdict::Ok };
    controllers(&mut r, endpoints).await;
    clocks(&mut r, endpoints, tls).await;
    certificates(&mut r, tls);
    cgroups(&mut r);
    gpus(&mut r);
    let dir = a.data_dir.unwrap_or_else(|| PathBuf::from("."));
    fsync(&mut r, &dir);
    if r.worst == Verdict::Fail {
        anyhow::bail!("doctor: some checks failed (FAIL above)");
    }
    Ok(())
}

async fn controllers(r: &mut Report, endpoints: &[String]) {
    if endpoints.is_empty() {
        r.line(Verdict::Warn, "controllers", "none named (--endpoints or GANGWAY_ENDPOINTS): not checked");
        return;
    }
    for ep in endpoints {
        let addr = ep.trim_start_matches("https://").trim_start_matches("http://");
        let started = Instant::now();
        match tokio::time::timeout(CONNECT_TIMEOUT, tokio::net::TcpStream::connect(addr)).await {
            Ok(Ok(_)) => {
                let ms = started.elapsed().as_secs_f64() * 1000.0;
                r.line(Verdict::Ok, "controller", &format!("{addr} reachable ({ms:.1} ms to connect)"));
            }
            Ok(Err(e)) => r.line(
                Verdict::Fail,
                "controller",
                &format!("{addr}: {e}; open its gRPC port (50051 by default) from this host"),
            ),
            Err(_) => r.line(
                Verdict::Fail,
                "controller",
                &format!("{addr}: no answer within {} s (a firewall dropping the port?)", CONNECT_TIMEOUT.as_secs()),
            ),
        }
    }
}

/// How doctor talks to the controllers: the TLS directory's first usable
/// certificate (a host about to join has its own, of any role), else what
/// the CLI would use.
fn security(tls: &crate::tls::TlsArgs, endpoints: &[String]) -> anyhow::Result<gangway_proto::tls::Security> {
    if let Some(dir) = &tls.tls_dir {
        let mut stems: Vec<String> = std::fs::read_dir(dir)?
            .flatten()
            .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_suffix("-key.pem")).map(str::to_string))
            .filter(|s| s != "ca")
            .collect();
        // The least powerful first: a user's, then a node's, then a replica's.
        stems.sort_by_key(|s| (["client", "agent", "server"].iter().position(|r| s.starts_with(r)), s.clone()));
        for stem in stems {
            if let Ok(c) = gangway_proto::tls::Credentials::load(gangway_proto::tls::TlsFiles::in_dir(dir, &stem)) {
                return Ok(gangway_proto::tls::Security::Tls(c));
            }
        }
    }
    tls.for_client(endpoints)
}

/// Each controller's clock against this host's: its time when it answered
/// against the middle of the round trip (so within half of it).
async fn clocks(r: &mut Report, endpoints: &[String], tls: &crate::tls::TlsArgs) {
    use gangway_proto::v1::admin_service_client::AdminServiceClient;
    if endpoints.is_empty() {
        return;
    }
    let security = match security(tls, endpoints) {
        Ok(s) => s,
        Err(e) => return r.line(Verdict::Warn, "clock", &format!("not checked: no credentials to ask with ({e})")),
    };
    for ep in endpoints {
        let addr = ep.trim_start_matches("https://").trim_start_matches("http://");
        // Connected first: the round trip timed is the call's alone.
        let (mut sent, mut started) = (std::time::SystemTime::now(), Instant::now());
        let asked = tokio::time::timeout(2 * CONNECT_TIMEOUT, async {
            let ch = security
                .connect(addr, gangway_proto::tls::Expect::Server, CONNECT_TIMEOUT)
                .await
                .map_err(anyhow::Error::msg)?;
            (sent, started) = (std::time::SystemTime::now(), Instant::now());
            let s = AdminServiceClient::new(ch).get_replica_status(gangway_proto::v1::ReplicaStatusRequest {}).await?;
            anyhow::Ok(s.into_inner())
        })
        .await;
        let rtt = started.elapsed();
        let status = match asked {
            Ok(Ok(s)) => s,
            // Reachability is the controllers' line; this one is about clocks.
            Ok(Err(e)) => {
                r.line(Verdict::Warn, "clock", &format!("{addr}: not read ({e})"));
                continue;
            }
            Err(_) => {
                r.line(Verdict::Warn, "clock", &format!("{addr}: not read within {} s", 2 * CONNECT_TIMEOUT.as_secs()));
                continue;
            }
        };
        let Some(theirs) = status.now_unix_ms else {
            r.line(Verdict::Warn, "clock", &format!("{addr}: this replica's build does not say its time"));
            continue;
        };
        let mid = sent + rtt / 2;
        let ours = mid.duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as i64);
        let skew_ms = theirs as i64 - ours;
        let skew = Duration::from_millis(skew_ms.unsigned_abs());
        let detail = format!("{addr}: {skew_ms:+} ms against this host (±{:.1} ms)", rtt.as_secs_f64() * 500.0);
        match skew {
            s if s > CLOCK_SKEW_FAIL => r.line(
                Verdict::Fail,
                "clock",
                &format!("{detail}; tokens and credentials will be refused: run NTP (chrony) on every host"),
            ),
            s if s > CLOCK_SKEW_WARN => {
                r.line(Verdict::Warn, "clock", &format!("{detail}; run NTP (chrony) on every host"))
            }
            _ => r.line(Verdict::Ok, "clock", &detail),
        }
    }
}

/// Every certificate of the TLS directory (`STEM.pem` with `STEM-key.pem`),
/// loaded as the daemons load them: it must match its key and chain to the
/// directory's `ca.pem`.
fn certificates(r: &mut Report, tls: &crate::tls::TlsArgs) {
    let Some(dir) = tls.tls_dir.clone() else {
        r.line(Verdict::Warn, "certificates", "no --tls-dir (or GANGWAY_TLS_DIR): not checked");
        return;
    };
    let mut stems: Vec<String> = std::fs::read_dir(&dir)
        .map(|d| {
            d.flatten()
                .filter_map(|e| e.file_name().to_str().and_then(|n| n.strip_suffix("-key.pem")).map(str::to_string))
                .collect()
        })
        .unwrap_or_default();
    // The CA's own key (a directory `gangway tls ca create` wrote) is no
    // process's certificate: the others are checked against it.
    stems.retain(|s| s != "ca");
    stems.sort();
    if stems.is_empty() {
        r.line(Verdict::Fail, "certificates", &format!("{} holds no STEM.pem with STEM-key.pem", dir.display()));
        return;
    }
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
    for stem in stems {
        let files = gangway_proto::tls::TlsFiles::in_dir(&dir, &stem);
        match gangway_proto::tls::Credentials::load(files) {
            Err(e) => r.line(Verdict::Fail, "certificate", &format!("{stem}: {e}")),
            Ok(c) => {
                let who = c.principal().map(|p| p.encode()).unwrap_or_else(|| stem.clone());
                let days = c.not_after().map(|t| (t - now) / 86_400);
                match days {
                    Some(d) if d < 0 => {
                        r.line(Verdict::Fail, "certificate", &format!("{who}: expired; issue a new one"))
                    }
                    Some(d) if d < CERT_WARN_DAYS => {
                        r.line(Verdict::Warn, "certificate", &format!("{who}: expires in {d} days; renew it"))
                    }
                    Some(d) => r.line(Verdict::Ok, "certificate", &format!("{who}: valid for {d} more days")),
                    None => r.line(Verdict::Ok, "certificate", &format!("{who}: loaded")),
                }
            }
        }
    }
}

fn cgroups(r: &mut Report) {
    if Path::new("/sys/fs/cgroup/cgroup.controllers").exists() {
        r.line(Verdict::Ok, "cgroups", "v2: the agent confines jobs in cgroups");
    } else if Path::new("/sys/fs/cgroup").exists() {
        r.line(
            Verdict::Warn,
            "cgroups",
            "v1 (or hybrid): the agent falls back to process groups (no cgroup limits or accounting for \
             jobs); boot with systemd.unified_cgroup_hierarchy=1 for v2",
        );
    } else {
        r.line(Verdict::Warn, "cgroups", "no /sys/fs/cgroup: jobs run in process groups only");
    }
}

fn gpus(r: &mut Report) {
    match gangway_node_agent::nvml::NvmlProvider::probe() {
        Ok((_, gpus)) => {
            let models: std::collections::BTreeSet<&str> = gpus.iter().map(|g| g.model.as_str()).collect();
            let models: Vec<&str> = models.into_iter().collect();
            r.line(Verdict::Ok, "gpus", &format!("NVML reports {} GPUs ({})", gpus.len(), models.join(", ")));
        }
        Err(e) => r.line(Verdict::Warn, "gpus", &format!("{e} (fine for a CPU node or a controller host)")),
    }
}

/// Times [`FSYNC_SAMPLES`] 4 KiB write+fsync rounds in `dir`.
fn fsync(r: &mut Report, dir: &Path) {
    let path = dir.join(format!(".gangway-doctor-{}", std::process::id()));
    let result = (|| -> std::io::Result<Vec<Duration>> {
        let mut f = std::fs::OpenOptions::new().create_new(true).write(true).open(&path)?;
        let block = [0u8; 4096];
        let mut times = Vec::with_capacity(FSYNC_SAMPLES);
        for _ in 0..FSYNC_SAMPLES {
            let t = Instant::now();
            f.write_all(&block)?;
            f.sync_data()?;
            times.push(t.elapsed());
        }
        Ok(times)
    })();
    let _ = std::fs::remove_file(&path);
    match result {
        Err(e) => {
            r.line(Verdict::Fail, "disk", &format!("{}: {e}; the data directory must be writable", dir.display()))
        }
        Ok(mut times) => {
            times.sort();
            let at = |q: f64| times[((times.len() as f64 * q) as usize).min(times.len() - 1)];
            let (p50, p99) = (at(0.50), at(0.99));
            let detail = format!(
                "fsync in {}: p50 {:.2} ms, p99 {:.2} ms ({FSYNC_SAMPLES} x 4 KiB)",
                dir.display(),
                p50.as_secs_f64() * 1000.0,
                p99.as_secs_f64() * 1000.0
            );
            if p99 > FSYNC_P99_WARN {
                let advice =
                    format!("{detail}; above {} ms every commit waits: use an SSD", FSYNC_P99_WARN.as_millis());
                r.line(Verdict::Warn, "disk", &advice);
            } else {
                r.line(Verdict::Ok, "disk", &detail);
            }
        }
    }
}
