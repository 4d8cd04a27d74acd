"""
train_diffusion.py: a class-conditional diffusion transformer (DiT) on pixels, in one file.

Rectified flow by default (the network predicts the clean image, the loss is on the velocity;
logit-normal timesteps; Euler or Heun), or DDPM epsilon-prediction (cosine schedule, min-SNR,
DDIM). adaLN-Zero conditioning on timestep and class, label dropout for classifier-free
guidance, samples from an EMA of the weights; AdamW; precision, compile, DDP or FSDP2, exact
resume and guards as in train_gpt.py. Quality, offline: the held-out denoising loss and, with a
train_vit.py classifier, its accuracy on the samples and the Frechet distance of its features.

  python train_diffusion.py            # CPU demo: upright shapes, 7 min of training, samples.png
  python train_vit.py && python train_diffusion.py --eval_classifier=out/vit  # scored samples
  python train_diffusion.py --sample --ckpt=out/diffusion --cfg_scale=3 --sampler=heun
  python prepare_data.py cifar10 && torchrun --nproc_per_node=8 train_diffusion.py --preset=cifar10
  python train_diffusion.py --benchmark --preset=cifar10
  python train_diffusion.py -h         # every flag, with its default
"""
import contextlib
import copy
import dataclasses
import difflib
import functools
import glob
import inspect
import json
import math
import os
import pickle
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
import zipfile
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import kernels  # Triton attention and RMSNorm on CUDA; PyTorch elsewhere

# -----------------------------------------------------------------------------
# Config

@dataclass
class Config:
    # data and output
    data_dir: str = "data/shapes_upright"  # images from prepare_data.py (shapes, cifar10, mnist, imagefolder...)
    out_dir: str = "out/diffusion"     # checkpoints, metrics.jsonl, config.json, sample grids; results.tsv beside it
    preset: str = ""                   # named overrides: cpu_demo|cifar10 (explicit flags still win)
    num_classes: int = -1              # -1 = the data's classes (unconditional if it has one); 0 = unconditional
    flip: Literal["auto", "true", "false"] = "auto"  # random horizontal flips; auto = the data's flip_ok
    # model
    image_size: int = 0                # 0 = the data's; else must equal it (resize with prepare_data.py --image_size)
    patch_size: int = 8                # pixels per side of a patch: (image_size / patch_size)^2 tokens (16 on shapes)
    n_layer: int = 4                   # transformer blocks
    n_head: int = 4                    # attention heads
    n_embd: int = 128                  # model width
    mlp_ratio: float = 4.0             # MLP hidden width / n_embd
    qk_norm: bool = True               # RMSNorm on queries and keys, bounds the attention logits
    init_std: float = 0.02             # std of the hidden weights at init; adaLN and the output layer start at zero
    class_dropout: float = 0.1         # fraction of labels replaced by the null label in training, for guidance
    # objective
    objective: Literal["flow", "ddpm"] = "flow"  # rectified-flow velocity, or DDPM epsilon on a cosine schedule
    t_mean: float = 0.8                # flow: t = sigmoid(N(t_mean, t_std^2)), logit-normal (SD3); > 0: noisier
    t_std: float = 0.8                 # flow: see t_mean
    predict: Literal["x", "v"] = "x"  # flow's network outputs the clean image (and the velocity follows) or v
    min_snr: float = 5.0               # ddpm: weight min(SNR, gamma) / SNR (Hang et al. 2023); 0 = plain epsilon MSE
    # sampling
    sampler: Literal["auto", "euler", "heun", "ddim"] = "auto"  # auto: euler for flow, ddim for ddpm
    sample_steps: int = 32             # sampler steps (heun makes two model calls per step)
    cfg_scale: float = 2.0             # classifier-free guidance: 1 = the conditional model alone, 0 = unconditional
    sample_seed: int = 0               # noise of the sample grids and the quality metrics: the same at every eval
    per_class: int = 8                 # columns of the sample grid (rows are classes)
    # budget: max_steps, else epochs, else time_budget
    max_steps: int = 0                 # optimizer steps; 0 = from epochs or time_budget
    epochs: float = 0.0                # passes over the train split; 0 = from max_steps or time_budget
    time_budget: float = 420.0         # seconds of training (eval excluded); the LR schedule follows elapsed time
    batch_size: int = 64               # micro-batch per rank, in images
    grad_accum: int = 1                # micro-steps per optimizer step
    # optimizer and schedule
    lr: float = 2e-3                   # peak LR
    weight_decay: float = 0.0          # decoupled, on 2-D hidden matrices only
    beta1: float = 0.9                 # AdamW
    beta2: float = 0.95                # AdamW
    grad_clip: float = 1.0             # max global grad norm; 0 = off
    schedule: Literal["constant", "cosine"] = "constant"  # after linear warmup
    warmup_steps: int = 100            # linear warmup, in optimizer steps
    final_lr_frac: float = 0.0         # LR at the end of cosine, as a fraction of the peak
    ema: float = 0.999                 # decay of the EMA of the weights (warmed up as min(ema, (1+t)/(10+t))); 0 = off
    # eval, logging, checkpoints
    eval_every: int = 1000             # steps between evals; 0 = only at the end
    eval_images: int = 500             # val images in the denoising loss (each at 8 timesteps); 0 = all
    eval_samples: int = 200            # samples drawn at each periodic eval (the grid and the classifier metrics)
    final_samples: int = 500           # samples drawn at the final eval and by --sample with --eval_classifier
    eval_classifier: str = ""          # a train_vit.py checkpoint on this data: accuracy on samples, Frechet distance
    fid_weights: str = ""              # optional Inception TorchScript (clean-fid's inception-2015-12-05.pt) for FID
    log_every: int = 50                # steps between log lines
    save_every: int = 0                # steps between checkpoints; 0 = only at the end
    keep_last: int = 2                 # newest checkpoints kept (milestones are kept besides)
    milestone_every: int = 0           # keep every checkpoint whose step is a multiple of this; 0 = none
    async_save: bool = False           # write checkpoints in a background thread (from a CPU copy of the state)
    resume: bool = False               # go on from the newest complete checkpoint in out_dir (auto on torchrun restart)
    wandb: str = ""                    # wandb project name; empty = off
    description: str = ""              # free text for the results.tsv experiment log
    # guards: a bad step's update is skipped; repeated bad steps roll back (see "When training goes wrong", README)
    loss_spike: float = 6.0            # a loss this many running stds above its running mean is a spike; 0 = off
    gnorm_spike: float = 0.0           # the same for the grad norm; 0 = off
    clip_mult: float = 0.0             # dynamic clipping at this multiple of the running grad-norm mean; 0 = off
    guard_window: int = 100            # steps in the running statistics and in the bad-step count
    rollback_after: int = 5            # bad steps in guard_window that roll back to the last good checkpoint; 0 = never
    # system
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # bf16 where fast (fp16 on old GPUs), else fp32
    compile: Literal["auto", "true", "false"] = "auto"  # auto: on for CUDA on Linux
    parallel: Literal["ddp", "fsdp"] = "ddp"  # used under torchrun
    offload: Literal["none", "params"] = "none"  # with fsdp, shards, grads and optimizer state in CPU memory
    seed: int = 1337                   # init, data order, noise and timesteps
    benchmark: bool = False            # time steps on synthetic images and exit; needs no data
    bench_steps: int = 20              # timed steps in --benchmark, after 5 warm-up steps
    profile: bool = False              # --benchmark: 3 more steps under torch.profiler; trace.json in out_dir, top ops
    kernels: Literal["auto", "triton", "torch"] = "auto"  # per op the faster (kernels.use), Triton, or PyTorch's
    # sampling from a checkpoint
    sample: bool = False               # write a sample grid from --ckpt's EMA weights (and score it) and exit
    ckpt: str = ""                     # checkpoint file or directory for --sample; empty = out_dir
    sample_out: str = ""               # PNG written by --sample; empty = named after the sampler, beside the checkpoint

PRESETS = {
    # the defaults: 1.3M parameters, 16 patches of 8x8 predicting the clean image, 420 s on 2 cores, on upright shapes
    # (prepare_data.py shapes --rotate=off): at every angle, a small model's samples blur into blobs (BENCHMARKS.md)
    "cpu_demo": {},
    # one GPU or a node: DiT-S/2 (Peebles & Xie 2023) on 32x32 images, 256 tokens; not yet measured for quality
    "cifar10": dict(data_dir="data/cifar10", out_dir="out/diffusion_cifar10", patch_size=2, n_layer=12, n_head=6,
                    n_embd=384, predict="v", t_mean=0.0, t_std=1.0, time_budget=0.0, epochs=400, batch_size=256,
                    lr=3e-4, cfg_scale=1.5, ema=0.9999, warmup_steps=1000, eval_every=10000, eval_images=10000,
                    eval_samples=1000, final_samples=10000, sample_steps=50),
}
ARCH_FIELDS = ("patch_size", "n_layer", "n_head", "n_embd", "mlp_ratio", "qk_norm", "objective", "predict")

# -----------------------------------------------------------------------------
# Model

def timestep_embedding(t, dim=256):
    """Sinusoidal features (B, dim), fp32, of t (B,) in [0, 1] scaled to DDPM's 0..1000."""
    half = dim // 2
    freqs = torch.exp(-math.log(10000) * torch.arange(half, device=t.device, dtype=torch.float32) / half)
    args = 1000 * t.float()[:, None] * freqs[None]
    return torch.cat((torch.cos(args), torch.sin(args)), dim=-1)

def modulate(x, shift, scale):
    """adaLN: shift and scale the normalised x (B, T, d) by per-sample (B, d) vectors."""
    return x * (1 + scale[:, None]) + shift[:, None]

class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hd = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.qk_norm = cfg.qk_norm
        if cfg.qk_norm:
            self.q_norm, self.k_norm = nn.Parameter(torch.ones(self.hd)), nn.Parameter(torch.ones(self.hd))

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, -1, self.hd).permute(2, 0, 3, 1, 4)  # (B, nh, T, hd)
        if self.qk_norm:
            q, k = kernels.rms_norm(q, self.q_norm), kernels.rms_norm(k, self.k_norm)
        y = kernels.attention(q, k, v, causal=False)  # no mask
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

class Block(nn.Module):
    """A DiT block with adaLN-Zero (Peebles & Xie 2023): the conditioning c sets each
    branch's shift, scale and gate; the gates start at 0, the block as the identity."""

    def __init__(self, cfg):
        super().__init__()
        d, hidden = cfg.n_embd, int(cfg.mlp_ratio * cfg.n_embd)
        self.attn = Attention(cfg)
        self.fc, self.proj = nn.Linear(d, hidden, bias=False), nn.Linear(hidden, d, bias=False)
        self.ada = nn.Linear(d, 6 * d)

    def forward(self, x, c):
        shift1, scale1, gate1, shift2, scale2, gate2 = self.ada(F.silu(c)).chunk(6, dim=-1)  # each (B, d)
        x = x + gate1[:, None] * self.attn(modulate(kernels.rms_norm(x), shift1, scale1))
        h = F.gelu(self.fc(modulate(kernels.rms_norm(x), shift2, scale2)), approximate="tanh")
        return x + gate2[:, None] * self.proj(h)

class DiT(nn.Module):
    def __init__(self, cfg, image_size, channels, num_classes):
        super().__init__()
        self.cfg, p, d = cfg, cfg.patch_size, cfg.n_embd
        self.grid = image_size // p
        self.patch = nn.Linear(p * p * channels, d)  # a stride-p convolution, as a matmul
        self.register_buffer("pos", torch.zeros(self.grid ** 2, d), persistent=False)
        self.t_mlp = nn.Sequential(nn.Linear(256, d), nn.SiLU(), nn.Linear(d, d))
        # a row per class and a last one for "no label", for guidance; none if unconditional
        self.y_emb = nn.Embedding(num_classes + 1, d) if num_classes else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        self.final_ada = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, p * p * channels)

    @torch.no_grad()
    def init_weights(self):
        """Initialise every parameter and buffer (the model was built on the meta device)."""
        c = self.cfg
        for name, p in self.named_parameters():
            if "ada." in name or name.startswith("out."):
                nn.init.zeros_(p)  # adaLN-Zero: blocks start as the identity, the output as 0
            elif p.ndim == 1:  # biases 0, norm gains 1
                nn.init.constant_(p, 0.0 if name.endswith("bias") else 1.0)
            else:
                nn.init.trunc_normal_(p, std=c.init_std, a=-2 * c.init_std, b=2 * c.init_std)
        self.pos.copy_(sincos_2d(self.grid, self.grid, c.n_embd))

    def forward(self, x, t, y=None):
        """x (B, H, W, C) noisy, t (B,) in [0, 1], y (B,) labels or None -> (B, H, W, C)."""
        B, H, W, C = x.shape
        p, g, x_t = self.cfg.patch_size, self.grid, x
        x = x.view(B, g, p, g, p, C).permute(0, 1, 3, 2, 4, 5).reshape(B, g * g, -1)  # patches
        x = self.patch(x) + self.pos.to(x.dtype)  # (B, N, d)
        c = self.t_mlp(timestep_embedding(t))  # (B, d): every block's conditioning
        if self.y_emb is not None:
            c = c + self.y_emb(y)
        for block in self.blocks:
            x = block(x, c)
        shift, scale = self.final_ada(F.silu(c)).chunk(2, dim=-1)
        x = self.out(modulate(kernels.rms_norm(x), shift, scale))  # (B, N, p*p*C)
        x = x.view(B, g, g, p, p, C).permute(0, 1, 3, 2, 4, 5).reshape(B, H, W, C)
        if self.cfg.predict == "x" and self.cfg.objective == "flow":
            # x-prediction (Li & He 2025, "Back to Basics"): the network outputs the clean
            # image, near a low-dimensional manifold, which a width-d token carries even if
            # p*p*C > d (noise cannot), and returns the velocity (x_t - x_0) / t to the loss
            x = (x_t - x) / t.clamp(min=0.05).view(-1, 1, 1, 1).to(x.dtype)
        return x

    def flops_per_image(self):
        """Training FLOPs per image: 6 per matmul weight per token (adaLN's: per image), plus attention."""
        # the patch embedding makes no grad for the pixels: 4 a weight, not 6. FlopCounterMode counts 1.7% more at
        # cifar10 (tests/test_compile.py): the scores that a flash backward recomputes, which MFU leaves out
        T, mats = self.grid ** 2, [(k, p.numel()) for k, p in self.named_parameters() if p.ndim == 2]
        once = sum(n for k, n in mats if "ada." in k or k.startswith("t_mlp."))  # the conditioning: once an image
        n = sum(n for k, n in mats if k.startswith(("blocks.", "out.")) and "ada." not in k)
        return T * (6 * n + 4 * self.patch.weight.numel() + 12 * self.cfg.n_layer * self.cfg.n_embd * T) + 6 * once

def build_model(cfg, image_size, channels, num_classes, device):
    """Build on the meta device, materialise on device, initialise under cfg.seed."""
    with torch.device("meta"):
        model = DiT(cfg, image_size, channels, num_classes)
    model.to_empty(device=device)
    torch.manual_seed(cfg.seed)
    model.init_weights()
    return model

# -----------------------------------------------------------------------------
# Diffusion: noising, training target and samplers
# t in [0, 1] for both objectives: t = 0 the data, t = 1 pure noise.
# flow: x_t = (1 - t) x_0 + t e; the model predicts v = e - x_0 (Liu et al. 2022; Lipman et al. 2022)
# ddpm: x_t = sqrt(ab) x_0 + sqrt(1 - ab) e at step t * 1000; the model predicts e (Ho et al. 2020)

T_DDPM = 1000

def cosine_alpha_bar(T=T_DDPM, s=0.008):
    """alpha_bar at steps 0..T, betas clipped at 0.999 (Nichol & Dhariwal 2021, eq. 17)."""
    f = torch.cos((torch.arange(T + 1, dtype=torch.float64) / T + s) / (1 + s) * math.pi / 2) ** 2
    beta = (1 - f[1:] / f[:-1]).clamp(max=0.999)
    return torch.cat((torch.ones(1, dtype=torch.float64), torch.cumprod(1 - beta, 0)))

def sample_t(B, cfg, gen):
    """B training timesteps: logit-normal for flow (Esser et al. 2024), uniform steps for ddpm."""
    if cfg.objective == "flow":
        return torch.sigmoid(cfg.t_mean + cfg.t_std * torch.randn(B, generator=gen, device=gen.device))
    return torch.randint(1, T_DDPM + 1, (B,), generator=gen, device=gen.device).float() / T_DDPM

def corrupt(x0, noise, t, cfg, alpha_bar):
    """(x_t, the model's target, loss weight (B,) or None) of clean x0 (B, H, W, C) at t (B,)."""
    if cfg.objective == "flow":
        tb = t.view(-1, 1, 1, 1)
        return (1 - tb) * x0 + tb * noise, noise - x0, None
    ab = alpha_bar.to(x0.device)[(t * T_DDPM).round().long()].float()  # (B,)
    x_t = ab.sqrt().view(-1, 1, 1, 1) * x0 + (1 - ab).sqrt().view(-1, 1, 1, 1) * noise
    # min-SNR-gamma for epsilon: min(SNR, gamma) / SNR, so the easy (high-SNR) steps weigh less
    snr = ab / (1 - ab)
    return x_t, noise, (snr.clamp(max=cfg.min_snr) / snr if cfg.min_snr else None)

@torch.no_grad()
def sample(model, noise, y, cfg, alpha_bar, scale=1.0, null=0):
    """Images (B, H, W, C), fp32, integrated from noise (t = 1) to t = 0 by model(x, t, y)."""
    x, B = noise.float(), noise.size(0)
    if y is not None:  # guidance (Ho & Salimans 2022): labels and null labels in one batch
        yy = torch.cat((y, torch.full_like(y, null)))

    def pred(x, t):
        tt = torch.full((B,), float(t), device=x.device)
        if y is None:
            return model(x, tt, None).float()
        cond, uncond = model(torch.cat((x, x)), torch.cat((tt, tt)), yy).float().chunk(2)
        return uncond + scale * (cond - uncond)

    if cfg.objective == "flow":  # Euler, or Heun (Karras et al. 2022)
        ts = torch.linspace(1, 0, cfg.sample_steps + 1).tolist()
        for a, b in zip(ts[:-1], ts[1:]):
            v = pred(x, a)
            if cfg.sampler == "heun" and b > 0:  # the mean slope of both ends; the last step is Euler
                v = 0.5 * (v + pred(x + (b - a) * v, b))
            x = x + (b - a) * v
        return x
    # ddpm: deterministic DDIM (Song et al. 2021) on an even subsequence of the T steps
    ab = alpha_bar.to(x.device)
    steps = torch.linspace(T_DDPM, 0, cfg.sample_steps + 1).round().long().tolist()
    for i, j in zip(steps[:-1], steps[1:]):
        eps = pred(x, i / T_DDPM)
        x0 = ((x - (1 - ab[i]).sqrt() * eps) / ab[i].sqrt()).clamp(-1, 1).float()  # kept in range
        eps = ((x - ab[i].sqrt() * x0) / (1 - ab[i]).sqrt()).float()
        x = ab[j].sqrt().float() * x0 + (1 - ab[j]).sqrt().float() * eps
    return x

# -----------------------------------------------------------------------------
# Data

def to_model(x):
    """uint8 pixels (B, H, W, C) -> floats in [-1, 1], the scale of the noise."""
    return x.float() / 127.5 - 1

# -----------------------------------------------------------------------------
# Optimizer and schedule

def build_optimizers(cfg, raw, device):
    """AdamW; weight decay on the blocks' matrices only (not embeddings, adaLN, norms, biases)."""
    decay = [p for n, p in raw.blocks.named_parameters() if p.ndim == 2 and "ada." not in n]
    rest = [p for p in raw.parameters() if all(p is not q for q in decay)]
    groups = [dict(params=decay, weight_decay=cfg.weight_decay), dict(params=rest, weight_decay=0.0)]
    opt = torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda")
    for g in opt.param_groups:
        g["peak_lr"] = g["lr"]
    return [opt]

def lr_mult(cfg, step, progress):
    """LR multiplier: linear warmup, then cosine or no decay over progress in [0, 1]."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    p, f = min(max(progress, 0.0), 1.0), cfg.final_lr_frac
    if cfg.schedule == "cosine":
        return warm * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * p)))
    return warm

# -----------------------------------------------------------------------------
# Quality: held-out denoising loss, and samples scored by a classifier trained with train_vit.py

@torch.no_grad()
def denoising_loss(model, x_all, y_all, cfg, alpha_bar, K, B, rank, world_size, ctx, n_images=0):
    """(mean, per-t) error of the model's target on the first n_images val images (0: all), at 8
    fixed timesteps with fixed noise (the same for any B and ranks), so that evals compare."""
    model.eval()
    n = min(n_images or len(y_all), len(y_all))
    ts = (torch.arange(8, dtype=torch.float32) + 0.5) / 8
    sums = torch.zeros(8, device=y_all.device, dtype=torch.float64)
    noise_all = torch.randn((n, *x_all.shape[1:]), generator=torch.Generator().manual_seed(0))
    for it in range(math.ceil(n / (B * world_size))):  # as many forwards on every rank (FSDP)
        i = (it * world_size + rank) * B
        i, j, w = (i, min(i + B, n), 1.0) if i < n else (0, 1, 0.0)  # past the end: not counted
        x0 = to_model(x_all[i:j])
        noise = noise_all[i:j].to(x0.device)
        for k, t in enumerate(ts.tolist()):
            tt = torch.full((j - i,), t, device=x0.device)
            x_t, target, _ = corrupt(x0, noise, tt, cfg, alpha_bar)
            with ctx:
                out = model(x_t, tt, y_all[i:j] if K else None).float()
            sums[k] += w * (out - target).square().mean((1, 2, 3)).sum().double()
    model.train()
    per_t = (all_mean(sums, world_size) * world_size / n).tolist()
    return sum(per_t) / len(per_t), per_t

@torch.no_grad()
def draw_samples(model, n, shape, K, cfg, alpha_bar, B, rank, world_size, ctx):
    """n uint8 samples (n, H, W, C) on every rank, sample i of class i % K (K = 0: none)."""
    # the noise comes from cfg.sample_seed alone: the samples do not depend on the ranks,
    # which each draw an equal share (as many forwards) and gather them all
    share = math.ceil(n / world_size)
    noise = torch.randn(share * world_size, *shape, generator=torch.Generator().manual_seed(cfg.sample_seed))
    labels = torch.arange(share * world_size) % max(K, 1)
    device = next(model.parameters()).device
    model.eval()
    out = []
    for i in range(rank * share, (rank + 1) * share, B):
        j = min(i + B, (rank + 1) * share)
        y = labels[i:j].to(device) if K else None
        with ctx:  # autocasts the model's matmuls; the sampler's steps are fp32 either way
            x = sample(model, noise[i:j].to(device), y, cfg, alpha_bar, cfg.cfg_scale, null=K)
        out.append(((x + 1) * 127.5).round().clamp(0, 255).to(torch.uint8))  # as a PNG stores them
    model.train()
    mine = torch.cat(out)
    if world_size > 1:
        parts = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(parts, mine)
        mine = torch.cat(parts)
    return mine[:n]

def frechet_distance(a, b):
    """Frechet distance of Gaussians fitted to features a (n, d) and b (m, d), as FID's
    (Heusel et al. 2017): |mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a S_b)^1/2), float64."""
    a, b = a.double(), b.double()
    sa, sb = torch.cov(a.T), torch.cov(b.T)
    w, V = torch.linalg.eigh(sa)
    ra = V @ torch.diag(w.clamp(min=0).sqrt()) @ V.T  # S_a^1/2
    cross = torch.linalg.eigvalsh(ra @ sb @ ra).clamp(min=0).sqrt().sum()  # = tr (S_a S_b)^1/2
    return ((a.mean(0) - b.mean(0)).square().sum() + sa.trace() + sb.trace() - 2 * cross).item()

class Judge:
    """Scores samples with a train_vit.py classifier of the same data: its accuracy on them,
    and the Frechet distance of its features ('FD-ViT'); FID proper with --fid_weights."""

    def __init__(self, path, meta, fid_weights, device, val_x):
        import train_vit  # only this metric needs the classifier's code
        ckpt, where = load_checkpoint(path) if os.path.exists(path) else (None, path)
        if ckpt is None or "pool" not in ckpt["config"]:  # a ViT's pooling: train_vit.py's
            die(f"--eval_classifier={path}: no complete train_vit.py checkpoint there; train one with train_vit.py")
        with reading(where, "pass a checkpoint written by train_vit.py"):
            m = ckpt["data_meta"]
            if any(m[k] != meta[k] for k in ("classes", "image_size", "channels")):
                die(f"--eval_classifier={path}: trained on other data ({m['num_classes']} classes of "
                    f"{m['image_size']}); train it with train_vit.py on this --data_dir")
            known = {k: v for k, v in ckpt["config"].items() if k in train_vit.Config.__dataclass_fields__}
            self.clf = train_vit.build_model(train_vit.Config(**known), m, device).eval()
            self.clf.load_state_dict(ckpt["ema"] or ckpt["model"])
        self.inception = torch.jit.load(fid_weights, map_location=device).eval() if fid_weights else None
        self.real = self.features(val_x[:10000])  # once

    @torch.no_grad()
    def features(self, x):
        """{name: features (n, d)} of uint8 images (n, H, W, C), and the classifier's logits."""
        out = {"logits": [], "vit": [], "inception": []}
        for i in range(0, len(x), 500):
            xb = x[i:i + 500].float() / 255
            f = self.clf(xb, features=True)
            out["vit"].append(f)
            out["logits"].append(self.clf.head(f))
            if self.inception is not None:  # takes NCHW in 0..255, resized to 299 inside
                img = xb.permute(0, 3, 1, 2).expand(-1, 3, -1, -1) * 255
                out["inception"].append(self.inception(img, return_features=True).flatten(1))
        return {k: torch.cat(v).float() for k, v in out.items() if v}

    def score(self, samples, K):
        """{'clf_acc', 'fd_vit'(, 'fid')} of uint8 samples, sample i of class i % K."""
        f = self.features(samples)
        res = {"fd_vit": frechet_distance(self.real["vit"], f["vit"])}
        if K:
            right = f["logits"].argmax(-1).cpu() == torch.arange(len(samples)) % K
            res["clf_acc"] = right.float().mean().item()
        if self.inception is not None:
            res["fid"] = frechet_distance(self.real["inception"], f["inception"])
        return res

# -----------------------------------------------------------------------------
# System: processes and devices, precision, compile, DDP/FSDP2 wrapping and the grad-sync context, the same
# bytes in every train_*.py (tests/test_style.py checks)

# === shared: system ===
def setup_dist(device_arg="auto"):
    """(rank, world_size, device); under torchrun, the process group joined (NCCL, gloo on CPU), ranks > 0 mute."""
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if device_arg == "cuda" and not torch.cuda.is_available():
        die("--device=cuda but no CUDA GPU is visible; use --device=cpu")
    if not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):  # growable segments fragment less (read at the first CUDA malloc)
        os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    if "RANK" not in os.environ:
        return 0, 1, torch.device(device_arg)
    rank, world_size, local = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"]), int(os.environ["LOCAL_RANK"])
    device = torch.device(f"cuda:{local}") if device_arg == "cuda" else torch.device(device_arg)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        # torchrun lends its own store to the workers, and after a restart it still holds the last attempt's
        # addresses, which the new attempt would dial (pytorch#135712): a key prefix per attempt keeps them apart
        store, _, _ = next(dist.rendezvous("env://"))
        store = dist.PrefixStore(f"attempt_{os.environ.get('TORCHELASTIC_RESTART_COUNT', '0')}/", store)
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank,
                                world_size=world_size)
    if rank:
        sys.stdout = open(os.devnull, "w")
    return rank, world_size, device

def all_mean(x, world_size):
    """Average a tensor over ranks (a no-op in a single process)."""
    if world_size > 1:
        x = x.clone()
        dist.all_reduce(x)
        x /= world_size
    return x

def full(t):
    """The whole tensor of an FSDP-sharded DTensor (a collective: every rank calls it); other tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

@functools.cache  # timed once per process: every run in it (tests run many) takes the same precision
def cpu_has_bf16():
    """Whether this CPU has AVX512-BF16 or AMX and a bf16 matmul 1.5x faster (BENCHMARKS.md: not every such CPU)."""
    import timeit
    with open("/proc/cpuinfo" if os.path.exists("/proc/cpuinfo") else os.devnull) as f:  # no /proc: no flags to see
        if not set(f.read().split()) & {"avx512_bf16", "amx_bf16"}:
            return False
    a = torch.randn(512, 512, generator=torch.Generator().manual_seed(0))
    b = a.bfloat16()
    # each the fastest of 5 products after one to warm up, about 50 ms in all
    fp32 = min(timeit.repeat(lambda: a @ a, number=1, repeat=6)[1:])
    bf16 = min(timeit.repeat(lambda: b @ b, number=1, repeat=6)[1:])
    return fp32 > 1.5 * bf16

def setup_precision(device, dtype_arg="auto", ckpt=None):
    """(dtype, autocast, GradScaler); auto: a resumed run's, else bf16 where fast (fp16 on old GPUs), or fp32."""
    if dtype_arg == "auto" and ckpt and ckpt["config"]["dtype"] in ("bfloat16", "float16", "float32"):
        dtype_arg = ckpt["config"]["dtype"]
    elif dtype_arg == "auto" and device.type == "cuda":
        dtype_arg = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    elif dtype_arg == "auto":
        fast = torch.tensor(int(device.type == "cpu" and cpu_has_bf16()))
        if dist.is_available() and dist.is_initialized():  # a timed choice: every rank takes the slowest's
            dist.all_reduce(fast, op=dist.ReduceOp.MIN)
        dtype_arg = "bfloat16" if fast else "float32"
    dtype = getattr(torch, dtype_arg)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul that remains
    ctx = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    # fp16's range is narrow: scale the loss up, skip steps whose grads overflow, grow the scale after 2000 good steps
    return dtype, ctx, torch.amp.GradScaler(device.type, enabled=dtype == torch.float16, growth_interval=2000)

def wrap_model(raw, cfg, device, dtype, world_size):
    """(model, compiled): raw compiled, then in DDP or sharded by FSDP2 block by block; raw's keys stay plain."""
    compiled = cfg.compile == "true" or (cfg.compile == "auto" and device.type == "cuda" and sys.platform == "linux")
    kernels.use(cfg.kernels)  # before compiling: the model traces the path it will run
    if world_size > 1 and cfg.parallel == "fsdp":
        if dtype == torch.float16:
            die("--parallel=fsdp does not support float16 (no sharded loss scaler); use bfloat16 or --parallel=ddp")
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cfg.offload == "params" else OffloadPolicy()
        kw = dict(mp_policy=MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32),  # fp32 grad averages
                  offload_policy=offload, mesh=dist.init_device_mesh(device.type, (world_size,)))  # not CUDA's on CPU
        for block in raw.blocks:
            if compiled:
                block.compile()
            fully_shard(block, **kw)
        return fully_shard(raw, **kw), compiled
    model = torch.compile(raw) if compiled else raw
    if world_size > 1:  # buffers are constants: nothing to broadcast
        model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None,
                                                    broadcast_buffers=False)
    return model, compiled

def grad_sync(model, sync):
    """The context of a micro-step's backward: grads are averaged across ranks only when sync (the last micro-step)."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2
        model.set_requires_gradient_sync(sync)
    return model.no_sync() if hasattr(model, "no_sync") and not sync else contextlib.nullcontext()  # DDP

def agree(loss_sum, gnorm, signal, train_time, world_size):
    """The step's one host sync, an all-reduce: (loss, grad norm, whether any rank got a signal, training time)
    averaged over ranks, so that every rank decides alike."""
    t = loss_sum.new_tensor
    local = torch.stack([loss_sum.float(), full(gnorm).float(), t(float(signal is not None)), t(train_time)])
    loss, gnorm, stopped, train_time = all_mean(local, world_size).tolist()
    return loss, gnorm, stopped > 0, train_time
# === end shared ===

# -----------------------------------------------------------------------------
# Training loop

def evaluate_both(cfg, model, ema, val_x, val_y, K, alpha_bar, judge, meta, ctx, rank, world_size, step, final=False):
    """The record: the held-out denoising loss of the weights and their EMA, the EMA's samples (grid, scores)."""
    rec, (H, W), C, B = {"step": step}, meta["image_size"], meta["channels"], cfg.batch_size
    for tag in ("", "ema_") if ema else ("",):
        if tag:
            ema.swap()
        rec[f"{tag}val_loss"], rec[f"{tag}val_loss_t"] = denoising_loss(model, val_x, val_y, cfg, alpha_bar, K, B,
                                                                        rank, world_size, ctx, cfg.eval_images)
    rows = K or cfg.per_class
    n_samples = max(rows * cfg.per_class, cfg.final_samples if final else cfg.eval_samples)
    t0 = time.perf_counter()
    samples = draw_samples(model, n_samples, (H, W, C), K, cfg, alpha_bar, B, rank, world_size, ctx)
    rec["sample_s"] = time.perf_counter() - t0
    if ema:
        ema.swap()
    grid = os.path.join(cfg.out_dir, "samples.png" if final else f"samples_{step:05d}.png")
    if rank == 0:
        side_path("writing the sample grid", write_grid, grid, samples[:rows * cfg.per_class].cpu().numpy(), rows,
                  meta["classes"] if K else None)
    if judge:
        rec.update(side_path("scoring the samples", judge.score, samples, K) or {})
    print(f"eval {step:05d} | val loss {rec['val_loss']:.4f}"
          + (f" | ema val loss {rec['ema_val_loss']:.4f}" if ema else "")
          + (f" | classifier acc {100 * rec['clf_acc']:.1f}%" if "clf_acc" in rec else "")
          + (f" | FD-ViT {rec['fd_vit']:.2f}" if judge else "") + (f" | FID {rec['fid']:.2f}" if "fid" in rec else "")
          + f" | {n_samples} samples in {rec['sample_s']:.0f} s | {grid}")
    return rec

def write_grid(path, images, rows, labels=None, zoom=2):
    """A PNG of uint8 images (rows * cols, H, W, C), image r + j * rows at row r, column j, `zoom` times larger."""
    from PIL import Image, ImageDraw
    n, H, W, C = images.shape
    cols, gap = n // rows, 2
    margin = 8 + 6 * max(map(len, labels)) if labels else 0
    canvas = np.full((rows * (H * zoom + gap) + gap, margin + cols * (W * zoom + gap) + gap, 3), 255, np.uint8)
    big = images.repeat(zoom, 1).repeat(zoom, 2)
    big = big.repeat(3, 3) if C == 1 else big
    for r in range(rows):
        for j in range(cols):
            y0, x0 = gap + r * (H * zoom + gap), margin + gap + j * (W * zoom + gap)
            canvas[y0:y0 + H * zoom, x0:x0 + W * zoom] = big[r + j * rows]
    im = Image.fromarray(canvas)
    if labels:
        draw = ImageDraw.Draw(im)
        for r, name in enumerate(labels):
            draw.text((4, gap + r * (H * zoom + gap) + H * zoom // 2 - 5), name, fill=(0, 0, 0))
    im.save(f"{path}.tmp", format="PNG")
    os.replace(f"{path}.tmp", path)

def conditioning(cfg, meta):
    """The number of classes the model is conditioned on: 0 (unconditional) for one class or --num_classes=0."""
    K = meta["num_classes"]
    if cfg.num_classes > 0 and cfg.num_classes != K:
        die(f"--num_classes={cfg.num_classes} but {cfg.data_dir} has {K} classes; use -1 (the data's) or 0 (none)")
    return 0 if cfg.num_classes == 0 or K == 1 else K

def main(cfg):
    """Train (or --benchmark, or --sample) per cfg; returns a dict of final metrics."""
    if cfg.sample:  # checked there, against the objective of the checkpoint
        return sample_main(cfg)
    check_config(cfg)
    with StopSignal() as stop:  # SIGTERM or SIGINT: finish the step, save, exit 0; handlers restored on return
        return train(cfg, stop)

def train(cfg, stop):
    """Set up, resume, then the loop: micro-steps, clip, agree, check, step, log, eval, save. A signal stops it."""
    rank, world_size, device = setup_dist(cfg.device)
    wall0 = time.perf_counter()
    # data: both splits held whole on the device as uint8; random images for --benchmark
    meta, train_loader, val_x, val_y = image_data(cfg, rank, world_size, device, "the upright shapes dataset",
                                                  "--rotate=off")
    (H, W), C, K = meta["image_size"], meta["channels"], conditioning(cfg, meta)
    flip, why = flips(cfg, meta)
    data_info = {"num_classes": K, "image_size": [H, W], "channels": C}
    alpha_bar = cosine_alpha_bar()
    judge = Judge(cfg.eval_classifier, meta, cfg.fid_weights, device, val_x) if cfg.eval_classifier and rank == 0 \
        and not cfg.benchmark else None

    # cfg settles here, before anything derives from it: the precision (auto: a resumed run's, else decided now)
    layout = run_layout(dataclasses.asdict(cfg), world_size, data_info)
    ckpt, path = (None, None) if cfg.benchmark else resume_point(cfg.out_dir, cfg.resume, layout, rank == 0)
    dtype, ctx, scaler = setup_precision(device, cfg.dtype, ckpt)
    cfg = dataclasses.replace(cfg, dtype=str(dtype).removeprefix("torch."))
    B, accum = cfg.batch_size, cfg.grad_accum
    images_per_step = B * accum * world_size

    # model, optimizers, EMA and guard; the budget: steps (--max_steps or --epochs), or seconds of training
    raw = build_model(cfg, H, C, K, device)
    model, compiled = wrap_model(raw, cfg, device, dtype, world_size)
    opts = build_optimizers(cfg, raw, device)
    ema = EMA(raw.parameters(), cfg.ema, raw) if cfg.ema else None
    guard = Guard(cfg.loss_spike, cfg.gnorm_spike, cfg.guard_window, cfg.rollback_after, cfg.clip_mult)
    n_params = sum(p.numel() for p in raw.parameters())
    steps_per_epoch = len(train_loader.y) // (B * world_size) / accum
    bench = Benchmark(cfg.bench_steps, cfg.profile)
    max_steps = bench.total if cfg.benchmark else cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
    time_budget = 0.0 if cfg.benchmark or cfg.max_steps or cfg.epochs else cfg.time_budget
    # throughput: per step, its unit, and the seconds a step would take at the GPU's peak (MFU: those over its time)
    rate = (images_per_step, "img", peak_seconds(raw.flops_per_image() * images_per_step, device, dtype))

    # the loop's state is these locals; a resume sets them from the checkpoint, and the loader's place
    step, train_time, history, rollbacks = 0, 0.0, [], {}
    if ckpt:
        with reading(path, "it is not a checkpoint of this run; pass a new --out_dir"):
            step, train_time, history = apply_checkpoint(ckpt, raw, opts, scaler, guard, ema)
            train_loader.load_state(ckpt["data"])
        resumed(path, step, train_time >= time_budget if time_budget else step >= max_steps, cfg.out_dir)
    metrics = start_log(cfg, rank == 0)  # the file of every logged value (None on ranks > 0)
    sharded = world_size > 1 and cfg.parallel == "fsdp"  # a checkpoint is then a folder of every rank's shards
    writer = CheckpointWriter(cfg.out_dir, cfg.keep_last, cfg.milestone_every, cfg.async_save, sharded, rank == 0)
    print(f"{n_params / 1e6:.2f}M parameters | {len(train_loader.y)} train images of {H}x{W}x{C}, "
          + (f"{K} classes" if K else "unconditional") + f" | {(H // cfg.patch_size) ** 2} patches | {cfg.objective}"
          + (f", {cfg.predict}-prediction" if cfg.objective == "flow" else "")
          + f" | {images_per_step} images/step (B {B} x accum {accum} x world {world_size}) | "
          + (f"{time_budget:.0f} s" if time_budget else f"{max_steps} steps ({max_steps / steps_per_epoch:.1f} epochs)")
          + f" | {device} {dtype} | compile {compiled} | kernels {kernels.backend(device)}"
          + f" | lr {cfg.lr:g} | flips {'on' if flip else 'off'} ({why})")

    # the loop: an optimizer step (micro-steps, clip, agree, check, update, EMA), then log, eval and save
    t0, lap, last_step = time.perf_counter(), (step, train_time), False
    while not last_step:
        # noise, timesteps, label dropout and flips are drawn for the whole global batch from a generator seeded by
        # (seed, step), and each rank takes its slice: a resumed run draws the same numbers as an uninterrupted one
        # (the checkpoint needs no RNG state), and training does not depend on the number of ranks
        gen = torch.Generator(device).manual_seed(cfg.seed + 1000003 * (step + 1))
        mult = lr_mult(cfg, step, train_time / time_budget if time_budget else step / max_steps)  # of the budget
        for opt in opts:
            opt.zero_grad(set_to_none=True)
            for g in opt.param_groups:
                g["lr"] = g["peak_lr"] * mult
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = train_loader.next()
            x0, mine = to_model(x), slice(rank * B, (rank + 1) * B)
            noise = torch.randn((B * world_size, H, W, C), generator=gen, device=device)[mine]
            t = sample_t(B * world_size, cfg, gen)[mine]
            u = torch.rand((2, B * world_size), generator=gen, device=device)[:, mine]
            if flip:
                x0 = torch.where(u[0].view(B, 1, 1, 1) < 0.5, x0.flip(2), x0)
            y = torch.where(u[1] < cfg.class_dropout, K, y) if K else None  # label K: none
            x_t, target, weight = corrupt(x0, noise, t, cfg, alpha_bar)
            with grad_sync(model, micro == accum - 1):
                with ctx:
                    out = model(x_t, t, y).float()
                mse = (out - target).square().mean((1, 2, 3))  # (B,)
                loss = (mse * weight if weight is not None else mse).mean() / accum
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        for opt in opts:
            scaler.unscale_(opt)
        gnorm = nn.utils.clip_grad_norm_(raw.parameters(), guard.clip(cfg.grad_clip))
        now = time.perf_counter()  # the host waits for the GPU in agree(): that wait counts in the next step
        loss, gnorm, stopped, train_time = agree(loss_sum, gnorm, stop.received, train_time + now - t0, world_size)
        t0 = now
        overflow = scaler.is_enabled() and math.isfinite(loss) and not math.isfinite(gnorm)  # fp16: the scaler's job
        reason = None if overflow else guard.check(step + 1, loss, gnorm)
        if reason is None:
            for opt in opts:
                scaler.step(opt)  # which skips it when fp16 grads overflowed
            if ema and not overflow:
                ema.update()
        scaler.update()
        step += 1

        if reason:  # a skipped update; repeated ones roll back to a checkpoint, past the batches read since (PaLM 5.1)
            record(metrics, step=step, event="skip", reason=reason, loss=loss, gnorm=gnorm)
            print(f"step {step:05d} | update skipped: {reason} | {len(guard.bad)} bad in {guard.window} steps")
        if reason and guard.rollback_due():
            writer.wait()
            ckpt = rollback_point(cfg.out_dir, guard, reason, rollbacks, world_size, rank == 0, metrics, step)
            step, train_time, history = apply_checkpoint(ckpt, raw, opts, scaler, guard, ema)
            t0, lap = time.perf_counter(), (step, train_time)
            continue
        done = train_time >= time_budget if time_budget else step >= max_steps
        last_step = done or stopped
        if step % cfg.log_every == 0 or last_step:
            dt, lap = (train_time - lap[1]) / max(step - lap[0], 1), (step, train_time)  # seconds a step since
            log_step(metrics, step, (max_steps, time_budget), loss, cfg.lr * mult, gnorm, dt, rate, train_time,
                     epoch=train_loader.epoch + train_loader.pos / len(train_loader.y))
            history.append({"step": step, "loss": loss})
        if cfg.benchmark:
            bench.mark(step, train_time)  # timing starts after the warm-up; --profile traces the steps after the timed
            continue
        paused = time.perf_counter()  # evals and saves are not training time
        if (done and not stopped) or (cfg.eval_every and step % cfg.eval_every == 0):
            rec = evaluate_both(cfg, model, ema, val_x, val_y, K, alpha_bar, judge, meta, ctx, rank, world_size, step,
                                done and not stopped)
            record(metrics, **rec)
            history.append({k: v for k, v in rec.items() if not k.endswith("_t")})
        if last_step or (cfg.save_every and step % cfg.save_every == 0):
            writer.save({**model_state(raw, opts, ema, full=not sharded), "scaler": scaler.state_dict(), "step": step,
                         "guard": guard.state(), "train_time": train_time, "history": history, "data_info": data_info,
                         "config": dataclasses.asdict(cfg), "world_size": world_size, "data": train_loader.state(),
                         "num_classes": K, "data_meta": {k: meta[k] for k in ("classes", "num_classes", "image_size",
                                                                              "channels")}})
        t0 += time.perf_counter() - paused

    # the end: the benchmark's figures, or how to resume after a signal, or the results
    writer.wait()
    if stopped and not cfg.benchmark:  # the checkpoint is saved: exit 0, and --resume goes on
        return preempted(stop.received, step, train_time, cfg.out_dir)
    result = {"steps": step, "train_time": train_time, "wall_time": time.perf_counter() - wall0,
              "peak_mem_gb": peak_memory_gb(device), "params": n_params}
    if cfg.benchmark:  # the time of the steps after the warm-up (a signal leaves none)
        what = (f"{cfg.preset or 'default'} | {n_params / 1e6:.1f}M params | {H}x{W} patch {cfg.patch_size} | "
                f"{device} {dtype} compile={compiled}")
        return bench.report(result, stopped and stop.received, rate, what, cfg.out_dir, device, rank == 0)
    key = "clf_acc" if "clf_acc" in rec else "ema_val_loss" if ema else "val_loss"
    epochs = step * images_per_step / len(train_loader.y)
    scores = " | ".join(f"{k} {rec[k]:.4f}" for k in ("val_loss", "ema_val_loss", "clf_acc", "fd_vit", "fid")
                        if k in rec)
    return finish(f"done: {step} steps, {epochs:.1f} epochs in {train_time:.0f} s | {scores} | checkpoint and "
                  f"samples.png in {cfg.out_dir}", {**result, **rec, "train_loss": loss,
                  "images": step * images_per_step}, key, rank == 0 and cfg.out_dir, cfg.description)

def sample_main(cfg):
    """--sample: a grid from a checkpoint's EMA weights (rows = classes) and, with --eval_classifier, its scores."""
    check_choices(cfg)
    where = cfg.ckpt or cfg.out_dir
    ckpt, path = load_checkpoint(where) if os.path.exists(where) else (None, None)
    if ckpt is None or "objective" not in ckpt["config"]:
        die(f"no complete train_diffusion.py checkpoint at {where!r}; train first or pass --ckpt=PATH")
    _, _, device = setup_dist(cfg.device)
    _, ctx, _ = setup_precision(device, cfg.dtype)
    with reading(path, "pass a checkpoint written by train_diffusion.py"):
        meta, trained = ckpt["data_meta"], Config(**{k: v for k, v in ckpt["config"].items()
                                                     if k in Config.__dataclass_fields__})
        K, (H, W), C = ckpt["num_classes"], meta["image_size"], meta["channels"]
        model = build_model(trained, H, C, K, device)
        model.load_state_dict(ckpt["ema"] or ckpt["model"])
    cfg = dataclasses.replace(cfg, objective=trained.objective)
    check_config(cfg)
    rows = K or cfg.per_class
    n = max(rows * cfg.per_class, cfg.final_samples if cfg.eval_classifier else 0)
    sampler = {"auto": "euler" if cfg.objective == "flow" else "ddim"}.get(cfg.sampler, cfg.sampler)
    print(f"# {path} (step {ckpt['step']}, {'EMA' if ckpt['ema'] else 'raw'} weights) | {n} samples | {sampler} "
          f"{cfg.sample_steps} steps | cfg scale {cfg.cfg_scale:g} | seed {cfg.sample_seed}")
    t0 = time.perf_counter()
    samples = draw_samples(model, n, (H, W, C), K, cfg, cosine_alpha_bar(), 256, 0, 1, ctx)
    out = cfg.sample_out or os.path.join(os.path.dirname(path), f"sample_{sampler}{cfg.sample_steps}_cfg"
                                         f"{cfg.cfg_scale:g}_seed{cfg.sample_seed}.png")
    write_grid(out, samples[:rows * cfg.per_class].cpu().numpy(), rows, meta["classes"] if K else None)
    res = {"grid": out, "sample_s": time.perf_counter() - t0}
    if cfg.eval_classifier:
        _, arrays = load_image_data(trained.data_dir, ("val",)) if os.path.exists(trained.data_dir) else (None, None)
        if arrays is None:
            die(f"the checkpoint's data_dir {trained.data_dir!r} is gone; the Frechet distance needs its val images")
        val_x = torch.from_numpy(np.array(arrays["val"][0])).to(device)
        res.update(Judge(cfg.eval_classifier, meta, cfg.fid_weights, device, val_x).score(samples, K))
    print(f"wrote {out} in {res['sample_s']:.1f} s"
          + "".join(f" | {k} {v:.4f}" for k, v in res.items() if k not in ("grid", "sample_s")))
    return res

def check_config(cfg):
    """Reject impossible settings with a one-line message that names the fix."""
    check_choices(cfg)
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        die(f"--n_embd={cfg.n_embd} must split into {cfg.n_head} heads of even size; change --n_embd or --n_head")
    at_least = dict.fromkeys(("patch_size n_layer n_head n_embd batch_size grad_accum guard_window sample_steps "
                              "per_class").split(), 1)
    at_least |= dict.fromkeys(("min_snr cfg_scale epochs image_size eval_images eval_samples final_samples loss_spike "
                               "gnorm_spike clip_mult rollback_after max_steps time_budget").split(), 0)  # budgets too
    for k, low in {**at_least, "num_classes": -1}.items():
        if getattr(cfg, k) < low:
            die(f"--{k} must be at least {low}, got {getattr(cfg, k)}")
    if cfg.lr <= 0 or cfg.warmup_steps < 0 or not 0 <= cfg.final_lr_frac <= 1:
        die("need --lr > 0, --warmup_steps >= 0 and 0 <= --final_lr_frac <= 1")
    if not 0 <= cfg.ema < 1 or not 0 <= cfg.class_dropout < 1 or cfg.t_std <= 0:
        die("need 0 <= --ema < 1, 0 <= --class_dropout < 1 and --t_std > 0")
    if cfg.sampler != "auto" and (cfg.sampler == "ddim") != (cfg.objective == "ddpm"):
        die(f"--sampler={cfg.sampler} does not fit --objective={cfg.objective}: "
            "euler|heun sample flow, ddim samples ddpm")
    if not (cfg.benchmark or cfg.sample) and not (cfg.max_steps or cfg.epochs or cfg.time_budget > 0):
        die("no training budget: set --max_steps, --epochs or --time_budget")
    for k in ("eval_classifier", "fid_weights"):
        if getattr(cfg, k) and not os.path.exists(getattr(cfg, k)):
            die(f"--{k}={getattr(cfg, k)}: no such file or directory")

# -----------------------------------------------------------------------------
# Images: the same bytes in train_vit.py and train_diffusion.py (tests/test_style.py checks): what a resumed run must
# match, 2-D sin-cos positions, a prepared image dir and its checks, the train split's loader, the EMA of the weights.

# === shared: images ===
def run_layout(c, world_size, data_info):
    """What a resumed run must share with the run of its checkpoint's config dict c."""
    return {**{k: c[k] for k in ARCH_FIELDS}, "ema": c["ema"] > 0, "batch_size": c["batch_size"],
            "grad_accum": c["grad_accum"], "world_size": world_size, "dtype": c["dtype"], **data_info}

def sincos_2d(h, w, dim):
    """Fixed 2-D sin-cos positions (h * w, dim), fp32 (MAE; Beyer et al. 2022; DiT)."""
    # half the channels encode the row, half the column, as sin, cos at dim/4 frequencies
    omega = 1.0 / 10000 ** (torch.arange(dim // 4, dtype=torch.float32) / (dim // 4))
    ys, xs = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")
    parts = [f(pos.flatten()[:, None] * omega[None]) for pos in (ys, xs) for f in (torch.sin, torch.cos)]
    return torch.cat(parts, dim=1)

def load_image_data(data_dir, splits=("train", "val")):
    """meta.json and {split: (uint8 images (N, H, W, C), int64 labels (N,))} of an image dir."""
    path = os.path.join(data_dir, "meta.json")
    if not os.path.exists(path):
        die(f"no prepared images in {data_dir!r} (no meta.json); make them with 'python prepare_data.py shapes "
            f"--data_dir={data_dir}' (or cifar10, mnist, imagefolder PATH ...)")
    with reading(path, "re-run prepare_data.py for this data dir"), open(path) as f:
        meta = json.load(f)
        if meta["format"] != "trainsuite-image-1":
            raise ValueError(f"format {meta['format']!r} is not an image dataset")
        (H, W), C, K = meta["image_size"], meta["channels"], meta["num_classes"]
        if not (all(isinstance(v, int) and v > 0 for v in (H, W, C, K)) and len(meta["classes"]) == K and all(
                len(meta[k]) == C and all(isinstance(v, (int, float)) for v in meta[k]) for k in ("mean", "std"))):
            raise ValueError("image_size, channels, num_classes, classes, mean and std do not fit together")
        if not isinstance(meta.get("flip_ok", False), bool):
            raise ValueError("flip_ok must be true or false")
        arrays = {s: (np.load(os.path.join(data_dir, f"{s}_images.npy"), mmap_mode="r"),
                      np.load(os.path.join(data_dir, f"{s}_labels.npy"))) for s in splits}
    for s, (x, y) in arrays.items():
        if x.dtype != np.uint8 or x.ndim != 4 or list(x.shape[1:]) != [H, W, C]:
            die(f"{data_dir}/{s}_images.npy is {x.dtype} {x.shape}, not uint8 (N, {meta['image_size']}, "
                f"{meta['channels']}) as meta.json says; re-run prepare_data.py for this data dir")
        if len(x) != len(y) or (len(y) and not 0 <= y.min() <= y.max() < K):
            die(f"{data_dir}: {s} has {len(x)} images and {len(y)} labels (or labels outside "
                f"0..{meta['num_classes'] - 1}); re-run prepare_data.py for this data dir")
    return meta, arrays

def image_data(cfg, rank, world_size, device, what, *flags):
    """meta, the train split's loader, and the val images and labels on the device."""
    if cfg.benchmark:  # random images, no val split
        size, n, g = cfg.image_size or 32, 4 * cfg.batch_size, torch.Generator().manual_seed(0)
        meta = {"classes": [str(i) for i in range(10)], "num_classes": 10, "image_size": [size, size], "channels": 3,
                "mean": [0.5] * 3, "std": [0.25] * 3, "flip_ok": True}
        arrays = {"train": (torch.randint(0, 256, (n, size, size, 3), generator=g, dtype=torch.uint8).numpy(),
                            torch.randint(0, 10, (n,), generator=g).numpy())}
    else:
        prepare_default_data(cfg, rank, world_size, "shapes", what, *flags)
        meta, arrays = load_image_data(cfg.data_dir)
    H, W = meta["image_size"]
    if cfg.image_size and cfg.image_size != H:
        die(f"--image_size={cfg.image_size} but the images in {cfg.data_dir} are {H}x{W}; prepare them at that size "
            f"(prepare_data.py ... --image_size={cfg.image_size}) or use --image_size=0")
    if H != W or H % cfg.patch_size:
        die(f"images of {H}x{W} do not split into {cfg.patch_size}x{cfg.patch_size} patches; change --patch_size")
    loader = ImageLoader(*arrays["train"], cfg.batch_size, rank, world_size, device, cfg.seed)
    val = [torch.from_numpy(np.array(a)).to(device) for a in arrays["val"]] if "val" in arrays else [None, None]
    return meta, loader, *val

def flips(cfg, meta):
    """(whether training flips images, why): --flip, else meta.json's flip_ok."""
    if cfg.flip != "auto":
        return cfg.flip == "true", "--flip"
    if "flip_ok" not in meta:  # older data flips, as it did (a mirrored digit is not a digit)
        return True, "meta.json predates flip_ok: re-run prepare_data.py, or pass --flip=false for digits or text"
    return meta["flip_ok"], "the data's flip_ok"

class ImageLoader:
    """(B, H, W, C) uint8 batches from a split held on the device, in an order per epoch
    seeded by (seed, epoch); rank r takes the r-th B of each global batch."""

    def __init__(self, images, labels, B, rank, world_size, device, seed=0):
        self.x = torch.from_numpy(np.array(images)).to(device)  # uint8: 4x smaller than fp32
        self.y = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(device)
        self.B, self.rank, self.world_size, self.seed = B, rank, world_size, seed
        if len(self.y) < B * world_size:
            die(f"the train split has {len(self.y)} images, fewer than one batch of --batch_size x ranks = "
                f"{B * world_size}; lower --batch_size")
        self.load_state({"epoch": 0, "pos": 0})

    def state(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state(self, s):
        self.epoch, self.pos, self.order = int(s["epoch"]), int(s["pos"]), None

    def next(self):
        """This rank's next (images (B, H, W, C) uint8, labels (B,) int64)."""
        n, step = len(self.y), self.B * self.world_size
        if self.pos + step > n:  # drop the epoch's partial last batch
            self.epoch, self.pos, self.order = self.epoch + 1, 0, None
        if self.order is None:
            g = torch.Generator().manual_seed(self.seed * 1000003 + self.epoch)
            self.order = torch.randperm(n, generator=g).to(self.x.device)
        idx = self.order[self.pos + self.rank * self.B:self.pos + (self.rank + 1) * self.B]
        self.pos += step
        return self.x[idx], self.y[idx]

class EMA:
    """An fp32 moving average of the weights, beside them (sharded like them under FSDP).
    swap() trades it with the live weights, so one model evaluates with either."""

    def __init__(self, params, decay, model=None):
        self.params, self.decay, self.t, self.model = list(params), decay, 0, model
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self):
        self.t += 1
        d = min(self.decay, (1 + self.t) / (10 + self.t))  # early weights are forgotten fast
        torch._foreach_lerp_(self.shadow, [p.detach() for p in self.params], 1 - d)

    @torch.no_grad()
    def swap(self):
        for p, s in zip(self.params, self.shadow):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)
        if hasattr(self.model, "reshard"):  # FSDP2 keeps a no-grad forward's gathered weights
            self.model.reshard()
# === end shared ===

# -----------------------------------------------------------------------------
# Machinery: the same bytes in every train_*.py (tests/test_style.py checks). Flags; a run's clock, log,
# checkpoints, resume and rollback; the guards. The recipe above reads without it.

# === shared: machinery ===
def die(msg):
    """Stop with a one-line error and a non-zero exit (a SystemExit, so tests can catch it)."""
    raise SystemExit(f"{os.path.basename(sys.argv[0]) or 'train'}: error: {msg}")

def side_path(what, fn, *args):
    """fn(*args), or None after a one-line warning if it fails: a sample, a plot or a figure never ends a run."""
    try:
        return fn(*args)
    except (Exception, SystemExit) as e:  # noqa: BLE001 - whatever went wrong there, training goes on
        print(f"warning: {what} failed, training goes on: {' '.join(str(e).split())[:200] or type(e).__name__}",
              file=sys.stderr)

def field_comments(cls):
    """{field: its trailing comment}, the help of -h; a subclass (finetune_gpt.py's Config) adds its own."""
    return {k: v for c in reversed(cls.__mro__[:-1])  # [:-1]: object has no source
            for k, v in re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", inspect.getsource(c), re.M)}

def choose(field, value):
    """value, if the field's type allows it: one of a Literal's choices (any value of other types); else stop."""
    options = get_args(field.type)
    if options and value not in options:
        die(f"--{field.name}={value} is not one of {'|'.join(options)}")
    return value

def check_choices(cfg):
    """Each Literal field holds one of its choices; --profile needs --benchmark, --offload FSDP."""
    for f in dataclasses.fields(cfg):
        choose(f, getattr(cfg, f.name))
    if cfg.profile and not cfg.benchmark:  # a training run would profile every step after the 24th, never exported
        die("--profile profiles --benchmark's steps; add --benchmark")
    if cfg.offload != "none" and (cfg.parallel != "fsdp" or int(os.environ.get("WORLD_SIZE", "1")) < 2):
        die("--offload needs --parallel=fsdp under torchrun (FSDP2 moves the shards); drop it or add those")

def parse_args(cls, argv):
    """A Config from --key=value / --key value flags over a --preset; -h lists every field, its default and comment."""
    import argparse
    module, yes = sys.modules[cls.__module__], ("1", "true", "yes", "on")

    def to_bool(s):  # a bare --flag is true
        if s.lower() not in (*yes, "0", "false", "no", "off"):
            raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")
        return s.lower() in yes

    p = argparse.ArgumentParser(description=module.__doc__.strip().split("\n")[0], usage="%(prog)s [--key=value ...]",
                                allow_abbrev=False, argument_default=argparse.SUPPRESS)
    p.error = lambda msg: die(f"{msg} (see -h)")
    comments = field_comments(cls)  # once: it parses the file (0.1 s), which per field made each start take seconds
    for f in dataclasses.fields(cls):
        b, options = f.type is bool, get_args(f.type)  # the choices of a Literal: the parser checks them
        kind = to_bool if b else functools.partial(choose, f) if options else f.type
        p.add_argument(f"--{f.name}", type=kind, nargs="?" if b else None, metavar="|".join(options) or f.name.upper(),
                       const=True if b else None, help=f"{comments.get(f.name, '')} (default: {f.default!r})")
    args, unknown = p.parse_known_args(argv)
    for u in unknown:
        near = difflib.get_close_matches(u.split("=")[0].lstrip("-"), [f.name for f in dataclasses.fields(cls)], n=1)
        die(f"unknown flag {u.split('=')[0]!r}" + (f"; did you mean --{near[0]}?" if near else " (see -h)"))
    preset = vars(args).get("preset", "")
    if preset and preset not in module.PRESETS:
        die(f"unknown --preset={preset}; choose one of {', '.join(module.PRESETS)}")
    return cls(**{**module.PRESETS.get(preset, {}), **vars(args)})

PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12,
              "A10": 125e12, "L4": 121e12, "V100": 125e12, "T4": 65e12}  # dense bf16/fp16; tf32 is half

def peak_seconds(flops, device, dtype):
    """Seconds that `flops` take at the GPU's peak (MFU: these over the seconds taken); 0 if the peak is unknown."""
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    peak = next((v / (2 if dtype == torch.float32 else 1) for k, v in PEAK_FLOPS.items() if k in gpu), None)
    return flops / peak if peak else 0.0

def fmt_rate(x):
    """3.66M, 812k, 95: rates readable at any scale."""
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"

def start_log(cfg, master):
    """Print the config. Rank 0 of a training run writes out_dir/config.json, opens wandb if asked and returns the
    path of metrics.jsonl; the others return None."""
    print(json.dumps(dataclasses.asdict(cfg)))
    if not master or cfg.benchmark:
        return None
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(dataclasses.asdict(cfg), f, indent=2)
        if cfg.wandb:
            import wandb
            wandb.init(project=cfg.wandb, config=dataclasses.asdict(cfg))
    except OSError as e:
        die(f"cannot write to --out_dir={cfg.out_dir} ({e.strerror}); pick a writable directory")
    except ImportError:
        die("--wandb needs the wandb package: pip install wandb")
    return os.path.join(cfg.out_dir, "metrics.jsonl")

def record(metrics, **kv):
    """Append kv to the file `metrics` (None: no file) as a line of JSON, and to wandb's run if one is open."""
    if metrics:
        with open(metrics, "a") as f:
            f.write(json.dumps(kv) + "\n")
        if "wandb" in sys.modules and sys.modules["wandb"].run:
            sys.modules["wandb"].log(kv, step=kv.get("step"))

def log_step(metrics, step, budget, loss, lr, gnorm, dt, rate, train_time, **extra):
    """Print a step's line and record it: loss, LR, grad norm, time per step (dt), throughput and MFU at rate (per
    step, unit, seconds a step at the GPU's peak), and extra values; budget: (max_steps, time_budget)."""
    (max_steps, time_budget), (per_step, unit, ideal) = budget, rate
    rec = {"step": step, "loss": loss, "lr": lr, "gnorm": gnorm, "ms": dt * 1e3, f"{unit}_s": per_step / dt,
           "mfu": ideal / dt or None, "train_time": train_time, **extra}
    record(metrics, **rec)
    of = f"{train_time:.0f}/{time_budget:.0f}s" if time_budget else f"{max_steps:05d}"
    mfu = f"{100 * rec['mfu']:.1f}%" if rec["mfu"] else "-"
    print(f"step {step:05d}/{of} | loss {loss:.4f} | lr {lr:.1e} | gnorm {gnorm:.2f} | {dt * 1e3:.0f} ms | "
          f"{fmt_rate(per_step / dt)} {unit}/s | mfu {mfu}" + "".join(f" | {k} {v:.2f}" for k, v in extra.items()))

BENCH_WARMUP, PROFILE_STEPS = 5, 3  # --benchmark leaves its first steps untimed (compile, autotuning, the allocator)

class Benchmark:
    """--benchmark: the time of `steps` steps after BENCH_WARMUP; with `profile`, a trace of PROFILE_STEPS more."""

    def __init__(self, steps, profile):
        self.steps, self.profile, self.t0, self.t1, self.profiler = steps, profile, 0.0, None, None
        self.total = BENCH_WARMUP + steps + PROFILE_STEPS * profile

    def mark(self, step, train_time):
        """After each step: timing starts once the warm-up is over, the profiler once the timed steps are."""
        if step == BENCH_WARMUP:
            self.t0 = train_time
            if torch.cuda.is_initialized():
                torch.cuda.reset_peak_memory_stats()
        if self.profile and step == BENCH_WARMUP + self.steps:
            self.t1, self.profiler = train_time, torch.profiler.profile()  # the CPU, and a GPU where there is one
            self.profiler.start()

    def report(self, result, signal, rate, what, out_dir, device, master):
        """The end of --benchmark: result with the figures of the timed steps at rate (per step, unit, seconds a
        step at the GPU's peak); with --profile, a Chrome trace (chrome://tracing, ui.perfetto.dev) and the top ops."""
        if signal:
            die(f"--benchmark stopped by {signal} at step {result['steps']}; nothing measured")
        dt, (per_step, unit, ideal) = ((self.t1 or result["train_time"]) - self.t0) / self.steps, rate
        if self.profiler:
            self.profiler.stop()
        if self.profiler and master:
            os.makedirs(out_dir, exist_ok=True)
            self.profiler.export_chrome_trace(os.path.join(out_dir, "trace.json"))
            key = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
            print(self.profiler.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
            print(f"profile of {PROFILE_STEPS} steps: {out_dir}/trace.json")
        result.update({f"{unit}_s": per_step / dt, "ms_per_step": dt * 1e3, "mfu": ideal / dt or None})
        mfu = f"{100 * result['mfu']:.1f}%" if result["mfu"] else "-"
        return finish(f"benchmark | {what} | {fmt_rate(per_step / dt)} {unit}/s | {dt * 1e3:.1f} ms/step | mfu {mfu} | "
                      f"peak mem {result['peak_mem_gb']:.2f} GB", result)

def peak_memory_gb(device):
    """The peak GPU memory allocated, or on a CPU the peak resident memory (0 on Windows: it has no resource)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    if sys.platform == "win32":
        return 0.0
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / (1e9 if sys.platform == "darwin" else 1e6)  # B, KiB

def finish(line, result, metric=None, out_dir=None, description=""):
    """Print the run's last line and leave the process group; given out_dir (rank 0 of a finished run), add a row to
    results.tsv beside it, the experiment log of every script. Returns result."""
    if out_dir:
        git = shutil.which("git") and subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True,
                                                     text=True, cwd=os.path.dirname(os.path.abspath(__file__))).stdout
        row = [time.strftime("%Y%m%d-%H%M%S"), os.path.basename(__file__), (git or "unknown").strip(), metric,
               f"{result[metric]:.4f}", f"{result['peak_mem_gb']:.2f}", f"{result['wall_time']:.0f}",
               description.replace("\t", " ")]
        with open(os.path.join(os.path.dirname(os.path.abspath(out_dir)), "results.tsv"), "a") as f:
            f.write(("" if f.tell() else "run_id\tscript\tcommit\tmetric\tvalue\tpeak_mem_gb\twall_s\tdescription\n")
                    + "\t".join(row) + "\n")
    print(line)
    if dist.is_initialized():
        dist.destroy_process_group()
    return result

def preempted(signal, step, train_time, out_dir):
    """The end of a run that a signal stopped: its checkpoint is saved; it exits 0, and --resume goes on."""
    return finish(f"stopped by {signal or 'a signal to another rank'} at step {step}: checkpoint saved in {out_dir}; "
                  f"run the same command with --resume to continue", {"preempted": True, "steps": step,
                  "train_time": train_time})

def model_state(model, opts, ema=None, full=True):
    """{model, optim, ema, ema_t}: the state dicts in full on the CPU (a collective under FSDP), or this rank's
    shards; the EMA's through the model, to be sharded as it is."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    options = StateDictOptions(full_state_dict=full, cpu_offload=full)
    sd = dict(zip(("model", "optim"), get_state_dict(model, opts, options=options)), ema=None, ema_t=0)
    if ema:  # a copy: on CPU the live tensors swap back
        ema.swap()
        sd["ema"] = {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}
        ema.swap()
        sd["ema_t"] = ema.t
    return sd

def apply_checkpoint(ckpt, model, opts, scaler, guard, ema=None):
    """Load a checkpoint dict into the run's objects (a sharded one's tensors are read here, each rank its parts,
    resharded by DCP if the ranks changed); returns its (step, train_time, history)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict
    options = StateDictOptions(full_state_dict="shards" not in ckpt)
    if "shards" in ckpt:
        ckpt = {**ckpt, **read_shards(ckpt["shards"], model_state(model, opts, ema, full=False))}
    set_state_dict(model, opts, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"], options=options)
    if ema:
        ema.swap()
        set_model_state_dict(model, ckpt["ema"], options=options)
        ema.swap()
        ema.t = int(ckpt["ema_t"])
    scaler.load_state_dict(ckpt["scaler"])
    guard.load_state(ckpt["guard"])
    history = list(ckpt["history"])  # int, float, list: a crafted checkpoint fails here, in one line
    if not all(isinstance(h, dict) for h in history):
        raise ValueError("its history is not a list of records")
    return int(ckpt["step"]), float(ckpt["train_time"]), history

class CheckpointWriter:
    """Writes checkpoints one at a time, in a thread that training does not wait for with async_save. Under FSDP
    (sharded) every rank writes its shards with DCP, and rank 0 a state.pt."""

    def __init__(self, out_dir, keep_last, milestone_every, async_save, sharded, master):
        self.out_dir, self.keep, self.async_save = out_dir, (keep_last, milestone_every), async_save
        self.sharded, self.master, self.thread, self.error, self.group = sharded, master, None, None, None

    def save(self, ckpt):
        """Write ckpt (every rank calls this). DCP writes in a gloo group of its own: on the training's, its messages
        could interleave with the training's all-reduces."""
        self.wait()
        shards = None
        if self.sharded:
            import torch.distributed.checkpoint as dcp
            path = os.path.join(self.out_dir, f"ckpt_{ckpt['step']:07d}")
            if self.master:  # a torn or abandoned folder of this step: none of its files may mix with these
                shutil.rmtree(path, ignore_errors=True)
            dist.barrier()
            sd = {k: ckpt.pop(k) for k in ("model", "optim", "ema")}
            ckpt["shards"] = {"param_groups": sd["optim"]["param_groups"]}
            self.group = self.group or dist.new_group(backend="gloo")
            kw = dict(storage_writer=dcp.FileSystemWriter(path), process_group=self.group)
            shards = (dcp.async_save(dcp_part(sd), **kw).result if self.async_save  # a CPU copy now, then a thread
                      else functools.partial(dcp.save, dcp_part(sd), **kw))
        if self.master or shards:
            ckpt = copy.deepcopy(ckpt) if self.async_save else ckpt
            self.thread = threading.Thread(target=self.write, args=(ckpt, shards))
            self.thread.start()
            if not self.async_save:
                self.wait()

    def write(self, ckpt, shards):
        try:
            write_checkpoint(self.out_dir, ckpt, *self.keep, shards, self.master)
        except SystemExit as e:  # a failed write: the run stops at the next wait()
            self.error = e

    def wait(self):
        """Block until the checkpoint in flight is on disk; a failed write (a full disk) stops the run."""
        if self.thread:
            self.thread.join()
            self.thread = None
        if self.error:
            raise self.error

def write_checkpoint(out_dir, ckpt, keep_last=0, milestone_every=0, shards=None, master=True):
    """ckpt_STEP.pt via a temp file, fsynced and renamed (sharded: shards() writes the tensors first, and state.pt
    lists their sizes); then all but the newest keep_last and the milestones go. A failed write stops the run."""
    path = os.path.join(out_dir, f"ckpt_{ckpt['step']:07d}" + ("/state.pt" if shards else ".pt"))
    folder, tmp = os.path.dirname(path), os.path.join(os.path.dirname(path), "ckpt.tmp")
    try:
        if shards:
            shards()  # DCP gathers every rank's result: once rank 0's returns, all the shards are on disk
            if not master:
                return
            ckpt["shards"]["sizes"] = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)}
        os.makedirs(out_dir, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:  # noqa: BLE001 - DCP's CheckpointException is a BaseException; the failure is reported
        e = next(iter(e.failures.values()))[0] if hasattr(e, "failures") else e  # DCP's wraps each rank's error
        if os.path.exists(tmp):
            os.remove(tmp)
        die(f"writing {path} failed ({getattr(e, 'strerror', None) or e}); the earlier checkpoints are intact")
    for s, p in list_checkpoints(out_dir)[:-keep_last] if keep_last > 0 else []:  # all older: a rollback or resume
        if not (milestone_every and s % milestone_every == 0):  # deleted any newer, so only good ones count
            remove(p)

def remove(path):
    """Delete a checkpoint: a file, or a folder of shards."""
    if os.path.isdir(path):
        return shutil.rmtree(path)
    os.remove(path)

def list_checkpoints(out_dir):
    """[(step, path)] of the ckpt_STEP.pt files and ckpt_STEP/ folders in out_dir, oldest first."""
    found = [(re.fullmatch(r"ckpt_(\d+)(\.pt)?", os.path.basename(p)), p) for p in glob.glob(f"{out_dir}/ckpt_*")]
    return sorted((int(m[1]), p) for m, p in found if m)

def resume_point(out_dir, resume, layout, master):
    """(checkpoint, path) to go on from (--resume, or after a torchrun restart): the newest intact one in out_dir,
    of the same layout (a dtype of auto: any), or (None, None). Rank 0 deletes the newer, unreadable ones."""
    found = list_checkpoints(out_dir)
    if found and not (resume or int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))):
        die(f"{out_dir} holds checkpoints of an earlier run; continue it with --resume or pick a new --out_dir")
    if not found:
        if resume:
            print(f"--resume: no checkpoint in {out_dir} yet, starting from scratch")
        return None, None
    ckpt, path = load_checkpoint(out_dir, whole=False)
    if ckpt is None:
        die(f"--resume: no checkpoint in {out_dir} is readable (see warnings above); nothing was changed")
    with reading(path, "it is not a checkpoint of this run; pass a new --out_dir"):
        saved = run_layout(ckpt["config"], ckpt["world_size"], ckpt["data_info"])
        diff = [f"{k}={v!r} (now {layout.get(k)!r})" for k, v in saved.items() if layout.get(k) not in (v, "auto")]
    if diff:
        die(f"--resume: {path} was made with a different config: {', '.join(diff)}; pass the same flags or use a new "
            f"--out_dir")
    remove_after(out_dir, ckpt["step"], master)
    return ckpt, path

def resumed(path, step, done, out_dir):
    """Say where a resumed run goes on from; one whose budget is spent (done) has nothing left to train."""
    if done:
        die(f"--resume: the run in {out_dir} is complete at step {step}; raise its budget (--max_steps, "
            f"--time_budget, ...) to train on")
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    print(f"resumed from {path} at step {step}" + (f" (torchrun restart {restarts})" if restarts else ""))

MAX_ROLLBACKS = 3  # to one checkpoint: if its steps keep going bad, the fix is in the flags

def rollback_point(out_dir, guard, reason, rollbacks, world_size, master, metrics, step):
    """The newest intact checkpoint from before the guard's first bad step, to roll back to at step; rank 0 deletes
    the newer ones (a timeline nothing may resume). rollbacks counts them per step: too many, or none, stop the run."""
    if world_size > 1:
        dist.barrier()  # rank 0's checkpoint write is on disk before any rank looks
    ckpt, path = load_checkpoint(out_dir, before=guard.bad[0], whole=False)
    if ckpt is None:  # going on would skip steps to the end of the budget; nothing is saved over a good checkpoint
        die(f"{guard.max_bad} bad steps in {guard.window} (the last: {reason}) and no checkpoint from before step "
            f"{guard.bad[0]} to roll back to; lower --lr, or pass --save_every so that a rollback has one")
    rollbacks[ckpt["step"]] = rollbacks.get(ckpt["step"], 0) + 1
    if rollbacks[ckpt["step"]] > MAX_ROLLBACKS:
        die(f"bad steps go on after {MAX_ROLLBACKS} rollbacks to step {ckpt['step']} (the last: {reason}); lower --lr "
            f"or raise --warmup_steps")
    print(f"step {step:05d} | rollback to {path} (step {ckpt['step']}): the batches read since are skipped")
    record(metrics, step=step, event="rollback", to_step=ckpt["step"])
    remove_after(out_dir, ckpt["step"], master)
    return ckpt

def remove_after(out_dir, step, master):
    """Rank 0 deletes the checkpoints newer than step."""
    for s, p in list_checkpoints(out_dir) if master else []:
        if s > step:
            remove(p)

def load_checkpoint(where, before=None, whole=True):
    """(checkpoint, path) of a file or folder, or of the newest intact one in a directory (before step `before`), or
    (None, None). Intact: CRC-32s, sizes and weights_only loading pass. whole=False leaves a folder's tensors unread."""
    one = os.path.isfile(where) or re.fullmatch(r"ckpt_\d+", os.path.basename(os.path.normpath(where)))
    found = [(0, where)] if one else list_checkpoints(where)
    for _, path in reversed([c for c in found if before is None or c[0] < before]):
        try:
            file = os.path.join(path, "state.pt") if os.path.isdir(path) else path
            if not os.path.exists(file):
                raise ValueError("incomplete: it has no state.pt, which rank 0 writes last")
            bad = zipfile.ZipFile(file).testzip()
            if bad:
                raise ValueError(f"the checksum of {bad} does not match")
            ckpt, sharded = torch.load(file, map_location="cpu", weights_only=True), file != path
            if not isinstance(ckpt, dict) or not {"config", "step", "shards" if sharded else "model"} <= ckpt.keys():
                raise ValueError("not a checkpoint of these scripts")
            if sharded:
                for name, size in ckpt["shards"].pop("sizes").items():
                    if os.path.getsize(os.path.join(path, name)) != size:
                        raise ValueError(f"{name} has {os.path.getsize(os.path.join(path, name))} bytes, not {size}")
                ckpt["shards"]["path"] = path
                ckpt.update(read_shards(ckpt.pop("shards")) if whole else {})
            return ckpt, path
        except Exception as e:  # noqa: BLE001 - whatever is wrong with it, it is not used
            why = "it holds objects other than tensors and plain data, which could run code" if isinstance(
                e, pickle.UnpicklingError) else str(e).split("\n")[0] or type(e).__name__
            if one:
                die(f"{path} is not a usable checkpoint ({why}); pass one written by {os.path.basename(__file__)}")
            print(f"warning: skipping checkpoint {path}, truncated or corrupt: {why}", file=sys.stderr)
    return None, None

def dcp_part(sd):
    """The tensors of {model, optim, ema}, which DCP writes: the optimizers' param groups go into state.pt."""
    return {k: {"state": sd[k]["state"]} if k == "optim" else sd[k]
            for k in ("model", "optim", "ema") if sd[k] is not None}

def read_shards(shards, into=None):
    """{model, optim, ema} of a sharded checkpoint, read into `into` (this rank's shards) or whole; safely."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    with open(os.path.join(shards["path"], ".metadata"), "rb") as f:
        meta = MetadataUnpickler(f).load()
    if any(s.relative_path != os.path.basename(s.relative_path) or s.transform_descriptors
           for s in meta.storage_data.values()):
        raise ValueError("its .metadata names files outside its folder")
    reader, sd = dcp.FileSystemReader(shards["path"]), dcp_part(into) if into else {}
    reader.read_metadata = lambda *args, **kw: meta
    try:
        _load_state_dict(sd, storage_reader=reader, planner=None if into else _EmptyStateDictLoadPlanner(),
                         no_dist=not (into and dist.is_initialized()))
    except dcp.CheckpointException as e:  # a BaseException, which wraps each rank's error
        raise ValueError(next(iter(e.failures.values()))[0]) from None
    return {"ema": None, **sd, "optim": {**sd["optim"], "param_groups": shards["param_groups"]}}

class MetadataUnpickler(pickle.Unpickler):
    """Unpickles a sharded checkpoint's .metadata, allowing only the classes DCP writes there for tensors."""
    ALLOWED = {("torch", "Size"), ("torch.serialization", "_get_layout"), ("pathlib", "PosixPath"),
               ("pathlib", "WindowsPath"), ("torch.distributed.checkpoint.filesystem", "_StorageInfo")} | {
        ("torch.distributed.checkpoint.metadata", n) for n in ("Metadata", "MetadataIndex", "StorageMeta",
            "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}

    def find_class(self, module, name):
        if (module, name) in self.ALLOWED or module == "torch" and isinstance(vars(torch).get(name), torch.dtype):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"its .metadata asks for {module}.{name}, which DCP's metadata does not hold")

@contextlib.contextmanager
def reading(path, fix):
    """Any error while making sense of `path` stops the run with one line that names it and the fix."""
    try:
        yield
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError, RuntimeError, EOFError,
            pickle.UnpicklingError) as e:
        die(f"{path}: {type(e).__name__}: {' '.join(str(e).split())[:200] or 'unreadable'}; {fix}")

class Guard:
    """Whether an update is safe: a loss or grad norm that is non-finite, or sigma running stds over its running mean,
    is bad; max_bad bad steps in window call for a rollback (PaLM, Chowdhery et al. 2022, 5.1)."""

    def __init__(self, loss_sigma=6.0, gnorm_sigma=0.0, window=100, max_bad=5, clip_mult=0.0):
        self.sigma, self.window, self.max_bad, self.clip_mult = (loss_sigma, gnorm_sigma), window, max_bad, clip_mult
        self.load_state({"n": 0, "mean": [0.0, 0.0], "var": [0.0, 0.0], "bad": []})

    def state(self):
        return {"n": self.n, "mean": list(self.mean), "var": list(self.var), "bad": list(self.bad)}

    def load_state(self, s):
        self.n, self.bad = int(s["n"]), [int(b) for b in s["bad"]]
        self.mean, self.var = [float(v) for v in s["mean"][:2]], [float(v) for v in s["var"][:2]]

    def clip(self, max_norm):
        """This step's clipping threshold: max_norm (0 = none), lowered to clip_mult x the running grad-norm mean."""
        limit = max_norm if max_norm > 0 else float("inf")
        return min(limit, self.clip_mult * self.mean[1]) if self.clip_mult and self.n >= 10 else limit

    def check(self, step, loss, gnorm):
        """None if the update is safe, else the reason; good values update the running statistics."""
        finite = math.isfinite(loss) and math.isfinite(gnorm)
        reason = None if finite else f"non-finite loss {loss:.4g} or grad norm {gnorm:.4g}"
        for i, (v, name) in enumerate(((loss, "loss"), (gnorm, "grad norm"))):
            std = max(math.sqrt(self.var[i]), 0.02 * abs(self.mean[i]))  # a floor: a flat loss has a tiny std
            if reason is None and self.sigma[i] and self.n >= 10 and v > self.mean[i] + self.sigma[i] * std:
                reason = f"{name} spike ({v:.4g} > mean {self.mean[i]:.4g} + {self.sigma[i]:g} x std {std:.2g})"
        if reason:
            self.bad = [s for s in self.bad if s > step - self.window] + [step]
            return reason
        self.n += 1
        a = max(1.0 / self.n, 1.0 / self.window)  # a plain mean at first, then an exponential moving average
        for i, v in enumerate((loss, gnorm)):
            d = v - self.mean[i]
            self.mean[i], self.var[i] = self.mean[i] + a * d, (1 - a) * (self.var[i] + a * d * d)

    def rollback_due(self):
        return self.max_bad > 0 and len(self.bad) >= self.max_bad

class StopSignal:
    """SIGTERM (preemption) or SIGINT (Ctrl-C) sets stop.received: the run saves and exits 0; a second acts at once."""

    def __enter__(self):
        self.received, main = None, threading.current_thread() is threading.main_thread()  # handlers run there only
        self.old = {sig: signal.signal(sig, self.handle) for sig in (signal.SIGTERM, signal.SIGINT)} if main else {}
        return self

    def handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        signal.signal(signum, self.old[signum])

    def __exit__(self, *exc):
        for sig, handler in self.old.items():
            signal.signal(sig, handler)

def prepare_default_data(cfg, rank, world_size, command, what, *flags):
    """With the default data_dir and no data yet, rank 0 runs prepare_data.py `command` (no network); the rest wait."""
    if cfg.data_dir != type(cfg).data_dir or os.path.exists(os.path.join(cfg.data_dir, "meta.json")):
        return
    if rank == 0:
        print(f"no data in {cfg.data_dir}: preparing {what} (no network needed)", flush=True)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prepare_data.py")
        if subprocess.run([sys.executable, script, command, *flags, f"--data_dir={cfg.data_dir}"]).returncode:
            die(f"preparing {what} failed (see above)")
    if world_size > 1:
        dist.barrier()
# === end shared ===

# -----------------------------------------------------------------------------
# Entry point

if __name__ == "__main__":
    main(parse_args(Config, sys.argv[1:]))
