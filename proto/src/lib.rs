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

impl v1::KvLayout {
    /// Bytes of one element of the layout's dtype (`None`: unset or unknown).
    #[must_use]
    pub fn dtype_bytes(&self) -> Option<u64> {
        match v1::KvDtype::try_from(self.dtype) {
            Ok(v1::KvDtype::F32) => Some(4),
            Ok(v1::KvDtype::F16 | v1::KvDtype::Bf16) => Some(2),
            Ok(v1::KvDtype::Unspecified) | Err(_) => None,
        }
    }

    /// Bytes of one block: `layers × {K,V} × block_size × kv_heads × head_dim` elements
    /// (`None`: no dtype, or past `u64`).
    #[must_use]
    pub fn block_bytes(&self) -> Option<u64> {
        [self.num_layers, 2, self.block_size, self.num_kv_heads, self.head_dim]
            .iter()
            .map(|&d| u64::from(d))
            .try_fold(self.dtype_bytes()?, u64::checked_mul)
    }

    /// A 64-bit name of the layout (FNV-1a over every field, the model fingerprint included):
    /// equal layouts have equal ids, so stores and indexes key blocks by it.
    #[must_use]
    pub fn id(&self) -> u64 {
        let mut h = 0xcbf2_9ce4_8422_2325u64;
        let mut feed = |bytes: &[u8]| {
            for b in bytes {
                h = (h ^ u64::from(*b)).wrapping_mul(0x0100_0000_01b3);
            }
        };
        for v in [self.num_layers, self.block_size, self.num_kv_heads, self.head_dim] {
            feed(&v.to_le_bytes());
        }
        feed(&self.dtype.to_le_bytes());
        feed(self.model_fingerprint.as_bytes());
        h
    }
}
