"""
train_diffusion.py: a class-conditional diffusion transformer (DiT) on pixels, in one file.

Rectified flow predicting the clean image (logit-normal t; Euler or Heun), or DDPM epsilon
(cosine schedule, min-SNR, DDIM); adaLN-Zero, classifier-free guidance, an EMA of the weights.
Scored by the held-out denoising loss and, with a train_vit.py classifier, its accuracy on the
samples and the Frechet distance of its features.

  python train_diffusion.py            # CPU demo: upright shapes, 8 min of training, samples.png
  python train_vit.py && python train_diffusion.py --eval_classifier=out/vit  # scored samples
  python sample_diffusion.py --ckpt=out/diffusion --cfg_scale=3 --sampler=heun   # a grid from a checkpoint
  python prepare_data.py cifar10 && torchrun --nproc_per_node=8 train_diffusion.py --preset=cifar10
  python bench.py train_diffusion.py --preset=cifar10   # its speed, on random images
  python train_diffusion.py -h         # every flag, with its default
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
# trailing comment as its help. The defaults are the CPU demo, each measured side by side on two cores (BENCHMARKS.md,
# "Diffusion CPU demo"): upright shapes, since a small model blurs a shape seen at every angle into a disc; 8x8
# patches, 3.2x the steps of 4x4 in the same time; the network predicting the clean image, and timesteps shifted
# toward noise, each a large gain in how often a classifier recognises the samples; guidance 2.5, and 16 Euler steps,
# which draw samples as good as 32 in half the time; AdamW, since Muon was no better per second here; DiT's constant
# LR and no weight decay (Peebles & Xie 2023).
@dataclass
class Config:
    # data and output
    data_dir: str = "data/shapes_upright"  # images written by prepare_data.py; the default is generated on first use
    out_dir: str = "out/diffusion"  # where checkpoints, config.json, metrics.jsonl and sample grids go
    preset: str = ""  # a named set of defaults, cpu_demo, cifar10 or imagenet64; flags given explicitly override it
    num_classes: int = -1  # classes to condition on: -1 = the data's; 0 = none (an unconditional model)
    flip: Literal["auto", "true", "false"] = "auto"  # mirror half the images; auto: if the data's flip_ok says so
    # model
    image_size: int = 0  # side of the images in pixels; 0 takes the data's, any other value must equal it
    patch_size: int = 8  # side of a square patch in pixels; each patch becomes one token
    n_layer: int = 4  # number of transformer blocks
    n_head: int = 4  # attention heads; n_embd must split into heads of even width
    n_embd: int = 128  # token width
    mlp_ratio: float = 4.0  # the MLP's hidden width over n_embd
    qk_norm: bool = True  # RMSNorm on each head's queries and keys, which bounds the attention logits
    init_std: float = 0.02  # std of the hidden weights' truncated normal; adaLN and the output layer start at 0
    class_dropout: float = 0.1  # share of training labels replaced by "no label", which guidance needs
    # objective
    objective: Literal["flow", "ddpm"] = "flow"  # rectified flow, or DDPM's noise prediction on a cosine schedule
    t_mean: float = 0.8  # flow: t = sigmoid(N(t_mean, t_std^2)), logit-normal (SD3); above 0 leans to noise
    t_std: float = 0.8  # flow: the spread of the logit-normal t, see t_mean
    predict: Literal["x", "v"] = "x"  # flow: the network outputs the clean image (x) or the velocity (v)
    min_snr: float = 5.0  # ddpm: gamma of the min-SNR-gamma loss weight (Hang et al. 2023); 0 = plain MSE
    # sampling
    sampler: Literal["auto", "euler", "heun", "ddim"] = "auto"  # auto: euler for flow, ddim for ddpm
    sample_steps: int = 16  # steps from noise to image (heun: 2 model calls a step)
    cfg_scale: float = 2.5  # classifier-free guidance: 1 = plain conditional, 0 = unconditional
    guidance_interval: str = "0,1"  # LO,HI: guide only at LO < t <= HI (1 = noise), plain conditional elsewhere
    sample_seed: int = 0  # seeds the samples' noise, the same at every eval so the grids compare
    per_class: int = 8  # columns of the sample grid, one row per class
    # budget: max_steps, else epochs, else time_budget
    max_steps: int = 0  # optimizer steps to train; 0 = train for epochs or time_budget
    epochs: float = 0.0  # passes over the train split, when max_steps is 0; 0 = train for time_budget
    time_budget: float = 480.0  # seconds of training, evals and saves excluded, when max_steps and epochs are 0
    batch_size: int = 64  # images in a micro-batch on each rank
    grad_accum: int = 1  # micro-batches whose gradients add up to one optimizer step
    # optimizer and schedule
    lr: float = 2e-3  # peak learning rate of AdamW
    weight_decay: float = 0.0  # decoupled weight decay of the blocks' matrices (not adaLN's)
    beta1: float = 0.9  # AdamW's decay of the gradient's running mean (its momentum)
    beta2: float = 0.95  # AdamW's decay of the squared gradient's running mean
    grad_clip: float = 1.0  # clip the global gradient norm to this; 0 = off
    schedule: Literal["constant", "cosine"] = "constant"  # the LR after warmup: held, or a cosine decay
    warmup_steps: int = 100  # steps of linear warmup up to the peak LR
    final_lr_frac: float = 0.0  # cosine: the LR at the end of the decay, as a fraction of the peak
    ema: float = 0.999  # a moving average of the weights, which samples come from: its decay; 0 = none at all
    ema_std: float = 0.02  # that average a power-function profile (EDM2) this wide, relative to the run; 0: decay
    phema_every: int = 0  # steps between snapshots of two power-function EMAs, for sample_diffusion --ema_std
    # eval, logging, checkpoints
    eval_every: int = 1000  # steps between evals; 0 = only at the end
    eval_images: int = 250  # val images in the held-out denoising loss; 0 = all
    eval_samples: int = 200  # samples drawn and scored at each periodic eval
    final_samples: int = 500  # samples drawn and scored at the final eval
    eval_classifier: str = ""  # a train_vit.py checkpoint on this data, to score the samples with
    fid_weights: str = ""  # clean-fid's Inception TorchScript file, to also score FID; empty = no FID
    log_every: int = 50  # steps between log lines
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
    seed: int = 1337  # seeds the init, the data order, the noise and the timesteps
    kernels: Literal["auto", "triton", "torch"] = "auto"  # attention and norm kernels; auto: the faster per op
    loader: Literal["auto", "device", "host"] = "auto"  # images held on the device, or read from disk; auto: by size

PRESETS = {
    # the defaults: 1.3M parameters, 480 s on 2 cores, on upright shapes (rotated ones blur: BENCHMARKS.md)
    "cpu_demo": {},
    # one GPU or a node: DiT-S/2 (Peebles & Xie 2023) on 32x32 images; not yet measured
    "cifar10": dict(
        data_dir="data/cifar10",
        out_dir="out/diffusion_cifar10",
        # DiT-S/2: 12 blocks of width 384 in 6 heads, on 2x2 patches (256 tokens)
        patch_size=2,
        n_layer=12,
        n_head=6,
        n_embd=384,
        # a 2x2 patch holds 12 numbers, far fewer than a token's width: the network can predict the velocity
        # itself (Li & He 2025). t is SD3's logit-normal(0, 1).
        predict="v",
        t_mean=0.0,
        t_std=1.0,
        time_budget=0.0,
        epochs=400,
        batch_size=256,  # DiT's
        lr=3e-4,
        warmup_steps=1000,
        ema=0.9999,  # DiT's, a fixed decay
        ema_std=0.0,
        eval_every=10000,
        eval_images=10000,
        eval_samples=1000,
        final_samples=10000,  # FID is biased upward at few samples (Chong & Forsyth 2020)
        sample_steps=50,
        cfg_scale=1.5,  # DiT's guidance for its best FID
    ),
    # ImageNet at 64x64 (prepare_data.py imagefolder --image_size=64, README), the benchmark of pixel-space
    # diffusion (improved DDPM; EDM): DiT-B/4, 130M parameters, on 4x4 patches (256 tokens), with DiT's batch of
    # 256, learning rate, EMA and 400k steps. Not yet measured. The train split (15.7 GB) is read from its file a
    # batch ahead where it would take over a quarter of the device's free memory (--loader=auto).
    "imagenet64": dict(
        data_dir="data/imagenet64",
        out_dir="out/diffusion_imagenet64",
        patch_size=4,
        n_layer=12,
        n_head=12,
        n_embd=768,
        predict="v",  # a 4x4 patch holds 48 numbers, far fewer than a token's width, as in cifar10's
        t_mean=0.0,
        t_std=1.0,
        time_budget=0.0,
        epochs=80,  # 400k steps of 256 images
        batch_size=256,  # a rank's: under torchrun, divide it by the ranks for DiT's step
        lr=1e-4,
        warmup_steps=1000,
        ema=0.9999,
        ema_std=0.0,
        eval_every=20000,
        eval_images=10000,
        eval_samples=1000,
        final_samples=10000,
        sample_steps=50,
        cfg_scale=1.5
    ),
}
# the fields that shape the weights and their meaning: a resumed run must match its checkpoint's
ARCH_FIELDS = ("patch_size", "n_layer", "n_head", "n_embd", "mlp_ratio", "qk_norm", "objective", "predict")
# A trainer trains (STYLE.md: one job per file). Sampling from a finished checkpoint is
# sample_diffusion.py's job; its old flags here stop in one line that names the new command.
MOVED = {"sample": "python sample_diffusion.py --ckpt=out/diffusion",
         "ckpt": "python sample_diffusion.py --ckpt=PATH",
         "sample_out": "python sample_diffusion.py --ckpt=out/diffusion --out=PATH.png",
         "benchmark": "python bench.py train_diffusion.py --preset=cifar10 (any flag of this script's)",
         "bench_steps": "python bench.py train_diffusion.py --steps=N",
         "profile": "python bench.py train_diffusion.py --profile"}

# -----------------------------------------------------------------------------
# Model
# A diffusion transformer (DiT, Peebles & Xie 2023): the ViT's recipe (patches as tokens, pre-norm blocks of
# attention and an MLP) applied to a noisy image, with the timestep and the class entering every block through
# adaLN-Zero (Block). DiT works on a VAE's latents of 256x256 images; these images are 32x32, small enough to take
# as pixels, which is what lets the network predict the clean image itself (DiT.forward, Li & He 2025).

def timestep_embedding(t, dim=256):
    """Sinusoidal features (B, dim), fp32, of t (B,) in [0, 1], scaled to 0..1000."""
    # The Transformer's sinusoids (Vaswani et al. 2017) as DDPM and DiT embed their step: cos and sin of t at
    # frequencies from 1 down to 1/10000, which an MLP then reads. Their range was set for integer steps up to
    # 1000, so t in [0, 1] is scaled to it; unscaled, even the fastest would turn by at most a radian over all t.
    half = dim // 2
    k = torch.arange(half, device=t.device, dtype=torch.float32)  # (half,)
    freqs = torch.exp(-math.log(10000) * k / half)  # 1 down to 1/10000
    args = 1000 * t.float()[:, None] * freqs[None]  # (B, half)
    return torch.cat((torch.cos(args), torch.sin(args)), dim=-1)

def modulate(x, shift, scale):
    """adaLN: shift and scale the normalised x (B, T, d) by per-sample (B, 1, d) vectors."""
    return torch.addcmul(shift, x, 1 + scale)  # shift + x * (1 + scale), one pass over x

class Attention(nn.Module):
    """Multi-head self-attention of every patch to every patch, with optional QK-norm."""

    def __init__(self, cfg):
        super().__init__()
        d = cfg.n_embd
        self.hd = d // cfg.n_head
        self.qk_norm = cfg.qk_norm
        self.qkv = nn.Linear(d, 3 * d, bias=False)
        self.proj = nn.Linear(d, d, bias=False)
        if cfg.qk_norm:
            # the gains of RMSNorm on queries and keys (Dehghani et al. 2023): bounded attention logits
            self.q_norm = nn.Parameter(torch.ones(self.hd))
            self.k_norm = nn.Parameter(torch.ones(self.hd))

    def forward(self, x):
        """x (B, T, d) -> (B, T, d)."""
        B, T, C = x.shape
        qkv = self.qkv(x).view(B, T, 3, -1, self.hd)  # (B, T, 3, nh, hd)
        q, k, v = qkv.permute(2, 0, 3, 1, 4)  # each (B, nh, T, hd)
        if self.qk_norm:
            q = kernels.rms_norm(q, self.q_norm)
            k = kernels.rms_norm(k, self.k_norm)
        y = kernels.attention(q, k, v, causal=False)  # (B, nh, T, hd): an image has no order
        y = y.transpose(1, 2).reshape(B, T, C)  # the heads side by side again
        return self.proj(y)

class Block(nn.Module):
    """A DiT block, adaLN-Zero (Peebles & Xie 2023): c sets each branch's shift, scale and gate (0 at first)."""
    # The conditioning c (timestep and class, (B, d)) enters every block through its norms: a linear layer of c
    # gives each branch a shift and a scale of its normalised input, in place of a norm's learned gain, and a gate
    # on its output. DiT found this beat cross-attention to c and c as an extra token, at less compute. "Zero": that
    # layer starts at 0, so every gate is 0 and every block starts as the identity (as Goyal et al. 2017 zero the
    # last norm's gain of each ResNet block); each branch grows in as it learns.

    def __init__(self, cfg):
        super().__init__()
        d = cfg.n_embd
        hidden = int(cfg.mlp_ratio * d)
        self.attn = Attention(cfg)
        self.fc = nn.Linear(d, hidden, bias=False)
        self.proj = nn.Linear(hidden, d, bias=False)
        self.ada = nn.Linear(d, 6 * d)

    def forward(self, x, c):
        """x (B, T, d), the conditioning c (B, d) -> (B, T, d)."""
        ada = self.ada(F.silu(c))[:, None]  # (B, 1, 6d): this block's six vectors of the conditioning
        shift1, scale1, gate1, shift2, scale2, gate2 = ada.chunk(6, dim=-1)  # each (B, 1, d), the same for every token
        h = modulate(kernels.rms_norm(x), shift1, scale1)  # (B, T, d), a norm without a gain of its own
        x = torch.addcmul(x, gate1, self.attn(h))  # x + gate1 * attn(h)
        h = modulate(kernels.rms_norm(x), shift2, scale2)
        # GELU as its definition, x Phi(x): DiT's tanh approximation costs 2.4x as much on an AVX2 CPU
        h = F.gelu(self.fc(h))  # (B, T, hidden)
        return torch.addcmul(x, gate2, self.proj(h))  # x + gate2 * proj(h)

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

class DiT(nn.Module):
    """A diffusion transformer on pixel patches: a ViT whose blocks are conditioned on t and the class."""

    def __init__(self, cfg, image_size, channels, num_classes):
        super().__init__()
        self.cfg = cfg
        p = cfg.patch_size
        d = cfg.n_embd
        self.grid = image_size // p
        # patches in as the ViT's are (a stride-p convolution, as one matmul), with fixed 2-D sin-cos positions
        self.patch = nn.Linear(p * p * channels, d)
        self.register_buffer("pos", torch.zeros(self.grid ** 2, d), persistent=False)  # (N, d), set in init_weights
        # t's 256 sinusoids to a token's width, through DiT's two-layer MLP
        self.t_mlp = nn.Sequential(
            nn.Linear(256, d),
            nn.SiLU(),
            nn.Linear(d, d),
        )
        # A row per class and one more, K, for "no label": training drops labels to K at rate class_dropout, so one
        # network learns both the conditional and the unconditional model that guidance combines. No rows at all
        # if unconditional.
        self.y_emb = nn.Embedding(num_classes + 1, d) if num_classes else None
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layer))
        # the output layer: adaLN's shift and scale, then a linear map of each token back to a p x p patch
        self.final_ada = nn.Linear(d, 2 * d)
        self.out = nn.Linear(d, p * p * channels)

    @torch.no_grad()
    def init_weights(self):
        """Initialise it in place (it was built on the meta device)."""
        s = self.cfg.init_std
        for name, p in self.named_parameters():
            if "ada." in name or name.startswith("out."):
                # adaLN-Zero: every gate 0, so each block starts as the identity, and the output layer 0, so the
                # untrained network outputs exactly 0
                nn.init.zeros_(p)
            elif p.ndim == 1:  # biases 0, norm gains 1
                nn.init.constant_(p, 0.0 if name.endswith("bias") else 1.0)
            else:
                nn.init.trunc_normal_(p, std=s, a=-2 * s, b=2 * s)  # no weight beyond 2 std
        self.pos.copy_(sincos_2d(self.grid, self.grid, self.cfg.n_embd))

    def forward(self, x_t, t, y=None):
        """x_t (B, H, W, C) noisy, t (B,) in [0, 1], y (B,) labels or None -> (B, H, W, C)."""
        B, H, W, C = x_t.shape
        p = self.cfg.patch_size
        g = self.grid
        # cut the image into a g x g grid of p x p patches, each flattened to one row of pixels
        x = x_t.view(B, g, p, g, p, C)  # (B, grid row, row in patch, grid column, column in patch, C)
        x = x.permute(0, 1, 3, 2, 4, 5)  # (B, g, g, p, p, C)
        x = x.reshape(B, g * g, -1)  # (B, N, p*p*C)
        x = self.patch(x) + self.pos.to(x.dtype)  # (B, N, d)
        c = self.t_mlp(timestep_embedding(t))  # (B, d): every block's conditioning
        if self.y_emb is not None:
            c = c + self.y_emb(y)
        for block in self.blocks:
            x = block(x, c)
        ada = self.final_ada(F.silu(c))[:, None]  # (B, 1, 2d)
        shift, scale = ada.chunk(2, dim=-1)  # each (B, 1, d)
        x = modulate(kernels.rms_norm(x), shift, scale)
        x = self.out(x)  # (B, N, p*p*C)
        # the patches back into an image: the inverse of the cut above
        x = x.view(B, g, g, p, p, C)
        x = x.permute(0, 1, 3, 2, 4, 5)  # (B, g, p, g, p, C)
        x = x.reshape(B, H, W, C)
        if self.cfg.predict == "x" and self.cfg.objective == "flow":
            # x-prediction (Li & He 2025): a clean image lies near a low-dimensional manifold that a
            # width-d token carries even if p*p*C > d (noise cannot); the loss gets v = (x_t - x_0) / t
            t_safe = t.clamp(min=0.05).view(-1, 1, 1, 1)  # near t = 0 the division would blow up the error
            x = (x_t - x) / t_safe.to(x.dtype)
        return x

    def flops_per_image(self):
        """Training FLOPs per image: 6 per matmul weight per token (adaLN's: per image), plus attention."""
        # A weight costs 2 FLOPs per token forward and 4 backward; the patch embedding makes no grad for the pixels:
        # 4 a weight. The conditioning (t_mlp, every adaLN) runs once an image, not once a token. FlopCounterMode
        # counts 1.7% more at cifar10 (tests/test_compile.py): the scores a flash backward recomputes.
        T = self.grid ** 2
        once = 0  # matrix weights used once an image: the conditioning
        n = 0  # matrix weights used once a token: attention, MLPs and the output layer
        for k, p in self.named_parameters():
            if p.ndim != 2:  # biases and norm gains: a few FLOPs, not counted
                continue
            if "ada." in k or k.startswith("t_mlp."):
                once += p.numel()
            elif k.startswith(("blocks.", "out.")):
                n += p.numel()
        attention = 12 * self.cfg.n_layer * self.cfg.n_embd * T  # scores and their mix of the values
        per_token = 6 * n + 4 * self.patch.weight.numel() + attention
        return T * per_token + 6 * once

def build_model(cfg, image_size, channels, num_classes, device):
    """Build on the meta device, then initialise under cfg.seed."""
    # shapes without memory first, so nothing is initialised twice; every rank draws the same weights from cfg.seed
    with torch.device("meta"):
        model = DiT(cfg, image_size, channels, num_classes)
    model.to_empty(device=device)
    torch.manual_seed(cfg.seed)
    model.init_weights()
    return model

# -----------------------------------------------------------------------------
# Diffusion: noising, training target and samplers
# Both objectives train a network to undo a mix of the data with Gaussian noise e, and sample by starting from pure
# noise and following the network back to the data. Rectified flow (Liu et al. 2022), or flow matching (Lipman et
# al. 2022), mixes along a straight line: for one image and its noise the velocity v is the same at every t, the
# target is simple, and an ODE solver follows it in few steps. DDPM (Ho et al. 2020) mixes on a variance-preserving
# path set by a noise schedule; it is the baseline most of the literature starts from, kept here to compare.
# t in [0, 1] for both objectives: t = 0 the data, t = 1 pure noise.
# flow: x_t = (1 - t) x_0 + t e; the model predicts v = e - x_0 (or x_0, see DiT.forward)
# ddpm: x_t = sqrt(ab) x_0 + sqrt(1 - ab) e at step t * 1000; the model predicts e

T_DDPM = 1000

def cosine_alpha_bar(T=T_DDPM, s=0.008):
    """alpha_bar at steps 0..T, betas clipped at 0.999 (Nichol & Dhariwal 2021, eq. 17)."""
    # alpha_bar is the share of the data's variance left at a step. Ho et al.'s linear betas drive it near 0 well
    # before the last step on small images, which wastes those steps; the cosine falls slowly at both ends. The
    # offset s keeps the first betas from being tiny, and the clip avoids a singular last step (alpha_bar = 0).
    steps = torch.arange(T + 1, dtype=torch.float64) / T  # (T + 1,): t of each step
    f = torch.cos((steps + s) / (1 + s) * math.pi / 2) ** 2
    beta = (1 - f[1:] / f[:-1]).clamp(max=0.999)  # (T,)
    alpha_bar = torch.cumprod(1 - beta, 0)  # (T,): steps 1..T
    one = torch.ones(1, dtype=torch.float64)  # step 0 is the data: alpha_bar 1
    return torch.cat((one, alpha_bar))

def sample_t(B, cfg, gen):
    """B training timesteps: logit-normal for flow (Esser et al. 2024), uniform for ddpm."""
    # Flow: t = sigmoid(n), n ~ N(t_mean, t_std^2) (SD3). Near t = 0 or 1 the velocity is easy to predict (the
    # image or the noise is almost in plain view); the logit-normal spends the steps in between. t_mean > 0 leans
    # toward noise, where an image's layout is decided.
    if cfg.objective == "flow":
        n = torch.randn(B, generator=gen, device=gen.device)  # (B,)
        return torch.sigmoid(cfg.t_mean + cfg.t_std * n)
    # ddpm: a step in 1..T, uniform as in Ho et al., as a fraction of T
    steps = torch.randint(1, T_DDPM + 1, (B,), generator=gen, device=gen.device)  # (B,)
    return steps.float() / T_DDPM

def corrupt(x0, noise, t, cfg, alpha_bar):
    """(x_t, the target, loss weight (B,) or None) of clean x0 (B, H, W, C) at t (B,)."""
    if cfg.objective == "flow":
        tb = t.view(-1, 1, 1, 1)
        x_t = (1 - tb) * x0 + tb * noise  # the straight line from the image (t = 0) to the noise (t = 1)
        return x_t, noise - x0, None  # the target: its velocity dx_t/dt
    steps = (t * T_DDPM).round().long()  # (B,) in 1..T
    ab = alpha_bar.to(x0.device)[steps].float()  # (B,)
    a = ab.view(-1, 1, 1, 1)
    x_t = a.sqrt() * x0 + (1 - a).sqrt() * noise  # the data's share of the variance is ab, the noise's 1 - ab
    if not cfg.min_snr:
        return x_t, noise, None
    # min-SNR-gamma (Hang et al. 2023). SNR = ab / (1 - ab) is the signal-to-noise ratio of x_t; an error in e is
    # sqrt(SNR) times the error in x_0 it implies, so plain MSE on e weighs each step's x_0 error by SNR, and the
    # nearly clean steps dominate. min(SNR, gamma) / SNR caps that weight at gamma.
    snr = ab / (1 - ab)
    return x_t, noise, snr.clamp(max=cfg.min_snr) / snr

def guided(model, x, t, y, scale, null, interval=(0.0, 1.0), guide=None):
    """The model's output at x (B, ...), t, guided where t is in the interval (LO, HI] and there is something
    to guide by: the unconditional model (label null), or with guide, a weaker model of the same task."""
    # Classifier-free guidance: a model trained with some labels dropped gives both the conditional output and the
    # unconditional one (label null). Going past the conditional, away from the unconditional, by scale sharpens
    # each sample toward its class at some cost in variety; scale 1 is the plain conditional model.
    tt = torch.full((x.size(0),), float(t), device=x.device)  # (B,)
    # A guidance interval (Kynkaanniemi et al. 2024): at high noise guidance pulls every sample of a class toward
    # the same few layouts, and near the data it only sharpens what is decided; guiding in the middle alone keeps
    # the variety. Outside it a step is the plain conditional model, at one forward instead of two.
    lo, hi = interval
    if scale == 1 or not lo < t <= hi or (y is None and guide is None):
        return model(x, tt, y).float()
    if guide is not None:
        # Autoguidance (Karras et al. 2024): guide by a worse model of the same task (an early checkpoint of the
        # same run, say). Its errors are of the kind the good model makes more mildly, so stepping away from them
        # sharpens without the unconditional model's pull toward fewer modes.
        good = model(x, tt, y).float()
        bad = guide(x, tt, y).float()
        return bad + scale * (good - bad)
    # both outputs from one forward of twice the batch: each image once with its label, once with the null label
    dropped = torch.full_like(y, null)  # (B,): every label "no label"
    yy = torch.cat((y, dropped))  # (2B,)
    out = model(torch.cat((x, x)), torch.cat((tt, tt)), yy).float()  # (2B, H, W, C)
    cond, uncond = out.chunk(2)
    return uncond + scale * (cond - uncond)

def parse_interval(text):
    """(LO, HI) of a --guidance_interval=LO,HI, or a one-line stop that names the fix."""
    try:
        lo, hi = (float(v) for v in text.split(","))
    except ValueError:
        lo = hi = -1.0
    if not 0 <= lo < hi <= 1:
        die(f"--guidance_interval={text}: need LO,HI with 0 <= LO < HI <= 1 (t: 1 is noise, 0 the data), "
            "such as 0,1 (every step)")
    return lo, hi

@torch.no_grad()
def sample(model, noise, y, cfg, alpha_bar, scale=1.0, null=0, guide=None):
    """Images (B, H, W, C), fp32, integrated from noise (t = 1) to t = 0 by model(x, t, y), guided as
    guided() says."""
    x = noise.float()
    how = (scale, null, parse_interval(cfg.guidance_interval), guide)  # guided()'s settings
    if cfg.objective == "flow":
        # The ODE dx/dt = v from t = 1 to 0, in equal steps (b < a: toward the data). Euler takes the slope at the
        # step's start; Heun (Karras et al. 2022) makes that an Euler trial and then steps along the mean of the
        # slopes at both ends: second order, at two model calls a step.
        ts = torch.linspace(1, 0, cfg.sample_steps + 1).tolist()
        for a, b in zip(ts[:-1], ts[1:]):
            v = guided(model, x, a, y, *how)
            # the last step stays Euler, as in Karras et al.: its trial point is t = 0, where x-prediction's
            # velocity divides by t
            if cfg.sampler == "heun" and b > 0:
                x_trial = x + (b - a) * v
                v = 0.5 * (v + guided(model, x_trial, b, y, *how))
            x = x + (b - a) * v
        return x
    # ddpm: deterministic DDIM (Song et al. 2021) on an even subsequence of the T steps. Each step estimates the
    # clean image and the noise from the model's e, then jumps to step j along the same pair.
    # the schedule's float64 square roots, rounded once to the sampler's fp32
    ab = alpha_bar.to(x.device)
    signal = ab.sqrt().float()  # (T + 1,): x_t = signal x_0 + sigma e at each step
    sigma = (1 - ab).sqrt().float()
    steps = torch.linspace(T_DDPM, 0, cfg.sample_steps + 1)  # T down to 0 in equal strides
    steps = steps.round().long().tolist()
    for i, j in zip(steps[:-1], steps[1:]):
        eps = guided(model, x, i / T_DDPM, y, *how)
        x0 = (x - sigma[i] * eps) / signal[i]  # the clean image that this noise implies
        x0 = x0.clamp(-1, 1)  # kept in the data's range
        eps = (x - signal[i] * x0) / sigma[i]  # the noise that fits the clamped x0
        x = signal[j] * x0 + sigma[j] * eps
    return x

# -----------------------------------------------------------------------------
# Data
# The images and their loader are train_vit.py's, in the images fence below: both splits as uint8, held whole on
# the device when they fit (a step then never waits for the disk), else read from their files a batch ahead, in an
# order seeded per epoch, which a checkpoint records so a resume goes on with the same batches. Here they only
# change scale.

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

def to_model(x):
    """uint8 pixels (B, H, W, C) -> floats in [-1, 1], the scale of the noise."""
    # centred, and spread about as wide as the unit Gaussian noise they are mixed with (Ho et al. 2020)
    return x.float() / 127.5 - 1

# -----------------------------------------------------------------------------
# Optimizer and schedule

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

# The post-hoc EMA (Karras et al. 2024, EDM2, section 3). How long an average of the weights samples best is found
# by measuring samples, after training; a running EMA fixes it before the run. A power-function EMA weighs the
# weights of step tau by tau^gamma up to the step t it has reached: its profile stretches with the run, so its
# width relative to t (sigma_rel, the std of the profile over t) is the same at every step. Two of them,
# snapshotted every --phema_every steps, hold enough to rebuild any other width of the same kind by least squares
# (sample_diffusion.py --ema_std); EDM2 keeps these two.
PHEMA_STDS = (0.05, 0.10)

def std_to_gamma(std):
    """The exponent gamma of the power-function profile whose relative width is std (EDM2, eq. 3)."""
    # a profile tau^gamma on [0, t] has sigma_rel^2 = (gamma + 1) / ((gamma + 2)^2 (gamma + 3)): gamma is the
    # largest real root of the cubic (gamma + 2)^2 (gamma + 3) sigma_rel^2 - (gamma + 1) = 0
    s = 1 / std ** 2
    roots = np.roots([1, 7, 16 - s, 12 - s])
    return float(roots.real[abs(roots.imag) < 1e-9].max())

class PowerEMA(EMA):
    """An EMA whose decay at update t is (1 - 1/t)^(gamma + 1): the weights after update tau count
    (tau^(gamma+1) - (tau-1)^(gamma+1)) / t^(gamma+1), the profile tau^gamma over each step."""

    def __init__(self, params, std, model=None):
        super().__init__(params, 0.0, model)
        self.std = std
        self.gamma = std_to_gamma(std)

    @torch.no_grad()
    def update(self):
        self.t += 1
        decay = (1 - 1 / self.t) ** (self.gamma + 1)  # 0 at the first update: the average starts as the weights
        live = [p.detach() for p in self.params]
        torch._foreach_lerp_(self.shadow, live, 1 - decay)

def phema_state(phemas, raw):
    """The power-function EMAs as plain data: {std, t, weights {name: tensor on the CPU}} each."""
    names = [name for name, _ in raw.named_parameters()]
    return [{"std": e.std, "t": e.t, "weights": {k: s.detach().cpu().clone() for k, s in zip(names, e.shadow)}}
            for e in phemas]

def load_phema(phemas, ckpt, raw):
    """Set the power-function EMAs from the phema_state() of a checkpoint."""
    if not phemas:  # (a checkpoint from before them has none)
        return
    names = [name for name, _ in raw.named_parameters()]
    for e, s in zip(phemas, ckpt["phema"], strict=True):
        for shadow, k in zip(e.shadow, names):
            shadow.copy_(s["weights"][k])
        e.t = int(s["t"])

def build_emas(cfg, raw, ckpt, world_size):
    """(the evals' EMA or None, the post-hoc EMA's profiles or []) of the weights of raw."""
    # the evals' EMA: a power-function profile of relative width ema_std, else a fixed decay
    ema = None
    if cfg.ema and cfg.ema_std:
        ema = PowerEMA(raw.parameters(), cfg.ema_std, raw)
    elif cfg.ema:
        ema = EMA(raw.parameters(), cfg.ema, raw)
    phemas = []  # the post-hoc EMA's two profiles, snapshotted every phema_every steps
    if cfg.phema_every:
        phemas = [PowerEMA(raw.parameters(), std, raw) for std in PHEMA_STDS]
    if phemas and world_size > 1 and cfg.parallel == "fsdp":
        die("--phema_every snapshots whole weights, which --parallel=fsdp shards; use --parallel=ddp or 0")
    if not ckpt:
        return ema, phemas
    # a resume goes on with the EMAs the run began with: begun later, a profile would miss the run's start
    theirs = ckpt["config"].get("ema_std", 0.0)  # 0 before the option existed
    if theirs != cfg.ema_std:
        die(f"--resume: the run in {cfg.out_dir} was made with --ema_std={theirs:g}; pass the same, or use a new "
            "--out_dir")
    if bool(ckpt.get("phema")) != bool(phemas):
        die(f"--resume: the run in {cfg.out_dir} was made with{'out' if phemas else ''} --phema_every; pass the "
            "same, or use a new --out_dir")
    return ema, phemas

def write_snapshot_file(out_dir, step, state):
    """out_dir/phema/phema_STEP.pt: the power-function EMAs at this step, written whole, then renamed."""
    folder = os.path.join(out_dir, "phema")
    os.makedirs(folder, exist_ok=True)
    path = os.path.join(folder, f"phema_{step:07d}.pt")
    with open(f"{path}.tmp", "wb") as f:
        torch.save({"step": step, "profiles": state}, f)
    os.replace(f"{path}.tmp", path)

def write_snapshot(out_dir, step, state):
    """write_snapshot_file(), where a failed write warns, and training goes on."""
    side_path("writing the post-hoc EMA's snapshot", write_snapshot_file, out_dir, step, state)

def build_optimizers(cfg, raw):
    """[AdamW], with weight decay on the blocks' matrices only (not adaLN's)."""
    # AdamW alone: Muon on the blocks' matrices was no better per second on the CPU demo (BENCHMARKS.md). Decay,
    # if any (DiT uses none), goes to the attention and MLP matrices. Not to adaLN's, which start at 0 and must
    # grow to carry t and the class; not to embeddings, norm gains or biases.
    decay, rest = [], []
    for name, p in raw.named_parameters():
        if p.ndim == 2 and name.startswith("blocks.") and "ada." not in name:
            decay.append(p)
        else:
            rest.append(p)
    groups = [
        dict(params=decay, weight_decay=cfg.weight_decay),
        dict(params=rest, weight_decay=0.0),
    ]
    # the loop sets the LR of both groups every step, cfg.lr times lr_mult
    opt = AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2))
    return [opt]  # a list, as the other trainers' (the checkpoint functions take one)

def lr_mult(cfg, step, progress):
    """Linear warmup, then cosine or no decay over progress in [0, 1]."""
    # Warmup: Adam's first updates divide by second moments estimated from a handful of gradients, and are too
    # large at the peak LR (Liu et al. 2020). progress is steps / max_steps, or training seconds / time_budget.
    # DiT holds its LR constant; cosine decay (Loshchilov & Hutter 2017) did no better on the CPU demo.
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    if cfg.schedule == "constant":
        return warm
    p = min(max(progress, 0.0), 1.0)
    f = cfg.final_lr_frac
    cosine = 1 + math.cos(math.pi * p)  # from 2 down to 0
    return warm * (f + (1 - f) * 0.5 * cosine)  # from 1 down to f

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
# Quality: the held-out denoising loss, and samples scored by a classifier

@torch.no_grad()
def denoising_loss(model, x_all, y_all, K, cfg, alpha_bar, rank, world_size, ctx):
    """(mean, per-t) error on cfg.eval_images val images (0: all) at 8 fixed t and noise."""
    # The training loss draws t and the noise at random, so it jumps from step to step. Here both are fixed: the
    # midpoints of 8 equal bins of t and one noise per image from seed 0, so any two evals, of any two runs on this
    # data, compare. The loss per t shows where along the path the model is weak.
    model.eval()
    B = cfg.batch_size
    n = min(cfg.eval_images or len(y_all), len(y_all))
    ts = [(k + 0.5) / 8 for k in range(8)]  # 1/16, 3/16, ..., 15/16
    sums = torch.zeros(8, device=y_all.device, dtype=torch.float64)
    g = torch.Generator().manual_seed(0)
    noise_all = torch.randn((n, *x_all.shape[1:]), generator=g)  # (n, H, W, C)
    # every rank runs as many forwards, since FSDP gathers each block's weights with all ranks together
    for it in range(math.ceil(n / (B * world_size))):
        i = (it * world_size + rank) * B
        j = min(i + B, n)
        w = 1.0
        if i >= n:  # this rank is past the end: a forward of one image, weighed 0
            i, j, w = 0, 1, 0.0
        x0 = to_model(x_all[i:j].to(y_all.device, non_blocking=True))  # from the host under --loader=host
        noise = noise_all[i:j].to(x0.device)
        y = y_all[i:j] if K else None
        for k, t in enumerate(ts):
            tt = torch.full((j - i,), t, device=x0.device)
            x_t, target, _ = corrupt(x0, noise, tt, cfg, alpha_bar)
            with ctx:
                out = model(x_t, tt, y).float()
            mse = (out - target).square().mean((1, 2, 3))  # (b,): each image's
            sums[k] += w * mse.sum().double()
    model.train()
    per_t = (all_mean(sums, world_size) * world_size / n).tolist()
    return sum(per_t) / len(per_t), per_t

@torch.no_grad()
def draw_samples(model, n, shape, K, cfg, alpha_bar, B, rank, world_size, ctx, guide=None):
    """n uint8 samples (n, H, W, C) on every rank, sample i of class i % K (K = 0: none); guide: see guided()."""
    # noise from cfg.sample_seed alone, the same at every eval, so the grids of a run compare; each rank draws an
    # equal share (as many forwards), and all gather the whole set
    share = math.ceil(n / world_size)
    g = torch.Generator().manual_seed(cfg.sample_seed)
    noise = torch.randn(share * world_size, *shape, generator=g)  # on the CPU: the same numbers on any device
    device = next(model.parameters()).device
    model.eval()
    if guide is not None:
        guide.eval()
    out = []
    for i in range(rank * share, (rank + 1) * share, B):
        j = min(i + B, (rank + 1) * share)
        # sample i is of class i % K: every class gets as many, and the grid's rows are the classes
        y = torch.arange(i, j, device=device) % K if K else None
        with ctx:  # the model's matmuls autocast; the sampler's steps stay fp32
            x = sample(model, noise[i:j].to(device), y, cfg, alpha_bar, cfg.cfg_scale, K, guide)
        x = ((x + 1) * 127.5).round().clamp(0, 255)  # back from [-1, 1] to pixels
        out.append(x.to(torch.uint8))  # as a PNG stores them
    model.train()
    mine = torch.cat(out)
    # every rank ends with the whole set, in the order of the labels
    if world_size > 1:
        parts = [torch.empty_like(mine) for _ in range(world_size)]
        dist.all_gather(parts, mine)
        mine = torch.cat(parts)
    return mine[:n]

def frechet_distance(a, b):
    """Frechet distance of Gaussians fitted to features a (n, d) and b (m, d), as FID's
    (Heusel et al. 2017): |mu_a - mu_b|^2 + tr(S_a + S_b - 2 (S_a S_b)^1/2), float64."""
    # FID fits a Gaussian to a network's features of real images and one to those of samples, and measures how far
    # apart they are: the means, and the covariances through the trace term. S_a S_b is not symmetric, but it is
    # similar to S_a^1/2 S_b S_a^1/2, which is: the same eigenvalues, found stably by eigvalsh.
    a = a.double()
    b = b.double()
    sa = torch.cov(a.T)  # (d, d)
    sb = torch.cov(b.T)
    w, V = torch.linalg.eigh(sa)
    ra = V @ torch.diag(w.clamp(min=0).sqrt()) @ V.T  # S_a^1/2
    # the eigenvalues of S_a S_b; rounding can make tiny ones negative
    lam = torch.linalg.eigvalsh(ra @ sb @ ra).clamp(min=0)  # (d,)
    cross = lam.sqrt().sum()  # tr (S_a S_b)^1/2
    means = (a.mean(0) - b.mean(0)).square().sum()
    return (means + sa.trace() + sb.trace() - 2 * cross).item()

class Judge:
    """Scores samples by a train_vit.py classifier of their data: accuracy, FD-ViT, FID."""
    # Offline, with no Inception weights to download, the judge is a ViT trained on the same data: how often it
    # recognises the class a sample was drawn for, and FID's distance in its own feature space (FD-ViT), which
    # compares only runs scored by the same classifier. With --fid_weights, FID proper on Inception's features.

    def __init__(self, path, meta, fid_weights, device, val_x):
        import train_vit as tv  # only this metric needs the classifier's code
        ckpt, where = load_checkpoint(path)  # (None, None) if path holds no checkpoint; main checked that it exists
        with exit_if_unreadable(where or path, "pass a checkpoint written by train_vit.py"):
            if ckpt is None or "pool" not in ckpt["config"]:  # a ViT's pooling: train_vit.py's
                die(f"--eval_classifier={path}: no complete train_vit.py checkpoint there; train one")
            m = ckpt["data_meta"]
            if any(m[k] != meta[k] for k in ("classes", "image_size", "channels")):
                die(f"--eval_classifier={path}: trained on other data ({m['num_classes']} classes of "
                    f"{m['image_size']}); train it with train_vit.py on this --data_dir")
            # build it from the fields of its config that train_vit.py has today; flags it has dropped are left out
            known = {k: v for k, v in ckpt["config"].items() if k in tv.Config.__dataclass_fields__}
            self.clf = tv.build_model(tv.Config(**known), m, device).eval()
            self.clf.load_state_dict(ckpt["ema"] or ckpt["model"])
        self.inception = None
        if fid_weights:
            with exit_if_unreadable(fid_weights, "pass clean-fid's Inception TorchScript (inception-2015-12-05.pt)"):
                self.inception = torch.jit.load(fid_weights, map_location=device).eval()
        self.real = self.features(val_x[:10000].to(device))  # once

    @torch.no_grad()
    def features(self, x):
        """{name: features (n, d)} of uint8 images (n, H, W, C), and the logits."""
        out = {"logits": [], "vit": [], "inception": []}
        for xb in x.split(500):  # 500 images at a time, to bound the memory
            xb = xb.float() / 255  # (b, H, W, C) in [0, 1], as the ViT takes them
            f = self.clf(xb, features=True)  # (b, d), the pooled tokens its head reads
            out["vit"].append(f)
            out["logits"].append(self.clf.head(f))
            if self.inception is not None:  # takes NCHW in 0..255, resized to 299 inside
                img = xb.permute(0, 3, 1, 2)  # (b, C, H, W)
                img = img.expand(-1, 3, -1, -1) * 255  # grey images as RGB
                out["inception"].append(self.inception(img, return_features=True).flatten(1))
        return {k: torch.cat(v).float() for k, v in out.items() if v}

    def score(self, samples, K):
        """{'clf_acc', 'fd_vit'(, 'fid')} of uint8 samples, sample i of class i % K."""
        f = self.features(samples)
        res = {"fd_vit": frechet_distance(self.real["vit"], f["vit"])}
        if K:
            # clf_acc: how often the classifier names the class that each sample was drawn for
            drawn_for = torch.arange(len(samples)) % K
            right = f["logits"].argmax(-1).cpu() == drawn_for
            res["clf_acc"] = right.float().mean().item()
        if self.inception is not None:
            res["fid"] = frechet_distance(self.real["inception"], f["inception"])
        return res

# -----------------------------------------------------------------------------
# Training loop
# main() checks the flags and catches the stop signals; train() sets up, resumes, and runs the loop. Each pass of
# the loop first evaluates and saves what the last step left (so step 0 evaluates the untrained model and the last
# pass saves the finished one), then takes one optimizer step: micro-batches, clip, guard, update, EMA; a log step
# ends in the sync and its line. Evals score the model twice: the held-out denoising loss, a number that moves
# smoothly, and samples, which are what a diffusion model is for but take many forwards each.

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
def write_grid(path, images, rows, labels=None, zoom=2):
    """A PNG of uint8 images (rows * cols, H, W, C), image r + j * rows at (r, j)."""
    # column-major: draw_samples gives sample i the class i % K, so with a row per class, row r holds that class
    from PIL import Image, ImageDraw
    n, H, W, _ = images.shape  # (n, H, W, C)
    gap = 2
    h = H * zoom + gap  # a cell and the gap after it
    w = W * zoom + gap
    margin = 0  # room for the labels, left of the rows
    if labels:
        margin = 8 + 6 * max(map(len, labels))
    im = Image.new("RGB", (margin + n // rows * w + gap, rows * h + gap), "white")
    for i, image in enumerate(images):
        cell = Image.fromarray(image.squeeze())  # (H, W, 3) RGB, or (H, W) grey, which paste turns into RGB
        cell = cell.resize((W * zoom, H * zoom), Image.NEAREST)  # a pixel becomes a zoom x zoom square
        im.paste(cell, (margin + gap + i // rows * w, gap + i % rows * h))  # row i % rows, column i // rows
    draw = ImageDraw.Draw(im)
    for r, name in enumerate(labels or ()):
        top = gap + r * h + H * zoom // 2 - 5  # the text, about 10 pixels high, centred on its row
        draw.text((4, top), name, fill=(0, 0, 0))
    # written whole, then renamed: a reader never sees half a PNG
    im.save(f"{path}.tmp", format="PNG")
    os.replace(f"{path}.tmp", path)

def evaluate_both(cfg, model, ema, val_x, val_y, K, alpha_bar, judge, meta,
                  ctx, rank, world_size, step, final):
    """The denoising loss of the weights and their EMA; the EMA's samples, scored."""
    rec = {"step": step}
    args = (model, val_x, val_y, K, cfg, alpha_bar, rank, world_size, ctx)
    rec["val_loss"], rec["val_loss_t"] = denoising_loss(*args)
    # The samples come from the EMA of the weights, as DiT's and EDM's do: an average over the last few percent of
    # the run (--ema_std), or roughly the last 1 / (1 - ema) steps, which smooths out the noise of single updates.
    if ema:
        ema.swap()
        rec["ema_val_loss"], rec["ema_val_loss_t"] = denoising_loss(*args)
    rows = K or cfg.per_class  # the grid: a row per class, or a square of unconditional samples
    n_samples = cfg.final_samples if final else cfg.eval_samples
    n_samples = max(rows * cfg.per_class, n_samples)  # enough to fill the grid
    t0 = time.perf_counter()
    samples = draw_samples(model, n_samples, val_x.shape[1:], K, cfg, alpha_bar,  # shape (H, W, C)
                           cfg.batch_size, rank, world_size, ctx)
    rec["sample_s"] = time.perf_counter() - t0
    if ema:
        ema.swap()
    name = "samples.png" if final else f"samples_{step:05d}.png"
    grid = os.path.join(cfg.out_dir, name)
    if rank == 0:
        labels = meta["classes"] if K else None
        cells = samples[:rows * cfg.per_class].cpu().numpy()
        side_path("writing the sample grid", write_grid, grid, cells, rows, labels)
    if judge:
        rec.update(side_path("scoring the samples", judge.score, samples, K) or {})
    line = f"eval {step:05d} | val loss {rec['val_loss']:.4f}"
    if ema:
        line += f" | ema val loss {rec['ema_val_loss']:.4f}"
    if "clf_acc" in rec:
        line += f" | classifier acc {100 * rec['clf_acc']:.1f}%"
    if "fd_vit" in rec:
        line += f" | FD-ViT {rec['fd_vit']:.2f}"
    if "fid" in rec:
        line += f" | FID {rec['fid']:.2f}"
    print(f"{line} | {n_samples} samples in {rec['sample_s']:.0f} s | {grid}")
    return rec

def conditioning(cfg, meta):
    """Classes to condition on: 0 (none) for one class or --num_classes=0."""
    K = meta["num_classes"]
    # a single class needs no label; a positive --num_classes only confirms the data's count
    if cfg.num_classes > 0 and cfg.num_classes != K:
        die(f"--num_classes={cfg.num_classes} but {cfg.data_dir} has {K} classes; use -1 (the data's) or 0")
    return 0 if cfg.num_classes == 0 or K == 1 else K

def done_line(step, epochs, train_time, rec, out_dir):
    """The run's last line: steps, epochs, time, and the final scores: the denoising loss of the
    weights (and of their EMA), and the samples' classifier accuracy and Frechet distances."""
    scores = " | ".join(f"{k} {rec[k]:.4f}" for k in ("val_loss", "ema_val_loss", "clf_acc", "fd_vit", "fid")
                        if k in rec)
    return (f"done: {step} steps, {epochs:.1f} epochs in {train_time:.0f} s | {scores} | checkpoint and "
            f"samples.png in {out_dir}")

def training_loss(model, x, y, gen, rank, world_size, K, flip, cfg, alpha_bar, ctx):
    """The loss of this rank's micro-batch: uint8 images x (B, H, W, C), labels y (B,)."""
    # Noise, t and the coins are drawn for the global micro-batch of G images and each rank keeps its slice, so a
    # global batch gets the same numbers however many ranks share it.
    B = len(x)
    G = B * world_size
    mine = slice(rank * B, (rank + 1) * B)
    x0 = to_model(x)
    noise = torch.randn((G, *x.shape[1:]), generator=gen, device=x.device)[mine]
    t = sample_t(G, cfg, gen)[mine]  # (B,)
    u = torch.rand((2, G), generator=gen, device=x.device)[:, mine]  # a coin for the flip, one for the label
    if flip:  # mirror half the images left to right (dim 2 is W)
        heads = u[0].view(B, 1, 1, 1) < 0.5
        x0 = torch.where(heads, x0.flip(2), x0)
    # Label dropout: a share class_dropout of the labels becomes K, "no label", so that one network also learns
    # the unconditional model that guidance needs (Ho & Salimans 2022; DiT drops 10%).
    y = torch.where(u[1] < cfg.class_dropout, K, y) if K else None
    x_t, target, weight = corrupt(x0, noise, t, cfg, alpha_bar)
    with ctx:
        out = model(x_t, t, y).float()
    # The loss is the mean squared error of each image's velocity (flow) or noise (ddpm), averaged over its
    # pixels. With x-prediction, DiT.forward has already turned the clean image into a velocity: Li & He's
    # x-prediction with a v-loss.
    mse = (out - target).square().mean((1, 2, 3))  # (B,)
    if weight is not None:  # ddpm's min-SNR weights
        mse = mse * weight
    return mse.mean()

def train(cfg, stop):
    """Set up, resume, then the loop: evals and saves; micro-steps, clip, the guard, the update; the sync
    and its log line."""
    rank, world_size, device = setup_dist(cfg.device)
    if rank:  # one rank prints: the others' lines would repeat its own
        sys.stdout = open(os.devnull, "w")
    wall0 = time.perf_counter()
    master = rank == 0  # only rank 0 writes files
    # a first run: the demo's data, made offline
    prepare_default_data(cfg, rank, world_size, "shapes", "the upright shapes dataset", "--rotate=off")
    # data: both splits as uint8, held on the device or read from their files (--loader)
    meta, loader, val_x, val_y = image_data(cfg, rank, world_size, device)
    H, W = meta["image_size"]
    C = meta["channels"]
    K = conditioning(cfg, meta)
    flip, why = flips(cfg, meta)
    data_info = {"num_classes": K, "image_size": [H, W], "channels": C}
    data_meta = {k: meta[k] for k in ("classes", "num_classes", "image_size", "channels")}
    alpha_bar = cosine_alpha_bar()  # (T + 1,): ddpm's schedule
    judge = None  # the samples are scored on rank 0 alone
    if cfg.eval_classifier and master:
        judge = Judge(cfg.eval_classifier, meta, cfg.fid_weights, device, val_x)

    # The budget: steps (--max_steps, or --epochs in steps), else seconds of training (--time_budget)
    B = cfg.batch_size
    accum = cfg.grad_accum
    images_per_step = B * accum * world_size
    steps_per_epoch = len(loader.y) // (B * world_size) / accum
    max_steps = cfg.max_steps or math.ceil(cfg.epochs * steps_per_epoch)
    time_budget = 0.0 if max_steps else cfg.time_budget
    # cfg settles here, before anything derives from it: the precision (a resumed run's)
    layout = run_layout(dataclasses.asdict(cfg), world_size, data_info)
    ckpt, path = resume_point(cfg.out_dir, cfg.resume, layout, master, max_steps, time_budget)
    dtype, ctx, scaler = setup_precision(device, cfg.dtype, ckpt)
    cfg = dataclasses.replace(cfg, dtype=str(dtype).removeprefix("torch."))

    # model, optimizer, EMA, guard
    raw = build_model(cfg, H, C, K, device)
    kernels.use(cfg.kernels)  # Triton's or PyTorch's ops, chosen before compile traces the model
    model, compiled = wrap_model(raw, cfg, device, dtype, world_size)
    opts = build_optimizers(cfg, raw)
    ema, phemas = build_emas(cfg, raw, ckpt, world_size)
    guard = Guard(cfg.loss_spike, cfg.gnorm_spike, cfg.guard_window, cfg.rollback_after, cfg.clip_mult, device)
    n_params = sum(p.numel() for p in raw.parameters())

    # the loop's state: these locals; a resume sets them, and the loader's place
    step, train_time, history = 0, 0.0, []
    if ckpt:
        with exit_if_unreadable(path, "it is not a checkpoint of this run; pass a new --out_dir"):
            step, train_time, history = apply_checkpoint(ckpt, raw, opts, scaler, guard, ema)
            loader.load_state(ckpt["data"])
            load_phema(phemas, ckpt, raw)
    # the log: a line a log step, every value in metrics.jsonl; what a step is worth gives its speed and MFU
    log = start_log(cfg, master, images_per_step, "img", raw.flops_per_image() * images_per_step, device, dtype)
    sharded = world_size > 1 and cfg.parallel == "fsdp"  # a checkpoint: a folder of shards
    writer = CheckpointWriter(cfg.out_dir, cfg.keep_last, cfg.milestone_every, cfg.async_save, sharded, world_size,
                              master)
    budget = f"{time_budget:.0f} s" if time_budget else f"{max_steps} steps ({max_steps / steps_per_epoch:.1f} epochs)"
    classes = f"{K} classes" if K else "unconditional"
    objective = f"{cfg.objective}, {cfg.predict}-prediction" if cfg.objective == "flow" else cfg.objective
    print(f"{n_params / 1e6:.2f}M parameters | {len(loader.y)} train images of {H}x{W}x{C}, {classes}"
          f" | {(H // cfg.patch_size) ** 2} patches | {objective}"
          f" | {images_per_step} images/step (B {B} x accum {accum} x world {world_size}) | {budget}"
          f" | {device} {dtype} | compile {compiled} | kernels {kernels.backend(device)}"
          f" | lr {cfg.lr:g} | flips {'on' if flip else 'off'} ({why}) | images {loader.where}")

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
        # Evals (one at step 0: the samples of an untrained model are noise) and saves, but not
        # again at the step a resume or rollback starts from. The clock stopped at the sync: they
        # are not training time.
        final = last_step and not stopped  # a stopped run saves, and leaves the final eval to its resume
        # a periodic eval within a tenth of an interval of the end would only repeat the final one: skipped
        soon = steps_left(step, max_steps, train_time, time_budget, step_time) < cfg.eval_every / 10
        evals = final or (every(step, cfg.eval_every) and (step == 0 or step > first) and not soon)
        saves = last_step or (every(step, cfg.save_every) and step > first)
        snapshot = phemas and step > first and (every(step, cfg.phema_every) or last_step)
        if snapshot and master:
            write_snapshot(cfg.out_dir, step, phema_state(phemas, raw))
        if evals:
            rec = evaluate_both(cfg, model, ema, val_x, val_y, K, alpha_bar, judge, meta,
                                ctx, rank, world_size, step, final)
            log.eval(final, **rec)
            history.append({k: v for k, v in rec.items() if not k.endswith("_t")})  # scores, not the per-t losses
        if saves:
            # The checkpoint is a dict built here and read back by apply_checkpoint. It holds all a resumed run
            # needs to go on as if never stopped: the guard's statistics, the loader's place, the train time.
            writer.save({**model_state(raw, opts, ema, whole=not sharded), "scaler": scaler.state_dict(),
                         "step": step, "guard": guard.state(), "train_time": train_time,
                         "history": history, "data_info": data_info, "config": dataclasses.asdict(cfg),
                         "world_size": world_size, "data": loader.state(), "num_classes": K,
                         "data_meta": data_meta, "phema": phema_state(phemas, raw)})
        if last_step:
            break
        if evals or saves or snapshot:
            t0 = time.perf_counter()  # start the clock again

        # One optimizer step. Noise, t, label dropout and flips are drawn for the global batch
        # from a generator seeded by (seed, step), and each rank keeps its slice: a resumed run
        # draws the same numbers, for any number of ranks.
        gen = torch.Generator(device).manual_seed(cfg.seed + 1000003 * (step + 1))  # a seed per (seed, step)
        if time_budget:  # the schedule follows the time, estimated since the sync
            progress = (train_time + len(trace) * step_time) / time_budget
        else:
            progress = step / max_steps
        mult = lr_mult(cfg, step, progress)
        for opt in opts:
            opt.zero_grad(set_to_none=True)
            for g in opt.param_groups:
                g["lr"] = cfg.lr * mult
        loss = torch.zeros((), device=device)  # the step's mean loss, on the device
        for micro in range(accum):
            x, y = loader.next()  # (B, H, W, C) uint8, (B,)
            # DDP all-reduces grads in backward; only the last micro-step needs to (grad_sync)
            with grad_sync(model, micro == accum - 1):
                micro_loss = training_loss(model, x, y, gen, rank, world_size, K, flip, cfg, alpha_bar, ctx) / accum
                scaler.scale(micro_loss).backward()
            loss += micro_loss.detach()
        for opt in opts:
            scaler.unscale_(opt)
        # clip the global norm of the gradients at grad_clip (or, with --clip_mult, at a multiple of its running
        # mean), a guard against a rare batch with an outsized gradient; gnorm is the norm before clipping
        gnorm = clip_grads(raw.parameters(), guard.clip(cfg.grad_clip))
        # The guard skips a bad step (non-finite, or a spike), deciding on the device: asking
        # the host would stall the device every step. Where its verdict is not GOOD, AdamW's
        # fused kernel leaves the weights and their state as they were.
        loss = all_mean(loss, world_size)
        verdict = guard.check(loss, gnorm, scaler.is_enabled())
        for opt in opts:
            opt.step(skip=verdict != GOOD)
        # The EMA of the weights, which evals sample from. By default a power-function profile (PowerEMA) whose
        # width is 2% of the steps so far at every step: the post-hoc EMA's measurements chose it (BENCHMARKS.md,
        # issue 79), 1.4 to 1.9 points more samples recognised than the fixed 0.999, whose warm-up averaged about
        # the last tenth of the demo's run. With --ema_std=0 the decay rises as (1 + t) / (10 + t) up to --ema,
        # DiT's 0.9999 in the presets. A skipped step left the weights, and so the EMAs, as they were.
        if ema:
            ema.update()
        for e in phemas:
            e.update()
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
        due = [every(step, n) for n in (cfg.log_every, cfg.eval_every, cfg.save_every, cfg.phema_every)]
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
                load_phema(phemas, ckpt, raw)
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
        # results.tsv ranks runs by the best score there is: the classifier's, else the denoising loss
        key = "val_loss"
        if "clf_acc" in rec:
            key = "clf_acc"
        elif ema:
            key = "ema_val_loss"
        result |= {**rec, "train_loss": lossf, "images": step * images_per_step}
        log.result(key, result, cfg.description)
        print(done_line(step, step * images_per_step / len(loader.y), train_time, rec, cfg.out_dir))
    return result

def check_config(cfg):
    """Reject impossible settings with a one-line message that names the fix."""
    check_choices(cfg)
    # sizes and counts first, since the checks below divide by them
    at_least_1 = ("patch_size n_layer n_head n_embd batch_size grad_accum guard_window sample_steps per_class "
                  "log_every")
    at_least_0 = ("min_snr cfg_scale epochs image_size eval_images eval_samples final_samples init_std "
                  "weight_decay loss_spike gnorm_spike clip_mult rollback_after max_steps time_budget phema_every")
    for low, keys in ((1, at_least_1), (0, at_least_0), (-1, "num_classes")):
        for k in keys.split():
            if getattr(cfg, k) < low:
                die(f"--{k} must be at least {low}, got {getattr(cfg, k)}")
    d = cfg.n_embd
    if d % cfg.n_head or (d // cfg.n_head) % 2:
        fit = [h for h in range(1, d + 1) if d % h == 0 and (d // h) % 2 == 0]
        die(f"--n_embd={d} must split into {cfg.n_head} heads of even size; "
            f"--n_head={'|'.join(map(str, fit))} would, or change --n_embd")
    if cfg.lr <= 0 or cfg.warmup_steps < 0 or not 0 <= cfg.final_lr_frac <= 1:
        die("need --lr > 0, --warmup_steps >= 0 and 0 <= --final_lr_frac <= 1")
    in_range = all(0 <= v < 1 for v in (cfg.ema, cfg.class_dropout, cfg.beta1, cfg.beta2))
    if not (in_range and cfg.t_std > 0 and cfg.mlp_ratio > 0):
        die("need 0 <= --ema, --class_dropout, --beta1, --beta2 < 1 and --t_std, --mlp_ratio > 0")
    if not 0 <= cfg.ema_std <= 0.28:  # a power function's profile is at most 0.289 wide (gamma = 0)
        die(f"--ema_std={cfg.ema_std:g}: need 0 < std <= 0.28 (EDM2's are 0.05 and 0.10), or 0 for --ema's decay")
    # euler and heun integrate flow's ODE; ddim steps through ddpm's chain
    if cfg.sampler != "auto" and (cfg.sampler == "ddim") != (cfg.objective == "ddpm"):
        die(f"--sampler={cfg.sampler} does not fit --objective={cfg.objective}: "
            "euler|heun sample flow, ddim samples ddpm")
    parse_interval(cfg.guidance_interval)
    if not (cfg.max_steps or cfg.epochs or cfg.time_budget > 0):
        die("no training budget: set --max_steps, --epochs or --time_budget")
    for k in ("eval_classifier", "fid_weights"):
        path = getattr(cfg, k)
        if path and not os.path.exists(path):
            die(f"--{k}={path}: no such file or directory")

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
