//! Numeric CSV files: one sample per row, every feature column a number,
//! one optional integer label column. Gzipped files are detected from
//! their content.

use std::path::Path;

use super::data_err;
use super::dataset::{Dataset, check_total, finite_feature};
use super::limits::{
    DataBounds, MAX_CLASSES, MAX_CSV_COLUMNS, MAX_CSV_LINE_BYTES, MAX_SAMPLES, OverBound,
};
use super::read::DataFile;
use crate::error::{EngineError, EngineResult};

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
    load_csv_within(path, opts, &DataBounds::DEFAULT)
}

/// [`load_csv_with`] under `bounds`: the file is read a line at a time,
/// stopping once it decompresses past `bounds.max_bytes` or its rows
/// hold more than `bounds.max_values` feature values.
pub fn load_csv_within(
    path: impl AsRef<Path>,
    opts: &CsvOptions,
    bounds: &DataBounds,
) -> EngineResult<Dataset> {
    let path = path.as_ref();
    let mut file = DataFile::open(path, bounds)?;
    let parsed = Parser::new(*opts, bounds.max_values)
        .parse(&mut file)
        .map_err(|error| match error {
            RowError::Cause(cause) => data_err(path, cause),
            RowError::Over(over) => file.over(over),
            RowError::Read(error) => error,
        })?;
    let shape = vec![parsed.columns - usize::from(opts.label != LabelColumn::None)];
    if opts.label == LabelColumn::None {
        return Dataset::from_parts(path, parsed.features, shape, parsed.labels, 1);
    }
    Dataset::infer_classes(path, parsed.features, shape, parsed.labels)
}

/// Why a row was refused.
enum RowError {
    Cause(String),
    Over(OverBound),
    Read(EngineError),
}

impl From<String> for RowError {
    fn from(cause: String) -> RowError {
        RowError::Cause(cause)
    }
}

impl From<&str> for RowError {
    fn from(cause: &str) -> RowError {
        RowError::Cause(cause.to_string())
    }
}

/// Accumulates rows; `columns` is fixed by the first data row.
struct Parser {
    opts: CsvOptions,
    max_values: usize,
    columns: usize,
    label_col: usize,
    features: Vec<f32>,
    labels: Vec<i64>,
}

impl Parser {
    fn new(opts: CsvOptions, max_values: usize) -> Self {
        Parser {
            opts,
            max_values,
            columns: 0,
            label_col: usize::MAX,
            features: Vec::new(),
            labels: Vec::new(),
        }
    }

    /// Reads the file's lines, skipping blank ones; the first non-blank
    /// may be a header.
    fn parse(mut self, file: &mut DataFile) -> Result<Parser, RowError> {
        let mut buf = Vec::new();
        let (mut number, mut first) = (0usize, true);
        while file
            .read_line(&mut buf, MAX_CSV_LINE_BYTES)
            .map_err(RowError::Read)?
        {
            number += 1;
            let line = std::str::from_utf8(&buf)
                .map_err(|e| format!("line {number}: not UTF-8 text: {e}"))?;
            if line.trim().is_empty() {
                continue;
            }
            if std::mem::replace(&mut first, false) && self.is_header(line) {
                continue;
            }
            self.row(number, line)?;
        }
        if first {
            return Err("file has no rows".into());
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
    fn row(&mut self, line: usize, text: &str) -> Result<(), RowError> {
        let n = self.cells(text).count();
        if self.columns == 0 {
            self.set_columns(n)?;
        }
        if n != self.columns {
            return Err(format!(
                "row {} (line {line}) has {n} columns, expected {}",
                self.labels.len() + 1,
                self.columns
            )
            .into());
        }
        if self.labels.len() >= MAX_SAMPLES {
            return Err(format!("more than {MAX_SAMPLES} rows").into());
        }
        let features = self.columns - usize::from(self.label_col < self.columns);
        check_total(self.labels.len() + 1, features, self.max_values).map_err(RowError::Over)?;
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
    finite_feature(x).map_err(str::to_string)
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
