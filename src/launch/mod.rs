//! Launchers: how `yatt-node run --launcher slurm|k8s` works out its name, seed,
//! addresses and devices from the environment Slurm or a Kubernetes StatefulSet gives
//! it. [`resolve`] is pure (an environment map in, a [`Plan`] out, no I/O), so every
//! case is a unit test; the daemon resolves host names to addresses afterwards
//! ([`dns`]).
//!
//! | variable | launcher | default | meaning |
//! |---|---|---|---|
//! | `YATT_PORT` | both | 7400 | QUIC port of every node (the seed's too) |
//! | `YATT_HTTP_PORT` | both | 7480 | `/health` and `/metrics` port |
//! | `YATT_LISTEN_HOST` | both | `0.0.0.0` | address the QUIC endpoint binds |
//! | `YATT_HTTP_HOST` | both | Slurm `127.0.0.1`, k8s `0.0.0.0` | address HTTP binds (k8s: the kubelet probes the pod IP) |
//! | `YATT_ADVERTISE_HOST` | both | Slurm: the host's name; k8s: `POD_IP`, else the pod's DNS name | what peers dial |
//! | `YATT_GPUS_PER_NODE` | both | Slurm: `SLURM_GPUS_ON_NODE`, `SLURM_GPUS_PER_NODE` | devices this node offers |
//! | `YATT_K8S_SERVICE` | k8s | (required) | the headless Service |
//! | `YATT_K8S_NAMESPACE` | k8s | (the pod's) | appended to the seed's DNS name |
//! | `YATT_REPLICAS` | k8s | (none: no peers) | the StatefulSet's size: pods 0..N are each other's peers |
//! | `YATT_HOSTS_FILE` | both | (none) | names looked up before DNS ([`dns`]) |

pub mod dns;
pub mod nodelist;

use std::collections::BTreeMap;

use serde::Serialize;

pub use nodelist::{expand as expand_nodelist, NodeListError};

/// Default QUIC port (`YATT_PORT`).
pub const DEFAULT_PORT: u16 = 7400;
/// Default HTTP port (`YATT_HTTP_PORT`).
pub const DEFAULT_HTTP_PORT: u16 = 7480;

/// Who started this node, and so where its name and seed come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum, Serialize)]
#[serde(rename_all = "lowercase")]
pub enum Launcher {
    /// `srun`: `SLURM_JOB_NODELIST`, `SLURM_NODEID`, `SLURM_GPUS_ON_NODE`; the first
    /// host of the node list leads.
    Slurm,
    /// A StatefulSet pod `NAME-K` behind a headless Service: pod 0 leads, the others
    /// join through `NAME-0.<service>`.
    K8s,
}

impl std::fmt::Display for Launcher {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Launcher::Slurm => "slurm",
            Launcher::K8s => "k8s",
        })
    }
}

/// Why the launcher's environment does not give a node; each message names the
/// variable, its value, and what to set.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LaunchError {
    /// A variable the launcher must set is absent (or empty).
    #[error("{var} is not set: {fix}")]
    Missing {
        /// The variable.
        var: String,
        /// What sets it, or what to set.
        fix: String,
    },
    /// A variable holds a value that does not parse or does not fit.
    #[error("{var}={value:?}: {problem}; {fix}")]
    Invalid {
        /// The variable.
        var: String,
        /// Its value.
        value: String,
        /// What is wrong with it.
        problem: String,
        /// What to set.
        fix: String,
    },
}

/// What a launcher resolved: everything `yatt-node run` needs that the launcher
/// decides. Addresses are `host:port` text; host names are looked up at start.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Plan {
    /// The launcher.
    pub launcher: Launcher,
    /// The node's name (its certificate's CN).
    pub name: String,
    /// Its index: `SLURM_NODEID`, or the pod's ordinal.
    pub index: usize,
    /// Every host of the allocation, in order (Slurm only).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub hosts: Option<Vec<String>>,
    /// The member to join through; `None`: this node leads a new cluster, unless one
    /// of its peers belongs to a live one (a restarted head rejoins it).
    pub seed: Option<String>,
    /// The other nodes' stable addresses (neither this node nor the seed): asked for a
    /// live cluster before a seedless node leads, tried after the seed otherwise.
    pub peers: Vec<String>,
    /// The QUIC listen address.
    pub listen: String,
    /// The address peers dial.
    pub advertise: String,
    /// The HTTP address of `/health` and `/metrics`.
    pub http: String,
    /// Devices this node offers; `None`: detected (`nvidia-smi`).
    pub devices: Option<u32>,
    /// The variable `devices` came from.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub devices_from: Option<String>,
}

/// The environment a launcher reads (a map, so tests need not touch the process's).
pub type Env = BTreeMap<String, String>;

/// The process's environment as an [`Env`] (variables that are not UTF-8 are left out).
pub fn process_env() -> Env {
    std::env::vars_os()
        .filter_map(|(k, v)| Some((k.into_string().ok()?, v.into_string().ok()?)))
        .collect()
}

/// Resolves `launcher` against `env`.
pub fn resolve(launcher: Launcher, env: &Env) -> Result<Plan, LaunchError> {
    let plan = match launcher {
        Launcher::Slurm => slurm(env)?,
        Launcher::K8s => k8s(env)?,
    };
    // The addresses bound must be literals; a host name is caught here, naming the
    // variable, rather than later as a bad `node.listen`.
    for (var, addr) in [
        ("YATT_LISTEN_HOST", &plan.listen),
        ("YATT_HTTP_HOST", &plan.http),
    ] {
        if addr.parse::<std::net::SocketAddr>().is_err() {
            let value = get(env, var).unwrap_or_default();
            return Err(invalid(
                var,
                value,
                "not an IP address of this machine",
                "set it to an address such as 0.0.0.0, 127.0.0.1 or 10.0.0.2",
            ));
        }
    }
    if yatt_runtime::validate_node_name(&plan.name).is_err() {
        let (var, value) = match launcher {
            Launcher::Slurm => ("SLURM_JOB_NODELIST", get(env, "SLURM_JOB_NODELIST")),
            Launcher::K8s => ("POD_NAME", get(env, "POD_NAME").or(get(env, "HOSTNAME"))),
        };
        return Err(invalid(
            var,
            value.unwrap_or_default(),
            format!("{:?} is not a yatt node name (1-63 of a-z 0-9 - _ . starting with a letter or digit)", plan.name),
            "name hosts in lower case, or start yatt-node with --name",
        ));
    }
    Ok(plan)
}

/// A set, non-empty variable.
fn get<'a>(env: &'a Env, var: &str) -> Option<&'a str> {
    env.get(var).map(|v| v.trim()).filter(|v| !v.is_empty())
}

fn require<'a>(env: &'a Env, var: &str, fix: &str) -> Result<&'a str, LaunchError> {
    get(env, var).ok_or_else(|| LaunchError::Missing {
        var: var.into(),
        fix: fix.into(),
    })
}

fn invalid(var: &str, value: &str, problem: impl Into<String>, fix: &str) -> LaunchError {
    LaunchError::Invalid {
        var: var.into(),
        value: value.into(),
        problem: problem.into(),
        fix: fix.into(),
    }
}

fn parse_port(env: &Env, var: &str, default: u16) -> Result<u16, LaunchError> {
    match get(env, var) {
        None => Ok(default),
        Some(v) => v.parse().map_err(|_| {
            invalid(
                var,
                v,
                "not a port",
                &format!("set it to a number from 0 to 65535 (default {default})"),
            )
        }),
    }
}

/// `host:port`, with IPv6 literals in brackets.
fn host_port(host: &str, port: u16) -> String {
    if host.contains(':') && !host.starts_with('[') {
        format!("[{host}]:{port}")
    } else {
        format!("{host}:{port}")
    }
}

/// A count of devices from `var`: `4`, or Slurm's `[type:]4` (`a100:4`).
fn gpu_count(var: &str, v: &str) -> Result<u32, LaunchError> {
    let count = v.rsplit(':').next().unwrap_or(v);
    count.parse().map_err(|_| {
        invalid(
            var,
            v,
            "not a count of GPUs",
            "set YATT_GPUS_PER_NODE to this node's GPU count, e.g. 8",
        )
    })
}

/// The first of `vars` that is set, as a device count.
fn devices(env: &Env, vars: &[&str]) -> Result<Option<(u32, String)>, LaunchError> {
    for var in vars {
        if let Some(v) = get(env, var) {
            return Ok(Some((gpu_count(var, v)?, (*var).to_string())));
        }
    }
    Ok(None)
}

/// The addresses every launcher shares.
struct Ports {
    port: u16,
    listen: String,
    http: String,
}

fn ports(env: &Env, http_host_default: &str) -> Result<Ports, LaunchError> {
    let port = parse_port(env, "YATT_PORT", DEFAULT_PORT)?;
    let http_port = parse_port(env, "YATT_HTTP_PORT", DEFAULT_HTTP_PORT)?;
    let listen_host = get(env, "YATT_LISTEN_HOST").unwrap_or("0.0.0.0");
    let http_host = get(env, "YATT_HTTP_HOST").unwrap_or(http_host_default);
    Ok(Ports {
        port,
        listen: host_port(listen_host, port),
        http: host_port(http_host, http_port),
    })
}

const SLURM_FIX: &str = "run yatt-node under srun (deploy/slurm/yatt.sbatch), which sets it";

fn slurm(env: &Env) -> Result<Plan, LaunchError> {
    let list_var = "SLURM_JOB_NODELIST";
    let list = require(env, list_var, SLURM_FIX)?;
    let hosts = nodelist::expand(list).map_err(|e| {
        invalid(
            list_var,
            list,
            e.to_string(),
            "set it to a Slurm host list such as gpu[01-04] or a1,b[3-4]",
        )
    })?;
    let id_var = "SLURM_NODEID";
    let id_text = require(env, id_var, SLURM_FIX)?;
    let index: usize = id_text.parse().map_err(|_| {
        invalid(
            id_var,
            id_text,
            "not a node index",
            "set it to this node's 0-based index in SLURM_JOB_NODELIST",
        )
    })?;
    let name = hosts.get(index).cloned().ok_or_else(|| {
        invalid(
            id_var,
            id_text,
            format!(
                "SLURM_JOB_NODELIST={list:?} has {} hosts (0 to {})",
                hosts.len(),
                hosts.len() - 1
            ),
            "set it to this node's 0-based index in SLURM_JOB_NODELIST",
        )
    })?;
    let gpu_vars = [
        "YATT_GPUS_PER_NODE",
        "SLURM_GPUS_ON_NODE",
        "SLURM_GPUS_PER_NODE",
    ];
    let (devices, devices_from) = devices(env, &gpu_vars)?.ok_or_else(|| LaunchError::Missing {
        var: "SLURM_GPUS_ON_NODE".into(),
        fix: "neither is SLURM_GPUS_PER_NODE or YATT_GPUS_PER_NODE; submit with --gpus-per-node=N, or set YATT_GPUS_PER_NODE to this node's GPU count".into(),
    })?;
    let p = ports(env, "127.0.0.1")?;
    let advertise_host = get(env, "YATT_ADVERTISE_HOST").unwrap_or(&name);
    let peers = (1..hosts.len())
        .filter(|&i| i != index)
        .map(|i| host_port(&hosts[i], p.port))
        .collect();
    Ok(Plan {
        launcher: Launcher::Slurm,
        seed: (index != 0).then(|| host_port(&hosts[0], p.port)),
        peers,
        advertise: host_port(advertise_host, p.port),
        name,
        index,
        hosts: Some(hosts),
        listen: p.listen,
        http: p.http,
        devices: Some(devices),
        devices_from: Some(devices_from),
    })
}

/// `NAME-K` → (`NAME`, `K`): a StatefulSet pod's name.
fn split_ordinal(pod: &str) -> Option<(&str, usize)> {
    let (set, ordinal) = pod.rsplit_once('-')?;
    let valid_digits = !ordinal.is_empty() && ordinal.bytes().all(|b| b.is_ascii_digit());
    (!set.is_empty() && valid_digits)
        .then(|| ordinal.parse().ok().map(|k| (set, k)))
        .flatten()
}

/// The most pods `YATT_REPLICAS` may name: each is a peer pod 0 asks at start.
const MAX_REPLICAS: usize = 4096;

/// `YATT_REPLICAS`: the StatefulSet's size, which must hold this pod's ordinal; 0 when
/// unset (no peers: a restarted pod 0 leads a cluster of its own).
fn replicas(env: &Env, pod_var: &str, pod: &str, index: usize) -> Result<usize, LaunchError> {
    let var = "YATT_REPLICAS";
    let Some(text) = get(env, var) else {
        return Ok(0);
    };
    let fix =
        "set it to the StatefulSet's spec.replicas (the yatt-launch ConfigMap of deploy/k8s does)";
    let n: usize = text
        .parse()
        .map_err(|_| invalid(var, text, "not a count of pods", fix))?;
    if n == 0 || n > MAX_REPLICAS {
        return Err(invalid(
            var,
            text,
            format!("not from 1 to {MAX_REPLICAS}"),
            fix,
        ));
    }
    if index >= n {
        return Err(invalid(
            var,
            text,
            format!("{pod_var}={pod:?} is pod {index}, which a StatefulSet of {n} does not have"),
            fix,
        ));
    }
    Ok(n)
}

fn k8s(env: &Env) -> Result<Plan, LaunchError> {
    let (pod_var, pod) = match (get(env, "POD_NAME"), get(env, "HOSTNAME")) {
        (Some(p), _) => ("POD_NAME", p),
        (None, Some(h)) => ("HOSTNAME", h),
        (None, None) => {
            return Err(LaunchError::Missing {
                var: "POD_NAME".into(),
                fix: "neither is HOSTNAME; set POD_NAME from the downward API (fieldRef metadata.name), as deploy/k8s/base/statefulset.yaml does".into(),
            })
        }
    };
    let (set, index) = split_ordinal(pod).ok_or_else(|| {
        invalid(
            pod_var,
            pod,
            "not a StatefulSet pod name NAME-K",
            "run yatt-node in a StatefulSet's pod, or set POD_NAME to NAME-K (K = the pod's ordinal, 0 leads)",
        )
    })?;
    let service = require(
        env,
        "YATT_K8S_SERVICE",
        "set it to the name of the StatefulSet's headless Service (its spec.serviceName)",
    )?;
    let domain = match get(env, "YATT_K8S_NAMESPACE") {
        Some(ns) => format!("{service}.{ns}"),
        None => service.to_string(),
    };
    let (devices, devices_from) = match devices(env, &["YATT_GPUS_PER_NODE"])? {
        Some((n, var)) => (Some(n), Some(var)),
        None => (None, None),
    };
    let replicas = replicas(env, pod_var, pod, index)?;
    let p = ports(env, "0.0.0.0")?;
    let peers = (1..replicas)
        .filter(|&k| k != index)
        .map(|k| host_port(&format!("{set}-{k}.{domain}"), p.port))
        .collect();
    let own_dns = format!("{pod}.{domain}");
    let advertise_host = get(env, "YATT_ADVERTISE_HOST")
        .or(get(env, "POD_IP"))
        .unwrap_or(&own_dns);
    Ok(Plan {
        launcher: Launcher::K8s,
        name: pod.to_string(),
        index,
        hosts: None,
        seed: (index != 0).then(|| host_port(&format!("{set}-0.{domain}"), p.port)),
        peers,
        advertise: host_port(advertise_host, p.port),
        listen: p.listen,
        http: p.http,
        devices,
        devices_from,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn env(pairs: &[(&str, &str)]) -> Env {
        pairs
            .iter()
            .map(|(k, v)| (k.to_string(), v.to_string()))
            .collect()
    }

    fn slurm_env(id: &str) -> Env {
        env(&[
            ("SLURM_JOB_NODELIST", "gpu[01-03,07]"),
            ("SLURM_NODEID", id),
            ("SLURM_GPUS_ON_NODE", "8"),
        ])
    }

    #[test]
    fn slurm_head_is_the_first_host_and_leads() {
        let p = resolve(Launcher::Slurm, &slurm_env("0")).unwrap();
        assert_eq!((p.name.as_str(), p.index, p.seed), ("gpu01", 0, None));
        assert_eq!(p.listen, "0.0.0.0:7400");
        assert_eq!(p.advertise, "gpu01:7400");
        assert_eq!(p.http, "127.0.0.1:7480");
        assert_eq!(p.devices, Some(8));
        assert_eq!(p.hosts.unwrap(), ["gpu01", "gpu02", "gpu03", "gpu07"]);
    }

    #[test]
    fn slurm_others_join_through_the_first_host() {
        for (id, name) in [("1", "gpu02"), ("3", "gpu07")] {
            let p = resolve(Launcher::Slurm, &slurm_env(id)).unwrap();
            assert_eq!(p.name, name);
            assert_eq!(p.seed.as_deref(), Some("gpu01:7400"));
        }
        let mut e = slurm_env("2");
        e.insert("SLURM_JOB_NODELIST".into(), "r[1-2]-n[01-02]".into());
        let p = resolve(Launcher::Slurm, &e).unwrap();
        assert_eq!(
            (p.name.as_str(), p.seed.as_deref()),
            ("r2-n01", Some("r1-n01:7400"))
        );
    }

    #[test]
    fn slurm_ports_hosts_and_gpus_come_from_overrides() {
        let mut e = slurm_env("1");
        e.extend(env(&[
            ("YATT_PORT", "9000"),
            ("YATT_HTTP_PORT", "9080"),
            ("YATT_LISTEN_HOST", "10.0.0.2"),
            ("YATT_HTTP_HOST", "0.0.0.0"),
            ("YATT_ADVERTISE_HOST", "10.0.0.2"),
            ("YATT_GPUS_PER_NODE", "2"),
        ]));
        let p = resolve(Launcher::Slurm, &e).unwrap();
        assert_eq!(p.seed.as_deref(), Some("gpu01:9000"));
        assert_eq!(
            (p.listen.as_str(), p.advertise.as_str(), p.http.as_str()),
            ("10.0.0.2:9000", "10.0.0.2:9000", "0.0.0.0:9080")
        );
        assert_eq!(
            (p.devices, p.devices_from.as_deref()),
            (Some(2), Some("YATT_GPUS_PER_NODE"))
        );
        let mut e = slurm_env("0");
        e.remove("SLURM_GPUS_ON_NODE");
        e.insert("SLURM_GPUS_PER_NODE".into(), "a100:4".into());
        assert_eq!(resolve(Launcher::Slurm, &e).unwrap().devices, Some(4));
        e.insert("YATT_LISTEN_HOST".into(), "::".into());
        assert_eq!(resolve(Launcher::Slurm, &e).unwrap().listen, "[::]:7400");
    }

    #[test]
    fn slurm_errors_name_the_variable_its_value_and_the_fix() {
        let cases: &[(&[&str], &[(&str, &str)], &[&str])] = &[
            (
                &["SLURM_JOB_NODELIST"],
                &[],
                &["SLURM_JOB_NODELIST is not set", "srun"],
            ),
            (&["SLURM_NODEID"], &[], &["SLURM_NODEID is not set", "srun"]),
            (
                &[],
                &[("SLURM_JOB_NODELIST", "gpu[01-03")],
                &["SLURM_JOB_NODELIST=\"gpu[01-03\"", "bracket", "gpu[01-04]"],
            ),
            (
                &[],
                &[("SLURM_NODEID", "x")],
                &["SLURM_NODEID=\"x\"", "index"],
            ),
            (
                &[],
                &[("SLURM_NODEID", "4")],
                &["SLURM_NODEID=\"4\"", "4 hosts"],
            ),
            (
                &["SLURM_GPUS_ON_NODE"],
                &[],
                &[
                    "SLURM_GPUS_ON_NODE is not set",
                    "YATT_GPUS_PER_NODE",
                    "--gpus-per-node",
                ],
            ),
            (
                &[],
                &[("SLURM_GPUS_ON_NODE", "many")],
                &["SLURM_GPUS_ON_NODE=\"many\"", "YATT_GPUS_PER_NODE"],
            ),
            (
                &[],
                &[("YATT_PORT", "74000")],
                &["YATT_PORT=\"74000\"", "0 to 65535"],
            ),
            (
                &[],
                &[("YATT_HTTP_PORT", "http")],
                &["YATT_HTTP_PORT=\"http\""],
            ),
            (
                &[],
                &[("YATT_LISTEN_HOST", "gpu01")],
                &["YATT_LISTEN_HOST=\"gpu01\"", "IP address"],
            ),
            (
                &[],
                &[("SLURM_JOB_NODELIST", "GPU[1-2]")],
                &["SLURM_JOB_NODELIST=\"GPU[1-2]\"", "\"GPU1\"", "--name"],
            ),
        ];
        for (remove, set, want) in cases {
            let mut e = slurm_env("0");
            remove.iter().for_each(|k| {
                e.remove(*k);
            });
            e.extend(env(set));
            let msg = resolve(Launcher::Slurm, &e).unwrap_err().to_string();
            for w in *want {
                assert!(msg.contains(w), "{remove:?} {set:?}: {msg:?} lacks {w:?}");
            }
        }
    }

    fn pod_env(pod: &str) -> Env {
        env(&[
            ("POD_NAME", pod),
            ("POD_IP", "10.1.2.3"),
            ("YATT_K8S_SERVICE", "yatt"),
        ])
    }

    #[test]
    fn k8s_pod_zero_leads_and_the_others_join_through_it() {
        let p = resolve(Launcher::K8s, &pod_env("yatt-node-0")).unwrap();
        assert_eq!((p.name.as_str(), p.index, p.seed), ("yatt-node-0", 0, None));
        assert_eq!(p.advertise, "10.1.2.3:7400");
        assert_eq!(p.http, "0.0.0.0:7480");
        assert_eq!(p.devices, None);
        let p = resolve(Launcher::K8s, &pod_env("yatt-node-12")).unwrap();
        assert_eq!((p.name.as_str(), p.index), ("yatt-node-12", 12));
        assert_eq!(p.seed.as_deref(), Some("yatt-node-0.yatt:7400"));
        let mut e = pod_env("yatt-node-1");
        e.extend(env(&[("YATT_K8S_NAMESPACE", "rl"), ("YATT_PORT", "7600")]));
        e.remove("POD_IP");
        let p = resolve(Launcher::K8s, &e).unwrap();
        assert_eq!(p.seed.as_deref(), Some("yatt-node-0.yatt.rl:7600"));
        assert_eq!(p.advertise, "yatt-node-1.yatt.rl:7600");
        // HOSTNAME when POD_NAME is absent (a pod's hostname is its name).
        let e = env(&[
            ("HOSTNAME", "w-3"),
            ("YATT_K8S_SERVICE", "s"),
            ("YATT_GPUS_PER_NODE", "4"),
        ]);
        let p = resolve(Launcher::K8s, &e).unwrap();
        assert_eq!(
            (p.seed.as_deref(), p.devices),
            (Some("w-0.s:7400"), Some(4))
        );
    }

    #[test]
    fn the_other_nodes_are_peers_so_a_restarted_head_rejoins() {
        let peers = |e: &Env, l| resolve(l, e).unwrap().peers;
        assert_eq!(
            peers(&slurm_env("0"), Launcher::Slurm),
            ["gpu02:7400", "gpu03:7400", "gpu07:7400"]
        );
        // Neither itself nor the seed, which it already joins through.
        assert_eq!(
            peers(&slurm_env("2"), Launcher::Slurm),
            ["gpu02:7400", "gpu07:7400"]
        );
        let mut e = pod_env("yatt-node-0");
        e.extend(env(&[("YATT_REPLICAS", "3"), ("YATT_K8S_NAMESPACE", "rl")]));
        assert_eq!(
            peers(&e, Launcher::K8s),
            ["yatt-node-1.yatt.rl:7400", "yatt-node-2.yatt.rl:7400"]
        );
        e.insert("POD_NAME".into(), "yatt-node-2".into());
        assert_eq!(peers(&e, Launcher::K8s), ["yatt-node-1.yatt.rl:7400"]);
        e.insert("YATT_REPLICAS".into(), "1".into());
        e.insert("POD_NAME".into(), "yatt-node-0".into());
        assert!(peers(&e, Launcher::K8s).is_empty());
        // Unset: no peers (a restarted pod 0 leads on its own, as before).
        assert!(peers(&pod_env("yatt-node-0"), Launcher::K8s).is_empty());
    }

    #[test]
    fn k8s_errors_name_the_variable_its_value_and_the_fix() {
        let cases: &[(&[(&str, &str)], &[&str])] = &[
            (
                &[("YATT_K8S_SERVICE", "s")],
                &["POD_NAME is not set", "HOSTNAME", "downward API"],
            ),
            (
                &[("POD_NAME", "yatt"), ("YATT_K8S_SERVICE", "s")],
                &["POD_NAME=\"yatt\"", "NAME-K"],
            ),
            (
                &[("HOSTNAME", "gpu-box"), ("YATT_K8S_SERVICE", "s")],
                &["HOSTNAME=\"gpu-box\"", "StatefulSet"],
            ),
            (
                &[("POD_NAME", "-1"), ("YATT_K8S_SERVICE", "s")],
                &["POD_NAME=\"-1\""],
            ),
            (
                &[("POD_NAME", "y-0")],
                &["YATT_K8S_SERVICE is not set", "headless Service"],
            ),
            (
                &[
                    ("POD_NAME", "y-0"),
                    ("YATT_K8S_SERVICE", "s"),
                    ("YATT_REPLICAS", "three"),
                ],
                &["YATT_REPLICAS=\"three\"", "count of pods", "spec.replicas"],
            ),
            (
                &[
                    ("POD_NAME", "y-0"),
                    ("YATT_K8S_SERVICE", "s"),
                    ("YATT_REPLICAS", "0"),
                ],
                &["YATT_REPLICAS=\"0\"", "from 1 to 4096", "spec.replicas"],
            ),
            (
                &[
                    ("POD_NAME", "y-3"),
                    ("YATT_K8S_SERVICE", "s"),
                    ("YATT_REPLICAS", "3"),
                ],
                &[
                    "YATT_REPLICAS=\"3\"",
                    "POD_NAME=\"y-3\" is pod 3",
                    "spec.replicas",
                ],
            ),
        ];
        for (set, want) in cases {
            let msg = resolve(Launcher::K8s, &env(set)).unwrap_err().to_string();
            for w in *want {
                assert!(msg.contains(w), "{set:?}: {msg:?} lacks {w:?}");
            }
        }
    }
}
