//! Tables of the run, rendered as aligned text (stdout, latest.txt) and Markdown
//! (latest.md) from the same rows.

pub struct Table {
    pub title: String,
    pub head: Vec<String>,
    pub rows: Vec<Vec<String>>,
}

impl Table {
    pub fn new(title: &str, head: &[&str]) -> Table {
        Table {
            title: title.to_string(),
            head: head.iter().map(|s| s.to_string()).collect(),
            rows: Vec::new(),
        }
    }

    pub fn row(&mut self, cells: Vec<String>) {
        self.rows.push(cells);
    }

    fn widths(&self) -> Vec<usize> {
        let mut w: Vec<usize> = self.head.iter().map(|h| h.chars().count()).collect();
        for r in &self.rows {
            for (i, c) in r.iter().enumerate() {
                if i < w.len() {
                    w[i] = w[i].max(c.chars().count());
                }
            }
        }
        w
    }

    pub fn text(&self) -> String {
        let w = self.widths();
        let line = |cells: &[String]| {
            let mut s = String::new();
            for (i, c) in cells.iter().enumerate() {
                let pad = w.get(i).copied().unwrap_or(0);
                if i == 0 {
                    s.push_str(&format!("{c:<pad$}"));
                } else {
                    s.push_str(&format!("  {c:>pad$}"));
                }
            }
            s.trim_end().to_string()
        };
        let mut out = format!("{}\n{}\n", self.title, line(&self.head));
        for r in &self.rows {
            out.push_str(&line(r));
            out.push('\n');
        }
        out
    }

    pub fn markdown(&self) -> String {
        let mut out = format!("### {}\n\n| {} |\n|", self.title, self.head.join(" | "));
        for i in 0..self.head.len() {
            out.push_str(if i == 0 { " --- |" } else { " ---: |" });
        }
        out.push('\n');
        for r in &self.rows {
            out.push_str(&format!("| {} |\n", r.join(" | ")));
        }
        out
    }
}

pub fn f2(x: f64) -> String {
    format!("{x:.2}")
}

pub fn f0(x: f64) -> String {
    format!("{x:.0}")
}

pub fn us(x: f64) -> String {
    if x >= 100.0 {
        format!("{x:.0}")
    } else {
        format!("{x:.1}")
    }
}

pub fn chunk_name(c: usize) -> String {
    if c >= 1 << 20 {
        format!("{} MiB", c >> 20)
    } else {
        format!("{} KiB", c >> 10)
    }
}
