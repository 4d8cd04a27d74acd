"""Issue 79: the guidance interval, autoguidance and the post-hoc EMA of train_diffusion.py and sample_diffusion.py,
each tested for what it computes."""
import glob
import os
import shutil

import numpy as np
import pytest
import torch

import sample_diffusion as sd
import train_diffusion as td
from test_train_diffusion import TINY, shapes, tiny  # noqa: F401 - shapes is a fixture

CPU = torch.device("cpu")


def labelled_model(seed=1, K=5):
    """A small DiT whose output depends on the label (adaLN-Zero left), for K classes of 16x16 images."""
    model = td.build_model(td.Config(**TINY), 16, 3, K, CPU)
    torch.manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05 * torch.randn_like(p))
    return model.eval()


class Counting(torch.nn.Module):
    """A model that records the batch size and t of each call."""

    def __init__(self, model):
        super().__init__()
        self.model = model
        self.calls = []

    def forward(self, x, t, y):
        self.calls.append((len(x), float(t[0])))
        return self.model(x, t, y)

# ----------------------------------------------------------------------------- the guidance interval


@torch.no_grad()
def test_outside_the_interval_a_step_is_the_conditional_model_and_inside_it_is_guided():
    model = labelled_model()
    x, y = torch.randn(4, 16, 16, 3), torch.tensor([0, 1, 2, 3])
    cond = lambda t: model(x, torch.full((4,), t), y)  # noqa: E731
    uncond = lambda t: model(x, torch.full((4,), t), torch.full_like(y, 5))  # noqa: E731
    for t in (0.1, 0.3, 0.9):  # outside (0.3, 0.8]: the plain conditional model, whatever the scale
        torch.testing.assert_close(td.guided(model, x, t, y, 3.0, 5, (0.3, 0.8)), cond(t), rtol=1e-5, atol=1e-5)
    for t in (0.31, 0.5, 0.8):  # inside: uncond + 3 (cond - uncond)
        want = uncond(t) + 3.0 * (cond(t) - uncond(t))
        torch.testing.assert_close(td.guided(model, x, t, y, 3.0, 5, (0.3, 0.8)), want, rtol=1e-4, atol=1e-4)
    assert (td.guided(model, x, 0.5, y, 3.0, 5, (0.3, 0.8)) - cond(0.5)).abs().max() > 1e-3


@pytest.mark.parametrize("objective,sampler", [("flow", "euler"), ("flow", "heun"), ("ddpm", "ddim")])
def test_every_sampler_guides_only_inside_the_interval(objective, sampler):
    """Each sampler calls the model on the guided pair (twice the batch) at t in (LO, HI] only; the whole
    interval 0,1 is today's guidance at every step."""
    cfg = td.Config(**{**TINY, "objective": objective, "sampler": sampler, "sample_steps": 8})
    model = Counting(labelled_model())
    noise, y = torch.randn(3, 16, 16, 3), torch.tensor([0, 1, 2])
    ab = td.cosine_alpha_bar()
    every = td.sample(model, noise, y, cfg, ab, 2.5, 5)
    assert all(n == 6 for n, _ in model.calls)  # the default interval guides every call
    model.calls.clear()
    half = td.Config(**{**cfg.__dict__, "guidance_interval": "0.25,0.75"})
    part = td.sample(model, noise, y, half, ab, 2.5, 5)
    assert model.calls and all((n == 6) == (0.25 < t <= 0.75) for n, t in model.calls), model.calls
    assert {n for n, _ in model.calls} == {3, 6}
    assert (every - part).abs().max() > 1e-3


def test_bad_intervals_are_refused_in_one_line():
    for text in ("0.5", "0.8,0.2", "a,b", "0,1.5", "-0.1,0.5"):
        with pytest.raises(SystemExit, match="guidance_interval"):
            td.parse_interval(text)
    assert td.parse_interval("0.1,0.9") == (0.1, 0.9)

# ----------------------------------------------------------------------------- autoguidance


@torch.no_grad()
def test_a_guide_equal_to_the_model_gives_the_model_and_another_is_stepped_away_from():
    model, weak = labelled_model(1), labelled_model(2)
    x, y = torch.randn(4, 16, 16, 3), torch.tensor([0, 1, 2, 3])
    tt = torch.full((4,), 0.5)
    good, bad = model(x, tt, y), weak(x, tt, y)
    for scale in (0.0, 2.0, 4.0):
        torch.testing.assert_close(td.guided(model, x, 0.5, y, scale, 5, guide=model), good, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(td.guided(model, x, 0.5, y, 2.0, 5, guide=weak), bad + 2.0 * (good - bad))
    # outside the interval the guide is not called: the conditional model alone
    counted = Counting(weak)
    at_09 = model(x, torch.full((4,), 0.9), y)
    torch.testing.assert_close(td.guided(model, x, 0.9, y, 2.0, 5, (0.0, 0.5), counted), at_09)
    assert counted.calls == []

# ----------------------------------------------------------------------------- the post-hoc EMA


def test_profile_widths_are_edm2s():
    """EDM2 (section 3.1): sigma_rel 0.05 and 0.10 are gamma 16.97 and 6.94; and gamma gives its width back."""
    assert td.std_to_gamma(0.05) == pytest.approx(16.97, abs=0.01)
    assert td.std_to_gamma(0.10) == pytest.approx(6.94, abs=0.01)
    for std in (0.02, 0.05, 0.1, 0.2, 0.28):
        g = td.std_to_gamma(std)
        assert np.sqrt((g + 1) / ((g + 2) ** 2 * (g + 3))) == pytest.approx(std, rel=1e-9)


def test_the_inner_product_of_two_profiles_is_their_integral():
    for ta, ga, tb, gb in ((100, 6.9, 100, 17.0), (40, 3.0, 100, 7.0), (100, 7.0, 40, 3.0), (10, 0.5, 11, 2.5)):
        tau = np.linspace(0, max(ta, tb), 2_000_001)
        pa = np.where(tau <= ta, (ga + 1) * tau ** ga / ta ** (ga + 1), 0)
        pb = np.where(tau <= tb, (gb + 1) * tau ** gb / tb ** (gb + 1), 0)
        assert sd.profile_inner(ta, ga, tb, gb) == pytest.approx(np.trapezoid(pa * pb, tau), rel=1e-4)


def weight_sequence(n, seed=0):
    """n steps of a random walk of two small tensors, as an optimizer's weights."""
    g = torch.Generator().manual_seed(seed)
    walk = [torch.randn(3, 4, generator=g, dtype=torch.float64), torch.randn(5, generator=g, dtype=torch.float64)]
    out = []
    for _ in range(n):
        walk = [w + 0.1 * torch.randn(w.shape, generator=g, dtype=torch.float64) for w in walk]
        out.append(walk)
    return out


def brute_force(seq, t, std):
    """The power-function EMA at step t from the profile itself: step tau's weights count
    (tau^(g+1) - (tau-1)^(g+1)) / t^(g+1), the profile's integral over (tau - 1, tau]."""
    g = td.std_to_gamma(std)
    w = [(tau ** (g + 1) - (tau - 1) ** (g + 1)) / t ** (g + 1) for tau in range(1, t + 1)]
    return [sum(wi * seq[i][j] for i, wi in enumerate(w)) for j in range(len(seq[0]))]


def run_phema(seq, every):
    """PowerEMA's running averages of the sequence, snapshotted every `every` steps as a run does."""
    net = torch.nn.ParameterList([torch.nn.Parameter(w.clone()) for w in seq[0]]).double()
    emas = [td.PowerEMA(net.parameters(), std, net) for std in td.PHEMA_STDS]
    snaps = []
    for step, weights in enumerate(seq, 1):
        with torch.no_grad():
            for p, w in zip(net.parameters(), weights):
                p.copy_(w)
        for e in emas:
            e.update()
        if step % every == 0:
            snaps.append({"step": step, "profiles": td.phema_state(emas, net)})
    return net, snaps


def test_power_ema_is_its_profile_and_a_profiles_own_length_is_rebuilt_exactly(tmp_path):
    seq = weight_sequence(400)
    net, snaps = run_phema(seq, every=50)
    last = snaps[-1]["profiles"]
    for p, std in zip(last, td.PHEMA_STDS):  # the running update is the profile's weighted sum
        want = brute_force(seq, 400, std)
        for k, w in zip(("0", "1"), want):
            torch.testing.assert_close(p["weights"][k], w, rtol=1e-9, atol=1e-9)
    for i, s in enumerate(snaps):
        torch.save(s, tmp_path / f"phema_{s['step']:07d}.pt")
    # a length that a profile holds at the last snapshot: the least squares picks that snapshot alone
    for p, std in zip(last, td.PHEMA_STDS):
        got = sd.posthoc_ema(str(tmp_path), 400, std, net)
        for k in ("0", "1"):
            torch.testing.assert_close(got[k].double(), p["weights"][k], rtol=1e-5, atol=1e-5)
    # one in between is rebuilt nearer the brute-force average than either profile comes
    want = brute_force(seq, 400, 0.075)
    got = sd.posthoc_ema(str(tmp_path), 400, 0.075, net)
    err = lambda ws: sum((ws[k].double() - w).norm() for k, w in zip(("0", "1"), want))  # noqa: E731
    assert err(got) < 0.5 * min(err(p["weights"]) for p in last), (err(got), [err(p["weights"]) for p in last])
    # at an earlier step only the snapshots up to it count
    early = sd.posthoc_ema(str(tmp_path), 200, 0.05, net)
    torch.testing.assert_close(early["0"].double(), snaps[3]["profiles"][0]["weights"]["0"], rtol=1e-5, atol=1e-5)


def test_the_evals_ema_is_a_power_profile_by_default_and_the_presets_keep_dits_decay():
    raw = td.build_model(td.Config(**TINY), 16, 3, 5, CPU)
    ema, phemas = td.build_emas(td.Config(**TINY), raw, None, 1)
    assert isinstance(ema, td.PowerEMA) and ema.std == 0.02 and phemas == []
    ema, phemas = td.build_emas(td.Config(**{**TINY, "ema_std": 0.0, "phema_every": 10}), raw, None, 1)
    assert type(ema) is td.EMA and ema.decay == 0.999 and [e.std for e in phemas] == [0.05, 0.10]
    ema, _ = td.build_emas(td.Config(**{**TINY, "ema": 0.0}), raw, None, 1)
    assert ema is None  # --ema=0: no average at all
    for name in ("cifar10", "imagenet64"):  # DiT's fixed 0.9999, unmeasured here
        assert td.PRESETS[name]["ema"] == 0.9999 and td.PRESETS[name]["ema_std"] == 0.0


@pytest.mark.slow
def test_a_run_snapshots_its_profiles_resumes_them_exactly_and_samples_from_them(shapes, tmp_path):  # noqa: F811
    """--phema_every: snapshots at its steps and the end; a resume goes on with the same profiles (bit for bit);
    sample_diffusion.py --ema_std=0.05 samples with the last snapshot's 0.05 profile, as the least squares says."""
    a, b = tmp_path / "a", tmp_path / "b"
    kw = dict(max_steps=8, phema_every=3, class_dropout=0.3)
    td.main(tiny(shapes, a, save_every=4, keep_last=5, **kw))
    assert sorted(os.listdir(a / "phema")) == [f"phema_000000{s}.pt" for s in (3, 6, 8)]
    b.mkdir()
    shutil.copy(a / "ckpt_0000004.pt", b)
    td.main(tiny(shapes, b, resume=True, **kw))
    for name in ("phema_0000006.pt", "phema_0000008.pt"):
        pa, pb = (torch.load(d / "phema" / name, weights_only=True)["profiles"] for d in (a, b))
        assert all(torch.equal(pa[i]["weights"][k], pb[i]["weights"][k]) for i in range(2) for k in pa[i]["weights"])
    last = torch.load(a / "phema" / "phema_0000008.pt", weights_only=True)["profiles"][0]["weights"]
    ckpt, path = td.load_checkpoint(str(a))
    model, *_ = sd.load_model(path, ckpt, str(a), CPU)
    mixed = sd.posthoc_ema(str(a / "phema"), 8, 0.05, model)
    assert all(torch.allclose(mixed[k], last[k], atol=1e-5) for k in last)
    out = sd.main(sd.Config(ckpt=str(a), device="cpu", sample_steps=3, per_class=1, ema_std=0.05,
                            guidance_interval="0.2,0.8", guide=str(a / "ckpt_0000004.pt")))
    assert out["grid"].endswith("_interval0.2-0.8_guide4_ema0.05.png") and os.path.exists(out["grid"])
    with pytest.raises(SystemExit, match="phema_every"):  # a resume must keep the snapshots as they began
        td.main(tiny(shapes, b, resume=True, **{**kw, "phema_every": 0, "max_steps": 12}))
    with pytest.raises(SystemExit, match="ema_std=0.02"):  # and the evals' EMA
        td.main(tiny(shapes, b, resume=True, **{**kw, "ema_std": 0.05, "max_steps": 12}))


def test_sampling_refuses_what_it_cannot_rebuild_or_guide_by(shapes, tmp_path):  # noqa: F811
    run = tmp_path / "run"
    td.main(tiny(shapes, run, max_steps=2))
    with pytest.raises(SystemExit, match="phema_every"):  # trained without snapshots
        sd.main(sd.Config(ckpt=str(run), device="cpu", sample_steps=2, per_class=1, ema_std=0.1))
    other = tmp_path / "other"
    td.main(tiny(shapes, other, max_steps=2, objective="ddpm"))
    with pytest.raises(SystemExit, match="another task"):
        sd.main(sd.Config(ckpt=str(run), device="cpu", sample_steps=2, per_class=1, guide=str(other)))
    for bad, match in ((dict(ema_std=0.4), "ema_std"), (dict(guidance_interval="1,0"), "guidance_interval"),
                       (dict(samples=0, eval_classifier=str(run)), "nothing to score")):
        with pytest.raises(SystemExit, match=match):
            sd.main(sd.Config(ckpt=str(run), device="cpu", **bad))
    assert not glob.glob(str(run / "sample_*"))
