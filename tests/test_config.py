import pytest

from qrag.config import ConfigError, TrainConfig, apply_overrides, describe, flatten, load_config, to_dict


def test_defaults_follow_the_paper():
    c = TrainConfig()
    lc = c.learner
    assert (lc.lr, lc.betas, lc.eps, lc.weight_decay) == (1.5e-5, [0.9, 0.98], 1e-6, 5e-4)
    assert (lc.warmup_updates, lc.final_lr_fraction, lc.grad_clip) == (1000, 0.1, 2.0)
    assert (lc.gamma, lc.alpha, lc.lam, lc.tau) == (0.99, 0.05, 0.5, 0.02)
    assert c.data.chunk_tokens == 220 and c.env.max_steps == 2


def test_overrides_are_typed():
    cfg = load_config(
        None,
        ["learner.lr=1e-3", "learner.alpha=0.1", "updates=7", "search.stop_threshold=0.3", "data.tasks=[qa1, qa2]"],
    )
    assert cfg.learner.lr == 1e-3 and cfg.learner.alpha == 0.1 and cfg.updates == 7 and cfg.search.stop_threshold == 0.3
    assert cfg.data.tasks == ["qa1", "qa2"]
    assert isinstance(cfg.learner.lr, float)


@pytest.mark.parametrize(
    "override,message",
    [
        ("learner.alpah=0.1", "unknown config key learner.alpah"),
        ("nonsense=1", "unknown config key nonsense"),
        ("updates=many", "updates: expected an integer"),
        ("env.never_terminate=maybe", "expected true or false"),
        ("updates", "expected key=value"),
        ("learner..alpha=1", "not a dotted config key"),
        ("learner=3", "expected a mapping"),
    ],
)
def test_bad_overrides_name_the_key(override, message):
    with pytest.raises(ConfigError, match=message):
        load_config(None, [override])


def test_yaml_errors_name_the_file(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("learner:\n  alphaa: 1\n")
    with pytest.raises(ConfigError, match=r"bad.yaml: unknown config key learner.alphaa"):
        load_config(bad)
    with pytest.raises(ConfigError, match="config file not found"):
        load_config(tmp_path / "missing.yaml")


def test_presets_load():
    from conftest import ROOT

    for preset in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(preset)


def test_describe_and_flatten_cover_every_leaf():
    keys = {k for k, _, _ in describe(TrainConfig)}
    assert "learner.alpha" in keys and "model.positions" in keys
    assert all(h for _, _, h in describe(TrainConfig))
    assert "learner.alpha" in flatten(to_dict(TrainConfig()))
    assert apply_overrides({}, ["a.b=1"]) == {"a": {"b": 1}}


def test_keep_best_without_a_validation_part_is_an_error_naming_the_keys(tmp_path):
    # Planted bug it catches: check_selection not called (keep_best silently selects on dev).
    with pytest.raises(ConfigError, match=r"keep_best=true with data.val_fraction=0"):
        load_config(None, ["keep_best=true", "eval_every=5"])
    preset = tmp_path / "p.yaml"
    preset.write_text("keep_best: true\ndata:\n  val_fraction: 0.1\n")
    with pytest.raises(ConfigError, match=r"p.yaml: keep_best=true with data.val_fraction=0"):
        load_config(preset, ["data.val_fraction=0"])
    assert load_config(preset).keep_best  # with a validation part it is fine
    assert not load_config(None, ["keep_best=false"]).keep_best


def test_a_saved_run_config_loads_without_the_run_rules(tmp_path):
    """Checkpoints written before the rule existed must still evaluate."""
    from qrag.model.checkpoint import load_run_config
    from qrag.config import dump_yaml

    old = TrainConfig(keep_best=True)
    dump_yaml(old, tmp_path / "config.yaml")
    assert load_run_config(tmp_path).keep_best


def test_presets_never_select_or_monitor_on_dev():
    """Periodic evaluation (and keep_best) of every preset runs on a validation part of train."""
    from conftest import ROOT

    presets = sorted((ROOT / "configs").glob("*.yaml"))
    assert presets
    for preset in presets:
        cfg = load_config(preset)
        assert cfg.data.val_fraction > 0 or (cfg.eval_every == 0 and not cfg.keep_best), preset.name
