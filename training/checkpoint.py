"""Sharded training checkpoints (torch distributed checkpoint), shared by pretraining and fine-tuning.

Layout of a run directory (local path or object store)::

    <run>/checkpoints/step_000001000/   .metadata + __<rank>_0.distcp   DCP shards of model and optimiser
                                        rng/rank-00000.pt               each rank's RNG states
                                        commit.json                     written last: step, the loop's state, config

A checkpoint counts only once ``commit.json`` exists. It is written by rank 0 after ``dcp.save`` returned, and
``dcp.save`` returns on every rank only after the coordinator wrote ``.metadata``, i.e. after every shard is
complete; ``write_json_atomic`` moves it into place from a temporary name. Directories without it (a save that a
preemption cut short) are removed before training resumes. A committed checkpoint newer than the one Ray Train
hands back (Ray lost a killed worker's report, or the driver died, before registering it) is complete: the
worker resumes from it and reports it again (``training/worker.py``).

Retention (the last K): checkpoints reported to Ray Train in place (``CheckpointUploadMode.NO_UPLOAD``, pretraining)
are Ray's to delete (``CheckpointConfig(num_to_keep=K)``); deleting them here as well would leave Ray's run snapshot
pointing at missing folders, which Ray refuses to restore from. Checkpoints never reported (fine-tuning) are pruned
with ``keep_newest``.

Loading is ``weights_only`` throughout: DCP reads tensors that way, and ``SafeLoadPlanner`` makes the non-tensor
entries (optimiser hyper-parameters) load that way too instead of DCP's default full unpickling. DCP reshards on
load, so a checkpoint written by N workers loads into M.

Object stores (``s3://...``) go through the project's pyarrow filesystems (``_PyArrowFileSystem``), with reads
buffered so that small tensors do not cost a request each.
"""

from __future__ import annotations

import io
import json
import os
import random
import struct
import time
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from common import storage

CHECKPOINTS = "checkpoints"
COMMIT_FILE = "commit.json"
READ_BUFFER = 16 << 20  # bytes per ranged read from an object store


class CheckpointError(RuntimeError):
    """A checkpoint is incomplete or does not fit the model; the message names it."""


def step_uri(run_uri: str, step: int) -> str:
    return storage.join(run_uri, CHECKPOINTS, f"step_{step:09d}")


def step_of(uri: str) -> int:
    return int(storage.basename(uri).removeprefix("step_"))


def _rank_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


class _PyArrowFileSystem(FileSystemBase):
    """DCP's file operations on the project's pyarrow filesystems (``common.storage``): object stores need no
    extra fsspec backend and use the same credentials and endpoints as Ray Train and the rest of the project."""

    def init_path(self, path: str | os.PathLike) -> str:
        self.fs, fs_path = storage.resolve(str(path))
        return fs_path

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" in mode:
            with self.fs.open_output_stream(str(path)) as stream:  # uploaded in parts as it fills
                yield stream
        else:
            # DCP reads each tensor with a seek and a read; buffered, neighbouring small tensors share one
            # ranged GET instead of costing one request each.
            with io.BufferedReader(self.fs.open_input_file(str(path)), buffer_size=READ_BUFFER) as stream:
                yield stream

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str:
        return storage.join(str(path), suffix)

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.fs.move(str(path), str(new_path))

    def mkdir(self, path: str | os.PathLike) -> None:
        self.fs.create_dir(str(path), recursive=True)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return "://" in str(checkpoint_id)

    def exists(self, path: str | os.PathLike) -> bool:
        return storage.exists(self.fs, str(path))

    def rm_file(self, path: str | os.PathLike) -> None:
        self.fs.delete_file(str(path))


def _writer(uri: str) -> dcp.StorageWriter:
    """Local paths: DCP's own writer (fsync'd files); object stores: the same writer on ``_PyArrowFileSystem``
    (an upload is durable once closed)."""
    if "://" not in uri:
        return dcp.FileSystemWriter(storage.resolve(uri)[1])
    writer = dcp.FileSystemWriter(uri, sync_files=False)
    # torch types fs by inference as its local FileSystem; DCP takes any FileSystemBase (as its fsspec writer does)
    writer.fs = _PyArrowFileSystem()  # type: ignore[assignment]
    writer.path = writer.fs.init_path(uri)
    return writer


def storage_reader(uri: str) -> dcp.StorageReader:
    """DCP's reader of the checkpoint at ``uri``, on the filesystem ``_writer`` wrote it with."""
    if "://" not in uri:
        return dcp.FileSystemReader(storage.resolve(uri)[1])
    reader = dcp.FileSystemReader(uri)
    # torch types fs by inference as its local FileSystem; DCP takes any FileSystemBase (as its fsspec reader does)
    reader.fs = _PyArrowFileSystem()  # type: ignore[assignment]
    reader.path = reader.fs.init_path(uri)
    return reader


class SafeLoadPlanner(DefaultLoadPlanner):
    """DCP's default planner, but non-tensor entries are unpickled with ``weights_only=True`` like the tensors."""

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        # Unpickle restricted to plain data; the parent then stores it (it re-reads bytes we made from that data).
        safe = io.BytesIO()
        torch.save(torch.load(value, weights_only=True), safe)
        safe.seek(0)
        super().load_bytes(read_item, safe)


# --- RNG --------------------------------------------------------------------------------------------------------


def _rng_state() -> dict:
    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


# --- save / load --------------------------------------------------------------------------------------------------


def save(uri: str, model: nn.Module, optimizer: torch.optim.Optimizer, train_state: dict) -> None:
    """Every rank calls this; returns once the checkpoint at ``uri`` is committed."""
    fs, path = storage.resolve(uri)
    rank, world = _rank_world()
    buf = io.BytesIO()
    torch.save(_rng_state(), buf)
    storage.write_bytes_atomic(fs, storage.join(path, "rng", f"rank-{rank:05d}.pt"), buf.getvalue())
    model_sd, optim_sd = get_state_dict(model, optimizer)
    # Returns on each rank after the coordinator has written .metadata, so all shards (and RNG files) exist.
    dcp.save({"model": model_sd, "optim": optim_sd}, storage_writer=_writer(uri))
    if rank == 0:
        commit = {**train_state, "world_size": world, "committed_at": time.time()}
        storage.write_json_atomic(fs, storage.join(path, COMMIT_FILE), commit)
    if world > 1:
        dist.barrier()


def read_commit(uri: str) -> dict:
    fs, path = storage.resolve(uri)
    commit = storage.join(path, COMMIT_FILE)
    if not storage.exists(fs, commit):
        raise CheckpointError(f"checkpoint {uri} has no {COMMIT_FILE}: it was never completed")
    return storage.read_json(fs, commit)


def load(uri: str, model: nn.Module, optimizer: torch.optim.Optimizer) -> dict:
    """Load model and optimiser (resharding as needed) and, at the same world size, this rank's RNG states.

    Returns the commit record (step, data position, config, ...).
    """
    commit = read_commit(uri)
    model_sd, optim_sd = get_state_dict(model, optimizer)
    state: dict[str, Any] = {"model": model_sd, "optim": optim_sd}  # dcp.load's state dict type
    dcp.load(state, storage_reader=storage_reader(uri), planner=SafeLoadPlanner())
    set_state_dict(model, optimizer, model_state_dict=state["model"], optim_state_dict=state["optim"])
    rank, world = _rank_world()
    if commit["world_size"] == world:  # other world sizes draw fresh streams (the data order does not depend on it)
        fs, path = storage.resolve(uri)
        with fs.open_input_stream(storage.join(path, "rng", f"rank-{rank:05d}.pt")) as f:
            _set_rng_state(torch.load(io.BytesIO(f.read()), weights_only=True))
    return commit


def list_checkpoints(run_uri: str) -> list[tuple[int, str, bool]]:
    """(step, uri, committed) of every checkpoint folder of the run, oldest first."""
    fs, run = storage.resolve(run_uri)
    root = storage.join(run, CHECKPOINTS)
    if not storage.exists(fs, root):
        return []
    out = []
    for info in fs.get_file_info(pafs.FileSelector(root)):
        name = info.base_name
        if info.type != pafs.FileType.Directory or not name.startswith("step_") or not name[5:].isdigit():
            continue
        uri = storage.join(run_uri, CHECKPOINTS, name)
        out.append((int(name[5:]), uri, storage.exists(fs, storage.join(info.path, COMMIT_FILE))))
    return sorted(out)


def latest_committed(run_uri: str) -> str | None:
    done = [uri for _, uri, committed in list_checkpoints(run_uri) if committed]
    return done[-1] if done else None


def remove_stale(run_uri: str, resumed_step: int | None) -> list[str]:
    """Delete checkpoint folders that are uncommitted or newer than the checkpoint the run resumes from."""
    fs, _ = storage.resolve(run_uri)
    stale = [
        uri
        for step, uri, committed in list_checkpoints(run_uri)
        if not committed or resumed_step is None or step > resumed_step
    ]
    for uri in stale:
        storage.delete_quietly(fs, storage.resolve(uri)[1])
    return stale


def keep_newest(run_uri: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoint folders (only for checkpoints Ray Train does not track)."""
    fs, _ = storage.resolve(run_uri)
    for _, uri, _ in list_checkpoints(run_uri)[:-keep]:
        storage.delete_quietly(fs, storage.resolve(uri)[1])


# --- safetensors ----------------------------------------------------------------------------------------------


def read_safetensors(uri: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file (local or object store); no pickle involved."""
    from safetensors.torch import load as st_load

    fs, path = storage.resolve(uri)
    with fs.open_input_stream(path) as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    return st_load(data), meta
