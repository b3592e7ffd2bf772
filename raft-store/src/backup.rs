//! Backups: a consistent copy of one replica's applied state, and the seed of
//! a new cluster when a majority is lost for good (etcd's snapshot restore).
//!
//! A backup file is `GWBK` | version (u32 LE) | CRC-32C of the rest (u32 LE) |
//! bincode of [`Backup`]. The state inside is a snapshot in the cluster's data
//! format at the time, with the log index it reflects.
//!
//! Restoring writes a new store whose snapshot is the backup's state at its
//! index, its log empty and purged through that index, and its membership the
//! new cluster's replicas. Every replica of the new cluster is restored from
//! the same file (as with etcd), so all start from the same state and elect a
//! leader; replicas added later receive the state as a snapshot.

use std::collections::{BTreeMap, BTreeSet};
use std::path::Path;

use gangway_core::format::crc32c;
use openraft::{BasicNode, CommittedLeaderId, LogId, Membership, SnapshotMeta, StoredMembership};
use serde::{Deserialize, Serialize};

use crate::codec::{decode, encode};
use crate::db::{StoreError, CF_META, CF_SNAPSHOT};
use crate::NodeId;

const BACKUP_MAGIC: &[u8; 4] = b"GWBK";
/// The backup file's layout version (its state has its own data format).
pub const BACKUP_VERSION: u32 = 1;
/// A restored cluster numbers new jobs from the backup's next id plus this:
/// ids the lost cluster issued after the backup are never reused (agents fence
/// launches by job id and attempt, and users and scripts remember ids).
pub const RESTORE_JOB_ID_GAP: u64 = 1_000_000;

#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Backup {
    /// The log index the state reflects (every entry through it applied).
    pub index: u64,
    /// The replica that took it, and when (Unix ms).
    pub taken_by: NodeId,
    pub taken_at_ms: u64,
    /// The state, as a snapshot (`gangway_core::snapshot`).
    #[serde(with = "gangway_core::format::raw_bytes")]
    pub snapshot: Vec<u8>,
}

impl Backup {
    pub fn to_bytes(&self) -> Vec<u8> {
        let body = encode(self);
        let mut out = Vec::with_capacity(body.len().saturating_add(12));
        out.extend_from_slice(BACKUP_MAGIC);
        out.extend_from_slice(&BACKUP_VERSION.to_le_bytes());
        out.extend_from_slice(&crc32c(&body).to_le_bytes());
        out.extend_from_slice(&body);
        out
    }

    /// Decodes and checks a backup file, including that its state decodes.
    pub fn from_bytes(bytes: &[u8]) -> Result<Backup, String> {
        if bytes.get(..4) != Some(BACKUP_MAGIC.as_slice()) {
            return Err("not a Gangway backup (bad magic)".into());
        }
        let word = |at: usize| bytes.get(at..at + 4).map(|w| u32::from_le_bytes(w.try_into().expect("4 bytes")));
        let version = word(4).ok_or("the backup is truncated")?;
        if version != BACKUP_VERSION {
            return Err(format!("backup version {version} is not supported (this build reads {BACKUP_VERSION})"));
        }
        let sum = word(8).ok_or("the backup is truncated")?;
        let body = &bytes[12..];
        if crc32c(body) != sum {
            return Err("the backup is damaged (checksum mismatch)".into());
        }
        let backup: Backup = decode(body).map_err(|e| format!("the backup does not decode: {e}"))?;
        let state = gangway_core::snapshot::decode(&backup.snapshot).map_err(|e| format!("the backup's state: {e}"))?;
        state.check_invariants().map_err(|e| format!("the backup's state breaks an invariant: {e}"))?;
        Ok(backup)
    }
}

/// What a restore started the new cluster with, for its report.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Restored {
    /// The new cluster's history ([`restored_history`]).
    pub history: u64,
    /// The first job id it issues.
    pub next_job_id: u64,
    /// Finished jobs in the backup that the accounting store had not
    /// confirmed when it was taken: they are in the restored state, and an
    /// accounting service stores them again when it meets the new history.
    pub unaccounted: usize,
}

/// The state a restore starts the new cluster with: the backup's, with job
/// ids moved past any the lost cluster may have issued, in a history of its
/// own ([`restored_history`]), and so in a data format that holds one
/// (every replica of the new cluster runs the build that restores it).
pub fn restored_state(backup: &Backup, mut state: gangway_core::state::State) -> gangway_core::state::State {
    state.next_job_id = state.next_job_id.saturating_add(RESTORE_JOB_ID_GAP);
    state.history = restored_history(backup, state.history);
    state.history_since = backup.index;
    state.format = state.format.max(gangway_core::format::FRESH_HISTORY_FORMAT);
    // Derived from the file, so every replica restored from it agrees; the
    // first leader draws one no other restore of the file can share.
    state.history_pending = true;
    state
}

/// The history a cluster restored from `backup` (taken in history
/// `previous`) counts its log in: after the backup's index, its entries are
/// not the lost cluster's, though their indexes are the same. Every replica
/// of the new cluster is restored from the same file, so the number is
/// derived from it (FNV-1a over the backup's index, taker, time and state's
/// checksum, and the history it was taken in), never 0 (the history a
/// cluster starts with). Restoring the same file twice would give the same
/// history, so it is only the history until the new cluster's first leader
/// draws one at random (`Command::DrawHistory`, `State::history_pending`).
pub fn restored_history(backup: &Backup, previous: u64) -> u64 {
    const FNV_OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const FNV_PRIME: u64 = 0x0000_0100_0000_01b3;
    let words = [previous, backup.index, backup.taken_by, backup.taken_at_ms, u64::from(crc32c(&backup.snapshot))];
    let hash = words
        .iter()
        .flat_map(|w| w.to_le_bytes())
        .fold(FNV_OFFSET, |h, byte| (h ^ u64::from(byte)).wrapping_mul(FNV_PRIME));
    hash.max(1)
}

/// Seeds an empty data directory `dir` with `backup`'s state, as a member of
/// a new cluster of `members` (id → address). Refuses a directory that holds
/// a store: a restore never overwrites data.
pub fn restore(dir: &Path, backup: &Backup, members: &BTreeMap<NodeId, String>) -> Result<Restored, StoreError> {
    let path = dir.display().to_string();
    let refuse = |reason: String| StoreError::Restore { path: path.clone(), reason };
    if dir.join("CURRENT").exists() {
        return Err(refuse("it already holds a store; restore into an empty data directory".into()));
    }
    if members.is_empty() {
        return Err(refuse("the new cluster needs at least one member (--peers)".into()));
    }
    let state = gangway_core::snapshot::decode(&backup.snapshot).map_err(|e| refuse(e.to_string()))?;
    let state = restored_state(backup, state);
    let restored = Restored {
        history: state.history,
        next_job_id: state.next_job_id,
        unaccounted: state
            .jobs
            .values()
            .filter(|j| state.accounted_index > 0 && j.finished_index.is_some_and(|i| i > state.accounted_index))
            .count(),
    };
    let snapshot = gangway_core::snapshot::encode(&state);
    // Seeded beside the data directory, then renamed into place: a restore
    // that fails half-way leaves no store behind that would start empty.
    let name = dir.file_name().map(|n| n.to_string_lossy().to_string()).unwrap_or_else(|| "data".into());
    let staging = dir.with_file_name(format!("{name}.restoring"));
    if staging.exists() {
        std::fs::remove_dir_all(&staging).map_err(|e| refuse(format!("removing {}: {e}", staging.display())))?;
    }
    std::fs::create_dir_all(&staging).map_err(|e| refuse(e.to_string()))?;
    let stores = crate::open(&staging)?;
    let db = stores.state_machine.db();
    // Term 0 from no leader: the new cluster's first leader (term 1) follows it.
    let log_id = LogId::new(CommittedLeaderId::new(0, 0), backup.index);
    let voters: BTreeSet<NodeId> = members.keys().copied().collect();
    let nodes: BTreeMap<NodeId, BasicNode> = members.iter().map(|(id, a)| (*id, BasicNode::new(a))).collect();
    let membership = Membership::new(vec![voters], nodes);
    let meta = SnapshotMeta {
        last_log_id: Some(log_id),
        last_membership: StoredMembership::new(Some(log_id), membership),
        snapshot_id: format!("restored-{}", backup.index),
    };
    let stored = crate::state_machine::StoredSnapshot { meta, data: snapshot };
    // One synced batch: the store holds all of the restore or none of it.
    let cf = |name: &str| db.cf_handle(name).expect("column family created at open");
    let mut batch = rocksdb::WriteBatch::default();
    batch.put_cf(cf(CF_SNAPSHOT), crate::state_machine::KEY_CURRENT, encode(&stored));
    batch.put_cf(cf(CF_META), crate::log_store::KEY_PURGED, encode(&log_id));
    batch.put_cf(cf(CF_META), crate::log_store::KEY_COMMITTED, encode(&Some(log_id)));
    let format = state.format.max(gangway_core::format::FORMAT_BASE);
    batch.put_cf(cf(CF_META), crate::db::FORMAT_KEY, format.to_le_bytes());
    let mut opts = rocksdb::WriteOptions::default();
    opts.set_sync(true);
    db.write_opt(batch, &opts).map_err(|e| refuse(e.to_string()))?;
    drop(db);
    drop(stores);
    // An empty data directory is replaced; one with anything in it is not.
    std::fs::rename(&staging, dir).map_err(|e| refuse(format!("moving the seeded store into place: {e}")))?;
    // The rename is durable only once the directory holding both names is
    // synced: a power cut right after would otherwise leave the empty data
    // directory (a replica that starts a cluster of its own) or the staging one.
    let parent = match dir.parent() {
        Some(p) if !p.as_os_str().is_empty() => p,
        _ => std::path::Path::new("."),
    };
    std::fs::File::open(parent)
        .and_then(|d| d.sync_all())
        .map_err(|e| refuse(format!("syncing {} after the restore: {e}", parent.display())))?;
    Ok(restored)
}

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::format::FRESH_HISTORY_FORMAT;
    use gangway_core::state::State;

    #[test]
    fn a_restored_cluster_counts_in_a_history_of_its_own() {
        let mut state = State::default();
        (state.format, state.next_job_id) = (13, 40);
        let snapshot = gangway_core::snapshot::encode(&state);
        let backup = Backup { index: 900, taken_by: 2, taken_at_ms: 1_700_000_000_000, snapshot };
        let restored = restored_state(&backup, state.clone());
        assert_eq!(restored.next_job_id, 40 + RESTORE_JOB_ID_GAP);
        assert_eq!(restored.format, FRESH_HISTORY_FORMAT, "raised to a format that holds a history to draw");
        assert!(restored.history_pending, "its first leader draws the history anew");
        assert_ne!(restored.history, 0, "0 is the history a cluster starts with");
        assert_eq!(restored.history_since, 900, "it begins after the backup's index");
        restored.check_invariants().unwrap();
        // Every replica restored from the file agrees.
        assert_eq!(restored_state(&backup, state.clone()).history, restored.history);
        // Another backup, or one taken later in the restored history: another history.
        let later = Backup { taken_at_ms: backup.taken_at_ms + 1, ..backup.clone() };
        assert_ne!(restored_state(&later, state.clone()).history, restored.history);
        assert_ne!(restored_state(&backup, restored.clone()).history, restored.history);
        // The snapshot the restore writes keeps it.
        let written = gangway_core::snapshot::encode(&restored);
        let read = gangway_core::snapshot::decode(&written).unwrap();
        assert_eq!((read.history, read.history_pending), (restored.history, true));
    }
}
