//! The run's picture: a PNG with two panels, loss (train and test) and accuracy in percent (test,
//! and train when measured), against the epoch.
//!
//! Drawn here on an RGB buffer with a small bitmap font of our own and encoded with the `png`
//! crate, so that it needs no system font or library: it works the same on a bare CI machine.

use std::path::Path;

use super::metrics::EpochRecord;
use crate::error::{Error, Result};

/// The picture's size in pixels.
pub const WIDTH: usize = 1000;
pub const HEIGHT: usize = 450;

const WHITE: Rgb = [255, 255, 255];
const TEXT: Rgb = [40, 40, 40];
const FRAME: Rgb = [110, 110, 110];
const GRID: Rgb = [228, 228, 228];
/// Train and test series (the blue and orange everybody reads as "first" and "second").
const TRAIN: Rgb = [31, 119, 180];
const TEST: Rgb = [255, 127, 14];

/// Text scale: the font's 5×7 cell drawn as 2×2 pixel blocks (title 3×3).
const SCALE: usize = 2;
const TITLE_SCALE: usize = 3;

/// Draws `history` to a PNG at `path` (replaced atomically). Non-finite values are left out of
/// the lines (a NaN loss makes a gap); an empty history draws empty axes.
pub fn plot_history(history: &[EpochRecord], path: &Path, title: &str) -> Result<()> {
    let mut canvas = Canvas::new(WIDTH, HEIGHT);

    let title = fit_text(title, TITLE_SCALE, WIDTH - 20);
    let tw = text_width(&title, TITLE_SCALE);
    canvas.text((WIDTH - tw) / 2, 10, &title, TITLE_SCALE, TEXT);

    let epochs: Vec<f64> = history.iter().map(|r| r.epoch as f64).collect();
    let loss = Panel {
        title: "loss",
        series: vec![
            Series {
                label: "train",
                color: TRAIN,
                points: zip(&epochs, history.iter().map(|r| r.train_loss)),
            },
            Series {
                label: "test",
                color: TEST,
                points: zip(&epochs, history.iter().map(|r| r.test_loss)),
            },
        ],
        clamp: None,
    };
    let mut acc_series = Vec::new();
    // Epochs where the train accuracy was not measured are left out (the line joins over them);
    // a NaN one is a gap, as everywhere.
    let train_acc: Vec<(f64, f64)> = history
        .iter()
        .filter_map(|r| Some((r.epoch as f64, 100.0 * r.train_accuracy?)))
        .collect();
    if !train_acc.is_empty() {
        acc_series.push(Series {
            label: "train",
            color: TRAIN,
            points: train_acc,
        });
    }
    acc_series.push(Series {
        label: "test",
        color: TEST,
        points: zip(&epochs, history.iter().map(|r| 100.0 * r.test_accuracy)),
    });
    let accuracy = Panel {
        title: "accuracy %",
        series: acc_series,
        clamp: Some((0.0, 100.0)),
    };

    let top = 56;
    let half = WIDTH / 2;
    draw_panel(&mut canvas, &loss, 0, half, top, HEIGHT);
    draw_panel(&mut canvas, &accuracy, half, WIDTH, top, HEIGHT);

    let png = canvas.encode_png().map_err(|e| {
        Error::io(
            format!("encoding {}", path.display()),
            std::io::Error::other(e),
        )
    })?;
    super::write_atomic(path, &png)
}

fn zip(xs: &[f64], ys: impl Iterator<Item = f64>) -> Vec<(f64, f64)> {
    xs.iter().copied().zip(ys).collect()
}

struct Series {
    label: &'static str,
    color: Rgb,
    /// (epoch, value); non-finite values are gaps.
    points: Vec<(f64, f64)>,
}

struct Panel {
    title: &'static str,
    series: Vec<Series>,
    /// Bounds the y axis never goes past (accuracy stays within 0..100).
    clamp: Option<(f64, f64)>,
}

/// Draws one panel in the column `[x0, x1)` of the canvas, between rows `y0` and `y1`.
fn draw_panel(c: &mut Canvas, p: &Panel, x0: usize, x1: usize, y0: usize, y1: usize) {
    let line_h = glyph_height(SCALE);

    // Y axis: nice ticks over the finite values.
    let ys = p
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|&(_, y)| y));
    let (ylo, yhi) = padded_range(ys, p.clamp);
    let mut yticks = nice_ticks(ylo, yhi, 5);
    if let Some((cl, ch)) = p.clamp {
        yticks.retain(|&t| t >= cl - 1e-9 && t <= ch + 1e-9);
    }
    if yticks.len() < 2 {
        yticks = vec![ylo, yhi];
    }
    let (ylo, yhi) = (
        yticks.first().copied().unwrap_or(ylo),
        yticks.last().copied().unwrap_or(yhi),
    );
    let ystep = tick_step(&yticks);
    let ylabels: Vec<String> = yticks.iter().map(|&t| format_tick(t, ystep)).collect();
    let label_w = ylabels
        .iter()
        .map(|l| text_width(l, SCALE))
        .max()
        .unwrap_or(0);

    // X axis: epochs, integer ticks, half an epoch of room at either end.
    let (xmin, xmax) = p
        .series
        .iter()
        .flat_map(|s| s.points.iter().map(|&(x, _)| x))
        .fold(None, |acc: Option<(f64, f64)>, x| {
            Some(acc.map_or((x, x), |(a, b)| (a.min(x), b.max(x))))
        })
        .unwrap_or((1.0, 1.0));
    let (xlo, xhi) = (xmin - 0.5, xmax + 0.5);
    let xticks: Vec<f64> = {
        let step = nice_step((xmax - xmin) / 8.0).max(1.0).round();
        let mut t = (xlo / step).ceil() * step;
        let mut v = Vec::new();
        while t <= xhi + 1e-9 {
            v.push(t);
            t += step;
        }
        v
    };

    // The plot area, inside room for the labels.
    let left = x0 + 16 + label_w + 8;
    let right = x1 - 24;
    let top = y0 + line_h + 10;
    let bottom = y1 - 2 * line_h - 24;
    let area = Area {
        left,
        right,
        top,
        bottom,
        xlo,
        xhi,
        ylo,
        yhi,
    };

    // Panel title on the left, legend on the right, on one line above the plot area.
    c.text(left, y0, p.title, SCALE, TEXT);
    let mut lx = right;
    for s in p.series.iter().rev() {
        lx = lx.saturating_sub(text_width(s.label, SCALE));
        c.text(lx, y0, s.label, SCALE, TEXT);
        lx = lx.saturating_sub(8 + 24);
        let ly = (y0 + glyph_cap_height(SCALE) / 2) as f64;
        c.line(lx as f64, ly, (lx + 24) as f64, ly, 2.5, s.color);
        lx = lx.saturating_sub(18);
    }

    // Grid, ticks and their labels.
    for (t, l) in yticks.iter().zip(&ylabels) {
        let y = area.py(*t).round() as usize;
        c.hline(left, right, y, GRID);
        c.hline(left - 5, left, y, FRAME);
        let ty = y.saturating_sub(glyph_cap_height(SCALE) / 2);
        c.text(
            left.saturating_sub(8 + text_width(l, SCALE)),
            ty,
            l,
            SCALE,
            TEXT,
        );
    }
    for &t in &xticks {
        let x = area.px(t).round() as usize;
        c.vline(x, top, bottom, GRID);
        c.vline(x, bottom, bottom + 5, FRAME);
        let l = format!("{}", t as i64);
        c.text(
            x.saturating_sub(text_width(&l, SCALE) / 2),
            bottom + 9,
            &l,
            SCALE,
            TEXT,
        );
    }
    let xl = "epoch";
    c.text(
        (left + right - text_width(xl, SCALE)) / 2,
        bottom + 9 + line_h + 6,
        xl,
        SCALE,
        TEXT,
    );
    c.rect_outline(left, top, right, bottom, FRAME);

    draw_series(c, p, &area);
}

/// A panel's data inside its plot `area` (see `draw_panel`).
fn draw_series(c: &mut Canvas, p: &Panel, area: &Area) {
    let (left, right, top, bottom) = (area.left, area.right, area.top, area.bottom);
    let line_h = glyph_height(SCALE);
    // The data: lines between consecutive finite points, markers when there are few of them;
    // nothing past the frame (a clamped axis can leave values out of range) but a marker's width,
    // so that a line along the frame (accuracy 100%) shows whole.
    let m = 4;
    c.clip = Some((
        left as i64 - m,
        top as i64 - m,
        right as i64 + m,
        bottom as i64 + m,
    ));
    let many = p.series.iter().map(|s| s.points.len()).max().unwrap_or(0) > 40;
    for s in &p.series {
        let mut prev: Option<(f64, f64)> = None;
        for &(x, y) in &s.points {
            if !plottable(y) {
                prev = None;
                continue;
            }
            let (px, py) = (area.px(x), area.py(y));
            if let Some((qx, qy)) = prev {
                c.line(qx, qy, px, py, 2.5, s.color);
            }
            if !many {
                c.disc(px, py, 3.5, s.color);
            }
            prev = Some((px, py));
        }
        // A point with no finite neighbour would be invisible without a marker.
        if many {
            for (i, &(x, y)) in s.points.iter().enumerate() {
                let finite = |j: usize| s.points.get(j).is_some_and(|p| plottable(p.1));
                if plottable(y) && !(i > 0 && finite(i - 1)) && !finite(i + 1) {
                    c.disc(area.px(x), area.py(y), 3.0, s.color);
                }
            }
        }
    }
    c.clip = None;

    // A diverged run: say so rather than show an empty frame.
    let has_points = p.series.iter().any(|s| !s.points.is_empty());
    let any_finite = p
        .series
        .iter()
        .any(|s| s.points.iter().any(|&(_, y)| plottable(y)));
    if has_points && !any_finite {
        let note = "no finite values";
        let x = (left + right).saturating_sub(text_width(note, SCALE)) / 2;
        c.text(x, (top + bottom) / 2 - line_h / 2, note, SCALE, FRAME);
    }
}

/// Maps data coordinates to pixels.
struct Area {
    left: usize,
    right: usize,
    top: usize,
    bottom: usize,
    xlo: f64,
    xhi: f64,
    ylo: f64,
    yhi: f64,
}

impl Area {
    fn px(&self, x: f64) -> f64 {
        self.left as f64 + (x - self.xlo) / (self.xhi - self.xlo) * (self.right - self.left) as f64
    }

    fn py(&self, y: f64) -> f64 {
        self.bottom as f64
            - (y - self.ylo) / (self.yhi - self.ylo) * (self.bottom - self.top) as f64
    }
}

/// Whether a value is drawn: finite, and not so large that the axis arithmetic would overflow
/// (a loss of 1e300 has diverged as surely as an infinite one).
fn plottable(v: f64) -> bool {
    v.is_finite() && v.abs() < 1e300
}

/// The range of the finite values with a little room, widened when flat, `(0, 1)` when there are
/// none; within `clamp` when given.
fn padded_range(values: impl Iterator<Item = f64>, clamp: Option<(f64, f64)>) -> (f64, f64) {
    let (lo, hi) = values
        .filter(|v| plottable(*v))
        .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), v| {
            (a.min(v), b.max(v))
        });
    let (mut lo, mut hi) = if lo > hi {
        clamp.unwrap_or((0.0, 1.0))
    } else if hi - lo <= 1e-9 * hi.abs().max(lo.abs()).max(1e-300) {
        // A flat line: centre it in a band of ±10% of its value (±1 around zero).
        let half = if lo == 0.0 { 1.0 } else { 0.1 * lo.abs() };
        (lo - half, hi + half)
    } else {
        // Room of 5% either side, but not across zero: losses start from 0, not -0.1.
        let pad = 0.05 * (hi - lo);
        let padded_lo = if lo >= 0.0 {
            (lo - pad).max(0.0)
        } else {
            lo - pad
        };
        let padded_hi = if hi <= 0.0 {
            (hi + pad).min(0.0)
        } else {
            hi + pad
        };
        (padded_lo, padded_hi)
    };
    if let Some((cl, ch)) = clamp {
        lo = lo.max(cl);
        hi = hi.min(ch);
        if lo >= hi {
            (lo, hi) = (cl, ch);
        }
    }
    (lo, hi)
}

/// 1, 2 or 5 times a power of ten, the smallest not below `raw`.
fn nice_step(raw: f64) -> f64 {
    if !(raw.is_finite() && raw > 0.0) {
        return 1.0;
    }
    let mag = 10f64.powf(raw.log10().floor());
    let f = raw / mag;
    let nice = if f <= 1.0 {
        1.0
    } else if f <= 2.0 {
        2.0
    } else if f <= 5.0 {
        5.0
    } else {
        10.0
    };
    nice * mag
}

/// About `target` round ticks whose first and last enclose `[lo, hi]`.
fn nice_ticks(lo: f64, hi: f64, target: usize) -> Vec<f64> {
    let step = nice_step((hi - lo) / target as f64);
    // The tolerance keeps a bound that is a multiple of the step (up to rounding) a tick itself.
    let first = (lo / step + 1e-9).floor();
    let last = (hi / step - 1e-9).ceil();
    if !(first.is_finite() && last.is_finite()) || last - first > 50.0 {
        return vec![lo, hi];
    }
    // Multiples of the step, computed as such (no accumulated rounding, no "-0").
    (first as i64..=last as i64)
        .map(|k| {
            let t = k as f64 * step;
            if k == 0 {
                0.0
            } else {
                t
            }
        })
        .collect()
}

fn tick_step(ticks: &[f64]) -> f64 {
    match ticks {
        [a, b, ..] => b - a,
        _ => 1.0,
    }
}

/// A tick label with as many decimals as the step needs; scientific when that would be long.
fn format_tick(v: f64, step: f64) -> String {
    let decimals = (-step.log10().floor()).max(0.0) as usize;
    if decimals > 4 || v.abs() >= 1e6 {
        if v == 0.0 {
            return "0".to_string();
        }
        let s = format!("{v:.1e}");
        // "2.0e-5" → "2e-5"
        return s.replace(".0e", "e");
    }
    format!("{v:.decimals$}")
}

/// Shortens `s` with ".." until it fits in `max_w` pixels.
fn fit_text(s: &str, scale: usize, max_w: usize) -> String {
    if text_width(s, scale) <= max_w {
        return s.to_string();
    }
    // n characters take (n * ADVANCE - 1) * scale pixels; keep room for the two dots.
    let fits = (max_w / scale + 1) / ADVANCE;
    let mut out: String = s.chars().take(fits.saturating_sub(2)).collect();
    out.push_str("..");
    out
}

type Rgb = [u8; 3];

struct Canvas {
    w: usize,
    h: usize,
    px: Vec<u8>,
    /// When set, drawing outside `(left, top, right, bottom)` (inclusive) does nothing.
    clip: Option<(i64, i64, i64, i64)>,
}

impl Canvas {
    fn new(w: usize, h: usize) -> Self {
        Canvas {
            w,
            h,
            px: WHITE.repeat(w * h),
            clip: None,
        }
    }

    /// Mixes `color` into the pixel with weight `alpha`; outside the canvas does nothing.
    fn blend(&mut self, x: i64, y: i64, color: Rgb, alpha: f64) {
        if x < 0 || y < 0 || x as usize >= self.w || y as usize >= self.h || alpha <= 0.0 {
            return;
        }
        if let Some((l, t, r, b)) = self.clip {
            if x < l || x > r || y < t || y > b {
                return;
            }
        }
        let a = alpha.min(1.0);
        let i = 3 * (y as usize * self.w + x as usize);
        for (k, &c) in color.iter().enumerate() {
            let old = self.px[i + k] as f64;
            self.px[i + k] = (old + (c as f64 - old) * a).round() as u8;
        }
    }

    fn set(&mut self, x: usize, y: usize, color: Rgb) {
        self.blend(x as i64, y as i64, color, 1.0);
    }

    fn hline(&mut self, x0: usize, x1: usize, y: usize, color: Rgb) {
        for x in x0..=x1 {
            self.set(x, y, color);
        }
    }

    fn vline(&mut self, x: usize, y0: usize, y1: usize, color: Rgb) {
        for y in y0..=y1 {
            self.set(x, y, color);
        }
    }

    fn rect_outline(&mut self, x0: usize, y0: usize, x1: usize, y1: usize, color: Rgb) {
        self.hline(x0, x1, y0, color);
        self.hline(x0, x1, y1, color);
        self.vline(x0, y0, y1, color);
        self.vline(x1, y0, y1, color);
    }

    /// An antialiased segment `width` pixels wide with round ends.
    fn line(&mut self, x0: f64, y0: f64, x1: f64, y1: f64, width: f64, color: Rgb) {
        let r = width / 2.0;
        let (dx, dy) = (x1 - x0, y1 - y0);
        let len2 = dx * dx + dy * dy;
        let xa = (x0.min(x1) - r - 1.0).floor() as i64;
        let xb = (x0.max(x1) + r + 1.0).ceil() as i64;
        let ya = (y0.min(y1) - r - 1.0).floor() as i64;
        let yb = (y0.max(y1) + r + 1.0).ceil() as i64;
        for y in ya.max(0)..=yb.min(self.h as i64 - 1) {
            for x in xa.max(0)..=xb.min(self.w as i64 - 1) {
                // Distance from the pixel's centre to the segment.
                let (cx, cy) = (x as f64 + 0.5, y as f64 + 0.5);
                let t = if len2 > 0.0 {
                    (((cx - x0) * dx + (cy - y0) * dy) / len2).clamp(0.0, 1.0)
                } else {
                    0.0
                };
                let (ex, ey) = (cx - (x0 + t * dx), cy - (y0 + t * dy));
                let d = (ex * ex + ey * ey).sqrt();
                self.blend(x, y, color, r + 0.5 - d);
            }
        }
    }

    fn disc(&mut self, x: f64, y: f64, r: f64, color: Rgb) {
        self.line(x, y, x, y, 2.0 * r, color);
    }

    fn text(&mut self, x: usize, y: usize, s: &str, scale: usize, color: Rgb) {
        let mut cx = x;
        for ch in s.chars() {
            let rows = glyph(ch);
            for (row, bits) in rows.iter().enumerate() {
                for col in 0..GLYPH_W {
                    if bits & (1 << (GLYPH_W - 1 - col)) != 0 {
                        for sy in 0..scale {
                            for sx in 0..scale {
                                self.set(cx + col * scale + sx, y + row * scale + sy, color);
                            }
                        }
                    }
                }
            }
            cx += ADVANCE * scale;
        }
    }

    fn encode_png(&self) -> std::result::Result<Vec<u8>, png::EncodingError> {
        let mut out = Vec::new();
        {
            let mut enc = png::Encoder::new(&mut out, self.w as u32, self.h as u32);
            enc.set_color(png::ColorType::Rgb);
            enc.set_depth(png::BitDepth::Eight);
            let mut writer = enc.write_header()?;
            writer.write_image_data(&self.px)?;
            writer.finish()?;
        }
        Ok(out)
    }
}

// ---- the font ------------------------------------------------------------------------------
//
// 5 columns × 9 rows a glyph: rows 0..7 are the letter (capitals and digits fill them, lower case
// starts at row 2), rows 7..9 are descenders. Bit 4 of a row is its leftmost column.

const GLYPH_W: usize = 5;
/// A glyph's width plus one column of space.
const ADVANCE: usize = GLYPH_W + 1;

fn text_width(s: &str, scale: usize) -> usize {
    let n = s.chars().count();
    if n == 0 {
        0
    } else {
        (n * ADVANCE - 1) * scale
    }
}

/// Height of a line of text, descenders included.
fn glyph_height(scale: usize) -> usize {
    9 * scale
}

/// Height of capitals and digits.
fn glyph_cap_height(scale: usize) -> usize {
    7 * scale
}

/// The rows of `ch`'s glyph; a hollow box for a character the font lacks.
fn glyph(ch: char) -> [u8; 9] {
    if ch == ' ' {
        return [0; 9];
    }
    FONT.iter()
        .find(|(c, _)| *c == ch)
        .map(|(_, g)| *g)
        .unwrap_or(MISSING)
}

const MISSING: [u8; 9] = [
    0b11111, 0b10001, 0b10001, 0b10001, 0b10001, 0b10001, 0b11111, 0, 0,
];

#[rustfmt::skip]
const FONT: &[(char, [u8; 9])] = &[
    ('0', [0b01110, 0b10001, 0b10011, 0b10101, 0b11001, 0b10001, 0b01110, 0, 0]),
    ('1', [0b00100, 0b01100, 0b00100, 0b00100, 0b00100, 0b00100, 0b01110, 0, 0]),
    ('2', [0b01110, 0b10001, 0b00001, 0b00010, 0b00100, 0b01000, 0b11111, 0, 0]),
    ('3', [0b11111, 0b00010, 0b00100, 0b00010, 0b00001, 0b10001, 0b01110, 0, 0]),
    ('4', [0b00010, 0b00110, 0b01010, 0b10010, 0b11111, 0b00010, 0b00010, 0, 0]),
    ('5', [0b11111, 0b10000, 0b11110, 0b00001, 0b00001, 0b10001, 0b01110, 0, 0]),
    ('6', [0b00110, 0b01000, 0b10000, 0b11110, 0b10001, 0b10001, 0b01110, 0, 0]),
    ('7', [0b11111, 0b00001, 0b00010, 0b00100, 0b01000, 0b01000, 0b01000, 0, 0]),
    ('8', [0b01110, 0b10001, 0b10001, 0b01110, 0b10001, 0b10001, 0b01110, 0, 0]),
    ('9', [0b01110, 0b10001, 0b10001, 0b01111, 0b00001, 0b00010, 0b01100, 0, 0]),
    ('A', [0b01110, 0b10001, 0b10001, 0b11111, 0b10001, 0b10001, 0b10001, 0, 0]),
    ('B', [0b11110, 0b10001, 0b10001, 0b11110, 0b10001, 0b10001, 0b11110, 0, 0]),
    ('C', [0b01110, 0b10001, 0b10000, 0b10000, 0b10000, 0b10001, 0b01110, 0, 0]),
    ('D', [0b11100, 0b10010, 0b10001, 0b10001, 0b10001, 0b10010, 0b11100, 0, 0]),
    ('E', [0b11111, 0b10000, 0b10000, 0b11110, 0b10000, 0b10000, 0b11111, 0, 0]),
    ('F', [0b11111, 0b10000, 0b10000, 0b11110, 0b10000, 0b10000, 0b10000, 0, 0]),
    ('G', [0b01110, 0b10001, 0b10000, 0b10111, 0b10001, 0b10001, 0b01111, 0, 0]),
    ('H', [0b10001, 0b10001, 0b10001, 0b11111, 0b10001, 0b10001, 0b10001, 0, 0]),
    ('I', [0b01110, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b01110, 0, 0]),
    ('J', [0b00111, 0b00010, 0b00010, 0b00010, 0b00010, 0b10010, 0b01100, 0, 0]),
    ('K', [0b10001, 0b10010, 0b10100, 0b11000, 0b10100, 0b10010, 0b10001, 0, 0]),
    ('L', [0b10000, 0b10000, 0b10000, 0b10000, 0b10000, 0b10000, 0b11111, 0, 0]),
    ('M', [0b10001, 0b11011, 0b10101, 0b10101, 0b10001, 0b10001, 0b10001, 0, 0]),
    ('N', [0b10001, 0b10001, 0b11001, 0b10101, 0b10011, 0b10001, 0b10001, 0, 0]),
    ('O', [0b01110, 0b10001, 0b10001, 0b10001, 0b10001, 0b10001, 0b01110, 0, 0]),
    ('P', [0b11110, 0b10001, 0b10001, 0b11110, 0b10000, 0b10000, 0b10000, 0, 0]),
    ('Q', [0b01110, 0b10001, 0b10001, 0b10001, 0b10101, 0b10010, 0b01101, 0, 0]),
    ('R', [0b11110, 0b10001, 0b10001, 0b11110, 0b10100, 0b10010, 0b10001, 0, 0]),
    ('S', [0b01111, 0b10000, 0b10000, 0b01110, 0b00001, 0b00001, 0b11110, 0, 0]),
    ('T', [0b11111, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0, 0]),
    ('U', [0b10001, 0b10001, 0b10001, 0b10001, 0b10001, 0b10001, 0b01110, 0, 0]),
    ('V', [0b10001, 0b10001, 0b10001, 0b10001, 0b10001, 0b01010, 0b00100, 0, 0]),
    ('W', [0b10001, 0b10001, 0b10001, 0b10101, 0b10101, 0b10101, 0b01010, 0, 0]),
    ('X', [0b10001, 0b10001, 0b01010, 0b00100, 0b01010, 0b10001, 0b10001, 0, 0]),
    ('Y', [0b10001, 0b10001, 0b10001, 0b01010, 0b00100, 0b00100, 0b00100, 0, 0]),
    ('Z', [0b11111, 0b00001, 0b00010, 0b00100, 0b01000, 0b10000, 0b11111, 0, 0]),
    ('a', [0, 0, 0b01110, 0b00001, 0b01111, 0b10001, 0b01111, 0, 0]),
    ('b', [0b10000, 0b10000, 0b10110, 0b11001, 0b10001, 0b10001, 0b11110, 0, 0]),
    ('c', [0, 0, 0b01110, 0b10000, 0b10000, 0b10001, 0b01110, 0, 0]),
    ('d', [0b00001, 0b00001, 0b01101, 0b10011, 0b10001, 0b10001, 0b01111, 0, 0]),
    ('e', [0, 0, 0b01110, 0b10001, 0b11111, 0b10000, 0b01110, 0, 0]),
    ('f', [0b00110, 0b01001, 0b01000, 0b11100, 0b01000, 0b01000, 0b01000, 0, 0]),
    ('g', [0, 0, 0b01111, 0b10001, 0b10001, 0b10001, 0b01111, 0b00001, 0b01110]),
    ('h', [0b10000, 0b10000, 0b10110, 0b11001, 0b10001, 0b10001, 0b10001, 0, 0]),
    ('i', [0b00100, 0, 0b01100, 0b00100, 0b00100, 0b00100, 0b01110, 0, 0]),
    ('j', [0b00010, 0, 0b00110, 0b00010, 0b00010, 0b00010, 0b00010, 0b10010, 0b01100]),
    ('k', [0b10000, 0b10000, 0b10010, 0b10100, 0b11000, 0b10100, 0b10010, 0, 0]),
    ('l', [0b01100, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b01110, 0, 0]),
    ('m', [0, 0, 0b11010, 0b10101, 0b10101, 0b10001, 0b10001, 0, 0]),
    ('n', [0, 0, 0b10110, 0b11001, 0b10001, 0b10001, 0b10001, 0, 0]),
    ('o', [0, 0, 0b01110, 0b10001, 0b10001, 0b10001, 0b01110, 0, 0]),
    ('p', [0, 0, 0b11110, 0b10001, 0b10001, 0b10001, 0b11110, 0b10000, 0b10000]),
    ('q', [0, 0, 0b01111, 0b10001, 0b10001, 0b10001, 0b01111, 0b00001, 0b00001]),
    ('r', [0, 0, 0b10110, 0b11001, 0b10000, 0b10000, 0b10000, 0, 0]),
    ('s', [0, 0, 0b01111, 0b10000, 0b01110, 0b00001, 0b11110, 0, 0]),
    ('t', [0b01000, 0b01000, 0b11100, 0b01000, 0b01000, 0b01001, 0b00110, 0, 0]),
    ('u', [0, 0, 0b10001, 0b10001, 0b10001, 0b10011, 0b01101, 0, 0]),
    ('v', [0, 0, 0b10001, 0b10001, 0b10001, 0b01010, 0b00100, 0, 0]),
    ('w', [0, 0, 0b10001, 0b10001, 0b10101, 0b10101, 0b01010, 0, 0]),
    ('x', [0, 0, 0b10001, 0b01010, 0b00100, 0b01010, 0b10001, 0, 0]),
    ('y', [0, 0, 0b10001, 0b10001, 0b10001, 0b10001, 0b01111, 0b00001, 0b01110]),
    ('z', [0, 0, 0b11111, 0b00010, 0b00100, 0b01000, 0b11111, 0, 0]),
    ('.', [0, 0, 0, 0, 0, 0b01100, 0b01100, 0, 0]),
    (',', [0, 0, 0, 0, 0, 0b01100, 0b01100, 0b00100, 0b01000]),
    (':', [0, 0b01100, 0b01100, 0, 0b01100, 0b01100, 0, 0, 0]),
    (';', [0, 0b01100, 0b01100, 0, 0b01100, 0b01100, 0b00100, 0b01000, 0]),
    ('%', [0b11000, 0b11001, 0b00010, 0b00100, 0b01000, 0b10011, 0b00011, 0, 0]),
    ('-', [0, 0, 0, 0b01110, 0, 0, 0, 0, 0]),
    ('+', [0, 0b00100, 0b00100, 0b11111, 0b00100, 0b00100, 0, 0, 0]),
    ('=', [0, 0, 0b11111, 0, 0b11111, 0, 0, 0, 0]),
    ('_', [0, 0, 0, 0, 0, 0, 0, 0, 0b11111]),
    ('/', [0b00001, 0b00001, 0b00010, 0b00100, 0b01000, 0b10000, 0b10000, 0, 0]),
    ('(', [0b00010, 0b00100, 0b01000, 0b01000, 0b01000, 0b00100, 0b00010, 0, 0]),
    (')', [0b01000, 0b00100, 0b00010, 0b00010, 0b00010, 0b00100, 0b01000, 0, 0]),
    ('[', [0b01110, 0b01000, 0b01000, 0b01000, 0b01000, 0b01000, 0b01110, 0, 0]),
    (']', [0b01110, 0b00010, 0b00010, 0b00010, 0b00010, 0b00010, 0b01110, 0, 0]),
    ('#', [0b01010, 0b01010, 0b11111, 0b01010, 0b11111, 0b01010, 0b01010, 0, 0]),
    ('\'', [0b00100, 0b00100, 0b01000, 0, 0, 0, 0, 0, 0]),
    ('"', [0b01010, 0b01010, 0, 0, 0, 0, 0, 0, 0]),
    ('!', [0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0, 0b00100, 0, 0]),
    ('?', [0b01110, 0b10001, 0b00001, 0b00010, 0b00100, 0, 0b00100, 0, 0]),
    ('<', [0b00010, 0b00100, 0b01000, 0b10000, 0b01000, 0b00100, 0b00010, 0, 0]),
    ('>', [0b01000, 0b00100, 0b00010, 0b00001, 0b00010, 0b00100, 0b01000, 0, 0]),
    ('*', [0, 0b00100, 0b10101, 0b01110, 0b10101, 0b00100, 0, 0, 0]),
    ('@', [0b01110, 0b10001, 0b10111, 0b10101, 0b10111, 0b10000, 0b01110, 0, 0]),
    ('&', [0b01100, 0b10010, 0b10100, 0b01000, 0b10101, 0b10010, 0b01101, 0, 0]),
    ('|', [0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0b00100, 0, 0]),
    ('~', [0, 0, 0b01000, 0b10101, 0b00010, 0, 0, 0, 0]),
];
