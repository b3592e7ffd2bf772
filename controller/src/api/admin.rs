//! AdminService: cluster status, membership changes, leader transfer, snapshots.

use std::sync::Arc;
use std::time::Duration;

use gangway_proto::v1::admin_service_client::AdminServiceClient;
use gangway_proto::v1::admin_service_server::AdminService;
use gangway_proto::v1::*;
use tonic::{Request, Response, Status};

use super::{status_from_propose, unexpected, CallCtx, Read, Routed};
use crate::raft::{ProposeError, RaftStatus};
use crate::shared::Replica;
use gangway_core::inventory::NodeInventory;
use gangway_core::policy::ClusterPolicy;
use gangway_core::reservation::{ReservationChange, ReservationFlags, ReservationRequest};
use gangway_core::{Command, Outcome};
use gangway_proto::v1::NodeInventory as NodeInventoryMsg;

/// How long ClusterStatus waits for each replica before calling it unreachable.
const STATUS_PROBE_TIMEOUT: Duration = Duration::from_millis(1500);
/// Waiting for a requested snapshot to be built and stored.
const SNAPSHOT_TIMEOUT: Duration = Duration::from_secs(60);
/// Waiting for a membership change to commit (a new learner first catches up).
const MEMBERSHIP_TIMEOUT: Duration = Duration::from_secs(60);

pub struct AdminApi {
    pub replica: Arc<Replica>,
}

/// How long adding a replica waits for it to answer (it may be starting).
const JOINER_PROBE_WAIT: Duration = Duration::from_secs(10);

/// Bytes per backup chunk: well under every message limit.
const BACKUP_CHUNK_BYTES: usize = 1024 * 1024;

fn replica_status(replica: &Replica) -> ReplicaStatus {
    let s = replica.node.status();
    // One view for the format and history it reports.
    let view = replica.node.state().read();
    ReplicaStatus {
        id: s.id,
        role: s.role.as_str().to_string(),
        term: s.term,
        leader_id: s.leader_id,
        last_log_index: s.last_log_index,
        commit_index: s.committed_index,
        applied_index: s.applied_index,
        snapshot_index: s.snapshot_index,
        voter: s.voters.contains(&s.id),
        error: String::new(),
        cert_not_after_unix: replica.cert_not_after(),
        newest_data_format: gangway_core::format::FORMAT_NEWEST,
        data_format: view.format,
        addr: replica.addr.clone(),
        now_unix_ms: Some(crate::now_ms()),
        history: view.history,
        history_since: view.history_since,
        history_pending: view.history_pending,
    }
}

/// A replica being stopped (SIGTERM from systemd or Kubernetes) that leads
/// hands leadership to the most caught-up other voter first: the cluster then
/// has a leader within one transfer, instead of waiting out the lease and an
/// election with writes refused meanwhile. `None` when this replica does not
/// lead or has no other voter; the error says why a transfer failed (the
/// replica stops anyway and the others elect as after a crash).
pub async fn hand_over_leadership(replica: &Arc<Replica>) -> Option<Result<u64, String>> {
    use crate::raft::transfer::transfer_leadership;
    let node = &replica.node;
    if !node.is_leader() {
        return None;
    }
    let status = node.status();
    let to =
        *status.voters.iter().filter(|v| **v != status.id).max_by_key(|v| status.matched.get(v).copied().flatten())?;
    let channel = match status.addrs.get(&to).map(|addr| replica.channel_to(addr)) {
        Some(Ok(c)) => c,
        Some(Err(e)) => return Some(Err(e.message().to_string())),
        None => return Some(Err(format!("replica {to} has no address"))),
    };
    let ask = || {
        let channel = channel.clone();
        async move {
            let mut client = AdminServiceClient::new(channel);
            client.trigger_election(Request::new(TriggerElectionRequest {})).await.is_ok()
        }
    };
    use crate::raft::transfer::TransferError;
    Some(match transfer_leadership(node, to, ask).await {
        Ok(moved) => Ok(moved.leader_id),
        // Another voter won the election: leadership moved all the same.
        Err(TransferError::OtherWon { winner, .. }) => Ok(winner),
        Err(e) => Err(e.to_string()),
    })
}

fn membership(s: &RaftStatus, log_index: u64) -> MembershipResponse {
    MembershipResponse {
        voters: s.voters.iter().copied().collect(),
        learners: s.learners.iter().copied().collect(),
        log_index,
    }
}

impl AdminApi {
    async fn membership_change<M, F, Fut>(
        &self,
        ctx: &CallCtx,
        change: impl std::future::Future<Output = Result<u64, ProposeError>>,
        msg: M,
        forward: F,
    ) -> Result<Response<MembershipResponse>, Status>
    where
        F: FnOnce(tonic::transport::Channel, Request<M>) -> Fut,
        Fut: std::future::Future<Output = Result<Response<MembershipResponse>, Status>>,
    {
        let result = tokio::time::timeout(MEMBERSHIP_TIMEOUT, change)
            .await
            .map_err(|_| Status::deadline_exceeded("the membership change did not commit in time"))?;
        match result {
            Ok(index) => Ok(Response::new(membership(&self.replica.node.status(), index))),
            Err(ProposeError::NotLeader { leader_addr }) => self.replica.forward(ctx, leader_addr, msg, forward).await,
            Err(e) => Err(status_from_propose(e)),
        }
    }
}

/// Largest node inventory document accepted: the request's own limit
/// (`gangway_proto::limits::API_REQUEST_BYTES_MAX`); its content is bounded again by
/// `inventory::INVENTORY_BYTES_MAX` (1 MiB of names), which JSON's quotes
/// and separators at most quadruple.
const INVENTORY_JSON_BYTES_MAX: usize = gangway_proto::limits::API_REQUEST_BYTES_MAX;

fn inventory_of_json(json: &str) -> Result<NodeInventory, Status> {
    if json.len() > INVENTORY_JSON_BYTES_MAX {
        return Err(Status::invalid_argument(format!("json: must be at most {INVENTORY_JSON_BYTES_MAX} bytes")));
    }
    serde_json::from_str(json).map_err(|e| Status::invalid_argument(format!("json: not a node inventory: {e}")))
}

fn inventory_to_proto(i: &NodeInventory, revoked: Vec<String>) -> Result<NodeInventoryMsg, Status> {
    let json = serde_json::to_string(i).map_err(|e| Status::internal(format!("node inventory: cannot encode: {e}")))?;
    Ok(NodeInventoryMsg { json, version: i.version, revoked })
}

/// Largest policy document accepted: 100,000 users at ~100 bytes each, with room.
const POLICY_JSON_BYTES_MAX: usize = 32 * 1024 * 1024;

/// A policy document's text as a policy: at most [`POLICY_JSON_BYTES_MAX`]
/// bytes (checked before it is parsed), and JSON of a policy.
fn policy_of_json(json: &str) -> Result<ClusterPolicy, Status> {
    if json.len() > POLICY_JSON_BYTES_MAX {
        return Err(Status::invalid_argument(format!("json: must be at most {POLICY_JSON_BYTES_MAX} bytes")));
    }
    serde_json::from_str(json).map_err(|e| Status::invalid_argument(format!("json: not a policy document: {e}")))
}

fn policy_to_proto(p: &ClusterPolicy) -> Result<Policy, Status> {
    let json = serde_json::to_string(p).map_err(|e| Status::internal(format!("policy: cannot encode: {e}")))?;
    Ok(Policy { json, version: p.version })
}

/// The reservations named `only` (empty: all), with the window in effect at `now_ms`.
fn reservations_to_proto(state: &gangway_core::State, only: &str, now_ms: u64) -> ListReservationsResponse {
    let reservations = state
        .reservations
        .values()
        .filter(|r| (only.is_empty() || r.name == only) && r.window(now_ms).is_some())
        .map(|r| {
            let (start_ms, end_ms) = r.window(now_ms).unwrap_or((r.start_ms, r.end_ms));
            let nodes = r.nodes.iter().filter_map(|n| state.nodes.get(n));
            let (gpus, cpus) = nodes.fold((0u32, 0u32), |(g, c), n| {
                (g.saturating_add(u32::try_from(n.gpus.len()).unwrap_or(u32::MAX)), c.saturating_add(n.cpus))
            });
            Reservation {
                name: r.name.clone(),
                start_ms,
                end_ms,
                nodes: r.nodes.clone(),
                users: r.users.clone(),
                accounts: r.accounts.clone(),
                flags: r.flags.as_text(),
                created_by: r.created_by.clone(),
                active: r.active(now_ms),
                gpus,
                cpus,
            }
        })
        .collect();
    ListReservationsResponse { reservations }
}

#[tonic::async_trait]
impl AdminService for AdminApi {
    async fn get_policy(&self, req: Request<GetPolicyRequest>) -> Result<Response<Policy>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        let state =
            match self
                .replica
                .read_or_forward(&ctx, msg.stale, msg, |ch, r| async move {
                    AdminServiceClient::new(ch).get_policy(r).await
                })
                .await?
            {
                Read::Here(view) => view,
                Read::Forwarded(resp) => return Ok(resp),
            };
        Ok(Response::new(policy_to_proto(&state.policy)?))
    }

    async fn update_policy(&self, req: Request<UpdatePolicyRequest>) -> Result<Response<Policy>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin_or_coordinator(&ctx, "change the policy")?;
        let msg = req.into_inner();
        let policy = policy_of_json(&msg.json)?;
        policy.validate().map_err(super::status_from_spec)?;
        let (needs, format) = (policy.needs_format(), self.replica.node.state().read().format);
        if needs > format {
            return Err(Status::failed_precondition(format!(
                "this policy needs data format {needs} (operators, coordinators, user_map, user_domains, \
                 allow_root_jobs and private_jobs need 6, licenses 9); this cluster is on format {format} until \
                 every replica runs a build that reads {needs} (see `gangway cluster status`)"
            )));
        }
        let cmd = Command::UpdatePolicy {
            policy,
            expected_version: msg.expected_version,
            force: msg.force,
            identity: ctx.identity.clone(),
            now_ms: crate::now_ms(),
        };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move { AdminServiceClient::new(ch).update_policy(r).await })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::PolicyUpdated { .. } => {
                    let state = self.replica.fresh_view().await?;
                    Ok(Response::new(policy_to_proto(&state.policy)?))
                }
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn get_node_inventory(
        &self,
        req: Request<GetNodeInventoryRequest>,
    ) -> Result<Response<NodeInventoryMsg>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        let state = match self
            .replica
            .read_or_forward(&ctx, msg.stale, msg, |ch, r| async move {
                AdminServiceClient::new(ch).get_node_inventory(r).await
            })
            .await?
        {
            Read::Here(view) => view,
            Read::Forwarded(resp) => return Ok(resp),
        };
        Ok(Response::new(inventory_to_proto(&state.node_inventory, Vec::new())?))
    }

    async fn set_node_inventory(
        &self,
        req: Request<SetNodeInventoryRequest>,
    ) -> Result<Response<NodeInventoryMsg>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin(&ctx, "admit nodes (set the node inventory)")?;
        let msg = req.into_inner();
        let inventory = inventory_of_json(&msg.json)?;
        inventory.validate().map_err(super::status_from_spec)?;
        let cmd = Command::SetNodeInventory {
            inventory,
            expected_version: msg.expected_version,
            identity: ctx.identity.clone(),
            now_ms: crate::now_ms(),
        };
        let routed =
            self.replica
                .write_or_forward(&ctx, cmd, msg, |ch, r| async move {
                    AdminServiceClient::new(ch).set_node_inventory(r).await
                })
                .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::NodeInventorySet { revoked, .. } => {
                    let state = self.replica.fresh_view().await?;
                    Ok(Response::new(inventory_to_proto(&state.node_inventory, revoked)?))
                }
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn restore_usage(&self, req: Request<RestoreUsageRequest>) -> Result<Response<RestoreUsageResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin(&ctx, "restore fair share's usage")?;
        let msg = req.into_inner();
        if msg.accounts.len() > gangway_core::policy::ACCOUNTS_MAX {
            let max = gangway_core::policy::ACCOUNTS_MAX;
            return Err(Status::invalid_argument(format!("accounts: at most {max}")));
        }
        let mut usage = std::collections::BTreeMap::new();
        for a in &msg.accounts {
            let buckets: Vec<gangway_core::state::UsageBucket> = a
                .buckets
                .iter()
                .take(gangway_core::limits::USAGE_BUCKETS_MAX + 1)
                .map(|b| gangway_core::state::UsageBucket { start_ms: b.start_ms, gpu_ms: b.gpu_ms, cpu_ms: b.cpu_ms })
                .collect();
            if usage.insert(a.account.clone(), buckets).is_some() {
                return Err(Status::invalid_argument(format!("accounts: {} is named twice", a.account)));
            }
        }
        let now_ms = crate::now_ms();
        let clock = self.replica.node.state().read().clock_ms.max(now_ms);
        gangway_core::state::check_restored_usage(&usage, clock).map_err(Status::invalid_argument)?;
        let cmd = Command::RestoreUsage { usage, identity: ctx.identity.clone(), now_ms };
        let routed = self
            .replica
            .write_or_forward(&ctx, cmd, msg, |ch, r| async move { AdminServiceClient::new(ch).restore_usage(r).await })
            .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::UsageRestored { accounts } => Ok(Response::new(RestoreUsageResponse { accounts })),
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn accounting_stored(
        &self,
        req: Request<AccountingStoredRequest>,
    ) -> Result<Response<AccountingStoredResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_accounting(&ctx, "report what the accounting store holds")?;
        let msg = req.into_inner();
        // An index of another history names other entries: telling this
        // cluster that those are stored would let it drop jobs the store
        // never saw. (A restored cluster's replicas answer only once its
        // history is drawn, and it never changes again: the check here is enough.)
        let history = super::settled_history(&self.replica.node.state().read())?;
        // (A service that names no history counts in the first one, 0.)
        if let Some(theirs) = Some(msg.history.unwrap_or(0)).filter(|h| *h != history) {
            return Err(Status::failed_precondition(format!(
                "history: index {} counts in cluster history {theirs}, and this cluster's history is {history} \
                 (it was restored from a backup since); follow its events again and report indexes of its history",
                msg.index
            )));
        }
        // An accounting service is no operator in the policy: the replica that
        // authorized it proposes in its own name (the audit trail has whom).
        let identity = if self.replica.is_operator(&ctx) {
            ctx.identity.clone()
        } else {
            format!("server:{}", self.replica.node.id)
        };
        let cmd = Command::AccountingStored { index: msg.index, identity, now_ms: crate::now_ms() };
        let routed =
            self.replica
                .write_or_forward(&ctx, cmd, msg, |ch, r| async move {
                    AdminServiceClient::new(ch).accounting_stored(r).await
                })
                .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::AccountingStored { index } => Ok(Response::new(AccountingStoredResponse { index })),
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn fair_share(&self, req: Request<FairShareRequest>) -> Result<Response<FairShareResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        let msg = req.into_inner();
        let state =
            match self
                .replica
                .read_or_forward(&ctx, msg.stale, msg, |ch, r| async move {
                    AdminServiceClient::new(ch).fair_share(r).await
                })
                .await?
            {
                Read::Here(view) => view,
                Read::Forwarded(resp) => return Ok(resp),
            };
        let shares = gangway_core::sched::fair_share(&state, crate::now_ms());
        let mut pending: std::collections::BTreeMap<&str, u64> = Default::default();
        for id in &state.pending {
            let n = pending.entry(state.jobs[id].spec.account.as_str()).or_default();
            *n = n.saturating_add(1);
        }
        let accounts = shares
            .iter()
            .map(|(name, s)| {
                let running = state.running_use.get(&gangway_core::state::UseKey::Account(name.clone())).copied();
                let (parent, raw_shares) = match state.policy.accounts.get(name) {
                    Some(a) => (state.policy.parent_of(name).to_string(), a.shares),
                    None => (String::new(), 1),
                };
                AccountShare {
                    account: name.clone(),
                    parent,
                    shares: raw_shares,
                    norm_shares: s.norm_shares,
                    gpu_hours: s.gpu_hours,
                    cpu_hours: s.cpu_hours,
                    norm_usage: s.norm_usage,
                    factor: s.factor,
                    running_gpus: running.map_or(0, |u| u.gpus),
                    running_jobs: running.map_or(0, |u| u.jobs),
                    pending_jobs: pending.get(name.as_str()).copied().unwrap_or(0),
                }
            })
            .collect();
        // What it looked at: every pending job and every account's usage.
        let looked = state.pending.len().saturating_add(state.usage.values().map(|u| u.len()).sum());
        self.replica.charge_read(&ctx, crate::ratelimit::read_units(looked, 0));
        Ok(Response::new(FairShareResponse { accounts }))
    }

    async fn list_reservations(
        &self,
        req: Request<ListReservationsRequest>,
    ) -> Result<Response<ListReservationsResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        ctx.require_known()?;
        let msg = req.into_inner();
        let state = match self
            .replica
            .read_or_forward(&ctx, msg.stale, msg.clone(), |ch, r| async move {
                AdminServiceClient::new(ch).list_reservations(r).await
            })
            .await?
        {
            Read::Here(view) => view,
            Read::Forwarded(resp) => return Ok(resp),
        };
        let live = |name: &str| state.reservations.get(name).is_some_and(|r| r.window(crate::now_ms()).is_some());
        if !msg.name.is_empty() && !live(&msg.name) {
            return Err(Status::not_found(format!("reservation {} does not exist", msg.name)));
        }
        let looked = state.reservations.values().map(|r| r.nodes.len()).fold(0usize, usize::saturating_add);
        self.replica.charge_read(&ctx, crate::ratelimit::read_units(looked, 0));
        Ok(Response::new(reservations_to_proto(&state, &msg.name, crate::now_ms())))
    }

    async fn change_reservation(
        &self,
        req: Request<ChangeReservationRequest>,
    ) -> Result<Response<ListReservationsResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_operator(&ctx, "manage reservations")?;
        let msg = req.into_inner();
        let spec = msg.spec.clone().unwrap_or_default();
        let request = || -> Result<ReservationRequest, Status> {
            Ok(ReservationRequest {
                name: spec.name.clone(),
                start_ms: spec.start_ms,
                end_ms: spec.end_ms,
                nodes: spec.nodes.clone(),
                gpus: spec.gpus,
                partition: spec.partition.clone(),
                users: spec.users.clone(),
                accounts: spec.accounts.clone(),
                flags: ReservationFlags::parse(&spec.flags).map_err(super::status_from_spec)?,
            })
        };
        let change = match msg.action.as_str() {
            "create" => ReservationChange::Create(request()?),
            "update" => ReservationChange::Update(request()?),
            "delete" => {
                gangway_core::reservation::check_name(&spec.name).map_err(super::status_from_spec)?;
                ReservationChange::Delete { name: spec.name.clone() }
            }
            other => {
                return Err(Status::invalid_argument(format!("action: '{other}' is not create, update or delete")))
            }
        };
        if let ReservationChange::Create(r) | ReservationChange::Update(r) = &change {
            let state = self.replica.node.state().read();
            let existing = state.reservations.len().saturating_sub(usize::from(msg.action == "update"));
            gangway_core::reservation::check_request(r, crate::now_ms(), existing).map_err(super::status_from_spec)?;
        }
        let format = self.replica.node.state().read().format;
        if format < gangway_core::format::SLURM_FEATURES_FORMAT {
            return Err(Status::failed_precondition(format!(
                "reservations need data format {}; this cluster is on format {format} until every replica runs a \
                 build that reads it (see `gangway cluster status`)",
                gangway_core::format::SLURM_FEATURES_FORMAT
            )));
        }
        let name = spec.name.clone();
        let cmd = Command::ChangeReservation { change, identity: ctx.identity.clone(), now_ms: crate::now_ms() };
        let routed =
            self.replica
                .write_or_forward(&ctx, cmd, msg, |ch, r| async move {
                    AdminServiceClient::new(ch).change_reservation(r).await
                })
                .await?;
        match routed {
            Routed::Forwarded(resp) => Ok(resp),
            Routed::Local(applied) => match applied.outcome {
                Outcome::ReservationChanged { .. } => {
                    let state = self.replica.fresh_view().await?;
                    let shown = if state.reservations.contains_key(&name) { name.as_str() } else { "\0none" };
                    Ok(Response::new(reservations_to_proto(&state, shown, crate::now_ms())))
                }
                other => Err(unexpected(&other)),
            },
        }
    }

    async fn licenses(&self, req: Request<LicensesRequest>) -> Result<Response<LicensesResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        ctx.require_known()?;
        let msg = req.into_inner();
        let state = match self
            .replica
            .read_or_forward(&ctx, msg.stale, msg, |ch, r| async move { AdminServiceClient::new(ch).licenses(r).await })
            .await?
        {
            Read::Here(view) => view,
            Read::Forwarded(resp) => return Ok(resp),
        };
        let licenses = state
            .policy
            .licenses
            .iter()
            .map(|(name, &total)| License { name: name.clone(), total, used: state.licenses_in_use(name) })
            .collect();
        Ok(Response::new(LicensesResponse { licenses }))
    }

    async fn cluster_status(
        &self,
        req: Request<ClusterStatusRequest>,
    ) -> Result<Response<ClusterStatusResponse>, Status> {
        self.replica.ctx(&req)?.require_known()?;
        let me = self.replica.node.status();
        let members: Vec<(u64, String)> = me.addrs.iter().map(|(id, a)| (*id, a.clone())).collect();
        let probes = members.iter().map(|(id, addr)| {
            let id = *id;
            let addr = addr.clone();
            let replica = self.replica.clone();
            let me = me.clone();
            async move {
                if id == me.id {
                    return replica_status(&replica);
                }
                probe_replica(&replica, &addr).await.unwrap_or_else(|error| ReplicaStatus {
                    id,
                    addr: addr.clone(),
                    role: gangway_proto::ReplicaRole::Unreachable.as_str().into(),
                    error,
                    voter: me.voters.contains(&id),
                    ..Default::default()
                })
            }
        });
        let replicas = futures::future::join_all(probes).await;
        // The freshest view of the leader: the highest term any replica reports.
        let best = replicas
            .iter()
            .filter(|r| r.replica_role() != Some(gangway_proto::ReplicaRole::Unreachable))
            .max_by_key(|r| r.term);
        Ok(Response::new(ClusterStatusResponse {
            leader_id: best.and_then(|r| r.leader_id),
            term: best.map(|r| r.term).unwrap_or(me.term),
            replicas,
            data_format: self.replica.node.state().read().format,
        }))
    }

    async fn get_replica_status(&self, req: Request<ReplicaStatusRequest>) -> Result<Response<ReplicaStatus>, Status> {
        self.replica.ctx(&req)?.require_known()?;
        Ok(Response::new(replica_status(&self.replica)))
    }

    async fn add_learner(&self, req: Request<AddLearnerRequest>) -> Result<Response<MembershipResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin(&ctx, "add replicas")?;
        let msg = req.into_inner();
        if msg.id == 0 {
            return Err(Status::invalid_argument("id: replica ids start at 1"));
        }
        let addr =
            crate::config::ReplicaAddr::parse(&msg.addr).map_err(|e| Status::invalid_argument(format!("addr: {e}")))?;
        // A build that cannot read the cluster's data format would stop at
        // the first entry it is sent: refuse it here, with the reason.
        // (A replica started a moment ago may not listen yet: ask again for a while.)
        let cluster_format = self.replica.node.state().read().format;
        let deadline = crate::deadline_in(JOINER_PROBE_WAIT);
        let (newest, advertised) = loop {
            match probe_replica(&self.replica, &addr.api).await {
                Ok(s) => break (s.newest_data_format.max(gangway_core::format::FORMAT_BASE), s.addr),
                Err(e) if tokio::time::Instant::now() >= deadline => {
                    return Err(Status::failed_precondition(format!(
                        "addr: cannot reach replica {} at {} to check its build ({e}); start it with --join first",
                        msg.id, msg.addr
                    )))
                }
                Err(_) => tokio::time::sleep(Duration::from_millis(200)).await,
            }
        };
        if newest < cluster_format {
            return Err(Status::failed_precondition(format!(
                "replica {}: its build reads data formats up to {newest}, the cluster is at {cluster_format}; \
                 run a newer build on it",
                msg.id
            )));
        }
        // Raft goes where the address says: it must be where the replica
        // serves it (its peer port, or none), as the replica itself says.
        // (By port: the host it calls itself may be another name for it.)
        if let Ok(own) = crate::config::ReplicaAddr::parse(&advertised) {
            let port = |a: &str| a.rsplit_once(':').map(|(_, p)| p.to_string()).unwrap_or_default();
            if own.split != addr.split || port(&own.peer) != port(&addr.peer) {
                let want = match own.split {
                    true => format!("{}/{}", addr.api, port(&own.peer)),
                    false => addr.api.clone(),
                };
                return Err(Status::failed_precondition(format!(
                    "addr: replica {} serves Raft on {} (it advertises {advertised}): add it as {want}",
                    msg.id,
                    if own.split { "a peer port" } else { "its API port" },
                )));
            }
        }
        let change = self.replica.node.add_learner(msg.id, addr.format());
        self.membership_change(
            &ctx,
            change,
            msg,
            |ch, r| async move { AdminServiceClient::new(ch).add_learner(r).await },
        )
        .await
    }

    async fn promote(&self, req: Request<PromoteRequest>) -> Result<Response<MembershipResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin(&ctx, "promote replicas")?;
        let msg = req.into_inner();
        let status = self.replica.node.status();
        if self.replica.node.is_leader() && !status.learners.contains(&msg.id) {
            return Err(Status::failed_precondition(format!(
                "id: replica {} is not a learner; add it with `gangway cluster add` first",
                msg.id
            )));
        }
        let change = self.replica.node.promote(msg.id);
        self.membership_change(&ctx, change, msg, |ch, r| async move { AdminServiceClient::new(ch).promote(r).await })
            .await
    }

    async fn remove_member(&self, req: Request<RemoveMemberRequest>) -> Result<Response<MembershipResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin(&ctx, "remove replicas")?;
        let msg = req.into_inner();
        let status = self.replica.node.status();
        if self.replica.node.is_leader() {
            if msg.id == status.id {
                return Err(Status::failed_precondition(format!(
                    "id: replica {} is the leader; move leadership away first (`gangway cluster transfer-leader`)",
                    msg.id
                )));
            }
            if status.voters.contains(&msg.id) && status.voters.len() <= 1 {
                return Err(Status::failed_precondition("id: cannot remove the last voter"));
            }
        }
        let change = self.replica.node.remove_member(msg.id);
        self.membership_change(
            &ctx,
            change,
            msg,
            |ch, r| async move { AdminServiceClient::new(ch).remove_member(r).await },
        )
        .await
    }

    async fn transfer_leader(
        &self,
        req: Request<TransferLeaderRequest>,
    ) -> Result<Response<TransferLeaderResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin(&ctx, "move leadership")?;
        let msg = req.into_inner();
        let node = &self.replica.node;
        if !node.is_leader() {
            let leader = node.remote_leader();
            return self
                .replica
                .forward(&ctx, leader, msg, |ch, r| async move { AdminServiceClient::new(ch).transfer_leader(r).await })
                .await;
        }
        let to = msg.to;
        // The channel first: a bad address is an error now, not a pause of
        // heartbeats with no candidate asked to stand.
        let status = node.status();
        let channel = match status.addrs.get(&to) {
            Some(addr) if to != status.id => Some(self.replica.channel_to(addr)?),
            _ => None,
        };
        let ask = || {
            let channel = channel.clone();
            async move {
                let Some(channel) = channel else { return false };
                let mut client = AdminServiceClient::new(channel);
                client.trigger_election(Request::new(TriggerElectionRequest {})).await.is_ok()
            }
        };
        use crate::raft::transfer::{transfer_leadership, TransferError};
        match transfer_leadership(node, to, ask).await {
            Ok(moved) => Ok(Response::new(TransferLeaderResponse { leader_id: moved.leader_id, term: moved.term })),
            Err(e @ TransferError::NotVoter(_)) => Err(Status::invalid_argument(e.to_string())),
            Err(e @ TransferError::OtherWon { .. }) => Err(Status::aborted(e.to_string())),
            Err(e) => Err(Status::unavailable(e.to_string())),
        }
    }

    type AuditStream = std::pin::Pin<Box<dyn futures::Stream<Item = Result<AuditEntry, Status>> + Send>>;
    type BackupStream = std::pin::Pin<Box<dyn futures::Stream<Item = Result<BackupChunk, Status>> + Send>>;

    async fn backup(&self, req: Request<BackupRequest>) -> Result<Response<Self::BackupStream>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin(&ctx, "take a backup")?;
        let shared = self.replica.node.state().clone();
        let taken_by = self.replica.node.id;
        // Encoding a large state takes a while: off the async workers.
        let file = tokio::task::spawn_blocking(move || {
            let (index, snapshot) = shared.snapshot_with_index();
            let backup = gangway_raft_store::backup::Backup { index, taken_by, taken_at_ms: crate::now_ms(), snapshot };
            (index, backup.to_bytes())
        })
        .await
        .map_err(|_| Status::internal("backup: encoding the state failed"))?;
        let (index, bytes) = file;
        tracing::info!(index, bytes = bytes.len(), caller = %ctx.identity, "backup taken");
        let total_bytes = bytes.len() as u64;
        // Chunks are cut as the stream is read: one copy of the file, not two.
        let chunks = (0..bytes.len().div_ceil(BACKUP_CHUNK_BYTES)).map(move |i| {
            let start = i.saturating_mul(BACKUP_CHUNK_BYTES);
            let end = start.saturating_add(BACKUP_CHUNK_BYTES).min(bytes.len());
            let first = i == 0;
            Ok(BackupChunk {
                data: bytes[start..end].to_vec(),
                index: if first { index } else { 0 },
                total_bytes: if first { total_bytes } else { 0 },
            })
        });
        Ok(Response::new(Box::pin(futures::stream::iter(chunks))))
    }

    async fn audit(&self, req: Request<AuditRequest>) -> Result<Response<Self::AuditStream>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin(&ctx, "read the audit trail")?;
        let auth = self.replica.stream_auth(&req, true);
        let slot = self.replica.streams.take(&ctx.identity)?;
        let (backlog, mut rx) = self.replica.audit.follow(req.into_inner().from_seq);
        let replica_id = self.replica.node.id;
        let entry = move |e: crate::audit::AuditEvent| AuditEntry {
            seq: e.seq,
            time_ms: e.time_ms,
            replica_id,
            caller: e.caller,
            action: e.action,
            target: e.target,
            outcome: e.outcome.to_string(),
            reason: e.reason,
        };
        let (tx, out) = tokio::sync::mpsc::channel(crate::audit::AUDIT_STREAM_BUFFER);
        let closed = self.replica.closed();
        let replica = self.replica.clone();
        tokio::spawn(async move {
            let _slot = slot;
            tokio::pin!(closed);
            let mut last = 0;
            for e in backlog {
                last = e.seq;
                if tx.send(Ok(entry(e))).await.is_err() {
                    return;
                }
            }
            let mut recheck = tokio::time::interval(super::jobs::STREAM_RECHECK_INTERVAL);
            recheck.set_missed_tick_behavior(tokio::time::MissedTickBehavior::Delay);
            loop {
                let next = tokio::select! {
                    n = rx.recv() => n,
                    _ = tx.closed() => return,
                    _ = recheck.tick() => {
                        if let Err(s) = replica.still_allowed(&ctx, &auth) {
                            let _ = tx.send(Err(s)).await;
                            return;
                        }
                        continue;
                    }
                    _ = &mut closed => return,
                };
                match next {
                    Ok(e) if e.seq <= last => {}
                    Ok(e) => {
                        last = e.seq;
                        if tx.send(Ok(entry(e))).await.is_err() {
                            return;
                        }
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Lagged(n)) => {
                        let _ = tx
                            .send(Err(Status::resource_exhausted(format!(
                                "the audit stream fell {n} entries behind; resume with from_seq {last}"
                            ))))
                            .await;
                        return;
                    }
                    Err(tokio::sync::broadcast::error::RecvError::Closed) => return,
                }
            }
        });
        Ok(Response::new(Box::pin(tokio_stream::wrappers::ReceiverStream::new(out))))
    }

    async fn snapshot(&self, req: Request<SnapshotRequest>) -> Result<Response<SnapshotResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin(&ctx, "take snapshots")?;
        let index = self.replica.node.snapshot(SNAPSHOT_TIMEOUT).await.map_err(status_from_propose)?;
        Ok(Response::new(SnapshotResponse { index }))
    }

    async fn trigger_election(
        &self,
        req: Request<TriggerElectionRequest>,
    ) -> Result<Response<TriggerElectionResponse>, Status> {
        let ctx = self.replica.ctx(&req)?;
        self.replica.require_admin(&ctx, "trigger elections")?;
        self.replica.node.trigger_election().await.map_err(status_from_propose)?;
        Ok(Response::new(TriggerElectionResponse {}))
    }
}

/// Another replica's own status, asked over gRPC (bounded by STATUS_PROBE_TIMEOUT).
pub(crate) async fn probe_replica(replica: &Replica, addr: &str) -> Result<ReplicaStatus, String> {
    let channel = replica.channel_to(addr).map_err(|e| e.message().to_string())?;
    let mut req = Request::new(ReplicaStatusRequest {});
    req.set_timeout(STATUS_PROBE_TIMEOUT);
    match tokio::time::timeout(STATUS_PROBE_TIMEOUT, AdminServiceClient::new(channel).get_replica_status(req)).await {
        Ok(Ok(r)) => Ok(r.into_inner()),
        Ok(Err(s)) => Err(s.message().to_string()),
        Err(_) => Err("timed out".into()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An inventory document of INVENTORY_JSON_BYTES_MAX bytes is parsed;
    /// one byte more is refused before parsing.
    #[test]
    fn an_inventory_document_is_bounded_at_the_edge() {
        let doc = |len: usize| format!("{{}}{}", " ".repeat(len - 2));
        assert_eq!(inventory_of_json(&doc(INVENTORY_JSON_BYTES_MAX)).unwrap(), NodeInventory::default());
        let e = inventory_of_json(&doc(INVENTORY_JSON_BYTES_MAX + 1)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.message(), format!("json: must be at most {INVENTORY_JSON_BYTES_MAX} bytes"));
        // A valid inventory of the most bytes fits as JSON: a name costs at
        // most four bytes per byte (`"a",`, `"k":"v",`), and each class its
        // field names once.
        use gangway_core::inventory::*;
        let one = NodeInventory { retired: ["a".to_string()].into(), ..NodeInventory::default() };
        let empty = serde_json::to_string(&NodeInventory::default()).unwrap().len();
        assert!(serde_json::to_string(&one).unwrap().len() - empty <= 4);
        let class = serde_json::to_string(&NodeClass::default()).unwrap().len();
        assert!(4 * INVENTORY_BYTES_MAX + NODE_CLASSES_MAX * (class + 8) + empty < INVENTORY_JSON_BYTES_MAX);
    }

    /// A policy document of POLICY_JSON_BYTES_MAX bytes is parsed; one byte
    /// more is refused before parsing, naming the field and the limit.
    #[test]
    fn a_policy_document_is_bounded_at_the_edge() {
        let doc = |len: usize| format!("{{}}{}", " ".repeat(len - 2));
        assert_eq!(policy_of_json(&doc(POLICY_JSON_BYTES_MAX)).unwrap(), ClusterPolicy::default());
        let e = policy_of_json(&doc(POLICY_JSON_BYTES_MAX + 1)).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.message(), format!("json: must be at most {POLICY_JSON_BYTES_MAX} bytes"));
    }
}
