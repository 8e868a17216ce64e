//! Why a device operation failed, and the device errors as a rank's failure.

use meshplan_kernels::cpu::KernelError;

/// Why a device operation failed.
#[derive(Clone, Debug, PartialEq, thiserror::Error)]
#[error("{0}")]
pub struct DeviceError(pub String);

/// A device error as a rank's failure, naming what failed.
pub(crate) fn derr(what: &str) -> impl Fn(DeviceError) -> crate::comm::RankError + '_ {
    move |e| crate::train::fail(format!("{what}: {e}"))
}

impl From<KernelError> for DeviceError {
    fn from(e: KernelError) -> Self {
        DeviceError(e.to_string())
    }
}

/// Result of a device operation.
pub type DResult<T> = Result<T, DeviceError>;

/// The two operands only LayerNorm has (bias and means forward, means and bias
/// gradient backward), or an error naming them.
pub(crate) fn layernorm_parts<A, B>(a: Option<A>, b: Option<B>) -> DResult<(A, B)> {
    a.zip(b).ok_or_else(|| {
        DeviceError("LayerNorm needs its bias, its means and its bias gradient".into())
    })
}

/// A copy or sum whose range falls outside its buffers.
pub(crate) fn range_err(what: &str) -> DeviceError {
    DeviceError(format!("{what}: range out of bounds"))
}
