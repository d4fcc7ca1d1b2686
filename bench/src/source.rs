//! A registry model's weights as a [`TensorSource`]: random bf16 values made as
//! the host store reads each tensor (no copy of the model in memory), the same
//! scheme as the tch file and the anchors (linear weights at ±1/√fan-in, biases
//! ±0.01, norm scales in [0.5, 1.5]), reproducible from a seed.

use crate::registry::Model;
use offload_core::{BlockDiscovery, ComponentInventory, DType, Error, Plan, ResolvedComponent, Result, TensorSource, TensorSpec};

/// `model`'s blocks among `specs`, one component, without its non-block tensors:
/// the bench's models keep those on the device themselves (or have none), so a
/// store must not hold a second copy.
pub fn block_inventory(model: &Model, specs: &[TensorSpec]) -> Result<ComponentInventory> {
    let prefixes: Vec<&str> = model.stacks.iter().map(|s| s.prefix).collect();
    let mut inv = offload_core::DeclaredStacks::new(prefixes).discover("transformer", specs)?;
    inv.non_block.clear();
    Ok(inv)
}

/// The one component `plan` resolves `inv` to.
pub fn resolved(plan: &Plan, inv: &ComponentInventory) -> Result<ResolvedComponent> {
    Ok(offload_core::resolve(plan, std::slice::from_ref(inv))?.components.remove(0))
}

/// bf16 values (as their bits) in f32, for [`crate::harness::check_output`].
pub fn bf16_to_f32(v: &[u16]) -> Vec<f32> {
    v.iter().map(|&b| half::bf16::from_bits(b).to_f32()).collect()
}

/// Every parameter of a model, random, in bf16.
pub struct RegistrySource {
    specs: Vec<TensorSpec>,
    seed: u64,
    normal: bool,
}

impl RegistrySource {
    /// The source of `model`'s parameters from `seed`: uniform in each tensor's
    /// range (the scheme the tch file and the anchors share).
    pub fn new(model: &Model, seed: u64) -> Self {
        RegistrySource {
            specs: model.params().into_iter().map(|p| TensorSpec::new(p.name, DType::BF16, p.shape)).collect(),
            seed,
            normal: false,
        }
    }

    /// The same tensors drawn as a trained checkpoint's are distributed: normal,
    /// centred on the range's middle, with the uniform range's standard deviation
    /// (its width ÷ √12) as each tensor's scale — what the coded bench measures
    /// exponent entropy and compression on.
    pub fn normal(model: &Model, seed: u64) -> Self {
        RegistrySource { normal: true, ..Self::new(model, seed) }
    }
}

/// Values per chunk of a tensor made from one state (and by one thread).
const CHUNK: usize = 1 << 20;

/// Values per chunk of a normal tensor.
const NORMAL_CHUNK: usize = 1 << 16;

/// SplitMix64: one state word, good enough bits for weights.
fn next(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9E37_79B9_7F4A_7C15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
    z ^ (z >> 31)
}

/// `n` values uniform in [−√3, √3] (mean 0, variance 1) from `seed`: inputs
/// made on the host where a device cannot be seeded (candle's CPU device).
pub fn unit_values(seed: u64, n: usize) -> Vec<f32> {
    let mut state = seed;
    let r3 = 3f32.sqrt();
    (0..n).map(|_| ((next(&mut state) >> 40) as f32 / (1u64 << 24) as f32 * 2.0 - 1.0) * r3).collect()
}

impl TensorSource for RegistrySource {
    fn specs(&self) -> &[TensorSpec] {
        &self.specs
    }

    fn read_into(&self, index: usize, dst: &mut [u8]) -> Result<()> {
        let spec = self.specs.get(index).ok_or_else(|| Error::BadTensor { tensor: format!("#{index}"), fault: "no such tensor".into() })?;
        let (lo, hi) = crate::registry::init_range(&spec.name, &spec.shape);
        let (lo, hi) = (lo as f32, hi as f32);
        let (mid, sd) = ((lo + hi) / 2.0, (hi - lo) / 12f32.sqrt());
        let normal = self.normal;
        let seed = self.seed ^ (index as u64).wrapping_mul(0xD134_2543_DE82_EF95);
        // Chunks of CHUNK values, each from its own state: the values do not depend
        // on how many threads make them (a 22 GiB model is made in seconds, not a minute).
        let fill = |c: usize, chunk: &mut [u8]| {
            let mut state = seed ^ (c as u64).wrapping_mul(0x9FB2_1C65_1E98_DF25);
            for pair in chunk.chunks_exact_mut(2) {
                let u = (next(&mut state) >> 40) as f32 / (1u64 << 24) as f32;
                let v = match normal {
                    false => lo + (hi - lo) * u,
                    true => {
                        // Box–Muller, one value per pair of draws.
                        let u2 = (next(&mut state) >> 40) as f32 / (1u64 << 24) as f32;
                        let r = (-2.0 * (u + 0.5 / (1u64 << 24) as f32).ln()).sqrt();
                        mid + sd * r * (std::f32::consts::TAU * u2).cos()
                    }
                };
                pair.copy_from_slice(&half::bf16::from_f32(v).to_le_bytes());
            }
        };
        // Normal values cost a logarithm and a cosine each: smaller chunks spread a
        // tensor over every thread (a 22 GiB model was 59 s on 16 threads at CHUNK).
        let values = if normal { NORMAL_CHUNK } else { CHUNK };
        let chunks: Vec<(usize, &mut [u8])> = dst.chunks_mut(values * 2).enumerate().collect();
        let threads = std::thread::available_parallelism().map_or(1, |n| n.get()).min(chunks.len()).max(1);
        if threads == 1 {
            chunks.into_iter().for_each(|(c, chunk)| fill(c, chunk));
            return Ok(());
        }
        let per = chunks.len().div_ceil(threads);
        let mut chunks = chunks;
        std::thread::scope(|s| {
            while !chunks.is_empty() {
                let mine: Vec<(usize, &mut [u8])> = chunks.drain(..per.min(chunks.len())).collect();
                s.spawn(move || mine.into_iter().for_each(|(c, chunk)| fill(c, chunk)));
            }
        });
        Ok(())
    }

    fn origin(&self) -> String {
        "the bench room's random weights".into()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn values_are_reproducible_in_range_and_varied() {
        let m = crate::registry::tiny(&crate::registry::flux_dev());
        let (a, b) = (RegistrySource::new(&m, 7), RegistrySource::new(&m, 7));
        let i = a.specs().iter().position(|s| s.name == "transformer_blocks.0.attn.to_q.weight").unwrap();
        let n = a.specs()[i].nbytes().unwrap();
        let (mut x, mut y) = (vec![0u8; n], vec![0u8; n]);
        a.read_into(i, &mut x).unwrap();
        b.read_into(i, &mut y).unwrap();
        assert_eq!(x, y);
        let v: Vec<f32> = x.chunks_exact(2).map(|p| half::bf16::from_le_bytes([p[0], p[1]]).to_f32()).collect();
        let bound = 1.0 / (64f32).sqrt() + 1e-3;
        assert!(v.iter().all(|x| x.abs() <= bound), "outside ±1/√64");
        assert!(v.iter().any(|x| *x != v[0]));
        RegistrySource::new(&m, 8).read_into(i, &mut y).unwrap();
        assert_ne!(x, y, "another seed, other values");
        assert!(a.read_into(a.specs().len(), &mut y).is_err());
    }

    #[test]
    fn normal_values_have_the_uniform_ranges_scale_and_a_normals_exponents() {
        let m = crate::registry::tiny(&crate::registry::flux_dev());
        let a = RegistrySource::normal(&m, 7);
        let i = a.specs().iter().position(|s| s.name == "transformer_blocks.0.attn.to_q.weight").unwrap();
        let mut x = vec![0u8; a.specs()[i].nbytes().unwrap()];
        a.read_into(i, &mut x).unwrap();
        let v: Vec<f64> = x.chunks_exact(2).map(|p| f64::from(half::bf16::from_le_bytes([p[0], p[1]]).to_f32())).collect();
        let n = v.len() as f64;
        let mean = v.iter().sum::<f64>() / n;
        let sd = (v.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / n).sqrt();
        // The uniform range ±1/√64 has sd 1/√64/√3 ≈ 0.0722.
        assert!(mean.abs() < 0.01 && (sd / 0.0722 - 1.0).abs() < 0.1, "mean {mean}, sd {sd}");
        // Beyond 2 sd: about 4.6 % for a normal, none for a uniform of this sd.
        let tails = v.iter().filter(|x| x.abs() > 2.0 * 0.0722).count() as f64 / n;
        assert!((0.02..0.08).contains(&tails), "tails {tails}");
        let e = offload_core::codec::exponent_entropy_bits(&x);
        assert!((2.3..2.9).contains(&e), "exponent entropy {e}");
    }
}
