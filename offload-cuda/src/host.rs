//! What a CUDA host buffer holds: a block's bytes as they are (page-locked, or
//! pageable as a fallback), the block coded for the device, or a range of a
//! registered mapping. Built on the core's [`HostBytes`]; the backend
//! ([`crate::CudaBackend`]) makes them and copies from them.

use crate::coded::{CodedHost, Coding};
use crate::engine::Engine;
use crate::mapped::Registration;
use crate::memory::HostBytes;
use offload_core::{Error, HostBuffer, Result};
use std::sync::{Arc, OnceLock};

/// A CUDA host buffer holding one block: page-locked (not write-combined)
/// memory, immutable after it is filled; or, as the plan's fallback, ordinary
/// pageable memory; or page-locked memory holding the block coded for the
/// device ([`CudaBackend::enable_coding`](crate::CudaBackend::enable_coding));
/// or a range of a registered mapped checkpoint ([`crate::map_checkpoint`]).
/// What it can do is [`HostBuffer`]'s.
pub struct CudaHostBuffer {
    bytes: HostBytes,
    /// `Some` when the bytes are the block coded for the device.
    coded: Option<CodedHost>,
    /// `Some` when the bytes are a range of a registered region (the mapped host
    /// tier): only the device reads them; host code reads the file.
    mapped: Option<MappedAt>,
}

/// A buffer's range of a registered region, and its bytes as host code reads
/// them (through the file, on first use).
struct MappedAt {
    reg: Arc<Registration>,
    offset: usize,
    read: OnceLock<Box<[u8]>>,
}

impl CudaHostBuffer {
    /// `len` page-locked bytes written by `fill`.
    pub(crate) fn new(engine: Arc<Engine>, len: usize, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>, purpose: &str) -> Result<Self> {
        Ok(CudaHostBuffer { bytes: HostBytes::pinned(engine, len, fill, purpose)?, coded: None, mapped: None })
    }

    /// `len` pageable bytes written by `fill`.
    pub(crate) fn new_pageable(engine: Arc<Engine>, len: usize, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<Self> {
        Ok(CudaHostBuffer { bytes: HostBytes::pageable(engine, len, fill)?, coded: None, mapped: None })
    }

    /// The block of `len` bytes `fill` writes, coded for the device
    /// (`code_for_device` with `coding`'s options) into page-locked memory; the
    /// raw bytes are held only while coding. A block coding does not shrink is
    /// held raw (plain page-locked bytes, copied without a decode).
    pub(crate) fn new_coded(
        engine: Arc<Engine>,
        coding: &Coding,
        len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        purpose: &str,
    ) -> Result<Self> {
        let mut raw = offload_core::host::zeroed(crate::error::BACKEND, len, purpose)?;
        fill(&mut raw)?;
        let o = coding.options;
        let codes = offload_core::codec::DeviceCodes { fp8_e4m3: o.fp8_code };
        let coded = offload_core::codec::code_for_device_with(&raw, o.segment_bytes, o.threads, codes);
        if coded.len() >= len {
            // Coding does not shrink this block (dense bytes: GGUF blocks, random
            // data): held raw, so a coded store never sends more than the raw bytes.
            return CudaHostBuffer::new(
                engine,
                len,
                &mut |dst| {
                    dst.copy_from_slice(&raw);
                    Ok(())
                },
                purpose,
            );
        }
        drop(raw);
        let info = CodedHost::new(coding, &coded, len, purpose)?;
        let mut me = CudaHostBuffer::new(
            engine,
            coded.len(),
            &mut |dst| {
                dst.copy_from_slice(&coded);
                Ok(())
            },
            purpose,
        )?;
        me.coded = Some(info);
        Ok(me)
    }

    /// A coded buffer of a `len`-byte block whose `coded_len` coded bytes
    /// `fill` writes (made ahead of time), parsed before it is handed out.
    pub(crate) fn new_precoded(
        engine: Arc<Engine>,
        coding: &Coding,
        len: usize,
        coded_len: usize,
        fill: &mut dyn FnMut(&mut [u8]) -> Result<()>,
        purpose: &str,
    ) -> Result<Self> {
        let mut me = CudaHostBuffer::new(engine, coded_len, fill, purpose)?;
        me.coded = Some(CodedHost::new(coding, me.bytes.own_bytes(), len, purpose)?);
        Ok(me)
    }

    /// `len` bytes at `offset` of a registered region, served in place; an
    /// error where they do not lie in the registered range.
    pub(crate) fn in_region(reg: Arc<Registration>, offset: usize, len: usize) -> Result<Self> {
        if offset.checked_add(len).is_none_or(|end| end > reg.len()) {
            return Err(Error::Protocol(format!("{len} bytes at {offset} of a {}-byte registration", reg.len())));
        }
        let ptr = reg.base().wrapping_add(offset);
        // The registration keeps the whole mapping registered with its engine's
        // device and mapped while it lives, and drains that engine's copy stream
        // before it lets go (its `Drop`).
        // SAFETY: `ptr .. ptr + len` lies in the registered mapping (checked above).
        let bytes = unsafe { HostBytes::lent(reg.engine().clone(), ptr, len, reg.clone()) };
        Ok(CudaHostBuffer { bytes, coded: None, mapped: Some(MappedAt { reg, offset, read: Default::default() }) })
    }

    /// The bytes a copy moves (the coded ones for a coded buffer).
    pub(crate) fn bytes(&self) -> &HostBytes {
        &self.bytes
    }

    /// What the buffer knows of its coding, where it holds its block coded.
    pub(crate) fn coded(&self) -> Option<&CodedHost> {
        self.coded.as_ref()
    }

    /// Whether the bytes are served in place from a mapped checkpoint.
    pub fn is_mapped(&self) -> bool {
        self.mapped.is_some()
    }

    /// Whether the buffer holds its block coded for the device.
    pub fn is_coded(&self) -> bool {
        self.coded.is_some()
    }

    /// Whether a copy may move it in shares (the relay): plain page-locked bytes.
    pub(crate) fn is_plain_pinned(&self) -> bool {
        self.bytes.is_pinned() && self.coded.is_none() && self.mapped.is_none()
    }

    /// The bytes held (for a coded buffer, the coded bytes; see
    /// [`HostBuffer::block_bytes`]). A buffer served from a mapped checkpoint is
    /// read from the file on first use (never through the mapping) and checked
    /// at every later use: an error naming the file if it can no longer be read
    /// or no longer holds those bytes (cut short, replaced or written since the
    /// store was built).
    pub fn as_slice(&self) -> Result<&[u8]> {
        let Some(m) = &self.mapped else { return Ok(self.bytes.own_bytes()) };
        if self.bytes.len() == 0 {
            return Ok(&[]);
        }
        if let Some(b) = m.read.get() {
            // Read once; the opened file must still hold those bytes at every
            // later call (its path may name another file since: the bytes mapped
            // are still the opened file's).
            m.reg.region().held()?;
            return Ok(b);
        }
        let mut b = vec![0u8; self.bytes.len()].into_boxed_slice();
        m.reg.region().read_at(m.offset, &mut b)?;
        Ok(m.read.get_or_init(|| b))
    }

    /// Size in bytes (coded bytes for a coded buffer).
    pub fn len(&self) -> usize {
        self.bytes.len()
    }

    /// Whether the buffer is empty.
    pub fn is_empty(&self) -> bool {
        self.bytes.len() == 0
    }
}

impl HostBuffer for CudaHostBuffer {
    fn is_pinned(&self) -> bool {
        self.bytes.is_pinned()
    }

    fn held_bytes(&self) -> Option<usize> {
        self.coded.is_some().then(|| self.bytes.len())
    }

    /// The block's own bytes: [`as_slice`](CudaHostBuffer::as_slice) for a plain
    /// buffer; for a coded one, decoded on the host (for reference runs and
    /// checks, never on the streaming path). A decode is kept while the coded
    /// bytes hash the same, so asking again costs a hash; if they changed, they
    /// are decoded afresh (and the earlier decode kept too, for the references
    /// handed out).
    ///
    /// An error where they cannot be had: a coded buffer that does not decode
    /// (its memory damaged after it was checked at build: decoding verifies every
    /// segment's hash), or a mapped one whose file can no longer be read.
    fn block_bytes(&self) -> Result<&[u8]> {
        let Some(c) = &self.coded else { return self.as_slice() };
        let own = self.bytes.own_bytes();
        let h = offload_core::codec::hash64(own);
        let mut d = c.decoded.lock().unwrap_or_else(|e| e.into_inner());
        if d.last().is_none_or(|(last, _)| *last != h) {
            let mut out = vec![0u8; c.raw_len].into_boxed_slice();
            offload_core::codec::decode_device_block(own, &mut out, &c.purpose).map_err(|e| {
                Error::Protocol(format!(
                    "{}: a coded host buffer no longer decodes ({e}): host memory damaged since it was built",
                    c.purpose
                ))
            })?;
            d.push((h, out));
        }
        let b = &d[d.len() - 1].1;
        // `decoded` is only appended to, and moving a `Box` within the vector does
        // not move its heap bytes.
        // SAFETY: the boxed bytes are never freed or written while `self` lives.
        Ok(unsafe { std::slice::from_raw_parts(b.as_ptr(), b.len()) })
    }

    fn refill(&mut self, fill: &mut dyn FnMut(&mut [u8]) -> Result<()>) -> Result<()> {
        if self.coded.is_some() || self.mapped.is_some() {
            return Err(Error::unsupported("cuda", "refilling a coded or mapped host buffer"));
        }
        self.bytes.refill(fill)
    }
}
