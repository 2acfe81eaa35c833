"""The Hydra config groups of the entry points (``train.yaml``, ``plan.yaml``, ``verify.yaml`` and their groups)."""

from pathlib import Path

CONF_DIR = Path(__file__).resolve().parent
