"""Object-store calls retried with jittered exponential backoff up to a limit, their retries and throttling answers
counted (and reported by the score phase), permanent errors raised at once.

The S3 tests put a small HTTP proxy between pyarrow and a local moto server: it answers chosen requests as a throttling
S3 does (``503 SlowDown``) or refuses them (``403 AccessDenied``) and forwards the rest. pyarrow's S3 client retries a
throttled request itself first (about 30 times over 6 s), so a throttle reaches the project's retries only when it
outlasts those.
"""

from __future__ import annotations

import gzip
import http.client
import http.server
import io
import json
import threading
from collections.abc import Callable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from conftest import moto_s3
from PIL import Image

from common import schema, storage
from common.config import load_config
from common.layout import LAYOUT
from common.storage import RetriesExhausted, RetryPolicy, io_counts, retry_io, retry_io_stream
from curation.config import CurateConfig
from curation.score.chain import read_shards
from curation.score.ledger import read_ledger
from curation.score.pool import Pool, list_shards
from jobs import curate

REPO = Path(__file__).resolve().parents[2]
LITE = str(REPO / "configs/curate/lite.yaml")
FAST = [  # the stages these tests do not need
    "stages.person.enabled=false",
    "stages.head_pose.enabled=false",
    "stages.quality.enabled=false",
    "stages.text_overlay.enabled=false",
    "stages.nsfw.enabled=false",
]
SLOW_DOWN = "AWS Error SLOW_DOWN during GetObject operation: Please reduce your request rate."


def _delta(before: dict[str, int]) -> dict[str, int]:
    return {k: v - before[k] for k, v in io_counts().items()}


# --- the policy, without a store -------------------------------------------------------------------------------


def test_backoff_doubles_from_the_base_up_to_the_cap_with_full_jitter(monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr("common.storage.time.sleep", pauses.append)
    monkeypatch.setattr("common.storage.random.uniform", lambda lo, hi: hi)  # the top of each draw
    calls = []

    def throttled_five_times() -> str:
        calls.append(1)
        if len(calls) <= 5:
            raise OSError(SLOW_DOWN)
        return "read"

    before = io_counts()
    assert retry_io(throttled_five_times, RetryPolicy(5, base_s=0.2, cap_s=1.0), "reading x") == "read"
    assert pauses == pytest.approx([0.2, 0.4, 0.8, 1.0, 1.0])
    assert _delta(before) == {"io_retries": 5, "io_throttles": 5}
    monkeypatch.undo()
    draws = [RetryPolicy(base_s=0.2, cap_s=1.0).delay(3) for _ in range(200)]  # full jitter: anywhere in [0, 1.0]
    assert all(0.0 <= d <= 1.0 for d in draws) and min(draws) < 0.2 and max(draws) > 0.8


def test_a_permanent_error_is_raised_at_once_and_spent_retries_name_the_call(monkeypatch):
    pauses: list[float] = []
    monkeypatch.setattr("common.storage.time.sleep", pauses.append)
    before = io_counts()
    for permanent in (
        FileNotFoundError("bkt/gone.jpg"),
        PermissionError("/pool/locked.jpg"),
        OSError("When reading 'bkt/x': AWS Error ACCESS_DENIED during GetObject operation: Access Denied"),
        gzip.BadGzipFile("Not a gzipped file"),  # an OSError about the bytes, not the store
    ):

        def fail(exc: OSError = permanent) -> None:
            raise exc

        with pytest.raises(type(permanent)) as raised:
            retry_io(fail, 3, "reading x")
        assert raised.value is permanent
    assert not pauses and _delta(before) == {"io_retries": 0, "io_throttles": 0}

    last = OSError("AWS Error UNKNOWN (HTTP status 503) during HeadObject operation: No response body.")

    def unavailable() -> None:
        raise last

    with pytest.raises(RetriesExhausted) as raised:
        retry_io(unavailable, RetryPolicy(2, 0.01, 0.01), "reading s3://bkt/pool/a.jpg")
    message = str(raised.value)
    assert message.startswith("reading s3://bkt/pool/a.jpg failed 3 times in a row (the store kept throttling it)")
    assert "HTTP status 503" in message and "ray.io_retries=2" in message and raised.value.__cause__ is last
    assert isinstance(raised.value, OSError) and len(pauses) == 2
    assert _delta(before) == {"io_retries": 2, "io_throttles": 3}


def test_a_stream_gets_its_retries_afresh_after_each_new_item(monkeypatch):
    monkeypatch.setattr("common.storage.time.sleep", lambda s: None)
    opened = []

    def stream():  # each opening fails once right after the item it is the first to reach
        opened.append(1)
        for i in range(4):
            yield i
            if i == len(opened) - 1:
                raise ConnectionResetError("connection reset by peer")

    assert list(retry_io_stream(stream, 1, "reading a shard")) == [0, 1, 2, 3] and len(opened) == 5

    def stuck():
        yield 0
        raise TimeoutError("timed out")

    with pytest.raises(RetriesExhausted, match="reading a stuck shard failed 2 times in a row"):
        list(retry_io_stream(stuck, 1, "reading a stuck shard"))


# --- through a local S3 that throttles ----------------------------------------------------------------------------


class StoreProxy:
    """An HTTP proxy on 127.0.0.1 in front of an S3 endpoint: ``answer(method, path)`` gives ``(status, code,
    message)`` for a request to answer with an S3 error instead of forwarding it, or None."""

    def __init__(self, upstream: str, answer: Callable[[str, str], tuple[int, str, str] | None]):
        host, port = upstream.split(":")
        self.answered: list[tuple[str, str]] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"  # keep-alive, as the S3 client expects

            def log_message(self, *args) -> None:
                pass

            def handle_one(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                error = answer(self.command, self.path)
                if error is not None:
                    proxy.answered.append((self.command, self.path))
                    status, code, text = error
                    xml = f"<?xml version='1.0' encoding='UTF-8'?><Error><Code>{code}</Code><Message>{text}</Message></Error>"
                    self.reply(status, [("Content-Type", "application/xml")], xml.encode())
                    return
                upstream = http.client.HTTPConnection(host, int(port), timeout=30)
                try:
                    upstream.request(self.command, self.path, body=body, headers=dict(self.headers.items()))
                    response = upstream.getresponse()
                    headers = [(k, v) for k, v in response.getheaders() if k.lower() not in _HOP_BY_HOP]
                    self.reply(response.status, headers, response.read(), response.getheader("Content-Length"))
                finally:
                    upstream.close()

            def reply(self, status: int, headers: list, data: bytes, length: str | None = None) -> None:
                self.send_response(status)
                for k, v in headers:
                    self.send_header(k, v)
                # a HEAD answer carries the object's length and no body
                self.send_header("Content-Length", length if self.command == "HEAD" and length else str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = do_DELETE = handle_one

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def query(self) -> str:
        return f"?endpoint_override=127.0.0.1:{self.server.server_address[1]}&scheme=http&region=us-east-1"

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


_HOP_BY_HOP = {"connection", "keep-alive", "transfer-encoding", "content-length"}
THROTTLE = (503, "SlowDown", "Please reduce your request rate.")


@pytest.fixture(scope="module")
def store():
    """A local S3 (moto) with bucket ``bkt``: ``(filesystem, host:port)``."""
    with moto_s3("bkt") as (fs, endpoint):
        yield fs, endpoint


@pytest.fixture
def proxy_to(store):
    proxies: list[StoreProxy] = []

    def make(answer: Callable[[str, str], tuple[int, str, str] | None]) -> StoreProxy:
        proxies.append(StoreProxy(store[1], answer))
        return proxies[-1]

    yield make
    for p in proxies:
        p.close()


def _photo(seed: int) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (480, 400), (seed * 40 % 256, 90, 160)).save(buf, "JPEG")
    return buf.getvalue()


def _read_once(uri: str) -> bytes:
    fs, path = storage.resolve(uri)
    with fs.open_input_stream(path) as f:
        return f.read()


def test_a_throttle_outlasting_the_s3_clients_retries_is_retried_and_counted(store, proxy_to):
    fs, _ = store
    with fs.open_output_stream("bkt/data/x.bin") as f:
        f.write(b"payload" * 100)
    before = io_counts()
    # throttled until the project's retries have seen it: pyarrow's own retries give up first
    proxy = proxy_to(lambda method, path: THROTTLE if "x.bin" in path and io_counts() == before else None)
    uri = f"s3://test:test@bkt/data/x.bin{proxy.query()}"
    data = retry_io(lambda: _read_once(uri), RetryPolicy(3, 0.01, 0.05), f"reading {storage.redact(uri)}")
    assert data == b"payload" * 100
    assert _delta(before) == {"io_retries": 1, "io_throttles": 1}
    assert len(proxy.answered) > 1  # the S3 client had retried the request itself before giving up


@pytest.mark.slow  # two reads that each outlast the S3 client's own retries
def test_a_store_that_keeps_throttling_stops_the_call_naming_the_file(store, proxy_to):
    fs, _ = store
    with fs.open_output_stream("bkt/data/y.bin") as f:
        f.write(b"y" * 4096)
    proxy = proxy_to(lambda method, path: THROTTLE if "y.bin" in path else None)
    uri = f"s3://test:test@bkt/data/y.bin{proxy.query()}"
    with pytest.raises(RetriesExhausted) as raised:
        retry_io(lambda: _read_once(uri), RetryPolicy(1, 0.01, 0.01), f"reading {storage.redact(uri)}")
    message = str(raised.value)
    assert message.startswith("reading s3://bkt/data/y.bin failed 2 times in a row (the store kept throttling it)")
    assert "test:test" not in message and "allow more retries (ray.io_retries=1)" in message


def test_a_refusal_is_raised_at_once(store, proxy_to):
    fs, _ = store
    with fs.open_output_stream("bkt/data/z.bin") as f:
        f.write(b"z" * 4096)
    proxy = proxy_to(lambda method, path: (403, "AccessDenied", "Access Denied") if "z.bin" in path else None)
    uri = f"s3://test:test@bkt/data/z.bin{proxy.query()}"
    before = io_counts()
    with pytest.raises(OSError) as raised:
        retry_io(lambda: _read_once(uri), 3, "reading z")
    assert not isinstance(raised.value, RetriesExhausted) and "ACCESS_DENIED" in str(raised.value)
    assert _delta(before) == {"io_retries": 0, "io_throttles": 0}


def test_a_throttled_pool_file_is_read_again_not_recorded_unreadable(store, proxy_to):
    """The score phase's reader: a throttle that outlasts the S3 client is retried, the input's row holds its
    bytes, and the chunk carries the retry for the shard's commit record."""
    fs, _ = store
    for name in ("a.jpg", "b.jpg"):
        with fs.open_output_stream(f"bkt/pool1/{name}") as f:
            f.write(_photo(len(name) + ord(name[0])))
    before = io_counts()
    proxy = proxy_to(
        lambda method, path: THROTTLE if method == "GET" and path.endswith("b.jpg") and io_counts() == before else None
    )
    pool = f"s3://test:test@bkt/pool1{proxy.query()}"
    cfg = load_config(CurateConfig, LITE, [*FAST, "ray.io_backoff_s=0.01"])
    (shard,) = list_shards(Pool.at(pool), cfg.input)
    batch = pa.Table.from_pylist([shard.to_row()])
    table = pa.concat_tables(read_shards(batch, cfg.model_dump_json(), pool))
    rows = table.to_pylist()
    assert sorted(r["source"] for r in rows) == ["s3://bkt/pool1/a.jpg", "s3://bkt/pool1/b.jpg"]
    assert all(r["image"] is not None and r["reason"] is None for r in rows), [r["reason"] for r in rows]
    assert sum(table.column("_io_retries").to_pylist()) == 1 and sum(table.column("_io_throttles").to_pylist()) == 1
    assert proxy.answered


def _gets_the_client_absorbs(fs, proxy_to) -> int:
    """How many throttled answers to one GET pyarrow's S3 client takes before it raises."""
    with fs.open_output_stream("bkt/probe/p.bin") as f:
        f.write(b"p" * 4096)  # larger than the error's body, which the client reads into the object's buffer
    proxy = proxy_to(lambda method, path: THROTTLE if method == "GET" and "p.bin" in path else None)
    with pytest.raises(OSError) as raised:
        _read_once(f"s3://test:test@bkt/probe/p.bin{proxy.query()}")
    assert storage.is_throttled(raised.value), raised.value
    return len(proxy.answered)


@pytest.mark.slow  # a score phase on Ray behind a throttling store
def test_the_score_phase_reports_its_retries_and_throttles(store, proxy_to, ray_local, tmp_path, capsys):
    """Retries in the Ray workers reach the shard's commit record, the phase's done record and its console line."""
    fs, _ = store
    absorbed = _gets_the_client_absorbs(fs, proxy_to)
    for name in ("a.jpg", "b.jpg"):
        with fs.open_output_stream(f"bkt/pool2/{name}") as f:
            f.write(_photo(ord(name[0])))
    answered = []

    def throttle(method: str, path: str):  # one throttle more than the client takes: one retry of the project's
        if method == "GET" and path.endswith("a.jpg") and len(answered) <= absorbed:
            answered.append(path)
            return THROTTLE
        return None

    proxy = proxy_to(throttle)
    out = tmp_path / "out"
    args = ["--config", LITE, "--input", f"s3://test:test@bkt/pool2{proxy.query()}", "--output", str(out)]
    capsys.readouterr()
    assert curate.main([*args, "--phases", "score", *FAST, "ray.io_backoff_s=0.01"]) == 0
    done = json.loads((out / LAYOUT.done("score")).read_text())
    assert (done["io_retries"], done["io_throttles"]) == (1, 1), done
    (commit,) = [json.loads(p.read_text())["receipt"] for p in (out / LAYOUT.score_commits).glob("*.json")]
    assert (commit["io_retries"], commit["io_throttles"]) == (1, 1)
    assert "; 1 I/O retries (1 throttled by the store)" in capsys.readouterr().out
    ledger = read_ledger(str(out), ["source", "status", "reason"]).to_pylist()
    assert sorted(r["source"] for r in ledger) == ["s3://bkt/pool2/a.jpg", "s3://bkt/pool2/b.jpg"]
    assert not any((r["reason"] or "").startswith("unreadable") for r in ledger), ledger
    assert len(answered) == absorbed + 1


def _columns(data: bytes) -> dict[str, object]:
    group = pq.ParquetFile(pa.BufferReader(data)).metadata.row_group(0)
    return {group.column(i).path_in_schema: group.column(i) for i in range(group.num_columns)}


def test_a_file_rewritten_with_the_options_read_from_it_has_the_same_bytes():
    rows = 12
    table = pa.table(
        {
            "key": [f"{i:064x}" for i in range(rows)],
            "source": [f"img-{i}.jpg" for i in range(rows)],
            "shard_id": ["files-000000"] * rows,
            "format": ["JPEG", "PNG"] * (rows // 2),
            "image": pa.array([{"bytes": bytes([i]) * 50, "path": f"{i}.jpg"} for i in range(rows)], schema.IMAGE_TYPE),
            "persons": pa.array([[{"x0": 0.1 * i, "score": 0.5}] for i in range(rows)]),
            "embedding": pa.array([[float(i)] * 4 for i in range(rows)], pa.list_(pa.float32(), 4)),
        }
    )
    shard = {"row_group_size": 4, "compression": "snappy", "use_dictionary": False, "write_statistics": ["source"]}
    for options in ({"row_group_size": 5}, shard):
        data = storage.encode_parquet(table, **options)
        again = storage.encode_parquet(
            table, **storage.parquet_options_like(pq.ParquetFile(pa.BufferReader(data)).metadata)
        )
        assert again == data

    columns = _columns(storage.encode_parquet(table, **shard))
    assert {c.compression for c in columns.values()} == {"SNAPPY"}
    assert not any(c.has_dictionary_page for c in columns.values())
    assert [path for path, c in columns.items() if c.is_stats_set] == ["source"]
    # by default, a dictionary for the columns whose values repeat, none for those distinct in every row
    columns = _columns(storage.encode_parquet(table, row_group_size=rows))
    assert {path for path, c in columns.items() if c.has_dictionary_page} == {
        "shard_id", "format", "persons.list.element.x0", "persons.list.element.score"
    }  # fmt: skip
