//! The one writer of the metrics page: `prometheus-client`'s encoder of the Prometheus text
//! format (version 0.0.4, the format every scraper of this page already reads), and the few
//! helpers through which every family on the page is written.
//!
//! A page is a [`Page`]: the long-lived registry of the request path's counters and histograms
//! ([`super::metrics::Metrics`]), plus this scrape's collectors, each of which owns what it read
//! of the gate's state at scrape time (the core's snapshot, the ledger's totals, the listeners'
//! counts, the cluster's status) and writes its families through [`Families`]. Label values are
//! escaped by the encoder, everywhere: no family builds its own label text.

use prometheus_client::collector::Collector;
use prometheus_client::encoding::{
    prometheus_text, DescriptorEncoder, EncodeGaugeValue, EncodeLabelSet, EncodeMetric,
    GaugeValueEncoder, MetricEncoder,
};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use prometheus_client::registry::{Metric, Registry};
use std::fmt;

/// The page's `Content-Type`: the Prometheus text format, version 0.0.4, in UTF-8.
pub const CONTENT_TYPE: &str = prometheus_text::CONTENT_TYPE;

/// No labels: the one series of a family that has a single row.
pub const NO_LABELS: [(&str, &str); 0] = [];

/// One scrape's page: the registered families, then this scrape's collectors.
pub struct Page<'a> {
    registered: &'a Registry,
    scrape: Registry,
}

impl<'a> Page<'a> {
    /// A page of `registered`'s families, to which collectors are added.
    pub fn new(registered: &'a Registry) -> Page<'a> {
        Page {
            registered,
            scrape: Registry::default(),
        }
    }

    /// Add a collector: its families follow those already on the page.
    pub fn collect(&mut self, c: impl Collector) {
        self.scrape.register_collector(Box::new(c));
    }

    /// The page in the text format.
    pub fn render(&self) -> String {
        let mut out = String::with_capacity(16 * 1024);
        // Writing to a String cannot fail, and no encoder here returns an error of its own.
        let _ = prometheus_text::encode(&mut out, self.registered);
        let _ = prometheus_text::encode(&mut out, &self.scrape);
        out
    }
}

/// Register a family under the name scrapers see: a counter's `_total` is the encoder's to
/// add, and so is the full stop that ends every help text on this page.
pub fn register(reg: &mut Registry, name: &str, help: &str, family: impl Metric) {
    let name = name.strip_suffix("_total").unwrap_or(name);
    debug_assert!(help.ends_with('.'), "{name}: help ends with a full stop");
    let help = help.strip_suffix('.').unwrap_or(help);
    reg.register(name, help, Listed(family));
}

/// A family whose HELP and TYPE lines are on every scrape, rows or not (the registry leaves
/// out an empty family; this page never has, and `docs/reference.md`'s test relies on it).
#[derive(Debug)]
struct Listed<M>(M);

impl<M: EncodeMetric> EncodeMetric for Listed<M> {
    fn encode(&self, encoder: MetricEncoder<'_>) -> fmt::Result {
        self.0.encode(encoder)
    }

    fn metric_type(&self) -> MetricType {
        self.0.metric_type()
    }
}

/// A gauge's value: whole numbers are written as integers (`3`, not `3.0`), as this page
/// always wrote them.
#[derive(Clone, Copy, Debug)]
pub struct Value(pub f64);

impl EncodeGaugeValue for Value {
    fn encode(&self, encoder: &mut GaugeValueEncoder<'_>) -> fmt::Result {
        let v = self.0;
        // Below 2^53 every whole f64 is exactly an i64.
        if v.fract() == 0.0 && v.abs() < 9.0e15 {
            (v as i64).encode(encoder)
        } else {
            v.encode(encoder)
        }
    }
}

/// A collector's families, written one after another.
pub struct Families<'a>(DescriptorEncoder<'a>);

impl<'a> Families<'a> {
    /// The families a collector writes on this scrape.
    pub fn new(encoder: DescriptorEncoder<'a>) -> Families<'a> {
        Families(encoder)
    }

    /// A gauge family, one row per (labels, value).
    pub fn gauge<L: EncodeLabelSet>(
        &mut self,
        name: &str,
        help: &str,
        rows: impl IntoIterator<Item = (L, f64)>,
    ) -> fmt::Result {
        let mut family = self
            .0
            .encode_descriptor(name, help, None, MetricType::Gauge)?;
        for (labels, v) in rows {
            ConstGauge::new(Value(v)).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }

    /// A counter family, one row per (labels, value); `name` as scrapers see it (`_total`).
    pub fn counter<L: EncodeLabelSet>(
        &mut self,
        name: &str,
        help: &str,
        rows: impl IntoIterator<Item = (L, u64)>,
    ) -> fmt::Result {
        let name = name.strip_suffix("_total").unwrap_or(name);
        let mut family = self
            .0
            .encode_descriptor(name, help, None, MetricType::Counter)?;
        for (labels, v) in rows {
            ConstCounter::new(v).encode(family.encode_family(&labels)?)?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug)]
    struct Sample;

    impl Collector for Sample {
        fn encode(&self, encoder: DescriptorEncoder<'_>) -> fmt::Result {
            let mut f = Families::new(encoder);
            f.gauge("g", "A gauge.", [([("k", "a\"b\\c\nd")], 2.0)])?;
            f.gauge("h", "Half.", [(NO_LABELS, 0.5)])?;
            f.counter("c_total", "A counter.", [(NO_LABELS, 7)])
        }
    }

    #[test]
    fn families_are_written_in_the_classic_text_format() {
        let reg = Registry::default();
        let mut page = Page::new(&reg);
        page.collect(Sample);
        assert_eq!(
            page.render(),
            "# HELP g A gauge.\n# TYPE g gauge\ng{k=\"a\\\"b\\\\c\\nd\"} 2\n\
             # HELP h Half.\n# TYPE h gauge\nh 0.5\n\
             # HELP c_total A counter.\n# TYPE c_total counter\nc_total 7\n"
        );
    }

    #[test]
    fn a_registered_family_is_listed_before_its_first_row() {
        let mut reg = Registry::default();
        let f = prometheus_client::metrics::family::Family::<
            Vec<(String, String)>,
            prometheus_client::metrics::counter::Counter,
        >::default();
        register(&mut reg, "x_total", "Xs seen.", f.clone());
        let page = Page::new(&reg);
        assert_eq!(
            page.render(),
            "# HELP x_total Xs seen.\n# TYPE x_total counter\n"
        );
        f.get_or_create(&vec![("k".into(), "v".into())]).inc();
        assert!(page.render().ends_with("x_total{k=\"v\"} 1\n"));
    }
}
