//! The state machine half of the store: [`gangway_core::State`] in memory, applied
//! from the log, snapshotted into RocksDB's `snapshot` column family.
//!
//! Restart = load the latest snapshot, then openraft re-applies the committed log
//! after it. The in-memory state is shared with the API ([`SharedState`]) behind a
//! read-write lock; job events go out on a broadcast channel for watchers.
//!
//! The leader's scheduler plans on its own copy of the state ([`StateCopy`]),
//! brought up to date before each pass by applying the commands applied here
//! since (Nomad's scheduler likewise works on a state snapshot). A pass over
//! hundreds of thousands of jobs then holds no lock: apply is never held up by
//! it, nor is every heartbeat queued behind a waiting apply.

use std::collections::VecDeque;
use std::io::Cursor;
use std::sync::{Arc, Mutex, RwLock, RwLockReadGuard};

use gangway_core::{snapshot, Command, Event, State};
use openraft::storage::{RaftStateMachine, Snapshot};
use openraft::{
    AnyError, BasicNode, EntryPayload, LogId, OptionalSend, RaftSnapshotBuilder, SnapshotMeta, StorageError,
    StorageIOError, StoredMembership,
};
use rocksdb::{WriteOptions, DB};
use serde::{Deserialize, Serialize};
use tokio::sync::broadcast;

use crate::codec::{decode, encode};
use crate::db::CF_SNAPSHOT;
use crate::{NodeId, Response, TypeConfig};

/// Job events buffered for watchers. A watcher further behind than this is told
/// it lagged (and its stream ends) instead of holding memory without bound.
pub const WATCH_EVENTS_BUFFER_MAX: usize = 16_384;
/// Events each replica keeps so a client can resume its stream after a
/// reconnect (to any replica: all number events by log index alike). About
/// 100 bytes each; older ones are dropped first.
pub const RECENT_EVENTS_MAX: usize = 100_000;

pub(crate) const KEY_CURRENT: &[u8] = b"current";

/// Commands a [`StateCopy`] may fall behind by before it is taken anew
/// instead. The leader refreshes its copy before every pass (at least once a
/// second); a batch of exits or submits counts as one command, so this is
/// minutes of a 10,000-node cluster's writes.
pub const COPY_TAIL_COMMANDS_MAX: usize = 65_536;
/// And the bytes they may hold (a submit may carry a script of megabytes):
/// past this the copy is taken anew rather than the record held.
pub const COPY_TAIL_BYTES_MAX: usize = 256 << 20;

/// The commands applied since a copy of the state was last brought up to date.
struct Tail {
    /// The copy this record is for: taking another copy starts another
    /// record, and a copy never takes a record that is not its own.
    generation: u64,
    /// The log index the copy reflects before these commands.
    from: u64,
    commands: VecDeque<(u64, Command)>,
    /// Their approximate size.
    bytes: usize,
    /// The log index the state reflects after them.
    applied: u64,
    /// Commands were dropped (a bound) or the state was replaced (a
    /// snapshot installed): the copy must be taken anew.
    broken: bool,
}

impl Tail {
    fn break_off(&mut self) {
        // A new deque: clearing would keep the old one's memory.
        self.commands = VecDeque::new();
        self.bytes = 0;
        self.broken = true;
    }
}

/// A private copy of the applied state, kept up to date by
/// [`SharedState::refresh`]: read it for as long as needed without holding
/// the state's lock.
pub struct StateCopy {
    state: State,
    index: u64,
    /// Times the whole state was cloned into it (1 when every refresh since
    /// the first was by commands).
    clones: u64,
    /// Its record's generation (0: nothing is recorded for it).
    generation: u64,
}

impl StateCopy {
    pub fn state(&self) -> &State {
        &self.state
    }

    /// The log index the copy reflects.
    pub fn index(&self) -> u64 {
        self.index
    }

    pub fn clones(&self) -> u64 {
        self.clones
    }
}

type Result<T> = std::result::Result<T, StorageError<NodeId>>;

#[derive(Serialize, Deserialize)]
pub(crate) struct StoredSnapshot {
    pub(crate) meta: SnapshotMeta<NodeId, BasicNode>,
    pub(crate) data: Vec<u8>,
}

/// The applied state, shared between the state machine (writer) and the API
/// (readers).
pub struct SharedState {
    state: RwLock<State>,
    /// The log index the state reflects: written with the state, under its
    /// write lock, so a reader holding the read lock sees both agree.
    applied: std::sync::atomic::AtomicU64,
    events: broadcast::Sender<Event>,
    /// The last RECENT_EVENTS_MAX events applied here, oldest first, and the
    /// log index through which events are not known here (a snapshot loaded or
    /// installed, or events dropped from the ring).
    recent: Mutex<(VecDeque<Event>, u64)>,
    /// Snapshots that replaced this replica's state while it ran: a stream
    /// of events open across one skipped what the snapshot covered.
    snapshots_installed: std::sync::atomic::AtomicU64,
    /// What a [`StateCopy`] has yet to apply; None when no copy is kept.
    /// Written under the state's write lock, so a copy taken under the read
    /// lock and the tail started with it always agree.
    tail: Mutex<Option<Tail>>,
    /// Copies taken so far (each record's generation).
    copies: std::sync::atomic::AtomicU64,
}

impl SharedState {
    /// A read view of the applied state. Hold it briefly: apply waits for it.
    pub fn read(&self) -> RwLockReadGuard<'_, State> {
        self.state.read().expect("state lock poisoned: a replica thread panicked")
    }

    /// A read view of the applied state and the log index it reflects.
    pub fn read_with_index(&self) -> (u64, RwLockReadGuard<'_, State>) {
        let state = self.read();
        (self.applied.load(std::sync::atomic::Ordering::Acquire), state)
    }

    /// The state as a snapshot (in the cluster's data format) and the log index
    /// it reflects, read together: a consistent backup.
    pub fn snapshot_with_index(&self) -> (u64, Vec<u8>) {
        // Copied under the lock, encoded after it: apply waits for the copy only.
        let (index, state) = {
            let state = self.read();
            (self.applied.load(std::sync::atomic::Ordering::Acquire), state.clone())
        };
        (index, snapshot::encode(&state))
    }

    /// A copy of the state, from which on every applied command is recorded
    /// for [`SharedState::refresh`]. One record at a time: taking another
    /// copy starts a new record, and the older copy is then taken anew at its
    /// next refresh. The clone is made under the read lock: apply (and the
    /// heartbeats behind it) wait for it once, when a replica starts leading.
    pub fn copy(&self) -> StateCopy {
        let (index, state) = self.read_with_index();
        let generation = self.copies.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        *self.tail.lock().expect("tail lock") =
            Some(Tail { generation, from: index, commands: VecDeque::new(), bytes: 0, applied: index, broken: false });
        StateCopy { state: state.clone(), index, clones: 1, generation }
    }

    /// Brings `copy` up to date: applies the commands applied here since, or
    /// takes it anew when its record is broken, is another copy's, or does not
    /// start where the copy is. The state lock is held only to take it anew.
    pub fn refresh(&self, copy: &mut StateCopy) {
        let (taken, recording) = {
            let mut tail = self.tail.lock().expect("tail lock");
            let recording = tail.is_some();
            let taken = match tail.as_mut() {
                Some(t) if t.generation == copy.generation && !t.broken && t.from == copy.index => {
                    let commands = std::mem::take(&mut t.commands);
                    t.bytes = 0;
                    t.from = t.applied;
                    Some((commands, t.applied))
                }
                _ => None,
            };
            (taken, recording)
        };
        match taken {
            Some((commands, applied)) => {
                for (index, cmd) in commands {
                    copy.state.apply(index, &cmd);
                }
                copy.index = applied;
            }
            None => {
                let clones = copy.clones + 1;
                // The old copy goes before the new one is made.
                copy.state = State::default();
                if recording {
                    *copy = self.copy();
                } else {
                    // Nobody keeps a record (this replica stopped leading):
                    // a copy for this once, and none is started.
                    let (index, state) = self.read_with_index();
                    *copy = StateCopy { state: state.clone(), index, clones, generation: 0 };
                }
                copy.clones = clones;
            }
        }
    }

    /// Stops recording commands for `copy` (its keeper stopped leading); a
    /// newer copy's record is left alone.
    pub fn end_copy(&self, copy: &StateCopy) {
        let mut tail = self.tail.lock().expect("tail lock");
        if tail.as_ref().is_some_and(|t| t.generation == copy.generation) {
            *tail = None;
        }
    }

    /// The state was replaced wholesale: a copy must be taken anew. Called
    /// under the state's write lock.
    fn break_copy(&self) {
        if let Some(t) = self.tail.lock().expect("tail lock").as_mut() {
            t.break_off();
        }
    }

    /// Records commands just applied, and the index the state now reflects.
    /// Called under the state's write lock.
    fn record_for_copy(&self, commands: Vec<(u64, Command)>, applied: u64) {
        let mut tail = self.tail.lock().expect("tail lock");
        let Some(t) = tail.as_mut() else { return };
        if t.broken {
            return;
        }
        let bytes = t.bytes.saturating_add(commands.iter().map(|(_, c)| c.approx_bytes()).sum());
        if t.commands.len() + commands.len() > COPY_TAIL_COMMANDS_MAX || bytes > COPY_TAIL_BYTES_MAX {
            t.break_off();
            return;
        }
        t.commands.extend(commands);
        t.bytes = bytes;
        t.applied = applied;
    }

    fn set_applied(&self, index: u64) {
        self.applied.store(index, std::sync::atomic::Ordering::Release);
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// Kept events with index >= `from`, or Err(the oldest index kept) when
    /// some of those are no longer kept here.
    pub fn events_since(&self, from: u64) -> std::result::Result<Vec<Event>, u64> {
        self.events_since_matching(from, |_| true)
    }

    /// [`Self::events_since`], only those `keep` takes (copied under the
    /// lock only when taken: one job's events out of the whole ring).
    pub fn events_since_matching(
        &self,
        from: u64,
        keep: impl Fn(&Event) -> bool,
    ) -> std::result::Result<Vec<Event>, u64> {
        let recent = self.recent.lock().expect("events lock");
        let (events, unknown_through) = (&recent.0, recent.1);
        if from <= unknown_through {
            return Err(unknown_through + 1);
        }
        Ok(events.iter().filter(|e| e.index() >= from && keep(e)).cloned().collect())
    }

    /// The oldest index [`Self::events_since`] can still answer from.
    pub fn oldest_event_index(&self) -> u64 {
        self.recent.lock().expect("events lock").1 + 1
    }

    /// Events through `index` are not known here (a snapshot replaced the state).
    fn forget_events_through(&self, index: u64) {
        let mut recent = self.recent.lock().expect("events lock");
        recent.0.clear();
        recent.1 = recent.1.max(index);
        self.snapshots_installed.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
    }

    /// How many times a snapshot replaced the state (see the field).
    pub fn snapshots_installed(&self) -> u64 {
        self.snapshots_installed.load(std::sync::atomic::Ordering::SeqCst)
    }
}

pub struct StateMachineStore {
    shared: Arc<SharedState>,
    last_applied: Option<LogId<NodeId>>,
    last_membership: StoredMembership<NodeId, BasicNode>,
    db: Arc<DB>,
    /// Makes snapshot ids unique within this process's life.
    snapshot_seq: u64,
    /// The data format the store is stamped with.
    stamped_format: u32,
}

impl StateMachineStore {
    /// Loads the latest snapshot from `db`, or starts empty.
    pub(crate) fn load(db: Arc<DB>, stamped_format: u32) -> std::result::Result<StateMachineStore, String> {
        let (events, _) = broadcast::channel(WATCH_EVENTS_BUFFER_MAX);
        let mut sm = StateMachineStore {
            shared: Arc::new(SharedState {
                state: RwLock::new(State::default()),
                applied: std::sync::atomic::AtomicU64::new(0),
                events,
                recent: Mutex::new((VecDeque::new(), 0)),
                snapshots_installed: std::sync::atomic::AtomicU64::new(0),
                tail: Mutex::new(None),
                copies: std::sync::atomic::AtomicU64::new(0),
            }),
            last_applied: None,
            last_membership: StoredMembership::default(),
            db,
            snapshot_seq: 0,
            stamped_format,
        };
        let cf = sm.db.cf_handle(CF_SNAPSHOT).expect("column family created at open");
        if let Some(raw) = sm.db.get_cf(cf, KEY_CURRENT).map_err(|e| e.to_string())? {
            let stored: StoredSnapshot = decode(&raw).map_err(|e| e.to_string())?;
            let state = snapshot::decode(&stored.data).map_err(|e| e.to_string())?;
            state.check_invariants().map_err(|e| format!("snapshot breaks an invariant: {e}"))?;
            *sm.shared.state.write().expect("fresh lock") = state;
            sm.shared.set_applied(stored.meta.last_log_id.map_or(0, |l| l.index));
            sm.last_applied = stored.meta.last_log_id;
            sm.last_membership = stored.meta.last_membership;
            sm.shared.forget_events_through(sm.last_applied.map_or(0, |l| l.index));
        }
        Ok(sm)
    }

    pub fn shared(&self) -> Arc<SharedState> {
        self.shared.clone()
    }

    pub(crate) fn db(&self) -> Arc<DB> {
        self.db.clone()
    }

    /// Raises the store's format stamp when the cluster's data format rose
    /// (so an older build refuses the store instead of misreading it). Until
    /// then an older build can still open it: a rolling upgrade can be rolled
    /// back until the cluster's format moves.
    fn stamp_format(&mut self) -> Result<()> {
        let format = self.shared.read().format;
        if format <= self.stamped_format {
            return Ok(());
        }
        crate::db::write_format(&self.db, format)
            .map_err(|e| StorageIOError::write_state_machine(AnyError::error(e.to_string())))?;
        tracing::info!(format, "the cluster moved to a newer data format; the store is stamped with it");
        self.stamped_format = format;
        Ok(())
    }

    fn store_snapshot(&self, stored: &StoredSnapshot) -> Result<()> {
        let cf = self.db.cf_handle(CF_SNAPSHOT).expect("column family created at open");
        let mut opts = WriteOptions::default();
        opts.set_sync(true);
        self.db
            .put_cf_opt(cf, KEY_CURRENT, encode(stored), &opts)
            .map_err(|e| StorageIOError::write_snapshot(Some(stored.meta.signature()), AnyError::new(&e)))?;
        Ok(())
    }
}

/// Builds one snapshot from a copy of the state taken on the state-machine task,
/// so encoding and writing happen off that task.
pub struct SnapshotBuilder {
    state: State,
    meta: SnapshotMeta<NodeId, BasicNode>,
    db: Arc<DB>,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>> {
        let data = snapshot::encode(&self.state);
        let stored = StoredSnapshot { meta: self.meta.clone(), data };
        let cf = self.db.cf_handle(CF_SNAPSHOT).expect("column family created at open");
        let mut opts = WriteOptions::default();
        opts.set_sync(true);
        self.db
            .put_cf_opt(cf, KEY_CURRENT, encode(&stored), &opts)
            .map_err(|e| StorageIOError::write_snapshot(Some(stored.meta.signature()), AnyError::new(&e)))?;
        Ok(Snapshot { meta: stored.meta, snapshot: Box::new(Cursor::new(stored.data)) })
    }
}

impl RaftStateMachine<TypeConfig> for StateMachineStore {
    type SnapshotBuilder = SnapshotBuilder;

    async fn applied_state(&mut self) -> Result<(Option<LogId<NodeId>>, StoredMembership<NodeId, BasicNode>)> {
        Ok((self.last_applied, self.last_membership.clone()))
    }

    async fn apply<I>(&mut self, entries: I) -> Result<Vec<Response>>
    where
        I: IntoIterator<Item = openraft::Entry<TypeConfig>> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let entries = entries.into_iter();
        let mut replies = Vec::with_capacity(entries.size_hint().0);
        let mut events = Vec::new();
        {
            let mut state = self.shared.state.write().expect("state lock poisoned");
            let recording = self.shared.tail.lock().expect("tail lock").is_some();
            let mut applied_commands = Vec::new();
            for entry in entries {
                if let EntryPayload::Normal(gangway_core::format::Payload { format, command: None, .. }) =
                    &entry.payload
                {
                    // Never guess at bytes from the future: stop here (Raft
                    // turns this into a fatal error; the replica says why and exits).
                    let why = format!(
                        "log entry {} is in data format {format}, newer than this build reads ({}..={}): \
                         run the newer build on this replica",
                        entry.log_id.index,
                        gangway_core::format::FORMAT_OLDEST,
                        gangway_core::format::FORMAT_NEWEST
                    );
                    tracing::error!("{why}");
                    // What was applied before it was not recorded.
                    self.shared.break_copy();
                    return Err(StorageIOError::apply(entry.log_id, AnyError::error(why)).into());
                }
                self.last_applied = Some(entry.log_id);
                self.shared.set_applied(entry.log_id.index);
                match entry.payload {
                    EntryPayload::Blank => replies.push(None),
                    EntryPayload::Normal(payload) => {
                        let cmd = payload.command.expect("unreadable entries stop above");
                        let applied = state.apply(entry.log_id.index, &cmd);
                        metrics::counter!("gangway_commands_applied_total", "command" => cmd.name()).increment(1);
                        state.events_of(entry.log_id.index, &applied, &mut events);
                        replies.push(Some(applied));
                        if recording {
                            applied_commands.push((entry.log_id.index, cmd));
                        }
                    }
                    EntryPayload::Membership(m) => {
                        self.last_membership = StoredMembership::new(Some(entry.log_id), m);
                        replies.push(None);
                    }
                }
            }
            if recording {
                self.shared.record_for_copy(applied_commands, self.last_applied.map_or(0, |l| l.index));
            }
        }
        self.stamp_format()?;
        if !events.is_empty() {
            let mut recent = self.shared.recent.lock().expect("events lock");
            for ev in &events {
                if recent.0.len() >= RECENT_EVENTS_MAX {
                    if let Some(dropped) = recent.0.pop_front() {
                        recent.1 = recent.1.max(dropped.index());
                    }
                }
                recent.0.push_back(ev.clone());
            }
            // Sent while the ring is locked, so a reader that subscribes and
            // then reads the ring misses nothing in between.
            for ev in events {
                // No receivers is fine: nobody is watching.
                let _ = self.shared.events.send(ev);
            }
        }
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.snapshot_seq += 1;
        let state = self.shared.read().clone();
        let snapshot_id = match self.last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id, l.index, self.snapshot_seq),
            None => format!("none-{}", self.snapshot_seq),
        };
        let meta =
            SnapshotMeta { last_log_id: self.last_applied, last_membership: self.last_membership.clone(), snapshot_id };
        SnapshotBuilder { state, meta, db: self.db.clone() }
    }

    async fn begin_receiving_snapshot(&mut self) -> Result<Box<Cursor<Vec<u8>>>> {
        Ok(Box::new(Cursor::new(Vec::new())))
    }

    async fn install_snapshot(
        &mut self,
        meta: &SnapshotMeta<NodeId, BasicNode>,
        snapshot: Box<Cursor<Vec<u8>>>,
    ) -> Result<()> {
        let data = snapshot.into_inner();
        let state = snapshot::decode(&data)
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), AnyError::error(e.to_string())))?;
        state
            .check_invariants()
            .map_err(|e| StorageIOError::read_snapshot(Some(meta.signature()), AnyError::error(e)))?;
        self.store_snapshot(&StoredSnapshot { meta: meta.clone(), data })?;
        {
            let mut guard = self.shared.state.write().expect("state lock poisoned");
            *guard = state;
            self.shared.set_applied(meta.last_log_id.map_or(0, |l| l.index));
            self.shared.break_copy();
        }
        self.last_applied = meta.last_log_id;
        self.last_membership = meta.last_membership.clone();
        self.shared.forget_events_through(self.last_applied.map_or(0, |l| l.index));
        self.stamp_format()?;
        Ok(())
    }

    async fn get_current_snapshot(&mut self) -> Result<Option<Snapshot<TypeConfig>>> {
        let cf = self.db.cf_handle(CF_SNAPSHOT).expect("column family created at open");
        let raw =
            self.db.get_cf(cf, KEY_CURRENT).map_err(|e| StorageIOError::read_snapshot(None, AnyError::new(&e)))?;
        let Some(raw) = raw else { return Ok(None) };
        let stored: StoredSnapshot =
            decode(&raw).map_err(|e| StorageIOError::read_snapshot(None, AnyError::new(&e)))?;
        Ok(Some(Snapshot { meta: stored.meta, snapshot: Box::new(Cursor::new(stored.data)) }))
    }
}
