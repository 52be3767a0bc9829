//! Three nodes in one process, talking real QUIC with mutual TLS over loopback.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;
use std::time::Duration;

use bytes::Bytes;
use serde::{Deserialize, Serialize};
use yatt_runtime::NodeConfig;
use yatt_runtime::TransportConfig;
use yatt_runtime::WithBulk;
use yatt_runtime::{Actor, ActorError, CallError, Context};
use yatt_runtime::{Bulk, DType};
use yatt_runtime::{Node, NodeError};

const T: Duration = Duration::from_secs(10);

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
enum Req {
    Add(u64),
    Log(u64),
    Read,
    Checksum,
}

#[derive(Debug, Clone, Serialize, Deserialize, PartialEq)]
enum Resp {
    Sum(u64),
    Log(Vec<u64>),
    Ok,
}

struct Summer {
    sum: u64,
    log: Vec<u64>,
}

impl Actor for Summer {
    type Request = Req;
    type Response = Resp;
    async fn handle(&mut self, r: Req, _: &mut Context) -> Result<Resp, ActorError> {
        Ok(match r {
            Req::Add(x) => {
                self.sum = self
                    .sum
                    .checked_add(x)
                    .ok_or_else(|| ActorError::BadRequest("overflow".into()))?;
                Resp::Sum(self.sum)
            }
            Req::Log(x) => {
                self.log.push(x);
                Resp::Ok
            }
            Req::Read => Resp::Log(self.log.clone()),
            Req::Checksum => Resp::Ok,
        })
    }
}

/// Receives a batch and answers its crc32 and the tensor count.
struct Sink;
impl Actor for Sink {
    type Request = WithBulk<String>;
    type Response = (String, u32, usize);
    async fn handle(
        &mut self,
        r: WithBulk<String>,
        _: &mut Context,
    ) -> Result<(String, u32, usize), ActorError> {
        Ok((r.meta, r.bulk.checksum(), r.bulk.header().tensors.len()))
    }
}

async fn cluster(tag: &str, shm: bool) -> (tempfile::TempDir, Node, Node, Node) {
    let transport = TransportConfig {
        shm_fast_path: shm,
        ..TransportConfig::default()
    };
    cluster_with(tag, transport).await
}

async fn cluster_with(
    tag: &str,
    transport: TransportConfig,
) -> (tempfile::TempDir, Node, Node, Node) {
    let dir = tempfile::tempdir().unwrap();
    let config = || NodeConfig {
        transport: transport.clone(),
        ..NodeConfig::default()
    };
    let seed = Node::builder(&format!("{tag}-a"))
        .config(config())
        .dev_certs(dir.path())
        .start()
        .await
        .unwrap();
    let mut others = Vec::new();
    for n in ["b", "c"] {
        let node = Node::builder(&format!("{tag}-{n}"))
            .config(config())
            .dev_certs(dir.path())
            .seed(seed.addr())
            .factory("summer", |start: u64| {
                Ok(Summer {
                    sum: start,
                    log: vec![],
                })
            })
            .factory("sink", |_: ()| Ok(Sink))
            // Built on a blocking thread, as a role that loads a model is.
            .factory_async("summer-async", |start: u64| async move {
                if start == u64::MAX {
                    return Err("start must be below u64::MAX".to_string());
                }
                tokio::task::spawn_blocking(move || Summer {
                    sum: start,
                    log: vec![],
                })
                .await
                .map_err(|e| e.to_string())
            })
            .start()
            .await
            .unwrap();
        others.push(node);
    }
    let c = others.pop().unwrap();
    let b = others.pop().unwrap();
    assert!(
        seed.directory()
            .wait_until(T, |d| d.alive_nodes().count() == 3)
            .await
    );
    assert!(
        b.directory()
            .wait_until(T, |d| d.alive_nodes().count() == 3)
            .await
    );
    assert!(
        c.directory()
            .wait_until(T, |d| d.alive_nodes().count() == 3)
            .await
    );
    (dir, seed, b, c)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_spawn_ask_and_ordered_tells() {
    let (_dir, a, b, c) = cluster("t1", true).await;
    let summer = a
        .spawn_remote::<Req, Resp, _>(b.name(), "summer", &10u64, T)
        .await
        .unwrap();
    assert!(!summer.is_local());
    assert_eq!(summer.ask(Req::Add(5), T).await.unwrap(), Resp::Sum(15));
    // Handler errors come back as such, and the actor keeps serving.
    let err = summer.ask(Req::Add(u64::MAX), T).await.unwrap_err();
    assert!(
        matches!(
            err,
            CallError::Handler {
                error: ActorError::BadRequest(_),
                ..
            }
        ),
        "{err:?}"
    );
    // Tells from one node keep their order.
    for i in 0..200 {
        summer.tell(Req::Log(i)).await.unwrap();
    }
    let log = summer.ask(Req::Read, T).await.unwrap();
    assert_eq!(log, Resp::Log((0..200).collect()));
    // Every node can resolve it by name through its directory replica.
    assert!(
        c.directory()
            .wait_until(T, |d| d.resolve(&summer.id().name).is_some())
            .await
    );
    let via_c = c.resolve::<Req, Resp>(&summer.id().name).unwrap();
    assert_eq!(via_c.ask(Req::Add(1), T).await.unwrap(), Resp::Sum(16));
    // On its own node the reference is in-process.
    let local = b.actor_ref::<Req, Resp>(summer.id()).unwrap();
    assert!(local.is_local());
    assert_eq!(local.ask(Req::Add(1), T).await.unwrap(), Resp::Sum(17));
    // Wrong types are refused locally.
    assert!(matches!(
        b.actor_ref::<String, String>(summer.id()),
        Err(NodeError::WrongType { .. })
    ));
    // Unknown factory names what is there.
    match a
        .spawn_remote::<Req, Resp, _>(b.name(), "nope", &(), T)
        .await
    {
        Err(NodeError::NoFactory { known, .. }) => {
            assert_eq!(known, vec!["sink", "summer", "summer-async"])
        }
        other => panic!("{other:?}"),
    }
}

/// A caller that does not link a factory's argument type (a job config naming a user's
/// role) sends them as JSON; the same factory decodes them, and refuses what does not fit.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_spawn_takes_its_arguments_as_json() {
    let (_dir, a, b, _c) = cluster("t5", true).await;
    let summer = a
        .spawn_remote_linked_json::<Req, Resp>(b.name(), "summer", "10", T)
        .await
        .unwrap();
    assert_eq!(summer.ask(Req::Add(5), T).await.unwrap(), Resp::Sum(15));
    // Its name is the factory's, as with typed arguments.
    assert_eq!(summer.id().name.role, "summer");
    let e = a
        .spawn_remote_linked_json::<Req, Resp>(b.name(), "summer", "\"ten\"", T)
        .await
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("summer") && e.contains("do not fit its type") && e.contains("\"ten\""),
        "{e}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn async_factory_answers_once_built_and_reports_its_error() {
    let (_dir, a, b, _c) = cluster("t4", true).await;
    let summer = a
        .spawn_remote::<Req, Resp, _>(b.name(), "summer-async", &7u64, T)
        .await
        .unwrap();
    assert_eq!(summer.ask(Req::Add(1), T).await.unwrap(), Resp::Sum(8));
    let err = a
        .spawn_remote::<Req, Resp, _>(b.name(), "summer-async", &u64::MAX, T)
        .await
        .unwrap_err();
    assert!(err.to_string().contains("start must be below"), "{err}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn linked_actors_are_released_when_their_owner_leaves() {
    let (dir, a, b, _c) = cluster("t6", true).await;
    let driver = Node::builder("t6-driver")
        .dev_certs(dir.path())
        .seed(a.addr())
        .start()
        .await
        .unwrap();
    let linked = driver
        .spawn_remote_linked::<Req, Resp, _>(b.name(), "summer", &1u64, T)
        .await
        .unwrap();
    let free = driver
        .spawn_remote::<Req, Resp, _>(b.name(), "summer", &2u64, T)
        .await
        .unwrap();
    assert_eq!(linked.ask(Req::Add(1), T).await.unwrap(), Resp::Sum(2));
    driver.shutdown().await;
    let name = linked.id().name.clone();
    assert!(
        b.directory()
            .wait_until(T, |d| d.resolve(&name).is_none())
            .await,
        "the linked actor outlived its owner"
    );
    // An actor spawned without the link keeps serving.
    let free = a.actor_ref::<Req, Resp>(free.id()).unwrap();
    assert_eq!(free.ask(Req::Add(1), T).await.unwrap(), Resp::Sum(3));
}

/// How many `slow` actors a host has begun and finished building.
#[derive(Default)]
struct Builds {
    begun: AtomicUsize,
    done: AtomicUsize,
}

const SLOW: Duration = Duration::from_millis(1000);

/// A member whose factory `slow` takes [`SLOW`] to build.
async fn slow_host(dir: &std::path::Path, seed: &Node, name: &str, builds: Arc<Builds>) -> Node {
    let node = Node::builder(name)
        .dev_certs(dir)
        .seed(seed.addr())
        .factory_async("slow", move |start: u64| {
            let builds = builds.clone();
            async move {
                builds.begun.fetch_add(1, Ordering::SeqCst);
                tokio::time::sleep(SLOW).await;
                builds.done.fetch_add(1, Ordering::SeqCst);
                Ok(Summer {
                    sum: start,
                    log: vec![],
                })
            }
        })
        .start()
        .await
        .unwrap();
    assert!(
        seed.directory()
            .wait_until(T, |d| d.node(name).is_some())
            .await
    );
    node
}

fn slow_alive(d: &yatt_runtime::Directory) -> usize {
    d.actors()
        .filter(|e| e.id.name.role == "slow" && e.liveness == yatt_runtime::Liveness::Alive)
        .count()
}

/// Regression: a spawn whose caller gave up (its deadline passed, or its future was
/// dropped, as a sibling's failure in `try_join!` drops it) went on to start the actor,
/// which nobody held a reference to and which ran until the caller left the cluster
/// (for ever, unlinked), holding its name and, for a role, its model. Now the caller
/// cancels the spawn and the host releases what it started.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_spawn_its_caller_gave_up_on_leaves_nothing_running() {
    let (dir, a, _b, _c) = cluster("t9", true).await;
    let builds = Arc::new(Builds::default());
    let host = slow_host(dir.path(), &a, "t9-slow", builds.clone()).await;
    // A spawn nobody gives up on is kept (and the connection is up for the rest).
    let kept = a
        .spawn_remote::<Req, Resp, _>(host.name(), "slow", &5u64, T)
        .await
        .unwrap();
    assert_eq!(kept.ask(Req::Add(1), T).await.unwrap(), Resp::Sum(6));
    // Only `kept` runs once every build that began has ended.
    let only_kept = || {
        let (begun, done) = (&builds.begun, &builds.done);
        begun.load(Ordering::SeqCst) == done.load(Ordering::SeqCst)
            && host.hosted() == vec![kept.id().clone()]
            && a.directory().read(slow_alive) == 1
    };
    let state = || {
        format!(
            "{:?} running (builds begun {:?}, done {:?}; alive in the directory: {})",
            host.hosted(),
            builds.begun,
            builds.done,
            a.directory().read(slow_alive)
        )
    };
    // Past its deadline, linked or not.
    for linked in [true, false] {
        let short = Duration::from_millis(200);
        let e = if linked {
            a.spawn_remote_linked::<Req, Resp, _>(host.name(), "slow", &0u64, short)
                .await
        } else {
            a.spawn_remote::<Req, Resp, _>(host.name(), "slow", &0u64, short)
                .await
        }
        .err()
        .expect("a 1 s build answered within 200 ms");
        eprintln!("past its deadline (linked: {linked}): {e}");
        assert!(
            wait(only_kept).await,
            "a spawn past its deadline left {}",
            state()
        );
    }
    // Dropped while the host builds it.
    let before = builds.begun.load(Ordering::SeqCst);
    let spawn = Box::pin(a.spawn_remote::<Req, Resp, _>(host.name(), "slow", &0u64, T));
    let begun = wait(|| builds.begun.load(Ordering::SeqCst) > before);
    tokio::select! {
        biased;
        b = begun => assert!(b),
        r = spawn => panic!("a 1 s build answered: {:?}", r.map(|r| r.id().clone())),
    }
    assert!(
        wait(only_kept).await,
        "a spawn dropped mid-build left {}",
        state()
    );
    // Dropped after the host started it, while its answer travels: this node (the
    // leader) shows the actor in its directory before the host answers.
    let mut spawn = Box::pin(a.spawn_remote::<Req, Resp, _>(host.name(), "slow", &0u64, T));
    tokio::select! {
        biased;
        shown = a.directory().wait_until(T, |d| slow_alive(d) == 2) => assert!(shown),
        r = &mut spawn => panic!("answered before the directory showed it: {:?}", r.map(|r| r.id().clone())),
    }
    drop(spawn);
    assert!(
        wait(only_kept).await,
        "a spawn dropped after it started left {}",
        state()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn stale_incarnation_is_refused() {
    let (_dir, a, b, _c) = cluster("t2", true).await;
    let first = a
        .spawn_remote::<Req, Resp, _>(b.name(), "summer", &0u64, T)
        .await
        .unwrap();
    let mut stale_id = first.id().clone();
    stale_id.incarnation -= 1;
    let stale = a.actor_ref::<Req, Resp>(&stale_id).unwrap();
    let err = stale.ask(Req::Add(1), T).await.unwrap_err();
    assert!(
        matches!(
            err,
            CallError::Stale {
                current: Some(_),
                ..
            }
        ),
        "{err:?}"
    );
}

async fn bulk_round_trip(shm: bool) {
    let tag = if shm { "t3" } else { "t4" };
    let (_dir, a, b, _c) = cluster(tag, shm).await;
    let sink = a
        .spawn_remote::<WithBulk<String>, (String, u32, usize), _>(b.name(), "sink", &(), T)
        .await
        .unwrap();
    let n = 64 << 20;
    let data: Vec<u8> = (0..n).map(|i| (i * 7 + i / 4096) as u8).collect();
    let ids: Vec<u8> = (0..64u64).flat_map(|i| i.to_le_bytes()).collect();
    let bulk = Bulk::from_tensors([
        ("tokens", DType::U8, vec![n as u64], Bytes::from(data)),
        ("ids", DType::I64, vec![64], Bytes::from(ids)),
    ])
    .unwrap();
    let want = bulk.checksum();
    let segments = || -> usize {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| {
                e.file_name()
                    .to_string_lossy()
                    .starts_with(&format!("yatt-{tag}-a-"))
            })
            .count()
    };
    for round in 0..3 {
        let (meta, got, count) = sink
            .ask(
                WithBulk {
                    meta: format!("batch-{round}"),
                    bulk: bulk.clone(),
                },
                T,
            )
            .await
            .unwrap();
        assert_eq!((meta, got, count), (format!("batch-{round}"), want, 2));
        if shm {
            // The receiver releases the segment when it drops the payload, and the
            // sender reuses it. The release travels apart from the reply, so a round
            // can start before it lands and lease a second segment (seen once in three
            // runs on a quiet machine); it must never take one per round.
            let reused = wait(|| segments() <= 2).await;
            assert!(reused, "{} segments after round {round}", segments());
        }
    }
    if shm {
        a.shutdown().await;
        drop(a);
        assert!(
            wait(|| segments() == 0).await,
            "segments left behind: {}",
            segments()
        );
    }
}

/// Polls a condition for up to 5 s.
async fn wait(mut f: impl FnMut() -> bool) -> bool {
    for _ in 0..250 {
        if f() {
            return true;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    false
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_64mib_intact_through_shared_memory() {
    bulk_round_trip(true).await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bulk_64mib_intact_inline_over_quic() {
    bulk_round_trip(false).await;
}

type SinkRef = yatt_runtime::ActorRef<WithBulk<String>, (String, u32, usize)>;

/// A cluster whose transports use shared memory and free idle pools after
/// `pool_idle`, with a sink on `b` that `a` sends to.
async fn shm_sink(
    tag: &str,
    pool_idle: Duration,
) -> (tempfile::TempDir, Node, Node, Node, SinkRef) {
    let transport = TransportConfig {
        shm_fast_path: true,
        pool_idle,
        ..TransportConfig::default()
    };
    let (dir, a, b, c) = cluster_with(tag, transport).await;
    let sink = a
        .spawn_remote::<WithBulk<String>, (String, u32, usize), _>(b.name(), "sink", &(), T)
        .await
        .unwrap();
    (dir, a, b, c, sink)
}

/// Sends 4 MiB of `fill` (through shared memory) to `sink` and checks what arrived.
async fn send_4mib(sink: &SinkRef, fill: u8) {
    let data = Bytes::from(vec![fill; 4 << 20]);
    let bulk = Bulk::from_tensors([("x", DType::U8, vec![4 << 20], data)]).unwrap();
    let want = bulk.checksum();
    let request = WithBulk {
        meta: format!("{fill}"),
        bulk,
    };
    let (_, got, _) = sink.ask(request, T).await.unwrap();
    assert_eq!(got, want);
}

/// This process's mappings of files whose name contains `prefix`.
fn mappings_of(prefix: &str) -> usize {
    let maps = std::fs::read_to_string("/proc/self/maps").unwrap();
    maps.lines().filter(|l| l.contains(prefix)).count()
}

// Regression: a daemon kept its shared-memory segments (up to 1 GiB of /dev/shm, with
// the receivers' mappings of them) and its receive buffers from one job to the next.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_shared_memory_segments_are_removed_and_unmapped() {
    let tag = "idle";
    let (_dir, a, _b, _c, sink) = shm_sink(tag, Duration::from_secs(3)).await;
    let send = |fill: u8| send_4mib(&sink, fill);
    send(7).await;
    let prefix = format!("yatt-{tag}-a-");
    let files = || {
        std::fs::read_dir("/dev/shm")
            .unwrap()
            .filter_map(|e| e.ok())
            .filter(|e| e.file_name().to_string_lossy().starts_with(&prefix))
            .count()
    };
    // Both ends are in this process: the sender's mapping and the receiver's.
    let mappings = || mappings_of(&prefix);
    assert_eq!(files(), 1, "the payload went through shared memory");
    assert!(mappings() >= 1);
    // Within the idle time and a sweep period (a quarter of it), with room for a busy
    // machine.
    let mut freed = false;
    for _ in 0..500 {
        freed = files() == 0 && mappings() == 0;
        if freed {
            break;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert!(
        freed,
        "{} segment files and {} mappings left",
        files(),
        mappings()
    );
    // The next payload makes a segment again.
    send(9).await;
    assert_eq!(files(), 1);
    a.shutdown().await;
}

// Regression: each connection's task that sends segment releases held the connection's
// peer, whose mappings hold the sender that task waits on: no connection's peer was
// ever freed, so a receiver kept the mappings of a peer that had left (its removed
// segments' memory with them) until it stopped itself.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_peer_that_leaves_has_its_segments_unmapped_at_once() {
    let tag = "gone";
    // No idle sweep within the test: only the connection's end may unmap.
    let (_dir, a, b, _c, sink) = shm_sink(tag, Duration::from_secs(3600)).await;
    send_4mib(&sink, 5).await;
    let prefix = format!("yatt-{tag}-a-");
    let mappings = || mappings_of(&prefix);
    assert!(mappings() >= 1, "the payload went through shared memory");
    drop(sink);
    a.shutdown().await;
    drop(a);
    assert!(
        wait(|| mappings() == 0).await,
        "{} mappings of the departed peer's segments left in {}",
        mappings(),
        b.name()
    );
    b.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_leave_marks_actors_dead() {
    let (_dir, a, b, c) = cluster("t5", true).await;
    let summer = a
        .spawn_remote::<Req, Resp, _>(c.name(), "summer", &0u64, T)
        .await
        .unwrap();
    let name = summer.id().name.clone();
    c.shutdown().await;
    for n in [&a, &b] {
        assert!(
            n.directory()
                .wait_until(T, |d| d.resolve(&name).is_none()
                    && d.alive_nodes().count() == 2)
                .await
        );
    }
    let err = summer
        .ask(Req::Read, Duration::from_secs(2))
        .await
        .unwrap_err();
    assert!(
        matches!(
            err,
            CallError::NodeDown { .. } | CallError::Transport { .. }
        ),
        "{err:?}"
    );
}
