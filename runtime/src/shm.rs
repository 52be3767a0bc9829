//! The same-host fast path for bulk payloads: reusable shared-memory segments.
//!
//! Creating, faulting in and freeing a fresh 64 MiB tmpfs file per message costs more
//! than copying the bytes, so segments are reused:
//!
//! - the **sender** keeps a [`SegmentPool`] of files in `/dev/shm`, each mapped once;
//!   it copies a payload into a free segment and sends only its name, length and id;
//! - the **receiver** maps each segment once ([`MappingCache`]) and hands out
//!   zero-copy [`Bytes`] over it; when the last of those drops, a release (the segment
//!   id) goes back to the sender, which may then reuse the segment.
//!
//! A segment is never written while its release is outstanding. A pool that is full
//! (a receiver holds many payloads) makes the transport fall back to sending inline.

use std::collections::HashMap;
use std::fs::OpenOptions;
use std::os::unix::fs::OpenOptionsExt;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use bytes::Bytes;
use memmap2::{Mmap, MmapMut, MmapOptions};
use tokio::sync::mpsc;

/// Smallest segment created; payloads are rounded up to a power of two above it.
const MIN_SEGMENT: usize = 1 << 20;

struct Segment {
    id: u64,
    path: PathBuf,
    map: MmapMut,
    busy: bool,
    /// When it was last released (or created).
    idle_since: Instant,
}

/// A lease on a segment: write the payload through [`Lease::as_mut`], then send
/// `(id, path, len)`. Dropping a lease that was not sent frees the segment.
pub(crate) struct Lease {
    pool: Arc<SegmentPool>,
    /// The segment's id.
    pub id: u64,
    /// The segment's file.
    pub path: PathBuf,
    ptr: *mut u8,
    len: usize,
    sent: bool,
}

// SAFETY: the pointer is into a mapping owned by the pool, which outlives the lease
// (the lease holds an Arc to it) and is not handed to anyone else while leased.
unsafe impl Send for Lease {}

impl Lease {
    /// The bytes to fill.
    pub fn as_mut(&mut self) -> &mut [u8] {
        // SAFETY: ptr/len describe the leased segment's mapping (see the Send impl).
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// Marks the lease as sent: the segment stays busy until the receiver releases it.
    pub fn sent(mut self) {
        self.sent = true;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        if !self.sent {
            self.pool.release(self.id);
        }
    }
}

/// The sender's segments.
pub(crate) struct SegmentPool {
    dir: PathBuf,
    prefix: String,
    max_bytes: usize,
    state: Mutex<PoolState>,
}

#[derive(Default)]
struct PoolState {
    segments: Vec<Segment>,
    next_id: u64,
    bytes: usize,
}

impl SegmentPool {
    /// A pool creating files `<dir>/<prefix>-<id>`, at most `max_bytes` in all.
    pub fn new(dir: &Path, prefix: String, max_bytes: usize) -> Arc<Self> {
        Arc::new(SegmentPool {
            dir: dir.to_path_buf(),
            prefix,
            max_bytes,
            state: Mutex::new(PoolState::default()),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, PoolState> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Leases a free segment of at least `len` bytes, creating one if the pool has
    /// room; `None` when it is full.
    pub fn lease(self: &Arc<Self>, len: usize) -> std::io::Result<Option<Lease>> {
        let mut st = self.lock();
        let found = st
            .segments
            .iter_mut()
            .filter(|s| !s.busy && s.map.len() >= len)
            .min_by_key(|s| s.map.len());
        let seg = match found {
            Some(seg) => seg,
            None => {
                let size = len.max(MIN_SEGMENT).next_power_of_two();
                if st.bytes + size > self.max_bytes {
                    // Make room by dropping idle segments that are too small.
                    let idle: usize = st
                        .segments
                        .iter()
                        .filter(|s| !s.busy)
                        .map(|s| s.map.len())
                        .sum();
                    if st.bytes - idle + size > self.max_bytes {
                        return Ok(None);
                    }
                    for s in st.segments.iter().filter(|s| !s.busy) {
                        let _ = std::fs::remove_file(&s.path);
                    }
                    st.segments.retain(|s| s.busy);
                    st.bytes = st.segments.iter().map(|s| s.map.len()).sum();
                }
                st.next_id += 1;
                let id = st.next_id;
                let path = self.dir.join(format!("{}-{id}", self.prefix));
                let file = OpenOptions::new()
                    .read(true)
                    .write(true)
                    .create_new(true)
                    .mode(0o600)
                    .open(&path)?;
                file.set_len(size as u64)?;
                // SAFETY: a file we just created, private to this process until its
                // name is sent; the receiver maps it read-only.
                let map = unsafe { MmapOptions::new().populate().map_mut(&file)? };
                st.bytes += size;
                st.segments.push(Segment {
                    id,
                    path,
                    map,
                    busy: false,
                    idle_since: Instant::now(),
                });
                st.segments.last_mut().expect("just pushed")
            }
        };
        seg.busy = true;
        Ok(Some(Lease {
            pool: self.clone(),
            id: seg.id,
            path: seg.path.clone(),
            ptr: seg.map.as_mut_ptr(),
            len,
            sent: false,
        }))
    }

    /// The receiver is done with a segment.
    pub fn release(&self, id: u64) {
        if let Some(s) = self.lock().segments.iter_mut().find(|s| s.id == id) {
            s.busy = false;
            s.idle_since = Instant::now();
        }
    }

    /// Removes the segments unused for `idle` or longer at `now` (their files and this
    /// side's mappings), so a process that has stopped sending does not keep them;
    /// answers the bytes removed.
    pub fn release_idle(&self, idle: Duration, now: Instant) -> usize {
        let mut st = self.lock();
        let before = st.bytes;
        st.segments.retain(|s| {
            let keep = s.busy || now.saturating_duration_since(s.idle_since) < idle;
            if !keep {
                let _ = std::fs::remove_file(&s.path);
            }
            keep
        });
        st.bytes = st.segments.iter().map(|s| s.map.len()).sum();
        before - st.bytes
    }

    /// Segments leased and not yet released.
    #[cfg(test)]
    pub fn busy(&self) -> usize {
        self.lock().segments.iter().filter(|s| s.busy).count()
    }
}

impl SegmentPool {
    /// Removes every segment's file (shutdown). Receivers keep mappings they hold.
    pub fn remove_all(&self) {
        let mut st = self.lock();
        for s in &st.segments {
            let _ = std::fs::remove_file(&s.path);
        }
        st.segments.clear();
        st.bytes = 0;
    }
}

impl Drop for SegmentPool {
    fn drop(&mut self) {
        self.remove_all();
    }
}

/// Removes segment files left by processes of `node` that no longer run (killed).
pub(crate) fn remove_stale(dir: &Path, node: &str) {
    let Ok(entries) = std::fs::read_dir(dir) else {
        return;
    };
    let prefix = format!("yatt-{node}-");
    for e in entries.flatten() {
        let name = e.file_name().to_string_lossy().into_owned();
        let Some(rest) = name.strip_prefix(&prefix) else {
            continue;
        };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(e.path());
        }
    }
}

struct Slice {
    map: Arc<Mmap>,
    len: usize,
    id: u64,
    release: mpsc::UnboundedSender<u64>,
}

impl AsRef<[u8]> for Slice {
    fn as_ref(&self) -> &[u8] {
        &self.map[..self.len]
    }
}

impl Drop for Slice {
    fn drop(&mut self) {
        // The sender may reuse the segment now. If the connection is gone, so is the
        // sender's interest.
        let _ = self.release.send(self.id);
    }
}

/// The receiver's mappings of one peer's segments, each with when it was last used.
pub(crate) struct MappingCache {
    maps: Mutex<HashMap<PathBuf, (Arc<Mmap>, Instant)>>,
    release: mpsc::UnboundedSender<u64>,
}

impl MappingCache {
    /// A cache whose payloads report their release on `release`.
    pub fn new(release: mpsc::UnboundedSender<u64>) -> Self {
        MappingCache {
            maps: Mutex::new(HashMap::new()),
            release,
        }
    }

    /// Zero-copy bytes `[0, len)` of segment `id` at `path`, mapped on first use.
    pub fn bytes(&self, path: &Path, id: u64, len: usize) -> std::io::Result<Bytes> {
        let map = {
            let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
            match maps.get_mut(path) {
                Some((m, used)) if m.len() >= len => {
                    *used = Instant::now();
                    m.clone()
                }
                _ => {
                    let file = std::fs::File::open(path)?;
                    // SAFETY: the sender writes a segment only while it holds no
                    // outstanding release for it, i.e. while no Bytes over it exist here.
                    let m = Arc::new(unsafe { MmapOptions::new().populate().map(&file)? });
                    maps.insert(path.to_path_buf(), (m.clone(), Instant::now()));
                    m
                }
            }
        };
        if len > map.len() {
            return Err(std::io::Error::new(
                std::io::ErrorKind::InvalidData,
                format!(
                    "segment {} holds {} bytes, {} announced",
                    path.display(),
                    map.len(),
                    len
                ),
            ));
        }
        Ok(Bytes::from_owner(Slice {
            map,
            len,
            id,
            release: self.release.clone(),
        }))
    }

    /// Unmaps the segments no payload uses that were last used `idle` or longer before
    /// `now`: a sender's removed segment keeps its memory while a mapping holds it.
    pub fn release_idle(&self, idle: Duration, now: Instant) {
        let mut maps = self.maps.lock().unwrap_or_else(|p| p.into_inner());
        maps.retain(|_, (m, used)| {
            Arc::strong_count(m) > 1 || now.saturating_duration_since(*used) < idle
        });
    }

    /// Segments mapped.
    #[cfg(test)]
    fn mapped(&self) -> usize {
        self.maps.lock().unwrap_or_else(|p| p.into_inner()).len()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn segments_are_reused_only_after_release() {
        let dir = tempfile::tempdir().unwrap();
        let pool = SegmentPool::new(
            dir.path(),
            format!("yatt-test-{}", std::process::id()),
            8 << 20,
        );
        let (tx, mut rx) = mpsc::unbounded_channel();
        let cache = MappingCache::new(tx);

        let mut a = pool.lease(3000).unwrap().unwrap();
        a.as_mut().fill(7);
        let (id_a, path_a) = (a.id, a.path.clone());
        a.sent();
        let got = cache.bytes(&path_a, id_a, 3000).unwrap();
        assert!(got.iter().all(|b| *b == 7) && got.len() == 3000);

        // While `got` lives, the segment is busy: a second lease gets another one.
        let b = pool.lease(10).unwrap().unwrap();
        assert_ne!(b.id, id_a);
        drop(b); // unsent: freed at once
        assert_eq!(pool.busy(), 1);

        drop(got);
        let released = rx.try_recv().unwrap();
        assert_eq!(released, id_a);
        pool.release(released);
        assert_eq!(pool.busy(), 0);
        let again = pool.lease(100).unwrap().unwrap();
        assert!(again.id == id_a || again.id == id_a + 1);
    }

    #[test]
    fn segments_unused_for_the_idle_time_are_removed_and_unmapped() {
        let dir = tempfile::tempdir().unwrap();
        let pool = SegmentPool::new(dir.path(), "yatt-idle".into(), 8 << 20);
        let (tx, _rx) = mpsc::unbounded_channel();
        let cache = MappingCache::new(tx);
        let idle = Duration::from_secs(30);
        let a = pool.lease(100).unwrap().unwrap();
        let (id, path) = (a.id, a.path.clone());
        a.sent();
        let got = cache.bytes(&path, id, 100).unwrap();
        // In use on both sides: kept however long.
        let late = Instant::now() + Duration::from_secs(3600);
        assert_eq!(pool.release_idle(idle, late), 0);
        cache.release_idle(idle, late);
        assert_eq!(cache.mapped(), 1);
        drop(got);
        pool.release(id);
        let released = Instant::now();
        // Released a moment ago: kept for the next payload.
        assert_eq!(
            pool.release_idle(idle, released + Duration::from_secs(29)),
            0
        );
        cache.release_idle(idle, released + Duration::from_secs(29));
        assert_eq!(cache.mapped(), 1);
        assert!(path.exists());
        // Idle for the idle time: the file and both mappings go.
        let later = Instant::now() + idle;
        assert_eq!(pool.release_idle(idle, later), MIN_SEGMENT);
        cache.release_idle(idle, later);
        assert_eq!(cache.mapped(), 0);
        assert!(!path.exists());
        // The pool makes a new one when asked.
        assert!(pool.lease(100).unwrap().is_some());
    }

    #[test]
    fn a_full_pool_says_so() {
        let dir = tempfile::tempdir().unwrap();
        let pool = SegmentPool::new(dir.path(), "yatt-full".into(), 2 << 20);
        let a = pool.lease(1 << 20).unwrap().unwrap();
        a.sent();
        let b = pool.lease(1 << 20).unwrap().unwrap();
        b.sent();
        assert!(pool.lease(1 << 20).unwrap().is_none());
        pool.release(1);
        assert!(pool.lease(1 << 20).unwrap().is_some());
    }

    #[test]
    fn announced_length_beyond_the_segment_is_refused() {
        let dir = tempfile::tempdir().unwrap();
        let pool = SegmentPool::new(dir.path(), "yatt-len".into(), 4 << 20);
        let a = pool.lease(10).unwrap().unwrap();
        let (tx, _rx) = mpsc::unbounded_channel();
        let cache = MappingCache::new(tx);
        assert!(cache.bytes(&a.path, a.id, 2 << 20).is_err());
    }
}
