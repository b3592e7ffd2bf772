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
