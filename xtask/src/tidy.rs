//! The tidy checks (after rust-analyzer's `tidy.rs`): every Rust file opens with
//! `//!`; every `unsafe` block or impl has a `// SAFETY:` comment just above it;
//! `unsafe` appears only in backend crates; `offload-core` and `offload-plan` name
//! no GPU crate; backends depend on each other only where the design allows.

use std::path::{Path, PathBuf};

fn rust_files(dir: &Path, out: &mut Vec<PathBuf>) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            if !matches!(name.as_str(), "target" | ".git" | ".bundle" | ".cache" | ".whl") {
                rust_files(&p, out);
            }
        } else if name.ends_with(".rs") {
            out.push(p);
        }
    }
}

/// `line` with the contents of string literals removed (escapes honoured).
fn strip_strings(line: &str) -> String {
    let mut out = String::with_capacity(line.len());
    let (mut in_str, mut escaped) = (false, false);
    for c in line.chars() {
        match (in_str, escaped, c) {
            (true, true, _) => escaped = false,
            (true, false, '\\') => escaped = true,
            (_, _, '"') => {
                in_str = !in_str;
                out.push('"');
            }
            (true, _, _) => {}
            (false, _, c) => out.push(c),
        }
    }
    out
}

/// Whether `code` opens an `unsafe` block or impl (`unsafe` as a whole word,
/// followed by `{`, `impl` or the end of the line).
fn unsafe_block_or_impl(code: &str) -> bool {
    code.match_indices("unsafe").any(|(i, _)| {
        let before = code[..i].chars().next_back();
        let after = code[i + 6..].trim_start();
        !before.is_some_and(|c| c.is_alphanumeric() || c == '_')
            && (after.is_empty() || after.starts_with('{') || after.starts_with("impl"))
    })
}

/// Every problem found under `root`, one line each.
pub fn check(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(root, &mut files);
    files.sort();
    let mut problems = Vec::new();
    for f in &files {
        let rel = f.strip_prefix(root).unwrap_or(f).display().to_string();
        let Ok(text) = std::fs::read_to_string(f) else { continue };
        if !text.starts_with("//!") {
            problems.push(format!("{rel}: does not open with a `//!` doc comment"));
        }
        let lines: Vec<&str> = text.lines().collect();
        let backend = ["offload-cuda/", "offload-candle/", "offload-tch/", "offload-vulkan/"].iter().any(|p| rel.starts_with(p));
        for (i, line) in lines.iter().enumerate() {
            let code = strip_strings(line.split("//").next().unwrap_or(""));
            if !unsafe_block_or_impl(&code) {
                continue;
            }
            if !backend && !rel.starts_with("xtask/") {
                problems.push(format!("{rel}:{}: `unsafe` outside a backend crate", i + 1));
            }
            let above = lines[i.saturating_sub(3)..i].iter().chain(std::iter::once(line));
            if !above.clone().any(|l| l.contains("SAFETY:")) {
                problems.push(format!("{rel}:{}: `unsafe` without a `// SAFETY:` comment above it", i + 1));
            }
        }
    }
    let manifest = |c: &str| std::fs::read_to_string(root.join(c).join("Cargo.toml")).unwrap_or_default();
    for (krate, banned) in [
        ("offload-core", &["cudarc", "candle", "tch", "ash", "offload-cuda", "offload-candle", "offload-tch", "offload-vulkan"][..]),
        ("offload-plan", &["cudarc", "candle", "tch", "ash", "offload-cuda", "offload-candle", "offload-tch", "offload-vulkan"][..]),
        ("offload-cuda", &["candle", "tch", "ash", "offload-candle", "offload-tch", "offload-vulkan"][..]),
        ("offload-candle", &["tch", "ash", "offload-tch", "offload-vulkan"][..]),
        ("offload-tch", &["candle", "ash", "offload-candle", "offload-vulkan"][..]),
        ("offload-vulkan", &["cudarc", "candle", "tch", "offload-cuda", "offload-candle", "offload-tch"][..]),
    ] {
        let m = manifest(krate);
        let deps = m.split("[dependencies]").nth(1).unwrap_or("");
        for b in banned {
            if deps.lines().any(|l| l.split(['=', '.', ' ']).next() == Some(b)) {
                problems.push(format!("{krate}/Cargo.toml: depends on {b}, which the design forbids"));
            }
        }
    }
    problems
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_workspace_is_tidy() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("workspace root");
        let p = check(root);
        assert!(p.is_empty(), "tidy:\n{}", p.join("\n"));
    }

    #[test]
    fn tidy_catches_what_it_must() {
        let dir = std::env::temp_dir().join(format!("offload-tidy-{}", std::process::id()));
        let core = dir.join("offload-core/src");
        std::fs::create_dir_all(&core).expect("temp dir");
        std::fs::write(core.join("lib.rs"), concat!("fn f() { uns", "afe { g() } }\n")).expect("write");
        std::fs::write(dir.join("offload-core/Cargo.toml"), "[package]\n[dependencies]\ncudarc = \"1\"\n").expect("write");
        let p = check(&dir).join("\n");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(p.contains("does not open with"), "{p}");
        assert!(p.contains("outside a backend crate"), "{p}");
        assert!(p.contains("without a `// SAFETY:`"), "{p}");
        assert!(p.contains("depends on cudarc"), "{p}");
    }
}
