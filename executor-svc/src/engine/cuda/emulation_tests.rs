//! Tests of the CUDA emulation itself ([`crate::engine::cuda_emulation`]), through cudarc as the backend
//! calls it. Each is built to fail if the emulator were wrong in the way that would make a
//! wrong backend look right: threads of a block run one after another instead of meeting at a
//! barrier, warp shuffles reading lanes that have not written yet, cuBLAS's column-major,
//! transpose, leading-dimension or batch-stride semantics bent.

use std::sync::Arc;

use cudarc::cublas::sys::cublasOperation_t::{CUBLAS_OP_N, CUBLAS_OP_T};
use cudarc::cublas::{CudaBlas, Gemm, GemmConfig, StridedBatchedConfig};
use cudarc::driver::{CudaContext, CudaStream, LaunchConfig, PushKernelArg};
use cudarc::nvrtc::compile_ptx;

use crate::engine::cuda_emulation::{Emulation, TestDevice};

/// The emulated device's stream, or `None` (with a note) where the emulation is not wanted.
fn emulated_stream() -> Option<Arc<CudaStream>> {
    match TestDevice::installed() {
        TestDevice::Emulated(_) => {
            Some(CudaContext::new(0).expect("the emulated device").default_stream())
        }
        TestDevice::Gpu => {
            eprintln!("skipped: FERRY_CUDA_TESTS=gpu tests the GPU, not the emulation");
            None
        }
        TestDevice::Skip => None,
    }
}

/// `blocks` blocks of `threads` threads.
fn grid(blocks: usize, threads: usize) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (blocks as u32, 1, 1),
        block_dim: (threads as u32, 1, 1),
        shared_mem_bytes: 0,
    }
}

const KERNELS: &str = r#"
// Each thread doubles its input into shared memory; after the barrier it reads its neighbour's.
// Threads run one after another without meeting at the barrier would read a neighbour's slot
// before it was written (holding the previous block's value).
extern "C" __global__ void neighbour(float* out, const float* in) {
    __shared__ float s[256];
    int t = threadIdx.x;
    size_t base = (size_t)blockIdx.x * blockDim.x;
    s[t] = in[base + t] * 2.0f;
    __syncthreads();
    out[base + t] = s[(t + 1) % blockDim.x];
}

// The sum of a block's inputs by warp shuffles (down) and shared memory, written by thread 0;
// then every lane writes what its warp's xor-reduction gave it, as its last act: lanes that
// finish first must not take their values with them.
extern "C" __global__ void block_sum(float* sums, float* lanes, const float* in) {
    __shared__ float partial[32];
    int t = threadIdx.x, lane = t % 32, warp = t / 32;
    float v = in[(size_t)blockIdx.x * blockDim.x + t];
    float d = v;
    for (int off = 16; off > 0; off >>= 1) d += __shfl_down_sync(0xffffffffu, d, off);
    if (lane == 0) partial[warp] = d;
    __syncthreads();
    if (t == 0) {
        float total = 0.0f;
        for (int w = 0; w < (int)(blockDim.x / 32); ++w) total += partial[w];
        sums[blockIdx.x] = total;
    }
    float x = v;
    for (int off = 16; off > 0; off >>= 1) x += __shfl_xor_sync(0xffffffffu, x, off);
    lanes[(size_t)blockIdx.x * blockDim.x + t] = x;
}
"#;

#[test]
fn emulated_threads_meet_at_the_barrier_and_share_the_blocks_memory() {
    let Some(stream) = emulated_stream() else { return };
    let module = stream.context().load_module(compile_ptx(KERNELS).unwrap()).unwrap();
    let f = module.load_function("neighbour").unwrap();
    let (blocks, threads) = (3usize, 256usize);
    let input: Vec<f32> = (0..blocks * threads).map(|i| i as f32).collect();
    let d_in = stream.clone_htod(&input).unwrap();
    let mut d_out = stream.alloc_zeros::<f32>(blocks * threads).unwrap();
    let before = Emulation::stats().unwrap();
    let mut b = stream.launch_builder(&f);
    b.arg(&mut d_out).arg(&d_in);
    let cfg = grid(blocks, threads);
    // SAFETY: `neighbour(float*, const float*)` over `blocks × threads` values each.
    unsafe { b.launch(cfg) }.unwrap();
    let out = stream.clone_dtoh(&d_out).unwrap();
    for (i, v) in out.iter().enumerate() {
        let (blk, t) = (i / threads, i % threads);
        let expected = 2.0 * (blk * threads + (t + 1) % threads) as f32;
        assert_eq!(*v, expected, "block {blk} thread {t}");
    }
    let after = Emulation::stats().unwrap();
    assert_eq!(after.launches - before.launches, 1);
    // Every thread but the last of each block waited at the barrier.
    assert_eq!(after.fiber_switches - before.fiber_switches, (blocks * (threads - 1)) as u64);
}

#[test]
fn emulated_warp_shuffles_reduce_like_a_warp() {
    let Some(stream) = emulated_stream() else { return };
    let module = stream.context().load_module(compile_ptx(KERNELS).unwrap()).unwrap();
    let f = module.load_function("block_sum").unwrap();
    let (blocks, threads) = (2usize, 128usize);
    // Small integers: every sum is exact in f32 whatever the order.
    let input: Vec<f32> = (0..blocks * threads).map(|i| ((i * 7) % 23) as f32).collect();
    let d_in = stream.clone_htod(&input).unwrap();
    let mut sums = stream.alloc_zeros::<f32>(blocks).unwrap();
    let mut lanes = stream.alloc_zeros::<f32>(blocks * threads).unwrap();
    let mut b = stream.launch_builder(&f);
    b.arg(&mut sums).arg(&mut lanes).arg(&d_in);
    let cfg = grid(blocks, threads);
    // SAFETY: `block_sum(float*, float*, const float*)` with the sizes above.
    unsafe { b.launch(cfg) }.unwrap();
    let sums = stream.clone_dtoh(&sums).unwrap();
    let lanes = stream.clone_dtoh(&lanes).unwrap();
    for blk in 0..blocks {
        let block = &input[blk * threads..(blk + 1) * threads];
        assert_eq!(sums[blk], block.iter().sum::<f32>(), "block {blk}");
        for (w, warp) in block.chunks(32).enumerate() {
            let total: f32 = warp.iter().sum();
            for lane in 0..32 {
                let got = lanes[blk * threads + w * 32 + lane];
                assert_eq!(got, total, "block {blk} warp {w} lane {lane}");
            }
        }
    }
}

/// Column-major `op(A)·op(B)` computed naively: `a` is `m × k` (or `k × m` stored when
/// transposed), leading dimensions as given.
#[allow(clippy::too_many_arguments)]
fn naive(
    (ta, tb): (bool, bool),
    (m, n, k): (usize, usize, usize),
    a: &[f32],
    lda: usize,
    b: &[f32],
    ldb: usize,
) -> Vec<f32> {
    let mut c = vec![0f32; m * n];
    for j in 0..n {
        for i in 0..m {
            let mut s = 0f64;
            for l in 0..k {
                let x = if ta { a[l + i * lda] } else { a[i + l * lda] };
                let y = if tb { b[j + l * ldb] } else { b[l + j * ldb] };
                s += f64::from(x) * f64::from(y);
            }
            c[i + j * m] = s as f32;
        }
    }
    c
}

#[test]
fn emulated_strided_gemm_matches_a_naive_product() {
    let Some(stream) = emulated_stream() else { return };
    let blas = CudaBlas::new(stream.clone()).unwrap();
    let (m, n, k, batches) = (5usize, 3usize, 7usize, 2usize);
    // A transposed (stored k × m, lda = k + 2: padding rows), B as is (k × n, ldb = k + 1).
    let (lda, ldb) = (k + 2, k + 1);
    let (stride_a, stride_b, stride_c) = (lda * m + 3, ldb * n + 1, m * n);
    let value = |i: usize| ((i * 37 % 101) as f32 - 50.0) / 16.0;
    let a: Vec<f32> = (0..stride_a * batches).map(value).collect();
    let b: Vec<f32> = (0..stride_b * batches).map(|i| value(i + 11)).collect();
    let (d_a, d_b) = (stream.clone_htod(&a).unwrap(), stream.clone_htod(&b).unwrap());
    // C starts at 1: beta = 0.5 must add half of it.
    let mut d_c = stream.clone_htod(&vec![1f32; stride_c * batches]).unwrap();
    let cfg = StridedBatchedConfig {
        gemm: GemmConfig {
            transa: CUBLAS_OP_T,
            transb: CUBLAS_OP_N,
            m: m as i32,
            n: n as i32,
            k: k as i32,
            alpha: 2.0f32,
            lda: lda as i32,
            ldb: ldb as i32,
            beta: 0.5,
            ldc: m as i32,
        },
        batch_size: batches as i32,
        stride_a: stride_a as i64,
        stride_b: stride_b as i64,
        stride_c: stride_c as i64,
    };
    let before = Emulation::stats().unwrap();
    // SAFETY: every matrix lies inside its buffer (strides and leading dimensions above).
    unsafe { blas.gemm_strided_batched(cfg, &d_a, &d_b, &mut d_c) }.unwrap();
    let c = stream.clone_dtoh(&d_c).unwrap();
    for batch in 0..batches {
        let want = naive(
            (true, false),
            (m, n, k),
            &a[batch * stride_a..],
            lda,
            &b[batch * stride_b..],
            ldb,
        );
        for (i, w) in want.iter().enumerate() {
            let got = c[batch * stride_c + i];
            let expected = 2.0 * w + 0.5;
            assert!((got - expected).abs() <= 1e-4 * expected.abs().max(1.0), "{batch}/{i}");
        }
    }
    assert_eq!(Emulation::stats().unwrap().gemms - before.gemms, batches as u64);
    // A leading dimension below the stored rows is refused, as cuBLAS refuses it.
    let mut bad = cfg;
    bad.gemm.lda = (k - 1) as i32;
    // SAFETY: refused before any memory is read.
    assert!(unsafe { blas.gemm_strided_batched(bad, &d_a, &d_b, &mut d_c) }.is_err());
}

#[test]
fn an_entry_point_the_emulation_lacks_fails_loudly_naming_it() {
    // Managed memory is not emulated: a backend that began to call it would fail here, in
    // cudarc's loader, with the entry point's name, not quietly get something else.
    if emulated_stream().is_none() {
        return;
    }
    let failed = std::panic::catch_unwind(|| {
        let mut ptr = 0u64;
        // SAFETY: the call never reaches a driver: its symbol is missing.
        unsafe { cudarc::driver::sys::cuMemAllocManaged(&raw mut ptr, 16, 1) }
    })
    .expect_err("cuMemAllocManaged is not emulated");
    let message = failed
        .downcast_ref::<String>()
        .cloned()
        .or_else(|| failed.downcast_ref::<&str>().map(|s| (*s).to_string()))
        .unwrap_or_default();
    assert!(message.contains("cuMemAllocManaged"), "{message}");
}
