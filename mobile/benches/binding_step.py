"""The Python side of binding_step.rs, which measures the same work in
Rust in the same run. Prints the seconds per training step.

argv: mode, model file, images .npy, labels .npy, learning rate, batch,
warm-up steps, timed steps.
- `step`: LocalTrainer.step_bytes per batch, the batch crossing the
  boundary on every call (the first `batch` samples, again and again).
- `fit`: LocalTrainer.fit over the files for `steps` / batches-per-file
  epochs, a Python progress listener at the default pace: the data
  crosses once, as in run_task.
"""

import struct
import sys
import time

import canopy

mode, model_path, images, labels_path, lr, batch, warmup, steps = sys.argv[1:9]
batch, warmup, steps = int(batch), int(warmup), int(steps)
trainer = canopy.LocalTrainer(open(model_path, "rb").read(), float(lr), canopy.BackendPreference.CPU, 1)


class Count(canopy.ProgressListener):
    def __init__(self):
        self.calls = 0

    def on_progress(self, progress):
        self.calls += 1


def npy_payload(path, item):
    raw = open(path, "rb").read()
    header = struct.unpack("<H", raw[8:10])[0]
    return raw[10 + header:]


if mode == "step":
    per = len(npy_payload(images, 4)) // 4 // (len(npy_payload(labels_path, 8)) // 8)
    features = npy_payload(images, 4)[: batch * per * 4]
    labels = npy_payload(labels_path, 8)[: batch * 8]
    for _ in range(warmup):
        trainer.step_bytes(features, labels)
    start = time.perf_counter()
    for _ in range(steps):
        trainer.step_bytes(features, labels)
    print((time.perf_counter() - start) / steps)
else:
    data = canopy.TrainingData.FILE(path=images, labels_path=labels_path)
    trainer.fit(data, 1, batch, 1, None, None)
    per_epoch = len(npy_payload(labels_path, 8)) // 8 // batch
    listener = Count()
    start = time.perf_counter()
    epochs = trainer.fit(data, steps // per_epoch, batch, 2, listener, None)
    elapsed = time.perf_counter() - start
    assert len(epochs) * per_epoch == steps and listener.calls >= 2, (len(epochs), listener.calls)
    print(elapsed / steps)
