//! The cluster secret: read from --secret or WEFT_SECRET and refused when weak, or made
//! fresh by `weft secret`.

use anyhow::{anyhow, Result};

/// The secret from the flag or WEFT_SECRET, refused when too weak to resist online guessing.
pub(crate) fn secret_from(flag: &Option<String>) -> Result<String> {
    let s = flag
        .clone()
        .or_else(|| std::env::var("WEFT_SECRET").ok())
        .filter(|s| !s.is_empty())
        .ok_or_else(|| {
            anyhow!(
                "a cluster secret is needed: --secret S or WEFT_SECRET (`weft secret` makes one)"
            )
        })?;
    weft_comm::secret::check_secret(&s).map_err(|e| anyhow!(e))?;
    Ok(s)
}

/// `weft secret`: one fresh secret on stdout (so it can be captured), the hint on stderr.
pub fn print_secret() -> Result<()> {
    outln!("{}", weft_comm::secret::random_secret())?;
    eprintln!(
        "give every node and coordinator of one cluster this secret: \
         --secret SECRET, or WEFT_SECRET=SECRET in the environment"
    );
    Ok(())
}
