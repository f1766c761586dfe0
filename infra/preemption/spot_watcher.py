"""Watch this VM's cloud metadata for a spot interruption notice; when one comes, drain the Ray node.

    python infra/preemption/spot_watcher.py --cloud aws|gcp [--poll-s 5] [--margin-s 15]

- AWS: IMDSv2 `latest/meta-data/spot/instance-action` answers 404 until EC2 schedules the reclaim, then
  {"action": "terminate"|"stop"|"hibernate", "time": "<UTC ISO 8601>"}, about two minutes ahead.
- GCP: `computeMetadata/v1/instance/preempted` turns TRUE when the preemption starts, about 30 s ahead.

On a notice it runs drain_node.py (same folder) with the time left minus --margin-s as the drain deadline and
exits. The launcher configs (infra/aws, infra/gcp) start it in the background on every spot worker after
`ray start`. Metadata endpoints exist only on cloud VMs: tests exercise the parsing and the decision with canned
answers and never run the loop.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

AWS_IMDS = "http://169.254.169.254"
AWS_TOKEN_TTL_S = 21600
GCP_METADATA = "http://metadata.google.internal/computeMetadata/v1"
GCP_NOTICE_S = 30.0  # GCP documents 30 s between the preemption notice and the stop
MIN_DEADLINE_S = 5

# (method, url, headers, timeout_s) -> (HTTP status, body); injectable so the logic is testable offline.
Fetch = Callable[[str, str, dict[str, str], float], tuple[int, str]]


def http_fetch(method: str, url: str, headers: dict[str, str], timeout_s: float) -> tuple[int, str]:
    req = urllib.request.Request(url, method=method, headers=headers)
    try:
        with urllib.request.urlopen(req, timeout=timeout_s) as resp:
            return resp.status, resp.read().decode()
    except urllib.error.HTTPError as exc:
        return exc.code, ""


def aws_seconds_left(status: int, body: str, now: datetime) -> float | None:
    """Seconds until the reclaim from an `instance-action` answer, or None when no interruption is scheduled."""
    if status != 200 or not body.strip():  # 404: nothing scheduled
        return None
    notice = json.loads(body)
    if notice.get("action") not in {"terminate", "stop", "hibernate"}:
        return None
    when = datetime.fromisoformat(notice["time"].replace("Z", "+00:00"))
    return (when - now).total_seconds()


def gcp_preempted(status: int, body: str) -> bool:
    return status == 200 and body.strip().upper() == "TRUE"


def drain_deadline(seconds_left: float, margin_s: float) -> int:
    """The drain deadline: the time left minus the margin the node needs to go down, never below a few seconds."""
    return max(MIN_DEADLINE_S, int(seconds_left - margin_s))


class AwsSource:
    def __init__(self, fetch: Fetch, now: Callable[[], datetime] = lambda: datetime.now(UTC)):
        self.fetch, self.now = fetch, now
        self._token, self._token_at = "", float("-inf")

    def _imds_token(self) -> str:
        if time.monotonic() - self._token_at > AWS_TOKEN_TTL_S / 2:
            status, body = self.fetch(
                "PUT",
                f"{AWS_IMDS}/latest/api/token",
                {"X-aws-ec2-metadata-token-ttl-seconds": str(AWS_TOKEN_TTL_S)},
                2.0,
            )
            if status != 200:
                raise RuntimeError(f"IMDSv2 token request answered HTTP {status}")
            self._token, self._token_at = body.strip(), time.monotonic()
        return self._token

    def seconds_left(self) -> float | None:
        headers = {"X-aws-ec2-metadata-token": self._imds_token()}
        status, body = self.fetch("GET", f"{AWS_IMDS}/latest/meta-data/spot/instance-action", headers, 2.0)
        return aws_seconds_left(status, body, self.now())


class GcpSource:
    def __init__(self, fetch: Fetch, wait_s: int = 60):
        self.fetch, self.wait_s = fetch, wait_s

    def seconds_left(self) -> float | None:
        headers = {"Metadata-Flavor": "Google"}
        url = f"{GCP_METADATA}/instance/preempted"
        # A plain read first: a long poll only returns on a *change*, so a notice that came before it would be
        # seen only when the poll times out. Then wait_for_change holds the request until the value changes.
        if gcp_preempted(*self.fetch("GET", url, headers, 2.0)):
            return GCP_NOTICE_S
        status, body = self.fetch(
            "GET", f"{url}?wait_for_change=true&timeout_sec={self.wait_s}", headers, self.wait_s + 5.0
        )
        return GCP_NOTICE_S if gcp_preempted(status, body) else None


def drain(deadline_s: int) -> int:
    script = Path(__file__).with_name("drain_node.py")
    cmd = [sys.executable, str(script), "--deadline-s", str(deadline_s), "--reason-message", "spot interruption notice"]
    return subprocess.run(cmd, check=False).returncode


def watch(source: AwsSource | GcpSource, poll_s: float, margin_s: float, drain_fn: Callable[[int], int] = drain) -> int:
    """Poll until a notice arrives, drain once, return the drain's exit code."""
    while True:
        try:
            left = source.seconds_left()
        except Exception as exc:  # noqa: BLE001 - the metadata service hiccups; keep watching
            print(f"spot_watcher: metadata query failed: {exc}", file=sys.stderr, flush=True)
            left = None
        if left is not None:
            deadline = drain_deadline(left, margin_s)
            print(
                f"spot_watcher: interruption notice, {left:.0f} s left; draining with deadline {deadline} s", flush=True
            )
            return drain_fn(deadline)
        time.sleep(poll_s)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="spot_watcher.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--cloud", choices=["aws", "gcp"], required=True)
    p.add_argument("--poll-s", type=float, default=5.0, help="seconds between AWS metadata polls (GCP long-polls)")
    p.add_argument("--margin-s", type=float, default=15.0, help="seconds kept back from the notice for shutdown")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    source = AwsSource(http_fetch) if args.cloud == "aws" else GcpSource(http_fetch)
    return watch(source, args.poll_s, args.margin_s)


if __name__ == "__main__":
    sys.exit(main())
