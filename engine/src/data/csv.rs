//! Numeric CSV files: one sample per row, every feature column a number,
//! one optional integer label column. Gzipped files are detected from
//! their content.

use std::path::Path;

use super::data_err;
use super::dataset::{Dataset, check_total};
use super::limits::{MAX_CLASSES, MAX_CSV_COLUMNS, MAX_SAMPLES};
use super::read::read_file;
use crate::error::EngineResult;

/// Which column holds the class label.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum LabelColumn {
    First,
    #[default]
    Last,
    /// Zero-based column index.
    Index(usize),
    /// Unlabelled data: every sample gets label 0 of a single class.
    None,
}

/// Whether the first line is a header of column names.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum CsvHeader {
    /// A header if any cell of the first line is not a number.
    #[default]
    Auto,
    Present,
    Absent,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct CsvOptions {
    pub label: LabelColumn,
    pub header: CsvHeader,
    pub delimiter: u8,
}

impl Default for CsvOptions {
    fn default() -> Self {
        CsvOptions {
            label: LabelColumn::Last,
            header: CsvHeader::Auto,
            delimiter: b',',
        }
    }
}

/// Loads a comma-separated file with the label in `label` and the header
/// auto-detected; features get shape `[columns - 1]`.
pub fn load_csv(path: impl AsRef<Path>, label: LabelColumn) -> EngineResult<Dataset> {
    load_csv_with(
        path,
        &CsvOptions {
            label,
            ..CsvOptions::default()
        },
    )
}

/// Loads a CSV file with explicit options.
pub fn load_csv_with(path: impl AsRef<Path>, opts: &CsvOptions) -> EngineResult<Dataset> {
    let path = path.as_ref();
    let bytes = read_file(path)?;
    let text =
        std::str::from_utf8(&bytes).map_err(|e| data_err(path, format!("not UTF-8 text: {e}")))?;
    let parsed = Parser::new(*opts)
        .parse(text)
        .map_err(|c| data_err(path, c))?;
    let shape = vec![parsed.columns - usize::from(opts.label != LabelColumn::None)];
    if opts.label == LabelColumn::None {
        return Dataset::from_parts(path, parsed.features, shape, parsed.labels, 1);
    }
    Dataset::infer_classes(path, parsed.features, shape, parsed.labels)
}

/// Accumulates rows; `columns` is fixed by the first data row.
struct Parser {
    opts: CsvOptions,
    columns: usize,
    label_col: usize,
    features: Vec<f32>,
    labels: Vec<i64>,
}

impl Parser {
    fn new(opts: CsvOptions) -> Self {
        Parser {
            opts,
            columns: 0,
            label_col: usize::MAX,
            features: Vec::new(),
            labels: Vec::new(),
        }
    }

    fn parse(mut self, text: &str) -> Result<Parser, String> {
        let mut lines = text
            .lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty());
        let first = lines.next().ok_or("file has no rows")?;
        if !self.is_header(first.1) {
            self.row(first.0 + 1, first.1)?;
        }
        for (i, line) in lines {
            self.row(i + 1, line)?;
        }
        if self.labels.is_empty() {
            return Err("file has a header but no data rows".into());
        }
        Ok(self)
    }

    fn is_header(&self, line: &str) -> bool {
        match self.opts.header {
            CsvHeader::Present => true,
            CsvHeader::Absent => false,
            CsvHeader::Auto => self.cells(line).any(|c| c.parse::<f64>().is_err()),
        }
    }

    fn cells<'a>(&self, line: &'a str) -> impl Iterator<Item = &'a str> + use<'a> {
        cells(line, self.opts.delimiter)
    }

    /// Parses one data row (`line` is the 1-based line number in the file).
    fn row(&mut self, line: usize, text: &str) -> Result<(), String> {
        let n = self.cells(text).count();
        if self.columns == 0 {
            self.set_columns(n)?;
        }
        if n != self.columns {
            return Err(format!(
                "row {} (line {line}) has {n} columns, expected {}",
                self.labels.len() + 1,
                self.columns
            ));
        }
        if self.labels.len() >= MAX_SAMPLES {
            return Err(format!("more than {MAX_SAMPLES} rows"));
        }
        check_total(self.labels.len() + 1, self.columns)?;
        let mut label = 0;
        for (col, cell) in cells(text, self.opts.delimiter).enumerate() {
            if col == self.label_col {
                label = parse_label(cell).map_err(|c| cell_err(line, col, cell, &c))?;
            } else {
                let x = parse_feature(cell).map_err(|c| cell_err(line, col, cell, &c))?;
                self.features.push(x);
            }
        }
        self.labels.push(label);
        Ok(())
    }

    fn set_columns(&mut self, n: usize) -> Result<(), String> {
        if n > MAX_CSV_COLUMNS {
            return Err(format!(
                "{n} columns exceeds the limit of {MAX_CSV_COLUMNS}"
            ));
        }
        self.label_col = match self.opts.label {
            LabelColumn::First => 0,
            LabelColumn::Last => n - 1,
            LabelColumn::Index(i) if i < n => i,
            LabelColumn::Index(i) => {
                return Err(format!("label column {i} but rows have {n} columns"));
            }
            LabelColumn::None => usize::MAX,
        };
        let has_label = usize::from(self.opts.label != LabelColumn::None);
        if n <= has_label {
            return Err(format!("rows have {n} column(s): no feature columns"));
        }
        self.columns = n;
        Ok(())
    }
}

fn cells(line: &str, delimiter: u8) -> impl Iterator<Item = &str> {
    line.split(char::from(delimiter)).map(str::trim)
}

fn cell_err(line: usize, col: usize, cell: &str, cause: &str) -> String {
    format!("line {line}, column {}: {cause} ({cell:?})", col + 1)
}

fn parse_feature(cell: &str) -> Result<f32, String> {
    let x: f32 = cell.parse().map_err(|_| "not a number".to_string())?;
    if x.is_finite() {
        Ok(x)
    } else {
        Err("not a finite number".into())
    }
}

/// Labels are class indices; "3.0" is accepted since many exporters write
/// integers as floats, "3.5" is not.
fn parse_label(cell: &str) -> Result<i64, String> {
    let y = match cell.parse::<i64>() {
        Ok(y) => y,
        Err(_) => match cell.parse::<f64>() {
            Ok(f) if f.fract() == 0.0 && f.abs() < 1e15 => f as i64,
            _ => return Err("label is not an integer".into()),
        },
    };
    if y < 0 || y >= MAX_CLASSES as i64 {
        return Err(format!("label must be in 0..{MAX_CLASSES}"));
    }
    Ok(y)
}

/// Writes a dataset as CSV that [`load_csv`] reads back with
/// [`LabelColumn::Last`]: the features of each sample, then its label, no
/// header. For handing shards to devices and tools.
pub fn write_csv(path: impl AsRef<Path>, data: &Dataset) -> EngineResult<()> {
    use std::fmt::Write as _;
    let path = path.as_ref();
    let mut text = String::with_capacity(data.len() * (data.feature_len() * 4 + 4));
    for (features, label) in data
        .features()
        .chunks(data.feature_len().max(1))
        .zip(data.labels())
    {
        for value in features {
            let _ = write!(text, "{value},");
        }
        let _ = writeln!(text, "{label}");
    }
    std::fs::write(path, text).map_err(|error| crate::EngineError::Data {
        path: path.display().to_string(),
        cause: format!("cannot write: {error}"),
    })
}
