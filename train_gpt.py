"""
train_gpt.py: a modern GPT, trained from scratch, in one file you can read top to bottom.

A decoder-only transformer (RoPE, RMSNorm pre-norm, QK-norm, SwiGLU, GQA, zero-init output projections) trained
on token shards from prepare_data.py with AdamW or Muon, warmup + cosine/WSD, bf16/fp16 mixed precision,
torch.compile, DDP or FSDP2, exact resume, and a KV-cache sampler.

  python train_gpt.py                                  # CPU demo: prepares the stdlib corpus, trains for ~4 min
  python train_gpt.py --preset=gpt2_124m --data_dir=data/fineweb10B
  torchrun --nproc_per_node=8 train_gpt.py --preset=gpt2_124m --data_dir=data/fineweb10B
  torchrun --nnodes=2 --nproc_per_node=8 --rdzv_backend=c10d --rdzv_endpoint=HOST:29500 train_gpt.py ...
  python train_gpt.py --sample --ckpt=out/gpt --prompt="def "
  python train_gpt.py --benchmark --preset=gpt2_124m
  python train_gpt.py -h                               # every flag, with its default
"""
import base64
import contextlib
import copy
import dataclasses
import difflib
import glob
import hashlib
import inspect
import json
import math
import os
import pickle
import re
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import kernels  # Triton attention, RMSNorm and fused linear + cross-entropy on CUDA; PyTorch elsewhere

# -----------------------------------------------------------------------------
# Config


@dataclass
class Config:
    # data and output
    data_dir: str = "data/stdlib"      # shards from prepare_data.py, or nanoGPT's train.bin/val.bin (+ meta.pkl)
    out_dir: str = "out/gpt"           # checkpoints, metrics.jsonl, config.json, loss.png; results.tsv goes beside it
    preset: str = ""                   # named overrides: cpu_demo|gpt2_124m|gpt2_350m (explicit flags still win)
    # model
    n_layer: int = 4                   # transformer blocks
    n_head: int = 4                    # query heads
    n_kv_head: int = 0                 # key/value heads (GQA); 0 = n_head (MHA), 1 = MQA
    n_embd: int = 128                  # model width
    seq_len: int = 128                 # context length in tokens
    vocab_size: int = 0                # 0 = from the data's meta; padded up to a multiple of 64 for fast matmuls
    mlp: str = "swiglu"                # swiglu|relu2|gelu
    norm: str = "rmsnorm"              # rmsnorm|layernorm (pre-norm either way)
    qk_norm: bool = True               # RMSNorm on queries and keys, bounds the attention logits
    tie_embeddings: bool = False       # share the input embedding with the output head
    logit_softcap: float = 0.0         # cap * tanh(logits / cap); 0 = off (Gemma 2 uses 30)
    rope_base: float = 10000.0         # RoPE theta
    init_std: float = 0.02             # std of the hidden weights at init; output projections and head start at zero
    mup: bool = False                  # maximal update parametrisation: the best LR transfers across width (see GPT)
    base_width: int = 128              # muP: the n_embd at which muP equals the standard parametrisation; tune LR here
    # budget: max_steps, else tokens, else time_budget
    max_steps: int = 0                 # optimizer steps; 0 = from tokens or time_budget
    tokens: str = ""                   # training tokens, e.g. 2.5e9, or auto = 20 x parameters (Chinchilla)
    time_budget: float = 240.0         # seconds of training (eval excluded); the LR schedule follows elapsed time
    batch_size: int = 16               # micro-batch per rank, in sequences
    grad_accum: int = 1                # micro-steps per optimizer step
    total_batch: int = 0               # tokens per optimizer step over all ranks; sets grad_accum; 0 = use grad_accum
    # optimizer and schedule
    optimizer: str = "adamw"           # adamw|muon (Muon on 2-D hidden matrices, AdamW on the rest)
    lr: float = 4e-3                   # peak LR; Muon's update RMS is matched to AdamW's, so one LR serves both
    weight_decay: float = 0.1          # decoupled, on 2-D hidden matrices only
    beta1: float = 0.9                 # AdamW
    beta2: float = 0.95                # AdamW
    grad_clip: float = 1.0             # max global grad norm; 0 = off
    z_loss: float = 0.0                # weight of logsumexp(logits)^2 (PaLM uses 1e-4); 0 = off
    schedule: str = "cosine"           # cosine|wsd|constant, after linear warmup
    warmup_steps: int = 20             # linear warmup, in optimizer steps
    cooldown_frac: float = 0.2         # wsd: fraction of the run spent in the final linear decay
    final_lr_frac: float = 0.1         # LR at the end of cosine/wsd, as a fraction of the peak
    # eval, logging, checkpoints
    eval_every: int = 250              # steps between evals; 0 = only at the end
    eval_tokens: int = 65536           # val tokens per periodic eval; the final eval reads up to 4M
    log_every: int = 25                # steps between log lines
    sample_tokens: int = 200           # tokens sampled at each eval; 0 = off
    save_every: int = 0                # steps between checkpoints; 0 = only at the end
    keep_last: int = 2                 # newest checkpoints kept (milestones are kept besides)
    milestone_every: int = 0           # keep every checkpoint whose step is a multiple of this; 0 = none
    async_save: bool = False           # write checkpoints in a background thread (from a CPU copy of the state)
    resume: bool = False               # continue from the newest complete checkpoint in out_dir (auto on torchrun restart)
    wandb: str = ""                    # wandb project name; empty = off
    description: str = ""              # free text for the results.tsv experiment log
    # guards: a bad step's update is skipped; repeated bad steps roll back (see "When training goes wrong", README)
    loss_spike: float = 6.0            # a loss this many running stds above its running mean is a spike; 0 = off
    gnorm_spike: float = 0.0           # the same for the grad norm; 0 = off
    clip_mult: float = 0.0             # dynamic clipping at this multiple of the running grad-norm mean; 0 = off
    guard_window: int = 100            # steps in the running statistics and in the bad-step count
    rollback_after: int = 5            # bad steps within guard_window that roll back to the last good checkpoint; 0 = never
    skip_data: str = ""                # TSV of token ranges (shard, start, end) never read, e.g. a rollback's skipped.tsv
    sharpness_every: int = 0           # steps between estimates of the top Hessian eigenvalue; 0 = off
    inject_fault: str = ""             # debug: KIND@STEP[-END][:RANK],... with KIND nan|spike|sigterm|kill
    # system
    device: str = "auto"               # auto|cpu|cuda|mps
    dtype: str = "auto"                # auto|bfloat16|float16|float32 (auto: bf16 on CUDA, fp16 if unsupported; else fp32)
    compile: str = "auto"              # auto|true|false (auto: on for CUDA on Linux)
    parallel: str = "ddp"              # ddp|fsdp, used under torchrun
    seed: int = 1337                   # init and sampling
    benchmark: bool = False            # time steps on synthetic tokens and exit; needs no data
    bench_steps: int = 20              # timed steps in --benchmark, after 5 warm-up steps
    # sampling
    mode: str = "train"                # train|sample
    sample: bool = False               # same as --mode=sample
    ckpt: str = ""                     # checkpoint file or directory to sample from; empty = out_dir
    prompt: str = ""                   # text to continue; empty = start of a document
    max_new_tokens: int = 500          # tokens to generate in sample mode
    temperature: float = 0.8           # 0 = greedy
    top_k: int = 50                    # sample among the k most likely tokens; 0 = all


PRESETS = {
    "cpu_demo": {},  # the defaults: 0.9M parameters, 240 s of training on a 2-core CPU
    "gpt2_124m": dict(n_layer=12, n_head=12, n_embd=768, seq_len=1024, batch_size=32, total_batch=1 << 19,
                      data_dir="data/fineweb10B", out_dir="out/gpt2_124m", time_budget=0.0, tokens="auto",
                      lr=6e-4, warmup_steps=700, eval_every=250, eval_tokens=1 << 20, save_every=2000),
    "gpt2_350m": dict(n_layer=24, n_head=16, n_embd=1024, seq_len=1024, batch_size=16, total_batch=1 << 19,
                      data_dir="data/fineweb10B", out_dir="out/gpt2_350m", time_budget=0.0, tokens="auto",
                      lr=3e-4, warmup_steps=700, eval_every=250, eval_tokens=1 << 20, save_every=2000),
}
ARCH_FIELDS = ("n_layer", "n_head", "n_kv_head", "n_embd", "seq_len", "mlp", "norm", "qk_norm",
               "tie_embeddings", "logit_softcap", "rope_base", "mup", "base_width")


def run_layout(c, world_size, vocab_real):
    """What a resumed run must share with its checkpoint, from a config dict: architecture, vocab and batch layout."""
    B, T = c["batch_size"], c["seq_len"]
    accum = c["total_batch"] // (B * T * world_size) if c.get("total_batch") else c["grad_accum"]
    return {**{k: c.get(k, getattr(Config, k)) for k in ARCH_FIELDS}, "batch_size": B, "grad_accum": accum, "world_size": world_size,
            "vocab": vocab_real}


def check_config(cfg):
    """Reject impossible settings with a one-line message that names the fix."""
    check_choices(cfg)
    kv = cfg.n_kv_head or cfg.n_head
    if cfg.n_embd % cfg.n_head or (cfg.n_embd // cfg.n_head) % 2:
        die(f"--n_embd={cfg.n_embd} must split into {cfg.n_head} heads of even size (RoPE); change --n_embd or --n_head")
    if cfg.n_head % kv:
        die(f"--n_head={cfg.n_head} must be a multiple of --n_kv_head={kv}")
    if cfg.mup and (cfg.tie_embeddings or cfg.base_width < 1):
        die("--mup needs --base_width >= 1 and untied embeddings (the input and output layers scale differently); "
            "drop --tie_embeddings")
    for k in ("n_layer", "n_head", "n_embd", "seq_len", "batch_size", "grad_accum", "guard_window"):
        if getattr(cfg, k) < 1:
            die(f"--{k} must be at least 1, got {getattr(cfg, k)}")
    if cfg.lr <= 0 or cfg.warmup_steps < 0 or not 0 <= cfg.final_lr_frac <= 1 or not 0 < cfg.cooldown_frac <= 1:
        die("need --lr > 0, --warmup_steps >= 0, 0 <= --final_lr_frac <= 1 and 0 < --cooldown_frac <= 1")
    if min(cfg.loss_spike, cfg.gnorm_spike, cfg.clip_mult, cfg.rollback_after, cfg.total_batch, cfg.sharpness_every) < 0:
        die("--loss_spike, --gnorm_spike, --clip_mult, --rollback_after, --total_batch and --sharpness_every must be >= 0")
    if not cfg.benchmark and not (cfg.max_steps or cfg.tokens or cfg.time_budget > 0):
        die("no training budget: set --max_steps, --tokens (or --tokens=auto) or --time_budget")
    if cfg.tokens and cfg.tokens != "auto":
        try:
            float(cfg.tokens)
        except ValueError:
            die(f"--tokens={cfg.tokens} is neither a number (e.g. 2.5e9) nor 'auto'")
    parse_faults(cfg.inject_fault)

# === shared: cli ===
def die(msg):
    """Stop with a one-line error and a non-zero exit (a SystemExit, so tests can catch it)."""
    raise SystemExit(f"{os.path.basename(sys.argv[0]) or 'train'}: error: {msg}")


def field_comments(cls):
    """{field: its trailing comment} of a dataclass: the text of -h, and the choices a|b|c a field may take."""
    return dict(re.findall(r"^\s+(\w+):[^#\n]*#\s*(.*)$", inspect.getsource(cls), re.M))


def check_choices(cfg):
    """A field whose comment starts with choices (a|b|c) must hold one of them."""
    for name, comment in field_comments(type(cfg)).items():
        m = re.match(r"[\w.]+(\|[\w.]+)+", comment)
        if m and str(getattr(cfg, name)) not in m[0].split("|"):
            die(f"--{name}={getattr(cfg, name)} is not one of {m[0]}")


def parse_args(cls, argv):
    """Build a Config from --key=value / --key value flags; -h lists every field, its default and its comment."""
    import argparse
    helps = field_comments(cls)
    fields = {f.name: f for f in dataclasses.fields(cls)}

    def to_bool(s):
        if s.lower() in ("1", "true", "yes", "on"):
            return True
        if s.lower() in ("0", "false", "no", "off"):
            return False
        raise argparse.ArgumentTypeError(f"expected true/false, got {s!r}")

    p = argparse.ArgumentParser(description=(sys.modules[cls.__module__].__doc__ or "").strip().split("\n")[0],
                                usage="%(prog)s [--key=value ...]", allow_abbrev=False, argument_default=argparse.SUPPRESS)
    p.error = lambda msg: sys.exit(f"{p.prog}: error: {msg} (see -h)")
    for name, f in fields.items():
        typ = to_bool if f.type in (bool, "bool") else {"int": int, "float": float, "str": str}.get(f.type, f.type)
        p.add_argument(f"--{name}", type=typ, nargs="?" if typ is to_bool else None, const=True if typ is to_bool else None,
                       metavar=name.upper(), help=f"{helps.get(name, '')} (default: {f.default!r})")
    args, unknown = p.parse_known_args(argv)
    for u in unknown:
        key = u.split("=")[0].lstrip("-")
        near = difflib.get_close_matches(key, fields, n=1)
        sys.exit(f"{p.prog}: error: unknown flag {u.split('=')[0]!r}" + (f"; did you mean --{near[0]}?" if near else " (see -h)"))
    given = vars(args)
    presets = getattr(sys.modules[cls.__module__], "PRESETS", {})
    name = given.get("preset", "")
    if name and name not in presets:
        sys.exit(f"{p.prog}: error: unknown --preset={name}; choose one of {', '.join(presets)}")
    return cls(**{**presets.get(name, {}), **given})
# === end shared ===

# -----------------------------------------------------------------------------
# Model


class Norm(nn.Module):
    """RMSNorm (default) or bias-free LayerNorm over the last dim, with a learnable gain."""

    def __init__(self, dim, kind="rmsnorm", eps=1e-6):
        super().__init__()
        self.kind, self.eps = kind, eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        if self.kind == "rmsnorm":
            return kernels.rms_norm(x, self.weight, self.eps)
        return F.layer_norm(x, (x.size(-1),), self.weight, None, self.eps)


def rope_tables(seq_len, head_dim, base, device):
    """cos and sin tables of rotary position embeddings (Su et al. 2021), each (seq_len, head_dim // 2), fp32."""
    inv_freq = 1.0 / base ** (torch.arange(0, head_dim, 2, device=device, dtype=torch.float32) / head_dim)
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    return freqs.cos(), freqs.sin()


def apply_rope(x, cos, sin):
    """Rotate pairs (x[i], x[i + D/2]) of x (B, H, T, D) by position-dependent angles."""
    x1, x2 = x.float().chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).type_as(x)


class KVCache:
    """Keys and values of past positions for fast sampling: one (B, n_kv_head, seq_len, head_dim) pair per layer."""

    def __init__(self, n_layer, max_len):
        self.k, self.v, self.pos, self.max_len = [None] * n_layer, [None] * n_layer, 0, max_len

    def update(self, layer, k, v):
        """Store k, v (B, Hkv, t, D) at positions pos..pos+t and return all keys and values so far."""
        if self.k[layer] is None:
            B, H, _, D = k.shape
            self.k[layer] = k.new_empty(B, H, self.max_len, D)
            self.v[layer] = v.new_empty(B, H, self.max_len, D)
        t = k.size(2)
        self.k[layer][:, :, self.pos:self.pos + t] = k
        self.v[layer][:, :, self.pos:self.pos + t] = v
        return self.k[layer][:, :, :self.pos + t], self.v[layer][:, :, :self.pos + t]


class Attention(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.layer, self.n_head, self.n_kv = layer, cfg.n_head, cfg.n_kv_head or cfg.n_head
        self.hd = cfg.n_embd // cfg.n_head
        # muP: logits q.k / d, not / sqrt(d), since trained q and k become correlated and q.k grows like d; written
        # as 1 / sqrt(d * m) it equals the usual 1 / sqrt(d) at the base width (head dim grows with width)
        self.scale = 1 / math.sqrt(self.hd * width_mult(cfg))
        self.qkv = nn.Linear(cfg.n_embd, (self.n_head + 2 * self.n_kv) * self.hd, bias=False)
        self.proj = nn.Linear(self.n_head * self.hd, cfg.n_embd, bias=False)
        self.q_norm = Norm(self.hd) if cfg.qk_norm else nn.Identity()
        self.k_norm = Norm(self.hd) if cfg.qk_norm else nn.Identity()

    def forward(self, x, cos, sin, cache=None):
        B, T, _ = x.shape
        q, k, v = self.qkv(x).split([self.n_head * self.hd, self.n_kv * self.hd, self.n_kv * self.hd], dim=-1)
        q = q.view(B, T, self.n_head, self.hd).transpose(1, 2)  # (B, nh, T, hd)
        k = k.view(B, T, self.n_kv, self.hd).transpose(1, 2)  # (B, nkv, T, hd)
        v = v.view(B, T, self.n_kv, self.hd).transpose(1, 2)
        q, k = apply_rope(self.q_norm(q), cos, sin), apply_rope(self.k_norm(k), cos, sin)
        if cache is not None:  # new queries are the last T positions: the causal mask lines up bottom-right
            k, v = cache.update(self.layer, k, v)
        # flash attention, scale 1/sqrt(head_dim); GQA shares each k/v head among n_head/n_kv query heads
        y = kernels.attention(q, k, v, causal=True, scale=self.scale)
        return self.proj(y.transpose(1, 2).reshape(B, T, -1))


class MLP(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        self.kind = cfg.mlp
        # SwiGLU has three matrices, so its hidden width is 2/3 of 4d to keep the parameter count (Shazeer 2020)
        hidden = 64 * math.ceil(8 * cfg.n_embd / 3 / 64) if cfg.mlp == "swiglu" else 4 * cfg.n_embd
        self.fc = nn.Linear(cfg.n_embd, 2 * hidden if cfg.mlp == "swiglu" else hidden, bias=False)
        self.proj = nn.Linear(hidden, cfg.n_embd, bias=False)

    def forward(self, x):
        h = self.fc(x)
        if self.kind == "swiglu":
            a, b = h.chunk(2, dim=-1)
            h = F.silu(a) * b
        elif self.kind == "relu2":  # ReLU squared (So et al. 2021, modded-nanogpt)
            h = F.relu(h).square()
        else:
            h = F.gelu(h, approximate="tanh")
        return self.proj(h)


class Block(nn.Module):
    def __init__(self, cfg, layer):
        super().__init__()
        self.norm1, self.attn = Norm(cfg.n_embd, cfg.norm), Attention(cfg, layer)
        self.norm2, self.mlp = Norm(cfg.n_embd, cfg.norm), MLP(cfg)

    def forward(self, x, cos, sin, cache=None):
        x = x + self.attn(self.norm1(x), cos, sin, cache)
        return x + self.mlp(self.norm2(x))


def width_mult(cfg):
    """muP's width multiplier m = n_embd / base_width; 1 under the standard parametrisation."""
    return cfg.n_embd / cfg.base_width if cfg.mup else 1.0


class GPT(nn.Module):
    """muP (Yang et al. 2022, "Tensor Programs V", Table 3, Adam column), with m = n_embd / base_width: hidden
    matrices start at std init_std / sqrt(m) (variance 1 / fan_in) and train at LR / m (build_optimizers); the
    embedding and the gains keep their init and LR; the head's output is multiplied by 1 / m; attention uses 1 / d.
    Every term is 1 at m = 1, so muP at the base width is this very model. `scaling.py coord_check` tests it."""

    def __init__(self, cfg, vocab_size):
        super().__init__()
        self.cfg, self.vocab_size = cfg, vocab_size
        self.wte = nn.Embedding(vocab_size, cfg.n_embd)
        self.blocks = nn.ModuleList(Block(cfg, i) for i in range(cfg.n_layer))
        self.norm = Norm(cfg.n_embd, cfg.norm)
        self.head = None if cfg.tie_embeddings else nn.Linear(cfg.n_embd, vocab_size, bias=False)
        cos, sin = rope_tables(cfg.seq_len, cfg.n_embd // cfg.n_head, cfg.rope_base, None)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    @torch.no_grad()
    def init_weights(self):
        """Initialise every parameter (the model is built on the meta device, so nothing is set before this)."""
        for name, p in self.named_parameters():
            if p.ndim < 2:
                nn.init.ones_(p)  # norm gains
            elif name.endswith("proj.weight") or name == "head.weight":
                nn.init.zeros_(p)  # each block starts as the identity and the first loss is ln(vocab)
            elif name.startswith("blocks."):  # hidden matrices: fan_in grows with width
                nn.init.normal_(p, std=self.cfg.init_std / math.sqrt(width_mult(self.cfg)))
            else:
                nn.init.normal_(p, std=self.cfg.init_std)  # the embedding: fan_in is the vocab, not the width
        cos, sin = rope_tables(self.cfg.seq_len, self.cfg.n_embd // self.cfg.n_head, self.cfg.rope_base, self.cos.device)
        self.cos.copy_(cos)
        self.sin.copy_(sin)

    def forward(self, idx, targets=None, z_loss=0.0, cache=None):
        """idx (B, T) token ids -> logits (B, T, V), or the mean loss (cross-entropy + z_loss term) given targets."""
        B, T = idx.shape
        pos = cache.pos if cache is not None else 0
        cos, sin = self.cos[pos:pos + T], self.sin[pos:pos + T]
        x = self.wte(idx)  # (B, T, d)
        for block in self.blocks:
            x = block(x, cos, sin, cache)
        x = self.norm(x) / width_mult(self.cfg)  # muP's output multiplier 1 / m (exactly 1 otherwise)
        w = self.wte.weight if self.head is None else self.head.weight
        cap = self.cfg.logit_softcap or None
        if targets is not None:  # head and loss fused in chunks: the (B*T, V) logits never exist at once;
            if torch.is_autocast_enabled(x.device.type):  # a custom op is not autocast: cast as F.linear would be
                dt = torch.get_autocast_dtype(x.device.type)
                x, w = x.to(dt), w.to(dt)
            # z_loss keeps the softmax normaliser near 1, which stabilises bf16 training (PaLM)
            return kernels.linear_cross_entropy(x.flatten(0, 1), w, targets.reshape(-1), softcap=cap, z_loss=z_loss)
        if cache is not None:
            cache.pos += T
        logits = F.linear(x, w).float()  # (B, T, V), the softmax in fp32 even under autocast
        return cap * torch.tanh(logits / cap) if cap else logits

    def flops_per_token(self):
        """Training FLOPs per token: 6 per weight that does a matmul, plus attention (PaLM appendix B)."""
        n = sum(p.numel() for p in self.parameters()) - (self.wte.weight.numel() if self.head is not None else 0)
        return 6 * n + 12 * self.cfg.n_layer * self.cfg.n_embd * self.cfg.seq_len

    @torch.no_grad()
    def generate(self, idx, max_new_tokens, temperature=0.8, top_k=50, vocab_real=None, generator=None):
        """Continue idx (B, T0) by max_new_tokens sampled tokens, with a KV cache; returns (B, T0 + max_new_tokens)."""
        was_training = self.training
        self.eval()
        with torch.compiler.set_stance("force_eager"):  # compiled blocks (FSDP) would recompile for every length
            out = self._sample(idx, max_new_tokens, temperature, top_k, vocab_real, generator)
        self.train(was_training)
        return out

    def _sample(self, out, max_new_tokens, temperature, top_k, vocab_real, generator):
        """The sampling loop of generate: prefill the cache with the context, then feed one token at a time."""
        T, cache = self.cfg.seq_len, None
        for i in range(max_new_tokens):
            if cache is None or cache.pos >= T:  # (re)fill the cache; when full, keep the last half of the context
                cache = KVCache(len(self.blocks), T)
                logits = self(out[:, -(T if i == 0 else T // 2):], cache=cache)
            logits = logits[:, -1, :]
            if vocab_real is not None:
                logits[:, vocab_real:] = -float("inf")  # never sample the padding of the vocab
            if temperature == 0:
                nxt = logits.argmax(-1, keepdim=True)
            else:
                logits = logits / temperature
                if top_k:
                    kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, -float("inf"))
                nxt = torch.multinomial(F.softmax(logits, -1), 1, generator=generator)
            out = torch.cat((out, nxt), dim=1)
            if i + 1 < max_new_tokens and cache.pos < T:
                logits = self(nxt, cache=cache)
        return out


def build_model(cfg, vocab_size, device):
    """Build on the meta device (no memory, no init cost), materialise on `device`, then initialise under cfg.seed."""
    with torch.device("meta"):
        model = GPT(cfg, vocab_size)
    model.to_empty(device=device)
    torch.manual_seed(cfg.seed)
    model.init_weights()
    return model

# -----------------------------------------------------------------------------
# Data

MAGIC, VERSION, HEADER_BYTES = 20240520, 1, 1024


def open_shard(path):
    """Memory-map one token file: llm.c format (256 int32 header, uint16 tokens) or nanoGPT's raw uint16 .bin."""
    size = os.path.getsize(path)
    header = np.fromfile(path, dtype="<i4", count=256) if size >= HEADER_BYTES else np.zeros(3, dtype="<i4")
    if header[0] == MAGIC:
        if header[1] != VERSION or HEADER_BYTES + 2 * int(header[2]) != size:
            die(f"{path}: corrupt shard (header says version {header[1]}, {header[2]} tokens, but the file has "
                f"{size} bytes); re-run prepare_data.py for this data dir")
        return np.memmap(path, dtype=np.uint16, mode="r", offset=HEADER_BYTES, shape=(int(header[2]),))
    if os.path.basename(path) in ("train.bin", "val.bin") and size % 2 == 0 and size > 0:
        return np.memmap(path, dtype=np.uint16, mode="r")  # nanoGPT: no header
    die(f"{path}: not a token shard (no llm.c header magic {MAGIC}, and not a nanoGPT train.bin/val.bin); "
        f"make shards with prepare_data.py")


def find_shards(data_dir, split):
    """The token files of one split: prepare_data.py/llm.c shards (*{split}_NNNNNN.bin) or nanoGPT's {split}.bin."""
    files = sorted(glob.glob(os.path.join(data_dir, f"*{split}_[0-9]*.bin")))
    raw = os.path.join(data_dir, f"{split}.bin")
    return files or ([raw] if os.path.exists(raw) else [])


def load_meta(data_dir):
    """Tokenizer and size facts of a data dir: meta.json from prepare_data.py, or nanoGPT's meta.pkl / defaults."""
    if not os.path.isdir(data_dir):
        die(f"data dir {data_dir!r} does not exist; make it with 'python prepare_data.py stdlib --data_dir={data_dir}' "
            f"(or text PATH..., shakespeare, fineweb)")
    path = os.path.join(data_dir, "meta.json")
    if os.path.exists(path):
        try:
            with open(path) as f:
                meta = json.load(f)
            meta["vocab_size"], meta["eot_id"]
        except (ValueError, KeyError) as e:
            die(f"{path} is unreadable ({e!r}); re-run prepare_data.py for this data dir")
    elif os.path.exists(os.path.join(data_dir, "train.bin")):  # nanoGPT layout
        meta = {"tokenizer": "nanogpt", "vocab_size": 50304, "eot_id": None, "splits": {}}
        pkl = os.path.join(data_dir, "meta.pkl")
        if os.path.exists(pkl):
            with open(pkl, "rb") as f:
                m = pickle.load(f)
            meta.update(vocab_size=m["vocab_size"], itos=m.get("itos"))
    else:
        die(f"data dir {data_dir!r} has no meta.json or train.bin; prepare it with 'python prepare_data.py ...'")
    for split in ("train", "val"):
        if not find_shards(data_dir, split):
            die(f"data dir {data_dir!r} has no {split} shards; re-run prepare_data.py for it")
    return meta


class TokenLoader:
    """Reads (B, T) batches in a fixed order from memory-mapped shards; each rank takes its own B rows of a batch.

    Each shard is cut into `lanes` equal stretches read side by side (row i of a global batch comes from lane
    i % lanes), so one batch mixes far-apart documents instead of B windows of the same file. A row starts at a
    document boundary (EOT) when one lies within T/8 tokens ahead, so most rows see a document's beginning while
    at most 1/8 of the data is skipped. The position (epoch, shard, offset of every lane) is the whole state:
    saved in checkpoints, it makes resume read exactly the batches an uninterrupted run would.
    """

    def __init__(self, files, B, T, rank, world_size, device, eot=None, lanes=1, vocab=65536, skip=()):
        self.files, self.B, self.T, self.rank, self.world_size, self.device, self.eot = files, B, T, rank, world_size, device, eot
        self.shards = [open_shard(f) for f in files]
        if max(len(s) for s in self.shards) < T + 1:
            die(f"{os.path.dirname(files[0])}: shards of {max(len(s) for s in self.shards)} tokens are shorter than "
                f"--seq_len+1 = {T + 1}; lower --seq_len or add data")
        self.bos = [None] * len(files)  # EOT positions per shard, found on first use
        self.lanes, self.vocab = lanes, vocab
        names = [os.path.basename(f) for f in files]
        unknown = sorted({n for n, _, _ in skip} - set(names))
        if unknown:
            die(f"--skip_data names shards that {os.path.dirname(files[0])} does not have: {', '.join(unknown)}; "
                f"was it written for another data dir?")
        self.skip = [sorted((a, b) for name, a, b in skip if name == n) for n in names]  # token ranges never read
        self.load_state({"epoch": 0, "shard": 0})

    def state(self):
        return {"epoch": self.epoch, "shard": self.shard, "pos": list(self.pos), "lane": self.lane}

    def load_state(self, s):
        """Go to a saved position; without "pos", to the start of the shard."""
        self.epoch, self.shard = s["epoch"], s["shard"]
        starts, self.ends = self.lane_bounds(self.shard)
        self.pos, self.lane = list(s.get("pos") or starts), s.get("lane", 0)

    def lane_bounds(self, shard):
        """([start of each lane], [end of each lane]) of a shard; small shards get fewer lanes."""
        n = len(self.shards[shard])
        k = max(1, min(self.lanes, n // (self.T + 1)))
        return [i * (n // k) for i in range(k)], [(i + 1) * (n // k) for i in range(k)]

    def _next_row(self):
        T, lane = self.T, self.lane
        while True:
            start, end = self.pos[lane], self.ends[lane]
            if start + T + 1 > end:  # this lane is used up: all lanes move on to the next shard
                shard = (self.shard + 1) % len(self.shards)
                self.load_state({"epoch": self.epoch + (shard == 0), "shard": shard})
                lane = 0
                continue
            if self.eot is not None:
                if self.bos[self.shard] is None:
                    self.bos[self.shard] = np.flatnonzero(self.shards[self.shard] == self.eot)
                bos = self.bos[self.shard]
                j = np.searchsorted(bos, start)
                if j < len(bos) and bos[j] - start < T // 8 and bos[j] + T + 1 <= end:
                    start = int(bos[j])
            hit = next((b for a, b in self.skip[self.shard] if a < start + T + 1 and start < b), None)
            if hit is None:
                break
            self.pos[lane] = hit  # the row would touch a skipped range: jump past it
        self.pos[lane] = start + T  # rows overlap by one token, so every token is a target once
        self.lane = (lane + 1) % len(self.pos)
        return self.shard, start

    def ranges(self, a, b):
        """[(shard name, start, end)]: the token ranges read from loader state a up to state b (a rollback's skip)."""
        name = lambda i: os.path.basename(self.files[i])  # noqa: E731
        if (a["epoch"], a["shard"]) == (b["epoch"], b["shard"]):
            return [(name(a["shard"]), p, q) for p, q in zip(a["pos"], b["pos"]) if q > p]
        out = [(name(a["shard"]), p, e) for p, e in zip(a["pos"], self.lane_bounds(a["shard"])[1]) if e > p]
        i = (a["shard"] + 1) % len(self.files)
        while i != b["shard"]:  # shards read whole in between
            out.append((name(i), 0, len(self.shards[i])))
            i = (i + 1) % len(self.files)
        return out + [(name(i), s, q) for s, q in zip(self.lane_bounds(i)[0], b["pos"]) if q > s]

    def next(self):
        """The next (x, y) pair for this rank, each (B, T) int64 on the device; rows of other ranks are skipped."""
        rows = [self._next_row() for _ in range(self.B * self.world_size)]
        mine = rows[self.rank * self.B:(self.rank + 1) * self.B]
        buf = np.stack([self.shards[s][p:p + self.T + 1] for s, p in mine])
        if buf.max() >= self.vocab:  # would index past the embedding: a crash on CPU, a device assert on CUDA
            die(f"{self.files[mine[0][0]]}: token id {buf.max()} >= vocab size {self.vocab}; the shards and "
                f"meta.json disagree (another tokenizer?): re-run prepare_data.py, or raise --vocab_size")
        buf = torch.from_numpy(buf.astype(np.int64))
        if self.device.type == "cuda":  # pinned memory lets the copy run asynchronously while the GPU computes
            buf = buf.pin_memory().to(self.device, non_blocking=True)
        else:
            buf = buf.to(self.device)
        return buf[:, :-1], buf[:, 1:]


class SyntheticLoader:
    """Random tokens of the right shape, for --benchmark: no data needed."""

    def __init__(self, B, T, vocab, device):
        self.x = torch.randint(0, vocab, (B, T + 1), device=device, generator=torch.Generator(device).manual_seed(0))

    def state(self):
        return {}

    def next(self):
        return self.x[:, :-1], self.x[:, 1:]


def load_tokenizer(tok):
    """(encode, decode) for the tokenizer description stored in meta.json and in every checkpoint."""
    name = tok.get("tokenizer")
    if name == "byte":
        return (lambda s: list(s.encode())), (lambda ids: bytes(i for i in ids if i < 256).decode("utf-8", "replace"))
    if tok.get("itos"):  # nanoGPT character-level meta.pkl
        stoi = {c: i for i, c in tok["itos"].items()}
        return (lambda s: [stoi[c] for c in s if c in stoi]), (lambda ids: "".join(tok["itos"].get(i, "") for i in ids))
    import tiktoken
    if name == "gpt2":
        try:
            enc = tiktoken.get_encoding("gpt2")
        except Exception as e:  # noqa: BLE001 - offline without tiktoken's cached files: training goes on
            print(f"warning: cannot load the gpt2 tokenizer ({type(e).__name__}); samples will show token ids")
            name = None
    if name and name.startswith("bpe") and tok.get("ranks"):
        ranks = {base64.b64decode(t): int(r) for t, r in (line.split() for line in tok["ranks"].splitlines() if line)}
        enc = tiktoken.Encoding(name, pat_str=tok["pat_str"], mergeable_ranks=ranks,
                                special_tokens={"<|endoftext|>": tok["eot_id"]})
    elif name != "gpt2":  # unknown or unloadable tokenizer: show ids
        return (lambda s: []), (lambda ids: " ".join(map(str, ids)))
    n = enc.n_vocab
    return enc.encode_ordinary, (lambda ids: enc.decode([i for i in ids if i < n]))


def tokenizer_info(data_dir, meta):
    """What sampling needs to rebuild the tokenizer, small enough to store in each checkpoint."""
    info = {k: meta.get(k) for k in ("tokenizer", "eot_id", "pat_str", "itos")}
    if meta.get("tokenizer_file"):
        with open(os.path.join(data_dir, meta["tokenizer_file"])) as f:
            info["ranks"] = f.read()
    return info

# -----------------------------------------------------------------------------
# Optimizer and schedule


def build_optimizers(cfg, raw, device):
    """AdamW (betas 0.9/0.95, no decay on embeddings, head and gains); with --optimizer=muon, Muon on hidden matrices."""
    hidden = [p for n, p in raw.named_parameters() if p.ndim == 2 and n.startswith("blocks.")]
    rest = [p for n, p in raw.named_parameters() if not (p.ndim == 2 and n.startswith("blocks."))]
    fused = device.type == "cuda"
    if cfg.optimizer == "muon":
        # Newton-Schulz orthogonalised momentum (Jordan et al. 2024); "match_rms_adamw" scales each update to
        # AdamW's RMS, 0.2 * sqrt(max(fan_in, fan_out)), so the LR grows with width and one LR serves both (Moonlight)
        # muP: orthogonal updates of spectral norm 0.2 * sqrt(width) * lr must stay O(1), so hidden LR / sqrt(m)
        muon = torch.optim.Muon(hidden, lr=cfg.lr / math.sqrt(width_mult(cfg)), weight_decay=cfg.weight_decay, momentum=0.95, nesterov=True,
                                adjust_lr_fn="match_rms_adamw")
        adam = torch.optim.AdamW(rest, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), weight_decay=0.0, fused=fused)
        opts = [muon, adam]
    else:
        # muP: Adam moves each hidden weight by ~lr, so a hidden matrix's effect on its output grows with fan_in;
        # LR / m cancels it (decoupled weight decay is lr * wd, so it scales with it, as in the mup package)
        groups = [dict(params=hidden, weight_decay=cfg.weight_decay, lr=cfg.lr / width_mult(cfg)),
                  dict(params=rest, weight_decay=0.0)]
        opts = [torch.optim.AdamW(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), fused=fused)]
    for opt in opts:
        for g in opt.param_groups:
            g["peak_lr"] = g["lr"]
    return opts


def lr_mult(cfg, step, progress):
    """LR multiplier: linear warmup over warmup_steps, times cosine, WSD or constant decay over progress in [0, 1]."""
    warm = min(1.0, (step + 1) / cfg.warmup_steps) if cfg.warmup_steps else 1.0
    p, f = min(max(progress, 0.0), 1.0), cfg.final_lr_frac
    if cfg.schedule == "cosine":
        return warm * (f + (1 - f) * 0.5 * (1 + math.cos(math.pi * p)))
    if cfg.schedule == "wsd":  # warmup-stable-decay: flat, then linear to the final LR (Hu et al. 2024)
        return warm * (1.0 if p < 1 - cfg.cooldown_frac else f + (1 - f) * (1 - p) / cfg.cooldown_frac)
    return warm

# -----------------------------------------------------------------------------
# Distributed and precision

# === shared: dist ===
def setup_dist(device_arg="auto"):
    """Return (rank, world_size, device). Under torchrun, join the process group: NCCL on CUDA, gloo on CPU."""
    if device_arg == "auto":
        device_arg = "cuda" if torch.cuda.is_available() else "mps" if torch.backends.mps.is_available() else "cpu"
    if device_arg == "cuda" and not torch.cuda.is_available():
        sys.exit("error: --device=cuda but no CUDA GPU is visible; use --device=cpu")
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
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=store, rank=rank, world_size=world_size)
    return rank, world_size, device


def full(t):
    """The whole tensor of an FSDP-sharded DTensor (a collective: every rank must call it); other tensors as they are."""
    return t.full_tensor() if hasattr(t, "full_tensor") else t


def all_mean(x, world_size):
    """Average a tensor over ranks (a no-op in a single process)."""
    if world_size > 1:
        x = x.clone()
        dist.all_reduce(x)
        x /= world_size
    return x
# === end shared ===

# === shared: precision ===
PEAK_FLOPS = {"H100": 989e12, "H200": 989e12, "B200": 2250e12, "A100": 312e12, "L40S": 362e12, "4090": 165e12,
              "A10": 125e12, "L4": 121e12, "V100": 125e12, "T4": 65e12}  # dense bf16/fp16; tf32 is half


def setup_precision(device, dtype_arg="auto"):
    """Resolve the dtype and return (dtype, autocast context, GradScaler). fp32 master weights in every case."""
    if dtype_arg == "auto":
        cuda = device.type == "cuda"
        dtype_arg = ("bfloat16" if torch.cuda.is_bf16_supported() else "float16") if cuda else "float32"
    dtype = getattr(torch, dtype_arg)
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul that remains
    ctx = contextlib.nullcontext() if dtype == torch.float32 else torch.autocast(device.type, dtype=dtype)
    # fp16 has a narrow range: scale the loss up, skip steps whose grads overflow, grow the scale after 2000 good steps
    scaler = torch.amp.GradScaler(device.type, enabled=dtype == torch.float16, growth_interval=2000)
    return dtype, ctx, scaler


def peak_flops(device, dtype):
    """Peak dense FLOP/s of this GPU for MFU, or None when unknown (CPU, unlisted GPU)."""
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = next((v for k, v in PEAK_FLOPS.items() if k in name), None)
    return peak / 2 if peak and dtype == torch.float32 else peak


def peak_memory_gb(device):
    """Peak GPU memory allocated, or the process's peak resident memory on CPU, in GB."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # KB on Linux
# === end shared ===

# -----------------------------------------------------------------------------
# Checkpointing

# === shared: checkpoint ===
def atomic_write(path, write_fn):
    """Write a file so that it is either complete or absent: temp file in the same dir, fsync, rename."""
    tmp = f"{path}.tmp{os.getpid()}"
    try:
        with open(tmp, "wb") as f:
            write_fn(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)


class CheckpointWriter:
    """Writes ckpt_STEP.pt atomically, then its completion marker (size + sha256); only then prunes older ones,
    keeping the newest keep_last plus every multiple of milestone_every. With background=True the write runs in a
    thread from a deep copy of the state, so training goes on; a failed write stops the run at the next save."""

    def __init__(self, out_dir, keep_last=2, milestone_every=0, background=False):
        self.out_dir, self.keep_last, self.milestone_every, self.background = out_dir, keep_last, milestone_every, background
        self.thread, self.error = None, None

    def save(self, obj, step):
        self.wait()  # one write at a time
        if self.background:
            self.thread = threading.Thread(target=self.write, args=(copy.deepcopy(obj), step))
            self.thread.start()
        else:
            self.write(obj, step)
            self.wait()

    def write(self, obj, step):
        path = os.path.join(self.out_dir, f"ckpt_{step:07d}.pt")
        try:
            os.makedirs(self.out_dir, exist_ok=True)
            atomic_write(path, lambda f: torch.save(obj, f))
            marker = json.dumps({"size": os.path.getsize(path), "sha256": sha256_file(path)}).encode()
            atomic_write(path + ".done", lambda f: f.write(marker))
        except OSError as e:
            self.error = f"writing {path} failed ({e.strerror or e}); the earlier checkpoints are intact"
            return
        # newer steps than this one are an abandoned timeline (a rollback, or a resume past an unreadable newest
        # checkpoint): they go, and never count among the keep_last that protect the good ones
        done = list_checkpoints(self.out_dir)
        older = [(s, p) for s, p in done if s <= step][:-self.keep_last] if self.keep_last > 0 else []
        remove_checkpoints([p for s, p in done if s > step] +
                           [p for s, p in older if not (self.milestone_every and s % self.milestone_every == 0)])

    def wait(self):
        """Block until the write in flight is on disk; stop the run if it failed."""
        if self.thread:
            self.thread.join()
            self.thread = None
        if self.error:
            die(self.error)


def remove_checkpoints(paths):
    """Delete checkpoints, each marker first: a half-deleted checkpoint never looks complete."""
    for p in paths:
        for q in (p + ".done", p):
            os.remove(q)


def sha256_file(path):
    """Hex sha256 of a file, read in 16 MB chunks."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 24), b""):
            h.update(chunk)
    return h.hexdigest()


def list_checkpoints(out_dir):
    """[(step, path)] of the checkpoints in out_dir that have a completion marker, oldest first."""
    found = []
    for p in glob.glob(os.path.join(out_dir, "ckpt_*.pt")):
        m = re.fullmatch(r"ckpt_(\d+)\.pt", os.path.basename(p))
        if m and os.path.exists(p + ".done"):
            found.append((int(m.group(1)), p))
    return sorted(found)


def load_checkpoint(where, map_location="cpu", before=None):
    """Load a checkpoint file, or the newest complete and intact one in a directory (falling back past bad ones),
    optionally the newest from before step `before`."""
    candidates = [(0, where)] if os.path.isfile(where) else list_checkpoints(where)
    candidates = [c for c in candidates if before is None or c[0] < before]
    for _, path in reversed(candidates):
        try:
            marker_path = path + ".done"
            if os.path.exists(marker_path):
                with open(marker_path) as f:
                    marker = json.load(f)
                if os.path.getsize(path) != marker["size"] or sha256_file(path) != marker["sha256"]:
                    raise ValueError("size or checksum differs from its completion marker")
            return torch.load(path, map_location=map_location, weights_only=False), path
        except Exception as e:  # noqa: BLE001 - any unreadable file means: try the previous one
            print(f"warning: skipping checkpoint {path}: {e}", file=sys.stderr)
    return None, None
# === end shared ===

# === shared: metrics ===
class Metrics:
    """Append every logged value to out_dir/metrics.jsonl (one JSON object per line), and to wandb if enabled."""

    def __init__(self, out_dir, enabled=True, wandb_project="", config=None):
        self.path, self.enabled, self.wandb = os.path.join(out_dir, "metrics.jsonl"), enabled, None
        if enabled and wandb_project:
            try:
                import wandb
            except ImportError:
                sys.exit("error: --wandb needs the wandb package: pip install wandb")
            self.wandb = wandb.init(project=wandb_project, config=config)

    def log(self, **kv):
        if not self.enabled:
            return
        with open(self.path, "a") as f:
            f.write(json.dumps(kv) + "\n")
        if self.wandb:
            self.wandb.log(kv, step=kv.get("step"))


def append_results(out_dir, row):
    """Append one row to results.tsv beside out_dir: the experiment log shared by all scripts."""
    path = os.path.join(os.path.dirname(os.path.abspath(out_dir)), "results.tsv")
    cols = ["run_id", "script", "commit", "metric", "value", "peak_mem_gb", "wall_s", "description"]
    new = not os.path.exists(path)
    with open(path, "a") as f:
        if new:
            f.write("\t".join(cols) + "\n")
        f.write("\t".join(str(row.get(c, "")).replace("\t", " ") for c in cols) + "\n")


def git_commit():
    """Short hash of the code's git commit, or 'unknown'."""
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=5,
                              cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"
# === end shared ===


def fmt_rate(x):
    """3.66M, 812k, 95: rates readable at any scale."""
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def plot_losses(out_dir, history):
    """loss.png: train loss and val loss against step."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return
    fig, ax = plt.subplots(figsize=(7, 4))
    for key, style in (("loss", "-"), ("val_loss", "o-")):
        pts = [(h["step"], h[key]) for h in history if key in h]
        if pts:
            ax.plot(*zip(*pts), style, label=key.replace("_", " "))
    ax.set(xlabel="step", ylabel="loss (nats/token)", title=os.path.basename(os.path.abspath(out_dir)))
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(os.path.join(out_dir, "loss.png"), dpi=120)
    plt.close(fig)

# -----------------------------------------------------------------------------
# Training loop

# === shared: guard ===
class Guard:
    """Decides before each update whether it is safe, from the loss and the grad norm (both agreed across ranks).

    Non-finite values are bad at once; after 10 good steps, a value more than `sigma` running stds above its
    running mean (an exponential moving average over ~window good steps) is a spike. A bad step's update is
    skipped; `max_bad` bad steps within `window` steps call for a rollback (PaLM, Chowdhery et al. 2022, 5.1).
    With clip_mult > 0 the clipping threshold follows clip_mult x the running grad-norm mean instead of a constant.
    """

    def __init__(self, loss_sigma=6.0, gnorm_sigma=0.0, window=100, max_bad=5, clip_mult=0.0):
        self.sigma, self.window, self.max_bad, self.clip_mult = (loss_sigma, gnorm_sigma), window, max_bad, clip_mult
        self.load_state({"n": 0, "mean": [0.0, 0.0], "var": [0.0, 0.0], "bad": []})

    def state(self):
        return {"n": self.n, "mean": list(self.mean), "var": list(self.var), "bad": list(self.bad)}

    def load_state(self, s):
        self.n, self.mean, self.var, self.bad = s["n"], list(s["mean"]), list(s["var"]), list(s["bad"])

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
            self.mean[i] += a * d
            self.var[i] = (1 - a) * (self.var[i] + a * d * d)
        return None

    def rollback_due(self):
        return self.max_bad > 0 and len(self.bad) >= self.max_bad


class StopSignal:
    """Within `with StopSignal() as stop:`, SIGTERM (preemption, Slurm, torchrun) and SIGINT (Ctrl-C) set
    stop.received; the loop stops after the step, saves and exits 0. A second signal acts at once, as usual."""

    def __enter__(self):
        self.received, self.old = None, {}
        if threading.current_thread() is threading.main_thread():  # Python runs handlers in the main thread only
            for sig in (signal.SIGTERM, signal.SIGINT):
                self.old[sig] = signal.signal(sig, self.handle)
        return self

    def handle(self, signum, frame):
        self.received = signal.Signals(signum).name
        signal.signal(signum, self.old[signum])

    def __exit__(self, *exc):
        for sig, handler in self.old.items():
            signal.signal(sig, handler)


def parse_faults(spec):
    """--inject_fault=KIND@STEP[-END][:RANK],... -> [(kind, first, last, rank or None)], for testing the guards."""
    faults = []
    for item in filter(None, spec.split(",")):
        m = re.fullmatch(r"(nan|spike|sigterm|kill)@(\d+)(?:-(\d+))?(?::(\d+))?", item)
        if not m:
            die(f"--inject_fault: cannot read {item!r}; write KIND@STEP[-END][:RANK] with KIND nan|spike|sigterm|kill")
        faults.append((m[1], int(m[2]), int(m[3] or m[2]), None if m[4] is None else int(m[4])))
    return faults


def inject_faults(faults, fired, step, rank, loss):
    """Apply the faults due at this step, each once (a rollback replays steps, not faults): nan makes the loss NaN,
    spike multiplies it by 10, sigterm sends this process SIGTERM, kill exits at once as a crashed worker would."""
    for kind, first, last, r in faults:
        if first <= step <= last and r in (None, rank) and (kind, step) not in fired:
            fired.add((kind, step))
            if kind in ("nan", "spike"):
                loss = loss * (float("nan") if kind == "nan" else 10.0)
            elif kind == "sigterm":
                os.kill(os.getpid(), signal.SIGTERM)
            elif os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":  # not again once torchrun restarted us
                os._exit(1)
    return loss


def sharpness(loss_fn, params, iters=10, seed=0):
    """Top eigenvalue of the loss Hessian (the "sharpness" of Cohen et al. 2021) by power iteration. Each
    Hessian-vector product is a central difference of gradients, Hv = (g(w + e v) - g(w - e v)) / 2e: no double
    backward, so fused kernels, torch.compile and DDP all work. loss_fn() returns the loss; params end unchanged."""
    norm = lambda ts: math.sqrt(sum(full(t.float().square().sum()).item() for t in ts))  # noqa: E731
    w0 = [p.detach().clone() for p in params]
    gen = torch.Generator(params[0].device).manual_seed(seed)  # its own generator: training's RNG stays untouched
    v = [torch.randn(p.shape, device=p.device, generator=gen) for p in params]
    eps, lam = 1e-3 * norm(w0), 0.0
    for _ in range(iters):
        n = norm(v)
        v, grads = [t / n for t in v], []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for p, w, t in zip(params, w0, v):
                    p.copy_(w + sign * eps * t)
            for p in params:
                p.grad = None
            loss_fn().backward()
            grads.append([p.grad.float() for p in params])
        hv = [(a - b) / (2 * eps) for a, b in zip(*grads)]
        lam = sum(full((a * b).sum()).item() for a, b in zip(v, hv))  # the Rayleigh quotient v.Hv, |v| = 1
        v = hv
    with torch.no_grad():
        for p, w in zip(params, w0):
            p.copy_(w)
            p.grad = None
    return lam
# === end shared ===


def evaluate(model, loader, n_batches, ctx):
    """Mean cross-entropy over the first n_batches of the val split (the same tokens every time)."""
    loader.load_state({"epoch": 0, "shard": 0})
    model.eval()
    total = torch.zeros((), device=loader.device)
    with torch.no_grad():
        for _ in range(n_batches):
            x, y = loader.next()
            with ctx:
                total += model(x, y).float()
    model.train()
    return total / n_batches


def prepare_default_data(cfg, rank, world_size):
    """With the default data_dir and no data yet, rank 0 builds the stdlib corpus (no network) and the rest wait."""
    if cfg.data_dir != Config.data_dir or os.path.exists(os.path.join(cfg.data_dir, "meta.json")):
        return
    if rank == 0:
        print(f"no data in {cfg.data_dir}: preparing the Python stdlib corpus (no network needed)")
        script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prepare_data.py")
        if subprocess.run([sys.executable, script, "stdlib", f"--data_dir={cfg.data_dir}"]).returncode:
            die("preparing the stdlib corpus failed (see above)")
    if world_size > 1:
        dist.barrier()


def layer_stats(raw, x, ctx):
    """Per layer (embedding, each block, head): |grad| / |weight| from the last backward, and the RMS of each layer's
    output on x. One ratio far above the rest, or an RMS that keeps growing, is an early sign of instability."""
    sq = lambda ts: sum(full(t.detach().float().square().sum()) for t in ts)  # noqa: E731
    acts = [raw.wte, *raw.blocks]
    layers = acts + ([raw.head] if raw.head is not None else [])
    stats, rms = {}, []
    if all(p.grad is not None for p in raw.parameters()):
        stats["grad_ratio"] = torch.stack([(sq(p.grad for p in m.parameters()) / sq(m.parameters())).sqrt()
                                           for m in layers]).tolist()
    hooks = [m.register_forward_hook(lambda m, i, o: rms.append(o.float().square().mean().sqrt())) for m in acts]
    with torch.no_grad(), ctx, torch.compiler.set_stance("force_eager"):
        raw(x[:1])
    for h in hooks:
        h.remove()
    return {**stats, "act_rms": torch.stack(rms).tolist()}


def read_skip_file(path):
    """[(shard name, start, end)] token ranges from a TSV such as a rollback's skipped.tsv; '#' starts a comment."""
    try:
        with open(path) as f:
            return [(n, int(a), int(b)) for n, a, b in (line.split("\t") for line in f if line.strip()[:1] not in "#")]
    except (OSError, ValueError) as e:
        die(f"--skip_data={path}: {e}; each line must be SHARD<TAB>START<TAB>END in tokens")


def main(cfg):
    """Train (or --benchmark, or --sample) per cfg; returns a dict of final metrics."""
    check_config(cfg)
    if cfg.sample or cfg.mode == "sample":
        return sample_main(cfg)
    with StopSignal() as stop:  # SIGTERM or SIGINT: finish the step, save, exit 0; handlers restored on return
        return train(cfg, stop)


def train(cfg, stop):
    """The training run of main(); stop.received is set by a signal."""
    rank, world_size, device = setup_dist(cfg.device)
    master = rank == 0
    dtype, ctx, scaler = setup_precision(device, cfg.dtype)
    if cfg.parallel == "fsdp" and world_size > 1 and (dtype == torch.float16 or cfg.sharpness_every):
        die("--parallel=fsdp supports neither float16 (no sharded loss scaler) nor --sharpness_every; use --parallel=ddp")
    use_compile = cfg.compile == "true" or (cfg.compile == "auto" and device.type == "cuda" and sys.platform == "linux")
    B, T, accum = cfg.batch_size, cfg.seq_len, cfg.grad_accum
    if cfg.total_batch:  # a global batch in tokens, the same on 1 GPU or 64: micro-steps make up the difference
        accum, rest = divmod(cfg.total_batch, B * T * world_size)
        if rest or not accum:
            die(f"--total_batch={cfg.total_batch} is not a multiple of --batch_size x --seq_len x ranks = {B} x {T} x "
                f"{world_size} = {B * T * world_size}; change one of them")
    tokens_per_step = B * T * accum * world_size
    restarts = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))  # torchrun restarted us after a failure
    resume = (cfg.resume or restarts > 0) and not cfg.benchmark

    # data: token shards of each split, read in order; the vocab comes from the data unless given
    skip = read_skip_file(cfg.skip_data) if cfg.skip_data else ()  # a bad file fails before any data is prepared
    if cfg.benchmark:
        meta = {"tokenizer": None, "vocab_size": cfg.vocab_size or 50257, "eot_id": None, "splits": {}}
    else:
        prepare_default_data(cfg, rank, world_size)
        meta = load_meta(cfg.data_dir)
    if cfg.vocab_size and meta["vocab_size"] > cfg.vocab_size:
        die(f"the data has {meta['vocab_size']} tokens but --vocab_size={cfg.vocab_size}; raise it or use 0 (from data)")
    vocab_real = cfg.vocab_size or meta["vocab_size"]
    vocab = 64 * math.ceil(vocab_real / 64)
    if cfg.benchmark:
        train_loader = SyntheticLoader(B, T, vocab_real, device)
    else:
        train_loader = TokenLoader(find_shards(cfg.data_dir, "train"), B, T, rank, world_size, device, meta["eot_id"],
                                   lanes=B * world_size * accum, vocab=vocab_real, skip=skip)  # a lane per row of a step
        # val in lanes too, so a short periodic eval samples the whole val split, like the final one
        val_loader = TokenLoader(find_shards(cfg.data_dir, "val"), B, T, rank, world_size, device, meta["eot_id"],
                                 lanes=B * world_size, vocab=vocab_real)
        val = meta.get("splits", {}).get("val", {})
        tokens_per_byte = val["tokens"] / val["bytes"] if val.get("bytes") else None  # for bits per byte
        tok_info = tokenizer_info(cfg.data_dir, meta)  # read once: it goes into every checkpoint
        _, decode = load_tokenizer(tok_info)

    # model: built on the meta device, materialised, initialised; then compiled and wrapped
    raw = build_model(cfg, vocab, device)
    n_params = sum(p.numel() for p in raw.parameters())
    flops_per_step = raw.flops_per_token() * tokens_per_step
    model = raw
    if world_size > 1 and cfg.parallel == "fsdp":
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=dtype, reduce_dtype=torch.float32) if dtype != torch.float32 else None
        for block in raw.blocks:  # compile each block before sharding it, then shard the root (embeddings, head)
            if use_compile:
                block.compile()
            fully_shard(block, **({"mp_policy": mp} if mp else {}))
        fully_shard(raw, **({"mp_policy": mp} if mp else {}))
    else:
        model = torch.compile(raw) if use_compile else raw
        if world_size > 1:
            model = nn.parallel.DistributedDataParallel(model, device_ids=[device.index] if device.type == "cuda" else None)
    opts = build_optimizers(cfg, raw, device)
    guard = Guard(cfg.loss_spike, cfg.gnorm_spike, cfg.guard_window, cfg.rollback_after, cfg.clip_mult)
    saver = CheckpointWriter(cfg.out_dir, cfg.keep_last, cfg.milestone_every, cfg.async_save)
    layout = run_layout(dataclasses.asdict(cfg), world_size, vocab_real)

    # budget: steps given, or derived from a token budget; a time budget is checked as we go
    n_tokens = 20 * n_params if cfg.tokens == "auto" else float(cfg.tokens or 0)
    max_steps = cfg.bench_steps + 5 if cfg.benchmark else cfg.max_steps or math.ceil(n_tokens / tokens_per_step)
    time_budget = cfg.time_budget if not (cfg.benchmark or cfg.max_steps or cfg.tokens) else 0.0

    def restore(ckpt, with_data=True):
        """Model, optimizer, scaler, guard and RNG (and the data position) from a checkpoint; (step, time, history)."""
        from torch.distributed.checkpoint.state_dict import StateDictOptions, set_state_dict
        set_state_dict(raw, opts, model_state_dict=ckpt["model"], optim_state_dict=ckpt["optim"],
                       options=StateDictOptions(full_state_dict=True))
        scaler.load_state_dict(ckpt["scaler"])
        if "guard" in ckpt:  # not in checkpoints from before the guards
            guard.load_state(ckpt["guard"])
        torch.set_rng_state(ckpt["rng"]["cpu"])
        if with_data:
            train_loader.load_state(ckpt["data"])
        return ckpt["step"], ckpt["train_time"], ckpt["history"]

    # resume (asked for, or after a torchrun restart) from the newest intact checkpoint; never mix runs or configs
    step, train_time, history = 0, 0.0, []
    if not cfg.benchmark and not resume and list_checkpoints(cfg.out_dir):
        die(f"{cfg.out_dir} holds checkpoints of an earlier run; continue it with --resume or pick a new --out_dir")
    if resume:
        ckpt, path = load_checkpoint(cfg.out_dir)
        if ckpt is None and list_checkpoints(cfg.out_dir):
            die(f"--resume: no checkpoint in {cfg.out_dir} is readable (see warnings above); nothing was changed")
        if ckpt is None:
            if master:
                print(f"--resume: no checkpoint in {cfg.out_dir} yet, starting from scratch")
        else:
            saved = run_layout(ckpt["config"], ckpt["world_size"], ckpt["vocab_real"])
            diff = [f"{k}={v!r} (now {layout[k]!r})" for k, v in saved.items() if layout[k] != v]
            if diff:
                die(f"--resume: {path} was made with a different config: {', '.join(diff)}; pass the same flags or use "
                    f"a new --out_dir")
            step, train_time, history = restore(ckpt)
            if master:
                print(f"resumed from {path} at step {step}" + (f" (torchrun restart {restarts})" if restarts else ""))

    data_state = train_loader.state()  # loader position before the batch in hand: what a checkpoint must store
    x, y = train_loader.next()  # read before anything is written: bad data stops the run with out_dir untouched
    if master and not cfg.benchmark:  # a benchmark writes nothing: never the config.json of a run in out_dir
        try:
            os.makedirs(cfg.out_dir, exist_ok=True)
            with open(os.path.join(cfg.out_dir, "config.json"), "w") as f:
                json.dump(dataclasses.asdict(cfg), f, indent=2)
        except OSError as e:
            die(f"cannot write to --out_dir={cfg.out_dir} ({e.strerror}); pick a writable directory")
    if master:
        print(json.dumps(dataclasses.asdict(cfg)))
        budget = f"{time_budget:.0f} s" if time_budget else f"{max_steps} steps"
        print(f"{n_params / 1e6:.2f}M parameters | vocab {vocab_real} (padded {vocab}) | {tokens_per_step} tokens/step "
              f"(B {B} x T {T} x accum {accum} x world {world_size}) | {budget} | {device} {dtype} | "
              f"compile {use_compile} | {cfg.optimizer} lr {cfg.lr:g} {cfg.schedule}")
    metrics = Metrics(cfg.out_dir, master and not cfg.benchmark, cfg.wandb, dataclasses.asdict(cfg))
    peak = peak_flops(device, dtype)

    def save(step):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict
        msd, osd = get_state_dict(raw, opts, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        if master:  # every rank joins the gather above (FSDP); one writes
            saver.save({"model": msd, "optim": osd, "scaler": scaler.state_dict(), "guard": guard.state(), "step": step,
                        "data": data_state, "train_time": train_time, "history": history,
                        "rng": {"cpu": torch.get_rng_state()}, "config": dataclasses.asdict(cfg), "world_size": world_size,
                        "vocab_size": vocab, "vocab_real": vocab_real, "tokenizer": tok_info}, step)

    def eval_and_sample(step, final=False):
        limit = min(sum(len(s) for s in val_loader.shards), 1 << 22) if final else cfg.eval_tokens
        n_batches = max(1, limit // (B * T * world_size))
        vl = all_mean(evaluate(model, val_loader, n_batches, ctx), world_size).item()
        rec = {"step": step, "val_loss": vl, "val_ppl": math.exp(min(vl, 50))}
        if tokens_per_byte:  # bits per byte = nats per token / ln 2 * tokens per byte: comparable across tokenizers
            rec["val_bpb"], rec["val_tokens_per_byte"] = vl / math.log(2) * tokens_per_byte, tokens_per_byte
        line = f"eval {step:05d} | val loss {vl:.4f} | ppl {rec['val_ppl']:.2f}"
        line += f" | val bpb {rec['val_bpb']:.4f}" if "val_bpb" in rec else ""
        if master:
            print(line + (f" | {n_batches * B * T * world_size} tokens" if final else ""))
        if cfg.sample_tokens:  # every rank samples (FSDP needs all of them for a forward); rank 0 prints
            bos = meta["eot_id"] if meta["eot_id"] is not None else 0
            g = torch.Generator(device).manual_seed(cfg.seed)
            out = raw.generate(torch.full((1, 1), bos, device=device), cfg.sample_tokens, cfg.temperature, cfg.top_k,
                               vocab_real, g)
            if master:
                print("-" * 40 + "\n" + decode(out[0, 1:].tolist()) + "\n" + "-" * 40)
        metrics.log(**rec, **layer_stats(raw, x, ctx))  # per-layer grad/weight ratios and activation RMS
        history.append(rec)
        return rec

    def rollback(step):
        """Back to the newest intact checkpoint from before the first recent bad step, with the loader left where it
        is: the batches read since that checkpoint are skipped (PaLM). Returns (step, train_time, history)."""
        saver.wait()
        if world_size > 1:
            dist.barrier()  # rank 0's checkpoint write is on disk before any rank looks
        first_bad, guard.bad = guard.bad[0], []
        ckpt, path = load_checkpoint(cfg.out_dir, before=first_bad)
        if ckpt is None:
            if master:
                print(f"step {step:05d} | no checkpoint from before step {first_bad} to roll back to; going on")
            return step, train_time, history
        tries[ckpt["step"]] = tries.get(ckpt["step"], 0) + 1
        if tries[ckpt["step"]] > 3:
            die(f"bad steps go on after 3 rollbacks to step {ckpt['step']}; lower --lr, raise --warmup_steps "
                f"or look at the data ranges in {cfg.out_dir}/skipped.tsv")
        skipped = train_loader.ranges(ckpt["data"], data_state)
        if master:
            remove_checkpoints([p for s, p in list_checkpoints(cfg.out_dir) if s > ckpt["step"]])  # never resumed
            with open(os.path.join(cfg.out_dir, "skipped.tsv"), "a") as f:
                f.writelines(f"{name}\t{a}\t{b}\n" for name, a, b in skipped)
            print(f"step {step:05d} | rollback to {path} (step {ckpt['step']}): the data read since is skipped, "
                  f"{len(skipped)} token ranges appended to {cfg.out_dir}/skipped.tsv")
        metrics.log(step=step, event="rollback", to_step=ckpt["step"], skipped=skipped)
        out = restore(ckpt, with_data=False)
        guard.bad = []
        return out

    def batch_loss():  # the training loss on the batch in hand, for --sharpness_every
        with ctx:
            return model(x, y, cfg.z_loss)

    # the loop: accumulate grads over micro-steps (sync only on the last), clip, check, step, log, eval, save
    t_log, steps_since_log, start_step, wall0, last = time.perf_counter(), 0, step, time.perf_counter(), {}
    faults, fired, tries, clock, stopped = parse_faults(cfg.inject_fault), set(), {}, train_time, False
    while True:
        progress = clock / time_budget if time_budget else step / max_steps  # clock: the train time all ranks agree on
        done = progress >= 1.0 or stopped
        t_pause = time.perf_counter()  # evals and saves are not training time
        if not cfg.benchmark and step > start_step and not done:
            if cfg.eval_every and step % cfg.eval_every == 0:
                eval_and_sample(step)
            if cfg.sharpness_every and step % cfg.sharpness_every == 0:
                lam = sharpness(batch_loss, list(raw.parameters()))
                metrics.log(step=step, sharpness=lam)
                if master:
                    print(f"sharpness {step:05d} | top Hessian eigenvalue {lam:.4g}")
            if cfg.save_every and step % cfg.save_every == 0:
                save(step)
        t_log += time.perf_counter() - t_pause
        if done:
            break
        if cfg.benchmark and step == 5:  # warm-up (compile, allocator) done: start the clock
            if device.type == "cuda":
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats(device)
            t_bench = time.perf_counter()
        t0 = time.perf_counter()
        mult = lr_mult(cfg, step, progress)
        for opt in opts:
            opt.zero_grad(set_to_none=True)  # here, not after the update: an eval reads the last step's grads
            for g in opt.param_groups:
                g["lr"] = g["peak_lr"] * mult
        loss_sum = torch.zeros((), device=device)
        for micro in range(accum):
            sync = micro == accum - 1
            if world_size > 1 and cfg.parallel == "fsdp":
                raw.set_requires_gradient_sync(sync)
            no_sync = model.no_sync() if world_size > 1 and cfg.parallel == "ddp" and not sync else contextlib.nullcontext()
            with no_sync:
                with ctx:
                    loss = model(x, y, cfg.z_loss) / accum  # mean over micro-steps, so grads equal one big batch
                if faults:
                    loss = inject_faults(faults, fired, step + 1, rank, loss)
                data_state = train_loader.state()
                x, y = train_loader.next()  # prefetch: the CPU reads the next batch while the GPU computes
                scaler.scale(loss).backward()
            loss_sum += loss.detach()
        for opt in opts:
            scaler.unscale_(opt)
        gnorm = full(nn.utils.clip_grad_norm_(raw.parameters(), guard.clip(cfg.grad_clip)))
        # one all-reduce and host sync per step, so every rank decides on the same loss, grad norm, signal and clock
        local = [loss_sum.float(), gnorm.float(), torch.full((), float(stop.received is not None), device=device),
                 torch.full((), train_time, device=device)]
        loss_v, gnorm_v, stop_v, clock = all_mean(torch.stack(local), world_size).tolist()
        overflow = scaler.is_enabled() and math.isfinite(loss_v) and not math.isfinite(gnorm_v)  # fp16: the scaler's job
        reason = None if overflow else guard.check(step + 1, loss_v, gnorm_v)
        if reason is None:
            for opt in opts:
                scaler.step(opt)  # skipped when fp16 grads overflowed
        scaler.update()
        step += 1
        steps_since_log += 1
        train_time += time.perf_counter() - t0
        stopped = stop_v > 0
        if reason:
            metrics.log(step=step, event="skip", reason=reason, loss=loss_v, gnorm=gnorm_v)
            if master:
                print(f"step {step:05d} | update skipped: {reason} | {len(guard.bad)} bad in {cfg.guard_window} steps")
            if guard.rollback_due():
                step, train_time, history = rollback(step)
                clock = train_time
                continue
        if step % cfg.log_every == 0 or step == max_steps:
            dt = (time.perf_counter() - t_log) / steps_since_log
            t_log, steps_since_log = time.perf_counter(), 0
            tok_s = tokens_per_step / dt
            mfu = flops_per_step / dt / peak if peak else None
            last = {"step": step, "loss": loss_v, "lr": cfg.lr * mult, "gnorm": gnorm_v,
                    "ms": dt * 1e3, "tok_s": tok_s, "mfu": mfu, "train_time": train_time}
            metrics.log(**last)
            history.append({"step": step, "loss": loss_v})
            if master:
                total = f"{train_time:.0f}/{time_budget:.0f}s" if time_budget else f"{max_steps:05d}"
                print(f"step {step:05d}/{total} | loss {loss_v:.4f} | lr {last['lr']:.1e} | gnorm {gnorm_v:.2f} | "
                      f"{dt * 1e3:.0f} ms | {fmt_rate(tok_s)} tok/s | mfu " + (f"{100 * mfu:.1f}%" if mfu else "-"))

    if cfg.benchmark:
        if stopped:
            die(f"--benchmark stopped by {stop.received or 'a signal to another rank'} at step {step}; nothing measured")
        if device.type == "cuda":
            torch.cuda.synchronize()
        dt = (time.perf_counter() - t_bench) / cfg.bench_steps
        res = {"tok_s": tokens_per_step / dt, "ms_per_step": dt * 1e3, "mfu": flops_per_step / dt / peak if peak else None,
               "peak_mem_gb": peak_memory_gb(device), "params": n_params}
        if master:
            print(f"benchmark | {cfg.preset or 'default'} | {n_params / 1e6:.1f}M params | {fmt_rate(res['tok_s'])} tok/s | "
                  f"{res['ms_per_step']:.1f} ms/step | mfu " + (f"{100 * res['mfu']:.1f}%" if res["mfu"] else "-") +
                  f" | peak mem {res['peak_mem_gb']:.2f} GB | {device} {dtype} compile={use_compile}")
        return res
    if stopped:  # preempted: save where we are and leave with exit code 0; --resume carries on
        save(step)
        saver.wait()
        if master:
            print(f"stopped by {stop.received or 'a signal to another rank'} at step {step}: checkpoint saved in "
                  f"{cfg.out_dir}; run the same command with --resume to continue")
        if world_size > 1:
            dist.destroy_process_group()
        return {"preempted": True, "steps": step, "train_time": train_time}

    rec = eval_and_sample(step, final=True)
    save(step)
    saver.wait()
    wall = time.perf_counter() - wall0
    result = {**rec, "train_loss": last.get("loss"), "steps": step, "tokens": step * tokens_per_step,
              "train_time": train_time, "wall_time": wall, "params": n_params, "peak_mem_gb": peak_memory_gb(device)}
    if master:
        plot_losses(cfg.out_dir, history)
        metric = ("val_bpb", rec["val_bpb"]) if "val_bpb" in rec else ("val_loss", rec["val_loss"])
        append_results(cfg.out_dir, {"run_id": time.strftime("%Y%m%d-%H%M%S"), "script": "train_gpt.py",
                                     "commit": git_commit(), "metric": metric[0], "value": f"{metric[1]:.4f}",
                                     "peak_mem_gb": f"{result['peak_mem_gb']:.2f}", "wall_s": f"{wall:.0f}",
                                     "description": cfg.description})
        summary = f"done: {step} steps, {step * tokens_per_step / 1e6:.1f}M tokens in {train_time:.0f} s"
        if "val_bpb" in rec:
            summary += f" | val bpb {rec['val_bpb']:.4f}"
            for tool in ("gzip", "xz"):
                if meta.get(f"val_{tool}_bpb"):
                    ref = meta[f"val_{tool}_bpb"]
                    summary += f" | {tool} -9 {ref:.3f} ({'beaten' if rec['val_bpb'] < ref else 'not beaten'})"
        print(summary + f" | checkpoint and loss.png in {cfg.out_dir}")
    if world_size > 1:
        dist.destroy_process_group()
    return result


def sample_main(cfg):
    """--sample: load a checkpoint and continue --prompt with temperature / top-k sampling and a KV cache."""
    where = cfg.ckpt or cfg.out_dir
    if not os.path.exists(where):
        die(f"no checkpoint at {where!r}; train first or pass --ckpt=PATH")
    ckpt, path = load_checkpoint(where)
    if ckpt is None:
        die(f"no complete checkpoint in {where!r}; train first or pass --ckpt=PATH")
    _, _, device = setup_dist(cfg.device)
    mcfg = Config(**{**ckpt["config"], "seed": cfg.seed})
    model = build_model(mcfg, ckpt["vocab_size"], device)
    model.load_state_dict(ckpt["model"])
    encode, decode = load_tokenizer(ckpt["tokenizer"])
    eot = ckpt["tokenizer"].get("eot_id")
    ids = ([eot] if eot is not None else []) + encode(cfg.prompt)
    if not ids:
        die("empty prompt and no end-of-text token to start from; pass --prompt=TEXT")
    g = torch.Generator(device).manual_seed(cfg.seed)
    out = model.generate(torch.tensor([ids], device=device), cfg.max_new_tokens, cfg.temperature, cfg.top_k,
                         ckpt["vocab_real"], g)
    text = decode(out[0, 1 if eot is not None else 0:].tolist())
    print(f"# {path} (step {ckpt['step']})\n{text}")
    return {"text": text, "ids": out[0].tolist()}

# -----------------------------------------------------------------------------
# Entry point

if __name__ == "__main__":
    main(parse_args(Config, sys.argv[1:]))
