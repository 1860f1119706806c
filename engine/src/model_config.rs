//! A model's shape: parsed from a Hugging Face `config.json`, or one of the
//! built-in seeded models.
//!
//! Only the Llama family is run (`LlamaForCausalLM`: RMSNorm, rotary
//! embeddings, grouped-query attention, SwiGLU, no biases). Anything else is
//! refused at start-up with the file and the field that says so, rather than
//! run with a silently different computation.

use std::path::Path;

use serde_json::Value;

use crate::error::EngineError;

/// RoPE frequency scaling of Llama 3.x (`rope_scaling.rope_type = "llama3"`).
#[derive(Debug, Clone, PartialEq)]
pub struct Llama3Scaling {
    pub factor: f32,
    pub low_freq_factor: f32,
    pub high_freq_factor: f32,
    pub original_max_position_embeddings: usize,
}

/// The hyper-parameters the decoder needs.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelConfig {
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub vocab_size: usize,
    pub num_hidden_layers: usize,
    pub num_attention_heads: usize,
    pub num_key_value_heads: usize,
    pub rms_norm_eps: f64,
    pub rope_theta: f32,
    pub rope_scaling: Option<Llama3Scaling>,
    pub max_position_embeddings: usize,
    pub tie_word_embeddings: bool,
    pub bos_token_id: Option<u32>,
    pub eos_token_ids: Vec<u32>,
}

impl ModelConfig {
    /// Dimension of one attention head.
    pub fn head_dim(&self) -> usize {
        self.hidden_size / self.num_attention_heads
    }

    /// Query heads per KV head.
    pub fn kv_groups(&self) -> usize {
        self.num_attention_heads / self.num_key_value_heads
    }

    /// Parameters of the weights this config asks for.
    pub fn parameters(&self) -> usize {
        let h = self.hidden_size;
        let kv = self.num_key_value_heads * self.head_dim();
        let per_layer = 2 * h * h + 2 * h * kv + 3 * h * self.intermediate_size + 2 * h;
        let embed = self.vocab_size * h;
        let head = if self.tie_word_embeddings { 0 } else { embed };
        self.num_hidden_layers * per_layer + embed + head + h
    }

    /// A canonical text of every field, for the model fingerprint.
    pub fn canonical(&self) -> String {
        format!("{self:?}")
    }

    /// Checks the shape makes sense; `file` names where it came from.
    pub fn validate(&self, file: &Path) -> Result<(), EngineError> {
        let bad = |field: &str, why: String| Err(EngineError::model(file, field, why));
        for (field, v) in [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("vocab_size", self.vocab_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("max_position_embeddings", self.max_position_embeddings),
        ] {
            if v == 0 {
                return bad(field, "must be greater than 0".into());
            }
        }
        if !self.hidden_size.is_multiple_of(self.num_attention_heads) {
            return bad(
                "num_attention_heads",
                format!(
                    "{} does not divide hidden_size {}",
                    self.num_attention_heads, self.hidden_size
                ),
            );
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            return bad(
                "num_key_value_heads",
                format!(
                    "{} does not divide num_attention_heads {}",
                    self.num_key_value_heads, self.num_attention_heads
                ),
            );
        }
        if !self.head_dim().is_multiple_of(2) {
            return bad(
                "hidden_size",
                format!("head dimension {} must be even for RoPE", self.head_dim()),
            );
        }
        if self.vocab_size > u32::MAX as usize {
            return bad("vocab_size", "does not fit token ids of 32 bits".into());
        }
        if self.rms_norm_eps.is_nan() || self.rms_norm_eps <= 0.0 {
            return bad("rms_norm_eps", "must be greater than 0".into());
        }
        if self.rope_theta.is_nan() || self.rope_theta <= 0.0 {
            return bad("rope_theta", "must be greater than 0".into());
        }
        if let Some(s) = &self.rope_scaling {
            let positive = s.factor > 0.0 && s.high_freq_factor > s.low_freq_factor;
            if !positive {
                return bad(
                    "rope_scaling",
                    "llama3 scaling needs factor > 0 and high_freq_factor > low_freq_factor".into(),
                );
            }
        }
        for &t in self.bos_token_id.iter().chain(&self.eos_token_ids) {
            if t as usize >= self.vocab_size {
                return bad(
                    "eos_token_id",
                    format!("token {t} is outside the vocabulary of {}", self.vocab_size),
                );
            }
        }
        Ok(())
    }

    /// Parses a Hugging Face `config.json`.
    pub fn from_hf_json(text: &str, file: &Path) -> Result<Self, EngineError> {
        let v: Value = serde_json::from_str(text)
            .map_err(|e| EngineError::model(file, "(file)", format!("not valid JSON: {e}")))?;
        let Some(obj) = v.as_object() else {
            return Err(EngineError::model(file, "(file)", "not a JSON object"));
        };
        let err = |field: &str, why: &str| EngineError::model(file, field, why);
        if let Some(archs) = obj.get("architectures") {
            let names: Vec<&str> = archs
                .as_array()
                .map(|a| a.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            if !names.contains(&"LlamaForCausalLM") {
                return Err(EngineError::model(
                    file,
                    "architectures",
                    format!("{names:?} is not supported: only LlamaForCausalLM runs here"),
                ));
            }
        }
        match obj.get("model_type").and_then(Value::as_str) {
            Some("llama") => {}
            Some(other) => {
                return Err(EngineError::model(
                    file,
                    "model_type",
                    format!("{other:?} is not supported: only \"llama\" runs here"),
                ))
            }
            None => return Err(err("model_type", "missing (expected \"llama\")")),
        }
        let usize_field = |field: &str| -> Result<usize, EngineError> {
            match obj.get(field) {
                None => Err(err(field, "missing")),
                Some(x) => x
                    .as_u64()
                    .map(|n| n as usize)
                    .ok_or_else(|| err(field, "must be a non-negative integer")),
            }
        };
        let opt_usize = |field: &str| -> Result<Option<usize>, EngineError> {
            match obj.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_u64()
                    .map(|n| Some(n as usize))
                    .ok_or_else(|| err(field, "must be a non-negative integer")),
            }
        };
        let opt_f64 = |field: &str| -> Result<Option<f64>, EngineError> {
            match obj.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_f64()
                    .map(Some)
                    .ok_or_else(|| err(field, "must be a number")),
            }
        };
        let opt_bool = |field: &str| -> Result<Option<bool>, EngineError> {
            match obj.get(field) {
                None | Some(Value::Null) => Ok(None),
                Some(x) => x
                    .as_bool()
                    .map(Some)
                    .ok_or_else(|| err(field, "must be true or false")),
            }
        };
        if let Some(act) = obj.get("hidden_act") {
            if act.as_str() != Some("silu") {
                return Err(EngineError::model(
                    file,
                    "hidden_act",
                    format!("{act} is not supported: only \"silu\" (SwiGLU) runs here"),
                ));
            }
        }
        for field in ["attention_bias", "mlp_bias"] {
            if opt_bool(field)? == Some(true) {
                return Err(err(
                    field,
                    "biases are not supported: only bias-free Llama runs here",
                ));
            }
        }
        let hidden_size = usize_field("hidden_size")?;
        let num_attention_heads = usize_field("num_attention_heads")?;
        if let Some(hd) = opt_usize("head_dim")? {
            if num_attention_heads > 0 && hd * num_attention_heads != hidden_size {
                return Err(EngineError::model(
                    file,
                    "head_dim",
                    format!(
                        "{hd} is not hidden_size / num_attention_heads ({hidden_size} / {num_attention_heads}): not supported"
                    ),
                ));
            }
        }
        let rope_scaling = match obj.get("rope_scaling") {
            None | Some(Value::Null) => None,
            Some(s) => {
                let kind = s
                    .get("rope_type")
                    .or_else(|| s.get("type"))
                    .and_then(Value::as_str)
                    .unwrap_or("");
                match kind {
                    "default" => None,
                    "llama3" => {
                        let num = |f: &str| -> Result<f64, EngineError> {
                            s.get(f).and_then(Value::as_f64).ok_or_else(|| {
                                EngineError::model(
                                    file,
                                    format!("rope_scaling.{f}"),
                                    "missing or not a number",
                                )
                            })
                        };
                        Some(Llama3Scaling {
                            factor: num("factor")? as f32,
                            low_freq_factor: num("low_freq_factor")? as f32,
                            high_freq_factor: num("high_freq_factor")? as f32,
                            original_max_position_embeddings: num(
                                "original_max_position_embeddings",
                            )?
                                as usize,
                        })
                    }
                    other => {
                        return Err(EngineError::model(
                            file,
                            "rope_scaling.rope_type",
                            format!("{other:?} is not supported (only \"default\" and \"llama3\")"),
                        ))
                    }
                }
            }
        };
        let eos_token_ids = match obj.get("eos_token_id") {
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|t| t.as_u64().map(|n| n as u32))
                .collect::<Option<Vec<u32>>>()
                .ok_or_else(|| err("eos_token_id", "must be an integer or a list of integers"))?,
            Some(t) => vec![t
                .as_u64()
                .ok_or_else(|| err("eos_token_id", "must be an integer or a list of integers"))?
                as u32],
        };
        let cfg = Self {
            hidden_size,
            intermediate_size: usize_field("intermediate_size")?,
            vocab_size: usize_field("vocab_size")?,
            num_hidden_layers: usize_field("num_hidden_layers")?,
            num_attention_heads,
            num_key_value_heads: opt_usize("num_key_value_heads")?.unwrap_or(num_attention_heads),
            rms_norm_eps: opt_f64("rms_norm_eps")?.ok_or_else(|| err("rms_norm_eps", "missing"))?,
            rope_theta: opt_f64("rope_theta")?.unwrap_or(10_000.0) as f32,
            rope_scaling,
            max_position_embeddings: usize_field("max_position_embeddings")?,
            tie_word_embeddings: opt_bool("tie_word_embeddings")?.unwrap_or(false),
            bos_token_id: opt_usize("bos_token_id")?.map(|t| t as u32),
            eos_token_ids,
        };
        cfg.validate(file)?;
        Ok(cfg)
    }

    /// `builtin:tiny`: about 3 M parameters; runs anywhere in milliseconds.
    pub fn builtin_tiny() -> Self {
        Self::builtin(256, 688, 4, 8, 4)
    }

    /// `builtin:small`: about 100 M parameters (16 layers of width 768).
    pub fn builtin_small() -> Self {
        Self::builtin(768, 2048, 16, 12, 4)
    }

    fn builtin(hidden: usize, inter: usize, layers: usize, heads: usize, kv_heads: usize) -> Self {
        Self {
            hidden_size: hidden,
            intermediate_size: inter,
            vocab_size: crate::tokenizer::BYTE_VOCAB,
            num_hidden_layers: layers,
            num_attention_heads: heads,
            num_key_value_heads: kv_heads,
            rms_norm_eps: 1e-5,
            rope_theta: 10_000.0,
            rope_scaling: None,
            max_position_embeddings: 32_768,
            tie_word_embeddings: false,
            bos_token_id: Some(crate::tokenizer::BYTE_BOS),
            eos_token_ids: vec![crate::tokenizer::BYTE_EOS],
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn base() -> serde_json::Map<String, Value> {
        serde_json::json!({
            "architectures": ["LlamaForCausalLM"], "model_type": "llama",
            "hidden_size": 64, "intermediate_size": 128, "vocab_size": 300,
            "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
            "rms_norm_eps": 1e-5, "max_position_embeddings": 1024, "eos_token_id": [1, 2]
        })
        .as_object()
        .unwrap()
        .clone()
    }

    fn parse(m: &serde_json::Map<String, Value>) -> Result<ModelConfig, EngineError> {
        ModelConfig::from_hf_json(
            &Value::Object(m.clone()).to_string(),
            Path::new("m/config.json"),
        )
    }

    #[test]
    fn parses_a_llama_config() {
        let c = parse(&base()).unwrap();
        assert_eq!(c.head_dim(), 16);
        assert_eq!(c.kv_groups(), 2);
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        assert_eq!(c.rope_theta, 10_000.0);
    }

    #[test]
    fn errors_name_the_file_and_field() {
        let cases: Vec<(&str, Value, &str)> = vec![
            (
                "architectures",
                serde_json::json!(["MistralForCausalLM"]),
                "architectures",
            ),
            ("model_type", serde_json::json!("gpt2"), "model_type"),
            ("hidden_act", serde_json::json!("gelu"), "hidden_act"),
            ("attention_bias", serde_json::json!(true), "attention_bias"),
            (
                "num_key_value_heads",
                serde_json::json!(3),
                "num_key_value_heads",
            ),
            (
                "rope_scaling",
                serde_json::json!({"rope_type": "yarn"}),
                "rope_scaling.rope_type",
            ),
            ("head_dim", serde_json::json!(8), "head_dim"),
        ];
        for (key, value, field) in cases {
            let mut m = base();
            m.insert(key.into(), value);
            let e = parse(&m).unwrap_err().to_string();
            assert!(
                e.starts_with(&format!("m/config.json: {field}:")),
                "{key}: {e}"
            );
        }
        let mut m = base();
        m.remove("hidden_size");
        let e = parse(&m).unwrap_err().to_string();
        assert_eq!(e, "m/config.json: hidden_size: missing");
    }

    #[test]
    fn builtin_small_has_about_100m_parameters() {
        let p = ModelConfig::builtin_small().parameters();
        assert!((90_000_000..=110_000_000).contains(&p), "{p}");
        ModelConfig::builtin_small()
            .validate(Path::new("builtin:small"))
            .unwrap();
        ModelConfig::builtin_tiny()
            .validate(Path::new("builtin:tiny"))
            .unwrap();
    }
}
