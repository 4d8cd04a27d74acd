"""
train_gpt.py: a modern GPT, trained from scratch, in one file.

A decoder-only transformer (RoPE, pre-norm, QK-norm, SwiGLU, value
embeddings; GQA, sliding windows and muP as options) on prepare_data.py's
shards: Muon + AdamW, warmup + cosine or WSD, bf16/fp16, torch.compile,
DDP or FSDP2, exact resume, a KV-cache sampler.

  python train_gpt.py          # CPU demo on the stdlib corpus, ~4 min
  torchrun --nproc_per_node=8 train_gpt.py --preset=gpt2_124m
  python bench.py train_gpt.py --preset=gpt2_124m   # its speed, on random tokens
  python train_gpt.py -h       # every flag, with its default

Jobs on a finished checkpoint live beside it: sample_gpt.py samples text,
eval_gpt.py scores multiple choice (HellaSwag), finetune_gpt.py fine-tunes
(LoRA, distillation, INT8) and exports.

Read it top to bottom: the Config (every flag), the Model, the Data, the
Optimizer and schedule, the System (devices, precision, compile, DDP/FSDP2),
then the Training loop. Each choice is explained where it is made, with the
paper or the measurement (BENCHMARKS.md) behind it. The Machinery after the
loop (flags, checkpoint files, guards, logging) is the same in every trainer,
and a first reading may skip it.
"""
import argparse
import base64
import contextlib
import copy
import dataclasses
import difflib
import functools
import gc
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
from torch.utils.checkpoint import checkpoint as recompute  # activations, in backward

import kernels  # Triton kernels on CUDA; PyTorch's ops elsewhere

# -----------------------------------------------------------------------------
# Config

@dataclass
class Config:
    """Every knob of a run, one field per flag: --n_layer=12 sets n_layer, and -h shows each field with its
    trailing comment as help and its default. A --preset (PRESETS, below) replaces some defaults first; the flags
    given on the command line win over it. What follows from these fields (the micro-steps a step, the step count
    of a token budget) is derived in train(), where it is used, and printed there; it is not stored here."""
    # data and output
    data_dir: str = "data/stdlib_bpe"  # prepare_data.py's shards and meta.json, or nanoGPT's train.bin and val.bin
    out_dir: str = "out/gpt"  # where checkpoints, metrics.jsonl and config.json go
    preset: str = ""  # cpu_demo|cpu_128|gpt2_124m|gpt2_350m: a named set of flags; the flags you give win
    # model
    n_layer: int = 4  # transformer blocks
    n_head: int = 2  # query heads, which split n_embd; 2 x 32 wide beat 4 x 16 on a CPU
    n_kv_head: int = 0  # key/value heads, shared by groups of query heads (GQA); 0 = n_head, 1 = multi-query
    n_embd: int = 64  # width of the residual stream; 64 beat 96 and 128 in 240 s on a CPU (BENCHMARKS.md)
    seq_len: int = 128  # context length, in tokens
    vocab_size: int = 0  # the vocabulary the model is built for, at least the data's; 0 = the data's
    mlp: Literal["swiglu", "relu2", "gelu"] = "swiglu"  # the MLP: gated SiLU, ReLU squared, or GPT-2's GELU
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"  # before each attention and MLP (pre-norm), and the head
    qk_norm: bool = True  # normalise each head's queries and keys, which steadies the attention logits
    tie_embeddings: bool = False  # the head reuses the input embedding's weights, as GPT-2 does
    value_embeds: bool = True  # token tables on alternate layers, added to the values (nanochat): the ladder's winner
    logit_softcap: float = 0.0  # cap * tanh(logits / cap) bounds the logits (Gemma 2 uses 30); 0 = off
    rope_base: float = 10000.0  # RoPE's theta: the longest rotation's period grows with it
    window: int = 0  # sliding-window attention: a query sees this many positions back; 0 = all positions
    window_pattern: int = 0  # every k-th layer sees all positions, the others the window (Gemma 2); 0 = none
    pos_emb: Literal["rope", "learned"] = "rope"  # rotate queries and keys, or add a learned embedding (GPT-2)
    bias: bool = False  # biases in the linears and LayerNorms, as GPT-2 has
    norm_eps: float = 1e-6  # the norms' epsilon; GPT-2 uses 1e-5
    init_std: float = 0.02  # std of the hidden weights at init (muP divides it by sqrt(n_embd / base_width))
    mup: bool = False  # muP (Yang et al. 2022): the LR tuned at base_width holds at any width
    base_width: int = 128  # muP: the n_embd at which muP and the standard parametrisation agree
    # budget: max_steps, else tokens, else time_budget
    max_steps: int = 0  # optimizer steps; 0 = set by --tokens or --time_budget
    tokens: str = ""  # tokens to train on, e.g. 2.5e9; auto = 20 x the parameters (Chinchilla); empty = off
    time_budget: float = 240.0  # seconds of training, evals and saves excluded; 0 = no limit
    batch_size: int = 32  # micro-batch per rank, in sequences
    grad_accum: int = 1  # micro-steps per optimizer step
    total_batch: int = 0  # tokens per optimizer step over all ranks, which sets grad_accum; 0 = off
    # optimizer and schedule
    optimizer: Literal["muon", "adamw"] = "muon"  # muon: Muon on hidden matrices and AdamW on the rest
    lr: float = 8e-3  # peak LR, of Muon and AdamW alike (4e-3 at 128 wide)
    embed_lr: float = 0.0  # LR of the input embedding; 0 = auto: 10 x lr for a BPE under Muon, else lr
    weight_decay: float = 0.1  # decoupled weight decay, on the hidden matrices only
    beta1: float = 0.9  # AdamW's momentum
    beta2: float = 0.95  # AdamW's decay of the squared gradients
    grad_clip: float = 1.0  # max global grad norm; 0 = off
    z_loss: float = 0.0  # weight of logsumexp^2 in the loss, which keeps logits from drifting (PaLM: 1e-4)
    seq_len_warmup: int = 0  # steps over which the sequence length grows to seq_len; 0 = off
    seq_len_start: int = 64  # the first length of seq_len_warmup, in tokens
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"  # the LR after warmup: its decay to final_lr_frac
    warmup_steps: int = 20  # steps of linear LR warmup
    cooldown_frac: float = 0.2  # wsd: the share of the steps spent in the final decay
    final_lr_frac: float = 0.1  # the last LR, as a fraction of the peak
    # eval, logging, checkpoints
    eval_every: int = 250  # steps between evals; 0 = only at the end
    eval_tokens: int = 65536  # val tokens a periodic eval reads; the final eval reads up to 4M
    log_every: int = 25  # steps between log lines
    sample_tokens: int = 200  # tokens sampled at each eval; 0 = off
    save_every: int = 0  # steps between checkpoints; 0 = only at the end
    keep_last: int = 2  # newest checkpoints kept, besides the milestones
    milestone_every: int = 0  # steps between checkpoints kept for good; 0 = none
    async_save: bool = False  # write checkpoints in a thread while training goes on
    resume: bool = False  # continue from out_dir's newest checkpoint
    wandb: str = ""  # wandb project to log to; empty = off
    description: str = ""  # a note on this run, for its row in results.tsv
    # guards: a bad step is skipped; repeated ones roll back
    loss_spike: float = 6.0  # skip a step whose loss is this many running stds over the mean; 0 = off
    gnorm_spike: float = 0.0  # the same for the grad norm; 0 = off
    clip_mult: float = 0.0  # clip the grad norm at this many times its running mean; 0 = off
    guard_window: int = 100  # steps in the running statistics
    rollback_after: int = 5  # bad steps within the window that roll back to a checkpoint; 0 = never
    # system
    activation_checkpointing: Literal["none", "blocks", "selective"] = "none"  # recompute in backward: less memory
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"  # auto: cuda, else mps, else cpu
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # autocast's; auto: bf16 on GPUs, fp32 on CPUs
    compile: Literal["auto", "true", "false"] = "auto"  # torch.compile the model; auto: on CUDA
    parallel: Literal["ddp", "fsdp"] = "ddp"  # under torchrun: replicate the model (DDP) or shard it (FSDP2)
    offload: Literal["none", "params"] = "none"  # fsdp: keep the parameters in CPU memory
    seed: int = 1337  # of the init, the order of the train rows and the sampling
    kernels: Literal["auto", "triton", "torch"] = "auto"  # Triton's or PyTorch's ops; auto: the faster per op
    attention: Literal["sdpa", "flex"] = "sdpa"  # --window's: SDPA under a dense mask, or FlexAttention (CUDA)
    # the text sampled at evals (sample_gpt.py samples a finished checkpoint)
    temperature: float = 0.8  # of the sampled text; 0 = greedy
    top_k: int = 50  # sample from the k likeliest tokens; 0 = all tokens

# prepare_data.py's command for the default data_dir, what it makes, and its flags: a first run with no
# --data_dir prepares this itself, offline
DEFAULT_DATA = ("stdlib", "the Python stdlib corpus as a 4,353-token BPE", "--tokenizer=bpe:4353")
# GPT-2's sizes on FineWeb, for GPUs
GPT2 = dict(
    seq_len=1024,
    total_batch=1 << 19,  # 0.5M tokens a step, GPT-3's batch at this size
    data_dir="data/fineweb10B",
    time_budget=0,
    lr=4e-3,  # Muon's, which beat AdamW at 124M (BENCHMARKS.md)
    tokens="auto",  # 20 a parameter (Chinchilla)
    batch_size=32,
    warmup_steps=700,
    eval_every=250,
    eval_tokens=1 << 20,
    save_every=2000,
    norm="rmsnorm",
    value_embeds=False,  # off: they won the ladder on the CPU (BENCHMARKS.md), but are untested on a GPU here
)
PRESETS = {
    "cpu_demo": {},  # the defaults: 1.34M parameters (0.57M of them value embeddings), 240 s on a 2-core CPU
    "cpu_128": dict(n_embd=128, n_head=4, lr=4e-3, value_embeds=False),  # the defaults until 2026-11-27
    "gpt2_124m": dict(GPT2, n_layer=12, n_head=12, n_embd=768, out_dir="out/gpt2_124m"),
    "gpt2_350m": dict(GPT2, n_layer=24, n_head=16, n_embd=1024, batch_size=16, optimizer="adamw", lr=3e-4,
                      out_dir="out/gpt2_350m"),
}
# jobs on a finished checkpoint that moved to companion scripts: an old flag names the new command
MOVED = {
    "sample": "python sample_gpt.py --ckpt=out/gpt --prompt=TEXT",
    "prompt": "python sample_gpt.py --ckpt=out/gpt --prompt=TEXT",
    "max_new_tokens": "python sample_gpt.py --ckpt=out/gpt --max_new_tokens=N",
    "ckpt": "python sample_gpt.py --ckpt=PATH (text) or python eval_gpt.py --ckpt=PATH (multiple choice)",
    "eval_only": "python eval_gpt.py --ckpt=out/gpt --items=data/hellaswag",
    "consolidate": "python finetune_gpt.py --export=pt --ckpt=SHARDED_CKPT --out_dir=NEW_DIR",
    "eval_mc": "python eval_gpt.py --ckpt=out/gpt --items=data/hellaswag (--every_checkpoint for a run's milestones)",
    "benchmark": "python bench.py train_gpt.py --preset=gpt2_124m (any flag of this script's)",
    "bench_steps": "python bench.py train_gpt.py --steps=N",
    "profile": "python bench.py train_gpt.py --profile",
}
# The fields that define the weights: a checkpoint carries them, and finetune_gpt.py takes them from the weights
# it starts from. A resume must match them, and ADAPT_FIELDS too: those leave the weights' shapes alone but change
# what a step computes (the attention's reach, the rows a step reads, the precision), so a resume that changed one
# would not replay the run it continues.
ARCH_FIELDS = tuple("""n_layer n_head n_kv_head n_embd seq_len mlp norm qk_norm tie_embeddings value_embeds
    logit_softcap rope_base pos_emb bias norm_eps mup base_width""".split())
ADAPT_FIELDS = ("window", "window_pattern", "seq_len_warmup", "seq_len_start", "dtype")
# What a checkpoint older than a field was trained with: value embeddings became the default on 2026-12-02, and a
# checkpoint saved before has no value_embeds and none of their tables
OLDER_CHECKPOINTS = {"value_embeds": False}

# -----------------------------------------------------------------------------
# Model

class Norm(nn.Module):
    """LayerNorm (a bias only with --bias) or RMSNorm."""

    def __init__(self, dim, cfg):
        super().__init__()
        self.kind = cfg.norm
        self.eps = cfg.norm_eps
        self.weight = nn.Parameter(torch.ones(dim))
        self.bias = None  # RMSNorm has none, and LayerNorm has one only with --bias
        if cfg.bias and cfg.norm == "layernorm":
            self.bias = nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        if self.kind == "rmsnorm":
            return kernels.rms_norm(x, self.weight, self.eps)
        return F.layer_norm(x, x.shape[-1:], self.weight, self.bias, self.eps)

# RoPE (Su et al. 2021) turns each pair of a head's dimensions by an angle proportional to the position, so q.k
# depends only on the distance between two tokens. Pair j, of frequency base^(-2j/D), is (x[j], x[j + D/2]): the
# halves of the head, as in GPT-NeoX and Llama, rather than neighbours (x[2j], x[2j + 1]). Both are the same rotation
# up to a fixed shuffle of the head's dimensions, which the qkv projection learns around; halves let one roll of the
# last axis line every pair up, where neighbours need a strided split and a re-interleave.

def rope_tables(seq_len, head_dim, base, device):
    """RoPE's cos and signed sin (Su et al. 2021), (T, D) fp32."""
    f32 = dict(device=device, dtype=torch.float32)
    exponents = torch.arange(0, head_dim, 2, **f32) / head_dim  # 2j / D
    inv_freq = 1.0 / base ** exponents  # (D/2,)
    # (T, D/2): the angle of pair j at position t, in fp32: bf16 would round position 1,000 to a multiple of 4
    freqs = torch.outer(torch.arange(seq_len, **f32), inv_freq)
    # both halves of a pair turn by the same angle; the sign of sin differs: -sin for the first half, +sin for the
    # second, so that apply_rope's one multiply-add makes both rows of the 2 x 2 rotation
    cos = freqs.cos().repeat(1, 2)
    sin = torch.cat((-freqs.sin(), freqs.sin()), -1)
    return cos, sin

def apply_rope(x, cos, sin):
    """Rotate the pairs (x[i], x[i + D/2]) of x (B, H, T, D)."""
    # rolled by D/2, x lines up each half with its partner: the first half gets x[j] cos - x[j + D/2] sin and the
    # second x[j + D/2] cos + x[j] sin. A roll, not a split and a cat of the halves: 2x faster on a CPU. In fp32,
    # as the tables are; the result goes back to x's dtype
    xf = x.float()
    rolled = xf.roll(x.size(-1) // 2, dims=-1)
    return (xf * cos + rolled * sin).type_as(x)

def width_mult(cfg):
    """muP's width multiplier m = n_embd / base_width, else 1."""
    # muP (Yang et al. 2022, Tensor Programs V, Table 3) keeps every layer's update the same size as the model
    # widens, so that the best LR found at base_width is the best at any n_embd. Relative to base_width it changes
    # four things, each where it happens: the output is multiplied by 1/m (GPT.hidden), attention scores q.k by
    # 1/d rather than 1/sqrt(d) (Attention), hidden weights start at std / sqrt(m) (GPT.init_weights), and the
    # hidden matrices' LR is Muon's / sqrt(m) or AdamW's / m (build_optimizers). At n_embd = base_width nothing
    # changes: muP and the standard parametrisation agree there.
    return cfg.n_embd / cfg.base_width if cfg.mup else 1.0

class KVCache:
    """Past keys and values for sampling: (B, Hkv, max_len, D)."""

    def __init__(self, n_layer, max_len):
        self.k = [None] * n_layer
        self.v = [None] * n_layer
        self.pos = 0  # positions filled; the next token's position
        self.max_len = max_len

    def update(self, layer, k, v):
        """Store k, v (B, Hkv, t, D) at pos; return all so far."""
        if self.k[layer] is None:  # allocated once, at the first call: its batch and heads are the input's
            B, H, _, D = k.shape
            self.k[layer] = k.new_empty(B, H, self.max_len, D)
            self.v[layer] = v.new_empty(B, H, self.max_len, D)
        end = self.pos + k.size(2)
        self.k[layer][:, :, self.pos:end] = k
        self.v[layer][:, :, self.pos:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]  # (B, Hkv, end, D) each

def has_value_embed(cfg, layer):
    """--value_embeds: every other layer, counted back from the last, has a value embedding."""
    return cfg.value_embeds and layer % 2 == (cfg.n_layer - 1) % 2

class Attention(nn.Module):
    """Causal self-attention, (B, T, n_embd) -> (B, T, n_embd): every position mixes in the values of the positions
    before it, weighted by how well its query matches their keys, in n_head heads at once."""

    def __init__(self, cfg, layer):
        super().__init__()
        d = cfg.n_embd
        self.layer = layer
        self.n_head = cfg.n_head
        hd = d // cfg.n_head  # a head's width
        self.hd = hd
        # GQA (Ainslie et al. 2023): n_kv key/value heads, each shared by n_head / n_kv query heads, shrink the KV
        # cache and the projection; 1 is multi-query attention (Shazeer 2019)
        self.n_kv = cfg.n_kv_head or cfg.n_head
        # softmax(q.k * scale): 1/sqrt(hd) keeps the scores' variance at 1 while q and k are independent. muP scales
        # by 1/d instead, since trained q and k correlate and q.k then grows like d, not sqrt(d); written as
        # 1/sqrt(hd * m), it is the usual 1/sqrt(hd) at base_width
        self.scale = 1 / math.sqrt(hd * width_mult(cfg))
        # one matmul makes the queries, keys and values: n_head + 2 * n_kv heads of hd
        self.qkv = nn.Linear(d, (self.n_head + 2 * self.n_kv) * hd, bias=cfg.bias)
        self.proj = nn.Linear(self.n_head * hd, d, bias=cfg.bias)
        # --window: local layers see the last `window` positions only (Beltagy et al. 2020), which is cheaper on
        # long contexts; with --window_pattern=3, layers 0 and 1 are local, 2 global, 3 and 4 local, ...: the
        # global ones carry what lies further back (Gemma 2 alternates the two: --window_pattern=2)
        is_global = cfg.window_pattern and (layer + 1) % cfg.window_pattern == 0
        self.window = cfg.window if cfg.window and not is_global else None
        # QK-norm (Dehghani et al. 2023): queries and keys whose norms grow in training would push the softmax
        # toward one-hot weights, whose gradients vanish; normalised, they cannot grow unchecked
        self.q_norm = Norm(hd, cfg) if cfg.qk_norm else nn.Identity()
        self.k_norm = Norm(hd, cfg) if cfg.qk_norm else nn.Identity()
        # --value_embeds: a gate per key/value head, read off the first 12 channels of the input (GPT.hidden)
        self.ve_gate = None
        if has_value_embed(cfg, layer):
            self.ve_gate = nn.Linear(min(12, d), self.n_kv, bias=False)

    def forward(self, x, cos, sin, cache=None, ve=None):
        B, T, _ = x.shape  # x (B, T, n_embd)
        qkv = self.qkv(x).view(B, T, -1, self.hd)  # (B, T, n_head + 2 n_kv, hd)
        qkv = qkv.transpose(1, 2)  # (B, n_head + 2 n_kv, T, hd)
        q, k, v = qkv.split([self.n_head, self.n_kv, self.n_kv], dim=1)  # (B, n_head | n_kv | n_kv, T, hd)
        if ve is not None:
            # the value embedding (B, T, n_kv * hd) joins the values, each head's share scaled by a gate in (0, 3)
            # that the input sets: 3 sigmoid(0) = 1.5 at init, as nanochat's
            first = x[..., :self.ve_gate.in_features]  # the input's first 12 channels
            gate = 3 * torch.sigmoid(self.ve_gate(first))  # (B, T, n_kv)
            ve = ve.view(B, T, self.n_kv, self.hd) * gate.unsqueeze(-1)
            v = v + ve.transpose(1, 2)  # (B, n_kv, T, hd)
        q = self.q_norm(q)
        k = self.k_norm(k)
        if cos is not None:  # RoPE, unless learned positions
            q = apply_rope(q, cos, sin)
            k = apply_rope(k, cos, sin)
        if cache is not None:
            # sampling: k and v grow to every position so far; the T new queries are the last T positions, so the
            # causal mask is aligned bottom-right
            k, v = cache.update(self.layer, k, v)
        y = kernels.attention(q, k, v, causal=True, scale=self.scale, window=self.window)  # (B, n_head, T, hd)
        y = y.transpose(1, 2).reshape(B, T, -1)  # heads side by side: (B, T, n_embd)
        return self.proj(y)

class MLP(nn.Module):
    """The per-position feed-forward layer, (B, T, n_embd) -> (B, T, n_embd): up to a wider hidden layer, a
    nonlinearity, and back down; it holds about two thirds of a block's weights."""

    def __init__(self, cfg):
        super().__init__()
        self.kind = cfg.mlp
        d = cfg.n_embd
        if cfg.mlp == "swiglu":
            # a gated MLP has three matrices where GPT-2's has two: 2/3 of the 4d hidden width keeps the
            # parameters (Shazeer 2020), rounded up to a multiple of 64 for fast matmuls
            hidden = 64 * math.ceil(8 * d / 3 / 64)
            outputs = 2 * hidden  # fc makes the gate and the value at once
        else:
            hidden = 4 * d
            outputs = hidden
        self.fc = nn.Linear(d, outputs, bias=cfg.bias)
        self.proj = nn.Linear(hidden, d, bias=cfg.bias)

    def forward(self, x):
        h = self.fc(x)  # (B, T, hidden), or (B, T, 2 hidden) gated
        if self.kind == "swiglu":
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b
        elif self.kind == "relu2":  # ReLU squared (So et al. 2021)
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate="tanh")
        return self.proj(h)  # (B, T, n_embd)

class Block(nn.Module):
    """One transformer layer: attention, then the MLP, each a pre-norm residual branch."""

    def __init__(self, cfg, layer):
        super().__init__()
        self.norm1 = Norm(cfg.n_embd, cfg)
        self.attn = Attention(cfg, layer)
        self.norm2 = Norm(cfg.n_embd, cfg)
        self.mlp = MLP(cfg)
        self.checkpointing = cfg.activation_checkpointing

    # Activation checkpointing trades compute for memory: backward recomputes what forward did not keep. "blocks"
    # keeps only each block's input (forward runs twice: about a third more compute); "selective" recomputes only
    # the norm and the MLP, whose hidden activations (4 n_embd wide, or 2 x 8/3 gated) are the largest a block
    # keeps. Sampling and evals (no grad) keep nothing anyway.

    def forward(self, x, cos, sin, cache=None, ve=None):
        if self.checkpointing == "blocks" and torch.is_grad_enabled():
            return recompute(self.sublayers, x, cos, sin, cache, ve, use_reentrant=False)
        return self.sublayers(x, cos, sin, cache, ve)

    def sublayers(self, x, cos, sin, cache=None, ve=None):
        # pre-norm (GPT-2; Xiong et al. 2020): each sublayer reads a normalised copy and adds its output to the
        # residual stream x, which nothing normalises, so gradients reach early layers undamped
        x = x + self.attn(self.norm1(x), cos, sin, cache, ve)
        if self.checkpointing == "selective" and torch.is_grad_enabled():
            return x + recompute(lambda x: self.mlp(self.norm2(x)), x, use_reentrant=False)
        return x + self.mlp(self.norm2(x))

class GPT(nn.Module):
    """Embedding, pre-norm blocks, a final norm and the head. --mup
    is Yang et al. 2022 (Tensor Programs V, Table 3)."""

    def __init__(self, cfg, vocab_size):
        super().__init__()
        self.cfg = cfg
        self.vocab_size = vocab_size
        d = cfg.n_embd
        # the embedding and the head get rows up to a multiple of 64, as nanoGPT pads GPT-2's 50,257 to 50,304:
        # matmuls on such shapes run faster. The extra rows are never a target; the loss and logits leave them out
        rows = 64 * math.ceil(vocab_size / 64)
        self.wte = nn.Embedding(rows, d)
        self.wpe = nn.Embedding(cfg.seq_len, d) if cfg.pos_emb == "learned" else None
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        # Value embeddings (nanochat, after ResFormer's value residual, Zhou et al. 2024): on every other layer, a
        # table of its own gives each token a vector that the attention adds to its values. A value is what a
        # position passes on to the positions that attend to it, so the token itself reaches every later layer
        # directly, not only through the residual stream. Lookups, so they cost parameters, not FLOPs
        kv = (cfg.n_kv_head or cfg.n_head) * (d // cfg.n_head)  # the values' width
        layers = [str(i) for i in range(cfg.n_layer) if has_value_embed(cfg, i)]
        self.value_embeds = nn.ModuleDict({i: nn.Embedding(rows, kv) for i in layers})
        self.norm = Norm(d, cfg)
        self.head = None if cfg.tie_embeddings else nn.Linear(d, rows, bias=False)
        # RoPE's tables are buffers, so they move with .to(device), but not persistent: the config rebuilds them,
        # and a checkpoint need not carry them
        cos, sin = rope_tables(cfg.seq_len, d // cfg.n_head, cfg.rope_base, None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """Set every parameter and buffer (built on meta)."""
        c = self.cfg
        for name, p in self.named_parameters():
            if p.ndim < 2:  # biases 0, norm gains 1
                nn.init.constant_(p, 0.0 if name.endswith("bias") else 1.0)
            elif name.endswith("proj.weight") or name == "head.weight":
                # the layers that write to the residual stream, and an untied head, start at zero (as in
                # modded-nanogpt): each block starts as the identity, and the first logits are all 0, so step 0's
                # loss is ln(vocab_size) exactly. The first step then trains the head alone (a zero head passes
                # no gradient back), and the blocks from the second on
                nn.init.zeros_(p)
            elif name.startswith("blocks."):
                # muP: a hidden weight's fan_in grows with the width, so its std falls by sqrt(m) to keep each
                # output's variance
                nn.init.normal_(p, std=c.init_std / math.sqrt(width_mult(c)))
            else:  # embeddings: their fan_in is a one-hot row choice, not the width
                nn.init.normal_(p, std=c.init_std)
        cos, sin = rope_tables(c.seq_len, c.n_embd // c.n_head, c.rope_base, self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, idx, targets=None, z_loss=0.0, cache=None, reduction="mean"):
        """idx (B, T) -> logits (B, T, V), or the loss of targets (-100: none)."""
        x, w = self.hidden(idx, cache)  # (B, T, n_embd), the head's weight (rows, n_embd)
        if targets is not None:
            return self.loss(x, w, targets, z_loss, reduction)
        if cache is not None:
            cache.pos += idx.size(1)
        return self.logits(x, w)

    def loss(self, x, w, targets, z_loss=0.0, reduction="mean"):
        """Cross-entropy (+ z-loss) of hidden states x, head w."""
        if torch.is_autocast_enabled(x.device.type):  # the precision F.linear would get under autocast
            dt = torch.get_autocast_dtype(x.device.type)
            x = x.to(dt)
            w = w.to(dt)
        # The head and the loss run together, in chunks of rows (kernels.linear_cross_entropy): all (B*T, V) logits
        # are never in memory at once. At gpt2_124m a micro-step's would be 32 x 1024 rows x 50,304 in fp32, 6.6 GB,
        # and their gradient as much again. z_loss adds z_loss * logsumexp(logits)^2, which keeps the softmax's
        # normaliser near 1 and the logits from drifting (PaLM, Chowdhery et al. 2022)
        x = x.flatten(0, 1)  # (B*T, n_embd)
        y = targets.reshape(-1)  # (B*T,)
        cap = self.cfg.logit_softcap or None
        keep = slice(None)  # all rows
        if reduction == "none":  # eval_gpt.py's per-token losses: only the rows that have a target go to the kernel
            keep = y != -100
        out = kernels.linear_cross_entropy(x[keep], w, y[keep], softcap=cap, z_loss=z_loss,
                                           reduction=reduction, classes=self.vocab_size)
        if reduction != "none":
            return out
        return out.new_zeros(y.shape).masked_scatter(keep, out)  # (B*T,), 0 where no target

    def logits(self, x, w):
        """fp32 logits (..., vocab_size) of hidden states x."""
        # the matmul keeps the padding rows (a fast shape); the result drops them, so they are never sampled
        logits = F.linear(x, w)  # (..., rows)
        logits = logits[..., :self.vocab_size].float()
        cap = self.cfg.logit_softcap
        return cap * torch.tanh(logits / cap) if cap else logits

    def hidden(self, idx, cache=None):
        """(hidden states (B, T, d), head weight) of idx (B, T)."""
        B, T = idx.shape
        pos = 0
        if cache is not None:  # sampling: idx continues at the cache's position
            pos = cache.pos
        cos = self.cos[pos:pos + T]  # (T, hd)
        sin = self.sin[pos:pos + T]
        x = self.wte(idx)  # (B, T, d)
        if self.wpe is not None:  # GPT-2's positions, not RoPE
            x = x + self.wpe(torch.arange(pos, pos + T, device=idx.device))
            cos = sin = None
        for i, block in enumerate(self.blocks):
            ve = None
            if str(i) in self.value_embeds:
                ve = self.value_embeds[str(i)](idx)  # (B, T, kv)
            x = block(x, cos, sin, cache, ve)
        # muP's 1/m on the output: the head's update lines up with its input x, so the logits would move m times
        # further at m times the width
        x = self.norm(x) / width_mult(self.cfg)
        if self.head is None:  # tied: the input embedding is the head
            return x, self.wte.weight
        return x, self.head.weight

    def flops_per_token(self):
        """Training FLOPs a token: 6 a weight, + attention (PaLM)."""
        # 2 a weight forward (a multiply and an add) and 4 backward (the grads of the input and of the weight), for
        # every weight in a matmul; plus attention's scores and weighted sum, 12 * n_layer * n_embd * seq_len (PaLM,
        # Chowdhery et al. 2022, appendix B). FlopCounterMode counts 2.2% more at gpt2_124m (tests/test_compile.py):
        # the scores a flash backward recomputes, which MFU leaves out
        n = sum(p.numel() for p in self.parameters())
        # a lookup is no matmul: the input embedding (unless tied: then it is also the head) and GPT-2's positions
        if self.head is not None:
            n -= self.wte.weight.numel()
        if self.wpe is not None:
            n -= self.wpe.weight.numel()
        n -= sum(p.numel() for p in self.value_embeds.parameters())
        c = self.cfg
        attention = 12 * c.n_layer * c.n_embd * c.seq_len
        return 6 * n + attention

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, top_k=50, generator=None):
        """idx (B, T0) and max_new_tokens sampled, with a KV cache."""
        out = idx
        T = self.cfg.seq_len
        cache = None
        with torch.compiler.set_stance("force_eager"):  # a compiled model would recompile for every length
            for i in range(max_new_tokens):
                if cache is None or cache.pos >= T:
                    # (re)fill a cache from the text so far: the prompt's last T tokens, then, each time the cache
                    # is full, the last T/2, so that a refill comes once every T/2 new tokens
                    keep = T if i == 0 else T // 2
                    cache = KVCache(len(self.blocks), T)
                    logits = self(out[:, -keep:], cache=cache)
                logits = logits[:, -1, :]  # (B, V): the next token's
                if temperature == 0:
                    nxt = logits.argmax(-1, keepdim=True)
                else:
                    logits = logits / temperature
                    if top_k:  # only the k likeliest stay; the rest get probability 0
                        k = min(top_k, logits.size(-1))
                        kth = torch.topk(logits, k).values[:, -1:]  # (B, 1): the k-th largest
                        logits = logits.masked_fill(logits < kth, -math.inf)
                    nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)  # (B, 1)
                out = torch.cat((out, nxt), dim=1)
                if i + 1 < max_new_tokens and cache.pos < T:  # one new position through the cache
                    logits = self(nxt, cache=cache)
            return out

def build_model(cfg, vocab_size, device, cls=GPT):
    """Build on meta, materialise on device, init under cfg.seed."""
    # on the meta device, building allocates nothing and draws no random numbers (a 1B model would otherwise be
    # built and initialised once on the CPU); to_empty allocates it on the device, and init_weights sets it there,
    # under the seed: the same weights on every rank, and in every run with that seed
    with torch.device("meta"):
        model = cls(cfg, vocab_size)
    model.to_empty(device=device)
    torch.manual_seed(cfg.seed)
    model.init_weights()
    return model

# -----------------------------------------------------------------------------
# Data

# llm.c's shard format, which prepare_data.py writes: a header of 256 int32 (1,024 bytes) that starts with the magic
# number, the version and the token count, then the tokens as uint16
MAGIC = 20240520
VERSION = 1
HEADER_BYTES = 1024

def open_shard(path):
    """Memory-map llm.c's shard (int32 header, uint16 tokens) or nanoGPT's .bin."""
    # a memory map reads nothing up front: the OS pages in the rows a step touches, so a corpus may outgrow memory
    size = os.path.getsize(path)
    header = [0] * 3
    if size >= HEADER_BYTES:
        header = np.fromfile(path, dtype="<i4", count=3).tolist()
    magic, version, n = header
    if size == 0 or (magic == MAGIC and n == 0):
        die(f"{path} is empty: give that split tokens, or re-run prepare_data.py")
    if magic == MAGIC:
        if version != VERSION or HEADER_BYTES + 2 * n != size:
            die(f"{path}: corrupt shard ({n} tokens, {size} bytes); re-run prepare_data.py")
        return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(n,))
    if os.path.basename(path) in ("train.bin", "val.bin") and size % 2 == 0:
        return np.memmap(path, dtype=np.uint16, mode="r")  # nanoGPT's: no header
    die(f"{path}: not a token shard; make shards with prepare_data.py")

def find_shards(data_dir, split):
    """A split's files: prepare_data.py's *{split}_NNNNNN.bin or nanoGPT's {split}.bin."""
    pattern = os.path.join(data_dir, f"*{split}_[0-9]*.bin")  # train_000001.bin, ...
    files = sorted(glob.glob(pattern))
    raw = os.path.join(data_dir, f"{split}.bin")
    return files or ([raw] if os.path.exists(raw) else [])

class PlainUnpickler(pickle.Unpickler):
    """Plain data only: a pickle runs code through the classes it names."""

    def find_class(self, module, name):
        raise pickle.UnpicklingError(f"it asks for {module}.{name}, in a meta.pkl of plain data")

def load_meta(data_dir):
    """A data dir's tokenizer and sizes: meta.json, or nanoGPT's meta.pkl or defaults."""
    if not os.path.isdir(data_dir):
        die(f"data dir {data_dir!r} does not exist; make it with prepare_data.py")
    path = os.path.join(data_dir, "meta.json")
    pkl = os.path.join(data_dir, "meta.pkl")
    # a data dir may come from anyone, so what it holds is checked before use: exit_if_unreadable(path,
    # fix) turns an error in its block into one line that names the file and the fix, and exits
    if os.path.exists(path):
        with exit_if_unreadable(path, "re-run prepare_data.py for this data dir"), open(path) as f:
            meta = json.load(f)
            if "vocab_size" not in meta and "image_size" in meta:  # prepare_data.py's images
                die(f"data dir {data_dir!r} holds images, which train_vit.py and train_diffusion.py read; give "
                    f"--data_dir token shards: python prepare_data.py text FILES... --data_dir=data/mine")
            val = meta.get("splits", {}).get("val", {})
            file = meta.get("tokenizer_file") or "x"  # a file name inside data_dir, not a path out of it
            nums = [val.get("tokens", 0), val.get("bytes", 0)]
            nums += [meta.get(f"val_{t}_bpb") or 0 for t in ("gzip", "xz")]
            if not (isinstance(meta["vocab_size"], int)
                    and meta["vocab_size"] > 0
                    and os.path.basename(file) == file
                    and isinstance(meta["eot_id"], (int, type(None)))
                    and all(isinstance(v, (int, float)) for v in nums)):
                raise ValueError("vocab_size, eot_id, val sizes, gzip/xz or tokenizer_file amiss")
    elif os.path.exists(os.path.join(data_dir, "train.bin")):  # nanoGPT's layout
        meta = {"tokenizer": "gpt2", "vocab_size": 50257, "eot_id": 50256, "splits": {}}
        if os.path.exists(pkl):  # nanoGPT's character-level data: its vocabulary
            with exit_if_unreadable(pkl, "give nanoGPT's meta.pkl, or none"), open(pkl, "rb") as f:
                m = PlainUnpickler(f).load()
                itos = m.get("itos") or None
                n = m["vocab_size"]
                pairs = (itos or {}).items()
                if not (isinstance(n, int)
                        and n > 0
                        and all(isinstance(i, int) and isinstance(c, str) for i, c in pairs)):
                    raise ValueError("need vocab_size > 0 and itos of integers to strings")
                kind = "ids"  # neither characters nor bytes: the ids' text is unknown, and samples show numbers
                if itos:
                    kind = "chars"
                elif n == 256:
                    kind = "byte"
                meta.update(tokenizer=kind, vocab_size=n, eot_id=None, itos=itos)
    else:
        die(f"data dir {data_dir!r} has no meta.json or train.bin; use prepare_data.py")
    for split in ("train", "val"):
        if not find_shards(data_dir, split):
            die(f"data dir {data_dir!r} has no {split} shards; re-run prepare_data.py")
    return meta

class TokenLoader:
    """(B, T) batches a rank, from memory-mapped shards, in an order shuffled anew each epoch; a resumed run reads
    what an uninterrupted one would.

    The rows: a shard is cut into rows of T + 1 tokens, T apart (a row's last target is the next row's first
    input, so each token is a target once an epoch). An epoch reads each shard's rows in a random order drawn from
    (seed, epoch, shard), and a step takes the next B x world_size of them. So a batch holds far-apart text, and no
    step reads the continuation of the last one's rows. (Reading each row's continuation in the next step, as this
    loader once did, made consecutive batches nearly alike: the CPU demo ended 0.18 bits per byte worse at 697
    steps, BENCHMARKS.md.) The whole position is three integers (the epoch, the shard, the rows read), which a
    checkpoint stores: that is how a resume replays exactly, since the order is drawn again from the same seed.
    Each rank walks all the rows of a step and keeps its own B, so every rank's loader is in the same state."""

    def __init__(self, files, B, T, rank, world_size, device, seed=0, vocab_size=65536):
        self.files = files
        self.B = B
        self.T = T
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.seed = seed
        self.vocab_size = vocab_size
        self.maps = [open_shard(f) for f in files]  # a memory map of each shard's tokens
        most = max(len(m) for m in self.maps)
        if most < T + 1:
            die(f"{files[0]}: shards of {most} tokens are shorter than --seq_len+1; lower it")
        self.load_state({"epoch": 0, "shard": 0, "row": 0})

    def state(self):
        """The position of the next batch: a checkpoint that stores it reads on from there."""
        return {"epoch": self.epoch, "shard": self.shard, "row": self.row}

    def load_state(self, s):
        """Go to a saved position. (A checkpoint of the earlier loader, whose position was its lanes' offsets, has no
        "row": it starts its shard over.)"""
        self.start_shard(int(s["epoch"]), int(s["shard"]))
        self.row = int(s.get("row", 0))  # the rows of this shard read so far this epoch
        if not 0 <= self.row <= len(self.order):
            raise ValueError(f"the loader position {s} does not fit these shards")

    def start_shard(self, epoch, shard):
        """Read shard from its first row in epoch's order."""
        if not 0 <= shard < len(self.maps):
            raise ValueError(f"the loader position (epoch {epoch}, shard {shard}) does not fit these shards")
        self.epoch = epoch
        self.shard = shard
        self.row = 0
        rows = (len(self.maps[shard]) - 1) // self.T  # a shorter shard has none: the next one is read
        # the order comes from the position alone, so a resume draws it again (numpy takes no negative seed)
        rng = np.random.default_rng([self.seed % 2**32, epoch, shard])
        self.order = rng.permutation(rows)

    def next_row(self):
        """(shard, start) of the next row in this epoch's order."""
        while self.row == len(self.order):
            # this shard is read: on to the next (a new epoch after the last)
            shard = (self.shard + 1) % len(self.maps)
            self.start_shard(self.epoch + (shard == 0), shard)
        start = int(self.order[self.row]) * self.T
        self.row += 1
        return self.shard, start

    def next(self, T=None):
        """This rank's next (x, y), (B, T) int64 each: a shorter T gives more rows."""
        # --seq_len_warmup: at a shorter T, more rows, so that a step keeps its tokens; each reads the first T + 1
        # tokens of a row, and the rest of that row goes unread this epoch
        T = T or self.T
        B = self.B * self.T // T
        rows = [self.next_row() for _ in range(B * self.world_size)]  # every rank's, so all stay in step
        mine = rows[self.rank * B:(self.rank + 1) * B]
        buf = np.stack([self.maps[s][p:p + T + 1] for s, p in mine])  # (B, T + 1) uint16
        # an id past the embedding would index out of range: a crash on a CPU, a device-side assert on CUDA
        if buf.max() >= self.vocab_size:
            die(f"{self.files[mine[0][0]]}: token id {buf.max()} >= vocab size {self.vocab_size}; "
                f"re-run prepare_data.py, or raise --vocab_size")
        buf = torch.from_numpy(buf.astype(np.int64))
        if self.device.type == "cuda":
            # pinned (page-locked) memory lets the copy to the GPU run while it computes (non_blocking)
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        else:
            buf = buf.to(self.device)
        return buf[:, :-1], buf[:, 1:]  # inputs and targets, (B, T) each: the same tokens shifted by one

# A tokenizer is a pair of functions: encode (text -> ids) and decode (ids -> text), for the samples at evals and
# for the companions. Which pair depends on what prepared the data: bytes, nanoGPT's characters, GPT-2's BPE
# (tiktoken), or prepare_data.py's own BPE, whose ranks travel in every checkpoint

def encode_ids(s):
    """Token ids written as numbers, '17 42': the text of a tokenizer we lack."""
    return [int(t) for t in s.split() if t.isdigit()]

def load_tokenizer(tok):
    """(encode, decode) of the tokenizer that meta.json and checkpoints describe."""
    name = tok.get("tokenizer")
    itos = tok.get("itos")
    if name == "byte":
        encode = lambda s: list(s.encode())
        decode = lambda ids: bytes(i for i in ids if i < 256).decode(errors="replace")  # EOT, 256, is no byte
        return encode, decode
    if itos:  # nanoGPT's characters
        stoi = {c: i for i, c in itos.items()}
        encode = lambda s: [stoi[c] for c in s if c in stoi]  # characters it lacks are left out
        decode = lambda ids: "".join(itos.get(i, "") for i in ids)
        return encode, decode
    import tiktoken
    if name == "gpt2":
        try:
            enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # noqa: BLE001 - offline, no cached files
            print(f"warning: no gpt2 tokenizer ({type(e).__name__}); samples show token ids")
            name = None
    if name and name.startswith("bpe") and tok.get("ranks"):
        # tiktoken's file format: one "base64(bytes) rank" a line, ranks 0, 1, 2, ... in merge order
        lines = map(str.split, tok["ranks"].splitlines())
        ranks = {base64.b64decode(t, validate=True): int(r) for t, r in lines}
        if (sorted(ranks.values()) != list(range(len(ranks)))
                or tok["eot_id"] != len(ranks)
                or not isinstance(tok["pat_str"], str)):  # tiktoken would panic
            raise ValueError("its ranks are not 0, 1, 2, ..., then the end-of-text id")
        enc = tiktoken.Encoding(name, pat_str=tok["pat_str"], mergeable_ranks=ranks,
                                special_tokens={"<|endoftext|>": tok["eot_id"]})
    elif name != "gpt2":  # unknown (meta.pkl's vocab_size only), or not loaded
        return encode_ids, (lambda ids: " ".join(map(str, ids)))
    return enc.encode_ordinary, (lambda ids: enc.decode([i for i in ids if i < enc.n_vocab]))

def tokenizer_info(data_dir, meta):
    """What rebuilds the tokenizer; it goes in every checkpoint."""
    info = {k: meta.get(k) for k in ("tokenizer", "eot_id", "pat_str", "itos")}
    if meta.get("tokenizer_file"):
        with open(os.path.join(data_dir, meta["tokenizer_file"])) as f:
            info["ranks"] = f.read()
    return info

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

def build_optimizers(cfg, raw, dtype=torch.float32):
    """Muon on hidden matrices, AdamW on the rest (or all); decay on hidden ones only."""
    # Who gets Muon: Muon (Keller Jordan 2024) orthogonalises a matrix's update, setting all its singular values to
    # 1, so that no direction of the map from inputs to outputs takes the whole step. That means something for the
    # 2-D matrices inside the blocks, which map one activation to another. It means nothing for a vector (norm
    # gains, biases), and it is wrong for a lookup table: an embedding's rows are separate tokens, each moved only
    # when it occurs, and orthogonalising would mix them. The head stays with AdamW too, as Muon's README advises. So
    # Muon takes the hidden matrices and AdamW the embeddings, the head, the gains and the biases; the Muon class
    # above scales its update to AdamW's RMS (Moonlight, Liu et al. 2025), so that one --lr serves both.
    named = {n: p for n, p in raw.named_parameters() if p.requires_grad}  # LoRA: adapters
    # The embedding's own LR: a row moves only in steps where its token occurs. A BPE's vocabulary is mostly rare
    # tokens, whose rows see few updates, and 10x the LR made up for it: -0.047 bits per byte on the 4,353-token
    # BPE, while on 257 bytes, each row seen every step, it cost +0.056 (BENCHMARKS.md, "CPU recipe"). So auto
    # means 10x under Muon with 1,024 rows or more. Tied, the embedding is also the head, which every step
    # trains, and it keeps lr.
    bpe = cfg.optimizer == "muon" and raw.wte.weight.shape[0] >= 1024
    embed_lr = cfg.embed_lr
    if not embed_lr and bpe:
        embed_lr = 10 * cfg.lr
    own = embed_lr > 0 and not cfg.tie_embeddings and "wte.weight" in named
    embed = []
    if own:
        # the value embeddings (--value_embeds) are token tables too, with the same rare rows
        tables = [n for n in named if n == "wte.weight" or n.startswith("value_embeds.")]
        params = [named.pop(n) for n in tables]
        embed = [dict(params=params, lr=embed_lr, weight_decay=0.0)]
    # weight decay pulls the hidden matrices only: decayed, a norm's gain or an embedding's rare row would shrink
    # toward 0 between the steps that train it
    hidden = []
    rest = []
    for n, p in named.items():
        if p.ndim == 2 and n.startswith("blocks."):  # a matrix inside a block
            hidden.append(p)
        else:
            rest.append(p)
    if cfg.optimizer == "muon":
        # muP: Muon's update has a spectral norm of about 0.2 sqrt(max(rows, cols)) lr, which grows as sqrt(m)
        # with the width; lr / sqrt(m) holds it where base_width had it. Newton-Schulz runs in bf16 only if the
        # run does
        ns_dtype = torch.bfloat16 if dtype == torch.bfloat16 else torch.float32
        lr = cfg.lr / math.sqrt(width_mult(cfg))
        opts = [Muon(hidden, lr=lr, weight_decay=cfg.weight_decay, ns_dtype=ns_dtype)]
        groups = [dict(params=rest), *embed]
    else:
        # muP (Tensor Programs V, Table 3): Adam moves each weight by about lr, so a hidden unit, summing fan_in
        # of them in step with its input, moves by about fan_in x lr; lr / m holds that as the width grows. The
        # embeddings and the head keep lr: the head's 1/m is in the forward pass (GPT.hidden)
        lr = cfg.lr / width_mult(cfg)
        opts = []
        groups = [dict(params=hidden, weight_decay=cfg.weight_decay, lr=lr),  # the hidden matrices
                  dict(params=rest),  # the head, the gains and the biases (and the embedding unless *embed)
                  *embed]
    groups = [g for g in groups if g["params"]]  # none: LoRA under Muon
    if groups:
        opts.append(AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=0.0))
    # the schedule multiplies each group's own peak: the embedding's 10x and muP's scaled LRs stay in proportion
    for opt in opts:
        for g in opt.param_groups:
            g["peak_lr"] = g["lr"]
    return opts

def seq_len_at(cfg, step):
    """--seq_len_warmup's length at step (Li et al. 2022): linear, in multiples of 64
    that divide batch_size x seq_len, so every step keeps its tokens."""
    # Short sequences first: early in training, long ones make the gradient noisy and the run unstable, where
    # short ones give steadier, cheaper steps (Li et al. 2022, "The Stability-Efficiency Dilemma"). The loader
    # reads more rows of the shorter length, so the tokens a step, and with them the LR schedule and the token
    # budget, stay put. Multiples of 64 keep the shapes fast and few: each new one costs torch.compile a recompile
    if step >= cfg.seq_len_warmup:
        return cfg.seq_len
    t = cfg.seq_len_start + (cfg.seq_len - cfg.seq_len_start) * step / cfg.seq_len_warmup
    tokens = cfg.batch_size * cfg.seq_len  # a rank's tokens a micro-step, at every length
    return max(T for T in range(64, int(t) + 1, 64) if tokens % T == 0)

def lr_mult(cfg, step, progress):
    """Linear warmup, then cosine, WSD or no decay over progress in [0, 1]."""
    # progress is the share of the run done: of its steps, or of its seconds under --time_budget, so the decay
    # ends when the run does. The warmup ramps the LR up over the first steps, while Adam's second moments are
    # still poor estimates and the first updates would be too large
    warm = 1.0
    if cfg.warmup_steps:
        warm = min(1.0, (step + 1) / cfg.warmup_steps)
    p = min(max(progress, 0.0), 1.0)
    f = cfg.final_lr_frac
    if cfg.schedule == "cosine":  # half a cosine, from the peak down to f of it (Loshchilov & Hutter 2017)
        return warm * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * p)))
    if cfg.schedule == "wsd" and p >= 1 - cfg.cooldown_frac:
        # WSD, warmup-stable-decay (Hu et al. 2024, MiniCPM): the peak LR holds until the last cooldown_frac of the
        # run, then falls linearly to f. A checkpoint of the stable phase can be cooled down to a finished model
        # at any point, so one run serves several budgets
        return warm * (f + (1 - f) * (1 - p) / cfg.cooldown_frac)
    return warm

# -----------------------------------------------------------------------------
# System: devices, precision, compile, DDP/FSDP2, grad sync (shared by every train_*.py)

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

def evaluate(cfg, model, loader, ctx, world_size, meta, step, final=False):
    """Val loss, perplexity and bits per byte on eval_tokens (<= 4M at the end)."""
    have = sum(len(m) for m in loader.maps)
    per_batch = cfg.batch_size * cfg.seq_len * world_size
    # --eval_tokens at each eval; the final one reads the whole split, up to 4M tokens, so that the
    # run's last figure is the most exact one
    n = max(1, (min(have, 1 << 22) if final else cfg.eval_tokens) // per_batch)
    loader.load_state({"epoch": 0, "shard": 0})  # every eval reads the same batches
    model.eval()
    total = torch.zeros((), device=loader.device)
    with torch.no_grad():
        for _ in range(n):
            x, y = loader.next()
            with ctx:
                total += model(x, y).float()
    model.train()
    loss = all_mean(total / n, world_size).item()  # nats a token
    rec = {"val_loss": loss, "val_ppl": math.exp(min(loss, 50))}
    line = f"eval {step:05d} | val loss {loss:.4f} | ppl {rec['val_ppl']:.2f}"
    # Bits per byte compare across tokenizers, where a loss a token does not: a larger vocabulary
    # has fewer, harder tokens. nats a token / ln 2 x tokens a byte of the val split's text
    val = meta.get("splits", {}).get("val", {})
    if val.get("bytes"):
        rec["val_tokens_per_byte"] = val["tokens"] / val["bytes"]
        rec["val_bpb"] = loss / math.log(2) * rec["val_tokens_per_byte"]
        line += f" | val bpb {rec['val_bpb']:.4f}"
    if final:
        line += f" | {n * per_batch} tokens"
        if n * per_batch > have:
            line += f" (the val split has {have}: read more than once)"
    print(line)
    return rec

def sample(model, tok, n_tokens, temperature, top_k, seed, prompt=""):
    """Text sampled after prompt (or an end-of-text token), with a KV cache."""
    encode, decode = load_tokenizer(tok)
    eot = tok.get("eot_id")
    ids = encode(prompt)
    if prompt and not ids:
        hint = " (give token ids, e.g. --prompt='17 42')" if encode is encode_ids else ""
        die(f"--prompt={prompt!r}: none of its characters is in the {tok['tokenizer']} vocabulary{hint}")
    # The text starts after an end-of-text token, as a document in the training data does (and
    # the EOT is cut from the text shown). Data without one (nanoGPT's characters) starts from
    # the prompt, or else from a newline, as nanoGPT's sample.py does, or else from token 0
    if eot is not None:
        ids = [eot] + ids
    if not ids:
        ids = encode("\n")[:1] or [0]
    device = next(model.parameters()).device
    out = model.generate(torch.tensor([ids], device=device), n_tokens, temperature, top_k,
                         torch.Generator(device).manual_seed(seed))[0]  # (len(ids) + n_tokens,)
    shown = out[1:] if eot is not None else out
    return out.tolist(), decode(shown.tolist())

def sum_of_squares(tensors):
    """The sum of the squares of every element (FSDP2 shards gathered): a norm, squared."""
    return sum(full(t.detach().float().square().sum()) for t in tensors)

def layer_stats(raw, x, ctx):
    """Per layer, |grad| / |weight| and its output's RMS on x: early warnings."""
    # Two early warnings of a run going wrong, recorded at every eval: a layer whose update is large
    # against its weights (grad_ratio, the last step's grads, before the LR) is moving too fast,
    # and an activation RMS that grows layer by layer means the residual stream is blowing up
    outputs = [raw.wte, *raw.blocks]  # (B, T, n_embd) each
    layers = list(outputs)
    if raw.head is not None:
        layers.append(raw.head)
    stats = {}
    if all(p.grad is not None for p in raw.parameters()):
        ratios = [(sum_of_squares(p.grad for p in m.parameters()) / sum_of_squares(m.parameters())).sqrt()
                  for m in layers]
        stats["grad_ratio"] = torch.stack(ratios).tolist()
    rms = []

    def keep_rms(module, inputs, output):  # a forward hook: it sees each layer's output
        rms.append(output.float().square().mean().sqrt())
    hooks = [m.register_forward_hook(keep_rms) for m in outputs]
    with torch.no_grad(), ctx, torch.compiler.set_stance("force_eager"):
        raw(x[:1])  # one row is enough for an RMS
    for h in hooks:
        h.remove()
    stats["act_rms"] = torch.stack(rms).tolist()
    return stats

def evaluate_and_sample(cfg, model, raw, val_loader, ctx, world_size, meta, tokenizer, x, step, final):
    """(the eval's record, each layer's statistics): a text sample printed, the val loss and bits
    per byte, and the statistics (early warnings of a run going wrong), side paths that
    warn but never stop a run."""
    if cfg.sample_tokens:  # on every rank: an FSDP forward needs them all
        out = side_path("sampling", sample, raw, tokenizer, cfg.sample_tokens, cfg.temperature, cfg.top_k, cfg.seed)
        if out:
            print("-" * 40 + "\n" + out[1] + "\n" + "-" * 40)
    # the eval line last, so that the loop prints the reference run's figures right below it
    rec = evaluate(cfg, model, val_loader, ctx, world_size, meta, step, final=final)
    stats = side_path("layer statistics", layer_stats, raw, x, ctx)  # on x, the next batch to train on
    return rec, stats or {}

def token_data(cfg):
    """(meta, tokenizer) of data_dir, checked."""
    meta = load_meta(cfg.data_dir)
    tokenizer_file = os.path.join(cfg.data_dir, meta.get("tokenizer_file") or "meta.json")
    with exit_if_unreadable(tokenizer_file, "re-run prepare_data.py"):
        tokenizer = tokenizer_info(cfg.data_dir, meta)
        load_tokenizer(tokenizer)  # a bad file fails now, not at the first sample
    return meta, tokenizer

def done_line(step, tokens_per_step, train_time, rec, metric, meta, out_dir):
    """The run's last line: steps, tokens, time, the final val metric, and, in bits per byte,
    how it compares with gzip -9 and xz -9 on the same val bytes (prepare_data.py measures them)."""
    line = (f"done: {step} steps, {step * tokens_per_step / 1e6:.1f}M tokens in {train_time:.0f} s | "
            f"{metric.replace('_', ' ')} {rec[metric]:.4f}")
    if "val_bpb" in rec:
        for tool in ("gzip", "xz"):
            if bpb := meta.get(f"val_{tool}_bpb"):
                line += f" | {tool} -9 {bpb:.3f} ({'beaten' if rec['val_bpb'] < bpb else 'not beaten'})"
    return line + f" | checkpoint in {out_dir} | plot: python scaling.py compare {out_dir}"

def run_layout(c, world_size, data_info):
    """What a resume shares, from a run's config dict c: shape, vocab, rows a step (not ranks: exact)."""
    c = {**OLDER_CHECKPOINTS, **c}
    B, T = c["batch_size"], c["seq_len"]
    accum = c["total_batch"] // (B * T * world_size) if c.get("total_batch") else c["grad_accum"]
    rows = B * accum * world_size
    return {
        **{k: c[k] for k in ARCH_FIELDS + ADAPT_FIELDS},
        "batch_size x grad_accum x ranks": rows,
        **data_info
    }

def train(cfg, stop, build=None, resume_fields=()):
    """Set up, resume, then the loop: evals and saves; micro-steps, clip, the guard, the update; the sync
    and its log line. build makes the model (finetune_gpt.py's: from other weights), and a resume must
    also match cfg's resume_fields (its adapters)."""
    rank, world_size, device = setup_dist(cfg.device)
    if rank:  # one rank prints: the others' lines would repeat its own
        sys.stdout = open(os.devnull, "w")
    wall0 = time.perf_counter()
    prepare_default_data(cfg, rank, world_size, *DEFAULT_DATA)  # a first run: the demo's data, made offline
    meta, tokenizer = token_data(cfg)
    vocab_size = cfg.vocab_size or meta["vocab_size"]
    if meta["vocab_size"] > vocab_size:
        die(f"the data has {meta['vocab_size']} tokens but --vocab_size={cfg.vocab_size}; "
            f"raise it or use 0 (from data)")

    # A step sees tokens_per_step tokens: B rows of T tokens on each of world_size ranks, in
    # accum micro-steps whose grads add up before the update (one big batch, in the memory of
    # one micro-batch). --total_batch fixes the tokens a step and derives accum from the ranks.
    # (After a CUDA out-of-memory error, main() starts again at half the B, the same tokens.)
    B, T = cfg.batch_size, cfg.seq_len
    accum = cfg.total_batch // (B * T * world_size) if cfg.total_batch else cfg.grad_accum
    tokens_per_step = B * T * accum * world_size
    # val's rows are shuffled too, by a fixed seed, so a short eval samples the whole split, the same rows each time
    loader = functools.partial(TokenLoader, B=B, T=T, rank=rank, world_size=world_size, device=device,
                               vocab_size=vocab_size)
    train_loader = loader(find_shards(cfg.data_dir, "train"), seed=cfg.seed)
    val_loader = loader(find_shards(cfg.data_dir, "val"), seed=0)

    # the model; the budget: steps (--max_steps, or --tokens / tokens a step), or seconds.
    # --tokens=auto is Chinchilla's 20 tokens a parameter (Hoffmann et al. 2022)
    raw = (build or build_model)(cfg, vocab_size, device)
    n_params = sum(p.numel() for p in raw.parameters())
    n_trained = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    n_tokens = 20 * n_params if cfg.tokens == "auto" else float(cfg.tokens or 0)
    max_steps = cfg.max_steps or math.ceil(n_tokens / tokens_per_step)
    time_budget = 0.0 if cfg.max_steps or n_tokens else cfg.time_budget

    # cfg settles here, before anything derives from it: the precision (auto: a resumed run's).
    # What a resume must match (run_layout): the shape, the rows a step, the data, resume_fields
    data_info = {"vocab_size": vocab_size, **{k: getattr(cfg, k) for k in resume_fields}}
    layout = run_layout(dataclasses.asdict(cfg), world_size, data_info)
    ckpt, path = resume_point(cfg.out_dir, cfg.resume, layout, rank == 0, max_steps, time_budget)
    dtype, ctx, scaler = setup_precision(device, cfg.dtype, ckpt)
    cfg = dataclasses.replace(cfg, dtype=str(dtype).removeprefix("torch."))
    # the wrapped model, the optimizers, the guard
    kernels.use(cfg.kernels)  # Triton's or PyTorch's ops, chosen before compile traces the model
    kernels.use_attention(cfg.attention)  # flex: a window skips the tiles it masks
    model, compiled = wrap_model(raw, cfg, device, dtype, world_size)
    opts = build_optimizers(cfg, raw, dtype)
    guard = Guard(cfg.loss_spike, cfg.gnorm_spike, cfg.guard_window, cfg.rollback_after, cfg.clip_mult, device)

    # the loop's state: these locals; a resume sets them, and the loader's place
    step, train_time, history = 0, 0.0, []
    if ckpt:
        with exit_if_unreadable(path, "it is not a checkpoint of this run; pass a new --out_dir"):
            step, train_time, history = apply_checkpoint(ckpt, raw, opts, scaler, guard)
            train_loader.load_state(ckpt["data"])
    # The loop reads each batch ahead, while the device computes the one before (nanoGPT's prefetch):
    # (x, y) is the batch held, and `at` where it starts in the data, which a checkpoint stores so
    # that a resume reads it again. The first is read now: bad data fails before any file is written
    at = train_loader.state()
    x, y = train_loader.next(seq_len_at(cfg, step))
    # the log: a line a log step, every value in metrics.jsonl; what a step is worth gives its speed and MFU
    log = start_log(cfg, rank == 0, tokens_per_step, "tok", raw.flops_per_token() * tokens_per_step, device, dtype)
    sharded = world_size > 1 and cfg.parallel == "fsdp"  # a folder of shards
    writer = CheckpointWriter(cfg.out_dir, cfg.keep_last, cfg.milestone_every, cfg.async_save, sharded, world_size,
                              rank == 0)
    budget = f"{time_budget:.0f} s" if time_budget else f"{max_steps} steps"
    print(f"{n_params / 1e6:.2f}M parameters | vocab {vocab_size} | {tokens_per_step} tokens/step "
          f"(B {B} x T {T} x accum {accum} x world {world_size}) | {budget} | {device} {dtype} | "
          f"compile {compiled} | kernels {kernels.backend(device)} | {cfg.optimizer} lr {cfg.lr:g} "
          f"{cfg.schedule}" + (f" | {n_trained / 1e6:.3f}M of them train" if n_trained < n_params else ""))

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
        # Evals (one at step 0: a val loss near ln(vocab) says the model starts untrained) and
        # saves, but not again at the step a resume or rollback starts from. The clock stopped
        # at the sync: they are not training time.
        final = last_step and not stopped  # a stopped run saves, and leaves the final eval to its resume
        # a periodic eval within a tenth of an interval of the end would only repeat the final one: skipped
        soon = steps_left(step, max_steps, train_time, time_budget, step_time) < cfg.eval_every / 10
        evals = final or (every(step, cfg.eval_every) and (step == 0 or step > first) and not soon)
        saves = last_step or (every(step, cfg.save_every) and step > first)
        if evals:
            rec, stats = evaluate_and_sample(cfg, model, raw, val_loader, ctx, world_size, meta, tokenizer, x,
                                             step, final)
            log.eval(final, step=step, **rec, **stats)
            history.append({"step": step, **rec})
        if saves:
            # The checkpoint is a dict built here and read back by apply_checkpoint. It holds all a resumed run
            # needs to go on as if never stopped: the guard's statistics, the loader's place, the train time.
            writer.save({**model_state(raw, opts, whole=not sharded), "scaler": scaler.state_dict(),
                         "step": step, "guard": guard.state(), "train_time": train_time, "history": history,
                         "data": at, "config": dataclasses.asdict(cfg), "world_size": world_size,
                         "data_info": data_info, "tokenizer": tokenizer})
        if last_step:
            break
        if evals or saves:
            t0 = time.perf_counter()  # start the clock again

        # one optimizer step: its LR, then accum micro-steps of one big batch
        if time_budget:  # the schedule follows the time, estimated since the sync
            progress = (train_time + len(trace) * step_time) / time_budget
        else:
            progress = step / max_steps
        mult = lr_mult(cfg, step, progress)
        for opt in opts:
            # zeroed here, not after the step: an eval's layer_stats reads the last step's grads
            opt.zero_grad(set_to_none=True)
            for g in opt.param_groups:
                g["lr"] = g["peak_lr"] * mult
        loss = torch.zeros((), device=device)  # the step's mean loss, on the device
        for micro in range(accum):
            # Under DDP a backward all-reduces the grads; only the last micro-step needs to,
            # so grad_sync turns it off for the others (FSDP2: its reduce-scatter likewise)
            with grad_sync(model, micro == accum - 1):
                with ctx:
                    micro_loss = model(x, y, cfg.z_loss) / accum  # the mean over micro-steps: one big batch
                # the next batch, read while the device computes: the last micro-step's is the next step's
                next_step = step + 1 if micro == accum - 1 else step
                at = train_loader.state()
                x, y = train_loader.next(seq_len_at(cfg, next_step))  # (B', T') tokens, their next tokens
                scaler.scale(micro_loss).backward()
            loss += micro_loss.detach()
        for opt in opts:
            scaler.unscale_(opt)
        gnorm = clip_grads(raw.parameters(), guard.clip(cfg.grad_clip))
        # The guard skips a bad step (a non-finite or spiking loss or grad norm, PaLM 5.1), and
        # decides on the device: asking the host would stall the device at every step. Its
        # verdict reaches the optimizers as a tensor: where it is not GOOD, AdamW's fused kernel
        # and our Muon leave the weights and their state as they were.
        loss = all_mean(loss, world_size)
        verdict = guard.check(loss, gnorm, scaler.is_enabled())
        for opt in opts:
            opt.step(skip=verdict != GOOD)
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
                step, train_time, history = apply_checkpoint(ckpt, raw, opts, scaler, guard)
                first = step  # the batches read since are skipped, not read again
                t0 = time.perf_counter()
        last_step = stopped or (train_time >= time_budget if time_budget else step >= max_steps)
        lossf, gnormf = rows[-1][:2]  # the step's loss and grad norm, on the host
        if step > first and (every(step, cfg.log_every) or last_step):  # (after a rollback: no new step yet)
            log.step(step, max_steps, time_budget, train_time, step_time, loss=lossf, lr=cfg.lr * mult, gnorm=gnormf)
            history.append({"step": step, "loss": lossf})

    # the end: how to resume after a signal, or the results
    writer.close(step)
    result = {"steps": step, "train_time": train_time, "wall_time": time.perf_counter() - wall0,
              "peak_mem_gb": log.peak_memory_gb(), "params": n_params, "trained_params": n_trained}
    if stopped:  # the checkpoint is saved: exit 0, and --resume goes on
        print(stop.preempted(step, cfg.out_dir))
        result = {"preempted": True, "steps": step, "train_time": train_time}
    else:
        metric = "val_bpb" if "val_bpb" in rec else "val_loss"
        result |= {**rec, "train_loss": lossf, "tokens": step * tokens_per_step}
        log.result(metric, result, cfg.description)
        print(done_line(step, tokens_per_step, train_time, rec, metric, meta, cfg.out_dir))
    return result

def check_config(cfg):
    """Reject impossible settings with a one-line message that names the fix."""
    check_choices(cfg)
    ones = "n_layer n_head n_embd seq_len batch_size grad_accum guard_window log_every rope_base".split()
    zeros = ("loss_spike gnorm_spike clip_mult rollback_after total_batch window window_pattern "
             "seq_len_warmup max_steps time_budget embed_lr warmup_steps n_kv_head eval_every "
             "save_every top_k temperature weight_decay init_std norm_eps").split()  # < 0: no end
    for k in ones + zeros:  # before the checks that divide by them
        if getattr(cfg, k) < (low := int(k in ones)):
            die(f"--{k} must be at least {low}, got {getattr(cfg, k)}")
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        fit = [h for h in range(1, cfg.n_embd + 1) if cfg.n_embd % h == 0 and (cfg.n_embd // h) % 2 == 0]
        die(f"--n_embd={cfg.n_embd} must split into {cfg.n_head} heads of even size (RoPE); "
            f"--n_head={'|'.join(map(str, fit))} would")
    if cfg.n_head % (cfg.n_kv_head or cfg.n_head):
        die(f"--n_head={cfg.n_head} must be a multiple of --n_kv_head={cfg.n_kv_head}")
    if cfg.mup and (cfg.tie_embeddings or cfg.base_width < 1):
        die("--mup needs --base_width >= 1 and untied embeddings: drop --tie_embeddings")
    if not (cfg.lr > 0 and 0 <= cfg.final_lr_frac <= 1 and 0 < cfg.cooldown_frac <= 1
            and 0 <= cfg.beta1 < 1 and 0 <= cfg.beta2 < 1):
        die("need --lr > 0, 0 <= --final_lr_frac <= 1, 0 < --cooldown_frac <= 1, 0 <= --beta1, --beta2 < 1")
    cuda = cfg.device in ("auto", "cuda") and torch.cuda.is_available()
    if cfg.attention == "flex" and not cuda:  # FlexAttention's backward runs on CUDA only
        die("--attention=flex needs a CUDA GPU (FlexAttention has no backward elsewhere); use --attention=sdpa")
    if cfg.seq_len_warmup and (cfg.seq_len % 64 or not 64 <= cfg.seq_len_start <= cfg.seq_len):
        die(f"--seq_len_warmup needs --seq_len a multiple of 64 (got {cfg.seq_len}) and "
            f"64 <= --seq_len_start <= --seq_len (got {cfg.seq_len_start})")
    ranks = int(os.environ.get("WORLD_SIZE", "1"))  # torchrun's, before setup_dist()
    if cfg.total_batch % (cfg.batch_size * cfg.seq_len * ranks):  # in whole micro-steps
        die(f"--total_batch={cfg.total_batch} is not a multiple of --batch_size x --seq_len x "
            f"ranks = {cfg.batch_size * cfg.seq_len * ranks}; change one of them")
    if cfg.tokens not in ("", "auto") and not re.fullmatch(r"(\d+\.?\d*|\.\d+)([eE]\+?\d+)?", cfg.tokens):
        die(f"--tokens={cfg.tokens} is neither a number >= 0 (e.g. 2.5e9) nor 'auto'")
    tokens = cfg.tokens == "auto" or float(cfg.tokens or 0) > 0
    if not (cfg.max_steps or tokens or cfg.time_budget > 0):
        die("no training budget: set --max_steps, --tokens (or --tokens=auto) or --time_budget")

def main(cfg, build=None, resume_fields=()):
    """Train per cfg; returns the final metrics. build and resume_fields: train()'s."""
    check_config(cfg)
    with StopSignal() as stop:  # SIGTERM or SIGINT: finish the step, save, exit 0
        while True:
            found = list_checkpoints(cfg.out_dir)
            try:
                result = train(cfg, stop, build, resume_fields)
                break
            except torch.cuda.OutOfMemoryError:  # nothing saved: the batch in halves
                if cfg.batch_size % 2 or "RANK" in os.environ or list_checkpoints(cfg.out_dir) != found:
                    raise  # under torchrun the other ranks are mid-step
                cfg = dataclasses.replace(cfg, batch_size=cfg.batch_size // 2, grad_accum=cfg.grad_accum * 2)
                flags = f"--batch_size={cfg.batch_size}"
                flags += "" if cfg.total_batch else f" --grad_accum={cfg.grad_accum}"
                print(f"out of GPU memory: starting again with {flags} (same tokens per step); "
                      f"pass {flags} next time")
            gc.collect()  # out here, where no traceback holds the tensors
            torch.cuda.empty_cache()
    leave_dist()
    return result

# -----------------------------------------------------------------------------
# Machinery, shared by every train_*.py: flags, logs, checkpoint I/O, rollbacks, signals

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
