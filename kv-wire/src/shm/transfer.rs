//! What a transfer does with its slots: an export's [`Filler`] fills them in order and
//! publishes each with its chunk checksums while the transfer already sends the filled ones;
//! an import's [`Place`] says where each landed block is, in the reader's slot or in the
//! agent's store.

use std::sync::Arc;

use super::region::{Region, RegionError};
use super::staging::Slots;

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
            Self::Store { region, offset } => region.slice(*offset, slots.staging().block_bytes()),
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
            std::slice::from_raw_parts_mut(self.slots.ptr(i), self.slots.staging().block_bytes())
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
