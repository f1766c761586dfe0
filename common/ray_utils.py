"""Connecting to Ray the same way from ``python -m`` and from ``ray job submit``."""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterable, Iterator

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


def as_completed(launches: Iterable[Callable[[], ray.ObjectRef]], window: int) -> Iterator:
    """Call each launch (it starts one Ray task) with at most ``window`` tasks in flight, so the driver's object
    refs stay bounded however many tasks a step has; yields their results as they finish."""
    pending: list[ray.ObjectRef] = []
    for launch in launches:
        if len(pending) >= window:
            ready, pending = ray.wait(pending, num_returns=1)
            yield ray.get(ready[0])
        pending.append(launch())
    while pending:
        ready, pending = ray.wait(pending, num_returns=1)
        yield ray.get(ready[0])
