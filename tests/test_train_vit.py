"""train_vit.py: units, in-process CPU training runs, exact resume, prediction (predict_vit.py), bad input, two-rank
torchrun parity."""
import json
import math
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import faults
import predict_vit as pv
import prepare_data
import ranks
import train_diffusion as td
import train_vit as tv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCRIPT = os.path.join(ROOT, "train_vit.py")
TINY = dict(n_layer=2, n_head=2, n_embd=32, patch_size=4, batch_size=16, time_budget=0.0, warmup_steps=5,
            eval_every=0, log_every=1, device="cpu", compile="false", lr=3e-3, optimizer="adamw")


@pytest.fixture(scope="session")
def shapes(tmp_path_factory):
    """A small shapes dataset of 16x16 images: 3,000 train, 300 val."""
    d = tmp_path_factory.mktemp("shapes")
    splits = {"train": prepare_data.make_shapes(3000, 16, 0), "val": prepare_data.make_shapes(300, 16, 1)}
    prepare_data.write_images(d, splits, list(prepare_data.SHAPES), "shapes")
    return d


def tiny(data, out, **kw):
    return tv.Config(**{**TINY, "data_dir": str(data), "out_dir": str(out), **kw})


def records(out_dir, key):
    """{step: value} of key in a run's metrics.jsonl."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r[key] for r in map(json.loads, f) if key in r}


def run_script(*args, cwd=ROOT):
    """Run train_vit.py in a new process (two ranks: tests/ranks.py)."""
    return subprocess.run([sys.executable, SCRIPT, *args], capture_output=True, text=True, cwd=cwd, timeout=600)


META = {"classes": list("abcdefg"), "num_classes": 7, "image_size": [16, 16], "channels": 3, "mean": [0.5] * 3,
        "std": [0.25] * 3}

# ----------------------------------------------------------------------------- units


@pytest.mark.parametrize("kw", [dict(), dict(pool="cls", registers=2, pos_emb="learned"),
                                dict(mlp="swiglu", norm="layernorm", qk_norm=False, layer_scale=0.1, drop_path=0.2)])
def test_model_shapes_and_initial_loss(kw):
    cfg = tv.Config(**{**TINY, **kw})
    model = tv.build_model(cfg, META, torch.device("cpu"))
    x = torch.rand(3, 16, 16, 3)
    logits = model(x)
    assert logits.shape == (3, 7) and model(x, features=True).shape == (3, 32)
    # zero-init head: a uniform prediction, loss ln(K); zero-init output projections: each block is the identity
    assert torch.nn.functional.cross_entropy(logits, torch.arange(3)).item() == pytest.approx(math.log(7), abs=1e-5)
    assert all(b.attn.proj.weight.abs().sum() == 0 and b.mlp.proj.weight.abs().sum() == 0 for b in model.blocks)
    assert model.flops_per_image() > 0


def test_sincos_position_embedding():
    pe = tv.sincos_2d(4, 5, 16)
    assert pe.shape == (20, 16)
    # rows share the first half (row code), columns the second half (column code); all positions differ
    assert torch.equal(pe[0, :8], pe[4, :8]) and torch.equal(pe[0, 8:], pe[5, 8:])
    assert torch.cdist(pe, pe).add(torch.eye(20)).min() > 0.1


def test_patches_follow_the_image_layout():
    """A model whose patch embedding is the identity sees patch (i, j) of the image as token i * grid + j."""
    cfg = tv.Config(**{**TINY, "n_layer": 1, "n_embd": 48, "n_head": 2, "pos_emb": "learned"})
    model = tv.build_model(cfg, {**META, "mean": [0.0] * 3, "std": [1.0] * 3}, torch.device("cpu"))
    seen = []
    model.blocks[0].register_forward_hook(lambda m, i, o: seen.append(i[0]))
    with torch.no_grad():
        model.patch.weight.copy_(torch.eye(48))
        model.patch.bias.zero_()
        model.pos.zero_()
        x = torch.rand(1, 16, 16, 3)
        model(x)
    assert torch.equal(seen[0][0, 1 * 4 + 2], x[0, 4:8, 8:12].reshape(-1))


@pytest.mark.parametrize("script", [tv, td])
def test_flips_follow_the_data_unless_asked(script, capsys):
    """--flip=auto takes meta.json's flip_ok (a mirrored digit is not a digit); an explicit --flip wins; data prepared
    before the field existed keeps flipping, as it did, and the startup line says why."""
    cases = [("auto", {"flip_ok": False}, False), ("auto", {"flip_ok": True}, True), ("true", {"flip_ok": False}, True),
             ("false", {"flip_ok": True}, False), ("auto", {}, True)]
    for flag, meta, want in cases:
        flip, why = script.flips(script.Config(flip=flag), meta)
        assert flip is want and (("predates" in why) == (meta == {}))


def test_augment_translates_and_flips_and_mix_keeps_labels():
    cfg = tv.Config(translate=2)
    x = torch.rand(64, 8, 8, 3)
    torch.manual_seed(0)
    out = tv.augment(x, cfg, flip=False)
    # each image is its reflect-padded self, shifted by at most 2 pixels: its centre 4x4 appears somewhere
    for a, b in zip(x, out):
        assert any(torch.equal(b[2:6, 2:6], a[2 + dy:6 + dy, 2 + dx:6 + dx]) for dy in range(-2, 3) for dx in range(-2, 3))
    flipped = tv.augment(x, tv.Config(translate=0), flip=True)
    same, mirrored = [torch.equal(a, b) for a, b in zip(x, flipped)], [torch.equal(a.flip(1), b) for a, b in zip(x, flipped)]
    assert all(s or m for s, m in zip(same, mirrored)) and 10 < sum(mirrored) < 54
    y = torch.arange(64)
    for kw in (dict(mixup=0.8), dict(cutmix=1.0)):
        xm, ya, yb, lam = tv.mix(x, y, tv.Config(**kw))
        assert 0 <= lam <= 1 and torch.equal(ya, y) and torch.equal(yb, y.flip(0)) and xm.shape == x.shape
        if "mixup" in kw:
            torch.testing.assert_close(xm, lam * x + (1 - lam) * x.flip(0))
        else:  # the pasted box is exactly the fraction 1 - lam of each image
            pasted = (xm != x).any(-1).float().mean((1, 2))
            assert pasted.max().item() <= 1 - lam + 1e-6


def test_ema_warms_up_and_swaps():
    p = torch.nn.Parameter(torch.zeros(3))
    ema = tv.EMA([p], 0.9)
    with torch.no_grad():
        p.fill_(1.0)
    ema.update()  # t = 1: decay min(0.9, 2/11)
    assert ema.shadow[0][0].item() == pytest.approx(1 - 2 / 11)
    ema.swap()
    assert p[0].item() == pytest.approx(1 - 2 / 11) and ema.shadow[0][0].item() == 1.0
    ema.swap()
    assert p[0].item() == 1.0


def test_loader_ranks_partition_the_global_batch_and_resume():
    x, y = np.zeros((50, 4, 4, 3), np.uint8), np.arange(50)
    loaders = [tv.ImageLoader(x, y, 4, r, 2, torch.device("cpu"), seed=3) for r in range(2)]
    seen = [torch.cat([ld.next()[1] for ld in loaders]) for _ in range(6)]  # 6 global batches of 8: 48 of 50
    assert len(set(torch.cat(seen).tolist())) == 48  # no image twice within an epoch
    assert torch.cat(seen).tolist() != list(range(48))  # and not in the file's order: shuffled
    state = loaders[0].state()
    nxt = loaders[0].next()[1]  # the 7th batch starts epoch 1 (the 2 left over are dropped)
    assert loaders[0].epoch == 1
    fresh = tv.ImageLoader(x, y, 4, 0, 2, torch.device("cpu"), seed=3)
    fresh.load_state(state)
    assert torch.equal(fresh.next()[1], nxt)

# ----------------------------------------------------------------------------- training runs


def test_overfit_one_batch():
    cfg = tv.Config(**{**TINY, "n_embd": 64})
    model = tv.build_model(cfg, META, torch.device("cpu"))
    x, y = torch.rand(16, 16, 16, 3), torch.randint(0, 7, (16,))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    for _ in range(150):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.05 and (model(x).argmax(-1) == y).all()


@pytest.mark.slow
def test_learns_shapes_and_writes_its_files(shapes, tmp_path):
    cfg = tiny(shapes, tmp_path / "run", n_embd=64, max_steps=400, batch_size=64, log_every=10, eval_every=200,
               warmup_steps=20, ema=0.99)
    res = tv.main(cfg)
    loss = records(cfg.out_dir, "loss")
    # bars about half way from chance to what the run reaches (seeds 1-3 and 1337: train loss down 0.26-0.35,
    # val loss 1.70-1.80 from ln 10 = 2.30, accuracy 29-33% from 10%); CI once failed a 30% bar at 29%
    assert np.mean([loss[s] for s in range(310, 401, 10)]) < np.mean([loss[s] for s in range(10, 101, 10)]) - 0.12
    assert res["val_loss"] < math.log(10) - 0.3
    assert max(res["val_acc"], res["ema_val_acc"]) > 0.2  # chance is 0.10
    assert len(res["per_class_acc"]) == 10 and res["steps"] == 400
    for f in ("config.json", "metrics.jsonl", "accuracy.png", "confusion.png", "ckpt_0000400.pt"):
        assert (tmp_path / "run" / f).exists(), f
    assert (tmp_path / "results.tsv").read_text().count("train_vit.py") == 1
    # predict_vit.py on images written as PNG, with the checkpoint of this run
    from PIL import Image
    x, y = prepare_data.make_shapes(4, 16, 7)
    (tmp_path / "images").mkdir()
    for i, im in enumerate(x):
        Image.fromarray(im).save(tmp_path / "images" / f"im{i}.png")
    out = pv.main(pv.Config(images=str(tmp_path / "images"), ckpt=cfg.out_dir, device="cpu", show=3))
    assert len(out) == 4 and all(len(p) == 3 and sum(p.values()) <= 1 + 1e-5 for p in out.values())


@pytest.mark.slow
@pytest.mark.parametrize("optimizer, loader", [("adamw", "device"), ("muon", "device"), ("adamw", "host")])
def test_resume_is_exact(shapes, tmp_path, optimizer, loader):
    """Stop at step 4 (by keeping only that checkpoint), resume: steps 5..8, the weights and the EMA must equal the
    uninterrupted run's, bit for bit, with augmentation, mixup/cutmix and stochastic depth on; on either loader path."""
    import shutil
    a, b = tmp_path / "a", tmp_path / "b"
    kw = dict(max_steps=8, mixup=0.5, cutmix=1.0, drop_path=0.1, optimizer=optimizer, ema=0.9, loader=loader)
    ra = tv.main(tiny(shapes, a, save_every=4, keep_last=5, **kw))
    b.mkdir()
    shutil.copy(a / "ckpt_0000004.pt", b)
    rb = tv.main(tiny(shapes, b, resume=True, **kw))
    la, lb = records(a, "loss"), records(b, "loss")
    assert sorted(lb) == [5, 6, 7, 8] and all(la[s] == lb[s] for s in lb), (la, lb)
    assert ra["ema_val_loss"] == rb["ema_val_loss"] and ra["val_loss"] == rb["val_loss"]
    ca, _ = tv.load_checkpoint(str(a))
    cb, _ = tv.load_checkpoint(str(b))
    for key in ("model", "ema"):
        assert all(torch.equal(ca[key][k], cb[key][k]) for k in ca[key])
    assert not all(torch.equal(ca["model"][k], ca["ema"][k]) for k in ca["model"])  # the EMA is not the live weights


@pytest.mark.slow
def test_guards_skip_a_nan_and_sigterm_saves(shapes, tmp_path, capsys):
    with faults.inject(tv, "nan@6"):
        res = tv.main(tiny(shapes, tmp_path / "nan", max_steps=12))
    assert "update skipped: non-finite" in capsys.readouterr().out and res["steps"] == 12
    with faults.inject(tv, "sigterm@5"):
        res = tv.main(tiny(shapes, tmp_path / "term", max_steps=12))
    assert res["preempted"] and res["steps"] == 5 and tv.list_checkpoints(str(tmp_path / "term"))[-1][0] == 5


@pytest.mark.parametrize("args,message", [
    (["--pool=max"], "is not one of gap|cls"),
    (["--n_embd=30", "--n_head=4"], "must split into"),
    (["--patch_sise=4"], "did you mean --patch_size"),
    (["--ema=1.0"], "0 <= --ema, --drop_path"),
    (["--max_steps=0", "--time_budget=0"], "no training budget"),
    (["--max_steps=-3"], "--max_steps must be at least 0, got -3"),  # budgets that would never end
    (["--max_steps=5", "--time_budget=-1"], "--time_budget must be at least 0, got -1.0"),
    # jobs that moved to predict_vit.py: the old flag names the new command (issue 59)
    (["--predict=x.png", "--ckpt=out/vit"], "--predict moved: python predict_vit.py --ckpt=out/vit --images=PATH"),
    (["--top_k=3"], "--top_k moved: python predict_vit.py --ckpt="),  # the --out_dir given (issue 80), then
    (["--top_k=3"], "/o --images=PATH --show=K"),
])
def test_bad_flags_give_one_line_errors(args, message, tmp_path, as_a_user):
    status, err = as_a_user("train_vit.py", *args, f"--out_dir={tmp_path}/o", cwd=tmp_path)
    assert status != 0 and message in err and len(err.strip().splitlines()) == 1, err


def test_bad_data_gives_one_line_errors(shapes, tmp_path):
    with pytest.raises(SystemExit, match="no prepared images"):
        tv.main(tiny(tmp_path / "missing", tmp_path / "o", max_steps=1))
    with pytest.raises(SystemExit, match="--image_size=32 but the images"):
        tv.main(tiny(shapes, tmp_path / "o", max_steps=1, image_size=32))
    with pytest.raises(SystemExit, match="do not split into 5x5 patches"):
        tv.main(tiny(shapes, tmp_path / "o", max_steps=1, patch_size=5))
    with pytest.raises(SystemExit, match="--translate=16 must be under the images' side, 16"):
        tv.main(tiny(shapes, tmp_path / "o", max_steps=1, translate=16))
    bad = tmp_path / "bad"
    bad.mkdir()
    for f in os.listdir(shapes):
        os.symlink(shapes / f, bad / f)
    os.remove(bad / "val_labels.npy")
    np.save(bad / "val_labels.npy", np.zeros(7, np.int64))  # 300 images, 7 labels
    with pytest.raises(SystemExit, match="300 images and 7 labels"):
        tv.main(tiny(bad, tmp_path / "o", max_steps=1))
    assert not (tmp_path / "o").exists()  # nothing written on bad input


@pytest.mark.slow
def test_existing_run_and_other_config_are_refused(shapes, tmp_path):
    tv.main(tiny(shapes, tmp_path / "run", max_steps=2))
    with pytest.raises(SystemExit, match="holds checkpoints of an earlier run"):
        tv.main(tiny(shapes, tmp_path / "run", max_steps=4))
    with pytest.raises(SystemExit, match="different config: n_layer=2"):
        tv.main(tiny(shapes, tmp_path / "run", max_steps=4, n_layer=3, resume=True))


@pytest.mark.slow
@pytest.mark.parametrize("parallel, loader", [("ddp", "device"), ("fsdp", "device"), ("ddp", "host")])
def test_two_ranks_match_one_process(shapes, tmp_path, parallel, loader):
    """Two gloo ranks with batch B each follow one process with batch 2B (augmentation and drop path off, as their
    random numbers differ per rank by design), EMA and eval included; the ranks read their images on either loader
    path, the one process on the device path."""
    common = ["--dtype=float32",  # the same math in fp32; bf16 rounds each micro-batch's sums apart
              "--n_layer=2", "--n_head=2", "--n_embd=32", "--max_steps=6", "--time_budget=0", "--log_every=1",
              "--eval_every=3", "--eval_images=100", "--device=cpu", "--compile=false", "--translate=0", "--flip=false",
              f"--data_dir={shapes}", "--warmup_steps=2", "--ema=0.9"]
    tv.main(tv.parse_args(tv.Config, [*common, "--batch_size=32", f"--out_dir={tmp_path}/one"]))  # in this process
    two = ranks.run([SCRIPT, *common, "--batch_size=16", f"--out_dir={tmp_path}/two", f"--parallel={parallel}",
                     "--save_every=3", f"--loader={loader}"])
    assert two.returncode == 0, two.stderr[-2000:]
    la, lb = records(tmp_path / "one", "loss"), records(tmp_path / "two", "loss")
    assert la.keys() == lb.keys() and all(abs(la[k] - lb[k]) < 1e-4 for k in la)
    ea, eb = records(tmp_path / "one", "ema_val_acc"), records(tmp_path / "two", "ema_val_acc")
    assert ea == pytest.approx(eb, abs=1e-6)
    # the EMA's loss is sensitive where accuracy is not: under FSDP2 a stale gathered root once hid the EMA weights
    la, lb = records(tmp_path / "one", "ema_val_loss"), records(tmp_path / "two", "ema_val_loss")
    assert la.keys() == lb.keys() and all(abs(la[k] - lb[k]) < 1e-4 for k in la)
    # resumed from step 3 (under FSDP a folder of each rank's shards), the weights, optimizer and EMA go on the same
    three = tv.list_checkpoints(str(tmp_path / "two"))[0][1]
    os.makedirs(tmp_path / "again")
    os.rename(three, tmp_path / "again" / os.path.basename(three))
    again = ranks.run([SCRIPT, *common, "--batch_size=16", f"--out_dir={tmp_path}/again", f"--parallel={parallel}",
                       "--resume", f"--loader={loader}"])
    assert again.returncode == 0, again.stderr[-2000:]
    for key in ("loss", "ema_val_loss"):
        lc = records(tmp_path / "again", key)
        assert lc and all(s > 3 and lc[s] == pytest.approx(records(tmp_path / "two", key)[s], abs=1e-6) for s in lc)


def glyph_folder(root, chars, per_class, seed):
    """An imagefolder of 32x32 grayscale letters (PNG), each at its own size, weight, slant, rotation, offset,
    contrast and noise: a small set where raw pixels line up poorly, as in real photos. Pillow's built-in font."""
    from PIL import Image, ImageDraw, ImageFont
    rng = np.random.default_rng(seed)
    for ch in chars:
        (root / ch).mkdir(parents=True)
        for i in range(per_class):
            im = Image.new("L", (64, 64))
            ImageDraw.Draw(im).text((32, 32), ch, fill=255, font=ImageFont.load_default(size=int(rng.integers(14, 24))),
                                    anchor="mm", stroke_width=int(rng.integers(0, 2)), stroke_fill=255)
            s, (dx, dy) = rng.uniform(-0.2, 0.2), rng.integers(-4, 5, 2)
            im = im.rotate(rng.uniform(-15, 15), Image.Resampling.BILINEAR).transform(
                im.size, Image.Transform.AFFINE, (1, s, -32 * s, 0, 1, 0), Image.Resampling.BILINEAR)
            a = np.asarray(im.crop((16 - dx, 16 - dy, 48 - dx, 48 - dy)), np.float64) / 255
            bg, fg = rng.uniform(0.6, 1), rng.uniform(0, 0.4)  # dark ink on light paper
            a = bg + (fg - bg) * a + rng.normal(0, 0.05, a.shape)
            Image.fromarray((255 * a.clip(0, 1)).astype(np.uint8)).save(root / ch / f"{i:03d}.png")


@pytest.mark.slow
def test_small_real_set_learns_past_a_linear_baseline(tmp_path):
    """Letters brought through prepare_data.py imagefolder, 1,125 train images: the default model (which takes width 64
    on a set this small) beats the best ridge classifier on the raw pixels of the same split."""
    glyph_folder(tmp_path / "letters", "ACEHKLNRTX", 150, 0)
    prepare_data.main(["imagefolder", str(tmp_path / "letters"), f"--data_dir={tmp_path / 'data'}", "--val_fraction=0.25"])
    meta, arrays = tv.load_image_data(str(tmp_path / "data"))
    (xt, yt), (xv, yv) = ((torch.from_numpy(np.array(x)).flatten(1).double() / 255, torch.from_numpy(y)) for x, y in
                          (arrays["train"], arrays["val"]))
    xt, xv = (torch.cat((x - xt.mean(0), torch.ones(len(x), 1, dtype=x.dtype)), 1) for x in (xt, xv))
    linear = max((xv @ torch.linalg.solve(xt.T @ xt + lam * torch.eye(xt.size(1), dtype=xt.dtype),
                                          xt.T @ torch.nn.functional.one_hot(yt).double())).argmax(1).eq(yv).double().mean().item()
                 for lam in (1, 10, 100, 1000, 10000))
    res = tv.main(tv.Config(data_dir=str(tmp_path / "data"), out_dir=str(tmp_path / "run"), time_budget=0.0,
                            max_steps=400, eval_every=0, device="cpu", compile="false"))
    assert json.load(open(tmp_path / "run" / "config.json"))["n_embd"] == 64 and meta["channels"] == 1
    # measured (2 cores): ridge 35.2%, the model 93.9% at these 400 steps with Muon, the default since 2026-11-23
    # (93.1% at 600 steps, 84.1% at 350, 65.1% at 300; 72.8% at 600 with AdamW); chance 10%. The bar, linear + 20
    # points, sits 34% of the way from the ridge to the run, 54% from chance
    assert max(res["val_acc"], res["ema_val_acc"]) > linear + 0.2, (linear, res["val_acc"], res["ema_val_acc"])
