//! GEMM through cuBLASLt: bf16 inputs, fp32 accumulation, fp32 or bf16 output,
//! row-major with the transposes of [`crate::cpu::matmul()`].
//!
//! cuBLASLt is column-major, and a row-major `[r, c]` matrix is the column-major
//! `[c, r]` one: `C = op(A) op(B)` (row-major) is computed as
//! `Cᵀ = op(B)ᵀ op(A)ᵀ` (column-major), i.e. cuBLASLt's `A` is our `b` and its `B`
//! our `a`, with the same transpose flags and leading dimensions equal to the
//! stored row lengths.

use super::gpu::{Gpu, GpuError};
use crate::cpu::{check_len, invalid, prod, GemmAt, KernelError, Transpose};
use cudarc::cublaslt::result::{self as lt, CublasError};
use cudarc::cublaslt::sys;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr, ValidAsZeroBits};
use half::bf16;
use std::ffi::c_void;
use std::mem::size_of;
use std::sync::{Arc, PoisonError};

/// An output type of [`Gpu::gemm`]: fp32 (e.g. weight gradients accumulated with
/// `beta = 1`) or bf16 (activations).
pub trait GemmOut: DeviceRepr + ValidAsZeroBits {
    /// cuBLASLt's name for the type.
    #[doc(hidden)]
    fn data_type() -> sys::cudaDataType;
}

impl GemmOut for f32 {
    fn data_type() -> sys::cudaDataType {
        sys::cudaDataType_t::CUDA_R_32F
    }
}

impl GemmOut for bf16 {
    fn data_type() -> sys::cudaDataType {
        sys::cudaDataType_t::CUDA_R_16BF
    }
}

/// A cuBLASLt handle and its workspace (32 MiB on Hopper and later, 4 MiB before,
/// as NVIDIA recommends).
pub(crate) struct Blas {
    handle: sys::cublasLtHandle_t,
    workspace: CudaSlice<u8>,
}

// SAFETY: the handle is a pointer to cuBLASLt's own state, which may be used from
// any thread; `Gpu` keeps the `Blas` behind a mutex, so one call at a time uses it
// and its workspace.
#[allow(unsafe_code)]
unsafe impl Send for Blas {}

impl Blas {
    pub(crate) fn new(stream: &Arc<CudaStream>) -> Result<Blas, GpuError> {
        let major = stream.context().attribute(
            cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR,
        )?;
        let bytes = if major >= 9 { 32 << 20 } else { 4 << 20 };
        let workspace = stream.alloc_zeros::<u8>(bytes)?;
        let handle = lt::create_handle()?;
        Ok(Blas { handle, workspace })
    }
}

impl Drop for Blas {
    fn drop(&mut self) {
        // SAFETY: the handle came from cublasLtCreate and is destroyed once, here.
        #[allow(unsafe_code)]
        let _ = unsafe { lt::destroy_handle(self.handle) };
    }
}

/// A matrix layout descriptor, destroyed on drop.
struct Layout(sys::cublasLtMatrixLayout_t);

impl Layout {
    /// Column-major `rows x cols` with leading dimension `ld`, `batch` matrices
    /// `stride` elements apart.
    fn new(
        ty: sys::cudaDataType,
        rows: usize,
        cols: usize,
        ld: usize,
        batch: i32,
        stride: i64,
    ) -> Result<Layout, CublasError> {
        let layout = Layout(lt::create_matrix_layout(
            ty,
            rows as u64,
            cols as u64,
            ld.max(1) as i64,
        )?);
        if batch > 1 {
            // SAFETY: the layout is live; each attribute is passed as a pointer to a
            // value of the type and size cuBLASLt documents for it (int32, int64).
            #[allow(unsafe_code)]
            unsafe {
                lt::set_matrix_layout_attribute(
                    layout.0,
                    sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT,
                    (&batch as *const i32).cast(),
                    size_of::<i32>(),
                )?;
                lt::set_matrix_layout_attribute(
                    layout.0,
                    sys::cublasLtMatrixLayoutAttribute_t::CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET,
                    (&stride as *const i64).cast(),
                    size_of::<i64>(),
                )?;
            }
        }
        Ok(layout)
    }
}

impl Drop for Layout {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatrixLayoutCreate, destroyed once.
        #[allow(unsafe_code)]
        let _ = unsafe { lt::destroy_matrix_layout(self.0) };
    }
}

/// A matmul descriptor, destroyed on drop.
struct Desc(sys::cublasLtMatmulDesc_t);

impl Drop for Desc {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulDescCreate, destroyed once.
        #[allow(unsafe_code)]
        let _ = unsafe { lt::destroy_matmul_desc(self.0) };
    }
}

/// A heuristic preference, destroyed on drop.
struct Pref(sys::cublasLtMatmulPreference_t);

impl Drop for Pref {
    fn drop(&mut self) {
        // SAFETY: created by cublasLtMatmulPreferenceCreate, destroyed once.
        #[allow(unsafe_code)]
        let _ = unsafe { lt::destroy_matmul_pref(self.0) };
    }
}

/// (rows, cols, ld) of a row-major operand stored `[r, c]` (or `[c, r]` when
/// transposed), seen column-major.
fn col_major(trans: Transpose, r: usize, c: usize) -> (usize, usize, usize) {
    match trans {
        // Stored row-major [r, c] = column-major [c, r], leading dimension c.
        Transpose::No => (c, r, c),
        // Stored row-major [c, r] = column-major [r, c], leading dimension r.
        Transpose::Yes => (r, c, r),
    }
}

fn op(trans: Transpose) -> i32 {
    // cublasOperation_t: CUBLAS_OP_N = 0, CUBLAS_OP_T = 1.
    match trans {
        Transpose::No => 0,
        Transpose::Yes => 1,
    }
}

impl Gpu {
    /// `C = beta * C + op(A) op(B)` on the device, as [`crate::cpu::matmul()`]:
    /// `op(A)` is `[m, k]` (`a` stored `[m, k]`, or `[k, m]` with
    /// [`Transpose::Yes`]), `op(B)` is `[k, n]`, `C` is `[m, n]`, all row-major.
    /// bf16 inputs, fp32 accumulation; `C` is fp32 or bf16. With `beta == 0` the old
    /// `C` is not read.
    #[allow(clippy::too_many_arguments)] // the BLAS signature of `cpu::matmul`
    pub fn gemm<C: GemmOut>(
        &self,
        trans_a: Transpose,
        trans_b: Transpose,
        m: usize,
        k: usize,
        n: usize,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        beta: f32,
        c: &mut CudaSlice<C>,
    ) -> Result<(), GpuError> {
        self.gemm_batched(1, trans_a, trans_b, m, k, n, a, b, beta, c)
    }

    /// [`Gpu::gemm`] over a leading batch dimension (`a` is `[batch, ..]`, and so
    /// on), one strided-batched cuBLASLt call.
    #[allow(clippy::too_many_arguments)]
    pub fn gemm_batched<C: GemmOut>(
        &self,
        batch: usize,
        trans_a: Transpose,
        trans_b: Transpose,
        m: usize,
        k: usize,
        n: usize,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        beta: f32,
        c: &mut CudaSlice<C>,
    ) -> Result<(), GpuError> {
        let (sa, sb, sc) = (
            prod("a", &[m, k])?,
            prod("b", &[k, n])?,
            prod("c", &[m, n])?,
        );
        check_len("a", a.len(), prod("a", &[batch, sa])?)?;
        check_len("b", b.len(), prod("b", &[batch, sb])?)?;
        check_len("c", c.len(), prod("c", &[batch, sc])?)?;
        let g = GemmAt {
            ta: trans_a,
            tb: trans_b,
            m,
            k,
            n,
            a_off: 0,
            b_off: 0,
            c_off: 0,
        };
        self.gemm_core(batch, &g, a, b, beta, c)
    }

    /// [`crate::cpu::matmul_at`]: one product on spans of larger buffers (each
    /// routed expert's rows against its block of a stacked weight), without a copy.
    pub fn gemm_at<C: GemmOut>(
        &self,
        g: &GemmAt,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        beta: f32,
        c: &mut CudaSlice<C>,
    ) -> Result<(), GpuError> {
        g.spans_within([a.len(), b.len(), c.len()])?;
        self.gemm_core(1, g, a, b, beta, c)
    }

    /// The cuBLASLt call behind [`Gpu::gemm_batched`] and [`Gpu::gemm_at`]; the
    /// callers checked the buffers cover `batch` products from the offsets on.
    fn gemm_core<C: GemmOut>(
        &self,
        batch: usize,
        g: &GemmAt,
        a: &CudaSlice<bf16>,
        b: &CudaSlice<bf16>,
        beta: f32,
        c: &mut CudaSlice<C>,
    ) -> Result<(), GpuError> {
        let GemmAt {
            ta: trans_a,
            tb: trans_b,
            m,
            k,
            n,
            ..
        } = *g;
        let (sa, sb, sc) = (
            prod("a", &[m, k])?,
            prod("b", &[k, n])?,
            prod("c", &[m, n])?,
        );
        let batch_i32 =
            i32::try_from(batch).map_err(|_| invalid("batch", "does not fit in i32"))?;
        for (name, len) in [("a", a.len()), ("b", b.len()), ("c", c.len())] {
            if len > i64::MAX as usize / 4 {
                return Err(invalid(name, "too large for cuBLASLt").into());
            }
        }
        if batch == 0 || m == 0 || n == 0 {
            return Ok(());
        }
        if k == 0 {
            // An empty inner product: C = beta * C. cuBLASLt's k = 0 is not relied
            // on; the two values a caller uses are handled here.
            return if beta == 0.0 {
                // Only the products' span of C, as the CPU's `matmul_at` writes.
                let span = g.c_off..g.c_off + batch * sc;
                Ok(self.stream.memset_zeros(&mut c.slice_mut(span))?)
            } else if beta == 1.0 {
                Ok(())
            } else {
                Err(KernelError::Invalid {
                    name: "beta",
                    reason: "k = 0 with beta other than 0 or 1".into(),
                }
                .into())
            };
        }
        let blas = self.blas.lock().unwrap_or_else(PoisonError::into_inner);
        // cuBLASLt's A is our b (op(b)ᵀ is [n, k] column-major), its B our a.
        let (ar, ac, ald) = col_major(trans_b, k, n);
        let (br, bc, bld) = col_major(trans_a, m, k);
        let bf = sys::cudaDataType_t::CUDA_R_16BF;
        let a_layout = Layout::new(bf, ar, ac, ald, batch_i32, sb as i64)?;
        let b_layout = Layout::new(bf, br, bc, bld, batch_i32, sa as i64)?;
        let c_layout = Layout::new(C::data_type(), n, m, n, batch_i32, sc as i64)?;
        let desc = Desc(lt::create_matmul_desc(
            sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
            sys::cudaDataType_t::CUDA_R_32F,
        )?);
        let (ta, tb) = (op(trans_b), op(trans_a));
        let pref = Pref(lt::create_matmul_pref()?);
        let ws_bytes = blas.workspace.len();
        // SAFETY: the descriptors are live (owned by the guards above); each
        // attribute points at a value of the documented type and size
        // (cublasOperation_t as i32, size_t).
        #[allow(unsafe_code)]
        unsafe {
            lt::set_matmul_desc_attribute(
                desc.0,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSA,
                (&ta as *const i32).cast(),
                size_of::<i32>(),
            )?;
            lt::set_matmul_desc_attribute(
                desc.0,
                sys::cublasLtMatmulDescAttributes_t::CUBLASLT_MATMUL_DESC_TRANSB,
                (&tb as *const i32).cast(),
                size_of::<i32>(),
            )?;
            lt::set_matmul_pref_attribute(
                pref.0,
                sys::cublasLtMatmulPreferenceAttributes_t::CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                (&ws_bytes as *const usize).cast(),
                size_of::<usize>(),
            )?;
        }
        // SAFETY: handle, descriptors and layouts are live and describe the buffers
        // whose lengths were checked above.
        #[allow(unsafe_code)]
        let heuristic = unsafe {
            lt::get_matmul_algo_heuristic(
                blas.handle,
                desc.0,
                a_layout.0,
                b_layout.0,
                c_layout.0,
                c_layout.0,
                pref.0,
            )
        }?;
        let stream = &self.stream;
        let (pa, _ra) = b.device_ptr(stream);
        let (pb, _rb) = a.device_ptr(stream);
        let (pc, _rc) = c.device_ptr_mut(stream);
        // Byte offsets of the spans (within the allocations, as checked).
        let pa = pa + (g.b_off * size_of::<bf16>()) as u64;
        let pb = pb + (g.a_off * size_of::<bf16>()) as u64;
        let pc = pc + (g.c_off * size_of::<C>()) as u64;
        let (pw, _rw) = blas.workspace.device_ptr(stream);
        let alpha = 1.0f32;
        // SAFETY: every pointer is a live device allocation of the length checked
        // against the layouts (m, n, k, batch and strides as set above); C is read
        // and written in place (C and D share a layout), which cuBLASLt allows; the
        // workspace is exclusively ours while the mutex is held; alpha and beta are
        // fp32 host values, matching the fp32 scale type.
        #[allow(unsafe_code)]
        unsafe {
            lt::matmul(
                blas.handle,
                desc.0,
                (&alpha as *const f32).cast::<c_void>(),
                (&beta as *const f32).cast::<c_void>(),
                pa as *const c_void,
                a_layout.0,
                pb as *const c_void,
                b_layout.0,
                pc as *const c_void,
                c_layout.0,
                pc as *mut c_void,
                c_layout.0,
                &heuristic.algo,
                pw as *mut c_void,
                ws_bytes,
                stream.cu_stream() as sys::cudaStream_t,
            )
        }?;
        Ok(())
    }
}
