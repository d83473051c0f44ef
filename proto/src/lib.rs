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

/// How an executor says "another scheduler leads now": a `FAILED_PRECONDITION` status whose
/// metadata carries the newest leadership epoch it has seen. A scheduler that reads it knows
/// for certain that it was deposed (DESIGN.md §7), even while etcd is unreachable.
pub mod fencing {
    /// The metadata key of the newest epoch, in decimal.
    pub const NEWEST_EPOCH: &str = "ferry-newest-epoch";

    /// The status refusing a scheduler at `given`, older than the `newest` epoch seen.
    #[must_use]
    pub fn stale_epoch(given: u64, newest: u64) -> tonic::Status {
        let mut status = tonic::Status::failed_precondition(format!(
            "stale scheduler epoch {given}: this executor has seen epoch {newest}"
        ));
        status.metadata_mut().insert(NEWEST_EPOCH, newest.into());
        status
    }

    /// The newest epoch a stale-epoch refusal names (`None`: `status` is not one).
    #[must_use]
    pub fn newest_epoch(status: &tonic::Status) -> Option<u64> {
        if status.code() != tonic::Code::FailedPrecondition {
            return None;
        }
        status.metadata().get(NEWEST_EPOCH)?.to_str().ok()?.parse().ok()
    }

    #[cfg(test)]
    mod tests {
        #[test]
        fn a_stale_epoch_refusal_names_the_newest_epoch_and_nothing_else_does() {
            let s = super::stale_epoch(7, 9);
            assert_eq!(super::newest_epoch(&s), Some(9));
            assert!(s.message().contains("stale scheduler epoch 7"), "{}", s.message());
            assert_eq!(super::newest_epoch(&tonic::Status::failed_precondition("x")), None);
            let mut other = tonic::Status::unavailable("x");
            other.metadata_mut().insert(super::NEWEST_EPOCH, 9u64.into());
            assert_eq!(super::newest_epoch(&other), None, "only a refusal fences");
        }
    }
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
