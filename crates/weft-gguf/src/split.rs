//! Models split by llama.cpp's `gguf-split` (`NAME-00001-of-0000N.gguf` …): the first part
//! carries the metadata and `split.count`; every part carries `split.no` and its own
//! tensors. Opening the first part opens all of them, checks that they belong together,
//! and lays their bytes end to end so a shard's byte range may lie in any part.

use std::path::{Path, PathBuf};

use crate::error::{FormatError, GgufError};
use crate::reader::{map_file, Backing, GgufFile, Part};

pub const KEY_SPLIT_NO: &str = "split.no";
pub const KEY_SPLIT_COUNT: &str = "split.count";
pub const KEY_SPLIT_TENSORS: &str = "split.tensors.count";

/// The path of part `no` (0-based) of `count`, named as gguf-split names them, from the
/// path of any part.
pub fn split_part_path(any_part: &Path, no: usize, count: usize) -> Option<PathBuf> {
    let name = any_part.file_name()?.to_str()?;
    let stem = name.strip_suffix(".gguf")?;
    // NAME-00001-of-00003
    let (head, of) = stem.rsplit_once("-of-")?;
    let (prefix, num) = head.rsplit_once('-')?;
    if num.len() != 5 || of.len() != 5 || !num.bytes().chain(of.bytes()).all(|b| b.is_ascii_digit())
    {
        return None;
    }
    Some(any_part.with_file_name(format!("{prefix}-{:05}-of-{count:05}.gguf", no + 1)))
}

fn bad(path: &Path, key: &str, detail: String) -> GgufError {
    GgufError::Format {
        path: path.to_path_buf(),
        error: FormatError::BadValue {
            key: key.to_string(),
            detail,
        },
    }
}

/// A split key as an integer, if present (gguf-split writes u16 and i32).
fn int_key(f: &GgufFile, key: &str) -> Result<Option<u64>, GgufError> {
    match f.get(key) {
        None => Ok(None),
        Some(_) => f.get_u64(key).map(Some),
    }
}

/// Opens the other parts of `first` when it is part 1 of a split model.
pub(crate) fn open_parts(first: &mut GgufFile) -> Result<(), GgufError> {
    let Some(count) = int_key(first, KEY_SPLIT_COUNT)? else {
        return Ok(());
    };
    let path = first.path().to_path_buf();
    let no = int_key(first, KEY_SPLIT_NO)?.unwrap_or(0);
    if count == 0 || count > 9999 {
        return Err(bad(
            &path,
            KEY_SPLIT_COUNT,
            format!("{count} parts (1..=9999)"),
        ));
    }
    if no != 0 {
        let hint = split_part_path(&path, 0, count as usize)
            .map(|p| format!("; open the first part, {}", p.display()))
            .unwrap_or_default();
        return Err(bad(
            &path,
            KEY_SPLIT_NO,
            format!("this is part {} of {count}{hint}", no + 1),
        ));
    }
    let total = int_key(first, KEY_SPLIT_TENSORS)?;
    let mut base = first.bytes().len();
    for i in 1..count as usize {
        let p = split_part_path(&path, i, count as usize).ok_or_else(|| {
            bad(
                &path,
                KEY_SPLIT_COUNT,
                format!(
                    "the model has {count} parts but this file is not named NAME-00001-of-{count:05}.gguf, so the others cannot be found"
                ),
            )
        })?;
        let map = map_file(&p).map_err(|e| match e {
            GgufError::Io { path, error } => GgufError::Io {
                path,
                error: std::io::Error::new(
                    error.kind(),
                    format!(
                        "part {} of {count} of {}: {error}",
                        i + 1,
                        first.path().display()
                    ),
                ),
            },
            other => other,
        })?;
        let part = GgufFile::parse(p.clone(), Backing::Mapped(map))?;
        for (key, want) in [(KEY_SPLIT_NO, i as u64), (KEY_SPLIT_COUNT, count)] {
            let got = int_key(&part, key)?;
            if got != Some(want) {
                return Err(bad(
                    &p,
                    key,
                    format!(
                        "is {got:?} where part {} of {count} of {} needs {want} (a part of another split?)",
                        i + 1,
                        first.path().display()
                    ),
                ));
            }
        }
        if int_key(&part, KEY_SPLIT_TENSORS)? != total {
            return Err(bad(
                &p,
                KEY_SPLIT_TENSORS,
                format!(
                    "differs from the first part's {total:?}: the parts come from different models"
                ),
            ));
        }
        let GgufFile {
            backing,
            tensors,
            data_offset,
            ..
        } = part;
        for mut t in tensors {
            if first.tensor_index.contains_key(&t.name) {
                return Err(bad(
                    &p,
                    KEY_SPLIT_NO,
                    format!("tensor '{}' is in two parts", t.name),
                ));
            }
            t.part = i;
            first
                .tensor_index
                .insert(t.name.clone(), first.tensors.len());
            first.tensors.push(t);
        }
        let len = backing.bytes().len();
        first.more.push(Part {
            path: p,
            backing,
            data_offset,
            base,
        });
        base += len;
    }
    if let Some(total) = total {
        if first.tensors.len() as u64 != total {
            return Err(bad(
                &path,
                KEY_SPLIT_TENSORS,
                format!(
                    "the {count} parts hold {} tensors, the first part says {total}",
                    first.tensors.len()
                ),
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn part_names_follow_gguf_split() {
        let p = Path::new("/m/qwen-00001-of-00003.gguf");
        assert_eq!(
            split_part_path(p, 2, 3).unwrap(),
            Path::new("/m/qwen-00003-of-00003.gguf")
        );
        assert!(split_part_path(Path::new("/m/qwen.gguf"), 1, 2).is_none());
        assert!(split_part_path(Path::new("/m/q-1-of-2.gguf"), 1, 2).is_none());
    }
}
