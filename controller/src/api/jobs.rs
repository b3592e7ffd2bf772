//! JobService: submit, cancel, get, list and watch jobs.

use std::pin::Pin;
use std::sync::Arc;

use futures::Stream;
use gangway_core::limits::IDEMPOTENCY_KEY_BYTES_MAX;
use gangway_core::{Command, Outcome};
use gangway_proto::v1::job_service_client::JobServiceClient;
use gangway_proto::v1::job_service_server::JobService;
use gangway_proto::v1::*;
use tokio::sync::broadcast::error::RecvError;
use tonic::{Request, Response, Status};

use super::convert::{job_state_to_proto, spec_from_proto, state_from_proto, state_to_proto};
use super::{status_from_spec, unexpected, Read, Routed};
use crate::shared::Replica;

/// Jobs in one List page unless the caller asks for fewer.
const LIST_LIMIT_DEFAULT: u32 = 1000;
/// Largest List page: bounds one response (a job is ~0.5 KiB on the wire).
const LIST_LIMIT_MAX: u32 = 10_000;
/// A replica without the leader's cached pending reasons computes them for a
/// List only up to this queue length (a pass over it takes a few milliseconds).
const EXPLAIN_INLINE_PENDING_MAX: usize = 10_000;

pub struct JobApi {
    pub replica: Arc<Replica>,
}

impl JobApi {
    /// The accounting database `what` reads, if this replica has one.
    fn history(&self, what: &str) -> Result<&crate::accounting::History, Status> {
        self.replica.history.as_ref().ok_or_else(|| {
            Status::failed_precondition(format!(
                "{what}: this replica has no accounting database (gangway controller --accounting-database)"
            ))
        })
    }
}

/// A failed history query as the caller sees it (the detail goes to the log).
fn history_status(what: &str, e: crate::accounting::HistoryError) -> Status {
    match e {
        crate::accounting::HistoryError::Busy => {
            Status::resource_exhausted(format!("{what}: this replica is answering other history queries; retry"))
        }
        crate::accounting::HistoryError::Unavailable(why) => {
            tracing::warn!(error = %why, "{what}: the accounting database did not answer");
            Status::unavailable(format!("{what}: the accounting database did not answer (see the replica's log)"))
        }
    }
}

type WatchStream = Pin<Box<dyn Stream<Item = Result<JobEvent, Status>> + Send>>;

impl JobApi {
    /// What a job's own process records about its job (checkpoints, steps):
    /// the caller must see and own the job, and a job's credential speaks
    /// for its own job only.
    fn require_job_writer(&self, ctx: &super::CallCtx, job_id: u64, what: &str) -> Result<(), Status> {
        self.replica.require_visible(ctx, job_id)?;
        self.replica.require_owner(ctx, job_id, what)?;
        if ctx.via_job.is_some_and(|(job, _)| job != job_id) {
            return Err(Status::permission_denied(format!(
                "permission: a job's credential may {what} for its own job only, not job {job_id}"
            )));
        }
        Ok(())
    }
}

#[tonic::async_trait]
impl JobService for JobApi {
    async fn submit(&self, req: Request<SubmitRequest>) -> Result<Response<SubmitResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        if msg.idempotency_key.len() > IDEMPOTENCY_KEY_BYTES_MAX {
            return Err(Status::invalid_argument(format!(
                "idempotency_key: must be at most {IDEMPOTENCY_KEY_BYTES_MAX} bytes"
            )));
        }
        let Some(pspec) = msg.spec.clone() else {
            return Err(Status::invalid_argument("spec: is required"));
        };
        let user = self.replica.job_user(&ctx, &pspec.user, "submit jobs")?;
        let force_reservation = pspec.force_reservation;
        let spec = spec_from_proto(pspec, &user).map_err(status_from_spec)?;
        self.replica.check_reservation_access(&ctx, &spec, force_reservation)?;
        // Fields a newer data format carries, named while the cluster is older.
        spec.validate_in(self.replica.node.state().read().format).map_err(status_from_spec)?;
        self.replica.hide_dependencies(&ctx, &spec)?;
        if spec.nice < 0 {
            ctx.require_not_job("raise a job's priority (negative nice)")?;
        }
        // A job's credential submits follow-up jobs, but never one pinned to
        // nodes, or kept off all but some: whoever holds a node could
        // otherwise keep minting itself credentials by steering each new job
        // onto that node.
        let steered = |nodelist: &[String], exclude: &[String]| !nodelist.is_empty() || !exclude.is_empty();
        if steered(&spec.nodelist, &spec.exclude) || spec.components.iter().any(|c| steered(&c.nodelist, &c.exclude)) {
            ctx.require_not_job("steer a job to nodes (--nodelist, --exclude)")?;
        }
        let cmd = Command::SubmitJob {
            spec,
            identity: ctx.identity.clone(),
            idempotency_key: msg.idempotency_key.clone(),
            now_ms: crate::now_ms(),
        };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move { JobServiceClient::new(ch).submit(r).await })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::Submitted { job_id, duplicate } => {
                    let count =
                        self.replica.fresh_view().await?.jobs.get(&job_id).and_then(|j| j.array).map_or(1, |a| a.count);
                    metrics::counter!("gangway_jobs_submitted_total").increment(if duplicate {
                        0
                    } else {
                        u64::from(count)
                    });
                    Ok(Response::new(SubmitResponse { job_id, duplicate, count }))
                }
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn cancel(&self, req: Request<CancelRequest>) -> Result<Response<CancelResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        ctx.require_user("cancel jobs")?;
        let msg = req.into_inner();
        let job_id = msg.job_id;
        self.replica.require_visible(&ctx, job_id)?;
        if ctx.via_job.is_some() {
            // Its user's own jobs only (never an admin's reach).
            self.replica.require_owner(&ctx, job_id, "cancel jobs")?;
        }
        let cmd = Command::CancelJob { job_id, identity: ctx.identity.clone(), now_ms: crate::now_ms() };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move { JobServiceClient::new(ch).cancel(r).await })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::Cancelled { .. } => {
                    let viewer = self.replica.viewer(&ctx);
                    let job = self.replica.fresh_view().await?.jobs.get(&job_id).map(|j| viewer.job(j));
                    Ok(Response::new(CancelResponse { job }))
                }
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn get(&self, req: Request<GetJobRequest>) -> Result<Response<Job>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        let job_id = msg.job_id;
        let state = match self
            .replica
            .read_or_forward(&ctx, msg.stale, msg, |ch, r| async move { JobServiceClient::new(ch).get(r).await })
            .await?
        {
            Read::Here(view) => view,
            Read::Forwarded(resp) => return Ok(resp),
        };
        let viewer = self.replica.viewer(&ctx);
        match state.jobs.get(&job_id) {
            Some(job) if !viewer.visible(job) => Err(Status::not_found(format!("job {job_id} does not exist"))),
            Some(job) => {
                let pj = viewer.job(job);
                self.replica.charge_read(&ctx, crate::ratelimit::read_units(1, prost::Message::encoded_len(&pj)));
                Ok(Response::new(pj))
            }
            // With private jobs, a job long gone and another user's read alike.
            None if job_id > 0 && job_id < state.next_job_id && !viewer.private_jobs => {
                Err(Status::not_found(format!("job {job_id} finished long ago and is no longer kept")))
            }
            None => Err(Status::not_found(format!("job {job_id} does not exist"))),
        }
    }

    async fn usage(&self, req: Request<UsageRequest>) -> Result<Response<UsageResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        if msg.end_ms <= msg.start_ms {
            return Err(Status::invalid_argument("end_ms: must be after start_ms"));
        }
        check_names("accounts", &msg.accounts)?;
        check_names("users", &msg.users)?;
        let history = self.history("usage")?;
        // Bounded before any SQL is built, in the pool every analysis shares.
        let _permit = self.replica.analysis_permit(&ctx.identity, "usage")?;
        self.replica.admit_read(&ctx)?;
        let scope = self.replica.viewer(&ctx).history_scope();
        let utilization = match msg.utilization {
            false => None,
            // It counts everyone's jobs.
            true if scope != crate::accounting::Scope::All => {
                return Err(Status::permission_denied(
                    "permission: the cluster's utilization counts every user's jobs; with private jobs only \
                     operators and admins see it",
                ))
            }
            true => Some(history.utilization(&msg).await.map_err(|e| history_status("usage", e))?),
        };
        let rows = history.usage(&msg, &scope).await.map_err(|e| history_status("usage", e))?;
        self.replica.charge_read(&ctx, crate::ratelimit::read_units(rows.len(), 0));
        Ok(Response::new(UsageResponse { rows, utilization }))
    }

    async fn history(&self, req: Request<HistoryRequest>) -> Result<Response<ListJobsResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        check_history_filters(&msg)?;
        let history = self.history("history")?;
        // Bounded before any SQL is built, in the pool every analysis shares.
        let _permit = self.replica.analysis_permit(&ctx.identity, "history")?;
        self.replica.admit_read(&ctx)?;
        let viewer = self.replica.viewer(&ctx);
        let scope = viewer.history_scope();
        let jobs = history.jobs(&msg, &scope).await.map_err(|e| history_status("history", e))?;
        // Paged by size like a listing: the answer stays under every client's limit.
        let mut out = Vec::with_capacity(jobs.len());
        let mut budget = gangway_proto::limits::PageBudget::list();
        let mut next_after_id = 0;
        for mut j in jobs {
            j.reason = viewer.reason(&j.reason);
            if !budget.take(prost::Message::encoded_len(&j)) {
                next_after_id = j.id;
                break;
            }
            out.push(j);
        }
        self.replica.charge_read(&ctx, crate::ratelimit::read_units(out.len(), budget.used()));
        Ok(Response::new(ListJobsResponse { jobs: out, next_after_id }))
    }

    async fn list(&self, req: Request<ListJobsRequest>) -> Result<Response<ListJobsResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        let query = JobQuery::of(&msg)?;
        let state = match self
            .replica
            .read_or_forward(&ctx, msg.stale, msg, |ch, r| async move { JobServiceClient::new(ch).list(r).await })
            .await?
        {
            Read::Here(view) => view,
            Read::Forwarded(resp) => return Ok(resp),
        };
        let viewer = self.replica.viewer(&ctx);
        // Pending reasons: the leader's last scheduling pass; a replica that has
        // none (a follower serving a stale read) runs a pass itself when the
        // queue is short enough for that to be cheap and an analysis permit
        // is free (otherwise the stored reasons stand).
        let cached = if query.explain { self.replica.pending_reasons() } else { Default::default() };
        let inline = explains_inline(query.explain, cached.is_empty(), state.pending.len());
        let permit = if inline { self.replica.analysis_permit(&ctx.identity, "list").ok() } else { None };
        let pass = permit.is_some();
        drop(state);
        let resp = self
            .replica
            .on_read_lane(&ctx, "list", permit, move |state| {
                let reasons = if pass {
                    let opts = gangway_core::sched::Options::new(gangway_core::sched::Policy::Easy, crate::now_ms());
                    Arc::new(gangway_core::sched::plan(state, &opts).reasons.into_iter().collect())
                } else {
                    cached
                };
                let (resp, examined, bytes) = list_page(state, &viewer, &query, &reasons);
                let pass_units = if pass { state.pending.len().saturating_mul(EXPLAIN_UNITS_PER_JOB) } else { 0 };
                (resp, crate::ratelimit::read_units(examined.saturating_add(pass_units), bytes))
            })
            .await?;
        Ok(Response::new(resp))
    }

    async fn update(&self, req: Request<UpdateJobRequest>) -> Result<Response<Job>, Status> {
        use gangway_core::command::JobChange;
        use update_job_request::Change;
        let ctx = self.replica.ctx(&req)?;
        ctx.require_user("change jobs")?;
        ctx.require_not_job("change jobs")?;
        let msg = req.into_inner();
        let job_id = msg.job_id;
        self.replica.require_visible(&ctx, job_id)?;
        let value = msg.value;
        let int = |what: &str, min: i64, max: i64| -> Result<i64, Status> {
            if value < min || value > max {
                return Err(Status::invalid_argument(format!(
                    "value: {what} must be between {min} and {max}, got {value}"
                )));
            }
            Ok(value)
        };
        let change = match Change::try_from(msg.change).unwrap_or(Change::Unspecified) {
            Change::Unspecified => return Err(Status::invalid_argument("change: say what to change")),
            Change::Hold => JobChange::Hold { admin: false },
            Change::AdminHold => JobChange::Hold { admin: true },
            Change::Release => JobChange::Release,
            Change::SetPriority => JobChange::SetPriority(Some(narrow(int("priority", 0, i64::from(u32::MAX))?)?)),
            Change::ClearPriority => JobChange::SetPriority(None),
            Change::SetNice => {
                let max = i64::from(gangway_core::limits::NICE_MAX);
                JobChange::SetNice(narrow(int("nice", max.saturating_neg(), max)?)?)
            }
            Change::Requeue => JobChange::Requeue { hold: false },
            Change::RequeueHold => JobChange::Requeue { hold: true },
            Change::SetTimeLimit => {
                JobChange::SetTimeLimit(int("time limit", 1, gangway_core::limits::TIME_LIMIT_S_MAX as i64)? as u64)
            }
            Change::Suspend => JobChange::Suspend,
            Change::Resume => JobChange::Resume,
            Change::Signal => {
                use gangway_core::command::SignalTarget;
                let max = i64::from(gangway_core::limits::SIGNAL_SEND_MAX);
                let target = match gangway_proto::v1::SignalTarget::try_from(msg.signal_target) {
                    Ok(gangway_proto::v1::SignalTarget::Steps) => SignalTarget::Steps,
                    Ok(gangway_proto::v1::SignalTarget::Batch) => SignalTarget::Batch,
                    Ok(gangway_proto::v1::SignalTarget::Full) => SignalTarget::Full,
                    Err(_) => return Err(Status::invalid_argument("signal_target: not a target")),
                };
                JobChange::Signal { signal: narrow(int("signal", 1, max)?)?, target }
            }
        };
        let cmd = Command::UpdateJob { job_id, change, identity: ctx.identity.clone(), now_ms: crate::now_ms() };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move { JobServiceClient::new(ch).update(r).await })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::JobUpdated { .. } => {
                    // As the caller may see it: operators and coordinators
                    // change others' jobs without reading their secrets.
                    let viewer = self.replica.viewer(&ctx);
                    let state = self.replica.fresh_view().await?;
                    let job =
                        state.jobs.get(&job_id).ok_or_else(|| Status::not_found(format!("job {job_id} is gone")))?;
                    Ok(Response::new(viewer.job(job)))
                }
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn explain(&self, req: Request<ExplainRequest>) -> Result<Response<Explanation>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        let job_id = msg.job_id;
        self.replica.require_visible(&ctx, job_id)?;
        let state = match self
            .replica
            .read_or_forward(&ctx, msg.stale, msg, |ch, r| async move { JobServiceClient::new(ch).explain(r).await })
            .await?
        {
            Read::Here(view) => view,
            Read::Forwarded(resp) => return Ok(resp),
        };
        // A full scheduling pass: on the read lane, a few at a time (the
        // replica that runs it takes the permit, not one that forwards).
        let permit = self.replica.analysis_permit(&ctx.identity, "explain")?;
        let now = crate::now_ms();
        drop(state);
        let e = self
            .replica
            .on_read_lane(&ctx, "explain", permit, move |state| {
                (gangway_core::sched::explain(state, job_id, now), analysis_units(state))
            })
            .await?;
        let e = e.ok_or_else(|| Status::not_found(format!("job {job_id} does not exist")))?;
        Ok(Response::new(explanation_to_proto(e)))
    }

    async fn test_submit(&self, req: Request<SubmitRequest>) -> Result<Response<Explanation>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        let Some(pspec) = msg.spec else {
            return Err(Status::invalid_argument("spec: is required"));
        };
        let user = self.replica.job_user(&ctx, &pspec.user, "test submissions")?;
        let force_reservation = pspec.force_reservation;
        let spec = spec_from_proto(pspec, &user).map_err(status_from_spec)?;
        self.replica.check_reservation_access(&ctx, &spec, force_reservation)?;
        self.replica.hide_dependencies(&ctx, &spec)?;
        if spec.nice < 0 {
            ctx.require_not_job("raise a job's priority (negative nice)")?;
        }
        let permit = self.replica.analysis_permit(&ctx.identity, "test-only")?;
        self.replica.admit_read(&ctx)?;
        let now = crate::now_ms();
        let identity = ctx.identity.clone();
        // Every check a submission meets in the log, then one scheduling pass
        // with the would-be job as if pending: no copy of the state, one pass
        // over a view like an explain (and the leader's own passes). On the
        // read lane; bounded by the analysis permits.
        let answer = self
            .replica
            .on_read_lane(&ctx, "test-only", permit, move |state| {
                let answer = match state.prepare_submission(u64::MAX / 2, &spec, &identity) {
                    Ok(mut jobs) => match jobs.first_mut() {
                        Some(job) => {
                            state.settle_hypothetical(job);
                            Ok(gangway_core::sched::explain_submission(state, job, now))
                        }
                        None => Err(Status::internal("test-only: the submission makes no job")),
                    },
                    Err(applied) => match applied.outcome {
                        Outcome::Refused(r) => Err(super::status_from_refusal(&r)),
                        other => Err(unexpected(&other)),
                    },
                };
                (answer, analysis_units(state))
            })
            .await??;
        Ok(Response::new(explanation_to_proto(answer)))
    }

    async fn checkpoint(&self, req: Request<CheckpointRequest>) -> Result<Response<CheckpointResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        self.require_job_writer(&ctx, msg.job_id, "record checkpoints")?;
        let cmd = Command::JobCheckpointed { job_id: msg.job_id, attempt: msg.attempt, now_ms: crate::now_ms() };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move { JobServiceClient::new(ch).checkpoint(r).await })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::CheckpointRecorded { .. } => Ok(Response::new(CheckpointResponse {})),
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn begin_step(&self, req: Request<BeginStepRequest>) -> Result<Response<BeginStepResponse>, Status> {
        use gangway_core::limits::{NAME_BYTES_MAX, STEP_NAME_BYTES_MAX, STEP_NODES_LISTED_MAX};
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        self.require_job_writer(&ctx, msg.job_id, "record steps")?;
        // Bounded here, before anything is proposed (apply checks them again).
        if msg.name.len() > STEP_NAME_BYTES_MAX || msg.name.chars().any(char::is_control) {
            return Err(Status::invalid_argument(format!(
                "name: at most {STEP_NAME_BYTES_MAX} bytes, without control characters"
            )));
        }
        if msg.nodes.len() > STEP_NODES_LISTED_MAX || msg.nodes.iter().any(|n| n.len() > NAME_BYTES_MAX) {
            return Err(Status::invalid_argument(format!(
                "nodes: at most {STEP_NODES_LISTED_MAX} names of at most {NAME_BYTES_MAX} bytes (none: every node)"
            )));
        }
        let cmd = Command::StepStarted {
            job_id: msg.job_id,
            attempt: msg.attempt,
            name: msg.name.clone(),
            nodes: msg.nodes.clone(),
            tasks: msg.tasks,
            now_ms: crate::now_ms(),
        };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move { JobServiceClient::new(ch).begin_step(r).await })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::StepStarted { step_id, .. } => Ok(Response::new(BeginStepResponse { step_id })),
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn end_step(&self, req: Request<EndStepRequest>) -> Result<Response<EndStepResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        self.require_job_writer(&ctx, msg.job_id, "record steps")?;
        gangway_core::limits::check_task_exit(msg.exit_code, msg.signal, "").map_err(status_from_spec)?;
        let cmd = Command::StepEnded {
            job_id: msg.job_id,
            attempt: msg.attempt,
            step_id: msg.step_id,
            exit_code: msg.exit_code,
            signal: msg.signal,
            now_ms: crate::now_ms(),
        };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move { JobServiceClient::new(ch).end_step(r).await })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::StepEnded { .. } => Ok(Response::new(EndStepResponse {})),
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn step_credential(
        &self,
        req: Request<StepCredentialRequest>,
    ) -> Result<Response<StepCredentialResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        ctx.require_user("get step credentials")?;
        ctx.require_not_job("get step credentials")?;
        let msg = req.into_inner();
        let job_id = msg.job_id;
        self.replica.require_visible(&ctx, job_id)?;
        // Only the leader signs step credentials (as it does in launch
        // orders): a follower's key, or one whose replica has since left,
        // never made a credential that is in use.
        if !self.replica.node.is_leader() {
            let leader = self.replica.node.remote_leader();
            return self
                .replica
                .forward(&ctx, leader, msg, |ch, r| async move { JobServiceClient::new(ch).step_credential(r).await })
                .await;
        }
        let state = match self
            .replica
            .read_or_forward(
                &ctx,
                false,
                msg,
                |ch, r| async move { JobServiceClient::new(ch).step_credential(r).await },
            )
            .await?
        {
            Read::Here(view) => view,
            Read::Forwarded(resp) => return Ok(resp),
        };
        // Its owner only, checked on the very job the credential is made for:
        // a credential runs commands as the job's user, which no admin may.
        let (job, owner) = {
            let job = state
                .jobs
                .get(&job_id)
                .cloned()
                .ok_or_else(|| Status::not_found(format!("job {job_id} does not exist")))?;
            let owner = super::caller_owns(&state, &ctx, &job);
            (job, owner)
        };
        if !owner {
            return Err(super::denied(
                &ctx,
                "get step credentials",
                format!("{} does not own job {job_id}; only its owner gets its step credentials", ctx.identity),
            ));
        }
        if job.state != gangway_core::JobState::Running {
            return Err(Status::failed_precondition(format!("job {job_id} is not running: it has no nodes for steps")));
        }
        if job.is_suspended() {
            return Err(Status::failed_precondition(format!(
                "job {job_id} is suspended: its steps wait for `scontrol resume {job_id}`"
            )));
        }
        let credential = self.replica.step_credential(&job)?;
        Ok(Response::new(StepCredentialResponse { credential, attempt: job.attempt }))
    }

    type WatchStream = WatchStream;
    type EventsStream = Pin<Box<dyn Stream<Item = Result<ClusterEvent, Status>> + Send>>;

    async fn events(&self, req: Request<EventsRequest>) -> Result<Response<Self::EventsStream>, Status> {
        let ctx = self.replica.ctx(&req)?;
        ctx.require_known()?;
        let auth = self.replica.stream_auth(&req, false);
        let slot = self.replica.streams.take(&ctx.identity)?;
        self.replica.admit_read(&ctx)?;
        let shown = Shown::new(&self.replica, &ctx);
        let msg = req.into_inner();
        let (from, only) = (msg.from_index, msg.job_id);
        let wanted =
            move |ev: &gangway_core::Event| only == 0 || matches!(ev, gangway_core::Event::Job(j) if j.job_id == only);
        let shared = self.replica.node.state().clone();
        // Subscribe before reading what is kept, so nothing falls in between.
        let mut rx = shared.subscribe();
        let snapshots = shared.snapshots_installed();
        let start = self.replica.node.status().applied_index.unwrap_or(0);
        let history = super::settled_history(&shared.read())?;
        // (A caller that names no history counts in the first one, 0: a
        // client from before histories, after a restore, is refused too.)
        if let Some(theirs) = Some(msg.history.unwrap_or(0)).filter(|h| from > 0 && *h != history) {
            return Err(Status::out_of_range(format!(
                "history: from_index {from} counts in cluster history {theirs}, and this cluster's history is \
                 {history} (it was restored from a backup since): its indexes name other events; read the \
                 current state (gangway queue --all) and follow from now"
            )));
        }
        if from > 0 && from < shared.oldest_event_index() {
            let oldest = shared.oldest_event_index();
            return Err(Status::out_of_range(format!(
                "from_index: events before index {oldest} are no longer kept on this replica; \
                 read the current state (gangway queue --all) and follow from {oldest}"
            )));
        }
        let closed = self.replica.closed();
        let replica = self.replica.clone();
        let stream = async_stream(move |tx| async move {
            let _slot = slot;
            let first = ClusterEvent {
                index: if from > 0 { from.saturating_sub(1) } else { start },
                kind: "stream_start".into(),
                history,
                ..Default::default()
            };
            if tx.send(Ok(first)).await.is_err() {
                return;
            }
            // What is kept from `from` on, page by page: the ring's lock is
            // held to take references to a page, never to copy it, and each
            // page is charged to the caller's read budget (a caller past it
            // waits for it to refill, not everyone else).
            let mut next = from;
            let mut seen_through = from.saturating_sub(1);
            // (From 0: live events only.)
            let mut replaying = from > 0;
            while replaying {
                // Each page waits for the caller's budget first: a caller
                // with many streams replays at its budget's pace, together
                // (and one whose client went away gives its slot back now).
                let budget = tokio::select! {
                    b = replica.wait_for_read_budget(&shown.ctx) => b,
                    _ = tx.closed() => return,
                };
                if let Err(s) = budget {
                    let _ = tx.send(Err(s)).await;
                    return;
                }
                let page = match shared.replay_page(next) {
                    Ok(page) if page.is_empty() => break,
                    Ok(page) => page,
                    Err(oldest) => {
                        let _ = tx
                            .send(Err(Status::out_of_range(format!(
                                "from_index: events before index {oldest} are no longer kept on this replica"
                            ))))
                            .await;
                        return;
                    }
                };
                let mut replayed = 0usize;
                for ev in page.iter().flat_map(|c| c.iter()).filter(|e| e.index() >= next) {
                    replayed = replayed.saturating_add(1);
                    seen_through = ev.index();
                    if !wanted(ev) || !shown.event(ev).await {
                        continue;
                    }
                    let mut ev = cluster_event(ev.clone());
                    ev.reason = shown.reason(ev.reason);
                    if tx.send(Ok(ev)).await.is_err() {
                        return;
                    }
                }
                replaying = replayed > 0;
                next = seen_through.saturating_add(1);
                replica.charge_read(
                    &shown.ctx,
                    crate::ratelimit::read_units(replayed.saturating_mul(EVENT_REPLAY_UNITS), 0),
                );
                if let Err(s) = replica.still_allowed(&shown.ctx, &auth) {
                    let _ = tx.send(Err(s)).await;
                    return;
                }
            }
            let closed = closed;
            tokio::pin!(closed);
            let mut recheck = tokio::time::interval(STREAM_RECHECK_INTERVAL);
            recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let got = tokio::select! {
                    got = rx.recv() => got,
                    // The caller went away: its slot goes back now, not at
                    // the next event.
                    _ = tx.closed() => return,
                    _ = recheck.tick() => {
                        if let Err(s) = replica.still_allowed(&shown.ctx, &auth) {
                            let _ = tx.send(Err(s)).await;
                            return;
                        }
                        continue;
                    }
                    _ = &mut closed => {
                        let _ = tx.send(Err(Status::unavailable("this replica is shutting down; resume on another"))).await;
                        return;
                    }
                };
                // A snapshot replaced the state: the events it covered were
                // never broadcast here. End the stream; the follower resumes
                // from its last index (on a replica that still has them).
                if shared.snapshots_installed() != snapshots {
                    let _ = tx
                        .send(Err(Status::unavailable(
                            "this replica loaded a snapshot; resume from the last index seen",
                        )))
                        .await;
                    return;
                }
                match got {
                    Ok(ev) if from > 0 && ev.index() <= seen_through => continue,
                    Ok(ev) if !wanted(&ev) => continue,
                    Ok(ev) if !shown.event(&ev).await => continue,
                    Ok(ev) => {
                        let mut ev = cluster_event(ev);
                        ev.reason = shown.reason(ev.reason);
                        if tx.send(Ok(ev)).await.is_err() {
                            return; // the client went away
                        }
                    }
                    Err(RecvError::Lagged(n)) => {
                        let _ = tx
                            .send(Err(Status::resource_exhausted(format!(
                                "the stream fell {n} events behind and was dropped; resume from the last index seen"
                            ))))
                            .await;
                        return;
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(stream))
    }

    async fn watch(&self, req: Request<WatchRequest>) -> Result<Response<WatchStream>, Status> {
        let ctx = self.replica.ctx(&req)?;
        ctx.require_known()?;
        let auth = self.replica.stream_auth(&req, false);
        let slot = self.replica.streams.take(&ctx.identity)?;
        // Opening a stream is a read like any other.
        self.replica.admit_read(&ctx)?;
        let shown = Shown::new(&self.replica, &ctx);
        let filter = req.into_inner().job_id;
        let mut rx = self.replica.node.state().subscribe();
        let closed = self.replica.closed();
        let replica = self.replica.clone();
        let stream = async_stream(move |tx| async move {
            let _slot = slot;
            tokio::pin!(closed);
            let mut recheck = tokio::time::interval(STREAM_RECHECK_INTERVAL);
            recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let got = tokio::select! {
                    got = rx.recv() => got,
                    // The caller went away: its slot goes back now, not at
                    // the next event.
                    _ = tx.closed() => return,
                    _ = recheck.tick() => {
                        if let Err(s) = replica.still_allowed(&shown.ctx, &auth) {
                            let _ = tx.send(Err(s)).await;
                            return;
                        }
                        continue;
                    }
                    _ = &mut closed => {
                        let _ = tx.send(Err(Status::unavailable("this replica is shutting down; watch another"))).await;
                        return;
                    }
                };
                match got {
                    Ok(gangway_core::Event::Node { .. }) => continue,
                    Ok(gangway_core::Event::Job(ev)) => {
                        // Watchers follow jobs' states; steps and late usage are in
                        // the event stream (Events).
                        if filter != 0 && ev.job_id != filter || ev.step.is_some() || ev.usage {
                            continue;
                        }
                        if !shown.job(ev.job_id, ev.index).await {
                            continue;
                        }
                        let msg = JobEvent {
                            index: ev.index,
                            job_id: ev.job_id,
                            state: event_state(&ev) as i32,
                            attempt: ev.attempt,
                            reason: shown.reason(ev.reason),
                        };
                        if tx.send(Ok(msg)).await.is_err() {
                            return; // the client went away
                        }
                    }
                    Err(RecvError::Lagged(n)) => {
                        let _ = tx
                            .send(Err(Status::resource_exhausted(format!(
                                "watcher fell {n} events behind and was dropped; re-read state and watch again"
                            ))))
                            .await;
                        return;
                    }
                    Err(RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(stream))
    }
}

/// An update's value, range-checked as i64, in the type its change takes.
fn narrow<T: TryFrom<i64>>(v: i64) -> Result<T, Status> {
    T::try_from(v).map_err(|_| Status::invalid_argument(format!("value: {v} is out of range")))
}

/// Entries `ListJobsRequest.states` may have: each state at most a few
/// times over (they are deduplicated); more is not a listing but an attack
/// on the replica's CPU.
pub const LIST_STATES_MAX: usize = 32;
/// Jobs one List call looks at before it answers with what it found so far
/// and a cursor (`next_after_id`) to go on from: a filter that matches
/// nothing in a queue of a million jobs costs a bounded page, not a scan of
/// everything (a few milliseconds each).
pub const LIST_SCAN_MAX: usize = 50_000;
/// Read units a scheduling pass costs per pending job it orders (a pass
/// weighs each job against the nodes: far more than looking at it).
const EXPLAIN_UNITS_PER_JOB: usize = 20;

/// Whether a List asked to `explain` runs a scheduling pass itself: only
/// without the leader's reasons (`none_cached`), and only for a queue of 1
/// to [`EXPLAIN_INLINE_PENDING_MAX`] pending jobs.
fn explains_inline(explain: bool, none_cached: bool, pending: usize) -> bool {
    explain && none_cached && pending > 0 && pending <= EXPLAIN_INLINE_PENDING_MAX
}

/// Values one filter of a history or usage query may list: far more than a
/// person types, and each becomes an SQL parameter.
pub const HISTORY_FILTER_VALUES_MAX: usize = 1_000;

/// A list of names in a query: bounded in count and length.
fn check_names(field: &str, values: &[String]) -> Result<(), Status> {
    use gangway_core::limits::NAME_BYTES_MAX;
    if values.len() > HISTORY_FILTER_VALUES_MAX {
        return Err(Status::invalid_argument(format!(
            "{field}: at most {HISTORY_FILTER_VALUES_MAX} values, got {}",
            values.len()
        )));
    }
    if values.iter().any(|v| v.len() > NAME_BYTES_MAX) {
        return Err(Status::invalid_argument(format!("{field}: each at most {NAME_BYTES_MAX} bytes")));
    }
    Ok(())
}

/// A history query's filters, bounded before they become SQL parameters.
fn check_history_filters(msg: &HistoryRequest) -> Result<(), Status> {
    if msg.limit > crate::accounting::HISTORY_ROWS_MAX {
        return Err(Status::invalid_argument(format!(
            "limit: must be at most {}",
            crate::accounting::HISTORY_ROWS_MAX
        )));
    }
    if msg.job_ids.len() > HISTORY_FILTER_VALUES_MAX {
        return Err(Status::invalid_argument(format!(
            "job_ids: at most {HISTORY_FILTER_VALUES_MAX} ids, got {}",
            msg.job_ids.len()
        )));
    }
    check_names("users", &msg.users)?;
    check_names("accounts", &msg.accounts)?;
    check_names("partitions", &msg.partitions)?;
    check_names("names", &msg.names)?;
    if msg.states.len() > LIST_STATES_MAX {
        return Err(Status::invalid_argument(format!(
            "states: at most {LIST_STATES_MAX} entries (each job state once is enough), got {}",
            msg.states.len()
        )));
    }
    for s in &msg.states {
        if JobState::try_from(*s).ok().and_then(state_from_proto).is_none() {
            return Err(Status::invalid_argument(format!("states: {s} is not a job state")));
        }
    }
    Ok(())
}

/// The read units of a scheduling analysis over `state`: a pass weighs the
/// pending jobs against the nodes.
fn analysis_units(state: &gangway_core::State) -> u64 {
    crate::ratelimit::read_units(
        state.pending.len().saturating_add(state.nodes.len()).saturating_mul(EXPLAIN_UNITS_PER_JOB),
        0,
    )
}

/// A listing's filters, checked and bounded at the edge before any work.
#[derive(Clone, Debug)]
pub struct JobQuery {
    /// Deduplicated, each a real state.
    states: Vec<JobState>,
    user: String,
    name: String,
    account: String,
    partition: String,
    after_id: u64,
    limit: usize,
    explain: bool,
}

impl JobQuery {
    pub fn of(msg: &ListJobsRequest) -> Result<JobQuery, Status> {
        use gangway_core::limits::NAME_BYTES_MAX;
        if msg.limit > LIST_LIMIT_MAX {
            return Err(Status::invalid_argument(format!("limit: must be at most {LIST_LIMIT_MAX}")));
        }
        if msg.states.len() > LIST_STATES_MAX {
            return Err(Status::invalid_argument(format!(
                "states: at most {LIST_STATES_MAX} entries (each job state once is enough), got {}",
                msg.states.len()
            )));
        }
        // Matched against the state each job shows (SUSPENDED apart from RUNNING).
        let mut states = Vec::new();
        for s in &msg.states {
            let st = JobState::try_from(*s)
                .ok()
                .filter(|st| state_from_proto(*st).is_some())
                .ok_or_else(|| Status::invalid_argument(format!("states: {s} is not a job state")))?;
            if !states.contains(&st) {
                states.push(st);
            }
        }
        for (field, v) in
            [("user", &msg.user), ("name", &msg.name), ("account", &msg.account), ("partition", &msg.partition)]
        {
            if v.len() > NAME_BYTES_MAX {
                return Err(Status::invalid_argument(format!(
                    "{field}: at most {NAME_BYTES_MAX} bytes (no job has a longer one)"
                )));
            }
        }
        Ok(JobQuery {
            states,
            user: msg.user.clone(),
            name: msg.name.clone(),
            account: msg.account.clone(),
            partition: msg.partition.clone(),
            after_id: msg.after_id,
            limit: if msg.limit == 0 { LIST_LIMIT_DEFAULT } else { msg.limit } as usize,
            explain: msg.explain,
        })
    }

    fn matches(&self, viewer: &super::Viewer, j: &gangway_core::Job) -> bool {
        viewer.visible(j)
            && (self.states.is_empty() || self.states.contains(&job_state_to_proto(j)))
            && (self.user.is_empty() || j.spec.user == self.user)
            && (self.name.is_empty() || j.spec.name == self.name)
            && (self.account.is_empty() || j.spec.account == self.account)
            && (self.partition.is_empty()
                || j.spec.partition == self.partition
                || j.spec.components.iter().any(|c| c.partition == self.partition))
    }
}

/// Two ascending id sequences as one, ascending (pending and running jobs,
/// both indexed by id).
fn merge_ascending<'a>(
    a: impl Iterator<Item = &'a u64> + 'a,
    b: impl Iterator<Item = &'a u64> + 'a,
) -> impl Iterator<Item = u64> + 'a {
    let (mut a, mut b) = (a.copied().peekable(), b.copied().peekable());
    std::iter::from_fn(move || match (a.peek(), b.peek()) {
        (Some(x), Some(y)) if x <= y => a.next(),
        (Some(_), Some(_)) => b.next(),
        (Some(_), None) => a.next(),
        (None, _) => b.next(),
    })
}

/// One page of a listing: the answer, the jobs looked at and the bytes
/// answered (what the caller is charged). Pure over a view of the state;
/// it looks at no more than LIST_SCAN_MAX jobs and answers no more than
/// the query's limit or LIST_RESPONSE_BYTES_MAX.
pub fn list_page(
    state: &gangway_core::State,
    viewer: &super::Viewer,
    q: &JobQuery,
    reasons: &std::collections::BTreeMap<u64, gangway_core::sched::Pending>,
) -> (ListJobsResponse, usize, usize) {
    use std::ops::Bound::{Excluded, Unbounded};
    let after = (Excluded(q.after_id), Unbounded);
    // Pending and running jobs are indexed; scanning only them keeps the
    // common "what is queued" listing cheap when many finished jobs are kept.
    let active_only =
        !q.states.is_empty() && q.states.iter().all(|s| state_from_proto(*s).is_some_and(|s| !s.is_finished()));
    let ids: Box<dyn Iterator<Item = u64>> = if active_only && !q.user.is_empty() {
        // One user's queue: that user's jobs only, however long the queue.
        match state.active_jobs_of(&q.user) {
            Some(mine) => Box::new(mine.range(after).copied()),
            None => Box::new(std::iter::empty()),
        }
    } else if active_only {
        Box::new(merge_ascending(state.pending.range(after), state.running.range(after)))
    } else {
        Box::new(state.jobs.range(after).map(|(id, _)| *id))
    };
    let (mut jobs, mut budget, mut examined) =
        (Vec::with_capacity(q.limit.min(1024)), gangway_proto::limits::PageBudget::list(), 0usize);
    let (mut next_after_id, mut last_examined) = (0, q.after_id);
    for id in ids {
        if examined == LIST_SCAN_MAX || jobs.len() == q.limit {
            // More may follow: go on after the last one looked at.
            next_after_id = last_examined;
            break;
        }
        examined = examined.saturating_add(1);
        last_examined = id;
        let Some(j) = state.jobs.get(&id) else { continue };
        if !q.matches(viewer, j) {
            continue;
        }
        let mut pj = viewer.job(j);
        // Paged by size too: the answer stays under every client's limit.
        if !budget.take(prost::Message::encoded_len(&pj)) {
            next_after_id = jobs.last().map_or(0, |j: &Job| j.id);
            break;
        }
        // The scheduler's reason replaces the stored one, except a requeue's
        // explanation, which says more.
        if let Some(r) = reasons.get(&j.id).filter(|_| j.state == gangway_core::JobState::Pending) {
            if !pj.reason.starts_with("requeued") {
                pj.reason = r.as_str().to_string();
            }
        }
        jobs.push(pj);
    }
    (ListJobsResponse { jobs, next_after_id }, examined, budget.used())
}

/// Read units one replayed event costs: it is filtered for the caller,
/// converted and encoded (a hundred bytes or so).
const EVENT_REPLAY_UNITS: usize = 4;
/// How often an open stream checks that its caller still may read it: a
/// revoked or expired token, a job credential whose attempt ended, an admin
/// no longer one.
pub const STREAM_RECHECK_INTERVAL: std::time::Duration = std::time::Duration::from_secs(5);

/// Events queued for one watcher's gRPC stream before back-pressure applies.
const WATCH_STREAM_BUFFER_MAX: usize = 256;

fn explanation_to_proto(e: gangway_core::sched::Explanation) -> Explanation {
    let f = e.factors;
    let factors = [
        ("age", f.age),
        ("fairshare", f.fairshare),
        ("job_size", f.job_size),
        ("qos", f.qos),
        ("partition", f.partition),
        ("nice", f.nice),
    ];
    Explanation {
        job_id: e.job_id,
        state: state_to_proto(e.state) as i32,
        reason: e.reason,
        detail: e.detail,
        priority: f.total,
        priority_factors: factors.into_iter().map(|(k, v)| (k.to_string(), v)).collect(),
        eligible_nodes: e.eligible_nodes,
        rejections: e.rejections.into_iter().collect(),
        queue_position: e.queue_position,
        estimated_start_ms: e.estimated_start_ms,
        start_nodes: e.start_nodes,
    }
}

/// Which events a stream's caller may see: with private jobs, a user's own
/// jobs' only (a job no longer kept is not shown). Streams live long and the
/// policy (roles, the private switch, the user map) changes at run time, so
/// the caller's view is computed again whenever the policy's version moves.
struct Shown {
    replica: Arc<Replica>,
    pub(super) ctx: super::CallCtx,
    /// (policy version, the view it gave).
    viewer: std::sync::Mutex<(u64, super::Viewer)>,
}

impl Shown {
    fn new(replica: &Arc<Replica>, ctx: &super::CallCtx) -> Shown {
        let version = replica.node.state().read().policy.version;
        let viewer = std::sync::Mutex::new((version, replica.viewer(ctx)));
        Shown { replica: replica.clone(), ctx: ctx.clone(), viewer }
    }

    /// Runs `f` with the caller's view under the current policy.
    fn with<R>(&self, f: impl FnOnce(&super::Viewer) -> R) -> R {
        let version = self.replica.node.state().read().policy.version;
        let mut cached = self.viewer.lock().unwrap_or_else(|e| e.into_inner());
        if cached.0 != version {
            *cached = (version, self.replica.viewer(&self.ctx));
        }
        f(&cached.1)
    }

    /// Whether the job of an event at log index `at` is shown: judged on a
    /// view at least as new as the event (the event is sent as apply makes
    /// it, a moment before the view with its job is published).
    async fn job(&self, job_id: u64, at: u64) -> bool {
        let private = self.with(|v| v.private_jobs);
        if !private {
            return true;
        }
        let mut view = self.replica.node.state().read();
        if view.index() < at {
            match self.replica.fresh_view().await {
                Ok(v) => view = v,
                Err(_) => return false,
            }
        }
        self.with(|v| view.jobs.get(&job_id).is_some_and(|j| v.visible(j)))
    }

    /// An event's reason as the caller may read it.
    fn reason(&self, reason: String) -> String {
        self.with(|v| v.reason(&reason))
    }

    async fn event(&self, ev: &gangway_core::Event) -> bool {
        match ev {
            gangway_core::Event::Job(j) => self.job(j.job_id, j.index).await,
            _ => true,
        }
    }
}

/// Runs `f` as a task feeding a bounded channel, and returns that channel as a stream.
fn async_stream<T, F, Fut>(f: F) -> Pin<Box<dyn Stream<Item = Result<T, Status>> + Send>>
where
    T: Send + 'static,
    F: FnOnce(tokio::sync::mpsc::Sender<Result<T, Status>>) -> Fut,
    Fut: std::future::Future<Output = ()> + Send + 'static,
{
    let (tx, rx) = tokio::sync::mpsc::channel(WATCH_STREAM_BUFFER_MAX);
    tokio::spawn(f(tx));
    Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))
}

/// The state a job event shows: SUSPENDED for a suspension.
fn event_state(ev: &gangway_core::state::JobEvent) -> gangway_proto::v1::JobState {
    if ev.suspended == Some(true) {
        gangway_proto::v1::JobState::Suspended
    } else {
        state_to_proto(ev.state)
    }
}

/// An event as the stream carries it, with its kind in words.
fn cluster_event(ev: gangway_core::Event) -> ClusterEvent {
    use gangway_core::{Event, JobState, NodeChange, NodeState};
    match ev {
        Event::Job(j) => {
            let kind = match j.state {
                _ if j.usage => "usage",
                _ if j.step.is_some_and(|(_, s)| s == JobState::Running) => "step_started",
                _ if j.step.is_some() => "step_ended",
                JobState::Running if j.suspended == Some(true) => "suspended",
                JobState::Running if j.suspended == Some(false) => "resumed",
                JobState::Running => "started",
                JobState::Pending if j.attempt == 0 && j.reason.is_empty() => "submitted",
                JobState::Pending if j.reason.contains("preempted") => "preempted",
                JobState::Pending if j.attempt > 0 => "requeued",
                JobState::Pending => "pending",
                _ => "finished",
            };
            ClusterEvent {
                index: j.index,
                kind: kind.into(),
                job_id: j.job_id,
                state: event_state(&j) as i32,
                attempt: j.attempt,
                step: j.step.map(|(id, _)| id),
                step_state: j.step.map_or(0, |(_, s)| state_to_proto(s) as i32),
                reason: j.reason,
                ..Default::default()
            }
        }
        Event::Node { index, node, change, reason } => {
            let (kind, gpu) = match change {
                NodeChange::Registered => ("node_registered", None),
                NodeChange::State(NodeState::Up) => ("node_up", None),
                NodeChange::State(NodeState::Drain) => ("node_drain", None),
                NodeChange::State(NodeState::Down) => ("node_down", None),
                NodeChange::State(NodeState::PoweredDown) => ("node_powered_down", None),
                NodeChange::State(NodeState::PoweringUp) => ("node_powering_up", None),
                NodeChange::Gpu { gpu, healthy: false } => ("gpu_quarantined", Some(gpu)),
                NodeChange::Gpu { gpu, healthy: true } => ("gpu_healthy", Some(gpu)),
            };
            ClusterEvent { index, kind: kind.into(), node, gpu, reason, ..Default::default() }
        }
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Each bound of a history query, at its limit and one past it (the
    /// answer names the field; nothing reaches the database).
    #[test]
    fn history_queries_are_bounded_at_the_edge() {
        use crate::accounting::HISTORY_ROWS_MAX;
        let ok = |msg: HistoryRequest| check_history_filters(&msg).is_ok();
        let refused = |msg: HistoryRequest, field: &str| {
            let e = check_history_filters(&msg).unwrap_err();
            e.code() == tonic::Code::InvalidArgument && e.message().starts_with(field)
        };
        assert!(ok(HistoryRequest { limit: HISTORY_ROWS_MAX, ..Default::default() }));
        assert!(refused(HistoryRequest { limit: HISTORY_ROWS_MAX + 1, ..Default::default() }, "limit"));
        let ids = |n: usize| (1..=n as u64).collect::<Vec<_>>();
        assert!(ok(HistoryRequest { job_ids: ids(HISTORY_FILTER_VALUES_MAX), ..Default::default() }));
        assert!(refused(
            HistoryRequest { job_ids: ids(HISTORY_FILTER_VALUES_MAX + 1), ..Default::default() },
            "job_ids"
        ));
        let names = |n: usize| vec!["a".to_string(); n];
        assert!(ok(HistoryRequest { users: names(HISTORY_FILTER_VALUES_MAX), ..Default::default() }));
        assert!(refused(HistoryRequest { names: names(HISTORY_FILTER_VALUES_MAX + 1), ..Default::default() }, "names"));
        let states = |n: usize| vec![JobState::Running as i32; n];
        assert!(ok(HistoryRequest { states: states(LIST_STATES_MAX), ..Default::default() }));
        assert!(refused(HistoryRequest { states: states(LIST_STATES_MAX + 1), ..Default::default() }, "states"));
    }

    // Fields set one by one: a struct literal of a core type here would
    // read as a conversion outside convert.rs (core.rs's architecture rule).
    #[allow(clippy::field_reassign_with_default)]
    pub(crate) fn state_with_jobs(n: u64) -> gangway_core::State {
        let mut state = gangway_core::State::default();
        for i in 1..=n {
            let mut spec = gangway_core::JobSpec::default();
            spec.name = format!("j{i}");
            spec.command = vec!["true".into()];
            spec.user = "alice".into();
            let cmd =
                Command::SubmitJob { spec, identity: "client:alice".into(), idempotency_key: String::new(), now_ms: i };
            state.apply(i, &cmd);
        }
        assert_eq!(state.jobs.len() as u64, n);
        state
    }

    /// A List runs a scheduling pass itself for a queue of up to
    /// EXPLAIN_INLINE_PENDING_MAX pending jobs; one more keeps the stored
    /// reasons (as does an empty queue, cached reasons, or no `explain`).
    #[test]
    fn an_inline_pass_is_bounded_by_the_queue_length() {
        assert!(explains_inline(true, true, EXPLAIN_INLINE_PENDING_MAX));
        assert!(!explains_inline(true, true, EXPLAIN_INLINE_PENDING_MAX + 1));
        assert!(!explains_inline(true, true, 0));
        assert!(!explains_inline(true, false, 1));
        assert!(!explains_inline(false, true, 1));
    }

    /// A stream's task queues WATCH_STREAM_BUFFER_MAX items for a caller
    /// who reads none; the next waits (back-pressure) rather than queueing.
    #[tokio::test]
    async fn a_stream_buffers_at_most_watch_stream_buffer_max() {
        let (done, took) = tokio::sync::oneshot::channel();
        let stream = async_stream(move |tx| async move {
            let sent = (0..=WATCH_STREAM_BUFFER_MAX).map(|i| tx.try_send(Ok(i)).is_ok()).collect::<Vec<_>>();
            let _ = done.send(sent);
        });
        let sent = took.await.unwrap();
        assert!(sent[..WATCH_STREAM_BUFFER_MAX].iter().all(|ok| *ok));
        assert!(!sent[WATCH_STREAM_BUFFER_MAX], "one past the buffer was queued");
        drop(stream);
    }

    fn query(msg: ListJobsRequest) -> JobQuery {
        JobQuery::of(&msg).unwrap()
    }

    /// A listing looks at no more than LIST_SCAN_MAX jobs per call and says
    /// where to go on; paging through finds every job once; the largest
    /// cursor lists nothing, without arithmetic on it.
    #[test]
    fn a_listing_is_bounded_per_call_and_pages_through_everything() {
        let n = LIST_SCAN_MAX as u64 + 100;
        let state = state_with_jobs(n);
        let viewer = crate::api::Viewer::whole_for_tests();
        let none = Default::default();
        // A filter nothing matches: one bounded page, then the rest.
        let q = query(ListJobsRequest { user: "nobody".into(), ..Default::default() });
        let (r, examined, bytes) = list_page(&state, &viewer, &q, &none);
        assert_eq!((r.jobs.len(), examined, bytes, r.next_after_id), (0, LIST_SCAN_MAX, 0, LIST_SCAN_MAX as u64));
        let q = query(ListJobsRequest { user: "nobody".into(), after_id: r.next_after_id, ..Default::default() });
        let (r, examined, _) = list_page(&state, &viewer, &q, &none);
        assert_eq!((r.jobs.len(), examined, r.next_after_id), (0, 100, 0));
        // The same over the pending index.
        let pending = vec![JobState::Pending as i32];
        let q = query(ListJobsRequest { name: "nobody".into(), states: pending.clone(), ..Default::default() });
        let (r, examined, _) = list_page(&state, &viewer, &q, &none);
        assert_eq!((examined, r.next_after_id), (LIST_SCAN_MAX, LIST_SCAN_MAX as u64));
        // Pages of 7 find every job once, in order.
        let (mut after_id, mut seen) = (0, Vec::new());
        loop {
            let q = query(ListJobsRequest { limit: 7, after_id, states: pending.clone(), ..Default::default() });
            let (r, _, _) = list_page(&state, &viewer, &q, &none);
            seen.extend(r.jobs.iter().map(|j| j.id));
            if r.next_after_id == 0 {
                break;
            }
            assert!(r.next_after_id > after_id, "the cursor went backwards");
            after_id = r.next_after_id;
            if seen.len() > 300 {
                break;
            }
        }
        assert_eq!(seen, (1..=seen.len() as u64).collect::<Vec<_>>());
        for after_id in [u64::MAX, u64::MAX - 1, n] {
            let q = query(ListJobsRequest { after_id, ..Default::default() });
            let (r, examined, _) = list_page(&state, &viewer, &q, &none);
            assert_eq!((r.jobs.len(), examined, r.next_after_id), (0, 0, 0));
        }
    }

    /// A listing of one user's queue looks at that user's unfinished jobs
    /// only (and is charged for those), however long the whole queue is.
    #[test]
    #[allow(clippy::field_reassign_with_default)]
    fn one_users_queue_is_listed_from_their_own_jobs() {
        let mut state = state_with_jobs(5_000);
        let mut bobs = Vec::new();
        for i in 0..3u64 {
            let mut spec = gangway_core::JobSpec::default();
            spec.command = vec!["true".into()];
            spec.user = "bob".into();
            let cmd = Command::SubmitJob {
                spec,
                identity: "client:bob".into(),
                idempotency_key: String::new(),
                now_ms: 10_000 + i,
            };
            let index = 10_000 + i;
            state.apply(index, &cmd);
            bobs.push(state.next_job_id - 1);
        }
        state.check_invariants().unwrap();
        let viewer = crate::api::Viewer::whole_for_tests();
        let none = Default::default();
        let active = vec![JobState::Pending as i32, JobState::Running as i32];
        let q = query(ListJobsRequest { user: "bob".into(), states: active.clone(), ..Default::default() });
        let (r, examined, _) = list_page(&state, &viewer, &q, &none);
        assert_eq!(r.jobs.iter().map(|j| j.id).collect::<Vec<_>>(), bobs);
        assert_eq!((examined, r.next_after_id), (3, 0));
        // Paged: after bob's first job, the other two.
        let q = query(ListJobsRequest { user: "bob".into(), states: active, after_id: bobs[0], ..Default::default() });
        let (r, examined, _) = list_page(&state, &viewer, &q, &none);
        assert_eq!((r.jobs.len(), examined), (2, 2));
        // A user with nothing queued costs nothing.
        let q = query(ListJobsRequest {
            user: "carol".into(),
            states: vec![JobState::Pending as i32],
            ..Default::default()
        });
        assert_eq!(list_page(&state, &viewer, &q, &none).1, 0);
    }

    #[test]
    fn a_listings_filters_are_bounded_and_deduplicated() {
        let many =
            ListJobsRequest { states: vec![JobState::Running as i32; LIST_STATES_MAX + 1], ..Default::default() };
        assert_eq!(JobQuery::of(&many).unwrap_err().code(), tonic::Code::InvalidArgument);
        let repeated =
            ListJobsRequest { states: vec![JobState::Running as i32; LIST_STATES_MAX], ..Default::default() };
        assert_eq!(JobQuery::of(&repeated).unwrap().states, vec![JobState::Running]);
        let bad = ListJobsRequest { states: vec![-1], ..Default::default() };
        assert!(JobQuery::of(&bad).unwrap_err().message().starts_with("states:"));
        let long =
            ListJobsRequest { partition: "p".repeat(gangway_core::limits::NAME_BYTES_MAX + 1), ..Default::default() };
        assert!(JobQuery::of(&long).unwrap_err().message().starts_with("partition:"));
        let big = ListJobsRequest { limit: LIST_LIMIT_MAX + 1, ..Default::default() };
        assert!(JobQuery::of(&big).unwrap_err().message().starts_with("limit:"));
    }
}
