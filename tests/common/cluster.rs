//! A master and its storage nodes in one call: the start-up most tests of
//! the pool repeat. Every process runs the real binary on 127.0.0.1 with
//! ephemeral ports and 2 shards; config files go to the cluster's scratch
//! directory; the processes are killed when the `Cluster` drops (nodes
//! first). In config texts, `{dir}` stands for that directory (an NVMe
//! tier's file, say: `path = "{dir}/tier.kvnv"`).
//!
//! ```ignore
//! let c = Cluster::spec("hot-evict")
//!     .master_config("[master]\nshards = 1\n")
//!     .nodes(2, "8MiB")
//!     .start();
//! let client = Client::connect(c.addr(), cfg).await?;
//! ```

use std::cell::Cell;
use std::path::PathBuf;

use super::{ephemeral, scratch_dir, start_env, write_config, Proc};

/// One storage node of a [`ClusterSpec`]: its DRAM segment, an optional
/// config file's text and extra flags.
#[derive(Clone, Debug)]
pub struct Node {
    size: String,
    config: Option<String>,
    args: Vec<String>,
}

impl Node {
    /// A node with a DRAM segment of `size` ("64MiB") and defaults otherwise.
    pub fn new(size: &str) -> Node {
        Node {
            size: size.to_string(),
            config: None,
            args: Vec::new(),
        }
    }

    /// The text of the node's config file (`[storage]`, `[storage.nvme]`...).
    pub fn config(mut self, text: &str) -> Node {
        self.config = Some(text.to_string());
        self
    }

    /// Extra command-line flags (`--resp 127.0.0.1:0`, say).
    pub fn args(mut self, args: &[&str]) -> Node {
        self.args.extend(args.iter().map(|a| a.to_string()));
        self
    }
}

/// What [`ClusterSpec::start`] starts.
#[must_use = "a spec starts nothing until `start`"]
pub struct ClusterSpec {
    name: String,
    master_config: Option<String>,
    nodes: Vec<Node>,
    env: Vec<(String, String)>,
}

impl ClusterSpec {
    /// The text of the master's config file.
    pub fn master_config(mut self, text: &str) -> Self {
        self.master_config = Some(text.to_string());
        self
    }

    /// One more node with a DRAM segment of `size` and defaults otherwise.
    pub fn node(self, size: &str) -> Self {
        self.node_with(Node::new(size))
    }

    /// `n` more nodes with DRAM segments of `size`.
    pub fn nodes(mut self, n: usize, size: &str) -> Self {
        self.nodes.extend((0..n).map(|_| Node::new(size)));
        self
    }

    /// One more node as `node` says.
    pub fn node_with(mut self, node: Node) -> Self {
        self.nodes.push(node);
        self
    }

    /// Environment variables of every process (`KVPOOL_SECRET`, say).
    pub fn env(mut self, env: &[(&str, &str)]) -> Self {
        self.env
            .extend(env.iter().map(|(k, v)| (k.to_string(), v.to_string())));
        self
    }

    /// Starts the master, then each node in order; returns once each has
    /// printed its ready line (a storage node prints it after its segment is
    /// mounted at the master). Panics, with the process's log, on a process
    /// that does not become ready within 30 s.
    pub fn start(self) -> Cluster {
        let dir = scratch_dir(&format!("cluster-{}", self.name));
        let mut args: Vec<String> = Vec::new();
        if let Some(text) = &self.master_config {
            args.push("--config".into());
            args.push(write_config(&dir, "master.toml", &in_dir(text, &dir)));
        }
        args.extend(ephemeral(&[]).iter().map(|a| a.to_string()));
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        let master = start_env("master", &as_strs(&args), &env);
        let mut cluster = Cluster {
            nodes: Vec::new(),
            master,
            dir,
            env: self.env,
            started: Cell::new(0),
        };
        for node in self.nodes {
            let p = cluster.start_node(node);
            cluster.nodes.push(p);
        }
        cluster
    }
}

/// A running master and storage nodes (see the module's doc).
pub struct Cluster {
    /// The storage nodes the spec named, in its order. Declared before the
    /// master: fields drop in order, so the nodes stop first.
    pub nodes: Vec<Proc>,
    pub master: Proc,
    /// The scratch directory (config files, NVMe tier files a test puts here).
    pub dir: PathBuf,
    env: Vec<(String, String)>,
    /// Nodes started so far (names their config files).
    started: Cell<usize>,
}

impl Cluster {
    /// A spec for a cluster named `name` (its scratch directory's name: unique
    /// per test, since the suite's tests share one process).
    pub fn spec(name: &str) -> ClusterSpec {
        ClusterSpec {
            name: name.to_string(),
            master_config: None,
            nodes: Vec::new(),
            env: Vec::new(),
        }
    }

    /// The master's address (shard 0), for clients and the CLI.
    pub fn addr(&self) -> &str {
        &self.master.addr
    }

    /// Starts one more node mounted at this master, with the cluster's
    /// environment; the caller owns it (a node a test joins late, or starts
    /// again after a kill). Its config file goes to `dir/node<i>.toml`.
    pub fn start_node(&self, node: Node) -> Proc {
        let i = self.started.get();
        self.started.set(i + 1);
        let mut args: Vec<String> = Vec::new();
        if let Some(text) = &node.config {
            args.push("--config".into());
            let text = in_dir(text, &self.dir);
            args.push(write_config(&self.dir, &format!("node{i}.toml"), &text));
        }
        args.extend(node.args.iter().cloned());
        args.extend(
            ephemeral(&["--master"])
                .iter()
                .map(|a| a.to_string())
                .chain([self.master.addr.clone()]),
        );
        args.extend(["--segment-size".to_string(), node.size.clone()]);
        let env: Vec<(&str, &str)> = self
            .env
            .iter()
            .map(|(k, v)| (k.as_str(), v.as_str()))
            .collect();
        start_env("storage", &as_strs(&args), &env)
    }
}

fn as_strs(v: &[String]) -> Vec<&str> {
    v.iter().map(String::as_str).collect()
}

/// `text` with `{dir}` replaced by `dir`.
fn in_dir(text: &str, dir: &std::path::Path) -> String {
    text.replace("{dir}", &dir.display().to_string())
}
