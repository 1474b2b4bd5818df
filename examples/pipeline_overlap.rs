//! Measures the pull-delay pipeline on this machine:
//!
//! 1. overlap: for a 64-chunk request, read alone, scatter alone, pipelined
//!    total and `max(read, scatter) / total`, over shm and tcp with a host
//!    KV cache, and over tcp into an NPU cache on the CANN emulator;
//! 2. the receiver's peak buffer bytes while loading pull-delay requests of
//!    8, 64 and 256 chunks (it must not grow with the request).
//!
//! `cargo run --release --example pipeline_overlap`. Nothing here runs on
//! Ascend hardware; the NPU figures are the emulator's (host memcpys on its
//! stream thread), useful only as a check that the overlap is real.

use anyhow::Context;
use ascend_pd::config::{BufferDevice, ChannelKind, PdConfig, PortList, Role};
use ascend_pd::memory::npu::AclRuntime;
use ascend_pd::pipeline::bench::{
    measure_overlap, measure_peak_buffer, BenchDevice, OverlapFigures, OverlapOptions,
};
use ascend_pd::pipeline::LoadOptions;

fn free_port() -> anyhow::Result<u16> {
    Ok(std::net::TcpListener::bind("127.0.0.1:0")?
        .local_addr()?
        .port())
}

fn print(label: &str, f: &OverlapFigures) {
    let ms = |d: std::time::Duration| d.as_secs_f64() * 1e3;
    println!(
        "{label:<28} {:>4} x {:>5.2} MiB  depth {:>2}  read {:>8.2} ms  scatter {:>8.2} ms  total {:>8.2} ms  \
         efficiency {:.3}  total/max {:.3}  buffer {:>5.1} MiB  verified {}",
        f.chunks,
        f.chunk_bytes as f64 / (1 << 20) as f64,
        f.depth,
        ms(f.read),
        ms(f.scatter),
        ms(f.total),
        f.efficiency,
        f.total_over_max,
        f.buffer_bytes as f64 / (1 << 20) as f64,
        f.verified
    );
}

fn pair_configs() -> anyhow::Result<(PdConfig, PdConfig)> {
    let shape = |c: &mut PdConfig| {
        c.transfer_channel = ChannelKind::Shm;
        c.buffer_device = BufferDevice::Cpu;
        c.chunk_size = 64;
        c.kv.num_layers = 4;
        c.kv.num_kv_heads = 1;
        c.kv.head_size = 128;
        c.kv.hidden_size = 128;
        c.pull_mode = true;
        c.delay_pull = true;
        c.peer_host = Some("127.0.0.1".into());
    };
    let mut r = PdConfig::with_defaults(Role::Receiver);
    shape(&mut r);
    r.buffer_size = 64 * r.page_bytes();
    r.peer_init_port = Some(PortList::Single(free_port()?));
    r.peer_alloc_port = Some(PortList::Single(free_port()?));
    let mut s = PdConfig::with_defaults(Role::Sender);
    shape(&mut s);
    s.buffer_size = 320 * s.page_bytes();
    s.proxy_host = Some("127.0.0.1".into());
    s.proxy_port = Some(free_port()?);
    s.pull_done_port = Some(PortList::Single(free_port()?));
    Ok((r, s))
}

fn main() -> anyhow::Result<()> {
    println!("== overlap: 64-chunk request, fastest of 5 runs ==");
    for ch in [ChannelKind::Shm, ChannelKind::Tcp] {
        let f = measure_overlap(&OverlapOptions::long_request(ch))?;
        print(&format!("{ch:?} -> host cache"), &f);
    }
    let dir = ascend_emu::install_dir().context("the CANN emulator")?;
    let rt = AclRuntime::from_dir(&dir)?;
    let opts = OverlapOptions {
        device: BenchDevice::Npu {
            runtime: rt,
            device: 0,
        },
        ..OverlapOptions::long_request(ChannelKind::Tcp)
    };
    print("Tcp -> NPU cache (emulator)", &measure_overlap(&opts)?);

    println!("\n== receiver peak buffer bytes, pull-delay loads (depth 8) ==");
    let (rc, sc) = pair_configs()?;
    let figures = measure_peak_buffer(&rc, &sc, &[8, 64, 256], &LoadOptions::default())?;
    for f in &figures {
        println!(
            "{:>4} chunks ({:>6.1} MiB of KV): pipeline {:>7} B  pool high-water {:>7} B  (depth {}, {} pools, {} micro-batches)",
            f.chunks,
            (f.chunks * rc.page_bytes() as usize) as f64 / (1 << 20) as f64,
            f.pipeline_bytes,
            f.pool_high_water_bytes,
            f.report.depth,
            f.report.pools,
            f.report.micro_batches
        );
    }
    Ok(())
}
