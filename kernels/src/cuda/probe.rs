//! Can this process use a GPU? Answered without a panic, whatever is installed.
//!
//! cudarc opens libcuda, libnvrtc and libcublasLt lazily and panics when one is
//! missing, so [`probe`] first tries to load each library the way cudarc will (its
//! own candidate names), reports every missing one with what to install or set, and
//! only then initialises the driver and reads the first device. Should cudarc still
//! panic (say, a library too old to have a symbol cudarc wants), the panic is caught
//! and reported as [`CudaUnavailable::Panicked`].

use std::fmt;

/// What the probe found: the device kernels will run on (ordinal 0) and the
/// libraries around it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DeviceInfo {
    /// Device ordinal the rest describes.
    pub ordinal: usize,
    /// Devices the driver reports.
    pub device_count: usize,
    /// Marketing name (`NVIDIA H100 80GB HBM3`).
    pub name: String,
    /// Compute capability (major, minor): (9, 0) on Hopper.
    pub compute_capability: (i32, i32),
    /// Streaming multiprocessors.
    pub sm_count: u32,
    /// Device memory in bytes.
    pub total_memory_bytes: usize,
    /// CUDA version the driver supports (major, minor).
    pub driver_version: (i32, i32),
    /// NVRTC version (major, minor).
    pub nvrtc_version: (i32, i32),
    /// Whether libnccl can be loaded (needed only for more than one GPU).
    pub nccl: bool,
}

impl DeviceInfo {
    /// NVRTC's `--gpu-architecture` for this device (`sm_90`).
    pub fn arch(&self) -> String {
        format!(
            "sm_{}{}",
            self.compute_capability.0, self.compute_capability.1
        )
    }
}

impl fmt::Display for DeviceInfo {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{} ({}, {} SMs, {:.1} GiB; device {} of {}; driver CUDA {}.{}, NVRTC {}.{}{})",
            self.name,
            self.arch(),
            self.sm_count,
            self.total_memory_bytes as f64 / (1u64 << 30) as f64,
            self.ordinal,
            self.device_count,
            self.driver_version.0,
            self.driver_version.1,
            self.nvrtc_version.0,
            self.nvrtc_version.1,
            if self.nccl { ", NCCL" } else { ", no NCCL" }
        )
    }
}

/// A shared library the GPU layer needs and could not load.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MissingLibrary {
    /// The library as people know it (`libcuda.so.1 (the NVIDIA driver)`).
    pub library: &'static str,
    /// What to install or set.
    pub hint: &'static str,
}

/// Why the GPU layer cannot run here.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CudaUnavailable {
    /// The binary was built without the `cuda` (or `cuda-12`) feature.
    NotCompiled,
    /// Required libraries that could not be loaded (every one of them).
    MissingLibraries(Vec<MissingLibrary>),
    /// The driver loaded but reports no device (or `CUDA_VISIBLE_DEVICES` hides all).
    NoDevice,
    /// A driver call failed.
    Driver {
        /// The call (`cuInit`).
        call: &'static str,
        /// The driver's error.
        error: String,
    },
    /// cudarc panicked in spite of the checks (caught here).
    Panicked {
        /// What the probe was doing.
        during: &'static str,
        /// The panic's message.
        message: String,
    },
}

impl fmt::Display for CudaUnavailable {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            CudaUnavailable::NotCompiled => write!(
                f,
                "this binary was built without CUDA support; rebuild with `cargo build --release --features cuda` (CUDA 13) or `--features cuda-12` (CUDA 12.8); no CUDA toolkit is needed to build"
            ),
            CudaUnavailable::MissingLibraries(libs) => {
                write!(f, "no usable CUDA installation:")?;
                for l in libs {
                    write!(f, "\n  - {} cannot be loaded: {}", l.library, l.hint)?;
                }
                Ok(())
            }
            CudaUnavailable::NoDevice => write!(
                f,
                "the NVIDIA driver is installed but reports no CUDA device (check `nvidia-smi` and CUDA_VISIBLE_DEVICES)"
            ),
            CudaUnavailable::Driver { call, error } => {
                write!(f, "the CUDA driver failed in {call}: {error}")
            }
            CudaUnavailable::Panicked { during, message } => {
                write!(f, "cudarc failed while {during}: {message}")
            }
        }
    }
}

impl std::error::Error for CudaUnavailable {}

/// The driver's library (libcuda), found through the loader's path.
// Used by the probe of a `cuda` build (and the tests).
#[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
pub(crate) const DRIVER_LIB: MissingLibrary = MissingLibrary {
    library: "libcuda.so.1 (the NVIDIA driver)",
    hint: "install the NVIDIA driver, or add the folder holding libcuda.so.1 to LD_LIBRARY_PATH; in a container, start it with the GPUs exposed (e.g. `docker run --gpus all`)",
};

/// NVRTC, which compiles the kernels at run time.
// Used by the probe of a `cuda` build (and the tests).
#[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
pub(crate) const NVRTC_LIB: MissingLibrary = MissingLibrary {
    library: NVRTC_NAME,
    hint: "install NVRTC (the CUDA toolkit's cuda-nvrtc package, or `pip install nvidia-cuda-nvrtc` for CUDA 13, `nvidia-cuda-nvrtc-cu12` for CUDA 12) and add its lib folder to LD_LIBRARY_PATH",
};

/// cuBLASLt, the GEMMs.
// Used by the probe of a `cuda` build (and the tests).
#[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
pub(crate) const CUBLASLT_LIB: MissingLibrary = MissingLibrary {
    library: CUBLASLT_NAME,
    hint: "install cuBLAS (the CUDA toolkit's libcublas package, or `pip install nvidia-cublas` for CUDA 13, `nvidia-cublas-cu12` for CUDA 12) and add its lib folder to LD_LIBRARY_PATH",
};

// The sonames cudarc looks for, from the CUDA version the build targets (they
// only label messages).
#[cfg(feature = "cuda")]
const NVRTC_NAME: &str = "libnvrtc.so.13 (NVRTC)";
#[cfg(feature = "cuda")]
const CUBLASLT_NAME: &str = "libcublasLt.so.13 (cuBLASLt)";
#[cfg(all(feature = "cuda-12", not(feature = "cuda")))]
const NVRTC_NAME: &str = "libnvrtc.so.12 (NVRTC)";
#[cfg(all(feature = "cuda-12", not(feature = "cuda")))]
const CUBLASLT_NAME: &str = "libcublasLt.so.12 (cuBLASLt)";
#[cfg(not(any(feature = "cuda", feature = "cuda-12")))]
#[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
const NVRTC_NAME: &str = "libnvrtc (NVRTC)";
#[cfg(not(any(feature = "cuda", feature = "cuda-12")))]
#[cfg_attr(not(feature = "cudarc"), allow(dead_code))]
const CUBLASLT_NAME: &str = "libcublasLt (cuBLASLt)";

/// Checks that the driver, NVRTC and cuBLASLt load and that a device exists, and
/// describes device 0. Never panics; in a build without the `cuda` feature it
/// returns [`CudaUnavailable::NotCompiled`].
pub fn probe() -> Result<DeviceInfo, CudaUnavailable> {
    imp::probe(0)
}

/// [`probe`] describing device `ordinal` (a process of a multi-GPU launch uses its
/// `LOCAL_RANK`); an ordinal past the devices the driver reports is
/// [`CudaUnavailable::NoDevice`].
pub fn probe_device(ordinal: usize) -> Result<DeviceInfo, CudaUnavailable> {
    imp::probe(ordinal)
}

#[cfg(not(feature = "cudarc"))]
mod imp {
    use super::*;

    pub(super) fn probe(_: usize) -> Result<DeviceInfo, CudaUnavailable> {
        Err(CudaUnavailable::NotCompiled)
    }
}

#[cfg(feature = "cudarc")]
mod imp {
    use super::*;
    use cudarc::driver::result as drv;
    use cudarc::driver::sys::CUdevice_attribute as Attr;
    use std::panic::{catch_unwind, AssertUnwindSafe};

    /// Which of the libraries cudarc will open are loadable, by cudarc's own check.
    fn missing_libraries() -> Vec<MissingLibrary> {
        // SAFETY: each check opens a shared library by name (running its
        // initialisers, as any later cudarc call would) and closes it; no symbol
        // is called and nothing is kept.
        #[allow(unsafe_code)]
        let (driver, nvrtc, cublaslt) = unsafe {
            (
                cudarc::driver::sys::is_culib_present(),
                cudarc::nvrtc::sys::is_culib_present(),
                cudarc::cublaslt::sys::is_culib_present(),
            )
        };
        let mut missing = Vec::new();
        for (ok, lib) in [
            (driver, DRIVER_LIB),
            (nvrtc, NVRTC_LIB),
            (cublaslt, CUBLASLT_LIB),
        ] {
            if !ok {
                missing.push(lib);
            }
        }
        missing
    }

    /// Whether NVRTC alone can be loaded (the compile tests need nothing else).
    pub(crate) fn nvrtc_present() -> bool {
        // SAFETY: as in `missing_libraries`: open and close the library only.
        #[allow(unsafe_code)]
        unsafe {
            cudarc::nvrtc::sys::is_culib_present()
        }
    }

    fn nccl_present() -> bool {
        // SAFETY: as in `missing_libraries`.
        #[allow(unsafe_code)]
        unsafe {
            cudarc::nccl::sys::is_culib_present()
        }
    }

    fn driver_err(call: &'static str) -> impl Fn(drv::DriverError) -> CudaUnavailable {
        move |e| CudaUnavailable::Driver {
            call,
            error: e.to_string(),
        }
    }

    fn describe(ordinal: usize) -> Result<DeviceInfo, CudaUnavailable> {
        match drv::init() {
            Ok(()) => {}
            Err(e) if e.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NO_DEVICE => {
                return Err(CudaUnavailable::NoDevice)
            }
            Err(e) => return Err(driver_err("cuInit")(e)),
        }
        let count = drv::device::get_count().map_err(driver_err("cuDeviceGetCount"))?;
        if count <= 0 || ordinal >= count as usize {
            return Err(CudaUnavailable::NoDevice);
        }
        let dev = drv::device::get(ordinal as i32).map_err(driver_err("cuDeviceGet"))?;
        let name = drv::device::get_name(dev).map_err(driver_err("cuDeviceGetName"))?;
        // SAFETY: `dev` came from cuDeviceGet on an initialised driver.
        #[allow(unsafe_code)]
        let (major, minor, sms, mem) = unsafe {
            (
                drv::device::get_attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR),
                drv::device::get_attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR),
                drv::device::get_attribute(dev, Attr::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT),
                drv::device::total_mem(dev),
            )
        };
        let attr = driver_err("cuDeviceGetAttribute");
        let (major, minor, sms) = (
            major.map_err(&attr)?,
            minor.map_err(&attr)?,
            sms.map_err(&attr)?,
        );
        let mem = mem.map_err(driver_err("cuDeviceTotalMem"))?;
        let mut driver = 0i32;
        // SAFETY: cuDriverGetVersion writes one int through a valid pointer.
        #[allow(unsafe_code)]
        unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut driver) }
            .result()
            .map_err(driver_err("cuDriverGetVersion"))?;
        let nvrtc = crate::cuda::compile::nvrtc_version()?;
        Ok(DeviceInfo {
            ordinal,
            device_count: count as usize,
            name,
            compute_capability: (major, minor),
            sm_count: sms.max(0) as u32,
            total_memory_bytes: mem,
            driver_version: (driver / 1000, (driver % 1000) / 10),
            nvrtc_version: nvrtc,
            nccl: nccl_present(),
        })
    }

    pub(super) fn probe(ordinal: usize) -> Result<DeviceInfo, CudaUnavailable> {
        let missing = missing_libraries();
        if !missing.is_empty() {
            return Err(CudaUnavailable::MissingLibraries(missing));
        }
        catch_unwind(AssertUnwindSafe(|| describe(ordinal))).unwrap_or_else(|p| {
            Err(CudaUnavailable::Panicked {
                during: "reading the device",
                message: panic_message(&*p),
            })
        })
    }

    fn panic_message(p: &(dyn std::any::Any + Send)) -> String {
        p.downcast_ref::<&str>()
            .map(|s| s.to_string())
            .or_else(|| p.downcast_ref::<String>().cloned())
            .unwrap_or_else(|| "unknown panic".into())
    }
}

#[cfg(feature = "cudarc")]
pub(crate) use imp::nvrtc_present;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_say_what_to_do() {
        let e = CudaUnavailable::NotCompiled.to_string();
        assert!(e.contains("--features cuda"), "{e}");
        let e = CudaUnavailable::MissingLibraries(vec![DRIVER_LIB, NVRTC_LIB]).to_string();
        assert!(e.contains("libcuda.so.1"), "{e}");
        assert!(e.contains("LD_LIBRARY_PATH"), "{e}");
        assert!(e.contains("libnvrtc"), "{e}");
    }

    #[test]
    fn probe_never_panics_and_explains_itself() {
        match probe() {
            Ok(info) => {
                assert!(info.device_count >= 1);
                assert!(info.arch().starts_with("sm_"));
                println!("probe: {info}");
            }
            Err(e) => {
                let msg = e.to_string();
                assert!(!msg.is_empty());
                if cfg!(not(feature = "cudarc")) {
                    assert_eq!(e, CudaUnavailable::NotCompiled);
                }
                println!("probe: {msg}");
            }
        }
    }
}
