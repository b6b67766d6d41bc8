//! Aligned text tables for the admin commands' human output. Cells come
//! from the server and, through it, from devices (tags, last errors), so
//! control characters are escaped (no terminal escape sequences reach the
//! screen) and long cells are cut, except a last column of reasons, which
//! is shown whole (nothing follows it to keep aligned).

use anyhow::Result;

use crate::output::outln;

/// Longest cell shown; the rest is cut with `…` (`--json` has it whole).
pub const MAX_CELL_CHARS: usize = 60;

pub struct Table {
    header: Vec<String>,
    rows: Vec<Vec<String>>,
    /// Whether the last column's cells are shown whole.
    whole_last: bool,
}

impl Table {
    pub fn new(header: &[&str]) -> Table {
        Table {
            header: header.iter().map(|name| name.to_string()).collect(),
            rows: Vec::new(),
            whole_last: false,
        }
    }

    /// The same table, with its last column (a status, a reason) never
    /// cut: a cut reason loses its cause, which comes last.
    pub fn with_whole_last_column(mut self) -> Table {
        self.whole_last = true;
        self
    }

    pub fn row(&mut self, cells: Vec<String>) {
        let last = self.header.len().saturating_sub(1);
        let whole_last = self.whole_last;
        self.rows.push(
            cells
                .iter()
                .enumerate()
                .map(|(index, cell)| {
                    if whole_last && index == last {
                        escape(cell)
                    } else {
                        clean(cell)
                    }
                })
                .collect(),
        );
    }

    pub fn is_empty(&self) -> bool {
        self.rows.is_empty()
    }

    /// The table as lines: columns two spaces apart, no trailing spaces.
    pub fn lines(&self) -> Vec<String> {
        let mut widths: Vec<usize> = self.header.iter().map(|h| h.chars().count()).collect();
        for row in &self.rows {
            for (index, cell) in row.iter().enumerate() {
                if let Some(width) = widths.get_mut(index) {
                    *width = (*width).max(cell.chars().count());
                }
            }
        }
        std::iter::once(&self.header)
            .chain(&self.rows)
            .map(|row| {
                let line: Vec<String> = row
                    .iter()
                    .zip(&widths)
                    .map(|(cell, width)| format!("{cell:<width$}"))
                    .collect();
                line.join("  ").trim_end().to_string()
            })
            .collect()
    }

    pub fn print(&self) -> Result<()> {
        for line in self.lines() {
            outln!("{line}")?;
        }
        Ok(())
    }
}

/// One line of at most [`MAX_CELL_CHARS`], control characters escaped.
pub fn clean(text: &str) -> String {
    let escaped = escape(text);
    if escaped.chars().count() > MAX_CELL_CHARS {
        let mut cut: String = escaped.chars().take(MAX_CELL_CHARS - 1).collect();
        cut.push('…');
        cut
    } else {
        escaped
    }
}

/// The whole text on one line, control characters escaped: for reasons
/// and statuses, which are not cut.
pub fn escape(text: &str) -> String {
    text.chars()
        .flat_map(|c| {
            let shown: Vec<char> = if c.is_control() {
                c.escape_default().collect()
            } else {
                vec![c]
            };
            shown
        })
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn columns_align_and_device_text_cannot_drive_the_terminal() {
        let mut table = Table::new(&["ID", "LAST ERROR"]);
        table.row(vec!["1".into(), "ok".into()]);
        table.row(vec!["12".into(), "\u{1b}[2Jcleared\nnext".into()]);
        assert_eq!(
            table.lines(),
            vec!["ID  LAST ERROR", "1   ok", "12  \\u{1b}[2Jcleared\\nnext",]
        );
        let long = clean(&"x".repeat(500));
        assert_eq!(long.chars().count(), MAX_CELL_CHARS);
        assert!(long.ends_with('…'));
    }

    #[test]
    fn a_whole_last_column_keeps_its_cause_and_still_escapes() {
        let reason = format!("waiting for devices: {}the cause\n", "x".repeat(80));
        let mut table = Table::new(&["ID", "NAME", "STATUS"]).with_whole_last_column();
        table.row(vec!["1".into(), "n".repeat(80), reason]);
        let lines = table.lines();
        assert!(lines[1].ends_with("the cause\\n"), "{}", lines[1]);
        assert!(lines[1].contains(&"x".repeat(80)));
        assert!(lines[1].contains('…'), "other columns are still cut");
        assert_eq!(escape("a\u{1b}b"), "a\\u{1b}b");
    }
}
