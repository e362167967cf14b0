//! Weight tensors of one shard: linear layers whose rows (a byte range of the mmap, or
//! copied column blocks) are copied once more at load into huge pages, interleaved for
//! this CPU's kernels or in ggml's layout (a dry run keeps them where they are); norm
//! vectors, and the token embedding.

use std::ops::Range;
use std::sync::Arc;

use weft_gguf::{GgmlType, GgufFile};
use weft_kernels::pages::HugeBuf;
use weft_kernels::quant;
use weft_kernels::ThreadPool;

use crate::error::ModelError;

fn tensor_err(file: &GgufFile, tensor: &str, detail: String) -> ModelError {
    ModelError::Tensor {
        path: file.path().display().to_string(),
        tensor: tensor.to_string(),
        detail,
    }
}

enum Bytes {
    /// A byte range of the mapped file: only pages this shard touches become resident.
    Mapped {
        file: Arc<GgufFile>,
        range: Range<usize>,
    },
    Owned(Vec<u8>),
    /// Rows in ggml's layout, copied at load into huge pages where the kernel gives them
    /// (`weft_kernels::pages`).
    Rows(HugeBuf),
    /// Rows interleaved for this CPU's kernels (`quant::pack`), copied alike.
    Packed(HugeBuf),
}

/// A (possibly sharded) linear layer y = W x (+ b): `n_out` rows of `n_in` values.
pub struct Linear {
    pub name: String,
    pub ty: GgmlType,
    pub n_in: usize,
    pub n_out: usize,
    bytes: Bytes,
    pub bias: Option<Vec<f32>>,
}

/// Disjoint output ranges are written from several threads.
#[derive(Clone, Copy)]
struct SyncPtr(*mut f32);
// SAFETY: used only to hand disjoint sub-slices to pool tasks.
unsafe impl Send for SyncPtr {}
unsafe impl Sync for SyncPtr {}

impl SyncPtr {
    /// Through a method so closures capture the whole (Sync) wrapper, not the raw field.
    fn get(self) -> *mut f32 {
        self.0
    }
}

impl Linear {
    fn check(file: &GgufFile, name: &str, n_in: usize, n_out: usize) -> Result<(), ModelError> {
        Self::check_dims(file, name, &[n_in, n_out])
    }

    fn check_dims(file: &GgufFile, name: &str, want: &[usize]) -> Result<(), ModelError> {
        let t = file.tensor(name)?;
        if t.dims.len() != want.len() || t.dims.iter().zip(want).any(|(&d, &w)| d as usize != w) {
            return Err(tensor_err(
                file,
                name,
                format!("shape {:?}, expected {want:?}", t.dims),
            ));
        }
        if !GgmlType::WEIGHT_TYPES.contains(&t.ty) {
            return Err(tensor_err(
                file,
                name,
                format!("type {} cannot be a weight", t.ty),
            ));
        }
        Ok(())
    }

    /// Rows `rows` of a `[n_in, n_out]` weight (column-parallel: split outputs).
    pub fn load_rows(
        file: &Arc<GgufFile>,
        name: &str,
        n_in: usize,
        n_out: usize,
        rows: Range<usize>,
    ) -> Result<Self, ModelError> {
        Self::check(file, name, n_in, n_out)?;
        let t = file.tensor(name)?;
        let range = file.row_range(t, rows.clone())?;
        let bias = load_bias(file, name, n_out, rows.clone())?;
        Ok(Linear {
            name: name.to_string(),
            ty: t.ty,
            n_in,
            n_out: rows.len(),
            bytes: Bytes::Mapped {
                file: file.clone(),
                range,
            },
            bias,
        }
        .settled(file))
    }

    /// Rows `rows` of a `[n_in, n_out]` weight dequantized to f32, and transposed (`n_in`
    /// outputs of `rows.len()` inputs) where `transposed`. For the legacy deepseek2
    /// `attn_kv_b`, whose key rows absorbed attention applies from the query side: f32 so
    /// that no rounding of the activations is added where llama.cpp has none.
    pub fn load_rows_f32(
        file: &Arc<GgufFile>,
        name: &str,
        [n_in, n_out]: [usize; 2],
        rows: Range<usize>,
        transposed: bool,
    ) -> Result<Self, ModelError> {
        Self::check(file, name, n_in, n_out)?;
        let t = file.tensor(name)?;
        let bytes = file.slice(file.row_range(t, rows.clone())?);
        let (rb, k) = (t.row_bytes(), rows.len());
        let mut out = vec![0f32; n_in * k];
        let mut row = vec![0f32; n_in];
        for i in 0..k {
            quant::dequantize_row(t.ty, &bytes[i * rb..(i + 1) * rb], &mut row);
            if transposed {
                for (j, &v) in row.iter().enumerate() {
                    out[j * k + i] = v;
                }
            } else {
                out[i * n_in..(i + 1) * n_in].copy_from_slice(&row);
            }
        }
        let (n_in, n_out) = if transposed { (k, n_in) } else { (n_in, k) };
        Ok(Linear {
            name: format!("{name}[{rows:?}]"),
            ty: GgmlType::F32,
            n_in,
            n_out,
            bytes: Bytes::Owned(quant::quantize_row(GgmlType::F32, &out)),
            bias: None,
        })
    }

    /// The layer in the memory decode streams best, copied once at load: its rows
    /// interleaved where this CPU's kernels read them faster so (`quant::packs`: prefill
    /// about twice as fast on Q4_K), else ggml's rows as they are; either way in huge pages
    /// where the kernel gives them (`weft_kernels::pages`), one run in load order. A Q8_0
    /// head streamed 9-27 % faster so than from the file's 4 KiB pages (AMD Zen 3,
    /// `kbench` dram against huge, two runs: 10.7 -> 13.6 and 14.4 -> 15.7 GB/s). The
    /// mapped pages it copied are released, so the shard's memory does not double. A dry
    /// run's `file` (`GgufFile::records_only`) keeps the mapping: its bytes are
    /// placeholders, and copying them would cost a whole shard's memory and time before the
    /// fetch (its weight bytes then count ggml's size, 2.8 % under the packed size for
    /// Q4_K).
    pub(crate) fn settled(mut self, file: &GgufFile) -> Self {
        if file.records_only() {
            return self;
        }
        let pack = quant::packs(self.ty, self.n_in);
        let copied = if pack {
            quant::pack_rows_huge(self.ty, self.n_in, self.bytes(), self.n_out)
        } else {
            HugeBuf::zeroed(self.n_bytes()).map(|mut b| {
                b.copy_from_slice(self.bytes());
                b
            })
        };
        let copied = match copied {
            Ok(c) => c,
            Err(e) => {
                // No memory for the copy: the rows stay where they are, in ggml's layout,
                // which the row kernels read as well.
                tracing::warn!("{}: rows left in place: {e}", self.name);
                return self;
            }
        };
        if let Bytes::Mapped { file, range } = &self.bytes {
            file.release(range.clone());
        }
        self.bytes = if pack {
            Bytes::Packed(copied)
        } else {
            Bytes::Rows(copied)
        };
        self
    }

    /// Input columns `cols` of every row (row-parallel: split inputs, then all-reduce).
    /// The whole bias, if any, belongs to rank 0 only (`keep_bias`), so the sum adds it once.
    pub fn load_cols(
        file: &Arc<GgufFile>,
        name: &str,
        n_in: usize,
        n_out: usize,
        cols: Range<usize>,
        keep_bias: bool,
    ) -> Result<Self, ModelError> {
        Self::check(file, name, n_in, n_out)?;
        let t = file.tensor(name)?;
        let bias = if keep_bias {
            load_bias(file, name, n_out, 0..n_out)?
        } else {
            None
        };
        if cols == (0..n_in) {
            return Self::load_rows(file, name, n_in, n_out, 0..n_out).map(|mut l| {
                l.bias = bias;
                l
            });
        }
        let data = file.copy_columns(t, 0..n_out, cols.clone())?;
        Ok(Linear {
            name: name.to_string(),
            ty: t.ty,
            n_in: cols.len(),
            n_out,
            bytes: Bytes::Owned(data),
            bias,
        }
        .settled(file))
    }

    /// Rows `rows` of expert `expert` in a stacked `[n_in, n_out, n_expert]` tensor
    /// (column-parallel inside the expert), borrowed from the mapping until the caller
    /// interleaves them.
    pub fn load_expert_rows(
        file: &Arc<GgufFile>,
        name: &str,
        expert: usize,
        [n_in, n_out, n_expert]: [usize; 3],
        rows: Range<usize>,
    ) -> Result<Self, ModelError> {
        Self::check_dims(file, name, &[n_in, n_out, n_expert])?;
        let t = file.tensor(name)?;
        let base = expert * n_out;
        let range = file.row_range(t, base + rows.start..base + rows.end)?;
        Ok(Linear {
            name: format!("{name}[{expert}]"),
            ty: t.ty,
            n_in,
            n_out: rows.len(),
            bytes: Bytes::Mapped {
                file: file.clone(),
                range,
            },
            bias: None,
        })
    }

    /// Input columns `cols` of expert `expert` in a stacked `[n_in, n_out, n_expert]`
    /// tensor (row-parallel inside the expert; copied unless the columns are all).
    pub fn load_expert_cols(
        file: &Arc<GgufFile>,
        name: &str,
        expert: usize,
        [n_in, n_out, n_expert]: [usize; 3],
        cols: Range<usize>,
    ) -> Result<Self, ModelError> {
        if cols == (0..n_in) {
            return Self::load_expert_rows(file, name, expert, [n_in, n_out, n_expert], 0..n_out);
        }
        Self::check_dims(file, name, &[n_in, n_out, n_expert])?;
        let t = file.tensor(name)?;
        let base = expert * n_out;
        let data = file.copy_columns(t, base..base + n_out, cols.clone())?;
        Ok(Linear {
            name: format!("{name}[{expert}]"),
            ty: t.ty,
            n_in: cols.len(),
            n_out,
            bytes: Bytes::Owned(data),
            bias: None,
        })
    }

    /// The weight bytes: rows in ggml's layout, or interleaved when [`Self::is_interleaved`].
    pub fn bytes(&self) -> &[u8] {
        match &self.bytes {
            Bytes::Mapped { file, range } => file.slice(range.clone()),
            Bytes::Owned(v) => v,
            Bytes::Rows(v) | Bytes::Packed(v) => v,
        }
    }

    /// Whether the rows are interleaved (`quant::pack`) rather than in ggml's layout.
    pub fn is_interleaved(&self) -> bool {
        matches!(self.bytes, Bytes::Packed(_))
    }

    pub fn n_bytes(&self) -> usize {
        match &self.bytes {
            Bytes::Mapped { range, .. } => range.len(),
            Bytes::Owned(v) => v.len(),
            Bytes::Rows(v) | Bytes::Packed(v) => v.len(),
        }
    }

    /// Bytes of one activation row quantized for this weight.
    pub fn act_bytes(&self) -> usize {
        quant::act_bytes(self.ty, self.n_in)
    }

    /// Quantizes `m` input rows (each `n_in` long, `x_stride` apart) into `act`.
    pub fn quantize_input(&self, x: &[f32], x_stride: usize, m: usize, act: &mut [u8]) {
        let ab = self.act_bytes();
        for t in 0..m {
            quant::quantize_act(
                self.ty,
                &x[t * x_stride..t * x_stride + self.n_in],
                &mut act[t * ab..(t + 1) * ab],
            );
        }
    }

    /// Rows `r` of `w` (this layer's bytes) times `m` quantized inputs, in whichever
    /// layout the rows are: `out[t * out_stride + i]` for row `r.start + i`.
    fn rows_times(
        &self,
        w: &[u8],
        r: Range<usize>,
        acts: &[u8],
        m: usize,
        out: &mut [f32],
        out_stride: usize,
    ) {
        let (ty, n) = (self.ty, self.n_in);
        match (self.is_interleaved(), m) {
            (true, _) => quant::matmul_packed(ty, n, w, r, acts, m, out, out_stride),
            (false, 1) => quant::matvec(ty, n, w, r, acts, out),
            (false, _) => quant::matmul(ty, n, w, r, acts, m, out, out_stride),
        }
    }

    /// Rows `rows` times one quantized input into `out` (one per row), in whichever layout
    /// the rows are; where they are interleaved, `rows.start` starts a group
    /// (`quant::pack::GROUP_ROWS`).
    pub fn rows_into(&self, rows: Range<usize>, act: &[u8], out: &mut [f32]) {
        let len = rows.len();
        self.rows_times(self.bytes(), rows, act, 1, out, len);
    }

    /// y = W x for one quantized input (decode).
    pub fn matvec(&self, pool: &ThreadPool, act: &[u8], out: &mut [f32]) {
        let out = &mut out[..self.n_out];
        let w = self.bytes();
        let p = SyncPtr(out.as_mut_ptr());
        // Interleaved ranges must start at a group of rows.
        let align = if self.is_interleaved() {
            quant::pack::GROUP_ROWS
        } else {
            4
        };
        pool.for_ranges(self.n_out, align, &|r| {
            // SAFETY: for_ranges hands out disjoint ranges within 0..n_out.
            let o = unsafe { std::slice::from_raw_parts_mut(p.get().add(r.start), r.len()) };
            let len = r.len();
            self.rows_times(w, r, act, 1, o, len);
        });
        if let Some(b) = &self.bias {
            out.iter_mut().zip(b).for_each(|(o, b)| *o += b);
        }
    }

    /// Y = W X for `m` quantized inputs (prefill): `out[t * out_stride + r]`.
    /// `tile` is scratch of at least `m * n_out` floats.
    pub fn matmul(
        &self,
        pool: &ThreadPool,
        acts: &[u8],
        m: usize,
        out: &mut [f32],
        out_stride: usize,
        tile: &mut [f32],
    ) {
        if m == 1 {
            return self.matvec(pool, acts, out);
        }
        let w = self.bytes();
        let tile = &mut tile[..m * self.n_out];
        let p = SyncPtr(tile.as_mut_ptr());
        // Each task owns the contiguous tile region rows.start*m .. rows.end*m (token-major
        // within it), so tasks never share memory; the transpose below is cheap. Ranges
        // start at multiples of 16 rows, so interleaved ones start at a group.
        pool.for_ranges(self.n_out, 16, &|r| {
            // SAFETY: disjoint ranges map to disjoint tile regions.
            let o =
                unsafe { std::slice::from_raw_parts_mut(p.get().add(r.start * m), r.len() * m) };
            let len = r.len();
            self.rows_times(w, r, acts, m, o, len);
        });
        // Gather: the region of a task starting at row s holds [t][r - s] with stride len.
        for rs in pool.ranges(self.n_out, 16) {
            let base = rs.start * m;
            let len = rs.len();
            for t in 0..m {
                let src = &tile[base + t * len..base + t * len + len];
                out[t * out_stride + rs.start..t * out_stride + rs.end].copy_from_slice(src);
            }
        }
        if let Some(b) = &self.bias {
            for t in 0..m {
                out[t * out_stride..t * out_stride + self.n_out]
                    .iter_mut()
                    .zip(b)
                    .for_each(|(o, b)| *o += b);
            }
        }
    }
}

fn load_bias(
    file: &GgufFile,
    weight: &str,
    n_out: usize,
    rows: Range<usize>,
) -> Result<Option<Vec<f32>>, ModelError> {
    let name = weight.replace(".weight", ".bias");
    if !file.has_tensor(&name) {
        return Ok(None);
    }
    let v = load_vector(file, &name, n_out)?;
    Ok(Some(v[rows].to_vec()))
}

/// A whole `[n_in, n_out]` matrix dequantized to f32, row after row (the router: small,
/// and read on one fixed-order path so that every rank routes alike).
pub fn load_matrix_f32(
    file: &GgufFile,
    name: &str,
    n_in: usize,
    n_out: usize,
) -> Result<Vec<f32>, ModelError> {
    Linear::check(file, name, n_in, n_out)?;
    let t = file.tensor(name)?;
    let bytes = file.tensor_data(t)?;
    let rb = t.row_bytes();
    let mut out = vec![0f32; n_in * n_out];
    for (r, row) in out.chunks_exact_mut(n_in).enumerate() {
        quant::dequantize_row(t.ty, &bytes[r * rb..(r + 1) * rb], row);
    }
    Ok(out)
}

/// A 1-D tensor of `n` values (norm weights, biases), dequantized to f32.
pub fn load_vector(file: &GgufFile, name: &str, n: usize) -> Result<Vec<f32>, ModelError> {
    let t = file.tensor(name)?;
    if t.n_elements() as usize != n {
        return Err(tensor_err(
            file,
            name,
            format!("has {} values, expected {n}", t.n_elements()),
        ));
    }
    let mut out = vec![0f32; n];
    quant::dequantize_row(t.ty, file.tensor_data(t)?, &mut out);
    Ok(out)
}

/// The token embedding table, read one row per token from the mmap.
pub struct Embedding {
    file: Arc<GgufFile>,
    range: Range<usize>,
    pub ty: GgmlType,
    pub n_embd: usize,
    pub n_vocab: usize,
    row_bytes: usize,
}

impl Embedding {
    pub fn load(
        file: &Arc<GgufFile>,
        name: &str,
        n_embd: usize,
        n_vocab: usize,
    ) -> Result<Self, ModelError> {
        let t = file.tensor(name)?;
        let range = file.row_range(t, 0..n_vocab)?;
        Ok(Embedding {
            file: file.clone(),
            range,
            ty: t.ty,
            n_embd,
            n_vocab,
            row_bytes: t.row_bytes(),
        })
    }

    /// Writes token `id`'s vector, times `scale`, into `out`.
    pub fn lookup(&self, id: u32, scale: f32, out: &mut [f32]) -> Result<(), ModelError> {
        let id = id as usize;
        if id >= self.n_vocab {
            return Err(ModelError::BadToken {
                id: id as u32,
                n_vocab: self.n_vocab,
            });
        }
        let bytes = self.file.slice(self.range.clone());
        let row = &bytes[id * self.row_bytes..(id + 1) * self.row_bytes];
        quant::dequantize_row(self.ty, row, &mut out[..self.n_embd]);
        if scale != 1.0 {
            out[..self.n_embd].iter_mut().for_each(|v| *v *= scale);
        }
        Ok(())
    }
}
