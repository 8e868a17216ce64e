//! NVRTC: a [`KernelModule`]'s source to PTX for one architecture, keeping the
//! compiler's log (warnings included), and the cached form of it.

use super::{cache, probe, CudaUnavailable, KernelModule};
use cudarc::nvrtc::{result, sys};
use std::ffi::{c_char, CString};
use std::fmt;
use std::path::Path;

/// NVRTC's output for one module.
#[derive(Debug, Clone)]
pub struct Compiled {
    /// The PTX text (no NUL; ends with a newline).
    pub ptx: String,
    /// NVRTC's log: empty unless it warned.
    pub log: String,
}

/// NVRTC refused a module (or could not be reached); the log is kept whole.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct KernelCompileError {
    /// The `.cu` file.
    pub module: &'static str,
    /// The `--gpu-architecture` asked for.
    pub arch: String,
    /// What failed.
    pub error: String,
    /// NVRTC's log.
    pub log: String,
}

impl fmt::Display for KernelCompileError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "NVRTC could not compile {} for {}: {}",
            self.module, self.arch, self.error
        )?;
        if !self.log.trim().is_empty() {
            write!(f, "\n{}", self.log.trim_end())?;
        }
        Ok(())
    }
}

impl std::error::Error for KernelCompileError {}

/// The options every module is compiled with: the explicit architecture (never
/// NVRTC's default), C++17 for the prelude's lambdas, line info for profilers.
pub fn options(arch: &str) -> Vec<String> {
    vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-lineinfo".to_string(),
    ]
}

/// NVRTC's version (major, minor), after checking that the library loads.
pub fn nvrtc_version() -> Result<(i32, i32), CudaUnavailable> {
    if !probe::nvrtc_present() {
        return Err(CudaUnavailable::MissingLibraries(vec![probe::NVRTC_LIB]));
    }
    let (mut major, mut minor) = (0, 0);
    // SAFETY: the library is loadable (checked above); nvrtcVersion writes two ints
    // through valid pointers.
    #[allow(unsafe_code)]
    let status = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    status.result().map_err(|e| CudaUnavailable::Driver {
        call: "nvrtcVersion",
        error: e.to_string(),
    })?;
    Ok((major, minor))
}

fn text(raw: &[c_char]) -> String {
    let bytes: Vec<u8> = raw
        .iter()
        .map(|&c| c as u8)
        .take_while(|&b| b != 0)
        .collect();
    String::from_utf8_lossy(&bytes).into_owned()
}

/// An NVRTC program, destroyed on drop.
struct Program(sys::nvrtcProgram);

impl Drop for Program {
    fn drop(&mut self) {
        // SAFETY: the program came from nvrtcCreateProgram and is destroyed once,
        // here; a failure to free is ignored (nothing is left to use it).
        #[allow(unsafe_code)]
        let _ = unsafe { result::destroy_program(self.0) };
    }
}

/// Compiles `module` for `arch` (`sm_90`, `sm_80`, `sm_90a`, ...).
pub fn compile(module: KernelModule, arch: &str) -> Result<Compiled, KernelCompileError> {
    let fail = |error: String, log: String| KernelCompileError {
        module: module.file(),
        arch: arch.to_string(),
        error,
        log,
    };
    if arch.is_empty() || !arch.chars().all(|c| c.is_ascii_alphanumeric() || c == '_') {
        return Err(fail(
            format!("`{arch}` is not an architecture name"),
            String::new(),
        ));
    }
    nvrtc_version().map_err(|e| fail(e.to_string(), String::new()))?;
    let src = CString::new(module.source())
        .map_err(|_| fail("the source contains a NUL byte".into(), String::new()))?;
    let name = CString::new(module.file())
        .map_err(|_| fail("the file name contains a NUL byte".into(), String::new()))?;
    let prog = Program(
        result::create_program(&src, Some(&name))
            .map_err(|e| fail(format!("nvrtcCreateProgram: {e}"), String::new()))?,
    );
    let opts = options(arch);
    // SAFETY: `prog` is a live program (owned by the guard, destroyed only on drop,
    // after these calls); `src` and `name` outlive it; the options hold no NUL.
    #[allow(unsafe_code)]
    let (status, log) = unsafe {
        let status = result::compile_program(prog.0, &opts);
        let log = result::get_program_log(prog.0)
            .map(|l| text(&l))
            .unwrap_or_default();
        (status, log)
    };
    status.map_err(|e| fail(e.to_string(), log.clone()))?;
    // SAFETY: as above; the program compiled, so it has PTX.
    #[allow(unsafe_code)]
    let ptx = unsafe { result::get_ptx(prog.0) }
        .map_err(|e| fail(format!("nvrtcGetPTX: {e}"), log.clone()))?;
    let mut ptx = text(&ptx);
    // One form for compiled and cached PTX (the cache stores whole lines).
    if !ptx.ends_with('\n') {
        ptx.push('\n');
    }
    Ok(Compiled { ptx, log })
}

/// The PTX of `module` for `arch`: from the cache folder `dir` when it holds this
/// exact source, architecture, NVRTC version and options, else compiled and stored
/// there (a failure to store is not an error). Returns the PTX and whether it came
/// from the cache.
pub fn compile_cached(
    module: KernelModule,
    arch: &str,
    dir: Option<&Path>,
) -> Result<(String, bool), KernelCompileError> {
    let version = nvrtc_version().map_err(|e| KernelCompileError {
        module: module.file(),
        arch: arch.to_string(),
        error: e.to_string(),
        log: String::new(),
    })?;
    let key = cache::key(module.source(), arch, version, &options(arch));
    if let Some(dir) = dir {
        if let Some(ptx) = cache::read(dir, &key) {
            return Ok((ptx, true));
        }
    }
    let compiled = compile(module, arch)?;
    if let Some(dir) = dir {
        let _ = cache::write(dir, &key, &compiled.ptx);
    }
    Ok((compiled.ptx, false))
}
