//! CPU compute kernels.
