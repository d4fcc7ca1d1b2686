//! Documentation truth, checked by `cargo test -p xtask`: every results path that
//! `README.md`, `ARCHITECTURE.md` and `docs/*.md` name (`bench/results/…`,
//! `bench/raw/…`, `bench/registry-check/…`, `bench/NOTES.md`) exists and is written
//! out in full, and every figure the prose quotes in a paragraph (or list item, or
//! table row) that names a results file is in one of the files that paragraph
//! names, at the precision quoted and with the sign written (`−6.7 %` is not 6.7).
//!
//! A figure is a number with a unit (`1.004 ×`, `0.290 s`, `8 ms`, `1.87 GB/s`,
//! `22.05 GiB`, `6.7 %`, `2.65 bits`, `16 threads`), a number after `≈`, or a
//! number in a range (`0.985–1.000 ×`) or a spread (`[1.12, 1.98]`) beside such a
//! figure. It is found in a file when one of the file's numbers, rounded to the
//! quoted number of decimals, reads the same: as it is, or converted the ways the
//! docs quote files' numbers (bytes as GiB, MiB, GB or MB; seconds as ms or min; a
//! ratio as a percent, or as its distance from 1 in percent). The README's
//! generated block (`report.rs` checks it against the files), fenced code and
//! inline code are not prose; version numbers, dates, hashes and names are not
//! figures.

use crate::report::{README_END, README_START};
use std::path::{Path, PathBuf};

/// Where the results paths the docs name live.
const RESULTS_ROOTS: [&str; 4] = ["bench/results/", "bench/raw/", "bench/registry-check/", "bench/NOTES.md"];

/// A figure's unit: how a file's number may have been converted to be quoted.
#[derive(Clone, Copy, Debug, PartialEq)]
enum Unit {
    /// As it is: a ratio (`×`), a number after `≈`, GB/s, bits, threads.
    Plain,
    Percent,
    Seconds,
    Millis,
    Minutes,
    GiB,
    MiB,
    Gb,
    Mb,
}

/// The units a figure may carry, longest first where one begins another.
const UNITS: [(&str, Unit); 12] = [
    ("GB/s", Unit::Plain),
    ("GiB", Unit::GiB),
    ("MiB", Unit::MiB),
    ("GB", Unit::Gb),
    ("MB", Unit::Mb),
    ("ms", Unit::Millis),
    ("min", Unit::Minutes),
    ("s", Unit::Seconds),
    ("%", Unit::Percent),
    ("×", Unit::Plain),
    ("bits", Unit::Plain),
    ("threads", Unit::Plain),
];

/// A quoted figure: its digits as written (no sign), its unit, and its sign
/// where one is written (`+6.7 %`: positive, `−6.7 %`: negative).
#[derive(Clone, Debug, PartialEq)]
struct Figure {
    digits: String,
    unit: Unit,
    negative: Option<bool>,
}

impl Unit {
    /// Whether a JSON number under `key` (its object keys joined by `.`,
    /// lowercased) can be a figure of this unit: a time only under a key that
    /// names one (`step_streamed_s`, `start_s.median`, not a rate such as
    /// `h2d_gb_per_s`), a size under one that names bytes (`streamed_bytes`,
    /// `bytes_per_step`, not `h2d_bytes_per_s` or `bytes_per_weight`); a number
    /// of a text file (no key) can be any.
    fn fits(self, key: Option<&str>) -> bool {
        let Some(k) = key else { return true };
        let any = |f: &dyn Fn(&str) -> bool| k.split('.').any(f);
        let rate = |s: &str| s.contains("_per_s") && !s.contains("_per_step");
        match self {
            Unit::Seconds | Unit::Millis | Unit::Minutes => any(&|s| {
                !rate(s)
                    && (s.ends_with("_s")
                        || s.contains("_s_")
                        || s.ends_with("_ms")
                        || s.contains("second")
                        || s.ends_with("_time")
                        || s.contains("time_s"))
            }),
            Unit::GiB | Unit::MiB | Unit::Gb | Unit::Mb => any(&|s| {
                (s.contains("bytes") && !rate(s) && !s.contains("per_weight"))
                    || ["_gib", "_mib", "_gb", "_mb"].iter().any(|u| s.ends_with(u))
            }),
            Unit::Plain | Unit::Percent => true,
        }
    }
}

impl Figure {
    /// Whether one of `numbers` whose key fits the unit ([`Unit::fits`]),
    /// converted as `unit` allows, reads as `digits`.
    fn found_in(&self, numbers: &[(f64, Option<String>)]) -> bool {
        let decimals = self.digits.split_once('.').map_or(0, |(_, d)| d.len());
        numbers.iter().filter(|(_, key)| self.unit.fits(key.as_deref())).any(|&(v, _)| {
            let ways: &[f64] = &match self.unit {
                Unit::Plain | Unit::Seconds => vec![v],
                Unit::Percent => vec![v, v * 100.0, (v - 1.0) * 100.0],
                Unit::Millis => vec![v, v * 1e3],
                Unit::Minutes => vec![v, v / 60.0],
                Unit::GiB => vec![v, v / (1u64 << 30) as f64],
                Unit::MiB => vec![v, v / (1u64 << 20) as f64],
                Unit::Gb => vec![v, v / 1e9],
                Unit::Mb => vec![v, v / 1e6],
            };
            // A written sign must be the number's own (a figure without one reads either way).
            let signed = |w: f64| self.negative.is_none_or(|neg| (w < 0.0) == neg);
            ways.iter().any(|&w| w.is_finite() && signed(w) && format!("{:.*}", decimals, w.abs()) == self.digits)
        })
    }
}

fn repo_root() -> PathBuf {
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("the workspace root").to_path_buf();
    unpack_raw(&root);
    root
}

/// The raw runs unpacked into `bench/raw/` from their archive (`bench/raw.sh`),
/// once a process; a failure to unpack panics here, naming the script.
fn unpack_raw(root: &Path) {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        let s = std::process::Command::new("bash").arg(root.join("bench/raw.sh")).status().expect("bash runs bench/raw.sh");
        assert!(s.success(), "bench/raw.sh could not unpack bench/raw.tar.gz ({s})");
    });
}

/// The raw runs the published results files (`bench/results/*.json`, not the
/// archived ones) cite that are not in `bench/raw/`, and how many they cite: each
/// `bench/raw/…` path among a file's strings, and each name of a `raw` list in
/// the directory its `raw_dir` names.
fn cited_raw_runs(root: &Path) -> (usize, Vec<String>) {
    let (mut cited, mut faults) = (0, Vec::new());
    let mut files: Vec<PathBuf> = std::fs::read_dir(root.join("bench/results"))
        .map(|d| d.flatten().map(|e| e.path()).filter(|p| p.extension().is_some_and(|x| x == "json")).collect())
        .unwrap_or_default();
    files.sort();
    for f in files {
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        let Ok(v) = std::fs::read_to_string(&f)
            .map_err(|e| e.to_string())
            .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).map_err(|e| e.to_string()))
        else {
            faults.push(format!("bench/results/{name} cannot be read as JSON"));
            continue;
        };
        let mut paths = Vec::new();
        strings(&v, &mut |s| {
            if s.starts_with("bench/raw/") {
                paths.push(s.to_owned());
            }
        });
        if let (Some(dir), Some(list)) = (v.get("raw_dir").and_then(|d| d.as_str()), v.get("raw").and_then(|r| r.as_array())) {
            paths.extend(list.iter().filter_map(|n| n.as_str()).map(|n| format!("{}/{n}", dir.trim_end_matches('/'))));
        } else if v.get("raw").is_some() {
            faults.push(format!("bench/results/{name} lists its raw runs without `raw_dir`, the directory that holds them"));
        }
        for p in paths {
            cited += 1;
            // A string may name a run's directory (`raw_dir`); the rest name files.
            let dir = v.get("raw_dir").and_then(|d| d.as_str()) == Some(p.as_str());
            let kept = if dir { root.join(&p).is_dir() } else { root.join(&p).is_file() };
            if !kept {
                faults.push(format!("bench/results/{name} cites `{p}`, which is not in bench/raw (bench/raw.tar.gz)"));
            }
        }
    }
    (cited, faults)
}

/// Every string of `v`, depth first.
fn strings(v: &serde_json::Value, f: &mut dyn FnMut(&str)) {
    match v {
        serde_json::Value::String(s) => f(s),
        serde_json::Value::Array(a) => a.iter().for_each(|x| strings(x, f)),
        serde_json::Value::Object(o) => o.values().for_each(|x| strings(x, f)),
        _ => {}
    }
}

/// The documents checked: README.md, ARCHITECTURE.md and docs/*.md, by name.
fn documents(root: &Path) -> Vec<(String, String)> {
    let mut names = vec!["README.md".to_owned(), "ARCHITECTURE.md".to_owned()];
    if let Ok(dir) = std::fs::read_dir(root.join("docs")) {
        let mut md: Vec<String> =
            dir.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.ends_with(".md")).collect();
        md.sort();
        names.extend(md.into_iter().map(|n| format!("docs/{n}")));
    }
    names
        .into_iter()
        .map(|n| {
            let text = std::fs::read_to_string(root.join(&n)).unwrap_or_else(|e| panic!("{n}: {e}"));
            (n, text)
        })
        .collect()
}

fn is_path_char(c: char) -> bool {
    c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-' | '/')
}

/// The results paths `text` names, in order (a name followed by `<`, `*` or `{`
/// is a pattern, not a path).
fn named_paths(text: &str) -> Vec<String> {
    let mut found: Vec<(usize, String)> = Vec::new();
    for root in RESULTS_ROOTS {
        for (at, _) in text.match_indices(root) {
            if text[..at].chars().next_back().is_some_and(is_path_char) {
                continue;
            }
            let rest = &text[at..];
            let end = rest.find(|c: char| !is_path_char(c)).unwrap_or(rest.len());
            if rest[end..].starts_with(['<', '*', '{']) {
                continue;
            }
            found.push((at, rest[..end].trim_end_matches(['.', ',']).to_owned()));
        }
    }
    found.sort();
    found.into_iter().map(|(_, p)| p).collect()
}

/// Inline code that stands for a path without writing it (`…-07aeb66/`): it
/// cannot be checked, so it is refused.
fn abbreviated_paths(text: &str) -> Vec<String> {
    text.split('`').skip(1).step_by(2).filter(|code| code.starts_with('…')).map(|code| format!("`{code}`")).collect()
}

/// `text` without the README's generated block and fenced code: those lines
/// blanked, so paragraphs keep their breaks.
fn prose(text: &str) -> String {
    let (mut generated, mut fence) = (false, false);
    let mut out = String::with_capacity(text.len());
    for line in text.lines() {
        let t = line.trim_start();
        generated |= t.starts_with(README_START);
        let skip = generated || fence || t.starts_with("```");
        fence ^= t.starts_with("```");
        if t.starts_with(README_END) {
            generated = false;
        }
        if !skip {
            out.push_str(line);
        }
        out.push('\n');
    }
    out
}

/// Prose in units a sentence cannot cross: paragraphs, each table row, each
/// heading and each list item, lines joined.
fn units(prose: &str) -> Vec<String> {
    let mut units = Vec::new();
    let mut cur = String::new();
    for line in prose.lines() {
        let t = line.trim();
        let item = t.starts_with("- ") || t.starts_with("* ") || t.split_once(". ").is_some_and(|(n, _)| n.parse::<u32>().is_ok());
        if t.is_empty() || t.starts_with('|') || t.starts_with('#') || item {
            if !cur.is_empty() {
                units.push(std::mem::take(&mut cur));
            }
            if t.starts_with('|') || t.starts_with('#') {
                units.push(t.to_owned());
                continue;
            }
        }
        if !t.is_empty() {
            if !cur.is_empty() {
                cur.push(' ');
            }
            cur.push_str(t);
        }
    }
    if !cur.is_empty() {
        units.push(cur);
    }
    units
}

/// The sentences of a unit: each ends at a full stop (outside inline code)
/// followed by a space and a capital, `(`, `` ` `` or `*`; not after `e.g.`/`i.e.`.
fn sentences(unit: &str) -> Vec<&str> {
    let mut out = Vec::new();
    let (mut start, mut code) = (0, false);
    for (i, c) in unit.char_indices() {
        match c {
            '`' => code = !code,
            '.' if !code && !unit[..=i].ends_with("e.g.") && !unit[..=i].ends_with("i.e.") => {
                let rest = &unit[i + 1..];
                let next = rest.trim_start().chars().next();
                if rest.starts_with(' ') && next.is_some_and(|n| n.is_uppercase() || matches!(n, '(' | '`' | '*')) {
                    out.push(&unit[start..=i]);
                    start = i + 1;
                }
            }
            _ => {}
        }
    }
    if start < unit.len() {
        out.push(&unit[start..]);
    }
    out
}

/// `sentence` with its inline code blanked.
fn without_code(sentence: &str) -> String {
    sentence.split('`').enumerate().map(|(k, part)| if k % 2 == 0 { part } else { " " }).collect()
}

/// An unsigned decimal number starting at byte `at` of `s`: its digits and its end,
/// if it stands alone (not part of a name, a date, a hash or a version).
fn number_at(s: &str, at: usize) -> Option<(&str, usize)> {
    let prev = s[..at].chars().next_back();
    if prev.is_some_and(|p| p.is_alphanumeric() || matches!(p, '_' | '.' | '-' | '/' | '=' | '^' | '<' | '·')) {
        return None;
    }
    let int = s[at..].find(|c: char| !c.is_ascii_digit()).map_or(s.len(), |n| at + n);
    if int == at {
        return None;
    }
    let mut end = int;
    if s[int..].starts_with('.') && s[int + 1..].starts_with(|c: char| c.is_ascii_digit()) {
        end = s[int + 1..].find(|c: char| !c.is_ascii_digit()).map_or(s.len(), |n| int + 1 + n);
    }
    let next = s[end..].chars().next();
    let after = s[end..].chars().nth(1);
    let glued = next.is_some_and(|c| c.is_alphanumeric() || matches!(c, '_' | '²' | '³' | '/'));
    let version_or_date = matches!(next, Some('.' | '-' | ':')) && after.is_some_and(|c| c.is_ascii_digit());
    (!glued && !version_or_date).then_some((&s[at..end], end))
}

/// The unit right after byte `at` (spaces skipped), and where it ends.
fn unit_at(s: &str, at: usize) -> Option<(Unit, usize)> {
    let rest = s[at..].trim_start_matches([' ', '\u{a0}', '\u{202f}', '\u{2009}']);
    let from = s.len() - rest.len();
    UNITS.iter().find_map(|&(name, unit)| {
        let tail = rest.strip_prefix(name)?;
        let word = name.chars().all(char::is_alphabetic);
        (!word || !tail.starts_with(char::is_alphanumeric)).then_some((unit, from + name.len()))
    })
}

/// The figures quoted in `text` (inline code already blanked).
fn figures(text: &str) -> Vec<Figure> {
    let mut out = Vec::new();
    let mut at = 0;
    while let Some((start, digits, mut end)) =
        text[at..].char_indices().find_map(|(k, _)| number_at(text, at + k).map(|(d, e)| (at + k, d, e)))
    {
        // A range: `a–b unit` gives both the unit.
        let mut group = vec![digits.to_owned()];
        while let Some(rest) = text[end..].strip_prefix('–') {
            match number_at(text, text.len() - rest.len()) {
                Some((d, e)) => {
                    group.push(d.to_owned());
                    end = e;
                }
                None => break,
            }
        }
        let approx = text[..start].trim_end().ends_with('≈');
        let unit = unit_at(text, end).or(approx.then_some((Unit::Plain, end)));
        if let Some((unit, mut next)) = unit {
            // A spread right after it: `[min, max]` in the same unit.
            let rest = text[next..].trim_start();
            if let Some(inner) = rest.strip_prefix('[').and_then(|r| r.split_once(']')).map(|(i, _)| i) {
                let nums: Vec<&str> = inner.split(',').map(str::trim).collect();
                if nums.iter().all(|n| number_at(n, 0).is_some_and(|(d, e)| d == *n && e == n.len())) {
                    group.extend(nums.iter().map(|n| (*n).to_owned()));
                    next = text.len() - rest.len() + inner.len() + 2;
                }
            }
            let negative = match text[..start].chars().next_back() {
                Some('−') => Some(true),
                Some('+') => Some(false),
                _ => None,
            };
            // A range or spread is read as its members are written: the sign, of the first only.
            out.extend(group.into_iter().enumerate().map(|(k, digits)| Figure { digits, unit, negative: negative.filter(|_| k == 0) }));
            end = next;
        }
        at = end;
    }
    out
}

/// Every number in a results file: a JSON file's numeric values, each with its
/// key (the object keys above it joined by `.`, lowercased), or every decimal
/// number in a text file (no key).
fn file_numbers(path: &Path) -> Result<Vec<(f64, Option<String>)>, String> {
    let text = std::fs::read_to_string(path).map_err(|e| e.to_string())?;
    if path.extension().is_some_and(|e| e == "json") {
        fn walk(v: &serde_json::Value, key: &str, out: &mut Vec<(f64, Option<String>)>) {
            match v {
                serde_json::Value::Number(n) => out.extend(n.as_f64().map(|x| (x, Some(key.to_owned())))),
                serde_json::Value::Array(a) => a.iter().for_each(|x| walk(x, key, out)),
                serde_json::Value::Object(o) => o.iter().for_each(|(k, x)| walk(x, &format!("{key}.{}", k.to_lowercase()), out)),
                _ => {}
            }
        }
        let doc: serde_json::Value = serde_json::from_str(&text).map_err(|e| e.to_string())?;
        let mut out = Vec::new();
        walk(&doc, "", &mut out);
        return Ok(out);
    }
    let mut out = Vec::new();
    let mut rest = text.as_str();
    while let Some(k) = rest.find(|c: char| c.is_ascii_digit()) {
        let tail = &rest[k..];
        let n = tail.find(|c: char| !(c.is_ascii_digit() || c == '.')).unwrap_or(tail.len());
        out.extend(tail[..n].trim_end_matches('.').parse::<f64>().ok().map(|x| (x, None)));
        rest = &tail[n..];
    }
    Ok(out)
}

/// Paths that `text` names and that do not exist under `root`, and how many it names.
fn check_paths(root: &Path, name: &str, text: &str) -> (usize, Vec<String>) {
    let paths = named_paths(text);
    let mut faults: Vec<String> =
        paths.iter().filter(|p| !root.join(p).exists()).map(|p| format!("{name} names `{p}`, which does not exist")).collect();
    faults.extend(abbreviated_paths(text).into_iter().map(|a| format!("{name} abbreviates a path as {a}: write it in full")));
    (paths.len(), faults)
}

/// Figures quoted in `text`'s prose in a sentence naming a results file that are
/// in none of the files the sentence names, and how many figures were checked.
fn check_figures(root: &Path, name: &str, text: &str) -> (usize, Vec<String>) {
    let (mut checked, mut faults) = (0, Vec::new());
    for unit in units(&prose(text)) {
        // A figure is checked against the sources its paragraph (or list item, or
        // table row) names, whichever sentence names them: a sentence that names
        // none quotes those of its paragraph.
        let files: Vec<String> = named_paths(&unit).into_iter().filter(|p| !p.ends_with('/')).fold(Vec::new(), |mut v, p| {
            if !v.contains(&p) {
                v.push(p);
            }
            v
        });
        for sentence in sentences(&unit) {
            let quoted = figures(&without_code(sentence));
            if files.is_empty() || quoted.is_empty() {
                continue;
            }
            let mut numbers = Vec::new();
            for f in &files {
                match file_numbers(&root.join(f)) {
                    Ok(n) => numbers.extend(n),
                    Err(e) => faults.push(format!("{name} names `{f}`, which cannot be read: {e}")),
                }
            }
            for fig in quoted {
                checked += 1;
                if !fig.found_in(&numbers) {
                    faults.push(format!(
                        "{name}: {} ({:?}) is in none of {}, in: {}",
                        fig.digits,
                        fig.unit,
                        files.join(", "),
                        sentence.trim()
                    ));
                }
            }
        }
    }
    (checked, faults)
}

/// A line of Rust as the docs' excerpt check compares it: trimmed, and a doc
/// comment's `//!` or `///` taken off (an example in a doc comment is compiled
/// as a doctest).
fn code_line(line: &str) -> &str {
    let t = line.trim();
    t.strip_prefix("//!").or_else(|| t.strip_prefix("///")).map_or(t, str::trim)
}

/// A code block of the docs: the source file its paragraph names, and its lines.
type CodeBlock = (Option<String>, Vec<String>);

/// The languages whose blocks the docs quote from files the project runs: the
/// fence's word and the file's extension (Rust: compiled by the workspace; Python:
/// `offload-py`'s example, run by its tests).
const QUOTED: [(&str, &str); 2] = [("rust", ".rs"), ("python", ".py")];

/// The ```` ```LANG ```` blocks of `text`: each with the first `EXT` file named in
/// inline code in the paragraph just above it, and its non-blank lines. A fence
/// that says more than `LANG` (`rust,ignore`, `rust,no_run`) is a fault: the
/// block would not be checked.
fn code_blocks(text: &str, lang: &str, ext: &str) -> (Vec<CodeBlock>, Vec<String>) {
    let lines: Vec<&str> = text.lines().collect();
    let (mut blocks, mut faults) = (Vec::new(), Vec::new());
    let open = format!("```{lang}");
    let mut k = 0;
    while k < lines.len() {
        let fence = lines[k].trim();
        if !fence.starts_with(&open) || fence[open.len()..].starts_with(|c: char| c.is_alphanumeric()) {
            k += 1;
            continue;
        }
        if fence != open {
            faults.push(format!("line {}: a `{fence}` block is not checked; write `{lang}` and quote a file the project runs", k + 1));
        }
        // The paragraph above: past the blank lines, back to the blank line before it.
        let mut above = Vec::new();
        let mut j = k;
        while j > 0 && lines[j - 1].trim().is_empty() {
            j -= 1;
        }
        while j > 0 && !lines[j - 1].trim().is_empty() {
            j -= 1;
            above.insert(0, lines[j]);
        }
        let named = above.join(" ").split('`').skip(1).step_by(2).find(|c| c.ends_with(ext) && !c.contains(' ')).map(str::to_owned);
        let mut body = Vec::new();
        k += 1;
        while k < lines.len() && !lines[k].trim().starts_with("```") {
            if !lines[k].trim().is_empty() {
                body.push(code_line(lines[k]).to_owned());
            }
            k += 1;
        }
        blocks.push((named, body));
        k += 1;
    }
    (blocks, faults)
}

/// Every Rust and Python block of document `name` is a run of lines of the file
/// its paragraph names (a file the workspace compiles: an example, a library, a
/// doctest; a Python example the package's tests run), so what the docs show
/// compiles and runs. Returns the blocks checked and the faults.
fn check_excerpts(root: &Path, name: &str, text: &str) -> (usize, Vec<String>) {
    let mut checked = 0;
    let mut all = Vec::new();
    for (lang, ext) in QUOTED {
        let (blocks, mut faults) = code_blocks(text, lang, ext);
        faults.iter_mut().for_each(|f| *f = format!("{name}: {f}"));
        for (named, body) in &blocks {
            let first = body.first().map_or("(empty)", String::as_str);
            let Some(file) = named else {
                faults.push(format!("{name}: the {lang} block starting `{first}` names no `{ext}` file it is taken from"));
                continue;
            };
            let Ok(source) = std::fs::read_to_string(root.join(file)) else {
                faults.push(format!("{name}: `{file}` (named above the block starting `{first}`) does not exist"));
                continue;
            };
            let lines: Vec<&str> = source.lines().map(code_line).filter(|l| !l.is_empty()).collect();
            let found = !body.is_empty() && lines.windows(body.len()).any(|w| w.iter().zip(body).all(|(a, b)| a == b));
            if !found {
                faults.push(format!("{name}: the {lang} block starting `{first}` is not a run of lines of `{file}`"));
            }
        }
        checked += blocks.len();
        all.extend(faults);
    }
    (checked, all)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// `check` over every document of the repository: what it counted, and its faults.
    fn every_document(check: fn(&Path, &str, &str) -> (usize, Vec<String>)) -> (usize, Vec<String>) {
        let root = repo_root();
        documents(&root).iter().fold((0, Vec::new()), |(n, mut faults), (name, text)| {
            let (k, f) = check(&root, name, text);
            faults.extend(f);
            (n + k, faults)
        })
    }

    /// ARCHITECTURE.md names every crate of the workspace and every command
    /// `cargo xtask` has (the first word of each line of its help), and the
    /// README stays one screen.
    #[test]
    fn architecture_names_every_crate_and_command_and_the_readme_is_one_screen() {
        let root = repo_root();
        let arch = std::fs::read_to_string(root.join("ARCHITECTURE.md")).expect("ARCHITECTURE.md");
        let manifest = std::fs::read_to_string(root.join("Cargo.toml")).expect("Cargo.toml");
        let members = manifest.split("members = [").nth(1).and_then(|m| m.split(']').next()).expect("workspace members");
        let crates: Vec<&str> = members.split(',').map(|c| c.trim().trim_matches('"')).filter(|c| !c.is_empty()).collect();
        assert!(crates.len() >= 8, "{crates:?}");
        let missing: Vec<&&str> = crates.iter().filter(|c| !arch.contains(&format!("{c}/")) && !arch.contains(&format!("`{c}`"))).collect();
        assert!(missing.is_empty(), "ARCHITECTURE.md does not name the crates {missing:?}");
        let help = std::fs::read_to_string(root.join("xtask/src/main.rs")).expect("main.rs");
        let help = help.split("const HELP: &str = \"").nth(1).and_then(|h| h.split("\";").next()).expect("xtask's help");
        let commands: Vec<&str> = help
            .lines()
            .filter(|l| l.starts_with("  ") && l.chars().nth(2).is_some_and(|c| c.is_ascii_lowercase()))
            .filter_map(|l| l.split_whitespace().next())
            .collect();
        assert!(commands.len() >= 9, "{commands:?}");
        let line = arch.lines().find(|l| l.contains("xtask/src/main.rs")).expect("ARCHITECTURE.md's xtask line");
        let unnamed: Vec<&&str> = commands.iter().filter(|c| !line.contains(&format!("`{c}`"))).collect();
        assert!(unnamed.is_empty(), "ARCHITECTURE.md's xtask line does not name {unnamed:?}: {line}");
        let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md").lines().count();
        assert!(readme <= 100, "README.md is {readme} lines: tables beyond the headline go to docs/results.md");
    }

    /// Every raw run a published results file cites is kept (in
    /// `bench/raw.tar.gz`); a file citing one that is not fails, by name.
    #[test]
    fn every_raw_run_a_published_result_cites_is_kept() {
        let root = repo_root();
        let (cited, faults) = cited_raw_runs(&root);
        assert!(faults.is_empty(), "{}", faults.join("\n"));
        assert!(cited >= 90, "only {cited} raw runs cited by the results files: the scan broke");
        let dir = std::env::temp_dir().join(format!("offload-cited-raw-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("bench/results")).unwrap();
        std::fs::create_dir_all(dir.join("bench/raw/2026-01-01-x")).unwrap();
        std::fs::write(dir.join("bench/raw/2026-01-01-x/r1.json"), "{}").unwrap();
        let write = |text: &str| std::fs::write(dir.join("bench/results/2026-01-01-x.json"), text).unwrap();
        write(r#"{"runs": ["bench/raw/2026-01-01-x/r1.json"], "raw_dir": "bench/raw/2026-01-01-x", "raw": ["r1.json"]}"#);
        assert_eq!(cited_raw_runs(&dir), (3, Vec::new()));
        write(r#"{"cases": [{"runs": ["bench/raw/2026-01-01-x/r1.json", "bench/raw/2026-01-01-x/r2.json"]}]}"#);
        let (_, faults) = cited_raw_runs(&dir);
        assert!(faults.len() == 1 && faults[0].contains("r2.json"), "{faults:?}");
        write(r#"{"raw_dir": "bench/raw/2026-01-01-x", "raw": ["r3.json"]}"#);
        let (_, faults) = cited_raw_runs(&dir);
        assert!(faults.len() == 1 && faults[0].contains("r3.json"), "{faults:?}");
        write(r#"{"raw": ["r1.json"]}"#);
        let (_, faults) = cited_raw_runs(&dir);
        let _ = std::fs::remove_dir_all(&dir);
        assert!(faults.len() == 1 && faults[0].contains("without `raw_dir`"), "{faults:?}");
    }

    #[test]
    fn every_results_path_the_docs_name_exists() {
        let (named, faults) = every_document(check_paths);
        assert!(faults.is_empty(), "{}", faults.join("\n"));
        // The README names a score of results files and runs: finding none means the scan broke.
        assert!(named >= 20, "only {named} results paths found in the docs");
    }

    #[test]
    fn every_figure_quoted_beside_a_results_file_is_in_it() {
        let (checked, faults) = every_document(check_figures);
        assert!(faults.is_empty(), "{}", faults.join("\n"));
        // The README's prose quotes at least the coded size, the encode rate, the
        // disk tier's rates and the Vulkan ratios beside their files.
        assert!(checked >= 10, "only {checked} figures checked");
    }

    #[test]
    fn every_rust_block_in_the_docs_is_taken_from_a_compiled_file() {
        let (checked, faults) = every_document(check_excerpts);
        assert!(faults.is_empty(), "{}", faults.join("\n"));
        // The README's example and the guide's: raw CUDA, candle, tch, Vulkan, the tiers, the coded file.
        assert!(checked >= 8, "only {checked} Rust blocks found in the docs");
    }

    #[test]
    fn a_block_not_in_its_file_or_naming_none_fails() {
        let dir = scratch("excerpts");
        std::fs::create_dir_all(dir.join("examples")).unwrap();
        std::fs::write(dir.join("examples/a.rs"), "fn main() {\n    //! doc\n    let x = 1;\n    let y = x + 1;\n}\n").unwrap();
        let good = "From `examples/a.rs`:\n\n```rust\nlet x = 1;\n\n  let y = x + 1;\n```\n";
        assert_eq!(check_excerpts(&dir, "d.md", good), (1, vec![]));
        std::fs::write(dir.join("examples/a.py"), "def main():\n    x = 1\n    y = x + 1\n").unwrap();
        let good_py = "From `examples/a.py`:\n\n```python\nx = 1\ny = x + 1\n```\n";
        assert_eq!(check_excerpts(&dir, "d.md", good_py), (1, vec![]));
        for (bad, fault) in [
            ("From `examples/a.rs`:\n\n```rust\nlet x = 2;\n```\n", "not a run of lines"),
            ("From `examples/a.rs`:\n\n```rust\nlet y = x + 1;\nlet x = 1;\n```\n", "not a run of lines"),
            ("No file:\n\n```rust\nlet x = 1;\n```\n", "names no `.rs` file"),
            ("From `examples/b.rs`:\n\n```rust\nlet x = 1;\n```\n", "does not exist"),
            ("From `examples/a.rs`:\n\n```rust,ignore\nlet x = 1;\n```\n", "is not checked"),
            ("From `examples/a.py`:\n\n```python\nx = 2\n```\n", "not a run of lines"),
            ("No file:\n\n```python\nx = 1\n```\n", "names no `.py` file"),
        ] {
            let (_, faults) = check_excerpts(&dir, "d.md", bad);
            assert!(faults.iter().any(|f| f.contains(fault)), "{bad:?}: {faults:?}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }

    /// A temporary repository with one results file.
    fn scratch(tag: &str) -> PathBuf {
        let dir = std::env::temp_dir().join(format!("offload-docs-check-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("bench/results")).unwrap();
        std::fs::create_dir_all(dir.join("bench/raw")).unwrap();
        let doc = serde_json::json!({"ratio": 0.9123, "bytes": 1_487_575_168u64, "start_s": {"median": 57.35003, "min": 54.66, "max": 59.56},
            "off": 1.067, "gbps": 1.866, "h2d_gb_per_s": 3.21, "bytes_per_weight": 1.0625, "rows": [{"step_s": 0.0124}], "commit": "3980ca5", "version": "0.42.1"});
        std::fs::write(dir.join("bench/results/x.json"), doc.to_string()).unwrap();
        std::fs::write(dir.join("bench/results/y.txt"), "step 0.290 s, 12 blocks\n").unwrap();
        dir
    }

    #[test]
    fn a_figure_not_in_its_file_or_a_missing_file_fails() {
        let root = scratch("figures");
        let good = "Intro.\n\nMeasured (`bench/results/x.json`): 0.912 × and 1.39 GiB, 57.4 s [54.7, 59.6], +6.7 %, 12.4 ms,\n\
                    1.87 GB/s, ≈ 0.91 of it, 0.912–1.067 ×; diffusers 0.42.1 at 3980ca5 on 2026-12-01, d=1, 1024², bf16.\n\n\
                    A step of 0.290 s (`bench/results/y.txt`).\n\nElsewhere 9.999 × and `7.777 ×` with no file named.\n";
        let (n, faults) = check_figures(&root, "doc", good);
        assert!(faults.is_empty(), "{faults:?}");
        assert_eq!(n, 12, "figures checked");
        for (from, to) in [
            ("0.912 ×", "0.913 ×"),
            ("1.39 GiB", "1.38 GiB"),
            ("59.6]", "59.7]"),
            ("+6.7 %", "+6.8 %"),
            ("+6.7 %", "−6.7 %"),
            ("0.290 s", "0.291 s"),
        ] {
            let bad = good.replacen(from, to, 1);
            let (_, faults) = check_figures(&root, "doc", &bad);
            assert_eq!(faults.len(), 1, "{to}: {faults:?}");
            assert!(faults[0].contains(to.split(' ').next().unwrap().trim_end_matches(']')), "{faults:?}");
        }
        // A JSON number counts for a time or a size only under a key that names one:
        // 1.067 (`off`) is no time, 57.35 (`start_s`) no size; in a text file any number counts.
        for (bad, figure) in [("1.067 s", "1.067"), ("57.4 GiB", "57.4"), ("1.87 GB", "1.87"), ("3.21 s", "3.21"), ("1.0625 GB", "1.0625")]
        {
            let (n, faults) = check_figures(&root, "doc", &format!("Measured (`bench/results/x.json`): {bad}."));
            assert!(n == 1 && faults.len() == 1 && faults[0].contains(figure), "{bad}: {faults:?}");
        }
        let (n, faults) = check_figures(&root, "doc", "Measured (`bench/results/y.txt`): 12 s.");
        assert!(n == 1 && faults.is_empty(), "{faults:?}");
        // A sentence that names no file quotes those its paragraph names.
        let (n, faults) = check_figures(&root, "doc", "Measured (`bench/results/y.txt`). A step of 0.291 s, another of 0.290 s.");
        assert!(n == 2 && faults.len() == 1 && faults[0].contains("0.291"), "{faults:?}");
        // The same figures in the generated block, in code or in a paragraph naming no file are not checked.
        let outside =
            format!("{README_START}\n\n(`bench/results/x.json`) 5.555 ×\n\n{README_END}\n\n```\n`bench/results/x.json` 5.555 ×\n```\n");
        assert_eq!(check_figures(&root, "doc", &outside), (0, vec![]));
        // A file that is not there: named, and its figures cannot pass.
        let (_, faults) = check_figures(&root, "doc", "Gone (`bench/results/z.json`): 1.000 ×.");
        assert!(faults.iter().any(|f| f.contains("cannot be read")) && faults.iter().any(|f| f.contains("1.000")), "{faults:?}");
        let (n, faults) = check_paths(&root, "doc", "See `bench/results/x.json`, `bench/results/z.json` and `bench/raw/`; `…-07aeb66/`.");
        assert_eq!(n, 3);
        assert!(faults.len() == 2 && faults[0].contains("bench/results/z.json") && faults[1].contains("…-07aeb66/"), "{faults:?}");
        let _ = std::fs::remove_dir_all(&root);
    }

    #[test]
    fn sentences_and_units_split_where_prose_does() {
        let u = units("One (`a. B`). Two e.g. This.\nStill two.\n\n| a | 1 |\n| b | 2 |\n- item one\n- item two\n");
        assert_eq!(u, ["One (`a. B`). Two e.g. This. Still two.", "| a | 1 |", "| b | 2 |", "- item one", "- item two"]);
        assert_eq!(sentences(&u[0]), ["One (`a. B`).", " Two e.g. This.", " Still two."]);
        let f = figures("26–29 minutes, 3 s step, 0.3 seconds, 22 GiB, H200, v1.2, 16 threads, 8 steps");
        let digits: Vec<&str> = f.iter().map(|f| f.digits.as_str()).collect();
        assert_eq!(digits, ["3", "22", "16"]);
    }
}
