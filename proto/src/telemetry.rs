//! Prometheus metrics for controllers and agents: the process-wide recorder
//! behind the `metrics` facade (counters and histograms recorded as things
//! happen), a builder for gauges computed when scraped, and a small HTTP
//! endpoint serving `GET /metrics` in the text exposition format.

use std::fmt::Write as _;
use std::sync::{Arc, OnceLock};
use std::time::Duration;

use metrics_exporter_prometheus::{Matcher, PrometheusBuilder, PrometheusHandle};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpListener;

/// Histogram buckets for durations (`*_seconds`): from a millisecond (a
/// proposal) to a day (a queue wait).
const SECONDS_BUCKETS: &[f64] =
    &[0.001, 0.005, 0.01, 0.05, 0.1, 0.5, 1.0, 5.0, 10.0, 30.0, 60.0, 300.0, 900.0, 3600.0, 14_400.0, 86_400.0];
/// Histogram buckets for batch sizes.
const SIZE_BUCKETS: &[f64] = &[1.0, 2.0, 4.0, 8.0, 16.0, 32.0, 64.0, 128.0, 256.0, 512.0, 1024.0];
/// Bytes of a request read before answering: a scrape's request line and
/// headers are a few hundred bytes.
const REQUEST_BYTES_MAX: usize = 8192;
/// A client that sends nothing for this long is dropped.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(5);
/// Scrapes served at once; more are closed (Prometheus scrapes one at a time
/// and retries at its next interval).
const SCRAPE_CONNECTIONS_MAX: usize = 16;
/// Connections one host (an IPv4 address, an IPv6 /64) may hold at once, so
/// one peer cannot take every slot.
const CONNECTIONS_PER_PEER_MAX: usize = 4;
/// A TLS handshake on a LAN takes milliseconds.
const HANDSHAKE_TIMEOUT: Duration = Duration::from_secs(2);

/// A metrics endpoint over TLS: the server configuration and the client
/// certificates' names allowed to scrape (`client/NAME`).
#[derive(Clone)]
pub struct MetricsTls {
    pub config: Arc<rustls::ServerConfig>,
    pub scrapers: Vec<String>,
}

/// The process-wide recorder (installed on first use) whose handle renders
/// every counter and histogram recorded through the `metrics` facade.
pub fn recorder() -> &'static PrometheusHandle {
    static HANDLE: OnceLock<PrometheusHandle> = OnceLock::new();
    HANDLE.get_or_init(|| {
        let builder = PrometheusBuilder::new()
            .set_buckets_for_metric(Matcher::Suffix("_seconds".into()), SECONDS_BUCKETS)
            .and_then(|b| b.set_buckets(SIZE_BUCKETS))
            .expect("bucket lists are not empty");
        let recorder = builder.build_recorder();
        let handle = recorder.handle();
        // Another recorder may be installed already (a test harness): then the
        // facade records there and this handle renders nothing of it.
        let _ = metrics::set_global_recorder(recorder);
        handle
    })
}

/// Gauges computed at scrape time, rendered with one HELP and TYPE line per family.
#[derive(Default)]
pub struct Gauges {
    text: String,
    families: Vec<&'static str>,
}

fn escape(v: &str) -> String {
    v.replace('\\', "\\\\").replace('"', "\\\"").replace('\n', "\\n")
}

impl Gauges {
    /// Adds one sample of the gauge `name`.
    pub fn set(&mut self, name: &'static str, help: &str, labels: &[(&str, &str)], value: f64) {
        if !self.families.contains(&name) {
            self.families.push(name);
            let _ = writeln!(self.text, "# HELP {name} {help}\n# TYPE {name} gauge");
        }
        let _ = write!(self.text, "{name}");
        if !labels.is_empty() {
            let l: Vec<String> = labels.iter().map(|(k, v)| format!("{k}=\"{}\"", escape(v))).collect();
            let _ = write!(self.text, "{{{}}}", l.join(","));
        }
        let _ = writeln!(self.text, " {value}");
    }

    /// The gauges, then everything the recorder holds.
    pub fn finish(self) -> String {
        let mut out = self.text;
        out.push_str(&recorder().render());
        out
    }
}

/// Serves `GET /metrics` with `render()`'s text until the task is dropped.
/// With `tls`, over TLS, and only to the scrapers it names (client
/// certificates of the cluster's CA): users and nodes get nothing.
pub async fn serve(listener: TcpListener, render: Arc<dyn Fn() -> String + Send + Sync>, tls: Option<MetricsTls>) {
    let admission = crate::tls::Admission::new(SCRAPE_CONNECTIONS_MAX, CONNECTIONS_PER_PEER_MAX);
    let tls = tls.map(|t| (tokio_rustls::TlsAcceptor::from(t.config), Arc::new(t.scrapers)));
    loop {
        let Ok((conn, peer)) = listener.accept().await else { continue };
        // Shed rather than queue: a scraper retries at its next interval.
        let Some(admitted) = admission.admit(crate::tls::host_of(peer.ip())) else { continue };
        let render = render.clone();
        let tls = tls.clone();
        tokio::spawn(async move {
            let _admitted = admitted;
            match tls {
                None => answer(conn, render).await,
                Some((acceptor, scrapers)) => {
                    if let Ok(Ok(tls)) = tokio::time::timeout(HANDSHAKE_TIMEOUT, acceptor.accept(conn)).await {
                        let allowed = tls
                            .get_ref()
                            .1
                            .peer_certificates()
                            .and_then(|c| c.first())
                            .and_then(|leaf| crate::tls::principal_of(leaf).ok())
                            .is_some_and(|(p, _)| p.role == crate::tls::Role::Client && scrapers.contains(&p.name));
                        if allowed {
                            answer(tls, render).await;
                        }
                    }
                }
            }
        });
    }
}

/// Reads one request and answers it.
async fn answer<S: tokio::io::AsyncRead + tokio::io::AsyncWrite + Unpin>(
    mut conn: S,
    render: Arc<dyn Fn() -> String + Send + Sync>,
) {
    let mut buf = Vec::with_capacity(512);
    let read = tokio::time::timeout(REQUEST_TIMEOUT, async {
        let mut chunk = [0u8; 1024];
        while !buf.windows(4).any(|w| w == b"\r\n\r\n") && buf.len() < REQUEST_BYTES_MAX {
            match conn.read(&mut chunk).await {
                Ok(0) | Err(_) => return false,
                Ok(n) => buf.extend_from_slice(&chunk[..n]),
            }
        }
        true
    })
    .await;
    if !matches!(read, Ok(true)) {
        return;
    }
    let request = String::from_utf8_lossy(&buf);
    let mut words = request.split_whitespace();
    let (method, path) = (words.next().unwrap_or(""), words.next().unwrap_or(""));
    let path = path.split('?').next().unwrap_or("");
    let (status, kind, body) = match (method, path) {
        ("GET", "/metrics") => ("200 OK", "text/plain; version=0.0.4; charset=utf-8", render()),
        ("GET", "/") => ("200 OK", "text/plain; charset=utf-8", "Gangway: metrics at /metrics\n".to_string()),
        _ => ("404 Not Found", "text/plain; charset=utf-8", "not found: try /metrics\n".to_string()),
    };
    let head = format!(
        "HTTP/1.1 {status}\r\nContent-Type: {kind}\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    let _ = conn.write_all(head.as_bytes()).await;
    let _ = conn.write_all(body.as_bytes()).await;
    let _ = conn.shutdown().await;
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gauges_render_one_family_header_each() {
        let mut g = Gauges::default();
        g.set("gangway_jobs", "Jobs by state.", &[("state", "pending")], 3.0);
        g.set("gangway_jobs", "Jobs by state.", &[("state", "run\"ning")], 1.0);
        let text = g.finish();
        assert_eq!(text.matches("# TYPE gangway_jobs gauge").count(), 1, "{text}");
        assert!(text.contains("gangway_jobs{state=\"pending\"} 3\n"), "{text}");
        assert!(text.contains("gangway_jobs{state=\"run\\\"ning\"} 1\n"), "{text}");
    }

    /// With TLS, metrics go only to the named scrapers' certificates.
    #[tokio::test]
    async fn tls_metrics_need_a_client_certificate() {
        use crate::tls::{Credentials, Expect, Principal, Role, TlsFiles};
        use tokio::io::{AsyncReadExt, AsyncWriteExt};
        let dir = std::env::temp_dir().join(format!("gangway-metrics-tls-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let ps = [
            Principal::new(Role::Server, "1").unwrap(),
            Principal::new(Role::Client, "prometheus").unwrap(),
            Principal::new(Role::Client, "alice").unwrap(),
        ];
        crate::pki::throwaway(&dir, &ps).unwrap();
        let server = Credentials::load(TlsFiles::in_dir(&dir, "server-1")).unwrap();
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let render: Arc<dyn Fn() -> String + Send + Sync> = Arc::new(|| "gangway_up 1\n".to_string());
        let tls =
            MetricsTls { config: server.server_config_for(b"http/1.1").unwrap(), scrapers: vec!["prometheus".into()] };
        let task = tokio::spawn(serve(listener, render, Some(tls)));
        let scrape = |files: TlsFiles| async move {
            let creds = Credentials::load(files).unwrap();
            let mut cfg = (*creds.client_config(Expect::Server).unwrap()).clone();
            cfg.alpn_protocols = vec![b"http/1.1".to_vec()];
            let tcp = tokio::net::TcpStream::connect(addr).await.unwrap();
            let name = rustls::pki_types::ServerName::try_from("gangway").unwrap();
            let Ok(mut tls) = tokio_rustls::TlsConnector::from(Arc::new(cfg)).connect(name, tcp).await else {
                return String::new();
            };
            let _ = tls.write_all(b"GET /metrics HTTP/1.1\r\nHost: x\r\n\r\n").await;
            let mut out = Vec::new();
            let _ = tokio::time::timeout(Duration::from_secs(5), tls.read_to_end(&mut out)).await;
            String::from_utf8_lossy(&out).into_owned()
        };
        let with_cert = scrape(TlsFiles::in_dir(&dir, "client-prometheus")).await;
        assert!(with_cert.starts_with("HTTP/1.1 200 OK") && with_cert.contains("gangway_up 1"), "{with_cert}");
        let without = scrape(TlsFiles { ca: dir.join("ca.pem"), cert: None }).await;
        assert!(!without.contains("gangway_up"), "{without}");
        // A user's certificate is the CA's too, but not a scraper's.
        let user = scrape(TlsFiles::in_dir(&dir, "client-alice")).await;
        assert!(!user.contains("gangway_up"), "{user}");
        task.abort();
        std::fs::remove_dir_all(&dir).unwrap();
    }

    async fn connect_from(host: u8, addr: std::net::SocketAddr) -> tokio::net::TcpStream {
        let s = tokio::net::TcpSocket::new_v4().unwrap();
        s.bind(std::net::SocketAddr::from(([127, 0, 0, host], 0))).unwrap();
        s.connect(addr).await.unwrap()
    }

    /// Whether the endpoint closes `s` at once (it answers nothing unasked).
    async fn closed_at_once(mut s: tokio::net::TcpStream) -> bool {
        let mut b = [0u8; 1];
        matches!(tokio::time::timeout(Duration::from_secs(2), s.read(&mut b)).await, Ok(Ok(0) | Err(_)))
    }

    /// What a plain scrape from `host` gets back.
    async fn scrape_from(host: u8, addr: std::net::SocketAddr) -> String {
        let mut s = connect_from(host, addr).await;
        s.write_all(b"GET /metrics HTTP/1.1\r\n\r\n").await.unwrap();
        let mut out = String::new();
        let _ = tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out)).await;
        out
    }

    /// The endpoint keeps CONNECTIONS_PER_PEER_MAX silent connections of
    /// one address and SCRAPE_CONNECTIONS_MAX in all; one past either is closed at
    /// once, and their places come back when they close.
    #[tokio::test]
    async fn scrapes_are_bounded_per_address_and_in_all() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(serve(listener, Arc::new(|| "gangway_up 1\n".to_string()), None));
        let mut held = Vec::new();
        for _ in 0..CONNECTIONS_PER_PEER_MAX {
            held.push(connect_from(1, addr).await);
        }
        assert!(closed_at_once(connect_from(1, addr).await).await, "one past an address's share stayed open");
        let hosts = u8::try_from(SCRAPE_CONNECTIONS_MAX / CONNECTIONS_PER_PEER_MAX).unwrap();
        for host in 2..=hosts {
            for _ in 0..CONNECTIONS_PER_PEER_MAX {
                held.push(connect_from(host, addr).await);
            }
        }
        assert_eq!(held.len(), SCRAPE_CONNECTIONS_MAX);
        assert!(closed_at_once(connect_from(hosts + 1, addr).await).await, "one past the total stayed open");
        drop(held);
        let mut answered = String::new();
        for _ in 0..50 {
            answered = scrape_from(1, addr).await;
            if answered.contains("gangway_up 1") {
                break;
            }
            tokio::time::sleep(Duration::from_millis(20)).await;
        }
        assert!(answered.starts_with("HTTP/1.1 200 OK"), "places did not come back: {answered:?}");
        task.abort();
    }

    /// A request's head is read up to REQUEST_BYTES_MAX bytes: one byte
    /// short of it (and no blank line) the endpoint waits for more; at it,
    /// it reads no further and answers.
    #[tokio::test]
    async fn a_request_is_read_up_to_request_bytes_max() {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let task = tokio::spawn(serve(listener, Arc::new(|| "gangway_up 1\n".to_string()), None));
        let mut s = connect_from(1, addr).await;
        let mut head = b"GET /metrics HTTP/1.1\r\nX-Pad: ".to_vec();
        head.resize(REQUEST_BYTES_MAX - 1, b'x');
        s.write_all(&head).await.unwrap();
        let mut b = [0u8; 1];
        assert!(
            tokio::time::timeout(Duration::from_millis(500), s.read(&mut b)).await.is_err(),
            "answered before REQUEST_BYTES_MAX bytes or a blank line"
        );
        s.write_all(b"x").await.unwrap();
        let mut out = String::new();
        tokio::time::timeout(Duration::from_secs(5), s.read_to_string(&mut out)).await.unwrap().unwrap();
        assert!(out.starts_with("HTTP/1.1 200 OK") && out.contains("gangway_up 1"), "{out}");
        task.abort();
    }
}
