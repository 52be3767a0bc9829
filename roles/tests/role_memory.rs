//! A stopped role gives its host memory back to the OS.
//!
//! The binaries keep freed heap pages for reuse (`tune_host_allocator`: a decode step
//! frees and allocates many multi-megabyte activations), so a daemon whose job had
//! ended still held its roles' models and caches: about 1.8 GB on a SmolLM2 rollout
//! node, until its next job.

use yatt_engine::tch::{Device, Kind, Tensor};
use yatt_roles::{DeviceGroup, ResourceProfile, Role, RoleActor, RoleError};

/// Tensors of 8 MiB: each below a thread arena's largest heap (64 MiB), so they come
/// from the allocator's heaps and not from an mmap of their own, as a model's weights
/// and activations do.
const TENSOR_ELEMENTS: i64 = 2 << 20;
const TENSORS: usize = 64;
const MIB: i64 = 1 << 20;

/// Holds `TENSORS` touched tensors from its start to its stop.
struct Hoard {
    held: Vec<Tensor>,
}

impl Role for Hoard {
    type Request = ();
    type Response = ();

    fn name(&self) -> &str {
        "hoard"
    }

    fn profile(&self) -> ResourceProfile {
        ResourceProfile::cpu_only()
    }

    fn start(&mut self, _: &DeviceGroup) -> Result<(), RoleError> {
        self.held = (0..TENSORS)
            .map(|_| Tensor::ones([TENSOR_ELEMENTS], (Kind::Float, Device::Cpu)))
            .collect();
        Ok(())
    }

    fn serve(&mut self, _: ()) -> Result<(), RoleError> {
        Ok(())
    }
}

/// Resident bytes of this process.
fn rss() -> i64 {
    let statm = std::fs::read_to_string("/proc/self/statm").unwrap();
    let pages: i64 = statm.split_whitespace().nth(1).unwrap().parse().unwrap();
    // SAFETY: sysconf only reads a system constant.
    pages * unsafe { libc::sysconf(libc::_SC_PAGESIZE) }
}

// Regression: the freed pages stayed with the allocator after the role had stopped.
#[tokio::test(flavor = "current_thread")]
async fn a_stopped_roles_host_memory_goes_back_to_the_os() {
    yatt_engine::tune_host_allocator();
    let before = rss();
    let actor = RoleActor::start(Hoard { held: Vec::new() }, DeviceGroup::cpu("n"), 1)
        .await
        .unwrap();
    let holding = rss() - before;
    let held = TENSORS as i64 * TENSOR_ELEMENTS * 4;
    assert!(
        holding > held * 3 / 4,
        "the role holds {} MiB, expected about {} MiB",
        holding / MIB,
        held / MIB
    );
    // Dropping the actor closes its queue and waits for its thread to stop the role.
    drop(actor);
    let kept = rss() - before;
    assert!(
        kept < held / 8,
        "{} MiB of the role's {} MiB are still resident after it stopped",
        kept / MIB,
        held / MIB
    );
}
