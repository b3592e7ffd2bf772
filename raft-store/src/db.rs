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
    #[error(
        "the store at {path} is damaged ({reason}). This replica must not serve from it: remove it from the \
         cluster (gangway cluster remove ID), move the data directory away, start the replica on an empty \
         one with --join, and add it back (gangway cluster add ID ADDR, then gangway cluster promote ID); \
         it copies the state from the others"
    )]
    Corrupt { path: String, reason: String },
    #[error("cannot restore into {path}: {reason}")]
    Restore { path: String, reason: String },
    #[error(
        "the data in {path} was written in format {found}; this build reads formats {FORMAT_OLDEST}..={FORMAT_NEWEST}. \
         Run a build that reads it (docs/operations.md: upgrades), or start from an empty data directory"
    )]
    Format { path: String, found: u32 },
}

use gangway_core::format::{readable, FORMAT_BASE, FORMAT_NEWEST, FORMAT_OLDEST};

/// Meta key holding the store's data format (a little-endian u32): the newest
/// format anything in the store may be written in. A new store starts at
/// [`FORMAT_BASE`], as every log does; it rises with the cluster's format (see
/// `gangway_core::format`). A store stamped with a format this build does not
/// read is refused at open with a clear error instead of failing later on the
/// first entry it cannot decode.
pub(crate) const FORMAT_KEY: &[u8] = b"data_format";

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
    // Damage is an error, never silently skipped: RocksDB checks every file it
    // opens and every block it reads against its checksums.
    opts.set_paranoid_checks(true);
    // WAL replay after a crash may drop only a torn last record (one that was
    // never synced, so never acknowledged); damage anywhere before it refuses
    // the open instead of dropping acknowledged entries after the damage (the
    // default, PointInTime, would).
    opts.set_wal_recovery_mode(rocksdb::DBRecoveryMode::TolerateCorruptedTailRecords);
    let cfs = [CF_LOG, CF_META, CF_SNAPSHOT].map(|name| ColumnFamilyDescriptor::new(name, Options::default()));
    let db = DB::open_cf_descriptors(&opts, dir, cfs).map_err(|source| {
        let path = dir.display().to_string();
        match source.kind() {
            rocksdb::ErrorKind::Corruption => StoreError::Corrupt { path, reason: source.to_string() },
            _ => StoreError::Open { path, source },
        }
    })?;
    let stamped = check_format(&db, dir)?;
    verify(&db).map_err(|reason| StoreError::Corrupt { path: dir.display().to_string(), reason })?;
    let db = Arc::new(db);
    let state_machine = StateMachineStore::load(db.clone(), stamped)
        .map_err(|reason| StoreError::Snapshot { path: dir.display().to_string(), reason })?;
    Ok(Stores { log: LogStore::new(db, stamped), state_machine })
}

/// Stamps the store with `format` (synced).
pub(crate) fn write_format(db: &DB, format: u32) -> Result<(), rocksdb::Error> {
    let meta = db.cf_handle(CF_META).expect("column family created at open");
    let mut opts = rocksdb::WriteOptions::default();
    opts.set_sync(true);
    db.put_cf_opt(meta, FORMAT_KEY, format.to_le_bytes(), &opts)
}

/// Refuses a store written in a format this build does not read; stamps a
/// new, empty store. Stores from before the stamp existed (format 1) hold
/// entries but no stamp. Returns the store's format.
fn check_format(db: &DB, dir: &Path) -> Result<u32, StoreError> {
    let open_err = |source| StoreError::Open { path: dir.display().to_string(), source };
    let meta = db.cf_handle(CF_META).expect("column family created at open");
    let found = match db.get_cf(meta, FORMAT_KEY).map_err(open_err)? {
        Some(v) if v.len() == 4 => u32::from_le_bytes(v[..4].try_into().expect("4 bytes")),
        Some(_) => 0,
        None => {
            let log = db.cf_handle(CF_LOG).expect("column family created at open");
            let has_log = db.iterator_cf(log, rocksdb::IteratorMode::Start).next().is_some();
            let has_meta = db.iterator_cf(meta, rocksdb::IteratorMode::Start).next().is_some();
            if has_log || has_meta {
                1
            } else {
                write_format(db, FORMAT_BASE).map_err(open_err)?;
                FORMAT_BASE
            }
        }
    };
    if !readable(found) {
        return Err(StoreError::Format { path: dir.display().to_string(), found });
    }
    Ok(found)
}

/// Reads every key and value of every column family with checksums verified,
/// so a damaged store is refused at open rather than found later, mid-apply.
/// The store holds a snapshot and the log since it (bounded by the snapshot
/// policy), so this reads tens of MiB at most.
fn verify(db: &DB) -> Result<(), String> {
    for name in [CF_LOG, CF_META, CF_SNAPSHOT] {
        let cf = db.cf_handle(name).expect("column family created at open");
        let mut read = rocksdb::ReadOptions::default();
        read.set_verify_checksums(true);
        read.fill_cache(false);
        let mut it = db.raw_iterator_cf_opt(cf, read);
        it.seek_to_first();
        while it.valid() {
            it.next();
        }
        it.status().map_err(|e| format!("column family {name}: {e}"))?;
    }
    Ok(())
}
