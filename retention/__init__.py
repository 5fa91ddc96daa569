"""The retention study of the coding prune on the trained demo (REAP against frequency, EAN and random), run from the
repository root: `python -m retention.retention`, and `python -m retention.calibration_arms` for the choice of its
calibration windows. Results in `retention/results/`."""
