//! PNG plots of a run (`ferry-sim --plot DIR`): the latency distributions, and the run over
//! time. Text is drawn with a font compiled in (`DejaVu Sans Mono`, in `sim/fonts/`), so a plot
//! looks the same wherever it is made.

use std::path::{Path, PathBuf};

use plotters::prelude::*;
use plotters::style::{register_font, FontStyle};

use crate::des::{Report, Timeline};

const FONT: &[u8] = include_bytes!("../fonts/DejaVuSansMono.ttf");
const SIZE: (u32, u32) = (1000, 640);

/// Plotting failed (a file that could not be written, mostly).
#[derive(Debug, thiserror::Error)]
#[error("plot {path}: {error}")]
pub struct PlotError {
    path: String,
    error: String,
}

fn font() {
    static ONCE: std::sync::Once = std::sync::Once::new();
    ONCE.call_once(|| {
        // The only font; registered under the family every style below names.
        let _ = register_font("sans-serif", FontStyle::Normal, FONT);
    });
}

/// Writes `latency.png` (the distribution of TTFT, TPOT, ITL and end-to-end latency) and
/// `timeline.png` (output tokens per second, requests in the cluster and KV usage over
/// virtual time) into `dir`; returns their paths.
pub fn write_plots(report: &Report, title: &str, dir: &Path) -> Result<Vec<PathBuf>, PlotError> {
    font();
    std::fs::create_dir_all(dir)
        .map_err(|e| PlotError { path: dir.display().to_string(), error: e.to_string() })?;
    let latency = dir.join("latency.png");
    let timeline = dir.join("timeline.png");
    let err = |path: &Path| {
        let path = path.display().to_string();
        move |e: Box<dyn std::error::Error>| PlotError { path: path.clone(), error: e.to_string() }
    };
    latency_plot(report, title, &latency).map_err(err(&latency))?;
    timeline_plot(&report.detail.timeline, title, &timeline).map_err(err(&timeline))?;
    Ok(vec![latency, timeline])
}

type Result2 = Result<(), Box<dyn std::error::Error>>;

/// One line of a panel: its label, its values by window, its colour.
type Line<'a> = (&'a str, Vec<f64>, RGBColor);

fn latency_plot(report: &Report, title: &str, path: &Path) -> Result2 {
    let d = &report.detail;
    let series = [
        ("TTFT", d.ttft.cdf(), RED),
        ("TPOT", d.tpot.cdf(), BLUE),
        ("ITL", d.itl.cdf(), GREEN),
        ("end to end", d.e2e.cdf(), BLACK),
    ];
    let lo = series
        .iter()
        .filter_map(|(_, c, _)| c.first().map(|p| p.0))
        .fold(f64::INFINITY, f64::min)
        .max(1e-6);
    let hi = series.iter().filter_map(|(_, c, _)| c.last().map(|p| p.0)).fold(lo * 10.0, f64::max);
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let mut chart = ChartBuilder::on(&root)
        .caption(format!("{title}: latency distributions"), ("sans-serif", 22))
        .margin(16)
        .x_label_area_size(48)
        .y_label_area_size(64)
        .build_cartesian_2d((lo * 0.9..hi * 1.1).log_scale(), 0.0..1.0)?;
    chart
        .configure_mesh()
        .x_desc("seconds (log scale)")
        .y_desc("fraction of requests (tokens, for ITL) at most")
        .label_style(("sans-serif", 14))
        .draw()?;
    for (name, cdf, color) in series {
        if cdf.is_empty() {
            continue;
        }
        // A step function: each bucket's fraction holds up to its edge.
        let mut points = Vec::with_capacity(2 * cdf.len());
        let mut last = 0.0;
        for (x, y) in cdf {
            points.push((x, last));
            points.push((x, y));
            last = y;
        }
        chart.draw_series(LineSeries::new(points, color.stroke_width(2)))?.label(name).legend(
            move |(x, y)| PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2)),
        );
    }
    chart
        .configure_series_labels()
        .position(SeriesLabelPosition::LowerRight)
        .background_style(WHITE.mix(0.8))
        .border_style(BLACK)
        .label_font(("sans-serif", 14))
        .draw()?;
    root.present()?;
    Ok(())
}

/// Averages of `values` over groups of consecutive windows, at most `points` of them: `(start
/// of the group in seconds, mean)`.
fn downsample(values: &[f64], points: usize) -> Vec<(f64, f64)> {
    let group = values.len().div_ceil(points.max(1)).max(1);
    values
        .chunks(group)
        .enumerate()
        .map(|(i, c)| {
            let t = (i * group) as f64 * Timeline::WINDOW;
            (t, c.iter().sum::<f64>() / c.len() as f64)
        })
        .collect()
}

fn timeline_plot(t: &Timeline, title: &str, path: &Path) -> Result2 {
    let tokens: Vec<f64> = t.tokens.iter().map(|&n| n as f64 / Timeline::WINDOW).collect();
    let live: Vec<f64> = t.live.iter().map(|&n| n as f64).collect();
    let kv: Vec<f64> =
        t.kv.iter().map(|&(s, n)| if n > 0 { 100.0 * s / n as f64 } else { 0.0 }).collect();
    let end = (t.tokens.len().max(1) as f64) * Timeline::WINDOW;
    let root = BitMapBackend::new(path, SIZE).into_drawing_area();
    root.fill(&WHITE)?;
    let (top, bottom) = root.split_vertically(SIZE.1 / 2);
    let panels: [(&str, &str, Vec<Line>, _); 2] = [
        ("output tokens per second", "tokens/s", vec![("output tokens/s", tokens, BLUE)], top),
        (
            "requests in the cluster and KV usage",
            "requests; KV %",
            vec![("requests", live, BLACK), ("KV usage %", kv, RED)],
            bottom,
        ),
    ];
    for (i, (name, unit, lines, area)) in panels.into_iter().enumerate() {
        let max = lines.iter().flat_map(|l| l.1.iter().copied()).fold(1.0, f64::max);
        let caption = if i == 0 { format!("{title}: {name}") } else { name.to_string() };
        let mut chart = ChartBuilder::on(&area)
            .caption(caption, ("sans-serif", 18))
            .margin(12)
            .x_label_area_size(36)
            .y_label_area_size(64)
            .build_cartesian_2d(0.0..end, 0.0..max * 1.05)?;
        chart
            .configure_mesh()
            .x_desc("virtual seconds")
            .y_desc(unit)
            .label_style(("sans-serif", 13))
            .draw()?;
        for (label, values, color) in lines {
            chart
                .draw_series(LineSeries::new(downsample(&values, 800), color.stroke_width(2)))?
                .label(label)
                .legend(move |(x, y)| {
                    PathElement::new(vec![(x, y), (x + 20, y)], color.stroke_width(2))
                });
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .label_font(("sans-serif", 13))
            .draw()?;
    }
    root.present()?;
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn downsampling_averages_groups_of_windows() {
        let v: Vec<f64> = (0..10).map(f64::from).collect();
        assert_eq!(
            downsample(&v, 5),
            vec![(0.0, 0.5), (2.0, 2.5), (4.0, 4.5), (6.0, 6.5), (8.0, 8.5)]
        );
        assert_eq!(downsample(&v, 100).len(), 10);
        assert!(downsample(&[], 10).is_empty());
    }

    #[test]
    fn a_run_is_plotted_as_two_pngs() {
        use crate::des::{run, tests::spec, Router};
        use crate::workload::{Arrivals, Generated, Lengths, Source};
        let spec = spec(2, 4096, Router::KvAware);
        let w = Generated {
            arrivals: Arrivals::Poisson { rate: 20.0 },
            prompt: Lengths::Uniform(100, 900),
            output: Lengths::Uniform(10, 200),
            prefixes: None,
            conversations: None,
            requests: 300,
            vocab_size: 1000,
        };
        let report = run(&spec, &mut Source::generated(w, 1), |_| {}).unwrap();
        assert!(report.detail.timeline.tokens.iter().sum::<u64>() >= report.output_tokens);
        let dir = std::env::temp_dir().join(format!("ferry-sim-plots-{}", std::process::id()));
        let paths = write_plots(&report, "test", &dir).unwrap();
        assert_eq!(paths.len(), 2);
        for path in paths {
            let png = std::fs::read(&path).unwrap();
            assert!(png.starts_with(b"\x89PNG\r\n\x1a\n") && png.len() > 10_000, "{path:?}");
        }
        let _ = std::fs::remove_dir_all(dir);
    }
}
