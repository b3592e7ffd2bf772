//! `gangway tls`: a small CA for sites without one, and how every command finds
//! its certificates (`--tls-*` flags, `GANGWAY_TLS_*`, a TLS directory, or the
//! running dev cluster's).

use std::path::{Path, PathBuf};

use anyhow::{bail, Context};
use clap::{Args, Subcommand};
use gangway_proto::pki;
use gangway_proto::tls::{Credentials, Principal, Role, Security, TlsFiles};

/// How this process secures its connections (global flags).
#[derive(Args, Clone, Debug, Default)]
pub struct TlsArgs {
    /// The cluster's CA certificate (PEM).
    #[arg(long, global = true, env = "GANGWAY_TLS_CA")]
    pub tls_ca: Option<PathBuf>,
    /// This process's certificate (PEM): a server, agent or client certificate.
    #[arg(long, global = true, env = "GANGWAY_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// This process's private key (PEM).
    #[arg(long, global = true, env = "GANGWAY_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// A directory as `gangway tls` writes it: ca.pem plus this process's
    /// STEM.pem and STEM-key.pem (server-ID, agent-NODE, client-NAME or client).
    #[arg(long, global = true, env = "GANGWAY_TLS_DIR")]
    pub tls_dir: Option<PathBuf>,
    /// Plaintext gRPC where callers name themselves (--identity): anyone who
    /// can reach the cluster controls it. Only for throwaway test clusters.
    #[arg(long, global = true, env = "GANGWAY_INSECURE")]
    pub insecure: bool,
    /// A bearer token (gangway token create, or a site's OIDC issuer) to use
    /// instead of a client certificate; the CA still comes from --tls-ca or
    /// --tls-dir.
    #[arg(long, global = true, env = "GANGWAY_TOKEN", hide_env_values = true)]
    pub token: Option<String>,
}

/// Where this user's dev clusters keep their throwaway CAs and certificates
/// while they run (one directory per first port inside), so the CLI finds
/// them with no flags.
pub fn dev_tls_base() -> PathBuf {
    let uid = nix::unistd::getuid().as_raw();
    match std::env::var_os("XDG_RUNTIME_DIR").filter(|d| !d.is_empty()) {
        Some(d) => PathBuf::from(d).join("gangway-dev-tls"),
        None => std::env::temp_dir().join(format!("gangway-dev-tls-{uid}")),
    }
}

/// The dev cluster whose first replica listens on `port`: its directory.
pub fn dev_tls_dir(port: u16) -> PathBuf {
    dev_tls_base().join(port.to_string())
}

/// The dev cluster's directory for these endpoints (by the first one's port),
/// when it and its parent are this user's own and nobody else can write them.
fn dev_dir_for(endpoints: &[String]) -> Option<PathBuf> {
    let port: u16 = endpoints.first()?.trim().rsplit(':').next()?.parse().ok()?;
    let dir = dev_tls_dir(port);
    (owned_private_dir(&dev_tls_base()) && owned_private_dir(&dir)).then_some(dir)
}

/// The user's own TLS directory, used when nothing else is given.
fn user_tls_dir() -> Option<PathBuf> {
    std::env::var_os("HOME").filter(|h| !h.is_empty()).map(|h| PathBuf::from(h).join(".config/gangway/tls"))
}

/// A directory others could have planted (in /tmp) is used only when it is
/// ours and nobody else can write it.
fn owned_private_dir(dir: &Path) -> bool {
    use std::os::unix::fs::MetadataExt;
    match std::fs::symlink_metadata(dir) {
        Ok(m) => m.is_dir() && m.uid() == nix::unistd::getuid().as_raw() && m.mode() & 0o022 == 0,
        Err(_) => false,
    }
}

/// Inside a job of a secured cluster: the job's step credential and the CA
/// (from the job's environment), which let its processes act as its user.
pub fn job_credential() -> Option<(Security, String)> {
    let credential = std::env::var(gangway_proto::step_cred::STEP_CREDENTIAL_ENV).ok().filter(|c| !c.is_empty())?;
    let ca = std::env::var(gangway_proto::step_cred::STEP_CA_ENV).ok().filter(|c| !c.is_empty())?;
    let cluster = std::env::var(gangway_proto::step_cred::STEP_CLUSTER_ENV).ok().filter(|c| !c.is_empty());
    let creds = Credentials::from_ca_pem(ca.as_bytes(), cluster.as_deref()).ok()?;
    Some((Security::Tls(creds), credential))
}

/// The login name of this process (USER, LOGNAME, else its uid's name).
pub fn login_name() -> String {
    std::env::var("USER")
        .or_else(|_| std::env::var("LOGNAME"))
        .ok()
        .filter(|u| !u.is_empty())
        .or_else(|| nix::unistd::User::from_uid(nix::unistd::getuid()).ok().flatten().map(|u| u.name))
        .unwrap_or_else(|| "user".into())
}

fn files_in(dir: &Path, stems: &[String]) -> Option<TlsFiles> {
    stems
        .iter()
        .map(|s| TlsFiles::in_dir(dir, s))
        .find(|f| f.ca.is_file() && f.cert.as_ref().is_some_and(|(c, k)| c.is_file() && k.is_file()))
}

impl TlsArgs {
    /// The flags' environment variables alone, for commands run without the
    /// usual argument parsing (srun inside a job).
    pub fn from_env() -> TlsArgs {
        let path = |k: &str| std::env::var_os(k).filter(|v| !v.is_empty()).map(PathBuf::from);
        TlsArgs {
            tls_ca: path("GANGWAY_TLS_CA"),
            tls_cert: path("GANGWAY_TLS_CERT"),
            tls_key: path("GANGWAY_TLS_KEY"),
            tls_dir: path("GANGWAY_TLS_DIR"),
            insecure: std::env::var("GANGWAY_INSECURE").is_ok_and(|v| v == "true" || v == "1"),
            token: std::env::var("GANGWAY_TOKEN").ok().filter(|t| !t.is_empty()),
        }
    }

    /// Explicit files or a directory; `stems` name the files looked for there.
    fn explicit(&self, stems: &[String]) -> anyhow::Result<Option<TlsFiles>> {
        match (&self.tls_ca, &self.tls_cert, &self.tls_key) {
            (Some(ca), Some(cert), Some(key)) => {
                return Ok(Some(TlsFiles { ca: ca.clone(), cert: Some((cert.clone(), key.clone())) }))
            }
            (None, None, None) => {}
            _ => bail!("tls: give all of --tls-ca, --tls-cert and --tls-key (or --tls-dir)"),
        }
        if let Some(dir) = &self.tls_dir {
            return match files_in(dir, stems) {
                Some(f) => Ok(Some(f)),
                None => {
                    bail!("tls-dir: {} holds no ca.pem with {} (.pem and -key.pem)", dir.display(), stems.join(" or "))
                }
            };
        }
        Ok(None)
    }

    fn secured(&self, files: TlsFiles) -> anyhow::Result<Security> {
        if self.insecure {
            bail!("insecure: cannot be combined with TLS files; choose one");
        }
        Ok(Security::Tls(Credentials::load(files).map_err(|e| anyhow::anyhow!("tls: {e}"))?))
    }

    /// For a controller replica or an agent: explicit files, or `--insecure`.
    pub fn for_daemon(&self, principal: &Principal) -> anyhow::Result<Security> {
        let stem = pki::stem(principal);
        match self.explicit(std::slice::from_ref(&stem))? {
            Some(files) => self.secured(files),
            None if self.insecure => {
                tracing::warn!(
                    "INSECURE (--insecure): plaintext gRPC, callers are whoever they claim to be; never use this on a shared network"
                );
                Ok(Security::Insecure)
            }
            None => bail!(
                "tls: this {} needs its certificate: --tls-dir DIR (with ca.pem, {stem}.pem, {stem}-key.pem) or \
                 --tls-ca/--tls-cert/--tls-key; make them with `gangway tls ca create` and `gangway tls cert create --{} {}`; \
                 or run a throwaway cluster with --insecure",
                principal.role.as_str(),
                principal.role.as_str(),
                principal.name
            ),
        }
    }

    /// For a user command: explicit files, else `~/.config/gangway/tls`, else
    /// the running dev cluster's, else `--insecure`. With a token, only the
    /// CA is needed.
    pub fn for_client(&self, endpoints: &[String]) -> anyhow::Result<Security> {
        if self.token.is_some() && self.tls_cert.is_none() {
            let ca = match (&self.tls_ca, &self.tls_dir) {
                (Some(ca), _) => Some(ca.clone()),
                (None, Some(dir)) => Some(dir.join("ca.pem")),
                // The dev cluster's directory may be in /tmp: only when it is
                // this user's own and nobody else can write it.
                (None, None) => [user_tls_dir(), dev_dir_for(endpoints)]
                    .into_iter()
                    .flatten()
                    .map(|d| d.join("ca.pem"))
                    .find(|p| p.is_file()),
            };
            let ca = ca.context("token: the cluster's CA certificate is needed too (--tls-ca)")?;
            return self.secured(TlsFiles { ca, cert: None });
        }
        let stems = vec!["client".to_string(), format!("client-{}", login_name())];
        if let Some(files) = self.explicit(&stems)? {
            return self.secured(files);
        }
        if self.insecure {
            return Ok(Security::Insecure);
        }
        if let Some(files) = user_tls_dir().and_then(|d| files_in(&d, &stems)) {
            return self.secured(files);
        }
        if let Some(files) = dev_dir_for(endpoints).and_then(|dev| files_in(&dev, &stems)) {
            return self.secured(files);
        }
        bail!(
            "tls: no client certificate found (looked in --tls-dir/GANGWAY_TLS_DIR, ~/.config/gangway/tls and a dev \
             cluster's in {}); ask an admin for one (`gangway tls cert create --client {}`), or use --insecure for an \
             insecure cluster",
            dev_tls_base().display(),
            login_name()
        )
    }
}

// ---------------------------------------------------------------- gangway tls

#[derive(Subcommand)]
pub enum TlsCmd {
    /// The cluster's certificate authority.
    #[command(subcommand)]
    Ca(CaCmd),
    /// Certificates for servers, agents and clients.
    #[command(subcommand)]
    Cert(CertCmd),
    /// Prints the principal and expiry of a certificate file.
    Show { file: PathBuf },
}

#[derive(Subcommand)]
pub enum CaCmd {
    /// Creates a CA: DIR/ca.pem (give it to every host) and DIR/ca-key.pem (keep it offline).
    Create {
        /// Where to write the CA.
        #[arg(long, default_value = ".")]
        dir: PathBuf,
        /// The CA's common name.
        #[arg(long, default_value = "Gangway CA")]
        name: String,
        #[arg(long, default_value_t = pki::CA_DAYS_DEFAULT)]
        days: u32,
    },
}

#[derive(Subcommand)]
pub enum CertCmd {
    /// Issues a certificate signed by the CA: DIR/ROLE-NAME.pem and DIR/ROLE-NAME-key.pem.
    Create(CertArgs),
}

#[derive(Args)]
#[command(group = clap::ArgGroup::new("role").required(true).args(["server", "agent", "client"]))]
pub struct CertArgs {
    /// A controller replica's certificate (its id).
    #[arg(long)]
    server: Option<String>,
    /// A node agent's certificate (the node's name).
    #[arg(long)]
    agent: Option<String>,
    /// A user's or service's certificate (the user name jobs run as).
    #[arg(long)]
    client: Option<String>,
    /// Other names the holder is reached by (DNS names or IP addresses), for
    /// tools that check host names; Gangway itself checks roles.
    #[arg(long = "host")]
    hosts: Vec<String>,
    #[arg(long, default_value_t = pki::CERT_DAYS_DEFAULT)]
    days: u32,
    /// The directory holding ca.pem and ca-key.pem.
    #[arg(long, default_value = ".")]
    ca_dir: PathBuf,
    /// Where to write the certificate (default: the CA's directory).
    #[arg(long)]
    dir: Option<PathBuf>,
    /// The cluster it is for (its SPIFFE trust domain). Clusters that share a
    /// CA must differ here: each then refuses the other's certificates, step
    /// credentials and (with its name as the token audience) tokens.
    #[arg(long, env = "GANGWAY_CLUSTER", default_value = gangway_proto::tls::DEFAULT_CLUSTER)]
    cluster: String,
}

pub fn run(cmd: TlsCmd) -> anyhow::Result<()> {
    match cmd {
        TlsCmd::Ca(CaCmd::Create { dir, name, days }) => {
            let path = pki::create_ca(&dir, &name, days).map_err(anyhow::Error::msg)?;
            println!("CA written: {} (and ca-key.pem beside it: keep it offline)", path.display());
        }
        TlsCmd::Cert(CertCmd::Create(a)) => {
            let (role, name) = match (a.server, a.agent, a.client) {
                (Some(n), _, _) => (Role::Server, n),
                (_, Some(n), _) => (Role::Agent, n),
                (_, _, Some(n)) => (Role::Client, n),
                _ => bail!("give one of --server, --agent or --client"),
            };
            let principal = Principal::new(role, &name).map_err(|e| anyhow::anyhow!("--{}: {e}", role.as_str()))?;
            let out = a.dir.unwrap_or_else(|| a.ca_dir.clone());
            gangway_proto::tls::check_cluster_name(&a.cluster).map_err(|e| anyhow::anyhow!("--cluster: {e}"))?;
            let req =
                pki::CertRequest { principal, hosts: a.hosts, days: a.days, backdate_days: 0, cluster: a.cluster };
            let (cert, key) = pki::create_cert(&a.ca_dir, &out, &req).map_err(anyhow::Error::msg)?;
            println!("certificate written: {} (key: {})", cert.display(), key.display());
        }
        TlsCmd::Show { file } => {
            let pem = std::fs::read(&file).with_context(|| format!("{}", file.display()))?;
            let der = rustls_pemfile::certs(&mut pem.as_slice())
                .next()
                .with_context(|| format!("{}: no certificate", file.display()))??;
            let (p, cluster, not_after) = gangway_proto::tls::principal_in_cluster(&der).map_err(anyhow::Error::msg)?;
            let now =
                std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_secs() as i64);
            println!("{p}  cluster {cluster}  expires in {} days", (not_after - now) / 86_400);
        }
    }
    Ok(())
}

// ---------------------------------------------------------------- gangway token

#[derive(Subcommand)]
pub enum TokenCmd {
    /// The key tokens are signed with.
    #[command(subcommand)]
    Key(TokenKeyCmd),
    /// Prints a bearer token for a user (like Slurm's `scontrol token`).
    Create {
        /// The user the token names (jobs run as this user).
        #[arg(long)]
        user: String,
        /// How long it is valid: 90s, 30m, 12h, 2d (at most 7d).
        #[arg(long, default_value = "30m")]
        lifetime: String,
        /// The signing key (from `gangway token key create`).
        #[arg(long, default_value = "token-key.pem")]
        key: PathBuf,
        #[arg(long, default_value = gangway_proto::token::DEFAULT_ISSUER)]
        issuer: String,
        /// The cluster it is for (`aud`): controllers accept only tokens for
        /// the cluster their certificate names.
        #[arg(long, env = "GANGWAY_CLUSTER", default_value = gangway_proto::token::DEFAULT_AUDIENCE)]
        audience: String,
    },
}

#[derive(Subcommand)]
pub enum TokenKeyCmd {
    /// Creates DIR/token-key.pem (keep it private) and DIR/token-key.pub.pem
    /// (give it to every controller: --token-public-key).
    Create {
        #[arg(long, default_value = ".")]
        dir: PathBuf,
    },
}

/// `90s`, `30m`, `12h`, `2d`, or plain seconds.
pub fn parse_lifetime(s: &str) -> anyhow::Result<std::time::Duration> {
    let s = s.trim();
    let (num, unit) = match s.char_indices().find(|(_, c)| !c.is_ascii_digit()) {
        Some((i, _)) => (&s[..i], &s[i..]),
        None => (s, "s"),
    };
    let n: u64 = num.parse().map_err(|_| anyhow::anyhow!("lifetime: '{s}' is not like 30m, 12h or 2d"))?;
    let mult = match unit {
        "s" => 1,
        "m" => 60,
        "h" => 3600,
        "d" => 86_400,
        _ => bail!("lifetime: unit '{unit}' is not s, m, h or d"),
    };
    Ok(std::time::Duration::from_secs(n.saturating_mul(mult)))
}

pub fn run_token(cmd: TokenCmd) -> anyhow::Result<()> {
    match cmd {
        TokenCmd::Key(TokenKeyCmd::Create { dir }) => {
            let (private, public) = gangway_proto::token::create_key(&dir).map_err(anyhow::Error::msg)?;
            println!(
                "token key written: {} (private) and {} (give it to the controllers: --token-public-key)",
                private.display(),
                public.display()
            );
        }
        TokenCmd::Create { user, lifetime, key, issuer, audience } => {
            let lifetime = parse_lifetime(&lifetime)?;
            let t =
                gangway_proto::token::create(&key, &user, lifetime, &issuer, &audience).map_err(anyhow::Error::msg)?;
            println!("{t}");
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn lifetimes_read_like_durations() {
        assert_eq!(parse_lifetime("90s").unwrap().as_secs(), 90);
        assert_eq!(parse_lifetime("30m").unwrap().as_secs(), 1800);
        assert_eq!(parse_lifetime("2d").unwrap().as_secs(), 172_800);
        assert_eq!(parse_lifetime("45").unwrap().as_secs(), 45);
        assert!(parse_lifetime("5y").is_err());
        assert!(parse_lifetime("m").is_err());
    }
}
