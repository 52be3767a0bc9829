//! The `Role` trait: what a user implements to add an RLHF role.
//!
//! A role is plain synchronous code: tch calls block, so every role runs on a dedicated
//! OS thread (one per role instance, i.e. per device group), and [`RoleActor`] is the
//! thin actor around it that queues requests to that thread and awaits the answers, so
//! the async executor never blocks. The trait itself carries no actor-framework types:
//! the runtime can change without breaking roles.
//!
//! ```
//! use yatt_roles::{DeviceGroup, ResourceProfile, Role, RoleError};
//!
//! /// Scores a response by its length (a toy reward role).
//! struct LengthReward;
//!
//! impl Role for LengthReward {
//!     type Request = String;
//!     type Response = f32;
//!     fn name(&self) -> &str { "length-reward" }
//!     fn profile(&self) -> ResourceProfile { ResourceProfile::cpu_only() }
//!     fn start(&mut self, _group: &DeviceGroup) -> Result<(), RoleError> { Ok(()) }
//!     fn serve(&mut self, response: String) -> Result<f32, RoleError> {
//!         Ok(response.len() as f32)
//!     }
//! }
//! ```

use serde::{Deserialize, Serialize};
use tokio::sync::{mpsc, oneshot};
use yatt_runtime::{Actor, ActorError, Context, DeviceClaim};

/// Why a role could not do something.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, thiserror::Error)]
pub enum RoleError {
    /// The request was not acceptable; the text says how to fix it.
    #[error("bad request: {0}")]
    BadRequest(String),
    /// The role failed doing the work (model error, I/O, ...).
    #[error("{0}")]
    Failed(String),
    /// The role cannot serve in its current state (offloaded, draining, not started).
    #[error("not ready: {0}")]
    NotReady(String),
    /// The role does not support this lifecycle operation.
    #[error("{role} does not support {operation}")]
    Unsupported {
        /// The role's name.
        role: String,
        /// The operation asked for.
        operation: &'static str,
    },
}

impl From<RoleError> for ActorError {
    fn from(e: RoleError) -> Self {
        match e {
            RoleError::BadRequest(s) => ActorError::BadRequest(s),
            RoleError::NotReady(s) => ActorError::Unavailable(s),
            // A request the role does not take is refused, not failed: the asker can
            // tell it from a failure and stop asking (weight sync's direct push).
            e @ RoleError::Unsupported { .. } => ActorError::BadRequest(e.to_string()),
            other => ActorError::Failed(other.to_string()),
        }
    }
}

/// The devices a role instance runs on: devices of one node.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct DeviceGroup {
    /// The node hosting the devices.
    pub node: String,
    /// Device indices on that node (CUDA ordinals, or virtual device numbers).
    pub devices: Vec<u32>,
    /// Whether the devices are CUDA GPUs (false: CPU with virtual devices).
    pub cuda: bool,
}

impl DeviceGroup {
    /// A group of one CPU (virtual) device on `node`.
    pub fn cpu(node: &str) -> Self {
        DeviceGroup {
            node: node.to_string(),
            devices: vec![0],
            cuda: false,
        }
    }

    /// The group's devices as a node records them with the actor that holds them
    /// (without the node: the actor's own).
    pub fn claim(&self) -> DeviceClaim {
        DeviceClaim {
            devices: self.devices.clone(),
            cuda: self.cuda,
        }
    }

    /// The libtorch device the group's first device is: where a role built on it keeps
    /// its model, KV cache and optimizer state.
    pub fn torch_device(&self) -> tch::Device {
        if self.cuda {
            tch::Device::Cuda(self.devices.first().copied().unwrap_or(0) as usize)
        } else {
            tch::Device::Cpu
        }
    }
}

/// What a role needs, for the placement planner.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ResourceProfile {
    /// Device memory the role holds while loaded (weights, optimizer, caches), bytes.
    pub resident_bytes: u64,
    /// Extra device memory at peak (activations, KV cache growth), bytes.
    pub peak_extra_bytes: u64,
    /// Whether the role can release its device memory between phases.
    pub offloadable: bool,
    /// Whether it needs a GPU to be useful.
    pub needs_gpu: bool,
}

impl ResourceProfile {
    /// A role that uses no device memory (e.g. a rule-based reward).
    pub fn cpu_only() -> Self {
        ResourceProfile {
            resident_bytes: 0,
            peak_extra_bytes: 0,
            offloadable: false,
            needs_gpu: false,
        }
    }
}

/// Named weights pushed into a role (weight sync): as buckets of raw bytes, which cross
/// processes, or within one process as a snapshot of the policy's tensors.
#[derive(Debug, Clone)]
pub struct WeightsUpdate {
    /// Policy version these weights belong to.
    pub version: u64,
    /// The buckets, each a header plus raw bytes (HF names). Empty when `local` is set.
    pub buckets: Vec<yatt_engine::WeightBucket>,
    /// In-process weight sync: the policy's parameters by canonical name, a snapshot
    /// no one writes to, which models take over without copying
    /// (`Llama::adopt_weights`). Such an update cannot be sent to another process.
    pub local: Option<LocalWeights>,
    /// Weight sync between processes of one host: the weights stay in a device buffer
    /// of the policy's process, which the receiver maps through CUDA IPC. Empty
    /// `buckets` when set.
    pub device: Option<DeviceWeights>,
    /// Set when the buckets hold one rank's slice of a sharded policy's weights (each
    /// unit's shard, named `yatt.unit.I`) rather than named parameters: the receiver
    /// writes the weights once every rank's slice of the version has come.
    pub slice: Option<WeightSlice>,
}

/// Which rank's slice of a sharded policy's weights a [`WeightsUpdate`] carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct WeightSlice {
    /// The rank that sent it.
    pub rank: u32,
    /// Ranks of the replica: the slices of a version.
    pub world: u32,
}

impl WeightsUpdate {
    /// Bytes of weights the update carries (buckets' payloads, or the snapshot's
    /// tensors).
    pub fn bytes(&self) -> u64 {
        let buckets: u64 = self.buckets.iter().map(|b| b.data.len() as u64).sum();
        let local: u64 = self.local.as_ref().map_or(0, |l| {
            l.tensors()
                .iter()
                .map(|(_, t)| (t.numel() * t.kind().elt_size_in_bytes()) as u64)
                .sum()
        });
        let device: u64 = self
            .device
            .as_ref()
            .map_or(0, |d| d.entries.iter().map(|e| e.len).sum());
        buckets + local + device
    }

    /// An update carried as byte buckets.
    pub fn from_buckets(version: u64, buckets: Vec<yatt_engine::WeightBucket>) -> Self {
        WeightsUpdate {
            version,
            buckets,
            local: None,
            device: None,
            slice: None,
        }
    }
}

/// Weights packed into one device buffer of the policy's process, which the receiver
/// maps (CUDA IPC, one host) or receives (NCCL broadcast, any host).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceWeights {
    /// The tensors: names, dtypes, shapes and byte ranges in the buffer.
    pub entries: Vec<yatt_engine::BucketEntry>,
    /// How the buffer reaches the receiver.
    pub route: DeviceRoute,
}

impl DeviceWeights {
    /// Bytes of the packed buffer that hold weights: up to the end of the last tensor
    /// (what a broadcast sends).
    pub fn packed_bytes(&self) -> u64 {
        packed_end(&self.entries)
    }
}

/// Where the last of `entries`' tensors ends in their packed buffer.
pub(crate) fn packed_end(entries: &[yatt_engine::BucketEntry]) -> u64 {
    entries.iter().map(|e| e.offset + e.len).max().unwrap_or(0)
}

/// How a receiver gets the policy's packed device buffer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum DeviceRoute {
    /// It maps the buffer by its CUDA IPC handle (a process of the policy's host).
    Ipc(yatt_collective::IpcHandle),
    /// The policy broadcasts the buffer through NCCL (rank 0) to every rank of the
    /// group, which receive it into a buffer of their own.
    Broadcast(NcclGroup),
}

/// An NCCL group as one member sees it: for weight sync the policy is rank 0 and the
/// receivers the other ranks; for gradients, the policy replicas in ring order. A
/// member keeps its communicator while the id stays the same.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct NcclGroup {
    /// The group's NCCL unique id (made in rank 0's process).
    pub id: yatt_collective::UniqueId,
    /// This member's rank.
    pub rank: u32,
    /// Members in all.
    pub nranks: u32,
    /// Deadline of the group's init and of each operation, milliseconds: on expiry the
    /// communicator is aborted and the call fails naming the operation.
    pub deadline_ms: u64,
    /// Bytes broadcast per NCCL call (weight sync).
    pub bucket_bytes: u64,
}

impl NcclGroup {
    /// The group's deadline per operation.
    pub fn deadline(&self) -> std::time::Duration {
        std::time::Duration::from_millis(self.deadline_ms)
    }
}

/// A snapshot of a model's parameters (canonical names), shared by the roles of one
/// process that adopt it. Cloning shares it.
#[derive(Clone)]
pub struct LocalWeights(std::sync::Arc<std::sync::Mutex<Vec<(String, tch::Tensor)>>>);

impl LocalWeights {
    /// Wraps a snapshot (`Llama::weights_snapshot`).
    pub fn new(snapshot: Vec<(String, tch::Tensor)>) -> Self {
        LocalWeights(std::sync::Arc::new(std::sync::Mutex::new(snapshot)))
    }

    /// Handles to the snapshot's tensors (no data is copied). A `Tensor` may move
    /// between threads but not be shared, hence the lock around taking handles.
    pub fn tensors(&self) -> Vec<(String, tch::Tensor)> {
        let guard = self.0.lock().unwrap_or_else(|e| e.into_inner());
        guard
            .iter()
            .map(|(n, t)| (n.clone(), t.shallow_clone()))
            .collect()
    }
}

impl std::fmt::Debug for LocalWeights {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let n = self.0.lock().map(|g| g.len()).unwrap_or(0);
        write!(f, "LocalWeights({n} tensors)")
    }
}

/// An RLHF role. Implement it to add one; register it with a node by name.
///
/// All methods run on the role's own OS thread and may block.
pub trait Role: Send + 'static {
    /// What the role is asked.
    type Request: Send + 'static;
    /// What it answers.
    type Response: Send + 'static;

    /// The role's name, e.g. `rollout` (the role part of its actors' names).
    fn name(&self) -> &str;

    /// What it needs from a device group, for placement.
    fn profile(&self) -> ResourceProfile;

    /// Loads onto a device group. Called once before any request.
    fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError>;

    /// Serves one request.
    fn serve(&mut self, request: Self::Request) -> Result<Self::Response, RoleError>;

    /// Frees device memory while another role uses the group (full colocation).
    fn offload(&mut self) -> Result<(), RoleError> {
        Ok(())
    }

    /// Takes back device memory after [`Role::offload`].
    fn reload(&mut self) -> Result<(), RoleError> {
        Ok(())
    }

    /// Replaces weights in place (weight sync from the policy).
    fn load_weights(&mut self, _update: WeightsUpdate) -> Result<(), RoleError> {
        Err(RoleError::Unsupported {
            role: self.name().to_string(),
            operation: "load_weights",
        })
    }

    /// Finishes or aborts in-flight work before a migration; returns the ids of work
    /// items it gave up, so the controller can requeue them through the ledger.
    fn drain(&mut self) -> Result<Vec<u64>, RoleError> {
        Ok(Vec::new())
    }

    /// Releases everything; the instance is not used again.
    fn stop(&mut self) {}
}

/// What a [`RoleActor`] is asked: a request for the role, or a lifecycle step.
#[derive(Debug)]
pub enum RoleRequest<Req> {
    /// Serve a request.
    Serve(Req),
    /// Offload device memory.
    Offload,
    /// Reload after an offload.
    Reload,
    /// Replace weights.
    LoadWeights(WeightsUpdate),
    /// Drain in-flight work.
    Drain,
    /// Report the resource profile.
    Profile,
    /// Stop the role for good: its thread ends (calling [`Role::stop`]) and drops
    /// everything it held, then the actor exits. The placement actor uses it to free a
    /// group a role loses.
    Stop,
}

impl<Req> RoleRequest<Req> {
    /// The variant's name, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            RoleRequest::Serve(_) => "serve",
            RoleRequest::Offload => "offload",
            RoleRequest::Reload => "reload",
            RoleRequest::LoadWeights(_) => "load_weights",
            RoleRequest::Drain => "drain",
            RoleRequest::Profile => "profile",
            RoleRequest::Stop => "stop",
        }
    }
}

/// What a [`RoleActor`] answers.
#[derive(Debug)]
pub enum RoleResponse<Resp> {
    /// The role's answer to `Serve`.
    Served(Resp),
    /// A lifecycle step completed.
    Done,
    /// Work given up by `Drain`.
    Drained(Vec<u64>),
    /// The resource profile.
    Profile(ResourceProfile),
}

type Job<R> = (
    RoleRequest<<R as Role>::Request>,
    oneshot::Sender<Result<RoleResponse<<R as Role>::Response>, RoleError>>,
);

/// The actor around a role: it owns the role's OS thread. It claims its device group
/// ([`Actor::device_claim`]): the node that spawns it records the group with it in the
/// cluster's directory, so every node's live view shows the role as the devices' holder
/// until it stops.
pub struct RoleActor<R: Role> {
    jobs: Option<mpsc::Sender<Job<R>>>,
    thread: Option<std::thread::JoinHandle<()>>,
    claim: DeviceClaim,
}

impl<R: Role> RoleActor<R> {
    /// Starts `role` on its own thread and calls [`Role::start`] there; returns once it
    /// is started (or failed to).
    pub async fn start(role: R, group: DeviceGroup, queue: usize) -> Result<Self, RoleError> {
        let name = role.name().to_string();
        Self::build(&name, move || Ok(role), group, queue).await
    }

    /// Like [`RoleActor::start`], but builds the role on its thread first: `make` may
    /// block (a model load), and the async caller only awaits. `name` names the thread
    /// and the errors.
    pub async fn build(
        name: &str,
        make: impl FnOnce() -> Result<R, RoleError> + Send + 'static,
        group: DeviceGroup,
        queue: usize,
    ) -> Result<Self, RoleError> {
        let (jobs, mut rx) = mpsc::channel::<Job<R>>(queue.max(1));
        let claim = group.claim();
        let (started_tx, started_rx) = oneshot::channel();
        let name = name.to_string();
        let role_name = name.clone();
        let thread = std::thread::Builder::new()
            .name(format!("yatt-role-{name}"))
            .spawn(move || {
                let mut role = match make() {
                    Ok(r) => r,
                    Err(e) => {
                        let _ = started_tx.send(Err(e));
                        return;
                    }
                };
                let started = role.start(&group);
                let ok = started.is_ok();
                let _ = started_tx.send(started);
                if !ok {
                    return;
                }
                while let Some((req, reply)) = rx.blocking_recv() {
                    let (kind, t0) = (req.kind(), std::time::Instant::now());
                    let result = match req {
                        RoleRequest::Serve(r) => role.serve(r).map(RoleResponse::Served),
                        RoleRequest::Offload => role.offload().map(|_| RoleResponse::Done),
                        RoleRequest::Reload => role.reload().map(|_| RoleResponse::Done),
                        RoleRequest::LoadWeights(u) => {
                            role.load_weights(u).map(|_| RoleResponse::Done)
                        }
                        RoleRequest::Drain => role.drain().map(RoleResponse::Drained),
                        RoleRequest::Profile => Ok(RoleResponse::Profile(role.profile())),
                        // Handled by the actor, which closes the queue instead.
                        RoleRequest::Stop => Ok(RoleResponse::Done),
                    };
                    // Where a step's time goes, per role (e.g. a weight sync's load
                    // against its transfer): RUST_LOG=yatt_roles::role=debug.
                    tracing::debug!(role = %role_name, request = kind, seconds = t0.elapsed().as_secs_f64(), ok = result.is_ok(), "role request done");
                    let _ = reply.send(result);
                }
                role.stop();
                drop(role);
                // Its model and caches are freed now, but the host allocator keeps the
                // pages for reuse: a daemon would hold them until its next job.
                yatt_engine::release_host_memory();
            })
            .map_err(|e| RoleError::Failed(format!("cannot start the {name} thread: {e}")))?;
        started_rx
            .await
            .map_err(|_| RoleError::Failed(format!("{name} panicked while starting")))??;
        Ok(RoleActor {
            jobs: Some(jobs),
            thread: Some(thread),
            claim,
        })
    }
}

/// How long a dropped role actor waits for its thread to finish the request in hand.
const ROLE_EXIT_WAIT: std::time::Duration = std::time::Duration::from_secs(30);

impl<R: Role> Drop for RoleActor<R> {
    /// An actor dropped without [`Actor::stopped`] (its runtime shut down while it
    /// served, e.g. a generation whose ask had timed out) still has its thread inside the
    /// role. A process that ends under that thread crashes in libtorch's teardown
    /// (SIGSEGV after a run that stopped on a deadline), so the queue is closed and the
    /// thread given, bounded, the time to finish its request and stop the role.
    fn drop(&mut self) {
        self.jobs.take();
        let Some(t) = self.thread.take() else {
            return;
        };
        let deadline = std::time::Instant::now() + ROLE_EXIT_WAIT;
        while !t.is_finished() && std::time::Instant::now() < deadline {
            std::thread::sleep(std::time::Duration::from_millis(2));
        }
        match t.is_finished() {
            true => {
                let _ = t.join();
            }
            false => tracing::warn!(
                thread = t.thread().name().unwrap_or("?"),
                "a role thread still serves after {ROLE_EXIT_WAIT:?}; leaving it"
            ),
        }
    }
}

impl<R: Role> Actor for RoleActor<R> {
    type Request = RoleRequest<R::Request>;
    type Response = RoleResponse<R::Response>;

    async fn handle(
        &mut self,
        request: Self::Request,
        ctx: &mut Context,
    ) -> Result<Self::Response, ActorError> {
        if matches!(request, RoleRequest::Stop) {
            // Closing the queue ends the thread, which drops the role and its tensors;
            // answering only after the join means the memory is free when the asker
            // hears back.
            self.stopped().await;
            ctx.stop();
            return Ok(RoleResponse::Done);
        }
        let jobs = self
            .jobs
            .as_ref()
            .ok_or_else(|| ActorError::Unavailable("role stopped".into()))?;
        let (tx, rx) = oneshot::channel();
        jobs.send((request, tx))
            .await
            .map_err(|_| ActorError::Failed("role thread ended".into()))?;
        match rx.await {
            Ok(result) => result.map_err(ActorError::from),
            // The role panicked on its thread: this actor cannot serve any more.
            Err(_) => panic!("role thread died while serving"),
        }
    }

    async fn stopped(&mut self) {
        // Closing the queue ends the thread's loop, which then calls Role::stop.
        self.jobs.take();
        if let Some(t) = self.thread.take() {
            let _ = tokio::task::spawn_blocking(move || t.join()).await;
        }
    }

    /// Its device group, held from its start until its thread has ended (its memory
    /// freed: the actor exits only after [`Actor::stopped`] joined the thread).
    fn device_claim(&self) -> Option<DeviceClaim> {
        Some(self.claim.clone())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::{Arc, Mutex};
    use std::time::Duration;
    use yatt_runtime::ActorName;
    use yatt_runtime::{spawn, CallError};

    struct Probe {
        log: Arc<Mutex<Vec<String>>>,
        offloaded: bool,
    }

    impl Role for Probe {
        type Request = u32;
        type Response = u32;
        fn name(&self) -> &str {
            "probe"
        }
        fn profile(&self) -> ResourceProfile {
            ResourceProfile::cpu_only()
        }
        fn start(&mut self, group: &DeviceGroup) -> Result<(), RoleError> {
            self.log
                .lock()
                .unwrap()
                .push(format!("start {}", group.node));
            Ok(())
        }
        fn serve(&mut self, x: u32) -> Result<u32, RoleError> {
            if self.offloaded {
                return Err(RoleError::NotReady("offloaded".into()));
            }
            // Record which thread serves, to show it is not a runtime worker.
            let t = std::thread::current().name().unwrap_or("").to_string();
            self.log.lock().unwrap().push(t);
            Ok(x * 2)
        }
        fn offload(&mut self) -> Result<(), RoleError> {
            self.offloaded = true;
            Ok(())
        }
        fn reload(&mut self) -> Result<(), RoleError> {
            self.offloaded = false;
            Ok(())
        }
        fn stop(&mut self) {
            self.log.lock().unwrap().push("stop".into());
        }
    }

    /// Serves by working for a second (a generation, say), and records its stop.
    struct Busy {
        stopped: Arc<std::sync::atomic::AtomicBool>,
    }

    impl Role for Busy {
        type Request = u32;
        type Response = u32;
        fn name(&self) -> &str {
            "busy"
        }
        fn profile(&self) -> ResourceProfile {
            ResourceProfile::cpu_only()
        }
        fn start(&mut self, _: &DeviceGroup) -> Result<(), RoleError> {
            Ok(())
        }
        fn serve(&mut self, x: u32) -> Result<u32, RoleError> {
            let (_keep, work) = std::sync::mpsc::channel::<()>();
            let _ = work.recv_timeout(Duration::from_secs(1));
            Ok(x)
        }
        fn stop(&mut self) {
            self.stopped
                .store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }

    /// Regression: a run that stopped on a deadline left a role thread inside its
    /// request when the runtime shut down, and the process crashed in libtorch's
    /// teardown (SIGSEGV in 10 of 30 runs of the deadline job test). A dropped actor now
    /// waits for its thread to finish and stop the role.
    #[test]
    fn an_actor_dropped_mid_request_waits_for_its_thread_to_stop_the_role() {
        let stopped = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .unwrap();
        let role = Busy {
            stopped: stopped.clone(),
        };
        let a = rt.block_on(async {
            let actor = RoleActor::start(role, DeviceGroup::cpu("n0"), 4)
                .await
                .unwrap();
            let a = spawn(ActorName::new("n0", "busy", 0).unwrap(), actor, 8).actor_ref;
            let e = a
                .ask(RoleRequest::Serve(1), Duration::from_millis(5))
                .await
                .unwrap_err();
            assert!(matches!(e, CallError::Timeout { .. }), "{e:?}");
            a
        });
        // The actor's task is cancelled with the runtime while its role still serves.
        drop(rt);
        assert!(
            stopped.load(std::sync::atomic::Ordering::SeqCst),
            "the runtime shut down and left the role thread serving"
        );
        drop(a);
    }

    #[tokio::test]
    async fn role_runs_on_its_own_thread_with_lifecycle() {
        let log = Arc::new(Mutex::new(Vec::new()));
        let role = Probe {
            log: log.clone(),
            offloaded: false,
        };
        let actor = RoleActor::start(role, DeviceGroup::cpu("n0"), 4)
            .await
            .unwrap();
        let running = spawn(ActorName::new("n0", "probe", 0).unwrap(), actor, 8);
        let a = running.actor_ref;
        let t = Duration::from_secs(5);
        assert!(matches!(
            a.ask(RoleRequest::Serve(21), t).await.unwrap(),
            RoleResponse::Served(42)
        ));
        assert!(matches!(
            a.ask(RoleRequest::Offload, t).await.unwrap(),
            RoleResponse::Done
        ));
        let err = a.ask(RoleRequest::Serve(1), t).await.unwrap_err();
        assert!(
            matches!(
                err,
                CallError::Handler {
                    error: ActorError::Unavailable(_),
                    ..
                }
            ),
            "{err:?}"
        );
        a.ask(RoleRequest::Reload, t).await.unwrap();
        assert!(matches!(
            a.ask(RoleRequest::Serve(1), t).await.unwrap(),
            RoleResponse::Served(2)
        ));
        // Unsupported lifecycle steps say so.
        let err = a
            .ask(
                RoleRequest::LoadWeights(WeightsUpdate::from_buckets(1, vec![])),
                t,
            )
            .await
            .unwrap_err();
        assert!(
            err.to_string().contains("does not support load_weights"),
            "{err}"
        );
        // Refused, not failed: an asker tells a request the role does not take from a
        // failure of one it does (the controller stops asking for direct pushes only
        // then; it used to stop after any failure).
        assert!(
            matches!(
                err,
                yatt_runtime::CallError::Handler {
                    error: ActorError::BadRequest(_),
                    ..
                }
            ),
            "{err:?}"
        );
        drop(a);
        running.exit.await.unwrap();
        let log = log.lock().unwrap().clone();
        assert_eq!(log.first().map(String::as_str), Some("start n0"));
        assert!(log.iter().any(|l| l == "yatt-role-probe"), "{log:?}");
        assert_eq!(log.last().map(String::as_str), Some("stop"));
    }
}
