//! Typed configuration, loaded from LMCache-style YAML (`configs/*.yaml`).
//!
//! Loading is two steps: the YAML reader turns the text into a [`PdConfig`]
//! (type errors name the key), then [`PdConfig::validate`] checks the
//! combinations statically, without an NPU or CANN. Every problem is
//! collected, so a user fixes a file in one pass.

mod error;
mod ports;
mod yaml;

pub use error::{ConfigError, ConfigProblem};
pub use ports::loopback_port;

use crate::layout::{ChunkLayout, Dtype, MemFormat};
use std::fmt::{self, Write as _};
use std::path::Path;
use std::str::FromStr;
use std::time::Duration;

/// The longest `pd_peer_host`: a sender's node id adds at most about 50
/// bytes to it (port, pid, rank, nonce, route number) and must stay a
/// valid ZMQ routing id (1 to 255 bytes).
pub const MAX_HOST_BYTES: usize = 180;

/// Which side of the transfer this worker is.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Role {
    /// Prefill worker: produces KV chunks and sends them.
    Sender,
    /// Decode worker: receives KV chunks and loads them into its KV cache.
    Receiver,
}

impl Role {
    /// The YAML spelling.
    pub fn name(self) -> &'static str {
        match self {
            Role::Sender => "sender",
            Role::Receiver => "receiver",
        }
    }
}

impl FromStr for Role {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "sender" => Ok(Role::Sender),
            "receiver" => Ok(Role::Receiver),
            _ => Err(()),
        }
    }
}

/// The data path between sender and receiver (`transfer_channel`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum ChannelKind {
    /// HCCL one-sided put/get between Ascend devices.
    Hccl,
    /// TCP transfer servers; works across any network.
    Tcp,
    /// Shared host memory; same host only.
    Shm,
    /// HIXL's client-server one-sided put/get between Ascend devices
    /// (`libcann_hixl.so`); also what `hccl` runs with `pd_hccl_path: hixl`
    /// (or `auto` where HIXL loads).
    Hixl,
}

impl ChannelKind {
    /// The YAML spelling.
    pub fn name(self) -> &'static str {
        match self {
            ChannelKind::Hccl => "hccl",
            ChannelKind::Tcp => "tcp",
            ChannelKind::Shm => "shm",
            ChannelKind::Hixl => "hixl",
        }
    }

    /// Whether this channel registers its pools with the ACL runtime, so
    /// they must be ACL memory (the CPU pool pinned by it): hccl and hixl.
    pub fn needs_acl_memory(self) -> bool {
        matches!(self, ChannelKind::Hccl | ChannelKind::Hixl)
    }
}

impl FromStr for ChannelKind {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "hccl" => Ok(ChannelKind::Hccl),
            "tcp" => Ok(ChannelKind::Tcp),
            "shm" => Ok(ChannelKind::Shm),
            "hixl" => Ok(ChannelKind::Hixl),
            _ => Err(()),
        }
    }
}

/// Which software path `transfer_channel: hccl` moves bytes on (`pd_hccl_path`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HcclPath {
    /// HIXL's client-server path where `libcann_hixl.so` loads, HCCL's
    /// communicator path otherwise (the log says which, and why).
    Auto,
    /// HCCL's communicator path (`HcclBatchPut` / `HcclBatchGet`).
    Comm,
    /// HIXL's client-server path; an error when HIXL does not load.
    Hixl,
}

impl HcclPath {
    /// The YAML spelling.
    pub fn name(self) -> &'static str {
        match self {
            HcclPath::Auto => "auto",
            HcclPath::Comm => "comm",
            HcclPath::Hixl => "hixl",
        }
    }
}

impl FromStr for HcclPath {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "auto" => Ok(HcclPath::Auto),
            "comm" => Ok(HcclPath::Comm),
            "hixl" => Ok(HcclPath::Hixl),
            _ => Err(()),
        }
    }
}

/// The transport of this worker's HIXL endpoint (`pd_hixl_protocol`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum HixlProtocol {
    /// RDMA over Converged Ethernet, between servers (needs `pd_hixl_device_ip`).
    Roce,
    /// HCCS, between NPUs of one server or super node.
    Hccs,
}

impl HixlProtocol {
    /// The YAML spelling.
    pub fn name(self) -> &'static str {
        match self {
            HixlProtocol::Roce => "roce",
            HixlProtocol::Hccs => "hccs",
        }
    }
}

impl FromStr for HixlProtocol {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "roce" => Ok(HixlProtocol::Roce),
            "hccs" => Ok(HixlProtocol::Hccs),
            _ => Err(()),
        }
    }
}

/// What the HIXL path needs to know about this worker's device (the
/// `pd_hixl_*` keys). Only HIXL on hardware uses them; the CANN emulator
/// ignores them, and nothing here has run on hardware.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct HixlSettings {
    /// `pd_hixl_protocol` (default `roce`).
    pub protocol: HixlProtocol,
    /// `pd_hixl_device_ip`: the NPU's RoCE NIC address (`hccn_tool -i N -ip -g`).
    pub device_ip: Option<std::net::Ipv4Addr>,
    /// `pd_hixl_port`: the TCP port this worker's HIXL server listens on
    /// (default 0: a free port, picked at start).
    pub port: u16,
    /// `pd_hixl_device_phy_id`: the NPU's physical id when it differs from
    /// the logical one the pools use (default: the same).
    pub device_phy_id: Option<u32>,
}

impl Default for HixlSettings {
    fn default() -> Self {
        HixlSettings {
            protocol: HixlProtocol::Roce,
            device_ip: None,
            port: 0,
            device_phy_id: None,
        }
    }
}

/// `pd_npu_link`: the Ascend link whose published throughput by op size
/// ([`ascend_sys::link`]) a receiver prices its loads' one-sided ops with,
/// on channels that take such a link (hccl), to choose between reading
/// pull-delay chunks straight into the KV cache (one op per block run) and
/// reading each chunk's page whole, then scattering it on the device.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash)]
pub enum NpuLink {
    /// The link the CANN emulator models (`ASCEND_PD_EMU_LINK`), if any;
    /// otherwise none.
    #[default]
    Auto,
    /// No model: a load reads directly wherever the channel can.
    Off,
    /// A link of the table, by name (`a2-roce`, `a2-hccs`, `a3-hccs`, `a3-roce`).
    Named(String),
}

impl NpuLink {
    /// The YAML spelling.
    pub fn name(&self) -> &str {
        match self {
            NpuLink::Auto => "auto",
            NpuLink::Off => "none",
            NpuLink::Named(n) => n,
        }
    }

    /// Parses `auto`, `none` or a link of the built-in table.
    pub fn parse(s: &str) -> Option<NpuLink> {
        match s {
            "auto" => Some(NpuLink::Auto),
            "none" => Some(NpuLink::Off),
            n => ascend_sys::link::Table::builtin()
                .link(n)
                .map(|_| NpuLink::Named(n.to_string())),
        }
    }

    /// The values [`NpuLink::parse`] takes, for error messages.
    pub fn allowed() -> String {
        let mut v = vec!["auto", "none"];
        v.extend(ascend_sys::link::Table::builtin().names());
        v.join(", ")
    }

    /// The link this setting selects now: `auto` reads
    /// `ASCEND_PD_EMU_LINK` (an unknown value there is an error naming the
    /// known ones).
    pub fn resolve(&self) -> Result<Option<&'static ascend_sys::link::Link>, String> {
        let table = ascend_sys::link::Table::builtin();
        match self {
            NpuLink::Off => Ok(None),
            NpuLink::Named(n) => table
                .link(n)
                .map(Some)
                .ok_or_else(|| format!("pd_npu_link: {n:?} is not a known link")),
            NpuLink::Auto => {
                let env = std::env::var(ascend_sys::link::LINK_ENV).ok();
                table.select(env.as_deref()).map_err(|e| e.to_string())
            }
        }
    }
}

/// Where the main transfer buffer lives (`pd_buffer_device`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum BufferDevice {
    /// Host memory.
    Cpu,
    /// NPU memory; `npu` means the worker's current device, `npu:N` device N.
    Npu(Option<u32>),
}

impl BufferDevice {
    /// Whether this is an NPU device.
    pub fn is_npu(self) -> bool {
        matches!(self, BufferDevice::Npu(_))
    }
}

impl fmt::Display for BufferDevice {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            BufferDevice::Cpu => f.write_str("cpu"),
            BufferDevice::Npu(None) => f.write_str("npu"),
            BufferDevice::Npu(Some(n)) => write!(f, "npu:{n}"),
        }
    }
}

impl FromStr for BufferDevice {
    type Err = ();
    fn from_str(s: &str) -> Result<Self, ()> {
        match s {
            "cpu" => Ok(BufferDevice::Cpu),
            "npu" => Ok(BufferDevice::Npu(None)),
            _ => match s.strip_prefix("npu:").map(str::parse::<u32>) {
                Some(Ok(n)) => Ok(BufferDevice::Npu(Some(n))),
                _ => Err(()),
            },
        }
    }
}

/// The transfer mode, derived from `pd_pull_mode` and `pd_delay_pull`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum TransferMode {
    /// Receiver allocates, sender writes.
    Push,
    /// Sender pins and advertises, receiver reads at once.
    PullEager,
    /// Receiver keeps proxies and reads when the KV cache is loaded.
    PullDelay,
}

impl TransferMode {
    /// The name used in logs, the bench and the handshake.
    pub fn name(self) -> &'static str {
        match self {
            TransferMode::Push => "push",
            TransferMode::PullEager => "pull-eager",
            TransferMode::PullDelay => "pull-delay",
        }
    }

    /// Whether the receiver reads (pull) rather than the sender writing (push).
    pub fn is_pull(self) -> bool {
        !matches!(self, TransferMode::Push)
    }
}

impl fmt::Display for TransferMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

/// A port key: one port for every TP rank, or one shared by all.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum PortList {
    /// A single int in the YAML; every rank `r` uses it unchanged.
    Single(u16),
    /// A list in the YAML; rank `r` uses entry `r`.
    PerRank(Vec<u16>),
}

impl PortList {
    /// The port of TP rank `rank`, if the list has one.
    pub fn for_rank(&self, rank: usize) -> Option<u16> {
        match self {
            PortList::Single(p) => Some(*p),
            PortList::PerRank(v) => v.get(rank).copied(),
        }
    }

    /// How many ranks the key covers (`None` = any number).
    pub fn ranks(&self) -> Option<usize> {
        match self {
            PortList::Single(_) => None,
            PortList::PerRank(v) => Some(v.len()),
        }
    }

    fn ports(&self) -> &[u16] {
        match self {
            PortList::Single(p) => std::slice::from_ref(p),
            PortList::PerRank(v) => v,
        }
    }
}

impl fmt::Display for PortList {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PortList::Single(p) => write!(f, "{p}"),
            PortList::PerRank(v) => write!(f, "{v:?}"),
        }
    }
}

/// Ports of one TP rank under `pd_base_port`: rank `r`'s listeners take
/// `base + PORT_STRIDE * r + slot`.
pub const PORT_STRIDE: u16 = 20;

/// A listening socket a worker opens.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Listener {
    /// Receiver: the channel handshake (`pd_peer_init_port`).
    Init,
    /// Receiver: allocation requests and pull notices (`pd_peer_alloc_port`).
    Alloc,
    /// Receiver: LMCache's cache query (`pd_peer_query_port`, opt-in).
    Query,
    /// Sender, pull modes: PullDoneSignal (`pd_pull_done_port`).
    Done,
    /// Sender: decode registrations, router flow (`pd_register_port`).
    Register,
    /// tcp channel: the transfer server (`pd_data_port`).
    Data,
    /// hccl / hixl channel: the liveness listener (`pd_liveness_port`).
    Liveness,
    /// HIXL path: the HIXL server (`pd_hixl_port`).
    Hixl,
}

impl Listener {
    /// Every listener, in table order.
    pub const ALL: [Listener; 8] = [
        Listener::Init,
        Listener::Alloc,
        Listener::Query,
        Listener::Done,
        Listener::Register,
        Listener::Data,
        Listener::Liveness,
        Listener::Hixl,
    ];

    /// The config key that fixes its port.
    pub fn key(self) -> &'static str {
        match self {
            Listener::Init => "pd_peer_init_port",
            Listener::Alloc => "pd_peer_alloc_port",
            Listener::Query => "pd_peer_query_port",
            Listener::Done => "pd_pull_done_port",
            Listener::Register => "pd_register_port",
            Listener::Data => "pd_data_port",
            Listener::Liveness => "pd_liveness_port",
            Listener::Hixl => "pd_hixl_port",
        }
    }

    /// What it is, in a few words.
    pub fn what(self) -> &'static str {
        match self {
            Listener::Init => "channel handshake (ZMQ)",
            Listener::Alloc => "allocations and pull notices (ZMQ)",
            Listener::Query => "LMCache cache queries (ZMQ)",
            Listener::Done => "pull done signals (ZMQ)",
            Listener::Register => "decode registrations (ZMQ)",
            Listener::Data => "tcp transfer server",
            Listener::Liveness => "liveness links",
            Listener::Hixl => "HIXL server",
        }
    }

    /// Its offset in a rank's `pd_base_port` block for a worker of
    /// `role`: a receiver's are 0-5, a sender's 10-14, so a decode and a
    /// prefill (or the two halves of a `kv_both` engine) share one base.
    pub fn slot(self, role: Role) -> u16 {
        let sender = if role == Role::Sender { 10 } else { 0 };
        match self {
            Listener::Init => 0,
            Listener::Alloc => 1,
            Listener::Query => 2,
            Listener::Data => 3 + sender,
            Listener::Liveness => 4 + sender,
            Listener::Hixl => 5 + sender,
            Listener::Done => 10,
            Listener::Register => 11,
        }
    }

    /// Whether a worker of `role` opens it at all.
    pub fn opened_by(self, role: Role) -> bool {
        match self {
            Listener::Init | Listener::Alloc | Listener::Query => role == Role::Receiver,
            Listener::Done | Listener::Register => role == Role::Sender,
            Listener::Data | Listener::Liveness | Listener::Hixl => true,
        }
    }
}

/// The model's KV geometry the backend needs to size pages
/// (`kv_*` keys; LMCache takes them from the engine, we take them from the file).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvLayout {
    /// Transformer layers (`kv_num_layers`).
    pub num_layers: usize,
    /// KV heads per TP rank (`kv_num_heads`).
    pub num_kv_heads: usize,
    /// Head size (`kv_head_size`).
    pub head_size: usize,
    /// Elements per token per layer (`kv_hidden_size`, default heads × head size).
    pub hidden_size: usize,
    /// Element type (`kv_dtype`).
    pub dtype: Dtype,
    /// Multi-head latent attention: one latent tensor per layer (`use_mla`).
    pub use_mla: bool,
}

impl Default for KvLayout {
    /// A Llama-3-8B-shaped cache per TP rank: 32 layers, 8 KV heads × 128, bf16.
    fn default() -> Self {
        KvLayout {
            num_layers: 32,
            num_kv_heads: 8,
            head_size: 128,
            hidden_size: 8 * 128,
            dtype: Dtype::BFloat16,
            use_mla: false,
        }
    }
}

/// Fewest keys per message the derived default allows.
pub const MIN_KEYS_PER_MESSAGE: u64 = 1024;
/// Frame budget per key (the key string, a buffer UUID and an index, with
/// room for long model names in the key).
pub const MESSAGE_BYTES_PER_KEY: u64 = 1024;
/// Frame budget besides the keys.
pub const MESSAGE_BYTES_FIXED: u64 = 64 * 1024;

/// Keys only a sender reads, left out of the receiver half of a
/// `pd_role: both` config (a receiver would warn they are ignored).
pub const SENDER_ONLY_KEYS: &[&str] = &["pd_layerwise", "pd_pull_done_port"];

/// The complete configuration of one PD worker, defaults filled in.
#[derive(Clone, Debug, PartialEq)]
pub struct PdConfig {
    /// `enable_pd`: must be true for this backend to run.
    pub enable_pd: bool,
    /// `transfer_channel`.
    pub transfer_channel: ChannelKind,
    /// `pd_hccl_path` (with `transfer_channel: hccl`; default `auto`).
    pub hccl_path: HcclPath,
    /// The `pd_hixl_*` keys (the HIXL path's device endpoint).
    pub hixl: HixlSettings,
    /// `pd_role`.
    pub role: Role,
    /// `pd_buffer_size` in bytes, as written (see [`PdConfig::buffer_pool_bytes`]).
    pub buffer_size: u64,
    /// `pd_buffer_device`.
    pub buffer_device: BufferDevice,
    /// `pd_peer_host`: the receiver's listen host; on a pull sender, the host it advertises for done signals.
    pub peer_host: Option<String>,
    /// `pd_peer_init_port`: channel handshake port(s) of the receiver.
    pub peer_init_port: Option<PortList>,
    /// `pd_peer_alloc_port`: allocation REQ/REP port(s) of the receiver.
    pub peer_alloc_port: Option<PortList>,
    /// `pd_peer_query_port`: optional port(s) where the receiver also
    /// answers upstream LMCache's `CacheQueryRequest` (the decoder cache
    /// probe), apart from the allocation socket.
    pub peer_query_port: Option<PortList>,
    /// `pd_proxy_host`.
    pub proxy_host: Option<String>,
    /// `pd_proxy_port`.
    pub proxy_port: Option<u16>,
    /// `pd_auth_secret_file`: the deployment's shared secret, which every
    /// peer must prove it holds (see [`crate::auth`]); the environment
    /// variable `ASCEND_PD_AUTH_SECRET_FILE` overrides it. `None`: the data
    /// plane is unauthenticated (a warning says so once).
    pub auth_secret_file: Option<std::path::PathBuf>,
    /// `pd_max_keys_per_message`: the most keys one side-channel message
    /// may carry; bounds every receiving socket's frame size
    /// ([`PdConfig::max_message_bytes`]). `None`: as many chunks as this
    /// worker's pools hold, at least [`MIN_KEYS_PER_MESSAGE`].
    pub max_keys_per_message: Option<u64>,
    /// `pd_copy_threads`: threads of the process's copy pool (see
    /// [`crate::memory::copy_pool`]), which runs large shm transfers and
    /// host KV-cache gathers/scatters. `1`: every copy runs inline on the
    /// calling thread and no pool is built. `None`: the cores available,
    /// at most 8 ([`PdConfig::copy_threads`]).
    pub copy_threads: Option<u64>,
    /// `pd_pull_mode`.
    pub pull_mode: bool,
    /// `pd_delay_pull`.
    pub delay_pull: bool,
    /// `pd_pull_done_port`: where a pull sender binds its PullDoneSignal PULL socket.
    pub pull_done_port: Option<PortList>,
    /// `pd_register_port` (sender): where each prefill rank takes decode
    /// registrations for parked transfers (router-native flow). Default:
    /// a free port chosen at start, which the worker reports
    /// (`SaveQueue::register_port` in the request API).
    pub register_port: Option<PortList>,
    /// `pd_park_timeout` (sender, default 60 s): how long a parked
    /// transfer waits for a decode to register before its pages are freed.
    pub park_timeout: Duration,
    /// `pd_bind_host`: the local address every listener of this worker
    /// binds (`0.0.0.0`: all interfaces). Default: `pd_peer_host`, which
    /// stays the address peers are told (the advertised address).
    pub bind_host: Option<String>,
    /// `pd_base_port`: fills every listener port not set by its own key,
    /// `base + 20 * rank + slot` (see [`Listener::slot`]); unset, such
    /// listeners take a free port at start.
    pub base_port: Option<u16>,
    /// `pd_data_port`: the tcp channel's transfer server, per TP rank.
    pub data_port: Option<PortList>,
    /// `pd_liveness_port`: the hccl / hixl channel's liveness listener,
    /// per TP rank.
    pub liveness_port: Option<PortList>,
    /// `pd_model_identity`: what this worker's KV is (model, revision,
    /// dtype: the vLLM connector fills it). Peers whose identities differ
    /// are refused at the handshake, before any byte moves.
    pub model_identity: Option<String>,
    /// `pd_drain_timeout` (sender, default 20 s): on close, how long the
    /// sender keeps serving the transfers in flight (new saves refused)
    /// before it tears them down.
    pub drain_timeout: Duration,
    /// `pd_use_cpu_offload`.
    pub use_cpu_offload: bool,
    /// `pd_layerwise` (sender, push mode): save each layer's KV as soon
    /// as the prefill wrote it, so the transfer runs during the forward
    /// pass (the engine integration hands layers over; see
    /// `SaveQueue::open_layered`).
    pub layerwise: bool,
    /// `pd_push_direct_write` (sender, push mode; default true): a save from
    /// a host KV cache writes its bytes straight from the cache into the
    /// receiver's pages, with no staging page of ours in between (one copy
    /// less), over channels that can send from caller memory (shm, tcp);
    /// false, or another channel or an NPU cache, gathers into pool pages
    /// first.
    pub push_direct_write: bool,
    /// `pd_npu_link` (receiver; default `auto`): see [`NpuLink`].
    pub npu_link: NpuLink,
    /// `pd_cpu_buffer_size`; `None` falls back to `pd_buffer_size`.
    pub cpu_buffer_size: Option<u64>,
    /// `pd_alloc_fail_backoff_ttl` (default 2 s).
    pub alloc_fail_backoff_ttl: Duration,
    /// `pd_pull_pending_ttl` (default 360 s).
    pub pull_pending_ttl: Duration,
    /// `pd_pull_backpressure_reserve_pct` (default 2.0).
    pub backpressure_reserve_pct: f64,
    /// `pd_push_landing_timeout` (receiver, default 30 s): how long pages
    /// allocated for a push wait for the sender's notice before they are
    /// revoked (and kept quarantined until the sender can no longer write them).
    pub push_landing_timeout: Duration,
    /// `pd_resident_ttl` (receiver, default 600 s; 0 = never): how long a
    /// chunk that landed here waits to be loaded or cancelled before its
    /// page goes back to the pool. A request the engine dropped without
    /// cancelling would otherwise hold its pages for the receiver's life.
    pub resident_ttl: Duration,
    /// `pd_pull_read_margin_pct` (receiver, default 10): the last share of
    /// a pull's agreed lease in which no read is started.
    pub pull_read_margin_pct: f64,
    /// `chunk_size` in tokens (default 256).
    pub chunk_size: usize,
    /// `local_cpu` (LMCache's local CPU cache; carried, not used by this backend).
    pub local_cpu: bool,
    /// `tp_size`: tensor-parallel ranks this config serves (default 1).
    pub tp_size: usize,
    /// `pd_peer_tp_size`: the other side's TP size (default `tp_size`).
    /// When it differs, KV heads are split per [`crate::layout::tp::TpPlan`]:
    /// one must be a multiple of the other.
    pub peer_tp_size: Option<usize>,
    /// The KV geometry.
    pub kv: KvLayout,
}

impl PdConfig {
    /// A config with every default and no ports, for `role` (build on it in code).
    pub fn with_defaults(role: Role) -> PdConfig {
        PdConfig {
            enable_pd: true,
            transfer_channel: ChannelKind::Hccl,
            hccl_path: HcclPath::Auto,
            hixl: HixlSettings::default(),
            role,
            buffer_size: 0,
            buffer_device: BufferDevice::Npu(None),
            peer_host: None,
            peer_init_port: None,
            peer_alloc_port: None,
            peer_query_port: None,
            proxy_host: None,
            proxy_port: None,
            auth_secret_file: None,
            max_keys_per_message: None,
            copy_threads: None,
            pull_mode: false,
            delay_pull: false,
            pull_done_port: None,
            register_port: None,
            park_timeout: Duration::from_secs(60),
            bind_host: None,
            base_port: None,
            data_port: None,
            liveness_port: None,
            model_identity: None,
            drain_timeout: Duration::from_secs(20),
            use_cpu_offload: false,
            layerwise: false,
            push_direct_write: true,
            npu_link: NpuLink::Auto,
            cpu_buffer_size: None,
            alloc_fail_backoff_ttl: Duration::from_secs(2),
            pull_pending_ttl: Duration::from_secs(360),
            backpressure_reserve_pct: 2.0,
            push_landing_timeout: Duration::from_secs(30),
            resident_ttl: Duration::from_secs(600),
            pull_read_margin_pct: 10.0,
            chunk_size: 256,
            local_cpu: false,
            tp_size: 1,
            peer_tp_size: None,
            kv: KvLayout::default(),
        }
    }

    /// Reads, parses and validates a YAML file.
    pub fn load(path: impl AsRef<Path>) -> Result<LoadedConfig, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::from_yaml_str(&text, &path.display().to_string())
    }

    /// Reads a YAML file as [`PdConfig::roles_from_yaml_str`] does.
    pub fn load_roles(path: impl AsRef<Path>) -> Result<Vec<LoadedConfig>, ConfigError> {
        let path = path.as_ref();
        let text = std::fs::read_to_string(path).map_err(|source| ConfigError::Read {
            path: path.to_path_buf(),
            source,
        })?;
        Self::roles_from_yaml_str(&text, &path.display().to_string())
    }

    /// Parses and validates YAML text of any `pd_role`: `both` (a vLLM
    /// `kv_both` engine) gives its sender half and its receiver half (the
    /// receiver half without the sender-only keys [`SENDER_ONLY_KEYS`]),
    /// each validated as its role; `sender` or `receiver` gives one config.
    pub fn roles_from_yaml_str(text: &str, origin: &str) -> Result<Vec<LoadedConfig>, ConfigError> {
        let doc: Option<serde_yaml::Mapping> = serde_yaml::from_str(text).ok();
        let both = doc.as_ref().is_some_and(|m| {
            m.get("pd_role")
                .and_then(|v| v.as_str())
                .is_some_and(|r| r == "both")
        });
        let Some(doc) = doc.filter(|_| both) else {
            return Ok(vec![Self::from_yaml_str(text, origin)?]);
        };
        [Role::Sender, Role::Receiver]
            .into_iter()
            .map(|role| {
                let mut half = doc.clone();
                half.insert("pd_role".into(), role.name().into());
                if role == Role::Receiver {
                    for k in SENDER_ONLY_KEYS {
                        half.remove(*k);
                    }
                }
                let text = serde_yaml::to_string(&half).expect("a mapping serializes");
                Self::from_yaml_str(&text, &format!("{origin} ({} half)", role.name()))
            })
            .collect()
    }

    /// Parses and validates YAML text; `origin` names it in errors.
    pub fn from_yaml_str(text: &str, origin: &str) -> Result<LoadedConfig, ConfigError> {
        let (config, mut warnings) = yaml::parse(text, origin)?;
        match config.validate() {
            Ok(more) => {
                warnings.extend(more);
                Ok(LoadedConfig { config, warnings })
            }
            Err(problems) => Err(ConfigError::Invalid {
                origin: origin.to_string(),
                problems,
            }),
        }
    }

    /// The transfer mode these flags select.
    pub fn mode(&self) -> TransferMode {
        match (self.pull_mode, self.delay_pull) {
            (false, _) => TransferMode::Push,
            (true, false) => TransferMode::PullEager,
            (true, true) => TransferMode::PullDelay,
        }
    }

    /// The other side's TP size (`pd_peer_tp_size`, default `tp_size`).
    pub fn peer_tp(&self) -> usize {
        self.peer_tp_size.unwrap_or(self.tp_size)
    }

    /// How KV heads split between this side's TP ranks and the peer's.
    /// `kv_num_heads` is per rank of this side; MLA's latent is replicated.
    pub fn tp_plan(&self) -> Result<crate::layout::tp::TpPlan, String> {
        let (prefill, decode) = match self.role {
            Role::Sender => (self.tp_size, self.peer_tp()),
            Role::Receiver => (self.peer_tp(), self.tp_size),
        };
        let total = if self.kv.use_mla {
            1
        } else {
            self.kv.num_kv_heads.saturating_mul(self.tp_size)
        };
        crate::layout::tp::TpPlan::new(prefill, decode, total, self.kv.use_mla)
    }

    /// Elements of one KV head in a chunk token (the latent for MLA).
    pub fn head_elements(&self) -> usize {
        match self.kv.use_mla {
            true => self.kv.hidden_size,
            false => self.kv.head_size,
        }
    }

    /// The geometry of one full chunk.
    pub fn chunk_layout(&self) -> ChunkLayout {
        ChunkLayout {
            fmt: if self.kv.use_mla {
                MemFormat::Mla
            } else {
                MemFormat::Kv2Ltd
            },
            layers: self.kv.num_layers,
            tokens: self.chunk_size,
            hidden: self.kv.hidden_size,
            dtype: self.kv.dtype,
        }
    }

    /// Bytes of one page (one full chunk).
    pub fn page_bytes(&self) -> u64 {
        self.chunk_layout().page_bytes() as u64
    }

    /// Whether this worker has an NPU pool (`pd_buffer_device` is `npu*`).
    pub fn has_npu_pool(&self) -> bool {
        self.buffer_device.is_npu()
    }

    /// Whether this worker has a CPU pool (device `cpu`, or sender offload).
    pub fn has_cpu_pool(&self) -> bool {
        self.buffer_device == BufferDevice::Cpu || self.use_cpu_offload
    }

    /// Effective size of the pool `pd_buffer_size` describes: whole pages, at least one.
    pub fn buffer_pool_bytes(&self) -> u64 {
        round_up_pages(self.buffer_size, self.page_bytes())
    }

    /// Effective CPU pool size: `pd_cpu_buffer_size` (or `pd_buffer_size`) in whole pages.
    ///
    /// With `pd_buffer_device: cpu` and no offload, the CPU pool is the main
    /// buffer and has `pd_buffer_size`.
    pub fn cpu_pool_bytes(&self) -> u64 {
        let raw = if self.use_cpu_offload {
            self.cpu_buffer_size.unwrap_or(self.buffer_size)
        } else {
            self.buffer_size
        };
        round_up_pages(raw, self.page_bytes())
    }

    /// `pd_peer_init_port` of TP rank `rank` (on a receiver, its own:
    /// `pd_base_port`'s slot when the key is unset).
    pub fn init_port(&self, rank: usize) -> Option<u16> {
        match &self.peer_init_port {
            Some(list) => list.for_rank(rank),
            None => self.own_base(Listener::Init, rank),
        }
    }

    /// The port `listener` of TP rank `rank` takes from `pd_base_port`,
    /// when this role opens it and the base is set.
    fn own_base(&self, listener: Listener, rank: usize) -> Option<u16> {
        let base = self.base_port?;
        if !listener.opened_by(self.role) {
            return None;
        }
        let rank = u16::try_from(rank).ok()?;
        base.checked_add(rank.checked_mul(PORT_STRIDE)?)?
            .checked_add(listener.slot(self.role))
    }

    /// The port of a listener whose key is `list`: its entry for `rank`,
    /// else `pd_base_port`'s slot, else 0 (a free port at start).
    fn own_port(&self, list: &Option<PortList>, listener: Listener, rank: usize) -> u16 {
        list.as_ref()
            .and_then(|l| l.for_rank(rank))
            .or_else(|| self.own_base(listener, rank))
            .unwrap_or(0)
    }

    /// The address every listener binds: `pd_bind_host`, else
    /// `pd_peer_host`, else loopback.
    pub fn bind_host(&self) -> &str {
        self.bind_host
            .as_deref()
            .or(self.peer_host.as_deref())
            .unwrap_or("127.0.0.1")
    }

    /// The tcp transfer server's port of TP rank `rank` (`pd_data_port`; 0: free).
    pub fn data_port(&self, rank: usize) -> u16 {
        self.own_port(&self.data_port, Listener::Data, rank)
    }

    /// The liveness listener's port of TP rank `rank` (`pd_liveness_port`; 0: free).
    pub fn liveness_port(&self, rank: usize) -> u16 {
        self.own_port(&self.liveness_port, Listener::Liveness, rank)
    }

    /// The HIXL server's port of TP rank `rank`: `pd_hixl_port` (one for
    /// every rank) when set, else `pd_base_port`'s slot, else 0 (free).
    pub fn hixl_port(&self, rank: usize) -> u16 {
        match self.hixl.port {
            0 => self.own_base(Listener::Hixl, rank).unwrap_or(0),
            p => p,
        }
    }

    /// Whether this worker opens `listener` (by role, channel and mode).
    pub fn opens(&self, listener: Listener) -> bool {
        if !listener.opened_by(self.role) {
            return false;
        }
        let hccl_like = matches!(self.transfer_channel, ChannelKind::Hccl | ChannelKind::Hixl);
        match listener {
            Listener::Init | Listener::Alloc | Listener::Register => true,
            Listener::Query => self.peer_query_port.is_some(),
            Listener::Done => self.pull_mode,
            Listener::Data => self.transfer_channel == ChannelKind::Tcp,
            Listener::Liveness => hccl_like,
            Listener::Hixl => {
                self.transfer_channel == ChannelKind::Hixl
                    || (self.transfer_channel == ChannelKind::Hccl
                        && self.hccl_path != HcclPath::Comm)
            }
        }
    }

    /// Every listener TP rank `rank` of this worker opens, with its port
    /// (0: a free port picked at start). `Hixl` is listed where the HIXL
    /// path may run (`pd_hccl_path: auto` picks it only where HIXL loads).
    pub fn port_table(&self, rank: usize) -> Vec<(Listener, u16)> {
        Listener::ALL
            .iter()
            .filter(|l| self.opens(**l))
            .map(|&l| {
                let port = match l {
                    Listener::Init => self.init_port(rank).unwrap_or(0),
                    Listener::Alloc => self.alloc_port(rank).unwrap_or(0),
                    Listener::Query => self.query_port(rank).unwrap_or(0),
                    Listener::Done => self.done_port(rank).unwrap_or(0),
                    Listener::Register => self.register_port(rank),
                    Listener::Data => self.data_port(rank),
                    Listener::Liveness => self.liveness_port(rank),
                    Listener::Hixl => self.hixl_port(rank),
                };
                (l, port)
            })
            .collect()
    }

    /// The most keys one side-channel message may carry:
    /// `pd_max_keys_per_message`, or as many chunks as the pools hold (at
    /// least [`MIN_KEYS_PER_MESSAGE`]).
    pub fn max_keys_per_message(&self) -> u64 {
        self.max_keys_per_message.unwrap_or_else(|| {
            let page = self.page_bytes().max(1);
            let pages = self.buffer_pool_bytes() / page
                + if self.use_cpu_offload || !self.has_npu_pool() {
                    0
                } else {
                    self.cpu_pool_bytes() / page
                };
            pages.max(MIN_KEYS_PER_MESSAGE)
        })
    }

    /// Threads of the copy pool: `pd_copy_threads`, or the cores
    /// available at most 8 (see [`crate::memory::copy_pool`]).
    pub fn copy_threads(&self) -> usize {
        match self.copy_threads {
            Some(n) => n.clamp(1, 256) as usize,
            None => crate::memory::copy_pool::default_threads(),
        }
    }

    /// The largest frame a receiving side-channel socket accepts (ZMQ
    /// drops a longer one before buffering it, and the connection with
    /// it): [`MESSAGE_BYTES_FIXED`] plus [`MESSAGE_BYTES_PER_KEY`] per key.
    pub fn max_message_bytes(&self) -> i64 {
        let keys = self.max_keys_per_message().min(1 << 32);
        (MESSAGE_BYTES_FIXED + keys * MESSAGE_BYTES_PER_KEY) as i64
    }

    /// `pd_peer_alloc_port` of TP rank `rank` (on a receiver, its own:
    /// `pd_base_port`'s slot when the key is unset).
    pub fn alloc_port(&self, rank: usize) -> Option<u16> {
        match &self.peer_alloc_port {
            Some(list) => list.for_rank(rank),
            None => self.own_base(Listener::Alloc, rank),
        }
    }

    /// `pd_peer_query_port` of TP rank `rank`, if configured.
    pub fn query_port(&self, rank: usize) -> Option<u16> {
        self.peer_query_port.as_ref()?.for_rank(rank)
    }

    /// The PullDoneSignal port of TP rank `rank`: `pd_pull_done_port[rank]`,
    /// else `pd_base_port`'s slot, else `pd_peer_alloc_port[rank] + 100`.
    pub fn done_port(&self, rank: usize) -> Option<u16> {
        match &self.pull_done_port {
            Some(list) => list.for_rank(rank),
            None => self
                .own_base(Listener::Done, rank)
                .or_else(|| self.alloc_port(rank)?.checked_add(100)),
        }
    }

    /// The registration port of TP rank `rank` (`pd_register_port`, else
    /// `pd_base_port`'s slot); 0: a free port chosen when the sender starts.
    pub fn register_port(&self, rank: usize) -> u16 {
        self.own_port(&self.register_port, Listener::Register, rank)
    }

    /// Checks the combinations of keys. Returns warnings when usable, or every problem.
    pub fn validate(&self) -> Result<Vec<String>, Vec<ConfigProblem>> {
        let mut problems = Vec::new();
        let mut warnings = Vec::new();
        let mut bad = |key: &str, problem: String, fix: &str| {
            problems.push(ConfigProblem::new(key, problem, fix));
        };

        if !self.enable_pd {
            bad(
                "enable_pd",
                "is false, so the PD backend has nothing to do".into(),
                "set enable_pd: true",
            );
        }
        if self.delay_pull && !self.pull_mode {
            bad(
                "pd_delay_pull",
                "is true but pd_pull_mode is false; delay-pull is a pull mode".into(),
                "set pd_pull_mode: true, or remove pd_delay_pull",
            );
        }
        if self.layerwise && self.pull_mode {
            bad(
                "pd_layerwise",
                "is true but pd_pull_mode is true; layer-wise saving is a push mode (the \
                 receiver allocates at once and the sender writes each layer as the prefill \
                 produces it; a pull announces a chunk only once it is whole)"
                    .into(),
                "set pd_pull_mode: false (push), or remove pd_layerwise",
            );
        }
        if self.layerwise && self.role == Role::Receiver {
            warnings.push(
                "pd_layerwise: ignored on a receiver (a layer-wise push lands like any push)"
                    .to_string(),
            );
        }
        if self.use_cpu_offload && self.role == Role::Receiver {
            bad(
                "pd_use_cpu_offload",
                "is a sender option but pd_role is receiver".into(),
                "remove pd_use_cpu_offload from the receiver config",
            );
        }
        if self.use_cpu_offload && !self.pull_mode {
            bad(
                "pd_use_cpu_offload",
                "needs pd_pull_mode: true (the receiver reads the offloaded pages; push mode writes from the NPU pool)".into(),
                "set pd_pull_mode: true, or remove pd_use_cpu_offload",
            );
        }
        if self.cpu_buffer_size.is_some() && !self.use_cpu_offload {
            warnings.push(
                "pd_cpu_buffer_size: ignored because pd_use_cpu_offload is false".to_string(),
            );
        }
        if self.use_cpu_offload && self.buffer_device == BufferDevice::Cpu {
            warnings.push(
                "pd_use_cpu_offload: pd_buffer_device is already cpu, so offload changes nothing"
                    .to_string(),
            );
        }
        if self.hccl_path != HcclPath::Auto && self.transfer_channel != ChannelKind::Hccl {
            warnings.push(format!(
                "pd_hccl_path: ignored because transfer_channel is {} (it picks the path of \
                 transfer_channel: hccl)",
                self.transfer_channel.name()
            ));
        }
        if self.hixl != HixlSettings::default() && !self.transfer_channel.needs_acl_memory() {
            warnings.push(format!(
                "pd_hixl_*: ignored because transfer_channel is {} (they describe the HIXL \
                 endpoint of transfer_channel: hixl or hccl)",
                self.transfer_channel.name()
            ));
        }
        if self.transfer_channel == ChannelKind::Shm && self.has_npu_pool() {
            bad(
                "pd_buffer_device",
                format!(
                    "is {} but transfer_channel shm moves host memory only (device memory is not host-mappable)",
                    self.buffer_device
                ),
                "use pd_buffer_device: cpu with shm, or transfer_channel: hccl, hixl or tcp for NPU buffers",
            );
        }
        if self.buffer_size == 0 {
            bad(
                "pd_buffer_size",
                "is missing or 0".into(),
                "set the buffer pool size in bytes, e.g. pd_buffer_size: 1073741824",
            );
        }
        if self.chunk_size == 0 {
            bad(
                "chunk_size",
                "is 0".into(),
                "set chunk_size to the tokens per chunk, e.g. 256",
            );
        }
        if self.tp_size == 0 {
            bad(
                "tp_size",
                "is 0".into(),
                "set tp_size to the tensor-parallel size, at least 1",
            );
        }
        if let Err(e) = self.tp_plan() {
            bad(
                "pd_peer_tp_size",
                format!(
                    "tp_size {} with pd_peer_tp_size {}: {e}",
                    self.tp_size,
                    self.peer_tp()
                ),
                "give each side's real TP size (prefill and decode sizes must divide one \
                 another) and kv_num_heads per rank",
            );
        }
        if self.peer_tp() != self.tp_size
            && !self.kv.use_mla
            && self.kv.hidden_size != self.kv.num_kv_heads * self.kv.head_size
        {
            bad(
                "kv_hidden_size",
                format!(
                    "is {}, not kv_num_heads × kv_head_size ({} × {}); heads cannot be split \
                     between TP sizes",
                    self.kv.hidden_size, self.kv.num_kv_heads, self.kv.head_size
                ),
                "leave kv_hidden_size out, or use the same TP size on both sides",
            );
        }
        if self.kv.num_layers == 0 || self.kv.hidden_size == 0 {
            bad(
                "kv_num_layers",
                "the KV layout has a zero dimension (layers or hidden size)".into(),
                "set kv_num_layers, kv_num_heads and kv_head_size (or kv_hidden_size) to the model's values",
            );
        }
        if !(0.0..100.0).contains(&self.backpressure_reserve_pct) {
            bad(
                "pd_pull_backpressure_reserve_pct",
                format!("is {}, outside [0, 100)", self.backpressure_reserve_pct),
                "use a percentage such as 2.0",
            );
        }
        if let Some(n) = self.max_keys_per_message {
            if !(1..=1 << 24).contains(&n) {
                bad(
                    "pd_max_keys_per_message",
                    format!("is {n}; a message carries 1 to 16777216 keys"),
                    "leave it out (sized from the pools) or set the longest request's chunk count",
                );
            }
        }
        if let Some(n) = self.copy_threads {
            if !(1..=256).contains(&n) {
                bad(
                    "pd_copy_threads",
                    format!("is {n}; the copy pool runs 1 to 256 threads"),
                    "leave it out (sized from the cores, at most 8), or set 1 to copy on the calling thread",
                );
            }
        }
        if self.park_timeout.is_zero() {
            bad(
                "pd_park_timeout",
                "is 0, so every parked transfer would be freed before a decode could register".into(),
                "use a positive number of seconds longer than a decode takes to schedule a request, e.g. 60.0",
            );
        }
        if self.push_landing_timeout.is_zero() {
            bad(
                "pd_push_landing_timeout",
                "is 0, so every push would be reclaimed before its data could land".into(),
                "use a positive number of seconds longer than a push write takes, e.g. 30.0",
            );
        }
        if !(0.0..100.0).contains(&self.pull_read_margin_pct) {
            bad(
                "pd_pull_read_margin_pct",
                format!(
                    "is {}, outside [0, 100): it is the share of the pull lease, at its end, in which no read starts",
                    self.pull_read_margin_pct
                ),
                "use a percentage such as 10.0",
            );
        }
        if self.pull_pending_ttl.is_zero() {
            bad(
                "pd_pull_pending_ttl",
                "is 0, so pinned pages would be freed while receivers may still read them".into(),
                "use a positive number of seconds, e.g. 360.0",
            );
        }

        if !self.resident_ttl.is_zero() && self.resident_ttl < Duration::from_secs(10) {
            warnings.push(format!(
                "pd_resident_ttl: {:?} is shorter than most engines take to schedule a request; \
                 chunks not loaded by then are dropped (use 0 to keep them until loaded)",
                self.resident_ttl
            ));
        }

        let page = self.page_bytes();
        let page_ok = page > 0 && self.chunk_size > 0;
        if page_ok && self.buffer_size > 0 && self.buffer_size < page {
            warnings.push(format!(
                "pd_buffer_size: {} bytes is smaller than one chunk ({page} bytes); rounded up to one page",
                self.buffer_size
            ));
        }
        if page_ok && self.use_cpu_offload {
            if let Some(c) = self.cpu_buffer_size.filter(|&c| c < page) {
                warnings.push(format!(
                    "pd_cpu_buffer_size: {c} bytes is smaller than one chunk ({page} bytes); rounded up to one page"
                ));
            }
        }

        let check_ports = |key: &str, list: &Option<PortList>, problems: &mut Vec<_>| {
            let Some(list) = list else { return };
            if list.ports().contains(&0) {
                problems.push(ConfigProblem::new(
                    key,
                    "contains port 0",
                    "use real port numbers (1-65535)",
                ));
            }
            if let Some(n) = list.ranks() {
                if n < self.tp_size {
                    problems.push(ConfigProblem::new(
                        key,
                        format!(
                            "lists {n} port(s) but tp_size is {}; every TP rank needs its own port",
                            self.tp_size
                        ),
                        format!(
                            "give {key} {} ports (one per rank), or lower tp_size",
                            self.tp_size
                        ),
                    ));
                }
            }
        };
        if let Some(host) = &self.peer_host {
            // The host is part of the node id, and the node id plus a route
            // number is the ZMQ routing id of a request socket (<= 255 bytes).
            if host.is_empty() || host.len() > MAX_HOST_BYTES {
                problems.push(ConfigProblem::new(
                    "pd_peer_host",
                    format!(
                        "is {} bytes; it must be 1 to {MAX_HOST_BYTES} (it names this worker in routing ids of at most 255 bytes)",
                        host.len()
                    ),
                    "use an IP address or a shorter host name",
                ));
            }
        }
        check_ports("pd_peer_init_port", &self.peer_init_port, &mut problems);
        check_ports("pd_peer_alloc_port", &self.peer_alloc_port, &mut problems);
        check_ports("pd_peer_query_port", &self.peer_query_port, &mut problems);
        check_ports("pd_pull_done_port", &self.pull_done_port, &mut problems);
        check_ports("pd_register_port", &self.register_port, &mut problems);
        check_ports("pd_data_port", &self.data_port, &mut problems);
        check_ports("pd_liveness_port", &self.liveness_port, &mut problems);
        if let Some(base) = self.base_port {
            let last = u32::from(base)
                + u32::from(PORT_STRIDE) * (self.tp_size.max(1) as u32 - 1).min(4096)
                + 14;
            if last > 65_535 {
                problems.push(ConfigProblem::new(
                    "pd_base_port",
                    format!(
                        "{base} leaves no room for {} TP rank(s): the last rank's block ends at {last}",
                        self.tp_size
                    ),
                    format!(
                        "lower pd_base_port to at most {}",
                        65_535 - (last - u32::from(base))
                    ),
                ));
            }
        }
        if self.bind_host.as_deref() == Some("") {
            problems.push(ConfigProblem::new(
                "pd_bind_host",
                "is empty",
                "give the local address to bind (0.0.0.0 for every interface), or leave it out to bind pd_peer_host",
            ));
        }
        // Two listeners of one rank on one port: the second bind fails at
        // start; say which keys collide now. Two ranks sharing a port work
        // only if they run on different hosts: a warning.
        let mut taken: std::collections::HashMap<u16, (Listener, usize)> = Default::default();
        let mut shared = std::collections::BTreeSet::new();
        for rank in 0..self.tp_size.min(4096) {
            for (l, port) in self.port_table(rank) {
                if port == 0 {
                    continue;
                }
                match taken.insert(port, (l, rank)) {
                    Some((other, orank)) if orank == rank => problems.push(ConfigProblem::new(
                        l.key(),
                        format!(
                            "gives TP rank {rank}'s {} port {port}, which its {} ({}) also has",
                            l.what(),
                            other.what(),
                            other.key()
                        ),
                        "give every listener its own port, or use pd_base_port",
                    )),
                    Some(_) => {
                        shared.insert(l.key());
                    }
                    None => {}
                }
            }
        }
        for key in shared {
            warnings.push(format!(
                "{key}: TP ranks share a port, which works only if each rank runs on its own \
                 host; give one port per rank (a list) or use pd_base_port"
            ));
        }

        match self.role {
            Role::Receiver => {
                let no_base = self.base_port.is_none();
                for (key, missing) in [
                    ("pd_peer_host", self.peer_host.is_none()),
                    (
                        "pd_peer_init_port",
                        self.peer_init_port.is_none() && no_base,
                    ),
                    (
                        "pd_peer_alloc_port",
                        self.peer_alloc_port.is_none() && no_base,
                    ),
                ] {
                    if missing {
                        problems.push(ConfigProblem::new(
                            key,
                            "is required on a receiver (it is where senders reach it)",
                            format!("set {key} or pd_base_port (see configs/receiver-*.yaml for an example)"),
                        ));
                    }
                }
                if self.pull_done_port.is_some() {
                    warnings.push("pd_pull_done_port: ignored on a receiver (each PullReadyNotif carries the sender's done URL)".to_string());
                }
            }
            Role::Sender => {
                // Optional (the vLLM connector and the router flow need
                // no proxy); half of an address is a mistake.
                for (key, missing, other) in [
                    (
                        "pd_proxy_host",
                        self.proxy_host.is_none(),
                        self.proxy_port.is_some(),
                    ),
                    (
                        "pd_proxy_port",
                        self.proxy_port.is_none(),
                        self.proxy_host.is_some(),
                    ),
                ] {
                    if missing && other {
                        problems.push(ConfigProblem::new(
                            key,
                            "is missing while the other pd_proxy_* key is set (ProxyNotif needs both)",
                            format!("set {key} too, or leave both pd_proxy_* keys out (no ProxyNotif is sent)"),
                        ));
                    }
                }
                if self.pull_mode {
                    if self.pull_done_port.is_none()
                        && self.peer_alloc_port.is_none()
                        && self.base_port.is_none()
                    {
                        problems.push(ConfigProblem::new(
                            "pd_pull_done_port",
                            "is missing and there is no pd_peer_alloc_port to fall back to (+100); a pull sender must listen for PullDoneSignal",
                            "set pd_pull_done_port: [one port per TP rank]",
                        ));
                    }
                    let overflow = self
                        .peer_alloc_port
                        .as_ref()
                        .is_some_and(|l| l.ports().iter().any(|p| p.checked_add(100).is_none()));
                    if self.pull_done_port.is_none() && overflow {
                        problems.push(ConfigProblem::new(
                            "pd_peer_alloc_port",
                            "a port + 100 (the pd_pull_done_port fallback) exceeds 65535",
                            "set pd_pull_done_port explicitly",
                        ));
                    }
                    if self.peer_host.is_none() {
                        warnings.push("pd_peer_host: not set on a pull sender; its done URL will advertise 127.0.0.1, which receivers on other hosts cannot reach".to_string());
                    }
                }
            }
        }

        if problems.is_empty() {
            Ok(warnings)
        } else {
            Err(problems)
        }
    }

    /// The listeners of every TP rank, one line each: rank, key, what it
    /// is, where it binds and the address peers dial (`free` where the
    /// port is picked at start).
    pub fn port_table_text(&self) -> String {
        let mut s = String::new();
        let advertise = self.peer_host.as_deref().unwrap_or("127.0.0.1");
        let _ = writeln!(
            s,
            "# listeners: bound on {}, advertised as {advertise}",
            self.bind_host()
        );
        let _ = writeln!(s, "# rank  port   key                 listener");
        for rank in 0..self.tp_size.min(4096) {
            for (l, port) in self.port_table(rank) {
                let p = if port == 0 {
                    "free".to_string()
                } else {
                    port.to_string()
                };
                let _ = writeln!(s, "# {rank:<5} {p:<6} {:<19} {}", l.key(), l.what());
            }
        }
        s
    }

    /// The effective configuration as YAML, defaults filled in, with derived values as comments.
    pub fn to_effective_yaml(&self) -> String {
        let opt = |v: &Option<String>| v.clone().unwrap_or_else(|| "null".into());
        let ports = |v: &Option<PortList>| v.as_ref().map_or("null".into(), |p| p.to_string());
        let secs = |d: Duration| format!("{:?}", d.as_secs_f64());
        let mut s = String::new();
        let page = self.page_bytes();
        let _ = writeln!(s, "# mode: {}", self.mode());
        let _ = writeln!(
            s,
            "# page: {page} bytes (one chunk: shape {:?}, {})",
            self.chunk_layout().full_shape(),
            self.kv.dtype
        );
        if self.has_npu_pool() {
            let b = self.buffer_pool_bytes();
            let _ = writeln!(s, "# npu pool: {b} bytes = {} pages", b / page.max(1));
        }
        if self.has_cpu_pool() {
            let b = self.cpu_pool_bytes();
            let _ = writeln!(s, "# cpu pool: {b} bytes = {} pages", b / page.max(1));
        }
        if self.role == Role::Sender && self.pull_mode {
            let done: Vec<String> = (0..self.tp_size)
                .map(|r| self.done_port(r).map_or("-".into(), |p| p.to_string()))
                .collect();
            let _ = writeln!(s, "# done port per rank: [{}]", done.join(", "));
        }
        let _ = writeln!(s, "enable_pd: {}", self.enable_pd);
        let _ = writeln!(s, "transfer_channel: {}", self.transfer_channel.name());
        let _ = writeln!(s, "pd_hccl_path: {}", self.hccl_path.name());
        let _ = writeln!(s, "pd_hixl_protocol: {}", self.hixl.protocol.name());
        let _ = writeln!(
            s,
            "pd_hixl_device_ip: {}",
            self.hixl
                .device_ip
                .map_or("null".into(), |ip| format!("\"{ip}\""))
        );
        let _ = writeln!(s, "pd_hixl_port: {}", self.hixl.port);
        let _ = writeln!(
            s,
            "pd_hixl_device_phy_id: {}",
            self.hixl
                .device_phy_id
                .map_or("null".into(), |n| n.to_string())
        );
        let _ = writeln!(s, "pd_role: {}", self.role.name());
        let _ = writeln!(s, "pd_buffer_size: {}", self.buffer_pool_bytes());
        let _ = writeln!(s, "pd_buffer_device: {}", self.buffer_device);
        let _ = writeln!(s, "pd_peer_host: {}", opt(&self.peer_host));
        let _ = writeln!(s, "pd_peer_init_port: {}", ports(&self.peer_init_port));
        let _ = writeln!(s, "pd_peer_alloc_port: {}", ports(&self.peer_alloc_port));
        let _ = writeln!(s, "pd_peer_query_port: {}", ports(&self.peer_query_port));
        let _ = writeln!(s, "pd_proxy_host: {}", opt(&self.proxy_host));
        let _ = writeln!(
            s,
            "pd_proxy_port: {}",
            self.proxy_port.map_or("null".into(), |p| p.to_string())
        );
        let _ = writeln!(
            s,
            "pd_auth_secret_file: {}",
            self.auth_secret_file
                .as_ref()
                .map_or("null".into(), |p| p.display().to_string())
        );
        let _ = writeln!(
            s,
            "pd_max_keys_per_message: {}",
            self.max_keys_per_message
                .map_or("null".into(), |n| n.to_string())
        );
        let _ = match self.copy_threads {
            Some(n) => writeln!(s, "pd_copy_threads: {n}"),
            None => writeln!(
                s,
                "pd_copy_threads: null  # {} (the cores available, at most 8)",
                self.copy_threads()
            ),
        };
        let _ = writeln!(s, "pd_pull_mode: {}", self.pull_mode);
        let _ = writeln!(s, "pd_delay_pull: {}", self.delay_pull);
        let _ = writeln!(s, "pd_pull_done_port: {}", ports(&self.pull_done_port));
        let _ = writeln!(s, "pd_register_port: {}", ports(&self.register_port));
        let _ = writeln!(s, "pd_park_timeout: {}", secs(self.park_timeout));
        let _ = writeln!(s, "pd_bind_host: {}", opt(&self.bind_host));
        let _ = writeln!(
            s,
            "pd_base_port: {}",
            self.base_port.map_or("null".into(), |p| p.to_string())
        );
        let _ = writeln!(s, "pd_data_port: {}", ports(&self.data_port));
        let _ = writeln!(s, "pd_liveness_port: {}", ports(&self.liveness_port));
        let _ = writeln!(s, "pd_model_identity: {}", opt(&self.model_identity));
        let _ = writeln!(s, "pd_drain_timeout: {}", secs(self.drain_timeout));
        let _ = writeln!(s, "pd_use_cpu_offload: {}", self.use_cpu_offload);
        let _ = writeln!(s, "pd_layerwise: {}", self.layerwise);
        let _ = writeln!(s, "pd_push_direct_write: {}", self.push_direct_write);
        let _ = writeln!(s, "pd_npu_link: {}", self.npu_link.name());
        let cpu = if self.use_cpu_offload {
            self.cpu_pool_bytes().to_string()
        } else {
            self.cpu_buffer_size
                .map_or("null".into(), |b| b.to_string())
        };
        let _ = writeln!(s, "pd_cpu_buffer_size: {cpu}");
        let _ = writeln!(
            s,
            "pd_alloc_fail_backoff_ttl: {}",
            secs(self.alloc_fail_backoff_ttl)
        );
        let _ = writeln!(s, "pd_pull_pending_ttl: {}", secs(self.pull_pending_ttl));
        let _ = writeln!(
            s,
            "pd_pull_backpressure_reserve_pct: {:?}",
            self.backpressure_reserve_pct
        );
        let _ = writeln!(
            s,
            "pd_push_landing_timeout: {}",
            secs(self.push_landing_timeout)
        );
        let _ = writeln!(s, "pd_resident_ttl: {}", secs(self.resident_ttl));
        let _ = writeln!(
            s,
            "pd_pull_read_margin_pct: {:?}",
            self.pull_read_margin_pct
        );
        let _ = writeln!(s, "chunk_size: {}", self.chunk_size);
        let _ = writeln!(s, "local_cpu: {}", self.local_cpu);
        let _ = writeln!(s, "tp_size: {}", self.tp_size);
        if let Some(n) = self.peer_tp_size {
            let _ = writeln!(s, "pd_peer_tp_size: {n}");
        }
        let _ = writeln!(s, "kv_num_layers: {}", self.kv.num_layers);
        let _ = writeln!(s, "kv_num_heads: {}", self.kv.num_kv_heads);
        let _ = writeln!(s, "kv_head_size: {}", self.kv.head_size);
        let _ = writeln!(s, "kv_hidden_size: {}", self.kv.hidden_size);
        let _ = writeln!(s, "kv_dtype: {}", self.kv.dtype);
        let _ = writeln!(s, "use_mla: {}", self.kv.use_mla);
        s
    }
}

/// A validated configuration and the warnings produced on the way.
#[derive(Clone, Debug)]
pub struct LoadedConfig {
    /// The configuration.
    pub config: PdConfig,
    /// Things that were accepted but deserve a look (unknown keys, rounding, ignored keys).
    pub warnings: Vec<String>,
}

fn round_up_pages(bytes: u64, page: u64) -> u64 {
    if page == 0 {
        return bytes;
    }
    bytes.div_ceil(page).max(1) * page
}

#[cfg(test)]
mod tests;
