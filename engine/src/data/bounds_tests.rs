//! The loaders under [`DataBounds`]: gzip bombs stop at the byte bound,
//! headers declaring too many values are refused before anything is
//! allocated for them, and NaN or ±inf is refused in every format, naming
//! where it is.

use std::io::Write;
use std::path::{Path, PathBuf};

use super::limits::{DataBounds, OverBound};
use super::{
    CsvOptions, load_csv, load_csv_within, load_idx_within, load_npy_dataset,
    load_npy_dataset_within,
};
use crate::EngineError;

const MIB: usize = 1 << 20;

fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("canopy-bounds-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp dir");
    dir
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).expect("write");
    path
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut encoder = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::best());
    encoder.write_all(bytes).expect("gzip");
    encoder.finish().expect("gzip")
}

/// `head`, then `mib` MiB of `filler`, as gzip members (one compressed
/// MiB repeated): a few KB that decompress to `mib` MiB.
fn bomb(head: &[u8], filler: u8, mib: usize) -> Vec<u8> {
    let block = gzip(&vec![filler; MIB]);
    let mut out = gzip(head);
    (0..mib).for_each(|_| out.extend_from_slice(&block));
    out
}

fn idx_header(magic: u8, dims: &[u32]) -> Vec<u8> {
    let mut out = vec![0, 0, 8, magic];
    dims.iter().for_each(|d| out.extend(d.to_be_bytes()));
    out
}

fn npy(descr: &str, shape: &str, data: &[u8]) -> Vec<u8> {
    let mut header = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend((header.len() as u16).to_le_bytes());
    out.extend(header.as_bytes());
    out.extend(data);
    out
}

fn over<T: std::fmt::Debug>(result: Result<T, EngineError>, file: &Path) -> OverBound {
    match result {
        Err(EngineError::OverBound { path, over }) => {
            assert_eq!(Path::new(&path), file, "{over}");
            over
        }
        other => panic!("expected a bound refusal naming {file:?}, got {other:?}"),
    }
}

fn data_cause<T: std::fmt::Debug>(result: Result<T, EngineError>, file: &Path) -> String {
    match result {
        Err(EngineError::Data { path, cause }) => {
            assert_eq!(Path::new(&path), file, "{cause}");
            cause
        }
        other => panic!("expected a data error naming {file:?}, got {other:?}"),
    }
}

const SMALL: DataBounds = DataBounds {
    max_bytes: MIB as u64,
    max_values: 4096,
};

#[test]
fn an_idx_header_declaring_too_many_values_is_refused_before_reading_on() {
    let dir = temp_dir("idx-values");
    // 2^24 images of 8×8 declared, 64 MiB of zeros after it.
    let images = write(
        &dir,
        "images.gz",
        &bomb(&idx_header(3, &[1 << 24, 8, 8]), 0, 64),
    );
    let labels = write(&dir, "labels", &idx_header(1, &[1]));
    let refused = over(load_idx_within(&images, &labels, &SMALL), &images);
    assert_eq!(
        refused,
        OverBound::Values {
            values: 1 << 30,
            limit: 4096
        }
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn a_gzip_bomb_stops_at_the_byte_bound() {
    let dir = temp_dir("bomb");
    // A valid header of 4 images of 8×8, then 64 MiB of trailing zeros.
    let mut head = idx_header(3, &[4, 8, 8]);
    head.extend([0u8; 256]);
    let images = write(&dir, "images.gz", &bomb(&head, 0, 64));
    let labels = write(&dir, "labels", &[idx_header(1, &[4]), vec![0; 4]].concat());
    let refused = over(load_idx_within(&images, &labels, &SMALL), &images);
    assert_eq!(refused, OverBound::Bytes { limit: MIB as u64 });

    // Blank lines hold no values: only the byte bound stops them.
    let csv = write(&dir, "blank.csv.gz", &bomb(b"1,2,0\n", b'\n', 64));
    let refused = over(load_csv_within(&csv, &CsvOptions::default(), &SMALL), &csv);
    assert_eq!(refused, OverBound::Bytes { limit: MIB as u64 });
    // Nor can a file without line breaks be read whole into one line.
    let long = write(&dir, "one-line.csv.gz", &bomb(b"1,2,", b'7', 64));
    let cause = data_cause(load_csv(&long, super::LabelColumn::Last), &long);
    assert!(
        cause.contains("a line is longer than 16777216 bytes"),
        "{cause}"
    );
    // Under the engine's own bounds the same file loads: one row.
    assert_eq!(
        load_csv(&csv, super::LabelColumn::Last)
            .map(|d| d.len())
            .ok(),
        Some(1)
    );

    // The labels file shares the dataset's byte budget with the images.
    let bounds = DataBounds {
        max_bytes: 16 + 256 + 8 + 2,
        max_values: 4096,
    };
    let images = write(
        &dir,
        "images",
        &[idx_header(3, &[4, 8, 8]), vec![0; 256]].concat(),
    );
    let refused = over(load_idx_within(&images, &labels, &bounds), &labels);
    assert_eq!(refused, OverBound::Bytes { limit: 282 });
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn npy_and_csv_rows_past_the_value_bound_are_refused() {
    let dir = temp_dir("values");
    // The header declares 10^6 × 100 values in a file of a few bytes.
    let images = write(&dir, "images.npy", &npy("<f4", "(1000000, 100)", &[0; 16]));
    let labels = write(&dir, "labels.npy", &npy("<i8", "(1000000,)", &[]));
    let refused = over(load_npy_dataset_within(&images, &labels, &SMALL), &images);
    assert_eq!(
        refused,
        OverBound::Values {
            values: 100_000_000,
            limit: 4096
        }
    );
    let rows = "1,2,3,0\n".repeat(2000);
    let csv = write(&dir, "rows.csv", rows.as_bytes());
    let refused = over(load_csv_within(&csv, &CsvOptions::default(), &SMALL), &csv);
    assert_eq!(
        refused,
        OverBound::Values {
            values: 4098,
            limit: 4096
        }
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn npy_values_that_are_not_finite_are_refused_naming_where() {
    let dir = temp_dir("finite");
    let labels: Vec<u8> = (0..3i64).flat_map(|i| i.to_le_bytes()).collect();
    let labels = write(&dir, "labels.npy", &npy("<i8", "(3,)", &labels));
    for (bad, at) in [(f32::NAN, 3), (f32::INFINITY, 5), (f32::NEG_INFINITY, 0)] {
        let mut values = [0.25f32; 6];
        values[at] = bad;
        let bytes: Vec<u8> = values.iter().flat_map(|v| v.to_le_bytes()).collect();
        let images = write(&dir, "images.npy", &npy("<f4", "(3, 2)", &bytes));
        let cause = data_cause(load_npy_dataset(&images, &labels), &images);
        let place = format!("value {} of sample {} is {bad}", at % 2, at / 2);
        assert!(
            cause.contains(&place) && cause.contains("not a finite number"),
            "{cause}"
        );
    }
    // f8 values past f32's range would become infinite.
    let bytes: Vec<u8> = [0.0f64, 1e300]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect();
    let images = write(&dir, "wide.npy", &npy("<f8", "(1, 2)", &bytes));
    let one = write(&dir, "one.npy", &npy("<i8", "(1,)", &0i64.to_le_bytes()));
    let cause = data_cause(load_npy_dataset(&images, &one), &images);
    assert!(cause.contains("value 1 of sample 0 is inf"), "{cause}");
    // Finite values load, u8 pixels scaled as before.
    let pixels = write(&dir, "pixels.npy", &npy("|u1", "(1, 2)", &[0, 255]));
    let loaded = load_npy_dataset(&pixels, &one).expect("finite values load");
    assert_eq!(loaded.features(), &[0.0, 1.0]);
    std::fs::remove_dir_all(dir).ok();
}
