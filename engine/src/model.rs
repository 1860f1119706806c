//! The Llama-family decoder: RMSNorm, rotary embeddings (non-interleaved
//! halves, optional Llama 3 frequency scaling), grouped-query attention,
//! SwiGLU; f32 on the CPU (candle).
//!
//! One [`Llama::forward`] call runs any mix of sequences, each with its own
//! new tokens and position: a prefill piece of one sequence, or one token of
//! each decoding sequence. The linear layers run on all their rows at once;
//! attention runs per sequence over its own KV ([`SeqKv`]), written before
//! it is read so a piece attends to itself. The math is the reference Llama
//! (Hugging Face `modeling_llama.py`): the oracle test checks our logits
//! against that implementation (transformers' `LlamaForCausalLM`).

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Module, Tensor};
use candle_nn::Linear;

use crate::error::EngineError;
use crate::kv::SeqKv;
use crate::model_config::ModelConfig;

struct Layer {
    input_norm: Tensor,
    q: Linear,
    k: Linear,
    v: Linear,
    o: Linear,
    post_norm: Tensor,
    gate: Linear,
    up: Linear,
    down: Linear,
}

/// A loaded decoder.
pub struct Llama {
    cfg: ModelConfig,
    embed: Tensor,
    layers: Vec<Layer>,
    norm: Tensor,
    lm_head: Linear,
    cos: Tensor,
    sin: Tensor,
    device: Device,
}

/// The new tokens of one sequence in a forward pass.
pub struct Step<'a> {
    /// Tokens at positions `kv.len()..kv.len() + tokens.len()`.
    pub tokens: &'a [u32],
    /// The sequence's KV; the pass appends the new positions.
    pub kv: &'a mut SeqKv,
    /// Whether the logits of the last new token are wanted.
    pub want_logits: bool,
}

/// Called around each layer of a forward pass: layer-wise KV streaming
/// waits for a loaded group before its first layer and stores a computed
/// group after its last.
pub trait LayerHook {
    /// Before layer `layer` reads step `step`'s KV. An error ends the pass
    /// before any new position counts (the steps' KV lengths are unchanged).
    fn before_layer(
        &mut self,
        step: usize,
        layer: usize,
        kv: &mut SeqKv,
    ) -> Result<(), EngineError>;
    /// Once layer `layer`'s K and V of step `step`'s new positions are written.
    fn after_layer(&mut self, step: usize, layer: usize, kv: &mut SeqKv);
}

struct NoHook;

impl LayerHook for NoHook {
    fn before_layer(&mut self, _: usize, _: usize, _: &mut SeqKv) -> Result<(), EngineError> {
        Ok(())
    }
    fn after_layer(&mut self, _: usize, _: usize, _: &mut SeqKv) {}
}

/// Weights by name, each with the file it came from (for error messages).
pub type Weights = HashMap<String, (Tensor, PathBuf)>;

fn take(
    w: &mut Weights,
    name: &str,
    shape: &[usize],
    missing_in: &Path,
) -> Result<Tensor, EngineError> {
    let Some((t, file)) = w.remove(name) else {
        return Err(EngineError::model(missing_in, name, "tensor missing"));
    };
    if t.dims() != shape {
        return Err(EngineError::model(
            file,
            name,
            format!("shape {:?}, the config asks for {shape:?}", t.dims()),
        ));
    }
    Ok(t)
}

fn rope_tables(cfg: &ModelConfig, device: &Device) -> Result<(Tensor, Tensor), EngineError> {
    let hd = cfg.head_dim();
    let base: Vec<f32> = (0..hd)
        .step_by(2)
        .map(|i| 1f32 / cfg.rope_theta.powf(i as f32 / hd as f32))
        .collect();
    let inv_freq: Vec<f32> = match &cfg.rope_scaling {
        None => base,
        Some(s) => {
            let orig = s.original_max_position_embeddings as f32;
            let low_wavelen = orig / s.low_freq_factor;
            let high_wavelen = orig / s.high_freq_factor;
            base.into_iter()
                .map(|f| {
                    let wavelen = 2. * std::f32::consts::PI / f;
                    if wavelen < high_wavelen {
                        f
                    } else if wavelen > low_wavelen {
                        f / s.factor
                    } else {
                        let smooth = (orig / wavelen - s.low_freq_factor)
                            / (s.high_freq_factor - s.low_freq_factor);
                        (1. - smooth) * f / s.factor + smooth * f
                    }
                })
                .collect()
        }
    };
    let n = inv_freq.len();
    let inv_freq = Tensor::from_vec(inv_freq, (1, n), device)?;
    let positions = Tensor::arange(0u32, cfg.max_position_embeddings as u32, device)?
        .to_dtype(DType::F32)?
        .reshape((cfg.max_position_embeddings, 1))?;
    let angles = positions.matmul(&inv_freq)?;
    Ok((angles.cos()?, angles.sin()?))
}

impl Llama {
    /// Builds the model from `weights` (Hugging Face names); `missing_in`
    /// names the file a missing tensor should have been in. Tensors the
    /// model does not use are ignored.
    pub fn from_weights(
        cfg: ModelConfig,
        mut weights: Weights,
        missing_in: &Path,
        device: &Device,
    ) -> Result<Self, EngineError> {
        let h = cfg.hidden_size;
        let kv = cfg.num_key_value_heads * cfg.head_dim();
        let i = cfg.intermediate_size;
        let w = &mut weights;
        let lin = |w: &mut Weights, name: &str, out: usize, inp: usize| {
            take(w, name, &[out, inp], missing_in).map(|t| Linear::new(t, None))
        };
        let embed = take(
            w,
            "model.embed_tokens.weight",
            &[cfg.vocab_size, h],
            missing_in,
        )?;
        let mut layers = Vec::with_capacity(cfg.num_hidden_layers);
        for l in 0..cfg.num_hidden_layers {
            let p = format!("model.layers.{l}");
            layers.push(Layer {
                input_norm: take(w, &format!("{p}.input_layernorm.weight"), &[h], missing_in)?,
                q: lin(w, &format!("{p}.self_attn.q_proj.weight"), h, h)?,
                k: lin(w, &format!("{p}.self_attn.k_proj.weight"), kv, h)?,
                v: lin(w, &format!("{p}.self_attn.v_proj.weight"), kv, h)?,
                o: lin(w, &format!("{p}.self_attn.o_proj.weight"), h, h)?,
                post_norm: take(
                    w,
                    &format!("{p}.post_attention_layernorm.weight"),
                    &[h],
                    missing_in,
                )?,
                gate: lin(w, &format!("{p}.mlp.gate_proj.weight"), i, h)?,
                up: lin(w, &format!("{p}.mlp.up_proj.weight"), i, h)?,
                down: lin(w, &format!("{p}.mlp.down_proj.weight"), h, i)?,
            });
        }
        let norm = take(w, "model.norm.weight", &[h], missing_in)?;
        let lm_head = if cfg.tie_word_embeddings {
            Linear::new(embed.clone(), None)
        } else {
            lin(w, "lm_head.weight", cfg.vocab_size, h)?
        };
        let (cos, sin) = rope_tables(&cfg, device)?;
        Ok(Self {
            cfg,
            embed,
            layers,
            norm,
            lm_head,
            cos,
            sin,
            device: device.clone(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    /// Runs the new tokens of every step through the model, appending their
    /// K and V to each step's KV. Returns the logits of the last new token
    /// of each step that asked for them, in step order.
    pub fn forward(&self, steps: &mut [Step<'_>]) -> Result<Vec<Vec<f32>>, EngineError> {
        self.forward_with(steps, &mut NoHook)
    }

    /// [`Llama::forward`], calling `hook` around every layer of every step.
    pub fn forward_with(
        &self,
        steps: &mut [Step<'_>],
        hook: &mut dyn LayerHook,
    ) -> Result<Vec<Vec<f32>>, EngineError> {
        let cfg = &self.cfg;
        let hd = cfg.head_dim();
        let heads = cfg.num_attention_heads;
        let kvh = cfg.num_key_value_heads;
        let groups = cfg.kv_groups();
        let eps = cfg.rms_norm_eps as f32;
        let mut ids = Vec::new();
        let mut positions = Vec::new();
        let mut rows = Vec::with_capacity(steps.len());
        for s in steps.iter() {
            if s.tokens.is_empty() {
                return Err(EngineError::BadRequest(
                    "a forward step has no tokens".into(),
                ));
            }
            let start = s.kv.len();
            if start + s.tokens.len() > cfg.max_position_embeddings {
                return Err(EngineError::BadRequest(format!(
                    "position {} is past max_position_embeddings {}",
                    start + s.tokens.len(),
                    cfg.max_position_embeddings
                )));
            }
            if let Some(&t) = s.tokens.iter().find(|&&t| t as usize >= cfg.vocab_size) {
                return Err(EngineError::BadRequest(format!(
                    "token {t} is outside the vocabulary of {}",
                    cfg.vocab_size
                )));
            }
            rows.push((ids.len(), s.tokens.len(), start));
            ids.extend_from_slice(s.tokens);
            positions.extend((start..start + s.tokens.len()).map(|p| p as u32));
        }
        let total = ids.len();
        let ids = Tensor::from_vec(ids, total, &self.device)?;
        let positions = Tensor::from_vec(positions, total, &self.device)?;
        let cos = self.cos.index_select(&positions, 0)?;
        let sin = self.sin.index_select(&positions, 0)?;
        let mut x = self.embed.index_select(&ids, 0)?;
        let scale = (hd as f64).sqrt();
        // Causal masks, one per step of more than one token (the same for
        // every layer): position start + i sees positions 0..=start + i.
        let masks: Vec<Option<Tensor>> = rows
            .iter()
            .map(|&(_, n, start)| {
                if n == 1 {
                    return Ok(None);
                }
                let len = start + n;
                let mask: Vec<f32> = (0..n)
                    .flat_map(|i| {
                        (0..len).map(move |j| {
                            if j > start + i {
                                f32::NEG_INFINITY
                            } else {
                                0.0
                            }
                        })
                    })
                    .collect();
                Tensor::from_vec(mask, (n, len), &self.device).map(Some)
            })
            .collect::<candle_core::Result<_>>()?;
        for (li, layer) in self.layers.iter().enumerate() {
            for (i, s) in steps.iter_mut().enumerate() {
                hook.before_layer(i, li, s.kv)?;
            }
            let residual = &x;
            let hn = candle_nn::ops::rms_norm(&x, &layer.input_norm, eps)?;
            let split = |t: Tensor, n: usize| -> candle_core::Result<Tensor> {
                t.reshape((total, n, hd))?.transpose(0, 1)?.contiguous()
            };
            let q = split(layer.q.forward(&hn)?, heads)?.unsqueeze(0)?;
            let q = candle_nn::rotary_emb::rope(&q, &cos, &sin)?.squeeze(0)?;
            let k = split(layer.k.forward(&hn)?, kvh)?.unsqueeze(0)?;
            let k = candle_nn::rotary_emb::rope(&k, &cos, &sin)?.squeeze(0)?;
            let v = split(layer.v.forward(&hn)?, kvh)?;
            let k_all = k.flatten_all()?.to_vec1::<f32>()?;
            let v_all = v.flatten_all()?.to_vec1::<f32>()?;
            let mut ys = Vec::with_capacity(steps.len());
            for (i, ((s, &(off, n, start)), mask)) in
                steps.iter_mut().zip(&rows).zip(&masks).enumerate()
            {
                let pick = |all: &[f32]| -> Vec<f32> {
                    let mut out = Vec::with_capacity(kvh * n * hd);
                    for h in 0..kvh {
                        let b = (h * total + off) * hd;
                        out.extend_from_slice(&all[b..b + n * hd]);
                    }
                    out
                };
                s.kv.write(li, &pick(&k_all), &pick(&v_all), n);
                hook.after_layer(i, li, s.kv);
                let len = start + n;
                let keys =
                    Tensor::from_vec(s.kv.gather(li, false, len), (kvh, len, hd), &self.device)?;
                let vals =
                    Tensor::from_vec(s.kv.gather(li, true, len), (kvh, len, hd), &self.device)?;
                let qs = q
                    .narrow(1, off, n)?
                    .contiguous()?
                    .reshape((kvh, groups * n, hd))?;
                let att = (qs.matmul(&keys.t()?)? / scale)?;
                let att = match mask {
                    Some(mask) => att
                        .reshape((kvh, groups, n, len))?
                        .broadcast_add(mask)?
                        .reshape((kvh, groups * n, len))?,
                    None => att,
                };
                let att = candle_nn::ops::softmax_last_dim(&att)?;
                let y = att
                    .matmul(&vals)?
                    .reshape((heads, n, hd))?
                    .transpose(0, 1)?;
                ys.push(y.reshape((n, heads * hd))?);
            }
            let y = Tensor::cat(&ys, 0)?;
            let x1 = (layer.o.forward(&y)? + residual)?;
            let hn = candle_nn::ops::rms_norm(&x1, &layer.post_norm, eps)?;
            let mlp =
                (candle_nn::ops::silu(&layer.gate.forward(&hn)?)? * layer.up.forward(&hn)?)?;
            x = (layer.down.forward(&mlp)? + x1)?;
        }
        for (s, &(_, n, _)) in steps.iter_mut().zip(&rows) {
            s.kv.advance(n);
        }
        let last: Vec<u32> = steps
            .iter()
            .zip(&rows)
            .filter(|(s, _)| s.want_logits)
            .map(|(_, &(off, n, _))| (off + n - 1) as u32)
            .collect();
        if last.is_empty() {
            return Ok(Vec::new());
        }
        let nl = last.len();
        let last = Tensor::from_vec(last, nl, &self.device)?;
        let x = x.index_select(&last, 0)?;
        let x = candle_nn::ops::rms_norm(&x, &self.norm, eps)?;
        let logits = self.lm_head.forward(&x)?.to_dtype(DType::F32)?;
        Ok(logits.to_vec2::<f32>()?)
    }

    /// Index of the largest logit (greedy decoding; the first on ties).
    /// NaN logits are skipped; all NaN (or none) gives 0.
    pub fn argmax(logits: &[f32]) -> u32 {
        let mut best: Option<(usize, f32)> = None;
        for (i, &l) in logits.iter().enumerate() {
            if !l.is_nan() && best.is_none_or(|(_, b)| l > b) {
                best = Some((i, l));
            }
        }
        best.map_or(0, |(i, _)| i as u32)
    }
}
