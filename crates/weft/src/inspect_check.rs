//! `weft inspect --check`: finds tensors holding NaN or infinite values, which load fine
//! and then turn every logit into NaN. Unquantized tensors (norm weights, biases: small)
//! are always scanned; `--all` dequantizes the large quantized weights too.

use anyhow::{bail, Result};
use weft_gguf::{GgmlType, GgufFile, TensorInfo};
use weft_kernels::quant;

/// NaN and infinite values found in one tensor.
#[derive(Debug, Default, PartialEq)]
pub struct Bad {
    pub nan: u64,
    pub inf: u64,
}

/// Counts the non-finite values of `t`, one row at a time.
pub fn scan(f: &GgufFile, t: &TensorInfo) -> Bad {
    let bytes = f.tensor_bytes(t);
    let (len, rb) = (t.row_len(), t.row_bytes());
    let mut row = vec![0f32; len];
    let mut bad = Bad::default();
    for src in bytes.chunks_exact(rb).take(t.n_rows()) {
        quant::dequantize_row(t.ty, src, &mut row);
        for v in &row {
            bad.nan += v.is_nan() as u64;
            bad.inf += v.is_infinite() as u64;
        }
    }
    bad
}

fn unquantized(ty: GgmlType) -> bool {
    matches!(ty, GgmlType::F32 | GgmlType::F16 | GgmlType::BF16)
}

/// Prints each offending tensor and fails when there is any.
pub fn run(f: &GgufFile, all: bool) -> Result<()> {
    let mut offenders = Vec::new();
    let mut scanned = 0usize;
    for t in f.tensors() {
        if !all && !unquantized(t.ty) {
            continue;
        }
        scanned += 1;
        let bad = scan(f, t);
        if bad.nan + bad.inf > 0 {
            outln!(
                "  {}: {} NaN, {} infinite of {} values",
                t.name,
                bad.nan,
                bad.inf,
                t.n_elements()
            )?;
            offenders.push(t.name.clone());
        }
    }
    let what = if all {
        "tensors"
    } else {
        "unquantized tensors (--all: every tensor)"
    };
    if offenders.is_empty() {
        outln!("check: {scanned} {what} scanned, all values finite")?;
        return Ok(());
    }
    bail!(
        "{}: {} of {scanned} {what} hold NaN or infinite values: {}",
        f.path().display(),
        offenders.len(),
        offenders.join(", ")
    )
}
