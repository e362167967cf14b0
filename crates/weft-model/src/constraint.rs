//! A rule over which tokens a sequence may sample next (structured output, forced tool
//! calls). `Sequence` applies it between the logits and the sampler; the rule itself
//! (a grammar) lives above this crate.

/// Restricts sampling to the tokens a rule allows at each step.
pub trait TokenConstraint: Send {
    /// Sets the logit of every token the rule forbids now to -inf, leaving at least one
    /// finite logit. Err: the rule cannot go on, and says why.
    fn mask(&mut self, logits: &mut [f32]) -> Result<(), String>;
    /// Records the token that was sampled. Err: the rule refuses it.
    fn accept(&mut self, token: u32) -> Result<(), String>;
    /// The rule is complete and allows nothing more: the sequence ends here.
    fn finished(&self) -> bool;
}
