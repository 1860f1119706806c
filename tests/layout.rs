//! The dependency direction the crate map promises (docs/ARCHITECTURE.md):
//! an embedder of the client crate links neither the master, nor an HTTP
//! server, nor plotting. Checked on the real dependency graph (`cargo tree`),
//! so a feature switched on by mistake fails here, not in a user's build.

use std::process::Command;

/// `cargo tree <args> --prefix none`: one crate a line.
fn cargo_tree(args: &[&str]) -> String {
    let out = Command::new(env!("CARGO"))
        .arg("tree")
        .args(args)
        .args(["--prefix", "none"])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// The crate names of a [`cargo_tree`] listing.
fn names(tree: &str) -> Vec<&str> {
    tree.lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect()
}

#[test]
fn the_client_crate_links_no_master_http_server_or_plotting() {
    let tree = cargo_tree(&["-p", "kvpool-client", "-e", "normal"]);
    let crates = names(&tree);
    assert!(crates.contains(&"kvpool-client"), "no client in:\n{tree}");
    for banned in ["kvpool-master", "axum", "hyper", "hyper-util", "plotters"] {
        assert!(
            !crates.contains(&banned),
            "the client crate depends on {banned}:\n{tree}"
        );
    }
}

/// A fresh machine with only Rust and a C compiler builds the workspace
/// (issue 27): no crate of it build-depends on a protobuf code generator,
/// whose build scripts need an external `protoc`.
#[test]
fn no_crate_needs_protoc_at_build_time() {
    let tree = cargo_tree(&["--workspace", "-e", "normal,build,dev"]);
    let crates = names(&tree);
    assert!(crates.contains(&"kvpool-ha"), "no kvpool-ha in:\n{tree}");
    for banned in [
        "prost-build",
        "tonic-build",
        "tonic-prost-build",
        "protoc-bin-vendored",
    ] {
        assert!(
            !crates.contains(&banned),
            "{banned} is in the build graph: its build script needs protoc"
        );
    }
}

/// Simulators, generators, plots and bench drivers are tools (`tools/`):
/// no role's crate links plotting or progress bars (issue 32). Only the
/// binary, which has `kvpool sim` and `kvpool bench serve`, links
/// `kvpool-sim`.
#[test]
fn no_role_crate_links_the_tools_plotting_or_progress_bars() {
    for krate in [
        "kvpool-master",
        "kvpool-storage-node",
        "kvpool-conductor",
        "kvpool-serving",
        "kvpool-resp",
        "kvpool-node",
        "kvpool-ha",
        "kvpool-engine",
        "kvpool-client",
    ] {
        let tree = cargo_tree(&["-p", krate, "-e", "normal"]);
        let crates = names(&tree);
        assert!(crates.contains(&krate), "no {krate} in:\n{tree}");
        for banned in ["plotters", "indicatif", "kvpool-sim", "kvpool-cluster-sim"] {
            assert!(
                !crates.contains(&banned),
                "{krate} depends on {banned}:\n{tree}"
            );
        }
    }
}

/// The master, the configuration, HA, the RESP front, the serving path and
/// the engine speak the wire protocol (`kvpool-wire`) and move no bytes
/// themselves: none of them links the transfer engine (`kvpool-transport`)
/// but through the client, and the master not at all (docs/ARCHITECTURE.md,
/// "The wire protocol and the transfer engine are two crates").
#[test]
fn the_master_and_the_fronts_link_the_protocol_not_the_transfer_engine() {
    for krate in ["kvpool-master", "kvpool-config", "kvpool-wire"] {
        let tree = cargo_tree(&["-p", krate, "-e", "normal"]);
        let crates = names(&tree);
        assert!(
            crates.contains(&"kvpool-wire"),
            "no kvpool-wire in:\n{tree}"
        );
        for banned in ["kvpool-transport", "kvpool-client", "ibverbs-sys"] {
            assert!(
                !crates.contains(&banned),
                "{krate} depends on {banned}:\n{tree}"
            );
        }
    }
    // The others reach the engine only through the client, which moves
    // their bytes: their own tree's first level names no transfer engine.
    for krate in [
        "kvpool-ha",
        "kvpool-resp",
        "kvpool-serving",
        "kvpool-engine",
    ] {
        let tree = cargo_tree(&["-p", krate, "-e", "normal", "--depth", "1"]);
        let crates = names(&tree);
        assert!(
            crates.contains(&"kvpool-wire"),
            "no kvpool-wire in:\n{tree}"
        );
        assert!(
            !crates.contains(&"kvpool-transport"),
            "{krate} depends on kvpool-transport itself:\n{tree}"
        );
    }
}

/// Every crate of the Python wheel's build (`maturin build --features abi3`,
/// which resolves features for `kvpool-python` alone), with its features,
/// as `cargo tree` lists it: `name vX.Y.Z [f1,f2]`.
fn feature_lines(args: &[&str]) -> std::collections::BTreeSet<String> {
    cargo_tree(&[args, &["-f", "{p} [{f}]"]].concat())
        .lines()
        .map(|l| {
            l.replace(" (*)", "")
                .replace(" (proc-macro)", "")
                .trim()
                .to_owned()
        })
        .filter(|l| !l.is_empty())
        .collect()
}

/// The wheel's build asks for the builds `cargo test --release --workspace`
/// made: the same crates with the same features, but for the module and
/// PyO3. A crate whose features differ is compiled again, with everything
/// above it; before `kvpool-python`'s `share-workspace-build` feature that
/// was 80 crates and ~3 minutes of CI on 2 cores (docs/ARCHITECTURE.md,
/// "Where CI's time goes").
#[test]
fn the_wheel_build_reuses_the_workspace_build() {
    let workspace = feature_lines(&["--workspace", "-e", "normal,build,dev"]);
    let wheel = feature_lines(&[
        "-p",
        "kvpool-python",
        "--features",
        "abi3",
        "-e",
        "normal,build",
    ]);
    assert!(
        wheel.iter().any(|l| l.starts_with("kvpool-client ")),
        "no client in the wheel's tree: {wheel:?}"
    );
    let only_the_wheel = ["kvpool-python ", "pyo3", "libloading ", "target-lexicon "];
    let differ: Vec<&String> = wheel
        .iter()
        .filter(|l| !only_the_wheel.iter().any(|p| l.starts_with(p)))
        .filter(|l| !workspace.contains(*l))
        .collect();
    assert!(
        differ.is_empty(),
        "the wheel's build asks for these crates with other features than the \
         workspace's build, so it compiles them (and all above them) again; give \
         `share-workspace-build` in python/Cargo.toml the workspace's features:\n{}",
        differ
            .iter()
            .map(|l| {
                let name = l.split_whitespace().next().unwrap_or("");
                let ws: Vec<&String> = workspace
                    .iter()
                    .filter(|w| w.split_whitespace().next() == Some(name))
                    .collect();
                format!("  wheel:     {l}\n  workspace: {ws:?}")
            })
            .collect::<Vec<_>>()
            .join("\n")
    );
}

/// The verbs code is a plug-in (docs/architecture/rdma.md, "RDMA as a plug-in"):
/// only the binary and the Python module link `kvpool-rdma`, and turning the
/// `rdma` feature on changes no other crate of the workspace's build, so the
/// `rdma` build compiles `kvpool-rdma`, its verbs bindings and the binary's
/// crate, not the client, the storage node or the fronts again.
#[test]
fn only_the_binary_and_the_python_module_link_the_verbs_code() {
    let users = cargo_tree(&[
        "--workspace",
        "--features",
        "kvpool/rdma,kvpool-python/rdma",
        "-e",
        "normal",
        "-i",
        "kvpool-rdma",
    ]);
    let mut users = names(&users);
    users.sort_unstable();
    users.dedup();
    assert_eq!(
        users,
        ["kvpool", "kvpool-python", "kvpool-rdma"],
        "{users:?}"
    );

    let plain = feature_lines(&["--workspace", "-e", "normal,build,dev"]);
    let rdma = feature_lines(&[
        "--workspace",
        "--features",
        "kvpool/rdma",
        "-e",
        "normal,build,dev",
    ]);
    // What the feature adds (the verbs bindings, their build tools) is new
    // lines; a crate of the plain build whose features changed would be a
    // line of the plain build missing from this one.
    let changed: Vec<&String> = plain
        .iter()
        .filter(|l| !rdma.contains(*l))
        .filter(|l| !l.starts_with("kvpool ") && !l.starts_with("kvpool-rdma "))
        .collect();
    assert!(
        changed.is_empty(),
        "the rdma feature changes these crates' features, so its build compiles \
         them again: {changed:?}"
    );
}

/// Every `.rs` file under `dir`, recursively.
fn rust_files(dir: &std::path::Path, out: &mut Vec<std::path::PathBuf>) {
    for e in std::fs::read_dir(dir).unwrap().flatten() {
        let p = e.path();
        if p.is_dir() {
            rust_files(&p, out);
        } else if p.extension().is_some_and(|x| x == "rs") {
            out.push(p);
        }
    }
}

/// `actors/` holds what is an actor (issue 32; docs/ARCHITECTURE.md
/// "Crates"): each crate directly under it defines a ractor actor or is the
/// process that spawns them. The client, the configuration and the RESP
/// front live elsewhere.
#[test]
fn every_crate_under_actors_defines_or_spawns_an_actor() {
    let actors = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("actors");
    let mut crates = 0;
    for e in std::fs::read_dir(&actors).unwrap().flatten() {
        let dir = e.path();
        if !dir.join("Cargo.toml").is_file() {
            continue;
        }
        crates += 1;
        let mut files = Vec::new();
        rust_files(&dir.join("src"), &mut files);
        let actor = files.iter().any(|f| {
            let text = std::fs::read_to_string(f).unwrap();
            text.contains("impl Actor for") || text.contains("Actor::spawn(")
        });
        assert!(
            actor,
            "{} is under actors/ but defines no actor and spawns none",
            dir.display()
        );
    }
    assert!(crates >= 5, "actors/ lost its crates ({crates})");
}

/// The crate table of docs/ARCHITECTURE.md ("Crates") names each workspace
/// crate with the folder it is in, as `cargo metadata` finds it: the map, the
/// build and the folders agree.
#[test]
fn the_crate_table_names_every_crate_in_its_folder() {
    let root = env!("CARGO_MANIFEST_DIR");
    let out = Command::new(env!("CARGO"))
        .args(["metadata", "--no-deps", "--format-version", "1"])
        .current_dir(root)
        .output()
        .expect("cargo metadata runs");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let meta: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let mut built: Vec<(String, String)> = meta["packages"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| {
            let manifest = p["manifest_path"].as_str().unwrap();
            let dir = std::path::Path::new(manifest).parent().unwrap();
            let rel = dir.strip_prefix(root).unwrap().display().to_string();
            let folder = if rel.is_empty() {
                "src/".into()
            } else {
                format!("{rel}/")
            };
            (p["name"].as_str().unwrap().to_string(), folder)
        })
        .collect();
    built.sort();
    let doc = std::fs::read_to_string(format!("{root}/docs/ARCHITECTURE.md")).unwrap();
    // Rows of the form | `kvpool-x` | `folder/` | what it does |
    let mut mapped: Vec<(String, String)> = doc
        .lines()
        .filter_map(|l| {
            let cells: Vec<&str> = l.split('|').map(str::trim).collect();
            let name = cells.get(1)?.strip_prefix('`')?.strip_suffix('`')?;
            let folder = cells.get(2)?.strip_prefix('`')?.strip_suffix('`')?;
            (name.starts_with("kvpool") && !name.contains("::"))
                .then(|| (name.to_string(), folder.to_string()))
        })
        .collect();
    mapped.sort();
    assert_eq!(
        mapped, built,
        "docs/ARCHITECTURE.md's crate table (left) against the workspace (right)"
    );
}

/// The names a function or test is defined under in `src` (`fn name`, or
/// `def name` in Python).
fn defined_names(src: &str, out: &mut std::collections::HashSet<String>) {
    for w in src
        .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
        .collect::<Vec<_>>()
        .windows(2)
    {
        if w[0] == "fn" || w[0] == "def" {
            out.insert(w[1].to_string());
        }
    }
}

/// Every test that docs/RELIABILITY.md holds a promise to (a row's last
/// cell: `name`, a function's name of two words or more) is defined in
/// the tree (Rust or Python), so a renamed or deleted test cannot leave a
/// promise without one. That the tests pass is the suite's and CI's.
#[test]
fn every_test_a_reliability_row_names_is_defined() {
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    let mut files = Vec::new();
    for dir in [
        "actors", "client", "configs", "engine", "fronts", "runtime", "storage",
    ] {
        rust_files(&root.join(dir), &mut files);
    }
    for dir in [
        "src",
        "tests",
        "tools",
        "transport",
        "python",
        "fuzz",
        "benches",
    ] {
        rust_files(&root.join(dir), &mut files);
    }
    let mut py = Vec::new();
    let mut stack = vec![root.join("python"), root.join("tests")];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap().flatten() {
            let p = e.path();
            if p.is_dir() {
                stack.push(p);
            } else if p.extension().is_some_and(|x| x == "py") {
                py.push(p);
            }
        }
    }
    let mut defined = std::collections::HashSet::new();
    for f in files.iter().chain(&py) {
        defined_names(
            &std::fs::read_to_string(f).unwrap_or_default(),
            &mut defined,
        );
    }
    let doc = std::fs::read_to_string(root.join("docs/RELIABILITY.md")).unwrap();
    let mut named = 0;
    let mut missing = Vec::new();
    for row in doc.lines().filter(|l| l.starts_with('|')) {
        let last = row
            .trim()
            .trim_end_matches('|')
            .rsplit('|')
            .next()
            .unwrap_or("");
        for (i, part) in last.split('`').enumerate() {
            // Inside backticks, a function's name: lower case, two
            // underscores at least (not a file, a module or a flag).
            let name_like = part
                .chars()
                .all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || c == '_')
                && part.matches('_').count() >= 2;
            if i % 2 == 1 && name_like {
                named += 1;
                if !defined.contains(part) {
                    missing.push(part.to_string());
                }
            }
        }
    }
    assert!(
        named >= 100,
        "RELIABILITY names only {named} tests: the rows were not read"
    );
    assert!(
        missing.is_empty(),
        "RELIABILITY names tests that are not defined: {missing:?}"
    );
}

/// No source file or document grows past 1,500 lines (issue 32: a file that
/// long holds more than one thing; split it by what its parts are about, as
/// docs/ARCHITECTURE.md and docs/BENCHMARKS.md are split into a chapter per
/// subsystem). Counted on what git tracks, so build outputs and virtual
/// environments are not read; data (traces, fuzz seeds) and generated files
/// (Cargo.lock) are neither source nor document.
#[test]
fn no_source_file_or_document_is_over_1500_lines() {
    const MOST: usize = 1_500;
    let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR"));
    if !root.join(".git").exists() {
        eprintln!("skip: not a git checkout, so no list of tracked files");
        return;
    }
    let out = Command::new("git")
        .args(["ls-files", "-z"])
        .current_dir(root)
        .output()
        .expect("git runs in a git checkout");
    assert!(
        out.status.success(),
        "git ls-files failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let kinds = [
        "rs", "py", "pyi", "c", "h", "sh", "toml", "yaml", "yml", "md",
    ];
    let mut long = Vec::new();
    let mut read = 0;
    for name in String::from_utf8_lossy(&out.stdout).split('\0') {
        let path = root.join(name);
        let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
        if !kinds.contains(&ext) {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&path) else {
            continue;
        };
        read += 1;
        let lines = text.lines().count();
        if lines > MOST {
            long.push(format!("{name}: {lines} lines"));
        }
    }
    assert!(read > 100, "only {read} files found: wrong root?");
    assert!(long.is_empty(), "files over {MOST} lines: {long:?}");
}
