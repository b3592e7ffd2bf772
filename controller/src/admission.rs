//! The gate every request passes before its body is read: who may call which
//! service, and how many bytes of request each may send.
//!
//! tonic decodes a whole message before a handler sees it, so a handler's
//! role check comes after the replica has buffered what the caller sent. The
//! gate runs first, on the request's head alone (the path, the transport's
//! verified peer, the credential headers), and either refuses at once — the
//! body is never read, and HTTP/2 flow control keeps what the client already
//! sent to one stream window — or lets the request through with its body
//! capped at what that caller may send to that method.
//!
//! | caller (as the transport and the head say)  | may call              | request bytes            |
//! |---------------------------------------------|-----------------------|--------------------------|
//! | server certificate                          | everything            | Raft: RAFT_MESSAGE_BYTES_MAX |
//! | agent certificate, or a server forwarding   | AgentService, users'  | AGENT_MESSAGE_BYTES_MAX  |
//! | client certificate, valid bearer token, well-signed step credential | users' services | API_REQUEST_BYTES_MAX for the big methods, SMALL_REQUEST_BYTES_MAX for the rest |
//! | nobody (no certificate, no credential)      | gRPC health only      | STRANGER_REQUEST_BYTES_MAX |
//!
//! Handlers still make every decision they made before (`Replica::ctx` and
//! the `require_*` checks): the gate only refuses what they would refuse
//! anyway, earlier and cheaper.

#![cfg_attr(not(test), deny(clippy::arithmetic_side_effects, clippy::cast_possible_truncation))]

use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use gangway_proto::limits::{AGENT_MESSAGE_BYTES_MAX, API_REQUEST_BYTES_MAX};
use gangway_proto::tls::{PeerAuth, PeerInfo, Role, Security};
use gangway_proto::token::{TokenVerifier, AUTHORIZATION_METADATA_KEY};
use http_body_util::BodyExt;
use tonic::body::BoxBody;
use tonic::Status;

use crate::audit::AuditLog;
use crate::raft::RAFT_MESSAGE_BYTES_MAX;

/// Requests of every user method but the few that carry a job spec or a
/// policy: ids, names, filters. 64 KiB is hundreds of times the largest.
pub const SMALL_REQUEST_BYTES_MAX: usize = 64 * 1024;
/// Requests from a caller nobody vouches for (health checks): a health
/// request is a service name.
pub const STRANGER_REQUEST_BYTES_MAX: usize = 1024;
/// gRPC frames each message with a flag byte and a 4-byte length: a
/// request body of one message is this much longer than the message, so a
/// message of exactly a method's limit passes (the limits are the
/// messages', as tonic's own decoding limits are).
const GRPC_FRAME_HEADER_BYTES: usize = 5;

/// The methods whose requests may be large (a job spec of up to 2 MiB, a
/// policy, a node inventory, a reservation naming thousands of nodes, fair
/// share's history).
const LARGE_METHODS: [&str; 6] = [
    "/gangway.v1.JobService/Submit",
    "/gangway.v1.JobService/TestSubmit",
    "/gangway.v1.AdminService/UpdatePolicy",
    "/gangway.v1.AdminService/SetNodeInventory",
    "/gangway.v1.AdminService/RestoreUsage",
    "/gangway.v1.AdminService/ChangeReservation",
];

/// Who a request comes from, as far as its head tells.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Who {
    /// A plaintext listener (`--insecure`): claims are all there is.
    Insecure,
    Server,
    Agent,
    /// A client certificate.
    Client,
    /// No certificate, but a bearer token that verifies or a step credential
    /// this cluster signed (the handler checks the rest).
    Credentialed,
    /// Nobody vouches for it.
    Stranger,
    /// A server certificate (or a step credential one signed) whose replica
    /// is not a member of the cluster: removed, or never added.
    NotMember,
}

/// What the gate decided for one request.
#[derive(Debug, Clone)]
pub enum Verdict {
    /// Through, with at most this many request bytes.
    Pass(usize),
    Refuse(Status),
}

/// The service a request's path names (as the router reads it).
fn service_of(path: &str) -> &str {
    path.trim_start_matches('/').split('/').next().unwrap_or("")
}

/// The gate's rule: pure over the path and the caller.
pub fn rule(path: &str, who: Who) -> Verdict {
    let service = service_of(path);
    let any_known = !matches!(who, Who::Stranger | Who::NotMember);
    if who == Who::NotMember && path != "/grpc.health.v1.Health/Check" {
        return Verdict::Refuse(Status::unauthenticated(
            "the replica this server certificate names is not a member of the cluster (a removed replica's \
             certificate, or a step credential it signed, opens nothing)",
        ));
    }
    match service {
        // Anyone may ask whether the replica serves (load balancers and
        // probes carry no certificate); only a known caller may hold a
        // Watch stream open.
        "grpc.health.v1.Health" if any_known || path == "/grpc.health.v1.Health/Check" => {
            Verdict::Pass(STRANGER_REQUEST_BYTES_MAX)
        }
        "grpc.health.v1.Health" => {
            Verdict::Refuse(Status::unauthenticated("a health watch needs a certificate or a bearer token"))
        }
        "gangway.v1.RaftService" => match who {
            Who::Server | Who::Insecure => Verdict::Pass(RAFT_MESSAGE_BYTES_MAX),
            Who::Stranger | Who::Credentialed | Who::NotMember => {
                Verdict::Refuse(Status::unauthenticated("Raft needs a server certificate signed by the cluster's CA"))
            }
            Who::Agent | Who::Client => Verdict::Refuse(Status::permission_denied(
                "permission: only controller replicas (server certificates) take part in Raft",
            )),
        },
        "gangway.v1.AgentService" => match who {
            Who::Server | Who::Agent | Who::Insecure => Verdict::Pass(AGENT_MESSAGE_BYTES_MAX),
            Who::Stranger | Who::NotMember => {
                Verdict::Refuse(Status::unauthenticated("AgentService needs an agent certificate"))
            }
            Who::Client | Who::Credentialed => Verdict::Refuse(Status::permission_denied(
                "permission: only node agents (agent certificates) call AgentService",
            )),
        },
        _ if !any_known => Verdict::Refuse(Status::unauthenticated(
            "no client certificate and no bearer token: present a client certificate signed by the cluster's CA \
             (gangway tls cert create --client NAME) or a bearer token (gangway token create)",
        )),
        _ if LARGE_METHODS.contains(&path) => Verdict::Pass(API_REQUEST_BYTES_MAX),
        _ => Verdict::Pass(SMALL_REQUEST_BYTES_MAX),
    }
}

/// Whether a replica (by its certificate's name) is a member now.
type MemberCheck = Arc<dyn Fn(&str) -> bool + Send + Sync>;

/// What the gate needs to tell callers apart.
pub struct Gate {
    security: Security,
    tokens: Option<Arc<TokenVerifier>>,
    audit: Arc<AuditLog>,
    /// Whether a step credential's job attempt still runs.
    state: Arc<gangway_raft_store::SharedState>,
    /// Whether Raft is served on the replica's peer port, not behind this
    /// gate: asked for each Raft message (see [`Gate::raft_elsewhere`]).
    raft_elsewhere: Option<Arc<dyn Fn() -> bool + Send + Sync>>,
    /// Whether a server certificate's replica (by name) is a member: one
    /// that is not (removed, or never added) is nobody here, nor is a step
    /// credential it signed (see [`Gate::members`]).
    member: Option<MemberCheck>,
}

impl Gate {
    pub fn new(
        security: Security,
        tokens: Option<Arc<TokenVerifier>>,
        audit: Arc<AuditLog>,
        state: Arc<gangway_raft_store::SharedState>,
    ) -> Gate {
        Gate { security, tokens, audit, state, raft_elsewhere: None, member: None }
    }

    /// The replica has a peer port (`--peer-listen`): while `elsewhere` says
    /// the cluster's membership sends its Raft messages there, one arriving
    /// here is refused before it is read. Until then (a cluster formed
    /// without peer ports, moving to them replica by replica) this listener
    /// still takes them, from replicas only, so its peers never lose it.
    pub fn raft_elsewhere(mut self, elsewhere: impl Fn() -> bool + Send + Sync + 'static) -> Gate {
        self.raft_elsewhere = Some(Arc::new(elsewhere));
        self
    }

    /// Servers count as servers only while `member` says their replica is
    /// a member of the cluster (membership, not certificate expiry, decides).
    pub fn members(mut self, member: impl Fn(&str) -> bool + Send + Sync + 'static) -> Gate {
        self.member = Some(Arc::new(member));
        self
    }

    fn is_member(&self, server: &str) -> bool {
        self.member.as_ref().is_none_or(|m| m(server))
    }

    /// Who `head` comes from: the transport's verified peer, or for a
    /// connection without a certificate a credential in the head that
    /// verifies (a bearer token, a step credential's signature).
    pub fn who(&self, head: &http::request::Parts) -> Who {
        let peer = head.extensions.get::<PeerInfo>().map(|p| p.auth.clone()).unwrap_or(PeerAuth::Anonymous);
        match peer {
            PeerAuth::Insecure => Who::Insecure,
            PeerAuth::Verified(p) => match p.role {
                Role::Server if !self.is_member(&p.name) => Who::NotMember,
                Role::Server => Who::Server,
                Role::Agent => Who::Agent,
                Role::Client => Who::Client,
            },
            PeerAuth::Unusable(_) => Who::Stranger,
            PeerAuth::Anonymous => {
                let header = |k: &str| head.headers.get(k).and_then(|v| v.to_str().ok());
                if let Some(token) = header(AUTHORIZATION_METADATA_KEY).and_then(|v| v.strip_prefix("Bearer ")) {
                    let ok = self.tokens.as_ref().is_some_and(|t| t.verify(token.trim()).is_ok());
                    return if ok { Who::Credentialed } else { Who::Stranger };
                }
                if let (Some(cred), Some(creds)) =
                    (header(gangway_proto::step_cred::STEP_CREDENTIAL_METADATA_KEY), self.security.credentials())
                {
                    let now =
                        std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs());
                    if let Ok((claims, signer)) = gangway_proto::step_cred::verify_signed_by(creds, cred, now) {
                        if !self.is_member(&signer.name) {
                            return Who::NotMember;
                        }
                        // A credential whose attempt ended vouches for nobody.
                        let live =
                            self.state.read().jobs.get(&claims.job_id).is_some_and(|j| {
                                j.attempt == claims.attempt && j.state == gangway_core::JobState::Running
                            });
                        return if live { Who::Credentialed } else { Who::Stranger };
                    }
                }
                Who::Stranger
            }
        }
    }

    /// Puts a refusal in the audit trail as the handlers would.
    fn audit_refusal(&self, head: &http::request::Parts, status: &Status) {
        let method = head.uri.path().rsplit('/').next().unwrap_or("call");
        let action = if head.uri.path().starts_with("/gangway.v1.RaftService/") { "raft" } else { method };
        let peer = head.extensions.get::<PeerInfo>();
        match peer.map(|p| &p.auth) {
            Some(PeerAuth::Verified(p)) => {
                metrics::counter!("gangway_api_denied_total", "reason" => "permission").increment(1);
                self.audit.record_refused(&p.encode(), action, "denied", status.message());
            }
            _ => {
                metrics::counter!("gangway_api_denied_total", "reason" => "unauthenticated").increment(1);
                let ip = peer.and_then(|p| p.remote).map(|a| a.ip());
                self.audit.record_anonymous(ip, action, "unauthenticated", status.message());
            }
        }
    }
}

/// The tower layer that puts a [`Gate`] in front of the services.
#[derive(Clone)]
pub struct GateLayer(pub Arc<Gate>);

impl<S> tower_layer::Layer<S> for GateLayer {
    type Service = Gated<S>;
    fn layer(&self, inner: S) -> Gated<S> {
        Gated { gate: self.0.clone(), inner }
    }
}

#[derive(Clone)]
pub struct Gated<S> {
    gate: Arc<Gate>,
    inner: S,
}

type BoxFuture<T, E> = Pin<Box<dyn Future<Output = Result<T, E>> + Send>>;

impl<S> tower_service::Service<http::Request<BoxBody>> for Gated<S>
where
    S: tower_service::Service<http::Request<BoxBody>, Response = http::Response<BoxBody>> + Clone + Send + 'static,
    S::Future: Send + 'static,
    S::Error: Send + 'static,
{
    type Response = http::Response<BoxBody>;
    type Error = S::Error;
    type Future = BoxFuture<Self::Response, Self::Error>;

    fn poll_ready(&mut self, cx: &mut Context<'_>) -> Poll<Result<(), Self::Error>> {
        self.inner.poll_ready(cx)
    }

    fn call(&mut self, req: http::Request<BoxBody>) -> Self::Future {
        let (head, body) = req.into_parts();
        let raft = service_of(head.uri.path()) == "gangway.v1.RaftService";
        let verdict = if raft && self.gate.raft_elsewhere.as_ref().is_some_and(|elsewhere| elsewhere()) {
            Verdict::Refuse(Status::failed_precondition(
                "this replica serves Raft on its peer port (--peer-listen), not here",
            ))
        } else {
            rule(head.uri.path(), self.gate.who(&head))
        };
        match verdict {
            Verdict::Refuse(status) => {
                self.gate.audit_refusal(&head, &status);
                // The body is dropped unread: the stream is reset, and what
                // the client sent stays within its flow-control window.
                drop(body);
                Box::pin(std::future::ready(Ok(status.into_http())))
            }
            Verdict::Pass(limit) => {
                // The request is in progress on its connection until its
                // response (a stream, perhaps) ends: the idle limit waits.
                let active = head.extensions.get::<PeerInfo>().and_then(|p| p.activity.as_ref()).map(|a| a.begin());
                let body_limit = limit.saturating_add(GRPC_FRAME_HEADER_BYTES);
                let limited = http_body_util::Limited::new(body, body_limit).map_err(move |e| {
                    Status::resource_exhausted(format!(
                        "request: at most {limit} bytes for this method from this caller ({e})"
                    ))
                });
                let req = http::Request::from_parts(head, BoxBody::new(limited));
                // The clone taken by poll_ready's contract: tower's usual dance.
                let clone = self.inner.clone();
                let mut inner = std::mem::replace(&mut self.inner, clone);
                Box::pin(async move {
                    let resp = inner.call(req).await?;
                    Ok(resp.map(|body| {
                        BoxBody::new(body.map_frame(move |frame| {
                            let _in_progress = &active;
                            frame
                        }))
                    }))
                })
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn strangers_reach_only_health_and_raft_only_servers() {
        use Who::*;
        let raft = "/gangway.v1.RaftService/AppendEntries";
        let hb = "/gangway.v1.AgentService/Heartbeat";
        let list = "/gangway.v1.JobService/List";
        let submit = "/gangway.v1.JobService/Submit";
        let health = "/grpc.health.v1.Health/Check";
        let code = |v: Verdict| match v {
            Verdict::Refuse(s) => Some(s.code()),
            Verdict::Pass(_) => None,
        };
        for who in [Stranger, Credentialed] {
            assert_eq!(code(rule(raft, who)), Some(tonic::Code::Unauthenticated));
        }
        for who in [Agent, Client] {
            assert_eq!(code(rule(raft, who)), Some(tonic::Code::PermissionDenied));
        }
        assert_eq!(code(rule(hb, Stranger)), Some(tonic::Code::Unauthenticated));
        assert_eq!(code(rule(hb, Client)), Some(tonic::Code::PermissionDenied));
        assert_eq!(code(rule(hb, Credentialed)), Some(tonic::Code::PermissionDenied));
        assert_eq!(code(rule(list, Stranger)), Some(tonic::Code::Unauthenticated));
        assert_eq!(code(rule("/grpc.reflection.v1.ServerReflection/X", Stranger)), Some(tonic::Code::Unauthenticated));
        let pass = |v: Verdict| match v {
            Verdict::Pass(n) => Some(n),
            Verdict::Refuse(_) => None,
        };
        assert_eq!(pass(rule(health, Stranger)), Some(STRANGER_REQUEST_BYTES_MAX));
        // A replica that is not a member is nobody: everything but the
        // health check refused, naming why.
        for path in [raft, hb, list, submit, "/gangway.v1.AdminService/ClusterStatus"] {
            let Verdict::Refuse(s) = rule(path, NotMember) else { panic!("{path} passed a non-member") };
            assert_eq!(s.code(), tonic::Code::Unauthenticated, "{path}");
            assert!(s.message().contains("not a member"), "{path}: {}", s.message());
        }
        assert!(pass(rule(health, NotMember)).is_some());
        assert_eq!(code(rule("/grpc.health.v1.Health/Watch", Stranger)), Some(tonic::Code::Unauthenticated));
        assert_eq!(pass(rule("/grpc.health.v1.Health/Watch", Client)), Some(STRANGER_REQUEST_BYTES_MAX));
        assert_eq!(pass(rule(raft, Server)), Some(RAFT_MESSAGE_BYTES_MAX));
        assert_eq!(pass(rule(raft, Insecure)), Some(RAFT_MESSAGE_BYTES_MAX));
        assert_eq!(pass(rule(hb, Agent)), Some(AGENT_MESSAGE_BYTES_MAX));
        assert_eq!(pass(rule(hb, Server)), Some(AGENT_MESSAGE_BYTES_MAX));
        assert_eq!(pass(rule(submit, Credentialed)), Some(API_REQUEST_BYTES_MAX));
        assert_eq!(pass(rule(list, Client)), Some(SMALL_REQUEST_BYTES_MAX));
        assert_eq!(pass(rule(list, Credentialed)), Some(SMALL_REQUEST_BYTES_MAX));
    }
}
