//! The PNG chart: GB/s by system, one panel per chunk size, two bars per system (one
//! client, and four clients / two threads). Text is drawn with the DejaVu Sans font
//! embedded in the binary (bench/assets), so no system font library is needed.

use plotters::coord::ranged1d::SegmentValue;
use plotters::prelude::*;
use plotters::style::FontStyle;
use std::path::Path;

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// One bar pair: a system's GB/s with one client and with several (None: not measured).
pub struct Bars {
    pub system: String,
    pub one: f64,
    pub many: Option<f64>,
}

pub struct Panel {
    pub title: String,
    pub bars: Vec<Bars>,
}

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("chart: {e}")
}

pub fn draw(path: &Path, title: &str, panels: &[Panel]) -> Result<(), String> {
    let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    let root = BitMapBackend::new(path, (1400, 720)).into_drawing_area();
    root.fill(&WHITE).map_err(err)?;
    let root = root
        .titled(title, ("sans-serif", 24).into_font())
        .map_err(err)?;
    let (_, h) = root.dim_in_pixel();
    let (plots, legend) = root.split_vertically(h - 34);
    let areas = plots.split_evenly((1, panels.len().max(1)));
    let max = panels
        .iter()
        .flat_map(|p| p.bars.iter())
        .map(|b| b.one.max(b.many.unwrap_or(0.0)))
        .fold(1.0f64, f64::max)
        * 1.12;
    let one = RGBColor(31, 90, 160);
    let many = RGBColor(240, 150, 40);
    for (area, p) in areas.iter().zip(panels) {
        if p.bars.is_empty() {
            // A focused run measured nothing of this chunk size: the panel says so.
            area.draw(&Text::new(
                format!("{}: not measured", p.title),
                (20, 20),
                ("sans-serif", 20).into_font(),
            ))
            .map_err(err)?;
            continue;
        }
        let n = p.bars.len() as i32;
        let names: Vec<String> = p.bars.iter().map(|b| b.system.clone()).collect();
        let mut chart = ChartBuilder::on(area)
            .caption(&p.title, ("sans-serif", 20).into_font())
            .margin(12)
            .x_label_area_size(40)
            .y_label_area_size(190)
            .build_cartesian_2d(0.0..max, (0..n - 1).into_segmented())
            .map_err(err)?;
        chart
            .configure_mesh()
            .disable_y_mesh()
            .x_desc("GB/s")
            .label_style(("sans-serif", 15).into_font())
            .y_label_formatter(&|v| match v {
                SegmentValue::CenterOf(i) | SegmentValue::Exact(i) => {
                    names.get(*i as usize).cloned().unwrap_or_default()
                }
                SegmentValue::Last => String::new(),
            })
            .draw()
            .map_err(err)?;
        for (i, b) in p.bars.iter().enumerate() {
            let i = i as i32;
            // y grows upwards: the first bar of a segment is the lower one.
            chart
                .draw_series(std::iter::once(Rectangle::new(
                    [
                        (0.0, SegmentValue::Exact(i)),
                        (b.one, SegmentValue::CenterOf(i)),
                    ],
                    one.filled(),
                )))
                .map_err(err)?;
            if let Some(m) = b.many {
                chart
                    .draw_series(std::iter::once(Rectangle::new(
                        [
                            (0.0, SegmentValue::CenterOf(i)),
                            (m, SegmentValue::Exact(i + 1)),
                        ],
                        many.filled(),
                    )))
                    .map_err(err)?;
            }
            let label = match b.many {
                Some(m) => format!("{:.2} / {:.2}", b.one, m),
                None => format!("{:.2}", b.one),
            };
            let x = b.one.max(b.many.unwrap_or(0.0));
            chart
                .draw_series(std::iter::once(Text::new(
                    label,
                    (x + max * 0.01, SegmentValue::CenterOf(i)),
                    ("sans-serif", 13).into_font(),
                )))
                .map_err(err)?;
        }
    }
    // Legend, drawn by hand in the strip below the panels.
    let (lx, ly) = (220, 8);
    let font = ("sans-serif", 15).into_font();
    // A swatch and its label per series, 260 pixels apart.
    for (dx, color, label) in [
        (0, one, "1 client (memcpy: 1 thread)"),
        (260, many, "4 clients (memcpy: 2 threads)"),
    ] {
        let x = lx + dx;
        legend
            .draw(&Rectangle::new(
                [(x, ly), (x + 16, ly + 14)],
                color.filled(),
            ))
            .map_err(err)?;
        legend
            .draw(&Text::new(label, (x + 22, ly), font.clone()))
            .map_err(err)?;
    }
    root.present().map_err(err)?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    fn bars(n: usize) -> Vec<Bars> {
        (0..n)
            .map(|i| Bars {
                system: format!("system {i}"),
                one: 1.0 + i as f64,
                many: (i % 2 == 0).then_some(2.0),
            })
            .collect()
    }

    /// A focused run (`--only maru --backends cxl --clients 1`) gives panels of one bar,
    /// or none; the chart is still drawn, as for a full run.
    #[test]
    fn panels_of_zero_one_and_many_bars_are_drawn() {
        let dir = std::env::temp_dir().join(format!("maru-chart-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        for n in [0, 1, 2, 7] {
            let path = dir.join(format!("{n}.png"));
            let panels = [
                Panel {
                    title: "256 KiB".into(),
                    bars: bars(n),
                },
                Panel {
                    title: "2 MiB".into(),
                    bars: bars(1),
                },
            ];
            draw(&path, "test", &panels).unwrap_or_else(|e| panic!("{n} bars: {e}"));
            assert!(
                std::fs::metadata(&path).unwrap().len() > 1000,
                "{n} bars: empty PNG"
            );
        }
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
