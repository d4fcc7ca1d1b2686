// The conformance fold and the bench's timed compute, compiled to SPIR-V at
// build time by naga (build.rs). Entry points:
// - `spin`: one invocation busy for `p.spin` rounds (the checking mode's delay
//   before a fold reads, and the bench's compute of a chosen length);
// - `block_hash`: acc[1] += Σ mix(word_i, i) over the first `p.bytes` bytes;
// - `fold_combine`: acc[0] = (rotl(acc[0], 7) ^ acc[1]) · K, acc[1] = 0.
// 32-bit arithmetic throughout (WGSL has no 64-bit integers); the host computes
// the same fold to check it (offload_vulkan::fold::reference_*).

struct Params {
    words: u32,
    bytes: u32,
    spin: u32,
    pad: u32,
}

var<immediate> p: Params;

@group(0) @binding(0) var<storage, read> slot: array<u32>;
@group(0) @binding(1) var<storage, read_write> acc: array<atomic<u32>, 4>;

fn mix(w: u32, i: u32) -> u32 {
    var x = (w + i * 0x9E3779B9u) * 0x85EBCA6Bu;
    x = x ^ (x >> 13u);
    return x * 0xC2B2AE35u;
}

@compute @workgroup_size(1)
fn spin() {
    var x = atomicLoad(&acc[2]) | 1u;
    for (var k = 0u; k < p.spin; k = k + 1u) {
        x = x * 1664525u + 1013904223u;
    }
    // Never true for the seeds used; keeps the loop from being optimised away.
    if (x == 0x12345678u) {
        atomicAdd(&acc[3], 1u);
    }
}

@compute @workgroup_size(256)
fn block_hash(@builtin(global_invocation_id) gid: vec3<u32>, @builtin(num_workgroups) groups: vec3<u32>) {
    var sum = 0u;
    let stride = groups.x * 256u;
    for (var i = gid.x; i < p.words; i = i + stride) {
        var w = slot[i];
        let end = (i + 1u) * 4u;
        if (end > p.bytes) {
            let keep = p.bytes - i * 4u;
            w = w & ((1u << (8u * keep)) - 1u);
        }
        sum = sum + mix(w, i);
    }
    atomicAdd(&acc[1], sum);
}

@compute @workgroup_size(1)
fn fold_combine() {
    let a = atomicLoad(&acc[0]);
    let s = atomicLoad(&acc[1]);
    atomicStore(&acc[0], (((a << 7u) | (a >> 25u)) ^ s) * 0x9E3779B9u);
    atomicStore(&acc[1], 0u);
}
