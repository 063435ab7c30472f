//! The scale bench's report: `scale.json`, `scale.md` (the tables of
//! [`scale::tables`](crate::scale::tables)) and `scale.png`, a chart drawn as
//! `chart.rs` draws the main one (plotters' bitmap backend, the embedded DejaVu font):
//! maru-server's CPU and p99 latencies by step, and RSS bytes per key by fill.

use crate::scale::{ScaleResult, Step};
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::Path;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("scale chart: {e}")
}

fn p99(s: &Step, op: &str) -> f64 {
    s.ops
        .iter()
        .find(|(o, _)| o == op)
        .map_or(0.0, |(_, l)| l.p99_us)
}

/// Draws scale.png again from a scale.json (`MARU_SCALE_REPLOT=FILE`).
pub fn replot(json: &Path, out: &Path) -> Result<(), String> {
    let r: ScaleResult = serde_json::from_str(
        &std::fs::read_to_string(json).map_err(|e| format!("{}: {e}", json.display()))?,
    )
    .map_err(|e| format!("{}: {e}", json.display()))?;
    chart(&out.join("scale.png"), &r)
}

/// Writes scale.json, scale.md and scale.png into `out`.
pub fn write(out: &Path, r: &ScaleResult, machine: &str) -> Result<(), String> {
    let json = serde_json::to_string_pretty(r).map_err(|e| e.to_string())?;
    std::fs::write(out.join("scale.json"), json).map_err(|e| e.to_string())?;
    let mut md = String::from(
        "# maru-server at scale\n\n\
         Written by `make bench-scale` (`maru-bench --only scale`); see bench/src/scale.rs for \
         what each step does. One maru-server (release build, durable directory) and one RM on \
         loopback; simulated engines (`maru-scale-sim`, up to 1,000 sessions a process) speak \
         the wire protocol through the worker's session client: heartbeats every 10 s (a third \
         of the 30 s session timeout), 400 prompts/s in all at every step (exists of 16 chunks, \
         acquire + release of the hits, alloc + publish of the misses, victims + remove when the \
         pool gives no region), 2 sessions closed and opened again per second. Latencies are \
         the engines' (request sent to reply read, loopback included); the engines run at \
         nice +10 (`MARU_SCALE_SIM_NICE`) so that maru-server has a core first, and \
         \"where the time goes\" splits each figure into maru-server's own time (its \
         `request_served_seconds` histogram), the engines' wait for a core and the rest. \
         Pages of 1 KiB and \
         regions of 4 MiB (4,096 pages a region, as 1 GiB regions of 256 KiB chunks).\n\n",
    );
    md.push_str(&format!("Machine: {machine}\n\n"));
    for n in &r.notes {
        md.push_str(&format!("Note: {n}\n\n"));
    }
    for t in crate::scale::tables(r) {
        md.push_str(&t.markdown());
        md.push('\n');
    }
    std::fs::write(out.join("scale.md"), md).map_err(|e| e.to_string())?;
    chart(&out.join("scale.png"), r)
}

fn chart(path: &Path, r: &ScaleResult) -> Result<(), String> {
    let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    let root = BitMapBackend::new(path, (1600, 560)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(
            "maru-server at scale: one process, simulated engines on loopback",
            ("sans-serif", 24).into_font(),
        )
        .map_err(err)?;
    let areas = root.split_evenly((1, 2));
    let steps = &r.steps;
    let n = steps.len().max(1);
    // Short labels: sessions, tenants, keys (millions).
    let names: Vec<String> = steps
        .iter()
        .map(|s| {
            format!(
                "{} s, {} t, {:.0} M",
                s.sessions,
                s.tenants,
                s.keys as f64 / f64::from(1u32 << 20)
            )
        })
        .collect();
    let colors = [
        RGBColor(31, 90, 160),
        RGBColor(240, 150, 40),
        RGBColor(60, 160, 80),
        RGBColor(180, 50, 50),
    ];
    // Left: p99 latencies (µs) by step.
    let series: Vec<(&str, Vec<f64>)> = ["exists", "publish", "alloc", "heartbeat"]
        .iter()
        .map(|op| (*op, steps.iter().map(|s| p99(s, op)).collect()))
        .collect();
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(100.0f64, f64::max)
        * 1.15;
    draw_lines(
        &areas[0],
        "p99 latency by step (µs)",
        &names,
        &series,
        max,
        &colors,
    )?;
    // Right: CPU (% of a core) and RSS (GiB x 10, to share the axis).
    let cpu: Vec<f64> = steps.iter().map(|s| s.cpu_pct).collect();
    let rss: Vec<f64> = steps.iter().map(|s| s.rss_mib / 1024.0 * 10.0).collect();
    let series = vec![
        ("server CPU % of a core", cpu),
        ("server RSS (GiB x 10)", rss),
    ];
    let max = series
        .iter()
        .flat_map(|(_, v)| v.iter().copied())
        .fold(10.0f64, f64::max)
        * 1.15;
    let _ = n;
    draw_lines(
        &areas[1],
        "CPU and memory by step",
        &names,
        &series,
        max,
        &colors,
    )
}

fn draw_lines(
    area: &DrawingArea<BitMapBackend<'_>, plotters::coord::Shift>,
    title: &str,
    names: &[String],
    series: &[(&str, Vec<f64>)],
    max: f64,
    colors: &[RGBColor],
) -> Result<(), String> {
    let n = names.len().max(1);
    let mut chart = ChartBuilder::on(area)
        .caption(title, ("sans-serif", 20).into_font())
        .margin(14)
        .x_label_area_size(40)
        .y_label_area_size(60)
        .build_cartesian_2d(-0.3f64..(n as f64 - 0.7), 0.0..max)
        .map_err(err)?;
    let labels = names.to_vec();
    chart
        .configure_mesh()
        .x_labels(n)
        .x_label_formatter(&|x| {
            let i = x.round() as i64;
            if (x - i as f64).abs() < 0.01 && i >= 0 && (i as usize) < labels.len() {
                labels[i as usize].clone()
            } else {
                String::new()
            }
        })
        .x_desc("step: sessions, tenants, keys")
        .label_style(("sans-serif", 14).into_font())
        .draw()
        .map_err(err)?;
    for (i, (name, v)) in series.iter().enumerate() {
        let c = colors[i % colors.len()];
        chart
            .draw_series(std::iter::once(PathElement::new(
                v.iter()
                    .enumerate()
                    .map(|(x, y)| (x as f64, *y))
                    .collect::<Vec<_>>(),
                c.stroke_width(3),
            )))
            .map_err(err)?
            .label(*name)
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], c.stroke_width(3)));
        chart
            .draw_series(
                v.iter()
                    .enumerate()
                    .map(|(x, y)| Circle::new((x as f64, *y), 4, c.filled())),
            )
            .map_err(err)?;
    }
    chart
        .configure_series_labels()
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .label_font(("sans-serif", 14).into_font())
        .position(SeriesLabelPosition::UpperLeft)
        .draw()
        .map_err(err)?;
    Ok(())
}
