//! YAML text → [`PdConfig`], with type errors that name the key.

use super::{
    BufferDevice, ChannelKind, ConfigError, ConfigProblem, HcclPath, HixlProtocol, HixlSettings,
    KvLayout, NpuLink, PdConfig, PortList, Role,
};
use crate::layout::Dtype;
use serde_yaml::{Mapping, Value};
use std::time::Duration;

/// Longest duration a config key may give, in seconds.
const MAX_SECONDS: f64 = 1e9;

/// Every key this backend reads. Anything else gets an "unknown key" warning.
pub(crate) const KNOWN_KEYS: &[&str] = &[
    "enable_pd",
    "transfer_channel",
    "pd_hccl_path",
    "pd_hixl_protocol",
    "pd_hixl_device_ip",
    "pd_hixl_port",
    "pd_hixl_device_phy_id",
    "pd_role",
    "pd_buffer_size",
    "pd_buffer_device",
    "pd_peer_host",
    "pd_peer_init_port",
    "pd_peer_alloc_port",
    "pd_peer_query_port",
    "pd_proxy_host",
    "pd_proxy_port",
    "pd_auth_secret_file",
    "pd_max_keys_per_message",
    "pd_copy_threads",
    "pd_pull_mode",
    "pd_delay_pull",
    "pd_pull_done_port",
    "pd_register_port",
    "pd_park_timeout",
    "pd_bind_host",
    "pd_base_port",
    "pd_data_port",
    "pd_liveness_port",
    "pd_model_identity",
    "pd_drain_timeout",
    "pd_use_cpu_offload",
    "pd_layerwise",
    "pd_push_direct_write",
    "pd_npu_link",
    "pd_cpu_buffer_size",
    "pd_alloc_fail_backoff_ttl",
    "pd_pull_pending_ttl",
    "pd_pull_backpressure_reserve_pct",
    "pd_push_landing_timeout",
    "pd_resident_ttl",
    "pd_pull_read_margin_pct",
    "chunk_size",
    "local_cpu",
    "tp_size",
    "pd_peer_tp_size",
    "kv_num_layers",
    "kv_num_heads",
    "kv_head_size",
    "kv_hidden_size",
    "kv_dtype",
    "use_mla",
];

struct Reader<'a> {
    map: &'a Mapping,
    problems: Vec<ConfigProblem>,
}

impl<'a> Reader<'a> {
    fn get(&self, key: &str) -> Option<&'a Value> {
        match self.map.get(key) {
            None | Some(Value::Null) => None,
            Some(v) => Some(v),
        }
    }

    fn wrong(&mut self, key: &str, expected: &str, got: &Value) {
        self.problems.push(ConfigProblem::new(
            key,
            format!("expected {expected}, got {}", describe(got)),
            format!("write {key} as {expected}"),
        ));
    }

    fn bool(&mut self, key: &str, default: bool) -> bool {
        match self.get(key) {
            None => default,
            Some(Value::Bool(b)) => *b,
            Some(v) => {
                self.wrong(key, "true or false", v);
                default
            }
        }
    }

    fn uint(&mut self, key: &str) -> Option<u64> {
        let v = self.get(key)?;
        match v.as_u64() {
            Some(n) => Some(n),
            None => {
                self.wrong(key, "a non-negative integer", v);
                None
            }
        }
    }

    fn usize_or(&mut self, key: &str, default: usize) -> usize {
        self.uint(key)
            .map_or(default, |n| usize::try_from(n).unwrap_or(usize::MAX))
    }

    fn float(&mut self, key: &str, default: f64) -> f64 {
        match self.get(key) {
            None => default,
            Some(v) => match v.as_f64() {
                Some(f) if f.is_finite() => f,
                _ => {
                    self.wrong(key, "a number", v);
                    default
                }
            },
        }
    }

    /// A duration key in seconds: at least 0 and at most [`MAX_SECONDS`].
    fn seconds(&mut self, key: &str, default: f64) -> Duration {
        let s = self.float(key, default);
        if s < 0.0 {
            self.problems.push(ConfigProblem::new(
                key,
                format!("is {s}, a negative duration"),
                "use a number of seconds >= 0",
            ));
            return Duration::from_secs_f64(default);
        }
        // Deadlines are `Instant + duration`, which panics on overflow; a
        // billion seconds (about 31 years) is far beyond any useful TTL.
        if s > MAX_SECONDS {
            self.problems.push(ConfigProblem::new(
                key,
                format!("is {s} seconds, longer than the {MAX_SECONDS:e}-second (31-year) limit"),
                "use a number of seconds up to 1e9",
            ));
            return Duration::from_secs_f64(default);
        }
        Duration::from_secs_f64(s)
    }

    fn string(&mut self, key: &str) -> Option<String> {
        match self.get(key)? {
            Value::String(s) => Some(s.clone()),
            v => {
                self.wrong(key, "a string", v);
                None
            }
        }
    }

    fn ipv4(&mut self, key: &str) -> Option<std::net::Ipv4Addr> {
        let v = self.get(key)?;
        match v.as_str().and_then(|s| s.parse().ok()) {
            Some(ip) => Some(ip),
            None => {
                self.wrong(key, "an IPv4 address in quotes, e.g. \"192.168.1.8\"", v);
                None
            }
        }
    }

    fn port(&mut self, key: &str, v: &Value) -> Option<u16> {
        match v.as_u64().and_then(|n| u16::try_from(n).ok()) {
            Some(p) => Some(p),
            None => {
                self.wrong(key, "a port number (1-65535) or a list of them", v);
                None
            }
        }
    }

    fn ports(&mut self, key: &str) -> Option<PortList> {
        match self.get(key)? {
            Value::Sequence(items) => {
                if items.is_empty() {
                    self.problems.push(ConfigProblem::new(
                        key,
                        "is an empty list",
                        format!("give {key} one port per TP rank"),
                    ));
                    return None;
                }
                let ports: Option<Vec<u16>> = items.iter().map(|i| self.port(key, i)).collect();
                ports.map(PortList::PerRank)
            }
            v => self.port(key, v).map(PortList::Single),
        }
    }

    fn choice<T>(
        &mut self,
        key: &str,
        default: T,
        parse: impl Fn(&str) -> Option<T>,
        allowed: &str,
    ) -> T {
        let Some(v) = self.get(key) else {
            return default;
        };
        match v.as_str().and_then(&parse) {
            Some(t) => t,
            None => {
                let shown = v.as_str().map_or_else(|| describe(v), |s| format!("{s:?}"));
                self.problems.push(ConfigProblem::new(
                    key,
                    format!("unknown value {shown}"),
                    format!("use one of {allowed}"),
                ));
                default
            }
        }
    }
}

fn describe(v: &Value) -> String {
    match v {
        Value::Null => "null".into(),
        Value::Bool(b) => format!("boolean {b}"),
        Value::Number(n) => format!("number {n}"),
        Value::String(s) => format!("string {s:?}"),
        Value::Sequence(_) => "a list".into(),
        Value::Mapping(_) => "a mapping".into(),
        Value::Tagged(t) => format!("tagged value {}", t.tag),
    }
}

/// Parses YAML text into a config (not yet validated) and the warnings so far.
pub(crate) fn parse(text: &str, origin: &str) -> Result<(PdConfig, Vec<String>), ConfigError> {
    let value: Value = serde_yaml::from_str(text).map_err(|e| {
        let (line, column) = e.location().map_or((0, 0), |l| (l.line(), l.column()));
        ConfigError::Syntax {
            origin: origin.to_string(),
            line,
            column,
            message: e.to_string(),
        }
    })?;
    let empty = Mapping::new();
    let map = match &value {
        Value::Mapping(m) => m,
        Value::Null => &empty,
        other => {
            return Err(ConfigError::Invalid {
                origin: origin.to_string(),
                problems: vec![ConfigProblem::new(
                    "<top level>",
                    format!("expected a mapping of keys, got {}", describe(other)),
                    "write the config as `key: value` lines",
                )],
            })
        }
    };

    let mut warnings = Vec::new();
    let mut r = Reader {
        map,
        problems: Vec::new(),
    };
    for key in map.keys() {
        match key.as_str() {
            Some(k) if KNOWN_KEYS.contains(&k) => {}
            Some(k) => warnings.push(match closest_known_key(k) {
                Some(near) => format!("{k}: unknown key, ignored (did you mean {near}?)"),
                None => format!("{k}: unknown key, ignored"),
            }),
            None => warnings.push(format!("{}: non-string key, ignored", describe(key))),
        }
    }

    let d = PdConfig::with_defaults(Role::Sender);
    let role = match r.get("pd_role") {
        None => {
            r.problems.push(ConfigProblem::new(
                "pd_role",
                "is missing",
                "set pd_role: sender (prefill) or pd_role: receiver (decode)",
            ));
            Role::Sender
        }
        Some(Value::String(s)) if s == "both" => {
            r.problems.push(ConfigProblem::new(
                "pd_role",
                "is both (a vLLM kv_both engine), which runs a sender and a receiver: one worker \
                 of the library takes one role",
                "load it with PdConfig::roles_from_yaml_str (check-config and doctor do), or \
                 write one config per role",
            ));
            Role::Sender
        }
        Some(_) => r.choice(
            "pd_role",
            Role::Sender,
            |s| s.parse().ok(),
            "sender, receiver (both: a kv_both engine's two halves)",
        ),
    };
    let num_kv_heads = r.usize_or("kv_num_heads", d.kv.num_kv_heads);
    let head_size = r.usize_or("kv_head_size", d.kv.head_size);
    let hidden_size = r.usize_or("kv_hidden_size", num_kv_heads.saturating_mul(head_size));
    let kv = KvLayout {
        num_layers: r.usize_or("kv_num_layers", d.kv.num_layers),
        num_kv_heads,
        head_size,
        hidden_size,
        dtype: r.choice(
            "kv_dtype",
            d.kv.dtype,
            |s| s.parse::<Dtype>().ok(),
            "bfloat16, float16, float32, int8, uint8",
        ),
        use_mla: r.bool("use_mla", false),
    };
    let config = PdConfig {
        enable_pd: r.bool("enable_pd", false),
        transfer_channel: r.choice(
            "transfer_channel",
            d.transfer_channel,
            |s| s.parse::<ChannelKind>().ok(),
            "hccl, tcp, shm, hixl",
        ),
        hccl_path: r.choice(
            "pd_hccl_path",
            d.hccl_path,
            |s| s.parse::<HcclPath>().ok(),
            "auto, comm, hixl",
        ),
        hixl: HixlSettings {
            protocol: r.choice(
                "pd_hixl_protocol",
                d.hixl.protocol,
                |s| s.parse::<HixlProtocol>().ok(),
                "roce, hccs",
            ),
            device_ip: r.ipv4("pd_hixl_device_ip"),
            port: r
                .get("pd_hixl_port")
                .map_or(0, |v| r.port("pd_hixl_port", v).unwrap_or(0)),
            device_phy_id: r
                .uint("pd_hixl_device_phy_id")
                .map(|n| u32::try_from(n).unwrap_or(u32::MAX)),
        },
        role,
        buffer_size: r.uint("pd_buffer_size").unwrap_or(0),
        buffer_device: r.choice(
            "pd_buffer_device",
            d.buffer_device,
            |s| s.parse::<BufferDevice>().ok(),
            "cpu, npu, npu:N",
        ),
        peer_host: r.string("pd_peer_host"),
        peer_init_port: r.ports("pd_peer_init_port"),
        peer_alloc_port: r.ports("pd_peer_alloc_port"),
        peer_query_port: r.ports("pd_peer_query_port"),
        proxy_host: r.string("pd_proxy_host"),
        proxy_port: r
            .get("pd_proxy_port")
            .and_then(|v| r.port("pd_proxy_port", v)),
        auth_secret_file: r.string("pd_auth_secret_file").map(Into::into),
        max_keys_per_message: r.uint("pd_max_keys_per_message"),
        copy_threads: r.uint("pd_copy_threads"),
        pull_mode: r.bool("pd_pull_mode", false),
        delay_pull: r.bool("pd_delay_pull", false),
        pull_done_port: r.ports("pd_pull_done_port"),
        register_port: r.ports("pd_register_port"),
        park_timeout: r.seconds("pd_park_timeout", 60.0),
        bind_host: r.string("pd_bind_host"),
        base_port: r
            .get("pd_base_port")
            .and_then(|v| r.port("pd_base_port", v)),
        data_port: r.ports("pd_data_port"),
        liveness_port: r.ports("pd_liveness_port"),
        model_identity: r.string("pd_model_identity"),
        drain_timeout: r.seconds("pd_drain_timeout", 20.0),
        use_cpu_offload: r.bool("pd_use_cpu_offload", false),
        layerwise: r.bool("pd_layerwise", false),
        push_direct_write: r.bool("pd_push_direct_write", true),
        npu_link: r.choice(
            "pd_npu_link",
            NpuLink::Auto,
            NpuLink::parse,
            &NpuLink::allowed(),
        ),
        cpu_buffer_size: r.uint("pd_cpu_buffer_size"),
        alloc_fail_backoff_ttl: r.seconds("pd_alloc_fail_backoff_ttl", 2.0),
        pull_pending_ttl: r.seconds("pd_pull_pending_ttl", 360.0),
        backpressure_reserve_pct: r.float("pd_pull_backpressure_reserve_pct", 2.0),
        push_landing_timeout: r.seconds("pd_push_landing_timeout", 30.0),
        resident_ttl: r.seconds("pd_resident_ttl", 600.0),
        pull_read_margin_pct: r.float("pd_pull_read_margin_pct", 10.0),
        chunk_size: r.usize_or("chunk_size", d.chunk_size),
        local_cpu: r.bool("local_cpu", false),
        tp_size: r.usize_or("tp_size", 1),
        peer_tp_size: r
            .uint("pd_peer_tp_size")
            .map(|n| usize::try_from(n).unwrap_or(usize::MAX)),
        kv,
    };
    if r.problems.is_empty() {
        Ok((config, warnings))
    } else {
        Err(ConfigError::Invalid {
            origin: origin.to_string(),
            problems: r.problems,
        })
    }
}

/// The known key within edit distance 2 of `key`, for typo hints.
fn closest_known_key(key: &str) -> Option<&'static str> {
    KNOWN_KEYS
        .iter()
        .map(|k| (edit_distance(key, k), *k))
        .filter(|(d, _)| *d <= 2)
        .min_by_key(|(d, _)| *d)
        .map(|(_, k)| k)
}

fn edit_distance(a: &str, b: &str) -> usize {
    let b: Vec<char> = b.chars().collect();
    let mut prev: Vec<usize> = (0..=b.len()).collect();
    for (i, ca) in a.chars().enumerate() {
        let mut cur = vec![i + 1; b.len() + 1];
        for (j, cb) in b.iter().enumerate() {
            let sub = prev[j] + usize::from(ca != *cb);
            cur[j + 1] = sub.min(prev[j + 1] + 1).min(cur[j] + 1);
        }
        prev = cur;
    }
    prev[b.len()]
}
