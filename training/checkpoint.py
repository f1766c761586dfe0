"""Sharded training checkpoints (torch distributed checkpoint), shared by pretraining and fine-tuning.

Layout of a run directory (local path or object store)::

    <run>/checkpoints/step_000001000/   .metadata + __<rank>_0.distcp   DCP shards of model and optimiser
                                        rng/rank-00000.pt               each rank's RNG states
                                        commit.json                     written last: step, the loop's state, config

A checkpoint counts only once ``commit.json`` exists. It is written by rank 0 after ``dcp.save`` returned, and
``dcp.save`` returns on every rank only after the coordinator wrote ``.metadata``, i.e. after every shard is
complete; ``write_json_atomic`` moves it into place from a temporary name. Directories without it (a save that a
preemption cut short) are removed before training resumes. An async save (``AsyncSaver``) stages the state in host
memory and writes it from a thread while training goes on; its commit record is written the same way, at the first
step at which every rank's write has returned.

A committed checkpoint is verified before it is trusted: the commit record lists every file with its size and CRC-32,
taken as the bytes went out (``_Digesting``: no second read); ``verify`` compares them with one listing of the folder
and reads the files back, each rank a share, before a load. One that fails (a torn or overwritten shard, a missing
``.metadata``) is renamed ``damaged-step_...`` (``set_aside``, never deleted) and the next newest is tried. The cost at
1B-image scale: a resume reads the checkpoint twice (0.4B model: ~7 GB over all ranks), a save reads nothing extra.

Retention (the last K) is the project's (``keep_newest``), for pretraining and fine-tuning alike: checkpoints are not
registered with Ray Train, whose run snapshot would then name a folder set aside, and Ray refuses to restore a run
whose snapshot names a missing folder.

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
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, cast

import pyarrow.fs as pafs
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystemBase
from torch.distributed.checkpoint.planner import ReadItem
from torch.distributed.checkpoint.staging import BlockingAsyncStager
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

from common import storage
from training import failures
from training.failures import Permanent

CHECKPOINTS = "checkpoints"
COMMIT_FILE = "commit.json"
SET_ASIDE = "damaged-"  # the prefix of a checkpoint folder set aside (``set_aside``)
READ_BUFFER = 16 << 20  # bytes per ranged read from an object store


class CheckpointError(Permanent, RuntimeError):
    """A checkpoint is incomplete, damaged or does not fit the model; the message names it."""


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


class _DigestStream:
    """A write stream that counts and CRC-32s the bytes it passes on (everything else is the wrapped stream's)."""

    def __init__(self, inner: io.IOBase) -> None:
        self.inner, self.bytes, self.crc32 = inner, 0, 0

    def write(self, data) -> int | None:
        view = memoryview(data)
        self.bytes += view.nbytes
        self.crc32 = zlib.crc32(view.cast("B"), self.crc32)
        return self.inner.write(data)

    def __getattr__(self, name: str):
        return getattr(self.inner, name)


class _Digesting(FileSystemBase):
    """A DCP filesystem that records each file it writes as ``{name: {"bytes", "crc32"}}`` in ``written`` (names
    relative to the checkpoint folder; a renamed file under its new name), for the commit record."""

    def __init__(self, inner: FileSystemBase) -> None:
        self.inner = inner
        self.written: dict[str, dict[str, int]] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        if "w" not in mode:
            with self.inner.create_stream(path, mode) as stream:
                yield stream
            return
        with self.inner.create_stream(path, mode) as stream:
            digest = _DigestStream(stream)
            yield digest  # type: ignore[misc]  # a stream by duck typing, as DCP uses it
        self.written[os.path.basename(str(path))] = {"bytes": digest.bytes, "crc32": digest.crc32}

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        self.inner.rename(path, new_path)
        if (old := os.path.basename(str(path))) in self.written:
            self.written[os.path.basename(str(new_path))] = self.written.pop(old)

    def concat_path(self, path: str | os.PathLike, suffix: str) -> str | os.PathLike:
        return self.inner.concat_path(path, suffix)

    def init_path(self, path: str | os.PathLike) -> str | os.PathLike:
        return self.inner.init_path(path)

    def mkdir(self, path: str | os.PathLike) -> None:
        self.inner.mkdir(path)

    @classmethod
    def validate_checkpoint_id(cls, checkpoint_id: str | os.PathLike) -> bool:
        return True

    def exists(self, path: str | os.PathLike) -> bool:
        return self.inner.exists(path)

    def rm_file(self, path: str | os.PathLike) -> None:
        self.inner.rm_file(path)


def _writer(uri: str) -> dcp.FileSystemWriter:
    """Local paths: DCP's own writer (fsync'd files); object stores: the same writer on ``_PyArrowFileSystem``
    (an upload is durable once closed). Either digests what it writes (``_Digesting``)."""
    if "://" not in uri:
        writer = dcp.FileSystemWriter(storage.resolve(uri)[1])
    else:
        writer = dcp.FileSystemWriter(uri, sync_files=False)
        # torch types fs by inference as its local FileSystem; DCP takes any FileSystemBase (as its fsspec writer does)
        writer.fs = _PyArrowFileSystem()  # type: ignore[assignment]
        writer.path = writer.fs.init_path(uri)
    writer.fs = _Digesting(writer.fs)  # type: ignore[assignment]
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


Summary = Callable[[dict, dist.ProcessGroup | None], dict]
"""The loop's commit-record entries computed from the checkpointed state dict (``{"model", "optim"}``) with
collectives on the given group: the live tensors after a blocking save, the staged copy off the step path after an
async one."""


def checkpointed(model: nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The state dict a checkpoint holds, ``{"model", "optim"}``: this rank's shards, keyed by parameter name."""
    model_sd, optim_sd = get_state_dict(model, optimizer)
    return {"model": model_sd, "optim": optim_sd}


def _write_rng(uri: str) -> dict[str, dict[str, int]]:
    """This rank's RNG states as a file of the checkpoint, written now; its entry of the commit record."""
    fs, path = storage.resolve(uri)
    buf = io.BytesIO()
    torch.save(_rng_state(), buf)
    name = f"rng/rank-{_rank_world()[0]:05d}.pt"
    storage.write_bytes_atomic(fs, storage.join(path, name), buf.getvalue())
    return {name: {"bytes": len(buf.getvalue()), "crc32": zlib.crc32(buf.getvalue())}}


@contextmanager
def _naming(uri: str) -> Iterator[None]:
    """A failed write's error, naming the checkpoint it was writing where the error itself names no file."""
    try:
        yield
    except (OSError, CheckpointException) as exc:
        found = failures.os_error(exc)
        if found is None or found.filename:
            raise
        raise OSError(found.errno, found.strerror or str(found), storage.redact(uri)) from exc


def _commit(uri: str, record: dict, mine: dict[str, dict[str, int]]) -> None:
    """Every rank, once its files of ``uri`` are durable: rank 0 writes the commit record listing every rank's files
    (``mine``: this rank's, with size and CRC-32); returns when it is written."""
    fs, path = storage.resolve(uri)
    rank, world = _rank_world()
    every: list[dict] = [mine]
    if world > 1:
        every = [{} for _ in range(world)]
        dist.all_gather_object(every, mine)
    if rank == 0:
        files = {name: digest for written in every for name, digest in written.items()}
        commit = {**record, "world_size": world, "committed_at": time.time(), "files": files}
        storage.write_json_atomic(fs, storage.join(path, COMMIT_FILE), commit)
    if world > 1:
        dist.barrier()


def save(
    uri: str, model: nn.Module, optimizer: torch.optim.Optimizer, record: dict, summary: Summary | None = None
) -> dict[str, float]:
    """Every rank calls this; returns once the checkpoint at ``uri`` is committed, with the seconds its write and
    summary took. The commit record is ``record`` and ``summary``'s entries, and lists every file with its size and
    CRC-32 (``verify``)."""
    started = time.perf_counter()
    state = checkpointed(model, optimizer)
    writer = _writer(uri)
    with _naming(uri):
        rng = _write_rng(uri)
        # Returns on each rank after the coordinator has written .metadata, so all shards (and RNG files) exist.
        dcp.save(state, storage_writer=writer)
    written = time.perf_counter()
    extra = summary(state, None) if summary else {}
    seconds = {"write_s": written - started, "summary_s": time.perf_counter() - written}
    _commit(uri, {**record, **extra}, {**writer.fs.written, **rng})  # type: ignore[attr-defined]
    return seconds


class _KeepingStager(BlockingAsyncStager):
    """DCP's blocking stager (a host copy; pinned and reused across saves when ``cache_staged_state_dict``) that
    keeps the copy it made, for the summary computed from it while training goes on."""

    staged: dict | None = None

    def stage(self, state_dict: dict) -> dict:
        self.staged = super().stage(state_dict)
        return self.staged


@dataclass
class _InFlight:
    uri: str
    record: dict
    rng: dict[str, dict[str, int]]
    writer: dcp.FileSystemWriter
    done: Future  # (summary entries, {"write_s", "summary_s"}) once every file of this rank is durable
    stage_s: float


class AsyncSaver:
    """Async checkpoints (``checkpoint.async_save``), at most one in flight. ``start`` stages the state in host
    memory and returns; DCP writes it from a thread, then the summary is computed on the staged copy there.
    ``commit`` (every rank, at the same step) waits for it and writes the commit record: a checkpoint counts only
    once every rank's files are durable, so a save cut short is never chosen (``latest_committed``).

    The background thread's collectives run on a gloo group of their own: the training's collectives on the
    default group (NCCL or gloo) never meet them, in whatever order the two threads reach theirs."""

    def __init__(self, pinned: bool) -> None:
        self.group: dist.ProcessGroup | None = None
        if dist.is_available() and dist.is_initialized():
            self.group = cast(dist.ProcessGroup, dist.new_group(backend="gloo"))  # every rank is in it
        self.stager = _KeepingStager(cache_staged_state_dict=pinned)
        self.thread = ThreadPoolExecutor(1, thread_name_prefix="checkpoint")
        self.in_flight: _InFlight | None = None

    def start(
        self, uri: str, model: nn.Module, optimizer: torch.optim.Optimizer, record: dict, summary: Summary | None
    ) -> None:
        if self.in_flight is not None:
            raise RuntimeError(f"a save of {storage.redact(self.in_flight.uri)} is still in flight: commit it first")
        started = time.perf_counter()
        writer = _writer(uri)
        with _naming(uri):
            rng = _write_rng(uri)
        upload = dcp.async_save(
            checkpointed(model, optimizer), storage_writer=writer, process_group=self.group, async_stager=self.stager
        )
        assert isinstance(upload, Future)  # a blocking stager: staged by now, only the upload pending
        staged, self.stager.staged = self.stager.staged, None
        stage_s = time.perf_counter() - started

        def finish() -> tuple[dict, dict[str, float]]:
            upload.result()
            written = time.perf_counter()
            extra = summary(staged, self.group) if summary and staged is not None else {}
            return extra, {"write_s": written - started, "summary_s": time.perf_counter() - written}

        self.in_flight = _InFlight(uri, record, rng, writer, self.thread.submit(finish), stage_s)

    def ready(self, device: torch.device) -> bool:
        """Whether the save in flight is done on every rank (a collective on the default group: every rank calls
        this at the same steps); False with none in flight."""
        if self.in_flight is None:
            return False
        done = torch.tensor([float(self.in_flight.done.done())], device=device)
        if _rank_world()[1] > 1:
            dist.all_reduce(done, op=dist.ReduceOp.MIN)
        return bool(done.item())

    def commit(self) -> tuple[str, dict, dict[str, float]]:
        """Wait for the save in flight (every rank) and commit it: its URI, commit record and seconds spent
        (``stage_s`` on the step path; ``write_s``, ``summary_s`` in the background). A failed write raises here."""
        if (flight := self.in_flight) is None:
            raise RuntimeError("no save in flight")
        self.in_flight = None
        with _naming(flight.uri):
            extra, seconds = flight.done.result()
        record = {**flight.record, **extra}
        _commit(flight.uri, record, {**flight.writer.fs.written, **flight.rng})  # type: ignore[attr-defined]
        return flight.uri, record, {"stage_s": flight.stage_s, **seconds}


def _crc32(fs: pafs.FileSystem, path: str) -> int:
    crc = 0
    with fs.open_input_stream(path) as f:
        while chunk := f.read(READ_BUFFER):
            crc = zlib.crc32(chunk, crc)
    return crc


def verify(uri: str, commit: dict, rank: int = 0, world: int = 1) -> list[str]:
    """What is wrong with the checkpoint at ``uri`` against its commit record, as ``<file>: <problem>``: every file
    listed, of the size written (one listing); the CRC-32 of every ``world``-th file from ``rank`` on read back. A
    record without a file list (written before there was one) needs DCP's ``.metadata``."""
    fs, path = storage.resolve(uri)
    files = commit.get("files")
    if files is None:
        return [] if storage.exists(fs, storage.join(path, ".metadata")) else [".metadata: missing"]
    found = {
        info.path[len(path.rstrip("/")) + 1 :]: info.size
        for info in fs.get_file_info(pafs.FileSelector(path, recursive=True))
        if info.type == pafs.FileType.File
    }
    problems = []
    for i, (name, written) in enumerate(sorted(files.items())):
        size = found.get(name)
        if size is None:
            problems.append(f"{name}: missing")
        elif size != written["bytes"]:
            problems.append(f"{name}: {size} bytes, {written['bytes']} were written")
        elif i % world == rank and _crc32(fs, storage.join(path, name)) != written["crc32"]:
            problems.append(f"{name}: its bytes differ from those written (CRC-32)")
    return problems


def set_aside(uri: str) -> str:
    """Move the checkpoint folder ``uri`` to ``damaged-<its name>-<time>`` beside it: kept, never deleted, no longer
    a checkpoint of the run. Returns the new folder's name."""
    fs, path = storage.resolve(uri)
    name = f"{SET_ASIDE}{storage.basename(uri)}-{time.time_ns()}"
    target = storage.join(os.path.dirname(path.rstrip("/")), name)
    if storage.is_local(fs):
        fs.move(path, target)
    else:  # an object store moves objects, not folders
        for info in fs.get_file_info(pafs.FileSelector(path, recursive=True)):
            if info.type == pafs.FileType.File:
                fs.move(info.path, target + info.path[len(path.rstrip("/")) :])
    return name


def set_aside_names(run_uri: str) -> list[str]:
    """The run's checkpoint folders set aside as damaged (``set_aside``), oldest first."""
    fs, run = storage.resolve(run_uri)
    root = storage.join(run, CHECKPOINTS)
    if not storage.exists(fs, root):
        return []
    infos = fs.get_file_info(pafs.FileSelector(root))
    return sorted(i.base_name for i in infos if i.base_name.startswith(SET_ASIDE))


def read_commit(uri: str) -> dict:
    fs, path = storage.resolve(uri)
    commit = storage.join(path, COMMIT_FILE)
    if not storage.exists(fs, commit):
        raise CheckpointError(f"checkpoint {uri} has no {COMMIT_FILE}: it was never completed")
    return storage.read_json(fs, commit)


def load(uri: str, model: nn.Module, optimizer: torch.optim.Optimizer, commit: dict | None = None) -> dict:
    """Load model and optimiser (resharding as needed) and, at the same world size, this rank's RNG states.

    Returns the commit record (step, data position, config, ...); ``commit``: the record, when already read.
    """
    commit = commit or read_commit(uri)
    state = checkpointed(model, optimizer)
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


def remove_uncommitted(run_uri: str) -> list[str]:
    """Delete the checkpoint folders a save left without a commit record (cut short; never used)."""
    fs, _ = storage.resolve(run_uri)
    stale = [uri for _, uri, committed in list_checkpoints(run_uri) if not committed]
    for uri in stale:
        storage.delete_quietly(fs, storage.resolve(uri)[1])
    return stale


def keep_newest(run_uri: str, keep: int) -> None:
    """Delete all but the newest ``keep`` checkpoint folders."""
    fs, _ = storage.resolve(run_uri)
    for _, uri, _ in list_checkpoints(run_uri)[:-keep]:
        storage.delete_quietly(fs, storage.resolve(uri)[1])


# --- safetensors ----------------------------------------------------------------------------------------------


SAFETENSORS_DTYPES = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16, "I64": torch.int64,
    "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8, "BOOL": torch.bool,
}  # fmt: skip


class SafetensorsFile:
    """A safetensors file (local or object store) read in parts: its header on opening, then only the rows of each
    tensor asked for, so a rank reads its own shard of a large file and nothing else."""

    def __init__(self, uri: str) -> None:
        fs, path = storage.resolve(uri)
        self.uri = storage.redact(uri)  # named in messages
        self._file = fs.open_input_file(path)
        try:
            size = self._file.size()
            (header_len,) = struct.unpack("<Q", self._file.read_at(8, 0)) if size >= 8 else (0,)
            if not 0 < header_len <= size - 8:  # a foreign file's first bytes: no allocation of that size
                raise ValueError(f"a header of {header_len} bytes in a file of {size}: not safetensors")
            header = json.loads(self._file.read_at(header_len, 8))
        except Exception:
            self._file.close()
            raise
        self.meta: dict[str, str] = header.pop("__metadata__", {})
        self.entries: dict[str, dict] = header  # name -> dtype, shape, data_offsets
        self._data = 8 + header_len

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.entries[name]["shape"])

    def read(self, name: str, rows: slice | None = None) -> torch.Tensor:
        """Tensor ``name``, or its ``rows`` (of the first dimension, steps of 1): one contiguous byte range."""
        entry = self.entries[name]
        shape, (begin, end) = self.shape(name), entry["data_offsets"]
        if rows is None or not shape:
            first, count = 0, shape[0] if shape else 1
        else:
            first, stop, _ = rows.indices(shape[0])
            count = max(stop - first, 0)
        row_bytes = (end - begin) // shape[0] if shape and shape[0] else end - begin
        dtype = SAFETENSORS_DTYPES[entry["dtype"]]
        out = torch.empty((count, *shape[1:]) if shape else (), dtype=dtype)
        if out.numel():
            self._file.seek(self._data + begin + first * row_bytes)
            got = self._file.readinto(out.view(-1).view(torch.uint8).numpy())  # straight into the tensor's memory
            if got != count * row_bytes:
                raise storage.StorageError(
                    f"{self.uri}: tensor {name} ends {count * row_bytes - got} bytes early: the file is cut short; copy "
                    "it again, or rerun the job that wrote it"
                )
        return out

    def close(self) -> None:
        self._file.close()

    def __enter__(self) -> SafetensorsFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def safetensors_meta(uri: str) -> dict[str, str]:
    """The metadata of a safetensors file, from its header alone."""
    with SafetensorsFile(uri) as f:
        return f.meta


def read_safetensors(uri: str) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """Tensors and metadata of a safetensors file (local or object store); no pickle involved."""
    from safetensors.torch import load as st_load

    fs, path = storage.resolve(uri)
    with fs.open_input_stream(path) as f:
        data = f.read()
    (header_len,) = struct.unpack("<Q", data[:8])
    meta = json.loads(data[8 : 8 + header_len]).get("__metadata__", {})
    return st_load(data), meta
