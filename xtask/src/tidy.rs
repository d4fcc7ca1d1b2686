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
/// The crates a manifest depends on, in any dependency table (`[dependencies]`,
/// `[dev-dependencies]`, `[build-dependencies]`, a target's), as `name = …`, as
/// `name.workspace = true`, as a `[dependencies.name]` table, or renamed
/// (`alias = { package = "name" }`).
fn dependencies(manifest: &str) -> Vec<String> {
    let mut out = Vec::new();
    let mut in_deps = false;
    for line in manifest.lines().map(str::trim) {
        if let Some(header) = line.strip_prefix('[').and_then(|l| l.strip_suffix(']')) {
            let parts: Vec<&str> = header.split('.').map(|p| p.trim().trim_matches(['"', '\''])).collect();
            in_deps = parts.last().is_some_and(|p| p.ends_with("dependencies"));
            // `[dependencies.name]`, `[target.'cfg(…)'.dependencies.name]`.
            if let Some(k) = parts.iter().rposition(|p| p.ends_with("dependencies")).filter(|&k| k + 1 < parts.len()) {
                out.push(parts[k + 1].to_owned());
            }
            continue;
        }
        if in_deps && !line.starts_with('#') {
            if let Some(name) = line.split(['=', '.', ' ']).next().filter(|n| !n.is_empty()) {
                out.push(name.to_owned());
            }
        }
        if let Some(at) = line.find("package") {
            let rest = line[at + "package".len()..].trim_start();
            if let Some(name) = rest.strip_prefix('=').map(|r| r.trim_start().trim_start_matches('"')) {
                out.push(name.split('"').next().unwrap_or("").to_owned());
            }
        }
    }
    out
}

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
        let backend =
            ["offload-cuda/", "offload-candle/", "offload-tch/", "offload-vulkan/", "offload-py/"].iter().any(|p| rel.starts_with(p));
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
        // The Python package links no libtorch: torch is reached through Python.
        ("offload-py", &["tch", "torch-sys", "candle", "ash", "offload-candle", "offload-tch", "offload-vulkan"][..]),
    ] {
        let deps = dependencies(&manifest(krate));
        for b in banned {
            if deps.iter().any(|d| d == b) {
                problems.push(format!("{krate}/Cargo.toml: depends on {b}, which the design forbids"));
            }
        }
    }
    for krate in LAYERED {
        problems.extend(import_cycles(&root.join(krate).join("src"), krate));
    }
    problems.extend(history(root));
    problems.extend(long_functions(root));
    problems
}

/// The crates a user builds on: their functions (tests aside) stay short
/// enough to read, each at most [`LONGEST_FUNCTION`] lines.
const LIBRARY: [&str; 9] = [
    "offload-core",
    "offload-formats",
    "offload-plan",
    "offload-cuda",
    "offload-candle",
    "offload-tch",
    "offload-vulkan",
    "offload-py",
    "src",
];

/// The most lines a library function may have (its signature to its closing brace).
pub const LONGEST_FUNCTION: usize = 150;

/// The import cycles of the layered crates, and the longest library function
/// (its length and where it is), as tidy reads them.
pub fn house_counts(root: &Path) -> (Vec<String>, Option<(usize, String)>) {
    let cycles = LAYERED.iter().flat_map(|k| import_cycles(&root.join(k).join("src"), k)).collect();
    let longest = library_functions(root)
        .into_iter()
        .max_by_key(|(_, _, _, len)| *len)
        .map(|(rel, name, line, len)| (len, format!("{rel}:{line} `{name}`")));
    (cycles, longest)
}

/// Every library function (Rust and the Python package's): its file, name, line and length.
fn library_functions(root: &Path) -> Vec<(String, String, usize, usize)> {
    let mut files = Vec::new();
    for krate in LIBRARY {
        collect(&root.join(krate), &mut files, &["rs", "py"]);
    }
    files.sort();
    let mut out = Vec::new();
    for f in files {
        let rel = f.strip_prefix(root).unwrap_or(&f).display().to_string();
        // Tests, examples and benches are not the library.
        if ["/tests/", "/examples/", "/benches/", "/gpu_tests/"].iter().any(|d| rel.contains(d)) || rel.ends_with("tests.rs") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&f) else { continue };
        let found = if rel.ends_with(".py") { python_functions(&text) } else { rust_functions(&text) };
        out.extend(found.into_iter().map(|(name, line, len)| (rel.clone(), name, line, len)));
    }
    out
}

/// Library functions (Rust and the Python package's) over [`LONGEST_FUNCTION`] lines.
fn long_functions(root: &Path) -> Vec<String> {
    library_functions(root)
        .into_iter()
        .filter(|f| f.3 > LONGEST_FUNCTION)
        .map(|(rel, name, line, len)| {
            format!("{rel}:{line}: function `{name}` is {len} lines (at most {LONGEST_FUNCTION}): split it into named steps")
        })
        .collect()
}

/// Each Rust function of `text` outside an inline test module: its name, first
/// line (1-based) and length in lines, by its braces (outside comments and strings).
fn rust_functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let end = (1..lines.len())
        .find(|&i| lines[i].starts_with("mod tests") && lines[i - 1].starts_with("#[cfg(") && lines[i - 1].contains("test"))
        .map_or(lines.len(), |i| i - 1);
    let code: Vec<String> = lines[..end].iter().map(|l| strip_strings(l.split("//").next().unwrap_or(""))).collect();
    let mut out = Vec::new();
    for (i, l) in code.iter().enumerate() {
        let Some(at) = l.find("fn ").filter(|&a| a == 0 || !l[..a].ends_with(|c: char| c.is_alphanumeric() || c == '_')) else { continue };
        let name: String = l[at + 3..].chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        if name.is_empty() {
            continue;
        }
        // A declaration without a body (a trait's) ends at its `;`, before any `{`.
        let rest = code[i..].iter().map(|c| c.as_str()).collect::<Vec<_>>().join("\n");
        let rest = &rest[at..];
        if rest.find(';').is_some_and(|semi| rest.find('{').is_none_or(|brace| semi < brace)) {
            continue;
        }
        let (mut depth, mut opened) = (0i64, false);
        for (j, c) in code.iter().enumerate().skip(i) {
            for ch in c.chars() {
                match ch {
                    '{' => (depth, opened) = (depth + 1, true),
                    '}' => depth -= 1,
                    _ => {}
                }
            }
            if opened && depth <= 0 {
                out.push((name.clone(), i + 1, j - i + 1));
                break;
            }
        }
    }
    out
}

/// Each Python function of `text` (`def` at any depth): its name, first line
/// and length, to the last line indented under it.
fn python_functions(text: &str) -> Vec<(String, usize, usize)> {
    let lines: Vec<&str> = text.lines().collect();
    let indent = |l: &str| l.len() - l.trim_start().len();
    let mut out = Vec::new();
    for (i, l) in lines.iter().enumerate() {
        let t = l.trim_start();
        let Some(rest) = t.strip_prefix("def ").or_else(|| t.strip_prefix("async def ")) else { continue };
        let name: String = rest.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect();
        let own = indent(l);
        // The signature may span lines: the body starts after the line ending in `:`.
        let body = (i..lines.len()).find(|&j| lines[j].trim_end().ends_with(':')).unwrap_or(i);
        let mut last = body;
        for (j, m) in lines.iter().enumerate().skip(body + 1) {
            if m.trim().is_empty() {
                continue;
            }
            if indent(m) <= own {
                break;
            }
            last = j;
        }
        out.push((name, i + 1, last - i + 1));
    }
    out
}

/// Words that tell where a comment came from rather than what the code does (a
/// tracker's number, a work period, a critique, a revision hash). The code and
/// the docs explain the code; its history lives in `bench/NOTES.md`, the
/// results files and git.
const HISTORY: [&str; 4] = ["issue ", " session", "review", "commit "];

/// Comments (Rust `//`, Python and shell `#`) and the guide's pages (`docs/`,
/// the README, ARCHITECTURE.md) that cite their history ([`HISTORY`]'s words,
/// as [`cites`] reads them).
fn history(root: &Path) -> Vec<String> {
    let mut files = Vec::new();
    collect(root, &mut files, &["rs", "py", "sh", "md"]);
    let mut problems = Vec::new();
    for f in files {
        let rel = f.strip_prefix(root).unwrap_or(&f).display().to_string();
        // This file names the patterns it looks for.
        if rel == "xtask/src/tidy.rs" {
            continue;
        }
        let md = rel.ends_with(".md");
        if md && !(rel.starts_with("docs/") || rel == "README.md" || rel == "ARCHITECTURE.md") {
            continue;
        }
        let Ok(text) = std::fs::read_to_string(&f) else { continue };
        for (i, line) in text.lines().enumerate() {
            let comment = match (md, rel.ends_with(".rs")) {
                (true, _) => Some(line),
                (false, true) => line.find("//").map(|at| &line[at..]),
                (false, false) => line.trim_start().strip_prefix('#'),
            };
            let Some(comment) = comment.map(str::to_lowercase) else { continue };
            if let Some(word) = HISTORY.iter().find(|w| cites(&comment, w)) {
                problems.push(format!("{rel}:{}: a comment cites its history ({:?}): say what the code does", i + 1, word.trim()));
            }
        }
    }
    problems
}

/// Whether `text` holds `word` as history: a tracker's word followed by a
/// number, a revision followed by a hash, a work period named or numbered
/// (an ordinal, `this`, `last`), a critique as a definite noun (`the …`, `…'s`).
/// The test below plants each form.
fn cites(text: &str, word: &str) -> bool {
    text.match_indices(word).any(|(at, _)| {
        let head = &text[..at];
        let before = head.chars().next_back().is_none_or(|c| !c.is_alphanumeric());
        let after = &text[at + word.len()..];
        let previous = head.split_whitespace().next_back().unwrap_or("").trim_start_matches(|c: char| !c.is_alphanumeric());
        match word {
            "issue " => before && after.starts_with(|c: char| c.is_ascii_digit()),
            "commit " => {
                let hash = after.get(..7).unwrap_or("");
                before && hash.len() == 7 && hash.chars().all(|c| c.is_ascii_hexdigit()) && hash.chars().any(|c| c.is_ascii_digit())
            }
            " session" => {
                ["this", "last", "previous", "next", "first", "second", "third"].contains(&previous)
                    || ["th", "st", "nd", "rd"].iter().any(|s| previous.ends_with(s) && previous.len() > 3 && !previous.ends_with("est"))
            }
            _ => before && (head.ends_with("the ") || after.starts_with("'s")),
        }
    })
}

/// Files under `dir` ending in one of `exts`, outside build outputs, run data
/// and the GPU bundle.
fn collect(dir: &Path, out: &mut Vec<PathBuf>, exts: &[&str]) {
    let Ok(entries) = std::fs::read_dir(dir) else { return };
    for e in entries.flatten() {
        let p = e.path();
        let name = e.file_name().to_string_lossy().into_owned();
        if p.is_dir() {
            if !name.starts_with('.') && !["target", "raw", "results", "node_modules", "fuzz"].contains(&name.as_str()) {
                collect(&p, out, exts);
            }
        } else if exts.iter().any(|x| name.ends_with(&format!(".{x}"))) && name != "NOTES.md" {
            out.push(p);
        }
    }
}

/// The crates whose files must import each other without a cycle (a core the
/// features stand on, never the other way).
pub const LAYERED: [&str; 4] = ["offload-cuda", "offload-tch", "offload-core", "offload-vulkan"];

/// The modules of the crate at `src` that file `rel` (relative to `src`) names
/// with `crate::…` paths, outside comments and strings; a name that is not a
/// module (an item of the crate root, `crate::CudaBackend`) is the root, `lib`.
fn crate_imports(text: &str, modules: &[String]) -> Vec<String> {
    let code: String = text.lines().map(|l| strip_strings(l.split("//").next().unwrap_or(""))).collect::<Vec<_>>().join("\n");
    let ident = |s: &str| s.chars().take_while(|c| c.is_alphanumeric() || *c == '_').collect::<String>();
    let mut out = Vec::new();
    let mut push = |name: String| {
        let m = if modules.contains(&name) { name } else { "lib".to_owned() };
        if !out.contains(&m) {
            out.push(m);
        }
    };
    for (i, _) in code.match_indices("crate::") {
        if code[..i].chars().next_back().is_some_and(|c| c.is_alphanumeric() || c == '_' || c == '$') {
            // `offload_crate::`, say; or a macro's `$crate::`, a path the macro's
            // caller names where it expands the macro, not this file's import.
            continue;
        }
        let rest = &code[i + 7..];
        if let Some(group) = rest.strip_prefix('{') {
            // `use crate::{a, b::C, d::{e, f}}`: the first segment of each item.
            let (mut depth, mut start) = (0usize, true);
            for (j, c) in group.char_indices() {
                match c {
                    '{' => depth += 1,
                    '}' if depth == 0 => break,
                    '}' => depth -= 1,
                    ',' if depth == 0 => start = true,
                    c if start && (c.is_alphanumeric() || c == '_') => {
                        push(ident(&group[j..]));
                        start = false;
                    }
                    _ => {}
                }
            }
        } else {
            let name = ident(rest);
            if !name.is_empty() {
                push(name);
            }
        }
    }
    out
}

/// Import cycles among the files of the crate at `src`: a module (a file, or a
/// directory with its files) that imports, directly or through others, a
/// module that imports it. The root (`lib.rs`) declares every module, so a
/// file that names an item through the root (`crate::Item`) is in a cycle too.
fn import_cycles(src: &Path, krate: &str) -> Vec<String> {
    let mut files = Vec::new();
    rust_files(src, &mut files);
    let module_of = |f: &Path| -> String {
        let rel = f.strip_prefix(src).unwrap_or(f);
        let first = rel.components().next().map(|c| c.as_os_str().to_string_lossy().into_owned()).unwrap_or_default();
        first.trim_end_matches(".rs").to_owned()
    };
    let mut modules: Vec<String> = files.iter().map(|f| module_of(f)).collect();
    modules.sort();
    modules.dedup();
    let mut edges: std::collections::BTreeMap<String, Vec<String>> = Default::default();
    for f in &files {
        let m = module_of(f);
        if f.file_name().is_some_and(|n| n == "tests.rs") {
            // A module's tests use the crate as any caller does: not its layering.
            continue;
        }
        let Ok(text) = std::fs::read_to_string(f) else { continue };
        // The same for an inline test module (`#[cfg(…test…)]` then `mod tests`):
        // the file's text up to it.
        let lines: Vec<&str> = text.lines().collect();
        let end = (1..lines.len())
            .find(|&i| lines[i].starts_with("mod tests") && lines[i - 1].starts_with("#[cfg(") && lines[i - 1].contains("test"))
            .map_or(lines.len(), |i| i - 1);
        let text = lines[..end].join("\n");
        let e = edges.entry(m.clone()).or_default();
        if m == "lib" || m == "main" {
            // The root reaches every module it declares.
            e.extend(modules.iter().filter(|x| *x != &m).cloned());
            continue;
        }
        for to in crate_imports(&text, &modules) {
            if to != m && !e.contains(&to) {
                e.push(to);
            }
        }
    }
    // A cycle through a module: a path from one of its imports back to it.
    let mut problems = Vec::new();
    for m in modules.iter().filter(|m| *m != "lib" && *m != "main") {
        let mut seen = vec![m.clone()];
        // Breadth first: the shortest cycle is the one reported.
        let mut queue: std::collections::VecDeque<Vec<String>> =
            edges.get(m).into_iter().flatten().map(|n| vec![m.clone(), n.clone()]).collect();
        while let Some(path) = queue.pop_front() {
            let last = path.last().expect("a path");
            if last == m {
                problems.push(format!("{krate}: {} (an import cycle: each file imports the next)", path.join(" → ")));
                break;
            }
            if seen.contains(last) {
                continue;
            }
            seen.push(last.clone());
            for n in edges.get(last).into_iter().flatten() {
                let mut p = path.clone();
                p.push(n.clone());
                queue.push_back(p);
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

    /// A comment citing its history is caught in Rust, Python, shell and the
    /// guide's pages (each planted form spelled in pieces, so that this file
    /// holds none whole); the same words in other senses pass.
    #[test]
    fn tidy_catches_a_comment_that_cites_its_history() {
        let dir = std::env::temp_dir().join(format!("offload-tidy-history-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("offload-core/src")).expect("temp dir");
        std::fs::create_dir_all(dir.join("docs")).expect("temp dir");
        let plant = |name: &str, parts: &[&str]| std::fs::write(dir.join(name), parts.concat()).expect("write");
        plant("offload-core/src/lib.rs", &["//! ok\n// The relay (iss", "ue 18).\nfn f() {} // a sess", "ion of steps is fine\n"]);
        plant("run.sh", &["# from the twelfth sess", "ion\necho iss", "ue 3\n"]);
        plant("t.py", &["x = 1  # the rev", "iew's example\n# at com", "mit 8531df1\n"]);
        plant("docs/page.md", &["Short of iss", "ue 33's target.\nThe issues list, reviewed code and a commit message pass.\n"]);
        let p = history(&dir).join("\n");
        let _ = std::fs::remove_dir_all(&dir);
        for at in ["offload-core/src/lib.rs:2", "run.sh:1", "t.py:2", "docs/page.md:1"] {
            assert!(p.contains(at), "{at} not caught:\n{p}");
        }
        assert!(!p.contains("lib.rs:3") && !p.contains("run.sh:2") && !p.contains("page.md:2"), "{p}");
    }

    /// What tidy lets through, and the forms a dependency can take.
    #[test]
    fn tidy_lets_through_what_it_should_and_reads_every_dependency_form() {
        let dir = std::env::temp_dir().join(format!("offload-tidy-ok-{}", std::process::id()));
        for (krate, body) in [
            // `unsafe` in a backend crate, with its SAFETY comment within three lines above.
            ("offload-cuda", concat!("//! ok\n// SAFETY: g is sound here.\n\n", "fn f() { uns", "afe { g() } }\n")),
            ("offload-core", "//! ok\nfn f() {}\n"),
        ] {
            std::fs::create_dir_all(dir.join(krate).join("src")).expect("temp dir");
            std::fs::write(dir.join(krate).join("src/lib.rs"), body).expect("write");
        }
        std::fs::write(dir.join("offload-core/Cargo.toml"), "[package]\n[dependencies]\nserde = \"1\"\n").expect("write");
        let clean = check(&dir);
        // A SAFETY comment four lines above is too far; a backend crate depending on another is refused.
        std::fs::write(dir.join("offload-cuda/src/lib.rs"), concat!("//! far\n// SAFETY: x\n\n\n\n", "fn f() { uns", "afe { g() } }\n"))
            .expect("write");
        std::fs::write(dir.join("offload-cuda/Cargo.toml"), "[package]\n[dependencies.ash]\nversion = \"0.38\"\n").expect("write");
        let p = check(&dir).join("\n");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(clean.is_empty(), "{clean:?}");
        assert!(p.contains("offload-cuda/src/lib.rs:6: `unsafe` without"), "{p}");
        assert!(p.contains("offload-cuda/Cargo.toml: depends on ash"), "{p}");
        let forms = "[package]\nname = \"x\"\n[dependencies]\na = \"1\"\nb.workspace = true\nc = { version = \"1\" }\n\
                     alias = { package = \"d\", version = \"1\" }\n[dependencies.e]\nversion = \"1\"\n\
                     [target.'cfg(unix)'.dependencies]\nf = \"1\"\n[dev-dependencies]\ng = \"1\"\n[features]\nh = []\n";
        let deps = dependencies(forms);
        for want in ["a", "b", "c", "d", "e", "f", "g"] {
            assert!(deps.iter().any(|d| d == want), "{want} not read: {deps:?}");
        }
        assert!(!deps.iter().any(|d| d == "h" || d == "name"), "{deps:?}");
    }

    /// The layering check finds a cycle between two files, through a grouped
    /// `use`, and through an item named by the root; not one in a comment.
    #[test]
    fn import_cycles_are_caught() {
        let dir = std::env::temp_dir().join(format!("offload-tidy-cycles-{}", std::process::id()));
        let src = dir.join("offload-cuda/src");
        std::fs::create_dir_all(src.join("tests")).expect("temp dir");
        let write = |f: &str, text: &str| std::fs::write(src.join(f), text).expect("write");
        write("lib.rs", "//! root\nmod core;\nmod feature;\nmod top;\nmod tests;\npub use top::Backend;\n");
        write("core.rs", "//! core\n// crate::top in a comment is no import\nfn f() -> &'static str { \"crate::top\" }\n");
        write("feature.rs", "//! feature\nuse crate::core::f;\n");
        write("top.rs", "//! top\nuse crate::{core::f, feature};\npub struct Backend;\n");
        write("tests/mod.rs", "//! tests\nuse crate::top::Backend;\n");
        let clean = import_cycles(&src, "offload-cuda");
        assert!(clean.is_empty(), "{clean:?}");
        write("core.rs", "//! core\nuse crate::{feature::g, x};\n");
        let p = import_cycles(&src, "offload-cuda").join("\n");
        assert!(p.contains("core → feature → core"), "{p}");
        write("core.rs", "//! core\nmacro_rules! m { () => { fn f() -> $crate::Backend { todo!() } } }\n");
        assert!(import_cycles(&src, "offload-cuda").is_empty(), "a macro's `$crate::` path taken for an import");
        write("core.rs", "//! core\nfn f() -> crate::Backend { todo!() }\n");
        let p = import_cycles(&src, "offload-cuda").join("\n");
        assert!(p.contains("core → lib → core"), "{p}");
        // A module's tests (an inline test module, a sibling `tests.rs`) may use
        // any module: they are callers, not layers. The code above them is not.
        write("core.rs", "//! core\nfn f() {}\n#[cfg(all(test, feature = \"sim\"))]\nmod tests {\n    use crate::top::Backend;\n}\n");
        std::fs::create_dir_all(src.join("feature")).expect("temp dir");
        write("feature/tests.rs", "use crate::top::Backend;\n");
        let clean = import_cycles(&src, "offload-cuda");
        assert!(clean.is_empty(), "{clean:?}");
        write("core.rs", "//! core\nuse crate::top::Backend;\n#[cfg(test)]\nmod tests {}\n");
        let p = import_cycles(&src, "offload-cuda").join("\n");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(p.contains("core → top → core"), "{p}");
    }

    /// A library function over the limit is named, in Rust and in Python; tests
    /// and short functions are not.
    #[test]
    fn long_functions_are_caught() {
        let body = |n: usize| (0..n).map(|i| format!("    let x{i} = {i};\n")).collect::<String>();
        let rust = format!("//! m\nfn short() {{\n{}}}\nfn long() {{\n{}}}\ntrait T {{ fn decl(&self); }}\n", body(10), body(160));
        let found = rust_functions(&rust);
        assert!(found.iter().any(|(n, line, len)| n == "long" && *line == 14 && *len == 162), "{found:?}");
        assert!(found.iter().any(|(n, _, len)| n == "short" && *len == 12), "{found:?}");
        assert!(!found.iter().any(|(n, _, _)| n == "decl"), "{found:?}");
        let tested = format!("//! m\nfn f() {{}}\n#[cfg(test)]\nmod tests {{\n    fn long() {{\n{}    }}\n}}\n", body(160));
        assert!(rust_functions(&tested).iter().all(|(n, _, _)| n != "long"), "a test module's function counted");
        let py = format!("def f(\n    a,\n):\n{}\n    return a\n\nclass C:\n    def g(self):\n        pass\n", "    x = 1\n".repeat(151));
        let found = python_functions(&py);
        assert!(found.iter().any(|(n, line, len)| n == "f" && *line == 1 && *len == 156), "{found:?}");
        assert!(found.iter().any(|(n, _, len)| n == "g" && *len == 2), "{found:?}");
        let dir = std::env::temp_dir().join(format!("offload-tidy-long-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("offload-core/src")).unwrap();
        std::fs::write(dir.join("offload-core/src/lib.rs"), &rust).unwrap();
        let p = long_functions(&dir).join("\n");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(p.contains("offload-core/src/lib.rs:14: function `long` is 162 lines"), "{p}");
    }

    /// The engine's crates and every device backend are checked for cycles.
    #[test]
    fn the_layered_crates_include_the_core_and_every_backend() {
        for krate in ["offload-core", "offload-cuda", "offload-tch", "offload-vulkan"] {
            assert!(LAYERED.contains(&krate), "{krate} is not checked for import cycles");
        }
    }
}
