//! Typed launches of the kernels in [`super::kernels`]: one method per kernel, taking device
//! buffers and host sizes, checking the buffer lengths the kernel relies on before the
//! `unsafe` launch. Indices *inside* buffers (token ids, block ids, rows picked for logits)
//! come from a batch that has passed validation; the kernels do not check them again.

use cudarc::driver::{CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg};
use ferry_model::{Activation, RopeStyle};

use super::cache::KvData;
use super::kernels::{Kernels, ATTN_GROUP, ATTN_WARPS, ROW_THREADS};
use super::CudaError;

/// Most blocks a grid-stride kernel is launched with; each thread then loops.
const MAX_BLOCKS: usize = 1 << 16;

/// A host size as the kernels' `int`. Every size passed here was checked against `i32::MAX`
/// (model dimensions at load, row counts by the batch plan).
pub fn int(v: usize) -> i32 {
    i32::try_from(v).expect("sizes are checked against i32::MAX before they reach a kernel")
}

/// One block of [`ROW_THREADS`] per row.
fn per_row(rows: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (int(rows) as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// Enough blocks of [`ROW_THREADS`] to cover `total` elements, capped (the kernels stride).
fn elementwise(total: usize) -> LaunchConfig {
    let blocks = total.div_ceil(ROW_THREADS as usize).clamp(1, MAX_BLOCKS);
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (ROW_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The batch geometry that the KV write and the attention read: which rows, where each
/// row's position and block table are, and which layer of the cache.
pub struct PagedContext<'a> {
    /// Rows in the batch.
    pub rows: usize,
    /// Head geometry of the fused rows.
    pub heads: Heads,
    /// Position of each row.
    pub positions: &'a CudaSlice<u64>,
    /// Start of each row's block table in `tables`.
    pub row_table: &'a CudaSlice<u64>,
    /// All block tables.
    pub tables: &'a CudaSlice<u32>,
    /// Layer whose keys and values are written or read.
    pub layer: usize,
    /// Layers in the cache.
    pub num_layers: usize,
    /// Tokens per block.
    pub block_size: usize,
}

impl PagedContext<'_> {
    /// The per-row buffers hold every row.
    fn rows_fit(&self) -> bool {
        self.positions.len() >= self.rows && self.row_table.len() >= self.rows
    }
}

/// The head geometry of fused `[q | k | v]` rows.
#[derive(Clone, Copy, Debug)]
pub struct Heads {
    /// Query heads.
    pub num_heads: usize,
    /// Key/value heads.
    pub num_kv_heads: usize,
    /// Size of one head.
    pub head_dim: usize,
}

impl Heads {
    /// Width of the query part (= hidden).
    pub fn q_width(self) -> usize {
        self.num_heads * self.head_dim
    }

    /// Width of the key (or value) part.
    pub fn kv_dim(self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Width of a fused row.
    pub fn row_width(self) -> usize {
        self.q_width() + 2 * self.kv_dim()
    }
}

impl Kernels {
    /// `out[r] = src[idx[r]]` for `rows` rows of `width`.
    pub fn gather_rows(
        &self,
        stream: &CudaStream,
        out: &mut CudaSlice<f32>,
        src: &CudaSlice<f32>,
        idx: &CudaSlice<u32>,
        rows: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        assert!(out.len() >= rows * width && idx.len() >= rows, "gather_rows buffers too small");
        let (rows_i, width_i) = (int(rows), int(width));
        let mut b = stream.launch_builder(&self.gather_rows);
        b.arg(out).arg(src).arg(idx).arg(&rows_i).arg(&width_i);
        // SAFETY: arguments match the kernel's signature; `out` and `idx` hold `rows` rows
        // (checked above) and every index is a valid row of `src` (validated batch).
        unsafe { b.launch(per_row(rows)) }.map_err(CudaError::driver("launching gather_rows"))?;
        Ok(())
    }

    /// `out[r] = rms_norm(x[r]) · w` for `rows` rows of `w.len()`.
    pub fn rms_norm(
        &self,
        stream: &CudaStream,
        out: &mut CudaSlice<f32>,
        x: &CudaSlice<f32>,
        w: &CudaSlice<f32>,
        rows: usize,
        eps: f32,
    ) -> Result<(), CudaError> {
        let width = w.len();
        assert!(out.len() >= rows * width && x.len() >= rows * width, "rms_norm buffers too small");
        let (rows_i, width_i) = (int(rows), int(width));
        let mut b = stream.launch_builder(&self.rms_norm);
        b.arg(out).arg(x).arg(w).arg(&rows_i).arg(&width_i).arg(&eps);
        // SAFETY: arguments match the kernel's signature; every buffer holds what it reads or
        // writes (checked above); blocks have ROW_THREADS threads, a multiple of 32.
        unsafe { b.launch(per_row(rows)) }.map_err(CudaError::driver("launching rms_norm"))?;
        Ok(())
    }

    /// Adds `bias` to each of `rows` rows of `x` (each `bias.len()` wide) in place.
    pub fn add_bias(
        &self,
        stream: &CudaStream,
        x: &mut CudaSlice<f32>,
        bias: &CudaSlice<f32>,
        rows: usize,
    ) -> Result<(), CudaError> {
        let width = bias.len();
        assert!(x.len() >= rows * width, "add_bias buffers too small");
        launch_rows(stream, &self.add_bias, (x, bias), (rows, width), "launching add_bias")
    }

    /// RMS-norms each query head (by `q_norm`) and key head (by `k_norm`) of `rows` fused rows
    /// in place.
    pub fn head_norm(
        &self,
        stream: &CudaStream,
        qkv: &mut CudaSlice<f32>,
        (q_norm, k_norm): (&CudaSlice<f32>, &CudaSlice<f32>),
        rows: usize,
        heads: Heads,
        eps: f32,
    ) -> Result<(), CudaError> {
        assert!(
            qkv.len() >= rows * heads.row_width()
                && q_norm.len() >= heads.head_dim
                && k_norm.len() >= heads.head_dim,
            "head_norm buffers too small"
        );
        let qk_heads = heads.num_heads + heads.num_kv_heads;
        let (rows_i, q_i, qk_i) = (int(rows), int(heads.num_heads), int(qk_heads));
        let (hd_i, row_i) = (int(heads.head_dim), int(heads.row_width()));
        let mut b = stream.launch_builder(&self.head_norm);
        b.arg(qkv).arg(q_norm).arg(k_norm).arg(&rows_i).arg(&q_i).arg(&qk_i).arg(&hd_i);
        b.arg(&row_i).arg(&eps);
        // SAFETY: arguments match the kernel's signature; sizes checked above; blocks have
        // ROW_THREADS threads, a multiple of 32.
        unsafe { b.launch(per_row(rows * qk_heads)) }
            .map_err(CudaError::driver("launching head_norm"))?;
        Ok(())
    }

    /// Rotates the query and key heads of `rows` fused rows in place, by the `rotary`
    /// frequencies (one per pair: the first `2 · freqs.len()` dimensions of each head turn),
    /// pairing and `mscale`.
    pub fn rope(
        &self,
        stream: &CudaStream,
        qkv: &mut CudaSlice<f32>,
        positions: &CudaSlice<u64>,
        (freqs, style, mscale): (&CudaSlice<f32>, RopeStyle, f32),
        rows: usize,
        heads: Heads,
    ) -> Result<(), CudaError> {
        assert!(
            qkv.len() >= rows * heads.row_width()
                && positions.len() >= rows
                && freqs.len() <= heads.head_dim / 2,
            "rope buffers too small"
        );
        let pairs = int(freqs.len());
        let qk_heads = heads.num_heads + heads.num_kv_heads;
        let (rows_i, qk_i, hd_i, row_i) =
            (int(rows), int(qk_heads), int(heads.head_dim), int(heads.row_width()));
        let halves = i32::from(style == RopeStyle::Halves);
        let mut b = stream.launch_builder(&self.rope);
        b.arg(qkv).arg(positions).arg(freqs).arg(&rows_i).arg(&qk_i).arg(&hd_i).arg(&row_i);
        b.arg(&halves).arg(&pairs).arg(&mscale);
        let cfg = elementwise(rows * qk_heads * freqs.len());
        // SAFETY: arguments match the kernel's signature; sizes checked above.
        unsafe { b.launch(cfg) }.map_err(CudaError::driver("launching rope"))?;
        Ok(())
    }

    /// Writes the keys and values of `ctx.rows` fused rows into `cache` for `ctx.layer`.
    pub fn kv_write(
        &self,
        stream: &CudaStream,
        cache: &mut KvData,
        qkv: &CudaSlice<f32>,
        ctx: &PagedContext<'_>,
    ) -> Result<(), CudaError> {
        let (rows, heads) = (ctx.rows, ctx.heads);
        assert!(
            qkv.len() >= rows * heads.row_width() && ctx.rows_fit(),
            "kv_write buffers too small"
        );
        let (rows_i, layer_i, layers_i, bs_i) =
            (int(rows), int(ctx.layer), int(ctx.num_layers), int(ctx.block_size));
        let (kv_i, q_i, row_i) =
            (int(heads.kv_dim()), int(heads.q_width()), int(heads.row_width()));
        let mut b = stream.launch_builder(&self.kv_write[cache.kind()]);
        match cache {
            KvData::F32(c) => b.arg(c),
            KvData::F16(c) => b.arg(c),
        };
        b.arg(qkv).arg(ctx.positions).arg(ctx.row_table).arg(ctx.tables);
        b.arg(&rows_i).arg(&layer_i).arg(&layers_i).arg(&bs_i).arg(&kv_i).arg(&q_i).arg(&row_i);
        // SAFETY: arguments match the kernel's signature; per-row buffers checked above; the
        // batch's block tables cover every position and name blocks inside the cache.
        unsafe { b.launch(elementwise(rows * heads.kv_dim())) }
            .map_err(CudaError::driver("launching kv_write"))?;
        Ok(())
    }

    /// Causal attention of every query head of `ctx.rows` fused rows over their sequences'
    /// context in `cache` (the last `window` positions of it; `usize::MAX`: all), scores
    /// scaled by `scale` and soft-capped where `softcap` says; writes `rows × q_width` into
    /// `out`. One block per row and KV head (and per [`ATTN_GROUP`] of its query heads), so
    /// each cached key and value is read once for the query heads that share it.
    #[allow(clippy::too_many_arguments)]
    pub fn paged_attention(
        &self,
        stream: &CudaStream,
        out: &mut CudaSlice<f32>,
        qkv: &CudaSlice<f32>,
        cache: &KvData,
        ctx: &PagedContext<'_>,
        (scale, window, softcap): (f32, usize, Option<f32>),
    ) -> Result<(), CudaError> {
        let (rows, heads) = (ctx.rows, ctx.heads);
        assert!(
            out.len() >= rows * heads.q_width()
                && qkv.len() >= rows * heads.row_width()
                && ctx.rows_fit(),
            "paged_attention buffers too small"
        );
        let (rows_i, nh_i, nkv_i, hd_i) =
            (int(rows), int(heads.num_heads), int(heads.num_kv_heads), int(heads.head_dim));
        let (layer_i, layers_i, bs_i, row_i) =
            (int(ctx.layer), int(ctx.num_layers), int(ctx.block_size), int(heads.row_width()));
        let mut b = stream.launch_builder(&self.attention[cache.kind()]);
        b.arg(out).arg(qkv);
        match cache {
            KvData::F32(c) => b.arg(c),
            KvData::F16(c) => b.arg(c),
        };
        b.arg(ctx.positions).arg(ctx.row_table).arg(ctx.tables);
        b.arg(&rows_i).arg(&nh_i).arg(&nkv_i).arg(&hd_i).arg(&layer_i).arg(&layers_i);
        let (window, softcap) = (window as u64, softcap.unwrap_or(0.0));
        b.arg(&bs_i).arg(&row_i).arg(&scale).arg(&window).arg(&softcap);
        let group = heads.num_heads / heads.num_kv_heads;
        let cfg = LaunchConfig {
            // Rows on x (up to 2^31 - 1 blocks), KV heads on y (up to 65 535), groups of
            // query heads on z (1 unless a KV head serves more than ATTN_GROUP).
            grid_dim: (rows_i as u32, nkv_i as u32, group.div_ceil(ATTN_GROUP as usize) as u32),
            block_dim: (32 * ATTN_WARPS, 1, 1),
            shared_mem_bytes: 0,
        };
        // SAFETY: arguments match the kernel's signature; per-row buffers checked above;
        // head_dim <= MAX_HEAD_DIM (checked at load); the tables cover positions 0..=pos of
        // every row, whose keys and values this or an earlier step wrote.
        unsafe { b.launch(cfg) }.map_err(CudaError::driver("launching paged_attention"))?;
        Ok(())
    }

    /// `out[i]` = `x[i]` rounded to f16 (`bf16`: bfloat16) for the first `n` values.
    pub fn to_half(
        &self,
        stream: &CudaStream,
        out: &mut CudaSlice<u16>,
        x: &CudaSlice<f32>,
        n: usize,
        bf16: bool,
    ) -> Result<(), CudaError> {
        assert!(out.len() >= n && x.len() >= n, "to_half buffers too small");
        let (n_u, bf16_i) = (n as u64, i32::from(bf16));
        let mut b = stream.launch_builder(&self.to_half);
        b.arg(out).arg(x).arg(&n_u).arg(&bf16_i);
        // SAFETY: `to_half(unsigned short*, const float*, unsigned long long, int)`; both
        // buffers hold `n` values.
        unsafe { b.launch(elementwise(n)) }.map_err(CudaError::driver("launching to_half"))?;
        Ok(())
    }

    /// `out[r] = src[idx[r]]` widened to f32, for `rows` rows of `width` half-precision
    /// values (`bf16`: bfloat16).
    #[allow(clippy::too_many_arguments)]
    pub fn gather_rows_half(
        &self,
        stream: &CudaStream,
        out: &mut CudaSlice<f32>,
        (src, bf16): (&CudaSlice<u16>, bool),
        idx: &CudaSlice<u32>,
        rows: usize,
        width: usize,
    ) -> Result<(), CudaError> {
        assert!(out.len() >= rows * width && idx.len() >= rows, "gather_rows buffers too small");
        let (rows_i, width_i, bf16_i) = (int(rows), int(width), i32::from(bf16));
        let mut b = stream.launch_builder(&self.gather_rows_half);
        b.arg(out).arg(src).arg(idx).arg(&rows_i).arg(&width_i).arg(&bf16_i);
        // SAFETY: arguments match the kernel's signature; `out` and `idx` hold `rows` rows
        // (checked above) and every index is a valid row of `src` (validated batch).
        unsafe { b.launch(per_row(rows)) }
            .map_err(CudaError::driver("launching gather_rows_half"))?;
        Ok(())
    }

    /// `out[r] = act(gate[r]) · up[r]` from `rows` rows of `[gate | up]`, each `width` wide.
    pub fn gate_mul(
        &self,
        stream: &CudaStream,
        act: Activation,
        out: &mut CudaSlice<f32>,
        gate_up: &CudaSlice<f32>,
        (rows, width): (usize, usize),
    ) -> Result<(), CudaError> {
        assert!(
            out.len() >= rows * width && gate_up.len() >= rows * 2 * width,
            "gate_mul buffers too small"
        );
        let (rows_i, width_i) = (int(rows), int(width));
        let gelu = i32::from(act == Activation::GeluTanh);
        let mut b = stream.launch_builder(&self.gate_mul);
        b.arg(out).arg(gate_up).arg(&rows_i).arg(&width_i).arg(&gelu);
        // SAFETY: arguments match the kernel's signature; sizes checked above.
        unsafe { b.launch(elementwise(rows * width)) }
            .map_err(CudaError::driver("launching gate_mul"))?;
        Ok(())
    }

    /// `x += y` over `rows` rows of `width`.
    pub fn add_rows(
        &self,
        stream: &CudaStream,
        x: &mut CudaSlice<f32>,
        y: &CudaSlice<f32>,
        (rows, width): (usize, usize),
    ) -> Result<(), CudaError> {
        assert!(x.len() >= rows * width && y.len() >= rows * width, "add_rows buffers too small");
        launch_rows(stream, &self.add_rows, (x, y), (rows, width), "launching add_rows")
    }

    /// `x[i] = x[i] · c` (`scale`) or `tanh(x[i] / c) · c` (`softcap`) for the first `n`
    /// values of `x`.
    pub fn map(
        &self,
        stream: &CudaStream,
        (kernel, during): (&CudaFunction, &'static str),
        x: &mut CudaSlice<f32>,
        c: f32,
        n: usize,
    ) -> Result<(), CudaError> {
        assert!(x.len() >= n, "{during}: buffer too small");
        let n_u = n as u64;
        let mut b = stream.launch_builder(kernel);
        b.arg(x).arg(&c).arg(&n_u);
        // SAFETY: `kernel` takes (float*, float, unsigned long long); `x` holds `n` values.
        unsafe { b.launch(elementwise(n)) }.map_err(CudaError::driver(during))?;
        Ok(())
    }
}

/// Launches `kernel(out, input, rows, width)`, one thread per element of `rows × width`: the
/// signature of the row-wise kernels (`add_bias`, `add_rows`). The caller checks the sizes.
fn launch_rows(
    stream: &CudaStream,
    kernel: &CudaFunction,
    (out, input): (&mut CudaSlice<f32>, &CudaSlice<f32>),
    (rows, width): (usize, usize),
    during: &'static str,
) -> Result<(), CudaError> {
    let (rows_i, width_i) = (int(rows), int(width));
    let mut b = stream.launch_builder(kernel);
    b.arg(out).arg(input).arg(&rows_i).arg(&width_i);
    // SAFETY: `kernel` takes (float*, const float*, int, int); the caller checked the sizes.
    unsafe { b.launch(elementwise(rows * width)) }.map_err(CudaError::driver(during))?;
    Ok(())
}
