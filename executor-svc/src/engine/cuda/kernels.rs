//! The CUDA kernels of the forward, as CUDA C compiled at run time with NVRTC, so that building
//! Ferry needs no CUDA toolkit and no `nvcc`. cuBLAS does the matrix products; these kernels do
//! everything between them.
//!
//! Each kernel mirrors one step of the CPU forward (`forward::ops`, `forward::paged`): the same
//! formulas with the same association of operations, compiled without fused multiply-add
//! contraction (`--fmad=false`), so the two paths differ only where summation order differs and
//! in the device's `expf`, `tanhf` and `sincosf`. Layouts are the CPU path's: activations
//! are row-major `rows × width`; the KV cache is block-major,
//! `block × layer × {K, V} × slot × kv_dim`; a fused QKV row is `[q | k | v]`.
//!
//! Invariants the host keeps (checked at load or by batch validation, never in the kernels):
//! widths and row counts fit in `int` (positions and table offsets are 64-bit); block ids and
//! token ids are in range; `head_dim` is even and at most [`MAX_HEAD_DIM`]; `blockDim.x` is a
//! multiple of 32 wherever a kernel reduces.
//!
//! Run in CI under the CPU emulation of CUDA ([`crate::engine::cuda_emulation`]: the same source, compiled
//! for the host, each block's threads meeting at real barriers), where the forward matches the
//! CPU backend's logits to a few parts in a million (`tests.rs`). Not yet run on a GPU.

use std::sync::Arc;

use cudarc::driver::{CudaContext, CudaFunction, CudaModule};
use cudarc::nvrtc::{compile_ptx_with_opts, CompileOptions, Ptx};

use super::CudaError;

/// Largest head size the attention kernel holds per lane (`MAX_HEAD_DIM / 32` values each).
pub const MAX_HEAD_DIM: usize = 256;

/// Threads per block of the row kernels (a multiple of the warp size).
pub const ROW_THREADS: u32 = 256;

/// Warps per block of the attention kernel: they split a sequence's positions between them.
pub const ATTN_WARPS: u32 = 4;

/// The kernels' source. `MAX_HEAD_DIM` and `ATTN_WARPS` are prepended as `#define`s by
/// [`source`] so the host and the device agree on them.
const BODY: &str = r#"
#define WARP 32
// NVRTC has no <math.h>, so no INFINITY: build minus infinity from its bits.
#define NEG_INF __int_as_float((int)0xff800000u)

// Sum over a warp; every lane gets the total.
__device__ float warp_sum(float v) {
    for (int off = WARP / 2; off > 0; off >>= 1) v += __shfl_xor_sync(0xffffffffu, v, off);
    return v;
}

// Sum over the block; every thread gets the total. `scratch` holds one float per warp.
__device__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP, warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();  // `scratch` may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    // Every warp adds up the partial sums itself, so no broadcast is needed.
    return warp_sum(lane < warps ? scratch[lane] : 0.0f);
}

// out[r, :] = src[idx[r], :]: the embedding lookup, and picking the rows that want logits.
// Grid: one block per row.
extern "C" __global__ void gather_rows(float* __restrict__ out, const float* __restrict__ src,
                                       const unsigned int* __restrict__ idx, int rows,
                                       int width) {
    int r = blockIdx.x;
    if (r >= rows) return;
    const float* s = src + (size_t)idx[r] * width;
    float* o = out + (size_t)r * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = s[c];
}

// out = x / sqrt(mean(x^2) + eps) * w over `width` values, by the block's threads together
// (`out` may be `x`: each thread writes only what it read, after the block's sum).
__device__ void norm_by_block(float* out, const float* x, const float* w, int width, float eps,
                              float* scratch) {
    float ss = 0.0f;
    for (int c = threadIdx.x; c < width; c += blockDim.x) ss += x[c] * x[c];
    ss = block_sum(ss, scratch);
    float scale = 1.0f / sqrtf(ss / (float)width + eps);
    for (int c = threadIdx.x; c < width; c += blockDim.x) out[c] = x[c] * (scale * w[c]);
}

// out[r, :] = x[r, :] / sqrt(mean(x[r, :]^2) + eps) * w. Grid: one block per row.
extern "C" __global__ void rms_norm(float* __restrict__ out, const float* __restrict__ x,
                                    const float* __restrict__ w, int rows, int width,
                                    float eps) {
    __shared__ float scratch[32];
    int r = blockIdx.x;
    if (r >= rows) return;  // the whole block leaves together
    norm_by_block(out + (size_t)r * width, x + (size_t)r * width, w, width, eps, scratch);
}

// Each query and key head of fused [q | k | v] rows RMS-normed in place, query heads by `qw`,
// key heads by `kw` (`head_dim` each; Qwen 3). `qk_heads` = query heads + key heads, side by
// side at the start of each row. Grid: one block per (row, head).
extern "C" __global__ void head_norm(float* __restrict__ qkv, const float* __restrict__ qw,
                                     const float* __restrict__ kw, int rows, int q_heads,
                                     int qk_heads, int head_dim, int row_width, float eps) {
    __shared__ float scratch[32];
    int r = blockIdx.x / qk_heads, head = blockIdx.x % qk_heads;
    if (r >= rows) return;  // the whole block leaves together
    float* v = qkv + (size_t)r * row_width + (size_t)head * head_dim;
    norm_by_block(v, v, head < q_heads ? qw : kw, head_dim, eps, scratch);
}

// Rotary embedding, in place, on the Q and K heads of fused [q | k | v] rows: pair p < `pairs`
// of each head turns by pos * freqs[p], its sine and cosine times `mscale` (LongRoPE); the pair
// is (x[2p], x[2p+1]) (GGUF Llama's adjacent pairs) or, with `halves`, (x[p], x[p + pairs])
// (NEOX: Qwen); dimensions past 2 * pairs (a partial rotation) stay. `qk_heads` = query heads
// + key heads, which sit side by side at the start of each row.
extern "C" __global__ void rope(float* __restrict__ qkv, const unsigned long long* __restrict__ pos,
                                const float* __restrict__ freqs, int rows, int qk_heads,
                                int head_dim, int row_width, int halves, int pairs,
                                float mscale) {
    int step = halves ? 1 : 2, offset = halves ? pairs : 1;
    size_t total = (size_t)rows * qk_heads * pairs;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        int p = (int)(i % pairs);
        size_t t = i / pairs;
        int head = (int)(t % qk_heads);
        int r = (int)(t / qk_heads);
        float* v = qkv + (size_t)r * row_width + (size_t)head * head_dim + step * p;
        float s, c;
        sincosf((float)pos[r] * freqs[p], &s, &c);
        s *= mscale;
        c *= mscale;
        float a = v[0], b = v[offset];
        v[0] = a * c - b * s;
        v[offset] = a * s + b * c;
    }
}

// x[i] *= c for the first `n` values (Gemma's embeddings, by sqrt(width)).
extern "C" __global__ void scale(float* __restrict__ x, float c, unsigned long long n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        x[i] *= c;
    }
}

// x[i] = tanh(x[i] / c) * c for the first `n` values (Gemma 2's logits).
extern "C" __global__ void softcap(float* __restrict__ x, float c, unsigned long long n) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        x[i] = tanhf(x[i] / c) * c;
    }
}

// x[i] += y[i] for `rows` rows of `width` (a post-normed output joining the residual stream).
extern "C" __global__ void add_rows(float* __restrict__ x, const float* __restrict__ y,
                                    int rows, int width) {
    size_t total = (size_t)rows * width;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        x[i] += y[i];
    }
}

// x[r, j] += bias[j] for `rows` rows of `width` (Qwen 2's Q, K and V biases).
extern "C" __global__ void add_bias(float* __restrict__ x, const float* __restrict__ bias,
                                    int rows, int width) {
    size_t total = (size_t)rows * width;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        x[i] += bias[i % width];
    }
}

// Where (layer, kv, slot) of a block starts in the cache, in floats.
__device__ size_t cache_offset(unsigned int block, int layer, int kv, size_t slot,
                               int num_layers, int block_size, int kv_dim) {
    return ((((size_t)block * num_layers + layer) * 2 + kv) * block_size + slot) * (size_t)kv_dim;
}

// Copies each row's (rotated) K and its V into the cache at the row's position: block
// tables[row_table[r] + pos / block_size], slot pos % block_size.
extern "C" __global__ void kv_write(float* __restrict__ cache, const float* __restrict__ qkv,
                                    const unsigned long long* __restrict__ pos,
                                    const unsigned long long* __restrict__ row_table,
                                    const unsigned int* __restrict__ tables, int rows,
                                    int layer, int num_layers, int block_size, int kv_dim,
                                    int q_width, int row_width) {
    size_t total = (size_t)rows * kv_dim;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        int e = (int)(i % kv_dim);
        int r = (int)(i / kv_dim);
        unsigned long long p = pos[r];
        unsigned int block = tables[row_table[r] + p / block_size];
        size_t slot = p % block_size;
        const float* row = qkv + (size_t)r * row_width;
        cache[cache_offset(block, layer, 0, slot, num_layers, block_size, kv_dim) + e] =
            row[q_width + e];
        cache[cache_offset(block, layer, 1, slot, num_layers, block_size, kv_dim) + e] =
            row[q_width + kv_dim + e];
    }
}

// Causal attention of one query head of one row over positions 0..=pos of the row's sequence
// (the last `window` of them with a sliding window), read through its block table:
// out = softmax(cap(q . K^T * scale)) V, where cap(s) = tanh(s / softcap) * softcap when
// `softcap` > 0 (Gemma 2) and s otherwise. Grid: (rows, query heads);
// ATTN_WARPS warps per block. Warp w visits positions w, w + ATTN_WARPS, ... keeping a running
// maximum, normaliser and weighted sum (online softmax); the warps then merge their partials.
// Lane l holds dimensions l, l + 32, ... of the head.
extern "C" __global__ void paged_attention(float* __restrict__ out, const float* __restrict__ qkv,
                                           const float* __restrict__ cache,
                                           const unsigned long long* __restrict__ pos,
                                           const unsigned long long* __restrict__ row_table,
                                           const unsigned int* __restrict__ tables, int rows,
                                           int num_heads, int num_kv_heads, int head_dim,
                                           int layer, int num_layers, int block_size,
                                           int row_width, float scale,
                                           unsigned long long window, float softcap) {
    const int PER_LANE = MAX_HEAD_DIM / WARP;
    __shared__ float q_s[MAX_HEAD_DIM];
    __shared__ float max_s[ATTN_WARPS];
    __shared__ float sum_s[ATTN_WARPS];
    __shared__ float acc_s[ATTN_WARPS][MAX_HEAD_DIM];
    int r = blockIdx.x, head = blockIdx.y;
    if (r >= rows || head >= num_heads) return;
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int kv_dim = num_kv_heads * head_dim;
    int kv_head = head / (num_heads / num_kv_heads);
    const float* q = qkv + (size_t)r * row_width + (size_t)head * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) q_s[d] = q[d];
    __syncthreads();

    unsigned long long ctx = pos[r] + 1;
    unsigned long long first = ctx > window ? ctx - window : 0;
    const unsigned int* table = tables + row_table[r];
    float m = NEG_INF, l = 0.0f, acc[PER_LANE];
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) acc[j] = 0.0f;
    for (unsigned long long p = first + warp; p < ctx; p += ATTN_WARPS) {
        unsigned int block = table[p / block_size];
        size_t slot = p % block_size;
        const float* k =
            cache + cache_offset(block, layer, 0, slot, num_layers, block_size, kv_dim) +
            (size_t)kv_head * head_dim;
        const float* v =
            cache + cache_offset(block, layer, 1, slot, num_layers, block_size, kv_dim) +
            (size_t)kv_head * head_dim;
        float dot = 0.0f;
        for (int d = lane; d < head_dim; d += WARP) dot += q_s[d] * k[d];
        float s = warp_sum(dot) * scale;
        if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
        float m_new = fmaxf(m, s);
        float carry = expf(m - m_new);  // 0 on the first position (m is -inf)
        float weight = expf(s - m_new);
        l = l * carry + weight;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            int d = lane + WARP * j;
            if (d < head_dim) acc[j] = acc[j] * carry + weight * v[d];
        }
        m = m_new;
    }
    if (lane == 0) {
        max_s[warp] = m;
        sum_s[warp] = l;
    }
#pragma unroll
    for (int j = 0; j < PER_LANE; ++j) {
        int d = lane + WARP * j;
        if (d < head_dim) acc_s[warp][d] = acc[j];
    }
    __syncthreads();

    // Merge: rescale each warp's partials to the overall maximum. A warp that saw no
    // position (ctx < ATTN_WARPS) has m = -inf and contributes nothing.
    float m_all = NEG_INF;
    for (int w = 0; w < ATTN_WARPS; ++w) m_all = fmaxf(m_all, max_s[w]);
    float factor[ATTN_WARPS];
    float l_all = 0.0f;
    for (int w = 0; w < ATTN_WARPS; ++w) {
        factor[w] = max_s[w] == NEG_INF ? 0.0f : expf(max_s[w] - m_all);
        l_all += sum_s[w] * factor[w];
    }
    float inv = 1.0f / l_all;
    float* o = out + (size_t)r * num_heads * head_dim + (size_t)head * head_dim;
    for (int d = threadIdx.x; d < head_dim; d += blockDim.x) {
        float sum = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) sum += acc_s[w][d] * factor[w];
        o[d] = sum * inv;
    }
}

// From rows of [gate | up] (each `width` wide): out[r, j] = act(gate[j]) * up[j], act being
// silu, or with `gelu` GELU's tanh form (Gemma).
extern "C" __global__ void gate_mul(float* __restrict__ out, const float* __restrict__ gate_up,
                                    int rows, int width, int gelu) {
    size_t total = (size_t)rows * width;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        size_t r = i / width;
        int j = (int)(i % width);
        float g = gate_up[r * 2 * width + j];
        float u = gate_up[r * 2 * width + width + j];
        if (gelu) {
            float inner = 0.7978846f * (g + 0.044715f * g * g * g);
            out[i] = 0.5f * g * (1.0f + tanhf(inner)) * u;
        } else {
            out[i] = g / (1.0f + expf(-g)) * u;
        }
    }
}
"#;

/// The full CUDA C source, with the host's constants.
pub fn source() -> String {
    format!("#define MAX_HEAD_DIM {MAX_HEAD_DIM}\n#define ATTN_WARPS {ATTN_WARPS}\n{BODY}")
}

/// Compiles [`source`] to PTX. Needs only the NVRTC library, not a GPU or a driver.
pub fn compile() -> Result<Ptx, CudaError> {
    let opts = CompileOptions {
        // Plain multiplies and adds, as the CPU path does (see the module comment).
        fmad: Some(false),
        prec_div: Some(true),
        prec_sqrt: Some(true),
        name: Some("ferry_forward.cu".into()),
        ..Default::default()
    };
    compile_ptx_with_opts(source(), opts).map_err(|e| CudaError::Compile(describe_compile(&e)))
}

/// NVRTC's error with its log as text (the `Debug` form prints the log as escaped bytes).
fn describe_compile(e: &cudarc::nvrtc::CompileError) -> String {
    match e {
        cudarc::nvrtc::CompileError::CompileError { nvrtc, log, .. } => {
            format!("{nvrtc:?}: {}", log.to_string_lossy())
        }
        other => format!("{other:?}"),
    }
}

/// The loaded kernels, one handle each.
#[derive(Debug)]
pub struct Kernels {
    /// Keeps the module loaded for as long as the handles live.
    _module: Arc<CudaModule>,
    /// [`BODY`]'s `gather_rows`.
    pub gather_rows: CudaFunction,
    /// [`BODY`]'s `rms_norm`.
    pub rms_norm: CudaFunction,
    /// [`BODY`]'s `rope`.
    pub rope: CudaFunction,
    /// [`BODY`]'s `add_bias`.
    pub add_bias: CudaFunction,
    /// [`BODY`]'s `head_norm`.
    pub head_norm: CudaFunction,
    /// [`BODY`]'s `kv_write`.
    pub kv_write: CudaFunction,
    /// [`BODY`]'s `paged_attention`.
    pub paged_attention: CudaFunction,
    /// [`BODY`]'s `gate_mul`.
    pub gate_mul: CudaFunction,
    /// [`BODY`]'s `scale`.
    pub scale: CudaFunction,
    /// [`BODY`]'s `softcap`.
    pub softcap: CudaFunction,
    /// [`BODY`]'s `add_rows`.
    pub add_rows: CudaFunction,
}

impl Kernels {
    /// Compiles the kernels and loads them into `ctx`.
    pub fn load(ctx: &Arc<CudaContext>) -> Result<Self, CudaError> {
        let module =
            ctx.load_module(compile()?).map_err(CudaError::driver("loading the kernels"))?;
        let f = |name: &str| {
            module.load_function(name).map_err(CudaError::driver("finding a kernel in the module"))
        };
        Ok(Self {
            gather_rows: f("gather_rows")?,
            rms_norm: f("rms_norm")?,
            rope: f("rope")?,
            add_bias: f("add_bias")?,
            head_norm: f("head_norm")?,
            kv_write: f("kv_write")?,
            paged_attention: f("paged_attention")?,
            gate_mul: f("gate_mul")?,
            scale: f("scale")?,
            softcap: f("softcap")?,
            add_rows: f("add_rows")?,
            _module: module,
        })
    }
}
