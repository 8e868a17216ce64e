//! PNG output: the canvas painted into an RGB buffer, glyphs from the DejaVu Sans
//! Mono file committed beside the crate (no system fonts, no system libraries).

use crate::canvas::{Anchor, Canvas, Item, Rgb};
use ab_glyph::{Font, FontRef, PxScale, ScaleFont};

const FONT: &[u8] = include_bytes!("../fonts/DejaVuSansMono.ttf");

struct Pixmap {
    w: usize,
    h: usize,
    px: Vec<u8>,
}

impl Pixmap {
    fn blend(&mut self, x: i64, y: i64, c: Rgb, a: f32) {
        if x < 0 || y < 0 || x as usize >= self.w || y as usize >= self.h || a <= 0.0 {
            return;
        }
        let a = a.min(1.0);
        let i = 3 * (y as usize * self.w + x as usize);
        for (k, v) in [c.0, c.1, c.2].into_iter().enumerate() {
            let old = self.px[i + k] as f32;
            self.px[i + k] = (old + (v as f32 - old) * a).round() as u8;
        }
    }

    /// Fills a rectangle with coverage at its fractional edges, so thin boxes (a
    /// short task on a long timeline) stay visible as a faint line.
    fn fill(&mut self, x: f64, y: f64, w: f64, h: f64, c: Rgb) {
        let (x0, x1) = (x.max(0.0), (x + w).min(self.w as f64));
        let (y0, y1) = (y.max(0.0), (y + h).min(self.h as f64));
        if x1 <= x0 || y1 <= y0 {
            return;
        }
        for py in y0.floor() as i64..y1.ceil() as i64 {
            let cy = (y1.min(py as f64 + 1.0) - y0.max(py as f64)).clamp(0.0, 1.0);
            for px in x0.floor() as i64..x1.ceil() as i64 {
                let cx = (x1.min(px as f64 + 1.0) - x0.max(px as f64)).clamp(0.0, 1.0);
                self.blend(px, py, c, (cx * cy) as f32);
            }
        }
    }
}

/// Paints `canvas` at `scale` device pixels per px and encodes it as PNG.
pub fn to_png(canvas: &Canvas, scale: f64) -> Result<Vec<u8>, String> {
    let font = FontRef::try_from_slice(FONT).map_err(|e| format!("embedded font: {e}"))?;
    let w = (canvas.width * scale).ceil().max(1.0) as usize;
    let h = (canvas.height * scale).ceil().max(1.0) as usize;
    let mut pm = Pixmap {
        w,
        h,
        px: vec![255; 3 * w * h],
    };
    for item in &canvas.items {
        match item {
            Item::Rect {
                x,
                y,
                w,
                h,
                fill,
                stroke,
                ..
            } => {
                let (x, y, w, h) = (x * scale, y * scale, w * scale, h * scale);
                if let Some(c) = fill {
                    pm.fill(x, y, w, h, *c);
                }
                if let Some((c, sw)) = stroke {
                    let t = (sw * scale).max(1.0);
                    pm.fill(x - t / 2.0, y - t / 2.0, w + t, t, *c);
                    pm.fill(x - t / 2.0, y + h - t / 2.0, w + t, t, *c);
                    pm.fill(x - t / 2.0, y - t / 2.0, t, h + t, *c);
                    pm.fill(x + w - t / 2.0, y - t / 2.0, t, h + t, *c);
                }
            }
            Item::Line {
                x1,
                y1,
                x2,
                y2,
                color,
                width,
                dashed,
                ..
            } => {
                let t = (width * scale).max(1.0);
                let (x1, y1, x2, y2) = (x1 * scale, y1 * scale, x2 * scale, y2 * scale);
                let len = ((x2 - x1).powi(2) + (y2 - y1).powi(2)).sqrt();
                let steps = len.ceil().max(1.0) as usize;
                for k in 0..=steps {
                    let f = k as f64 / steps as f64;
                    // Dashes of 6 on, 4 off (in px), as the SVG's dasharray.
                    if *dashed && (f * len / scale) % 10.0 >= 6.0 {
                        continue;
                    }
                    let (cx, cy) = (x1 + (x2 - x1) * f, y1 + (y2 - y1) * f);
                    pm.fill(cx - t / 2.0, cy - t / 2.0, t, t, *color);
                }
            }
            Item::Text {
                x,
                y,
                size,
                anchor,
                color,
                text,
                ..
            } => draw_text(
                &mut pm,
                &font,
                x * scale,
                y * scale,
                size * scale,
                *anchor,
                *color,
                text,
            ),
        }
    }
    let mut out = Vec::new();
    {
        let mut enc = png::Encoder::new(&mut out, w as u32, h as u32);
        enc.set_color(png::ColorType::Rgb);
        enc.set_depth(png::BitDepth::Eight);
        let mut writer = enc.write_header().map_err(|e| e.to_string())?;
        writer.write_image_data(&pm.px).map_err(|e| e.to_string())?;
    }
    Ok(out)
}

#[allow(clippy::too_many_arguments)]
fn draw_text(
    pm: &mut Pixmap,
    font: &FontRef<'_>,
    x: f64,
    y: f64,
    size: f64,
    anchor: Anchor,
    color: Rgb,
    text: &str,
) {
    let scaled = font.as_scaled(PxScale::from(size as f32));
    let width: f32 = text
        .chars()
        .map(|c| scaled.h_advance(font.glyph_id(c)))
        .sum();
    let mut pen = x as f32
        - match anchor {
            Anchor::Start => 0.0,
            Anchor::Middle => width / 2.0,
            Anchor::End => width,
        };
    for c in text.chars() {
        let id = font.glyph_id(c);
        let glyph = id.with_scale_and_position(size as f32, ab_glyph::point(pen, y as f32));
        if let Some(outline) = font.outline_glyph(glyph) {
            let b = outline.px_bounds();
            outline.draw(|gx, gy, cov| {
                pm.blend(
                    b.min.x as i64 + gx as i64,
                    b.min.y as i64 + gy as i64,
                    color,
                    cov,
                );
            });
        }
        pen += scaled.h_advance(id);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn png_has_the_canvas_size_and_paints_text_and_boxes() {
        let mut c = Canvas::new(60.0, 20.0);
        c.rect(0.0, 0.0, 10.0, 10.0, Rgb(255, 0, 0), "box");
        c.text(20.0, 15.0, 12.0, Anchor::Start, "Ag", "t");
        let bytes = to_png(&c, 2.0).unwrap();
        let dec = png::Decoder::new(std::io::Cursor::new(bytes));
        let mut r = dec.read_info().unwrap();
        let mut buf = vec![0; r.output_buffer_size()];
        let info = r.next_frame(&mut buf).unwrap();
        assert_eq!((info.width, info.height), (120, 40));
        // The box's inside is red; the text region holds dark pixels.
        assert_eq!(&buf[3 * (5 * 120 + 5)..3 * (5 * 120 + 5) + 3], &[255, 0, 0]);
        let dark = (0..40)
            .flat_map(|y| (40..120).map(move |x| (x, y)))
            .filter(|(x, y)| buf[3 * (y * 120 + x)] < 100)
            .count();
        assert!(dark > 20, "{dark} dark pixels");
    }
}
