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
//!
//! The pieces: [`Staging`] (a region this process made, and the [`Slots`] it hands out), the
//! executor's KV pool inside it ([`PoolMemory`]), a region of another process's as this one
//! maps it ([`Region`], [`Regions`]), and what a transfer does with its slots ([`Filler`] for
//! an export, [`Place`] for an import).

mod files;
mod pool;
mod region;
mod staging;
#[cfg(test)]
mod tests;
mod transfer;

pub use pool::PoolMemory;
pub use region::{Region, RegionError, Regions};
pub use staging::{Slots, Staging};
pub use transfer::{filling, Filled, Filler, Place};

/// Default directory of staging regions.
pub const DEFAULT_DIR: &str = "/dev/shm";
/// Prefix of every region's file name.
pub const PREFIX: &str = "ferry-kv-";
/// Longest region name accepted.
pub const MAX_NAME: usize = 64;
