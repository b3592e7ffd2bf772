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
    // A dropped store has closed its database: it reopens at once.
    if let Err(e) = open(fresh.path()) {
        panic!("a store must reopen in its own format: {e}");
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

/// Copies a checked-in fixture store (`format4`, `format5`) into a fresh directory.
fn fixture(name: &str) -> tempfile::TempDir {
    // The runner's directory, not the compile-time one: a shared target
    // directory may hold a binary built in another checkout.
    let manifest = std::env::var_os("CARGO_MANIFEST_DIR").unwrap_or_else(|| env!("CARGO_MANIFEST_DIR").into());
    let src = std::path::Path::new(&manifest).join("tests/fixtures").join(name);
    let dir = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(&src).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dir.path().join(e.file_name())).unwrap();
    }
    dir
}

/// Opens a store (waiting for a closed one's lock) and replays its log after
/// the snapshot, as Raft does at start.
async fn open_and_replay(dir: &std::path::Path) -> (gangway_raft_store::Stores, gangway_core::State) {
    use openraft::storage::{RaftLogStorage, RaftStateMachine};
    use openraft::RaftLogReader;
    // A dropped store has closed its database: it opens at once.
    let mut stores = open(dir).unwrap_or_else(|e| panic!("the store does not open: {e}"));
    let (applied, _) = stores.state_machine.applied_state().await.unwrap();
    let from = applied.map_or(0, |l| l.index + 1);
    let mut reader = stores.log.get_log_reader().await;
    let entries = reader.try_get_log_entries(from..).await.unwrap();
    stores.state_machine.apply(entries).await.unwrap();
    let state = stores.state_machine.shared().read_fresh().await.unwrap().state().clone();
    (stores, state)
}

/// The store written by the last build of data format 4 (a one-replica
/// cluster: a policy import, two agents, ten jobs — completed, running,
/// failed, cancelled, held, an array waiting on a dependency — a drained node;
/// a snapshot at index 6 and log entries after it) opens in this build, reads
/// the same, and migrates in place to format 5.
#[tokio::test]
async fn a_format4_store_opens_replays_and_migrates_to_format5() {
    use gangway_core::payload::Payload;
    use gangway_core::{Command, JobState, NodeState};
    use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
    let dir = fixture("format4");
    let (mut stores, s) = open_and_replay(dir.path()).await;
    assert_eq!(s.format, 4);
    assert_eq!(s.jobs.len(), 10, "{:?}", s.jobs.keys().collect::<Vec<_>>());
    assert_eq!(s.policy.admins, vec!["fixture".to_string()]);
    assert!(s.policy.partitions.contains_key("gpu"));
    assert_eq!(s.jobs[&1].state, JobState::Completed);
    assert_eq!(s.jobs[&2].state, JobState::Running);
    assert_eq!(s.jobs[&2].allocation.as_ref().unwrap().nodes[0].node, "dev-node-1");
    assert_eq!(s.jobs[&2].allocation.as_ref().unwrap().nodes[0].gpus.len(), 2);
    assert_eq!(s.jobs[&3].spec.exclude, vec!["node-b".to_string()]);
    assert_eq!(s.jobs[&3].spec.comment, "fixture array");
    assert!((3..=6).all(|id| s.jobs[&id].array.is_some() && s.jobs[&id].state == JobState::Pending));
    assert_eq!(s.jobs[&7].held, Some(gangway_core::model::HoldKind::User));
    assert_eq!(s.jobs[&8].state, JobState::Cancelled);
    assert_eq!((s.jobs[&9].state, s.jobs[&9].exit_code), (JobState::Failed, Some(3)));
    assert_eq!(s.jobs[&10].state, JobState::Completed);
    assert_eq!(s.nodes["node-a"].state, NodeState::Drain);
    assert_eq!(s.nodes["node-a"].state_reason, "fixture drain");
    s.check_invariants().unwrap();
    // The cluster moves to format 5: the next entry, the store's stamp and
    // snapshots are format 5 from then on.
    let next = openraft::Entry::<gangway_raft_store::TypeConfig> {
        log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), 1_000),
        payload: openraft::EntryPayload::Normal(Payload::new(Command::SetDataFormat { format: 5, now_ms: 1 }, 4)),
    };
    stores.state_machine.apply([next]).await.unwrap();
    let snap = stores.state_machine.get_snapshot_builder().await.build_snapshot().await.unwrap();
    assert_eq!(&snap.snapshot.get_ref()[4..8], &5u32.to_le_bytes(), "the snapshot is not format 5");
    let migrated = stores.state_machine.shared().read_fresh().await.unwrap().state().clone();
    assert_eq!(migrated.format, 5);
    drop(stores);
    // Reopened, it reads format 5 and holds the same state.
    let (_stores, again) = open_and_replay(dir.path()).await;
    assert_eq!(again, migrated);
}

/// The store written by the last build of data format 5 (a one-replica dev
/// cluster: a policy import, two agents, ten jobs — completed, running,
/// failed, held, waiting to begin, an array waiting on a dependency with one
/// element cancelled — a drained node; a snapshot at index 20 and log entries
/// after it) opens in this build, reads the same, and migrates in place to
/// format 6, after which the policy takes roles and job switches.
#[tokio::test]
async fn a_format5_store_opens_replays_and_migrates_to_format6() {
    use gangway_core::payload::Payload;
    use gangway_core::{Command, JobState, NodeState, Outcome};
    use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
    let dir = fixture("format5");
    let (mut stores, s) = open_and_replay(dir.path()).await;
    assert_eq!(s.format, 5);
    assert_eq!(s.jobs.len(), 10, "{:?}", s.jobs.keys().collect::<Vec<_>>());
    assert_eq!(s.policy.admins, vec!["root".to_string()]);
    assert_eq!(s.policy.accounts["ml"].shares, 2);
    assert!(s.policy.partitions["gpu"].default);
    assert_eq!(s.policy.qos["high"].priority, 10);
    assert!(s.policy.operators.is_empty() && !s.policy.private_jobs, "format 5 has no roles");
    assert_eq!(s.jobs[&1].state, JobState::Completed);
    assert_eq!(s.jobs[&2].state, JobState::Running);
    assert_eq!(s.jobs[&2].allocation.as_ref().unwrap().nodes[0].gpus.len(), 2);
    assert_eq!((s.jobs[&3].state, s.jobs[&3].exit_code), (JobState::Failed, Some(3)));
    assert_eq!(s.jobs[&4].held, Some(gangway_core::model::HoldKind::User));
    assert!(s.jobs[&5].spec.begin_ms > 0);
    assert_eq!(s.jobs[&6].spec.comment, "fixture array");
    assert!((6..=8).all(|id| s.jobs[&id].array.is_some()));
    assert_eq!(s.jobs[&7].state, JobState::Cancelled);
    assert_eq!(s.jobs[&10].spec.name, "after-snap");
    assert_eq!(s.jobs[&10].state, JobState::Completed);
    assert_eq!(s.nodes["dev-node-2"].state, NodeState::Drain);
    assert_eq!(s.nodes["dev-node-2"].state_reason, "fixture drain");
    s.check_invariants().unwrap();
    // The cluster moves to format 6; the policy then takes format 6's fields.
    let mut roles = s.policy.clone();
    roles.operators = vec!["oscar".into()];
    roles.private_jobs = true;
    let entries = [
        Command::SetDataFormat { format: 6, now_ms: 1 },
        Command::UpdatePolicy {
            policy: roles,
            expected_version: None,
            force: false,
            identity: "server:1".into(),
            now_ms: 2,
        },
    ]
    .into_iter()
    .enumerate()
    .map(|(i, cmd)| openraft::Entry::<gangway_raft_store::TypeConfig> {
        log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), 1_000 + i as u64),
        payload: openraft::EntryPayload::Normal(Payload::new(cmd, 6)),
    });
    let replies = stores.state_machine.apply(entries).await.unwrap();
    let outcome = replies[1].as_ref().map(|a| a.outcome.clone());
    assert!(matches!(outcome, Some(Outcome::PolicyUpdated { .. })), "{outcome:?}");
    let snap = stores.state_machine.get_snapshot_builder().await.build_snapshot().await.unwrap();
    assert_eq!(&snap.snapshot.get_ref()[4..8], &6u32.to_le_bytes(), "the snapshot is not format 6");
    let migrated = stores.state_machine.shared().read_fresh().await.unwrap().state().clone();
    assert_eq!(migrated.format, 6);
    assert!(migrated.policy.private_jobs && migrated.policy.operators == vec!["oscar".to_string()]);
    drop(stores);
    let (_stores, again) = open_and_replay(dir.path()).await;
    assert_eq!(again, migrated);
}

/// An entry of a format this build does not read stops the state machine
/// with an error naming the formats, instead of being misread.
#[tokio::test]
async fn an_entry_from_a_newer_format_stops_apply_with_a_clear_error() {
    use gangway_core::payload::Payload;
    use openraft::storage::RaftStateMachine;
    let dir = tempfile::tempdir().unwrap();
    let mut stores = open(dir.path()).unwrap();
    // One past the newest this build reads, whatever that is now.
    let newer = gangway_core::format::FORMAT_NEWEST + 1;
    let entry = openraft::Entry::<gangway_raft_store::TypeConfig> {
        log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), 1),
        payload: openraft::EntryPayload::Normal(Payload { format: newer, command: None, unread: vec![7] }),
    };
    let err = stores.state_machine.apply([entry]).await.unwrap_err().to_string();
    assert!(err.contains(&format!("data format {newer}")) && err.contains("newer build"), "{err}");
    assert_eq!(stores.state_machine.shared().read().format, 4, "nothing was applied");
}

/// The store's format stamp rises with the first entry of a newer format in
/// the same write as the entry, so from then on a build that reads only the
/// older format refuses the store at open (and a rollback before it opens).
#[tokio::test]
async fn an_entry_of_a_newer_format_stamps_the_store_as_it_is_written() {
    use gangway_core::payload::Payload;
    use gangway_core::Command;
    use openraft::storage::RaftLogStorageExt;
    let dir = tempfile::tempdir().unwrap();
    let stamp = |dir: &std::path::Path| {
        let db =
            rocksdb::DB::open_cf_for_read_only(&rocksdb::Options::default(), dir, ["log", "meta", "snapshot"], false)
                .unwrap();
        let raw = db.get_cf(db.cf_handle("meta").unwrap(), b"data_format").unwrap().unwrap();
        u32::from_le_bytes(raw[..4].try_into().unwrap())
    };
    let mut stores = open(dir.path()).unwrap();
    let entry = |index, format| openraft::Entry::<gangway_raft_store::TypeConfig> {
        log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
        payload: openraft::EntryPayload::Normal(Payload::new(
            Command::CancelJob { job_id: 1, identity: "a".into(), now_ms: 1 },
            format,
        )),
    };
    stores.log.blocking_append([entry(1, 4)]).await.unwrap();
    assert_eq!(stamp(dir.path()), 4);
    stores.log.blocking_append([entry(2, 5)]).await.unwrap();
    assert_eq!(stamp(dir.path()), 5);
}

/// A normal log entry at `index` carrying `cmd` in `format`.
fn normal_entry(index: u64, cmd: gangway_core::Command, format: u32) -> openraft::Entry<TypeConfig> {
    openraft::Entry::<TypeConfig> {
        log_id: openraft::LogId::new(openraft::CommittedLeaderId::new(1, 1), index),
        payload: openraft::EntryPayload::Normal(gangway_core::payload::Payload::new(cmd, format)),
    }
}

/// A submit of job `i` by alice, as the API would propose it.
fn submit(i: u64) -> gangway_core::Command {
    gangway_core::Command::SubmitJob {
        spec: gangway_core::spec::JobSpec {
            name: format!("j{i}"),
            command: vec!["true".into()],
            user: "alice".into(),
            ..Default::default()
        },
        identity: "client:alice".into(),
        idempotency_key: String::new(),
        now_ms: i,
    }
}

/// The leader's scheduler plans on a copy of the state that follows every
/// applied command without holding the state's lock: after any mix of
/// applies it equals the state; past the bound on recorded commands, or once
/// nobody keeps a copy, it is taken anew rather than left behind.
#[tokio::test]
async fn the_schedulers_copy_follows_every_applied_command() {
    use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
    use openraft::{CommittedLeaderId, EntryPayload, LogId};
    let dir = tempfile::tempdir().unwrap();
    let mut stores = open(dir.path()).unwrap();
    let shared = stores.state_machine.shared();
    let format = shared.read().format;
    let normal = |index: u64, cmd| normal_entry(index, cmd, format);
    let blank = |index: u64| openraft::Entry::<TypeConfig> {
        log_id: LogId::new(CommittedLeaderId::new(1, 1), index),
        payload: EntryPayload::Blank,
    };
    stores.state_machine.apply((1..=3).map(|i| normal(i, submit(i)))).await.unwrap();
    let mut copy = shared.copy();
    assert_eq!((copy.index(), copy.state()), (3, shared.read_fresh().await.unwrap().state()));
    stores.state_machine.apply((4..=10).map(|i| normal(i, submit(i)))).await.unwrap();
    stores.state_machine.apply([blank(11)]).await.unwrap();
    assert_eq!(copy.state().jobs.len(), 3, "the copy is the caller's until it refreshes");
    shared.refresh(&mut copy);
    assert_eq!(copy.state().jobs.len(), 10);
    assert_eq!((copy.index(), copy.state(), copy.clones()), (11, shared.read_fresh().await.unwrap().state(), 1));
    // More commands than are kept: the next refresh takes the state anew.
    let over = gangway_raft_store::COPY_TAIL_COMMANDS_MAX as u64 + 1;
    let mut next = 12;
    while next < 12 + over {
        let end = (next + 4096).min(12 + over);
        stores.state_machine.apply((next..end).map(|i| normal(i, submit(i)))).await.unwrap();
        next = end;
    }
    shared.refresh(&mut copy);
    assert_eq!((copy.index(), copy.state(), copy.clones()), (next - 1, shared.read_fresh().await.unwrap().state(), 2));
    // A second copy starts its own record. The first never takes a record
    // that is not its own (it would miss what the other copy already took):
    // it is taken anew, and the two take turns that way without either
    // missing a command.
    let mut second = shared.copy();
    stores.state_machine.apply([normal(next, submit(next))]).await.unwrap();
    shared.refresh(&mut copy);
    assert_eq!((copy.index(), copy.state(), copy.clones()), (next, shared.read_fresh().await.unwrap().state(), 3));
    next += 1;
    stores.state_machine.apply([normal(next, submit(next))]).await.unwrap();
    shared.refresh(&mut second);
    assert_eq!(
        (second.index(), second.state(), second.clones()),
        (next, shared.read_fresh().await.unwrap().state(), 2)
    );
    // A snapshot installed replaces the state wholesale: taken anew.
    let snap = stores.state_machine.get_snapshot_builder().await.build_snapshot().await.unwrap();
    stores.state_machine.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
    shared.refresh(&mut second);
    assert_eq!(
        (second.index(), second.state(), second.clones()),
        (next, shared.read_fresh().await.unwrap().state(), 3)
    );
    // Once its keeper ends the record (it stopped leading), nothing is
    // recorded; a refresh takes the state anew instead of missing what was
    // applied, and starts no record.
    shared.end_copy(&second);
    next += 1;
    stores.state_machine.apply([normal(next, submit(next))]).await.unwrap();
    shared.refresh(&mut second);
    assert_eq!(
        (second.index(), second.state(), second.clones()),
        (next, shared.read_fresh().await.unwrap().state(), 4)
    );
}

/// Readers read published views (`views.rs`): a view is the state as of one
/// index, whole and unchanging however long a reader holds it, and apply
/// never waits for its readers. After any mix of applies a fresh view equals
/// the state apply holds; a snapshot installed is published too.
#[tokio::test]
async fn views_follow_apply_and_readers_never_hold_it_up() {
    use openraft::storage::{RaftSnapshotBuilder, RaftStateMachine};
    let dir = tempfile::tempdir().unwrap();
    let mut stores = open(dir.path()).unwrap();
    let shared = stores.state_machine.shared();
    let format = shared.read().format;
    let normal = |index: u64, cmd| normal_entry(index, cmd, format);
    stores.state_machine.apply((1..=3).map(|i| normal(i, submit(i)))).await.unwrap();
    let held = shared.read_fresh().await.unwrap();
    assert_eq!((held.index(), held.jobs.len()), (3, 3));
    // Applies go on, one batch at a time, while a reader holds its view: each
    // completes, and the held view does not change under its reader.
    let mut next = 4;
    while next <= 2_000 {
        let end = next + 37;
        stores.state_machine.apply((next..end).map(|i| normal(i, submit(i)))).await.unwrap();
        next = end;
        if next % 5 == 0 {
            // Other readers come and go meanwhile.
            let v = shared.read();
            assert!(v.index() < next);
            assert_eq!(v.jobs.len() as u64, v.index());
        }
    }
    assert_eq!((held.index(), held.jobs.len()), (3, 3), "a published view changed under its reader");
    let fresh = shared.read_fresh().await.unwrap();
    assert_eq!(fresh.index(), next - 1);
    assert_eq!(fresh.state(), shared.copy().state(), "the view is not the state apply holds");
    assert!(shared.applied_index() == fresh.index());
    // The view held all along was never reused for a newer one: it was
    // cloned past instead.
    assert!(shared.view_stats().clones >= 1, "{:?}", shared.view_stats());
    drop(held);
    // A snapshot installed replaces the state: the views are taken anew.
    let rebuilds = shared.view_stats().rebuilds;
    let snap = stores.state_machine.get_snapshot_builder().await.build_snapshot().await.unwrap();
    stores.state_machine.install_snapshot(&snap.meta, snap.snapshot).await.unwrap();
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    while shared.view_stats().rebuilds == rebuilds {
        assert!(std::time::Instant::now() < deadline, "the views were not taken anew");
        tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    }
    let after = shared.read_fresh().await.unwrap();
    assert_eq!((after.index(), after.state()), (next - 1, shared.copy().state()));
}

/// Applies a submit at `index` alone and waits for the view that has it.
async fn apply_one_published(
    stores: &mut gangway_raft_store::Stores,
    shared: &gangway_raft_store::SharedState,
    index: u64,
) {
    use openraft::storage::RaftStateMachine;
    let format = shared.read().format;
    stores.state_machine.apply([normal_entry(index, submit(index), format)]).await.unwrap();
    assert_eq!(shared.read_fresh().await.unwrap().index(), index);
}

/// Entries 1 to 4, each published: the maintainer has made its spares (the
/// first ones are clones). The next index to apply.
async fn warm_up(stores: &mut gangway_raft_store::Stores, shared: &gangway_raft_store::SharedState) -> u64 {
    for index in 1..=4 {
        apply_one_published(stores, shared, index).await;
    }
    5
}

/// A reader that holds a view past its replacement (a heartbeat's answer
/// whose thread was not scheduled for a while) costs no clone of the whole
/// state: the maintainer keeps SPARES_MAX spares and takes the free one. With
/// one spare, the held view was due next and was cloned past.
#[tokio::test]
async fn a_view_held_past_its_replacement_costs_no_clone() {
    let dir = tempfile::tempdir().unwrap();
    let mut stores = open(dir.path()).unwrap();
    let shared = stores.state_machine.shared();
    const { assert!(gangway_raft_store::views::SPARES_MAX >= 2) };
    // Warm up: the maintainer has its spares (the first ones are clones).
    let mut next = warm_up(&mut stores, &shared).await;
    let clones = shared.view_stats().clones;
    let held = shared.read_fresh().await.unwrap();
    for _ in 0..20 {
        apply_one_published(&mut stores, &shared, next).await;
        next += 1;
    }
    assert_eq!(held.index(), 4, "a held view does not change");
    assert_eq!(shared.view_stats().clones, clones, "a held view cost a clone: {:?}", shared.view_stats());
    drop(held);
    // With readers letting go at once, the spares take turns: the queue
    // holds only what the older spare needs (a command or two here), never
    // everything since the start, and the views are never taken anew.
    for round in 0..200 {
        apply_one_published(&mut stores, &shared, next).await;
        next += 1;
        let stats = shared.view_stats();
        // (The first rounds catch the spare that was held up.)
        assert!(round < 3 || stats.queued <= 4, "the view queue grew to {} commands: {stats:?}", stats.queued);
    }
    let stats = shared.view_stats();
    assert_eq!((stats.rebuilds, stats.clones), (0, clones), "{stats:?}");
}

/// A view held past SPARE_LAG_MAX entries is let go by the maintainer (its
/// reader keeps it, unchanged): the queue stays within that lag, and one
/// spare is made up (a clone) in its place.
#[tokio::test]
async fn a_spare_held_past_the_lag_limit_is_let_go() {
    use gangway_raft_store::views::SPARE_LAG_MAX;
    let dir = tempfile::tempdir().unwrap();
    let mut stores = open(dir.path()).unwrap();
    let shared = stores.state_machine.shared();
    let mut next = warm_up(&mut stores, &shared).await;
    let clones = shared.view_stats().clones;
    let held = shared.read_fresh().await.unwrap();
    let mut most_queued = 0;
    for _ in 0..SPARE_LAG_MAX + 8 {
        apply_one_published(&mut stores, &shared, next).await;
        next += 1;
        most_queued = most_queued.max(shared.view_stats().queued);
    }
    assert_eq!(held.index(), 4, "a held view does not change");
    assert!(most_queued <= SPARE_LAG_MAX + 2, "the queue held {most_queued} commands");
    let stats = shared.view_stats();
    assert_eq!((stats.clones, stats.rebuilds), (clones + 1, 0), "one spare made up: {stats:?}");
    assert!(stats.queued <= 4, "{stats:?}");
}

/// openraft builds a snapshot in a task of its own: one built from the state
/// at index 3 that finishes after the leader's snapshot at 10 was installed
/// must not replace it. The store keeps the newer one, and after the log
/// through 10 is purged a restart opens at 10 with all ten jobs (from the
/// older one it could not replay past 3).
#[tokio::test]
async fn a_late_build_never_replaces_a_newer_installed_snapshot() {
    use openraft::storage::{RaftLogStorage, RaftLogStorageExt, RaftSnapshotBuilder, RaftStateMachine};
    let dir = tempfile::tempdir().unwrap();
    let mut stores = open(dir.path()).unwrap();
    let format = stores.state_machine.shared().read().format;
    let entries = |to: u64| (1..=to).map(move |i| normal_entry(i, submit(i), format));
    stores.log.blocking_append(entries(10)).await.unwrap();
    stores.state_machine.apply(entries(3)).await.unwrap();
    let mut late = stores.state_machine.get_snapshot_builder().await;

    // The leader's snapshot at 10, from a replica that applied all ten.
    let leader_dir = tempfile::tempdir().unwrap();
    let mut leader = open(leader_dir.path()).unwrap();
    leader.state_machine.apply(entries(10)).await.unwrap();
    let newer = leader.state_machine.get_snapshot_builder().await.build_snapshot().await.unwrap();
    stores.state_machine.install_snapshot(&newer.meta, newer.snapshot).await.unwrap();

    let built = late.build_snapshot().await.unwrap();
    assert_eq!(built.meta.last_log_id.map(|l| l.index), Some(3));
    let current = stores.state_machine.get_current_snapshot().await.unwrap().expect("a current snapshot");
    assert_eq!(current.meta.last_log_id.map(|l| l.index), Some(10), "the late build replaced the newer snapshot");

    stores.log.purge(newer.meta.last_log_id.unwrap()).await.unwrap();
    drop((stores, late));
    let (reopened, state) = open_and_replay(dir.path()).await;
    assert_eq!(state.jobs.len(), 10, "a restart opened an older snapshot than the log was purged to");
    drop(reopened);
    // A newer build is written as before.
    let (mut again, _) = open_and_replay(dir.path()).await;
    again.state_machine.apply((11..=12).map(|i| normal_entry(i, submit(i), format))).await.unwrap();
    let built = again.state_machine.get_snapshot_builder().await.build_snapshot().await.unwrap();
    let current = again.state_machine.get_current_snapshot().await.unwrap().unwrap();
    assert_eq!(
        (built.meta.last_log_id, current.meta.last_log_id.map(|l| l.index)),
        (current.meta.last_log_id, Some(12))
    );
}

/// Dropping the stores closes their database before the drop returns, the
/// group-commit thread's handle included: reopening at once succeeds (RocksDB
/// refuses a second open of a directory while any handle in the process is
/// alive), and no database is left closing in a detached thread as the
/// process exits (which can abort it in RocksDB's static destructors).
#[tokio::test]
async fn dropped_stores_have_closed_their_database() {
    use openraft::storage::RaftLogStorageExt;
    let dir = tempfile::tempdir().unwrap();
    for round in 1..=20u64 {
        let mut stores = open(dir.path()).unwrap_or_else(|e| panic!("reopening, round {round}: {e}"));
        let format = stores.state_machine.shared().read().format;
        stores.log.blocking_append([normal_entry(round, submit(round), format)]).await.unwrap();
        drop(stores);
    }
}
