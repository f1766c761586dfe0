"""A job that refuses its arguments writes nothing: every check comes before the first write (a lease, a run record,
Ray), so the folders it was given are as they were and the corrected command is not refused for the first one's
leftovers. And a job that finishes says where its results are and which commands come next, commands its own
parsers accept."""

from __future__ import annotations

import shlex
import shutil
from pathlib import Path

import pytest

from common.config import load_config
from curation.steps.output import Output
from finetune.config import FinetuneConfig
from jobs import audit, curate, export, finetune, make_synthetic, pretrain, probe
from pretrain.config import PretrainConfig
from training.runner import claim_run

REPO = Path(__file__).resolve().parents[2]
LITE = str(REPO / "configs/curate/lite.yaml")
TINY = str(REPO / "configs/pretrain/tiny.yaml")
TINY_SEG = str(REPO / "configs/finetune/tiny-seg.yaml")
PARSERS = {
    "jobs.audit": audit.parse_args,
    "jobs.curate": curate.parse_args,
    "jobs.export": export.parse_args,
    "jobs.finetune": finetune.parse_args,
    "jobs.make_synthetic": make_synthetic.parse_args,
    "jobs.pretrain": pretrain.parse_args,
    "jobs.probe": probe.parse_args,
}


def _tree(root: Path) -> dict[str, tuple[bool, int, int]]:
    """Every path under ``root`` (folders too), with its size and modification time."""
    if not root.exists():
        return {}
    return {
        str(p.relative_to(root)): (p.is_dir(), p.stat().st_size, p.stat().st_mtime_ns) for p in [root, *root.rglob("*")]
    }


@pytest.fixture
def folders(curated_run, sample_pool, tmp_path) -> dict[str, Path]:
    """A copy of a curated output, a training run folder beside it (its run record as jobs.pretrain writes it) and
    the sample pool."""
    curated = tmp_path / "curated"
    shutil.copytree(curated_run, curated)
    runs = tmp_path / "runs"
    claim_run(str(runs / "tiny"), {"data": str(curated / "shards"), "model_hash": "0"}, info={"size": "tiny"})
    return {"base": tmp_path, "curated": curated, "runs": runs, "run": runs / "tiny", "pool": sample_pool}


def _refusals(f: dict[str, Path]) -> list[tuple[str, list[str], str]]:
    """(job, argv, what the error says) of commands that must be refused."""
    c, run, base = f["curated"], f["run"], f["base"]
    storage = ["--storage", str(f["runs"])]
    return [
        # the README's command with --data at the curated output instead of its shards folder
        ("jobs.pretrain", ["--config", TINY, "--data", str(c), *storage, "--name", "fresh"], f"--data {c}/shards"),
        ("jobs.pretrain", ["--config", TINY, "--data", str(c / "shards"), *storage, "--name", "a/b"], "--name 'a/b'"),
        ("jobs.pretrain", ["--config", TINY, "--data", str(c / "shards"), "--storage", str(c), "--name", "x"],
         f"--storage {c} holds a curated output"),
        ("jobs.pretrain", ["--config", TINY, "--data", str(c / "shards"), "--storage", str(base), "--name", "curated"],
         f"the run folder {c} holds a curated output"),
        ("jobs.finetune", ["--task", "seg", "--config", TINY_SEG, "--data", str(base / "synthetic"),
                           "--storage", str(base), "--name", "curated"], f"the run folder {c} holds a curated output"),
        # a copy of a training run is no curation output: refused before Ray starts
        ("jobs.curate", ["--config", LITE, "--input", str(f["pool"]), "--output", str(run)],
         f"--output {run} holds a training run"),
        ("jobs.curate", ["--config", LITE, "--input", str(f["pool"]), "--output", str(c / "shards")],
         f"--output {c}/shards holds the shards folder of a curated output"),
        ("jobs.curate", ["--config", LITE, "--input", str(f["pool"]), "--output", str(base / "new"), "--phases",
                         "dedup,sample,write"], "phase dedup needs phase score"),
        ("jobs.export", ["--shards", str(c), "--format", "webdataset", "--output", str(base / "wds")],
         f"pass --shards {c}/shards"),
        ("jobs.export", ["--shards", str(c / "shards"), "--format", "webdataset", "--output", str(c)],
         f"--output {c} holds a curated output"),
        ("jobs.export", ["--shards", str(c / "shards"), "--format", "webdataset", "--output", str(base / "wds"),
                         "--samples-per-tar", "0"], "--samples-per-tar must be at least 1"),
        ("jobs.audit", [str(base / "missing"), "--report"], f"no such folder: {base}/missing"),
        ("jobs.audit", [str(run), "--report"], f"the output {run} holds a training run"),
    ]  # fmt: skip


MAINS = {"jobs.audit": audit, "jobs.curate": curate, "jobs.export": export, "jobs.finetune": finetune,
         "jobs.pretrain": pretrain}  # fmt: skip


def test_a_refused_command_writes_nothing(folders, capsys):
    before = _tree(folders["base"])
    for job, argv, message in _refusals(folders):
        assert MAINS[job].main(argv) == 2, (job, argv)
        captured = capsys.readouterr()
        errors = captured.err.strip().splitlines()
        assert len(errors) == 1 and errors[0].startswith("error: ") and message in errors[0], (job, argv, errors)
        assert "[curate] profile=" not in captured.out  # refused before Ray started
        assert _tree(folders["base"]) == before, (job, argv)  # not one file or folder created, changed or removed


def _commands(text: str) -> list[list[str]]:
    """The ``python -m jobs.X ...`` commands a job's closing lines name."""
    return [shlex.split(line[line.index("python -m") :]) for line in text.splitlines() if "python -m jobs." in line]


def _parse(command: list[str]) -> object:
    assert command[:2] == ["python", "-m"], command
    return PARSERS[command[2]](command[3:])  # argparse exits on anything it does not accept


def test_curate_ends_with_where_the_results_are_and_valid_next_commands(folders, ray_local, capsys):
    out = folders["curated"]
    argv = ["--config", LITE, "--input", str(folders["pool"]), "--output", str(out), "write.rows_per_shard=4"]
    assert curate.main(argv) == 0  # everything committed: a resume that only reads the ledger
    printed = capsys.readouterr().out
    tail = printed[printed.index("[curate] summary") :]
    for place in (f"{out}/shards/", f"{out}/final_ledger/", f"{out}/README.md", f"{out}/report/index.html"):
        assert place in tail
    commands = {c[2]: _parse(c) for c in _commands(tail)}
    assert set(commands) == {"jobs.audit", "jobs.pretrain", "jobs.export"}
    assert commands["jobs.audit"].output == str(out) and commands["jobs.audit"].overrides == ["write.rows_per_shard=4"]
    assert commands["jobs.pretrain"].data == commands["jobs.export"].shards == str(out / "shards")
    assert commands["jobs.pretrain"].storage == str(folders["base"] / "runs")


def test_curate_after_the_score_phase_alone_names_the_phases_left(folders):
    args = curate.parse_args(
        ["--config", LITE, "--input", str(folders["pool"]), "--output", str(folders["base"] / "o")]
    )
    where, commands = curate.next_commands(args, Output.at(args.output))
    assert [label for label, _ in where] == ["ledger"]
    [command] = commands
    assert _parse(command).phases == "dedup,sample,write"


@pytest.mark.parametrize("size", ["tiny", "0.1b"])
def test_pretrain_next_commands_are_valid_and_use_the_exported_backbone(size, tmp_path):
    args = pretrain.parse_args(["--config", TINY, "--data", "d", "--storage", str(tmp_path / "runs"), "--name", "r"])
    cfg = load_config(PretrainConfig, TINY, [f"model.size={size}"])
    commands = {c[2]: _parse(c) for c in pretrain.next_commands(cfg, args)}
    backbone = str(tmp_path / "runs" / "r" / "backbone.safetensors")
    assert commands["jobs.probe"].backbone == commands["jobs.finetune"].backbone == backbone
    assert commands["jobs.finetune"].storage == str(tmp_path / "runs")
    assert commands["jobs.finetune"].data == commands["jobs.probe"].data == str(tmp_path / "synthetic")
    # the fine-tuning config's model is made the backbone's where they differ
    finetune_cfg = load_config(FinetuneConfig, TINY_SEG, commands["jobs.finetune"].overrides)
    assert (finetune_cfg.model.size, finetune_cfg.model.patch_size) == (size, cfg.model.patch_size)
