//! Reliability: injected faults at every step of enabling, running and disabling;
//! bad checkpoints; plans that cannot work; out of memory; pin fallback; odd
//! orders; several rings on one device and on several threads.

use offload_core::sim::{SimBackend, SimConfig};
use offload_core::HostBuffer as _;
use offload_core::HostMemory as _;
use offload_core::{
    resolve, ComponentPlan, Error, FaultInjector, FaultKind, HostStore, OffloadBackend, PinFallback, PinOptions, Plan, Ring,
    SafetensorsFile, TensorSource,
};
use offload_tests::checkpoint::{load_on_sim, valid_checkpoint};
use offload_tests::model::{ModelShape, TestModel};
use offload_tests::sim_harness::sim_step as run;
use proptest::prelude::*;
use rand::{Rng as _, SeedableRng as _};
use std::path::PathBuf;
use std::sync::Arc;

fn tmp(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("offload-reliability-{}", std::process::id()));
    std::fs::create_dir_all(&d).expect("temp dir");
    d.join(name)
}

proptest! {
    #![proptest_config(ProptestConfig { cases: 12, ..ProptestConfig::default() })]
    /// Sweep the n-th host allocation, slot allocation, copy and event through
    /// building the store, enabling, two steps and disabling: every failure leaves
    /// the weights byte-identical, releases every slot, and a retry succeeds.
    #[test]
    fn every_fault_leaves_the_model_intact(seed in any::<u64>(), depth in 1usize..4, stacks in prop::collection::vec(2usize..5, 1..3)) {
        let model = TestModel::random(&ModelShape { stacks, tensors_per_block: 2, min_bytes: 64, max_bytes: 2048, non_block: 1 }, seed);
        let sim = SimBackend::new(SimConfig { max_copy_delay_us: 20, seed, ..Default::default() });
        let fi = FaultInjector::new(sim.clone());
        let plan = Plan::layerwise().component("transformer", ComponentPlan { prefetch_depth: depth, resident_blocks: vec!["stack0.1".into()], ..Default::default() });
        let rc = resolve(&plan, std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
        let order: Vec<usize> = (0..model.len()).collect();
        let want = model.reference(&order);
        for kind in [FaultKind::HostAlloc, FaultKind::SlotAlloc, FaultKind::Copy, FaultKind::Event] {
            for n in 0.. {
                fi.arm(kind, n);
                let attempt = (|| {
                    let store = Arc::new(HostStore::build(&fi, &model.inventory, &model.tensors)?);
                    let mut ring = Ring::new(fi.clone(), store.clone(), &rc)?;
                    let a = run(&mut ring, &sim, &order)?;
                    let b = run(&mut ring, &sim, &order)?;
                    ring.close()?;
                    Ok::<_, Error>((store, a, b))
                })();
                fi.disarm();
                sim.synchronize().unwrap();
                prop_assert_eq!(sim.stats().live_bytes, 0, "{:?} #{}: slots left behind", kind, n);
                match attempt {
                    Ok((store, a, b)) => {
                        prop_assert_eq!(a, want);
                        prop_assert_eq!(b, want);
                        for (i, blk) in store.blocks().iter().enumerate() {
                            prop_assert_eq!(blk.buffer().unwrap().block_bytes().unwrap(), &model.block_bytes(i)[..]);
                        }
                        break;
                    }
                    Err(e) => prop_assert!(matches!(e, Error::Injected(_)), "{:?} #{}: unexpected {}", kind, n, e),
                }
            }
        }
        prop_assert!(sim.stats().violations.is_empty(), "{:?}", sim.stats().violations);
    }

    /// Random damage to a valid checkpoint (flipped bytes, truncation, garbage
    /// appended) never panics the load path: it loads or says why not.
    #[test]
    fn damaged_checkpoints_never_panic(flips in prop::collection::vec((any::<prop::sample::Index>(), any::<u8>()), 0..6), cut in any::<prop::sample::Index>(), do_cut in any::<bool>(), extra in prop::collection::vec(any::<u8>(), 0..16)) {
        let mut bytes = valid_checkpoint(3);
        let valid = bytes.clone();
        for (i, v) in flips {
            let i = i.index(bytes.len());
            bytes[i] ^= v;
        }
        if do_cut {
            bytes.truncate(cut.index(bytes.len()));
        }
        bytes.extend(extra);
        let p = tmp(&format!("damaged-{}.safetensors", std::thread::current().name().unwrap_or("t").replace(':', "_")));
        std::fs::write(&p, &bytes).unwrap();
        // Loads or says why not, never panics; an undamaged file loads whole.
        match load_on_sim(&p) {
            Ok(n) => prop_assert!(n <= 3),
            Err(e) => prop_assert!(!e.is_empty() && bytes != valid, "the valid checkpoint was refused: {e}"),
        }
    }
}

fn write_raw(name: &str, header: &str, data_len: usize) -> PathBuf {
    let p = tmp(name);
    let mut bytes = (header.len() as u64).to_le_bytes().to_vec();
    bytes.extend_from_slice(header.as_bytes());
    bytes.extend(std::iter::repeat_n(7u8, data_len));
    std::fs::write(&p, bytes).unwrap();
    p
}

#[test]
fn bad_checkpoints_name_file_tensor_and_fault() {
    let cases: Vec<(&str, PathBuf, &str, &str)> = vec![
        (
            "truncated header",
            {
                let p = tmp("short.safetensors");
                std::fs::write(&p, [1u8, 2, 3]).unwrap();
                p
            },
            "",
            "shorter than",
        ),
        (
            "header past the end",
            {
                let p = tmp("past.safetensors");
                std::fs::write(&p, [&100u64.to_le_bytes()[..], b"{}"].concat()).unwrap();
                p
            },
            "",
            "runs past the end",
        ),
        (
            "offsets past the end",
            write_raw("end.safetensors", r#"{"a.0.w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]}}"#, 4),
            "a.0.w",
            "outside",
        ),
        (
            "overlapping offsets",
            write_raw(
                "overlap.safetensors",
                r#"{"a.0.w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"a.1.w":{"dtype":"U8","shape":[8],"data_offsets":[4,12]}}"#,
                12,
            ),
            "a.1.w",
            "overlap",
        ),
        (
            "unknown dtype",
            write_raw("dtype.safetensors", r#"{"a.0.w":{"dtype":"Q4","shape":[8],"data_offsets":[0,8]}}"#, 8),
            "a.0.w",
            "unknown dtype",
        ),
        (
            "shape disagrees with data",
            write_raw("shape.safetensors", r#"{"a.0.w":{"dtype":"F32","shape":[8],"data_offsets":[0,8]}}"#, 8),
            "a.0.w",
            "needs 32 bytes",
        ),
        (
            "duplicate names",
            write_raw(
                "dup.safetensors",
                r#"{"a.0.w":{"dtype":"U8","shape":[8],"data_offsets":[0,8]},"a.0.w":{"dtype":"U8","shape":[8],"data_offsets":[8,16]}}"#,
                16,
            ),
            "a.0.w",
            "twice",
        ),
        ("not JSON", write_raw("json.safetensors", "{nope", 0), "", "not valid JSON"),
    ];
    for (what, path, tensor, fault) in cases {
        let e = SafetensorsFile::open(&path).expect_err(what).to_string();
        assert!(e.contains(&path.display().to_string()), "{what}: {e}");
        assert!(e.contains(tensor), "{what}: {e}");
        assert!(e.contains(fault), "{what}: {e}");
    }
    // A tensor the model expects but the file lacks.
    let p = tmp("lacks.safetensors");
    std::fs::write(&p, valid_checkpoint(2)).unwrap();
    let file = SafetensorsFile::open(&p).unwrap();
    let mut inv = offload_core::BlockDiscovery::discover(&offload_core::NameDiscovery, "transformer", file.specs()).unwrap();
    inv.stacks[0].blocks[1].tensors.push(offload_core::TensorSpec::new("blocks.1.extra.weight", offload_core::DType::BF16, [2]));
    let e = HostStore::build(&SimBackend::new(SimConfig::fast()), &inv, &file).err().expect("missing tensor").to_string();
    assert!(e.contains("blocks.1.extra.weight") && e.contains(&p.display().to_string()) && e.contains("lacks"), "{e}");
}

#[test]
fn the_fuzz_corpus_replays_without_panics() {
    let dir = PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../fuzz/corpus/safetensors_store");
    let mut n = 0;
    for entry in std::fs::read_dir(&dir).expect("corpus committed") {
        let path = entry.unwrap().path();
        let _ = load_on_sim(&path);
        n += 1;
    }
    assert!(n >= 8, "only {n} corpus files");
    // The valid seed loads.
    assert_eq!(load_on_sim(&dir.join("valid-3-blocks")), Ok(3));
}

#[test]
fn out_of_device_memory_says_how_much() {
    let model = TestModel::random(&ModelShape::default(), 3);
    let sim = SimBackend::new(SimConfig { device_bytes: 300_000, ..Default::default() });
    let store = Arc::new(HostStore::build(&sim, &model.inventory, &model.tensors).unwrap());
    let rc = resolve(&Plan::layerwise(), std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    let e = Ring::new(sim.clone(), store, &rc).err().expect("out of memory");
    let text = e.to_string();
    assert!(matches!(e, Error::OutOfDeviceMemory { .. }), "{text}");
    assert!(text.contains("out of device memory allocating") && text.contains("bytes free") && text.contains("transformer/"), "{text}");
    assert_eq!(sim.stats().live_bytes, 0);
}

#[test]
fn pinning_failure_fails_or_falls_back_as_planned() {
    let model = TestModel::random(&ModelShape { stacks: vec![4], ..Default::default() }, 4);
    let total: u64 = (0..model.len()).map(|i| model.block_bytes(i).len() as u64).sum();
    let sim = SimBackend::new(SimConfig { pinned_host_bytes: Some(total / 2), ..Default::default() });
    let e = HostStore::build(&sim, &model.inventory, &model.tensors).err().expect("pinning fails").to_string();
    assert!(e.contains("could not allocate") && e.contains("page-locked memory exhausted") && e.contains("transformer/stack0."), "{e}");
    // With the pageable fallback: loads, fewer bytes pinned, same results.
    let pin = PinOptions { budget_bytes: None, fallback: PinFallback::Pageable, coded: false };
    let store = Arc::new(HostStore::build_with(&sim, &model.inventory, &model.tensors, pin).unwrap());
    assert!(store.pinned_bytes() > 0 && store.pinned_bytes() < store.host_bytes());
    let rc = resolve(&Plan::layerwise(), std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    let mut ring = Ring::new(sim.clone(), store, &rc).unwrap();
    let order: Vec<usize> = (0..model.len()).collect();
    assert_eq!(run(&mut ring, &sim, &order).unwrap(), model.reference(&order));
    assert!(ring.metrics().host_pinned_bytes < ring.metrics().host_bytes);
    // A pin budget from the plan, failing when spent.
    let budget = PinOptions { budget_bytes: Some(1000), fallback: PinFallback::Fail, coded: false };
    let e = HostStore::build_with(&SimBackend::default_device(), &model.inventory, &model.tensors, budget).err().unwrap().to_string();
    assert!(e.contains("pin budget has 1000 bytes left"), "{e}");
}

/// A plan's `coded` reaches the store: on the simulated device every block is
/// held coded, each copy moves the coded bytes (fewer) and the copy thread
/// decodes them, and the streamed result is the reference's — with copy delays,
/// so a decode not ordered before the read would show.
/// (`coded = true` in a plan's TOML: offload-plan's tests.)
#[test]
fn coded_blocks_stream_the_same_bytes_on_the_simulated_device() {
    let plan = Plan { default: ComponentPlan { coded: true, ..Default::default() }, ..Default::default() };
    let model = TestModel::random(&ModelShape { stacks: vec![3, 2], ..Default::default() }, 6);
    let sim = SimBackend::new(SimConfig { max_copy_delay_us: 300, ..Default::default() });
    let store = Arc::new(HostStore::build_with(&sim, &model.inventory, &model.tensors, PinOptions::from_plan(&plan.default)).unwrap());
    // Every block coded (their bf16 tensors shrink); the non-block tensors'
    // uniform bytes do not, and are held raw.
    assert_eq!(store.coded_blocks(), store.blocks().len(), "every block coded");
    assert_eq!(store.non_block().and_then(|b| b.buffer().unwrap().held_bytes()), None, "the head held raw");
    // The store counts what its buffers hold: the coded bytes (the head's own), all page-locked.
    let all = || store.blocks().iter().chain(store.non_block());
    let held: u64 = all().map(|b| b.buffer().unwrap().held_bytes().unwrap_or(b.bytes()) as u64).sum();
    let block_bytes: u64 = all().map(|b| b.bytes() as u64).sum();
    assert_ne!(held, block_bytes, "coded buffers hold other than their blocks' bytes");
    assert_eq!((store.host_bytes(), store.pinned_bytes(), sim.stats().pinned_bytes), (held, held, held), "host bytes counted as held");
    assert!(store.is_pinned());
    let rc = resolve(&plan, std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    let before = sim.stats();
    let mut ring = Ring::new(sim.clone(), store.clone(), &rc).unwrap();
    let order: Vec<usize> = (0..model.len()).collect();
    assert_eq!(run(&mut ring, &sim, &order).unwrap(), model.reference(&order));
    let st = sim.stats();
    let raw: u64 = store.blocks().iter().map(|b| b.bytes() as u64).sum();
    // Every block of the step, the next step's first blocks prefetched, and the
    // non-block weights loaded once.
    assert!(st.coded_copies - before.coded_copies >= model.len() as u64, "{} coded copies", st.coded_copies - before.coded_copies);
    // A steady-state step copies every block once: fewer bytes than they hold.
    assert_eq!(run(&mut ring, &sim, &order).unwrap(), model.reference(&order));
    let again = sim.stats();
    assert_eq!(again.coded_copies - st.coded_copies, model.len() as u64);
    assert!(again.bytes_copied - st.bytes_copied < raw, "{} bytes on the wire for {raw}", again.bytes_copied - st.bytes_copied);
    assert!(again.violations.is_empty(), "{:?}", again.violations);
}

/// A coded plan's device budget counts the decoder's staging buffers, which
/// `resolve` cannot (it does not know the coded sizes): on a simulated device
/// that stages coded copies as offload-cuda's decode engine does, a budget that
/// holds the weights but not the staging is refused by the ring, naming the
/// component and the bytes, and at weights + staging the streamed step stays
/// within it (the simulator counts the staging it really holds).
#[test]
fn a_coded_plan_over_its_budget_by_the_staging_buffers_is_refused() {
    let model = TestModel::random(&ModelShape { stacks: vec![4], min_bytes: 1 << 20, max_bytes: 3 << 20, ..Default::default() }, 48);
    let sim = SimBackend::new(SimConfig { max_copy_delay_us: 50, staging_buffers: 2, ..Default::default() });
    let coded = ComponentPlan { coded: true, ..Default::default() };
    let store = Arc::new(HostStore::build_with(&sim, &model.inventory, &model.tensors, PinOptions::from_plan(&coded)).unwrap());
    assert_eq!(store.coded_blocks(), store.blocks().len(), "every block coded");
    let largest = store.blocks().iter().filter_map(|b| b.buffer().unwrap().held_bytes()).max().unwrap();
    let staging = 2 * offload_core::codec::staging_buffer_bytes(largest as u64);
    assert_eq!(sim.host().decoder_staging_bytes(largest), staging);
    let bound = resolve(&Plan { default: coded.clone(), ..Default::default() }, std::slice::from_ref(&model.inventory)).unwrap().components
        [0]
    .device_weight_bound;
    let with_budget = |bytes: u64| {
        let plan = Plan { default: ComponentPlan { device_budget_bytes: Some(bytes), ..coded.clone() }, ..Default::default() };
        resolve(&plan, std::slice::from_ref(&model.inventory)).unwrap().components.remove(0)
    };
    // The weights alone fit: resolve passes, the ring refuses.
    let e = Ring::new(sim.clone(), store.clone(), &with_budget(bound + staging - 1)).err().expect("over budget by the staging");
    let msg = e.to_string();
    assert!(matches!(e, Error::Plan(_)) && msg.contains("\"transformer\"") && msg.contains("staging buffers"), "{msg}");
    assert!(msg.contains(&format!("{bound} for the weights + {staging}")), "{msg}");
    assert_eq!(sim.stats().live_bytes, 0, "nothing held after the refusal");
    // At weights + staging it builds, streams the reference, and the device never holds more.
    let mut ring = Ring::new(sim.clone(), store.clone(), &with_budget(bound + staging)).unwrap();
    let order: Vec<usize> = (0..model.len()).collect();
    assert_eq!(run(&mut ring, &sim, &order).unwrap(), model.reference(&order));
    assert_eq!(run(&mut ring, &sim, &order).unwrap(), model.reference(&order));
    ring.close().unwrap();
    let peak = sim.stats().peak_bytes;
    assert!(peak > bound && peak <= bound + staging, "peak {peak} bytes: weights {bound}, staging {staging}");
}

/// Coding is kept only where it pays: a block whose coded form would not be
/// smaller than its bytes (dense data: GGUF blocks, random bytes) is held raw and
/// copied without a decode, counted as not coded, so a coded store never sends
/// more bytes than the raw blocks.
#[test]
fn a_block_coding_does_not_shrink_is_held_raw_and_counted_so() {
    let plan = Plan { default: ComponentPlan { coded: true, ..Default::default() }, ..Default::default() };
    let mut tensors = offload_core::MemoryTensors::new();
    let mut rng = rand::rngs::StdRng::seed_from_u64(35);
    for b in 0..3 {
        // Block 1 holds uniform bytes only; blocks 0 and 2 hold bf16 weights.
        let bytes: Vec<u8> = match b {
            1 => (0..64 << 10).map(|_| rng.gen()).collect(),
            _ => offload_tests::model::normal_bf16_bytes(&mut rng, 64 << 10),
        };
        tensors.push(offload_core::TensorSpec::new(format!("blocks.{b}.w"), offload_core::DType::U8, [bytes.len()]), bytes).unwrap();
    }
    let inventory = offload_core::BlockDiscovery::discover(&offload_core::NameDiscovery, "transformer", tensors.specs()).unwrap();
    let sim = SimBackend::default_device();
    let store = Arc::new(HostStore::build_with(&sim, &inventory, &tensors, PinOptions::from_plan(&plan.default)).unwrap());
    assert_eq!(store.coded_blocks(), 2, "the uniform block is not counted coded");
    let held = |i: usize| store.blocks()[i].buffer().unwrap().held_bytes();
    assert!(held(0).is_some_and(|h| h < 64 << 10) && held(2).is_some());
    assert_eq!(held(1), None, "held as its raw bytes");
    assert!(store.host_bytes() <= 3 * (64 << 10), "{} bytes held for 3 x 64 KiB", store.host_bytes());
    let rc = resolve(&plan, std::slice::from_ref(&inventory)).unwrap().components.remove(0);
    let mut ring = Ring::new(sim.clone(), store.clone(), &rc).unwrap();
    for i in 0..3 {
        let g = ring.block("blocks", i).unwrap();
        let got = sim.read_slot(g.slot(), |b| b[..64 << 10].to_vec());
        let mut want = vec![0u8; 64 << 10];
        tensors.read_into(i, &mut want).unwrap();
        assert!(got == want, "block {i}: streamed bytes differ");
        g.finish().unwrap();
    }
    let m = ring.end_step().unwrap();
    ring.close().unwrap();
    // The ring counts the bytes on the link: the coded blocks' coded bytes and
    // the raw block's own, what the device's counters saw.
    // Three blocks, and block 0 again, prefetched for the next step.
    assert_eq!(m.bytes_copied, 4 * (64 << 10));
    assert_eq!(m.link_bytes, (2 * held(0).unwrap() + (64 << 10) + held(2).unwrap()) as u64);
    assert_eq!(sim.stats().bytes_copied, m.link_bytes, "the ring's count is the device's");
    assert!(sim.stats().violations.is_empty());
}

/// A coded store never holds more page-locked bytes than its blocks' own size,
/// through wrappers too (the fault injector): incompressible blocks are held
/// raw, so a pin budget of the blocks' size holds the whole store page-locked,
/// and one byte less fails naming the block (or falls back to pageable).
#[test]
fn coded_blocks_never_hold_more_than_their_bytes_under_a_pin_budget() {
    // Blocks of random bytes: incompressible, so each is held raw.
    let mut tensors = offload_core::MemoryTensors::new();
    let mut x = 11u64;
    for i in 0..4 {
        let noise: Vec<u8> = (0..40_000 + 1000 * i)
            .map(|_| {
                x = x.wrapping_mul(6364136223846793005).wrapping_add(1442695040888963407);
                (x >> 33) as u8
            })
            .collect();
        let spec = offload_core::TensorSpec::new(format!("blocks.{i}.w"), offload_core::DType::U8, [noise.len()]);
        tensors.push(spec, noise).unwrap();
    }
    let specs = offload_core::TensorSource::specs(&tensors);
    let inventory = offload_core::BlockDiscovery::discover(&offload_core::NameDiscovery, "model", specs).unwrap();
    let fi = FaultInjector::new(SimBackend::new(SimConfig::default()));
    let coded = PinOptions { budget_bytes: None, fallback: PinFallback::Fail, coded: true };
    let full = HostStore::build_with(&fi, &inventory, &tensors, coded).unwrap();
    let raw = full.laid_out_bytes();
    assert_eq!(full.coded_blocks(), 0, "no incompressible block held coded");
    assert!(full.blocks().iter().all(|b| b.buffer().unwrap().held_bytes().is_none()));
    assert_eq!((full.host_bytes(), full.pinned_bytes()), (raw, raw), "through the fault injector, held as their bytes");
    drop(full);
    let exact = PinOptions { budget_bytes: Some(raw), fallback: PinFallback::Fail, coded: true };
    let s = HostStore::build_with(&fi, &inventory, &tensors, exact).unwrap();
    assert!(s.is_pinned() && s.pinned_bytes() == raw);
    drop(s);
    let pageable = PinOptions { budget_bytes: Some(raw - 1), fallback: PinFallback::Pageable, coded: true };
    let s = HostStore::build_with(&fi, &inventory, &tensors, pageable).unwrap();
    assert!(s.pinned_bytes() < raw && !s.is_pinned(), "the block that did not fit is held pageable");
    drop(s);
    let fail = PinOptions { budget_bytes: Some(raw - 1), fallback: PinFallback::Fail, coded: true };
    let e = HostStore::build_with(&fi, &inventory, &tensors, fail).err().expect("over the budget").to_string();
    assert!(e.contains("pin budget") && e.contains("model/blocks."), "{e}");
}

/// On a device that cannot decode (the simulator without its decoder) a plan's
/// `coded` leaves the blocks as they are, with a warning, and the streamed result
/// is the reference's.
#[test]
fn coded_blocks_fall_back_where_the_backend_cannot_decode() {
    let plan = Plan { default: ComponentPlan { coded: true, ..Default::default() }, ..Default::default() };
    let model = TestModel::random(&ModelShape { stacks: vec![3], ..Default::default() }, 6);
    let sim = SimBackend::new(SimConfig { decodes: false, max_copy_delay_us: 100, ..Default::default() });
    let store = Arc::new(HostStore::build_with(&sim, &model.inventory, &model.tensors, PinOptions::from_plan(&plan.default)).unwrap());
    assert_eq!(store.coded_blocks(), 0, "nothing coded on a device without a decoder");
    for (i, b) in store.blocks().iter().enumerate() {
        assert_eq!(b.buffer().unwrap().block_bytes().unwrap(), &model.block_bytes(i)[..]);
    }
    let rc = resolve(&plan, std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    let mut ring = Ring::new(sim.clone(), store, &rc).unwrap();
    let order: Vec<usize> = (0..model.len()).collect();
    assert_eq!(run(&mut ring, &sim, &order).unwrap(), model.reference(&order));
    assert_eq!(sim.stats().coded_copies, 0);
}

#[test]
fn interleaved_pipelines_get_the_right_weights() {
    // One component driven by two pipelines with different orders, alternating.
    let model = TestModel::random(&ModelShape { stacks: vec![3, 4], ..Default::default() }, 8);
    let sim = SimBackend::default_device();
    let store = Arc::new(HostStore::build(&sim, &model.inventory, &model.tensors).unwrap());
    let rc = resolve(&Plan::layerwise().prefetch_depth(2), std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
    let mut ring = Ring::new(sim.clone(), store, &rc).unwrap();
    let a: Vec<usize> = (0..model.len()).collect();
    let b: Vec<usize> = vec![0, 1, 2, 0, 1, 2, 6, 5];
    let mut misses = 0;
    for step in 0..6 {
        let order = if step % 2 == 0 { &a } else { &b };
        assert_eq!(run(&mut ring, &sim, order).unwrap(), model.reference(order), "step {step}");
        misses += ring.metrics().misses;
    }
    assert!(misses > 0, "deviations are counted");
    assert!(sim.stats().violations.is_empty());
}

#[test]
fn rings_on_one_device_and_on_two_threads() {
    fn assert_send<T: Send>() {}
    assert_send::<Ring<SimBackend>>();
    assert_send::<Ring<FaultInjector<SimBackend>>>();
    let sim = SimBackend::default_device();
    let models: Vec<TestModel> =
        (0..2).map(|i| TestModel::random(&ModelShape { stacks: vec![3, 2], ..Default::default() }, 20 + i)).collect();
    let handles: Vec<_> = models
        .into_iter()
        .enumerate()
        .map(|(i, mut model)| {
            model.inventory.name = format!("component{i}");
            let sim = sim.clone();
            std::thread::spawn(move || {
                let store = Arc::new(HostStore::build(&sim, &model.inventory, &model.tensors).unwrap());
                let rc = resolve(&Plan::layerwise(), std::slice::from_ref(&model.inventory)).unwrap().components.remove(0);
                let mut ring = Ring::new(sim.clone(), store, &rc).unwrap();
                let order: Vec<usize> = (0..model.len()).collect();
                for _ in 0..20 {
                    assert_eq!(run(&mut ring, &sim, &order).unwrap(), model.reference(&order));
                }
                ring.close().unwrap();
            })
        })
        .collect();
    for h in handles {
        h.join().unwrap();
    }
    assert!(sim.stats().violations.is_empty(), "{:?}", sim.stats().violations);
    assert_eq!(sim.stats().live_bytes, 0);
}

/// `vulkan-bench` refuses a misspelt, repeated, value-less, zero or overflowing
/// option before any work (a bad `--blocks` once ran 24 blocks; `--steps 0`
/// indexed an empty median).
#[cfg(all(feature = "vulkan", feature = "cuda"))]
#[test]
fn the_vulkan_bench_names_a_bad_option_before_any_work() {
    for (args, says) in [
        (&["--out", "x", "--blocks", "0"][..], "--blocks \"0\": not a count of at least 1"),
        (&["--out", "x", "--block", "3"][..], "unknown argument \"--block\""),
        (&["--out", "x", "--steps"][..], "--steps needs a value"),
        (&["--out", "x", "--steps", "2", "--steps", "3"][..], "--steps given twice"),
        (&["--out", "x", "--copy-chunk-mib", "abc"][..], "--copy-chunk-mib \"abc\""),
        (&["--out", "x", "--block-mib", "99999999999999999"][..], "overflows"),
    ] {
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_vulkan-bench")).args(args).output().expect("vulkan-bench runs");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success(), "{args:?} succeeded: {err}");
        assert!(err.contains(says), "{args:?}: {err}");
    }
}
