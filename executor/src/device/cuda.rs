//! The CUDA [`super::Device`] (feature `cuda`).
