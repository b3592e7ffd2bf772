//! Bearer tokens: a JWT that names a user, for callers without a client
//! certificate (scripts, CI, web front ends), like Slurm's `scontrol token`.
//!
//! A token is accepted only when it is signed by a key the controllers were
//! given (`--token-public-key` PEM files: ES256, EdDSA or RS256; or a JWKS file
//! from a site's OIDC issuer), with exactly the algorithm of that key (so
//! `alg: none` and HS/RS confusion are refused), the configured issuer and
//! audience, a `sub` that is a valid user name, an `exp` in the future, and a
//! `jti` not in the revocation file (with a revocation file configured, a
//! token must carry a `jti`: one without could never be revoked; deleting
//! the file keeps the last list). It travels as `authorization: Bearer
//! TOKEN` over TLS.
//!
//! The key files and the JWKS file are read again within a second of
//! changing (an issuer's key rotation, a new PEM put in place): a change that
//! does not load (a half-written file) keeps the keys trusted until then and
//! logs why; a file that is gone takes its keys with it (with every file
//! gone, no token is accepted).

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant, SystemTime};

use jsonwebtoken::{Algorithm, DecodingKey, EncodingKey, Header, Validation};
use serde::{Deserialize, Serialize};

use crate::tls::{check_principal_name, Principal, Role};

/// The gRPC metadata key tokens travel in.
pub const AUTHORIZATION_METADATA_KEY: &str = "authorization";
/// Longest token accepted: OIDC tokens with many claims are a few kilobytes.
pub const TOKEN_BYTES_MAX: usize = 8 * 1024;
/// Longest lifetime `gangway token create` issues: a week. Long-lived
/// credentials are certificates.
pub const LIFETIME_MAX: Duration = Duration::from_secs(7 * 24 * 3600);
/// The issuer and audience of tokens this cluster makes (and expects by default).
pub const DEFAULT_ISSUER: &str = "gangway";
pub const DEFAULT_AUDIENCE: &str = "gangway";
/// Clock skew tolerated on `exp` and `nbf`.
const LEEWAY_S: u64 = 30;
/// Keys a cluster trusts at once (key rotation keeps a few; a JWKS has a few).
const KEYS_MAX: usize = 64;
/// Revoked token ids kept; a site past this rotates its signing key instead.
const REVOKED_MAX: usize = 100_000;
/// How often the revocation file is checked for changes.
const REVOKED_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// How often the key and JWKS files are checked for changes: a stat per
/// file per second, and a rotation is trusted within a second.
const KEYS_CHECK_INTERVAL: Duration = Duration::from_secs(1);
/// Largest key, JWKS or revocation file read.
const FILE_BYTES_MAX: u64 = 4 * 1024 * 1024;

#[derive(Debug, Serialize, Deserialize)]
struct Claims {
    sub: String,
    iss: String,
    aud: String,
    exp: u64,
    iat: u64,
    #[serde(default, skip_serializing_if = "String::is_empty")]
    jti: String,
}

/// What the controllers read from a verified token (exp, nbf, iss and aud are
/// checked by the validation itself, `aud` as one string or a list).
#[derive(Debug, Deserialize)]
struct Verified {
    sub: String,
    #[serde(default)]
    jti: String,
}

fn now_s() -> u64 {
    SystemTime::now().duration_since(SystemTime::UNIX_EPOCH).map_or(0, |d| d.as_secs())
}

fn read_limited(path: &Path, what: &str) -> Result<Vec<u8>, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("{what} {}: {e}", path.display()))?;
    if meta.len() > FILE_BYTES_MAX {
        return Err(format!("{what} {}: larger than {FILE_BYTES_MAX} bytes", path.display()));
    }
    std::fs::read(path).map_err(|e| format!("{what} {}: {e}", path.display()))
}

/// Creates a token signing key: `DIR/token-key.pem` (private, 0600, for
/// `gangway token create`) and `DIR/token-key.pub.pem` (for the controllers'
/// `--token-public-key`).
pub fn create_key(dir: &Path) -> Result<(PathBuf, PathBuf), String> {
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    let private = dir.join("token-key.pem");
    let public = dir.join("token-key.pub.pem");
    if private.exists() || public.exists() {
        return Err(format!("{} already holds a token key; not overwriting it", dir.display()));
    }
    let key = rcgen::KeyPair::generate().map_err(|e| e.to_string())?;
    crate::pki::write_private(&private, &key.serialize_pem())?;
    crate::pki::write_private(&public, &key.public_key_pem())?;
    Ok((private, public))
}

/// Signs a token for `user`, valid for `lifetime`, with the ES256 key in `key_pem`.
pub fn create(key_pem: &Path, user: &str, lifetime: Duration, issuer: &str, audience: &str) -> Result<String, String> {
    check_principal_name(user).map_err(|e| format!("user: {e}"))?;
    if lifetime.is_zero() || lifetime > LIFETIME_MAX {
        return Err(format!("lifetime: must be between 1 s and {} h", LIFETIME_MAX.as_secs() / 3600));
    }
    let pem = read_limited(key_pem, "token key")?;
    let key = EncodingKey::from_ec_pem(&pem).map_err(|e| format!("token key {}: {e}", key_pem.display()))?;
    let now = now_s();
    let claims = Claims {
        sub: user.to_string(),
        iss: issuer.to_string(),
        aud: audience.to_string(),
        iat: now,
        exp: now.saturating_add(lifetime.as_secs()),
        jti: uuid::Uuid::new_v4().to_string(),
    };
    jsonwebtoken::encode(&Header::new(Algorithm::ES256), &claims, &key).map_err(|e| e.to_string())
}

/// The `sub` a token claims, unverified: only for showing the caller who it
/// says it is (the controllers verify it).
pub fn peek_subject(token: &str) -> Option<String> {
    let mut v = Validation::new(Algorithm::ES256);
    v.insecure_disable_signature_validation();
    v.validate_aud = false;
    v.validate_exp = false;
    v.required_spec_claims.clear();
    let header = jsonwebtoken::decode_header(token).ok()?;
    v.algorithms = vec![header.alg];
    jsonwebtoken::decode::<Claims>(token, &DecodingKey::from_secret(b""), &v).ok().map(|d| d.claims.sub)
}

/// A key that verifies tokens, with the one algorithm it is used with.
struct TrustedKey {
    kid: Option<String>,
    alg: Algorithm,
    key: DecodingKey,
}

/// The revoked token ids, from a file of one `jti` per line (`#` comments),
/// read again when it changes.
struct Revoked {
    path: Option<PathBuf>,
    ids: std::collections::BTreeSet<String>,
    stamp: Option<(SystemTime, u64)>,
    last_check: Instant,
}

impl Revoked {
    fn stamp(path: &Path) -> Option<(SystemTime, u64)> {
        std::fs::metadata(path).ok().and_then(|m| Some((m.modified().ok()?, m.len())))
    }

    fn read(path: &Path) -> Result<std::collections::BTreeSet<String>, String> {
        let text = match read_limited(path, "revocation file") {
            Ok(t) => t,
            // No file yet: nothing is revoked.
            Err(_) if !path.exists() => return Ok(Default::default()),
            Err(e) => return Err(e),
        };
        let text = String::from_utf8(text).map_err(|_| format!("revocation file {}: not UTF-8", path.display()))?;
        let ids: std::collections::BTreeSet<String> = text
            .lines()
            .map(|l| l.split('#').next().unwrap_or("").trim())
            .filter(|l| !l.is_empty())
            .map(String::from)
            .collect();
        if ids.len() > REVOKED_MAX {
            return Err(format!("revocation file {}: more than {REVOKED_MAX} ids", path.display()));
        }
        Ok(ids)
    }

    /// Whether `jti` is revoked, reading the file again (at most once per
    /// REVOKED_CHECK_INTERVAL) when it changed. The file is read outside
    /// the lock; a file that cannot be read, or is gone, keeps the last
    /// list (deleting the file never un-revokes a token).
    fn contains(revoked: &Mutex<Revoked>, jti: &str) -> bool {
        let due = {
            let mut r = revoked.lock().expect("revoked lock");
            match r.path.clone() {
                Some(path) if r.last_check.elapsed() >= REVOKED_CHECK_INTERVAL => {
                    r.last_check = Instant::now();
                    Some((path, r.stamp))
                }
                _ => None,
            }
        };
        if let Some((path, seen)) = due {
            let stamp = Revoked::stamp(&path);
            let read = match stamp {
                _ if stamp == seen => None,
                None => {
                    tracing::warn!(path = %path.display(), "the revocation file is gone; keeping the last list");
                    None
                }
                Some(_) => match Revoked::read(&path) {
                    Ok(ids) => Some(ids),
                    Err(e) => {
                        tracing::warn!(error = %e, "keeping the previous revocation list");
                        None
                    }
                },
            };
            if let Some(ids) = read {
                let mut r = revoked.lock().expect("revoked lock");
                r.ids = ids;
                r.stamp = stamp;
            }
        }
        revoked.lock().expect("revoked lock").ids.contains(jti)
    }
}

/// The keys trusted now, and the files they were read from as they were.
struct KeySet {
    keys: Arc<Vec<TrustedKey>>,
    stamp: Vec<Option<(SystemTime, u64)>>,
    last_check: Instant,
}

/// What the controllers trust tokens from.
pub struct TokenVerifier {
    config: TokenConfig,
    keys: Mutex<KeySet>,
    issuer: String,
    audience: String,
    revoked: Mutex<Revoked>,
    /// A revocation file is configured: a token without a `jti` (which no
    /// revocation could name) is refused.
    revocable: bool,
}

impl std::fmt::Debug for TokenVerifier {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TokenVerifier").field("config", &self.config).field("issuer", &self.issuer).finish()
    }
}

/// Where the controllers' token settings come from (flags).
#[derive(Debug, Clone, Default)]
pub struct TokenConfig {
    pub public_keys: Vec<PathBuf>,
    pub jwks: Option<PathBuf>,
    pub issuer: Option<String>,
    pub audience: Option<String>,
    pub revoked: Option<PathBuf>,
}

fn key_from_pem(pem: &[u8], label: &str) -> Result<TrustedKey, String> {
    if let Ok(key) = DecodingKey::from_ec_pem(pem) {
        return Ok(TrustedKey { kid: None, alg: Algorithm::ES256, key });
    }
    if let Ok(key) = DecodingKey::from_ed_pem(pem) {
        return Ok(TrustedKey { kid: None, alg: Algorithm::EdDSA, key });
    }
    if let Ok(key) = DecodingKey::from_rsa_pem(pem) {
        return Ok(TrustedKey { kid: None, alg: Algorithm::RS256, key });
    }
    Err(format!("token public key {label}: not an EC P-256, Ed25519 or RSA public key in PEM"))
}

/// The key and JWKS files of `config`, as they are now (modification time
/// and length; `None` for one that is gone).
fn key_stamps(config: &TokenConfig) -> Vec<Option<(SystemTime, u64)>> {
    config.public_keys.iter().chain(config.jwks.as_ref()).map(|p| Revoked::stamp(p)).collect()
}

/// Every key of `config`'s files.
fn load_keys(config: &TokenConfig) -> Result<Vec<TrustedKey>, String> {
    let mut keys = Vec::new();
    for p in &config.public_keys {
        keys.push(key_from_pem(&read_limited(p, "token public key")?, &p.display().to_string())?);
    }
    if let Some(p) = &config.jwks {
        let text = read_limited(p, "JWKS")?;
        let set: jsonwebtoken::jwk::JwkSet =
            serde_json::from_slice(&text).map_err(|e| format!("JWKS {}: {e}", p.display()))?;
        for jwk in &set.keys {
            // An issuer's set also holds encryption keys: not ours to use.
            if matches!(jwk.common.public_key_use, Some(jsonwebtoken::jwk::PublicKeyUse::Encryption)) {
                continue;
            }
            let alg = match (&jwk.common.key_algorithm, &jwk.algorithm) {
                (Some(a), _) => match alg_from_name(&format!("{a:?}")) {
                    Ok(a) => a,
                    Err(e) => {
                        tracing::warn!(kid = ?jwk.common.key_id, error = %e, "JWKS: skipping a key");
                        continue;
                    }
                },
                (None, jsonwebtoken::jwk::AlgorithmParameters::EllipticCurve(_)) => Algorithm::ES256,
                (None, jsonwebtoken::jwk::AlgorithmParameters::OctetKeyPair(_)) => Algorithm::EdDSA,
                (None, jsonwebtoken::jwk::AlgorithmParameters::RSA(_)) => Algorithm::RS256,
                // Shared secrets are refused: the controllers verify,
                // they must never be able to mint.
                (None, jsonwebtoken::jwk::AlgorithmParameters::OctetKey(_)) => {
                    return Err(format!("JWKS {}: symmetric keys are not accepted", p.display()))
                }
            };
            if matches!(alg, Algorithm::HS256 | Algorithm::HS384 | Algorithm::HS512) {
                return Err(format!("JWKS {}: HMAC algorithms are not accepted", p.display()));
            }
            let key = DecodingKey::from_jwk(jwk).map_err(|e| format!("JWKS {}: {e}", p.display()))?;
            keys.push(TrustedKey { kid: jwk.common.key_id.clone(), alg, key });
        }
    }
    if keys.len() > KEYS_MAX {
        return Err(format!("token keys: at most {KEYS_MAX}"));
    }
    Ok(keys)
}

impl TokenVerifier {
    /// `None` when no key is configured (tokens are then refused).
    pub fn load(config: &TokenConfig) -> Result<Option<Arc<TokenVerifier>>, String> {
        let stamp = key_stamps(config);
        let keys = load_keys(config)?;
        if keys.is_empty() {
            return Ok(None);
        }
        let revoked_ids = match &config.revoked {
            Some(p) => {
                if !p.exists() {
                    tracing::warn!(path = %p.display(), "the revocation file does not exist: nothing is revoked yet");
                }
                Revoked::read(p)?
            }
            None => Default::default(),
        };
        let revoked = Revoked {
            stamp: config.revoked.as_deref().and_then(Revoked::stamp),
            path: config.revoked.clone(),
            ids: revoked_ids,
            last_check: Instant::now(),
        };
        Ok(Some(Arc::new(TokenVerifier {
            config: config.clone(),
            keys: Mutex::new(KeySet { keys: Arc::new(keys), stamp, last_check: Instant::now() }),
            issuer: config.issuer.clone().unwrap_or_else(|| DEFAULT_ISSUER.into()),
            audience: config.audience.clone().unwrap_or_else(|| DEFAULT_AUDIENCE.into()),
            revocable: config.revoked.is_some(),
            revoked: Mutex::new(revoked),
        })))
    }

    /// The keys trusted now: read again (outside the lock, at most once per
    /// KEYS_CHECK_INTERVAL) when a key or JWKS file changed. A change that
    /// does not load keeps the previous keys.
    fn keys(&self) -> Arc<Vec<TrustedKey>> {
        let due = {
            let mut k = self.keys.lock().expect("token keys lock");
            if k.last_check.elapsed() >= KEYS_CHECK_INTERVAL {
                k.last_check = Instant::now();
                Some(k.stamp.clone())
            } else {
                None
            }
        };
        if let Some(seen) = due {
            let stamp = key_stamps(&self.config);
            if stamp != seen {
                // A file that is gone takes its keys with it (deleting a
                // compromised key's file must not leave it trusted); one
                // that does not load keeps the keys of before.
                let mut present = self.config.clone();
                present.public_keys.retain(|p| p.exists());
                present.jwks = present.jwks.filter(|p| p.exists());
                if present.public_keys.len() < self.config.public_keys.len() || present.jwks != self.config.jwks {
                    tracing::error!("a token key or JWKS file is gone: its keys are no longer trusted");
                }
                let loaded = load_keys(&present);
                match loaded {
                    Ok(keys) => {
                        tracing::info!(keys = keys.len(), "token keys reloaded");
                        let mut k = self.keys.lock().expect("token keys lock");
                        k.keys = Arc::new(keys);
                        k.stamp = stamp;
                    }
                    Err(e) => tracing::warn!(error = %e, "token key files changed; keeping the keys trusted until now"),
                }
            }
        }
        self.keys.lock().expect("token keys lock").keys.clone()
    }

    /// The user a token names, or why it is refused.
    pub fn verify(&self, token: &str) -> Result<Principal, String> {
        if token.len() > TOKEN_BYTES_MAX {
            return Err(format!("the token is longer than {TOKEN_BYTES_MAX} bytes"));
        }
        let header = jsonwebtoken::decode_header(token).map_err(|e| format!("the token does not parse: {e}"))?;
        let mut last = String::from("no trusted key matches the token");
        let keys = self.keys();
        for k in keys.iter() {
            if header.kid.is_some() && k.kid.is_some() && header.kid != k.kid {
                continue;
            }
            if header.alg != k.alg {
                last = format!("the token's algorithm {:?} is not the key's ({:?})", header.alg, k.alg);
                continue;
            }
            let mut v = Validation::new(k.alg);
            v.set_issuer(&[&self.issuer]);
            v.set_audience(&[&self.audience]);
            v.set_required_spec_claims(&["exp", "iss", "aud", "sub"]);
            v.validate_nbf = true;
            v.leeway = LEEWAY_S;
            match jsonwebtoken::decode::<Verified>(token, &k.key, &v) {
                Ok(data) => {
                    let c = data.claims;
                    // One the file could not name (blank, spaced, or with the
                    // file's comment sign) could never be revoked either.
                    let listable = !c.jti.is_empty() && c.jti.trim() == c.jti && !c.jti.contains(['#', '\n', '\r']);
                    if self.revocable && !listable {
                        return Err("the token's jti is missing or cannot be listed in a revocation file: with one \
                                    configured, only tokens that can be revoked are taken"
                            .into());
                    }
                    if !c.jti.is_empty() && Revoked::contains(&self.revoked, &c.jti) {
                        return Err("the token was revoked".into());
                    }
                    return Principal::new(Role::Client, &c.sub).map_err(|e| format!("the token's sub: {e}"));
                }
                Err(e) => last = format!("the token is not valid: {e}"),
            }
        }
        Err(last)
    }
}

/// A JWK's `alg` as a JWT algorithm.
fn alg_from_name(s: &str) -> Result<Algorithm, String> {
    use std::str::FromStr;
    Algorithm::from_str(s).map_err(|_| format!("JWKS: unsupported algorithm {s}"))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn b64(s: &[u8]) -> String {
        // base64url without padding, enough for forging test tokens.
        const T: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789-_";
        let mut out = String::new();
        for chunk in s.chunks(3) {
            let b = [chunk[0], *chunk.get(1).unwrap_or(&0), *chunk.get(2).unwrap_or(&0)];
            let n = (u32::from(b[0]) << 16) | (u32::from(b[1]) << 8) | u32::from(b[2]);
            for i in 0..=chunk.len() {
                out.push(T[(n >> (18 - 6 * i)) as usize & 63] as char);
            }
        }
        out
    }

    /// A rotated key file is trusted within a check: the new key's tokens
    /// pass and the old key's do not; a file that does not load keeps the
    /// keys trusted until then; a file that is gone takes its keys along.
    #[test]
    fn rotated_key_files_are_read_again() {
        let dir = std::env::temp_dir().join(format!("gangway-token-rotate-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (old_private, old_public) = create_key(&dir.join("old")).unwrap();
        let (new_private, new_public) = create_key(&dir.join("new")).unwrap();
        let trusted = dir.join("trusted.pub.pem");
        std::fs::copy(&old_public, &trusted).unwrap();
        let v = TokenVerifier::load(&TokenConfig { public_keys: vec![trusted.clone()], ..Default::default() })
            .unwrap()
            .unwrap();
        let token =
            |key: &Path| create(key, "alice", Duration::from_secs(600), DEFAULT_ISSUER, DEFAULT_AUDIENCE).unwrap();
        let (old, new) = (token(&old_private), token(&new_private));
        assert!(v.verify(&old).is_ok());
        assert!(v.verify(&new).is_err());
        let check_now = || v.keys.lock().unwrap().last_check -= KEYS_CHECK_INTERVAL;
        // Not before the check is due.
        std::fs::copy(&new_public, &trusted).unwrap();
        assert!(v.verify(&new).is_err(), "read again before KEYS_CHECK_INTERVAL");
        check_now();
        assert!(v.verify(&new).is_ok(), "the rotated key is not trusted");
        assert!(v.verify(&old).is_err(), "the replaced key is still trusted");
        // Half written, then gone: the rotated key stays trusted.
        std::fs::write(&trusted, "-----BEGIN PUBLIC KEY-----\nhalf").unwrap();
        check_now();
        assert!(v.verify(&new).is_ok());
        std::fs::remove_file(&trusted).unwrap();
        check_now();
        assert!(v.verify(&new).is_err(), "a deleted key file's key is still trusted");
        std::fs::copy(&new_public, &trusted).unwrap();
        check_now();
        assert!(v.verify(&new).is_ok(), "a key file put back is not trusted again");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A token of TOKEN_BYTES_MAX bytes is read (and found not to parse);
    /// one byte more is refused unread, naming the limit.
    #[test]
    fn tokens_are_at_most_token_bytes_max() {
        let dir = std::env::temp_dir().join(format!("gangway-token-max-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (_, public) = create_key(&dir).unwrap();
        let config = TokenConfig { public_keys: vec![public], ..Default::default() };
        let v = TokenVerifier::load(&config).unwrap().unwrap();
        let at = "a".repeat(TOKEN_BYTES_MAX);
        assert!(v.verify(&at).unwrap_err().starts_with("the token does not parse"));
        let past = "a".repeat(TOKEN_BYTES_MAX + 1);
        assert_eq!(v.verify(&past).unwrap_err(), format!("the token is longer than {TOKEN_BYTES_MAX} bytes"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn only_well_signed_unexpired_unrevoked_tokens_name_a_user() {
        let dir = std::env::temp_dir().join(format!("gangway-token-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let (private, public) = create_key(&dir).unwrap();
        let revoked = dir.join("revoked");
        let config =
            TokenConfig { public_keys: vec![public.clone()], revoked: Some(revoked.clone()), ..Default::default() };
        let v = TokenVerifier::load(&config).unwrap().unwrap();
        let good = create(&private, "alice", Duration::from_secs(600), DEFAULT_ISSUER, DEFAULT_AUDIENCE).unwrap();
        assert_eq!(v.verify(&good).unwrap(), Principal::new(Role::Client, "alice").unwrap());
        // Tampered: another user in the payload, the same signature.
        let parts: Vec<&str> = good.split('.').collect();
        let claims = format!(r#"{{"sub":"root","iss":"gangway","aud":"gangway","exp":{},"iat":0}}"#, now_s() + 600);
        let tampered = format!("{}.{}.{}", parts[0], b64(claims.as_bytes()), parts[2]);
        assert!(v.verify(&tampered).is_err());
        // alg: none, unsigned.
        let none = format!("{}.{}.", b64(br#"{"alg":"none","typ":"JWT"}"#), b64(claims.as_bytes()));
        assert!(v.verify(&none).is_err());
        // HS256 "signed" with the public key as the secret (key confusion).
        let pem = std::fs::read(&public).unwrap();
        let hs = jsonwebtoken::encode(
            &Header::new(Algorithm::HS256),
            &Claims {
                sub: "root".into(),
                iss: "gangway".into(),
                aud: "gangway".into(),
                exp: now_s() + 600,
                iat: 0,
                jti: String::new(),
            },
            &EncodingKey::from_secret(&pem),
        )
        .unwrap();
        assert!(v.verify(&hs).unwrap_err().contains("algorithm"));
        // Wrong issuer or audience; expired.
        let wrong_iss = create(&private, "alice", Duration::from_secs(600), "someone-else", DEFAULT_AUDIENCE).unwrap();
        assert!(v.verify(&wrong_iss).is_err());
        let wrong_aud = create(&private, "alice", Duration::from_secs(600), DEFAULT_ISSUER, "other").unwrap();
        assert!(v.verify(&wrong_aud).is_err());
        let key = EncodingKey::from_ec_pem(&std::fs::read(&private).unwrap()).unwrap();
        let old = Claims {
            sub: "alice".into(),
            iss: "gangway".into(),
            aud: "gangway".into(),
            exp: now_s() - 3600,
            iat: 0,
            jti: "x".into(),
        };
        let expired = jsonwebtoken::encode(&Header::new(Algorithm::ES256), &old, &key).unwrap();
        assert!(v.verify(&expired).unwrap_err().contains("xpired"));
        // OIDC issuers' forms: `aud` as a list, no `iat`; a future `nbf` is refused.
        let oidc = serde_json::json!({
            "sub": "alice", "iss": "gangway", "aud": ["other", "gangway"], "exp": now_s() + 600, "jti": "o-1"
        });
        let oidc = jsonwebtoken::encode(&Header::new(Algorithm::ES256), &oidc, &key).unwrap();
        assert_eq!(v.verify(&oidc).unwrap().name, "alice");
        // Without a jti: taken where no revocation file is configured, and
        // refused where one is (no revocation could name it).
        let anonymous = serde_json::json!({"sub": "alice", "iss": "gangway", "aud": "gangway", "exp": now_s() + 600});
        let anonymous = jsonwebtoken::encode(&Header::new(Algorithm::ES256), &anonymous, &key).unwrap();
        assert!(v.verify(&anonymous).unwrap_err().starts_with("the token's jti is missing"));
        for unlistable in [" ", "a b ", "x#y"] {
            let t = serde_json::json!({"sub": "alice", "iss": "gangway", "aud": "gangway", "exp": now_s() + 600, "jti": unlistable});
            let t = jsonwebtoken::encode(&Header::new(Algorithm::ES256), &t, &key).unwrap();
            assert!(v.verify(&t).unwrap_err().starts_with("the token's jti is missing"), "{unlistable:?}");
        }
        let unrevocable = TokenConfig { public_keys: vec![public.clone()], ..Default::default() };
        let unrevocable = TokenVerifier::load(&unrevocable).unwrap().unwrap();
        assert_eq!(unrevocable.verify(&anonymous).unwrap().name, "alice");
        let early = serde_json::json!({"sub": "alice", "iss": "gangway", "aud": "gangway", "exp": now_s() + 600, "nbf": now_s() + 300});
        let early = jsonwebtoken::encode(&Header::new(Algorithm::ES256), &early, &key).unwrap();
        assert!(v.verify(&early).is_err());
        // Revoked by its id.
        let mut peek = Validation::new(Algorithm::ES256);
        peek.insecure_disable_signature_validation();
        peek.set_audience(&[DEFAULT_AUDIENCE]);
        let jti = jsonwebtoken::decode::<Claims>(&good, &DecodingKey::from_secret(b""), &peek).unwrap().claims.jti;
        std::fs::write(&revoked, format!("# revoked\n{jti}\n")).unwrap();
        std::thread::sleep(REVOKED_CHECK_INTERVAL + Duration::from_millis(50));
        assert_eq!(v.verify(&good).unwrap_err(), "the token was revoked");
        // Deleting the file un-revokes nothing; a new file is read again.
        std::fs::remove_file(&revoked).unwrap();
        std::thread::sleep(REVOKED_CHECK_INTERVAL + Duration::from_millis(50));
        assert_eq!(v.verify(&good).unwrap_err(), "the token was revoked", "a deleted file cleared the list");
        std::fs::write(&revoked, "# nothing revoked\n").unwrap();
        std::thread::sleep(REVOKED_CHECK_INTERVAL + Duration::from_millis(50));
        assert_eq!(v.verify(&good).unwrap().name, "alice");
        // Bad users and lifetimes are refused at creation.
        assert!(create(&private, "../root", Duration::from_secs(60), "gangway", "gangway").is_err());
        assert!(create(&private, "alice", LIFETIME_MAX * 2, "gangway", "gangway").is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A scratch directory of this test's own, removed first.
    fn scratch(what: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("gangway-token-{what}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }

    /// KEYS_MAX trusted keys load; one more is refused.
    #[test]
    fn at_most_keys_max_keys_are_trusted() {
        let dir = scratch("keys");
        let (_, public) = create_key(&dir).unwrap();
        let config = |n| TokenConfig { public_keys: vec![public.clone(); n], ..Default::default() };
        assert_eq!(TokenVerifier::load(&config(KEYS_MAX)).unwrap().unwrap().keys().len(), KEYS_MAX);
        let err = TokenVerifier::load(&config(KEYS_MAX + 1)).unwrap_err();
        assert_eq!(err, format!("token keys: at most {KEYS_MAX}"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A revocation file of REVOKED_MAX ids is read; one more id is refused,
    /// and the verifier then refuses to load.
    #[test]
    fn at_most_revoked_max_ids_are_kept() {
        let dir = scratch("revoked");
        let (_, public) = create_key(&dir).unwrap();
        let path = dir.join("revoked");
        let ids: String = (0..REVOKED_MAX).map(|i| format!("r{i}\n")).collect();
        std::fs::write(&path, &ids).unwrap();
        assert_eq!(Revoked::read(&path).unwrap().len(), REVOKED_MAX);
        std::fs::write(&path, format!("{ids}r{REVOKED_MAX}\n")).unwrap();
        let err = Revoked::read(&path).unwrap_err();
        assert!(err.contains(&format!("more than {REVOKED_MAX} ids")), "{err}");
        let config = TokenConfig { public_keys: vec![public], revoked: Some(path), ..Default::default() };
        assert!(TokenVerifier::load(&config).unwrap_err().contains("revocation file"));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    /// A file of FILE_BYTES_MAX bytes is read; one byte more is refused unread.
    #[test]
    fn files_are_read_up_to_file_bytes_max() {
        let dir = scratch("file-bytes");
        let path = dir.join("revoked");
        let max = usize::try_from(FILE_BYTES_MAX).unwrap();
        let text = format!("r1\n#{}", "x".repeat(max - 4));
        assert_eq!(text.len(), max);
        std::fs::write(&path, &text).unwrap();
        assert_eq!(Revoked::read(&path).unwrap().into_iter().collect::<Vec<_>>(), ["r1"]);
        std::fs::write(&path, format!("{text}x")).unwrap();
        let err = Revoked::read(&path).unwrap_err();
        assert!(
            err.starts_with("revocation file") && err.contains(&format!("larger than {FILE_BYTES_MAX} bytes")),
            "{err}"
        );
        assert!(read_limited(&path, "token public key").unwrap_err().contains("larger than"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
