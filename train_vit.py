"""
train_vit.py: a Vision Transformer, trained from scratch on images held on the GPU, in one file.

Patch embedding, sin-cos positions, pre-norm blocks (RMSNorm, QK-norm, GELU or SwiGLU,
LayerScale, stochastic depth, registers); augmentation on the device; Muon or AdamW; an EMA.

  python train_vit.py                  # CPU demo: generates the shapes dataset, ~4 min
  python prepare_data.py cifar10 && python train_vit.py --preset=cifar10
  torchrun --nproc_per_node=8 train_vit.py --preset=cifar10
  python predict_vit.py --ckpt=out/vit --images=IMAGE_OR_DIR   # a checkpoint classifies your images
  python bench.py train_vit.py --preset=cifar10   # its speed, on random images
  python train_vit.py -h               # every flag, with its default
"""
import argparse
import collections
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
from concurrent.futures import ThreadPoolExecutor
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

# Every knob of a run is a field of this one flat dataclass: --key=value sets it, and -h prints each field's
# trailing comment as its help. The defaults are the CPU demo: a 0.8M-parameter ViT on 50,000 generated 32x32
# shapes, 240 s of training on two cores. That data is plentiful and clean for so small a model, so the regularisers
# a ViT needs on a small set of natural images (stochastic depth, mixup, cutmix; DeiT, Touvron et al. 2021) stay off.
# 8x8 patches make 16 tokens an image: attention is cheap, and most of the time goes to the matrix products. A slow
# laptop makes about 950 steps in the 240 s, a fast CPU 1,800: the LR (4e-3) and the short warmup (30 steps) are set
# for the slow one, where they reach 98.6% against 88.6% for 2e-3 and 100 (at 815 steps), and lose nothing on the fast
# one.
@dataclass
class Config:
    # data and output
    data_dir: str = "data/shapes"  # images written by prepare_data.py; the default set is generated on first use
    out_dir: str = "out/vit"  # where checkpoints, config.json, metrics.jsonl and the plots go
    preset: str = ""  # a named set of defaults, cpu_demo, cifar10 or imagenet; flags given explicitly override it
    # model
    image_size: int = 0  # side of the images in pixels; 0 takes the data's, any other value must equal it
    patch_size: int = 8  # side of a square patch in pixels; each patch becomes one token
    n_layer: int = 4  # number of transformer blocks
    n_head: int = 4  # attention heads; n_embd must split into heads of even width
    n_embd: int = 0  # token width; 0 picks 128, or 64 when the train split has under 10,000 images
    mlp: Literal["gelu", "swiglu"] = "gelu"  # the MLP: GELU, or SwiGLU's gated SiLU (Shazeer 2020)
    mlp_ratio: float = 4.0  # the MLP's hidden width over n_embd; SwiGLU uses 2/3 of it, for the same parameters
    norm: Literal["rmsnorm", "layernorm"] = "rmsnorm"  # the norm before each attention, each MLP and the head
    qk_norm: bool = True  # RMSNorm on each head's queries and keys, which bounds the attention logits
    pos_emb: Literal["sincos", "learned"] = "sincos"  # token positions: fixed 2-D sin-cos, or a learned table
    pool: Literal["gap", "cls"] = "gap"  # what the head reads: the mean of the patch tokens, or a class token
    registers: int = 0  # extra learned tokens that attention may use as scratch space (Darcet et al. 2024)
    layer_scale: float = 0.0  # initial per-channel gain of each residual branch (LayerScale, CaiT); 0 = off
    drop_path: float = 0.0  # stochastic depth: the last block's chance to skip an image; earlier blocks less
    init_std: float = 0.02  # std of the hidden weights' truncated normal; output layers and the head start at 0
    # budget: max_steps, else epochs, else time_budget
    max_steps: int = 0  # optimizer steps to train; 0 = train for epochs or time_budget
    epochs: float = 0.0  # passes over the train split, when max_steps is 0; 0 = train for time_budget
    time_budget: float = 240.0  # seconds of training, evals and saves excluded, when max_steps and epochs are 0
    batch_size: int = 128  # images in a micro-batch on each rank
    grad_accum: int = 1  # micro-batches whose gradients add up to one optimizer step
    # optimizer and schedule
    optimizer: Literal["muon", "adamw"] = "muon"  # muon: Muon on the blocks' matrices, AdamW on the rest
    lr: float = 4e-3  # peak learning rate of both optimizers (Muon's update is scaled to AdamW's size)
    weight_decay: float = 0.05  # decoupled weight decay of the 2-D weight matrices; none on the other parameters
    beta1: float = 0.9  # AdamW's decay of the gradient's running mean (its momentum)
    beta2: float = 0.95  # AdamW's decay of the squared gradient's running mean
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = off
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # the LR after warmup (wsd: hold, then decay)
    warmup_steps: int = 30  # steps of linear warmup up to the peak LR
    cooldown_frac: float = 0.2  # wsd: the share of the run spent decaying, at its end
    final_lr_frac: float = 0.0  # the LR at the end of the decay, as a fraction of the peak
    ema: float = 0.999  # decay of a moving average of the weights, evaluated beside them; 0 = off
    # augmentation, on the device
    translate: int = 4  # shift each image by up to this many pixels, borders reflected; 0 = off
    flip: Literal["auto", "true", "false"] = "auto"  # mirror half the images; auto: if the data's flip_ok says so
    mixup: float = 0.0  # alpha of mixup's Beta(alpha, alpha) blend of two images and their labels; 0 = off
    cutmix: float = 0.0  # alpha of cutmix's Beta(alpha, alpha) box pasted from another image; 0 = off
    label_smoothing: float = 0.1  # share of each target spread evenly over all classes (Szegedy et al. 2016)
    # eval, logging, checkpoints
    eval_every: int = 400  # steps between evals; 0 = only at the end
    eval_images: int = 1000  # val images in each periodic eval; the final eval reads them all
    tta_flip: bool = False  # evaluate each image and its mirror image, and average their probabilities
    log_every: int = 25  # steps between log lines
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last: int = 2  # how many of the newest checkpoints to keep
    milestone_every: int = 0  # also keep each checkpoint whose step is a multiple of this; 0 = none
    async_save: bool = False  # write checkpoints in a background thread while training goes on
    resume: bool = False  # continue from the newest checkpoint in out_dir
    wandb: str = ""  # also log to this Weights & Biases project; empty = off
    description: str = ""  # a note for this run's row of the results.tsv experiment log
    # guards: a bad step is skipped; repeated ones roll back
    loss_spike: float = 6.0  # skip a step whose loss is this many running stds over the mean; 0 = off
    gnorm_spike: float = 0.0  # the same test for the gradient norm; 0 = off
    clip_mult: float = 0.0  # clip the gradient norm at this multiple of its running mean; 0 = off
    guard_window: int = 100  # steps in the guards' running mean and std
    rollback_after: int = 5  # roll back to a checkpoint after this many bad steps in the window; 0 = never
    # system
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"  # where to train; auto: cuda, else mps, else cpu
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # auto: a resume's, else bf16 on GPUs
    compile: Literal["auto", "true", "false"] = "auto"  # torch.compile the model; auto: on CUDA under Linux
    parallel: Literal["ddp", "fsdp"] = "ddp"  # under torchrun: replicate the model (ddp) or shard it (fsdp)
    offload: Literal["none", "params"] = "none"  # fsdp: keep the parameter shards in CPU memory
    seed: int = 1337  # seeds the init, the data order and the augmentation
    kernels: Literal["auto", "triton", "torch"] = "auto"  # attention and norm kernels; auto: the faster per op
    loader: Literal["auto", "device", "host"] = "auto"  # images held on the device, or read from disk; auto: by size

PRESETS = {
    "cpu_demo": {},  # the defaults: 0.8M parameters, 240 s
    # one GPU, minutes: the recipe of DeiT (Touvron et al. 2021) and Beyer et al. (2022). Without a convolution's
    # built-in locality a ViT overfits 50,000 natural images, so LayerScale, stochastic depth, mixup, cutmix and a
    # slow EMA regularise it; 2x2 patches give it 256 tokens of each 32x32 image
    "cifar10": dict(
        data_dir="data/cifar10",
        out_dir="out/vit_cifar10",
        patch_size=2,
        n_layer=8,
        n_head=6,
        n_embd=384,  # ViT-S's width, with 6 heads of 64
        optimizer="adamw",
        lr=2e-3,
        warmup_steps=500,
        layer_scale=0.1,
        drop_path=0.1,
        time_budget=0.0,
        epochs=60,
        batch_size=512,
        mixup=0.8,
        cutmix=1.0,
        ema=0.9995,
        eval_every=1000,
        eval_images=10000,  # all of CIFAR-10's val split, at every eval
        tta_flip=True
    ),
    # ImageNet-1k at 224 (prepare_data.py imagefolder, README): ViT-S/16, 22M parameters, with DeiT's recipe
    # (Touvron et al. 2021, 79.8% top-1 in 300 epochs) where ours differs: AdamW at 5e-4 x 1,024/512 with its
    # default beta2, 5 warmup epochs, drop path 0.1, mixup and cutmix, DeiT's EMA, a batch of 1,024 (8 ranks x 128).
    # Left out: RandAugment, random erasing, repeated augmentation and random-resized crops, which this trainer does
    # not have; shifts of up to 16 pixels stand in for the crops, so expect less than DeiT's 79.8%. Not yet
    # measured. The train split (193 GB) stays on disk: --loader=auto reads it from its file a batch ahead.
    "imagenet": dict(
        data_dir="data/imagenet",
        out_dir="out/vit_imagenet",
        patch_size=16,
        n_layer=12,
        n_head=6,
        n_embd=384,
        optimizer="adamw",
        lr=1e-3,
        beta2=0.999,
        warmup_steps=6255,  # 5 epochs of 1,251 steps
        final_lr_frac=0.01,
        drop_path=0.1,
        time_budget=0.0,
        epochs=300,
        batch_size=128,  # a rank's: one GPU takes --grad_accum=8 for the same step
        translate=16,
        mixup=0.8,
        cutmix=1.0,
        ema=0.99996,
        eval_every=5000,
        eval_images=10000
    ),
}
# The fields that shape the weights: a resumed run must match its checkpoint's (run_layout, in the images fence).
ARCH_FIELDS = (
    "patch_size",
    "n_layer",
    "n_head",
    "n_embd",
    "mlp",
    "mlp_ratio",
    "norm",
    "qk_norm",
    "pos_emb",
    "pool",
    "registers",
    "layer_scale"
)
# A trainer trains (STYLE.md: one job per file). Classifying images with a finished checkpoint
# is predict_vit.py's job; its old flags here stop in one line that names the new command.
MOVED = {"predict": "python predict_vit.py --ckpt=out/vit --images=PATH",
         "ckpt": "python predict_vit.py --ckpt=PATH --images=PATH",
         "top_k": "python predict_vit.py --ckpt=out/vit --images=PATH --show=K",
         "benchmark": "python bench.py train_vit.py --preset=cifar10 (any flag of this script's)",
         "bench_steps": "python bench.py train_vit.py --steps=N",
         "profile": "python bench.py train_vit.py --profile"}

# -----------------------------------------------------------------------------
# Model

class Norm(nn.Module):
    """RMSNorm, or LayerNorm without bias, over the last dim."""

    def __init__(self, dim, kind="rmsnorm"):
        super().__init__()
        self.kind = kind
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        # RMSNorm (Zhang & Sennrich 2019) only rescales: no mean to subtract, one reduction fewer than LayerNorm's.
        # Both divide by a root mean square floored at sqrt(1e-6), so a zero vector stays finite.
        if self.kind == "rmsnorm":
            return kernels.rms_norm(x, self.weight, 1e-6)
        return F.layer_norm(x, self.weight.shape, self.weight, None, 1e-6)

class Attention(nn.Module):
    """Multi-head self-attention of every token to every token."""

    def __init__(self, cfg):
        super().__init__()
        d = cfg.n_embd
        self.hd = d // cfg.n_head  # each head's width
        self.qkv = nn.Linear(d, 3 * d, bias=False)  # queries, keys and values in one matmul
        self.proj = nn.Linear(d, d, bias=False)
        # QK-norm (Dehghani et al. 2023, ViT-22B): normalised queries and keys keep the attention logits bounded,
        # so the softmax does not collapse onto one token as a high LR grows the weights
        self.q_norm = nn.Identity()
        self.k_norm = nn.Identity()
        if cfg.qk_norm:
            self.q_norm = Norm(self.hd)
            self.k_norm = Norm(self.hd)

    def forward(self, x):
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, -1, self.hd)  # (B, T, 3, nh, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, nh, T, hd)
        q = self.q_norm(q)
        k = self.k_norm(k)
        # not causal: an image has no order, every patch attends to every other
        y = kernels.attention(q, k, v, causal=False)  # (B, nh, T, hd)
        y = y.transpose(1, 2).reshape(B, T, C)  # (B, T, C): the heads side by side again
        return self.proj(y)

class MLP(nn.Module):
    """The per-token feed-forward layer: widen, a nonlinearity, project back."""

    def __init__(self, cfg):
        super().__init__()
        self.swiglu = cfg.mlp == "swiglu"
        hidden = int(cfg.mlp_ratio * cfg.n_embd)
        fc_width = hidden
        if self.swiglu:
            # SwiGLU (Shazeer 2020) has two input matrices, a gate and a value, held side by side in fc: 2/3 of
            # the width keeps the parameter count of the plain MLP
            hidden = 2 * hidden // 3
            fc_width = 2 * hidden
        self.fc = nn.Linear(cfg.n_embd, fc_width, bias=False)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        if self.swiglu:
            a, b = self.fc(x).chunk(2, dim=-1)  # gate and value, each (B, T, hidden)
            return self.proj(F.silu(a) * b)
        return self.proj(F.gelu(self.fc(x), approximate="tanh"))

def stochastic_depth(x, p, training):
    """Stochastic depth (Huang et al. 2016), per sample."""
    # Each image of the batch skips this residual branch with chance p: a regulariser that trains an ensemble of
    # shallower networks. Dividing by 1 - p keeps the branch's expected output, so eval uses the branch as it is.
    if not training or p == 0:
        return x
    keep = torch.rand(x.size(0), 1, 1, device=x.device) >= p  # (B, 1, 1): True keeps the branch
    return x * keep.to(x.dtype) / (1 - p)

class Block(nn.Module):
    """A pre-norm transformer block: x + attn(norm(x)), then x + mlp(norm(x))."""

    def __init__(self, cfg, drop):
        super().__init__()
        self.norm1 = Norm(cfg.n_embd, cfg.norm)
        self.attn = Attention(cfg)
        self.norm2 = Norm(cfg.n_embd, cfg.norm)
        self.mlp = MLP(cfg)
        self.drop = drop
        # LayerScale (Touvron et al. 2021, CaiT): a learned per-channel gain on each branch, starting small
        # (--layer_scale=0.1), so that a deep stack starts near the identity and each branch grows in as it learns
        self.ls1 = None
        self.ls2 = None
        if cfg.layer_scale:
            self.ls1 = nn.Parameter(torch.ones(cfg.n_embd))
            self.ls2 = nn.Parameter(torch.ones(cfg.n_embd))

    def forward(self, x):
        a = self.attn(self.norm1(x))  # (B, T, d)
        if self.ls1 is not None:
            a = a * self.ls1
        x = x + stochastic_depth(a, self.drop, self.training)
        m = self.mlp(self.norm2(x))  # (B, T, d)
        if self.ls2 is not None:
            m = m * self.ls2
        return x + stochastic_depth(m, self.drop, self.training)

# === shared: sincos ===
def sincos_2d(h, w, dim):
    """Fixed 2-D sin-cos positions (h * w, dim), fp32 (MAE; Beyer et al. 2022; DiT)."""
    # half the channels encode the row, half the column, each as sin and cos at dim/4 frequencies
    quarter = dim // 4
    omega = 1.0 / 10000 ** (torch.arange(quarter, dtype=torch.float32) / quarter)  # (dim/4,)
    rows, cols = torch.meshgrid(torch.arange(h).float(), torch.arange(w).float(), indexing="ij")  # (h, w) each
    parts = []
    for pos in (rows, cols):
        angle = pos.flatten()[:, None] * omega  # (h * w, dim/4)
        parts += [torch.sin(angle), torch.cos(angle)]
    return torch.cat(parts, dim=1)
# === end shared ===

class ViT(nn.Module):
    """Patches, positions, blocks, a final norm, then a linear head on the pooled tokens (Dosovitskiy et al. 2021)."""

    def __init__(self, cfg, image_size, channels, num_classes):
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        d = cfg.n_embd
        self.grid = image_size // p
        # The patch embedding is a p x p convolution of stride p (Dosovitskiy et al. 2021). Patches do not overlap,
        # so it is one matmul of each flattened patch; forward cuts the patches with a reshape.
        self.patch = nn.Linear(p * p * channels, d)
        # Attention sees a set, so each patch's token gets its position added. Fixed 2-D sin-cos positions (MAE)
        # are no worse than learned ones (Beyer et al. 2022) and cost no parameters.
        pos = torch.zeros(self.grid ** 2, d)  # (N, d): init_weights fills it
        if cfg.pos_emb == "learned":
            self.pos = nn.Parameter(pos)
        else:
            self.register_buffer("pos", pos, persistent=False)  # computed, so not saved
        # Learned tokens with no position, placed before the patches: a class token whose output the head reads
        # (--pool=cls, BERT's and the first ViT's way), and registers (Darcet et al. 2024). Without registers, large
        # ViTs repurpose background patches as scratch space, which shows as artefacts in their attention maps.
        self.n_extra = int(cfg.pool == "cls") + cfg.registers
        self.extra = None
        if self.n_extra:
            self.extra = nn.Parameter(torch.zeros(self.n_extra, d))
        # the drop rate grows linearly with depth, 0 at the first block (Huang et al. 2016)
        rates = [cfg.drop_path * i / max(cfg.n_layer - 1, 1) for i in range(cfg.n_layer)]
        self.blocks = nn.ModuleList(Block(cfg, r) for r in rates)
        self.norm = Norm(d, cfg.norm)
        self.head = nn.Linear(d, num_classes)
        # The data's channel statistics, kept in the model (and its checkpoint): it takes pixels in [0, 1] and
        # standardises them itself, so predict_vit.py and the diffusion's judge feed it images as they are
        self.register_buffer("mean", torch.zeros(channels))
        self.register_buffer("std", torch.ones(channels))

    @torch.no_grad()
    def init_weights(self, mean, std):
        """Initialise it in place (it was built on the meta device)."""
        c = self.cfg
        s = c.init_std
        for name, p in self.named_parameters():
            if name.endswith(("proj.weight", ".bias")) or name.startswith("head."):
                # Each residual branch ends in a proj that starts at zero, so every block starts as the identity
                # and the signal passes straight through; the zero head starts every class at the same logit,
                # the loss at ln(classes). The biases (patch embedding, head) start at zero too.
                nn.init.zeros_(p)
            elif name.endswith((".ls1", ".ls2")):
                nn.init.constant_(p, c.layer_scale)
            elif p.ndim == 1:  # the norms' gains
                nn.init.ones_(p)
            else:
                # the other matrices, learned positions and extra tokens: BERT's and ViT's truncated normal
                nn.init.trunc_normal_(p, std=s, a=-2 * s, b=2 * s)
        if c.pos_emb == "sincos":
            self.pos.copy_(sincos_2d(self.grid, self.grid, c.n_embd))
        self.mean.copy_(torch.tensor(mean))
        self.std.copy_(torch.tensor(std))

    def forward(self, x, features=False):
        """x (B, H, W, C) in [0, 1] -> logits (B, K), or features (B, d)."""
        B, H, W, C = x.shape
        p = self.cfg.patch_size
        g = self.grid
        x = (x - self.mean) / self.std
        # cut a g x g grid of p x p patches, each flattened to p * p * C numbers
        x = x.view(B, g, p, g, p, C)  # (B, grid row, row in patch, grid column, column in patch, C)
        x = x.permute(0, 1, 3, 2, 4, 5)  # (B, g, g, p, p, C)
        x = x.reshape(B, g * g, -1)  # (B, N, p*p*C)
        x = self.patch(x)  # (B, N, d)
        x = x + self.pos.to(x.dtype)  # each patch's token, told where in the image it is
        if self.n_extra:
            extra = self.extra.to(x.dtype).expand(B, -1, -1)  # (B, n_extra, d)
            x = torch.cat((extra, x), dim=1)  # (B, n_extra + N, d)
        for block in self.blocks:
            x = block(x)
        x = self.norm(x)
        # the head reads the class token, or the mean of the patch tokens (global average pooling, Beyer et al.
        # 2022: as good as a class token, one token fewer); registers are read by neither
        if self.cfg.pool == "cls":
            f = x[:, 0]
        else:
            f = x[:, self.n_extra:].mean(1)  # (B, d)
        if features:
            return f
        return self.head(f)  # (B, K)

    def flops_per_image(self):
        """Training FLOPs per image: 6 per matmul weight per token, plus attention (PaLM)."""
        # A weight costs 2 FLOPs per token forward and 4 backward (the grads of its input and of itself). The patch
        # embedding makes no grad for the pixels: 4 a weight. Attention's scores and mixing add 12 L d T per token.
        # FlopCounterMode counts 1.7% more at cifar10 (tests/test_compile.py): the scores that a flash backward
        # recomputes, which MFU leaves out.
        T = self.grid ** 2 + self.n_extra  # tokens per image
        n = sum(p.numel() for p in self.blocks.parameters() if p.ndim == 2)  # the blocks' matmul weights
        matmuls = 6 * n * T
        attention = 12 * self.cfg.n_layer * self.cfg.n_embd * T * T
        patch = 4 * self.grid ** 2 * self.patch.weight.numel()
        head = 6 * self.head.weight.numel()  # once per image: the head reads one pooled token
        return matmuls + attention + patch + head

def build_model(cfg, meta, device):
    """Build on the meta device, then initialise under cfg.seed."""
    # On the meta device the modules get shapes but no memory, so nothing is initialised twice; every rank then
    # draws the same weights from cfg.seed, and DDP and FSDP2 start from one model
    with torch.device("meta"):
        model = ViT(cfg, meta["image_size"][0], meta["channels"], meta["num_classes"])
    model.to_empty(device=device)
    torch.manual_seed(cfg.seed)
    model.init_weights(meta["mean"], meta["std"])
    return model

# -----------------------------------------------------------------------------
# Data
# Both splits live on the device as uint8 when they fit (the loader in the images fence below), and augmentation
# runs there on whole batches: no worker processes, no host-to-device copies in the loop. A larger split is read
# from its file a batch ahead, and augmented on the device all the same. Shift and flip are the classic
# CIFAR pair (He et al. 2016); DeiT adds RandAugment (Cubuk et al. 2020), left out here: mixup and cutmix carry
# the heavy regularisation when a preset needs it. The loss (in the loop) smooths its labels (Szegedy et al. 2016):
# the target puts 1 - label_smoothing on the true class and spreads the rest over all classes, so the logits
# need not grow without bound to fit the training images.

# === shared: images ===
def load_image_data(data_dir, splits=("train", "val")):
    """meta.json and {split: (uint8 images (N, H, W, C), int64 labels (N,))} of an image dir."""
    path = os.path.join(data_dir, "meta.json")
    fix = "re-run prepare_data.py for this data dir"
    if not os.path.exists(path):
        die(f"no prepared images in {data_dir!r} (no meta.json); make them with 'python "
            f"prepare_data.py shapes --data_dir={data_dir}' (or cifar10, mnist, imagefolder PATH ...)")
    with exit_if_unreadable(path, fix), open(path) as f:
        meta = json.load(f)
        if "vocab_size" in meta:  # prepare_data.py's text: token shards
            die(f"{data_dir} holds token shards (text), which train_gpt.py reads; give --data_dir an image data "
                f"dir, e.g. python prepare_data.py shapes --data_dir=data/shapes")
        if meta["format"] != "trainsuite-image-1":
            raise ValueError(f"format {meta['format']!r} is not an image dataset")
        H, W = meta["image_size"]
        C = meta["channels"]
        K = meta["num_classes"]
        fits = all(isinstance(v, int) and v > 0 for v in (H, W, C, K)) and len(meta["classes"]) == K
        for k in ("mean", "std"):  # a number a channel
            fits = fits and len(meta[k]) == C and all(isinstance(v, (int, float)) for v in meta[k])
        if not fits:
            raise ValueError("image_size, channels, num_classes, classes, mean and std do not fit")
        if not isinstance(meta.get("flip_ok", False), bool):
            raise ValueError("flip_ok must be true or false")
    arrays = {}
    for s in splits:
        images = os.path.join(data_dir, f"{s}_images.npy")
        labels = os.path.join(data_dir, f"{s}_labels.npy")
        # a memory map reads no pixels yet, but checks that the file holds all the rows its header promises
        with exit_if_unreadable(images, fix):
            images = np.load(images, mmap_mode="r")
        with exit_if_unreadable(labels, fix):
            labels = np.load(labels)
        arrays[s] = (images, labels)
    for s, (x, y) in arrays.items():
        if x.dtype != np.uint8 or x.ndim != 4 or list(x.shape[1:]) != [H, W, C]:
            die(f"{data_dir}/{s}_images.npy is {x.dtype} {x.shape}, not uint8 (N, {H}, {W}, {C}) "
                f"as meta.json says; {fix}")
        if len(x) != len(y) or (len(y) and not 0 <= y.min() <= y.max() < K):
            die(f"{data_dir}: {s} has {len(x)} images and {len(y)} labels (or labels outside "
                f"0..{K - 1}); {fix}")
    return meta, arrays

def host_memory():
    """The host's memory in bytes."""
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")

def data_on_device(cfg, arrays, device):
    """Whether the images are copied to the device whole (--loader=device), or stay in their files on the host and
    are read a batch at a time (host). auto: the device, if both splits take under a quarter of its memory."""
    if cfg.loader != "auto":
        return cfg.loader == "device"
    need = sum(x.nbytes for x, _ in arrays.values())
    if device.type == "cuda":
        free = torch.cuda.mem_get_info(device)[0]
    else:  # the CPU, or MPS, which shares the host's memory: every rank on this host holds a copy
        free = host_memory() / int(os.environ.get("LOCAL_WORLD_SIZE", 1))
    return need < free / 4

class HostImages:
    """A split's images left in their .npy file on the host: rows read on request, with plain file reads into fresh
    host memory (pinned when they go to a GPU, so that the copy runs beside the compute). No copy of the whole
    split is made anywhere. Why not index np.load's memory map: its disk reads happen as page faults inside
    numpy's copy, which holds Python's lock (the GIL) meanwhile and stalls the training thread; a file read lets
    it go. And every page the map touched would count in this process's memory, where a read's stay the kernel's
    page cache."""

    def __init__(self, array, device):
        self.path = array.filename  # array: np.load's memory map, which has checked the file's size
        self.offset = array.offset  # where the rows start, past the .npy header
        self.shape = array.shape
        self.row = math.prod(self.shape[1:])  # bytes a uint8 image
        self.pin = device.type == "cuda"
        self.file = open(self.path, "rb", buffering=0)  # reads straight into the batch, no buffer between

    def __len__(self):
        return self.shape[0]

    def __getitem__(self, rows):
        """uint8 images (n, H, W, C) on the host: rows is a slice, or a tensor of indices."""
        if isinstance(rows, slice):
            rows = torch.arange(*rows.indices(len(self)))
        out = torch.empty((len(rows), *self.shape[1:]), dtype=torch.uint8, pin_memory=self.pin)
        flat = out.numpy().reshape(len(rows), self.row)
        for k in rows.argsort().tolist():  # in the file's order: the disk reads forward
            self.file.seek(self.offset + int(rows[k]) * self.row)
            if self.file.readinto(flat[k]) != self.row:
                # the file shrank under the run (rewritten, or a disk that failed): one line, in the reading
                # thread too, whose error the next batch raises in the loop
                die(f"{self.path} ends before image {int(rows[k])}: it changed while this run read it; re-run "
                    f"prepare_data.py, and keep the data dir as it is while a run reads it")
        return out

def hold(images, device, on_device):
    """A split's uint8 images (N, H, W, C): copied whole to the device, or left in their file (HostImages)."""
    if on_device:
        return torch.from_numpy(np.array(images)).to(device)  # uint8: 4x smaller than fp32
    return HostImages(images, device)

class ImageLoader:
    """(B, H, W, C) uint8 batches of the train split, in an order per epoch seeded by (seed, epoch); rank r takes
    the r-th B of each global batch. Two paths, one order. A split that fits is copied to the device once and
    indexed there. A larger one stays in its file (HostImages): a thread reads the next batches, two waiting while
    the device computes, and each goes to the device with a non-blocking copy."""

    def __init__(self, images, labels, B, rank, world_size, device, seed=0, on_device=True):
        self.x = hold(images, device, on_device)
        self.y = torch.from_numpy(np.asarray(labels, dtype=np.int64))
        if on_device:
            self.y = self.y.to(device)
            self.where = f"held on {device.type}"
        else:
            self.where = "read from their file a batch ahead (host)"
            self.reader = ThreadPoolExecutor(1)  # one thread: its reads of the file come one after another
        self.on_device = on_device
        self.device = device
        self.B = B
        self.rank = rank
        self.world_size = world_size
        self.seed = seed
        if len(self.y) < B * world_size:
            die(f"the train split has {len(self.y)} images, fewer than one batch of --batch_size x "
                f"ranks = {B * world_size}; lower --batch_size")
        self.load_state({"epoch": 0, "pos": 0})

    def state(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state(self, s):
        self.epoch = int(s["epoch"])
        self.pos = int(s["pos"])  # where the next global batch starts in the epoch's order
        self.order_epoch = None  # the epoch whose permutation self.order holds: none yet
        self.ahead = collections.deque()  # the host path's reads: (batch to come, epoch and pos after it)
        self.planned = (self.epoch, self.pos)  # where the next read starts

    def plan(self, epoch, pos):
        """(this rank's indices of the global batch at pos in the epoch's order, and the epoch and pos after it)."""
        n = len(self.y)
        step = self.B * self.world_size  # a global batch
        if pos + step > n:  # drop the epoch's partial last batch
            epoch += 1
            pos = 0
        if self.order_epoch != epoch:  # the epoch's permutation, drawn at its first batch
            g = torch.Generator().manual_seed(self.seed * 1000003 + epoch)
            self.order = torch.randperm(n, generator=g).to(self.y.device)
            self.order_epoch = epoch
        start = pos + self.rank * self.B  # this rank's B of the global batch
        return self.order[start:start + self.B], epoch, pos + step

    def next(self):
        """This rank's next (images (B, H, W, C) uint8, labels (B,) int64), on the device."""
        if self.on_device:
            idx, self.epoch, self.pos = self.plan(self.epoch, self.pos)
            return self.x[idx], self.y[idx]
        while len(self.ahead) < 3:  # this batch, and two more read while the device computes
            idx, epoch, pos = self.plan(*self.planned)
            self.planned = (epoch, pos)
            self.ahead.append((self.reader.submit(self.read, idx), epoch, pos))
        batch, self.epoch, self.pos = self.ahead.popleft()
        x, y = batch.result()
        return x.to(self.device, non_blocking=True), y.to(self.device, non_blocking=True)

    def read(self, idx):
        """The images and labels at idx, in host memory (the reading thread's job)."""
        y = self.y[idx]
        if self.x.pin:
            y = y.pin_memory()
        return self.x[idx], y

def image_data(cfg, rank, world_size, device):
    """meta, the train split's loader, and the val images and labels (images on the device, or read from their file)."""
    meta, arrays = load_image_data(cfg.data_dir)
    H, W = meta["image_size"]
    p = cfg.patch_size
    if cfg.image_size and cfg.image_size != H:
        die(f"--image_size={cfg.image_size} but the images in {cfg.data_dir} are {H}x{W}; prepare them "
            f"at that size (prepare_data.py ... --image_size={cfg.image_size}) or use --image_size=0")
    if H != W or H % p:
        die(f"images of {H}x{W} do not split into {p}x{p} patches; change --patch_size")
    on_device = data_on_device(cfg, arrays, device)
    loader = ImageLoader(*arrays["train"], cfg.batch_size, rank, world_size, device, cfg.seed, on_device)
    images, labels = arrays["val"]
    val_y = torch.from_numpy(np.asarray(labels, dtype=np.int64)).to(device)  # labels are small: always there
    val_x = hold(images, device, on_device)
    return meta, loader, val_x, val_y

def flips(cfg, meta):
    """(whether training flips images, why): --flip, else meta.json's flip_ok."""
    if cfg.flip != "auto":
        return cfg.flip == "true", "--flip"
    if "flip_ok" not in meta:  # older data flips, as it did (a mirrored digit is not a digit)
        return True, "meta.json predates flip_ok: re-run prepare_data.py, or --flip=false for digits"
    return meta["flip_ok"], "the data's flip_ok"

def run_layout(c, world_size, data_info):
    """What a resumed run must share with the run of its checkpoint's config dict c."""
    return {
        **{k: c[k] for k in ARCH_FIELDS},
        "ema": c["ema"] > 0,
        "batch_size": c["batch_size"],
        "grad_accum": c["grad_accum"],
        "world_size": world_size,
        "dtype": c["dtype"],
        **data_info
    }
# === end shared ===

def augment(x, cfg, flip):
    """Shift x (B, H, W, C) by up to cfg.translate pixels; flip it if flip."""
    B, H, W, _ = x.shape
    dev = x.device
    t = cfg.translate
    if t:
        # a random H x W crop of the image padded by t reflected pixels: a shift that invents no black border
        chw = x.permute(0, 3, 1, 2)  # (B, C, H, W): F.pad pads the last two dims
        xp = F.pad(chw, (t, t, t, t), mode="reflect")  # (B, C, H+2t, W+2t)
        xp = xp.permute(0, 2, 3, 1)  # (B, H+2t, W+2t, C)
        dy, dx = torch.randint(0, 2 * t + 1, (2, B, 1), device=dev)  # each image's offset, (B, 1)
        rows = dy + torch.arange(H, device=dev)  # (B, H)
        cols = dx + torch.arange(W, device=dev)  # (B, W)
        batch = torch.arange(B, device=dev)[:, None, None]  # (B, 1, 1)
        x = xp[batch, rows[:, :, None], cols[:, None, :]]  # (B, H, W, C): image b's rows and columns
    if flip:
        # a mirror image is the same class only for some data (not for letters): the caller decides, from
        # --flip or the data's flip_ok
        mirror = torch.rand(B, 1, 1, 1, device=dev) < 0.5  # (B, 1, 1, 1)
        x = torch.where(mirror, x.flip(2), x)
    return x

def check_shift(cfg, side):
    """Stop in one line if --translate is not under the images' side: a shift pads with reflected pixels, and a
    reflection is no longer than the image."""
    if cfg.translate >= side:
        die(f"--translate={cfg.translate} must be under the images' side, {side}; lower it")

def mix(x, y, cfg):
    """Mixup or cutmix (one at random if both, as timm) with the reversed batch: (x, y, y reversed, y's weight)."""
    # Mixup (Zhang et al. 2018) blends two images, cutmix (Yun et al. 2019) pastes a box of one into the other; the
    # target mixes the same way, lam of one label and 1 - lam of the other. Cross-entropy is linear in its target,
    # so the loop adds the two labels' losses by their weights. Each image's partner is the one at the mirrored
    # place in the batch (the batch reversed), whose order is already random: no second batch is read.
    use_cutmix = cfg.cutmix > 0
    if use_cutmix and cfg.mixup > 0:
        use_cutmix = torch.rand(()).item() < 0.5
    alpha = cfg.cutmix if use_cutmix else cfg.mixup
    if alpha == 0:
        return x, y, y, 1.0
    lam = torch.distributions.Beta(alpha, alpha).sample().item()
    if not use_cutmix:
        x = lam * x + (1 - lam) * x.flip(0)
        return x, y, y.flip(0), lam
    # paste a box of area 1 - lam from the partner, centred anywhere
    B, H, W, _ = x.shape
    h = int(H * math.sqrt(1 - lam))
    w = int(W * math.sqrt(1 - lam))
    cy = int(torch.randint(H, ()))
    cx = int(torch.randint(W, ()))
    y0 = max(cy - h // 2, 0)
    y1 = min(cy + h // 2, H)
    x0 = max(cx - w // 2, 0)
    x1 = min(cx + w // 2, W)
    x = x.clone()
    x[:, y0:y1, x0:x1] = x.flip(0)[:, y0:y1, x0:x1]
    # the image's edge may clip the box: the weight is the share of the image really kept
    kept = 1 - (y1 - y0) * (x1 - x0) / (H * W)
    return x, y, y.flip(0), kept

# -----------------------------------------------------------------------------
# Optimizer and schedule

# === shared: muon ===
def unless(skip, old, new):
    """new, or old where skip is true (a NaN in new stays out)."""
    return new if skip is None else torch.where(skip, old, new)

def orthogonalise(x):
    """Roughly U V^T for each x = U S V^T (..., rows, cols), by 5 Newton-Schulz steps."""
    # Each step maps every singular value s to a s + b s^3 + c s^5 and leaves U and V alone. The
    # coefficients (Jordan et al. 2024) are tuned to push any s in (0, 1] to about 1 in five
    # steps, fast rather than exactly: Muon needs U V^T only roughly
    a, b, c = 3.4445, -4.7750, 2.0315
    tall = x.size(-2) > x.size(-1)
    if tall:  # work on the wide side, so that the Gram matrix x x^T is the smaller square
        x = x.mT
    norm = x.norm(dim=(-2, -1), keepdim=True)  # the Frobenius norm bounds the spectral norm: then s <= 1
    x = x / norm.clamp(min=1e-7)
    for _ in range(5):
        gram = x @ x.mT  # (..., rows, rows)
        poly = torch.baddbmm(gram, gram, gram, beta=b, alpha=c)  # b gram + c gram^2
        x = torch.baddbmm(x, poly, x, beta=a)  # a x + (b gram + c gram^2) x
    if tall:
        x = x.mT
    return x

class Muon(torch.optim.Optimizer):
    """Muon (Jordan et al. 2024) for 2-D hidden matrices: Nesterov momentum, orthogonalised,
    scaled to AdamW's update RMS, 0.2 sqrt(max(rows, cols)), so one LR serves both (Moonlight).
    torch.optim.Muon with adjust_lr_fn="match_rms_adamw", but batched per shape, and in bf16
    only if the run is (a CPU emulates bf16 ~100x slower)."""

    def __init__(self, params, lr, weight_decay=0.0, momentum=0.95, ns_dtype=torch.bfloat16):
        super().__init__(params, dict(lr=lr, weight_decay=weight_decay, momentum=momentum))
        self.ns_dtype = ns_dtype

    @torch.no_grad()
    def step(self, closure=None, skip=None):
        """One update of every matrix; where skip (the guard's verdict, a tensor on the device) is true, none."""
        for group in self.param_groups:
            lr = group["lr"]
            mom = group["momentum"]
            # The matrices of one shape are stacked and orthogonalised in one batched call: a
            # model has a few shapes (qkv, proj, fc) repeated in every block, so a step makes a
            # few large matmuls instead of many small ones
            shapes = {}
            for p in group["params"]:
                if p.grad is not None:
                    shapes.setdefault(p.shape, []).append(p)
            for ps in shapes.values():
                bufs = [self.state[p].setdefault("momentum_buffer", torch.zeros_like(p)) for p in ps]
                g = torch.stack([p.grad for p in ps])  # (n, rows, cols)
                b = torch.stack(bufs)
                w = torch.stack(ps)
                new_b = unless(skip, b, b.lerp(g, 1 - mom))  # momentum: b = mom b + (1 - mom) g
                # Nesterov: the update looks ahead along the momentum, then is orthogonalised
                x = orthogonalise(g.lerp(new_b, mom).to(self.ns_dtype)).to(w.dtype)
                # decoupled weight decay, then the step: an orthogonal x has an RMS of about
                # 1/sqrt(max(rows, cols)), so this scale gives it AdamW's RMS of about 0.2
                scale = 0.2 * math.sqrt(max(w.shape[1:]))
                decayed = w * (1 - lr * group["weight_decay"])
                new_w = torch.add(decayed, x, alpha=-lr * scale)
                new_w = unless(skip, w, new_w)
                # one copy a tensor, back into the parameters and buffers (DTensor has no _foreach_copy_)
                news = [*new_b.unbind(0), *new_w.unbind(0)]
                for t, new in zip(bufs + ps, news):
                    t.copy_(new)
# === end shared ===

# === shared: adamw ===
class AdamW(torch.optim.AdamW):
    """torch's fused AdamW (one kernel for every parameter), whose step takes the guard's verdict: where skip is
    true, the kernel leaves the weights, their moments and the step count as they were, on the device, with no
    sync. It is the contract of torch.amp.GradScaler with fused optimizers, which skip fp16's overflows so: the
    kernel reads the verdict from the optimizer's found_inf, which this step sets (and GradScaler.step, if skip is
    None)."""

    def __init__(self, params, **kw):
        super().__init__(params, fused=True, **kw)  # only the fused kernel reads found_inf

    def step(self, closure=None, skip=None):
        if skip is not None:
            self.found_inf = skip.float()
        return super().step(closure)
# === end shared ===

# === shared: ema ===
class EMA:
    """An fp32 moving average of the weights, beside them (sharded like them under FSDP).
    swap() trades it with the live weights, so one model evaluates with either."""

    def __init__(self, params, decay, model=None):
        self.params = list(params)
        self.decay = decay
        self.t = 0  # updates so far
        self.model = model
        self.shadow = [p.detach().clone() for p in self.params]

    @torch.no_grad()
    def update(self):
        self.t += 1
        d = min(self.decay, (1 + self.t) / (10 + self.t))  # early weights are forgotten fast
        live = [p.detach() for p in self.params]
        torch._foreach_lerp_(self.shadow, live, 1 - d)

    @torch.no_grad()
    def swap(self):
        for p, s in zip(self.params, self.shadow):
            tmp = p.detach().clone()
            p.copy_(s)
            s.copy_(tmp)
        if hasattr(self.model, "reshard"):  # FSDP2 keeps a no-grad forward's gathered weights
            self.model.reshard()
# === end shared ===

def build_optimizers(cfg, raw, dtype=torch.float32):
    """AdamW, and with --optimizer=muon Muon on the blocks' matrices; no decay on vectors."""
    # Muon orthogonalises an update, which suits a matrix that maps hidden features to hidden features: the blocks'.
    # The patch embedding reads pixels and the head writes logits; Muon's authors leave such input and output layers
    # to AdamW, as they do vectors, which have no matrix to orthogonalise. Weight decay pulls weights toward zero:
    # right for the matrices, wrong for norm gains (1 at init), biases, positions and the extra tokens.
    hidden = []  # the blocks' matrices: Muon's, or AdamW's with decay
    decay = []  # the patch embedding's and the head's matrices: AdamW's, with decay
    rest = []  # norm gains, biases, positions, the class token and registers: AdamW's, no decay
    for name, p in raw.named_parameters():
        top = name.split(".")[0]  # blocks, patch, head, pos, extra or norm
        if p.ndim == 2 and top == "blocks":
            hidden.append(p)
        elif p.ndim == 2 and top in ("patch", "head"):
            decay.append(p)
        else:
            rest.append(p)
    wd = cfg.weight_decay
    opts = []
    if cfg.optimizer == "muon":
        # Newton-Schulz runs in bf16 only if the run does: a CPU without bf16 matmuls emulates them ~100x slower
        ns_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        opts.append(Muon(hidden, lr=cfg.lr, weight_decay=wd, ns_dtype=ns_dtype))
    else:
        decay = hidden + decay
    groups = [
        dict(params=decay, weight_decay=wd),
        dict(params=rest, weight_decay=0.0)
    ]
    opts.append(AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2)))
    return opts

def lr_mult(cfg, step, progress):
    """Linear warmup, then cosine, WSD or no decay over progress in [0, 1]."""
    # Warmup: Adam's first updates divide by second moments estimated from a handful of gradients, and are too
    # large at the peak LR (Liu et al. 2020). progress is steps / max_steps, or training seconds / time_budget, so
    # a run on a time budget decays to its end whatever its speed.
    # Linear, from peak / warmup_steps at the first step to the peak at step warmup_steps - 1.
    warm = 1.0
    if cfg.warmup_steps:
        warm = min(1.0, (step + 1) / cfg.warmup_steps)
    p = min(max(progress, 0.0), 1.0)
    f = cfg.final_lr_frac  # the floor that every decay ends on
    if cfg.schedule == "cosine":
        # cosine decay (Loshchilov & Hutter 2017) from the peak down to final_lr_frac of it
        return warm * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * p)))
    if cfg.schedule == "wsd" and p >= 1 - cfg.cooldown_frac:
        # warmup-stable-decay (Hu et al. 2024, MiniCPM): the peak until the last cooldown_frac, then a linear
        # decay. A checkpoint of the stable phase can train on, or be cooled down for an early result.
        return warm * (f + (1 - f) * (1 - p) / cfg.cooldown_frac)
    return warm

# -----------------------------------------------------------------------------
# System: processes and devices, precision, compile, DDP/FSDP2 wrapping, the grad-sync
# context; the same bytes in every train_*.py

# === shared: system ===
def setup_dist(device_arg="auto"):
    """(rank, world_size, device). Plain `python` is rank 0 of 1; under torchrun, which sets RANK,
    WORLD_SIZE and LOCAL_RANK, each process joins the group: NCCL on GPUs, gloo on CPUs (so every
    distributed path runs in CPU tests)."""
    if device_arg == "auto" and torch.cuda.is_available():
        device_arg = "cuda"
    elif device_arg == "auto" and torch.backends.mps.is_available():
        device_arg = "mps"
    elif device_arg == "auto":
        device_arg = "cpu"
    if device_arg == "cuda" and not torch.cuda.is_available():
        die("--device=cuda but no CUDA GPU is visible; use --device=cpu")
    if device_arg == "mps" and not torch.backends.mps.is_available():
        die("--device=mps but MPS is not available (it needs Apple silicon and macOS); use --device=cpu")
    # expandable segments let the CUDA allocator grow a block instead of leaving holes: less
    # fragmentation when shapes vary (evals, --seq_len_warmup). A user's own setting wins
    if not os.environ.get("PYTORCH_CUDA_ALLOC_CONF"):
        os.environ.setdefault("PYTORCH_ALLOC_CONF", "expandable_segments:True")
    if "RANK" not in os.environ:
        return 0, 1, torch.device(device_arg)
    rank = int(os.environ["RANK"])
    world_size = int(os.environ["WORLD_SIZE"])
    device = torch.device(device_arg)
    if device_arg == "cuda":  # one GPU a process: the local rank's
        device = torch.device(f"cuda:{os.environ['LOCAL_RANK']}")
        torch.cuda.set_device(device)
    if not dist.is_initialized():
        store, _, _ = next(dist.rendezvous("env://"))
        if os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True":
            # torchrun's agent keeps one store for all its restarts, with the addresses of the
            # attempt before: a key prefix per restart, or the ranks of a new attempt meet stale
            # ones (pytorch#135712). Each agent counts its own restarts, so on two nodes the
            # counts can differ: the README's two-node command gives each attempt a store of its
            # own instead (TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1), and nothing is prefixed
            attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
            store = dist.PrefixStore(f"attempt_{attempt}/", store)
        backend = "nccl" if device.type == "cuda" else "gloo"
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size)
    return rank, world_size, device

def leave_dist():
    """The last call of a run, once train() has returned and its DDP wrapper, which holds the process group, is
    freed with its locals: destroyed under a live DDP, the group's gloo teardown can abort the exiting process."""
    if dist.is_initialized():
        dist.destroy_process_group()

def all_mean(x, world_size):
    """x averaged over ranks."""
    if world_size > 1:
        x = x.clone()
        dist.all_reduce(x)
        x /= world_size
    return x

def full(t):
    """t whole: an FSDP2 DTensor is gathered from every rank (a collective: all ranks call it); else t."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t

def setup_precision(device, dtype_arg="auto", ckpt=None):
    """(dtype, autocast context, loss scaler). auto: a resumed run's dtype; else bf16 on GPUs that
    have it, fp16 on older ones, and fp32 on a CPU or MPS."""
    # Mixed precision: the weights and the optimizer's state stay fp32, and autocast runs the
    # matmuls in the low precision (half the memory traffic, and tensor cores). bf16 has fp32's
    # range, so nothing overflows; fp16 has not, so the scaler multiplies the loss before
    # backward, divides the grads after, and skips a step whose grads overflowed.
    # On a CPU auto is fp32, whatever the CPU: a rule of the device alone, so that one command
    # trains in one precision on one machine, loaded or idle. Measured where bf16 is at its best,
    # a 2-core Xeon with AVX512-BF16 and AMX (BENCHMARKS.md, 2026-12-01): in the GPT demo's 240 s
    # bf16 made as many steps (1,646 against 1,650) and ended 0.024 bits per byte worse; the
    # image demos made 1.2-1.3x the steps in bf16 and ended level, at 99.4-99.95%. Without those
    # units (most laptops: AVX2) a CPU emulates bf16, many times slower than fp32
    saved = ckpt["config"].get("dtype") if ckpt else None
    if dtype_arg == "auto" and saved in ("bfloat16", "float16", "float32"):
        dtype_arg = saved
    elif dtype_arg == "auto" and device.type == "cuda":
        dtype_arg = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
    elif dtype_arg == "auto":
        dtype_arg = "float32"
    dtype = getattr(torch, dtype_arg)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for what stays fp32
    ctx = contextlib.nullcontext()
    if dtype != torch.float32:
        ctx = torch.autocast(device.type, dtype=dtype)
    fp16 = dtype == torch.float16
    scaler = torch.amp.GradScaler(device.type, enabled=fp16, growth_interval=2000)
    return dtype, ctx, scaler

def wrap_model(raw, cfg, device, dtype, world_size):
    """(model, compiled): raw compiled, and wrapped in DDP or FSDP2 under torchrun. The optimizers
    and checkpoints keep using raw, whose parameter names have no wrapper's prefix."""
    # torch.compile fuses the elementwise ops between matmuls into Triton kernels. auto: on Linux
    # GPUs, where it pays back its minute of compiling; on a CPU it rarely does for a short run
    compiled = cfg.compile == "true"
    if cfg.compile == "auto":
        compiled = device.type == "cuda" and sys.platform == "linux"
    if world_size == 1 and cfg.parallel == "fsdp":  # a flag that would do nothing: say so
        print("--parallel=fsdp shards a model across the ranks of torchrun; this run is one process, unsharded")
    if world_size > 1 and cfg.parallel == "fsdp":
        # FSDP2 (Zhao et al. 2023): each rank keeps 1/world_size of every weight, gradient and
        # optimizer state, and gathers a block's weights just before it runs. Sharded block by
        # block, so only one block is whole at a time, and the next block's gather overlaps this
        # one's compute
        if dtype == torch.float16:
            die("--parallel=fsdp has no float16 (no sharded loss scaler); use bfloat16 or --parallel=ddp")
        from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy, fully_shard
        offload = OffloadPolicy()  # none
        if cfg.offload == "params":  # the shards live in CPU memory between uses
            offload = CPUOffloadPolicy(pin_memory=device.type == "cuda")
        # computed in dtype, gradients reduced in fp32: a sum over many ranks in bf16 loses bits
        precision = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32)
        mesh = dist.init_device_mesh(device.type, (world_size,))
        for block in raw.blocks:
            if compiled:
                block.compile()
            fully_shard(block, mp_policy=precision, offload_policy=offload, mesh=mesh)
        return fully_shard(raw, mp_policy=precision, offload_policy=offload, mesh=mesh), compiled
    model = raw
    if compiled:
        model = torch.compile(raw)
    if world_size > 1:
        # DDP: every rank holds the whole model and all-reduces the grads in backward, bucket by
        # bucket while backward goes on. The buffers (RoPE's tables) are constants: not broadcast
        ids = [device.index] if device.type == "cuda" else None
        model = nn.parallel.DistributedDataParallel(model, device_ids=ids, broadcast_buffers=False)
    return model, compiled

def grad_sync(model, sync):
    """A micro-step's backward context: the grads are synced across ranks only if sync."""
    if hasattr(model, "set_requires_gradient_sync"):  # FSDP2: a flag on the model
        model.set_requires_gradient_sync(sync)
    if hasattr(model, "no_sync") and not sync:  # DDP: a context
        return model.no_sync()
    return contextlib.nullcontext()

def clip_grads(params, max_norm):
    """Scales the grads to norm <= max_norm (a float or a tensor) on the device; their norm."""
    grads = [p.grad for p in params if p.grad is not None]
    norm = full(nn.utils.get_total_norm(grads))
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # 1: the norm is within the limit
    torch._foreach_mul_(grads, scale)
    return norm

def every(step, n):
    """Whether step is a multiple of n (n = 0: never)."""
    return n > 0 and step % n == 0

def steps_left(step, max_steps, train_time, time_budget, step_time):
    """The steps left in the budget: counted, or estimated from the last sync's step time (inf before one)."""
    if not time_budget:
        return max_steps - step
    if not step_time:
        return math.inf
    return (time_budget - train_time) / step_time

def agree(trace, t0, world_size):
    """The sync: the host reads the rows of the steps since the last sync (each a tensor of its
    loss, grad norm and the guard's verdict), which waits for the device to finish them, then the
    seconds since t0, averaged over the ranks so that every rank decides alike (when to stop, what
    the LR is). Returns (rows as lists, seconds)."""
    rows = torch.stack(trace).tolist()  # the one host read of device values, at a sync only
    seconds = time.perf_counter() - t0
    if world_size > 1:  # NCCL reduces tensors on the GPU, gloo on the CPU
        device = "cuda" if dist.get_backend() == "nccl" else "cpu"
        t = torch.tensor([seconds], dtype=torch.float64, device=device)
        seconds = all_mean(t, world_size).item()
    return rows, seconds
# === end shared ===

# -----------------------------------------------------------------------------
# Training loop

# === shared: guard ===
# The guard's verdict on a step: a number on the device, which the host reads at the next sync. GOOD, or why the
# optimizers skipped the step; OVERFLOW is fp16's, which the loss scaler handles (it lowers its scale), not a bad step
GOOD, NONFINITE, LOSS_SPIKE, GNORM_SPIKE, OVERFLOW = range(5)
BAD = {NONFINITE: "non-finite loss or grad norm", LOSS_SPIKE: "loss spike", GNORM_SPIKE: "grad norm spike"}

class Guard:
    """Skips a step whose loss or grad norm is non-finite or spikes, and asks for a rollback after
    max_bad bad steps in window steps (PaLM, Chowdhery et al. 2022, section 5.1: restart from a
    checkpoint before the spike and skip the batches around it).

    It decides on the device: reading the loss on the host at every step would make the host wait
    for the device at every step. A spike is measured against running statistics of the good
    steps: their mean, then (after window steps) an exponential moving average, of the loss and the
    grad norm, and their variance. The host reads the verdicts at the next sync (RunLog.skips)."""

    def __init__(self, loss_sigma=6.0, gnorm_sigma=0.0, window=100, max_bad=5, clip_mult=0.0, device="cpu"):
        self.sigma = torch.tensor([loss_sigma, gnorm_sigma], device=device)  # 0: that test is off
        self.window = window
        self.max_bad = max_bad
        self.clip_mult = clip_mult
        self.rollbacks = {}  # {checkpoint step: rollbacks to it}, for this process only
        self.load_state({"n": 0, "mean": [0.0, 0.0], "var": [0.0, 0.0], "bad": []})

    def state(self):
        """The statistics as plain data, for a checkpoint (a host read: called at saves only)."""
        n, *mean_var = self.stats.tolist()
        return {
            "n": int(n),
            "mean": mean_var[:2],  # the loss's and the grad norm's
            "var": mean_var[2:],
            "bad": list(self.bad)
        }

    def load_state(self, s):
        self.bad = [int(b) for b in s["bad"]]  # the steps of the recent bad steps
        # stats (5,): the good steps so far; the loss's and grad norm's means; their variances
        mean = [float(m) for m in s["mean"][:2]]
        var = [float(v) for v in s["var"][:2]]
        self.stats = self.sigma.new_tensor([int(s["n"]), *mean, *var])

    def clip(self, max_norm):
        """The grad norm to clip at: max_norm (0: none), and with --clip_mult at most clip_mult
        times the mean grad norm, once ten steps have made that mean."""
        limit = max_norm if max_norm > 0 else float("inf")
        if not self.clip_mult:
            return limit
        warm = self.stats[0] >= 10
        mean_gnorm = self.stats[2]
        return torch.where(warm, self.clip_mult * mean_gnorm, limit).clamp(max=limit)

    def check(self, loss, gnorm, fp16=False):
        """The step's verdict, a 0-d float tensor on the device: GOOD, or why the optimizers must
        leave the weights alone. A good step's loss and grad norm join the running statistics."""
        v = torch.stack([loss.float(), gnorm.float()])  # (2,): this step's loss and grad norm
        n, mean, var = self.stats.split([1, 2, 2])
        std = torch.maximum(var.sqrt(), 0.02 * mean.abs())  # a flat loss has a tiny std
        # a spike: more than sigma stds above the mean, once ten good steps have made the mean
        spike = (self.sigma > 0) & (n >= 10) & (v > mean + self.sigma * std)
        verdict = torch.where(spike[1], GNORM_SPIKE, GOOD)
        verdict = torch.where(spike[0], LOSS_SPIKE, verdict)  # a loss spike is named before a grad norm one
        nonfinite = NONFINITE
        if fp16:  # non-finite grads of a finite loss: fp16 overflowed, and the scaler skips the step
            nonfinite = torch.where(v[0].isfinite(), OVERFLOW, NONFINITE)
        verdict = torch.where(v.isfinite().all(), verdict, nonfinite)
        # the statistics of good steps: a running mean for the first window steps, then an EMA
        a = (1 / (n + 1)).clamp(min=1 / self.window)
        d = v - mean
        new_mean = mean + a * d
        new_var = (1 - a) * (var + a * d * d)  # the variance's exponentially weighted update (Finch 2009)
        new = torch.cat([n + 1, new_mean, new_var])
        self.stats = torch.where(verdict == GOOD, new, self.stats)
        return verdict.float()

    def rollback_due(self):
        """Whether enough bad steps in the window call for a rollback (max_bad = 0: never)."""
        return self.max_bad > 0 and len(self.bad) >= self.max_bad
# === end shared ===

@torch.no_grad()
def evaluate(model, x_all, y_all, K, B, rank, world_size, ctx, n, tta_flip):
    """({val_acc, val_top5, val_loss}, the confusion matrix (true, predicted)) of the first n val images."""
    model.eval()
    # This rank's sums, in one tensor so that one all-reduce adds them up over the ranks: top-1 hits, top-5 hits,
    # the loss's sum, then the K x K confusion counts (true class, predicted class), flattened.
    sums = torch.zeros(3 + K * K, device=y_all.device, dtype=torch.float64)
    # The ranks take turns at batches of B. Under FSDP every forward is a collective, so every rank runs as many:
    # a rank past the end of the n images reads one image and counts it with weight 0.
    for it in range(math.ceil(n / (B * world_size))):
        i = (it * world_size + rank) * B
        j = min(i + B, n)
        w = 1.0
        if i >= n:
            i = 0
            j = 1
            w = 0.0
        x = x_all[i:j].to(y_all.device, non_blocking=True)  # (b, H, W, C) uint8, from the host under --loader=host
        x = x.float() / 255  # in [0, 1]
        y = y_all[i:j]
        with ctx:
            logits = model(x).float()  # (b, K)
            if tta_flip:
                # test-time augmentation: the log of the mean of the two views' probabilities (up to a constant,
                # which the softmax below cancels)
                mirrored = model(x.flip(2)).float()  # (b, K): the mirror images' logits
                both = torch.stack((logits, mirrored))  # (2, b, K)
                logits = both.log_softmax(-1).logsumexp(0)
        top = logits.topk(min(5, K), dim=-1).indices  # (b, 5): the classes in order of their logits
        top1 = (top[:, 0] == y).sum()
        top5 = (top == y[:, None]).any(1).sum()
        loss = F.cross_entropy(logits, y, reduction="sum")
        sums[:3] += w * torch.stack([top1, top5, loss]).double()
        cells = y * K + top[:, 0]  # (b,): each image's cell (true, predicted) of the confusion matrix, flattened
        sums[3:] += w * torch.bincount(cells, minlength=K * K).double()
    model.train()
    total = all_mean(sums, world_size) * world_size
    acc, top5, loss = (total[:3] / n).tolist()
    confusion = total[3:].view(K, K).long().cpu().numpy()  # (K, K): rows true, columns predicted
    return {"val_acc": acc, "val_top5": top5, "val_loss": loss}, confusion

def evaluate_both(cfg, model, ema, val_x, val_y, K, ctx, rank, world_size, step, final):
    """Evaluate the weights and their EMA and print the eval line; returns (the record, the confusion matrix of the
    better weights, "" or "ema_": which weights were better)."""
    # Periodic evals read the first eval_images of the val split, to keep them cheap; the final one reads it all.
    n = len(val_y) if final else min(cfg.eval_images, len(val_y))
    args = (val_x, val_y, K, cfg.batch_size, rank, world_size, ctx, n, cfg.tta_flip)
    scores, conf = evaluate(model, *args)
    rec = {"step": step, **scores}
    best = ""
    # The EMA's weights are a second model for free: swapped into the model for their eval, then swapped back.
    # The better of the two (the raw weights on a tie) gives the per-class accuracies and the confusion matrix.
    if ema:
        ema.swap()
        ema_scores, ema_conf = evaluate(model, *args)
        ema.swap()
        rec |= {"ema_" + k: v for k, v in ema_scores.items()}
        if ema_scores["val_acc"] > scores["val_acc"]:
            best = "ema_"
            conf = ema_conf
    # each class's accuracy: the final line names the three weakest, so a class the model keeps confusing is not
    # averaged away
    right = conf.diagonal()  # (K,): each class's val images predicted right
    seen = np.maximum(conf.sum(1), 1)  # (K,): its val images, at least 1 so that a class with none scores 0
    rec["per_class_acc"] = (right / seen).round(4).tolist()
    line = f"eval {step:05d} | val acc {100 * rec['val_acc']:.2f}% | top5 {100 * rec['val_top5']:.2f}%"
    line += f" | loss {rec['val_loss']:.4f}"
    if ema:
        line += f" | ema acc {100 * rec['ema_val_acc']:.2f}% | ema loss {rec['ema_val_loss']:.4f}"
    line += f" | {n} images"
    if cfg.tta_flip:
        line += " (flip TTA)"
    print(line)
    return rec, conf, best

def plot_results(out_dir, history, confusion, classes):
    """accuracy.png (val accuracy, its EMA's, train loss) and confusion.png."""
    # imported here, not at the top: only a finished run on rank 0 plots, and Agg draws without a display
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    # history holds the log steps' train losses and the evals' records, in the order they happened
    fig1, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("val_acc", "o-"), ("ema_val_acc", "s-")):
        pts = [(h["step"], 100 * h[key]) for h in history if key in h]
        if pts:
            ax.plot(*zip(*pts), style, label=key.replace("_", " "))
    ax.set(
        xlabel="step",
        ylabel="val top-1 accuracy (%)",
        title=os.path.basename(os.path.abspath(out_dir))
    )
    ax.grid(alpha=0.3)
    ax.legend(loc="lower left")
    losses = [(h["step"], h["loss"]) for h in history if "loss" in h]
    if losses:
        ax2 = ax.twinx()  # the loss on its own axis, at the right
        ax2.plot(*zip(*losses), color="gray", alpha=0.5)
        ax2.set_ylabel("train loss")
    # The confusion matrix, as rates: row i is where the val images of class i went. Up to 30 classes each cell
    # is labelled with its count; more would not be legible, so only the colours show.
    K = len(classes)
    labelled = K <= 30
    size = (12, 11)
    if labelled:
        size = (2 + 0.5 * K, 1.5 + 0.5 * K)
    fig2, ax = plt.subplots(figsize=size)
    rates = confusion / np.maximum(confusion.sum(1, keepdims=True), 1)  # (K, K), each row sums to 1
    ax.imshow(rates, cmap="Blues", vmin=0, vmax=1)
    if labelled:
        ax.set_xticks(range(K), classes, rotation=90)
        ax.set_yticks(range(K), classes)
        for i, j in zip(*np.nonzero(confusion)):
            color = "white" if rates[i, j] > 0.5 else "black"  # legible on a dark cell and a light one
            ax.text(j, i, int(confusion[i, j]), ha="center", va="center", fontsize=7, color=color)
    ax.set(
        xlabel="predicted",
        ylabel="true",
        title=f"confusion on val ({int(confusion.sum())} images)"
    )
    for fig, name in ((fig1, "accuracy.png"), (fig2, "confusion.png")):
        fig.tight_layout()
        fig.savefig(os.path.join(out_dir, name), dpi=120)
        plt.close(fig)

def done_line(step, epochs, train_time, rec, best, meta, out_dir):
    """The run's last line: steps, epochs, time, the final val accuracy (of the EMA weights where
    they did better), and the three weakest classes."""
    acc = rec["per_class_acc"]
    weakest = ", ".join(f"{meta['classes'][i]} {100 * acc[i]:.0f}%" for i in np.argsort(acc)[:3])
    return (
        f"done: {step} steps, {epochs:.1f} epochs in {train_time:.0f} s"
        f" | val acc {100 * rec[best + 'val_acc']:.2f}% ({'EMA' if best else 'raw'} weights)"
        f" | weakest: {weakest}"
        f" | checkpoint, accuracy.png and confusion.png in {out_dir}"
    )

def train(cfg, stop):
    """Set up, resume, then the loop: evals and saves; micro-steps, clip, the guard, the update; the sync
    and its log line."""
    rank, world_size, device = setup_dist(cfg.device)
    if rank:  # one rank prints: the others' lines would repeat its own
        sys.stdout = open(os.devnull, "w")
    wall0 = time.perf_counter()
    master = rank == 0  # only rank 0 writes files
    # a first run: the demo's data, made offline
    prepare_default_data(cfg, rank, world_size, "shapes", "the shapes dataset")
    # data: both splits as uint8, held on the device or read from their files (--loader)
    meta, loader, val_x, val_y = image_data(cfg, rank, world_size, device)
    H, W = meta["image_size"]
    C = meta["channels"]
    K = meta["num_classes"]
    if K < 2:  # one class: every image is right before a step, and the loss falls to 0 with nothing learnt
        die(f"{cfg.data_dir} holds images of {K} class ({', '.join(meta['classes'])}); a classifier needs at least "
            f"2: prepare a folder of two or more, one subfolder a class (prepare_data.py imagefolder PATH)")
    check_shift(cfg, H)
    flip, why = flips(cfg, meta)
    # Two views of the data go into every checkpoint: data_info, which a resume must match, and data_meta, which
    # lets predict_vit.py classify images with the checkpoint alone (the class names, the pixel statistics).
    data_info = {"num_classes": K, "image_size": [H, W], "channels": C}
    data_meta = {k: meta[k] for k in ("classes", "num_classes", "image_size", "channels", "mean", "std")}

    # cfg settles here, before anything derives from it. The width: under 10k images, 128
    # stalls near chance for ~500 steps where 64 learns (README). The precision: a resumed run's.
    # The budget: steps (--max_steps, or --epochs in steps: an epoch is at least one, as the
    # loader refuses a split smaller than a batch), else seconds of training (--time_budget)
    B = cfg.batch_size
    accum = cfg.grad_accum
    images_per_step = B * accum * world_size
    steps_per_epoch = len(loader.y) // (B * world_size) / accum
    max_steps = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
    time_budget = 0.0 if max_steps else cfg.time_budget
    width = cfg.n_embd
    if not width:
        width = 64 if len(loader.y) < 10000 else 128
    layout = run_layout({**dataclasses.asdict(cfg), "n_embd": width}, world_size, data_info)
    ckpt, path = resume_point(cfg.out_dir, cfg.resume, layout, master, max_steps, time_budget)
    dtype, ctx, scaler = setup_precision(device, cfg.dtype, ckpt)
    cfg = dataclasses.replace(cfg, n_embd=width, dtype=str(dtype).removeprefix("torch."))

    # model, optimizers, EMA, guard
    raw = build_model(cfg, meta, device)
    kernels.use(cfg.kernels)  # Triton's or PyTorch's ops, chosen before compile traces the model
    model, compiled = wrap_model(raw, cfg, device, dtype, world_size)
    opts = build_optimizers(cfg, raw, dtype)
    ema = EMA(raw.parameters(), cfg.ema, raw) if cfg.ema else None
    guard = Guard(cfg.loss_spike, cfg.gnorm_spike, cfg.guard_window, cfg.rollback_after, cfg.clip_mult, device)
    n_params = sum(p.numel() for p in raw.parameters())

    # the loop's state: these locals; a resume sets them, and the loader's place
    step, train_time, history = 0, 0.0, []
    if ckpt:
        with exit_if_unreadable(path, "it is not a checkpoint of this run; pass a new --out_dir"):
            step, train_time, history = apply_checkpoint(ckpt, raw, opts, scaler, guard, ema)
            loader.load_state(ckpt["data"])
    # the log: a line a log step, every value in metrics.jsonl; what a step is worth gives its speed and MFU
    log = start_log(cfg, master, images_per_step, "img", raw.flops_per_image() * images_per_step, device, dtype)
    sharded = world_size > 1 and cfg.parallel == "fsdp"  # a checkpoint: a folder of shards
    writer = CheckpointWriter(cfg.out_dir, cfg.keep_last, cfg.milestone_every, cfg.async_save, sharded, world_size,
                              master)
    span = f"{time_budget:.0f} s" if time_budget else f"{max_steps} steps ({max_steps / steps_per_epoch:.1f} epochs)"
    print(f"{n_params / 1e6:.2f}M parameters | {len(loader.y)} train images of {H}x{W}x{C}, {K} classes"
          f" | {(H // cfg.patch_size) ** 2} patches | {images_per_step} images/step (B {B} x accum {accum} x world"
          f" {world_size}) | {span} | {device} {dtype} | compile {compiled} | kernels {kernels.backend(device)}"
          f" | {cfg.optimizer} lr {cfg.lr:g} | flips {'on' if flip else 'off'} ({why}) | images {loader.where}")

    # The host reads what the device computed (each step's loss, grad norm and the guard's
    # verdict) only at a sync: a log step, before an eval or a save, near the end, on a stop.
    # Between syncs it queues steps while the device runs, and nothing waits (tests/test_sync.py
    # counts the reads). The sync's state is two names: trace, the rows of the steps since the
    # last sync, and step_time, a step's seconds over the last interval, which estimates the time
    # since (train_time is the time up to it; t0 is when the clock last started).
    first, trace, step_time = step, [], 0.0  # first: where this run (re)starts
    last_step = stopped = False
    t0 = time.perf_counter()  # start the clock
    while True:
        # Evals (one at step 0: an untrained model is at chance) and saves, but not again at the
        # step a resume or rollback starts from. The clock stopped at the sync: they are not
        # training time.
        final = last_step and not stopped  # a stopped run saves, and leaves the final eval to its resume
        # a periodic eval within a tenth of an interval of the end would only repeat the final one: skipped
        soon = steps_left(step, max_steps, train_time, time_budget, step_time) < cfg.eval_every / 10
        evals = final or (every(step, cfg.eval_every) and (step == 0 or step > first) and not soon)
        saves = last_step or (every(step, cfg.save_every) and step > first)
        if evals:
            rec, conf, best = evaluate_both(cfg, model, ema, val_x, val_y, K, ctx, rank, world_size, step, final)
            log.eval(final, **rec)
            history.append({k: v for k, v in rec.items() if k != "per_class_acc"})
        if saves:
            # The checkpoint is a dict built here and read back by apply_checkpoint. It holds all a resumed run
            # needs to go on as if never stopped: the guard's statistics, the loader's place, the train time.
            writer.save({**model_state(raw, opts, ema, whole=not sharded), "scaler": scaler.state_dict(),
                         "step": step, "guard": guard.state(), "train_time": train_time,
                         "history": history, "data_info": data_info, "config": dataclasses.asdict(cfg),
                         "world_size": world_size, "data": loader.state(), "data_meta": data_meta})
        if last_step:
            break
        if evals or saves:
            t0 = time.perf_counter()  # start the clock again

        # one optimizer step. Augmentation and stochastic depth draw from the global RNG seeded
        # by (seed, step, rank): a resumed run draws the same numbers, with no RNG state saved
        torch.manual_seed(cfg.seed + 1000003 * (step + 1) + 7919 * rank)
        if time_budget:  # the schedule follows the time, estimated since the sync
            progress = (train_time + len(trace) * step_time) / time_budget
        else:
            progress = step / max_steps
        # Every group of both optimizers shares one peak LR (Muon scales its update to AdamW's size), so one
        # multiplier sets them all.
        mult = lr_mult(cfg, step, progress)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
            for g in opt.param_groups:
                g["lr"] = cfg.lr * mult
        loss = torch.zeros((), device=device)  # the step's mean loss, on the device
        for micro in range(accum):
            x, y = loader.next()  # (B, H, W, C) uint8, (B,)
            x = augment(x.float() / 255, cfg, flip)  # (B, H, W, C) in [0, 1]
            x, ya, yb, lam = mix(x, y, cfg)
            # DDP all-reduces grads in backward; only the last micro-step needs to (grad_sync)
            with grad_sync(model, micro == accum - 1):
                with ctx:
                    logits = model(x).float()  # (B, K)
                    micro_loss = F.cross_entropy(logits, ya, label_smoothing=cfg.label_smoothing)
                    if lam < 1:  # a mixed batch: each partner's loss, by its share
                        other = F.cross_entropy(logits, yb, label_smoothing=cfg.label_smoothing)
                        micro_loss = lam * micro_loss + (1 - lam) * other
                    micro_loss = micro_loss / accum  # the mean over micro-steps: one big batch
                scaler.scale(micro_loss).backward()
            loss += micro_loss.detach()
        for opt in opts:
            scaler.unscale_(opt)
        gnorm = clip_grads(raw.parameters(), guard.clip(cfg.grad_clip))
        # The guard skips a bad step (non-finite, or a spike), deciding on the device: asking
        # the host would stall the device every step. Where its verdict is not GOOD, AdamW's
        # fused kernel and Muon leave the weights and their state as they were.
        loss = all_mean(loss, world_size)
        verdict = guard.check(loss, gnorm, scaler.is_enabled())
        for opt in opts:
            opt.step(skip=verdict != GOOD)
        if ema:  # a skipped step left the weights as they were
            ema.update()
        scaler.update()
        step += 1
        trace.append(torch.stack([loss, gnorm, verdict]))

        # sync now? At a log step, before an eval or a save, near the end, or on a signal (the
        # handler's flag is host state, read every step: a SIGTERM is obeyed after this step)
        stopped = stop.requested(world_size)
        if time_budget:  # will the budget be spent by this step's end? (no step_time yet: learn it)
            near_end = not step_time or train_time + len(trace) * step_time >= time_budget
        else:
            near_end = step >= max_steps
        due = [every(step, n) for n in (cfg.log_every, cfg.eval_every, cfg.save_every)]
        if not (near_end or stopped or any(due)):
            continue
        rows, seconds = agree(trace, t0, world_size)  # the host waits for the device here
        t0 = time.perf_counter()
        train_time += seconds
        step_time = seconds / len(rows)
        trace = []
        reason = log.skips(rows, step - len(rows), guard)
        if reason and guard.rollback_due():  # repeated bad steps: back to a checkpoint before them
            ckpt = writer.rollback_point(guard, reason, log, step)
            stopped = stopped or ckpt is None  # none to go back to: save the weights (skips left them) and stop
            if ckpt:
                step, train_time, history = apply_checkpoint(ckpt, raw, opts, scaler, guard, ema)
                first = step  # the batches read since are skipped, not read again
                t0 = time.perf_counter()
        last_step = stopped or (train_time >= time_budget if time_budget else step >= max_steps)
        lossf, gnormf = rows[-1][:2]  # the step's loss and grad norm, on the host
        if step > first and (every(step, cfg.log_every) or last_step):  # (after a rollback: no new step yet)
            log.step(step, max_steps, time_budget, train_time, step_time, loss=lossf, lr=cfg.lr * mult, gnorm=gnormf,
                     epoch=loader.epoch + loader.pos / len(loader.y))
            history.append({"step": step, "loss": lossf})

    # the end: how to resume after a signal, or the results
    writer.close(step)
    result = {"steps": step, "train_time": train_time, "wall_time": time.perf_counter() - wall0,
              "peak_mem_gb": log.peak_memory_gb(), "params": n_params}
    if stopped:  # the checkpoint is saved: exit 0, and --resume goes on
        print(stop.preempted(step, cfg.out_dir))
        result = {"preempted": True, "steps": step, "train_time": train_time}
    else:
        result |= {**rec, "train_loss": lossf, "images": step * images_per_step}
        # rank 0 draws the plots and adds the run's row to results.tsv, the log of experiments beside out_dir,
        # under the better of the two val accuracies (raw or EMA weights)
        if master:
            side_path("writing the plots", plot_results, cfg.out_dir, history, conf, meta["classes"])
        log.result(f"{best}val_acc", result, cfg.description)
        print(done_line(step, step * images_per_step / len(loader.y), train_time, rec, best, meta, cfg.out_dir))
    return result

def check_config(cfg):
    """Reject impossible settings with a one-line message that names the fix."""
    check_choices(cfg)
    # Counts and sizes must be at least 1; the rest at least 0, where 0 means off or "pick it for me". The counts
    # come first, so that the head check below never divides by n_head = 0.
    for low, keys in (
        (1, "patch_size n_layer n_head batch_size grad_accum guard_window log_every"),
        (0, "n_embd translate mixup cutmix registers layer_scale epochs image_size init_std eval_images "
            "weight_decay loss_spike gnorm_spike clip_mult rollback_after max_steps time_budget")
    ):
        for k in keys.split():
            if getattr(cfg, k) < low:
                die(f"--{k} must be at least {low}, got {getattr(cfg, k)}")
    width = cfg.n_embd or 64  # auto is 64 or 128: heads that split 64 evenly split 128 too
    if width % cfg.n_head or (width // cfg.n_head) % 2:
        fit = [h for h in range(1, width + 1) if width % h == 0 and (width // h) % 2 == 0]
        die(
            f"--n_embd={width} must split into {cfg.n_head} heads of even size; --n_head={'|'.join(map(str, fit))} "
            f"would, or change --n_embd"
        )
    if (
        cfg.lr <= 0
        or cfg.warmup_steps < 0
        or not 0 <= cfg.final_lr_frac <= 1
        or not 0 < cfg.cooldown_frac <= 1
    ):
        die("need --lr > 0, --warmup_steps >= 0, 0 <= --final_lr_frac <= 1, 0 < --cooldown_frac <= 1")
    # Decays and probabilities stay under 1: an EMA of 1 never moves, Adam's bias correction divides by 1 - beta,
    # stochastic depth by 1 - drop_path, and a label smoothing of 1 leaves no trace of the true class.
    if not (
        0 <= cfg.ema < 1
        and 0 <= cfg.drop_path < 1
        and 0 <= cfg.label_smoothing < 1
        and 0 <= cfg.beta1 < 1
        and 0 <= cfg.beta2 < 1
        and cfg.mlp_ratio > 0
    ):
        die("need 0 <= --ema, --drop_path, --label_smoothing, --beta1, --beta2 < 1 and --mlp_ratio > 0")
    if not (cfg.max_steps or cfg.epochs or cfg.time_budget > 0):
        die("no training budget: set --max_steps, --epochs or --time_budget")

def main(cfg):
    """Train per cfg; returns a dict of final metrics."""
    check_config(cfg)
    with StopSignal() as stop:  # SIGTERM, SIGINT: finish the step, save, exit 0
        result = train(cfg, stop)
    leave_dist()
    return result

# -----------------------------------------------------------------------------
# Machinery, the same bytes in every train_*.py: flags, logs, checkpoint I/O, resume and rollback,
# signals. The recipe above reads without it.

# === shared: machinery ===
# What every trainer needs and none of them teaches: flags, logs, checkpoints, rollbacks,
# signals. This block is the same, byte for byte, in the three trainers (a
# test compares them), so a fix lands in all three at once. A reader may skip it: train() calls
# each part by a name that says what it does, and the names that stop a run say so.

def die(msg):
    """Stop with a one-line error that names the problem and its fix. A SystemExit, not an
    exception: a user sees one line and a non-zero exit, not a traceback, and tests catch it."""
    raise SystemExit(f"{os.path.basename(sys.argv[0]) or 'train'}: error: {msg}")

def side_path(what, fn, *args):
    """fn(*args), or None and a warning: a sample or a plot that fails must not end a run."""
    try:
        return fn(*args)
    except (Exception, SystemExit) as e:  # noqa: BLE001
        why = " ".join(str(e).split())[:200] or type(e).__name__
        print(f"warning: {what} failed, training goes on: {why}", file=sys.stderr)

# ---- flags: each Config field is a --key=value flag; the comments in its source are the help

@functools.cache  # inspect parses the whole file for a class's source: once a process is enough
def config_lines(cls):
    """[(field, section, help)] from a Config's source, base classes first: the first line of the
    comment block above a group of fields is their section, the comment ending a field's line its help."""
    rows = []
    for c in reversed(cls.__mro__[:-1]):  # object has no source
        section = ""
        after_comment = False
        for line in inspect.getsource(c).splitlines():
            comment = re.match(r"^\s+#\s*(.*)$", line)
            if comment and not after_comment:
                section = comment[1]
            after_comment = bool(comment)
            field = re.match(r"^\s+(\w+):[^#\n]*(?:#\s*(.*))?$", line)
            if field:
                rows.append((field[1], section, field[2] or ""))
    return rows

def choose(field, value):
    """value, if the field's Literal type allows it; else stop naming the choices."""
    options = get_args(field.type)
    if options and value not in options:
        die(f"--{field.name}={value} is not one of {'|'.join(options)}")
    return value

def check_choices(cfg):
    """Stop on a value that no flag could have given: a test or a companion may build a Config
    directly. --offload means something only under FSDP2."""
    for f in dataclasses.fields(cfg):
        choose(f, getattr(cfg, f.name))
    ranks = int(os.environ.get("WORLD_SIZE", "1"))
    if cfg.offload != "none" and (cfg.parallel != "fsdp" or ranks < 2):
        die("--offload needs --parallel=fsdp under torchrun (FSDP2 moves the shards); drop it or add those")

TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")

def to_bool(text):
    """A flag's true or false; a bare --flag is true."""
    if text.lower() not in TRUE + FALSE:
        raise argparse.ArgumentTypeError(f"expected true/false, got {text!r}")
    return text.lower() in TRUE

def finite(text):
    """A float flag. nan would pass every range check after this one, so it stops here."""
    x = float(text)
    if not math.isfinite(x):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return x

def own_value(given, out_dir, m):
    """A --key=VALUE (the match m) of a moved job's command in the user's own value: the --key given, and for
    --ckpt=OUT_DIR, the default run's folder, the --out_dir given (or the preset's)."""
    import shlex  # a value with spaces or quotes, written as a shell reads it back
    key, value = m.groups()
    if key == "ckpt" and value == out_dir:
        value = given.get("out_dir", value)
    return f"--{key}={shlex.quote(str(given.get(key, value)))}"

def parse_args(cls, argv):
    """A Config from --key=value flags over a --preset. Unlike nanoGPT's configurator, which
    exec()s its arguments, a typo stops in one line that names the nearest flag."""
    module = sys.modules[cls.__module__]
    p = argparse.ArgumentParser(description=module.__doc__.strip().split("\n")[0],
                                usage="%(prog)s [--key=value ...]",
                                allow_abbrev=False,
                                argument_default=argparse.SUPPRESS)  # unset flags keep the preset's value
    p.error = lambda msg: die(f"{msg} (see -h)")
    helps = {name: (section, text) for name, section, text in config_lines(cls)}
    groups = {}
    for f in dataclasses.fields(cls):  # -h lists the flags under the Config's section comments
        section, text = helps.get(f.name, ("", ""))
        title = section or "options"
        if title not in groups:
            groups[title] = p.add_argument_group(title)
        options = get_args(f.type)
        bare = {}
        if f.type is bool:
            kind = to_bool
            bare = dict(nargs="?", const=True)
        elif options:
            kind = functools.partial(choose, f)
        elif f.type is float:
            kind = finite
        else:
            kind = f.type
        groups[title].add_argument(f"--{f.name}", type=kind,
                                   metavar="|".join(options) or f.name.upper(),
                                   help=f"{text} (default: {f.default!r})", **bare)
    # parse_known_args, so that an unknown flag gets our message (did you mean, or where its job
    # moved) rather than argparse's list of every flag
    args, unknown = p.parse_known_args(argv)
    if unknown:
        flag = unknown[0].split("=")[0]
        moved = getattr(module, "MOVED", {})  # jobs that moved to a companion: name its command
        if flag.lstrip("-") in moved:
            # the values of this command line, over the preset's: the flags known here, then the moved ones
            defaults = module.PRESETS.get(vars(args).get("preset"), {})
            given = {**defaults, **vars(args)}
            for word in unknown:
                key, eq, value = word.lstrip("-").partition("=")
                if eq:
                    given[key] = value
            command = re.sub(r"--(\w+)=([^\s),]+)", functools.partial(own_value, given, cls.out_dir),
                             moved[flag.lstrip("-")])
            die(f"{flag} moved: {command}")
        names = [f.name for f in dataclasses.fields(cls)]
        near = difflib.get_close_matches(flag.lstrip("-"), names, n=1)
        die(f"unknown flag {flag!r}" + (f"; did you mean --{near[0]}?" if near else " (see -h)"))
    preset = vars(args).get("preset", "")
    if preset and preset not in module.PRESETS:
        die(f"unknown --preset={preset}; choose one of {', '.join(module.PRESETS)}")
    # a preset is a dict of defaults: the flags given on the command line win over it
    return cls(**{**module.PRESETS.get(preset, {}), **vars(args)})

# ---- logs: the config and the code at the start, a line a log step, a result at the end

# Dense bf16 peaks in FLOP/s, from the vendors' sheets: MFU is a step's FLOPs at this peak over
# its measured time (PaLM, Chowdhery et al. 2022, appendix B)
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12,
              "4090": 165e12, "A10": 125e12, "L4": 121e12, "V100": 125e12, "T4": 65e12}

def start_log(cfg, master, units, unit, flops, device, dtype):
    """Print the config; rank 0 writes it and the scripts' source to out_dir. Returns the run's
    RunLog: units, unit and flops are what one step is worth (its tokens or images, and FLOPs)."""
    config = dataclasses.asdict(cfg)
    print(json.dumps(config))
    if not master:
        return RunLog(None, units, unit, flops, device, dtype)
    try:
        os.makedirs(cfg.out_dir, exist_ok=True)
        with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
            json.dump(config, f, indent=2)
        # the code that made the run, beside its config: an edited copy is in no commit
        sources = {__file__, kernels.__file__, sys.modules[type(cfg).__module__].__file__}
        for src in sorted(sources):
            shutil.copyfile(src, os.path.join(cfg.out_dir, os.path.basename(src)))
        if cfg.wandb:
            import wandb
            wandb.init(project=cfg.wandb, config=config)
    except OSError as e:
        die(f"cannot write to --out_dir={cfg.out_dir} ({e.strerror}); pick a writable directory")
    except ImportError:
        die("--wandb needs the wandb package: pip install wandb")
    return RunLog(os.path.join(cfg.out_dir, "metrics.jsonl"), units, unit, flops, device, dtype, Reference(cfg))

# ---- the reference run: "is my loss normal?"

# The fields a run may change and still be compared with the reference at the steps both evaluated: where it
# writes, how often it logs, evaluates and saves, its seed, and its budget. Any other field changes what is learnt.
FREE_FIELDS = {"out_dir", "resume", "seed", "log_every", "eval_every", "save_every", "milestone_every", "wandb",
               "max_steps", "time_budget", "tokens", "eval_classifier", "phema_every"}
BUDGET_FIELDS = ("max_steps", "time_budget", "tokens")

class Reference:
    """A measured run of the default config (assets/reference_SCRIPT.json beside the script, written by
    tests/reference.py): its metrics at each eval, the machine, dtype and commit they came from, and how far off a
    metric may be before a newcomer should look for a cause. A run of another config compares with nothing."""

    def __init__(self, cfg):
        script = os.path.abspath(sys.modules[type(cfg).__module__].__file__)
        name = os.path.basename(script).removesuffix(".py")
        self.config = json.loads(json.dumps(dataclasses.asdict(cfg)))  # tuples as lists, as the file has them
        self.ref = None
        self.warned = False
        try:
            with open(os.path.join(os.path.dirname(script), "assets", f"reference_{name}.json")) as f:
                ref = json.load(f)
        except (OSError, ValueError):  # none for this script, or unreadable: the run goes on without
            return
        theirs = ref.get("config", {})
        if set(theirs) == set(self.config) and all(theirs[k] == v for k, v in self.config.items()
                                                   if k not in FREE_FIELDS):
            self.ref = ref

    def line(self, step, rec, final):
        """The reference's metrics at this step (at its end, for a final eval of the same budget), and a line on
        what to check the first time this run is far worse; "" where the reference has nothing to compare."""
        same_budget = all(self.config.get(k) == self.ref["config"].get(k) for k in BUDGET_FIELDS)
        at = self.ref["final_step"] if final and same_budget else step
        theirs = self.ref["curve"].get(str(at), {})
        shown, worse = [], []
        for k in theirs.keys() & rec.keys():
            acc = k.endswith("acc")  # accuracies are higher-is-better and shown in percent, the rest lower
            shown.append(f"{k.replace('_', ' ')} " + (f"{100 * theirs[k]:.2f}%" if acc else f"{theirs[k]:.4f}"))
            if (theirs[k] - rec[k] if acc else rec[k] - theirs[k]) > self.ref["far"][k]:
                worse.append(k.replace("_", " "))
        if not shown:
            return ""
        where = f"at its end, step {at}" if at != step else f"at step {at}"
        text = (f"  reference {where}: {' | '.join(sorted(shown))} ({self.ref['machine']}, {self.ref['dtype']}, "
                f"commit {self.ref['commit']})")
        if worse and not self.warned:
            self.warned = True
            text += (f"\n  far off the reference in {', '.join(sorted(worse))}: check the data (--data_dir, made as "
                     f"prepare_data.py makes it), the LR (--lr) and the dtype (the reference's {self.ref['dtype']})")
        return text

class RunLog:
    """A run's log: every rank prints its lines (those of ranks > 0 go to devnull), and rank 0
    records every logged value in metrics.jsonl, a JSON object a line (pandas.read_json(lines=True)),
    and in wandb if a run is open. A step's worth gives its throughput and MFU."""

    def __init__(self, path, units, unit, flops, device, dtype, reference=None):
        self.path = path  # None: nothing is recorded
        self.reference = reference  # the Reference whose figures each eval prints beside its own, or None
        self.units = units  # a step's tokens (or images)
        self.unit = unit  # their name: tok, img
        self.device = device
        # a step's seconds at the GPU's peak (tf32, in fp32: half of it), 0 where the peak is unknown
        gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
        peak = next((f for name, f in PEAK_FLOPS.items() if name in gpu), 0)
        if dtype == torch.float32:
            peak /= 2
        self.ideal = flops / peak if peak else 0.0

    def eval(self, final, **rec):
        """Record an eval, and print the reference's figures at its step below it (a side path: a reference file
        edited into another shape warns, and the run goes on)."""
        self.record(**rec)
        if self.reference and self.reference.ref:
            text = side_path("the reference", self.reference.line, rec["step"], rec, final)
            if text:
                print(text)

    def record(self, **kv):
        """Append kv to metrics.jsonl, and to wandb."""
        if not self.path:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(kv) + "\n")
        wandb = sys.modules.get("wandb")
        if wandb and wandb.run:
            wandb.log(kv, step=kv.get("step"))

    def step(self, step, max_steps, time_budget, train_time, dt, loss, lr, gnorm, **extra):
        """Print and record a log step: its loss, LR and grad norm, dt (a step's seconds), extra."""
        x = self.units / dt
        mfu = self.ideal / dt or None
        self.record(step=step, loss=loss, lr=lr, gnorm=gnorm, ms=dt * 1e3, **{f"{self.unit}_s": x}, mfu=mfu,
                    train_time=train_time, **extra)
        if x >= 1e6:
            rate = f"{x / 1e6:.2f}M"
        elif x >= 1e3:
            rate = f"{x / 1e3:.1f}k"
        else:
            rate = f"{x:.0f}"
        of = f"{train_time:.0f}/{time_budget:.0f}s" if time_budget else f"{max_steps:05d}"
        extras = "".join(f" | {k} {v:.2f}" for k, v in extra.items())
        mfu_text = f"mfu {100 * mfu:.1f}%" if mfu else "mfu -"
        print(f"step {step:05d}/{of} | loss {loss:.4f} | lr {lr:.1e} | gnorm {gnorm:.2f} | {dt * 1e3:.0f} ms | "
              f"{rate} {self.unit}/s | {mfu_text}{extras}")

    def skips(self, rows, step, guard):
        """At a sync, the rows [loss, grad norm, verdict] of the steps after step: prints and records
        the bad ones, notes them as the guard's recent bad steps, and returns why the last one was
        skipped (None if none was)."""
        last = None
        for s, (loss, gnorm, verdict) in enumerate(rows, step + 1):
            if verdict not in BAD:  # GOOD, or fp16's OVERFLOW
                continue
            guard.bad = [b for b in guard.bad if b > s - guard.window] + [s]
            last = f"{BAD[verdict]} (loss {loss:.4g}, grad norm {gnorm:.4g})"
            self.record(step=s, event="skip", reason=last, loss=loss, gnorm=gnorm)
            print(f"step {s:05d} | update skipped: {last} | {len(guard.bad)} bad in {guard.window} steps")
        return last

    def peak_memory_gb(self):
        """Peak GPU memory, or the CPU's peak resident memory (0 on Windows, which lacks `resource`)."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) / 1e9
        if sys.platform == "win32":
            return 0.0
        import resource
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        return peak / (1e9 if sys.platform == "darwin" else 1e6)  # bytes on macOS, KiB on Linux

    def result(self, metric, result, description):
        """A row in results.tsv beside out_dir (rank 0): one line a finished run (time, script,
        commit, metric, its value, memory, wall time, --description), to compare experiments."""
        if not self.path:
            return
        here = os.path.dirname(os.path.abspath(__file__))
        commit = ""
        if shutil.which("git"):
            git = ["git", "rev-parse", "--short", "HEAD"]
            commit = subprocess.run(git, capture_output=True, text=True, cwd=here).stdout.strip()
        row = [time.strftime("%Y%m%d-%H%M%S"),
               os.path.basename(__file__),
               commit or "unknown",
               metric,
               f"{result[metric]:.4f}",
               f"{result['peak_mem_gb']:.2f}",
               f"{result['wall_time']:.0f}",
               description.replace("\t", " ")]
        try:
            out_dir = os.path.dirname(self.path)
            tsv = os.path.join(os.path.dirname(os.path.abspath(out_dir)), "results.tsv")  # beside the runs
            with open(tsv, "a") as f:
                if f.tell() == 0:
                    f.write("run_id\tscript\tcommit\tmetric\tvalue\tpeak_mem_gb\twall_s\tdescription\n")
                f.write("\t".join(row) + "\n")
        except OSError as e:  # a side output: the run is done, its checkpoint saved
            print(f"warning: results.tsv not written: {e}")

# ---- checkpoints
# A checkpoint is a dict that train() builds: the weights and the optimizers' state, the step,
# the loader's place, the guard's statistics, the config. One process writes ckpt_STEP.pt with
# torch.save, atomically (a temporary file, fsync, rename), so a crash mid-write leaves the
# earlier checkpoints as they were. Under FSDP2 no rank holds the whole model, so each rank
# writes its own shards with torch.distributed.checkpoint (DCP) into a folder ckpt_STEP/, and
# rank 0 writes the rest as state.pt last, with the shards' sizes: a folder without state.pt,
# or with a shard of the wrong size, is torn. Loading skips a torn or corrupt checkpoint for
# the one before it, and unpickles only tensors and plain data (a checkpoint may come from
# anyone, and a pickle can run code).

# torch.distributed.checkpoint.state_dict's get/set functions read and write the same dicts for a
# plain model, DDP and FSDP2: keyed by parameter name (not by the optimizer's numbering), full
# on rank 0's CPU or sharded. So one checkpoint format serves every layout.

def model_state(model, opts, ema=None, whole=True):
    """{model, optim, ema, ema_t}: whole tensors on the CPU, or (whole=False) each rank's shards."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict, get_state_dict
    options = StateDictOptions(full_state_dict=whole, cpu_offload=whole)
    weights, optim = get_state_dict(model, opts, options=options)
    sd = {"model": weights, "optim": optim, "ema": None, "ema_t": 0}
    if ema:  # the EMA's weights are read through the model, so that they are sharded alike
        ema.swap()
        # cloned: on the CPU a full state dict shares memory with the weights, and they swap back
        sd["ema"] = {k: v.clone() for k, v in get_model_state_dict(model, options=options).items()}
        ema.swap()
        sd["ema_t"] = ema.t
    return sd

def apply_checkpoint(ckpt, model, opts, scaler, guard, ema=None):
    """Load ckpt into the model, the optimizers, the scaler and the guard; returns (step,
    train_time, history), the loop's state."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict, set_state_dict
    options = StateDictOptions(full_state_dict="shards" not in ckpt)
    if "shards" in ckpt:  # DCP reads each rank's part, and reshards if the number of ranks changed
        ckpt = {**ckpt, **read_shards(ckpt["shards"], model_state(model, opts, ema, whole=False))}
    set_state_dict(model, opts, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"], options=options)
    if ema:
        ema.swap()
        set_model_state_dict(model, ckpt["ema"], options=options)
        ema.swap()
        ema.t = int(ckpt["ema_t"])
    scaler.load_state_dict(ckpt["scaler"])
    guard.load_state(ckpt["guard"])
    history = list(ckpt["history"])  # a crafted one fails here, not at the end of the run
    if not all(isinstance(h, dict) for h in history):
        raise ValueError("its history is not a list of records")
    return int(ckpt["step"]), float(ckpt["train_time"]), history

class CheckpointWriter:
    """Writes one checkpoint at a time. With --async_save the write runs beside training (a thread,
    or DCP's async_save for shards), and the next save, a rollback or the end waits for it."""

    def __init__(self, out_dir, keep_last, milestone_every, async_save, sharded, world_size, master):
        self.out_dir = out_dir
        self.keep = (keep_last, milestone_every)
        self.async_save = async_save
        self.world_size = world_size
        self.master = master
        self.pending = None  # the write in flight
        self.stuck = ""  # why the run must stop: bad steps and no checkpoint from before them (rollback_point)
        # DCP gathers the shards' plan over a gloo group of its own, apart from training's NCCL
        self.group = dist.new_group(backend="gloo") if sharded else None

    def save(self, ckpt):
        """Every rank calls it. An async write that failed stops the run at the next wait()."""
        # One write at a time: two in flight could finish out of order, and the newest
        # checkpoint on disk would not be the newest one saved.
        from concurrent.futures import ThreadPoolExecutor
        self.wait()
        write_tensors = None
        if self.group:  # FSDP: the tensors go to DCP's shards, the rest to state.pt
            write_tensors = self.dcp_writer(ckpt)
            rest = {k: v for k, v in ckpt.items() if k not in ("model", "optim", "ema")}
            ckpt = {**rest, "shards": {"param_groups": ckpt["optim"]["param_groups"]}}
        if not (self.master or write_tensors):
            return
        if self.async_save:
            ckpt = copy.deepcopy(ckpt)  # training goes on changing the tensors the thread writes
        args = (self.out_dir, ckpt, *self.keep, write_tensors, self.master)
        if self.async_save:
            self.pending = ThreadPoolExecutor(1).submit(write_checkpoint, *args)
        else:
            write_checkpoint(*args)

    def dcp_writer(self, ckpt):
        """A function that writes ckpt's tensors as DCP shards and returns when they are on disk."""
        import torch.distributed.checkpoint as dcp
        path = os.path.join(self.out_dir, f"ckpt_{ckpt['step']:07d}")
        if self.master:  # the files of a torn earlier attempt must not mix with these
            shutil.rmtree(path, ignore_errors=True)
        dist.barrier()
        sd = {k: ckpt[k] for k in ("model", "optim", "ema")}
        kw = dict(storage_writer=dcp.FileSystemWriter(path), process_group=self.group)
        if self.async_save:  # DCP copies the shards to the CPU now, and writes them in a thread
            return dcp.async_save(dcp_part(sd), **kw).result
        return functools.partial(dcp.save, dcp_part(sd), **kw)

    def wait(self):
        """Wait for the write in flight; if it failed, its error stops the run here."""
        if self.pending:
            self.pending.result()
            self.pending = None

    # A rollback restores the weights, optimizers and guard of a checkpoint from before the bad
    # steps, but not the loader's place: the run goes on from the batch it had reached, so the
    # batches that caused the trouble are not seen again (PaLM's fix).

    def close(self, step):
        """Wait for the last write; stop in one line if the run had to stop (self.stuck)."""
        self.wait()
        if self.stuck:
            die(f"{self.stuck}; the weights of step {step} are saved, as the bad steps left them: --resume after "
                "the fix")

    def rollback_point(self, guard, reason, log, step):
        """The newest intact checkpoint from before the guard's first bad step, or None (and why in
        self.stuck) if there is none; stops in one line if the run has rolled back to it MAX_ROLLBACKS times already."""
        self.wait()
        if self.world_size > 1:
            dist.barrier()  # rank 0's last write lands before any rank looks
        ckpt, path = load_checkpoint(self.out_dir, before=guard.bad[0], whole=False)
        if ckpt is None:  # else it would skip to the end: the loop saves what it has (the steps before the bad ones)
            self.stuck = (f"{guard.max_bad} bad steps in {guard.window} (the last: {reason}) and no checkpoint from "
                          f"before step {guard.bad[0]} to roll back to; lower --lr, or pass --save_every so that a "
                          "rollback has one")
            return None
        guard.rollbacks[ckpt["step"]] = guard.rollbacks.get(ckpt["step"], 0) + 1
        if guard.rollbacks[ckpt["step"]] > MAX_ROLLBACKS:
            die(f"bad steps go on after {MAX_ROLLBACKS} rollbacks to step {ckpt['step']} (the last: {reason}); "
                f"lower --lr or raise --warmup_steps")
        print(f"step {step:05d} | rollback to {path} (step {ckpt['step']}): the batches read since are skipped")
        log.record(step=step, event="rollback", to_step=ckpt["step"])
        if self.master:  # the steps after it are a timeline that nothing may resume
            prune(self.out_dir, lambda s: s > ckpt["step"])
        return ckpt

MAX_ROLLBACKS = 3  # to one checkpoint: beyond that the flags need fixing, not another try

def write_checkpoint(out_dir, ckpt, keep_last=0, milestone_every=0, write_tensors=None, master=True):
    """Write ckpt_STEP.pt (or the shards, then ckpt_STEP/state.pt) atomically, then prune the old
    ones: all but the newest keep_last, and the milestones (steps that are multiples of milestone_every)."""
    name = f"ckpt_{ckpt['step']:07d}" + ("/state.pt" if write_tensors else ".pt")
    path = os.path.join(out_dir, name)
    folder = os.path.dirname(path)
    tmp = os.path.join(folder, "ckpt.tmp")
    try:
        if write_tensors:
            write_tensors()  # returns when every rank's shards are on disk
            if not master:
                return
            sizes = {n: os.path.getsize(os.path.join(folder, n)) for n in os.listdir(folder)}
            ckpt["shards"]["sizes"] = sizes
        os.makedirs(out_dir, exist_ok=True)
        with open(tmp, "wb") as f:
            torch.save(ckpt, f)
            os.fsync(f.fileno())  # on disk before the rename makes it the newest checkpoint
        os.replace(tmp, path)
    except BaseException as e:  # noqa: BLE001 - DCP raises BaseExceptions
        if hasattr(e, "failures"):  # DCP wraps each rank's error: show the first
            e = next(iter(e.failures.values()))[0]
        if os.path.exists(tmp):
            os.remove(tmp)
        die(f"writing {path} failed ({getattr(e, 'strerror', None) or e}); the earlier checkpoints are intact")
    if keep_last > 0:  # "newest" counts from this one: a rollback or resume pruned those after it
        newest = [s for s, _ in list_checkpoints(out_dir)[-keep_last:]]
        prune(out_dir, lambda s: s not in newest and not (milestone_every and s % milestone_every == 0))

def prune(out_dir, old):
    """Delete the checkpoints whose step makes old(step) true."""
    for step, path in list_checkpoints(out_dir):
        if not old(step):
            continue
        if os.path.isdir(path):
            shutil.rmtree(path)
        else:
            os.remove(path)

def list_checkpoints(out_dir):
    """[(step, path)] of ckpt_STEP(.pt) in out_dir, oldest first."""
    found = []
    for path in glob.glob(f"{out_dir}/ckpt_*"):
        m = re.fullmatch(r"ckpt_(\d+)(\.pt)?", os.path.basename(path))
        if m:
            found.append((int(m[1]), path))
    return sorted(found)

# A resume must continue the same run: same model, same data, same batch layout, or the loss
# curve after it means nothing. run_layout() (in the recipe) names the fields that must match,
# and a resume that changes one stops with the list of differences.

def resume_point(out_dir, resume, layout, master, max_steps=0, time_budget=0.0):
    """(ckpt, path) of the newest intact checkpoint to resume from, or (None, None) for a fresh
    run. Stops if out_dir holds an earlier run and --resume is not given (torchrun's restarts
    resume by themselves), if the checkpoint's run had another layout, or if it is complete
    (its step is max_steps, or its train_time time_budget)."""
    found = list_checkpoints(out_dir)
    # Each torchrun agent counts its own node's restarts: a node whose workers were restarted because
    # another node's failed counts none. The ranks take the largest count, so that all of them resume.
    restarted = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    if dist.is_initialized():
        counts = [0] * dist.get_world_size()
        dist.all_gather_object(counts, restarted)
        restarted = max(counts)
    if found and not (resume or restarted):
        die(f"{out_dir} holds checkpoints of an earlier run; continue it with --resume or pick a new --out_dir")
    if not found:
        if resume:
            print(f"--resume: no checkpoint in {out_dir} yet, starting from scratch")
        return None, None
    ckpt, path = load_checkpoint(out_dir, whole=False)
    if ckpt is None:
        die(f"--resume: no checkpoint in {out_dir} is readable (see warnings above); nothing was changed")
    with exit_if_unreadable(path, "it is not a checkpoint of this run; pass a new --out_dir"):
        saved = run_layout(ckpt["config"], ckpt["world_size"], ckpt["data_info"])
        diff = [f"{k}={v!r} (now {layout.get(k)!r})" for k, v in saved.items() if layout.get(k) not in (v, "auto")]
        step = int(ckpt["step"])
        done = float(ckpt["train_time"]) >= time_budget if time_budget else 0 < max_steps <= step
    if diff:
        die(f"--resume: {path} was made with a different config: {', '.join(diff)}; pass the same flags or "
            f"use a new --out_dir")
    if done:
        die(f"--resume: the run in {out_dir} is complete at step {step}; raise its budget (--max_steps, "
            f"--time_budget, ...) to train on")
    if master:  # the newer ones are unreadable: a later save must not count them among the newest
        prune(out_dir, lambda s: s > ckpt["step"])
    print(f"resumed from {path} at step {step}" + (f" (torchrun restart {restarted})" if restarted else ""))
    return ckpt, path

def check_intact(path):
    """A checkpoint's dict, loaded on the CPU, if it is intact: raises ValueError naming the fault,
    or pickle.UnpicklingError for anything but tensors and plain data (weights_only)."""
    file = os.path.join(path, "state.pt") if os.path.isdir(path) else path
    if not os.path.exists(file):
        raise ValueError("incomplete: it has no state.pt, which rank 0 writes last")
    bad = zipfile.ZipFile(file).testzip()  # torch.save writes a zip: each member has a CRC
    if bad:
        raise ValueError(f"the checksum of {bad} does not match")
    ckpt = torch.load(file, map_location="cpu", weights_only=True)
    sharded = file != path
    if not isinstance(ckpt, dict) or not {"config", "step", "shards" if sharded else "model"} <= ckpt.keys():
        raise ValueError("not a checkpoint of these scripts")
    if sharded:
        for name, size in ckpt["shards"].pop("sizes").items():
            got = os.path.getsize(os.path.join(path, name))
            if got != size:
                raise ValueError(f"{name} has {got} bytes, not {size}")
        ckpt["shards"]["path"] = path
    return ckpt

def load_checkpoint(where, before=None, whole=True):
    """(ckpt, path): the checkpoint at where, or the newest intact one in the folder where (before
    the step before, if given), or (None, None). whole: a sharded one's tensors are read too."""
    one = os.path.isfile(where) or re.fullmatch(r"ckpt_\d+", os.path.basename(os.path.normpath(where)))
    found = [(0, where)] if one else list_checkpoints(where)
    for step, path in reversed(found):
        if before is not None and step >= before:
            continue
        try:
            ckpt = check_intact(path)
            if whole and os.path.isdir(path):  # a folder of shards
                ckpt.update(read_shards(ckpt.pop("shards")))
            return ckpt, path
        except Exception as e:  # noqa: BLE001
            if isinstance(e, pickle.UnpicklingError):
                why = "it holds objects other than tensors and plain data, which could run code"
            else:
                why = str(e).split("\n")[0] or type(e).__name__
            if one:
                die(f"{path} is not a usable checkpoint ({why}); pass one written by {os.path.basename(__file__)}")
            print(f"warning: skipping checkpoint {path}, truncated or corrupt: {why}", file=sys.stderr)
    return None, None

def dcp_part(sd):
    """The part of a state dict that DCP writes: tensors. The optimizers' param groups go in state.pt."""
    return {k: {"state": sd[k]["state"]} if k == "optim" else sd[k]
            for k in ("model", "optim", "ema") if sd[k] is not None}

def read_shards(shards, into=None):
    """A sharded checkpoint's tensors: into `into`, this rank's shards of the live model (DCP
    reshards them), or else whole, in one process."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.default_planner import _EmptyStateDictLoadPlanner
    from torch.distributed.checkpoint.state_dict_loader import _load_state_dict
    # DCP's .metadata is a pickle: read it with an unpickler that builds only DCP's own classes
    with open(os.path.join(shards["path"], ".metadata"), "rb") as f:
        meta = MetadataUnpickler(f).load()
    for s in meta.storage_data.values():
        if s.relative_path != os.path.basename(s.relative_path) or s.transform_descriptors:
            raise ValueError("its .metadata names files outside its folder")
    reader = dcp.FileSystemReader(shards["path"])
    reader.read_metadata = lambda *args, **kw: meta
    sd = dcp_part(into) if into else {}
    planner = None if into else _EmptyStateDictLoadPlanner()  # the empty planner loads everything
    try:
        _load_state_dict(sd, storage_reader=reader, planner=planner, no_dist=not (into and dist.is_initialized()))
    except dcp.CheckpointException as e:  # it wraps each rank's error
        raise ValueError(next(iter(e.failures.values()))[0]) from None
    return {"ema": None, **sd, "optim": {**sd["optim"], "param_groups": shards["param_groups"]}}

class MetadataUnpickler(pickle.Unpickler):
    """Unpickles DCP's .metadata, building only the classes DCP writes there."""
    ALLOWED = {"torch.Size", "torch.serialization._get_layout", "pathlib.PosixPath", "pathlib.WindowsPath",
               "torch.distributed.checkpoint.filesystem._StorageInfo"} | {
        f"torch.distributed.checkpoint.metadata.{n}" for n in ("Metadata", "MetadataIndex", "StorageMeta",
            "TensorProperties", "TensorStorageMetadata", "ChunkStorageMetadata", "_MEM_FORMAT_ENCODING")}

    def find_class(self, module, name):
        is_dtype = module == "torch" and isinstance(vars(torch).get(name), torch.dtype)  # torch.float32, ...
        if f"{module}.{name}" in self.ALLOWED or is_dtype:
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"its .metadata asks for {module}.{name}, which DCP's metadata does not hold")

@contextlib.contextmanager
def exit_if_unreadable(path, fix):
    """Run the block; an error there reading the file at path (a crafted or foreign checkpoint)
    stops in one line that names the file and the fix, instead of a traceback."""
    try:
        yield
    except Exception as e:  # noqa: BLE001 - whatever a crafted file makes the reader raise
        die(f"{path}: {type(e).__name__}: {' '.join(str(e).split())[:200] or 'unreadable'}; {fix}")

# ---- signals, default data

class StopSignal:
    """SIGTERM/SIGINT: finish the step, save, exit 0; a second signal acts at once.

    The handler only sets a flag, and the loop asks after every step whether to stop. A scheduler
    gives a preempted job seconds (Kubernetes 30 by default, `timeout -k 5` five), so the flag is
    not left for the next log step. In one process it is host state: reading it costs nothing.
    Under torchrun each rank gets the signal at a different step, so the ranks agree through a
    tiny all-reduce of a CPU tensor (gloo): no device sync, and every rank stops after the same
    step, at most one step after the first rank got the signal."""

    def __enter__(self):
        self.received = None  # the signal's name
        self.group = None
        main = threading.current_thread() is threading.main_thread()  # signals reach only that thread
        self.old = {}
        if main:
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.old[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        signal.signal(signum, self.old[signum])  # the old handler again: a second signal acts at once

    def requested(self, world_size):
        """Whether any rank got a signal; every rank calls it after every step."""
        if world_size == 1:
            return self.received is not None
        if self.group is None:  # a CPU group beside NCCL's; made by every rank at the same step
            self.group = dist.new_group(backend="gloo")
        flag = torch.tensor([float(self.received is not None)])
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=self.group)
        return flag.item() > 0

    def preempted(self, step, out_dir):
        """What a run stopped by the signal says: its checkpoint is saved and --resume continues it."""
        return (f"stopped by {self.received or 'a signal to another rank'} at step {step}: checkpoint saved in "
                f"{out_dir}; run the same command with --resume to continue")

    def __exit__(self, *exc):
        for sig, handler in self.old.items():
            signal.signal(sig, handler)

def prepare_default_data(cfg, rank, world_size, command, what, *flags):
    """A first run with the default --data_dir and nothing in it: rank 0 prepares the demo's data
    with prepare_data.py (no network needed), and the other ranks wait for it."""
    theirs = cfg.data_dir != type(cfg).data_dir  # a data dir the user chose is theirs to prepare
    if theirs or os.path.exists(os.path.join(cfg.data_dir, "meta.json")):
        return
    if rank == 0:
        print(f"no data in {cfg.data_dir}: preparing {what} (no network needed)", flush=True)
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prepare_data.py")
        done = subprocess.run([sys.executable, script, command, *flags, f"--data_dir={cfg.data_dir}"])
        if done.returncode:
            die(f"preparing {what} failed (see above)")
    if world_size > 1:
        dist.barrier()
# === end shared ===

# -----------------------------------------------------------------------------
# Entry point

if __name__ == "__main__":
    main(parse_args(Config, sys.argv[1:]))
