//! openraft's own storage test suite against the RocksDB store, plus Gangway's
//! durability checks.

use gangway_raft_store::{open, LogStore, StateMachineStore, TypeConfig};
use openraft::testing::{StoreBuilder, Suite};
use openraft::StorageError;

struct Builder;

impl StoreBuilder<TypeConfig, LogStore, StateMachineStore, tempfile::TempDir> for Builder {
    async fn build(&self) -> Result<(tempfile::TempDir, LogStore, StateMachineStore), StorageError<u64>> {
        let dir = tempfile::tempdir().expect("temp dir");
        let stores = open(dir.path()).expect("open store");
        Ok((dir, stores.log, stores.state_machine))
    }
}

#[test]
fn openraft_storage_suite() {
    Suite::test_all(Builder).unwrap();
}

/// A store written by a build with another data format is refused at open,
/// naming the formats, instead of failing later on an undecodable entry.
#[test]
fn stores_in_another_data_format_are_refused() {
    // A fresh store is stamped and reopens.
    let fresh = tempfile::tempdir().unwrap();
    drop(open(fresh.path()).expect("open a new store"));
    // The closed store's background threads release its lock shortly after.
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match open(fresh.path()) {
            Ok(_) => break,
            Err(e) => {
                assert!(!e.to_string().contains("format"), "a store must reopen in its own format: {e}");
                assert!(std::time::Instant::now() < deadline, "the store never reopened: {e}");
                std::thread::sleep(std::time::Duration::from_millis(50));
            }
        }
    }
    // A store with entries but no stamp predates the stamp (format 1).
    let old = tempfile::tempdir().unwrap();
    {
        let mut opts = rocksdb::Options::default();
        opts.create_if_missing(true);
        opts.create_missing_column_families(true);
        let db = rocksdb::DB::open_cf(&opts, old.path(), ["log", "meta", "snapshot"]).unwrap();
        db.put_cf(db.cf_handle("log").unwrap(), 1u64.to_be_bytes(), b"an entry").unwrap();
    }
    let err = match open(old.path()) {
        Ok(_) => panic!("an old store opened"),
        Err(e) => e.to_string(),
    };
    assert!(err.contains("format 1") && err.contains("empty data directory"), "{err}");
}
