"""configs/hotpot-2wiki-mpnet.yaml: configs/hotpot-mpnet.yaml's recipe with no MuSiQue question in training
(MuSiQue is then out of distribution) and 2WikiMultihopQA's longer chains kept."""

from __future__ import annotations

from conftest import ROOT

from qrag.config import flatten, load_config, to_dict


def _preset(name: str):
    return load_config(ROOT / "configs" / f"{name}.yaml")


def test_it_is_the_mpnet_preset_but_for_its_sources():
    ood, shipped = (flatten(to_dict(_preset(n))) for n in ("hotpot-2wiki-mpnet", "hotpot-mpnet"))
    differ = {k for k in ood.keys() | shipped.keys() if ood.get(k) != shipped.get(k)}
    assert differ == {"name", "data.sources"}


def test_no_musique_in_training_and_every_2wiki_record_kept():
    sources = _preset("hotpot-2wiki-mpnet").data.sources
    assert all(s["dataset"] != "musique" for s in sources)
    (wiki,) = [s for s in sources if s["dataset"] == "2wiki"]
    assert wiki.get("max_support") is None
    shipped = [s for s in _preset("hotpot-mpnet").data.sources if s["dataset"] != "musique"]
    assert [dict(s, max_support=None) for s in shipped] == [dict(s, max_support=None) for s in sources]


def test_qrag_eval_scores_it_on_musique_train(tiny_mpnet, shared_data, tmp_path, monkeypatch):
    """MuSiQue's train subset is where a stop is chosen out of distribution; qrag eval refuses it for a run
    that trained on MuSiQue, and must not for this one."""
    from qrag.cli import main

    monkeypatch.setenv("QRAG_DATA_DIR", str(shared_data))
    config = str(ROOT / "configs" / "hotpot-2wiki-mpnet.yaml")
    common = [f"model.encoder={tiny_mpnet}", "device=cpu", f"out_dir={tmp_path}"]
    train = ["train", "--config", config, *common, "updates=1", "eval_every=1", "eval_limit=2"]
    train += ["checkpoint_every=1", "learner.episodes_per_update=4", "learner.micro_batch=4", "--no-progress"]
    assert main(train) == 0
    run = tmp_path / "hotpot-2wiki-mpnet" / "best"
    out = tmp_path / "musique-val.json"
    args = ["eval", "--config", str(ROOT / "configs" / "hotpot.yaml"), "--checkpoint", str(run), *common]
    args += ["--dataset", "musique", "--split", "train", "--steps", "4", "--limit", "3", "--out", str(out)]
    assert main(args + ["--no-progress"]) == 0
    assert out.is_file()
