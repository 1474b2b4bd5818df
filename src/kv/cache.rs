//! The KV cache's memory and the copies in and out of it.

use super::plan::{chunk_copies, CopyRun};
use super::{KvCacheSpec, KvError};
use crate::memory::npu::{read_page, write_page};
use crate::memory::{DeviceKind, MemObj, Page, SealedMemObj};
use ascend_sys::{Device, DeviceBuffer, Event, MemcpyKind, Stream};
use std::ffi::c_void;

/// A host cache's memory: a private, 2 MiB-aligned, prefaulted region
/// (allocated once and warm, like a serving engine's cache).
struct HostKv(crate::memory::HostRegion);

impl std::ops::Deref for HostKv {
    type Target = [u8];
    fn deref(&self) -> &[u8] {
        // SAFETY: the region is private anonymous memory owned by this cache;
        // nothing else maps or writes it.
        unsafe { std::slice::from_raw_parts(self.0.as_ptr(), self.0.len()) }
    }
}

impl std::ops::DerefMut for HostKv {
    fn deref_mut(&mut self) -> &mut [u8] {
        // SAFETY: as above, and `&mut self` makes the access exclusive.
        unsafe { std::slice::from_raw_parts_mut(self.0.as_ptr(), self.0.len()) }
    }
}

enum Memory {
    Host(HostKv),
    Npu {
        buf: DeviceBuffer,
        stream: Stream,
        device: Device,
    },
}

/// A paged KV cache (see the [module docs](super)).
///
/// Scatters on an NPU cache are queued on its load stream and finish at a
/// [`KvFence`]; the cache keeps every source page alive until then, so a
/// page can never return to its pool while a copy still reads it.
pub struct KvCache {
    spec: KvCacheSpec,
    mem: Memory,
    /// Source pages of copies queued since the last fence.
    pending: Vec<SealedMemObj>,
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
    fn of(copies: &[CopyRun]) -> ScatterStats {
        ScatterStats {
            copies: copies.len(),
            bytes: copies.iter().map(|c| c.len).sum(),
        }
    }
}

/// The end of the scatters queued before it: wait for it before reusing
/// their source pages. Host scatters are complete when they return, so
/// their fence is already reached. Dropping a fence waits for it.
#[must_use = "a fence is how you learn the scatters have finished"]
pub struct KvFence {
    event: Option<Event>,
    pages: Vec<SealedMemObj>,
}

impl std::fmt::Debug for KvFence {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("KvFence")
            .field("device_work", &self.event.is_some())
            .field("pages", &self.pages.len())
            .finish()
    }
}

impl KvFence {
    /// Blocks until the scatters before the fence have run, then releases
    /// their source pages.
    pub fn wait(mut self) -> Result<(), KvError> {
        let r = match self.event.take() {
            Some(e) => e.synchronize().map_err(|source| KvError::Device {
                context: "waiting for the scatter copies".into(),
                source,
            }),
            None => Ok(()),
        };
        self.pages.clear();
        r
    }

    /// Whether the scatters before the fence have run.
    pub fn is_complete(&self) -> Result<bool, KvError> {
        match &self.event {
            Some(e) => e.is_complete().map_err(|source| KvError::Device {
                context: "querying the scatter event".into(),
                source,
            }),
            None => Ok(true),
        }
    }
}

impl Drop for KvFence {
    fn drop(&mut self) {
        // The pages may only go back to their pools once the copies ran.
        if let Some(e) = self.event.take() {
            let _ = e.synchronize();
        }
    }
}

fn device_err(context: impl Into<String>) -> impl FnOnce(ascend_sys::Error) -> KvError {
    let context = context.into();
    move |source| KvError::Device { context, source }
}

impl KvCache {
    /// A zeroed cache in host memory (the `cpu` device).
    pub fn host(spec: KvCacheSpec) -> Result<KvCache, KvError> {
        spec.validate()?;
        let bytes = spec.bytes();
        let region = crate::memory::HostRegion::anonymous(bytes)
            .map_err(|source| crate::memory::MemoryError::HostAlloc { bytes, source })?;
        region.prefault();
        Ok(KvCache {
            spec,
            mem: Memory::Host(HostKv(region)),
            pending: Vec::new(),
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
        Ok(KvCache {
            spec,
            mem: Memory::Npu {
                buf,
                stream,
                device: device.clone(),
            },
            pending: Vec::new(),
        })
    }

    /// The shape.
    pub fn spec(&self) -> &KvCacheSpec {
        &self.spec
    }

    /// Where the cache lives.
    pub fn device(&self) -> DeviceKind {
        match &self.mem {
            Memory::Host(_) => DeviceKind::Cpu,
            Memory::Npu { device, .. } => DeviceKind::Npu(device.id()),
        }
    }

    /// Whether scatters complete asynchronously (NPU) and need a [`KvFence`].
    pub fn is_async(&self) -> bool {
        matches!(self.mem, Memory::Npu { .. })
    }

    fn check_page(&self, page: &Page, tokens: usize) -> Result<(), KvError> {
        self.spec.check_layout(&page.meta().layout)?;
        if tokens > page.tokens() {
            return Err(KvError::TooManyTokens {
                tokens,
                page_tokens: page.tokens(),
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
        self.check_page(page, tokens)?;
        let copies = chunk_copies(&self.spec, tokens, slots)?;
        match &mut self.mem {
            Memory::Host(cache) => match page.host_bytes() {
                Some(src) => {
                    for c in &copies {
                        cache[c.cache_offset..c.cache_offset + c.len]
                            .copy_from_slice(&src[c.chunk_offset..c.chunk_offset + c.len]);
                    }
                }
                // An NPU page into a host cache: device-to-host copies.
                None => {
                    for c in &copies {
                        read_page(
                            page,
                            c.chunk_offset,
                            &mut cache[c.cache_offset..c.cache_offset + c.len],
                        )?;
                    }
                }
            },
            Memory::Npu { buf, stream, .. } => {
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
                    // SAFETY: the plan keeps [cache_offset, +len) inside the
                    // cache (slots < num_slots) and [chunk_offset, +len) inside
                    // the chunk's bytes, which fit the page (check_page); the
                    // page's pool stays alive in `pending` until a fence
                    // completes, and the cache's buffer until its stream is
                    // synchronised in Drop.
                    unsafe {
                        stream.memcpy_async(
                            buf.as_ptr().cast::<u8>().add(c.cache_offset).cast(),
                            buf.len() - c.cache_offset,
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

    /// A fence after every scatter queued so far.
    pub fn fence(&mut self) -> Result<KvFence, KvError> {
        match &self.mem {
            Memory::Host(_) => Ok(KvFence {
                event: None,
                pages: Vec::new(),
            }),
            Memory::Npu { stream, device, .. } => {
                let event = device
                    .create_event()
                    .map_err(device_err("creating a scatter event"))?;
                stream
                    .record(&event)
                    .map_err(device_err("recording the scatter event"))?;
                Ok(KvFence {
                    event: Some(event),
                    pages: std::mem::take(&mut self.pending),
                })
            }
        }
    }

    /// Waits for every queued copy and reports an asynchronous failure.
    pub fn synchronize(&mut self) -> Result<(), KvError> {
        if let Memory::Npu { stream, .. } = &self.mem {
            stream
                .synchronize()
                .map_err(device_err("synchronising the load stream"))?;
        }
        self.pending.clear();
        Ok(())
    }

    /// Copies the slots `slots` (one per token of `page`'s chunk) into
    /// `page` in chunk layout: the sender side of a transfer. An NPU cache
    /// into a CPU page is a device-to-host copy (CPU offload). Blocks until
    /// the copies are done; `&mut` keeps the page ours meanwhile.
    pub fn gather(&mut self, slots: &[i64], page: &mut MemObj) -> Result<ScatterStats, KvError> {
        let tokens = page.tokens();
        self.check_page(page, tokens)?;
        let copies = chunk_copies(&self.spec, tokens, slots)?;
        match &mut self.mem {
            Memory::Host(cache) => {
                for c in &copies {
                    write_page(
                        &mut *page,
                        c.chunk_offset,
                        &cache[c.cache_offset..c.cache_offset + c.len],
                    )?;
                }
            }
            Memory::Npu { buf, stream, .. } => {
                let kind = match page.device() {
                    DeviceKind::Npu(_) => MemcpyKind::DeviceToDevice,
                    DeviceKind::Cpu => MemcpyKind::DeviceToHost,
                };
                let dst = page.addr() as usize;
                let page_size = page.pool().buffer().page_size();
                for c in &copies {
                    // SAFETY: both ranges are in bounds (plan + check_page);
                    // `page` is borrowed until the stream is synchronised
                    // below, and the caller owns its bytes meanwhile.
                    let queued = unsafe {
                        stream.memcpy_async(
                            (dst + c.chunk_offset) as *mut c_void,
                            page_size - c.chunk_offset,
                            buf.as_ptr().cast::<u8>().add(c.cache_offset).cast(),
                            c.len,
                            kind,
                        )
                    };
                    if let Err(e) = queued {
                        // Let what was queued finish before `page` is released.
                        let _ = stream.synchronize();
                        return Err(device_err("queueing a gather copy")(e));
                    }
                }
                stream
                    .synchronize()
                    .map_err(device_err("waiting for the gather copies"))?;
            }
        }
        Ok(ScatterStats::of(&copies))
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

    /// Copies cache bytes at `offset` into `dst` (after queued copies finish).
    pub fn read(&mut self, offset: usize, dst: &mut [u8]) -> Result<(), KvError> {
        self.check_range(offset, dst.len())?;
        self.synchronize()?;
        match &self.mem {
            Memory::Host(cache) => {
                dst.copy_from_slice(&cache[offset..offset + dst.len()]);
                Ok(())
            }
            Memory::Npu { buf, .. } => buf
                .copy_to_host(offset, dst)
                .map_err(device_err("reading the cache")),
        }
    }

    /// Copies `src` into the cache at `offset` (after queued copies finish),
    /// e.g. to stand in for a prefill.
    pub fn write(&mut self, offset: usize, src: &[u8]) -> Result<(), KvError> {
        self.check_range(offset, src.len())?;
        self.synchronize()?;
        match &mut self.mem {
            Memory::Host(cache) => {
                cache[offset..offset + src.len()].copy_from_slice(src);
                Ok(())
            }
            Memory::Npu { buf, .. } => buf
                .copy_from_host(offset, src)
                .map_err(device_err("writing the cache")),
        }
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
        if let Memory::Npu { stream, .. } = &self.mem {
            let _ = stream.synchronize();
        }
    }
}
