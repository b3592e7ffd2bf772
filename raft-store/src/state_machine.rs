//! The state machine half of the store: [`gangway_core::State`] in memory, applied
//! from the log, snapshotted into RocksDB's `snapshot` column family.
//!
//! Restart = load the latest snapshot, then openraft re-applies the committed log
//! after it. Only apply touches the in-memory state; everyone else reads the
//! views it publishes ([`SharedState::read`], `views.rs`), so no reader ever
//! holds what apply needs. Job events go out on a broadcast channel for
//! watchers and are kept in a ring for streams that resume.
//!
//! The leader's scheduler plans on its own copy of the state ([`StateCopy`]),
//! brought up to date before each pass by applying the commands applied here
//! since (Nomad's scheduler likewise works on a state snapshot). A pass over
//! hundreds of thousands of jobs then holds no lock: apply is never held up by
//! it, nor is every heartbeat queued behind a waiting apply.

use std::collections::VecDeque;
use std::io::Cursor;
use std::sync::{Arc, Mutex, RwLock};

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
use crate::views::{Master, View, ViewStats, Views, FRESH_WAIT_MAX};
use crate::{NodeId, Response, TypeConfig};

/// Job events buffered for watchers. A watcher further behind than this is told
/// it lagged (and its stream ends) instead of holding memory without bound.
pub const WATCH_EVENTS_BUFFER_MAX: usize = 16_384;
/// Events each replica keeps so a client can resume its stream after a
/// reconnect (to any replica: all number events by log index alike). About
/// 100 bytes each; older ones are dropped first.
pub const RECENT_EVENTS_MAX: usize = 100_000;
/// Events a stream replays per page of the ring (each page charged to the
/// caller's read budget before the next is taken; the lock is held only to
/// take references to a page's batches).
pub const EVENTS_PAGE_MAX: usize = 1_024;

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
    commands: VecDeque<(u64, Arc<Command>)>,
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

    /// Records commands just applied, or breaks off past
    /// COPY_TAIL_COMMANDS_MAX commands or COPY_TAIL_BYTES_MAX bytes.
    fn record(&mut self, commands: Vec<(u64, Arc<Command>)>, applied: u64) {
        if self.broken {
            return;
        }
        let bytes = self.bytes.saturating_add(commands.iter().map(|(_, c)| c.approx_bytes()).sum());
        if self.commands.len() + commands.len() > COPY_TAIL_COMMANDS_MAX || bytes > COPY_TAIL_BYTES_MAX {
            self.break_off();
            return;
        }
        self.commands.extend(commands);
        self.bytes = bytes;
        self.applied = applied;
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
    #[serde(with = "gangway_core::format::raw_bytes")]
    pub(crate) data: Vec<u8>,
}

/// Events kept for streams that resume: the batches apply produced, oldest
/// first, shared (a stream takes references to them, never copies under the lock).
struct Recent {
    chunks: VecDeque<Arc<[Event]>>,
    /// Events in `chunks`.
    len: usize,
    /// Events through this log index are not known here (a snapshot loaded or
    /// installed, or events dropped from the ring).
    unknown_through: u64,
}

impl Recent {
    /// Keeps `chunk`, dropping the oldest batches while more than
    /// RECENT_EVENTS_MAX events are kept.
    fn push(&mut self, chunk: Arc<[Event]>) {
        self.len = self.len.saturating_add(chunk.len());
        self.chunks.push_back(chunk);
        while self.len > RECENT_EVENTS_MAX {
            let Some(dropped) = self.chunks.pop_front() else { break };
            self.len = self.len.saturating_sub(dropped.len());
            if let Some(last) = dropped.last() {
                self.unknown_through = self.unknown_through.max(last.index());
            }
        }
    }
}

/// The applied state, shared between the state machine (its only writer) and
/// everyone who reads it: the API, the leader's duties, telemetry.
pub struct SharedState {
    /// What apply applies to. Nothing outside this crate reads it: readers
    /// take a published view instead.
    master: Arc<Master>,
    views: Arc<Views>,
    events: broadcast::Sender<Event>,
    recent: Mutex<Recent>,
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

impl Drop for SharedState {
    fn drop(&mut self) {
        self.views.stop();
    }
}

/// A read that had to see everything applied so far found the published
/// view further behind than [`FRESH_WAIT_MAX`] allows.
#[derive(Debug, Clone, thiserror::Error)]
#[error("this replica's view of the state is {behind} entries behind what it applied; retry")]
pub struct ViewBehind {
    pub behind: u64,
}

impl SharedState {
    fn new(state: State, index: u64) -> SharedState {
        let (events, _) = broadcast::channel(WATCH_EVENTS_BUFFER_MAX);
        let first = View::new(state.clone(), index);
        let master = Arc::new(Master { state: RwLock::new(state), applied: std::sync::atomic::AtomicU64::new(index) });
        SharedState {
            views: Views::start(first, master.clone()),
            master,
            events,
            recent: Mutex::new(Recent { chunks: VecDeque::new(), len: 0, unknown_through: 0 }),
            snapshots_installed: std::sync::atomic::AtomicU64::new(0),
            tail: Mutex::new(None),
            copies: std::sync::atomic::AtomicU64::new(0),
        }
    }

    /// The newest published view of the applied state. It never waits for
    /// apply and apply never waits for it: hold it as long as the work needs.
    /// It may be a moment behind what was applied; a read that must include
    /// everything applied so far uses [`SharedState::read_fresh`].
    pub fn read(&self) -> Arc<View> {
        self.views.current()
    }

    /// A view that includes everything this replica had applied when called
    /// (a write just answered, a read after the leader confirmed its
    /// leadership): waits, without blocking a thread, for the maintainer.
    pub async fn read_fresh(&self) -> std::result::Result<Arc<View>, ViewBehind> {
        let target = self.master.applied();
        let view = self.read_fresh_within(FRESH_WAIT_MAX).await;
        match view.index() >= target {
            true => Ok(view),
            false => Err(ViewBehind { behind: target.saturating_sub(view.index()) }),
        }
    }

    /// [`SharedState::read_fresh`], waiting at most `wait`; then the newest
    /// view there is, however far behind.
    pub async fn read_fresh_within(&self, wait: std::time::Duration) -> Arc<View> {
        let target = self.master.applied();
        let view = self.read();
        if view.index() >= target {
            return view;
        }
        let mut rx = self.views.subscribe();
        let _ = tokio::time::timeout(wait, rx.wait_for(|i| *i >= target)).await;
        self.read()
    }

    /// A read view and the log index it reflects.
    pub fn read_with_index(&self) -> (u64, Arc<View>) {
        let view = self.read();
        (view.index(), view)
    }

    /// The log index apply has reached (the published view may be a moment behind).
    pub fn applied_index(&self) -> u64 {
        self.master.applied()
    }

    /// The views published so far, and how (telemetry, tests).
    pub fn view_stats(&self) -> ViewStats {
        self.views.stats()
    }

    /// The state as a snapshot (in the cluster's data format) and the log index
    /// it reflects, read together from one view: a consistent backup that
    /// holds nothing apply needs.
    pub fn snapshot_with_index(&self) -> (u64, Vec<u8>) {
        let view = self.read();
        (view.index(), snapshot::encode(view.state()))
    }

    /// The master state under its read lock, for the few clones this crate
    /// makes (a scheduler's copy taken anew). Apply waits while it is held.
    fn read_master(&self) -> (u64, std::sync::RwLockReadGuard<'_, State>) {
        let state = self.master.state.read().expect("state lock poisoned: a replica thread panicked");
        (self.master.applied(), state)
    }

    /// A copy of the state, from which on every applied command is recorded
    /// for [`SharedState::refresh`]. One record at a time: taking another
    /// copy starts a new record, and the older copy is then taken anew at its
    /// next refresh. The clone is made under the read lock: apply (and the
    /// heartbeats behind it) wait for it once, when a replica starts leading.
    pub fn copy(&self) -> StateCopy {
        let (index, state) = self.read_master();
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
                    let (index, state) = self.read_master();
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
    fn record_for_copy(&self, commands: Vec<(u64, Arc<Command>)>, applied: u64) {
        if let Some(t) = self.tail.lock().expect("tail lock").as_mut() {
            t.record(commands, applied);
        }
    }

    fn set_applied(&self, index: u64) {
        self.master.applied.store(index, std::sync::atomic::Ordering::Release);
    }

    pub fn subscribe(&self) -> broadcast::Receiver<Event> {
        self.events.subscribe()
    }

    /// Kept events with index >= `from`, in the batches apply made them in,
    /// at most `max` events' worth of batches (at least one batch), or
    /// Err(the oldest index kept) when some of those are no longer kept
    /// here. The lock is held to find them and take references, never to
    /// copy or filter them: a stream pages through the ring.
    pub fn events_page(&self, from: u64, max: usize) -> std::result::Result<Vec<Arc<[Event]>>, u64> {
        let recent = self.recent.lock().expect("events lock");
        if from <= recent.unknown_through {
            return Err(recent.unknown_through.saturating_add(1));
        }
        let first = recent.chunks.partition_point(|c| c.last().is_none_or(|e| e.index() < from));
        let mut out = Vec::new();
        let mut taken = 0usize;
        for chunk in recent.chunks.range(first..) {
            if !out.is_empty() && taken.saturating_add(chunk.len()) > max {
                break;
            }
            taken = taken.saturating_add(chunk.len());
            out.push(chunk.clone());
        }
        Ok(out)
    }

    /// The page of kept events a stream replays next, from `from`:
    /// [`EVENTS_PAGE_MAX`] events' worth of batches (see [`Self::events_page`]).
    pub fn replay_page(&self, from: u64) -> std::result::Result<Vec<Arc<[Event]>>, u64> {
        self.events_page(from, EVENTS_PAGE_MAX)
    }

    /// Every kept event with index >= `from` (tests and small callers; a
    /// stream pages with [`Self::replay_page`]).
    pub fn events_since(&self, from: u64) -> std::result::Result<Vec<Event>, u64> {
        let chunks = self.events_page(from, RECENT_EVENTS_MAX)?;
        Ok(chunks.iter().flat_map(|c| c.iter()).filter(|e| e.index() >= from).cloned().collect())
    }

    /// The oldest index [`Self::events_page`] can still answer from.
    pub fn oldest_event_index(&self) -> u64 {
        self.recent.lock().expect("events lock").unknown_through.saturating_add(1)
    }

    /// Events through `index` are not known here (a snapshot replaced the state).
    fn forget_events_through(&self, index: u64) {
        let mut recent = self.recent.lock().expect("events lock");
        recent.chunks.clear();
        recent.len = 0;
        recent.unknown_through = recent.unknown_through.max(index);
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
    /// Held while a snapshot is checked against the current one and written
    /// (see [`put_if_newer`]); shared with the builders.
    snapshot_write: Arc<std::sync::Mutex<()>>,
}

/// Writes `stored` as the current snapshot unless the one there is as new
/// or newer, and says whether it did. openraft builds a snapshot in a task
/// of its own: one built from the state at index X may finish after a
/// leader's snapshot at Y > X was installed, and must not replace it (the log
/// before Y is not here, and may be purged anyway: a restart from X could not
/// replay to Y). Check and write are one step under `lock`, held only for
/// them (a read and a write of the store; nothing waits on anything else).
fn put_if_newer(db: &DB, lock: &std::sync::Mutex<()>, stored: &StoredSnapshot) -> Result<bool> {
    let _one_at_a_time = lock.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
    let cf = db.cf_handle(CF_SNAPSHOT).expect("column family created at open");
    let signature = || Some(stored.meta.signature());
    if let Some(raw) =
        db.get_cf(cf, KEY_CURRENT).map_err(|e| StorageIOError::read_snapshot(signature(), AnyError::new(&e)))?
    {
        let current: StoredSnapshot =
            decode(&raw).map_err(|e| StorageIOError::read_snapshot(signature(), AnyError::new(&e)))?;
        if current.meta.last_log_id >= stored.meta.last_log_id && current.meta.snapshot_id != stored.meta.snapshot_id {
            return Ok(false);
        }
    }
    let mut opts = WriteOptions::default();
    opts.set_sync(true);
    db.put_cf_opt(cf, KEY_CURRENT, encode(stored), &opts)
        .map_err(|e| StorageIOError::write_snapshot(signature(), AnyError::new(&e)))?;
    Ok(true)
}

impl StateMachineStore {
    /// Loads the latest snapshot from `db`, or starts empty.
    pub(crate) fn load(db: Arc<DB>, stamped_format: u32) -> std::result::Result<StateMachineStore, String> {
        let cf = db.cf_handle(CF_SNAPSHOT).expect("column family created at open");
        let mut loaded = None;
        if let Some(raw) = db.get_cf(cf, KEY_CURRENT).map_err(|e| e.to_string())? {
            let stored: StoredSnapshot = decode(&raw).map_err(|e| e.to_string())?;
            let state = snapshot::decode(&stored.data).map_err(|e| e.to_string())?;
            state.check_invariants().map_err(|e| format!("snapshot breaks an invariant: {e}"))?;
            loaded = Some((state, stored.meta));
        }
        let index = loaded.as_ref().and_then(|(_, m)| m.last_log_id).map_or(0, |l| l.index);
        let (state, meta) = match loaded {
            Some((state, meta)) => (state, Some(meta)),
            None => (State::default(), None),
        };
        let shared = Arc::new(SharedState::new(state, index));
        let mut sm = StateMachineStore {
            shared,
            last_applied: None,
            last_membership: StoredMembership::default(),
            db,
            snapshot_seq: 0,
            stamped_format,
            snapshot_write: Default::default(),
        };
        if let Some(meta) = meta {
            sm.last_applied = meta.last_log_id;
            sm.last_membership = meta.last_membership;
            sm.shared.forget_events_through(index);
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
        let format = self.shared.read_master().1.format;
        if format <= self.stamped_format {
            return Ok(());
        }
        crate::db::write_format(&self.db, format)
            .map_err(|e| StorageIOError::write_state_machine(AnyError::error(e.to_string())))?;
        tracing::info!(format, "the cluster moved to a newer data format; the store is stamped with it");
        self.stamped_format = format;
        Ok(())
    }
}

/// Builds one snapshot from a copy of the state taken on the state-machine task,
/// so encoding and writing happen off that task.
pub struct SnapshotBuilder {
    state: State,
    meta: SnapshotMeta<NodeId, BasicNode>,
    db: Arc<DB>,
    snapshot_write: Arc<std::sync::Mutex<()>>,
}

impl RaftSnapshotBuilder<TypeConfig> for SnapshotBuilder {
    async fn build_snapshot(&mut self) -> Result<Snapshot<TypeConfig>> {
        let data = snapshot::encode(&self.state);
        let stored = StoredSnapshot { meta: self.meta.clone(), data };
        if !put_if_newer(&self.db, &self.snapshot_write, &stored)? {
            // openraft keeps the newer one too (it ignores an older snapshot).
            tracing::info!(
                snapshot = %stored.meta.snapshot_id,
                "a newer snapshot was installed while this one was built: the newer one stays current"
            );
        }
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
            let mut state = self.shared.master.state.write().expect("state lock poisoned");
            let recording = self.shared.tail.lock().expect("tail lock").is_some();
            let mut applied_commands = Vec::new();
            let mut for_views = Vec::new();
            for entry in entries {
                if let EntryPayload::Normal(gangway_core::payload::Payload { format, command: None, .. }) =
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
                        let cmd = Arc::new(payload.command.expect("unreadable entries stop above"));
                        let applied = state.apply(entry.log_id.index, &cmd);
                        metrics::counter!("gangway_commands_applied_total", "command" => cmd.name()).increment(1);
                        state.events_of(entry.log_id.index, &applied, &mut events);
                        replies.push(Some(applied));
                        if recording {
                            applied_commands.push((entry.log_id.index, cmd.clone()));
                        }
                        for_views.push((entry.log_id.index, cmd));
                    }
                    EntryPayload::Membership(m) => {
                        self.last_membership = StoredMembership::new(Some(entry.log_id), m);
                        replies.push(None);
                    }
                }
            }
            let applied_index = self.last_applied.map_or(0, |l| l.index);
            if recording {
                self.shared.record_for_copy(applied_commands, applied_index);
            }
            self.shared.views.push(for_views, applied_index);
        }
        self.stamp_format()?;
        if !events.is_empty() {
            let mut recent = self.shared.recent.lock().expect("events lock");
            let chunk: Arc<[Event]> = events.into();
            recent.push(chunk.clone());
            // Sent while the ring is locked, so a reader that subscribes and
            // then reads the ring misses nothing in between.
            for ev in chunk.iter() {
                // No receivers is fine: nobody is watching.
                let _ = self.shared.events.send(ev.clone());
            }
        }
        Ok(replies)
    }

    async fn get_snapshot_builder(&mut self) -> Self::SnapshotBuilder {
        self.snapshot_seq += 1;
        let state = self.shared.read_master().1.clone();
        let snapshot_id = match self.last_applied {
            Some(l) => format!("{}-{}-{}", l.leader_id, l.index, self.snapshot_seq),
            None => format!("none-{}", self.snapshot_seq),
        };
        let meta =
            SnapshotMeta { last_log_id: self.last_applied, last_membership: self.last_membership.clone(), snapshot_id };
        SnapshotBuilder { state, meta, db: self.db.clone(), snapshot_write: self.snapshot_write.clone() }
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
        // openraft installs only a snapshot newer than what it has applied,
        // so this one is newer than any built here: it is written (unless
        // the very same one is there), and a build still running cannot
        // replace it afterwards.
        if !put_if_newer(&self.db, &self.snapshot_write, &StoredSnapshot { meta: meta.clone(), data })? {
            tracing::warn!(snapshot = %meta.snapshot_id, "an installed snapshot is not newer than the stored one");
        }
        {
            let mut guard = self.shared.master.state.write().expect("state lock poisoned");
            *guard = state;
            let index = meta.last_log_id.map_or(0, |l| l.index);
            self.shared.set_applied(index);
            self.shared.break_copy();
            self.shared.views.rebuild(index);
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

#[cfg(test)]
mod tests {
    use super::*;
    use gangway_core::NodeChange;

    fn event(index: u64) -> Event {
        Event::Node { index, node: String::new(), change: NodeChange::Registered, reason: String::new() }
    }

    /// Events of `indexes`, one batch.
    fn chunk(indexes: std::ops::RangeInclusive<u64>) -> Arc<[Event]> {
        indexes.map(event).collect()
    }

    /// A watcher may fall WATCH_EVENTS_BUFFER_MAX events behind and still
    /// read every one; one more and it is told it lagged.
    #[test]
    fn a_watcher_keeps_up_within_the_buffer_and_lags_one_past_it() {
        let shared = SharedState::new(State::default(), 0);
        let mut watcher = shared.subscribe();
        for i in 1..=WATCH_EVENTS_BUFFER_MAX as u64 {
            shared.events.send(event(i)).unwrap();
        }
        for i in 1..=WATCH_EVENTS_BUFFER_MAX as u64 {
            assert_eq!(watcher.try_recv().map(|e| e.index()), Ok(i));
        }
        for i in 1..=WATCH_EVENTS_BUFFER_MAX as u64 + 1 {
            shared.events.send(event(i)).unwrap();
        }
        assert_eq!(watcher.try_recv(), Err(broadcast::error::TryRecvError::Lagged(1)));
    }

    /// A read that must be fresh waits FRESH_WAIT_MAX for the view that
    /// covers what was applied: a view published within it is read; with
    /// none by then the read is refused, naming how far behind it is.
    #[tokio::test]
    async fn a_fresh_read_waits_fresh_wait_max_for_its_view() {
        let shared = Arc::new(SharedState::new(State::default(), 0));
        // Applied through 1, and the maintainer not told: no view covers it.
        shared.master.applied.store(1, std::sync::atomic::Ordering::Release);
        let started = std::time::Instant::now();
        let behind = shared.read_fresh().await.err().map(|e| e.behind);
        assert_eq!(behind, Some(1));
        assert!(started.elapsed() >= FRESH_WAIT_MAX, "refused before FRESH_WAIT_MAX: {:?}", started.elapsed());
        // Told a moment later, well within the wait: the read gets it.
        shared.master.applied.store(2, std::sync::atomic::Ordering::Release);
        let teller = shared.clone();
        let tell = std::thread::spawn(move || {
            std::thread::sleep(std::time::Duration::from_millis(50));
            teller.views.push(Vec::new(), 2);
        });
        assert_eq!(shared.read_fresh().await.map(|v| v.index()).ok(), Some(2));
        tell.join().unwrap();
    }

    /// A replayed page holds EVENTS_PAGE_MAX events' worth of batches; the
    /// batch one past waits for the next page. A batch bigger than a page
    /// is still answered, alone.
    #[test]
    fn a_replay_page_holds_events_page_max_events() {
        let shared = SharedState::new(State::default(), 0);
        let max = EVENTS_PAGE_MAX as u64;
        for i in 1..=max + 1 {
            shared.recent.lock().unwrap().push(chunk(i..=i));
        }
        let count = |page: Vec<Arc<[Event]>>| page.iter().map(|c| c.len()).sum::<usize>();
        assert_eq!(count(shared.replay_page(1).unwrap()), EVENTS_PAGE_MAX);
        assert_eq!(count(shared.replay_page(max + 1).unwrap()), 1, "the one past, on the next page");
        shared.recent.lock().unwrap().push(chunk(max + 2..=3 * max));
        assert_eq!(count(shared.replay_page(max + 2).unwrap()), 2 * EVENTS_PAGE_MAX - 1);
    }

    /// The ring keeps RECENT_EVENTS_MAX events for streams that resume; one
    /// more and the oldest batch goes, its events then unknown here.
    #[test]
    fn recent_events_keep_their_max_and_drop_the_oldest_batch_one_past_it() {
        let mut recent = Recent { chunks: VecDeque::new(), len: 0, unknown_through: 0 };
        let max = RECENT_EVENTS_MAX as u64;
        recent.push(chunk(1..=10));
        recent.push(chunk(11..=max));
        assert_eq!((recent.len, recent.chunks.len(), recent.unknown_through), (RECENT_EVENTS_MAX, 2, 0));
        recent.push(chunk(max + 1..=max + 1));
        assert_eq!((recent.len, recent.chunks.len(), recent.unknown_through), (RECENT_EVENTS_MAX - 9, 2, 10));
    }

    /// A copy's record holds commands of COPY_TAIL_BYTES_MAX bytes; a byte
    /// more and it breaks off (the copy is then taken anew).
    #[test]
    fn a_copys_record_holds_its_bytes_max_and_breaks_off_one_past_it() {
        let cmd = Arc::new(Command::DrawHistory { history: 1, now_ms: 0 });
        let size = cmd.approx_bytes();
        let tail = |bytes| Tail { generation: 1, from: 0, commands: VecDeque::new(), bytes, applied: 0, broken: false };
        let mut t = tail(COPY_TAIL_BYTES_MAX - size);
        t.record(vec![(1, cmd.clone())], 1);
        assert_eq!((t.commands.len(), t.bytes, t.applied, t.broken), (1, COPY_TAIL_BYTES_MAX, 1, false));
        let mut t = tail(COPY_TAIL_BYTES_MAX + 1 - size);
        t.record(vec![(1, cmd.clone())], 1);
        assert_eq!((t.commands.len(), t.bytes, t.applied, t.broken), (0, 0, 0, true));
        t.record(vec![(2, cmd)], 2);
        assert_eq!((t.commands.len(), t.broken), (0, true), "a broken record stays broken");
    }
}
