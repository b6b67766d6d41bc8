"""Trains a scikit-learn MLPClassifier on a CSV of digits (64 features, then
the label; what canopy_engine::data::write_csv writes) and exports it with
skl2onnx, for the federated fine-tuning test in tests/agents.rs.

Usage: sklearn_mlp.py TRAIN_CSV OUT_ONNX
"""

import os
import sys
import warnings

for variable in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ.setdefault(variable, "1")

import numpy as np  # noqa: E402 (after the thread settings)
from sklearn.exceptions import ConvergenceWarning  # noqa: E402
from sklearn.neural_network import MLPClassifier  # noqa: E402
from skl2onnx import to_onnx  # noqa: E402

train_csv, out = sys.argv[1], sys.argv[2]
table = np.loadtxt(train_csv, delimiter=",", dtype=np.float32)
features, labels = table[:, :-1], table[:, -1].astype(np.int64)
if sorted(set(labels.tolist())) != list(range(10)):
    sys.exit("the pretraining CSV must hold every digit 0-9")
warnings.filterwarnings("ignore", category=ConvergenceWarning)
mlp = MLPClassifier(hidden_layer_sizes=(32,), max_iter=200, random_state=0).fit(features, labels)
proto = to_onnx(
    mlp,
    features[:1],
    target_opset={"": 17, "ai.onnx.ml": 1},
    options={id(mlp): {"zipmap": False}},
)
with open(out, "wb") as f:
    f.write(proto.SerializeToString())
