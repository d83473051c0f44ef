// Ferry's CPU emulation of CUDA — TEST INFRASTRUCTURE, NOT A BACKEND.
//
// What the emulated driver (driver.cpp) and a compiled kernel module (kernel.h) pass each other.
#pragma once

namespace ferry_emu {

// One launch, as the driver hands it to a module's entry point `ferry_emu_entry_<kernel>`.
struct Launch {
    unsigned int grid[3];
    unsigned int block[3];
    unsigned long long fiber_switches;  // out: how many times a thread waited at a barrier
    char error[512];                    // out: why the launch failed
};

// `int ferry_emu_entry_<kernel>(void** params, Launch* launch)`: 0, or 1 with `error` set.
typedef int (*Entry)(void** params, Launch* launch);

}  // namespace ferry_emu

// Counters the tests read (`ferry_emu_stats` in the driver).
struct FerryEmuStats {
    unsigned long long launches;        // kernel launches that ran
    unsigned long long fiber_switches;  // barrier waits over all launches
    unsigned long long gemms;           // cuBLAS products computed
    unsigned long long live_allocations;
    unsigned long long live_bytes;
    unsigned long long modules_loaded;
};
