//! A GGUF file's header: its metadata and the table of its tensors, read without the weights.
//!
//! Why our own reader and not candle's: the front (tokenizer, chat template, model length) and
//! the scheduler binary must not link candle and its kernels just to read a few keys. This
//! reader takes the header only (GGUF v2 and v3, little-endian); the executor loads tensors
//! through candle from the offsets given here.
//!
//! Every length read from the file is checked against what is left of it before anything is
//! allocated, so a truncated or hostile file is an error, never a huge allocation or a panic.

use std::collections::HashMap;
use std::io::{BufReader, Read};
use std::path::Path;

/// The four bytes every GGUF file starts with.
pub const MAGIC: [u8; 4] = *b"GGUF";

/// The alignment of the tensor data when `general.alignment` does not say.
const DEFAULT_ALIGNMENT: u64 = 32;

/// A metadata value.
#[derive(Debug, Clone, PartialEq)]
pub enum Value {
    /// Any unsigned integer type (u8, u16, u32, u64).
    U64(u64),
    /// Any signed integer type (i8, i16, i32, i64).
    I64(i64),
    /// f32 or f64.
    F64(f64),
    /// A boolean.
    Bool(bool),
    /// A UTF-8 string.
    String(String),
    /// An array of values of one type.
    Array(Vec<Value>),
}

impl Value {
    /// The value as a `u32`, if it is an integer that fits.
    pub fn as_u32(&self) -> Option<u32> {
        match *self {
            Value::U64(v) => u32::try_from(v).ok(),
            Value::I64(v) => u32::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as an `i32`, if it is an integer that fits.
    pub fn as_i32(&self) -> Option<i32> {
        match *self {
            Value::U64(v) => i32::try_from(v).ok(),
            Value::I64(v) => i32::try_from(v).ok(),
            _ => None,
        }
    }

    /// The value as an `f32`, if it is a number.
    #[allow(clippy::cast_possible_truncation, clippy::cast_precision_loss)]
    pub fn as_f32(&self) -> Option<f32> {
        match *self {
            Value::F64(v) => Some(v as f32),
            Value::U64(v) => Some(v as f32),
            Value::I64(v) => Some(v as f32),
            _ => None,
        }
    }

    /// The value as a boolean.
    pub fn as_bool(&self) -> Option<bool> {
        match *self {
            Value::Bool(b) => Some(b),
            _ => None,
        }
    }

    /// The value as a string.
    pub fn as_str(&self) -> Option<&str> {
        match self {
            Value::String(s) => Some(s),
            _ => None,
        }
    }

    /// The value as an array.
    pub fn as_array(&self) -> Option<&[Value]> {
        match self {
            Value::Array(a) => Some(a),
            _ => None,
        }
    }

    /// The GGUF type name, for error messages.
    pub fn type_name(&self) -> &'static str {
        match self {
            Value::U64(_) => "unsigned integer",
            Value::I64(_) => "signed integer",
            Value::F64(_) => "float",
            Value::Bool(_) => "bool",
            Value::String(_) => "string",
            Value::Array(_) => "array",
        }
    }
}

/// The value as an error message shows it (an array by its length).
impl std::fmt::Display for Value {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Value::U64(v) => write!(f, "{v}"),
            Value::I64(v) => write!(f, "{v}"),
            Value::F64(v) => write!(f, "{v}"),
            Value::Bool(v) => write!(f, "{v}"),
            Value::String(v) => write!(f, "{v:?}"),
            Value::Array(v) => write!(f, "[{} items]", v.len()),
        }
    }
}

/// GGML's type names by code (`ggml_type`), for the types a GGUF file may hold.
const GGML_TYPES: [(u32, &str); 31] = [
    (0, "F32"),
    (1, "F16"),
    (2, "Q4_0"),
    (3, "Q4_1"),
    (6, "Q5_0"),
    (7, "Q5_1"),
    (8, "Q8_0"),
    (9, "Q8_1"),
    (10, "Q2_K"),
    (11, "Q3_K"),
    (12, "Q4_K"),
    (13, "Q5_K"),
    (14, "Q6_K"),
    (15, "Q8_K"),
    (16, "IQ2_XXS"),
    (17, "IQ2_XS"),
    (18, "IQ3_XXS"),
    (19, "IQ1_S"),
    (20, "IQ4_NL"),
    (21, "IQ3_S"),
    (22, "IQ2_S"),
    (23, "IQ4_XS"),
    (24, "I8"),
    (25, "I16"),
    (26, "I32"),
    (27, "I64"),
    (28, "F64"),
    (29, "IQ1_M"),
    (30, "BF16"),
    (34, "TQ1_0"),
    (35, "TQ2_0"),
];

/// The types Ferry computes matrices in (the executor's kernels take exactly these; a test
/// holds the two lists equal).
pub const SERVED_WEIGHT_TYPES: [&str; 11] =
    ["Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0", "Q4_K", "Q5_K", "Q6_K", "F16", "BF16", "F32"];

/// The name of GGML type `code` (`Q4_K`, `BF16`, …), or `type <code>` for one GGML does not
/// name.
pub fn ggml_type_name(code: u32) -> String {
    GGML_TYPES
        .iter()
        .find(|(c, _)| *c == code)
        .map_or_else(|| format!("type {code}"), |(_, name)| (*name).to_string())
}

/// Where one tensor lives in the file.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    /// Its name (`blk.0.attn_q.weight`, …).
    pub name: String,
    /// Its dimensions, innermost first (GGUF's order).
    pub dims: Vec<u64>,
    /// The GGML type code (0 = F32, 1 = F16, 2 = `Q4_0`, 3 = `Q4_1`, 8 = `Q8_0`, …).
    pub ggml_type: u32,
    /// Offset of its data from the start of the data section.
    pub offset: u64,
}

/// A GGUF file's header.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    /// The format version (2 or 3).
    pub version: u32,
    /// The metadata, by key.
    pub metadata: HashMap<String, Value>,
    /// The tensors, in file order.
    pub tensors: Vec<TensorInfo>,
    /// Where the data section starts, from the start of the file.
    pub data_offset: u64,
    /// The file's length in bytes.
    pub file_len: u64,
}

/// Why a GGUF header could not be read.
#[derive(Debug, thiserror::Error)]
pub enum GgufError {
    /// The file could not be read.
    #[error("reading the GGUF header: {0}")]
    Io(#[from] std::io::Error),
    /// The file does not start with `GGUF`.
    #[error("not a GGUF file (it does not start with the GGUF magic)")]
    NotGguf,
    /// A version this reader does not know.
    #[error("GGUF version {0} is not supported (only 2 and 3)")]
    Version(u32),
    /// The header contradicts itself or the file's size.
    #[error("malformed GGUF header: {0}")]
    Malformed(String),
}

impl GgufHeader {
    /// Reads the header of the file at `path`.
    pub fn open(path: &Path) -> Result<Self, GgufError> {
        let file = std::fs::File::open(path)?;
        let len = file.metadata()?.len();
        Self::read(&mut BufReader::with_capacity(1 << 16, file), len)
    }

    /// Reads a header from `reader`, positioned at the start of a file `file_len` bytes long.
    pub fn read<R: Read>(reader: &mut R, file_len: u64) -> Result<Self, GgufError> {
        let mut r = Cursor { inner: reader, left: file_len };
        let mut magic = [0u8; 4];
        r.bytes(&mut magic)?;
        if magic != MAGIC {
            return Err(GgufError::NotGguf);
        }
        let version = r.u32()?;
        if !(2..=3).contains(&version) {
            return Err(GgufError::Version(version));
        }
        let n_tensors = r.u64()?;
        let n_kv = r.u64()?;
        let mut metadata = HashMap::new();
        for _ in 0..n_kv {
            let key = r.string()?;
            let ty = r.u32()?;
            let value = r.value(ty, 0)?;
            metadata.insert(key, value);
        }
        // Each tensor info takes at least 8 + 4 + 4 + 8 bytes.
        r.room_for(n_tensors, 24)?;
        let mut tensors = Vec::with_capacity(usize::try_from(n_tensors).unwrap_or(0));
        for _ in 0..n_tensors {
            let name = r.string()?;
            let n_dims = r.u32()?;
            if n_dims > 8 {
                return Err(malformed(format!("tensor {name} has {n_dims} dimensions")));
            }
            let dims = (0..n_dims).map(|_| r.u64()).collect::<Result<_, _>>()?;
            let ggml_type = r.u32()?;
            let offset = r.u64()?;
            tensors.push(TensorInfo { name, dims, ggml_type, offset });
        }
        let alignment = match metadata.get("general.alignment") {
            Some(v) => v
                .as_u32()
                .map(u64::from)
                .filter(|a| a.is_power_of_two())
                .ok_or_else(|| malformed("general.alignment is not a power of two".into()))?,
            None => DEFAULT_ALIGNMENT,
        };
        let header_end = file_len - r.left;
        let data_offset = header_end.div_ceil(alignment) * alignment;
        Ok(Self { version, metadata, tensors, data_offset, file_len })
    }

    /// The metadata value of `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.metadata.get(key)
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensors.iter().find(|t| t.name == name)
    }

    /// The types of its matrices (tensors of two or more dimensions), most tensors first (ties
    /// by name): `["Q4_K", "Q6_K"]` for a `Q4_K_M` file.
    pub fn weight_types(&self) -> Vec<String> {
        let mut counts: Vec<(String, usize)> = Vec::new();
        for t in self.tensors.iter().filter(|t| t.dims.len() >= 2) {
            let name = ggml_type_name(t.ggml_type);
            match counts.iter_mut().find(|(n, _)| *n == name) {
                Some((_, c)) => *c += 1,
                None => counts.push((name, 1)),
            }
        }
        counts.sort_by(|a, b| b.1.cmp(&a.1).then_with(|| a.0.cmp(&b.0)));
        counts.into_iter().map(|(n, _)| n).collect()
    }

    /// The first matrix whose type Ferry does not compute in, with that type's name.
    pub fn unserved_matrix(&self) -> Option<(&TensorInfo, String)> {
        self.tensors.iter().filter(|t| t.dims.len() >= 2).find_map(|t| {
            let name = ggml_type_name(t.ggml_type);
            (!SERVED_WEIGHT_TYPES.contains(&name.as_str())).then_some((t, name))
        })
    }
}

fn malformed(what: String) -> GgufError {
    GgufError::Malformed(what)
}

/// A reader that knows how many bytes the file has left, so no length read from the file can
/// make it allocate more than the file could hold.
struct Cursor<'a, R> {
    inner: &'a mut R,
    left: u64,
}

/// How deep arrays may nest (GGUF files use one level).
const MAX_NESTING: u32 = 4;

impl<R: Read> Cursor<'_, R> {
    fn bytes(&mut self, buf: &mut [u8]) -> Result<(), GgufError> {
        let n = buf.len() as u64;
        if n > self.left {
            return Err(malformed("the header runs past the end of the file".into()));
        }
        self.inner.read_exact(buf)?;
        self.left -= n;
        Ok(())
    }

    /// Fails unless `count` items of at least `each` bytes could fit in what is left.
    fn room_for(&self, count: u64, each: u64) -> Result<(), GgufError> {
        if count.saturating_mul(each) > self.left {
            return Err(malformed(format!(
                "{count} items of {each} bytes do not fit in the {} bytes left",
                self.left
            )));
        }
        Ok(())
    }

    fn array<const N: usize>(&mut self) -> Result<[u8; N], GgufError> {
        let mut b = [0u8; N];
        self.bytes(&mut b)?;
        Ok(b)
    }

    fn u32(&mut self) -> Result<u32, GgufError> {
        Ok(u32::from_le_bytes(self.array()?))
    }

    fn u64(&mut self) -> Result<u64, GgufError> {
        Ok(u64::from_le_bytes(self.array()?))
    }

    fn string(&mut self) -> Result<String, GgufError> {
        let len = self.u64()?;
        self.room_for(len, 1)?;
        let mut buf =
            vec![0u8; usize::try_from(len).map_err(|_| malformed("string too long".into()))?];
        self.bytes(&mut buf)?;
        String::from_utf8(buf).map_err(|_| malformed("a string is not UTF-8".into()))
    }

    fn value(&mut self, ty: u32, depth: u32) -> Result<Value, GgufError> {
        Ok(match ty {
            0 => Value::U64(u64::from(self.array::<1>()?[0])),
            1 => Value::I64(i64::from(i8::from_le_bytes(self.array()?))),
            2 => Value::U64(u64::from(u16::from_le_bytes(self.array()?))),
            3 => Value::I64(i64::from(i16::from_le_bytes(self.array()?))),
            4 => Value::U64(u64::from(self.u32()?)),
            5 => Value::I64(i64::from(i32::from_le_bytes(self.array()?))),
            6 => Value::F64(f64::from(f32::from_le_bytes(self.array()?))),
            7 => match self.array::<1>()?[0] {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                b => return Err(malformed(format!("bool value {b}"))),
            },
            8 => Value::String(self.string()?),
            9 => {
                if depth >= MAX_NESTING {
                    return Err(malformed("arrays nested too deep".into()));
                }
                let elem = self.u32()?;
                let count = self.u64()?;
                // Every element takes at least one byte.
                self.room_for(count, 1)?;
                let count =
                    usize::try_from(count).map_err(|_| malformed("array too long".into()))?;
                let mut items = Vec::with_capacity(count);
                for _ in 0..count {
                    items.push(self.value(elem, depth + 1)?);
                }
                Value::Array(items)
            }
            10 => Value::U64(self.u64()?),
            11 => Value::I64(i64::from_le_bytes(self.array()?)),
            12 => Value::F64(f64::from_le_bytes(self.array()?)),
            other => return Err(malformed(format!("unknown metadata value type {other}"))),
        })
    }
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;

    /// Builds a GGUF v3 file in memory from `(key, type, bytes)` metadata and tensor infos.
    pub(crate) struct Builder {
        kv: Vec<u8>,
        n_kv: u64,
        tensors: Vec<u8>,
        n_tensors: u64,
    }

    impl Builder {
        pub(crate) fn new() -> Self {
            Self { kv: Vec::new(), n_kv: 0, tensors: Vec::new(), n_tensors: 0 }
        }

        fn put_str(buf: &mut Vec<u8>, s: &str) {
            buf.extend_from_slice(&(s.len() as u64).to_le_bytes());
            buf.extend_from_slice(s.as_bytes());
        }

        pub(crate) fn string(mut self, key: &str, value: &str) -> Self {
            Self::put_str(&mut self.kv, key);
            self.kv.extend_from_slice(&8u32.to_le_bytes());
            Self::put_str(&mut self.kv, value);
            self.n_kv += 1;
            self
        }

        pub(crate) fn u32(mut self, key: &str, value: u32) -> Self {
            Self::put_str(&mut self.kv, key);
            self.kv.extend_from_slice(&4u32.to_le_bytes());
            self.kv.extend_from_slice(&value.to_le_bytes());
            self.n_kv += 1;
            self
        }

        pub(crate) fn f32(mut self, key: &str, value: f32) -> Self {
            Self::put_str(&mut self.kv, key);
            self.kv.extend_from_slice(&6u32.to_le_bytes());
            self.kv.extend_from_slice(&value.to_le_bytes());
            self.n_kv += 1;
            self
        }

        pub(crate) fn strings(mut self, key: &str, values: &[&str]) -> Self {
            Self::put_str(&mut self.kv, key);
            self.kv.extend_from_slice(&9u32.to_le_bytes());
            self.kv.extend_from_slice(&8u32.to_le_bytes());
            self.kv.extend_from_slice(&(values.len() as u64).to_le_bytes());
            for v in values {
                Self::put_str(&mut self.kv, v);
            }
            self.n_kv += 1;
            self
        }

        pub(crate) fn tensor(mut self, name: &str, dims: &[u64], ty: u32, offset: u64) -> Self {
            Self::put_str(&mut self.tensors, name);
            self.tensors.extend_from_slice(&(dims.len() as u32).to_le_bytes());
            for d in dims {
                self.tensors.extend_from_slice(&d.to_le_bytes());
            }
            self.tensors.extend_from_slice(&ty.to_le_bytes());
            self.tensors.extend_from_slice(&offset.to_le_bytes());
            self.n_tensors += 1;
            self
        }

        pub(crate) fn build(self) -> Vec<u8> {
            let mut out = MAGIC.to_vec();
            out.extend_from_slice(&3u32.to_le_bytes());
            out.extend_from_slice(&self.n_tensors.to_le_bytes());
            out.extend_from_slice(&self.n_kv.to_le_bytes());
            out.extend_from_slice(&self.kv);
            out.extend_from_slice(&self.tensors);
            out
        }
    }

    fn read(bytes: &[u8]) -> Result<GgufHeader, GgufError> {
        GgufHeader::read(&mut std::io::Cursor::new(bytes), bytes.len() as u64)
    }

    #[test]
    fn reads_metadata_and_tensor_table() {
        let bytes = Builder::new()
            .string("general.architecture", "llama")
            .u32("llama.block_count", 2)
            .f32("llama.rope.freq_base", 10_000.0)
            .strings("tokenizer.ggml.tokens", &["a", "b"])
            .tensor("token_embd.weight", &[8, 2], 3, 0)
            .build();
        let h = read(&bytes).unwrap();
        assert_eq!(h.version, 3);
        assert_eq!(h.get("general.architecture").and_then(Value::as_str), Some("llama"));
        assert_eq!(h.get("llama.block_count").and_then(Value::as_u32), Some(2));
        assert_eq!(h.get("llama.rope.freq_base").and_then(Value::as_f32), Some(10_000.0));
        assert_eq!(
            h.get("tokenizer.ggml.tokens").and_then(Value::as_array).map(<[_]>::len),
            Some(2)
        );
        let t = h.tensor("token_embd.weight").unwrap();
        assert_eq!((t.dims.as_slice(), t.ggml_type, t.offset), (&[8u64, 2][..], 3, 0));
        assert_eq!(h.data_offset % 32, 0);
        assert!(h.data_offset >= bytes.len() as u64);
    }

    #[test]
    fn refuses_what_is_not_a_whole_gguf_header() {
        assert!(matches!(read(b"GGML0000"), Err(GgufError::NotGguf)));
        let mut v9 = MAGIC.to_vec();
        v9.extend_from_slice(&9u32.to_le_bytes());
        assert!(matches!(read(&v9), Err(GgufError::Version(9))));
        let whole = Builder::new().strings("k", &["x", "y"]).build();
        for cut in 0..whole.len() {
            assert!(read(&whole[..cut]).is_err(), "a header cut at {cut} bytes was accepted");
        }
        // A count far past the file's size is refused before anything is allocated.
        let mut huge = MAGIC.to_vec();
        huge.extend_from_slice(&3u32.to_le_bytes());
        huge.extend_from_slice(&u64::MAX.to_le_bytes());
        huge.extend_from_slice(&0u64.to_le_bytes());
        assert!(matches!(read(&huge), Err(GgufError::Malformed(_))));
    }
}
