//! Ops ↔ node records: the op name (`Op::name`) plus exactly the attributes
//! that op has. An op's attribute list is fixed here, and the reader rejects
//! missing and extra attributes alike, so every op has one encoding.

use crate::control::{Cond, Scan, WhileLoop};
use crate::data::{Buffer, TensorData};
use crate::error::IrResult;
use crate::graph::Graph;
use crate::op::{BinaryOp, Conv2dAttrs, CustomGrad, Op, Pool2dAttrs, ReduceKind, UnaryOp};
use crate::types::{DType, Dim};

use super::error::FormatError;
use super::read::Decoder;
use super::schema::{DimRec, GraphRec, NodeRec};
use super::write::{DataWriter, check_tensor, dim_value, encode_graph};
use super::{INLINE_MAX_ELEMENTS, hex};

const CONV: &[&str] = &["stride", "padding", "dilation"];
const POOL: &[&str] = &["kernel", "stride", "padding"];

/// The attributes of the op named `op`; `None` for an unknown op.
fn attrs_of(op: &str) -> Option<&'static [&'static str]> {
    Some(match op {
        "input" => &["name"],
        "constant" => &["value", "data"],
        "where" => &[],
        "cast" => &["to"],
        "matmul" => &["transpose_a", "transpose_b"],
        "reshape" | "broadcast" | "random_uniform" => &["shape"],
        "transpose" => &["perm"],
        "slice" => &["axis", "start", "end"],
        "pad" => &["axis", "before", "after"],
        "concat" | "softmax" | "log_softmax" | "gather" => &["axis"],
        "conv2d" => CONV,
        "conv2d_backward_input" => &["stride", "padding", "dilation", "input_hw"],
        "conv2d_backward_filter" => &["stride", "padding", "dilation", "kernel_hw"],
        "max_pool2d" | "max_pool2d_select" | "max_pool2d_backward" | "avg_pool2d" => POOL,
        "avg_pool2d_backward" => &["kernel", "stride", "padding", "input_hw"],
        "scatter_add" => &["axis", "dim_size"],
        "one_hot" => &["depth"],
        "argmax" => &["axis", "keep_dims"],
        "custom_grad" => &["name", "forward", "backward"],
        "scan" => &[
            "carries",
            "scanned",
            "length",
            "reverse",
            "checkpoint",
            "body",
        ],
        "cond" => &["then_branch", "else_branch"],
        "while_loop" => &["carries", "max_trips", "cond", "body"],
        "output" => &["index"],
        _ if find_unary(op).is_some() || find_binary(op).is_some() => &[],
        _ if find_reduce(op).is_some() => &["axes", "keep_dims"],
        _ => return None,
    })
}

fn find_unary(name: &str) -> Option<UnaryOp> {
    UnaryOp::ALL
        .into_iter()
        .find(|&u| Op::Unary(u).name() == name)
}

fn find_binary(name: &str) -> Option<BinaryOp> {
    BinaryOp::ALL
        .into_iter()
        .find(|&b| Op::Binary(b).name() == name)
}

fn find_reduce(name: &str) -> Option<ReduceKind> {
    let named = |kind| {
        let op = Op::Reduce {
            kind,
            axes: Vec::new(),
            keep_dims: false,
        };
        op.name() == name
    };
    ReduceKind::ALL.into_iter().find(|&k| named(k))
}

// ---- encoding ----------------------------------------------------------

/// The record of `op` with its attributes set; the caller fills in inputs
/// and type.
pub(crate) fn encode_op(op: &Op, data: &mut DataWriter) -> IrResult<NodeRec> {
    let mut r = NodeRec {
        op: op.name().to_string(),
        ..NodeRec::default()
    };
    match op {
        Op::Input { name } => r.name = Some(name.clone()),
        Op::Constant(t) => encode_constant(t, data, &mut r)?,
        Op::Unary(_) | Op::Binary(_) | Op::Where => {}
        Op::Cast { to } => r.to = Some(to.name().to_string()),
        Op::MatMul {
            transpose_a,
            transpose_b,
        } => {
            r.transpose_a = Some(*transpose_a);
            r.transpose_b = Some(*transpose_b);
        }
        Op::Reduce {
            axes, keep_dims, ..
        } => {
            r.axes = Some(values(axes)?);
            r.keep_dims = Some(*keep_dims);
        }
        Op::Reshape { shape } | Op::Broadcast { shape } | Op::RandomUniform { shape } => {
            r.shape = Some(dims(shape)?)
        }
        Op::Transpose { perm } => r.perm = Some(values(perm)?),
        Op::Slice { axis, start, end } => {
            r.axis = Some(dim_value(*axis)?);
            r.start = Some(dim_value(*start)?);
            r.end = Some(dim_value(*end)?);
        }
        Op::Pad {
            axis,
            before,
            after,
        } => {
            r.axis = Some(dim_value(*axis)?);
            r.before = Some(dim_value(*before)?);
            r.after = Some(dim_value(*after)?);
        }
        Op::Concat { axis }
        | Op::Softmax { axis }
        | Op::LogSoftmax { axis }
        | Op::Gather { axis } => r.axis = Some(dim_value(*axis)?),
        Op::ScatterAdd { axis, dim_size } => {
            r.axis = Some(dim_value(*axis)?);
            r.dim_size = Some(dim_value(*dim_size)?);
        }
        Op::OneHot { depth } => r.depth = Some(dim_value(*depth)?),
        Op::ArgMax { axis, keep_dims } => {
            r.axis = Some(dim_value(*axis)?);
            r.keep_dims = Some(*keep_dims);
        }
        Op::CustomGrad(c) => {
            r.name = Some(c.name.clone());
            r.forward = Some(Box::new(encode_graph(&c.forward, data)?));
            r.backward = Some(Box::new(encode_graph(&c.backward, data)?));
        }
        Op::Scan(scan) => {
            r.carries = Some(dim_value(scan.carries)?);
            r.scanned = Some(dim_value(scan.scanned)?);
            r.length = Some(dim(&scan.length)?);
            r.reverse = Some(scan.reverse);
            r.checkpoint = Some(dim_value(scan.checkpoint)?);
            r.body = Some(Box::new(encode_graph(&scan.body, data)?));
        }
        Op::Cond(cond) => {
            r.then_branch = Some(Box::new(encode_graph(&cond.then_branch, data)?));
            r.else_branch = Some(Box::new(encode_graph(&cond.else_branch, data)?));
        }
        Op::WhileLoop(w) => {
            r.carries = Some(dim_value(w.carries)?);
            r.max_trips = Some(dim_value(w.max_trips)?);
            r.cond = Some(Box::new(encode_graph(&w.cond, data)?));
            r.body = Some(Box::new(encode_graph(&w.body, data)?));
        }
        Op::Output { index } => r.index = Some(dim_value(*index)?),
        _ => encode_window_op(op, &mut r)?,
    }
    Ok(r)
}

/// Convolution and pooling ops, which share their geometry attributes.
fn encode_window_op(op: &Op, r: &mut NodeRec) -> IrResult<()> {
    match op {
        Op::Conv2d(a) => set_conv(a, r),
        Op::Conv2dBackwardInput { attrs, input_hw } => {
            r.input_hw = Some(pair(input_hw)?);
            set_conv(attrs, r)
        }
        Op::Conv2dBackwardFilter { attrs, kernel_hw } => {
            r.kernel_hw = Some(pair(kernel_hw)?);
            set_conv(attrs, r)
        }
        Op::MaxPool2d(a) | Op::MaxPool2dSelect(a) | Op::MaxPool2dBackward(a) | Op::AvgPool2d(a) => {
            set_pool(a, r)
        }
        Op::AvgPool2dBackward { attrs, input_hw } => {
            r.input_hw = Some(pair(input_hw)?);
            set_pool(attrs, r)
        }
        _ => unreachable!("encode_op handles every other op"),
    }
}

fn set_conv(a: &Conv2dAttrs, r: &mut NodeRec) -> IrResult<()> {
    r.stride = Some(pair(&a.stride)?);
    r.padding = Some(pair(&a.padding)?);
    r.dilation = Some(pair(&a.dilation)?);
    Ok(())
}

fn set_pool(a: &Pool2dAttrs, r: &mut NodeRec) -> IrResult<()> {
    r.kernel = Some(pair(&a.kernel)?);
    r.stride = Some(pair(&a.stride)?);
    r.padding = Some(pair(&a.padding)?);
    Ok(())
}

fn encode_constant(t: &TensorData, data: &mut DataWriter, r: &mut NodeRec) -> IrResult<()> {
    check_tensor(t)?;
    let bytes = t.buffer.to_le_bytes();
    if t.num_elements() <= INLINE_MAX_ELEMENTS {
        r.value = Some(hex::encode(&bytes));
    } else {
        r.data = Some(data.push(&bytes));
    }
    Ok(())
}

fn values(v: &[usize]) -> IrResult<Vec<u64>> {
    v.iter().map(|&x| dim_value(x)).collect()
}

fn pair(v: &[usize; 2]) -> IrResult<[u64; 2]> {
    Ok([dim_value(v[0])?, dim_value(v[1])?])
}

fn dims(shape: &[Dim]) -> IrResult<Vec<DimRec>> {
    shape.iter().map(dim).collect()
}

fn dim(d: &Dim) -> IrResult<DimRec> {
    match d {
        Dim::Fixed(n) => dim_value(*n).map(DimRec::Fixed),
        Dim::Batch => Ok(DimRec::Batch),
    }
}

// ---- decoding ----------------------------------------------------------

/// Decodes the op of one node record at `loc` (e.g. "entry point `infer`,
/// node 3"), in a graph nested `depth` levels inside its entry point.
pub(crate) fn decode_op(
    r: &NodeRec,
    dec: &mut Decoder<'_>,
    loc: &str,
    depth: usize,
) -> Result<Op, FormatError> {
    let Some(allowed) = attrs_of(&r.op) else {
        return Err(FormatError::UnknownOp {
            op: truncate(&r.op),
            location: loc.to_string(),
        });
    };
    if let Some(extra) = r.present_attrs().find(|a| !allowed.contains(a)) {
        return Err(FormatError::invalid(
            loc,
            format!("op `{}` has no attribute `{extra}`", r.op),
        ));
    }
    let a = Attrs { r, dec, loc };
    a.op(depth)
}

/// Op names from a file appear in messages; a hostile one could be huge.
fn truncate(s: &str) -> String {
    match s.char_indices().nth(64) {
        Some((at, _)) => format!("{}…", &s[..at]),
        None => s.to_string(),
    }
}

/// Attribute access for one record, turning absence and out-of-limit values
/// into errors that name the node and the attribute.
struct Attrs<'r, 'd, 'b> {
    r: &'r NodeRec,
    dec: &'d mut Decoder<'b>,
    loc: &'r str,
}

impl Attrs<'_, '_, '_> {
    fn op(mut self, depth: usize) -> Result<Op, FormatError> {
        let r = self.r;
        Ok(match r.op.as_str() {
            "input" => Op::Input {
                name: self.string(&r.name, "name")?,
            },
            "constant" => Op::Constant(Box::new(self.constant()?)),
            "where" => Op::Where,
            "cast" => Op::Cast {
                to: self.dtype(&r.to)?,
            },
            "matmul" => Op::MatMul {
                transpose_a: self.need(&r.transpose_a, "transpose_a")?,
                transpose_b: self.need(&r.transpose_b, "transpose_b")?,
            },
            "reshape" => Op::Reshape {
                shape: self.dims()?,
            },
            "broadcast" => Op::Broadcast {
                shape: self.dims()?,
            },
            "random_uniform" => Op::RandomUniform {
                shape: self.dims()?,
            },
            "transpose" => Op::Transpose {
                perm: self.list(&r.perm, "perm")?,
            },
            "slice" => Op::Slice {
                axis: self.int(r.axis, "axis")?,
                start: self.int(r.start, "start")?,
                end: self.int(r.end, "end")?,
            },
            "pad" => Op::Pad {
                axis: self.int(r.axis, "axis")?,
                before: self.int(r.before, "before")?,
                after: self.int(r.after, "after")?,
            },
            "scatter_add" => Op::ScatterAdd {
                axis: self.int(r.axis, "axis")?,
                dim_size: self.int(r.dim_size, "dim_size")?,
            },
            "one_hot" => Op::OneHot {
                depth: self.int(r.depth, "depth")?,
            },
            "argmax" => Op::ArgMax {
                axis: self.int(r.axis, "axis")?,
                keep_dims: self.need(&r.keep_dims, "keep_dims")?,
            },
            "custom_grad" => self.custom_grad(depth)?,
            "scan" => self.scan(depth)?,
            "cond" => self.cond(depth)?,
            "while_loop" => self.while_loop(depth)?,
            "output" => Op::Output {
                index: self.int(r.index, "index")?,
            },
            name => self.axis_or_window_op(name)?,
        })
    }

    fn axis_or_window_op(&self, name: &str) -> Result<Op, FormatError> {
        let axis = || self.int(self.r.axis, "axis");
        Ok(match name {
            "concat" => Op::Concat { axis: axis()? },
            "softmax" => Op::Softmax { axis: axis()? },
            "log_softmax" => Op::LogSoftmax { axis: axis()? },
            "gather" => Op::Gather { axis: axis()? },
            "conv2d" => Op::Conv2d(self.conv()?),
            "conv2d_backward_input" => Op::Conv2dBackwardInput {
                attrs: self.conv()?,
                input_hw: self.pair(self.r.input_hw, "input_hw")?,
            },
            "conv2d_backward_filter" => Op::Conv2dBackwardFilter {
                attrs: self.conv()?,
                kernel_hw: self.pair(self.r.kernel_hw, "kernel_hw")?,
            },
            "max_pool2d" => Op::MaxPool2d(self.pool()?),
            "max_pool2d_select" => Op::MaxPool2dSelect(self.pool()?),
            "max_pool2d_backward" => Op::MaxPool2dBackward(self.pool()?),
            "avg_pool2d" => Op::AvgPool2d(self.pool()?),
            "avg_pool2d_backward" => Op::AvgPool2dBackward {
                attrs: self.pool()?,
                input_hw: self.pair(self.r.input_hw, "input_hw")?,
            },
            _ => self.elementwise_or_reduce(name)?,
        })
    }

    fn elementwise_or_reduce(&self, name: &str) -> Result<Op, FormatError> {
        if let Some(u) = find_unary(name) {
            return Ok(Op::Unary(u));
        }
        if let Some(b) = find_binary(name) {
            return Ok(Op::Binary(b));
        }
        let kind = find_reduce(name).expect("attrs_of accepted only known op names");
        Ok(Op::Reduce {
            kind,
            axes: self.list(&self.r.axes, "axes")?,
            keep_dims: self.need(&self.r.keep_dims, "keep_dims")?,
        })
    }

    fn err(&self, cause: impl Into<String>) -> FormatError {
        FormatError::invalid(self.loc, cause)
    }

    fn need<T: Clone>(&self, v: &Option<T>, name: &str) -> Result<T, FormatError> {
        v.clone()
            .ok_or_else(|| self.err(format!("op `{}` lacks attribute `{name}`", self.r.op)))
    }

    fn string(&self, v: &Option<String>, name: &str) -> Result<String, FormatError> {
        let s = self.need(v, name)?;
        self.dec.check_string(&s, self.loc)?;
        Ok(s)
    }

    fn int(&self, v: Option<u64>, name: &str) -> Result<usize, FormatError> {
        let v = self.need(&v, name)?;
        let limit = self.dec.limits.max_dim;
        if v > limit {
            return Err(self.err(format!(
                "attribute `{name}` = {v} exceeds the limit of {limit}"
            )));
        }
        Ok(v as usize)
    }

    fn pair(&self, v: Option<[u64; 2]>, name: &str) -> Result<[usize; 2], FormatError> {
        let [a, b] = self.need(&v, name)?;
        Ok([self.int(Some(a), name)?, self.int(Some(b), name)?])
    }

    fn list(&self, v: &Option<Vec<u64>>, name: &str) -> Result<Vec<usize>, FormatError> {
        let v = self.need(v, name)?;
        let max = self.dec.limits.max_rank;
        if v.len() > max {
            return Err(self.err(format!(
                "attribute `{name}` has {} entries, more than rank {max}",
                v.len()
            )));
        }
        v.iter().map(|&x| self.int(Some(x), name)).collect()
    }

    /// A dimension attribute, bounded like a shape's dimensions.
    fn dim(&self, v: Option<DimRec>, name: &str) -> Result<Dim, FormatError> {
        match self.need(&v, name)? {
            DimRec::Fixed(n) => self.int(Some(n), name).map(Dim::Fixed),
            DimRec::Batch => Ok(Dim::Batch),
        }
    }

    fn dims(&self) -> Result<Vec<Dim>, FormatError> {
        let shape = self.need(&self.r.shape, "shape")?;
        self.dec.dims(&shape, self.loc)
    }

    fn dtype(&self, v: &Option<String>) -> Result<DType, FormatError> {
        let name = self.need(v, "to")?;
        self.dec.dtype(&name, self.loc)
    }

    fn conv(&self) -> Result<Conv2dAttrs, FormatError> {
        Ok(Conv2dAttrs {
            stride: self.pair(self.r.stride, "stride")?,
            padding: self.pair(self.r.padding, "padding")?,
            dilation: self.pair(self.r.dilation, "dilation")?,
        })
    }

    fn pool(&self) -> Result<Pool2dAttrs, FormatError> {
        Ok(Pool2dAttrs {
            kernel: self.pair(self.r.kernel, "kernel")?,
            stride: self.pair(self.r.stride, "stride")?,
            padding: self.pair(self.r.padding, "padding")?,
        })
    }

    /// A constant's dtype and shape come from the node's type; its bytes
    /// are inline when small and in the data section when large.
    fn constant(&mut self) -> Result<TensorData, FormatError> {
        let ty = self.dec.tensor_type(&self.r.ty, self.loc)?;
        let Some(shape) = ty.shape.as_fixed() else {
            return Err(self.err(format!("constant type {ty} has a batch dimension")));
        };
        // tensor_type capped the element count, so this product fits.
        let elements: usize = shape.iter().product();
        let want = elements * ty.dtype.size_bytes();
        let bytes = match (&self.r.value, self.r.data) {
            (Some(hex), None) => self.inline_bytes(hex, elements, want)?,
            (None, Some(range)) => {
                if elements <= INLINE_MAX_ELEMENTS {
                    return Err(self.err(format!(
                        "constant of {elements} elements must be inline (`value`), not in the data section"
                    )));
                }
                self.dec.take_data(range, want as u64, self.loc)?.to_vec()
            }
            (Some(_), Some(_)) => return Err(self.err("constant has both `value` and `data`")),
            (None, None) => return Err(self.err("constant lacks attribute `value` or `data`")),
        };
        let buffer = Buffer::from_le_bytes(ty.dtype, &bytes)
            .ok_or_else(|| self.err("bool constant holds a byte other than 0 or 1"))?;
        TensorData::new(shape, buffer).ok_or_else(|| self.err("constant size mismatch"))
    }

    fn inline_bytes(
        &self,
        hex: &str,
        elements: usize,
        want: usize,
    ) -> Result<Vec<u8>, FormatError> {
        if elements > INLINE_MAX_ELEMENTS {
            return Err(self.err(format!(
                "constant of {elements} elements must live in the data section, not inline (at most {INLINE_MAX_ELEMENTS})"
            )));
        }
        let bytes =
            hex::decode(hex).ok_or_else(|| self.err("inline `value` is not lowercase hex"))?;
        if bytes.len() != want {
            return Err(self.err(format!(
                "inline `value` holds {} bytes, but type {} needs {want}",
                bytes.len(),
                self.r.ty.dtype
            )));
        }
        Ok(bytes)
    }

    fn custom_grad(&mut self, depth: usize) -> Result<Op, FormatError> {
        let name = self.string(&self.r.name, "name")?;
        let r = self.r;
        let what = format!("custom gradient `{name}`");
        let [forward, backward] = self.graphs(
            depth,
            &what,
            [(&r.forward, "forward"), (&r.backward, "backward")],
        )?;
        Ok(Op::CustomGrad(Box::new(CustomGrad {
            name,
            forward,
            backward,
        })))
    }

    fn scan(&mut self, depth: usize) -> Result<Op, FormatError> {
        let r = self.r;
        let carries = self.int(r.carries, "carries")?;
        let scanned = self.int(r.scanned, "scanned")?;
        // A dim, so that a scan over the symbolic batch is representable
        // and a fixed length is bounded by `max_dim` like any dimension.
        let length = self.dim(r.length, "length")?;
        let reverse = self.need(&r.reverse, "reverse")?;
        let checkpoint = self.int(r.checkpoint, "checkpoint")?;
        let [body] = self.graphs(depth, "scan", [(&r.body, "body")])?;
        Ok(Op::Scan(Box::new(Scan {
            body,
            carries,
            scanned,
            length,
            reverse,
            checkpoint,
        })))
    }

    fn cond(&mut self, depth: usize) -> Result<Op, FormatError> {
        let r = self.r;
        let [then_branch, else_branch] = self.graphs(
            depth,
            "cond",
            [
                (&r.then_branch, "then_branch"),
                (&r.else_branch, "else_branch"),
            ],
        )?;
        Ok(Op::Cond(Box::new(Cond {
            then_branch,
            else_branch,
        })))
    }

    fn while_loop(&mut self, depth: usize) -> Result<Op, FormatError> {
        let r = self.r;
        let carries = self.int(r.carries, "carries")?;
        let trips = self.need(&r.max_trips, "max_trips")?;
        let limit = self.dec.limits.max_while_trips as u64;
        if trips > limit {
            return Err(FormatError::limit(
                format!("{}: attribute `max_trips`", self.loc),
                trips,
                limit,
            ));
        }
        let max_trips = self.int(Some(trips), "max_trips")?;
        let [cond, body] =
            self.graphs(depth, "while_loop", [(&r.cond, "cond"), (&r.body, "body")])?;
        Ok(Op::WhileLoop(Box::new(WhileLoop {
            cond,
            body,
            carries,
            max_trips,
        })))
    }

    /// Decodes the graphs nested in this node, one level below `depth`,
    /// each named `{what} {attribute}` in errors. `parts` is in attribute
    /// order, which is also the order of the graphs' tensors in the data
    /// section.
    fn graphs<const N: usize>(
        &mut self,
        depth: usize,
        what: &str,
        parts: [(&Option<Box<GraphRec>>, &str); N],
    ) -> Result<[Graph; N], FormatError> {
        let mut recs = Vec::with_capacity(N);
        for (rec, name) in parts {
            let rec = rec
                .as_deref()
                .ok_or_else(|| self.err(format!("op `{}` lacks attribute `{name}`", self.r.op)))?;
            recs.push((rec, name));
        }
        let limit = self.dec.limits.max_nesting;
        if depth + 1 > limit {
            return Err(FormatError::limit(
                format!("{}: nested graph depth", self.loc),
                (depth + 1) as u64,
                limit as u64,
            ));
        }
        let mut graphs = Vec::with_capacity(N);
        for (rec, name) in recs {
            let loc = format!("{}, {what} {name}", self.loc);
            graphs.push(self.dec.graph(rec, &loc, depth + 1)?);
        }
        Ok(graphs
            .try_into()
            .unwrap_or_else(|_| unreachable!("one graph per part")))
    }
}
