//! Tests of the layers below the backend that need the whole backend (a
//! device, a store, a ring): kept here, above every layer, so that no file
//! imports the backend that is built on it.

mod coded;
mod mapped;
mod reference;

use crate::device::CudaBackend;
use crate::memory::CudaSlot;

/// The backend on device 0 for a GPU test, or `None` after printing `SKIPPED`
/// where no driver is installed (a failure under `OFFLOAD_REQUIRE_DEVICE=1`, and
/// any other error a failure).
pub(crate) fn test_backend() -> Option<CudaBackend> {
    match CudaBackend::new(0) {
        Ok(b) => Some(b),
        Err(e) if !crate::engine::driver_present() => {
            assert!(std::env::var("OFFLOAD_REQUIRE_DEVICE").as_deref() != Ok("1"), "a CUDA device is required: {e}");
            eprintln!("SKIPPED: no CUDA device ({e})");
            None
        }
        Err(e) => panic!("CUDA driver present but the backend failed: {e}"),
    }
}

/// The first `len` bytes of `slot`, read back on `b`'s compute stream after
/// everything enqueued there (the block's copy event, where a guard waited for
/// it), the stream synchronised before they are returned.
pub(crate) fn read_back(b: &CudaBackend, slot: &CudaSlot, len: usize) -> Vec<u8> {
    assert!(len <= slot.len(), "{len} bytes asked of a {}-byte slot", slot.len());
    let mut got = vec![0u8; len];
    // SAFETY: the borrowed slot holds at least `len` device bytes (checked above)
    // and `got` `len` host bytes; the stream is synchronised before `got` is read.
    unsafe {
        let s = b.compute_stream();
        cudarc::driver::sys::cuMemcpyDtoHAsync_v2(got.as_mut_ptr().cast(), slot.device_ptr(), len, s.cu_stream()).result().unwrap();
        s.synchronize().unwrap();
    }
    got
}

/// `n` pseudo-random bytes (an LCG whose state is `x`): incompressible, never zeros.
pub(crate) fn noise(n: usize, x: &mut u64) -> Vec<u8> {
    (0..n)
        .map(|_| {
            *x = x.wrapping_mul(6364136223846793005).wrapping_add(1);
            (*x >> 33) as u8
        })
        .collect()
}

/// The fold kernel's accumulator lives on the compute stream of the backend it
/// was made on, and event tracking is off: folding or reading it for another
/// backend instance (another stream, no order between them) is refused, as is a
/// slot of another backend.
#[test]
fn a_fold_kernel_refuses_another_backend() {
    use crate::checksum::ChecksumKernel;
    use offload_core::OffloadBackend;
    let (Some(a), Some(b)) = (test_backend(), test_backend()) else { return };
    let mut fold = ChecksumKernel::new(&a, 1).expect("fold");
    let slot_a = a.alloc_slot(4096, "a").expect("slot of a");
    let slot_b = b.alloc_slot(4096, "b").expect("slot of b");
    assert!(fold.fold(&b, &slot_b, 4096).is_err(), "a fold kernel of a folded on b's stream");
    assert!(fold.read(&b).is_err(), "a fold kernel of a read on b's stream");
    assert!(fold.fold(&a, &slot_b, 4096).is_err(), "a folded b's slot");
    fold.fold(&a, &slot_a, 4096).expect("a's own slot");
    fold.read(&a).expect("read on a");
}
