//! Opening the RocksDB that holds one replica's Raft log, metadata and snapshots.

use std::path::Path;
use std::sync::Arc;

use rocksdb::{ColumnFamilyDescriptor, Options, DB};

use crate::log_store::LogStore;
use crate::state_machine::StateMachineStore;

pub(crate) const CF_LOG: &str = "log";
pub(crate) const CF_META: &str = "meta";
pub(crate) const CF_SNAPSHOT: &str = "snapshot";

#[derive(Debug, thiserror::Error)]
pub enum StoreError {
    #[error("cannot open the store at {path}: {source}")]
    Open { path: String, source: rocksdb::Error },
    #[error("the snapshot stored at {path} cannot be read: {reason}")]
    Snapshot { path: String, reason: String },
}

/// The two halves openraft needs, over one shared database.
pub struct Stores {
    pub log: LogStore,
    pub state_machine: StateMachineStore,
}

/// Opens (creating if missing) the store in `dir`.
pub fn open(dir: &Path) -> Result<Stores, StoreError> {
    let mut opts = Options::default();
    opts.create_if_missing(true);
    opts.create_missing_column_families(true);
    // Few, small writes at a high rate: keep memtables modest and let one
    // background thread flush and compact.
    opts.set_max_background_jobs(2);
    let cfs = [CF_LOG, CF_META, CF_SNAPSHOT].map(|name| ColumnFamilyDescriptor::new(name, Options::default()));
    let db = DB::open_cf_descriptors(&opts, dir, cfs)
        .map_err(|source| StoreError::Open { path: dir.display().to_string(), source })?;
    let db = Arc::new(db);
    let state_machine = StateMachineStore::load(db.clone())
        .map_err(|reason| StoreError::Snapshot { path: dir.display().to_string(), reason })?;
    Ok(Stores { log: LogStore::new(db), state_machine })
}
