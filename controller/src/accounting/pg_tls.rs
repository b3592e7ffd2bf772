//! TLS to PostgreSQL, with libpq's `sslmode` and `sslrootcert` honoured
//! (tokio-postgres itself knows only `disable`, `prefer` and `require`, and
//! no root certificate): rustls with the ring provider, as every other
//! Gangway connection.
//!
//! | `sslmode` | encrypted | the server's certificate |
//! |---|---|---|
//! | `disable` | never | — |
//! | `prefer` (the default, as libpq's) | if the server offers it | not checked (as libpq) |
//! | `require` | always | checked against `sslrootcert` when given, else not |
//! | `verify-ca` | always | signed by `sslrootcert` |
//! | `verify-full` | always | signed by `sslrootcert` and naming the host |
//!
//! `verify-full` is what the examples use: anything less lets whoever sits
//! on the path read the accounting records or pose as the database. libpq's
//! environment (`PGSSLMODE`, `PGSSLROOTCERT`) and `~/.postgresql/root.crt`
//! are not read: the URL says it all.

use std::future::Future;
use std::io;
use std::path::{Path, PathBuf};
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

use rustls::client::danger::{HandshakeSignatureValid, ServerCertVerified, ServerCertVerifier};
use rustls::pki_types::{CertificateDer, ServerName, UnixTime};
use rustls::{DigitallySignedStruct, SignatureScheme};
use tokio::io::{AsyncRead, AsyncWrite, ReadBuf};
use tokio_postgres::config::SslMode;
use tokio_postgres::tls::{ChannelBinding, MakeTlsConnect, TlsConnect};

/// The largest root certificate file read (a bundle of a few hundred CAs).
pub const ROOT_CERT_FILE_BYTES_MAX: u64 = 1024 * 1024;

/// What a database URL asks of TLS.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    Disable,
    Prefer,
    Require,
    VerifyCa,
    VerifyFull,
}

impl Mode {
    fn parse(v: &str) -> Result<Mode, String> {
        Ok(match v {
            "disable" => Mode::Disable,
            // libpq's `allow` tries plaintext first; plaintext it is here
            // only when the server refuses TLS, as with `prefer`.
            "allow" | "prefer" => Mode::Prefer,
            "require" => Mode::Require,
            "verify-ca" => Mode::VerifyCa,
            "verify-full" => Mode::VerifyFull,
            other => {
                return Err(format!(
                    "sslmode: '{other}' is not one of disable, allow, prefer, require, verify-ca, verify-full"
                ))
            }
        })
    }
}

/// A database URL's TLS settings, and the URL without them (for
/// tokio-postgres, which would refuse `verify-full` and `sslrootcert`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Settings {
    pub mode: Mode,
    pub root_cert: Option<PathBuf>,
    pub rest: String,
}

/// Splits `sslmode` and `sslrootcert` out of a URL (`postgres://...?a=b&...`)
/// or a key=value connection string.
pub fn split(url: &str) -> Result<Settings, String> {
    let (mut mode, mut root_cert) = (Mode::Prefer, None);
    let mut take = |k: &str, v: &str| -> Result<bool, String> {
        match k {
            "sslmode" => mode = Mode::parse(v)?,
            "sslrootcert" => root_cert = Some(PathBuf::from(v)),
            _ => return Ok(false),
        }
        Ok(true)
    };
    let is_url = url.starts_with("postgres://") || url.starts_with("postgresql://");
    let rest = if is_url {
        let (base, query) = url.split_once('?').unwrap_or((url, ""));
        let mut kept = Vec::new();
        for kv in query.split('&').filter(|kv| !kv.is_empty()) {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            // Only these two are decoded here (a password's escapes are
            // tokio-postgres' business, and never in an error of ours).
            if matches!(k, "sslmode" | "sslrootcert") {
                take(k, &percent_decode(v)?)?;
            } else {
                kept.push(kv);
            }
        }
        if kept.is_empty() {
            base.to_string()
        } else {
            format!("{base}?{}", kept.join("&"))
        }
    } else {
        let mut kept = Vec::new();
        for kv in url.split_whitespace() {
            let (k, v) = kv.split_once('=').unwrap_or((kv, ""));
            if !take(k, v.trim_matches('\''))? {
                kept.push(kv);
            }
        }
        kept.join(" ")
    };
    if matches!(mode, Mode::VerifyCa | Mode::VerifyFull) && root_cert.is_none() {
        return Err("sslrootcert: verify-ca and verify-full need the CA file that signed the server's certificate \
                    (sslrootcert=/path/to/ca.pem)"
            .into());
    }
    Ok(Settings { mode, root_cert, rest })
}

fn percent_decode(v: &str) -> Result<String, String> {
    let bytes = v.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while let Some(&b) = bytes.get(i) {
        if b == b'%' {
            let hex = v.get(i + 1..i + 3).ok_or_else(|| format!("'{v}' has a cut %-escape"))?;
            out.push(u8::from_str_radix(hex, 16).map_err(|_| format!("'{v}' has a bad %-escape"))?);
            i += 3;
        } else {
            out.push(b);
            i += 1;
        }
    }
    String::from_utf8(out).map_err(|_| format!("'{v}' is not UTF-8"))
}

/// The tokio-postgres mode for `mode` (the connector does the checking).
pub fn ssl_mode(mode: Mode) -> SslMode {
    match mode {
        Mode::Disable => SslMode::Disable,
        Mode::Prefer => SslMode::Prefer,
        Mode::Require | Mode::VerifyCa | Mode::VerifyFull => SslMode::Require,
    }
}

fn read_roots(path: &Path) -> Result<rustls::RootCertStore, String> {
    let meta = std::fs::metadata(path).map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
    if meta.len() > ROOT_CERT_FILE_BYTES_MAX {
        return Err(format!("sslrootcert {}: larger than {ROOT_CERT_FILE_BYTES_MAX} bytes", path.display()));
    }
    let pem = std::fs::read(path).map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
    let mut roots = rustls::RootCertStore::empty();
    for c in rustls_pemfile::certs(&mut pem.as_slice()) {
        let c = c.map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
        roots.add(c).map_err(|e| format!("sslrootcert {}: {e}", path.display()))?;
    }
    if roots.is_empty() {
        return Err(format!("sslrootcert {}: no certificate in it", path.display()));
    }
    Ok(roots)
}

/// The connector for `settings`: rustls checking what the mode asks.
pub fn connector(settings: &Settings) -> Result<RustlsConnect, String> {
    let provider = Arc::new(rustls::crypto::ring::default_provider());
    let builder = rustls::ClientConfig::builder_with_provider(provider.clone())
        .with_safe_default_protocol_versions()
        .map_err(|e| e.to_string())?;
    let roots = settings.root_cert.as_deref().map(read_roots).transpose()?;
    let verifier: Arc<dyn ServerCertVerifier> = match (settings.mode, roots) {
        (Mode::VerifyFull, Some(roots)) => {
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| e.to_string())?
        }
        (Mode::VerifyCa | Mode::Require, Some(roots)) => Arc::new(AnyName(
            rustls::client::WebPkiServerVerifier::builder_with_provider(Arc::new(roots), provider.clone())
                .build()
                .map_err(|e| e.to_string())?,
        )),
        (Mode::VerifyCa | Mode::VerifyFull, None) => return Err("sslrootcert: needed to verify the server".into()),
        (Mode::Disable | Mode::Prefer | Mode::Require, _) => Arc::new(Unchecked(provider)),
    };
    let config = builder.dangerous().with_custom_certificate_verifier(verifier).with_no_client_auth();
    Ok(RustlsConnect { config: Arc::new(config) })
}

/// A chain signed by the roots, whatever names it carries (`verify-ca`).
#[derive(Debug)]
struct AnyName(Arc<rustls::client::WebPkiServerVerifier>);

impl ServerCertVerifier for AnyName {
    fn verify_server_cert(
        &self,
        end_entity: &CertificateDer<'_>,
        intermediates: &[CertificateDer<'_>],
        server_name: &ServerName<'_>,
        ocsp: &[u8],
        now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        use rustls::CertificateError::{NotValidForName, NotValidForNameContext};
        match self.0.verify_server_cert(end_entity, intermediates, server_name, ocsp, now) {
            Err(rustls::Error::InvalidCertificate(NotValidForName | NotValidForNameContext { .. })) => {
                Ok(ServerCertVerified::assertion())
            }
            other => other,
        }
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls12_signature(message, cert, dss)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        self.0.verify_tls13_signature(message, cert, dss)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.supported_verify_schemes()
    }
}

/// Encryption without checking who the server is (`prefer`, `require`
/// without a root certificate), as libpq does: the handshake's own
/// signatures are still checked.
#[derive(Debug)]
struct Unchecked(Arc<rustls::crypto::CryptoProvider>);

impl ServerCertVerifier for Unchecked {
    fn verify_server_cert(
        &self,
        _end_entity: &CertificateDer<'_>,
        _intermediates: &[CertificateDer<'_>],
        _server_name: &ServerName<'_>,
        _ocsp: &[u8],
        _now: UnixTime,
    ) -> Result<ServerCertVerified, rustls::Error> {
        Ok(ServerCertVerified::assertion())
    }

    fn verify_tls12_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls12_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn verify_tls13_signature(
        &self,
        message: &[u8],
        cert: &CertificateDer<'_>,
        dss: &DigitallySignedStruct,
    ) -> Result<HandshakeSignatureValid, rustls::Error> {
        rustls::crypto::verify_tls13_signature(message, cert, dss, &self.0.signature_verification_algorithms)
    }

    fn supported_verify_schemes(&self) -> Vec<SignatureScheme> {
        self.0.signature_verification_algorithms.supported_schemes()
    }
}

/// tokio-postgres' TLS over rustls.
#[derive(Clone)]
pub struct RustlsConnect {
    config: Arc<rustls::ClientConfig>,
}

impl<S> MakeTlsConnect<S> for RustlsConnect
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type TlsConnect = RustlsConnector;
    type Error = rustls::pki_types::InvalidDnsNameError;

    fn make_tls_connect(&mut self, domain: &str) -> Result<RustlsConnector, Self::Error> {
        let name = ServerName::try_from(domain.to_string())?;
        Ok(RustlsConnector { config: self.config.clone(), name })
    }
}

pub struct RustlsConnector {
    config: Arc<rustls::ClientConfig>,
    name: ServerName<'static>,
}

impl<S> TlsConnect<S> for RustlsConnector
where
    S: AsyncRead + AsyncWrite + Unpin + Send + 'static,
{
    type Stream = RustlsStream<S>;
    type Error = io::Error;
    type Future = Pin<Box<dyn Future<Output = io::Result<RustlsStream<S>>> + Send>>;

    fn connect(self, stream: S) -> Self::Future {
        Box::pin(async move {
            let tls = tokio_rustls::TlsConnector::from(self.config).connect(self.name, stream).await?;
            Ok(RustlsStream(Box::new(tls)))
        })
    }
}

pub struct RustlsStream<S>(Box<tokio_rustls::client::TlsStream<S>>);

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncRead for RustlsStream<S> {
    fn poll_read(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &mut ReadBuf<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_read(cx, buf)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> AsyncWrite for RustlsStream<S> {
    fn poll_write(mut self: Pin<&mut Self>, cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        Pin::new(&mut *self.0).poll_write(cx, buf)
    }

    fn poll_flush(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_flush(cx)
    }

    fn poll_shutdown(mut self: Pin<&mut Self>, cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Pin::new(&mut *self.0).poll_shutdown(cx)
    }
}

impl<S: AsyncRead + AsyncWrite + Unpin> tokio_postgres::tls::TlsStream for RustlsStream<S> {
    fn channel_binding(&self) -> ChannelBinding {
        // SCRAM without channel binding (tokio-postgres' `prefer` default).
        ChannelBinding::none()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sslmode_and_sslrootcert_are_split_out_of_both_url_forms() {
        let s = split("postgres://u@db:5432/acct?sslmode=verify-full&sslrootcert=%2Fetc%2Fca.pem&application_name=x")
            .unwrap();
        assert_eq!(s.mode, Mode::VerifyFull);
        assert_eq!(s.root_cert.as_deref(), Some(Path::new("/etc/ca.pem")));
        assert_eq!(s.rest, "postgres://u@db:5432/acct?application_name=x");
        let s = split("host=db user=u sslmode=verify-ca sslrootcert=/etc/ca.pem dbname=acct").unwrap();
        assert_eq!((s.mode, s.rest.as_str()), (Mode::VerifyCa, "host=db user=u dbname=acct"));
        // A key=value string holding `://` somewhere is still one.
        let s = split("host=db options=x://y sslmode=require").unwrap();
        assert_eq!((s.mode, s.rest.as_str()), (Mode::Require, "host=db options=x://y"));
        // A password's bad escape is not ours to decode, nor to print.
        let s = split("postgres://u:p%zz@db/acct?password=s%zz&sslmode=require").unwrap();
        assert_eq!(s.mode, Mode::Require);
        assert_eq!(split("postgres://u@db/acct").unwrap().mode, Mode::Prefer, "libpq's default");
        assert_eq!(split("postgres://u@db/acct?sslmode=disable").unwrap().mode, Mode::Disable);
        let e = split("postgres://u@db/acct?sslmode=verify-full").unwrap_err();
        assert!(e.starts_with("sslrootcert:"), "{e}");
        let e = split("postgres://u@db/acct?sslmode=strict").unwrap_err();
        assert!(e.starts_with("sslmode: 'strict'"), "{e}");
    }

    #[test]
    fn a_root_certificate_file_is_read_up_to_its_limit() {
        let dir = tempfile::tempdir().unwrap();
        let big = dir.path().join("big.pem");
        std::fs::write(&big, vec![b'#'; ROOT_CERT_FILE_BYTES_MAX as usize + 1]).unwrap();
        let e = read_roots(&big).unwrap_err();
        assert!(e.contains(&format!("larger than {ROOT_CERT_FILE_BYTES_MAX} bytes")), "{e}");
        let at = dir.path().join("at.pem");
        std::fs::write(&at, vec![b'#'; ROOT_CERT_FILE_BYTES_MAX as usize]).unwrap();
        assert!(read_roots(&at).unwrap_err().contains("no certificate in it"));
    }
}
