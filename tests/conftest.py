import contextlib
import json
import os
import pathlib
from collections.abc import Iterator
from pathlib import Path

import pytest

from common.telemetry import disable_telemetry
from jobs import make_sample_pool

REPO = pathlib.Path(__file__).resolve().parents[1]
disable_telemetry()  # the tests that load the models in this process, as the jobs do in theirs (common.telemetry)


# the tiny pretraining every training test runs: its config and the overrides that make it a 12-step run
TINY = str(Path(__file__).resolve().parents[1] / "configs/pretrain/tiny.yaml")
STEPS, EVERY = 12, 4
FAST = [
    f"steps={STEPS}",
    f"checkpoint.every={EVERY}",
    "checkpoint.keep=2",
    "objective.views.global_size=[64,48]",
    "objective.views.local_size=[32,32]",
    "optim.warmup_steps=2",
    "data.batch_size=1",  # 2 micro-batches of 1 per step and worker: accumulation on, a global batch of 4
    "optim.grad_accum=2",
    "log.every=1",
    "log.record_keys=true",
    "log.collapse_patience=3",
]


class CountedTask:
    """A Ray task in a step's place (set as a ``TaskStep``'s ``task``): counts its launches, and at launch
    ``kill_at`` raises ``KeyboardInterrupt`` as a driver killed between units would."""

    def __init__(self, task, kill_at: int | None = None):
        self.task, self.kill_at, self.launched = task, kill_at, 0

    def remote(self, *args):
        if self.launched == self.kill_at:
            raise KeyboardInterrupt("killed between units")
        self.launched += 1
        return self.task.remote(*args)


@pytest.fixture(scope="session")
def repo_root() -> pathlib.Path:
    return REPO


@pytest.fixture(scope="session")
def ray_local():
    """One local Ray for the whole session (2 CPUs, as on the CI machine)."""
    import ray

    os.environ.setdefault("RAY_DEDUP_LOGS", "0")
    start_local_ray()
    yield ray
    ray.shutdown()


def start_local_ray() -> None:
    import ray

    from common.ray_utils import RUNTIME_ENV, quiet_ray_logs

    quiet_ray_logs()  # the jobs' quiet console (common.ray_utils.init_ray), in the driver and the workers
    if not ray.is_initialized():
        ray.init(address="local", num_cpus=2, include_dashboard=False, logging_level="WARNING", runtime_env=RUNTIME_ENV)


def tensorboard_scalars(run: Path) -> dict[str, dict[int, float]]:
    """A run's TensorBoard scalars as TensorBoard's own reader shows them (a resume's purge applied):
    tag -> step -> value; a step seen twice for a tag fails."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from training.metrics_sinks import TENSORBOARD

    events = EventAccumulator(str(run / TENSORBOARD), size_guidance={"scalars": 0})
    events.Reload()
    out = {}
    for tag in events.Tags()["scalars"]:
        steps = [e.step for e in events.Scalars(tag)]
        assert len(steps) == len(set(steps)), (tag, steps)
        out[tag] = {e.step: e.value for e in events.Scalars(tag)}
    return out


@contextlib.contextmanager
def moto_s3(*buckets: str) -> Iterator[tuple[object, str]]:
    """A local S3 endpoint (a moto server on a free port of 127.0.0.1) holding ``buckets``; yields a pyarrow
    filesystem on it and its ``host:port``. URIs reach it through their query:
    ``s3://<bucket>/<key>?endpoint_override=<host:port>&scheme=http&region=us-east-1``."""
    moto_server = pytest.importorskip("moto.server")
    import pyarrow.fs as pafs

    os.environ.setdefault("AWS_EC2_METADATA_DISABLED", "true")  # never ask a cloud's metadata service for keys
    server = moto_server.ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    try:
        host, port = server.get_host_and_port()
        fs = pafs.S3FileSystem(
            access_key="test", secret_key="test", endpoint_override=f"{host}:{port}", scheme="http",
            region="us-east-1", allow_bucket_creation=True,
        )  # fmt: skip
        for bucket in buckets:
            fs.create_dir(bucket)
        yield fs, f"{host}:{port}"
    finally:
        server.stop()


def s3_query(endpoint: str) -> str:
    return f"?endpoint_override={endpoint}&scheme=http&region=us-east-1"


@pytest.fixture
def s3(monkeypatch):
    """A local S3 endpoint (moto) with a bucket "curated", its credentials in the environment, and a URI query that
    reaches it: ``(filesystem, "?endpoint_override=...")``."""
    for k, v in {
        "AWS_ACCESS_KEY_ID": "test",
        "AWS_SECRET_ACCESS_KEY": "test",
        "AWS_DEFAULT_REGION": "us-east-1",
    }.items():
        monkeypatch.setenv(k, v)
    with moto_s3("curated") as (fs, endpoint):
        yield fs, s3_query(endpoint)


@pytest.fixture(scope="session")
def store_dir(tmp_path_factory) -> Path:
    """Random-init YOLO11n detector and pose model, a tiny OpenCLIP and a LAION-layout aesthetic head, saved the
    way a cluster's store would hold them."""
    from generators.random_models import build_random_store

    out = tmp_path_factory.mktemp("model_store")
    build_random_store(out)
    return out


@pytest.fixture(scope="session")
def sample_pool(tmp_path_factory) -> Path:
    """The sample pool (folder format, default size, seed 0), built once per session."""
    root = tmp_path_factory.mktemp("pool") / "folder"
    assert make_sample_pool.main(["--out", str(root), "--seed", "0"]) == 0
    return root


@pytest.fixture(scope="session")
def manifest(sample_pool) -> dict[str, dict]:
    entries = [json.loads(line) for line in (sample_pool / "_manifest.jsonl").read_text().splitlines()]
    return {str(sample_pool / e["path"]): e for e in entries}


@pytest.fixture(scope="session")
def curated_run(sample_pool, ray_local, tmp_path_factory) -> Path:
    """The sample pool curated once with the lite profile into final shards of 4 images (so there are several).

    Shared by the whole session: read it, or copy it before changing anything.
    """
    from jobs import curate

    out = tmp_path_factory.mktemp("curated_run") / "out"
    args = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(sample_pool), "--output", str(out)]
    assert curate.main([*args, "write.rows_per_shard=4"]) == 0
    return out


@pytest.fixture(scope="session")
def wds_curated_run(ray_local, tmp_path_factory) -> tuple[Path, Path]:
    """(pool, out): a 40-input WebDataset sample pool with img2dataset's sidecars, curated with the lite profile.

    Shared by the whole session: read it, or copy it before changing anything.
    """
    from jobs import curate

    base = tmp_path_factory.mktemp("wds_curated_run")
    pool, out = base / "pool", base / "out"
    assert make_sample_pool.main(["--out", str(pool), "--format", "webdataset", "--n", "40"]) == 0
    argv = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(pool), "--output", str(out)]
    assert curate.main(argv) == 0
    return pool, out


@pytest.fixture(scope="module")
def one_torch_thread():
    """Tiny tensors: one thread is fastest, and OpenMP workers spin badly on a shared two-core machine."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """Leave with pytest's own exit status once everything is reported: native threads of Ray, gRPC and moto that
    outlive the session can crash the interpreter's teardown (exit 139 after a green summary)."""
    import sys

    sys.stdout.flush()
    sys.stderr.flush()
    status = getattr(config, "_humans1b_exitstatus", None)
    if status is not None:
        os._exit(int(status))


def pytest_sessionfinish(session, exitstatus):
    session.config._humans1b_exitstatus = exitstatus
