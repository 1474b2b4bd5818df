//! Counters in Prometheus text format at `http://HOST:PORT/metrics`.

use anyhow::{Context, Result};
use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{TcpListener, TcpStream};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

/// Named gauges and counters (`name{labels}` → value).
#[derive(Clone, Default)]
pub struct Registry(Arc<Mutex<BTreeMap<String, f64>>>);

impl Registry {
    /// Sets a gauge.
    pub fn set(&self, name: &str, v: f64) {
        self.0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .insert(name.to_string(), v);
    }

    /// Adds to a counter.
    pub fn add(&self, name: &str, v: f64) {
        *self
            .0
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(name.to_string())
            .or_insert(0.0) += v;
    }

    /// The exposition text.
    pub fn render(&self) -> String {
        let m = self.0.lock().unwrap_or_else(|p| p.into_inner());
        let mut out = String::new();
        let mut last = "";
        for (k, v) in m.iter() {
            let base = k.split('{').next().unwrap_or(k);
            if base != last {
                let kind = if base.ends_with("_total") {
                    "counter"
                } else {
                    "gauge"
                };
                out.push_str(&format!("# TYPE {base} {kind}\n"));
                last = base;
            }
            out.push_str(&format!("{k} {v}\n"));
        }
        out
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
        let l = TcpListener::bind(("0.0.0.0", port))
            .with_context(|| format!("binding the metrics port {port}"))?;
        l.set_nonblocking(true)?;
        let stop = Arc::new(AtomicBool::new(false));
        let s2 = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            while !s2.load(Ordering::Acquire) {
                match l.accept() {
                    Ok((c, _)) => {
                        let _ = serve(c, &registry);
                    }
                    Err(_) => std::thread::sleep(Duration::from_millis(50)),
                }
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

fn serve(mut c: TcpStream, registry: &Registry) -> std::io::Result<()> {
    c.set_nonblocking(false)?;
    c.set_read_timeout(Some(Duration::from_secs(2)))?;
    let mut line = String::new();
    BufReader::new(&c).read_line(&mut line)?;
    let path = line.split_whitespace().nth(1).unwrap_or("");
    let (status, body) = if path == "/metrics" {
        ("200 OK", registry.render())
    } else {
        ("404 Not Found", "try /metrics\n".to_string())
    };
    write!(
        c,
        "HTTP/1.1 {status}\r\nContent-Type: text/plain; version=0.0.4\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    )
}
