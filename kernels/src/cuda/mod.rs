//! The GPU kernel layer: CUDA C sources (`kernels/cuda/*.cu`, one file per op
//! family, each the twin of a CPU reference kernel in [`crate::cpu`]) compiled at run
//! time with NVRTC for the device's architecture, and safe launch wrappers over
//! cudarc device buffers.
//!
//! Always built: the sources and their registry ([`KernelModule`]), the PTX cache
//! ([`cache`]) and [`probe`], which in a build without the `cuda` feature says so
//! ([`CudaUnavailable::NotCompiled`]). With the `cuda` (CUDA 13) or `cuda-12`
//! (CUDA 12.8) feature: `Gpu` (device, stream, loaded modules, cuBLASLt handle),
//! one launch method per kernel on it, `Gpu::gemm` through cuBLASLt, and
//! `compile` / `compile_cached` (NVRTC, with the compiler's log).
//!
//! cudarc loads libcuda, libnvrtc and libcublasLt when first used and panics if one
//! is missing, so nothing here touches cudarc before [`probe`] has checked that each
//! library can be loaded; `Gpu::new` runs the probe first.
//!
//! Precision: activations and weights used for compute are bf16 (`half::bf16` on the
//! Rust side, the bit pattern in the kernels) with fp32 accumulation; master
//! weights, optimizer moments, parameter gradients, statistics and losses are fp32.
//! As on the CPU, forward kernels overwrite their outputs and backward kernels add
//! into every gradient (bf16 ones by read, add in fp32, round once).

pub mod cache;
mod probe;

pub use probe::{probe, probe_device, CudaUnavailable, DeviceInfo, MissingLibrary};

#[cfg(feature = "cudarc")]
mod compile;
#[cfg(feature = "cudarc")]
mod gemm;
#[cfg(feature = "cudarc")]
mod gpu;
#[cfg(feature = "cudarc")]
mod layout_ops;
#[cfg(feature = "cudarc")]
mod ops;
#[cfg(all(test, feature = "cudarc"))]
mod tests;

#[cfg(feature = "cudarc")]
pub use compile::{compile, compile_cached, nvrtc_version, Compiled, KernelCompileError};
/// cudarc itself, for crates above (the executor's NCCL communicator) that need its
/// driver and NCCL APIs at the same version and features.
#[cfg(feature = "cudarc")]
pub use cudarc;
#[cfg(feature = "cudarc")]
pub use gemm::GemmOut;
#[cfg(feature = "cudarc")]
pub use gpu::{Gpu, GpuError};
#[cfg(feature = "cudarc")]
pub use half::bf16;

/// The shared helpers every module starts with (bf16 conversion, reductions).
#[cfg(test)]
const PRELUDE: &str = include_str!("../../cuda/prelude.cuh");

/// A family of kernels: one `.cu` file, compiled as one NVRTC program.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum KernelModule {
    /// `embedding.cu`: vocabulary-parallel lookup and its gradient.
    Embedding,
    /// `norm.cu`: LayerNorm and RMSNorm forward and backward.
    Norm,
    /// `rope.cu`: rotary position embedding.
    Rope,
    /// `activation.cu`: GELU, SwiGLU, residual add.
    Activation,
    /// `cast.cu`: fp32 <-> bf16.
    Cast,
    /// `loss.cu`: fused cross-entropy (loss and logits gradient).
    Loss,
    /// `adamw.cu`: fused AdamW with the bf16 weight copy.
    Adamw,
    /// `attention.cu`: flash-style causal GQA attention forward and backward.
    Attention,
    /// `moe.cu`: MoE routing, dispatch and combine.
    Moe,
    /// `layout.cu`: the device interpreter's data movement (fused QKV split and
    /// join, batch/sequence transpose, RoPE on fused rows) and bias/accumulate.
    Layout,
}

/// Every module, in a fixed order (the index of [`KernelModule::index`]).
pub const ALL_MODULES: [KernelModule; 10] = [
    KernelModule::Embedding,
    KernelModule::Norm,
    KernelModule::Rope,
    KernelModule::Activation,
    KernelModule::Cast,
    KernelModule::Loss,
    KernelModule::Adamw,
    KernelModule::Attention,
    KernelModule::Moe,
    KernelModule::Layout,
];

/// The prelude, a `#line` reset (so NVRTC's messages name the `.cu` file and its own
/// line numbers), then the file.
macro_rules! module_source {
    ($file:literal) => {
        concat!(
            include_str!("../../cuda/prelude.cuh"),
            "\n#line 1 \"",
            $file,
            "\"\n",
            include_str!(concat!("../../cuda/", $file))
        )
    };
}

impl KernelModule {
    /// Position in [`ALL_MODULES`].
    pub fn index(self) -> usize {
        self as usize
    }

    /// The `.cu` file name (also the NVRTC program name).
    pub fn file(self) -> &'static str {
        match self {
            KernelModule::Embedding => "embedding.cu",
            KernelModule::Norm => "norm.cu",
            KernelModule::Rope => "rope.cu",
            KernelModule::Activation => "activation.cu",
            KernelModule::Cast => "cast.cu",
            KernelModule::Loss => "loss.cu",
            KernelModule::Adamw => "adamw.cu",
            KernelModule::Attention => "attention.cu",
            KernelModule::Moe => "moe.cu",
            KernelModule::Layout => "layout.cu",
        }
    }

    /// The complete source NVRTC compiles: the prelude, then the file. No include
    /// path and no CUDA header is needed.
    pub fn source(self) -> &'static str {
        match self {
            KernelModule::Embedding => module_source!("embedding.cu"),
            KernelModule::Norm => module_source!("norm.cu"),
            KernelModule::Rope => module_source!("rope.cu"),
            KernelModule::Activation => module_source!("activation.cu"),
            KernelModule::Cast => module_source!("cast.cu"),
            KernelModule::Loss => module_source!("loss.cu"),
            KernelModule::Adamw => module_source!("adamw.cu"),
            KernelModule::Attention => module_source!("attention.cu"),
            KernelModule::Moe => module_source!("moe.cu"),
            KernelModule::Layout => module_source!("layout.cu"),
        }
    }

    /// The `extern "C"` kernels the module defines (what the launch wrappers
    /// load), read from its source: adding a kernel to a `.cu` file registers it.
    pub fn kernels(self) -> Vec<&'static str> {
        extern_kernels(self.source())
    }
}

/// The names of the `extern "C" __global__` functions of CUDA source `src`, in
/// order (a `__launch_bounds__(...)` between the return type and the name is
/// skipped).
fn extern_kernels(src: &'static str) -> Vec<&'static str> {
    let decl = "extern \"C\" __global__ void";
    src.match_indices(decl)
        .map(|(at, _)| {
            let mut rest = src[at + decl.len()..].trim_start();
            if let Some(r) = rest.strip_prefix("__launch_bounds__") {
                rest = r.find(')').map_or("", |p| r[p + 1..].trim_start());
            }
            let end = rest
                .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                .unwrap_or(rest.len());
            &rest[..end]
        })
        .filter(|name| !name.is_empty())
        .collect()
}

#[cfg(test)]
mod registry_tests {
    use super::*;

    #[test]
    fn every_module_is_listed_once_and_names_its_kernels() {
        for (i, m) in ALL_MODULES.iter().enumerate() {
            assert_eq!(m.index(), i, "{m:?}");
            let src = m.source();
            assert!(src.starts_with(PRELUDE), "{m:?} starts with the prelude");
            assert!(src.contains(&format!("#line 1 \"{}\"", m.file())));
            for k in m.kernels() {
                assert!(
                    src.contains(&format!(" {k}(")),
                    "{} defines no kernel `{k}`",
                    m.file()
                );
            }
        }
        // Every `.cu` file of kernels/cuda is a module (none is forgotten).
        let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/cuda");
        let mut files: Vec<String> = std::fs::read_dir(dir)
            .expect("kernels/cuda")
            .flatten()
            .map(|e| e.file_name().to_string_lossy().into_owned())
            .filter(|n| n.ends_with(".cu"))
            .collect();
        files.sort();
        let mut listed: Vec<String> = ALL_MODULES.iter().map(|m| m.file().to_string()).collect();
        listed.sort();
        assert_eq!(files, listed);
    }

    #[test]
    fn kernels_are_read_from_the_source() {
        let src = "extern \"C\" __global__ void a_f32(int n) {}\n\
                   __device__ void helper() {}\n\
                   extern \"C\" __global__ void __launch_bounds__(128) b_bf16(int n) {}";
        assert_eq!(extern_kernels(src), ["a_f32", "b_bf16"]);
        // Every module defines kernels, each name once; the ones the launch
        // wrappers load by name are among them.
        let mut all: Vec<&str> = ALL_MODULES.iter().flat_map(|m| m.kernels()).collect();
        let n = all.len();
        all.sort_unstable();
        all.dedup();
        assert_eq!(all.len(), n, "a kernel name defined twice");
        for m in ALL_MODULES {
            assert!(!m.kernels().is_empty(), "{m:?}");
        }
        // Each name a launch wrapper loads (`self.function(M::Module, "name")`)
        // is a kernel of that module.
        let ops = include_str!("ops.rs");
        let mut loads = 0;
        for (at, _) in ops.match_indices("self.function(M::") {
            let rest = &ops[at + "self.function(M::".len()..];
            let (module, rest) = rest.split_once(',').expect("a module and a name");
            let Some(name) = rest.trim_start().strip_prefix('"') else {
                continue; // a name chosen at run time (attention's head-size variants)
            };
            let name = &name[..name.find('"').expect("closing quote")];
            let m = ALL_MODULES
                .iter()
                .find(|m| format!("{m:?}") == module)
                .unwrap_or_else(|| panic!("no module {module}"));
            assert!(m.kernels().contains(&name), "{name} is not in {m:?}");
            loads += 1;
        }
        assert!(loads >= 40, "{loads} loads found in ops.rs");
    }
}
