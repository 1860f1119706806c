//! The independent oracle: for one safetensors file, the logits of our
//! decoder (loaded through the real folder loader, run in the engine's
//! chunk-aligned prefill pieces, then decode steps over its own KV) equal
//! Hugging Face transformers' `LlamaForCausalLM` (tests/hf_llama.py, run by
//! the Python in `KVPOOL_PYTHON`, else `python3`) within 1e-4, for prompts of
//! 1, 255, 256, 257 and 700 tokens. Without torch and transformers the tests
//! print `skip:` and pass, or fail under `KVPOOL_REQUIRE_EXTERNAL=1` (CI).

use std::collections::HashMap;
use std::io::Write;
use std::path::Path;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use kvpool_engine::kv::{KvLayout, SeqKv};
use kvpool_engine::model::{Llama, Step};
use rand::{Rng, SeedableRng};

const CHUNK: usize = 256;
const TOLERANCE: f32 = 1e-4;
/// transformers' import and both runs take seconds; this is a hang.
const PYTHON_DEADLINE: Duration = Duration::from_secs(300);

/// A minimal word-level tokenizer.json (the oracle feeds token ids).
const TOKENIZER_JSON: &str = r#"{"version":"1.0","truncation":null,"padding":null,"added_tokens":[],
"normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
"model":{"type":"WordLevel","vocab":{"[UNK]":0,"hello":1,"world":2},"unk_token":"[UNK]"}}"#;

fn write_folder(dir: &Path, config: &serde_json::Value, seed: u64) {
    std::fs::create_dir_all(dir).unwrap();
    std::fs::write(dir.join("config.json"), config.to_string()).unwrap();
    std::fs::write(dir.join("tokenizer.json"), TOKENIZER_JSON).unwrap();
    let g = |k: &str| config[k].as_u64().unwrap() as usize;
    let (h, i, v, layers) = (
        g("hidden_size"),
        g("intermediate_size"),
        g("vocab_size"),
        g("num_hidden_layers"),
    );
    let kv = g("num_key_value_heads") * h / g("num_attention_heads");
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mut tensors: HashMap<String, Tensor> = HashMap::new();
    let mut add = |name: String, shape: Vec<usize>, std: f32| {
        let n: usize = shape.iter().product();
        let data: Vec<f32> = if std == 0.0 {
            (0..n).map(|_| rng.random_range(0.5f32..1.5)).collect()
        } else {
            let a = std * 3f32.sqrt();
            (0..n).map(|_| rng.random_range(-a..a)).collect()
        };
        tensors.insert(name, Tensor::from_vec(data, shape, &Device::Cpu).unwrap());
    };
    let s = |fan: usize| 1.0 / (fan as f32).sqrt();
    add("model.embed_tokens.weight".into(), vec![v, h], 1.0);
    for l in 0..layers {
        let p = format!("model.layers.{l}");
        add(format!("{p}.self_attn.q_proj.weight"), vec![h, h], s(h));
        add(format!("{p}.self_attn.k_proj.weight"), vec![kv, h], s(h));
        add(format!("{p}.self_attn.v_proj.weight"), vec![kv, h], s(h));
        add(format!("{p}.self_attn.o_proj.weight"), vec![h, h], s(h));
        add(format!("{p}.mlp.gate_proj.weight"), vec![i, h], s(h));
        add(format!("{p}.mlp.up_proj.weight"), vec![i, h], s(h));
        add(format!("{p}.mlp.down_proj.weight"), vec![h, i], s(i));
        add(format!("{p}.input_layernorm.weight"), vec![h], 0.0);
        add(format!("{p}.post_attention_layernorm.weight"), vec![h], 0.0);
    }
    add("model.norm.weight".into(), vec![h], 0.0);
    if !config["tie_word_embeddings"].as_bool().unwrap_or(false) {
        add("lm_head.weight".into(), vec![v, h], s(h));
    }
    candle_core::safetensors::save(&tensors, dir.join("model.safetensors")).unwrap();
}

/// Largest |a - b|; NaN if any difference is NaN (f32::max would skip it,
/// and NaN logits on either side would then pass as equal).
fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, |m, d| if d.is_nan() || d > m { d } else { m })
}

/// Prefill in the engine's chunk-aligned pieces, then `decode` greedy steps;
/// returns the logits after the prompt and after each decode step.
fn ours(model: &Llama, prompt: &[u32], decode: usize) -> Vec<Vec<f32>> {
    let c = model.config();
    let layout = KvLayout {
        chunk_tokens: CHUNK,
        layers: c.num_hidden_layers,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim(),
        fingerprint: 0,
        group_layers: c.num_hidden_layers,
    };
    let mut kv = SeqKv::new(layout);
    let mut out = Vec::new();
    let mut pos = 0;
    while pos < prompt.len() {
        let end = ((pos / CHUNK + 1) * CHUNK).min(prompt.len());
        let last = end == prompt.len();
        let mut steps = [Step {
            tokens: &prompt[pos..end],
            kv: &mut kv,
            want_logits: last,
        }];
        let logits = model.forward(&mut steps).unwrap();
        if last {
            out.push(logits.into_iter().next().unwrap());
        }
        pos = end;
    }
    for _ in 0..decode {
        let next = Llama::argmax(out.last().unwrap());
        let mut steps = [Step {
            tokens: &[next],
            kv: &mut kv,
            want_logits: true,
        }];
        out.push(
            model
                .forward(&mut steps)
                .unwrap()
                .into_iter()
                .next()
                .unwrap(),
        );
    }
    out
}

/// A Python with torch and transformers, or `None` after a skip line
/// (a failure under `KVPOOL_REQUIRE_EXTERNAL=1`).
fn python_with_transformers() -> Option<String> {
    let py = std::env::var("KVPOOL_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import torch, transformers"])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return Some(py);
    }
    let what = format!("python with the torch and transformers packages ({py}) not found");
    if std::env::var("KVPOOL_REQUIRE_EXTERNAL").as_deref() == Ok("1") {
        panic!("{what}, and KVPOOL_REQUIRE_EXTERNAL=1 requires it");
    }
    eprintln!("skip: {what}");
    None
}

/// transformers' logits for each prompt: after the prompt, then after each
/// of `decode` greedy steps.
fn theirs(py: &str, dir: &Path, prompts: &[Vec<u32>], decode: usize) -> Vec<Vec<Vec<f32>>> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/hf_llama.py");
    let mut child = Command::new(py)
        .arg(&script)
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .stderr(Stdio::inherit())
        .spawn()
        .unwrap();
    let req = serde_json::json!({"folder": dir, "prompts": prompts, "decode": decode});
    child
        .stdin
        .take()
        .unwrap()
        .write_all(req.to_string().as_bytes())
        .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let reader = std::thread::spawn(move || {
        let mut b = Vec::new();
        std::io::Read::read_to_end(&mut stdout, &mut b).map(|_| b)
    });
    let deadline = Instant::now() + PYTHON_DEADLINE;
    let status = loop {
        if let Some(s) = child.try_wait().unwrap() {
            break s;
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            panic!("{} ran past {PYTHON_DEADLINE:?}", script.display());
        }
        std::thread::sleep(Duration::from_millis(50));
    };
    assert!(status.success(), "{} failed: {status}", script.display());
    serde_json::from_slice(&reader.join().unwrap().unwrap()).unwrap()
}

fn check(config: serde_json::Value, seed: u64, tag: &str) {
    let Some(py) = python_with_transformers() else {
        return;
    };
    let dir = std::env::temp_dir().join(format!("kvpool-oracle-{tag}-{}", std::process::id()));
    write_folder(&dir, &config, seed);
    let loaded = kvpool_engine::loader::load(dir.to_str().unwrap()).unwrap();
    let vocab = config["vocab_size"].as_u64().unwrap() as u32;
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed ^ 0xabcdef);
    let prompts: Vec<Vec<u32>> = [1usize, 255, 256, 257, 700]
        .iter()
        .map(|&len| (0..len).map(|_| rng.random_range(0..vocab)).collect())
        .collect();
    let reference = theirs(&py, &dir, &prompts, 3);
    assert_eq!(reference.len(), prompts.len());
    for (prompt, b) in prompts.iter().zip(&reference) {
        let a = ours(&loaded.model, prompt, 3);
        assert_eq!(
            (a.len(), b.len()),
            (4, 4),
            "prompt logits and three decode steps"
        );
        for (step, (x, y)) in a.iter().zip(b).enumerate() {
            let d = max_diff(x, y);
            assert!(
                d <= TOLERANCE,
                "{tag}: prompt of {} tokens, step {step}: max |ours - transformers| = {d}",
                prompt.len()
            );
        }
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

fn base_config() -> serde_json::Value {
    serde_json::json!({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_act": "silu",
        "hidden_size": 64, "intermediate_size": 176, "vocab_size": 300,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "rms_norm_eps": 1e-5, "rope_theta": 10000.0, "max_position_embeddings": 1024,
        "tie_word_embeddings": false, "bos_token_id": 1, "eos_token_id": 2
    })
}

#[test]
fn logits_equal_transformers_llama_gqa_untied() {
    check(base_config(), 1, "gqa");
}

#[test]
fn logits_equal_transformers_llama3_rope_scaling_tied() {
    let mut c = base_config();
    c["tie_word_embeddings"] = true.into();
    c["num_key_value_heads"] = 1.into();
    c["rope_theta"] = 500000.0.into();
    c["rope_scaling"] = serde_json::json!({
        "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 128
    });
    check(c, 2, "llama3");
}
