//! Ferry's gRPC API, package `ferry.v1`, generated from `proto/ferry/v1/*.proto`.
//!
//! The `.proto` files are the contract between Ferry's services: the client API of the front
//! (`Generation`), the scheduler <-> executor session (`Executor`) and the KV agent
//! (`KvTransfer`). [`FILE_DESCRIPTOR_SET`] is what gRPC reflection serves, so `grpcurl` works
//! without the `.proto` files.

/// Generated messages, clients and servers of `ferry.v1`.
pub mod v1 {
    #![allow(missing_docs, clippy::all, clippy::pedantic)]
    tonic::include_proto!("ferry.v1");
}

/// The encoded `FileDescriptorSet` of every `ferry.v1` file, for gRPC reflection.
pub const FILE_DESCRIPTOR_SET: &[u8] =
    include_bytes!(concat!(env!("OUT_DIR"), "/ferry_v1_descriptor.bin"));

/// Fully qualified names of the `ferry.v1` services, as reflection lists them.
pub mod service_names {
    /// The client API of the front.
    pub const GENERATION: &str = "ferry.v1.Generation";
    /// The scheduler <-> executor session.
    pub const EXECUTOR: &str = "ferry.v1.Executor";
    /// The per-node KV agent.
    pub const KV_TRANSFER: &str = "ferry.v1.KvTransfer";
}
