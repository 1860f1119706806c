//! `kvpool`: one binary, every role, and the CLI.
//!
//! * `kvpool run [--role all|master|storage|gateway]` serves (all roles in one process
//!   by default, with the embedded default config: master, storage node, and
//!   the serving path: conductor, a prefill and a decode engine with their
//!   proxies); `--role engine --model M` runs the inference engine (crate
//!   kvpool-engine); `--role conductor|prefill-proxy|decode-proxy` the
//!   serving path's parts (crate kvpool-serving); `--role gateway` is a pool
//!   client with the Redis protocol front (`--resp HOST:PORT`, which roles
//!   all and storage take too).
//! * `kvpool chat "..."` and `kvpool bench serve` talk to the front.
//! * `kvpool put|get|exists|rm|stat` talk to a running pool.
//! * `kvpool sim` replays a request trace against a modelled cluster.
//!
//! Exit codes: 0 success; 1 `exists` found nothing; 2 an error (printed as
//! `error: <Code> (<n>): <message>` on stderr).

use std::io::{Read, Write};
use std::path::PathBuf;
use std::process::ExitCode;

use clap::{Parser, Subcommand, ValueEnum};
use kvpool_client::Client;
use kvpool_config::NodeConfig;
use kvpool_config::Role;
use kvpool_node as node;
use kvpool_runtime::config::Bytes;
use kvpool_runtime::Shutdown;
use kvpool_wire::proto::PutOptions;
use kvpool_wire::KvError;

#[derive(Parser)]
#[command(
    name = "kvpool",
    version,
    about = "A pooled DRAM/NVMe KV-cache store for disaggregated LLM serving"
)]
struct Cli {
    /// The master's RPC address (host:port of its shard 0), or
    /// etcd://host:port[,host:port...] (optionally then /name) to follow
    /// the leader of masters on etcd.
    #[arg(long, global = true, value_name = "HOST:PORT|etcd://...")]
    master: Option<String>,
    /// A TOML config file (see configs/); every key has a default.
    #[arg(long, global = true, value_name = "FILE")]
    config: Option<PathBuf>,
    #[command(subcommand)]
    cmd: Cmd,
}

#[derive(Subcommand)]
enum Cmd {
    /// Serve: run one or all roles until SIGINT/SIGTERM.
    Run(RunArgs),
    /// One chat turn against the conductor's front, streamed to the terminal.
    Chat(kvpool_serving::chat::ChatArgs),
    /// Store a value: from FILE, or stdin when FILE is `-` or absent.
    Put {
        key: String,
        file: Option<String>,
        /// Replicas, each on a distinct segment (best effort).
        #[arg(long, default_value_t = 1)]
        replicas: u32,
        /// Soft-pin the object for this many milliseconds.
        #[arg(long, default_value_t = 0, value_name = "MS")]
        soft_pin_ms: u64,
        /// Never evict the object (remove still works).
        #[arg(long)]
        hard_pin: bool,
        /// Replace the value stored under KEY, atomically (without it, a
        /// stored key is ObjectAlreadyExists).
        #[arg(long)]
        replace: bool,
    },
    /// Print a value to stdout, or write it to a file.
    Get {
        key: String,
        #[arg(short, long, value_name = "FILE")]
        output: Option<PathBuf>,
    },
    /// Exit 0 if the key is stored, 1 if not.
    Exists { key: String },
    /// Remove a key.
    Rm {
        key: String,
        /// Remove even while a reader holds a lease.
        #[arg(long)]
        force: bool,
    },
    /// Segments, capacity, use and key count.
    Stat {
        #[arg(long)]
        json: bool,
    },
    /// Replay a request trace against a modelled cluster, per scheduling
    /// policy (`kvpool sim cache`: the pool's prefix hit ratio alone).
    Sim(kvpool_sim::cli::SimCommand),
    /// Measure a running pool.
    #[command(subcommand)]
    Bench(BenchCmd),
    /// Write a model's tokenizer as Hugging Face files (tokenizer.json,
    /// tokenizer_config.json) into DIR, so clients count tokens as the
    /// engine does (load generators' `--tokenizer DIR`, transformers).
    Tokenizer {
        /// The folder to write (made if missing; the two files replaced).
        dir: PathBuf,
        /// `builtin:tiny`, `builtin:small` or a model folder.
        #[arg(long, default_value = "builtin:small")]
        model: String,
    },
}

#[derive(Subcommand)]
enum BenchCmd {
    /// Replay a request trace against the serving front at its timestamps:
    /// TTFT/TBT percentiles, SLO attainment and goodput, the columns of
    /// `kvpool sim`.
    Serve(Box<kvpool_sim::serve_bench::BenchServeArgs>),
    /// Put and get latency and throughput per transport, value size, batch:
    /// rows on stdout, one progress line per case on stderr.
    Transfer {
        /// Transports to measure: tcp, shm (same host only), auto, rdma
        /// (a build with the rdma feature and a device).
        #[arg(long, value_delimiter = ',', default_value = "tcp,shm")]
        transport: Vec<TransportArg>,
        /// Value sizes.
        #[arg(long, value_delimiter = ',', default_value = "4KiB,64KiB,1MiB,16MiB")]
        sizes: Vec<Bytes>,
        /// Batch sizes (1 = single calls).
        #[arg(long, value_delimiter = ',', default_value = "1,32")]
        batch: Vec<usize>,
        /// Bytes moved per case, at most; a case also uses at most half of
        /// the pool's room below its high watermark (`stat`), waiting a
        /// little for earlier cases' space when their read leases end soon.
        #[arg(long, default_value = "256MiB")]
        bytes: Bytes,
        /// Calls per case, at most (all clients' together).
        #[arg(long, default_value_t = 5000)]
        max_calls: usize,
        /// Clients at once, a row per count (e.g. 1,4,16): each its own
        /// connections, all in this process on one thread per core; the
        /// rows give their aggregate GB/s and the percentiles of all calls.
        #[arg(long, value_delimiter = ',', default_value = "1")]
        clients: Vec<usize>,
        /// One JSON object per line.
        #[arg(long)]
        json: bool,
    },
}

#[derive(Clone, Copy, ValueEnum)]
enum TransportArg {
    Auto,
    Tcp,
    Shm,
    Rdma,
}

impl TransportArg {
    fn transport(self) -> kvpool_config::Transport {
        use kvpool_config::Transport;
        match self {
            TransportArg::Auto => Transport::Auto,
            TransportArg::Tcp => Transport::Tcp,
            TransportArg::Shm => Transport::Shm,
            TransportArg::Rdma => Transport::Rdma,
        }
    }
}

fn load_config(path: Option<&PathBuf>) -> Result<NodeConfig, String> {
    match path {
        None => Ok(NodeConfig::default()),
        Some(p) => {
            let text = std::fs::read_to_string(p)
                .map_err(|e| format!("cannot read config {}: {e}", p.display()))?;
            NodeConfig::from_toml(&text, &p.display().to_string()).map_err(|e| e.to_string())
        }
    }
}

/// A panic anywhere (a shard, an actor, the HTTP server) ends the process
/// with the reason logged: a supervisor restarts it whole, instead of a
/// process that still answers `/healthz` with a dead shard inside.
fn die_on_panic() {
    let default_hook = std::panic::take_hook();
    std::panic::set_hook(Box::new(move |info| {
        default_hook(info);
        let thread = std::thread::current();
        tracing::error!(
            thread = thread.name().unwrap_or("?"),
            "panic: {info}; the process exits so that it can be restarted whole"
        );
        eprintln!("kvpool: a thread panicked; aborting the process");
        std::process::abort();
    }));
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    kvpool_runtime::telemetry::init();
    die_on_panic();
    // Every client of this process (CLI, storage node, RESP, engines) may
    // name the master as etcd://...: the leader of masters on etcd.
    kvpool_ha::install();
    // Built with RDMA: every client and storage node of this process may use
    // it (their settings permitting).
    #[cfg(feature = "rdma")]
    kvpool_rdma::install();
    let mut cfg = match load_config(cli.config.as_ref()) {
        Ok(c) => c,
        Err(e) => {
            eprintln!("error: {e}");
            return ExitCode::from(2);
        }
    };
    cfg.apply_env();
    if let Err(e) = cfg.validate() {
        eprintln!("error: {e}");
        return ExitCode::from(2);
    }
    match cli.cmd {
        Cmd::Sim(cmd) => match kvpool_sim::cli::run_sim_command(&cmd) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Cmd::Tokenizer { dir, model } => match write_tokenizer(&dir, &model) {
            Ok(()) => ExitCode::SUCCESS,
            Err(e) => {
                eprintln!("error: {e}");
                ExitCode::from(2)
            }
        },
        Cmd::Chat(args) => {
            let front = front_or_default(&args.front, &cfg);
            block_on_cli(async move {
                let mut out = std::io::stdout();
                kvpool_serving::chat::run_chat(&front, &args, &mut out)
                    .await
                    .map(|_| ())
            })
        }
        Cmd::Bench(BenchCmd::Serve(args)) => {
            let front = front_or_default(&args.front, &cfg);
            block_on_cli(async move {
                let mut out = std::io::stdout();
                kvpool_sim::serve_bench::run_bench_serve(&front, &args, &mut out)
                    .await
                    .map(|_| ())
            })
        }
        Cmd::Run(RunArgs {
            role,
            pool,
            serving,
            ha,
        }) => {
            if let Some(url) = ha {
                cfg.master.ha = url;
            }
            let mut launch = node::Launch::default();
            let flags = match role {
                Role::Engine => {
                    launch.model = pool.model;
                    launch.engine_listen = pool.listen;
                    launch.engine_master = cli.master;
                    Ok(launch)
                }
                Role::Conductor | Role::PrefillProxy | Role::DecodeProxy => {
                    serving_role_flags(role, pool.listen, cli.master, serving, &mut cfg)
                        .map(|()| launch)
                }
                Role::All | Role::Master | Role::Storage | Role::Gateway => {
                    pool_role_flags(role, pool, cli.master, serving, &mut cfg)
                }
            };
            let launch = match flags {
                Ok(l) => l,
                Err(e) => {
                    eprintln!("error: {e}");
                    return ExitCode::from(2);
                }
            };
            match node::launch(role, cfg, launch, Shutdown::new()) {
                Ok(()) => ExitCode::SUCCESS,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
        cmd => {
            let master = cli.master.unwrap_or_else(|| "127.0.0.1:7070".into());
            // A bench's clients run in parallel, one worker per core; any
            // other verb is one call at a time.
            let builder = match &cmd {
                Cmd::Bench(_) => tokio::runtime::Builder::new_multi_thread(),
                _ => tokio::runtime::Builder::new_current_thread(),
            };
            let rt = match cli_runtime(builder) {
                Ok(rt) => rt,
                Err(code) => return code,
            };
            let r = match cmd {
                Cmd::Bench(b) => rt.block_on(bench_cmd(&master, cfg, b)),
                cmd => rt.block_on(client_cmd(&master, cfg, cmd)),
            };
            match r {
                Ok(code) => code,
                Err(e) => {
                    eprintln!("error: {e}");
                    ExitCode::from(2)
                }
            }
        }
    }
}

/// A runtime for a CLI command, or exit code 2 with the reason on stderr.
fn cli_runtime(mut b: tokio::runtime::Builder) -> Result<tokio::runtime::Runtime, ExitCode> {
    b.enable_all().build().map_err(|e| {
        eprintln!("error: cannot start the runtime: {e}");
        ExitCode::from(2)
    })
}

/// `--front`, or the config's `serving.conductor.listen`.
fn front_or_default(front: &Option<String>, cfg: &NodeConfig) -> String {
    front
        .clone()
        .unwrap_or_else(|| cfg.serving.conductor.listen.clone())
}

/// Runs `fut` on a small runtime for a CLI verb: exit 0, or 2 with the
/// error on stderr.
fn block_on_cli(fut: impl std::future::Future<Output = Result<(), String>>) -> ExitCode {
    let mut b = tokio::runtime::Builder::new_multi_thread();
    b.worker_threads(2);
    let rt = match cli_runtime(b) {
        Ok(rt) => rt,
        Err(code) => return code,
    };
    match rt.block_on(fut) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(2)
        }
    }
}

/// `kvpool run`'s flags: the role, the pool's flags, the serving path's.
#[derive(clap::Args)]
struct RunArgs {
    /// Which role(s) this process runs.
    #[arg(long, default_value = "all", value_parser = role_parser())]
    role: Role,
    #[command(flatten)]
    pool: PoolFlags,
    #[command(flatten)]
    serving: ServingFlags,
    /// Role master: campaign with the other masters on etcd
    /// (etcd://host:port[,host:port...], optionally then /name); one leads, the others
    /// stand by. Sets `[master] ha`.
    #[arg(long, value_name = "etcd://HOST:PORT,...")]
    ha: Option<String>,
}

/// `kvpool run` flags of the serving roles.
#[derive(clap::Args)]
struct ServingFlags {
    /// Role prefill-proxy / decode-proxy: the engine it fronts.
    #[arg(long, value_name = "HOST:PORT")]
    engine: Option<String>,
    /// Role conductor: the prefill proxies, in instance order.
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT,...")]
    prefill: Vec<String>,
    /// Role conductor: the decode proxies, in instance order.
    #[arg(long, value_delimiter = ',', value_name = "HOST:PORT,...")]
    decode: Vec<String>,
    /// Role conductor (and all): the scheduling policy.
    #[arg(long, value_name = "POLICY")]
    policy: Option<String>,
    /// Role conductor (and all): the front's API key (`[serving]
    /// api_key`; the environment's KVPOOL_API_KEY keeps it out of `ps`).
    #[arg(long, value_name = "KEY")]
    api_key: Option<String>,
    /// Role conductor (and all): the cluster cost model (TOML).
    #[arg(long, value_name = "FILE")]
    cost_model: Option<String>,
    /// Role conductor (and all): log every scheduling decision and the
    /// view it was made on to FILE (`kvpool sim replay --log FILE`).
    #[arg(long, value_name = "FILE")]
    decision_log: Option<String>,
}

impl ServingFlags {
    /// Puts the flags into `[serving]`; `proxy` says the role is a proxy
    /// (only proxies take `--engine`, only the conductor the lists).
    fn apply(self, cfg: &mut NodeConfig, proxy: bool) -> Result<(), String> {
        let c = &mut cfg.serving.conductor;
        if self.engine.is_some() && !proxy {
            return Err("--engine is for --role prefill-proxy and --role decode-proxy".into());
        }
        if (!self.prefill.is_empty() || !self.decode.is_empty()) && proxy {
            return Err("--prefill and --decode are for --role conductor".into());
        }
        if !self.prefill.is_empty() {
            c.prefill = self.prefill;
        }
        if !self.decode.is_empty() {
            c.decode = self.decode;
        }
        if let Some(p) = self.policy {
            c.policy = p;
        }
        if let Some(k) = self.api_key {
            if proxy {
                return Err("--api-key is for --role conductor and --role all".into());
            }
            cfg.serving.api_key = k;
        }
        let c = &mut cfg.serving.conductor;
        if let Some(m) = self.cost_model {
            c.cost_model = m;
        }
        if let Some(l) = self.decision_log {
            c.decision_log = l;
        }
        if let Some(e) = self.engine {
            cfg.serving.prefill_proxy.engine = e.clone();
            cfg.serving.decode_proxy.engine = e;
        }
        cfg.serving.validate()
    }
}

/// `--role`: one of [`Role::NAMES`] (listed in `--help` and in the error).
fn role_parser() -> impl clap::builder::TypedValueParser<Value = Role> {
    use clap::builder::TypedValueParser;
    clap::builder::PossibleValuesParser::new(Role::NAMES)
        .map(|name| name.parse::<Role>().expect("a name of Role::NAMES"))
}

/// `kvpool run --role conductor|prefill-proxy|decode-proxy`: the flags into
/// the configuration.
fn serving_role_flags(
    role: Role,
    listen: Option<String>,
    master: Option<String>,
    flags: ServingFlags,
    cfg: &mut NodeConfig,
) -> Result<(), String> {
    let proxy = matches!(role, Role::PrefillProxy | Role::DecodeProxy);
    flags.apply(cfg, proxy)?;
    if let Some(l) = listen {
        match role {
            Role::PrefillProxy => cfg.serving.prefill_proxy.listen = l,
            Role::DecodeProxy => cfg.serving.decode_proxy.listen = l,
            _ => cfg.serving.conductor.listen = l,
        }
    }
    if let (Some(m), Role::Conductor) = (master, role) {
        cfg.serving.conductor.pool = m;
    }
    Ok(())
}

/// The flags of `kvpool run` for the pool's roles (all, master, storage,
/// gateway); role engine takes `--listen` and `--model` of them.
#[derive(clap::Args)]
struct PoolFlags {
    /// Base listen address of the role (shard i listens on port + i);
    /// for `all`, the master's.
    #[arg(long, value_name = "HOST:PORT")]
    listen: Option<String>,
    /// HTTP address for /healthz and /metrics.
    #[arg(long, value_name = "HOST:PORT")]
    http: Option<String>,
    /// Base data-plane address of the storage node (role all; for role
    /// storage, --listen). With role all and a --listen on port 0, the
    /// storage node takes ephemeral ports too.
    #[arg(long, value_name = "HOST:PORT")]
    data_listen: Option<String>,
    /// DRAM this storage node gives to the pool: bytes, or with a
    /// KiB/MiB/GiB suffix.
    #[arg(long, value_name = "BYTES")]
    segment_size: Option<Bytes>,
    /// Shards (cores) to run; 0 = all cores.
    #[arg(long, value_name = "N")]
    shards: Option<usize>,
    /// Roles master and all: keep the master's log and snapshots in DIR,
    /// so a restarted master remembers every object (`[master]
    /// state_dir`).
    #[arg(long, value_name = "DIR")]
    state_dir: Option<String>,
    /// Serve the Redis protocol (RESP2 and RESP3) on this address: roles all and
    /// storage add the listener; role gateway is a pool client with only
    /// it (default 127.0.0.1:6379). See `[resp]` in configs/.
    #[arg(long, value_name = "HOST:PORT")]
    resp: Option<String>,
    /// Role engine (and role all's two engines): a Hugging Face model
    /// folder, `builtin:tiny` or `builtin:small`.
    #[arg(long, value_name = "DIR|builtin:tiny|builtin:small")]
    model: Option<String>,
    /// Role all: leave the serving path off (master and storage only).
    #[arg(long)]
    no_serving: bool,
}

/// The pool roles' flags into the configuration; what the launch needs.
fn pool_role_flags(
    role: Role,
    f: PoolFlags,
    master: Option<String>,
    serving: ServingFlags,
    cfg: &mut NodeConfig,
) -> Result<node::Launch, String> {
    let mut launch = node::Launch::default();
    if f.model.is_some() && !role.takes_a_model() {
        return Err("--model is for --role engine and --role all".into());
    }
    serving.apply(cfg, false)?;
    if let Some(m) = f.model {
        cfg.serving.model = m;
    }
    // Role all on a free port puts every listener on one (the
    // storage node's, and the serving path's).
    let ephemeral = role == Role::All && f.listen.as_deref().is_some_and(|l| l.ends_with(":0"));
    if role == Role::Master && f.resp.is_some() {
        return Err("--resp needs a pool client: roles all, storage or gateway".into());
    }
    if role == Role::Gateway {
        if f.data_listen.is_some() || f.segment_size.is_some() {
            return Err("--data-listen and --segment-size are for roles all and storage".into());
        }
        // The gateway's one listener is its RESP port.
        if let Some(l) = f.resp.or(f.listen) {
            cfg.resp.listen = l;
        }
        if let Some(h) = f.http {
            cfg.resp.http = h;
        }
        if let Some(m) = master {
            cfg.resp.master = m;
        }
        if let Some(n) = f.shards {
            cfg.runtime.shards = n;
        }
        return Ok(launch);
    }
    if let Some(r) = f.resp {
        cfg.resp.listen = r;
    }
    if let Some(l) = f.listen {
        if role == Role::All && f.data_listen.is_none() {
            if let Some(host) = l.strip_suffix(":0") {
                cfg.storage.listen = format!("{host}:0");
            }
        }
        match role {
            Role::Storage => cfg.storage.listen = l,
            _ => cfg.master.listen = l,
        }
    }
    if let Some(d) = f.data_listen {
        cfg.storage.listen = d;
    }
    if let Some(h) = f.http {
        match role {
            Role::Storage => cfg.storage.http = h,
            _ => cfg.master.http = h,
        }
    }
    if let Some(m) = master {
        cfg.storage.master = m;
    }
    if let Some(d) = f.state_dir {
        if role != Role::Master && role != Role::All {
            return Err("--state-dir is for --role master and --role all".into());
        }
        cfg.master.state_dir = d;
    }
    if let Some(s) = f.segment_size {
        cfg.storage.segment_size = s;
    }
    if let Some(n) = f.shards {
        cfg.runtime.shards = n;
    }
    launch.serving = role == Role::All && cfg.serving.enabled && !f.no_serving;
    launch.ephemeral = ephemeral;
    Ok(launch)
}

#[derive(Debug)]
enum CliError {
    Kv(KvError),
    Io(String),
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            CliError::Kv(e) => write!(f, "{e}"),
            CliError::Io(e) => f.write_str(e),
        }
    }
}

impl From<KvError> for CliError {
    fn from(e: KvError) -> Self {
        CliError::Kv(e)
    }
}

/// `kvpool bench transfer`: rows on stdout as they are measured, progress
/// on stderr; on a failure, the error names the case (the rows before it
/// are printed already).
async fn bench_cmd(master: &str, cfg: NodeConfig, cmd: BenchCmd) -> Result<ExitCode, CliError> {
    use kvpool_node::bench::{self, Progress};
    let BenchCmd::Transfer {
        transport,
        sizes,
        batch,
        bytes,
        max_calls,
        clients,
        json,
    } = cmd
    else {
        unreachable!("bench serve is handled in main");
    };
    let b = bench::TransferBench {
        transports: transport.iter().map(|t| t.transport()).collect(),
        sizes: sizes.iter().map(|s| s.get() as usize).collect(),
        batches: batch,
        bytes_per_case: bytes.get(),
        max_calls,
        clients,
        high_watermark: cfg.master.high_watermark,
        client: cfg.client_config(),
    };
    // Before connecting or printing anything: one clear error.
    bench::check_transports(&b.transports)?;
    if !json {
        bench::print_header();
    }
    let r = bench::run_transfer(master, &b, |p| match p {
        Progress::Row(r) if json => {
            println!("{}", serde_json::to_string(r).expect("a row serializes"))
        }
        Progress::Row(r) => bench::print_row(r),
        p => bench::print_progress(&p),
    })
    .await;
    match r {
        Ok(_) => Ok(ExitCode::SUCCESS),
        Err(e) => Err(CliError::Io(e.to_string())),
    }
}

async fn client_cmd(master: &str, cfg: NodeConfig, cmd: Cmd) -> Result<ExitCode, CliError> {
    let mut ccfg = cfg.client_config();
    // One command is over in well under client_ttl: no liveness pings.
    ccfg.ping_interval_ms = 0;
    let client = Client::connect(master, ccfg).await?;
    match cmd {
        Cmd::Run { .. } | Cmd::Sim(_) | Cmd::Bench(_) | Cmd::Chat(_) | Cmd::Tokenizer { .. } => {
            unreachable!("handled in main")
        }
        Cmd::Put {
            key,
            file,
            replicas,
            soft_pin_ms,
            hard_pin,
            replace,
        } => {
            let value = match file.as_deref() {
                None | Some("-") => {
                    let mut v = Vec::new();
                    std::io::stdin()
                        .read_to_end(&mut v)
                        .map_err(|e| CliError::Io(format!("cannot read stdin: {e}")))?;
                    v
                }
                Some(path) => std::fs::read(path)
                    .map_err(|e| CliError::Io(format!("cannot read {path}: {e}")))?,
            };
            let opts = PutOptions {
                replicas,
                soft_pin_ttl_ms: soft_pin_ms,
                hard_pin,
                preferred_host: String::new(),
                replace,
                put_id: 0, // the client names each placement
            };
            client.put_with(key.as_bytes(), &value, &opts).await?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Get { key, output } => {
            let value = client.get(key.as_bytes()).await?;
            match output {
                Some(p) => std::fs::write(&p, &value)
                    .map_err(|e| CliError::Io(format!("cannot write {}: {e}", p.display())))?,
                None => {
                    let mut out = std::io::stdout().lock();
                    out.write_all(&value)
                        .and_then(|_| out.flush())
                        .map_err(|e| CliError::Io(format!("cannot write stdout: {e}")))?;
                }
            }
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Exists { key } => Ok(if client.exists(key.as_bytes()).await? {
            ExitCode::SUCCESS
        } else {
            ExitCode::from(1)
        }),
        Cmd::Rm { key, force } => {
            client.remove_with(key.as_bytes(), force).await?;
            Ok(ExitCode::SUCCESS)
        }
        Cmd::Stat { json } => {
            let s = client.stat().await?;
            if json {
                let segs: Vec<serde_json::Value> = s
                    .segments
                    .iter()
                    .map(|g| {
                        serde_json::json!({
                            "id": g.id,
                            "name": g.name,
                            "endpoint": g.endpoint.shard_addr(0),
                            "shards": g.endpoint.nr_shards,
                            "host_id": g.host_id,
                            "capacity": g.capacity,
                            "used": g.used,
                            "draining": g.draining,
                        })
                    })
                    .collect();
                let v = serde_json::json!({
                    "segments": segs,
                    "capacity": s.capacity,
                    "used": s.used,
                    "keys": s.keys,
                });
                println!("{v}");
            } else {
                println!("segments: {}", s.segments.len());
                for g in &s.segments {
                    println!(
                        "  {}  {}  capacity {}  used {}{}",
                        g.name,
                        g.endpoint.shard_addr(0),
                        Bytes(g.capacity),
                        Bytes(g.used),
                        if g.draining { "  (draining)" } else { "" }
                    );
                }
                println!("capacity: {}", Bytes(s.capacity));
                println!("used: {}", Bytes(s.used));
                println!("keys: {}", s.keys);
            }
            Ok(ExitCode::SUCCESS)
        }
    }
}

/// `kvpool tokenizer`: the model's tokenizer.json and tokenizer_config.json
/// into `dir`, each path printed.
fn write_tokenizer(dir: &std::path::Path, model: &str) -> Result<(), String> {
    let (tok, max_len) = kvpool_engine::loader::tokenizer_of(model).map_err(|e| e.to_string())?;
    let json = tok.to_hf_json().map_err(|e| e.to_string())?;
    let config = kvpool_engine::tokenizer::hf_tokenizer_config(&tok, max_len);
    std::fs::create_dir_all(dir).map_err(|e| format!("{}: {e}", dir.display()))?;
    for (name, text) in [("tokenizer.json", json), ("tokenizer_config.json", config)] {
        // Whole or not at all: written beside, then renamed over.
        let p = dir.join(name);
        let tmp = dir.join(format!(".{name}.tmp"));
        std::fs::write(&tmp, text)
            .and_then(|()| std::fs::rename(&tmp, &p))
            .map_err(|e| format!("{}: {e}", p.display()))?;
        println!("{}", p.display());
    }
    Ok(())
}
