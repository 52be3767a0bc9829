//! Membership under failure, in one process: each node runs on a runtime of its own, on
//! a thread of its own, so that a test can freeze one node (block its only thread: its
//! timers, sockets and tasks stand still, as under SIGSTOP) or kill it (drop its runtime:
//! everything stops at once and nothing says goodbye, as under kill -9) while the others
//! go on. Every wait polls with a deadline.

use std::future::Future;
use std::time::{Duration, Instant};

use tokio::runtime::Handle;
use tokio::sync::oneshot;
use yatt_runtime::{
    Actor, ActorError, ActorName, ActorRef, CallError, Context, DeviceClaim, Liveness, Membership,
    Node, NodeBuilder, NodeError,
};

const T: Duration = Duration::from_secs(20);
/// The default failure bound (`NodeConfig::failure_timeout`).
const BOUND: Duration = Duration::from_secs(2);

/// Adds what it is sent and answers the sum. It claims its node's device 0, so the
/// directory records a claim with it.
struct Summer(u64);

impl Actor for Summer {
    type Request = u64;
    type Response = u64;
    async fn handle(&mut self, x: u64, _: &mut Context) -> Result<u64, ActorError> {
        self.0 += x;
        Ok(self.0)
    }
    fn device_claim(&self) -> Option<DeviceClaim> {
        Some(DeviceClaim {
            devices: vec![0],
            cuda: false,
        })
    }
}

/// One node on a runtime and thread of its own.
struct Host {
    node: Node,
    handle: Handle,
    stop: Option<oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Host {
    async fn start(builder: NodeBuilder) -> Result<Host, NodeError> {
        let (started_tx, started) = oneshot::channel();
        let (stop, stopped) = oneshot::channel::<()>();
        let thread = std::thread::spawn(move || {
            let rt = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("a runtime for the node");
            rt.block_on(async move {
                match builder.start().await {
                    Ok(node) => {
                        let _ = started_tx.send(Ok((node, Handle::current())));
                        let _ = stopped.await;
                    }
                    Err(e) => {
                        let _ = started_tx.send(Err(e));
                    }
                }
            });
            // Dropping the runtime drops every task of the node mid-flight.
        });
        let started = tokio::time::timeout(T, started)
            .await
            .expect("the node starts within the deadline")
            .expect("the node's thread answers");
        let (node, handle) = started?;
        Ok(Host {
            node,
            handle,
            stop: Some(stop),
            thread: Some(thread),
        })
    }

    /// Runs `f` on the node's own runtime, so the connections it opens are driven (and
    /// frozen, and killed) with the node.
    async fn run<Fut>(&self, f: impl FnOnce(Node) -> Fut) -> Fut::Output
    where
        Fut: Future + Send + 'static,
        Fut::Output: Send + 'static,
    {
        self.handle
            .spawn(f(self.node.clone()))
            .await
            .expect("the task ran on the node's runtime")
    }

    /// Blocks the node's only thread for `d`.
    fn freeze(&self, d: Duration) {
        self.handle.spawn(async move { std::thread::sleep(d) });
    }

    /// Stops the node's runtime at once.
    fn kill(mut self) {
        self.halt();
    }

    fn halt(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.halt();
    }
}

fn builder(dir: &tempfile::TempDir, name: &str, seed: Option<&Host>) -> NodeBuilder {
    let b = Node::builder(name)
        .dev_certs(dir.path())
        .factory("summer", |start: u64| Ok(Summer(start)));
    match seed {
        Some(s) => b.seed(s.node.addr()),
        None => b,
    }
}

/// Polls `f` every 20 ms until it holds, at most `timeout`.
async fn until(timeout: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + timeout;
    loop {
        if f() {
            return true;
        }
        if Instant::now() >= end {
            return false;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Whether `viewer` holds `node` alive under `incarnation`.
fn sees_alive(viewer: &Node, node: &str, incarnation: u64) -> bool {
    viewer.directory().read(|d| {
        d.node(node)
            .is_some_and(|e| e.liveness == Liveness::Alive && e.info.incarnation == incarnation)
    })
}

/// Whether `viewer` resolves `name` to a live actor.
fn resolves(viewer: &Node, name: &ActorName) -> bool {
    viewer.directory().read(|d| d.resolve(name).is_some())
}

fn sees_dead(viewer: &Node, node: &str) -> bool {
    viewer.directory().read(|d| {
        d.node(node)
            .is_some_and(|e| matches!(e.liveness, Liveness::Dead(_)))
    })
}

/// Seed `<tag>-a` and members `<tag>-b`, `<tag>-c`, all joined.
async fn three(tag: &str) -> (tempfile::TempDir, Host, Host, Host) {
    let dir = tempfile::tempdir().unwrap();
    let a = Host::start(builder(&dir, &format!("{tag}-a"), None))
        .await
        .unwrap();
    let b = Host::start(builder(&dir, &format!("{tag}-b"), Some(&a)))
        .await
        .unwrap();
    let c = Host::start(builder(&dir, &format!("{tag}-c"), Some(&a)))
        .await
        .unwrap();
    for h in [&a, &b, &c] {
        assert!(
            h.node
                .directory()
                .wait_until(T, |d| d.alive_nodes().count() == 3)
                .await,
            "{} did not see all three joined",
            h.node.name()
        );
    }
    (dir, a, b, c)
}

async fn spawn_summer(on: &Host, host: &str) -> ActorRef<u64, u64> {
    let host = host.to_string();
    on.run(move |n| async move {
        n.spawn_remote::<u64, u64, _>(&host, "summer", &0u64, T)
            .await
            .expect("spawn summer")
    })
    .await
}

async fn ask(on: &Host, actor: &ActorRef<u64, u64>, x: u64) -> Result<u64, CallError> {
    let actor = actor.clone();
    on.run(move |_| async move { actor.ask(x, Duration::from_secs(3)).await })
        .await
}

/// Collects the membership states `node` goes through until it is a member again.
fn record_membership(node: &Node) -> tokio::task::JoinHandle<Vec<Membership>> {
    let mut rx = node.watch_membership();
    tokio::spawn(async move {
        let mut seen = Vec::new();
        while tokio::time::timeout(T, rx.changed())
            .await
            .is_ok_and(|r| r.is_ok())
        {
            let m = rx.borrow_and_update().clone();
            let done = m == Membership::Member;
            seen.push(m);
            if done {
                break;
            }
        }
        seen
    })
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_member_frozen_past_the_bound_stops_its_actors_and_rejoins_as_a_new_incarnation() {
    let (_dir, a, b, c) = three("fz").await;
    let summer = spawn_summer(&a, b.node.name()).await;
    assert_eq!(ask(&a, &summer, 5).await.unwrap(), 5);
    let old = b.node.incarnation();
    let changes = record_membership(&b.node);

    let frozen = Instant::now();
    b.freeze(Duration::from_secs(3));
    // The leader declares it dead while it is frozen, and its actor with it.
    assert!(until(T, || sees_dead(&a.node, "fz-b")).await);
    eprintln!("frozen member declared dead after {:?}", frozen.elapsed());
    let name = summer.id().name.clone();
    assert!(until(T, || !resolves(&a.node, &name)).await);

    // It wakes, learns it was declared dead, stops what it hosted and rejoins.
    let seen = tokio::time::timeout(T, changes).await.unwrap().unwrap();
    assert!(
        matches!(&seen[..], [Membership::Rejoining { reason }, Membership::Member] if reason.contains("no heartbeat")),
        "{seen:?}"
    );
    let new = b.node.incarnation();
    assert!(new > old, "rejoined under incarnation {new}, was {old}");
    eprintln!("rejoined {:?} after the freeze began", frozen.elapsed());
    for viewer in [&a.node, &c.node, &b.node] {
        assert!(
            until(T, || sees_alive(viewer, "fz-b", new)).await,
            "{} does not see the new incarnation",
            viewer.name()
        );
    }
    assert!(b.node.hosted().is_empty(), "{:?}", b.node.hosted());
    // The old actor does not answer as if it were current.
    let err = ask(&a, &summer, 1).await.unwrap_err();
    assert!(
        matches!(err, CallError::NodeDown { .. } | CallError::Stale { .. }),
        "{err:?}"
    );
    // The node is a usable spare again.
    let again = spawn_summer(&c, "fz-b").await;
    assert_eq!(ask(&c, &again, 7).await.unwrap(), 7);
    assert_eq!(a.node.leader(), "fz-a");
    assert_eq!(a.node.term(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stall_below_the_bound_is_harmless() {
    let (_dir, a, b, _c) = three("st").await;
    let summer = spawn_summer(&a, b.node.name()).await;
    let before = (b.node.incarnation(), a.node.incarnation());
    let mut changes = b.node.watch_membership();

    // A member and then the leader stall for 1.5 s (below the 2 s bound).
    for h in [&b, &a] {
        let epoch = a.node.directory().epoch();
        h.freeze(Duration::from_millis(1500));
        // Another bound's worth of time: nothing may be declared dead meanwhile.
        let quiet = tokio::time::timeout(BOUND * 2, changes.changed()).await;
        assert!(quiet.is_err(), "{} changed membership", b.node.name());
        assert_eq!(a.node.membership(), Membership::Member);
        assert_eq!(a.node.directory().epoch(), epoch, "the directory changed");
    }
    assert_eq!((b.node.incarnation(), a.node.incarnation()), before);
    assert_eq!((a.node.leader().as_str(), a.node.term()), ("st-a", 1));
    assert_eq!(b.node.leader(), "st-a");
    assert_eq!(ask(&a, &summer, 3).await.unwrap(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_live_name_is_refused_and_a_dead_or_departed_one_rejoins() {
    let (dir, a, b, _c) = three("dn").await;
    let real = b.node.incarnation();
    let started = Instant::now();
    let err = match Host::start(builder(&dir, "dn-b", Some(&a))).await {
        Ok(h) => panic!("a second dn-b joined as {}", h.node.incarnation()),
        Err(e) => e,
    };
    let text = err.to_string();
    assert!(matches!(err, NodeError::NameInUse { .. }), "{err:?}");
    for want in ["\"dn-b\"", "live member", "--name", "declared it dead"] {
        assert!(text.contains(want), "{want:?} missing from: {text}");
    }
    eprintln!("duplicate refused after {:?}: {text}", started.elapsed());
    // The real one is untouched.
    assert!(sees_alive(&a.node, "dn-b", real));
    assert_eq!(b.node.membership(), Membership::Member);

    // After a graceful leave the name is free at once.
    b.run(|n| async move { n.shutdown().await }).await;
    drop(b);
    let b2 = Host::start(builder(&dir, "dn-b", Some(&a))).await.unwrap();
    assert!(until(T, || sees_alive(&a.node, "dn-b", b2.node.incarnation())).await);

    // After a crash it is free once the crashed life is declared dead; a join in the
    // meantime waits for that (within one bound) instead of failing.
    b2.kill();
    let b3 = Host::start(builder(&dir, "dn-b", Some(&a))).await.unwrap();
    assert!(sees_alive(&a.node, "dn-b", b3.node.incarnation()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn killing_the_leader_fails_over_to_the_oldest_member() {
    let (dir, a, b, c) = three("ko").await;
    // A driver (a client member) runs a job: a linked actor on c, one on the leader.
    let driver = Host::start(builder(&dir, "ko-driver", Some(&a)))
        .await
        .unwrap();
    let on_a = spawn_summer(&driver, "ko-a").await;
    let linked = driver
        .run(|n| async move {
            n.spawn_remote_linked::<u64, u64, _>("ko-c", "summer", &1u64, T)
                .await
                .unwrap()
        })
        .await;
    assert_eq!(ask(&driver, &linked, 1).await.unwrap(), 2);

    let killed = Instant::now();
    a.kill();
    // b joined first after a: it leads term 2, and everyone follows it.
    for h in [&b, &c, &driver] {
        assert!(
            until(T, || h.node.leader() == "ko-b" && h.node.term() == 2).await,
            "{} follows {} at term {}",
            h.node.name(),
            h.node.leader(),
            h.node.term()
        );
    }
    let took_over = killed.elapsed();
    for h in [&b, &c, &driver] {
        assert!(until(T, || sees_dead(&h.node, "ko-a")).await);
    }
    eprintln!(
        "leader killed: ko-b led term 2 after {took_over:?}, all saw ko-a dead after {:?}",
        killed.elapsed()
    );
    // The old leader's actors went through the node-down path.
    let name = on_a.id().name.clone();
    assert!(until(T, || !resolves(&driver.node, &name)).await);
    // The actors on the others are still registered and serve.
    assert!(resolves(&c.node, &linked.id().name));
    assert_eq!(ask(&driver, &linked, 1).await.unwrap(), 3);
    // The new leader's directory still says which device each holds; the dead
    // leader's actors hold none.
    for h in [&b, &c, &driver] {
        let claims: Vec<String> = h.node.directory().read(|d| {
            d.claims()
                .map(|(id, c)| format!("{id}:{:?}", c.devices))
                .collect()
        });
        assert_eq!(
            claims,
            [format!("{}:[0]", linked.id())],
            "{}",
            h.node.name()
        );
    }

    // The driver leaves through the new leader: its linked actor on c is released.
    driver.run(|n| async move { n.shutdown().await }).await;
    assert!(
        until(T, || c.node.hosted().is_empty()).await,
        "{:?}",
        c.node.hosted()
    );
    assert!(until(T, || sees_dead(&b.node, "ko-driver")).await);

    // A new node joining through a follower is sent to the leader.
    let late = Host::start(builder(&dir, "ko-late", Some(&c)))
        .await
        .unwrap();
    assert_eq!(late.node.leader(), "ko-b");
    let s = spawn_summer(&late, "ko-c").await;
    assert_eq!(ask(&late, &s, 4).await.unwrap(), 4);

    // The old seed restarted with a member as its seed joins the same cluster.
    let a2 = Host::start(builder(&dir, "ko-a", Some(&c))).await.unwrap();
    assert_eq!((a2.node.leader().as_str(), a2.node.term()), ("ko-b", 2));
    assert!(until(T, || sees_alive(&b.node, "ko-a", a2.node.incarnation())).await);
    let s = spawn_summer(&b, "ko-a").await;
    assert_eq!(ask(&b, &s, 9).await.unwrap(), 9);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_that_leaves_hands_over_without_waiting_for_the_bound() {
    let (_dir, a, b, c) = three("gl").await;
    let started = Instant::now();
    a.run(|n| async move { n.shutdown().await }).await;
    for h in [&b, &c] {
        assert!(until(T, || h.node.leader() == "gl-b" && h.node.term() == 2).await);
    }
    let took = started.elapsed();
    eprintln!("graceful handover after {took:?}");
    assert!(took < BOUND, "handover waited {took:?}");
    let s = spawn_summer(&c, "gl-b").await;
    assert_eq!(ask(&c, &s, 2).await.unwrap(), 2);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_leader_frozen_past_the_bound_steps_down_and_rejoins() {
    let (_dir, a, b, c) = three("lf").await;
    let old = a.node.incarnation();
    let changes = record_membership(&a.node);
    a.freeze(Duration::from_secs(4));
    for h in [&b, &c] {
        assert!(until(T, || h.node.leader() == "lf-b" && h.node.term() == 2).await);
        assert!(until(T, || sees_dead(&h.node, "lf-a")).await);
    }
    // It wakes up leading term 1, hears of term 2, and rejoins under it.
    let seen = tokio::time::timeout(T, changes).await.unwrap().unwrap();
    assert!(
        matches!(
            &seen[..],
            [Membership::Rejoining { .. }, Membership::Member]
        ),
        "{seen:?}"
    );
    assert_eq!((a.node.leader().as_str(), a.node.term()), ("lf-b", 2));
    let new = a.node.incarnation();
    assert!(new > old);
    for viewer in [&b.node, &c.node] {
        assert!(until(T, || sees_alive(viewer, "lf-a", new)).await);
    }
    let s = spawn_summer(&c, "lf-a").await;
    assert_eq!(ask(&c, &s, 6).await.unwrap(), 6);
}

/// A founder (no seed) given its peers' addresses, as a launcher gives pod 0 the other
/// pods: on a fresh start, with no peer in a cluster, it leads after one round of
/// asking; killed and started again at once, it finds its peers still following its
/// earlier life, waits for them to elect another leader, and rejoins that cluster as a
/// new incarnation instead of leading a second one.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_founder_restarted_with_peers_rejoins_the_live_cluster() {
    let (dir, a, b, c) = three("fr").await;
    // Fresh start: a peer that never answers (a bound UDP socket that speaks no QUIC).
    let mute = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
    let t0 = Instant::now();
    let solo = Host::start(builder(&dir, "fr-solo", None).peers([mute.local_addr().unwrap()]))
        .await
        .unwrap();
    let asked = t0.elapsed();
    assert_eq!(
        (solo.node.leader().as_str(), solo.node.term()),
        ("fr-solo", 1)
    );
    assert!(asked < BOUND * 2, "the fresh start took {asked:?}");
    assert!(sees_alive(&solo.node, "fr-solo", solo.node.incarnation()));

    let before = a.node.incarnation();
    let peers = [b.node.addr(), c.node.addr()];
    a.kill();
    let killed = Instant::now();
    let a2 = Host::start(builder(&dir, "fr-a", None).peers(peers))
        .await
        .unwrap();
    let rejoined = killed.elapsed();
    assert_eq!((a2.node.leader().as_str(), a2.node.term()), ("fr-b", 2));
    assert!(!a2.node.is_leader());
    assert_ne!(a2.node.incarnation(), before);
    for h in [&b, &c] {
        assert!(
            until(T, || sees_alive(&h.node, "fr-a", a2.node.incarnation())).await,
            "{} does not see the restarted fr-a",
            h.node.name()
        );
        assert_eq!((h.node.leader().as_str(), h.node.term()), ("fr-b", 2));
    }
    // It is a member like any other: actors spawn on it.
    let s = spawn_summer(&b, "fr-a").await;
    assert_eq!(ask(&b, &s, 5).await.unwrap(), 5);
    eprintln!("fresh start with a mute peer: led after {asked:?}; restarted founder rejoined fr-b's term 2 after {rejoined:?}");
}
