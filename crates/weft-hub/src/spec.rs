//! `OWNER/REPO[:QUANT]` and choosing a quantization's files from a repository listing.

use crate::client::{HubError, HubFile};

/// A repository and, optionally, the quantization wanted from it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct RepoSpec {
    pub repo: String,
    pub quant: Option<String>,
}

impl std::str::FromStr for RepoSpec {
    type Err = HubError;
    fn from_str(s: &str) -> Result<Self, HubError> {
        let (repo, quant) = match s.split_once(':') {
            Some((r, q)) => (r, Some(q)),
            None => (s, None),
        };
        let ok_part = |p: &str| {
            !p.is_empty()
                && p.bytes()
                    .all(|b| b.is_ascii_alphanumeric() || b"-_.".contains(&b))
                && p != "."
                && p != ".."
        };
        match repo.split_once('/') {
            Some((o, n)) if ok_part(o) && ok_part(n) => {}
            _ => {
                return Err(HubError::Spec(format!(
                    "{s:?} is not OWNER/REPO[:QUANT] (for example Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M)"
                )))
            }
        }
        if let Some(q) = quant {
            if q.is_empty() || !q.bytes().all(|b| b.is_ascii_alphanumeric() || b == b'_') {
                return Err(HubError::Spec(format!("{q:?} is not a quantization name")));
            }
        }
        Ok(RepoSpec {
            repo: repo.to_string(),
            quant: quant.map(str::to_string),
        })
    }
}

/// The quantization a GGUF file name states (`…-Q4_K_M.gguf`, `…-Q4_K_M-00001-of-00003.gguf`,
/// or a `Q4_K_M/` folder), upper-cased.
fn quant_of(path: &str) -> Option<String> {
    let is_quant = |t: &str| {
        let t = t.to_ascii_uppercase();
        let body = t
            .strip_prefix("IQ")
            .or_else(|| t.strip_prefix("BF"))
            .or_else(|| t.strip_prefix('Q'))
            .or_else(|| t.strip_prefix('F'));
        body.is_some_and(|b| b.starts_with(|c: char| c.is_ascii_digit()))
            && t.bytes().all(|c| c.is_ascii_alphanumeric() || c == b'_')
    };
    let stem = path.strip_suffix(".gguf")?;
    let tokens: Vec<&str> = stem.split(['-', '.', '/']).collect();
    tokens
        .iter()
        .rev()
        .find(|t| is_quant(t))
        .map(|t| t.to_ascii_uppercase())
}

/// The distinct quantizations among a listing's GGUF files, sorted.
pub fn available_quants(files: &[HubFile]) -> Vec<String> {
    let mut q: Vec<String> = files.iter().filter_map(|f| quant_of(&f.path)).collect();
    q.sort();
    q.dedup();
    q
}

/// The GGUF files of `quant` (all parts of a split model), in name order; without a
/// quantization, the repository must hold exactly one.
pub fn pick_files(
    files: &[HubFile],
    quant: Option<&str>,
    repo: &str,
) -> Result<Vec<HubFile>, HubError> {
    let ggufs = files.iter().filter(|f| f.path.ends_with(".gguf"));
    let quants = available_quants(files);
    let want = match quant {
        Some(q) => q.to_ascii_uppercase(),
        None if quants.len() == 1 => quants[0].clone(),
        None if quants.is_empty() => {
            return Err(HubError::NoGguf(repo.to_string()));
        }
        None => {
            return Err(HubError::Spec(format!(
                "{repo} holds several quantizations ({}); name one as {repo}:QUANT",
                quants.join(", ")
            )))
        }
    };
    let mut picked: Vec<HubFile> = ggufs
        .filter(|f| quant_of(&f.path).as_deref() == Some(want.as_str()))
        .cloned()
        .collect();
    if picked.is_empty() {
        return Err(HubError::NoQuant {
            repo: repo.to_string(),
            quant: want,
            available: quants,
        });
    }
    picked.sort_by(|a, b| a.path.cmp(&b.path));
    Ok(picked)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn f(p: &str) -> HubFile {
        HubFile {
            path: p.into(),
            size: 1,
            sha256: None,
        }
    }

    #[test]
    fn specs_parse_and_bad_ones_are_named() {
        let s: RepoSpec = "Qwen/Qwen3-30B-A3B-GGUF:Q4_K_M".parse().unwrap();
        assert_eq!(s.repo, "Qwen/Qwen3-30B-A3B-GGUF");
        assert_eq!(s.quant.as_deref(), Some("Q4_K_M"));
        assert_eq!("a/b".parse::<RepoSpec>().unwrap().quant, None);
        for bad in ["noslash", "a/", "/b", "a/b:", "a/../b", "a/b:Q4 K", "../x"] {
            assert!(bad.parse::<RepoSpec>().is_err(), "{bad}");
        }
    }

    #[test]
    fn a_quantization_picks_every_part_and_a_missing_one_lists_the_rest() {
        let files = [
            f("README.md"),
            f("Model-Q8_0.gguf"),
            f("Q4_K_M/Model-Q4_K_M-00002-of-00002.gguf"),
            f("Q4_K_M/Model-Q4_K_M-00001-of-00002.gguf"),
            f("Model-IQ4_XS.gguf"),
            f("Model-BF16.gguf"),
        ];
        let got = pick_files(&files, Some("q4_k_m"), "o/r").unwrap();
        assert_eq!(got.len(), 2);
        assert!(got[0].path.ends_with("00001-of-00002.gguf"));
        assert_eq!(pick_files(&files, Some("Q8_0"), "o/r").unwrap().len(), 1);
        assert_eq!(pick_files(&files, Some("IQ4_XS"), "o/r").unwrap().len(), 1);
        let e = pick_files(&files, Some("Q5_K_M"), "o/r")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("Q5_K_M") && e.contains("BF16, IQ4_XS, Q4_K_M, Q8_0"),
            "{e}"
        );
        assert!(pick_files(&files, None, "o/r").is_err());
        assert_eq!(pick_files(&files[1..2], None, "o/r").unwrap().len(), 1);
    }
}
