//! Opening a GPU: the libraries are probed first ([`super::probe`]), then the driver is
//! initialised, the device's context taken, the kernels compiled and loaded and a cuBLAS handle
//! made, all on one stream that every later call uses, so work runs in issue order with no
//! cross-stream synchronisation to get wrong.
//!
//! Every call into cudarc here runs under [`guarded`]: the probe should leave nothing for
//! cudarc to panic about, but a panic from a library we do not control must become an error
//! the operator can read, not a crashed process.

use std::panic::{catch_unwind, AssertUnwindSafe};
use std::sync::Arc;

use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaContext, CudaStream};

use super::kernels::Kernels;
use super::probe::probe_libraries;
use super::CudaError;

/// One GPU, ready to run the forward.
#[derive(Debug)]
pub struct Gpu {
    /// The device's primary context.
    pub ctx: Arc<CudaContext>,
    /// The stream all work goes to.
    pub stream: Arc<CudaStream>,
    /// cuBLAS, bound to `stream`.
    pub blas: CudaBlas,
    /// The compiled kernels.
    pub kernels: Kernels,
}

impl Gpu {
    /// Opens GPU `ordinal` (as the driver numbers them, 0 first).
    pub fn open(ordinal: usize) -> Result<Self, CudaError> {
        probe_libraries()?;
        guarded("opening the GPU", || {
            let count = CudaContext::device_count()
                .map_err(CudaError::driver("initialising the CUDA driver"))?;
            if ordinal >= usize::try_from(count).unwrap_or(0) {
                return Err(CudaError::NoDevice { ordinal, count });
            }
            let ctx = CudaContext::new(ordinal)
                .map_err(CudaError::driver("creating the device context"))?;
            let stream = ctx.default_stream();
            let kernels = Kernels::load(&ctx)?;
            let blas = CudaBlas::new(stream.clone())
                .map_err(CudaError::cublas("creating the cuBLAS handle"))?;
            Ok(Self { ctx, stream, blas, kernels })
        })
    }

    /// The device's name, for the log.
    pub fn name(&self) -> String {
        self.ctx.name().unwrap_or_else(|e| format!("<unknown: {e}>"))
    }

    /// Makes the context current on the calling thread. The backend is built on one thread
    /// and run on the engine's; cudarc binds for its own calls, cuBLAS does not.
    pub fn bind(&self) -> Result<(), CudaError> {
        self.ctx.bind_to_thread().map_err(CudaError::driver("binding the context to the thread"))
    }

    /// Waits for all queued work and reports any error it raised (kernel faults surface here).
    pub fn finish(&self) -> Result<(), CudaError> {
        self.stream.synchronize().map_err(CudaError::driver("running the forward"))?;
        self.ctx.check_err().map_err(CudaError::driver("running the forward"))
    }
}

/// Runs `f`, turning a panic inside it into [`CudaError::Panicked`].
pub fn guarded<T>(
    during: &'static str,
    f: impl FnOnce() -> Result<T, CudaError>,
) -> Result<T, CudaError> {
    // AssertUnwindSafe: on a panic, everything `f` built is dropped and only the message is
    // kept, so no half-made state is observed afterwards.
    catch_unwind(AssertUnwindSafe(f)).unwrap_or_else(|payload| {
        let message = payload
            .downcast_ref::<&str>()
            .map(|s| (*s).to_string())
            .or_else(|| payload.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "a panic without a message".into());
        Err(CudaError::Panicked { during, message })
    })
}
