"""Writes the ONNX files cli/tests/onnx_errors.rs feeds to
`canopy model import`, each with onnx.helper (requirements-dev.txt):

- valid.onnx: a small valid MLP (the test cuts it to make a truncated file);
- unsupported.onnx: a valid model whose node `pick` is a Hardmax (opset 17),
  an op import does not have;
- external.onnx: valid.onnx saved as ONNX saves large models, its
  initializers in external.onnx.data beside it (data_location EXTERNAL);
- huge.onnx: an initializer `huge` whose dims declare 2^29 floats (2 GiB)
  but which carries no bytes, as a hostile file would.

Usage: onnx_broken.py OUT_DIR
"""

import pathlib
import sys

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

OPSET = 17
HUGE_ELEMENTS = 1 << 29


def make_model(nodes, initializers, name):
    graph = helper.make_graph(
        nodes,
        name,
        [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])],
        initializers,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", OPSET)])
    model.ir_version = 8
    return model


def mlp():
    rng = np.random.default_rng(15)
    weights = [
        numpy_helper.from_array(rng.normal(0, 0.5, (4, 3)).astype(np.float32), "fc.w"),
        numpy_helper.from_array(rng.normal(0, 0.1, (3,)).astype(np.float32), "fc.b"),
    ]
    nodes = [
        helper.make_node("MatMul", ["x", "fc.w"], ["h"], name="fc"),
        helper.make_node("Add", ["h", "fc.b"], ["y"], name="bias"),
    ]
    model = make_model(nodes, weights, "mlp")
    onnx.checker.check_model(model, full_check=True)
    return model


def main():
    out = pathlib.Path(sys.argv[1])
    onnx.save(mlp(), out / "valid.onnx")

    hardmax = make_model([helper.make_node("Hardmax", ["x"], ["y"], name="pick")], [], "hardmax")
    hardmax.graph.output[0].CopyFrom(helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 4]))
    onnx.checker.check_model(hardmax, full_check=True)
    onnx.save(hardmax, out / "unsupported.onnx")

    onnx.save_model(
        mlp(),
        out / "external.onnx",
        save_as_external_data=True,
        location="external.onnx.data",
        size_threshold=0,
    )

    huge = TensorProto(name="huge", data_type=TensorProto.FLOAT, dims=[HUGE_ELEMENTS])
    nodes = [helper.make_node("Add", ["x", "huge"], ["y"], name="add")]
    onnx.save(make_model(nodes, [huge], "huge"), out / "huge.onnx")


if __name__ == "__main__":
    main()
