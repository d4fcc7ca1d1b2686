//! Random test models and the reference "forward" the conformance cases compare
//! against: an order-dependent fold over every byte of every block run.

use offload_core::{BlockDiscovery, BlockLayout, ComponentInventory, DType, MemoryTensors, NameDiscovery, TensorSpec};
use rand::{Rng, SeedableRng};

/// The shape of a random model.
#[derive(Clone, Debug)]
pub struct ModelShape {
    /// Blocks per stack.
    pub stacks: Vec<usize>,
    /// Tensors per block.
    pub tensors_per_block: usize,
    /// Tensor sizes are drawn from `min_bytes..=max_bytes`.
    pub min_bytes: usize,
    /// See `min_bytes`.
    pub max_bytes: usize,
    /// Non-block tensors.
    pub non_block: usize,
}

impl Default for ModelShape {
    fn default() -> Self {
        ModelShape { stacks: vec![5, 7], tensors_per_block: 3, min_bytes: 64 << 10, max_bytes: 192 << 10, non_block: 2 }
    }
}

/// A random model: its tensors (fresh random bytes, never zeros) and inventory.
pub struct TestModel {
    /// Tensors with their bytes.
    pub tensors: MemoryTensors,
    /// Stacks and blocks.
    pub inventory: ComponentInventory,
}

/// `len` bytes of little-endian bf16 values, normal with a scale drawn per tensor
/// (an odd last byte uniform).
pub fn normal_bf16_bytes(rng: &mut rand::rngs::StdRng, len: usize) -> Vec<u8> {
    let sd = 0.01 + rng.gen::<f64>() * 0.2;
    let mut out = Vec::with_capacity(len);
    while out.len() + 2 <= len {
        let (u1, u2): (f64, f64) = (rng.gen::<f64>().max(1e-300), rng.gen());
        let v = ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos() * sd) as f32;
        out.extend_from_slice(&((v.to_bits() >> 16) as u16).to_le_bytes());
    }
    if out.len() < len {
        out.push(rng.gen());
    }
    out
}

impl TestModel {
    /// A model of `shape` with random bytes from `seed`.
    pub fn random(shape: &ModelShape, seed: u64) -> Self {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut tensors = MemoryTensors::new();
        for (s, &n) in shape.stacks.iter().enumerate() {
            for b in 0..n {
                for t in 0..shape.tensors_per_block {
                    let len = rng.gen_range(shape.min_bytes..=shape.max_bytes);
                    // Even tensors hold bf16 weights drawn as a checkpoint's are (normal,
                    // with the tensor's own scale: what a coded store codes); odd ones
                    // uniform bytes (what it cannot shrink).
                    let bytes: Vec<u8> = if t % 2 == 0 { normal_bf16_bytes(&mut rng, len) } else { (0..len).map(|_| rng.gen()).collect() };
                    let spec = TensorSpec::new(format!("stack{s}.{b}.t{t}.weight"), DType::U8, [len]);
                    tensors.push(spec, bytes).expect("sizes agree");
                }
            }
        }
        for t in 0..shape.non_block {
            let len = rng.gen_range(shape.min_bytes..=shape.max_bytes);
            let bytes: Vec<u8> = (0..len).map(|_| rng.gen()).collect();
            tensors.push(TensorSpec::new(format!("head{t}.weight"), DType::U8, [len]), bytes).expect("sizes agree");
        }
        let inventory = NameDiscovery.discover("transformer", offload_core::TensorSource::specs(&tensors)).expect("discoverable");
        TestModel { tensors, inventory }
    }

    /// Number of blocks.
    pub fn len(&self) -> usize {
        self.inventory.blocks().count()
    }

    /// Whether the model has no blocks.
    pub fn is_empty(&self) -> bool {
        self.len() == 0
    }

    /// The bytes block `b` has in a host buffer, laid out as the store lays it out,
    /// built from the source tensors (not from the store).
    pub fn block_bytes(&self, b: usize) -> Vec<u8> {
        let spec = self.inventory.blocks().nth(b).expect("block exists");
        let layout = BlockLayout::new(spec.tensors.clone()).expect("valid");
        let mut out = vec![0u8; layout.bytes];
        for t in &layout.tensors {
            out[t.offset..t.offset + t.nbytes].copy_from_slice(self.tensors.bytes(&t.spec.name).expect("present"));
        }
        out
    }

    /// The reference forward over blocks run in `order`.
    pub fn reference(&self, order: &[usize]) -> u64 {
        order.iter().fold(SEED, |acc, &b| fold_combine(acc, block_hash(&self.block_bytes(b))))
    }
}

/// Accumulator start value.
pub const SEED: u64 = 0x5EED_0FF1_0AD5_EED5;
const K1: u64 = 0x9E37_79B9_7F4A_7C15;
const K2: u64 = 0xBF58_476D_1CE4_E5B9;

/// The per-word mix: position-dependent, so moved bytes change the hash.
pub fn mix(word: u64, index: u64) -> u64 {
    let x = word.wrapping_add(index.wrapping_mul(K1)).wrapping_mul(K2);
    x ^ (x >> 31)
}

/// A block's hash: the wrapping sum of `mix` over its little-endian 8-byte words
/// (the last one zero-padded). Order-free inside a block, so a GPU can sum it in
/// parallel with atomics and still match exactly.
pub fn block_hash(bytes: &[u8]) -> u64 {
    bytes.chunks(8).enumerate().fold(0u64, |h, (i, c)| {
        let mut w = [0u8; 8];
        w[..c.len()].copy_from_slice(c);
        h.wrapping_add(mix(u64::from_le_bytes(w), i as u64))
    })
}

/// Fold a block hash into the running accumulator: order-dependent across blocks.
pub fn fold_combine(acc: u64, h: u64) -> u64 {
    (acc.rotate_left(7) ^ h).wrapping_mul(K1)
}
