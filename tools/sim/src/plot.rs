//! Plots as PNG: the TTFT CDF, one curve per policy ([`plot_ttft_cdf`]), and
//! prefill and decode load over time, one panel per policy
//! ([`plot_load_series`]).
//!
//! Drawing is pure Rust (plotters' bitmap backend). Text needs a TrueType
//! font, which is loaded at run time from a short list of common system
//! locations ([`FONT_CANDIDATES`]); no font is bundled. Without one, the
//! curves are still drawn, without any text, and the caller is told so.

use std::path::Path;
use std::sync::OnceLock;

use hdrhistogram::Histogram;
use plotters::prelude::*;

pub use crate::error::PlotError;
use crate::sim::LoadSeries;
use plotters::style::{register_font, FontStyle};

/// Where [`plot_ttft_cdf`] looks for a font, in order.
pub const FONT_CANDIDATES: &[&str] = &[
    "/usr/share/fonts/truetype/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/TTF/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu/DejaVuSans.ttf",
    "/usr/share/fonts/dejavu-sans-fonts/DejaVuSans.ttf",
    "/usr/share/fonts/truetype/liberation/LiberationSans-Regular.ttf",
    "/usr/share/fonts/liberation-sans/LiberationSans-Regular.ttf",
    "/usr/share/fonts/noto/NotoSans-Regular.ttf",
    "/usr/share/fonts/truetype/noto/NotoSans-Regular.ttf",
    "/System/Library/Fonts/Supplemental/Arial.ttf",
    "/Library/Fonts/Arial.ttf",
    "C:\\Windows\\Fonts\\arial.ttf",
];

/// What [`plot_ttft_cdf`] managed to draw.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlotOutcome {
    /// Whether a font was found and text (title, axes, legend) was drawn.
    pub with_text: bool,
}

static FONT_BYTES: OnceLock<&'static [u8]> = OnceLock::new();

/// Registers the first readable, valid font of `candidates` with plotters.
/// The font bytes are kept for the rest of the process (plotters needs
/// `'static` data); they are read and kept at most once.
fn load_font(candidates: &[&Path]) -> bool {
    for path in candidates {
        let Ok(bytes) = std::fs::read(path) else {
            continue;
        };
        let data: &'static [u8] = FONT_BYTES.get_or_init(|| Box::leak(bytes.into_boxed_slice()));
        if register_font("sans-serif", FontStyle::Normal, data).is_ok() {
            return true;
        }
    }
    false
}

/// Draws the TTFT CDF of each `(label, ttft histogram in µs)` series to a PNG
/// at `path`, with a vertical line at the TTFT SLO.
pub fn plot_ttft_cdf(
    path: &Path,
    series: &[(&str, &Histogram<u64>)],
    ttft_slo_ms: f64,
) -> Result<PlotOutcome, PlotError> {
    let candidates: Vec<&Path> = FONT_CANDIDATES.iter().map(Path::new).collect();
    plot_ttft_cdf_with_fonts(path, series, ttft_slo_ms, &candidates)
}

/// [`plot_ttft_cdf`] with an explicit list of font files to try.
pub fn plot_ttft_cdf_with_fonts(
    path: &Path,
    series: &[(&str, &Histogram<u64>)],
    ttft_slo_ms: f64,
    fonts: &[&Path],
) -> Result<PlotOutcome, PlotError> {
    let err = |message: String| PlotError {
        path: path.display().to_string(),
        message,
    };
    let with_text = load_font(fonts);
    const POINTS: u32 = 200;
    let mut lo = f64::INFINITY;
    let mut hi = 0.0f64;
    for (_, h) in series.iter().filter(|(_, h)| !h.is_empty()) {
        lo = lo.min(h.min() as f64 / 1e6);
        hi = hi.max(h.max() as f64 / 1e6);
    }
    let slo_s = ttft_slo_ms / 1000.0;
    if !lo.is_finite() {
        lo = slo_s / 10.0;
        hi = slo_s * 10.0;
    }
    lo = lo.min(slo_s).max(1e-4) * 0.8;
    hi = hi.max(slo_s).max(lo * 10.0) * 1.25;

    let root = BitMapBackend::new(path, (1100, 700)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let mut builder = ChartBuilder::on(&root);
    builder.margin(24);
    if with_text {
        builder
            .caption("TTFT CDF per policy", ("sans-serif", 28))
            .x_label_area_size(50)
            .y_label_area_size(60);
    }
    let mut chart = builder
        .build_cartesian_2d((lo..hi).log_scale(), 0.0f64..1.0f64)
        .map_err(|e| err(e.to_string()))?;
    {
        let mut mesh = chart.configure_mesh();
        if with_text {
            mesh.x_desc("time to first token (s, log scale)")
                .y_desc("fraction of prefilled requests")
                .label_style(("sans-serif", 16));
        } else {
            mesh.x_labels(0).y_labels(0);
        }
        mesh.draw().map_err(|e| err(e.to_string()))?;
    }
    for (k, (label, h)) in series.iter().enumerate() {
        if h.is_empty() {
            continue;
        }
        let color = Palette99::pick(k).to_rgba();
        let points = (0..=POINTS).map(|q| {
            let q = f64::from(q) / f64::from(POINTS);
            (h.value_at_quantile(q) as f64 / 1e6, q)
        });
        let drawn = chart
            .draw_series(LineSeries::new(points, color.stroke_width(2)))
            .map_err(|e| err(e.to_string()))?;
        if with_text {
            drawn.label(label.to_string()).legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
            });
        }
    }
    chart
        .draw_series(LineSeries::new(
            [(slo_s, 0.0), (slo_s, 1.0)],
            BLACK.mix(0.6).stroke_width(1),
        ))
        .map_err(|e| err(e.to_string()))?;
    if with_text {
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperLeft)
            .background_style(WHITE.mix(0.85))
            .border_style(BLACK)
            .label_font(("sans-serif", 16))
            .draw()
            .map_err(|e| err(e.to_string()))?;
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(PlotOutcome { with_text })
}

/// Highest load drawn in [`plot_load_series`]; higher samples are clipped.
pub const LOAD_PLOT_MAX: f64 = 3.0;

/// Draws one panel per `(label, load series)`: prefill load and decode load
/// (1.0 = at the SLO) against simulated time, with a line at 1.0, to a PNG
/// at `path`. The load axis runs to 1.1x the highest sample, at least 1.5
/// and at most [`LOAD_PLOT_MAX`] (higher samples are drawn at the top).
pub fn plot_load_series(
    path: &Path,
    series: &[(&str, &LoadSeries)],
) -> Result<PlotOutcome, PlotError> {
    let candidates: Vec<&Path> = FONT_CANDIDATES.iter().map(Path::new).collect();
    plot_load_series_with_fonts(path, series, &candidates)
}

/// [`plot_load_series`] with an explicit list of font files to try.
pub fn plot_load_series_with_fonts(
    path: &Path,
    series: &[(&str, &LoadSeries)],
    fonts: &[&Path],
) -> Result<PlotOutcome, PlotError> {
    let err = |message: String| PlotError {
        path: path.display().to_string(),
        message,
    };
    if series.is_empty() {
        return Err(err("no load series to draw".into()));
    }
    let with_text = load_font(fonts);
    let span_s = series
        .iter()
        .map(|(_, l)| l.decode.len() as f64 * l.interval_ms / 1000.0)
        .fold(1.0f64, f64::max);
    let y_max = series
        .iter()
        .flat_map(|(_, l)| l.prefill.iter().chain(&l.decode))
        .fold(0.0f64, |m, v| m.max(f64::from(*v) * 1.1))
        .clamp(1.5, LOAD_PLOT_MAX);
    const PANEL_H: u32 = 260;
    let height = PANEL_H * series.len() as u32 + if with_text { 50 } else { 0 };
    let root = BitMapBackend::new(path, (1100, height)).into_drawing_area();
    root.fill(&WHITE).map_err(|e| err(e.to_string()))?;
    let body = if with_text {
        let (title, body) = root.split_vertically(50);
        title
            .titled(
                "Load over time: prefill (queue wait / TTFT SLO), decode (TBT / TBT SLO)",
                ("sans-serif", 22),
            )
            .map_err(|e| err(e.to_string()))?;
        body
    } else {
        root.clone()
    };
    let prefill_color = RGBColor(31, 119, 180);
    let decode_color = RGBColor(214, 39, 40);
    for ((label, load), panel) in series.iter().zip(body.split_evenly((series.len(), 1))) {
        let mut builder = ChartBuilder::on(&panel);
        builder.margin(12);
        if with_text {
            builder
                .caption(*label, ("sans-serif", 18))
                .x_label_area_size(36)
                .y_label_area_size(50);
        }
        let mut chart = builder
            .build_cartesian_2d(0.0f64..span_s, 0.0f64..y_max)
            .map_err(|e| err(e.to_string()))?;
        {
            let mut mesh = chart.configure_mesh();
            mesh.disable_x_mesh().y_max_light_lines(1);
            if with_text {
                mesh.x_desc("simulated time (s)")
                    .y_desc("load (x SLO)")
                    .x_label_formatter(&|x| format!("{x:.0}"))
                    .y_label_formatter(&|y| format!("{y:.1}"))
                    .label_style(("sans-serif", 14));
            } else {
                mesh.x_labels(0).y_labels(0);
            }
            mesh.draw().map_err(|e| err(e.to_string()))?;
        }
        chart
            .draw_series(LineSeries::new(
                [(0.0, 1.0), (span_s, 1.0)],
                BLACK.mix(0.5).stroke_width(1),
            ))
            .map_err(|e| err(e.to_string()))?;
        for (name, values, color) in [
            ("prefill", &load.prefill, prefill_color),
            ("decode", &load.decode, decode_color),
        ] {
            let points = values.iter().enumerate().map(|(i, v)| {
                (
                    i as f64 * load.interval_ms / 1000.0,
                    f64::from(*v).min(y_max),
                )
            });
            let drawn = chart
                .draw_series(LineSeries::new(points, color.stroke_width(1)))
                .map_err(|e| err(e.to_string()))?;
            if with_text {
                drawn.label(name).legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 24, y)], color.stroke_width(2))
                });
            }
        }
        if with_text {
            chart
                .configure_series_labels()
                .position(SeriesLabelPosition::UpperRight)
                .background_style(WHITE.mix(0.85))
                .border_style(BLACK)
                .label_font(("sans-serif", 14))
                .draw()
                .map_err(|e| err(e.to_string()))?;
        }
    }
    root.present().map_err(|e| err(e.to_string()))?;
    Ok(PlotOutcome { with_text })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn draws_without_a_font() {
        let dir = std::env::temp_dir().join(format!("kvpool-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("nofont.png");
        let mut h = Histogram::<u64>::new_with_bounds(1, 86_400_000_000, 3).unwrap();
        for v in [1_000u64, 50_000, 2_000_000, 9_000_000] {
            h.record(v).unwrap();
        }
        let empty = Histogram::<u64>::new_with_bounds(1, 86_400_000_000, 3).unwrap();
        let out =
            plot_ttft_cdf_with_fonts(&path, &[("a", &h), ("b", &empty)], 10_000.0, &[]).unwrap();
        assert!(!out.with_text);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn draws_load_panels_without_a_font() {
        let dir = std::env::temp_dir().join(format!("kvpool-load-plot-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("load.png");
        let wave = LoadSeries {
            interval_ms: 1_000.0,
            prefill: (0..300).map(|i| (i % 60) as f32 / 60.0).collect(),
            decode: (0..300)
                .map(|i| 0.5 + ((i + 30) % 60) as f32 / 20.0)
                .collect(),
        };
        let flat = LoadSeries {
            interval_ms: 2_000.0,
            prefill: vec![0.3; 100],
            decode: vec![0.95; 100],
        };
        let out = plot_load_series_with_fonts(&path, &[("a", &wave), ("b", &flat)], &[]).unwrap();
        assert!(!out.with_text);
        let bytes = std::fs::read(&path).unwrap();
        assert_eq!(&bytes[1..4], b"PNG");
        assert!(plot_load_series_with_fonts(&path, &[], &[]).is_err());
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
