//! AgentService: node agents register their inventory and send heartbeats.
//! Registration is replicated; heartbeats stay in the leader's memory (only a
//! resulting state change, such as a node going Down, is committed).

use std::sync::Arc;

use std::time::Duration;

use gangway_core::duties::{heartbeat_interval_ms, HeartbeatReply};
use gangway_core::limits::{check_task_exit, REASON_BYTES_MAX};
use gangway_core::{Command, Outcome, RefusalKind};
use gangway_proto::limits::{AGENT_MESSAGE_BYTES_MAX, API_REQUEST_BYTES_MAX, LAUNCH_ORDERS_BYTES_MAX};

// A spec the API accepts always reaches its agent: one launch order (a spec
// and its environment) fits the order budget, which fits an agent message.
const _: () = assert!(gangway_core::limits::JOB_SPEC_BYTES_MAX * 2 <= LAUNCH_ORDERS_BYTES_MAX);
const _: () = assert!(LAUNCH_ORDERS_BYTES_MAX * 2 <= AGENT_MESSAGE_BYTES_MAX);
const _: () = assert!(gangway_core::limits::JOB_SPEC_BYTES_MAX * 2 <= API_REQUEST_BYTES_MAX);
use gangway_proto::v1::agent_service_server::AgentService;
use gangway_proto::v1::*;
use tonic::{Request, Response, Status};

use super::convert::node_spec_from_proto;
use super::{status_from_spec, unexpected, Routed};
use crate::shared::Replica;

pub struct AgentApi {
    pub replica: Arc<Replica>,
    /// Big gangs' launch orders, built once per attempt.
    pub templates: LaunchTemplates,
}

impl AgentApi {
    /// The membership's replicas by their certificates' names, for agents
    /// to refuse step credentials any other replica signed.
    fn members(&self) -> Vec<String> {
        let status = self.replica.node.status();
        status.voters.iter().chain(&status.learners).map(u64::to_string).collect()
    }

    /// The interval this leader asks of a fleet of `nodes` (see
    /// `duties::heartbeat_interval_ms`).
    fn heartbeat_interval_ms(&self, nodes: usize) -> u64 {
        let t = &self.replica.timing;
        heartbeat_interval_ms(nodes, t.agent_heartbeat_interval_ms, t.node_down_timeout_ms)
    }
}

/// How long a heartbeat waits for the view that covers what was applied
/// when it arrived, when the views are far behind, before it answers from
/// the newest one there is.
const HEARTBEAT_VIEW_WAIT: Duration = Duration::from_millis(200);
/// Log entries the views may lag apply by before a heartbeat waits for them.
const HEARTBEAT_VIEW_LAG_MAX: u64 = 64;

/// Fastest rate at which one agent is poked: coalesces bursts (a plan starting
/// hundreds of jobs) into one reconcile.
const POKE_MIN_INTERVAL: Duration = Duration::from_millis(20);
/// Pokes buffered per watching agent; one pending poke is all an agent needs.
const POKE_BUFFER_MAX: usize = 1;

type PokeStream = std::pin::Pin<Box<dyn futures::Stream<Item = Result<NodeChanged, Status>> + Send>>;
type Poke = Result<NodeChanged, Status>;

/// A watching agent's pokes: [`POKE_BUFFER_MAX`]; a poke past it is
/// dropped (the one waiting already says "look again").
fn pokes() -> (tokio::sync::mpsc::Sender<Poke>, tokio::sync::mpsc::Receiver<Poke>) {
    tokio::sync::mpsc::channel(POKE_BUFFER_MAX)
}

#[tonic::async_trait]
impl AgentService for AgentApi {
    type WatchNodeStream = PokeStream;

    async fn watch_node(&self, req: Request<WatchNodeRequest>) -> Result<Response<PokeStream>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let name = req.into_inner().name;
        if name.is_empty() {
            return Err(Status::invalid_argument("name: must not be empty"));
        }
        ctx.require_agent_for(&name, "watch a node")?;
        if name.len() > gangway_core::limits::NAME_BYTES_MAX {
            return Err(Status::invalid_argument(format!(
                "name: at most {} bytes",
                gangway_core::limits::NAME_BYTES_MAX
            )));
        }
        let slot = self.replica.node_watches.take(&ctx.identity)?;
        // Only a registered node is watched: a claimed name cannot grow the
        // watch map past the nodes the cluster has.
        if !self.replica.node.state().read().nodes.contains_key(&name) {
            return Err(Status::failed_precondition(format!("name: node {name} is not registered; register first")));
        }
        let mut changes = self.replica.watches.subscribe(&name)?;
        let watches = self.replica.watches.clone();
        let (tx, rx) = pokes();
        let closed = self.replica.closed();
        tokio::spawn(async move {
            let _slot = slot;
            tokio::pin!(closed);
            loop {
                tokio::select! {
                    changed = changes.changed() => if changed.is_err() { break },
                    // The agent reconnects to another replica.
                    _ = &mut closed => break,
                    // The agent went away.
                    _ = tx.closed() => break,
                }
                let index = *changes.borrow_and_update();
                if let Err(tokio::sync::mpsc::error::TrySendError::Closed(_)) = tx.try_send(Ok(NodeChanged { index })) {
                    break;
                }
                tokio::time::sleep(POKE_MIN_INTERVAL).await;
            }
            drop(changes);
            watches.unsubscribed(&name);
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(rx))))
    }

    async fn register(&self, req: Request<RegisterRequest>) -> Result<Response<RegisterResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        ctx.require_agent_for(&msg.name, "register")?;
        let spec = node_spec_from_proto(msg.clone()).map_err(status_from_spec)?;
        // Refused here already when this replica's state refuses it: an
        // agent retrying a refused registration costs no log entry (apply
        // checks again, against the state the entry meets).
        if let Err(e) = self.replica.node.state().read().admits(&spec) {
            return Err(super::denied(&ctx, "register", format!("not admitted: {e}")));
        }
        let name = spec.name.clone();
        let cmd = Command::RegisterNode { spec, now_ms: crate::now_ms() };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move {
                gangway_proto::limits::agent_client(ch).register(r).await
            })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::NodeRegistered { .. } => {
                    self.replica.heartbeats.record(&name, None);
                    let nodes = self.replica.fresh_view().await?.nodes.len();
                    Ok(Response::new(RegisterResponse {
                        heartbeat_interval_ms: self.heartbeat_interval_ms(nodes),
                        node_down_timeout_ms: self.replica.timing.node_down_timeout_ms,
                    }))
                }
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn heartbeat(&self, req: Request<HeartbeatRequest>) -> Result<Response<HeartbeatResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        ctx.require_agent_for(&msg.name, "heartbeat")?;
        if !self.replica.node.is_leader() {
            let leader = self.replica.node.remote_leader();
            return self
                .replica
                .forward(&ctx, leader, msg, |ch, r| async move {
                    gangway_proto::limits::agent_client(ch).heartbeat(r).await
                })
                .await;
        }
        check_heartbeat(&msg)?;
        // A leader a quorum has not acknowledged lately may be deposed: its
        // answer must not count as contact, or the agent would keep its tasks
        // while the real leader declares the node down and starts them elsewhere.
        let within = Duration::from_millis(self.replica.timing.election_timeout_max_ms);
        if !self.replica.node.leads_with_quorum(within) {
            return Err(Status::unavailable(format!(
                "this leader has not heard from a quorum of replicas within {} ms; it may be deposed",
                within.as_millis()
            )));
        }
        let hb = gangway_proto::orders::heartbeat_from_proto(&msg);
        // GPU health first (level-triggered: what differs is committed).
        let changes = {
            let state = self.replica.node.state().read();
            gangway_core::duties::gpu_health_changes(&state, &hb, crate::now_ms(), REASON_BYTES_MAX)
        };
        for cmd in changes {
            tracing::warn!(node = %msg.name, change = ?cmd, "GPU health changed");
            self.replica.proposer.propose(cmd).await.map_err(super::status_from_propose)?;
        }
        let term = self.replica.node.status().term;
        // The newest view: an agent poked about a change heartbeats after the
        // view with it is published (the poker waits for it), and orders
        // from a moment-old state are safe (the agent ignores orders older
        // than those it acted on; one that acted on newer ones is told to
        // retry below). A heartbeat never waits for the views, which a
        // write flood keeps busy; only when the views are far behind (a
        // replica under strain) does it wait a little for them.
        let state = match self.replica.node.state().read() {
            view if view_is_recent(view.index(), self.replica.node.state().applied_index()) => view,
            _ => self.replica.node.state().read_fresh_within(HEARTBEAT_VIEW_WAIT).await,
        };
        let index = state.index();
        // A restored cluster's agents wait for its drawn history: an answer
        // in the derived one, after one in the drawn, would reset their fences.
        super::settled_history(&state)?;
        // The core decides (`duties::on_heartbeat`, which the simulation
        // runs too): a node unknown, Down or silent past the timeout gets no
        // orders; an agent ahead of this state waits.
        let silence = self.replica.heartbeats.silence_ms(&msg.name, term);
        let timeout = self.replica.timing.node_down_timeout_ms;
        let orders = match gangway_core::duties::on_heartbeat(&state, index, silence, timeout, &hb) {
            HeartbeatReply::RegisterAgain => {
                return Ok(Response::new(HeartbeatResponse {
                    known: false,
                    term,
                    history: state.history,
                    ..Default::default()
                }))
            }
            HeartbeatReply::Behind { index, seen_index } => {
                return Err(Status::unavailable(format!(
                    "this leader has applied the log to index {index}, behind the orders the agent acted on \
                     ({seen_index}); retry"
                )))
            }
            HeartbeatReply::Orders { orders, seen_index, jobs } => {
                self.replica.heartbeats.record(&msg.name, Some((seen_index, jobs)));
                orders
            }
        };
        let mut launch = Vec::new();
        let mut budget = gangway_proto::limits::PageBudget::launch_orders();
        for (job_id, _) in &orders.launch {
            let Some(job) = state.jobs.get(job_id) else { continue };
            let Some(mut order) = self.launch_order(&state, job, &msg.name, term)? else { continue };
            if !msg.reads_nodelist && !order.nodelist.is_empty() {
                name_every_node(&mut order)?;
            }
            // The answer must fit the agent's message limit: orders past the
            // budget go out with the next heartbeat.
            if !budget.take(prost::Message::encoded_len(&order)) {
                continue;
            }
            launch.push(order);
        }
        // The one codec of the answer (`gangway_proto::orders`), which the
        // agent reads back with its inverse.
        let from = gangway_proto::orders::From {
            term,
            index,
            history: state.history,
            heartbeat_interval_ms: self.heartbeat_interval_ms(state.nodes.len()),
        };
        let mut answer = gangway_proto::orders::orders_to_proto(&orders, from, launch);
        answer.members = self.members();
        Ok(Response::new(answer))
    }

    async fn report_task_exit(&self, req: Request<TaskExitReport>) -> Result<Response<TaskExitAck>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        ctx.require_agent_for(&msg.node, "report task exits")?;
        check_task_exit(msg.exit_code, msg.signal, &msg.reason).map_err(status_from_spec)?;
        // Impossible figures are dropped, not the exit: refusing the report
        // would have the agent send it again and again.
        let usage = msg.usage.as_ref().and_then(|u| match super::convert::task_usage_from_proto(u) {
            Ok(u) => Some(u),
            Err(e) => {
                tracing::warn!(node = %msg.node, job = msg.job_id, error = %e, "task usage dropped");
                None
            }
        });
        // A cluster not yet on the accounting format cannot carry it (a
        // rolling upgrade): the exit is what matters.
        let accounting = self.replica.node.state().read().format >= gangway_core::format::ACCOUNTING_FORMAT;
        let cmd = Command::TaskExited {
            job_id: msg.job_id,
            attempt: msg.attempt,
            node: msg.node.clone(),
            exit_code: msg.exit_code,
            signal: msg.signal,
            reason: msg.reason.clone(),
            lost: msg.lost,
            peak_mem_mb: msg.peak_mem_mb,
            usage: usage.filter(|_| accounting),
            now_ms: crate::now_ms(),
        };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move {
                gangway_proto::limits::agent_client(ch).report_task_exit(r).await
            })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            // A stale report (job cancelled, or already recorded) needs no retry.
            Routed::Local(applied) => match applied.outcome {
                Outcome::TaskRecorded { .. } => Ok(Response::new(TaskExitAck {})),
                Outcome::Refused(r) if matches!(r.kind, RefusalKind::Stale | RefusalKind::NotFound) => {
                    Ok(Response::new(TaskExitAck {}))
                }
                other => Err(unexpected(&other)),
            },
        }
    }
}

/// Tasks one agent may report running (the core allows this many per node).
const TASKS_PER_NODE_REPORTED_MAX: usize = 4096;

/// A heartbeat's sizes, bounded before any work: the tasks it reports and
/// its GPUs' health.
fn check_heartbeat(msg: &HeartbeatRequest) -> Result<(), Status> {
    if msg.running.len() > TASKS_PER_NODE_REPORTED_MAX {
        return Err(Status::invalid_argument(format!("running: at most {TASKS_PER_NODE_REPORTED_MAX} tasks")));
    }
    if msg.gpu_health.len() > gangway_core::limits::GPUS_PER_NODE_MAX as usize {
        return Err(Status::invalid_argument(format!(
            "gpu_health: at most {} GPUs, as many as a node can have",
            gangway_core::limits::GPUS_PER_NODE_MAX
        )));
    }
    Ok(())
}

/// Whether views at `view` are recent enough to answer a heartbeat from,
/// with the log applied to `applied`: within [`HEARTBEAT_VIEW_LAG_MAX`].
fn view_is_recent(view: u64, applied: u64) -> bool {
    view.saturating_add(HEARTBEAT_VIEW_LAG_MAX) >= applied
}

/// Whether a gang of `nodes` nodes gets its launch order from a template
/// built once (see [`LAUNCH_TEMPLATE_NODES_MIN`]).
fn uses_template(nodes: usize) -> bool {
    nodes >= LAUNCH_TEMPLATE_NODES_MIN
}

/// Whether a job's launch order names its `nodes` nodes as one hostlist
/// (see [`LAUNCH_NODES_INLINE_MAX`]); a heterogeneous job's never do.
fn sends_hostlist(nodes: usize, heterogeneous: bool) -> bool {
    nodes > LAUNCH_NODES_INLINE_MAX && !heterogeneous
}
/// Rendezvous ports are chosen per job from this range (PyTorch's default
/// MASTER_PORT, 29500, starts it), the same on every node of the gang.
const MASTER_PORT_BASE: u32 = 29_500;
const MASTER_PORT_SPAN: u64 = 10_000;

/// Gangs at least this big get their launch order built once per attempt and
/// copied for each node: built per node, it walks every node of the gang, so
/// launching a gang would cost the leader its size squared.
const LAUNCH_TEMPLATE_NODES_MIN: usize = 32;
/// Launch templates kept: one per big gang launching at about the same time,
/// far more than start at once. Each insert drops the templates of attempts
/// no longer running, then the oldest past this count or byte budget.
const LAUNCH_TEMPLATES_MAX: usize = 256;
/// Bytes of launch templates kept (a template holds its job's script and
/// environment, up to a few MiB).
const LAUNCH_TEMPLATES_BYTES_MAX: usize = 64 * 1024 * 1024;

/// A template is for one attempt with one time limit (which an update may
/// change while it runs).
type TemplateKey = (u64, u32, u64);
/// Gangs of more nodes than this send them as one hostlist
/// (`LaunchOrder.nodelist`); smaller ones name each node, as agents from
/// before data format 8 (which never ran bigger gangs) expect.
const LAUNCH_NODES_INLINE_MAX: usize = gangway_core::limits::NODES_PER_JOB_MAX_BEFORE_FORMAT_8 as usize;

/// The launch orders of big gangs' attempts, built once: everything but the
/// node's rank, GPUs and the term.
#[derive(Default)]
pub struct LaunchTemplates {
    /// Each template with its encoded size.
    orders: std::sync::Mutex<std::collections::BTreeMap<TemplateKey, (Arc<LaunchOrder>, usize)>>,
}

impl LaunchTemplates {
    fn get(&self, key: TemplateKey) -> Option<Arc<LaunchOrder>> {
        self.orders.lock().expect("launch templates lock").get(&key).map(|(o, _)| o.clone())
    }

    /// Keeps `order` for `key`, dropping the templates of attempts not
    /// `running` and then the oldest past the count or byte budget.
    fn keep(&self, running: impl Fn(&TemplateKey) -> bool, key: TemplateKey, order: Arc<LaunchOrder>) {
        let bytes = prost::Message::encoded_len(order.as_ref());
        let mut orders = self.orders.lock().expect("launch templates lock");
        orders.retain(|k, _| running(k));
        orders.insert(key, (order, bytes));
        let mut total: usize = orders.values().map(|(_, b)| *b).sum();
        while orders.len() > LAUNCH_TEMPLATES_MAX || (total > LAUNCH_TEMPLATES_BYTES_MAX && orders.len() > 1) {
            let Some((_, (_, b))) = orders.pop_first() else { break };
            total = total.saturating_sub(b);
        }
    }
}

impl AgentApi {
    /// The order that starts `node`'s task of `job`'s current attempt.
    fn launch_order(
        &self,
        state: &gangway_core::State,
        job: &gangway_core::Job,
        node: &str,
        term: u64,
    ) -> Result<Option<LaunchOrder>, Status> {
        let Some(alloc) = job.allocation.as_ref() else { return Ok(None) };
        let Some(rank) = alloc.nodes.iter().position(|n| n.node == node) else { return Ok(None) };
        let key = (job.id, job.attempt, job.spec.time_limit_s);
        let mut order = if !uses_template(alloc.nodes.len()) {
            self.launch_template(state, job, alloc)?
        } else if let Some(template) = self.templates.get(key) {
            LaunchOrder::clone(&template)
        } else {
            let template = Arc::new(self.launch_template(state, job, alloc)?);
            let running = |(job, attempt, _): &TemplateKey| {
                state.jobs.get(job).is_some_and(|j| j.attempt == *attempt && j.allocation.is_some())
            };
            self.templates.keep(running, key, template.clone());
            LaunchOrder::clone(&template)
        };
        order.node_rank = u32::try_from(rank).unwrap_or(u32::MAX);
        order.gpus = alloc.nodes[rank].gpus.clone();
        order.term = term;
        // A heterogeneous job: this node's task has its component's shape.
        let mut first = 0usize;
        for g in &order.het_groups {
            let end = first.saturating_add(g.nodes as usize);
            if rank < end {
                order.tasks_per_node = g.tasks_per_node;
                order.cpus_per_task = g.cpus_per_task;
                order.mem_per_node_mb = g.mem_per_node_mb;
                order.partition.clone_from(&g.partition);
                break;
            }
            first = end;
        }
        Ok(Some(order))
    }

    /// `job`'s launch order without what differs per node (rank, GPUs) or
    /// per answer (term).
    fn launch_template(
        &self,
        state: &gangway_core::State,
        job: &gangway_core::Job,
        alloc: &gangway_core::Allocation,
    ) -> Result<LaunchOrder, Status> {
        let first = &alloc.nodes[0].node;
        let addr = |node: &str| state.nodes.get(node).map_or("", |n| n.addr.as_str());
        let master_addr = gangway_proto::node_host(first, addr(first)).to_string();
        let names: Vec<String> = alloc.nodes.iter().map(|n| n.node.clone()).collect();
        // A big gang: one hostlist, and step addresses in its expansion's order.
        // A heterogeneous job's nodes stay in component order, inline (a
        // hostlist would sort them).
        let (nodes, nodelist) = if sends_hostlist(names.len(), !job.spec.components.is_empty()) {
            let list = gangway_proto::hostlist::compress(&names);
            let expanded = gangway_proto::hostlist::expand(&list)
                .map_err(|e| Status::internal(format!("job {}: its hostlist does not expand: {e}", job.id)))?;
            (expanded, list)
        } else {
            (names, String::new())
        };
        let step_addrs: Vec<String> =
            nodes.iter().map(|n| gangway_proto::step_addr(n, addr(n)).unwrap_or_default()).collect();
        let step_addrs =
            if !nodelist.is_empty() && step_addrs.iter().all(String::is_empty) { Vec::new() } else { step_addrs };
        let spec = &job.spec;
        Ok(LaunchOrder {
            job_id: job.id,
            attempt: job.attempt,
            term: 0,
            name: spec.name.clone(),
            user: spec.user.clone(),
            command: spec.command.clone(),
            script: spec.script.to_string(),
            workdir: spec.workdir.clone(),
            env: spec.env.iter().map(|(k, v)| (k.clone(), v.clone())).collect(),
            gpus: Vec::new(),
            nodes: if nodelist.is_empty() { nodes } else { Vec::new() },
            node_rank: 0,
            tasks_per_node: spec.tasks_per_node,
            cpus_per_task: spec.cpus_per_task,
            time_limit_s: spec.time_limit_s,
            master_addr,
            master_port: MASTER_PORT_BASE
                .saturating_add(u32::try_from(job.id.checked_rem(MASTER_PORT_SPAN).unwrap_or(0)).unwrap_or(0)),
            mem_per_node_mb: spec.mem_per_node_mb,
            output: spec.output.clone(),
            error: spec.error.clone(),
            warn_signal: spec.warn_signal.into(),
            warn_before_s: spec.warn_before_s,
            array_job_id: job.array.map(|a| a.array_job_id),
            array_index: job.array.map(|a| a.index),
            array_count: job.array.map_or(0, |a| a.count),
            account: spec.account.clone(),
            partition: spec.partition.clone(),
            qos: spec.qos.clone(),
            batch: spec.batch,
            step_addrs,
            truncate_output: spec.truncate_output,
            warn_batch_shell: spec.warn_batch_shell,
            step_credential: self.replica.step_credential(job)?,
            nodelist,
            het_groups: if spec.components.is_empty() {
                Vec::new()
            } else {
                spec.shapes()
                    .map(|c| gangway_proto::v1::HetGroup {
                        nodes: c.nodes,
                        tasks_per_node: c.tasks_per_node,
                        cpus_per_task: c.cpus_per_task,
                        mem_per_node_mb: c.mem_per_node_mb,
                        gpus_per_node: c.gpus_per_node,
                        partition: c.partition,
                    })
                    .collect()
            },
        })
    }
}

/// A big gang's order as an agent that predates `LaunchOrder.nodelist`
/// reads it: every node named (and no hostlist it would ignore).
fn name_every_node(order: &mut LaunchOrder) -> Result<(), Status> {
    gangway_proto::hostlist::name_every_node(order, gangway_core::limits::NODES_PER_JOB_MAX as usize)
        .map_err(|e| Status::internal(format!("a launch order for an old agent: {e}")))?;
    order.nodelist.clear();
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A watching agent holds POKE_BUFFER_MAX pokes; one past it is
    /// dropped, not queued, and the next after a read is taken.
    #[test]
    fn a_watcher_holds_poke_buffer_max_pokes() {
        let (tx, mut rx) = pokes();
        let poke = |index| Ok(NodeChanged { index });
        for i in 0..POKE_BUFFER_MAX as u64 {
            assert!(tx.try_send(poke(i)).is_ok());
        }
        assert!(matches!(tx.try_send(poke(99)), Err(tokio::sync::mpsc::error::TrySendError::Full(_))));
        assert!(matches!(rx.try_recv(), Ok(Ok(NodeChanged { index: 0 }))));
        assert!(tx.try_send(poke(100)).is_ok());
    }

    /// A heartbeat reporting TASKS_PER_NODE_REPORTED_MAX tasks and a GPU
    /// health entry per GPU a node can have is taken; one more of either is
    /// refused, naming the field and the limit.
    #[test]
    fn a_heartbeat_is_bounded_before_any_work() {
        let gpus = gangway_core::limits::GPUS_PER_NODE_MAX as usize;
        let mut msg = HeartbeatRequest {
            running: vec![TaskRef::default(); TASKS_PER_NODE_REPORTED_MAX],
            gpu_health: vec![Default::default(); gpus],
            ..Default::default()
        };
        assert!(check_heartbeat(&msg).is_ok());
        msg.running.push(TaskRef::default());
        let err = check_heartbeat(&msg).unwrap_err();
        assert_eq!(err.code(), tonic::Code::InvalidArgument);
        assert_eq!(err.message(), format!("running: at most {TASKS_PER_NODE_REPORTED_MAX} tasks"));
        msg.running.pop();
        msg.gpu_health.push(Default::default());
        let err = check_heartbeat(&msg).unwrap_err();
        assert!(err.message().starts_with(&format!("gpu_health: at most {gpus} GPUs")), "{}", err.message());
    }

    /// Views HEARTBEAT_VIEW_LAG_MAX entries behind apply answer a heartbeat
    /// at once; one more and it waits for fresher ones.
    #[test]
    fn a_heartbeat_waits_only_for_views_past_heartbeat_view_lag_max() {
        assert!(view_is_recent(100, 100 + HEARTBEAT_VIEW_LAG_MAX));
        assert!(!view_is_recent(100, 100 + HEARTBEAT_VIEW_LAG_MAX + 1));
        assert!(view_is_recent(u64::MAX, u64::MAX), "no overflow at the end of the index space");
    }

    /// Gangs from LAUNCH_TEMPLATE_NODES_MIN nodes share a template, smaller
    /// ones do not; past LAUNCH_NODES_INLINE_MAX nodes a job's order names
    /// them as a hostlist, unless it is heterogeneous.
    #[test]
    fn big_gangs_get_templates_and_hostlists() {
        assert!(uses_template(LAUNCH_TEMPLATE_NODES_MIN));
        assert!(!uses_template(LAUNCH_TEMPLATE_NODES_MIN - 1));
        assert!(!sends_hostlist(LAUNCH_NODES_INLINE_MAX, false));
        assert!(sends_hostlist(LAUNCH_NODES_INLINE_MAX + 1, false));
        assert!(!sends_hostlist(LAUNCH_NODES_INLINE_MAX + 1, true));
    }

    fn template(job: u64, script_bytes: usize) -> Arc<LaunchOrder> {
        Arc::new(LaunchOrder { job_id: job, script: "x".repeat(script_bytes), ..Default::default() })
    }

    /// LAUNCH_TEMPLATES_MAX templates are kept, one more drops the oldest;
    /// templates of LAUNCH_TEMPLATES_BYTES_MAX bytes in all are kept, one
    /// byte more drops the oldest; finished attempts' go first.
    #[test]
    fn launch_templates_are_bounded_in_count_and_bytes() {
        let all = |_: &TemplateKey| true;
        let t = LaunchTemplates::default();
        for job in 1..=LAUNCH_TEMPLATES_MAX as u64 {
            t.keep(all, (job, 1, 60), template(job, 0));
        }
        assert!(t.get((1, 1, 60)).is_some(), "dropped within the count");
        t.keep(all, (LAUNCH_TEMPLATES_MAX as u64 + 1, 1, 60), template(0, 0));
        assert!(t.get((1, 1, 60)).is_none(), "one past the count kept the oldest");
        assert!(t.get((2, 1, 60)).is_some());
        t.keep(|k: &TemplateKey| k.0 != 2, (0, 1, 60), template(0, 0));
        assert!(t.get((2, 1, 60)).is_none(), "a finished attempt's template stayed");

        // Two templates of exactly LAUNCH_TEMPLATES_BYTES_MAX bytes together.
        for extra in [0, 1] {
            let t = LaunchTemplates::default();
            let first = template(1, 1024);
            let first_bytes = prost::Message::encoded_len(first.as_ref());
            let want = LAUNCH_TEMPLATES_BYTES_MAX - first_bytes + extra;
            // The script's length, less its field's tag and length prefix and the job id's field.
            let len = want - (prost::Message::encoded_len(template(2, want).as_ref()) - want);
            assert_eq!(prost::Message::encoded_len(template(2, len).as_ref()), want, "no script length fits");
            t.keep(all, (1, 1, 60), first);
            t.keep(all, (2, 1, 60), template(2, len));
            assert_eq!(t.get((1, 1, 60)).is_some(), extra == 0, "{extra} byte(s) past the budget");
            assert!(t.get((2, 1, 60)).is_some(), "the newest template is always kept");
        }
    }
}
