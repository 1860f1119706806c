//! Choosing the next token: greedy (temperature 0) or seeded sampling with
//! temperature and top-p (nucleus).

use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;

/// Below this temperature, sampling is greedy (vLLM's threshold).
pub const GREEDY_BELOW: f32 = 1e-5;

/// How one request samples.
#[derive(Debug, Clone)]
pub struct SamplingParams {
    /// 0 = greedy.
    pub temperature: f32,
    /// Keep the smallest set of tokens whose probability reaches this (1 = all).
    pub top_p: f32,
    /// Seed of the request's random stream (None: a random seed).
    pub seed: Option<u64>,
    /// Most tokens to generate.
    pub max_tokens: usize,
    /// Keep going after an end-of-sequence token.
    pub ignore_eos: bool,
    /// Report each generated token's logprob and this many alternatives'
    /// (`None`: no logprobs).
    pub logprobs: Option<usize>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 1.0,
            top_p: 1.0,
            seed: None,
            max_tokens: 16,
            ignore_eos: false,
            logprobs: None,
        }
    }
}

impl SamplingParams {
    /// Checks the values; the message names the field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            return Err(format!("temperature {} must be >= 0", self.temperature));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p {} must be in (0, 1]", self.top_p));
        }
        if self.max_tokens == 0 {
            return Err("max_tokens must be at least 1".into());
        }
        if self.logprobs.is_some_and(|k| k > MAX_TOP_LOGPROBS) {
            return Err(format!(
                "at most {MAX_TOP_LOGPROBS} top logprobs per token may be asked for"
            ));
        }
        Ok(())
    }
}

/// A request's sampler: its parameters and random stream.
#[derive(Debug)]
pub struct Sampler {
    temperature: f32,
    top_p: f32,
    rng: ChaCha8Rng,
    scratch: Vec<(f32, u32)>,
}

impl Sampler {
    pub fn new(p: &SamplingParams) -> Self {
        let seed = p.seed.unwrap_or_else(rand::random);
        Self {
            temperature: p.temperature,
            top_p: p.top_p,
            rng: ChaCha8Rng::seed_from_u64(seed),
            scratch: Vec::new(),
        }
    }

    /// The next token for `logits`. Logits come from KV that crossed the
    /// network, so they may hold NaN or infinities: a NaN logit is never
    /// drawn, and logits with no finite maximum (all NaN or -inf, or a +inf)
    /// fall back to greedy; nothing here panics.
    pub fn sample(&mut self, logits: &[f32]) -> u32 {
        if self.temperature < GREEDY_BELOW {
            return crate::model::Llama::argmax(logits);
        }
        // f32::max skips NaN.
        let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
        if !max.is_finite() {
            return crate::model::Llama::argmax(logits);
        }
        self.scratch.clear();
        let mut sum = 0f32;
        for (i, &l) in logits.iter().enumerate() {
            // NaN -> 0: never drawn. Finite l - max <= 0, so p is in [0, 1].
            let p = ((l - max) / self.temperature).exp();
            let p = if p.is_nan() { 0.0 } else { p };
            sum += p;
            self.scratch.push((p, i as u32));
        }
        let mut keep = self.scratch.len();
        if self.top_p < 1.0 {
            // Highest first; ties by token id so the order is deterministic.
            self.scratch
                .sort_unstable_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
            let mut acc = 0f32;
            for (i, &(p, _)) in self.scratch.iter().enumerate() {
                acc += p / sum;
                if acc >= self.top_p {
                    keep = i + 1;
                    break;
                }
            }
            sum = self.scratch[..keep].iter().map(|x| x.0).sum();
        }
        // The maximum's own p is 1, so sum >= 1 and the range is not empty.
        if !(sum > 0.0 && sum.is_finite()) {
            return crate::model::Llama::argmax(logits);
        }
        let mut r = self.rng.random_range(0.0..sum);
        for &(p, t) in &self.scratch[..keep] {
            if r < p {
                return t;
            }
            r -= p;
        }
        self.scratch[keep - 1].1
    }
}

/// Most alternatives a request may ask for per token (vLLM's default
/// `max_logprobs`).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// What a logprob of minus infinity is reported as (JSON has no infinity;
/// vLLM's choice).
pub const LOGPROB_FLOOR: f32 = -9999.0;

/// The log-probability of a sampled token and of the most likely tokens,
/// under the model's own distribution (the log-softmax of the raw logits,
/// before temperature and top-p: what vLLM reports by default).
#[derive(Debug, Clone, PartialEq)]
pub struct TokenLogprobs {
    pub logprob: f32,
    /// Up to the asked number of `(token, logprob)`, most likely first.
    pub top: Vec<(u32, f32)>,
}

/// The logprobs of `token` and the `top` most likely tokens of `logits`.
/// A NaN logit has probability 0; logits with no finite maximum report
/// every token at [`LOGPROB_FLOOR`] (nothing here panics).
pub fn logprobs(logits: &[f32], token: u32, top: usize) -> TokenLogprobs {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let lse = if max.is_finite() {
        let sum: f32 = logits
            .iter()
            .filter(|l| !l.is_nan())
            .map(|&l| (l - max).exp())
            .sum();
        max + sum.ln()
    } else {
        f32::NAN
    };
    let of = |l: f32| -> f32 {
        let v = l - lse;
        if v.is_finite() {
            v.max(LOGPROB_FLOOR)
        } else {
            LOGPROB_FLOOR
        }
    };
    let logprob = logits.get(token as usize).map_or(LOGPROB_FLOOR, |&l| of(l));
    let k = top.min(MAX_TOP_LOGPROBS).min(logits.len());
    // The k largest, kept sorted (k is small): highest first, ties by id.
    let mut best: Vec<(u32, f32)> = Vec::with_capacity(k + 1);
    if k > 0 {
        for (i, &l) in logits.iter().enumerate() {
            if l.is_nan() {
                continue;
            }
            if best.len() == k && l <= best[k - 1].1 {
                continue;
            }
            let at = best.partition_point(|&(_, b)| b >= l);
            best.insert(at, (i as u32, l));
            best.truncate(k);
        }
    }
    TokenLogprobs {
        logprob,
        top: best.into_iter().map(|(t, l)| (t, of(l))).collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_p: f32, seed: u64) -> SamplingParams {
        SamplingParams {
            temperature,
            top_p,
            seed: Some(seed),
            ..SamplingParams::default()
        }
    }

    #[test]
    fn greedy_takes_the_largest_logit() {
        let mut s = Sampler::new(&params(0.0, 1.0, 1));
        assert_eq!(s.sample(&[0.1, 3.0, 2.9, -1.0]), 1);
    }

    #[test]
    fn same_seed_same_stream_and_top_p_cuts_the_tail() {
        let logits: Vec<f32> = (0..50).map(|i| (i % 7) as f32 * 0.3).collect();
        let draw = |seed| {
            let mut s = Sampler::new(&params(1.0, 1.0, seed));
            (0..64).map(|_| s.sample(&logits)).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        // Token 0 has 0.9 of the mass; top_p 0.5 keeps it alone.
        let mut s = Sampler::new(&params(1.0, 0.5, 3));
        let peaked = [5.0f32, 2.0, 1.0, 0.5];
        assert!((0..200).all(|_| s.sample(&peaked) == 0));
        // Without the cut, the others show up.
        let mut s = Sampler::new(&params(1.0, 1.0, 3));
        assert!((0..2000).any(|_| s.sample(&peaked) != 0));
    }

    #[test]
    fn non_finite_logits_never_panic_and_nan_is_never_drawn() {
        let mut s = Sampler::new(&params(1.0, 1.0, 5));
        // NaN beside finite logits: only the finite ones are drawn.
        let mixed = [f32::NAN, 1.0, f32::NAN, 0.5];
        for _ in 0..500 {
            let t = s.sample(&mixed);
            assert!(t == 1 || t == 3, "drew token {t}");
        }
        // No finite maximum: greedy fallback, no panic.
        assert_eq!(s.sample(&[f32::NAN; 4]), 0);
        assert_eq!(s.sample(&[f32::NEG_INFINITY; 3]), 0);
        assert_eq!(s.sample(&[0.0, f32::INFINITY, 1.0]), 1);
        let mut s = Sampler::new(&params(1.0, 0.5, 5));
        assert_eq!(s.sample(&[f32::NAN, f32::INFINITY]), 1);
        // Greedy skips NaN too.
        let mut g = Sampler::new(&params(0.0, 1.0, 5));
        assert_eq!(g.sample(&[f32::NAN, 1.0, 2.0, f32::NAN]), 2);
        for _ in 0..100 {
            assert_eq!(s.sample(&[f32::NAN, 9.0, 0.0, f32::NAN]), 1);
        }
    }

    #[test]
    fn logprobs_are_the_log_softmax_and_the_top_ones_come_first() {
        let logits = [1.0f32, 3.0, 2.0, f32::NAN, 0.0];
        let lp = logprobs(&logits, 2, 2);
        let z: f32 = [1.0f32, 3.0, 2.0, 0.0].iter().map(|l| l.exp()).sum();
        assert!((lp.logprob - (2.0 - z.ln())).abs() < 1e-5, "{lp:?}");
        assert_eq!(lp.top.iter().map(|t| t.0).collect::<Vec<_>>(), [1, 2]);
        assert!((lp.top[0].1 - (3.0 - z.ln())).abs() < 1e-5);
        let total: f32 = (0..5).map(|t| logprobs(&logits, t, 0).logprob.exp()).sum();
        assert!((total - 1.0).abs() < 1e-4, "{total}");
        // NaN has no probability; no finite maximum reports the floor.
        assert_eq!(logprobs(&logits, 3, 0).logprob, LOGPROB_FLOOR);
        let none = logprobs(&[f32::NAN; 3], 0, 5);
        assert_eq!(none.logprob, LOGPROB_FLOOR);
        assert!(none.top.is_empty());
        // Asking for more than there are, or than the cap, is bounded.
        assert_eq!(logprobs(&logits, 0, 50).top.len(), 4);
    }

    #[test]
    fn bad_parameters_are_named() {
        assert!(params(-1.0, 1.0, 0)
            .validate()
            .unwrap_err()
            .contains("temperature"));
        assert!(params(1.0, 0.0, 0)
            .validate()
            .unwrap_err()
            .contains("top_p"));
    }
}
