//! `meshplan._native`: the command line's own dispatch, called in-process.
//!
//! The Python package builds the arguments a user would type and gets back the JSON
//! object the command prints with `--json` (or the file it writes); every check,
//! default and message is the command line's. Nothing here decides anything.

use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _native,
    NativeError,
    PyException,
    "A meshplan failure: args[0] is the exit code the command line gives (1 runtime, 2 bad input, 3 does not fit), args[1] its message."
);

/// Runs `meshplan ARGS` and returns what it printed as one JSON object (text), or
/// raises `NativeError(code, message)`.
#[pyfunction]
fn run_json(py: Python<'_>, args: Vec<String>) -> PyResult<String> {
    let out = py.detach(|| meshplan::run_json(&args));
    match out {
        Ok(v) => Ok(v.to_string()),
        Err(f) => Err(NativeError::new_err((f.code, f.message))),
    }
}

/// The version of the meshplan crate the module was built from.
#[pyfunction]
fn version() -> &'static str {
    meshplan::VERSION
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_function(wrap_pyfunction!(run_json, m)?)?;
    m.add_function(wrap_pyfunction!(version, m)?)?;
    m.add("NativeError", m.py().get_type::<NativeError>())?;
    Ok(())
}
