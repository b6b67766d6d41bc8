"""Checks canopy's ONNX exports against ONNX Runtime, for onnx/tests/export.rs.

Usage: export_ops.py DIR. DIR/cases.json lists the cases: each names an ONNX
file in DIR, its inputs and the outputs canopy computed for them. Every file
must pass onnx.checker with full shape inference, declare opset 17 and IR
version 8, and ONNX Runtime (CPU) must give the same outputs: the same dtype
and shape, integers and booleans equal, floats within 1e-5 (absolute plus
relative), NaN where canopy has NaN. Prints "K cases match" and exits 0, or
lists every mismatch and exits 1.
"""

import json
import pathlib
import sys

import numpy as np
import onnx
import onnxruntime

TOLERANCE = 1e-5
DTYPES = {"f32": np.float32, "i64": np.int64, "i32": np.int32, "bool": np.bool_}


def array(tensor):
    return np.array(tensor["data"], dtype=DTYPES[tensor["dtype"]]).reshape(tensor["shape"])


def check(directory, case):
    path = directory / case["file"]
    model = onnx.load(path)
    onnx.checker.check_model(model, full_check=True)
    opsets = {entry.domain: entry.version for entry in model.opset_import}
    if opsets != {"": 17} or model.ir_version != 8:
        return [f"opsets {opsets}, IR version {model.ir_version}"]
    session = onnxruntime.InferenceSession(str(path), providers=["CPUExecutionProvider"])
    feeds = {tensor["name"]: array(tensor) for tensor in case["inputs"]}
    names = [tensor["name"] for tensor in case["outputs"]]
    got = session.run(names, feeds)
    problems = []
    for want_tensor, actual in zip(case["outputs"], got):
        want = array(want_tensor)
        name = want_tensor["name"]
        if actual.dtype != want.dtype or actual.shape != want.shape:
            problems.append(f"{name}: {actual.dtype} {actual.shape}, canopy {want.dtype} {want.shape}")
        elif want.dtype == np.float32:
            same_nan = np.isnan(actual) == np.isnan(want)
            close = np.isclose(actual, want, rtol=TOLERANCE, atol=TOLERANCE, equal_nan=True)
            if not (same_nan.all() and close.all()):
                worst = np.nanmax(np.abs(actual - want))
                problems.append(f"{name}: max difference {worst}\n  ort    {actual.ravel()}\n  canopy {want.ravel()}")
        elif not np.array_equal(actual, want):
            problems.append(f"{name}:\n  ort    {actual.ravel()}\n  canopy {want.ravel()}")
    return problems


def main():
    directory = pathlib.Path(sys.argv[1])
    cases = json.loads((directory / "cases.json").read_text())
    failures = 0
    for case in cases:
        problems = check(directory, case)
        for problem in problems:
            print(f"{case['name']}: {problem}")
        failures += bool(problems)
    if failures:
        print(f"{failures} of {len(cases)} cases differ")
        sys.exit(1)
    print(f"{len(cases)} cases match")


main()
