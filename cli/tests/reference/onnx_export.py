"""ONNX Runtime's side of cli/tests/onnx_export.rs: checks and runs models
that `canopy model export` wrote.

Usage: onnx_export.py inputs DATASETS_DIR OUT_DIR
    Writes real samples as the test's inputs: OUT_DIR/digits_x.npy (200
    digits rows, 64 pixels 0..16, f32) with OUT_DIR/digits_y.npy (i64
    labels), and OUT_DIR/mnist_x.npy (200 MNIST test images as
    [200, 1, 28, 28] f32 in 0..1, as canopy's IDX loader scales them) with
    OUT_DIR/mnist_y.npy.

Usage: onnx_export.py run MODEL.onnx OUT.npz NAME=X.npy...
    Checks MODEL.onnx with onnx.checker (full shape inference), requires
    default-domain opset 17 or newer, runs it on the CPU execution provider
    with the given inputs and writes every output to OUT.npz by name.
"""

import gzip
import pathlib
import sys

import numpy as np
import onnx
import onnxruntime

SAMPLES = 200


def inputs(datasets, out):
    digits = np.loadtxt(gzip.open(datasets / "digits" / "digits.csv.gz", "rt"), delimiter=",")
    np.save(out / "digits_x.npy", digits[:SAMPLES, :64].astype(np.float32))
    np.save(out / "digits_y.npy", digits[:SAMPLES, 64].astype(np.int64))
    mnist = datasets / "mnist-10k"
    images = np.frombuffer(gzip.open(mnist / "test-images-idx3-ubyte.gz").read(), np.uint8, offset=16)
    labels = np.frombuffer(gzip.open(mnist / "test-labels-idx1-ubyte.gz").read(), np.uint8, offset=8)
    images = images.reshape(-1, 1, 28, 28)[:SAMPLES].astype(np.float32) / np.float32(255.0)
    np.save(out / "mnist_x.npy", images)
    np.save(out / "mnist_y.npy", labels[:SAMPLES].astype(np.int64))


def run(model_path, out, feeds):
    model = onnx.load(model_path)
    onnx.checker.check_model(model, full_check=True)
    opset = {entry.domain: entry.version for entry in model.opset_import}.get("")
    if opset is None or opset < 17:
        sys.exit(f"{model_path}: default-domain opset {opset}, expected 17 or newer")
    session = onnxruntime.InferenceSession(str(model_path), providers=["CPUExecutionProvider"])
    arrays = {}
    for feed in feeds:
        name, path = feed.split("=", 1)
        arrays[name] = np.load(path)
    names = [output.name for output in session.get_outputs()]
    results = session.run(names, arrays)
    np.savez(out, **dict(zip(names, results)))


if sys.argv[1] == "inputs":
    inputs(pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3]))
elif sys.argv[1] == "run":
    run(pathlib.Path(sys.argv[2]), sys.argv[3], sys.argv[4:])
else:
    sys.exit(f"unknown command {sys.argv[1]}")
