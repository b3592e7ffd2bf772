//! A replica's configuration, with defaults chosen for sub-second failover.

use std::collections::BTreeMap;
use std::path::PathBuf;

/// Raft and liveness timing. The defaults aim at a leader failover well under a
/// second on a LAN while tolerating a loaded 2-core host: a follower that hears
/// nothing for the lease (= `election_timeout_max_ms`) plus one election timeout
/// starts an election, so a dead leader is replaced in ~0.6–0.9 s.
#[derive(Debug, Clone)]
pub struct Timing {
    pub heartbeat_interval_ms: u64,
    pub election_timeout_min_ms: u64,
    pub election_timeout_max_ms: u64,
    /// Build a snapshot after this many applied entries since the last one.
    pub snapshot_logs_since_last: u64,
    /// Log entries kept after a snapshot, so a briefly lagging follower catches up
    /// from the log rather than a full snapshot.
    pub logs_kept_after_snapshot: u64,
    /// A node whose agent is silent this long is marked Down and its jobs
    /// requeued (Slurm waits 300 s). Agents stop their tasks after half of it
    /// without reaching a leader, so that is also how long running jobs ride
    /// out a control-plane outage (no quorum): the default tolerates 15 s.
    pub node_down_timeout_ms: u64,
    /// How often agents are asked to heartbeat.
    pub agent_heartbeat_interval_ms: u64,
    /// Writes per second one user may sustain, and in a burst (see `ratelimit`).
    pub user_writes_per_s: f64,
    pub user_write_burst: f64,
    /// Bytes of writes per second one user may sustain, and in a burst.
    pub user_write_bytes_per_s: f64,
    pub user_write_bytes_burst: f64,
    /// The same four for admins (their own budget; see `ratelimit`).
    pub admin_writes_per_s: f64,
    pub admin_write_burst: f64,
    pub admin_write_bytes_per_s: f64,
    pub admin_write_bytes_burst: f64,
    /// Read units per second one identity may spend on one replica, and in a
    /// full bucket (see `ratelimit::ReadLimiter`).
    pub user_read_units_per_s: f64,
    pub user_read_burst: f64,
}

impl Default for Timing {
    fn default() -> Self {
        Timing {
            heartbeat_interval_ms: 50,
            election_timeout_min_ms: 250,
            election_timeout_max_ms: 400,
            snapshot_logs_since_last: 20_000,
            logs_kept_after_snapshot: 2_000,
            node_down_timeout_ms: 30_000,
            agent_heartbeat_interval_ms: 1_000,
            user_writes_per_s: crate::ratelimit::WRITES_PER_S,
            user_write_burst: crate::ratelimit::WRITES_BURST,
            user_write_bytes_per_s: crate::ratelimit::WRITE_BYTES_PER_S,
            user_write_bytes_burst: crate::ratelimit::WRITE_BYTES_BURST,
            admin_writes_per_s: crate::ratelimit::ADMIN_WRITES_PER_S,
            admin_write_burst: crate::ratelimit::ADMIN_WRITES_BURST,
            admin_write_bytes_per_s: crate::ratelimit::ADMIN_WRITE_BYTES_PER_S,
            admin_write_bytes_burst: crate::ratelimit::ADMIN_WRITE_BYTES_BURST,
            user_read_units_per_s: crate::ratelimit::READ_UNITS_PER_S,
            user_read_burst: crate::ratelimit::READ_UNITS_BURST,
        }
    }
}

/// The site's power programs for elastic pools (`--resume-program`,
/// `--suspend-program`), run by the leader (`leader::power`).
#[derive(Debug, Clone, Default)]
pub struct PowerPrograms {
    pub resume: Option<PathBuf>,
    pub suspend: Option<PathBuf>,
}

#[derive(Debug, Clone)]
pub struct ReplicaConfig {
    pub id: u64,
    /// The address other replicas, agents and clients use to reach this one.
    pub advertise_addr: String,
    /// Every initial member, this one included: id → address. Used to form the
    /// cluster on first start; ignored once the data dir holds a cluster.
    pub peers: BTreeMap<u64, String>,
    pub data_dir: PathBuf,
    /// Start without forming a cluster: wait to be added with `cluster add`.
    pub join: bool,
    pub timing: Timing,
    /// Mutual TLS with this replica's server certificate, or `Insecure`.
    pub security: gangway_proto::tls::Security,
    /// Users made admins when the cluster's policy names none (the first
    /// admin of a new cluster; also the way back in if every admin was removed).
    pub bootstrap_admins: Vec<String>,
    /// Accept jobs that run as root (refused by default).
    pub allow_root_jobs: bool,
    /// Users see only their own jobs (Slurm's `PrivateData=jobs`); others'
    /// read as not found.
    pub private_jobs: bool,
    /// Bearer tokens this replica accepts, if any.
    pub tokens: Option<std::sync::Arc<gangway_proto::token::TokenVerifier>>,
    /// Seed an empty data directory from this backup file, as a member of a
    /// new cluster of `peers` (disaster recovery; every member is restored from
    /// the same file). Refused when the directory already holds a store.
    pub restore: Option<PathBuf>,
    /// The programs the leader runs to power elastic pools' nodes up and down.
    pub power: PowerPrograms,
    /// The accounting database `JobService.History` reads (`gangway
    /// accounting` writes it); `None`: this replica answers no history.
    pub accounting: Option<String>,
    /// Identities (or names) of accounting services (`--accounting-identity`):
    /// they see every job as operators do and report what they stored, and
    /// may do nothing else.
    pub accounting_identities: Vec<String>,
}

/// A replica's address as its cluster membership records it: `HOST:PORT`,
/// where it serves everything, or `HOST:PORT/PEERPORT` (or
/// `HOST:PORT/PEERHOST:PEERPORT`) when Raft has a peer port of its own
/// (`--peer-listen`), as etcd keeps its client and peer URLs apart. Clients,
/// agents and forwarded requests use the first part; only replicas' Raft
/// messages go to the second. An old membership's `HOST:PORT` reads as before.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReplicaAddr {
    /// Where clients, agents and forwarded requests reach the replica.
    pub api: String,
    /// Where its Raft messages go: the peer port, or `api` when it has none.
    pub peer: String,
    /// Whether the replica has a peer port of its own.
    pub split: bool,
}

impl ReplicaAddr {
    /// Parses a membership address, refusing one a replica cannot be reached
    /// at (a scheme, `http://` or `https://`, is allowed and dropped).
    pub fn parse(addr: &str) -> Result<ReplicaAddr, String> {
        let trimmed = addr.trim();
        let bare = trimmed.strip_prefix("http://").or_else(|| trimmed.strip_prefix("https://")).unwrap_or(trimmed);
        let (api, peer) = match bare.split_once('/') {
            None => (bare, None),
            Some((api, peer)) => (api, Some(peer)),
        };
        let Some((host, api_port)) = host_port(api) else {
            return Err(format!("'{addr}' must be HOST:PORT, or HOST:PORT/PEERPORT with a peer port"));
        };
        let Some(peer) = peer else {
            return Ok(ReplicaAddr { api: api.to_string(), peer: api.to_string(), split: false });
        };
        let (peer_host, peer_port) = match peer.parse::<u16>() {
            Ok(port) if port != 0 => (host, port),
            _ => host_port(peer).ok_or_else(|| {
                format!("'{addr}': the peer part '{peer}' must be PORT or HOST:PORT (a port from 1 to 65535)")
            })?,
        };
        if peer_port == api_port && peer_host.eq_ignore_ascii_case(host) {
            return Err(format!("'{addr}': the peer port must differ from the API port"));
        }
        Ok(ReplicaAddr { api: api.to_string(), peer: format!("{peer_host}:{peer_port}"), split: true })
    }

    /// The membership address of a replica reached at `api` and, when it
    /// has one, `peer`.
    pub fn format(&self) -> String {
        match self.split {
            false => self.api.clone(),
            true => format!("{}/{}", self.api, self.peer),
        }
    }

    /// The API part of a membership address (all of it when it does not parse:
    /// the caller's connection attempt then names it).
    pub fn api_of(addr: &str) -> String {
        ReplicaAddr::parse(addr).map_or_else(|_| addr.to_string(), |a| a.api)
    }

    /// Where Raft messages to the replica at `addr` go.
    pub fn peer_of(addr: &str) -> String {
        ReplicaAddr::parse(addr).map_or_else(|_| addr.to_string(), |a| a.peer)
    }
}

/// `HOST:PORT` split, with a port from 1 to 65535 and a host that is a
/// name, an IPv4 address or a bracketed IPv6 one (`[::1]:50051`).
fn host_port(s: &str) -> Option<(&str, u16)> {
    let (host, port) = s.rsplit_once(':')?;
    let port = port.parse::<u16>().ok().filter(|p| *p != 0)?;
    let bracketed = host.starts_with('[') && host.ends_with(']') && host.len() > 2;
    let plain = !host.is_empty() && !host.contains(|c: char| c == ':' || c == '[' || c == ']' || c.is_whitespace());
    (bracketed || plain).then_some((host, port))
}

/// Parses `1=host:port,2=host:port,...` into an id → address map (each
/// address may name a peer port, see [`ReplicaAddr`]).
pub fn parse_peers(s: &str) -> Result<BTreeMap<u64, String>, String> {
    let mut peers = BTreeMap::new();
    for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
        let (id, addr) = part
            .split_once('=')
            .ok_or_else(|| format!("peers: '{part}' must look like ID=HOST:PORT, e.g. 1=10.0.0.1:50051"))?;
        let id: u64 =
            id.trim().parse().map_err(|_| format!("peers: '{id}' is not a replica id (a positive integer)"))?;
        if id == 0 {
            return Err("peers: replica ids start at 1".into());
        }
        let addr = addr.trim();
        let addr = ReplicaAddr::parse(addr).map_err(|e| format!("peers: {e}"))?.format();
        if peers.insert(id, addr).is_some() {
            return Err(format!("peers: replica id {id} appears twice"));
        }
    }
    if peers.is_empty() {
        return Err("peers: give at least one ID=HOST:PORT".into());
    }
    Ok(peers)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn peers_parse_and_refuse() {
        let p = parse_peers("1=127.0.0.1:1, 2=127.0.0.1:2").unwrap();
        assert_eq!(p[&2], "127.0.0.1:2");
        assert!(parse_peers("1=a:1,1=b:2").unwrap_err().contains("twice"));
        assert!(parse_peers("x=a:1").unwrap_err().contains("replica id"));
        assert!(parse_peers("1=nohostport").unwrap_err().contains("HOST:PORT"));
        assert!(parse_peers("").is_err());
        assert!(parse_peers("1=a:1/a:1").unwrap_err().contains("differ"));
        assert!(parse_peers("1=a:1/x").unwrap_err().contains("PORT or HOST:PORT"));
        assert!(parse_peers("1=a:99999").unwrap_err().contains("HOST:PORT"));
    }

    #[test]
    fn replica_addresses_name_their_peer_port() {
        let one = ReplicaAddr::parse("10.0.0.1:50051").unwrap();
        assert_eq!((one.api.as_str(), one.peer.as_str(), one.split), ("10.0.0.1:50051", "10.0.0.1:50051", false));
        let port = ReplicaAddr::parse("10.0.0.1:50051/50052").unwrap();
        assert_eq!((port.api.as_str(), port.peer.as_str(), port.split), ("10.0.0.1:50051", "10.0.0.1:50052", true));
        let host = ReplicaAddr::parse("ctl-1:50051/10.9.0.1:7001").unwrap();
        assert_eq!((host.api.as_str(), host.peer.as_str()), ("ctl-1:50051", "10.9.0.1:7001"));
        let v6 = ReplicaAddr::parse("[::1]:50051/50052").unwrap();
        assert_eq!(v6.peer, "[::1]:50052");
        assert_eq!(ReplicaAddr::api_of("h:1/2"), "h:1");
        assert_eq!(ReplicaAddr::peer_of("h:1/2"), "h:2");
        assert_eq!(ReplicaAddr::peer_of("h:1"), "h:1");
        // The same port however written; port 0; unbracketed IPv6; a scheme.
        assert!(ReplicaAddr::parse("h:1/01").unwrap_err().contains("differ"));
        assert!(ReplicaAddr::parse("H:1/h:1").unwrap_err().contains("differ"));
        assert!(ReplicaAddr::parse("h:0").is_err());
        assert!(ReplicaAddr::parse("h:1/0").is_err());
        assert!(ReplicaAddr::parse("::1:5/6").is_err());
        assert!(ReplicaAddr::parse("a b:1").is_err());
        let schemed = ReplicaAddr::parse(" https://h:1/2 ").unwrap();
        assert_eq!((schemed.api.as_str(), schemed.peer.as_str(), schemed.format()), ("h:1", "h:2", "h:1/h:2".into()));
        assert_eq!(parse_peers("1=http://h:1").unwrap()[&1], "h:1");
    }
}
