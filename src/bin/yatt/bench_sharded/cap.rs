//! The rank processes' memory caps (a cgroup where one can be made, else RLIMIT_AS) and
//! peak resident memory, and the lead's handle on each rank process.

use anyhow::{anyhow, Context, Result};
use std::os::unix::process::CommandExt;
use std::path::PathBuf;
use std::process::{Child, Command};
use std::time::{Duration, Instant};

enum Mechanism {
    /// A cgroup v2 directory (`memory.max`).
    Cgroup2(PathBuf),
    /// A cgroup v1 memory-controller directory (`memory.limit_in_bytes`).
    Cgroup1(PathBuf),
    /// RLIMIT_AS on the process: counts address space, not resident memory, so it
    /// needs headroom for libtorch's mapped libraries.
    AddressSpace,
}

/// A memory cap for one rank process.
pub struct MemoryCap {
    how: Mechanism,
    mb: u64,
}

impl MemoryCap {
    /// A cap of `mb` MiB in a cgroup named `name` if this machine lets us make one.
    pub fn new(mb: u64, name: &str) -> Result<Self> {
        let bytes = (mb << 20).to_string();
        let v2 = PathBuf::from("/sys/fs/cgroup");
        let v1 = PathBuf::from("/sys/fs/cgroup/memory");
        let try_dir = |root: &PathBuf, file: &str| -> Option<PathBuf> {
            let d = root.join(name);
            std::fs::create_dir_all(&d).ok()?;
            match std::fs::write(d.join(file), &bytes) {
                Ok(()) => Some(d),
                Err(_) => {
                    let _ = std::fs::remove_dir(&d);
                    None
                }
            }
        };
        let controllers =
            std::fs::read_to_string(v2.join("cgroup.controllers")).unwrap_or_default();
        let how = if controllers.split_whitespace().any(|c| c == "memory") {
            try_dir(&v2, "memory.max").map(|d| {
                let _ = std::fs::write(d.join("memory.swap.max"), "0");
                Mechanism::Cgroup2(d)
            })
        } else if v1.join("memory.limit_in_bytes").exists() {
            try_dir(&v1, "memory.limit_in_bytes").map(|d| {
                // Without this the cap would let the rank swap (where swap accounting is on).
                let _ = std::fs::write(d.join("memory.memsw.limit_in_bytes"), &bytes);
                Mechanism::Cgroup1(d)
            })
        } else {
            None
        };
        Ok(MemoryCap {
            how: how.unwrap_or(Mechanism::AddressSpace),
            mb,
        })
    }

    fn name(&self) -> String {
        match &self.how {
            Mechanism::Cgroup2(d) => {
                format!("cgroup v2 memory.max of {} MiB ({})", self.mb, d.display())
            }
            Mechanism::Cgroup1(d) => format!(
                "cgroup v1 memory.limit_in_bytes of {} MiB ({})",
                self.mb,
                d.display()
            ),
            Mechanism::AddressSpace => format!("RLIMIT_AS of {} MiB", self.mb),
        }
    }

    /// Sets RLIMIT_AS in the child, where no cgroup could be made.
    pub fn before_spawn(&self, cmd: &mut Command) {
        if let Mechanism::AddressSpace = self.how {
            let bytes = self.mb << 20;
            // SAFETY: setrlimit is async-signal-safe, as pre_exec requires.
            unsafe {
                cmd.pre_exec(move || {
                    let lim = libc::rlimit {
                        rlim_cur: bytes,
                        rlim_max: bytes,
                    };
                    if libc::setrlimit(libc::RLIMIT_AS, &lim) != 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                    Ok(())
                });
            }
        }
    }

    /// Moves the child into the cgroup (before it allocates its state: it waits for
    /// the ring's members first).
    pub fn after_spawn(&self, pid: u32) -> Result<()> {
        if let Mechanism::Cgroup2(d) | Mechanism::Cgroup1(d) = &self.how {
            let f = d.join("cgroup.procs");
            std::fs::write(&f, pid.to_string())
                .with_context(|| format!("writing {}", f.display()))?;
        }
        Ok(())
    }

    /// Whether the cgroup's OOM killer fired.
    fn oom_killed(&self) -> bool {
        let count = |f: PathBuf, key: &str| -> u64 {
            std::fs::read_to_string(f)
                .unwrap_or_default()
                .lines()
                .find_map(|l| l.strip_prefix(key).and_then(|v| v.trim().parse().ok()))
                .unwrap_or(0)
        };
        match &self.how {
            Mechanism::Cgroup2(d) => count(d.join("memory.events"), "oom_kill ") > 0,
            Mechanism::Cgroup1(d) => {
                count(d.join("memory.oom_control"), "oom_kill ") > 0
                    || std::fs::read_to_string(d.join("memory.failcnt"))
                        .ok()
                        .and_then(|s| s.trim().parse::<u64>().ok())
                        .is_some_and(|n| n > 0)
            }
            Mechanism::AddressSpace => false,
        }
    }
}

impl Drop for MemoryCap {
    fn drop(&mut self) {
        if let Mechanism::Cgroup2(d) | Mechanism::Cgroup1(d) = &self.how {
            // Empty once its process has gone; the kernel may take a moment.
            for _ in 0..50 {
                if std::fs::remove_dir(d).is_ok() {
                    return;
                }
                std::thread::sleep(Duration::from_millis(20));
            }
        }
    }
}

/// A rank process. Dropped while running, it is killed: no error path leaves an orphan.
pub struct Rank {
    pub child: Child,
    pub cap: Option<MemoryCap>,
}

impl Rank {
    /// Why rank `r` ended without a result, naming the memory cap when it was that.
    pub fn died(&mut self, r: usize) -> anyhow::Error {
        let status = self.child.wait();
        let status = match status {
            Ok(s) => s,
            Err(e) => return anyhow!("rank {r}: {e}"),
        };
        use std::os::unix::process::ExitStatusExt;
        match &self.cap {
            Some(c) if c.oom_killed() || status.signal() == Some(9) => anyhow!(
                "rank {r} ran out of memory: killed ({status}) by its {}; its share of the training state does not fit (shard it over more ranks)",
                c.name()
            ),
            Some(c) => anyhow!("rank {r} ended with {status} under a {} (see its error above; an allocation failure means memory)", c.name()),
            None => anyhow!("rank {r} ended with {status} before reporting (see its error above)"),
        }
    }

    /// Closes the rank's stdin and waits for it, bounded; kills it after.
    pub fn finish(&mut self, within: Duration) {
        self.child.stdin.take();
        let until = Instant::now() + within;
        while Instant::now() < until {
            if let Ok(Some(_)) = self.child.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Drop for Rank {
    fn drop(&mut self) {
        if let Ok(None) = self.child.try_wait() {
            let _ = self.child.kill();
            let _ = self.child.wait();
        }
    }
}

/// This process's peak resident memory (VmHWM), bytes.
pub fn peak_rss_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .unwrap_or_default()
        .lines()
        .find_map(|l| l.strip_prefix("VmHWM:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse::<u64>().ok())
        .map_or(0, |kb| kb * 1024)
}
