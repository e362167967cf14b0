//! One sequence's grammar state as a `TokenConstraint`: masks the logits with the
//! grammar's allowed set and advances on each sampled token.

use llguidance::{Matcher, TokenParser};
use weft_model::TokenConstraint;

pub struct Rule {
    matcher: Matcher,
    eos: u32,
    /// Every end-of-generation token: allowed wherever the grammar allows EOS.
    eog: Vec<u32>,
}

impl Rule {
    pub(crate) fn new(parser: TokenParser, eos: u32, eog: Vec<u32>) -> Result<Self, String> {
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(e);
        }
        Ok(Rule { matcher, eos, eog })
    }

    /// Whether the output so far is a complete match.
    pub fn accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}

impl std::fmt::Debug for Rule {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Rule")
            .field("eos", &self.eos)
            .finish_non_exhaustive()
    }
}

impl TokenConstraint for Rule {
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String> {
        let allowed = self.matcher.compute_mask().map_err(|e| e.to_string())?;
        let eos_ok = allowed.is_allowed(self.eos);
        let ok = |id: usize| {
            (id < allowed.len() && allowed.is_allowed(id as u32))
                || (eos_ok && self.eog.binary_search(&(id as u32)).is_ok())
        };
        let mut first_allowed = None;
        let mut any_finite = false;
        for (id, l) in logits.iter_mut().enumerate() {
            if ok(id) {
                first_allowed.get_or_insert(id);
                any_finite |= l.is_finite();
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        match (first_allowed, any_finite) {
            (None, _) => Err("the grammar allows no token of this vocabulary here".into()),
            // A cluster sends only its best candidates; when none of them is allowed, the
            // grammar's first allowed token keeps the output well-formed.
            (Some(id), false) => {
                logits[id] = 0.0;
                Ok(())
            }
            _ => Ok(()),
        }
    }

    fn accept(&mut self, token: u32) -> Result<(), String> {
        self.matcher
            .consume_token(token)
            .map_err(|e| format!("token {token} does not follow the grammar: {e}"))
    }

    fn finished(&self) -> bool {
        self.matcher.is_stopped()
    }
}
