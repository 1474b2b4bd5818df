//! Moving NPU memory over a byte stream through pinned host memory.
//!
//! A [`Stager`] belongs to one connection and one NPU: a stream, two pinned
//! staging buffers and an event per buffer. Bytes go in chunks, double
//! buffered, so the device copy of one chunk overlaps the socket I/O of the
//! other: sending, the device-to-host copy of chunk i+1 runs while chunk i
//! is written to the socket; receiving, chunk i+1 is read from the socket
//! while the host-to-device copy of chunk i runs.

use ascend_sys::{Device, DeviceBuffer, Event, HostBuffer, Stream};
use std::io::{self, Read, Write};
use std::time::Duration;

/// Bytes per staged chunk (a request of 1 MiB runs as four overlapped chunks).
pub(crate) const STAGE_CHUNK: usize = 256 << 10;

/// What failed while staging: the socket, or the device.
#[derive(Debug)]
pub(crate) enum StageError {
    /// Reading or writing the socket.
    Io(io::Error),
    /// A device copy or wait.
    Device(ascend_sys::Error),
}

impl From<io::Error> for StageError {
    fn from(e: io::Error) -> Self {
        StageError::Io(e)
    }
}

impl From<ascend_sys::Error> for StageError {
    fn from(e: ascend_sys::Error) -> Self {
        StageError::Device(e)
    }
}

/// Double-buffered staging between one NPU and a socket.
pub(crate) struct Stager {
    // Dropped first: the stream waits for its queued copies before the
    // buffers they use are freed.
    stream: Stream,
    events: [Event; 2],
    bufs: [HostBuffer; 2],
    timeout: Duration,
}

impl Stager {
    /// A stager on `device`; each wait for a device copy is bounded by `timeout`.
    pub(crate) fn new(device: &Device, timeout: Duration) -> Result<Stager, ascend_sys::Error> {
        Ok(Stager {
            stream: device.create_stream()?,
            events: [device.create_event()?, device.create_event()?],
            bufs: [
                device.alloc_host(STAGE_CHUNK)?,
                device.alloc_host(STAGE_CHUNK)?,
            ],
            timeout,
        })
    }

    /// The `(offset, len)` of chunk `i` of a `len`-byte transfer.
    fn piece(i: usize, len: usize) -> (usize, usize) {
        let off = i * STAGE_CHUNK;
        (off, STAGE_CHUNK.min(len - off))
    }

    fn wait(&self, b: usize) -> Result<(), ascend_sys::Error> {
        self.events[b].wait_timeout(self.timeout)?;
        // Already reached: returns at once, with the copy's status.
        self.events[b].synchronize()
    }

    /// Waits for every queued copy, so no copy outlives a failed call.
    fn drain(&self) {
        let _ = self.stream.synchronize();
    }

    fn queue_d2h(
        &self,
        src: &DeviceBuffer,
        at: usize,
        i: usize,
        len: usize,
    ) -> Result<(), ascend_sys::Error> {
        let b = i % 2;
        let (off, n) = Self::piece(i, len);
        // SAFETY: the span is checked by ascend-sys against both buffers;
        // `src` outlives the call (borrowed) and no copy outlives the call
        // (every exit waits for or drains the stream); staging buffer `b`
        // is not read until its event says this copy finished.
        unsafe {
            self.stream
                .copy_device_to_host(&self.bufs[b], 0, src, at + off, n)?
        };
        self.stream.record(&self.events[b])
    }

    /// Sends `len` bytes at byte `at` of `src` to `out`. `header`, if any,
    /// goes out once the first chunk is staged (so a device failure on it
    /// can still be reported before anything was sent).
    pub(crate) fn send_from<W: Write>(
        &mut self,
        out: &mut W,
        src: &DeviceBuffer,
        at: usize,
        len: usize,
        header: Option<&[u8]>,
    ) -> Result<(), StageError> {
        let r = self.send_inner(out, src, at, len, header);
        if r.is_err() {
            self.drain();
        }
        r
    }

    fn send_inner<W: Write>(
        &mut self,
        out: &mut W,
        src: &DeviceBuffer,
        at: usize,
        len: usize,
        header: Option<&[u8]>,
    ) -> Result<(), StageError> {
        let chunks = len.div_ceil(STAGE_CHUNK);
        if chunks == 0 {
            if let Some(h) = header {
                out.write_all(h)?;
            }
            return Ok(());
        }
        for i in 0..chunks.min(2) {
            self.queue_d2h(src, at, i, len)?;
        }
        for i in 0..chunks {
            let b = i % 2;
            self.wait(b)?;
            if i == 0 {
                if let Some(h) = header {
                    out.write_all(h)?;
                }
            }
            let (_, n) = Self::piece(i, len);
            out.write_all(&self.bufs[b].as_slice()[..n])?;
            if i + 2 < chunks {
                self.queue_d2h(src, at, i + 2, len)?;
            }
        }
        Ok(())
    }

    /// Receives `len` bytes from `inp` into byte `at` of `dst`; returns once
    /// every byte is in device memory.
    pub(crate) fn recv_into<R: Read>(
        &mut self,
        inp: &mut R,
        dst: &DeviceBuffer,
        at: usize,
        len: usize,
    ) -> Result<(), StageError> {
        let r = self.recv_inner(inp, dst, at, len);
        if r.is_err() {
            self.drain();
        }
        r
    }

    fn recv_inner<R: Read>(
        &mut self,
        inp: &mut R,
        dst: &DeviceBuffer,
        at: usize,
        len: usize,
    ) -> Result<(), StageError> {
        let chunks = len.div_ceil(STAGE_CHUNK);
        for i in 0..chunks {
            let b = i % 2;
            if i >= 2 {
                // The copy out of this buffer (chunk i-2) must be done first.
                self.wait(b)?;
            }
            let (off, n) = Self::piece(i, len);
            inp.read_exact(&mut self.bufs[b].as_mut_slice()[..n])?;
            // SAFETY: spans are checked by ascend-sys; `dst` is borrowed for
            // the call and every exit waits for or drains the stream; buffer
            // `b` is not written again until its event says this copy ran.
            unsafe {
                self.stream
                    .copy_host_to_device(dst, at + off, &self.bufs[b], 0, n)?
            };
            self.stream.record(&self.events[b])?;
        }
        if chunks > 0 {
            // Copies run in stream order: the last one's event covers all.
            self.wait((chunks - 1) % 2)?;
            self.stream.synchronize()?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn device() -> Device {
        let dir = ascend_emu::install_dir().expect("the emulator is a dev-dependency");
        ascend_sys::Acl::init_from_dir(&dir)
            .expect("the emulator loads")
            .device(0)
            .unwrap()
    }

    #[test]
    fn staged_bytes_round_trip_through_a_socket_at_any_length_and_offset() {
        let dev = device();
        let mut st = Stager::new(&dev, Duration::from_secs(10)).unwrap();
        let size = 3 * STAGE_CHUNK + 777;
        let src = dev.alloc(size + 64).unwrap();
        let data: Vec<u8> = (0..size).map(|i| (i * 31 % 253) as u8).collect();
        src.copy_from_host(64, &data).unwrap();
        for len in [0, 1, STAGE_CHUNK, STAGE_CHUNK + 1, 2 * STAGE_CHUNK, size] {
            let mut wire = Vec::new();
            st.send_from(&mut wire, &src, 64, len, Some(b"HDR"))
                .unwrap();
            assert_eq!(&wire[..3], b"HDR");
            assert_eq!(&wire[3..], &data[..len], "send len {len}");
            let dst = dev.alloc(size + 8).unwrap();
            dst.fill(0, size + 8, 0xEE).unwrap();
            st.recv_into(&mut &wire[3..], &dst, 8, len).unwrap();
            let mut back = vec![0u8; size + 8];
            dst.copy_to_host(0, &mut back).unwrap();
            assert!(back[..8].iter().all(|&b| b == 0xEE));
            assert_eq!(&back[8..8 + len], &data[..len], "recv len {len}");
            assert!(back[8 + len..].iter().all(|&b| b == 0xEE), "len {len}");
        }
    }

    #[test]
    fn a_short_socket_and_a_bad_range_are_errors() {
        let dev = device();
        let mut st = Stager::new(&dev, Duration::from_secs(10)).unwrap();
        let dst = dev.alloc(4 * STAGE_CHUNK).unwrap();
        let short = vec![1u8; STAGE_CHUNK + 10];
        let e = st
            .recv_into(&mut &short[..], &dst, 0, 2 * STAGE_CHUNK)
            .unwrap_err();
        assert!(matches!(e, StageError::Io(ref io) if io.kind() == io::ErrorKind::UnexpectedEof));
        let mut wire = Vec::new();
        let e = st
            .send_from(
                &mut wire,
                &dst,
                3 * STAGE_CHUNK,
                2 * STAGE_CHUNK,
                Some(b"H"),
            )
            .unwrap_err();
        assert!(matches!(e, StageError::Device(_)), "{e:?}");
        assert!(wire.is_empty(), "nothing was sent before the failing copy");
    }
}
