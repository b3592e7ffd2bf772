//! Who the caller is and what they may do: the identity every handler derives
//! first (`Replica::ctx`: a verified certificate's principal, a bearer token's
//! user, a forwarding replica's word for its caller, or a job's step
//! credential), the authorization checks (`require_*`, `job_user`, ownership),
//! and the `Viewer` that shows each caller only what the policy lets them see.

use std::collections::BTreeSet;

use gangway_core::{SpecError, StopCause};
use gangway_proto::tls::{PeerAuth, Principal, Role};
use gangway_proto::token::{TokenVerifier, AUTHORIZATION_METADATA_KEY};
use gangway_proto::{FORWARDED_FOR_METADATA_KEY, IDENTITY_METADATA_KEY};
use tonic::{Request, Status};

use super::{convert, status_from_spec};
use crate::shared::Replica;

/// Marks a request a replica forwarded to the leader.
pub const FORWARDED_METADATA_KEY: &str = "gangway-forwarded";
/// With forwarded-for: the caller acted through job JOB.ATTEMPT's credential.
pub const FORWARDED_JOB_METADATA_KEY: &str = "gangway-forwarded-job";
// A name the policy may grant to is as long as any name a replica verifies.
// The core's limit decides replicated outcomes (a policy naming a longer
// one is refused in apply): raising the TLS limit means raising the core's
// under a new data format, never in place.
const _: () = assert!(gangway_core::limits::IDENTITY_NAME_BYTES_MAX == gangway_proto::tls::PRINCIPAL_NAME_BYTES_MAX);
/// Identity used when a request to an insecure cluster names none.
pub const DEFAULT_IDENTITY: &str = "anonymous";
/// Identities are short principal names such as `dev:alice`.
const IDENTITY_BYTES_MAX: usize = 256;
/// A step credential outlives its job's time limit by this much: the agents
/// also refuse steps of an attempt that no longer runs on them, so the expiry
/// only bounds a leaked credential, and an admin may raise a running job's
/// limit by up to a day without its steps being refused.
const STEP_CREDENTIAL_SLACK_S: u64 = 24 * 3600;

/// Who is calling, as far as this replica can tell.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Caller {
    /// A principal whose certificate the cluster's CA signed (or, for a
    /// forwarded request, whom a replica holding a server certificate vouched for).
    Verified(Principal),
    /// An insecure cluster (`--insecure`): the caller's own claim, and every
    /// check passes, as before the cluster had security. Never on a TLS listener.
    Claimed(String),
}

/// Who is calling, and whether a replica already forwarded the call.
#[derive(Debug, Clone)]
pub struct CallCtx {
    pub caller: Caller,
    /// The caller as the core records it: `client:alice`, `agent:node-1`,
    /// `server:2` (its user is the part after the last `:`), or the claim.
    pub identity: String,
    pub forwarded: bool,
    /// The replica's audit trail, where refusals of this call go.
    pub audit: Option<std::sync::Arc<crate::audit::AuditLog>>,
    /// The caller is a job's process acting through its step credential
    /// (job id, attempt): its user's everyday rights only, never an admin's.
    pub via_job: Option<(u64, u32)>,
}

impl CallCtx {
    pub(super) fn audit(&self, action: &str, outcome: &'static str, reason: &str) {
        self.audit_entry(action, outcome, reason, outcome != "allowed");
    }

    /// An action allowed to a caller short of an admin (an operator, an
    /// account coordinator, before the state machine checks the edit): in
    /// the ring at most as often as a refusal is, so a loop of them cannot
    /// flush it; every one in the log.
    pub(super) fn audit_bounded(&self, action: &str, outcome: &'static str, reason: &str) {
        self.audit_entry(action, outcome, reason, true);
    }

    fn audit_entry(&self, action: &str, outcome: &'static str, reason: &str, bounded: bool) {
        if let Some(a) = &self.audit {
            let who = match self.via_job {
                Some((job, attempt)) => format!("{} (job {job} attempt {attempt})", self.identity),
                None => self.identity.clone(),
            };
            if bounded {
                a.record_denied(&self.identity, &who, action, "", outcome, reason);
            } else {
                a.record(&who, action, "", outcome, reason);
            }
        }
    }

    /// Refused to a job's credential: what needs the user's own certificate
    /// or token (job changes, step credentials, anything of an admin's).
    pub fn require_not_job(&self, what: &str) -> Result<(), Status> {
        match self.via_job {
            None => Ok(()),
            Some((job, _)) => Err(denied(
                self,
                what,
                format!("job {job}'s credential cannot {what}; use your own certificate or token"),
            )),
        }
    }
}

fn unauthenticated(why: &str) -> Status {
    metrics::counter!("gangway_api_denied_total", "reason" => "unauthenticated").increment(1);
    Status::unauthenticated(format!(
        "{why}: present a client certificate signed by the cluster's CA (gangway tls cert create --client NAME) \
         or a bearer token (gangway token create)"
    ))
}

/// Counts a refusal for lack of permission and puts it in the audit trail.
pub fn denied(ctx: &CallCtx, what: &str, why: String) -> Status {
    metrics::counter!("gangway_api_denied_total", "reason" => "permission").increment(1);
    ctx.audit(what, "denied", &why);
    Status::permission_denied(format!("permission: {why}"))
}

impl Replica {
    /// The caller of `req`: from its verified certificate (or a forwarding
    /// replica's word), from a bearer token this cluster trusts, or on an
    /// insecure listener from its claim.
    ///
    /// A process of a running job with nothing else but its job's step
    /// credential acts as the job's user (sbatch, squeue, scancel inside a
    /// job, as with Slurm), for as long as that attempt runs.
    pub fn ctx<T>(&self, req: &Request<T>) -> Result<CallCtx, Status> {
        let of = match self.step_caller(req) {
            _ if !self.member_or_not_server(req) => Err(unauthenticated(
                "this server certificate's replica is not a member of the cluster (a removed replica's \
                 certificate opens nothing)",
            )),
            Ok(Some(claims)) => self.job_ctx(&claims),
            Ok(None) => CallCtx::of(req, self.tokens.as_deref()).and_then(|ctx| self.still_running(ctx)),
            Err(s) => Err(s),
        };
        match of {
            Ok(mut ctx) => {
                ctx.audit = Some(self.audit.clone());
                Ok(ctx)
            }
            Err(s) => {
                // The call, by its request message (`SubmitRequest` → `Submit`).
                let name = std::any::type_name::<T>().rsplit("::").next().unwrap_or("call");
                let method = name.strip_suffix("Request").unwrap_or(name).to_string();
                let ip = req.extensions().get::<gangway_proto::tls::PeerInfo>().and_then(|p| p.remote).map(|a| a.ip());
                let outcome = if s.code() == tonic::Code::Unauthenticated { "unauthenticated" } else { "denied" };
                self.audit.record_anonymous(ip, &method, outcome, s.message());
                Err(s)
            }
        }
    }
}

impl Replica {
    /// False for a server certificate whose replica is not a member (see
    /// `RaftNode::admits_server`); true for everyone else.
    fn member_or_not_server<T>(&self, req: &Request<T>) -> bool {
        match gangway_proto::tls::peer_of(req) {
            PeerAuth::Verified(p) if p.role == Role::Server => self.node.admits_server(&p.name),
            _ => true,
        }
    }

    /// A job's process forwarded by a follower (which checked the credential
    /// against its own, possibly lagging, state): the attempt must still run
    /// here too.
    fn still_running(&self, ctx: CallCtx) -> Result<CallCtx, Status> {
        let Some((job, attempt)) = ctx.via_job else { return Ok(ctx) };
        let live = self
            .node
            .state()
            .read()
            .jobs
            .get(&job)
            .is_some_and(|j| j.attempt == attempt && j.state == gangway_core::JobState::Running);
        if !live {
            return Err(unauthenticated(&format!("the step credential's job {job} attempt {attempt} no longer runs")));
        }
        Ok(ctx)
    }

    /// The caller a live step credential stands for: the job's user.
    fn job_ctx(&self, claims: &gangway_proto::step_cred::StepClaims) -> Result<CallCtx, Status> {
        let user = self.node.state().read().jobs.get(&claims.job_id).map(|j| j.spec.user.clone());
        let user = user.ok_or_else(|| unauthenticated(&format!("job {} is gone", claims.job_id)))?;
        let p = Principal::new(Role::Client, &user)
            .map_err(|e| unauthenticated(&format!("job {}'s user cannot act through it: {e}", claims.job_id)))?;
        Ok(CallCtx {
            identity: p.encode(),
            caller: Caller::Verified(p),
            forwarded: false,
            audit: None,
            via_job: Some((claims.job_id, claims.attempt)),
        })
    }

    /// A caller with no certificate and no token but a step credential of a
    /// job attempt that still runs: its claims. `None` for every other caller.
    /// Such a caller acts as the job's user ([`Replica::ctx`]); `NodeService.Get`
    /// answers it for the nodes its credential names without more checks.
    pub fn step_caller<T>(&self, req: &Request<T>) -> Result<Option<gangway_proto::step_cred::StepClaims>, Status> {
        use gangway_proto::step_cred::{verify_signed_by, STEP_CREDENTIAL_METADATA_KEY};
        let (Some(creds), PeerAuth::Anonymous) = (self.security.credentials(), gangway_proto::tls::peer_of(req)) else {
            return Ok(None);
        };
        let md = req.metadata();
        if md.get(AUTHORIZATION_METADATA_KEY).is_some() {
            return Ok(None);
        }
        let Some(token) = md.get(STEP_CREDENTIAL_METADATA_KEY) else { return Ok(None) };
        let token = token.to_str().map_err(|_| unauthenticated("the step credential is not printable ASCII"))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
        let (claims, signer) = verify_signed_by(creds, token, now)
            .map_err(|why| unauthenticated(&format!("the step credential is not valid: {why}")))?;
        // Signed by a replica of this cluster's membership: not a removed
        // one's, nor another cluster's that shares the CA.
        if !self.node.admits_server(&signer.name) {
            return Err(unauthenticated(&format!(
                "the step credential is not valid: its signer {signer} is not a member of this cluster"
            )));
        }
        let live = self
            .node
            .state()
            .read()
            .jobs
            .get(&claims.job_id)
            .is_some_and(|j| j.attempt == claims.attempt && j.state == gangway_core::JobState::Running);
        if !live {
            return Err(unauthenticated(&format!(
                "the step credential's job {} attempt {} no longer runs",
                claims.job_id, claims.attempt
            )));
        }
        let remote = req.extensions().get::<gangway_proto::tls::PeerInfo>().and_then(|p| p.remote);
        if let Some(remote) = remote.map(|a| a.ip().to_canonical()) {
            let node_ips: Option<Vec<std::net::IpAddr>> = {
                let state = self.node.state().read();
                claims.nodes.iter().map(|n| state.nodes.get(n).and_then(|node| host_ip(&node.addr))).collect()
            };
            // Only from a node the job holds, where its nodes registered
            // addresses (`gangway agent --addr IP`); a node known by a host
            // name is not resolved here. A call over loopback comes from this
            // replica's own host: one of the job's nodes must be it.
            if let Some(ips) = node_ips {
                let own = host_ip(&self.addr);
                let from_node = ips.contains(&remote)
                    || (remote.is_loopback() && ips.iter().any(|ip| ip.is_loopback() || Some(*ip) == own));
                if !from_node {
                    return Err(unauthenticated(&format!(
                        "the step credential of job {} is used from {remote}, which is none of the job's nodes",
                        claims.job_id
                    )));
                }
            }
        }
        Ok(Some(claims))
    }
}

/// The IP address in `HOST[:PORT]` when HOST is one (`10.0.0.7:6818`,
/// `[fd00::7]:6818`, `10.0.0.7`), else None (a host name, or nothing).
pub fn host_ip(addr: &str) -> Option<std::net::IpAddr> {
    addr.parse::<std::net::SocketAddr>()
        .map(|a| a.ip())
        .or_else(|_| addr.parse::<std::net::IpAddr>())
        .ok()
        .map(|ip| ip.to_canonical())
}

/// What an open stream checks again about its caller (see
/// [`Replica::still_allowed`]), taken when it opened.
#[derive(Debug, Clone)]
pub struct StreamAuth {
    /// The bearer token it was opened with, verified again each time.
    bearer: Option<String>,
    /// The stream is for admins only.
    admin: bool,
    /// The replica whose membership it stands on: the server certificate
    /// that opened it, or the replica that signed its step credential.
    server: Option<String>,
}

impl Replica {
    /// What a stream opened by `req` checks again while it runs; `admin`
    /// when only admins may read it.
    pub fn stream_auth<T>(&self, req: &Request<T>, admin: bool) -> StreamAuth {
        let (mut bearer, mut server) = (None, None);
        match gangway_proto::tls::peer_of(req) {
            PeerAuth::Anonymous => {
                bearer = req
                    .metadata()
                    .get(AUTHORIZATION_METADATA_KEY)
                    .and_then(|v| v.to_str().ok())
                    .and_then(|s| s.strip_prefix("Bearer "))
                    .map(|t| t.trim().to_string());
                if let (Some(creds), Some(token)) = (
                    self.security.credentials(),
                    req.metadata()
                        .get(gangway_proto::step_cred::STEP_CREDENTIAL_METADATA_KEY)
                        .and_then(|v| v.to_str().ok()),
                ) {
                    let now =
                        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
                    server = gangway_proto::step_cred::verify_signed_by(creds, token, now).ok().map(|(_, s)| s.name);
                }
            }
            PeerAuth::Verified(p) if p.role == Role::Server => server = Some(p.name),
            _ => {}
        }
        StreamAuth { bearer, admin, server }
    }

    /// Whether the caller of an open stream still may read it: its bearer
    /// token still verifies (not expired, not revoked), the job attempt its
    /// step credential speaks for still runs, and an admin stream's caller is
    /// still an admin. A stream that fails this ends with the reason.
    pub fn still_allowed(&self, ctx: &CallCtx, auth: &StreamAuth) -> Result<(), Status> {
        if let Some(token) = &auth.bearer {
            let Some(tokens) = self.tokens.as_deref() else {
                return Err(unauthenticated("this cluster no longer accepts bearer tokens"));
            };
            tokens.verify(token).map_err(|why| unauthenticated(&format!("bearer token refused: {why}")))?;
        }
        if ctx.via_job.is_some() {
            self.still_running(ctx.clone())?;
        }
        if let Some(server) = auth.server.as_deref().filter(|s| !self.node.admits_server(s)) {
            return Err(unauthenticated(&format!(
                "replica {server} is no longer a member of the cluster (its certificate and the step credentials it \
                 signed open nothing)"
            )));
        }
        if auth.admin && !self.is_admin(ctx) {
            return Err(denied(ctx, "read the audit trail", format!("{} is no longer an admin", ctx.identity)));
        }
        Ok(())
    }

    /// Waits until `ctx`'s read budget lets it read again (a stream past its
    /// budget pauses rather than ends); an error once the replica closes.
    pub async fn wait_for_read_budget(&self, ctx: &CallCtx) -> Result<(), Status> {
        let closed = self.closed();
        tokio::pin!(closed);
        loop {
            let Err(s) = self.admit_read(ctx) else { return Ok(()) };
            let wait = s
                .metadata()
                .get(crate::ratelimit::RETRY_AFTER_METADATA_KEY)
                .and_then(|v| v.to_str().ok()?.parse::<u64>().ok())
                .unwrap_or(100);
            tokio::select! {
                _ = tokio::time::sleep(std::time::Duration::from_millis(wait)) => {}
                _ = &mut closed => return Err(Status::unavailable("this replica is shutting down; resume on another")),
            }
        }
    }
}

/// The user named by the request's bearer token, if it carries one.
fn bearer(md: &tonic::metadata::MetadataMap, tokens: Option<&TokenVerifier>) -> Option<Result<Principal, Status>> {
    let v = md.get(AUTHORIZATION_METADATA_KEY)?;
    let Some(token) = v.to_str().ok().and_then(|s| s.strip_prefix("Bearer ")) else {
        return Some(Err(unauthenticated("authorization: must be 'Bearer TOKEN'")));
    };
    let Some(tokens) = tokens else {
        return Some(Err(unauthenticated("this cluster accepts no bearer tokens (no --token-public-key)")));
    };
    Some(tokens.verify(token.trim()).map_err(|why| unauthenticated(&format!("bearer token refused: {why}"))))
}

impl CallCtx {
    /// See [`Replica::ctx`].
    pub fn of<T>(req: &Request<T>, tokens: Option<&TokenVerifier>) -> Result<CallCtx, Status> {
        let md = req.metadata();
        match gangway_proto::tls::peer_of(req) {
            PeerAuth::Insecure => {
                let identity = match md.get(IDENTITY_METADATA_KEY) {
                    None => DEFAULT_IDENTITY.to_string(),
                    Some(v) => {
                        let s = v.to_str().map_err(|_| {
                            Status::invalid_argument(format!("{IDENTITY_METADATA_KEY}: must be printable ASCII"))
                        })?;
                        if s.is_empty() || s.len() > IDENTITY_BYTES_MAX {
                            return Err(Status::invalid_argument(format!(
                                "{IDENTITY_METADATA_KEY}: must be 1 to {IDENTITY_BYTES_MAX} bytes"
                            )));
                        }
                        s.to_string()
                    }
                };
                Ok(CallCtx {
                    caller: Caller::Claimed(identity.clone()),
                    identity,
                    forwarded: md.get(FORWARDED_METADATA_KEY).is_some(),
                    audit: None,
                    via_job: None,
                })
            }
            PeerAuth::Anonymous => match bearer(md, tokens) {
                Some(Ok(p)) => Ok(CallCtx {
                    identity: p.encode(),
                    caller: Caller::Verified(p),
                    forwarded: false,
                    audit: None,
                    via_job: None,
                }),
                Some(Err(s)) => Err(s),
                None => Err(unauthenticated("no client certificate and no bearer token")),
            },
            PeerAuth::Unusable(e) => Err(unauthenticated(&format!("the client certificate is not usable here ({e})"))),
            PeerAuth::Verified(peer) => {
                let forwarded_for = md.get(FORWARDED_FOR_METADATA_KEY);
                let principal = match forwarded_for {
                    None => peer,
                    Some(_) if peer.role != Role::Server => {
                        metrics::counter!("gangway_api_denied_total", "reason" => "permission").increment(1);
                        return Err(Status::permission_denied(format!(
                            "permission: {peer} may not forward requests for others (only controller replicas do)"
                        )));
                    }
                    Some(v) => {
                        let s = v.to_str().map_err(|_| {
                            Status::invalid_argument(format!("{FORWARDED_FOR_METADATA_KEY}: must be printable ASCII"))
                        })?;
                        Principal::decode(s)
                            .map_err(|e| Status::invalid_argument(format!("{FORWARDED_FOR_METADATA_KEY}: {e}")))?
                    }
                };
                // The forwarding replica vouches that its caller was a job's
                // process (a server's word, like forwarded-for).
                let via_job = match (forwarded_for, md.get(FORWARDED_JOB_METADATA_KEY)) {
                    (Some(_), Some(v)) => {
                        let parsed = v
                            .to_str()
                            .ok()
                            .and_then(|s| s.split_once('.'))
                            .and_then(|(j, a)| Some((j.parse::<u64>().ok()?, a.parse::<u32>().ok()?)));
                        Some(parsed.ok_or_else(|| {
                            Status::invalid_argument(format!("{FORWARDED_JOB_METADATA_KEY}: must be JOB.ATTEMPT"))
                        })?)
                    }
                    _ => None,
                };
                Ok(CallCtx {
                    identity: principal.encode(),
                    caller: Caller::Verified(principal),
                    forwarded: forwarded_for.is_some(),
                    audit: None,
                    via_job,
                })
            }
        }
    }

    /// The user name in the identity (`client:alice` → `alice`).
    pub fn user(&self) -> &str {
        gangway_core::policy::identity_name(&self.identity)
    }

    fn role_is(&self, role: Role) -> bool {
        match &self.caller {
            Caller::Verified(p) => p.role == role,
            Caller::Claimed(_) => true,
        }
    }

    /// A user (client certificate): jobs, queues, their own changes. Returns the
    /// user name jobs run as.
    pub fn require_user(&self, what: &str) -> Result<String, Status> {
        if self.role_is(Role::Client) {
            return Ok(self.user().to_string());
        }
        Err(denied(self, what, format!("{} is not a user; {what} needs a client certificate", self.identity)))
    }

    /// A controller replica (Raft, internal duties).
    pub fn require_server(&self, what: &str) -> Result<(), Status> {
        if self.role_is(Role::Server) {
            return Ok(());
        }
        Err(denied(self, what, format!("{} is not a controller replica; only servers may {what}", self.identity)))
    }

    /// The agent of `node` and nobody else (a node speaks only for itself).
    pub fn require_agent_for(&self, node: &str, what: &str) -> Result<(), Status> {
        match &self.caller {
            Caller::Claimed(_) => Ok(()),
            Caller::Verified(p) if p.role == Role::Agent && p.name == node => Ok(()),
            Caller::Verified(p) if p.role == Role::Agent => Err(denied(
                self,
                what,
                format!("the agent certificate of node {} cannot {what} for node {node}", p.name),
            )),
            Caller::Verified(_) => Err(denied(
                self,
                what,
                format!("{} is not the agent of node {node}; only it may {what}", self.identity),
            )),
        }
    }

    /// Anyone the cluster knows (users, agents, servers): read-only views.
    pub fn require_known(&self) -> Result<(), Status> {
        Ok(())
    }
}

impl Replica {
    /// Admins: servers, the users the policy names, and the bootstrap admins.
    pub fn is_admin(&self, ctx: &CallCtx) -> bool {
        if ctx.via_job.is_some() {
            return false;
        }
        match &ctx.caller {
            Caller::Claimed(_) => true,
            Caller::Verified(p) => match p.role {
                Role::Server => true,
                Role::Agent => false,
                Role::Client => self.client_is_admin(&self.node.state().read(), p, &ctx.identity),
            },
        }
    }

    /// Whether client `p` is an admin in `state`: named in the policy, or a
    /// bootstrap admin while the policy names none (the leader then commits
    /// them into it).
    fn client_is_admin(&self, state: &gangway_core::State, p: &Principal, identity: &str) -> bool {
        state.is_admin(identity)
            || (state.policy.admins.is_empty() && self.bootstrap_admins.iter().any(|a| a == &p.name))
    }

    /// An accounting service (`--accounting-identity`): a client by its own
    /// certificate or token (never a job's credential) whose identity or
    /// name the replica's list holds.
    pub fn is_accounting(&self, ctx: &CallCtx) -> bool {
        match &ctx.caller {
            Caller::Verified(p) if p.role == Role::Client && ctx.via_job.is_none() => {
                self.accounting_identities.iter().any(|a| *a == ctx.identity || *a == p.name)
            }
            _ => false,
        }
    }

    /// An operator, admin or accounting service: reporting what the
    /// accounting store holds.
    pub fn require_accounting(&self, ctx: &CallCtx, what: &str) -> Result<(), Status> {
        if self.is_accounting(ctx) {
            ctx.audit_bounded(what, "allowed", "accounting service");
            return Ok(());
        }
        self.require_operator(ctx, what)
    }

    /// Operators (and admins): the machines and everyone's jobs, not the policy.
    pub fn is_operator(&self, ctx: &CallCtx) -> bool {
        if self.is_admin(ctx) {
            return true;
        }
        match &ctx.caller {
            Caller::Verified(p) if p.role == Role::Client && ctx.via_job.is_none() => {
                self.node.state().read().policy.is_operator(&ctx.identity)
            }
            _ => false,
        }
    }

    /// Whether users see only their own jobs: the replicated policy's
    /// `private_jobs`, or this replica's `--private-jobs` (which can only
    /// make it stricter). Never call while holding the state lock.
    pub fn private_jobs(&self) -> bool {
        self.private_jobs || self.node.state().read().policy.private_jobs
    }

    /// Whether jobs may run as root: from data format 6 the replicated
    /// policy's `allow_root_jobs` decides (the leader that moved the cluster
    /// to format 6 carried its `--allow-root-jobs` into it); before, this
    /// replica's flag.
    fn root_jobs_allowed(&self) -> bool {
        let state = self.node.state().read();
        if state.format >= gangway_core::policy::ROLES_FORMAT {
            state.policy.allow_root_jobs
        } else {
            self.allow_root_jobs
        }
    }

    /// The Unix user a job of `ctx` runs as: the authenticated user (through
    /// the policy's user map), never one the request names (a request naming
    /// another is refused), and never root unless the policy allows it.
    pub fn job_user(&self, ctx: &CallCtx, requested: &str, what: &str) -> Result<String, Status> {
        let user = match &ctx.caller {
            Caller::Claimed(_) if requested.is_empty() => ctx.user().to_string(),
            Caller::Claimed(_) => requested.to_string(),
            Caller::Verified(_) => {
                let name = ctx.require_user(what)?;
                // A job's process already acts as its Unix user: no second mapping.
                let me = match ctx.via_job {
                    Some(_) => name,
                    None => self.node.state().read().policy.unix_user(&name).to_string(),
                };
                if !requested.is_empty() && requested != me {
                    return Err(denied(
                        ctx,
                        what,
                        format!("user: jobs run as the authenticated user '{me}', not as '{requested}'"),
                    ));
                }
                me
            }
        };
        if user == "root" && !self.root_jobs_allowed() {
            return Err(denied(
                ctx,
                what,
                "user: jobs as root are refused on this cluster (an admin may set allow_root_jobs in the policy)"
                    .into(),
            ));
        }
        Ok(user)
    }

    /// How `ctx` sees jobs. Taken before the state lock (it reads the
    /// policy), never while holding it.
    pub fn viewer(&self, ctx: &CallCtx) -> Viewer {
        let state = self.node.state().read();
        let policy = &state.policy;
        let private_jobs = self.private_jobs || policy.private_jobs;
        let (mut whole, mut sees_all, mut user, mut accounts) = (false, false, String::new(), BTreeSet::new());
        match &ctx.caller {
            Caller::Claimed(_) => whole = true,
            Caller::Verified(p) => match p.role {
                Role::Server => whole = true,
                Role::Agent => {}
                Role::Client => {
                    user = match ctx.via_job {
                        Some(_) => p.name.clone(),
                        None => policy.unix_user(&p.name).to_string(),
                    };
                    if ctx.via_job.is_none() {
                        whole = self.client_is_admin(&state, p, &ctx.identity);
                        sees_all = policy.is_operator(&ctx.identity) || self.is_accounting(ctx);
                        let mine = policy.coordinated(&ctx.identity);
                        if !mine.is_empty() {
                            accounts = std::iter::once(gangway_core::policy::ROOT_ACCOUNT)
                                .chain(policy.accounts.keys().map(String::as_str))
                                .filter(|a| mine.iter().any(|m| policy.is_under(a, m)))
                                .map(str::to_string)
                                .collect();
                        }
                    }
                }
            },
        }
        Viewer {
            caller: ctx.caller.clone(),
            identity: ctx.identity.clone(),
            user,
            whole,
            sees_all,
            accounts,
            private_jobs,
            via_job: ctx.via_job.map(|(job, _)| job),
        }
    }

    /// With private jobs, another user's job reads as not found (not
    /// denied: its existence is private too). Jobs this replica does not
    /// know are left to the call.
    pub fn require_visible(&self, ctx: &CallCtx, job_id: u64) -> Result<(), Status> {
        let viewer = self.viewer(ctx);
        if !viewer.private_jobs {
            return Ok(());
        }
        let hidden = self.node.state().read().jobs.get(&job_id).is_some_and(|j| !viewer.visible(j));
        if hidden {
            return Err(Status::not_found(format!("job {job_id} does not exist")));
        }
        Ok(())
    }

    /// Reservation lists hold for admins' jobs too: a job in a reservation
    /// that names neither its user nor its account is refused, unless an
    /// admin (by their own certificate or token, never a job's credential)
    /// forces it, which the audit trail records. Users who are not admins
    /// are refused by the state machine as before.
    pub fn check_reservation_access(
        &self,
        ctx: &CallCtx,
        spec: &gangway_core::JobSpec,
        force: bool,
    ) -> Result<(), Status> {
        if spec.reservation.is_empty() {
            return Ok(());
        }
        let (listed, account) = {
            let state = self.node.state().read();
            let account = state
                .policy
                .resolve_account(&spec.user, &spec.account)
                .map_or_else(|_| spec.account.clone(), str::to_string);
            match state.reservations.get(&spec.reservation) {
                Some(r) => (r.lists(&spec.user, &account), Some(account)),
                // Unknown here: the state machine reports it to users; an
                // admin's or a job's submit must not race its creation past
                // this check (apply admits admins whatever the lists say).
                None => (false, None),
            }
        };
        let admin = self.is_admin(ctx);
        let Some(account) = account else {
            if admin || ctx.via_job.is_some() {
                return Err(Status::failed_precondition(format!(
                    "reservation: {} does not exist (on this replica yet); retry once it does",
                    spec.reservation
                )));
            }
            return Ok(());
        };
        if listed || !admin && ctx.via_job.is_none() {
            return Ok(());
        }
        if force && admin {
            ctx.audit("run a job in a reservation that does not list it", "allowed", "admin, forced");
            return Ok(());
        }
        Err(denied(
            ctx,
            "use a reservation",
            format!(
                "reservation: {} lists neither user {} nor account {account}; its lists hold for admins' jobs too \
                 (an admin may pass --force-reservation; a job's credential may not)",
                spec.reservation, spec.user
            ),
        ))
    }

    /// With `--private-jobs`, a dependency on another user's job answers as
    /// one on a job long gone would: nothing tells whether it exists, is an
    /// array or how it ended.
    pub fn hide_dependencies(&self, ctx: &CallCtx, spec: &gangway_core::JobSpec) -> Result<(), Status> {
        if spec.dependencies.is_empty() {
            return Ok(());
        }
        let viewer = self.viewer(ctx);
        if !viewer.private_jobs {
            return Ok(());
        }
        let state = self.node.state().read();
        for d in &spec.dependencies {
            if state.jobs.get(&d.job_id).is_some_and(|j| !viewer.visible(j)) {
                let e = SpecError::new("dependency", format!("job {} was purged from the queue", d.job_id));
                return Err(status_from_spec(e));
            }
        }
        Ok(())
    }

    /// The owner of job `job_id` or an admin. A job that does not exist (yet,
    /// on this replica) is refused as not found: a check must never pass for a
    /// job id that someone else's job may take a moment later. Owners never
    /// change and ids are never reused, so the check holds until the command
    /// applies.
    pub fn require_owner(&self, ctx: &CallCtx, job_id: u64, what: &str) -> Result<(), Status> {
        let Caller::Verified(_) = &ctx.caller else { return Ok(()) };
        let owner = {
            let state = self.node.state().read();
            match state.jobs.get(&job_id) {
                None => return Err(Status::not_found(format!("job {job_id} does not exist"))),
                Some(j) => caller_owns(&state, ctx, j),
            }
        };
        if owner || self.is_admin(ctx) {
            return Ok(());
        }
        Err(denied(
            ctx,
            what,
            format!("{} does not own job {job_id}; only its owner and admins may {what}", ctx.identity),
        ))
    }

    /// A step credential for `job`'s current attempt on its nodes, signed with
    /// this replica's server key (empty on an insecure cluster, or for a job
    /// that holds no nodes).
    pub fn step_credential(&self, job: &gangway_core::Job) -> Result<String, Status> {
        let Some(creds) = self.security.credentials() else { return Ok(String::new()) };
        let Some(alloc) = job.allocation.as_ref() else { return Ok(String::new()) };
        // The limit's end, later by the time the job has been suspended.
        let end_s = job.expected_end_ms(crate::now_ms()) / 1000;
        let claims = gangway_proto::step_cred::StepClaims {
            job_id: job.id,
            attempt: job.attempt,
            nodes: alloc.nodes.iter().map(|n| n.node.clone()).collect(),
            expires_unix: end_s.saturating_add(STEP_CREDENTIAL_SLACK_S),
        };
        gangway_proto::step_cred::sign(creds, &claims)
            .map_err(|e| Status::internal(format!("cannot sign the step credential: {e}")))
    }

    /// Refuses a write over its caller's rate (RESOURCE_EXHAUSTED, with when
    /// to retry): users' and admins' (each from a budget of their own);
    /// agents and replicas are not limited. Counted on the leader, where every write ends up
    /// (a follower forwards it with the caller's identity), so the rate holds
    /// for the cluster, not per replica.
    pub(super) fn limit_writes(&self, ctx: &CallCtx, what: &str, bytes: usize) -> Result<(), Status> {
        let user = matches!(&ctx.caller, Caller::Verified(p) if p.role == Role::Client);
        if !user || !self.node.is_leader() {
            return Ok(());
        }
        let limiter = if self.is_admin(ctx) { &self.admin_writes } else { &self.writes };
        match limiter.check(&ctx.identity, bytes, std::time::Instant::now()) {
            Ok(()) => Ok(()),
            Err(wait) => {
                metrics::counter!("gangway_api_denied_total", "reason" => "rate").increment(1);
                let (rate, burst) = limiter.rate();
                let (bytes_rate, bytes_burst) = limiter.bytes_rate();
                let mib = |b: f64| b / (1024.0 * 1024.0);
                let mut s = Status::resource_exhausted(format!(
                    "rate: {} may make {rate} writes per second (bursts of {burst}) of {} MiB per second (bursts \
                     of {} MiB); retry in {} ms",
                    ctx.identity,
                    mib(bytes_rate),
                    mib(bytes_burst),
                    wait.as_millis().max(1)
                ));
                // The standard hint clients and proxies read.
                if let Ok(v) = format!("{}", wait.as_millis().max(1)).parse() {
                    s.metadata_mut().insert(crate::ratelimit::RETRY_AFTER_METADATA_KEY, v);
                }
                // Counted, not audited one by one: a flood past the rate must
                // not push admin actions out of the audit ring.
                tracing::debug!(caller = %ctx.identity, action = what, "write over the rate refused");
                Err(s)
            }
        }
    }

    /// An admin (see [`Replica::is_admin`]); every admin action is logged.
    pub fn require_admin(&self, ctx: &CallCtx, what: &str) -> Result<(), Status> {
        if self.is_admin(ctx) {
            ctx.audit(what, "allowed", "admin");
            return Ok(());
        }
        Err(denied(ctx, what, format!("{} is not an admin of this cluster; only admins may {what}", ctx.identity)))
    }

    /// An operator or admin (see [`Replica::is_operator`]); logged like admin actions.
    pub fn require_operator(&self, ctx: &CallCtx, what: &str) -> Result<(), Status> {
        if self.is_admin(ctx) {
            ctx.audit(what, "allowed", "admin");
            return Ok(());
        }
        if self.is_operator(ctx) {
            ctx.audit_bounded(what, "allowed", "operator");
            return Ok(());
        }
        Err(denied(
            ctx,
            what,
            format!("{} is not an operator or admin of this cluster; only they may {what}", ctx.identity),
        ))
    }

    /// An admin, or a coordinator of some account (whose policy changes the
    /// state machine then limits to their accounts, see
    /// `gangway_core::policy::coordinator_change`).
    pub fn require_admin_or_coordinator(&self, ctx: &CallCtx, what: &str) -> Result<(), Status> {
        if self.is_admin(ctx) {
            ctx.audit(what, "allowed", "admin");
            return Ok(());
        }
        let coordinator = matches!(&ctx.caller, Caller::Verified(p) if p.role == Role::Client)
            && ctx.via_job.is_none()
            && !self.node.state().read().policy.coordinated(&ctx.identity).is_empty();
        if coordinator {
            ctx.audit_bounded(what, "allowed", "coordinator (the state machine then checks the edit is in reach)");
            return Ok(());
        }
        Err(denied(
            ctx,
            what,
            format!("{} is not an admin or account coordinator of this cluster; only they may {what}", ctx.identity),
        ))
    }
}

/// Whether the caller owns `job`: a client whose jobs run as its user, or
/// who submitted it. A job's process acts as its Unix user already (its
/// identity names that user, not a certificate's holder), so the policy's
/// user map is not applied to it a second time.
pub fn caller_owns(state: &gangway_core::State, ctx: &CallCtx, job: &gangway_core::Job) -> bool {
    let Caller::Verified(p) = &ctx.caller else { return true };
    if p.role != Role::Client {
        return false;
    }
    match ctx.via_job {
        Some(_) => job.spec.user == p.name || job.submitted_by == ctx.identity,
        None => state.owns(job, &ctx.identity),
    }
}

/// What a caller may see of jobs: a job's script, command and environment
/// (which sbatch fills with the submitter's whole environment) only for its
/// owner, admins and the agents of its nodes; with private jobs, others'
/// jobs not at all, except to operators and (for their accounts) coordinators.
#[derive(Clone)]
pub struct Viewer {
    caller: Caller,
    identity: String,
    /// The Unix user a client's jobs run as (after the policy's user map).
    user: String,
    /// Sees every job whole (admins, servers, insecure clusters).
    whole: bool,
    /// Sees every job, without others' scripts and environments (operators).
    sees_all: bool,
    /// Accounts whose jobs this coordinator sees (theirs and those below).
    accounts: BTreeSet<String>,
    /// Others' jobs are not shown at all (the policy's or the replica's `private_jobs`).
    pub private_jobs: bool,
    /// A job's process acting through that job's step credential: it sees
    /// its own job whole, and its user's other jobs without their scripts,
    /// commands and environments.
    via_job: Option<u64>,
}

impl Viewer {
    /// A viewer who sees every job whole (unit tests of listings).
    #[cfg(test)]
    pub fn whole_for_tests() -> Viewer {
        Viewer {
            caller: Caller::Claimed("test".into()),
            identity: "test".into(),
            user: String::new(),
            whole: true,
            sees_all: true,
            accounts: BTreeSet::new(),
            private_jobs: false,
            via_job: None,
        }
    }

    /// Whether the ids of the jobs that preempted others are another
    /// user's business to this caller (private jobs, and it sees not all).
    fn hides_preemptors(&self) -> bool {
        self.private_jobs && !self.whole && !self.sees_all
    }

    /// A job's reason as this caller may read it, from the job's typed
    /// stop cause (format 18): a hidden preemptor's id left out.
    pub fn job_reason(&self, job: &gangway_core::Job) -> String {
        match &job.stop_cause {
            // The text scan after it too: never more shown than it shows.
            Some(cause @ StopCause::Preempted { .. }) if self.hides_preemptors() => {
                self.reason(&job.reason.replace(&cause.describe(true), &cause.describe(false)))
            }
            Some(_) => job.reason.clone(),
            // Written before format 18, or text from outside the state.
            None => self.reason(&job.reason),
        }
    }

    /// A reason's text as this caller may read it, for text that left the
    /// state as text (events, the accounting store's history, jobs from
    /// before format 18): with private jobs, the id of the job that
    /// preempted it is another user's business.
    pub fn reason(&self, reason: &str) -> String {
        const PREEMPTED_BY: &str = StopCause::PREEMPTED_BY;
        if !self.hides_preemptors() || !reason.contains(PREEMPTED_BY) {
            return reason.to_string();
        }
        let mut out = String::with_capacity(reason.len());
        let mut rest = reason;
        while let Some(i) = rest.find(PREEMPTED_BY) {
            out.push_str(&rest[..i]);
            out.push_str("preempted by another job");
            rest = rest[i.saturating_add(PREEMPTED_BY.len())..]
                .trim_start_matches(|c: char| c.is_ascii_digit() || c == '_');
        }
        out.push_str(rest);
        out
    }

    /// Whether this client owns the job: it runs as their user, or they submitted it.
    fn owns(&self, p: &Principal, job: &gangway_core::Job) -> bool {
        p.role == Role::Client && (job.spec.user == self.user || job.submitted_by == self.identity)
    }

    /// Whose stored history this caller may read: [`Viewer::visible`] for
    /// jobs known only by their user and account.
    pub fn history_scope(&self) -> crate::accounting::Scope {
        use crate::accounting::Scope;
        if !self.private_jobs || self.whole || self.sees_all {
            return Scope::All;
        }
        match &self.caller {
            Caller::Claimed(_) => Scope::All,
            Caller::Verified(p) => match p.role {
                Role::Server => Scope::All,
                // A node's agent reads no history; a user theirs and their accounts'.
                Role::Agent => Scope::Own { user: String::new(), accounts: Vec::new() },
                Role::Client => {
                    Scope::Own { user: self.user.clone(), accounts: self.accounts.iter().cloned().collect() }
                }
            },
        }
    }

    /// Whether the job is shown at all.
    pub fn visible(&self, job: &gangway_core::Job) -> bool {
        if !self.private_jobs || self.whole || self.sees_all {
            return true;
        }
        match &self.caller {
            Caller::Claimed(_) => true,
            Caller::Verified(p) => match p.role {
                Role::Server => true,
                Role::Agent => job.allocation.as_ref().is_some_and(|a| a.nodes.iter().any(|n| n.node == p.name)),
                Role::Client => self.owns(p, job) || self.accounts.contains(&job.spec.account),
            },
        }
    }

    pub fn job(&self, job: &gangway_core::Job) -> gangway_proto::v1::Job {
        let mut pj = convert::job_to_proto(job);
        pj.reason = self.job_reason(job);
        let private = !self.whole
            && match &self.caller {
                Caller::Claimed(_) => false,
                Caller::Verified(p) => match p.role {
                    Role::Server => false,
                    Role::Agent => !job.allocation.as_ref().is_some_and(|a| a.nodes.iter().any(|n| n.node == p.name)),
                    Role::Client => !self.owns(p, job) || self.via_job.is_some_and(|own| own != job.id),
                },
            };
        if private {
            if let Some(spec) = pj.spec.as_mut() {
                spec.env.clear();
                spec.script.clear();
                spec.command.clear();
            }
        }
        pj
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_viewers_do_not_learn_who_preempted_them() {
        let bob = Principal::new(Role::Client, "bob").unwrap();
        let viewer = |private_jobs, whole| Viewer {
            caller: Caller::Verified(bob.clone()),
            identity: bob.encode(),
            user: "bob".into(),
            whole,
            sees_all: false,
            accounts: BTreeSet::new(),
            private_jobs,
            via_job: None,
        };
        let r = "requeued: preempted by job 4242_7 (grace 30 s)";
        assert_eq!(viewer(true, false).reason(r), "requeued: preempted by another job (grace 30 s)");
        assert_eq!(viewer(false, false).reason(r), r);
        assert_eq!(viewer(true, true).reason(r), r, "admins see everything");
        assert_eq!(viewer(true, false).reason("held by user"), "held by user");
        // From format 18 the job's typed cause says who preempted it.
        let job = gangway_core::Job {
            reason: "requeued: preempted by job 42".into(),
            stop_cause: Some(StopCause::Preempted { by: 42 }),
            ..Default::default()
        };
        assert_eq!(viewer(true, false).job_reason(&job), "requeued: preempted by another job");
        assert_eq!(viewer(false, false).job_reason(&job), job.reason);
        let cancelled = gangway_core::Job {
            reason: "cancelled by preempted by job 7".into(),
            stop_cause: Some(StopCause::CancelledBy { identity: "preempted by job 7".into() }),
            ..Default::default()
        };
        assert_eq!(viewer(true, false).job_reason(&cancelled), cancelled.reason, "only a preemption's words");
    }

    /// On an insecure cluster a claimed identity of IDENTITY_BYTES_MAX bytes
    /// is taken; one byte more is refused, naming the header and the limit.
    #[test]
    fn a_claimed_identity_is_bounded_at_the_edge() {
        let claim = |len: usize| {
            let mut req = Request::new(());
            let peer = gangway_proto::tls::PeerInfo { remote: None, auth: PeerAuth::Insecure, activity: None };
            req.extensions_mut().insert(peer);
            req.metadata_mut().insert(IDENTITY_METADATA_KEY, "a".repeat(len).parse().unwrap());
            CallCtx::of(&req, None)
        };
        assert_eq!(claim(IDENTITY_BYTES_MAX).unwrap().identity, "a".repeat(IDENTITY_BYTES_MAX));
        let e = claim(IDENTITY_BYTES_MAX + 1).unwrap_err();
        assert_eq!(e.code(), tonic::Code::InvalidArgument);
        assert_eq!(e.message(), format!("{IDENTITY_METADATA_KEY}: must be 1 to {IDENTITY_BYTES_MAX} bytes"));
    }
}
