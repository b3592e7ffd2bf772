//! Gangway's wire types, generated from `proto/gangway/v1/*.proto`. This crate is
//! the only place wire types are defined; conversion to the core model lives at
//! the API edge in `controller/src/api`.

#![allow(clippy::all)]

pub mod v1 {
    tonic::include_proto!("gangway.v1");
}

/// Encoded file descriptors of every service, for gRPC server reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] = tonic::include_file_descriptor_set!("gangway_descriptor");

/// Metadata key that carries the caller identity on every request.
pub const IDENTITY_METADATA_KEY: &str = "gangway-identity";

pub mod client;
pub mod events;
pub mod telemetry;
