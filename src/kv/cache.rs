//! The KV cache's memory and the copies in and out of it.

use super::plan::{layer_copies, strided_copies, PlaneCopy};
use super::strides::{check_planes, CheckedPlanes};
use super::{KvCacheSpec, KvError, KvStrides};
use crate::memory::npu::{read_page, write_page};
use crate::memory::{ChunkMeta, DeviceKind, DirectRegistration, MemObj, Page, SealedMemObj};
use ascend_sys::{Device, DeviceBuffer, Event, MemcpyKind, Stream};
use std::ffi::c_void;
use std::sync::{Arc, Mutex};

/// Where bytes of a chunk land in a KV cache (see
/// [`KvCache::direct_targets`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DirectRun {
    /// Offset in the chunk.
    pub chunk_offset: usize,
    /// Address in the cache (a host address, or a device address for an
    /// NPU cache).
    pub addr: usize,
    /// Bytes.
    pub len: usize,
}

enum Memory {
    /// Host memory: the cache's own region (`None`: the engine's memory).
    Host(Option<crate::memory::HostRegion>),
    /// NPU memory: the cache's own buffer (`None`: the engine's tensors)
    /// and the stream its copies are queued on.
    Npu {
        buf: Option<DeviceBuffer>,
        stream: Stream,
        device: Device,
        /// `stream` is the engine's own: copies queued on it run after the
        /// engine's kernels queued before them.
        engine_stream: bool,
    },
}

/// One engine-owned tensor a [`KvCache`] wraps: its base address (a host
/// pointer, or a device address for an NPU cache) and its size in bytes.
/// For [`KvCache::wrap_host_strided`]: one plane's base and the bytes
/// available from it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct KvTensor {
    /// Base address (`tensor.data_ptr()`).
    pub addr: u64,
    /// Bytes from `addr` that belong to the tensor.
    pub bytes: usize,
}

/// A paged KV cache (see the [module docs](super)).
///
/// Scatters on an NPU cache are queued on its load stream and finish at a
/// [`KvFence`]; the cache keeps every source page alive until then, so a
/// page can never return to its pool while a copy still reads it.
///
/// A wait for device copies that fails (a stream or event synchronisation)
/// is no proof that they stopped: the pages they touch stay with the
/// cache, counted as quarantined in their pools, until a later
/// synchronisation of its stream succeeds. A cache dropped before that
/// keeps them (and its own device memory) out of use for good.
pub struct KvCache {
    /// Registrations with channels that read straight into the cache.
    /// Declared first: dropped before the memory they name.
    direct: Vec<DirectRegistration>,
    spec: KvCacheSpec,
    mem: Memory,
    /// How each plane of a layer lays out its elements (index `plane`).
    strides: Vec<KvStrides>,
    /// Base address of each `(layer, plane)`, index `layer * planes +
    /// plane`; every element its strides reach was checked to be the
    /// cache's (its own memory, or the engine's tensors).
    planes: Vec<usize>,
    /// The memory the planes touch, one region per allocation (or per
    /// group of planes sharing one): what direct reads register.
    regions: Vec<(usize, usize)>,
    /// Source pages of copies queued since the last fence.
    pending: Vec<SealedMemObj>,
    /// Pages of copies whose end the device never proved (shared with the
    /// fences, whose failed waits leave their pages here).
    unsettled: Arc<Unsettled>,
}

/// Device copies of one cache's stream that the device never proved
/// finished: a wait for them failed. Their pages stay here, quarantined,
/// until a later wait covering them succeeds; pages still here when the
/// last holder goes stay quarantined for good.
#[derive(Debug, Default)]
pub(crate) struct Unsettled(Mutex<UnsettledState>);

#[derive(Debug, Default)]
struct UnsettledState {
    /// Each held page with the failed wait (numbered from 1) that left it.
    held: Vec<(u64, SealedMemObj)>,
    /// Failed waits so far.
    failures: u64,
    /// Every failed wait up to this one was settled by a later wait that
    /// covered its copies.
    settled: u64,
}

impl Unsettled {
    fn state(&self) -> std::sync::MutexGuard<'_, UnsettledState> {
        self.0.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Failed waits so far: a mark for [`Unsettled::unproven_since`], and
    /// what a later wait must cover to settle them.
    pub(crate) fn failures(&self) -> u64 {
        self.state().failures
    }

    /// Whether a wait that failed after mark `mark` is not settled yet:
    /// copies it covered may still run.
    pub(crate) fn unproven_since(&self, mark: u64) -> bool {
        let s = self.state();
        s.failures > mark && s.settled < s.failures
    }

    /// Whether every wait that failed up to mark `mark` is settled.
    pub(crate) fn settled(&self, mark: u64) -> bool {
        self.state().settled >= mark
    }

    /// A wait (`what`) failed with `e`: nothing proves the copies it
    /// covered stopped, so `pages` stay here, quarantined, until a later
    /// wait covering them succeeds.
    fn fail(&self, what: &str, e: &ascend_sys::Error, pages: Vec<SealedMemObj>) {
        let mut s = self.state();
        s.failures += 1;
        let n = s.failures;
        for p in &pages {
            p.quarantine();
        }
        let count = pages.len();
        s.held.extend(pages.into_iter().map(|p| (n, p)));
        let total = s.held.len();
        drop(s);
        log::error!(
            "KV cache: {what} failed ({e}); nothing proves the device stopped copying, so the \
             {count} page(s) those copies touch stay quarantined ({total} held in all) until a \
             later synchronisation of the cache's stream succeeds"
        );
    }

    /// A wait that covered every copy queued before failed wait `upto`
    /// succeeded: the pages of those waits go back.
    fn settle(&self, upto: u64) {
        let mut s = self.state();
        if upto <= s.settled {
            return;
        }
        s.settled = upto;
        let (back, kept): (Vec<_>, Vec<_>) = std::mem::take(&mut s.held)
            .into_iter()
            .partition(|(n, _)| *n <= upto);
        s.held = kept;
        drop(s);
        if !back.is_empty() {
            log::warn!(
                "KV cache: its stream synchronised after a failed wait; the {} page(s) held since \
                 go back to their pools",
                back.len()
            );
        }
    }
}

impl Drop for UnsettledState {
    fn drop(&mut self) {
        if self.held.is_empty() {
            return;
        }
        log::error!(
            "KV cache gone while the device never proved {} copy page(s) finished: they stay \
             quarantined (with their pools) for good",
            self.held.len()
        );
        for (_, p) in self.held.drain(..) {
            // Never back to the pool: a late copy may still touch it.
            std::mem::forget(p);
        }
    }
}

impl std::fmt::Debug for KvCache {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvCache")
            .field("spec", &self.spec)
            .field("device", &self.device())
            .finish()
    }
}

/// What one scatter or gather moved.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct ScatterStats {
    /// Copies issued (after coalescing runs of consecutive slots).
    pub copies: usize,
    /// Bytes moved.
    pub bytes: usize,
}

impl ScatterStats {
    fn of(copies: &[PlaneCopy]) -> ScatterStats {
        ScatterStats {
            copies: copies.len(),
            bytes: copies.iter().map(|c| c.len).sum(),
        }
    }
}

/// The end of the scatters queued before it: wait for it before reusing
/// their source pages. Host scatters are complete when they return, so
/// their fence is already reached. Dropping a fence waits for it.
///
/// A wait that fails proves nothing about the copies: their source pages
/// stay quarantined with the cache until a later synchronisation of its
/// stream succeeds.
#[must_use = "a fence is how you learn the scatters have finished"]
pub struct KvFence {
    work: Option<DeviceWork>,
    pages: Vec<SealedMemObj>,
}

/// What a fence of an NPU cache waits for.
struct DeviceWork {
    /// Recorded on the cache's stream after the scatters.
    event: Event,
    /// Where the pages go if the wait fails.
    unsettled: Arc<Unsettled>,
    /// Failed waits of the cache when the event was recorded: their copies
    /// were queued before it, so its completion settles them.
    upto: u64,
}

impl std::fmt::Debug for KvFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvFence")
            .field("device_work", &self.work.is_some())
            .field("pages", &self.pages.len())
            .finish()
    }
}

impl KvFence {
    /// Blocks until the scatters before the fence have run, then releases
    /// their source pages. On an error the pages stay quarantined (see the
    /// type's docs).
    pub fn wait(mut self) -> Result<(), KvError> {
        self.finish().map_err(|source| KvError::Device {
            context: "waiting for the scatter copies (their source pages stay quarantined until \
                      a synchronisation of the stream succeeds)"
                .into(),
            source,
        })
    }

    /// Waits for the event: the pages go back once it was reached, or to
    /// the cache's unsettled copies when the wait fails.
    fn finish(&mut self) -> Result<(), ascend_sys::Error> {
        let pages = std::mem::take(&mut self.pages);
        let Some(w) = self.work.take() else {
            return Ok(());
        };
        match w.event.synchronize() {
            Ok(()) => {
                drop(pages);
                w.unsettled.settle(w.upto);
                Ok(())
            }
            Err(e) => {
                w.unsettled
                    .fail("waiting for the scatter copies", &e, pages);
                Err(e)
            }
        }
    }

    /// Whether the scatters before the fence have run.
    pub fn is_complete(&self) -> Result<bool, KvError> {
        match &self.work {
            Some(w) => w.event.is_complete().map_err(|source| KvError::Device {
                context: "querying the scatter event".into(),
                source,
            }),
            None => Ok(true),
        }
    }
}

impl Drop for KvFence {
    fn drop(&mut self) {
        // The pages may only go back to their pools once the copies ran; a
        // failed wait keeps them quarantined (and logs it).
        let _ = self.finish();
    }
}

fn device_err(context: impl Into<String>) -> impl FnOnce(ascend_sys::Error) -> KvError {
    let context = context.into();
    move |source| KvError::Device { context, source }
}

/// The address of every `(layer, plane)` region of a cache laid out in one
/// allocation at `base`.
fn contiguous_planes(spec: &KvCacheSpec, base: usize) -> Vec<usize> {
    (0..spec.layers * spec.planes())
        .map(|i| base + i * spec.plane_bytes())
        .collect()
}

/// Checks engine tensors against `spec` and returns the plane addresses:
/// one tensor holding the whole cache (`[layers][planes][slots][hidden]`),
/// or one per `(layer, plane)` in the order `layer0.K, layer0.V, layer1.K,
/// …` (vLLM-Ascend's per-layer K and V tensors; MLA: one latent per layer),
/// each `[num_blocks, block_size, hidden]`. Every tensor must be non-null,
/// aligned to the element size, at least as large as its geometry needs,
/// and no two may overlap.
fn check_tensors(spec: &KvCacheSpec, tensors: &[KvTensor]) -> Result<CheckedPlanes, KvError> {
    spec.validate()?;
    let per_plane = spec.layers * spec.planes();
    let need = if tensors.len() == 1 {
        spec.bytes()
    } else if tensors.len() == per_plane {
        spec.plane_bytes()
    } else {
        return Err(KvError::InvalidSpec(format!(
            "{} tensor(s) given: pass 1 (the whole cache, [layers][{}][slots][hidden]) or {} \
             (one [num_blocks, block_size, hidden] tensor per layer{})",
            tensors.len(),
            spec.planes(),
            per_plane,
            if spec.planes() == 2 {
                " and K/V, in the order layer0.K, layer0.V, layer1.K, ..."
            } else {
                ", the MLA latent"
            }
        )));
    };
    let mut spans = Vec::with_capacity(tensors.len());
    for (i, t) in tensors.iter().enumerate() {
        if t.addr == 0 {
            return Err(KvError::InvalidSpec(format!(
                "tensor {i} has a null address"
            )));
        }
        if t.addr % spec.dtype.size() as u64 != 0 {
            return Err(KvError::InvalidSpec(format!(
                "tensor {i} at {:#x} is not aligned to its {}-byte {} elements",
                t.addr,
                spec.dtype.size(),
                spec.dtype
            )));
        }
        if t.bytes < need {
            return Err(KvError::InvalidSpec(format!(
                "tensor {i} has {} bytes but the geometry needs {need} ({} blocks × {} tokens × \
                 {} elements × {} bytes{}); check num_blocks, block_size and the head sizes",
                t.bytes,
                spec.num_blocks,
                spec.block_size,
                spec.hidden,
                spec.dtype.size(),
                if tensors.len() == 1 {
                    format!(" × {} layers × {} planes", spec.layers, spec.planes())
                } else {
                    String::new()
                }
            )));
        }
        let end = t
            .addr
            .checked_add(need as u64)
            .filter(|e| *e <= usize::MAX as u64);
        let Some(end) = end else {
            return Err(KvError::InvalidSpec(format!(
                "tensor {i} at {:#x} + {need} bytes overflows the address space",
                t.addr
            )));
        };
        spans.push((t.addr, end, i));
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        if w[1].0 < w[0].1 {
            return Err(KvError::InvalidSpec(format!(
                "tensors {} and {} overlap: loading into one would overwrite the other",
                w[0].2, w[1].2
            )));
        }
    }
    let strides = vec![KvStrides::contiguous(spec); spec.planes()];
    Ok(if tensors.len() == 1 {
        let base = tensors[0].addr as usize;
        CheckedPlanes {
            bases: contiguous_planes(spec, base),
            strides,
            regions: vec![(base, spec.bytes())],
        }
    } else {
        CheckedPlanes {
            bases: tensors.iter().map(|t| t.addr as usize).collect(),
            strides,
            // Each its own allocation: a registration must not span two
            // even where they happen to be adjacent.
            regions: tensors
                .iter()
                .map(|t| (t.addr as usize, spec.plane_bytes()))
                .collect(),
        }
    })
}

/// Refuses strides on an NPU where copies would be one per head or per
/// element: every copy is a runtime call there.
fn check_npu_strides(
    device: &Device,
    spec: &KvCacheSpec,
    strides: &[KvStrides],
) -> Result<(), KvError> {
    let es = spec.dtype.size();
    for (p, st) in strides.iter().enumerate() {
        if st.token_contiguous(spec) {
            continue;
        }
        let kind = match (spec.planes(), p) {
            (1, _) => "latent",
            (_, 0) => "K",
            _ => "V",
        };
        let (what, gap, want) = if st.head_size > 1 && st.elem_stride != es {
            ("elements", st.elem_stride, format!("elem_stride = {es}"))
        } else {
            (
                "heads",
                st.head_stride,
                format!("head_stride = head_size × {es} = {}", st.head_size * es),
            )
        };
        return Err(KvError::DeviceLayout {
            device: DeviceKind::Npu(device.id()),
            reason: format!(
                "its {kind} plane's {what} are {gap} bytes apart, not side by side: every \
                 {} of every token would be its own device copy. Keep each token's elements \
                 contiguous on an NPU ({want}); layouts such as vLLM's CPU backend are \
                 supported in host memory",
                &what[..what.len() - 1]
            ),
        });
    }
    Ok(())
}

/// Copies `len` bytes from `src` to `dst`. Per-element plans (vLLM's CPU
/// K) are hundreds of thousands of copies of an element each: those sizes
/// are single moves here, not calls into `memcpy`.
///
/// # Safety
/// As [`std::ptr::copy_nonoverlapping`]: `src` readable and `dst` writable
/// for `len` bytes, the ranges disjoint.
#[inline]
unsafe fn copy_run(src: *const u8, dst: *mut u8, len: usize) {
    // SAFETY: each arm reads `src` and writes `dst` for exactly `len`
    // bytes, which the caller's contract allows; the unaligned reads and
    // writes need no alignment.
    unsafe {
        match len {
            1 => *dst = *src,
            2 => dst
                .cast::<[u8; 2]>()
                .write_unaligned(src.cast::<[u8; 2]>().read_unaligned()),
            4 => dst
                .cast::<[u8; 4]>()
                .write_unaligned(src.cast::<[u8; 4]>().read_unaligned()),
            8 => dst
                .cast::<[u8; 8]>()
                .write_unaligned(src.cast::<[u8; 8]>().read_unaligned()),
            _ => std::ptr::copy_nonoverlapping(src, dst, len),
        }
    }
}

/// Whether no slot (padding aside) appears twice.
fn distinct_slots(slots: &[i64]) -> bool {
    let mut s: Vec<i64> = slots.iter().copied().filter(|&s| s >= 0).collect();
    s.sort_unstable();
    s.windows(2).all(|w| w[0] != w[1])
}

/// Whether the runs' chunk ranges ascend without overlapping.
fn ascending_runs(copies: &[PlaneCopy]) -> bool {
    copies
        .windows(2)
        .all(|w| w[0].chunk_offset + w[0].len <= w[1].chunk_offset)
}

/// Whether a plan is better moved between an NPU page and a host cache
/// through one host copy of the chunk than copy by copy (each a runtime
/// call): when its copies are small on average.
fn stage_through_host(copies: &[PlaneCopy]) -> bool {
    let bytes: usize = copies.iter().map(|c| c.len).sum();
    copies.len() > 1 && bytes / copies.len() < 4096
}

impl KvCache {
    /// A zeroed cache in host memory (the `cpu` device), allocated by the
    /// library: a private, 2 MiB-aligned, prefaulted region.
    pub fn host(spec: KvCacheSpec) -> Result<KvCache, KvError> {
        spec.validate()?;
        let bytes = spec.bytes();
        let region = crate::memory::HostRegion::anonymous(bytes)
            .map_err(|source| crate::memory::MemoryError::HostAlloc { bytes, source })?;
        region.prefault();
        let base = region.as_ptr() as usize;
        Ok(KvCache {
            direct: Vec::new(),
            spec,
            strides: vec![KvStrides::contiguous(&spec); spec.planes()],
            planes: contiguous_planes(&spec, base),
            regions: vec![(base, bytes)],
            mem: Memory::Host(Some(region)),
            pending: Vec::new(),
            unsettled: Arc::default(),
        })
    }

    /// A zeroed cache on NPU `device`, with its own load stream.
    pub fn npu(device: &Device, spec: KvCacheSpec) -> Result<KvCache, KvError> {
        spec.validate()?;
        let bytes = spec.bytes();
        let buf = device
            .alloc(bytes)
            .map_err(device_err(format!("allocating {bytes} bytes")))?;
        buf.fill(0, bytes, 0)
            .map_err(device_err("zeroing the cache"))?;
        let stream = device
            .create_stream()
            .map_err(device_err("creating the load stream"))?;
        let base = buf.addr() as usize;
        Ok(KvCache {
            direct: Vec::new(),
            spec,
            strides: vec![KvStrides::contiguous(&spec); spec.planes()],
            planes: contiguous_planes(&spec, base),
            regions: vec![(base, bytes)],
            mem: Memory::Npu {
                buf: Some(buf),
                stream,
                device: device.clone(),
                // Its own memory: every write to it goes through the cache.
                engine_stream: true,
            },
            pending: Vec::new(),
            unsettled: Arc::default(),
        })
    }

    /// Wraps a KV cache the engine allocated in host memory (see
    /// [`KvTensor`] for the tensor layouts accepted). Every tensor is
    /// checked against `spec` before the cache is returned; every copy is
    /// planned inside the tensors.
    ///
    /// # Safety
    /// Each tensor must be host memory readable and writable for the bytes
    /// its geometry needs, and stay allocated until the cache is dropped.
    /// While a save or load runs, the engine must not write the slots it
    /// reads or read the slots it writes (the engine's usual rule for
    /// blocks of a request in flight).
    pub unsafe fn wrap_host(spec: KvCacheSpec, tensors: &[KvTensor]) -> Result<KvCache, KvError> {
        let checked = check_tensors(&spec, tensors)?;
        Ok(KvCache::host_planes(spec, checked))
    }

    /// Wraps a KV cache the engine allocated in host memory, laid out by
    /// `strides` (see [`KvStrides`]): one per plane of a layer (K's then
    /// V's; MLA: the latent's), or one shared by all, applied to every
    /// layer. `planes` holds one entry per `(layer, plane)` in the order
    /// layer0.K, layer0.V, layer1.K, … (MLA: one latent per layer), each
    /// that plane's base address and the bytes available from it. Planes
    /// may share a tensor (vLLM's CPU backend keeps a layer's K and V in
    /// one: [`KvStrides::vllm_cpu`], [`KvStrides::vllm_cpu_planes`]).
    /// Checked before the cache is returned: the strides
    /// ([`KvStrides::check`]); each plane non-null, aligned, with room for
    /// every element its strides reach; and no byte reachable from two
    /// planes (planes whose spans overlap must keep to disjoint parts of a
    /// cell their common strides repeat, or they are refused, naming both).
    ///
    /// # Safety
    /// Each plane must be host memory readable and writable for the bytes
    /// its strides reach, and stay allocated until the cache is dropped;
    /// the rule on slots in flight of [`KvCache::wrap_host`] applies.
    pub unsafe fn wrap_host_strided(
        spec: KvCacheSpec,
        strides: &[KvStrides],
        planes: &[KvTensor],
    ) -> Result<KvCache, KvError> {
        let checked = check_planes(&spec, strides, planes)?;
        Ok(KvCache::host_planes(spec, checked))
    }

    fn host_planes(spec: KvCacheSpec, checked: CheckedPlanes) -> KvCache {
        KvCache {
            direct: Vec::new(),
            spec,
            strides: checked.strides,
            planes: checked.bases,
            regions: checked.regions,
            mem: Memory::Host(None),
            pending: Vec::new(),
            unsettled: Arc::default(),
        }
    }

    /// Wraps a KV cache the engine allocated on NPU `device` (see
    /// [`KvCache::wrap_host`]). With `stream` (the engine's, e.g. from
    /// [`Device::borrow_stream`]) copies are queued behind the engine's
    /// kernels; without one the cache makes its own stream.
    ///
    /// # Safety
    /// Each tensor must be device memory of `device` for the bytes its
    /// geometry needs, and stay allocated until the cache is dropped; the
    /// rule on slots in flight of [`KvCache::wrap_host`] applies.
    pub unsafe fn wrap_npu(
        device: &Device,
        spec: KvCacheSpec,
        tensors: &[KvTensor],
        stream: Option<Stream>,
    ) -> Result<KvCache, KvError> {
        let checked = check_tensors(&spec, tensors)?;
        // SAFETY: forwarded to the caller's contract.
        unsafe { KvCache::npu_planes(device, spec, checked, stream) }
    }

    /// [`KvCache::wrap_host_strided`] on NPU `device`, with the engine's
    /// `stream` as in [`KvCache::wrap_npu`]. Each token's elements must be
    /// contiguous in every plane (`elem_stride` the element size and
    /// `head_stride = head_size × element size`, or one head): copies on an
    /// NPU are runtime calls, and other layouts (vLLM's CPU backend) would
    /// make one per head or element of every token, so they are refused
    /// here ([`KvError::DeviceLayout`]); they work in host memory.
    ///
    /// # Safety
    /// Each plane must be device memory of `device` for the bytes its
    /// strides reach, and stay allocated until the cache is dropped; the
    /// rule on slots in flight of [`KvCache::wrap_host`] applies.
    pub unsafe fn wrap_npu_strided(
        device: &Device,
        spec: KvCacheSpec,
        strides: &[KvStrides],
        planes: &[KvTensor],
        stream: Option<Stream>,
    ) -> Result<KvCache, KvError> {
        let checked = check_planes(&spec, strides, planes)?;
        check_npu_strides(device, &spec, &checked.strides)?;
        // SAFETY: forwarded to the caller's contract.
        unsafe { KvCache::npu_planes(device, spec, checked, stream) }
    }

    /// # Safety
    /// `checked` names device memory of `device` that outlives the cache.
    unsafe fn npu_planes(
        device: &Device,
        spec: KvCacheSpec,
        checked: CheckedPlanes,
        stream: Option<Stream>,
    ) -> Result<KvCache, KvError> {
        let engine_stream = stream.is_some();
        let stream = match stream {
            Some(s) if s.device().id() != device.id() => {
                return Err(KvError::InvalidSpec(format!(
                    "the stream is on NPU {} but the cache on NPU {}: pass a stream of the \
                     cache's device",
                    s.device().id(),
                    device.id()
                )))
            }
            Some(s) => s,
            None => device
                .create_stream()
                .map_err(device_err("creating the load stream"))?,
        };
        Ok(KvCache {
            direct: Vec::new(),
            spec,
            strides: checked.strides,
            planes: checked.bases,
            regions: checked.regions,
            mem: Memory::Npu {
                buf: None,
                stream,
                device: device.clone(),
                engine_stream,
            },
            pending: Vec::new(),
            unsettled: Arc::default(),
        })
    }

    /// Whether a copy out of the cache queued now runs after whatever the
    /// engine queued before: always for a host cache (the engine's writes
    /// are done when it says so) and for an NPU cache wrapped with the
    /// engine's stream; not for one wrapped without it, whose layer-wise
    /// saves need the engine's event ([`KvCache::gather_layer`]'s `after`).
    pub fn follows_engine(&self) -> bool {
        match &self.mem {
            Memory::Host(_) => true,
            Memory::Npu { engine_stream, .. } => *engine_stream,
        }
    }

    /// The NPU the cache is on (`None` for a host cache): where the events
    /// a layer-wise save orders its copies by are made.
    pub fn npu_device(&self) -> Option<&Device> {
        match &self.mem {
            Memory::Npu { device, .. } => Some(device),
            Memory::Host(_) => None,
        }
    }

    /// The shape.
    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    /// How each plane of a layer lays out its elements, one per plane (K,
    /// V; MLA: the latent): [`KvStrides::contiguous`] unless wrapped with
    /// other strides.
    pub fn strides(&self) -> &[KvStrides] {
        &self.strides
    }

    /// The fewest bytes a copy of a whole chunk into or out of this cache
    /// can move, the contiguous unit of its most scattered plane: the
    /// element size where a plane's elements are apart (vLLM's CPU K), a
    /// head or a token where heads or tokens are, at least a block for the
    /// contiguous layouts. (A chunk's head piece can make copies smaller
    /// still.) Loads read directly into the cache only when this is large
    /// enough to be worth a transfer operation per copy.
    pub fn min_run_bytes(&self) -> usize {
        self.strides
            .iter()
            .map(|st| st.dense_unit(&self.spec))
            .min()
            .unwrap_or(0)
    }

    /// Where the cache lives.
    pub fn device(&self) -> DeviceKind {
        match &self.mem {
            Memory::Host(_) => DeviceKind::Cpu,
            Memory::Npu { device, .. } => DeviceKind::Npu(device.id()),
        }
    }

    /// Whether the engine owns the memory (a wrapped cache).
    pub fn is_wrapped(&self) -> bool {
        matches!(self.mem, Memory::Host(None) | Memory::Npu { buf: None, .. })
    }

    /// Whether scatters complete asynchronously (NPU) and need a [`KvFence`].
    pub fn is_async(&self) -> bool {
        matches!(self.mem, Memory::Npu { .. })
    }

    /// The address of a planned copy's bytes in the cache.
    fn addr_of(&self, c: &PlaneCopy) -> usize {
        self.planes[c.plane] + c.offset
    }

    /// Maps `[offset, offset + len)` of the logical
    /// `[layers][planes][slots][hidden]` cache to memory: `(address,
    /// position in the range, length)` of each contiguous piece (one per
    /// plane for the contiguous layout; per head or token otherwise).
    fn spans(&self, offset: usize, len: usize) -> Vec<(usize, usize, usize)> {
        let pb = self.spec.plane_bytes();
        let mut out: Vec<(usize, usize, usize)> = Vec::new();
        let mut done = 0;
        while done < len {
            let at = offset + done;
            let (plane, within) = (at / pb, at % pb);
            let n = (pb - within).min(len - done);
            let base = self.planes[plane];
            // Merged within a plane only: planes may be separate
            // allocations, however adjacent.
            self.strides[plane % self.spec.planes()].for_each_span(
                &self.spec,
                within,
                n,
                |o, pos, m| match out.last_mut() {
                    Some(l) if l.1 >= done && l.0 + l.2 == base + o => l.2 += m,
                    _ => out.push((base + o, done + pos, m)),
                },
            );
            done += n;
        }
        out
    }

    /// Checks a chunk `meta` held in `page` against the cache and plans
    /// its copies.
    fn plan_page(
        &self,
        page: &Page,
        meta: &ChunkMeta,
        slots: &[i64],
    ) -> Result<Vec<PlaneCopy>, KvError> {
        self.check_page(page, meta)?;
        strided_copies(
            &self.spec,
            &self.strides,
            meta.layout.hidden,
            meta.hidden_offset,
            meta.tokens,
            slots,
        )
    }

    fn check_page(&self, page: &Page, meta: &ChunkMeta) -> Result<(), KvError> {
        self.spec.check_piece(&meta.layout, meta.hidden_offset)?;
        let capacity = page.meta().layout.page_bytes();
        if meta.tokens > meta.layout.tokens || meta.byte_len() > capacity {
            return Err(KvError::TooManyTokens {
                tokens: meta.tokens,
                page_tokens: page.tokens().min(meta.layout.tokens),
            });
        }
        if let (DeviceKind::Npu(c), DeviceKind::Npu(p)) = (self.device(), page.device()) {
            if c != p {
                return Err(KvError::Unsupported {
                    cache: self.device(),
                    page: page.device(),
                    hint: "put the receiver's pool on the NPU of its KV cache (pd_buffer_device)",
                });
            }
        }
        Ok(())
    }

    /// Copies the first `tokens` tokens of the chunk in `page` (layout
    /// `[planes, layers, tokens, hidden]`, a prefix of the page) into the
    /// slots `slots` (one per token; negative = padding, skipped).
    ///
    /// Host cache: done on return. NPU cache: queued on the load stream;
    /// the cache holds a clone of the (sealed, so unchanging) page until a
    /// [`KvCache::fence`] after it completes.
    pub fn scatter(
        &mut self,
        page: &SealedMemObj,
        tokens: usize,
        slots: &[i64],
    ) -> Result<ScatterStats, KvError> {
        let meta = ChunkMeta {
            tokens,
            ..page.meta()
        };
        self.scatter_as(page, meta, slots)
    }

    /// [`KvCache::scatter`] of the chunk `meta` describes, held in `page`
    /// (which may have been allocated for another layout, as a staging
    /// page is): a head piece lands in its elements of each slot.
    pub fn scatter_as(
        &mut self,
        page: &SealedMemObj,
        meta: ChunkMeta,
        slots: &[i64],
    ) -> Result<ScatterStats, KvError> {
        let copies = self.plan_page(page, &meta, slots)?;
        match &self.mem {
            Memory::Host(_) => match page.host_bytes() {
                Some(src) => self.scatter_host(&copies, src, slots),
                // An NPU page into a host cache with small copies: the
                // chunk comes over in one device-to-host copy, then
                // scatters on the host.
                None if stage_through_host(&copies) => {
                    let mut chunk = vec![0u8; meta.byte_len()];
                    read_page(page, 0, &mut chunk)?;
                    self.scatter_host(&copies, &chunk, slots);
                }
                // Otherwise one device-to-host copy per run.
                None => {
                    for c in &copies {
                        let dst = self.addr_of(c) as *mut u8;
                        // SAFETY: the plan keeps the run inside elements of
                        // one (layer, plane), which are ours or the
                        // engine's (checked at wrap; the engine keeps these
                        // slots to us while the load runs); the slice lives
                        // only for the copy.
                        let dst = unsafe { std::slice::from_raw_parts_mut(dst, c.len) };
                        read_page(page, c.chunk_offset, dst)?;
                    }
                }
            },
            Memory::Npu { stream, .. } => {
                let kind = match page.device() {
                    DeviceKind::Npu(_) => MemcpyKind::DeviceToDevice,
                    DeviceKind::Cpu => MemcpyKind::HostToDevice,
                };
                let src = page.addr();
                // Held from before the first copy is queued: if a later one
                // fails, those already queued still read the page until a
                // fence after them completes.
                self.pending.push(page.clone());
                for c in &copies {
                    let dst = self.addr_of(c);
                    // SAFETY: the plan keeps the run inside elements of one
                    // (layer, plane) of the cache and [chunk_offset, +len)
                    // inside the chunk's bytes, which fit the page
                    // (check_page); the page's pool stays alive in `pending`
                    // until a fence completes, and the cache's memory until
                    // its stream is synchronised in Drop.
                    unsafe {
                        stream.memcpy_async(
                            dst as *mut c_void,
                            c.len,
                            (src as usize + c.chunk_offset) as *const c_void,
                            c.len,
                            kind,
                        )
                    }
                    .map_err(device_err("queueing a scatter copy"))?;
                }
            }
        }
        Ok(ScatterStats::of(&copies))
    }

    /// The host copies of a plan from `src`, a chunk's bytes (a host page,
    /// or a host copy of an NPU page), into this host cache at `slots`.
    /// A large plan is split over the copy pool when no slot repeats.
    fn scatter_host(&self, copies: &[PlaneCopy], src: &[u8], slots: &[i64]) {
        let planes = &self.planes[..];
        let base = src.as_ptr() as usize;
        let src_len = src.len();
        let pooled = crate::memory::copy_pool::run_split(
            copies.len(),
            |i| copies[i].len,
            || distinct_slots(slots),
            |r| {
                for c in &copies[r] {
                    assert!(
                        c.chunk_offset + c.len <= src_len,
                        "a planned run past its chunk"
                    );
                    let dst = (planes[c.plane] + c.offset) as *mut u8;
                    // SAFETY: the plan keeps the run inside elements of one
                    // (layer, plane), which are ours or the engine's
                    // (checked at wrap; the engine keeps these slots to us
                    // while the load runs); the source run is inside `src`
                    // (asserted), a page or a copy of one, another
                    // allocation, so the ranges do not overlap. Runs are
                    // copied by several threads only when no slot repeats:
                    // the plan copies each (layer, plane, token, element)
                    // once, wrap proved no two elements of a plane and no
                    // two planes share a byte, so distinct slots make every
                    // run's destination disjoint from every other's.
                    unsafe { copy_run((base + c.chunk_offset) as *const u8, dst, c.len) };
                }
            },
        );
        let bytes = copies.iter().map(|c| c.len).sum();
        crate::memory::copy_pool::count_scatter(bytes, pooled);
    }

    /// Where the chunk `meta` describes lands in this cache at `slots`, as
    /// runs of the cache's memory, for a direct load (a channel reading the
    /// chunk's ranges straight into the cache). Checked like a scatter:
    /// layout, piece, slots.
    pub fn direct_targets(
        &self,
        meta: &ChunkMeta,
        slots: &[i64],
    ) -> Result<Vec<DirectRun>, KvError> {
        self.spec.check_piece(&meta.layout, meta.hidden_offset)?;
        if meta.tokens > meta.layout.tokens {
            return Err(KvError::TooManyTokens {
                tokens: meta.tokens,
                page_tokens: meta.layout.tokens,
            });
        }
        let copies = strided_copies(
            &self.spec,
            &self.strides,
            meta.layout.hidden,
            meta.hidden_offset,
            meta.tokens,
            slots,
        )?;
        Ok(copies
            .iter()
            .map(|c| DirectRun {
                chunk_offset: c.chunk_offset,
                addr: self.addr_of(c),
                len: c.len,
            })
            .collect())
    }

    /// The cache's memory as (address, bytes) regions, one per allocation
    /// (the whole cache, or each of an engine's per-layer tensors; a
    /// registration must not span two allocations even where they happen
    /// to be adjacent): what a channel registers for direct reads. For a
    /// strided cache, each plane's span from its base to past its last
    /// element, planes that overlap (K and V interleaved in one tensor)
    /// merged into their union; no two regions overlap.
    pub fn regions(&self) -> Vec<(usize, usize)> {
        self.regions.clone()
    }

    /// Whether the cache is registered with channel instance `channel`
    /// (a transfer channel's `direct_registry` id).
    pub fn is_registered_with(&self, channel: u64) -> bool {
        self.direct.iter().any(|r| r.channel() == channel)
    }

    /// Keeps `registration` (of this cache's [`KvCache::regions`]) until the
    /// cache is dropped.
    pub fn keep_registration(&mut self, registration: DirectRegistration) {
        self.direct.push(registration);
    }

    /// A fence after every scatter queued so far.
    pub fn fence(&mut self) -> Result<KvFence, KvError> {
        match &self.mem {
            Memory::Host(_) => Ok(KvFence {
                work: None,
                pages: Vec::new(),
            }),
            Memory::Npu { stream, device, .. } => {
                let event = device
                    .create_event()
                    .map_err(device_err("creating a scatter event"))?;
                // Read before the record: every failed wait counted so far
                // covered copies queued before the event.
                let upto = self.unsettled.failures();
                stream
                    .record(&event)
                    .map_err(device_err("recording the scatter event"))?;
                Ok(KvFence {
                    work: Some(DeviceWork {
                        event,
                        unsettled: Arc::clone(&self.unsettled),
                        upto,
                    }),
                    pages: std::mem::take(&mut self.pending),
                })
            }
        }
    }

    /// Waits for every queued copy and reports an asynchronous failure.
    /// Once it succeeds every copy queued before has run: the pages held
    /// since earlier failed waits go back. When it fails, the sources of
    /// scatters not yet fenced stay quarantined until one succeeds.
    pub fn synchronize(&mut self) -> Result<(), KvError> {
        const WHAT: &str = "synchronising the load stream";
        self.wait_stream().map_err(|e| {
            self.hold_unproven(WHAT, &e, None);
            device_err(WHAT)(e)
        })
    }

    /// Copies whose end the device has not proved yet (see [`KvCache`]):
    /// shared so that a request can learn when a later synchronisation
    /// settled the failure it met.
    pub(crate) fn unsettled(&self) -> &Arc<Unsettled> {
        &self.unsettled
    }

    /// Waits for everything queued on an NPU cache's stream. On `Ok` every
    /// copy queued so far ran: the pending scatter sources and the pages
    /// held since earlier failed waits go back. On `Err` nothing changed:
    /// the caller holds what the copies touch ([`KvCache::hold_unproven`]).
    fn wait_stream(&mut self) -> Result<(), ascend_sys::Error> {
        let Memory::Npu { stream, .. } = &self.mem else {
            return Ok(());
        };
        let upto = self.unsettled.failures();
        stream.synchronize()?;
        self.pending.clear();
        self.unsettled.settle(upto);
        Ok(())
    }

    /// A wait (`what`) for the stream failed with `e`: the pending scatter
    /// sources, and `page` (the page of the caller's copies), stay
    /// quarantined until a later synchronisation succeeds.
    fn hold_unproven(&mut self, what: &str, e: &ascend_sys::Error, page: Option<MemObj>) {
        let mut pages = std::mem::take(&mut self.pending);
        pages.extend(page.map(MemObj::seal));
        self.unsettled.fail(what, e, pages);
    }

    /// Waits until a synchronisation of the stream succeeds, however often
    /// one fails: for copies into or out of memory the caller lent for the
    /// call only, which cannot be kept back as a page can.
    fn settle_stream(&mut self, context: &str, at_risk: &str) {
        let mut first = true;
        crate::memory::npu::settle_with(
            || {
                let r = self.wait_stream();
                if let (Err(e), true) = (&r, std::mem::take(&mut first)) {
                    self.hold_unproven(context, e, None);
                }
                r
            },
            context,
            at_risk,
            || {},
        );
    }

    /// Copies the slots `slots` (one per token of `page`'s chunk) into
    /// `page` in chunk layout: the sender side of a transfer. An NPU cache
    /// into a CPU page is a device-to-host copy (CPU offload). Blocks until
    /// the copies are done, and gives the page back with what was moved.
    ///
    /// The page moves into the gather: on an error it is dropped, unless
    /// the device did not prove that copies into it stopped (a wait for
    /// them failed); then the cache keeps it, quarantined, until a later
    /// synchronisation of its stream succeeds.
    pub fn gather(
        &mut self,
        slots: &[i64],
        page: MemObj,
    ) -> Result<(MemObj, ScatterStats), KvError> {
        let meta = page.meta();
        let copies = self.plan_page(&page, &meta, slots)?;
        self.run_gather(&copies, page)
    }

    /// Layer `layer` of several chunks, packed into one page `dst` (a
    /// layer-wise save's staging page): for each part `(slots, meta, at)`
    /// — the chunk's slots, its chunk metadata (tokens, head piece), and
    /// where its layer goes in `dst` — the layer's K rows land at `at` and
    /// its V rows right after them (MLA: the one latent row), each
    /// `tokens × hidden` elements, exactly as that layer's ranges of the
    /// chunk's own page ([`ChunkMeta::layer_ranges`]) would hold them.
    /// Nothing else of `dst` is written. Blocks until the copies are done;
    /// `dst` comes back as from [`KvCache::gather`].
    ///
    /// `after`, for an NPU cache, is an event the engine recorded on its
    /// stream right after the layer's kernels: the copies are queued behind
    /// it (on the cache's own stream), never behind the rest of the forward
    /// pass. For a host cache it is waited for on the host.
    pub fn gather_layer(
        &mut self,
        layer: usize,
        parts: &[(&[i64], ChunkMeta, usize)],
        dst: MemObj,
        after: Option<&Event>,
    ) -> Result<(MemObj, ScatterStats), KvError> {
        if let Some(e) = after {
            match &self.mem {
                Memory::Npu { stream, .. } => stream.wait_event(e).map_err(device_err(
                    "ordering a layer's gather after the engine's event",
                ))?,
                Memory::Host(_) => e
                    .synchronize()
                    .map_err(device_err("waiting for the engine's layer event"))?,
            }
        }
        let capacity = dst.byte_len();
        let mut copies = Vec::new();
        for &(slots, meta, at) in parts {
            self.spec.check_piece(&meta.layout, meta.hidden_offset)?;
            let ranges = meta.layer_ranges(layer).ok_or_else(|| {
                KvError::InvalidSpec(format!(
                    "layer {layer} asked of chunks of {} layer(s)",
                    meta.layout.layers
                ))
            })?;
            let row = ranges.first().map_or(0, |r| r.1);
            if at.saturating_add(row * ranges.len()) > capacity {
                return Err(KvError::TooManyTokens {
                    tokens: meta.tokens,
                    page_tokens: capacity / (row / meta.tokens.max(1)).max(1),
                });
            }
            let planes = ranges.len();
            for mut c in layer_copies(
                &self.spec,
                &self.strides,
                meta.layout.hidden,
                meta.hidden_offset,
                meta.tokens,
                slots,
                layer..layer + 1,
            )? {
                let plane = c.plane % planes;
                c.chunk_offset = at + plane * row + (c.chunk_offset - ranges[plane].0);
                copies.push(c);
            }
        }
        if let (DeviceKind::Npu(c), DeviceKind::Npu(p)) = (self.device(), dst.device()) {
            if c != p {
                return Err(KvError::Unsupported {
                    cache: self.device(),
                    page: dst.device(),
                    hint: "put the sender's pool on the NPU of its KV cache (pd_buffer_device)",
                });
            }
        }
        self.run_gather(&copies, dst)
    }

    /// Where layer `layer` of a chunk (`meta`, its tokens at `slots`) lies
    /// in this host cache: `(address, offset in the chunk's page, bytes)`
    /// per run, the copies [`KvCache::gather_layer`] would make into a page
    /// holding the chunk at its start. A direct write sends them from the
    /// cache straight into a receiver's page. Host caches only (an NPU
    /// cache's memory is not addressable by the host).
    pub fn layer_sources(
        &self,
        layer: usize,
        slots: &[i64],
        meta: ChunkMeta,
    ) -> Result<Vec<(usize, usize, usize)>, KvError> {
        if !matches!(self.mem, Memory::Host(_)) {
            return Err(KvError::Unsupported {
                cache: self.device(),
                page: DeviceKind::Cpu,
                hint: "a direct write sends from host memory: stage an NPU cache through pages",
            });
        }
        self.spec.check_piece(&meta.layout, meta.hidden_offset)?;
        if layer >= meta.layout.layers {
            return Err(KvError::InvalidSpec(format!(
                "layer {layer} asked of chunks of {} layer(s)",
                meta.layout.layers
            )));
        }
        Ok(layer_copies(
            &self.spec,
            &self.strides,
            meta.layout.hidden,
            meta.hidden_offset,
            meta.tokens,
            slots,
            layer..layer + 1,
        )?
        .iter()
        .map(|c| (self.addr_of(c), c.chunk_offset, c.len))
        .collect())
    }

    fn run_gather(
        &mut self,
        copies: &[PlaneCopy],
        mut page: MemObj,
    ) -> Result<(MemObj, ScatterStats), KvError> {
        let meta = page.meta();
        let queued = match &self.mem {
            Memory::Host(_) => {
                match page.host_bytes_mut() {
                    Some(dst) => self.gather_host(copies, dst),
                    // A host cache into an NPU page with small copies:
                    // gathered on the host, then one host-to-device copy.
                    None if stage_through_host(copies) => {
                        let mut chunk = vec![0u8; meta.byte_len()];
                        self.gather_host(copies, &mut chunk);
                        write_page(&mut page, 0, &chunk)?;
                    }
                    None => {
                        for c in copies {
                            let src = self.addr_of(c) as *const u8;
                            // SAFETY: the run lies inside elements of one
                            // plane of the cache (plan + wrap checks); the
                            // engine does not write slots being saved, and
                            // the slice lives only for the copy.
                            let src = unsafe { std::slice::from_raw_parts(src, c.len) };
                            write_page(&mut page, c.chunk_offset, src)?;
                        }
                    }
                }
                return Ok((page, ScatterStats::of(copies)));
            }
            Memory::Npu { stream, .. } => {
                let kind = match page.device() {
                    DeviceKind::Npu(_) => MemcpyKind::DeviceToDevice,
                    DeviceKind::Cpu => MemcpyKind::DeviceToHost,
                };
                let dst = page.addr() as usize;
                let page_size = page.pool().buffer().page_size();
                copies.iter().try_for_each(|c| {
                    let src = self.addr_of(c);
                    // SAFETY: both ranges are in bounds (plan, wrap checks,
                    // check_page); `page` is ours until the stream is
                    // proven to have finished the copies below (or the
                    // cache keeps it, quarantined, when it is not).
                    unsafe {
                        stream.memcpy_async(
                            (dst + c.chunk_offset) as *mut c_void,
                            page_size - c.chunk_offset,
                            src as *const c_void,
                            c.len,
                            kind,
                        )
                    }
                })
            }
        };
        // The copies queued (all, or those before a refused one) write the
        // page until the stream is proven to have run them.
        match (queued, self.wait_stream()) {
            (Ok(()), Ok(())) => Ok((page, ScatterStats::of(copies))),
            (Err(e), Ok(())) => Err(device_err("queueing a gather copy")(e)),
            (queued, Err(e)) => {
                let what = "waiting for the gather copies";
                self.hold_unproven(what, &e, Some(page));
                let held = "the page stays quarantined until a synchronisation of the stream \
                            succeeds";
                Err(match queued {
                    Ok(()) => device_err(format!("{what} ({held})"))(e),
                    Err(q) => device_err(format!(
                        "queueing a gather copy (and {what} queued before it failed too: {e}; \
                         {held})"
                    ))(q),
                })
            }
        }
    }

    /// The host copies of a plan from this host cache into `dst`, a
    /// chunk's bytes (a host page, or a host buffer for an NPU page). A
    /// large plan is split over the copy pool when its runs land in `dst`
    /// in ascending, non-overlapping order (plans are built so).
    fn gather_host(&self, copies: &[PlaneCopy], dst: &mut [u8]) {
        let planes = &self.planes[..];
        let dst_len = dst.len();
        let base = dst.as_mut_ptr() as usize;
        let pooled = crate::memory::copy_pool::run_split(
            copies.len(),
            |i| copies[i].len,
            || ascending_runs(copies),
            |r| {
                for c in &copies[r] {
                    assert!(
                        c.chunk_offset + c.len <= dst_len,
                        "a planned run past its chunk"
                    );
                    let src = (planes[c.plane] + c.offset) as *const u8;
                    // SAFETY: the run lies inside elements of one plane of
                    // the cache (plan + wrap checks), which the engine does
                    // not write while they are saved; the destination run
                    // is inside `dst` (asserted), a page we hold
                    // exclusively (or a buffer of ours) and borrow mutably
                    // for the whole call, another allocation. Runs are
                    // copied by several threads only when ascending_runs
                    // proved no two destination runs share a byte.
                    unsafe { copy_run(src, (base + c.chunk_offset) as *mut u8, c.len) };
                }
            },
        );
        let bytes = copies.iter().map(|c| c.len).sum();
        crate::memory::copy_pool::count_gather(bytes, pooled);
    }

    fn check_range(&self, offset: usize, len: usize) -> Result<(), KvError> {
        match offset.checked_add(len) {
            Some(end) if end <= self.spec.bytes() => Ok(()),
            _ => Err(KvError::OutOfBounds {
                offset,
                len,
                size: self.spec.bytes(),
            }),
        }
    }

    /// Copies cache bytes at `offset` of the logical
    /// `[layers][planes][slots][hidden]` layout into `dst` (after queued
    /// copies finish).
    pub fn read(&mut self, offset: usize, dst: &mut [u8]) -> Result<(), KvError> {
        self.check_range(offset, dst.len())?;
        self.synchronize()?;
        for (addr, at, n) in self.spans(offset, dst.len()) {
            match &self.mem {
                // SAFETY: the span is elements of one plane of the cache.
                Memory::Host(_) => unsafe {
                    std::ptr::copy_nonoverlapping(addr as *const u8, dst[at..].as_mut_ptr(), n)
                },
                Memory::Npu { stream, .. } => {
                    // SAFETY: the span is device memory of the cache, `dst`
                    // host memory we borrow until the stream is synchronised.
                    let queued = unsafe {
                        stream.memcpy_async(
                            dst[at..].as_mut_ptr().cast(),
                            n,
                            addr as *const c_void,
                            n,
                            MemcpyKind::DeviceToHost,
                        )
                    };
                    if let Err(e) = queued {
                        // Copies already queued still write `dst`: the
                        // caller gets it back only once they are proven done.
                        self.settle_stream("reading the cache", "the caller's buffer");
                        return Err(device_err("reading the cache")(e));
                    }
                }
            }
        }
        self.synchronize().inspect_err(|_| {
            self.settle_stream("reading the cache", "the caller's buffer");
        })
    }

    /// Copies `src` into the cache at `offset` of the logical layout (after
    /// queued copies finish), e.g. to stand in for a prefill.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), KvError> {
        self.check_range(offset, src.len())?;
        self.synchronize()?;
        for (addr, at, n) in self.spans(offset, src.len()) {
            match &self.mem {
                // SAFETY: the span is elements of one plane of the cache.
                Memory::Host(_) => unsafe {
                    std::ptr::copy_nonoverlapping(src[at..].as_ptr(), addr as *mut u8, n)
                },
                Memory::Npu { stream, .. } => {
                    // SAFETY: as in `read`, the other way round.
                    let queued = unsafe {
                        stream.memcpy_async(
                            addr as *mut c_void,
                            n,
                            src[at..].as_ptr().cast(),
                            n,
                            MemcpyKind::HostToDevice,
                        )
                    };
                    if let Err(e) = queued {
                        // Copies already queued still read `src`.
                        self.settle_stream("writing the cache", "the caller's buffer");
                        return Err(device_err("writing the cache")(e));
                    }
                }
            }
        }
        self.synchronize().inspect_err(|_| {
            self.settle_stream("writing the cache", "the caller's buffer");
        })
    }

    /// The bytes of `slot` in `(layer, plane)`.
    pub fn token(&mut self, layer: usize, plane: usize, slot: usize) -> Result<Vec<u8>, KvError> {
        let mut out = vec![0; self.spec.token_bytes()];
        if layer >= self.spec.layers || plane >= self.spec.planes() || slot >= self.spec.slots() {
            return Err(KvError::OutOfBounds {
                offset: usize::MAX,
                len: out.len(),
                size: self.spec.bytes(),
            });
        }
        let off = self.spec.offset(layer, plane, slot);
        self.read(off, &mut out)?;
        Ok(out)
    }
}

impl Drop for KvCache {
    fn drop(&mut self) {
        // Queued copies read pages in `pending` and write `buf`: let them
        // finish before either goes away.
        let Err(e) = self.wait_stream() else {
            return;
        };
        // Nothing will learn when the device stops: the pages stay
        // quarantined for good (with `unsettled`), and the cache's own
        // device memory is never given back to be allocated again.
        self.hold_unproven(
            "synchronising the stream of a KV cache being dropped",
            &e,
            None,
        );
        if let Memory::Npu { buf, .. } = &mut self.mem {
            if let Some(b) = buf.take() {
                log::error!(
                    "KV cache dropped while its copies are unproven ({e}): its {} bytes of device \
                     memory are kept allocated for good",
                    b.len()
                );
                std::mem::forget(b);
            }
        }
        if self.is_wrapped() {
            log::error!(
                "KV cache dropped while its copies are unproven ({e}): the engine's tensors may \
                 still be written"
            );
        }
    }
}
