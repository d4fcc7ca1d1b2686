//! The Vulkan backend of `offload`, through ash 0.38: the layerwise ring on an
//! explicit-submission API.
//!
//! Design choices:
//!
//! - **Timeline semaphores are the events.** Copies signal the copy timeline,
//!   compute submissions the compute timeline; an event is a (timeline, value)
//!   pair ([`VulkanEvent`]). Nothing in the steady state waits on the host.
//! - **Explicit submission.** `compute_wait` enqueues nothing: it returns the
//!   block's copy point as a wait token, which the user's submission carries
//!   ([`VulkanBackend::submit_compute`]); a block's release is an empty submission
//!   on the compute queue (its signal follows every command submitted before it),
//!   or the point the user's own submission signals (`BlockGuard::finish_after`).
//! - **Queues are externally synchronised** by one lock, which also guards the
//!   command pools; copies run on a dedicated transfer queue family where the
//!   device has one (NVIDIA), or a second queue of the compute family
//!   ([`CopyQueue`]), else share the compute queue (lavapipe). Buffers are created
//!   `CONCURRENT` over both families, so no ownership transfer is needed.
//! - **Host buffers** are host-visible, coherent, persistently mapped memory,
//!   zeroed before the store's `fill` — or, with [`HostAllocation::Imported`], this
//!   process's own pages imported with `VK_EXT_external_memory_host` where the
//!   device offers it (lavapipe and NVIDIA do); **slots** are device-local and go to a
//!   deferred-destroy list when freed, destroyed once both timelines pass every
//!   value issued before: freeing never blocks.
//! - **The protocol is checked on every submission.** The backend records which
//!   copy filled each slot and which submission read it last, and logs a violation
//!   when a read does not wait for the copy (invariant 1) or a copy or release is
//!   not ordered after the last read (invariant 2): on lavapipe's single queue,
//!   where submissions run in order, that is what catches a broken ring.
//! - **Shaders from source.** The fold and the bench's compute are WGSL compiled to
//!   SPIR-V by naga in `build.rs`; no binary is downloaded or committed.
//! - **Validation in tests.** [`VulkanOptions::validation`] turns on the Khronos
//!   validation layer; any error it reports fails `poll_error` (every `end_step`).

pub mod checksum;
mod context;
mod device;
mod memory;
mod setup;

pub use ash;
pub use context::{CopyQueue, HostAllocation, Timeline, VulkanBackend, VulkanCounters, VulkanEvent, VulkanOptions, POISON};
pub use memory::{VulkanHostBuffer, VulkanSlot};

#[cfg(test)]
mod tests {
    use super::*;
    use offload_core::HostMemory as _;
    use offload_core::OffloadBackend;

    /// A backend opened with `options`, or `None` after `SKIPPED` where no Vulkan
    /// loader or device is installed (a failure under `OFFLOAD_REQUIRE_DEVICE=1`;
    /// any other error a failure).
    fn open(options: &VulkanOptions) -> Option<VulkanBackend> {
        match VulkanBackend::with_options(options) {
            Ok(b) => Some(b),
            Err(e) => {
                assert!(e.to_string().contains("unsupported"), "{e}");
                assert!(std::env::var("OFFLOAD_REQUIRE_DEVICE").map_or(true, |v| v != "1"), "OFFLOAD_REQUIRE_DEVICE=1 but {e}");
                eprintln!("SKIPPED: {e}");
                None
            }
        }
    }

    /// A 64-byte host buffer of `byte` and a 64-byte slot of `b`.
    fn host_and_slot(b: &VulkanBackend, byte: u8) -> (VulkanHostBuffer, VulkanSlot) {
        let host = b.host().alloc_pinned(64, "test", &mut |x| {
            x.fill(byte);
            Ok(())
        });
        (host.expect("host buffer"), b.alloc_slot(64, "test").expect("slot"))
    }

    /// The validation layer is really on when asked for: an invalid call (a
    /// zero-sized buffer) is reported, and `poll_error` then fails.
    #[test]
    fn validation_errors_are_collected_and_fail_poll_error() {
        let Some(b) = open(&VulkanOptions { validation: true, ..Default::default() }) else { return };
        assert!(b.poll_error().is_ok(), "validation errors before any misuse: {:?}", b.validation_messages());
        let ci = ash::vk::BufferCreateInfo::default().size(0).usage(ash::vk::BufferUsageFlags::TRANSFER_SRC);
        // SAFETY: deliberately invalid (size 0) for the layer to report; the buffer,
        // if the driver made one, is destroyed at once and never used.
        unsafe {
            if let Ok(buf) = b.device().create_buffer(&ci, None) {
                b.device().destroy_buffer(buf, None);
            }
        }
        let m = b.validation_messages();
        assert!(!m.is_empty(), "the validation layer reported nothing for a zero-sized buffer");
        assert!(b.poll_error().is_err(), "poll_error passed with validation errors: {m:?}");
    }

    /// Points are checked before they reach a queue: another instance's point, a
    /// copy point as a slot's release, or a buffer of another instance is an
    /// error, not a wait on a foreign semaphore or on a value never signalled.
    #[test]
    fn foreign_or_wrong_points_are_refused() {
        let (Some(a), Some(b)) = (open(&VulkanOptions::default()), open(&VulkanOptions::default())) else { return };
        let (host, mut slot) = host_and_slot(&a, 3);
        let foreign = b.record_compute().expect("b's point");
        assert!(a.copy_to_slot(&host, &mut slot, 64, Some(&foreign)).is_err(), "a waited on b's semaphore");
        let copy = a.copy_to_slot(&host, &mut slot, 64, None).expect("copy");
        assert!(a.copy_to_slot(&host, &mut slot, 64, Some(&copy)).is_err(), "a copy point was taken as a release");
        let mut b_slot = b.alloc_slot(64, "test").expect("slot of b");
        assert!(b.copy_to_slot(&host, &mut b_slot, 64, None).is_err(), "b copied from a's host buffer");
        let mut fold = checksum::ChecksumKernel::new(&b, 1).expect("fold");
        assert!(fold.fold(&slot, 64, &[copy]).is_err(), "b's fold read a's slot");
        a.synchronize().expect("sync");
        b.synchronize().expect("sync");
    }

    /// A slot's release ordered after another backend's point, or after a copy
    /// point, is refused (the log compared it by its number alone); the slot is
    /// destroyed all the same.
    #[test]
    fn a_release_after_a_foreign_or_copy_point_is_refused() {
        let (Some(a), Some(b)) = (open(&VulkanOptions::default()), open(&VulkanOptions::default())) else { return };
        let (host, mut slot) = host_and_slot(&a, 4);
        let copy = a.copy_to_slot(&host, &mut slot, 64, None).expect("copy");
        let foreign = b.record_compute().expect("b's point");
        let e = a.free_slot(slot, Some(&foreign)).expect_err("b's point taken").to_string();
        assert!(e.contains("did not issue"), "{e}");
        let slot = a.alloc_slot(64, "test").expect("slot");
        let e = a.free_slot(slot, Some(&copy)).expect_err("a copy point taken").to_string();
        assert!(e.contains("copy point"), "{e}");
        a.synchronize().expect("sync");
        b.synchronize().expect("sync");
        a.collect(&mut context::lock(&a.inner.state));
        assert_eq!(a.counters().live_bytes, 0, "a refused release still destroys the slot");
    }

    /// A compute submission refused (a wait on another backend's point) read
    /// nothing: the log records no read of its slot, so the next copy into the
    /// slot, ordered after nothing, is no violation.
    #[test]
    fn a_refused_submission_records_no_read() {
        let (Some(a), Some(b)) = (open(&VulkanOptions::default()), open(&VulkanOptions::default())) else { return };
        let (host, mut slot) = host_and_slot(&a, 6);
        let copy = a.copy_to_slot(&host, &mut slot, 64, None).expect("copy");
        let mut fold = checksum::ChecksumKernel::new(&a, 1).expect("fold");
        let foreign = b.record_compute().expect("b's point");
        assert!(fold.fold(&slot, 64, &[copy, foreign]).is_err(), "a wait on b's point submitted");
        a.copy_to_slot(&host, &mut slot, 64, None).expect("copy");
        assert!(a.violations().is_empty(), "{:?}", a.violations());
        a.synchronize().expect("sync");
        b.synchronize().expect("sync");
    }

    /// A point outlives its backend (it is `Copy`): one of a dropped backend is
    /// refused by the next, even where the next reuses the first's address and
    /// semaphore handles (as an allocator and lavapipe may).
    #[test]
    fn a_point_of_a_dropped_backend_is_refused() {
        for _ in 0..8 {
            let Some(a) = open(&VulkanOptions::default()) else { return };
            let stale = a.record_compute().expect("a's point");
            a.synchronize().expect("sync");
            drop(a);
            let Some(b) = open(&VulkanOptions::default()) else { return };
            let (host, mut slot) = host_and_slot(&b, 5);
            let _ = b.record_compute().expect("b's point");
            assert!(b.copy_to_slot(&host, &mut slot, 64, Some(&stale)).is_err(), "b waited on a dropped backend's point");
            b.synchronize().expect("sync");
        }
    }

    /// Once the device may run work nothing tracks (a failed wait, a split copy
    /// half whose other half failed), nothing is freed: a slot dropped then stays
    /// in the garbage for good instead of being destroyed under a copy.
    #[test]
    fn a_lost_device_frees_nothing() {
        let Some(b) = open(&VulkanOptions::default()) else { return };
        let garbage = |b: &VulkanBackend| context::lock(&b.inner.state).garbage.len();
        drop(b.alloc_slot(64, "kept").expect("slot"));
        b.synchronize().expect("sync");
        b.collect(&mut context::lock(&b.inner.state));
        assert_eq!(garbage(&b), 0, "a slot whose work completed was not destroyed");
        b.inner.mark_lost("a test");
        drop(b.alloc_slot(64, "leaked").expect("slot"));
        b.synchronize().expect("sync");
        b.collect(&mut context::lock(&b.inner.state));
        assert_eq!(garbage(&b), 1, "a slot was destroyed after the device was marked lost");
        assert!(b.poll_error().is_err(), "a lost device passed poll_error");
    }

    /// A refill is checked against the protocol log, not against the race: one
    /// before the host waited for the buffer's last copy is a violation even when
    /// that copy has landed (the break's wrong bytes need the copy to run late);
    /// the waiting refill logs nothing.
    #[cfg(feature = "sabotage")]
    #[test]
    fn a_refill_before_its_copy_was_waited_for_is_logged_however_the_race_went() {
        let Some(b) = open(&VulkanOptions::default()) else { return };
        let (mut host, mut slot) = host_and_slot(&b, 9);
        b.copy_to_slot(&host, &mut slot, 64, None).expect("copy");
        host.refill(&mut |x| {
            x.fill(1);
            Ok(())
        })
        .expect("refill");
        assert!(b.violations().is_empty(), "{:?}", b.violations());
        b.copy_to_slot(&host, &mut slot, 64, None).expect("copy");
        // Landed, seen only by polling the semaphore (no wait): still not waited for.
        let issued = context::lock(&b.inner.state).copy_value;
        while b.reached(context::Timeline::Copy) < issued {
            std::thread::yield_now();
        }
        b.sabotage_refill_early();
        host.refill(&mut |x| {
            x.fill(2);
            Ok(())
        })
        .expect("refill");
        let v = b.violations();
        assert!(v.iter().any(|v| v.contains("refilled before the host waited for its last copy")), "{v:?}");
        b.synchronize().expect("sync");
    }

    /// Sizes past the address space are an error naming the buffer, not a
    /// panic (debug) or a wrapped, smaller buffer that copies then overrun (release).
    #[test]
    fn a_size_past_the_address_space_is_an_error_not_a_wrapped_buffer() {
        let Some(b) = open(&VulkanOptions::default()) else { return };
        for bytes in [usize::MAX - 2, usize::MAX] {
            let e = b.alloc_slot(bytes, "huge slot").err().expect("refused").to_string();
            assert!(e.contains("huge slot"), "{e}");
            let e = b.host().alloc_pinned(bytes, "huge host", &mut |_| Ok(())).err().expect("refused").to_string();
            assert!(e.contains("huge host"), "{e}");
        }
        assert!(b.alloc_slot(1 << 62, "too large").is_err());
        assert_eq!(b.counters().live_bytes, 0);
    }

    #[test]
    fn no_loader_or_device_is_unsupported_not_a_panic() {
        match VulkanBackend::new() {
            Ok(b) => println!("Vulkan device: {}", b.device_name()),
            Err(e) => {
                let text = e.to_string();
                assert!(text.contains("unsupported"), "{text}");
                assert!(std::env::var("OFFLOAD_REQUIRE_DEVICE").as_deref() != Ok("1"), "OFFLOAD_REQUIRE_DEVICE=1 but {text}");
                eprintln!("SKIPPED: {text}");
            }
        }
    }
}
