"""Writes small valid ONNX models, built with onnx.helper and checked with
onnx.checker, as the seed corpus of the `import_onnx` fuzz target. Between
them they use every op `canopy_onnx::SUPPORTED_OPS` lists, both tensor
payload forms (raw_data and the typed fields) and the symbolic batch
dimension, so mutations start inside the importer rather than at the
protobuf decoder.

Usage: python3 onnx_seeds.py OUT_DIR   (requirements-dev.txt has onnx)
"""

import pathlib
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
rng = np.random.default_rng(15)


def floats(name, shape):
    """An f32 initializer in raw_data, as exporters write them."""
    return numpy_helper.from_array(rng.normal(0, 0.5, shape).astype(np.float32), name)


def ints(name, values):
    """An int64 initializer in the typed int64_data field."""
    return helper.make_tensor(name, TensorProto.INT64, [len(values)], values)


def save(out, name, nodes, inputs, outputs, initializers=(), opset=OPSET):
    graph = helper.make_graph(nodes, name, inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    onnx.checker.check_model(model, full_check=True)
    onnx.save(model, out / f"{name}.onnx")


def value(name, shape, elem_type=TensorProto.FLOAT):
    return helper.make_tensor_value_info(name, elem_type, shape)


def cnn(out):
    nodes = [
        helper.make_node("Conv", ["x", "c.w", "c.b"], ["c"], pads=[1, 1, 1, 1], name="conv"),
        helper.make_node("Relu", ["c"], ["r"], name="relu"),
        helper.make_node("MaxPool", ["r"], ["p"], kernel_shape=[2, 2], strides=[2, 2], name="max"),
        helper.make_node("AveragePool", ["p"], ["a"], kernel_shape=[2, 2], name="avg"),
        helper.make_node("GlobalAveragePool", ["a"], ["g"], name="gap"),
        helper.make_node("Flatten", ["g"], ["f"], axis=1, name="flatten"),
        helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["l"], transB=1, alpha=0.5, name="fc"),
        helper.make_node("Softmax", ["l"], ["y"], axis=1, name="softmax"),
    ]
    weights = [floats("c.w", (2, 1, 3, 3)), floats("c.b", (2,)), floats("fc.w", (3, 2)), floats("fc.b", (3,))]
    save(out, "cnn", nodes, [value("x", ["N", 1, 6, 6])], [value("y", ["N", 3])], weights)


def mlp(out):
    nodes = [
        helper.make_node("MatMul", ["x", "w1"], ["h"], name="mm1"),
        helper.make_node("Add", ["h", "b1"], ["hb"], name="add1"),
        helper.make_node("Tanh", ["hb"], ["t"], name="tanh"),
        helper.make_node("MatMul", ["t", "w2"], ["o"], name="mm2"),
        helper.make_node("Sigmoid", ["o"], ["s"], name="sigmoid"),
        helper.make_node("Erf", ["s"], ["e"], name="erf"),
        helper.make_node("LogSoftmax", ["e"], ["y"], axis=-1, name="logsoftmax"),
    ]
    weights = [floats("w1", (4, 3)), floats("b1", (3,)), floats("w2", (3, 2))]
    save(out, "mlp", nodes, [value("x", ["N", 4])], [value("y", ["N", 2])], weights)


def shapes(out):
    """Shape ops reading their shapes and axes from constants."""
    nodes = [
        helper.make_node("Reshape", ["x", "shape"], ["r"], name="reshape"),
        helper.make_node("Transpose", ["r"], ["t"], perm=[0, 2, 1], name="transpose"),
        helper.make_node("Unsqueeze", ["t", "axes"], ["u"], name="unsqueeze"),
        helper.make_node("Squeeze", ["u", "axes"], ["s"], name="squeeze"),
        helper.make_node("Constant", [], ["k"], value=numpy_helper.from_array(np.full((1, 3, 2), 2.0, np.float32)), name="const"),
        helper.make_node("Concat", ["s", "k"], ["c"], axis=0, name="concat"),
        helper.make_node("Mul", ["c", "c"], ["m"], name="mul"),
        helper.make_node("Sub", ["m", "c"], ["d"], name="sub"),
        helper.make_node("Div", ["d", "k"], ["q"], name="div"),
        helper.make_node("Identity", ["q"], ["i"], name="identity"),
        helper.make_node("Dropout", ["i"], ["y"], name="dropout"),
    ]
    save(
        out,
        "shapes",
        nodes,
        [value("x", [2, 6])],
        [value("y", [3, 3, 2])],
        [ints("shape", [2, 2, 3]), ints("axes", [1])],
    )


def casts(out):
    """Integer and boolean values, Cast, and scalar Constants."""
    nodes = [
        helper.make_node("Constant", [], ["one"], value_int=1, name="one"),
        helper.make_node("Add", ["x", "one"], ["a"], name="add"),
        helper.make_node("Cast", ["a"], ["f"], to=TensorProto.FLOAT, name="to_float"),
        helper.make_node("Constant", [], ["half"], value_float=0.5, name="half"),
        helper.make_node("Mul", ["f", "half"], ["y"], name="scale"),
        helper.make_node("Cast", ["y"], ["b"], to=TensorProto.BOOL, name="to_bool"),
    ]
    save(
        out,
        "casts",
        nodes,
        [value("x", ["N", 3], TensorProto.INT64)],
        [value("y", ["N", 3]), value("b", ["N", 3], TensorProto.BOOL)],
        opset=13,
    )


def elementwise(out):
    """Comparisons, selection, reductions, gathers, slices and padding."""
    nodes = [
        helper.make_node("Abs", ["x"], ["abs"], name="abs"),
        helper.make_node("Greater", ["x", "abs"], ["gt"], name="greater"),
        helper.make_node("LessOrEqual", ["x", "abs"], ["le"], name="less_or_equal"),
        helper.make_node("Or", ["gt", "le"], ["either"], name="or"),
        helper.make_node("Not", ["either"], ["neither"], name="not"),
        helper.make_node("Where", ["neither", "x", "abs"], ["w"], name="where"),
        helper.make_node("Exp", ["w"], ["e"], name="exp"),
        helper.make_node("Log", ["e"], ["l"], name="log"),
        helper.make_node("Pow", ["l", "two"], ["p"], name="pow"),
        helper.make_node("Sqrt", ["p"], ["s"], name="sqrt"),
        helper.make_node("Softplus", ["s"], ["sp"], name="softplus"),
        helper.make_node("Max", ["sp", "x"], ["mx"], name="max"),
        helper.make_node("Gather", ["mx", "rows"], ["g"], axis=1, name="gather"),
        helper.make_node("Slice", ["g", "starts", "ends", "axes"], ["sl"], name="slice"),
        helper.make_node("Pad", ["sl", "pads"], ["pd"], mode="constant", name="pad"),
        helper.make_node("ReduceSum", ["pd", "axes"], ["rs"], keepdims=1, name="reduce_sum"),
        helper.make_node("Expand", ["rs", "shape"], ["ex"], name="expand"),
        helper.make_node("ArgMax", ["ex"], ["y"], axis=1, keepdims=0, name="argmax"),
    ]
    constants = [
        numpy_helper.from_array(np.array(2.0, np.float32), "two"),
        ints("rows", [0, 2]),
        ints("starts", [0]),
        ints("ends", [1]),
        ints("axes", [1]),
        ints("pads", [0, 1, 0, 1]),
        ints("shape", [1, 3]),
    ]
    save(out, "elementwise", nodes, [value("x", ["N", 3])], [value("y", ["N"], TensorProto.INT64)], constants, opset=18)


def main():
    out = pathlib.Path(sys.argv[1])
    out.mkdir(parents=True, exist_ok=True)
    for write in (cnn, mlp, shapes, casts, elementwise):
        write(out)


if __name__ == "__main__":
    main()
