//! `cargo xtask bench --report`: the committed `bench/results/*.json` as a Markdown
//! table (`bench/REPORT.md`) and PNG plots (`bench/plots/`).

use plotters::prelude::*;
use serde_json::Value;
use std::fmt::Write;
use std::path::Path;

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

/// The README's generated block: the headline table and its plot, then the
/// Python package's table where a results file holds one.
pub fn readme_headline(table: &str) -> String {
    format!("{table}\n![per model: our streamed step beside diffusers' offloaded modes and the resident step](bench/plots/headline.png)\n")
}

fn span(v: &Value, digits: usize) -> String {
    format!("{:.digits$} [{:.digits$}, {:.digits$}]", f(&v["median"]), f(&v["min"]), f(&v["max"]))
}

/// The Python package's table, from the newest `*-python-package.json` in
/// `results` (`bench/anchors/py_merge.py`'s output): per model and case, the
/// package's step beside resident and diffusers' modes on the same model object,
/// every figure read from the file.
pub fn python_table(results: &Path) -> Result<Option<String>, String> {
    let Some(name) = newest(results, "-python-package.json")? else { return Ok(None) };
    let d = read_json(&results.join(&name))?;
    let gpu = gpu_of(&d, &name)?;
    let mut md = format!(
        "The Python package (`offload.enable`) on the real diffusers and transformers classes, one {gpu}, bf16 (rows `MODEL-fp8`: \
         diffusers' layerwise casting, fp8 storage and bf16 compute, in every mode; `-fp8-linears`: every Linear of the blocks \
         fp8; `MODEL-gguf-q8_0` and `-gguf-q4_k`: the blocks' Linears as diffusers' GGUF layers, dequantised per layer in every \
         mode; `-budgetB`: the package planned under B GiB from a traced step), medians of the processes named with \
         [min, max]; resident, the package and diffusers' group offloading ran on the same model object in each process; `d=` \
         is the package's prefetch depth (`bench/results/{name}`, commits `{}`, {}, {}):\n\n",
        d["commit"].as_str().unwrap_or("?"),
        d["date"].as_str().unwrap_or("?"),
        d["versions"].as_array().into_iter().flatten().filter_map(Value::as_str).collect::<Vec<_>>().join("; ")
    );
    md.push_str("| model | case | package (s) | ratio to bound | resident (s) | diffusers' best offloaded (s) | package ÷ diffusers | weights on device, package (GiB) | bitwise equal | host syncs a step | targets met | commit |\n");
    md.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
    for r in d["cases"].as_array().into_iter().flatten() {
        let best = r["diffusers_best_mode"].as_str().unwrap_or("");
        let diff = match (best.is_empty(), r["diffusers_failed"].is_object()) {
            (true, true) => "failed (below)".into(),
            (true, false) => "–".into(),
            (false, _) => format!("{} ({})", span(&r["diffusers_s"][best], 3), best.replace('_', " ")),
        };
        let targets = r["targets"].as_object().is_some_and(|t| t.values().all(|v| v.as_bool() == Some(true)));
        // Runs before the engine's slots were counted report no weights (`py_merge.py`).
        let weights = match &r["weights_device_gib"]["offload"]["median"] {
            Value::Null => "not measured¹".to_owned(),
            v => format!("{:.2}", f(v)),
        };
        let planned = match r["budget_gib"].as_f64() {
            Some(b) => format!(", {b:.1} GiB budget, {} blocks resident", r["resident_blocks"].as_array().map_or(0, Vec::len)),
            None => String::new(),
        };
        let _ = writeln!(
            md,
            "| {} | {} d={}{planned} | {} | {} | {} | {diff} | {} | {} | {} | {} | {} | {} |",
            r["model"].as_str().unwrap_or("?"),
            r["case"].as_str().unwrap_or("?"),
            r["depth"],
            span(&r["offload_s"], 3),
            span(&r["ratio_to_bound"], 3),
            span(&r["resident_s"], 3),
            r["vs_diffusers_best"].get("median").map_or("–".into(), |v| format!("{:.3}", f(v))),
            weights,
            yes(&r["bitwise_equal"]),
            r["host_syncs_in_timed_steps"],
            if targets { "yes" } else { "no" },
            r["commit"].as_str().unwrap_or(d["commit"].as_str().unwrap_or("?"))
        );
    }
    // Cases measured again: one line for all of them, each with its count of earlier runs.
    let mut again = Vec::new();
    for r in d["cases"].as_array().into_iter().flatten() {
        for (mode, why) in r["diffusers_failed"].as_object().into_iter().flatten() {
            let _ = writeln!(
                md,
                "\n{} {}: diffusers' {} failed on this model: `{}`.",
                r["model"].as_str().unwrap_or("?"),
                r["case"].as_str().unwrap_or("?"),
                mode.replace('_', " "),
                why.as_str().unwrap_or("?")
            );
        }
        let gone = r["superseded_runs"].as_array().map_or(0, Vec::len);
        if gone > 0 {
            let (model, case, commit) =
                (r["model"].as_str().unwrap_or("?"), r["case"].as_str().unwrap_or("?"), r["commit"].as_str().unwrap_or("?"));
            again.push(format!("{model} {case} ({gone}, now from `{commit}`)"));
        }
    }
    if !again.is_empty() {
        let _ = writeln!(
            md,
            "\nMeasured again, each merged from its newest runs only; the earlier runs (how many in brackets) are kept and \
             named in the file (`superseded_runs`), and `bench/NOTES.md` says why: {}.",
            again.join(", ")
        );
    }
    if d["cases"].as_array().into_iter().flatten().any(|r| r["weights_device_gib"]["offload"].is_null()) {
        md.push_str(
            "\n¹ Runs before 2026-12-04 counted the package's weights on the device without its slots and resident blocks \
             (allocated when it is enabled, before the step whose peak was read): too low, so not reported until run again.\n",
        );
    }
    for n in d["not_merged"].as_array().into_iter().flatten() {
        let _ = writeln!(
            md,
            "\nNot merged: {} {} ({}).",
            n["model"].as_str().unwrap_or("?"),
            n["case"].as_str().unwrap_or("?"),
            n["why"].as_str().unwrap_or("?")
        );
    }
    if let Some(runs) = python_runs(results)? {
        md.push('\n');
        md.push_str(&runs);
    }
    Ok(Some(md))
}

/// The name of the newest file in `results` whose name ends with `suffix`.
fn newest(results: &Path, suffix: &str) -> Result<Option<String>, String> {
    let names = std::fs::read_dir(results).map_err(|e| format!("{}: {e}", results.display()))?;
    newest_of(names.flatten().map(|e| e.file_name().to_string_lossy().into_owned()).filter(|n| n.ends_with(suffix)), suffix)
}

/// The newest of `names` (results files, named `YYYY-MM-DD-…`): the latest
/// date. Two files of that date are no order (the name's rest would decide it
/// by its letters): an error naming both, until the superseded one leaves
/// `bench/results/` (its raw runs stay in `bench/raw.tar.gz` while a published file cites them).
fn newest_of(names: impl IntoIterator<Item = String>, what: &str) -> Result<Option<String>, String> {
    let mut names: Vec<String> = names.into_iter().collect();
    names.sort();
    let Some(last) = names.last() else { return Ok(None) };
    let date = last.get(..10).unwrap_or(last);
    let same: Vec<&String> = names.iter().filter(|n| n.get(..10) == Some(date)).collect();
    if same.len() > 1 {
        return Err(format!(
            "results files {} are all the newest {what} ({date}): which one is published is no file name's order; remove the \
             superseded ones from bench/results/ (git keeps them)",
            same.iter().map(|n| format!("`{n}`")).collect::<Vec<_>>().join(", ")
        ));
    }
    Ok(Some(last.clone()))
}

/// The Python package's whole pipeline call and its start from a checkpoint,
/// from the newest `*-python-pipeline.json` and `*-python-start.json`
/// (`bench/anchors/py_pipeline.py` and `py_start.py` merges), every figure and
/// verdict read from the files.
pub fn python_runs(results: &Path) -> Result<Option<String>, String> {
    let mut md = String::new();
    if let Some(name) = newest(results, "-python-pipeline.json")? {
        let d = read_json(&results.join(&name))?;
        let c = &d["case"];
        let budget = f(&d["budget_gib"]);
        let _ = writeln!(
            md,
            "A whole `{}` call ({}'s transformer and the VAE, random weights, prompt embeddings passed in; {} steps at {}², batch {}), \
             the package enabled on the pipeline under {budget:.0} GiB beside diffusers' offloading, {} processes, medians with \
             [min, max] (`bench/results/{name}`, commit `{}`, {}):\n",
            c["pipeline"].as_str().unwrap_or("?"),
            c["transformer"].as_str().unwrap_or("?"),
            c["steps"],
            c["res"],
            c["batch"],
            d["processes"],
            d["commit"].as_str().unwrap_or("?"),
            d["versions"].as_str().unwrap_or("?")
        );
        md.push_str(&format!(
            "| mode | call (s) | peak device memory (GiB) | weights on device (GiB) | within {budget:.0} GiB | bitwise equal to resident |\n"
        ));
        md.push_str("| --- | --- | --- | --- | --- | --- |\n");
        // Resident and the package first, then diffusers' modes as the file names them.
        let modes = d["modes"].as_object().into_iter().flatten();
        let mut modes: Vec<(&String, &Value)> = modes.collect();
        modes.sort_by_key(|(m, _)| (["resident", "offload"].iter().position(|k| k == m).unwrap_or(2), m.to_string()));
        for (mode, r) in modes {
            let label = if mode == "offload" { "the package (`enable_pipeline`)".to_owned() } else { mode.replace('_', " ") };
            let _ = writeln!(
                md,
                "| {label} | {} | {:.2} | {:.2} | {} | {} |",
                span(&r["call_s"], 3),
                gib(&r["peak_device_bytes"]),
                gib(&r["weights_device_bytes"]),
                yes(&r["fits_budget"]),
                yes(&r["bitwise_equal_to_resident"])
            );
        }
        let _ = writeln!(
            md,
            "\nThe package's call is {:.3} × diffusers' fastest mode within the budget ({}) and {:.3} × all resident; targets met: {}.",
            f(&d["offload_vs_diffusers_best"]),
            d["diffusers_best_within_budget"].as_str().unwrap_or("none").replace('_', " "),
            f(&d["offload_vs_resident"]),
            yes(&d["meets_targets"])
        );
    }
    if let Some(name) = newest(results, "-python-start.json")? {
        let d = read_json(&results.join(&name))?;
        let gib_span = |v: &Value| format!("{:.2} [{:.2}, {:.2}]", gib(&v["median"]), gib(&v["min"]), gib(&v["max"]));
        let _ = writeln!(
            md,
            "{}A model built on the meta device and enabled with `checkpoint=` on {}'s {:.2} GiB file, {} processes \
             (`bench/results/{name}`, commit `{}`): {} s from `enable` to the end of the first streamed step (target ≤ 2 s); \
             host memory beyond the page cache {} GiB then, {} GiB of it before `enable` (target ≤ 1 GiB); {} blocks served \
             in place, {} copied; streamed step {} s, {} × its bound; bitwise equal to the resident model: {}; targets met: {}.",
            if md.is_empty() { "" } else { "\n" },
            d["model"].as_str().unwrap_or("?"),
            gib(&d["file_bytes"]),
            d["processes"],
            d["commit"].as_str().unwrap_or("?"),
            span(&d["start_s"], 2),
            gib_span(&d["host_rss_first_step_bytes"]),
            gib_span(&d["host_rss_before_enable_bytes"]),
            d["in_place"],
            d["copied"],
            span(&d["step_streamed_s"], 3),
            span(&d["ratio_to_bound"], 3),
            yes(&d["bitwise_equal"]),
            yes(&d["meets_targets"])
        );
    }
    Ok((!md.is_empty()).then_some(md))
}

/// The first line of the README's generated block.
pub const README_START: &str =
    "<!-- Generated by `cargo xtask bench --report` from the files it names under bench/results/; edit those, not this. -->";
/// The last line of the README's generated block.
pub const README_END: &str = "<!-- End of the generated block. -->";

fn f(v: &Value) -> f64 {
    v.as_f64().unwrap_or(f64::NAN)
}

fn yes(v: &Value) -> &'static str {
    match v.as_bool() {
        Some(true) => "yes",
        Some(false) => "**no**",
        None => "–",
    }
}

fn read_json(path: &Path) -> Result<Value, String> {
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    let v: Value = serde_json::from_str(&text).map_err(|e| format!("{}: {e}", path.display()))?;
    if v["probe"] == true {
        return Err(format!("{}: a --probe merge (fewer than three processes): not published", path.display()));
    }
    Ok(v)
}

/// A row's case: [`case_label`] where the file names its cases, else the side.
fn row_case(c: &Value) -> String {
    if c["case"].is_string() {
        case_label(c)
    } else {
        match c["resolution"].as_u64() {
            Some(r) if r > 0 => format!("{r}²"),
            _ => "–".into(),
        }
    }
}

/// A streamed case's depth: `d=2`, or `d=2 (the planner's)` where the planner
/// chose it (`zoo run --depths auto`).
fn depth_label(c: &Value) -> String {
    match c["depth_chosen_by"].as_str() {
        Some("planner") => format!("d={} (the planner's)", c["depth"]),
        _ => format!("d={}", c["depth"]),
    }
}

/// A zoo row's verdict: yes or **no**, or, for a row at a depth given on the
/// command line beside the planner's row of the same case, not judged.
fn verdict(c: &Value) -> String {
    match c["judged"] == false {
        true => format!("not judged ({}; the planner's row is)", if c["meets_targets"] == true { "within" } else { "over" }),
        false => yes(&c["meets_targets"]).to_owned(),
    }
}

/// A case as the tables name it: an image side (`1024²`), a video case's name as
/// it is, or a text encoder's tokens (resolution 0).
fn case_label(c: &Value) -> String {
    let name = c["case"].as_str().unwrap_or("?");
    match (c["resolution"].as_u64(), c["tokens"].as_u64()) {
        (Some(0), Some(t)) => format!("{t} tokens"),
        _ if name.chars().all(|ch| ch.is_ascii_digit()) => format!("{name}²"),
        _ => name.to_owned(),
    }
}

/// The README's measured tables, from the bench room's results (`*-zoo-*.json`),
/// the planner's budget run, the compressed case (`*-compressed-*.json`), the
/// pipeline case (`*-pipeline-*.json`) and the Vulkan run in `results`: every
/// figure read or computed here, each table naming its file.
pub fn readme_tables(results: &Path) -> Result<String, String> {
    let mut names: Vec<String> = std::fs::read_dir(results)
        .map_err(|e| format!("{}: {e}", results.display()))?
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .collect();
    names.sort();
    let mut md = String::new();
    let mut printed: Vec<String> = Vec::new();
    for name in names.iter().filter(|n| n.contains("-zoo-") && n.ends_with(".json")) {
        let d = read_json(&results.join(name))?;
        let _ = writeln!(
            md,
            "`bench/results/{name}`: backend `{}` at {} on an {}, {}; each figure is the median of {} process runs with [min, max] \
             (for the ratio: the per-run ratios); the bound is `max(resident step, streamed bytes ÷ pinned bandwidth measured in the same run)`{}.\n",
            d["backend"].as_str().unwrap_or("?"),
            match d["commit"].as_str().unwrap_or("?") {
                one if !one.contains(", ") => format!("commit `{one}`"),
                many => format!("commits `{}` (each model's runs at one, named per case in the file)", many.replace(", ", "`, `")),
            },
            d["gpu"].as_str().unwrap_or("?"),
            d["date"].as_str().unwrap_or("?"),
            d["repeats"],
            if d["anchors"].as_array().is_some_and(|a| !a.is_empty()) { "; diffusers' processes ran interleaved with ours on the same machine (`bench/NOTES.md` names the device command of each)" } else { "" }
        );
        md.push_str("| model | case | streamed step (s) | ratio to bound | resident step (s) | diffusers' best offloaded (s) | ours ÷ diffusers | weights on device (GiB) | activations (GiB) | bitwise equal | finite, not constant | targets met |\n");
        md.push_str("| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n");
        for c in d["cases"].as_array().into_iter().flatten() {
            let anchor = match (c["anchor_best_mode"].as_str(), c["anchor_best_step_s"].as_f64()) {
                (Some(m), Some(s)) => format!("{s:.3} ({})", m.replace('_', " ")),
                _ => "–".into(),
            };
            let _ = writeln!(
                md,
                "| {} | {} {} | {:.3} [{:.3}, {:.3}] | {:.3} [{:.3}, {:.3}] | {:.3} | {anchor} | {} | {:.2} | {:.2} | {} | {} | {} |",
                c["model"].as_str().unwrap_or("?"),
                case_label(c),
                depth_label(c),
                f(&c["step_streamed_s"]),
                f(&c["step_streamed_s_min"]),
                f(&c["step_streamed_s_max"]),
                f(&c["ratio_to_bound"]),
                f(&c["ratio_to_bound_min"]),
                f(&c["ratio_to_bound_max"]),
                f(&c["step_resident_s"]),
                c["ratio_to_anchor_best"].as_f64().map_or("–".into(), |r| format!("{r:.3}")),
                gib(&c["weights_device_bytes"]),
                gib(&c["activations_peak_bytes"]),
                yes(&c["bitwise_equal"]),
                yes(&Value::Bool(c["output_finite"] == true && c["output_nonconstant"] == true)),
                verdict(c),
            );
        }
        // diffusers' rows, each once: a later file merged with the same anchor runs
        // (another backend of the same command) names them without repeating them.
        let fresh: Vec<&Value> = d["anchors"]
            .as_array()
            .into_iter()
            .flatten()
            .filter(|a| {
                let key = format!("{}|{}|{}|{}", a["model"], a["case"], a["mode"], a["step_streamed_s"]);
                !printed.contains(&key) && {
                    printed.push(key);
                    true
                }
            })
            .collect();
        if d["anchors"].as_array().is_some_and(|a| !a.is_empty()) && fresh.is_empty() {
            md.push_str("\ndiffusers' rows for these cases: the table above (the same anchor runs).\n");
        }
        if !fresh.is_empty() {
            md.push_str("\n| model | case | diffusers | step (s) | ratio to its bound | weights on device (GiB) | activations (GiB) |\n| --- | --- | --- | --- | --- | --- | --- |\n");
        }
        for a in fresh {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.3} [{:.3}, {:.3}] | {} | {:.2} | {:.2} |",
                a["model"].as_str().unwrap_or("?"),
                case_label(a),
                a["mode"].as_str().unwrap_or("?").replace('_', " "),
                f(&a["step_streamed_s"]),
                f(&a["step_streamed_s_min"]),
                f(&a["step_streamed_s_max"]),
                a["ratio_to_bound"].as_f64().map_or("–".into(), |r| format!("{r:.3}")),
                gib(&a["weights_device_bytes"]),
                gib(&a["activations_peak_bytes"]),
            );
        }
        md.push('\n');
    }
    // Host tiers (`zoo merge-host-tiers`): the mapped and the copying store, the newest file.
    let shared = |n: &&String| n.contains("-host-tiers-shared-");
    if let Some(name) =
        newest_of(names.iter().filter(|n| n.contains("-host-tiers-") && !shared(n) && n.ends_with(".json")).cloned(), "host-tiers file")?
    {
        let d = read_json(&results.join(&name))?;
        let modes: Vec<String> = d["cases"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                let disk = match c["mode"].as_str() {
                    Some("disk") => format!(
                        " (host RAM budget {:.1} GiB, {} blocks read from disk at {:.2} GB/s, {:.3} × the file's read rate)",
                        f(&c["host_ram_budget_bytes"]) / (1u64 << 30) as f64,
                        c["disk_blocks"],
                        f(&c["disk_stream_gbps"]["median"]),
                        f(&c["disk_stream_to_read"]["median"]),
                    ),
                    _ => String::new(),
                };
                // The disk mode's figure against the file's read rate is an estimate the
                // steps can beat, not a bound: files merged before `disk_estimate_s` existed
                // hold it under `ratio_to_bound`, newer ones beside a true bound.
                let ratio = match (c["mode"].as_str(), c["disk_estimate_s"].is_null()) {
                    (Some("disk"), true) => format!(
                        "{:.3} × the disk estimate (bytes read ÷ the file's read rate: an estimate the steps beat, not a bound)",
                        f(&c["ratio_to_bound"]["median"])
                    ),
                    (Some("disk"), false) => format!(
                        "{:.3} × its bound, {:.3} × the disk estimate (bytes read ÷ the file's read rate: an estimate, not a bound)",
                        f(&c["ratio_to_bound"]["median"]),
                        f(&c["ratio_to_disk_estimate"]["median"])
                    ),
                    _ => format!("{:.3} × its bound", f(&c["ratio_to_bound"]["median"])),
                };
                format!(
                    "{} store{disk}: open → first streamed step {:.2} s [{:.2}, {:.2}], host memory beyond the page cache {:.2} GiB, \
                     streamed step {:.3} s, {ratio}, bitwise equal: {}, targets met: {}",
                    c["mode"].as_str().unwrap_or("?"),
                    f(&c["start_s"]["median"]),
                    f(&c["start_s"]["min"]),
                    f(&c["start_s"]["max"]),
                    f(&c["host_rss_bytes"]["median"]) / (1u64 << 30) as f64,
                    f(&c["step_streamed_s"]["median"]),
                    if c["bitwise_equal"] == true { "yes" } else { "**no**" },
                    if c["meets_targets"] == true { "yes" } else { "**no**" },
                )
            })
            .collect();
        let _ = writeln!(
            md,
            "Host tiers (`bench/results/{name}`, backend `{}` at {} on an {}, {} process runs, a {:.2} GiB {} checkpoint in the page cache, \
             medians with [min, max]): {}. Disk tier: {}.\n",
            d["backend"].as_str().unwrap_or("?"),
            d["commit"].as_str().unwrap_or("?"),
            d["gpu"].as_str().unwrap_or("?"),
            d["process_runs"],
            f(&d["file_bytes"]) / (1u64 << 30) as f64,
            d["model"].as_str().unwrap_or("?"),
            modes.join("; "),
            match (d["disk_tier"].as_str(), d["disk_read_gbps"]["median"].as_f64()) {
                (Some(why), _) => why.to_owned(),
                (None, Some(gbps)) => format!(
                    "the file read at {gbps:.2} GB/s [{:.2}, {:.2}] in the same runs, {}",
                    f(&d["disk_read_gbps"]["min"]),
                    f(&d["disk_read_gbps"]["max"]),
                    if d["cases"].as_array().into_iter().flatten().any(|c| c["disk_direct"] == true) {
                        "bypassing the page cache (O_DIRECT)"
                    } else {
                        "through the page cache (no O_DIRECT on that file system)"
                    }
                ),
                (None, None) => "not measured".to_owned(),
            },
        );
    }
    // A coded start from a coded file (`zoo merge-coded-start`), the newest file.
    if let Some(name) =
        newest_of(names.iter().filter(|n| n.contains("-coded-start-") && n.ends_with(".json")).cloned(), "coded-start file")?
    {
        let d = read_json(&results.join(&name))?;
        let modes: Vec<String> = d["cases"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|c| {
                format!(
                    "{}: open → first streamed step {:.2} s [{:.2}, {:.2}] (store {:.2} s), {} buffers coded, {:.2} GiB held, \
                     streamed step {:.3} s, bitwise equal: {}",
                    match c["mode"].as_str() {
                        Some("coded-file") => "from the coded file",
                        Some("coded") => "coded at build",
                        _ => "?",
                    },
                    f(&c["start_s"]["median"]),
                    f(&c["start_s"]["min"]),
                    f(&c["start_s"]["max"]),
                    f(&c["store_build_s"]["median"]),
                    c["coded_blocks"],
                    f(&c["host_bytes"]) / (1u64 << 30) as f64,
                    f(&c["step_streamed_s"]["median"]),
                    if c["bitwise_equal"] == true { "yes" } else { "**no**" },
                )
            })
            .collect();
        let writes: Vec<String> = d["coded_file_write_s"].as_array().into_iter().flatten().map(|w| format!("{:.1} s", f(w))).collect();
        let _ = writeln!(
            md,
            "Coded start (`bench/results/{name}`, backend `{}` at {} on an {}, {} process runs, a {:.2} GiB {} checkpoint and its \
             {:.2} GiB coded file in the page cache, medians with [min, max]): {}. Coded at build ÷ from the file: {:.1} × [{:.1}, {:.1}]; \
             the file written once in {}; checks pass: {}.\n",
            d["backend"].as_str().unwrap_or("?"),
            d["commit"].as_str().unwrap_or("?"),
            d["gpu"].as_str().unwrap_or("?"),
            d["process_runs"],
            f(&d["file_bytes"]) / (1u64 << 30) as f64,
            d["model"].as_str().unwrap_or("?"),
            f(&d["coded_file_bytes"]) / (1u64 << 30) as f64,
            modes.join("; "),
            f(&d["start_speedup"]["median"]),
            f(&d["start_speedup"]["min"]),
            f(&d["start_speedup"]["max"]),
            if writes.is_empty() { "an earlier command".to_owned() } else { writes.join(", ") },
            if d["checks_pass"] == true { "yes" } else { "**no**" },
        );
    }
    // Processes serving one mapped file at once (`zoo merge-host-tiers-shared`), the newest file.
    if let Some(name) = newest_of(names.iter().filter(|n| shared(n) && n.ends_with(".json")).cloned(), "shared host-tiers file")? {
        let d = read_json(&results.join(&name))?;
        let groups = d["groups"].as_array().map_or(0, Vec::len);
        let procs = d["groups"].as_array().into_iter().flatten().map(|g| g["processes"].as_u64().unwrap_or(0)).max().unwrap_or(0);
        let all = |key: &str| d["groups"].as_array().into_iter().flatten().all(|g| g[key] == true);
        let _ = writeln!(
            md,
            "Processes sharing one checkpoint (`bench/results/{name}`, backend `{}` at {} on an {}, {groups} groups of {procs} processes \
             started together on the same {:.2} GiB {} file, medians with [min, max]): serving at the same time for {:.1} s [{:.1}, {:.1}], \
             each holding at most {:.2} GiB beyond the page cache, with file-backed resident memory of at least {:.3} × the file's size \
             (page-cache pages, one copy for all; the count includes the process's libraries), every block served in place: {}, \
             bitwise equal: {}, targets met: {}.\n",
            d["backend"].as_str().unwrap_or("?"),
            d["commit"].as_str().unwrap_or("?"),
            d["gpu"].as_str().unwrap_or("?"),
            f(&d["file_bytes"]) / (1u64 << 30) as f64,
            d["model"].as_str().unwrap_or("?"),
            f(&d["serving_together_s"]["median"]),
            f(&d["serving_together_s"]["min"]),
            f(&d["serving_together_s"]["max"]),
            f(&d["host_rss_bytes"]["max"]) / (1u64 << 30) as f64,
            f(&d["file_mapped_share"]["min"]),
            if all("served_in_place") { "yes" } else { "**no**" },
            if all("bitwise_equal") { "yes" } else { "**no**" },
            if d["meets_targets"] == true { "yes" } else { "**no**" },
        );
    }
    // Compressed streaming (`zoo merge-compressed`): raw and coded steps of one process.
    for name in names.iter().filter(|n| n.contains("-compressed-") && n.ends_with(".json")) {
        let d = read_json(&results.join(name))?;
        let sp = |v: &Value| format!("{:.3} [{:.3}, {:.3}]", f(&v["median"]), f(&v["min"]), f(&v["max"]));
        let _ = writeln!(
            md,
            "Compressed streaming (`bench/results/{name}`, backend `{}` at {} on an {}, {} process runs; weights {}): coded size {:.3} × raw (exponent entropy {:.2} bits), host encode {:.2} GB/s on {} threads, device decode {} GB/s{}, pinned bandwidth {:.1} GB/s; targets (a transfer-bound case: coded ÷ bound ≤ 0.78; a compute-bound one: the step the planner chooses within 1.01 × the raw one) met: {}.\n",
            d["backend"].as_str().unwrap_or("?"),
            d["commit"].as_str().unwrap_or("?"),
            d["gpu"].as_str().unwrap_or("?"),
            d["process_runs"],
            d["weights"].as_str().unwrap_or("?"),
            f(&d["compression_ratio"]),
            f(&d["exponent_entropy_bits"]),
            f(&d["encode_gbps_host"]),
            d["encode_threads"],
            d["decode_gbps"].as_f64().map_or("–".into(), |g| format!("{g:.0}")),
            match d["decode_gbps_by_mib"].as_array() {
                Some(sizes) if !sizes.is_empty() => {
                    let runs: Vec<String> = sizes.iter().map(|z| format!("{} MiB: {} run(s)", z["mib"], z["runs"])).collect();
                    format!(" (the slowest buffer size; {})", runs.join(", "))
                }
                _ => String::new(),
            },
            f(&d["bandwidth_gbps"]),
            yes(&d["meets_targets"]),
        );
        md.push_str(
            "| case | raw step | resident (s) | streamed raw (s) | streamed coded (s) | uncompressed bound (s) | coded ÷ bound | coded ÷ raw streamed | planner | bitwise equal | targets met |\n\
             | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
        );
        for c in d["cases"].as_array().into_iter().flatten() {
            let _ = writeln!(
                md,
                "| {} d={} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} |",
                row_case(c),
                c["depth"],
                c["raw_step"].as_str().unwrap_or("?"),
                sp(&c["step_resident_s"]),
                sp(&c["step_streamed_raw_s"]),
                sp(&c["step_streamed_compressed_s"]),
                sp(&c["bound_uncompressed_s"]),
                sp(&c["ratio_to_uncompressed_bound"]),
                sp(&c["compressed_over_raw_streamed"]),
                match c["planner_codes"].as_bool() {
                    Some(true) => "codes",
                    Some(false) => "leaves raw",
                    None => "–",
                },
                yes(&c["bitwise_equal"]),
                yes(&c["meets_targets"]),
            );
        }
        md.push('\n');
    }
    // The pipeline case (`zoo merge-pipeline`): per component and whole.
    for name in names.iter().filter(|n| n.contains("-pipeline-") && n.ends_with(".json")) {
        let d = read_json(&results.join(name))?;
        let w = &d["whole"];
        let _ = writeln!(
            md,
            "Pipeline (`bench/results/{name}`, backend `{}` at {}, {} process runs): {}² with {} denoising steps under one device \
             budget of {:.1} GiB (peak {:.2} GiB allocated); whole pass {:.3} s [{:.3}, {:.3}], {:.3} × the sum of its components' \
             bounds, against {:.3} s all resident; targets met: {}.\n",
            d["backend"].as_str().unwrap_or("?"),
            d["commit"].as_str().unwrap_or("?"),
            d["repeats"],
            d["case"].as_str().unwrap_or("?"),
            d["steps"],
            d["budget_bytes"].as_f64().unwrap_or(f64::NAN) / (1u64 << 30) as f64,
            d["peak_device_bytes"].as_f64().unwrap_or(f64::NAN) / (1u64 << 30) as f64,
            f(&w["offloaded_s"]),
            f(&w["offloaded_s_min"]),
            f(&w["offloaded_s_max"]),
            f(&w["ratio_to_bound"]),
            f(&w["resident_s"]),
            yes(&d["meets_targets"]),
        );
        md.push_str("| component | model | held | offloaded (s) | bound (s) | resident (s) | bitwise equal |\n| --- | --- | --- | --- | --- | --- | --- |\n");
        for c in d["components"].as_array().into_iter().flatten() {
            let _ = writeln!(
                md,
                "| {} | {} | {} | {:.3} [{:.3}, {:.3}] | {:.3} | {:.3} | {} |",
                c["component"].as_str().unwrap_or("?").replace('_', " "),
                c["model"].as_str().unwrap_or("?"),
                c["mode"].as_str().unwrap_or("?").replace('_', " "),
                f(&c["offloaded_s"]),
                f(&c["offloaded_s_min"]),
                f(&c["offloaded_s_max"]),
                f(&c["bound_s"]),
                f(&c["resident_s"]),
                yes(&c["bitwise_equal"]),
            );
        }
        md.push('\n');
    }
    // The planner under device budgets: every bench-room file with merged budget
    // runs (medians over process runs), else the older one-run planner file.
    let zoo_budgets: Vec<(String, Value)> = names
        .iter()
        .filter(|n| n.contains("-zoo-") && n.ends_with(".json"))
        .filter_map(|n| {
            let d = read_json(&results.join(n)).ok()?;
            let has = d["budgets"].as_array().is_some_and(|b| !b.is_empty());
            has.then(|| (n.clone(), d))
        })
        .collect();
    for (name, d) in &zoo_budgets {
        let backend = d["backend"].as_str().unwrap_or("?");
        let runs: Vec<&Value> = d["budgets"].as_array().into_iter().flatten().collect();
        // One sentence per (model, case): each against its own resident step.
        let mut groups: Vec<(String, String)> = Vec::new();
        for c in &runs {
            let k = (c["model"].as_str().unwrap_or("").to_string(), c["case"].as_str().unwrap_or("").to_string());
            if !groups.contains(&k) {
                groups.push(k);
            }
        }
        for (model, case) in groups {
            let group: Vec<&&Value> = runs.iter().filter(|c| c["model"] == model.as_str() && c["case"] == case.as_str()).collect();
            let errors: Vec<f64> = group.iter().map(|c| f(&c["prediction_error"])).collect();
            let worst = match errors.iter().all(|e| e.is_finite()) {
                true => format!(
                    "the worst step is {:.1} % off the planner's prediction",
                    errors.iter().map(|e| e.abs()).fold(0.0, f64::max) * 100.0
                ),
                false => "a prediction error is missing (not finite) in the file".to_string(),
            };
            let steps: Vec<String> = group
                .iter()
                .map(|c| {
                    let counts: Vec<u64> =
                        c["resident_block_count_per_run"].as_array().into_iter().flatten().filter_map(Value::as_u64).collect();
                    // Each process planned from its own calibration: where the choices
                    // differ (blocks or depth), the figure is over different plans, said.
                    let same = c["same_choice_every_run"].as_bool() != Some(false);
                    let resident = match (counts.iter().min(), counts.iter().max()) {
                        (Some(a), Some(b)) if a != b => format!("{a}–{b} blocks resident, the choice differing between runs"),
                        _ if !same => format!(
                            "{} blocks resident, the choice (blocks or depth) differing between runs",
                            c["resident_blocks"].as_array().map_or(0, Vec::len)
                        ),
                        _ => format!("{} blocks resident", c["resident_blocks"].as_array().map_or(0, Vec::len)),
                    };
                    // Merged files since the candle budget runs carry each row's
                    // ratio to its bound (a spread); older ones do not.
                    let bound = match c["ratio_to_bound"]["median"].as_f64() {
                        Some(r) => format!(", {r:.3} × its bound"),
                        None => String::new(),
                    };
                    format!(
                        "{:.1} GiB → {:.3} s [{:.3}, {:.3}]{bound} (d={}, {resident}, predicted {:.3} s, {:+.1} %{})",
                        c["budget_bytes"].as_u64().unwrap_or(0) as f64 / (1u64 << 30) as f64,
                        f(&c["step_streamed_s"]),
                        f(&c["step_streamed_s_min"]),
                        f(&c["step_streamed_s_max"]),
                        c["depth"],
                        f(&c["predicted_step_s"]),
                        f(&c["prediction_error"]) * 100.0,
                        match (c["bitwise_equal"] == true, c["weights_within_budget"] == true) {
                            (true, true) => "",
                            (false, _) => "; OUTPUT DIFFERS FROM RESIDENT",
                            (true, false) => "; OVER ITS BUDGET",
                        }
                    )
                })
                .collect();
            let _ = writeln!(
                md,
                "Under a device budget (the planner, `{backend}`, {model} {case}², medians of {} process runs with [min, max]; `bench/results/{name}`): \
                 {}, against {:.3} s all resident; {worst}.\n",
                group.first().map_or(0, |c| c["repeats"].as_u64().unwrap_or(0)),
                steps.join(", "),
                group.first().map_or(f64::NAN, |c| f(&c["step_resident_s"])),
            );
        }
    }
    let planner_file = names.iter().filter(|n| n.contains("planner") && n.ends_with(".json") && n.contains("cuda")).max();
    if let (true, Some(name)) = (zoo_budgets.is_empty(), planner_file) {
        let d = read_json(&results.join(name))?;
        let cases: Vec<&Value> = d["cases"].as_array().into_iter().flatten().filter(|c| c["budget_bytes"].is_u64()).collect();
        let worst = cases.iter().map(|c| (f(&c["step_streamed_s"]) / f(&c["predicted_step_s"]) - 1.0).abs()).fold(0.0, f64::max);
        let steps: Vec<String> = cases
            .iter()
            .map(|c| {
                let bound = f(&c["bound_s"]).max(f(&c["step_resident_s"]));
                format!(
                    "{} GiB → {:.3} s ({:.3} × its bound)",
                    c["budget_bytes"].as_u64().unwrap_or(0) >> 30,
                    f(&c["step_streamed_s"]),
                    f(&c["step_streamed_s"]) / bound
                )
            })
            .collect();
        let _ = writeln!(
            md,
            "Under a device budget (planner, `cuda`, Flux-dev-shaped at 1024², one process run, not yet repeated in the bench room; `bench/results/{name}`): \
             {}, against {:.3} s all resident; every step within {:.2} % of the planner's prediction.\n",
            steps.join(", "),
            cases.first().map_or(f64::NAN, |c| f(&c["step_resident_s"])),
            worst * 100.0
        );
    }
    if let Some(name) = newest_of(names.iter().filter(|n| n.contains("vulkan") && n.ends_with(".json")).cloned(), "Vulkan file")? {
        let d = read_json(&results.join(&name))?;
        let ratios: Vec<f64> = d["cases"].as_array().into_iter().flatten().map(|c| f(&c["ratio_to_bound"])).collect();
        let _ = writeln!(
            md,
            "Vulkan (`bench/results/{name}`, {} process runs{}): pinned bandwidth {:.1} GB/s [{:.1}, {:.1}], {:.3} × cudarc's in the same runs \
             (target 0.9: {}); streamed steps {:.3}–{:.3} × their bound.",
            d["runs"].as_array().map_or(0, Vec::len),
            match d["options"]["split_copy_queues"].as_u64() {
                Some(n) if n > 1 => format!(", each copy split over {n} transfer queues"),
                _ => String::new(),
            },
            f(&d["bandwidth_gbps"]),
            f(&d["bandwidth_gbps_min"]),
            f(&d["bandwidth_gbps_max"]),
            f(&d["bandwidth_ratio_to_cuda"]),
            if d["meets_bandwidth_target"] == true { "met" } else { "missed" },
            ratios.iter().copied().fold(f64::INFINITY, f64::min),
            ratios.iter().copied().fold(0.0, f64::max)
        );
    }
    if let Some(py) = python_table(results)? {
        md.push('\n');
        md.push_str(&py);
    }
    if let Some(sweep) = sweep_table(results)? {
        md.push('\n');
        md.push_str(&sweep);
    }
    Ok(md)
}

/// The sweep of classes beyond the registry, from the newest `*-sweep.json`
/// (`bench/anchors/sweep_merge.py`): per model its figures over the processes
/// (median [min, max]), the ratio to its bound, diffusers' best offloaded mode,
/// the diagnosis's verdicts and the targets as the merge judged them.
pub fn sweep_table(results: &Path) -> Result<Option<String>, String> {
    let Some(name) = newest(results, "-sweep.json")? else { return Ok(None) };
    let d = read_json(&results.join(&name))?;
    let list = |v: &Value| v.as_array().into_iter().flatten().filter_map(Value::as_str).collect::<Vec<_>>().join(", ");
    let mut md = format!(
        "`bench/results/{name}`: the package with defaults (`offload.enable(model, device=\"cuda\")`) on diffusers' and \
         transformers' classes beyond the registry (`bench/anchors/sweep.py`: random bf16 weights at the class's size, built \
         and measured in one process with resident and diffusers' group offloading on the same object) on an {} at commit \
         `{}`; {} process files (raw, in `{}/`: `{}`), each model in 3 of them; each figure the median of the processes' medians \
         with [min, max]; the bound is `max(resident step, streamed bytes ÷ pinned bandwidth probed in the same process)`, \
         the ratio the median of the per-process ratios. *verdict*: `Offloaded.diagnose()` on a traced step after the \
         timed ones.\n\n",
        d["gpu"].as_str().unwrap_or("?"),
        d["commit"].as_str().unwrap_or("?"),
        d["processes"],
        d["raw_dir"].as_str().unwrap_or("?"),
        list(&d["raw"])
    );
    md.push_str(
        "| model | class | case | resident (s) | ours (s) | ratio to bound | diffusers' best (s) | ours ÷ diffusers | depth | verdict | bitwise | targets met |\n\
         | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |\n",
    );
    for r in d["rows"].as_array().into_iter().flatten() {
        if let Some(e) = r["error"].as_str().filter(|_| r["offload_s"].is_null()) {
            let _ = writeln!(md, "| {} | – | – | – | – | {e} | – | – | – | – | – | no |", r["model"].as_str().unwrap_or("?"));
            continue;
        }
        let best = match (r["diffusers_best_mode"].as_str(), r["diffusers_best_s"].is_object()) {
            (Some(m), true) => format!("{:.4} ({})", f(&r["diffusers_best_s"]["median"]), m.replace('_', " ")),
            _ => "–".into(),
        };
        let failed: Vec<&str> =
            r["targets"].as_object().into_iter().flatten().filter(|(_, v)| **v == Value::Bool(false)).map(|(k, _)| k.as_str()).collect();
        let _ = writeln!(
            md,
            "| {} | `{}` | {} | {:.4} | {} | {} | {} | {:.3} | {} | {} | {} | {} |",
            r["model"].as_str().unwrap_or("?"),
            r["class"].as_str().unwrap_or("?"),
            r["case"].as_str().unwrap_or("?"),
            f(&r["resident_s"]["median"]),
            span(&r["offload_s"], 4),
            span(&r["ratio"], 3),
            best,
            f(&r["ours_over_diffusers"]["median"]),
            r["plan"]["depth"],
            list(&r["verdicts"]).replace("None", "at its bound"),
            yes(&r["bitwise_equal"]),
            if failed.is_empty() { "yes".to_owned() } else { format!("no ({})", failed.join(", ").replace('_', " ")) }
        );
    }
    Ok(Some(md))
}

/// `README.md` with its generated block replaced by `tables`.
pub fn splice_readme(readme: &str, tables: &str) -> Result<String, String> {
    let start = readme.find(README_START).ok_or("README.md has no generated block start marker")?;
    let end = readme.find(README_END).ok_or("README.md has no generated block end marker")?;
    if end < start {
        return Err("README.md's generated block markers are out of order".into());
    }
    Ok(format!("{}{README_START}\n\n{tables}\n{}", &readme[..start], &readme[end..]))
}

#[cfg(test)]
mod readme_tests {
    use super::*;

    #[test]
    fn the_readme_tables_are_the_generated_ones() {
        let root = Path::new(env!("CARGO_MANIFEST_DIR")).parent().expect("root");
        let readme = std::fs::read_to_string(root.join("README.md")).expect("README.md");
        let (_, table, cases) = headline(&root.join("bench/results")).expect("headline");
        let want = splice_readme(&readme, &readme_headline(&table)).expect("markers");
        let lines = readme.lines().count();
        assert!(lines <= 100, "README.md is {lines} lines: the front door is one screen; tables beyond the headline go to docs/results.md");
        assert!(readme == want, "README.md's headline differs from `cargo xtask bench --report`'s; run it");
        // Every registry model of the tch file, each with diffusers beside it.
        assert!(cases.len() >= 8 && cases.iter().all(|c| !c.diffusers.is_empty()), "{} cases", cases.len());
        let page = std::fs::read_to_string(root.join("docs/results.md")).expect("docs/results.md");
        let want = splice_readme(&page, &readme_tables(&root.join("bench/results")).expect("tables")).expect("markers");
        assert!(page == want, "docs/results.md's measured tables differ from `cargo xtask bench --report`'s; run it");
    }

    /// Of two results files of the newest date none is picked by its name's
    /// letters (`synced-python-start` after `python-start`): an error naming both.
    #[test]
    fn two_results_files_of_the_newest_date_are_an_error_not_a_pick() {
        let names = |v: &[&str]| v.iter().map(|n| n.to_string()).collect::<Vec<_>>();
        let e = newest_of(names(&["2026-12-05-python-start.json", "2026-12-05-synced-python-start.json"]), "start").unwrap_err();
        assert!(e.contains("`2026-12-05-python-start.json`") && e.contains("superseded"), "{e}");
        let one = newest_of(names(&["2026-12-04-python-start.json", "2026-12-05-synced-python-start.json"]), "start").unwrap();
        assert_eq!(one.as_deref(), Some("2026-12-05-synced-python-start.json"));
        assert_eq!(newest_of(Vec::new(), "start").unwrap(), None);
    }

    /// A `--probe` merge (fewer than three processes) in bench/results is refused,
    /// not published as a figure.
    #[test]
    fn a_probe_merge_is_not_published() {
        let doc = serde_json::json!({"backend": "tch", "gpu": "NVIDIA H200", "repeats": 1, "cases": [], "probe": true});
        assert!(headline_of("probe", &doc).err().is_some_and(|e| e.contains("--probe merge")), "a probe merge published");
    }

    /// `headline` over a results folder holding `doc` alone (as `x-zoo-tch.json`).
    fn headline_of(tag: &str, doc: &serde_json::Value) -> Result<(String, String, Vec<Headline>), String> {
        let dir = std::env::temp_dir().join(format!("offload-headline-{tag}-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("x-zoo-tch.json"), doc.to_string()).unwrap();
        let got = headline(&dir);
        std::fs::remove_dir_all(&dir).unwrap();
        got
    }

    /// The headline names the card the file's runs were measured on, and a file
    /// that does not say is an error, not "H200" by default.
    #[test]
    fn the_headline_names_the_files_gpu() {
        let mut doc = serde_json::json!({"backend": "tch", "gpu": "NVIDIA H100 80GB HBM3", "repeats": 3, "cases": []});
        let (_, table, _) = headline_of("gpu", &doc).expect("headline");
        assert!(table.contains("one NVIDIA H100 80GB HBM3, bf16"), "{table}");
        doc.as_object_mut().unwrap().remove("gpu");
        assert!(headline_of("gpu", &doc).err().is_some_and(|e| e.contains("no \"gpu\"")), "a file without its GPU taken");
    }

    #[test]
    fn the_tables_show_every_case_and_anchor_of_a_zoo_file() {
        let dir = std::env::temp_dir().join(format!("offload-zoo-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let doc = serde_json::json!({"backend": "tch", "commit": "c0", "gpu": "G", "date": "d", "repeats": 3,
            "cases": [{"model": "m", "case": "1024", "depth": 1, "step_streamed_s": 0.5, "step_streamed_s_min": 0.4, "step_streamed_s_max": 0.6,
                       "ratio_to_bound": 1.01, "ratio_to_bound_min": 1.0, "ratio_to_bound_max": 1.02, "step_resident_s": 0.2,
                       "anchor_best_mode": "leaf_stream", "anchor_best_step_s": 0.55, "ratio_to_anchor_best": 0.909,
                       "weights_device_bytes": 1u64 << 30, "activations_peak_bytes": 1u64 << 29, "bitwise_equal": true,
                       "output_finite": true, "output_nonconstant": false, "meets_targets": false}],
            "anchors": [{"model": "m", "case": "1024", "mode": "block_stream", "step_streamed_s": 0.7, "step_streamed_s_min": 0.69,
                         "step_streamed_s_max": 0.71, "ratio_to_bound": 1.3, "weights_device_bytes": 1u64 << 31, "activations_peak_bytes": 0}]});
        std::fs::write(dir.join("x-zoo-tch.json"), doc.to_string()).unwrap();
        let md = readme_tables(&dir).unwrap();
        assert!(md.contains("| m | 1024² d=1 | 0.500 [0.400, 0.600] | 1.010 [1.000, 1.020] | 0.200 | 0.550 (leaf stream) | 0.909 | 1.00 | 0.50 | yes | **no** | **no** |"), "{md}");
        assert!(md.contains("| m | 1024² | block stream | 0.700 [0.690, 0.710] | 1.300 | 2.00 | 0.00 |"), "{md}");
        assert!(md.contains("`bench/results/x-zoo-tch.json`"), "{md}");
        let _ = std::fs::remove_dir_all(&dir);
        let spliced = splice_readme(&format!("a\n{README_START}\nold\n{README_END}\nb"), "new\n").unwrap();
        assert_eq!(spliced, format!("a\n{README_START}\n\nnew\n\n{README_END}\nb"));
        assert!(splice_readme("no markers", "x").is_err());
    }

    #[test]
    fn a_planners_depth_row_is_named_and_a_fixed_row_beside_it_not_judged() {
        let dir = std::env::temp_dir().join(format!("offload-zoo-planner-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let row = |depth: u64, by: &str, judged: bool, met: bool| {
            serde_json::json!({"model": "m", "case": "1024", "depth": depth, "depth_chosen_by": by, "judged": judged,
                "step_streamed_s": 0.5, "step_streamed_s_min": 0.5, "step_streamed_s_max": 0.5, "ratio_to_bound": 1.0,
                "ratio_to_bound_min": 1.0, "ratio_to_bound_max": 1.0, "step_resident_s": 0.5, "weights_device_bytes": 1u64 << 30,
                "activations_peak_bytes": 1u64 << 29, "bitwise_equal": true, "output_finite": true, "output_nonconstant": true,
                "meets_targets": met})
        };
        let doc = serde_json::json!({"backend": "candle", "commit": "c0", "gpu": "G", "date": "d", "repeats": 3,
            "cases": [row(1, "command line", false, false), row(2, "planner", true, true)], "anchors": []});
        std::fs::write(dir.join("x-zoo-candle.json"), doc.to_string()).unwrap();
        let md = readme_tables(&dir).unwrap();
        assert!(md.contains("| m | 1024² d=1 | 0.500") && md.contains("| not judged (over; the planner's row is) |"), "{md}");
        assert!(md.contains("| m | 1024² d=2 (the planner's) | 0.500") && md.contains("| yes | yes | yes |"), "{md}");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn a_python_row_names_its_depth_and_the_diffusers_modes_that_failed() {
        let dir = std::env::temp_dir().join(format!("offload-python-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let s = |v: f64| serde_json::json!({"median": v, "min": v, "max": v, "n": 3});
        let row = serde_json::json!({"model": "flux-dev-gguf-q4_k", "case": "1024", "commit": "c0", "depth": 2, "superseded_runs": [],
            "offload_s": s(0.2), "ratio_to_bound": s(1.0), "resident_s": s(0.15), "diffusers_s": {}, "vs_diffusers_best": {},
            "weights_device_gib": {"offload": s(0.1)}, "bitwise_equal": true, "host_syncs_in_timed_steps": 0,
            "diffusers_failed": {"block_stream": "RuntimeError: boom", "leaf_stream": "TypeError: no"},
            "targets": {"within_1_02_of_bound": true, "faster_than_diffusers_best": null}});
        // A run planned under a budget, and one whose weights on the device were not measured.
        let mut planned = row.clone();
        planned["model"] = "flux-dev-fp8-linears-budget2.5".into();
        planned["budget_gib"] = 2.5.into();
        planned["resident_blocks"] = serde_json::json!(["a", "b", "c", "d"]);
        let mut unmeasured = row.clone();
        unmeasured["model"] = "flux-dev".into();
        unmeasured["weights_device_gib"]["offload"] = serde_json::Value::Null;
        let doc = serde_json::json!({"commit": "c0", "date": "2026-12-03", "gpu": "NVIDIA H200", "versions": ["v"], "cases": [row, planned, unmeasured]});
        std::fs::write(dir.join("2026-12-03-python-package.json"), doc.to_string()).unwrap();
        let md = python_table(&dir).unwrap().expect("a table");
        let _ = std::fs::remove_dir_all(&dir);
        assert!(md.contains("| flux-dev-fp8-linears-budget2.5 | 1024 d=2, 2.5 GiB budget, 4 blocks resident |"), "{md}");
        assert!(md.contains("| flux-dev | 1024 d=2 |") && md.contains("| not measured¹ |") && md.contains("\n¹ Runs before"), "{md}");
        assert_eq!(md.matches("| 0.10 |").count(), 2, "the measured rows keep their figure\n{md}");
        assert!(md.contains("| flux-dev-gguf-q4_k | 1024 d=2 |") && md.contains("| failed (below) |"), "{md}");
        assert!(md.contains("flux-dev-gguf-q4_k 1024: diffusers' block stream failed on this model: `RuntimeError: boom`."), "{md}");
        assert!(md.contains("diffusers' leaf stream failed") && md.contains("| no | c0 |"), "no anchor ran: not a met target\n{md}");
    }

    #[test]
    fn a_pipeline_file_becomes_its_sentence_and_table() {
        let dir = std::env::temp_dir().join(format!("offload-pipeline-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let comp = |name: &str, mode: &str, off: f64| {
            serde_json::json!({"component": name, "model": "m", "mode": mode, "offloaded_s": off, "offloaded_s_min": off, "offloaded_s_max": off,
                               "bound_s": off, "resident_s": 0.1, "bitwise_equal": true})
        };
        let doc = serde_json::json!({"backend": "tch", "commit": "c0", "repeats": 3, "case": "1024", "steps": 4, "budget_bytes": 8u64 << 30,
            "peak_device_bytes": 7u64 << 30, "meets_targets": false,
            "whole": {"offloaded_s": 1.5, "offloaded_s_min": 1.4, "offloaded_s_max": 1.6, "ratio_to_bound": 1.05, "resident_s": 0.8},
            "components": [comp("text_encoder", "layerwise", 0.2), comp("transformer", "layerwise+resident", 1.2), comp("vae", "on_demand", 0.1)]});
        std::fs::write(dir.join("x-pipeline-tch.json"), doc.to_string()).unwrap();
        let md = readme_tables(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(md.contains("`bench/results/x-pipeline-tch.json`") && md.contains("whole pass 1.500 s [1.400, 1.600], 1.050 ×"), "{md}");
        assert!(md.contains("targets met: **no**"), "{md}");
        assert!(md.contains("| vae | m | on demand | 0.100 [0.100, 0.100] | 0.100 | 0.100 | yes |"), "{md}");
    }

    #[test]
    fn a_host_tiers_file_becomes_its_sentence() {
        let dir = std::env::temp_dir().join(format!("offload-host-tiers-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sp = |m: f64| serde_json::json!({"median": m, "min": m - 0.01, "max": m + 0.01});
        let mode = |m: &str, start: f64, rss: f64, ok: bool| {
            serde_json::json!({"mode": m, "start_s": sp(start), "host_rss_bytes": sp(rss), "step_streamed_s": sp(0.43),
                "ratio_to_bound": sp(1.001), "bitwise_equal": true, "meets_targets": ok})
        };
        let doc = serde_json::json!({"backend": "cuda", "commit": "c0", "gpu": "NVIDIA H200", "process_runs": 3, "model": "flux-dev",
            "file_bytes": 23_676_000_000u64, "disk_tier": "not built yet: no disk case",
            "cases": [mode("mapped", 1.2, 0.32 * (1u64 << 30) as f64, true), mode("copy", 16.1, 22.45 * (1u64 << 30) as f64, false)]});
        std::fs::write(dir.join("x-host-tiers-h200.json"), doc.to_string()).unwrap();
        let md = readme_tables(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(md.contains("`bench/results/x-host-tiers-h200.json`") && md.contains("a 22.05 GiB flux-dev checkpoint"), "{md}");
        assert!(
            md.contains("mapped store: open → first streamed step 1.20 s [1.19, 1.21], host memory beyond the page cache 0.32 GiB"),
            "{md}"
        );
        assert!(md.contains("copy store: open → first streamed step 16.10 s") && md.contains("targets met: **no**"), "{md}");
        assert!(md.contains("Disk tier: not built yet"), "{md}");
        // With a disk case: its budget and rate, and the file's read rate.
        let mut disk = mode("disk", 13.0, 8.4 * (1u64 << 30) as f64, true);
        disk["host_ram_budget_bytes"] = serde_json::json!(8u64 << 30);
        disk["disk_blocks"] = serde_json::json!(36);
        disk["disk_stream_gbps"] = sp(1.15);
        disk["disk_stream_to_read"] = sp(0.95);
        disk["disk_direct"] = serde_json::json!(true);
        let doc = serde_json::json!({"backend": "cuda", "commit": "c1", "gpu": "NVIDIA H200", "process_runs": 3, "model": "flux-dev",
            "file_bytes": 23_676_000_000u64, "disk_read_gbps": sp(1.21), "cases": [disk]});
        let dir = std::env::temp_dir().join(format!("offload-host-tiers-report-disk-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("y-host-tiers-h200.json"), doc.to_string()).unwrap();
        let md = readme_tables(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(
            md.contains("disk store (host RAM budget 8.0 GiB, 36 blocks read from disk at 1.15 GB/s, 0.950 × the file's read rate)"),
            "{md}"
        );
        assert!(
            md.contains("Disk tier: the file read at 1.21 GB/s [1.20, 1.22] in the same runs, bypassing the page cache (O_DIRECT)"),
            "{md}"
        );
        // A file from before the disk estimate had its own name: its ratio is called the estimate, not a bound.
        assert!(md.contains("× the disk estimate (bytes read ÷ the file's read rate: an estimate the steps beat, not a bound)"), "{md}");
        // A newer file: its bound and the estimate beside it.
        let mut disk = doc["cases"][0].clone();
        disk["disk_estimate_s"] = sp(9.0);
        disk["ratio_to_bound"] = sp(21.3);
        disk["ratio_to_disk_estimate"] = sp(0.986);
        let mut newer = doc.clone();
        newer["cases"] = serde_json::json!([disk]);
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("y-host-tiers-h200.json"), newer.to_string()).unwrap();
        let md = readme_tables(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(md.contains("21.300 × its bound, 0.986 × the disk estimate"), "{md}");
        // A shared file beside it: its own sentence, and the tiers' sentence still
        // from the tiers' file (the shared file's name sorts after it).
        let group = |g: &str| serde_json::json!({"group": g, "processes": 2, "served_in_place": true, "bitwise_equal": true, "meets_targets": true});
        let shared = serde_json::json!({"backend": "cuda", "commit": "c2", "gpu": "NVIDIA H200", "model": "flux-dev",
            "file_bytes": 23_676_000_000u64, "groups": [group("pair1"), group("pair2"), group("pair3")],
            "serving_together_s": sp(20.0), "host_rss_bytes": sp(0.33 * (1u64 << 30) as f64), "file_mapped_share": sp(1.0),
            "meets_targets": true});
        let dir = std::env::temp_dir().join(format!("offload-host-tiers-report-shared-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        std::fs::write(dir.join("y-host-tiers-h200.json"), doc.to_string()).unwrap();
        std::fs::write(dir.join("y-host-tiers-shared-h200.json"), shared.to_string()).unwrap();
        let md = readme_tables(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(md.contains("Host tiers (`bench/results/y-host-tiers-h200.json`"), "{md}");
        assert!(
            md.contains("(`bench/results/y-host-tiers-shared-h200.json`, backend `cuda` at c2 on an NVIDIA H200, 3 groups of 2"),
            "{md}"
        );
        assert!(
            md.contains("serving at the same time for 20.0 s [20.0, 20.0]")
                && md.contains("resident memory of at least 0.990 × the file's size"),
            "{md}"
        );
    }

    #[test]
    fn a_coded_start_file_becomes_its_sentence() {
        let dir = std::env::temp_dir().join(format!("offload-coded-start-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let case = |mode: &str, start: f64| {
            serde_json::json!({"mode": mode, "start_s": {"median": start, "min": start - 1.0, "max": start + 1.0},
                "store_build_s": {"median": start - 0.5}, "coded_blocks": 57, "host_bytes": 16u64 << 30,
                "step_streamed_s": {"median": 0.335}, "bitwise_equal": true})
        };
        let doc = serde_json::json!({"backend": "cuda", "commit": "c3", "gpu": "NVIDIA H200", "process_runs": 3, "model": "flux-dev",
            "file_bytes": 24u64 << 30, "coded_file_bytes": 16u64 << 30, "coded_file_write_s": [41.5],
            "start_speedup": {"median": 6.5, "min": 6.0, "max": 7.0}, "checks_pass": true,
            "cases": [case("coded-file", 9.0), case("coded", 58.0)]});
        std::fs::write(dir.join("z-coded-start-h200.json"), doc.to_string()).unwrap();
        let md = readme_tables(&dir).unwrap();
        std::fs::remove_dir_all(&dir).unwrap();
        assert!(md.contains("Coded start (`bench/results/z-coded-start-h200.json`, backend `cuda` at c3"), "{md}");
        assert!(
            md.contains("from the coded file: open → first streamed step 9.00 s [8.00, 10.00] (store 8.50 s), 57 buffers coded"),
            "{md}"
        );
        assert!(md.contains("Coded at build ÷ from the file: 6.5 × [6.0, 7.0]; the file written once in 41.5 s; checks pass: yes"), "{md}");
    }

    /// Each process plans from its own calibration: a budget row whose runs chose
    /// differently says so, also where they kept as many blocks (other ones, or
    /// another depth), not only where the counts differ.
    #[test]
    fn a_budget_row_over_different_choices_says_so() {
        let dir = std::env::temp_dir().join(format!("offload-budget-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let row = |gib: u64, counts: [u64; 3], same: bool| {
            serde_json::json!({"model": "flux-dev", "case": "1024", "budget_bytes": gib << 30, "depth": 1,
                "resident_blocks": vec!["b"; counts[0] as usize], "resident_block_count_per_run": counts, "same_choice_every_run": same,
                "step_streamed_s": 0.3, "step_streamed_s_min": 0.29, "step_streamed_s_max": 0.31, "predicted_step_s": 0.3,
                "prediction_error": 0.01, "step_resident_s": 0.2})
        };
        let doc = serde_json::json!({"backend": "cuda", "commit": "c0", "gpu": "NVIDIA H200",
            "budgets": [row(8, [5, 5, 5], true), row(12, [9, 9, 9], false), row(16, [12, 13, 13], false)]});
        std::fs::write(dir.join("y-zoo-cuda.json"), doc.to_string()).unwrap();
        let md = readme_tables(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(md.contains("8.0 GiB → 0.300 s [0.290, 0.310] (d=1, 5 blocks resident, predicted"), "{md}");
        assert!(md.contains("9 blocks resident, the choice (blocks or depth) differing between runs"), "{md}");
        assert!(md.contains("12–13 blocks resident, the choice differing between runs"), "{md}");
    }

    #[test]
    fn a_compressed_file_becomes_its_sentence_and_table() {
        let dir = std::env::temp_dir().join(format!("offload-compressed-report-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let sp = |m: f64| serde_json::json!({"median": m, "min": m - 0.01, "max": m + 0.01});
        let case = serde_json::json!({"case": "1024", "resolution": 1024, "tokens": 4608, "depth": 1, "raw_step": "transfer-bound",
            "step_resident_s": sp(0.17), "step_streamed_raw_s": sp(0.4), "step_streamed_compressed_s": sp(0.29),
            "bound_uncompressed_s": sp(0.4), "ratio_to_uncompressed_bound": sp(0.725), "compressed_over_raw_streamed": sp(0.725),
            "planner_codes": true, "bitwise_equal": true, "meets_targets": true});
        let doc = serde_json::json!({"backend": "cuda", "commit": "c0", "gpu": "NVIDIA H200", "process_runs": 3, "weights": "normal",
            "compression_ratio": 0.665, "exponent_entropy_bits": 2.55, "encode_gbps_host": 3.1, "encode_threads": 16, "decode_gbps": 512.0,
            "bandwidth_gbps": 55.2, "meets_targets": false, "cases": [case]});
        std::fs::write(dir.join("x-compressed-h200.json"), doc.to_string()).unwrap();
        let md = readme_tables(&dir).unwrap();
        let _ = std::fs::remove_dir_all(&dir);
        assert!(md.contains("`bench/results/x-compressed-h200.json`") && md.contains("coded size 0.665 × raw"), "{md}");
        assert!(
            md.contains("device decode 512 GB/s")
                && md.contains("compute-bound one: the step the planner chooses within 1.01 × the raw one) met: **no**"),
            "{md}"
        );
        assert!(md.contains("| 1024² d=1 | transfer-bound | 0.170 [0.160, 0.180] | 0.400 [0.390, 0.410] | 0.290 [0.280, 0.300]"), "{md}");
        assert!(md.contains("| 0.725 [0.715, 0.735] | codes | yes | yes |"), "the planner's choice in its column: {md}");
    }

    #[test]
    fn cases_are_named_by_side_tokens_or_name() {
        let c = |case: &str, res: u64, tokens: u64| serde_json::json!({"case": case, "resolution": res, "tokens": tokens});
        assert_eq!(case_label(&c("1024", 1024, 4608)), "1024²");
        assert_eq!(case_label(&c("512", 0, 512)), "512 tokens");
        assert_eq!(case_label(&c("480x832x21", 480, 32760)), "480x832x21");
    }
}
