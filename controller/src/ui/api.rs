//! The console's JSON API: each route is one or a few calls of the gRPC API's
//! own handlers (in-process, as the caller [`Who`] says), and the answer
//! reshaped for the page. No route reads the state directly: what a user may
//! see and do is decided where it is for the CLI.

use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use gangway_proto::v1::admin_service_server::AdminService;
use gangway_proto::v1::job_service_server::JobService;
use gangway_proto::v1::node_service_server::NodeService;
use gangway_proto::v1::{self as pb, update_job_request::Change, JobState, NodeState};
use hyper::{Method, StatusCode};
use serde_json::{json, Value};
use tokio::sync::{OwnedSemaphorePermit, Semaphore};
use tokio_stream::StreamExt;

use super::session::{self, Who};
use super::{answer, error, json as reply, Console, Response};
use crate::api::{admin::AdminApi, jobs::JobApi, nodes::NodeApi};

/// Event streams open at once on one replica (each holds a subscription to
/// the replica's event broadcast); more are refused with 429 and the page
/// falls back to polling.
pub const EVENT_STREAMS_MAX: usize = 64;
/// Events queued for one browser before its stream is dropped (the page
/// reconnects and reloads what it shows).
const EVENT_QUEUE_MAX: usize = 256;
/// A comment on an idle stream this often keeps proxies from closing it and
/// finds browsers that went away.
const EVENT_KEEPALIVE: Duration = Duration::from_secs(15);
/// Active jobs the queue page lists (the API pages by size below this too).
const QUEUE_JOBS_MAX: u32 = 2000;
/// Finished jobs the queue page lists, newest first.
const FINISHED_JOBS_MAX: u32 = 200;
/// Newest job ids the finished list looks at.
const FINISHED_SCAN_IDS: u32 = 1000;
/// Pending jobs whose expected start the queue page asks the scheduler for
/// (each is a scheduling analysis, bounded per replica): the front of the queue.
const ESTIMATES_MAX: usize = 8;
/// Pages of nodes the GPU map reads (each up to the API's response size,
/// thousands of nodes).
const NODE_PAGES_MAX: usize = 8;
/// How long an expected start is reused, for every viewer of the queue.
pub const ESTIMATES_TTL: Duration = Duration::from_secs(10);
/// Expected starts kept at most (more are dropped, oldest first).
const ESTIMATES_CACHED_MAX: usize = 1024;
/// Events of one job its page shows from what the replica still keeps.
const JOB_EVENTS_MAX: usize = 500;
/// Job histories read at once on one replica (each scans the kept events
/// under their lock); more get 429 and the page shows live events only.
pub const JOB_HISTORIES_MAX: usize = 4;
/// How long the backlog of kept events may take to read for a job page.
const JOB_EVENTS_READ: Duration = Duration::from_secs(5);
/// The kept events come in one burst: a pause this long means it is over
/// (what follows are live events, which the page's stream shows).
const JOB_EVENTS_IDLE: Duration = Duration::from_millis(200);

/// Expected starts by job, each with when it was computed.
#[derive(Default)]
pub struct Estimates(std::collections::BTreeMap<u64, (std::time::Instant, Value)>);

/// A failed API call as an HTTP answer with the handler's own message.
fn from_status(s: tonic::Status) -> Response {
    use tonic::Code;
    let code = match s.code() {
        Code::Unauthenticated => StatusCode::UNAUTHORIZED,
        Code::PermissionDenied => StatusCode::FORBIDDEN,
        Code::NotFound => StatusCode::NOT_FOUND,
        Code::InvalidArgument | Code::OutOfRange => StatusCode::BAD_REQUEST,
        Code::FailedPrecondition | Code::Aborted | Code::AlreadyExists => StatusCode::CONFLICT,
        Code::ResourceExhausted => StatusCode::TOO_MANY_REQUESTS,
        Code::Unavailable | Code::DeadlineExceeded => StatusCode::SERVICE_UNAVAILABLE,
        _ => StatusCode::INTERNAL_SERVER_ERROR,
    };
    error(code, s.message())
}

macro_rules! call {
    ($e:expr) => {
        match $e.await {
            Ok(r) => r.into_inner(),
            Err(s) => return from_status(s),
        }
    };
}

pub async fn handle(console: &Console, who: &Who, method: &Method, path: &str, query: &str, body: &Bytes) -> Response {
    let jobs = JobApi { replica: console.replica.clone() };
    match (method, path) {
        (&Method::POST, "/ui/login") => login(console, body),
        (&Method::POST, "/ui/logout") => {
            let mut r = reply(StatusCode::OK, &json!({ "ok": true }));
            set_cookie(&mut r, &session::clear_cookie(console.tls));
            r
        }
        _ if !who.named() => {
            let (login, how) = if console.replica.security.is_insecure() {
                ("user", "log in: this cluster is insecure (--insecure); name yourself as with the CLI's --identity")
            } else {
                (
                    "token",
                    "log in: present a client certificate of the cluster's CA, or a bearer token \
                     (gangway token create)",
                )
            };
            reply(StatusCode::UNAUTHORIZED, &json!({ "error": how, "login": login }))
        }
        (&Method::GET, "/ui/api/whoami") => whoami(console, who),
        (&Method::GET, "/ui/api/cluster") => {
            let admin = AdminApi { replica: console.replica.clone() };
            let s = call!(admin.cluster_status(who.request(pb::ClusterStatusRequest {})));
            reply(
                StatusCode::OK,
                &json!({
                    "leader_id": s.leader_id, "term": s.term, "data_format": s.data_format,
                    "served_by": console.replica.node.status().id,
                    "replicas": s.replicas.iter().map(|r| json!({
                        "id": r.id, "addr": r.addr, "role": r.role, "term": r.term, "voter": r.voter,
                        "last_log_index": r.last_log_index, "applied_index": r.applied_index,
                        "error": r.error, "cert_not_after_unix": r.cert_not_after_unix,
                        "data_format": r.data_format,
                    })).collect::<Vec<_>>(),
                }),
            )
        }
        (&Method::GET, "/ui/api/nodes") => {
            let api = &NodeApi { replica: console.replica.clone() };
            let nodes = read_pages(move |after_name| async move {
                let page = api.list(who.request(pb::ListNodesRequest { stale: true, after_name })).await?.into_inner();
                Ok((page.nodes.iter().map(node_json).collect(), page.next_after_name))
            });
            match nodes.await {
                Ok(nodes) => reply(StatusCode::OK, &json!({ "nodes": nodes, "now_ms": crate::now_ms() })),
                Err(s) => from_status(s),
            }
        }
        (&Method::GET, "/ui/api/jobs") => queue(console, who, &jobs, query == "view=queue").await,
        (&Method::GET, "/ui/api/accounts") => {
            let admin = AdminApi { replica: console.replica.clone() };
            let f = call!(admin.fair_share(who.request(pb::FairShareRequest { stale: true })));
            reply(
                StatusCode::OK,
                &json!({ "accounts": f.accounts.iter().map(|a| json!({
                    "account": a.account, "parent": a.parent, "shares": a.shares, "norm_shares": a.norm_shares,
                    "gpu_hours": a.gpu_hours, "cpu_hours": a.cpu_hours, "norm_usage": a.norm_usage,
                    "factor": a.factor, "running_gpus": a.running_gpus, "running_jobs": a.running_jobs,
                    "pending_jobs": a.pending_jobs,
                })).collect::<Vec<_>>() }),
            )
        }
        (&Method::GET, "/ui/api/events") => events(console, who).await,
        (_, p) if p.starts_with("/ui/api/jobs/") => {
            let rest = &p["/ui/api/jobs/".len()..];
            let (id, action) = rest.split_once('/').unwrap_or((rest, ""));
            let Ok(job_id) = id.parse::<u64>() else {
                return error(StatusCode::BAD_REQUEST, &format!("job id: {id:?} is not a number"));
            };
            match (method, action) {
                (&Method::GET, "events") => job_events(console, who, job_id).await,
                (&Method::GET, "") => {
                    let job = call!(jobs.get(who.request(pb::GetJobRequest { job_id, stale: false })));
                    let explanation = if job.state() == JobState::Pending {
                        match jobs.explain(who.request(pb::ExplainRequest { job_id, stale: true })).await {
                            Ok(e) => explanation_json(&e.into_inner()),
                            Err(s) => json!({ "error": s.message() }),
                        }
                    } else {
                        Value::Null
                    };
                    reply(
                        StatusCode::OK,
                        &json!({ "job": job_json(&job), "explanation": explanation, "now_ms": crate::now_ms() }),
                    )
                }
                (&Method::POST, "cancel") => {
                    let r = call!(jobs.cancel(who.request(pb::CancelRequest { job_id })));
                    reply(StatusCode::OK, &json!({ "job": r.job.as_ref().map(job_json) }))
                }
                (&Method::POST, "hold" | "release") => {
                    let change = if action == "hold" { Change::Hold } else { Change::Release };
                    let j = call!(jobs.update(who.request(pb::UpdateJobRequest {
                        job_id,
                        change: change as i32,
                        ..Default::default()
                    })));
                    reply(StatusCode::OK, &json!({ "job": job_json(&j) }))
                }
                _ => error(StatusCode::NOT_FOUND, &format!("{method} {p}: no such job action (cancel, hold, release)")),
            }
        }
        _ => error(StatusCode::NOT_FOUND, &format!("{method} {path}: no such console call")),
    }
}

/// What up to [`NODE_PAGES_MAX`] pages hold: `page(after)` answers a page
/// and where the next one starts (empty after the last).
async fn read_pages<T, F, Fut>(mut page: F) -> Result<Vec<T>, tonic::Status>
where
    F: FnMut(String) -> Fut,
    Fut: std::future::Future<Output = Result<(Vec<T>, String), tonic::Status>>,
{
    let (mut items, mut after) = (Vec::new(), String::new());
    for _ in 0..NODE_PAGES_MAX {
        let (got, next) = page(after).await?;
        items.extend(got);
        if next.is_empty() {
            break;
        }
        after = next;
    }
    Ok(items)
}

/// A slot of one of the console's bounded readers (event streams, job
/// histories), or a 429 saying how many there may be.
fn slot(slots: &Arc<Semaphore>, busy: impl FnOnce() -> String) -> Result<OwnedSemaphorePermit, Response> {
    slots.clone().try_acquire_owned().map_err(|_| error(StatusCode::TOO_MANY_REQUESTS, &busy()))
}

/// The slots of the event streams one replica serves at once.
pub fn event_stream_slots() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(EVENT_STREAMS_MAX))
}

/// The slots of the job histories one replica reads at once.
pub fn job_history_slots() -> Arc<Semaphore> {
    Arc::new(Semaphore::new(JOB_HISTORIES_MAX))
}

fn stream_slot(streams: &Arc<Semaphore>) -> Result<OwnedSemaphorePermit, Response> {
    slot(streams, || format!("this replica serves {EVENT_STREAMS_MAX} event streams at once"))
}

fn history_slot(histories: &Arc<Semaphore>) -> Result<OwnedSemaphorePermit, Response> {
    slot(histories, || {
        format!("this replica reads {JOB_HISTORIES_MAX} job histories at once; the page shows live events")
    })
}

fn set_cookie(r: &mut Response, cookie: &str) {
    if let Ok(v) = cookie.parse() {
        r.headers_mut().insert(hyper::header::SET_COOKIE, v);
    }
}

/// `{"token": "..."}` on a secure cluster, `{"user": "..."}` on an insecure
/// one: checked now (a clear error at the form), and again by the API on
/// every call.
fn login(console: &Console, body: &Bytes) -> Response {
    let Ok(v) = serde_json::from_slice::<Value>(body) else {
        return error(StatusCode::BAD_REQUEST, "body: must be JSON: {\"token\": \"...\"}");
    };
    let field = |k: &str| v.get(k).and_then(Value::as_str).map(str::trim).unwrap_or("").to_string();
    let (value, user) = if console.replica.security.is_insecure() {
        let user = field("user");
        if let Err(e) = session::valid_name(&user) {
            return error(StatusCode::BAD_REQUEST, &e);
        }
        (user.clone(), user)
    } else {
        let token = field("token");
        if let Err(e) = session::valid_token(&token) {
            return error(StatusCode::BAD_REQUEST, &e);
        }
        let Some(tokens) = console.replica.tokens.as_deref() else {
            return error(
                StatusCode::BAD_REQUEST,
                "token: this cluster accepts no bearer tokens (no --token-public-key); \
                 use a client certificate of the cluster's CA in the browser",
            );
        };
        match tokens.verify(&token) {
            Ok(p) => (token, p.name),
            Err(why) => return error(StatusCode::UNAUTHORIZED, &format!("token: refused: {why}")),
        }
    };
    let mut r = reply(StatusCode::OK, &json!({ "user": user }));
    set_cookie(&mut r, &session::set_cookie(&value, console.tls));
    r
}

fn whoami(console: &Console, who: &Who) -> Response {
    let ctx = match console.replica.ctx(&who.request(())) {
        Ok(c) => c,
        Err(s) => return from_status(s),
    };
    reply(
        StatusCode::OK,
        &json!({
            "identity": ctx.identity,
            "user": ctx.user(),
            "admin": console.replica.is_admin(&ctx),
            "operator": console.replica.is_operator(&ctx),
            "insecure": console.replica.security.is_insecure(),
            "certificate": matches!(who.auth, gangway_proto::tls::PeerAuth::Verified(_)),
            "replica": console.replica.node.status().id,
        }),
    )
}

/// `GET /ui/api/jobs[?view=queue]`: the active jobs; for the queue page
/// also the scheduler's reasons, the newest finished jobs and the front of
/// the queue's expected starts (the other pages only map GPUs to jobs).
async fn queue(console: &Console, who: &Who, jobs: &JobApi, full: bool) -> Response {
    let list = call!(jobs.list(who.request(queue_request(full))));
    let mut out = json!({
        "jobs": list.jobs.iter().map(job_json).collect::<Vec<_>>(),
        "more": list.next_after_id != 0,
        "now_ms": crate::now_ms(),
    });
    if !full {
        return reply(StatusCode::OK, &out);
    }
    let finished = [
        JobState::Completed,
        JobState::Failed,
        JobState::Cancelled,
        JobState::Timeout,
        JobState::NodeFail,
        JobState::Deadline,
    ];
    // The newest ids only (a listing runs oldest first): the id counter is a
    // number, not a job, and the listing still decides what this caller sees.
    let next_id = console.replica.node.state().read().next_job_id;
    let done = call!(jobs.list(who.request(pb::ListJobsRequest {
        states: finished.iter().map(|s| *s as i32).collect(),
        limit: FINISHED_SCAN_IDS,
        after_id: next_id.saturating_sub(u64::from(FINISHED_SCAN_IDS) + 1),
        ..Default::default()
    })));
    let mut estimates = serde_json::Map::new();
    for j in front_of_queue(&list.jobs) {
        // Only jobs this caller's listing showed: a cached estimate is no
        // more than the caller could ask `explain` for.
        let cached = console.estimates.lock().expect("estimates lock").fresh(j.id);
        let v = match cached {
            Some(v) => v,
            None => {
                let Ok(e) = jobs.explain(who.request(pb::ExplainRequest { job_id: j.id, stale: true })).await else {
                    continue;
                };
                let e = e.into_inner();
                let v = json!({ "start_ms": e.estimated_start_ms, "position": e.queue_position });
                console.estimates.lock().expect("estimates lock").keep(j.id, v.clone());
                v
            }
        };
        estimates.insert(j.id.to_string(), v);
    }
    let finished = newest_finished(&done.jobs);
    if let Some(o) = out.as_object_mut() {
        o.insert("finished".into(), Value::Array(finished.into_iter().map(job_json).collect()));
        o.insert("estimates".into(), Value::Object(estimates));
    }
    reply(StatusCode::OK, &out)
}

/// The listing of the queue page's active jobs (or, not `full`, of the
/// other pages' GPU map): at most [`QUEUE_JOBS_MAX`].
fn queue_request(full: bool) -> pb::ListJobsRequest {
    let active = [JobState::Pending, JobState::Running, JobState::Suspended];
    pb::ListJobsRequest {
        states: active.iter().map(|s| *s as i32).collect(),
        limit: QUEUE_JOBS_MAX,
        explain: full,
        ..Default::default()
    }
}

/// The pending jobs whose expected start the queue page shows: the first
/// [`ESTIMATES_MAX`] of the listing.
fn front_of_queue(jobs: &[pb::Job]) -> impl Iterator<Item = &pb::Job> {
    jobs.iter().filter(|j| j.state() == JobState::Pending).take(ESTIMATES_MAX)
}

/// The finished jobs the queue page lists: the newest [`FINISHED_JOBS_MAX`]
/// by end time, newest first.
fn newest_finished(jobs: &[pb::Job]) -> Vec<&pb::Job> {
    let mut finished: Vec<&pb::Job> = jobs.iter().collect();
    finished.sort_by_key(|j| std::cmp::Reverse(j.end_time_ms.unwrap_or(0)));
    finished.truncate(FINISHED_JOBS_MAX as usize);
    finished
}

impl Estimates {
    /// `job`'s expected start, if one younger than [`ESTIMATES_TTL`] is kept.
    fn fresh(&self, job: u64) -> Option<Value> {
        self.0.get(&job).filter(|(at, _)| at.elapsed() < ESTIMATES_TTL).map(|(_, v)| v.clone())
    }

    /// Keeps `job`'s expected start: stale ones go, and at
    /// [`ESTIMATES_CACHED_MAX`] the oldest kept one makes room.
    fn keep(&mut self, job: u64, v: Value) {
        self.0.retain(|_, (at, _)| at.elapsed() < ESTIMATES_TTL);
        if self.0.len() >= ESTIMATES_CACHED_MAX && !self.0.contains_key(&job) {
            if let Some(oldest) = self.0.iter().min_by_key(|(_, (at, _))| *at).map(|(id, _)| *id) {
                self.0.remove(&oldest);
            }
        }
        self.0.insert(job, (std::time::Instant::now(), v));
    }
}

/// Adds `ev` to a job page's events, which keeps the newest [`JOB_EVENTS_MAX`].
fn keep_newest(events: &mut std::collections::VecDeque<Value>, ev: Value) {
    if events.len() == JOB_EVENTS_MAX {
        events.pop_front();
    }
    events.push_back(ev);
}

/// `GET /ui/api/jobs/ID/events`: the job's events this replica still keeps
/// (the API's event stream from the oldest kept, as this caller may see
/// it, read up to what was applied when asked). The page follows later ones
/// on its live stream.
async fn job_events(console: &Console, who: &Who, job_id: u64) -> Response {
    let api = JobApi { replica: console.replica.clone() };
    // Only a job this caller may see is looked for (the answer is theirs).
    call!(api.get(who.request(pb::GetJobRequest { job_id, stale: true })));
    let _permit = match history_slot(&console.histories) {
        Ok(p) => p,
        Err(busy) => return busy,
    };
    let through = console.replica.node.status().applied_index.unwrap_or(0);
    let from = console.replica.node.state().oldest_event_index();
    // This replica's own events, in its own history.
    let history = Some(console.replica.node.state().read().history);
    let mut stream = match api.events(who.request(pb::EventsRequest { from_index: from, job_id, history })).await {
        Ok(s) => s.into_inner(),
        // Forgotten meanwhile (a snapshot replaced them): none to show.
        Err(s) if s.code() == tonic::Code::OutOfRange => {
            return reply(StatusCode::OK, &json!({ "events": [], "through": through }))
        }
        Err(s) => return from_status(s),
    };
    let mut events = std::collections::VecDeque::new();
    let deadline = tokio::time::Instant::now() + JOB_EVENTS_READ;
    loop {
        let until = deadline.min(tokio::time::Instant::now() + JOB_EVENTS_IDLE);
        let Ok(Some(Ok(ev))) = tokio::time::timeout_at(until, stream.next()).await else { break };
        if ev.kind == "stream_start" {
            continue;
        }
        if ev.index > through {
            break;
        }
        if ev.job_id == job_id {
            keep_newest(&mut events, event_json(&ev, None));
        }
        if ev.index == through {
            break;
        }
    }
    reply(StatusCode::OK, &json!({ "events": Vec::from(events), "through": through }))
}

/// `GET /ui/api/events`: the cluster's live events as server-sent events,
/// as the API shows them to this caller (one stream per page; it filters
/// by job itself). The caller is checked again at every keepalive, so an
/// expired or revoked token's stream ends within [`EVENT_KEEPALIVE`].
async fn events(console: &Console, who: &Who) -> Response {
    let permit = match stream_slot(&console.streams) {
        Ok(p) => p,
        Err(busy) => return busy,
    };
    let api = JobApi { replica: console.replica.clone() };
    let stream = call!(api.events(who.request(pb::EventsRequest { from_index: 0, job_id: 0, history: None })));
    let (tx, rx) = tokio::sync::mpsc::channel::<Bytes>(EVENT_QUEUE_MAX);
    let (replica, who) = (console.replica.clone(), who.clone());
    tokio::spawn(async move {
        let _permit = permit;
        pump(stream, tx, move || replica.ctx(&who.request(())).map(|_| ())).await;
    });
    let body = http_body_util::StreamBody::new(
        tokio_stream::wrappers::ReceiverStream::new(rx).map(|b| Ok(hyper::body::Frame::data(b))),
    );
    answer(StatusCode::OK, "text/event-stream", http_body_util::BodyExt::boxed(body))
}

/// Sends `stream`'s events into a browser's queue as server-sent events
/// until the stream ends, the browser goes, `allowed` (asked at every
/// keepalive) refuses the caller, or the browser is [`EVENT_QUEUE_MAX`]
/// frames behind: too slow to take its events, it is dropped and reconnects.
async fn pump<S>(mut stream: S, tx: tokio::sync::mpsc::Sender<Bytes>, allowed: impl Fn() -> Result<(), tonic::Status>)
where
    S: tokio_stream::Stream<Item = Result<pb::ClusterEvent, tonic::Status>> + Unpin,
{
    let mut keepalive = tokio::time::interval(EVENT_KEEPALIVE);
    keepalive.tick().await;
    loop {
        let frame = tokio::select! {
            ev = stream.next() => match ev {
                Some(Ok(ev)) if ev.kind == "stream_start" => continue,
                Some(Ok(ev)) => format!("id: {}\ndata: {}\n\n", ev.index, event_json(&ev, Some(crate::now_ms()))),
                Some(Err(s)) => format!("event: error\ndata: {}\n\n", json!({ "error": s.message() })),
                None => return,
            },
            _ = keepalive.tick() => match allowed() {
                Ok(()) => ": keepalive\n\n".to_string(),
                Err(s) => {
                    let _ = tx.try_send(Bytes::from(format!("event: error\ndata: {}\n\n", json!({ "error": s.message() }))));
                    return;
                }
            },
            _ = tx.closed() => return,
        };
        if tx.try_send(Bytes::from(frame)).is_err() {
            return;
        }
    }
}

fn job_state(s: i32) -> String {
    gangway_proto::job_state_name(s).to_string()
}

pub(super) fn job_json(j: &pb::Job) -> Value {
    let s = j.spec.clone().unwrap_or_default();
    let allocation: Vec<Value> = j
        .allocation
        .iter()
        .map(|a| json!({ "node": a.node, "cpus": a.cpus, "mem_mb": a.mem_mb, "gpus": a.gpus }))
        .collect();
    let steps: Vec<Value> = j
        .steps
        .iter()
        .map(|st| {
            json!({
                "id": st.id, "name": st.name, "nodes": st.nodes, "tasks": st.tasks, "start_ms": st.start_ms,
                "end_ms": st.end_ms, "state": job_state(st.state), "exit_code": st.exit_code, "signal": st.signal,
            })
        })
        .collect();
    let display_id = if j.display_id.is_empty() { j.id.to_string() } else { j.display_id.clone() };
    let mut v = json!({
        "id": j.id, "display_id": display_id, "state": job_state(j.state), "reason": j.reason,
        "attempt": j.attempt, "held": j.held, "submitted_by": j.submitted_by, "submit_time_ms": j.submit_time_ms,
        "start_time_ms": j.start_time_ms, "end_time_ms": j.end_time_ms, "suspended_ms": j.suspended_ms,
        "suspended_at_ms": j.suspended_at_ms, "pending_dependencies": j.pending_dependencies,
        "allocation": allocation, "ran_on": j.ran_on, "exit_code": j.exit_code, "exit_signal": j.exit_signal,
        "preempted": j.preempted, "array_job_id": j.array_job_id, "array_index": j.array_index, "steps": steps,
    });
    let spec = json!({
        "name": s.name, "user": s.user, "account": s.account, "partition": s.partition, "qos": s.qos,
        "time_limit_s": s.time_limit_s.unwrap_or(86_400), "nodes": s.nodes.unwrap_or(1),
        "tasks_per_node": s.tasks_per_node.unwrap_or(1), "cpus_per_task": s.cpus_per_task.unwrap_or(1),
        "gpus_per_node": s.gpus_per_node.unwrap_or(0), "gpu_type": s.gpu_type,
        "mem_per_node_mb": s.mem_per_node_mb.unwrap_or(0), "constraints": s.constraints,
        "command": s.command, "workdir": s.workdir, "output": s.output, "error": s.error,
        "dependency": s.dependency,
    });
    if let (Some(v), Value::Object(spec)) = (v.as_object_mut(), spec) {
        v.extend(spec);
    }
    v
}

fn node_json(n: &pb::Node) -> Value {
    let state = NodeState::try_from(n.state)
        .map(|s| s.as_str_name().trim_start_matches("NODE_STATE_").to_string())
        .unwrap_or_else(|_| "UNKNOWN".into());
    json!({
        "name": n.name, "state": state, "state_reason": n.state_reason, "cpus": n.cpus,
        "cpus_alloc": n.cpus_alloc, "mem_mb": n.mem_mb, "mem_alloc_mb": n.mem_alloc_mb,
        "topology": n.topology, "jobs": n.jobs, "last_heartbeat_age_ms": n.last_heartbeat_age_ms,
        "reservation": n.reservation, "maint": n.maint,
        "gpus": n.gpus.iter().map(|g| json!({
            "index": g.index, "model": g.model, "mem_mb": g.mem_mb, "nvlink_island": g.nvlink_island,
            "healthy": g.healthy, "allocated_to": g.allocated_to,
            "allocated": g.allocated || g.allocated_to.is_some(), "health_reason": g.health_reason,
        })).collect::<Vec<_>>(),
    })
}

fn explanation_json(e: &pb::Explanation) -> Value {
    json!({
        "reason": e.reason, "detail": e.detail, "priority": e.priority,
        "priority_factors": e.priority_factors, "eligible_nodes": e.eligible_nodes,
        "rejections": e.rejections, "queue_position": e.queue_position,
        "estimated_start_ms": e.estimated_start_ms, "start_nodes": e.start_nodes,
    })
}

/// An event; `seen_ms` is when a live one reached this replica (the API's
/// events carry no time), `None` for one read back from the kept ones.
fn event_json(e: &pb::ClusterEvent, seen_ms: Option<u64>) -> Value {
    json!({
        "index": e.index, "kind": e.kind, "job_id": e.job_id, "state": job_state(e.state),
        "attempt": e.attempt, "node": e.node, "gpu": e.gpu, "reason": e.reason, "step": e.step,
        "step_state": if e.step.is_some() { job_state(e.step_state) } else { String::new() },
        "time_ms": seen_ms,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::ui::tests::message;

    /// A browser EVENT_QUEUE_MAX frames behind is still served; one frame
    /// more and its stream is dropped (it reconnects), the frames queued
    /// before kept for it to read.
    #[tokio::test]
    async fn a_browser_too_far_behind_is_dropped_past_event_queue_max() {
        for (events, dropped) in [(EVENT_QUEUE_MAX, false), (EVENT_QUEUE_MAX + 1, true)] {
            let (tx, mut rx) = tokio::sync::mpsc::channel::<Bytes>(EVENT_QUEUE_MAX);
            let live = tokio_stream::iter(
                (1..=events as u64)
                    .map(|index| Ok(pb::ClusterEvent { index, kind: "job".into(), ..Default::default() })),
            )
            .chain(tokio_stream::pending());
            let served = tokio::time::timeout(Duration::from_millis(300), pump(live, tx, || Ok(()))).await;
            assert_eq!(served.is_ok(), dropped, "{events} events unread");
            let mut queued = 0;
            while let Ok(frame) = rx.try_recv() {
                queued += 1;
                assert!(String::from_utf8_lossy(&frame).starts_with(&format!("id: {queued}\n")));
            }
            assert_eq!(queued, EVENT_QUEUE_MAX);
        }
    }
    use gangway_proto::v1::Job;

    // Fields set one by one: a struct literal of a wire job here would read
    // as a conversion outside convert.rs (core.rs's architecture rule).
    #[allow(clippy::field_reassign_with_default)]
    fn job(id: u64, state: JobState, end_time_ms: Option<u64>) -> Job {
        let mut j = pb::Job::default();
        j.id = id;
        j.set_state(state);
        j.end_time_ms = end_time_ms;
        j
    }

    /// EVENT_STREAMS_MAX event streams are served at once; one more is
    /// answered 429 naming the limit, until a stream ends.
    #[tokio::test]
    async fn event_streams_are_bounded_at_event_streams_max() {
        let slots = event_stream_slots();
        let mut held: Vec<_> = (0..EVENT_STREAMS_MAX).filter_map(|_| stream_slot(&slots).ok()).collect();
        assert_eq!(held.len(), EVENT_STREAMS_MAX);
        let Err(r) = stream_slot(&slots) else { panic!("one stream past the limit was served") };
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert_eq!(message(r).await, format!("this replica serves {EVENT_STREAMS_MAX} event streams at once"));
        drop(held.pop());
        assert!(stream_slot(&slots).is_ok(), "an ended stream makes room");
    }

    /// JOB_HISTORIES_MAX job histories are read at once; one more is
    /// answered 429 naming the limit, until a read ends.
    #[tokio::test]
    async fn job_histories_are_bounded_at_job_histories_max() {
        let slots = job_history_slots();
        let mut held: Vec<_> = (0..JOB_HISTORIES_MAX).filter_map(|_| history_slot(&slots).ok()).collect();
        assert_eq!(held.len(), JOB_HISTORIES_MAX);
        let Err(r) = history_slot(&slots) else { panic!("one history past the limit was read") };
        assert_eq!(r.status(), StatusCode::TOO_MANY_REQUESTS);
        assert!(message(r).await.starts_with(&format!("this replica reads {JOB_HISTORIES_MAX} job histories")));
        drop(held.pop());
        assert!(history_slot(&slots).is_ok(), "an ended read makes room");
    }

    /// The queue page lists a queue of QUEUE_JOBS_MAX active jobs whole; of
    /// one more it lists as many and says there are more.
    #[test]
    fn the_queue_page_lists_at_most_queue_jobs_max() {
        use crate::api::jobs::{list_page, tests::state_with_jobs, JobQuery};
        let viewer = crate::api::Viewer::whole_for_tests();
        let q = JobQuery::of(&queue_request(true)).unwrap();
        for (queued, more) in [(QUEUE_JOBS_MAX, false), (QUEUE_JOBS_MAX + 1, true)] {
            let (list, _, _) = list_page(&state_with_jobs(u64::from(queued)), &viewer, &q, &Default::default());
            assert_eq!((list.jobs.len(), list.next_after_id != 0), (QUEUE_JOBS_MAX as usize, more));
        }
    }

    /// The queue page lists FINISHED_JOBS_MAX finished jobs, newest first:
    /// that many are all listed, and of one more the oldest is left out.
    #[test]
    fn the_queue_page_lists_the_newest_finished_jobs_max() {
        let done = |n: u64| (1..=n).map(|i| job(i, JobState::Completed, Some(i * 1000))).collect::<Vec<_>>();
        let max = u64::from(FINISHED_JOBS_MAX);
        let ids = |jobs: &[pb::Job]| newest_finished(jobs).iter().map(|j| j.id).collect::<Vec<_>>();
        assert_eq!(ids(&done(max)), (1..=max).rev().collect::<Vec<_>>());
        assert_eq!(ids(&done(max + 1)), (2..=max + 1).rev().collect::<Vec<_>>());
    }

    /// Expected starts are asked for the first ESTIMATES_MAX pending jobs of
    /// the listing: that many all, of one more not the last.
    #[test]
    fn expected_starts_are_asked_for_at_most_estimates_max_jobs() {
        let queue = |pending: usize| {
            let running = (0..pending).map(|i| job(2 * i as u64, JobState::Running, None));
            let waiting = (0..pending).map(|i| job(2 * i as u64 + 1, JobState::Pending, None));
            running.zip(waiting).flat_map(|(r, p)| [r, p]).collect::<Vec<_>>()
        };
        let asked = |jobs: &[pb::Job]| front_of_queue(jobs).map(|j| j.id).collect::<Vec<_>>();
        let first = (0..ESTIMATES_MAX as u64).map(|i| 2 * i + 1).collect::<Vec<_>>();
        assert_eq!(asked(&queue(ESTIMATES_MAX)), first);
        assert_eq!(asked(&queue(ESTIMATES_MAX + 1)), first);
    }

    /// The GPU map reads NODE_PAGES_MAX pages of nodes: a fleet of that
    /// many pages whole, of one more page not the last.
    #[tokio::test]
    async fn the_gpu_map_reads_at_most_node_pages_max_pages() {
        for pages in [NODE_PAGES_MAX, NODE_PAGES_MAX + 1] {
            let read = read_pages(move |after: String| async move {
                let page = if after.is_empty() { 0 } else { after.parse::<usize>().unwrap() };
                let next = if page + 1 < pages { (page + 1).to_string() } else { String::new() };
                Ok((vec![page], next))
            });
            assert_eq!(read.await.unwrap(), (0..NODE_PAGES_MAX).collect::<Vec<_>>());
        }
    }

    /// ESTIMATES_CACHED_MAX expected starts are kept; one more makes room by
    /// dropping the oldest kept.
    #[test]
    fn expected_starts_kept_are_bounded_at_estimates_cached_max() {
        let mut kept = Estimates::default();
        for id in 0..ESTIMATES_CACHED_MAX as u64 {
            kept.keep(id, json!(id));
        }
        assert_eq!(kept.0.len(), ESTIMATES_CACHED_MAX);
        assert_eq!(kept.fresh(0), Some(json!(0)));
        let one_more = ESTIMATES_CACHED_MAX as u64;
        kept.keep(one_more, json!(one_more));
        assert_eq!(kept.0.len(), ESTIMATES_CACHED_MAX);
        assert_eq!((kept.fresh(0), kept.fresh(1), kept.fresh(one_more)), (None, Some(json!(1)), Some(json!(one_more))));
    }

    /// A job's page shows its newest JOB_EVENTS_MAX events: that many all,
    /// of one more not the oldest.
    #[test]
    fn a_job_page_keeps_the_newest_job_events_max() {
        let mut events = std::collections::VecDeque::new();
        for i in 0..JOB_EVENTS_MAX {
            keep_newest(&mut events, json!(i));
        }
        assert_eq!((events.len(), events.front()), (JOB_EVENTS_MAX, Some(&json!(0))));
        keep_newest(&mut events, json!(JOB_EVENTS_MAX));
        assert_eq!(
            (events.len(), events.front(), events.back()),
            (JOB_EVENTS_MAX, Some(&json!(1)), Some(&json!(JOB_EVENTS_MAX)))
        );
    }
}
