//! Round trips through the writer and the reader, and every way a file can be broken.

use super::*;

fn sample() -> GgufWriter {
    let mut w = GgufWriter::new();
    w.set_str("general.architecture", "llama")
        .set_u32("llama.block_count", 2)
        .set_f32("llama.rope.freq_base", 10000.0)
        .set(
            "tokenizer.ggml.tokens",
            Value::Array(Array::String(vec!["a".into(), "b".into()])),
        )
        .set(
            "tokenizer.ggml.scores",
            Value::Array(Array::F32(vec![0.5, -1.0])),
        );
    let data: Vec<u8> = (0..4 * 64 * 3).map(|i| i as u8).collect();
    w.add_tensor("w", &[64, 3], GgmlType::F32, data);
    w.add_tensor("q", &[32, 2], GgmlType::Q8_0, vec![7u8; 68]);
    w
}

fn parse(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
    GgufFile::from_bytes("test.gguf", bytes)
}

#[test]
fn round_trip() {
    let f = parse(sample().to_bytes()).unwrap();
    assert_eq!(f.version, 3);
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    assert_eq!(f.get_u64("llama.block_count").unwrap(), 2);
    assert_eq!(f.get_f32("llama.rope.freq_base").unwrap(), 10000.0);
    let toks = f.get_array("tokenizer.ggml.tokens").unwrap();
    assert_eq!(toks, &Array::String(vec!["a".into(), "b".into()]));
    let w = f.tensor("w").unwrap();
    assert_eq!((w.row_len(), w.n_rows(), w.row_bytes()), (64, 3, 256));
    let bytes = f.tensor_bytes(w);
    assert_eq!(bytes[5], 5);
    let r = f.row_range(w, 1..3).unwrap();
    assert_eq!(&f.slice(r)[0], &(256u32 as u8));
    let cols = f.copy_columns(w, 0..3, 1..3).unwrap();
    assert_eq!(cols.len(), 3 * 8);
    assert_eq!(cols[0], 4);
    assert_eq!(cols[8], (256 + 4) as u8);
    let q = f.tensor("q").unwrap();
    assert_eq!(f.tensor_bytes(q), &[7u8; 68][..]);
    assert!(
        f.copy_columns(q, 0..2, 0..16).is_err(),
        "columns off the block boundary"
    );
}

#[test]
fn file_on_disk() {
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("m.gguf");
    sample().write_file(&p).unwrap();
    let f = GgufFile::open(&p).unwrap();
    assert_eq!(f.tensors().len(), 2);
    let e = GgufFile::open(dir.path().join("missing.gguf"))
        .err()
        .unwrap();
    assert!(e.to_string().contains("missing.gguf"), "{e}");
}

#[test]
fn bad_magic() {
    let mut b = sample().to_bytes();
    b[0] = b'X';
    let e = parse(b).err().unwrap();
    assert!(
        matches!(e.format(), Some(FormatError::BadMagic { .. })),
        "{e}"
    );
    assert!(
        e.to_string().starts_with("test.gguf: not a GGUF file"),
        "{e}"
    );
    assert!(parse(vec![1, 2]).is_err());
}

#[test]
fn bad_version() {
    let mut b = sample().to_bytes();
    b[4] = 1;
    let e = parse(b).err().unwrap();
    assert_eq!(
        e.format(),
        Some(&FormatError::UnsupportedVersion { version: 1 })
    );
}

#[test]
fn every_truncation_is_an_error() {
    let b = sample().to_bytes();
    let f = parse(b.clone()).unwrap();
    let last = f
        .tensors()
        .iter()
        .map(|t| f.data_offset() + t.offset + t.n_bytes)
        .max()
        .unwrap();
    // trailing alignment padding may go; every byte before the end of the last tensor counts
    for cut in 0..last as usize {
        let r = parse(b[..cut].to_vec());
        assert!(r.is_err(), "a file cut at {cut} of {} parsed", b.len());
    }
}

#[test]
fn tensor_past_end() {
    let mut w = GgufWriter::new();
    w.add_tensor("big", &[4], GgmlType::F32, vec![0; 16]);
    let mut b = w.to_bytes();
    b.truncate(b.len() - 32);
    let e = parse(b).err().unwrap();
    assert!(
        matches!(e.format(), Some(FormatError::TensorPastEnd { tensor, .. }) if tensor == "big"),
        "{e}"
    );
}

#[test]
fn unknown_and_unsupported_tensor_types() {
    let mut w = GgufWriter::new();
    w.add_tensor("t", &[32], GgmlType::Q8_0, vec![0; 34]);
    let b = w.to_bytes();
    // the type id sits right after name (8 + 1), n_dims (4) and one dim (8), after the 24-byte header
    let at = 24 + 8 + 1 + 4 + 8;
    for (id, want_known) in [(10u32, true), (77u32, false)] {
        let mut c = b.clone();
        c[at..at + 4].copy_from_slice(&id.to_le_bytes());
        let e = parse(c).err().unwrap();
        match e.format() {
            Some(FormatError::UnsupportedTensorType { name, .. }) if want_known => {
                assert_eq!(*name, "Q2_K")
            }
            Some(FormatError::UnknownTensorType { type_id, .. }) if !want_known => {
                assert_eq!(*type_id, 77)
            }
            other => panic!("unexpected {other:?}"),
        }
        assert!(e.to_string().contains("tensor 't'"), "{e}");
    }
}

#[test]
fn huge_counts_do_not_allocate() {
    let mut b = sample().to_bytes();
    b[8..16].copy_from_slice(&u64::MAX.to_le_bytes());
    let e = parse(b).err().unwrap();
    assert!(
        matches!(e.format(), Some(FormatError::CountTooLarge { .. })),
        "{e}"
    );
}

#[test]
fn typed_getters_name_the_key() {
    let f = parse(sample().to_bytes()).unwrap();
    let e = f.get_u64("general.architecture").err().unwrap();
    assert!(e.to_string().contains("general.architecture"), "{e}");
    let e = f.get_str("nope").err().unwrap();
    assert!(e.to_string().contains("'nope' is missing"), "{e}");
    assert_eq!(f.get_u64_or("nope", 9).unwrap(), 9);
}

/// `sample()` with more tensors, cut into parts of `per` tensors named as gguf-split names
/// them under `dir`; returns the first part's path and the uncut file.
fn write_split(dir: &std::path::Path, per: usize) -> (std::path::PathBuf, GgufFile) {
    let mut w = sample();
    w.add_tensor(
        "x",
        &[32, 4],
        GgmlType::Q8_0,
        (0..136).map(|i| i as u8).collect(),
    );
    w.add_tensor("y", &[16], GgmlType::F32, vec![9u8; 64]);
    let whole = parse(w.to_bytes()).unwrap();
    let parts = w.split(per);
    let n = parts.len();
    for (i, p) in parts.iter().enumerate() {
        p.write_file(&dir.join(format!("m-{:05}-of-{n:05}.gguf", i + 1)))
            .unwrap();
    }
    (dir.join(format!("m-00001-of-{n:05}.gguf")), whole)
}

#[test]
fn a_split_model_opens_from_its_first_part_with_the_same_bytes() {
    let dir = tempfile::tempdir().unwrap();
    let (first, whole) = write_split(dir.path(), 1);
    let f = GgufFile::open(&first).unwrap();
    assert_eq!(f.parts().len(), 4);
    assert_eq!(f.tensors().len(), whole.tensors().len());
    assert_eq!(f.get_str("general.architecture").unwrap(), "llama");
    for t in whole.tensors() {
        let s = f.tensor(&t.name).unwrap();
        assert_eq!(f.tensor_bytes(s), whole.tensor_bytes(t), "{}", t.name);
        let rows = 1..s.n_rows();
        assert_eq!(
            f.slice(f.row_range(s, rows.clone()).unwrap()),
            whole.slice(whole.row_range(t, rows).unwrap())
        );
    }
    assert_eq!(f.tensor("y").unwrap().part, 3);
}

#[test]
fn a_missing_or_foreign_part_is_named() {
    let dir = tempfile::tempdir().unwrap();
    let (first, _) = write_split(dir.path(), 2);
    // Opening a later part says which one to open.
    let e = open_err(&dir.path().join("m-00002-of-00002.gguf"));
    assert!(
        e.contains("part 2 of 2") && e.contains("m-00001-of-00002.gguf"),
        "{e}"
    );
    // A part of another model's split (another tensor count) is refused by name.
    let mut parts = {
        let mut o = GgufWriter::new();
        o.add_tensor("a", &[16], GgmlType::F32, vec![0u8; 64]);
        o.add_tensor("b", &[16], GgmlType::F32, vec![0u8; 64]);
        o.add_tensor("c", &[16], GgmlType::F32, vec![0u8; 64]);
        o.split(2)
    };
    parts
        .pop()
        .unwrap()
        .write_file(&dir.path().join("m-00002-of-00002.gguf"))
        .unwrap();
    let e = open_err(&first);
    assert!(
        e.contains("m-00002-of-00002.gguf") && e.contains("split.tensors.count"),
        "{e}"
    );
    // A missing part is named with its number.
    std::fs::remove_file(dir.path().join("m-00002-of-00002.gguf")).unwrap();
    let e = open_err(&first);
    assert!(
        e.contains("m-00002-of-00002.gguf") && e.contains("part 2 of 2"),
        "{e}"
    );
}

fn open_err(p: &std::path::Path) -> String {
    match GgufFile::open(p) {
        Ok(_) => panic!("{} opened", p.display()),
        Err(e) => e.to_string(),
    }
}
