//! The fuzz corpus on stable: every file of `fuzz/corpus/<target>/` (the
//! seeds, and every input that once crashed a target) runs through the same
//! target body cargo-fuzz runs (`fuzz/src/lib.rs`), so `cargo test` replays
//! them without nightly. Also checks that the seed corpus holds a valid
//! encoding of every request type.

// The fuzz crate's library, compiled here on stable: this test replays the
// corpus through some of its entry points; the others serve only the
// cargo-fuzz targets.
#[allow(dead_code)]
#[path = "../fuzz/src/lib.rs"]
mod fuzz;

use std::path::{Path, PathBuf};

use kvpool_wire::frame;
use kvpool_wire::proto::{DataRequest, MasterRequest};

fn repo() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn corpus(target: &str) -> PathBuf {
    repo().join("fuzz/corpus").join(target)
}

#[test]
fn every_corpus_file_runs_through_its_target_without_a_panic() {
    let mut ran = 0;
    for target in fuzz::TARGETS {
        let mut files: Vec<PathBuf> = std::fs::read_dir(corpus(target))
            .unwrap_or_else(|e| panic!("fuzz/corpus/{target}: {e}"))
            .map(|e| e.unwrap().path())
            .collect();
        files.sort();
        assert!(!files.is_empty(), "fuzz/corpus/{target} is empty");
        for f in files {
            let bytes = std::fs::read(&f).unwrap();
            let r = std::panic::catch_unwind(|| fuzz::run(target, &bytes));
            assert!(r.is_ok(), "{} panicked in target {target}", f.display());
            ran += 1;
        }
    }
    eprintln!("{ran} corpus files replayed");
}

/// With `KVPOOL_WRITE_FUZZ_SEEDS=1` the seeds are (re)written first.
#[test]
fn the_seed_corpus_is_current_and_holds_every_request_type() {
    let write = std::env::var_os("KVPOOL_WRITE_FUZZ_SEEDS").is_some();
    for s in fuzz::seeds(&repo()) {
        let path = corpus(s.target).join(&s.name);
        if write {
            std::fs::create_dir_all(path.parent().unwrap()).unwrap();
            std::fs::write(&path, &s.bytes).unwrap();
        }
        let kept = std::fs::read(&path).unwrap_or_else(|e| {
            panic!(
                "{} missing ({e}): KVPOOL_WRITE_FUZZ_SEEDS=1 cargo test --release --test suite fuzz_corpus::",
                path.display()
            )
        });
        assert_eq!(
            kept,
            s.bytes,
            "{} is stale: KVPOOL_WRITE_FUZZ_SEEDS=1 cargo test --release --test suite fuzz_corpus::",
            path.display()
        );
    }
    // Every master request variant decodes from some corpus file.
    let mut seen = [false; fuzz::MASTER_VARIANTS];
    for q in fuzz::master_request_seeds() {
        seen[fuzz::master_variant(&q)] = true;
    }
    assert!(
        seen.iter().all(|s| *s),
        "a MasterRequest variant has no seed"
    );
    let masters = variants::<MasterRequest>(
        "master_request",
        fuzz::MASTER_VARIANTS,
        fuzz::master_variant,
    );
    assert!(
        masters.iter().all(|s| *s),
        "the corpus lacks a master request: {masters:?}"
    );
    let datas = variants::<DataRequest>("data_request", fuzz::DATA_VARIANTS, fuzz::data_variant);
    assert!(
        datas.iter().all(|s| *s),
        "the corpus lacks a data request: {datas:?}"
    );
}

/// Which of a request type's `n` variants some file of `target`'s corpus decodes to.
fn variants<T: frame::Payload>(target: &str, n: usize, variant: fn(&T) -> usize) -> Vec<bool> {
    let mut seen = vec![false; n];
    for f in files(&corpus(target)) {
        if let Ok(q) = decode::<T>(&std::fs::read(f).unwrap()) {
            seen[variant(&q)] = true;
        }
    }
    seen
}

fn files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect()
}

fn decode<T: frame::Payload>(b: &[u8]) -> Result<T, frame::FrameError> {
    let mut v = frame::AlignedVec::with_capacity(b.len());
    v.extend_from_slice(b);
    frame::decode(&v)
}
