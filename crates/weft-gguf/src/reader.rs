//! Parsing a GGUF file over mmap: header, metadata, tensor index, and shard byte ranges.

use std::collections::HashMap;
use std::fs::File;
use std::ops::Range;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use memmap2::Mmap;

use crate::error::{FormatError, GgufError};
use crate::types::GgmlType;
use crate::value::{Array, Value};

pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// Tensors of more dimensions than this are not part of the format.
const MAX_DIMS: u32 = 4;

/// One tensor's entry in the index. `dims[0]` is the innermost (contiguous) dimension,
/// as in ggml: a weight of `dims = [n_in, n_out]` is stored as `n_out` rows of `n_in`.
#[derive(Clone, Debug, PartialEq)]
pub struct TensorInfo {
    pub name: String,
    pub dims: Vec<u64>,
    pub ty: GgmlType,
    /// Offset from the start of the data section of its part.
    pub offset: u64,
    pub n_bytes: u64,
    /// Which part of a split model holds the data (0 for a single file).
    pub part: usize,
}

impl TensorInfo {
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().product()
    }
    /// Values per row (the innermost dimension).
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(1) as usize
    }
    /// Number of rows (all outer dimensions together).
    pub fn n_rows(&self) -> usize {
        self.dims.iter().skip(1).product::<u64>() as usize
    }
    pub fn row_bytes(&self) -> usize {
        self.row_len() / self.ty.block_size() * self.ty.type_size()
    }
}

pub(crate) enum Backing {
    Mapped(Mmap),
    Owned(Vec<u8>),
}

impl Backing {
    pub(crate) fn bytes(&self) -> &[u8] {
        match self {
            Backing::Mapped(m) => m,
            Backing::Owned(v) => v,
        }
    }
}

/// One file of a (possibly split) model: its image, where its data section starts, and
/// where its bytes sit in the model's byte space (parts laid end to end).
pub(crate) struct Part {
    pub(crate) path: PathBuf,
    pub(crate) backing: Backing,
    pub(crate) data_offset: u64,
    pub(crate) base: usize,
}

/// One file of a model as `GgufFile::part_layout` describes it.
#[derive(Clone, Debug, PartialEq)]
pub struct PartLayout {
    pub path: PathBuf,
    pub len: u64,
    /// Where the part starts in the model's byte space (the parts laid end to end).
    pub base: u64,
    /// Bytes before the part's data section: magic, metadata, tensor index, padding.
    pub header_len: u64,
}

/// Where the tensor data of a partial copy of a model lies (a node's shard cache holds only
/// its shard's bytes): every range a shard borrows is checked present, so a missing byte is
/// an error naming it rather than a zero read from a hole, and column-split blocks come
/// from wherever the partial copy keeps them (weft-share's strip store).
pub trait PartialData: Send + Sync {
    /// `Err(why)` unless every byte of `r` (the model's byte space) is held.
    fn check(&self, r: Range<usize>) -> Result<(), String>;
    /// Columns `cols` (block-aligned) of rows `rows` of the tensor at `index` in the
    /// tensor list, gathered row after row as `GgufFile::copy_columns` gives them.
    fn columns(
        &self,
        index: usize,
        t: &TensorInfo,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Vec<u8>, String>;
    /// Whether this copy only records what a loader asks for (a dry run learning a
    /// shard's pieces before they are fetched): its bytes are placeholders, so work on
    /// them, such as interleaving rows, is skipped.
    fn records_only(&self) -> bool {
        false
    }
}

/// An open GGUF model: one file, or every part of one split by llama.cpp's gguf-split.
/// Tensor data stays in the page cache until a shard touches it.
pub struct GgufFile {
    pub(crate) path: PathBuf,
    pub(crate) backing: Backing,
    /// Parts after the first, for a split model.
    pub(crate) more: Vec<Part>,
    pub version: u32,
    pub alignment: u64,
    metadata: Vec<(String, Value)>,
    meta_index: HashMap<String, usize>,
    pub(crate) tensors: Vec<TensorInfo>,
    pub(crate) tensor_index: HashMap<String, usize>,
    pub(crate) data_offset: u64,
    /// Set for a partial copy: tensor data reads go through it.
    partial: Option<Arc<dyn PartialData>>,
}

impl GgufFile {
    /// Parses a file image held in memory (tests, and files received over the network).
    pub fn from_bytes(name: impl Into<PathBuf>, bytes: Vec<u8>) -> Result<Self, GgufError> {
        Self::parse(name.into(), Backing::Owned(bytes))
    }

    pub(crate) fn parse(path: PathBuf, backing: Backing) -> Result<Self, GgufError> {
        match parse_header(backing.bytes()) {
            Ok(h) => Ok(GgufFile {
                path,
                backing,
                more: Vec::new(),
                version: h.version,
                alignment: h.alignment,
                meta_index: h
                    .metadata
                    .iter()
                    .enumerate()
                    .map(|(i, (k, _))| (k.clone(), i))
                    .collect(),
                metadata: h.metadata,
                tensor_index: h
                    .tensors
                    .iter()
                    .enumerate()
                    .map(|(i, t)| (t.name.clone(), i))
                    .collect(),
                tensors: h.tensors,
                data_offset: h.data_offset,
                partial: None,
            }),
            Err(error) => Err(GgufError::Format { path, error }),
        }
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    /// The first (or only) file's whole image.
    pub fn bytes(&self) -> &[u8] {
        self.backing.bytes()
    }

    /// Bytes of the model's byte space (the parts laid end to end), as `row_range` gives
    /// them: a range never crosses from one part into the next.
    pub fn slice(&self, r: Range<usize>) -> &[u8] {
        match self.more.iter().rev().find(|p| r.start >= p.base) {
            Some(p) => &p.backing.bytes()[r.start - p.base..r.end - p.base],
            None => &self.bytes()[r],
        }
    }

    /// Drops the pages of `r` (the model's byte space) from this process's resident
    /// memory: a shard that copied a tensor into another layout does not keep both. The
    /// bytes stay readable (read again from the file if touched); a file held in memory
    /// is left as it is.
    pub fn release(&self, r: Range<usize>) {
        let (backing, start) = match self.more.iter().rev().find(|p| r.start >= p.base) {
            Some(p) => (&p.backing, r.start - p.base),
            None => (&self.backing, r.start),
        };
        if let Backing::Mapped(m) = backing {
            // SAFETY: the mapping is read-only and file-backed, so MADV_DONTNEED only
            // drops clean pages: the next read faults them in from the file unchanged.
            // Advice is a hint; a refusal changes nothing, so its error is ignored.
            let _ = unsafe {
                m.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, start, r.len())
            };
        }
    }

    /// Total bytes of every part.
    pub fn file_len(&self) -> u64 {
        self.bytes().len() as u64
            + self
                .more
                .iter()
                .map(|p| p.backing.bytes().len() as u64)
                .sum::<u64>()
    }

    /// Each part's path and length (one entry for a single file).
    pub fn parts(&self) -> Vec<(&Path, u64)> {
        std::iter::once((self.path.as_path(), self.bytes().len() as u64))
            .chain(
                self.more
                    .iter()
                    .map(|p| (p.path.as_path(), p.backing.bytes().len() as u64)),
            )
            .collect()
    }

    /// Each part's path, length, start in the model's byte space and header length
    /// (where its data section starts).
    pub fn part_layout(&self) -> Vec<PartLayout> {
        std::iter::once(PartLayout {
            path: self.path.clone(),
            len: self.bytes().len() as u64,
            base: 0,
            header_len: self.data_offset,
        })
        .chain(self.more.iter().map(|p| PartLayout {
            path: p.path.clone(),
            len: p.backing.bytes().len() as u64,
            base: p.base as u64,
            header_len: p.data_offset,
        }))
        .collect()
    }

    /// Where tensor `t`'s data starts in the model's byte space.
    fn data_base(&self, t: &TensorInfo) -> u64 {
        match t.part.checked_sub(1).and_then(|i| self.more.get(i)) {
            Some(p) => p.base as u64 + p.data_offset + t.offset,
            None => self.data_offset + t.offset,
        }
    }

    /// Wraps a format error with this file's path.
    pub fn err(&self, error: FormatError) -> GgufError {
        GgufError::Format {
            path: self.path.clone(),
            error,
        }
    }

    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.meta_index.get(key).map(|&i| &self.metadata[i].1)
    }

    fn require(&self, key: &str) -> Result<&Value, GgufError> {
        self.get(key).ok_or_else(|| {
            self.err(FormatError::MissingKey {
                key: key.to_string(),
            })
        })
    }

    fn wrong_type(&self, key: &str, v: &Value, expected: &'static str) -> GgufError {
        self.err(FormatError::WrongType {
            key: key.to_string(),
            found: v.type_name(),
            expected,
        })
    }

    /// An integer key that must be present and fit in `u64`.
    pub fn get_u64(&self, key: &str) -> Result<u64, GgufError> {
        let v = self.require(key)?;
        let i = v
            .as_int()
            .ok_or_else(|| self.wrong_type(key, v, "integer"))?;
        u64::try_from(i).map_err(|_| {
            self.err(FormatError::BadValue {
                key: key.to_string(),
                detail: format!("{i} is negative"),
            })
        })
    }

    /// An integer key, or `default` when absent.
    pub fn get_u64_or(&self, key: &str, default: u64) -> Result<u64, GgufError> {
        if self.get(key).is_some() {
            self.get_u64(key)
        } else {
            Ok(default)
        }
    }

    pub fn get_f32(&self, key: &str) -> Result<f32, GgufError> {
        let v = self.require(key)?;
        v.as_f64()
            .map(|x| x as f32)
            .ok_or_else(|| self.wrong_type(key, v, "number"))
    }

    pub fn get_f32_or(&self, key: &str, default: f32) -> Result<f32, GgufError> {
        if self.get(key).is_some() {
            self.get_f32(key)
        } else {
            Ok(default)
        }
    }

    pub fn get_bool_or(&self, key: &str, default: bool) -> Result<bool, GgufError> {
        match self.get(key) {
            None => Ok(default),
            Some(Value::Bool(b)) => Ok(*b),
            Some(v) => v
                .as_int()
                .map(|i| i != 0)
                .ok_or_else(|| self.wrong_type(key, v, "bool")),
        }
    }

    pub fn get_str(&self, key: &str) -> Result<&str, GgufError> {
        let v = self.require(key)?;
        v.as_str().ok_or_else(|| self.wrong_type(key, v, "string"))
    }

    pub fn get_array(&self, key: &str) -> Result<&Array, GgufError> {
        let v = self.require(key)?;
        v.as_array().ok_or_else(|| self.wrong_type(key, v, "array"))
    }

    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    pub fn tensor(&self, name: &str) -> Result<&TensorInfo, GgufError> {
        self.tensor_index
            .get(name)
            .map(|&i| &self.tensors[i])
            .ok_or_else(|| {
                self.err(FormatError::MissingTensor {
                    name: name.to_string(),
                })
            })
    }

    pub fn has_tensor(&self, name: &str) -> bool {
        self.tensor_index.contains_key(name)
    }

    /// Absolute file offset of the first byte of the data section.
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }

    /// Routes tensor data reads through `p`: this file is a partial copy.
    pub fn set_partial(&mut self, p: Arc<dyn PartialData>) {
        self.partial = Some(p);
    }

    /// Whether this is a dry run's copy, whose tensor bytes are placeholders
    /// ([`PartialData::records_only`]).
    pub fn records_only(&self) -> bool {
        self.partial.as_ref().is_some_and(|p| p.records_only())
    }

    /// Whether tensor data reads go through a partial copy's checks.
    pub fn is_partial(&self) -> bool {
        self.partial.is_some()
    }

    /// Where tensor `t`'s bytes lie in the model's byte space.
    pub fn tensor_range(&self, t: &TensorInfo) -> Range<usize> {
        let start = self.data_base(t) as usize;
        start..start + t.n_bytes as usize
    }

    /// All of one tensor's bytes (validated against its part's length at open). For a
    /// partial copy use `tensor_data`, which says when they are not held.
    pub fn tensor_bytes(&self, t: &TensorInfo) -> &[u8] {
        self.slice(self.tensor_range(t))
    }

    /// All of one tensor's bytes, or an error naming it where a partial copy lacks them.
    pub fn tensor_data(&self, t: &TensorInfo) -> Result<&[u8], GgufError> {
        let r = self.tensor_range(t);
        self.check_held(t, r.clone())?;
        Ok(self.slice(r))
    }

    fn check_held(&self, t: &TensorInfo, r: Range<usize>) -> Result<(), GgufError> {
        match &self.partial {
            Some(p) => p.check(r).map_err(|detail| {
                self.err(FormatError::BadShard {
                    tensor: t.name.clone(),
                    detail,
                })
            }),
            None => Ok(()),
        }
    }

    /// Absolute byte range in the file of rows `rows` of a tensor: a row-split shard.
    pub fn row_range(&self, t: &TensorInfo, rows: Range<usize>) -> Result<Range<usize>, GgufError> {
        if rows.start > rows.end || rows.end > t.n_rows() {
            return Err(self.err(FormatError::BadShard {
                tensor: t.name.clone(),
                detail: format!("rows {rows:?} outside 0..{}", t.n_rows()),
            }));
        }
        let rb = t.row_bytes();
        let base = self.data_base(t) as usize;
        let r = base + rows.start * rb..base + rows.end * rb;
        self.check_held(t, r.clone())?;
        Ok(r)
    }

    /// Copies columns `cols` of rows `rows` into one buffer (a column-split shard).
    /// Column bounds must fall on the type's block boundaries; only those bytes are read.
    pub fn copy_columns(
        &self,
        t: &TensorInfo,
        rows: Range<usize>,
        cols: Range<usize>,
    ) -> Result<Vec<u8>, GgufError> {
        let bs = t.ty.block_size();
        if cols.start > cols.end
            || cols.end > t.row_len()
            || !cols.start.is_multiple_of(bs)
            || !cols.end.is_multiple_of(bs)
        {
            return Err(self.err(FormatError::BadShard {
                tensor: t.name.clone(),
                detail: format!(
                    "columns {cols:?} are not block-aligned ({bs}) within 0..{}",
                    t.row_len()
                ),
            }));
        }
        if rows.start > rows.end || rows.end > t.n_rows() {
            return Err(self.err(FormatError::BadShard {
                tensor: t.name.clone(),
                detail: format!("rows {rows:?} outside 0..{}", t.n_rows()),
            }));
        }
        if let Some(p) = &self.partial {
            let index = self
                .tensor_index
                .get(&t.name)
                .copied()
                .unwrap_or(usize::MAX);
            return p.columns(index, t, rows, cols).map_err(|detail| {
                self.err(FormatError::BadShard {
                    tensor: t.name.clone(),
                    detail,
                })
            });
        }
        let range = self.row_range(t, rows.clone())?;
        let rb = t.row_bytes();
        let (b0, b1) = (
            cols.start / bs * t.ty.type_size(),
            cols.end / bs * t.ty.type_size(),
        );
        let src = self.slice(range);
        let mut out = Vec::with_capacity(rows.len() * (b1 - b0));
        for row in src.chunks_exact(rb) {
            out.extend_from_slice(&row[b0..b1]);
        }
        Ok(out)
    }
}

/// Maps a model file read-only, naming it in every error.
pub(crate) fn map_file(path: &Path) -> Result<Mmap, GgufError> {
    let io = |error| GgufError::Io {
        path: path.to_path_buf(),
        error,
    };
    // Opening a directory succeeds on Linux and mapping it fails with "No such device";
    // say what is wrong instead.
    if path.is_dir() {
        return Err(io(std::io::ErrorKind::IsADirectory.into()));
    }
    let file = File::open(path).map_err(io)?;
    // SAFETY: the mapping is read-only; weft never writes model files while serving them.
    // A file truncated underneath us by another process is outside what we can defend.
    unsafe { Mmap::map(&file) }.map_err(io)
}

struct Header {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    tensors: Vec<TensorInfo>,
    data_offset: u64,
}

/// A bounds-checked reader over the file image; every read names the field it is for.
struct Cursor<'a> {
    buf: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn take(&mut self, n: u64, field: &dyn Fn() -> String) -> Result<&'a [u8], FormatError> {
        let remaining = (self.buf.len() - self.pos) as u64;
        if n > remaining {
            return Err(FormatError::Truncated {
                field: field(),
                offset: self.pos as u64,
                needed: n,
                len: self.buf.len() as u64,
            });
        }
        let s = &self.buf[self.pos..self.pos + n as usize];
        self.pos += n as usize;
        Ok(s)
    }
    fn arr<const N: usize>(&mut self, field: &dyn Fn() -> String) -> Result<[u8; N], FormatError> {
        let s = self.take(N as u64, field)?;
        let mut a = [0u8; N];
        a.copy_from_slice(s);
        Ok(a)
    }
    fn u32(&mut self, field: &dyn Fn() -> String) -> Result<u32, FormatError> {
        Ok(u32::from_le_bytes(self.arr(field)?))
    }
    fn u64(&mut self, field: &dyn Fn() -> String) -> Result<u64, FormatError> {
        Ok(u64::from_le_bytes(self.arr(field)?))
    }
    fn remaining(&self) -> u64 {
        (self.buf.len() - self.pos) as u64
    }
    /// A count of items each at least `min_size` bytes: rejects counts the file cannot hold,
    /// so a corrupt count never turns into a huge allocation.
    fn count(&mut self, min_size: u64, field: &dyn Fn() -> String) -> Result<u64, FormatError> {
        let n = self.u64(field)?;
        if n.saturating_mul(min_size) > self.remaining() {
            return Err(FormatError::CountTooLarge {
                field: field(),
                count: n,
                remaining: self.remaining(),
            });
        }
        Ok(n)
    }
    fn string(&mut self, field: &dyn Fn() -> String) -> Result<String, FormatError> {
        let n = self.u64(field)?;
        let s = self.take(n, field)?;
        match std::str::from_utf8(s) {
            Ok(s) => Ok(s.to_string()),
            Err(_) => Err(FormatError::BadUtf8 { field: field() }),
        }
    }
}

fn parse_header(buf: &[u8]) -> Result<Header, FormatError> {
    let mut c = Cursor { buf, pos: 0 };
    let magic: [u8; 4] = if buf.len() < 4 {
        let mut m = [0u8; 4];
        m[..buf.len()].copy_from_slice(buf);
        return Err(FormatError::BadMagic { found: m });
    } else {
        c.arr(&|| "magic".into())?
    };
    if magic != GGUF_MAGIC {
        return Err(FormatError::BadMagic { found: magic });
    }
    let version = c.u32(&|| "version".into())?;
    if version != 2 && version != 3 {
        return Err(FormatError::UnsupportedVersion { version });
    }
    let n_tensors = c.count(8 + 4 + 4 + 8, &|| "tensor_count".into())?;
    let n_kv = c.count(8 + 4, &|| "metadata_kv_count".into())?;

    let mut metadata = Vec::with_capacity(n_kv as usize);
    for i in 0..n_kv {
        let key = c.string(&|| format!("metadata key #{i}"))?;
        let type_id = c.u32(&|| format!("metadata '{key}' type"))?;
        let value = read_value(&mut c, type_id, &key, 0)?;
        metadata.push((key, value));
    }
    let alignment = match metadata.iter().find(|(k, _)| k == "general.alignment") {
        None => DEFAULT_ALIGNMENT,
        Some((_, v)) => match v.as_int() {
            Some(a) if a > 0 && (a as u64).is_power_of_two() => a as u64,
            _ => {
                return Err(FormatError::BadValue {
                    key: "general.alignment".into(),
                    detail: format!("{v} is not a positive power of two"),
                })
            }
        },
    };

    let mut tensors = Vec::with_capacity(n_tensors as usize);
    for i in 0..n_tensors {
        let name = c.string(&|| format!("tensor #{i} name"))?;
        let n_dims = c.u32(&|| format!("tensor '{name}' n_dims"))?;
        if n_dims == 0 || n_dims > MAX_DIMS {
            return Err(FormatError::BadTensor {
                tensor: name,
                detail: format!("{n_dims} dimensions (1 to {MAX_DIMS} allowed)"),
            });
        }
        let mut dims = Vec::with_capacity(n_dims as usize);
        for d in 0..n_dims {
            dims.push(c.u64(&|| format!("tensor '{name}' dim {d}"))?);
        }
        let type_id = c.u32(&|| format!("tensor '{name}' type"))?;
        let offset = c.u64(&|| format!("tensor '{name}' offset"))?;
        let ty = match GgmlType::from_id(type_id) {
            Ok(t) => t,
            Err(Some(n)) => {
                return Err(FormatError::UnsupportedTensorType {
                    tensor: name,
                    name: n,
                    type_id,
                })
            }
            Err(None) => {
                return Err(FormatError::UnknownTensorType {
                    tensor: name,
                    type_id,
                })
            }
        };
        let n_elems = dims
            .iter()
            .try_fold(1u64, |a, &d| a.checked_mul(d))
            .ok_or_else(|| FormatError::BadTensor {
                tensor: name.clone(),
                detail: format!("dimensions {dims:?} overflow"),
            })?;
        if !dims[0].is_multiple_of(ty.block_size() as u64) {
            return Err(FormatError::BadTensor {
                tensor: name,
                detail: format!(
                    "row length {} is not a multiple of the {ty} block size {}",
                    dims[0],
                    ty.block_size()
                ),
            });
        }
        let n_bytes = ty
            .bytes_for(n_elems)
            .ok_or_else(|| FormatError::BadTensor {
                tensor: name.clone(),
                detail: "size overflows".into(),
            })?;
        if !offset.is_multiple_of(alignment) {
            return Err(FormatError::BadTensor {
                tensor: name,
                detail: format!("offset {offset} is not a multiple of the alignment {alignment}"),
            });
        }
        tensors.push(TensorInfo {
            name,
            dims,
            ty,
            offset,
            n_bytes,
            part: 0,
        });
    }
    let data_offset = (c.pos as u64).div_ceil(alignment) * alignment;
    let len = buf.len() as u64;
    for t in &tensors {
        let start = data_offset.saturating_add(t.offset);
        let end = start.saturating_add(t.n_bytes);
        if end > len {
            return Err(FormatError::TensorPastEnd {
                tensor: t.name.clone(),
                start,
                end,
                len,
            });
        }
    }
    Ok(Header {
        version,
        alignment,
        metadata,
        tensors,
        data_offset,
    })
}

fn read_value(c: &mut Cursor, type_id: u32, key: &str, depth: u32) -> Result<Value, FormatError> {
    let f = || format!("metadata '{key}'");
    Ok(match type_id {
        0 => Value::U8(c.arr::<1>(&f)?[0]),
        1 => Value::I8(c.arr::<1>(&f)?[0] as i8),
        2 => Value::U16(u16::from_le_bytes(c.arr(&f)?)),
        3 => Value::I16(i16::from_le_bytes(c.arr(&f)?)),
        4 => Value::U32(u32::from_le_bytes(c.arr(&f)?)),
        5 => Value::I32(i32::from_le_bytes(c.arr(&f)?)),
        6 => Value::F32(f32::from_le_bytes(c.arr(&f)?)),
        7 => Value::Bool(c.arr::<1>(&f)?[0] != 0),
        8 => Value::String(c.string(&f)?),
        10 => Value::U64(u64::from_le_bytes(c.arr(&f)?)),
        11 => Value::I64(i64::from_le_bytes(c.arr(&f)?)),
        12 => Value::F64(f64::from_le_bytes(c.arr(&f)?)),
        9 => {
            if depth > 2 {
                return Err(FormatError::BadValue {
                    key: key.to_string(),
                    detail: "arrays nested too deeply".into(),
                });
            }
            let elem = c.u32(&f)?;
            Value::Array(read_array(c, elem, key, depth)?)
        }
        other => {
            return Err(FormatError::BadValueType {
                field: f(),
                type_id: other,
            })
        }
    })
}

fn read_array(c: &mut Cursor, elem: u32, key: &str, depth: u32) -> Result<Array, FormatError> {
    let f = || format!("metadata '{key}'");
    let min = match elem {
        0 | 1 | 7 => 1,
        2 | 3 => 2,
        4..=6 => 4,
        8 | 9 => 8,
        10..=12 => 8,
        other => {
            return Err(FormatError::BadValueType {
                field: format!("metadata '{key}' array element"),
                type_id: other,
            })
        }
    };
    let n = c.count(min, &f)? as usize;
    macro_rules! nums {
        ($variant:ident, $t:ty) => {{
            let raw = c.take((n * std::mem::size_of::<$t>()) as u64, &f)?;
            Array::$variant(
                raw.chunks_exact(std::mem::size_of::<$t>())
                    .map(|b| <$t>::from_le_bytes(b.try_into().expect("chunk size")))
                    .collect(),
            )
        }};
    }
    Ok(match elem {
        0 => Array::U8(c.take(n as u64, &f)?.to_vec()),
        1 => Array::I8(c.take(n as u64, &f)?.iter().map(|&b| b as i8).collect()),
        2 => nums!(U16, u16),
        3 => nums!(I16, i16),
        4 => nums!(U32, u32),
        5 => nums!(I32, i32),
        6 => nums!(F32, f32),
        7 => Array::Bool(c.take(n as u64, &f)?.iter().map(|&b| b != 0).collect()),
        8 => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                v.push(c.string(&f)?);
            }
            Array::String(v)
        }
        10 => nums!(U64, u64),
        11 => nums!(I64, i64),
        12 => nums!(F64, f64),
        _ => {
            let mut v = Vec::with_capacity(n);
            for _ in 0..n {
                let t = c.u32(&f)?;
                v.push(read_value(c, t, key, depth + 1)?);
            }
            Array::Nested(v)
        }
    })
}
