"""Fixtures for the Python package's tests: a real `canopy-server` over
HTTPS on loopback, driven as an ML engineer would (the `canopy` CLI, the
admin REST API), and real `canopy.CanopyClient` devices.

Run by `mobile/tests/python.rs` (part of `cargo test --workspace`), which
builds the package from the cdylib cargo just built and sets:

- `CANOPY_BIN_DIR`: the directory with `canopy-server` and `canopy`;
- `CANOPY_DIGITS`: the bundled UCI digits, `datasets/digits/digits.csv.gz`.

To run it by hand after `pip install ./mobile` and `cargo build --release`:
`CANOPY_BIN_DIR=target/release CANOPY_DIGITS=datasets/digits/digits.csv.gz
python3 -m pytest mobile/python/tests`.
"""

import gzip
import hashlib
import http.client
import json
import os
import socket
import ssl
import subprocess
import threading
import time
from pathlib import Path

import pytest

STARTUP_TIMEOUT_S = 60
JOB_TIMEOUT_S = 180


def _required_env(name, hint):
    value = os.environ.get(name)
    if not value:
        pytest.exit(f"error: {name} is not set\nhint: {hint}", returncode=2)
    return value


def bin_dir():
    return Path(_required_env("CANOPY_BIN_DIR", "point it at target/release after `cargo build --release`"))


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    """One `canopy-server serve` process on SQLite, self-signed TLS; with
    `device_authority`, one that takes devices' certificates from that
    authority (its public key) and selects only certified devices for
    secure jobs."""

    def __init__(self, root: Path, device_authority=None):
        self.data_dir = root / "server"
        self.data_dir.mkdir(mode=0o700)
        self.config_dir = root / "cli-config"
        self.port = _free_port()
        self.log = open(root / "server.log", "wb")
        self.process = subprocess.Popen(
            [
                str(bin_dir() / "canopy-server"), "serve",
                "--data-dir", str(self.data_dir),
                "--listen", f"127.0.0.1:{self.port}",
                "--tls", "self-signed",
                "--log-format", "json",
                *(["--device-authority", device_authority] if device_authority else []),
            ],
            stdout=subprocess.PIPE,
            stderr=self.log,
            env={**os.environ, "RUST_LOG": "info,sqlx=warn"},
        )
        self.url = self.fingerprint = self.admin_token = None
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while self.url is None:
            line = self.process.stdout.readline().decode().strip()
            if not line and (self.process.poll() is not None or time.monotonic() > deadline):
                raise RuntimeError(f"canopy-server did not start; see {root / 'server.log'}")
            if line.startswith("admin token: "):
                self.admin_token = line.removeprefix("admin token: ")
            elif line.startswith("tls fingerprint: "):
                self.fingerprint = line.removeprefix("tls fingerprint: ")
            elif line.startswith("listening on "):
                self.url = line.removeprefix("listening on ")
        self.cli("login", self.url, "--fingerprint", self.fingerprint, "--token", self.admin_token)

    def stop(self):
        self.process.terminate()
        try:
            self.process.wait(timeout=20)
        except subprocess.TimeoutExpired:
            self.process.kill()
        self.log.close()

    def cli(self, *args):
        """Runs `canopy ARGS` logged in to this server; returns stdout."""
        env = {**os.environ, "CANOPY_CONFIG_DIR": str(self.config_dir)}
        done = subprocess.run(
            [str(bin_dir() / "canopy"), *args], env=env, capture_output=True, text=True
        )
        if done.returncode != 0:
            raise RuntimeError(f"canopy {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout

    def _request(self, method, path, body=None):
        """An admin API call over HTTPS, trusting only the pinned certificate."""
        context = ssl.create_default_context()
        context.check_hostname = False
        context.verify_mode = ssl.CERT_NONE
        connection = http.client.HTTPSConnection("127.0.0.1", self.port, context=context, timeout=30)
        connection.connect()
        pin = hashlib.sha256(connection.sock.getpeercert(binary_form=True)).hexdigest()
        expected = self.fingerprint.removeprefix("sha256:").lower()
        assert pin == expected, f"the server's certificate {pin} is not the pinned {expected}"
        headers = {"Authorization": f"Bearer {self.admin_token}"}
        if body is not None:
            headers["Content-Type"] = "application/json"
            body = json.dumps(body).encode()
        connection.request(method, path, body=body, headers=headers)
        response = connection.getresponse()
        data = response.read()
        connection.close()
        if response.status >= 300:
            raise RuntimeError(f"{method} {path} answered {response.status}: {data[:500]!r}")
        return data

    def get(self, path):
        return json.loads(self._request("GET", path))

    def download_version(self, model, version_id):
        return self._request("GET", f"/api/v1/models/{model}/versions/{version_id}/download")

    def push_digits_model(self, root: Path, name="digits", fitted=False):
        """A new MLP for the digits; with `fitted`, its input statistics
        fitted on the digits first (`canopy model stats`), as a secure job
        needs."""
        path = root / f"{name}.canopy"
        self.cli("model", "new", "mlp", "--inputs", "64", "--hidden", "16", "--classes", "10", "-o", str(path))
        if fitted:
            data = root / "digits-data"
            data.mkdir()
            (data / "digits.csv").write_bytes(gzip.open(os.environ["CANOPY_DIGITS"]).read())
            self.cli("model", "stats", str(path), "--data", str(data), "-o", str(path))
        self.cli("model", "push", str(path), name)

    def enrollment_token(self, uses=10):
        return self.cli("device", "enroll-token", "--max-uses", str(uses)).strip().splitlines()[-1].strip()

    def create_job(self, root: Path, spec: dict, model="digits"):
        """`canopy job create --spec` with `spec`, started; returns its id."""
        path = root / f"job-{time.monotonic_ns()}.json"
        path.write_text(json.dumps(spec))
        self.cli("job", "create", "--spec", str(path), "--model", model, "--start")
        return max(job["id"] for job in self.get("/api/v1/jobs")["items"])

    def job(self, job_id):
        return self.get(f"/api/v1/jobs/{job_id}")

    def rounds(self, job_id):
        return self.get(f"/api/v1/jobs/{job_id}/rounds")["items"]

    def participants(self, round_id):
        return self.get(f"/api/v1/rounds/{round_id}/participants")["items"]


@pytest.fixture
def server(tmp_path):
    server = Server(tmp_path)
    yield server
    server.stop()


class Authority:
    """A device authority run apart from the server, as an app's backend
    would run it: `canopy authority new` and `canopy authority certify`."""

    def __init__(self, root: Path):
        self.key_path = root / "authority.key"
        self.public_key = self._canopy("authority", "new", "--out", str(self.key_path)).strip()

    def certify(self, device_id, device_key):
        return self._canopy(
            "authority", "certify", "--key", str(self.key_path),
            "--device", str(device_id), "--device-key", device_key,
        ).strip()

    @staticmethod
    def _canopy(*args):
        done = subprocess.run([str(bin_dir() / "canopy"), *args], capture_output=True, text=True)
        if done.returncode != 0:
            raise RuntimeError(f"canopy {' '.join(args)} failed:\n{done.stdout}{done.stderr}")
        return done.stdout


@pytest.fixture
def authority(tmp_path):
    return Authority(tmp_path)


@pytest.fixture
def server_with_authority(tmp_path, authority):
    server = Server(tmp_path, device_authority=authority.public_key)
    yield server
    server.stop()


def load_digits():
    """The bundled UCI digits: (features as rows of 64 floats, labels)."""
    path = _required_env("CANOPY_DIGITS", "point it at datasets/digits/digits.csv.gz")
    rows = [line.split(",") for line in gzip.open(path, "rt").read().split()]
    return [[float(v) for v in row[:-1]] for row in rows], [int(row[-1]) for row in rows]


def new_model(root: Path, name="local"):
    """A new MLP for the digits (`canopy model new`), as file bytes."""
    path = root / f"{name}.canopy"
    done = subprocess.run(
        [str(bin_dir() / "canopy"), "model", "new", "mlp", "--inputs", "64", "--hidden", "16",
         "--classes", "10", "-o", str(path)],
        capture_output=True, text=True,
    )
    if done.returncode != 0:
        raise RuntimeError(f"canopy model new failed:\n{done.stdout}{done.stderr}")
    return path.read_bytes()


def shard(index, count, samples=None):
    """Every `count`-th sample from `index`, as TrainingData arrays."""
    import canopy

    features, labels = load_digits()
    picked = range(index, len(labels), count)
    if samples is not None:
        picked = list(picked)[:samples]
    flat = [v for i in picked for v in features[i]]
    return canopy.TrainingData.ARRAYS(
        features=flat, sample_shape=[64], labels=[labels[i] for i in picked], classes=10
    )


def new_client(server, storage: Path, **overrides):
    import canopy

    config = canopy.ClientConfig(
        server_url=server.url,
        trust=canopy.TrustSetting.PINNED_SHA256(fingerprint=server.fingerprint),
        storage_dir=str(storage),
        limits=overrides.pop("limits", canopy.Limits()),
        backend=canopy.BackendPreference.CPU,
        checkpoint_every_steps=overrides.pop("checkpoint_every_steps", 5),
        # Every step reported: the tests stop training at a given step.
        progress_interval_ms=overrides.pop("progress_interval_ms", 0),
        device_authority=overrides.pop("device_authority", None),
    )
    return canopy.CanopyClient(config)


EVERY_STATE_OK = None


def good_conditions():
    import canopy

    return canopy.DeviceConditions(charging=True, unmetered_network=True, idle=True, battery_percent=90)


def wait_for(predicate, what, timeout_s=JOB_TIMEOUT_S):
    deadline = time.monotonic() + timeout_s
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.1)


def run_in_threads(functions):
    """Runs each function on its own thread; re-raises the first failure."""
    errors = []

    def wrap(function):
        try:
            function()
        except BaseException as error:  # noqa: BLE001 - re-raised below
            errors.append(error)

    threads = [threading.Thread(target=wrap, args=(f,)) for f in functions]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=JOB_TIMEOUT_S)
    if errors:
        raise errors[0]
