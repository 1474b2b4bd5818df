//! The CPU + NPU allocator of one worker and its role-aware placement.

use super::buffer::{DeviceKind, NpuRuntime, RegisteredBuffer};
use super::pool::{ChunkMeta, MemObj, PagePool, PoolStats};
use super::MemoryError;
use std::sync::Arc;
use std::time::Instant;

/// Which of the two pools.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum PoolKind {
    /// Host memory.
    Cpu,
    /// NPU memory.
    Npu,
}

/// Everything needed to build a [`DualAllocator`]: the pool specification
/// (the backend derives it from a worker's configuration).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct DualSpec {
    /// Bytes of the CPU pool, if there is one.
    pub cpu_bytes: Option<usize>,
    /// Bytes of the NPU pool and its device, if there is one.
    pub npu: Option<(u32, usize)>,
    /// Bytes per page (one full chunk).
    pub page_size: usize,
    /// Which pool [`DualAllocator::allocate`] uses.
    pub placement: PoolKind,
    /// Put the CPU pool in shared memory (the `shm` channel maps it from the peer).
    pub shareable_cpu: bool,
}

/// What a CPU pool is made of.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum CpuBacking {
    /// Mapped host memory: anonymous, or a memfd when [`DualSpec::shareable_cpu`].
    Mapped,
    /// Pinned host memory from the NPU runtime, tied to NPU `device`: what
    /// the `hccl` channel registers (HCCL does not take ordinary memory).
    Pinned {
        /// The NPU the pinned memory belongs to.
        device: u32,
    },
}

/// A worker's CPU pool and/or NPU pool, with role-aware placement.
#[derive(Debug)]
pub struct DualAllocator {
    cpu: Option<Arc<PagePool>>,
    npu: Option<Arc<PagePool>>,
    placement: PoolKind,
}

/// Counters of both pools.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct DualStats {
    /// The CPU pool's counters, if it exists.
    pub cpu: Option<PoolStats>,
    /// The NPU pool's counters, if it exists.
    pub npu: Option<PoolStats>,
}

impl DualAllocator {
    /// Builds the pools of `spec`. An NPU pool needs `npu_runtime`; without
    /// one the error says how to get one or how to avoid needing it.
    pub fn new(spec: &DualSpec, npu_runtime: Option<&dyn NpuRuntime>) -> Result<Self, MemoryError> {
        Self::build(spec, npu_runtime, CpuBacking::Mapped)
    }

    /// Like [`DualAllocator::new`], choosing what the CPU pool is made of;
    /// [`CpuBacking::Pinned`] needs `npu_runtime` even without an NPU pool.
    pub fn build(
        spec: &DualSpec,
        npu_runtime: Option<&dyn NpuRuntime>,
        cpu_backing: CpuBacking,
    ) -> Result<Self, MemoryError> {
        let placement_exists = match spec.placement {
            PoolKind::Cpu => spec.cpu_bytes.is_some(),
            PoolKind::Npu => spec.npu.is_some(),
        };
        if !placement_exists {
            return Err(MemoryError::InvalidGeometry(format!(
                "placement is the {:?} pool but the spec has no such pool",
                spec.placement
            )));
        }
        let npu = match spec.npu {
            None => None,
            Some((device, bytes)) => {
                let rt = npu_runtime.ok_or_else(|| {
                    MemoryError::NoNpuRuntime(
                        "no NPU runtime was given for the NPU pool".to_string(),
                    )
                })?;
                let buf = RegisteredBuffer::npu(rt, device, bytes, spec.page_size)?;
                Some(PagePool::new(buf))
            }
        };
        let cpu = match (spec.cpu_bytes, cpu_backing) {
            (None, _) => None,
            (Some(bytes), CpuBacking::Mapped) => {
                let buf = RegisteredBuffer::host(bytes, spec.page_size, spec.shareable_cpu)?;
                // Fault every page in now: a transfer must not pay first-touch
                // faults (thousands per chunk on 4 KiB shared-memory pages).
                buf.prefault();
                Some(PagePool::new(buf))
            }
            (Some(bytes), CpuBacking::Pinned { device }) => {
                let rt = npu_runtime.ok_or_else(|| {
                    MemoryError::NoNpuRuntime(
                        "no NPU runtime was given for the pinned CPU pool (transfer_channel: hccl)"
                            .to_string(),
                    )
                })?;
                Some(PagePool::new(RegisteredBuffer::pinned_host(
                    rt,
                    device,
                    bytes,
                    spec.page_size,
                )?))
            }
        };
        Ok(DualAllocator {
            cpu,
            npu,
            placement: spec.placement,
        })
    }

    /// The pool of `kind`, if this worker has it.
    pub fn pool(&self, kind: PoolKind) -> Option<&Arc<PagePool>> {
        match kind {
            PoolKind::Cpu => self.cpu.as_ref(),
            PoolKind::Npu => self.npu.as_ref(),
        }
    }

    /// The pool transfers use (the placement table's choice).
    pub fn primary(&self) -> &Arc<PagePool> {
        self.pool(self.placement)
            .expect("constructor checked the placement pool exists")
    }

    /// Which pool transfers use.
    pub fn placement(&self) -> PoolKind {
        self.placement
    }

    /// The pool whose buffer has `uuid`.
    pub fn pool_by_uuid(&self, uuid: uuid::Uuid) -> Option<&Arc<PagePool>> {
        self.pools().find(|p| p.uuid() == uuid)
    }

    /// Every pool (for registration with the transfer channel).
    pub fn pools(&self) -> impl Iterator<Item = &Arc<PagePool>> {
        self.npu.iter().chain(self.cpu.iter())
    }

    /// One page from the placement pool.
    pub fn allocate(&self, meta: ChunkMeta) -> Result<MemObj, MemoryError> {
        self.primary().allocate(meta)
    }

    /// Pages from the placement pool, all or nothing.
    pub fn allocate_batch(&self, metas: &[ChunkMeta]) -> Result<Vec<MemObj>, MemoryError> {
        self.primary().allocate_batch(metas)
    }

    /// Pages from the placement pool if they are free now (see
    /// [`PagePool::try_allocate_batch`]).
    pub fn try_allocate_batch(
        &self,
        metas: &[ChunkMeta],
    ) -> Result<Option<Vec<MemObj>>, MemoryError> {
        self.primary().try_allocate_batch(metas)
    }

    /// Pages from the placement pool, retrying until `deadline`, all or nothing.
    pub fn allocate_batch_until(
        &self,
        metas: &[ChunkMeta],
        deadline: Instant,
    ) -> Result<Vec<MemObj>, MemoryError> {
        self.primary().allocate_batch_until(metas, deadline)
    }

    /// Counters of both pools.
    pub fn stats(&self) -> DualStats {
        DualStats {
            cpu: self.cpu.as_ref().map(|p| p.stats()),
            npu: self.npu.as_ref().map(|p| p.stats()),
        }
    }

    /// The device of the placement pool.
    pub fn primary_device(&self) -> DeviceKind {
        self.primary().buffer().device()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn npu_pool_without_runtime_is_a_clear_error() {
        let spec = DualSpec {
            cpu_bytes: None,
            npu: Some((0, 4096)),
            page_size: 1024,
            placement: PoolKind::Npu,
            shareable_cpu: false,
        };
        let e = DualAllocator::new(&spec, None).unwrap_err().to_string();
        assert!(
            e.contains("NPU runtime") && e.contains("pd_buffer_device: cpu"),
            "{e}"
        );
    }

    #[test]
    fn cpu_only_allocator_allocates_from_primary_and_finds_by_uuid() {
        let spec = DualSpec {
            cpu_bytes: Some(4 * 1024),
            npu: None,
            page_size: 1024,
            placement: PoolKind::Cpu,
            shareable_cpu: true,
        };
        let a = DualAllocator::new(&spec, None).unwrap();
        assert!(a.pool(PoolKind::Npu).is_none());
        let uuid = a.primary().uuid();
        assert!(a.pool_by_uuid(uuid).is_some());
        assert!(a.primary().buffer().shared_fd().is_some());
        assert_eq!(a.stats().cpu.unwrap().total, 4);
        assert_eq!(a.primary_device(), DeviceKind::Cpu);
    }
}
