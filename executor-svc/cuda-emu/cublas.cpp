// Ferry's CPU emulation of CUDA — TEST INFRASTRUCTURE, NOT A BACKEND.
//
// cuBLAS (`libcublas`) as far as Ferry calls it: handles bound to a stream, and the products
// `Sgemm`, `SgemmStridedBatched`, `GemmEx` and `GemmStridedBatchedEx`, computed on the CPU with
// cuBLAS's semantics: column-major matrices, `op(A)` (m × k) and `op(B)` (k × n) by the
// transpose flags, leading dimensions, C = alpha·op(A)·op(B) + beta·C, and C not read when beta
// is 0. Half and bfloat16 inputs are widened exactly and summed in f32 (the compute type Ferry
// asks for). The extent each matrix's leading dimension implies is checked against the
// emulated driver's allocations, so a wrong `ld` or size fails here instead of reading past a
// buffer. Each product counts in the driver's statistics (`ferry_emu_stats`).

#include <dlfcn.h>
#include <stdint.h>
#include <stdio.h>

#include <vector>

#include "half.h"

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef int cublasStatus_t;
enum : cublasStatus_t {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_NOT_INITIALIZED = 1,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum { OP_N = 0, OP_T = 1, OP_C = 2 };
enum { R_32F = 0, R_16F = 2, R_16BF = 14 };
enum { COMPUTE_32F = 68, COMPUTE_32F_PEDANTIC = 69, COMPUTE_32F_FAST_16F = 74,
       COMPUTE_32F_FAST_16BF = 75, COMPUTE_32F_FAST_TF32 = 77 };

struct cublasContext {
    void* stream;
    int math_mode;
};
typedef cublasContext* cublasHandle_t;

namespace {

struct Driver {
    void (*note_gemm)() = nullptr;
    int (*inside)(unsigned long long, size_t) = nullptr;
};

const Driver& driver() {
    static Driver d = [] {
        Driver d;
        // The emulated driver is loaded before cuBLAS is used (cudarc opens it first).
        void* h = dlopen("libcuda.so", RTLD_NOW | RTLD_NOLOAD);
        if (h) {
            d.note_gemm = reinterpret_cast<void (*)()>(dlsym(h, "ferry_emu_note_gemm"));
            d.inside = reinterpret_cast<int (*)(unsigned long long, size_t)>(
                dlsym(h, "ferry_emu_inside"));
        }
        return d;
    }();
    return d;
}

cublasStatus_t invalid(const char* what, long long a, long long b) {
    fprintf(stderr, "ferry CUDA emulation: cuBLAS: %s (%lld, %lld)\n", what, a, b);
    return CUBLAS_STATUS_INVALID_VALUE;
}

int size_of(int type) { return type == R_32F ? 4 : 2; }

float load(const void* base, int type, size_t i) {
    switch (type) {
        case R_32F: return static_cast<const float*>(base)[i];
        case R_16F: return __half2float(static_cast<const __half*>(base)[i]);
        default: return __bfloat162float(static_cast<const __nv_bfloat16*>(base)[i]);
    }
}

void store(void* base, int type, size_t i, float v) {
    switch (type) {
        case R_32F: static_cast<float*>(base)[i] = v; break;
        case R_16F: static_cast<__half*>(base)[i] = __float2half_rn(v); break;
        default: static_cast<__nv_bfloat16*>(base)[i] = __float2bfloat16_rn(v); break;
    }
}

// Checks that a column-major `rows × cols` matrix with leading dimension `ld` lies in one
// device allocation.
bool in_device(const void* p, int type, int rows, int cols, int ld) {
    if (rows == 0 || cols == 0 || !driver().inside) return true;
    size_t bytes = (static_cast<size_t>(cols - 1) * ld + rows) * size_of(type);
    return driver().inside(reinterpret_cast<uintptr_t>(p), bytes);
}

cublasStatus_t gemm(int ta, int tb, int m, int n, int k, float alpha, const void* a, int at,
                    int lda, const void* b, int bt, int ldb, float beta, void* c, int ct, int ldc) {
    if (ta < OP_N || ta > OP_C || tb < OP_N || tb > OP_C) return invalid("operation", ta, tb);
    if (m < 0 || n < 0 || k < 0) return invalid("a negative size", m, n);
    int a_rows = ta == OP_N ? m : k, a_cols = ta == OP_N ? k : m;
    int b_rows = tb == OP_N ? k : n, b_cols = tb == OP_N ? n : k;
    if (lda < (a_rows > 1 ? a_rows : 1)) return invalid("lda below op(A)'s stored rows", lda, a_rows);
    if (ldb < (b_rows > 1 ? b_rows : 1)) return invalid("ldb below op(B)'s stored rows", ldb, b_rows);
    if (ldc < (m > 1 ? m : 1)) return invalid("ldc below m", ldc, m);
    if (k > 0 && !in_device(a, at, a_rows, a_cols, lda)) return invalid("A past its allocation", a_rows, a_cols);
    if (k > 0 && !in_device(b, bt, b_rows, b_cols, ldb)) return invalid("B past its allocation", b_rows, b_cols);
    if (!in_device(c, ct, m, n, ldc)) return invalid("C past its allocation", m, n);
    // op(B)'s columns widened to f32 and laid out contiguously once, then op(A)'s rows one at a
    // time: every dot product runs over two contiguous f32 vectors.
    size_t a_step = ta == OP_N ? lda : 1, a_row = ta == OP_N ? 1 : lda;
    size_t b_step = tb == OP_N ? 1 : ldb, b_col = tb == OP_N ? ldb : 1;
    std::vector<float> bs(static_cast<size_t>(n) * k), as(k);
    for (int j = 0; j < n; ++j)
        for (int l = 0; l < k; ++l) bs[static_cast<size_t>(j) * k + l] = load(b, bt, j * b_col + l * b_step);
    for (int i = 0; i < m; ++i) {
        for (int l = 0; l < k; ++l) as[l] = load(a, at, i * a_row + l * a_step);
        for (int j = 0; j < n; ++j) {
            // Eight partial sums in a fixed order: deterministic, and fast enough for the tests.
            const float* x = as.data();
            const float* y = bs.data() + static_cast<size_t>(j) * k;
            float part[8] = {0, 0, 0, 0, 0, 0, 0, 0};
            int l = 0;
            for (; l + 8 <= k; l += 8)
                for (int u = 0; u < 8; ++u) part[u] += x[l + u] * y[l + u];
            for (; l < k; ++l) part[l % 8] += x[l] * y[l];
            float dot = ((part[0] + part[1]) + (part[2] + part[3])) +
                        ((part[4] + part[5]) + (part[6] + part[7]));
            size_t ci = i + static_cast<size_t>(j) * ldc;
            float v = alpha * dot;
            if (beta != 0.0f) v += beta * load(c, ct, ci);
            store(c, ct, ci, v);
        }
    }
    if (driver().note_gemm) driver().note_gemm();
    return CUBLAS_STATUS_SUCCESS;
}

bool supported(int type) { return type == R_32F || type == R_16F || type == R_16BF; }

}  // namespace

EXPORT cublasStatus_t cublasCreate_v2(cublasHandle_t* h) {
    *h = new cublasContext{nullptr, 0};
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasDestroy_v2(cublasHandle_t h) {
    delete h;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasSetStream_v2(cublasHandle_t h, void* stream) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetStream_v2(cublasHandle_t h, void** stream) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    *stream = h->stream;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasSetMathMode(cublasHandle_t h, int mode) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    h->math_mode = mode;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGetMathMode(cublasHandle_t h, int* mode) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    *mode = h->math_mode;
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT const char* cublasGetStatusString(cublasStatus_t s) {
    switch (s) {
        case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
        default: return "CUBLAS_STATUS_INTERNAL_ERROR";
    }
}

EXPORT cublasStatus_t cublasSgemm_v2(cublasHandle_t h, int ta, int tb, int m, int n, int k,
                                     const float* alpha, const float* a, int lda, const float* b,
                                     int ldb, const float* beta, float* c, int ldc) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    return gemm(ta, tb, m, n, k, *alpha, a, R_32F, lda, b, R_32F, ldb, *beta, c, R_32F, ldc);
}

EXPORT cublasStatus_t cublasSgemmStridedBatched(cublasHandle_t h, int ta, int tb, int m, int n,
                                                int k, const float* alpha, const float* a,
                                                int lda, long long sa, const float* b, int ldb,
                                                long long sb, const float* beta, float* c, int ldc,
                                                long long sc, int batches) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    for (int i = 0; i < batches; ++i) {
        cublasStatus_t s = gemm(ta, tb, m, n, k, *alpha, a + i * sa, R_32F, lda, b + i * sb,
                                R_32F, ldb, *beta, c + i * sc, R_32F, ldc);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}

static cublasStatus_t check_ex(int at, int bt, int ct, int compute) {
    if (!supported(at) || !supported(bt) || !supported(ct)) {
        fprintf(stderr, "ferry CUDA emulation: cuBLAS GemmEx: data types %d, %d, %d are not "
                        "emulated\n", at, bt, ct);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (compute != COMPUTE_32F && compute != COMPUTE_32F_PEDANTIC &&
        compute != COMPUTE_32F_FAST_16F && compute != COMPUTE_32F_FAST_16BF &&
        compute != COMPUTE_32F_FAST_TF32) {
        fprintf(stderr, "ferry CUDA emulation: cuBLAS GemmEx: compute type %d is not emulated "
                        "(f32 compute types only)\n", compute);
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

EXPORT cublasStatus_t cublasGemmEx(cublasHandle_t h, int ta, int tb, int m, int n, int k,
                                   const void* alpha, const void* a, int at, int lda,
                                   const void* b, int bt, int ldb, const void* beta, void* c,
                                   int ct, int ldc, int compute, int /*algo*/) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (cublasStatus_t s = check_ex(at, bt, ct, compute)) return s;
    return gemm(ta, tb, m, n, k, *static_cast<const float*>(alpha), a, at, lda, b, bt, ldb,
                *static_cast<const float*>(beta), c, ct, ldc);
}

EXPORT cublasStatus_t cublasGemmStridedBatchedEx(cublasHandle_t h, int ta, int tb, int m, int n,
                                                 int k, const void* alpha, const void* a, int at,
                                                 int lda, long long sa, const void* b, int bt,
                                                 int ldb, long long sb, const void* beta, void* c,
                                                 int ct, int ldc, long long sc, int batches,
                                                 int compute, int /*algo*/) {
    if (!h) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (cublasStatus_t s = check_ex(at, bt, ct, compute)) return s;
    for (int i = 0; i < batches; ++i) {
        cublasStatus_t s = gemm(
            ta, tb, m, n, k, *static_cast<const float*>(alpha),
            static_cast<const char*>(a) + i * sa * size_of(at), at, lda,
            static_cast<const char*>(b) + i * sb * size_of(bt), bt, ldb,
            *static_cast<const float*>(beta), static_cast<char*>(c) + i * sc * size_of(ct), ct, ldc);
        if (s != CUBLAS_STATUS_SUCCESS) return s;
    }
    return CUBLAS_STATUS_SUCCESS;
}
