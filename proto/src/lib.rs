//! Gangway's wire types, generated from `proto/gangway/v1/*.proto`. This crate is
//! the only place wire types are defined; conversion to the core model lives at
//! the API edge in `controller/src/api`.

#![allow(clippy::all)]

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
pub mod limits;
pub mod pki;
pub mod step_cred;
pub mod telemetry;
pub mod tls;
pub mod token;
