//! Charts for reports: SVG and PNG, written without external tools.
//!
//! A chart is first laid out once into a list of drawing primitives in pixel coordinates
//! (rectangles, lines, text); the SVG writer and the PNG rasterizer both walk that list, so the
//! two files always show the same picture. Everything is pure arithmetic on the input, so the
//! same chart gives byte-identical files (the simulator's reports are diffed and committed).
//! The PNG is drawn by a tiny software rasterizer with a built-in 5x7 bitmap font and encoded
//! by the `png` crate with fixed settings: the same pixels give the same bytes for the version
//! Cargo.lock holds (an upgrade of `png` or its deflate backends may change the bytes of a
//! PNG, never its pixels or the SVG).

use std::path::Path;

/// One line of a line chart: a legend name and its `(x, y)` points, drawn in the given order.
#[derive(Clone, Debug, PartialEq)]
pub struct Series {
    /// Legend name.
    pub name: String,
    /// `(x, y)` points; non-finite coordinates are skipped.
    pub points: Vec<(f64, f64)>,
}

/// Lines over a numeric x axis.
#[derive(Clone, Debug, PartialEq)]
pub struct LineChart {
    /// Title above the plot.
    pub title: String,
    /// Label under the x axis.
    pub x_label: String,
    /// Label beside the y axis.
    pub y_label: String,
    /// The lines, coloured by position in the palette.
    pub series: Vec<Series>,
}

/// Grouped bars: one cluster per category, one bar per group inside each cluster.
#[derive(Clone, Debug, PartialEq)]
pub struct BarChart {
    /// Title above the plot.
    pub title: String,
    /// Label beside the y axis.
    pub y_label: String,
    /// Category names along the x axis.
    pub categories: Vec<String>,
    /// `(legend name, one value per category)`; missing or non-finite values draw no bar.
    pub groups: Vec<(String, Vec<f64>)>,
}

/// A chart of either kind.
#[derive(Clone, Debug, PartialEq)]
pub enum Chart {
    /// Lines over a numeric x axis.
    Line(LineChart),
    /// Grouped bars per category.
    Bar(BarChart),
}

impl Chart {
    /// The chart as a standalone SVG document.
    pub fn to_svg(&self) -> String {
        svg(&self.scene())
    }

    /// The chart as an 8-bit RGB PNG of `WIDTH` x `HEIGHT` pixels.
    ///
    /// Encoding a chart into memory does not fail in practice (the size is fixed and the
    /// buffer always matches it); the error is the encoder's, passed on rather than unwrapped.
    pub fn to_png(&self) -> std::io::Result<Vec<u8>> {
        let mut canvas = Canvas::new();
        for prim in &self.scene() {
            canvas.draw(prim);
        }
        encode_png(WIDTH as u32, HEIGHT as u32, &canvas.px).map_err(std::io::Error::from)
    }

    fn scene(&self) -> Vec<Prim> {
        match self {
            Chart::Line(c) => line_scene(c),
            Chart::Bar(c) => bar_scene(c),
        }
    }
}

/// Writes `dir/stem.svg` and `dir/stem.png`, creating `dir` if needed.
pub fn write_chart(dir: &Path, stem: &str, chart: &Chart) -> std::io::Result<()> {
    std::fs::create_dir_all(dir)?;
    std::fs::write(dir.join(format!("{stem}.svg")), chart.to_svg())?;
    std::fs::write(dir.join(format!("{stem}.png")), chart.to_png()?)
}

/// Image size in pixels (SVG user units and PNG pixels alike).
pub const WIDTH: usize = 900;
/// Image height in pixels.
pub const HEIGHT: usize = 500;
// The plot area; the legend sits to the right of it.
const LEFT: f64 = 80.0;
const TOP: f64 = 50.0;
const RIGHT: f64 = 690.0;
const BOTTOM: f64 = 440.0;

type Rgb = [u8; 3];
const BACKGROUND: Rgb = [255, 255, 255];
const INK: Rgb = [0x33, 0x33, 0x33];
const AXIS: Rgb = [0x55, 0x55, 0x55];
const GRID: Rgb = [0xe4, 0xe4, 0xe4];
/// Series and group colours, by position, cycling (Tableau 10 plus two darker ones).
const PALETTE: [u32; 12] = [
    0x1f77b4, 0xff7f0e, 0x2ca02c, 0xd62728, 0x9467bd, 0x8c564b, 0xe377c2, 0x7f7f7f, 0xbcbd22,
    0x17becf, 0x393b79, 0x637939,
];

fn colour(i: usize) -> Rgb {
    let [_, r, g, b] = PALETTE[i % PALETTE.len()].to_be_bytes();
    [r, g, b]
}

/// One drawing primitive in pixel coordinates (y grows downwards).
#[derive(Clone, Debug, PartialEq)]
enum Prim {
    /// Filled rectangle: left, top, width, height (may be zero), colour.
    Rect(f64, f64, f64, f64, Rgb),
    /// A one-pixel grid line, axis or tick from (x0, y0) to (x1, y1).
    Seg(f64, f64, f64, f64, Rgb),
    /// A data line, two pixels wide (an SVG polyline).
    Series(Vec<(f64, f64)>, Rgb),
    Text(Label),
}

#[derive(Clone, Debug, PartialEq)]
struct Label {
    x: f64,
    /// The vertical centre of the text.
    y: f64,
    text: String,
    /// 1: small text (5x7 pixel glyphs); 2: the title.
    scale: u32,
    /// Where `x` is along the text: -1 at its start, 0 in its middle, 1 at its end.
    anchor: i8,
    /// Turned a quarter anticlockwise, reading bottom to top.
    vertical: bool,
}

fn text(x: f64, y: f64, text: &str, scale: u32, anchor: i8) -> Prim {
    let text = text.to_string();
    Prim::Text(Label {
        x,
        y,
        text,
        scale,
        anchor,
        vertical: false,
    })
}

/// A numeric axis: the shown range and its round tick values.
struct Axis {
    lo: f64,
    hi: f64,
    step: f64,
    ticks: Vec<f64>,
}

impl Axis {
    /// Round range covering `[min, max]` (`None`: no data) in three to eight steps of 1, 2 or 5.
    fn nice(range: Option<(f64, f64)>, include_zero: bool) -> Axis {
        let (mut min, mut max) = range.unwrap_or((0.0, 1.0));
        if include_zero {
            (min, max) = (min.min(0.0), max.max(0.0));
        }
        if max - min <= f64::EPSILON * max.abs().max(min.abs()) {
            let pad = if min == 0.0 { 1.0 } else { min.abs() * 0.1 };
            (min, max) = (min - pad, max + pad);
        }
        let rough = (max - min) / 8.0;
        let mag = 10f64.powi(rough.log10().floor() as i32);
        let step = [1.0, 2.0, 5.0]
            .iter()
            .map(|m| m * mag)
            .find(|s| *s >= rough);
        let step = step.unwrap_or(10.0 * mag);
        let (first, last) = ((min / step).floor(), (max / step).ceil());
        if !(step.is_finite() && step > 0.0 && first.is_finite() && last.is_finite()) {
            // Magnitudes near f64::MAX overflow the arithmetic: a plain 0..1 axis instead.
            return Axis::nice(None, false);
        }
        let ticks = (first as i64..=last as i64).take(50);
        let ticks = ticks.map(|i| i as f64 * step).collect();
        let (lo, hi) = (first * step, last * step);
        Axis {
            lo,
            hi,
            step,
            ticks,
        }
    }

    /// Pixel position of `v` on an axis drawn from pixel `a` (at `lo`) to pixel `b` (at `hi`).
    fn px(&self, v: f64, a: f64, b: f64) -> f64 {
        a + (v - self.lo) / (self.hi - self.lo) * (b - a)
    }

    /// Tick label with just enough decimals for the step; k / M for large round steps.
    fn label(&self, v: f64) -> String {
        let (div, suffix) = match self.step {
            s if s >= 1e6 => (1e6, "M"),
            s if s >= 1e3 => (1e3, "k"),
            _ => (1.0, ""),
        };
        let (v, step) = (v / div, self.step / div);
        // Steps are 1, 2 or 5 times a power of ten: the power says how many decimals.
        let decimals = (-(step.log10() + 1e-9).floor()).clamp(0.0, 9.0) as usize;
        let s = format!("{v:.decimals$}");
        if s.trim_start_matches(['-', '0', '.']).is_empty() {
            return "0".to_string();
        }
        format!("{s}{suffix}")
    }
}

fn min_max(values: impl Iterator<Item = f64>) -> Option<(f64, f64)> {
    let finite = values.filter(|v| v.is_finite());
    finite.fold(None, |acc, v| match acc {
        None => Some((v, v)),
        Some((lo, hi)) => Some((v.min(lo), v.max(hi))),
    })
}

/// Shortens `s` to at most `max` characters, marking the cut with "..".
fn fit(s: &str, max: usize) -> String {
    if s.chars().count() <= max {
        return s.to_string();
    }
    let keep: String = s.chars().take(max.saturating_sub(2)).collect();
    format!("{keep}..").chars().take(max).collect()
}

/// Background, title, y grid with labels, axis labels; the caller then adds its data.
fn frame(out: &mut Vec<Prim>, title: &str, x_label: &str, y_label: &str, y: &Axis) {
    out.push(Prim::Rect(
        0.0,
        0.0,
        WIDTH as f64,
        HEIGHT as f64,
        BACKGROUND,
    ));
    out.push(text(WIDTH as f64 / 2.0, 22.0, &fit(title, 72), 2, 0));
    for &t in &y.ticks {
        let py = y.px(t, BOTTOM, TOP);
        out.push(Prim::Seg(LEFT, py, RIGHT, py, GRID));
        out.push(Prim::Seg(LEFT - 5.0, py, LEFT, py, AXIS));
        out.push(text(LEFT - 8.0, py, &y.label(t), 1, 1));
    }
    out.push(text(
        (LEFT + RIGHT) / 2.0,
        BOTTOM + 36.0,
        &fit(x_label, 100),
        1,
        0,
    ));
    if let Prim::Text(mut label) = text(20.0, (TOP + BOTTOM) / 2.0, &fit(y_label, 64), 1, 0) {
        label.vertical = true;
        out.push(Prim::Text(label));
    }
}

/// Axis lines on top of the data, then the legend to the right of the plot.
fn finish<'a>(out: &mut Vec<Prim>, names: impl Iterator<Item = &'a str>) {
    out.push(Prim::Seg(LEFT, TOP, LEFT, BOTTOM, AXIS));
    out.push(Prim::Seg(LEFT, BOTTOM, RIGHT, BOTTOM, AXIS));
    let max_chars = ((WIDTH as f64 - RIGHT - 40.0) / 6.0) as usize;
    for (i, name) in names.enumerate() {
        let y = TOP + 6.0 + 18.0 * i as f64;
        out.push(Prim::Rect(RIGHT + 16.0, y - 5.0, 14.0, 10.0, colour(i)));
        out.push(text(RIGHT + 36.0, y, &fit(name, max_chars), 1, -1));
    }
}

fn line_scene(c: &LineChart) -> Vec<Prim> {
    let finite = |s: &Series| -> Vec<(f64, f64)> {
        let pts = s.points.iter().copied();
        pts.filter(|(x, y)| x.is_finite() && y.is_finite())
            .collect()
    };
    let data: Vec<Vec<(f64, f64)>> = c.series.iter().map(finite).collect();
    let all = || data.iter().flatten();
    let x = Axis::nice(min_max(all().map(|p| p.0)), false);
    let y = Axis::nice(min_max(all().map(|p| p.1)), false);
    let mut out = Vec::new();
    frame(&mut out, &c.title, &c.x_label, &c.y_label, &y);
    for &t in &x.ticks {
        let px = x.px(t, LEFT, RIGHT);
        out.push(Prim::Seg(px, TOP, px, BOTTOM, GRID));
        out.push(Prim::Seg(px, BOTTOM, px, BOTTOM + 5.0, AXIS));
        out.push(text(px, BOTTOM + 14.0, &x.label(t), 1, 0));
    }
    for (i, pts) in data.iter().enumerate().filter(|(_, p)| !p.is_empty()) {
        let to_px = |&(a, b): &(f64, f64)| (x.px(a, LEFT, RIGHT), y.px(b, BOTTOM, TOP));
        let pts: Vec<(f64, f64)> = pts.iter().map(to_px).collect();
        if let [(px, py)] = pts[..] {
            // A lone point draws no line: mark it.
            out.push(Prim::Rect(px - 3.0, py - 3.0, 6.0, 6.0, colour(i)));
        }
        out.push(Prim::Series(pts, colour(i)));
    }
    finish(&mut out, c.series.iter().map(|s| s.name.as_str()));
    out
}

fn bar_scene(c: &BarChart) -> Vec<Prim> {
    let values = c.groups.iter().flat_map(|g| g.1.iter().copied());
    let y = Axis::nice(min_max(values), true);
    let mut out = Vec::new();
    frame(&mut out, &c.title, "", &c.y_label, &y);
    let longest = c.groups.iter().map(|g| g.1.len()).max().unwrap_or(0);
    let slot = (RIGHT - LEFT) / c.categories.len().max(longest).max(1) as f64;
    let bar = slot * 0.8 / c.groups.len().max(1) as f64;
    let gap = if bar > 4.0 { 1.0 } else { 0.0 };
    let zero = y.px(0.0, BOTTOM, TOP);
    let max_chars = ((slot / 6.0) as usize).max(1);
    for (k, name) in c.categories.iter().enumerate() {
        let x = LEFT + slot * (k as f64 + 0.5);
        out.push(text(x, BOTTOM + 14.0, &fit(name, max_chars), 1, 0));
    }
    for (j, (_, values)) in c.groups.iter().enumerate() {
        for (k, &v) in values.iter().enumerate().filter(|(_, v)| v.is_finite()) {
            let x = LEFT + slot * (k as f64 + 0.1) + bar * j as f64 + gap;
            let top = y.px(v, BOTTOM, TOP);
            let (w, h) = (bar - 2.0 * gap, (top - zero).abs());
            out.push(Prim::Rect(x, top.min(zero), w, h, colour(j)));
        }
    }
    if y.lo < 0.0 {
        out.push(Prim::Seg(LEFT, zero, RIGHT, zero, AXIS));
    }
    finish(&mut out, c.groups.iter().map(|g| g.0.as_str()));
    out
}

// ---- SVG ----

/// Fixed-precision number, never "-0.00".
fn num(v: f64) -> String {
    let s = format!("{v:.2}");
    if s == "-0.00" {
        "0.00".to_string()
    } else {
        s
    }
}

fn hex(c: Rgb) -> String {
    format!("#{:02x}{:02x}{:02x}", c[0], c[1], c[2])
}

/// XML-escapes `s`; control characters (not allowed in XML) become spaces.
fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for ch in s.chars() {
        match ch {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            '\'' => out.push_str("&apos;"),
            c if c.is_control() => out.push(' '),
            c => out.push(c),
        }
    }
    out
}

fn svg(scene: &[Prim]) -> String {
    let (w, h) = (WIDTH, HEIGHT);
    let mut out = format!(
        r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="sans-serif">"#
    );
    out.push('\n');
    for prim in scene {
        let line = match prim {
            Prim::Rect(x, y, w, h, fill) => {
                let (x, y, w, h, fill) = (num(*x), num(*y), num(*w), num(*h), hex(*fill));
                format!(r#"<rect x="{x}" y="{y}" width="{w}" height="{h}" fill="{fill}"/>"#)
            }
            Prim::Series(pts, c) => {
                let pts: Vec<String> = pts.iter().map(|p| num(p.0) + "," + &num(p.1)).collect();
                let (c, pts) = (hex(*c), pts.join(" "));
                format!(
                    r#"<polyline fill="none" stroke="{c}" stroke-width="2" stroke-linejoin="round" points="{pts}"/>"#
                )
            }
            Prim::Seg(x1, y1, x2, y2, c) => {
                let (x1, y1, x2, y2, c) = (num(*x1), num(*y1), num(*x2), num(*y2), hex(*c));
                format!(
                    r#"<line x1="{x1}" y1="{y1}" x2="{x2}" y2="{y2}" stroke="{c}" stroke-width="1"/>"#
                )
            }
            Prim::Text(t) => {
                let (x, y, size, fill) = (num(t.x), num(t.y), 6 * t.scale + 6, hex(INK));
                let anchor = ["start", "middle", "end"][(t.anchor + 1).clamp(0, 2) as usize];
                let turn = if t.vertical {
                    format!(r#" transform="rotate(-90 {x} {y})""#)
                } else {
                    String::new()
                };
                let body = escape(&t.text);
                format!(
                    r#"<text x="{x}" y="{y}" font-size="{size}" text-anchor="{anchor}" dominant-baseline="middle" fill="{fill}"{turn}>{body}</text>"#
                )
            }
        };
        out.push_str(&line);
        out.push('\n');
    }
    out.push_str("</svg>\n");
    out
}

// ---- Raster ----

/// 5x7 glyphs for ASCII 32..=126, space-separated: five column bytes each in hex, bit 0 the top
/// row. Lower case has its own glyphs; anything outside the range draws as '?'.
const FONT_HEX: &str = concat!(
    "0000000000 00005f0000 0007000700 147f147f14 242a7f2a12 2313086462 3649552250 0005030000 ",
    "001c224100 0041221c00 082a1c2a08 08083e0808 0050300000 0808080808 0060600000 2010080402 ",
    "3e5149453e 00427f4000 4261514946 2141454b31 1814127f10 2745454539 3c4a494930 0171090503 ",
    "3649494936 064949291e 0036360000 0056360000 0008142241 1414141414 4122140800 0201510906 ",
    "324979413e 7e1111117e 7f49494936 3e41414122 7f4141221c 7f49494941 7f09090101 3e41415132 ",
    "7f0808087f 00417f4100 2040413f01 7f08142241 7f40404040 7f0204027f 7f0408107f 3e4141413e ",
    "7f09090906 3e4151215e 7f09192946 4649494931 01017f0101 3f4040403f 1f2040201f 7f2018207f ",
    "6314081463 0304780403 6151494543 00007f4141 0204081020 41417f0000 0402010204 4040404040 ",
    "0001020400 2054545478 7f48444438 3844444420 384444487f 3854545418 087e090102 081454543c ",
    "7f08040478 00447d4000 2040443d00 007f102844 00417f4000 7c04180478 7c08040478 3844444438 ",
    "7c14141408 081414187c 7c08040408 4854545420 043f444020 3c4040207c 1c2040201c 3c4030403c ",
    "4428102844 0c5050503c 4464544c44 0008364100 00007f0000 0041360800 0804081008 ",
);

const fn nibble(b: u8) -> u8 {
    match b {
        b'0'..=b'9' => b - b'0',
        b'a'..=b'f' => b - b'a' + 10,
        _ => 0,
    }
}

const FONT: [[u8; 5]; 95] = {
    let hex = FONT_HEX.as_bytes();
    let mut font = [[0u8; 5]; 95];
    let mut i = 0;
    while i < 95 * 5 {
        let at = i / 5 * 11 + i % 5 * 2;
        font[i / 5][i % 5] = nibble(hex[at]) << 4 | nibble(hex[at + 1]);
        i += 1;
    }
    font
};

fn glyph(c: char) -> [u8; 5] {
    let c = if (' '..='~').contains(&c) { c } else { '?' };
    FONT[c as usize - 32]
}

/// An RGB pixel buffer of `WIDTH` x `HEIGHT`, row-major, three bytes a pixel.
struct Canvas {
    px: Vec<u8>,
}

impl Canvas {
    fn new() -> Canvas {
        Canvas {
            px: BACKGROUND.repeat(WIDTH * HEIGHT),
        }
    }

    /// Fills pixels `[x0, x1) x [y0, y1)`, clipped to the canvas.
    fn fill(&mut self, x0: i64, y0: i64, x1: i64, y1: i64, c: Rgb) {
        let (cx, cy) = (
            |v: i64| v.clamp(0, WIDTH as i64),
            |v: i64| v.clamp(0, HEIGHT as i64),
        );
        for y in cy(y0)..cy(y1) {
            for x in cx(x0)..cx(x1) {
                let i = (y as usize * WIDTH + x as usize) * 3;
                self.px[i..i + 3].copy_from_slice(&c);
            }
        }
    }

    /// Bresenham from `a` to `b`, stamping a `t` x `t` square at each step.
    fn line(&mut self, a: (f64, f64), b: (f64, f64), t: i64, c: Rgb) {
        // Clamp far-off points so a wild coordinate cannot make the walk endless.
        let p = |v: f64| v.round().clamp(-4096.0, 8192.0) as i64;
        let (mut x, mut y, x1, y1) = (p(a.0), p(a.1), p(b.0), p(b.1));
        let (dx, dy) = ((x1 - x).abs(), -(y1 - y).abs());
        let (sx, sy) = (if x < x1 { 1 } else { -1 }, if y < y1 { 1 } else { -1 });
        let mut err = dx + dy;
        loop {
            let (x0, y0) = (x - t / 2, y - t / 2);
            self.fill(x0, y0, x0 + t, y0 + t, c);
            if x == x1 && y == y1 {
                break;
            }
            let e2 = 2 * err;
            if e2 >= dy {
                err += dy;
                x += sx;
            }
            if e2 <= dx {
                err += dx;
                y += sy;
            }
        }
    }

    /// Bitmap text: glyph cells are 6 x 8 units (one unit of spacing), a unit `scale` pixels.
    fn text(&mut self, t: &Label) {
        let s = i64::from(t.scale);
        let len = (t.text.chars().count() as i64 * 6 - 1).max(0) * s;
        let back = len * i64::from(t.anchor + 1) / 2; // from the anchor back to the start
        let (x, y) = (t.x.round() as i64, t.y.round() as i64);
        for (i, ch) in t.text.chars().enumerate() {
            for (gx, col) in glyph(ch).into_iter().enumerate() {
                for gy in (0..7).filter(|r| col >> r & 1 == 1) {
                    let along = (i as i64 * 6 + gx as i64) * s;
                    let (px, py) = if t.vertical {
                        (x - 7 * s / 2 + gy * s, y + back - along - s)
                    } else {
                        (x - back + along, y - 7 * s / 2 + gy * s)
                    };
                    self.fill(px, py, px + s, py + s, INK);
                }
            }
        }
    }

    fn draw(&mut self, prim: &Prim) {
        match prim {
            Prim::Rect(x, y, w, h, fill) => {
                let r = |v: f64| v.round() as i64;
                self.fill(r(*x), r(*y), r(x + w), r(y + h), *fill);
            }
            Prim::Seg(x0, y0, x1, y1, c) => self.line((*x0, *y0), (*x1, *y1), 1, *c),
            Prim::Series(pts, c) => {
                for pair in pts.windows(2) {
                    self.line(pair[0], pair[1], 2, *c);
                }
            }
            Prim::Text(t) => self.text(t),
        }
    }
}

// ---- PNG ----

/// PNG of 8-bit RGB pixels `rgb` (row-major, `w * h * 3` bytes).
///
/// Every setting that shapes the bytes is set here rather than left to the encoder's
/// defaults, so that a default changing in a minor release of `png` cannot change them.
/// Adaptive filtering and the balanced level keep a mostly-white chart at about ten KiB.
fn encode_png(w: u32, h: u32, rgb: &[u8]) -> Result<Vec<u8>, png::EncodingError> {
    let mut out = Vec::new();
    let mut encoder = png::Encoder::new(&mut out, w, h);
    encoder.set_color(png::ColorType::Rgb);
    encoder.set_depth(png::BitDepth::Eight);
    encoder.set_compression(png::Compression::Balanced);
    encoder.set_filter(png::Filter::Adaptive);
    let mut writer = encoder.write_header()?;
    writer.write_image_data(rgb)?;
    writer.finish()?;
    Ok(out)
}

#[cfg(test)]
#[allow(clippy::unwrap_used)]
mod tests {
    use super::*;

    /// Reads a PNG back with the `png` crate's decoder, which checks the signature, every
    /// chunk's CRC and the zlib stream; returns (width, height, RGB pixels row by row).
    fn decode(bytes: &[u8]) -> (usize, usize, Vec<u8>) {
        let mut reader = png::Decoder::new(std::io::Cursor::new(bytes))
            .read_info()
            .unwrap();
        let mut px = vec![0; reader.output_buffer_size().unwrap()];
        let info = reader.next_frame(&mut px).unwrap();
        assert_eq!(info.color_type, png::ColorType::Rgb);
        assert_eq!(info.bit_depth, png::BitDepth::Eight);
        px.truncate(info.buffer_size());
        (info.width as usize, info.height as usize, px)
    }

    fn pixel(px: &[u8], x: f64, y: f64) -> Rgb {
        let i = (y as usize * WIDTH + x as usize) * 3;
        [px[i], px[i + 1], px[i + 2]]
    }

    /// FNV-1a, to pin a whole image in one number.
    fn fnv1a(bytes: &[u8]) -> u64 {
        bytes.iter().fold(0xcbf2_9ce4_8422_2325, |h, &b| {
            (h ^ u64::from(b)).wrapping_mul(0x100_0000_01b3)
        })
    }

    fn series(name: &str, points: Vec<(f64, f64)>) -> Series {
        Series {
            name: name.into(),
            points,
        }
    }

    fn line_chart() -> Chart {
        Chart::Line(LineChart {
            title: "Goodput <on time> & \"late\"".into(),
            x_label: "offered load (req/s)".into(),
            y_label: "on-time goodput, % of offered".into(),
            series: vec![
                series(
                    "slackgate",
                    (0..20).map(|i| (i as f64, (i * i) as f64)).collect(),
                ),
                series(
                    "fifo",
                    vec![(0.0, -50.0), (f64::NAN, 1.0), (10.0, 150.0), (19.0, 300.0)],
                ),
                series("empty", vec![]),
                series("no-finite", vec![(f64::INFINITY, 1.0), (1.0, f64::NAN)]),
                series("single", vec![(7.0, 120.0)]),
            ],
        })
    }

    fn bar_chart() -> Chart {
        Chart::Bar(BarChart {
            title: "On-time share by class".into(),
            y_label: "share (%)".into(),
            categories: vec!["interactive".into(), "batch".into(), "bulk_export".into()],
            groups: vec![
                ("slackgate".into(), vec![10.0, 4.0, 7.5]),
                ("fifo".into(), vec![6.0, f64::NAN, -2.0]),
                ("lifo".into(), vec![3.0, 5.0]),
            ],
        })
    }

    #[test]
    fn png_decodes_to_the_full_size_and_the_pinned_pixels() {
        // The pixel hashes were taken from the hand-written encoder this module used before
        // the `png` crate: changing the encoder changed no pixel.
        for (chart, pixels) in [
            (line_chart(), 0xadae_cd77_6ae1_fa53),
            (bar_chart(), 0x025a_b417_79aa_5435),
        ] {
            let png = chart.to_png().unwrap();
            let (w, h, px) = decode(&png);
            assert_eq!((w, h), (WIDTH, HEIGHT));
            assert_eq!(px.len(), w * h * 3);
            assert_eq!(fnv1a(&px), pixels);
            // Mostly white, so it compresses to a small file.
            assert!(png.len() < 40_000, "{} bytes", png.len());
        }
    }

    #[test]
    fn bars_have_their_colour_and_the_background_stays_white() {
        let (_, _, px) = decode(&bar_chart().to_png().unwrap());
        // The axis runs -2..10 in steps of 2; bars start at 0 (y 375) and "interactive"'s
        // first bar (slackgate, 10) reaches the top of the plot.
        let y = Axis::nice(Some((-2.0, 10.0)), true);
        assert_eq!((y.lo, y.hi), (-2.0, 10.0));
        let slot = (RIGHT - LEFT) / 3.0;
        let bar = slot * 0.8 / 3.0;
        let first = LEFT + slot * 0.1 + bar / 2.0;
        assert_eq!(pixel(&px, first, y.px(5.0, BOTTOM, TOP) + 3.0), colour(0));
        assert_eq!(
            pixel(&px, first + bar, y.px(3.0, BOTTOM, TOP) + 3.0),
            colour(1)
        );
        // Above the second bar (6) and off the grid lines: background.
        assert_eq!(pixel(&px, first + bar, y.px(9.0, BOTTOM, TOP)), BACKGROUND);
        // A negative bar hangs below zero.
        assert_eq!(
            pixel(&px, first + 2.0 * slot + bar, y.px(-1.0, BOTTOM, TOP) + 3.0),
            colour(1)
        );
        assert_eq!(pixel(&px, 3.0, (HEIGHT - 3) as f64), BACKGROUND);
    }

    #[test]
    fn lines_are_drawn_where_the_points_are() {
        let (_, _, px) = decode(&line_chart().to_png().unwrap());
        let (x, y) = (
            Axis::nice(Some((0.0, 19.0)), false),
            Axis::nice(Some((-50.0, 361.0)), false),
        );
        let at = |a, b| pixel(&px, x.px(a, LEFT, RIGHT), y.px(b, BOTTOM, TOP));
        assert_eq!(at(19.0, 361.0), colour(0));
        assert_eq!(at(10.0, 150.0), colour(1));
        assert_eq!(at(7.0, 120.0), colour(4));
    }

    #[test]
    fn svg_has_title_escaped_text_and_one_polyline_per_drawn_series() {
        let svg = line_chart().to_svg();
        assert!(svg.starts_with("<svg xmlns=\"http://www.w3.org/2000/svg\""));
        assert!(svg.ends_with("</svg>\n"));
        assert!(svg.contains(">Goodput &lt;on time&gt; &amp; &quot;late&quot;</text>"));
        // slackgate, fifo and single; not the empty one nor the one without finite points.
        assert_eq!(svg.matches("<polyline").count(), 3);
        for name in ["slackgate", "fifo", "empty", "no-finite", "single"] {
            assert!(svg.contains(&format!(">{name}</text>")), "legend {name}");
        }
        assert!(svg.contains(">-100</text>") && svg.contains(">400</text>"));
        assert!(!svg.contains("NaN") && !svg.contains("inf<") && !svg.contains("-0.00"));
        let bars = bar_chart().to_svg();
        assert!(
            bars.contains(">On-time share by class</text>") && bars.contains("fill=\"#1f77b4\"")
        );
        assert_eq!(bars.matches("<polyline").count(), 0);
    }

    #[test]
    fn output_is_deterministic() {
        for chart in [line_chart(), bar_chart()] {
            assert_eq!(chart.to_svg(), chart.clone().to_svg());
            let (a, b) = (chart.to_png().unwrap(), chart.clone().to_png().unwrap());
            assert_eq!(a, b);
            // Byte for byte through files too, as reports write them.
            let dir = std::env::temp_dir().join(format!("slackgate-chart-{}", std::process::id()));
            write_chart(&dir, "a", &chart).unwrap();
            write_chart(&dir, "b", &chart).unwrap();
            let read = |name: &str| std::fs::read(dir.join(name)).unwrap();
            assert_eq!(read("a.png"), a);
            assert_eq!(read("b.png"), a);
            assert_eq!(read("a.svg"), read("b.svg"));
            std::fs::remove_dir_all(&dir).unwrap();
        }
    }

    #[test]
    fn degenerate_input_does_not_panic() {
        let line = |points| {
            let series = vec![series("s", points)];
            Chart::Line(LineChart {
                title: "t".into(),
                x_label: "x".into(),
                y_label: "y".into(),
                series,
            })
        };
        let bars = |categories: Vec<String>, groups| {
            Chart::Bar(BarChart {
                title: "odd\u{7}é".into(),
                y_label: String::new(),
                categories,
                groups,
            })
        };
        let charts = [
            line(vec![]),
            line(vec![(1.0, 5.0), (1.0, 5.0)]),
            line(vec![(0.0, 0.0), (0.0, 0.0)]),
            line(vec![(-f64::MAX, f64::MAX), (f64::MAX, -f64::MAX)]),
            line(vec![(1e-300, 1e300), (2e-300, -1e300)]),
            bars(vec![], vec![]),
            bars(
                vec!["a".into(), "b".into()],
                vec![
                    ("g".into(), vec![f64::NAN, -3.0, 4.0]),
                    ("h".into(), vec![]),
                ],
            ),
        ];
        for chart in charts {
            let (w, h, px) = decode(&chart.to_png().unwrap());
            assert_eq!((w, h, px.len()), (WIDTH, HEIGHT, WIDTH * HEIGHT * 3));
            let svg = chart.to_svg();
            assert!(!svg.contains("NaN") && !svg.contains('\u{7}'));
        }
    }

    #[test]
    fn ticks_are_round() {
        let a = Axis::nice(Some((0.0, 97.0)), false);
        assert_eq!((a.lo, a.hi, a.step), (0.0, 100.0, 20.0));
        let small = Axis::nice(Some((0.0, 0.23)), false);
        let labels: Vec<String> = small.ticks.iter().map(|&t| small.label(t)).collect();
        assert_eq!(labels, ["0", "0.05", "0.10", "0.15", "0.20", "0.25"]);
        let big = Axis::nice(Some((0.0, 25_000.0)), true);
        assert_eq!(big.label(10_000.0), "10k");
        let flat = Axis::nice(Some((-7.0, -7.0)), false);
        assert!(flat.lo < -7.0 && flat.hi > -7.0 && (3..=10).contains(&flat.ticks.len()));
        assert_eq!(fit("abcdefgh", 5), "abc..");
    }

    /// `write_chart` writes each chart as the SVG and PNG it renders to, creating the
    /// directory. `CHART_EXAMPLE_DIR=/tmp cargo test -p slackgate-sim chart` keeps the files
    /// there to look at; otherwise they go to a scratch directory, removed afterwards.
    #[test]
    fn write_chart_writes_the_svg_and_png_it_renders() {
        let keep = std::env::var_os("CHART_EXAMPLE_DIR").map(std::path::PathBuf::from);
        let dir = keep.clone().unwrap_or_else(|| {
            std::env::temp_dir()
                .join(format!("slackgate-chart-files-{}", std::process::id()))
                .join("nested")
        });
        for (stem, chart) in [
            ("chart_example", line_chart()),
            ("chart_example_bars", bar_chart()),
        ] {
            write_chart(&dir, stem, &chart).unwrap();
            let svg = std::fs::read_to_string(dir.join(format!("{stem}.svg"))).unwrap();
            let png = std::fs::read(dir.join(format!("{stem}.png"))).unwrap();
            assert_eq!(svg, chart.to_svg(), "{stem}.svg");
            assert_eq!(png, chart.to_png().unwrap(), "{stem}.png");
            assert!(
                svg.starts_with("<svg") || svg.starts_with("<?xml"),
                "{stem}.svg"
            );
            assert!(png.starts_with(b"\x89PNG\r\n\x1a\n"), "{stem}.png");
        }
        if keep.is_none() {
            let _ = std::fs::remove_dir_all(dir.parent().unwrap_or(&dir));
        }
    }
}
