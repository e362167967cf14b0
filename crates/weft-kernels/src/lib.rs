//! CPU compute for weft: quantized matvec/matmul per GGML block type, vector primitives,
//! transformer ops, and the data plane's thread pool. Knows nothing of models or networks.

pub mod activation;
pub mod calibrate;
pub mod choose;
pub mod choose_tiles;
pub mod grid;
mod keep;
pub mod ops;
pub mod pages;
pub mod pool;
pub mod quant;
pub mod roofline;
pub mod vecops;

pub use pool::ThreadPool;
