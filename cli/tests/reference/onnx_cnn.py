"""Writes the small CNN of cli/tests/onnx_import.rs with onnx.helper, and
ONNX Runtime's outputs for 100 inputs, so the test can import the file with
`canopy model import` and compare.

Usage: onnx_cnn.py OUT_DIR. Writes OUT_DIR/cnn.onnx, OUT_DIR/cnn.json
({"input_shape", "inputs", "probabilities", "labels"}), the inputs as
OUT_DIR/inputs.npy (and as float64, which `model run` refuses).
"""

import json
import pathlib
import sys

import numpy as np
import onnx
import onnxruntime
from onnx import TensorProto, helper, numpy_helper

out = pathlib.Path(sys.argv[1])
rng = np.random.default_rng(7)
# [N, 1, 10, 10] → conv 3×3 (4 channels, pad 1) → relu → max pool 2×2 →
# conv 3×3 (6 channels) → global average pool → flatten → gemm (5 classes)
# → softmax.
weights = {
    "conv1.w": rng.normal(0, 0.5, (4, 1, 3, 3)),
    "conv1.b": rng.normal(0, 0.1, (4,)),
    "conv2.w": rng.normal(0, 0.3, (6, 4, 3, 3)),
    "conv2.b": rng.normal(0, 0.1, (6,)),
    "fc.w": rng.normal(0, 0.5, (5, 6)),
    "fc.b": rng.normal(0, 0.1, (5,)),
}
initializers = [
    numpy_helper.from_array(value.astype(np.float32), name) for name, value in weights.items()
]
nodes = [
    helper.make_node("Conv", ["x", "conv1.w", "conv1.b"], ["c1"], pads=[1, 1, 1, 1], name="conv1"),
    helper.make_node("Relu", ["c1"], ["r1"], name="relu1"),
    helper.make_node("MaxPool", ["r1"], ["p1"], kernel_shape=[2, 2], strides=[2, 2], name="pool1"),
    helper.make_node("Conv", ["p1", "conv2.w", "conv2.b"], ["c2"], name="conv2"),
    helper.make_node("GlobalAveragePool", ["c2"], ["g"], name="gap"),
    helper.make_node("Flatten", ["g"], ["f"], axis=1, name="flatten"),
    helper.make_node("Gemm", ["f", "fc.w", "fc.b"], ["logits"], transB=1, name="fc"),
    helper.make_node("Softmax", ["logits"], ["probabilities"], axis=1, name="softmax"),
]
graph = helper.make_graph(
    nodes,
    "cnn",
    [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 1, 10, 10])],
    [helper.make_tensor_value_info("probabilities", TensorProto.FLOAT, ["N", 5])],
    initializers,
)
model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], producer_name="onnx_cnn.py")
model.ir_version = 8
onnx.checker.check_model(model)
onnx.save(model, out / "cnn.onnx")

inputs = rng.normal(0, 1, (100, 1, 10, 10)).astype(np.float32)
np.save(out / "inputs.npy", inputs)
np.save(out / "inputs_f64.npy", inputs.astype(np.float64))
session = onnxruntime.InferenceSession(str(out / "cnn.onnx"), providers=["CPUExecutionProvider"])
(probabilities,) = session.run(None, {"x": inputs})
json.dump(
    {
        "input_shape": list(inputs.shape),
        "inputs": inputs.ravel().tolist(),
        "probabilities": probabilities.ravel().tolist(),
        "labels": probabilities.argmax(axis=1).tolist(),
    },
    open(out / "cnn.json", "w"),
)
