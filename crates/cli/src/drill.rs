//! `slackgate drill`: the scenario live over HTTP through a real gate, gate on versus gate
//! off, reported like `slackgate sim` (see crates/drill).

use anyhow::{bail, Result};
use slackgate_drill::{DrillOptions, Mode, RealUpstream, Target};
use slackgate_gateway::Config;
use slackgate_sim::scenario::Scenario;
use std::io::Write;
use std::path::PathBuf;

/// Arguments of `slackgate drill`.
#[derive(clap::Args)]
pub struct DrillArgs {
    /// The scenario (TOML; the same files `slackgate sim` reads).
    pub scenario: PathBuf,
    /// Real seconds per scenario second: 0.1 runs a 300 s scenario in 30 s per run.
    #[arg(long, default_value_t = 1.0)]
    pub time_scale: f64,
    /// Override the scenario's seed.
    #[arg(long)]
    pub seed: Option<u64>,
    /// Estimator noise (sigma of the lognormal error of the size the gate is told), e.g. 0.3.
    #[arg(long)]
    pub noise: Option<f64>,
    /// Do not tell the gate each request's size (X-Expected-Output-Tokens): it uses the
    /// class's learned mean, as with clients that send no hint.
    #[arg(long)]
    pub no_hint: bool,
    /// Which runs: `on`, `off`, `signal` (gate on reading the upstream's /metrics), `cluster`
    /// (with --replicas), comma separated (default `on,off`; `signal,on,off` when the
    /// scenario has a [neighbour]; `cluster,on` with --replicas above 1).
    #[arg(long = "run", value_delimiter = ',')]
    pub runs: Vec<String>,
    /// Drive a running gate instead of starting one (needs --upstream too). Gate off then
    /// sends straight to the upstream.
    #[arg(long, requires = "upstream")]
    pub gate: Option<String>,
    /// The running gate's upstream (with --gate).
    #[arg(long, requires = "gate")]
    pub upstream: Option<String>,
    /// Drill a real OpenAI-compatible model server (llama-server, vLLM, ...) at this URL: no
    /// stub; the drill's own gate fronts it (gate off: the same gate with admit_always), and
    /// requests carry real prompt text of the scenario's token sizes.
    #[arg(long, conflicts_with_all = ["gate", "upstream"])]
    pub real_upstream: Option<String>,
    /// The `model` field sent to the real upstream (default: the first of its /v1/models).
    #[arg(long, requires = "real_upstream")]
    pub model: Option<String>,
    /// Characters of prompt text per token of the real upstream's vocabulary (default:
    /// measured with its /tokenize, else from usage.prompt_tokens, else 4).
    #[arg(long, requires = "real_upstream")]
    pub chars_per_token: Option<f64>,
    /// Gate configuration (TOML, as `serve` reads) for the drill's gate in front of the real
    /// upstream, instead of the scenario's: priors, slots (set them to the server's
    /// parallel slots), classes.
    #[arg(long, requires = "real_upstream")]
    pub config: Option<PathBuf>,
    /// Offer this multiple of the upstream's capacity instead of the scenario's rate (e.g. 2
    /// for a 2x overload): with --real-upstream the server is measured first (`calibrate
    /// --quick`, about 20 s) and the runs model it; otherwise the scenario's [upstream] is
    /// the measure. Scales [arrivals] rate, or a trace's load.
    #[arg(long)]
    pub load: Option<f64>,
    /// Leave this many scenario seconds of each run out of the estimator's error (warm-up).
    #[arg(long, default_value_t = 30.0)]
    pub error_after_s: f64,
    /// Run the scenario through this many gate replicas sharing one Redis (cluster mode,
    /// offers spread round-robin over them), then through one gate, and report both side by
    /// side with their ratio. 1: no cluster run.
    #[arg(long, default_value_t = 1, conflicts_with_all = ["gate", "real_upstream"])]
    pub replicas: usize,
    /// The Redis of the cluster run (`redis://127.0.0.1:PORT[/DB]`; default: the drill starts
    /// its own `redis-server` on a free loopback port and stops it afterwards).
    #[arg(long)]
    pub redis: Option<String>,
    /// Print JSON instead of markdown.
    #[arg(long)]
    pub json: bool,
    /// Write report.md, report.json, the charts and the gates' decision logs here.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// A drill is load: it may only go to this machine's loopback.
pub fn only_loopback(url: &str) -> Result<()> {
    let rest = url
        .strip_prefix("http://")
        .ok_or_else(|| anyhow::anyhow!("{url}: only http:// URLs are supported"))?;
    let authority = rest.split('/').next().unwrap_or("");
    let host = match authority.strip_prefix('[') {
        Some(v6) => v6.split(']').next().unwrap_or(""),
        None => authority.split(':').next().unwrap_or(""),
    };
    if !matches!(host, "127.0.0.1" | "localhost" | "::1") {
        bail!("{url}: a drill sends load only to 127.0.0.1, localhost or [::1]");
    }
    Ok(())
}

/// Run `slackgate drill`.
pub fn run(a: DrillArgs) -> Result<()> {
    let mut s = Scenario::load(&a.scenario)?;
    if let Some(seed) = a.seed {
        s.seed = seed;
    }
    if let Some(noise) = a.noise {
        s.estimator_noise = noise;
    }
    if a.no_hint {
        s.size_hint = false;
    }
    if let Err((field, why)) = s.validate() {
        bail!("{}: {field}: {why}", a.scenario.display());
    }
    let modes = a
        .runs
        .iter()
        .map(|r| match r.as_str() {
            "on" => Ok(Mode::On),
            "off" => Ok(Mode::Off),
            "signal" => Ok(Mode::Signal),
            "cluster" => Ok(Mode::Cluster),
            other => Err(anyhow::anyhow!(
                "--run {other:?}: expected on, off, signal or cluster"
            )),
        })
        .collect::<Result<Vec<_>>>()?;
    if !(a.error_after_s.is_finite() && a.error_after_s >= 0.0) {
        bail!("--error-after-s must be a number of seconds, 0 or more");
    }
    if a.redis.is_some() && a.replicas < 2 {
        bail!("--redis is the cluster run's Redis: give --replicas 2 or more with it");
    }
    let target = match (a.gate, a.upstream, a.real_upstream) {
        (Some(gate), Some(upstream), _) => {
            only_loopback(&gate)?;
            only_loopback(&upstream)?;
            Target::External { gate, upstream }
        }
        (_, _, Some(url)) => {
            only_loopback(&url)?;
            let config = match &a.config {
                Some(p) => {
                    Some(Box::new(Config::from_file(p).map_err(|e| {
                        anyhow::anyhow!("--config {}: {e}", p.display())
                    })?))
                }
                None => None,
            };
            Target::Real(RealUpstream {
                url,
                model: a.model,
                chars_per_token: a.chars_per_token,
                config,
            })
        }
        _ => Target::InProcess,
    };
    let modes = if modes.is_empty() {
        slackgate_drill::default_modes_for(&s, &target, a.replicas)
    } else {
        modes
    };
    let opts = DrillOptions {
        time_scale: a.time_scale,
        target,
        modes,
        progress: slackgate_drill::progress::wanted() && !a.json,
        log_dir: a.out.clone(),
        error_after_s: a.error_after_s,
        replicas: a.replicas,
        redis: a.redis,
        load: a.load,
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let drill = rt.block_on(slackgate_drill::run(&s, &opts))?;
    let text = if a.json {
        drill.to_json()
    } else {
        drill.to_markdown()
    };
    let mut stdout = std::io::stdout().lock();
    writeln!(stdout, "{text}")?;
    if let Some(dir) = &a.out {
        drill.write(dir)?;
        writeln!(stdout, "wrote {}", dir.display())?;
    }
    if !drill.healthy() {
        bail!(
            "the drill did not reach the gate cleanly (connection failures, malformed-request \
             refusals or missing upstream records; see the report): its figures do not \
             describe the gate"
        );
    }
    Ok(())
}
