//! Data loading against the real datasets in the repo's `datasets/` folder
//! and against hand-made malformed files.

use std::collections::HashSet;
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

use canopy_engine::data::{
    CsvHeader, CsvOptions, Dataset, DirichletOptions, LabelColumn, load_csv, load_csv_with,
    load_dir, load_idx, load_npy, load_npy_dataset, partition_by_label, partition_dirichlet,
    partition_dirichlet_sized, partition_dirichlet_with, partition_iid,
};
use canopy_engine::{EngineError, Value};

fn datasets() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../datasets")
}

fn mnist_dir() -> PathBuf {
    datasets().join("mnist-10k")
}

fn digits_csv() -> PathBuf {
    datasets().join("digits/digits.csv.gz")
}

/// A fresh, empty folder under the system temp dir, unique per test and
/// process so parallel tests and concurrent runs never collide.
fn temp_dir(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("canopy-data-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir
}

fn write(dir: &Path, name: &str, bytes: &[u8]) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, bytes).unwrap();
    path
}

fn gunzip(path: &Path) -> Vec<u8> {
    let mut out = Vec::new();
    flate2::read::GzDecoder::new(std::fs::File::open(path).unwrap())
        .read_to_end(&mut out)
        .unwrap();
    out
}

fn gzip(bytes: &[u8]) -> Vec<u8> {
    let mut enc = flate2::write::GzEncoder::new(Vec::new(), flate2::Compression::fast());
    enc.write_all(bytes).unwrap();
    enc.finish().unwrap()
}

/// An IDX file: big-endian magic and dims, then the bytes.
fn idx(magic: u32, dims: &[u32], data: &[u8]) -> Vec<u8> {
    let mut out = magic.to_be_bytes().to_vec();
    dims.iter()
        .for_each(|d| out.extend_from_slice(&d.to_be_bytes()));
    out.extend_from_slice(data);
    out
}

/// An .npy v1 file with the given header dict and raw data.
fn npy(descr: &str, fortran: bool, shape: &str, data: &[u8]) -> Vec<u8> {
    let fortran = if fortran { "True" } else { "False" };
    let mut header =
        format!("{{'descr': '{descr}', 'fortran_order': {fortran}, 'shape': {shape}, }}");
    while (10 + header.len() + 1) % 64 != 0 {
        header.push(' ');
    }
    header.push('\n');
    let mut out = b"\x93NUMPY\x01\x00".to_vec();
    out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    out.extend_from_slice(header.as_bytes());
    out.extend_from_slice(data);
    out
}

/// Asserts a data error naming `path` whose cause contains `needle`.
fn assert_data_err<T: std::fmt::Debug>(result: Result<T, EngineError>, path: &Path, needle: &str) {
    match result {
        Err(EngineError::Data { path: p, cause }) => {
            assert_eq!(Path::new(&p), path, "wrong path in error: {cause}");
            assert!(cause.contains(needle), "cause {cause:?} lacks {needle:?}");
        }
        other => panic!("expected a data error containing {needle:?}, got {other:?}"),
    }
}

fn assert_partition_err<T: std::fmt::Debug>(result: Result<T, EngineError>, needle: &str) {
    match result {
        Err(EngineError::Data { cause, .. }) => {
            assert!(cause.contains(needle), "cause {cause:?} lacks {needle:?}")
        }
        other => panic!("expected an error containing {needle:?}, got {other:?}"),
    }
}

/// `n` samples whose first feature is the sample's index (to track samples
/// through batching and partitioning) and second its label.
fn tagged(n: usize, classes: usize) -> Dataset {
    let labels: Vec<i64> = (0..n).map(|i| ((i * 7) % classes) as i64).collect();
    let features = labels
        .iter()
        .enumerate()
        .flat_map(|(i, &y)| [i as f32, y as f32])
        .collect();
    Dataset::new(features, vec![2], labels, classes).unwrap()
}

fn ids(d: &Dataset) -> Vec<usize> {
    d.features().chunks(2).map(|r| r[0] as usize).collect()
}

fn distinct_labels(d: &Dataset) -> usize {
    d.class_counts().iter().filter(|&&c| c > 0).count()
}

/// Checks clients are disjoint and together hold every sample once.
fn assert_covers(parts: &[Dataset], n: usize) {
    let mut seen = HashSet::new();
    for p in parts {
        for i in ids(p) {
            assert!(seen.insert(i), "sample {i} assigned twice");
        }
    }
    assert_eq!(seen.len(), n, "not every sample assigned");
}

// ---- real data ----------------------------------------------------------

#[test]
fn mnist_10k_loads_from_repo() {
    let (train, test) = load_dir(mnist_dir()).unwrap();
    assert_eq!((train.len(), test.len()), (8004, 1996));
    assert_eq!(train.feature_shape(), &[1, 28, 28]);
    assert_eq!((train.num_classes(), test.num_classes()), (10, 10));
    assert!(train.features().iter().all(|&x| (0.0..=1.0).contains(&x)));
    assert!(train.features().contains(&1.0));
    assert!(train.class_counts().iter().all(|&c| c > 600));
    assert_eq!(test.class_counts().iter().sum::<usize>(), 1996);
    let direct = load_idx(
        mnist_dir().join("train-images-idx3-ubyte.gz"),
        mnist_dir().join("train-labels-idx1-ubyte.gz"),
    )
    .unwrap();
    assert_eq!(direct, train);
}

#[test]
fn gzipped_and_plain_idx_are_equivalent() {
    let dir = temp_dir("plain-idx");
    for name in [
        "train-images-idx3-ubyte",
        "train-labels-idx1-ubyte",
        "test-images-idx3-ubyte",
        "test-labels-idx1-ubyte",
    ] {
        write(&dir, name, &gunzip(&mnist_dir().join(format!("{name}.gz"))));
    }
    let plain = load_idx(
        dir.join("test-images-idx3-ubyte"),
        dir.join("test-labels-idx1-ubyte"),
    )
    .unwrap();
    let (_, gz_test) = load_dir(mnist_dir()).unwrap();
    assert_eq!(plain, gz_test);
    let (train, test) = load_dir(&dir).unwrap();
    assert_eq!((train.len(), test), (8004, gz_test));
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn digits_csv_loads() {
    let d = load_csv(digits_csv(), LabelColumn::Last).unwrap();
    assert_eq!(
        (d.len(), d.feature_shape(), d.num_classes()),
        (1797, &[64][..], 10)
    );
    assert_eq!(d.features().iter().copied().fold(0f32, f32::max), 16.0);
    assert!(d.class_counts().iter().all(|&c| (170..=190).contains(&c)));
    let (train, test) = load_dir(datasets().join("digits")).unwrap();
    assert_eq!(train.len() + test.len(), 1797);
    for (tr, te) in train.class_counts().iter().zip(test.class_counts()) {
        let frac = te as f64 / (tr + te) as f64;
        assert!((frac - 0.2).abs() < 0.01, "split is not stratified: {frac}");
    }
}

// ---- malformed IDX -----------------------------------------------------

#[test]
fn malformed_idx_files_are_rejected_with_file_and_cause() {
    let dir = temp_dir("bad-idx");
    let pixels = vec![7u8; 3 * 2 * 2];
    let images = write(&dir, "images", &idx(0x803, &[3, 2, 2], &pixels));
    let labels = write(&dir, "labels", &idx(0x801, &[3], &[0, 1, 2]));
    let ok = load_idx(&images, &labels).unwrap();
    assert_eq!(
        (ok.len(), ok.feature_shape(), ok.num_classes()),
        (3, &[1, 2, 2][..], 3)
    );

    let truncated = write(&dir, "truncated", &idx(0x803, &[3, 2, 2], &pixels[..11]));
    assert_data_err(load_idx(&truncated, &labels), &truncated, "truncated");
    let trailing = write(
        &dir,
        "trailing",
        &idx(0x803, &[3, 2, 2], &[pixels.clone(), vec![0]].concat()),
    );
    assert_data_err(load_idx(&trailing, &labels), &trailing, "trailing");
    let short_header = write(&dir, "short-header", &[0, 0, 8, 3, 0, 0]);
    assert_data_err(load_idx(&short_header, &labels), &short_header, "too short");
    let empty = write(&dir, "empty", &[]);
    assert_data_err(load_idx(&empty, &labels), &empty, "too short");

    let magic = write(&dir, "magic", &idx(0x81a, &[3, 2, 2], &pixels));
    assert_data_err(load_idx(&magic, &labels), &magic, "IDX magic 0x0000081a");
    let floats = write(&dir, "floats", &idx(0xd03, &[3, 2, 2], &pixels));
    assert_data_err(load_idx(&floats, &labels), &floats, "0x00000d03");
    assert_data_err(
        load_idx(&labels, &labels),
        &labels,
        "is not an image file (expected 0x00000803)",
    );
    assert_data_err(load_idx(&images, &images), &images, "is not a labels file");

    let few = write(&dir, "few-labels", &idx(0x801, &[2], &[0, 1]));
    assert_data_err(
        load_idx(&images, &few),
        &few,
        "labels file has 2 items but images file has 3",
    );

    // Claims 4 billion 65536x65536 images in a 20-byte file: must fail on
    // the limits, never try to allocate.
    let huge = write(
        &dir,
        "huge",
        &idx(0x803, &[u32::MAX, 65_536, 65_536], &[1, 2, 3, 4]),
    );
    assert_data_err(load_idx(&huge, &labels), &huge, "items");
    let wide = write(
        &dir,
        "wide",
        &idx(0x803, &[1, 65_536, 65_536], &[1, 2, 3, 4]),
    );
    assert_data_err(load_idx(&wide, &labels), &wide, "exceeds");
    let zero = write(&dir, "zero", &idx(0x803, &[0, 2, 2], &[]));
    assert_data_err(load_idx(&zero, &labels), &zero, "0 items");

    let bad_gz = write(&dir, "bad.gz", &[0x1f, 0x8b, 8, 0, 1, 2, 3, 4, 5, 6, 7, 8]);
    assert_data_err(load_idx(&bad_gz, &labels), &bad_gz, "gzip");
    let cut_gz = gzip(&idx(0x803, &[3, 2, 2], &pixels));
    let cut_gz = write(&dir, "cut.gz", &cut_gz[..cut_gz.len() - 6]);
    assert!(matches!(
        load_idx(&cut_gz, &labels),
        Err(EngineError::Data { .. })
    ));
    let missing = dir.join("missing");
    assert_data_err(load_idx(&missing, &labels), &missing, "cannot open");
    std::fs::remove_dir_all(dir).ok();
}

// ---- CSV ---------------------------------------------------------------

#[test]
fn csv_options_header_and_label_columns() {
    let dir = temp_dir("csv-ok");
    let with_header = write(&dir, "h.csv", b"label,a,b\r\n1, 0.5,2\n0,1e-3,-4\n\n");
    let d = load_csv_with(
        &with_header,
        &CsvOptions {
            label: LabelColumn::First,
            ..CsvOptions::default()
        },
    )
    .unwrap();
    assert_eq!(
        (d.len(), d.feature_shape(), d.labels()),
        (2, &[2][..], &[1, 0][..])
    );
    assert_eq!(d.features(), &[0.5, 2.0, 0.001, -4.0]);

    let tabs = write(&dir, "t.tsv", b"1\t2\t3.0\n4\t5\t1\n");
    let opts = CsvOptions {
        label: LabelColumn::Index(2),
        header: CsvHeader::Absent,
        delimiter: b'\t',
    };
    let d = load_csv_with(&tabs, &opts).unwrap();
    assert_eq!((d.labels(), d.num_classes()), (&[3, 1][..], 4));

    let unlabelled = load_csv_with(
        &tabs,
        &CsvOptions {
            label: LabelColumn::None,
            ..opts
        },
    )
    .unwrap();
    assert_eq!(
        (unlabelled.feature_shape(), unlabelled.num_classes()),
        (&[3][..], 1)
    );
    let gz = write(&dir, "g.csv.gz", &gzip(b"1,2,0\n3,4,1\n"));
    assert_eq!(
        load_csv(&gz, LabelColumn::Last).unwrap().features(),
        &[1.0, 2.0, 3.0, 4.0]
    );
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn malformed_csv_files_are_rejected_with_file_and_cause() {
    let dir = temp_dir("bad-csv");
    let cases: &[(&str, &[u8], &str)] = &[
        (
            "short-row.csv",
            b"1,2,3,0\n1,2,3,1\n1,2,1\n",
            "row 3 (line 3) has 3 columns, expected 4",
        ),
        (
            "text-cell.csv",
            b"1,2,0\n1,abc,1\n",
            "line 2, column 2: not a number (\"abc\")",
        ),
        (
            "empty-cell.csv",
            b"1,2,0\n1,,1\n",
            "line 2, column 2: not a number",
        ),
        ("frac-label.csv", b"1,2,3.5\n", "label is not an integer"),
        ("neg-label.csv", b"1,2,-1\n", "label must be in 0.."),
        ("nan.csv", b"1,2,0\n1,NaN,1\n", "not a finite number"),
        ("empty.csv", b"\n\n", "no rows"),
        ("header-only.csv", b"a,b,label\n", "no data rows"),
        ("one-col.csv", b"1\n2\n", "no feature columns"),
        ("binary.csv", &[0xff, 0xfe, 0x00, 0x31], "not UTF-8"),
    ];
    for (name, bytes, needle) in cases {
        let path = write(&dir, name, bytes);
        assert_data_err(load_csv(&path, LabelColumn::Last), &path, needle);
    }
    let path = write(&dir, "idx.csv", b"1,2,3\n");
    assert_data_err(
        load_csv(&path, LabelColumn::Index(5)),
        &path,
        "label column 5",
    );
    std::fs::remove_dir_all(dir).ok();
}

// ---- NPY ---------------------------------------------------------------

#[test]
fn npy_arrays_of_each_dtype_load() {
    let dir = temp_dir("npy-ok");
    let f32s: Vec<u8> = [1.5f32, -2.0, 3.25, 4.0, 5.0, 6.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let a = load_npy(write(&dir, "f4.npy", &npy("<f4", false, "(2, 3)", &f32s))).unwrap();
    assert_eq!(a.shape(), &[2, 3]);
    assert_eq!(
        a.iter().copied().collect::<Vec<_>>(),
        vec![1.5, -2.0, 3.25, 4.0, 5.0, 6.0]
    );
    let f64s: Vec<u8> = [0.5f64, 2.0].iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(
        load_npy(write(&dir, "f8.npy", &npy("<f8", false, "(2,)", &f64s)))
            .unwrap()
            .into_raw_vec_and_offset()
            .0,
        vec![0.5, 2.0]
    );
    let i32s: Vec<u8> = [-3i32, 7].iter().flat_map(|x| x.to_le_bytes()).collect();
    assert_eq!(
        load_npy(write(&dir, "i4.npy", &npy("<i4", false, "(2,)", &i32s)))
            .unwrap()
            .into_raw_vec_and_offset()
            .0,
        vec![-3.0, 7.0]
    );
    let scalar: Vec<u8> = 9i64.to_le_bytes().to_vec();
    assert_eq!(
        load_npy(write(&dir, "s.npy", &npy("<i8", false, "()", &scalar)))
            .unwrap()
            .shape(),
        &[] as &[usize]
    );

    let images = write(&dir, "img.npy", &npy("|u1", false, "(3, 2, 2)", &[255; 12]));
    let labels: Vec<u8> = [2i64, 0, 1].iter().flat_map(|x| x.to_le_bytes()).collect();
    let labels = write(&dir, "lbl.npy", &npy("<i8", false, "(3,)", &labels));
    let d = load_npy_dataset(&images, &labels).unwrap();
    assert_eq!(
        (d.len(), d.feature_shape(), d.labels()),
        (3, &[2, 2][..], &[2, 0, 1][..])
    );
    assert!(
        d.features().iter().all(|&x| x == 1.0),
        "u8 images scale to [0, 1]"
    );
    let few = write(&dir, "few.npy", &npy("|u1", false, "(2,)", &[0, 1]));
    assert_data_err(
        load_npy_dataset(&images, &few),
        &few,
        "labels file has 2 items but images file has 3",
    );
    let frac: Vec<u8> = [1.0f32, 0.5, 0.0]
        .iter()
        .flat_map(|x| x.to_le_bytes())
        .collect();
    let frac = write(&dir, "frac.npy", &npy("<f4", false, "(3,)", &frac));
    assert_data_err(load_npy_dataset(&images, &frac), &frac, "not a class index");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn malformed_npy_files_are_rejected_with_file_and_cause() {
    let dir = temp_dir("bad-npy");
    let cases: Vec<(&str, Vec<u8>, &str)> = vec![
        (
            "fortran.npy",
            npy("<f4", true, "(2, 2)", &[0; 16]),
            "Fortran",
        ),
        (
            "truncated.npy",
            npy("<f4", false, "(2, 2)", &[0; 15]),
            "truncated",
        ),
        (
            "trailing.npy",
            npy("|u1", false, "(2,)", &[0; 3]),
            "trailing",
        ),
        (
            "big-endian.npy",
            npy(">f4", false, "(1,)", &[0; 4]),
            "big-endian",
        ),
        (
            "complex.npy",
            npy("<c8", false, "(1,)", &[0; 8]),
            "not supported",
        ),
        (
            "huge.npy",
            npy("<f4", false, "(4000000000, 4000000000)", &[0; 4]),
            "limit",
        ),
        (
            "overflow.npy",
            npy("<f4", false, "(2, 18446744073709551615, 16)", &[0; 4]),
            "overflow",
        ),
        (
            "bad-shape.npy",
            npy("<f4", false, "(two,)", &[0; 4]),
            "not a size",
        ),
        (
            "magic.npy",
            b"PK\x03\x04 not numpy".to_vec(),
            "missing \\x93NUMPY magic",
        ),
        ("short.npy", b"\x93NUMPY\x01\x00\xff".to_vec(), "too short"),
        (
            "long-header.npy",
            b"\x93NUMPY\x02\x00\xff\xff\xff\x7f{".to_vec(),
            "exceeds the limit",
        ),
    ];
    for (name, bytes, needle) in cases {
        let path = write(&dir, name, &bytes);
        assert_data_err(load_npy(&path), &path, needle);
    }
    let no_shape = write(
        &dir,
        "no-shape.npy",
        b"\x93NUMPY\x01\x00\x20\x00{'descr': '<f4', 'fortran_order': False}",
    );
    assert!(matches!(load_npy(&no_shape), Err(EngineError::Data { .. })));
    std::fs::remove_dir_all(dir).ok();
}

// ---- load_dir layouts --------------------------------------------------

#[test]
fn load_dir_finds_csv_pairs_and_reports_unknown_layouts() {
    let dir = temp_dir("dir-csv");
    write(&dir, "train.csv", b"0,0,0\n1,1,1\n2,2,2\n");
    write(&dir, "test.csv.gz", &gzip(b"5,5,1\n"));
    let (train, test) = load_dir(&dir).unwrap();
    assert_eq!((train.len(), test.len(), test.num_classes()), (3, 1, 3));

    let empty = temp_dir("dir-empty");
    write(&empty, "notes.txt", b"hello");
    assert_data_err(load_dir(&empty), &empty, "no dataset found");
    let half = temp_dir("dir-half");
    write(
        &half,
        "train-images-idx3-ubyte",
        &idx(0x803, &[1, 1, 1], &[0]),
    );
    assert_data_err(load_dir(&half), &half, "no train-labels* file");
    for d in [dir, empty, half] {
        std::fs::remove_dir_all(d).ok();
    }
}

// ---- dataset transforms ------------------------------------------------

#[test]
fn reshape_subset_and_normalization() {
    let (train, test) = load_dir(mnist_dir()).unwrap();
    let flat = train.clone().with_feature_shape(&[784]).unwrap();
    assert_eq!(
        (flat.feature_shape(), flat.features()),
        (&[784][..], train.features())
    );
    assert!(train.clone().with_feature_shape(&[783]).is_err());
    assert!(train.clone().with_feature_shape(&[]).is_err());

    let sub = train.subset(&[5, 0, 5]);
    assert_eq!(sub.len(), 3);
    assert_eq!(sub.sample(0), train.sample(5));
    assert_eq!(sub.sample(1), train.sample(0));
    assert!(train.try_subset(&[8004]).is_err());

    let mut norm = train.clone();
    norm.normalize(0.1307, 0.3081).unwrap();
    let (mean, std) = norm.global_stats();
    assert!(
        mean.abs() < 0.05 && (std - 1.0).abs() < 0.05,
        "{mean} {std}"
    );
    assert!(norm.normalize(0.0, 0.0).is_err());
    let mut scaled = train.clone();
    scaled.scale(255.0);
    assert_eq!(
        scaled.features().iter().copied().fold(0f32, f32::max),
        255.0
    );

    let mut std_train = train.clone();
    let stats = std_train.standardize();
    assert_eq!(stats.mean.len(), 784);
    let after = std_train.feature_stats();
    let centre = 14 * 28 + 14;
    assert!(after.mean[centre].abs() < 1e-4 && (after.std[centre] - 1.0).abs() < 1e-3);
    assert!(after.mean.iter().chain(&after.std).all(|x| x.is_finite()));
    let mut std_test = test.clone();
    std_test.apply_stats(&stats).unwrap();
    assert!(std_test.features().iter().all(|x| x.is_finite()));
    assert!(std_test.apply_stats(&tagged(4, 2).feature_stats()).is_err());
}

#[test]
fn dataset_new_checks_invariants() {
    assert!(Dataset::new(vec![0.0; 6], vec![2], vec![0, 1, 1], 2).is_ok());
    assert!(Dataset::new(vec![0.0; 5], vec![2], vec![0, 1, 1], 2).is_err());
    assert!(Dataset::new(vec![0.0; 6], vec![2], vec![0, 2, 1], 2).is_err());
    assert!(Dataset::new(vec![0.0; 6], vec![2], vec![0, -1, 1], 2).is_err());
    assert!(Dataset::new(vec![], vec![0], vec![], 2).is_err());
}

#[test]
fn split_is_stratified_and_seeded() {
    let d = tagged(1000, 10);
    let (train, test) = d.split(0.25, 1).unwrap();
    assert_eq!((train.len(), test.len()), (750, 250));
    assert!(test.class_counts().iter().all(|&c| c == 25));
    assert_covers(&[train.clone(), test.clone()], 1000);
    assert_eq!(d.split(0.25, 1).unwrap().1, test);
    assert_ne!(d.split(0.25, 2).unwrap().1, test);
    assert!(d.split(1.5, 0).is_err());
}

// ---- batching ----------------------------------------------------------

#[test]
fn batches_cover_every_sample_once_with_right_shapes() {
    let d = tagged(103, 5);
    for seed in [None, Some(3)] {
        let batches: Vec<_> = d.batches(10, seed, false).unwrap().collect();
        assert_eq!(batches.len(), 11);
        assert_eq!(batches[10].len(), 3);
        let mut seen = Vec::new();
        for b in &batches {
            assert_eq!(b.x.shape(), &[b.len(), 2]);
            assert_eq!(b.y.shape(), &[b.len()]);
            let x = b.x.to_f32_vec().unwrap();
            let Value::I64(y) = &b.y else {
                panic!("labels must be i64")
            };
            for (row, &label) in x.chunks(2).zip(y.iter()) {
                assert_eq!(row[1] as i64, label, "features and label out of step");
                seen.push(row[0] as usize);
            }
        }
        seen.sort_unstable();
        assert_eq!(seen, (0..103).collect::<Vec<_>>());
    }
    let dropped = d.batches(10, Some(1), true).unwrap();
    assert_eq!(dropped.len(), 10);
    assert!(dropped.into_iter().all(|b| b.len() == 10));
    assert!(d.batches(0, None, false).is_err());
}

#[test]
fn shuffling_is_reproducible_and_seed_dependent() {
    let d = tagged(500, 10);
    let order = |seed| d.batches(32, Some(seed), false).unwrap().order().to_vec();
    assert_eq!(order(7), order(7));
    assert_ne!(order(7), order(8));
    assert_ne!(order(7), (0..500).collect::<Vec<_>>());
    let a: Vec<_> = d.batches(32, Some(7), false).unwrap().collect();
    let b: Vec<_> = d.batches(32, Some(7), false).unwrap().collect();
    assert_eq!(a, b);
}

#[test]
fn mnist_batches_and_reused_buffers_agree() {
    let (train, _) = load_dir(mnist_dir()).unwrap();
    let first = train.batches(64, Some(0), false).unwrap().next().unwrap();
    assert_eq!(first.x.shape(), &[64, 1, 28, 28]);
    let (mut x, mut y) = (Vec::new(), Vec::new());
    let mut it = train.batches(64, Some(0), false).unwrap();
    assert_eq!(it.next_into(&mut x, &mut y), Some(64));
    assert_eq!(x, first.x.to_f32_vec().unwrap());
    let mut total = 64;
    while let Some(n) = it.next_into(&mut x, &mut y) {
        assert_eq!((x.len(), y.len()), (n * 784, n));
        total += n;
    }
    assert_eq!(total, 8004);
}

// ---- federated partitions ----------------------------------------------

#[test]
fn iid_partition_is_disjoint_and_balanced() {
    let d = tagged(1003, 10);
    let parts = partition_iid(&d, 10, 4).unwrap();
    assert_covers(&parts, 1003);
    assert!(parts.iter().all(|p| (100..=101).contains(&p.len())));
    assert_eq!(partition_iid(&d, 10, 4).unwrap(), parts);
    assert_partition_err(partition_iid(&d, 0, 4), "num_clients");
    assert_partition_err(
        partition_iid(&d, 1004, 4),
        "1004 clients but only 1003 samples",
    );
}

#[test]
fn label_partition_limits_classes_per_client() {
    let d = tagged(2000, 10);
    for (clients, lpc) in [(10, 2), (7, 3), (5, 2), (20, 1), (3, 10)] {
        let parts = partition_by_label(&d, clients, lpc, 9).unwrap();
        assert_eq!(parts.len(), clients);
        assert_covers(&parts, 2000);
        for p in &parts {
            assert!(!p.is_empty());
            assert!(
                distinct_labels(p) <= lpc,
                "{} labels > {lpc}",
                distinct_labels(p)
            );
            assert_eq!(p.num_classes(), 10);
        }
    }
    assert_eq!(
        partition_by_label(&d, 10, 2, 9).unwrap(),
        partition_by_label(&d, 10, 2, 9).unwrap()
    );
    assert_partition_err(partition_by_label(&d, 4, 2, 0), "cannot cover 10 classes");
    assert_partition_err(partition_by_label(&d, 4, 0, 0), "labels_per_client");

    let (train, _) = load_dir(mnist_dir()).unwrap();
    let parts = partition_by_label(&train, 10, 2, 0).unwrap();
    assert_eq!(parts.iter().map(Dataset::len).sum::<usize>(), 8004);
    assert!(parts.iter().all(|p| distinct_labels(p) <= 2));
}

/// Mean over clients of the entropy (bits) of the client's label mix.
fn mean_label_entropy(parts: &[Dataset]) -> f64 {
    let entropy = |p: &Dataset| {
        let n = p.len() as f64;
        p.class_counts()
            .iter()
            .filter(|&&c| c > 0)
            .map(|&c| -(c as f64 / n) * (c as f64 / n).log2())
            .sum::<f64>()
    };
    parts.iter().map(entropy).sum::<f64>() / parts.len() as f64
}

#[test]
fn dirichlet_skew_follows_alpha_and_seed() {
    let (train, _) = load_dir(mnist_dir()).unwrap();
    let skewed = partition_dirichlet(&train, 10, 0.1, 1).unwrap();
    let near_iid = partition_dirichlet(&train, 10, 100.0, 1).unwrap();
    for parts in [&skewed, &near_iid] {
        assert_eq!(parts.iter().map(Dataset::len).sum::<usize>(), 8004);
        assert!(parts.iter().all(|p| p.len() >= 10));
    }
    let (h_small, h_large) = (mean_label_entropy(&skewed), mean_label_entropy(&near_iid));
    assert!(
        h_small + 1.0 < h_large,
        "alpha 0.1 entropy {h_small} vs alpha 100 entropy {h_large}"
    );
    assert!(
        h_large > 3.2,
        "alpha 100 should be near uniform over 10 classes: {h_large}"
    );

    assert_eq!(partition_dirichlet(&train, 10, 0.1, 1).unwrap(), skewed);
    assert_ne!(partition_dirichlet(&train, 10, 0.1, 2).unwrap(), skewed);

    let d = tagged(1000, 10);
    assert_covers(&partition_dirichlet(&d, 8, 0.5, 3).unwrap(), 1000);
    for alpha in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_partition_err(partition_dirichlet(&d, 4, alpha, 0), "alpha");
    }
    assert_partition_err(partition_dirichlet(&d, 0, 1.0, 0), "num_clients");
    assert_partition_err(partition_dirichlet(&d, 1001, 1.0, 0), "clients but only");
    let impossible = DirichletOptions {
        min_samples: 200,
        max_attempts: 5,
        ..DirichletOptions::default()
    };
    assert_partition_err(
        partition_dirichlet_with(&d, 8, 0.5, 0, &impossible),
        "at least 200 samples in 5 draws",
    );
}

#[test]
fn sized_dirichlet_gives_every_client_its_share_however_skewed() {
    let (train, _) = load_dir(mnist_dir()).unwrap();
    // 1,000 clients on 8,004 samples: the per-class partition cannot give
    // each even a few samples; this one gives each 8 or 9.
    let parts = partition_dirichlet_sized(&train, 1000, 0.5, 7).unwrap();
    assert_eq!(parts.iter().map(Dataset::len).sum::<usize>(), 8004);
    assert!(parts.iter().all(|p| (8..=9).contains(&p.len())));
    assert_eq!(
        partition_dirichlet_sized(&train, 1000, 0.5, 7).unwrap(),
        parts
    );
    assert_ne!(
        partition_dirichlet_sized(&train, 1000, 0.5, 8).unwrap(),
        parts
    );
    let skewed = partition_dirichlet_sized(&train, 20, 0.1, 1).unwrap();
    let near_iid = partition_dirichlet_sized(&train, 20, 100.0, 1).unwrap();
    let (h_small, h_large) = (mean_label_entropy(&skewed), mean_label_entropy(&near_iid));
    assert!(
        h_small + 1.0 < h_large,
        "alpha 0.1 entropy {h_small} vs alpha 100 entropy {h_large}"
    );
    let d = tagged(1000, 10);
    assert_covers(&partition_dirichlet_sized(&d, 1000, 0.01, 3).unwrap(), 1000);
    for alpha in [0.0, -1.0, f64::NAN, f64::INFINITY] {
        assert_partition_err(partition_dirichlet_sized(&d, 4, alpha, 0), "alpha");
    }
    assert_partition_err(
        partition_dirichlet_sized(&d, 1001, 1.0, 0),
        "clients but only",
    );
}

#[test]
fn digits_federated_demo_partitions() {
    let d = load_csv(digits_csv(), LabelColumn::Last).unwrap();
    let parts = partition_dirichlet(&d, 5, 0.5, 42).unwrap();
    assert_eq!(parts.iter().map(Dataset::len).sum::<usize>(), 1797);
    assert!(
        parts
            .iter()
            .all(|p| p.len() >= 10 && p.feature_shape() == [64])
    );
}

#[test]
fn csv_written_reads_back_identically() {
    let path = std::env::temp_dir().join(format!("canopy-write-csv-{}.csv", std::process::id()));
    let data =
        canopy_engine::data::Dataset::new(vec![0.5, -1.25, 3.0, 16.0], vec![2], vec![3, 7], 10)
            .unwrap();
    canopy_engine::data::write_csv(&path, &data).unwrap();
    let back =
        canopy_engine::data::load_csv(&path, canopy_engine::data::LabelColumn::Last).unwrap();
    std::fs::remove_file(&path).ok();
    assert_eq!(back.features(), data.features());
    assert_eq!(back.labels(), data.labels());
}

#[test]
fn mnist_moments_merge_across_dirichlet_clients_to_the_central_fit() {
    use canopy_engine::stats::InputMoments;
    let (train, _) = load_dir(mnist_dir()).unwrap();
    // Ten non-IID clients, as a federated statistics round would see them.
    let clients = partition_dirichlet(&train, 10, 0.3, 5).unwrap();
    let mut merged = InputMoments::empty(train.feature_len());
    for client in &clients {
        merged.merge(&InputMoments::of(client)).unwrap();
    }
    let whole = InputMoments::of(&train);
    assert_eq!(merged.count, whole.count);
    let close = |a: f64, b: f64| (a - b).abs() <= 1e-9 * b.abs().max(1.0);
    assert!(
        merged
            .sum
            .iter()
            .zip(&whole.sum)
            .all(|(a, b)| close(*a, *b))
    );
    assert!(
        merged
            .sum_sq
            .iter()
            .zip(&whole.sum_sq)
            .all(|(a, b)| close(*a, *b))
    );

    // The federated fit equals the central two-pass fit `model train` used.
    let stats = merged.to_input_stats().unwrap();
    let (mean, std) = train.global_stats();
    assert!(
        (stats.mean - mean).abs() < 1e-6 * mean,
        "{stats:?} vs {mean}"
    );
    assert!((stats.std - std).abs() < 1e-6 * std, "{stats:?} vs {std}");
    assert!((0.12..0.14).contains(&stats.mean) && (0.29..0.32).contains(&stats.std));
}
