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
