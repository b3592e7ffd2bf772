//! `gangway accounting`: the long-term job history in PostgreSQL, fed from
//! the replicated event stream (Slurm's slurmdbd). It follows the events
//! from the cursor it stored last; for every batch it reads the jobs the
//! events touched and writes events, jobs and the cursor in one transaction
//! (`store.rs`), so a restart, a replica failover or a database outage
//! resumes without a gap or a duplicate. The controllers never wait for it.
//!
//! It needs to see every job: run it with the certificate (or token) of an
//! operator (`gangway admin set --operators client:accounting`).

use gangway_controller::accounting::store::{is_data_error, redacted, Store};

use std::collections::BTreeSet;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::Context;
use clap::Args;
use futures::StreamExt;
use gangway_proto::client::Client;
use gangway_proto::events::Cursor;
use gangway_proto::retry::Retry;
use gangway_proto::v1 as pb;
use gangway_proto::v1::admin_service_client::AdminServiceClient;
use gangway_proto::v1::job_service_client::JobServiceClient;

/// Events between the stream and the writer: while the database is slow or
/// away the stream waits here, then on the replica, which drops it when it
/// falls too far behind (the follower then resumes from its cursor).
const EVENT_QUEUE_MAX: usize = 4096;
/// Events written in one transaction at most.
const BATCH_EVENTS_MAX: usize = 1000;
/// Jobs one batch reads at most (a job's record can be megabytes: its
/// script): a batch closes when its events touch this many.
const BATCH_JOBS_MAX: usize = 100;
/// How long writing one batch may take before the connection is dropped
/// and the batch tried again on a new one.
const WRITE_TIMEOUT: Duration = Duration::from_secs(60);
/// Attempts at reading a batch's jobs from the controllers (a second apart:
/// an election takes well under one) before the service exits.
const READ_ATTEMPTS_MAX: u64 = 120;
const READ_RETRY: Retry = Retry::new(READ_ATTEMPTS_MAX, Duration::from_secs(1));
/// How long a batch waits for more events before it is written.
const BATCH_WAIT: Duration = Duration::from_millis(200);
/// Jobs read from the controllers at once for one batch.
const JOB_READS_AT_ONCE: usize = 16;
/// Jobs per page when the whole state is read (a first start, or a
/// follower that fell behind what the replicas keep).
const RESYNC_PAGE_JOBS: u32 = 1000;
/// Pages of one such read (10 million jobs; the state keeps far fewer: a
/// read that does not end within them fails rather than skip the rest).
const RESYNC_PAGES_MAX: usize = 10_000;
/// Attempts at writing one batch (or connecting) before giving up, with
/// pauses growing to [`DB_RETRY_PAUSE_MAX`]: about an hour of outage, after
/// which the service exits for its supervisor and resumes from its cursor.
const DB_ATTEMPTS_MAX: u32 = 720;
const DB_RETRY_PAUSE_MAX: Duration = Duration::from_secs(5);
/// How often expired history is deleted.
const RETENTION_EVERY: Duration = Duration::from_secs(3600);
/// How often the service tells the cluster what it has stored (a log entry
/// each time), so the state can let those finished jobs go.
const STORED_EVERY: Duration = Duration::from_secs(1);
/// How often ingest progress is logged.
const PROGRESS_EVERY: Duration = Duration::from_secs(60);

/// How often the nodes' capacity is sampled for `sreport cluster
/// Utilization` (Slurm's slurmdbd rolls usage up hourly; a minute keeps a
/// node's outage visible to the minute, 1,440 rows a day).
const CAPACITY_EVERY: Duration = Duration::from_secs(60);

#[derive(Args)]
pub struct AccountingArgs {
    #[command(subcommand)]
    pub action: Option<AccountingAction>,
    /// The PostgreSQL database: postgres://USER[:PASSWORD]@HOST[:PORT]/DB, or
    /// key=value settings (host=/var/run/postgresql user=gangway dbname=gangway).
    #[arg(long, env = "GANGWAY_ACCOUNTING_DATABASE", global = true)]
    pub database: Option<String>,
    /// Finished jobs (and events) are deleted this many days after they
    /// ended (were stored); 0 keeps everything.
    #[arg(long, default_value_t = 365)]
    pub retention_days: u64,
}

/// The service's settings, the database named.
struct Service {
    database: String,
    retention_days: u64,
    action: Option<AccountingAction>,
}

#[derive(clap::Subcommand, Clone, Copy)]
pub enum AccountingAction {
    /// Rebuild fair share's usage from the stored history (after a
    /// disaster restore left the cluster's usage older than the history):
    /// every finished job charged at its end, as the controllers charge
    /// them, within the window fair share remembers. Admins only.
    RebuildFairshare {
        /// Print the usage it would restore, and change nothing.
        #[arg(long)]
        dry_run: bool,
    },
    /// Let the cluster drop the finished jobs the accounting store has not
    /// stored (an accounting service gone for good): the state treats every
    /// job finished so far as stored, so those it keeps past
    /// --finished-jobs-kept go, and their records with them, and new jobs
    /// are taken again. Operators and admins only; no database needed.
    ReleaseUnstored,
}

pub async fn run(client: Client, mut a: AccountingArgs) -> anyhow::Result<()> {
    if let Some(AccountingAction::ReleaseUnstored) = a.action {
        return release_unstored(&client).await;
    }
    let database = a.database.take().filter(|d| !d.is_empty()).ok_or_else(|| {
        anyhow::anyhow!("--database: name the PostgreSQL database (or set GANGWAY_ACCOUNTING_DATABASE)")
    })?;
    let a = Service { database, retention_days: a.retention_days, action: a.action };
    if let Some(AccountingAction::RebuildFairshare { dry_run }) = a.action {
        return rebuild_fairshare(&client, &a.database, dry_run).await;
    }
    let client = Arc::new(client);
    let mut store = connect(&a.database).await?;
    // Only the writer samples (a standby reaches here once it takes over).
    let _capacity = AbortOnDrop(tokio::spawn(capacity_loop(client.clone(), a.database.clone())));
    let mut cursor = match store.cursor().await? {
        Some(c) => c,
        None => resync(&client, &mut store, &a.database).await?,
    };
    // From now on the state keeps the finished jobs the store does not have yet.
    if cursor.index > 1 {
        tell_stored(&client, &store, cursor.index - 1, cursor.history).await;
    }
    tracing::info!(index = cursor.index, "accounting: following the cluster's events");
    loop {
        let (tx, rx) = event_queue();
        let follower = {
            let client = client.clone();
            tokio::spawn(async move {
                gangway_proto::events::follow_from(&client, Some(cursor), move |ev, c| {
                    let tx = tx.clone();
                    async move { tx.send((ev, c)).await.is_ok() }
                })
                .await
            })
        };
        let written = write_loop(&client, &mut store, &a, rx).await;
        follower.abort();
        let followed = follower.await;
        written?;
        match followed {
            Ok(Err(s)) if s.code() == tonic::Code::OutOfRange => {
                tracing::warn!(
                    error = %s.message(),
                    "accounting: the cursor is past what the replicas keep, or of another cluster history \
                     (a restore); reading every job again (events in a gap are not stored; jobs the state \
                     still holds are)"
                );
                cursor = resync(&client, &mut store, &a.database).await?;
            }
            Ok(Err(s)) => anyhow::bail!("accounting: the event stream failed: {}", s.message()),
            Ok(Ok(())) | Err(_) => anyhow::bail!("accounting: the event stream ended"),
        }
    }
}

/// Writes batches until the stream's channel closes (the follower stopped).
async fn write_loop(
    client: &Client,
    store: &mut Store,
    a: &Service,
    mut rx: tokio::sync::mpsc::Receiver<(pb::ClusterEvent, Cursor)>,
) -> anyhow::Result<()> {
    let mut expired_at: Option<Instant> = None;
    let (mut since, mut events_since) = (Instant::now(), 0usize);
    // The log index through which every job is stored, not yet told.
    let mut untold: Option<(u64, Option<u64>)> = None;
    let mut told_at = Instant::now();
    loop {
        let first = match tokio::time::timeout(STORED_EVERY, rx.recv()).await {
            Ok(Some(first)) => first,
            Ok(None) => return Ok(()),
            Err(_) => {
                if let Some((index, history)) = untold.take() {
                    tell_stored(client, store, index, history).await;
                    told_at = Instant::now();
                }
                continue;
            }
        };
        let (batch, ids) = gather(first, &mut rx).await;
        let jobs = read_jobs_retrying(client, &ids).await?;
        let cursor = batch.last().map(|(_, c)| *c);
        let as_of = cursor.map_or(0, |c| c.index);
        write_retrying(store, &a.database, &batch, &jobs, as_of, cursor).await?;
        // Entries before the cursor's are stored whole.
        untold = cursor.map(|c| (c.index.saturating_sub(1), c.history)).filter(|(i, _)| *i > 0).or(untold);
        if told_at.elapsed() >= STORED_EVERY {
            if let Some((index, history)) = untold.take() {
                tell_stored(client, store, index, history).await;
                told_at = Instant::now();
            }
        }
        events_since += batch.len();
        if since.elapsed() >= PROGRESS_EVERY {
            let rate = events_since as f64 / since.elapsed().as_secs_f64();
            tracing::info!(index = cursor.map_or(0, |c| c.index), events_per_s = rate, "accounting: ingesting");
            (since, events_since) = (Instant::now(), 0);
        }
        if a.retention_days > 0 && expired_at.is_none_or(|t| t.elapsed() >= RETENTION_EVERY) {
            let keep = Duration::from_secs(a.retention_days.saturating_mul(86_400));
            let before = std::time::SystemTime::now().checked_sub(keep).unwrap_or(std::time::UNIX_EPOCH);
            match store.expire(before).await {
                Ok(n) if n > 0 => tracing::info!(rows = n, "accounting: expired history deleted"),
                Ok(_) => {}
                Err(e) => tracing::warn!(error = %e, "accounting: expiring history failed; retried next hour"),
            }
            expired_at = Some(Instant::now());
        }
    }
}

/// A batch from its `first` event: the events that follow within
/// [`BATCH_WAIT`], until it holds [`BATCH_EVENTS_MAX`] events or touches
/// [`BATCH_JOBS_MAX`] jobs; with the ids of those jobs.
async fn gather(
    first: (pb::ClusterEvent, Cursor),
    rx: &mut tokio::sync::mpsc::Receiver<(pb::ClusterEvent, Cursor)>,
) -> (Vec<(pb::ClusterEvent, Cursor)>, BTreeSet<u64>) {
    let mut ids: BTreeSet<u64> = BTreeSet::new();
    ids.extend(Some(first.0.job_id).filter(|j| *j != 0));
    let mut batch = vec![first];
    let deadline = tokio::time::Instant::now() + BATCH_WAIT;
    while batch.len() < BATCH_EVENTS_MAX && ids.len() < BATCH_JOBS_MAX {
        match tokio::time::timeout_at(deadline, rx.recv()).await {
            Ok(Some(e)) => {
                ids.extend(Some(e.0.job_id).filter(|j| *j != 0));
                batch.push(e);
            }
            _ => break,
        }
    }
    (batch, ids)
}

/// Tells the cluster the store holds every job through `index` of
/// `history`; a failure is only logged (the next report says as much, and
/// until then the state just keeps those jobs a while longer). A cluster of
/// another history refuses it.
async fn tell_stored(client: &Client, store: &Store, index: u64, history: Option<u64>) {
    // Never at or past a batch the database refused.
    let index = match store.unstored_from(false).await {
        Ok(Some(from)) => index.min(from.saturating_sub(1)),
        Ok(None) => index,
        Err(e) => {
            tracing::warn!(error = %format!("{e:#}"), "accounting: reading what is unstored failed; not telling");
            return;
        }
    };
    if index == 0 {
        return;
    }
    let r = client
        .call(|ch| {
            let req = client.request(pb::AccountingStoredRequest { index, history });
            async move { AdminServiceClient::new(ch).accounting_stored(req).await }
        })
        .await;
    if let Err(s) = r {
        tracing::warn!(index, error = %s.message(), "accounting: telling the cluster what is stored failed");
    }
}

/// `gangway accounting release-unstored`: the cluster's applied index told
/// as stored, in its own history.
async fn release_unstored(client: &Client) -> anyhow::Result<()> {
    let status = replica_position(client).await?;
    let index = status.applied_index.unwrap_or(0);
    let history = Some(status.history);
    let told = client
        .call(|ch| {
            let req = client.request(pb::AccountingStoredRequest { index, history });
            async move { AdminServiceClient::new(ch).accounting_stored(req).await }
        })
        .await
        .map_err(|s| anyhow::anyhow!("{}", s.message()))?
        .into_inner();
    println!(
        "the cluster now treats every job finished through log index {} as stored: those the accounting store \
         lacks leave the state as its limits need room, and new jobs are taken again",
        told.index
    );
    Ok(())
}

/// The pages of a read of the whole state: [`RESYNC_PAGES_MAX`] at most.
/// The cursor is stored with the last page only, so a read that does not
/// end within them fails with nothing of its position stored (never reached
/// while the state keeps fewer jobs than the pages hold: a test holds the
/// two together).
#[derive(Debug, Default)]
struct Pages {
    read: usize,
    after_id: u64,
}

impl Pages {
    /// Where the next page starts, or the error past the last page.
    fn next(&self) -> anyhow::Result<u64> {
        anyhow::ensure!(
            self.read < RESYNC_PAGES_MAX,
            "accounting: the state's jobs did not end within {RESYNC_PAGES_MAX} pages; the cursor was not moved"
        );
        Ok(self.after_id)
    }

    /// A page was read, ending at `next_after_id` (0: the last): whether it
    /// was the last.
    fn took(&mut self, next_after_id: u64) -> bool {
        self.read = self.read.saturating_add(1);
        self.after_id = next_after_id;
        next_after_id == 0
    }
}

/// [`read_jobs`], again while the controllers do not answer (an election).
async fn read_jobs_retrying(client: &Client, ids: &BTreeSet<u64>) -> anyhow::Result<Vec<pb::Job>> {
    let mut last = None;
    let mut tries = READ_RETRY.tries();
    while tries.next().await {
        match read_jobs(client, ids.clone()).await {
            Ok(j) => return Ok(j),
            Err(e) => {
                if tries.first() {
                    tracing::warn!(error = %format!("{e:#}"), "accounting: reading jobs failed; retrying");
                }
                last = Some(e);
            }
        }
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("no attempt made")))
        .context(format!("accounting: the controllers did not answer {READ_ATTEMPTS_MAX} times"))
}

/// The jobs as they are now (read from the leader, so at least as new as
/// the events); one the state no longer holds is left out.
async fn read_jobs(client: &Client, ids: BTreeSet<u64>) -> anyhow::Result<Vec<pb::Job>> {
    let reads = futures::stream::iter(ids)
        .map(|job_id| async move {
            let r = client
                .call(|ch| {
                    let req = client.request(pb::GetJobRequest { job_id, stale: false });
                    async move { JobServiceClient::new(ch).get(req).await }
                })
                .await;
            match r {
                Ok(j) => Ok(Some(j.into_inner())),
                Err(s) if s.code() == tonic::Code::NotFound => Ok(None),
                Err(s) => Err(anyhow::anyhow!("accounting: reading job {job_id}: {}", s.message())),
            }
        })
        .buffer_unordered(JOB_READS_AT_ONCE)
        .collect::<Vec<_>>()
        .await;
    let mut jobs = Vec::with_capacity(reads.len());
    for r in reads {
        if let Some(j) = r? {
            jobs.push(j);
        }
    }
    Ok(jobs)
}

/// Every job the state holds, written without events, and the cursor to
/// follow from: the answering replica's applied index, read before the
/// jobs (so nothing between falls out; what is read twice is written once).
/// When the cluster's history is not the stored cursor's (a restore from a
/// backup since), the cursor is the new history's first entry instead: its
/// events from there are followed too, while the replicas keep them.
async fn resync(client: &Client, store: &mut Store, database: &str) -> anyhow::Result<Cursor> {
    let status = replica_position(client).await?;
    let applied = status.applied_index.unwrap_or(0);
    let mut cursor = Cursor { index: applied + 1, delivered: 0, history: Some(status.history) };
    let stored = store.cursor().await?;
    let as_of = match stored {
        // The cluster was restored from a backup since the store's cursor:
        // its indexes count in the new history from the backup's on.
        Some(c) if c.history.is_some_and(|h| h != status.history) => {
            tracing::warn!(
                stored = ?c.history,
                cluster = status.history,
                since = status.history_since,
                "accounting: the cluster's history changed (a restore from a backup); following the new one \
                 from its first entry"
            );
            store.start_history(status.history_since).await?;
            cursor.index = status.history_since.saturating_add(1).min(cursor.index);
            applied
        }
        // A lagging replica's index may be older than what is stored: the
        // jobs read now are newer than both, so they are written as of the newer.
        Some(c) => applied.max(c.index),
        None => applied,
    };
    let (mut pages, mut total, mut refused) = (Pages::default(), 0usize, false);
    loop {
        let after_id = pages.next()?;
        let resp = client
            .call(|ch| {
                let req =
                    client.request(pb::ListJobsRequest { limit: RESYNC_PAGE_JOBS, after_id, ..Default::default() });
                async move { JobServiceClient::new(ch).list(req).await }
            })
            .await
            .map_err(|s| anyhow::anyhow!("accounting: listing jobs: {}", s.message()))?
            .into_inner();
        total += resp.jobs.len();
        let last = pages.took(resp.next_after_id);
        // The cursor goes with the last page only: a read cut short starts over.
        refused |= !write_retrying(store, database, &[], &resp.jobs, as_of, last.then_some(cursor)).await?;
        if last {
            break;
        }
    }
    if !refused {
        // Whatever an earlier refused batch left out, the state held is stored now.
        store.unstored_from(true).await?;
    }
    tracing::info!(jobs = total, from_index = cursor.index, "accounting: every job the state holds is stored");
    Ok(cursor)
}

/// Where the answering replica's log is, and in which history: asked again
/// (a second apart) while it has applied nothing yet (a replica just added,
/// waiting for its snapshot, would report the first history at index 0), or
/// while a restored cluster's leader has not drawn its history yet.
async fn replica_position(client: &Client) -> anyhow::Result<pb::ReplicaStatus> {
    let mut tries = READ_RETRY.tries();
    while tries.next().await {
        let status = client
            .call(|ch| {
                let req = client.request(pb::ReplicaStatusRequest {});
                async move { AdminServiceClient::new(ch).get_replica_status(req).await }
            })
            .await
            .map_err(|s| anyhow::anyhow!("accounting: asking a replica where its log is: {}", s.message()))?
            .into_inner();
        // A restored cluster's history is settled once its leader drew it.
        if status.applied_index.unwrap_or(0) > 0 && !status.history_pending {
            return Ok(status);
        }
    }
    anyhow::bail!("accounting: no replica has applied its log after {READ_ATTEMPTS_MAX} tries")
}

/// Connects, and waits to be the only writer (a second service stands by
/// until the first one's connection ends).
async fn connect(database: &str) -> anyhow::Result<Store> {
    let mut last = None;
    for attempt in 0..DB_ATTEMPTS_MAX {
        let connected = async {
            let s = Store::connect(database).await?;
            s.become_writer().await?;
            anyhow::Ok(s)
        };
        match connected.await {
            Ok(s) => return Ok(s),
            Err(e) => {
                if attempt == 0 {
                    tracing::warn!(error = %format!("{e:#}"), "accounting: the database is not reachable; retrying");
                }
                last = Some(e);
            }
        }
        tokio::time::sleep(pause(attempt)).await;
    }
    Err(last.unwrap_or_else(|| anyhow::anyhow!("database: no attempt made")))
        .with_context(|| format!("accounting: gave up on {} after {DB_ATTEMPTS_MAX} attempts", redacted(database)))
}

async fn write_retrying(
    store: &mut Store,
    database: &str,
    events: &[(pb::ClusterEvent, Cursor)],
    jobs: &[pb::Job],
    as_of: u64,
    cursor: Option<Cursor>,
) -> anyhow::Result<bool> {
    for attempt in 0..DB_ATTEMPTS_MAX {
        if store.is_closed() {
            *store = connect(database).await?;
        }
        let written =
            tokio::time::timeout(WRITE_TIMEOUT, store.write(events, jobs, as_of, cursor, crate::output::now_ms()))
                .await;
        match written {
            Ok(Ok(())) => return Ok(true),
            // The same batch would fail again forever: it is skipped (its
            // cursor kept), loudly, rather than stop the whole history.
            Ok(Err(e)) if is_data_error(&e) => {
                let at = cursor.map_or(0, |c| c.index);
                tracing::error!(
                    error = %format!("{e:#}"),
                    index = at,
                    "accounting: the database refused a batch's data; it is skipped"
                );
                // Its jobs are never said to be stored (a resync page: no
                // job after this is).
                let first = events.first().map_or(1, |(e, _)| e.index.max(1));
                if cursor.is_some() {
                    store.write(&[], &[], as_of, cursor, crate::output::now_ms()).await?;
                }
                store.mark_unstored(first).await?;
                return Ok(false);
            }
            Ok(Err(e)) => {
                tracing::warn!(error = %format!("{e:#}"), attempt, "accounting: writing a batch failed; retrying");
                tokio::time::sleep(pause(attempt)).await;
            }
            Err(_) => {
                tracing::warn!(attempt, "accounting: writing a batch took too long; reconnecting");
                *store = connect(database).await?;
            }
        }
    }
    anyhow::bail!("accounting: a batch could not be written after {DB_ATTEMPTS_MAX} attempts")
}

struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// Samples the nodes' capacity every [`CAPACITY_EVERY`] into its own
/// connection; a sample that cannot be taken or stored is skipped (the
/// range it covered reads as unknown, not as idle).
async fn capacity_loop(client: Arc<Client>, database: String) {
    let mut store: Option<Store> = None;
    let mut tick = tokio::time::interval(CAPACITY_EVERY);
    tick.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Skip);
    // Bounded by the service's life: one sample a tick.
    loop {
        tick.tick().await;
        let at = std::time::SystemTime::now();
        let nodes = match client.list_nodes(false).await {
            Ok(n) => n,
            Err(e) => {
                tracing::warn!(error = %e.message(), "accounting: sampling capacity failed");
                continue;
            }
        };
        let c = gangway_controller::accounting::store::capacity(&nodes);
        if store.as_ref().is_none_or(Store::is_closed) {
            store = tokio::time::timeout(CAPACITY_EVERY, Store::connect(&database)).await.ok().and_then(Result::ok);
        }
        let interval_s = CAPACITY_EVERY.as_secs() as i32;
        let stored = match &store {
            Some(s) => tokio::time::timeout(CAPACITY_EVERY, s.sample_capacity(at, interval_s, &c))
                .await
                .unwrap_or_else(|_| Err(anyhow::anyhow!("no answer within {} s", CAPACITY_EVERY.as_secs()))),
            None => Err(anyhow::anyhow!("no database connection")),
        };
        if let Err(e) = stored {
            tracing::warn!(error = %format!("{e:#}"), "accounting: storing a capacity sample failed");
            store = None;
        }
    }
}

/// `gangway accounting rebuild-fairshare`: the usage fair share would hold
/// had the cluster charged every stored job at its end, restored through
/// `AdminService.RestoreUsage`.
async fn rebuild_fairshare(client: &Client, database: &str, dry_run: bool) -> anyhow::Result<()> {
    use gangway_core::limits::USAGE_BUCKETS_MAX;
    use gangway_core::state::{usage_bucket_width_ms, usage_from_runs};
    let policy = client
        .call(|ch| {
            let req = client.request(pb::GetPolicyRequest::default());
            async move { AdminServiceClient::new(ch).get_policy(req).await }
        })
        .await
        .map_err(|s| anyhow::anyhow!("reading the policy: {}", s.message()))?
        .into_inner();
    let policy: gangway_core::policy::ClusterPolicy =
        serde_json::from_str(&policy.json).context("reading the policy: not a policy document")?;
    // Older runs than the buckets the state keeps would be dropped anyway.
    let width = usage_bucket_width_ms(policy.fairshare_half_life_s);
    let window = Duration::from_millis(width.saturating_mul(USAGE_BUCKETS_MAX as u64));
    let since = std::time::SystemTime::now().checked_sub(window).unwrap_or(std::time::UNIX_EPOCH);
    let store = Store::connect(database).await?;
    let runs: Vec<gangway_core::state::ChargedRun> = store
        .charged_runs(since)
        .await?
        .into_iter()
        .map(|(account, end_ms, gpu_ms, cpu_ms)| gangway_core::state::ChargedRun { account, end_ms, gpu_ms, cpu_ms })
        .collect();
    let jobs = runs.len();
    let usage = usage_from_runs(runs, policy.fairshare_half_life_s);
    for (account, buckets) in &usage {
        let gpu_h: f64 = buckets.iter().map(|b| b.gpu_ms as f64).sum::<f64>() / 3.6e6;
        let cpu_h: f64 = buckets.iter().map(|b| b.cpu_ms as f64).sum::<f64>() / 3.6e6;
        println!("{account}: {gpu_h:.2} GPU-hours, {cpu_h:.2} CPU-hours in {} buckets", buckets.len());
    }
    if dry_run {
        println!("{jobs} jobs, {} accounts: nothing changed (--dry-run)", usage.len());
        return Ok(());
    }
    let accounts: Vec<pb::AccountUsage> = usage
        .into_iter()
        .map(|(account, buckets)| pb::AccountUsage {
            account,
            buckets: buckets
                .iter()
                .map(|b| pb::UsageBucket { start_ms: b.start_ms, gpu_ms: b.gpu_ms, cpu_ms: b.cpu_ms })
                .collect(),
        })
        .collect();
    let resp = client
        .call(|ch| {
            let req = client.request(pb::RestoreUsageRequest { accounts: accounts.clone() });
            async move { AdminServiceClient::new(ch).restore_usage(req).await }
        })
        .await
        .map_err(|s| anyhow::anyhow!("restoring fair share's usage: {}", s.message()))?
        .into_inner();
    println!("fair share's usage rebuilt from {jobs} jobs: {} accounts", resp.accounts);
    Ok(())
}

type EventQueue =
    (tokio::sync::mpsc::Sender<(pb::ClusterEvent, Cursor)>, tokio::sync::mpsc::Receiver<(pb::ClusterEvent, Cursor)>);

/// The queue between the event stream and the writer: [`EVENT_QUEUE_MAX`].
fn event_queue() -> EventQueue {
    tokio::sync::mpsc::channel(EVENT_QUEUE_MAX)
}

/// 100 ms, doubling, at most [`DB_RETRY_PAUSE_MAX`].
fn pause(attempt: u32) -> Duration {
    Duration::from_millis(100u64.saturating_mul(1 << attempt.min(10))).min(DB_RETRY_PAUSE_MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The stream waits (then the replica drops it) once EVENT_QUEUE_MAX
    /// events wait for the writer.
    #[test]
    fn the_event_queue_holds_event_queue_max_events() {
        let (tx, mut rx) = event_queue();
        for i in 0..EVENT_QUEUE_MAX as u64 {
            tx.try_send(event(0, i)).unwrap();
        }
        assert!(matches!(tx.try_send(event(0, 0)), Err(tokio::sync::mpsc::error::TrySendError::Full(_))));
        rx.try_recv().unwrap();
        tx.try_send(event(0, 0)).unwrap();
    }

    /// Reads retry READ_ATTEMPTS_MAX times, a second apart: two minutes,
    /// many elections' worth; a resync's pages hold every job the state can
    /// keep (the active and the retained finished ones), so it never stops
    /// short of the end.
    #[tokio::test]
    async fn reads_retry_through_elections_and_a_resync_reads_the_whole_state() {
        assert_eq!(gangway_proto::retry::count_tries(READ_RETRY).await, READ_ATTEMPTS_MAX);
        assert!(READ_RETRY.span() >= Duration::from_secs(60), "{:?}", READ_RETRY.span());
        // Pages are cut at RESYNC_PAGE_JOBS jobs or at the list's byte
        // budget, which a page fills to within one spec: the jobs the state
        // can keep, and the bytes of their specs, fit in the pages.
        use gangway_core::limits::{
            ACTIVE_JOBS_MAX, CLUSTER_UNFINISHED_BYTES_MAX, FINISHED_BYTES_RETAINED_MAX, FINISHED_JOBS_RETAINED_MAX,
            JOB_SPEC_BYTES_MAX,
        };
        use gangway_proto::limits::LIST_RESPONSE_BYTES_MAX;
        let by_count = (ACTIVE_JOBS_MAX + FINISHED_JOBS_RETAINED_MAX).div_ceil(RESYNC_PAGE_JOBS as usize);
        let bytes = CLUSTER_UNFINISHED_BYTES_MAX + FINISHED_BYTES_RETAINED_MAX;
        let by_bytes = bytes.div_ceil((LIST_RESPONSE_BYTES_MAX - JOB_SPEC_BYTES_MAX) as u64) as usize;
        assert!(by_count + by_bytes <= RESYNC_PAGES_MAX, "{by_count} + {by_bytes} pages");
    }

    /// A read of the whole state takes RESYNC_PAGES_MAX pages, the last
    /// with the cursor; one page more is an error before it is read, and
    /// the cursor (stored with the last page only) never is.
    #[test]
    fn a_resync_reads_resync_pages_max_pages_and_fails_past_them() {
        let read = |pages_there: usize| {
            let mut pages = Pages::default();
            let mut lasts = 0;
            for k in 1.. {
                let after_id = pages.next()?;
                assert_eq!(after_id, (k as u64 - 1) * 10, "each page goes on from the last");
                let next = if k == pages_there { 0 } else { k as u64 * 10 };
                if pages.took(next) {
                    lasts += 1;
                    break;
                }
            }
            anyhow::Ok((pages.read, lasts))
        };
        assert_eq!(read(RESYNC_PAGES_MAX).unwrap(), (RESYNC_PAGES_MAX, 1));
        let e = read(RESYNC_PAGES_MAX + 1).unwrap_err().to_string();
        assert!(e.contains(&RESYNC_PAGES_MAX.to_string()) && e.contains("cursor was not moved"), "{e}");
    }

    fn event(job_id: u64, index: u64) -> (pb::ClusterEvent, Cursor) {
        (pb::ClusterEvent { job_id, ..Default::default() }, Cursor { index, delivered: 0, history: None })
    }

    /// A batch closes at BATCH_EVENTS_MAX events, or once its events touch
    /// BATCH_JOBS_MAX jobs; what follows waits for the next batch.
    #[tokio::test]
    async fn batches_close_at_their_event_and_job_limits() {
        let (tx, mut rx) = tokio::sync::mpsc::channel(2 * BATCH_EVENTS_MAX);
        // Events of no job (node events): only the event limit applies.
        for i in 1..=BATCH_EVENTS_MAX as u64 + 1 {
            tx.send(event(0, i)).await.unwrap();
        }
        let first = rx.recv().await.unwrap();
        let (batch, ids) = gather(first, &mut rx).await;
        assert_eq!((batch.len(), ids.len()), (BATCH_EVENTS_MAX, 0));
        assert_eq!(rx.recv().await.unwrap().1.index, BATCH_EVENTS_MAX as u64 + 1, "the event past the batch waits");

        // Two events per job: the batch closes with its BATCH_JOBS_MAX-th job's first.
        for i in 0..2 * (BATCH_JOBS_MAX as u64 + 1) {
            tx.send(event(i / 2 + 1, i + 1)).await.unwrap();
        }
        let first = rx.recv().await.unwrap();
        let (batch, ids) = gather(first, &mut rx).await;
        assert_eq!(ids.len(), BATCH_JOBS_MAX);
        assert_eq!(batch.len(), 2 * BATCH_JOBS_MAX - 1);
        assert_eq!(rx.recv().await.unwrap().0.job_id, BATCH_JOBS_MAX as u64, "its second event waits");
    }

    /// Retries pause 100 ms, doubling, never more than DB_RETRY_PAUSE_MAX;
    /// DB_ATTEMPTS_MAX of them ride out about an hour of outage, as the
    /// service promises its operators, and no more.
    #[test]
    fn database_retries_ride_out_about_an_hour() {
        assert_eq!(pause(0), Duration::from_millis(100));
        assert_eq!(pause(1), Duration::from_millis(200));
        assert_eq!(pause(5), Duration::from_millis(3_200));
        assert_eq!(pause(6), DB_RETRY_PAUSE_MAX);
        assert_eq!(pause(u32::MAX), DB_RETRY_PAUSE_MAX);
        let outage: Duration = (0..DB_ATTEMPTS_MAX).map(pause).sum();
        assert!(
            (Duration::from_secs(55 * 60)..=Duration::from_secs(61 * 60)).contains(&outage),
            "{DB_ATTEMPTS_MAX} attempts ride out {outage:?}"
        );
    }
}
