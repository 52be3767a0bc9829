//! Helpers for the multi-process integration tests: start real `yatt-node` processes on
//! loopback, wait for conditions by polling with a deadline, and clean up (every child
//! is killed when its [`Cluster`] drops, also when a test fails).

pub mod browser;
mod chaos;
pub mod insecure;
mod relay;

pub use chaos::{
    hosted_roles, inflict, schedule, table_header, ChaosConfig, ChaosRng, Fault, FaultRecord,
    Planned,
};
pub use relay::UdpRelay;

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::time::{Duration, Instant};

/// Where the `yatt-node` binary is: `$YATT_NODE_BIN`, or next to the test binary's
/// `deps/` folder (cargo puts both under `target/<profile>/`).
pub fn yatt_node_bin() -> PathBuf {
    binary("yatt-node", "YATT_NODE_BIN")
}

/// Where the `yatt` binary is: `$YATT_BIN`, or next to the test binary's `deps/` folder.
pub fn yatt_bin() -> PathBuf {
    binary("yatt", "YATT_BIN")
}

fn binary(name: &str, var: &str) -> PathBuf {
    if let Some(p) = std::env::var_os(var) {
        return p.into();
    }
    let exe = std::env::current_exe().expect("test binary path");
    let profile_dir = exe
        .parent()
        .and_then(Path::parent)
        .expect("target/<profile>/deps/<test>");
    let bin = profile_dir.join(name);
    assert!(
        bin.exists(),
        "{} is missing: build it first with `cargo build --bins` in the same profile (scripts/test.sh does)",
        bin.display()
    );
    bin
}

/// Polls `f` every 20 ms until it returns `Some`, at most `timeout`.
pub fn poll<T>(timeout: Duration, mut f: impl FnMut() -> Option<T>) -> Option<T> {
    let end = Instant::now() + timeout;
    loop {
        if let Some(v) = f() {
            return Some(v);
        }
        if Instant::now() >= end {
            return None;
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Waits at most `timeout` for `child` to exit; kills (and reaps) it if it did not.
fn wait_or_kill(child: &mut Child, timeout: Duration) -> Option<std::process::ExitStatus> {
    let status = poll(timeout, || child.try_wait().ok().flatten());
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    status
}

/// One `yatt-node` process.
pub struct NodeProc {
    /// The node's name.
    pub name: String,
    /// Its QUIC address (the one it advertises).
    pub addr: SocketAddr,
    /// The address its QUIC endpoint is bound to.
    pub listen: SocketAddr,
    /// Its HTTP address.
    pub http: SocketAddr,
    /// Its process id.
    pub pid: u32,
    child: Option<Child>,
    log: PathBuf,
    ready: PathBuf,
}

impl NodeProc {
    /// Whether the node has written its ready file (it listens and joined); reads its
    /// addresses from it.
    pub fn ready(&mut self) -> bool {
        if self.http.port() != 0 {
            return true;
        }
        let Some(info) = std::fs::read_to_string(&self.ready)
            .ok()
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        else {
            return false;
        };
        let addr = |k: &str| info[k].as_str().and_then(|a| a.parse::<SocketAddr>().ok());
        match (addr("addr"), addr("listen"), addr("http")) {
            (Some(a), Some(l), Some(h)) => {
                (self.addr, self.listen, self.http) = (a, l, h);
                true
            }
            _ => false,
        }
    }

    /// Whether the process has exited (a node whose join failed stops by itself).
    pub fn exited(&mut self) -> bool {
        self.child
            .as_mut()
            .is_none_or(|c| c.try_wait().ok().flatten().is_some())
    }

    /// Sends SIGKILL and reaps the process.
    pub fn kill9(&mut self) {
        if let Some(mut c) = self.child.take() {
            let _ = c.kill();
            let _ = c.wait();
        }
    }

    /// Sends SIGSTOP: the process stands still (timers, sockets, everything) until
    /// [`NodeProc::resume`].
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// Sends SIGCONT to a paused process.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    fn signal(&self, signal: i32) {
        if let Some(c) = &self.child {
            // SAFETY: plain kill(2) on our own child's pid.
            unsafe {
                libc::kill(c.id() as i32, signal);
            }
        }
    }

    /// The incarnation `/health` reports.
    pub fn incarnation(&self) -> Option<u64> {
        self.health()?["incarnation"].as_u64()
    }

    /// The incarnation under which `/health` lists `node` alive.
    pub fn sees_alive_as(&self, node: &str) -> Option<u64> {
        let h = self.health()?;
        let n = h["nodes"].as_array()?.iter().find(|n| n["name"] == node)?;
        n["alive"]
            .as_bool()
            .filter(|a| *a)
            .and(n["incarnation"].as_u64())
    }

    /// The leader and term `/health` reports.
    pub fn lead(&self) -> Option<(String, u64)> {
        let h = self.health()?;
        Some((h["leader"].as_str()?.to_string(), h["term"].as_u64()?))
    }

    /// Sends SIGTERM and waits (bounded) for a clean exit; returns the exit code.
    pub fn terminate(&mut self, timeout: Duration) -> Option<i32> {
        let mut c = self.child.take()?;
        // SAFETY: plain kill(2) on our own child's pid.
        unsafe {
            libc::kill(c.id() as i32, libc::SIGTERM);
        }
        let status = poll(timeout, || c.try_wait().ok().flatten());
        match status {
            Some(s) => s.code(),
            None => {
                let _ = c.kill();
                let _ = c.wait();
                None
            }
        }
    }

    /// The node's log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }

    /// GET a path from the node's HTTP server; returns the body.
    pub fn http_get(&self, path: &str) -> Option<String> {
        use std::io::{Read, Write};
        let mut s =
            std::net::TcpStream::connect_timeout(&self.http, Duration::from_secs(2)).ok()?;
        s.set_read_timeout(Some(Duration::from_secs(5))).ok()?;
        write!(
            s,
            "GET {path} HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n"
        )
        .ok()?;
        let mut out = String::new();
        s.read_to_string(&mut out).ok()?;
        out.split_once("\r\n\r\n").map(|(_, body)| body.to_string())
    }

    /// `/health` as JSON.
    pub fn health(&self) -> Option<serde_json::Value> {
        serde_json::from_str(&self.http_get("/health")?).ok()
    }

    /// Whether `/health` reports `node` alive.
    pub fn sees_alive(&self, node: &str) -> Option<bool> {
        let h = self.health()?;
        h["nodes"]
            .as_array()?
            .iter()
            .find(|n| n["name"] == node)
            .and_then(|n| n["alive"].as_bool())
    }
}

impl Drop for NodeProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// A set of `yatt-node` processes sharing a dev CA in a temporary directory.
pub struct Cluster {
    /// The temporary directory (CA, ready files, logs).
    pub dir: tempfile::TempDir,
    /// The nodes; the first is the seed and directory leader.
    pub nodes: Vec<NodeProc>,
    /// Environment variables of one node's processes: (node name, key, value).
    node_env: Vec<(String, String, String)>,
    /// Working directories of some nodes' processes: (node name, directory).
    node_cwd: Vec<(String, PathBuf)>,
}

impl Cluster {
    /// Starts `n` nodes named `prefix-0`, `prefix-1`, ... and waits until all have joined.
    pub fn start(prefix: &str, n: usize) -> Cluster {
        Cluster::start_with(prefix, &vec![&[][..]; n])
    }

    /// Like [`Cluster::start`], one node per entry of `args`, each started with its
    /// extra `yatt-node run` arguments (e.g. `["--virtual-devices", "2"]`).
    pub fn start_with(prefix: &str, args: &[&[&str]]) -> Cluster {
        Cluster::start_with_env(prefix, args, &[])
    }

    /// Like [`Cluster::start_with`], with environment variables for some nodes'
    /// processes, restarts included: `(node index, key, value)` (a fault to inject).
    pub fn start_with_env(prefix: &str, args: &[&[&str]], env: &[(usize, &str, &str)]) -> Cluster {
        Cluster::start_in(prefix, args, env, &[])
    }

    /// Like [`Cluster::start_with_env`], with some nodes started in a working directory
    /// of their own: `(node index, directory)` (a relative path is each node's own).
    pub fn start_in(
        prefix: &str,
        args: &[&[&str]],
        env: &[(usize, &str, &str)],
        cwd: &[(usize, PathBuf)],
    ) -> Cluster {
        let dir = tempfile::tempdir().expect("tempdir");
        let mut cluster = Cluster {
            dir,
            nodes: Vec::new(),
            node_env: env
                .iter()
                .map(|(i, k, v)| (format!("{prefix}-{i}"), k.to_string(), v.to_string()))
                .collect(),
            node_cwd: cwd
                .iter()
                .map(|(i, d)| (format!("{prefix}-{i}"), d.clone()))
                .collect(),
        };
        for (i, extra) in args.iter().enumerate() {
            let seed = cluster.nodes.first().map(|s| s.addr);
            let node = cluster.spawn(&format!("{prefix}-{i}"), seed, extra);
            cluster.nodes.push(node);
        }
        let names: Vec<String> = cluster.nodes.iter().map(|n| n.name.clone()).collect();
        let leader = &cluster.nodes[0];
        let joined = poll(Duration::from_secs(20), || {
            names
                .iter()
                .all(|n| leader.sees_alive(n) == Some(true))
                .then_some(())
        });
        assert!(
            joined.is_some(),
            "nodes did not all join; leader log:\n{}",
            leader.log()
        );
        cluster
    }

    /// Starts one more node, `PREFIX-N` (N: the nodes so far), joining through node 0,
    /// and waits until it is ready (not until the others see it: a run started before
    /// it joins must wait for it).
    pub fn add_node(&mut self) {
        let prefix = self.nodes[0].name.trim_end_matches("-0").to_string();
        let name = format!("{prefix}-{}", self.nodes.len());
        let node = self.spawn(&name, Some(self.nodes[0].addr), &[]);
        self.nodes.push(node);
    }

    /// The dev CA directory, for in-test client nodes.
    pub fn ca_dir(&self) -> PathBuf {
        self.dir.path().join("ca")
    }

    /// Starts node `i` again under its name, as a new process (a new incarnation) that
    /// joins through the first node, and waits until that node sees it alive. The old
    /// process, if still running, is killed first.
    pub fn restart(&mut self, i: usize, extra: &[&str]) {
        self.restart_through(i, 0, extra);
    }

    /// Like [`Cluster::restart`], joining through node `via` (any member: one that does
    /// not lead the directory sends the join on to the leader) and waiting until `via`
    /// sees it alive.
    pub fn restart_through(&mut self, i: usize, via: usize, extra: &[&str]) {
        self.nodes[i].kill9();
        let name = self.nodes[i].name.clone();
        let seed = self.nodes[via].addr;
        let _ = std::fs::remove_file(self.dir.path().join(format!("{name}.ready")));
        let node = self.spawn(&name, Some(seed), extra);
        self.nodes[i] = node;
        let viewer = &self.nodes[via];
        let back = poll(Duration::from_secs(20), || {
            (viewer.sees_alive(&name) == Some(true)).then_some(())
        });
        assert!(
            back.is_some(),
            "{name} did not join again; its log:\n{}",
            self.nodes[i].log()
        );
    }

    /// Runs `yatt-node run` as `name`, joining through `seed`, when it is expected to
    /// stop by itself (a refused join): waits at most `timeout` for it to exit and
    /// returns its exit code (`None`: it was still running, and was killed) and its log.
    pub fn run_expecting_exit(
        &self,
        name: &str,
        seed: SocketAddr,
        timeout: Duration,
    ) -> (Option<i32>, String) {
        let log = self.dir.path().join(format!("{name}.refused.log"));
        let ready = self.dir.path().join(format!("{name}.refused.ready"));
        let mut child = self
            .command(name, Some(seed), &[], &ready, &log)
            .spawn()
            .expect("start yatt-node");
        let status = wait_or_kill(&mut child, timeout);
        (
            status.and_then(|s| s.code()),
            std::fs::read_to_string(&log).unwrap_or_default(),
        )
    }

    fn command(
        &self,
        name: &str,
        seed: Option<SocketAddr>,
        extra: &[&str],
        ready: &Path,
        log: &Path,
    ) -> Command {
        let mut cmd = Command::new(yatt_node_bin());
        cmd.args([
            "run",
            "--dev",
            "--name",
            name,
            "--listen",
            "127.0.0.1:0",
            "--http",
            "127.0.0.1:0",
        ])
        .arg("--certs")
        .arg(self.ca_dir())
        .arg("--ready-file")
        .arg(ready)
        .env("RUST_LOG", "info")
        .env_remove("RUST_BACKTRACE")
        .stdin(Stdio::null())
        .stdout(Stdio::null())
        .stderr(std::fs::File::create(log).expect("log file"));
        if let Some(seed) = seed {
            cmd.arg("--seed").arg(seed.to_string());
        }
        for (_, k, v) in self.node_env.iter().filter(|(n, _, _)| n == name) {
            cmd.env(k, v);
        }
        for (_, d) in self.node_cwd.iter().filter(|(n, _)| n == name) {
            cmd.current_dir(d);
        }
        if !extra.contains(&"--data-dir") {
            // Tests keep their runs in their own temporary directories.
            cmd.arg("--data-dir").arg(std::env::temp_dir());
        }
        cmd.args(extra);
        cmd
    }

    fn spawn(&self, name: &str, seed: Option<SocketAddr>, extra: &[&str]) -> NodeProc {
        let mut proc = self.launch(name, seed, extra);
        let ready = poll(Duration::from_secs(20), || proc.ready().then_some(()));
        assert!(
            ready.is_some(),
            "{name} did not become ready; log:\n{}",
            proc.log()
        );
        proc
    }

    /// Starts the process of node `name` and returns at once; its addresses are
    /// known once [`NodeProc::ready`].
    fn launch(&self, name: &str, seed: Option<SocketAddr>, extra: &[&str]) -> NodeProc {
        let ready = self.dir.path().join(format!("{name}.ready"));
        let _ = std::fs::remove_file(&ready);
        let log = self.dir.path().join(format!("{name}.log"));
        let child = self
            .command(name, seed, extra, &ready, &log)
            .spawn()
            .expect("start yatt-node");
        NodeProc {
            name: name.to_string(),
            addr: "0.0.0.0:0".parse().expect("literal"),
            listen: "0.0.0.0:0".parse().expect("literal"),
            http: "0.0.0.0:0".parse().expect("literal"),
            pid: child.id(),
            child: Some(child),
            log,
            ready,
        }
    }

    /// [`Cluster::restart_through`] without the waiting: starts node `i` again (killing
    /// the old process if it still runs) and returns; poll [`NodeProc::ready`] and
    /// whether the others see it alive.
    pub fn begin_restart(&mut self, i: usize, via: usize) {
        self.nodes[i].kill9();
        let name = self.nodes[i].name.clone();
        self.nodes[i] = self.launch(&name, Some(self.nodes[via].addr), &[]);
    }
}

/// Every node's log so far, for a failure message.
pub fn cluster_logs(cluster: &Cluster) -> String {
    cluster
        .nodes
        .iter()
        .map(|n| format!("--- {} ---\n{}", n.name, n.log()))
        .collect::<Vec<_>>()
        .join("\n")
}

/// This process as one more node of `cluster` (where the controllers run).
pub async fn join(cluster: &Cluster, name: &str) -> yatt_runtime::Node {
    yatt_runtime::Node::builder(name)
        .dev_certs(cluster.ca_dir())
        .seed(cluster.nodes[0].addr)
        .start()
        .await
        .expect("the controller joins")
}

/// Waits until no node hosts an actor: the roles a departed controller spawned are gone.
pub fn assert_roles_released(cluster: &Cluster) {
    for n in &cluster.nodes {
        let released = poll(Duration::from_secs(10), || {
            let h = n.health()?;
            h["hosted"].as_array()?.is_empty().then_some(())
        });
        assert!(
            released.is_some(),
            "{} still hosts roles: {:?}",
            n.name,
            n.health()
        );
    }
}

/// A policy replica's weights now: its version and its exported buckets.
pub async fn replica_weights(policy: &yatt_trainer::PolicyRef) -> yatt_roles::WeightsUpdate {
    use yatt_roles::{PolicyRequest, PolicyResponse};
    use yatt_roles::{RoleRequest, RoleResponse};
    let t = Duration::from_secs(30);
    match policy
        .ask(RoleRequest::Serve(PolicyRequest::ExportWeights), t)
        .await
        .expect("the replica exports its weights")
    {
        RoleResponse::Served(PolicyResponse::Weights(u)) => u,
        other => panic!("ExportWeights answered {other:?}"),
    }
}

impl Cluster {
    /// Runs `yatt train CONFIG --set ... --cluster SEED --dev --certs CA` with its output
    /// in `out` (`job.output_dir`; its stdout goes to `out/train.log`), waits at most
    /// `timeout`, and returns what it printed; panics, with the nodes' logs, unless it
    /// succeeded.
    pub fn yatt_train(&self, config: &str, sets: &[&str], out: &Path, timeout: Duration) -> String {
        let (ok, printed) = self.try_yatt_train(config, sets, out, timeout);
        assert!(
            ok,
            "yatt train --cluster failed:\n{printed}\n{}",
            cluster_logs(self)
        );
        printed
    }

    /// [`Cluster::yatt_train`] that returns whether it succeeded and what it printed
    /// (stdout, then stderr) instead of asserting.
    pub fn try_yatt_train(
        &self,
        config: &str,
        sets: &[&str],
        out: &Path,
        timeout: Duration,
    ) -> (bool, String) {
        self.run_train(
            train_command(config, sets, out),
            out,
            "train",
            timeout,
            true,
        )
    }

    /// `yatt train CONFIG --dry-run --set ... --cluster SEED ...` (stdout in
    /// `out/dry-run.log`): whether it exited 0, and what it printed.
    pub fn try_yatt_dry_run(
        &self,
        config: &str,
        sets: &[&str],
        out: &Path,
        timeout: Duration,
    ) -> (bool, String) {
        let mut cmd = train_command(config, sets, out);
        cmd.arg("--dry-run");
        self.run_train(cmd, out, "dry-run", timeout, true)
    }

    /// `yatt train --resume OUT --set ... --cluster SEED ...` (stdout in
    /// `out/resume.log`): like [`Cluster::yatt_train`], for a run directory.
    pub fn yatt_resume(&self, out: &Path, sets: &[&str], timeout: Duration) -> String {
        let mut cmd = Command::new(yatt_bin());
        cmd.arg("train").arg("--resume").arg(out);
        for s in sets {
            cmd.args(["--set", s]);
        }
        let (ok, printed) = self.run_train(cmd, out, "resume", timeout, true);
        assert!(
            ok,
            "yatt train --resume --cluster failed:\n{printed}\n{}",
            cluster_logs(self)
        );
        printed
    }

    fn run_train(
        &self,
        cmd: Command,
        out: &Path,
        log: &str,
        timeout: Duration,
        dev: bool,
    ) -> (bool, String) {
        let mut child = self.start_train_with(cmd, out, log, dev);
        let status = child.wait(timeout);
        let printed = child.printed();
        (
            status.is_some_and(|s| s.success()),
            format!("{status:?}\n{printed}"),
        )
    }

    /// [`Cluster::try_yatt_train`] under a certificate issued beforehand (`yatt-node
    /// cert`): `--certs DIR --name NAME`, without `--dev`.
    pub fn try_yatt_train_as(
        &self,
        config: &str,
        sets: &[&str],
        out: &Path,
        (certs, name): (&Path, &str),
        timeout: Duration,
    ) -> (bool, String) {
        let mut cmd = train_command(config, sets, out);
        cmd.arg("--certs").arg(certs).args(["--name", name]);
        self.run_train(cmd, out, "train", timeout, false)
    }

    /// Starts `cmd` (a `yatt train`) against this cluster with dev certificates, its
    /// output in `OUT/LOG.log` and `OUT/LOG.err`.
    fn start_train(&self, cmd: Command, out: &Path, log: &str) -> TrainProc {
        self.start_train_with(cmd, out, log, true)
    }

    fn start_train_with(&self, mut cmd: Command, out: &Path, log: &str, dev: bool) -> TrainProc {
        let (stdout, stderr) = (
            out.join(format!("{log}.log")),
            out.join(format!("{log}.err")),
        );
        cmd.arg("--cluster").arg(self.nodes[0].addr.to_string());
        if dev {
            cmd.arg("--dev").arg("--certs").arg(self.ca_dir());
        }
        // Warnings, and which path weight sync and gradients took (an info line each).
        let child = cmd
            .env(
                "RUST_LOG",
                [
                    "warn",
                    "yatt_trainer::controller::weights_ipc=info",
                    "yatt_trainer::controller::weights_nccl=info",
                    "yatt_trainer::controller::weights_direct=info",
                    "yatt_trainer::controller::data_parallel=info",
                    "yatt_trainer::build::first_sync=info",
                ]
                .join(","),
            )
            .stdin(Stdio::null())
            .stdout(std::fs::File::create(&stdout).expect("train log"))
            .stderr(std::fs::File::create(&stderr).expect("train stderr"))
            .spawn()
            .expect("start yatt train");
        TrainProc {
            child,
            stdout,
            stderr,
        }
    }
}

/// `yatt train CONFIG --set ... --set job.output_dir=OUT`.
fn train_command(config: &str, sets: &[&str], out: &Path) -> Command {
    let mut cmd = Command::new(yatt_bin());
    cmd.arg("train").arg(config);
    for s in sets {
        cmd.args(["--set", s]);
    }
    cmd.arg("--set")
        .arg(format!("job.output_dir=\"{}\"", out.display()));
    cmd
}

/// A `metrics.jsonl` line without what depends on the machine's speed (timings,
/// throughput, the wall clock), as sorted `(key, value)` pairs: what two runs of the
/// same job with the same seed must agree on.
pub fn deterministic_metrics(line: &str) -> Vec<(String, String)> {
    let v: serde_json::Value = serde_json::from_str(line).expect("a metrics.jsonl line is JSON");
    let mut out: Vec<(String, String)> = v
        .as_object()
        .expect("a metrics.jsonl line is an object")
        .iter()
        .filter(|(k, _)| {
            // A head's own value (`head/1/timing_s/gen`) is timed as its mean is.
            let k = k
                .strip_prefix("head/")
                .and_then(|r| r.split_once('/'))
                .map_or(k.as_str(), |(_, m)| m);
            !k.starts_with("timing_s/")
                && !k.starts_with("perf/")
                && k != "async/overlap_s"
                && k != "async/gen_ahead_s"
                && k != "time"
        })
        .map(|(k, v)| (k.clone(), v.to_string()))
        .collect();
    out.sort();
    out
}

/// The files of a run's final checkpoint (`OUT/checkpoint`, and its `critic/` when
/// there is one) that hold trainer state (weights, optimizer, step), each as `(name,
/// FNV-1a 64 of its bytes)`, sorted: two runs end with the same models and optimizers
/// exactly when these agree.
pub fn checkpoint_digest(out: &Path) -> Vec<(String, String)> {
    let dir = out.join("checkpoint");
    let files = |dir: &Path, prefix: &str| -> Vec<(String, String)> {
        std::fs::read_dir(dir)
            .unwrap_or_else(|e| panic!("{}: {e}", dir.display()))
            .map(|e| e.expect("a checkpoint entry").path())
            .filter(|p| {
                p.extension().is_some_and(|x| x == "safetensors")
                    || p.file_name().is_some_and(|n| n == "trainer_state.json")
            })
            .map(|p| {
                let bytes = std::fs::read(&p).expect("a checkpoint file");
                let name = p.file_name().expect("a name").to_string_lossy();
                (format!("{prefix}{name}"), format!("{:016x}", fnv1a(&bytes)))
            })
            .collect()
    };
    let mut v = files(&dir, "");
    if dir.join("critic").is_dir() {
        v.extend(files(&dir.join("critic"), "critic/"));
    }
    v.sort();
    assert!(!v.is_empty(), "{} holds no weights", dir.display());
    v
}

fn fnv1a(bytes: &[u8]) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, b| {
        (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3)
    })
}

/// `OUT/metrics.jsonl`'s lines as [`deterministic_metrics`], without the `recovery/`
/// counters (which only a disturbed run has).
pub fn run_trajectory(out: &Path) -> Vec<Vec<(String, String)>> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .map(|l| {
            let mut m = deterministic_metrics(l);
            m.retain(|(k, _)| !k.starts_with("recovery/"));
            m
        })
        .collect()
}

/// Steps `OUT/metrics.jsonl` records so far.
pub fn steps_done(out: &Path) -> usize {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .map(|t| t.lines().count())
        .unwrap_or(0)
}

/// A metric of every step of `OUT/metrics.jsonl` that has it, with its 1-based step.
pub fn metric_of_steps(out: &Path, key: &str) -> Vec<(usize, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap_or_default()
        .lines()
        .enumerate()
        .filter_map(|(i, l)| {
            let v: serde_json::Value = serde_json::from_str(l).ok()?;
            Some((i + 1, v[key].as_f64()?))
        })
        .collect()
}

impl Cluster {
    /// Starts `yatt train CONFIG --set ... --cluster ...` (or, with `resume`, `yatt
    /// train --resume OUT`) in the background, output in `OUT/train.log` / `train.err`
    /// (`resume.log` / `resume.err`). The child is killed when the guard drops.
    pub fn spawn_train(
        &self,
        config: &str,
        sets: &[String],
        out: &Path,
        resume: bool,
    ) -> TrainProc {
        self.spawn_train_with(config, sets, out, resume, &[])
    }

    /// [`Cluster::spawn_train`] with more `yatt train` arguments (e.g. `--http 0`).
    pub fn spawn_train_with(
        &self,
        config: &str,
        sets: &[String],
        out: &Path,
        resume: bool,
        extra: &[&str],
    ) -> TrainProc {
        let mut cmd = Command::new(yatt_bin());
        let log = if resume {
            cmd.arg("train").arg("--resume").arg(out);
            "resume"
        } else {
            cmd.arg("train").arg(config);
            cmd.arg("--set")
                .arg(format!("job.output_dir=\"{}\"", out.display()));
            "train"
        };
        for s in sets {
            cmd.args(["--set", s]);
        }
        cmd.args(extra);
        self.start_train(cmd, out, log)
    }
}

/// A `yatt train` child process ([`Cluster::spawn_train`]).
pub struct TrainProc {
    /// The process.
    pub child: Child,
    stdout: PathBuf,
    stderr: PathBuf,
}

impl TrainProc {
    /// The file its stdout goes to.
    pub fn stdout_path(&self) -> &Path {
        &self.stdout
    }

    /// What it printed so far (stdout, then stderr).
    pub fn printed(&self) -> String {
        std::fs::read_to_string(&self.stdout).unwrap_or_default()
            + &std::fs::read_to_string(&self.stderr).unwrap_or_default()
    }

    /// Waits at most `timeout` for it to exit (killing it if it did not).
    pub fn wait(&mut self, timeout: Duration) -> Option<std::process::ExitStatus> {
        wait_or_kill(&mut self.child, timeout)
    }

    /// Waits at most `timeout` for it to exit and checks that it succeeded (failing
    /// with what it printed and the cluster's logs); returns what it printed.
    pub fn wait_success(&mut self, timeout: Duration, cluster: &Cluster) -> String {
        let status = self.wait(timeout);
        let printed = self.printed();
        assert!(
            status.is_some_and(|s| s.success()),
            "{status:?}\n{printed}\n{}",
            cluster_logs(cluster)
        );
        printed
    }

    /// Sends SIGKILL and reaps it.
    pub fn kill9(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for TrainProc {
    fn drop(&mut self) {
        self.kill9();
    }
}

/// Runs `yatt train CONFIG` with `sets` to its end on a fresh cluster of `n` nodes
/// named `PREFIX-i`, output in `out`: the undisturbed run a disturbed one is compared
/// with ([`assert_same_run`]).
pub fn undisturbed_run(prefix: &str, n: usize, config: &str, sets: &[String], out: &Path) {
    let cluster = Cluster::start(prefix, n);
    let mut run = cluster.spawn_train(config, sets, out, false);
    run.wait_success(Duration::from_secs(120), &cluster);
}

/// Asserts that the run in `out` ended with the metrics, step for step, and the final
/// checkpoint bytes of the undisturbed run in `quiet` (`printed`: the disturbed run's
/// output, shown on a failure).
pub fn assert_same_run(quiet: &Path, out: &Path, printed: &str) {
    assert_eq!(
        run_trajectory(quiet),
        run_trajectory(out),
        "the disturbed run's metrics differ\n{printed}"
    );
    assert_eq!(
        checkpoint_digest(quiet),
        checkpoint_digest(out),
        "the disturbed run ends with other weights or optimizer state\n{printed}"
    );
}

impl Cluster {
    /// The index of the node that hosts a `role` actor now (its health lists it).
    pub fn node_hosting(&self, role: &str) -> Option<usize> {
        let path = format!("/{role}/");
        self.nodes.iter().position(|n| {
            n.health().is_some_and(|h| {
                h["hosted"].as_array().is_some_and(|a| {
                    a.iter()
                        .any(|x| x.as_str().is_some_and(|x| x.contains(&path)))
                })
            })
        })
    }
}

/// Waits at most 90 s until the run `run` writing to `out` has done `steps` steps;
/// otherwise fails with what it printed and the cluster's logs.
pub fn wait_for_steps(out: &Path, steps: usize, run: &TrainProc, cluster: &Cluster) {
    let reached = poll(Duration::from_secs(90), || {
        (steps_done(out) >= steps).then_some(())
    });
    assert!(
        reached.is_some(),
        "{}\n{}",
        run.printed(),
        cluster_logs(cluster)
    );
}

/// `--set`s that place a disaggregated run's roles (`(role, node index)`) on the nodes
/// `PREFIX-i`, for `steps` steps with a checkpoint every 3.
pub fn placed(prefix: &str, steps: u64, roles: &[(&str, usize)]) -> Vec<String> {
    let mut sets = vec![
        format!("job.steps={steps}"),
        "checkpoint.every=3".into(),
        "placement.mode=\"disaggregated\"".into(),
    ];
    sets.extend(
        roles
            .iter()
            .map(|(role, i)| format!("placement.{role}=\"{prefix}-{i}\"")),
    );
    sets
}
