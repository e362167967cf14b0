//! `GgufFile::open`: maps a model file and, when it is the first part of a split model,
//! every other part (split.rs), so callers see one model either way.

use std::path::Path;

use crate::error::GgufError;
use crate::reader::{map_file, Backing, GgufFile};
use crate::split::open_parts;

impl GgufFile {
    /// Maps and parses `path`; for the first part of a split model
    /// (`NAME-00001-of-0000N.gguf`) it opens every part.
    pub fn open(path: impl AsRef<Path>) -> Result<Self, GgufError> {
        let path = path.as_ref().to_path_buf();
        let map = map_file(&path)?;
        let mut f = Self::parse(path, Backing::Mapped(map))?;
        open_parts(&mut f)?;
        Ok(f)
    }
}
