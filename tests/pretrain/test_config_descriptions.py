"""Every key of the training configs carries its description in its field (the configuration reference's one source);
the watchdog section's keys are ``common/watchdog.py``'s."""

import pytest

from common.config import settings_fields
from finetune.config import FinetuneConfig
from pretrain.config import PretrainConfig


@pytest.mark.parametrize("model", [PretrainConfig, FinetuneConfig], ids=lambda m: m.__name__)
def test_every_key_has_a_description(model):
    keys = [f for f in settings_fields(model) if not f.key.startswith("watchdog.")]
    assert {"seed", "watchdog", "model.size", "optim.lr"} <= {f.key for f in keys}  # the walk reached the sections
    missing = [f"{f.key} ({f.owner.__module__}.{f.owner.__name__})" for f in keys if not (f.description or "").strip()]
    assert not missing, "keys without a description: " + ", ".join(missing)
