// Ferry's CPU emulation of CUDA — TEST INFRASTRUCTURE, NOT A BACKEND.
//
// The driver API (`libcuda`) as far as Ferry's CUDA backend and cudarc call it, on the CPU:
// "device memory" is host memory (a device pointer is its address), every stream runs its work
// at once, in the calling thread (so work is always complete when a call returns: a valid
// schedule for one stream, and the only one this emulation offers), and a kernel launch calls
// the module's entry point, which runs the grid (kernel.h). Built as a shared library whose
// SONAME is `libcuda.so`, so cudarc's `dlopen("libcuda.so")` finds it once a test has loaded it
// by path, or through LD_LIBRARY_PATH in a child process.
//
// An entry point not written here is missing from the library, and cudarc fails naming it
// ("Missing symbol cuXxx"). Copies are checked against the allocations they touch; an
// attribute or option not emulated is an error naming it, on stderr and as the result.

#include <dlfcn.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <chrono>
#include <map>
#include <mutex>
#include <string>

#include "abi.h"

#define EXPORT extern "C" __attribute__((visibility("default")))

typedef int CUresult;
typedef int CUdevice;
typedef unsigned long long CUdeviceptr;

enum : CUresult {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_CONTEXT = 201,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_LAUNCH_FAILED = 719,
    CUDA_ERROR_NOT_SUPPORTED = 801,
};

struct CUctx_st {
    CUdevice device;
};
struct CUstream_st {
    int unused;
};
struct CUevent_st {
    std::chrono::steady_clock::time_point at;
};
struct CUmod_st {
    void* handle;
    std::string path;
};
struct CUfunc_st {
    ferry_emu::Entry entry;
    std::string name;
};
typedef CUctx_st* CUcontext;
typedef CUstream_st* CUstream;
typedef CUevent_st* CUevent;
typedef CUmod_st* CUmodule;
typedef CUfunc_st* CUfunction;

namespace {

std::mutex mu;
std::map<uintptr_t, size_t> allocations;  // start -> bytes
FerryEmuStats stats;
struct KernelCount {
    unsigned long long launches = 0, blocks = 0;
};
std::map<std::string, KernelCount> launches_by_kernel;
CUresult sticky = CUDA_SUCCESS;  // a failed launch spoils the context, as on a GPU
CUctx_st primary[16];
thread_local CUcontext current = nullptr;

int device_count() {
    const char* v = getenv("FERRY_CUDA_EMU_DEVICES");
    int n = v ? atoi(v) : 1;
    return n < 0 ? 0 : (n > 16 ? 16 : n);
}

size_t total_bytes() {
    const char* v = getenv("FERRY_CUDA_EMU_MEMORY_MIB");
    size_t mib = v ? strtoull(v, nullptr, 10) : 16384;
    return mib << 20;
}

__attribute__((format(printf, 2, 3))) CUresult complain(CUresult code, const char* fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    fprintf(stderr, "ferry CUDA emulation: ");
    vfprintf(stderr, fmt, ap);
    fputc('\n', stderr);
    va_end(ap);
    return code;
}

// Whether [p, p + n) lies inside one allocation.
bool inside(uintptr_t p, size_t n) {
    std::lock_guard<std::mutex> g(mu);
    auto it = allocations.upper_bound(p);
    if (it == allocations.begin()) return false;
    --it;
    return p >= it->first && p + n <= it->first + it->second;
}

CUresult check_range(CUdeviceptr p, size_t n, const char* what) {
    if (n == 0 || inside(p, n)) return CUDA_SUCCESS;
    return complain(CUDA_ERROR_INVALID_VALUE, "%s: %zu bytes at %llx outside any device allocation",
                    what, n, p);
}

void write_stats_file() {
    const char* path = getenv("FERRY_CUDA_EMU_STATS");
    if (!path) return;
    FerryEmuStats s;
    {
        std::lock_guard<std::mutex> g(mu);
        s = stats;
    }
    std::string tmp = std::string(path) + ".tmp";
    FILE* f = fopen(tmp.c_str(), "w");
    if (!f) return;
    fprintf(f, "launches %llu\ngemms %llu\nfiber_switches %llu\nmodules_loaded %llu\n", s.launches,
            s.gemms, s.fiber_switches, s.modules_loaded);
    fclose(f);
    rename(tmp.c_str(), path);
}

}  // namespace

// ---- the emulation's own entry points, for the tests ----

EXPORT void ferry_emu_stats(FerryEmuStats* out) {
    std::lock_guard<std::mutex> g(mu);
    *out = stats;
}

EXPORT unsigned long long ferry_emu_kernel_launches(const char* name) {
    std::lock_guard<std::mutex> g(mu);
    auto it = launches_by_kernel.find(name);
    return it == launches_by_kernel.end() ? 0 : it->second.launches;
}

EXPORT unsigned long long ferry_emu_kernel_blocks(const char* name) {
    std::lock_guard<std::mutex> g(mu);
    auto it = launches_by_kernel.find(name);
    return it == launches_by_kernel.end() ? 0 : it->second.blocks;
}

// Called by the emulated cuBLAS for each product.
EXPORT void ferry_emu_note_gemm() {
    std::lock_guard<std::mutex> g(mu);
    stats.gemms++;
}

// ---- initialisation, devices, contexts ----

EXPORT CUresult cuInit(unsigned int) { return CUDA_SUCCESS; }

EXPORT CUresult cuDriverGetVersion(int* v) {
    *v = 12080;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetCount(int* n) {
    *n = device_count();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGet(CUdevice* d, int ordinal) {
    if (ordinal < 0 || ordinal >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    *d = ordinal;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetName(char* name, int len, CUdevice d) {
    if (len <= 0) return CUDA_ERROR_INVALID_VALUE;
    snprintf(name, static_cast<size_t>(len), "Ferry CUDA emulation on the CPU (device %d)", d);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceTotalMem_v2(size_t* bytes, CUdevice) {
    *bytes = total_bytes();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDeviceGetAttribute(int* v, int attribute, CUdevice) {
    switch (attribute) {
        case 1: *v = 1024; break;           // max threads per block
        case 2: *v = 1024; break;           // max block dim x
        case 3: *v = 1024; break;           // max block dim y
        case 4: *v = 64; break;             // max block dim z
        case 5: *v = 2147483647; break;     // max grid dim x
        case 6: *v = 65535; break;          // max grid dim y
        case 7: *v = 65535; break;          // max grid dim z
        case 8: *v = 48 * 1024; break;      // shared memory per block
        case 10: *v = 32; break;            // warp size
        case 16: *v = 1; break;             // multiprocessors
        case 36: *v = 1000000; break;       // memory clock, kHz
        case 37: *v = 64; break;            // memory bus width, bits
        case 75: *v = 8; break;             // compute capability major
        case 76: *v = 0; break;             // ... minor
        case 115: *v = 0; break;            // memory pools: no (cuMemAlloc, not ...Async)
        default:
            return complain(CUDA_ERROR_INVALID_VALUE,
                            "cuDeviceGetAttribute: attribute %d is not emulated", attribute);
    }
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRetain(CUcontext* ctx, CUdevice d) {
    if (d < 0 || d >= device_count()) return CUDA_ERROR_INVALID_DEVICE;
    primary[d].device = d;
    *ctx = &primary[d];
    return CUDA_SUCCESS;
}

EXPORT CUresult cuDevicePrimaryCtxRelease_v2(CUdevice) { return CUDA_SUCCESS; }

EXPORT CUresult cuCtxSetCurrent(CUcontext ctx) {
    current = ctx;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetCurrent(CUcontext* ctx) {
    *ctx = current;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxGetDevice(CUdevice* d) {
    if (!current) return CUDA_ERROR_INVALID_CONTEXT;
    *d = current->device;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuCtxSynchronize() {
    write_stats_file();
    return sticky;
}

// ---- streams and events: work is done when it is issued ----

EXPORT CUresult cuStreamCreate(CUstream* s, unsigned int) {
    *s = new CUstream_st{};
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamDestroy_v2(CUstream s) {
    delete s;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuStreamSynchronize(CUstream) {
    write_stats_file();
    return sticky;
}

EXPORT CUresult cuStreamQuery(CUstream) { return sticky; }

EXPORT CUresult cuStreamWaitEvent(CUstream, CUevent, unsigned int) { return CUDA_SUCCESS; }

EXPORT CUresult cuEventCreate(CUevent* e, unsigned int) {
    *e = new CUevent_st{std::chrono::steady_clock::now()};
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventDestroy_v2(CUevent e) {
    delete e;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventRecord(CUevent e, CUstream) {
    e->at = std::chrono::steady_clock::now();
    return CUDA_SUCCESS;
}

EXPORT CUresult cuEventSynchronize(CUevent) { return sticky; }
EXPORT CUresult cuEventQuery(CUevent) { return CUDA_SUCCESS; }

EXPORT CUresult cuEventElapsedTime(float* ms, CUevent start, CUevent end) {
    *ms = std::chrono::duration<float, std::milli>(end->at - start->at).count();
    return CUDA_SUCCESS;
}

// ---- memory ----

EXPORT CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::mutex> g(mu);
    *total = total_bytes();
    *free_bytes = stats.live_bytes > *total ? 0 : *total - stats.live_bytes;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) {
    if (bytes == 0) return CUDA_ERROR_INVALID_VALUE;
    std::lock_guard<std::mutex> g(mu);
    if (stats.live_bytes + bytes > total_bytes()) return CUDA_ERROR_OUT_OF_MEMORY;
    // 256-byte aligned, as cudaMalloc's are.
    void* mem = aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (!mem) return CUDA_ERROR_OUT_OF_MEMORY;
    allocations[reinterpret_cast<uintptr_t>(mem)] = bytes;
    stats.live_allocations++;
    stats.live_bytes += bytes;
    *p = reinterpret_cast<uintptr_t>(mem);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemFree_v2(CUdeviceptr p) {
    std::lock_guard<std::mutex> g(mu);
    auto it = allocations.find(p);
    if (it == allocations.end())
        return complain(CUDA_ERROR_INVALID_VALUE, "cuMemFree: pointer %llx was not allocated", p);
    stats.live_allocations--;
    stats.live_bytes -= it->second;
    allocations.erase(it);
    free(reinterpret_cast<void*>(p));
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    if (CUresult r = check_range(dst, n, "cuMemcpyHtoD")) return r;
    memcpy(reinterpret_cast<void*>(dst), src, n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    if (CUresult r = check_range(src, n, "cuMemcpyDtoH")) return r;
    memcpy(dst, reinterpret_cast<const void*>(src), n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    if (CUresult r = check_range(src, n, "cuMemcpyDtoD (source)")) return r;
    if (CUresult r = check_range(dst, n, "cuMemcpyDtoD (destination)")) return r;
    memmove(reinterpret_cast<void*>(dst), reinterpret_cast<const void*>(src), n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, CUstream) {
    return cuMemcpyHtoD_v2(dst, src, n);
}

EXPORT CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, CUstream) {
    return cuMemcpyDtoH_v2(dst, src, n);
}

EXPORT CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, CUstream) {
    return cuMemcpyDtoD_v2(dst, src, n);
}

EXPORT CUresult cuMemsetD8_v2(CUdeviceptr p, unsigned char v, size_t n) {
    if (CUresult r = check_range(p, n, "cuMemsetD8")) return r;
    memset(reinterpret_cast<void*>(p), v, n);
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD8Async(CUdeviceptr p, unsigned char v, size_t n, CUstream) {
    return cuMemsetD8_v2(p, v, n);
}

EXPORT CUresult cuMemsetD32_v2(CUdeviceptr p, unsigned int v, size_t n) {
    if (CUresult r = check_range(p, 4 * n, "cuMemsetD32")) return r;
    auto* d = reinterpret_cast<unsigned int*>(p);
    for (size_t i = 0; i < n; ++i) d[i] = v;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuMemsetD32Async(CUdeviceptr p, unsigned int v, size_t n, CUstream) {
    return cuMemsetD32_v2(p, v, n);
}

// ---- modules and launches ----

// A module image is what the emulated NVRTC returns as PTX: a marker line, then the path of the
// shared object it compiled.
EXPORT CUresult cuModuleLoadData(CUmodule* m, const void* image) {
    const char* text = static_cast<const char*>(image);
    const char* marker = "// ferry-cuda-emu module\n";
    if (strncmp(text, marker, strlen(marker)) != 0)
        return complain(CUDA_ERROR_INVALID_IMAGE,
                        "cuModuleLoadData: not an image of the emulated NVRTC (real PTX cannot "
                        "run here)");
    std::string path = text + strlen(marker);
    while (!path.empty() && (path.back() == '\n' || path.back() == '\0')) path.pop_back();
    void* h = dlopen(path.c_str(), RTLD_NOW | RTLD_LOCAL);
    if (!h) return complain(CUDA_ERROR_INVALID_IMAGE, "cuModuleLoadData: %s", dlerror());
    {
        std::lock_guard<std::mutex> g(mu);
        stats.modules_loaded++;
    }
    *m = new CUmod_st{h, path};
    return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleUnload(CUmodule m) {
    // Kept loaded: kernels' thread-local state lives in it. The handle goes.
    delete m;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuModuleGetFunction(CUfunction* f, CUmodule m, const char* name) {
    std::string symbol = std::string("ferry_emu_entry_") + name;
    void* entry = dlsym(m->handle, symbol.c_str());
    if (!entry)
        return complain(CUDA_ERROR_NOT_FOUND, "cuModuleGetFunction: no kernel %s", name);
    *f = new CUfunc_st{reinterpret_cast<ferry_emu::Entry>(entry), name};
    return CUDA_SUCCESS;
}

EXPORT CUresult cuLaunchKernel(CUfunction f, unsigned int gx, unsigned int gy, unsigned int gz,
                               unsigned int bx, unsigned int by, unsigned int bz,
                               unsigned int shared_bytes, CUstream, void** params, void** extra) {
    if (shared_bytes != 0)
        return complain(CUDA_ERROR_NOT_SUPPORTED,
                        "%s: %u bytes of dynamic shared memory (not emulated)", f->name.c_str(),
                        shared_bytes);
    if (extra != nullptr)
        return complain(CUDA_ERROR_NOT_SUPPORTED, "%s: arguments through `extra` (not emulated)",
                        f->name.c_str());
    if (gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535)
        return complain(CUDA_ERROR_INVALID_VALUE, "%s: grid (%u, %u, %u): empty, or y or z past 65535",
                        f->name.c_str(), gx, gy, gz);
    ferry_emu::Launch l{{gx, gy, gz}, {bx, by, bz}, 0, {0}};
    if (f->entry(params, &l) != 0) {
        fprintf(stderr, "ferry CUDA emulation: kernel %s failed: %s\n", f->name.c_str(), l.error);
        std::lock_guard<std::mutex> g(mu);
        sticky = CUDA_ERROR_LAUNCH_FAILED;
        return CUDA_ERROR_LAUNCH_FAILED;
    }
    std::lock_guard<std::mutex> g(mu);
    stats.launches++;
    stats.fiber_switches += l.fiber_switches;
    KernelCount& count = launches_by_kernel[f->name];
    count.launches++;
    count.blocks += static_cast<unsigned long long>(gx) * gy * gz;
    return CUDA_SUCCESS;
}

// ---- errors ----

namespace {

struct ErrorText {
    CUresult code;
    const char* name;
    const char* text;
};

const ErrorText ERRORS[] = {
    {CUDA_SUCCESS, "CUDA_SUCCESS", "no error"},
    {CUDA_ERROR_INVALID_VALUE, "CUDA_ERROR_INVALID_VALUE", "invalid argument"},
    {CUDA_ERROR_OUT_OF_MEMORY, "CUDA_ERROR_OUT_OF_MEMORY", "out of memory"},
    {CUDA_ERROR_INVALID_DEVICE, "CUDA_ERROR_INVALID_DEVICE", "invalid device ordinal"},
    {CUDA_ERROR_INVALID_IMAGE, "CUDA_ERROR_INVALID_IMAGE", "device kernel image is invalid"},
    {CUDA_ERROR_INVALID_CONTEXT, "CUDA_ERROR_INVALID_CONTEXT", "invalid device context"},
    {CUDA_ERROR_NOT_FOUND, "CUDA_ERROR_NOT_FOUND", "named symbol not found"},
    {CUDA_ERROR_LAUNCH_FAILED, "CUDA_ERROR_LAUNCH_FAILED", "unspecified launch failure"},
    {CUDA_ERROR_NOT_SUPPORTED, "CUDA_ERROR_NOT_SUPPORTED", "operation not supported"},
};

const ErrorText& error_text(CUresult code) {
    static const ErrorText unknown{-1, "CUDA_ERROR_UNKNOWN", "unknown error"};
    for (const ErrorText& e : ERRORS)
        if (e.code == code) return e;
    return unknown;
}

}  // namespace

EXPORT CUresult cuGetErrorString(CUresult code, const char** s) {
    *s = error_text(code).text;
    return CUDA_SUCCESS;
}

EXPORT CUresult cuGetErrorName(CUresult code, const char** s) {
    *s = error_text(code).name;
    return CUDA_SUCCESS;
}

// Whether [p, p + n) lies in one device allocation (for the emulated cuBLAS's checks).
EXPORT int ferry_emu_inside(unsigned long long p, size_t n) { return inside(p, n) ? 1 : 0; }
