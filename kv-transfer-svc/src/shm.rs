//! Shared memory between an executor and its node's agent: the executor's *staging region*, a
//! file in a tmpfs directory (`/dev/shm` by default) that both map. An export copies blocks
//! out of the KV pool into staging slots and tells the agent where they are; the agent sends
//! them on from there. An import names slots; the agent copies each block into its slot and
//! the executor writes them into its pool. Block bytes then never cross the loopback socket
//! between executor and agent (two kernel copies and a checksum each way saved), and the
//! slots, reused transfer after transfer, are never faulted in again.
//!
//! Ownership:
//! - the executor creates the region (`ferry-kv-<pid>-<n>`), owns its name and removes it when
//!   it ends; files of processes that no longer run are removed when the next region is made
//!   (a `kill -9` leaves one behind);
//! - a slot belongs to one transfer from [`Staging::alloc`] until its [`Slots`] drop, and the
//!   data channel drops them only after the agent answered or closed the connection, so the
//!   agent never reads or writes a slot that another transfer reuses;
//! - the agent maps only files named `ferry-kv-…` in its own shm directory, checks every
//!   offset against the file's size, and keeps a few mappings cached by name and inode.
//!
//! The region grows on demand: a slot's pages are reserved (`posix_fallocate`) when it is
//! first handed out, so a full tmpfs refuses the allocation (the transfer then takes the
//! socket) instead of faulting the process with `SIGBUS` later.

use std::collections::HashMap;
use std::os::fd::AsRawFd;
use std::os::unix::fs::{MetadataExt, OpenOptionsExt};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use memmap2::{MmapOptions, MmapRaw};

/// Default directory of staging regions.
pub const DEFAULT_DIR: &str = "/dev/shm";
/// Prefix of every region's file name.
pub const PREFIX: &str = "ferry-kv-";
/// Longest region name accepted.
pub const MAX_NAME: usize = 64;

/// An executor's staging region: `slots` slots of `block_bytes` each.
#[derive(Debug)]
pub struct Staging {
    name: String,
    path: PathBuf,
    file: std::fs::File,
    map: MmapRaw,
    block_bytes: usize,
    slots: Mutex<SlotState>,
}

#[derive(Debug)]
struct SlotState {
    /// Free slots, highest first (handed out lowest first, so the region grows in order).
    free: Vec<u32>,
    /// Slots whose pages are reserved: `0..reserved`.
    reserved: u32,
}

// SAFETY: the mapping is shared memory; `Slots` hands each slot to one owner at a time.
unsafe impl Send for Staging {}
unsafe impl Sync for Staging {}

static REGIONS: AtomicU64 = AtomicU64::new(0);

impl Staging {
    /// A new region of `slots` slots of `block_bytes` in `dir`; removes regions left behind
    /// by processes that no longer run.
    pub fn create(dir: &Path, block_bytes: usize, slots: u32) -> std::io::Result<Arc<Self>> {
        if block_bytes == 0 || slots == 0 {
            return Err(std::io::Error::other("a staging region needs slots of at least a byte"));
        }
        remove_orphans(dir);
        let n = REGIONS.fetch_add(1, Ordering::Relaxed);
        let name = format!("{PREFIX}{}-{n}", std::process::id());
        let path = dir.join(&name);
        // Readable by this user only: the agent runs as the executor's user.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&path)?;
        let len = block_bytes as u64 * u64::from(slots);
        let mapped = file.set_len(len).and_then(|()| MmapOptions::new().map_raw(&file));
        let map = match mapped {
            Ok(map) => map,
            Err(e) => {
                let _ = std::fs::remove_file(&path);
                return Err(e);
            }
        };
        let free = (0..slots).rev().collect();
        let slots = Mutex::new(SlotState { free, reserved: 0 });
        Ok(Arc::new(Self { name, path, file, map, block_bytes, slots }))
    }

    /// The region's file name (what the agent is told).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Bytes per slot.
    pub fn block_bytes(&self) -> usize {
        self.block_bytes
    }

    fn state(&self) -> std::sync::MutexGuard<'_, SlotState> {
        self.slots.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// `n` slots, or `None` when fewer are free (or their pages cannot be reserved).
    pub fn alloc(self: &Arc<Self>, n: usize) -> Option<Slots> {
        let mut st = self.state();
        if n == 0 || st.free.len() < n {
            return None;
        }
        let at = st.free.len() - n;
        let ids: Vec<u32> = st.free[at..].iter().rev().copied().collect();
        let top = ids.iter().max().copied().unwrap_or(0) + 1;
        if top > st.reserved {
            let from = u64::from(st.reserved) * self.block_bytes as u64;
            let to = u64::from(top) * self.block_bytes as u64;
            if !reserve(&self.file, from, to - from) {
                return None;
            }
            st.reserved = top;
        }
        st.free.truncate(at);
        Some(Slots { staging: self.clone(), ids })
    }

    /// Free slots.
    pub fn free_slots(&self) -> usize {
        self.state().free.len()
    }

    fn give_back(&self, ids: &[u32]) {
        let mut st = self.state();
        st.free.extend_from_slice(ids);
        st.free.sort_unstable_by(|a, b| b.cmp(a));
    }
}

impl Drop for Staging {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.path);
    }
}

/// Reserves `len` bytes of `file` from `offset`; false if the file system is full.
fn reserve(file: &std::fs::File, offset: u64, len: u64) -> bool {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return false;
    };
    // SAFETY: a plain system call on an open descriptor.
    unsafe { libc::posix_fallocate(file.as_raw_fd(), offset, len) == 0 }
}

/// Removes regions in `dir` whose process no longer runs.
fn remove_orphans(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(rest) = name.to_str().and_then(|n| n.strip_prefix(PREFIX)) else { continue };
        let Some(pid) = rest.split('-').next().and_then(|p| p.parse::<u32>().ok()) else {
            continue;
        };
        if !Path::new(&format!("/proc/{pid}")).exists() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// Slots of one transfer; back to the region when dropped.
#[derive(Debug)]
pub struct Slots {
    staging: Arc<Staging>,
    ids: Vec<u32>,
}

impl Slots {
    /// Number of slots.
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    /// Whether there are none.
    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// The region they are in.
    pub fn staging(&self) -> &Arc<Staging> {
        &self.staging
    }

    /// Byte offsets of the slots in the region, in order.
    pub fn offsets(&self) -> Vec<u64> {
        self.ids.iter().map(|&id| u64::from(id) * self.staging.block_bytes as u64).collect()
    }

    fn ptr(&self, i: usize) -> *mut u8 {
        let at = self.ids[i] as usize * self.staging.block_bytes;
        // SAFETY: `at + block_bytes` is within the mapping (ids are below `slots`).
        unsafe { self.staging.map.as_mut_ptr().add(at) }
    }

    /// Slot `i`'s bytes.
    pub fn block(&self, i: usize) -> &[u8] {
        // SAFETY: the slot is this value's alone; the agent writes it only while a read it was
        // given runs, which has ended before anyone holds `Slots` again.
        unsafe { std::slice::from_raw_parts(self.ptr(i), self.staging.block_bytes) }
    }

    /// Slot `i`'s bytes, to fill.
    pub fn block_mut(&mut self, i: usize) -> &mut [u8] {
        // SAFETY: as for `block`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr(i), self.staging.block_bytes) }
    }
}

/// Fills a transfer's slots in order while the transfer already sends the filled ones: the
/// writer side of a staged export. Slot `i` is written only before it is published (`filled`
/// passes `i`), and read only after.
#[derive(Debug)]
pub struct Filler {
    slots: Arc<Slots>,
    filled: tokio::sync::watch::Sender<usize>,
}

/// A filler for `slots`, the slots to hand to the sender, and how many are filled.
pub fn filling(slots: Slots) -> (Filler, Arc<Slots>, tokio::sync::watch::Receiver<usize>) {
    let slots = Arc::new(slots);
    let (filled, watch) = tokio::sync::watch::channel(0);
    (Filler { slots: slots.clone(), filled }, slots, watch)
}

impl Filler {
    /// Fills the next slot with `f` and publishes it; an error publishes nothing (drop the
    /// filler to end the transfer).
    pub fn fill<E>(&mut self, f: impl FnOnce(&mut [u8]) -> Result<(), E>) -> Result<(), E> {
        let i = *self.filled.borrow();
        assert!(i < self.slots.len(), "every slot is filled already");
        // SAFETY: slot `i` is not published: no reader looks at it, and this filler is its
        // only writer (it holds the one `Filler` of these slots).
        let buf = unsafe {
            std::slice::from_raw_parts_mut(self.slots.ptr(i), self.slots.staging.block_bytes)
        };
        f(buf)?;
        self.filled.send_replace(i + 1);
        Ok(())
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        self.staging.give_back(&self.ids);
    }
}

/// What was wrong with a region a client named.
#[derive(Debug, thiserror::Error)]
pub enum RegionError {
    /// Not a staging region's name.
    #[error(
        "shared region {0:?}: not a name of the form {PREFIX}… of at most {MAX_NAME} characters"
    )]
    Name(String),
    /// It could not be opened or mapped.
    #[error("shared region {name} in {dir}: {error}")]
    Open {
        /// Its name.
        name: String,
        /// The agent's directory.
        dir: String,
        /// Why.
        error: std::io::Error,
    },
    /// An offset past its end.
    #[error("shared region {name}: block at {offset} of {len} bytes runs past its {size} bytes")]
    OutOfRange {
        /// Its name.
        name: String,
        /// The offset.
        offset: u64,
        /// The block's length.
        len: usize,
        /// The region's size.
        size: usize,
    },
}

/// A region as the agent maps it.
#[derive(Debug)]
pub struct Region {
    name: String,
    map: MmapRaw,
    inode: (u64, u64),
}

// SAFETY: shared memory; the protocol gives each slot to one transfer at a time.
unsafe impl Send for Region {}
unsafe impl Sync for Region {}

impl Region {
    /// Checks that `len` bytes from `offset` lie inside the region.
    pub fn check(&self, offset: u64, len: usize) -> Result<usize, RegionError> {
        let size = self.map.len();
        match usize::try_from(offset) {
            Ok(at) if at.checked_add(len).is_some_and(|end| end <= size) => Ok(at),
            _ => Err(RegionError::OutOfRange { name: self.name.clone(), offset, len, size }),
        }
    }

    /// The `len` bytes at `offset` (checked), shared without a copy: the executor leaves them
    /// unchanged until the transfer is answered.
    pub fn bytes(self: &Arc<Self>, offset: u64, len: usize) -> Result<Bytes, RegionError> {
        let at = self.check(offset, len)?;
        Ok(Bytes::from_owner(RegionSlice { region: self.clone(), at, len }))
    }

    /// Copies `data` into the region at `offset` (checked).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        let at = self.check(offset, data.len())?;
        // SAFETY: in range; the slot is this transfer's until it is answered.
        unsafe {
            std::ptr::copy_nonoverlapping(data.as_ptr(), self.map.as_mut_ptr().add(at), data.len());
        }
        Ok(())
    }
}

struct RegionSlice {
    region: Arc<Region>,
    at: usize,
    len: usize,
}

impl AsRef<[u8]> for RegionSlice {
    fn as_ref(&self) -> &[u8] {
        // SAFETY: checked in range when made; the mapping lives as long as `region`.
        unsafe { std::slice::from_raw_parts(self.region.map.as_ptr().add(self.at), self.len) }
    }
}

/// The agent's mapped regions, by name: at most [`Regions::KEEP`], least recently used
/// dropped first (a mapping in use by a transfer lives until it ends).
#[derive(Debug)]
pub struct Regions {
    dir: PathBuf,
    mapped: Mutex<HashMap<String, (Arc<Region>, u64)>>,
    tick: AtomicU64,
}

impl Regions {
    /// Mappings kept.
    pub const KEEP: usize = 8;

    /// Regions in `dir`.
    pub fn new(dir: PathBuf) -> Self {
        Self { dir, mapped: Mutex::new(HashMap::new()), tick: AtomicU64::new(0) }
    }

    /// Region `name`, mapped (again if its file changed since).
    pub fn get(&self, name: &str) -> Result<Arc<Region>, RegionError> {
        let valid = name.len() <= MAX_NAME
            && name.strip_prefix(PREFIX).is_some_and(|rest| {
                !rest.is_empty() && rest.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'-')
            });
        if !valid {
            return Err(RegionError::Name(name.to_string()));
        }
        let open_error = |error| RegionError::Open {
            name: name.to_string(),
            dir: self.dir.display().to_string(),
            error,
        };
        let path = self.dir.join(name);
        let meta = std::fs::metadata(&path).map_err(open_error)?;
        let inode = (meta.dev(), meta.ino());
        let tick = self.tick.fetch_add(1, Ordering::Relaxed);
        let mut mapped = self.mapped.lock().unwrap_or_else(std::sync::PoisonError::into_inner);
        if let Some((region, used)) = mapped.get_mut(name) {
            if region.inode == inode && region.map.len() as u64 == meta.len() {
                *used = tick;
                return Ok(region.clone());
            }
        }
        let file = std::fs::OpenOptions::new().read(true).write(true).open(&path);
        let map = file.and_then(|f| MmapOptions::new().map_raw(&f)).map_err(open_error)?;
        let region = Arc::new(Region { name: name.to_string(), map, inode });
        mapped.insert(name.to_string(), (region.clone(), tick));
        while mapped.len() > Self::KEEP {
            let oldest = mapped.iter().min_by_key(|(_, (_, used))| *used).map(|(n, _)| n.clone());
            if let Some(n) = oldest {
                mapped.remove(&n);
            }
        }
        Ok(region)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_written_by_one_side_are_read_by_the_other_and_recycled() {
        let dir = tempdir();
        let staging = Staging::create(&dir, 4096, 4).unwrap();
        let regions = Regions::new(dir.clone());
        let mut slots = staging.alloc(3).unwrap();
        assert_eq!(slots.offsets(), vec![0, 4096, 8192], "lowest slots first");
        assert!(staging.alloc(2).is_none(), "one slot left");
        slots.block_mut(1).fill(7);
        let region = regions.get(staging.name()).unwrap();
        assert_eq!(&region.bytes(4096, 4096).unwrap()[..], &[7u8; 4096][..]);
        region.write(8192, &[9u8; 4096]).unwrap();
        assert_eq!(slots.block(2), &[9u8; 4096][..]);
        assert!(matches!(
            region.write(4 * 4096 - 1, &[0u8; 2]),
            Err(RegionError::OutOfRange { .. })
        ));
        drop(slots);
        assert_eq!(staging.free_slots(), 4);
        assert_eq!(staging.alloc(4).unwrap().offsets().len(), 4);
        // Only regions' names are mapped.
        for bad in ["../etc/passwd", "ferry-kv-", "other", "ferry-kv-a/b"] {
            assert!(matches!(regions.get(bad), Err(RegionError::Name(_))), "{bad}");
        }
        let path = dir.join(staging.name());
        drop(staging);
        assert!(!path.exists(), "the region's file goes with it");
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_dead_process_region_is_removed_when_the_next_is_made() {
        let dir = tempdir();
        // Pids are below 2^22 on Linux: this one runs nowhere.
        let orphan = dir.join(format!("{PREFIX}4294967295-0"));
        std::fs::write(&orphan, b"left behind").unwrap();
        let mine = Staging::create(&dir, 64, 1).unwrap();
        assert!(!orphan.exists());
        assert!(dir.join(mine.name()).exists());
        drop(mine);
        let _ = std::fs::remove_dir_all(dir);
    }

    fn tempdir() -> PathBuf {
        static N: AtomicU64 = AtomicU64::new(0);
        let dir = std::env::temp_dir().join(format!(
            "ferry-shm-test-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        std::fs::create_dir_all(&dir).unwrap();
        dir
    }
}
