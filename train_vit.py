"""
train_vit.py: a Vision Transformer, trained from scratch on images held on the GPU, in one file.

Patch embedding, 2-D sin-cos positions, pre-norm blocks (RMSNorm, QK-norm, GELU or SwiGLU,
LayerScale, stochastic depth, registers), average pooling; augmentation on the device; Muon or
AdamW; an EMA of the weights; bf16/fp16, torch.compile, DDP or FSDP2, exact resume and the
guards of train_gpt.py.

  python train_vit.py                  # CPU demo: generates the shapes dataset, ~4 min
  python prepare_data.py cifar10 && python train_vit.py --preset=cifar10
  torchrun --nproc_per_node=8 train_vit.py --preset=cifar10
  python train_vit.py --predict=IMAGE_OR_DIR --ckpt=out/vit
  python train_vit.py --benchmark --preset=cifar10
  python train_vit.py -h               # every flag, with its default
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
    data_dir: str = "data/shapes"      # images from prepare_data.py (shapes, cifar10, cifar100, mnist, imagefolder...)
    out_dir: str = "out/vit"           # checkpoints, metrics.jsonl, config.json, plots; results.tsv goes beside it
    preset: str = ""                   # named overrides: cpu_demo|cifar10 (explicit flags still win)
    # model
    image_size: int = 0                # 0 = the data's; else must equal it (resize with prepare_data.py --image_size)
    patch_size: int = 8                # pixels per side of a patch: (image_size / patch_size)^2 tokens (16 on shapes)
    n_layer: int = 4                   # transformer blocks
    n_head: int = 4                    # attention heads
    n_embd: int = 0                    # model width; 0 = 128, or 64 on a train split under 10,000 images
    mlp: Literal["gelu", "swiglu"] = "gelu"
    mlp_ratio: float = 4.0             # MLP hidden width / n_embd (SwiGLU uses 2/3 of it, same parameter count)
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"  # pre-norm either way
    qk_norm: bool = True               # RMSNorm on queries and keys, bounds the attention logits
    pos_emb: Literal["sincos", "learned"] = "sincos"
    pool: Literal["gap", "cls"] = "gap"  # average the patch tokens, or read a class token
    registers: int = 0                 # extra learned tokens that attention may use as scratch (Darcet et al. 2024)
    layer_scale: float = 0.0           # LayerScale init, a learned per-channel gain on each branch (CaiT); 0 = off
    drop_path: float = 0.0             # stochastic depth rate of the last block, rising linearly from 0
    init_std: float = 0.02             # std of the hidden weights at init; output projections and head start at zero
    # budget: max_steps, else epochs, else time_budget
    max_steps: int = 0                 # optimizer steps; 0 = from epochs or time_budget
    epochs: float = 0.0                # passes over the train split; 0 = from max_steps or time_budget
    time_budget: float = 200.0         # seconds of training (eval excluded); the LR schedule follows elapsed time
    batch_size: int = 128              # micro-batch per rank, in images
    grad_accum: int = 1                # micro-steps per optimizer step
    # optimizer and schedule
    optimizer: Literal["muon", "adamw"] = "muon"  # Muon on 2-D hidden matrices, AdamW on the rest
    lr: float = 2e-3                   # peak LR
    weight_decay: float = 0.05         # decoupled, on 2-D hidden matrices only
    beta1: float = 0.9                 # AdamW
    beta2: float = 0.95                # AdamW
    grad_clip: float = 1.0             # max global grad norm; 0 = off
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # after linear warmup
    warmup_steps: int = 100            # linear warmup, in optimizer steps
    cooldown_frac: float = 0.2         # wsd: fraction of the run spent in the final linear decay
    final_lr_frac: float = 0.0         # LR at the end of cosine/wsd, as a fraction of the peak
    ema: float = 0.999                 # decay of the EMA of the weights (warmed up as min(ema, (1+t)/(10+t))); 0 = off
    # augmentation, on the device
    translate: int = 4                 # random shift of up to this many pixels (reflect-padded crop); 0 = off
    flip: Literal["auto", "true", "false"] = "auto"  # random horizontal flips; auto = the data's flip_ok
    mixup: float = 0.0                 # Beta(a, a) of mixup (Zhang et al. 2018); 0 = off
    cutmix: float = 0.0                # Beta(a, a) of cutmix (Yun et al. 2019); 0 = off; with mixup, either per batch
    label_smoothing: float = 0.1       # target mass spread evenly over all classes
    # eval, logging, checkpoints
    eval_every: int = 400              # steps between evals; 0 = only at the end
    eval_images: int = 1000            # val images per periodic eval; the final eval reads the whole val split
    tta_flip: bool = False             # average the predictions on each val image and its mirror image
    log_every: int = 25                # steps between log lines
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
    seed: int = 1337                   # init, data order, augmentation
    benchmark: bool = False            # time steps on synthetic images and exit; needs no data
    bench_steps: int = 20              # timed steps in --benchmark, after 5 warm-up steps
    profile: bool = False              # --benchmark: 3 more steps under torch.profiler; trace.json in out_dir, top ops
    kernels: Literal["auto", "triton", "torch"] = "auto"  # per op the faster (kernels.use), Triton, or PyTorch's
    # prediction
    predict: str = ""                  # an image file or a folder of them: print class probabilities and exit
    ckpt: str = ""                     # checkpoint file or directory for --predict; empty = out_dir
    top_k: int = 5                     # classes shown per image by --predict

PRESETS = {
    "cpu_demo": {},  # the defaults: 0.8M parameters, 16 patches of 8x8, 200 s of training on a 2-core CPU
    # one GPU, minutes; the settings of the strong small-data ViT recipes (DeiT, Beyer et al. 2022), not yet measured
    "cifar10": dict(data_dir="data/cifar10", out_dir="out/vit_cifar10", patch_size=2, n_layer=8, n_head=6, n_embd=384,
                    optimizer="adamw", layer_scale=0.1, drop_path=0.1, time_budget=0.0, epochs=60, batch_size=512,
                    lr=2e-3, warmup_steps=500, mixup=0.8, cutmix=1.0, ema=0.9995, eval_every=1000, eval_images=10000,
                    tta_flip=True),
}
ARCH_FIELDS = ("patch_size", "n_layer", "n_head", "n_embd", "mlp", "mlp_ratio", "norm", "qk_norm", "pos_emb", "pool",
               "registers", "layer_scale")

# -----------------------------------------------------------------------------
# Model

class Norm(nn.Module):
    """RMSNorm (default) or bias-free LayerNorm over the last dim."""

    def __init__(self, dim, kind="rmsnorm", eps=1e-6):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.kind == "rmsnorm":
            return kernels.rms_norm(x, self.weight, self.eps)
        return F.layer_norm(x, (x.size(-1),), self.weight, None, self.eps)

class Attention(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.hd = cfg.n_embd // cfg.n_head
        self.qkv = nn.Linear(cfg.n_embd, 3 * cfg.n_embd, bias=False)
        self.proj = nn.Linear(cfg.n_embd, cfg.n_embd, bias=False)
        self.q_norm = Norm(self.hd) if cfg.qk_norm else nn.Identity()
        self.k_norm = Norm(self.hd) if cfg.qk_norm else nn.Identity()

    def forward(self, x):
        B, T, C = x.shape
        q, k, v = self.qkv(x).view(B, T, 3, -1, self.hd).permute(2, 0, 3, 1, 4)  # (B, nh, T, hd)
        y = kernels.attention(self.q_norm(q), self.k_norm(k), v, causal=False)  # no mask
        return self.proj(y.transpose(1, 2).reshape(B, T, C))

class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.swiglu, hidden = cfg.mlp == "swiglu", int(cfg.mlp_ratio * cfg.n_embd)
        if self.swiglu:  # three matrices: 2/3 of the width keeps the parameters (Shazeer 2020)
            hidden = 2 * hidden // 3
        self.fc = nn.Linear(cfg.n_embd, 2 * hidden if self.swiglu else hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        if self.swiglu:
            a, b = self.fc(x).chunk(2, dim=-1)
            return self.proj(F.silu(a) * b)
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))

def drop_path(x, p, training):
    """Stochastic depth (Huang et al. 2016): zero x for a random p of samples, rescale the rest."""
    if not training or p == 0:
        return x
    keep = (torch.rand(x.size(0), 1, 1, device=x.device) >= p).to(x.dtype)
    return x * keep / (1 - p)

class Block(nn.Module):
    def __init__(self, cfg, drop):
        super().__init__()
        self.norm1, self.attn = Norm(cfg.n_embd, cfg.norm), Attention(cfg)
        self.norm2, self.mlp = Norm(cfg.n_embd, cfg.norm), MLP(cfg)
        self.drop = drop
        self.ls1 = nn.Parameter(torch.ones(cfg.n_embd)) if cfg.layer_scale else None  # LayerScale
        self.ls2 = nn.Parameter(torch.ones(cfg.n_embd)) if cfg.layer_scale else None

    def forward(self, x):
        a = self.attn(self.norm1(x))
        x = x + drop_path(a * self.ls1 if self.ls1 is not None else a, self.drop, self.training)
        m = self.mlp(self.norm2(x))
        return x + drop_path(m * self.ls2 if self.ls2 is not None else m, self.drop, self.training)

class ViT(nn.Module):
    def __init__(self, cfg, image_size, channels, num_classes, mean, std):
        super().__init__()
        self.cfg, p, d = cfg, cfg.patch_size, cfg.n_embd
        self.grid = image_size // p
        self.patch = nn.Linear(p * p * channels, d)  # a stride-p convolution, as a matmul
        if cfg.pos_emb == "learned":
            self.pos = nn.Parameter(torch.zeros(self.grid ** 2, d))
        else:
            self.register_buffer("pos", torch.zeros(self.grid ** 2, d), persistent=False)
        self.n_extra = int(cfg.pool == "cls") + cfg.registers  # [cls] and registers
        self.extra = nn.Parameter(torch.zeros(self.n_extra, d)) if self.n_extra else None
        rates = [cfg.drop_path * i / max(cfg.n_layer - 1, 1) for i in range(cfg.n_layer)]
        self.blocks = nn.ModuleList(Block(cfg, r) for r in rates)
        self.norm = Norm(d, cfg.norm)
        self.head = nn.Linear(d, num_classes)
        # the data's channel statistics: the model takes pixels in [0, 1]
        self.register_buffer("mean", torch.tensor(mean, dtype=torch.float32))
        self.register_buffer("std", torch.tensor(std, dtype=torch.float32))
        self.init_args = (list(mean), list(std))

    @torch.no_grad()
    def init_weights(self):
        """Initialise every parameter and buffer (the model was built on the meta device)."""
        c = self.cfg
        for name, p in self.named_parameters():
            if name.endswith("proj.weight") or name.startswith("head."):
                nn.init.zeros_(p)  # blocks start as the identity, the loss at ln(classes)
            elif name.split(".")[-1] in ("ls1", "ls2"):
                nn.init.constant_(p, c.layer_scale)  # LayerScale (Touvron et al. 2021)
            elif p.ndim == 1:  # biases 0, norm gains 1
                nn.init.constant_(p, 0.0 if name.endswith("bias") else 1.0)
            else:
                nn.init.trunc_normal_(p, std=c.init_std, a=-2 * c.init_std, b=2 * c.init_std)
        if c.pos_emb == "sincos":
            self.pos.copy_(sincos_2d(self.grid, self.grid, c.n_embd))
        self.mean.copy_(torch.tensor(self.init_args[0]))
        self.std.copy_(torch.tensor(self.init_args[1]))

    def forward(self, x, features=False):
        """x (B, H, W, C) pixels in [0, 1] -> logits (B, classes), or features (B, d)."""
        B, H, W, C = x.shape
        p, g = self.cfg.patch_size, self.grid
        x = (x - self.mean) / self.std
        x = x.view(B, g, p, g, p, C).permute(0, 1, 3, 2, 4, 5).reshape(B, g * g, -1)  # patches
        x = self.patch(x) + self.pos.to(x.dtype)  # (B, N, d)
        if self.n_extra:  # [cls] and registers go first, with no position
            x = torch.cat((self.extra.to(x.dtype).expand(B, -1, -1), x), dim=1)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        f = x[:, 0] if self.cfg.pool == "cls" else x[:, self.n_extra:].mean(1)  # no registers
        return f if features else self.head(f)

    def flops_per_image(self):
        """Training FLOPs per image: 6 per matmul weight per token, plus attention (PaLM)."""
        # the patch embedding makes no grad for the pixels: 4 a weight, not 6. FlopCounterMode counts 1.7% more at
        # cifar10 (tests/test_compile.py): the scores that a flash backward recomputes, which MFU leaves out
        T, patch = self.grid ** 2 + self.n_extra, 4 * self.grid ** 2 * self.patch.weight.numel()
        n = sum(p.numel() for p in self.blocks.parameters() if p.ndim == 2)
        return T * (6 * n + 12 * self.cfg.n_layer * self.cfg.n_embd * T) + patch + 6 * self.head.weight.numel()

def build_model(cfg, meta, device):
    """Build on the meta device, materialise on device, initialise under cfg.seed."""
    with torch.device("meta"):
        model = ViT(cfg, meta["image_size"][0], meta["channels"], meta["num_classes"], meta["mean"], meta["std"])
    model.to_empty(device=device)
    torch.manual_seed(cfg.seed)
    model.init_weights()
    return model

# -----------------------------------------------------------------------------
# Data

def augment(x, cfg, flip):
    """Shift each image of x (B, H, W, C) by up to cfg.translate pixels; flip it if flip."""
    B, H, W, _ = x.shape
    dev = x.device
    if cfg.translate:
        t = cfg.translate
        xp = F.pad(x.permute(0, 3, 1, 2), (t, t, t, t), mode="reflect").permute(0, 2, 3, 1)  # (B, H+2t, W+2t, C)
        dy, dx = torch.randint(0, 2 * t + 1, (2, B, 1), device=dev)
        rows, cols = dy + torch.arange(H, device=dev), dx + torch.arange(W, device=dev)  # (B, H), (B, W)
        x = xp[torch.arange(B, device=dev)[:, None, None], rows[:, :, None], cols[:, None, :]]
    if flip:
        x = torch.where(torch.rand(B, 1, 1, 1, device=dev) < 0.5, x.flip(2), x)
    return x

def mix(x, y, cfg):
    """Mixup or cutmix (one at random if both, as timm) of the batch with its reverse:
    (x, y, y reversed, lam), the loss being lam CE(y) + (1 - lam) CE(y reversed)."""
    use_cutmix = cfg.cutmix > 0 and (cfg.mixup == 0 or torch.rand(()).item() < 0.5)
    alpha = cfg.cutmix if use_cutmix else cfg.mixup
    if alpha == 0:
        return x, y, y, 1.0
    lam = torch.distributions.Beta(alpha, alpha).sample().item()
    if use_cutmix:  # paste a box of area 1 - lam from the partner; lam is then the area kept
        B, H, W, _ = x.shape
        h, w = int(H * math.sqrt(1 - lam)), int(W * math.sqrt(1 - lam))
        cy, cx = int(torch.randint(H, ())), int(torch.randint(W, ()))
        y0, y1, x0, x1 = max(cy - h // 2, 0), min(cy + h // 2, H), max(cx - w // 2, 0), min(cx + w // 2, W)
        x = x.clone()
        x[:, y0:y1, x0:x1] = x.flip(0)[:, y0:y1, x0:x1]
        lam = 1 - (y1 - y0) * (x1 - x0) / (H * W)
    else:
        x = lam * x + (1 - lam) * x.flip(0)
    return x, y, y.flip(0), lam

# -----------------------------------------------------------------------------
# Optimizer and schedule

# === shared: muon ===
class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024) for 2-D hidden matrices: Nesterov momentum, orthogonalised,
    scaled to AdamW's update RMS, 0.2 sqrt(max(rows, cols)), so one LR serves both (Moonlight).
    torch.optim.Muon with adjust_lr_fn="match_rms_adamw", but a batched matmul per shape, in
    bf16 only if the run is (torch.optim.Muon's bf16 is ~100x slower where a CPU emulates it)."""

    def __init__(self, params, lr, weight_decay=0.0, momentum=0.95, ns_dtype=torch.bfloat16):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            lr, wd, mom = group["lr"], group["weight_decay"], group["momentum"]
            shapes = {}
            for p in group["params"]:
                if p.grad is not None:
                    shapes.setdefault(p.shape, []).append(p)
            for ps in shapes.values():
                bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in ps]
                torch._foreach_lerp_(bufs, [p.grad for p in ps], 1 - mom)
                x = torch.stack([p.grad.lerp(b, mom) for p, b in zip(ps, bufs)])  # Nesterov, (n, r, c)
                x = orthogonalise(x.to(self.ns_dtype)).to(ps[0].dtype)
                torch._foreach_mul_(ps, 1 - lr * wd)
                torch._foreach_add_(ps, x.unbind(0), alpha=-lr * 0.2 * math.sqrt(max(ps[0].shape)))

def orthogonalise(x):
    """Roughly U V^T for each x = U S V^T (..., rows, cols), by 5 Newton-Schulz steps."""
    a, b, c = 3.4445, -4.7750, 2.0315  # a quintic that pushes singular values near 1 fast
    tall = x.size(-2) > x.size(-1)
    x = x.mT if tall else x  # the Gram matrix x x^T is the smaller square
    x = x / x.norm(dim=(-2, -1), keepdim=True).clamp(min=1e-7)  # spectral norm <= 1
    for _ in range(5):
        gram = x @ x.mT
        x = torch.baddbmm(x, torch.baddbmm(gram, gram, gram, beta=b, alpha=c), x, beta=a)
    return x.mT if tall else x
# === end shared ===

def build_optimizers(cfg, raw, device, dtype=torch.float32):
    """AdamW, with --optimizer=muon Muon on the blocks' matrices; no decay on vectors."""
    named = list(raw.named_parameters())
    hidden = [p for n, p in named if p.ndim == 2 and n.startswith("blocks.")]
    decay_rest = [p for n, p in named if p.ndim == 2 and n.startswith(("patch.", "head."))]
    # norms, biases, positions and the [cls] and register tokens
    no_decay = [p for n, p in named if not (p.ndim == 2 and n.startswith(("blocks.", "patch.", "head.")))]
    opts, decay = [], hidden + decay_rest
    if cfg.optimizer == "muon":
        ns_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        opts.append(Muon(hidden, lr=cfg.lr, weight_decay=cfg.weight_decay, ns_dtype=ns_dtype))
        decay = decay_rest
    groups = [dict(params=decay, weight_decay=cfg.weight_decay), dict(params=no_decay, weight_decay=0.0)]
    opts.append(torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=device.type == "cuda"))
    for opt in opts:
        for g in opt.param_groups:
            g["peak_lr"] = g["lr"]
    return opts

def lr_mult(cfg, step, progress):
    """LR multiplier: linear warmup, then cosine, WSD or no decay over progress in [0, 1]."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    p, f = min(max(progress, 0.0), 1.0), cfg.final_lr_frac
    if cfg.schedule == "cosine":
        return warm * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * p)))
    if cfg.schedule == "wsd" and p >= 1 - cfg.cooldown_frac:  # warmup-stable-decay (Hu et al. 2024)
        return warm * (f + (1 - f) * (1 - p) / cfg.cooldown_frac)
    return warm

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

@torch.no_grad()
def evaluate(model, x_all, y_all, num_classes, B, rank, world_size, ctx, n_images=None, tta_flip=False):
    """Top-1, top-5, mean loss and confusion matrix (true, predicted) of the first n_images val images (None: all)."""
    model.eval()
    n = len(y_all) if n_images is None else min(n_images, len(y_all))
    stats = torch.zeros(3, device=y_all.device, dtype=torch.float64)  # top-1 hits, top-5 hits, loss sum
    conf = torch.zeros(num_classes * num_classes, device=y_all.device, dtype=torch.float64)
    for it in range(math.ceil(n / (B * world_size))):  # the same number of forwards on every rank (FSDP gathers)
        i = (it * world_size + rank) * B
        i, j, w = (i, min(i + B, n), 1.0) if i < n else (0, 1, 0.0)  # a rank past the end runs one image, uncounted
        x, y = x_all[i:j].float() / 255, y_all[i:j]
        with ctx:
            logits = model(x).float()
            if tta_flip:
                logits = torch.stack((logits, model(x.flip(2)).float())).log_softmax(-1).logsumexp(0)  # mean probs
        top = logits.topk(min(5, num_classes), dim=-1).indices  # (b, 5)
        stats += w * torch.stack([(top[:, 0] == y).sum(), (top == y[:, None]).any(1).sum(),
                                  F.cross_entropy(logits, y, reduction="sum")]).double()
        conf += w * torch.bincount(y * num_classes + top[:, 0], minlength=num_classes ** 2).double()
    model.train()
    total = all_mean(torch.cat((stats, conf)), world_size) * world_size
    return {"val_acc": (total[0] / n).item(), "val_top5": (total[1] / n).item(), "val_loss": (total[2] / n).item(),
            "confusion": total[3:].view(num_classes, num_classes).long().cpu().numpy()}

def evaluate_both(cfg, model, ema, val_x, val_y, num_classes, ctx, rank, world_size, step, final=False):
    """(record, confusion matrix, tag "" or "ema_" of the better) of the weights and their EMA on val images."""
    n = None if final else cfg.eval_images
    args = (val_x, val_y, num_classes, cfg.batch_size, rank, world_size, ctx, n, cfg.tta_flip)
    res = {"": evaluate(model, *args)}
    if ema:
        ema.swap()
        res["ema_"] = evaluate(model, *args)
        ema.swap()
    rec = {"step": step, **{tag + k: v for tag, r in res.items() for k, v in r.items() if k != "confusion"}}
    best = max(res, key=lambda t: res[t]["val_acc"])
    conf = res[best]["confusion"]
    rec["per_class_acc"] = (conf.diagonal() / np.maximum(conf.sum(1), 1)).round(4).tolist()
    of_ema = f" | ema acc {100 * rec['ema_val_acc']:.2f}% | ema loss {rec['ema_val_loss']:.4f}" if ema else ""
    print(f"eval {step:05d} | val acc {100 * rec['val_acc']:.2f}% | top5 {100 * rec['val_top5']:.2f}% | loss "
          f"{rec['val_loss']:.4f}{of_ema} | {min(n or len(val_y), len(val_y))} images"
          + (" (flip TTA)" if cfg.tta_flip else ""))
    return rec, conf, best

def plot_results(out_dir, history, confusion, classes):
    """accuracy.png (val accuracy of the model and its EMA, train loss, against step) and confusion.png."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    fig1, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("val_acc", "o-"), ("ema_val_acc", "s-")):
        pts = [(h["step"], 100 * h[key]) for h in history if key in h]
        if pts:
            ax.plot(*zip(*pts), style, label=key.replace("_", " "))
    ax.set(xlabel="step", ylabel="val top-1 accuracy (%)", title=os.path.basename(os.path.abspath(out_dir)))
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    if losses:
        ax2 = ax.twinx()
        ax2.plot(*zip(*losses), color="gray", alpha=0.5, label="train loss")
        ax2.set_ylabel("train loss")
    K = len(classes)
    fig2, ax = plt.subplots(figsize=(2 + 0.5 * K, 1.5 + 0.5 * K) if K <= 30 else (12, 11))
    rates = confusion / np.maximum(confusion.sum(1, keepdims=True), 1)  # each row: where that class's images went
    ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    if K <= 30:
        ax.set_xticks(range(K), classes, rotation=90)
        ax.set_yticks(range(K), classes)
        for i, j in zip(*np.nonzero(confusion)):
            ax.text(j, i, int(confusion[i, j]), ha="center", va="center", fontsize=7,
                    color="white" if rates[i, j] > 0.5 else "black")
    ax.set(xlabel="predicted", ylabel="true", title=f"confusion on val ({int(confusion.sum())} images)")
    for fig, name in ((fig1, "accuracy.png"), (fig2, "confusion.png")):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=120)
        plt.close(fig)

def main(cfg):
    """Train (or --benchmark, or --predict) per cfg; returns a dict of final metrics."""
    check_config(cfg)
    if cfg.predict:
        return predict_main(cfg)
    with StopSignal() as stop:  # SIGTERM or SIGINT: finish the step, save, exit 0; handlers restored on return
        return train(cfg, stop)

def train(cfg, stop):
    """Set up, resume, then the loop: micro-steps, clip, agree, check, step, log, eval, save. A signal stops it."""
    rank, world_size, device = setup_dist(cfg.device)
    wall0 = time.perf_counter()
    # data: both splits held whole on the device as uint8; random images for --benchmark
    meta, train_loader, val_x, val_y = image_data(cfg, rank, world_size, device, "the shapes dataset")
    (H, W), C, K = meta["image_size"], meta["channels"], meta["num_classes"]
    flip, why = flips(cfg, meta)
    data_info = {"num_classes": K, "image_size": [H, W], "channels": C}

    # cfg settles here, before anything derives from it: the width (auto: under 10k images 128 stalls near chance
    # for ~500 steps where 64 learns, README) and the precision (auto: a resumed run's, else decided now)
    width = cfg.n_embd or (64 if len(train_loader.y) < 10000 and not cfg.benchmark else 128)
    layout = run_layout({**dataclasses.asdict(cfg), "n_embd": width}, world_size, data_info)
    ckpt, path = (None, None) if cfg.benchmark else resume_point(cfg.out_dir, cfg.resume, layout, rank == 0)
    dtype, ctx, scaler = setup_precision(device, cfg.dtype, ckpt)
    cfg = dataclasses.replace(cfg, n_embd=width, dtype=str(dtype).removeprefix("torch."))
    B, accum = cfg.batch_size, cfg.grad_accum
    images_per_step = B * accum * world_size

    # model, optimizers, EMA and guard; the budget: steps (--max_steps or --epochs), or seconds of training
    raw = build_model(cfg, meta, device)
    model, compiled = wrap_model(raw, cfg, device, dtype, world_size)
    opts = build_optimizers(cfg, raw, device, dtype)
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
    print(f"{n_params / 1e6:.2f}M parameters | {len(train_loader.y)} train images of {H}x{W}x{C}, {K} classes"
          f" | {(H // cfg.patch_size) ** 2} patches"
          + f" | {images_per_step} images/step (B {B} x accum {accum} x world {world_size}) | "
          + (f"{time_budget:.0f} s" if time_budget else f"{max_steps} steps ({max_steps / steps_per_epoch:.1f} epochs)")
          + f" | {device} {dtype} | compile {compiled} | kernels {kernels.backend(device)}"
          + f" | {cfg.optimizer} lr {cfg.lr:g} | flips {'on' if flip else 'off'} ({why})")

    # the loop: an optimizer step (micro-steps, clip, agree, check, update, EMA), then log, eval and save
    t0, lap, last_step = time.perf_counter(), (step, train_time), False
    while not last_step:
        # augmentation and stochastic depth draw from the global RNG, seeded by (seed, step, rank): a resumed run
        # draws the same numbers as an uninterrupted one, and the checkpoint needs no RNG state
        torch.manual_seed(cfg.seed + 1000003 * (step + 1) + 7919 * rank)
        mult = lr_mult(cfg, step, train_time / time_budget if time_budget else step / max_steps)  # of the budget
        for opt in opts:
            opt.zero_grad(set_to_none=True)
            for g in opt.param_groups:
                g["lr"] = g["peak_lr"] * mult
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            x, y = train_loader.next()
            x, ya, yb, lam = mix(augment(x.float() / 255, cfg, flip), y, cfg)
            with grad_sync(model, micro == accum - 1):
                with ctx:
                    logits = model(x).float()
                    loss = F.cross_entropy(logits, ya, label_smoothing=cfg.label_smoothing)
                    if lam < 1:  # a mixed batch: each partner's loss, weighted by its share
                        loss = lam * loss + (1 - lam) * F.cross_entropy(logits, yb, label_smoothing=cfg.label_smoothing)
                    loss = loss / accum
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
            rec, conf, best = evaluate_both(cfg, model, ema, val_x, val_y, K, ctx, rank, world_size, step,
                                            done and not stopped)
            record(metrics, **rec)
            history.append({k: v for k, v in rec.items() if k != "per_class_acc"})
        if last_step or (cfg.save_every and step % cfg.save_every == 0):
            writer.save({**model_state(raw, opts, ema, full=not sharded), "scaler": scaler.state_dict(), "step": step,
                         "guard": guard.state(), "train_time": train_time, "history": history, "data_info": data_info,
                         "config": dataclasses.asdict(cfg), "world_size": world_size, "data": train_loader.state(),
                         "data_meta": {k: meta[k] for k in ("classes", "num_classes", "image_size", "channels", "mean",
                                                            "std")}})
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
    if rank == 0:
        side_path("writing the plots", plot_results, cfg.out_dir, history, conf, meta["classes"])
    worst = np.argsort(rec["per_class_acc"])[:3]
    weakest = ", ".join(f"{meta['classes'][i]} {100 * rec['per_class_acc'][i]:.0f}%" for i in worst)
    key, epochs = f"{best}val_acc", step * images_per_step / len(train_loader.y)
    return finish(f"done: {step} steps, {epochs:.1f} epochs in {train_time:.0f} s | val acc {100 * rec[key]:.2f}% "
                  f"({'EMA' if best else 'raw'} weights) | weakest: {weakest} | checkpoint, accuracy.png and "
                  f"confusion.png in {cfg.out_dir}", {**result, **rec, "train_loss": loss,
                  "images": step * images_per_step}, key, rank == 0 and cfg.out_dir, cfg.description)

def load_image(path, size, channels):
    """An image file as (size, size, channels) uint8, its centre square resized to size, as prepare_data.py does."""
    from PIL import Image, ImageOps
    try:
        with Image.open(path) as im:
            im = im.convert("RGB" if channels == 3 else "L")
            a = np.asarray(ImageOps.fit(im, (size, size), Image.Resampling.BILINEAR))
    except (OSError, ValueError, SyntaxError, Image.DecompressionBombError) as e:  # a broken file, a pixel bomb
        die(f"cannot read the image {path} ({type(e).__name__}: {e}); give PNG/JPEG files")
    return a.reshape(size, size, channels)

def predict_main(cfg):
    """--predict: class probabilities of each image in a file or folder, from a checkpoint's EMA weights (if any)."""
    where = cfg.ckpt or cfg.out_dir
    ckpt, path = load_checkpoint(where) if os.path.exists(where) else (None, None)
    if ckpt is None:
        die(f"no complete checkpoint at {where!r}; train first or pass --ckpt=PATH")
    exts = (".png", ".jpg", ".jpeg", ".bmp", ".webp", ".gif")
    files = [cfg.predict] if os.path.isfile(cfg.predict) else sorted(
        f for f in glob.glob(os.path.join(cfg.predict, "**", "*"), recursive=True) if f.lower().endswith(exts))
    if not files:
        die(f"--predict={cfg.predict}: no such image file, or no PNG/JPEG images in that folder")
    _, _, device = setup_dist(cfg.device)
    with reading(path, "pass a checkpoint written by train_vit.py"):
        meta = ckpt["data_meta"]
        trained = Config(**{k: v for k, v in ckpt["config"].items() if k in Config.__dataclass_fields__})
        model = build_model(trained, meta, device).eval()
        model.load_state_dict(ckpt["ema"] if ckpt.get("ema") else ckpt["model"])
        size, classes = int(meta["image_size"][0]), [str(c) for c in meta["classes"]]
    print(f"# {path} (step {ckpt['step']}, {'EMA' if ckpt.get('ema') else 'raw'} weights)")
    out = {}
    for i in range(0, len(files), 256):
        batch = files[i:i + 256]
        x = torch.from_numpy(np.stack([load_image(f, size, meta["channels"]) for f in batch])).to(device)
        with torch.no_grad():
            probs = model(x.float() / 255).float().softmax(-1).cpu()
        for f, p in zip(batch, probs):
            top = p.topk(min(cfg.top_k, len(classes)))
            out[f] = {classes[j]: float(v) for v, j in zip(top.values, top.indices)}
            print(f"{f}: " + " | ".join(f"{c} {100 * v:.1f}%" for c, v in out[f].items()))
    return out

def check_config(cfg):
    """Reject impossible settings with a one-line message that names the fix."""
    check_choices(cfg)
    width = cfg.n_embd or 64  # auto is 64 or 128: heads that split 64 evenly split 128 too
    if width % cfg.n_head or (width // cfg.n_head) % 2:
        die(f"--n_embd={width} must split into {cfg.n_head} heads of even size; change --n_embd or --n_head")
    at_least = dict.fromkeys("patch_size n_layer n_head batch_size grad_accum guard_window top_k".split(), 1)
    at_least |= dict.fromkeys(("n_embd translate mixup cutmix registers layer_scale epochs image_size loss_spike "
                               "gnorm_spike clip_mult rollback_after max_steps time_budget").split(), 0)  # budgets too
    for k, low in at_least.items():
        if getattr(cfg, k) < low:
            die(f"--{k} must be at least {low}, got {getattr(cfg, k)}")
    if cfg.lr <= 0 or cfg.warmup_steps < 0 or not 0 <= cfg.final_lr_frac <= 1 or not 0 < cfg.cooldown_frac <= 1:
        die("need --lr > 0, --warmup_steps >= 0, 0 <= --final_lr_frac <= 1 and 0 < --cooldown_frac <= 1")
    if not 0 <= cfg.ema < 1 or not 0 <= cfg.drop_path < 1 or not 0 <= cfg.label_smoothing < 1:
        die("need 0 <= --ema < 1, 0 <= --drop_path < 1 and 0 <= --label_smoothing < 1")
    if not (cfg.benchmark or cfg.predict) and not (cfg.max_steps or cfg.epochs or cfg.time_budget > 0):
        die("no training budget: set --max_steps, --epochs or --time_budget")

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
