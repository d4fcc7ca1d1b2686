//! The `offload-plan` CLI on a small checkpoint written here.

use std::process::Command;

fn write_checkpoint(path: &std::path::Path) {
    let data: Vec<Vec<u8>> = (0..7).map(|i| vec![i as u8 + 1; if i < 6 { 4096 } else { 512 }]).collect();
    let mut views = Vec::new();
    for (i, d) in data.iter().take(6).enumerate() {
        views.push((
            format!("transformer_blocks.{i}.ff.net.0.proj.weight"),
            safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![4096], d).unwrap(),
        ));
    }
    views.push(("proj_out.weight".to_owned(), safetensors::tensor::TensorView::new(safetensors::Dtype::U8, vec![512], &data[6]).unwrap()));
    safetensors::serialize_to_file(views, &None, path).unwrap();
}

#[test]
fn plans_a_checkpoint_and_writes_toml() {
    let dir = std::env::temp_dir().join(format!("offload-plan-cli-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let ckpt = dir.join("m.safetensors");
    write_checkpoint(&ckpt);
    let out = dir.join("plan.toml");
    // 24 KiB of blocks; a budget of 20 KiB at d = 1 keeps 2 blocks resident… or more.
    let budget = (20.0 * 1024.0) / (1u64 << 30) as f64;
    let o = Command::new(env!("CARGO_BIN_EXE_offload-plan"))
        .args([ckpt.to_str().unwrap(), "--budget-gib", &budget.to_string(), "--write", out.to_str().unwrap()])
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&o.stdout);
    assert!(o.status.success(), "{stdout}{}", String::from_utf8_lossy(&o.stderr));
    assert!(stdout.contains("stack transformer_blocks") && stdout.contains("6 blocks"), "{stdout}");
    assert!(stdout.contains("resident blocks: 2 of 6"), "{stdout}");
    let plan = offload_plan::from_toml(&std::fs::read_to_string(&out).unwrap()).unwrap();
    assert_eq!(plan.components["transformer"].resident_blocks.len(), 2);
    // A budget too small for two slots is an error naming what is needed.
    let o = Command::new(env!("CARGO_BIN_EXE_offload-plan")).args([ckpt.to_str().unwrap(), "--budget-gib", "0.000001"]).output().unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("fits no plan"));
    let _ = std::fs::remove_dir_all(&dir);
}
