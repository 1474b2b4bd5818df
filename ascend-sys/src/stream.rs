//! Streams, events and completions.

use std::any::Any;
use std::ffi::c_void;
use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::acl::Device;
use crate::error::{Error, Result};
use crate::memory::{check_span, DeviceBuffer, HostBuffer, MemcpyKind};
use crate::result::acl_call;
use crate::sys;

/// An ACL stream: work submitted to it runs in order. Cheap to clone.
///
/// Dropping the last clone waits for queued work, then destroys the stream.
#[derive(Clone)]
pub struct Stream {
    inner: Arc<StreamInner>,
}

struct StreamInner {
    device: Device,
    raw: sys::aclrtStream,
    /// Whether dropping the last clone destroys the stream (false for a
    /// stream borrowed from its owner, e.g. an inference engine).
    owned: bool,
}

// SAFETY: an aclrtStream handle may be used from any thread once the
// thread has the stream's device bound, which every method ensures.
unsafe impl Send for StreamInner {}
// SAFETY: see Send; the runtime serialises work submitted to one stream.
unsafe impl Sync for StreamInner {}

impl std::fmt::Debug for Stream {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Stream")
            .field("device", &self.inner.device.id())
            .finish()
    }
}

impl Device {
    /// Creates a stream on this device.
    pub fn create_stream(&self) -> Result<Stream> {
        self.bind()?;
        let mut raw: sys::aclrtStream = std::ptr::null_mut();
        // SAFETY: raw is a valid out-parameter.
        unsafe { acl_call!(self.libs(), aclrtCreateStream(&mut raw))? };
        Ok(Stream {
            inner: Arc::new(StreamInner {
                device: self.clone(),
                raw,
                owned: true,
            }),
        })
    }

    /// Wraps a stream someone else created on this device (an inference
    /// engine's compute stream), so work queued through it is ordered with
    /// theirs. Dropping the wrapper waits for queued work but never
    /// destroys the stream.
    ///
    /// # Safety
    /// `raw` must be a live stream of this device, and stay live until the
    /// last clone of the returned [`Stream`] is dropped.
    pub unsafe fn borrow_stream(&self, raw: sys::aclrtStream) -> Result<Stream> {
        if raw.is_null() {
            return Err(Error::InvalidArgument(
                "the stream handle is null; pass the engine's aclrtStream, or no stream".into(),
            ));
        }
        Ok(Stream {
            inner: Arc::new(StreamInner {
                device: self.clone(),
                raw,
                owned: false,
            }),
        })
    }

    /// Creates an event on this device.
    pub fn create_event(&self) -> Result<Event> {
        self.bind()?;
        let mut raw: sys::aclrtEvent = std::ptr::null_mut();
        // SAFETY: raw is a valid out-parameter.
        unsafe { acl_call!(self.libs(), aclrtCreateEvent(&mut raw))? };
        Ok(Event {
            device: self.clone(),
            raw,
        })
    }
}

impl Stream {
    /// The device the stream runs on.
    pub fn device(&self) -> &Device {
        &self.inner.device
    }

    /// The raw `aclrtStream`, for calls outside this crate.
    pub fn as_raw(&self) -> sys::aclrtStream {
        self.inner.raw
    }

    /// Blocks until everything submitted so far has run; reports an
    /// asynchronous failure of that work.
    pub fn synchronize(&self) -> Result<()> {
        self.inner.device.bind()?;
        // SAFETY: raw is a live stream owned by this object.
        unsafe {
            acl_call!(
                self.inner.device.libs(),
                aclrtSynchronizeStream(self.inner.raw)
            )
        }
    }

    /// Records `event` at the current end of this stream.
    pub fn record(&self, event: &Event) -> Result<()> {
        self.inner.device.bind()?;
        // SAFETY: both handles are live and owned by their wrappers.
        unsafe {
            acl_call!(
                self.inner.device.libs(),
                aclrtRecordEvent(event.raw, self.inner.raw)
            )
        }
    }

    /// Makes work submitted to this stream after this call wait until
    /// `event`'s latest record has been reached.
    pub fn wait_event(&self, event: &Event) -> Result<()> {
        self.inner.device.bind()?;
        // SAFETY: both handles are live and owned by their wrappers.
        unsafe {
            acl_call!(
                self.inner.device.libs(),
                aclrtStreamWaitEvent(self.inner.raw, event.raw)
            )
        }
    }

    /// A completion for everything submitted to this stream so far.
    pub fn completion(&self) -> Result<Completion> {
        self.completion_holding(Vec::new(), None)
    }

    /// A completion for the work queued so far; `failure`, when given, is
    /// what waiting reports once that work has finished.
    pub(crate) fn completion_holding(
        &self,
        hold: Vec<Arc<dyn Any + Send + Sync>>,
        failure: Option<Error>,
    ) -> Result<Completion> {
        let event = self.inner.device.create_event()?;
        self.record(&event)?;
        Ok(Completion::new(event, hold, failure))
    }

    /// Queues a raw copy (`aclrtMemcpyAsync`).
    ///
    /// # Safety
    /// `dst` must stay valid for `dst_capacity` bytes and `src` for `len`
    /// bytes until the copy has run (see [`Stream::completion`]); host memory
    /// involved must not be accessed by the CPU in a conflicting way until
    /// then.
    pub unsafe fn memcpy_async(
        &self,
        dst: *mut c_void,
        dst_capacity: usize,
        src: *const c_void,
        len: usize,
        kind: MemcpyKind,
    ) -> Result<()> {
        self.inner.device.bind()?;
        // SAFETY: forwarded to the caller's contract.
        unsafe {
            acl_call!(
                self.inner.device.libs(),
                aclrtMemcpyAsync(dst, dst_capacity, src, len, kind.raw(), self.inner.raw)
            )
        }
    }

    /// Queues a copy of `len` bytes from `src` at `src_offset` to `dst` at
    /// `dst_offset`, host to device.
    ///
    /// # Safety
    /// Both buffers must outlive the copy, and `src` must not be written
    /// until it has run (wait for a [`Completion`] or synchronize).
    pub unsafe fn copy_host_to_device(
        &self,
        dst: &DeviceBuffer,
        dst_offset: usize,
        src: &HostBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_span("device buffer", dst_offset, len, dst.len())?;
        check_span("host buffer", src_offset, len, src.len())?;
        // SAFETY: ranges checked above; lifetime per the caller's contract.
        unsafe {
            self.memcpy_async(
                dst.as_ptr().cast::<u8>().add(dst_offset).cast(),
                dst.len() - dst_offset,
                src.as_ptr().cast::<u8>().add(src_offset).cast(),
                len,
                MemcpyKind::HostToDevice,
            )
        }
    }

    /// Queues a copy of `len` bytes from `src` at `src_offset` to `dst` at
    /// `dst_offset`, device to host.
    ///
    /// # Safety
    /// Both buffers must outlive the copy, and `dst` must not be read or
    /// written until it has run.
    pub unsafe fn copy_device_to_host(
        &self,
        dst: &HostBuffer,
        dst_offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_span("host buffer", dst_offset, len, dst.len())?;
        check_span("device buffer", src_offset, len, src.len())?;
        // SAFETY: ranges checked above; lifetime per the caller's contract.
        unsafe {
            self.memcpy_async(
                dst.as_ptr().cast::<u8>().add(dst_offset).cast(),
                dst.len() - dst_offset,
                src.as_ptr().cast::<u8>().add(src_offset).cast(),
                len,
                MemcpyKind::DeviceToHost,
            )
        }
    }

    /// Queues a device-to-device copy on this stream.
    ///
    /// # Safety
    /// Both buffers must outlive the copy.
    pub unsafe fn copy_device_to_device(
        &self,
        dst: &DeviceBuffer,
        dst_offset: usize,
        src: &DeviceBuffer,
        src_offset: usize,
        len: usize,
    ) -> Result<()> {
        check_span("destination buffer", dst_offset, len, dst.len())?;
        check_span("source buffer", src_offset, len, src.len())?;
        // SAFETY: ranges checked above; lifetime per the caller's contract.
        unsafe {
            self.memcpy_async(
                dst.as_ptr().cast::<u8>().add(dst_offset).cast(),
                dst.len() - dst_offset,
                src.as_ptr().cast::<u8>().add(src_offset).cast(),
                len,
                MemcpyKind::DeviceToDevice,
            )
        }
    }
}

impl Drop for StreamInner {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            let libs = self.device.libs();
            // SAFETY: raw is live; queued work finishes before the stream goes.
            unsafe {
                let _ = acl_call!(libs, aclrtSynchronizeStream(self.raw));
                if self.owned {
                    let _ = acl_call!(libs, aclrtDestroyStream(self.raw));
                }
            }
        }
    }
}

/// An ACL event.
pub struct Event {
    device: Device,
    raw: sys::aclrtEvent,
}

// SAFETY: an aclrtEvent handle may be used from any thread.
unsafe impl Send for Event {}
// SAFETY: record/query/synchronize on one event are thread-safe in ACL.
unsafe impl Sync for Event {}

impl std::fmt::Debug for Event {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Event")
            .field("device", &self.device.id())
            .finish()
    }
}

impl Event {
    /// True once the stream position of the latest record has been reached
    /// (also true for an event never recorded).
    pub fn is_complete(&self) -> Result<bool> {
        self.device.bind()?;
        let mut status: sys::aclrtEventRecordedStatus = sys::ACL_EVENT_RECORDED_STATUS_NOT_READY;
        // SAFETY: raw is live; status is a valid out-parameter.
        unsafe {
            acl_call!(
                self.device.libs(),
                aclrtQueryEventStatus(self.raw, &mut status)
            )?
        };
        Ok(status == sys::ACL_EVENT_RECORDED_STATUS_COMPLETE)
    }

    /// Blocks until the latest record has been reached, without a time limit.
    pub fn synchronize(&self) -> Result<()> {
        self.device.bind()?;
        // SAFETY: raw is a live event.
        unsafe { acl_call!(self.device.libs(), aclrtSynchronizeEvent(self.raw)) }
    }

    /// Waits at most `timeout` for the latest record to be reached.
    pub fn wait_timeout(&self, timeout: Duration) -> Result<()> {
        let deadline = Instant::now() + timeout;
        let mut pause = Duration::from_micros(20);
        loop {
            if self.is_complete()? {
                return Ok(());
            }
            let now = Instant::now();
            if now >= deadline {
                return Err(Error::Timeout {
                    what: "event",
                    timeout,
                });
            }
            std::thread::sleep(pause.min(deadline - now));
            pause = (pause * 2).min(Duration::from_millis(1));
        }
    }

    /// The raw `aclrtEvent`.
    pub fn as_raw(&self) -> sys::aclrtEvent {
        self.raw
    }

    /// Records this event at the current end of a stream someone else owns
    /// (an engine's compute stream), without wrapping it: unlike
    /// [`Device::borrow_stream`], nothing waits for that stream's work.
    ///
    /// # Safety
    /// `raw` must be a live stream of this event's device.
    pub unsafe fn record_on(&self, raw: sys::aclrtStream) -> Result<()> {
        if raw.is_null() {
            return Err(Error::InvalidArgument(
                "the stream handle is null; pass the engine's aclrtStream".into(),
            ));
        }
        self.device.bind()?;
        // SAFETY: `raw` is live by the caller's contract; the event is ours.
        unsafe { acl_call!(self.device.libs(), aclrtRecordEvent(self.raw, raw)) }
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        if self.device.bind().is_ok() {
            // SAFETY: raw is a live event destroyed exactly once.
            let _ = unsafe { acl_call!(self.device.libs(), aclrtDestroyEvent(self.raw)) };
        }
    }
}

/// The end of a batch of stream work: poll it or wait for it. Holds the
/// resources the work uses (registrations, peer mappings) until dropped.
#[must_use = "a completion is how you learn the work has finished"]
pub struct Completion {
    event: Event,
    /// Set when only part of the work could be queued
    /// ([`Error::BatchPartlyQueued`]); reported after the queued part ran.
    failure: Option<Error>,
    _hold: Vec<Arc<dyn Any + Send + Sync>>,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion")
            .field("event", &self.event)
            .finish()
    }
}

impl Completion {
    /// A completion of the work before `event` (already recorded).
    pub(crate) fn new(
        event: Event,
        hold: Vec<Arc<dyn Any + Send + Sync>>,
        failure: Option<Error>,
    ) -> Completion {
        Completion {
            event,
            failure,
            _hold: hold,
        }
    }

    /// True once the work has finished.
    pub fn is_complete(&self) -> Result<bool> {
        self.event.is_complete()
    }

    /// Waits at most `timeout` for the work to finish. A batch that was only
    /// partly queued reports its failure here, once the queued part is done.
    pub fn wait(&self, timeout: Duration) -> Result<()> {
        self.event.wait_timeout(timeout)?;
        self.event.synchronize()?;
        match &self.failure {
            Some(Error::BatchPartlyQueued {
                call,
                queued,
                total,
                cause,
            }) => Err(Error::BatchPartlyQueued {
                call,
                queued: *queued,
                total: *total,
                cause: cause.clone(),
            }),
            Some(other) => Err(Error::InvalidArgument(other.to_string())),
            None => Ok(()),
        }
    }

    /// The event recorded after the work, e.g. for [`Stream::wait_event`].
    pub fn event(&self) -> &Event {
        &self.event
    }
}
