//! [`Gpu`]: one device's context, stream, compiled modules and cuBLASLt handle.

use super::compile::{compile_cached, KernelCompileError};
use super::gemm::Blas;
use super::{cache, probe, CudaUnavailable, DeviceInfo, KernelModule, ALL_MODULES};
use crate::cpu::KernelError;
use cudarc::cublaslt::result::CublasError;
use cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute, CUresult};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DeviceRepr, DriverError,
    ValidAsZeroBits,
};
use cudarc::nvrtc::Ptx;
use std::collections::HashMap;
use std::fmt;
use std::path::PathBuf;
use std::sync::{Arc, Mutex, PoisonError};

/// Why a GPU operation failed.
#[derive(Debug)]
pub enum GpuError {
    /// No usable driver, library or device (see [`probe`](super::probe)).
    Unavailable(CudaUnavailable),
    /// A driver call failed.
    Driver(DriverError),
    /// The driver refused a compiled module.
    ModuleLoad {
        /// The `.cu` file.
        module: &'static str,
        /// The driver's error.
        error: DriverError,
        /// NVRTC's version, to explain a PTX the driver is too old for.
        nvrtc_version: (i32, i32),
        /// The CUDA version the driver supports.
        driver_version: (i32, i32),
    },
    /// A cuBLASLt call failed.
    Blas(CublasError),
    /// NVRTC could not compile a module.
    Compile(KernelCompileError),
    /// A kernel's arguments do not fit its sizes (nothing was launched).
    Args(KernelError),
}

impl fmt::Display for GpuError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuError::Unavailable(e) => write!(f, "{e}"),
            GpuError::Driver(e) => write!(f, "CUDA driver error: {e}"),
            GpuError::ModuleLoad {
                module,
                error,
                nvrtc_version: n,
                driver_version: d,
            } => {
                write!(f, "the CUDA driver could not load {module}: {error}")?;
                if error.0 == CUresult::CUDA_ERROR_UNSUPPORTED_PTX_VERSION {
                    write!(
                        f,
                        " (NVRTC {}.{} writes PTX newer than this driver, CUDA {}.{}, reads: use an NVRTC no newer than the driver, or update the driver)",
                        n.0, n.1, d.0, d.1
                    )?;
                }
                Ok(())
            }
            GpuError::Blas(e) => write!(f, "cuBLASLt error: {e}"),
            GpuError::Compile(e) => write!(f, "{e}"),
            GpuError::Args(e) => write!(f, "{e}"),
        }
    }
}

impl std::error::Error for GpuError {}

impl From<CudaUnavailable> for GpuError {
    fn from(e: CudaUnavailable) -> Self {
        GpuError::Unavailable(e)
    }
}
impl From<DriverError> for GpuError {
    fn from(e: DriverError) -> Self {
        GpuError::Driver(e)
    }
}
impl From<CublasError> for GpuError {
    fn from(e: CublasError) -> Self {
        GpuError::Blas(e)
    }
}
impl From<KernelCompileError> for GpuError {
    fn from(e: KernelCompileError) -> Self {
        GpuError::Compile(e)
    }
}
impl From<KernelError> for GpuError {
    fn from(e: KernelError) -> Self {
        GpuError::Args(e)
    }
}

/// One device: its primary context, the stream every kernel of this `Gpu` runs on,
/// the kernel modules (compiled for the device's architecture on first use, PTX
/// cached on disk) and a cuBLASLt handle with its workspace.
///
/// Buffers are cudarc's `CudaSlice<T>`: `half::bf16` for compute activations and
/// weights, `f32` for master weights, moments, gradients of parameters and
/// statistics, `u32` for ids. Kernels are launched asynchronously on [`Gpu::stream`];
/// [`Gpu::download`] and [`Gpu::synchronize`] wait for them.
pub struct Gpu {
    info: DeviceInfo,
    ctx: Arc<CudaContext>,
    pub(crate) stream: Arc<CudaStream>,
    modules: Mutex<Vec<Option<Arc<CudaModule>>>>,
    functions: Mutex<HashMap<&'static str, CudaFunction>>,
    pub(crate) blas: Mutex<Blas>,
    cache_dir: Option<PathBuf>,
    /// Largest dynamic shared memory a block may opt into.
    pub(crate) smem_optin_bytes: usize,
}

impl fmt::Debug for Gpu {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Gpu")
            .field("info", &self.info)
            .field("cache_dir", &self.cache_dir)
            .finish()
    }
}

/// Keeps memory freed to the device's stream-ordered pool there: the pool's default
/// release threshold (0) hands it back to the driver at every synchronisation, and
/// an interpreter that frees and reallocates its activations every step would then
/// map fresh memory every step.
fn keep_freed_memory(ctx: &CudaContext) -> Result<(), GpuError> {
    use cudarc::driver::sys;
    let mut pool: sys::CUmemoryPool = std::ptr::null_mut();
    let mut threshold: u64 = u64::MAX;
    // SAFETY: `pool` receives the device's default pool, a handle the driver owns;
    // the attribute's value is a `cuuint64_t` read through the pointer during the call.
    #[allow(unsafe_code)]
    unsafe {
        sys::cuDeviceGetDefaultMemPool(&mut pool, ctx.cu_device()).result()?;
        sys::cuMemPoolSetAttribute(
            pool,
            sys::CUmemPool_attribute::CU_MEMPOOL_ATTR_RELEASE_THRESHOLD,
            (&mut threshold as *mut u64).cast(),
        )
        .result()?;
    }
    Ok(())
}

impl Gpu {
    /// Opens device 0 after [`probe`](super::probe) found the driver, NVRTC,
    /// cuBLASLt and a device, with the PTX cache of [`cache::cache_dir`].
    pub fn new() -> Result<Gpu, GpuError> {
        Gpu::on(0)
    }

    /// Opens device `ordinal` ([`Gpu::new`] for another device of the node).
    pub fn on(ordinal: usize) -> Result<Gpu, GpuError> {
        let info = probe::probe_device(ordinal)?;
        let ctx = CudaContext::new(info.ordinal)?;
        if ctx.has_async_alloc() {
            keep_freed_memory(&ctx)?;
        }
        let stream = ctx.new_stream()?;
        let blas = Blas::new(&stream)?;
        let optin = ctx
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)?;
        Ok(Gpu {
            info,
            ctx,
            stream,
            modules: Mutex::new(vec![None; ALL_MODULES.len()]),
            functions: Mutex::new(HashMap::new()),
            blas: Mutex::new(blas),
            cache_dir: cache::cache_dir(),
            smem_optin_bytes: optin.max(0) as usize,
        })
    }

    /// What the probe found.
    pub fn info(&self) -> &DeviceInfo {
        &self.info
    }

    /// The stream every kernel of this `Gpu` is launched on.
    pub fn stream(&self) -> &Arc<CudaStream> {
        &self.stream
    }

    /// The device's context.
    pub fn context(&self) -> &Arc<CudaContext> {
        &self.ctx
    }

    /// Waits for everything launched so far.
    pub fn synchronize(&self) -> Result<(), GpuError> {
        Ok(self.stream.synchronize()?)
    }

    /// Compiles (or reads from the cache) and loads every module now, instead of on
    /// each module's first launch.
    pub fn load_all(&self) -> Result<(), GpuError> {
        for m in ALL_MODULES {
            self.module(m)?;
        }
        Ok(())
    }

    fn module(&self, m: KernelModule) -> Result<Arc<CudaModule>, GpuError> {
        let mut modules = self.modules.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(loaded) = &modules[m.index()] {
            return Ok(loaded.clone());
        }
        let (ptx, _) = compile_cached(m, &self.info.arch(), self.cache_dir.as_deref())?;
        let loaded =
            self.ctx
                .load_module(Ptx::from_src(ptx))
                .map_err(|error| GpuError::ModuleLoad {
                    module: m.file(),
                    error,
                    nvrtc_version: self.info.nvrtc_version,
                    driver_version: self.info.driver_version,
                })?;
        modules[m.index()] = Some(loaded.clone());
        Ok(loaded)
    }

    /// The kernel `name` of module `m`, loaded once.
    pub(crate) fn function(
        &self,
        m: KernelModule,
        name: &'static str,
    ) -> Result<CudaFunction, GpuError> {
        debug_assert!(m.kernels().contains(&name), "{name} is not in {m:?}");
        if let Some(f) = self
            .functions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(name)
        {
            return Ok(f.clone());
        }
        let f = self.module(m)?.load_function(name)?;
        self.functions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert(name, f.clone());
        Ok(f)
    }

    /// Lets `f` use `bytes` of dynamic shared memory (above the default 48 KiB a
    /// block needs an explicit opt-in), or refuses sizes the device cannot give.
    pub(crate) fn allow_shared(
        &self,
        f: &CudaFunction,
        bytes: usize,
        what: &'static str,
    ) -> Result<(), GpuError> {
        const DEFAULT_BYTES: usize = 48 * 1024;
        if bytes <= DEFAULT_BYTES {
            return Ok(());
        }
        if bytes > self.smem_optin_bytes {
            return Err(GpuError::Args(KernelError::Invalid {
                name: what,
                reason: format!(
                    "needs {bytes} bytes of shared memory per block; this device allows {}",
                    self.smem_optin_bytes
                ),
            }));
        }
        // SAFETY: `f` is a live function of a module loaded in this context, and
        // the attribute takes a byte count the device supports (checked above).
        #[allow(unsafe_code)]
        unsafe {
            cudarc::driver::result::function::set_function_attribute(
                f.cu_function(),
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                bytes as i32,
            )
        }?;
        Ok(())
    }

    /// A new device buffer holding `host`.
    pub fn upload<T: DeviceRepr>(&self, host: &[T]) -> Result<CudaSlice<T>, GpuError> {
        Ok(self.stream.clone_htod(host)?)
    }

    /// The contents of `dev`, after everything launched before on the stream.
    pub fn download<T: DeviceRepr + Default + Clone>(
        &self,
        dev: &CudaSlice<T>,
    ) -> Result<Vec<T>, GpuError> {
        Ok(self.stream.clone_dtoh(dev)?)
    }

    /// A zeroed device buffer of `n` values.
    pub fn zeros<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        n: usize,
    ) -> Result<CudaSlice<T>, GpuError> {
        Ok(self.stream.alloc_zeros(n)?)
    }
}
