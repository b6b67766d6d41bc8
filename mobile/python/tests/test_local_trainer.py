"""LocalTrainer, training on the device with no server: a step from
numpy-style bytes equals the same step from lists, `fit` learns the
digits and paces its progress reports, and bad batches are refused with
the Rust message."""

import struct

import pytest

import canopy
from conftest import load_digits, new_model

BATCH = 32


def trainer(model, learning_rate=0.1):
    return canopy.LocalTrainer(model, learning_rate, canopy.BackendPreference.CPU, 7)


def scaled_digits():
    """The digits with pixel values 0..16 scaled to 0..1, as an app would
    feed them."""
    features, labels = load_digits()
    return [[v / 16.0 for v in row] for row in features], labels


def batch(start=0, size=BATCH):
    features, labels = scaled_digits()
    rows = features[start:start + size]
    return [v for row in rows for v in row], labels[start:start + size]


def le_bytes(values, code):
    return struct.pack(f"<{len(values)}{code}", *values)


class Heard(canopy.ProgressListener):
    def __init__(self):
        self.steps = []

    def on_progress(self, progress):
        self.steps.append((progress.steps_done, progress.total_steps))


def test_a_step_from_bytes_equals_the_step_from_lists(tmp_path):
    model = new_model(tmp_path)
    from_lists, from_bytes = trainer(model), trainer(model)
    for start in (0, BATCH, 2 * BATCH):
        features, labels = batch(start)
        listed = from_lists.step(features, labels)
        packed = from_bytes.step_bytes(le_bytes(features, "f"), le_bytes(labels, "q"))
        assert packed == listed
    assert from_bytes.model() == from_lists.model()


def test_fit_learns_the_digits_and_paces_its_reports(tmp_path):
    model = new_model(tmp_path)
    features, labels = scaled_digits()
    data = canopy.TrainingData.ARRAYS(
        features=[v for row in features for v in row], sample_shape=[64], labels=labels, classes=10
    )
    every, paced = Heard(), Heard()
    epochs = trainer(model).fit(data, 3, BATCH, 1, every, None, 0)
    assert [e.epoch for e in epochs] == [1, 2, 3]
    assert epochs[-1].loss < epochs[0].loss and epochs[-1].accuracy > 0.8, epochs
    # Full batches only: 56 a pass over the 1,797 digits.
    total = 3 * (len(labels) // BATCH)
    assert every.steps == [(done, total) for done in range(total)]
    # A day between reports: the first and the last step only.
    trainer(model).fit(data, 3, BATCH, 1, paced, None, 86_400_000)
    assert paced.steps == [(0, total), (total - 1, total)]
    # The default interval (100 ms) reports far fewer than every step.
    default = Heard()
    trainer(model).fit(data, 3, BATCH, 1, default, None)
    assert 2 <= len(default.steps) < len(every.steps)


def test_bad_batches_are_refused_with_the_rust_message(tmp_path):
    local = trainer(new_model(tmp_path))
    features, labels = batch()
    with pytest.raises(canopy.CanopyError.InvalidData) as ragged:
        local.step_bytes(le_bytes(features, "f")[:-1], le_bytes(labels, "q"))
    assert "not a multiple of 4" in str(ragged.value) and "astype('<f4')" in str(ragged.value)
    with pytest.raises(canopy.CanopyError.InvalidData) as ragged_labels:
        local.step_bytes(le_bytes(features, "f"), le_bytes(labels, "q")[:-3])
    assert "label bytes" in str(ragged_labels.value)
    broken = list(features)
    broken[70] = float("nan")
    with pytest.raises(canopy.CanopyError.InvalidData) as nan:
        local.step_bytes(le_bytes(broken, "f"), le_bytes(labels, "q"))
    assert "feature value 70 is NaN" in str(nan.value)
    with pytest.raises(canopy.CanopyError.InvalidData) as short:
        local.step(features[:-64], labels)
    assert "need" in str(short.value)
    with pytest.raises(TypeError):
        local.step_bytes(list(le_bytes(features, "f")), le_bytes(labels, "q"))
