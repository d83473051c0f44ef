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

// A LoRA update of the listed rows: out[row, col + j] += sum_k t_k * bt[k, j], t_k = scale *
// (a[k, :] . x[row, :]), for each row in `rows` (`n` of them), as the CPU forward adds it (the
// k in order into each output). `a` is rank x in_features, `bt` rank x out_features, both
// row-major; x rows are `x_width` wide, out rows `out_width`. Grid: one block per listed row;
// rank <= LORA_MAX_RANK.
#define LORA_MAX_RANK 256
extern "C" __global__ void lora_add(float* __restrict__ out, const float* __restrict__ x,
                                    const unsigned int* __restrict__ rows, int n,
                                    const float* __restrict__ a, const float* __restrict__ bt,
                                    int rank, int in_features, int x_width, int col,
                                    int out_features, int out_width, float scale) {
    __shared__ float scratch[32];
    __shared__ float t[LORA_MAX_RANK];
    int i = blockIdx.x;
    if (i >= n) return;  // the whole block leaves together
    const float* xr = x + (size_t)rows[i] * x_width;
    for (int k = 0; k < rank; k++) {
        const float* ak = a + (size_t)k * in_features;
        float s = 0.0f;
        for (int c = threadIdx.x; c < in_features; c += blockDim.x) s += ak[c] * xr[c];
        s = block_sum(s, scratch);
        if (threadIdx.x == 0) t[k] = s * scale;
    }
    __syncthreads();
    float* o = out + (size_t)rows[i] * out_width + col;
    for (int j = threadIdx.x; j < out_features; j += blockDim.x) {
        float acc = o[j];
        for (int k = 0; k < rank; k++) acc += t[k] * bt[(size_t)k * out_features + j];
        o[j] = acc;
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

// ---- half precision, as bits in unsigned shorts: no header needed (NVRTC has no
// cuda_fp16.h of its own), and the same integer code on the GPU and under the emulation.
// Round to nearest, ties to even, as cuBLAS and the host's converters round.

__device__ float f16_to_f32(unsigned short h) {
    unsigned int sign = (unsigned int)(h & 0x8000u) << 16, exp = (h >> 10) & 0x1fu,
                 man = h & 0x3ffu;
    unsigned int bits;
    if (exp == 0x1fu) {
        bits = sign | 0x7f800000u | (man << 13);
    } else if (exp != 0) {
        bits = sign | ((exp + 112u) << 23) | (man << 13);
    } else if (man == 0) {
        bits = sign;
    } else {  // subnormal: shift the leading one into place
        int e = -1;
        do {
            ++e;
            man <<= 1;
        } while (!(man & 0x400u));
        bits = sign | ((unsigned int)(112 - e) << 23) | ((man & 0x3ffu) << 13);
    }
    return __uint_as_float(bits);
}

__device__ unsigned short f32_to_f16(float f) {
    unsigned int b = __float_as_uint(f);
    unsigned short sign = (unsigned short)((b >> 16) & 0x8000u);
    unsigned int abs = b & 0x7fffffffu;
    if (abs >= 0x7f800000u) return sign | 0x7c00u | (abs > 0x7f800000u ? 0x200u : 0u);
    if (abs >= 0x477ff000u) return sign | 0x7c00u;  // rounds past 65504: infinity
    if (abs < 0x38800000u) {                          // a subnormal half, or zero
        if (abs < 0x33000000u) return sign;
        unsigned int e = abs >> 23, man = (abs & 0x7fffffu) | 0x800000u;
        unsigned int shift = 126u - e;  // 14 to 24
        unsigned int h = man >> shift, rest = man & ((1u << shift) - 1u),
                     halfway = 1u << (shift - 1u);
        if (rest > halfway || (rest == halfway && (h & 1u))) ++h;
        return sign | (unsigned short)h;
    }
    unsigned int h = (abs >> 13) - (112u << 10), rest = abs & 0x1fffu;
    if (rest > 0x1000u || (rest == 0x1000u && (h & 1u))) ++h;
    return sign | (unsigned short)h;
}

__device__ float bf16_to_f32(unsigned short h) { return __uint_as_float((unsigned int)h << 16); }

__device__ unsigned short f32_to_bf16(float f) {
    unsigned int b = __float_as_uint(f);
    if ((b & 0x7fffffffu) > 0x7f800000u) return (unsigned short)((b >> 16) | 0x40u);  // NaN
    b += 0x7fffu + ((b >> 16) & 1u);
    return (unsigned short)(b >> 16);
}

__device__ float half_to_f32(unsigned short h, int bf16) {
    return bf16 ? bf16_to_f32(h) : f16_to_f32(h);
}

// out[i] = x[i] rounded to f16 (or, with `bf16`, bfloat16), for the first `n` values: the
// activations a half-precision product takes.
extern "C" __global__ void to_half(unsigned short* __restrict__ out, const float* __restrict__ x,
                                   unsigned long long n, int bf16) {
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < n;
         i += (size_t)gridDim.x * blockDim.x) {
        out[i] = bf16 ? f32_to_bf16(x[i]) : f32_to_f16(x[i]);
    }
}

// out[r, :] = src[idx[r], :] from half-precision rows (the embeddings), widened to f32.
// Grid: one block per row.
extern "C" __global__ void gather_rows_half(float* __restrict__ out,
                                            const unsigned short* __restrict__ src,
                                            const unsigned int* __restrict__ idx, int rows,
                                            int width, int bf16) {
    int r = blockIdx.x;
    if (r >= rows) return;
    const unsigned short* s = src + (size_t)idx[r] * width;
    float* o = out + (size_t)r * width;
    for (int c = threadIdx.x; c < width; c += blockDim.x) o[c] = half_to_f32(s[c], bf16);
}

// ---- the paged KV cache, in f32 or f16 ----

__device__ float kv_load(const float* p) { return *p; }
__device__ float kv_load(const unsigned short* p) { return f16_to_f32(*p); }
__device__ void kv_store(float* p, float v) { *p = v; }
__device__ void kv_store(unsigned short* p, float v) { *p = f32_to_f16(v); }

// Where (layer, kv, slot) of a block starts in the cache, in elements.
__device__ size_t cache_offset(unsigned int block, int layer, int kv, size_t slot,
                               int num_layers, int block_size, int kv_dim) {
    return ((((size_t)block * num_layers + layer) * 2 + kv) * block_size + slot) * (size_t)kv_dim;
}

// Copies each row's (rotated) K and its V into the cache at the row's position: block
// tables[row_table[r] + pos / block_size], slot pos % block_size.
template <typename T>
__device__ void kv_write(T* __restrict__ cache, const float* __restrict__ qkv,
                         const unsigned long long* __restrict__ pos,
                         const unsigned long long* __restrict__ row_table,
                         const unsigned int* __restrict__ tables, int rows, int layer,
                         int num_layers, int block_size, int kv_dim, int q_width, int row_width) {
    size_t total = (size_t)rows * kv_dim;
    for (size_t i = (size_t)blockIdx.x * blockDim.x + threadIdx.x; i < total;
         i += (size_t)gridDim.x * blockDim.x) {
        int e = (int)(i % kv_dim);
        int r = (int)(i / kv_dim);
        unsigned long long p = pos[r];
        unsigned int block = tables[row_table[r] + p / block_size];
        size_t slot = p % block_size;
        const float* row = qkv + (size_t)r * row_width;
        kv_store(cache + cache_offset(block, layer, 0, slot, num_layers, block_size, kv_dim) + e,
                 row[q_width + e]);
        kv_store(cache + cache_offset(block, layer, 1, slot, num_layers, block_size, kv_dim) + e,
                 row[q_width + kv_dim + e]);
    }
}

// The entry points, one per cache type (written out: kernels are not defined through macros).
extern "C" __global__ void kv_write_f32(float* __restrict__ cache, const float* __restrict__ qkv,
                                        const unsigned long long* __restrict__ pos,
                                        const unsigned long long* __restrict__ row_table,
                                        const unsigned int* __restrict__ tables, int rows,
                                        int layer, int num_layers, int block_size, int kv_dim,
                                        int q_width, int row_width) {
    kv_write(cache, qkv, pos, row_table, tables, rows, layer, num_layers, block_size, kv_dim,
             q_width, row_width);
}

extern "C" __global__ void kv_write_f16(unsigned short* __restrict__ cache,
                                        const float* __restrict__ qkv,
                                        const unsigned long long* __restrict__ pos,
                                        const unsigned long long* __restrict__ row_table,
                                        const unsigned int* __restrict__ tables, int rows,
                                        int layer, int num_layers, int block_size, int kv_dim,
                                        int q_width, int row_width) {
    kv_write(cache, qkv, pos, row_table, tables, rows, layer, num_layers, block_size, kv_dim,
             q_width, row_width);
}

// Causal attention of one row's query heads that share a KV head (up to ATTN_GROUP of them:
// blockIdx.z picks which ATTN_GROUP) over positions 0..=pos of the row's sequence (the last
// `window` of them with a sliding window), through its block table: each position's key and
// value are read once for all those heads. out = softmax(cap(q . K^T * scale)) V, where
// cap(s) = tanh(s / softcap) * softcap when `softcap` > 0 (Gemma 2) and s otherwise.
// Grid: (rows, KV heads, ceil(group / ATTN_GROUP)); ATTN_WARPS warps per block. Warp w visits
// positions w, w + ATTN_WARPS, ... keeping, per head, a running maximum, normaliser and
// weighted sum (online softmax); the warps then merge their partials. Lane l holds dimensions
// l, l + 32, ... of the head.
template <typename T>
__device__ void attention(float* __restrict__ out, const float* __restrict__ qkv,
                          const T* __restrict__ cache, const unsigned long long* __restrict__ pos,
                          const unsigned long long* __restrict__ row_table,
                          const unsigned int* __restrict__ tables, int rows, int num_heads,
                          int num_kv_heads, int head_dim, int layer, int num_layers,
                          int block_size, int row_width, float scale, unsigned long long window,
                          float softcap) {
    const int PER_LANE = MAX_HEAD_DIM / WARP;
    __shared__ float q_s[ATTN_GROUP][MAX_HEAD_DIM];
    __shared__ float max_s[ATTN_WARPS][ATTN_GROUP];
    __shared__ float sum_s[ATTN_WARPS][ATTN_GROUP];
    __shared__ float acc_s[ATTN_WARPS][ATTN_GROUP][MAX_HEAD_DIM];
    int r = blockIdx.x, kv_head = blockIdx.y;
    int group = num_heads / num_kv_heads;
    int first_head = kv_head * group + (int)blockIdx.z * ATTN_GROUP;
    int heads = kv_head * group + group - first_head;
    if (heads > ATTN_GROUP) heads = ATTN_GROUP;
    if (r >= rows || kv_head >= num_kv_heads || heads <= 0) return;  // the whole block leaves
    int lane = threadIdx.x % WARP, warp = threadIdx.x / WARP;
    int kv_dim = num_kv_heads * head_dim;
    const float* q = qkv + (size_t)r * row_width + (size_t)first_head * head_dim;
    for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x)
        q_s[i / head_dim][i % head_dim] = q[i];
    __syncthreads();

    unsigned long long ctx = pos[r] + 1;
    unsigned long long first = ctx > window ? ctx - window : 0;
    const unsigned int* table = tables + row_table[r];
    float m[ATTN_GROUP], l[ATTN_GROUP], acc[ATTN_GROUP][PER_LANE];
#pragma unroll
    for (int h = 0; h < ATTN_GROUP; ++h) {
        m[h] = NEG_INF;
        l[h] = 0.0f;
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) acc[h][j] = 0.0f;
    }
    for (unsigned long long p = first + warp; p < ctx; p += ATTN_WARPS) {
        unsigned int block = table[p / block_size];
        size_t slot = p % block_size;
        const T* k = cache + cache_offset(block, layer, 0, slot, num_layers, block_size, kv_dim) +
                     (size_t)kv_head * head_dim;
        const T* v = cache + cache_offset(block, layer, 1, slot, num_layers, block_size, kv_dim) +
                     (size_t)kv_head * head_dim;
        float kr[PER_LANE], vr[PER_LANE];  // this lane's part of the key and value, read once
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            int d = lane + WARP * j;
            kr[j] = d < head_dim ? kv_load(k + d) : 0.0f;
            vr[j] = d < head_dim ? kv_load(v + d) : 0.0f;
        }
#pragma unroll
        for (int h = 0; h < ATTN_GROUP; ++h) {
            if (h >= heads) break;  // the same for every lane: the shuffles stay converged
            float dot = 0.0f;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) {
                int d = lane + WARP * j;
                if (d < head_dim) dot += q_s[h][d] * kr[j];
            }
            float s = warp_sum(dot) * scale;
            if (softcap > 0.0f) s = tanhf(s / softcap) * softcap;
            float m_new = fmaxf(m[h], s);
            float carry = expf(m[h] - m_new);  // 0 on the first position (m is -inf)
            float weight = expf(s - m_new);
            l[h] = l[h] * carry + weight;
#pragma unroll
            for (int j = 0; j < PER_LANE; ++j) acc[h][j] = acc[h][j] * carry + weight * vr[j];
            m[h] = m_new;
        }
    }
#pragma unroll
    for (int h = 0; h < ATTN_GROUP; ++h) {
        if (h >= heads) break;
        if (lane == 0) {
            max_s[warp][h] = m[h];
            sum_s[warp][h] = l[h];
        }
#pragma unroll
        for (int j = 0; j < PER_LANE; ++j) {
            int d = lane + WARP * j;
            if (d < head_dim) acc_s[warp][h][d] = acc[h][j];
        }
    }
    __syncthreads();

    // Merge: rescale each warp's partials to the head's overall maximum. A warp that saw no
    // position (ctx < ATTN_WARPS) has m = -inf and contributes nothing.
    for (int i = threadIdx.x; i < heads * head_dim; i += blockDim.x) {
        int h = i / head_dim, d = i % head_dim;
        float m_all = NEG_INF;
        for (int w = 0; w < ATTN_WARPS; ++w) m_all = fmaxf(m_all, max_s[w][h]);
        float l_all = 0.0f, sum = 0.0f;
        for (int w = 0; w < ATTN_WARPS; ++w) {
            float factor = max_s[w][h] == NEG_INF ? 0.0f : expf(max_s[w][h] - m_all);
            l_all += sum_s[w][h] * factor;
            sum += acc_s[w][h][d] * factor;
        }
        out[(size_t)r * num_heads * head_dim + (size_t)(first_head + h) * head_dim + d] =
            sum * (1.0f / l_all);
    }
}

extern "C" __global__ void attention_f32(
    float* __restrict__ out, const float* __restrict__ qkv, const float* __restrict__ cache,
    const unsigned long long* __restrict__ pos, const unsigned long long* __restrict__ row_table,
    const unsigned int* __restrict__ tables, int rows, int num_heads, int num_kv_heads,
    int head_dim, int layer, int num_layers, int block_size, int row_width, float scale,
    unsigned long long window, float softcap) {
    attention(out, qkv, cache, pos, row_table, tables, rows, num_heads, num_kv_heads, head_dim,
              layer, num_layers, block_size, row_width, scale, window, softcap);
}

extern "C" __global__ void attention_f16(
    float* __restrict__ out, const float* __restrict__ qkv,
    const unsigned short* __restrict__ cache, const unsigned long long* __restrict__ pos,
    const unsigned long long* __restrict__ row_table, const unsigned int* __restrict__ tables,
    int rows, int num_heads, int num_kv_heads, int head_dim, int layer, int num_layers,
    int block_size, int row_width, float scale, unsigned long long window, float softcap) {
    attention(out, qkv, cache, pos, row_table, tables, rows, num_heads, num_kv_heads, head_dim,
              layer, num_layers, block_size, row_width, scale, window, softcap);
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
