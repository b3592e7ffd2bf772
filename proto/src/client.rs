//! The client library: connects to any of a cluster's replicas and fails over.
//!
//! Replicas forward writes and linearizable reads to the leader themselves, so a
//! client only needs one live replica. When a call fails with a retryable status
//! (the replica is down, or the leader changed mid-call), [`Client::call`] tries
//! the next endpoint, backing off between rounds, within a bounded number of
//! attempts and an overall deadline. Submits carry an idempotency key, so a retry
//! after an unknown outcome never creates a second job.

use std::future::Future;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use tonic::metadata::MetadataValue;
use tonic::transport::Channel;
use tonic::{Code, Request, Response, Status};

use crate::tls::{Expect, Security};
use crate::IDENTITY_METADATA_KEY;

/// Attempts of one call across all endpoints. With three replicas and the
/// backoff below this is ~100 rounds, about 10 s of retrying: enough to ride out
/// a leader election or a replica restart.
pub const CALL_ATTEMPTS_MAX: usize = 300;
/// Overall time one call may spend retrying. A Raft election here takes well
/// under a second; 15 s also covers a replica that restarts.
pub const CALL_DEADLINE: Duration = Duration::from_secs(15);
/// Pause after every endpoint failed once, doubling up to the cap. The cap is
/// short so a client notices a new leader within ~0.1 s of its election.
const BACKOFF_START: Duration = Duration::from_millis(10);
const BACKOFF_CAP: Duration = Duration::from_millis(100);
/// A node agent's backoff cap: a fleet of thousands retrying every 100 ms
/// through an election floods the replicas that are electing; an agent has
/// its whole self-fence window (seconds) to get through. Each pause is
/// jittered between half and all of it, so the fleet's retries spread out.
pub const FLEET_BACKOFF_CAP: Duration = Duration::from_secs(1);
/// How long connecting to one endpoint may take before trying the next.
const CONNECT_TIMEOUT: Duration = Duration::from_secs(2);
/// A single attempt's time limit (a write waits for a Raft commit).
const ATTEMPT_TIMEOUT: Duration = Duration::from_secs(12);
/// The metadata key of a server's retry hint on RESOURCE_EXHAUSTED
/// (milliseconds): a caller over its read or write budget, or a replica
/// whose read lane is full, says when to come back.
pub const RETRY_AFTER_METADATA_KEY: &str = "retry-after-ms";
/// The longest retry hint a call waits out before it gives the refusal to
/// its caller instead (a script should see "over budget", not hang).
pub const RETRY_AFTER_MAX: Duration = Duration::from_secs(5);

/// The pause a RESOURCE_EXHAUSTED refusal asks for, when it names one no
/// longer than RETRY_AFTER_MAX.
pub fn retry_after(status: &Status) -> Option<Duration> {
    if status.code() != Code::ResourceExhausted {
        return None;
    }
    let ms: u64 = status.metadata().get(RETRY_AFTER_METADATA_KEY)?.to_str().ok()?.parse().ok()?;
    Some(Duration::from_millis(ms)).filter(|d| *d <= RETRY_AFTER_MAX)
}

#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    #[error("no controller endpoints given (use --endpoints or GANGWAY_ENDPOINTS)")]
    NoEndpoints,
    #[error("endpoint '{0}' is not a valid address: {1}")]
    BadEndpoint(String, String),
    #[error("identity '{0}' cannot be sent as gRPC metadata (use printable ASCII)")]
    BadIdentity(String),
    #[error("TLS: {0}")]
    Tls(String),
    #[error("the token cannot be sent as gRPC metadata (it must be printable ASCII)")]
    BadToken,
}

/// A cluster client. Cheap to share by reference across tasks.
pub struct Client {
    endpoints: Vec<String>,
    channels: Vec<Channel>,
    identity: MetadataValue<tonic::metadata::Ascii>,
    /// Whether the identity is sent as a claim (plaintext clusters only; a
    /// secured cluster reads it from the certificate).
    claims_identity: bool,
    security: Security,
    /// `Bearer TOKEN`, sent with every request when the client has a token.
    bearer: Option<MetadataValue<tonic::metadata::Ascii>>,
    step_credential: Option<MetadataValue<tonic::metadata::Ascii>>,
    /// The endpoint that answered last; calls start there.
    preferred: AtomicUsize,
    /// The endpoint whose last attempt failed (usize::MAX: none): a leader
    /// hint naming it is not followed until it answers again.
    unreachable: AtomicUsize,
    /// The longest pause between rounds, and whether pauses are jittered.
    backoff_cap: Duration,
    jitter: bool,
}

/// Between half and all of `d`, from the clock's nanoseconds (no
/// randomness source needed: agents on different hosts and moments differ).
fn jittered(d: Duration) -> Duration {
    let nanos = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |t| t.subsec_nanos());
    let half = d.checked_div(2).unwrap_or_default();
    let span = u64::try_from(half.as_nanos()).unwrap_or(u64::MAX).max(1);
    half.saturating_add(Duration::from_nanos(u64::from(nanos).checked_rem(span).unwrap_or(0)))
}

/// The pause after one of `backoff`: twice as long, at most `cap`.
fn next_backoff(backoff: Duration, cap: Duration) -> Duration {
    backoff.saturating_mul(2).min(cap)
}

/// Whether a status means the call never got a real answer: the connection
/// failed or was torn down (a replica stopping mid-call surfaces as an HTTP/2
/// protocol error with code INTERNAL).
pub fn is_transport_failure(status: &Status) -> bool {
    match status.code() {
        Code::Unavailable | Code::Unknown | Code::Cancelled => true,
        Code::Internal => {
            let m = status.message();
            m.contains("h2 protocol error") || m.contains("transport error") || m.contains("connection")
        }
        _ => false,
    }
}

/// Whether a failed call may be retried on another replica. A TLS refusal
/// (a certificate the peer or we do not accept) is not: every replica would
/// refuse it alike.
pub fn is_retryable(status: &Status) -> bool {
    (is_transport_failure(status) || status.code() == Code::DeadlineExceeded) && tls_refusal(status).is_none()
}

/// The status's message with the errors that caused it ("transport error"
/// alone says nothing about a refused certificate).
pub fn describe(status: &Status) -> String {
    with_sources(status.message().to_string(), std::error::Error::source(status))
}

/// `msg` followed by the errors that caused it (each once).
pub fn with_sources(mut msg: String, mut src: Option<&(dyn std::error::Error + 'static)>) -> String {
    let mut depth = 0u32;
    // Error chains are short; the bound only guards against a cycle.
    while let Some(s) = src.filter(|_| depth < 8) {
        let part = s.to_string();
        if !msg.contains(&part) {
            msg = format!("{msg}: {part}");
        }
        src = s.source();
        depth = depth.saturating_add(1);
    }
    msg
}

/// Why TLS refused the connection, when it did.
pub fn tls_refusal(status: &Status) -> Option<String> {
    let text = describe(status);
    // Only explicit refusals: a handshake that times out (a partitioned
    // replica) must still fail over to the next one.
    const SIGNS: [&str; 4] =
        ["invalid peer certificate", "received fatal alert", "UnknownIssuer", "CertificateExpired"];
    SIGNS.iter().any(|s| text.contains(s)).then_some(text)
}

/// Pages one listing may take: each page holds at least one item, and a
/// cluster has at most 20,000 nodes (a page holds hundreds).
const LIST_PAGES_MAX: usize = 20_000;

/// The items of a paged listing, reading at most `pages_max` pages:
/// `fetch(cursor)` answers one page and the cursor of the next (`None` at
/// the end). With them, whether the listing ended within `pages_max` pages.
pub async fn paged<T, C, E, F, Fut>(pages_max: usize, mut cursor: C, mut fetch: F) -> Result<(Vec<T>, bool), E>
where
    F: FnMut(C) -> Fut,
    Fut: Future<Output = Result<(Vec<T>, Option<C>), E>>,
{
    let mut all = Vec::new();
    for _ in 0..pages_max {
        let (items, next) = fetch(cursor).await?;
        all.extend(items);
        match next {
            None => return Ok((all, true)),
            Some(next) => cursor = next,
        }
    }
    Ok((all, false))
}

impl Client {
    /// Every node, following the pages the server cuts by size.
    pub async fn list_nodes(&self, stale: bool) -> Result<Vec<crate::v1::Node>, Status> {
        use crate::v1::node_service_client::NodeServiceClient;
        // A page holds at least one node: the list ends within NODES_MAX pages.
        let (all, whole) = paged(LIST_PAGES_MAX, String::new(), |after_name| async move {
            let req = crate::v1::ListNodesRequest { stale, after_name };
            let page = self
                .call(|ch| {
                    let r = self.request(req.clone());
                    async move { NodeServiceClient::new(ch).list(r).await }
                })
                .await?
                .into_inner();
            let next = Some(page.next_after_name).filter(|n| !n.is_empty());
            Ok::<_, Status>((page.nodes, next))
        })
        .await?;
        if !whole {
            return Err(Status::out_of_range(format!("the node list did not end within {LIST_PAGES_MAX} pages")));
        }
        Ok(all)
    }

    /// Builds a client; connections are made on first use, over mutual TLS
    /// unless `security` is `Insecure`. `identity` is what this client calls
    /// itself: sent as a claim to an insecure cluster, only shown otherwise.
    pub fn new(endpoints: &[String], identity: &str, security: &Security) -> Result<Client, ClientError> {
        let endpoints: Vec<String> = endpoints.iter().map(|e| e.trim().to_string()).filter(|e| !e.is_empty()).collect();
        if endpoints.is_empty() {
            return Err(ClientError::NoEndpoints);
        }
        let mut channels = Vec::with_capacity(endpoints.len());
        for e in &endpoints {
            let ch = security.channel(e, Expect::Server, CONNECT_TIMEOUT).map_err(|err| {
                if err.starts_with("address") {
                    ClientError::BadEndpoint(e.clone(), err)
                } else {
                    ClientError::Tls(err)
                }
            })?;
            channels.push(ch);
        }
        let identity = identity.parse().map_err(|_| ClientError::BadIdentity(identity.to_string()))?;
        Ok(Client {
            endpoints,
            channels,
            identity,
            claims_identity: security.is_insecure(),
            security: security.clone(),
            bearer: None,
            step_credential: None,
            preferred: AtomicUsize::new(0),
            unreachable: AtomicUsize::new(usize::MAX),
            backoff_cap: BACKOFF_CAP,
            jitter: false,
        })
    }

    /// The same client connecting from the local address `from` (over TLS).
    pub fn from_address(mut self, from: std::net::IpAddr) -> Result<Client, ClientError> {
        let mut channels = Vec::with_capacity(self.endpoints.len());
        for e in &self.endpoints {
            let ch =
                self.security.channel_from(e, Expect::Server, CONNECT_TIMEOUT, Some(from)).map_err(ClientError::Tls)?;
            channels.push(ch);
        }
        self.channels = channels;
        Ok(self)
    }

    /// A client of one of a fleet's agents: pauses between rounds of retries
    /// grow to [`FLEET_BACKOFF_CAP`] and are jittered.
    pub fn for_fleet(mut self) -> Client {
        self.backoff_cap = FLEET_BACKOFF_CAP;
        self.jitter = true;
        self
    }

    /// Which of this client's endpoints is `addr` (as a replica advertises
    /// it: `host:port`, perhaps with a scheme).
    fn endpoint_index(&self, addr: &str) -> Option<usize> {
        let bare = |s: &str| {
            let s = s.trim();
            let s = s.strip_prefix("http://").or_else(|| s.strip_prefix("https://")).unwrap_or(s);
            s.trim_end_matches('/').to_ascii_lowercase()
        };
        let want = bare(addr);
        self.endpoints.iter().position(|e| bare(e) == want)
    }

    /// The endpoint the next call starts with.
    pub fn preferred_endpoint(&self) -> &str {
        // `new` refuses an empty list, so the remainder is always defined.
        &self.endpoints[self.preferred.load(Ordering::Relaxed).checked_rem(self.endpoints.len()).unwrap_or(0)]
    }

    /// The caller identity every request carries.
    pub fn identity(&self) -> &str {
        self.identity.to_str().unwrap_or_default()
    }

    /// Sends `token` (a JWT from `gangway token create` or a site's issuer)
    /// with every request, for a client without a certificate of its own.
    pub fn with_bearer(mut self, token: &str) -> Result<Client, ClientError> {
        let v = format!("Bearer {}", token.trim()).parse().map_err(|_| ClientError::BadToken)?;
        self.bearer = Some(v);
        Ok(self)
    }

    /// Sends a job's step credential with every request: what srun inside a
    /// job proves itself with (the controllers take it only to say where the
    /// job's nodes are).
    pub fn with_step_credential(mut self, credential: &str) -> Result<Client, ClientError> {
        let v = credential.trim().parse().map_err(|_| ClientError::BadToken)?;
        self.step_credential = Some(v);
        Ok(self)
    }

    /// How this client connects (its certificates, when secured).
    pub fn security(&self) -> &Security {
        &self.security
    }

    /// One channel per endpoint, in the order given (for calls that must reach
    /// every replica, such as their audit trails).
    pub fn channels(&self) -> &[Channel] {
        &self.channels
    }

    pub fn endpoints(&self) -> &[String] {
        &self.endpoints
    }

    /// Wraps a message in a request that carries the caller identity.
    pub fn request<T>(&self, msg: T) -> Request<T> {
        let mut req = self.stream_request(msg);
        req.set_timeout(ATTEMPT_TIMEOUT);
        req
    }

    /// Like [`Client::request`] but without a deadline, for long-lived streams.
    pub fn stream_request<T>(&self, msg: T) -> Request<T> {
        let mut req = Request::new(msg);
        if self.claims_identity {
            req.metadata_mut().insert(IDENTITY_METADATA_KEY, self.identity.clone());
        }
        if let Some(b) = &self.bearer {
            req.metadata_mut().insert(crate::token::AUTHORIZATION_METADATA_KEY, b.clone());
        }
        if let Some(c) = &self.step_credential {
            req.metadata_mut().insert(crate::step_cred::STEP_CREDENTIAL_METADATA_KEY, c.clone());
        }
        req
    }

    /// Runs `op` against a replica, failing over to the others on retryable
    /// errors. A replica that forwarded the call names the leader
    /// ([`crate::LEADER_METADATA_KEY`]): the next calls start there.
    pub async fn call<T, F, Fut>(&self, op: F) -> Result<Response<T>, Status>
    where
        F: Fn(Channel) -> Fut,
        Fut: Future<Output = Result<Response<T>, Status>>,
    {
        let started = Instant::now();
        let n = self.channels.len();
        let mut backoff = BACKOFF_START;
        let mut last = Status::unavailable("no attempt made");
        // Endpoints that failed during this call: a forwarded answer's leader
        // hint naming one of them (unreachable from here, though a follower
        // reaches it) is not followed.
        let mut failed = vec![false; n];
        for attempt in 0..CALL_ATTEMPTS_MAX {
            // `preferred` < n and `attempt` < CALL_ATTEMPTS_MAX; n > 0 (`new`
            // refuses an empty list).
            let i = self.preferred.load(Ordering::Relaxed).saturating_add(attempt).checked_rem(n).unwrap_or(0);
            match op(self.channels[i].clone()).await {
                Ok(v) => {
                    let leader = v.metadata().get(crate::LEADER_METADATA_KEY).and_then(|l| l.to_str().ok());
                    let _ = self.unreachable.compare_exchange(i, usize::MAX, Ordering::Relaxed, Ordering::Relaxed);
                    let unreachable = self.unreachable.load(Ordering::Relaxed);
                    let next = leader
                        .and_then(|l| self.endpoint_index(l))
                        .filter(|j| !failed[*j] && *j != unreachable)
                        .unwrap_or(i);
                    self.preferred.store(next, Ordering::Relaxed);
                    return Ok(v);
                }
                Err(status) if is_retryable(&status) => {
                    failed[i] = true;
                    self.unreachable.store(i, Ordering::Relaxed);
                    last = status;
                }
                // Over a budget, or the replica's read lane is full: wait as
                // long as it asks (jittered, so a thousand clients refused
                // together do not come back together), within the call's
                // deadline, and ask again. Slurm's clients do the same with
                // slurmctld's rate limit.
                Err(status)
                    if retry_after(&status).is_some_and(|d| started.elapsed().saturating_add(d) < CALL_DEADLINE) =>
                {
                    let pause = retry_after(&status).unwrap_or_default();
                    tokio::time::sleep(pause.saturating_add(jittered(pause.max(Duration::from_millis(2))))).await;
                    last = status;
                    continue;
                }
                Err(status) => {
                    if let Some(why) = tls_refusal(&status) {
                        return Err(Status::unavailable(format!(
                            "TLS refused the connection to {}: {why} (check the CA and this client's certificate: \
                             gangway tls show FILE)",
                            self.endpoints[i]
                        )));
                    }
                    return Err(status);
                }
            }
            if started.elapsed() >= CALL_DEADLINE {
                break;
            }
            if attempt.saturating_add(1).checked_rem(n) == Some(0) {
                tokio::time::sleep(if self.jitter { jittered(backoff) } else { backoff }).await;
                backoff = next_backoff(backoff, self.backoff_cap);
            }
        }
        let last_text = describe(&last);
        let hint = if self.claims_identity && ["h2 protocol error", "broken pipe"].iter().any(|s| last_text.contains(s))
        {
            " (the cluster may require TLS: drop --insecure)"
        } else {
            ""
        };
        Err(Status::unavailable(format!(
            "no controller answered ({} endpoints tried: {}); last error: {}{hint}",
            n,
            self.endpoints.join(", "),
            last_text
        )))
    }
}

/// Typed calls, one per method of the services clients use: each sends its
/// request with [`Client::request`]'s deadline, failing over as
/// [`Client::call`] does, so a command names the call it makes instead of
/// writing the closure.
macro_rules! typed_calls {
    ($($name:ident => $svc:ident :: $client:ident :: $method:ident ($req:ty) -> $resp:ty;)*) => {
        impl Client {
            $(
                #[doc = concat!("`", stringify!($client), "::", stringify!($method), "`, failed over.")]
                pub async fn $name(&self, msg: $req) -> Result<Response<$resp>, Status> {
                    self.call(|ch| {
                        let r = self.request(msg.clone());
                        async move { crate::v1::$svc::$client::new(ch).$method(r).await }
                    })
                    .await
                }
            )*
        }
    };
}

typed_calls! {
    job_submit => job_service_client::JobServiceClient::submit(crate::v1::SubmitRequest) -> crate::v1::SubmitResponse;
    job_cancel => job_service_client::JobServiceClient::cancel(crate::v1::CancelRequest) -> crate::v1::CancelResponse;
    job_get => job_service_client::JobServiceClient::get(crate::v1::GetJobRequest) -> crate::v1::Job;
    job_list => job_service_client::JobServiceClient::list(crate::v1::ListJobsRequest) -> crate::v1::ListJobsResponse;
    job_history => job_service_client::JobServiceClient::history(crate::v1::HistoryRequest) -> crate::v1::ListJobsResponse;
    job_usage => job_service_client::JobServiceClient::usage(crate::v1::UsageRequest) -> crate::v1::UsageResponse;
    job_watch => job_service_client::JobServiceClient::watch(crate::v1::WatchRequest) -> tonic::codec::Streaming<crate::v1::JobEvent>;
    job_events => job_service_client::JobServiceClient::events(crate::v1::EventsRequest) -> tonic::codec::Streaming<crate::v1::ClusterEvent>;
    job_test_submit => job_service_client::JobServiceClient::test_submit(crate::v1::SubmitRequest) -> crate::v1::Explanation;
    job_update => job_service_client::JobServiceClient::update(crate::v1::UpdateJobRequest) -> crate::v1::Job;
    job_explain => job_service_client::JobServiceClient::explain(crate::v1::ExplainRequest) -> crate::v1::Explanation;
    job_checkpoint => job_service_client::JobServiceClient::checkpoint(crate::v1::CheckpointRequest) -> crate::v1::CheckpointResponse;
    job_step_credential => job_service_client::JobServiceClient::step_credential(crate::v1::StepCredentialRequest) -> crate::v1::StepCredentialResponse;
    job_begin_step => job_service_client::JobServiceClient::begin_step(crate::v1::BeginStepRequest) -> crate::v1::BeginStepResponse;
    job_end_step => job_service_client::JobServiceClient::end_step(crate::v1::EndStepRequest) -> crate::v1::EndStepResponse;
    node_list => node_service_client::NodeServiceClient::list(crate::v1::ListNodesRequest) -> crate::v1::ListNodesResponse;
    node_get => node_service_client::NodeServiceClient::get(crate::v1::GetNodeRequest) -> crate::v1::Node;
    node_drain => node_service_client::NodeServiceClient::drain(crate::v1::DrainRequest) -> crate::v1::Node;
    node_resume => node_service_client::NodeServiceClient::resume(crate::v1::ResumeRequest) -> crate::v1::Node;
    node_power => node_service_client::NodeServiceClient::power(crate::v1::PowerRequest) -> crate::v1::Node;
    admin_cluster_status => admin_service_client::AdminServiceClient::cluster_status(crate::v1::ClusterStatusRequest) -> crate::v1::ClusterStatusResponse;
    admin_get_replica_status => admin_service_client::AdminServiceClient::get_replica_status(crate::v1::ReplicaStatusRequest) -> crate::v1::ReplicaStatus;
    admin_add_learner => admin_service_client::AdminServiceClient::add_learner(crate::v1::AddLearnerRequest) -> crate::v1::MembershipResponse;
    admin_promote => admin_service_client::AdminServiceClient::promote(crate::v1::PromoteRequest) -> crate::v1::MembershipResponse;
    admin_remove_member => admin_service_client::AdminServiceClient::remove_member(crate::v1::RemoveMemberRequest) -> crate::v1::MembershipResponse;
    admin_transfer_leader => admin_service_client::AdminServiceClient::transfer_leader(crate::v1::TransferLeaderRequest) -> crate::v1::TransferLeaderResponse;
    admin_snapshot => admin_service_client::AdminServiceClient::snapshot(crate::v1::SnapshotRequest) -> crate::v1::SnapshotResponse;
    admin_trigger_election => admin_service_client::AdminServiceClient::trigger_election(crate::v1::TriggerElectionRequest) -> crate::v1::TriggerElectionResponse;
    admin_get_policy => admin_service_client::AdminServiceClient::get_policy(crate::v1::GetPolicyRequest) -> crate::v1::Policy;
    admin_update_policy => admin_service_client::AdminServiceClient::update_policy(crate::v1::UpdatePolicyRequest) -> crate::v1::Policy;
    admin_fair_share => admin_service_client::AdminServiceClient::fair_share(crate::v1::FairShareRequest) -> crate::v1::FairShareResponse;
    admin_restore_usage => admin_service_client::AdminServiceClient::restore_usage(crate::v1::RestoreUsageRequest) -> crate::v1::RestoreUsageResponse;
    admin_accounting_stored => admin_service_client::AdminServiceClient::accounting_stored(crate::v1::AccountingStoredRequest) -> crate::v1::AccountingStoredResponse;
    admin_audit => admin_service_client::AdminServiceClient::audit(crate::v1::AuditRequest) -> tonic::codec::Streaming<crate::v1::AuditEntry>;
    admin_backup => admin_service_client::AdminServiceClient::backup(crate::v1::BackupRequest) -> tonic::codec::Streaming<crate::v1::BackupChunk>;
    admin_list_reservations => admin_service_client::AdminServiceClient::list_reservations(crate::v1::ListReservationsRequest) -> crate::v1::ListReservationsResponse;
    admin_change_reservation => admin_service_client::AdminServiceClient::change_reservation(crate::v1::ChangeReservationRequest) -> crate::v1::ListReservationsResponse;
    admin_licenses => admin_service_client::AdminServiceClient::licenses(crate::v1::LicensesRequest) -> crate::v1::LicensesResponse;
    admin_get_node_inventory => admin_service_client::AdminServiceClient::get_node_inventory(crate::v1::GetNodeInventoryRequest) -> crate::v1::NodeInventory;
    admin_set_node_inventory => admin_service_client::AdminServiceClient::set_node_inventory(crate::v1::SetNodeInventoryRequest) -> crate::v1::NodeInventory;
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A listing of LIST_PAGES_MAX pages is read whole; one that needs a
    /// page more is not, and says so; a page's error ends it.
    #[tokio::test]
    async fn a_listing_reads_at_most_list_pages_max_pages() {
        for (pages, whole) in [(LIST_PAGES_MAX, true), (LIST_PAGES_MAX + 1, false)] {
            let listed = paged(LIST_PAGES_MAX, 1usize, |page| async move {
                Ok::<_, Status>((vec![page], (page < pages).then_some(page + 1)))
            })
            .await
            .unwrap();
            assert_eq!(listed, ((1..=LIST_PAGES_MAX).collect::<Vec<_>>(), whole), "{pages} pages");
        }
        let failed = paged(LIST_PAGES_MAX, 1usize, |page| async move {
            if page == 3 {
                return Err(Status::unavailable("gone"));
            }
            Ok((vec![page], Some(page + 1)))
        })
        .await;
        assert_eq!(failed.unwrap_err().code(), Code::Unavailable);
    }

    /// Pauses between rounds double up to BACKOFF_CAP (FLEET_BACKOFF_CAP for
    /// a fleet's agents) and never past it, jittered or not.
    #[test]
    fn backoff_grows_to_its_cap_and_never_past_it() {
        for cap in [BACKOFF_CAP, FLEET_BACKOFF_CAP] {
            let mut b = BACKOFF_START;
            for _ in 0..CALL_ATTEMPTS_MAX {
                b = next_backoff(b, cap);
                assert!(b <= cap && jittered(b) <= b && jittered(b) >= b / 2, "{b:?} {cap:?}");
            }
            assert_eq!(b, cap);
            assert_eq!(next_backoff(cap / 2, cap), cap);
            assert_eq!(next_backoff(cap / 2 + Duration::from_nanos(1), cap), cap);
        }
    }

    /// Clients back off to BACKOFF_CAP, a fleet's agents to FLEET_BACKOFF_CAP.
    #[tokio::test]
    async fn a_fleet_client_backs_off_to_the_fleet_cap() {
        let client = Client::new(&["127.0.0.1:1".to_string()], "t", &Security::Insecure).unwrap();
        assert_eq!((client.backoff_cap, client.jitter), (BACKOFF_CAP, false));
        let fleet = client.for_fleet();
        assert_eq!((fleet.backoff_cap, fleet.jitter), (FLEET_BACKOFF_CAP, true));
    }

    /// A retry hint of RETRY_AFTER_MAX is waited out; one millisecond longer
    /// is handed to the caller instead.
    #[test]
    fn retry_hints_are_followed_up_to_retry_after_max() {
        let hint = |ms: u128| {
            let mut s = Status::resource_exhausted("over budget");
            s.metadata_mut().insert(RETRY_AFTER_METADATA_KEY, ms.to_string().parse().unwrap());
            retry_after(&s)
        };
        assert_eq!(hint(RETRY_AFTER_MAX.as_millis()), Some(RETRY_AFTER_MAX));
        assert_eq!(hint(RETRY_AFTER_MAX.as_millis() + 1), None);
    }

    /// A call succeeds on its CALL_ATTEMPTS_MAX-th attempt, and gives up
    /// after CALL_ATTEMPTS_MAX failed ones without making another.
    #[tokio::test]
    async fn a_call_makes_at_most_call_attempts_max_attempts() {
        // One endpoint per attempt: no pause between rounds until the last.
        let endpoints: Vec<String> = (1..=CALL_ATTEMPTS_MAX).map(|p| format!("127.0.0.1:{p}")).collect();
        let client = Client::new(&endpoints, "t", &Security::Insecure).unwrap();
        let attempts_until = |ok_at: usize| {
            let made = AtomicUsize::new(0);
            let client = &client;
            async move {
                let r = client
                    .call(|_| {
                        let n = made.fetch_add(1, Ordering::Relaxed) + 1;
                        async move {
                            if n < ok_at {
                                Err(Status::unavailable("down"))
                            } else {
                                Ok(Response::new(n))
                            }
                        }
                    })
                    .await;
                (r.map(Response::into_inner), made.load(Ordering::Relaxed))
            }
        };
        let (r, made) = attempts_until(CALL_ATTEMPTS_MAX).await;
        assert_eq!((r.unwrap(), made), (CALL_ATTEMPTS_MAX, CALL_ATTEMPTS_MAX));
        let (r, made) = attempts_until(CALL_ATTEMPTS_MAX + 1).await;
        assert!(r.unwrap_err().message().starts_with("no controller answered"));
        assert_eq!(made, CALL_ATTEMPTS_MAX);
    }
}
