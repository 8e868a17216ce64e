//! A picture as a list of shapes, written as SVG text or rasterised to PNG. The
//! shapes keep what they stand for (`class` and `data-*` attributes), so tests check
//! a picture's meaning on the structure the SVG is written from, and the SVG itself
//! stays diffable.

use std::fmt::Write as _;

/// An RGB colour.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Rgb(pub u8, pub u8, pub u8);

impl Rgb {
    fn hex(self) -> String {
        format!("#{:02x}{:02x}{:02x}", self.0, self.1, self.2)
    }
}

/// Text alignment about its x coordinate.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Anchor {
    /// Text starts at x.
    Start,
    /// Text is centred on x.
    Middle,
    /// Text ends at x.
    End,
}

/// One shape.
#[derive(Clone, Debug, PartialEq)]
pub enum Item {
    /// An axis-aligned rectangle.
    Rect {
        /// Left, px.
        x: f64,
        /// Top, px.
        y: f64,
        /// Width, px.
        w: f64,
        /// Height, px.
        h: f64,
        /// Fill, or none.
        fill: Option<Rgb>,
        /// Outline and its width, or none.
        stroke: Option<(Rgb, f64)>,
        /// What it stands for (`fwd`, `bwd`, `bubble`, `mem-params`, `node`, ...).
        class: String,
        /// `data-*` attributes, in order.
        data: Vec<(&'static str, String)>,
    },
    /// A straight line.
    Line {
        /// Start x, px.
        x1: f64,
        /// Start y, px.
        y1: f64,
        /// End x, px.
        x2: f64,
        /// End y, px.
        y2: f64,
        /// Colour.
        color: Rgb,
        /// Width, px.
        width: f64,
        /// Dashed.
        dashed: bool,
        /// What it stands for.
        class: String,
    },
    /// A line of text; `y` is the baseline.
    Text {
        /// Anchor x, px.
        x: f64,
        /// Baseline y, px.
        y: f64,
        /// Font size, px.
        size: f64,
        /// Alignment.
        anchor: Anchor,
        /// Colour.
        color: Rgb,
        /// The text.
        text: String,
        /// What it stands for.
        class: String,
    },
}

/// A picture of `width` x `height` px.
#[derive(Clone, Debug, PartialEq)]
pub struct Canvas {
    /// Width, px.
    pub width: f64,
    /// Height, px.
    pub height: f64,
    /// Shapes, painted in order.
    pub items: Vec<Item>,
}

/// Pixels of a monospace glyph's advance per px of font size (DejaVu Sans Mono).
pub const MONO_ADVANCE: f64 = 0.602;

/// Width of `text` at `size` px in the monospace font both outputs use.
pub fn text_width(text: &str, size: f64) -> f64 {
    text.chars().count() as f64 * size * MONO_ADVANCE
}

/// A number with at most one decimal, without a trailing `.0`: short, stable SVG.
fn num(v: f64) -> String {
    let r = (v * 10.0).round() / 10.0;
    if r == r.trunc() {
        format!("{}", r as i64)
    } else {
        format!("{r:.1}")
    }
}

/// Text and attribute values of an SVG (double-quoted attributes).
pub(crate) fn escape(s: &str) -> String {
    let mut out = String::with_capacity(s.len());
    for c in s.chars() {
        match c {
            '&' => out.push_str("&amp;"),
            '<' => out.push_str("&lt;"),
            '>' => out.push_str("&gt;"),
            '"' => out.push_str("&quot;"),
            _ => out.push(c),
        }
    }
    out
}

impl Canvas {
    /// An empty picture on a white background.
    pub fn new(width: f64, height: f64) -> Canvas {
        Canvas {
            width,
            height,
            items: Vec::new(),
        }
    }

    /// Adds a filled rectangle.
    pub fn rect(&mut self, x: f64, y: f64, w: f64, h: f64, fill: Rgb, class: &str) -> &mut Item {
        self.items.push(Item::Rect {
            x,
            y,
            w,
            h,
            fill: Some(fill),
            stroke: None,
            class: class.into(),
            data: Vec::new(),
        });
        self.items.last_mut().expect("just pushed")
    }

    /// Adds an outline.
    #[allow(clippy::too_many_arguments)]
    pub fn outline(&mut self, x: f64, y: f64, w: f64, h: f64, color: Rgb, width: f64, class: &str) {
        self.items.push(Item::Rect {
            x,
            y,
            w,
            h,
            fill: None,
            stroke: Some((color, width)),
            class: class.into(),
            data: Vec::new(),
        });
    }

    /// Adds a line.
    #[allow(clippy::too_many_arguments)]
    pub fn line(
        &mut self,
        x1: f64,
        y1: f64,
        x2: f64,
        y2: f64,
        color: Rgb,
        width: f64,
        dashed: bool,
        class: &str,
    ) {
        self.items.push(Item::Line {
            x1,
            y1,
            x2,
            y2,
            color,
            width,
            dashed,
            class: class.into(),
        });
    }

    /// Adds text.
    pub fn text(&mut self, x: f64, y: f64, size: f64, anchor: Anchor, text: &str, class: &str) {
        self.items.push(Item::Text {
            x,
            y,
            size,
            anchor,
            color: Rgb(0x22, 0x22, 0x22),
            text: text.into(),
            class: class.into(),
        });
    }

    /// Rectangles of a class.
    pub fn rects<'a>(&'a self, class: &'a str) -> impl Iterator<Item = &'a Item> + 'a {
        self.items
            .iter()
            .filter(move |i| matches!(i, Item::Rect { class: c, .. } if c == class))
    }

    /// Texts of a class.
    pub fn texts<'a>(&'a self, class: &'a str) -> impl Iterator<Item = &'a str> + 'a {
        self.items.iter().filter_map(move |i| match i {
            Item::Text { class: c, text, .. } if c == class => Some(text.as_str()),
            _ => None,
        })
    }

    /// The SVG text (deterministic: coordinates to 0.1 px, attributes in a fixed
    /// order).
    pub fn to_svg(&self) -> String {
        let mut s = String::with_capacity(64 * self.items.len() + 512);
        let _ = writeln!(
            s,
            r#"<svg xmlns="http://www.w3.org/2000/svg" width="{w}" height="{h}" viewBox="0 0 {w} {h}" font-family="DejaVu Sans Mono, monospace">"#,
            w = num(self.width),
            h = num(self.height)
        );
        let _ = writeln!(
            s,
            r##"<rect x="0" y="0" width="{}" height="{}" fill="#ffffff"/>"##,
            num(self.width),
            num(self.height)
        );
        for item in &self.items {
            match item {
                Item::Rect {
                    x,
                    y,
                    w,
                    h,
                    fill,
                    stroke,
                    class,
                    data,
                } => {
                    let _ = write!(
                        s,
                        r#"<rect class="{}" x="{}" y="{}" width="{}" height="{}""#,
                        escape(class),
                        num(*x),
                        num(*y),
                        num(*w),
                        num(*h)
                    );
                    match fill {
                        Some(c) => {
                            let _ = write!(s, r#" fill="{}""#, c.hex());
                        }
                        None => s.push_str(r#" fill="none""#),
                    }
                    if let Some((c, width)) = stroke {
                        let _ =
                            write!(s, r#" stroke="{}" stroke-width="{}""#, c.hex(), num(*width));
                    }
                    for (k, v) in data {
                        let _ = write!(s, r#" data-{k}="{}""#, escape(v));
                    }
                    s.push_str("/>\n");
                }
                Item::Line {
                    x1,
                    y1,
                    x2,
                    y2,
                    color,
                    width,
                    dashed,
                    class,
                } => {
                    let _ = write!(
                        s,
                        r#"<line class="{}" x1="{}" y1="{}" x2="{}" y2="{}" stroke="{}" stroke-width="{}""#,
                        escape(class),
                        num(*x1),
                        num(*y1),
                        num(*x2),
                        num(*y2),
                        color.hex(),
                        num(*width)
                    );
                    if *dashed {
                        s.push_str(r#" stroke-dasharray="6 4""#);
                    }
                    s.push_str("/>\n");
                }
                Item::Text {
                    x,
                    y,
                    size,
                    anchor,
                    color,
                    text,
                    class,
                } => {
                    let a = match anchor {
                        Anchor::Start => "",
                        Anchor::Middle => r#" text-anchor="middle""#,
                        Anchor::End => r#" text-anchor="end""#,
                    };
                    let _ = writeln!(
                        s,
                        r#"<text class="{}" x="{}" y="{}" font-size="{}" fill="{}"{a}>{}</text>"#,
                        escape(class),
                        num(*x),
                        num(*y),
                        num(*size),
                        color.hex(),
                        escape(text)
                    );
                }
            }
        }
        s.push_str("</svg>\n");
        s
    }
}

impl Item {
    /// A rectangle's `data-*` value.
    pub fn data(&self, key: &str) -> Option<&str> {
        match self {
            Item::Rect { data, .. } => data
                .iter()
                .find(|(k, _)| *k == key)
                .map(|(_, v)| v.as_str()),
            _ => None,
        }
    }

    /// A rectangle's (x, y, w, h).
    pub fn bounds(&self) -> Option<(f64, f64, f64, f64)> {
        match self {
            Item::Rect { x, y, w, h, .. } => Some((*x, *y, *w, *h)),
            _ => None,
        }
    }

    /// Sets a `data-*` attribute of a rectangle.
    pub fn with(&mut self, key: &'static str, value: impl ToString) -> &mut Item {
        if let Item::Rect { data, .. } = self {
            data.push((key, value.to_string()));
        }
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn svg_is_short_and_escaped() {
        let mut c = Canvas::new(100.0, 50.0);
        c.rect(1.25, 2.0, 10.0, 3.04, Rgb(255, 0, 16), "fwd")
            .with("mb", 3);
        c.text(5.0, 9.0, 12.0, Anchor::Middle, "a<b & c", "label");
        let svg = c.to_svg();
        assert!(svg.contains(
            r##"<rect class="fwd" x="1.3" y="2" width="10" height="3" fill="#ff0010" data-mb="3"/>"##
        ));
        assert!(svg.contains(">a&lt;b &amp; c</text>"));
        assert!(svg.contains(r#"text-anchor="middle""#));
        assert_eq!(c.rects("fwd").count(), 1);
        assert_eq!(c.texts("label").collect::<Vec<_>>(), ["a<b & c"]);
    }
}
