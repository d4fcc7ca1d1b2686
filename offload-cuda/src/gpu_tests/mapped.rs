//! `mapped` on a device, through the whole backend.
use crate::device::CudaBackend;
use crate::mapped::*;
use offload_core::HostBuffer;
use offload_core::{RegionSource, TensorSource};
use std::sync::Arc;

/// A safetensors file named `name` of U8 tensors, in the order given, packed.
fn write(name: &str, tensors: &[(String, Vec<u8>)]) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("offload-cuda-mapped-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    let p = d.join("m.safetensors");
    let (mut header, mut data) = (Vec::new(), Vec::new());
    for (t, bytes) in tensors {
        let at = data.len();
        data.extend_from_slice(bytes);
        header.push(format!(r#""{t}":{{"dtype":"U8","shape":[{}],"data_offsets":[{at},{}]}}"#, bytes.len(), data.len()));
    }
    let mut h = format!("{{{}}}", header.join(",")).into_bytes();
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    std::fs::write(&p, out).unwrap();
    p
}

fn checkpoint(name: &str) -> std::path::PathBuf {
    write(name, &[("w".into(), (0..8192u32).map(|i| (i * 7 + 1) as u8).collect())])
}

/// No GPU needed: the mapping is made, reads go through the file, and a
/// truncated file is an error from `check` and `read_at`, not a SIGBUS.
#[test]
fn a_mapped_checkpoint_reads_through_the_file_and_notices_truncation() {
    let p = checkpoint("trunc");
    let f = map_checkpoint(&p).unwrap();
    let r = f.region();
    assert!(r.as_any().downcast_ref::<MappedFile>().is_some(), "mapped");
    let mut w = vec![0u8; 8192];
    f.read_into(0, &mut w).unwrap();
    let mut via = vec![0u8; 8192];
    r.read_at(f.tensor_offset(0).unwrap(), &mut via).unwrap();
    assert_eq!(w, via);
    assert_eq!(w[5], 36);
    std::fs::OpenOptions::new().write(true).open(&p).unwrap().set_len(64).unwrap();
    let e = r.check().unwrap_err().to_string();
    assert!(e.contains("truncated"), "{e}");
    assert!(r.read_at(f.tensor_offset(0).unwrap(), &mut via).is_err());
}

/// A checkpoint of six blocks of random bytes (never zeros) in 256-multiple
/// tensors, block by block, with one odd-sized tensor first in block 3 (so
/// that block must be copied).
fn model(name: &str) -> std::path::PathBuf {
    let mut x = 0x9e37_79b9_7f4a_7c15u64;
    let mut tensors = Vec::new();
    for b in 0..6 {
        for (t, n) in [("a", if b == 3 { 1_000_001 } else { 1 << 20 }), ("b", 3 << 16)] {
            let bytes = (0..n)
                .map(|_| {
                    x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                    ((x >> 33) as u8) | 1
                })
                .collect();
            tensors.push((format!("blocks.{b}.{t}"), bytes));
        }
    }
    write(name, &tensors)
}

/// On a GPU: a store built from the mapped checkpoint serves five of six
/// blocks in place (registered, no copy), copies the misaligned one, and a
/// ring over it puts exactly the copying store's bytes in every slot (read
/// back after each block's copy event, two steps at depth 1). Without a
/// device it prints SKIPPED (and fails under `OFFLOAD_REQUIRE_DEVICE=1`).
#[test]
fn a_ring_over_a_mapped_store_streams_the_files_bytes() {
    use offload_core::{resolve, BlockDiscovery, HostStore, NameDiscovery, PinOptions, Plan, Ring};
    let Some(b) = super::test_backend() else { return };
    let p = model("ring");
    let file = map_checkpoint(&p).unwrap();
    let inv = NameDiscovery.discover("model", file.specs()).unwrap();
    let copied = HostStore::build(&b, &inv, &file).unwrap();
    let pinned_before = b.counters().pinned_bytes;
    let store = Arc::new(HostStore::build_mapped(&b, &inv, &file, PinOptions::default()).unwrap());
    let tier = store.tier().clone();
    assert_eq!((tier.mapped, tier.copied), (5, 1), "{tier:?}");
    assert!(tier.copy_reason.as_deref().unwrap_or("").contains("blocks.3"), "{tier:?}");
    assert!(store.blocks()[0].buffer().unwrap().is_mapped() && !store.blocks()[3].buffer().unwrap().is_mapped());
    // Page-locked: the whole file as registered, and the copied block's own
    // buffer; the store counts the same.
    let registered = std::fs::metadata(&p).unwrap().len().next_multiple_of(page_size() as u64);
    assert_eq!(b.counters().pinned_bytes - pinned_before, registered + store.blocks()[3].bytes() as u64);
    assert_eq!(store.pinned_bytes(), registered + store.blocks()[3].bytes() as u64);
    assert_eq!(tier.registration.as_deref(), Some("read-only"));
    let want: Vec<Vec<u8>> = copied.blocks().iter().map(|blk| blk.buffer().unwrap().block_bytes().unwrap().to_vec()).collect();
    for (m, w) in store.blocks().iter().zip(&want) {
        for t in &m.layout.tensors {
            let c = copied.blocks().iter().find_map(|c| c.layout.get(&t.spec.name)).unwrap();
            let got = &m.buffer().unwrap().block_bytes().unwrap()[t.offset..t.offset + t.nbytes];
            assert!(got == &w[c.offset..c.offset + c.nbytes], "{}: host bytes differ", t.spec.name);
        }
    }
    let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(&inv)).unwrap();
    let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
    for step in 0..2 {
        for (i, blk) in store.blocks().iter().enumerate() {
            let g = ring.block_at(i).unwrap();
            let got = super::read_back(&b, g.slot(), blk.bytes());
            for t in &blk.layout.tensors {
                let c = copied.blocks().iter().find_map(|c| c.layout.get(&t.spec.name)).unwrap();
                let w = &want[copied.position(&blk.id).unwrap()];
                assert!(
                    got[t.offset..t.offset + t.nbytes] == w[c.offset..c.offset + c.nbytes],
                    "step {step}, {}: the slot differs",
                    t.spec.name
                );
            }
            g.finish().unwrap();
        }
        ring.end_step().unwrap();
    }
    ring.close().unwrap();
    drop(store);
    // The registration went with the last buffer served from it, and its bytes with it.
    assert!(b.shared.regions.none_alive());
    assert_eq!(b.counters().pinned_bytes, pinned_before);
}

/// Every block's slot after its copy event, over one step of a ring at depth
/// 1 over `store`, against `copied`'s bytes of the same tensors.
fn slots_hold(
    b: &CudaBackend,
    inv: &offload_core::ComponentInventory,
    store: &Arc<offload_core::HostStore<CudaBackend>>,
    copied: &offload_core::HostStore<CudaBackend>,
) {
    use offload_core::{resolve, Plan, Ring};
    let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(inv)).unwrap();
    let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
    for (i, blk) in store.blocks().iter().enumerate() {
        let g = ring.block_at(i).unwrap();
        let got = super::read_back(b, g.slot(), blk.bytes());
        let c = &copied.blocks()[copied.position(&blk.id).unwrap()];
        let want = c.buffer().unwrap().block_bytes().unwrap();
        for t in &blk.layout.tensors {
            let ct = c.layout.get(&t.spec.name).unwrap();
            assert!(got[t.offset..t.offset + t.nbytes] == want[ct.offset..ct.offset + ct.nbytes], "{}: the slot differs", t.spec.name);
        }
        g.finish().unwrap();
    }
    ring.end_step().unwrap();
    ring.close().unwrap();
}

/// On a GPU: serving a block in place page-locks the whole file. A pin
/// budget of one block on a file of six serves none in place, and what the
/// device has page-locked stays within the budget; the store's count agrees.
#[test]
fn a_pin_budget_of_one_block_keeps_the_registration_within_it() {
    use offload_core::{BlockDiscovery, HostStore, NameDiscovery, PinFallback, PinOptions};
    let Some(b) = super::test_backend() else { return };
    let p = model("budget");
    let file = map_checkpoint(&p).unwrap();
    let inv = NameDiscovery.discover("model", file.specs()).unwrap();
    let block = HostStore::build(&b, &inv, &file).unwrap().largest_block_bytes() as u64;
    let before = b.counters().pinned_bytes;
    let pin = PinOptions { budget_bytes: Some(block), fallback: PinFallback::Pageable, ..PinOptions::default() };
    let store = Arc::new(HostStore::build_mapped(&b, &inv, &file, pin).unwrap());
    let pinned = b.counters().pinned_bytes - before;
    assert!(pinned <= block, "{pinned} bytes page-locked under a budget of {block}");
    assert_eq!(store.pinned_bytes(), pinned);
    assert_eq!(store.tier().mapped, 0, "{:?}", store.tier());
    assert!(store.tier().copy_reason.as_deref().unwrap_or("").contains("page-locks the whole of"), "{:?}", store.tier());
    let copied = HostStore::build(&b, &inv, &file).unwrap();
    slots_hold(&b, &inv, &store, &copied);
}

/// On a GPU: one byte inside block 2 written in place between two steps
/// (same file, same length) is an error naming the file no later than the
/// second step's end (a mapped buffer re-checks its file as its block is
/// copied, so it is seen at the first copy after the write), every later
/// block is refused, and so is the ring's close.
#[test]
fn a_mapped_file_written_in_place_between_steps_is_an_error() {
    use offload_core::{resolve, BlockDiscovery, HostStore, NameDiscovery, PinOptions, Plan, Ring};
    use std::os::unix::fs::FileExt;
    let Some(b) = super::test_backend() else { return };
    let p = model("written");
    let file = map_checkpoint(&p).unwrap();
    let inv = NameDiscovery.discover("model", file.specs()).unwrap();
    let store = Arc::new(HostStore::build_mapped(&b, &inv, &file, PinOptions::default()).unwrap());
    assert_eq!(store.tier().mapped, 5);
    let plan = resolve(&Plan::layerwise().prefetch_depth(1), std::slice::from_ref(&inv)).unwrap();
    let mut ring = Ring::new(b.clone(), store.clone(), &plan.components[0]).unwrap();
    let n = store.blocks().len();
    for i in 0..n {
        ring.block_at(i).unwrap().finish().unwrap();
    }
    ring.end_step().unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let t = file.specs().iter().position(|t| t.name == "blocks.2.a").unwrap();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(&p).unwrap();
    let mut byte = [0u8];
    f.read_exact_at(&mut byte, file.data_offset(t) + 4242).unwrap();
    f.write_all_at(&[byte[0] ^ 0xa5], file.data_offset(t) + 4242).unwrap();
    let mut seen = None;
    for i in 0..n {
        let done = match ring.block_at(i) {
            Ok(block) => block.finish(),
            Err(e) => Err(e),
        };
        if let Err(e) = done {
            seen = Some(e.to_string());
            break;
        }
    }
    let e = match seen {
        Some(e) => e,
        None => ring.end_step().expect_err("the second step's end sees the change").to_string(),
    };
    assert!(e.contains("m.safetensors") && e.contains("since it was opened"), "{e}");
    let later = ring.block_at(0).err().expect("refused after the change").to_string();
    assert!(later.contains("m.safetensors"), "{later}");
    let closed = ring.close().expect_err("close re-checks the file").to_string();
    assert!(closed.contains("m.safetensors"), "{closed}");
}

/// On a GPU: each registration a driver may refuse, refused on purpose in
/// turn. The store serves the file by the next way that works and says which
/// (`HostTier::registration`), with the same bytes in every slot; with all
/// three refused it copies every block and says why.
#[test]
fn each_registration_refused_falls_back_to_the_next() {
    use offload_core::{BlockDiscovery, HostStore, NameDiscovery, PinOptions};
    let Some(b) = super::test_backend() else { return };
    let p = model("fallback");
    let copied = {
        let file = map_checkpoint(&p).unwrap();
        let inv = NameDiscovery.discover("model", file.specs()).unwrap();
        HostStore::build(&b, &inv, &file).unwrap()
    };
    for refuse in 0..=3u8 {
        b.refuse_registrations(refuse);
        let file = map_checkpoint(&p).unwrap();
        let inv = NameDiscovery.discover("model", file.specs()).unwrap();
        let store = Arc::new(HostStore::build_mapped(&b, &inv, &file, PinOptions::default()).unwrap());
        let tier = store.tier().clone();
        println!("refused {refuse}: {tier:?}");
        if refuse < 3 {
            let how = tier.registration.clone().unwrap_or_default();
            let at = REGISTRATIONS.iter().position(|r| *r == how).unwrap_or(usize::MAX);
            assert!(at >= refuse as usize && at < 3, "refused {refuse}: registered as {how:?}");
            assert_eq!(tier.mapped, 5, "{tier:?}");
        } else {
            assert_eq!((tier.mapped, tier.registration.as_deref()), (0, None), "{tier:?}");
            assert!(tier.copy_reason.as_deref().unwrap_or("").contains("refused every way"), "{tier:?}");
        }
        slots_hold(&b, &inv, &store, &copied);
    }
    b.refuse_registrations(0);
}

/// A store built with `pin_by_register` on (and its registration refused
/// where `refuse`), beside a plain copied store of the same file: each block of
/// the first must be `registered` (a registered mapping) or not, page-locked
/// either way and counted; both stream the same bytes; dropped, the count comes
/// back. Returns whether the way was given up for the engine.
fn pin_by_register_store(b: &CudaBackend, name: &str, refuse: bool, registered: bool) -> bool {
    use offload_core::{BlockDiscovery, HostStore, NameDiscovery};
    use std::sync::atomic::Ordering;
    let p = model(name);
    let file = map_checkpoint(&p).unwrap();
    let inv = NameDiscovery.discover("model", file.specs()).unwrap();
    let copied = HostStore::build(b, &inv, &file).unwrap();
    let before = b.counters().pinned_bytes;
    b.engine().pin_by_register.store(true, Ordering::Relaxed);
    b.engine().refuse_pin_register.store(refuse, Ordering::Relaxed);
    let store = HostStore::build(b, &inv, &file);
    let given_up = !b.engine().pin_by_register.swap(false, Ordering::Relaxed);
    b.engine().refuse_pin_register.store(false, Ordering::Relaxed);
    let store = Arc::new(store.unwrap());
    for blk in store.blocks() {
        let buf = blk.buffer().unwrap();
        assert!(buf.is_pinned(), "{}: not page-locked", blk.id);
        assert_eq!(buf.bytes().is_registered_mapping(), registered, "{}: a registered mapping or not", blk.id);
    }
    assert_eq!(b.counters().pinned_bytes - before, store.pinned_bytes());
    slots_hold(b, &inv, &store, &copied);
    drop(store);
    assert_eq!(b.counters().pinned_bytes, before);
    given_up
}

/// On a GPU: with `pin_by_register` (each buffer an anonymous mapping filled,
/// then registered with `cuMemHostRegister`), a copied store's blocks are page-locked
/// mappings of their own, counted in the pinned bytes, and stream the bytes a
/// store of `cuMemHostAlloc` buffers streams; dropped, the count comes back.
#[test]
fn host_buffers_pinned_by_registering_stream_the_same_bytes() {
    let Some(b) = super::test_backend() else { return };
    assert!(!pin_by_register_store(&b, "register", false, true), "no registration was refused: the way stays");
}

/// On a GPU: where `cuMemHostRegister` refuses (as a driver may, for a locked-
/// memory limit), the way is given up for the engine after one refusal, and
/// the refused buffer and every later one come from `cuMemHostAlloc`: page-
/// locked, counted, and streaming the bytes a plain store streams (the refused
/// buffer from the bytes its fill already wrote, never read twice).
#[test]
fn a_refused_registration_falls_back_to_allocated_pinned_buffers_with_the_same_bytes() {
    let Some(b) = super::test_backend() else { return };
    assert!(pin_by_register_store(&b, "register-refused", true, false), "a refused registration must give the way up");
}
