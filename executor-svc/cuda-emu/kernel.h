// Ferry's CPU emulation of CUDA — TEST INFRASTRUCTURE, NOT A BACKEND.
//
// The device side: the emulated NVRTC (nvrtc.cpp) compiles a CUDA C source as C++ for the host
// with this header in front and an entry point per `extern "C" __global__` kernel after it. A
// launch (driver.cpp's cuLaunchKernel) calls the entry, which runs every block of the grid, one
// after another, and every thread of a block as a fiber on its own stack: a thread runs until it
// reaches a barrier (`__syncthreads`, or a warp shuffle or vote, which is a barrier of its warp's
// lanes), then the next runnable thread of the block runs. So `__shared__` memory is shared by
// the block's threads, and a barrier really is one: no thread passes it before every live thread
// of its block (or warp) has reached it. A thread that has returned counts as arrived, as on
// current GPUs. Threads waiting at different barriers (a divergent `__syncthreads`, a shuffle in
// divergent code) is a deadlock here and fails the launch with a message instead of hanging.
//
// Kernels are found by their text, `extern "C" __global__ void name(`: one defined through a
// macro is not found (the unit then fails to compile, naming the macro's parameter).
//
// What is not emulated (a kernel that needs it fails to compile or fails its launch, loudly):
// dynamic shared memory, warp operations on a partial mask, clusters, textures, cooperative
// groups, device-side printf formatting differences. Math functions are the host's (glibc),
// so results differ from a GPU's in the last bits of `expf`, `tanhf`, `sincosf`.
#pragma once

#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>

#include "abi.h"
#include "half.h"

#include <tuple>
#include <type_traits>
#include <utility>

#if !defined(__x86_64__)
#error "the CUDA emulation's fibers switch stacks with x86-64 assembly"
#endif

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
};

namespace ferry_emu {

enum class State { Runnable, AtBlockBarrier, AtWarpBarrier, Done };

struct Fiber {
    void* sp = nullptr;  // saved stack pointer while switched out
    char* stack = nullptr;
    dim3 tid;
    unsigned int lane = 0, warp = 0;
    State state = State::Runnable;
};

constexpr size_t STACK_BYTES = 64 * 1024;
constexpr unsigned int MAX_THREADS = 1024;
constexpr unsigned int WARP = 32;

struct Warp {
    unsigned int live = 0, arrived = 0, live_mask = 0;
    unsigned int phase = 0;          // which half of `slots` the next exchange uses
    uint64_t slots[2][WARP] = {};    // values exchanged by shuffles and votes
    unsigned int members[2] = {};    // the lanes that took part in each half's last exchange
};

// The block being run on this OS thread.
struct BlockRun {
    Fiber fibers[MAX_THREADS];
    Warp warps[MAX_THREADS / WARP];
    unsigned int threads = 0, live = 0, arrived = 0;
    void* scheduler_sp = nullptr;
    Fiber* current = nullptr;
    void (*body)(void*) = nullptr;  // runs the kernel with its arguments
    void* body_arg = nullptr;
    unsigned long long switches = 0;
};

inline thread_local BlockRun* run = nullptr;
inline thread_local dim3 block_idx, block_dim, grid_dim;

// Saves the callee-saved registers, SSE and x87 control words on the current stack, stores the
// stack pointer in *save, and resumes the context whose stack pointer is `to`.
extern "C" void ferry_emu_switch(void** save, void* to) __attribute__((visibility("hidden")));
asm(R"(
    .text
    .p2align 4
    .globl ferry_emu_switch
    .hidden ferry_emu_switch
    .type ferry_emu_switch,@function
ferry_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size ferry_emu_switch,.-ferry_emu_switch
)");

[[noreturn]] inline void fail(const char* why);

inline void yield_to_scheduler() {
    BlockRun* r = run;
    r->switches++;
    ferry_emu_switch(&r->current->sp, r->scheduler_sp);
}

inline void release_block_if_met(BlockRun* r) {
    if (r->arrived == 0 || r->arrived < r->live) return;
    for (unsigned int i = 0; i < r->threads; ++i)
        if (r->fibers[i].state == State::AtBlockBarrier) r->fibers[i].state = State::Runnable;
    r->arrived = 0;
}

inline void release_warp_if_met(BlockRun* r, unsigned int w) {
    Warp& wp = r->warps[w];
    if (wp.arrived == 0 || wp.arrived < wp.live) return;
    for (unsigned int i = w * WARP; i < r->threads && i < (w + 1) * WARP; ++i)
        if (r->fibers[i].state == State::AtWarpBarrier) r->fibers[i].state = State::Runnable;
    wp.arrived = 0;
    // Every live lane is here: they are the exchange's members, even if some return before
    // others read their values.
    wp.members[wp.phase] = wp.live_mask;
    wp.phase ^= 1;
}

// __syncthreads(): wait until every live thread of the block is here.
inline void sync_block() {
    BlockRun* r = run;
    Fiber* f = r->current;
    f->state = State::AtBlockBarrier;
    r->arrived++;
    release_block_if_met(r);
    while (f->state != State::Runnable) yield_to_scheduler();
}

// A barrier of the current thread's warp, used by shuffles and votes.
inline void sync_warp() {
    BlockRun* r = run;
    Fiber* f = r->current;
    Warp& w = r->warps[f->warp];
    f->state = State::AtWarpBarrier;
    w.arrived++;
    release_warp_if_met(r, f->warp);
    while (f->state != State::Runnable) yield_to_scheduler();
}

// Every lane puts `v` in the warp's exchange slots; after the warp's barrier each lane reads the
// value of lane `src(lane)` (its own where `src` is out of range). Slots alternate between two
// halves so a lane that is already at the next exchange cannot overwrite a value still read.
template <class T, class Src>
inline T exchange(unsigned int mask, T v, Src src) {
    static_assert(sizeof(T) <= 8, "a shuffled value is at most 8 bytes");
    BlockRun* r = run;
    Fiber* f = r->current;
    Warp& w = r->warps[f->warp];
    if ((mask & w.live_mask) != w.live_mask)
        fail("a warp shuffle or vote whose mask leaves out a live lane is not emulated");
    unsigned int phase = w.phase;
    memcpy(&w.slots[phase][f->lane], &v, sizeof(T));
    sync_warp();
    int from = src(static_cast<int>(f->lane));
    T out = v;
    if (from >= 0 && from < static_cast<int>(WARP) && (w.members[phase] >> from & 1u))
        memcpy(&out, &w.slots[phase][from], sizeof(T));
    return out;
}

// A vote: every live lane's predicate as a mask; the lanes that voted into `*voters`.
inline unsigned int ballot(unsigned int mask, int predicate, unsigned int* voters = nullptr) {
    BlockRun* r = run;
    Fiber* f = r->current;
    Warp& w = r->warps[f->warp];
    unsigned int bits = 0;
    unsigned int phase = w.phase;
    exchange(mask, predicate ? 1u : 0u, [](int l) { return l; });
    for (unsigned int l = 0; l < WARP; ++l)
        if ((w.members[phase] >> l & 1u) && w.slots[phase][l]) bits |= 1u << l;
    if (voters) *voters = w.members[phase];
    return bits;
}

// Where a fiber starts: runs the kernel body for its thread, then leaves the barriers.
inline void fiber_entry() {
    BlockRun* r = run;
    r->body(r->body_arg);
    r = run;  // (the same block: fibers never move between OS threads)
    Fiber* f = r->current;
    f->state = State::Done;
    r->live--;
    Warp& w = r->warps[f->warp];
    w.live--;
    w.live_mask &= ~(1u << f->lane);
    release_block_if_met(r);
    release_warp_if_met(r, f->warp);
    void* unused;
    ferry_emu_switch(&unused, r->scheduler_sp);
    __builtin_unreachable();
}

// The fiber stacks of this OS thread, made once and reused by every launch.
inline char* stacks(unsigned int threads) {
    static thread_local char* base = nullptr;
    static thread_local unsigned int have = 0;
    if (have < threads) {
        delete[] base;
        base = new char[static_cast<size_t>(threads) * STACK_BYTES];
        have = threads;
    }
    return base;
}

inline void start_fiber(Fiber& f) {
    auto* top = reinterpret_cast<uint64_t*>(
        (reinterpret_cast<uintptr_t>(f.stack + STACK_BYTES) & ~uintptr_t{15}));
    *--top = 0;  // fiber_entry's (never used) return address: rsp = 8 mod 16 at its entry
    *--top = reinterpret_cast<uint64_t>(&fiber_entry);
    for (int i = 0; i < 6; ++i) *--top = 0;  // rbp, rbx, r12 to r15
    --top;
    uint32_t csr[2] = {0x1F80, 0x037F};  // default MXCSR, x87 control word
    memcpy(top, csr, sizeof csr);
    f.sp = top;
}

inline thread_local const char* failure = nullptr;

[[noreturn]] inline void fail(const char* why) {
    // Unwinding across fiber stacks is not possible: record, and abandon the block from the
    // scheduler (its stacks are reset by the next launch).
    failure = why;
    BlockRun* r = run;
    void* unused;
    ferry_emu_switch(&unused, r->scheduler_sp);
    __builtin_unreachable();
}

// Runs one block: every thread from the start, switching at barriers until all have returned.
inline bool run_block(BlockRun& r, void (*body)(void*), void* arg, Launch* l) {
    unsigned int bx = l->block[0], by = l->block[1], bz = l->block[2];
    r.threads = bx * by * bz;
    r.live = r.threads;
    r.arrived = 0;
    r.body = body;
    r.body_arg = arg;
    char* base = stacks(r.threads);
    for (unsigned int w = 0; w < (r.threads + WARP - 1) / WARP; ++w) {
        Warp& wp = r.warps[w];
        unsigned int lanes = r.threads - w * WARP < WARP ? r.threads - w * WARP : WARP;
        wp.live = lanes;
        wp.arrived = 0;
        wp.phase = 0;
        wp.live_mask = lanes == WARP ? 0xffffffffu : (1u << lanes) - 1;
    }
    for (unsigned int i = 0; i < r.threads; ++i) {
        Fiber& f = r.fibers[i];
        f.tid = dim3{i % bx, (i / bx) % by, i / (bx * by)};
        f.lane = i % WARP;
        f.warp = i / WARP;
        f.state = State::Runnable;
        f.stack = base + static_cast<size_t>(i) * STACK_BYTES;
        start_fiber(f);
    }
    failure = nullptr;
    while (r.live > 0) {
        bool progressed = false;
        for (unsigned int i = 0; i < r.threads; ++i) {
            Fiber& f = r.fibers[i];
            if (f.state != State::Runnable) continue;
            progressed = true;
            r.current = &f;
            ferry_emu_switch(&r.scheduler_sp, f.sp);
            if (failure) {
                snprintf(l->error, sizeof l->error, "thread (%u, %u, %u) of block (%u, %u, %u): %s",
                         f.tid.x, f.tid.y, f.tid.z, block_idx.x, block_idx.y, block_idx.z,
                         failure);
                return false;
            }
        }
        if (!progressed) {
            snprintf(l->error, sizeof l->error,
                     "deadlock in block (%u, %u, %u): %u live threads wait at different barriers "
                     "(a __syncthreads or warp operation in divergent code)",
                     block_idx.x, block_idx.y, block_idx.z, r.live);
            return false;
        }
    }
    return true;
}

template <class... A, size_t... I>
inline void call(void (*k)(A...), std::tuple<std::decay_t<A>...>& args, std::index_sequence<I...>) {
    k(std::get<I>(args)...);
}

// Runs kernel `k` over the launch's grid with the arguments the driver was given (one pointer to
// each argument's value, as cuLaunchKernel takes them). Returns 0, or 1 with `l->error` set.
template <class... A>
inline int launch(void (*k)(A...), void** params, Launch* l) {
    using Args = std::tuple<std::decay_t<A>...>;
    Args args = [&]<size_t... I>(std::index_sequence<I...>) {
        return Args{*static_cast<std::decay_t<A>*>(params[I])...};
    }(std::index_sequence_for<A...>{});
    struct Closure {
        void (*k)(A...);
        Args* args;
    } closure{k, &args};
    auto body = [](void* p) {
        auto* c = static_cast<Closure*>(p);
        call(c->k, *c->args, std::index_sequence_for<A...>{});
    };
    unsigned int threads = l->block[0] * l->block[1] * l->block[2];
    if (threads == 0 || threads > MAX_THREADS) {
        snprintf(l->error, sizeof l->error, "a block of %u threads (1 to %u)", threads,
                 MAX_THREADS);
        return 1;
    }
    static thread_local BlockRun* block_run = new BlockRun;
    BlockRun* previous = run;
    run = block_run;
    grid_dim = dim3{l->grid[0], l->grid[1], l->grid[2]};
    block_dim = dim3{l->block[0], l->block[1], l->block[2]};
    l->fiber_switches = 0;
    int status = 0;
    for (unsigned int z = 0; z < l->grid[2] && status == 0; ++z)
        for (unsigned int y = 0; y < l->grid[1] && status == 0; ++y)
            for (unsigned int x = 0; x < l->grid[0] && status == 0; ++x) {
                block_idx = dim3{x, y, z};
                block_run->switches = 0;
                if (!run_block(*block_run, body, &closure, l)) status = 1;
                l->fiber_switches += block_run->switches;
            }
    run = previous;
    return status;
}

}  // namespace ferry_emu

// ---- CUDA C's built-ins, as the kernels see them ----
#define threadIdx (::ferry_emu::run->current->tid)
#define blockIdx (::ferry_emu::block_idx)
#define blockDim (::ferry_emu::block_dim)
#define gridDim (::ferry_emu::grid_dim)
#define warpSize 32
#define __global__
#define __device__
#define __host__
#define __forceinline__ inline
#define __noinline__ __attribute__((noinline))
#define __restrict__ __restrict
// One copy per OS thread, and an OS thread runs one block at a time: the block's memory.
#define __shared__ static thread_local
#define __launch_bounds__(...)

inline void __syncthreads() { ::ferry_emu::sync_block(); }
inline void __syncwarp(unsigned int = 0xffffffffu) { ::ferry_emu::sync_warp(); }

template <class T>
inline T __shfl_sync(unsigned int mask, T v, int src, int width = 32) {
    return ::ferry_emu::exchange(mask, v, [=](int l) { return (l / width) * width + src % width; });
}
template <class T>
inline T __shfl_xor_sync(unsigned int mask, T v, int m, int width = 32) {
    return ::ferry_emu::exchange(mask, v, [=](int l) {
        int to = l ^ m;
        return to / width == l / width ? to : l;
    });
}
template <class T>
inline T __shfl_down_sync(unsigned int mask, T v, unsigned int d, int width = 32) {
    return ::ferry_emu::exchange(mask, v, [=](int l) {
        int to = l + static_cast<int>(d);
        return to / width == l / width ? to : l;
    });
}
template <class T>
inline T __shfl_up_sync(unsigned int mask, T v, unsigned int d, int width = 32) {
    return ::ferry_emu::exchange(mask, v, [=](int l) {
        int to = l - static_cast<int>(d);
        return to >= 0 && to / width == l / width ? to : l;
    });
}
inline unsigned int __ballot_sync(unsigned int mask, int p) { return ::ferry_emu::ballot(mask, p); }
inline int __all_sync(unsigned int mask, int p) {
    unsigned int voters;
    return ::ferry_emu::ballot(mask, p, &voters) == voters;
}
inline int __any_sync(unsigned int mask, int p) { return ::ferry_emu::ballot(mask, p) != 0; }

// Atomics are real ones: blocks may one day run on several OS threads.
inline float atomicAdd(float* a, float v) {
    unsigned int* p = reinterpret_cast<unsigned int*>(a);
    unsigned int old = __atomic_load_n(p, __ATOMIC_RELAXED);
    while (!__atomic_compare_exchange_n(p, &old, ::ferry_emu::bits_of(::ferry_emu::float_of(old) + v),
                                        false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST)) {
    }
    return ::ferry_emu::float_of(old);
}
inline int atomicAdd(int* a, int v) { return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST); }
inline unsigned int atomicAdd(unsigned int* a, unsigned int v) {
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
inline unsigned long long atomicAdd(unsigned long long* a, unsigned long long v) {
    return __atomic_fetch_add(a, v, __ATOMIC_SEQ_CST);
}
inline int atomicMax(int* a, int v) {
    int old = __atomic_load_n(a, __ATOMIC_RELAXED);
    while (old < v && !__atomic_compare_exchange_n(a, &old, v, false, __ATOMIC_SEQ_CST,
                                                   __ATOMIC_SEQ_CST)) {
    }
    return old;
}
inline int atomicCAS(int* a, int expected, int desired) {
    __atomic_compare_exchange_n(a, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}
inline unsigned int atomicCAS(unsigned int* a, unsigned int expected, unsigned int desired) {
    __atomic_compare_exchange_n(a, &expected, desired, false, __ATOMIC_SEQ_CST, __ATOMIC_SEQ_CST);
    return expected;
}

inline float __int_as_float(int i) { return ::ferry_emu::float_of(static_cast<unsigned int>(i)); }
inline int __float_as_int(float f) { return static_cast<int>(::ferry_emu::bits_of(f)); }
inline unsigned int __float_as_uint(float f) { return ::ferry_emu::bits_of(f); }
inline float __uint_as_float(unsigned int i) { return ::ferry_emu::float_of(i); }
inline float rsqrtf(float x) { return 1.0f / sqrtf(x); }
inline float __expf(float x) { return expf(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x < 0.0f ? 0.0f : (x > 1.0f ? 1.0f : x); }
using ::fmaxf;
using ::fminf;
template <class T>
inline T min(T a, T b) { return b < a ? b : a; }
template <class T>
inline T max(T a, T b) { return a < b ? b : a; }
