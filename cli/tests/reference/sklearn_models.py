"""Trains the scikit-learn models of cli/tests/onnx_sklearn.rs on the bundled
digits, exports them with skl2onnx and runs ONNX Runtime on 100 held-out
digits, so the test can import the files with `canopy model import` and
compare `canopy model run`'s outputs.

Usage: sklearn_models.py OUT_DIR. Writes OUT_DIR/NAME.onnx for each model,
the held-out digits as OUT_DIR/inputs.npy (float32 [100, 64], pixels / 16)
and OUT_DIR/sklearn.json: for each model its file, output names, the node
ops it contains, and ONNX Runtime's labels and probabilities ([100, 10],
row-major; ZipMap's dictionaries read back as rows in class order).
"""

import gzip
import json
import os
import pathlib
import sys
import warnings

# One BLAS thread, set before NumPy loads: the models are tiny, and on a
# busy machine BLAS threads make training take seconds, not milliseconds.
for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import numpy as np  # noqa: E402 (after the thread settings)
import onnxruntime
from sklearn.exceptions import ConvergenceWarning
from sklearn.linear_model import LogisticRegression
from sklearn.neural_network import MLPClassifier
from sklearn.pipeline import make_pipeline
from sklearn.preprocessing import StandardScaler
from skl2onnx import to_onnx

out = pathlib.Path(sys.argv[1])
digits = pathlib.Path(__file__).resolve().parents[3] / "datasets/digits/digits.csv.gz"
with gzip.open(digits) as f:
    table = np.loadtxt(f, delimiter=",", dtype=np.float32)
features, classes = table[:, :64] / 16.0, table[:, 64].astype(np.int64)
held_out = 100
train_x, train_y = features[:-held_out], classes[:-held_out]
inputs = np.ascontiguousarray(features[-held_out:])
np.save(out / "inputs.npy", inputs)

# The MLP stops before it converges: the test needs a fixed model, not a
# good one, and a few seconds at most.
warnings.filterwarnings("ignore", category=ConvergenceWarning)
logistic = LogisticRegression(max_iter=500).fit(train_x, train_y)
scaled = make_pipeline(StandardScaler(), LogisticRegression(max_iter=500)).fit(train_x, train_y)
mlp = MLPClassifier(hidden_layer_sizes=(32,), max_iter=100, random_state=0).fit(train_x, train_y)

# skl2onnx's default opsets depend on the model (9 or 22 here); canopy
# imports default-domain opsets 13 to 21.
OPSETS = {"": 21, "ai.onnx.ml": 1}
no_zipmap = lambda clf: {id(clf): {"zipmap": False}}
exports = {
    # LinearClassifier, Cast, Normalizer, ZipMap.
    "logreg": to_onnx(logistic, features[:1], target_opset=OPSETS),
    # Scaler, LinearClassifier, Normalizer.
    "logreg_scaled": to_onnx(
        scaled, features[:1], target_opset=OPSETS, options=no_zipmap(scaled.steps[-1][1])
    ),
    # MatMul, Add, Relu, Softmax, ArgMax, ArrayFeatureExtractor, Reshape, Cast.
    "mlp": to_onnx(mlp, features[:1], target_opset=OPSETS, options=no_zipmap(mlp)),
    # The same with ZipMap.
    "mlp_zipmap": to_onnx(mlp, features[:1], target_opset=OPSETS),
}

models = []
for name, proto in exports.items():
    path = out / f"{name}.onnx"
    path.write_bytes(proto.SerializeToString())
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    label_name, probability_name = (o.name for o in session.get_outputs())
    labels, probabilities = session.run(None, {"X": inputs})
    if isinstance(probabilities, list):  # ZipMap: one {class: probability} per row
        probabilities = np.array([[row[c] for c in range(10)] for row in probabilities])
    models.append(
        {
            "name": name,
            "file": path.name,
            "label_output": label_name,
            "probability_output": probability_name,
            "ops": sorted({node.op_type for node in proto.graph.node}),
            "labels": labels.tolist(),
            "probabilities": probabilities.astype(np.float32).ravel().tolist(),
        }
    )
(out / "sklearn.json").write_text(json.dumps({"classes": 10, "models": models}))
