//! The Raft log and Raft metadata (vote, committed, purged) on RocksDB, with group
//! commit: appends write without syncing and hand their completion callback to the
//! [`GroupCommitter`] thread, which syncs the WAL once for every callback waiting
//! and only then acknowledges them to openraft.

use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc;
use std::sync::Arc;

use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{AnyError, Entry, LogId, OptionalSend, RaftLogReader, StorageError, StorageIOError, Vote};
use rocksdb::{Direction, IteratorMode, WriteBatch, WriteOptions, DB};

use crate::codec::{decode, encode, index_key, key_index};
use crate::db::{CF_LOG, CF_META};
use crate::{NodeId, TypeConfig};

/// Appends waiting for one fsync. openraft keeps a bounded number of appends in
/// flight, so this bound is never the limiter in practice; it stops a stuck disk
/// from queueing without end (senders then block, which is back-pressure).
const GROUP_COMMIT_QUEUE_MAX: usize = 8192;
/// Callbacks acknowledged by one fsync: large enough to amortise the sync under
/// load, small enough that one batch's acknowledgements go out promptly.
const GROUP_COMMIT_BATCH_MAX: usize = 4096;

/// How long dropping the last log store waits for the group-commit thread to
/// end (its last fsync): past this (a stuck disk) the thread is left to end
/// by itself rather than hang a shutdown.
const GROUP_COMMIT_CLOSE_WAIT: std::time::Duration = std::time::Duration::from_secs(5);

const KEY_VOTE: &[u8] = b"vote";
pub(crate) const KEY_COMMITTED: &[u8] = b"committed";
pub(crate) const KEY_PURGED: &[u8] = b"last_purged";

type Result<T> = std::result::Result<T, StorageError<NodeId>>;

/// The group-commit thread's way in, and word of its end. Dropped with the
/// last clone of the log store: the channel closes, the thread drains and
/// ends, and the drop waits for that (at most GROUP_COMMIT_CLOSE_WAIT), so
/// the thread's handle on the database is gone when the store is. A
/// database still closing in a detached thread as the process exits can
/// abort the process inside RocksDB's static destructors.
struct GroupCommit {
    tx: Option<mpsc::SyncSender<LogFlushed<TypeConfig>>>,
    /// Read only in `drop`, through `get_mut` (the mutex makes it `Sync`).
    ended: std::sync::Mutex<mpsc::Receiver<()>>,
}

impl Drop for GroupCommit {
    fn drop(&mut self) {
        drop(self.tx.take());
        // Err(Disconnected) is the thread's end too; Timeout a stuck disk.
        if let Ok(ended) = self.ended.get_mut() {
            let _ = ended.recv_timeout(GROUP_COMMIT_CLOSE_WAIT);
        }
    }
}

/// The log half of the store. Cheap to clone: openraft asks for readers.
#[derive(Clone)]
pub struct LogStore {
    /// Before `db`: fields drop in order, so the group-commit thread has
    /// ended (and let go of the database) before this handle goes, and a
    /// database this store holds last closes on the thread dropping it.
    committer: Arc<GroupCommit>,
    db: Arc<DB>,
    /// The highest committed index openraft reported (for status reporting; 0 = none).
    committed_index: Arc<AtomicU64>,
    /// The data format the store is stamped with (see `db.rs`).
    stamped: Arc<std::sync::atomic::AtomicU32>,
}

impl LogStore {
    pub(crate) fn new(db: Arc<DB>, stamped: u32) -> LogStore {
        let (tx, rx) = group_commit_queue();
        let (ended_tx, ended) = mpsc::sync_channel(1);
        let committer_db = db.clone();
        std::thread::Builder::new()
            .name("gangway-group-commit".into())
            .spawn(move || {
                group_commit_loop(&committer_db, &rx);
                // The database handle goes before the word that it has.
                drop(committer_db);
                let _ = ended_tx.send(());
            })
            .expect("spawning the group-commit thread");
        LogStore {
            committer: Arc::new(GroupCommit { tx: Some(tx), ended: std::sync::Mutex::new(ended) }),
            db,
            committed_index: Arc::new(AtomicU64::new(0)),
            stamped: Arc::new(std::sync::atomic::AtomicU32::new(stamped)),
        }
    }

    /// A live view of the committed index, for status reporting.
    pub fn committed_index(&self) -> Arc<AtomicU64> {
        self.committed_index.clone()
    }

    fn cf(&self, name: &str) -> &rocksdb::ColumnFamily {
        self.db.cf_handle(name).expect("column family created at open")
    }

    fn get_meta<T: serde::de::DeserializeOwned>(&self, key: &[u8]) -> Result<Option<T>> {
        let raw = self.db.get_cf(self.cf(CF_META), key).map_err(|e| StorageIOError::read(AnyError::new(&e)))?;
        raw.map(|bytes| decode(&bytes).map_err(|e| StorageIOError::read(AnyError::new(&e)).into())).transpose()
    }

    fn put_meta<T: serde::Serialize>(
        &self,
        key: &[u8],
        value: &T,
        sync: bool,
    ) -> std::result::Result<(), rocksdb::Error> {
        let mut opts = WriteOptions::default();
        opts.set_sync(sync);
        self.db.put_cf_opt(self.cf(CF_META), key, encode(value), &opts)
    }
}

/// The appends' way to the group-commit thread: GROUP_COMMIT_QUEUE_MAX wait
/// at most, then senders block.
fn group_commit_queue<T>() -> (mpsc::SyncSender<T>, mpsc::Receiver<T>) {
    mpsc::sync_channel(GROUP_COMMIT_QUEUE_MAX)
}

/// Adds to `batch` (which holds `first`'s) what waits in `rx`, up to
/// GROUP_COMMIT_BATCH_MAX in all; the rest waits for the next fsync.
fn fill_batch<T>(batch: &mut Vec<T>, rx: &mpsc::Receiver<T>) {
    while batch.len() < GROUP_COMMIT_BATCH_MAX {
        match rx.try_recv() {
            Ok(cb) => batch.push(cb),
            Err(_) => break,
        }
    }
}

/// Syncs the WAL once per batch of waiting appends, then acknowledges them all.
fn group_commit_loop(db: &DB, rx: &mpsc::Receiver<LogFlushed<TypeConfig>>) {
    let mut batch = Vec::with_capacity(64);
    // Ends when every LogStore handle is dropped (the replica shut down).
    while let Ok(first) = rx.recv() {
        batch.push(first);
        fill_batch(&mut batch, rx);
        metrics::histogram!("gangway_raft_group_commit_batch").record(batch.len() as f64);
        let started = std::time::Instant::now();
        let result = db.flush_wal(true);
        metrics::histogram!("gangway_raft_wal_fsync_seconds").record(started.elapsed().as_secs_f64());
        for cb in batch.drain(..) {
            let r = match &result {
                Ok(()) => Ok(()),
                Err(e) => Err(std::io::Error::other(e.to_string())),
            };
            cb.log_io_completed(r);
        }
    }
}

impl RaftLogReader<TypeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry<TypeConfig>>> {
        let start = match range.start_bound() {
            Bound::Included(&x) => x,
            Bound::Excluded(&x) => x + 1,
            Bound::Unbounded => 0,
        };
        let mut out = Vec::new();
        let iter = self.db.iterator_cf(self.cf(CF_LOG), IteratorMode::From(&index_key(start), Direction::Forward));
        for item in iter {
            let (key, value) = item.map_err(|e| StorageIOError::read_logs(AnyError::new(&e)))?;
            let index = key_index(&key);
            if !range.contains(&index) {
                break;
            }
            let entry: Entry<TypeConfig> =
                decode(&value).map_err(|e| StorageIOError::read_log_at_index(index, AnyError::new(&e)))?;
            assert_eq!(entry.log_id.index, index, "log entry stored under the wrong key");
            out.push(entry);
        }
        Ok(out)
    }
}

impl RaftLogStorage<TypeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>> {
        let last_purged_log_id: Option<LogId<NodeId>> = self.get_meta(KEY_PURGED)?;
        let last = match self.db.iterator_cf(self.cf(CF_LOG), IteratorMode::End).next() {
            None => None,
            Some(item) => {
                let (_, value) = item.map_err(|e| StorageIOError::read_logs(AnyError::new(&e)))?;
                let entry: Entry<TypeConfig> =
                    decode(&value).map_err(|e| StorageIOError::read_logs(AnyError::new(&e)))?;
                Some(entry.log_id)
            }
        };
        Ok(LogState { last_purged_log_id, last_log_id: last.or(last_purged_log_id) })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<()> {
        // A vote must survive a crash before it is acted on: synced write.
        self.put_meta(KEY_VOTE, vote, true).map_err(|e| StorageIOError::write_vote(AnyError::new(&e)))?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>> {
        self.get_meta(KEY_VOTE)
    }

    async fn save_committed(&mut self, committed: Option<LogId<NodeId>>) -> Result<()> {
        if let Some(c) = committed {
            self.committed_index.fetch_max(c.index, Ordering::Relaxed);
        }
        // Not synced: it only lets a restart re-apply sooner; losing it is safe.
        self.put_meta(KEY_COMMITTED, &committed, false).map_err(|e| StorageIOError::write(AnyError::new(&e)))?;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId<NodeId>>> {
        Ok(self.get_meta::<Option<LogId<NodeId>>>(KEY_COMMITTED)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<()>
    where
        I: IntoIterator<Item = Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut batch = WriteBatch::default();
        let cf = self.cf(CF_LOG);
        let mut newest = 0;
        for entry in entries {
            if let openraft::EntryPayload::Normal(p) = &entry.payload {
                newest = newest.max(p.format);
            }
            batch.put_cf(cf, index_key(entry.log_id.index), encode(&entry));
        }
        // An entry in a newer format raises the store's stamp in the same
        // batch: from the moment the store holds such an entry, an older build
        // refuses the store at open instead of failing on the entry.
        if newest > self.stamped.load(Ordering::Acquire) {
            batch.put_cf(self.cf(crate::db::CF_META), crate::db::FORMAT_KEY, newest.to_le_bytes());
            self.stamped.fetch_max(newest, Ordering::AcqRel);
        }
        let mut opts = WriteOptions::default();
        opts.set_sync(false);
        self.db.write_opt(batch, &opts).map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        // Acknowledged by the group-commit thread after the fsync that covers it.
        let sent = match &self.committer.tx {
            Some(tx) => tx.send(callback).map_err(|mpsc::SendError(cb)| cb),
            None => Err(callback),
        };
        if let Err(cb) = sent {
            cb.log_io_completed(Err(std::io::Error::other("group-commit thread is gone")));
        }
        Ok(())
    }

    async fn truncate(&mut self, log_id: LogId<NodeId>) -> Result<()> {
        self.db
            .delete_range_cf(self.cf(CF_LOG), index_key(log_id.index), index_key(u64::MAX))
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        Ok(())
    }

    async fn purge(&mut self, log_id: LogId<NodeId>) -> Result<()> {
        // Record the purge point first: a crash in between leaves extra entries,
        // never a gap that claims to exist.
        self.put_meta(KEY_PURGED, &log_id, true).map_err(|e| StorageIOError::write(AnyError::new(&e)))?;
        self.db
            .delete_range_cf(self.cf(CF_LOG), index_key(0), index_key(log_id.index + 1))
            .map_err(|e| StorageIOError::write_logs(AnyError::new(&e)))?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// GROUP_COMMIT_QUEUE_MAX appends wait for the group-commit thread; one
    /// more and its sender waits too (back-pressure).
    #[test]
    fn the_group_commit_queue_holds_its_max_and_refuses_one_more() {
        let (tx, rx) = group_commit_queue();
        for i in 0..GROUP_COMMIT_QUEUE_MAX {
            tx.try_send(i).unwrap();
        }
        assert_eq!(tx.try_send(GROUP_COMMIT_QUEUE_MAX), Err(mpsc::TrySendError::Full(GROUP_COMMIT_QUEUE_MAX)));
        drop(rx);
    }

    /// One fsync acknowledges GROUP_COMMIT_BATCH_MAX appends; one more
    /// waits for the next.
    #[test]
    fn one_fsync_takes_its_batch_max_and_leaves_one_more_for_the_next() {
        let (tx, rx) = group_commit_queue();
        for i in 0..=GROUP_COMMIT_BATCH_MAX {
            tx.try_send(i).unwrap();
        }
        let mut batch = vec![rx.recv().unwrap()];
        fill_batch(&mut batch, &rx);
        assert_eq!(batch, (0..GROUP_COMMIT_BATCH_MAX).collect::<Vec<_>>());
        let mut next = vec![rx.recv().unwrap()];
        fill_batch(&mut next, &rx);
        assert_eq!(next, vec![GROUP_COMMIT_BATCH_MAX]);
    }
}
