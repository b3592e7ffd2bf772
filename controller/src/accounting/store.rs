//! The accounting store in PostgreSQL: versioned migrations applied at
//! start, and one transaction per batch of events that writes the events,
//! the jobs they touched and the cursor together, so a batch is stored
//! exactly once whatever stops in between (the log index and the event's
//! place within it are the key).

use std::time::{Duration, SystemTime, UNIX_EPOCH};

use anyhow::Context;
use gangway_proto::events::Cursor;
use gangway_proto::v1 as pb;
use tokio_postgres::types::ToSql;

/// The schema, one migration per version, applied in order inside a
/// transaction each; `gangway_schema` records the newest applied. A
/// migration is never edited once released: a change is a new one.
pub const MIGRATIONS: &[(i32, &str)] = &[
    (
        1,
        "CREATE TABLE ingest_cursor (
        id boolean PRIMARY KEY DEFAULT true CHECK (id),
        log_index bigint NOT NULL,
        delivered integer NOT NULL,
        updated_at timestamptz NOT NULL DEFAULT now()
    );
    CREATE TABLE events (
        log_index bigint NOT NULL,
        ordinal integer NOT NULL,
        kind text NOT NULL,
        job_id bigint,
        state text NOT NULL,
        attempt integer NOT NULL,
        node text NOT NULL,
        gpu integer,
        reason text NOT NULL,
        step integer,
        ingested_at timestamptz NOT NULL DEFAULT now(),
        PRIMARY KEY (log_index, ordinal)
    );
    CREATE INDEX events_job ON events (job_id, log_index);
    CREATE INDEX events_ingested ON events (ingested_at);
    CREATE TABLE jobs (
        job_id bigint PRIMARY KEY,
        display_id text NOT NULL,
        name text NOT NULL,
        user_name text NOT NULL,
        account text NOT NULL,
        partition text NOT NULL,
        qos text NOT NULL,
        state text NOT NULL,
        reason text NOT NULL,
        exit_code integer,
        exit_signal integer,
        submit_time timestamptz NOT NULL,
        start_time timestamptz,
        end_time timestamptz,
        time_limit_s bigint NOT NULL,
        suspended_ms bigint NOT NULL,
        attempts integer NOT NULL,
        nodes_requested bigint NOT NULL,
        gpus_per_node bigint NOT NULL,
        gpu_type text NOT NULL,
        mem_per_node_mb bigint NOT NULL,
        node_list text[] NOT NULL,
        alloc_cpus bigint NOT NULL,
        alloc_gpus bigint NOT NULL,
        alloc_mem_mb bigint NOT NULL,
        elapsed_s bigint NOT NULL,
        cpu_seconds bigint NOT NULL,
        gpu_seconds bigint NOT NULL,
        array_job_id bigint,
        array_index integer,
        work_dir text NOT NULL,
        last_index bigint NOT NULL
    );
    CREATE INDEX jobs_end ON jobs (end_time);
    CREATE INDEX jobs_submit ON jobs (submit_time);
    CREATE INDEX jobs_user_end ON jobs (user_name, end_time);
    CREATE INDEX jobs_account_end ON jobs (account, end_time);
    CREATE TABLE allocations (
        job_id bigint NOT NULL REFERENCES jobs ON DELETE CASCADE,
        attempt integer NOT NULL,
        node text NOT NULL,
        cpus integer NOT NULL,
        mem_mb bigint NOT NULL,
        gpus integer[] NOT NULL,
        PRIMARY KEY (job_id, attempt, node)
    );
    CREATE TABLE steps (
        job_id bigint NOT NULL REFERENCES jobs ON DELETE CASCADE,
        attempt integer NOT NULL,
        step_id integer NOT NULL,
        name text NOT NULL,
        nodes text[] NOT NULL,
        tasks integer NOT NULL,
        start_time timestamptz NOT NULL,
        end_time timestamptz,
        state text NOT NULL,
        exit_code integer,
        signal integer,
        PRIMARY KEY (job_id, attempt, step_id)
    );",
    ),
    (
        2,
        "ALTER TABLE ingest_cursor ADD COLUMN unstored_from bigint;
        ALTER TABLE jobs ADD COLUMN measured_nodes integer, ADD COLUMN cpu_used_ms bigint,
            ADD COLUMN mem_peak_mb bigint, ADD COLUMN gpu_util_pct double precision,
            ADD COLUMN gpu_mem_peak_mb bigint;
        CREATE INDEX jobs_array ON jobs (array_job_id) WHERE array_job_id IS NOT NULL;
        CREATE INDEX jobs_unfinished ON jobs (start_time) WHERE end_time IS NULL;
        CREATE INDEX jobs_name ON jobs (name);
        CREATE TABLE capacity (
            sampled_at timestamptz PRIMARY KEY,
            interval_s integer NOT NULL CHECK (interval_s > 0 AND interval_s <= 3600),
            cpus_total bigint NOT NULL,
            cpus_down bigint NOT NULL,
            cpus_planned_down bigint NOT NULL,
            gpus_total bigint NOT NULL,
            gpus_down bigint NOT NULL,
            gpus_planned_down bigint NOT NULL
        );",
    ),
    (
        3,
        "ALTER TABLE ingest_cursor ADD COLUMN history bigint NOT NULL DEFAULT 0;
        ALTER TABLE events ADD COLUMN history bigint NOT NULL DEFAULT 0;
        ALTER TABLE events DROP CONSTRAINT events_pkey;
        ALTER TABLE events ADD PRIMARY KEY (history, log_index, ordinal);",
    ),
];

/// A cluster history (`ClusterEvent.history`, a u64) as PostgreSQL's bigint
/// holds it: the same 64 bits.
fn history_sql(history: Option<u64>) -> i64 {
    i64::from_ne_bytes(history.unwrap_or(0).to_ne_bytes())
}

/// Rows one retention pass deletes per statement, so it never holds a huge
/// transaction (it repeats until nothing is left, at most
/// [`RETENTION_ROUNDS_MAX`] times).
const RETENTION_ROWS_PER_ROUND: i64 = 10_000;
/// What one retention round deletes, each at most
/// [`RETENTION_ROWS_PER_ROUND`] rows older than $1: finished jobs (their
/// allocations and steps with them), events, capacity samples.
const EXPIRED: [&str; 3] = [
    "DELETE FROM jobs WHERE job_id IN (SELECT job_id FROM jobs WHERE end_time < $1 LIMIT $2)",
    // (An event is named by its history too: another history's event at
    // the same place is another event.)
    "DELETE FROM events WHERE (history, log_index, ordinal) IN
     (SELECT history, log_index, ordinal FROM events WHERE ingested_at < $1 LIMIT $2)",
    "DELETE FROM capacity WHERE sampled_at IN (SELECT sampled_at FROM capacity WHERE sampled_at < $1 LIMIT $2)",
];
/// Rounds of one retention pass; what is left waits for the next pass.
const RETENTION_ROUNDS_MAX: usize = 100;

/// A job's usage from its record: wall time of its current attempt (without
/// time suspended) and the CPUs, GPUs and memory it held, in CPU- and
/// GPU-seconds. Pure: what `sacct`, `sreport` and `seff` add up.
///
/// A running job's allocation says what it holds; a finished job's is
/// released, so its request times the nodes its last attempt ran on does
/// (an exclusive job's whole nodes count as what it asked for).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Usage {
    pub elapsed_s: i64,
    pub cpus: i64,
    pub gpus: i64,
    pub mem_mb: i64,
    pub cpu_seconds: i64,
    pub gpu_seconds: i64,
}

pub fn usage(j: &pb::Job, now_ms: u64) -> Usage {
    let (cpus, gpus, mem_mb) = if j.allocation.is_empty() {
        let s = j.spec.clone().unwrap_or_default();
        let nodes = j.ran_on.len() as i64;
        let per_node_cpus = s.tasks_per_node.unwrap_or(1).saturating_mul(s.cpus_per_task.unwrap_or(1));
        (
            nodes.saturating_mul(per_node_cpus),
            nodes.saturating_mul(s.gpus_per_node.unwrap_or(0)),
            nodes.saturating_mul(s.mem_per_node_mb.unwrap_or(0)),
        )
    } else {
        (
            j.allocation.iter().map(|a| i64::from(a.cpus)).sum(),
            j.allocation.iter().map(|a| a.gpus.len() as i64).sum(),
            j.allocation.iter().map(|a| i64::try_from(a.mem_mb).unwrap_or(i64::MAX)).fold(0, i64::saturating_add),
        )
    };
    let elapsed_ms = match j.start_time_ms {
        None => 0,
        Some(start) => {
            let end = j.end_time_ms.unwrap_or(now_ms);
            let suspended = j.suspended_ms + j.suspended_at_ms.map_or(0, |at| end.saturating_sub(at));
            end.saturating_sub(start).saturating_sub(suspended)
        }
    };
    let elapsed_s = i64::try_from(elapsed_ms / 1000).unwrap_or(i64::MAX);
    Usage {
        elapsed_s,
        cpus,
        gpus,
        mem_mb,
        cpu_seconds: cpus.saturating_mul(elapsed_s),
        gpu_seconds: gpus.saturating_mul(elapsed_s),
    }
}

/// What the nodes have at one moment, in CPUs and GPUs: all of them, those
/// down (down or drained nodes, quarantined GPUs) and those planned down
/// (pool nodes powered down, or powering up).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct Capacity {
    pub cpus_total: i64,
    pub cpus_down: i64,
    pub cpus_planned_down: i64,
    pub gpus_total: i64,
    pub gpus_down: i64,
    pub gpus_planned_down: i64,
}

/// The cluster's capacity from its node listing. Pure.
pub fn capacity(nodes: &[pb::Node]) -> Capacity {
    let mut c = Capacity::default();
    for n in nodes {
        let (cpus, gpus) = (i64::from(n.cpus), n.gpus.len() as i64);
        let sick = n.gpus.iter().filter(|g| !g.healthy).count() as i64;
        c.cpus_total += cpus;
        c.gpus_total += gpus;
        match pb::NodeState::try_from(n.state).unwrap_or(pb::NodeState::Unspecified) {
            pb::NodeState::Down => {
                c.cpus_down += cpus;
                c.gpus_down += gpus;
            }
            // A draining node's jobs still run on it: what they hold is allocated.
            pb::NodeState::Drain => {
                c.cpus_down += (cpus - i64::from(n.cpus_alloc)).max(0);
                c.gpus_down += n.gpus.iter().filter(|g| !g.allocated && g.allocated_to.is_none()).count() as i64;
            }
            pb::NodeState::PoweredDown | pb::NodeState::PoweringUp => {
                c.cpus_planned_down += cpus;
                c.gpus_planned_down += gpus;
            }
            _ => c.gpus_down += sick,
        }
    }
    c
}

/// The latest time PostgreSQL's timestamps hold comfortably (year 9999):
/// later ones are clamped rather than refused.
const TIME_MS_MAX: u64 = 253_402_300_799_000;

pub fn time(ms: u64) -> SystemTime {
    UNIX_EPOCH + Duration::from_millis(ms.min(TIME_MS_MAX))
}

/// Text as PostgreSQL stores it: it refuses NUL bytes, so they become U+FFFD
/// (a job's fields come from its user; one bad byte must not stop the history).
pub fn text(s: &str) -> String {
    s.replace('\0', "\u{fffd}")
}

/// Whether a database error is about the data (SQLSTATE classes 22 and 23:
/// a value out of range, a constraint): retrying the same batch cannot help.
pub fn is_data_error(e: &anyhow::Error) -> bool {
    e.chain()
        .filter_map(|c| c.downcast_ref::<tokio_postgres::Error>())
        .any(|pe| pe.code().is_some_and(|c| c.code().starts_with("22") || c.code().starts_with("23")))
}

/// The advisory lock only the one writing service holds (others stand by).
const WRITER_LOCK: i64 = 0x6761_6e67_7761_7901;

/// The columns [`job_of_row`] reads, in its order.
pub const JOB_COLUMNS: &str = "job_id, display_id, name, user_name, account, partition, qos, state, reason, \
    exit_code, exit_signal, submit_time, start_time, end_time, time_limit_s, suspended_ms, attempts, \
    nodes_requested, gpus_per_node, gpu_type, mem_per_node_mb, node_list, array_job_id, array_index, work_dir, \
    alloc_cpus, measured_nodes, cpu_used_ms, mem_peak_mb, gpu_util_pct, gpu_mem_peak_mb";

fn ms(t: SystemTime) -> u64 {
    t.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

/// A stored job as the API shows a finished one (its allocation released,
/// the nodes it ran on in `ran_on`; scripts and environments are never stored).
pub fn job_of_row(r: &tokio_postgres::Row) -> pb::Job {
    let state_text: String = r.get(7);
    let ran_on: Vec<String> = r.get(21);
    // The CPUs it held, as a request sacct multiplies back out.
    let cpus_per_node = r.get::<_, i64>(25) / (ran_on.len().max(1) as i64);
    let state = gangway_proto::job_state_named(&state_text).unwrap_or(pb::JobState::Unspecified);
    pb::Job {
        id: r.get::<_, i64>(0) as u64,
        display_id: r.get(1),
        spec: Some(pb::JobSpec {
            name: r.get(2),
            user: r.get(3),
            account: r.get(4),
            partition: r.get(5),
            qos: r.get(6),
            time_limit_s: Some(r.get(14)),
            nodes: Some(r.get(17)),
            gpus_per_node: Some(r.get(18)),
            gpu_type: r.get(19),
            mem_per_node_mb: Some(r.get(20)),
            workdir: r.get(24),
            tasks_per_node: Some(1),
            cpus_per_task: Some(cpus_per_node.max(1)),
            ..Default::default()
        }),
        state: state as i32,
        reason: r.get(8),
        exit_code: r.get(9),
        exit_signal: r.get(10),
        submit_time_ms: ms(r.get(11)),
        start_time_ms: r.get::<_, Option<SystemTime>>(12).map(ms),
        end_time_ms: r.get::<_, Option<SystemTime>>(13).map(ms),
        suspended_ms: r.get::<_, i64>(15).max(0) as u64,
        attempt: r.get::<_, i32>(16).max(0) as u32,
        ran_on,
        array_job_id: r.get::<_, Option<i64>>(22).map(|a| a as u64),
        array_index: r.get::<_, Option<i32>>(23).map(|i| i as u32),
        usage: r.get::<_, Option<i32>>(26).map(|nodes| pb::JobUsage {
            nodes: nodes.max(0) as u32,
            cpu_ms: r.get::<_, Option<i64>>(27).unwrap_or(0).max(0) as u64,
            mem_peak_mb: r.get::<_, Option<i64>>(28).unwrap_or(0).max(0) as u64,
            gpu_util_pct: r.get(29),
            gpu_mem_peak_mb: r.get::<_, Option<i64>>(30).unwrap_or(0).max(0) as u64,
        }),
        ..Default::default()
    }
}

pub struct Store {
    db: tokio_postgres::Client,
    connection: tokio::task::JoinHandle<()>,
}

impl Drop for Store {
    fn drop(&mut self) {
        self.connection.abort();
    }
}

impl Store {
    /// Connects and brings the schema to the newest version.
    pub async fn connect(url: &str) -> anyhow::Result<Store> {
        let (db, tls) = config(url)?;
        let (db, conn) =
            db.connect(tls).await.with_context(|| format!("database: cannot connect to {}", redacted(url)))?;
        let connection = tokio::spawn(async move {
            if let Err(e) = conn.await {
                tracing::warn!(error = %e, "the database connection ended");
            }
        });
        let mut store = Store { db, connection };
        store.migrate().await?;
        Ok(store)
    }

    /// Whether the connection to the database is gone (reconnect).
    pub fn is_closed(&self) -> bool {
        self.db.is_closed()
    }

    /// Waits until this connection is the only writer: a second service
    /// stands by here until the first one's connection ends.
    pub async fn become_writer(&self) -> anyhow::Result<()> {
        self.db.execute("SELECT pg_advisory_lock($1)", &[&WRITER_LOCK]).await.context("database: the writer's lock")?;
        Ok(())
    }

    async fn migrate(&mut self) -> anyhow::Result<()> {
        self.db
            .batch_execute("CREATE TABLE IF NOT EXISTS gangway_schema (version integer NOT NULL)")
            .await
            .context("database: creating gangway_schema")?;
        let newest = MIGRATIONS.last().map_or(0, |m| m.0);
        for (version, sql) in MIGRATIONS {
            let tx = self.db.transaction().await?;
            // One migrator at a time (two accounting services starting together).
            tx.batch_execute("LOCK TABLE gangway_schema IN EXCLUSIVE MODE").await?;
            let have: Option<i32> = tx.query_one("SELECT max(version) FROM gangway_schema", &[]).await?.get(0);
            let have = have.unwrap_or(0);
            if have > newest {
                anyhow::bail!(
                    "database: its schema is version {have}, newer than this build's {newest}; run a newer gangway"
                );
            }
            if have >= *version {
                tx.commit().await?;
                continue;
            }
            tx.batch_execute(sql).await.with_context(|| format!("database: migration {version}"))?;
            tx.execute("INSERT INTO gangway_schema (version) VALUES ($1)", &[version]).await?;
            tx.commit().await?;
            tracing::info!(version, "accounting schema migrated");
        }
        Ok(())
    }

    /// Where ingest stopped, if it ever started.
    pub async fn cursor(&self) -> anyhow::Result<Option<Cursor>> {
        let row = self.db.query_opt("SELECT log_index, delivered, history FROM ingest_cursor", &[]).await?;
        Ok(row.map(|r| Cursor {
            index: u64::try_from(r.get::<_, i64>(0)).unwrap_or(0),
            delivered: usize::try_from(r.get::<_, i32>(1)).unwrap_or(0),
            history: Some(u64::from_ne_bytes(r.get::<_, i64>(2).to_ne_bytes())),
        }))
    }

    /// The cluster's history changed (it was restored from a backup): what
    /// the store holds of jobs is as new as the new history's index `as_of`
    /// at most, so that the new history's records of them win (the job
    /// rows' `last_index` counted in the old one), and what was unstored
    /// of the old one no longer matters (the resync that follows stores
    /// every job the new history holds).
    pub async fn start_history(&mut self, as_of: u64) -> anyhow::Result<()> {
        let as_of = i64::try_from(as_of).unwrap_or(i64::MAX);
        let tx = self.db.transaction().await?;
        tx.execute("UPDATE jobs SET last_index = $1 WHERE last_index > $1", &[&as_of]).await?;
        tx.execute("UPDATE ingest_cursor SET unstored_from = NULL", &[]).await?;
        tx.commit().await?;
        Ok(())
    }

    /// Writes a batch in one transaction: its events (each once, by log
    /// index and place), the jobs they touched as they are now, and the
    /// cursor past the batch (when given). `as_of` is the log index the
    /// jobs are at least as new as.
    pub async fn write(
        &mut self,
        events: &[(pb::ClusterEvent, Cursor)],
        jobs: &[pb::Job],
        as_of: u64,
        cursor: Option<Cursor>,
        now_ms: u64,
    ) -> anyhow::Result<()> {
        let tx = self.db.transaction().await?;
        let insert_event = tx
            .prepare(
                "INSERT INTO events (log_index, ordinal, kind, job_id, state, attempt, node, gpu, reason, step, history)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11) ON CONFLICT DO NOTHING",
            )
            .await?;
        let rows: Vec<[Box<dyn ToSql + Sync + Send>; 11]> = events
            .iter()
            .map(|(e, c)| -> [Box<dyn ToSql + Sync + Send>; 11] {
                [
                    Box::new(e.index as i64),
                    Box::new(c.delivered.saturating_sub(1) as i32),
                    Box::new(text(&e.kind)),
                    Box::new((e.job_id != 0).then_some(e.job_id as i64)),
                    Box::new(if e.job_id != 0 { gangway_proto::job_state_name(e.state) } else { "" }.to_string()),
                    Box::new(e.attempt as i32),
                    Box::new(text(&e.node)),
                    Box::new(e.gpu.map(|g| g as i32)),
                    Box::new(text(&e.reason)),
                    Box::new(e.step.map(|s| s as i32)),
                    Box::new(history_sql(c.history)),
                ]
            })
            .collect();
        // Sent together: the connection pipelines them, one round trip in all.
        let params: Vec<Vec<&(dyn ToSql + Sync)>> =
            rows.iter().map(|r| r.iter().map(|b| b.as_ref() as &(dyn ToSql + Sync)).collect()).collect();
        futures::future::try_join_all(params.iter().map(|p| tx.execute(&insert_event, p))).await?;
        // An older batch replayed after a restart never overwrites a newer record.
        let last_index = i64::try_from(as_of).unwrap_or(i64::MAX);
        for j in jobs {
            upsert_job(&tx, j, last_index, now_ms).await?;
        }
        // A job the state no longer held when read: its last event's state.
        let read: std::collections::BTreeSet<u64> = jobs.iter().map(|j| j.id).collect();
        let mut gone: std::collections::BTreeMap<u64, &pb::ClusterEvent> = Default::default();
        for (e, _) in events.iter().filter(|(e, _)| e.job_id != 0 && e.step.is_none() && !read.contains(&e.job_id)) {
            gone.insert(e.job_id, e);
        }
        for (id, e) in gone {
            tx.execute(
                "UPDATE jobs SET state = $1, last_index = $2 WHERE job_id = $3 AND last_index <= $2",
                &[&gangway_proto::job_state_name(e.state), &(e.index as i64), &(id as i64)],
            )
            .await?;
        }
        if let Some(c) = cursor {
            tx.execute(
                "INSERT INTO ingest_cursor (id, log_index, delivered, history) VALUES (true, $1, $2, $3)
                 ON CONFLICT (id) DO UPDATE SET log_index = EXCLUDED.log_index, delivered = EXCLUDED.delivered,
                 history = EXCLUDED.history, updated_at = now()",
                &[&(c.index as i64), &(c.delivered as i32), &history_sql(c.history)],
            )
            .await?;
        }
        tx.commit().await?;
        Ok(())
    }

    /// Records that jobs of log entries from `index` on may be missing (a
    /// batch the database refused): the cluster is never told they are
    /// stored, so the state keeps them. A complete resync clears it.
    pub async fn mark_unstored(&self, index: u64) -> anyhow::Result<()> {
        let index = i64::try_from(index).unwrap_or(i64::MAX);
        self.db
            .execute("UPDATE ingest_cursor SET unstored_from = LEAST(COALESCE(unstored_from, $1), $1)", &[&index])
            .await?;
        Ok(())
    }

    /// See [`Store::mark_unstored`]; `clear` forgets it (every job the state
    /// holds has just been stored again).
    pub async fn unstored_from(&self, clear: bool) -> anyhow::Result<Option<u64>> {
        if clear {
            self.db.execute("UPDATE ingest_cursor SET unstored_from = NULL", &[]).await?;
            return Ok(None);
        }
        let row = self.db.query_opt("SELECT unstored_from FROM ingest_cursor", &[]).await?;
        Ok(row.and_then(|r| r.get::<_, Option<i64>>(0)).map(|i| i.max(0) as u64))
    }

    /// Stores one capacity sample, covering the `interval_s` that `at` is in
    /// (so a second service sampling the same interval adds nothing).
    pub async fn sample_capacity(&self, at: SystemTime, interval_s: i32, c: &Capacity) -> anyhow::Result<()> {
        let step = u64::try_from(interval_s).unwrap_or(1).max(1);
        let secs = at.duration_since(UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let at = UNIX_EPOCH + Duration::from_secs(secs - secs % step);
        self.db
            .execute(
                "INSERT INTO capacity (sampled_at, interval_s, cpus_total, cpus_down, cpus_planned_down, gpus_total,
                    gpus_down, gpus_planned_down)
                 VALUES ($1, $2, $3, $4, $5, $6, $7, $8) ON CONFLICT DO NOTHING",
                &[
                    &at,
                    &interval_s,
                    &c.cpus_total,
                    &c.cpus_down,
                    &c.cpus_planned_down,
                    &c.gpus_total,
                    &c.gpus_down,
                    &c.gpus_planned_down,
                ],
            )
            .await?;
        Ok(())
    }

    /// Every finished job's charge for fair share (see the core's
    /// `usage_from_runs`) that ended after `since`: its account, end (Unix
    /// ms), and GPU- and CPU-milliseconds.
    pub async fn charged_runs(&self, since: SystemTime) -> anyhow::Result<Vec<(String, u64, u64, u64)>> {
        let rows = self
            .db
            .query(
                "SELECT account, end_time, gpu_seconds, cpu_seconds FROM jobs
                 WHERE end_time IS NOT NULL AND end_time >= $1 AND start_time IS NOT NULL",
                &[&since],
            )
            .await?;
        Ok(rows
            .iter()
            .map(|r| {
                let gpu_ms = (r.get::<_, i64>(2).max(0) as u64).saturating_mul(1000);
                (r.get(0), ms(r.get(1)), gpu_ms, (r.get::<_, i64>(3).max(0) as u64).saturating_mul(1000))
            })
            .collect())
    }

    /// Deletes finished jobs that ended, and events stored, before `before`.
    pub async fn expire(&self, before: SystemTime) -> anyhow::Result<u64> {
        in_rounds(move || async move {
            let mut round = 0;
            for sql in EXPIRED {
                round += self.db.execute(sql, &[&before, &RETENTION_ROWS_PER_ROUND]).await?;
            }
            Ok(round)
        })
        .await
    }
}

/// Runs `round` until one deletes nothing, at most [`RETENTION_ROUNDS_MAX`]
/// times: the rows deleted in all.
async fn in_rounds<F, Fut>(mut round: F) -> anyhow::Result<u64>
where
    F: FnMut() -> Fut,
    Fut: std::future::Future<Output = anyhow::Result<u64>>,
{
    let mut deleted = 0;
    for _ in 0..RETENTION_ROUNDS_MAX {
        let n = round().await?;
        deleted += n;
        if n == 0 {
            break;
        }
    }
    Ok(deleted)
}

async fn upsert_job(
    tx: &tokio_postgres::Transaction<'_>,
    j: &pb::Job,
    last_index: i64,
    now_ms: u64,
) -> anyhow::Result<()> {
    let s = j.spec.clone().unwrap_or_default();
    let u = usage(j, now_ms);
    let id = j.id as i64;
    let display = if j.display_id.is_empty() { j.id.to_string() } else { text(&j.display_id) };
    let (name, user, account, partition, qos) =
        (text(&s.name), text(&s.user), text(&s.account), text(&s.partition), text(&s.qos));
    let (reason, gpu_type, workdir) = (text(&j.reason), text(&s.gpu_type), text(&s.workdir));
    let node_list: Vec<String> = match j.allocation.is_empty() {
        true => j.ran_on.iter().map(|n| text(n)).collect(),
        false => j.allocation.iter().map(|a| text(&a.node)).collect(),
    };
    let measured = j.usage.as_ref();
    let big = |v: u64| i64::try_from(v).unwrap_or(i64::MAX);
    let (measured_nodes, cpu_used_ms, mem_peak_mb, gpu_util_pct, gpu_mem_peak_mb) = (
        measured.map(|u| i32::try_from(u.nodes).unwrap_or(i32::MAX)),
        measured.map(|u| big(u.cpu_ms)),
        measured.map(|u| big(u.mem_peak_mb)),
        measured.and_then(|u| u.gpu_util_pct).filter(|p| p.is_finite()),
        measured.map(|u| big(u.gpu_mem_peak_mb)),
    );
    let params: [&(dyn ToSql + Sync); 37] = [
        &id,
        &display,
        &name,
        &user,
        &account,
        &partition,
        &qos,
        &gangway_proto::job_state_name(j.state).to_string(),
        &reason,
        &j.exit_code,
        &j.exit_signal,
        &time(j.submit_time_ms),
        &j.start_time_ms.map(time),
        &j.end_time_ms.map(time),
        &s.time_limit_s.unwrap_or(86_400),
        &i64::try_from(j.suspended_ms).unwrap_or(i64::MAX),
        &(j.attempt as i32),
        &s.nodes.unwrap_or(1),
        &s.gpus_per_node.unwrap_or(0),
        &gpu_type,
        &s.mem_per_node_mb.unwrap_or(0),
        &node_list,
        &u.cpus,
        &u.gpus,
        &u.mem_mb,
        &u.elapsed_s,
        &u.cpu_seconds,
        &u.gpu_seconds,
        &j.array_job_id.map(|a| a as i64),
        &j.array_index.map(|i| i as i32),
        &workdir,
        &last_index,
        &measured_nodes,
        &cpu_used_ms,
        &mem_peak_mb,
        &gpu_util_pct,
        &gpu_mem_peak_mb,
    ];
    tx.execute(
        "INSERT INTO jobs (job_id, display_id, name, user_name, account, partition, qos, state, reason,
            exit_code, exit_signal, submit_time, start_time, end_time, time_limit_s, suspended_ms, attempts,
            nodes_requested, gpus_per_node, gpu_type, mem_per_node_mb, node_list, alloc_cpus, alloc_gpus,
            alloc_mem_mb, elapsed_s, cpu_seconds, gpu_seconds, array_job_id, array_index, work_dir, last_index,
            measured_nodes, cpu_used_ms, mem_peak_mb, gpu_util_pct, gpu_mem_peak_mb)
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15, $16, $17, $18, $19, $20,
            $21, $22, $23, $24, $25, $26, $27, $28, $29, $30, $31, $32, $33, $34, $35, $36, $37)
         ON CONFLICT (job_id) DO UPDATE SET display_id = EXCLUDED.display_id, name = EXCLUDED.name,
            user_name = EXCLUDED.user_name, account = EXCLUDED.account, partition = EXCLUDED.partition,
            qos = EXCLUDED.qos, state = EXCLUDED.state, reason = EXCLUDED.reason, exit_code = EXCLUDED.exit_code,
            exit_signal = EXCLUDED.exit_signal, submit_time = EXCLUDED.submit_time,
            start_time = EXCLUDED.start_time, end_time = EXCLUDED.end_time,
            time_limit_s = EXCLUDED.time_limit_s, suspended_ms = EXCLUDED.suspended_ms,
            attempts = EXCLUDED.attempts, nodes_requested = EXCLUDED.nodes_requested,
            gpus_per_node = EXCLUDED.gpus_per_node, gpu_type = EXCLUDED.gpu_type,
            mem_per_node_mb = EXCLUDED.mem_per_node_mb, node_list = EXCLUDED.node_list,
            alloc_cpus = EXCLUDED.alloc_cpus, alloc_gpus = EXCLUDED.alloc_gpus,
            alloc_mem_mb = EXCLUDED.alloc_mem_mb, elapsed_s = EXCLUDED.elapsed_s,
            cpu_seconds = EXCLUDED.cpu_seconds, gpu_seconds = EXCLUDED.gpu_seconds,
            array_job_id = EXCLUDED.array_job_id, array_index = EXCLUDED.array_index,
            work_dir = EXCLUDED.work_dir, last_index = EXCLUDED.last_index,
            measured_nodes = EXCLUDED.measured_nodes, cpu_used_ms = EXCLUDED.cpu_used_ms,
            mem_peak_mb = EXCLUDED.mem_peak_mb, gpu_util_pct = EXCLUDED.gpu_util_pct,
            gpu_mem_peak_mb = EXCLUDED.gpu_mem_peak_mb
         WHERE jobs.last_index <= EXCLUDED.last_index",
        &params,
    )
    .await?;
    let attempt = j.attempt as i32;
    for a in &j.allocation {
        let gpus: Vec<i32> = a.gpus.iter().map(|g| *g as i32).collect();
        tx.execute(
            "INSERT INTO allocations (job_id, attempt, node, cpus, mem_mb, gpus) VALUES ($1, $2, $3, $4, $5, $6)
             ON CONFLICT (job_id, attempt, node) DO UPDATE SET cpus = EXCLUDED.cpus, mem_mb = EXCLUDED.mem_mb,
             gpus = EXCLUDED.gpus",
            &[&id, &attempt, &text(&a.node), &(a.cpus as i32), &i64::try_from(a.mem_mb).unwrap_or(i64::MAX), &gpus],
        )
        .await?;
    }
    for st in &j.steps {
        tx.execute(
            "INSERT INTO steps (job_id, attempt, step_id, name, nodes, tasks, start_time, end_time, state,
                exit_code, signal) VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11)
             ON CONFLICT (job_id, attempt, step_id) DO UPDATE SET end_time = EXCLUDED.end_time,
             state = EXCLUDED.state, exit_code = EXCLUDED.exit_code, signal = EXCLUDED.signal",
            &[
                &id,
                &attempt,
                &(st.id as i32),
                &text(&st.name),
                &st.nodes.iter().map(|n| text(n)).collect::<Vec<_>>(),
                &(st.tasks as i32),
                &time(st.start_ms),
                &st.end_ms.map(time),
                &gangway_proto::job_state_name(st.state),
                &st.exit_code,
                &st.signal,
            ],
        )
        .await?;
    }
    Ok(())
}

/// How long connecting to the database may take.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(10);

/// The connection settings of `url`, with a connection timeout.
pub fn config(url: &str) -> anyhow::Result<(tokio_postgres::Config, super::pg_tls::RustlsConnect)> {
    use super::pg_tls;
    let tls = pg_tls::split(url).map_err(|e| anyhow::anyhow!("database: {}: {e}", redacted(url)))?;
    let mut c: tokio_postgres::Config =
        tls.rest.parse().map_err(|e| anyhow::anyhow!("database: {}: {e}", redacted(url)))?;
    c.ssl_mode(pg_tls::ssl_mode(tls.mode));
    c.connect_timeout(CONNECT_TIMEOUT);
    let connector = pg_tls::connector(&tls).map_err(|e| anyhow::anyhow!("database: {}: {e}", redacted(url)))?;
    Ok((c, connector))
}

/// A database URL without its password, for errors and logs.
pub fn redacted(url: &str) -> String {
    if let Some(s) = url.find("://") {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let base = match base.rfind('@') {
            Some(at) if at > s => {
                let user = base[s + 3..at].split(':').next().unwrap_or("");
                format!("{}{user}{}", &base[..s + 3], &base[at..])
            }
            _ => base.to_string(),
        };
        let kept: Vec<&str> = query.split('&').filter(|kv| !kv.is_empty() && !kv.starts_with("password=")).collect();
        return if kept.is_empty() { base } else { format!("{base}?{}", kept.join("&")) };
    }
    // key=value settings: anything after a password is dropped (it may be quoted, with spaces).
    url.split_whitespace().take_while(|kv| !kv.starts_with("password=")).collect::<Vec<_>>().join(" ")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn usage_counts_held_resources_over_the_time_not_suspended() {
        let job = pb::Job {
            start_time_ms: Some(10_000),
            end_time_ms: Some(3_610_000),
            suspended_ms: 600_000,
            allocation: vec![
                pb::NodeAllocation { node: "a".into(), cpus: 8, mem_mb: 1024, gpus: vec![0, 1, 2, 3] },
                pb::NodeAllocation { node: "b".into(), cpus: 8, mem_mb: 1024, gpus: vec![0, 1, 2, 3] },
            ],
            ..Default::default()
        };
        let u = usage(&job, 99_999_999);
        assert_eq!(u.elapsed_s, 3000);
        assert_eq!((u.cpus, u.gpus, u.mem_mb), (16, 8, 2048));
        assert_eq!((u.cpu_seconds, u.gpu_seconds), (48_000, 24_000));
        // Running: until now; suspended now: not counting since then.
        let running = pb::Job { end_time_ms: None, suspended_at_ms: Some(1_010_000), suspended_ms: 0, ..job.clone() };
        assert_eq!(usage(&running, 2_010_000).elapsed_s, 1000);
        assert_eq!(usage(&pb::Job::default(), 5).elapsed_s, 0);
        // Finished: the allocation is released; the request on the nodes it ran on.
        let spec = pb::JobSpec {
            gpus_per_node: Some(4),
            tasks_per_node: Some(2),
            cpus_per_task: Some(3),
            ..Default::default()
        };
        let done =
            pb::Job { allocation: vec![], ran_on: vec!["a".into(), "b".into()], spec: Some(spec), ..job.clone() };
        let u = usage(&done, 0);
        assert_eq!((u.cpus, u.gpus, u.gpu_seconds), (12, 8, 24_000));
    }

    /// A time of TIME_MS_MAX is stored as it is; one past it (and any later)
    /// is clamped to it rather than refused.
    #[test]
    fn times_are_clamped_past_time_ms_max() {
        let max = UNIX_EPOCH + Duration::from_millis(TIME_MS_MAX);
        assert_eq!(time(TIME_MS_MAX), max);
        assert_eq!(ms(time(TIME_MS_MAX)), TIME_MS_MAX);
        assert_eq!(time(TIME_MS_MAX + 1), max);
        assert_eq!(time(u64::MAX), max);
        assert!(time(TIME_MS_MAX - 1) < max);
    }

    /// A retention pass runs RETENTION_ROUNDS_MAX rounds at most: work of
    /// exactly that many is done, one round more is left for the next pass,
    /// and a pass stops at the first round that deletes nothing.
    #[tokio::test]
    async fn a_retention_pass_runs_at_most_retention_rounds_max() {
        use std::cell::Cell;
        for (work, left) in [(3, 0), (RETENTION_ROUNDS_MAX, 0), (RETENTION_ROUNDS_MAX + 1, 1)] {
            let (rounds, calls) = (Cell::new(work), Cell::new(0));
            let deleted = in_rounds(|| {
                calls.set(calls.get() + 1);
                let more = rounds.get() > 0;
                rounds.set(rounds.get() - usize::from(more));
                async move { Ok(u64::from(more) * RETENTION_ROWS_PER_ROUND as u64) }
            })
            .await
            .unwrap();
            assert_eq!((rounds.get(), deleted), (left, (work - left) as u64 * RETENTION_ROWS_PER_ROUND as u64));
            assert_eq!(calls.get(), (work + 1).min(RETENTION_ROUNDS_MAX));
        }
    }

    #[test]
    fn passwords_stay_out_of_messages() {
        assert_eq!(redacted("postgres://acct:s3cret@db:5432/gangway"), "postgres://acct@db:5432/gangway");
        assert_eq!(redacted("host=db user=acct password=s3cret dbname=g"), "host=db user=acct");
        assert_eq!(
            redacted("postgres://db/g?user=a&password=s3cret&sslmode=disable"),
            "postgres://db/g?user=a&sslmode=disable"
        );
        assert_eq!(redacted("host=db password='a b' user=x"), "host=db");
        assert_eq!(text("a\0b"), "a\u{fffd}b");
    }
}
