//! The gate's own diagnostics on stderr: the gateway library emits them as `tracing` events
//! (an embedder routes them to its own subscriber); the binary prints each as one line,
//! `slackgate: <message>`, as it always has. `SLACKGATE_LOG` sets the most verbose level shown:
//! `error`, `warn`, `info` (the default) or `debug`; `off` shows none. The JSON decision log is
//! separate and unaffected.

use std::fmt;
use tracing::level_filters::LevelFilter;
use tracing::{Event, Subscriber};
use tracing_subscriber::fmt::format::Writer;
use tracing_subscriber::fmt::{FmtContext, FormatEvent, FormatFields};
use tracing_subscriber::registry::LookupSpan;

/// One line an event: `slackgate: ` and the event's fields (its message first).
struct Plain;

impl<S, N> FormatEvent<S, N> for Plain
where
    S: Subscriber + for<'a> LookupSpan<'a>,
    N: for<'a> FormatFields<'a> + 'static,
{
    fn format_event(
        &self,
        ctx: &FmtContext<'_, S, N>,
        mut writer: Writer<'_>,
        event: &Event<'_>,
    ) -> fmt::Result {
        write!(writer, "slackgate: ")?;
        ctx.field_format().format_fields(writer.by_ref(), event)?;
        writeln!(writer)
    }
}

/// The level `SLACKGATE_LOG` names; `info` when unset or unknown.
fn level(setting: Option<&str>) -> LevelFilter {
    match setting.map(str::trim) {
        Some("off") => LevelFilter::OFF,
        Some("error") => LevelFilter::ERROR,
        Some("warn") => LevelFilter::WARN,
        Some("debug") => LevelFilter::DEBUG,
        Some("trace") => LevelFilter::TRACE,
        _ => LevelFilter::INFO,
    }
}

/// Print the gate's diagnostics to stderr for the rest of the process.
pub fn init() {
    let setting = std::env::var("SLACKGATE_LOG").ok();
    // A subscriber set earlier (none in this binary) keeps its place.
    let _ = tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_max_level(level(setting.as_deref()))
        .event_format(Plain)
        .try_init();
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_level_setting_is_read_and_defaults_to_info() {
        assert_eq!(level(None), LevelFilter::INFO);
        assert_eq!(level(Some("warn")), LevelFilter::WARN);
        assert_eq!(level(Some(" off ")), LevelFilter::OFF);
        assert_eq!(level(Some("loud")), LevelFilter::INFO);
    }
}
