//! What one generation is asked for (`GenerateRequest`) and what it gives back
//! (`Generated`, `FinishReason`): shared by the single-node engine, the step-by-step
//! `Sequence` and the batcher.

use crate::sampler::SamplingParams;

/// What to generate.
#[derive(Clone, Debug)]
pub struct GenerateRequest {
    pub prompt_ids: Vec<u32>,
    pub max_tokens: usize,
    pub sampling: SamplingParams,
    pub stop: Vec<String>,
    /// Report this many top log-probabilities per generated token (0: none).
    pub logprobs: usize,
}

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum FinishReason {
    /// EOS / end of turn, or a stop sequence.
    Stop,
    /// max_tokens reached.
    #[default]
    Length,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
        }
    }
}

/// The outcome of one generation.
#[derive(Clone, Debug, Default)]
pub struct Generated {
    pub token_ids: Vec<u32>,
    pub text: String,
    pub finish: FinishReason,
    /// The stop sequence that ended it, if one did.
    pub stop_sequence: Option<String>,
    /// Per generated token: its own logprob and the top-k `(id, logprob)`.
    pub logprobs: Vec<(f32, Vec<(u32, f32)>)>,
    pub prefill_tokens: usize,
    pub prefill_secs: f64,
    pub decode_steps: usize,
    pub decode_secs: f64,
}

impl Generated {
    pub fn prefill_tok_s(&self) -> f64 {
        self.prefill_tokens as f64 / self.prefill_secs.max(1e-9)
    }
    pub fn decode_tok_s(&self) -> f64 {
        if self.decode_steps == 0 {
            0.0
        } else {
            self.decode_steps as f64 / self.decode_secs.max(1e-9)
        }
    }
}
