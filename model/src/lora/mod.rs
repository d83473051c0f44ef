//! LoRA adapters: the two formats people have them in, read into one form the forward applies
//! and checked against the base model they are meant for.
//!
//! - PEFT's folder: `adapter_config.json` (rank `r`, `lora_alpha`, `target_modules`, …) and
//!   `adapter_model.safetensors` (`…layers.{i}.self_attn.q_proj.lora_A.weight`, `lora_B`, in
//!   Hugging Face's layout).
//! - llama.cpp's LoRA GGUF (`convert_lora_to_gguf.py`): `general.type = "adapter"`,
//!   `adapter.lora.alpha`, tensors `blk.{i}.attn_q.weight.lora_a` / `lora_b`, in the GGUF
//!   model's layout.
//!
//! A GGUF Llama file holds Q and K with each head's rows permuted for llama.cpp's rotation
//! ([`RopeStyle::Adjacent`]), and the base weights the forward multiplies by are those. So a
//! PEFT adapter's `lora_B` rows for Q and K are permuted the same way here, as llama.cpp's
//! converter does when it writes a LoRA GGUF (whose `lora_b` is already permuted). `lora_A`
//! (rank × inputs) needs nothing.
//!
//! The update of a projection `y = W x` is `y += scale · B (A x)`, `scale = alpha / r`
//! (`alpha / √r` with rsLoRA). Every update is placed where it lands in the forward's stacked
//! products (`[q | k | v]`, `[gate | up]`), so a backend adds it to the columns it names.

mod gguf;
mod peft;

use std::path::{Path, PathBuf};

use crate::family::RopeStyle;
use crate::shape::LlamaShape;

/// The rank Ferry takes when none is configured (vLLM's `--max-lora-rank` default).
pub const DEFAULT_MAX_LORA_RANK: usize = 16;
/// Longest adapter name, in bytes.
pub const MAX_ADAPTER_NAME_BYTES: usize = 128;
/// Longest adapter path, in bytes.
pub const MAX_ADAPTER_PATH_BYTES: usize = 1024;

/// A block's projection an adapter may update.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Module {
    /// Query projection.
    Q,
    /// Key projection.
    K,
    /// Value projection.
    V,
    /// A fused `[q | k | v]` projection (Phi-3's `qkv_proj`).
    Qkv,
    /// Attention output projection.
    O,
    /// Feed-forward gate.
    Gate,
    /// Feed-forward up projection.
    Up,
    /// A fused `[gate | up]` projection (Phi-3's `gate_up_proj`).
    GateUp,
    /// Feed-forward down projection.
    Down,
}

/// One of the forward's four products per block, whose output an update adds to.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(usize)]
pub enum Product {
    /// `[q | k | v]`, from the attention norm's output.
    Qkv,
    /// The attention output projection, from the attention's output.
    O,
    /// `[gate | up]`, from the feed-forward norm's output.
    GateUp,
    /// The down projection, from the gated activation.
    Down,
}

impl Module {
    /// Every module, in a fixed order.
    pub const ALL: [Module; 9] = [
        Module::Q,
        Module::K,
        Module::V,
        Module::Qkv,
        Module::O,
        Module::Gate,
        Module::Up,
        Module::GateUp,
        Module::Down,
    ];

    /// Its name in PEFT (and Hugging Face) files.
    #[must_use]
    pub fn peft_name(self) -> &'static str {
        match self {
            Module::Q => "q_proj",
            Module::K => "k_proj",
            Module::V => "v_proj",
            Module::Qkv => "qkv_proj",
            Module::O => "o_proj",
            Module::Gate => "gate_proj",
            Module::Up => "up_proj",
            Module::GateUp => "gate_up_proj",
            Module::Down => "down_proj",
        }
    }

    /// Its tensor name in GGUF files (`blk.{i}.<name>.weight`).
    #[must_use]
    pub fn gguf_name(self) -> &'static str {
        match self {
            Module::Q => "attn_q",
            Module::K => "attn_k",
            Module::V => "attn_v",
            Module::Qkv => "attn_qkv",
            Module::O => "attn_output",
            Module::Gate => "ffn_gate",
            // A fused family's `ffn_up` is `[gate | up]` (see `Family::fused`).
            Module::Up | Module::GateUp => "ffn_up",
            Module::Down => "ffn_down",
        }
    }

    /// The module a GGUF tensor name's part names for a model of `fused` layout.
    fn from_gguf(name: &str, fused: bool) -> Option<Module> {
        if name == "ffn_up" {
            return Some(if fused { Module::GateUp } else { Module::Up });
        }
        Module::ALL
            .into_iter()
            .find(|m| !matches!(m, Module::Up | Module::GateUp) && m.gguf_name() == name)
    }

    /// Where its output lands for a model of `shape`: the product, the first column there, and
    /// the projection's inputs and outputs.
    #[must_use]
    pub fn place(self, shape: &LlamaShape) -> (Product, usize, usize, usize) {
        let (h, q, kv, ff) = (shape.hidden, shape.q_dim(), shape.kv_dim(), shape.intermediate);
        match self {
            Module::Q => (Product::Qkv, 0, h, q),
            Module::K => (Product::Qkv, q, h, kv),
            Module::V => (Product::Qkv, q + kv, h, kv),
            Module::Qkv => (Product::Qkv, 0, h, q + 2 * kv),
            Module::O => (Product::O, 0, q, h),
            Module::Gate => (Product::GateUp, 0, h, ff),
            Module::Up => (Product::GateUp, ff, h, ff),
            Module::GateUp => (Product::GateUp, 0, h, 2 * ff),
            Module::Down => (Product::Down, 0, ff, h),
        }
    }
}

/// One projection's low-rank update, placed in its product.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraDelta {
    /// The module it updates.
    pub module: Module,
    /// The first column of the product's output it adds to.
    pub col: usize,
    /// The projection's inputs.
    pub in_features: usize,
    /// The projection's outputs (columns `col..col + out_features`).
    pub out_features: usize,
    /// `A`, `rank × in_features`, row-major.
    pub a: Vec<f32>,
    /// `Bᵀ`, `rank × out_features`, row-major (`B`'s rows in the base file's order): the update
    /// adds `t_k · Bᵀ[k]` to the outputs for each `k`, a pass over contiguous columns.
    pub bt: Vec<f32>,
    /// `alpha / r` (or `alpha / √r`).
    pub scale: f32,
}

impl LoraDelta {
    /// Its rank (`A`'s rows).
    #[must_use]
    pub fn rank(&self) -> usize {
        self.a.len() / self.in_features
    }

    /// Adds `scale · B (A x)` to `out[col..col + out_features]` for one row `x`; `t` is
    /// scratch. Every sum runs in one fixed order, so a row's result does not depend on what
    /// else is computed.
    ///
    /// `#[inline]`: a backend compiles it into its own vector-width context.
    #[inline]
    pub fn add_to(&self, x: &[f32], out: &mut [f32], t: &mut Vec<f32>) {
        t.clear();
        t.extend(self.a.chunks_exact(self.in_features).map(|a| dot(a, x) * self.scale));
        let out = &mut out[self.col..self.col + self.out_features];
        for (&tk, row) in t.iter().zip(self.bt.chunks_exact(self.out_features)) {
            for (o, b) in out.iter_mut().zip(row) {
                *o += tk * b;
            }
        }
    }
}

/// `Σ aᵢ·bᵢ` in eight interleaved partial sums, added pairwise at the end: a fixed order the
/// compiler can keep in vector registers.
#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let (ca, cb) = (a.chunks_exact(8), b.chunks_exact(8));
    let (ra, rb) = (ca.remainder(), cb.remainder());
    for (x, y) in ca.zip(cb) {
        for i in 0..8 {
            acc[i] += x[i] * y[i];
        }
    }
    for (i, (x, y)) in ra.iter().zip(rb).enumerate() {
        acc[i] += x * y;
    }
    let q = [acc[0] + acc[4], acc[1] + acc[5], acc[2] + acc[6], acc[3] + acc[7]];
    (q[0] + q[2]) + (q[1] + q[3])
}

/// One block's updates, by product ([`Product`] indexes them).
#[derive(Clone, Debug, Default, PartialEq)]
pub struct LoraLayer([Vec<LoraDelta>; 4]);

impl LoraLayer {
    /// The updates of `product`.
    #[must_use]
    pub fn deltas(&self, product: Product) -> &[LoraDelta] {
        &self.0[product as usize]
    }

    /// Adds an update of `product`.
    pub fn push(&mut self, product: Product, delta: LoraDelta) {
        self.0[product as usize].push(delta);
    }

    /// Every update, product by product.
    pub fn all(&self) -> impl Iterator<Item = &LoraDelta> {
        self.0.iter().flatten()
    }
}

/// Which file format an adapter came from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum LoraFormat {
    /// PEFT's `adapter_config.json` + `adapter_model.safetensors`.
    Peft,
    /// llama.cpp's LoRA GGUF.
    Gguf,
}

/// An adapter read, checked against its base model, and ready to apply.
#[derive(Clone, Debug, PartialEq)]
pub struct LoraAdapter {
    /// This reading's id, unique in the process ([`LoraAdapter::next_id`]): a backend that
    /// copies an adapter to its device keys the copy by it.
    pub id: u64,
    /// Where it was read from.
    pub path: PathBuf,
    /// Its format.
    pub format: LoraFormat,
    /// Its updates, one entry per block of the base model (empty where it has none).
    pub layers: Vec<LoraLayer>,
}

impl LoraAdapter {
    /// A new [`LoraAdapter::id`].
    #[must_use]
    pub fn next_id() -> u64 {
        static NEXT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(1);
        NEXT.fetch_add(1, std::sync::atomic::Ordering::Relaxed)
    }

    fn deltas(&self) -> impl Iterator<Item = &LoraDelta> {
        self.layers.iter().flat_map(LoraLayer::all)
    }

    /// Its largest rank.
    #[must_use]
    pub fn rank(&self) -> usize {
        self.deltas().map(LoraDelta::rank).max().unwrap_or(0)
    }

    /// The modules it updates, in [`Module::ALL`]'s order.
    #[must_use]
    pub fn modules(&self) -> Vec<Module> {
        let mut modules: Vec<Module> = self.deltas().map(|d| d.module).collect();
        modules.sort();
        modules.dedup();
        modules
    }
}

/// Why an adapter could not be used.
#[derive(Debug, thiserror::Error)]
pub enum LoraError {
    /// A file could not be read.
    #[error("LoRA adapter {path}: {source}")]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// The files are not an adapter Ferry can read, or ask for something it does not do.
    #[error("LoRA adapter {path}: {reason}")]
    Invalid {
        /// The folder or file.
        path: PathBuf,
        /// What is wrong, naming the field or tensor.
        reason: String,
    },
    /// A well-formed adapter that does not fit the base model (shapes, layers, rank).
    #[error("LoRA adapter {path} does not fit the model: {reason}")]
    Unfit {
        /// The folder or file.
        path: PathBuf,
        /// The mismatch.
        reason: String,
    },
}

/// `path` as given, or in `base_dir` when relative (an adapter's path is in the model's
/// folder unless absolute).
#[must_use]
pub fn resolve(base_dir: Option<&Path>, path: &str) -> PathBuf {
    match base_dir {
        Some(dir) if Path::new(path).is_relative() => dir.join(path),
        _ => PathBuf::from(path),
    }
}

/// The float encodings adapters come in.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Floats {
    F32,
    F16,
    Bf16,
}

impl Floats {
    /// Bytes per value.
    pub(crate) fn width(self) -> usize {
        match self {
            Floats::F32 => 4,
            Floats::F16 | Floats::Bf16 => 2,
        }
    }

    /// `bytes` (little-endian values) as `f32`.
    pub(crate) fn decode(self, bytes: &[u8]) -> Vec<f32> {
        let halves = |f: fn(u16) -> f32| {
            bytes.chunks_exact(2).map(|c| f(u16::from_le_bytes([c[0], c[1]]))).collect()
        };
        match self {
            Floats::F32 => bytes
                .chunks_exact(4)
                .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                .collect(),
            Floats::F16 => halves(|h| half::f16::from_bits(h).to_f32()),
            Floats::Bf16 => halves(|h| half::bf16::from_bits(h).to_f32()),
        }
    }
}

/// One module's matrices as a file holds them, before they are checked.
pub(crate) struct RawDelta {
    pub(crate) layer: usize,
    pub(crate) module: Module,
    /// `A`: its rows (the rank) and columns (inputs), row-major.
    pub(crate) a: (usize, usize, Vec<f32>),
    /// `B`: its rows (outputs) and columns (the rank), row-major.
    pub(crate) b: (usize, usize, Vec<f32>),
    /// `alpha / r` for this module.
    pub(crate) scale: f32,
}

/// Reads the adapter at `path` for a model of `shape`, refusing ranks above `max_rank`.
///
/// `path` is a PEFT folder (or a file in one), or a LoRA GGUF file (or a folder holding one).
pub fn load(path: &Path, shape: &LlamaShape, max_rank: usize) -> Result<LoraAdapter, LoraError> {
    let (format, path) = locate(path)?;
    let raw = match format {
        LoraFormat::Peft => peft::read(&path, shape)?,
        LoraFormat::Gguf => gguf::read(&path, shape)?,
    };
    assemble(path, format, raw, shape, max_rank)
}

/// The format and the path to read for `path`.
fn locate(path: &Path) -> Result<(LoraFormat, PathBuf), LoraError> {
    let invalid = |reason: String| LoraError::Invalid { path: path.to_path_buf(), reason };
    let meta = std::fs::metadata(path)
        .map_err(|source| LoraError::Io { path: path.to_path_buf(), source })?;
    if meta.is_file() {
        let name = path.file_name().and_then(|n| n.to_str()).unwrap_or_default();
        if path.extension().is_some_and(|e| e.eq_ignore_ascii_case("gguf")) {
            return Ok((LoraFormat::Gguf, path.to_path_buf()));
        }
        if matches!(name, "adapter_config.json" | "adapter_model.safetensors") {
            let dir = path.parent().unwrap_or(Path::new("."));
            return Ok((LoraFormat::Peft, dir.to_path_buf()));
        }
        return Err(invalid("not a LoRA GGUF (.gguf) or a PEFT adapter's file".into()));
    }
    if path.join("adapter_config.json").is_file() {
        return Ok((LoraFormat::Peft, path.to_path_buf()));
    }
    let io = |source| LoraError::Io { path: path.to_path_buf(), source };
    let mut ggufs = Vec::new();
    for entry in std::fs::read_dir(path).map_err(io)? {
        let p = entry.map_err(io)?.path();
        if p.extension().is_some_and(|e| e == "gguf") {
            ggufs.push(p);
        }
    }
    match ggufs.as_slice() {
        [one] => Ok((LoraFormat::Gguf, one.clone())),
        [] => Err(invalid("the folder has no adapter_config.json and no .gguf file".into())),
        _ => Err(invalid(format!("the folder holds {} .gguf files: name one", ggufs.len()))),
    }
}

/// Checks every matrix against the model and places it.
fn assemble(
    path: PathBuf,
    format: LoraFormat,
    raw: Vec<RawDelta>,
    shape: &LlamaShape,
    max_rank: usize,
) -> Result<LoraAdapter, LoraError> {
    let unfit = |reason: String| LoraError::Unfit { path: path.clone(), reason };
    if raw.is_empty() {
        return Err(LoraError::Invalid {
            path: path.clone(),
            reason: "it has no LoRA tensors".into(),
        });
    }
    let mut layers = vec![LoraLayer::default(); shape.num_layers];
    for RawDelta { layer, module, a, b, scale } in raw {
        let what = format!("layer {layer} {}", module.peft_name());
        if layer >= shape.num_layers {
            return Err(unfit(format!("{what}: the model has {} layers", shape.num_layers)));
        }
        let (product, col, inputs, outputs) = module.place(shape);
        let r = a.0;
        if a.1 != inputs {
            return Err(unfit(format!(
                "{what}: A is {}×{}, the model's projection takes {inputs} inputs",
                a.0, a.1
            )));
        }
        if b.0 != outputs {
            return Err(unfit(format!(
                "{what}: B is {}×{}, the model's projection has {outputs} outputs",
                b.0, b.1
            )));
        }
        if b.1 != r {
            return Err(unfit(format!("{what}: A has rank {r}, B has rank {}", b.1)));
        }
        if r == 0 || r > max_rank {
            return Err(unfit(format!("{what}: rank {r} is above --max-lora-rank {max_rank}")));
        }
        let permute_heads = match (module, shape.family.rope, format) {
            (Module::Q, RopeStyle::Adjacent, LoraFormat::Peft) => Some(shape.num_heads),
            (Module::K, RopeStyle::Adjacent, LoraFormat::Peft) => Some(shape.num_kv_heads),
            (Module::Qkv, RopeStyle::Adjacent, _) => {
                return Err(unfit(format!(
                    "{what}: a fused qkv update on a model with llama.cpp's rotation"
                )));
            }
            _ => None,
        };
        let mut bm = b.2;
        if let Some(heads) = permute_heads {
            bm = permute_rows(&bm, heads, shape.head_dim, r);
        }
        let delta = LoraDelta {
            module,
            col,
            in_features: inputs,
            out_features: outputs,
            a: a.2,
            bt: transpose(&bm, outputs, r),
            scale,
        };
        let l = &mut layers[layer];
        if l.deltas(product).iter().any(|d| d.module == module) {
            return Err(LoraError::Invalid {
                path: path.clone(),
                reason: format!("{what} appears twice"),
            });
        }
        l.push(product, delta);
    }
    Ok(LoraAdapter { id: LoraAdapter::next_id(), path, format, layers })
}

/// `m` (`rows × cols`, row-major) transposed.
fn transpose(m: &[f32], rows: usize, cols: usize) -> Vec<f32> {
    (0..cols).flat_map(|c| (0..rows).map(move |r| m[r * cols + c])).collect()
}

/// Hugging Face's Q or K rows (`heads` heads of `head_dim` rows, `cols` wide) in llama.cpp's
/// order: within each head, row `t·half + i` moves to `2i + t` (its converter's `permute`).
fn permute_rows(b: &[f32], heads: usize, head_dim: usize, cols: usize) -> Vec<f32> {
    let half = head_dim / 2;
    let mut out = vec![0f32; b.len()];
    for h in 0..heads {
        for t in 0..2 {
            for i in 0..half {
                let from = (h * head_dim + t * half + i) * cols;
                let to = (h * head_dim + 2 * i + t) * cols;
                out[to..to + cols].copy_from_slice(&b[from..from + cols]);
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
