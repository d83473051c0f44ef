//! A region's file in the shared-memory directory: its pages reserved as slots are first used,
//! the `flock` its maker holds for as long as it runs, its random name part, and the removal of
//! files nobody holds the lock of (a `kill -9` leaves one behind).
//!
//! Invariant: a region is never seen unlocked while its maker runs: it is made under a name
//! starting with [`MAKING`] that no one maps, locked, then renamed into place.

use std::os::fd::AsRawFd;
use std::path::Path;

use super::PREFIX;

/// Reserves `len` bytes of `file` from `offset`; false if the file system is full.
pub(super) fn reserve(file: &std::fs::File, offset: u64, len: u64) -> bool {
    let (Ok(offset), Ok(len)) = (i64::try_from(offset), i64::try_from(len)) else {
        return false;
    };
    // SAFETY: a plain system call on an open descriptor.
    unsafe { libc::posix_fallocate(file.as_raw_fd(), offset, len) == 0 }
}

/// Prefix of a region's file while it is made.
pub(super) const MAKING: &str = ".making-";

/// Takes the lock a region's maker holds on its file for as long as it runs (`flock`, which
/// the kernel drops when the process ends, however it ends); fails if another holds it.
pub(super) fn lock(file: &std::fs::File) -> std::io::Result<()> {
    // SAFETY: a plain system call on an open descriptor.
    if unsafe { libc::flock(file.as_raw_fd(), libc::LOCK_EX | libc::LOCK_NB) } == 0 {
        Ok(())
    } else {
        Err(std::io::Error::last_os_error())
    }
}

/// Eight random bytes from the kernel (zero if it has none to give).
pub(super) fn random() -> u64 {
    let mut buf = [0u8; 8];
    // SAFETY: writes at most `buf.len()` bytes into `buf`.
    let _ = unsafe { libc::getrandom(buf.as_mut_ptr().cast(), buf.len(), 0) };
    u64::from_ne_bytes(buf)
}

/// Removes regions in `dir` that no running process made: those whose lock nobody holds.
/// The lock, not the pid in the name, tells: an executor and its agent in different PID
/// namespaces (two containers of a pod) cannot see each other's pids.
pub(super) fn remove_orphans(dir: &Path) {
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
