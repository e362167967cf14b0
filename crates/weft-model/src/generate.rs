//! Generation over any backend that yields next-token logits: the whole model on this node,
//! or a cluster whose ranks merge their vocabulary slices' top-k. Streaming text, stop
//! sequences, sampling and log-probabilities live here once for both.

use std::time::Instant;

use weft_tokenizer::{StreamDecoder, Tokenizer};

use crate::constraint::TokenConstraint;
use crate::error::ModelError;
use crate::request::{FinishReason, GenerateRequest, Generated};
use crate::sampler::{check_logits, log_sum_exp, top_k_into, NonFinite, Sampler};

/// Something that runs a sequence and yields the logits of its last token.
pub trait Backend {
    /// The most tokens a sequence may hold.
    fn n_ctx(&self) -> usize;
    /// Starts a new sequence with `prompt`; then `logits` holds its last token's logits.
    fn prefill(&mut self, prompt: &[u32]) -> Result<(), ModelError>;
    /// Appends one token; then `logits` holds its logits.
    fn decode(&mut self, token: u32) -> Result<(), ModelError>;
    /// The last token's logits over the whole vocabulary. A backend that only has the
    /// best k leaves the rest at -inf and reports the true normalizer below.
    fn logits(&mut self) -> &mut [f32];
    /// log Σ exp(logit) over the full vocabulary, when `logits` holds only the top k.
    fn log_normalizer(&self) -> Option<f32> {
        None
    }
}

/// Generates from `req.prompt_ids`, calling `on_text` with each new piece of text
/// (never part of a UTF-8 character, never part of a stop sequence).
pub fn generate(
    backend: &mut dyn Backend,
    tokenizer: &Tokenizer,
    req: &GenerateRequest,
    on_text: &mut dyn FnMut(&str),
) -> Result<Generated, ModelError> {
    let mut seq = Sequence::start(tokenizer, req, backend.n_ctx())?;
    let t0 = Instant::now();
    backend.prefill(&req.prompt_ids)?;
    seq.out.prefill_secs = t0.elapsed().as_secs_f64();
    let t1 = Instant::now();
    loop {
        let norm = backend.log_normalizer();
        let step = seq.advance(backend.logits(), norm)?;
        on_text(&step.text);
        match step.next {
            Some(tok) => {
                backend.decode(tok)?;
                seq.out.decode_steps += 1;
            }
            None => break,
        }
    }
    seq.out.decode_secs = t1.elapsed().as_secs_f64();
    Ok(seq.finish())
}

/// What one call to `Sequence::advance` produced.
#[derive(Debug, Default)]
pub struct Advanced {
    /// Text that became safe to emit (may be empty).
    pub text: String,
    /// The token sampled and kept (None when it ended the sequence, such as EOS).
    pub token: Option<u32>,
    /// The token the backend must run next; None when the sequence is finished.
    pub next: Option<u32>,
}

/// One sequence's generation state, driven step by step from its logits, so a batch of
/// sequences can share forward steps. `generate` is this loop for a single sequence.
pub struct Sequence<'a> {
    tokenizer: &'a Tokenizer,
    logprobs: usize,
    sampler: Sampler,
    history: Vec<u32>,
    stream: StreamDecoder<'a>,
    stops: StopScanner,
    budget: usize,
    finished: bool,
    /// Reused buffer of the top-k selection.
    best: Vec<(f32, u32)>,
    /// The rule the sampled tokens must follow, if any (structured output).
    constraint: Option<Box<dyn TokenConstraint>>,
    /// The result so far; the caller fills in the timings it measures.
    pub out: Generated,
}

impl<'a> Sequence<'a> {
    /// Checks `req` against a context of `n_ctx` tokens and prepares to sample.
    pub fn start(
        tokenizer: &'a Tokenizer,
        req: &GenerateRequest,
        n_ctx: usize,
    ) -> Result<Self, ModelError> {
        req.sampling.validate().map_err(ModelError::Invalid)?;
        if req.prompt_ids.is_empty() {
            return Err(ModelError::Invalid("the prompt is empty".into()));
        }
        if req.prompt_ids.len() >= n_ctx {
            return Err(ModelError::Invalid(format!(
                "the prompt has {} tokens; the context holds {n_ctx}",
                req.prompt_ids.len()
            )));
        }
        Ok(Sequence {
            tokenizer,
            logprobs: req.logprobs,
            sampler: Sampler::new(req.sampling.clone()),
            history: req.prompt_ids.clone(),
            stream: StreamDecoder::new(tokenizer),
            stops: StopScanner::new(req.stop.clone()),
            budget: req.max_tokens.min(n_ctx - req.prompt_ids.len()),
            finished: false,
            best: Vec::with_capacity(req.logprobs + 1),
            constraint: None,
            out: Generated {
                prefill_tokens: req.prompt_ids.len(),
                ..Default::default()
            },
        })
    }

    /// Samples only what `rule` allows from here on; the sequence ends (as a stop) when
    /// the rule is complete.
    pub fn constrained(mut self, rule: Option<Box<dyn TokenConstraint>>) -> Self {
        self.constraint = rule;
        self
    }

    pub fn is_finished(&self) -> bool {
        self.finished
    }

    /// Samples the next token from the last token's `logits` (`norm`: the full
    /// vocabulary's log-normalizer when `logits` holds only a top-k view). Logits with a
    /// NaN or +inf, or no finite value, end the sequence with `NonFiniteLogits`.
    pub fn advance(
        &mut self,
        logits: &mut [f32],
        norm: Option<f32>,
    ) -> Result<Advanced, ModelError> {
        let mut step = Advanced::default();
        if self.finished {
            return Ok(step);
        }
        if self.out.token_ids.len() >= self.budget {
            step.text = self.end(FinishReason::Length);
            return Ok(step);
        }
        // Checked once here, before logprobs and sampling both read them; a NaN
        // normalizer from a cluster's merged top-k counts as well.
        let bad = check_logits(logits)
            .err()
            .or_else(|| norm.filter(|z| !z.is_finite()).map(|_| NonFinite::NaN));
        if let Some(why) = bad {
            self.finished = true;
            return Err(ModelError::NonFiniteLogits {
                what: why.as_str(),
                // The position of the token whose logits these are.
                pos: self.history.len().saturating_sub(1),
            });
        }
        // Logprobs before penalties: the model's own distribution, normalized over the
        // full vocabulary (a top-k view comes with the true normalizer `norm`).
        let z = (self.logprobs > 0).then(|| norm.unwrap_or_else(|| log_sum_exp(logits)));
        let top = z.map(|z| {
            top_k_into(logits, self.logprobs, &mut self.best);
            self.best
                .iter()
                .map(|&(l, i)| (i, l - z))
                .collect::<Vec<_>>()
        });
        // The chosen token's own logit, read after sampling: only a penalty or a rule
        // changes the logits, and only then is a copy needed.
        let changes = self.sampler.modifies_logits() || self.constraint.is_some();
        let kept = (z.is_some() && changes).then(|| logits.to_vec());
        if let Some(rule) = &mut self.constraint {
            if rule.finished() {
                step.text = self.end(FinishReason::Stop);
                return Ok(step);
            }
            if let Err(why) = rule.mask(logits) {
                self.finished = true;
                return Err(ModelError::Constraint(why));
            }
        }
        let tok = self.sampler.sample_checked(logits, &self.history);
        if self.tokenizer.is_eog(tok) {
            self.finished = true;
            self.out.finish = FinishReason::Stop;
            return Ok(step);
        }
        if let Some(rule) = &mut self.constraint {
            if let Err(why) = rule.accept(tok) {
                self.finished = true;
                return Err(ModelError::Constraint(why));
            }
        }
        if let (Some(z), Some(top)) = (z, top) {
            let raw = kept.as_deref().unwrap_or(logits)[tok as usize];
            // A rule can pick a token outside a cluster's candidates, whose logit is not
            // known: it is reported as OpenAI reports the very unlikely, -9999.
            let lp = if (raw - z).is_finite() {
                raw - z
            } else {
                -9999.0
            };
            self.out.logprobs.push((lp, top));
        }
        self.out.token_ids.push(tok);
        self.history.push(tok);
        step.token = Some(tok);
        let piece = self.stream.push(tok);
        let (emit, hit) = self.stops.feed(&piece);
        self.out.text.push_str(&emit);
        step.text = emit;
        let complete = self.constraint.as_ref().is_some_and(|r| r.finished());
        if hit {
            self.finished = true;
            self.out.finish = FinishReason::Stop;
            self.out.stop_sequence = self.stops.matched.clone();
        } else if complete {
            step.text.push_str(&self.end(FinishReason::Stop));
        } else if self.out.token_ids.len() >= self.budget {
            step.text.push_str(&self.end(FinishReason::Length));
        } else {
            step.next = Some(tok);
        }
        Ok(step)
    }

    /// Finishes with `why`, flushing held-back text; returns that text.
    fn end(&mut self, why: FinishReason) -> String {
        self.finished = true;
        self.out.finish = why;
        let rest = self.stream.finish();
        let (mut emit, _) = self.stops.feed(&rest);
        emit.push_str(&self.stops.flush());
        self.out.text.push_str(&emit);
        emit
    }

    pub fn finish(self) -> Generated {
        self.out
    }
}

/// Finds stop sequences in streamed text, holding back any tail that might begin one.
struct StopScanner {
    stops: Vec<String>,
    pending: String,
    /// The stop sequence that was hit, once one is.
    matched: Option<String>,
}

impl StopScanner {
    fn new(stops: Vec<String>) -> Self {
        StopScanner {
            stops,
            pending: String::new(),
            matched: None,
        }
    }

    /// Adds `piece`; returns the text safe to emit and whether a stop sequence was hit
    /// (the stop sequence itself and anything after it are dropped).
    fn feed(&mut self, piece: &str) -> (String, bool) {
        self.pending.push_str(piece);
        let hit = self
            .stops
            .iter()
            .filter(|s| !s.is_empty())
            .filter_map(|s| self.pending.find(s.as_str()).map(|at| (at, s)))
            .min_by_key(|&(at, _)| at);
        if let Some((at, stop)) = hit {
            self.matched = Some(stop.clone());
            let emit = self.pending[..at].to_string();
            self.pending.clear();
            return (emit, true);
        }
        // Hold back the longest suffix that is a proper prefix of a stop sequence.
        let mut keep = 0;
        for s in &self.stops {
            for (i, _) in s.char_indices().skip(1) {
                if self.pending.ends_with(&s[..i]) {
                    keep = keep.max(i);
                }
            }
        }
        let cut = self.pending.len() - keep;
        let emit = self.pending[..cut].to_string();
        self.pending.drain(..cut);
        (emit, false)
    }

    fn flush(&mut self) -> String {
        std::mem::take(&mut self.pending)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stop_scanner_holds_back_prefixes() {
        let stops = vec!["END".to_string()];
        let mut s = StopScanner::new(stops.clone());
        assert_eq!(s.feed("abc E"), ("abc ".to_string(), false));
        assert_eq!(s.feed("N"), (String::new(), false));
        assert_eq!(s.feed("Dx"), (String::new(), true));
        let mut s = StopScanner::new(stops.clone());
        assert_eq!(s.feed("EN"), (String::new(), false));
        assert_eq!(s.feed("o"), ("ENo".to_string(), false));
        assert_eq!(s.flush(), "");
    }
}
