"""Times LocalTrainer.step_bytes through the Python binding; run by
binding_step.rs, which measures the same steps in Rust in the same run.

argv: model file, features file (f32 little-endian), labels file (i64
little-endian), learning rate, warm-up steps, timed steps. Prints the
seconds per step."""

import struct
import sys
import time

import canopy

model_path, features_path, labels_path, lr, warmup, steps = sys.argv[1:7]
features = open(features_path, "rb").read()
raw = open(labels_path, "rb").read()
labels = list(struct.unpack(f"<{len(raw) // 8}q", raw))
trainer = canopy.LocalTrainer(open(model_path, "rb").read(), float(lr), canopy.BackendPreference.CPU, 1)
for _ in range(int(warmup)):
    trainer.step_bytes(features, labels)
start = time.perf_counter()
for _ in range(int(steps)):
    trainer.step_bytes(features, labels)
print((time.perf_counter() - start) / int(steps))
