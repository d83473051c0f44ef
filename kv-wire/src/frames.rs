//! Block streams on the wire: a header, then the blocks in order, each cut into chunks of at
//! most [`CHUNK_BYTES`] with a CRC32C each. This module checks a stream as it arrives and
//! reassembles its blocks, and cuts blocks into frames for sending.
//!
//! What a receiver accepts, and nothing else: a header first (a transfer id, a valid layout, at
//! least one and at most [`MAX_BLOCKS`] blocks); then chunks in order — block by block, each
//! block's chunks contiguous from offset 0 — whose sizes add up to exactly the layout's block
//! size, each no larger than [`MAX_CHUNK_BYTES`] and with a matching CRC32C. Anything else is
//! a [`FrameError`] that says what was wrong, and a block is handed on only once all its bytes
//! arrived and checked.

use bytes::{Bytes, BytesMut};
use ferry_proto::v1::{self, block_frame::Frame};

use crate::layout::{BlockLayout, LayoutError};

/// Chunk size when sending: 2 MiB, well under gRPC's message limit and large enough that the
/// per-message cost is small next to the copy.
pub const CHUNK_BYTES: usize = 2 << 20;
/// Largest chunk a receiver accepts.
pub const MAX_CHUNK_BYTES: usize = 4 << 20;
/// Most blocks in one transfer.
pub const MAX_BLOCKS: usize = 1 << 16;
/// Longest transfer id.
pub const MAX_TRANSFER_ID: usize = 128;
/// gRPC message limit for block streams: a chunk plus its framing.
pub const MAX_MESSAGE_BYTES: usize = MAX_CHUNK_BYTES + (64 << 10);

/// A stream's header, checked.
#[derive(Debug, Clone)]
pub struct Header {
    /// The transfer.
    pub transfer_id: String,
    /// The blocks' layout.
    pub layout: BlockLayout,
    /// The blocks, in order.
    pub hashes: Vec<u64>,
    /// Where to push them on (a `Put` to the source agent), if anywhere.
    pub destination: Option<String>,
    /// Unix milliseconds after which the transfer is abandoned; 0 for none.
    pub deadline_unix_ms: u64,
    /// The sender's trace context (empty: untraced).
    pub traceparent: String,
}

impl Header {
    /// The wire form.
    pub fn to_proto(&self) -> v1::TransferHeader {
        v1::TransferHeader {
            transfer_id: self.transfer_id.clone(),
            layout: Some(self.layout.layout.clone()),
            block_hashes: self.hashes.clone(),
            destination_agent: self.destination.clone().unwrap_or_default(),
            deadline_unix_ms: self.deadline_unix_ms,
            traceparent: self.traceparent.clone(),
        }
    }

    /// Bytes of all the blocks.
    pub fn total_bytes(&self) -> u64 {
        self.hashes.len() as u64 * self.layout.block_bytes as u64
    }
}

/// What was wrong with a block stream.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The stream did not start with a header.
    #[error("a block stream must start with a header")]
    NoHeader,
    /// A second header.
    #[error("a block stream has one header, first")]
    SecondHeader,
    /// An empty frame.
    #[error("an empty frame (neither header nor chunk)")]
    EmptyFrame,
    /// A missing or oversized transfer id.
    #[error("transfer_id must be 1 to {MAX_TRANSFER_ID} bytes, got {0}")]
    TransferId(usize),
    /// A bad layout.
    #[error(transparent)]
    Layout(#[from] LayoutError),
    /// No blocks, or too many.
    #[error("a transfer carries 1 to {MAX_BLOCKS} blocks, got {0}")]
    BlockCount(usize),
    /// A chunk out of order.
    #[error("chunk for block {block} at offset {offset}, expected block {want_block} at offset {want_offset}")]
    OutOfOrder {
        /// Its block.
        block: u32,
        /// Its offset.
        offset: u64,
        /// The block expected next.
        want_block: usize,
        /// The offset expected next.
        want_offset: usize,
    },
    /// A chunk too large, or running past its block.
    #[error("chunk of {len} bytes at offset {offset} of block {block}: chunks are at most {MAX_CHUNK_BYTES} bytes and a block is {block_bytes}")]
    Oversized {
        /// Its block.
        block: u32,
        /// Its offset.
        offset: u64,
        /// Its length.
        len: usize,
        /// The layout's block size.
        block_bytes: usize,
    },
    /// An empty chunk.
    #[error("empty chunk for block {0}")]
    EmptyChunk(u32),
    /// A checksum mismatch.
    #[error("CRC32C mismatch in block {block} at offset {offset}: the chunk was corrupted")]
    Checksum {
        /// Its block.
        block: u32,
        /// Its offset.
        offset: u64,
    },
    /// The stream ended early.
    #[error("the stream ended after {received} of {expected} bytes (block {block} incomplete)")]
    Truncated {
        /// Bytes received.
        received: u64,
        /// Bytes the header announced.
        expected: u64,
        /// The first incomplete block.
        block: usize,
    },
}

/// Reads the header frame.
pub fn read_header(frame: v1::BlockFrame) -> Result<Header, FrameError> {
    let header = match frame.frame {
        Some(Frame::Header(h)) => h,
        Some(Frame::Chunk(_)) => return Err(FrameError::NoHeader),
        None => return Err(FrameError::EmptyFrame),
    };
    if header.transfer_id.is_empty() || header.transfer_id.len() > MAX_TRANSFER_ID {
        return Err(FrameError::TransferId(header.transfer_id.len()));
    }
    let layout = BlockLayout::from_proto(header.layout.as_ref())?;
    if header.block_hashes.is_empty() || header.block_hashes.len() > MAX_BLOCKS {
        return Err(FrameError::BlockCount(header.block_hashes.len()));
    }
    let destination = Some(header.destination_agent).filter(|d| !d.is_empty());
    Ok(Header {
        transfer_id: header.transfer_id,
        layout,
        hashes: header.block_hashes,
        destination,
        deadline_unix_ms: header.deadline_unix_ms,
        traceparent: header.traceparent,
    })
}

/// Reassembles the blocks of one stream from its chunks, checking each.
#[derive(Debug)]
pub struct BlockAssembler {
    block_bytes: usize,
    blocks: usize,
    /// The block being filled, and how much of it is.
    next: usize,
    current: BytesMut,
    /// Bytes of the current block seen (equals `current.len()` unless only checking).
    filled: usize,
    /// Keep the bytes (a store) or only check them (a relay).
    keep: bool,
    /// Whether chunks' checksums were verified as they were read (not computed again here).
    verified: bool,
    received: u64,
}

impl BlockAssembler {
    /// An assembler for the blocks `header` announces.
    pub fn new(header: &Header) -> Self {
        Self {
            block_bytes: header.layout.block_bytes,
            blocks: header.hashes.len(),
            next: 0,
            current: BytesMut::new(),
            filled: 0,
            keep: true,
            verified: false,
            received: 0,
        }
    }

    /// A checker for a relay: every rule of [`BlockAssembler::new`], but no bytes are kept
    /// (completed blocks come back empty).
    pub fn checking(header: &Header) -> Self {
        Self { keep: false, ..Self::new(header) }
    }

    /// The same, for chunks whose checksums the reader verified as their bytes arrived
    /// ([`Crc32c`]): every other rule holds, but a chunk's CRC32C is not computed again.
    #[must_use]
    pub fn verified(self) -> Self {
        Self { verified: true, ..self }
    }

    /// Takes the next frame; returns `(index, bytes)` of a block it completes.
    pub fn push(&mut self, frame: v1::BlockFrame) -> Result<Option<(usize, Bytes)>, FrameError> {
        let chunk = match frame.frame {
            Some(Frame::Chunk(c)) => c,
            Some(Frame::Header(_)) => return Err(FrameError::SecondHeader),
            None => return Err(FrameError::EmptyFrame),
        };
        let (block, offset, len) = (chunk.block_index, chunk.offset, chunk.data.len());
        if block as usize != self.next || offset != self.filled as u64 {
            return Err(FrameError::OutOfOrder {
                block,
                offset,
                want_block: self.next,
                want_offset: self.filled,
            });
        }
        if self.next >= self.blocks {
            return Err(FrameError::OutOfOrder {
                block,
                offset,
                want_block: self.next,
                want_offset: 0,
            });
        }
        if len == 0 {
            return Err(FrameError::EmptyChunk(block));
        }
        if len > MAX_CHUNK_BYTES || self.filled + len > self.block_bytes {
            return Err(FrameError::Oversized {
                block,
                offset,
                len,
                block_bytes: self.block_bytes,
            });
        }
        if !self.verified && crc32c(&chunk.data) != chunk.crc32c {
            return Err(FrameError::Checksum { block, offset });
        }
        self.received += len as u64;
        if self.filled == 0 && len == self.block_bytes {
            // A whole block in one chunk: hand on the received buffer as it is, no copy.
            self.next += 1;
            return Ok(Some((self.next - 1, if self.keep { chunk.data } else { Bytes::new() })));
        }
        if self.keep {
            if self.current.capacity() < self.block_bytes {
                self.current.reserve(self.block_bytes - self.current.len());
            }
            self.current.extend_from_slice(&chunk.data);
        }
        self.filled += len;
        if self.filled < self.block_bytes {
            return Ok(None);
        }
        self.next += 1;
        self.filled = 0;
        Ok(Some((self.next - 1, std::mem::take(&mut self.current).freeze())))
    }

    /// Bytes received so far.
    pub fn received(&self) -> u64 {
        self.received
    }

    /// Checks that every announced block arrived whole.
    pub fn finish(&self) -> Result<(), FrameError> {
        if self.next < self.blocks {
            return Err(FrameError::Truncated {
                received: self.received,
                expected: self.blocks as u64 * self.block_bytes as u64,
                block: self.next,
            });
        }
        Ok(())
    }
}

/// The CRC32C (Castagnoli, as iSCSI and ext4 use it) of `data`: every chunk's checksum.
pub fn crc32c(data: &[u8]) -> u32 {
    // The algorithm's value fits its 32 bits; the crate returns every width as a u64.
    crc_fast::checksum(crc_fast::CrcAlgorithm::Crc32Iscsi, data) as u32
}

/// A CRC32C computed piece by piece, as bytes arrive: each piece is checked while it is still
/// in the CPU's cache, which costs a fraction of a pass over the whole chunk from memory later.
#[derive(Debug)]
pub struct Crc32c(crc_fast::Digest);

impl Default for Crc32c {
    fn default() -> Self {
        Self(crc_fast::Digest::new(crc_fast::CrcAlgorithm::Crc32Iscsi))
    }
}

impl Crc32c {
    /// Adds the next bytes.
    pub fn update(&mut self, data: &[u8]) {
        self.0.update(data);
    }

    /// The CRC32C of every byte added.
    pub fn value(&self) -> u32 {
        // As in [`crc32c`].
        self.0.finalize() as u32
    }
}

/// The chunk frames of block `index` (its bytes `data`), at most [`CHUNK_BYTES`] each.
pub fn chunks(index: usize, data: &Bytes) -> impl Iterator<Item = v1::BlockFrame> + '_ {
    chunks_with(index, data, chunk_crcs(data))
}

/// The CRC32C of each piece of `block` that [`chunks`] cuts.
pub fn chunk_crcs(block: &[u8]) -> impl Iterator<Item = u32> + '_ {
    block.chunks(CHUNK_BYTES).map(crc32c)
}

/// The chunk frames of block `index` as [`chunks`] cuts them, with checksums `crcs` computed
/// before, one per piece (see [`chunk_crcs`]).
pub fn chunks_with<'a>(
    index: usize,
    data: &'a Bytes,
    crcs: impl IntoIterator<Item = u32> + 'a,
) -> impl Iterator<Item = v1::BlockFrame> + 'a {
    let index = u32::try_from(index).expect("at most MAX_BLOCKS blocks");
    let mut crcs = crcs.into_iter();
    (0..data.len()).step_by(CHUNK_BYTES).map(move |offset| {
        let piece = data.slice(offset..(offset + CHUNK_BYTES).min(data.len()));
        v1::BlockFrame {
            frame: Some(Frame::Chunk(v1::BlockChunk {
                block_index: index,
                offset: offset as u64,
                crc32c: crcs.next().unwrap_or_default(),
                data: piece,
            })),
        }
    })
}

/// The header frame of `header`.
pub fn header_frame(header: &Header) -> v1::BlockFrame {
    v1::BlockFrame { frame: Some(Frame::Header(header.to_proto())) }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    pub(crate) fn layout() -> v1::KvLayout {
        v1::KvLayout {
            num_layers: 2,
            block_size: 4,
            num_kv_heads: 1,
            head_dim: 8,
            dtype: v1::KvDtype::F32.into(),
            model_fingerprint: "fp".into(),
        }
    }

    pub(crate) fn header(n: usize) -> Header {
        let frame = v1::BlockFrame {
            frame: Some(Frame::Header(v1::TransferHeader {
                transfer_id: "t1".into(),
                layout: Some(layout()),
                block_hashes: (0..n as u64).collect(),
                ..Default::default()
            })),
        };
        read_header(frame).unwrap()
    }

    pub(crate) fn block(seed: u8, bytes: usize) -> Bytes {
        (0..bytes).map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed)).collect::<Vec<_>>().into()
    }

    #[test]
    fn the_checksum_is_the_standard_crc32c() {
        // The catalogue's check value, then lengths around the vector widths, against the
        // `crc32c` crate's independent implementation.
        assert_eq!(crc32c(b"123456789"), 0xe306_9283);
        let mut pieces = Crc32c::default();
        for piece in [&b"1234"[..], b"", b"56789"] {
            pieces.update(piece);
        }
        assert_eq!(pieces.value(), 0xe306_9283, "piece by piece, the same");
        let data = block(7, 1 << 16);
        for len in [0, 1, 15, 16, 17, 63, 64, 65, 255, 256, 4095, 4096, 65_535, 1 << 16] {
            assert_eq!(crc32c(&data[..len]), crc32c::crc32c(&data[..len]), "{len} bytes");
        }
    }

    #[test]
    fn blocks_cut_into_chunks_reassemble_exactly() {
        let h = header(3);
        let blocks: Vec<Bytes> = (0..3).map(|i| block(i, h.layout.block_bytes)).collect();
        let mut a = BlockAssembler::new(&h);
        let mut out = Vec::new();
        for (i, b) in blocks.iter().enumerate() {
            for f in chunks(i, b) {
                if let Some(done) = a.push(f).unwrap() {
                    out.push(done);
                }
            }
        }
        a.finish().unwrap();
        assert_eq!(out, blocks.into_iter().enumerate().collect::<Vec<_>>());
    }

    fn chunk(block: u32, offset: u64, data: Bytes, crc: Option<u32>) -> v1::BlockFrame {
        let crc32c = crc.unwrap_or_else(|| crc32c::crc32c(&data));
        v1::BlockFrame {
            frame: Some(Frame::Chunk(v1::BlockChunk { block_index: block, offset, data, crc32c })),
        }
    }

    #[test]
    fn every_malformed_stream_is_refused_saying_why() {
        let h = header(2);
        let bb = h.layout.block_bytes;
        let whole = block(1, bb);
        let cases: Vec<(Vec<v1::BlockFrame>, FrameError)> = vec![
            (
                vec![chunk(1, 0, whole.clone(), None)],
                FrameError::OutOfOrder { block: 1, offset: 0, want_block: 0, want_offset: 0 },
            ),
            (
                vec![chunk(0, 8, whole.slice(..8), None)],
                FrameError::OutOfOrder { block: 0, offset: 8, want_block: 0, want_offset: 0 },
            ),
            (
                vec![chunk(0, 0, block(1, bb + 1), None)],
                FrameError::Oversized { block: 0, offset: 0, len: bb + 1, block_bytes: bb },
            ),
            (vec![chunk(0, 0, Bytes::new(), None)], FrameError::EmptyChunk(0)),
            (
                vec![chunk(0, 0, whole.clone(), Some(1))],
                FrameError::Checksum { block: 0, offset: 0 },
            ),
            (vec![header_frame(&h)], FrameError::SecondHeader),
            (vec![v1::BlockFrame { frame: None }], FrameError::EmptyFrame),
            (
                vec![
                    chunk(0, 0, whole.clone(), None),
                    chunk(1, 0, whole.clone(), None),
                    chunk(2, 0, whole.clone(), None),
                ],
                FrameError::OutOfOrder { block: 2, offset: 0, want_block: 2, want_offset: 0 },
            ),
        ];
        for (frames, want) in cases {
            let mut a = BlockAssembler::new(&h);
            let got = frames.into_iter().map(|f| a.push(f)).find_map(Result::err);
            assert_eq!(got, Some(want.clone()), "{want}");
        }
        // A stream that stops early is truncated.
        let mut a = BlockAssembler::new(&h);
        a.push(chunk(0, 0, whole.slice(..10), None)).unwrap();
        let err = a.finish().unwrap_err();
        assert_eq!(err, FrameError::Truncated { received: 10, expected: 2 * bb as u64, block: 0 });
        // Headers: first, with an id, a layout and blocks.
        assert_eq!(read_header(chunk(0, 0, whole, None)).unwrap_err(), FrameError::NoHeader);
        let bad = |f: fn(&mut v1::TransferHeader)| {
            let mut th = h.to_proto();
            f(&mut th);
            read_header(v1::BlockFrame { frame: Some(Frame::Header(th)) }).unwrap_err()
        };
        assert_eq!(bad(|t| t.transfer_id.clear()), FrameError::TransferId(0));
        assert_eq!(bad(|t| t.block_hashes.clear()), FrameError::BlockCount(0));
        assert_eq!(bad(|t| t.layout = None), FrameError::Layout(LayoutError::Missing));
    }
}
