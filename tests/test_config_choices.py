"""Enumerated config fields are typed choices checked at load: a typo stops ``load_config`` with
the key, the value and the allowed values, not a training run later."""

from __future__ import annotations

import dataclasses
import re
import typing

import pytest

from qrag.config import ConfigError, TrainConfig, choices, from_dict, load_config


@pytest.mark.parametrize(
    "override,key,allowed",
    [
        ("model.positions=relativ", "model.positions", "none, absolute, relative"),
        ("search.beam_score=mn", "search.beam_score", "min, last, logprob"),
        ("learner.objective=ppo", "learner.objective", "pqn, sft, sft_trajectory"),
        ("data.dataset=hotpot", "data.dataset", "hotpotqa, musique, 2wiki, jsonl, babilong, niah, mixed"),
        ("env.reward=final", "env.reward", "terminal, per_fact"),
        ("answer.backend=vllm", "answer.backend", "none, local, openai"),
        ("distributed.mlflow_checkpoint=all", "distributed.mlflow_checkpoint", "inference, full, none"),
    ],
)
def test_a_typo_in_an_enumerated_key_fails_at_load(override, key, allowed):
    value = override.split("=", 1)[1]
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert f"{key}: unknown value {value!r} (choose from {allowed})" in str(err.value)


def test_the_error_suggests_the_close_value_and_names_the_file(tmp_path):
    preset = tmp_path / "typo.yaml"
    preset.write_text("search:\n  beam_score: mn\n")
    with pytest.raises(ConfigError, match=r"typo.yaml: search.beam_score: unknown value 'mn' .*did you mean 'min'"):
        load_config(preset)


@pytest.mark.parametrize(
    "value,ok",
    [
        ("auto", True),
        ("cpu", True),
        ("cuda", True),
        ("cuda:3", True),
        ("gpu", False),
        ("cuda0", False),
        ("cuda:x", False),
    ],
)
def test_devices_are_checked(value, ok):
    if ok:
        assert load_config(None, [f"device={value}", f"answer.device={value}"]).device == value
        return
    with pytest.raises(
        ConfigError, match=rf"device: '{value}' is not allowed \(expected auto \| cpu \| cuda \| cuda:N\)"
    ):
        load_config(None, [f"device={value}"])


def test_serve_config_choices_are_checked():
    from qrag.serving.service_config import ServeConfig

    assert from_dict(ServeConfig, {"dtype": "float16", "faiss": "never", "shard_device": "cuda:1"}).dtype == "float16"
    for bad, message in (
        ({"dtype": "fp16"}, "dtype: unknown value 'fp16'"),
        ({"faiss": "yes"}, "faiss: unknown value 'yes'"),
        ({"encoder_device": "gpu"}, "encoder_device: 'gpu' is not allowed"),
    ):
        with pytest.raises(ConfigError, match=message):
            from_dict(ServeConfig, bad)


def test_the_choices_match_what_the_code_accepts():
    from qrag.data import LOADERS, _register_optional_loaders
    from qrag.data.answer_support import SUPERVISIONS
    from qrag.data.credit import CREDIT_RULES
    from qrag.distributed.preflight import MLFLOW_CHECKPOINT_MODES
    from qrag.model.positions import MODES
    from qrag.retrieval.multistep import BEAM_SCORES

    _register_optional_loaders()
    hints = {key: hint for key, hint, _ in _choice_fields(TrainConfig)}
    assert set(hints["data.dataset"]) == set(LOADERS)
    assert hints["model.positions"] == MODES
    assert hints["search.beam_score"] == tuple(BEAM_SCORES)
    assert hints["env.credit"] == CREDIT_RULES
    assert hints["data.supervision"] == SUPERVISIONS
    assert hints["distributed.mlflow_checkpoint"] == MLFLOW_CHECKPOINT_MODES


def _choice_fields(cls: type, prefix: str = "") -> list[tuple[str, tuple[str, ...], str]]:
    hints = typing.get_type_hints(cls)
    out = []
    for f in dataclasses.fields(cls):
        if dataclasses.is_dataclass(hints[f.name]):
            out += _choice_fields(hints[f.name], f"{prefix}{f.name}.")
        elif choices(hints[f.name]):
            out.append((f"{prefix}{f.name}", choices(hints[f.name]), f.metadata["help"]))
    return out


def test_train_help_lists_every_choice():
    from qrag.cli.commands import build_parser

    fields = _choice_fields(TrainConfig)
    assert len(fields) >= 9
    parser = build_parser()
    train = parser._subparsers._group_actions[0].choices["train"]  # noqa: SLF001 - argparse keeps subparsers there
    text = " ".join(train.format_help().split())
    for key, allowed, help_text in fields:
        assert key in text
        for value in allowed:
            assert re.search(rf"(?<![\w/]){re.escape(value)}(?![\w/])", help_text), (
                f"{key}: --help does not name {value!r}"
            )
