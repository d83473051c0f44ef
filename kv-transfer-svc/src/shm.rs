//! Shared memory between an executor and its node's agent: the executor's *staging region*, a
//! file in a tmpfs directory (`/dev/shm` by default) that both map. An export copies blocks
//! out of the KV pool into staging slots and tells the agent where they are; the agent sends
//! them on from there. An import names slots; the agent copies each block into its slot and
//! the executor writes them into its pool. Block bytes then never cross the loopback socket
//! between executor and agent (two kernel copies and a checksum each way saved), and the
//! slots, reused transfer after transfer, are never faulted in again.
//!
//! Ownership:
//! - the executor creates the region (`ferry-kv-<pid>-<n>-<random>`), owns its name, holds
//!   an `flock` on it while it runs and removes it when it ends; files whose lock nobody holds
//!   (a `kill -9` leaves one behind) are removed when the next region is made — by the lock,
//!   not the pid, so that an executor and its agent in different PID namespaces do not take
//!   each other's regions for orphans;
//! - a slot belongs to one transfer from [`Staging::alloc`] until its [`Slots`] drop, and the
//!   data channel drops them only after the agent answered or closed the connection, so the
//!   agent never reads or writes a slot that another transfer reuses;
//! - the agent maps only files named `ferry-kv-…` in its own shm directory, checks every
//!   offset against the file's size, and keeps a few mappings cached by name and inode.
//!
//! The agent keeps the blocks it receives in regions of its own (named and locked alike,
//! one per block length, see [`crate::buffers`]); an executor maps those read-only and copies
//! an imported block straight from the agent's store into its pool. The agent keeps such a
//! block (not just its name: the very buffer) until the executor closes the read's
//! connection, so it is never reused while the executor may still read it.
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

/// A region of `slots` slots of `block_bytes` each that this process made: an executor's
/// staging region, or an agent's store buffers of one length.
#[derive(Debug)]
pub struct Staging {
    name: String,
    path: PathBuf,
    file: std::fs::File,
    map: MmapRaw,
    block_bytes: usize,
    slots: Mutex<SlotState>,
    /// The agent's regions, mapped read-only as this executor reads blocks from them.
    peers: Regions,
    /// Blocks `0..pool_blocks` are an executor's KV pool (see [`Staging::create_with_pool`]);
    /// the staging slots follow them.
    pool_blocks: u32,
}

#[derive(Debug)]
struct SlotState {
    /// Free slots, the lowest on top (handed out first, so the region grows in order).
    free: std::collections::BinaryHeap<std::cmp::Reverse<u32>>,
    /// Slots whose pages are reserved: `0..reserved`.
    reserved: u32,
}

// SAFETY: the mapping is shared memory; `Slots` hands each slot to one owner at a time.
unsafe impl Send for Staging {}
unsafe impl Sync for Staging {}

static REGIONS: AtomicU64 = AtomicU64::new(0);

impl Staging {
    /// A new region of `slots` slots of `block_bytes` in `dir`, locked for as long as this
    /// process runs; removes regions left behind by processes that no longer run.
    pub fn create(dir: &Path, block_bytes: usize, slots: u32) -> std::io::Result<Arc<Self>> {
        Self::make(dir, block_bytes, 0, slots)
    }

    /// A region whose first `pool_blocks` blocks are an executor's KV pool, reserved now
    /// (an error when the tmpfs has no room for them), followed by `slots` staging slots; and
    /// the pool's memory, for the executor's KV cache. An export then names the pool's blocks
    /// to the agent ([`Staging::pool_slots`]) instead of copying them into slots first.
    pub fn create_with_pool(
        dir: &Path,
        block_bytes: usize,
        pool_blocks: u32,
        slots: u32,
    ) -> std::io::Result<(Arc<Self>, PoolMemory)> {
        let region = Self::make(dir, block_bytes, pool_blocks, slots)?;
        let (ptr, len) = (region.map.as_mut_ptr(), pool_blocks as usize * block_bytes);
        Ok((region.clone(), PoolMemory { _region: region, ptr, len }))
    }

    fn make(
        dir: &Path,
        block_bytes: usize,
        pool_blocks: u32,
        slots: u32,
    ) -> std::io::Result<Arc<Self>> {
        if block_bytes == 0 || slots == 0 {
            return Err(std::io::Error::other("a staging region needs slots of at least a byte"));
        }
        remove_orphans(dir);
        let n = REGIONS.fetch_add(1, Ordering::Relaxed);
        // Unique across PID namespaces too: processes of two containers may share a pid.
        let name = format!("{PREFIX}{}-{n}-{:016x}", std::process::id(), random());
        let path = dir.join(&name);
        // Made under a name no one looks for, locked, then renamed into place: a region is
        // never seen unlocked while its maker runs (see `remove_orphans`).
        let making = dir.join(format!("{MAKING}{name}"));
        // Readable by this user only: the agent runs as the executor's user.
        let file = std::fs::OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .mode(0o600)
            .open(&making)?;
        let total = pool_blocks.checked_add(slots).ok_or_else(|| {
            std::io::Error::other(format!("{pool_blocks} pool blocks and {slots} slots overflow"))
        })?;
        let len = block_bytes as u64 * u64::from(total);
        let pool_len = block_bytes as u64 * u64::from(pool_blocks);
        let made = lock(&file)
            .and_then(|()| file.set_len(len))
            .and_then(|()| {
                if pool_len == 0 || reserve(&file, 0, pool_len) {
                    Ok(())
                } else {
                    Err(std::io::Error::other(format!(
                        "no room in {} for a KV pool of {} MiB",
                        dir.display(),
                        pool_len >> 20
                    )))
                }
            })
            .and_then(|()| MmapOptions::new().map_raw(&file))
            .and_then(|map| std::fs::rename(&making, &path).map(|()| map));
        let map = match made {
            Ok(map) => map,
            Err(e) => {
                let _ = std::fs::remove_file(&making);
                return Err(e);
            }
        };
        let free = (pool_blocks..total).map(std::cmp::Reverse).collect();
        let slots = Mutex::new(SlotState { free, reserved: pool_blocks });
        let peers = Regions::read_only(dir.to_path_buf());
        Ok(Arc::new(Self { name, path, file, map, block_bytes, slots, peers, pool_blocks }))
    }

    /// Pool blocks `ids` as the slots of a transfer: an export sends them from the pool where
    /// they are. They stay the pool's (nothing is given back when the slots drop); the
    /// scheduler keeps an exported block unchanged until the export is reported, and the
    /// checksums published with each block let the receiver refuse one changed meanwhile (a
    /// transfer cut short by a session reset). `None` if one is not a pool block.
    pub fn pool_slots(self: &Arc<Self>, ids: &[u32]) -> Option<Slots> {
        if ids.is_empty() || ids.iter().any(|&b| b >= self.pool_blocks) {
            return None;
        }
        Some(Slots { staging: self.clone(), ids: ids.to_vec(), pooled: true })
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
        // The lowest free slots: the region's pages stay at the high-water mark of its use.
        let ids: Vec<u32> = (0..n).filter_map(|_| st.free.pop().map(|r| r.0)).collect();
        let top = ids.last().copied().unwrap_or(0) + 1;
        if top > st.reserved {
            let from = u64::from(st.reserved) * self.block_bytes as u64;
            let to = u64::from(top) * self.block_bytes as u64;
            if !reserve(&self.file, from, to - from) {
                st.free.extend(ids.into_iter().map(std::cmp::Reverse));
                return None;
            }
            st.reserved = top;
        }
        Some(Slots { staging: self.clone(), ids, pooled: false })
    }

    /// Regions of the agent's, in this region's directory, mapped read-only: where a staged
    /// read's shared blocks are.
    pub fn peers(&self) -> &Regions {
        &self.peers
    }

    /// The offset of the slot `data` is, if it is exactly one of this region's slots.
    pub fn locate(&self, data: &[u8]) -> Option<u64> {
        let (base, at) = (self.map.as_ptr() as usize, data.as_ptr() as usize);
        let offset = at.checked_sub(base)?;
        let whole = data.len() == self.block_bytes && offset % self.block_bytes == 0;
        (whole && offset + data.len() <= self.map.len()).then_some(offset as u64)
    }

    /// Free slots.
    pub fn free_slots(&self) -> usize {
        self.state().free.len()
    }

    fn give_back(&self, ids: &[u32]) {
        let mut st = self.state();
        st.free.extend(ids.iter().copied().map(std::cmp::Reverse));
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

/// Prefix of a region's file while it is made.
const MAKING: &str = ".making-";

/// Takes the lock a region's maker holds on its file for as long as it runs (`flock`, which
/// the kernel drops when the process ends, however it ends); fails if another holds it.
fn lock(file: &std::fs::File) -> std::io::Result<()> {
    // SAFETY: a plain system call on an open descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Eight random bytes from the kernel (zero if it has none to give).
fn random() -> u64 {
    let mut buf = [0u8; 8];
    // SAFETY: writes at most `buf.len()` bytes into `buf`.
    let _ = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    u64::from_ne_bytes(buf)
}

/// Removes regions in `dir` that no running process made: those whose lock nobody holds.
/// The lock, not the pid in the name, tells: an executor and its agent in different PID
/// namespaces (two containers of a pod) cannot see each other's pids.
fn remove_orphans(dir: &Path) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for entry in entries.flatten() {
        let name = entry.file_name();
        let Some(name) = name.to_str() else { continue };
        if !name.strip_prefix(MAKING).unwrap_or(name).starts_with(PREFIX) {
            continue;
        }
        // Another user's file cannot be opened here, and is not this user's to remove.
        let Ok(file) = std::fs::File::open(entry.path()) else { continue };
        if lock(&file).is_ok() {
            let _ = std::fs::remove_file(entry.path());
        }
    }
}

/// An executor's KV pool in its region: the memory its KV cache lives in, shared with the
/// agent, which reads the blocks an export names straight from it.
#[derive(Debug)]
pub struct PoolMemory {
    /// Keeps the mapping.
    _region: Arc<Staging>,
    ptr: *mut u8,
    len: usize,
}

// SAFETY: a region's pool is handed out once, when it is made; `&`/`&mut` access follows
// Rust's rules through it.
unsafe impl Send for PoolMemory {}
unsafe impl Sync for PoolMemory {}

impl PoolMemory {
    /// The pool's bytes (page-aligned, `blocks × block_bytes` long).
    pub fn bytes(&self) -> &[u8] {
        // SAFETY: the mapping lives as long as `region`; only this value hands out references
        // to it in this process (the agent reads it from its own mapping).
        unsafe { std::slice::from_raw_parts(self.ptr, self.len) }
    }

    /// The pool's bytes, to write.
    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: as for `bytes`, and `&mut self` makes this the only reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }

    /// The pool as f32 values (a KV cache of f32 keys and values).
    pub fn floats(&self) -> &[f32] {
        // SAFETY: as for `bytes`; the mapping is page-aligned and any bit pattern is an f32.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len / 4) }
    }

    /// The pool as f32 values, to write.
    pub fn floats_mut(&mut self) -> &mut [f32] {
        // SAFETY: as for `floats`, through the only mutable reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast(), self.len / 4) }
    }

    /// The pool as 16-bit values (a KV cache of f16 keys and values).
    pub fn halves(&self) -> &[u16] {
        // SAFETY: as for `floats`; any bit pattern is a u16.
        unsafe { std::slice::from_raw_parts(self.ptr.cast(), self.len / 2) }
    }

    /// The pool as 16-bit values, to write.
    pub fn halves_mut(&mut self) -> &mut [u16] {
        // SAFETY: as for `halves`, through the only mutable reference.
        unsafe { std::slice::from_raw_parts_mut(self.ptr.cast(), self.len / 2) }
    }
}

/// Slots of one transfer; back to the region when dropped (unless they are pool blocks).
#[derive(Debug)]
pub struct Slots {
    staging: Arc<Staging>,
    ids: Vec<u32>,
    /// Pool blocks ([`Staging::pool_slots`]), never the free list's.
    pooled: bool,
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

/// Where a staged read left a block: in the reader's own slot, or in the agent's store (a slot
/// of one of the agent's regions, mapped read-only here) to be copied from there. The agent
/// keeps a stored block unchanged until the read's connection closes.
#[derive(Clone, Debug)]
pub enum Place {
    /// In the reader's slot of the block's index.
    Slot,
    /// In the agent's region, at `offset`.
    Store {
        /// The agent's region.
        region: Arc<Region>,
        /// The block's offset in it.
        offset: u64,
    },
}

impl Place {
    /// Block `i`'s bytes (of `slots`, or the agent's copy, checked against its region's size).
    pub fn bytes<'a>(&'a self, slots: &'a Slots, i: usize) -> Result<&'a [u8], RegionError> {
        match self {
            Self::Slot => Ok(slots.block(i)),
            Self::Store { region, offset } => region.slice(*offset, slots.staging.block_bytes),
        }
    }
}

/// Fills a transfer's slots in order while the transfer already sends the filled ones: the
/// writer side of a staged export. Slot `i` is written only before it is published (`filled`
/// passes `i`), and read only after. Each slot's chunk checksums are computed as it is filled,
/// while its bytes are in cache, and published with it.
#[derive(Debug)]
pub struct Filler {
    slots: Arc<Slots>,
    filled: tokio::sync::watch::Sender<Vec<Vec<u32>>>,
}

/// The filled slots of a staged export, in order: each one's chunk checksums (the CRC32C of
/// each piece [`crate::frames::chunks`] cuts the block into).
pub type Filled = tokio::sync::watch::Receiver<Vec<Vec<u32>>>;

/// A filler for `slots`, the slots to hand to the sender, and what is filled.
pub fn filling(slots: Slots) -> (Filler, Arc<Slots>, Filled) {
    let slots = Arc::new(slots);
    let (filled, watch) = tokio::sync::watch::channel(Vec::new());
    (Filler { slots: slots.clone(), filled }, slots, watch)
}

impl Filler {
    /// Fills the next slot with `f` and publishes it; an error publishes nothing (drop the
    /// filler to end the transfer).
    pub fn fill<E>(&mut self, f: impl FnOnce(&mut [u8]) -> Result<(), E>) -> Result<(), E> {
        let i = self.filled.borrow().len();
        assert!(i < self.slots.len(), "every slot is filled already");
        // SAFETY: slot `i` is not published: no reader looks at it, and this filler is its
        // only writer (it holds the one `Filler` of these slots).
        let buf = unsafe {
            std::slice::from_raw_parts_mut(self.slots.ptr(i), self.slots.staging.block_bytes)
        };
        f(buf)?;
        let crcs = crate::frames::chunk_crcs(buf).collect();
        self.filled.send_modify(|filled| filled.push(crcs));
        Ok(())
    }

    /// Publishes the next slot as it is (a pool block, already holding its bytes), with its
    /// checksums computed now.
    pub fn publish_in_place(&mut self) {
        let unchanged: Result<(), std::convert::Infallible> = self.fill(|_| Ok(()));
        let Ok(()) = unchanged;
    }
}

impl Drop for Slots {
    fn drop(&mut self) {
        if !self.pooled {
            self.staging.give_back(&self.ids);
        }
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
    /// A write into a region mapped to be read only.
    #[error("shared region {0} is mapped read-only here")]
    ReadOnly(String),
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

/// A region of another process's, as this one maps it: an executor's staging region as its
/// agent maps it (read and write), or an agent's store region as an executor maps it (read
/// only).
#[derive(Debug)]
pub struct Region {
    name: String,
    map: MmapRaw,
    inode: (u64, u64),
    read_only: bool,
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

    /// The `len` bytes at `offset` (checked), borrowed: the owner leaves them unchanged while
    /// the protocol gives them to this reader.
    pub fn slice(&self, offset: u64, len: usize) -> Result<&[u8], RegionError> {
        let at = self.check(offset, len)?;
        // SAFETY: in range; the mapping lives as long as `self`.
        Ok(unsafe { std::slice::from_raw_parts(self.map.as_ptr().add(at), len) })
    }

    /// Copies `data` into the region at `offset` (checked).
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        if self.read_only {
            return Err(RegionError::ReadOnly(self.name.clone()));
        }
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

/// Another process's regions mapped by this one, by name: at most [`Regions::KEEP`], least
/// recently used dropped first (a mapping in use by a transfer lives until it ends).
#[derive(Debug)]
pub struct Regions {
    dir: PathBuf,
    mapped: Mutex<HashMap<String, (Arc<Region>, u64)>>,
    tick: AtomicU64,
    read_only: bool,
}

impl Regions {
    /// Mappings kept.
    pub const KEEP: usize = 8;

    /// Regions in `dir`, mapped to be read and written (the agent's view of staging regions).
    pub fn new(dir: PathBuf) -> Self {
        Self { dir, mapped: Mutex::new(HashMap::new()), tick: AtomicU64::new(0), read_only: false }
    }

    /// Regions in `dir`, mapped to be read only (an executor's view of its agent's store).
    pub fn read_only(dir: PathBuf) -> Self {
        Self { read_only: true, ..Self::new(dir) }
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
        let file = std::fs::OpenOptions::new().read(true).write(!self.read_only).open(&path);
        let map = file
            .and_then(|f| {
                if self.read_only {
                    MmapOptions::new().map_raw_read_only(&f)
                } else {
                    MmapOptions::new().map_raw(&f)
                }
            })
            .map_err(open_error)?;
        let read_only = self.read_only;
        let region = Arc::new(Region { name: name.to_string(), map, inode, read_only });
        // A new mapping is when a region was made since: drop those whose file is gone (its
        // maker ended and the file was removed), so that a dead executor's KV pool, which may
        // be large, does not stay in memory through this mapping.
        mapped.retain(|n, (r, _)| {
            std::fs::metadata(self.dir.join(n)).is_ok_and(|m| (m.dev(), m.ino()) == r.inode)
        });
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
    fn a_peer_region_is_read_in_place_and_never_written() {
        let dir = tempdir();
        let (agent, executor) =
            (Staging::create(&dir, 4096, 4).unwrap(), Staging::create(&dir, 4096, 2).unwrap());
        let mut stored = agent.alloc(2).unwrap();
        stored.block_mut(1).fill(5);
        let offset = agent.locate(stored.block(1)).expect("a whole slot of the region");
        assert_eq!(offset, 4096);
        assert_eq!(agent.locate(&stored.block(1)[1..]), None, "not a whole slot");
        assert_eq!(executor.locate(stored.block(1)), None, "not a slot of this region");
        let region = executor.peers().get(agent.name()).unwrap();
        assert!(matches!(region.write(0, &[1u8; 16]), Err(RegionError::ReadOnly(_))));
        let place = Place::Store { region: region.clone(), offset };
        let mine = executor.alloc(1).unwrap();
        assert_eq!(place.bytes(&mine, 0).unwrap(), &[5u8; 4096][..]);
        let past = Place::Store { region, offset: 4 * 4096 };
        assert!(matches!(past.bytes(&mine, 0), Err(RegionError::OutOfRange { .. })));
        drop((stored, mine, executor, agent));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_dead_process_region_is_removed_when_the_next_is_made() {
        let dir = tempdir();
        let live = Staging::create(&dir, 64, 1).unwrap();
        // Left behind by a process that ended (nobody holds its lock), one of them while it
        // was being made; whatever pid their names carry (this one's, here).
        let pid = std::process::id();
        let orphans = [format!("{PREFIX}{pid}-77-0"), format!("{MAKING}{PREFIX}{pid}-78-0")];
        for orphan in &orphans {
            std::fs::write(dir.join(orphan), b"left behind").unwrap();
        }
        let other = dir.join("not-a-region");
        std::fs::write(&other, b"someone else's").unwrap();
        let mine = Staging::create(&dir, 64, 1).unwrap();
        for orphan in &orphans {
            assert!(!dir.join(orphan).exists(), "{orphan} was removed");
        }
        assert!(dir.join(live.name()).exists(), "a live region stays, its pid notwithstanding");
        assert!(dir.join(mine.name()).exists() && other.exists());
        assert_ne!(live.name(), mine.name());
        drop((live, mine));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_pool_region_shares_the_pool_and_sends_its_blocks_where_they_are() {
        let dir = tempdir();
        let (region, mut pool) = Staging::create_with_pool(&dir, 4096, 3, 2).unwrap();
        assert_eq!(pool.bytes().len(), 3 * 4096);
        assert_eq!(pool.floats().len(), 3 * 1024);
        pool.bytes_mut()[4096..8192].fill(6);
        // Staging slots come after the pool, and only they are allocated and given back.
        let staged = region.alloc(2).unwrap();
        assert_eq!(staged.offsets(), vec![3 * 4096, 4 * 4096]);
        assert!(region.alloc(1).is_none());
        // Pool blocks named as slots: the agent reads the pool's bytes at their offsets.
        let sent = region.pool_slots(&[1, 0]).unwrap();
        assert_eq!(sent.offsets(), vec![4096, 0]);
        let agent = Regions::new(dir.clone());
        let mapped = agent.get(region.name()).unwrap();
        assert_eq!(&mapped.bytes(4096, 4096).unwrap()[..], &[6u8; 4096][..]);
        // Checksums published in place are those of the pool's bytes.
        let (mut filler, sent_slots, filled) = filling(sent);
        filler.publish_in_place();
        let want: Vec<u32> = crate::frames::chunk_crcs(&[6u8; 4096]).collect();
        assert_eq!(filled.borrow()[0], want);
        drop((filler, sent_slots));
        assert_eq!(region.free_slots(), 0, "pool blocks are not staging slots");
        drop(staged);
        assert_eq!(region.free_slots(), 2);
        assert!(region.pool_slots(&[3]).is_none(), "block 3 is a staging slot, not the pool's");
        assert!(region.pool_slots(&[]).is_none());
        drop((pool, mapped, region));
        let _ = std::fs::remove_dir_all(dir);
    }

    #[test]
    fn a_mapping_of_a_removed_region_is_dropped_when_a_new_region_is_mapped() {
        let dir = tempdir();
        let agent = Regions::new(dir.clone());
        let (old, new) =
            (Staging::create(&dir, 4096, 1).unwrap(), Staging::create(&dir, 4096, 1).unwrap());
        let mapped = agent.get(old.name()).unwrap();
        let weak = Arc::downgrade(&mapped);
        drop((mapped, old)); // its maker ended: the file is gone
        assert!(weak.upgrade().is_some(), "still mapped by the agent");
        agent.get(new.name()).unwrap();
        assert!(weak.upgrade().is_none(), "the dead region's mapping went with its file");
        drop(new);
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
