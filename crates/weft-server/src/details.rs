//! What a served model file is, read once from its GGUF header: size, family, parameter
//! count, quantization, context; the Ollama API lists it.

use std::path::Path;

use serde_json::{json, Value};

/// What `/api/tags` and `/api/show` say about the served model, read from its file.
#[derive(Clone, Debug, Default)]
pub struct ModelDetails {
    pub size_bytes: u64,
    pub family: String,
    pub parameters: u64,
    /// Parameters one token uses: the routed experts' counted at k of n (MoE models).
    pub active_parameters: u64,
    pub quantization: String,
    pub context_length: u64,
    pub modified_unix: u64,
}

impl ModelDetails {
    /// Reads the details from a GGUF file (all its parts).
    pub fn from_gguf(path: &Path) -> Result<Self, String> {
        let f = weft_gguf::GgufFile::open(path).map_err(|e| format!("{}: {e}", path.display()))?;
        let family = f
            .get_str("general.architecture")
            .unwrap_or("unknown")
            .to_string();
        let file_type = f.get_u64("general.file_type").ok();
        let quantization = match file_type {
            Some(0) => "F32",
            Some(1) => "F16",
            Some(2) => "Q4_0",
            Some(3) => "Q4_1",
            Some(7) => "Q8_0",
            Some(8) => "Q5_0",
            Some(9) => "Q5_1",
            Some(10) => "Q2_K",
            Some(11) => "Q3_K_S",
            Some(12) => "Q3_K_M",
            Some(13) => "Q3_K_L",
            Some(14) => "Q4_K_S",
            Some(15) => "Q4_K_M",
            Some(16) => "Q5_K_S",
            Some(17) => "Q5_K_M",
            Some(18) => "Q6_K",
            Some(32) => "BF16",
            _ => "unknown",
        }
        .to_string();
        let modified_unix = std::fs::metadata(path)
            .and_then(|m| m.modified())
            .ok()
            .and_then(|t| t.duration_since(std::time::UNIX_EPOCH).ok())
            .map(|d| d.as_secs())
            .unwrap_or(0);
        let used = f.get_u64(&format!("{family}.expert_used_count")).ok();
        let experts = f.get_u64(&format!("{family}.expert_count")).ok();
        let active_parameters = f
            .tensors()
            .iter()
            .map(|t| match (used, experts) {
                (Some(k), Some(n)) if n > 0 && t.name.contains("_exps") => t.n_elements() / n * k,
                _ => t.n_elements(),
            })
            .sum();
        Ok(ModelDetails {
            active_parameters,
            size_bytes: f.parts().iter().map(|(_, n)| n).sum(),
            context_length: f.get_u64(&format!("{family}.context_length")).unwrap_or(0),
            parameters: f.tensors().iter().map(|t| t.n_elements()).sum(),
            family,
            quantization,
            modified_unix,
        })
    }

    fn parameter_size(&self) -> String {
        let p = self.parameters as f64;
        if p >= 1e9 {
            format!("{:.1}B", p / 1e9)
        } else {
            format!("{:.0}M", p / 1e6)
        }
    }

    pub fn json(&self) -> Value {
        json!({
            "parent_model": "",
            "format": "gguf",
            "family": self.family,
            "families": [self.family],
            "parameter_size": self.parameter_size(),
            "quantization_level": self.quantization,
        })
    }

    /// What the dashboard shows of the model: `json` with the exact figures beside.
    pub fn summary(&self) -> Value {
        let mut v = self.json();
        v["parameters"] = json!(self.parameters);
        v["active_parameters"] = json!(self.active_parameters);
        v["size_bytes"] = json!(self.size_bytes);
        v["context_length"] = json!(self.context_length);
        v
    }
}

/// RFC 3339 time (UTC) of a Unix time, as Ollama writes `modified_at` and `created_at`.
pub fn rfc3339(unix: u64) -> String {
    let days = unix / 86_400;
    let secs = unix % 86_400;
    // Civil date from days since 1970-01-01 (Howard Hinnant's algorithm).
    let z = days as i64 + 719_468;
    let era = z.div_euclid(146_097);
    let doe = z - era * 146_097;
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365;
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100);
    let mp = (5 * doy + 2) / 153;
    let d = doy - (153 * mp + 2) / 5 + 1;
    let m = if mp < 10 { mp + 3 } else { mp - 9 };
    let y = yoe + era * 400 + (m <= 2) as i64;
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        secs / 3600,
        secs / 60 % 60,
        secs % 60
    )
}

#[cfg(test)]
mod tests {
    use super::rfc3339;

    #[test]
    fn times_are_rfc3339() {
        assert_eq!(rfc3339(0), "1970-01-01T00:00:00Z");
        assert_eq!(rfc3339(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(rfc3339(1_796_414_262), "2026-12-04T19:57:42Z");
    }
}
