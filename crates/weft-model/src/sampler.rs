//! Choosing the next token from logits: greedy, temperature, top-k, top-p, min-p,
//! repetition penalty, seeded randomness; and the log-probabilities the API reports.

use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Sampling settings. `temperature <= 0` means greedy.
#[derive(Clone, Debug, PartialEq)]
pub struct SamplingParams {
    pub temperature: f32,
    /// Keep only the k most likely tokens (0: no limit).
    pub top_k: usize,
    /// Keep the smallest set whose probability reaches p (1.0: no limit).
    pub top_p: f32,
    /// Drop tokens less likely than min_p times the most likely one (0: off).
    pub min_p: f32,
    /// Divide positive (multiply negative) logits of recently seen tokens (1.0: off).
    pub repeat_penalty: f32,
    /// How many recent tokens the penalty looks at.
    pub repeat_last_n: usize,
    pub seed: u64,
}

impl Default for SamplingParams {
    fn default() -> Self {
        SamplingParams {
            temperature: 0.8,
            top_k: 40,
            top_p: 0.95,
            min_p: 0.05,
            repeat_penalty: 1.0,
            repeat_last_n: 64,
            seed: 0,
        }
    }
}

impl SamplingParams {
    pub fn greedy() -> Self {
        SamplingParams {
            temperature: 0.0,
            ..Default::default()
        }
    }

    pub fn validate(&self) -> Result<(), String> {
        if !self.temperature.is_finite() || self.temperature < 0.0 {
            return Err(format!(
                "temperature {} must be a finite number >= 0",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            return Err(format!("min_p {} must be in [0, 1]", self.min_p));
        }
        if !self.repeat_penalty.is_finite() || self.repeat_penalty <= 0.0 {
            return Err(format!(
                "repeat_penalty {} must be > 0",
                self.repeat_penalty
            ));
        }
        Ok(())
    }
}

/// A sampler for one sequence; its buffers are reused across tokens.
pub struct Sampler {
    pub params: SamplingParams,
    rng: StdRng,
    cand: Vec<(u32, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        Sampler {
            rng: StdRng::seed_from_u64(params.seed),
            params,
            cand: Vec::new(),
        }
    }

    /// Whether `sample` changes the logits it is given (repetition penalty).
    pub fn modifies_logits(&self) -> bool {
        self.params.repeat_penalty != 1.0
    }

    /// Picks the next token. `logits` may be modified (penalties are applied in place);
    /// `recent` is the sequence so far (prompt and generated). Logits with a NaN or +inf,
    /// or with no finite value at all, are refused: no token can be chosen from them.
    pub fn sample(&mut self, logits: &mut [f32], recent: &[u32]) -> Result<u32, NonFinite> {
        check_logits(logits)?;
        Ok(self.sample_checked(logits, recent))
    }

    /// `sample` for logits `check_logits` has passed (the caller scanned them already).
    pub(crate) fn sample_checked(&mut self, logits: &mut [f32], recent: &[u32]) -> u32 {
        let p = &self.params;
        if p.repeat_penalty != 1.0 {
            let from = recent.len().saturating_sub(p.repeat_last_n);
            for &t in &recent[from..] {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l = if *l > 0.0 {
                        *l / p.repeat_penalty
                    } else {
                        *l * p.repeat_penalty
                    };
                }
            }
        }
        if p.temperature <= 0.0 {
            return argmax(logits);
        }
        // Tokens more than 30 nats (at this temperature) below the best hold under 1e-13
        // of its probability each, 3e-8 over a 262k vocabulary: dropping them first keeps
        // the sort below small when no top-k limit is set.
        let best = logits.iter().fold(f32::NEG_INFINITY, |m, &v| m.max(v));
        let floor = best - 30.0 * p.temperature;
        self.cand.clear();
        self.cand.extend(
            logits
                .iter()
                .enumerate()
                .filter(|(_, &l)| l >= floor)
                .map(|(i, &l)| (i as u32, l)),
        );
        let by_logit = |a: &(u32, f32), b: &(u32, f32)| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0));
        if p.top_k > 0 && p.top_k < self.cand.len() {
            self.cand.select_nth_unstable_by(p.top_k - 1, by_logit);
            self.cand.truncate(p.top_k);
        }
        self.cand.sort_unstable_by(by_logit);
        // Softmax at temperature, over the candidates (sorted, best first).
        let max = self.cand[0].1;
        let mut sum = 0f64;
        for c in self.cand.iter_mut() {
            c.1 = ((c.1 - max) / p.temperature).exp();
            sum += c.1 as f64;
        }
        for c in self.cand.iter_mut() {
            c.1 = (c.1 as f64 / sum) as f32;
        }
        if p.min_p > 0.0 {
            let floor = self.cand[0].1 * p.min_p;
            let keep = self.cand.iter().take_while(|c| c.1 >= floor).count().max(1);
            self.cand.truncate(keep);
        }
        if p.top_p < 1.0 {
            let mut acc = 0f32;
            let mut keep = self.cand.len();
            for (i, c) in self.cand.iter().enumerate() {
                acc += c.1;
                if acc >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
            self.cand.truncate(keep);
        }
        let total: f32 = self.cand.iter().map(|c| c.1).sum();
        let mut r = self.rng.gen::<f32>() * total;
        for c in &self.cand {
            if r < c.1 {
                return c.0;
            }
            r -= c.1;
        }
        self.cand[self.cand.len() - 1].0
    }
}

/// Why a row of logits cannot be sampled from.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NonFinite {
    /// At least one logit is NaN.
    NaN,
    /// At least one logit is +inf (its probability would swallow the rest).
    Infinite,
    /// Every logit is -inf (or the row is empty): no candidate at all.
    NoCandidate,
}

impl NonFinite {
    pub fn as_str(self) -> &'static str {
        match self {
            NonFinite::NaN => "NaN",
            NonFinite::Infinite => "+inf",
            NonFinite::NoCandidate => "no finite value",
        }
    }
}

/// Checks a row of logits before sampling: no NaN, no +inf, at least one finite value
/// (-inf alone is fine: a top-k view leaves the rest of the vocabulary at -inf).
///
/// One pass without early exit, over 16 independent lanes, so it vectorizes: over a
/// 262k vocabulary it costs a few tens of microseconds a token.
pub fn check_logits(logits: &[f32]) -> Result<(), NonFinite> {
    const LANES: usize = 16;
    let mut nan = [false; LANES];
    let mut pos_inf = [false; LANES];
    let mut finite = [false; LANES];
    let mut groups = logits.chunks_exact(LANES);
    for g in &mut groups {
        for i in 0..LANES {
            let v = g[i];
            nan[i] |= v.is_nan();
            pos_inf[i] |= v == f32::INFINITY;
            finite[i] |= v.is_finite();
        }
    }
    let tail = groups.remainder();
    let any = |lanes: &[bool; LANES], f: &dyn Fn(f32) -> bool| {
        lanes.iter().any(|&b| b) || tail.iter().any(|&v| f(v))
    };
    if any(&nan, &|v| v.is_nan()) {
        return Err(NonFinite::NaN);
    }
    if any(&pos_inf, &|v| v == f32::INFINITY) {
        return Err(NonFinite::Infinite);
    }
    if !any(&finite, &|v| v.is_finite()) {
        return Err(NonFinite::NoCandidate);
    }
    Ok(())
}

/// Index of the largest logit (the lowest index among equals; 0 if none compares, as
/// when all are NaN).
///
/// Why not one compare-and-select loop: over a 262,144-entry vocabulary that is a serial
/// chain of dependent compares (about 0.4 ms a token here, several per cent of a batched
/// step). Instead, 16 independent lanes keep each block's maximum (the compiler turns them
/// into vector max instructions), and only the first block holding the overall maximum is
/// scanned again for its index.
pub fn argmax(logits: &[f32]) -> u32 {
    const LANES: usize = 16;
    const BLOCK: usize = 1024;
    let mut best = f32::NEG_INFINITY;
    let mut best_block = 0;
    for (b, block) in logits.chunks(BLOCK).enumerate() {
        let mut lanes = [f32::NEG_INFINITY; LANES];
        let mut groups = block.chunks_exact(LANES);
        for g in &mut groups {
            for (m, &v) in lanes.iter_mut().zip(g) {
                // `if v > m` rather than f32::max: the same NaN rule as a plain compare.
                *m = if v > *m { v } else { *m };
            }
        }
        let tail = groups.remainder().iter();
        let m = lanes
            .iter()
            .chain(tail)
            .fold(f32::NEG_INFINITY, |a, &v| if v > a { v } else { a });
        if m > best {
            best = m;
            best_block = b;
        }
    }
    let start = best_block * BLOCK;
    logits[start..(start + BLOCK).min(logits.len())]
        .iter()
        .position(|&v| v == best)
        .map_or(0, |i| (start + i) as u32)
}

/// The `k` largest logits as `(logit, id)`, best first, ties to the lower id, into `best`
/// (reused, so a caller per token allocates nothing). One pass with a sorted k-buffer:
/// k is small (tens) and most logits fail the first comparison.
pub fn top_k_into(logits: &[f32], k: usize, best: &mut Vec<(f32, u32)>) {
    let k = k.min(logits.len());
    best.clear();
    if k == 0 {
        return;
    }
    for (i, &v) in logits.iter().enumerate() {
        if best.len() == k && v <= best[k - 1].0 {
            continue; // ties keep the lower id, which came first
        }
        let at = best.partition_point(|&(bv, _)| bv >= v);
        if best.len() == k {
            best.pop();
        }
        best.insert(at, (v, i as u32));
    }
}

/// Log-probability of one token.
pub fn logprob_of(logits: &[f32], id: u32) -> f32 {
    logits[id as usize] - log_sum_exp(logits)
}

/// log Σ exp(l), computed around the maximum so it neither overflows nor underflows.
pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    if max == f32::NEG_INFINITY {
        return max;
    }
    max + logits
        .iter()
        .map(|&l| ((l - max) as f64).exp())
        .sum::<f64>()
        .ln() as f32
}

#[cfg(test)]
mod tests {
    use super::*;

    fn logits() -> Vec<f32> {
        vec![1.0, 3.0, 2.0, 2.9, -1.0, 0.5]
    }

    #[test]
    fn argmax_matches_a_plain_scan() {
        let plain = |x: &[f32]| {
            let (mut best, mut bv) = (0, f32::NEG_INFINITY);
            for (i, &v) in x.iter().enumerate() {
                if v > bv {
                    (best, bv) = (i as u32, v);
                }
            }
            best
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for n in [1usize, 15, 16, 17, 1023, 1024, 1025, 5000, 262_144] {
            let mut x: Vec<f32> = (0..n).map(|_| rng.gen_range(-8.0..8.0)).collect();
            assert_eq!(argmax(&x), plain(&x), "n={n}");
            // A tie across blocks goes to the lower index; NaNs never win.
            let last = n - 1;
            x[last] = 100.0;
            x[n / 2] = 100.0;
            x[n / 3] = f32::NAN;
            assert_eq!(argmax(&x), plain(&x), "n={n} with a tie and a NaN");
        }
        assert_eq!(argmax(&[f32::NAN; 40]), 0);
        assert_eq!(argmax(&[f32::NEG_INFINITY, f32::NEG_INFINITY]), 0);
    }

    #[test]
    fn greedy_takes_the_best() {
        let mut s = Sampler::new(SamplingParams::greedy());
        assert_eq!(s.sample(&mut logits(), &[]).unwrap(), 1);
    }

    #[test]
    fn repetition_penalty_changes_the_choice() {
        let mut s = Sampler::new(SamplingParams {
            repeat_penalty: 1.5,
            ..SamplingParams::greedy()
        });
        // token 1 (3.0) is penalised to 2.0, so 3 (2.9) wins
        assert_eq!(s.sample(&mut logits(), &[1]).unwrap(), 3);
    }

    #[test]
    fn same_seed_same_tokens() {
        let run = |seed| {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.5,
                top_k: 0,
                top_p: 1.0,
                min_p: 0.0,
                seed,
                ..Default::default()
            });
            (0..50)
                .map(|_| s.sample(&mut logits(), &[]).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(run(7), run(7));
        assert_ne!(run(7), run(8));
        let seen: std::collections::HashSet<_> = run(7).into_iter().collect();
        assert!(
            seen.len() >= 3,
            "high temperature should visit several tokens: {seen:?}"
        );
    }

    #[test]
    fn top_k_and_top_p_restrict() {
        for (k, p) in [(2usize, 1.0f32), (0, 0.5)] {
            let mut s = Sampler::new(SamplingParams {
                temperature: 1.0,
                top_k: k,
                top_p: p,
                min_p: 0.0,
                seed: 1,
                ..Default::default()
            });
            for _ in 0..100 {
                let t = s.sample(&mut logits(), &[]).unwrap();
                assert!(t == 1 || t == 3, "top_k={k} top_p={p} sampled {t}");
            }
        }
    }

    #[test]
    fn min_p_restricts() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.5,
            seed: 3,
            ..Default::default()
        });
        for _ in 0..100 {
            let t = s.sample(&mut logits(), &[]).unwrap();
            assert!([1, 2, 3].contains(&t), "sampled {t}");
        }
    }

    #[test]
    fn logprobs_are_normalised() {
        let l = logits();
        let mut top = Vec::new();
        top_k_into(&l, 3, &mut top);
        assert_eq!(top.iter().map(|t| t.1).collect::<Vec<_>>(), vec![1, 3, 2]);
        assert_eq!(top[0].0, 3.0);
        // Ties keep the lower id; k beyond the vocabulary takes all of it.
        top_k_into(&[0.5, 2.0, 2.0, 1.0], 9, &mut top);
        assert_eq!(
            top.iter().map(|t| t.1).collect::<Vec<_>>(),
            vec![1, 2, 3, 0]
        );
        let total: f64 = (0..l.len() as u32)
            .map(|i| (logprob_of(&l, i) as f64).exp())
            .sum();
        assert!((total - 1.0).abs() < 1e-5);
    }

    #[test]
    fn non_finite_logits_are_refused_not_sampled() {
        for params in [
            SamplingParams::greedy(),
            SamplingParams::default(),
            SamplingParams {
                repeat_penalty: 1.3,
                ..Default::default()
            },
        ] {
            let mut s = Sampler::new(params);
            for n in [3usize, 16, 40, 1000] {
                let mut l = vec![0.5f32; n];
                l[n / 2] = f32::NAN;
                assert_eq!(s.sample(&mut l, &[1]), Err(NonFinite::NaN), "n={n}");
                let mut l = vec![f32::NAN; n];
                assert_eq!(s.sample(&mut l, &[]), Err(NonFinite::NaN), "n={n}");
                let mut l = vec![0.5f32; n];
                l[n - 1] = f32::INFINITY;
                assert_eq!(s.sample(&mut l, &[]), Err(NonFinite::Infinite), "n={n}");
                let mut l = vec![f32::NEG_INFINITY; n];
                assert_eq!(s.sample(&mut l, &[]), Err(NonFinite::NoCandidate));
                // A top-k view: -inf everywhere but one finite logit is fine.
                l[n - 1] = -3.0;
                assert_eq!(s.sample(&mut l, &[]), Ok(n as u32 - 1), "n={n}");
            }
            assert_eq!(s.sample(&mut [], &[]), Err(NonFinite::NoCandidate));
        }
    }

    #[test]
    fn bad_params_are_named() {
        let p = SamplingParams {
            top_p: 0.0,
            ..Default::default()
        };
        assert!(p.validate().unwrap_err().contains("top_p"));
    }
}
