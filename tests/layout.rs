//! The dependency direction the crate map promises (docs/ARCHITECTURE.md):
//! an embedder of the client crate links neither the master, nor an HTTP
//! server, nor plotting. Checked on the real dependency graph (`cargo tree`),
//! so a feature switched on by mistake fails here, not in a user's build.

use std::process::Command;

#[test]
fn the_client_crate_links_no_master_http_server_or_plotting() {
    let out = Command::new(env!("CARGO"))
        .args([
            "tree",
            "-p",
            "kvpool-client",
            "-e",
            "normal",
            "--prefix",
            "none",
        ])
        .current_dir(env!("CARGO_MANIFEST_DIR"))
        .output()
        .expect("cargo tree runs");
    assert!(
        out.status.success(),
        "cargo tree failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    let tree = String::from_utf8_lossy(&out.stdout);
    let crates: Vec<&str> = tree
        .lines()
        .filter_map(|l| l.split_whitespace().next())
        .collect();
    assert!(crates.contains(&"kvpool-client"), "no client in:\n{tree}");
    for banned in ["kvpool-master", "axum", "hyper", "hyper-util", "plotters"] {
        assert!(
            !crates.contains(&banned),
            "the client crate depends on {banned}:\n{tree}"
        );
    }
}
