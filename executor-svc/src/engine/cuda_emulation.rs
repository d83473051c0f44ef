//! **Test infrastructure, not a backend**: Ferry's CPU emulation of the CUDA libraries the CUDA
//! backend calls (the driver, NVRTC, cuBLAS), so that the backend's own code — cudarc's calls,
//! the kernels' CUDA C, the launch configurations, cuBLAS's layouts — runs on machines without
//! a GPU. The C++ sources are in `executor-svc/cuda-emu/` (their comments say what is and is
//! not emulated); this module builds them with the host's C++ compiler into three shared
//! libraries whose SONAMEs are `libcuda.so`, `libnvrtc.so` and `libcublas.so`, and points the
//! dynamic loader at them:
//!
//! - in this process (with the `cuda` feature), `Emulation::install` loads them by path; cudarc's later
//!   `dlopen("libcuda.so")` then matches the loaded library's SONAME and gets it. cudarc loads
//!   its libraries once per process, so a process that installed the emulation never sees a
//!   real driver (nextest runs each test in a process of its own);
//! - in a child process, [`Emulation::library_dir`] goes first on `LD_LIBRARY_PATH`.
//!
//! The libraries are built once per version of their sources, under the build's target folder
//! (`target/<profile>/cuda-emu/`, or `FERRY_CUDA_EMU_DIR`), by whichever process gets there
//! first; compiled kernels are cached beside them.

use std::path::{Path, PathBuf};
use std::process::Command;
#[cfg(feature = "cuda")]
use std::sync::OnceLock;

/// The emulation's sources, compiled into the test binaries so a build needs nothing else.
const SOURCES: [(&str, &str); 6] = [
    ("abi.h", include_str!("../../cuda-emu/abi.h")),
    ("half.h", include_str!("../../cuda-emu/half.h")),
    ("kernel.h", include_str!("../../cuda-emu/kernel.h")),
    ("driver.cpp", include_str!("../../cuda-emu/driver.cpp")),
    ("nvrtc.cpp", include_str!("../../cuda-emu/nvrtc.cpp")),
    ("cublas.cpp", include_str!("../../cuda-emu/cublas.cpp")),
];

/// The three libraries: (source, library file).
const LIBRARIES: [(&str, &str); 3] =
    [("driver.cpp", "libcuda.so"), ("nvrtc.cpp", "libnvrtc.so"), ("cublas.cpp", "libcublas.so")];

/// How the CUDA backend's GPU tests run, from `FERRY_CUDA_TESTS`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TestMode {
    /// `emulated` (what CI sets): under the emulation, which must build; a test that cannot
    /// run fails instead of skipping.
    Emulated,
    /// `gpu` (`scripts/gpu-check`): on the real GPU, which must be there.
    Gpu,
    /// Unset: under the emulation when the host has a C++ compiler, else skipped with a note.
    Auto,
}

impl TestMode {
    /// Reads `FERRY_CUDA_TESTS`; panics on a value it does not know.
    pub fn from_env() -> Self {
        match std::env::var("FERRY_CUDA_TESTS").as_deref() {
            Ok("emulated") => Self::Emulated,
            Ok("gpu") => Self::Gpu,
            Ok("") | Err(_) => Self::Auto,
            Ok(other) => panic!("FERRY_CUDA_TESTS={other}: expected `emulated` or `gpu`"),
        }
    }
}

/// What the CUDA tests of this process run on, as [`TestMode`] says.
#[derive(Debug)]
pub enum TestDevice {
    /// The real GPU (`FERRY_CUDA_TESTS=gpu`).
    Gpu,
    /// The emulation, built (and, by [`TestDevice::installed`], loaded into this process).
    Emulated(Emulation),
    /// Neither: nothing demands a device and the emulation cannot be built (a note says why).
    Skip,
}

impl TestDevice {
    /// The device, with the emulation built for a child process's `LD_LIBRARY_PATH`. In
    /// `Emulated` mode a failure panics; in `Auto` mode it is a [`TestDevice::Skip`].
    pub fn from_env() -> Self {
        Self::resolve(|_| Ok(()))
    }

    /// The same, with the emulation loaded into this process.
    #[cfg(feature = "cuda")]
    pub fn installed() -> Self {
        Self::resolve(Emulation::install)
    }

    fn resolve(prepare: impl FnOnce(&Emulation) -> Result<(), String>) -> Self {
        let mode = TestMode::from_env();
        if mode == TestMode::Gpu {
            return Self::Gpu;
        }
        match Emulation::build().and_then(|e| prepare(&e).map(|()| e)) {
            Ok(e) => Self::Emulated(e),
            Err(e) if mode == TestMode::Auto => {
                eprintln!("skipped: {e}");
                Self::Skip
            }
            Err(e) => panic!("FERRY_CUDA_TESTS=emulated, but {e}"),
        }
    }
}

/// Whether the CUDA backend's tests can use a device in this process: the emulation, loaded
/// here, or the real GPU ([`TestDevice::installed`]).
#[cfg(feature = "cuda")]
pub fn device_for_tests() -> bool {
    !matches!(TestDevice::installed(), TestDevice::Skip)
}

/// Counters of the emulated driver (its `FerryEmuStats`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Stats {
    /// Kernel launches that ran.
    pub launches: u64,
    /// Times a thread waited at a barrier, over all launches.
    pub fiber_switches: u64,
    /// cuBLAS products computed.
    pub gemms: u64,
    /// Device allocations not freed.
    pub live_allocations: u64,
    /// Their bytes.
    pub live_bytes: u64,
    /// Kernel modules loaded.
    pub modules_loaded: u64,
}

/// The built emulation libraries.
#[derive(Clone, Debug)]
pub struct Emulation {
    dir: PathBuf,
}

/// The libraries this process loaded, kept loaded for its life.
#[cfg(feature = "cuda")]
static INSTALLED: OnceLock<Result<Vec<libloading::Library>, String>> = OnceLock::new();

fn fnv1a(bytes: &[u8], mut h: u64) -> u64 {
    for &b in bytes {
        h = (h ^ u64::from(b)).wrapping_mul(0x0100_0000_01b3);
    }
    h
}

/// `target/<profile>/cuda-emu` of the running binary (tests run from `target/<profile>/deps`).
fn default_root() -> Result<PathBuf, String> {
    if let Some(dir) = std::env::var_os("FERRY_CUDA_EMU_DIR") {
        return Ok(PathBuf::from(dir));
    }
    let exe = std::env::current_exe().map_err(|e| format!("finding the running binary: {e}"))?;
    let mut dir = exe.parent().ok_or("the running binary has no folder")?.to_path_buf();
    if dir.file_name().is_some_and(|n| n == "deps") {
        dir.pop();
    }
    Ok(dir.join("cuda-emu"))
}

impl Emulation {
    /// Builds the libraries if this version of the sources has not been built yet.
    pub fn build() -> Result<Self, String> {
        let cxx = std::env::var("CXX").ok().filter(|c| !c.is_empty()).unwrap_or("c++".into());
        let hash =
            SOURCES.iter().fold(fnv1a(cxx.as_bytes(), 0xcbf2_9ce4_8422_2325), |h, (_, text)| {
                fnv1a(text.as_bytes(), h)
            });
        let root = default_root()?;
        let dir = root.join(format!("libs-{hash:016x}"));
        if LIBRARIES.iter().all(|(_, lib)| dir.join(lib).is_file()) {
            return Ok(Self { dir });
        }
        std::fs::create_dir_all(&root).map_err(|e| format!("creating {}: {e}", root.display()))?;
        let tmp = root.join(format!("libs-{hash:016x}.{}.tmp", std::process::id()));
        let built = Self::build_into(&tmp, &dir, &cxx);
        if let Err(e) = built {
            let _ = std::fs::remove_dir_all(&tmp);
            return Err(e);
        }
        // Another process may have finished first: its libraries are as good as ours.
        if std::fs::rename(&tmp, &dir).is_err() {
            let _ = std::fs::remove_dir_all(&tmp);
            if !LIBRARIES.iter().all(|(_, lib)| dir.join(lib).is_file()) {
                return Err(format!("could not put the emulation in {}", dir.display()));
            }
        }
        Ok(Self { dir })
    }

    /// Writes the sources into `tmp` and compiles the libraries there, for their final
    /// place `dir` (NVRTC's emulation finds `kernel.h` and its kernel cache by path).
    fn build_into(tmp: &Path, dir: &Path, cxx: &str) -> Result<(), String> {
        let src = tmp.join("src");
        std::fs::create_dir_all(&src).map_err(|e| format!("creating {}: {e}", src.display()))?;
        std::fs::create_dir_all(tmp.join("kernels"))
            .map_err(|e| format!("creating {}: {e}", tmp.display()))?;
        for (name, text) in SOURCES {
            std::fs::write(src.join(name), text).map_err(|e| format!("writing {name}: {e}"))?;
        }
        let final_src = dir.join("src");
        let children = LIBRARIES
            .iter()
            .map(|(source, lib)| {
                let soname = format!("-Wl,-soname,{lib}");
                let mut cmd = Command::new(cxx);
                cmd.args(["-std=c++20", "-O2", "-fPIC", "-shared", "-fvisibility=hidden"])
                    .arg(format!("-DFERRY_EMU_DIR=\"{}\"", final_src.display()))
                    .arg(format!("-DFERRY_EMU_CACHE=\"{}\"", dir.join("kernels").display()))
                    .arg(soname)
                    .arg("-o")
                    .arg(tmp.join(lib))
                    .arg(src.join(source))
                    .arg("-ldl");
                cmd.spawn().map(|c| (*lib, c)).map_err(|e| {
                    format!("running the C++ compiler `{cxx}` (CXX) for the CUDA emulation: {e}")
                })
            })
            .collect::<Result<Vec<_>, _>>()?;
        for (lib, child) in children {
            let out = child.wait_with_output().map_err(|e| format!("building {lib}: {e}"))?;
            if !out.status.success() {
                return Err(format!("building the CUDA emulation's {lib} failed ({})", out.status));
            }
        }
        Ok(())
    }

    /// The folder holding `libcuda.so`, `libnvrtc.so` and `libcublas.so`: put it first on a
    /// child process's `LD_LIBRARY_PATH`.
    pub fn library_dir(&self) -> &Path {
        &self.dir
    }
}

/// Loading the emulation into this process (the `cuda` feature: the tests that run the backend
/// in-process).
#[cfg(feature = "cuda")]
impl Emulation {
    /// Loads the libraries into this process, driver first, so cudarc gets them. Idempotent;
    /// fails if another set was installed before.
    pub fn install(&self) -> Result<(), String> {
        let installed = INSTALLED.get_or_init(|| {
            LIBRARIES
                .iter()
                .map(|(_, lib)| {
                    let path = self.dir.join(lib);
                    // SAFETY: the emulation's own libraries; their initialisers only set up
                    // static tables.
                    unsafe { libloading::Library::new(&path) }
                        .map_err(|e| format!("loading {}: {e}", path.display()))
                })
                .collect()
        });
        installed.as_ref().map(|_| ()).map_err(Clone::clone)
    }

    /// The emulated driver's counters, if the emulation is installed in this process.
    pub fn stats() -> Option<Stats> {
        let libs = INSTALLED.get()?.as_ref().ok()?;
        let mut out = Stats::default();
        // SAFETY: `ferry_emu_stats(FerryEmuStats*)` fills the struct `Stats` mirrors.
        unsafe {
            let f = libs[0].get::<unsafe extern "C" fn(*mut Stats)>(b"ferry_emu_stats").ok()?;
            f(&raw mut out);
        }
        Some(out)
    }

    /// How many times kernel `name` has been launched in this process, if the emulation is
    /// installed.
    pub fn kernel_launches(name: &str) -> Option<u64> {
        Self::kernel_count(b"ferry_emu_kernel_launches", name)
    }

    /// How many blocks kernel `name` has run over all its launches in this process, if the
    /// emulation is installed.
    pub fn kernel_blocks(name: &str) -> Option<u64> {
        Self::kernel_count(b"ferry_emu_kernel_blocks", name)
    }

    /// The driver's per-kernel counter `symbol` for kernel `name`.
    fn kernel_count(symbol: &[u8], name: &str) -> Option<u64> {
        let libs = INSTALLED.get()?.as_ref().ok()?;
        let name = std::ffi::CString::new(name).ok()?;
        // SAFETY: the driver's counters take a C string and return a count.
        unsafe {
            let f =
                libs[0].get::<unsafe extern "C" fn(*const std::ffi::c_char) -> u64>(symbol).ok()?;
            Some(f(name.as_ptr()))
        }
    }
}
