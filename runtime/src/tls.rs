//! Cluster CA, node certificates and the mutual-TLS quinn configurations.
//!
//! Every cluster has one CA (created by `yatt-node init --dir DIR`). Each node holds a
//! certificate issued by that CA whose subject CN is the node's name and whose only DNS
//! SAN is [`SERVER_NAME`]. Clients always connect with server name [`SERVER_NAME`] and
//! learn who they are talking to from the peer certificate's CN ([`peer_identity`]), not
//! from DNS. Both sides verify the other against the cluster CA: a peer without a
//! certificate chained to it is refused at the handshake. ALPN is [`ALPN`].
//!
//! The rustls `aws-lc-rs` crypto provider is passed explicitly to every builder, so
//! nothing depends on a process-global default provider being installed. It is chosen
//! over `ring` for bulk data: its AES-GCM uses AVX-512/VAES where the CPU has them, and
//! sealed 64 MiB 2.1× faster than ring's on the reference machine (docs/benchmarks.md).

use std::fs;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use rcgen::{
    BasicConstraints, CertificateParams, DistinguishedName, DnType, ExtendedKeyUsagePurpose, IsCa,
    KeyPair, KeyUsagePurpose, SanType,
};
use rustls::crypto::CryptoProvider;
use rustls::pki_types::pem::PemObject;
use rustls::pki_types::{CertificateDer, PrivateKeyDer};
use rustls::server::WebPkiClientVerifier;
use rustls::RootCertStore;

use crate::cert_kind::CertKind;

/// ALPN protocol identifier spoken between yatt nodes: the wire protocol's version.
/// Bumped whenever a message between nodes changes shape, so that a node of another
/// build is refused at the handshake, saying so, rather than misreading messages
/// (postcard is not self-describing). 2: remote spawns carry a ticket (`CancelSpawn`).
/// 3: the policy's `PushWeights` (weight sync in one hop). 4: `PushWeights` names each
/// target's kind (the first sync loads the reference and the other replicas too).
/// 5: a rollout's counters carry its KV cache's preemptions and peak bytes held. 6, 7:
/// a sharded policy's rank messages. 8: slices (`LoadWeightSlice`, `PushSlice`, `Score`).
/// 9: an actor's directory record carries its device claim; HSDP's ring messages.
/// Tests pin the encoding of the system messages and frame heads (`node/protocol.rs`,
/// `transport/protocol.rs`) and the roles' messages (`yatt-roles`, `wire/pin.rs`).
pub const ALPN: &[u8] = b"yatt/11";

/// A fingerprint of encoded messages (each one's length, then its bytes), for tests
/// that pin an encoding to [`ALPN`]: a change to how the messages encode changes it.
pub fn wire_fingerprint(encoded: &[Vec<u8>]) -> u32 {
    let mut crc = crc32fast::Hasher::new();
    for bytes in encoded {
        crc.update(&(bytes.len() as u64).to_le_bytes());
        crc.update(bytes);
    }
    crc.finalize()
}

/// Every node certificate carries this DNS SAN; clients always connect with this server name
/// and learn the peer's node name from its certificate (CN), not from DNS.
pub const SERVER_NAME: &str = "yatt-node";

/// File name of the cluster CA certificate inside a certificate directory.
pub const CA_CERT_FILE: &str = "ca.pem";
/// File name of the cluster CA private key inside the CA directory.
pub const CA_KEY_FILE: &str = "ca.key";

/// Default keep-alive interval of node connections.
pub const DEFAULT_KEEP_ALIVE: Duration = Duration::from_secs(1);
/// Default maximum idle time before a node connection is considered dead.
pub const DEFAULT_IDLE_TIMEOUT: Duration = Duration::from_secs(10);
/// Default per-stream receive window (bulk payloads travel on one stream each).
pub const DEFAULT_STREAM_WINDOW: u32 = 64 << 20;
/// Default per-connection receive window.
pub const DEFAULT_CONN_WINDOW: u32 = 256 << 20;
/// Default per-connection send window.
pub const DEFAULT_SEND_WINDOW: u64 = 256 << 20;
/// Default ceiling on the congestion window: below the 8 MiB a 4 MiB socket buffer
/// request gets from Linux (it doubles the request, up to `net.core.rmem_max`).
pub const DEFAULT_MAX_CWND: u64 = 6 << 20;
/// Smallest UDP payload QUIC allows (and quinn's default starting size).
pub const MIN_UDP_PAYLOAD: u16 = 1200;
/// Largest UDP payload QUIC allows (IPv6's limit; IPv4 loopback carries 65,507).
pub const MAX_UDP_PAYLOAD: u16 = 65_527;

/// Node certificates are valid this many years from their issue year.
const NODE_CERT_YEARS: i32 = 10;
/// The cluster CA is valid this many years from its creation year.
const CA_CERT_YEARS: i32 = 30;

/// Errors of certificate handling and TLS configuration.
#[derive(Debug, thiserror::Error)]
pub enum TlsError {
    /// The node name does not match `[a-z0-9][a-z0-9-_.]{0,62}`.
    #[error("invalid node name {name:?}: expected 1-63 characters of [a-z0-9-_.], starting with [a-z0-9]")]
    InvalidNodeName {
        /// The rejected name.
        name: String,
    },
    /// rcgen failed to generate a key or certificate.
    #[error("certificate generation failed: {0}")]
    Generate(String),
    /// A required file does not exist.
    #[error("{path} not found; {hint}")]
    Missing {
        /// The missing file.
        path: PathBuf,
        /// How to create it.
        hint: String,
    },
    /// Reading or writing a file failed.
    #[error("{path}: {source}")]
    Io {
        /// The file involved.
        path: PathBuf,
        /// The underlying I/O error.
        source: std::io::Error,
    },
    /// A file exists but does not hold what it should (bad PEM, wrong kind of key, ...).
    #[error("{path}: {reason}")]
    BadFile {
        /// The offending file.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// A certificate directory already holds a different cluster CA certificate.
    #[error("{path} holds a different cluster CA certificate; refusing to overwrite it")]
    CaMismatch {
        /// The existing CA certificate file.
        path: PathBuf,
    },
    /// rustls rejected the configuration (bad key, bad certificate, ...).
    #[error("TLS configuration: {0}")]
    Rustls(#[from] rustls::Error),
    /// The client certificate verifier could not be built from the cluster CA.
    #[error("client certificate verifier: {0}")]
    Verifier(String),
    /// The rustls configuration is not usable for QUIC (no TLS 1.3 initial cipher suite).
    #[error("TLS configuration unusable for QUIC: {0}")]
    Quic(String),
    /// A transport parameter is out of range.
    #[error("transport configuration: {0}")]
    Transport(String),
    /// The connection has no verified peer certificate.
    #[error("peer presented no certificate")]
    NoPeerCertificate,
    /// The peer certificate could not be parsed or carries no usable CN.
    #[error("peer certificate: {0}")]
    BadPeerCertificate(String),
}

/// How a certificate issued before kinds existed is told to be replaced.
fn reissue_hint(node: &str) -> String {
    format!(
        "issue it again with its kind: `yatt-node cert --ca-dir CA_DIR --name {node} --kind node|trainer|client --out DIR`"
    )
}

/// Transport tuning shared by the server and client configurations.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportTuning {
    /// Interval of QUIC keep-alive pings.
    pub keep_alive: Duration,
    /// Idle time after which a connection is closed.
    pub idle_timeout: Duration,
    /// Receive window of each stream, in bytes.
    pub stream_receive_window: u32,
    /// Receive window of a whole connection, in bytes.
    pub connection_receive_window: u32,
    /// Send window of a whole connection, in bytes.
    pub send_window: u64,
    /// UDP payload size used from the first packet on, before path MTU discovery
    /// confirms a larger one (at least [`MIN_UDP_PAYLOAD`]).
    pub initial_udp_payload: u16,
    /// Largest UDP payload path MTU discovery probes for and the endpoint accepts
    /// (at most [`MAX_UDP_PAYLOAD`]; at or below `initial_udp_payload` turns discovery off).
    pub max_udp_payload: u16,
    /// Ceiling on the congestion window, in bytes (0: none). Keep it below the peer's
    /// UDP receive buffer, or a descheduled receiver drops datagrams.
    pub max_congestion_window: u64,
}

impl Default for TransportTuning {
    fn default() -> Self {
        Self {
            keep_alive: DEFAULT_KEEP_ALIVE,
            idle_timeout: DEFAULT_IDLE_TIMEOUT,
            stream_receive_window: DEFAULT_STREAM_WINDOW,
            connection_receive_window: DEFAULT_CONN_WINDOW,
            send_window: DEFAULT_SEND_WINDOW,
            initial_udp_payload: MIN_UDP_PAYLOAD,
            max_udp_payload: MAX_UDP_PAYLOAD,
            max_congestion_window: DEFAULT_MAX_CWND,
        }
    }
}

impl TransportTuning {
    /// Builds the quinn transport configuration.
    pub fn transport_config(&self) -> Result<quinn::TransportConfig, TlsError> {
        let mut t = quinn::TransportConfig::default();
        let idle = quinn::IdleTimeout::try_from(self.idle_timeout)
            .map_err(|e| TlsError::Transport(format!("idle timeout: {e}")))?;
        t.max_idle_timeout(Some(idle));
        t.keep_alive_interval(Some(self.keep_alive));
        t.stream_receive_window(quinn::VarInt::from_u32(self.stream_receive_window));
        t.receive_window(quinn::VarInt::from_u32(self.connection_receive_window));
        t.send_window(self.send_window);
        // Many asks in flight at once must not queue behind quinn's default of 100.
        t.max_concurrent_bidi_streams(quinn::VarInt::from_u32(4096));
        t.max_concurrent_uni_streams(quinn::VarInt::from_u32(4096));
        let initial = self
            .initial_udp_payload
            .clamp(MIN_UDP_PAYLOAD, MAX_UDP_PAYLOAD);
        let max = self.max_udp_payload.clamp(initial, MAX_UDP_PAYLOAD);
        t.initial_mtu(initial);
        t.mtu_discovery_config((max > initial).then(|| {
            let mut m = quinn::MtuDiscoveryConfig::default();
            m.upper_bound(max);
            m
        }));
        if self.max_congestion_window > 0 {
            t.congestion_controller_factory(Arc::new(crate::congestion::CappedCubic::new(
                self.max_congestion_window,
            )));
        }
        Ok(t)
    }
}

fn provider() -> Arc<CryptoProvider> {
    Arc::new(rustls::crypto::aws_lc_rs::default_provider())
}

fn gen_err(e: rcgen::Error) -> TlsError {
    TlsError::Generate(e.to_string())
}

fn current_year() -> i32 {
    let secs = SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0);
    // Average Gregorian year length; good enough to pick validity bounds.
    1970 + i32::try_from(secs / 31_556_952).unwrap_or(0)
}

/// Validates a node name: `[a-z0-9][a-z0-9-_.]{0,62}`.
pub fn validate_node_name(name: &str) -> Result<(), TlsError> {
    let bytes = name.as_bytes();
    let ok = !bytes.is_empty()
        && bytes.len() <= 63
        && (bytes[0].is_ascii_lowercase() || bytes[0].is_ascii_digit())
        && bytes.iter().all(|&b| {
            b.is_ascii_lowercase() || b.is_ascii_digit() || b == b'-' || b == b'_' || b == b'.'
        });
    if ok {
        Ok(())
    } else {
        Err(TlsError::InvalidNodeName {
            name: name.to_string(),
        })
    }
}

fn read_file(path: &Path, hint: &str) -> Result<Vec<u8>, TlsError> {
    match fs::read(path) {
        Ok(b) => Ok(b),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => Err(TlsError::Missing {
            path: path.to_path_buf(),
            hint: hint.to_string(),
        }),
        Err(source) => Err(TlsError::Io {
            path: path.to_path_buf(),
            source,
        }),
    }
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> TlsError + '_ {
    move |source| TlsError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// Writes `contents` to `path`; with `secret`, the file is created with mode 0600
/// (and an existing file is narrowed to 0600 first).
fn write_file(path: &Path, contents: &[u8], secret: bool) -> Result<(), TlsError> {
    let mut opts = fs::OpenOptions::new();
    opts.write(true).create(true).truncate(true);
    #[cfg(unix)]
    if secret {
        use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
        opts.mode(0o600);
        if path.exists() {
            fs::set_permissions(path, fs::Permissions::from_mode(0o600)).map_err(io_err(path))?;
        }
    }
    #[cfg(not(unix))]
    let _ = secret;
    let mut f = opts.open(path).map_err(io_err(path))?;
    f.write_all(contents).map_err(io_err(path))?;
    f.sync_all().map_err(io_err(path))
}

fn parse_certs(path: &Path, pem: &[u8]) -> Result<Vec<CertificateDer<'static>>, TlsError> {
    let certs = CertificateDer::pem_slice_iter(pem)
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| TlsError::BadFile {
            path: path.to_path_buf(),
            reason: format!("not a PEM certificate file: {e}"),
        })?;
    if certs.is_empty() {
        return Err(TlsError::BadFile {
            path: path.to_path_buf(),
            reason: "no CERTIFICATE section found".into(),
        });
    }
    Ok(certs)
}

fn parse_key_pair(path: &Path, pem: &[u8]) -> Result<KeyPair, TlsError> {
    let text = std::str::from_utf8(pem).map_err(|_| TlsError::BadFile {
        path: path.to_path_buf(),
        reason: "not a PEM file (not UTF-8)".into(),
    })?;
    KeyPair::from_pem(text).map_err(|e| TlsError::BadFile {
        path: path.to_path_buf(),
        reason: format!("not a usable PKCS#8 private key: {e}"),
    })
}

/// Common name (first CN attribute) of a DER certificate.
fn cert_common_name(der: &[u8]) -> Result<String, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
    let cn = cert
        .subject()
        .iter_common_name()
        .next()
        .ok_or_else(|| "certificate subject has no CN".to_string())?;
    cn.as_str()
        .map(str::to_string)
        .map_err(|e| format!("CN is not a string: {e}"))
}

/// The kind a certificate's subject names (its `O=yatt-<kind>` attribute).
fn cert_kind(der: &[u8]) -> Result<CertKind, String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
    let mut kinds = cert
        .subject()
        .iter_organization()
        .filter_map(|o| o.as_str().ok())
        .filter_map(CertKind::from_organization);
    match (kinds.next(), kinds.next()) {
        (Some(k), None) => Ok(k),
        (None, _) => Err(
            "the certificate names no kind (no O=yatt-node, O=yatt-trainer or O=yatt-client in its subject)".into(),
        ),
        (Some(_), Some(_)) => Err("the certificate names more than one kind".into()),
    }
}

/// Raw (subject, issuer) DER names of a certificate.
fn cert_names(der: &[u8]) -> Result<(Vec<u8>, Vec<u8>), String> {
    let (_, cert) = x509_parser::parse_x509_certificate(der).map_err(|e| e.to_string())?;
    Ok((
        cert.subject().as_raw().to_vec(),
        cert.issuer().as_raw().to_vec(),
    ))
}

/// The cluster certificate authority: its certificate and private key.
pub struct ClusterCa {
    /// The certificate as stored / distributed (original DER).
    cert_der: CertificateDer<'static>,
    /// PEM text of `cert_der`.
    cert_pem: String,
    /// Issuer form of the CA used by rcgen when signing (same subject and key).
    issuer: rcgen::Certificate,
    key: KeyPair,
}

impl std::fmt::Debug for ClusterCa {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ClusterCa").finish_non_exhaustive()
    }
}

impl ClusterCa {
    /// Creates a new CA for cluster `cluster` (used in the subject's O and CN).
    pub fn generate(cluster: &str) -> Result<Self, TlsError> {
        let key = KeyPair::generate().map_err(gen_err)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, cluster);
        dn.push(DnType::CommonName, format!("yatt cluster CA {cluster}"));
        params.distinguished_name = dn;
        params.is_ca = IsCa::Ca(BasicConstraints::Constrained(0));
        params.key_usages = vec![
            KeyUsagePurpose::KeyCertSign,
            KeyUsagePurpose::CrlSign,
            KeyUsagePurpose::DigitalSignature,
        ];
        let year = current_year();
        params.not_before = rcgen::date_time_ymd(year - 1, 1, 1);
        params.not_after = rcgen::date_time_ymd(year + CA_CERT_YEARS, 1, 1);
        let cert = params.self_signed(&key).map_err(gen_err)?;
        Ok(Self {
            cert_der: cert.der().clone(),
            cert_pem: cert.pem(),
            issuer: cert,
            key,
        })
    }

    /// Writes `ca.pem` and `ca.key` (mode 0600) into `dir`, creating it if needed.
    pub fn save(&self, dir: &Path) -> Result<(), TlsError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        write_file(&dir.join(CA_CERT_FILE), self.cert_pem.as_bytes(), false)?;
        write_file(
            &dir.join(CA_KEY_FILE),
            self.key.serialize_pem().as_bytes(),
            true,
        )
    }

    /// Loads `ca.pem` and `ca.key` from `dir`.
    pub fn load(dir: &Path) -> Result<Self, TlsError> {
        let hint = format!(
            "create the cluster CA with `yatt-node init --dir {}`",
            dir.display()
        );
        let cert_path = dir.join(CA_CERT_FILE);
        let key_path = dir.join(CA_KEY_FILE);
        let cert_pem_bytes = read_file(&cert_path, &hint)?;
        let key_pem = read_file(&key_path, &hint)?;
        let certs = parse_certs(&cert_path, &cert_pem_bytes)?;
        let cert_der = certs[0].clone();
        let key = parse_key_pair(&key_path, &key_pem)?;
        let params =
            CertificateParams::from_ca_cert_der(&cert_der).map_err(|e| TlsError::BadFile {
                path: cert_path.clone(),
                reason: format!("not a usable CA certificate: {e}"),
            })?;
        let (_, spki) = x509_parser::parse_x509_certificate(&cert_der)
            .map(|(r, c)| (r, c.public_key().raw.to_vec()))
            .map_err(|e| TlsError::BadFile {
                path: cert_path.clone(),
                reason: format!("unparsable certificate: {e}"),
            })?;
        if spki != key.public_key_der() {
            return Err(TlsError::BadFile {
                path: key_path,
                reason: format!("private key does not match {}", cert_path.display()),
            });
        }
        // Re-signing the parsed parameters yields an issuer with the same subject and key;
        // certificates it signs chain to the original `cert_der`.
        let issuer = params.self_signed(&key).map_err(gen_err)?;
        let cert_pem = String::from_utf8_lossy(&cert_pem_bytes).into_owned();
        Ok(Self {
            cert_der,
            cert_pem,
            issuer,
            key,
        })
    }

    /// PEM text of the CA certificate.
    pub fn cert_pem(&self) -> String {
        self.cert_pem.clone()
    }

    /// DER of the CA certificate.
    pub fn cert_der(&self) -> &CertificateDer<'static> {
        &self.cert_der
    }

    /// Issues a certificate for node `node` of kind `kind` (CN = node, O =
    /// `yatt-<kind>`, DNS SAN = [`SERVER_NAME`], usable as TLS server and client).
    pub fn issue(&self, node: &str, kind: CertKind) -> Result<NodeIdentity, TlsError> {
        self.issue_until(node, kind, None)
    }

    /// [`ClusterCa::issue`] valid until `until` (year, month, day; UTC midnight)
    /// instead of `NODE_CERT_YEARS` years: a short-lived certificate, or, with a past
    /// date, one already expired (to check that it is refused).
    pub fn issue_until(
        &self,
        node: &str,
        kind: CertKind,
        until: Option<(i32, u8, u8)>,
    ) -> Result<NodeIdentity, TlsError> {
        validate_node_name(node)?;
        let key = KeyPair::generate().map_err(gen_err)?;
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::OrganizationName, kind.organization());
        dn.push(DnType::CommonName, node);
        params.distinguished_name = dn;
        params.subject_alt_names = vec![SanType::DnsName(SERVER_NAME.try_into().map_err(gen_err)?)];
        params.is_ca = IsCa::ExplicitNoCa;
        params.key_usages = vec![KeyUsagePurpose::DigitalSignature];
        params.extended_key_usages = vec![
            ExtendedKeyUsagePurpose::ServerAuth,
            ExtendedKeyUsagePurpose::ClientAuth,
        ];
        params.use_authority_key_identifier_extension = true;
        let year = current_year();
        let (before, after) = match until {
            Some((y, m, d)) => (y.min(year) - 1, (y, m, d)),
            None => (year - 1, (year + NODE_CERT_YEARS, 1, 1)),
        };
        params.not_before = rcgen::date_time_ymd(before, 1, 1);
        params.not_after = rcgen::date_time_ymd(after.0, after.1, after.2);
        let cert = params
            .signed_by(&key, &self.issuer, &self.key)
            .map_err(gen_err)?;
        let key_pem = key.serialize_pem();
        Ok(NodeIdentity {
            node: node.to_string(),
            kind,
            cert_chain: vec![cert.der().clone()],
            key: PrivateKeyDer::Pkcs8(key.serialize_der().into()),
            key_pem,
            ca_cert: self.cert_der.clone(),
        })
    }
}

/// A node's credentials: its certificate chain and key, and the cluster CA certificate.
pub struct NodeIdentity {
    /// The node name (the CN of its certificate).
    pub node: String,
    /// What the holder may do (the O of its certificate).
    pub kind: CertKind,
    cert_chain: Vec<CertificateDer<'static>>,
    key: PrivateKeyDer<'static>,
    key_pem: String,
    ca_cert: CertificateDer<'static>,
}

impl std::fmt::Debug for NodeIdentity {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NodeIdentity")
            .field("node", &self.node)
            .field("kind", &self.kind)
            .finish_non_exhaustive()
    }
}

impl Clone for NodeIdentity {
    fn clone(&self) -> Self {
        Self {
            node: self.node.clone(),
            kind: self.kind,
            cert_chain: self.cert_chain.clone(),
            key: self.key.clone_key(),
            key_pem: self.key_pem.clone(),
            ca_cert: self.ca_cert.clone(),
        }
    }
}

fn pem_encode(tag: &str, der: &[u8]) -> String {
    // rcgen's `pem` dependency is not re-exported; a minimal encoder keeps the deps small.
    const ALPHABET: &[u8; 64] = b"ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789+/";
    let mut b64 = String::with_capacity(der.len().div_ceil(3) * 4);
    for chunk in der.chunks(3) {
        let n = chunk.len();
        let v = (u32::from(chunk[0]) << 16)
            | (u32::from(*chunk.get(1).unwrap_or(&0)) << 8)
            | u32::from(*chunk.get(2).unwrap_or(&0));
        for i in 0..4 {
            if i <= n {
                b64.push(ALPHABET[((v >> (18 - 6 * i)) & 63) as usize] as char);
            } else {
                b64.push('=');
            }
        }
    }
    let mut out = format!("-----BEGIN {tag}-----\n");
    for line in b64.as_bytes().chunks(64) {
        out.push_str(std::str::from_utf8(line).unwrap_or_default());
        out.push('\n');
    }
    out.push_str(&format!("-----END {tag}-----\n"));
    out
}

impl NodeIdentity {
    /// Convenience for tests and single-host setups: issues `node`'s identity from `ca`,
    /// of kind `node` (it may lead and spawn).
    pub fn dev(node: &str, ca: &ClusterCa) -> Result<Self, TlsError> {
        ca.issue(node, CertKind::Node)
    }

    /// The node's certificate chain (leaf first).
    pub fn cert_chain(&self) -> &[CertificateDer<'static>] {
        &self.cert_chain
    }

    /// When the certificate expires (its notAfter), if it parses.
    pub fn not_after(&self) -> Option<SystemTime> {
        let leaf = self.cert_chain.first()?;
        let (_, parsed) = x509_parser::parse_x509_certificate(leaf).ok()?;
        let secs = parsed.validity().not_after.timestamp();
        let secs = u64::try_from(secs).ok()?;
        Some(UNIX_EPOCH + Duration::from_secs(secs))
    }

    /// The cluster CA certificate this identity trusts.
    pub fn ca_cert(&self) -> &CertificateDer<'static> {
        &self.ca_cert
    }

    /// Writes `<node>.pem`, `<node>.key` (mode 0600) and `ca.pem` into `dir`.
    ///
    /// An existing `ca.pem` holding a different certificate is an error, not overwritten.
    pub fn save(&self, dir: &Path) -> Result<(), TlsError> {
        fs::create_dir_all(dir).map_err(io_err(dir))?;
        let ca_path = dir.join(CA_CERT_FILE);
        if ca_path.exists() {
            let existing = read_file(&ca_path, "")?;
            let same = parse_certs(&ca_path, &existing)
                .map(|c| c[0] == self.ca_cert)
                .unwrap_or(false);
            if !same {
                return Err(TlsError::CaMismatch { path: ca_path });
            }
        } else {
            write_file(
                &ca_path,
                pem_encode("CERTIFICATE", &self.ca_cert).as_bytes(),
                false,
            )?;
        }
        let chain: String = self
            .cert_chain
            .iter()
            .map(|c| pem_encode("CERTIFICATE", c))
            .collect();
        write_file(
            &dir.join(format!("{}.pem", self.node)),
            chain.as_bytes(),
            false,
        )?;
        write_file(
            &dir.join(format!("{}.key", self.node)),
            self.key_pem.as_bytes(),
            true,
        )
    }

    /// Loads `<node>.pem`, `<node>.key` and `ca.pem` from `dir` and checks that the
    /// certificate names `node` and was issued by the CA in `ca.pem`.
    pub fn load(dir: &Path, node: &str) -> Result<Self, TlsError> {
        validate_node_name(node)?;
        let hint = format!(
            "issue it with the cluster CA: `yatt-node cert --ca-dir CA_DIR --name {node} --out {}` (create a CA first with `yatt-node init --dir CA_DIR`), or run with --dev for a local dev cluster",
            dir.display()
        );
        let cert_path = dir.join(format!("{node}.pem"));
        let key_path = dir.join(format!("{node}.key"));
        let ca_path = dir.join(CA_CERT_FILE);
        let cert_chain = parse_certs(&cert_path, &read_file(&cert_path, &hint)?)?;
        let key_pem_bytes = read_file(&key_path, &hint)?;
        let ca_cert = parse_certs(&ca_path, &read_file(&ca_path, &hint)?)?
            .into_iter()
            .next()
            .ok_or_else(|| TlsError::BadFile {
                path: ca_path.clone(),
                reason: "no certificate".into(),
            })?;
        let key_pair = parse_key_pair(&key_path, &key_pem_bytes)?;
        let bad = |path: &Path, reason: String| TlsError::BadFile {
            path: path.to_path_buf(),
            reason,
        };
        let leaf = &cert_chain[0];
        let cn = cert_common_name(leaf).map_err(|e| bad(&cert_path, e))?;
        if cn != node {
            return Err(bad(
                &cert_path,
                format!("certificate is for node {cn:?}, not {node:?}"),
            ));
        }
        let kind =
            cert_kind(leaf).map_err(|e| bad(&cert_path, format!("{e}; {}", reissue_hint(node))))?;
        let (_, issuer) = cert_names(leaf).map_err(|e| bad(&cert_path, e))?;
        let (ca_subject, _) = cert_names(&ca_cert).map_err(|e| bad(&ca_path, e))?;
        if issuer != ca_subject {
            return Err(bad(
                &cert_path,
                format!(
                    "certificate was not issued by the CA in {}",
                    ca_path.display()
                ),
            ));
        }
        let (_, leaf_parsed) = x509_parser::parse_x509_certificate(leaf)
            .map_err(|e| bad(&cert_path, e.to_string()))?;
        if leaf_parsed.public_key().raw != key_pair.public_key_der().as_slice() {
            return Err(bad(
                &key_path,
                format!("private key does not match {}", cert_path.display()),
            ));
        }
        Ok(Self {
            node: node.to_string(),
            kind,
            cert_chain,
            key: PrivateKeyDer::Pkcs8(key_pair.serialize_der().into()),
            key_pem: String::from_utf8_lossy(&key_pem_bytes).into_owned(),
            ca_cert,
        })
    }

    fn roots(&self) -> Result<Arc<RootCertStore>, TlsError> {
        let mut roots = RootCertStore::empty();
        roots.add(self.ca_cert.clone())?;
        Ok(Arc::new(roots))
    }

    /// rustls server configuration: requires a client certificate chained to the cluster CA.
    pub fn rustls_server_config(&self) -> Result<rustls::ServerConfig, TlsError> {
        let provider = provider();
        let verifier = WebPkiClientVerifier::builder_with_provider(self.roots()?, provider.clone())
            .build()
            .map_err(|e| TlsError::Verifier(e.to_string()))?;
        let mut cfg = rustls::ServerConfig::builder_with_provider(provider)
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_client_cert_verifier(verifier)
            .with_single_cert(self.cert_chain.clone(), self.key.clone_key())?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }

    /// rustls client configuration: presents the node certificate and verifies the server
    /// against the cluster CA.
    pub fn rustls_client_config(&self) -> Result<rustls::ClientConfig, TlsError> {
        let mut cfg = rustls::ClientConfig::builder_with_provider(provider())
            .with_protocol_versions(&[&rustls::version::TLS13])?
            .with_root_certificates(self.roots()?)
            .with_client_auth_cert(self.cert_chain.clone(), self.key.clone_key())?;
        cfg.alpn_protocols = vec![ALPN.to_vec()];
        Ok(cfg)
    }

    /// quinn server configuration with the default [`TransportTuning`].
    pub fn server_config(&self) -> Result<quinn::ServerConfig, TlsError> {
        self.server_config_with(&TransportTuning::default())
    }

    /// quinn server configuration with the given transport tuning.
    pub fn server_config_with(
        &self,
        tuning: &TransportTuning,
    ) -> Result<quinn::ServerConfig, TlsError> {
        let crypto =
            quinn::crypto::rustls::QuicServerConfig::try_from(self.rustls_server_config()?)
                .map_err(|e| TlsError::Quic(e.to_string()))?;
        let mut cfg = quinn::ServerConfig::with_crypto(Arc::new(crypto));
        cfg.transport_config(Arc::new(tuning.transport_config()?));
        Ok(cfg)
    }

    /// quinn client configuration with the default [`TransportTuning`]; connect with
    /// server name [`SERVER_NAME`].
    pub fn client_config(&self) -> Result<quinn::ClientConfig, TlsError> {
        self.client_config_with(&TransportTuning::default())
    }

    /// quinn client configuration with the given transport tuning.
    pub fn client_config_with(
        &self,
        tuning: &TransportTuning,
    ) -> Result<quinn::ClientConfig, TlsError> {
        client_from_rustls(self.rustls_client_config()?, tuning)
    }
}

fn client_from_rustls(
    crypto: rustls::ClientConfig,
    tuning: &TransportTuning,
) -> Result<quinn::ClientConfig, TlsError> {
    let crypto = quinn::crypto::rustls::QuicClientConfig::try_from(crypto)
        .map_err(|e| TlsError::Quic(e.to_string()))?;
    let mut cfg = quinn::ClientConfig::new(Arc::new(crypto));
    cfg.transport_config(Arc::new(tuning.transport_config()?));
    Ok(cfg)
}

/// Who a verified peer is: its node name (the CN) and its kind (the O).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PeerIdentity {
    /// The node name.
    pub name: String,
    /// What it may do.
    pub kind: CertKind,
}

/// The peer's node name and kind, read from its verified certificate.
pub fn peer_identity(conn: &quinn::Connection) -> Result<PeerIdentity, TlsError> {
    let identity = conn.peer_identity().ok_or(TlsError::NoPeerCertificate)?;
    let certs = identity
        .downcast::<Vec<CertificateDer<'static>>>()
        .map_err(|_| TlsError::BadPeerCertificate("unexpected peer identity type".into()))?;
    let leaf = certs.first().ok_or(TlsError::NoPeerCertificate)?;
    let name = cert_common_name(leaf).map_err(TlsError::BadPeerCertificate)?;
    validate_node_name(&name)
        .map_err(|_| TlsError::BadPeerCertificate(format!("CN {name:?} is not a node name")))?;
    let kind = cert_kind(leaf).map_err(|e| {
        TlsError::BadPeerCertificate(format!("{name}: {e}; {}", reissue_hint(&name)))
    })?;
    Ok(PeerIdentity { name, kind })
}

/// The intruder client of the tests: one file, shared with the integration tests.
#[cfg(test)]
#[path = "../../integration-tests/src/insecure.rs"]
mod insecure;

/// Loopback helpers shared by the unit tests of this crate.
#[cfg(test)]
pub(crate) mod test_support {
    use super::*;
    use std::net::{Ipv4Addr, SocketAddr};

    /// Fails unless `encoded` (one value of every message of a kind, `what`) still has
    /// the `fingerprint` pinned with today's [`ALPN`]: a change to how the messages
    /// encode must bump the ALPN, then pin the new fingerprint.
    pub fn assert_pinned_to_alpn(what: &str, encoded: Vec<Vec<u8>>, fingerprint: u32) {
        assert_eq!(
            (
                String::from_utf8_lossy(ALPN).into_owned(),
                wire_fingerprint(&encoded)
            ),
            ("yatt/11".to_string(), fingerprint),
            "the {what} encode differently: bump ALPN in runtime/src/tls.rs and pin the new fingerprint"
        );
    }

    /// A server endpoint on 127.0.0.1:0 for `id`.
    pub fn server(id: &NodeIdentity) -> quinn::Endpoint {
        let cfg = id.server_config().expect("server config");
        quinn::Endpoint::server(cfg, SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).expect("bind")
    }

    /// A client endpoint on 127.0.0.1:0 with `cfg` as default client config.
    pub fn client(cfg: quinn::ClientConfig) -> quinn::Endpoint {
        let mut ep =
            quinn::Endpoint::client(SocketAddr::from((Ipv4Addr::LOCALHOST, 0))).expect("bind");
        ep.set_default_client_config(cfg);
        ep
    }

    /// A connected mTLS pair: (client connection, server connection, endpoints to keep alive).
    pub async fn connected_pair() -> (
        quinn::Connection,
        quinn::Connection,
        (quinn::Endpoint, quinn::Endpoint),
    ) {
        let ca = ClusterCa::generate("test").expect("ca");
        let a = ca.issue("node-a", CertKind::Node).expect("a");
        let b = ca.issue("node-b", CertKind::Node).expect("b");
        let srv = server(&a);
        let addr = srv.local_addr().expect("addr");
        let cli = client(b.client_config().expect("client config"));
        let accept = {
            let srv = srv.clone();
            tokio::spawn(async move {
                let inc = srv.accept().await.expect("incoming");
                inc.await.expect("server handshake")
            })
        };
        let c = tokio::time::timeout(Duration::from_secs(10), async {
            cli.connect(addr, SERVER_NAME).expect("connect").await
        })
        .await
        .expect("handshake timed out")
        .expect("client handshake");
        let s = tokio::time::timeout(Duration::from_secs(10), accept)
            .await
            .expect("accept timed out")
            .expect("join");
        (c, s, (srv, cli))
    }
}

#[cfg(test)]
mod tests {
    use super::test_support::*;
    use super::*;

    const T: Duration = Duration::from_secs(10);

    fn tmpdir(tag: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!(
            "yatt-tls-{tag}-{}-{}",
            std::process::id(),
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos())
                .unwrap_or(0)
        ));
        fs::create_dir_all(&d).expect("mkdir");
        d
    }

    #[test]
    fn node_names() {
        for ok in ["a", "node-1", "0", "n.b_c-d", &"a".repeat(63)] {
            validate_node_name(ok).expect(ok);
        }
        for bad in [
            "",
            "-a",
            "A",
            "a b",
            "a/b",
            ".a",
            "_a",
            &"a".repeat(64),
            "né",
        ] {
            assert!(validate_node_name(bad).is_err(), "{bad:?}");
        }
        let ca = ClusterCa::generate("c").expect("ca");
        assert!(matches!(
            ca.issue("Bad", CertKind::Node),
            Err(TlsError::InvalidNodeName { .. })
        ));
    }

    #[test]
    fn save_load_roundtrip_and_errors() {
        let dir = tmpdir("save");
        let err = ClusterCa::load(&dir).expect_err("empty dir");
        let msg = err.to_string();
        assert!(
            msg.contains("ca.pem") && msg.contains("yatt-node init --dir"),
            "{msg}"
        );

        let ca = ClusterCa::generate("c1").expect("ca");
        ca.save(&dir).expect("save");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.join("ca.key"))
                .expect("meta")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let loaded = ClusterCa::load(&dir).expect("load");
        assert_eq!(loaded.cert_der(), ca.cert_der());
        assert_eq!(loaded.cert_pem(), ca.cert_pem());

        // A node issued by the *loaded* CA still chains to the original certificate.
        let n = loaded.issue("n1", CertKind::Node).expect("issue");
        n.save(&dir).expect("save node");
        #[cfg(unix)]
        {
            use std::os::unix::fs::PermissionsExt;
            let mode = fs::metadata(dir.join("n1.key"))
                .expect("meta")
                .permissions()
                .mode();
            assert_eq!(mode & 0o777, 0o600);
        }
        let n2 = NodeIdentity::load(&dir, "n1").expect("load node");
        assert_eq!(n2.node, "n1");
        assert_eq!(n2.cert_chain(), n.cert_chain());
        n2.server_config().expect("server cfg");
        n2.client_config().expect("client cfg");

        let err = NodeIdentity::load(&dir, "n9").expect_err("missing");
        assert!(err.to_string().contains("n9.pem"), "{err}");

        // Garbage in a key file names the file.
        fs::write(dir.join("n1.key"), b"garbage").expect("write");
        let err = NodeIdentity::load(&dir, "n1").expect_err("bad key");
        assert!(err.to_string().contains("n1.key"), "{err}");

        // A different CA's node cannot be saved next to this ca.pem.
        let other = ClusterCa::generate("c2")
            .expect("ca2")
            .issue("n3", CertKind::Node)
            .expect("n3");
        assert!(matches!(other.save(&dir), Err(TlsError::CaMismatch { .. })));
        let _ = fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_certificate_carries_its_kind_and_one_without_a_kind_is_refused() {
        let dir = tmpdir("kind");
        let ca = ClusterCa::generate("c").expect("ca");
        for kind in CertKind::ALL {
            let name = format!("n-{kind}");
            ca.issue(&name, kind)
                .expect("issue")
                .save(&dir)
                .expect("save");
            assert_eq!(NodeIdentity::load(&dir, &name).expect("load").kind, kind);
        }
        // A certificate issued before kinds existed (no O) is refused, saying how to
        // issue one again.
        let key = KeyPair::generate().expect("key");
        let mut params = CertificateParams::default();
        let mut dn = DistinguishedName::new();
        dn.push(DnType::CommonName, "old");
        params.distinguished_name = dn;
        let cert = params.signed_by(&key, &ca.issuer, &ca.key).expect("sign");
        write_file(
            &dir.join("old.pem"),
            pem_encode("CERTIFICATE", cert.der()).as_bytes(),
            false,
        )
        .expect("write");
        write_file(&dir.join("old.key"), key.serialize_pem().as_bytes(), true).expect("write");
        let e = NodeIdentity::load(&dir, "old")
            .expect_err("no kind")
            .to_string();
        assert!(
            e.contains("old.pem") && e.contains("names no kind") && e.contains("--kind"),
            "{e}"
        );
        let _ = fs::remove_dir_all(&dir);
    }

    /// Spawns an echo server for one connection; returns the peer name it saw.
    fn spawn_echo(srv: quinn::Endpoint) -> tokio::task::JoinHandle<Result<String, String>> {
        tokio::spawn(async move {
            let inc = srv.accept().await.ok_or("endpoint closed")?;
            let conn = inc.await.map_err(|e| format!("handshake: {e}"))?;
            let peer = peer_identity(&conn).map_err(|e| e.to_string())?.name;
            let (mut send, mut recv) = conn.accept_bi().await.map_err(|e| e.to_string())?;
            let data = recv.read_to_end(1024).await.map_err(|e| e.to_string())?;
            send.write_all(&data).await.map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            conn.closed().await;
            Ok(peer)
        })
    }

    #[tokio::test]
    async fn mtls_handshake_echo_and_peer_names() {
        let ca = ClusterCa::generate("test").expect("ca");
        let a = ca.issue("node-a", CertKind::Node).expect("a");
        let b = NodeIdentity::dev("node-b", &ca).expect("b");
        let srv = server(&a);
        let addr = srv.local_addr().expect("addr");
        let task = spawn_echo(srv.clone());
        let cli = client(b.client_config().expect("cfg"));
        let conn = tokio::time::timeout(T, cli.connect(addr, SERVER_NAME).expect("connect"))
            .await
            .expect("timeout")
            .expect("handshake");
        assert_eq!(
            peer_identity(&conn).expect("peer"),
            PeerIdentity {
                name: "node-a".into(),
                kind: CertKind::Node
            }
        );
        assert_eq!(
            conn.handshake_data()
                .and_then(|h| h.downcast::<quinn::crypto::rustls::HandshakeData>().ok())
                .and_then(|h| h.protocol),
            Some(ALPN.to_vec())
        );
        let (mut send, mut recv) = conn.open_bi().await.expect("open");
        send.write_all(b"hello yatt").await.expect("write");
        send.finish().expect("finish");
        let echoed = tokio::time::timeout(T, recv.read_to_end(1024))
            .await
            .expect("timeout")
            .expect("read");
        assert_eq!(echoed, b"hello yatt");
        conn.close(0u32.into(), b"done");
        let seen = tokio::time::timeout(T, task)
            .await
            .expect("timeout")
            .expect("join")
            .expect("server");
        assert_eq!(seen, "node-b");
        srv.close(0u32.into(), b"");
    }

    /// Connects with `client_cfg` to a server for `server_id`; returns (client result, server result).
    async fn attempt(
        server_id: &NodeIdentity,
        client_cfg: quinn::ClientConfig,
    ) -> (Result<(), String>, Result<(), String>) {
        let srv = server(server_id);
        let addr = srv.local_addr().expect("addr");
        let srv2 = srv.clone();
        let server_side = tokio::spawn(async move {
            let inc = srv2.accept().await.ok_or("closed")?;
            let conn = inc.await.map_err(|e| e.to_string())?;
            // With TLS 1.3 the server's verdict on the client certificate comes last;
            // a connection that gets here was accepted.
            let _ = conn.accept_bi().await;
            Ok::<(), String>(())
        });
        let cli = client(client_cfg);
        let client_side = tokio::time::timeout(T, async {
            let conn = cli
                .connect(addr, SERVER_NAME)
                .map_err(|e| e.to_string())?
                .await
                .map_err(|e| e.to_string())?;
            // The client may finish its half of the handshake before the server rejects
            // its certificate; then the refusal arrives as a connection close.
            let (mut send, mut recv) = conn.open_bi().await.map_err(|e| e.to_string())?;
            send.write_all(b"x").await.map_err(|e| e.to_string())?;
            send.finish().map_err(|e| e.to_string())?;
            recv.read_to_end(16).await.map_err(|e| e.to_string())?;
            Ok::<(), String>(())
        })
        .await
        .unwrap_or_else(|_| Err("client timed out".into()));
        let server_res = tokio::time::timeout(T, server_side)
            .await
            .map_err(|_| "server timed out".to_string())
            .and_then(|j| j.map_err(|e| e.to_string()))
            .and_then(|r| r);
        srv.close(0u32.into(), b"");
        cli.close(0u32.into(), b"");
        (client_side, server_res)
    }

    #[tokio::test]
    async fn self_signed_client_is_refused() {
        let ca = ClusterCa::generate("test").expect("ca");
        let a = ca.issue("node-a", CertKind::Node).expect("a");
        let (c, s) = attempt(
            &a,
            insecure::self_signed_client_config("node-b", SERVER_NAME, ALPN),
        )
        .await;
        assert!(s.is_err(), "server accepted a self-signed client");
        assert!(c.is_err(), "client exchanged data");
        let msg = s.err().unwrap_or_default();
        assert!(!msg.contains("timed out"), "{msg}");
    }

    #[tokio::test]
    async fn client_from_other_ca_is_refused() {
        let ca = ClusterCa::generate("test").expect("ca");
        let other = ClusterCa::generate("test").expect("other ca");
        let a = ca.issue("node-a", CertKind::Node).expect("a");
        // The intruder trusts our CA (so it accepts our server) but its cert is foreign.
        let intruder = other.issue("node-b", CertKind::Node).expect("b");
        let mut forged = intruder.clone();
        forged.ca_cert = ca.cert_der().clone();
        let (c, s) = attempt(&a, forged.client_config().expect("cfg")).await;
        assert!(s.is_err(), "server accepted a client from another CA");
        assert!(c.is_err());
        assert!(!s.err().unwrap_or_default().contains("timed out"));
    }

    #[tokio::test]
    async fn server_from_other_ca_is_refused() {
        let ca = ClusterCa::generate("test").expect("ca");
        let other = ClusterCa::generate("test").expect("other ca");
        let rogue = other.issue("node-a", CertKind::Node).expect("a");
        let b = ca.issue("node-b", CertKind::Node).expect("b");
        let (c, _s) = attempt(&rogue, b.client_config().expect("cfg")).await;
        let msg = c.expect_err("client accepted a server from another CA");
        assert!(!msg.contains("timed out"), "{msg}");
    }

    #[tokio::test]
    async fn reloaded_ca_issues_compatible_certs() {
        let dir = tmpdir("reload");
        let ca = ClusterCa::generate("test").expect("ca");
        ca.save(&dir).expect("save");
        let reloaded = ClusterCa::load(&dir).expect("load");
        let a = ca.issue("node-a", CertKind::Node).expect("a");
        let b = reloaded.issue("node-b", CertKind::Node).expect("b");
        b.save(&dir).expect("save b");
        let b = NodeIdentity::load(&dir, "node-b").expect("load b");
        // The server side of `attempt` returns Ok only after a completed mTLS handshake.
        let (_, s) = attempt(&a, b.client_config().expect("cfg")).await;
        assert_eq!(s, Ok(()));
        let (_, s) = attempt(&b, a.client_config().expect("cfg")).await;
        assert_eq!(s, Ok(()));
        let _ = fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn connected_pair_works() {
        let (c, s, _eps) = connected_pair().await;
        assert_eq!(peer_identity(&c).expect("c").name, "node-a");
        assert_eq!(peer_identity(&s).expect("s").name, "node-b");
    }
}
