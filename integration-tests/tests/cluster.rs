//! Three real `yatt-node` processes on loopback; the test process joins as a fourth
//! node (a client) over the same QUIC + mutual TLS as everyone else.

use std::time::{Duration, Instant};

use bytes::Bytes;
use yatt_integration_tests::{cluster_logs, poll, Cluster};
use yatt_runtime::BulkReceipt;
use yatt_runtime::Liveness;
use yatt_runtime::TransportConfig;
use yatt_runtime::WithBulk;
use yatt_runtime::{Bulk, DType};
use yatt_runtime::{CallError, Node, NodeConfig};
use yatt_runtime::{CertKind, ClusterCa, DirectoryChange, ExitReason};

const T: Duration = Duration::from_secs(20);

async fn client(cluster: &Cluster, name: &str, shm: bool) -> Node {
    Node::builder(name)
        .config(NodeConfig {
            transport: TransportConfig {
                shm_fast_path: shm,
                ..TransportConfig::default()
            },
            ..NodeConfig::default()
        })
        .dev_certs(cluster.ca_dir())
        .seed(cluster.nodes[0].addr)
        .start()
        .await
        .expect("client joins")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_spawn_request_response_and_64mib_bulk() {
    let cluster = Cluster::start("rs", 3);
    let c = client(&cluster, "rs-client", true).await;
    for n in &cluster.nodes {
        let echo = c
            .spawn_remote::<Vec<u8>, Vec<u8>, _>(&n.name, "echo", &(), T)
            .await
            .expect("spawn echo");
        assert_eq!(echo.id().name.node, n.name);
        assert_eq!(echo.ask(b"ping".to_vec(), T).await.unwrap(), b"ping");
    }
    // A 64 MiB batch arrives intact, through shared memory and over plain QUIC.
    let sink = c
        .spawn_remote::<WithBulk<String>, BulkReceipt, _>(
            &cluster.nodes[2].name,
            "bulk-sink",
            &(),
            T,
        )
        .await
        .unwrap();
    let n = 64usize << 20;
    let data: Vec<u8> = (0..n).map(|i| (i ^ (i >> 13)) as u8).collect();
    let bulk =
        Bulk::from_tensors([("tokens", DType::U8, vec![n as u64], Bytes::from(data))]).unwrap();
    let want = bulk.checksum();
    let r = sink
        .ask(
            WithBulk {
                meta: "shm".into(),
                bulk: bulk.clone(),
            },
            T,
        )
        .await
        .unwrap();
    assert_eq!(
        (r.crc32, r.bytes, r.label.as_str()),
        (want, n as u64, "shm")
    );
    let plain = client(&cluster, "rs-client2", false).await;
    let sink2 = plain
        .actor_ref::<WithBulk<String>, BulkReceipt>(sink.id())
        .unwrap();
    let r = sink2
        .ask(
            WithBulk {
                meta: "quic".into(),
                bulk,
            },
            T,
        )
        .await
        .unwrap();
    assert_eq!(
        (r.crc32, r.bytes, r.label.as_str()),
        (want, n as u64, "quic")
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn kill_9_is_detected_within_the_bound() {
    let mut cluster = Cluster::start("kd", 3);
    let c = client(&cluster, "kd-client", true).await;
    let victim = cluster.nodes[2].name.clone();
    let echo = c
        .spawn_remote::<Vec<u8>, Vec<u8>, _>(&victim, "echo", &(), T)
        .await
        .unwrap();
    assert_eq!(echo.ask(vec![1], T).await.unwrap(), vec![1]);

    // A supervisor elsewhere monitors the actor.
    let monitor = {
        let (c, id) = (c.clone(), echo.id().clone());
        tokio::spawn(async move { c.monitor(&id).await })
    };
    let killed = Instant::now();
    cluster.nodes[2].kill9();
    // Default failure_timeout is 2 s; the bound the runtime promises is 3 s.
    let bound = Duration::from_secs(3);
    let name = echo.id().name.clone();
    let seen = c
        .directory()
        .wait_until(bound + Duration::from_millis(500), |d| {
            d.node(&victim)
                .is_some_and(|n| n.liveness != Liveness::Alive)
                && d.actor(&name)
                    .is_some_and(|a| a.liveness != Liveness::Alive)
        })
        .await;
    let detected = killed.elapsed();
    assert!(seen, "client never saw {victim} dead");
    eprintln!("kill -9 detected after {detected:?}");
    assert!(
        detected <= bound + Duration::from_millis(500),
        "detected after {detected:?}"
    );
    let reason = tokio::time::timeout(Duration::from_secs(2), monitor)
        .await
        .expect("monitor fired")
        .unwrap();
    assert!(
        matches!(reason, yatt_runtime::ExitReason::NodeDown(_)),
        "{reason:?}"
    );
    // Both surviving daemons agree.
    for n in &cluster.nodes[..2] {
        let dead = poll(Duration::from_secs(2), || {
            (n.sees_alive(&victim) == Some(false)).then_some(())
        });
        assert!(dead.is_some(), "{} still sees {victim} alive", n.name);
    }
    // Calls to its actors fail fast instead of hanging.
    let started = Instant::now();
    let err = echo.ask(vec![2], T).await.unwrap_err();
    assert!(matches!(err, CallError::NodeDown { .. }), "{err:?}");
    assert!(started.elapsed() < Duration::from_secs(1));
}

async fn handshake_fails(addr: std::net::SocketAddr, config: quinn::ClientConfig) -> bool {
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(config);
    let conn = match ep.connect(addr, yatt_runtime::SERVER_NAME).unwrap().await {
        Err(_) => return true,
        Ok(conn) => conn,
    };
    // With TLS 1.3 the server checks the client certificate after the client finishes;
    // a refused client sees the connection closed on its first use.
    let used = async {
        let (mut s, mut r) = conn.open_bi().await?;
        s.write_all(&[1]).await?;
        let _ = s.finish();
        let mut b = [0u8; 1];
        r.read_exact(&mut b).await?;
        Ok::<(), Box<dyn std::error::Error>>(())
    };
    tokio::time::timeout(Duration::from_secs(5), used)
        .await
        .map(|r| r.is_err())
        .unwrap_or(false)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn peers_without_a_cluster_certificate_are_refused() {
    let cluster = Cluster::start("tl", 3);
    let target = cluster.nodes[1].addr;
    let self_signed = yatt_integration_tests::insecure::self_signed_client_config(
        "intruder",
        yatt_runtime::SERVER_NAME,
        yatt_runtime::ALPN,
    );
    assert!(
        handshake_fails(target, self_signed).await,
        "self-signed client got in"
    );
    let other_ca = ClusterCa::generate("elsewhere")
        .unwrap()
        .issue("intruder", CertKind::Node)
        .unwrap();
    assert!(
        handshake_fails(target, other_ca.client_config().unwrap()).await,
        "foreign CA got in"
    );
    // The node keeps serving members.
    let c = client(&cluster, "tl-client", true).await;
    let echo = c
        .spawn_remote::<Vec<u8>, Vec<u8>, _>(&cluster.nodes[1].name, "echo", &(), T)
        .await
        .unwrap();
    assert_eq!(echo.ask(vec![7], T).await.unwrap(), vec![7]);
}

/// What a certificate's kind lets its holder ask of `yatt-node` daemons: a client
/// certificate may not spawn actors on other nodes and a trainer's may; no member
/// records another node's actors or deaths; a trainer never leads the directory, even
/// when it is the oldest live member.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_certificate_kind_bounds_what_its_holder_may_ask() {
    let mut cluster = Cluster::start("ck", 2);
    let ca = ClusterCa::load(&cluster.ca_dir()).unwrap();
    let seed = cluster.nodes[0].addr;
    let member = |name: &str, kind| {
        Node::builder(name)
            .identity(ca.issue(name, kind).unwrap())
            .seed(seed)
            .start()
    };
    let host = cluster.nodes[1].name.clone();

    let client = member("ck-client", CertKind::Client).await.unwrap();
    let e = client
        .spawn_remote::<Vec<u8>, Vec<u8>, _>(&host, "echo", &(), T)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("client certificate") && e.contains("--kind trainer"),
        "{e}"
    );
    client.shutdown().await;

    let trainer = member("ck-trainer", CertKind::Trainer).await.unwrap();
    let echo = trainer
        .spawn_remote::<Vec<u8>, Vec<u8>, _>(&host, "echo", &(), T)
        .await
        .unwrap();
    assert_eq!(echo.ask(vec![1], T).await.unwrap(), vec![1]);
    // The leader recorded the kind from the certificate.
    let kind = trainer
        .directory()
        .read(|d| d.node("ck-trainer").map(|n| n.info.kind));
    assert_eq!(kind, Some(CertKind::Trainer));

    // Another node's actor, or its death, is not the trainer's to record.
    let e = trainer
        .propose(DirectoryChange::ActorDown {
            id: echo.id().clone(),
            reason: ExitReason::Normal,
        })
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("only its own actors"), "{e}");
    let e = trainer
        .propose(DirectoryChange::NodeDown {
            node: host.clone(),
            reason: ExitReason::Normal,
        })
        .await
        .unwrap_err()
        .to_string();
    assert!(e.contains("declares deaths"), "{e}");
    assert_eq!(
        echo.ask(vec![2], T).await.unwrap(),
        vec![2],
        "nothing changed"
    );

    // ck-1 rejoins under a new incarnation, so the trainer is now the oldest member
    // after the seed; the seed dies, and ck-1 leads term 2 all the same.
    cluster.restart_through(1, 0, &[]);
    cluster.nodes[0].kill9();
    let want = Some(("ck-1".to_string(), 2));
    let led = poll(T, || (cluster.nodes[1].lead() == want).then_some(()));
    assert!(led.is_some(), "{}", cluster_logs(&cluster));
    let followed = poll(T, || (trainer.leader() == "ck-1").then_some(()));
    assert!(
        followed.is_some(),
        "the trainer follows {}",
        trainer.leader()
    );
    let echo = poll_spawn_echo(&trainer, "ck-1").await;
    assert_eq!(echo.ask(vec![3], T).await.unwrap(), vec![3]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_and_oversized_frames_close_only_their_stream() {
    let cluster = Cluster::start("mf", 3);
    let victim = &cluster.nodes[1];
    let c = client(&cluster, "mf-client", true).await;
    let echo = c
        .spawn_remote::<Vec<u8>, Vec<u8>, _>(&victim.name, "echo", &(), T)
        .await
        .unwrap();

    // An authenticated peer (certificate from the cluster CA) misbehaves by hand.
    let ca = ClusterCa::load(&cluster.ca_dir()).unwrap();
    let rogue = ca.issue("mf-rogue", CertKind::Node).unwrap();
    let mut ep = quinn::Endpoint::client("127.0.0.1:0".parse().unwrap()).unwrap();
    ep.set_default_client_config(rogue.client_config().unwrap());
    let conn = ep
        .connect(victim.addr, yatt_runtime::SERVER_NAME)
        .unwrap()
        .await
        .unwrap();
    let ask = yatt_runtime::testing::TAG_ASK;

    async fn expect_closed(conn: &quinn::Connection, bytes: &[u8]) {
        let (mut s, mut r) = conn.open_bi().await.unwrap();
        s.write_all(bytes).await.unwrap();
        let _ = s.finish();
        let got = tokio::time::timeout(Duration::from_secs(5), r.read_to_end(1 << 20))
            .await
            .expect("stream not closed");
        // Closed without a reply: either an empty finish or a reset/stop.
        assert!(
            got.map(|b| b.is_empty()).unwrap_or(true),
            "got a reply to garbage"
        );
    }
    // Oversized: a header announcing 4 GiB.
    expect_closed(&conn, &[ask, 0xff, 0xff, 0xff, 0xff]).await;
    // Malformed: a well-sized frame of garbage.
    expect_closed(&conn, &[ask, 4, 0, 0, 0, 0xde, 0xad, 0xbe, 0xef]).await;
    // Truncated: a frame cut short.
    expect_closed(&conn, &[ask, 100, 0, 0, 0, 1, 2, 3]).await;
    // Unknown stream kind.
    expect_closed(&conn, &[0x7f, 1, 2, 3]).await;
    // Oversized and malformed frames on the long-lived request stream.
    let asks = yatt_runtime::testing::TAG_ASKS;
    for bytes in [
        &[asks, 0xff, 0xff, 0xff, 0x7f][..],
        &[asks, 3, 0, 0, 0, 0xff, 0xff, 0xff][..],
    ] {
        let mut s = conn.open_uni().await.unwrap();
        s.write_all(bytes).await.unwrap();
        let _ = s.finish();
    }
    // The rogue's connection is still up, and everyone else is served.
    assert!(
        conn.close_reason().is_none(),
        "connection was closed: {:?}",
        conn.close_reason()
    );
    assert_eq!(echo.ask(vec![9], T).await.unwrap(), vec![9]);
    let bad = poll(Duration::from_secs(5), || {
        victim
            .http_get("/metrics")?
            .lines()
            .find(|l| l.starts_with("yatt_bad_frames_total"))?
            .rsplit(' ')
            .next()?
            .parse::<u64>()
            .ok()
            .filter(|n| *n >= 6)
    });
    assert!(
        bad.is_some(),
        "bad frames not counted:\n{}",
        victim.http_get("/metrics").unwrap_or_default()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_leaves_and_exits_cleanly() {
    let mut cluster = Cluster::start("st", 2);
    let leaver = cluster.nodes[1].name.clone();
    let code = cluster.nodes[1].terminate(Duration::from_secs(15));
    assert_eq!(code, Some(0), "log:\n{}", cluster.nodes[1].log());
    assert!(cluster.nodes[1].log().contains("left the cluster"));
    let gone = poll(Duration::from_secs(5), || {
        (cluster.nodes[0].sees_alive(&leaver) == Some(false)).then_some(())
    });
    assert!(gone.is_some(), "leader still lists {leaver} alive");
}

/// Polls until `node`'s `/health` answers `status` with `incarnation` other than `not`.
fn healthy_as_new_incarnation(
    node: &yatt_integration_tests::NodeProc,
    not: u64,
    timeout: Duration,
) -> Option<u64> {
    poll(timeout, || {
        let h = node.health()?;
        let inc = h["incarnation"].as_u64()?;
        (h["status"] == "ok" && inc != not).then_some(inc)
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_frozen_past_the_bound_rejoins_under_a_new_incarnation() {
    let cluster = Cluster::start("fz", 3);
    let c = client(&cluster, "fz-client", true).await;
    let (leader, victim) = (&cluster.nodes[0], &cluster.nodes[2]);
    let echo = c
        .spawn_remote::<Vec<u8>, Vec<u8>, _>(&victim.name, "echo", &(), T)
        .await
        .unwrap();
    let old = victim.incarnation().expect("/health names the incarnation");

    // A stall below the failure bound (2 s) is harmless. The stall itself is the
    // stimulus, so it is timed; what follows is watched for one bound.
    victim.pause();
    std::thread::sleep(Duration::from_millis(1500));
    victim.resume();
    let disturbed = poll(Duration::from_secs(3), || {
        (leader.sees_alive_as(&victim.name) != Some(old) || victim.incarnation() != Some(old))
            .then_some(())
    });
    assert!(
        disturbed.is_none(),
        "a 1.5 s stall changed the membership\n{}",
        cluster_logs(&cluster)
    );
    assert_eq!(echo.ask(vec![1], T).await.unwrap(), vec![1]);

    // Frozen until the leader has declared it dead (about the 2 s bound).
    let paused = Instant::now();
    victim.pause();
    let dead = poll(T, || {
        (leader.sees_alive(&victim.name) == Some(false)).then_some(())
    });
    let detected = paused.elapsed();
    victim.resume();
    assert!(dead.is_some(), "{}", cluster_logs(&cluster));
    let resumed = Instant::now();
    // It learns it was declared dead, stops what it hosted, and rejoins as a new life.
    let new = healthy_as_new_incarnation(victim, old, T);
    let new = new.unwrap_or_else(|| panic!("no rejoin\n{}", cluster_logs(&cluster)));
    let back = poll(T, || {
        (leader.sees_alive_as(&victim.name) == Some(new)).then_some(())
    });
    assert!(back.is_some(), "{}", cluster_logs(&cluster));
    eprintln!(
        "frozen node declared dead {detected:?} into the stall; healthy again as a new incarnation {:?} after SIGCONT",
        resumed.elapsed()
    );
    assert!(
        victim.log().contains("this node was declared dead"),
        "{}",
        victim.log()
    );
    let h = victim.health().unwrap();
    assert_eq!(h["hosted"].as_array().map(Vec::len), Some(0), "{h}");
    let up = victim.http_get("/metrics").unwrap_or_default();
    assert!(
        up.lines()
            .any(|l| l.starts_with("yatt_up{") && l.ends_with(" 1")),
        "{up}"
    );
    // The old actor does not answer as if it were current.
    let err = echo.ask(vec![2], T).await.unwrap_err();
    assert!(
        matches!(err, CallError::NodeDown { .. } | CallError::Stale { .. }),
        "{err:?}"
    );
    // The node is a usable spare again.
    let again = poll_spawn_echo(&c, &victim.name).await;
    assert_eq!(again.ask(vec![3], T).await.unwrap(), vec![3]);
}

/// Spawns an echo on `node`, retrying while the client's directory catches up with the
/// node's new incarnation.
async fn poll_spawn_echo(c: &Node, node: &str) -> yatt_runtime::ActorRef<Vec<u8>, Vec<u8>> {
    let end = Instant::now() + T;
    loop {
        match c
            .spawn_remote::<Vec<u8>, Vec<u8>, _>(node, "echo", &(), T)
            .await
        {
            Ok(r) => return r,
            Err(e) if Instant::now() < end => eprintln!("spawn on {node}: {e}; retrying"),
            Err(e) => panic!("spawn on {node}: {e}"),
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_node_under_a_live_name_is_refused() {
    let mut cluster = Cluster::start("dn", 3);
    let holder = cluster.nodes[1].name.clone();
    let inc = cluster.nodes[1].incarnation().unwrap();
    // Through the leader, and through a member that is not the leader.
    for via in [0, 2] {
        let started = Instant::now();
        let (code, log) =
            cluster.run_expecting_exit(&holder, cluster.nodes[via].addr, Duration::from_secs(30));
        assert!(code.is_some_and(|c| c != 0), "exit {code:?}\n{log}");
        for want in [
            "\"dn-1\" belongs to a live member",
            "another name (--name)",
            "declared it dead",
        ] {
            assert!(log.contains(want), "{want:?} missing:\n{log}");
        }
        eprintln!(
            "duplicate refused via node {via} after {:?}",
            started.elapsed()
        );
        // The live one was not ejected.
        assert_eq!(cluster.nodes[0].sees_alive_as(&holder), Some(inc));
        assert_eq!(cluster.nodes[1].health().unwrap()["status"], "ok");
    }
    // A crashed node restarted at once under its name joins once its old life has been
    // declared dead (the join waits for that, within one bound).
    cluster.restart(1, &[]);
    let new = cluster.nodes[1].incarnation().unwrap();
    assert_ne!(new, inc);
    assert_eq!(cluster.nodes[0].sees_alive_as(&holder), Some(new));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_seed_fails_over_and_the_old_seed_rejoins_through_a_member() {
    let mut cluster = Cluster::start("fo", 3);
    let c = client(&cluster, "fo-client", true).await;
    let linked = c
        .spawn_remote_linked::<Vec<u8>, Vec<u8>, _>(&cluster.nodes[2].name, "echo", &(), T)
        .await
        .unwrap();
    assert_eq!(linked.ask(vec![1], T).await.unwrap(), vec![1]);

    let killed = Instant::now();
    cluster.nodes[0].kill9();
    // fo-1 joined first after the seed: it leads term 2 and everyone follows it.
    let want = Some(("fo-1".to_string(), 2));
    let led = poll(T, || {
        (cluster.nodes[1].lead() == want && cluster.nodes[2].lead() == want).then_some(())
    });
    let failover = killed.elapsed();
    assert!(led.is_some(), "{}", cluster_logs(&cluster));
    for n in &cluster.nodes[1..] {
        let dead = poll(T, || (n.sees_alive("fo-0") == Some(false)).then_some(()));
        assert!(dead.is_some(), "{} still sees fo-0 alive", n.name);
    }
    assert!(
        c.directory()
            .wait_until(T, |d| d
                .node("fo-0")
                .is_some_and(|n| n.liveness != Liveness::Alive))
            .await
    );
    assert_eq!((c.leader().as_str(), c.term()), ("fo-1", 2));
    eprintln!("seed killed: fo-1 led term 2 after {failover:?}");

    // The job's roles survive the fail-over, and are released when their owner leaves
    // (through the new leader).
    assert_eq!(linked.ask(vec![2], T).await.unwrap(), vec![2]);
    c.shutdown().await;
    let released = poll(T, || {
        cluster.nodes[2].health()?["hosted"]
            .as_array()?
            .is_empty()
            .then_some(())
    });
    assert!(released.is_some(), "{:?}", cluster.nodes[2].health());

    // New work: a client joining through a member that is not the leader reaches it.
    let late = Node::builder("fo-late")
        .dev_certs(cluster.ca_dir())
        .seed(cluster.nodes[2].addr)
        .start()
        .await
        .expect("joins through a follower");
    assert_eq!(late.leader(), "fo-1");
    let echo = late
        .spawn_remote::<Vec<u8>, Vec<u8>, _>(&cluster.nodes[2].name, "echo", &(), T)
        .await
        .unwrap();
    assert_eq!(echo.ask(vec![3], T).await.unwrap(), vec![3]);

    // The old seed, restarted with a member as its seed, joins the same cluster.
    cluster.restart_through(0, 2, &[]);
    assert_eq!(cluster.nodes[0].lead(), want, "{}", cluster.nodes[0].log());
    let seen = poll(T, || {
        (cluster.nodes[1].sees_alive("fo-0") == Some(true)).then_some(())
    });
    assert!(seen.is_some(), "{}", cluster_logs(&cluster));
    let on_a = poll_spawn_echo(&late, "fo-0").await;
    assert_eq!(on_a.ask(vec![4], T).await.unwrap(), vec![4]);
}
