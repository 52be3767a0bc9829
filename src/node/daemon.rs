//! The daemon's command line and its `run`: `init` creates a cluster CA, `cert` issues
//! node certificates, `run` serves: it joins through a seed (or leads a new cluster),
//! hosts the actors peers spawn through its factory registry, exposes `/health` and
//! `/metrics`, and on SIGTERM stops accepting, drains, leaves the cluster and exits.

use std::path::PathBuf;

use clap::{Parser, Subcommand};
use yatt_runtime::Node;
use yatt_runtime::{CertKind, ClusterCa, NodeIdentity};

use crate::launch::{Launcher, Plan};
use crate::node::error::DaemonError;
use crate::node::roles::Roles;
use crate::node_config::{Endpoint, ResolvedNode};

/// `DaemonError::Failed` with `context`.
fn failed<E: std::error::Error + Send + Sync + 'static>(
    context: String,
) -> impl FnOnce(E) -> DaemonError {
    move |e| DaemonError::Failed {
        context,
        source: Box::new(e),
    }
}

#[derive(Parser)]
#[command(
    name = "yatt-node",
    version,
    about = "Host yatt actors on this machine"
)]
struct Cli {
    /// Log as JSON lines.
    #[arg(long, global = true, env = "YATT_LOG_JSON")]
    log_json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Create a cluster CA (ca.pem, ca.key) in DIR.
    Init {
        /// Where to write the CA.
        #[arg(long, default_value = "certs")]
        dir: PathBuf,
        /// The cluster's name (in the CA certificate).
        #[arg(long, default_value = "yatt")]
        cluster: String,
    },
    /// Issue a node certificate from the cluster CA.
    Cert {
        /// Directory holding ca.pem and ca.key.
        #[arg(long, default_value = "certs")]
        ca_dir: PathBuf,
        /// The node's name (its certificate CN).
        #[arg(long)]
        name: String,
        /// Where to write NAME.pem, NAME.key and ca.pem (default: the CA directory).
        #[arg(long)]
        out: Option<PathBuf>,
        /// What the holder may do: `node` (a daemon: hosts roles, may lead the
        /// directory and spawn), `trainer` (places roles on the nodes, never leads) or
        /// `client` (only calls actors: neither spawns nor leads).
        #[arg(long, default_value = "node")]
        kind: CertKind,
        /// Valid until this date (YYYY-MM-DD, UTC) instead of the default years: a
        /// short-lived certificate (a date in the past issues one already expired).
        #[arg(long, value_name = "YYYY-MM-DD")]
        valid_until: Option<String>,
    },
    /// Serve: join or lead a cluster and host actors.
    Run(RunArgs),
    /// Print what `run` with the same arguments would start as, as JSON (name, seed,
    /// listen, advertised and HTTP addresses, devices, certificate paths), and start
    /// nothing: to debug a launch.
    Plan(RunArgs),
}

#[derive(clap::Args)]
struct RunArgs {
    /// Take the name, seed, addresses and devices from the launcher's environment:
    /// `slurm` (under srun) or `k8s` (a StatefulSet pod); flags given here win. See
    /// docs/launch.md for the variables.
    #[arg(long, value_enum)]
    launcher: Option<Launcher>,
    /// TOML configuration (see config/node.toml).
    #[arg(long, short)]
    config: Option<PathBuf>,
    /// Node name (node.name).
    #[arg(long)]
    name: Option<String>,
    /// QUIC listen address (node.listen).
    #[arg(long)]
    listen: Option<String>,
    /// Join through this member: an address or HOST:PORT (node.seed).
    #[arg(long)]
    seed: Option<String>,
    /// The address peers dial, when it is not --listen: behind NAT, a proxy or a
    /// load balancer (node.advertise).
    #[arg(long)]
    advertise: Option<String>,
    /// HTTP address for /health, /metrics and the live view at / (the cluster as this
    /// node sees it); "" disables (http.listen).
    #[arg(long)]
    http: Option<String>,
    /// Certificate directory (tls.dir).
    #[arg(long)]
    certs: Option<PathBuf>,
    /// Dev mode: self-issue from a dev CA kept in the certificate directory (tls.dev).
    #[arg(long)]
    dev: bool,
    /// Virtual devices when there is no GPU (node.virtual_devices).
    #[arg(long)]
    virtual_devices: Option<u32>,
    /// Write {"name","addr","listen","http","pid"} here once serving (node.ready_file).
    #[arg(long)]
    ready_file: Option<PathBuf>,
    /// The only directory roles write into for peers, e.g. checkpoints (node.data_dir).
    #[arg(long)]
    data_dir: Option<PathBuf>,
}

/// `yatt-node`'s command line, for the generated CLI reference.
pub fn cli_command() -> clap::Command {
    <Cli as clap::CommandFactory>::command()
}

/// Parses the command line and runs it, with the roles `roles` registers.
pub(crate) fn main_with_roles(roles: Roles) -> Result<(), DaemonError> {
    let cli = Cli::parse();
    crate::logging::init(cli.log_json).map_err(failed("starting the logger".into()))?;
    match cli.command {
        Command::Init { dir, cluster } => init(&dir, &cluster),
        Command::Cert {
            ca_dir,
            name,
            out,
            kind,
            valid_until,
        } => cert(
            &ca_dir,
            &name,
            kind,
            valid_until.as_deref(),
            out.as_deref().unwrap_or(&ca_dir),
        ),
        Command::Plan(args) => plan(args),
        Command::Run(args) => tokio::runtime::Builder::new_multi_thread()
            .enable_all()
            .build()
            .map_err(failed("starting the async runtime".into()))?
            .block_on(run(args, roles)),
    }
}

fn init(dir: &std::path::Path, cluster: &str) -> Result<(), DaemonError> {
    if dir.join(yatt_runtime::CA_KEY_FILE).exists() {
        return Err(DaemonError::Refused(format!(
            "{} already holds a CA key; refusing to overwrite it (remove it first to start a new cluster)",
            dir.display()
        )));
    }
    std::fs::create_dir_all(dir).map_err(failed(format!("creating {}", dir.display())))?;
    ClusterCa::generate(cluster)
        .and_then(|ca| ca.save(dir))
        .map_err(failed(format!("writing a cluster CA to {}", dir.display())))?;
    println!("cluster CA written to {}", dir.display());
    Ok(())
}

fn cert(
    ca_dir: &std::path::Path,
    name: &str,
    kind: CertKind,
    valid_until: Option<&str>,
    out: &std::path::Path,
) -> Result<(), DaemonError> {
    let until = valid_until.map(parse_date).transpose()?;
    let ca = ClusterCa::load(ca_dir).map_err(failed(format!(
        "loading the cluster CA from {}",
        ca_dir.display()
    )))?;
    std::fs::create_dir_all(out).map_err(failed(format!("creating {}", out.display())))?;
    ca.issue_until(name, kind, until)
        .and_then(|id| id.save(out))
        .map_err(failed(format!("issuing a certificate for {name}")))?;
    println!("{kind} certificate for {name} written to {}", out.display());
    Ok(())
}

/// `YYYY-MM-DD` as (year, month, day).
fn parse_date(text: &str) -> Result<(i32, u8, u8), DaemonError> {
    let bad = || {
        DaemonError::Refused(format!(
            "--valid-until {text:?}: expected a date YYYY-MM-DD, e.g. 2027-06-30"
        ))
    };
    let mut parts = text.split('-');
    let (Some(y), Some(m), Some(d), None) =
        (parts.next(), parts.next(), parts.next(), parts.next())
    else {
        return Err(bad());
    };
    let (y, m, d) = (
        y.parse::<i32>().map_err(|_| bad())?,
        m.parse::<u8>().map_err(|_| bad())?,
        d.parse::<u8>().map_err(|_| bad())?,
    );
    if !(1..=12).contains(&m) || !(1..=31).contains(&d) || !(1970..=9999).contains(&y) {
        return Err(bad());
    }
    Ok((y, m, d))
}

/// The configuration `run` would start with: the config file, the environment, the
/// launcher's values, then the flags (later ones win), validated.
fn settings(args: RunArgs) -> Result<(Option<Plan>, ResolvedNode), DaemonError> {
    let launched = args
        .launcher
        .map(|l| crate::launch::resolve(l, &crate::launch::process_env()))
        .transpose()
        .map_err(|e| DaemonError::Refused(format!("--launcher: {e}")))?;
    let mut flags: Vec<(&str, String)> = Vec::new();
    if let Some(p) = &launched {
        flags.push(("node.name", p.name.clone()));
        flags.push(("node.listen", p.listen.clone()));
        flags.push(("node.advertise", p.advertise.clone()));
        // The leader's seed is cleared, not left to a config file's: pod 0 leads.
        flags.push(("node.seed", p.seed.clone().unwrap_or_default()));
        flags.push(("http.listen", p.http.clone()));
        if let Some(n) = p.devices {
            flags.push(("node.virtual_devices", n.to_string()));
        }
    }
    let mut flag = |k, v: Option<String>| {
        if let Some(v) = v {
            flags.retain(|(key, _)| *key != k);
            flags.push((k, v));
        }
    };
    flag("node.name", args.name);
    flag("node.listen", args.listen);
    flag("node.seed", args.seed);
    flag("node.advertise", args.advertise);
    flag("http.listen", args.http);
    flag("tls.dir", args.certs.map(|p| p.display().to_string()));
    flag("tls.dev", args.dev.then(|| "true".to_string()));
    flag(
        "node.virtual_devices",
        args.virtual_devices.map(|n| n.to_string()),
    );
    flag(
        "node.ready_file",
        args.ready_file.map(|p| p.display().to_string()),
    );
    flag(
        "node.data_dir",
        args.data_dir.map(|p| p.display().to_string()),
    );
    let cfg = crate::node_config::load(args.config.as_deref(), &flags)
        .map_err(|e| DaemonError::Refused(e.to_string()))?;
    Ok((launched, cfg))
}

/// `yatt-node plan`: the resolved settings as JSON on stdout.
fn plan(args: RunArgs) -> Result<(), DaemonError> {
    let (launched, cfg) = settings(args)?;
    let dir = &cfg.tls.dir;
    let text = |e: &Option<Endpoint>| e.as_ref().map(Endpoint::to_string);
    let out = serde_json::json!({
        "launcher": launched.as_ref().map(|p| p.launcher),
        "index": launched.as_ref().map(|p| p.index),
        "hosts": launched.as_ref().and_then(|p| p.hosts.clone()),
        "name": cfg.name,
        "leader": cfg.seed.is_none(),
        "seed": text(&cfg.seed),
        "peers": launched.as_ref().map(|p| p.peers.clone()).unwrap_or_default(),
        "listen": cfg.runtime.listen.to_string(),
        "advertise": text(&cfg.advertise).unwrap_or_else(|| cfg.runtime.listen.to_string()),
        "http": cfg.http.map(|a| a.to_string()),
        "devices": launched.as_ref().and_then(|p| p.devices),
        "devices_from": launched.as_ref().and_then(|p| p.devices_from.clone()),
        "virtual_devices": cfg.runtime.virtual_devices,
        "certs": {
            "dir": dir.display().to_string(),
            "dev": cfg.tls.dev,
            "ca": dir.join(yatt_runtime::CA_CERT_FILE).display().to_string(),
            "cert": dir.join(format!("{}.pem", cfg.name)).display().to_string(),
            "key": dir.join(format!("{}.key", cfg.name)).display().to_string(),
        },
    });
    let pretty = serde_json::to_string_pretty(&out).map_err(failed("printing the plan".into()))?;
    println!("{pretty}");
    Ok(())
}

/// How long a host name in the seed or the advertised address may take to resolve: a
/// StatefulSet pod's DNS name appears a few seconds after the pod starts.
const LOOKUP_WAIT: std::time::Duration = std::time::Duration::from_secs(120);

/// How long a peer's name may take to resolve. Short: on a fresh start a pod not yet
/// scheduled has no name, and pod 0 must not wait on it; a peer left out is only not
/// asked (the others, or the seed, still are).
const PEER_LOOKUP_WAIT: std::time::Duration = std::time::Duration::from_secs(3);

/// The launcher's peers that resolve within [`PEER_LOOKUP_WAIT`], all looked up at once.
async fn resolve_peers(peers: &[String]) -> Vec<std::net::SocketAddr> {
    let lookups: Vec<_> = peers
        .iter()
        .map(|p| {
            let p = p.clone();
            tokio::spawn(
                async move { crate::launch::dns::lookup("a peer", &p, PEER_LOOKUP_WAIT).await },
            )
        })
        .collect();
    let mut found = Vec::new();
    for (peer, lookup) in peers.iter().zip(lookups) {
        match lookup.await {
            Ok(Ok(addr)) => found.push(addr),
            Ok(Err(e)) => {
                tracing::info!(%peer, error = %e, "a peer does not resolve: not asking it")
            }
            Err(e) => tracing::warn!(%peer, error = %e, "looking up a peer failed"),
        }
    }
    found
}

async fn run(args: RunArgs, roles: Roles) -> Result<(), DaemonError> {
    let (launched, mut cfg) = settings(args)?;
    if let Some(p) = &launched {
        tracing::info!(launcher = %p.launcher, name = %cfg.name, index = p.index, seed = ?p.seed, peers = ?p.peers, devices = ?p.devices, "launch");
        cfg.runtime.peers = resolve_peers(&p.peers).await;
    }
    if let Some(Endpoint::Name(host)) = &cfg.seed {
        let addr = crate::launch::dns::lookup("the seed (node.seed)", host, LOOKUP_WAIT)
            .await
            .map_err(|e| DaemonError::Refused(e.to_string()))?;
        cfg.runtime.seed = Some(addr);
    }
    if let Some(Endpoint::Name(host)) = &cfg.advertise {
        let addr = crate::launch::dns::lookup(
            "the advertised address (node.advertise)",
            host,
            LOOKUP_WAIT,
        )
        .await
        .map_err(|e| DaemonError::Refused(e.to_string()))?;
        // A host whose name maps to 127.0.1.1 (Debian's /etc/hosts) would tell its
        // peers to dial themselves.
        if addr.ip().is_loopback() && cfg.runtime.listen.ip().is_unspecified() {
            tracing::warn!(%host, %addr, "the advertised name resolves to a loopback address while the node listens on all interfaces: peers on other hosts cannot reach it; set YATT_ADVERTISE_HOST (or --advertise) to an address they can reach");
        }
        cfg.runtime.advertise = Some(addr);
    }

    if let Some(addr) = cfg.http {
        crate::view::warn_if_exposed(addr);
    }
    // Bind HTTP first: a port in use should fail before we join the cluster.
    let http =
        match cfg.http {
            Some(addr) => Some(tokio::net::TcpListener::bind(addr).await.map_err(failed(
                format!("cannot listen for HTTP on {addr} (http.listen; is the port in use?)"),
            ))?),
            None => None,
        };
    let mut builder = Node::builder(&cfg.name).config(cfg.runtime.clone());
    builder = if cfg.tls.dev {
        builder.dev_certs(&cfg.tls.dir).dev_kind(CertKind::Node)
    } else {
        builder.identity(
            NodeIdentity::load(&cfg.tls.dir, &cfg.name).map_err(failed(format!(
                "loading the certificate of {} from {}",
                cfg.name,
                cfg.tls.dir.display()
            )))?,
        )
    };
    let user_roles = roles.names();
    builder = roles.register(crate::register_roles(builder));
    let node = builder
        .start()
        .await
        .map_err(failed(format!("starting node {}", cfg.name)))?;

    let http_addr = http.as_ref().and_then(|l| l.local_addr().ok());
    let (stop_http, http_stopped) = tokio::sync::oneshot::channel::<()>();
    let http_task = http.map(|listener| {
        let app = crate::http::with_view(&node, crate::view::View::new().cluster(&node));
        tokio::spawn(async move {
            let _ = crate::view::serve(listener, app, async {
                let _ = http_stopped.await;
            })
            .await;
        })
    });
    if let Some(path) = &cfg.ready_file {
        let ready = serde_json::json!({
            "name": node.name(),
            "addr": node.addr().to_string(),
            "listen": node.local_addr().to_string(),
            "http": http_addr.map(|a| a.to_string()),
            "pid": std::process::id(),
        });
        let tmp = path.with_extension("tmp");
        std::fs::write(&tmp, ready.to_string())
            .map_err(failed(format!("writing {}", tmp.display())))?;
        std::fs::rename(&tmp, path).map_err(failed(format!("writing {}", path.display())))?;
    }
    tracing::info!(node = %node.name(), addr = %node.addr(), http = ?http_addr, user_roles = ?user_roles, "serving");

    let mut term = tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate())
        .map_err(failed("listening for SIGTERM".into()))?;
    tokio::select! {
        _ = term.recv() => tracing::info!("SIGTERM"),
        _ = tokio::signal::ctrl_c() => tracing::info!("interrupt"),
    }
    node.shutdown().await;
    let _ = stop_http.send(());
    if let Some(t) = http_task {
        let _ = t.await;
    }
    Ok(())
}
