//! Finding the CUDA libraries before cudarc touches them.
//!
//! cudarc, built with `dynamic-loading`, opens the driver, NVRTC and cuBLAS on first use and
//! *panics* when one is missing. A machine without a GPU is an ordinary configuration mistake
//! (`--backend cuda` on the wrong host), so the backend first loads each library itself, by the
//! same names cudarc tries, and turns a failure into a [`CudaError`] that says what is missing
//! and what to do. If a library loads here, cudarc's own attempt finds it too.

use std::env::consts::{DLL_PREFIX, DLL_SUFFIX};

use super::CudaError;

/// A library the backend needs at run time.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CudaLibrary {
    /// The NVIDIA driver (`libcuda`), installed with the GPU driver.
    Driver,
    /// The run-time compiler for the kernels (`libnvrtc`, CUDA toolkit or a runtime package).
    Nvrtc,
    /// The matrix products (`libcublas`, CUDA toolkit or a runtime package).
    Cublas,
}

impl CudaLibrary {
    /// The base names cudarc looks up (it adds prefixes, suffixes and versions).
    fn base_names(self) -> &'static [&'static str] {
        match self {
            Self::Driver => &["cuda", "nvcuda"],
            Self::Nvrtc => &["nvrtc"],
            Self::Cublas => &["cublas"],
        }
    }

    /// The file a normal installation provides, named in the error: the driver ships
    /// `libcuda.so.1`, the CUDA 12 libraries `lib….so.12`.
    pub fn usual_file(self) -> String {
        match self {
            Self::Driver => format!("{DLL_PREFIX}cuda{DLL_SUFFIX}.1"),
            Self::Nvrtc => format!("{DLL_PREFIX}nvrtc{DLL_SUFFIX}.12"),
            Self::Cublas => format!("{DLL_PREFIX}cublas{DLL_SUFFIX}.12"),
        }
    }
}

/// Loads `lib` by its usual file name, then by every name cudarc would try. On failure, the
/// error of the usual name (the one worth reporting: the others are guesses).
pub fn try_load(lib: CudaLibrary) -> Result<(), String> {
    let usual = lib.usual_file();
    let mut names = vec![usual.clone()];
    names.extend(lib.base_names().iter().flat_map(|b| cudarc::get_lib_name_candidates(b)));
    let mut first_error = None;
    for name in &names {
        // SAFETY: loading runs the library's initialisers. These are NVIDIA's own CUDA
        // libraries, which cudarc would load in the same way a moment later.
        match unsafe { libloading::Library::new(name) } {
            // Dropping the handle unloads it again; cudarc keeps its own.
            Ok(_) => return Ok(()),
            Err(e) => {
                first_error.get_or_insert_with(|| ferry_runtime::error_chain(&e));
            }
        }
    }
    Err(first_error.unwrap_or_else(|| format!("no file name to try for {usual}")))
}

/// Checks that the driver, NVRTC and cuBLAS can all be loaded, in that order.
pub fn probe_libraries() -> Result<(), CudaError> {
    try_load(CudaLibrary::Driver)
        .map_err(|reason| CudaError::NoDriver { file: CudaLibrary::Driver.usual_file(), reason })?;
    for lib in [CudaLibrary::Nvrtc, CudaLibrary::Cublas] {
        try_load(lib).map_err(|reason| CudaError::MissingLibrary {
            library: lib,
            file: lib.usual_file(),
            reason,
        })?;
    }
    Ok(())
}
