//! `slackgate check`: validate a config file and say what the gate will do with it.
//!
//! The file is a plain positional argument (`slackgate check gate.toml`), as `nginx -t -c`,
//! `promtool check config` and `kubectl apply -f` users expect to type it; `--config FILE`,
//! the older spelling, is still accepted. Giving both, or neither, is a usage error, so a
//! script never validates one file while meaning another.

use anyhow::{bail, Context, Result};
use slackgate_gateway::Config;
use std::path::{Path, PathBuf};

/// The arguments of `slackgate check`.
#[derive(clap::Args)]
#[command(group(clap::ArgGroup::new("file").required(true).args(["path", "config"])))]
pub struct CheckArgs {
    /// The TOML file.
    #[arg(value_name = "FILE")]
    path: Option<PathBuf>,
    /// The TOML file (the older spelling of FILE).
    #[arg(long, value_name = "FILE")]
    config: Option<PathBuf>,
    /// Then connect to every endpoint of every pool (TCP, TLS, `GET health.path` with the
    /// pool's key) and report each; exits non-zero if any fails.
    #[arg(long)]
    probe: bool,
}

/// Validate, then probe if asked.
pub fn run(rt: &tokio::runtime::Runtime, a: CheckArgs) -> Result<()> {
    // The group above makes exactly one of them present; say so rather than unwrap.
    let Some(path) = a.path.or(a.config) else {
        bail!("slackgate check: name the config file (slackgate check FILE)");
    };
    check(&path)?;
    if a.probe {
        rt.block_on(probe_endpoints(&path))?;
    }
    Ok(())
}

/// `check --probe`: one line per endpoint, ok with what it answered or the error chain.
async fn probe_endpoints(path: &Path) -> Result<()> {
    let cfg =
        Config::from_file(path).with_context(|| format!("{} is not valid", path.display()))?;
    let env = slackgate_gateway::upstream::process_env();
    let reports = slackgate_gateway::upstream::probe::probe_pools(&cfg.gate.pools, env)
        .await
        .map_err(anyhow::Error::msg)?;
    println!("probing {} endpoints:", reports.len());
    for r in &reports {
        println!("  {r}");
    }
    let failed = reports.iter().filter(|r| r.outcome.is_err()).count();
    if failed > 0 {
        bail!("{failed} of {} endpoints failed the probe", reports.len());
    }
    Ok(())
}

fn check(path: &Path) -> Result<()> {
    crate::warn_deprecated(path);
    let cfg =
        Config::from_file(path).with_context(|| format!("{} is not valid", path.display()))?;
    // The admin token file is read at start: a missing or short one would stop `serve`.
    if let Some(token) = &cfg.admin.token_file {
        let text = std::fs::read_to_string(token)
            .with_context(|| format!("admin.token_file: cannot read {}", token.display()))?;
        let min = slackgate_gateway::ops::control::MIN_TOKEN_LEN;
        if text.trim().len() < min {
            bail!("admin.token_file: the token must be at least {min} characters");
        }
    }
    println!(
        "{}: ok ({} pools, {} classes)",
        path.display(),
        cfg.gate.pools.len(),
        cfg.gate.classes.len()
    );
    for c in &cfg.gate.classes {
        let overflow = c
            .overflow_pool
            .as_ref()
            .map(|o| format!("  overflow {o} ({:?})", c.overflow).to_lowercase())
            .unwrap_or_default();
        let displace = c
            .displace_within_ms
            .map(|w| format!("  displaces queued work admitted within {w}ms"))
            .unwrap_or_default();
        println!(
            "  class {:<12} priority {:>4}  pool {:<10} deadline {:>8}  max_queue_age {:>8}  {}{overflow}{displace}",
            c.name,
            c.priority,
            c.pool,
            c.deadline_ms.map_or("none".into(), |d| format!("{d}ms")),
            c.max_queue_age_ms
                .map_or("none".into(), |d| format!("{d}ms")),
            if c.enabled { "enabled" } else { "DISABLED" }
        );
    }
    // Displacement judges sizes: say what it costs to judge them badly, or to trust them.
    let displacing: Vec<&str> = cfg
        .gate
        .classes
        .iter()
        .filter(|c| c.displace_within_ms.is_some())
        .map(|c| c.name.as_str())
        .collect();
    if !displacing.is_empty() {
        let classes = displacing.join(", ");
        if cfg.server.trust_size_hint {
            println!(
                "  warning: displacement ({classes}) with server.trust_size_hint = true: a client that under-declares X-Expected-Output-Tokens can displace other tenants' queued work (victims are chosen regardless of tenant)"
            );
        } else {
            println!(
                "  warning: displacement ({classes}) without server.trust_size_hint: sizes are judged by class means and quantiles, not trusted hints, so it cannot tell which queued request is long; simulate with --no-hint before relying on it (BENCHMARKS.md, \"False rejections: what revoking an admission buys\")"
            );
        }
    }
    // At or above the upstream's own keep-alive, the gate reuses connections the server is
    // closing: each such request then needs a retry on a fresh connection.
    let idle_ms = cfg.server.upstream_idle_timeout_ms;
    if idle_ms >= 5_000 {
        println!(
            "  warning: server.upstream_idle_timeout_ms = {idle_ms}: llama.cpp's server, uvicorn (vLLM) and Node close idle keep-alive connections after 5000 ms; keep it below the upstream's keep-alive (slackgate_upstream_retries_total counts the stale connections hit)"
        );
    }
    if cfg.gate.admit_always {
        println!("  admit_always = true: the gate admits everything (rollback)");
    }
    if cfg.gate.shadow {
        println!("  shadow = true: would-be rejections are admitted and logged as shadow_reject");
    }
    match cfg.admin.listen {
        Some(a) => println!("  admin API on {a}"),
        None => println!("  admin API off (no [admin] section)"),
    }
    Ok(())
}
