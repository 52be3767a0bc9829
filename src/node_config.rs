//! `yatt-node`'s configuration: a TOML file, overridden by `YATT_NODE__SECTION__KEY`
//! environment variables, overridden by flags. Every bad value is reported with where
//! it came from, the key, what was expected and what was found.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::{Deserialize, Serialize};
use yatt_runtime::NodeConfig;
use yatt_runtime::TransportConfig;
use yatt_runtime::{BulkLimits, FrameLimits};

/// Prefix of environment overrides: `YATT_NODE__NODE__LISTEN=127.0.0.1:7400`.
pub const ENV_PREFIX: &str = "YATT_NODE";

/// Errors loading or validating the configuration.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    /// The file could not be read or parsed, or a value had the wrong type.
    #[error("{source_name}: {message}")]
    Load {
        /// The file (or "environment"/"flags").
        source_name: String,
        /// What the config crate said, with the key where it knows it.
        message: String,
    },
    /// A value had the right type but is not acceptable.
    #[error("{origin}: `{key}` = {found:?}: expected {expected}")]
    Invalid {
        /// Where the value came from: the file, an environment variable or a flag.
        origin: String,
        /// The dotted key, e.g. `node.listen`.
        key: String,
        /// What was expected.
        expected: String,
        /// What was found.
        found: String,
    },
}

/// `[node]`
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct NodeSection {
    /// The node's name; must match its certificate.
    pub name: String,
    /// QUIC listen address.
    pub listen: String,
    /// Address peers should use, if not the listen address.
    pub advertise: Option<String>,
    /// A member to join through; absent for the first node (the directory leader).
    pub seed: Option<String>,
    /// Virtual devices to offer when there is no GPU.
    pub virtual_devices: u32,
    /// Mailbox capacity of hosted actors.
    pub mailbox_capacity: usize,
    /// Where to write `{"name","addr","http","pid"}` once serving (for scripts and tests).
    pub ready_file: Option<PathBuf>,
    /// The only tree the node's roles write into for a peer (checkpoints).
    pub data_dir: PathBuf,
}

impl Default for NodeSection {
    fn default() -> Self {
        NodeSection {
            name: "node-0".into(),
            listen: "127.0.0.1:7400".into(),
            advertise: None,
            seed: None,
            virtual_devices: 1,
            mailbox_capacity: 1024,
            ready_file: None,
            data_dir: PathBuf::from("."),
        }
    }
}

/// `[tls]`
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TlsSection {
    /// Directory with `ca.pem`, `<name>.pem` and `<name>.key`.
    pub dir: PathBuf,
    /// Dev mode: keep a cluster CA in `dir` and issue this node's certificate at start.
    pub dev: bool,
}

impl Default for TlsSection {
    fn default() -> Self {
        TlsSection {
            dir: "certs".into(),
            dev: false,
        }
    }
}

/// `[http]`
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct HttpSection {
    /// Address of `/health` and `/metrics`; empty disables the HTTP server.
    pub listen: String,
}

impl Default for HttpSection {
    fn default() -> Self {
        HttpSection {
            listen: "127.0.0.1:7480".into(),
        }
    }
}

/// `[membership]`
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct MembershipSection {
    /// Heartbeat period in milliseconds.
    pub heartbeat_ms: u64,
    /// Silence in milliseconds after which a peer is declared dead.
    pub failure_timeout_ms: u64,
}

impl Default for MembershipSection {
    fn default() -> Self {
        MembershipSection {
            heartbeat_ms: 500,
            failure_timeout_ms: 2000,
        }
    }
}

/// `[transport]`
#[derive(Debug, Clone, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct TransportSection {
    /// Largest control frame in bytes.
    pub max_frame_bytes: usize,
    /// Largest bulk payload in bytes.
    pub max_bulk_bytes: u64,
    /// Shared-memory fast path for bulk payloads between processes on one host.
    pub shm_fast_path: bool,
    /// Handshake deadline in milliseconds.
    pub connect_timeout_ms: u64,
    /// How long shutdown drains in-flight requests, in milliseconds.
    pub drain_timeout_ms: u64,
    /// Largest UDP payload sent (path MTU discovery probes up to it) and accepted.
    pub max_udp_payload: u16,
    /// UDP payload size of the first packets, before MTU discovery.
    pub initial_udp_payload: u16,
    /// Most memory kept in unused receive buffers for bulk payloads, in bytes.
    pub recv_pool_bytes: usize,
    /// Milliseconds an unused receive buffer or shared-memory segment is kept before
    /// it is freed (0: kept).
    pub pool_idle_ms: u64,
    /// UDP socket send and receive buffer size requested, in bytes.
    pub socket_buffer_bytes: usize,
    /// Ceiling on each connection's congestion window, in bytes (0: none).
    pub max_congestion_window: u64,
}

impl Default for TransportSection {
    fn default() -> Self {
        let t = TransportConfig::default();
        TransportSection {
            max_frame_bytes: t.frame_limits.max_frame,
            max_bulk_bytes: t.bulk_limits.max_bulk,
            shm_fast_path: t.shm_fast_path,
            connect_timeout_ms: t.connect_timeout.as_millis() as u64,
            drain_timeout_ms: 10_000,
            max_udp_payload: t.max_udp_payload,
            initial_udp_payload: t.initial_udp_payload,
            recv_pool_bytes: t.recv_pool_bytes,
            pool_idle_ms: t.pool_idle.as_millis() as u64,
            socket_buffer_bytes: t.socket_buffer,
            max_congestion_window: t.max_congestion_window,
        }
    }
}

/// The whole file.
#[derive(Debug, Clone, Default, Serialize, Deserialize, schemars::JsonSchema)]
#[serde(deny_unknown_fields, default)]
pub struct NodeFile {
    /// `[node]`
    pub node: NodeSection,
    /// `[tls]`
    pub tls: TlsSection,
    /// `[http]`
    pub http: HttpSection,
    /// `[membership]`
    pub membership: MembershipSection,
    /// `[transport]`
    pub transport: TransportSection,
}

/// An address as configured: a socket address, or a `host:port` looked up at start.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Endpoint {
    /// An address literal.
    Addr(SocketAddr),
    /// `host:port`, to look up.
    Name(String),
}

impl Endpoint {
    /// The address, when it is a literal.
    pub fn addr(&self) -> Option<SocketAddr> {
        match self {
            Endpoint::Addr(a) => Some(*a),
            Endpoint::Name(_) => None,
        }
    }
}

impl std::fmt::Display for Endpoint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Endpoint::Addr(a) => write!(f, "{a}"),
            Endpoint::Name(n) => f.write_str(n),
        }
    }
}

/// A validated configuration, ready to start a node.
#[derive(Debug, Clone)]
pub struct ResolvedNode {
    /// The node's name.
    pub name: String,
    /// Runtime settings. `seed` and `advertise` are set here only when configured as
    /// address literals; a host name is in [`ResolvedNode::seed`] and
    /// [`ResolvedNode::advertise`] until the daemon looks it up.
    pub runtime: NodeConfig,
    /// `node.seed` as configured.
    pub seed: Option<Endpoint>,
    /// `node.advertise` as configured.
    pub advertise: Option<Endpoint>,
    /// TLS settings.
    pub tls: TlsSection,
    /// HTTP address, if enabled.
    pub http: Option<SocketAddr>,
    /// Ready file, if any.
    pub ready_file: Option<PathBuf>,
}

/// Loads `file` (optional), then environment overrides, then `flags` (dotted key →
/// value, e.g. `("node.listen", "127.0.0.1:0")`), and validates the result.
pub fn load(file: Option<&Path>, flags: &[(&str, String)]) -> Result<ResolvedNode, ConfigError> {
    let mut b = config::Config::builder();
    let file_name = file.map(|f| f.display().to_string());
    if let Some(f) = file {
        if !f.exists() {
            return Err(ConfigError::Load {
                source_name: f.display().to_string(),
                message: "file not found (see config/node.toml for an example)".into(),
            });
        }
        b = b.add_source(config::File::from(f).format(config::FileFormat::Toml));
    }
    b = b.add_source(
        config::Environment::with_prefix(ENV_PREFIX)
            .prefix_separator("__")
            .separator("__")
            .try_parsing(true),
    );
    for (key, value) in flags {
        b = b
            .set_override(*key, value.as_str())
            .map_err(|e| ConfigError::Load {
                source_name: "flags".into(),
                message: e.to_string(),
            })?;
    }
    let source_name = file_name.clone().unwrap_or_else(|| "configuration".into());
    let built = b.build().map_err(|e| ConfigError::Load {
        source_name: source_name.clone(),
        message: e.to_string(),
    })?;
    let parsed: NodeFile = built.try_deserialize().map_err(|e| ConfigError::Load {
        source_name: source_name.clone(),
        message: e.to_string(),
    })?;
    let origin = |key: &str| -> String {
        if let Some((flag, _)) = flags.iter().find(|(k, _)| *k == key) {
            return format!("flag for {flag}");
        }
        let env = format!("{ENV_PREFIX}__{}", key.replace('.', "__").to_uppercase());
        if std::env::var_os(&env).is_some() {
            return format!("environment variable {env}");
        }
        file_name.clone().unwrap_or_else(|| "default".into())
    };
    validate(parsed, &origin)
}

fn validate(f: NodeFile, origin: &dyn Fn(&str) -> String) -> Result<ResolvedNode, ConfigError> {
    let invalid = |key: &str, expected: &str, found: String| ConfigError::Invalid {
        origin: origin(key),
        key: key.into(),
        expected: expected.into(),
        found,
    };
    let addr = |key: &str, v: &str| -> Result<SocketAddr, ConfigError> {
        v.parse().map_err(|_| {
            invalid(
                key,
                "a socket address such as 127.0.0.1:7400 or [::1]:7400",
                v.into(),
            )
        })
    };
    yatt_runtime::validate_node_name(&f.node.name).map_err(|_| {
        invalid(
            "node.name",
            "1-63 characters of a-z 0-9 - _ . starting with a letter or digit",
            f.node.name.clone(),
        )
    })?;
    let listen = addr("node.listen", &f.node.listen)?;
    // The seed and the advertised address may name a host (`gpu01:7400`,
    // `yatt-0.yatt:7400`): a launcher knows names, not addresses. The daemon looks
    // them up at start.
    let endpoint = |key: &str, v: &str| -> Result<Endpoint, ConfigError> {
        match v.parse::<SocketAddr>() {
            Ok(a) => Ok(Endpoint::Addr(a)),
            Err(_) if crate::launch::dns::split_host_port(v).is_some() => {
                Ok(Endpoint::Name(v.to_string()))
            }
            Err(_) => Err(invalid(
                key,
                "HOST:PORT or a socket address, e.g. gpu01:7400 or 10.0.0.1:7400",
                v.into(),
            )),
        }
    };
    let advertise = f
        .node
        .advertise
        .as_deref()
        .filter(|s| !s.is_empty())
        .map(|v| endpoint("node.advertise", v))
        .transpose()?;
    let seed = f
        .node
        .seed
        .as_deref()
        .filter(|s| !s.is_empty())
        .map(|v| endpoint("node.seed", v))
        .transpose()?;
    let http = (!f.http.listen.is_empty())
        .then(|| addr("http.listen", &f.http.listen))
        .transpose()?;
    if f.membership.heartbeat_ms == 0 || f.membership.heartbeat_ms > 10_000 {
        return Err(invalid(
            "membership.heartbeat_ms",
            "1 to 10000",
            f.membership.heartbeat_ms.to_string(),
        ));
    }
    if f.membership.failure_timeout_ms < 2 * f.membership.heartbeat_ms
        || f.membership.failure_timeout_ms > 120_000
    {
        return Err(invalid(
            "membership.failure_timeout_ms",
            "at least twice membership.heartbeat_ms and at most 120000",
            f.membership.failure_timeout_ms.to_string(),
        ));
    }
    if f.node.mailbox_capacity == 0 {
        return Err(invalid(
            "node.mailbox_capacity",
            "a positive number",
            "0".into(),
        ));
    }
    if f.transport.max_frame_bytes < 1024 || f.transport.max_frame_bytes > u32::MAX as usize {
        return Err(invalid(
            "transport.max_frame_bytes",
            "1024 to 4294967295",
            f.transport.max_frame_bytes.to_string(),
        ));
    }
    let (lo, hi) = (yatt_runtime::MIN_UDP_PAYLOAD, yatt_runtime::MAX_UDP_PAYLOAD);
    if !(lo..=hi).contains(&f.transport.max_udp_payload) {
        return Err(invalid(
            "transport.max_udp_payload",
            "1200 to 65527",
            f.transport.max_udp_payload.to_string(),
        ));
    }
    if !(lo..=f.transport.max_udp_payload).contains(&f.transport.initial_udp_payload) {
        return Err(invalid(
            "transport.initial_udp_payload",
            "1200 to transport.max_udp_payload",
            f.transport.initial_udp_payload.to_string(),
        ));
    }
    let mut transport = TransportConfig {
        frame_limits: FrameLimits {
            max_frame: f.transport.max_frame_bytes,
        },
        shm_fast_path: f.transport.shm_fast_path,
        connect_timeout: Duration::from_millis(f.transport.connect_timeout_ms),
        max_udp_payload: f.transport.max_udp_payload,
        initial_udp_payload: f.transport.initial_udp_payload,
        recv_pool_bytes: f.transport.recv_pool_bytes,
        pool_idle: Duration::from_millis(f.transport.pool_idle_ms),
        socket_buffer: f.transport.socket_buffer_bytes,
        max_congestion_window: f.transport.max_congestion_window,
        ..TransportConfig::default()
    };
    transport.bulk_limits = BulkLimits {
        max_bulk: f.transport.max_bulk_bytes,
        frame: transport.frame_limits,
        ..transport.bulk_limits
    };
    let runtime = NodeConfig {
        listen,
        advertise: advertise.as_ref().and_then(Endpoint::addr),
        seed: seed.as_ref().and_then(Endpoint::addr),
        heartbeat_interval: Duration::from_millis(f.membership.heartbeat_ms),
        failure_timeout: Duration::from_millis(f.membership.failure_timeout_ms),
        virtual_devices: f.node.virtual_devices,
        mailbox_capacity: f.node.mailbox_capacity,
        drain_timeout: Duration::from_millis(f.transport.drain_timeout_ms),
        transport,
        data_dir: f.node.data_dir,
        ..NodeConfig::default()
    };
    Ok(ResolvedNode {
        name: f.node.name,
        runtime,
        seed,
        advertise,
        tls: f.tls,
        http,
        ready_file: f.node.ready_file,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(text: &str) -> (tempfile::TempDir, PathBuf) {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("node.toml");
        std::fs::write(&p, text).unwrap();
        (dir, p)
    }

    #[test]
    fn shipped_config_loads() {
        let p = Path::new(env!("CARGO_MANIFEST_DIR")).join("config/node.toml");
        let r = load(Some(&p), &[]).unwrap();
        assert_eq!(r.runtime.failure_timeout, Duration::from_secs(2));
        let t = &r.runtime.transport;
        let d = TransportConfig::default();
        assert_eq!(
            (t.max_udp_payload, t.initial_udp_payload, t.recv_pool_bytes),
            (d.max_udp_payload, d.initial_udp_payload, d.recv_pool_bytes)
        );
        assert_eq!(
            (t.socket_buffer, t.max_congestion_window),
            (d.socket_buffer, d.max_congestion_window)
        );
    }

    #[test]
    fn udp_payload_sizes_are_checked() {
        let (_d, p) = write("[transport]\nmax_udp_payload = 9000\ninitial_udp_payload = 1500\n");
        let r = load(Some(&p), &[]).unwrap();
        assert_eq!(r.runtime.transport.max_udp_payload, 9000);
        assert_eq!(r.runtime.transport.initial_udp_payload, 1500);
        for (text, key) in [
            ("max_udp_payload = 1000", "transport.max_udp_payload"),
            (
                "initial_udp_payload = 9000\nmax_udp_payload = 1500",
                "transport.initial_udp_payload",
            ),
        ] {
            let (_d, p) = write(&format!("[transport]\n{text}\n"));
            let e = load(Some(&p), &[]).unwrap_err().to_string();
            assert!(e.contains(key), "{e}");
        }
    }

    #[test]
    fn flags_override_file() {
        let (_d, p) = write("[node]\nname = \"alpha\"\nlisten = \"127.0.0.1:9\"\n");
        let r = load(Some(&p), &[("node.listen", "127.0.0.1:0".into())]).unwrap();
        assert_eq!(r.name, "alpha");
        assert_eq!(r.runtime.listen.port(), 0);
    }

    #[test]
    fn bad_address_names_file_key_expected_and_found() {
        let (_d, p) = write("[node]\nlisten = \"not-an-address\"\n");
        let e = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(
            e.contains("node.toml")
                && e.contains("node.listen")
                && e.contains("not-an-address")
                && e.contains("expected"),
            "{e}"
        );
    }

    #[test]
    fn wrong_type_names_the_key() {
        let (_d, p) = write("[membership]\nheartbeat_ms = \"often\"\n");
        let e = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(
            e.contains("node.toml") && e.contains("heartbeat_ms") && e.contains("often"),
            "{e}"
        );
    }

    #[test]
    fn unknown_key_is_refused() {
        let (_d, p) = write("[node]\nlisen = \"127.0.0.1:1\"\n");
        let e = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(e.contains("lisen"), "{e}");
    }

    #[test]
    fn failure_timeout_must_exceed_heartbeats() {
        let (_d, p) = write("[membership]\nheartbeat_ms = 500\nfailure_timeout_ms = 600\n");
        let e = load(Some(&p), &[]).unwrap_err().to_string();
        assert!(
            e.contains("membership.failure_timeout_ms") && e.contains("600"),
            "{e}"
        );
    }

    #[test]
    fn missing_file_is_clear() {
        let e = load(Some(Path::new("/nonexistent/node.toml")), &[])
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/nonexistent/node.toml") && e.contains("not found"),
            "{e}"
        );
    }
}
