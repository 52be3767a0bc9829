//! `yatt demo`: an embedded local cluster, shown working. Three nodes start in this
//! process (each with its own QUIC endpoint on loopback, mutual TLS from a dev CA),
//! join, spawn actors on each other, answer requests, move a batch, and notice a node
//! that leaves.

use std::time::{Duration, Instant};

use anyhow::Context as _;
use bytes::Bytes;
use yatt::runtime::BulkReceipt;
use yatt::runtime::Node;
use yatt::runtime::WithBulk;
use yatt::runtime::{Bulk, DType};

#[derive(clap::Args)]
pub struct DemoArgs {
    /// Size of the batch moved between nodes, in MiB.
    #[arg(long, default_value_t = 64)]
    batch_mib: usize,
}

pub fn run(args: DemoArgs) -> anyhow::Result<()> {
    tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?
        .block_on(demo(args))
}

async fn demo(args: DemoArgs) -> anyhow::Result<()> {
    let t = Duration::from_secs(10);
    let ca = tempfile::tempdir()?;
    let start = Instant::now();
    let seed = yatt::register_roles(Node::builder("node-0").dev_certs(ca.path()))
        .start()
        .await?;
    let mut nodes = vec![seed.clone()];
    for i in 1..3 {
        let n = yatt::register_roles(
            Node::builder(&format!("node-{i}"))
                .dev_certs(ca.path())
                .seed(seed.addr()),
        )
        .start()
        .await?;
        nodes.push(n);
    }
    let joined = seed
        .directory()
        .wait_until(t, |d| d.alive_nodes().count() == 3)
        .await;
    anyhow::ensure!(joined, "nodes did not join within {t:?}");
    println!(
        "3 nodes joined in {:?} (leader: {}, directory epoch {})",
        start.elapsed(),
        seed.leader(),
        seed.directory().epoch()
    );
    for n in &nodes {
        println!(
            "  {} at {} ({} device(s))",
            n.name(),
            n.addr(),
            n.info().devices.len()
        );
    }

    for target in ["node-1", "node-2"] {
        let echo = seed
            .spawn_remote::<Vec<u8>, Vec<u8>, _>(target, "echo", &(), t)
            .await
            .with_context(|| format!("spawning echo on {target}"))?;
        let asked = Instant::now();
        let answer = echo.ask(b"hello".to_vec(), t).await?;
        println!(
            "{} answered {:?} in {:?}",
            echo.id(),
            String::from_utf8_lossy(&answer),
            asked.elapsed()
        );
    }

    let sink = seed
        .spawn_remote::<WithBulk<String>, BulkReceipt, _>("node-2", "bulk-sink", &(), t)
        .await?;
    let n = args.batch_mib << 20;
    let data: Vec<u8> = (0..n).map(|i| (i % 251) as u8).collect();
    let bulk = Bulk::from_tensors([("tokens", DType::U8, vec![n as u64], Bytes::from(data))])?;
    let want = bulk.checksum();
    let sent = Instant::now();
    let receipt = sink
        .ask(
            WithBulk {
                meta: "batch-0".into(),
                bulk,
            },
            t,
        )
        .await?;
    let secs = sent.elapsed().as_secs_f64();
    anyhow::ensure!(
        receipt.crc32 == want,
        "batch corrupted: crc {} != {}",
        receipt.crc32,
        want
    );
    println!(
        "moved a {} MiB batch node-0 -> node-2 intact (crc32 {:08x}) in {:.1} ms, {:.2} GB/s",
        args.batch_mib,
        receipt.crc32,
        secs * 1e3,
        n as f64 / secs / 1e9
    );

    let leaving = nodes.pop().context("three nodes")?;
    leaving.shutdown().await;
    let noticed = seed
        .directory()
        .wait_until(t, |d| {
            d.alive_nodes().count() == 2 && d.resolve(&sink.id().name).is_none()
        })
        .await;
    anyhow::ensure!(noticed, "the leader did not notice node-2 leaving");
    println!(
        "node-2 left; the directory marked it and its actors dead (epoch {})",
        seed.directory().epoch()
    );
    for n in nodes.iter().rev() {
        n.shutdown().await;
    }
    println!("demo finished in {:?}", start.elapsed());
    Ok(())
}
