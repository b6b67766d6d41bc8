"""The Python package against a real server: enrollment, two FedAvg rounds
of three clients (one resumed after its client object was dropped
mid-training), a cancelled task, an ineligible device, a secure round, and
Rust errors as Python exceptions."""

import threading
import time

import pytest

import canopy
from conftest import good_conditions, new_client, run_in_threads, shard, wait_for

PLAIN_JOB = {
    "name": "python-fedavg", "rounds": 2, "min_devices": 3, "target_devices": 3,
    "over_selection": 0.0, "round_deadline_ms": 120000, "local_epochs": 2,
    "batch_size": 16, "learning_rate": 0.05,
}


def trainable(model_bytes):
    return {p.name: p.values for p in canopy.read_model_parameters(model_bytes) if p.trainable}


def enrolled_clients(server, tmp_path, count, **overrides):
    token = server.enrollment_token(uses=count + 2)
    clients = []
    for i in range(count):
        client = new_client(server, tmp_path / f"device-{i}", **overrides)
        info = client.enroll(token, canopy.DeviceInfo(os="python-test", memory_mb=2048, tags={}))
        assert info.device_id > 0 and "cpu" in info.backends
        assert len(info.device_key) == 64 and client.status().device_key == info.device_key
        client.report_conditions(good_conditions())
        clients.append(client)
    return clients


DONE = ("completed", "failed", "cancelled")


def work_until_done(server, job_id, client, data, outcomes, on_task=None):
    """Polls and runs tasks until the job has ended."""
    while server.job(job_id)["state"] not in DONE:
        task = client.check_for_task(1000)
        if task is None:
            continue
        if on_task is not None:
            client = on_task(client, task)
        outcome = client.run_task(data, None, None)
        outcomes.append(outcome)


def assert_fedavg(server, job_id, outcomes_by_round):
    """Each training round's new version is its base plus the
    sample-weighted mean of the devices' deltas."""
    checked = 0
    for round_ in server.rounds(job_id):
        if round_["kind"] != "train" or round_["state"] != "succeeded":
            continue
        outcomes = outcomes_by_round[round_["id"]]
        base = trainable(server.download_version("digits", round_["base_version_id"]))
        result = trainable(server.download_version("digits", round_["result_version_id"]))
        total = sum(o.num_samples for o in outcomes)
        offset = 0
        for name, before in base.items():
            after = result[name]
            for j, value in enumerate(before):
                mean = sum(o.num_samples * o.delta[offset + j] for o in outcomes) / total
                assert after[j] == pytest.approx(value + mean, rel=1e-5, abs=1e-6), (name, j)
            offset += len(before)
        assert offset == len(outcomes[0].delta)
        checked += 1
    return checked


def test_three_clients_train_two_fedavg_rounds_one_resumed_after_a_drop(server, tmp_path):
    server.push_digits_model(tmp_path)
    clients = enrolled_clients(server, tmp_path, 3)
    job_id = server.create_job(tmp_path, PLAIN_JOB)
    shards = [shard(i, 3) for i in range(3)]
    outcomes = [[], [], []]
    resumed = {}

    class StopAt(canopy.ProgressListener):
        """Cancels after `step` steps: the OS ending background work."""

        def __init__(self, token, step):
            self.token, self.step, self.seen = token, step, []

        def on_progress(self, progress):
            self.seen.append(progress.steps_done)
            if progress.steps_done >= self.step:
                self.token.cancel()

    def interrupt_then_resume(client, task):
        # Only the first training round is interrupted.
        if resumed or task.kind != canopy.TaskKind.TRAIN:
            return client
        token = canopy.CancelToken()
        listener = StopAt(token, 12)
        with pytest.raises(canopy.CanopyError.Cancelled) as cancelled:
            client.run_task(shards[2], listener, token)
        # Every step is reported and the cancel reaches training before
        # its next one: the run stops at step 12 exactly, and says so.
        assert "checkpointed at step 12" in str(cancelled.value), str(cancelled.value)
        del client
        # A new client object on the same storage: the process restarted.
        again = new_client(server, tmp_path / "device-2")
        again.report_conditions(good_conditions())
        status = again.status()
        assert status.enrolled and status.pending_task.round_id == task.round_id
        assert status.pending_task.checkpointed_step == 12
        pending = again.check_for_task(0)
        assert pending.round_id == task.round_id
        resumed["round"] = task.round_id
        resumed["checkpointed"] = status.pending_task.checkpointed_step
        return again

    run_in_threads([
        lambda: work_until_done(server, job_id, clients[0], shards[0], outcomes[0]),
        lambda: work_until_done(server, job_id, clients[1], shards[1], outcomes[1]),
        lambda: work_until_done(server, job_id, clients[2], shards[2], outcomes[2], interrupt_then_resume),
    ])
    assert server.job(job_id)["state"] == "completed"

    # Evaluation tasks (each new version, on the devices' data) share
    # their round's id; the updates are the training tasks'.
    by_round = {}
    for device in outcomes:
        for outcome in device:
            if outcome.kind == canopy.TaskKind.TRAIN:
                by_round.setdefault(outcome.round_id, []).append(outcome)
    resumed_outcome = next(o for o in by_round[resumed["round"]] if o.resumed_from_step > 0)
    assert resumed_outcome.resumed_from_step == resumed["checkpointed"]
    assert len(by_round[resumed["round"]]) == 3
    assert assert_fedavg(server, job_id, by_round) == 2


def test_an_ineligible_device_withdraws_and_is_not_a_dropout(server, tmp_path):
    server.push_digits_model(tmp_path)
    clients = enrolled_clients(server, tmp_path, 3)
    spec = dict(PLAIN_JOB, name="needs-charging", rounds=1, min_devices=2,
                device_policy={"requires_charging": True, "min_battery_percent": 50})
    job_id = server.create_job(tmp_path, spec)
    # All three fit the model's input statistics in round 0 first.
    for i in range(3):
        task = wait_for(lambda i=i: clients[i].check_for_task(1000), "a statistics task")
        assert task.kind == canopy.TaskKind.STATISTICS
        clients[i].run_task(shard(i, 3), None, None)
    # The third is unplugged after the training round selected it: the
    # task comes, and the device gives it back.
    wait_for(lambda: any(r["kind"] == "train" and r["selected"] == 3 for r in server.rounds(job_id)),
             "a training round with three devices")
    unplugged = canopy.DeviceConditions(charging=False, unmetered_network=True, idle=True, battery_percent=30)
    ineligible = clients[2]
    ineligible.report_conditions(unplugged)
    wait_for(
        lambda: ineligible.check_for_task(1000) is None
        and "withdrew" in (ineligible.status().last_outcome or ""),
        "the ineligible device to withdraw",
    )
    reason = ineligible.status().last_outcome
    assert "charging" in reason and "30%" in reason, reason
    assert ineligible.status().pending_task is None
    outcomes = [[], []]
    run_in_threads([
        lambda i=i: work_until_done(server, job_id, clients[i], shard(i, 3), outcomes[i]) for i in range(2)
    ])
    train = [r for r in server.rounds(job_id) if r["kind"] == "train"]
    assert train and train[0]["state"] == "succeeded", train
    metrics = train[0]["metrics"]
    assert metrics["dropouts"] == 0 and metrics["ineligible"] == 1, metrics
    states = {p["device_id"]: p["state"] for p in server.participants(train[0]["id"])}
    assert "ineligible" in states.values(), states


def test_a_job_on_a_named_dataset_selects_only_the_devices_that_offer_it(server, tmp_path):
    server.push_digits_model(tmp_path)
    token = server.enrollment_token(uses=2)
    info = canopy.DeviceInfo(os="python-test", memory_mb=2048)
    # Offered before enrolling: `enroll` tells the server.
    holder = new_client(server, tmp_path / "holder")
    data = shard(0, 3, samples=200)
    digits = holder.register_dataset("digits", data)
    assert (digits.name, digits.samples, digits.sample_shape, digits.classes) == ("digits", 200, [64], 10)
    holder.enroll(token, info)
    holder.report_conditions(good_conditions())
    assert [d.name for d in holder.status().datasets] == ["digits"]
    other = new_client(server, tmp_path / "other")
    other.enroll(token, info)
    other.report_conditions(good_conditions())

    # Names the protocol refuses are refused here, by the rule; the count
    # and replacement are the client's.
    for bad in ["two words", "", "x" * 65]:
        with pytest.raises(canopy.CanopyError.InvalidData) as refused:
            other.register_dataset(bad, data)
        assert "must be 1 to 64 characters of [A-Za-z0-9_.-]" in str(refused.value)
        assert "hint: name it as the job does" in str(refused.value)
    assert other.register_dataset("spare", data).samples == 200
    assert other.forget_dataset("spare") is True
    assert other.forget_dataset("spare") is False
    assert other.status().datasets == []

    spec = dict(PLAIN_JOB, name="on-digits", rounds=1, min_devices=1, target_devices=1,
                dataset="digits", evaluation={"fraction": 0.0})
    job_id = server.create_job(tmp_path, spec)
    # The device that offers nothing is never selected, and says why.
    assert other.check_for_task(2000) is None
    why = other.status().last_check
    assert "no task came within 2000 ms" in why and "offers no dataset" in why, why
    assert "hint: register_dataset" in why, why
    outcomes = []
    while server.job(job_id)["state"] not in DONE:
        task = holder.check_for_task(1000)
        if task is None:
            continue
        assert task.dataset == "digits"
        assert holder.status().last_check is None  # a task came
        outcomes.append(holder.run_task(data, None, None))
    assert server.job(job_id)["state"] == "completed"
    assert outcomes and all(o.num_samples > 0 for o in outcomes)


def test_a_cancelled_task_keeps_its_progress_and_finishes_later(server, tmp_path):
    server.push_digits_model(tmp_path)
    (client,) = enrolled_clients(server, tmp_path, 1)
    spec = dict(PLAIN_JOB, name="one", rounds=1, min_devices=1, target_devices=1)
    job_id = server.create_job(tmp_path, spec)
    data = shard(0, 3)
    token = canopy.CancelToken()
    token.cancel()
    finished = []
    while server.job(job_id)["state"] not in DONE:
        task = client.check_for_task(1000)
        if task is None:
            continue
        if task.kind == canopy.TaskKind.TRAIN and not finished:
            with pytest.raises(canopy.CanopyError.Cancelled) as error:
                client.run_task(data, None, token)
            assert "was cancelled" in str(error.value)
            assert client.status().pending_task.round_id == task.round_id
            finished.append(True)
        client.run_task(data, None, None)
    assert finished


def test_rust_errors_are_python_exceptions_with_the_rust_message(server, tmp_path):
    with pytest.raises(canopy.CanopyError.Trust) as trust:
        canopy.CanopyClient(canopy.ClientConfig(
            server_url=server.url,
            trust=canopy.TrustSetting.PINNED_SHA256(fingerprint="xyz"),
            storage_dir=str(tmp_path / "bad"),
            limits=canopy.Limits(), backend=canopy.BackendPreference.CPU, checkpoint_every_steps=0,
        ))
    assert str(trust.value).startswith("fingerprint `xyz` is not 64 hex digits"), str(trust.value)
    client = new_client(server, tmp_path / "fresh")
    with pytest.raises(canopy.CanopyError.NotEnrolled) as not_enrolled:
        client.check_for_task(0)
    assert "enroll" in str(not_enrolled.value)
    with pytest.raises(canopy.CanopyError.Server) as server_error:
        client.enroll("not-a-token", canopy.DeviceInfo(os="python-test", memory_mb=1, tags={}))
    assert "the server answered 401" in str(server_error.value) or "the server answered 4" in str(server_error.value)
    with pytest.raises(canopy.CanopyError.InvalidConfig) as wait:
        client.check_for_task(10 ** 9)
    assert "over the limit" in str(wait.value)
    with pytest.raises(canopy.CanopyError.InvalidConfig) as limits:
        new_client(server, tmp_path / "l", limits=canopy.Limits(max_threads=0))
    assert "max_threads" in str(limits.value)
    with pytest.raises(canopy.CanopyError.InvalidData) as bad_model:
        canopy.read_model_parameters(b"not a model")
    assert "hint:" in str(bad_model.value)


def test_python_clients_that_pin_a_device_authority_take_part_in_a_secure_round(
    server_with_authority, authority, tmp_path
):
    """The server relays enrolled keys in a secure round; clients that pin
    the device authority take a neighbour's key only with its certificate,
    so the server cannot substitute one."""
    server = server_with_authority
    server.push_digits_model(tmp_path, fitted=True)
    with pytest.raises(canopy.CanopyError.InvalidConfig) as bad_pin:
        new_client(server, tmp_path / "bad-pin", device_authority="not hex")
    assert "device_authority is not an Ed25519 public key" in str(bad_pin.value), str(bad_pin.value)
    clients = enrolled_clients(server, tmp_path, 4, device_authority=authority.public_key)
    statuses = [client.status() for client in clients]
    certificates = [authority.certify(s.device_id, s.device_key) for s in statuses]
    with pytest.raises(canopy.CanopyError.InvalidConfig) as garbled:
        clients[0].install_certificate("zz")
    assert "is not a device certificate" in str(garbled.value), str(garbled.value)
    # Another device's certificate: refused by the client's own check,
    # with the SDK's error name and message.
    with pytest.raises(canopy.CanopyError.Certificate) as forged:
        clients[0].install_certificate(certificates[1])
    assert f"device {statuses[0].device_id}" in str(forged.value), str(forged.value)
    assert "hint: ask the device authority" in str(forged.value), str(forged.value)
    for client, certificate in zip(clients, certificates):
        client.install_certificate(certificate)
    spec = dict(PLAIN_JOB, name="secure", rounds=1, min_devices=4, target_devices=4,
                secure_aggregation={"enabled": True, "max_dropout_fraction": 0.0, "clip": 1.0, "bits": 31})
    job_id = server.create_job(tmp_path, spec)
    outcomes = [[] for _ in clients]
    run_in_threads([
        lambda i=i: work_until_done(server, job_id, clients[i], shard(i, 4), outcomes[i])
        for i in range(len(clients))
    ])
    trained = [o for device in outcomes for o in device if o.kind == canopy.TaskKind.TRAIN]
    assert len(trained) == 4 and all(o.secure for o in trained), trained
    round_ = next(r for r in server.rounds(job_id) if r["kind"] == "train")
    assert round_["state"] == "succeeded", round_
    base = trainable(server.download_version("digits", round_["base_version_id"]))
    result = trainable(server.download_version("digits", round_["result_version_id"]))
    total = sum(min(o.num_samples, 1024) for o in trained)
    offset = 0
    for name, before in base.items():
        for j, value in enumerate(before):
            clipped = [max(-1.0, min(1.0, o.delta[offset + j])) for o in trained]
            mean = sum(min(o.num_samples, 1024) * d for o, d in zip(trained, clipped)) / total
            # Quantised to 2^31 levels over [-clip, clip] per weighted update.
            assert result[name][j] == pytest.approx(value + mean, abs=1e-4), (name, j)
        offset += len(before)


def test_unenroll_revokes_the_device_and_wipes_storage(server, tmp_path):
    (client,) = enrolled_clients(server, tmp_path, 1)
    device_id = client.status().device_id
    assert server.get(f"/api/v1/devices/{device_id}")["revoked"] is False
    client.unenroll()
    assert server.get(f"/api/v1/devices/{device_id}")["revoked"] is True
    status = client.status()
    assert not status.enrolled and status.device_id is None
    assert not (tmp_path / "device-0" / "device.key").exists()
    with pytest.raises(canopy.CanopyError.NotEnrolled):
        client.check_for_task(0)
    # Enrolling again makes a new device.
    again = client.enroll(server.enrollment_token(uses=1), canopy.DeviceInfo(os="python-test", memory_mb=1, tags={}))
    assert again.device_id != device_id
