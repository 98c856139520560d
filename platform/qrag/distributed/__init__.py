"""Training on Ray: episode-feeder actors feed a Ray Train learner; MLflow tracking; job entry points.

The only place in the library that imports Ray (and MLflow). Modules:

* ``episodes``  packing tokenised episodes into a few flat arrays for the object store
* ``feeder``    ``EpisodeFeeder``: one shard of the training split, served as ready-to-step episodes
                (the learner steps them; older docs called it EnvRunner)
* ``source``    ``FeederPool``: the learner's episode source over the feeders (prefetch, re-issue)
* ``tracking``  MLflow runs: params, metrics by update (no duplicates after restarts), artifacts
* ``train``     ``train_with_ray``: the Ray Train ``TorchTrainer`` around ``qrag.rl.train.TrainingRun``
* ``job``       ``run_job``: parse, validate before any actor starts, connect, train, print
* ``sweep``     ``tune/sweep.py``: Ray Tune sweeps (``sweep_spec`` the sweep file, ``sweep_tune`` the
                trainable and ASHA, ``sweep_tracking`` the MLflow parent run, ``sweep_results`` table,
                plot and best config, ``sweep_local`` the same trials without Ray)
"""
