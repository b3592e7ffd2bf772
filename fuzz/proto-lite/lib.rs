//! gangway-proto's `v1` messages, built alone for the fuzz targets (the fuzz
//! crate names this package `gangway-proto`, so the controller's edge
//! conversions, compiled into a target from their file, find them where
//! they expect them).

pub mod v1 {
    include!(concat!(env!("OUT_DIR"), "/gangway.v1.rs"));
}

/// Slurm's hostlists, from gangway-proto's own file (the CLI's parsers use it).
#[path = "../../proto/src/hostlist.rs"]
pub mod hostlist;
