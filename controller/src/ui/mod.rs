//! The web console (`/ui`), served by every replica on its own listener: a
//! page and its script and style, embedded in the binary (no build step, no
//! internet), and a small JSON and server-sent-events API under `/ui/api/`.
//!
//! The console has no powers of its own. Every call it makes is the gRPC
//! API's handler, called in-process with a request whose caller is built here
//! from what was verified and nothing else ([`session::Who`]): the browser's
//! client certificate, or the bearer token its session cookie holds (checked
//! by the handler exactly as for the CLI), or on an insecure cluster its
//! claimed name. So the console shows and changes exactly what the CLI would
//! for the same user, follower forwarding and audit included.
//!
//! This module is the HTTP shell (connections, limits, routing, headers);
//! `api.rs` turns requests into API calls and answers into JSON; `session.rs`
//! decides who the caller is.

mod api;
mod session;

use std::convert::Infallible;
use std::net::IpAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use bytes::Bytes;
use http_body_util::combinators::BoxBody;
use http_body_util::{BodyExt, Full};
use hyper::{Method, StatusCode};
use tokio::net::TcpListener;
use tokio_stream::StreamExt;

use crate::shared::Replica;

/// Connections served at once; more are closed (a console is a handful of
/// tabs per person, each one event stream and a few short requests).
const CONNECTIONS_MAX: usize = 256;
/// Connections one address may hold, so one client cannot take every slot.
const CONNECTIONS_PER_PEER_MAX: usize = 32;
/// A request's head (line and headers) arrives within this; a kept-alive
/// connection idle this long is closed.
const HEADER_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A request's body arrives within this (it is at most a few KiB).
const BODY_READ_TIMEOUT: Duration = Duration::from_secs(10);
/// A connection is closed after this, whatever it does, so a client that
/// stops reading cannot hold its slot for good. An event stream's browser
/// reconnects by itself and the page reloads what it shows.
const CONNECTION_LIFETIME_MAX: Duration = Duration::from_secs(15 * 60);
/// Bytes of a request head: a browser's is a few KiB, its cookie a token.
const REQUEST_HEAD_BYTES_MAX: usize = 32 * 1024;
/// Bytes of a request body: a login's token or a confirmation, nothing more.
const REQUEST_BODY_BYTES_MAX: usize = 16 * 1024;

/// How the console's listener speaks: HTTPS with the replica's certificate
/// (browsers may present a client certificate of the cluster's CA), or plain
/// HTTP (an insecure cluster, or the dev cluster on loopback).
pub enum Transport {
    Tls(gangway_proto::tls::Security),
    Plain,
}

/// The embedded files: (path, content type, bytes).
const ASSETS: &[(&str, &str, &str)] = &[
    ("/ui/app.js", "text/javascript; charset=utf-8", include_str!("assets/app.js")),
    ("/ui/app.css", "text/css; charset=utf-8", include_str!("assets/app.css")),
];
const INDEX_HTML: &str = include_str!("assets/index.html");

/// Headers on every answer: nothing from elsewhere runs, loads or frames
/// the console, and nothing it shows is cached or sniffed.
const SECURITY_HEADERS: &[(&str, &str)] = &[
    (
        "content-security-policy",
        "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self' data:; connect-src 'self'; \
         form-action 'self'; base-uri 'none'; frame-ancestors 'none'",
    ),
    ("x-content-type-options", "nosniff"),
    ("x-frame-options", "DENY"),
    ("referrer-policy", "no-referrer"),
    ("cache-control", "no-store"),
    ("cross-origin-opener-policy", "same-origin"),
    ("cross-origin-resource-policy", "same-origin"),
];

pub(crate) type Body = BoxBody<Bytes, Infallible>;
pub(crate) type Response = hyper::Response<Body>;

pub(crate) fn full(bytes: impl Into<Bytes>) -> Body {
    Full::new(bytes.into()).boxed()
}

/// An answer with the security headers.
pub(crate) fn answer(status: StatusCode, kind: &str, body: Body) -> Response {
    let mut r = hyper::Response::new(body);
    *r.status_mut() = status;
    let h = r.headers_mut();
    h.insert(hyper::header::CONTENT_TYPE, kind.parse().expect("content types are header values"));
    for (k, v) in SECURITY_HEADERS {
        h.insert(*k, v.parse().expect("static header values"));
    }
    r
}

pub(crate) fn json(status: StatusCode, v: &serde_json::Value) -> Response {
    answer(status, "application/json", full(v.to_string()))
}

pub(crate) fn error(status: StatusCode, message: &str) -> Response {
    json(status, &serde_json::json!({ "error": message }))
}

/// What every request handler shares.
pub(crate) struct Console {
    pub replica: Arc<Replica>,
    /// Answers go over TLS: the session cookie is `Secure` and `__Host-`.
    pub tls: bool,
    /// Event streams open now, bounded by [`api::EVENT_STREAMS_MAX`].
    pub streams: Arc<tokio::sync::Semaphore>,
    /// Job histories being read now, bounded by [`api::JOB_HISTORIES_MAX`].
    pub histories: Arc<tokio::sync::Semaphore>,
    /// Pending jobs' expected starts, shared by every viewer for a few
    /// seconds ([`api::ESTIMATES_TTL`]): each is a scheduling analysis.
    pub estimates: Mutex<api::Estimates>,
}

/// Serves the console on `listener` until the returned task is aborted.
pub fn serve(
    replica: Arc<Replica>,
    listener: TcpListener,
    transport: Transport,
) -> Result<tokio::task::JoinHandle<()>, String> {
    let (security, tls) = match transport {
        Transport::Tls(s) => (s, true),
        Transport::Plain => (gangway_proto::tls::Security::Insecure, false),
    };
    let mut conns = gangway_proto::tls::incoming_for(listener, &security, b"http/1.1")?;
    let console = Arc::new(Console {
        replica,
        tls,
        streams: api::event_stream_slots(),
        estimates: Mutex::new(api::Estimates::default()),
        histories: api::job_history_slots(),
    });
    Ok(tokio::spawn(async move {
        let admission = admission();
        while let Some(conn) = conns.next().await {
            let Ok(conn) = conn else { continue };
            let peer = conn.peer().clone();
            let ip = peer.remote.map(|a| gangway_proto::tls::host_of(a.ip())).unwrap_or(IpAddr::from([0, 0, 0, 0]));
            // Shed rather than queue: a browser retries.
            let Some(admitted) = admission.admit(ip) else { continue };
            let console = console.clone();
            tokio::spawn(async move {
                let _admitted = admitted;
                let svc = hyper::service::service_fn(move |req| {
                    let console = console.clone();
                    let peer = peer.clone();
                    async move { Ok::<_, Infallible>(route(&console, &peer, req).await) }
                });
                within_lifetime(http1().serve_connection(hyper_util::rt::TokioIo::new(conn), svc)).await;
            });
        }
    }))
}

/// Serves one connection for [`CONNECTION_LIFETIME_MAX`] at most, then
/// drops it (closing its socket) whatever it was doing.
async fn within_lifetime<F: std::future::Future<Output = Result<(), hyper::Error>>>(served: F) {
    match tokio::time::timeout(CONNECTION_LIFETIME_MAX, served).await {
        Ok(Err(e)) => tracing::debug!(error = %e, "console connection ended"),
        Ok(Ok(())) => {}
        Err(_) => tracing::debug!("console connection reached its lifetime"),
    }
}

/// The console's connection places: [`CONNECTIONS_MAX`] in all,
/// [`CONNECTIONS_PER_PEER_MAX`] per address.
fn admission() -> gangway_proto::tls::Admission {
    gangway_proto::tls::Admission::new(CONNECTIONS_MAX, CONNECTIONS_PER_PEER_MAX)
}

/// How a connection is read: a request's head of at most
/// [`REQUEST_HEAD_BYTES_MAX`] bytes, within [`HEADER_READ_TIMEOUT`].
fn http1() -> hyper::server::conn::http1::Builder {
    let mut http1 = hyper::server::conn::http1::Builder::new();
    http1
        .timer(hyper_util::rt::TokioTimer::new())
        .header_read_timeout(HEADER_READ_TIMEOUT)
        .max_buf_size(REQUEST_HEAD_BYTES_MAX);
    http1
}

/// A request's head is at most [`REQUEST_HEAD_BYTES_MAX`] bytes, counted as
/// a browser sends it (one space after each header's colon), or the 431
/// that says so. (The connection's buffer, [`http1`], bounds what is read
/// before a head is parsed, but not exactly: it let a head one byte past
/// the limit through.)
fn head_within_limit<B>(req: &hyper::Request<B>) -> Result<(), Response> {
    let line = req.method().as_str().len() + " ".len() + req.uri().to_string().len() + " HTTP/1.1\r\n".len();
    let headers: usize = req.headers().iter().map(|(k, v)| k.as_str().len() + ": ".len() + v.len() + 2).sum();
    if line + headers + "\r\n".len() > REQUEST_HEAD_BYTES_MAX {
        let why = format!("request head: must be at most {REQUEST_HEAD_BYTES_MAX} bytes");
        return Err(error(StatusCode::REQUEST_HEADER_FIELDS_TOO_LARGE, &why));
    }
    Ok(())
}

/// A request's body: at most [`REQUEST_BODY_BYTES_MAX`] bytes, within
/// [`BODY_READ_TIMEOUT`]; otherwise the answer that says which.
async fn read_body<B>(body: B) -> Result<Bytes, Response>
where
    B: hyper::body::Body<Data = Bytes>,
    B::Error: Into<Box<dyn std::error::Error + Send + Sync>>,
{
    let limited = http_body_util::Limited::new(body, REQUEST_BODY_BYTES_MAX);
    match tokio::time::timeout(BODY_READ_TIMEOUT, limited.collect()).await {
        Ok(Ok(b)) => Ok(b.to_bytes()),
        Ok(Err(_)) => {
            Err(error(StatusCode::PAYLOAD_TOO_LARGE, &format!("body: must be at most {REQUEST_BODY_BYTES_MAX} bytes")))
        }
        Err(_) => Err(error(
            StatusCode::REQUEST_TIMEOUT,
            &format!("body: did not arrive within {} s", BODY_READ_TIMEOUT.as_secs()),
        )),
    }
}

async fn route(
    console: &Console,
    peer: &gangway_proto::tls::PeerInfo,
    req: hyper::Request<hyper::body::Incoming>,
) -> Response {
    if let Err(too_large) = head_within_limit(&req) {
        return too_large;
    }
    // Over plain HTTP a page of another site can be made to resolve to this
    // address (DNS rebinding): only addresses and localhost name it here.
    // (Over HTTPS the certificate names the console.)
    if !console.tls {
        if let Err(why) = session::plain_host(req.headers()) {
            return error(StatusCode::MISDIRECTED_REQUEST, &why);
        }
    }
    let path = req.uri().path().to_string();
    let query = req.uri().query().unwrap_or("").to_string();
    let method = req.method().clone();
    match (&method, path.as_str()) {
        (&Method::GET, "/") => {
            let mut r = answer(StatusCode::FOUND, "text/plain; charset=utf-8", full("the console is at /ui/\n"));
            r.headers_mut().insert(hyper::header::LOCATION, "/ui/".parse().expect("static location"));
            r
        }
        (&Method::GET, "/ui" | "/ui/") => answer(StatusCode::OK, "text/html; charset=utf-8", full(INDEX_HTML)),
        (&Method::GET, p) if ASSETS.iter().any(|(a, _, _)| *a == p) => {
            let (_, kind, body) = ASSETS.iter().find(|(a, _, _)| *a == p).expect("just matched");
            answer(StatusCode::OK, kind, full(*body))
        }
        (_, p) if p.starts_with("/ui/api/") || p == "/ui/login" || p == "/ui/logout" => {
            if method == Method::POST {
                if let Err(why) = session::same_origin(req.headers()) {
                    return error(StatusCode::FORBIDDEN, &why);
                }
            }
            // Logging in or out needs no session, and must work with a bad one.
            let who = match session::Who::of(console, peer, req.headers()) {
                Ok(w) => w,
                Err(_) if p == "/ui/login" || p == "/ui/logout" => session::Who::nobody(peer),
                Err(why) => return error(StatusCode::BAD_REQUEST, &why),
            };
            let body = if method == Method::POST {
                match read_body(req.into_body()).await {
                    Ok(b) => b,
                    Err(answer) => return answer,
                }
            } else {
                Bytes::new()
            };
            api::handle(console, &who, &method, p, &query, &body).await
        }
        _ => error(StatusCode::NOT_FOUND, "not found: the console is at /ui/"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tokio::io::{AsyncReadExt, AsyncWriteExt};

    /// An answer's `error` message.
    pub(super) async fn message(r: Response) -> String {
        let body = r.into_body().collect().await.unwrap().to_bytes();
        let v: serde_json::Value = serde_json::from_slice(&body).unwrap();
        v["error"].as_str().unwrap_or_default().to_string()
    }

    /// The console keeps CONNECTIONS_PER_PEER_MAX connections of one
    /// address and CONNECTIONS_MAX in all; one past either is shed.
    #[test]
    fn console_connections_are_bounded_per_address_and_in_all() {
        let a = admission();
        let ip = |i: usize| IpAddr::from([10, 0, (i / 256) as u8, (i % 256) as u8]);
        let one: Vec<_> = (0..CONNECTIONS_PER_PEER_MAX).map(|_| a.admit(ip(0)).expect("within the share")).collect();
        assert!(a.admit(ip(0)).is_none(), "one past an address's share");
        drop(one);
        let all: Vec<_> = (0..CONNECTIONS_MAX).map(|i| a.admit(ip(i)).expect("within the total")).collect();
        assert!(a.admit(ip(CONNECTIONS_MAX)).is_none(), "one past the total");
        drop(all);
        assert!(a.admit(ip(CONNECTIONS_MAX)).is_some(), "places came back");
    }

    /// A connection lives CONNECTION_LIFETIME_MAX, whatever it does: an
    /// answer that never ends (an event stream) is still being sent a
    /// millisecond before, and the connection is closed a millisecond after.
    #[tokio::test(start_paused = true)]
    async fn a_connection_is_closed_at_connection_lifetime_max() {
        let (mut client, server) = tokio::io::duplex(64 * 1024);
        let svc = hyper::service::service_fn(|_req| async move {
            let endless = futures::stream::pending::<Result<hyper::body::Frame<Bytes>, Infallible>>();
            Ok::<_, Infallible>(hyper::Response::new(http_body_util::StreamBody::new(endless)))
        });
        let opened = tokio::time::Instant::now();
        let conn = tokio::spawn(within_lifetime(http1().serve_connection(hyper_util::rt::TokioIo::new(server), svc)));
        client.write_all(b"GET /api/events HTTP/1.1\r\nhost: x\r\n\r\n").await.unwrap();
        let mut head = vec![0u8; 17];
        client.read_exact(&mut head).await.unwrap();
        assert_eq!(&head, b"HTTP/1.1 200 OK\r\n");
        tokio::time::sleep_until(opened + CONNECTION_LIFETIME_MAX - Duration::from_millis(1)).await;
        assert!(!conn.is_finished(), "closed before its lifetime");
        tokio::time::sleep(Duration::from_millis(2)).await;
        for _ in 0..100 {
            if conn.is_finished() {
                break;
            }
            tokio::task::yield_now().await;
        }
        assert!(conn.is_finished(), "still open a millisecond past its lifetime");
        // Its socket closed: the client reads to the end.
        let mut rest = Vec::new();
        let end = tokio::time::timeout(Duration::from_secs(1), client.read_to_end(&mut rest)).await;
        assert!(end.is_ok_and(|r| r.is_ok()), "the connection was not closed");
    }

    /// A body of REQUEST_BODY_BYTES_MAX bytes is read whole; one byte more
    /// is answered 413, naming the limit.
    #[tokio::test]
    async fn a_request_body_is_bounded_at_request_body_bytes_max() {
        let body = |len: usize| Full::new(Bytes::from(vec![b'x'; len]));
        assert_eq!(read_body(body(REQUEST_BODY_BYTES_MAX)).await.map(|b| b.len()).ok(), Some(REQUEST_BODY_BYTES_MAX));
        let Err(r) = read_body(body(REQUEST_BODY_BYTES_MAX + 1)).await else {
            panic!("one byte past the limit was read")
        };
        assert_eq!(r.status(), StatusCode::PAYLOAD_TOO_LARGE);
        assert_eq!(message(r).await, format!("body: must be at most {REQUEST_BODY_BYTES_MAX} bytes"));
    }

    /// A request head of REQUEST_HEAD_BYTES_MAX bytes is served; one byte
    /// more is answered 431 (Request Header Fields Too Large), naming the
    /// limit, and so is a head past the connection's buffer.
    #[tokio::test]
    async fn a_request_head_is_bounded_at_request_head_bytes_max() {
        let limit = format!("request head: must be at most {REQUEST_HEAD_BYTES_MAX} bytes");
        let refused = [(REQUEST_HEAD_BYTES_MAX + 1, "431", limit.as_str()), (4 * REQUEST_HEAD_BYTES_MAX, "431", "")];
        for (len, status, says) in [(REQUEST_HEAD_BYTES_MAX, "200", "ok")].into_iter().chain(refused) {
            let (mut client, server) = tokio::io::duplex(8 * REQUEST_HEAD_BYTES_MAX);
            let svc = hyper::service::service_fn(|req| async move {
                Ok::<_, Infallible>(head_within_limit(&req).map_or_else(|r| r, |()| hyper::Response::new(full("ok"))))
            });
            let conn = tokio::spawn(http1().serve_connection(hyper_util::rt::TokioIo::new(server), svc));
            let (start, end) = ("GET / HTTP/1.1\r\nhost: x\r\nconnection: close\r\nx-pad: ", "\r\n\r\n");
            let head = format!("{start}{}{end}", "a".repeat(len - start.len() - end.len()));
            assert_eq!(head.len(), len);
            client.write_all(head.as_bytes()).await.unwrap();
            let mut answer = String::new();
            client.read_to_string(&mut answer).await.unwrap();
            assert!(answer.starts_with(&format!("HTTP/1.1 {status} ")), "a head of {len} bytes: {answer}");
            assert!(answer.contains(says), "a head of {len} bytes: {answer}");
            let _ = conn.await;
        }
    }
}
