//! The layout of a KV block as it travels: `layers × {K,V} × block_size × kv_heads × head_dim`
//! elements of one dtype, for one model. Two layouts are the same only when every field is,
//! model fingerprint included; blocks of different layouts never mix, so a store keys blocks by
//! layout as well as by hash, and a transfer between different layouts is refused.

use ferry_proto::v1;

/// Largest block accepted: 256 MiB (a 128-token block of a 400 B-parameter model in f32 is far
/// below it).
pub const MAX_BLOCK_BYTES: u64 = 256 << 20;

/// A checked layout and what follows from it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BlockLayout {
    /// As stated on the wire.
    pub layout: v1::KvLayout,
    /// Bytes of one block.
    pub block_bytes: usize,
    /// A 64-bit name of the layout (every field, fingerprint included), for store keys.
    pub id: u64,
}

/// Why a layout was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum LayoutError {
    /// No layout was given.
    #[error("no KV layout given")]
    Missing,
    /// A dimension is zero.
    #[error("KV layout field {0} is 0")]
    Zero(&'static str),
    /// No or an unknown dtype.
    #[error("KV layout dtype {0} is not f32, f16 or bf16")]
    Dtype(i32),
    /// No model fingerprint.
    #[error("KV layout has no model fingerprint")]
    NoFingerprint,
    /// Blocks too large.
    #[error("a KV block of this layout is {bytes} bytes; at most {MAX_BLOCK_BYTES}")]
    TooLarge {
        /// The block's size.
        bytes: u64,
    },
}

impl BlockLayout {
    /// Checks `layout`.
    pub fn from_proto(layout: Option<&v1::KvLayout>) -> Result<Self, LayoutError> {
        let l = layout.ok_or(LayoutError::Missing)?;
        for (name, value) in [
            ("num_layers", l.num_layers),
            ("block_size", l.block_size),
            ("num_kv_heads", l.num_kv_heads),
            ("head_dim", l.head_dim),
        ] {
            if value == 0 {
                return Err(LayoutError::Zero(name));
            }
        }
        if l.dtype_bytes().is_none() {
            return Err(LayoutError::Dtype(l.dtype));
        }
        if l.model_fingerprint.is_empty() {
            return Err(LayoutError::NoFingerprint);
        }
        let bytes = l
            .block_bytes()
            .filter(|b| *b <= MAX_BLOCK_BYTES)
            .ok_or(LayoutError::TooLarge { bytes: u64::MAX })?;
        let block_bytes = usize::try_from(bytes).map_err(|_| LayoutError::TooLarge { bytes })?;
        Ok(Self { layout: l.clone(), block_bytes, id: l.id() })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    pub(crate) fn smol() -> v1::KvLayout {
        v1::KvLayout {
            num_layers: 30,
            block_size: 16,
            num_kv_heads: 3,
            head_dim: 64,
            dtype: v1::KvDtype::F32.into(),
            model_fingerprint: "48be0342ec539b4c".into(),
        }
    }

    #[test]
    fn a_layout_gives_its_block_size_and_differs_in_any_field() {
        let l = BlockLayout::from_proto(Some(&smol())).unwrap();
        assert_eq!(l.block_bytes, 30 * 2 * 16 * 3 * 64 * 4);
        let other_model = v1::KvLayout { model_fingerprint: "x".into(), ..smol() };
        let bf16 = v1::KvLayout { dtype: v1::KvDtype::Bf16.into(), ..smol() };
        for other in [other_model, bf16] {
            assert_ne!(BlockLayout::from_proto(Some(&other)).unwrap().id, l.id);
        }
    }

    #[test]
    fn bad_layouts_are_refused_naming_what_is_wrong() {
        assert_eq!(BlockLayout::from_proto(None), Err(LayoutError::Missing));
        let zero = v1::KvLayout { head_dim: 0, ..smol() };
        assert_eq!(BlockLayout::from_proto(Some(&zero)), Err(LayoutError::Zero("head_dim")));
        let dtype = v1::KvLayout { dtype: 0, ..smol() };
        assert_eq!(BlockLayout::from_proto(Some(&dtype)), Err(LayoutError::Dtype(0)));
        let huge = v1::KvLayout { num_layers: u32::MAX, num_kv_heads: u32::MAX, ..smol() };
        assert!(matches!(BlockLayout::from_proto(Some(&huge)), Err(LayoutError::TooLarge { .. })));
        let anonymous = v1::KvLayout { model_fingerprint: String::new(), ..smol() };
        assert_eq!(BlockLayout::from_proto(Some(&anonymous)), Err(LayoutError::NoFingerprint));
    }
}
