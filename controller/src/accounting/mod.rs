//! The accounting store in PostgreSQL: its schema and writes (`store.rs`,
//! used by `gangway accounting`), and the replica's read of it
//! ([`History`]): `JobService.History` answers from it for jobs the
//! replicated state no longer holds, with the caller's view applied in the
//! query itself.

pub mod pg_tls;
pub mod store;

use std::time::Duration;

use gangway_proto::v1 as pb;
use tokio_postgres::types::ToSql;

/// How long connecting to the database, or one history query, may take.
const QUERY_TIMEOUT: Duration = Duration::from_secs(10);
/// Rows one history answer holds at most (the API pages by size below).
pub const HISTORY_ROWS_MAX: u32 = 10_000;
/// Rows when the caller names no limit.
const HISTORY_ROWS_DEFAULT: u32 = 1000;

/// Whose jobs a caller may read: everyone's, or one user's plus those of
/// the accounts they coordinate.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Scope {
    All,
    Own { user: String, accounts: Vec<String> },
}

/// History queries one replica runs at once; more are refused
/// (RESOURCE_EXHAUSTED) rather than queued behind a slow scan.
const HISTORY_QUERIES_MAX: usize = 4;

/// The replica's connection to the accounting database, made on first use
/// and again after it breaks or a query times out. Queries share it
/// (pipelined), at most [`HISTORY_QUERIES_MAX`] at once.
pub struct History {
    url: String,
    db: tokio::sync::Mutex<Option<std::sync::Arc<tokio_postgres::Client>>>,
    queries: tokio::sync::Semaphore,
}

/// Why a history query failed: the caller gets the kind, the log the detail
/// (the database's address is the operator's business).
#[derive(Debug)]
pub enum HistoryError {
    Busy,
    Unavailable(String),
}

impl History {
    pub fn new(url: String) -> History {
        History { url, db: tokio::sync::Mutex::new(None), queries: tokio::sync::Semaphore::new(HISTORY_QUERIES_MAX) }
    }

    /// Finished jobs matching `req` that `scope` may read, newest first.
    pub async fn jobs(&self, req: &pb::HistoryRequest, scope: &Scope) -> Result<Vec<pb::Job>, HistoryError> {
        let rows = self.run(history_sql(req, scope)).await?;
        Ok(rows.iter().map(store::job_of_row).collect())
    }

    /// Usage by account and user within `req`'s range, as `scope` may see it.
    pub async fn usage(&self, req: &pb::UsageRequest, scope: &Scope) -> Result<Vec<pb::UsageRow>, HistoryError> {
        let rows = self.run(usage_sql(req, scope)).await?;
        Ok(rows
            .iter()
            .map(|r| pb::UsageRow {
                account: r.get(0),
                user: r.get(1),
                cpu_seconds: r.get(2),
                gpu_seconds: r.get(3),
                jobs: r.get::<_, i64>(4).max(0) as u64,
            })
            .collect())
    }

    /// The cluster's utilization over `req`'s range: the capacity samples
    /// integrated over it, and every job's allocation clipped to it.
    pub async fn utilization(&self, req: &pb::UsageRequest) -> Result<pb::Utilization, HistoryError> {
        let range = || -> Vec<Param> { vec![Box::new(store::time(req.start_ms)), Box::new(store::time(req.end_ms))] };
        let cap = self.run((CAPACITY_SQL.to_string(), range())).await?;
        let alloc = self.run((ALLOCATED_SQL.to_string(), range())).await?;
        let f = |r: &tokio_postgres::Row, i: usize| r.get::<_, Option<f64>>(i).unwrap_or(0.0);
        let (c, a) = (cap.first(), alloc.first());
        Ok(pb::Utilization {
            samples: c.map_or(0, |c| c.get::<_, i64>(0).max(0) as u64),
            cpu_reported: c.map_or(0.0, |c| f(c, 1)),
            cpu_down: c.map_or(0.0, |c| f(c, 2)),
            cpu_planned_down: c.map_or(0.0, |c| f(c, 3)),
            gpu_reported: c.map_or(0.0, |c| f(c, 4)),
            gpu_down: c.map_or(0.0, |c| f(c, 5)),
            gpu_planned_down: c.map_or(0.0, |c| f(c, 6)),
            cpu_allocated: a.map_or(0.0, |a| f(a, 0)),
            gpu_allocated: a.map_or(0.0, |a| f(a, 1)),
        })
    }

    /// Runs one query: at most [`HISTORY_QUERIES_MAX`] at once, each within
    /// [`QUERY_TIMEOUT`].
    async fn run(&self, (sql, params): (String, Vec<Param>)) -> Result<Vec<tokio_postgres::Row>, HistoryError> {
        let Ok(_permit) = self.queries.try_acquire() else { return Err(HistoryError::Busy) };
        let query = async {
            let db = self.client().await?;
            let refs: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p.as_ref() as &(dyn ToSql + Sync)).collect();
            db.query(&sql, &refs).await.map_err(|e| e.to_string())
        };
        match tokio::time::timeout(QUERY_TIMEOUT, query).await {
            Ok(r) => r.map_err(HistoryError::Unavailable),
            Err(_) => {
                // A connection that hangs (a half-open socket) is not used again.
                *self.db.lock().await = None;
                Err(HistoryError::Unavailable(format!("no answer within {} s", QUERY_TIMEOUT.as_secs())))
            }
        }
    }

    async fn client(&self) -> Result<std::sync::Arc<tokio_postgres::Client>, String> {
        let mut slot = self.db.lock().await;
        if let Some(c) = slot.as_ref().filter(|c| !c.is_closed()) {
            return Ok(c.clone());
        }
        let (config, tls) = store::config(&self.url).map_err(|e| e.to_string())?;
        let (client, conn) = config.connect(tls).await.map_err(|e| e.to_string())?;
        tokio::spawn(async move {
            let _ = conn.await;
        });
        // A runaway scan is cut by the server too.
        let timeout = format!("SET statement_timeout = {}", QUERY_TIMEOUT.as_millis());
        client.batch_execute(&timeout).await.map_err(|e| e.to_string())?;
        let client = std::sync::Arc::new(client);
        *slot = Some(client.clone());
        Ok(client)
    }
}

type Param = Box<dyn ToSql + Sync + Send>;

/// The query for `req` within `scope`: every filter a bound parameter.
pub fn history_sql(req: &pb::HistoryRequest, scope: &Scope) -> (String, Vec<Param>) {
    let mut clauses: Vec<String> = Vec::new();
    let mut params: Vec<Param> = Vec::new();
    let mut bind = |p: Param| {
        params.push(p);
        format!("${}", params.len())
    };
    if let Scope::Own { user, accounts } = scope {
        let (u, a) = (bind(Box::new(user.clone())), bind(Box::new(accounts.clone())));
        clauses.push(format!("(user_name = {u} OR account = ANY({a}))"));
    }
    if !req.job_ids.is_empty() {
        let ids: Vec<i64> = req.job_ids.iter().map(|j| i64::try_from(*j).unwrap_or(i64::MAX)).collect();
        let p = bind(Box::new(ids));
        clauses.push(format!("(job_id = ANY({p}) OR array_job_id = ANY({p}))"));
    }
    for (column, values) in
        [("user_name", &req.users), ("account", &req.accounts), ("partition", &req.partitions), ("name", &req.names)]
    {
        if !values.is_empty() {
            let p = bind(Box::new(values.clone()));
            clauses.push(format!("{column} = ANY({p})"));
        }
    }
    if !req.states.is_empty() {
        let names: Vec<String> = req.states.iter().map(|s| gangway_proto::job_state_name(*s).to_string()).collect();
        let p = bind(Box::new(names));
        clauses.push(format!("state = ANY({p})"));
    }
    if req.ended_after_ms > 0 {
        let p = bind(Box::new(store::time(req.ended_after_ms)));
        clauses.push(format!("end_time >= {p}"));
    }
    if req.started_before_ms > 0 {
        let p = bind(Box::new(store::time(req.started_before_ms)));
        clauses.push(format!("COALESCE(start_time, submit_time) <= {p}"));
    }
    if req.before_id > 0 {
        let p = bind(Box::new(i64::try_from(req.before_id).unwrap_or(i64::MAX)));
        clauses.push(format!("job_id < {p}"));
    }
    let limit = match req.limit {
        0 => HISTORY_ROWS_DEFAULT,
        n => n.min(HISTORY_ROWS_MAX),
    };
    let limit = bind(Box::new(i64::from(limit)));
    let filter = if clauses.is_empty() { String::new() } else { format!("WHERE {}", clauses.join(" AND ")) };
    (format!("SELECT {} FROM jobs {filter} ORDER BY job_id DESC LIMIT {limit}", store::JOB_COLUMNS), params)
}

/// Capacity samples integrated over the range $1..$2: each covers its
/// interval from when it was taken (at most an hour, so the index on
/// `sampled_at` bounds the scan).
const CAPACITY_SQL: &str =
    "SELECT count(*) FILTER (WHERE o > 0), sum(cpus_total * o), sum(cpus_down * o), sum(cpus_planned_down * o), \
    sum(gpus_total * o), sum(gpus_down * o), sum(gpus_planned_down * o) FROM \
    (SELECT *, GREATEST(0, EXTRACT(EPOCH FROM LEAST(sampled_at + make_interval(secs => interval_s), $2) \
    - GREATEST(sampled_at, $1)))::float8 AS o FROM capacity \
    WHERE sampled_at < $2 AND sampled_at > $1 - interval '1 hour') t";

/// A job's run reaches past the range's start $1: ended after it, or still
/// running (written so that the indexes on `end_time` and on unfinished
/// jobs find them, not a scan of the whole history).
const RUN_OVERLAPS: &str = "(end_time > $1 OR end_time IS NULL)";

/// CPU- and GPU-seconds every job held within the range $1..$2.
const ALLOCATED_SQL: &str = "SELECT sum(alloc_cpus * secs)::float8, sum(alloc_gpus * secs)::float8 FROM \
    (SELECT alloc_cpus, alloc_gpus, GREATEST(0, EXTRACT(EPOCH FROM LEAST(COALESCE(end_time, now()), $2) \
    - GREATEST(start_time, $1)))::float8 AS secs FROM jobs \
    WHERE start_time IS NOT NULL AND start_time < $2 AND (end_time > $1 OR end_time IS NULL)) t";

/// Rows of one usage answer at most (account and user pairs).
pub const USAGE_ROWS_MAX: i64 = 10_000;

/// The usage query: each job's run clipped to the range, times the CPUs and
/// GPUs it held; every value a bound parameter.
pub fn usage_sql(req: &pb::UsageRequest, scope: &Scope) -> (String, Vec<Param>) {
    let mut params: Vec<Param> = vec![Box::new(store::time(req.start_ms)), Box::new(store::time(req.end_ms))];
    let mut clauses = vec!["start_time IS NOT NULL".to_string(), "start_time < $2".into(), RUN_OVERLAPS.into()];
    let bind = |p: Param, params: &mut Vec<Param>| {
        params.push(p);
        format!("${}", params.len())
    };
    if let Scope::Own { user, accounts } = scope {
        let u = bind(Box::new(user.clone()), &mut params);
        let a = bind(Box::new(accounts.clone()), &mut params);
        clauses.push(format!("(user_name = {u} OR account = ANY({a}))"));
    }
    if !req.accounts.is_empty() {
        let p = bind(Box::new(req.accounts.clone()), &mut params);
        clauses.push(format!("account = ANY({p})"));
    }
    if !req.users.is_empty() {
        let p = bind(Box::new(req.users.clone()), &mut params);
        clauses.push(format!("user_name = ANY({p})"));
    }
    let limit = bind(Box::new(USAGE_ROWS_MAX), &mut params);
    let sql = format!(
        "SELECT account, user_name, sum(alloc_cpus * secs)::float8, sum(alloc_gpus * secs)::float8, count(*) FROM \
         (SELECT account, user_name, alloc_cpus, alloc_gpus, GREATEST(0, EXTRACT(EPOCH FROM \
         LEAST(COALESCE(end_time, now()), $2) - GREATEST(start_time, $1)))::float8 AS secs \
         FROM jobs WHERE {}) t GROUP BY account, user_name ORDER BY account, user_name LIMIT {limit}",
        clauses.join(" AND ")
    );
    (sql, params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_history_query_is_scoped_and_bound() {
        let req = pb::HistoryRequest {
            job_ids: vec![7],
            names: vec!["x'; DROP TABLE jobs; --".into()],
            states: vec![pb::JobState::Failed as i32],
            ended_after_ms: u64::MAX,
            limit: 50_000,
            ..Default::default()
        };
        let scope = Scope::Own { user: "alice".into(), accounts: vec!["ml".into()] };
        let (sql, params) = history_sql(&req, &scope);
        assert!(sql.contains("WHERE (user_name = $1 OR account = ANY($2)) AND (job_id = ANY($3)"), "{sql}");
        assert!(
            sql.contains("name = ANY($4)") && sql.contains("state = ANY($5)") && sql.contains("end_time >= $6"),
            "{sql}"
        );
        assert!(sql.ends_with("LIMIT $7") && !sql.contains("DROP"), "{sql}");
        assert_eq!(params.len(), 7);
        let (all, p) = history_sql(&pb::HistoryRequest::default(), &Scope::All);
        assert!(!all.contains("WHERE") && p.len() == 1, "{all}");
    }

    /// HISTORY_QUERIES_MAX queries run at once: with one fewer running, a
    /// query goes on (to a database this test does not have); with that many
    /// running, one more is refused as busy before it connects.
    #[tokio::test]
    async fn history_queries_run_at_most_history_queries_max_at_once() {
        let history = History::new("bogus=1".into());
        let query = || history.run(("SELECT 1".into(), Vec::new()));
        let running: Vec<_> = (0..HISTORY_QUERIES_MAX - 1).map(|_| history.queries.try_acquire().unwrap()).collect();
        assert!(matches!(query().await, Err(HistoryError::Unavailable(_))));
        let one_more = history.queries.try_acquire().unwrap();
        assert!(matches!(query().await, Err(HistoryError::Busy)));
        drop((running, one_more));
        assert!(matches!(query().await, Err(HistoryError::Unavailable(_))));
    }

    /// A usage answer is limited to USAGE_ROWS_MAX rows: the query's last
    /// parameter, its LIMIT, is that number (PostgreSQL drops row
    /// USAGE_ROWS_MAX + 1 and later; no database here to show it).
    #[test]
    fn a_usage_query_is_limited_to_usage_rows_max() {
        let scope = Scope::Own { user: "alice".into(), accounts: vec!["ml".into()] };
        let (sql, params) = usage_sql(&pb::UsageRequest::default(), &scope);
        assert!(sql.ends_with(&format!("LIMIT ${}", params.len())), "{sql}");
        let mut limit = bytes::BytesMut::new();
        params.last().unwrap().to_sql_checked(&tokio_postgres::types::Type::INT8, &mut limit).unwrap();
        assert_eq!(limit[..], USAGE_ROWS_MAX.to_be_bytes());
    }
}
