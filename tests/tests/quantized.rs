//! fp8 checkpoints streamed as stored: a safetensors file of fp8 weights with
//! per-channel scales (the `weight_scale` convention), read through the host
//! store (copied and mapped tiers) and the ring on the simulated device, each
//! block dequantised from the slot's bytes: bitwise equal to the resident run
//! from the same file, at one byte a weight on the link, and coded (fp8's own
//! code) at about 0.83 of that. A missing scale is an error naming the weight.

use offload_core::sim::SimBackend;
use offload_core::{resolve, BlockDiscovery, HostStore, NameDiscovery, PinOptions, Plan, Ring, SafetensorsFile, TensorSource};
use offload_formats::fp8::{dequantize_to_bf16, Granularity};
use offload_formats::{fp8_weights, Fp8Convention};
use rand::{Rng, SeedableRng};
use std::collections::HashMap;
use std::sync::Arc;

const OUT: usize = 32;
const IN: usize = 32;
const DEPTH: usize = 4;

/// How the fp8 bytes are drawn.
#[derive(Clone, Copy)]
enum Weights {
    /// Any e4m3 byte but NaN (S.1111.111), uniformly: every code path, no skew.
    Uniform,
    /// A normal per output channel cast as a checkpoint is (amax ÷ 448 its
    /// scale, nearest-even): the exponent field skewed as trained weights'.
    Scaled,
}

fn write(path: &std::path::Path, with_scale: impl Fn(usize) -> bool) {
    write_sized(path, (OUT, IN), Weights::Uniform, with_scale)
}

fn write_sized(path: &std::path::Path, (out, inn): (usize, usize), weights: Weights, with_scale: impl Fn(usize) -> bool) {
    let mut rng = rand::rngs::StdRng::from_entropy();
    let mut data: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = Vec::new();
    for i in 0..DEPTH {
        let (w, scales): (Vec<u8>, Vec<f32>) = match weights {
            Weights::Uniform => (
                (0..out * inn)
                    .map(|_| loop {
                        let b: u8 = rng.gen();
                        if b & 0x7f != 0x7f {
                            break b;
                        }
                    })
                    .collect(),
                (0..out).map(|_| rng.gen_range(0.001f32..0.01)).collect(),
            ),
            Weights::Scaled => {
                // Box–Muller: a normal of standard deviation 0.02.
                let mut normal = || {
                    let (u, v): (f64, f64) = (rng.gen_range(1e-12..1.0), rng.gen());
                    ((-2.0 * u.ln()).sqrt() * (std::f64::consts::TAU * v).cos() * 0.02) as f32
                };
                let mut w = Vec::with_capacity(out * inn);
                let mut scales = Vec::with_capacity(out);
                for _ in 0..out {
                    let row: Vec<f32> = (0..inn).map(|_| normal()).collect();
                    let scale = row.iter().fold(0f32, |m, v| m.max(v.abs())) / 448.0;
                    w.extend(row.iter().map(|v| offload_formats::fp8::f32_to_fp8(v / scale, offload_core::DType::F8_E4M3).expect("fp8")));
                    scales.push(scale);
                }
                (w, scales)
            }
        };
        data.push((format!("blocks.{i}.ff.weight"), safetensors::Dtype::F8_E4M3, vec![out, inn], w));
        if with_scale(i) {
            let s: Vec<u8> = scales.iter().flat_map(|v| v.to_le_bytes()).collect();
            data.push((format!("blocks.{i}.ff.weight_scale"), safetensors::Dtype::F32, vec![out, 1], s));
        }
    }
    // Block by block, laid out as the host store lays blocks out: the mapped tier
    // serves every block in place and the disk tier reads each as one range.
    let dtypes: Vec<String> = data.iter().map(|(_, d, _, _)| format!("{d:?}")).collect();
    let laid: Vec<(&str, &str, &[usize], &[u8])> =
        data.iter().zip(&dtypes).map(|((n, _, s, b), d)| (n.as_str(), d.as_str(), s.as_slice(), b.as_slice())).collect();
    std::fs::write(path, offload_tests::checkpoint::laid_out_safetensors(&laid)).expect("writes");
}

/// One block: x <- x + W x, W dequantised to bf16 from its stored bytes and scales.
fn block(x: &[f32], w: &[u8], scale: &[u8]) -> Vec<f32> {
    let scales: Vec<f32> = scale.chunks_exact(4).map(|c| f32::from_le_bytes(c.try_into().unwrap())).collect();
    let (out, inn) = (scales.len(), x.len());
    let wq = dequantize_to_bf16(w, offload_core::DType::F8_E4M3, out, &scales).expect("dequantises");
    (0..out).map(|j| x[j] + (0..inn).map(|k| f32::from_bits((wq[j * inn + k] as u32) << 16) * x[k]).sum::<f32>()).collect()
}

/// One step through a ring over `store`: each block computed from its slot's bytes.
/// The ring (open), the output and the step's metrics.
fn stream(
    sim: &SimBackend,
    store: &Arc<HostStore<SimBackend>>,
    component: &offload_core::ResolvedComponent,
    x0: &[f32],
) -> (Ring<SimBackend>, Vec<f32>, offload_core::StepMetrics) {
    let mut ring = Ring::new(sim.clone(), store.clone(), component).unwrap();
    let mut x = x0.to_vec();
    for i in 0..DEPTH {
        let g = ring.block("blocks", i).unwrap();
        let part = |name: &str| {
            let t = g.layout().tensors.iter().find(|t| t.spec.name == format!("blocks.{i}.{name}")).expect("in the block");
            sim.read_slot(g.slot(), |b| b[t.offset..t.offset + t.nbytes].to_vec())
        };
        x = block(&x, &part("ff.weight"), &part("ff.weight_scale"));
        g.finish().unwrap();
    }
    let m = ring.end_step().unwrap();
    (ring, x, m)
}

fn tmp(tag: &str) -> std::path::PathBuf {
    std::env::temp_dir().join(format!("offload-fp8-{tag}-{}.safetensors", std::process::id()))
}

#[test]
fn fp8_weights_with_per_channel_scales_stream_as_stored_bitwise_equal_to_resident() {
    let path = tmp("stream");
    write(&path, |_| true);
    let file = SafetensorsFile::open(&path).unwrap();
    let fp8 = fp8_weights(file.specs()).unwrap();
    assert_eq!(fp8.convention, Fp8Convention::WeightScale);
    assert_eq!(fp8.weights.len(), DEPTH);
    assert!(fp8.weights.iter().all(|w| w.granularity == Granularity::PerChannel));

    let x0: Vec<f32> = (0..IN).map(|k| (k as f32 * 0.37).sin()).collect();
    // Resident: every tensor read from the file up front.
    let bytes: HashMap<String, Vec<u8>> = file
        .specs()
        .iter()
        .enumerate()
        .map(|(i, s)| {
            let mut b = vec![0; s.nbytes().unwrap()];
            file.read_into(i, &mut b).unwrap();
            (s.name.clone(), b)
        })
        .collect();
    let mut resident = x0.clone();
    for i in 0..DEPTH {
        resident = block(&resident, &bytes[&format!("blocks.{i}.ff.weight")], &bytes[&format!("blocks.{i}.ff.weight_scale")]);
    }
    assert!(resident.iter().all(|v| v.is_finite()) && resident.iter().any(|v| *v != resident[0]));

    let inventory = NameDiscovery.discover("transformer", file.specs()).unwrap();
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory)).unwrap();
    for tier in ["copied", "mapped tier", "disk tier"] {
        let sim = SimBackend::default_device();
        let store = Arc::new(match tier {
            "mapped tier" => HostStore::build_mapped(&sim, &inventory, &file, PinOptions::default()).unwrap(),
            // Every block left on disk, read from the file as stored for each copy.
            "disk tier" => HostStore::build_tiered(&sim, &inventory, &file, PinOptions::default(), &|_| true).unwrap(),
            _ => HostStore::build(&sim, &inventory, &file).unwrap(),
        });
        let (ring, x, m) = stream(&sim, &store, &plan.components[0], &x0);
        // A block holds one byte a weight and four a scale, with at most one
        // alignment gap between them, and that is what the ring copies.
        for b in store.blocks() {
            assert!(b.layout.tensors.iter().any(|t| t.spec.name.ends_with("ff.weight") && t.nbytes == OUT * IN));
            assert!(b.layout.bytes < OUT * IN + 4 * OUT + 256, "{}: {} bytes", b.id, b.layout.bytes);
        }
        assert_eq!(m.blocks, DEPTH as u64);
        assert!(m.bytes_copied >= (DEPTH * (OUT * IN + 4 * OUT)) as u64, "{} bytes a step", m.bytes_copied);
        // The file is laid out as the store lays blocks out: served in place, or read from disk, whole.
        let t = store.tier();
        let want = match tier {
            "mapped tier" => (DEPTH, 0, 0),
            "disk tier" => (0, 0, DEPTH),
            _ => (0, 0, 0),
        };
        assert_eq!((t.mapped, if tier == "mapped tier" { t.copied } else { 0 }, t.on_disk), want, "{tier}: {t:?}");
        let on_disk: u64 = match tier {
            "disk tier" => store.blocks().iter().map(|b| b.layout.bytes as u64).sum(),
            _ => 0,
        };
        // A step reads every block on disk once (a read ahead for the next
        // step's first block counts in that step).
        assert_eq!((store.disk_bytes(), m.disk_bytes_read), (on_disk, on_disk), "{tier}: {m}");
        ring.close().unwrap();
        sim.check().expect("no protocol violation");
        assert!(x.iter().zip(&resident).all(|(a, b)| a.to_bits() == b.to_bits()), "fp8 streamed ({tier}) differs from resident");
    }
    let _ = std::fs::remove_file(&path);
}

#[test]
fn fp8_weights_stream_coded_with_their_own_code_bitwise_equal_and_fewer_bytes_on_the_link() {
    // Blocks of 256 KiB of fp8 weights: four of the simulated device's 64 KiB segments each.
    let (out, inn) = (512, 512);
    let path = tmp("coded");
    write_sized(&path, (out, inn), Weights::Scaled, |_| true);
    let file = SafetensorsFile::open(&path).unwrap();
    let inventory = NameDiscovery.discover("transformer", file.specs()).unwrap();
    let plan = resolve(&Plan::layerwise(), std::slice::from_ref(&inventory)).unwrap();
    let x0: Vec<f32> = (0..inn).map(|k| (k as f32 * 0.37).sin()).collect();
    // The resident run and a coded one, from one file.
    let mut runs = Vec::new();
    for coded in [false, true] {
        let sim = SimBackend::default_device();
        let store = Arc::new(HostStore::build_with(&sim, &inventory, &file, PinOptions { coded, ..Default::default() }).unwrap());
        let (ring, x, m) = stream(&sim, &store, &plan.components[0], &x0);
        ring.close().unwrap();
        sim.check().expect("no protocol violation");
        assert_eq!(store.coded_blocks(), if coded { DEPTH } else { 0 });
        runs.push((x, m.bytes_copied, m.link_bytes));
    }
    let _ = std::fs::remove_file(&path);
    let ((resident, raw, raw_link), (x, copied, link)) = (&runs[0], &runs[1]);
    assert!(resident.iter().all(|v| v.is_finite()) && resident.iter().any(|v| *v != resident[0]));
    assert!(x.iter().zip(resident).all(|(a, b)| a.to_bits() == b.to_bits()), "fp8 streamed coded differs from resident");
    assert_eq!((copied, raw_link), (raw, raw));
    // The exponent field's ≈ 2.6 bits plus 4 of sign and mantissa: ≈ 0.82, and
    // each of the simulated device's 64 KiB segments carries its 8 KiB decode
    // table (0.13; on offload-cuda's 32 MiB segments 0.0002). bf16's code, reading
    // two fp8 values as one bf16, gets ≈ 0.94 before its table: these blocks
    // would be held raw (`coded_blocks` 0 above) without fp8's own code.
    let ratio = *link as f64 / *raw as f64;
    assert!(ratio < 0.97, "{link} of {raw} bytes on the link: ratio {ratio:.3}");
}

#[test]
fn an_fp8_weight_without_its_scale_is_named() {
    let path = tmp("missing");
    write(&path, |i| i != 2);
    let file = SafetensorsFile::open(&path).unwrap();
    let e = fp8_weights(file.specs()).unwrap_err().to_string();
    let _ = std::fs::remove_file(&path);
    assert!(e.contains("blocks.2.ff.weight") && e.contains("blocks.2.ff.weight_scale"), "{e}");
}
