"""The reference runs (issue 80): each trainer's default config has a measured curve in assets/, a default run
prints it beside its evals, and a run of another config prints nothing."""
import copy
import dataclasses
import json
import os

import pytest
import torch

import prepare_data
import train_diffusion
import train_gpt
import train_vit
from conftest import ROOT, write_corpus
from reference import FAR

TRAINERS = {"train_gpt": train_gpt, "train_vit": train_vit, "train_diffusion": train_diffusion}


def asset(name):
    with open(os.path.join(ROOT, "assets", f"reference_{name}.json")) as f:
        return json.load(f)


@pytest.mark.parametrize("name", TRAINERS)
def test_each_curve_is_of_todays_default(name):
    """A default changed without a new reference run fails here: make the run again, then tests/reference.py."""
    ref = asset(name)
    today = json.loads(json.dumps(dataclasses.asdict(TRAINERS[name].Config())))
    # the run wrote its config with its automatic choices made: --dtype=auto as a CPU resolves it, and the ViT's
    # --n_embd=0 as 128, its width for a train split of 10,000 images or more (the default's 50,000)
    dtype = TRAINERS[name].setup_precision(torch.device("cpu"), today["dtype"])[0]
    today["dtype"] = str(dtype).removeprefix("torch.")
    if name == "train_vit" and today["n_embd"] == 0:
        today["n_embd"] = 128
    free = TRAINERS[name].FREE_FIELDS  # what a run may change and still compare (the DiT's judge, say)
    changed = sorted(k for k in set(today) | set(ref["config"]) if today.get(k) != ref["config"].get(k)
                     and k not in free)
    assert not changed, f"{name}'s defaults differ from its reference run in {changed}"
    assert ref["far"] == FAR[name] and ref["script"] == f"{name}.py"
    assert "0" in ref["curve"] and str(ref["final_step"]) in ref["curve"]
    steps = sorted(map(int, ref["curve"]))
    every = TRAINERS[name].Config().eval_every
    assert all(s % every == 0 for s in steps[:-1]), steps  # the periodic evals, then the final one
    assert all(set(ref["curve"][str(s)]) <= set(FAR[name]) for s in steps)


def default_data(name, root):
    """The default data_dir of the trainer, under root, with small data in its format."""
    d = root / TRAINERS[name].Config().data_dir
    if name == "train_gpt":
        write_corpus(d)
    else:
        rotate = name == "train_vit"  # the DiT's shapes are upright
        # 10,000 train images: the ViT's automatic width is the default data's (64 under 10,000)
        splits = {"train": prepare_data.make_shapes(10000 if rotate else 400, 32, 0, rotate=rotate),
                  "val": prepare_data.make_shapes(100, 32, 1, rotate=rotate)}
        prepare_data.write_images(d, splits, list(prepare_data.SHAPES), "shapes", flip_ok=rotate)


@pytest.mark.parametrize("name", TRAINERS)
def test_a_default_run_prints_its_reference(name, tmp_path, monkeypatch, capsys):
    """The default config for two steps (flags of FREE_FIELDS aside): its step-0 eval is followed by the reference's figures at step 0; its
    final eval, at step 2 of another budget, by none."""
    default_data(name, tmp_path)
    monkeypatch.chdir(tmp_path)
    module, ref = TRAINERS[name], asset(name)
    # --eval_every=10: with its own (250 to 1,000), a 2-step run skips the eval at step 0 as too near its end
    module.main(module.Config(max_steps=2, eval_every=10, out_dir=str(tmp_path / "out")))
    lines = capsys.readouterr().out.splitlines()
    shown = [line for line in lines if line.startswith("  reference")]
    assert len(shown) == 1 and shown[0].startswith("  reference at step 0: "), shown
    first = ref["curve"]["0"]
    key = next(iter(first))
    value = f"{100 * first[key]:.2f}%" if key.endswith("acc") else f"{first[key]:.4f}"
    assert f"{key.replace('_', ' ')} {value}" in shown[0]
    assert f"({ref['machine']}, {ref['dtype']}, commit {ref['commit']})" in shown[0]
    eval0 = next(i for i, line in enumerate(lines) if line.startswith("eval 00000"))
    assert lines[eval0 + 1] == shown[0]


def test_another_config_prints_no_reference(tmp_path, monkeypatch, capsys):
    """A run whose model differs from the reference's (one layer more) compares with nothing."""
    default_data("train_gpt", tmp_path)
    monkeypatch.chdir(tmp_path)
    cfg = train_gpt.Config(max_steps=1, out_dir=str(tmp_path / "out"), n_layer=train_gpt.Config().n_layer + 1)
    train_gpt.main(cfg)
    assert "reference" not in capsys.readouterr().out


def with_curve(module, **changes):
    """A Reference of the default config, its file replaced by a crafted one."""
    cfg = module.Config(**changes)
    r = module.Reference(module.Config())
    r.config = json.loads(json.dumps(dataclasses.asdict(cfg)))
    r.ref = {"machine": "M", "dtype": "float32", "commit": "abc", "final_step": 7, "far": {"val_acc": 0.1},
             "config": copy.deepcopy(json.loads(json.dumps(dataclasses.asdict(module.Config())))),
             "curve": {"0": {"val_acc": 0.1}, "5": {"val_acc": 0.5}, "7": {"val_acc": 0.9}}}
    return r


def test_the_line_compares_at_the_same_step_and_warns_once():
    """At a step of the curve, its figure; at the end of the same budget, the reference's end; a run worse than the
    tolerance (lower, for an accuracy) says what to check, once; a better one does not."""
    r = with_curve(train_vit)
    assert r.line(3, {"val_acc": 0.3}, final=False) == ""  # no eval of the reference at step 3
    assert r.line(5, {"val_acc": 0.55}, final=False) == "  reference at step 5: val acc 50.00% (M, float32, commit abc)"
    far = r.line(5, {"val_acc": 0.35}, final=False).splitlines()
    assert len(far) == 2 and far[1].startswith("  far off the reference in val acc: check the data")
    assert len(r.line(5, {"val_acc": 0.35}, final=False).splitlines()) == 1  # said once
    assert r.line(6, {"val_acc": 0.8}, final=True).startswith("  reference at its end, step 7: val acc 90.00%")
    other = with_curve(train_vit, max_steps=6)  # another budget: its end is not the reference's
    assert other.line(6, {"val_acc": 0.8}, final=True) == ""
    assert other.line(5, {"val_acc": 0.8}, final=True).startswith("  reference at step 5:")
    lower = with_curve(train_vit)
    lower.ref["far"], lower.ref["curve"]["5"] = {"val_loss": 0.1}, {"val_loss": 1.0}
    assert lower.line(5, {"val_loss": 0.5}, final=False).count("\n") == 0  # a lower loss is not far off
    assert lower.line(5, {"val_loss": 1.2}, final=False).count("\n") == 1


def test_a_changed_field_gives_no_reference():
    """Any field outside FREE_FIELDS differing gives None, the resolved dtype included (a GPU's bf16 run)."""
    cpu = dict(dtype="float32")  # --dtype=auto as the trainer resolves it on a CPU, before it builds its Reference
    assert train_gpt.Reference(train_gpt.Config(max_steps=5, seed=3, out_dir="x", **cpu)).ref is not None
    assert train_gpt.Reference(train_gpt.Config(lr=1e-3, **cpu)).ref is None
    assert train_gpt.Reference(train_gpt.Config(data_dir="data/other", **cpu)).ref is None
    assert train_gpt.Reference(train_gpt.Config(dtype="bfloat16")).ref is None
