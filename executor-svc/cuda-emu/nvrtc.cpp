// Ferry's CPU emulation of CUDA — TEST INFRASTRUCTURE, NOT A BACKEND.
//
// NVRTC (`libnvrtc`) as cudarc calls it: a "compilation" writes the CUDA C source as C++ for the
// host, with kernel.h in front and an entry point per `extern "C" __global__` kernel after it,
// and compiles it with the host's C++ compiler (`$CXX`, else `c++`) into a shared object. The
// "PTX" handed back names that object; the emulated driver's cuModuleLoadData loads it.
// Objects are cached by a hash of everything that went into them, so the many test processes
// that compile the same kernels compile them once.
//
// Options: `--fmad=false` becomes `-ffp-contract=off` (no fused multiply-add, as asked; the
// x86-64 baseline has none anyway); `-D`/`--define-macro` and `-I`/`--include-path` pass on;
// `--prec-div`, `--prec-sqrt`, `--ftz` and `--gpu-architecture` are accepted and have no
// effect (host arithmetic is IEEE throughout). Any other option fails the compilation naming it.

#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include <fstream>
#include <regex>
#include <sstream>
#include <string>
#include <vector>

#define EXPORT extern "C" __attribute__((visibility("default")))

#ifndef FERRY_EMU_DIR
#error "build with -DFERRY_EMU_DIR=\"<the folder of kernel.h>\""
#endif
#ifndef FERRY_EMU_CACHE
#error "build with -DFERRY_EMU_CACHE=\"<a folder for compiled kernels>\""
#endif

typedef int nvrtcResult;
enum : nvrtcResult {
    NVRTC_SUCCESS = 0,
    NVRTC_ERROR_PROGRAM_CREATION_FAILURE = 2,
    NVRTC_ERROR_INVALID_INPUT = 3,
    NVRTC_ERROR_INVALID_PROGRAM = 4,
    NVRTC_ERROR_INVALID_OPTION = 5,
    NVRTC_ERROR_COMPILATION = 6,
};

struct _nvrtcProgram {
    std::string source, name, log, ptx;
};
typedef _nvrtcProgram* nvrtcProgram;

namespace {

std::string read_file(const std::string& path) {
    std::ifstream in(path, std::ios::binary);
    std::stringstream s;
    s << in.rdbuf();
    return s.str();
}

uint64_t fnv1a(const std::string& s, uint64_t h = 1469598103934665603ull) {
    for (unsigned char c : s) h = (h ^ c) * 1099511628211ull;
    return h;
}

std::string quoted(const std::string& s) { return "'" + s + "'"; }

}  // namespace

EXPORT const char* nvrtcGetErrorString(nvrtcResult r) {
    switch (r) {
        case NVRTC_SUCCESS: return "NVRTC_SUCCESS";
        case NVRTC_ERROR_PROGRAM_CREATION_FAILURE: return "NVRTC_ERROR_PROGRAM_CREATION_FAILURE";
        case NVRTC_ERROR_INVALID_INPUT: return "NVRTC_ERROR_INVALID_INPUT";
        case NVRTC_ERROR_INVALID_PROGRAM: return "NVRTC_ERROR_INVALID_PROGRAM";
        case NVRTC_ERROR_INVALID_OPTION: return "NVRTC_ERROR_INVALID_OPTION";
        case NVRTC_ERROR_COMPILATION: return "NVRTC_ERROR_COMPILATION";
        default: return "NVRTC_ERROR_INTERNAL_ERROR";
    }
}

EXPORT nvrtcResult nvrtcVersion(int* major, int* minor) {
    *major = 12;
    *minor = 8;
    return NVRTC_SUCCESS;
}

EXPORT nvrtcResult nvrtcCreateProgram(nvrtcProgram* prog, const char* src, const char* name,
                                      int num_headers, const char* const*, const char* const*) {
    if (!prog || !src) return NVRTC_ERROR_INVALID_INPUT;
    if (num_headers != 0) return NVRTC_ERROR_PROGRAM_CREATION_FAILURE;  // not emulated
    *prog = new _nvrtcProgram{src, name ? name : "default_program", "", ""};
    return NVRTC_SUCCESS;
}

EXPORT nvrtcResult nvrtcDestroyProgram(nvrtcProgram* prog) {
    if (!prog || !*prog) return NVRTC_ERROR_INVALID_PROGRAM;
    delete *prog;
    *prog = nullptr;
    return NVRTC_SUCCESS;
}

EXPORT nvrtcResult nvrtcCompileProgram(nvrtcProgram p, int num_options, const char* const* options) {
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    std::string flags = "-std=c++20 -O2 -fPIC -shared -fvisibility=hidden -ffp-contract=off "
                        "-Wno-unknown-pragmas";
    for (int i = 0; i < num_options; ++i) {
        std::string o = options[i];
        auto starts = [&](const char* prefix) { return o.rfind(prefix, 0) == 0; };
        if (starts("--fmad=") || starts("--prec-div=") || starts("--prec-sqrt=") ||
            starts("--ftz=") || starts("--gpu-architecture=") || starts("-arch=")) {
            continue;
        } else if (starts("-D") || starts("-I")) {
            flags += " " + quoted(o);
        } else if (starts("--define-macro=")) {
            flags += " " + quoted("-D" + o.substr(strlen("--define-macro=")));
        } else if (starts("--include-path=")) {
            flags += " " + quoted("-I" + o.substr(strlen("--include-path=")));
        } else {
            p->log = "the CUDA emulation's NVRTC does not take the option " + o + "\n";
            return NVRTC_ERROR_INVALID_OPTION;
        }
    }
    std::string dir = FERRY_EMU_DIR;
    std::string unit = "#include \"" + dir + "/kernel.h\"\n#line 1 \"" + p->name + "\"\n" +
                       p->source + "\n// ---- entry points (the emulated NVRTC) ----\n";
    std::regex kernel(R"(extern\s+"C"\s+__global__\s+(?:__launch_bounds__\([^)]*\)\s+)?void\s+(\w+)\s*\()");
    int kernels = 0;
    for (std::sregex_iterator it(p->source.begin(), p->source.end(), kernel), end; it != end; ++it) {
        std::string name = (*it)[1];
        unit += "extern \"C\" __attribute__((visibility(\"default\"))) int ferry_emu_entry_" + name +
                "(void** p, ::ferry_emu::Launch* l) { return ::ferry_emu::launch(&" + name +
                ", p, l); }\n";
        ++kernels;
    }
    const char* cxx_env = getenv("CXX");
    std::string cxx = cxx_env && *cxx_env ? cxx_env : "c++";
    uint64_t h = fnv1a(unit + flags + cxx);
    h = fnv1a(read_file(dir + "/kernel.h"), h);
    h = fnv1a(read_file(dir + "/abi.h"), h);
    h = fnv1a(read_file(dir + "/half.h"), h);
    char hex[17];
    snprintf(hex, sizeof hex, "%016llx", static_cast<unsigned long long>(h));
    std::string cache = FERRY_EMU_CACHE;
    std::string object = cache + "/kernels-" + hex + ".so";
    if (access(object.c_str(), R_OK) != 0) {
        std::string pid = std::to_string(getpid());
        std::string src = cache + "/kernels-" + hex + "." + pid + ".cpp";
        std::string tmp = object + "." + pid + ".tmp";
        {
            std::ofstream out(src, std::ios::binary);
            out << unit;
            if (!out) {
                p->log = "cannot write " + src + "\n";
                return NVRTC_ERROR_COMPILATION;
            }
        }
        // The compiler must not inherit a preloaded emulation.
        std::string cmd = "env -u LD_PRELOAD " + quoted(cxx) + " " + flags + " -o " + quoted(tmp) +
                          " " + quoted(src) + " 2>&1";
        FILE* pipe = popen(cmd.c_str(), "r");
        if (!pipe) {
            p->log = "cannot run the host C++ compiler (" + cxx + ")\n";
            return NVRTC_ERROR_COMPILATION;
        }
        char buf[4096];
        size_t n;
        while ((n = fread(buf, 1, sizeof buf, pipe)) > 0) p->log.append(buf, n);
        int status = pclose(pipe);
        if (status != 0) {
            p->log = "the host C++ compiler (" + cmd + ") failed:\n" + p->log;
            unlink(tmp.c_str());
            unlink(src.c_str());
            return NVRTC_ERROR_COMPILATION;
        }
        unlink(src.c_str());
        if (rename(tmp.c_str(), object.c_str()) != 0) {
            p->log += "cannot move the compiled kernels to " + object + "\n";
            return NVRTC_ERROR_COMPILATION;
        }
    }
    if (kernels == 0) p->log += "warning: no extern \"C\" __global__ kernel in the source\n";
    p->ptx = "// ferry-cuda-emu module\n" + object + "\n";
    return NVRTC_SUCCESS;
}

EXPORT nvrtcResult nvrtcGetPTXSize(nvrtcProgram p, size_t* n) {
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    *n = p->ptx.size() + 1;
    return NVRTC_SUCCESS;
}

EXPORT nvrtcResult nvrtcGetPTX(nvrtcProgram p, char* out) {
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    memcpy(out, p->ptx.c_str(), p->ptx.size() + 1);
    return NVRTC_SUCCESS;
}

EXPORT nvrtcResult nvrtcGetProgramLogSize(nvrtcProgram p, size_t* n) {
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    *n = p->log.size() + 1;
    return NVRTC_SUCCESS;
}

EXPORT nvrtcResult nvrtcGetProgramLog(nvrtcProgram p, char* out) {
    if (!p) return NVRTC_ERROR_INVALID_PROGRAM;
    memcpy(out, p->log.c_str(), p->log.size() + 1);
    return NVRTC_SUCCESS;
}
