//! Who a console request comes from, from what was verified only: the
//! browser's client certificate (the TLS handshake checked it against the
//! cluster's CA), else the bearer token in the session cookie (the API's
//! handlers verify it on every call, as for the CLI, so an expired or revoked
//! token stops working at once), else, on an insecure cluster only, the name
//! the browser claims (as the CLI's `--identity` there).
//!
//! Writes must come from the console's own page: a custom header a foreign
//! page cannot send without a CORS preflight (which is never granted), a
//! matching `Origin`, and a `SameSite=Strict` cookie.

use std::net::SocketAddr;

use gangway_proto::tls::{PeerAuth, PeerInfo, Role};
use hyper::header::HeaderMap;

use super::Console;

/// The session cookie over HTTPS: a bearer token on a secure cluster.
/// `__Host-` makes browsers refuse it unless it is `Secure`, for `/` and set
/// by this host (no sibling domain can plant one).
pub const COOKIE_TLS: &str = "__Host-gangway_session";
/// The session cookie over plain HTTP (a claimed name on an insecure
/// cluster, or the dev cluster's loopback).
pub const COOKIE: &str = "gangway_session";
/// The header every write carries (the page's script sets it).
pub const CSRF_HEADER: &str = "x-gangway-csrf";
/// A bearer token's bytes: a signed JWT is well under 2 KiB.
const TOKEN_BYTES_MAX: usize = 8 * 1024;

/// The caller of one console request, as the API's handlers will see it.
#[derive(Clone, Debug)]
pub struct Who {
    pub remote: Option<SocketAddr>,
    pub auth: PeerAuth,
    /// The session's bearer token (a secure cluster, no client certificate).
    pub bearer: Option<String>,
    /// The session's claimed name (an insecure cluster).
    pub claimed: Option<String>,
}

impl Who {
    pub fn of(console: &Console, peer: &PeerInfo, headers: &HeaderMap) -> Result<Who, String> {
        let name = if console.tls { COOKIE_TLS } else { COOKIE };
        let session = cookie(headers, name)?;
        let mut who = Who { remote: peer.remote, auth: PeerAuth::Anonymous, bearer: None, claimed: None };
        if console.replica.security.is_insecure() {
            who.auth = PeerAuth::Insecure;
            who.claimed = session.filter(|n| valid_name(n).is_ok());
            return Ok(who);
        }
        match &peer.auth {
            // A user's certificate in the browser: that user, cookie or not.
            PeerAuth::Verified(p) if p.role == Role::Client => who.auth = peer.auth.clone(),
            // Anything else (no certificate, another role's, plain HTTP on
            // loopback): only the session's token speaks for the caller.
            _ => who.bearer = session.filter(|t| valid_token(t).is_ok()),
        }
        Ok(who)
    }

    /// A caller with no session (logging in or out).
    pub fn nobody(peer: &PeerInfo) -> Who {
        Who { remote: peer.remote, auth: PeerAuth::Anonymous, bearer: None, claimed: None }
    }

    /// Whether the request carries anything that names a caller.
    pub fn named(&self) -> bool {
        self.bearer.is_some() || self.claimed.is_some() || matches!(self.auth, PeerAuth::Verified(_))
    }

    /// A gRPC request from this caller, as the transport would have built it.
    pub fn request<T>(&self, msg: T) -> tonic::Request<T> {
        let mut r = tonic::Request::new(msg);
        r.extensions_mut().insert(PeerInfo { remote: self.remote, auth: self.auth.clone(), activity: None });
        let md = r.metadata_mut();
        // Both were checked to be short printable ASCII (`valid_*`).
        if let Some(Ok(v)) = self.bearer.as_ref().map(|t| format!("Bearer {t}").parse()) {
            md.insert(gangway_proto::token::AUTHORIZATION_METADATA_KEY, v);
        }
        if let Some(Ok(v)) = self.claimed.as_ref().map(|n| n.parse()) {
            md.insert(gangway_proto::IDENTITY_METADATA_KEY, v);
        }
        r
    }
}

/// A cookie's value from the request's `Cookie` headers. Two of that name
/// (one planted for a narrower path or by a sibling domain) are refused
/// rather than one of them guessed at.
pub fn cookie(headers: &HeaderMap, name: &str) -> Result<Option<String>, String> {
    let mut found = headers
        .get_all(hyper::header::COOKIE)
        .iter()
        .filter_map(|v| v.to_str().ok())
        .flat_map(|v| v.split(';'))
        .filter_map(|kv| kv.trim().split_once('='))
        .filter(|(k, _)| *k == name)
        .map(|(_, v)| v.trim().to_string());
    let first = found.next();
    if found.next().is_some() {
        return Err(format!(
            "cookie: more than one {name} (another site or port set one): clear this site's cookies in the browser"
        ));
    }
    Ok(first)
}

/// The `Host` a plain-HTTP request names must be an address or localhost:
/// a page of another site whose name was made to resolve here (DNS
/// rebinding) names its own.
pub fn plain_host(headers: &HeaderMap) -> Result<(), String> {
    let host = headers.get(hyper::header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
    let name = match host.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => host.rsplit_once(':').map_or(host, |(h, _)| h),
    };
    if name.eq_ignore_ascii_case("localhost") || name.parse::<std::net::IpAddr>().is_ok() {
        return Ok(());
    }
    Err(format!(
        "host: {host:?}: over plain HTTP the console answers only to an address or localhost; \
         serve it over HTTPS (a TLS cluster's --ui-listen) to use a name"
    ))
}

/// A bearer token as it may travel in a cookie and in gRPC metadata.
pub fn valid_token(t: &str) -> Result<(), String> {
    if t.is_empty() || t.len() > TOKEN_BYTES_MAX {
        return Err(format!("token: must be 1 to {TOKEN_BYTES_MAX} bytes"));
    }
    if !t.bytes().all(|b| b.is_ascii_alphanumeric() || matches!(b, b'.' | b'-' | b'_')) {
        return Err("token: must be a JWT (letters, digits, '.', '-', '_')".into());
    }
    Ok(())
}

/// A name an insecure cluster's caller may claim.
pub fn valid_name(n: &str) -> Result<(), String> {
    gangway_proto::tls::check_principal_name(n).map_err(|e| format!("user: {e}"))
}

/// The session cookie that holds `value`.
pub fn set_cookie(value: &str, tls: bool) -> String {
    match tls {
        true => format!("{COOKIE_TLS}={value}; Path=/; HttpOnly; SameSite=Strict; Secure"),
        false => format!("{COOKIE}={value}; Path=/; HttpOnly; SameSite=Strict"),
    }
}

/// The cookie that ends the session.
pub fn clear_cookie(tls: bool) -> String {
    match tls {
        true => format!("{COOKIE_TLS}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0; Secure"),
        false => format!("{COOKIE}=; Path=/; HttpOnly; SameSite=Strict; Max-Age=0"),
    }
}

/// A write comes from the console's own page: it carries the header only
/// the page's script sets, and a browser that names its origin names ours.
pub fn same_origin(headers: &HeaderMap) -> Result<(), String> {
    if headers.get(CSRF_HEADER).and_then(|v| v.to_str().ok()) != Some("1") {
        return Err(format!("{CSRF_HEADER}: writes must come from the console's page (header missing)"));
    }
    if let Some(site) = headers.get("sec-fetch-site").and_then(|v| v.to_str().ok()) {
        if site != "same-origin" {
            return Err(format!("sec-fetch-site: {site}: writes must come from the console's page"));
        }
    }
    if let Some(origin) = headers.get(hyper::header::ORIGIN) {
        let host = headers.get(hyper::header::HOST).and_then(|v| v.to_str().ok()).unwrap_or("");
        let origin = origin.to_str().unwrap_or("");
        let origin_host = origin.split_once("://").map_or("", |(_, h)| h);
        if host.is_empty() || origin_host != host {
            return Err(format!("origin: {origin} is not this console's ({host})"));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn headers(pairs: &[(&'static str, &str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.append(*k, v.parse().unwrap());
        }
        h
    }

    #[test]
    fn writes_need_the_page_header_and_our_origin() {
        let ok = headers(&[("x-gangway-csrf", "1"), ("host", "c1:8080"), ("origin", "https://c1:8080")]);
        assert!(same_origin(&ok).is_ok());
        let no_header = headers(&[("host", "c1:8080"), ("origin", "https://c1:8080")]);
        assert!(same_origin(&no_header).unwrap_err().contains("x-gangway-csrf"));
        let foreign = headers(&[("x-gangway-csrf", "1"), ("host", "c1:8080"), ("origin", "https://evil.example")]);
        assert!(same_origin(&foreign).unwrap_err().contains("origin"));
        let cross = headers(&[("x-gangway-csrf", "1"), ("sec-fetch-site", "cross-site")]);
        assert!(same_origin(&cross).unwrap_err().contains("sec-fetch-site"));
    }

    #[test]
    fn cookies_and_tokens_are_read_strictly() {
        let h = headers(&[("cookie", "a=b; gangway_session=abc.def-_1"), ("cookie", "c=d")]);
        assert_eq!(cookie(&h, COOKIE).unwrap().as_deref(), Some("abc.def-_1"));
        assert_eq!(cookie(&h, "c").unwrap().as_deref(), Some("d"));
        // A second one, planted for a narrower path: refused, not guessed at.
        let tossed = headers(&[("cookie", "gangway_session=planted; gangway_session=mine")]);
        assert!(cookie(&tossed, COOKIE).unwrap_err().contains("more than one"));
        assert!(valid_token("abc.def").is_ok());
        assert!(valid_token("abc def").is_err());
        assert!(valid_token("a\r\nx-gangway-forwarded-for: server:1").is_err());
        assert!(valid_token(&"a".repeat(TOKEN_BYTES_MAX + 1)).is_err());
        assert!(valid_name("alice").is_ok());
        assert!(valid_name("").is_err());
        assert!(
            set_cookie("t", true).starts_with("__Host-gangway_session=t; Path=/; HttpOnly; SameSite=Strict; Secure")
        );
    }

    #[test]
    fn plain_http_answers_only_to_addresses_and_localhost() {
        for ok in ["127.0.0.1:8080", "localhost:8080", "[::1]:8080", "10.0.0.5", "LOCALHOST"] {
            assert!(plain_host(&headers(&[("host", ok)])).is_ok(), "{ok}");
        }
        for bad in ["evil.example:8080", "evil.example", "127.0.0.1.nip.io:8080", ""] {
            assert!(plain_host(&headers(&[("host", bad)])).is_err(), "{bad}");
        }
    }
}
