//! `canopy model run FILE [--entry infer] --input NAME=X.npy … -o OUT.npz`:
//! runs any entry point on NumPy arrays and writes every output to an
//! `.npz` keyed by output name, so a model can be checked against another
//! runtime from the shell. Parameters come from the file; every other
//! input must be given, with its entry point's dtype and shape.
//!
//! `.npy` files are untrusted: the header's shape is checked against the
//! file's length before any array is allocated, and each file is bounded.

use std::collections::BTreeMap;
use std::io::Cursor;
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, anyhow, bail};
use canopy_engine::Value;
use canopy_engine::select::{BackendChoice, open_backend};
use canopy_ir::model::PARAM_PREFIX;
use canopy_ir::{DType, Dim, TensorType};
use clap::Args;
use ndarray::ArrayD;
use ndarray_npy::{NpzWriter, ReadNpyExt};

use crate::files::{Hint, OUTPUT_FILE_MODE, read_bounded, read_model_file, write_atomic};
use crate::output::outln;

/// The largest `.npy` file read, in bytes.
const MAX_NPY_BYTES: u64 = 1 << 30;
/// The largest `.npy` header, in bytes (NumPy writes 64 to a few hundred).
const MAX_NPY_HEADER_BYTES: usize = 1 << 16;
/// The most `--input` arguments.
const MAX_INPUTS: usize = 256;

#[derive(Args)]
pub struct RunArgs {
    file: PathBuf,
    /// The entry point to run.
    #[arg(long, default_value = "infer")]
    entry: String,
    /// An input as NAME=PATH.npy; one per input the entry point reads
    /// (parameters come from the file).
    #[arg(long = "input", value_name = "NAME=PATH")]
    inputs: Vec<String>,
    /// The `.npz` file to write, one array per output.
    #[arg(short, long)]
    out: PathBuf,
    /// cpu, gpu (any Vulkan, Metal or DX12 adapter) or auto (a hardware
    /// GPU when there is one, else the CPU).
    #[arg(long, default_value_t = BackendChoice::Auto)]
    backend: BackendChoice,
}

pub fn run(args: RunArgs) -> Result<()> {
    if args.inputs.len() > MAX_INPUTS {
        bail!(
            "{} --input arguments, more than {MAX_INPUTS}",
            args.inputs.len()
        );
    }
    let (model, _) = read_model_file(&args.file)?;
    let graph = model.entry_points.get(&args.entry).ok_or_else(|| {
        let known: Vec<&str> = model.entry_points.keys().map(String::as_str).collect();
        Hint::attach(
            anyhow!(
                "`{}` has no entry point `{}`",
                args.file.display(),
                args.entry
            ),
            format!("its entry points: {}", known.join(", ")),
        )
    })?;
    let mut given = given_inputs(&args.inputs)?;
    let mut values = Vec::with_capacity(graph.inputs().len());
    for &id in graph.inputs() {
        let name = graph.input_name(id);
        let ty = graph.ty(id);
        if let Some(param) = name.strip_prefix(PARAM_PREFIX) {
            let parameter = model
                .parameter(param)
                .ok_or_else(|| anyhow!("the model has no parameter `{param}`"))?;
            values.push(Value::from_data(&parameter.data));
            continue;
        }
        let path = given.remove(name).ok_or_else(|| {
            Hint::attach(
                anyhow!(
                    "entry point `{}` reads input `{name}` ({ty}), which no --input gives",
                    args.entry
                ),
                format!("pass --input {name}=PATH.npy"),
            )
        })?;
        let value = read_npy_input(&path)
            .with_context(|| format!("cannot read input `{name}` from `{}`", path.display()))?;
        check_input(name, ty, &value)?;
        values.push(value);
    }
    if let Some(extra) = given.keys().next() {
        bail!("entry point `{}` has no input `{extra}`", args.entry);
    }
    let backend = open_backend(args.backend)?;
    let outputs = backend.compile(graph)?.run(values)?;
    let names: Vec<&str> = graph.outputs().iter().map(|(n, _)| n.as_str()).collect();
    write_npz(&args.out, names.iter().copied().zip(&outputs))?;
    outln!(
        "{} `{}` -> {}: {}",
        args.file.display(),
        args.entry,
        args.out.display(),
        names.join(", ")
    )?;
    Ok(())
}

/// `NAME=PATH` pairs, each name once.
fn given_inputs(pairs: &[String]) -> Result<BTreeMap<String, PathBuf>> {
    let mut given = BTreeMap::new();
    for pair in pairs {
        let (name, path) = pair
            .split_once('=')
            .ok_or_else(|| anyhow!("--input `{pair}` is not NAME=PATH"))?;
        if given
            .insert(name.to_string(), PathBuf::from(path))
            .is_some()
        {
            bail!("--input `{name}` is given twice");
        }
    }
    Ok(given)
}

fn check_input(name: &str, ty: &TensorType, value: &Value) -> Result<()> {
    let fits = value.shape().len() == ty.shape.0.len()
        && value
            .shape()
            .iter()
            .zip(&ty.shape.0)
            .all(|(&n, dim)| matches!(dim, Dim::Batch) || *dim == Dim::Fixed(n));
    if value.dtype() != ty.dtype || !fits {
        return Err(Hint::attach(
            anyhow!(
                "input `{name}` is {} {:?}, but the entry point reads {ty}",
                value.dtype().name(),
                value.shape()
            ),
            if value.dtype() == ty.dtype {
                "reshape the array to the entry point's shape".to_string()
            } else {
                format!("save it as {} (numpy: x.astype(...))", ty.dtype.name())
            },
        ));
    }
    Ok(())
}

/// A `.npy` file as a value: f32, i64, i32 or bool, little-endian, C order.
fn read_npy_input(path: &Path) -> Result<Value> {
    let bytes = read_bounded(path, MAX_NPY_BYTES)?;
    let (descr, shape, data_len) = npy_header(&bytes)?;
    let (dtype, element_bytes) = match descr.as_str() {
        "<f4" => (DType::F32, 4),
        "<i8" => (DType::I64, 8),
        "<i4" => (DType::I32, 4),
        "|b1" => (DType::Bool, 1),
        other => {
            return Err(Hint::attach(
                anyhow!("element type `{other}` is not one Canopy reads"),
                "save float32, int64, int32 or bool, little-endian (numpy: x.astype(np.float32))",
            ));
        }
    };
    let elements = shape
        .iter()
        .try_fold(1usize, |n, &d| n.checked_mul(d))
        .ok_or_else(|| anyhow!("shape {shape:?} overflows"))?;
    if elements.checked_mul(element_bytes) != Some(data_len) {
        bail!("the header declares shape {shape:?}, but the file holds {data_len} bytes of data");
    }
    // The declared size matches the bytes present, so reading allocates
    // no more than the file holds.
    let reader = Cursor::new(&bytes);
    Ok(match dtype {
        DType::F32 => Value::F32(ArrayD::<f32>::read_npy(reader)?),
        DType::I64 => Value::I64(ArrayD::<i64>::read_npy(reader)?),
        DType::I32 => Value::I32(ArrayD::<i32>::read_npy(reader)?),
        DType::Bool => Value::Bool(ArrayD::<bool>::read_npy(reader)?),
    })
}

/// The descr, the shape and the data length of a `.npy` file, refusing
/// Fortran order (the engine's arrays are C order).
fn npy_header(bytes: &[u8]) -> Result<(String, Vec<usize>, usize)> {
    let not_npy = || anyhow!("not a .npy file (no NumPy header)");
    if bytes.len() < 10 || &bytes[..6] != b"\x93NUMPY" {
        return Err(not_npy());
    }
    let (header_len, start) = match bytes[6] {
        1 => (usize::from(u16::from_le_bytes([bytes[8], bytes[9]])), 10),
        2 | 3 if bytes.len() >= 12 => {
            let len = u32::from_le_bytes([bytes[8], bytes[9], bytes[10], bytes[11]]);
            (usize::try_from(len)?, 12)
        }
        _ => return Err(not_npy()),
    };
    if header_len > MAX_NPY_HEADER_BYTES || start + header_len > bytes.len() {
        bail!("the .npy header length {header_len} does not fit the file");
    }
    let header = std::str::from_utf8(&bytes[start..start + header_len])
        .map_err(|_| anyhow!("the .npy header is not text"))?;
    let field = |key: &str| -> Result<&str> {
        let at = header
            .find(&format!("'{key}':"))
            .ok_or_else(|| anyhow!("the .npy header has no `{key}`"))?;
        Ok(header[at + key.len() + 3..].trim_start())
    };
    let descr = field("descr")?
        .trim_start_matches('\'')
        .split('\'')
        .next()
        .unwrap_or_default()
        .to_string();
    if field("fortran_order")?.starts_with("True") {
        bail!("the array is in Fortran order; save it with np.ascontiguousarray");
    }
    let tuple = field("shape")?;
    let inside = tuple
        .strip_prefix('(')
        .and_then(|t| t.split(')').next())
        .ok_or_else(|| anyhow!("the .npy header's shape is not a tuple"))?;
    let shape = inside
        .split(',')
        .map(str::trim)
        .filter(|d| !d.is_empty())
        .map(|d| {
            d.parse::<usize>()
                .map_err(|_| anyhow!("shape entry `{d}` is not a size"))
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((descr, shape, bytes.len() - start - header_len))
}

/// Builds the archive in memory, since the outputs are already there and a
/// file can only be replaced atomically whole.
fn write_npz<'a>(path: &Path, outputs: impl Iterator<Item = (&'a str, &'a Value)>) -> Result<()> {
    let mut npz = NpzWriter::new(Cursor::new(Vec::new()));
    for (name, value) in outputs {
        match value {
            Value::F32(a) => npz.add_array(name, a),
            Value::I64(a) => npz.add_array(name, a),
            Value::I32(a) => npz.add_array(name, a),
            Value::Bool(a) => npz.add_array(name, a),
        }
        .with_context(|| format!("cannot write output `{name}`"))?;
    }
    npz.finish()
        .context("cannot finish the .npz")
        .and_then(|archive| write_atomic(path, &archive.into_inner(), OUTPUT_FILE_MODE))
        .with_context(|| format!("cannot write `{}`", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A version-1 `.npy` file with `header` (padded as NumPy pads it) and
    /// `data`.
    fn npy(header: &str, data: &[u8]) -> Vec<u8> {
        let mut text = header.to_string();
        while !(10 + text.len() + 1).is_multiple_of(64) {
            text.push(' ');
        }
        text.push('\n');
        let mut out = b"\x93NUMPY\x01\x00".to_vec();
        out.extend_from_slice(&(text.len() as u16).to_le_bytes());
        out.extend_from_slice(text.as_bytes());
        out.extend_from_slice(data);
        out
    }

    #[test]
    fn a_well_formed_header_gives_its_type_and_shape() {
        let bytes = npy(
            "{'descr': '<f4', 'fortran_order': False, 'shape': (2, 3), }",
            &[0; 24],
        );
        let (descr, shape, len) = npy_header(&bytes).unwrap();
        assert_eq!((descr.as_str(), shape, len), ("<f4", vec![2, 3], 24));
        let scalar = npy(
            "{'descr': '<i8', 'fortran_order': False, 'shape': (), }",
            &[0; 8],
        );
        assert_eq!(npy_header(&scalar).unwrap().1, Vec::<usize>::new());
    }

    #[test]
    fn headers_that_do_not_fit_their_file_are_refused_before_allocating() {
        let dir = tempfile::tempdir().unwrap();
        let cases = [
            // 2^40 elements declared over 24 bytes.
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (1099511627776,), }",
                24,
                "declares shape",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (99999999999, 99999999999, 99999999999), }",
                24,
                "overflows",
            ),
            (
                "{'descr': '<f4', 'fortran_order': True, 'shape': (2, 3), }",
                24,
                "Fortran order",
            ),
            (
                "{'descr': '>f4', 'fortran_order': False, 'shape': (2, 3), }",
                24,
                "`>f4`",
            ),
            (
                "{'descr': '<f4', 'fortran_order': False, 'shape': (two,), }",
                24,
                "not a size",
            ),
        ];
        for (k, (header, data_len, cause)) in cases.into_iter().enumerate() {
            let path = dir.path().join(format!("{k}.npy"));
            std::fs::write(&path, npy(header, &vec![0; data_len])).unwrap();
            let error = format!("{:#}", read_npy_input(&path).unwrap_err());
            assert!(error.contains(cause), "{header}: {error}");
        }
        let path = dir.path().join("short.npy");
        std::fs::write(&path, b"\x93NUMPY\x01\x00\xff\x7f{").unwrap();
        let error = format!("{:#}", read_npy_input(&path).unwrap_err());
        assert!(error.contains("does not fit the file"), "{error}");
    }
}
