//! The host store's tests on the simulated device: tiers, checkpoints served in
//! place, coded blocks, changed files, the probe.

use crate::sim::{SimBackend, SimConfig};
use crate::{
    discovery::BlockDiscovery, discovery::NameDiscovery, host::HostBuffer, source::MemoryTensors, source::RegionSource,
    source::SafetensorsFile, source::TensorSource, store::probe_bandwidth, store::HostBlock, store::HostStore, store::PinOptions,
    tensor::DType, tensor::TensorSpec,
};

/// A store with no block in host memory has no rate to report: 0 would plan
/// every streamed block as taking forever, so it is an error. A coded file
/// hashed in pieces of 0 bytes is refused, not a panic.
#[test]
fn a_probe_of_nothing_and_pieces_of_nothing_are_errors() {
    let mut src = MemoryTensors::new();
    for i in 0..2 {
        src.push(TensorSpec::new(format!("blocks.{i}.w"), DType::U8, [4096]), vec![i as u8 + 1; 4096]).unwrap();
    }
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let empty = crate::discovery::ComponentInventory { name: "m".into(), stacks: Vec::new(), non_block: Vec::new() };
    let store = HostStore::build(&be, &empty, &src).expect("a store of no blocks");
    let e = probe_bandwidth(&be, &store, 1).unwrap_err().to_string();
    assert!(e.contains("no block is held in host memory"), "{e}");
    let path = std::env::temp_dir().join(format!("offload-pieces-0-{}.offload-coded", std::process::id()));
    let e = crate::coded_file::CodedFile::write_with(&path, &inv, &src, 1 << 16, 1, 0, 1, &|_, _| {}).unwrap_err().to_string();
    assert!(e.contains("pieces of at least one byte"), "{e}");
    assert!(!path.exists());
}

/// A plan resolved against another inventory (a renamed checkpoint's, say)
/// is refused by the ring, naming the block, instead of streaming a block
/// the plan keeps resident or leaving one the store holds unplanned.
#[test]
fn a_ring_refuses_a_plan_of_other_blocks() {
    let tensors = |n: usize| {
        let mut src = MemoryTensors::new();
        for i in 0..n {
            src.push(TensorSpec::new(format!("blocks.{i}.w"), DType::U8, [4096]), vec![i as u8 + 1; 4096]).unwrap();
        }
        src
    };
    let (three, four) = (tensors(3), tensors(4));
    let inv3 = NameDiscovery.discover("m", three.specs()).unwrap();
    let inv4 = NameDiscovery.discover("m", four.specs()).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let store = std::sync::Arc::new(HostStore::build(&be, &inv3, &three).unwrap());
    let keep3 = crate::plan::Plan::layerwise()
        .component("m", crate::plan::ComponentPlan { resident_blocks: vec!["blocks.3".into()], ..Default::default() });
    let rc = crate::plan::resolve(&keep3, std::slice::from_ref(&inv4)).unwrap().components.remove(0);
    let e = crate::ring::Ring::new(be.clone(), store.clone(), &rc).err().expect("a plan of four blocks on a store of three").to_string();
    assert!(e.contains("blocks.3") && e.contains("does not hold"), "{e}");
    let store4 = std::sync::Arc::new(HostStore::build(&be, &inv4, &four).unwrap());
    let rc3 = crate::plan::resolve(&crate::plan::Plan::layerwise(), std::slice::from_ref(&inv3)).unwrap().components.remove(0);
    let e = crate::ring::Ring::new(be.clone(), store4, &rc3).err().expect("a plan of three blocks on a store of four").to_string();
    assert!(e.contains("blocks.3") && e.contains("does not name"), "{e}");
    assert!(crate::ring::Ring::new(be, store, &rc3).is_ok());
}

#[test]
fn probe_reports_a_rate_and_frees_its_slot() {
    let mut src = MemoryTensors::new();
    for i in 0..3 {
        src.push(TensorSpec::new(format!("blocks.{i}.w"), DType::U8, [4096 + i]), vec![i as u8 + 1; 4096 + i]).unwrap();
    }
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let store = HostStore::build(&be, &inv, &src).unwrap();
    let live = be.stats().live_bytes;
    let bw = probe_bandwidth(&be, &store, 2).unwrap();
    assert!(bw.is_finite() && bw > 0.0, "{bw}");
    assert_eq!(be.stats().live_bytes, live);
    assert!(be.stats().violations.is_empty(), "{:?}", be.stats().violations);
}

#[test]
fn a_host_fault_lands_on_the_same_block_whether_or_not_coding_fell_back() {
    // A backend that cannot decode: the store's first coded allocation is
    // refused and it holds the blocks as they are. The fault schedule counts
    // allocations, so the n-th fails the same block as in an uncoded build.
    let mut src = MemoryTensors::new();
    for i in 0..4 {
        src.push(TensorSpec::new(format!("blocks.{i}.w"), DType::U8, [4096]), random(4096, 40 + i)).unwrap();
    }
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    // The same from a coded file (`alloc_host_precoded` refused instead).
    let path = temp("fault-coded-file").with_extension("offload-coded");
    crate::coded_file::CodedFile::write(&path, &inv, &src, crate::sim::SIM_SEGMENT_BYTES, 2).unwrap();
    let cf = crate::coded_file::CodedFile::open(&path).unwrap();
    for n in 0..4 {
        let mut failed = Vec::new();
        for how in 0..3 {
            let be = crate::fault::FaultInjector::new(SimBackend::new(SimConfig { decodes: false, ..SimConfig::fast() }));
            be.arm(crate::fault::FaultKind::HostAlloc, n);
            let pin = PinOptions { coded: how == 1, ..Default::default() };
            let built = match how {
                2 => HostStore::build_from_coded_file(&be, &inv, &src, pin, &cf),
                _ => HostStore::build_with(&be, &inv, &src, pin),
            };
            let e = built.err().expect("the armed fault fails the build").to_string();
            assert!(e.contains(&format!("HostAlloc #{n}")), "{e}");
            failed.push(e);
        }
        assert!(failed[0] == failed[1] && failed[0] == failed[2], "fault #{n}: {failed:?}");
    }
    std::fs::remove_file(&path).unwrap();
}

/// A safetensors file written by hand, tensors in the order given (so a test
/// chooses what lies where), the header padded to a multiple of 8.
fn write_checkpoint(path: &std::path::Path, tensors: &[(String, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut at = 0usize;
    for (name, bytes) in tensors {
        header.insert(name.clone(), serde_json::json!({"dtype": "U8", "shape": [bytes.len()], "data_offsets": [at, at + bytes.len()]}));
        at += bytes.len();
    }
    let mut h = serde_json::to_vec(&serde_json::Value::Object(header)).unwrap();
    while h.len() % 8 != 0 {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    for (_, bytes) in tensors {
        out.extend_from_slice(bytes);
    }
    std::fs::write(path, out).unwrap();
}

/// Fresh random bytes (never zeros).
fn random(n: usize, seed: u64) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n).map(|_| r.gen_range(1..=255u8)).collect()
}

/// Three blocks of two tensors and a non-block tensor; block 1's first
/// tensor is `odd` bytes long when given, so its second does not lie at a
/// multiple of 256 after it and block 1 cannot be served in place (the blocks
/// after it can: only distances within a block matter).
fn model(odd: Option<usize>) -> Vec<(String, Vec<u8>)> {
    let mut t = Vec::new();
    for b in 0..3u64 {
        let n = if b == 1 { odd.unwrap_or(4096) } else { 4096 };
        t.push((format!("blocks.{b}.a"), random(n, b * 2)));
        t.push((format!("blocks.{b}.b"), random(1024, b * 2 + 1)));
    }
    t.push(("head.w".to_string(), random(512, 99)));
    t
}

fn temp(name: &str) -> std::path::PathBuf {
    let d = std::env::temp_dir().join(format!("offload-mapped-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d.join("m.safetensors")
}

/// Every tensor's bytes in a store, by name, read through its layout.
fn tensors_of(be: &SimBackend, store: &HostStore<SimBackend>) -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    for b in store.blocks().iter().chain(store.non_block()) {
        let bytes = store.with_buffer(be, b, |buffer| Ok(buffer.block_bytes().unwrap().to_vec())).unwrap();
        for t in &b.layout.tensors {
            out.push((t.spec.name.clone(), bytes[t.offset..t.offset + t.nbytes].to_vec()));
        }
    }
    out.sort();
    out
}

#[test]
fn a_mapped_store_serves_the_files_bytes_in_place_and_copies_only_what_it_must() {
    for (odd, want_mapped) in [(None, 4), (Some(1000), 3)] {
        let path = temp(&format!("serve-{}", odd.is_some()));
        let tensors = model(odd);
        write_checkpoint(&path, &tensors);
        let file = SafetensorsFile::open(&path).unwrap();
        let inv = NameDiscovery.discover("m", file.specs()).unwrap();
        let be = SimBackend::new(SimConfig::fast());
        let copied = HostStore::build(&be, &inv, &file).unwrap();
        let pinned_before = be.stats().pinned_bytes;
        let mapped = HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).unwrap();
        let tier = mapped.tier();
        assert_eq!((tier.mapped, tier.copied), (want_mapped, 4 - want_mapped), "{tier:?}");
        match odd {
            None => assert_eq!(tier.copy_reason, None),
            Some(_) => {
                let why = tier.copy_reason.as_deref().unwrap_or("");
                assert!(why.contains("blocks.1") && why.contains("multiple of 256"), "{why}");
            }
        }
        // The same bytes, tensor by tensor, as the copying store and the file.
        let mut want: Vec<(String, Vec<u8>)> = tensors.clone();
        want.sort();
        assert_eq!(tensors_of(&be, &mapped), want);
        assert_eq!(tensors_of(&be, &copied), want);
        // A served block's layout is the file's: its tensors at their distance in the file.
        let b0 = &mapped.blocks()[0];
        assert_eq!(b0.layout.get("blocks.0.b").unwrap().offset, 4096);
        assert!(mapped.tier().build_s > 0.0 && be.stats().violations.is_empty());
        // What is page-locked: the whole file, registered once, and the copied
        // block's own buffer; the store and the device count the same.
        let file_len = std::fs::metadata(&path).unwrap().len();
        let copied_bytes: u64 = (0..4).filter(|&i| i == 1 && odd.is_some()).map(|i| mapped.blocks()[i].bytes() as u64).sum();
        assert_eq!(mapped.pinned_bytes(), file_len + copied_bytes);
        assert_eq!(be.stats().pinned_bytes - pinned_before, mapped.pinned_bytes());
        assert!(mapped.is_pinned());
    }
}

#[test]
fn a_device_that_cannot_register_gets_the_copying_store_and_says_so() {
    let path = temp("noreg");
    let tensors = model(None);
    write_checkpoint(&path, &tensors);
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    let be = SimBackend::new(SimConfig { registers_regions: false, ..SimConfig::fast() });
    let store = HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).unwrap();
    assert_eq!((store.tier().mapped, store.tier().copied), (0, 4));
    let why = store.tier().copy_reason.clone().unwrap_or_default();
    assert!(why.contains("did not register"), "{why}");
    let mut want = tensors;
    want.sort();
    assert_eq!(tensors_of(&be, &store), want);
}

#[test]
fn a_file_truncated_or_replaced_after_open_is_a_named_error_not_a_crash() {
    // Truncated (as `cp new old` does before it writes).
    let path = temp("trunc");
    write_checkpoint(&path, &model(None));
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(100).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let e = HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).err().expect("a truncated file is refused");
    let msg = e.to_string();
    assert!(msg.contains("m.safetensors") && msg.contains("truncated"), "{msg}");
    let mut dst = [0u8; 16];
    assert!(file.region().read_at(0, &mut dst).is_err(), "a read of the truncated file fails");
    // Replaced: another file renamed over the path.
    let path = temp("replace");
    write_checkpoint(&path, &model(None));
    let file = SafetensorsFile::open(&path).unwrap();
    let other = path.with_extension("new");
    write_checkpoint(&other, &model(None));
    std::fs::rename(&other, &path).unwrap();
    let e = HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).err().expect("a replaced file is refused");
    assert!(e.to_string().contains("replaced"), "{e}");
    // Nothing was kept on either error.
    assert_eq!(be.stats().pinned_bytes, 0);
}

#[test]
fn a_file_renamed_over_still_gives_its_opened_bytes_back_and_a_rewritten_one_does_not() {
    // What putting a module back reads: a file replaced by a rename is still
    // the opened one (unlinked, unchanged), so its blocks' bytes are there;
    // rewritten in place, they are not. The step check refuses both.
    let path = temp("held-replaced");
    write_checkpoint(&path, &model(None));
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    let be = SimBackend::new(SimConfig { registers_regions: true, ..SimConfig::fast() });
    let store = HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).unwrap();
    assert!(store.tier().mapped > 0, "{:?}", store.tier());
    let before: Vec<Vec<u8>> =
        store.blocks().iter().map(|b| store.with_buffer(&be, b, |h| h.block_bytes().map(<[u8]>::to_vec)).unwrap()).collect();
    let other = path.with_extension("new");
    let flipped: Vec<(String, Vec<u8>)> = model(None).into_iter().map(|(n, b)| (n, b.iter().map(|x| x ^ 0xff).collect())).collect();
    write_checkpoint(&other, &flipped);
    std::fs::rename(&other, &path).unwrap();
    assert!(file.region().check().is_err(), "the path names another file");
    store.check_sources().expect("the steps go on serving the opened file, as a resident module keeps its weights");
    file.region().held().expect("the opened file still holds its bytes");
    for (b, want) in store.blocks().iter().zip(&before) {
        let got = store.with_buffer(&be, b, |h| h.block_bytes().map(<[u8]>::to_vec)).expect("readable after a rename");
        assert_eq!(&got, want, "{}", b.id);
    }
    // Rewritten in place: the same file, written since.
    let path = temp("held-rewritten");
    write_checkpoint(&path, &model(None));
    let file = SafetensorsFile::open(&path).unwrap();
    let store = HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).unwrap();
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mut f = std::fs::OpenOptions::new().write(true).open(&path).unwrap();
    std::io::Write::write_all(&mut f, b"{").unwrap();
    drop(f);
    let e = file.region().held().expect_err("a rewritten file no longer holds its bytes").to_string();
    assert!(e.contains("written since"), "{e}");
    assert!(store.check_sources().is_err(), "a step refuses a file written in place");
    assert!(store.tier().mapped > 0, "{:?}", store.tier());
    let e = store.with_buffer(&be, &store.blocks()[0], |h| h.block_bytes().map(<[u8]>::to_vec)).expect_err("its bytes are gone");
    assert!(e.to_string().contains("written since"), "{e}");
}

#[test]
fn a_region_of_another_length_is_refused() {
    let path = temp("len");
    write_checkpoint(&path, &model(None));
    let mut file = SafetensorsFile::open(&path).unwrap();
    let short = temp("len-short");
    write_checkpoint(&short, &model(Some(16)));
    let other = SafetensorsFile::open(&short).unwrap();
    assert!(file.set_region(other.region()).is_err());
    // Another file of the same length, and this one written since it was opened.
    let same = temp("len-same");
    write_checkpoint(&same, &model(None));
    let other = SafetensorsFile::open(&same).unwrap();
    let e = file.set_region(other.region()).unwrap_err().to_string();
    assert!(e.contains("device and inode"), "{e}");
    let again = SafetensorsFile::open(&path).unwrap();
    write_in_place(&path, 100, true);
    let e = file.set_region(again.region()).unwrap_err().to_string();
    assert!(e.contains("change time"), "{e}");
    assert!(file.set_region(file.region()).is_err(), "its own region fails its check now");
}

#[test]
fn a_block_with_another_tensor_in_its_padding_or_past_the_pin_budget_is_copied() {
    // blocks.0.a ends 96 bytes short of 4096; a non-block tensor fills the gap.
    let tensors = vec![
        ("blocks.0.a".to_string(), random(4000, 1)),
        ("x.tail".to_string(), random(96, 2)),
        ("blocks.0.b".to_string(), random(1024, 3)),
        ("blocks.1.a".to_string(), random(4096, 4)),
        ("blocks.1.b".to_string(), random(1024, 5)),
    ];
    let path = temp("gap");
    write_checkpoint(&path, &tensors);
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let store = HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).unwrap();
    // blocks.1 and the non-block tensor served in place, blocks.0 copied.
    assert_eq!((store.tier().mapped, store.tier().copied), (2, 1), "{:?}", store.tier());
    let why = store.tier().copy_reason.clone().unwrap_or_default();
    assert!(why.contains("blocks.0") && why.contains("x.tail lies among"), "{why}");
    let mut want = tensors.clone();
    want.sort();
    assert_eq!(tensors_of(&be, &store), want);
    // A pin budget of one block: the rest copied into pageable memory, and said why.
    let pin = PinOptions { budget_bytes: Some(5200), fallback: crate::plan::PinFallback::Pageable, ..PinOptions::default() };
    let before = be.stats().pinned_bytes;
    let store = HostStore::build_mapped(&be, &inv, &file, pin).unwrap();
    assert!(store.pinned_bytes() <= 5200, "{}", store.pinned_bytes());
    assert!(be.stats().pinned_bytes - before <= 5200, "{} page-locked", be.stats().pinned_bytes - before);
    assert_eq!(tensors_of(&be, &store), want);
}

/// Serving a block in place registers the whole file page-locked, whatever
/// share of it is served: a pin budget of one block on a file of six blocks
/// (and a non-block tensor) keeps every block out of the file and what is
/// page-locked within the budget, and says why; a budget that holds the whole
/// file serves every block and counts the file once.
#[test]
fn the_mapped_tier_charges_the_whole_registered_file_to_the_pin_budget() {
    let path = temp("pin-budget");
    let tensors = disk_model(6, 4096);
    write_checkpoint(&path, &tensors);
    let file_len = std::fs::metadata(&path).unwrap().len();
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    let mut want = tensors.clone();
    want.sort();
    let one_block = HostStore::build(&SimBackend::new(SimConfig::fast()), &inv, &file).unwrap().largest_block_bytes() as u64;
    let be = SimBackend::new(SimConfig::fast());
    let pin = PinOptions { budget_bytes: Some(one_block), fallback: crate::plan::PinFallback::Pageable, ..PinOptions::default() };
    let store = HostStore::build_mapped(&be, &inv, &file, pin).unwrap();
    assert_eq!(store.tier().mapped, 0, "{:?}", store.tier());
    let why = store.tier().copy_reason.clone().unwrap_or_default();
    assert!(why.contains("page-locks the whole of") && why.contains("m.safetensors"), "{why}");
    assert!(be.stats().pinned_bytes <= one_block, "{} bytes page-locked under a budget of {one_block}", be.stats().pinned_bytes);
    assert_eq!(store.pinned_bytes(), be.stats().pinned_bytes);
    assert!(!store.is_pinned(), "the blocks past the budget are pageable");
    assert_eq!(tensors_of(&be, &store), want);
    // A budget of the whole file: every buffer served in place, the file counted once.
    let be = SimBackend::new(SimConfig::fast());
    let pin = PinOptions { budget_bytes: Some(file_len), fallback: crate::plan::PinFallback::Fail, ..PinOptions::default() };
    let store = HostStore::build_mapped(&be, &inv, &file, pin).unwrap();
    assert_eq!((store.tier().mapped, store.tier().copied), (7, 0), "{:?}", store.tier());
    assert_eq!((store.pinned_bytes(), be.stats().pinned_bytes), (file_len, file_len));
    assert_eq!(tensors_of(&be, &store), want);
}

/// Write one byte at `at` of `path` in place (same file, same length), as
/// `dd conv=notrunc` would; with `keep_mtime`, put the modification time back
/// after (as `cp -p`, `touch -r` and `rsync -t --inplace` leave it).
fn write_in_place(path: &std::path::Path, at: u64, keep_mtime: bool) {
    use std::os::unix::fs::FileExt;
    // Past the file system's timestamp granularity of the file's last change.
    std::thread::sleep(std::time::Duration::from_millis(20));
    let mtime = std::fs::metadata(path).unwrap().modified().unwrap();
    let f = std::fs::OpenOptions::new().read(true).write(true).open(path).unwrap();
    let mut b = [0u8];
    f.read_exact_at(&mut b, at).unwrap();
    f.write_all_at(&[b[0] ^ 0x5a], at).unwrap();
    if keep_mtime {
        f.set_modified(mtime).unwrap();
        assert_eq!(std::fs::metadata(path).unwrap().modified().unwrap(), mtime);
    }
}

/// A file written in place after it was opened, its modification time put
/// back or not, is refused by the copying read (`read_into`), by the mapped
/// store's build, and between two steps of a ring over a mapped store: that
/// step's end is an error naming the file and every later block is refused.
#[test]
fn a_file_written_in_place_is_refused_at_build_and_at_the_next_step_boundary() {
    use crate::{plan::resolve, plan::Plan, ring::Ring};
    for keep_mtime in [false, true] {
        let path = temp(&format!("in-place-{keep_mtime}"));
        let tensors = disk_model(4, 4096);
        write_checkpoint(&path, &tensors);
        // Read by the copying store: refused.
        let file = SafetensorsFile::open(&path).unwrap();
        let inv = NameDiscovery.discover("m", file.specs()).unwrap();
        write_in_place(&path, file.data_offset(0) + 7, keep_mtime);
        let mut dst = vec![0u8; file.specs()[0].nbytes().unwrap()];
        let e = file.read_into(0, &mut dst).unwrap_err().to_string();
        assert!(e.contains("m.safetensors") && e.contains(&file.specs()[0].name) && e.contains("since it was opened"), "{e}");
        let be = SimBackend::new(SimConfig::fast());
        assert!(HostStore::build(&be, &inv, &file).is_err());
        assert!(HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).is_err());
        // Between two steps of a ring over the mapped store.
        let file = SafetensorsFile::open(&path).unwrap();
        let store = std::sync::Arc::new(HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).unwrap());
        assert_eq!(store.tier().mapped, 5);
        let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inv)).unwrap();
        let mut ring = Ring::new(be.clone(), store.clone(), &plan.components[0]).unwrap();
        for i in 0..4 {
            drop(ring.block_at(i).unwrap());
        }
        ring.end_step().unwrap();
        let at = file.data_offset(file.specs().iter().position(|t| t.name == "blocks.2.a").unwrap()) + 100;
        write_in_place(&path, at, keep_mtime);
        for i in 0..4 {
            drop(ring.block_at(i).unwrap());
        }
        let e = ring.end_step().unwrap_err().to_string();
        assert!(e.contains("m.safetensors") && e.contains("since it was opened"), "{e}");
        let later = ring.block_at(0).err().expect("a block after the change is refused").to_string();
        assert!(later.contains("m.safetensors"), "{later}");
        assert!(ring.end_step().is_err());
    }
}

/// A checkpoint of four blocks ([`disk_model`]) at `temp(tag)`, opened, its
/// inventory (component "m"), and a fast simulated device.
fn four_blocks(tag: &str) -> (std::path::PathBuf, SafetensorsFile, crate::discovery::ComponentInventory, SimBackend) {
    let path = temp(tag);
    write_checkpoint(&path, &disk_model(4, 4096));
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    (path, file, inv, SimBackend::new(SimConfig::fast()))
}

/// A change made after the last step's `end_step` (its copies may still be
/// queued then) is seen when the ring closes, when an on-demand component is
/// released and by a buffer's `block_bytes`; a file rewritten while its
/// header is read is refused by `open` (the identity is taken before the header).
#[test]
fn a_change_after_the_last_step_is_an_error_at_close_and_release() {
    use crate::{ondemand::OnDemand, plan::resolve, plan::Plan, ring::Ring};
    let (path, file, inv, be) = four_blocks("after-last-step");
    let store = std::sync::Arc::new(HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).unwrap());
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inv)).unwrap();
    let mut ring = Ring::new(be.clone(), store.clone(), &plan.components[0]).unwrap();
    for i in 0..4 {
        drop(ring.block_at(i).unwrap());
    }
    ring.end_step().unwrap();
    let on_demand = OnDemand::load(be.clone(), store.clone()).unwrap();
    write_in_place(&path, file.data_offset(1) + 3, false);
    let e = ring.close().unwrap_err().to_string();
    assert!(e.contains("m.safetensors") && e.contains("since it was opened"), "{e}");
    let e = on_demand.release().unwrap_err().to_string();
    assert!(e.contains("m.safetensors"), "{e}");
    // A buffer served in place no longer gives its bytes (a reference run or
    // the Python package's disable would read the old ones).
    let e = store.blocks()[0].buffer().unwrap().block_bytes().map(drop).expect_err("changed").to_string();
    assert!(e.contains("m.safetensors"), "{e}");
    // Rewritten in place while its header is read: refused by open.
    let at = file.data_offset(0) + 11;
    let e = SafetensorsFile::open_then(&path, &|| write_in_place(&path, at, true)).map(drop).expect_err("refused").to_string();
    assert!(e.contains("m.safetensors") && e.contains("since it was opened"), "{e}");
    let reopened = SafetensorsFile::open(&path).unwrap();
    // Deleted after it was opened: the read names the file and the tensor.
    std::fs::remove_file(&path).unwrap();
    let mut dst = vec![0u8; reopened.specs()[0].nbytes().unwrap()];
    let e = reopened.read_into(0, &mut dst).unwrap_err().to_string();
    assert!(e.contains("m.safetensors") && e.contains(&reopened.specs()[0].name), "{e}");
}

/// A plan that leaves blocks on disk and a store that holds them otherwise
/// (the plan's host RAM count would be wrong) do not make a ring.
#[test]
fn a_store_whose_disk_blocks_are_not_the_plans_is_refused() {
    use crate::{plan::resolve, plan::ComponentPlan, plan::Plan, ring::Ring};
    let (_, file, inv, be) = four_blocks("disk-split");
    let cp = ComponentPlan { disk_blocks: vec!["blocks.1".into(), "blocks.3".into()], ..Default::default() };
    let rc = resolve(&Plan::layerwise().component("m", cp), std::slice::from_ref(&inv)).unwrap().components.remove(0);
    let in_memory = std::sync::Arc::new(HostStore::build(&be, &inv, &file).unwrap());
    let e = Ring::new(be.clone(), in_memory, &rc).err().expect("refused").to_string();
    assert!(e.contains("block blocks.1 on disk, the store in memory"), "{e}");
    let other = std::sync::Arc::new(HostStore::build_tiered(&be, &inv, &file, PinOptions::default(), &|id| id.index == 0).unwrap());
    let e = Ring::new(be.clone(), other, &rc).err().expect("refused").to_string();
    assert!(e.contains("block blocks.0 in memory, the store on disk"), "{e}");
    let planned = std::sync::Arc::new(HostStore::build_tiered(&be, &inv, &file, PinOptions::default(), &|id| rc.is_on_disk(id)).unwrap());
    Ring::new(be.clone(), planned, &rc).unwrap().close().unwrap();
    // A host RAM budget that holds every block in memory puts none on disk: a
    // store with one there (its bounce buffers uncounted) is refused as well.
    let all = resolve(&Plan::layerwise(), std::slice::from_ref(&inv)).unwrap().components.remove(0).host_ram_bytes;
    let cp = ComponentPlan { host_ram_budget_bytes: Some(all), ..Default::default() };
    let rc = resolve(&Plan::layerwise().component("m", cp), std::slice::from_ref(&inv)).unwrap().components.remove(0);
    assert!(rc.on_disk.is_empty());
    let other = std::sync::Arc::new(HostStore::build_tiered(&be, &inv, &file, PinOptions::default(), &|id| id.index == 0).unwrap());
    let e = Ring::new(be.clone(), other, &rc).err().expect("refused").to_string();
    assert!(e.contains("block blocks.0 in memory, the store on disk"), "{e}");
}

/// The disk tier's bounce buffers are page-locked beside the store: a pin
/// budget that holds the store but not them is refused by the ring, naming
/// both, and at store + bounce the ring page-locks exactly the bounce bytes
/// it counted (the simulator counts what it page-locks).
#[test]
fn the_disk_tiers_bounce_buffers_count_against_the_pin_budget() {
    use crate::{plan::resolve, plan::ComponentPlan, plan::Plan, ring::Ring};
    let (_, file, inv, be) = four_blocks("disk-pin-budget");
    let with = |budget: Option<u64>| {
        let cp =
            ComponentPlan { disk_blocks: vec!["blocks.1".into(), "blocks.3".into()], host_pin_budget_bytes: budget, ..Default::default() };
        resolve(&Plan::layerwise().component("m", cp), std::slice::from_ref(&inv)).unwrap().components.remove(0)
    };
    let rc = with(None);
    let store = std::sync::Arc::new(HostStore::build_tiered(&be, &inv, &file, PinOptions::default(), &|id| rc.is_on_disk(id)).unwrap());
    let largest = store.blocks().iter().filter(|b| b.disk_offset().is_some()).map(|b| b.bytes()).max().unwrap();
    let bounce = (3 * crate::disk::DiskFile::span(largest)) as u64;
    let pinned = store.pinned_bytes();
    let e = Ring::new(be.clone(), store.clone(), &with(Some(pinned + bounce - 1))).map(drop).expect_err("refused").to_string();
    assert!(
        e.contains("host pin budget") && e.contains(&format!("the store's {pinned} + the disk tier's 3 bounce buffers, {bounce} bytes")),
        "{e}"
    );
    let before = be.stats().pinned_bytes;
    let ring = Ring::new(be.clone(), store.clone(), &with(Some(pinned + bounce))).unwrap();
    assert_eq!(be.stats().pinned_bytes - before, bounce, "page-locked by the ring");
    ring.close().unwrap();
    assert_eq!(be.stats().pinned_bytes, before, "the bounce buffers given back at close");
}

/// `blocks` blocks of two tensors (the first `big` bytes) and a non-block
/// tensor, random bytes.
fn disk_model(blocks: u64, big: usize) -> Vec<(String, Vec<u8>)> {
    let mut t = Vec::new();
    for b in 0..blocks {
        t.push((format!("blocks.{b}.a"), random(big, 100 + b * 2)));
        t.push((format!("blocks.{b}.b"), random(768, 101 + b * 2)));
    }
    t.push(("head.w".to_string(), random(512, 7)));
    t
}

/// Each block's bytes as the ring serves them, over `steps` steps in `order`,
/// against the copying store's; the ring's metrics of the last step.
fn serve(
    be: &SimBackend,
    store: &std::sync::Arc<HostStore<SimBackend>>,
    want: &HostStore<SimBackend>,
    plan: &crate::plan::ResolvedComponent,
    order: &[usize],
    steps: usize,
) -> crate::error::Result<crate::metrics::StepMetrics> {
    let mut ring = crate::ring::Ring::new(be.clone(), store.clone(), plan)?;
    let mut m = None;
    for _ in 0..steps {
        for &i in order {
            let block = ring.block_at(i)?;
            let got = be.read_slot(block.slot(), |w| w[..want.blocks()[i].bytes()].to_vec());
            drop(block);
            let expect = want.blocks()[i].buffer().unwrap().block_bytes().unwrap();
            assert!(got == expect, "block {i} served other bytes than the copying store holds");
        }
        m = Some(ring.end_step()?);
    }
    ring.close()?;
    Ok(m.unwrap())
}

/// `n` bf16 values drawn normal with standard deviation `std` (what a real
/// checkpoint's weights look like: their exponents code to about 2.6 bits).
fn normal_bf16(n: usize, std: f32, seed: u64) -> Vec<u8> {
    use rand::{Rng, SeedableRng};
    let mut r = rand::rngs::StdRng::seed_from_u64(seed);
    (0..n)
        .flat_map(|_| {
            let (u, v): (f32, f32) = (r.gen_range(1e-7..1.0), r.gen_range(0.0..1.0));
            let x = std * (-2.0 * u.ln()).sqrt() * (std::f32::consts::TAU * v).cos();
            ((x.to_bits() >> 16) as u16).to_le_bytes()
        })
        .collect()
}

/// Three blocks of bf16 weights (two tensors each, one of odd length) and a
/// non-block tensor of random bytes (incompressible: kept raw).
fn coded_model(seed: u64) -> MemoryTensors {
    let mut src = MemoryTensors::new();
    for b in 0..3u64 {
        // Block 1 the largest: the scratch buffer the coded file's build reads
        // raw bytes into is reused for a smaller block after it.
        let n = [100_000, 120_777, 90_001][b as usize];
        src.push(TensorSpec::new(format!("blocks.{b}.w"), DType::BF16, [n]), normal_bf16(n, 0.02, seed + b)).unwrap();
        src.push(TensorSpec::new(format!("blocks.{b}.bias"), DType::BF16, [333]), normal_bf16(333, 0.5, seed + 10 + b)).unwrap();
    }
    src.push(TensorSpec::new("head.w", DType::U8, [5000]), random(5000, seed + 20)).unwrap();
    src
}

#[test]
fn the_probe_counts_a_coded_blocks_bytes_on_the_link() {
    // A coded store's copies move its coded bytes: a probe dividing the raw
    // bytes by their time would report the decode's gain as link bandwidth,
    // and `link bytes / bandwidth` would count the coding twice.
    let src = coded_model(3);
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let plain = HostStore::build(&be, &inv, &src).unwrap();
    let coded = HostStore::build_with(&be, &inv, &src, PinOptions { coded: true, ..Default::default() }).unwrap();
    assert!(coded.coded_blocks() > 0);
    let raw: usize = plain.blocks().iter().map(HostBlock::bytes).sum();
    let link: usize = coded.blocks().iter().map(|b| b.buffer().unwrap().held_bytes().unwrap_or(b.bytes())).sum();
    assert!(link < raw, "{link} of {raw}");
    assert_eq!(super::probe_bytes(&plain), raw);
    assert_eq!(super::probe_bytes(&coded), link);
    assert!(probe_bandwidth(&be, &coded, 1).unwrap() > 0.0);
}

#[test]
fn a_store_from_a_coded_file_serves_the_same_bytes_as_one_coded_at_build() {
    let checkpoint = temp("coded-file");
    let dir = checkpoint.parent().unwrap().to_path_buf();
    let path = crate::coded_file::CodedFile::path_for(&checkpoint);
    let src = coded_model(7);
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    let stats = crate::coded_file::CodedFile::write(&path, &inv, &src, crate::sim::SIM_SEGMENT_BYTES, 2).unwrap();
    assert_eq!(stats.entries, 4, "three blocks and the non-block tensors");
    assert!(stats.coded_bytes < stats.raw_bytes, "{stats:?}");
    let cf = crate::coded_file::CodedFile::open(&path).unwrap();
    assert_eq!((cf.component(), cf.segment_bytes(), cf.entries().len()), ("m", crate::sim::SIM_SEGMENT_BYTES, 4));
    let be = SimBackend::new(SimConfig::fast());
    let plain = HostStore::build(&be, &inv, &src).unwrap();
    let store = std::sync::Arc::new(HostStore::build_from_coded_file(&be, &inv, &src, PinOptions::default(), &cf).unwrap());
    // The head's uniform bytes do not shrink: held raw, as a build that codes holds them.
    assert_eq!(store.coded_blocks(), 3, "every block read coded from the file");
    assert!(store.host_bytes() < plain.host_bytes(), "held coded: {} of {}", store.host_bytes(), plain.host_bytes());
    // The same coded bytes a build that codes would hold (same segments), and
    // on the device the same bytes as the plain store.
    let at_build = HostStore::build_with(&be, &inv, &src, PinOptions { coded: true, ..Default::default() }).unwrap();
    assert_eq!(at_build.host_bytes(), store.host_bytes());
    assert_eq!(tensors_of(&be, &store), tensors_of(&be, &plain));
    let plan = crate::plan::resolve(&crate::plan::Plan::layerwise(), std::slice::from_ref(&inv)).unwrap().components.remove(0);
    let copies = be.stats().coded_copies;
    serve(&be, &store, &plain, &plan, &[0, 1, 2], 2).unwrap();
    let coded_copies = be.stats().coded_copies - copies;
    assert!(coded_copies >= 6, "each block's copy decoded from its coded bytes: {coded_copies} coded copies");
    assert!(be.stats().violations.is_empty(), "{:?}", be.stats().violations);
    // A device without a decoder holds the blocks as they are, the same bytes.
    let raw_be = SimBackend::new(SimConfig { decodes: false, ..SimConfig::fast() });
    let held = HostStore::build_from_coded_file(&raw_be, &inv, &src, PinOptions::default(), &cf).unwrap();
    assert_eq!((held.coded_blocks(), held.host_bytes()), (0, plain.host_bytes()));
    assert_eq!(tensors_of(&raw_be, &held), tensors_of(&be, &plain));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn a_coded_file_damaged_or_made_from_other_weights_is_a_named_error_never_a_wrong_weight() {
    let dir = temp("coded-file-bad").parent().unwrap().to_path_buf();
    let path = dir.join("m.safetensors.offload-coded");
    let src = coded_model(9);
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    crate::coded_file::CodedFile::write(&path, &inv, &src, crate::sim::SIM_SEGMENT_BYTES, 2).unwrap();
    let good = std::fs::read(&path).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let build = |src: &MemoryTensors, inv: &crate::discovery::ComponentInventory| {
        let cf = crate::coded_file::CodedFile::open(&path)?;
        HostStore::build_from_coded_file(&be, inv, src, PinOptions::default(), &cf).map(|_| ())
    };
    let entry = crate::coded_file::CodedFile::open(&path).unwrap().entry("blocks.1").unwrap().clone();
    // One byte of block 1's coded bytes, anywhere in them (its segment table,
    // its stream, its sign-mantissa bytes): damaged, by name.
    for at in [20, entry.len / 2, entry.len - 3] {
        let mut bad = good.clone();
        bad[(entry.at + at) as usize] ^= 0x10;
        std::fs::write(&path, &bad).unwrap();
        let e = build(&src, &inv).unwrap_err();
        let msg = e.to_string();
        assert!(matches!(e, crate::error::Error::CodedFile { .. }), "{msg}");
        assert!(msg.contains("m/blocks.1") && msg.contains("damaged") && msg.contains("offload-coded"), "byte {at}: {msg}");
    }
    std::fs::write(&path, &good).unwrap();
    // Several pieces to an entry (pieces of 4 KiB): the damaged one is named.
    let small = dir.join("small.offload-coded");
    crate::coded_file::CodedFile::write_pieces(&small, &inv, &src, crate::sim::SIM_SEGMENT_BYTES, 2, 4096).unwrap();
    let cf = crate::coded_file::CodedFile::open(&small).unwrap();
    let e1 = cf.entry("blocks.1").unwrap().clone();
    assert!(e1.pieces.len() > 10, "{} pieces", e1.pieces.len());
    HostStore::build_from_coded_file(&be, &inv, &src, PinOptions::default(), &cf).unwrap();
    let mut bad = std::fs::read(&small).unwrap();
    bad[(e1.at + 7 * 4096 + 100) as usize] ^= 0x02;
    std::fs::write(&small, &bad).unwrap();
    let cf = crate::coded_file::CodedFile::open(&small).unwrap();
    let msg = HostStore::build_from_coded_file(&be, &inv, &src, PinOptions::default(), &cf).err().unwrap().to_string();
    assert!(msg.contains("m/blocks.1") && msg.contains("piece 7 ") && msg.contains("damaged"), "{msg}");
    std::fs::remove_file(&small).unwrap();
    // The checkpoint changed since (one value of block 2): made from other weights.
    let mut changed = MemoryTensors::new();
    for (i, spec) in src.specs().iter().enumerate() {
        let mut bytes = vec![0u8; spec.nbytes().unwrap()];
        src.read_into(i, &mut bytes).unwrap();
        if spec.name == "blocks.2.w" {
            bytes[1001] ^= 0x01;
        }
        changed.push(spec.clone(), bytes).unwrap();
    }
    let msg = build(&changed, &inv).unwrap_err().to_string();
    assert!(msg.contains("m/blocks.2") && msg.contains("other weights"), "{msg}");
    // Another component, a block the file lacks, another layout.
    let other = NameDiscovery.discover("vae", src.specs()).unwrap();
    assert!(build(&src, &other).unwrap_err().to_string().contains("written for component \"m\""));
    let mut more = coded_model(9);
    more.push(TensorSpec::new("blocks.3.w", DType::BF16, [64]), normal_bf16(64, 0.02, 1)).unwrap();
    let more_inv = NameDiscovery.discover("m", more.specs()).unwrap();
    let msg = build(&more, &more_inv).unwrap_err().to_string();
    assert!(msg.contains("m/blocks.3") && msg.contains("no entry"), "{msg}");
    // The same on a device without a decoder (every entry is checked before any is read).
    let raw_be = SimBackend::new(SimConfig { decodes: false, ..SimConfig::fast() });
    let cf = crate::coded_file::CodedFile::open(&path).unwrap();
    let msg = HostStore::build_from_coded_file(&raw_be, &more_inv, &more, PinOptions::default(), &cf).err().unwrap().to_string();
    assert!(msg.contains("m/blocks.3") && msg.contains("no entry"), "{msg}");
    // An entry the file's index does not hold is refused, not read.
    let mut foreign = cf.entry("blocks.0").unwrap().clone();
    foreign.at += 1 << 30;
    let mut dst = vec![0u8; foreign.len as usize];
    assert!(cf.read_entry(&foreign, &mut dst, 2).unwrap_err().to_string().contains("does not hold"));
    foreign.at -= 1 << 30;
    foreign.pieces.push(0);
    assert!(cf.read_entry(&foreign, &mut dst, 2).unwrap_err().to_string().contains("does not hold"));
    // Cut short, not a coded file, an index that does not hold together.
    for (what, bytes) in [
        ("cut", good[..good.len() - 100].to_vec()),
        ("empty", Vec::new()),
        ("index", {
            let mut b = good.clone();
            let n = b.len();
            b[n - 17] ^= 0x7f;
            b
        }),
    ] {
        std::fs::write(&path, &bytes).unwrap();
        let e = crate::coded_file::CodedFile::open(&path).unwrap_err();
        assert!(matches!(e, crate::error::Error::CodedFile { .. }) && e.to_string().contains("offload-coded"), "{what}: {e}");
    }
    // A write that fails (a tensor the source lacks) leaves no file behind.
    std::fs::remove_file(&path).unwrap();
    let e = crate::coded_file::CodedFile::write(&path, &more_inv, &src, crate::sim::SIM_SEGMENT_BYTES, 2).unwrap_err().to_string();
    assert!(e.contains("blocks.3.w"), "{e}");
    assert!(std::fs::read_dir(&dir).unwrap().next().is_none(), "nothing left at the path or beside it");
    std::fs::remove_dir_all(&dir).unwrap();
}

/// A coded file forged so that its own hashes hold (two equal-length
/// exponent codes swapped, or one sign-mantissa byte changed, and the piece
/// hashes written for the forged bytes) passes every check but decoding:
/// the load decodes each block on the host and compares it with the
/// checkpoint, and refuses the file by name. A file of format 1 (written
/// before blocks were decoded back) is refused at open.
#[test]
fn a_coded_file_altered_with_its_hashes_rewritten_is_refused_at_load() {
    let dir = temp("coded-forged").parent().unwrap().to_path_buf();
    let path = dir.join("m.safetensors.offload-coded");
    let src = coded_model(5);
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let swapped = std::sync::atomic::AtomicBool::new(false);
    for how in ["swap two codes", "a sign-mantissa byte"] {
        crate::coded_file::CodedFile::write_with(
            &path,
            &inv,
            &src,
            crate::sim::SIM_SEGMENT_BYTES,
            2,
            crate::coded_file::PIECE_BYTES,
            2,
            &|block, coded| {
                if block != "blocks.1" {
                    return;
                }
                let before = coded.clone();
                if how == "swap two codes" {
                    swapped.store(crate::codec::swap_equal_length_codes(coded), std::sync::atomic::Ordering::Relaxed);
                } else {
                    let (_, segs) = crate::codec::device_segments(coded, "forge").unwrap();
                    let sg = segs.iter().find(|sg| sg.coded.is_some()).expect("a coded segment");
                    let sm_at = sg.enc_at + sg.coded.as_ref().unwrap().1.sm_at;
                    coded[sm_at + 3] ^= 0x01;
                }
                assert_ne!(&before, coded);
                // Every check but decoding still holds: the structure, and the
                // segments' stored hashes of the weights.
                let (len, _) = crate::codec::device_segments(coded, "forged").unwrap();
                let mut raw = vec![0u8; len];
                crate::codec::decode_device_block(&before, &mut raw, "good").unwrap();
                crate::codec::coded_matches(coded, &raw, 2, "forged").unwrap();
            },
        )
        .unwrap();
        let cf = crate::coded_file::CodedFile::open(&path).unwrap();
        let e = HostStore::build_from_coded_file(&be, &inv, &src, PinOptions::default(), &cf).err().expect("a forged file is refused");
        let msg = e.to_string();
        assert!(matches!(e, crate::error::Error::CodedFile { .. }), "{how}: {msg}");
        assert!(msg.contains("m/blocks.1") && msg.contains("offload-coded") && msg.contains("damaged or altered"), "{how}: {msg}");
    }
    assert!(swapped.load(std::sync::atomic::Ordering::Relaxed), "two equal-length codes were found and swapped");
    // Format 1.
    crate::coded_file::CodedFile::write_with(
        &path,
        &inv,
        &src,
        crate::sim::SIM_SEGMENT_BYTES,
        2,
        crate::coded_file::PIECE_BYTES,
        1,
        &|_, _| {},
    )
    .unwrap();
    let msg = crate::coded_file::CodedFile::open(&path).unwrap_err().to_string();
    assert!(msg.contains("format 1") && msg.contains("write it again"), "{msg}");
    std::fs::remove_file(&path).unwrap();
}

/// The simulator's refill waits for every copy from a bounce buffer to land
/// (the trait's contract), so the disk tier's refill race is caught there:
/// with the wait left out (`SimConfig::refill_waits = false`, slow copies),
/// the reader threads refill buffers whose copies are still queued and the
/// simulator logs it; with the wait, the same run logs nothing.
#[test]
fn a_refill_before_the_buffers_last_copy_landed_is_a_violation_on_the_simulator() {
    let path = temp("refill-race");
    write_checkpoint(&path, &disk_model(6, 8192));
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    for waits in [true, false] {
        let be = SimBackend::new(SimConfig { max_copy_delay_us: 3000, refill_waits: waits, ..SimConfig::fast() });
        let copied = HostStore::build(&be, &inv, &file).unwrap();
        let all: Vec<String> = inv.blocks().map(|b| b.id.to_string()).collect();
        let cp = crate::plan::ComponentPlan { prefetch_depth: 1, disk_blocks: all, ..Default::default() };
        let plan = crate::plan::resolve(&crate::plan::Plan::layerwise().component("m", cp), std::slice::from_ref(&inv))
            .unwrap()
            .components
            .remove(0);
        let store =
            std::sync::Arc::new(HostStore::build_tiered(&be, &inv, &file, PinOptions::default(), &|id| plan.is_on_disk(id)).unwrap());
        serve(&be, &store, &copied, &plan, &[0, 1, 2, 3, 4, 5], 2).unwrap();
        let v = be.stats().violations;
        match waits {
            true => assert!(v.is_empty(), "{v:?}"),
            false => assert!(v.iter().any(|v| v.contains("refilled while a copy from it was in flight")), "{v:?}"),
        }
    }
}

#[test]
fn the_disk_tier_serves_the_files_bytes_under_a_host_ram_budget() {
    let path = temp("disk");
    // Eight blocks: six on disk outweigh their bounce buffers at either depth
    // (where they did not, every block would stay in memory).
    let tensors = disk_model(8, 65536);
    write_checkpoint(&path, &tensors);
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    let be = SimBackend::new(SimConfig { max_copy_delay_us: 200, ..SimConfig::fast() });
    let copied = HostStore::build(&be, &inv, &file).unwrap();
    let block = copied.blocks()[0].bytes() as u64;
    for depth in [1, 2] {
        // Room for two blocks in memory beside the bounce buffers and the head.
        let bounce = ((depth + 2) * crate::disk::DiskFile::span(block as usize)) as u64;
        let budget = 2 * block + bounce + 512;
        let cp = crate::plan::ComponentPlan { prefetch_depth: depth, host_ram_budget_bytes: Some(budget), ..Default::default() };
        let plan = crate::plan::resolve(&crate::plan::Plan::layerwise().component("m", cp), std::slice::from_ref(&inv))
            .unwrap()
            .components
            .remove(0);
        assert_eq!(plan.on_disk.len(), 6, "{:?}", plan.on_disk);
        assert!(plan.host_ram_bytes <= budget);
        let store =
            std::sync::Arc::new(HostStore::build_tiered(&be, &inv, &file, PinOptions::default(), &|id| plan.is_on_disk(id)).unwrap());
        assert_eq!((store.tier().on_disk, store.tier().disk_bytes), (6, 6 * block), "{:?}", store.tier());
        assert_eq!(store.host_bytes(), 2 * block + 512);
        let mut want = tensors.clone();
        want.sort();
        assert_eq!(tensors_of(&be, &store), want, "every tensor as the file holds it");
        // In order, three steps: every block on disk read once a step, bytes equal.
        let m = serve(&be, &store, &copied, &plan, &[0, 1, 2, 3, 4, 5, 6, 7], 3).unwrap();
        assert_eq!(m.disk_bytes_read, 6 * block, "{m}");
        assert_eq!(m.host_bounce_bytes, bounce);
        // Out of the learned order (misses, reads nobody wanted any more): still the right bytes.
        serve(&be, &store, &copied, &plan, &[7, 0, 3, 1, 6, 4, 2, 2, 5, 7], 2).unwrap();
        assert!(be.stats().violations.is_empty(), "{:?}", be.stats().violations);
    }
}

#[test]
fn a_host_ram_budget_smaller_than_one_block_is_refused_by_name() {
    let path = temp("disk-small");
    write_checkpoint(&path, &disk_model(4, 8192));
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    let cp = crate::plan::ComponentPlan { host_ram_budget_bytes: Some(4096), ..Default::default() };
    let e = crate::plan::resolve(&crate::plan::Plan::layerwise().component("m", cp), std::slice::from_ref(&inv)).unwrap_err().to_string();
    assert!(e.contains("host RAM budget 4096 bytes") && e.contains("bounce buffers"), "{e}");
    // Named blocks on disk, checked like resident ones.
    let cp = crate::plan::ComponentPlan { disk_blocks: vec!["blocks.9".into()], ..Default::default() };
    let e = crate::plan::resolve(&crate::plan::Plan::layerwise().component("m", cp), std::slice::from_ref(&inv)).unwrap_err().to_string();
    assert!(e.contains("blocks.9"), "{e}");
}

/// A checkpoint of `n` blocks of `len` bytes at `temp(tag)`, every block on
/// disk: its path, the tiered store, its plan and the simulated device.
fn all_on_disk(
    tag: &str,
    n: usize,
    len: usize,
) -> (std::path::PathBuf, std::sync::Arc<HostStore<SimBackend>>, crate::plan::ResolvedComponent, SimBackend) {
    let path = temp(tag);
    write_checkpoint(&path, &disk_model(n as u64, len));
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let cp = crate::plan::ComponentPlan { disk_blocks: (0..n).map(|b| format!("blocks.{b}")).collect(), ..Default::default() };
    let plan =
        crate::plan::resolve(&crate::plan::Plan::layerwise().component("m", cp), std::slice::from_ref(&inv)).unwrap().components.remove(0);
    let store = std::sync::Arc::new(HostStore::build_tiered(&be, &inv, &file, PinOptions::default(), &|id| plan.is_on_disk(id)).unwrap());
    (path, store, plan, be)
}

#[test]
fn a_read_error_mid_step_names_the_block_and_serves_nothing_half_read() {
    let (path, store, plan, be) = all_on_disk("disk-trunc", 6, 8192);
    let mut ring = crate::ring::Ring::new(be.clone(), store.clone(), &plan).unwrap();
    drop(ring.block_at(0).unwrap());
    // The file is cut short mid-step: the next block whose read starts after
    // it fails, by name, and no guard is handed out for it.
    std::fs::OpenOptions::new().write(true).open(&path).unwrap().set_len(100).unwrap();
    let mut failed = None;
    for i in 1..6 {
        match ring.block_at(i) {
            Ok(g) => drop(g),
            Err(e) => {
                failed = Some((i, e));
                break;
            }
        }
    }
    let (i, e) = failed.expect("a read of the truncated file fails within the step");
    let msg = e.to_string();
    assert!(matches!(e, crate::error::Error::DiskRead { .. }), "{msg}");
    assert!(msg.contains("m/blocks.") && msg.contains("truncated") && msg.contains("m.safetensors"), "block {i}: {msg}");
    drop(ring);
    assert!(be.stats().violations.is_empty(), "{:?}", be.stats().violations);
    assert_eq!(be.stats().live_bytes, 0, "the ring's slots are released");
}

#[test]
fn a_block_on_disk_that_does_not_lie_in_the_file_as_laid_out_is_refused_by_name() {
    let path = temp("disk-odd");
    let tensors = model(Some(1000));
    write_checkpoint(&path, &tensors);
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let e = HostStore::build_tiered(&be, &inv, &file, PinOptions::default(), &|_| true).err().expect("refused").to_string();
    assert!(e.contains("m/blocks.1") && e.contains("multiple of 256"), "{e}");
    assert_eq!(be.stats().pinned_bytes, 0, "nothing kept");
    // The others can be on disk.
    let store = HostStore::build_tiered(&be, &inv, &file, PinOptions::default(), &|id| id.index != 1).unwrap();
    assert_eq!(store.tier().on_disk, 2, "{:?}", store.tier());
    let mut want = tensors;
    want.sort();
    assert_eq!(tensors_of(&be, &store), want);
}

#[test]
fn a_file_replaced_after_its_header_was_read_is_refused() {
    let path = temp("disk-replaced");
    write_checkpoint(&path, &disk_model(2, 4096));
    let file = SafetensorsFile::open(&path).unwrap();
    let inv = NameDiscovery.discover("m", file.specs()).unwrap();
    let other = path.with_extension("new");
    write_checkpoint(&other, &disk_model(2, 4096));
    std::fs::rename(&other, &path).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let e = HostStore::build_tiered(&be, &inv, &file, PinOptions::default(), &|_| true).err().expect("refused").to_string();
    assert!(e.contains("not the one whose header was read"), "{e}");
}

/// `n` blocks of one `len`-byte u8 tensor each, block `i` filled with `i + 1`.
fn u8_model(n: usize, len: usize) -> MemoryTensors {
    let mut src = MemoryTensors::new();
    for i in 0..n {
        src.push(TensorSpec::new(format!("blocks.{i}.w"), DType::U8, [len]), vec![i as u8 + 1; len]).unwrap();
    }
    src
}

/// A store of `big` on the simulator, and a plan under a device budget of
/// `budget` resolved against `small` (the same names, smaller tensors).
fn planned_for_smaller(
    small: &MemoryTensors,
    big: &MemoryTensors,
    budget: u64,
) -> (
    SimBackend,
    std::sync::Arc<HostStore<SimBackend>>,
    crate::discovery::ComponentInventory,
    crate::plan::Plan,
    crate::plan::ResolvedComponent,
) {
    let inv_small = NameDiscovery.discover("m", small.specs()).unwrap();
    let inv_big = NameDiscovery.discover("m", big.specs()).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let store = std::sync::Arc::new(HostStore::build(&be, &inv_big, big).unwrap());
    let cp = crate::plan::ComponentPlan { device_budget_bytes: Some(budget), ..Default::default() };
    let plan = crate::plan::Plan::layerwise().component("m", cp);
    let rc = crate::plan::resolve(&plan, std::slice::from_ref(&inv_small)).unwrap().components.remove(0);
    (be, store, inv_big, plan, rc)
}

/// A plan resolved against smaller blocks of the same names: its budget held
/// them, not the store's; the ring is refused rather than built 8 x over it.
#[test]
fn a_budget_planned_for_smaller_blocks_refuses_the_ring() {
    let (small, big) = (u8_model(4, 1024), u8_model(4, 8192));
    let (be, store, inv_big, plan, rc) = planned_for_smaller(&small, &big, 2048);
    let e = crate::ring::Ring::new(be.clone(), store.clone(), &rc).err().expect("over its budget").to_string();
    assert!(e.contains("block blocks.0 holds 8192 bytes, planned 1024"), "{e}");
    assert!(e.contains("would hold 16384 device bytes") && e.contains("over the budget of 2048"), "{e}");
    // Planned for the store's own blocks, the same budget is refused at plan time,
    // and a budget that holds them builds the ring.
    assert!(crate::plan::resolve(&plan, std::slice::from_ref(&inv_big)).is_err());
    let cp = crate::plan::ComponentPlan { device_budget_bytes: Some(16384), ..Default::default() };
    let rc = crate::plan::resolve(&crate::plan::Plan::layerwise().component("m", cp), std::slice::from_ref(&inv_big))
        .unwrap()
        .components
        .remove(0);
    crate::ring::Ring::new(be, store, &rc).unwrap();
}

/// Larger blocks than planned and the decoder's staging count together: a
/// budget that holds either alone, not both, is refused.
#[test]
fn grown_blocks_and_the_decoders_staging_count_together_against_the_budget() {
    let bf16 = |len: usize| {
        let mut src = MemoryTensors::new();
        for i in 0..4 {
            src.push(TensorSpec::new(format!("blocks.{i}.w"), DType::BF16, [len]), normal_bf16(len, 0.02, i as u64)).unwrap();
        }
        src
    };
    let (small, big) = (bf16(50_000), bf16(100_000));
    let inv_small = NameDiscovery.discover("m", small.specs()).unwrap();
    let inv_big = NameDiscovery.discover("m", big.specs()).unwrap();
    let be = SimBackend::new(SimConfig { staging_buffers: 2, ..SimConfig::fast() });
    let pin = PinOptions { coded: true, ..Default::default() };
    let store = std::sync::Arc::new(HostStore::build_with(&be, &inv_big, &big, pin).unwrap());
    let largest = store.blocks().iter().filter_map(|b| b.buffer().unwrap().held_bytes()).max().expect("coded");
    let staging = crate::host::HostMemory::decoder_staging_bytes(&crate::backend::OffloadBackend::host(&be), largest);
    let of = |inv: &crate::discovery::ComponentInventory| {
        crate::plan::resolve(&crate::plan::Plan::layerwise(), std::slice::from_ref(inv)).unwrap().components[0].device_weight_bound
    };
    let (planned, held) = (of(&inv_small), of(&inv_big));
    assert!(held > planned && staging > 0);
    let with_budget = |bytes: u64| {
        let cp = crate::plan::ComponentPlan { device_budget_bytes: Some(bytes), ..Default::default() };
        crate::plan::resolve(&crate::plan::Plan::layerwise().component("m", cp), std::slice::from_ref(&inv_small))
            .unwrap()
            .components
            .remove(0)
    };
    let need = held + staging;
    let e = crate::ring::Ring::new(be.clone(), store.clone(), &with_budget(need - 1)).err().expect("over by both").to_string();
    assert!(e.contains(&format!("{need} device bytes")) && e.contains("staging"), "{e}");
    crate::ring::Ring::new(be.clone(), store, &with_budget(need)).unwrap().close().unwrap();
}

/// A resolved plan made or deserialized by hand with a depth `resolve` never
/// gives is refused by `Ring::new`, not carried into its slot arithmetic.
#[test]
fn a_hand_made_plan_with_a_depth_out_of_range_is_refused() {
    let src = u8_model(4, 1024);
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    let be = SimBackend::new(SimConfig::fast());
    let store = std::sync::Arc::new(HostStore::build(&be, &inv, &src).unwrap());
    let mut rc = crate::plan::resolve(&crate::plan::Plan::layerwise(), std::slice::from_ref(&inv)).unwrap().components.remove(0);
    for depth in [0, crate::plan::MAX_PREFETCH_DEPTH + 1, usize::MAX] {
        rc.depth = depth;
        let e = crate::ring::Ring::new(be.clone(), store.clone(), &rc).err().expect("out of range").to_string();
        assert!(e.contains(&format!("prefetch depth {depth} must be 1 to")), "{e}");
    }
}

/// An on-demand component loaded under its plan is held to the plan's device
/// budget as a ring is: the decoder's staging beside its coded blocks, and
/// blocks larger than planned, are refused before anything is allocated.
#[test]
fn an_on_demand_load_under_a_plan_keeps_its_device_budget() {
    let src = coded_model(5);
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    let be = SimBackend::new(SimConfig { staging_buffers: 2, ..SimConfig::fast() });
    let store = std::sync::Arc::new(HostStore::build_with(&be, &inv, &src, PinOptions { coded: true, ..Default::default() }).unwrap());
    let largest = store.blocks().iter().chain(store.non_block()).filter_map(|b| b.buffer().unwrap().held_bytes()).max().expect("coded");
    let staging = crate::host::HostMemory::decoder_staging_bytes(&crate::backend::OffloadBackend::host(&be), largest);
    let with_budget = |bytes: Option<u64>| {
        let cp = crate::plan::ComponentPlan { strategy: crate::plan::Strategy::OnDemand, device_budget_bytes: bytes, ..Default::default() };
        crate::plan::resolve(&crate::plan::Plan::layerwise().component("m", cp), std::slice::from_ref(&inv)).unwrap().components.remove(0)
    };
    let bound = with_budget(None).device_weight_bound;
    let e = crate::ondemand::OnDemand::load_planned(be.clone(), store.clone(), &with_budget(Some(bound + staging - 1)))
        .err()
        .expect("over by the staging")
        .to_string();
    assert!(e.contains("\"m\"") && e.contains("staging"), "{e}");
    assert_eq!(be.stats().live_bytes, 0, "nothing allocated before the refusal");
    let od = crate::ondemand::OnDemand::load_planned(be.clone(), store, &with_budget(Some(bound + staging))).unwrap();
    od.release().unwrap();
}

/// The same check over the non-block tensors (embeddings, final norms): a
/// store whose non-block tensors outgrew the plan's is refused, by name.
#[test]
fn a_budget_planned_for_smaller_non_block_tensors_refuses_the_ring() {
    let with_head = |head: usize| {
        let mut m = u8_model(4, 1024);
        m.push(TensorSpec::new("head.w", DType::U8, [head]), vec![7; head]).unwrap();
        m
    };
    let (small, big) = (with_head(256), with_head(65536));
    let (be, store, inv_big, plan, rc) = planned_for_smaller(&small, &big, 4096);
    let e = crate::ring::Ring::new(be.clone(), store.clone(), &rc).err().expect("over its budget").to_string();
    assert!(e.contains("non-block tensors") && e.contains("over the budget of 4096"), "{e}");
    assert!(crate::plan::resolve(&plan, std::slice::from_ref(&inv_big)).is_err());
}

/// `metrics()` in the middle of a step counts that step's disk reads, as
/// `end_step` then reports them.
#[test]
fn metrics_of_the_open_step_count_its_disk_reads() {
    let (_path, store, plan, be) = all_on_disk("open-step-disk", 4, 8192);
    let mut ring = crate::ring::Ring::new(be.clone(), store.clone(), &plan).unwrap();
    for i in 0..4 {
        drop(ring.block_at(i).unwrap());
    }
    let open = ring.metrics();
    let closed = ring.end_step().unwrap();
    assert!(closed.disk_bytes_read > 0);
    assert_eq!(open.disk_bytes_read, closed.disk_bytes_read, "metrics() of the open step lacks its disk reads");
}

/// A step's disk bytes are those of the blocks it served, whatever the disk's
/// speed: a read ahead for the next step's first block counts in that step,
/// whether or not it was done before this one ended (CI saw both).
#[test]
fn each_step_counts_the_disk_reads_of_its_own_blocks_however_fast_the_disk() {
    for pause in [None, Some(std::time::Duration::from_millis(20))] {
        let (_path, store, plan, be) = all_on_disk("step-disk-bytes", 4, 8192);
        let mut ring = crate::ring::Ring::new(be.clone(), store.clone(), &plan).unwrap();
        for step in 0..3 {
            for i in 0..4 {
                drop(ring.block_at(i).unwrap());
                // A slow compute: every read ahead is done before the next request.
                if let Some(p) = pause {
                    std::thread::sleep(p);
                }
            }
            let m = ring.end_step().unwrap();
            assert_eq!(m.disk_bytes_read, store.disk_bytes(), "step {step}, pause {pause:?}: {m}");
        }
        ring.close().unwrap();
    }
}

/// A layerwise ring over `n` blocks of 4 KiB on a simulator behind a fault
/// injector (to fail one of its calls).
fn faulty_ring(n: usize) -> (crate::fault::FaultInjector<SimBackend>, crate::ring::Ring<crate::fault::FaultInjector<SimBackend>>) {
    let src = u8_model(n, 4096);
    let inv = NameDiscovery.discover("m", src.specs()).unwrap();
    let fi = crate::fault::FaultInjector::new(SimBackend::new(SimConfig::fast()));
    let store = std::sync::Arc::new(HostStore::build(&fi, &inv, &src).unwrap());
    let rc = crate::plan::resolve(&crate::plan::Plan::layerwise(), std::slice::from_ref(&inv)).unwrap().components.remove(0);
    (fi.clone(), crate::ring::Ring::new(fi, store, &rc).unwrap())
}

/// A request refused (the prefetch it issues fails) serves nothing: retried
/// in the learned order, the step counts each block once, no retrace and no
/// miss, as a clean step does.
#[test]
fn a_refused_request_leaves_the_order_and_the_counts_as_they_were() {
    let (fi, mut ring) = faulty_ring(6);
    for i in 0..6 {
        drop(ring.block_at(i).unwrap());
    }
    let clean = ring.end_step().unwrap();
    // Blocks `served` in turn, then `refused` with copy `fault` failing, then
    // retried with the rest: the step's metrics.
    let step = |ring: &mut crate::ring::Ring<_>, served: &[usize], refused: usize, fault: u64| {
        for &i in served {
            drop(ring.block_at(i).unwrap());
        }
        fi.arm(crate::fault::FaultKind::Copy, fault);
        ring.block_at(refused).err().expect("the prefetch's copy fails");
        fi.disarm();
        for i in refused..6 {
            drop(ring.block_at(i).unwrap());
        }
        ring.end_step().unwrap()
    };
    let m = step(&mut ring, &[0, 1], 2, 0);
    assert_eq!((m.blocks, m.retraces, m.misses), (6, 0, 0), "{m}");
    assert_eq!(m.prefetch_hits, clean.prefetch_hits, "{m}");
    // Refused after its on-demand fetch (out of order, the prefetch it then
    // issues fails): the block stays fetched, counted once as a miss, and
    // its retry counts no prefetch hit.
    for i in 0..6 {
        drop(ring.block_at(i).unwrap());
    }
    ring.end_step().unwrap();
    let m = step(&mut ring, &[0], 3, 1);
    assert_eq!((m.blocks, m.misses), (4, 1), "{m}");
    assert_eq!(m.prefetch_hits + m.misses + m.resident_hits, m.blocks, "{m}");
}

/// A pass's first request refused leaves the pass's learned first block as it
/// was: the next time the pass starts, its learned first block is copied
/// ahead (no miss), not the refused one.
#[test]
fn a_refused_first_request_does_not_move_the_passs_first_block() {
    let (fi, mut ring) = faulty_ring(6);
    let pass = |ring: &mut crate::ring::Ring<_>, backward: bool| {
        ring.set_backward(backward).unwrap();
        let order: Vec<usize> = if backward { (0..6).rev().collect() } else { (0..6).collect() };
        for i in order {
            drop(ring.block_at(i).unwrap());
        }
        ring.end_step().unwrap()
    };
    for _ in 0..2 {
        pass(&mut ring, false);
        pass(&mut ring, true);
    }
    pass(&mut ring, false);
    // The backward's first request (block 2, fetched on demand) is refused:
    // its wait fails.
    ring.set_backward(true).unwrap();
    fi.arm(crate::fault::FaultKind::Event, 0);
    ring.block_at(2).err().expect("the compute stream's wait fails");
    fi.disarm();
    ring.end_step().unwrap();
    pass(&mut ring, false);
    let m = pass(&mut ring, true);
    assert_eq!((m.blocks, m.misses), (6, 0), "{m}");
    ring.close().unwrap();
}

/// A step whose `end_step` fails (a guard's release failed on drop) is
/// closed all the same: the next step counts its own blocks, not both steps'.
#[test]
fn a_failed_end_step_closes_its_step() {
    let (fi, mut ring) = faulty_ring(4);
    for i in 0..4 {
        let g = ring.block_at(i).unwrap();
        if i == 3 {
            // The release event of the last block fails as its guard drops.
            fi.arm(crate::fault::FaultKind::Event, 0);
        }
        drop(g);
    }
    fi.disarm();
    let e = ring.end_step().expect_err("the failed release is reported").to_string();
    assert!(e.contains("record_compute"), "{e}");
    for i in 0..4 {
        drop(ring.block_at(i).unwrap());
    }
    let m = ring.end_step().unwrap();
    assert_eq!(m.blocks, 4, "{m}");
    assert_eq!(ring.metrics().blocks, 8, "every block served, counted once");
    ring.close().unwrap();
}

/// On a device that page-locks nothing (candle's CPU device), a store served
/// in place from a file pins nothing, says so, and is not refused by a pin
/// budget smaller than the file.
#[test]
fn a_mapped_store_on_a_device_that_locks_nothing_charges_no_pin_budget() {
    let (path, file, inv, _) = four_blocks("mapped-unlocked");
    let be = SimBackend::new(SimConfig { page_locked: false, decodes: false, ..SimConfig::fast() });
    let store = HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).unwrap();
    assert_eq!((store.pinned_bytes(), be.stats().pinned_bytes, store.is_pinned()), (0, 0, false));
    let pin = PinOptions { budget_bytes: Some(16384), fallback: crate::plan::PinFallback::Fail, ..PinOptions::default() };
    let budgeted = HostStore::build_mapped(&be, &inv, &file, pin).unwrap();
    assert_eq!((budgeted.tier().mapped, budgeted.tier().copied), (store.tier().mapped, 0), "{:?}", budgeted.tier());
    // Where buffers are page-locked the whole registration is charged, once.
    let locked = SimBackend::new(SimConfig { registers_regions: true, ..SimConfig::fast() });
    let charged = HostStore::build_mapped(&locked, &inv, &file, PinOptions::default()).unwrap();
    assert_eq!(charged.pinned_bytes(), std::fs::metadata(&path).unwrap().len());
    // Not charged, still checked: a change to the file is an error.
    store.check_sources().unwrap();
    write_in_place(&path, file.data_offset(1) + 3, false);
    let e = store.check_sources().expect_err("the file changed").to_string();
    assert!(e.contains("m.safetensors"), "{e}");
}

/// `coded` on a device that cannot decode codes nothing: the blocks are
/// served in place from the file, not copied under a reason that says they
/// were held coded.
#[test]
fn coded_on_a_device_without_a_decoder_still_serves_the_file_in_place() {
    let (_path, file, inv, _) = four_blocks("coded-no-decoder");
    let be = SimBackend::new(SimConfig { decodes: false, ..SimConfig::fast() });
    let store = HostStore::build_mapped(&be, &inv, &file, PinOptions { coded: true, ..Default::default() }).unwrap();
    let plain = HostStore::build_mapped(&be, &inv, &file, PinOptions::default()).unwrap();
    assert_eq!(store.coded_blocks(), 0);
    assert_eq!((store.tier().mapped, store.tier().copied), (plain.tier().mapped, 0), "{:?}", store.tier());
}
