//! The accounting store in PostgreSQL: its schema and writes (`store.rs`,
//! used by `gangway accounting`), and the replica's read of it
//! ([`History`]): `JobService.History` answers from it for jobs the
//! replicated state no longer holds, with the caller's view applied in the
//! query itself.

pub mod store;

use std::time::{Duration, UNIX_EPOCH};

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

/// The replica's connection to the accounting database, made on first use
/// and again after it breaks.
pub struct History {
    url: String,
    db: tokio::sync::Mutex<Option<(tokio_postgres::Client, tokio::task::JoinHandle<()>)>>,
}

impl History {
    pub fn new(url: String) -> History {
        History { url, db: tokio::sync::Mutex::new(None) }
    }

    /// Finished jobs matching `req` that `scope` may read, newest first.
    pub async fn jobs(&self, req: &pb::HistoryRequest, scope: &Scope) -> Result<Vec<pb::Job>, String> {
        tokio::time::timeout(QUERY_TIMEOUT, self.query(req, scope))
            .await
            .map_err(|_| format!("accounting database: no answer within {} s", QUERY_TIMEOUT.as_secs()))?
    }

    async fn query(&self, req: &pb::HistoryRequest, scope: &Scope) -> Result<Vec<pb::Job>, String> {
        let mut guard = self.db.lock().await;
        if guard.as_ref().is_none_or(|(c, _)| c.is_closed()) {
            let (client, conn) = tokio_postgres::connect(&self.url, tokio_postgres::NoTls)
                .await
                .map_err(|e| format!("accounting database {}: {e}", store::redacted(&self.url)))?;
            let task = tokio::spawn(async move {
                let _ = conn.await;
            });
            if let Some((_, old)) = guard.replace((client, task)) {
                old.abort();
            }
        }
        let (db, _) = guard.as_ref().expect("connected above");
        let (sql, params) = history_sql(req, scope);
        let refs: Vec<&(dyn ToSql + Sync)> = params.iter().map(|p| p.as_ref() as &(dyn ToSql + Sync)).collect();
        let rows = db.query(&sql, &refs).await.map_err(|e| format!("accounting database: {e}"))?;
        Ok(rows.iter().map(store::job_of_row).collect())
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
    for (column, value) in
        [("user_name", &req.user), ("account", &req.account), ("partition", &req.partition), ("name", &req.name)]
    {
        if !value.is_empty() {
            let p = bind(Box::new(value.clone()));
            clauses.push(format!("{column} = {p}"));
        }
    }
    if !req.states.is_empty() {
        let names: Vec<String> = req.states.iter().map(|s| store::state_name(*s)).collect();
        let p = bind(Box::new(names));
        clauses.push(format!("state = ANY({p})"));
    }
    if req.ended_after_ms > 0 {
        let p = bind(Box::new(UNIX_EPOCH + Duration::from_millis(req.ended_after_ms)));
        clauses.push(format!("end_time >= {p}"));
    }
    if req.started_before_ms > 0 {
        let p = bind(Box::new(UNIX_EPOCH + Duration::from_millis(req.started_before_ms)));
        clauses.push(format!("start_time <= {p}"));
    }
    let limit = match req.limit {
        0 => HISTORY_ROWS_DEFAULT,
        n => n.min(HISTORY_ROWS_MAX),
    };
    let limit = bind(Box::new(i64::from(limit)));
    let filter = if clauses.is_empty() { String::new() } else { format!("WHERE {}", clauses.join(" AND ")) };
    (format!("SELECT {} FROM jobs {filter} ORDER BY job_id DESC LIMIT {limit}", store::JOB_COLUMNS), params)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_users_history_query_is_scoped_and_bound() {
        let req = pb::HistoryRequest {
            job_ids: vec![7],
            name: "x'; DROP TABLE jobs; --".into(),
            states: vec![pb::JobState::Failed as i32],
            ended_after_ms: 1,
            limit: 50_000,
            ..Default::default()
        };
        let scope = Scope::Own { user: "alice".into(), accounts: vec!["ml".into()] };
        let (sql, params) = history_sql(&req, &scope);
        assert!(sql.contains("WHERE (user_name = $1 OR account = ANY($2)) AND (job_id = ANY($3)"), "{sql}");
        assert!(
            sql.contains("name = $4") && sql.contains("state = ANY($5)") && sql.contains("end_time >= $6"),
            "{sql}"
        );
        assert!(sql.ends_with("LIMIT $7") && !sql.contains("DROP"), "{sql}");
        assert_eq!(params.len(), 7);
        let (all, p) = history_sql(&pb::HistoryRequest::default(), &Scope::All);
        assert!(!all.contains("WHERE") && p.len() == 1, "{all}");
    }
}
