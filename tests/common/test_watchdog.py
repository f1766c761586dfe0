"""The watchdog: a stuck job says which stage waits for what; a job that moves says nothing. The words for what
waits are tested on made-up clusters in test_ray_waits.py."""

import os
import re
import signal
import subprocess
import sys
import threading
import time

import pytest

from common import watchdog
from common.config import ConfigError, load_config
from common.watchdog import Watchdog
from curation.steps.window import run_tasks


def _wait_for(lines: list[str], text: str, timeout_s: float) -> str:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in list(lines) if text in line]
        if found:
            return found[0]
        time.sleep(0.05)
    raise AssertionError(f"no {text!r} within {timeout_s} s; got {lines}")


# --- the settings -----------------------------------------------------------------------------------------------------


def test_watchdog_minutes_is_a_config_field_with_overrides(repo_root):
    from curation.config import CurateConfig
    from pretrain.config import PretrainConfig

    lite = repo_root / "configs/curate/lite.yaml"
    assert load_config(CurateConfig, lite).watchdog.minutes == 10
    cfg = load_config(CurateConfig, lite, ["watchdog.minutes=0.02"])
    assert cfg.watchdog.minutes == 0.02
    assert cfg.results_hash() == load_config(CurateConfig, lite).results_hash()  # resuming is not disturbed
    tiny = load_config(PretrainConfig, repo_root / "configs/pretrain/tiny.yaml", ["watchdog.minutes=0"])
    assert tiny.watchdog.minutes == 0
    with pytest.raises(ConfigError, match=r"watchdog\.minutes"):
        load_config(CurateConfig, lite, ["watchdog.minutes=-1"])


# --- the thread -------------------------------------------------------------------------------------------------------


@pytest.fixture
def no_ray(monkeypatch):
    """The thread's timing alone: a local Ray of other tests stays out of these blocks."""
    monkeypatch.setattr(watchdog, "_ray_up", lambda: False)


def test_a_stall_is_reported_again_while_it_lasts_and_its_end_once(no_ray):
    lines: list[str] = []
    with Watchdog("a job", 0.01, log=lines.append) as dog:  # 0.6 s
        dog.stage("phase one")
        deadline = time.monotonic() + 10
        while len(lines) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(lines) >= 2 and all("no progress for" in line for line in lines)  # again every watchdog.minutes
        head = r"\[watchdog\] a job: no progress for \d s in phase one \(last progress: phase one started\)\n"
        assert re.match(head, lines[0]), lines[0]
        assert lines[0].endswith("repeats every 1 s while nothing moves (watchdog.minutes=0.01) and a line says when "
                                 "progress resumes")  # fmt: skip
        watchdog.beat("shard 3 committed")  # the module-level beat reaches the running watchdog
        assert re.fullmatch(
            r"\[watchdog\] a job: progress again in phase one after \d s without: shard 3 committed", lines[-1]
        )
        reports = len(lines)
        for _ in range(10):
            watchdog.beat("more")
            time.sleep(0.1)
        assert len(lines) == reports  # said once; nothing while it moves
    assert dog not in watchdog._active


def test_zero_minutes_turns_it_off(no_ray):
    lines: list[str] = []
    with Watchdog("a job", 0, log=lines.append):
        time.sleep(0.2)
    assert lines == []


def test_an_error_in_the_watchdog_is_logged_once_and_it_keeps_watching(no_ray):
    calls: list[str] = []

    def flaky(text: str) -> None:
        calls.append(text)
        if len(calls) == 1:
            raise OSError("console gone")

    with Watchdog("a job", 0.001, log=flaky):  # 0.06 s
        deadline = time.monotonic() + 5
        while len(calls) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        watchdog.beat("still fine")  # the job's own call returns
    assert calls[1] == "[watchdog] a job: the watchdog hit OSError: console gone (not shown again)"
    assert sum("the watchdog hit" in c for c in calls) == 1
    assert len(calls) >= 3  # the reports after the fault still come


# --- on a local Ray ---------------------------------------------------------------------------------------------------


def test_a_stage_whose_tasks_ask_for_what_the_cluster_lacks_is_named(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0.5, num_gpus=1)
    def person(x):
        return x

    @ray.remote(num_cpus=0.5, resources={"humans1b_test_missing": 1})
    def special(x):
        return x

    lines: list[str] = []
    refs = []
    try:
        with Watchdog("test job", 0.02, log=lines.append) as dog:
            dog.stage("the score phase", {"stage person": {"CPU": 0.5, "GPU": 1}, "stage special": {"CPU": 0.5,
                      "humans1b_test_missing": 1}})  # fmt: skip
            refs = [person.remote(i) for i in range(3)] + [special.remote(0)]
            block = _wait_for(lines, "stage special", 30)
    finally:
        for ref in refs:
            ray.cancel(ref, force=True)
    assert block.startswith("[watchdog] test job: no progress for") and "in the score phase" in block
    assert "3 tasks or actors of stage person wait for {CPU: 0.5, GPU: 1}; the cluster has" in block
    assert "no GPU: no node has 1 GPU" in block
    assert "1 task or actor of stage special waits for {CPU: 0.5, humans1b_test_missing: 1}" in block
    assert "cluster: 1 node; 2 CPU" in block


def test_a_job_that_progresses_prints_nothing(ray_local):
    ray = ray_local

    @ray.remote(num_cpus=0.5)
    def work(i):
        time.sleep(0.1)
        return i

    ray.get(work.remote(0))  # a worker process ready before the clock starts
    lines: list[str] = []
    with Watchdog("test job", 0.05, log=lines.append) as dog:
        dog.stage("the score phase")
        done = list(run_tasks((lambda i=i: work.remote(i) for i in range(30)), window=2))  # each one a beat
    assert sorted(done) == list(range(30))
    assert lines == []
    assert dog.last_progress == "a task finished"


def test_a_workers_beats_reach_the_driver_through_the_relay(ray_local):
    ray = ray_local
    key = watchdog.progress_key(f"test-run-{time.time_ns()}")

    @ray.remote(num_cpus=0.5)
    def train(key, steps):
        from common import watchdog

        watchdog.relay(key, every_s=0.05)
        for step in range(1, steps + 1):
            watchdog.beat(f"step {step}/{steps}")
            time.sleep(0.1)
        time.sleep(0.5)  # the relay's last write
        watchdog.relay(None)

    ray.get(train.remote(key, 0))  # a worker process ready before the clock starts
    lines: list[str] = []
    with Watchdog("test job", 0.2, log=lines.append) as dog:  # 12 s; it reads the key every 0.6 s
        dog.stage("the Ray Train run", follow=key)
        time.sleep(1.5)  # the watchdog clears what an earlier attempt left under the key
        ray.get(train.remote(key, 10))
        deadline = time.monotonic() + 5
        while dog.last_progress != "step 10/10" and time.monotonic() < deadline:
            time.sleep(0.05)
    assert dog.last_progress == "step 10/10"
    assert lines == []


# --- end to end -------------------------------------------------------------------------------------------------------


@pytest.mark.slow  # a curation job in its own process, with its own Ray
def test_curate_with_a_stage_that_asks_for_a_missing_gpu_says_so_within_seconds(sample_pool, repo_root, tmp_path):
    """The person stage asks for a GPU the local Ray lacks: Ray Data waits for ever; the watchdog says which stage
    waits for what, and the run can be stopped."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}  # its own local Ray, not a cluster
    cmd = [sys.executable, "-m", "jobs.curate", "--config", str(repo_root / "configs/curate/lite.yaml"),
           "--input", str(sample_pool), "--output", str(tmp_path / "out"), "--phases", "score",
           "stages.person.num_gpus=1", "watchdog.minutes=0.05", "ray.num_cpus=2"]  # fmt: skip
    proc = subprocess.Popen(
        cmd, cwd=repo_root, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True
    )
    seen: list[str] = []
    reader = threading.Thread(target=lambda: seen.extend(line.rstrip("\n") for line in proc.stdout or ()), daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 75
        while time.monotonic() < deadline and proc.poll() is None:
            if any("[watchdog]" in line and "stage person" in line for line in list(seen)):
                break
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=10)
    text = "\n".join(seen)
    assert "[watchdog] jobs.curate: no progress for" in text and "in the score phase" in text, text[-3000:]
    person = next(line for line in seen if "[watchdog]" in line and "stage person" in line)
    assert "wait for {CPU: 0.5, GPU: 1, memory:" in person and "no GPU" in person, person
