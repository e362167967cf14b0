//! Decode tok/s against node count, one line per layout kind, link and delay, as SVG.

use plotters::prelude::*;

use crate::sweep::Row;

fn err<E: std::fmt::Display>(e: E) -> String {
    format!("drawing the plot: {e}")
}

/// The plot of `rows` (those that fit), titled `title`, as an SVG document.
pub fn svg(rows: &[Row], title: &str) -> Result<String, String> {
    let mut series: Vec<(String, Vec<(f64, f64)>)> = Vec::new();
    for r in rows.iter().filter(|r| r.fits && r.decode_tok_s > 0.0) {
        let key = if r.delay_us > 0.0 {
            format!("{} {} +{} µs", r.layout.name(), r.link, r.delay_us)
        } else {
            format!("{} {}", r.layout.name(), r.link)
        };
        match series.iter_mut().find(|s| s.0 == key) {
            Some(s) => s.1.push(((r.nodes as f64).log2(), r.decode_tok_s)),
            None => series.push((key, vec![((r.nodes as f64).log2(), r.decode_tok_s)])),
        }
    }
    if series.is_empty() {
        return Err("nothing to plot: no layout fits".into());
    }
    // Node counts on a log2 axis, labelled with the counts themselves.
    let max_x = (rows.iter().map(|r| r.nodes).max().unwrap_or(1).max(2) as f64).log2();
    let top = series
        .iter()
        .flat_map(|s| s.1.iter().map(|p| p.1))
        .fold(0.0, f64::max)
        * 1.1;
    let mut out = String::new();
    {
        let root = SVGBackend::with_string(&mut out, (960, 600)).into_drawing_area();
        root.fill(&WHITE).map_err(err)?;
        let mut chart = ChartBuilder::on(&root)
            .caption(title, ("sans-serif", 20))
            .margin(16)
            .x_label_area_size(44)
            .y_label_area_size(60)
            .build_cartesian_2d(0.0..max_x, 0.0..top)
            .map_err(err)?;
        chart
            .configure_mesh()
            .light_line_style(WHITE)
            .x_labels(max_x.ceil() as usize + 1)
            .x_label_formatter(&|x| format!("{}", 2f64.powf(*x).round()))
            .x_desc("nodes")
            .y_desc("decode tok/s (one stream)")
            .draw()
            .map_err(err)?;
        for (i, (name, points)) in series.iter().enumerate() {
            let color = Palette99::pick(i).to_rgba();
            chart
                .draw_series(LineSeries::new(
                    points.iter().copied(),
                    color.stroke_width(2),
                ))
                .map_err(err)?
                .label(name.as_str())
                .legend(move |(x, y)| PathElement::new(vec![(x, y), (x + 16, y)], color));
            chart
                .draw_series(points.iter().map(|&p| Circle::new(p, 3, color.filled())))
                .map_err(err)?;
        }
        chart
            .configure_series_labels()
            .position(SeriesLabelPosition::UpperRight)
            .background_style(WHITE.mix(0.8))
            .border_style(BLACK)
            .draw()
            .map_err(err)?;
        root.present().map_err(err)?;
    }
    Ok(out)
}
