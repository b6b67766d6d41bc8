//! One tiled GEMM kernel generator, and the ops built on it: batched
//! matmul, and convolution forward and backward-input as implicit GEMM
//! (where [`pays_off`] says the tile is worth it), and the filter gradient
//! as a tree reduction per output.
//!
//! Each workgroup computes a `rows × cols` tile of one batch element's
//! output. Per stage it copies a `rows × depth` slice of A and a
//! `depth × cols` slice of B into workgroup memory, then each invocation
//! accumulates `PER_INVOCATION × PER_INVOCATION` outputs in registers,
//! interleaved so neighbouring invocations read neighbouring words.
//!
//! Operands are read in one of two ways:
//! - [`Operand::Dense`]: a strided matrix in a storage buffer. When its
//!   contiguous side is a multiple of 4, the buffer is bound as
//!   `array<vec4<f32>>` and each invocation copies four elements per load
//!   (vectorised loads), else one.
//! - [`Operand::Gather`]: any expression of the global row and column.
//!   Convolutions use it to read input windows in place (implicit GEMM), so
//!   no im2col matrix is materialised.
//!
//! The tile shape follows the output: each side is rounded up to a power
//! of two from 8 to 64; two sides of 64 make a 64×64 tile, and otherwise
//! a side of 64 becomes 128, so LeNet's 6 and 16 output channels do
//! not leave most of a square tile idle.

use std::fmt::Write;

use canopy_ir::{Conv2dAttrs, DType, Op};

use super::{Bind, Family, Kernel, Site, foreign};
use crate::gpu::wgsl::{
    HELPERS, WORKGROUP, broadcast_index, coordinates, declare, grid, workgroup_tree,
};

/// The matmul family's kernels (convolution reaches the GEMM from
/// `conv.rs`).
pub fn generate(site: &Site<'_>) -> Result<Vec<Kernel>, String> {
    match site.op {
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => Ok(vec![matmul(site, *transpose_a, *transpose_b)]),
        other => Err(foreign(other, Family::MatMul)),
    }
}

/// Outputs per invocation along each side of the tile.
const PER_INVOCATION: usize = 4;
/// The depth of one workgroup-memory stage; a multiple of 4 for vec4 loads.
const DEPTH: usize = 16;
/// The long side of a tile whose short side is under [`SQUARE`].
const LONG: usize = 128;
const SQUARE: usize = 64;
/// The smallest tile side.
const MIN_SIDE: usize = 8;

/// Whether a convolution with `channels` output columns and `depth` terms
/// per output is worth a GEMM tile: with fewer channels most of a tile's
/// columns are padding, and with a shallow depth staging costs more than
/// the reuse it buys. Below this the direct kernel (one invocation per
/// output, its window in a loop) is faster: on lavapipe LeNet-5's
/// convolutions (6 and 16 channels, depth 25 and 150) ran at half the
/// speed as GEMMs.
pub fn pays_off(channels: usize, depth: usize) -> bool {
    channels >= 32 && depth >= 64
}

/// The output tile one workgroup computes.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct TileShape {
    rows: usize,
    cols: usize,
}

impl TileShape {
    fn for_output(m: usize, n: usize) -> Self {
        // A side over half a square tile takes a whole one: a 128-long
        // tile with a 64 side would need 512 invocations.
        let side = |extent: usize| extent.next_power_of_two().clamp(MIN_SIDE, SQUARE);
        let (rows, cols) = match (side(m), side(n)) {
            (SQUARE, SQUARE) => (SQUARE, SQUARE),
            (SQUARE, short) => (LONG, short),
            (short, SQUARE) => (short, LONG),
            (rows, cols) => (rows, cols),
        };
        Self { rows, cols }
    }

    /// Invocations along columns (x) and rows (y).
    fn threads(self) -> (usize, usize) {
        (self.cols / PER_INVOCATION, self.rows / PER_INVOCATION)
    }
}

/// How the tile loader reads one operand.
pub enum Operand {
    /// Element (r, c) at `base + r·row_stride + c·col_stride`, where one of
    /// the strides is 1 and `base` is an expression of the batch index
    /// `bi` that is a multiple of the contiguous side.
    Dense {
        base: String,
        row_stride: usize,
        col_stride: usize,
    },
    /// An f32 expression of the in-bounds global row `gr` and column `gc`.
    Gather(String),
}

/// One GEMM: `out(r, c) = Σ_k A(r, k) · B(k, c)` for each batch element.
pub struct Gemm<'a> {
    pub label: &'static str,
    pub m: usize,
    pub n: usize,
    pub k: usize,
    pub batches: u64,
    /// Statements run first, seeing the batch index `bi`.
    pub prologue: String,
    /// Per-row values computed once per workgroup rather than once per
    /// stage: each `(name, expression of the global row gr)` fills
    /// workgroup array `row_{name}` (i32), which a gather reads as
    /// `row_{name}[gr - row0]`. Convolutions keep a row's image offset
    /// and window corner here, so a stage's loads skip the divisions.
    pub row_values: Vec<(&'static str, String)>,
    pub a: Operand,
    pub b: Operand,
    /// Statements storing `value` at output row `r`, column `c`.
    pub store: &'a str,
}

/// A dense operand's layout, once vectorisation is decided.
struct Layout<'a> {
    base: &'a str,
    row_stride: usize,
    col_stride: usize,
    /// Whether rows (not columns) are the contiguous side.
    along_rows: bool,
    vec4: bool,
}

impl<'a> Layout<'a> {
    /// `vectorise` is false for an empty GEMM, whose operands may be
    /// buffers smaller than one vec4.
    fn of(operand: &'a Operand, rows: usize, cols: usize, vectorise: bool) -> Option<Self> {
        let Operand::Dense {
            base,
            row_stride,
            col_stride,
        } = operand
        else {
            return None;
        };
        let along_rows = *row_stride == 1 && *col_stride != 1;
        let (contiguous, stride) = if along_rows {
            (rows, *col_stride)
        } else {
            (cols, *row_stride)
        };
        Some(Self {
            base,
            row_stride: *row_stride,
            col_stride: *col_stride,
            along_rows,
            vec4: vectorise && contiguous % 4 == 0 && stride % 4 == 0,
        })
    }
}

impl Gemm<'_> {
    pub fn kernel(&self) -> Kernel {
        let tile = TileShape::for_output(self.m, self.n);
        let (threads_x, threads_y) = tile.threads();
        let lanes = threads_x * threads_y;
        let vectorise = self.m * self.n * self.k > 0 && self.batches > 0;
        let a_layout = Layout::of(&self.a, self.m, self.k, vectorise);
        let b_layout = Layout::of(&self.b, self.k, self.n, vectorise);
        let mut source = String::from(HELPERS);
        let mut bindings = Vec::new();
        for (name, layout) in [("a0", &a_layout), ("a1", &b_layout)] {
            let k = bindings.len();
            if layout.as_ref().is_some_and(|l| l.vec4) {
                let _ = writeln!(
                    source,
                    "@group(0) @binding({k}) var<storage, read> {name}: array<vec4<f32>>;"
                );
            } else {
                declare(&mut source, k, name, DType::F32, false);
            }
            bindings.push(Bind::Operand(k));
        }
        declare(&mut source, 2, "out", DType::F32, true);
        bindings.push(Bind::Output);
        let fill_a = fill(
            "tile_a",
            "a0",
            [tile.rows, DEPTH],
            ["row0", "k0"],
            [self.m, self.k],
            &self.a,
            a_layout.as_ref(),
            lanes,
        );
        let fill_b = fill(
            "tile_b",
            "a1",
            [DEPTH, tile.cols],
            ["k0", "col0"],
            [self.k, self.n],
            &self.b,
            b_layout.as_ref(),
            lanes,
        );
        let mut row_setup = String::new();
        for (name, expression) in &self.row_values {
            let _ = writeln!(
                source,
                "var<workgroup> row_{name}: array<i32, {}>;",
                tile.rows
            );
            let _ = writeln!(
                row_setup,
                "  for (var e = lane; e < {rows}u; e = e + {lanes}u) {{ let gr = row0 + e; row_{name}[e] = {expression}; }}",
                rows = tile.rows
            );
        }
        if !row_setup.is_empty() {
            row_setup.push_str("  workgroupBarrier();\n");
        }
        let _ = write!(
            source,
            r#"var<workgroup> tile_a: array<f32, {a_len}>;
var<workgroup> tile_b: array<f32, {b_len}>;
@compute @workgroup_size({threads_x}, {threads_y}, 1)
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_id) lid: vec3<u32>) {{
  let bi = wid.z;
{prologue}
  let row0 = wid.y * {rows}u;
  let col0 = wid.x * {cols}u;
  let lane = lid.y * {threads_x}u + lid.x;
{row_setup}  var acc: array<array<f32, {PER_INVOCATION}>, {PER_INVOCATION}>;
  for (var k0 = 0u; k0 < {k}u; k0 = k0 + {DEPTH}u) {{
{fill_a}{fill_b}    workgroupBarrier();
    for (var kk = 0u; kk < {DEPTH}u; kk = kk + 1u) {{
      var b_reg: array<f32, {PER_INVOCATION}>;
      for (var j = 0u; j < {PER_INVOCATION}u; j = j + 1u) {{ b_reg[j] = tile_b[kk * {cols}u + lid.x + j * {threads_x}u]; }}
      for (var i = 0u; i < {PER_INVOCATION}u; i = i + 1u) {{
        let a_val = tile_a[(lid.y + i * {threads_y}u) * {DEPTH}u + kk];
        for (var j = 0u; j < {PER_INVOCATION}u; j = j + 1u) {{ acc[i][j] = acc[i][j] + a_val * b_reg[j]; }}
      }}
    }}
    workgroupBarrier();
  }}
  for (var i = 0u; i < {PER_INVOCATION}u; i = i + 1u) {{
    let r = row0 + lid.y + i * {threads_y}u;
    for (var j = 0u; j < {PER_INVOCATION}u; j = j + 1u) {{
      let c = col0 + lid.x + j * {threads_x}u;
      if (r < {m}u && c < {n}u) {{
        let value = acc[i][j];
        {store}
      }}
    }}
  }}
}}
"#,
            a_len = tile.rows * DEPTH,
            b_len = DEPTH * tile.cols,
            rows = tile.rows,
            cols = tile.cols,
            prologue = self.prologue,
            k = self.k,
            m = self.m,
            n = self.n,
            store = self.store,
        );
        Kernel {
            label: self.label,
            source,
            workgroups: [
                self.n.div_ceil(tile.cols) as u32,
                self.m.div_ceil(tile.rows) as u32,
                self.batches.max(1) as u32,
            ],
            bindings,
        }
    }
}

/// Statements copying one stage of an operand into workgroup memory
/// `tile` (`shape` rows × columns, row-major), zero outside `limits`.
#[allow(clippy::too_many_arguments)]
fn fill(
    tile: &str,
    buffer: &str,
    shape: [usize; 2],
    origin: [&str; 2],
    limits: [usize; 2],
    operand: &Operand,
    layout: Option<&Layout<'_>>,
    lanes: usize,
) -> String {
    let [rows, cols] = shape;
    let [row0, col0] = origin;
    let [row_limit, col_limit] = limits;
    let in_bounds = format!("gr < {row_limit}u && gc < {col_limit}u");
    let Some(layout) = layout.filter(|l| l.vec4) else {
        let value = match (operand, layout) {
            (Operand::Gather(expression), _) => expression.clone(),
            (_, Some(l)) => format!(
                "{buffer}[{} + gr * {}u + gc * {}u]",
                l.base, l.row_stride, l.col_stride
            ),
            (Operand::Dense { .. }, None) => unreachable!("a dense operand has a layout"),
        };
        return format!(
            "    for (var e = lane; e < {len}u; e = e + {lanes}u) {{
      let gr = {row0} + e / {cols}u; let gc = {col0} + e % {cols}u;
      {tile}[e] = select(0.0, {value}, {in_bounds});
    }}
",
            len = rows * cols,
        );
    };
    // Four consecutive elements along the contiguous side per load; the
    // side is a multiple of 4, so a quad is wholly in or out of bounds.
    let (split, scatter) = if layout.along_rows {
        (
            format!(
                "let gc = {col0} + e / {q}u; let gr = {row0} + (e % {q}u) * 4u;",
                q = rows / 4
            ),
            format!("{tile}[(gr - {row0} + j) * {cols}u + gc - {col0}]"),
        )
    } else {
        (
            format!(
                "let gr = {row0} + e / {q}u; let gc = {col0} + (e % {q}u) * 4u;",
                q = cols / 4
            ),
            format!("{tile}[(gr - {row0}) * {cols}u + gc - {col0} + j]"),
        )
    };
    format!(
        "    for (var e = lane; e < {quads}u; e = e + {lanes}u) {{
      {split}
      var v = vec4<f32>(0.0);
      if ({in_bounds}) {{ v = {buffer}[(({base}) + gr * {rs}u + gc * {cs}u) / 4u]; }}
      for (var j = 0u; j < 4u; j = j + 1u) {{ {scatter} = v[j]; }}
    }}
",
        quads = rows * cols / 4,
        base = layout.base,
        rs = layout.row_stride,
        cs = layout.col_stride,
    )
}

/// Batched matmul with broadcasting over the leading dimensions.
pub fn matmul(site: &Site<'_>, transpose_a: bool, transpose_b: bool) -> Kernel {
    let (_, a_shape) = &site.operands[0];
    let (_, b_shape) = &site.operands[1];
    let out = &site.out.1;
    let rank = out.len();
    let (m, n) = (out[rank - 2], out[rank - 1]);
    let k = if transpose_a {
        a_shape[a_shape.len() - 2]
    } else {
        a_shape[a_shape.len() - 1]
    };
    let batch_shape = &out[..rank - 2];
    let batch_offset = |shape: &[usize], matrix: usize| {
        let lead = &shape[..shape.len() - 2];
        let idx = if lead == batch_shape {
            "bi".to_string()
        } else {
            broadcast_index(lead, batch_shape)
        };
        format!("({idx}) * {matrix}u")
    };
    let (a_row, a_col) = if transpose_a { (1, m) } else { (k, 1) };
    let (b_row, b_col) = if transpose_b { (1, k) } else { (n, 1) };
    let store = format!("out[bi * {}u + r * {n}u + c] = value;", m * n);
    Gemm {
        label: "matmul",
        m,
        n,
        k,
        batches: batch_shape.iter().product::<usize>() as u64,
        prologue: coordinates(batch_shape, "bi"),
        row_values: Vec::new(),
        a: Operand::Dense {
            base: batch_offset(a_shape, m * k),
            row_stride: a_row,
            col_stride: a_col,
        },
        b: Operand::Dense {
            base: batch_offset(b_shape, k * n),
            row_stride: b_row,
            col_stride: b_col,
        },
        store: &store,
    }
    .kernel()
}

/// conv2d(x, w) as implicit GEMM: rows are output positions (n, oh, ow),
/// columns output channels, and the depth runs over (c, ki, kj); A reads
/// x's window in place, B is w viewed as [O, C·KH·KW] and transposed.
pub fn conv2d(site: &Site<'_>, attrs: &Conv2dAttrs) -> Kernel {
    let x = &site.operands[0].1;
    let w = &site.operands[1].1;
    let out = &site.out.1;
    let (batch, c, h, wd) = (x[0], x[1], x[2], x[3]);
    let (o, kh, kw) = (w[0], w[2], w[3]);
    let (oh, ow) = (out[2], out[3]);
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [dh, dw] = attrs.dilation;
    let depth = c * kh * kw;
    let ohw = oh * ow;
    let store = format!("out[((r / {ohw}u) * {o}u + c) * {ohw}u + r % {ohw}u] = value;");
    let mut kernel = Gemm {
        label: "conv2d",
        m: batch * ohw,
        n: o,
        k: depth,
        batches: 1,
        prologue: String::new(),
        row_values: vec![
            (
                "image",
                format!("i32((gr / {ohw}u) * {chw}u)", chw = c * h * wd),
            ),
            (
                "top",
                format!("i32(((gr % {ohw}u) / {ow}u) * {sh}u) - {ph}i"),
            ),
            ("left", format!("i32((gr % {ow}u) * {sw}u) - {pw}i")),
        ],
        a: Operand::Gather("window(gr - row0, gc)".into()),
        b: Operand::Dense {
            base: "0u".into(),
            row_stride: 1,
            col_stride: depth,
        },
        store: &store,
    }
    .kernel();
    let _ = write!(
        kernel.source,
        r#"
fn window(row: u32, kc: u32) -> f32 {{
  let ci = i32(kc / {khw}u);
  let ih = row_top[row] + i32(((kc % {khw}u) / {kw}u) * {dh}u);
  let iw = row_left[row] + i32((kc % {kw}u) * {dw}u);
  if (ih < 0i || ih >= {h}i || iw < 0i || iw >= {wd}i) {{ return 0.0; }}
  return a0[u32(row_image[row] + (ci * {h}i + ih) * {wd}i + iw)];
}}
"#,
        khw = kh * kw,
    );
    kernel
}

/// dx = conv2d_backward_input(dy, w) as implicit GEMM: rows are input
/// positions (n, ih, iw), columns input channels, depth (o, ki, kj); A
/// reads the dy element whose window covers (ih, iw) through (ki, kj), or
/// zero where none does.
pub fn conv2d_backward_input(site: &Site<'_>, attrs: &Conv2dAttrs) -> Kernel {
    let dy = &site.operands[0].1;
    let w = &site.operands[1].1;
    let out = &site.out.1;
    let (batch, o, oh, ow) = (dy[0], dy[1], dy[2], dy[3]);
    let (c, kh, kw) = (w[1], w[2], w[3]);
    let (h, wd) = (out[2], out[3]);
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [dh, dw] = attrs.dilation;
    let hw = h * wd;
    let store = format!("out[((r / {hw}u) * {c}u + c) * {hw}u + r % {hw}u] = value;");
    let mut kernel = Gemm {
        label: "conv2d_backward_input",
        m: batch * hw,
        n: c,
        k: o * kh * kw,
        batches: 1,
        prologue: String::new(),
        row_values: vec![
            (
                "image",
                format!("i32((gr / {hw}u) * {ohw}u)", ohw = o * oh * ow),
            ),
            ("top", format!("i32((gr % {hw}u) / {wd}u) + {ph}i")),
            ("left", format!("i32(gr % {wd}u) + {pw}i")),
        ],
        a: Operand::Gather("covering(gr - row0, gc)".into()),
        b: Operand::Gather(format!(
            "a1[(((gr / {khw}u) * {c}u + gc) * {khw}u) + gr % {khw}u]",
            khw = kh * kw
        )),
        store: &store,
    }
    .kernel();
    // With stride 1 every offset is a position; otherwise only multiples
    // of the stride are.
    let on_grid = |offset: &str, stride: usize| {
        if stride == 1 {
            String::new()
        } else {
            format!(" || {offset} % {stride}i != 0i")
        }
    };
    let _ = write!(
        kernel.source,
        r#"
fn covering(row: u32, kc: u32) -> f32 {{
  let oi = i32(kc / {khw}u);
  let th = row_top[row] - i32(((kc % {khw}u) / {kw}u) * {dh}u);
  let tw = row_left[row] - i32((kc % {kw}u) * {dw}u);
  if (th < 0i || tw < 0i{th_grid}{tw_grid}) {{ return 0.0; }}
  let y = th / {sh}i;
  let x = tw / {sw}i;
  if (y >= {oh}i || x >= {ow}i) {{ return 0.0; }}
  return a0[u32(row_image[row] + (oi * {oh}i + y) * {ow}i + x)];
}}
"#,
        khw = kh * kw,
        th_grid = on_grid("th", sh),
        tw_grid = on_grid("tw", sw),
    );
    kernel
}

/// dw = conv2d_backward_filter(x, dy): few outputs, each a sum over the
/// whole batch and every output position, so one workgroup per output
/// element folds a strided share per invocation, then a tree in workgroup
/// memory (as `reduce` does).
pub fn conv2d_backward_filter(site: &Site<'_>, attrs: &Conv2dAttrs) -> Kernel {
    let x = &site.operands[0].1;
    let dy = &site.operands[1].1;
    let out = &site.out.1;
    let (batch, c, h, wd) = (x[0], x[1], x[2], x[3]);
    let (o, oh, ow) = (dy[1], dy[2], dy[3]);
    let (kh, kw) = (out[2], out[3]);
    let [sh, sw] = attrs.stride;
    let [ph, pw] = attrs.padding;
    let [dh, dw] = attrs.dilation;
    let outputs = (o * c * kh * kw) as u64;
    let terms = batch * oh * ow;
    let groups = grid(outputs * u64::from(WORKGROUP), site.max_workgroups);
    let row = u64::from(groups[0]);
    let mut source = String::from(HELPERS);
    declare(&mut source, 0, "a0", DType::F32, false);
    declare(&mut source, 1, "a1", DType::F32, false);
    declare(&mut source, 2, "out", DType::F32, true);
    let _ = write!(
        source,
        r#"var<workgroup> partial: array<f32, {WORKGROUP}>;
@compute @workgroup_size({WORKGROUP})
fn main(@builtin(workgroup_id) wid: vec3<u32>, @builtin(local_invocation_index) lane: u32) {{
  let i = wid.x + wid.y * {row}u;
  let live = i < {outputs}u;
{split}
  var acc = 0.0;
  if (live) {{
    for (var t = lane; t < {terms}u; t = t + {WORKGROUP}u) {{
      let nb = t / {ohw}u; let y = (t % {ohw}u) / {ow}u; let xo = t % {ow}u;
      let ih = i32(y * {sh}u + c2 * {dh}u) - {ph}i;
      let iw = i32(xo * {sw}u + c3 * {dw}u) - {pw}i;
      if (ih < 0i || ih >= {h}i || iw < 0i || iw >= {wd}i) {{ continue; }}
      acc = acc + a0[((nb * {c}u + c1) * {h}u + u32(ih)) * {wd}u + u32(iw)] * a1[(nb * {o}u + c0) * {ohw}u + t % {ohw}u];
    }}
  }}
{tree}  if (live && lane == 0u) {{ out[i] = partial[0]; }}
}}
"#,
        split = coordinates(out, "i"),
        ohw = oh * ow,
        tree = workgroup_tree("acc2 + v"),
    );
    Kernel {
        label: "conv2d_backward_filter",
        source,
        workgroups: groups,
        bindings: vec![Bind::Operand(0), Bind::Operand(1), Bind::Output],
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tiles_follow_the_output_shape() {
        let shape = |m, n| {
            let t = TileShape::for_output(m, n);
            (t.rows, t.cols)
        };
        assert_eq!(shape(4096, 4096), (64, 64));
        assert_eq!(shape(18432, 6), (128, 8));
        assert_eq!(shape(2048, 16), (128, 16));
        assert_eq!(shape(10, 784), (16, 128));
        assert_eq!(shape(3, 5), (8, 8));
        for (m, n) in [(1, 1), (64, 63), (1000, 33)] {
            let t = TileShape::for_output(m, n);
            let (x, y) = t.threads();
            assert!(x * y <= WORKGROUP as usize, "{m}x{n}: {x}x{y} invocations");
            // Both stages fit the 16 KiB of workgroup memory WebGPU
            // guarantees.
            assert!((t.rows + t.cols) * DEPTH * 4 <= 16384);
        }
    }
}
