"""A quiet console: Ray's noise filtered in every process, no deprecated Ray calls, rank 0's lines only; I/O retries
that replaced Ray's task-level retry arguments."""

from __future__ import annotations

import logging
import os
import re
import subprocess
import sys
import threading
import warnings
from pathlib import Path

import pytest

from common import console, ray_utils
from common.progress import Progress, progress
from common.storage import retry_io, retry_io_stream
from curation.config import CurateConfig
from curation.score.phase import ScorePhase
from curation.score.pool import Pool, list_shards
from curation.steps.output import Output

REPO = Path(__file__).resolve().parents[2]


def test_a_quiet_threads_error_is_not_printed_and_any_other_threads_is(monkeypatch):
    ray_utils.quiet_ray_logs()
    assert threading.excepthook is ray_utils._quiet_thread_errors
    printed: list[str] = []  # what the hook installed before (the one that prints) receives
    monkeypatch.setattr(ray_utils, "_next_excepthook", lambda args: printed.append(args.thread.name))

    def fail() -> None:
        raise RuntimeError("Timed out while waiting for GCS to become available.")

    for name in ("PlacementGroupCleanerMonitor", "some-other-thread"):
        thread = threading.Thread(target=fail, name=name)
        thread.start()
        thread.join()
    assert printed == ["some-other-thread"]


def test_quiet_filters_drop_only_the_named_noise():
    from ray.data.context import OK_PREFIX, WARN_PREFIX

    ray_utils.quiet_ray_logs()
    ray_utils.quiet_ray_logs()  # idempotent: one filter per logger
    cleaner = logging.getLogger("ray.train.v2._internal.execution.controller.placement_group_cleaner")
    callback = logging.getLogger("ray.train.v2._internal.callbacks.placement_group_callback")
    executor = logging.getLogger("ray.data._internal.execution.streaming_executor")
    assert sum(isinstance(f, ray_utils.DropMessages) for f in cleaner.filters) == 1
    shown: list[str] = []
    handler = logging.Handler(logging.INFO)
    handler.emit = lambda record: shown.append(record.getMessage())
    for logger in (cleaner, callback, executor):
        logger.addHandler(handler)
        logger.setLevel(logging.INFO)
    try:
        cleaner.warning("Failed to query Ray Train Controller actor state. State API may be temporarily unavailable.")
        cleaner.warning("Monitor thread did not exit within %.2f seconds", 12.0)
        cleaner.warning("Failed to clean up placement group: boom")
        try:
            raise TimeoutError("Get timed out: some object(s) not ready.")
        except TimeoutError:
            callback.exception("Failed to stop PlacementGroupCleaner gracefully.")
        callback.warning("Failed to register placement group with cleaner: boom")
        executor.info("Starting execution of Dataset dataset_1. Full logs are in /tmp/ray")
        executor.info(f"{OK_PREFIX} Dataset dataset_1 execution finished in 57.28 seconds")
        executor.info(f"{WARN_PREFIX} Dataset dataset_1 execution failed")
        executor.warning("Ray's object store is configured to use only 10% of available memory")
    finally:
        for logger in (cleaner, callback, executor):
            logger.removeHandler(handler)
            logger.setLevel(logging.NOTSET)
    assert shown == [
        "Failed to clean up placement group: boom",
        "Failed to register placement group with cleaner: boom",
        f"{WARN_PREFIX} Dataset dataset_1 execution failed",
        "Ray's object store is configured to use only 10% of available memory",
    ]


def test_the_driver_drops_relayed_noise_and_keeps_every_other_line(monkeypatch):
    """Lines of other processes Ray relays to the driver, C++ logs among them: the ``QUIET_RELAYED`` ones are dropped
    by Ray's own filter of relayed lines, with a pattern the user gave it; errors, warnings and prints pass."""
    from ray._private import ray_logging
    from ray.data import DataContext

    relays = {"stdout": ray_logging.stdout_deduplicator, "stderr": ray_logging.stderr_deduplicator}
    for relay in relays.values():
        monkeypatch.setattr(relay, "skip_re", relay.skip_re)
        monkeypatch.setattr(relay, "recent", {})  # the lines it has seen, to count repeats
    monkeypatch.setattr(ray_logging, "RAY_DEDUP_LOGS", True)  # Ray's default; RAY_DEDUP_LOGS=0 shows every line
    monkeypatch.setenv("RAY_DEDUP_LOGS_SKIP_REGEX", "^my noise$")
    monkeypatch.delenv("RAY_DATA_DISABLE_PROGRESS_BARS", raising=False)
    monkeypatch.setattr(DataContext.get_current(), "enable_progress_bars", True)
    ray_utils.quiet_driver()
    ray_utils.quiet_driver()
    assert not DataContext.get_current().enable_progress_bars
    caution = (
        "[2026-12-05 08:22:03,614 E 29264 29305] core_worker.cc:2465: Actor with class name: '{}' and ID: "
        "'e8d7aac2123673d1466c335401000000' has constructor arguments in the object store and max_restarts > 0. If "
        "the arguments in the object store go out of scope or are lost, the actor restart will fail. See "
        "https://github.com/ray-project/ray/issues/53727 for more details."
    )
    kept = [
        caution.format("MyActor"),  # an actor of ours would be worth the caution
        "[2026-12-05 08:22:04,000 E 29264 29305] core_worker.cc:1200: Failed to register actor. Error message: boom",
        "INFO: Created TensorFlow Lite GPU delegate.",
        "ValueError: bad image",
        "[score] warning: over the limit",
    ]
    noise = [
        caution.format("PreemptionWatcher"),
        caution.format("MapWorker(MapBatches(decode)->MapBatches(person+head_pose+quality))"),
        "INFO: Created TensorFlow Lite XNNPACK delegate for CPU.",
        "my noise",
    ]
    for name, relay in relays.items():
        batch = {"ip": "10.0.0.1", "pid": 1000, "job": "01000000", "is_err": name == "stderr", "lines": noise + kept}
        assert [line for b in relay.deduplicate(batch) for line in b["lines"]] == kept, name


def test_a_job_logging_to_a_file_gets_rays_console_without_colour_and_a_terminal_keeps_rays_defaults():
    assert ray_utils.console_env(terminal=True) == {}
    assert ray_utils.console_env(terminal=False) == {"RAY_COLOR_PREFIX": "0"}  # worker-line prefixes: no ANSI colour


def test_the_token_auth_notice_is_dropped_for_a_local_ray_only(monkeypatch):
    """Ray says token authentication is on at every local start; the driver of a local Ray drops that line and
    keeps the warning that it is off. Joining a cluster installs no such filter."""
    started: list[dict] = []
    monkeypatch.setattr(ray_utils.ray, "is_initialized", lambda: False)
    monkeypatch.setattr(ray_utils.ray, "init", lambda **kwargs: started.append(kwargs))
    monkeypatch.setattr(ray_utils, "_spend_restart_caution", lambda: None)  # no Ray is started here
    monkeypatch.delenv("RAY_ADDRESS", raising=False)
    monkeypatch.setattr(ray_utils, "console_env", lambda terminal: {})  # this process's environment stays as it is
    auth = logging.getLogger("ray._private.authentication.authentication_token_setup")
    monkeypatch.setattr(auth, "filters", [])
    ray_utils.init_ray(address="ray://head:10001")
    assert not auth.filters and started[-1]["address"] == "ray://head:10001"
    ray_utils.init_ray()
    assert started[-1]["address"] == "local" and len(auth.filters) == 1
    ray_utils.init_ray()
    assert len(auth.filters) == 1  # one filter however often
    shown: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: shown.append(record.getMessage())
    auth.addHandler(handler)
    try:
        auth.warning(
            "Token authentication is enabled for this Ray cluster. Set RAY_AUTH_MODE to opt out."
        )  # Ray says how
        auth.warning("Token authentication is disabled for this Ray cluster. Anyone with network access ...")
    finally:
        auth.removeHandler(handler)
    assert shown == ["Token authentication is disabled for this Ray cluster. Anyone with network access ..."]


def test_the_scoring_pipeline_uses_no_deprecated_ray_arguments(sample_pool, ray_local, tmp_path):
    from ray.util.annotations import RayDeprecationWarning

    cfg = CurateConfig()
    shards = list_shards(Pool.at(str(sample_pool)), cfg.input)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ScorePhase(cfg, Output.at(str(tmp_path / "out")), Pool.at(str(sample_pool))).build(
            shards
        )  # builds the plan, runs nothing
    ours = [w for w in caught if issubclass(w.category, DeprecationWarning) and w.filename.startswith(str(REPO))]
    assert not ours and not [w for w in caught if issubclass(w.category, RayDeprecationWarning)], caught


def test_io_errors_are_retried_and_a_retried_stream_yields_each_item_once(monkeypatch):
    monkeypatch.setattr("common.storage.time.sleep", lambda s: None)
    opened = []

    def stream():  # fails after two items on its first two openings
        opened.append(1)
        for i in range(5):
            if i == 2 and len(opened) <= 2:
                raise OSError("connection reset")
            yield i

    assert list(retry_io_stream(stream, retries=2)) == [0, 1, 2, 3, 4] and len(opened) == 3
    opened.clear()
    with pytest.raises(OSError):
        list(retry_io_stream(stream, retries=1))
    calls = []

    def flaky_write() -> str:  # fails twice
        calls.append(1)
        if len(calls) < 3:
            raise OSError("timeout")
        return "written"

    assert retry_io(flaky_write, retries=2) == "written" and len(calls) == 3
    calls.clear()
    with pytest.raises(OSError):
        retry_io(flaky_write, retries=1)


# What Ray's internals print into a job's console that is no error of the job: none of it may show.
RAY_NOISE = (
    "core_worker.cc",  # the C++ core worker's caution about restartable actors, of the driver or relayed
    "has constructor arguments in the object store",
    "XNNPACK delegate",  # the TFLite runtime of the head-pose actors
    "Running Dataset",  # Ray Data's progress blocks and closing line
    "Total Progress",
    "execution finished in",
    "Starting execution of Dataset",
    "Failed to query Ray Train Controller",  # Ray Train's placement-group cleaner
    "Failed to stop PlacementGroupCleaner",
    "GetTimeoutError",
    "Monitor thread did not exit",
    "TrainingReport(",
    "Reporting training result",
    "RayDeprecationWarning",
    "\x1b[",  # a log file, not a terminal: the workers' (pid=...) prefixes without colour
)


def job_console(module: str, args: list[str], ray_local, timeout: int = 900) -> str:
    """A job run as ``python -m`` joining the session's Ray, as a submitted job does: its whole console output, with
    Ray's relay of worker lines as it is by default (the session sets RAY_DEDUP_LOGS=0 for itself)."""
    address = ray_local.get_runtime_context().gcs_address
    env = {k: v for k, v in os.environ.items() if k != "RAY_DEDUP_LOGS"}
    run = subprocess.run(
        [sys.executable, "-m", module, *args, f"ray.address={address}"],
        cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip
    console = run.stdout + run.stderr
    assert run.returncode == 0, console[-3000:]
    shown = [noise for noise in RAY_NOISE if noise in console]
    assert not shown, (shown, console[-6000:])
    return console


@pytest.mark.slow
def test_a_curation_job_prints_its_progress_and_summary_and_no_ray_noise(sample_pool, ray_local, tmp_path):
    """The lite profile on the sample pool: its head-pose actors run TFLite, Ray Data starts actor pools from the
    driver. The lines dropped from the console stay in Ray's log files."""
    args = ["--config", str(REPO / "configs/curate/lite.yaml"), "--input", str(sample_pool), "--output",
            str(tmp_path / "out")]  # fmt: skip
    console = job_console("jobs.curate", args, ray_local)
    for ours in ("[curate] profile=lite", "[score] committed", "[score] done:", "[dedup]", "[sample]", "[write]",
                 "[curate] summary", "decode / not_an_image", "[curate] next:"):  # fmt: skip
        assert ours in console, ours
    logs = Path(ray_local._private.worker._global_node.get_logs_dir_path())
    assert any("XNNPACK delegate" in p.read_text(errors="replace") for p in logs.glob("worker-*.err"))
    spent = [p.read_text() for p in logs.glob("driver-*-start.err")]
    assert any("has constructor arguments in the object store" in text for text in spent)


@pytest.mark.slow
def test_a_training_job_prints_rank_zero_lines_and_no_ray_noise(curated_run, ray_local, tmp_path):
    args = ["--config", str(REPO / "configs/pretrain/tiny.yaml"), "--data", str(curated_run / "shards"),
            "--storage", str(tmp_path), "--name", "quiet", "steps=4", "checkpoint.every=2", "log.every=1",
            "objective.views.global_size=[64,48]", "objective.views.local_size=[32,32]", "data.batch_size=1"]  # fmt: skip
    console = job_console("jobs.pretrain", args, ray_local)
    steps = [int(m) for m in re.findall(r"\[pretrain\] step (\d+)/4", console)]
    assert steps and len(steps) == len(set(steps)), steps  # two workers, one line per step: rank 0's
    assert "[pretrain] done in" in console and (tmp_path / "quiet" / "tensorboard").is_dir()


def test_our_messages_print_alone_once_on_the_current_stdout_and_reach_caplog_and_a_file(
    capsys, caplog, tmp_path, monkeypatch
):
    monkeypatch.delenv(console.FILE_ENV, raising=False)
    console.configure_console()
    console.configure_console(file=str(tmp_path / "job.log"))  # idempotent: still one console handler
    loggers = [logging.getLogger(name) for name in console.PACKAGES]
    to_file = [h for h in loggers[0].handlers if isinstance(h, logging.FileHandler)]
    try:
        console.configure_console(file=str(tmp_path / "job.log"))
        for logger in loggers:
            assert [type(h) for h in logger.handlers].count(console._Stdout) == 1 and logger.propagate
            assert [h for h in logger.handlers if isinstance(h, logging.FileHandler)] == to_file
        caplog.set_level(logging.INFO, logger="curation")
        logging.getLogger("curation.phases.pipeline").info("[dedup] survey 1/2 partitions (50%)")
        logging.getLogger("curation.score.phase").warning("[score] warning: over the limit")
        logging.getLogger("common.lease").debug("not shown")
        assert capsys.readouterr().out == "[dedup] survey 1/2 partitions (50%)\n[score] warning: over the limit\n"
        assert caplog.messages == ["[dedup] survey 1/2 partitions (50%)", "[score] warning: over the limit"]
        to_file[0].flush()
        written = (tmp_path / "job.log").read_text().splitlines()
        assert [line.split(" ", 2)[2] for line in written] == [
            "INFO curation.phases.pipeline: [dedup] survey 1/2 partitions (50%)",
            "WARNING curation.score.phase: [score] warning: over the limit",
        ]
    finally:
        for logger in loggers:
            for handler in to_file:
                logger.removeHandler(handler)
        for handler in to_file:
            handler.close()


def test_progress_lines_come_every_interval_with_done_total_and_rate():
    now, lines = [0.0], []
    meter = Progress("[sample] assign", 10, lines.append, "files", every_s=10.0, clock=lambda: now[0])
    for _ in range(4):  # 3 s per file
        now[0] += 3.0
        meter.update()
    assert lines == ["[sample] assign 4/10 files (40%), 0.333/s, ~18 s left"]
    for _ in range(6):
        now[0] += 3.0
        meter.update()
    assert len(lines) == 2 and lines[1].startswith("[sample] assign 8/10 files (80%)")  # none once all are done
    quick: list[str] = []
    assert list(progress(range(5), "[x]", 5, quick.append)) == [0, 1, 2, 3, 4] and quick == []


def test_a_path_is_shown_even_where_the_working_directory_is_gone(tmp_path, monkeypatch):
    """A submitted job's working directory can be removed under it (Ray's package folder after a node is lost): the
    closing lines name the path as it is rather than fail the finished job."""
    inside = tmp_path / "repo" / "configs" / "x.yaml"
    inside.parent.mkdir(parents=True)
    monkeypatch.chdir(tmp_path / "repo")
    assert console.shown_path(inside) == str(Path("configs") / "x.yaml")
    gone = tmp_path / "gone"
    gone.mkdir()
    monkeypatch.chdir(gone)
    gone.rmdir()
    assert console.shown_path(inside) == str(inside)
