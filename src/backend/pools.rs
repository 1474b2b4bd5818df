//! A worker's pools from its configuration: the pool specification the
//! memory layer takes (DESIGN.md §3 placement table) and the CANN runtime
//! when a pool needs one.

use crate::config::{BufferDevice, ChannelKind, PdConfig, Role};
use crate::memory::npu::AclRuntime;
use crate::memory::{CpuBacking, DualAllocator, DualSpec, MemoryError, NpuRuntime, PoolKind};

/// Where this worker's transfer pages come from (DESIGN.md §3):
/// an offloading sender uses the CPU pool, any other sender the NPU pool, a
/// receiver the NPU pool unless its buffer device is `cpu`.
pub fn placement(role: Role, use_cpu_offload: bool, device: BufferDevice) -> PoolKind {
    match (role, use_cpu_offload, device) {
        (Role::Sender, true, _) => PoolKind::Cpu,
        (_, _, BufferDevice::Cpu) => PoolKind::Cpu,
        (_, _, BufferDevice::Npu(_)) => PoolKind::Npu,
    }
}

/// The pools a worker with `config` needs; `device_index` resolves a bare `npu`.
pub fn pool_spec(config: &PdConfig, device_index: u32) -> DualSpec {
    DualSpec {
        cpu_bytes: config
            .has_cpu_pool()
            .then(|| config.cpu_pool_bytes() as usize),
        npu: match config.buffer_device {
            BufferDevice::Npu(n) => Some((
                n.unwrap_or(device_index),
                config.buffer_pool_bytes() as usize,
            )),
            BufferDevice::Cpu => None,
        },
        page_size: config.page_bytes() as usize,
        placement: placement(config.role, config.use_cpu_offload, config.buffer_device),
        shareable_cpu: config.transfer_channel == ChannelKind::Shm,
    }
}

/// Builds the allocator of a worker with `config` (`device_index` resolves a
/// bare `npu`): the NPU pool from the CANN runtime when `pd_buffer_device`
/// is `npu`, and with `transfer_channel: hccl` or `hixl` a CPU pool in the
/// runtime's pinned host memory (HCCL and HIXL register nothing else). CANN is loaded from
/// the default search (`ASCEND_PD_CANN_LIB_DIR` first) only when needed;
/// when it cannot be, the error says how to point at it or how to avoid it.
pub fn allocator_for(config: &PdConfig, device_index: u32) -> Result<DualAllocator, MemoryError> {
    let spec = pool_spec(config, device_index);
    let hccl = config.transfer_channel.needs_acl_memory();
    let needs_runtime = spec.npu.is_some() || (hccl && spec.cpu_bytes.is_some());
    let runtime = if needs_runtime {
        Some(AclRuntime::load().map_err(|e| match (e, hccl) {
            (MemoryError::NoNpuRuntime(m), true) => MemoryError::NoNpuRuntime(format!(
                "{m}\n(transfer_channel: {} always needs CANN; transfer_channel: tcp does not)",
                config.transfer_channel.name()
            )),
            (e, _) => e,
        })?)
    } else {
        None
    };
    let backing = if hccl {
        CpuBacking::Pinned {
            device: spec.npu.map_or(device_index, |(d, _)| d),
        }
    } else {
        CpuBacking::Mapped
    };
    DualAllocator::build(
        &spec,
        runtime.as_ref().map(|r| r as &dyn NpuRuntime),
        backing,
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::memory::npu::{device_of, is_acl_device, is_acl_pinned};
    use crate::memory::DeviceKind;

    #[test]
    fn placement_table_matches_design() {
        let npu = BufferDevice::Npu(None);
        assert_eq!(placement(Role::Sender, true, npu), PoolKind::Cpu);
        assert_eq!(placement(Role::Sender, false, npu), PoolKind::Npu);
        assert_eq!(placement(Role::Receiver, false, npu), PoolKind::Npu);
        assert_eq!(
            placement(Role::Receiver, false, BufferDevice::Cpu),
            PoolKind::Cpu
        );
        assert_eq!(
            placement(Role::Sender, false, BufferDevice::Cpu),
            PoolKind::Cpu
        );
    }

    fn cfg(yaml: &str) -> PdConfig {
        PdConfig::from_yaml_str(yaml, "test").unwrap().config
    }

    const BASE_SENDER: &str =
        "enable_pd: true\npd_role: sender\npd_proxy_host: 127.0.0.1\npd_proxy_port: 8500\n\
        pd_buffer_size: 4096\nkv_num_layers: 1\nkv_num_heads: 1\nkv_head_size: 8\nchunk_size: 16\n";

    #[test]
    fn spec_from_config_follows_pool_existence_rules() {
        // Offloading sender on npu: both pools, pages from CPU.
        let c = cfg(&format!(
            "{BASE_SENDER}pd_buffer_device: npu:3\npd_pull_mode: true\npd_pull_done_port: 7600\npd_use_cpu_offload: true\npd_cpu_buffer_size: 8192\n"
        ));
        let s = pool_spec(&c, 0);
        assert_eq!(s.page_size, 2 * 16 * 8 * 2);
        assert_eq!(s.npu.map(|n| n.0), Some(3));
        assert_eq!(s.cpu_bytes, Some(8192));
        assert_eq!(s.placement, PoolKind::Cpu);
        // CPU device: CPU pool only, placement CPU.
        let c = cfg(&format!("{BASE_SENDER}pd_buffer_device: cpu\n"));
        let s = pool_spec(&c, 5);
        assert_eq!(
            (s.npu, s.cpu_bytes, s.placement),
            (None, Some(4096), PoolKind::Cpu)
        );
        // Bare npu resolves to the worker's device.
        let c = cfg(&format!("{BASE_SENDER}pd_buffer_device: npu\n"));
        assert_eq!(pool_spec(&c, 5).npu.map(|n| n.0), Some(5));
    }

    #[test]
    fn allocator_for_uses_the_loaded_runtime_for_npu_and_hccl() {
        // Load the emulator first: the default search then returns it.
        let dir = ascend_emu::install_dir().expect("the emulator is a dev-dependency");
        let _rt = AclRuntime::from_dir(&dir).expect("the emulator loads");
        let base = "enable_pd: true\npd_role: receiver\npd_buffer_size: 8192\n\
            kv_num_layers: 1\nkv_num_heads: 1\nkv_head_size: 8\nchunk_size: 16\n\
            pd_peer_host: 127.0.0.1\npd_peer_init_port: [7100]\npd_peer_alloc_port: [7200]\n";
        let cfg = |extra: &str| cfg(&format!("{base}{extra}"));
        let a = allocator_for(&cfg("pd_buffer_device: npu:1\ntransfer_channel: tcp\n"), 0).unwrap();
        let npu = a.pool(PoolKind::Npu).unwrap().buffer();
        assert!(is_acl_device(npu));
        assert_eq!(npu.device(), DeviceKind::Npu(1));
        let a = allocator_for(&cfg("pd_buffer_device: cpu\ntransfer_channel: hccl\n"), 3).unwrap();
        let cpu = a.primary().buffer();
        assert!(is_acl_pinned(cpu));
        assert_eq!(device_of(cpu).map(|d| d.id()), Some(3));
        let a = allocator_for(&cfg("pd_buffer_device: cpu\ntransfer_channel: tcp\n"), 0).unwrap();
        assert!(!is_acl_pinned(a.primary().buffer()));
    }
}
