//! 64 MiB handoffs over plain QUIC (shared memory off) between processes, the transport's
//! defaults against the settings it had before issue 15 (quinn's 1,200 → 1,452-byte
//! packets, a fresh receive buffer per payload, no ceiling on the congestion window),
//! with TCP over loopback as the ceiling, in alternating rounds of one run.
//!
//! ```sh
//! cargo run --release -p yatt-runtime --example quic_bulk -- [rounds]
//! ```
//!
//! Two child processes of this binary host a `bulk-sink` each, one per setting; a node
//! per setting in this process sends to its own child. Only the runtime crate is built,
//! so this is the quick way to try a transport change; `yatt bench runtime` gives the
//! full picture.

use std::io::{Read, Write};
use std::time::{Duration, Instant};

use bytes::Bytes;
use yatt_runtime::{
    ActorRef, Bulk, BulkReceipt, DType, Node, NodeConfig, TransportConfig, WithBulk,
};

// As in the `yatt` and `yatt-node` binaries (`yatt::Allocator`): glibc's malloc costs
// bulk transfers about half their speed.
#[global_allocator]
static ALLOC: mimalloc::MiMalloc = mimalloc::MiMalloc;

const T: Duration = Duration::from_secs(30);
const N: usize = 64 << 20;

/// The transport settings of a variant: "after" (the defaults) or "before".
fn config(variant: &str) -> NodeConfig {
    let mut t = TransportConfig {
        shm_fast_path: false,
        ..TransportConfig::default()
    };
    if variant == "before" {
        t.max_udp_payload = 1_472;
        t.recv_pool_bytes = 0;
        t.max_congestion_window = 0;
    }
    NodeConfig {
        failure_timeout: Duration::from_secs(10),
        transport: t,
        ..NodeConfig::default()
    }
}

fn median(mut v: Vec<Duration>) -> Duration {
    v.sort();
    v[v.len() / 2]
}

fn gbs(d: Duration) -> f64 {
    N as f64 / d.as_secs_f64() / 1e9
}

/// A 64 MiB transfer over a loopback TCP pair (the receiver reads every byte into a
/// reused buffer and acknowledges with one byte).
struct Tcp {
    c: std::net::TcpStream,
    server: std::thread::JoinHandle<()>,
}

impl Tcp {
    fn start() -> std::io::Result<Self> {
        let l = std::net::TcpListener::bind("127.0.0.1:0")?;
        let a = l.local_addr()?;
        let server = std::thread::spawn(move || {
            let Ok((mut s, _)) = l.accept() else { return };
            let mut buf = vec![0u8; N];
            while s.read_exact(&mut buf).is_ok() && s.write_all(&[1]).is_ok() {}
        });
        let c = std::net::TcpStream::connect(a)?;
        c.set_read_timeout(Some(T))?;
        Ok(Tcp { c, server })
    }

    fn once(&mut self, src: &[u8]) -> std::io::Result<Duration> {
        let t0 = Instant::now();
        self.c.write_all(src)?;
        self.c.read_exact(&mut [0u8])?;
        Ok(t0.elapsed())
    }
}

type Sink = ActorRef<WithBulk<String>, BulkReceipt>;

async fn handoff(sink: &Sink, bulk: &Bulk) -> Result<Duration, Box<dyn std::error::Error>> {
    let t0 = Instant::now();
    let r = sink
        .ask(
            WithBulk {
                meta: String::new(),
                bulk: bulk.clone(),
            },
            T,
        )
        .await?;
    if r.bytes != N as u64 {
        return Err(format!("the sink got {} bytes", r.bytes).into());
    }
    Ok(t0.elapsed())
}

async fn serve(seed: &str, dir: &str, variant: &str) -> Result<(), Box<dyn std::error::Error>> {
    let node = yatt_runtime::register_builtins(
        Node::builder(&format!("qb-{variant}-sink"))
            .config(config(variant))
            .dev_certs(std::path::Path::new(dir))
            .seed(seed.parse()?),
    )
    .start()
    .await?;
    println!("READY");
    // Until the parent closes stdin.
    let _ = tokio::task::spawn_blocking(|| std::io::stdin().read_line(&mut String::new())).await;
    node.shutdown().await;
    Ok(())
}

#[tokio::main(flavor = "multi_thread")]
async fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    if args.get(1).map(String::as_str) == Some("serve") {
        return serve(&args[2], &args[3], &args[4]).await;
    }
    let rounds: usize = args.get(1).map(|r| r.parse()).transpose()?.unwrap_or(15);
    let dir = std::env::temp_dir().join(format!("quic-bulk-{}", std::process::id()));
    std::fs::create_dir_all(&dir)?;
    let after = Node::builder("qb-after")
        .config(config("after"))
        .dev_certs(&dir)
        .start()
        .await?;
    let before = Node::builder("qb-before")
        .config(config("before"))
        .dev_certs(&dir)
        .seed(after.addr())
        .start()
        .await?;
    let mut children = Vec::new();
    for variant in ["before", "after"] {
        let mut child = std::process::Command::new(&args[0])
            .args([
                "serve",
                &after.addr().to_string(),
                dir.to_str().unwrap_or("."),
            ])
            .arg(variant)
            .stdin(std::process::Stdio::piped())
            .stdout(std::process::Stdio::piped())
            .spawn()?;
        let mut ready = [0u8; 6];
        child
            .stdout
            .take()
            .ok_or("no stdout")?
            .read_exact(&mut ready)?;
        children.push(child);
    }
    if !after
        .directory()
        .wait_until(T, |d| d.alive_nodes().count() == 4)
        .await
    {
        return Err("the children did not join".into());
    }
    let sink_before: Sink = after
        .spawn_remote("qb-before-sink", "bulk-sink", &(), T)
        .await?;
    let sink_before: Sink = before.actor_ref(sink_before.id())?;
    let sink_after: Sink = after
        .spawn_remote("qb-after-sink", "bulk-sink", &(), T)
        .await?;
    let data: Vec<u8> = (0..N).map(|i| (i * 31 % 251) as u8).collect();
    let bulk = Bulk::from_tensors([("x", DType::U8, vec![N as u64], Bytes::from(data.clone()))])?;
    let mut tcp = Tcp::start()?;
    // Warm-up: connections, MTU discovery, buffers.
    handoff(&sink_before, &bulk).await?;
    handoff(&sink_after, &bulk).await?;
    tcp.once(&data)?;
    let (mut b, mut a, mut t) = (Vec::new(), Vec::new(), Vec::new());
    for _ in 0..rounds {
        b.push(handoff(&sink_before, &bulk).await?);
        a.push(handoff(&sink_after, &bulk).await?);
        t.push(tcp.once(&data)?);
    }
    let (b, a, t) = (gbs(median(b)), gbs(median(a)), gbs(median(t)));
    println!("64 MiB handoff, median of {rounds} alternating rounds:");
    println!("  TCP loopback          {t:.2} GB/s");
    println!(
        "  plain QUIC, before    {b:.2} GB/s ({:.0}% of TCP)",
        100.0 * b / t
    );
    println!(
        "  plain QUIC, defaults  {a:.2} GB/s ({:.0}% of TCP)",
        100.0 * a / t
    );
    drop(tcp.c);
    let _ = tcp.server.join();
    for mut c in children {
        drop(c.stdin.take());
        let _ = c.wait();
    }
    before.shutdown().await;
    after.shutdown().await;
    let _ = std::fs::remove_dir_all(&dir);
    Ok(())
}
