//! Step credentials: what lets `srun` start tasks on the other nodes of its
//! job, and nothing else.
//!
//! The leader signs, with its server certificate's key, the claims (job,
//! attempt, the job's nodes, an expiry) and sends the result in every launch
//! order of that job; the agent hands it to the job's tasks
//! (`GANGWAY_STEP_CREDENTIAL`), and srun presents it to each node's step
//! service. A step service accepts a credential only when the CA signed its
//! signer's certificate as a `server`, the signature holds, it names this
//! job's attempt and this node, and it has not expired. Any replica may sign
//! (leaders change): the agents check the signer's role, not which replica.
//!
//! Form: `v1.HEX(claims).SCHEME.HEX(signature).HEX(signer certificate)[~HEX(intermediate)...]`.
//! The signature covers a fixed context string and the claims, so no other
//! signature made with a server key (a TLS handshake's) can pass for one.

use rustls::pki_types::{CertificateDer, UnixTime};
use rustls::server::ParsedCertificate;
use rustls::SignatureScheme;

use crate::tls::{principal_in_cluster, Credentials, Principal, Role};

/// Metadata key that carries the step credential to a step service.
pub const STEP_CREDENTIAL_METADATA_KEY: &str = "gangway-step-credential";
/// Environment variable that hands the credential to the job's tasks.
pub const STEP_CREDENTIAL_ENV: &str = "GANGWAY_STEP_CREDENTIAL";
/// Environment variable with the cluster's CA certificate (PEM), which srun
/// checks the agents' certificates against.
pub const STEP_CA_ENV: &str = "GANGWAY_STEP_CA";
/// The cluster (trust domain) whose agents and replicas a job's srun and
/// CLI accept: without a certificate of their own, they learn it here.
pub const STEP_CLUSTER_ENV: &str = "GANGWAY_STEP_CLUSTER";
/// A credential is a few kilobytes (mostly the signer's certificate); larger
/// input is refused before any parsing.
pub const STEP_CREDENTIAL_BYTES_MAX: usize = 16 * 1024;
/// Nodes one credential may name (a job's nodes; matches the core's bound on
/// nodes per job with room).
const NODES_MAX: usize = 100_000;
/// What every signature of a step credential covers first (domain separation).
const CONTEXT: &[u8] = b"gangway step credential v1\n";
/// Certificates in a credential's chain (the signer and its intermediates).
const CHAIN_MAX: usize = 4;
/// Schemes a replica may sign with, in order of preference.
const SCHEMES: &[SignatureScheme] = &[
    SignatureScheme::ECDSA_NISTP256_SHA256,
    SignatureScheme::ED25519,
    SignatureScheme::ECDSA_NISTP384_SHA384,
    SignatureScheme::RSA_PSS_SHA256,
];

/// What a step credential allows.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StepClaims {
    pub job_id: u64,
    pub attempt: u32,
    /// The job's nodes: the only ones where steps may start.
    pub nodes: Vec<String>,
    /// Unix seconds after which it is refused.
    pub expires_unix: u64,
}

impl StepClaims {
    fn encode(&self) -> String {
        format!("v1|{}|{}|{}|{}", self.job_id, self.attempt, self.expires_unix, self.nodes.join(","))
    }

    fn decode(s: &str) -> Result<StepClaims, String> {
        let mut f = s.splitn(5, '|');
        if f.next() != Some("v1") {
            return Err("unknown claims version".into());
        }
        let mut num = |what: &str| -> Result<u64, String> {
            f.next().and_then(|v| v.parse().ok()).ok_or_else(|| format!("claims: bad {what}"))
        };
        let job_id = num("job")?;
        let attempt = u32::try_from(num("attempt")?).map_err(|_| "claims: bad attempt".to_string())?;
        let expires_unix = num("expiry")?;
        let nodes: Vec<String> =
            f.next().unwrap_or("").split(',').filter(|n| !n.is_empty()).map(String::from).collect();
        if nodes.len() > NODES_MAX {
            return Err("claims: too many nodes".into());
        }
        Ok(StepClaims { job_id, attempt, nodes, expires_unix })
    }
}

fn hex(bytes: &[u8]) -> String {
    bytes.iter().map(|b| format!("{b:02x}")).collect()
}

fn unhex(s: &str) -> Result<Vec<u8>, String> {
    if s.len() % 2 != 0 || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err("not hex".into());
    }
    s.as_bytes()
        .chunks(2)
        .map(|pair| {
            let pair = std::str::from_utf8(pair).map_err(|e| e.to_string())?;
            u8::from_str_radix(pair, 16).map_err(|e| e.to_string())
        })
        .collect()
}

/// Signs `claims` with this replica's server key.
pub fn sign(creds: &Credentials, claims: &StepClaims) -> Result<String, String> {
    let key = creds.certified_key().ok_or("this process has no certificate to sign with")?;
    let signer = key.key.choose_scheme(SCHEMES).ok_or("the server key's type cannot sign step credentials")?;
    let payload = claims.encode();
    let sig = signer.sign(&[CONTEXT, payload.as_bytes()].concat()).map_err(|e| e.to_string())?;
    if key.cert.is_empty() || key.cert.len() > CHAIN_MAX {
        return Err(format!("the server certificate chain must hold 1 to {CHAIN_MAX} certificates"));
    }
    let chain: Vec<String> = key.cert.iter().map(|c| hex(c.as_ref())).collect();
    Ok(format!("v1.{}.{:04x}.{}.{}", hex(payload.as_bytes()), u16::from(signer.scheme()), hex(&sig), chain.join("~")))
}

/// Checks a credential for a step of `job_id`/`attempt` on `node` at `now`:
/// signed by a server certificate of the CA, unexpired, naming them.
pub fn verify(
    creds: &Credentials,
    token: &str,
    job_id: u64,
    attempt: u32,
    node: &str,
    now_unix: u64,
) -> Result<StepClaims, String> {
    verify_by(creds, token, job_id, attempt, node, now_unix).map(|(claims, _)| claims)
}

/// As [`verify`], with the replica whose certificate signed it.
pub fn verify_by(
    creds: &Credentials,
    token: &str,
    job_id: u64,
    attempt: u32,
    node: &str,
    now_unix: u64,
) -> Result<(StepClaims, Principal), String> {
    let (claims, signer) = verify_signed_by(creds, token, now_unix)?;
    if claims.job_id != job_id || claims.attempt != attempt {
        return Err(format!(
            "it is for job {} attempt {}, not job {job_id} attempt {attempt}",
            claims.job_id, claims.attempt
        ));
    }
    if !claims.nodes.iter().any(|n| n == node) {
        return Err(format!("it does not name node {node}"));
    }
    Ok((claims, signer))
}

/// The claims of a credential signed by a server certificate of the CA and
/// unexpired at `now`, whatever job and nodes it names.
pub fn verify_signed(creds: &Credentials, token: &str, now_unix: u64) -> Result<StepClaims, String> {
    verify_signed_by(creds, token, now_unix).map(|(claims, _)| claims)
}

/// As [`verify_signed`], with the replica whose certificate signed it.
pub fn verify_signed_by(creds: &Credentials, token: &str, now_unix: u64) -> Result<(StepClaims, Principal), String> {
    if token.len() > STEP_CREDENTIAL_BYTES_MAX {
        return Err(format!("longer than {STEP_CREDENTIAL_BYTES_MAX} bytes"));
    }
    let parts: Vec<&str> = token.split('.').collect();
    let [version, payload, scheme, sig, cert] = parts.as_slice() else {
        return Err("malformed".into());
    };
    if *version != "v1" {
        return Err(format!("unknown version '{version}'"));
    }
    let payload = unhex(payload)?;
    let sig = unhex(sig)?;
    let chain: Vec<&str> = cert.split('~').collect();
    if chain.len() > CHAIN_MAX {
        return Err(format!("more than {CHAIN_MAX} certificates"));
    }
    let cert = CertificateDer::from(unhex(chain[0])?);
    let intermediates: Vec<CertificateDer<'static>> =
        chain[1..].iter().map(|c| unhex(c).map(CertificateDer::from)).collect::<Result<_, _>>()?;
    let scheme = SignatureScheme::from(u16::from_str_radix(scheme, 16).map_err(|_| "bad signature scheme")?);
    // The signer: a server certificate the CA signed, valid now.
    let parsed = ParsedCertificate::try_from(&cert).map_err(|e| format!("signer certificate: {e}"))?;
    let provider = crate::tls::provider();
    rustls::client::verify_server_cert_signed_by_trust_anchor(
        &parsed,
        &creds.roots(),
        &intermediates,
        UnixTime::since_unix_epoch(std::time::Duration::from_secs(now_unix)),
        provider.signature_verification_algorithms.all,
    )
    .map_err(|e| format!("signer certificate: {e}"))?;
    let (signer, cluster, _) = principal_in_cluster(&cert)?;
    if signer.role != Role::Server {
        return Err(format!("signed by {signer}, not a controller replica"));
    }
    if let Some(own) = creds.cluster().filter(|own| *own != cluster) {
        return Err(format!("signed by {signer} of cluster '{cluster}', not '{own}'"));
    }
    let algs = provider
        .signature_verification_algorithms
        .mapping
        .iter()
        .find(|(s, _)| *s == scheme)
        .map(|(_, algs)| *algs)
        .ok_or_else(|| format!("signature scheme {scheme:?} is not accepted"))?;
    let ee = webpki::EndEntityCert::try_from(&cert).map_err(|e| format!("signer certificate: {e}"))?;
    let signed = [CONTEXT, &payload[..]].concat();
    if !algs.iter().any(|alg| ee.verify_signature(*alg, &signed, &sig).is_ok()) {
        return Err("the signature does not match".into());
    }
    let claims = StepClaims::decode(std::str::from_utf8(&payload).map_err(|_| "claims are not text")?)?;
    if now_unix > claims.expires_unix {
        return Err("it has expired".into());
    }
    Ok((claims, signer))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::pki;
    use crate::tls::{Principal, TlsFiles};

    /// Claims naming NODES_MAX nodes decode; one node more is refused.
    #[test]
    fn claims_name_at_most_nodes_max_nodes() {
        let claims = |n: usize| {
            let nodes: Vec<String> = (0..n).map(|i| format!("n{i}")).collect();
            StepClaims { job_id: 7, attempt: 1, nodes, expires_unix: 1 }.encode()
        };
        assert_eq!(StepClaims::decode(&claims(NODES_MAX)).unwrap().nodes.len(), NODES_MAX);
        assert_eq!(StepClaims::decode(&claims(NODES_MAX + 1)).unwrap_err(), "claims: too many nodes");
    }

    #[test]
    fn only_a_servers_unexpired_credential_for_this_job_and_node_passes() {
        let dir = std::env::temp_dir().join(format!("gangway-stepcred-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ps = [
            Principal::new(Role::Server, "1").unwrap(),
            Principal::new(Role::Agent, "n1").unwrap(),
            Principal::new(Role::Client, "alice").unwrap(),
        ];
        pki::throwaway(&dir, &ps).unwrap();
        let server = Credentials::load(TlsFiles::in_dir(&dir, "server-1")).unwrap();
        let agent = Credentials::load(TlsFiles::in_dir(&dir, "agent-n1")).unwrap();
        let alice = Credentials::load(TlsFiles::in_dir(&dir, "client-alice")).unwrap();
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let claims =
            StepClaims { job_id: 7, attempt: 1, nodes: vec!["n1".into(), "n2".into()], expires_unix: now + 1_000 };
        let token = sign(&server, &claims).unwrap();
        assert_eq!(verify(&agent, &token, 7, 1, "n1", now).unwrap(), claims);
        let refused = |t: &str, job, attempt, node, now| verify(&agent, t, job, attempt, node, now).unwrap_err();
        assert!(refused(&token, 8, 1, "n1", now).contains("not job 8"));
        assert!(refused(&token, 7, 2, "n1", now).contains("attempt 2"));
        assert!(refused(&token, 7, 1, "n3", now).contains("does not name node n3"));
        assert!(refused(&token, 7, 1, "n1", now + 1_001).contains("expired"));
        // Tampered claims: another job's id under the same signature.
        let mut parts: Vec<String> = token.split('.').map(String::from).collect();
        parts[1] = hex(format!("v1|8|1|{}|n1,n2", now + 1_000).as_bytes());
        assert!(refused(&parts.join("."), 8, 1, "n1", now).contains("signature does not match"));
        // Neither an agent nor a user can mint one.
        let forged = sign(&agent, &claims).unwrap();
        assert!(refused(&forged, 7, 1, "n1", now).contains("not a controller replica"));
        let forged = sign(&alice, &claims).unwrap();
        assert!(refused(&forged, 7, 1, "n1", now).contains("signer certificate"));
        assert!(refused("v1.zz", 7, 1, "n1", now).contains("malformed"));
        // A server of another cluster that shares the CA cannot mint one
        // this cluster's agents accept.
        let other = dir.join("other");
        std::fs::create_dir_all(&other).unwrap();
        let req = pki::CertRequest {
            principal: Principal::new(Role::Server, "1").unwrap(),
            hosts: vec![],
            days: 1,
            backdate_days: 0,
            cluster: "other".into(),
        };
        pki::create_cert(&dir, &other, &req).unwrap();
        let foreign = Credentials::load(TlsFiles {
            ca: dir.join("ca.pem"),
            cert: Some((other.join("server-1.pem"), other.join("server-1-key.pem"))),
        })
        .unwrap();
        let forged = sign(&foreign, &claims).unwrap();
        assert!(refused(&forged, 7, 1, "n1", now).contains("of cluster 'other', not 'gangway'"));
        assert!(refused(&"a".repeat(STEP_CREDENTIAL_BYTES_MAX + 1), 7, 1, "n1", now).contains("longer"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A server whose certificate file holds a chain of CHAIN_MAX certificates
    /// signs credentials that verify; with one more it cannot sign, and a
    /// credential carrying one more is refused.
    #[test]
    fn a_credential_carries_at_most_chain_max_certificates() {
        let dir = std::env::temp_dir().join(format!("gangway-stepcred-chain-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ps = [Principal::new(Role::Server, "1").unwrap(), Principal::new(Role::Agent, "n1").unwrap()];
        pki::throwaway(&dir, &ps).unwrap();
        let agent = Credentials::load(TlsFiles::in_dir(&dir, "agent-n1")).unwrap();
        let (leaf, ca) = (
            std::fs::read_to_string(dir.join("server-1.pem")).unwrap(),
            std::fs::read_to_string(dir.join("ca.pem")).unwrap(),
        );
        // The signer with extra copies of the CA as "intermediates".
        let signer = |n: usize| {
            let cert = dir.join(format!("chain-{n}.pem"));
            std::fs::write(&cert, format!("{leaf}{}", ca.repeat(n - 1))).unwrap();
            let files = TlsFiles { ca: dir.join("ca.pem"), cert: Some((cert, dir.join("server-1-key.pem"))) };
            Credentials::load(files).unwrap()
        };
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap().as_secs();
        let claims = StepClaims { job_id: 7, attempt: 1, nodes: vec!["n1".into()], expires_unix: now + 1_000 };
        let token = sign(&signer(CHAIN_MAX), &claims).unwrap();
        assert_eq!(token.split('~').count(), CHAIN_MAX);
        assert_eq!(verify(&agent, &token, 7, 1, "n1", now).unwrap(), claims);
        let err = sign(&signer(CHAIN_MAX + 1), &claims).unwrap_err();
        assert!(err.contains(&format!("1 to {CHAIN_MAX} certificates")), "{err}");
        let intermediate = token.rsplit('~').next().unwrap();
        let longer = format!("{token}~{intermediate}");
        assert!(longer.len() <= STEP_CREDENTIAL_BYTES_MAX);
        let err = verify(&agent, &longer, 7, 1, "n1", now).unwrap_err();
        assert_eq!(err, format!("more than {CHAIN_MAX} certificates"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
