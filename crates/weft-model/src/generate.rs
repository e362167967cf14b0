//! Generation over any backend that yields next-token logits: the whole model on this node,
//! or a cluster whose ranks merge their vocabulary slices' top-k. Streaming text, stop
//! sequences, sampling and log-probabilities live here once for both.

use std::time::Instant;

use weft_tokenizer::{StreamDecoder, Tokenizer};

use crate::engine::{FinishReason, GenerateRequest, Generated};
use crate::error::ModelError;
use crate::sampler::{log_sum_exp, logprob_of, top_logprobs, Sampler};

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
    req.sampling.validate().map_err(ModelError::Invalid)?;
    if req.prompt_ids.is_empty() {
        return Err(ModelError::Invalid("the prompt is empty".into()));
    }
    let n_ctx = backend.n_ctx();
    if req.prompt_ids.len() >= n_ctx {
        return Err(ModelError::Invalid(format!(
            "the prompt has {} tokens; the context holds {n_ctx}",
            req.prompt_ids.len()
        )));
    }
    let t0 = Instant::now();
    backend.prefill(&req.prompt_ids)?;
    let prefill_secs = t0.elapsed().as_secs_f64();
    let mut sampler = Sampler::new(req.sampling.clone());
    let mut history = req.prompt_ids.clone();
    let mut stream = StreamDecoder::new(tokenizer);
    let mut stops = StopScanner::new(&req.stop);
    let mut out = Generated {
        token_ids: Vec::new(),
        text: String::new(),
        finish: FinishReason::Length,
        logprobs: Vec::new(),
        prefill_tokens: req.prompt_ids.len(),
        prefill_secs,
        decode_steps: 0,
        decode_secs: 0.0,
    };
    let t1 = Instant::now();
    let budget = req.max_tokens.min(n_ctx - req.prompt_ids.len());
    while out.token_ids.len() < budget {
        let norm = backend.log_normalizer();
        let logits = backend.logits();
        // Logprobs before penalties: the model's own distribution. With a top-k view the
        // shift moves them from the view's normalizer to the full vocabulary's.
        let shift = norm.map(|z| log_sum_exp(logits) - z).unwrap_or(0.0);
        let raw = (req.logprobs > 0).then(|| logits.to_vec());
        if req.logprobs > 0 {
            let top = top_logprobs(logits, req.logprobs)
                .into_iter()
                .map(|(i, l)| (i, l + shift))
                .collect();
            out.logprobs.push((0.0, top));
        }
        let tok = sampler.sample(logits, &history);
        if let (Some(raw), Some(last)) = (raw, out.logprobs.last_mut()) {
            last.0 = logprob_of(&raw, tok) + shift;
        }
        if tokenizer.is_eog(tok) {
            if req.logprobs > 0 {
                out.logprobs.pop();
            }
            out.finish = FinishReason::Stop;
            break;
        }
        out.token_ids.push(tok);
        history.push(tok);
        let piece = stream.push(tok);
        let (emit, hit) = stops.feed(&piece);
        out.text.push_str(&emit);
        on_text(&emit);
        if hit {
            out.finish = FinishReason::Stop;
            break;
        }
        if out.token_ids.len() >= budget {
            break;
        }
        backend.decode(tok)?;
        out.decode_steps += 1;
    }
    if out.finish == FinishReason::Length {
        let rest = stream.finish();
        let (mut emit, _) = stops.feed(&rest);
        emit.push_str(&stops.flush());
        out.text.push_str(&emit);
        on_text(&emit);
    }
    out.decode_secs = t1.elapsed().as_secs_f64();
    Ok(out)
}

/// Finds stop sequences in streamed text, holding back any tail that might begin one.
struct StopScanner<'a> {
    stops: &'a [String],
    pending: String,
}

impl<'a> StopScanner<'a> {
    fn new(stops: &'a [String]) -> Self {
        StopScanner {
            stops,
            pending: String::new(),
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
            .filter_map(|s| self.pending.find(s.as_str()))
            .min();
        if let Some(at) = hit {
            let emit = self.pending[..at].to_string();
            self.pending.clear();
            return (emit, true);
        }
        // Hold back the longest suffix that is a proper prefix of a stop sequence.
        let mut keep = 0;
        for s in self.stops {
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
        let mut s = StopScanner::new(&stops);
        assert_eq!(s.feed("abc E"), ("abc ".to_string(), false));
        assert_eq!(s.feed("N"), (String::new(), false));
        assert_eq!(s.feed("Dx"), (String::new(), true));
        let mut s = StopScanner::new(&stops);
        assert_eq!(s.feed("EN"), (String::new(), false));
        assert_eq!(s.feed("o"), ("ENo".to_string(), false));
        assert_eq!(s.flush(), "");
    }
}
