//! Compile the compute shaders from WGSL to SPIR-V with naga at build time: no
//! prebuilt binary is downloaded or committed.

use std::path::PathBuf;

fn main() {
    let src_path = "shaders/fold.wgsl";
    println!("cargo:rerun-if-changed={src_path}");
    let src = std::fs::read_to_string(src_path).unwrap_or_else(|e| panic!("{src_path}: {e}"));
    let module = naga::front::wgsl::parse_str(&src).unwrap_or_else(|e| panic!("{}", e.emit_to_string(&src)));
    let info = naga::valid::Validator::new(naga::valid::ValidationFlags::all(), naga::valid::Capabilities::IMMEDIATES)
        .validate(&module)
        .unwrap_or_else(|e| panic!("{src_path}: {}", e.emit_to_string(&src)));
    let options = naga::back::spv::Options { lang_version: (1, 3), ..Default::default() };
    let words = naga::back::spv::write_vec(&module, &info, &options, None).unwrap_or_else(|e| panic!("{src_path}: SPIR-V: {e}"));
    let bytes: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let out = PathBuf::from(std::env::var_os("OUT_DIR").expect("OUT_DIR")).join("fold.spv");
    std::fs::write(&out, bytes).unwrap_or_else(|e| panic!("{}: {e}", out.display()));
}
