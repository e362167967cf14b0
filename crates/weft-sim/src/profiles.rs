//! Profiles beyond the built-in ones, from a JSON file: `{"hardware": [...], "links":
//! [...]}` with the fields of `Hardware` and `Link`; a name found there wins over a
//! built-in one of the same name.

use serde::Deserialize;

use crate::hardware::{self, Hardware};
use crate::links::{self, Link};

#[derive(Clone, Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Profiles {
    #[serde(default)]
    pub hardware: Vec<Hardware>,
    #[serde(default)]
    pub links: Vec<Link>,
}

impl Profiles {
    /// Reads and checks a profiles file's text; errors name the entry and field.
    pub fn from_json(text: &str) -> Result<Profiles, String> {
        let p: Profiles = serde_json::from_str(text).map_err(|e| e.to_string())?;
        for h in &p.hardware {
            h.validate()?;
        }
        for l in &p.links {
            l.validate()?;
        }
        Ok(p)
    }

    pub fn hardware(&self, name: &str) -> Result<Hardware, String> {
        match self
            .hardware
            .iter()
            .find(|h| h.name.eq_ignore_ascii_case(name))
        {
            Some(h) => Ok(h.clone()),
            None => hardware::named(name),
        }
    }

    pub fn link(&self, name: &str) -> Result<Link, String> {
        match self
            .links
            .iter()
            .find(|l| l.name.eq_ignore_ascii_case(name))
        {
            Some(l) => Ok(l.clone()),
            None => links::named(name),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_file_adds_machines_and_links_and_names_bad_fields() {
        let p = Profiles::from_json(
            r#"{"hardware": [{"name": "mini", "memory_bytes": 32e9,
                "bandwidth_bytes_per_s": 120e9, "compute_ops_per_s": 8e12}],
                "links": [{"name": "usb4", "latency_us": 40, "bytes_per_s": 3e9}]}"#,
        )
        .unwrap();
        let h = p.hardware("MINI").unwrap();
        assert_eq!(h.decode_efficiency, 0.6);
        assert_eq!(p.link("usb4").unwrap().per_message_us, 0.0);
        assert_eq!(p.link("10gbe").unwrap().name, "10gbe");
        let e = Profiles::from_json(r#"{"links": [{"name": "x", "latency_us": 1}]}"#).unwrap_err();
        assert!(e.contains("bytes_per_s"), "{e}");
        let e = Profiles::from_json(
            r#"{"hardware": [{"name": "m", "memory_bytes": 1, "bandwidth_bytes_per_s": 0,
                "compute_ops_per_s": 1}]}"#,
        )
        .unwrap_err();
        assert!(e.contains("hardware m: bandwidth_bytes_per_s"), "{e}");
        assert!(Profiles::from_json(r#"{"nodes": []}"#)
            .unwrap_err()
            .contains("nodes"));
    }
}
