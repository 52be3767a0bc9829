//! Launching a cluster as Slurm or a Kubernetes StatefulSet would (issue 53):
//! - `yatt-node plan --launcher slurm|k8s` under made-up launcher environments prints
//!   the resolved name, seed, addresses, devices and certificate paths;
//! - the real `deploy/slurm/yatt.sbatch`, with fake `scontrol` and `srun` on PATH,
//!   starts three real daemons on 127.0.0.1, .2 and .3 (the "hosts"), which join
//!   through the head the script chose, and runs `yatt train` on the head to the end;
//! - a node killed (`kill -9`) mid-run and started again under its name, as a
//!   StatefulSet restarts a pod, is survived with every sample trained once.

use std::net::{SocketAddr, TcpListener, UdpSocket};
use std::os::unix::process::CommandExt as _;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

use yatt_integration_tests::{metric_of_steps, poll, steps_done, yatt_bin, yatt_node_bin};

const ROOT: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/..");
const HOSTS: [&str; 3] = ["127.0.0.1", "127.0.0.2", "127.0.0.3"];

/// `yatt-node plan` with only `env` (and PATH) in its environment: stdout, stderr, success.
fn plan(args: &[&str], env: &[(&str, &str)]) -> (String, String, bool) {
    let out = Command::new(yatt_node_bin())
        .arg("plan")
        .args(args)
        .env_clear()
        .env("PATH", std::env::var_os("PATH").unwrap_or_default())
        .envs(env.iter().copied())
        .output()
        .expect("running yatt-node plan");
    (
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
        out.status.success(),
    )
}

fn plan_json(args: &[&str], env: &[(&str, &str)]) -> serde_json::Value {
    let (out, err, ok) = plan(args, env);
    assert!(ok, "yatt-node plan failed: {err}");
    serde_json::from_str(&out).unwrap_or_else(|e| panic!("plan printed no JSON ({e}):\n{out}"))
}

#[test]
fn plan_resolves_a_slurm_node_from_its_environment() {
    let slurm = |id: &'static str| {
        vec![
            ("SLURM_JOB_NODELIST", "gpu[01-03,07]"),
            ("SLURM_NODEID", id),
            ("SLURM_GPUS_ON_NODE", "8"),
            ("YATT_PORT", "7600"),
        ]
    };
    let head = plan_json(
        &["--launcher", "slurm", "--certs", "/shared/certs"],
        &slurm("0"),
    );
    assert_eq!(head["launcher"], "slurm");
    assert_eq!(head["name"], "gpu01");
    assert_eq!(head["leader"], true);
    assert_eq!(head["seed"], serde_json::Value::Null);
    assert_eq!(
        head["hosts"],
        serde_json::json!(["gpu01", "gpu02", "gpu03", "gpu07"])
    );
    let node = plan_json(
        &["--launcher", "slurm", "--certs", "/shared/certs"],
        &slurm("3"),
    );
    let want = serde_json::json!({
        "launcher": "slurm", "index": 3, "name": "gpu07", "leader": false,
        "seed": "gpu01:7600", "listen": "0.0.0.0:7600", "advertise": "gpu07:7600",
        "http": "127.0.0.1:7480", "devices": 8, "devices_from": "SLURM_GPUS_ON_NODE",
        "virtual_devices": 8,
        "certs": {"dir": "/shared/certs", "dev": false, "ca": "/shared/certs/ca.pem",
                  "cert": "/shared/certs/gpu07.pem", "key": "/shared/certs/gpu07.key"},
    });
    for (k, v) in want.as_object().unwrap() {
        assert_eq!(&node[k], v, "plan[{k}] in {node:#}");
    }
    // A flag wins over the launcher.
    let mut env = slurm("1");
    env.push(("SLURM_GPUS_ON_NODE", "2"));
    let flagged = plan_json(
        &["--launcher", "slurm", "--name", "other", "--http", ""],
        &env,
    );
    assert_eq!(
        (flagged["name"].as_str(), flagged["http"].as_str()),
        (Some("other"), None)
    );
    assert_eq!(flagged["seed"], "gpu01:7600");
}

#[test]
fn plan_resolves_a_statefulset_pod_from_its_environment() {
    let pod = |name: &'static str| {
        vec![
            ("POD_NAME", name),
            ("POD_IP", "10.4.0.7"),
            ("YATT_K8S_SERVICE", "yatt"),
            ("YATT_K8S_NAMESPACE", "rl"),
            ("YATT_GPUS_PER_NODE", "4"),
        ]
    };
    let zero = plan_json(
        &["--launcher", "k8s", "--certs", "/etc/yatt/certs"],
        &pod("yatt-node-0"),
    );
    assert_eq!(
        (zero["name"].as_str(), zero["leader"].as_bool()),
        (Some("yatt-node-0"), Some(true))
    );
    let two = plan_json(
        &["--launcher", "k8s", "--certs", "/etc/yatt/certs"],
        &pod("yatt-node-2"),
    );
    let want = serde_json::json!({
        "launcher": "k8s", "index": 2, "name": "yatt-node-2", "leader": false,
        "seed": "yatt-node-0.yatt.rl:7400", "listen": "0.0.0.0:7400",
        "advertise": "10.4.0.7:7400", "http": "0.0.0.0:7480", "devices": 4,
        "certs": {"dir": "/etc/yatt/certs", "dev": false, "ca": "/etc/yatt/certs/ca.pem",
                  "cert": "/etc/yatt/certs/yatt-node-2.pem", "key": "/etc/yatt/certs/yatt-node-2.key"},
    });
    for (k, v) in want.as_object().unwrap() {
        assert_eq!(&two[k], v, "plan[{k}] in {two:#}");
    }
}

#[test]
fn a_bad_launcher_environment_stops_the_node_naming_the_variable_and_the_fix() {
    let cases: &[(&str, &[(&str, &str)], &[&str])] = &[
        (
            "slurm",
            &[("SLURM_NODEID", "0"), ("SLURM_GPUS_ON_NODE", "1")],
            &["SLURM_JOB_NODELIST is not set", "srun"],
        ),
        (
            "slurm",
            &[
                ("SLURM_JOB_NODELIST", "gpu[01-03"),
                ("SLURM_NODEID", "0"),
                ("SLURM_GPUS_ON_NODE", "1"),
            ],
            &["SLURM_JOB_NODELIST=\"gpu[01-03\"", "bracket"],
        ),
        (
            "k8s",
            &[("POD_NAME", "yatt-node-1")],
            &["YATT_K8S_SERVICE is not set", "headless Service"],
        ),
    ];
    for (launcher, env, want) in cases {
        for cmd in ["plan", "run"] {
            let out = Command::new(yatt_node_bin())
                .args([cmd, "--launcher", launcher, "--http", ""])
                .env_clear()
                .envs(env.iter().copied())
                .stdin(Stdio::null())
                .output()
                .unwrap();
            let err = String::from_utf8_lossy(&out.stderr);
            assert!(!out.status.success(), "{cmd} {launcher} {env:?} succeeded");
            for w in *want {
                assert!(
                    err.contains(w),
                    "{cmd} {launcher} {env:?}: {err:?} lacks {w:?}"
                );
            }
        }
    }
}

/// A port free for UDP (`udp`) or TCP on every one of [`HOSTS`].
fn free_port(udp: bool) -> u16 {
    for _ in 0..50 {
        let port = if udp {
            UdpSocket::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        } else {
            TcpListener::bind("127.0.0.1:0")
                .unwrap()
                .local_addr()
                .unwrap()
                .port()
        };
        let all = HOSTS.iter().all(|h| {
            let a: SocketAddr = format!("{h}:{port}").parse().unwrap();
            if udp {
                UdpSocket::bind(a).is_ok()
            } else {
                TcpListener::bind(a).is_ok()
            }
        });
        if all {
            return port;
        }
    }
    panic!("no port free on all of {HOSTS:?}");
}

/// A process group that is killed (SIGKILL) when dropped: the script and every daemon
/// its fake srun started, also when the test fails.
struct Group(Child);

impl Drop for Group {
    fn drop(&mut self) {
        // SAFETY: kill(2) on our own child's process group.
        unsafe { libc::kill(-(self.0.id() as i32), libc::SIGKILL) };
        let _ = self.0.wait();
    }
}

/// Fake `scontrol` (`show hostnames LIST` prints the three loopback "hosts") and
/// `srun`: without `--overlap` it starts its command once per host, as Slurm starts one
/// task per node, with the variables slurmd sets; with `--overlap` it runs the command
/// here (the head). The three "hosts" share this machine's network, so each task binds
/// its own loopback address (YATT_LISTEN_HOST, YATT_HTTP_HOST), as separate machines
/// would bind theirs.
fn write_fakes(bin: &Path, logs: &Path) {
    std::fs::create_dir_all(bin).unwrap();
    let scontrol = format!(
        r#"#!/usr/bin/env bash
[ "$1 $2" = "show hostnames" ] || {{ echo "fake scontrol: only 'show hostnames'" >&2; exit 2; }}
[ "$3" = "127.0.0.[1-3]" ] || {{ echo "fake scontrol: unexpected node list $3" >&2; exit 2; }}
printf '%s\n' {hosts}
"#,
        hosts = HOSTS.join(" ")
    );
    let srun = format!(
        r#"#!/usr/bin/env bash
overlap=0
while [ $# -gt 0 ]; do
  case "$1" in
    --overlap) overlap=1; shift ;;
    -*) shift ;;
    *) break ;;
  esac
done
if [ "$overlap" = 1 ]; then exec "$@"; fi
hosts=({hosts})
pids=()
for i in "${{!hosts[@]}}"; do
  h=${{hosts[$i]}}
  SLURM_NODEID=$i SLURM_PROCID=$i SLURMD_NODENAME=$h SLURM_GPUS_ON_NODE=1 \
    YATT_LISTEN_HOST=$h YATT_HTTP_HOST=$h "$@" >"{logs}/node-$i.log" 2>&1 &
  pids+=($!)
done
trap 'kill -TERM "${{pids[@]}}" 2>/dev/null' TERM INT
status=0
for p in "${{pids[@]}}"; do
  while :; do
    wait "$p"; rc=$?
    kill -0 "$p" 2>/dev/null || break
  done
  [ "$rc" -eq 0 ] || status=$rc
done
exit "$status"
"#,
        hosts = HOSTS.join(" "),
        logs = logs.display()
    );
    for (name, text) in [("scontrol", scontrol), ("srun", srun)] {
        let p = bin.join(name);
        std::fs::write(&p, text).unwrap();
        std::fs::set_permissions(&p, std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    }
}

/// `text` without terminal colour codes (`ESC [ ... m`), which the log may carry.
fn strip_ansi(text: &str) -> String {
    let mut out = String::new();
    let mut chars = text.chars();
    while let Some(c) = chars.next() {
        if c == '\u{1b}' {
            chars.by_ref().find(|&c| c == 'm');
        } else {
            out.push(c);
        }
    }
    out
}

fn logs_of(dir: &Path) -> String {
    (0..HOSTS.len())
        .map(|i| {
            let t = std::fs::read_to_string(dir.join(format!("node-{i}.log"))).unwrap_or_default();
            format!("--- node-{i} ({}):\n{t}", HOSTS[i])
        })
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn the_sbatch_script_starts_three_daemons_that_join_through_the_head_and_trains() {
    let dir = tempfile::tempdir().unwrap();
    let (bin, logs, out) = (
        dir.path().join("bin"),
        dir.path().join("logs"),
        dir.path().join("run"),
    );
    std::fs::create_dir_all(&logs).unwrap();
    write_fakes(&bin, &logs);
    let (port, http_port) = (free_port(true), free_port(false));
    let path = format!(
        "{}:{}",
        bin.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let sets = [
        "job.steps=2",
        "placement.mode=\"disaggregated\"",
        "placement.rollout=\"127.0.0.3\"",
        "placement.reward=\"127.0.0.3\"",
        "placement.policy=\"127.0.0.2\"",
        "placement.reference=\"127.0.0.2\"",
    ];
    let mut cmd = Command::new("bash");
    cmd.arg(PathBuf::from(ROOT).join("deploy/slurm/yatt.sbatch"))
        .arg(PathBuf::from(ROOT).join("config/demo-letters.toml"));
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.arg("--set")
        .arg(format!("job.output_dir=\"{}\"", out.display()));
    let t0 = Instant::now();
    let child = cmd
        .env("PATH", path)
        .env("SLURM_JOB_NODELIST", "127.0.0.[1-3]")
        .env("SLURM_JOB_ID", "4242")
        .env("SLURM_SUBMIT_DIR", dir.path())
        .env("YATT_BIN", yatt_bin())
        .env("YATT_NODE_BIN", yatt_node_bin())
        .env("YATT_PORT", port.to_string())
        .env("YATT_HTTP_PORT", http_port.to_string())
        .env("YATT_TRAIN_PORT", "0")
        .env("YATT_JOIN_TIMEOUT", "60")
        .env_remove("YATT_GPUS_PER_NODE")
        .env_remove("NCCL_SOCKET_IFNAME")
        .stdout(std::fs::File::create(dir.path().join("sbatch.out")).unwrap())
        .stderr(std::fs::File::create(dir.path().join("sbatch.err")).unwrap())
        .process_group(0)
        .spawn()
        .expect("running bash deploy/slurm/yatt.sbatch");
    let mut group = Group(child);
    let status = poll(Duration::from_secs(180), || {
        group.0.try_wait().ok().flatten()
    });
    let printed = std::fs::read_to_string(dir.path().join("sbatch.out")).unwrap_or_default()
        + &std::fs::read_to_string(dir.path().join("sbatch.err")).unwrap_or_default();
    assert!(
        status.is_some_and(|s| s.success()),
        "the sbatch script ended with {status:?} after {:.1?}:\n{printed}\n{}",
        t0.elapsed(),
        logs_of(&logs)
    );
    let node_logs = logs_of(&logs);
    // The script made the CA, one certificate per host of the node list, the trainer's.
    let certs = dir.path().join("yatt-certs-4242");
    for f in [
        "ca.pem",
        "127.0.0.1.pem",
        "127.0.0.2.key",
        "127.0.0.3.pem",
        "train.pem",
    ] {
        assert!(
            certs.join(f).is_file(),
            "{f} missing in {}",
            certs.display()
        );
    }
    assert!(printed.contains("all 3 nodes joined"), "{printed}");
    let seed = format!("127.0.0.1:{port}");
    assert!(
        printed.contains(&format!("cluster: joined as train through {seed}")),
        "{printed}"
    );
    assert!(printed.contains("done: 2 steps"), "{printed}");
    // The head led; the others took it as their seed from the node list.
    let launch_line = |i: usize| {
        let t = std::fs::read_to_string(logs.join(format!("node-{i}.log"))).unwrap_or_default();
        let line = t.lines().find(|l| l.contains("launch")).unwrap_or_default();
        strip_ansi(line)
    };
    assert!(launch_line(0).contains("seed=None"), "{node_logs}");
    for i in 1..3 {
        assert!(
            launch_line(i).contains(&format!("seed=Some(\"{seed}\")")),
            "{node_logs}"
        );
    }
    assert_eq!(steps_done(&out), 2);
    eprintln!(
        "sbatch: 3 nodes joined and 2 steps trained in {:.1?}",
        t0.elapsed()
    );
}

/// How the three test daemons are launched.
#[derive(Clone, Copy, PartialEq)]
enum As {
    /// `--launcher slurm` under the environment srun gives each node: names 127.0.0.1-3.
    Slurm,
    /// `--launcher k8s` as a StatefulSet of 3 behind the headless Service `yatt`: pods
    /// `yatt-node-0..2`, whose DNS names (`yatt-node-K.yatt`) a hosts file maps to
    /// 127.0.0.1-3 (YATT_HOSTS_FILE).
    K8s,
}

/// Three daemons started as `yatt-node run --launcher slurm|k8s`, with certificates
/// made as the sbatch script makes them.
struct Launched {
    dir: tempfile::TempDir,
    launcher: As,
    port: u16,
    http_port: u16,
    nodes: Vec<Option<Child>>,
}

impl Launched {
    fn start(launcher: As) -> Launched {
        let dir = tempfile::tempdir().unwrap();
        let certs = dir.path().join("certs");
        let node = |args: &[&str]| {
            let ok = Command::new(yatt_node_bin()).args(args).output().unwrap();
            assert!(
                ok.status.success(),
                "{}",
                String::from_utf8_lossy(&ok.stderr)
            );
        };
        let c = certs.to_str().unwrap();
        node(&["init", "--dir", c]);
        let mut l = Launched {
            dir,
            launcher,
            port: free_port(true),
            http_port: free_port(false),
            nodes: Vec::new(),
        };
        for i in 0..HOSTS.len() {
            node(&["cert", "--ca-dir", c, "--name", &l.name(i)]);
        }
        node(&[
            "cert", "--ca-dir", c, "--name", "train", "--kind", "trainer",
        ]);
        let hosts: String = (0..HOSTS.len())
            .map(|i| format!("{} {}.yatt\n", HOSTS[i], l.name(i)))
            .collect();
        std::fs::write(l.dir.path().join("hosts"), hosts).unwrap();
        // All at once, as srun starts its tasks and a StatefulSet with Parallel pod
        // management its pods.
        for i in 0..HOSTS.len() {
            let child = l.spawn(i, 0);
            l.nodes.push(Some(child));
        }
        let all = poll(Duration::from_secs(30), || {
            (0..HOSTS.len())
                .all(|i| l.alive_incarnation(&l.name(i)).is_some())
                .then_some(())
        });
        assert!(all.is_some(), "the nodes did not all join:\n{}", l.logs());
        l
    }

    /// Node `i`'s name: its host's, or its pod's.
    fn name(&self, i: usize) -> String {
        match self.launcher {
            As::Slurm => HOSTS[i].to_string(),
            As::K8s => format!("yatt-node-{i}"),
        }
    }

    fn spawn(&self, i: usize, life: usize) -> Child {
        let log =
            std::fs::File::create(self.dir.path().join(format!("node-{i}.{life}.log"))).unwrap();
        let mut cmd = Command::new(yatt_node_bin());
        match self.launcher {
            As::Slurm => cmd
                .args(["run", "--launcher", "slurm"])
                .env_clear()
                .env("SLURM_JOB_NODELIST", "127.0.0.[1-3]")
                .env("SLURM_NODEID", i.to_string())
                .env("SLURM_GPUS_ON_NODE", "1"),
            As::K8s => cmd
                .args(["run", "--launcher", "k8s"])
                .env_clear()
                .env("POD_NAME", self.name(i))
                .env("POD_IP", HOSTS[i])
                .env("YATT_K8S_SERVICE", "yatt")
                .env("YATT_REPLICAS", HOSTS.len().to_string())
                .env("YATT_GPUS_PER_NODE", "1")
                .env("YATT_HOSTS_FILE", self.dir.path().join("hosts")),
        };
        cmd.arg("--certs")
            .arg(self.dir.path().join("certs"))
            .arg("--data-dir")
            .arg(self.dir.path())
            .env("YATT_PORT", self.port.to_string())
            .env("YATT_HTTP_PORT", self.http_port.to_string())
            .env("YATT_LISTEN_HOST", HOSTS[i])
            .env("YATT_HTTP_HOST", HOSTS[i])
            .stdout(log.try_clone().unwrap())
            .stderr(log)
            .spawn()
            .unwrap()
    }

    /// `/health` of node `i`.
    fn health_of(&self, i: usize) -> Option<serde_json::Value> {
        use std::io::{Read as _, Write as _};
        let addr: SocketAddr = format!("{}:{}", HOSTS[i], self.http_port).parse().unwrap();
        let mut s = std::net::TcpStream::connect_timeout(&addr, Duration::from_secs(1)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(2))).ok()?;
        s.write_all(b"GET /health HTTP/1.0\r\nHost: x\r\n\r\n")
            .ok()?;
        let mut text = String::new();
        s.read_to_string(&mut text).ok()?;
        serde_json::from_str(text.split("\r\n\r\n").nth(1)?).ok()
    }

    /// The incarnation under which the head sees `name` alive.
    fn alive_incarnation(&self, name: &str) -> Option<u64> {
        self.alive_incarnation_at(0, name)
    }

    /// The incarnation under which node `i` sees `name` alive.
    fn alive_incarnation_at(&self, i: usize, name: &str) -> Option<u64> {
        let h = self.health_of(i)?;
        h["nodes"]
            .as_array()?
            .iter()
            .find(|n| n["name"] == name && n["alive"] == true)?["incarnation"]
            .as_u64()
    }

    /// The (leader, term) node `i` follows, by its `/health`.
    fn lead_at(&self, i: usize) -> Option<(String, u64)> {
        let h = self.health_of(i)?;
        Some((h["leader"].as_str()?.to_string(), h["term"].as_u64()?))
    }

    fn log_of(&self, i: usize, life: usize) -> String {
        let t = std::fs::read_to_string(self.dir.path().join(format!("node-{i}.{life}.log")));
        strip_ansi(&t.unwrap_or_default())
    }

    fn logs(&self) -> String {
        let mut names: Vec<PathBuf> = std::fs::read_dir(self.dir.path())
            .unwrap()
            .map(|e| e.unwrap().path())
            .filter(|p| p.extension().is_some_and(|x| x == "log"))
            .collect();
        names.sort();
        names
            .iter()
            .map(|p| {
                format!(
                    "--- {}:\n{}",
                    p.display(),
                    std::fs::read_to_string(p).unwrap_or_default()
                )
            })
            .collect::<Vec<_>>()
            .join("\n")
    }
}

impl Drop for Launched {
    fn drop(&mut self) {
        for c in self.nodes.iter_mut().flatten() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }
}

/// `yatt train` of demo-letters for `steps` steps, joined through node `via`: rollout
/// and reward on node `victim`, policy and reference on node `other`.
fn start_training(
    cluster: &Launched,
    steps: usize,
    via: usize,
    victim: usize,
    other: usize,
) -> Child {
    let out = cluster.dir.path().join("run");
    let config = format!("{ROOT}/config/demo-letters.toml");
    let mut train = Command::new(yatt_bin());
    train.args(["train", &config]);
    let (v, o) = (cluster.name(victim), cluster.name(other));
    for s in [
        format!("job.steps={steps}"),
        "placement.mode=\"disaggregated\"".into(),
        format!("placement.rollout=\"{v}\""),
        format!("placement.reward=\"{v}\""),
        format!("placement.policy=\"{o}\""),
        format!("placement.reference=\"{o}\""),
        format!("job.output_dir=\"{}\"", out.display()),
    ] {
        train.arg("--set").arg(s);
    }
    train
        .args(["--cluster", &format!("{}:{}", HOSTS[via], cluster.port)])
        .arg("--certs")
        .arg(cluster.dir.path().join("certs"))
        .args(["--name", "train", "--listen", "127.0.0.1:0"])
        .stdout(std::fs::File::create(cluster.dir.path().join("train.log")).unwrap())
        .stderr(std::fs::File::create(cluster.dir.path().join("train.err")).unwrap())
        .spawn()
        .unwrap()
}

/// What `yatt train` printed.
fn printed(cluster: &Launched) -> String {
    let dir = cluster.dir.path();
    std::fs::read_to_string(dir.join("train.log")).unwrap_or_default()
        + &std::fs::read_to_string(dir.join("train.err")).unwrap_or_default()
}

/// Waits (bounded) for `step` steps done; returns the steps done.
fn await_step(cluster: &Launched, step: usize) -> usize {
    let out = cluster.dir.path().join("run");
    let reached = poll(Duration::from_secs(120), || {
        (steps_done(&out) >= step).then_some(())
    });
    assert!(
        reached.is_some(),
        "{}\n{}",
        printed(cluster),
        cluster.logs()
    );
    steps_done(&out)
}

/// Waits (bounded) for the run to end and checks it: successful, every step trained
/// every one of its samples once, and roles respawned. Returns the respawn steps.
fn finish_training(cluster: &Launched, run: &mut Child, steps: usize) -> Vec<(usize, f64)> {
    let out = cluster.dir.path().join("run");
    let status = poll(Duration::from_secs(180), || run.try_wait().ok().flatten());
    if status.is_none() {
        let _ = run.kill();
    }
    let text = printed(cluster);
    assert!(
        status.is_some_and(|s| s.success()),
        "{status:?}\n{text}\n{}",
        cluster.logs()
    );
    let trained = metric_of_steps(&out, "ledger/samples_trained");
    assert_eq!(trained.len(), steps, "{trained:?}");
    // demo-letters: 8 prompts × 8 samples a step, each trained once.
    assert!(trained.iter().all(|(_, n)| *n == 64.0), "{trained:?}");
    let respawned = metric_of_steps(&out, "recovery/respawned_roles");
    assert!(!respawned.is_empty(), "no roles were respawned:\n{text}");
    respawned
}

/// Kills node `i` (`kill -9`) and starts it again at once under its name with the same
/// launcher environment, as a StatefulSet restarts a pod.
fn kill_and_restart(cluster: &mut Launched, i: usize) -> Instant {
    let mut victim = cluster.nodes[i].take().unwrap();
    victim.kill().unwrap();
    victim.wait().unwrap();
    let t_kill = Instant::now();
    cluster.nodes[i] = Some(cluster.spawn(i, 1));
    t_kill
}

/// As a StatefulSet restarts a pod: the rollout's and reward's node is killed with
/// `kill -9` mid-run and started again at once under its name, with the same launcher
/// environment. It rejoins as a new incarnation; the trainer treats what it held as
/// lost and respawns those roles; every step trains every one of its samples once, and
/// the run ends.
#[test]
fn a_node_killed_and_restarted_under_its_name_mid_run_is_survived() {
    let mut cluster = Launched::start(As::Slurm);
    let steps = 40;
    let mut run = start_training(&cluster, steps, 0, 2, 1);
    let at_step = await_step(&cluster, 3);
    let before = cluster
        .alive_incarnation("127.0.0.3")
        .expect("127.0.0.3 alive");
    let t_kill = kill_and_restart(&mut cluster, 2);
    let back = poll(Duration::from_secs(30), || {
        cluster
            .alive_incarnation("127.0.0.3")
            .filter(|&i| i != before)
    });
    let rejoined_s = t_kill.elapsed().as_secs_f64();
    assert!(
        back.is_some(),
        "127.0.0.3 did not rejoin:\n{}",
        cluster.logs()
    );
    let respawned = finish_training(&cluster, &mut run, steps);
    eprintln!(
        "killed 127.0.0.3 at step {at_step}; it rejoined as incarnation {} (was {before}) after {rejoined_s:.2} s; roles respawned at steps {respawned:?}; {steps} steps, every sample trained once",
        back.unwrap()
    );
}

/// The seed itself restarted: StatefulSet pod `yatt-node-0`, which the others joined
/// through and which led, is killed with `kill -9` mid-run and started again at once
/// under its name and arguments. It has no seed, but its peers (the other pods, from
/// YATT_REPLICAS) answer that a live cluster exists, so it waits for them to elect
/// another leader and rejoins that same cluster as a new incarnation, instead of
/// leading one of its own: every node lists it alive under the new incarnation, all
/// three follow one leader and term, and the run ends with every sample trained once.
#[test]
fn a_restarted_seed_pod_rejoins_the_live_cluster_instead_of_leading_its_own() {
    let mut cluster = Launched::start(As::K8s);
    // A fresh start: pod 0 asked its peers, found them joining, and led term 1.
    assert_eq!(cluster.lead_at(1), Some(("yatt-node-0".into(), 1)));
    let fresh = cluster.log_of(0, 0);
    let founded = fresh
        .lines()
        .find(|l| l.contains("no peer belongs to a cluster"))
        .unwrap_or_else(|| panic!("pod 0 did not ask its peers before leading:\n{fresh}"))
        .to_string();
    let steps = 40;
    // Through pod 1: pod 0 is the one killed.
    let mut run = start_training(&cluster, steps, 1, 0, 2);
    let at_step = await_step(&cluster, 3);
    let before = cluster
        .alive_incarnation_at(1, "yatt-node-0")
        .expect("yatt-node-0 alive");
    let t_kill = kill_and_restart(&mut cluster, 0);
    // Back in the same cluster: the other pods list it under a new incarnation, and
    // everyone, the restarted pod too, follows one leader in one term.
    let back = poll(Duration::from_secs(60), || {
        let seen: Vec<Option<u64>> = (0..3)
            .map(|i| cluster.alive_incarnation_at(i, "yatt-node-0"))
            .collect();
        let leads: Vec<Option<(String, u64)>> = (0..3).map(|i| cluster.lead_at(i)).collect();
        let new = seen[1].filter(|&n| n != before);
        let agreed = new.is_some()
            && seen.iter().all(|s| *s == new)
            && leads[0].is_some()
            && leads.iter().all(|l| *l == leads[0]);
        agreed.then(|| (new.unwrap(), leads[0].clone().unwrap()))
    });
    let rejoined_s = t_kill.elapsed().as_secs_f64();
    let Some((incarnation, (leader, term))) = back else {
        panic!(
            "yatt-node-0 did not rejoin the cluster (incarnations seen {:?}, leads {:?}):\n{}",
            (0..3)
                .map(|i| cluster.alive_incarnation_at(i, "yatt-node-0"))
                .collect::<Vec<_>>(),
            (0..3).map(|i| cluster.lead_at(i)).collect::<Vec<_>>(),
            cluster.logs()
        )
    };
    // One cluster, led by a surviving pod in a later term; not a second one of pod 0.
    assert_ne!(leader, "yatt-node-0", "{}", cluster.logs());
    assert!(term >= 2, "term {term}");
    let restarted = cluster.log_of(0, 1);
    assert!(
        restarted.contains("a live cluster answers: rejoining it"),
        "{restarted}"
    );
    assert!(!restarted.contains("leading a new one"), "{restarted}");
    let respawned = finish_training(&cluster, &mut run, steps);
    // The restarted pod still belongs to the cluster at the end, under the same life.
    assert_eq!(
        cluster.alive_incarnation_at(1, "yatt-node-0"),
        Some(incarnation),
        "{}",
        cluster.logs()
    );
    eprintln!(
        "fresh start: {founded}\nkilled yatt-node-0 (the seed, leader of term 1) at step {at_step}; it rejoined as incarnation {incarnation} (was {before}) after {rejoined_s:.2} s, {leader} leading term {term}; roles respawned at steps {respawned:?}; {steps} steps, every sample trained once"
    );
}
