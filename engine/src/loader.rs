//! Loading a model: a Hugging Face folder (`config.json`, `model.safetensors`
//! or `model.safetensors.index.json` with its shards, `tokenizer.json`), or a
//! built-in seeded random model (`builtin:tiny`, `builtin:small`) with the
//! byte-level tokenizer.
//!
//! Every load computes the model fingerprint that KV chunk keys and headers
//! carry: xxh3 over the config and, per weight tensor in name order, its
//! name, dtype, shape and bytes. Hashing the bytes (not only names and
//! shapes) keeps two fine-tunes of one architecture from sharing KV; it
//! costs one pass over bytes that are read anyway.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use rand::{Rng, SeedableRng};
use xxhash_rust::xxh3::{xxh3_64, Xxh3};

use crate::error::EngineError;
use crate::model::{Llama, Weights};
use crate::model_config::ModelConfig;
use crate::tokenizer::Tokenizer;

/// A model ready to serve.
pub struct LoadedModel {
    /// The name it is served under (`builtin:tiny`, or the folder's name).
    pub name: String,
    pub model: Llama,
    pub tokenizer: Tokenizer,
    /// Hash of config and weights; names the KV it produces.
    pub fingerprint: u64,
}

impl std::fmt::Debug for LoadedModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoadedModel")
            .field("name", &self.name)
            .field("fingerprint", &format_args!("{:016x}", self.fingerprint))
            .finish()
    }
}

/// Seed of the built-in models' weights.
pub const BUILTIN_SEED: u64 = 0x6b76_706f_6f6c_000e;

/// Loads `spec`: `builtin:tiny`, `builtin:small`, or a folder path.
pub fn load(spec: &str) -> Result<LoadedModel, EngineError> {
    let device = Device::Cpu;
    match spec {
        "builtin:tiny" => builtin(spec, ModelConfig::builtin_tiny(), &device),
        "builtin:small" => builtin(spec, ModelConfig::builtin_small(), &device),
        s if s.starts_with("builtin:") => Err(EngineError::Start(format!(
            "unknown built-in model {s:?}: builtin:tiny or builtin:small"
        ))),
        dir => load_folder(Path::new(dir), &device),
    }
}

/// The tokenizer and context length of `spec` (as [`load`] names models),
/// without its weights: what `kvpool tokenizer` exports.
pub fn tokenizer_of(spec: &str) -> Result<(Tokenizer, usize), EngineError> {
    match spec {
        "builtin:tiny" => Ok((
            Tokenizer::Bytes,
            ModelConfig::builtin_tiny().max_position_embeddings,
        )),
        "builtin:small" => Ok((
            Tokenizer::Bytes,
            ModelConfig::builtin_small().max_position_embeddings,
        )),
        s if s.starts_with("builtin:") => Err(EngineError::Start(format!(
            "unknown built-in model {s:?}: builtin:tiny or builtin:small"
        ))),
        dir => {
            let dir = Path::new(dir);
            let config_file = dir.join("config.json");
            let text = String::from_utf8(read(&config_file)?)
                .map_err(|_| EngineError::model(&config_file, "(file)", "not UTF-8"))?;
            let cfg = ModelConfig::from_hf_json(&text, &config_file)?;
            let tokenizer = Tokenizer::from_file(&dir.join("tokenizer.json"))?;
            Ok((tokenizer, cfg.max_position_embeddings))
        }
    }
}

/// Per-tensor record for the fingerprint.
struct Fingerprint {
    config: String,
    tensors: BTreeMap<String, (String, Vec<usize>, u64)>,
}

impl Fingerprint {
    fn new(cfg: &ModelConfig) -> Self {
        Self {
            config: cfg.canonical(),
            tensors: BTreeMap::new(),
        }
    }

    fn add(&mut self, name: &str, dtype: &str, shape: &[usize], bytes: &[u8]) {
        self.tensors.insert(
            name.to_string(),
            (dtype.to_string(), shape.to_vec(), xxh3_64(bytes)),
        );
    }

    fn finish(&self) -> u64 {
        let mut h = Xxh3::new();
        h.update(b"kvpool-engine model fingerprint v1\n");
        h.update(self.config.as_bytes());
        for (name, (dtype, shape, content)) in &self.tensors {
            h.update(format!("\n{name} {dtype} {shape:?} {content:016x}").as_bytes());
        }
        h.digest()
    }
}

fn builtin(name: &str, cfg: ModelConfig, device: &Device) -> Result<LoadedModel, EngineError> {
    let h = cfg.hidden_size;
    let kv = cfg.num_key_value_heads * cfg.head_dim();
    let i = cfg.intermediate_size;
    // Weights ~ U(-a, a) with std 1/sqrt(fan_in) (embeddings: std 1), so
    // attention and the MLP matter to the output as much as the embedding:
    // a prompt's KV changes what is generated. Norm weights are 1.
    let mut shapes: Vec<(String, Vec<usize>, f32)> = vec![(
        "model.embed_tokens.weight".into(),
        vec![cfg.vocab_size, h],
        1.0,
    )];
    let inv = |fan_in: usize| 1.0 / (fan_in as f32).sqrt();
    for l in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{l}");
        shapes.push((format!("{p}.self_attn.q_proj.weight"), vec![h, h], inv(h)));
        shapes.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h], inv(h)));
        shapes.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h], inv(h)));
        shapes.push((format!("{p}.self_attn.o_proj.weight"), vec![h, h], inv(h)));
        shapes.push((format!("{p}.mlp.gate_proj.weight"), vec![i, h], inv(h)));
        shapes.push((format!("{p}.mlp.up_proj.weight"), vec![i, h], inv(h)));
        shapes.push((format!("{p}.mlp.down_proj.weight"), vec![h, i], inv(i)));
        shapes.push((format!("{p}.input_layernorm.weight"), vec![h], 0.0));
        shapes.push((format!("{p}.post_attention_layernorm.weight"), vec![h], 0.0));
    }
    shapes.push(("model.norm.weight".into(), vec![h], 0.0));
    // An untied head: with tied embeddings of std 1, a token's own
    // embedding dominates its logits and the model only repeats its input.
    shapes.push((
        "lm_head.weight".into(),
        vec![cfg.vocab_size, h],
        4.0 * inv(h),
    ));
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(BUILTIN_SEED);
    let mut fp = Fingerprint::new(&cfg);
    let mut weights = Weights::new();
    let origin = PathBuf::from(name);
    for (tname, shape, std) in shapes {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = if std == 0.0 {
            vec![1.0; n]
        } else {
            let a = std * 3f32.sqrt();
            (0..n).map(|_| rng.random_range(-a..a)).collect()
        };
        fp.add(&tname, "F32", &shape, crate::kv::block_bytes(&data));
        let t = Tensor::from_vec(data, shape, device)?;
        weights.insert(tname, (t, origin.clone()));
    }
    let fingerprint = fp.finish();
    let model = Llama::from_weights(cfg, weights, &origin, device)?;
    Ok(LoadedModel {
        name: name.to_string(),
        model,
        tokenizer: Tokenizer::Bytes,
        fingerprint,
    })
}

fn read(file: &Path) -> Result<Vec<u8>, EngineError> {
    std::fs::read(file).map_err(|e| EngineError::Io {
        file: file.to_path_buf(),
        why: e.to_string(),
    })
}

/// The safetensors files of a folder, and the file a missing tensor is
/// reported against.
fn weight_files(dir: &Path) -> Result<(Vec<PathBuf>, PathBuf), EngineError> {
    let single = dir.join("model.safetensors");
    if single.is_file() {
        return Ok((vec![single.clone()], single));
    }
    let index = dir.join("model.safetensors.index.json");
    if !index.is_file() {
        return Err(EngineError::model(
            &single,
            "(file)",
            "missing, and there is no model.safetensors.index.json either",
        ));
    }
    let text = String::from_utf8(read(&index)?)
        .map_err(|_| EngineError::model(&index, "(file)", "not UTF-8"))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| EngineError::model(&index, "(file)", format!("not valid JSON: {e}")))?;
    let Some(map) = v.get("weight_map").and_then(|m| m.as_object()) else {
        return Err(EngineError::model(
            &index,
            "weight_map",
            "missing or not an object",
        ));
    };
    let mut files: Vec<PathBuf> = Vec::new();
    for (tensor, f) in map {
        let Some(f) = f.as_str() else {
            return Err(EngineError::model(
                &index,
                format!("weight_map.{tensor}"),
                "not a file name",
            ));
        };
        if f.contains('/') || f.contains("..") {
            return Err(EngineError::model(
                &index,
                format!("weight_map.{tensor}"),
                format!("{f:?} is not a file name in the folder"),
            ));
        }
        let p = dir.join(f);
        if !files.contains(&p) {
            files.push(p);
        }
    }
    files.sort();
    Ok((files, index))
}

fn load_folder(dir: &Path, device: &Device) -> Result<LoadedModel, EngineError> {
    if !dir.is_dir() {
        return Err(EngineError::Start(format!(
            "--model {}: not a folder (nor builtin:tiny / builtin:small)",
            dir.display()
        )));
    }
    let config_file = dir.join("config.json");
    if !config_file.is_file() {
        return Err(EngineError::model(&config_file, "(file)", "missing"));
    }
    let text = String::from_utf8(read(&config_file)?)
        .map_err(|_| EngineError::model(&config_file, "(file)", "not UTF-8"))?;
    let cfg = ModelConfig::from_hf_json(&text, &config_file)?;
    let tok_file = dir.join("tokenizer.json");
    if !tok_file.is_file() {
        return Err(EngineError::model(&tok_file, "(file)", "missing"));
    }
    let tokenizer = Tokenizer::from_file(&tok_file)?;
    let (files, missing_in) = weight_files(dir)?;
    let mut fp = Fingerprint::new(&cfg);
    let mut weights = Weights::new();
    for file in &files {
        if !file.is_file() {
            return Err(EngineError::model(
                &missing_in,
                "weight_map",
                format!("names {}, which is missing", file.display()),
            ));
        }
        let bytes = read(file)?;
        let st = safetensors::SafeTensors::deserialize(&bytes).map_err(|e| {
            EngineError::model(file, "(file)", format!("not a safetensors file: {e}"))
        })?;
        for (name, view) in st.tensors() {
            let dtype = match view.dtype() {
                safetensors::Dtype::F32 => DType::F32,
                safetensors::Dtype::BF16 => DType::BF16,
                safetensors::Dtype::F16 => DType::F16,
                other => {
                    // Tensors the model does not use may have any dtype.
                    if is_used(&name) {
                        return Err(EngineError::model(
                            file,
                            &name,
                            format!("dtype {other:?} is not supported (F32, BF16, F16)"),
                        ));
                    }
                    continue;
                }
            };
            fp.add(&name, &format!("{dtype:?}"), view.shape(), view.data());
            let t = Tensor::from_raw_buffer(view.data(), dtype, view.shape(), device)?
                .to_dtype(DType::F32)?;
            if weights.insert(name.clone(), (t, file.clone())).is_some() {
                return Err(EngineError::model(
                    file,
                    &name,
                    "tensor appears in two files",
                ));
            }
        }
    }
    let fingerprint = fp.finish();
    let model = Llama::from_weights(cfg, weights, &missing_in, device)?;
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| dir.display().to_string());
    Ok(LoadedModel {
        name,
        model,
        tokenizer,
        fingerprint,
    })
}

fn is_used(name: &str) -> bool {
    name.starts_with("model.") || name == "lm_head.weight"
}
