//! The data channel: KV blocks as length-framed bytes on an agent's own port (a side channel of
//! its gRPC server, told apart by its first bytes), for agent-to-agent pushes and for an
//! executor's exports and imports through its local agent.
//!
//! Why not gRPC: on loopback a gRPC `Push` moved blocks at about a third of what a plain TCP
//! connection moves (HTTP/2 framing, protobuf messages, the copies between them); the data
//! channel reaches about 80 % (`ferry-bench kv`). It carries the same content — the same
//! header, the same chunks with their CRC32C — and the agent checks and stores it with the
//! same code as the gRPC calls, so the two differ only in framing. The gRPC `Put`, `Push` and
//! `Get` stay, for tools and tests.
//!
//! Wire format, all integers little-endian:
//! - [`MAGIC`], then one operation byte: [`Op::Push`], [`Op::Put`] or [`Op::Get`];
//! - `Push`/`Put`: the header (`u32` length, then a protobuf `TransferHeader`, at most
//!   [`MAX_MESSAGE_BYTES`]), then chunks in order: `u32` block index, `u64` offset, `u32` length,
//!   `u32` CRC32C, the bytes; the sender then closes its writing half and the agent answers:
//!   `u32` status code (0 for OK, else the gRPC code), `u32` length and the message, `u64`
//!   bytes received, `u32` blocks;
//! - `Get`: the request (`u32` length, then a protobuf `GetBlocksRequest`); the agent answers
//!   with records, each a tag byte then: `0` a chunk (as above), `1` the end (a status as
//!   above, without the receipt's fields);
//! - staged operations, between an executor and its own agent through the executor's
//!   shared-memory region ([`crate::shm`]); a region reference is a `u32` name length, the
//!   name, a `u32` count and that many `u64` slot offsets:
//!   - `PutStaged`: the header, a region reference without offsets, then per block, in
//!     order, as the executor fills it: its `u64` slot offset and the `u32` CRC32C of each of
//!     its chunks as [`crate::frames::chunks`] cuts it (the executor computes them right after
//!     copying the block in, while it is in cache); answered as `Put` is. A stream that ends
//!     early fails the transfer (reason `truncated`);
//!   - `GetStaged`: the request, then a region reference with one slot per block; the agent
//!     answers with a record per block as it is ready, in order, then the end record: `2`
//!     (`u32` block index) when it copied the block into its slot, or `3` (`u32` block index,
//!     `u64` offset, `u32` name length, the name) when the block is in a shared region of the
//!     agent's store ([`crate::buffers`]), for the executor to copy from there itself. The
//!     agent keeps every block it named so until the executor closes the connection;
//!   - `Probe`: a region reference; answered as `Put` is (OK if the agent can map it).
//!
//! This module is the format and the client side (what an executor, or an agent pushing to
//! another, calls): [`framing`] reads and writes its pieces, [`send_blocks`], [`push`] and
//! [`get`] speak it over the socket, and [`put_staged`], [`get_staged`] and [`probe`] through
//! shared memory. The agent's server side, which accepts the connections and dispatches them to
//! its store, is the agent's own (`ferry-kv-transfer-svc`'s `data_server`), built on the same
//! [`framing`].

mod client;
pub mod framing;
mod staged;

pub use client::{get, push, send_blocks};
pub use staged::{get_staged, open_staged, probe, put_staged};

use ferry_runtime::side_channel::{ReadHalf, WriteHalf};
use tokio::io::{BufReader, BufWriter};

/// A client's connection to an agent's data channel, buffered both ways.
pub type Conn = (BufReader<ReadHalf>, BufWriter<WriteHalf>);

/// The first bytes of a data-channel connection.
pub const MAGIC: &[u8; 8] = b"FERRYKV1";
/// Largest header or request accepted.
pub const MAX_MESSAGE_BYTES: usize = 1 << 20;
/// Bytes of a chunk's head on the wire.
const CHUNK_HEAD: usize = 4 + 8 + 4 + 4;
/// Buffer for the small reads and writes (heads); chunk data bypasses it.
pub const BUFFER: usize = 64 << 10;
/// Longest status message on the wire.
const MAX_STATUS_MESSAGE: usize = 16 << 10;

/// What a data-channel connection does.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
pub enum Op {
    /// Agent to agent: store these blocks here for a transfer's reader.
    Push = 1,
    /// Executor to its agent: push these blocks on to the header's destination, or keep them
    /// in the store (KV tier) when it names none.
    Put = 2,
    /// Executor from its agent: read blocks (of a transfer, as they arrive, or from the store).
    Get = 3,
    /// Executor to its agent: a `Put` of blocks staged in shared memory ([`crate::shm`]).
    PutStaged = 4,
    /// Executor from its agent: a `Get` whose blocks the agent copies into shared memory.
    GetStaged = 5,
    /// Executor to its agent: can you map this staging region?
    Probe = 6,
}

/// Record tags of a `Get` answer: a chunk follows (as `Push` sends one) ...
pub const TAG_CHUNK: u8 = 0;
/// ... or the end (a status).
const TAG_END: u8 = 1;
/// A staged `Get`'s block landed in its slot (`u32` index follows).
const TAG_BLOCK: u8 = 2;
/// A staged `Get`'s block is in the agent's store, to be copied from there: `u32` index, `u64`
/// offset, then the region's name (`u32` length, the bytes).
const TAG_SHARED: u8 = 3;
