//! A hand-made SVG line chart: GB/s against block size, one line per
//! (backend, strategy, direction, blocks).

use std::collections::BTreeMap;
use std::fmt::Write;

use super::BenchRow;

const W: f64 = 720.0;
const H: f64 = 420.0;
const M: f64 = 60.0;
const COLORS: [&str; 8] = [
    "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b", "#e377c2", "#17becf",
];

/// The chart as an SVG document (log2 block size on x, GB/s on y).
pub fn svg(rows: &[BenchRow]) -> String {
    let mut series: BTreeMap<String, Vec<(f64, f64)>> = BTreeMap::new();
    for r in rows {
        let name = format!("{} {} {} x{}", r.backend, r.strategy, r.direction, r.blocks);
        series
            .entry(name)
            .or_default()
            .push(((r.block_bytes.max(1) as f64).log2(), r.gbps));
    }
    let xs = rows.iter().map(|r| (r.block_bytes.max(1) as f64).log2());
    let (x0, x1) = xs.fold((f64::MAX, f64::MIN), |(a, b), x| (a.min(x), b.max(x)));
    let (x0, x1) = if x0 >= x1 {
        (x0 - 1.0, x0 + 1.0)
    } else {
        (x0, x1)
    };
    let y1 = rows.iter().map(|r| r.gbps).fold(0.0f64, f64::max).max(1e-9) * 1.1;
    let px = |x: f64| M + (x - x0) / (x1 - x0) * (W - 2.0 * M);
    let py = |y: f64| H - M - y / y1 * (H - 2.0 * M);
    let mut o = String::new();
    let _ = writeln!(
        o,
        "<svg xmlns=\"http://www.w3.org/2000/svg\" width=\"{W}\" height=\"{H}\" font-family=\"sans-serif\" font-size=\"11\">"
    );
    let _ = writeln!(o, "<rect width=\"100%\" height=\"100%\" fill=\"white\"/>");
    let _ = writeln!(
        o,
        "<line x1=\"{M}\" y1=\"{}\" x2=\"{}\" y2=\"{}\" stroke=\"black\"/>",
        H - M,
        W - M,
        H - M
    );
    let _ = writeln!(
        o,
        "<line x1=\"{M}\" y1=\"{M}\" x2=\"{M}\" y2=\"{}\" stroke=\"black\"/>",
        H - M
    );
    let _ = writeln!(
        o,
        "<text x=\"{}\" y=\"{}\" text-anchor=\"middle\">block size (bytes)</text>",
        W / 2.0,
        H - 15.0
    );
    let _ = writeln!(
        o,
        "<text x=\"15\" y=\"{}\" transform=\"rotate(-90 15 {})\" text-anchor=\"middle\">GB/s</text>",
        H / 2.0,
        H / 2.0
    );
    let mut e = x0.ceil();
    while e <= x1 {
        let _ = writeln!(
            o,
            "<text x=\"{:.1}\" y=\"{}\" text-anchor=\"middle\">{}</text>",
            px(e),
            H - M + 15.0,
            human(2f64.powf(e))
        );
        e += 1.0;
    }
    for i in 0..=4 {
        let y = y1 * f64::from(i) / 4.0;
        let _ = writeln!(
            o,
            "<text x=\"{}\" y=\"{:.1}\" text-anchor=\"end\">{y:.1}</text>",
            M - 5.0,
            py(y) + 4.0
        );
    }
    for (i, (name, pts)) in series.iter().enumerate() {
        let c = COLORS[i % COLORS.len()];
        let path: Vec<String> = pts
            .iter()
            .map(|&(x, y)| format!("{:.1},{:.1}", px(x), py(y)))
            .collect();
        let _ = writeln!(
            o,
            "<polyline fill=\"none\" stroke=\"{c}\" stroke-width=\"2\" points=\"{}\"/>",
            path.join(" ")
        );
        let _ = writeln!(
            o,
            "<text x=\"{}\" y=\"{}\" fill=\"{c}\">{name}</text>",
            M + 10.0,
            M + 14.0 * i as f64
        );
    }
    o.push_str("</svg>\n");
    o
}

fn human(b: f64) -> String {
    if b >= 1048576.0 {
        format!("{}M", b / 1048576.0)
    } else if b >= 1024.0 {
        format!("{}K", b / 1024.0)
    } else {
        format!("{b}")
    }
}
