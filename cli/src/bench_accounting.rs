//! `gangway bench accounting`: the accounting store in PostgreSQL, measured.
//!
//! - Ingest: the service's own write path (`Store::write`), batch by batch as
//!   the service writes them (each job's submitted, started and finished
//!   events with its record, 100 jobs a transaction): events per second
//!   into the database. The controllers' side (reading each job) is not in
//!   it; `gangway accounting` against a live cluster adds that.
//! - Queries: the history then filled to `--jobs` (a year of 200 users in
//!   40 accounts), and the replica's history and usage queries (`History`,
//!   what sacct and sreport call) timed: the SQL, the rows and their decoding.
//!
//! It needs an empty database of its own: it fills it.

use std::time::Instant;

use clap::Args;
use gangway_controller::accounting::store::Store;
use gangway_controller::accounting::{History, Scope};
use gangway_proto::events::Cursor;
use gangway_proto::v1 as pb;

/// Jobs per ingest transaction: the service's own bound (`BATCH_JOBS_MAX`).
const JOBS_PER_BATCH: u64 = 100;
/// Jobs inserted per statement while filling the history.
const FILL_CHUNK: u64 = 100_000;
/// Users and accounts of the synthetic history.
const USERS: u64 = 200;
const ACCOUNTS: u64 = 40;
/// How far back the synthetic history goes.
const HISTORY_DAYS: u64 = 365;

#[derive(Args)]
pub struct AccountingBenchArgs {
    /// An empty PostgreSQL database for the benchmark (it fills it).
    #[arg(long)]
    database: String,
    /// Jobs in the history the queries run over.
    #[arg(long, default_value_t = 1_000_000)]
    jobs: u64,
    /// Jobs written through the ingest path (3 events each).
    #[arg(long, default_value_t = 10_000)]
    ingest_jobs: u64,
    /// Times each query runs.
    #[arg(long, default_value_t = 20)]
    runs: usize,
}

fn now_ms() -> u64 {
    crate::output::now_ms()
}

/// Job `id` as the ingest path gets it: finished, on one node, 8 GPUs.
fn synthetic_job(id: u64, now: u64) -> pb::Job {
    pb::Job {
        id,
        display_id: id.to_string(),
        spec: Some(pb::JobSpec {
            name: format!("train-{}", id % 97),
            user: format!("user{}", id % USERS),
            account: format!("account{}", id % ACCOUNTS),
            partition: "gpu".into(),
            qos: "normal".into(),
            nodes: Some(1),
            tasks_per_node: Some(8),
            cpus_per_task: Some(4),
            gpus_per_node: Some(8),
            mem_per_node_mb: Some(512 * 1024),
            time_limit_s: Some(86_400),
            ..Default::default()
        }),
        state: pb::JobState::Completed as i32,
        attempt: 1,
        submit_time_ms: now - 3_600_000,
        start_time_ms: Some(now - 3_000_000),
        end_time_ms: Some(now - 1_000),
        exit_code: Some(0),
        ran_on: vec![format!("gpu-{:05}", id % 10_000)],
        usage: Some(pb::JobUsage {
            nodes: 1,
            cpu_ms: 20_000_000,
            mem_peak_mb: 300_000,
            gpu_util_pct: Some(63.5),
            gpu_mem_peak_mb: 70_000,
        }),
        ..Default::default()
    }
}

fn event(index: u64, job_id: u64, kind: &str, state: pb::JobState) -> (pb::ClusterEvent, Cursor) {
    let e =
        pb::ClusterEvent { index, kind: kind.into(), job_id, state: state as i32, attempt: 1, ..Default::default() };
    (e, Cursor { index, delivered: 1, history: Some(0) })
}

/// The history filled to `total` jobs with ids after `first`, over a year.
const FILL_SQL: &str = "INSERT INTO jobs (job_id, display_id, name, user_name, account, partition, qos, state, \
    reason, exit_code, submit_time, start_time, end_time, time_limit_s, suspended_ms, attempts, nodes_requested, \
    gpus_per_node, gpu_type, mem_per_node_mb, node_list, alloc_cpus, alloc_gpus, alloc_mem_mb, elapsed_s, \
    cpu_seconds, gpu_seconds, work_dir, last_index, measured_nodes, cpu_used_ms, mem_peak_mb, gpu_util_pct, \
    gpu_mem_peak_mb) \
    SELECT i, i::text, 'job-' || (i % 997), 'user' || (i % $3), 'account' || (i % $4), 'gpu', 'normal', \
    (ARRAY['COMPLETED','COMPLETED','COMPLETED','FAILED','CANCELLED','TIMEOUT'])[1 + i % 6], '', (i % 6 = 3)::int, \
    t - interval '10 minutes', t, t + make_interval(secs => e), 86400, 0, 1, n, 8, 'h100-80gb', 524288, \
    ARRAY['gpu-' || lpad((i % 10000)::text, 5, '0')], 32 * n, 8 * n, 524288 * n, e, 32 * n * e, 8 * n * e, \
    '/home/u', i, n, 1000 * 32 * n * e / 2, 200000 * n, 40 + (i % 50), 60000 \
    FROM (SELECT i, now() - make_interval(secs => ($5 - i)::float8 * $6) AS t, 60 + (i * 7919) % 7200 AS e, \
    1 + (i % 8 = 0)::int * 3 AS n FROM generate_series($1::bigint, $2::bigint) AS i) s";

/// p50 and max of `runs` timings (ms).
fn spread(mut t: Vec<f64>) -> (f64, f64) {
    t.sort_by(f64::total_cmp);
    (t[t.len() / 2], t[t.len() - 1])
}

pub async fn run(a: AccountingBenchArgs) -> anyhow::Result<()> {
    let mut store = Store::connect(&a.database).await?;
    let (db, tls) = gangway_controller::accounting::store::config(&a.database)?;
    let (client, conn) = db.connect(tls).await?;
    let _conn = tokio::spawn(conn);
    let have: i64 = client.query_one("SELECT count(*) FROM jobs", &[]).await?.get(0);
    anyhow::ensure!(have == 0, "--database: it holds {have} jobs already; the benchmark needs an empty one");
    println!("# Accounting store (PostgreSQL)\n");
    // Ingest, as the service writes.
    let now = now_ms();
    let started = Instant::now();
    let mut index = 1;
    let mut events_written = 0u64;
    let batches = a.ingest_jobs.div_ceil(JOBS_PER_BATCH);
    for b in 0..batches {
        let ids: Vec<u64> = (b * JOBS_PER_BATCH + 1..=((b + 1) * JOBS_PER_BATCH).min(a.ingest_jobs)).collect();
        let mut events = Vec::with_capacity(ids.len() * 3);
        for id in &ids {
            for (kind, state) in [
                ("submitted", pb::JobState::Pending),
                ("started", pb::JobState::Running),
                ("finished", pb::JobState::Completed),
            ] {
                events.push(event(index, *id, kind, state));
                index += 1;
            }
        }
        let jobs: Vec<pb::Job> = ids.iter().map(|id| synthetic_job(*id, now)).collect();
        let cursor = events.last().map(|(_, c)| *c);
        store.write(&events, &jobs, index, cursor, now).await?;
        events_written += events.len() as u64;
    }
    let secs = started.elapsed().as_secs_f64();
    println!("| ingest | events | jobs | seconds | events/s | jobs/s |\n|---|---:|---:|---:|---:|---:|");
    println!(
        "| the service's transactions ({JOBS_PER_BATCH} jobs, {} events each) | {events_written} | {} | {secs:.1} | {:.0} | {:.0} |\n",
        JOBS_PER_BATCH * 3,
        a.ingest_jobs,
        events_written as f64 / secs,
        a.ingest_jobs as f64 / secs
    );
    // The history, filled to --jobs.
    let fill_started = Instant::now();
    let step_s = (HISTORY_DAYS * 86_400) as f64 / a.jobs.max(1) as f64;
    let mut next = a.ingest_jobs + 1;
    while next <= a.jobs {
        let last = (next + FILL_CHUNK - 1).min(a.jobs);
        let (first, last_i, users, accounts, total) =
            (next as i64, last as i64, USERS as i64, ACCOUNTS as i64, a.jobs as i64);
        let params: [&(dyn tokio_postgres::types::ToSql + Sync); 6] =
            [&first, &last_i, &users, &accounts, &total, &step_s];
        client.execute(FILL_SQL, &params).await?;
        next = last + 1;
    }
    client.batch_execute("ANALYZE jobs").await?;
    let count: i64 = client.query_one("SELECT count(*) FROM jobs", &[]).await?.get(0);
    let size: String = client.query_one("SELECT pg_size_pretty(pg_total_relation_size('jobs'))", &[]).await?.get(0);
    println!("History: {count} jobs ({size} with indexes), filled in {:.0} s.\n", fill_started.elapsed().as_secs_f64());
    // The queries, as a replica runs them.
    let history = History::new(a.database.clone());
    let day = 86_400_000u64;
    let now = now_ms();
    let all = Scope::All;
    let alice = Scope::Own { user: "user7".into(), accounts: vec![] };
    let queries: Vec<(&str, pb::HistoryRequest, &Scope)> = vec![
        ("sacct -j ID (one job)", pb::HistoryRequest { job_ids: vec![a.jobs / 2], ..Default::default() }, &all),
        (
            "sacct -u USER -S now-7days",
            pb::HistoryRequest { users: vec!["user7".into()], ended_after_ms: now - 7 * day, ..Default::default() },
            &all,
        ),
        (
            "sacct (a user, private jobs) -S now-30days",
            pb::HistoryRequest { ended_after_ms: now - 30 * day, ..Default::default() },
            &alice,
        ),
        (
            "sacct -A ACCOUNT -S now-1days",
            pb::HistoryRequest { accounts: vec!["account3".into()], ended_after_ms: now - day, ..Default::default() },
            &all,
        ),
        (
            "sacct -a -S -E (one day, 200 days ago)",
            pb::HistoryRequest {
                ended_after_ms: now - 200 * day,
                started_before_ms: now - 199 * day,
                ..Default::default()
            },
            &all,
        ),
        (
            "sacct -a -s FAILED -S now-7days",
            pb::HistoryRequest {
                states: vec![pb::JobState::Failed as i32],
                ended_after_ms: now - 7 * day,
                ..Default::default()
            },
            &all,
        ),
        ("sacct -a (newest 1,000, no range)", pb::HistoryRequest::default(), &all),
    ];
    println!("| query ({} runs each) | rows | p50 ms | max ms |\n|---|---:|---:|---:|", a.runs);
    for (name, req, scope) in &queries {
        let mut t = Vec::with_capacity(a.runs);
        let mut rows = 0;
        for _ in 0..a.runs {
            let s = Instant::now();
            let jobs = history.jobs(req, scope).await.map_err(|e| anyhow::anyhow!("{name}: {e:?}"))?;
            t.push(s.elapsed().as_secs_f64() * 1000.0);
            rows = jobs.len();
        }
        let (p50, max) = spread(t);
        println!("| {name} | {rows} | {p50:.1} | {max:.1} |");
    }
    let usage: Vec<(&str, pb::UsageRequest)> = vec![
        (
            "sreport cluster AccountUtilizationByUser (a day)",
            pb::UsageRequest { start_ms: now - day, end_ms: now, ..Default::default() },
        ),
        ("sreport (30 days)", pb::UsageRequest { start_ms: now - 30 * day, end_ms: now, ..Default::default() }),
        ("sreport (the whole year)", pb::UsageRequest { start_ms: now - 366 * day, end_ms: now, ..Default::default() }),
        (
            "sreport cluster Utilization (30 days)",
            pb::UsageRequest { start_ms: now - 30 * day, end_ms: now, utilization: true, ..Default::default() },
        ),
    ];
    for (name, req) in &usage {
        let mut t = Vec::with_capacity(a.runs);
        let mut rows = 0;
        for _ in 0..a.runs {
            let s = Instant::now();
            rows = history.usage(req, &all).await.map_err(|e| anyhow::anyhow!("{name}: {e:?}"))?.len();
            if req.utilization {
                history.utilization(req).await.map_err(|e| anyhow::anyhow!("{name}: {e:?}"))?;
                rows = 1;
            }
            t.push(s.elapsed().as_secs_f64() * 1000.0);
        }
        let (p50, max) = spread(t);
        println!("| {name} | {rows} | {p50:.1} | {max:.1} |");
    }
    Ok(())
}
