"""Drain this Ray node ahead of a spot reclaim, so that Ray stops placing work on it and training checkpoints.

    python infra/preemption/drain_node.py --deadline-s 90 [--hold] [--reason-message TEXT] [--address auto]

Run on the node that is about to go: by spot_watcher.py on VMs when the cloud announces an interruption, and as
the preStop hook of KubeRay worker pods (infra/kuberay/*.yaml). It asks the GCS to drain the local node through
Ray's node drain API (`ray drain-node`, the call the autoscaler itself makes) with reason PREEMPTION and a
deadline. A draining node gets no new tasks or actors; Ray Train's preemption watcher sees the drain within
RAY_TRAIN_PREEMPTION_POLL_INTERVAL_S, `ray.train.get_preemption_info()` stops returning None, and the pretraining
loop saves a checkpoint (pretrain/train.py, `checkpoint.on_preemption`). When the node is gone, Ray Train restarts
the worker group elsewhere from that checkpoint.

--hold keeps this process alive until the deadline once the drain is accepted: Kubernetes sends SIGTERM (which
stops Ray) only after the preStop hook returns, so the hold is what keeps the workers alive long enough to finish
the checkpoint. Set the pod's terminationGracePeriodSeconds above --deadline-s.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time

REASON = "DRAIN_NODE_REASON_PREEMPTION"


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="drain_node.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--deadline-s", type=int, required=True, help="seconds until the node will be force-stopped")
    p.add_argument("--hold", action="store_true", help="after an accepted drain, stay alive until the deadline")
    p.add_argument("--reason-message", default="spot instance reclaim", help="recorded with the drain in the GCS")
    p.add_argument("--address", default="auto", help="Ray address of this node's cluster (default: auto)")
    args = p.parse_args(argv)
    if args.deadline_s < 0:
        p.error("--deadline-s must not be negative")
    return args


def local_node_id(address: str) -> str:
    """The Ray node id of this machine, from a driver connected through the local raylet."""
    import ray

    ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    try:
        return ray.get_runtime_context().get_node_id()
    finally:
        ray.shutdown()


def drain_command(node_id: str, deadline_s: int, message: str, address: str) -> list[str]:
    # The CLI of the same Python, so the hook works without `ray` on PATH.
    return [
        sys.executable,
        "-m",
        "ray.scripts.scripts",
        "drain-node",
        "--address",
        address,
        "--node-id",
        node_id,
        "--reason",
        REASON,
        "--reason-message",
        message,
        "--deadline-remaining-seconds",
        str(deadline_s),
    ]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    start = time.monotonic()
    try:
        node_id = local_node_id(args.address)
        subprocess.run(
            drain_command(node_id, args.deadline_s, args.reason_message, args.address), check=True, timeout=60
        )
    except Exception as exc:  # noqa: BLE001 - a hook must report and exit, never hang
        print(f"drain_node: drain failed: {exc}", file=sys.stderr)
        return 1
    print(f"drain_node: node {node_id} draining, deadline in {args.deadline_s} s", flush=True)
    if args.hold:
        time.sleep(max(0.0, args.deadline_s - (time.monotonic() - start)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
