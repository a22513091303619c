//! `slackgate calibrate`: time a model server's requests alone and under concurrency, and
//! print priors for the config (see crates/drill/src/calibrate.rs for the fit).

use anyhow::Result;
use slackgate_drill::calibrate::CalibrateOptions;
use std::io::Write;
use std::time::Duration;

/// Arguments of `slackgate calibrate`.
#[derive(clap::Args)]
pub struct CalibrateArgs {
    /// The model server's base URL (loopback only, as for the drill).
    #[arg(long)]
    pub upstream: String,
    /// The `model` field (default: the first of the server's /v1/models).
    #[arg(long)]
    pub model: Option<String>,
    /// Requests sent at once in the concurrent measurements: the server's parallel slots.
    #[arg(long, default_value_t = 4)]
    pub slots: u32,
    /// A small plan (two prompt sizes, three output lengths, once each): seconds, for tests.
    #[arg(long)]
    pub quick: bool,
    /// Start no new measurement after this many seconds.
    #[arg(long, default_value_t = 150)]
    pub max_seconds: u64,
    /// Print JSON (measurements, priors and the TOML snippet) instead of markdown.
    #[arg(long)]
    pub json: bool,
}

/// Run `slackgate calibrate`.
pub fn run(a: CalibrateArgs) -> Result<()> {
    crate::drill::only_loopback(&a.upstream)?;
    let opts = CalibrateOptions {
        url: a.upstream,
        model: a.model,
        slots: a.slots,
        quick: a.quick,
        budget: Duration::from_secs(a.max_seconds),
    };
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()?;
    let cal = rt.block_on(slackgate_drill::calibrate::run(&opts))?;
    let text = if a.json {
        cal.to_json()
    } else {
        cal.to_markdown()
    };
    writeln!(std::io::stdout().lock(), "{text}")?;
    Ok(())
}
