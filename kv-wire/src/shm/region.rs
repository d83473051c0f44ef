//! A region of another process's, as this one maps it ([`Region`]), and the few this process
//! keeps mapped by name ([`Regions`]): the agent's view of an executor's staging region (read
//! and write), an executor's view of its agent's store regions (read only).
//!
//! Only files named `ferry-kv-…` in the shared directory are mapped, every offset a client
//! names is checked against the region's size, and a mapping whose file is gone (its maker
//! ended) is dropped when the next region is mapped.

use std::collections::HashMap;
use std::os::unix::fs::MetadataExt;
use std::path::PathBuf;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use bytes::Bytes;
use memmap2::{MmapOptions, MmapRaw};

use super::{MAX_NAME, PREFIX};

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
