//! SVG plots of benchmark runs: throughput over time, and latency percentile curves on a
//! "nines" axis (50%, 90%, 99%, 99.9%, ... equally spaced) with latency on a log scale, where
//! tails are visible. SVG keeps the build free of font and image libraries; text sizes are
//! estimated by plotters.

use std::path::Path;

use plotters::prelude::*;

/// Plot size in pixels.
const WIDTH_PX: u32 = 960;
const HEIGHT_PX: u32 = 540;
/// The percentile axis ends at 99.9999% (six nines); 100% (the maximum) is drawn there.
const NINES_MAX: f64 = 6.0;

/// One line: its label, the engine it belongs to (lines of one engine share a colour), points.
#[derive(Clone, Debug)]
pub struct Series {
    pub label: String,
    pub color_index: usize,
    pub points: Vec<(f64, f64)>,
}

fn color(index: usize) -> RGBColor {
    // Distinct in print and for the common colour-vision deficiencies (Okabe–Ito).
    const COLORS: [RGBColor; 6] = [
        RGBColor(0, 114, 178),
        RGBColor(213, 94, 0),
        RGBColor(0, 158, 115),
        RGBColor(204, 121, 167),
        RGBColor(230, 159, 0),
        RGBColor(86, 180, 233),
    ];
    COLORS[index % COLORS.len()]
}

fn error(path: &Path, err: impl std::fmt::Display) -> String {
    format!("plotting {}: {err}", path.display())
}

/// Throughput (requests per second) against seconds since the phase started, a line per run.
pub fn timeline(path: &Path, title: &str, series: &[Series]) -> Result<(), String> {
    let x_max = series.iter().map(|s| s.points.len()).max().unwrap_or(1).max(1) as f64;
    let y_max =
        series.iter().flat_map(|s| s.points.iter().map(|(_, y)| *y)).fold(1.0, f64::max) * 1.1;
    let root = SVGBackend::new(path, (WIDTH_PX, HEIGHT_PX)).into_drawing_area();
    root.fill(&WHITE).map_err(|err| error(path, err))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..x_max + 0.5, 0.0..y_max)
        .map_err(|err| error(path, err))?;
    chart
        .configure_mesh()
        .x_desc("seconds into the phase")
        .y_desc("requests per second")
        .draw()
        .map_err(|err| error(path, err))?;
    for line in series {
        let style = color(line.color_index);
        chart
            .draw_series(LineSeries::new(line.points.iter().copied(), style.stroke_width(2)))
            .map_err(|err| error(path, err))?
            .label(line.label.clone())
            .legend(move |(x, y)| {
                PathElement::new(vec![(x, y), (x + 20, y)], style.stroke_width(2))
            });
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|err| error(path, err))?;
    root.present().map_err(|err| error(path, err))
}

/// Latency (µs, log scale) against percentile (on a nines scale), a line per engine and
/// operation type. Points are (percentile, microseconds).
pub fn latency_curves(path: &Path, title: &str, series: &[Series]) -> Result<(), String> {
    let y_max =
        series.iter().flat_map(|s| s.points.iter().map(|(_, y)| *y)).fold(10.0, f64::max) * 2.0;
    let root = SVGBackend::new(path, (WIDTH_PX, HEIGHT_PX)).into_drawing_area();
    root.fill(&WHITE).map_err(|err| error(path, err))?;
    let mut chart = ChartBuilder::on(&root)
        .caption(title, ("sans-serif", 22))
        .margin(12)
        .x_label_area_size(40)
        .y_label_area_size(80)
        .build_cartesian_2d(0.0..NINES_MAX, (1.0..y_max).log_scale())
        .map_err(|err| error(path, err))?;
    chart
        .configure_mesh()
        .x_desc("percentile")
        .y_desc("latency (µs)")
        .x_labels(7)
        .x_label_formatter(&|nines| percentile_label(*nines))
        .draw()
        .map_err(|err| error(path, err))?;
    for (index, line) in series.iter().enumerate() {
        let base = color(line.color_index);
        // Operation types of one engine share its colour, told apart by line width.
        let style = base.stroke_width(1 + (index % 3) as u32);
        let points = line.points.iter().map(|(percentile, us)| (nines(*percentile), us.max(1.0)));
        chart
            .draw_series(LineSeries::new(points, style))
            .map_err(|err| error(path, err))?
            .label(line.label.clone())
            .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], style));
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::UpperLeft)
        .background_style(WHITE.mix(0.85))
        .border_style(BLACK)
        .draw()
        .map_err(|err| error(path, err))?;
    root.present().map_err(|err| error(path, err))
}

/// 50% → 0.30, 90% → 1, 99% → 2, 99.9% → 3 ...; 100% is drawn at the axis end.
pub fn nines(percentile: f64) -> f64 {
    if percentile >= 100.0 {
        return NINES_MAX;
    }
    (-(1.0 - percentile / 100.0).log10()).clamp(0.0, NINES_MAX)
}

fn percentile_label(nines: f64) -> String {
    if nines >= NINES_MAX {
        return "max".to_string();
    }
    let percentile = 100.0 * (1.0 - 10f64.powf(-nines));
    format!("{percentile:.4}").trim_end_matches('0').trim_end_matches('.').to_string() + "%"
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn nines_axis() {
        assert!((nines(90.0) - 1.0).abs() < 1e-9);
        assert!((nines(99.9) - 3.0).abs() < 1e-9);
        assert_eq!(nines(100.0), NINES_MAX);
        assert_eq!(percentile_label(2.0), "99%");
        assert_eq!(percentile_label(0.0), "0%");
    }

    #[test]
    fn plots_are_written() {
        let dir = tempfile::tempdir().unwrap();
        let series = vec![
            Series {
                label: "copse #1".into(),
                color_index: 0,
                points: vec![(1.0, 10.0), (2.0, 12.0)],
            },
            Series { label: "rocksdb #1".into(), color_index: 1, points: vec![(1.0, 8.0)] },
        ];
        let throughput = dir.path().join("t.svg");
        timeline(&throughput, "a: throughput", &series).unwrap();
        let curves = vec![Series {
            label: "copse read".into(),
            color_index: 0,
            points: vec![(50.0, 100.0), (99.0, 900.0), (100.0, 5000.0)],
        }];
        let latency = dir.path().join("l.svg");
        latency_curves(&latency, "a: latency", &curves).unwrap();
        for path in [throughput, latency] {
            let svg = std::fs::read_to_string(&path).unwrap();
            assert!(svg.starts_with("<svg") && svg.contains("<polyline"), "{}", path.display());
            assert!(svg.contains("copse"), "legend drawn");
        }
    }
}
