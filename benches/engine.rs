//! Engine bench: prefill and decode tokens/s of builtin:tiny and
//! builtin:small; time to first token with 0%, 50% and 100% of the prompt's
//! chunks in the pool; and the crossover, the prefix length above which
//! loading a prefix's KV from the pool beats recomputing it on this CPU.
//!
//! The model runs in this process (the engine's own decoder and KV blocks);
//! the pool is a `kvpool run --role all` process reached over loopback TCP
//! (`client.transport = "tcp"`), read through the engine's import path (one
//! batch exists, one batch get into the KV blocks, header and checksum
//! checked). TTFT = that load + the prefill of the rest + the first token.
//! Cases alternate within each round; figures are medians over rounds.
//!
//!     cargo bench --bench engine              # full run (several minutes)
//!     cargo test --release --bench engine     # small run (part of the suite)

mod support;

use std::sync::Arc;
use std::time::Instant;

use kvpool_client::Client;
use kvpool_config::{ClientConfig, Transport};
use kvpool_engine::kv::{block_bytes, KvLayout, SeqKv};
use kvpool_engine::loader::{load, LoadedModel};
use kvpool_engine::metrics::EngineMetrics;
use kvpool_engine::model::{Llama, Step};
use kvpool_engine::pool::KvPool;
use kvpool_runtime::chunk_hash::chunk_hashes;
use kvpool_runtime::metrics::MetricsRegistry;
use kvpool_wire::proto::PutOptions;

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

fn prompt(n: usize, seed: u32) -> Vec<u32> {
    let mut x = seed.wrapping_mul(2_654_435_761) | 1;
    (0..n)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 17;
            x ^= x << 5;
            x % 256
        })
        .collect()
}

fn layout(m: &LoadedModel, chunk_tokens: usize) -> KvLayout {
    let c = m.model.config();
    KvLayout {
        chunk_tokens,
        layers: c.num_hidden_layers,
        kv_heads: c.num_key_value_heads,
        head_dim: c.head_dim(),
        fingerprint: m.fingerprint,
        group_layers: c.num_hidden_layers,
    }
}

/// Prefill from `kv.len()` to the end of `prompt` in chunk-aligned pieces
/// (as the engine's scheduler does); returns the first generated token.
fn prefill(model: &Llama, kv: &mut SeqKv, prompt: &[u32]) -> u32 {
    let chunk = kv.layout().chunk_tokens;
    let mut logits = Vec::new();
    while kv.len() < prompt.len() {
        let pos = kv.len();
        let end = ((pos / chunk + 1) * chunk).min(prompt.len());
        let last = end == prompt.len();
        let mut steps = [Step {
            tokens: &prompt[pos..end],
            kv,
            want_logits: last,
        }];
        logits = model.forward(&mut steps).expect("forward");
    }
    Llama::argmax(&logits[0])
}

struct Pool {
    _node: support::Node,
    client: Client,
    kv: KvPool,
    rt: tokio::runtime::Runtime,
}

impl Pool {
    fn start() -> Self {
        let node = support::start(
            "all",
            &[
                "--listen",
                "127.0.0.1:0",
                "--http",
                "127.0.0.1:0",
                "--segment-size",
                "1GiB",
            ],
        );
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(1)
            .enable_all()
            .build()
            .expect("runtime");
        let cfg = ClientConfig {
            transport: Transport::Tcp,
            ..ClientConfig::default()
        };
        let client = rt
            .block_on(Client::connect(&node.addr, cfg))
            .expect("connect");
        let metrics = EngineMetrics::new(&MetricsRegistry::new());
        let kv = KvPool::new(client.clone(), node.addr.clone(), metrics);
        Self {
            _node: node,
            client,
            kv,
            rt,
        }
    }

    /// Computes `prompt`'s KV and stores its full chunks in the pool.
    fn store(&self, model: &Llama, layout: KvLayout, prompt: &[u32]) {
        let mut kv = SeqKv::new(layout);
        prefill(model, &mut kv, prompt);
        let hashes = chunk_hashes(prompt, layout.chunk_tokens).expect("hashes");
        let items: Vec<(String, Arc<[f32]>)> = hashes
            .iter()
            .enumerate()
            .flat_map(|(i, h)| {
                let segs = kv.seal_chunk(i, *h);
                segs.into_iter()
                    .enumerate()
                    .map(|(g, s)| (layout.group_key(*h, g), s))
                    .collect::<Vec<_>>()
            })
            .collect();
        let refs: Vec<(&[u8], &[u8])> = items
            .iter()
            .map(|(k, b)| (k.as_bytes(), block_bytes(b)))
            .collect();
        for r in self
            .rt
            .block_on(self.client.batch_put(&refs, &PutOptions::default()))
            .expect("batch put")
        {
            match r {
                Ok(()) => {}
                Err(e) if e.code == kvpool_wire::ErrorCode::ObjectAlreadyExists => {}
                Err(e) => panic!("put: {e}"),
            }
        }
    }

    /// TTFT of `prompt` with its first `chunks` chunks loaded from the pool.
    fn ttft(&self, model: &Llama, layout: KvLayout, prompt: &[u32], chunks: usize) -> f64 {
        let t0 = Instant::now();
        let hashes = chunk_hashes(prompt, layout.chunk_tokens).expect("hashes");
        let loaded = self
            .rt
            .block_on(self.kv.load_prefix(&layout, &hashes[..chunks], true));
        assert_eq!(
            loaded.chunks, chunks,
            "every chunk asked for is in the pool"
        );
        let mut kv = SeqKv::with_loaded(layout, loaded.segs);
        prefill(model, &mut kv, prompt);
        t0.elapsed().as_secs_f64()
    }
}

fn throughput(name: &str, full: bool) {
    let t0 = Instant::now();
    let m = load(name).expect("model");
    let load_s = t0.elapsed().as_secs_f64();
    let l = layout(&m, 256);
    let (prefill_len, rounds, decode_steps) = if full { (1024, 5, 32) } else { (256, 1, 4) };
    let p = prompt(prefill_len, 1);
    let mut pre = Vec::new();
    for _ in 0..rounds {
        let mut kv = SeqKv::new(l);
        let t = Instant::now();
        prefill(&m.model, &mut kv, &p);
        pre.push(prefill_len as f64 / t.elapsed().as_secs_f64());
    }
    let mut row = format!(
        "{name:<14} {:>6.1}M params  load {load_s:>5.2} s  prefill({prefill_len}) {:>8.0} tok/s",
        m.model.config().parameters() as f64 / 1e6,
        median(pre)
    );
    for batch in [1usize, 8] {
        let mut kvs: Vec<SeqKv> = (0..batch).map(|_| SeqKv::new(l)).collect();
        let mut next: Vec<u32> = kvs
            .iter_mut()
            .enumerate()
            .map(|(i, kv)| prefill(&m.model, kv, &prompt(256, 10 + i as u32)))
            .collect();
        let mut rates = Vec::new();
        for _ in 0..rounds {
            let t = Instant::now();
            for _ in 0..decode_steps {
                let toks: Vec<[u32; 1]> = next.iter().map(|&t| [t]).collect();
                let mut steps: Vec<Step<'_>> = kvs
                    .iter_mut()
                    .zip(&toks)
                    .map(|(kv, t)| Step {
                        tokens: t,
                        kv,
                        want_logits: true,
                    })
                    .collect();
                let logits = m.model.forward(&mut steps).expect("decode");
                next = logits.iter().map(|l| Llama::argmax(l)).collect();
            }
            rates.push((batch * decode_steps) as f64 / t.elapsed().as_secs_f64());
        }
        row.push_str(&format!(
            "  decode(batch {batch}) {:>7.0} tok/s",
            median(rates)
        ));
    }
    println!("{row}");
}

pub fn main() {
    let full = support::full_mode();
    println!(
        "kvpool engine bench ({} mode)\nmachine: {}",
        if full { "full" } else { "small" },
        support::machine()
    );

    println!("\n# throughput (context 256 for decode; medians)");
    throughput("builtin:tiny", full);
    throughput("builtin:small", full);

    let pool = Pool::start();
    println!("\n# TTFT, ms (median of rounds; the cases alternate within a round)");
    println!(
        "{:<14} {:>7} {:>10} {:>10} {:>10}",
        "model", "tokens", "0%", "50%", "100%"
    );
    let cases: Vec<(&str, Vec<usize>, usize)> = if full {
        vec![
            ("builtin:tiny", vec![1024, 4096, 16384], 3),
            ("builtin:small", vec![1024], 3),
        ]
    } else {
        vec![("builtin:tiny", vec![1024], 1)]
    };
    for (name, lens, rounds) in cases {
        let m = load(name).expect("model");
        let l = layout(&m, 256);
        for len in lens {
            let p = prompt(len, len as u32);
            pool.store(&m.model, l, &p);
            // 100%: every chunk but the one holding the last token (its
            // logits start the generation), as the engine loads.
            let all = (len - 1) / 256;
            let fractions = [0, all / 2, all];
            let mut t: Vec<Vec<f64>> = vec![Vec::new(); 3];
            for r in 0..rounds {
                for k in 0..3 {
                    let k = (k + r) % 3;
                    t[k].push(pool.ttft(&m.model, l, &p, fractions[k]));
                }
            }
            let ms: Vec<f64> = t.into_iter().map(|v| median(v) * 1e3).collect();
            println!(
                "{name:<14} {len:>7} {:>10.1} {:>10.1} {:>10.1}   (chunks loaded: 0 / {} / {})",
                ms[0], ms[1], ms[2], fractions[1], fractions[2]
            );
        }
    }

    // Crossover: a prefix of L tokens held as one chunk object: recompute it
    // (prefill of L tokens) vs load it (batch exists + batch get + verify).
    println!("\n# crossover: recompute vs load a prefix of L tokens (one object), ms");
    println!(
        "{:<14} {:>6} {:>10} {:>10} {:>10} {:>8}",
        "model", "L", "KV bytes", "compute", "load", "load/cmp"
    );
    let (lens, rounds): (Vec<usize>, usize) = if full {
        (vec![4, 8, 16, 32, 64, 128, 256, 512, 1024], 7)
    } else {
        (vec![16, 256], 3)
    };
    for name in ["builtin:tiny", "builtin:small"] {
        let m = load(name).expect("model");
        let mut crossover = None;
        for &len in &lens {
            let l = layout(&m, len);
            // One more token than the prefix so the chunk is full.
            let p = prompt(len + 1, 99 + len as u32);
            pool.store(&m.model, l, &p);
            let hashes = chunk_hashes(&p, len).expect("hashes");
            let (mut comp, mut ld) = (Vec::new(), Vec::new());
            for r in 0..rounds {
                for k in 0..2 {
                    if (k + r) % 2 == 0 {
                        let mut kv = SeqKv::new(l);
                        let t = Instant::now();
                        prefill(&m.model, &mut kv, &p[..len]);
                        comp.push(t.elapsed().as_secs_f64());
                    } else {
                        let t = Instant::now();
                        let got = pool
                            .rt
                            .block_on(pool.kv.load_prefix(&l, &hashes[..1], true));
                        ld.push(t.elapsed().as_secs_f64());
                        assert_eq!(got.chunks, 1);
                    }
                }
            }
            let (c, d) = (median(comp) * 1e3, median(ld) * 1e3);
            if d < c && crossover.is_none() {
                crossover = Some(len);
            } else if d >= c {
                crossover = None;
            }
            println!(
                "{name:<14} {len:>6} {:>10} {c:>10.3} {d:>10.3} {:>8.2}",
                l.chunk_bytes(),
                d / c
            );
        }
        match crossover {
            Some(l) if l == lens[0] => {
                println!("{name}: loading wins at every length measured (from {l} tokens)")
            }
            Some(l) => println!("{name}: loading wins from {l} tokens on"),
            None => println!("{name}: recomputing wins at the longest length measured"),
        }
    }
}
