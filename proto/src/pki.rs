//! A small certificate authority for sites without one: `gangway tls ca create`
//! and `gangway tls cert create`, and the throwaway CA of the dev cluster and
//! the tests. Keys are ECDSA P-256; files are written 0600 and never
//! overwritten.

use std::io::Write;
use std::net::IpAddr;
use std::path::{Path, PathBuf};

use rcgen::{
    BasicConstraints, CertificateParams, DnType, ExtendedKeyUsagePurpose, IsCa, KeyPair, KeyUsagePurpose, SanType,
};

use crate::tls::{Principal, Role, TlsFiles};

/// Days a CA is valid by default: ten years, as a site CA usually is.
pub const CA_DAYS_DEFAULT: u32 = 3650;
/// Days a certificate is valid by default: one year.
pub const CERT_DAYS_DEFAULT: u32 = 365;
/// The longest validity `gangway tls` issues (ten years).
pub const DAYS_MAX: u32 = 3650;
/// Extra names (hosts, addresses) one certificate may carry.
pub const HOSTS_MAX: usize = 64;

fn err(e: impl std::fmt::Display) -> String {
    e.to_string()
}

fn validity(params: &mut CertificateParams, days: u32, backdate_days: u32) -> Result<(), String> {
    if days == 0 || days > DAYS_MAX {
        return Err(format!("days: must be between 1 and {DAYS_MAX}, got {days}"));
    }
    if backdate_days > DAYS_MAX {
        return Err(format!("backdate: must be at most {DAYS_MAX} days"));
    }
    let out_of_range = || format!("validity: {days} days (back-dated {backdate_days}) is out of range");
    let now = time::OffsetDateTime::now_utc()
        .checked_sub(time::Duration::days(i64::from(backdate_days)))
        .ok_or_else(out_of_range)?;
    // A little back-dating covers clocks a few minutes apart.
    params.not_before = now.checked_sub(time::Duration::minutes(5)).ok_or_else(out_of_range)?;
    params.not_after = now.checked_add(time::Duration::days(i64::from(days))).ok_or_else(out_of_range)?;
    Ok(())
}

/// Writes `contents` to a new file readable only by its owner.
pub fn write_private(path: &Path, contents: &str) -> Result<(), String> {
    use std::os::unix::fs::OpenOptionsExt;
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .mode(0o600)
        .open(path)
        .map_err(|e| format!("{}: {e}", path.display()))?;
    f.write_all(contents.as_bytes()).map_err(|e| format!("{}: {e}", path.display()))?;
    f.sync_all().map_err(|e| format!("{}: {e}", path.display()))
}

/// The CA's files in `dir`.
pub fn ca_paths(dir: &Path) -> (PathBuf, PathBuf) {
    (dir.join("ca.pem"), dir.join("ca-key.pem"))
}

/// The stem of a principal's files: `server-1`, `agent-node-7`, `client-alice`.
pub fn stem(p: &Principal) -> String {
    format!("{}-{}", p.role.as_str(), p.name)
}

/// Creates a CA in `dir` (`ca.pem`, `ca-key.pem`); refuses to overwrite one.
pub fn create_ca(dir: &Path, name: &str, days: u32) -> Result<PathBuf, String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let (cert_path, key_path) = ca_paths(dir);
    if cert_path.exists() || key_path.exists() {
        return Err(format!("{} already holds a CA; not overwriting it", dir.display()));
    }
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    params.distinguished_name.push(DnType::CommonName, name);
    params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
    params.key_usages = vec![KeyUsagePurpose::KeyCertSign, KeyUsagePurpose::CrlSign, KeyUsagePurpose::DigitalSignature];
    validity(&mut params, days, 0)?;
    let key = KeyPair::generate().map_err(err)?;
    let cert = params.self_signed(&key).map_err(err)?;
    write_private(&key_path, &key.serialize_pem())?;
    write_private(&cert_path, &cert.pem())?;
    Ok(cert_path)
}

/// What a new certificate is for.
pub struct CertRequest {
    pub principal: Principal,
    /// Host names and addresses the holder is also known by (DNS/IP SANs), for
    /// tools that check host names (grpcurl, Prometheus).
    pub hosts: Vec<String>,
    pub days: u32,
    /// Starts the validity this many days in the past (a certificate that has
    /// already expired, for tests of expiry handling; 0 normally).
    pub backdate_days: u32,
    /// The cluster it is for (its SPIFFE trust domain): peers of another
    /// cluster refuse it, even under the same CA.
    pub cluster: String,
}

/// Issues a certificate signed by the CA in `ca_dir` into `out_dir`
/// (`STEM.pem`, `STEM-key.pem`); refuses to overwrite.
pub fn create_cert(ca_dir: &Path, out_dir: &Path, req: &CertRequest) -> Result<(PathBuf, PathBuf), String> {
    if req.hosts.len() > HOSTS_MAX {
        return Err(format!("host: at most {HOSTS_MAX}"));
    }
    let (ca_cert_path, ca_key_path) = ca_paths(ca_dir);
    let ca_pem = std::fs::read_to_string(&ca_cert_path).map_err(|e| format!("{}: {e}", ca_cert_path.display()))?;
    let ca_key_pem = std::fs::read_to_string(&ca_key_path)
        .map_err(|e| format!("{}: {e} (certificates are signed with the CA's key)", ca_key_path.display()))?;
    let ca_key = KeyPair::from_pem(&ca_key_pem).map_err(|e| format!("{}: {e}", ca_key_path.display()))?;
    let ca_params =
        CertificateParams::from_ca_cert_pem(&ca_pem).map_err(|e| format!("{}: {e}", ca_cert_path.display()))?;
    let issuer = ca_params.self_signed(&ca_key).map_err(err)?;

    let p = &req.principal;
    let mut params = CertificateParams::new(Vec::<String>::new()).map_err(err)?;
    params.distinguished_name.push(DnType::CommonName, p.name.clone());
    params.distinguished_name.push(DnType::OrganizationalUnitName, p.role.as_str());
    crate::tls::check_cluster_name(&req.cluster)?;
    let san = p.san_uri_in(&req.cluster);
    let uri = san.clone().try_into().map_err(|e| format!("{san}: {e}"))?;
    params.subject_alt_names.push(SanType::URI(uri));
    // Tools that check host names (Prometheus, grpcurl) can check a Gangway
    // listener by its role: `server.gangway` or `agent.gangway`.
    if p.role != Role::Client {
        let name = format!("{}.{}", p.role.as_str(), crate::tls::SNI_NAME);
        if !req.hosts.contains(&name) {
            params.subject_alt_names.push(SanType::DnsName(name.try_into().map_err(err)?));
        }
    }
    for h in &req.hosts {
        let san = match h.parse::<IpAddr>() {
            Ok(ip) => SanType::IpAddress(ip),
            Err(_) => SanType::DnsName(h.clone().try_into().map_err(|e| format!("host '{h}': {e}"))?),
        };
        params.subject_alt_names.push(san);
    }
    params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
    // Servers and agents both accept connections and make them; clients only make them.
    params.extended_key_usages = match p.role {
        Role::Server | Role::Agent => vec![ExtendedKeyUsagePurpose::ServerAuth, ExtendedKeyUsagePurpose::ClientAuth],
        Role::Client => vec![ExtendedKeyUsagePurpose::ClientAuth],
    };
    validity(&mut params, req.days, req.backdate_days)?;
    let key = KeyPair::generate().map_err(err)?;
    let cert = params.signed_by(&key, &issuer, &ca_key).map_err(err)?;
    std::fs::create_dir_all(out_dir).map_err(|e| format!("{}: {e}", out_dir.display()))?;
    let s = stem(p);
    let cert_path = out_dir.join(format!("{s}.pem"));
    let key_path = out_dir.join(format!("{s}-key.pem"));
    if cert_path.exists() || key_path.exists() {
        return Err(format!("{} already exists; not overwriting it", cert_path.display()));
    }
    write_private(&key_path, &key.serialize_pem())?;
    write_private(&cert_path, &cert.pem())?;
    Ok((cert_path, key_path))
}

/// A CA plus one certificate per principal in `dir`, for dev clusters and
/// tests: returns each principal's files.
pub fn throwaway(dir: &Path, principals: &[Principal]) -> Result<Vec<TlsFiles>, String> {
    create_ca(dir, "Gangway throwaway CA", 30)?;
    let mut out = Vec::with_capacity(principals.len());
    for p in principals {
        let req = CertRequest {
            principal: p.clone(),
            hosts: vec!["localhost".into(), "127.0.0.1".into()],
            days: 30,
            backdate_days: 0,
            cluster: crate::tls::DEFAULT_CLUSTER.into(),
        };
        let (cert, key) = create_cert(dir, dir, &req)?;
        out.push(TlsFiles { ca: ca_paths(dir).0, cert: Some((cert, key)) });
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::tls::principal_of;

    #[test]
    fn issued_certificates_name_their_principal_and_are_private() {
        use std::os::unix::fs::PermissionsExt;
        let dir = tempfile_dir();
        let alice = Principal::new(Role::Client, "alice").unwrap();
        let files = throwaway(&dir, std::slice::from_ref(&alice)).unwrap();
        let (cert, key) = files[0].cert.clone().unwrap();
        for p in [&cert, &key, &dir.join("ca-key.pem")] {
            assert_eq!(std::fs::metadata(p).unwrap().permissions().mode() & 0o777, 0o600, "{}", p.display());
        }
        let pem = std::fs::read(&cert).unwrap();
        let der = rustls_pemfile::certs(&mut pem.as_slice()).next().unwrap().unwrap();
        let (p, not_after) = principal_of(&der).unwrap();
        assert_eq!(p, alice);
        assert!(not_after > 0);
        // Never overwritten.
        assert!(create_ca(&dir, "again", 1).unwrap_err().contains("already holds a CA"));
        let req = CertRequest { principal: alice, hosts: vec![], days: 1, backdate_days: 0, cluster: "gangway".into() };
        assert!(create_cert(&dir, &dir, &req).unwrap_err().contains("already exists"));
        let bad = CertRequest {
            principal: Principal::new(Role::Agent, "n1").unwrap(),
            hosts: vec![],
            days: 0,
            backdate_days: 0,
            cluster: "gangway".into(),
        };
        assert!(create_cert(&dir, &dir, &bad).unwrap_err().starts_with("days:"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn principal_names_are_path_safe() {
        assert!(Principal::new(Role::Client, "alice").is_ok());
        assert!(Principal::new(Role::Agent, "gpu-node-01.rack3").is_ok());
        for bad in ["", "../etc", "a/b", "-x", "a b", "a:b"] {
            assert!(Principal::new(Role::Client, bad).is_err(), "{bad}");
        }
        assert_eq!(Principal::decode("agent:n1").unwrap(), Principal::new(Role::Agent, "n1").unwrap());
        assert!(Principal::decode("root:n1").is_err());
        // Read by the core's parser, strictly: a name with a `:` in it, an
        // empty name or a bare name is not a principal.
        assert!(Principal::decode("client:alice:bob").unwrap_err().contains("must not contain ':'"));
        assert!(Principal::decode("client:").is_err());
        assert!(Principal::decode("alice").is_err());
        assert!(Principal::decode("dev:alice").unwrap_err().contains("is not a role"));
        assert_eq!(Principal::decode("server:1").unwrap(), Principal::new(Role::Server, "1").unwrap());
    }

    /// A CA valid DAYS_MAX days is made; one day more is refused. Back-dating
    /// is bounded the same way.
    #[test]
    fn validity_is_at_most_days_max() {
        let dir = tempfile_dir();
        assert!(create_ca(&dir.join("at"), "ca", DAYS_MAX).is_ok());
        let err = create_ca(&dir.join("past"), "ca", DAYS_MAX + 1).unwrap_err();
        assert_eq!(err, format!("days: must be between 1 and {DAYS_MAX}, got {}", DAYS_MAX + 1));
        let mut params = CertificateParams::default();
        assert!(validity(&mut params, 1, DAYS_MAX).is_ok());
        assert!(validity(&mut params, 1, DAYS_MAX + 1).unwrap_err().starts_with("backdate:"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A certificate for HOSTS_MAX extra names is issued; one more is refused.
    #[test]
    fn a_certificate_carries_at_most_hosts_max_names() {
        let dir = tempfile_dir();
        create_ca(&dir, "ca", 1).unwrap();
        let req = |n: usize, name: &str| CertRequest {
            principal: Principal::new(Role::Client, name).unwrap(),
            hosts: (0..n).map(|i| format!("h{i}.example")).collect(),
            days: 1,
            backdate_days: 0,
            cluster: "gangway".into(),
        };
        let (cert, _) = create_cert(&dir, &dir, &req(HOSTS_MAX, "at")).unwrap();
        let pem = std::fs::read(&cert).unwrap();
        let der = rustls_pemfile::certs(&mut pem.as_slice()).next().unwrap().unwrap();
        let (_, parsed) = x509_parser::parse_x509_certificate(&der).unwrap();
        let sans = parsed.subject_alternative_name().unwrap().unwrap().value.general_names.len();
        assert_eq!(sans, HOSTS_MAX + 1, "the hosts and the principal's URI");
        assert_eq!(
            create_cert(&dir, &dir, &req(HOSTS_MAX + 1, "past")).unwrap_err(),
            format!("host: at most {HOSTS_MAX}")
        );
        std::fs::remove_dir_all(&dir).unwrap();
    }

    fn tempfile_dir() -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "gangway-pki-test-{}-{:?}",
            std::process::id(),
            std::thread::current().id()
        ));
        let _ = std::fs::remove_dir_all(&d);
        d
    }
}
