//! Transport security: mutual TLS on every Gangway connection, with the peer's
//! role read from its certificate.
//!
//! Every certificate a Gangway cluster trusts is signed by the cluster's CA and
//! names its holder in a URI subject alternative name,
//! `spiffe://<cluster>/<role>/<name>` (the SPIFFE trust domain is the
//! cluster's name, `gangway` unless `gangway tls --cluster` says otherwise):
//! - `server/<id>`: a controller replica (may call Raft and membership RPCs);
//! - `agent/<node>`: the node agent of host `<node>` (may speak only for it);
//! - `client/<name>`: a user or a service, `<name>` being its user name.
//!
//! Any CA can issue them (`gangway tls` does, and so can cert-manager or Vault,
//! given the URI SAN). Clients check a server's certificate by its chain and its
//! role, not by host name: replicas are dialled by address and all of them are
//! `server`s. Certificates and the CA are read again when their files change, so
//! rotating them needs no restart.
//!
//! A process with a certificate of its own accepts only peers of its own
//! cluster: two clusters that share a CA (one company CA, a Vault PKI mount)
//! but not a name refuse each other's certificates in the handshake, and a
//! step credential signed by the other's replicas.
//!
//! `Security::Insecure` (the `--insecure` flag) is plaintext gRPC where callers
//! name themselves; it exists for throwaway test clusters and says so loudly.

use std::fmt;
use std::future::Future;
use std::io;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::{Arc, Mutex, RwLock};
use std::task::{Context, Poll};
use std::time::{Duration, Instant, SystemTime};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::{CertificateDer, PrivateKeyDer, ServerName, UnixTime};
use rustls::server::danger::{ClientCertVerified, ClientCertVerifier};
use rustls::server::{ParsedCertificate, WebPkiClientVerifier};
use rustls::sign::CertifiedKey;
use rustls::{DigitallySignedStruct, DistinguishedName, RootCertStore, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio::net::{TcpListener, TcpStream};
use tonic::transport::server::Connected;
use tonic::transport::{Channel, Endpoint, Uri};

/// The URI SAN scheme that carries a certificate's cluster, role and name.
pub const SPIFFE_SCHEME: &str = "spiffe://";
/// The cluster name (SPIFFE trust domain) of certificates made without one.
pub const DEFAULT_CLUSTER: &str = "gangway";
/// The URI SAN prefix of the default cluster's certificates.
pub const SAN_PREFIX: &str = "spiffe://gangway/";
/// Cluster names are SPIFFE trust domains: short, lower case, DNS-like.
pub const CLUSTER_NAME_BYTES_MAX: usize = 64;
/// Principal names are user, node and replica names: short and path-safe.
pub const PRINCIPAL_NAME_BYTES_MAX: usize = 128;
/// How often a connection checks whether the certificate files changed. A stat
/// per second per process is free; rotation shows up within a second.
const RELOAD_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// A peer that has not finished its handshake by then is dropped: it would
/// otherwise hold a socket and a handshake slot for as long as it likes. A
/// handshake takes a millisecond or two on a LAN; 5 s covers a slow WAN.
pub const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(5);
/// Handshakes in progress at once per listener. Bounds the CPU and memory an
/// unauthenticated flood can take (a handshake is a few kilobytes and one
/// signature); connections beyond it are closed at once, never left waiting,
/// so the listener keeps accepting.
pub const HANDSHAKES_IN_FLIGHT_MAX: usize = 256;
/// Handshakes in progress at once from one network prefix (an IPv4 /24, an
/// IPv6 /64: see [`prefix_of`]), so one host cannot take every slot however
/// many addresses it has. A handshake takes a millisecond or two; a rack of
/// agents reconnecting at once retries what is shed, jittered.
pub const HANDSHAKES_PER_PREFIX_MAX: usize = 64;
/// Connections accepted but not yet taken by the gRPC server.
const ACCEPTED_QUEUE_MAX: usize = 64;
/// Largest certificate, key or CA file read: real ones are a few kilobytes.
const PEM_FILE_BYTES_MAX: u64 = 1024 * 1024;
/// The name sent as SNI; servers are verified by role, not by this name
/// (server and agent certificates from `gangway tls` carry `server.gangway`
/// or `agent.gangway` as a DNS name, for tools that check names).
pub const SNI_NAME: &str = "gangway";

/// What a certificate allows its holder to be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Role {
    Server,
    Agent,
    Client,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::Server => "server",
            Role::Agent => "agent",
            Role::Client => "client",
        }
    }

    pub fn parse(s: &str) -> Option<Role> {
        match s {
            "server" => Some(Role::Server),
            "agent" => Some(Role::Agent),
            "client" => Some(Role::Client),
            _ => None,
        }
    }
}

/// A verified holder of a certificate: its role and name.
#[derive(Debug, Clone, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Principal {
    pub role: Role,
    pub name: String,
}

impl Principal {
    pub fn new(role: Role, name: &str) -> Result<Principal, String> {
        check_principal_name(name)?;
        Ok(Principal { role, name: name.to_string() })
    }

    /// `role:name`, the form forwarded between replicas and written in logs.
    pub fn encode(&self) -> String {
        format!("{}:{}", self.role.as_str(), self.name)
    }

    /// A principal from its `role:name` form, read by the core's one
    /// identity parser (`gangway_core::policy::Identity`), strictly: the
    /// text must be exactly a role, `:`, and a valid name.
    pub fn decode(s: &str) -> Result<Principal, String> {
        use gangway_core::policy::{Identity, IdentityKind};
        let (kind, _) = s.split_once(':').ok_or_else(|| format!("'{s}' is not role:name"))?;
        let id = Identity::parse(s);
        let role = match id.kind {
            IdentityKind::Server => Role::Server,
            IdentityKind::Agent => Role::Agent,
            IdentityKind::Client => Role::Client,
            IdentityKind::Other => return Err(format!("'{kind}' is not a role (server, agent, client)")),
        };
        // The core reads the last `:`-part as the name; a principal's name
        // holds none, so the text must be the role and the name alone.
        let name = s.get(kind.len().saturating_add(1)..).unwrap_or_default();
        if name != id.name {
            return Err(format!("name '{name}' must not contain ':'"));
        }
        Principal::new(role, name)
    }

    pub fn san_uri(&self) -> String {
        self.san_uri_in(DEFAULT_CLUSTER)
    }

    /// The URI SAN naming this principal in cluster `cluster`.
    pub fn san_uri_in(&self, cluster: &str) -> String {
        format!("{SPIFFE_SCHEME}{cluster}/{}/{}", self.role.as_str(), self.name)
    }
}

impl fmt::Display for Principal {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}:{}", self.role.as_str(), self.name)
    }
}

/// Names are 1 to 128 bytes of letters, digits, `.`, `_`, `-` and `@`, starting
/// with a letter or digit: safe in a URI path, a file name and a log line.
pub fn check_principal_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > PRINCIPAL_NAME_BYTES_MAX {
        return Err(format!("name '{name}' must be 1 to {PRINCIPAL_NAME_BYTES_MAX} bytes"));
    }
    let first_ok = name.chars().next().is_some_and(|c| c.is_ascii_alphanumeric());
    if !first_ok || !name.chars().all(|c| c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '@')) {
        return Err(format!(
            "name '{name}' may hold only letters, digits, '.', '_', '-' and '@', starting with a letter or digit"
        ));
    }
    Ok(())
}

/// A cluster name as a SPIFFE trust domain: 1 to 64 bytes of lower-case
/// letters, digits, `.`, `-` and `_`.
pub fn check_cluster_name(name: &str) -> Result<(), String> {
    if name.is_empty() || name.len() > CLUSTER_NAME_BYTES_MAX {
        return Err(format!("cluster name '{name}' must be 1 to {CLUSTER_NAME_BYTES_MAX} bytes"));
    }
    if !name.chars().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || matches!(c, '.' | '-' | '_')) {
        return Err(format!("cluster name '{name}' may hold only lower-case letters, digits, '.', '-' and '_'"));
    }
    Ok(())
}

/// A certificate's Gangway principal (from its `spiffe://CLUSTER/ROLE/NAME`
/// URI SAN) and its expiry (Unix seconds), whatever its cluster.
pub fn principal_of(der: &[u8]) -> Result<(Principal, i64), String> {
    principal_in_cluster(der).map(|(p, _, not_after)| (p, not_after))
}

/// A certificate's principal, the cluster it names it in, and its expiry.
pub fn principal_in_cluster(der: &[u8]) -> Result<(Principal, String, i64), String> {
    use x509_parser::prelude::{FromDer, GeneralName, X509Certificate};
    let (_, cert) = X509Certificate::from_der(der).map_err(|e| format!("not an X.509 certificate: {e}"))?;
    let not_after = cert.validity().not_after.timestamp();
    let san =
        cert.subject_alternative_name().map_err(|e| format!("subject alternative names: {e}"))?.ok_or_else(|| {
            format!("the certificate has no subject alternative names (needs a {SPIFFE_SCHEME}CLUSTER/ROLE/NAME URI)")
        })?;
    let mut found = None;
    for name in &san.value.general_names {
        if let GeneralName::URI(uri) = name {
            if let Some(rest) = uri.strip_prefix(SPIFFE_SCHEME) {
                if found.is_some() {
                    return Err(format!("the certificate names more than one {SPIFFE_SCHEME} principal"));
                }
                let bad = || format!("URI SAN '{uri}' is not {SPIFFE_SCHEME}CLUSTER/ROLE/NAME");
                let (cluster, rest) = rest.split_once('/').ok_or_else(bad)?;
                let (role, name) = rest.split_once('/').ok_or_else(bad)?;
                check_cluster_name(cluster).map_err(|e| format!("URI SAN '{uri}': {e}"))?;
                let role = Role::parse(role).ok_or_else(|| format!("URI SAN '{uri}': unknown role '{role}'"))?;
                found = Some((Principal::new(role, name)?, cluster.to_string()));
            }
        }
    }
    let (p, cluster) =
        found.ok_or_else(|| format!("the certificate has no {SPIFFE_SCHEME}CLUSTER/ROLE/NAME URI SAN"))?;
    Ok((p, cluster, not_after))
}

/// Refuses a peer certificate of another cluster than `own` (when this
/// process has a certificate, and so a cluster, of its own).
fn same_cluster(own: Option<&str>, peer: &CertificateDer<'_>) -> Result<(), rustls::Error> {
    let Some(own) = own else { return Ok(()) };
    let (p, cluster, _) = principal_in_cluster(peer).map_err(rustls::Error::General)?;
    if cluster != own {
        return Err(rustls::Error::General(format!(
            "{p}'s certificate is of cluster '{cluster}', not '{own}' (a CA shared by two clusters)"
        )));
    }
    Ok(())
}

/// Where this process's CA, certificate and key live (PEM files).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TlsFiles {
    pub ca: PathBuf,
    /// This process's certificate and key; `None` for a client that only
    /// verifies servers (srun inside a job, which proves itself otherwise).
    pub cert: Option<(PathBuf, PathBuf)>,
}

impl TlsFiles {
    /// The files `gangway tls` writes into `dir` for `stem` (`ca.pem`,
    /// `STEM.pem`, `STEM-key.pem`).
    pub fn in_dir(dir: &Path, stem: &str) -> TlsFiles {
        TlsFiles {
            ca: dir.join("ca.pem"),
            cert: Some((dir.join(format!("{stem}.pem")), dir.join(format!("{stem}-key.pem")))),
        }
    }
}

/// What was read from the files at one time.
struct Material {
    roots: Arc<RootCertStore>,
    client_verifier: Arc<dyn ClientCertVerifier>,
    key: Option<Arc<CertifiedKey>>,
    principal: Option<Principal>,
    /// The cluster this process's certificate names.
    cluster: Option<String>,
    not_after: Option<i64>,
    stamp: Vec<Option<(SystemTime, u64)>>,
}

fn stamp_of(files: &TlsFiles) -> Vec<Option<(SystemTime, u64)>> {
    let mut paths = vec![files.ca.as_path()];
    if let Some((c, k)) = &files.cert {
        paths.push(c);
        paths.push(k);
    }
    paths.into_iter().map(|p| std::fs::metadata(p).ok().and_then(|m| Some((m.modified().ok()?, m.len())))).collect()
}

fn read_pem(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if meta.len() > PEM_FILE_BYTES_MAX {
        return Err(format!("{what} {}: larger than {PEM_FILE_BYTES_MAX} bytes", path.display()));
    }
    std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

/// The one crypto provider (ring), built once: every handshake asks for it.
pub(crate) fn provider() -> Arc<CryptoProvider> {
    static PROVIDER: std::sync::OnceLock<Arc<CryptoProvider>> = std::sync::OnceLock::new();
    PROVIDER.get_or_init(|| Arc::new(rustls::crypto::ring::default_provider())).clone()
}

/// The CA certificates in `pem` and a verifier of client certificates they signed.
fn trust(pem: &[u8], label: &str) -> Result<(Arc<RootCertStore>, Arc<dyn ClientCertVerifier>), String> {
    let mut roots = RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut &pem[..]) {
        let c = c.map_err(|e| format!("CA certificate {label}: {e}"))?;
        roots.add(c).map_err(|e| format!("CA certificate {label}: {e}"))?;
    }
    if roots.is_empty() {
        return Err(format!("CA certificate {label}: no certificate in it"));
    }
    let roots = Arc::new(roots);
    let client_verifier = WebPkiClientVerifier::builder_with_provider(roots.clone(), provider())
        .allow_unauthenticated()
        .build()
        .map_err(|e| format!("CA certificate {label}: {e}"))?;
    Ok((roots, client_verifier))
}

fn load(files: &TlsFiles) -> Result<Material, String> {
    let stamp = stamp_of(files);
    let ca_pem = read_pem(&files.ca, "CA certificate")?;
    let (roots, client_verifier) = trust(&ca_pem, &files.ca.display().to_string())?;
    let (key, principal, cluster, not_after) = match &files.cert {
        None => (None, None, None, None),
        Some((cert_path, key_path)) => {
            let cert_pem = read_pem(cert_path, "certificate")?;
            let chain: Vec<CertificateDer<'static>> = rustls_pemfile::certs(&mut cert_pem.as_slice())
                .collect::<Result<_, _>>()
                .map_err(|e| format!("certificate {}: {e}", cert_path.display()))?;
            let leaf = chain.first().ok_or_else(|| format!("certificate {}: no certificate", cert_path.display()))?;
            let (principal, cluster, not_after) =
                principal_in_cluster(leaf).map_err(|e| format!("certificate {}: {e}", cert_path.display()))?;
            let key_pem = read_pem(key_path, "key")?;
            let key: PrivateKeyDer<'static> = rustls_pemfile::private_key(&mut key_pem.as_slice())
                .map_err(|e| format!("key {}: {e}", key_path.display()))?
                .ok_or_else(|| format!("key {}: no private key in the file", key_path.display()))?;
            let signer = provider()
                .key_provider
                .load_private_key(key)
                .map_err(|e| format!("key {}: {e}", key_path.display()))?;
            let ck = CertifiedKey::new(chain, signer);
            ck.keys_match().map_err(|e| {
                format!("key {} does not belong to certificate {}: {e}", key_path.display(), cert_path.display())
            })?;
            (Some(Arc::new(ck)), Some(principal), Some(cluster), Some(not_after))
        }
    };
    Ok(Material { roots, client_verifier, key, principal, cluster, not_after, stamp })
}

/// The CA, certificate and key of this process, read again when their files
/// change (checked at most once a second). A change that does not load (a
/// half-written file) keeps the previous material and logs why.
pub struct Credentials {
    files: TlsFiles,
    current: RwLock<Arc<Material>>,
    last_check: Mutex<Instant>,
}

impl fmt::Debug for Credentials {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Credentials").field("files", &self.files).finish()
    }
}

impl Credentials {
    pub fn load(files: TlsFiles) -> Result<Arc<Credentials>, String> {
        let m = load(&files)?;
        Ok(Arc::new(Credentials { files, current: RwLock::new(Arc::new(m)), last_check: Mutex::new(Instant::now()) }))
    }

    /// Trust in the CA of `pem` alone, with no certificate of our own: srun in
    /// a job, which checks agents and proves itself with a step credential.
    /// With `cluster`, peers of another cluster under the same CA are refused
    /// as they are by a process with a certificate.
    pub fn from_ca_pem(pem: &[u8], cluster: Option<&str>) -> Result<Arc<Credentials>, String> {
        if let Some(c) = cluster {
            check_cluster_name(c)?;
        }
        if pem.len() as u64 > PEM_FILE_BYTES_MAX {
            return Err(format!("CA certificate: larger than {PEM_FILE_BYTES_MAX} bytes"));
        }
        let files = TlsFiles { ca: PathBuf::new(), cert: None };
        let (roots, client_verifier) = trust(pem, "(from the environment)")?;
        let m = Material {
            roots,
            client_verifier,
            key: None,
            principal: None,
            cluster: cluster.map(str::to_string),
            not_after: None,
            stamp: stamp_of(&files),
        };
        Ok(Arc::new(Credentials { files, current: RwLock::new(Arc::new(m)), last_check: Mutex::new(Instant::now()) }))
    }

    fn material(&self) -> Arc<Material> {
        let due = {
            let mut last = self.last_check.lock().expect("tls check lock");
            if last.elapsed() >= RELOAD_CHECK_INTERVAL {
                *last = Instant::now();
                true
            } else {
                false
            }
        };
        let cur = self.current.read().expect("tls material lock").clone();
        if !due || stamp_of(&self.files) == cur.stamp {
            return cur;
        }
        match load(&self.files) {
            Ok(m) => {
                let m = Arc::new(m);
                tracing::info!(principal = ?m.principal, not_after = ?m.not_after, "TLS certificates reloaded");
                *self.current.write().expect("tls material lock") = m.clone();
                m
            }
            Err(e) => {
                tracing::warn!(error = %e, "TLS files changed but do not load; keeping the previous ones");
                cur
            }
        }
    }

    /// The principal this process's certificate names.
    pub fn principal(&self) -> Option<Principal> {
        self.material().principal.clone()
    }

    /// The cluster this process's certificate names (`None` without one).
    pub fn cluster(&self) -> Option<String> {
        self.material().cluster.clone()
    }

    /// When this process's certificate expires (Unix seconds).
    pub fn not_after(&self) -> Option<i64> {
        self.material().not_after
    }

    /// This process's certificate chain and signing key.
    pub fn certified_key(&self) -> Option<Arc<CertifiedKey>> {
        self.material().key.clone()
    }

    /// The CA certificates trusted now.
    pub fn roots(&self) -> Arc<RootCertStore> {
        self.material().roots.clone()
    }

    pub fn files(&self) -> &TlsFiles {
        &self.files
    }

    /// A rustls server configuration that asks for (but does not require) a
    /// client certificate signed by the CA.
    pub fn server_config(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, String> {
        self.server_config_for(b"h2")
    }

    /// [`Credentials::server_config`] for another application protocol
    /// (`http/1.1` for the metrics endpoint).
    pub fn server_config_for(self: &Arc<Self>, alpn: &[u8]) -> Result<Arc<rustls::ServerConfig>, String> {
        self.server_config_with(alpn, false)
    }

    /// A rustls server configuration whose handshake fails without a client
    /// certificate the CA signed (a replica's peer port).
    pub fn server_config_mandatory(self: &Arc<Self>) -> Result<Arc<rustls::ServerConfig>, String> {
        self.server_config_with(b"h2", true)
    }

    fn server_config_with(self: &Arc<Self>, alpn: &[u8], mandatory: bool) -> Result<Arc<rustls::ServerConfig>, String> {
        if self.files.cert.is_none() {
            return Err("a TLS server needs a certificate and key".into());
        }
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .with_client_cert_verifier(Arc::new(ReloadingClientVerifier { creds: self.clone(), mandatory }))
            .with_cert_resolver(Arc::new(ReloadingCert(self.clone())));
        cfg.alpn_protocols = vec![alpn.to_vec()];
        // No session resumption: a resumed session would carry a client
        // certificate verified under the old CA past a rotation.
        cfg.send_tls13_tickets = 0;
        cfg.session_storage = Arc::new(rustls::server::NoServerSessionStorage {});
        Ok(Arc::new(cfg))
    }

    /// A rustls client configuration that accepts only a peer whose certificate
    /// the CA signed and whose principal `expect` allows, presenting this
    /// process's certificate (if it has one).
    pub fn client_config(self: &Arc<Self>, expect: Expect) -> Result<Arc<rustls::ClientConfig>, String> {
        let builder = rustls::ClientConfig::builder_with_provider(provider())
            .with_safe_default_protocol_versions()
            .map_err(|e| e.to_string())?
            .dangerous()
            .with_custom_certificate_verifier(Arc::new(RoleVerifier { creds: self.clone(), expect }));
        let mut cfg = if self.files.cert.is_some() {
            builder.with_client_cert_resolver(Arc::new(ReloadingCert(self.clone())))
        } else {
            builder.with_no_client_auth()
        };
        cfg.alpn_protocols = vec![b"h2".to_vec()];
        Ok(Arc::new(cfg))
    }
}

#[derive(Debug)]
struct ReloadingCert(Arc<Credentials>);

impl rustls::server::ResolvesServerCert for ReloadingCert {
    fn resolve(&self, _hello: rustls::server::ClientHello<'_>) -> Option<Arc<CertifiedKey>> {
        self.0.material().key.clone()
    }
}

impl rustls::client::ResolvesClientCert for ReloadingCert {
    fn resolve(&self, _hints: &[&[u8]], _schemes: &[SignatureScheme]) -> Option<Arc<CertifiedKey>> {
        self.0.material().key.clone()
    }

    fn has_certs(&self) -> bool {
        true
    }
}

#[derive(Debug)]
struct ReloadingClientVerifier {
    creds: Arc<Credentials>,
    /// Whether a handshake without a certificate fails.
    mandatory: bool,
}

impl ClientCertVerifier for ReloadingClientVerifier {
    fn offer_client_auth(&self) -> bool {
        true
    }

    fn client_auth_mandatory(&self) -> bool {
        // On the API port a caller without a certificate still gets an
        // answer (UNAUTHENTICATED, naming what is missing) instead of a bare
        // handshake failure; the peer port talks to replicas only.
        self.mandatory
    }

    fn root_hint_subjects(&self) -> &[DistinguishedName] {
        &[]
    }

    fn verify_client_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        now: UnixTime,
    ) -> Result<ClientCertVerified, rustls::Error> {
        let m = self.creds.material();
        let verified = m.client_verifier.verify_client_cert(end_entity, intermediates, now)?;
        same_cluster(m.cluster.as_deref(), end_entity)?;
        Ok(verified)
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.creds.material().client_verifier.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.creds.material().client_verifier.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.creds.material().client_verifier.supported_verify_schemes()
    }
}

/// Which peer a client accepts.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Expect {
    /// Any controller replica.
    Server,
    /// The agent of this node.
    Agent(String),
}

#[derive(Debug)]
struct RoleVerifier {
    creds: Arc<Credentials>,
    expect: Expect,
}

impl ServerCertVerifier for RoleVerifier {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        let m = self.creds.material();
        let parsed = ParsedCertificate::try_from(end_entity)?;
        rustls::client::verify_server_cert_signed_by_trust_anchor(
            &parsed,
            &m.roots,
            intermediates,
            now,
            provider().signature_verification_algorithms.all,
        )?;
        same_cluster(m.cluster.as_deref(), end_entity)?;
        let (p, _) = principal_of(end_entity).map_err(rustls::Error::General)?;
        let ok = match &self.expect {
            Expect::Server => p.role == Role::Server,
            Expect::Agent(node) => p.role == Role::Agent && &p.name == node,
        };
        if !ok {
            return Err(rustls::Error::General(format!("the peer is {p}, not {:?}", self.expect)));
        }
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &provider().signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &provider().signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        provider().signature_verification_algorithms.supported_schemes()
    }
}

/// How this process talks to its peers.
#[derive(Debug, Clone)]
pub enum Security {
    /// Mutual TLS with these credentials.
    Tls(Arc<Credentials>),
    /// Plaintext; callers name themselves. Only with `--insecure`.
    Insecure,
}

impl Security {
    pub fn is_insecure(&self) -> bool {
        matches!(self, Security::Insecure)
    }

    pub fn credentials(&self) -> Option<&Arc<Credentials>> {
        match self {
            Security::Tls(c) => Some(c),
            Security::Insecure => None,
        }
    }

    /// A lazily connected channel to `addr` (`host:port`), over TLS when
    /// secured, accepting only a peer that `expect` allows.
    pub fn channel(&self, addr: &str, expect: Expect, connect_timeout: Duration) -> Result<Channel, String> {
        self.channel_from(addr, expect, connect_timeout, None)
    }

    /// [`Security::channel`] from the local address `from` (a host with
    /// several, or a test standing in for many hosts on loopback): over TLS
    /// only.
    pub fn channel_from(
        &self,
        addr: &str,
        expect: Expect,
        connect_timeout: Duration,
        from: Option<std::net::IpAddr>,
    ) -> Result<Channel, String> {
        let ep = endpoint(addr, connect_timeout)?;
        match self {
            Security::Insecure if from.is_some() => Err("a source address is supported over TLS only".into()),
            Security::Insecure => Ok(ep.connect_lazy()),
            Security::Tls(creds) => {
                let config = creds.client_config(expect)?;
                Ok(ep.connect_with_connector_lazy(TlsConnector { config, from }))
            }
        }
    }
}

impl Security {
    /// Like [`Security::channel`], but connects now, so an unreachable or
    /// refusing peer is an error here rather than at the first call.
    pub async fn connect(&self, addr: &str, expect: Expect, connect_timeout: Duration) -> Result<Channel, String> {
        let ep = endpoint(addr, connect_timeout)?;
        let r = match self {
            Security::Insecure => ep.connect().await,
            Security::Tls(creds) => {
                ep.connect_with_connector(TlsConnector { config: creds.client_config(expect)?, from: None }).await
            }
        };
        r.map_err(|e| crate::client::with_sources(e.to_string(), std::error::Error::source(&e)))
    }
}

/// The endpoint of `addr` (`host:port`, a scheme allowed): plain `http` URIs
/// always, TLS being the connector's business.
fn endpoint(addr: &str, connect_timeout: Duration) -> Result<Endpoint, String> {
    let addr = addr.strip_prefix("http://").or_else(|| addr.strip_prefix("https://")).unwrap_or(addr);
    Ok(Endpoint::from_shared(format!("http://{addr}"))
        .map_err(|e| format!("address '{addr}' is invalid: {e}"))?
        .connect_timeout(connect_timeout)
        .tcp_nodelay(true)
        // A call in flight to a host that died or was cut off without
        // closing the connection (a long srun stream, a watch) fails within
        // a minute instead of hanging.
        .http2_keep_alive_interval(PEER_PING_INTERVAL)
        .keep_alive_timeout(PEER_PING_TIMEOUT))
}

/// How often a client pings its server while a call is in flight, and how
/// long it waits for the answer (see [`endpoint`]).
const PEER_PING_INTERVAL: Duration = Duration::from_secs(30);
const PEER_PING_TIMEOUT: Duration = Duration::from_secs(20);

/// Dials TCP and runs the TLS handshake; tonic speaks HTTP/2 over the result.
#[derive(Clone)]
struct TlsConnector {
    config: Arc<rustls::ClientConfig>,
    /// The local address to connect from (the system's choice when None).
    from: Option<std::net::IpAddr>,
}

type ConnectFuture = Pin<Box<dyn Future<Output = io::Result<hyper_util::rt::TokioIo<ClientTls>>> + Send>>;
type ClientTls = tokio_rustls::client::TlsStream<TcpStream>;

impl tower_service::Service<Uri> for TlsConnector {
    type Response = hyper_util::rt::TokioIo<ClientTls>;
    type Error = io::Error;
    type Future = ConnectFuture;

    fn poll_ready(&mut self, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn call(&mut self, uri: Uri) -> Self::Future {
        let (config, from) = (self.config.clone(), self.from);
        Box::pin(async move {
            let host = uri.host().ok_or_else(|| io::Error::new(io::ErrorKind::InvalidInput, "no host"))?;
            let host = host.trim_start_matches('[').trim_end_matches(']').to_string();
            let port = uri.port_u16().unwrap_or(80);
            let tcp = match from {
                None => TcpStream::connect((host.as_str(), port)).await?,
                Some(ip) => {
                    let target = tokio::net::lookup_host((host.as_str(), port))
                        .await?
                        .find(|a| a.is_ipv4() == ip.is_ipv4())
                        .ok_or_else(|| {
                            io::Error::new(io::ErrorKind::InvalidInput, "no address of the source's family")
                        })?;
                    let socket =
                        if ip.is_ipv4() { tokio::net::TcpSocket::new_v4()? } else { tokio::net::TcpSocket::new_v6()? };
                    socket.bind(SocketAddr::new(ip, 0))?;
                    socket.connect(target).await?
                }
            };
            tcp.set_nodelay(true)?;
            let name = ServerName::try_from(SNI_NAME).expect("static name");
            let tls =
                tokio::time::timeout(HANDSHAKE_TIMEOUT, tokio_rustls::TlsConnector::from(config).connect(name, tcp))
                    .await
                    .map_err(|_| io::Error::new(io::ErrorKind::TimedOut, "TLS handshake timed out"))??;
            Ok(hyper_util::rt::TokioIo::new(tls))
        })
    }
}

/// Who is at the other end of an accepted connection, as the transport knows.
#[derive(Debug, Clone)]
pub enum PeerAuth {
    /// Plaintext listener (`--insecure`): the caller's claims are all there is.
    Insecure,
    /// TLS without a client certificate.
    Anonymous,
    /// A certificate the CA signed, naming this principal.
    Verified(Principal),
    /// A certificate the CA signed that names no usable principal.
    Unusable(String),
}

/// Connection facts handed to every request (`Request::extensions`).
#[derive(Debug, Clone)]
pub struct PeerInfo {
    pub remote: Option<SocketAddr>,
    pub auth: PeerAuth,
    /// The connection's requests, on a listener that times connections out
    /// by them (see [`incoming_gated`]): whoever serves a request marks it.
    pub activity: Option<Arc<Activity>>,
}

/// Milliseconds on a monotonic clock since the process first asked.
fn mono_ms() -> u64 {
    static EPOCH: std::sync::OnceLock<Instant> = std::sync::OnceLock::new();
    u64::try_from(EPOCH.get_or_init(Instant::now).elapsed().as_millis()).unwrap_or(u64::MAX)
}

/// What the requests on one connection are doing: how many are in progress
/// (a stream counts until it ends) and when the last one began or ended.
#[derive(Debug)]
pub struct Activity {
    in_flight: std::sync::atomic::AtomicUsize,
    last_ms: std::sync::atomic::AtomicU64,
}

impl Default for Activity {
    fn default() -> Activity {
        Activity { in_flight: Default::default(), last_ms: std::sync::atomic::AtomicU64::new(mono_ms()) }
    }
}

/// One request in progress on a connection; it ends when this is dropped.
pub struct ActivityGuard(Arc<Activity>);

impl Activity {
    pub fn begin(self: &Arc<Self>) -> ActivityGuard {
        self.in_flight.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        self.last_ms.store(mono_ms(), std::sync::atomic::Ordering::SeqCst);
        ActivityGuard(self.clone())
    }

    /// How long the connection has had no request in progress (None: one is).
    fn idle_for(&self) -> Option<Duration> {
        if self.in_flight.load(std::sync::atomic::Ordering::SeqCst) > 0 {
            return None;
        }
        let last = self.last_ms.load(std::sync::atomic::Ordering::SeqCst);
        Some(Duration::from_millis(mono_ms().saturating_sub(last)))
    }
}

impl Drop for ActivityGuard {
    fn drop(&mut self) {
        self.0.last_ms.store(mono_ms(), std::sync::atomic::Ordering::SeqCst);
        self.0.in_flight.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// Connections with a client certificate one listener keeps open at once.
/// Past it a new one is closed right after its handshake; the listener keeps
/// accepting. The cluster's own (replicas, agents) and those without a
/// certificate have pools of their own, so neither can shut the other out.
pub const CONNECTIONS_MAX: usize = 16_384;
/// Connections of replicas and agents one listener keeps: an agent per node
/// (at most 20,000), the replicas', and reconnects overlapping old ones.
pub const CLUSTER_CONNECTIONS_MAX: usize = 24_576;
/// Connections without a certificate (bearer tokens, jobs' step
/// credentials, strangers) one listener keeps.
pub const ANONYMOUS_CONNECTIONS_MAX: usize = 4_096;
/// Connections one replica's certificate may hold to one listener: its
/// Raft channel, its forwarding channel, a few in between reconnects.
pub const CONNECTIONS_PER_SERVER_MAX: usize = 64;
/// Connections one node's agent may hold: its channel to the controllers
/// (and a reconnect overlapping the old one).
pub const CONNECTIONS_PER_AGENT_MAX: usize = 8;
/// Connections one client certificate may hold: every process of a user's
/// workflow engine or CI runner has its own.
pub const CONNECTIONS_PER_CLIENT_MAX: usize = 512;
/// Connections without a certificate (bearer tokens, jobs' step
/// credentials, strangers) from one host (an IPv4 address, an IPv6 /64): a
/// node running jobs that call squeue, not a flood. Per host, so a job on
/// one node cannot take its neighbours' share.
pub const ANONYMOUS_CONNECTIONS_PER_HOST_MAX: usize = 512;
/// Connections of any kind from one host, counted from the moment they are
/// accepted (before the handshake, which costs the replica a signature):
/// past it a newcomer is closed before any handshake, so a flood of
/// connections costs the replica no cryptography.
pub const CONNECTIONS_PER_HOST_MAX: usize = 1_024;
/// A connection idle this long is closed: on a gated listener (the
/// controllers') one with no request in progress and none begun for this
/// long (an HTTP/2 ping answered is not a request); elsewhere one on which
/// nothing was read. Clients
/// ping every PEER_PING_INTERVAL while a call is open, agents heartbeat every
/// few seconds: only a connection nobody uses goes idle this long.
pub const CONNECTION_IDLE_MAX: Duration = Duration::from_secs(300);

/// An accepted connection, plaintext or TLS, holding its connection slot
/// and closed when idle past CONNECTION_IDLE_MAX.
pub struct Conn {
    io: ConnIo,
    info: PeerInfo,
    idle: Pin<Box<tokio::time::Sleep>>,
    _held: Option<ConnHold>,
}

/// Whether a listener times its connections out by their requests.
#[derive(Clone, Copy, PartialEq, Eq)]
enum IdleBy {
    Bytes,
    Requests,
}

/// An open connection's places in its listener's limits, given back when
/// the connection is dropped.
struct ConnHold {
    _total: PoolPermit,
    _mine: ConnSlot,
    _prefix: PeerSlot,
}

enum ConnIo {
    Plain(TcpStream),
    Tls(Box<tokio_rustls::server::TlsStream<TcpStream>>),
}

impl Conn {
    fn new(io: ConnIo, info: PeerInfo, held: Option<ConnHold>) -> Conn {
        Conn { io, info, idle: Box::pin(tokio::time::sleep(CONNECTION_IDLE_MAX)), _held: held }
    }

    /// Who is at the other end.
    pub fn peer(&self) -> &PeerInfo {
        &self.info
    }
}

impl Connected for Conn {
    type ConnectInfo = PeerInfo;

    fn connect_info(&self) -> PeerInfo {
        self.info.clone()
    }
}

impl AsyncRead for Conn {
    fn poll_read(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        let this = self.get_mut();
        let before = buf.filled().len();
        let read = match &mut this.io {
            ConnIo::Plain(s) => Pin::new(s).poll_read(cx, buf),
            ConnIo::Tls(s) => Pin::new(s.as_mut()).poll_read(cx, buf),
        };
        match read {
            Poll::Ready(Ok(())) if buf.filled().len() > before => {
                // Past the clock's range (never, in practice) the current deadline stands.
                if this.info.activity.is_none() {
                    if let Some(at) = tokio::time::Instant::now().checked_add(CONNECTION_IDLE_MAX) {
                        this.idle.as_mut().reset(at);
                    }
                }
                Poll::Ready(Ok(()))
            }
            Poll::Pending if this.idle.as_mut().poll(cx).is_ready() => {
                let busy = this.info.activity.as_ref().map(|a| a.idle_for());
                if let Some(at) = idle_wait(busy).and_then(|w| tokio::time::Instant::now().checked_add(w)) {
                    this.idle.as_mut().reset(at);
                    // Registers the new deadline's wake-up.
                    let _ = this.idle.as_mut().poll(cx);
                    return Poll::Pending;
                }
                metrics::counter!("gangway_connections_idle_closed_total").increment(1);
                Poll::Ready(Err(io::Error::new(io::ErrorKind::TimedOut, "the connection was idle too long")))
            }
            other => other,
        }
    }
}

/// When a connection's idle deadline passes, how much longer it stays open:
/// `busy` is `None` when the listener times connections by their bytes
/// (the deadline passed with nothing read: none), otherwise how long since
/// the last request ended (`None` while one is in progress: a full
/// [`CONNECTION_IDLE_MAX`] more). A request recent enough moves the
/// deadline to CONNECTION_IDLE_MAX after it.
fn idle_wait(busy: Option<Option<Duration>>) -> Option<Duration> {
    match busy {
        Some(None) => Some(CONNECTION_IDLE_MAX),
        Some(Some(idle)) if idle < CONNECTION_IDLE_MAX => Some(CONNECTION_IDLE_MAX.saturating_sub(idle)),
        _ => None,
    }
}

impl AsyncWrite for Conn {
    fn poll_write(self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            ConnIo::Plain(s) => Pin::new(s).poll_write(cx, buf),
            ConnIo::Tls(s) => Pin::new(s.as_mut()).poll_write(cx, buf),
        }
    }

    fn poll_flush(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            ConnIo::Plain(s) => Pin::new(s).poll_flush(cx),
            ConnIo::Tls(s) => Pin::new(s.as_mut()).poll_flush(cx),
        }
    }

    fn poll_shutdown(self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        match &mut self.get_mut().io {
            ConnIo::Plain(s) => Pin::new(s).poll_shutdown(cx),
            ConnIo::Tls(s) => Pin::new(s.as_mut()).poll_shutdown(cx),
        }
    }

    fn poll_write_vectored(
        self: Pin<&mut Self>,
        cx: &mut Context<'_>,
        bufs: &[io::IoSlice<'_>],
    ) -> Poll<io::Result<usize>> {
        match &mut self.get_mut().io {
            ConnIo::Plain(s) => Pin::new(s).poll_write_vectored(cx, bufs),
            ConnIo::Tls(s) => Pin::new(s.as_mut()).poll_write_vectored(cx, bufs),
        }
    }

    fn is_write_vectored(&self) -> bool {
        match &self.io {
            ConnIo::Plain(s) => s.is_write_vectored(),
            ConnIo::Tls(s) => s.is_write_vectored(),
        }
    }
}

/// The network prefix an address counts under for per-address limits: an
/// IPv4 /24 or an IPv6 /64, so one host cannot dodge a limit by the many
/// addresses it holds (an IPv6 host has billions).
pub fn prefix_of(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V4(v4) => {
            let [a, b, c, _] = v4.octets();
            std::net::IpAddr::from([a, b, c, 0])
        }
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => prefix_of(std::net::IpAddr::V4(v4)),
            None => {
                let mut seg = v6.segments();
                seg[4..].fill(0);
                std::net::IpAddr::from(seg)
            }
        },
    }
}

/// The host an address counts as for per-host limits: an IPv4 address, or
/// an IPv6 /64 (an IPv6 host owns billions of addresses).
pub fn host_of(ip: std::net::IpAddr) -> std::net::IpAddr {
    match ip {
        std::net::IpAddr::V4(_) => ip,
        std::net::IpAddr::V6(v6) => match v6.to_ipv4_mapped() {
            Some(v4) => std::net::IpAddr::V4(v4),
            None => prefix_of(ip),
        },
    }
}

/// Which pool a connection counts in, its key in the per-peer limits (its
/// certificate's principal, or without one its host) and its share there.
fn connection_share(auth: &PeerAuth, remote: SocketAddr) -> (Pool, String, usize) {
    match auth {
        PeerAuth::Verified(p) => {
            let (pool, max) = match p.role {
                Role::Server => (Pool::Cluster, CONNECTIONS_PER_SERVER_MAX),
                Role::Agent => (Pool::Cluster, CONNECTIONS_PER_AGENT_MAX),
                Role::Client => (Pool::Clients, CONNECTIONS_PER_CLIENT_MAX),
            };
            (pool, p.encode(), max)
        }
        PeerAuth::Insecure | PeerAuth::Anonymous | PeerAuth::Unusable(_) => {
            (Pool::Anonymous, format!("net:{}", host_of(remote.ip())), ANONYMOUS_CONNECTIONS_PER_HOST_MAX)
        }
    }
}

/// The listener's connection pools (see [`CONNECTIONS_MAX`]).
#[derive(Clone, Copy)]
enum Pool {
    Cluster,
    Clients,
    Anonymous,
}

/// Accepted (and, when secured, handshaken) connections for
/// `Server::serve_with_incoming`. Handshakes run concurrently, each bounded by
/// [`HANDSHAKE_TIMEOUT`], at most [`HANDSHAKES_IN_FLIGHT_MAX`] at once and
/// [`HANDSHAKES_PER_PREFIX_MAX`] per network prefix; a failed one is logged
/// and dropped. Open connections are bounded in total ([`CONNECTIONS_MAX`])
/// and per principal or prefix ([`connection_share`]); past a bound a new
/// connection is closed at once.
pub fn incoming(
    listener: TcpListener,
    security: &Security,
) -> Result<tokio_stream::wrappers::ReceiverStream<io::Result<Conn>>, String> {
    incoming_with(listener, security, b"h2", IdleBy::Bytes)
}

/// [`incoming`] for a server whose every request marks its connection's
/// [`Activity`] (the controllers' gate does): a connection is idle when no
/// request is in progress or has begun for CONNECTION_IDLE_MAX, whatever
/// pings its peer answers.
pub fn incoming_gated(
    listener: TcpListener,
    security: &Security,
) -> Result<tokio_stream::wrappers::ReceiverStream<io::Result<Conn>>, String> {
    incoming_with(listener, security, b"h2", IdleBy::Requests)
}

/// [`incoming`] for a replica's peer port: the handshake fails without a
/// client certificate the CA signed, and a connection whose certificate is
/// not a server's (a replica's) is closed right after it, before a byte of
/// a request is read. Only replicas can reach the Raft service behind it, as
/// only etcd's members reach its peer port.
pub fn incoming_peer(
    listener: TcpListener,
    security: &Security,
) -> Result<tokio_stream::wrappers::ReceiverStream<io::Result<Conn>>, String> {
    let acceptor = match security {
        Security::Insecure => None,
        Security::Tls(c) => Some(tokio_rustls::TlsAcceptor::from(c.server_config_mandatory()?)),
    };
    accept_loop(listener, acceptor, IdleBy::Bytes, true)
}

/// [`incoming`] for another application protocol (`http/1.1` for the web console).
pub fn incoming_for(
    listener: TcpListener,
    security: &Security,
    alpn: &[u8],
) -> Result<tokio_stream::wrappers::ReceiverStream<io::Result<Conn>>, String> {
    incoming_with(listener, security, alpn, IdleBy::Bytes)
}

fn incoming_with(
    listener: TcpListener,
    security: &Security,
    alpn: &[u8],
    idle_by: IdleBy,
) -> Result<tokio_stream::wrappers::ReceiverStream<io::Result<Conn>>, String> {
    let acceptor = match security {
        Security::Insecure => None,
        Security::Tls(c) => Some(tokio_rustls::TlsAcceptor::from(c.server_config_for(alpn)?)),
    };
    accept_loop(listener, acceptor, idle_by, false)
}

/// Accepts, handshakes and bounds connections (see [`incoming`]); with
/// `servers_only` a connection that is not a verified replica's is closed
/// right after its handshake.
fn accept_loop(
    listener: TcpListener,
    acceptor: Option<tokio_rustls::TlsAcceptor>,
    idle_by: IdleBy,
    servers_only: bool,
) -> Result<tokio_stream::wrappers::ReceiverStream<io::Result<Conn>>, String> {
    let (tx, rx) = accepted_queue();
    let gate = Gate::default();
    tokio::spawn(async move {
        loop {
            let (tcp, remote) = tokio::select! {
                r = listener.accept() => match r {
                    Ok(x) => x,
                    Err(e) => {
                        // Out of file descriptors and the like: back off, go on.
                        tracing::warn!(error = %e, "accept failed");
                        tokio::time::sleep(Duration::from_millis(50)).await;
                        continue;
                    }
                },
                _ = tx.closed() => return,
            };
            // Shed, never stall: with every slot (or this prefix's share)
            // taken, the newcomer is closed and accepting goes on.
            let (open_slot, handshake_slots) = match gate.accept(remote.ip()) {
                Ok(slots) => slots,
                Err(Shed::Host) => {
                    metrics::counter!("gangway_connections_shed_total").increment(1);
                    continue;
                }
                Err(Shed::Handshakes) => {
                    metrics::counter!("gangway_tls_handshakes_shed_total").increment(1);
                    continue;
                }
            };
            let _ = tcp.set_nodelay(true);
            let tx = tx.clone();
            let acceptor = acceptor.clone();
            let gate = gate.clone();
            tokio::spawn(async move {
                let (io, auth) = match acceptor {
                    None => (ConnIo::Plain(tcp), PeerAuth::Insecure),
                    Some(acceptor) => match tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(tcp)).await {
                        Ok(Ok(tls)) => {
                            let auth = match tls.get_ref().1.peer_certificates().and_then(|c| c.first()) {
                                None => PeerAuth::Anonymous,
                                Some(leaf) => match principal_of(leaf) {
                                    Ok((p, _)) => PeerAuth::Verified(p),
                                    Err(e) => PeerAuth::Unusable(e),
                                },
                            };
                            (ConnIo::Tls(Box::new(tls)), auth)
                        }
                        Ok(Err(e)) => {
                            tracing::debug!(%remote, error = %e, "TLS handshake failed");
                            metrics::counter!("gangway_tls_handshake_failures_total").increment(1);
                            return;
                        }
                        Err(_) => {
                            tracing::debug!(%remote, "TLS handshake timed out");
                            metrics::counter!("gangway_tls_handshake_failures_total").increment(1);
                            return;
                        }
                    },
                };
                drop(handshake_slots);
                if servers_only
                    && !matches!(&auth, PeerAuth::Insecure | PeerAuth::Verified(Principal { role: Role::Server, .. }))
                {
                    tracing::debug!(%remote, ?auth, "peer port: closed a connection that is not a replica's");
                    metrics::counter!("gangway_peer_connections_refused_total").increment(1);
                    return;
                }
                let Some(held) = gate.admit(&auth, remote, open_slot) else {
                    tracing::debug!(%remote, "connection refused: past the connection limits");
                    metrics::counter!("gangway_connections_shed_total").increment(1);
                    return;
                };
                let activity = (idle_by == IdleBy::Requests).then(Arc::default);
                let conn = Conn::new(io, PeerInfo { remote: Some(remote), auth, activity }, Some(held));
                let _ = tx.send(Ok(conn)).await;
            });
        }
    });
    Ok(tokio_stream::wrappers::ReceiverStream::new(rx))
}

type Accepted = io::Result<Conn>;

/// The connections admitted and not yet taken by the gRPC server:
/// [`ACCEPTED_QUEUE_MAX`]. Past it a connection's task waits (holding its
/// places in the limits), and accepting goes on.
fn accepted_queue() -> (tokio::sync::mpsc::Sender<Accepted>, tokio::sync::mpsc::Receiver<Accepted>) {
    tokio::sync::mpsc::channel(ACCEPTED_QUEUE_MAX)
}

/// Why an accepted connection was closed before its handshake.
#[derive(Debug, PartialEq, Eq)]
enum Shed {
    /// Its host holds [`CONNECTIONS_PER_HOST_MAX`] open connections.
    Host,
    /// [`HANDSHAKES_IN_FLIGHT_MAX`] handshakes run, or its prefix's share of them.
    Handshakes,
}

/// A handshake's places ([`HANDSHAKES_IN_FLIGHT_MAX`] in all,
/// [`HANDSHAKES_PER_PREFIX_MAX`] per prefix), given back when it ends.
struct HandshakeSlot {
    _all: tokio::sync::OwnedSemaphorePermit,
    _prefix: PeerSlot,
}

/// One listener's connection limits: the decisions of its accept loop, kept
/// apart from the sockets so each limit can be taken to its value and past.
#[derive(Clone)]
struct Gate {
    handshakes: Arc<tokio::sync::Semaphore>,
    handshakes_per_prefix: PeerSlots,
    open_per_host: PeerSlots,
    pools: Arc<[tokio::sync::Semaphore; 3]>,
    per_principal: ConnSlots,
}

impl Default for Gate {
    fn default() -> Gate {
        Gate {
            handshakes: Arc::new(tokio::sync::Semaphore::new(HANDSHAKES_IN_FLIGHT_MAX)),
            handshakes_per_prefix: PeerSlots::default(),
            open_per_host: PeerSlots::default(),
            pools: Arc::new([
                tokio::sync::Semaphore::new(CLUSTER_CONNECTIONS_MAX),
                tokio::sync::Semaphore::new(CONNECTIONS_MAX),
                tokio::sync::Semaphore::new(ANONYMOUS_CONNECTIONS_MAX),
            ]),
            per_principal: ConnSlots::default(),
        }
    }
}

impl Gate {
    /// A connection just accepted from `ip`: its place among its host's open
    /// connections (kept while it is open) and a handshake slot (given back
    /// after the handshake), or why it is closed at once.
    fn accept(&self, ip: std::net::IpAddr) -> Result<(PeerSlot, HandshakeSlot), Shed> {
        let open = self.open_per_host.take(host_of(ip), CONNECTIONS_PER_HOST_MAX).ok_or(Shed::Host)?;
        let all = self.handshakes.clone().try_acquire_owned().map_err(|_| Shed::Handshakes)?;
        let prefix =
            self.handshakes_per_prefix.take(prefix_of(ip), HANDSHAKES_PER_PREFIX_MAX).ok_or(Shed::Handshakes)?;
        Ok((open, HandshakeSlot { _all: all, _prefix: prefix }))
    }

    /// A handshaken connection's places in its pool and its principal's (or
    /// host's) share, with its host's place `open`; `None` past either.
    fn admit(&self, auth: &PeerAuth, remote: SocketAddr, open: PeerSlot) -> Option<ConnHold> {
        let (pool, key, share) = connection_share(auth, remote);
        let total = match pool {
            Pool::Cluster => pools_permit(&self.pools, 0),
            Pool::Clients => pools_permit(&self.pools, 1),
            Pool::Anonymous => pools_permit(&self.pools, 2),
        }?;
        let mine = self.per_principal.take(&key, share)?;
        Some(ConnHold { _total: total, _mine: mine, _prefix: open })
    }
}

/// A place in pool `i` of `pools`, held as long as the `Arc` is.
fn pools_permit(pools: &Arc<[tokio::sync::Semaphore; 3]>, i: usize) -> Option<PoolPermit> {
    let pool = pools.get(i)?;
    let permit = pool.try_acquire().ok()?;
    permit.forget();
    Some(PoolPermit { pools: pools.clone(), i })
}

/// A place in one of a listener's pools; given back when dropped.
struct PoolPermit {
    pools: Arc<[tokio::sync::Semaphore; 3]>,
    i: usize,
}

impl Drop for PoolPermit {
    fn drop(&mut self) {
        if let Some(pool) = self.pools.get(self.i) {
            pool.add_permits(1);
        }
    }
}

/// Open connections per principal or host (see [`connection_share`]).
#[derive(Clone, Default)]
struct ConnSlots(Arc<Mutex<std::collections::BTreeMap<String, usize>>>);

/// One open connection's place in [`ConnSlots`]; given back when dropped.
struct ConnSlot {
    slots: ConnSlots,
    key: String,
}

impl ConnSlots {
    fn take(&self, key: &str, max: usize) -> Option<ConnSlot> {
        let mut m = self.0.lock().expect("connection slots lock");
        let n = m.entry(key.to_string()).or_insert(0);
        if *n >= max {
            return None;
        }
        *n = n.saturating_add(1);
        Some(ConnSlot { slots: self.clone(), key: key.to_string() })
    }
}

impl Drop for ConnSlot {
    fn drop(&mut self) {
        let mut m = self.slots.0.lock().expect("connection slots lock");
        if let Some(n) = m.get_mut(&self.key) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.key);
            }
        }
    }
}

/// What each remote address holds now (handshakes here; the console's
/// connections), so one address cannot take every slot.
#[derive(Clone, Default)]
pub struct PeerSlots(Arc<Mutex<std::collections::BTreeMap<std::net::IpAddr, usize>>>);

/// One slot of one address; given back when dropped.
pub struct PeerSlot {
    slots: PeerSlots,
    ip: std::net::IpAddr,
}

impl PeerSlots {
    /// A slot for `ip`, unless it holds `max` already.
    pub fn take(&self, ip: std::net::IpAddr, max: usize) -> Option<PeerSlot> {
        let mut m = self.0.lock().expect("peer slots lock");
        let n = m.entry(ip).or_insert(0);
        if *n >= max {
            return None;
        }
        *n = n.saturating_add(1);
        Some(PeerSlot { slots: self.clone(), ip })
    }
}

impl Drop for PeerSlot {
    fn drop(&mut self) {
        let mut m = self.slots.0.lock().expect("peer slots lock");
        if let Some(n) = m.get_mut(&self.ip) {
            *n = n.saturating_sub(1);
            if *n == 0 {
                m.remove(&self.ip);
            }
        }
    }
}

/// Places for a small server's connections (the web console, the metrics
/// endpoint): at most `total` at once and `per_peer_max` per address. Past
/// either a newcomer is shed, never queued.
#[derive(Clone)]
pub struct Admission {
    total: Arc<tokio::sync::Semaphore>,
    per_peer: PeerSlots,
    per_peer_max: usize,
}

/// An admitted connection's places; given back when dropped.
pub struct Admitted {
    _total: tokio::sync::OwnedSemaphorePermit,
    _peer: PeerSlot,
}

impl Admission {
    pub fn new(total: usize, per_peer_max: usize) -> Admission {
        Admission { total: Arc::new(tokio::sync::Semaphore::new(total)), per_peer: PeerSlots::default(), per_peer_max }
    }

    /// Places for a connection from `ip`, unless every place or `ip`'s share is taken.
    pub fn admit(&self, ip: std::net::IpAddr) -> Option<Admitted> {
        let total = self.total.clone().try_acquire_owned().ok()?;
        let peer = self.per_peer.take(ip, self.per_peer_max)?;
        Some(Admitted { _total: total, _peer: peer })
    }
}

/// The peer of a request, as the transport verified it. A request that did not
/// come through [`incoming`] is anonymous: nothing vouches for it.
pub fn peer_of<T>(req: &tonic::Request<T>) -> PeerAuth {
    req.extensions().get::<PeerInfo>().map(|p| p.auth.clone()).unwrap_or(PeerAuth::Anonymous)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// ACCEPTED_QUEUE_MAX admitted connections wait for the gRPC server;
    /// the one past waits for room (in its own task, not the accept loop).
    #[test]
    fn admitted_connections_wait_past_accepted_queue_max() {
        let (tx, mut rx) = accepted_queue();
        let one = || Err(io::Error::other("a connection"));
        for _ in 0..ACCEPTED_QUEUE_MAX {
            assert!(tx.try_send(one()).is_ok());
        }
        assert!(matches!(tx.try_send(one()), Err(tokio::sync::mpsc::error::TrySendError::Full(_))));
        assert!(rx.try_recv().is_ok());
        assert!(tx.try_send(one()).is_ok());
    }
    use crate::pki;
    use tokio::io::AsyncReadExt;
    use tokio_stream::StreamExt;

    /// Silent connections from one address take at most its share of the
    /// handshake slots and are shed beyond it; the listener keeps accepting,
    /// and a real client elsewhere gets through with its principal verified.
    #[tokio::test]
    async fn a_silent_flood_from_one_address_does_not_stop_the_listener() {
        let dir = std::env::temp_dir().join(format!("gangway-tls-flood-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ps = [Principal::new(Role::Server, "1").unwrap(), Principal::new(Role::Client, "alice").unwrap()];
        pki::throwaway(&dir, &ps).unwrap();
        let server = Security::Tls(Credentials::load(TlsFiles::in_dir(&dir, "server-1")).unwrap());
        let alice = Credentials::load(TlsFiles::in_dir(&dir, "client-alice")).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let mut conns = incoming(listener, &server).unwrap();
        let mut silent = Vec::new();
        for _ in 0..HANDSHAKES_PER_PREFIX_MAX {
            silent.push(TcpStream::connect(addr).await.unwrap());
        }
        // One more from the same address is closed at once.
        let mut shed = TcpStream::connect(addr).await.unwrap();
        let mut buf = [0u8; 1];
        let n = tokio::time::timeout(Duration::from_secs(2), shed.read(&mut buf)).await.expect("shed promptly");
        assert!(matches!(n, Ok(0) | Err(_)), "the connection beyond the share stayed open");
        // Another address of the same /24 is shed too: the limit is the prefix's.
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.0.2:0".parse().unwrap()).unwrap();
        let mut same_prefix = sock.connect(addr).await.unwrap();
        let n = tokio::time::timeout(Duration::from_secs(2), same_prefix.read(&mut buf)).await.expect("shed promptly");
        assert!(matches!(n, Ok(0) | Err(_)), "another address of the prefix got past its share");
        // Another prefix still gets a full handshake.
        let sock = tokio::net::TcpSocket::new_v4().unwrap();
        sock.bind("127.0.1.2:0".parse().unwrap()).unwrap();
        let tcp = sock.connect(addr).await.unwrap();
        let config = alice.client_config(Expect::Server).unwrap();
        let name = ServerName::try_from(SNI_NAME).unwrap();
        let _tls = tokio_rustls::TlsConnector::from(config).connect(name, tcp).await.unwrap();
        let conn = tokio::time::timeout(Duration::from_secs(5), conns.next()).await.unwrap().unwrap().unwrap();
        match conn.connect_info().auth {
            PeerAuth::Verified(p) => assert_eq!(p, Principal::new(Role::Client, "alice").unwrap()),
            other => panic!("expected alice, got {other:?}"),
        }
        drop(silent);
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A cluster name of CLUSTER_NAME_BYTES_MAX bytes is one; a byte more,
    /// upper case or a slash (it would change the URI's path) is refused.
    #[test]
    fn cluster_names_are_short_lower_case_trust_domains() {
        assert!(check_cluster_name(&"a".repeat(CLUSTER_NAME_BYTES_MAX)).is_ok());
        assert!(check_cluster_name(&"a".repeat(CLUSTER_NAME_BYTES_MAX + 1)).unwrap_err().contains("1 to 64 bytes"));
        for bad in ["", "Prod", "prod/x", "prod x", "prod:1"] {
            assert!(check_cluster_name(bad).is_err(), "{bad:?}");
        }
        assert!(check_cluster_name("prod-eu.west_2").is_ok());
    }

    /// Two clusters that share a CA refuse each other in the handshake, both
    /// ways: a client of one reaches no server of the other, and a server
    /// accepts no client of the other; each accepts its own.
    #[tokio::test]
    async fn clusters_sharing_a_ca_refuse_each_others_certificates() {
        let dir = std::env::temp_dir().join(format!("gangway-tls-clusters-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ps = [Principal::new(Role::Server, "1").unwrap(), Principal::new(Role::Client, "alice").unwrap()];
        pki::throwaway(&dir, &ps).unwrap();
        let other = dir.join("other");
        std::fs::create_dir_all(&other).unwrap();
        for p in &ps {
            let req = pki::CertRequest {
                principal: p.clone(),
                hosts: vec![],
                days: 1,
                backdate_days: 0,
                cluster: "other".into(),
            };
            pki::create_cert(&dir, &other, &req).unwrap();
        }
        let load = |d: &Path, stem: &str| {
            Credentials::load(TlsFiles {
                ca: dir.join("ca.pem"),
                cert: Some((d.join(format!("{stem}.pem")), d.join(format!("{stem}-key.pem")))),
            })
            .unwrap()
        };
        assert_eq!(load(&other, "client-alice").cluster().as_deref(), Some("other"));
        assert_eq!(load(&dir, "client-alice").cluster().as_deref(), Some(DEFAULT_CLUSTER));
        // The server's own check, which a client that did not check the
        // server's cluster would meet.
        let leaf = |d: &Path| {
            let pem = std::fs::read(d.join("client-alice.pem")).unwrap();
            let der: CertificateDer<'static> = rustls_pemfile::certs(&mut pem.as_slice()).next().unwrap().unwrap();
            der
        };
        let verifier = ReloadingClientVerifier { creds: load(&dir, "server-1"), mandatory: false };
        let now = UnixTime::now();
        assert!(verifier.verify_client_cert(&leaf(&dir), &[], now).is_ok());
        let refused = verifier.verify_client_cert(&leaf(&other), &[], now).unwrap_err();
        assert!(refused.to_string().contains("of cluster 'other', not 'gangway'"), "{refused}");
        // (server's directory, client's directory, whether the handshake completes)
        for (server_dir, client_dir, ok) in [(&dir, &dir, true), (&dir, &other, false), (&other, &dir, false)] {
            let server = Security::Tls(load(server_dir, "server-1"));
            let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
            let addr = listener.local_addr().unwrap();
            let mut conns = incoming(listener, &server).unwrap();
            let accepted = tokio::spawn(async move { conns.next().await.map(|c| c.map(|c| c.connect_info().auth)) });
            let config = load(client_dir, "client-alice").client_config(Expect::Server).unwrap();
            let tcp = TcpStream::connect(addr).await.unwrap();
            let name = ServerName::try_from(SNI_NAME).unwrap();
            let mut tls = match tokio_rustls::TlsConnector::from(config).connect(name, tcp).await {
                Ok(tls) => tls,
                Err(e) => {
                    assert!(!ok, "{}: {e}", server_dir.display());
                    assert!(e.to_string().contains("a CA shared by two clusters"), "{e}");
                    accepted.abort();
                    continue;
                }
            };
            // TLS 1.3: the server's refusal of the client's certificate
            // arrives with the first read.
            let mut buf = [0u8; 1];
            let read = tokio::time::timeout(Duration::from_millis(500), tls.read(&mut buf)).await;
            if ok {
                let auth = tokio::time::timeout(Duration::from_secs(5), accepted).await.unwrap().unwrap();
                assert!(matches!(auth, Some(Ok(PeerAuth::Verified(_)))), "{auth:?}");
            } else {
                assert!(matches!(read, Ok(Err(_)) | Ok(Ok(0))), "a client of another cluster stayed connected");
                accepted.abort();
            }
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A gated connection is idle only with no request in progress: a
    /// stream open for an hour keeps it, a request that ended starts the
    /// clock; hosts and prefixes group addresses as the limits mean.
    #[test]
    fn a_connection_is_idle_only_without_requests_and_hosts_group_addresses() {
        let a = Arc::new(Activity::default());
        assert!(a.idle_for().is_some());
        let g = a.begin();
        let h = a.begin();
        assert_eq!(a.idle_for(), None, "busy with two requests");
        drop(g);
        assert_eq!(a.idle_for(), None, "still one");
        drop(h);
        assert!(a.idle_for().is_some_and(|d| d < Duration::from_secs(5)));
        let ip = |s: &str| s.parse::<std::net::IpAddr>().unwrap();
        assert_eq!(prefix_of(ip("10.1.2.3")), ip("10.1.2.0"));
        assert_eq!(host_of(ip("10.1.2.3")), ip("10.1.2.3"));
        assert_eq!(host_of(ip("2001:db8:1:2:3:4:5:6")), ip("2001:db8:1:2::"));
        assert_eq!(host_of(ip("::ffff:10.1.2.3")), ip("10.1.2.3"));
    }

    fn ip(s: &str) -> std::net::IpAddr {
        s.parse().unwrap()
    }

    fn remote(s: &str) -> SocketAddr {
        SocketAddr::new(ip(s), 40_000)
    }

    /// A host's place among the open connections, as a test holds it.
    fn open_slot(host: &str) -> PeerSlot {
        PeerSlots::default().take(ip(host), 1).unwrap()
    }

    fn verified(role: Role, name: &str) -> PeerAuth {
        PeerAuth::Verified(Principal::new(role, name).unwrap())
    }

    /// One host keeps CONNECTIONS_PER_HOST_MAX connections open, its
    /// handshakes done; one more is shed before a handshake, and another
    /// host still gets in. Handshakes in flight are bounded in all
    /// (HANDSHAKES_IN_FLIGHT_MAX, spread over prefixes within their share)
    /// and come back when they end.
    #[test]
    fn hosts_and_handshakes_are_bounded_at_accept() {
        let gate = Gate::default();
        let mut open = Vec::new();
        for _ in 0..CONNECTIONS_PER_HOST_MAX {
            let (slot, handshake) = gate.accept(ip("10.0.0.1")).unwrap();
            drop(handshake);
            open.push(slot);
        }
        assert_eq!(gate.accept(ip("10.0.0.1")).err(), Some(Shed::Host));
        assert!(gate.accept(ip("10.0.0.2")).is_ok(), "another host was shed");
        open.pop();
        assert!(gate.accept(ip("10.0.0.1")).is_ok(), "a closed connection's place did not come back");
        drop(open);

        let gate = Gate::default();
        let prefixes = HANDSHAKES_IN_FLIGHT_MAX.div_ceil(HANDSHAKES_PER_PREFIX_MAX);
        let mut handshakes = Vec::new();
        for i in 0..HANDSHAKES_IN_FLIGHT_MAX {
            let p = i % prefixes;
            handshakes.push(gate.accept(ip(&format!("10.1.{p}.{}", i / prefixes))).unwrap());
        }
        assert_eq!(gate.accept(ip("10.2.0.1")).err(), Some(Shed::Handshakes), "one past every handshake slot");
        handshakes.pop();
        assert!(gate.accept(ip("10.2.0.1")).is_ok(), "an ended handshake's slot did not come back");

        // One prefix's share: HANDSHAKES_PER_PREFIX_MAX at once, from any of its addresses.
        let gate = Gate::default();
        let share: Vec<_> = (0..HANDSHAKES_PER_PREFIX_MAX)
            .map(|i| gate.accept(ip(&format!("10.4.0.{}", i % 200))).expect("within the prefix's share"))
            .collect();
        assert_eq!(gate.accept(ip("10.4.0.250")).err(), Some(Shed::Handshakes), "one past the prefix's share");
        assert!(gate.accept(ip("10.4.1.1")).is_ok(), "another prefix was shed");
        drop(share);
    }

    /// Each certificate's share and each pool, at its value and one past:
    /// a replica's, an agent's and a client's connections; those without a
    /// certificate per host; the three pools in all. One pool full leaves
    /// the others open.
    #[test]
    fn connections_are_bounded_per_principal_and_per_pool() {
        let gate = Gate::default();
        let r = remote("10.0.0.1");
        for (role, share) in [
            (Role::Server, CONNECTIONS_PER_SERVER_MAX),
            (Role::Agent, CONNECTIONS_PER_AGENT_MAX),
            (Role::Client, CONNECTIONS_PER_CLIENT_MAX),
        ] {
            let held: Vec<_> = (0..share).map(|_| gate.admit(&verified(role, "x"), r, open_slot("10.0.0.1"))).collect();
            assert!(held.iter().all(Option::is_some), "{role:?} refused within its share");
            assert!(
                gate.admit(&verified(role, "x"), r, open_slot("10.0.0.1")).is_none(),
                "{role:?} one past its share"
            );
            assert!(gate.admit(&verified(role, "y"), r, open_slot("10.0.0.1")).is_some(), "another {role:?} refused");
        }
        for auth in [PeerAuth::Anonymous, PeerAuth::Insecure, PeerAuth::Unusable("no SAN".into())] {
            let held: Vec<_> =
                (0..ANONYMOUS_CONNECTIONS_PER_HOST_MAX).map(|_| gate.admit(&auth, r, open_slot("10.0.0.1"))).collect();
            assert!(held.iter().all(Option::is_some), "{auth:?} refused within its host's share");
            assert!(gate.admit(&auth, r, open_slot("10.0.0.1")).is_none(), "{auth:?} one past its host's share");
            assert!(gate.admit(&auth, remote("10.0.0.2"), open_slot("10.0.0.2")).is_some());
        }

        let gate = Gate::default();
        let fill = |pool_max: usize, share: usize, auth_of: &dyn Fn(usize) -> (PeerAuth, SocketAddr)| {
            let mut held = Vec::with_capacity(pool_max);
            for i in 0..pool_max {
                let (auth, at) = auth_of(i / share);
                held.push(gate.admit(&auth, at, open_slot("10.0.0.1")).expect("refused within the pool"));
            }
            let (auth, at) = auth_of(pool_max.div_ceil(share));
            assert!(gate.admit(&auth, at, open_slot("10.0.0.1")).is_none(), "one past the pool");
            held
        };
        let cluster = fill(CLUSTER_CONNECTIONS_MAX, CONNECTIONS_PER_AGENT_MAX, &|n| {
            (verified(Role::Agent, &format!("n{n}")), remote("10.0.0.1"))
        });
        assert!(
            gate.admit(&verified(Role::Server, "9"), r, open_slot("10.0.0.1")).is_none(),
            "replicas share the pool"
        );
        let clients = fill(CONNECTIONS_MAX, CONNECTIONS_PER_CLIENT_MAX, &|n| {
            (verified(Role::Client, &format!("u{n}")), remote("10.0.0.1"))
        });
        let anonymous = fill(ANONYMOUS_CONNECTIONS_MAX, ANONYMOUS_CONNECTIONS_PER_HOST_MAX, &|n| {
            (PeerAuth::Anonymous, remote(&format!("10.3.{}.{}", n / 256, n % 256)))
        });
        drop(cluster);
        assert!(gate.admit(&verified(Role::Server, "9"), r, open_slot("10.0.0.1")).is_some(), "places came back");
        drop((clients, anonymous));
    }

    /// The small servers' admission: `per_peer_max` per address and `total` in all.
    #[test]
    fn admission_bounds_each_address_and_the_total() {
        let a = Admission::new(6, 4);
        let first: Vec<_> = (0..4).map(|_| a.admit(ip("10.0.0.1")).unwrap()).collect();
        assert!(a.admit(ip("10.0.0.1")).is_none(), "one past the address's share");
        let second: Vec<_> = (0..2).map(|_| a.admit(ip("10.0.0.2")).unwrap()).collect();
        assert!(a.admit(ip("10.0.0.3")).is_none(), "one past the total");
        drop(first);
        assert!(a.admit(ip("10.0.0.1")).is_some(), "places came back");
        drop(second);
    }

    /// A connection timed by its requests closes CONNECTION_IDLE_MAX after
    /// its last one ended, never while one runs; timed by bytes, when its
    /// deadline passes.
    #[test]
    fn connections_idle_past_connection_idle_max_close() {
        assert_eq!(idle_wait(None), None, "timed by bytes: the deadline is the end");
        assert_eq!(idle_wait(Some(None)), Some(CONNECTION_IDLE_MAX), "a request in progress");
        let just = CONNECTION_IDLE_MAX.saturating_sub(Duration::from_millis(1));
        assert_eq!(idle_wait(Some(Some(just))), Some(Duration::from_millis(1)));
        assert_eq!(idle_wait(Some(Some(CONNECTION_IDLE_MAX))), None);
        assert_eq!(idle_wait(Some(Some(CONNECTION_IDLE_MAX + Duration::from_millis(1)))), None);
    }

    /// Principal names of PRINCIPAL_NAME_BYTES_MAX bytes are taken; one more is refused.
    #[test]
    fn principal_names_are_at_most_principal_name_bytes_max() {
        let name = "a".repeat(PRINCIPAL_NAME_BYTES_MAX);
        assert!(Principal::new(Role::Client, &name).is_ok());
        let err = Principal::new(Role::Client, &format!("{name}a")).unwrap_err();
        assert!(err.contains(&format!("must be 1 to {PRINCIPAL_NAME_BYTES_MAX} bytes")), "{err}");
    }

    /// Rotating a certificate in place takes effect without a restart; a
    /// half-written replacement keeps the previous one.
    #[test]
    fn certificates_are_read_again_when_their_files_change() {
        let dir = std::env::temp_dir().join(format!("gangway-tls-reload-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        pki::throwaway(&dir, &[Principal::new(Role::Agent, "n1").unwrap()]).unwrap();
        let files = TlsFiles::in_dir(&dir, "agent-n1");
        let creds = Credentials::load(files.clone()).unwrap();
        let first = creds.not_after().unwrap();
        // A new certificate for the same node, valid for a different time.
        let next = dir.join("next");
        let req = pki::CertRequest {
            principal: Principal::new(Role::Agent, "n1").unwrap(),
            hosts: vec![],
            days: 2,
            backdate_days: 0,
            cluster: "gangway".into(),
        };
        let (cert, key) = pki::create_cert(&dir, &next, &req).unwrap();
        let (old_cert, old_key) = files.cert.clone().unwrap();
        std::thread::sleep(RELOAD_CHECK_INTERVAL);
        std::fs::write(&old_cert, b"-----BEGIN CERTIFICATE-----\ngarbage").unwrap();
        assert_eq!(creds.not_after(), Some(first), "a broken file replaced the working certificate");
        std::fs::copy(&cert, &old_cert).unwrap();
        std::fs::copy(&key, &old_key).unwrap();
        std::thread::sleep(RELOAD_CHECK_INTERVAL);
        let second = creds.not_after().unwrap();
        assert!(second < first, "the rotated certificate was not picked up ({second} vs {first})");
        assert_eq!(creds.principal(), Some(Principal::new(Role::Agent, "n1").unwrap()));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A CA file of PEM_FILE_BYTES_MAX bytes loads, from a file or from the
    /// environment; one byte more is refused unread.
    #[test]
    fn pem_files_are_read_up_to_pem_file_bytes_max() {
        let dir = std::env::temp_dir().join(format!("gangway-tls-pem-max-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ca = pki::create_ca(&dir, "ca", 1).unwrap();
        let pem = std::fs::read(&ca).unwrap();
        let max = usize::try_from(PEM_FILE_BYTES_MAX).unwrap();
        let mut padded = pem.clone();
        padded.resize(max, b'\n');
        let files = TlsFiles { ca: ca.clone(), cert: None };
        std::fs::write(&ca, &padded).unwrap();
        assert!(Credentials::load(files.clone()).is_ok());
        assert!(Credentials::from_ca_pem(&padded, None).is_ok());
        padded.push(b'\n');
        std::fs::write(&ca, &padded).unwrap();
        let err = Credentials::load(files).unwrap_err();
        assert!(
            err.starts_with("CA certificate") && err.contains(&format!("larger than {PEM_FILE_BYTES_MAX} bytes")),
            "{err}"
        );
        let err = Credentials::from_ca_pem(&padded, None).unwrap_err();
        assert_eq!(err, format!("CA certificate: larger than {PEM_FILE_BYTES_MAX} bytes"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
