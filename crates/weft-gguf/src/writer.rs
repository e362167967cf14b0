//! Writing GGUF files: tests use it to build tiny synthetic models of every architecture
//! and quant type; tools use it to rewrite metadata.

use std::io::{self, Write};
use std::path::Path;

use crate::reader::{DEFAULT_ALIGNMENT, GGUF_MAGIC};
use crate::types::GgmlType;
use crate::value::{Array, Value};

struct PendingTensor {
    name: String,
    dims: Vec<u64>,
    ty: GgmlType,
    data: Vec<u8>,
}

/// Collects metadata and tensors, then writes a GGUF v3 file.
#[derive(Default)]
pub struct GgufWriter {
    metadata: Vec<(String, Value)>,
    tensors: Vec<PendingTensor>,
}

impl GgufWriter {
    pub fn new() -> Self {
        Self::default()
    }

    /// Sets (or replaces) a metadata key.
    pub fn set(&mut self, key: &str, value: Value) -> &mut Self {
        if let Some(slot) = self.metadata.iter_mut().find(|(k, _)| k == key) {
            slot.1 = value;
        } else {
            self.metadata.push((key.to_string(), value));
        }
        self
    }

    pub fn set_str(&mut self, key: &str, v: &str) -> &mut Self {
        self.set(key, Value::String(v.to_string()))
    }
    pub fn set_u32(&mut self, key: &str, v: u32) -> &mut Self {
        self.set(key, Value::U32(v))
    }
    pub fn set_f32(&mut self, key: &str, v: f32) -> &mut Self {
        self.set(key, Value::F32(v))
    }
    pub fn set_bool(&mut self, key: &str, v: bool) -> &mut Self {
        self.set(key, Value::Bool(v))
    }

    /// Adds a tensor whose bytes are already in `ty`'s block layout.
    /// `dims[0]` is the row length, as in the reader.
    pub fn add_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        let n: u64 = dims.iter().product();
        assert_eq!(
            ty.bytes_for(n),
            Some(data.len() as u64),
            "tensor {name}: {} bytes do not match dims {dims:?} of {ty}",
            data.len()
        );
        self.tensors.push(PendingTensor {
            name: name.to_string(),
            dims: dims.to_vec(),
            ty,
            data,
        });
        self
    }

    /// Replaces tensor `name` (kept in its place), or adds it if absent: tests use it to
    /// make files with one wrong tensor.
    pub fn replace_tensor(
        &mut self,
        name: &str,
        dims: &[u64],
        ty: GgmlType,
        data: Vec<u8>,
    ) -> &mut Self {
        let at = self.tensors.iter().position(|t| t.name == name);
        self.add_tensor(name, dims, ty, data);
        if let Some(i) = at {
            let new = self.tensors.pop().expect("just added");
            self.tensors[i] = new;
        }
        self
    }

    /// This model cut as llama.cpp's `gguf-split --split-max-tensors N` cuts it: the first
    /// part keeps every metadata key, each part gets `split.no`, `split.count` (u16) and
    /// `split.tensors.count` (i32), and tensors go to the parts in order, `max_tensors`
    /// to a part.
    pub fn split(self, max_tensors: usize) -> Vec<GgufWriter> {
        let n = self.tensors.len();
        let count = n.div_ceil(max_tensors.max(1)).max(1);
        let mut parts: Vec<GgufWriter> = (0..count).map(|_| GgufWriter::new()).collect();
        parts[0].metadata = self.metadata;
        for (i, p) in parts.iter_mut().enumerate() {
            p.set(crate::split::KEY_SPLIT_NO, Value::U16(i as u16));
            p.set(crate::split::KEY_SPLIT_COUNT, Value::U16(count as u16));
            p.set(crate::split::KEY_SPLIT_TENSORS, Value::I32(n as i32));
        }
        for (i, t) in self.tensors.into_iter().enumerate() {
            parts[i / max_tensors.max(1)].tensors.push(t);
        }
        parts
    }

    /// Serialises the file into a byte vector.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::new();
        self.write_to(&mut out)
            .expect("writing to a Vec cannot fail");
        out
    }

    pub fn write_file(&self, path: &Path) -> io::Result<()> {
        let mut f = io::BufWriter::new(std::fs::File::create(path)?);
        self.write_to(&mut f)?;
        f.flush()
    }

    pub fn write_to(&self, w: &mut dyn Write) -> io::Result<()> {
        let align = self
            .metadata
            .iter()
            .find(|(k, _)| k == "general.alignment")
            .and_then(|(_, v)| v.as_int())
            .map(|a| a as u64)
            .unwrap_or(DEFAULT_ALIGNMENT);
        let mut head = Vec::new();
        head.extend_from_slice(&GGUF_MAGIC);
        head.extend_from_slice(&3u32.to_le_bytes());
        head.extend_from_slice(&(self.tensors.len() as u64).to_le_bytes());
        head.extend_from_slice(&(self.metadata.len() as u64).to_le_bytes());
        for (k, v) in &self.metadata {
            put_str(&mut head, k);
            head.extend_from_slice(&v.type_id().to_le_bytes());
            put_value(&mut head, v);
        }
        let mut offset = 0u64;
        let mut offsets = Vec::with_capacity(self.tensors.len());
        for t in &self.tensors {
            put_str(&mut head, &t.name);
            head.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                head.extend_from_slice(&d.to_le_bytes());
            }
            head.extend_from_slice(&t.ty.id().to_le_bytes());
            head.extend_from_slice(&offset.to_le_bytes());
            offsets.push(offset);
            offset = (offset + t.data.len() as u64).div_ceil(align) * align;
        }
        let pad = (head.len() as u64).div_ceil(align) * align - head.len() as u64;
        head.resize(head.len() + pad as usize, 0);
        w.write_all(&head)?;
        let mut written = 0u64;
        for (t, off) in self.tensors.iter().zip(offsets) {
            w.write_all(&vec![0u8; (off - written) as usize])?;
            w.write_all(&t.data)?;
            written = off + t.data.len() as u64;
        }
        let tail = written.div_ceil(align) * align - written;
        w.write_all(&vec![0u8; tail as usize])
    }
}

fn put_str(out: &mut Vec<u8>, s: &str) {
    out.extend_from_slice(&(s.len() as u64).to_le_bytes());
    out.extend_from_slice(s.as_bytes());
}

fn put_value(out: &mut Vec<u8>, v: &Value) {
    match v {
        Value::U8(x) => out.push(*x),
        Value::I8(x) => out.push(*x as u8),
        Value::U16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I16(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::U32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F32(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Bool(x) => out.push(*x as u8),
        Value::String(s) => put_str(out, s),
        Value::U64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::I64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::F64(x) => out.extend_from_slice(&x.to_le_bytes()),
        Value::Array(a) => put_array(out, a),
    }
}

fn put_array(out: &mut Vec<u8>, a: &Array) {
    macro_rules! nums {
        ($id:expr, $v:expr) => {{
            out.extend_from_slice(&($id as u32).to_le_bytes());
            out.extend_from_slice(&($v.len() as u64).to_le_bytes());
            for x in $v {
                out.extend_from_slice(&x.to_le_bytes());
            }
        }};
    }
    match a {
        Array::U8(v) => nums!(0, v),
        Array::I8(v) => nums!(1, v),
        Array::U16(v) => nums!(2, v),
        Array::I16(v) => nums!(3, v),
        Array::U32(v) => nums!(4, v),
        Array::I32(v) => nums!(5, v),
        Array::F32(v) => nums!(6, v),
        Array::Bool(v) => {
            out.extend_from_slice(&7u32.to_le_bytes());
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            out.extend(v.iter().map(|&b| b as u8));
        }
        Array::String(v) => {
            out.extend_from_slice(&8u32.to_le_bytes());
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for s in v {
                put_str(out, s);
            }
        }
        Array::U64(v) => nums!(10, v),
        Array::I64(v) => nums!(11, v),
        Array::F64(v) => nums!(12, v),
        Array::Nested(v) => {
            let elem = v.first().map(|x| x.type_id()).unwrap_or(9);
            out.extend_from_slice(&elem.to_le_bytes());
            out.extend_from_slice(&(v.len() as u64).to_le_bytes());
            for x in v {
                put_value(out, x);
            }
        }
    }
}
