"""Ray Tune sweeps over training settings: the sweep file (spec), the Tune run (ray_tune), the
no-Ray fallback (local), results and MLflow records; driver.main is `tune/sweep.py`."""
