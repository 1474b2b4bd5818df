//! Counters and gauges at `http://HOST:PORT/metrics`: the snapshot the
//! processes publish is encoded by `prometheus-client` (OpenMetrics text)
//! on each scrape and served by `tiny_http`.

use anyhow::{anyhow, Result};
use prometheus_client::collector::Collector;
use prometheus_client::encoding::{DescriptorEncoder, EncodeMetric};
use prometheus_client::metrics::counter::ConstCounter;
use prometheus_client::metrics::gauge::ConstGauge;
use prometheus_client::metrics::MetricType;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// A label set: `(name, value)` pairs.
type Labels = Vec<(String, String)>;

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum Value {
    Gauge(i64),
    Counter(u64),
}

/// The latest value of every series, by metric name and labels. Counter
/// names are given without `_total` (the encoding appends it).
#[derive(Clone, Debug, Default)]
pub struct Registry(Arc<Mutex<BTreeMap<String, BTreeMap<Labels, Value>>>>);

fn labels(l: &[(&str, &str)]) -> Labels {
    l.iter()
        .map(|(k, v)| (k.to_string(), v.to_string()))
        .collect()
}

impl Registry {
    fn put(&self, name: &str, l: &[(&str, &str)], f: impl FnOnce(Option<Value>) -> Value) {
        let mut m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let series = m.entry(name.to_string()).or_default();
        let key = labels(l);
        let v = f(series.get(&key).copied());
        series.insert(key, v);
    }

    /// Sets a gauge.
    pub fn gauge(&self, name: &str, l: &[(&str, &str)], v: u64) {
        self.put(name, l, |_| {
            Value::Gauge(i64::try_from(v).unwrap_or(i64::MAX))
        });
    }

    /// Sets a counter to a total kept elsewhere (the library's own counters).
    pub fn counter(&self, name: &str, l: &[(&str, &str)], v: u64) {
        self.put(name, l, |_| Value::Counter(v));
    }

    /// Adds to a counter.
    pub fn inc(&self, name: &str, by: u64) {
        self.put(name, &[], |old| match old {
            Some(Value::Counter(n)) => Value::Counter(n.saturating_add(by)),
            _ => Value::Counter(by),
        });
    }

    /// The OpenMetrics text of every series.
    pub fn render(&self) -> String {
        let mut r = prometheus_client::registry::Registry::default();
        r.register_collector(Box::new(self.clone()));
        let mut out = String::new();
        // Writing to a String cannot fail.
        let _ = prometheus_client::encoding::text::encode(&mut out, &r);
        out
    }
}

impl Collector for Registry {
    fn encode(&self, mut encoder: DescriptorEncoder) -> Result<(), std::fmt::Error> {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        for (name, series) in m.iter() {
            let Some(first) = series.values().next() else {
                continue;
            };
            let kind = match first {
                Value::Gauge(_) => MetricType::Gauge,
                Value::Counter(_) => MetricType::Counter,
            };
            let mut metric = encoder.encode_descriptor(name, "", None, kind)?;
            // A name is published with labels or without, never both.
            if let Some(v) = series.get(&Labels::new()) {
                match v {
                    Value::Gauge(g) => ConstGauge::new(*g).encode(metric)?,
                    Value::Counter(c) => ConstCounter::new(*c).encode(metric)?,
                }
                continue;
            }
            for (l, v) in series {
                let e = metric.encode_family(l)?;
                match v {
                    Value::Gauge(g) => ConstGauge::new(*g).encode(e)?,
                    Value::Counter(c) => ConstCounter::new(*c).encode(e)?,
                }
            }
        }
        Ok(())
    }
}

/// The HTTP server thread; stops when dropped.
pub struct MetricsServer {
    stop: Arc<AtomicBool>,
    thread: Option<JoinHandle<()>>,
}

impl MetricsServer {
    /// Serves `registry` on `0.0.0.0:port` (scrapers usually live on other hosts).
    pub fn spawn(port: u16, registry: Registry) -> Result<MetricsServer> {
        let server = tiny_http::Server::http(("0.0.0.0", port))
            .map_err(|e| anyhow!("binding the metrics port {port}: {e}"))?;
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !s2.load(Ordering::Acquire) {
                let Ok(Some(req)) = server.recv_timeout(Duration::from_millis(100)) else {
                    continue;
                };
                let _ = if req.url() == "/metrics" {
                    let header = tiny_http::Header::from_bytes(
                        &b"Content-Type"[..],
                        &b"application/openmetrics-text; version=1.0.0; charset=utf-8"[..],
                    )
                    .expect("a valid header");
                    req.respond(
                        tiny_http::Response::from_string(registry.render()).with_header(header),
                    )
                } else {
                    req.respond(
                        tiny_http::Response::from_string("try /metrics\n").with_status_code(404),
                    )
                };
            }
        });
        Ok(MetricsServer {
            stop,
            thread: Some(thread),
        })
    }
}

impl Drop for MetricsServer {
    fn drop(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
