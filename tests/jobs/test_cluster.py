"""`ray job submit` on a real two-node local cluster (token authentication on), losing a worker node mid-run."""

import os
import re
import subprocess
import time

import psutil
import pytest
from conftest import start_local_ray
from ray.job_submission import JobStatus, JobSubmissionClient

from common.layout import LAYOUT
from curation.score.ledger import read_ledger

pytestmark = pytest.mark.slow

HEAD_PORT, DASHBOARD_PORT = 6391, 8271


def _ports(base: int) -> list[str]:
    """A node's own ports: two nodes share this machine, and neither may collide with a local Ray of another test
    (whose dashboard agent would otherwise hold the default port, leaving the job server without an agent)."""
    names = [
        "--node-manager-port",
        "--object-manager-port",
        "--dashboard-agent-listen-port",
        "--dashboard-agent-grpc-port",
        "--runtime-env-agent-port",
        "--metrics-export-port",
    ]
    ports = [arg for i, name in enumerate(names) for arg in (name, str(base + i))]
    return [*ports, "--min-worker-port", str(base + 100), "--max-worker-port", str(base + 199)]


HEAD_PORTS, WORKER_PORTS = _ports(7000), _ports(7300)  # the worker's node manager port (7300) identifies it
# small actors, so work lands on both nodes and the head's two CPUs carry on alone
SMALL = [
    "stages.person.actors=[1,1]",
    "stages.person.num_cpus=0.25",
    "stages.text_overlay.num_cpus=0.25",
    "stages.head_pose.num_cpus=0.25",
]


def _ray(*args: str, env: dict) -> subprocess.CompletedProcess:
    return subprocess.run(["ray", *args], env=env, capture_output=True, text=True, timeout=180)


@pytest.fixture()
def two_node_cluster(ray_local):
    ray_local.shutdown()  # the session's in-process Ray must not share this machine's ports
    # the submitted job relays its workers' lines as Ray does by default (the session sets RAY_DEDUP_LOGS=0 for itself)
    env = {**{k: v for k, v in os.environ.items() if k != "RAY_DEDUP_LOGS"}, "RAY_AUTH_MODE": "token"}
    common = ["--node-ip-address", "127.0.0.1", "--disable-usage-stats"]
    head = _ray(
        "start",
        "--head",
        "--port",
        str(HEAD_PORT),
        "--dashboard-host",
        "127.0.0.1",
        "--dashboard-port",
        str(DASHBOARD_PORT),
        "--include-dashboard",
        "true",
        "--num-cpus",
        "2",
        *common,
        *HEAD_PORTS,
        env=env,
    )
    assert head.returncode == 0, head.stderr
    worker = _ray("start", "--address", f"127.0.0.1:{HEAD_PORT}", "--num-cpus", "1", *common, *WORKER_PORTS, env=env)
    assert worker.returncode == 0, worker.stderr
    try:
        yield env
    finally:
        _kill_cluster()
        start_local_ray()  # back for the tests after this one


def _kill_cluster() -> None:
    """Stop this test's cluster only (``ray stop`` would stop every Ray on the machine)."""
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if str(HEAD_PORT) in cmd or "node_manager_port=7300" in cmd:
            for child in proc.children(recursive=True):
                child.kill()
            proc.kill()


def _kill_worker_node() -> int:
    """SIGKILL the second node's raylet and its workers, as a spot reclaim would."""
    killed = 0
    for proc in psutil.process_iter(["pid", "cmdline"]):
        cmd = " ".join(proc.info["cmdline"] or [])
        if "raylet" in cmd and "--node_manager_port=7300" in cmd:
            for child in proc.children(recursive=True):
                child.kill()
                killed += 1
            proc.kill()
            killed += 1
    return killed


def _submit(env: dict, argv: list[str]) -> str:
    """Submit without waiting, retrying while the fresh cluster's job agent comes up; returns the submission id."""
    deadline = time.monotonic() + 300
    while True:
        done = _ray("job", "submit", "--no-wait", "--address", f"http://127.0.0.1:{DASHBOARD_PORT}", *argv, env=env)
        found = re.search(r"raysubmit_\w+", done.stdout + done.stderr)
        if done.returncode == 0 and found:
            return found.group(0)
        assert "No available agent" in done.stdout + done.stderr or "Connection" in done.stderr, done.stderr
        assert time.monotonic() < deadline, f"the job server never accepted the job: {done.stderr[-2000:]}"
        time.sleep(2)


def test_submitted_job_survives_losing_a_worker_node(two_node_cluster, sample_pool, repo_root, tmp_path, monkeypatch):
    monkeypatch.setenv("RAY_AUTH_MODE", "token")  # for the job client in this process, as for the CLI
    out = tmp_path / "out"
    job_id = _submit(
        two_node_cluster,
        [
            "--working-dir",
            str(repo_root),
            "--",
            "python",
            "-m",
            "jobs.curate",
            "--config",
            "configs/curate/lite.yaml",
            "--input",
            str(sample_pool),
            "--output",
            str(out),
            *SMALL,
        ],
    )
    deadline = time.monotonic() + 600
    while not list((out / LAYOUT.score_commits).glob("*.json")) and time.monotonic() < deadline:
        time.sleep(0.5)
    committed_at_kill = len(list((out / LAYOUT.score_commits).glob("*.json")))
    assert _kill_worker_node() > 0  # mid-run: at least one shard committed, more to come
    client = JobSubmissionClient(f"http://127.0.0.1:{DASHBOARD_PORT}")
    while not client.get_job_status(job_id).is_terminal() and time.monotonic() < deadline + 600:
        time.sleep(2)
    log = client.get_job_logs(job_id)
    assert client.get_job_status(job_id) == JobStatus.SUCCEEDED, log[-3000:]
    assert "[curate] summary" in log and "[score]" in log
    # the quiet console of a submitted job (a lost node's own errors and warnings show)
    for noise in ("XNNPACK delegate", "has constructor arguments in the object store", "Running Dataset"):
        assert noise not in log, noise
    total_shards = len(list((out / LAYOUT.score_commits).glob("*.json")))
    assert 1 <= committed_at_kill < total_shards, "the node was not lost mid-run"
    manifest = (sample_pool / "_manifest.jsonl").read_text().splitlines()
    ledger = read_ledger(str(out), ["source", "status"]).column("source").to_pylist()
    assert len(ledger) == len(set(ledger)) == len(manifest)  # nothing lost, nothing twice
    assert list((out / "shards").glob("part-*.parquet"))
