"""Connecting to Ray the same way from ``python -m`` and from ``ray job submit``."""

from __future__ import annotations

import logging
import os

import ray


def init_ray(address: str | None = None, num_cpus: int | None = None) -> None:
    """Join the cluster a submitted job runs on (RAY_ADDRESS), a given address (``auto`` finds a cluster started on
    this machine), or start a local Ray.

    Ray 2.59+ local clusters use token authentication; a submitted job and ``ray.init`` on the head node find the
    token Ray wrote under ``~/.ray``; a remote client needs ``RAY_AUTH_MODE=token`` and the token (infra/README).
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    kwargs = {"logging_level": logging.WARNING, "log_to_driver": True}
    if address:
        ray.init(address=address, **kwargs)
    else:
        # "local": always a fresh Ray for this process, even where a `ray start` cluster runs on the machine
        ray.init(address="local", num_cpus=num_cpus, include_dashboard=False, **kwargs)
