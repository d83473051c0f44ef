//! The bytes a Ferry executor and a KV agent exchange, defined once: the block frames and their
//! checks ([`frames`]), a block's layout ([`layout`]), the shared-memory staging protocol
//! between an executor and its node's agent ([`shm`], with the receive buffers that can live in
//! it, [`buffers`]), and the data channel's format with the client side that an executor or a
//! pushing agent calls ([`data_channel`]).
//!
//! Why a crate of its own: both sides must agree on every byte, so both build on this one
//! definition, and an executor links the wire format without the agent's store, service and
//! server. The agent (`ferry-kv-transfer-svc`) keeps what only it does: the store, the transfer
//! table, the gRPC service and the data channel's server side.

pub mod buffers;
pub mod data_channel;
pub mod frames;
pub mod layout;
// Shared memory between processes: raw mappings and system calls, each unsafe block with the
// reason it holds.
#[allow(unsafe_code)]
pub mod shm;
