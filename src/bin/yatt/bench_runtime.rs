//! `yatt bench runtime`: actor-runtime latency and throughput.
//!
//! Two processes on this machine (this one leads; a child of the same binary, started
//! with the hidden `--serve`, hosts the actors), the same figures for actors in one
//! process, and the machine's ceilings (memcpy, raw TCP and UDP over loopback, a bare
//! quinn echo with the cluster's TLS) measured in the same run. Figures go to stdout as
//! markdown; logs go to stderr.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream, UdpSocket};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context as _, Result};
use yatt_runtime::ActorName;
use yatt_runtime::Node;
use yatt_runtime::NodeConfig;
use yatt_runtime::TransportConfig;
use yatt_runtime::WithBulk;
use yatt_runtime::{spawn, Actor, ActorError, ActorRef, Context};
use yatt_runtime::{Bulk, BulkHeader, DType, TensorMeta};
use yatt_runtime::{CertKind, ClusterCa, SERVER_NAME};

/// Deadline of every ask and set-up step.
const T: Duration = Duration::from_secs(30);
const MIB: usize = 1 << 20;
const HANDOFF_BYTES: usize = 64 * MIB;
const FANOUT_BYTES: usize = 16 * MIB;
const WORKERS: usize = 8;
const PEER: &str = "bench-peer";

/// Ray 2.60 actors on the same kind of machine, as given in the issue.
const RAY_RTT_US: f64 = 681.0;
const RAY_CALLS_S: f64 = 4_089.0;
const RAY_HANDOFF_GBS: f64 = 1.57;
const RAY_FANOUT_MS: f64 = 20.6;
/// The goals.
const GOAL_RTT_US: f64 = 68.0;
const GOAL_CALLS_S: f64 = 41_000.0;
const GOAL_HANDOFF_GBS: f64 = 3.1;
const GOAL_FANOUT_MS: f64 = 4.0;

#[derive(clap::Args, Clone)]
pub struct BenchRuntimeArgs {
    /// Short run (a few seconds; noisier figures).
    #[arg(long)]
    quick: bool,
    /// Asks kept in flight for the pipelined figure.
    #[arg(long, default_value_t = 256)]
    in_flight: usize,
    /// Tokio worker threads in each process (default: one per core).
    #[arg(long)]
    workers: Option<usize>,
    /// Profiling aid: set up the two-process cluster, then only loop one figure for
    /// --profile-secs: rtt, pipe, handoff, handoff-inline, fanout, quinn-rtt, quinn-pipe.
    #[arg(long)]
    profile: Option<String>,
    /// How long --profile loops its figure, in seconds.
    #[arg(long, default_value_t = 15)]
    profile_secs: u64,
    /// Internal: run as the child process that hosts the actors.
    #[arg(long, hide = true)]
    serve: bool,
    #[arg(long, hide = true)]
    seed: Option<SocketAddr>,
    #[arg(long, hide = true)]
    ca_dir: Option<PathBuf>,
}

pub fn run(args: BenchRuntimeArgs) -> Result<()> {
    let mut rt = tokio::runtime::Builder::new_multi_thread();
    rt.enable_all();
    if let Some(w) = args.workers {
        rt.worker_threads(w.max(1));
    }
    let rt = rt.build()?;
    if args.serve {
        return rt.block_on(serve(args));
    }
    let plan = Plan::new(&args);
    if let Some(what) = &args.profile {
        let (a, w) = (args.clone(), what.clone());
        return on_runtime(&rt, async move { profile(&a, &w).await });
    }
    eprintln!("bench runtime: ceilings (memcpy, TCP, UDP)");
    let ceil = ceilings(&plan)?;
    eprintln!("bench runtime: in-process actors");
    let plan = Arc::new(plan);
    let p = plan.clone();
    let local = on_runtime(&rt, async move { in_process(&p).await })?;
    eprintln!("bench runtime: two processes");
    let (a, p) = (args.clone(), plan.clone());
    let (two, quinn) = on_runtime(&rt, async move { two_process(&a, &p).await })?;
    print_report(&args, &plan, &ceil, &local, &two, &quinn);
    Ok(())
}

/// Runs `fut` as a task on the runtime's workers, as an actor calling actors would,
/// not on the thread that blocks on the runtime (every wake-up would cross threads).
fn on_runtime<T: Send + 'static>(
    rt: &tokio::runtime::Runtime,
    fut: impl std::future::Future<Output = Result<T>> + Send + 'static,
) -> Result<T> {
    rt.block_on(async move { tokio::spawn(fut).await? })
}

/// How long each figure runs.
struct Plan {
    rtt_warmup: usize,
    rtt_iters: usize,
    pipe_warmup: Duration,
    pipe_secs: Duration,
    in_flight: usize,
    handoff_reps: usize,
    fanout_rounds: usize,
    tcp_reps: usize,
    pingpong_iters: usize,
}

impl Plan {
    fn new(args: &BenchRuntimeArgs) -> Self {
        let in_flight = args.in_flight.max(1);
        if args.quick {
            Plan {
                rtt_warmup: 200,
                rtt_iters: 1_000,
                pipe_warmup: Duration::from_millis(200),
                pipe_secs: Duration::from_millis(800),
                in_flight,
                handoff_reps: 3,
                fanout_rounds: 10,
                tcp_reps: 3,
                pingpong_iters: 2_000,
            }
        } else {
            Plan {
                rtt_warmup: 1_000,
                rtt_iters: 5_000,
                pipe_warmup: Duration::from_millis(500),
                pipe_secs: Duration::from_secs(3),
                in_flight,
                handoff_reps: 10,
                fanout_rounds: 50,
                tcp_reps: 8,
                pingpong_iters: 10_000,
            }
        }
    }
}

// ---------------------------------------------------------------------------------
// Actors
// ---------------------------------------------------------------------------------

/// Small request, small response.
struct Echo;
impl Actor for Echo {
    type Request = u64;
    type Response = u64;
    async fn handle(&mut self, r: u64, _: &mut Context) -> Result<u64, ActorError> {
        Ok(r)
    }
}

/// Receives a batch, reads every byte (crc32) and answers (tag, length, crc).
struct Sink;
impl Actor for Sink {
    type Request = WithBulk<u64>;
    type Response = (u64, u64, u32);
    async fn handle(
        &mut self,
        r: WithBulk<u64>,
        _: &mut Context,
    ) -> Result<(u64, u64, u32), ActorError> {
        Ok((r.meta, r.bulk.len(), r.bulk.checksum()))
    }
}

type EchoRef = ActorRef<u64, u64>;
type SinkRef = ActorRef<WithBulk<u64>, (u64, u64, u32)>;

// ---------------------------------------------------------------------------------
// Measurements shared by both paths
// ---------------------------------------------------------------------------------

#[derive(Clone, Copy, Debug, Default)]
struct Dist {
    median: Duration,
    p99: Duration,
    n: usize,
}

impl Dist {
    fn of(mut v: Vec<Duration>) -> Dist {
        if v.is_empty() {
            return Dist::default();
        }
        v.sort_unstable();
        let n = v.len();
        Dist {
            median: v[n / 2],
            p99: v[((n * 99) / 100).min(n - 1)],
            n,
        }
    }
}

/// One path's four figures.
#[derive(Clone, Debug, Default)]
struct Figures {
    rtt: Dist,
    calls_per_s: f64,
    /// 64 MiB handoff (shared memory where the path has it), time per handoff.
    handoff: Dist,
    /// 64 MiB handoff forced through the QUIC stream (two processes only).
    handoff_inline: Option<Dist>,
    fanout: Dist,
    fanout_inline: Option<Dist>,
}

/// Sequential asks of a tiny message.
async fn measure_rtt(echo: &EchoRef, plan: &Plan) -> Result<Dist> {
    for i in 0..plan.rtt_warmup as u64 {
        ensure!(echo.ask(i, T).await? == i, "echo answered wrong");
    }
    let mut v = Vec::with_capacity(plan.rtt_iters);
    for i in 0..plan.rtt_iters as u64 {
        let t0 = Instant::now();
        let r = echo.ask(i, T).await?;
        v.push(t0.elapsed());
        ensure!(r == i, "echo answered wrong");
    }
    Ok(Dist::of(v))
}

/// `plan.in_flight` asks always in flight (one task per slot, each asking in a loop);
/// completed calls per second over `plan.pipe_secs` after a warm-up.
async fn measure_pipelined<F, Fut>(plan: &Plan, call: F) -> Result<f64>
where
    F: Fn(u64) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = Result<u64>> + Send,
{
    let call = Arc::new(call);
    let done = Arc::new(AtomicU64::new(0));
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = tokio::task::JoinSet::new();
    for slot in 0..plan.in_flight as u64 {
        let (call, done, stop) = (call.clone(), done.clone(), stop.clone());
        tasks.spawn(async move {
            let mut i = slot << 32;
            while !stop.load(Ordering::Relaxed) {
                let r = call(i).await?;
                ensure!(r == i, "echo answered wrong");
                done.fetch_add(1, Ordering::Relaxed);
                i += 1;
            }
            Ok::<(), anyhow::Error>(())
        });
    }
    tokio::time::sleep(plan.pipe_warmup).await;
    let (c0, t0) = (done.load(Ordering::Relaxed), Instant::now());
    tokio::time::sleep(plan.pipe_secs).await;
    let (c1, t1) = (done.load(Ordering::Relaxed), Instant::now());
    stop.store(true, Ordering::Relaxed);
    while let Some(r) = tasks.join_next().await {
        r??;
    }
    Ok((c1 - c0) as f64 / (t1 - t0).as_secs_f64())
}

/// A `Bulk` of one u8 tensor over `data`, without copying.
fn bulk_of(data: &Bulk, range: std::ops::Range<usize>) -> Result<Bulk> {
    let n = (range.end - range.start) as u64;
    let header = BulkHeader {
        tensors: vec![TensorMeta {
            name: "data".into(),
            dtype: DType::U8,
            shape: vec![n],
            offset: 0,
            len: n,
        }],
        total_len: n,
    };
    Ok(Bulk::new(header, data.contiguous().slice(range))?)
}

/// Pseudo-random bytes (xorshift), so no layer can shortcut on zero pages.
fn test_data(n: usize) -> Result<Bulk> {
    let mut v = vec![0u8; n];
    let mut x: u64 = 0x9E37_79B9_7F4A_7C15;
    for c in v.chunks_mut(8) {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let b = x.to_le_bytes();
        c.copy_from_slice(&b[..c.len()]);
    }
    let header = BulkHeader {
        tensors: vec![TensorMeta {
            name: "data".into(),
            dtype: DType::U8,
            shape: vec![n as u64],
            offset: 0,
            len: n as u64,
        }],
        total_len: n as u64,
    };
    Ok(Bulk::new(header, v.into())?)
}

/// Asks the sink with the 64 MiB batch (prepared before timing); time per handoff
/// including the receiver's crc32 over every byte.
async fn measure_handoff(sink: &SinkRef, batch: &Bulk, want_crc: u32, reps: usize) -> Result<Dist> {
    let mut v = Vec::with_capacity(reps);
    for i in 0..=reps as u64 {
        let msg = WithBulk {
            meta: i,
            bulk: batch.clone(),
        };
        let t0 = Instant::now();
        let (tag, len, crc) = sink.ask(msg, T).await?;
        let dt = t0.elapsed();
        ensure!(
            tag == i && len == batch.len() && crc == want_crc,
            "sink saw different bytes (len {len}, crc {crc:#x}, want {want_crc:#x})"
        );
        if i > 0 {
            v.push(dt); // the first one is a warm-up
        }
    }
    Ok(Dist::of(v))
}

/// A controller splits 16 MiB into 8 zero-copy 2 MiB slices, asks the 8 workers at
/// once and gathers their (tag, length, crc) answers; time per round.
async fn measure_fanout(
    workers: &[SinkRef],
    data: &Bulk,
    want: &[u32],
    rounds: usize,
) -> Result<Dist> {
    let part = data.len() as usize / workers.len();
    let mut v = Vec::with_capacity(rounds);
    for round in 0..=rounds {
        let t0 = Instant::now();
        let mut set = tokio::task::JoinSet::new();
        for (k, w) in workers.iter().enumerate() {
            let bulk = bulk_of(data, k * part..(k + 1) * part)?;
            let w = w.clone();
            set.spawn(async move {
                w.ask(
                    WithBulk {
                        meta: k as u64,
                        bulk,
                    },
                    T,
                )
                .await
            });
        }
        let mut got = vec![None; workers.len()];
        while let Some(r) = set.join_next().await {
            let (k, len, crc) = r??;
            ensure!(len == part as u64, "worker {k} saw {len} bytes");
            got[k as usize] = Some(crc);
        }
        let dt = t0.elapsed();
        for (k, g) in got.iter().enumerate() {
            ensure!(
                *g == Some(want[k]),
                "worker {k} answered crc {g:?}, want {:#x}",
                want[k]
            );
        }
        if round > 0 {
            v.push(dt);
        }
    }
    Ok(Dist::of(v))
}

struct Batches {
    handoff: Bulk,
    handoff_crc: u32,
    fanout: Bulk,
    fanout_crcs: Vec<u32>,
}

fn batches() -> Result<Batches> {
    let handoff = test_data(HANDOFF_BYTES)?;
    let handoff_crc = handoff.checksum();
    let fanout = test_data(FANOUT_BYTES)?;
    let part = FANOUT_BYTES / WORKERS;
    let fanout_crcs = (0..WORKERS)
        .map(|k| bulk_of(&fanout, k * part..(k + 1) * part).map(|b| b.checksum()))
        .collect::<Result<_>>()?;
    Ok(Batches {
        handoff,
        handoff_crc,
        fanout,
        fanout_crcs,
    })
}

// ---------------------------------------------------------------------------------
// In-process path
// ---------------------------------------------------------------------------------

async fn in_process(plan: &Plan) -> Result<Figures> {
    let b = batches()?;
    let cap = NodeConfig::default().mailbox_capacity;
    let echo = spawn(ActorName::new("local", "echo", 0)?, Echo, cap).actor_ref;
    let sink = spawn(ActorName::new("local", "sink", 0)?, Sink, cap).actor_ref;
    let workers: Vec<SinkRef> = (0..WORKERS as u32)
        .map(|k| Ok(spawn(ActorName::new("local", "worker", k)?, Sink, cap).actor_ref))
        .collect::<Result<_>>()?;
    ensure!(echo.is_local() && sink.is_local());
    let rtt = measure_rtt(&echo, plan).await?;
    let e = echo.clone();
    let calls_per_s = measure_pipelined(plan, move |i| {
        let e = e.clone();
        async move { Ok(e.ask(i, T).await?) }
    })
    .await?;
    let handoff = measure_handoff(&sink, &b.handoff, b.handoff_crc, plan.handoff_reps).await?;
    let fanout = measure_fanout(&workers, &b.fanout, &b.fanout_crcs, plan.fanout_rounds).await?;
    Ok(Figures {
        rtt,
        calls_per_s,
        handoff,
        handoff_inline: None,
        fanout,
        fanout_inline: None,
    })
}

// ---------------------------------------------------------------------------------
// Two-process path
// ---------------------------------------------------------------------------------

fn node_config(shm: bool) -> NodeConfig {
    NodeConfig {
        // Loopback only; a generous failure timeout so a busy core never looks dead.
        failure_timeout: Duration::from_secs(10),
        transport: TransportConfig {
            shm_fast_path: shm,
            ..TransportConfig::default()
        },
        ..NodeConfig::default()
    }
}

/// A private directory for the dev CA, removed on drop.
struct TempDir(PathBuf);
impl TempDir {
    fn new() -> Result<Self> {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.subsec_nanos())
            .unwrap_or(0);
        let p =
            std::env::temp_dir().join(format!("yatt-bench-runtime-{}-{nanos}", std::process::id()));
        std::fs::create_dir_all(&p).with_context(|| format!("creating {}", p.display()))?;
        Ok(TempDir(p))
    }
}
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

/// The child process. Closing its stdin asks it to leave; dropping the guard without
/// [`PeerProcess::finish`] kills it, so no error path leaves an orphan.
struct PeerProcess {
    child: Child,
    stdin: Option<ChildStdin>,
    /// The bare quinn echo endpoint it serves.
    quinn_addr: SocketAddr,
}

impl PeerProcess {
    fn start(seed: SocketAddr, ca_dir: &Path, workers: Option<usize>) -> Result<Self> {
        let exe = std::env::current_exe().context("locating the yatt binary")?;
        let mut cmd = Command::new(exe);
        cmd.args(["bench", "runtime", "--serve", "--seed"])
            .arg(seed.to_string())
            .arg("--ca-dir")
            .arg(ca_dir);
        if let Some(w) = workers {
            cmd.arg("--workers").arg(w.to_string());
        }
        if std::env::var_os("RUST_LOG").is_none() {
            cmd.env("RUST_LOG", "warn");
        }
        let mut child = cmd
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::inherit())
            .spawn()
            .context("starting the peer process")?;
        let stdin = child.stdin.take();
        let stdout = child.stdout.take().expect("piped");
        let mut guard = PeerProcess {
            child,
            stdin,
            quinn_addr: "127.0.0.1:0".parse().expect("literal"),
        };
        // The child prints `READY <quinn addr>` once its node has joined.
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines() {
                let Ok(line) = line else { break };
                if tx.send(line).is_err() {
                    break;
                }
            }
        });
        let deadline = Instant::now() + T;
        loop {
            if let Some(status) = guard.child.try_wait()? {
                bail!("the peer process exited before it was ready: {status}");
            }
            match rx.recv_timeout(Duration::from_millis(100)) {
                Ok(line) => {
                    if let Some(addr) = line.strip_prefix("READY ") {
                        guard.quinn_addr = addr.trim().parse().context("peer's READY line")?;
                        return Ok(guard);
                    }
                }
                Err(std::sync::mpsc::RecvTimeoutError::Timeout) => {}
                Err(std::sync::mpsc::RecvTimeoutError::Disconnected) => {
                    bail!("the peer process closed its stdout before it was ready")
                }
            }
            if Instant::now() > deadline {
                bail!("the peer process was not ready within {T:?}");
            }
        }
    }

    /// Asks the child to leave (closes its stdin) and waits, bounded; kills it after.
    fn finish(mut self, within: Duration) -> Result<()> {
        self.stdin.take();
        let deadline = Instant::now() + within;
        while Instant::now() < deadline {
            if let Some(status) = self.child.try_wait()? {
                ensure!(status.success(), "the peer process ended with {status}");
                return Ok(());
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        bail!("the peer process did not leave within {within:?}; killed it")
    }
}

impl Drop for PeerProcess {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// The child: a node hosting the actors' factories, plus a bare quinn echo endpoint.
async fn serve(args: BenchRuntimeArgs) -> Result<()> {
    let seed = args.seed.ok_or_else(|| anyhow!("--serve needs --seed"))?;
    let ca_dir = args
        .ca_dir
        .clone()
        .ok_or_else(|| anyhow!("--serve needs --ca-dir"))?;
    let node = Node::builder(PEER)
        .config(node_config(true))
        .dev_certs(&ca_dir)
        .seed(seed)
        .factory("echo", |_: ()| Ok(Echo))
        .factory("sink", |_: ()| Ok(Sink))
        .start()
        .await?;
    let quinn_addr = quinn_echo_server(&ca_dir)?;
    {
        let mut out = std::io::stdout().lock();
        writeln!(out, "READY {quinn_addr}")?;
        out.flush()?;
    }
    // The parent closes our stdin when done (or dies): then leave. A backstop bounds
    // our life in any case.
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    std::thread::spawn(move || {
        let _ = std::io::stdin().read_to_end(&mut Vec::new());
        let _ = tx.send(());
    });
    tokio::select! {
        _ = rx => {}
        _ = tokio::time::sleep(Duration::from_secs(900)) => {}
    }
    let _ = tokio::time::timeout(Duration::from_secs(5), node.shutdown()).await;
    Ok(())
}

/// A quinn endpoint with the cluster's TLS that echoes 8-byte messages on every
/// bidirectional stream until the stream ends. Nothing else: no framing, no dispatch.
fn quinn_echo_server(ca_dir: &Path) -> Result<SocketAddr> {
    let id = ClusterCa::load(ca_dir)?.issue("bench-quinn-server", CertKind::Node)?;
    let ep = quinn::Endpoint::server(id.server_config()?, "127.0.0.1:0".parse()?)?;
    let addr = ep.local_addr()?;
    tokio::spawn(async move {
        while let Some(incoming) = ep.accept().await {
            tokio::spawn(async move {
                let Ok(conn) = incoming.await else { return };
                while let Ok((mut send, mut recv)) = conn.accept_bi().await {
                    tokio::spawn(async move {
                        let mut buf = [0u8; 8];
                        while recv.read_exact(&mut buf).await.is_ok() {
                            if send.write_all(&buf).await.is_err() {
                                return;
                            }
                        }
                        let _ = send.finish();
                    });
                }
            });
        }
    });
    Ok(addr)
}

/// Bare quinn, same TLS and transport settings as the nodes, for comparison.
#[derive(Clone, Debug, Default)]
struct QuinnFigures {
    /// A new bidirectional stream per call, like an actor ask.
    rtt_stream_per_call: Dist,
    /// One long-lived stream, ping-pong.
    rtt_one_stream: Dist,
    /// A new stream per call, `in_flight` at once.
    calls_per_s: f64,
}

async fn quinn_client(
    ca_dir: &Path,
    server: SocketAddr,
) -> Result<(quinn::Endpoint, quinn::Connection)> {
    let id = ClusterCa::load(ca_dir)?.issue("bench-quinn-client", CertKind::Node)?;
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse()?)?;
    ep.set_default_client_config(id.client_config()?);
    let conn = tokio::time::timeout(T, ep.connect(server, SERVER_NAME)?)
        .await
        .context("quinn handshake timed out")??;
    Ok((ep, conn))
}

async fn quinn_call(conn: &quinn::Connection, i: u64) -> Result<u64> {
    let (mut send, mut recv) = conn.open_bi().await?;
    send.write_all(&i.to_le_bytes()).await?;
    let _ = send.finish();
    let mut buf = [0u8; 8];
    recv.read_exact(&mut buf).await?;
    Ok(u64::from_le_bytes(buf))
}

async fn bare_quinn(ca_dir: &Path, server: SocketAddr, plan: &Plan) -> Result<QuinnFigures> {
    let (ep, conn) = quinn_client(ca_dir, server).await?;
    let mut v = Vec::with_capacity(plan.rtt_iters);
    for i in 0..(plan.rtt_warmup + plan.rtt_iters) as u64 {
        let t0 = Instant::now();
        ensure!(quinn_call(&conn, i).await? == i);
        if i >= plan.rtt_warmup as u64 {
            v.push(t0.elapsed());
        }
    }
    let rtt_stream_per_call = Dist::of(v);
    let (mut send, mut recv) = conn.open_bi().await?;
    let mut v = Vec::with_capacity(plan.rtt_iters);
    let mut buf = [0u8; 8];
    for i in 0..(plan.rtt_warmup + plan.rtt_iters) as u64 {
        let t0 = Instant::now();
        send.write_all(&i.to_le_bytes()).await?;
        recv.read_exact(&mut buf).await?;
        if i >= plan.rtt_warmup as u64 {
            v.push(t0.elapsed());
        }
        ensure!(u64::from_le_bytes(buf) == i);
    }
    let _ = send.finish();
    let rtt_one_stream = Dist::of(v);
    let c = conn.clone();
    let calls_per_s = measure_pipelined(plan, move |i| {
        let c = c.clone();
        async move { quinn_call(&c, i).await }
    })
    .await?;
    conn.close(0u32.into(), b"done");
    let _ = tokio::time::timeout(Duration::from_secs(2), ep.wait_idle()).await;
    Ok(QuinnFigures {
        rtt_stream_per_call,
        rtt_one_stream,
        calls_per_s,
    })
}

/// The cluster as the parent sees it: the leader, a second node in this process with
/// the shared-memory fast path off, and the child.
struct Cluster {
    _dir: TempDir,
    lead: Node,
    plain: Node,
    peer: PeerProcess,
}

async fn start_cluster(workers: Option<usize>) -> Result<Cluster> {
    let dir = TempDir::new()?;
    let lead = Node::builder("bench-lead")
        .config(node_config(true))
        .dev_certs(&dir.0)
        .start()
        .await?;
    // Blocking wait for the child's READY line, off the runtime's workers: the child
    // joins through this process's node, which must keep serving meanwhile.
    let (seed, ca) = (lead.addr(), dir.0.clone());
    let peer =
        tokio::task::spawn_blocking(move || PeerProcess::start(seed, &ca, workers)).await??;
    ensure!(
        lead.directory()
            .wait_until(T, |d| d.node(PEER).is_some()
                && d.alive_nodes().count() == 2)
            .await,
        "the peer did not join within {T:?}"
    );
    let plain = Node::builder("bench-lead-noshm")
        .config(node_config(false))
        .dev_certs(&dir.0)
        .seed(lead.addr())
        .start()
        .await?;
    ensure!(
        plain
            .directory()
            .wait_until(T, |d| d.alive_nodes().count() == 3)
            .await,
        "the directory did not settle within {T:?}"
    );
    Ok(Cluster {
        _dir: dir,
        lead,
        plain,
        peer,
    })
}

impl Cluster {
    async fn stop(self) -> Result<()> {
        let Cluster {
            _dir,
            lead,
            plain,
            peer,
        } = self;
        plain.shutdown().await;
        let finished =
            tokio::task::spawn_blocking(move || peer.finish(Duration::from_secs(15))).await?;
        lead.shutdown().await;
        finished
    }
}

async fn two_process(args: &BenchRuntimeArgs, plan: &Plan) -> Result<(Figures, QuinnFigures)> {
    let b = batches()?;
    let cluster = start_cluster(args.workers).await?;
    let result = two_process_figures(&cluster, plan, &b).await;
    let quinn = match &result {
        Ok(_) => bare_quinn(&cluster._dir.0, cluster.peer.quinn_addr, plan).await,
        Err(_) => Ok(QuinnFigures::default()),
    };
    let stopped = cluster.stop().await;
    let figures = result?;
    let quinn = quinn?;
    stopped?;
    Ok((figures, quinn))
}

async fn two_process_figures(c: &Cluster, plan: &Plan, b: &Batches) -> Result<Figures> {
    let echo: EchoRef = c.lead.spawn_remote(PEER, "echo", &(), T).await?;
    let sink: SinkRef = c.lead.spawn_remote(PEER, "sink", &(), T).await?;
    let mut workers: Vec<SinkRef> = Vec::with_capacity(WORKERS);
    for _ in 0..WORKERS {
        workers.push(c.lead.spawn_remote(PEER, "sink", &(), T).await?);
    }
    ensure!(!echo.is_local() && !sink.is_local());
    // The same actors reached through the node whose shared-memory fast path is off.
    let sink_plain: SinkRef = c.plain.actor_ref(sink.id())?;
    let workers_plain: Vec<SinkRef> = workers
        .iter()
        .map(|w| c.plain.actor_ref(w.id()))
        .collect::<Result<_, _>>()?;

    eprintln!("  round trip");
    let rtt = measure_rtt(&echo, plan).await?;
    eprintln!("  pipelined");
    let e = echo.clone();
    let calls_per_s = measure_pipelined(plan, move |i| {
        let e = e.clone();
        async move { Ok(e.ask(i, T).await?) }
    })
    .await?;
    eprintln!("  64 MiB handoff");
    let handoff = measure_handoff(&sink, &b.handoff, b.handoff_crc, plan.handoff_reps).await?;
    let handoff_inline =
        measure_handoff(&sink_plain, &b.handoff, b.handoff_crc, plan.handoff_reps).await?;
    eprintln!("  fan-out");
    let fanout = measure_fanout(&workers, &b.fanout, &b.fanout_crcs, plan.fanout_rounds).await?;
    let fanout_inline = measure_fanout(
        &workers_plain,
        &b.fanout,
        &b.fanout_crcs,
        plan.fanout_rounds,
    )
    .await?;
    eprintln!("  bare quinn");
    Ok(Figures {
        rtt,
        calls_per_s,
        handoff,
        handoff_inline: Some(handoff_inline),
        fanout,
        fanout_inline: Some(fanout_inline),
    })
}

/// `--profile rtt|pipe|quinn-rtt|quinn-pipe`: loop one figure against the remote echo
/// actor (or the bare quinn echo), for running under a profiler.
async fn profile(args: &BenchRuntimeArgs, what: &str) -> Result<()> {
    let mut plan = Plan::new(args);
    plan.pipe_secs = Duration::from_secs(args.profile_secs);
    let cluster = start_cluster(args.workers).await?;
    let run = async {
        let echo: EchoRef = cluster.lead.spawn_remote(PEER, "echo", &(), T).await?;
        let until = Instant::now() + Duration::from_secs(args.profile_secs);
        match what {
            "rtt" => {
                let mut n = 0u64;
                let mut all = Vec::new();
                while Instant::now() < until {
                    let t0 = Instant::now();
                    echo.ask(n, T).await?;
                    all.push(t0.elapsed());
                    n += 1;
                }
                let d = Dist::of(all);
                println!("rtt: {n} asks, median {:?}, p99 {:?}", d.median, d.p99);
            }
            "pipe" => {
                let e = echo.clone();
                let r = measure_pipelined(&plan, move |i| {
                    let e = e.clone();
                    async move { Ok(e.ask(i, T).await?) }
                })
                .await?;
                println!("pipelined: {r:.0} calls/s");
            }
            "handoff" | "handoff-inline" | "fanout" => {
                let b = batches()?;
                let via = if what == "handoff-inline" { &cluster.plain } else { &cluster.lead };
                let sink: SinkRef = cluster.lead.spawn_remote(PEER, "sink", &(), T).await?;
                let sink: SinkRef = via.actor_ref(sink.id())?;
                let mut workers: Vec<SinkRef> = Vec::new();
                if what == "fanout" {
                    for _ in 0..WORKERS {
                        workers.push(cluster.lead.spawn_remote(PEER, "sink", &(), T).await?);
                    }
                }
                let mut all = Vec::new();
                while Instant::now() < until {
                    let d = if what == "fanout" {
                        measure_fanout(&workers, &b.fanout, &b.fanout_crcs, 1).await?
                    } else {
                        measure_handoff(&sink, &b.handoff, b.handoff_crc, 1).await?
                    };
                    all.push(d.median);
                }
                let d = Dist::of(all);
                println!("{what}: {} rounds, median {:?}, p99 {:?}", d.n, d.median, d.p99);
            }
            "quinn-rtt" | "quinn-pipe" => {
                let (_ep, conn) = quinn_client(&cluster._dir.0, cluster.peer.quinn_addr).await?;
                if what == "quinn-rtt" {
                    let mut all = Vec::new();
                    let mut n = 0u64;
                    while Instant::now() < until {
                        let t0 = Instant::now();
                        quinn_call(&conn, n).await?;
                        all.push(t0.elapsed());
                        n += 1;
                    }
                    let d = Dist::of(all);
                    println!("quinn rtt: {n} calls, median {:?}, p99 {:?}", d.median, d.p99);
                } else {
                    let r = measure_pipelined(&plan, move |i| {
                        let c = conn.clone();
                        async move { quinn_call(&c, i).await }
                    })
                    .await?;
                    println!("quinn pipelined: {r:.0} calls/s");
                }
            }
            other => bail!("--profile takes rtt, pipe, handoff, handoff-inline, fanout, quinn-rtt or quinn-pipe, not {other:?}"),
        }
        Ok::<(), anyhow::Error>(())
    };
    let cpu0 = (
        cpu_times(std::process::id()),
        cpu_times(cluster.peer.child.id()),
    );
    let t0 = Instant::now();
    let r = run.await;
    let wall = t0.elapsed().as_secs_f64();
    let cpu1 = (
        cpu_times(std::process::id()),
        cpu_times(cluster.peer.child.id()),
    );
    if let ((Some(a0), Some(b0)), (Some(a1), Some(b1))) = (cpu0, cpu1) {
        // CPU seconds over the run (includes the set-up of the echo actor and the quinn client).
        println!(
            "cpu over {wall:.1} s wall: leader user {:.2} s sys {:.2} s; peer user {:.2} s sys {:.2} s",
            a1.0 - a0.0,
            a1.1 - a0.1,
            b1.0 - b0.0,
            b1.1 - b0.1
        );
    }
    cluster.stop().await?;
    r
}

/// (user, system) CPU seconds of a process, from /proc.
fn cpu_times(pid: u32) -> Option<(f64, f64)> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    // Fields after the parenthesised command name; utime and stime are fields 14 and 15.
    let rest = &stat[stat.rfind(')')? + 2..];
    let f: Vec<&str> = rest.split_whitespace().collect();
    let tick = 100.0; // USER_HZ on Linux
    Some((
        f.get(11)?.parse::<f64>().ok()? / tick,
        f.get(12)?.parse::<f64>().ok()? / tick,
    ))
}

// ---------------------------------------------------------------------------------
// Machine ceilings
// ---------------------------------------------------------------------------------

#[derive(Clone, Debug, Default)]
struct Ceilings {
    memcpy_gbs: f64,
    memcpy_16mib: Duration,
    crc_gbs: f64,
    tcp_gbs: f64,
    tcp_rtt: Dist,
    udp_rtt: Dist,
}

fn gbs(bytes: usize, d: Duration) -> f64 {
    bytes as f64 / d.as_secs_f64() / 1e9
}

fn ceilings(plan: &Plan) -> Result<Ceilings> {
    // memcpy between two touched 64 MiB buffers.
    let src = test_data(HANDOFF_BYTES)?;
    let bytes = src.contiguous();
    let mut dst = vec![1u8; HANDOFF_BYTES];
    let mut v = Vec::new();
    for _ in 0..plan.handoff_reps.max(5) {
        let t0 = Instant::now();
        dst.copy_from_slice(&bytes);
        std::hint::black_box(&mut dst);
        v.push(t0.elapsed());
    }
    let memcpy_gbs = gbs(HANDOFF_BYTES, Dist::of(v).median);
    let mut v = Vec::new();
    for _ in 0..plan.fanout_rounds.max(10) {
        let t0 = Instant::now();
        dst[..FANOUT_BYTES].copy_from_slice(&bytes[..FANOUT_BYTES]);
        std::hint::black_box(&mut dst);
        v.push(t0.elapsed());
    }
    let memcpy_16mib = Dist::of(v).median;
    // crc32 of 64 MiB: what every receiver here does with the bytes.
    let mut v = Vec::new();
    for _ in 0..plan.handoff_reps.max(5) {
        let t0 = Instant::now();
        std::hint::black_box(src.checksum());
        v.push(t0.elapsed());
    }
    let crc_gbs = gbs(HANDOFF_BYTES, Dist::of(v).median);
    let (tcp_gbs, tcp_rtt) = tcp_ceiling(&src, plan)?;
    let udp_rtt = udp_pingpong(plan)?;
    Ok(Ceilings {
        memcpy_gbs,
        memcpy_16mib,
        crc_gbs,
        tcp_gbs,
        tcp_rtt,
        udp_rtt,
    })
}

/// A std TcpStream pair over loopback in two threads: 64 MiB transfers (the receiver
/// reads every byte into its buffer and acknowledges with one byte), then a 1-byte
/// ping-pong.
fn tcp_ceiling(src: &Bulk, plan: &Plan) -> Result<(f64, Dist)> {
    let bytes = src.contiguous();
    let listener = TcpListener::bind("127.0.0.1:0")?;
    let addr = listener.local_addr()?;
    let (reps, pings) = (plan.tcp_reps + 1, plan.rtt_warmup + plan.pingpong_iters);
    let server = std::thread::spawn(move || -> std::io::Result<()> {
        let (mut s, _) = listener.accept()?;
        s.set_nodelay(true)?;
        s.set_read_timeout(Some(T))?;
        let mut buf = vec![0u8; HANDOFF_BYTES];
        for _ in 0..reps {
            s.read_exact(&mut buf)?;
            std::hint::black_box(&buf);
            s.write_all(&[1])?;
        }
        let mut b = [0u8; 1];
        for _ in 0..pings {
            s.read_exact(&mut b)?;
            s.write_all(&b)?;
        }
        Ok(())
    });
    let mut c = TcpStream::connect(addr)?;
    c.set_nodelay(true)?;
    c.set_read_timeout(Some(T))?;
    let mut v = Vec::new();
    let mut ack = [0u8; 1];
    for r in 0..reps {
        let t0 = Instant::now();
        c.write_all(&bytes)?;
        c.read_exact(&mut ack)?;
        if r > 0 {
            v.push(t0.elapsed());
        }
    }
    let tcp_gbs = gbs(HANDOFF_BYTES, Dist::of(v).median);
    let mut v = Vec::new();
    for i in 0..pings {
        let t0 = Instant::now();
        c.write_all(&[7])?;
        c.read_exact(&mut ack)?;
        if i >= plan.rtt_warmup {
            v.push(t0.elapsed());
        }
    }
    server
        .join()
        .map_err(|_| anyhow!("tcp server thread panicked"))??;
    Ok((tcp_gbs, Dist::of(v)))
}

/// 1-byte UDP ping-pong over loopback in two threads (what QUIC rides on).
fn udp_pingpong(plan: &Plan) -> Result<Dist> {
    let a = UdpSocket::bind("127.0.0.1:0")?;
    let b = UdpSocket::bind("127.0.0.1:0")?;
    a.connect(b.local_addr()?)?;
    b.connect(a.local_addr()?)?;
    a.set_read_timeout(Some(Duration::from_secs(1)))?;
    b.set_read_timeout(Some(Duration::from_secs(1)))?;
    let pings = plan.rtt_warmup + plan.pingpong_iters;
    let server = std::thread::spawn(move || {
        let mut buf = [0u8; 16];
        for _ in 0..pings {
            if b.recv(&mut buf).is_err() || b.send(&buf[..1]).is_err() {
                return;
            }
        }
    });
    let mut v = Vec::new();
    let mut buf = [0u8; 16];
    for i in 0..pings {
        let t0 = Instant::now();
        a.send(&[7])?;
        a.recv(&mut buf).context("udp ping lost")?;
        if i >= plan.rtt_warmup {
            v.push(t0.elapsed());
        }
    }
    let _ = server.join();
    Ok(Dist::of(v))
}

// ---------------------------------------------------------------------------------
// Report
// ---------------------------------------------------------------------------------

fn us(d: Duration) -> f64 {
    d.as_secs_f64() * 1e6
}
fn ms(d: Duration) -> f64 {
    d.as_secs_f64() * 1e3
}

/// "1.23× ✓" where above 1 is better than the goal.
fn vs_goal(better_ratio: f64) -> String {
    let mark = if better_ratio >= 1.0 {
        "meets"
    } else {
        "misses"
    };
    format!("{better_ratio:.2}× ({mark})")
}

fn print_report(
    args: &BenchRuntimeArgs,
    plan: &Plan,
    c: &Ceilings,
    local: &Figures,
    two: &Figures,
    q: &QuinnFigures,
) {
    let handoff_gbs = |d: &Dist| gbs(HANDOFF_BYTES, d.median);
    let inline = two.handoff_inline.unwrap_or_default();
    let fan_inline = two.fanout_inline.unwrap_or_default();
    let mut o = String::new();
    let mode = if args.quick { " (--quick)" } else { "" };
    o += &format!(
        "### yatt bench runtime{mode}\n\n\
         Ratio to goal: above 1 is better than the goal. GB/s = 10^9 bytes/s. \
         Two-process figures: leader process → child process over QUIC with mutual TLS on 127.0.0.1.\n\n"
    );
    o += "| figure | yatt two-process | yatt in-process | Ray 2.60 (given) | goal | two-process vs goal | ceiling |\n";
    o += "|---|---:|---:|---:|---:|---:|---|\n";
    o += &format!(
        "| small-call round trip, median | {:.1} µs | {:.1} µs | {RAY_RTT_US:.0} µs | ≤ {GOAL_RTT_US:.0} µs | {} | TCP 1-byte ping-pong {:.1} µs; UDP {:.1} µs; bare quinn (stream per call) {:.1} µs |\n",
        us(two.rtt.median), us(local.rtt.median), vs_goal(GOAL_RTT_US / us(two.rtt.median)),
        us(c.tcp_rtt.median), us(c.udp_rtt.median), us(q.rtt_stream_per_call.median)
    );
    o += &format!(
        "| small-call round trip, p99 | {:.1} µs | {:.1} µs | – | – | – | TCP {:.1} µs; bare quinn {:.1} µs |\n",
        us(two.rtt.p99), us(local.rtt.p99), us(c.tcp_rtt.p99), us(q.rtt_stream_per_call.p99)
    );
    o += &format!(
        "| pipelined calls/s ({} in flight) | {:.0} | {:.0} | {RAY_CALLS_S:.0} | ≥ {GOAL_CALLS_S:.0} | {} | bare quinn, stream per call, same concurrency: {:.0}/s |\n",
        plan.in_flight, two.calls_per_s, local.calls_per_s, vs_goal(two.calls_per_s / GOAL_CALLS_S), q.calls_per_s
    );
    o += &format!(
        "| 64 MiB handoff, shared memory (receiver crc32s every byte) | {:.2} GB/s ({:.1} ms) | {:.2} GB/s ({:.1} ms) | {RAY_HANDOFF_GBS:.2} GB/s | ≥ {GOAL_HANDOFF_GBS:.1} GB/s | {} | memcpy {:.2} GB/s; crc32 alone {:.2} GB/s; TCP loopback {:.2} GB/s |\n",
        handoff_gbs(&two.handoff), ms(two.handoff.median), handoff_gbs(&local.handoff), ms(local.handoff.median),
        vs_goal(handoff_gbs(&two.handoff) / GOAL_HANDOFF_GBS), c.memcpy_gbs, c.crc_gbs, c.tcp_gbs
    );
    o += &format!(
        "| 64 MiB handoff, plain QUIC stream (shm off) | {:.2} GB/s ({:.1} ms) | – | – | ≥ {GOAL_HANDOFF_GBS:.1} GB/s | {} | TCP loopback {:.2} GB/s (plain QUIC at {:.0}% of it) |\n",
        handoff_gbs(&inline), ms(inline.median), vs_goal(handoff_gbs(&inline) / GOAL_HANDOFF_GBS), c.tcp_gbs,
        100.0 * handoff_gbs(&inline) / c.tcp_gbs
    );
    o += &format!(
        "| fan-out 16 MiB over 8 workers + gather, median | {:.2} ms | {:.2} ms | {RAY_FANOUT_MS:.1} ms | ≤ {GOAL_FANOUT_MS:.0} ms | {} | memcpy of 16 MiB {:.2} ms |\n",
        ms(two.fanout.median), ms(local.fanout.median), vs_goal(GOAL_FANOUT_MS / ms(two.fanout.median)), ms(c.memcpy_16mib)
    );
    o += &format!(
        "| fan-out, plain QUIC stream (shm off) | {:.2} ms | – | – | ≤ {GOAL_FANOUT_MS:.0} ms | {} | |\n",
        ms(fan_inline.median), vs_goal(GOAL_FANOUT_MS / ms(fan_inline.median))
    );
    o += &format!(
        "\nDetails: round trip n={} (after {} warm-up), p99 in-process {:.1} µs; bare quinn on one long-lived stream {:.1} µs median; \
         handoff median of {} (p99 two-process {:.1} ms, plain QUIC {:.1} ms); fan-out median of {} rounds (p99 {:.2} ms two-process, {:.2} ms in-process).\n",
        two.rtt.n, plan.rtt_warmup, us(local.rtt.p99), us(q.rtt_one_stream.median),
        two.handoff.n, ms(two.handoff.p99), ms(inline.p99), two.fanout.n, ms(two.fanout.p99), ms(local.fanout.p99)
    );
    print!("{o}");
}
