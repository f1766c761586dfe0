"""The telemetry of the libraries our processes load, off before they load: nothing is sent, and nothing lands in a
node's home folder but the model cache (``models.store.cache_dir``).

``disable_telemetry`` runs first in the driver (``common.ray_utils.init_ray``) and in every Ray worker of a job (its
setup hook), and ``TELEMETRY_OFF`` travels to the workers of every node in the job's runtime environment. Each switch
is read when its library is imported (Ray's when a Ray process starts), so it must be in place before that.
"""

from __future__ import annotations

import os
import sys

# Set, not defaulted: a value inherited from a shell or an image cannot turn a channel back on.
TELEMETRY_OFF = {
    # onnxruntime (RapidOCR's text detector) starts Microsoft's 1DS telemetry on import: a device id and an event
    # store in ~/.cache/Microsoft/DeveloperTools/.onnxruntime ($XDG_CACHE_HOME), uploaded to Microsoft. Set, it
    # starts nothing; onnxruntime.disable_telemetry_events() would come after import, and so after the files.
    "ORT_DISABLE_TELEMETRY": "1",
    # Ray's usage stats: a local Ray that our driver starts reports the cluster to usage-stats.ray.io, and Ray Data
    # records every dataset's plan for that report. (A cluster's head reports what its own `ray start` allows:
    # infra/ sets the same variable there.)
    "RAY_USAGE_STATS_ENABLED": "0",
    # huggingface_hub (the full profile's hf-hub: models): no telemetry calls, no library versions in its user agent.
    "HF_HUB_DISABLE_TELEMETRY": "1",
    # ultralytics (the full profile's YOLO) sends usage events to Google Analytics, and errors to Sentry, only where
    # its DNS probe on import finds the internet; offline it neither probes nor sends.
    "YOLO_OFFLINE": "1",
}

# The default of models.store.cache_dir (curation/models/settings.py), the one folder of ours in a node's home.
MODEL_CACHE = "~/.cache/humans1b/models"


def disable_telemetry() -> None:
    """Every library telemetry switch for this process and the processes it starts."""
    os.environ.update(TELEMETRY_OFF)
    # ultralytics writes its settings file (with a machine hash for its analytics) into ~/.config/Ultralytics on
    # import and has no switch against it: it goes to <model cache>/Ultralytics instead, unless YOLO_CONFIG_DIR is set.
    os.environ.setdefault("YOLO_CONFIG_DIR", os.path.expanduser(MODEL_CACHE))
    # OpenVINO has no switch: `import openvino` loads its model converter, which sends an import event to Google
    # Analytics and writes a client id and a usage count into ~/intel unless ~/intel/openvino_telemetry (written by
    # its opt_in_out tool) declines. Where its optional openvino_telemetry package does not import, OpenVINO uses its
    # own no-op stub (openvino.tools.ovc.telemetry_stub); a None entry in sys.modules makes that import fail.
    sys.modules.setdefault("openvino_telemetry", None)  # type: ignore[arg-type]
