"""Drafter training: data preparation, target features, anchors and losses,
the trainer, and Sequential Temperature Scaling calibration.

Entry points (wired into the CLI): `run_prepare`, `run_train`, `run_calibrate`.
"""

from dspark.train.prepare import prepare, run_prepare
from dspark.train.run import run_calibrate, run_train

__all__ = ["prepare", "run_prepare", "run_train", "run_calibrate"]
