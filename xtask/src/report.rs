//! `cargo xtask bench --report`: the committed `bench/results/*.json` as a Markdown
//! table (`bench/REPORT.md`) and PNG plots (`bench/plots/`).

use plotters::prelude::*;
use serde_json::Value;
use std::fmt::Write;
use std::path::Path;

mod tables;
pub use tables::*;

/// One row: a measured run.
struct Row {
    file: String,
    label: String,
    /// The case as the tables name it (`1024²`, `512 tokens`).
    res: String,
    budget_gib: Option<f64>,
    resident_s: f64,
    step_s: f64,
    bound_s: f64,
    ratio: f64,
    predicted_s: Option<f64>,
    peak_gib: f64,
    bitwise: String,
}

/// GiB where the file holds a figure, NaN where it holds none (a figure the run
/// did not read is not zero: a table prints it as NaN, never as 0.00).
fn gib(v: &Value) -> f64 {
    v.as_f64().map_or(f64::NAN, |b| b / (1u64 << 30) as f64)
}

/// Device memory for weights: the bench room's `weights_device_bytes`, else the
/// older files' `peak_device_bytes`.
fn weights_or_peak(v: &Value) -> &Value {
    if v["weights_device_bytes"].is_number() {
        &v["weights_device_bytes"]
    } else {
        &v["peak_device_bytes"]
    }
}

fn rows(dir: &Path) -> Result<Vec<Row>, String> {
    let mut files: Vec<_> = std::fs::read_dir(dir).map_err(|e| format!("{}: {e}", dir.display()))?.flatten().map(|e| e.path()).collect();
    files.sort();
    let mut out = Vec::new();
    for f in files.iter().filter(|f| f.extension().is_some_and(|e| e == "json")) {
        let text = std::fs::read_to_string(f).map_err(|e| format!("{}: {e}", f.display()))?;
        let Ok(doc) = serde_json::from_str::<Value>(&text) else { continue };
        let (Some(cases), Some(backend)) = (doc["cases"].as_array(), doc["backend"].as_str()) else { continue };
        let name = f.file_name().map(|n| n.to_string_lossy().into_owned()).unwrap_or_default();
        for c in cases.iter().filter(|c| c["step_streamed_s"].is_number()) {
            let budget = c["budget_bytes"].as_f64().map(|b| b / (1u64 << 30) as f64);
            let depth = if c["depth"].is_null() { "resident while it runs".to_owned() } else { format!("d={}", c["depth"]) };
            let label = match (c["component"].as_str(), budget) {
                // The pipeline case: one row per component.
                (Some(comp), Some(b)) => format!("{backend} pipeline {comp} ({}) {b:.0} GiB {depth}", c["model"].as_str().unwrap_or("?")),
                (_, Some(b)) => format!("{backend} {b:.0} GiB d={}", c["depth"]),
                (_, None) => match c["model"].as_str() {
                    Some(m) => format!("{backend} {m} {} {}", c["case"].as_str().unwrap_or(""), depth_label(c)),
                    None => format!("{backend} d={}", c["depth"]),
                },
            };
            out.push(Row {
                file: name.clone(),
                label,
                res: row_case(c),
                budget_gib: budget,
                resident_s: c["step_resident_s"].as_f64().unwrap_or(f64::NAN),
                step_s: c["step_streamed_s"].as_f64().unwrap_or(f64::NAN),
                bound_s: c["bound_s"].as_f64().unwrap_or(f64::NAN),
                ratio: c["ratio_to_bound"].as_f64().unwrap_or(f64::NAN),
                predicted_s: c["predicted_step_s"].as_f64(),
                peak_gib: gib(weights_or_peak(c)),
                bitwise: c["bitwise_equal"].as_bool().map_or("–".into(), |b| if b { "yes".into() } else { "NO".into() }),
            });
        }
        for a in doc["anchors"].as_array().into_iter().flatten().filter(|a| a["step_streamed_s"].is_number()) {
            out.push(Row {
                file: name.clone(),
                label: match a["model"].as_str() {
                    Some(m) => format!("{} {m}", a["name"].as_str().unwrap_or("anchor")),
                    None => a["name"].as_str().unwrap_or("anchor").to_owned(),
                },
                res: row_case(a),
                budget_gib: None,
                resident_s: a["step_resident_s"].as_f64().unwrap_or(f64::NAN),
                step_s: a["step_streamed_s"].as_f64().unwrap_or(f64::NAN),
                bound_s: a["bound_s"].as_f64().unwrap_or(f64::NAN),
                ratio: a["ratio_to_bound"].as_f64().unwrap_or(f64::NAN),
                predicted_s: None,
                peak_gib: gib(weights_or_peak(a)),
                bitwise: "–".into(),
            });
        }
    }
    Ok(out)
}

fn e<E: std::fmt::Display>(x: E) -> String {
    x.to_string()
}

/// Horizontal bars of `values` (label, value), one a row with its label on the
/// left, so labels never overlap; a value that is not a number (a resident run
/// has no ratio) is left out, not drawn as a bar. A dashed reference line at `target`.
fn bars(path: &Path, title: &str, x_label: &str, values: &[(String, f64)], target: Option<(f64, &str)>) -> Result<(), String> {
    let values: Vec<&(String, f64)> = values.iter().filter(|v| v.1.is_finite()).collect();
    let height = 90 + 26 * values.len().max(1) as u32;
    let root = BitMapBackend::new(path, (1100, height)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let max = values.iter().map(|v| v.1).fold(target.map_or(0.0, |t| t.0), f64::max) * 1.12;
    let n = values.len().max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(380)
        .build_cartesian_2d(0f64..max.max(1e-9), 0f64..n)
        .map_err(e)?;
    chart.configure_mesh().disable_y_mesh().y_labels(0).x_desc(x_label).label_style(("sans-serif", 15)).draw().map_err(e)?;
    for (i, (label, v)) in values.iter().enumerate() {
        // The first value on top.
        let y = n - 1.0 - i as f64;
        let colour = if label.starts_with("diffusers") { RGBColor(214, 120, 60) } else { RGBColor(60, 110, 190) };
        chart.draw_series(std::iter::once(Rectangle::new([(0.0, y + 0.15), (*v, y + 0.85)], colour.filled()))).map_err(e)?;
        // Beside the bar, clear of the reference line.
        let at = v.max(target.map_or(0.0, |t| t.0)) + max * 0.008;
        chart.draw_series(std::iter::once(Text::new(format!("{v:.3}"), (at, y + 0.75), ("sans-serif", 14)))).map_err(e)?;
        let (px, py) = chart.backend_coord(&(0.0, y + 0.75));
        root.draw(&Text::new(label.clone(), (px - 372, py), ("sans-serif", 14))).map_err(e)?;
    }
    if let Some((t, name)) = target {
        chart
            .draw_series(DashedLineSeries::new(vec![(t, 0.0), (t, n)], 8, 6, RED.stroke_width(2)))
            .map_err(e)?
            .label(name)
            .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::LowerRight)
            .background_style(WHITE)
            .border_style(BLACK)
            .label_font(("sans-serif", 15))
            .draw()
            .map_err(e)?;
    }
    root.present().map_err(e)
}

/// The planner's runs: step and bound per device budget.
fn planner_plot(path: &Path, rows: &[&Row]) -> Result<(), String> {
    let root = BitMapBackend::new(path, (900, 520)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let max_b = rows.iter().filter_map(|r| r.budget_gib).fold(0.0, f64::max) + 2.0;
    let max_t = rows.iter().map(|r| r.step_s.max(r.bound_s)).fold(0.0, f64::max) * 1.2;
    let mut chart = ChartBuilder::on(&root)
        .caption("step time vs device budget (cuda, H200, 1024²)", ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(50)
        .y_label_area_size(70)
        .build_cartesian_2d(0f64..max_b, 0f64..max_t)
        .map_err(e)?;
    chart
        .configure_mesh()
        .x_desc("device budget for weights (GiB)")
        .y_desc("step (s)")
        .label_style(("sans-serif", 15))
        .draw()
        .map_err(e)?;
    let series = |f: &dyn Fn(&Row) -> Option<f64>| -> Vec<(f64, f64)> {
        let mut v: Vec<(f64, f64)> = rows.iter().filter_map(|r| Some((r.budget_gib?, f(r)?))).collect();
        v.sort_by(|a, b| a.0.total_cmp(&b.0));
        v
    };
    let measured = series(&|r| Some(r.step_s));
    let predicted = series(&|r| r.predicted_s);
    let bound = series(&|r| Some(r.bound_s));
    let resident = rows.first().map_or(0.0, |r| r.resident_s);
    chart
        .draw_series(measured.iter().map(|&(x, y)| Circle::new((x, y), 5, BLUE.filled())))
        .map_err(e)?
        .label("measured")
        .legend(|(x, y)| Circle::new((x + 10, y), 5, BLUE.filled()));
    chart
        .draw_series(predicted.iter().map(|&(x, y)| Cross::new((x, y), 6, GREEN.stroke_width(2))))
        .map_err(e)?
        .label("predicted (replay)")
        .legend(|(x, y)| Cross::new((x + 10, y), 6, GREEN));
    chart
        .draw_series(LineSeries::new(bound.clone(), BLACK.stroke_width(1)))
        .map_err(e)?
        .label("bound of the plan")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], BLACK));
    chart
        .draw_series(DashedLineSeries::new(vec![(0.0, resident), (max_b, resident)], 8, 6, RED.stroke_width(2)))
        .map_err(e)?
        .label("all resident")
        .legend(|(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], RED));
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperRight)
        .background_style(WHITE)
        .border_style(BLACK)
        .label_font(("sans-serif", 15))
        .draw()
        .map_err(e)?;
    root.present().map_err(e)
}

/// One case of the headline: our streamed step, the resident one, and
/// diffusers' offloaded modes on the same case, seconds (medians).
struct Headline {
    label: String,
    ours: f64,
    resident: f64,
    diffusers: Vec<(String, f64)>,
}

/// The GPU a results file was measured on, as its runs recorded it (the tables
/// name it from the file, never from what the bench room is usually lent).
fn gpu_of(d: &Value, file: &str) -> Result<String, String> {
    d["gpu"].as_str().filter(|g| !g.is_empty()).map(str::to_owned).ok_or_else(|| format!("{file}: no \"gpu\": which card measured it?"))
}

/// The README's headline, from the newest `*-zoo-tch.json` in `results` (the
/// file that holds every registry model with diffusers beside it): its file
/// name, a table (per case our streamed step beside diffusers' best offloaded
/// one and the resident step, as the file has them) and the cases for the plot.
fn headline(results: &Path) -> Result<(String, String, Vec<Headline>), String> {
    let newest = std::fs::read_dir(results)
        .map_err(|e| format!("{}: {e}", results.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("-zoo-tch") && n.ends_with(".json"));
    let newest = newest_of(newest, "zoo-tch file")?.ok_or("no *-zoo-tch*.json under bench/results")?;
    let d = read_json(&results.join(&newest))?;
    let mut md = String::new();
    let _ = writeln!(
        md,
        "Per model, one {}, bf16, medians of {} processes with [min, max] (`bench/results/{newest}`, backend `tch`; \
         the full tables, every backend and the other cases: [docs/results.md](docs/results.md)):\n",
        gpu_of(&d, &newest)?,
        d["repeats"]
    );
    md.push_str("| model | case | streamed, ours (s) | diffusers' best offloaded (s) | ours ÷ diffusers | resident (s) | weights on device, ours (GiB) | bitwise equal to resident |\n");
    md.push_str("| --- | --- | --- | --- | --- | --- | --- | --- |\n");
    let mut cases = Vec::new();
    for c in d["cases"].as_array().into_iter().flatten().filter(|c| c["judged"] != false && c["budget_bytes"].is_null()) {
        let (model, case) = (c["model"].as_str().unwrap_or("?"), case_label(c));
        // diffusers' best mode's own runs: median with [min, max], as the file has them.
        let best = d["anchors"].as_array().into_iter().flatten().find(|a| {
            a["model"] == c["model"] && a["case"] == c["case"] && a["mode"].as_str().is_some() && a["mode"] == c["anchor_best_mode"]
        });
        let anchor = match (best, c["anchor_best_mode"].as_str()) {
            (Some(a), Some(m)) => format!(
                "{:.3} [{:.3}, {:.3}] ({})",
                f(&a["step_streamed_s"]),
                f(&a["step_streamed_s_min"]),
                f(&a["step_streamed_s_max"]),
                m.replace('_', " ")
            ),
            _ => "–".into(),
        };
        let _ = writeln!(
            md,
            "| {model} | {case} | {:.3} [{:.3}, {:.3}] | {anchor} | {} | {:.3} [{:.3}, {:.3}] | {:.2} | {} |",
            f(&c["step_streamed_s"]),
            f(&c["step_streamed_s_min"]),
            f(&c["step_streamed_s_max"]),
            c["ratio_to_anchor_best"].as_f64().map_or("–".into(), |r| format!("{r:.3}")),
            f(&c["step_resident_s"]),
            f(&c["step_resident_s_min"]),
            f(&c["step_resident_s_max"]),
            gib(&c["weights_device_bytes"]),
            yes(&c["bitwise_equal"]),
        );
        let diffusers = d["anchors"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| a["model"] == c["model"] && a["case"] == c["case"] && a["mode"] != "resident")
            .filter_map(|a| Some((format!("diffusers {}", a["mode"].as_str()?.replace('_', " ")), a["step_streamed_s"].as_f64()?)))
            .collect();
        cases.push(Headline {
            label: format!("{model} {case}"),
            ours: f(&c["step_streamed_s"]),
            resident: f(&c["step_resident_s"]),
            diffusers,
        });
    }
    Ok((newest, md, cases))
}

/// The headline plot: per case, our streamed step beside diffusers' offloaded
/// modes and the resident step, as a multiple of our streamed step (shorter is
/// faster; every case on one scale), the seconds written beside each bar.
fn headline_plot(path: &Path, file: &str, cases: &[Headline]) -> Result<(), String> {
    let rows: usize = cases.iter().map(|c| 2 + c.diffusers.len()).sum::<usize>() + cases.len();
    let height = 110 + 17 * rows.max(1) as u32;
    let root = BitMapBackend::new(path, (1100, height)).into_drawing_area();
    root.fill(&WHITE).map_err(e)?;
    let max = cases
        .iter()
        .flat_map(|c| c.diffusers.iter().map(|d| d.1).chain([c.resident]).map(move |v| v / c.ours))
        .filter(|v| v.is_finite())
        .fold(1.0, f64::max)
        * 1.18;
    let n = rows.max(1) as f64;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("step time ÷ our streamed step, per model (H200; {file})"), ("sans-serif", 19))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(200)
        .build_cartesian_2d(0f64..max, 0f64..n)
        .map_err(e)?;
    chart
        .configure_mesh()
        .disable_y_mesh()
        .y_labels(0)
        .x_desc("× our streamed step (shorter is faster)")
        .label_style(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    let ours_colour = RGBColor(60, 110, 190);
    let resident_colour = RGBColor(150, 150, 150);
    let block_colour = RGBColor(240, 170, 110);
    let leaf_colour = RGBColor(200, 95, 40);
    let mut row = 0usize;
    for c in cases {
        let group_top = n - row as f64;
        let (px, py) = chart.backend_coord(&(0.0, group_top - 0.9));
        root.draw(&Text::new(c.label.clone(), (px - 195, py), ("sans-serif", 14))).map_err(e)?;
        let bars: Vec<(f64, RGBColor)> = [(c.ours, ours_colour)]
            .into_iter()
            .chain(c.diffusers.iter().map(|(m, v)| (*v, if m.contains("leaf") { leaf_colour } else { block_colour })))
            .chain([(c.resident, resident_colour)])
            .collect();
        for (k, (secs, colour)) in bars.iter().enumerate() {
            let y = n - (row + k) as f64 - 1.0;
            let v = secs / c.ours;
            if !v.is_finite() {
                continue;
            }
            chart.draw_series(std::iter::once(Rectangle::new([(0.0, y + 0.1), (v, y + 0.9)], colour.filled()))).map_err(e)?;
            chart
                .draw_series(std::iter::once(Text::new(format!("{secs:.3} s"), (v + max * 0.006, y + 0.85), ("sans-serif", 12))))
                .map_err(e)?;
        }
        row += bars.len() + 1;
    }
    for (name, colour) in [
        ("ours, streamed", ours_colour),
        ("diffusers, block stream", block_colour),
        ("diffusers, leaf stream", leaf_colour),
        ("resident", resident_colour),
    ] {
        chart
            .draw_series(std::iter::once(Rectangle::new([(0.0, 0.0), (0.0, 0.0)], colour.filled())))
            .map_err(e)?
            .label(name)
            .legend(move |(x, y)| Rectangle::new([(x, y - 5), (x + 14, y + 5)], colour.filled()));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE)
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()
        .map_err(e)?;
    root.present().map_err(e)
}

/// Write `bench/REPORT.md` and `bench/plots/*.png` from `bench/results/`.
pub fn report(root: &Path) -> Result<(), String> {
    plotters::style::register_font("sans-serif", FontStyle::Normal, epaint_default_fonts::UBUNTU_LIGHT).map_err(|_| "font".to_owned())?;
    let rows = rows(&root.join("bench/results"))?;
    let plots = root.join("bench/plots");
    std::fs::create_dir_all(&plots).map_err(e)?;
    let mut md = String::from("# Benchmark report\n\nGenerated by `cargo xtask bench --report` from `bench/results/*.json`. Ratios are to each run's own bound, `max(resident step, streamed bytes ÷ bandwidth measured in the same run)`.\n\n");
    md.push_str("![ratio to bound](plots/ratio-to-bound.png)\n\n![peak device memory](plots/peak-memory.png)\n\n![planner](plots/planner-budget.png)\n\n");
    md.push_str("| file | run | res | budget | resident (s) | streamed (s) | predicted (s) | bound (s) | ratio | peak weights (GiB) | bitwise |\n| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for r in &rows {
        let _ = writeln!(
            md,
            "| {} | {} | {} | {} | {:.4} | {:.4} | {} | {:.4} | {:.3} | {:.2} | {} |",
            r.file,
            r.label,
            r.res,
            r.budget_gib.map_or("–".into(), |b| format!("{b:.0} GiB")),
            r.resident_s,
            r.step_s,
            r.predicted_s.map_or("–".into(), |p| format!("{p:.4}")),
            r.bound_s,
            r.ratio,
            r.peak_gib,
            r.bitwise
        );
    }
    // Plots from the full-streaming runs (no budget) of the newest file holding them.
    let full: Vec<&Row> = rows.iter().filter(|r| r.budget_gib.is_none()).collect();
    let newest = full.iter().filter(|r| r.file.contains("-zoo-")).map(|r| r.file.clone()).max();
    let latest: Vec<&Row> = full.iter().copied().filter(|r| Some(&r.file) == newest.as_ref()).collect();
    let ratio: Vec<(String, f64)> = latest.iter().map(|r| (format!("{} {}", r.label, r.res), r.ratio)).collect();
    bars(
        &plots.join("ratio-to-bound.png"),
        "step ÷ bound, full streaming (H200)",
        "ratio to bound",
        &ratio,
        Some((1.03, "target 1.03 (tch: 1.02)")),
    )?;
    let mut peak: Vec<(String, f64)> = latest.iter().map(|r| (format!("{} {}", r.label, r.res), r.peak_gib)).collect();
    if let Some(total) = std::fs::read_to_string(root.join("bench/results").join(newest.unwrap_or_default()))
        .ok()
        .and_then(|t| serde_json::from_str::<Value>(&t).ok())
        .and_then(|d| d["block_bytes_total"].as_f64())
    {
        peak.insert(0, ("all resident".into(), total / (1u64 << 30) as f64));
    }
    bars(&plots.join("peak-memory.png"), "device memory for weights", "GiB", &peak, None)?;
    // The planner's own runs (`*-planner*.json`), not other files' budgeted cases (a pipeline's).
    let newest_planner = rows.iter().filter(|r| r.budget_gib.is_some() && r.file.contains("-planner")).map(|r| r.file.clone()).max();
    let planner: Vec<&Row> = rows.iter().filter(|r| r.budget_gib.is_some() && Some(&r.file) == newest_planner.as_ref()).collect();
    if !planner.is_empty() {
        planner_plot(&plots.join("planner-budget.png"), &planner)?;
    }
    std::fs::write(root.join("bench/REPORT.md"), md).map_err(e)?;
    let (file, table, cases) = headline(&root.join("bench/results"))?;
    headline_plot(&plots.join("headline.png"), &file, &cases)?;
    let readme_path = root.join("README.md");
    if let Ok(readme) = std::fs::read_to_string(&readme_path) {
        std::fs::write(&readme_path, splice_readme(&readme, &readme_headline(&table))?).map_err(e)?;
        println!("wrote README.md's headline");
    }
    let results_path = root.join("docs/results.md");
    if let Ok(page) = std::fs::read_to_string(&results_path) {
        let tables = readme_tables(&root.join("bench/results"))?;
        std::fs::write(&results_path, splice_readme(&page, &tables)?).map_err(e)?;
        println!("wrote docs/results.md's measured tables");
    }
    for (page, table) in guide_tables(&root.join("bench/results"))? {
        let path = root.join(page);
        if let (Ok(text), Some(table)) = (std::fs::read_to_string(&path), table) {
            if text.contains(README_START) {
                std::fs::write(&path, splice_readme(&text, &table)?).map_err(e)?;
                println!("wrote {page}'s measured table");
            }
        }
    }
    println!("wrote bench/REPORT.md and bench/plots/ ({} runs)", rows.len());
    Ok(())
}

#[cfg(test)]
mod tests {
    #[test]
    fn the_report_builds_from_the_committed_results() {
        let root = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("root");
        let dir = std::env::temp_dir().join(format!("offload-report-{}", std::process::id()));
        std::fs::create_dir_all(dir.join("bench")).unwrap();
        let _ = std::fs::remove_dir_all(dir.join("bench/results"));
        std::os::unix::fs::symlink(root.join("bench/results"), dir.join("bench/results")).unwrap();
        super::report(&dir).unwrap();
        let md = std::fs::read_to_string(dir.join("bench/REPORT.md")).unwrap();
        assert!(md.contains("| tch flux-dev 1024 d=1 |"), "{md}");
        // The committed report is what the committed results make, byte for byte
        // (a hand edit, or a results file changed without `bench --report`, fails).
        let committed = std::fs::read_to_string(root.join("bench/REPORT.md")).unwrap();
        assert!(committed == md, "bench/REPORT.md is not what `cargo xtask bench --report` makes of bench/results/");
        for png in ["ratio-to-bound.png", "peak-memory.png", "planner-budget.png", "headline.png"] {
            let bytes = std::fs::read(dir.join("bench/plots").join(png)).unwrap();
            assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n", "{png}");
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
