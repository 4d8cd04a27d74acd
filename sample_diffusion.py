"""
sample_diffusion.py: a grid of samples from a checkpoint of train_diffusion.py, scored if you ask.

It draws the samples with the run's own model (the EMA weights where the run kept an EMA) and the
sampler settings you give: the sampler, its steps, the guidance scale and interval, the seed of the
noise. With --guide, a worse model of the same task guides instead of the unconditional one
(autoguidance); with --ema_std, the weights are an EMA of that width rebuilt after training from the
run's --phema_every snapshots (post-hoc EMA). With --eval_classifier, a train_vit.py classifier of
the same data scores them as the run's evals do: how often it recognises the class a sample was
asked for, and the Frechet distance of its features.

  python train_diffusion.py                                  # a run to sample from, in out/diffusion
  python sample_diffusion.py --ckpt=out/diffusion --cfg_scale=3 --sampler=heun
  python sample_diffusion.py --ckpt=out/diffusion --samples=500 --eval_classifier=out/vit
  python sample_diffusion.py --ckpt=out/diffusion --guide=out/diffusion/ckpt_0001000.pt --cfg_scale=2
  python sample_diffusion.py --ckpt=out/diffusion --ema_std=0.05     # a run trained with --phema_every
  python sample_diffusion.py -h                              # every flag, with its default

The grid goes beside the checkpoint, named by its settings (sample_heun32_cfg3_seed0.png), unless
--out names it. It imports train_diffusion.py for the model, the sampler, the checkpoint reader
and the flag parser, so a sample here is drawn by the very code that draws a run's eval samples.
"""
import dataclasses
import glob
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch

import train_diffusion as td

# -----------------------------------------------------------------------------
# Config

@dataclass
class Config:
    ckpt: str = "out/diffusion"  # a checkpoint file, or a run's out_dir (its newest)
    out: str = ""  # the grid's PNG; empty: beside the checkpoint, named by the settings
    # sampling: the flags of train_diffusion.py's evals, with the same defaults
    sampler: Literal["auto", "euler", "heun", "ddim"] = "auto"  # auto: euler (flow), ddim (ddpm)
    sample_steps: int = 16  # sampler steps (heun: 2 calls a step)
    cfg_scale: float = 2.5  # guidance: 1 = conditional, 0 = unconditional (or, with --guide, the guide)
    guidance_interval: str = "0,1"  # LO,HI: guide only at LO < t <= HI (1 = noise)
    guide: str = ""  # a worse checkpoint of the same task to guide by (autoguidance); empty: unconditional
    ema_std: float = 0.0  # rebuild an EMA of this relative width from the run's snapshots; 0: the run's EMA
    sample_seed: int = 0  # the noise's seed: one seed, one grid
    per_class: int = 8  # columns of the grid (rows: classes)
    # scoring
    samples: int = 500  # drawn for --eval_classifier (the grid shows the first)
    eval_classifier: str = ""  # a train_vit.py checkpoint of the same data: scores
    fid_weights: str = ""  # clean-fid's Inception TorchScript: FID as well
    # system
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"  # where the model runs
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # of the matmuls

# train_diffusion.py's flag parser reads a script's presets; sampling has no sizes to name
PRESETS = {}

# samples per forward: the model runs on the guided pairs, so a forward holds twice as many
BATCH = 256

def check_config(cfg):
    """Reject impossible flags in one line that names the fix, before any work."""
    # the flag parser checks a Literal's choices; a Config built in Python is checked here
    for field in dataclasses.fields(cfg):
        td.choose(field, getattr(cfg, field.name))
    for low, keys in ((1, "sample_steps per_class"), (0, "cfg_scale samples")):
        for k in keys.split():
            if getattr(cfg, k) < low:
                td.die(f"--{k} must be at least {low}, got {getattr(cfg, k)}")
    if cfg.eval_classifier and cfg.samples < 1:  # the grid's few samples would be scored as if they were a set
        td.die(f"--samples={cfg.samples} leaves nothing to score; pass --samples=N (500 or more to compare)")
    td.parse_interval(cfg.guidance_interval)
    if not 0 <= cfg.ema_std <= 0.28:  # a power function's profile is at most 0.289 wide (gamma = 0)
        td.die(f"--ema_std={cfg.ema_std:g}: need 0 < std <= 0.28 (EDM2's are 0.05 and 0.10), or 0 for the run's EMA")
    for k in ("eval_classifier", "fid_weights", "guide"):
        if getattr(cfg, k) and not os.path.exists(getattr(cfg, k)):
            td.die(f"--{k}={getattr(cfg, k)}: no such file or directory")
    # found now, not after minutes of sampling: a grid that has nowhere to go
    folder = os.path.dirname(os.path.abspath(cfg.out))
    if cfg.out and (os.path.isdir(cfg.out) or not os.path.isdir(folder)):
        td.die(f"--out={cfg.out} is a folder, or its folder does not exist; name a .png in one that does")

# -----------------------------------------------------------------------------
# The model of a run

def load_model(path, ckpt, where, device):
    """(model, the run's Config, data meta, classes K; 0: unconditional) of the checkpoint ckpt read from path."""
    # Rebuilt from the run's own config: build_model then makes the very model that was trained.
    # Keys this train_diffusion.py no longer has (an older checkpoint's --sample, say) are left out.
    # Everything read from the file is inside exit_if_unreadable(): a crafted value stops in one line.
    with td.exit_if_unreadable(path, "pass a checkpoint written by train_diffusion.py"):
        if ckpt is None or "objective" not in ckpt["config"]:  # a ViT's checkpoint has no objective
            td.die(f"no complete train_diffusion.py checkpoint at {where!r}; train first or pass --ckpt=PATH")
        fields = td.Config.__dataclass_fields__
        trained = td.Config(**{k: v for k, v in ckpt["config"].items() if k in fields})
        meta, K = ckpt["data_meta"], ckpt["num_classes"]
        (H, W), C = meta["image_size"], meta["channels"]
        model = td.build_model(trained, H, C, K, device)
        # the EMA's weights sample better than the last step's, where the run kept them
        model.load_state_dict(ckpt["ema"] or ckpt["model"])
    return model, trained, meta, K

def real_images(data_dir, device):
    """The val images (n, H, W, C) uint8 of the run's data: what a Frechet distance compares with."""
    if not os.path.exists(data_dir):
        td.die(f"the checkpoint's data_dir {data_dir!r} is gone; the Frechet distance needs its images")
    _, arrays = td.load_image_data(data_dir, ("val",))
    images, _ = arrays["val"]
    return torch.from_numpy(np.array(images)).to(device)

# -----------------------------------------------------------------------------
# Post-hoc EMA (Karras et al. 2024, EDM2, section 3 and appendix C)
# A power-function EMA at update t weighs the weights of step tau by the profile
#   p(tau) = (gamma + 1) tau^gamma / t^(gamma + 1) on [0, t], and 0 after,
# which integrates to 1 (train_diffusion.PowerEMA; a step's weights hold on (tau - 1, tau]). A run's
# snapshots are such averages at many (t, gamma). A mix sum_i x_i snapshot_i is itself an average
# of the weights, with profile sum_i x_i p_i; the x that bring it closest to the profile wanted, in
# the L2 norm over tau, solve the normal equations A x = b: A_ij = <p_i, p_j>, b_i = <p_i, p_target>.

def profile_inner(ta, ga, tb, gb):
    """<p_a, p_b>, the integral over tau of two profiles' product (a at (ta, ga), b at (tb, gb))."""
    if ta > tb:  # symmetric: let a end first
        ta, ga, tb, gb = tb, gb, ta, ga
    # the integral of (ga + 1)(gb + 1) tau^(ga + gb) / (ta^(ga + 1) tb^(gb + 1)) over [0, ta]
    scale = (ga + 1) * (gb + 1) / (ga + gb + 1)
    return scale / tb * (ta / tb) ** gb

def phema_coefficients(profiles, t, std):
    """Least-squares weights x of the snapshots' profiles [(t_i, gamma_i)] that rebuild the EMA of
    relative width std at step t."""
    g = td.std_to_gamma(std)
    A = np.zeros((len(profiles), len(profiles)))
    b = np.zeros(len(profiles))
    for i, (ta, ga) in enumerate(profiles):
        b[i] = profile_inner(ta, ga, t, g)
        for j, (tb, gb) in enumerate(profiles):
            A[i, j] = profile_inner(ta, ga, tb, gb)
    # A is a Gram matrix of nearly parallel profiles, so ill-conditioned: solved in float64 by lstsq
    return np.linalg.lstsq(A, b, rcond=None)[0]

def posthoc_ema(folder, step, std, model):
    """{name: tensor} of model's parameters, an EMA of width std at step rebuilt from the snapshots in
    folder (phema_STEP.pt, written by train_diffusion.py --phema_every) up to step."""
    profiles, weights = [], []  # (t, gamma) of each profile of each snapshot, and its weights
    for path in sorted(glob.glob(os.path.join(folder, "phema_*.pt"))):
        with td.exit_if_unreadable(path, "delete it, or pass --ema_std=0 for the run's EMA"):
            snap = torch.load(path, map_location="cpu", weights_only=True, mmap=True)  # read as it is used
            if snap["step"] > step:  # it belongs to a run that went on past this checkpoint
                continue
            for p in snap["profiles"]:
                profiles.append((int(p["t"]), td.std_to_gamma(p["std"])))
                weights.append(p["weights"])
    if not profiles:
        td.die(f"--ema_std: no snapshots up to step {step} in {folder}; train with --phema_every=N")
    x = phema_coefficients(profiles, step, std)
    mixed = {}
    for k, _ in model.named_parameters():  # a parameter at a time, so memory holds one mix
        mix = torch.zeros_like(weights[0][k], dtype=torch.float64)
        for w, ws in zip(x, weights):
            mix += float(w) * ws[k].double()
        mixed[k] = mix.float()
    return mixed

# -----------------------------------------------------------------------------
# Sampling

def main(cfg):
    """Write the grid of --ckpt's samples, score them with --eval_classifier; returns {grid, sample_s, scores}."""
    check_config(cfg)
    ckpt, path = None, None
    if os.path.exists(cfg.ckpt):  # a damaged file stops in load_checkpoint, saying what is wrong with it
        ckpt, path = td.load_checkpoint(cfg.ckpt)
    _, _, device = td.setup_dist(cfg.device)
    # autocast for the model's matmuls only: the sampler's steps stay fp32 (draw_samples)
    _, ctx, _ = td.setup_precision(device, cfg.dtype)
    model, trained, meta, K = load_model(path, ckpt, cfg.ckpt, device)
    weights = "EMA" if ckpt["ema"] else "raw"
    if cfg.ema_std:  # the weights of another EMA length, rebuilt from the run's snapshots
        folder = os.path.join(os.path.dirname(path), "phema")
        rebuilt = posthoc_ema(folder, ckpt["step"], cfg.ema_std, model)
        model.load_state_dict(rebuilt, strict=False)  # the parameters; the buffers stay the run's
        weights = f"post-hoc EMA {cfg.ema_std:g}"
    guide = None
    if cfg.guide:  # autoguidance: a worse model of the same task, the same images and classes
        guide_ckpt, guide_path = td.load_checkpoint(cfg.guide)
        guide, theirs, guide_meta, guide_K = load_model(guide_path, guide_ckpt, cfg.guide, device)
        same_data = guide_meta == meta and guide_K == K
        same_objective = theirs.objective == trained.objective and theirs.predict == trained.predict
        if not (same_data and same_objective):
            td.die(f"--guide={cfg.guide}: its model learned another task (data, classes or objective) than "
                   f"{path}'s; pass a checkpoint of the same run, or of one with the same flags but its size")
    # a sampler integrates the objective the run learned: Euler or Heun a flow, DDIM a DDPM
    if cfg.sampler != "auto" and (cfg.sampler == "ddim") != (trained.objective == "ddpm"):
        td.die(f"--sampler={cfg.sampler} does not fit --objective={trained.objective} (the checkpoint's): "
               "euler|heun sample flow, ddim samples ddpm")
    sampler = cfg.sampler
    if sampler == "auto":  # what td.sample runs for this objective
        sampler = "euler" if trained.objective == "flow" else "ddim"
    # td.sample and td.draw_samples read the sampler's settings from a train_diffusion.py Config:
    # the run's, with this command's settings in place of its own
    settings = dict(sampler=cfg.sampler, sample_steps=cfg.sample_steps, cfg_scale=cfg.cfg_scale,
                    guidance_interval=cfg.guidance_interval, sample_seed=cfg.sample_seed)
    run = dataclasses.replace(trained, **settings)
    # this command's sampler settings are its own flags, not the run's: say so where they differ from what the
    # run's evals sampled with, so that a grid is not read as the run's own
    differ = []
    for k in ("sampler", "sample_steps", "cfg_scale", "guidance_interval"):
        if getattr(trained, k) != settings[k]:
            differ.append(f"--{k}={getattr(trained, k)}")
    if differ:
        theirs = " ".join(differ)
        print(f"# the run's evals sampled with {theirs}; this command's differ (pass those to sample as they did)")
    rows = K or cfg.per_class  # a row per class; unconditional: a square grid
    n = rows * cfg.per_class
    if cfg.eval_classifier:  # a score needs more samples than a grid shows
        n = max(n, cfg.samples)
    guidance = f"guided by {guide_path} (step {guide_ckpt['step']})" if guide else "cfg"
    print(f"# {path} (step {ckpt['step']}, {weights} weights) | {n} samples | {sampler} {cfg.sample_steps} "
          f"steps | {guidance} scale {cfg.cfg_scale:g} at t in ({cfg.guidance_interval}] | seed {cfg.sample_seed}")

    # where the grid goes, checked before the sampling that fills it (issue 61); named by what differs
    name = f"sample_{sampler}{cfg.sample_steps}_cfg{cfg.cfg_scale:g}_seed{cfg.sample_seed}"
    if cfg.guidance_interval != "0,1":
        name += f"_interval{cfg.guidance_interval.replace(',', '-')}"
    if guide:
        name += f"_guide{guide_ckpt['step']}"
    if cfg.ema_std:
        name += f"_ema{cfg.ema_std:g}"
    name += ".png"
    out = cfg.out or os.path.join(os.path.dirname(path), name)
    folder = os.path.dirname(os.path.abspath(out))
    if not os.access(folder, os.W_OK):
        td.die(f"cannot write {out}: its folder is not writable; pass --out=PATH.png in one that is")

    t0 = time.perf_counter()
    shape = (*meta["image_size"], meta["channels"])  # (H, W, C)
    alpha_bar = td.cosine_alpha_bar()  # DDPM's noise levels; a flow ignores them
    # one process: rank 0 of 1 draws them all
    samples = td.draw_samples(model, n, shape, K, run, alpha_bar, BATCH, 0, 1, ctx, guide)  # (n, H, W, C) uint8
    labels = meta["classes"] if K else None
    td.write_grid(out, samples[:rows * cfg.per_class].cpu().numpy(), rows, labels)
    res = {"grid": out, "sample_s": time.perf_counter() - t0}

    if cfg.eval_classifier:  # the run's evals score alike (td.evaluate_both): the numbers compare
        real = real_images(trained.data_dir, device)
        judge = td.Judge(cfg.eval_classifier, meta, cfg.fid_weights, device, real)
        res |= judge.score(samples[:cfg.samples], K)
    scores = "".join(f" | {k} {v:.4f}" for k, v in res.items() if k not in ("grid", "sample_s"))
    print(f"wrote {out} in {res['sample_s']:.1f} s{scores}")
    return res

# -----------------------------------------------------------------------------
# Entry point

if __name__ == "__main__":
    main(td.parse_args(Config, sys.argv[1:]))
