//! Gangway's wire types, generated from `proto/gangway/v1/*.proto`. This crate is
//! the only place wire types are defined; conversion to the core model lives at
//! the API edge in `controller/src/api`.

#![allow(clippy::all)]
// This crate parses what the network sends: an overflow must never panic a daemon.
#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects, clippy::cast_possible_truncation))]

pub mod v1 {
    tonic::include_proto!("gangway.v1");
}

/// Encoded file descriptors of every service, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("gangway_descriptor");

/// Metadata key that carries the caller's claimed identity. Honoured only by
/// clusters running with `--insecure`; a secured cluster takes identity from the
/// caller's certificate.
pub const IDENTITY_METADATA_KEY: &str = "gangway-identity";
/// Metadata key with which a replica forwarding a request names its caller
/// (`role:name`); believed only from a peer holding a server certificate.
pub const FORWARDED_FOR_METADATA_KEY: &str = "gangway-forwarded-for";
/// Response metadata with which a replica that forwarded a call to the
/// leader names the leader's address: the client sends its next calls there,
/// so a fleet of agents does not keep paying a follower's hop per heartbeat.
pub const LEADER_METADATA_KEY: &str = "gangway-leader";

/// A replica's part in the cluster as `ReplicaStatus.role` carries it
/// (Raft's server state, or that it could not be asked): written and read
/// through this type, never as bare text.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ReplicaRole {
    Leader,
    Follower,
    Candidate,
    Learner,
    Shutdown,
    /// The replica did not answer a status probe.
    Unreachable,
}

impl ReplicaRole {
    pub const ALL: [ReplicaRole; 6] = [
        ReplicaRole::Leader,
        ReplicaRole::Follower,
        ReplicaRole::Candidate,
        ReplicaRole::Learner,
        ReplicaRole::Shutdown,
        ReplicaRole::Unreachable,
    ];

    /// As `gangway cluster status` shows it and the wire carries it.
    pub fn as_str(self) -> &'static str {
        match self {
            ReplicaRole::Leader => "leader",
            ReplicaRole::Follower => "follower",
            ReplicaRole::Candidate => "candidate",
            ReplicaRole::Learner => "learner",
            ReplicaRole::Shutdown => "shutdown",
            ReplicaRole::Unreachable => "unreachable",
        }
    }

    /// The role a status names (None: a build with a role this one does not know).
    pub fn parse(text: &str) -> Option<ReplicaRole> {
        ReplicaRole::ALL.into_iter().find(|r| r.as_str() == text)
    }
}

impl v1::ReplicaStatus {
    /// The replica's role, parsed (None: unknown to this build).
    pub fn replica_role(&self) -> Option<ReplicaRole> {
        ReplicaRole::parse(&self.role)
    }
}

/// The host other nodes reach node `name` at, from the address it registered
/// (`HOST[:PORT]`, HOST possibly empty): that host, else its name.
pub fn node_host<'a>(name: &'a str, addr: &'a str) -> &'a str {
    let host = addr.rsplit_once(':').map_or(addr, |(h, _)| h);
    if host.is_empty() {
        name
    } else {
        host
    }
}

/// Node `name`'s step service (`HOST:PORT`), when its agent registered a port.
pub fn step_addr(name: &str, addr: &str) -> Option<String> {
    let (_, port) = addr.rsplit_once(':')?;
    Some(format!("{}:{port}", node_host(name, addr)))
}

pub mod client;
pub mod events;
pub mod hostlist;
pub mod limits;
pub mod orders;
pub mod pki;
pub mod retry;
pub mod step_cred;
pub mod telemetry;
pub mod tls;
pub mod token;

#[cfg(test)]
mod tests {
    use super::ReplicaRole;

    #[test]
    fn replica_roles_read_back_as_written() {
        for role in ReplicaRole::ALL {
            assert_eq!(ReplicaRole::parse(role.as_str()), Some(role));
        }
        assert_eq!(ReplicaRole::parse("Leader"), None, "roles are lower case on the wire");
    }
}

/// A job state's name as Slurm prints it (`PENDING`, `NODE_FAIL`; `UNKNOWN`
/// for an unset or unknown value): what sacct, the console and the
/// accounting database show and store.
pub fn job_state_name(s: i32) -> &'static str {
    use v1::JobState;
    match JobState::try_from(s).unwrap_or(JobState::Unspecified) {
        JobState::Pending => "PENDING",
        JobState::Running => "RUNNING",
        JobState::Completed => "COMPLETED",
        JobState::Failed => "FAILED",
        JobState::Cancelled => "CANCELLED",
        JobState::Timeout => "TIMEOUT",
        JobState::NodeFail => "NODE_FAIL",
        JobState::Deadline => "DEADLINE",
        JobState::Suspended => "SUSPENDED",
        JobState::Unspecified => "UNKNOWN",
    }
}

/// The state a [`job_state_name`] names.
pub fn job_state_named(name: &str) -> Option<v1::JobState> {
    v1::JobState::from_str_name(&format!("JOB_STATE_{name}")).filter(|s| *s != v1::JobState::Unspecified)
}
