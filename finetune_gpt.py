"""
finetune_gpt.py: train_gpt.py's GPT from other weights (GPT-2 or a checkpoint) is fine-tuned and exported here.

It starts from GPT-2 or a checkpoint of ours, trains the whole model or LoRA adapters, can learn from a teacher
(distillation) or on the int8 grid (QAT), and writes a finished checkpoint as int8, as a Hugging Face folder, or, from
an FSDP run's shards, as one file. It runs train_gpt.py's loop, so all its flags work here; this file adds only
where a run starts (start_from, build_student) and the exports.

  python finetune_gpt.py --preset=finetune --data_dir=data/mine_gpt2  # GPT-2
  python finetune_gpt.py --preset=finetune --data_dir=data/mine_gpt2 --lora_rank=8 --lr=1e-3 --out_dir=out/lora
  python finetune_gpt.py --merge_lora --ckpt=out/lora --out_dir=out/lora_merged
  python finetune_gpt.py --teacher=out/gpt --n_layer=2 --out_dir=out/student  # distil
  python finetune_gpt.py --qat=8 --out_dir=out/gpt_qat  # train on the int8 grid
  python finetune_gpt.py --export=int8 --ckpt=out/gpt_qat --out_dir=out/gpt_int8
  python finetune_gpt.py --export=hf --ckpt=out/finetune --out_dir=out/hf  # transformers loads it
  python finetune_gpt.py --export=pt --ckpt=out/gpt_fsdp/ckpt_0001000 --out_dir=out/gpt_one  # shards: one file
  torchrun --nproc_per_node=8 finetune_gpt.py --preset=finetune --init_from=gpt2-xl --data_dir=data/mine_gpt2
  python finetune_gpt.py -h  # every flag, with its default
"""
import base64
import contextlib
import dataclasses
import functools
import json
import math
import os
import subprocess
import sys
import tempfile
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
import torch.utils.checkpoint
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file  # others' files, parsed safely

import train_gpt as tg

# -----------------------------------------------------------------------------
# Config
#
# train_gpt.py's flags, and these. A fine-tuning run is a new run from other weights: the optimizer's moments and the
# LR schedule start afresh (warmup included); only the weights come along. Three flags change what training does to
# them: --lora_rank trains small adapters beside frozen weights, --teacher adds a bigger model's soft targets to the
# loss, and --qat trains the weights as int8 will hold them. The last three fields are jobs on a finished checkpoint.

@dataclass
class Config(tg.Config):
    preset: str = ""  # named overrides: finetune, or train_gpt.py's
    init_from: str = ""  # gpt2[-medium|-large|-xl], a HF folder, a checkpoint
    lora_rank: int = 0  # LoRA adapters of this rank, the rest frozen; 0 = off
    lora_alpha: float = 16.0  # LoRA: the update is scaled by alpha / rank
    lora_targets: str = "attn,mlp"  # attn (qkv, proj) and/or mlp (fc, proj)
    teacher: str = ""  # distil from: a checkpoint, GPT-2 name or folder
    distill_weight: float = 0.5  # w: (1 - w) CE + w T^2 KL(teacher || student)
    distill_temp: float = 2.0  # T: both softmaxes at this temperature
    qat: int = 0  # QAT: hidden weights on a grid of this many bits; 0 = off
    merge_lora: bool = False  # write --ckpt, LoRA merged in, to --out_dir
    export: str = ""  # write --ckpt to --out_dir as int8, hf (Hugging Face) or pt (FSDP shards as one file)
    ckpt: str = ""  # the checkpoint that --merge_lora and --export write

PRESETS = {
    **tg.PRESETS,
    # GPT-2 124M on your own GPT-2 tokens. AdamW at a small LR nudges the weights and keeps what pretraining taught;
    # Muon's updates are orthogonalized to a fixed size whatever the gradient, which would overwrite it. No weight
    # decay: it would pull the pretrained weights towards zero. Short rows make a CPU step take seconds.
    "finetune": dict(
        init_from="gpt2",
        optimizer="adamw",
        lr=3e-5,
        weight_decay=0.0,
        warmup_steps=10,
        seq_len=256,
        batch_size=4,
        eval_every=50,
        eval_tokens=8192,
        sample_tokens=100,
        out_dir="out/finetune",
    ),
}
# Jobs on a finished checkpoint that moved to companion scripts: their old flag stops with the command to run
# instead. Those scripts read GPT-2, LoRA and int8 checkpoints through load_model below.
MOVED = {
    **tg.MOVED,
    "sample": "python sample_gpt.py --ckpt=gpt2 --prompt=TEXT (or --ckpt=out/gpt, this script's run)",
    "eval_only": "python eval_gpt.py --ckpt=gpt2 --items=data/hellaswag (or --ckpt=out/gpt, this script's run)",
}
# A resume must share these with the run it resumes, besides train_gpt.py's fields: they change what the weights in
# the checkpoint mean (adapters, a quantization grid) though not the base model's shapes.
ADAPT_FIELDS = ("lora_rank", "lora_alpha", "lora_targets", "qat")

def check_config(cfg):
    """train_gpt.py's checks, then the fine-tuning flags'."""
    tg.check_config(cfg)
    targets = set(cfg.lora_targets.split(","))
    if (cfg.lora_rank < 0
            or (cfg.lora_rank and not cfg.init_from)
            or targets - {"attn", "mlp"}):
        tg.die(f"--lora_rank={cfg.lora_rank} --lora_targets={cfg.lora_targets}: LoRA needs a rank >= 0, "
               f"--init_from=WEIGHTS to adapt, and targets among attn,mlp")
    # 1 bit would be a grid of 2^0 - 1 = 0 steps each side of zero: every weight would round to 0
    if (cfg.qat < 0
            or cfg.qat == 1
            or cfg.export not in ("", "int8", "hf", "pt")):
        tg.die(f"--qat={cfg.qat} --export={cfg.export}: --qat takes 0 (off) or 2 bits and up, "
               f"--export only int8, hf or pt")
    if not (0 <= cfg.distill_weight <= 1 and cfg.distill_temp > 0):
        tg.die("need 0 <= --distill_weight <= 1 and --distill_temp > 0")

# -----------------------------------------------------------------------------
# Model: GPT-2's weights in and out, LoRA, fake quantization, a student's loss

EOT = "<|endoftext|>"  # the end-of-text token's text, as tiktoken and transformers name it
GPT2_NAMES = ("gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl")
# GPT-2 reads tiktoken's gpt2 encoding: 50,256 BPE tokens, then <|endoftext|> as the last id
GPT2_TOKENIZER = {"tokenizer": "gpt2", "eot_id": 50256}
# GPT-2's architecture in train_gpt.py's flags: learned positions, biases, LayerNorm, a GELU MLP, the head tied to
# the embedding; multi-head attention with scores scaled by 1/sqrt(head dim), as train_gpt.py's default is.
GPT2_ARCH = dict(
    pos_emb="learned",
    bias=True,
    norm="layernorm",
    mlp="gelu",
    tie_embeddings=True,
    qk_norm=False,
    logit_softcap=0.0,
    mup=False,
    value_embeds=False,
)
# A block's layers: Hugging Face's GPT-2 names them (left) as OpenAI's TensorFlow code did; train_gpt.py (right) as
# nanoGPT does. c_attn makes q, k and v in one matmul, as our qkv does, in the same order.
GPT2_LAYERS = (
    ("ln_1", "norm1"),
    ("attn.c_attn", "attn.qkv"),
    ("attn.c_proj", "attn.proj"),
    ("ln_2", "norm2"),
    ("mlp.c_fc", "mlp.fc"),
    ("mlp.c_proj", "mlp.proj"),
)

def same_tokenizer(a, b):
    """Whether two tokenizer records turn text into the same ids: the same kind, BPE ranks and byte table."""
    return all(a.get(k) == b.get(k) for k in ("tokenizer", "ranks", "itos"))

def is_gpt2(name):
    """Whether --init_from names GPT-2: one of GPT2_NAMES, or a Hugging Face folder."""
    files = ("model.safetensors", "pytorch_model.bin")
    return name in GPT2_NAMES or any(os.path.exists(os.path.join(name, f)) for f in files)

def check_weights(flag, where, fix=""):
    """Stop in one line that says what `where` (given as flag) holds instead of weights, unless it may hold some:
    GPT-2 (a name or a folder), a checkpoint file, a sharded one's ckpt_N folder, or a run's folder of them (whose
    files load_checkpoint checks). fix: what to do instead; by default, the kinds of weights that load."""
    is_folder = os.path.isdir(where)
    shard_folder = is_folder and os.path.basename(os.path.normpath(where)).startswith("ckpt_")
    if is_gpt2(where) or os.path.isfile(where) or tg.list_checkpoints(where) or shard_folder:
        return
    names = sorted(os.listdir(where)) if is_folder else []
    # say what is there instead, so that a wrong path is plain at once
    if not is_folder:
        held = "no such file or folder"
    elif not names:
        held = "an empty folder"
    elif "meta.json" in names:  # prepared data: the trainers read it through --data_dir
        held = "a data dir: --data_dir takes it"
    elif "config.json" in names:  # a Hugging Face folder without its weights, or a run that saved none yet
        held = "config.json but no weights: no ckpt_*.pt, model.safetensors or pytorch_model.bin"
    else:
        held = "it holds " + ", ".join(names[:3])
        if len(names) > 3:
            held += ", ..."
    if fix:  # the caller knows what makes the weights it wants
        tg.die(f"{flag}={where}: no checkpoint there ({held}); {fix}")
    tg.die(f"{flag}={where}: no checkpoint there, nor a Hugging Face GPT-2 folder ({held}); give a checkpoint of "
           f"train_gpt.py, a GPT-2 folder, or one of {', '.join(GPT2_NAMES)}")

def check_writable(flag, path):
    """Stop before the work if path (given as flag) cannot become a folder of files: it is a file, lies inside one,
    or in a folder this process may not write. Checked at the start, a long run does not fail when it writes."""
    folder = os.path.abspath(path)
    while not os.path.exists(folder):  # the nearest folder that exists: the missing ones are made inside it
        folder = os.path.dirname(folder)
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK | os.X_OK):
        kind = "a folder you may not write" if os.path.isdir(folder) else "a file"
        tg.die(f"{flag}={path} cannot be written: {folder} is {kind}; pass a {flag} you can write")

def check_out_dir(out_dir, what):
    """Stop before the work if out_dir holds checkpoints already or cannot be written (check_writable)."""
    if tg.list_checkpoints(out_dir):
        tg.die(f"{out_dir} holds checkpoints already; pass a new --out_dir for the {what}")
    check_writable("--out_dir", out_dir)

def gpt2_folder(name):
    """GPT-2's folder: models/NAME for a name (prepare_data.py fetches it once), else name."""
    if name not in GPT2_NAMES:
        return name
    folder = os.path.join("models", name)
    if os.path.exists(os.path.join(folder, "model.safetensors")):
        return folder
    # only prepare_data.py touches the network (STYLE.md); it fetches the weights from the Hugging Face hub
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "prepare_data.py")
    fetch = [sys.executable, script, "gpt2", f"--model={name}", f"--data_dir={folder}"]
    if subprocess.run(fetch).returncode:
        tg.die(f"fetching {name} failed (see above); or pass --init_from=A_HF_GPT2_FOLDER")
    return folder

def gpt2_config(cfg, folder):
    """(cfg with the HF GPT-2 in folder's architecture, its vocab size); seq_len 0: all of it."""
    path = os.path.join(folder, "config.json")
    keys = ("n_layer", "n_head", "n_embd", "n_positions", "layer_norm_epsilon", "vocab_size")
    fix = "pass a Hugging Face GPT-2 folder (config.json and model.safetensors)"
    with tg.exit_if_unreadable(path, fix), open(path) as f:
        hf = json.load(f)
        if hf.get("model_type") != "gpt2":
            raise ValueError(f"model_type is {hf.get('model_type')!r}, not 'gpt2'")
        hf = {k: hf[k] for k in keys}
    check_positions(cfg.seq_len, hf["n_positions"], folder)
    cfg = dataclasses.replace(
        cfg,
        **GPT2_ARCH,
        n_layer=hf["n_layer"],
        n_head=hf["n_head"],
        n_kv_head=0,  # one key/value head per query head
        n_embd=hf["n_embd"],
        seq_len=cfg.seq_len or hf["n_positions"],
        norm_eps=hf["layer_norm_epsilon"],
    )
    return cfg, hf["vocab_size"]

def check_positions(seq_len, learned, where):
    """Learned positions (GPT-2's) are a table of `learned` rows: --seq_len at most that."""
    if seq_len > learned:
        tg.die(f"--seq_len={seq_len} is longer than the {learned} positions {where} learned (a table of learned "
               f"positions, not RoPE, which could grow); use --seq_len={learned} or less")

def gpt2_names(n_layer):
    """{Hugging Face GPT-2's name of a tensor: ours}."""
    # wte: token embeddings (tied to the head, so there is no head.weight); wpe: the learned positions; ln_f: the
    # final norm before the head. Every block h.i holds its two norms, attention and MLP, each weight with a bias.
    names = {
        "wte.weight": "wte.weight",
        "wpe.weight": "wpe.weight",
        "ln_f.weight": "norm.weight",
        "ln_f.bias": "norm.bias",
    }
    for i in range(n_layer):
        for p in ("weight", "bias"):
            for theirs, ours in GPT2_LAYERS:
                names[f"h.{i}.{theirs}.{p}"] = f"blocks.{i}.{ours}.{p}"
    return names

def conv1d(name, t):
    """Tensor t of ours as GPT-2's, or back: GPT-2's Conv1D weights are (in, out)."""
    # OpenAI's GPT-2 multiplies x @ W with W (in, out); nn.Linear stores (out, in) and computes x @ W.T. The
    # transpose is its own inverse, so the one function maps both ways. Biases and norms (1-D) and the embeddings
    # (not under h.) are stored alike.
    if t.ndim == 2 and name.startswith("h."):
        return t.T
    return t

def check_gpt2_shapes(hf, cfg, vocab_size, path):
    """Stop in one line where the weights hf (HF's names) are not of the sizes config.json gives (in cfg): the
    tensor, its shape in the file and the shape config.json makes it, and the fix."""
    with torch.device("meta"):  # the model config.json describes, as shapes only: nothing is allocated
        ours = tg.GPT(cfg, vocab_size).state_dict()
    sizes = f"n_layer {cfg.n_layer}, n_embd {cfg.n_embd}, vocab_size {vocab_size}, {cfg.seq_len} positions"
    fix = ("the weights and config.json are of different models: set config.json's sizes to the weights', or "
           "pass the config.json that came with them")
    for theirs, name in gpt2_names(cfg.n_layer).items():
        if theirs not in hf:
            tg.die(f"{path} holds no {theirs}, which config.json ({sizes}) asks for; {fix}")
        want = tuple(conv1d(theirs, ours[name]).shape)  # in GPT-2's layout
        got = tuple(hf[theirs].shape)
        if theirs == "wte.weight":  # ours has the padding rows that gpt2_state_dict adds
            want = (vocab_size, cfg.n_embd)
        if theirs == "wpe.weight":  # a table of more positions than this run reads: it reads the first rows
            got = tuple(hf[theirs][:cfg.seq_len].shape)
        if got != want:
            tg.die(f"{path}: {theirs} is {'x'.join(map(str, got))} there, but config.json ({sizes}) makes it "
                   f"{'x'.join(map(str, want))}; {fix}")
    beyond = sorted(k for k in hf if k.startswith(f"h.{cfg.n_layer}."))
    if beyond:  # a deeper model than config.json says: the layers past its n_layer would be dropped unread
        tg.die(f"{path} holds {beyond[0]}, of a layer beyond config.json's n_layer {cfg.n_layer}; {fix}")

def gpt2_state_dict(folder, cfg, vocab_size):
    """Our state dict of the HF GPT-2 weights in folder: the vocab padded with zero rows
    to a multiple of 64, the positions cut to seq_len."""
    path = os.path.join(folder, "model.safetensors")
    if not os.path.exists(path):  # older folders hold a pickle; weights_only loads tensors and nothing else
        path = os.path.join(folder, "pytorch_model.bin")
    fix = "pass a Hugging Face GPT-2 folder (config.json and model.safetensors or pytorch_model.bin)"
    with tg.exit_if_unreadable(path, fix):
        try:
            if path.endswith(".safetensors"):
                hf = load_file(path)
            else:
                hf = torch.load(path, "cpu", weights_only=True)
        except SafetensorError as e:  # truncated or damaged: one line, as for any file we read
            raise ValueError(e) from None
        hf = {k.removeprefix("transformer."): v.float() for k, v in hf.items()}
        check_gpt2_shapes(hf, cfg, vocab_size, path)
        sd = {ours: conv1d(theirs, hf[theirs]) for theirs, ours in gpt2_names(cfg.n_layer).items()}
    # 50,257 rows padded to 50,304 = 64 x 786, a shape the matmuls run fast on (nanoGPT's trick). The padding rows
    # are zeros and never sampled: GPT.logits drops them.
    padding = 64 * math.ceil(vocab_size / 64) - vocab_size
    sd["wte.weight"] = F.pad(sd["wte.weight"], (0, 0, 0, padding))  # (padded vocab, n_embd)
    sd["wpe.weight"] = sd["wpe.weight"][:cfg.seq_len]  # (seq_len, n_embd): the positions this run uses
    return sd

def from_pretrained(name_or_path, device="cpu"):
    """GPT-2 (a name in GPT2_NAMES or a HF folder) as train_gpt.py's GPT in eval mode;
    its first 50257 logits are those of Hugging Face's GPT2LMHeadModel."""
    # nanoGPT's from_pretrained, without transformers: the same GPT class that train_gpt.py trains, set to GPT-2's
    # shape by flags (GPT2_ARCH), so every script of ours samples, scores and fine-tunes GPT-2 as it does its own
    folder = gpt2_folder(name_or_path)
    cfg, vocab_size = gpt2_config(tg.Config(seq_len=0), folder)  # 0: every position GPT-2 has
    model = tg.build_model(cfg, vocab_size, torch.device(device))
    with tg.exit_if_unreadable(folder, "pass a Hugging Face GPT-2 folder"):
        model.load_state_dict(gpt2_state_dict(folder, cfg, vocab_size))
    return model.eval()

BLOCK_LAYERS = {"attn": ("qkv", "proj"), "mlp": ("fc", "proj")}  # the linear layers of a block's two parts

def swap_layers(model, kinds, new):
    """model with each block's `kinds` layers (attn: qkv, proj; mlp: fc, proj) as new(layer)."""
    for block in model.blocks:
        for kind in kinds:
            part = getattr(block, kind)
            for name in BLOCK_LAYERS[kind]:
                setattr(part, name, new(getattr(part, name)))
    return model

class LoRA(nn.Module):
    """A frozen linear layer plus a trainable low-rank update (Hu et al. 2021):
    base(x) + alpha / r * x A^T B^T; B starts at zero: at first, the base model."""

    def __init__(self, base, r, alpha):
        super().__init__()
        self.base = base.requires_grad_(False)
        # alpha / r: a larger rank does not make the update larger, so a change of r needs little retuning of the
        # LR (the paper sets alpha once, to the first r it tries, and leaves it)
        self.scale = alpha / r
        n_in = base.in_features
        dev = base.weight.device
        # A random, B zero (the paper's init): the update B A is 0 at step 0, so training starts from the base
        # model's outputs exactly, yet B's gradient (which goes through A x) is not zero. A's 1/sqrt(n_in) keeps
        # A x of unit scale, as Kaiming's init would.
        self.a = nn.Parameter(torch.randn(r, n_in, device=dev) / math.sqrt(n_in))  # (r, in)
        self.b = nn.Parameter(torch.zeros(base.out_features, r, device=dev))  # (out, r)

    def forward(self, x):
        """x (..., in) -> (..., out): the frozen layer's output plus the scaled low-rank update."""
        # two thin matmuls, (..., in) -> (..., r) -> (..., out), never the (out, in) matrix B A
        return self.base(x) + F.linear(F.linear(x, self.a), self.b) * self.scale

def add_lora(model, cfg):
    """Freeze the model; wrap each block's --lora_targets in LoRA adapters."""
    # The paper adapted attention's query and value matrices only; QLoRA (Dettmers et al. 2023) found that adapters
    # on every linear layer are needed to match full fine-tuning, hence the default attn,mlp. Embeddings, norms and
    # the head stay frozen: at rank 8, about 1% of GPT-2 124M's parameters train.
    def new(layer):
        return LoRA(layer, cfg.lora_rank, cfg.lora_alpha)

    return swap_layers(model.requires_grad_(False), cfg.lora_targets.split(","), new)

def merge_lora(sd, c):
    """A plain state dict of one with LoRA adapters (c: its config): W + alpha / r * B A."""
    # Merged, the adapters cost nothing at inference: W' = W + scale * B A has W's shape, and the model is a plain
    # GPT again that any of our scripts (and --export) reads
    out = {k.replace(".base.", "."): v for k, v in sd.items() if not k.endswith((".a", ".b"))}
    prefixes = [k[:-len("base.weight")] for k in sd if k.endswith(".base.weight")]
    for p in prefixes:
        base = sd[p + "base.weight"]
        ba = (sd[p + "b"].float() @ sd[p + "a"].float()).to(base.dtype)  # (out, r) @ (r, in) = (out, in)
        out[p + "weight"] = base + c["lora_alpha"] / c["lora_rank"] * ba
    return out

def quantize(w, bits=8):
    """(integers in [-(2^(bits-1) - 1), 2^(bits-1) - 1], scales (out, 1)): w (out, in)
    on a symmetric grid per output channel, scaled by the row's largest |w|."""
    # Symmetric: 0 is on the grid and no zero point is stored; -2^(bits-1) is left out, so the grid is the same on
    # both sides. A scale per output row, not one per matrix: one large weight then coarsens its own row only.
    scale = w.abs().amax(1, keepdim=True).clamp(min=1e-12) / (2 ** (bits - 1) - 1)  # (out, 1)
    return (w / scale).round(), scale

def rounded(w, bits):
    """w on quantize()'s grid, in floats: what --qat trains and --export=int8 stores."""
    return torch.mul(*quantize(w, bits))  # integers x their row's scale

def dequantize(sd):
    """A float state dict from an --export=int8 one: each int8 weight times its per-row scale."""
    out = {}
    for k, v in sd.items():
        if k.endswith("_scale"):
            continue
        if v.dtype == torch.int8:
            v = v.float() * sd[k + "_scale"]  # (out, in) x (out, 1)
        out[k] = v
    return out

def is_hidden(name, t):
    """Whether tensor t (named name) is a hidden matrix: a block's linear weight, not an embedding, norm or bias."""
    # these hold most of the bytes, and they are what QAT rounds and --export=int8 stores as int8
    return name.startswith("blocks.") and name.endswith("weight") and t.ndim == 2

def plain_weights(ckpt):
    """The float state dict of a plain GPT that computes what a checkpoint's did: QAT's
    weights on its grid, LoRA adapters merged in, int8 weights dequantized."""
    c = ckpt["config"]
    sd = ckpt["model"]
    if c.get("qat"):  # the float weights a QAT run kept, rounded as its forward rounded them
        # a LoRA run's rounded base weights are *.base.weight; its adapters (.a, .b) are not rounded
        sd = {k: rounded(v, c["qat"]) if is_hidden(k, v) else v for k, v in sd.items()}
    if c.get("lora_rank"):
        sd = merge_lora(sd, c)
    return dequantize(sd)

class QATLinear(nn.Linear):
    """nn.Linear `layer` (its parameters), its weight fake-quantized in the forward (QAT):
    on quantize()'s grid, the gradient passing straight through (STE)."""

    def __init__(self, layer, bits):
        nn.Module.__init__(self)  # not nn.Linear's, which would make new parameters
        self.in_features = layer.in_features
        self.out_features = layer.out_features
        self.bits = bits
        # the same Parameter objects, not copies: the optimizer, the checkpoint and a LoRA wrapped around this layer
        # all see the float weights under their usual names
        self.weight = layer.weight
        self.bias = layer.bias

    def forward(self, x):
        """x @ rounded(W).T + bias, with the gradient of x @ W.T + bias."""
        # Rounding has a zero gradient almost everywhere, so the straight-through estimator (Bengio et al. 2013)
        # treats it as the identity: the forward computes with r, the backward sees w + (r - w).detach(), whose
        # gradient with respect to w is 1. The float w keeps learning, and the model learns to live with the grid
        # that --export=int8 will put it on.
        with torch.no_grad():
            r = rounded(self.weight, self.bits)
        return F.linear(x, self.weight + (r - self.weight).detach(), self.bias)

class Student(tg.GPT):
    """train_gpt.py's GPT that also learns from teacher = (model, weight W, temperature T):
    (1 - W) CE + W T^2 KL(teacher || student) (Hinton et al. 2015); evals score CE alone."""
    teacher = None  # a tuple, not a submodule: neither trained, saved nor sharded

    def forward(self, idx, targets=None, z_loss=0.0, cache=None):
        """The GPT's forward; in training, with targets and a teacher, the distillation loss."""
        if targets is None or self.teacher is None or not self.training:  # val: comparable
            return super().forward(idx, targets, z_loss, cache)
        x, w = self.hidden(idx)  # (B, T, n_embd), the head's weight
        model, weight, temp = self.teacher
        with torch.no_grad():
            xt, wt = model.hidden(idx)
        ce = self.loss(x, w, targets, z_loss)
        # Distillation (Hinton et al. 2015): the teacher's softmax at temperature T > 1 is softer and tells the
        # student how alike the wrong tokens are, which one-hot targets cannot. The soft targets' gradients shrink
        # as 1/T^2, so the KL is multiplied by T^2: the two terms keep their balance as --distill_temp changes.
        kl = distill_kl(self, x, w, model, xt, wt, temp)
        return (1 - weight) * ce + weight * temp ** 2 * kl

def distill_kl(student, x, w, teacher, xt, wt, temp):
    """KL(teacher || student) of the softmaxes at temperature temp, averaged over positions;
    in chunks of rows recomputed in backward: never all (B*T, V) logits at once."""
    x = x.flatten(0, 1)  # (B*T, n_embd)
    xt = xt.flatten(0, 1)
    # at 32 x 1024 rows of GPT-2's 50,304 logits, the two models' fp32 logits would take 13 GB; a chunk of `rows`
    # rows holds about kernels.SMALL_LOGITS logits, and checkpoint() recomputes it in the backward, not keeping it
    rows = max(1, tg.kernels.SMALL_LOGITS // w.size(0))

    def chunk(xs, xts):
        s = student.logits(xs, w) / temp  # (rows, V)
        t = teacher.logits(xts, wt) / temp
        return F.kl_div(F.log_softmax(s, -1), F.log_softmax(t, -1), log_target=True, reduction="sum")

    total = 0
    for i in range(0, len(x), rows):
        kl = torch.utils.checkpoint.checkpoint(chunk, x[i:i + rows], xt[i:i + rows], use_reentrant=False)
        total = total + kl
    return total / len(x)

# -----------------------------------------------------------------------------
# Where a run starts: main() settles cfg in the weights' shape, and train_gpt.py's train() builds its model with
# build_student. All else (data, optimizers, loop, checkpoints) is train_gpt.py's own.

def start_from(cfg, meta, tokenizer, rank, world_size):
    """(cfg in --init_from's shape and vocabulary, init: its weights and the data's tokenizer), checked against the
    data: every token id of the data must have a row, and mean the same text."""
    if not cfg.init_from:
        return cfg, {"tokenizer": tokenizer}
    arch, init = load_init(cfg, rank, world_size)
    vocab_size = init["vocab_size"]
    theirs = init["tokenizer"]["tokenizer"]
    if meta["vocab_size"] > vocab_size:
        tg.die(f"the data has {meta['vocab_size']} tokens but --init_from={cfg.init_from} has {vocab_size}; "
               f"prepare the data with its tokenizer")
    if tokenizer and not same_tokenizer(init["tokenizer"], tokenizer):
        tg.die(f"--init_from={cfg.init_from} reads {theirs} tokens but {cfg.data_dir} holds "
               f"{tokenizer['tokenizer']} tokens; prepare the data with --tokenizer={theirs}")
    return dataclasses.replace(cfg, **arch, vocab_size=vocab_size), {**init, "tokenizer": tokenizer}

def build_student(cfg, vocab_size, device, init):
    """The model to train: init's weights, if any (the optimizer and step start afresh), then QAT, LoRA, a teacher."""
    raw = tg.build_model(cfg, vocab_size, device, Student)
    if "model" in init:
        raw.load_state_dict(init["model"])
    # the order matters: QAT rounds the base weights, and LoRA then wraps the rounded layers, so a QAT + LoRA
    # run's adapters learn on top of the grid
    if cfg.qat:  # each hidden layer swapped for a fake-quantized one with its parameters
        swap_layers(raw, ("attn", "mlp"), lambda layer: QATLinear(layer, cfg.qat))
    if cfg.lora_rank:  # LoRA: the weights so far are frozen; the adapters train
        add_lora(raw, cfg)
    if cfg.teacher:
        teacher = load_teacher(cfg, device, vocab_size, init["tokenizer"])
        raw.teacher = (teacher, cfg.distill_weight, cfg.distill_temp)
    return raw

def load_init(cfg, rank, world_size):
    """--init_from: (its architecture's fields, {model, vocab_size, tokenizer})."""
    if is_gpt2(cfg.init_from):
        # rank 0 fetches GPT-2 (if it is not on disk yet) while the others wait at the barrier; then they read it
        folder = None
        if rank == 0:
            folder = gpt2_folder(cfg.init_from)
        if world_size > 1:
            dist.barrier()
        folder = folder or gpt2_folder(cfg.init_from)
        cfg, vocab_size = gpt2_config(cfg, folder)
        init = dict(
            model=gpt2_state_dict(folder, cfg, vocab_size),
            vocab_size=vocab_size,
            tokenizer=GPT2_TOKENIZER,
        )
        print(f"--init_from={cfg.init_from}: GPT-2, {cfg.n_layer} layers, width {cfg.n_embd}, "
              f"context {cfg.seq_len}")
        return {k: getattr(cfg, k) for k in tg.ARCH_FIELDS}, init
    check_weights("--init_from", cfg.init_from)
    ckpt, path = tg.load_checkpoint(cfg.init_from)
    if ckpt is None:
        tg.die(f"--init_from={cfg.init_from}: no checkpoint there is readable (see the warnings above); give a "
               f"checkpoint of train_gpt.py, a GPT-2 folder, or one of {', '.join(GPT2_NAMES)}")
    if os.path.abspath(os.path.dirname(path)) == os.path.abspath(cfg.out_dir):
        tg.die(f"--init_from starts a new run from {path}; pass a new --out_dir (or --resume)")
    with tg.exit_if_unreadable(path, "pass a checkpoint written by train_gpt.py"):
        c = {**tg.OLDER_CHECKPOINTS, **ckpt["config"]}  # its architecture, this run's --seq_len: RoPE takes any
        arch = {k: c[k] for k in tg.ARCH_FIELDS if k in c and k != "seq_len"}
        cfg = dataclasses.replace(cfg, **arch)
        # the weights as a plain GPT: a QAT, LoRA or int8 checkpoint starts a new run like any other
        init = dict(
            model=plain_weights(ckpt),
            vocab_size=ckpt["data_info"]["vocab_size"],
            tokenizer=ckpt["tokenizer"],
        )
        if cfg.pos_emb == "learned":  # a table of positions: this run may use fewer rows, never more
            check_positions(cfg.seq_len, c["seq_len"], path)
            init["model"]["wpe.weight"] = init["model"]["wpe.weight"][:cfg.seq_len]
    line = f"--init_from={path}: the weights of step {ckpt['step']}; a fresh optimizer and schedule"
    if cfg.seq_len != c["seq_len"]:
        line += f"; context {c['seq_len']} -> {cfg.seq_len}"
    print(line)
    return {k: getattr(cfg, k) for k in tg.ARCH_FIELDS}, init

def load_teacher(cfg, device, vocab_size, tokenizer):
    """--teacher: the model to distil from, frozen, in eval mode; it reads our tokens."""
    teacher, tok, _, path = load_model(cfg.teacher, device, "--teacher")
    ours = tokenizer or tok
    # the KL compares the two softmaxes token by token: both must have the same vocabulary, id for id
    if teacher.vocab_size != vocab_size or not same_tokenizer(tok, ours):
        tg.die(f"--teacher={cfg.teacher} reads {tok['tokenizer']} tokens ({teacher.vocab_size}) but the student reads "
               f"{ours['tokenizer']} tokens ({vocab_size}); distillation needs the one tokenizer")
    n_params = sum(p.numel() for p in teacher.parameters())
    w = cfg.distill_weight
    print(f"--teacher={path}: {n_params / 1e6:.2f}M parameters | loss "
          f"(1 - {w:g}) CE + {w:g} x {cfg.distill_temp:g}^2 KL(teacher || student)")
    return teacher.requires_grad_(False)

def load_model(where, device, flag="--ckpt", fix=""):
    """(model in eval mode, tokenizer, step, path) of GPT-2 (a name or HF folder) or of a
    checkpoint as plain_weights() reads it: what --teacher, sample_gpt.py and eval_gpt.py read. flag:
    the flag that gave where, which an error names (with fix: check_weights)."""
    if is_gpt2(where):
        return from_pretrained(where, device), GPT2_TOKENIZER, "pretrained", where
    check_weights(flag, where, fix)
    ckpt, path = tg.load_checkpoint(where)
    if ckpt is None:
        tg.die(f"{flag}={where}: no complete checkpoint there; train first (python train_gpt.py)")
    with tg.exit_if_unreadable(path, "pass a checkpoint of train_gpt.py"):
        # the fields of its config that train_gpt.py has today; flags it has dropped since are left out
        saved = {**tg.OLDER_CHECKPOINTS, **ckpt["config"]}
        fields = {k: v for k, v in saved.items() if k in tg.Config.__dataclass_fields__}
        model = tg.build_model(tg.Config(**fields), ckpt["data_info"]["vocab_size"], device)
        model.load_state_dict(plain_weights(ckpt))
        tg.load_tokenizer(ckpt["tokenizer"])
    return model.eval(), ckpt["tokenizer"], ckpt["step"], path

# -----------------------------------------------------------------------------
# After training: merge, export

def megabytes(sd):
    """The size of a state dict's tensors, in MB."""
    return sum(v.numel() * v.element_size() for v in sd.values()) / 1e6

def export_main(cfg):
    """--merge_lora, --export=int8 or hf: --ckpt as a plain model in --out_dir; int8: hidden
    matrices as int8 with an fp32 scale a row, and both models' val loss."""
    if cfg.export:
        flag, what = "--export", cfg.export
    else:
        flag, what = "--merge_lora", "merged"
    ckpt, path = None, None
    if cfg.ckpt and os.path.exists(cfg.ckpt):
        ckpt, path = tg.load_checkpoint(cfg.ckpt)
    if ckpt is None or not (cfg.export or ckpt["config"].get("lora_rank")):
        source = "train_gpt.py" if cfg.export else "a LoRA run (--lora_rank)"
        msg = f"{flag} needs --ckpt=PATH, a checkpoint of {source}"
        if cfg.ckpt:
            msg += f"; {cfg.ckpt} is not one"
        tg.die(msg)
    check_out_dir(cfg.out_dir, f"{what} model")  # before the conversion, not when its result is written
    if os.path.abspath(cfg.out_dir) == os.path.abspath(os.path.dirname(path)):
        tg.die(f"{cfg.out_dir} holds checkpoints already; pass a new --out_dir for the {what} model")
    # --export=pt: an FSDP run saves a folder of shards (torch.distributed.checkpoint), each rank's slice of each
    # tensor in files of its own; load_checkpoint has gathered them into whole tensors, written here as one file
    if cfg.export == "pt":  # optimizer state and all: a run of any size resumes from it
        tg.write_checkpoint(cfg.out_dir, ckpt)
        out = tg.list_checkpoints(cfg.out_dir)[-1][1]
        print(f"wrote {path} as one file: {out}")
        return {"path": out}
    with tg.exit_if_unreadable(path, "pass a checkpoint written by train_gpt.py"):
        sd = plain_weights(ckpt)
        if cfg.export == "hf":  # a folder for transformers, not a checkpoint of ours
            return export_hf(cfg, ckpt, path, sd)
        out = sd
        if cfg.export:  # int8: each hidden matrix as int8 (out, in) and its fp32 scales (out, 1), a quarter the bytes
            out = dict(sd)
            for k, v in sd.items():
                if is_hidden(k, v):
                    q, out[k + "_scale"] = quantize(v.float())
                    out[k] = q.to(torch.int8)
        # a plain model: no optimizer state, and no LoRA or QAT in its config, since its weights hold them now
        config = {**ckpt["config"], "lora_rank": 0, "qat": 0, "out_dir": cfg.out_dir}
        ckpt.update(model=out, optim=None, config=config)
    tg.write_checkpoint(cfg.out_dir, ckpt)
    float_mb = megabytes(sd)
    int8_mb = megabytes(out)
    result = {"path": tg.list_checkpoints(cfg.out_dir)[-1][1], "float_mb": float_mb, "int8_mb": int8_mb}
    if cfg.export and os.path.exists(os.path.join(cfg.data_dir, "meta.json")):  # what the int8 grid costs in val loss
        meta = tg.load_meta(cfg.data_dir)
        device = tg.setup_dist(cfg.device)[2]
        # the same val tokens through the float model and the int8 one, each read back from disk: the gap is what
        # rounding the hidden matrices costs (QAT aims to close it)
        for name, where in (("float", path), ("int8", result["path"])):
            model, _, step, _ = load_model(where, device)
            B = model.cfg.batch_size
            T = model.cfg.seq_len
            val_shards = tg.find_shards(cfg.data_dir, "val")
            loader = tg.TokenLoader(val_shards, B, T, 0, 1, device, vocab_size=model.vocab_size)
            rec = tg.evaluate(model.cfg, model, loader, contextlib.nullcontext(), 1, meta, step, final=True)
            result.update({f"{name}_{k}": v for k, v in rec.items()})
    line = f"wrote {path} as a {what} model in {result['path']}: weights {float_mb:.2f} MB -> {int8_mb:.2f} MB"
    for k in ("val_loss", "val_bpb"):
        if "int8_" + k in result:
            line += f" | {k.replace('_', ' ')} {result['float_' + k]:.4f} -> {result['int8_' + k]:.4f}"
    print(line)
    return result

def export_hf(cfg, ckpt, path, sd):
    """--export=hf: a checkpoint (sd: its plain weights) as a Hugging Face folder that AutoModelForCausalLM and
    AutoTokenizer load with no code of ours: GPT-2's shape as GPT2LMHeadModel, the suite's own (RoPE, SwiGLU) as
    StableLM (LayerNorm), Qwen3 (RMSNorm, QK-norm) or Llama (RMSNorm); the same logits, the real vocab rows only."""
    # The folder holds config.json (the architecture class and its sizes, which transformers builds the model
    # from), model.safetensors (the weights under that class's names: tensors only, no pickle to run) and, where
    # our tokenizer has a byte-level BPE form, tokenizer.json and tokenizer_config.json for its fast tokenizer.
    c = {**dataclasses.asdict(tg.Config()), **tg.OLDER_CHECKPOINTS, **ckpt["config"]}  # fields older ones lack
    vocab = ckpt["data_info"]["vocab_size"]
    gpt2_shaped = (all(c[k] == v for k, v in GPT2_ARCH.items())
                   and c["window"] == 0
                   and c["n_kv_head"] in (0, c["n_head"]))
    if gpt2_shaped:
        conf, hf = gpt2_hf(c, sd, vocab)
    else:
        conf, hf = rope_hf(c, sd, vocab, path)
    # GPT-2's convention, which our data follows: one end-of-text token between documents, so it both opens (bos)
    # and closes (eos) a text; generate() stops at eos
    eot = ckpt["tokenizer"].get("eot_id")
    tok = hf_tokenizer(ckpt["tokenizer"], path)  # before any file is written
    conf.update(vocab_size=vocab, bos_token_id=eot, eos_token_id=eot, torch_dtype="float32")
    with tg.exit_if_unreadable(cfg.out_dir, "pass an --out_dir that is a folder you can write"):
        os.makedirs(cfg.out_dir, exist_ok=True)
        stage = tempfile.mkdtemp(prefix=".hf-", dir=os.path.dirname(os.path.abspath(cfg.out_dir)))  # then moved in
    hf = {k: v.float().contiguous().clone() for k, v in hf.items()}  # safetensors wants no views or shared storage
    save_file(hf, os.path.join(stage, "model.safetensors"), metadata={"format": "pt"})  # pt: transformers wants it
    files = {"config.json": conf}
    if tok:
        files["tokenizer.json"] = tok
        files["tokenizer_config.json"] = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": c["seq_len"],
            "eos_token": EOT,
            "bos_token": EOT,
        }
    for name, obj in files.items():
        with open(os.path.join(stage, name), "w") as f:
            json.dump(obj, f, indent=2, ensure_ascii=False)
    for name in ["model.safetensors", *files]:
        os.replace(os.path.join(stage, name), os.path.join(cfg.out_dir, name))
    os.rmdir(stage)
    arch = conf["architectures"][0]
    print(f"wrote {path} as a Hugging Face {arch} in {cfg.out_dir} ({', '.join(files)}, "
          f"model.safetensors): {c['n_layer']} layers, width {c['n_embd']}, {vocab} {ckpt['tokenizer']['tokenizer']} "
          f"tokens")
    return {"path": cfg.out_dir, "architecture": arch}

def gpt2_hf(c, sd, vocab):
    """(config, weights) of a GPT-2-shaped model as GPT2LMHeadModel's: Conv1D's (in, out) weights."""
    hf = {f"transformer.{theirs}": conv1d(theirs, sd[ours]) for theirs, ours in gpt2_names(c["n_layer"]).items()}
    hf["transformer.wte.weight"] = hf["transformer.wte.weight"][:vocab]  # (vocab, n_embd): no padding rows
    conf = dict(
        model_type="gpt2",
        architectures=["GPT2LMHeadModel"],
        n_positions=c["seq_len"],
        n_embd=c["n_embd"],
        n_layer=c["n_layer"],
        n_head=c["n_head"],
        layer_norm_epsilon=c["norm_eps"],
        activation_function="gelu_new",  # GELU's tanh approximation, as GPT-2 and F.gelu(approximate="tanh")
        tie_word_embeddings=True,
    )
    return conf, hf

# transformers' classes that compute the suite's RoPE + SwiGLU model, by (--norm, --qk_norm): StableLM's QK-norm is a
# LayerNorm per head (ours, shared by the heads, is copied to each), Qwen3's an RMSNorm over the head dim like ours
HF_ARCH = {
    ("layernorm", True): "StableLm",
    ("layernorm", False): "StableLm",
    ("rmsnorm", True): "Qwen3",
    ("rmsnorm", False): "Llama",
}
# what none of them computes: (flag, the value they need)
HF_NEEDS = {"pos_emb": "rope", "mlp": "swiglu", "logit_softcap": 0.0, "window": 0, "bias": False,
            "value_embeds": False}

def rope_hf(c, sd, vocab, path):
    """(config, weights) of the suite's own architecture as StableLM, Qwen3 or Llama (HF_ARCH), muP's multipliers
    folded in: attention's 1/(d m) as q / sqrt(m), the head's input 1/m as the final norm's gain (and bias) / m."""
    off = [k for k, v in HF_NEEDS.items() if c[k] != v]
    if off:
        have = ", ".join(f"--{k}={c[k]}" for k in off)
        need = ", ".join(f"--{k}={HF_NEEDS[k]}" for k in off)
        tg.die(f"--export=hf: {path} has {have}, which no transformers model we export to computes; train with {need}")
    arch = HF_ARCH[c["norm"], c["qk_norm"]]
    nh = c["n_head"]
    nkv = c["n_kv_head"] or nh
    hd = c["n_embd"] // nh  # a head's width
    # muP's width multiplier (train_gpt.width_mult): those models have no muP, so its two multipliers that act in
    # the forward move into the weights. Attention's scores scale by 1/sqrt(hd * m), theirs by 1/sqrt(hd): q / sqrt(m)
    # makes up the difference (with QK-norm, q's norm gain takes it). The output's 1/m goes into the final norm,
    # whose output is the head's input.
    m = 1.0
    if c["mup"]:
        m = c["n_embd"] / c["base_width"]
    ln = c["norm"] == "layernorm"
    zeros = torch.zeros(c["n_embd"])  # the bias of a LayerNorm that has none
    hf = {"model.embed_tokens.weight": sd["wte.weight"][:vocab], "model.norm.weight": sd["norm.weight"] / m}
    if ln:
        hf["model.norm.bias"] = sd.get("norm.bias", zeros) / m
    if not c["tie_embeddings"]:
        hf["lm_head.weight"] = sd["head.weight"][:vocab]
    norms = {"input_layernorm": "norm1", "post_attention_layernorm": "norm2"}
    for i in range(c["n_layer"]):
        ours = f"blocks.{i}."
        theirs = f"model.layers.{i}."
        # our one qkv matrix holds q's n_head heads, then k's and v's n_kv_head each; theirs are three matrices
        q, k, v = sd[ours + "attn.qkv.weight"].split([nh * hd, nkv * hd, nkv * hd])
        gate, up = sd[ours + "mlp.fc.weight"].chunk(2)  # SwiGLU: silu(first half) * second half
        for t, o in norms.items():
            hf[f"{theirs}{t}.weight"] = sd[f"{ours}{o}.weight"]
            if ln:
                hf[f"{theirs}{t}.bias"] = sd.get(f"{ours}{o}.bias", zeros)
        if not c["qk_norm"]:
            q = q / math.sqrt(m)
        hf[f"{theirs}self_attn.q_proj.weight"] = q
        hf[f"{theirs}self_attn.k_proj.weight"] = k
        hf[f"{theirs}self_attn.v_proj.weight"] = v
        hf[f"{theirs}self_attn.o_proj.weight"] = sd[ours + "attn.proj.weight"]
        hf[f"{theirs}mlp.gate_proj.weight"] = gate
        hf[f"{theirs}mlp.up_proj.weight"] = up
        hf[f"{theirs}mlp.down_proj.weight"] = sd[ours + "mlp.proj.weight"]
        if c["qk_norm"]:
            qn = sd[ours + "attn.q_norm.weight"] / math.sqrt(m)  # (hd,)
            kn = sd[ours + "attn.k_norm.weight"]
            if arch == "Qwen3":
                hf[f"{theirs}self_attn.q_norm.weight"] = qn
                hf[f"{theirs}self_attn.k_norm.weight"] = kn
            else:  # StableLM: a LayerNorm (no bias) per head, so each head gets a copy of ours
                for n, w, heads in (("q", qn, nh), ("k", kn, nkv)):
                    for h in range(heads):
                        hf[f"{theirs}self_attn.{n}_layernorm.norms.{h}.weight"] = w
    conf = dict(
        model_type=arch.lower(),
        architectures=[f"{arch}ForCausalLM"],
        hidden_size=c["n_embd"],
        intermediate_size=gate.shape[0],
        num_hidden_layers=c["n_layer"],
        num_attention_heads=nh,
        num_key_value_heads=nkv,
        hidden_act="silu",
        max_position_embeddings=c["seq_len"],
        tie_word_embeddings=c["tie_embeddings"],
        attention_dropout=0.0,
        # RoPE on every dimension of a head, as ours; StableLM's default rotates a quarter of them
        rope_parameters={"rope_type": "default", "rope_theta": c["rope_base"], "partial_rotary_factor": 1.0},
    )
    # our blocks are sequential (attention, then the MLP on its output), not GPT-J's parallel residual; and every
    # layer attends to the whole context, with no sliding window
    if ln:
        conf.update(layer_norm_eps=c["norm_eps"], qk_layernorm=c["qk_norm"], use_parallel_residual=False)
    else:
        conf.update(rms_norm_eps=c["norm_eps"], head_dim=hd, use_sliding_window=False)
    return conf, hf

def byte_chars():
    """GPT-2's map of the 256 bytes to printable characters, which byte-level BPE vocabularies (tokenizer.json) use."""
    # tokenizer.json stores tokens as text, so each byte needs a visible character: the printable ones ('!' to '~',
    # and Latin-1's) stand for themselves, and the rest (space, control bytes) take the characters from 256 on, in
    # order: a space is 'Ġ' (256 + 32), as in GPT-2's vocab.json
    keep = [*range(33, 127), *range(161, 173), *range(174, 256)]
    chars = {}
    moved = 0
    for b in range(256):
        if b in keep:
            chars[b] = chr(b)
        else:
            chars[b] = chr(256 + moved)
            moved += 1
    return chars

def no_tokenizer(why):
    """Warn that --export=hf writes the model without a tokenizer, and why."""
    print(f"warning: --export=hf writes no tokenizer: {why}", file=sys.stderr)

def hf_tokenizer(tok, path):
    """tokenizer.json of our tokenizer for transformers' fast tokenizer: byte-level BPE whose merges are recovered
    from tiktoken's ranks (each token splits, by the merges of lower rank, into the pair whose merge made it), the
    same pre-split pattern, and the end-of-text token; the ids equal ours on any text. None where it has no such
    form (no_tokenizer says why)."""
    name = tok.get("tokenizer")
    pat = tok.get("pat_str")
    ranks = None  # {token's bytes: its id}; a BPE's id is its rank: the order in which its merge was learnt
    if name == "byte":
        ranks = {bytes([i]): i for i in range(256)}
    elif name == "gpt2":
        import tiktoken
        try:
            enc = tiktoken.get_encoding("gpt2")
            ranks = enc._mergeable_ranks
            pat = enc._pat_str
        except Exception as e:  # noqa: BLE001 - offline, without tiktoken's cached files
            no_tokenizer(f"tiktoken cannot load gpt2 ({type(e).__name__}); set TIKTOKEN_CACHE_DIR to a cache "
                         f"that holds it, or use GPT-2's own: AutoTokenizer.from_pretrained('gpt2')")
            return None
    elif tok.get("ranks"):
        ranks = {base64.b64decode(t): int(r) for t, r in map(str.split, tok["ranks"].splitlines())}
    if ranks is None or tok.get("eot_id") != len(ranks):  # the model still goes out: a wrong tokenizer would not
        no_tokenizer(f"{path}'s tokenizer ({name}) has no byte-level BPE form with its end-of-text id; pass "
                     f"text through your own tokenizer")
        return None
    chars = byte_chars()

    def text(b):
        """The bytes b as tokenizer.json spells them (byte_chars)."""
        return "".join(chars[x] for x in b)

    # tiktoken keeps ranks only; Hugging Face's BPE wants the merges, each "left right". A token of rank r was made
    # by merging two tokens of lower rank; running BPE on its bytes with the merges below r stops at that pair.
    def halves(token, rank):  # tiktoken's BPE on the token's bytes with the merges of lower rank only: two parts
        parts = [bytes([x]) for x in token]
        while len(parts) > 2:
            # the adjacent pair of lowest rank merges first, as in tiktoken; pairs no merge makes rank `rank`
            pairs = [(ranks.get(a + b, rank), i) for i, (a, b) in enumerate(zip(parts, parts[1:]))]
            r, i = min(pairs)
            if r >= rank:
                break
            parts[i:i + 2] = [parts[i] + parts[i + 1]]
        return parts

    order = sorted(ranks, key=ranks.get)
    merges = [" ".join(map(text, halves(t, ranks[t]))) for t in order if len(t) > 1]
    if any(m.count(" ") != 1 for m in merges):
        no_tokenizer(f"{path}'s tokenizer ranks are not a byte-level BPE's (a token no merge makes)")
        return None
    # The pipeline transformers runs: split the text by tiktoken's regex (words, numbers, spaces apart), map bytes to
    # characters (ByteLevel, without its own regex: ours did the split), then BPE; the decoder maps back to bytes.
    split = []
    if pat:
        split = [{"type": "Split", "pattern": {"Regex": pat}, "behavior": "Isolated", "invert": False}]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": False}
    end_of_text = {  # the id after the BPE's, as in our tokenizer; special: never split, never merged
        "id": len(ranks),
        "content": EOT,
        "single_word": False,
        "lstrip": False,
        "rstrip": False,
        "normalized": False,
        "special": True,
    }
    bpe = {
        "type": "BPE",
        "dropout": None,
        "unk_token": None,  # byte-level: every text has tokens, none is unknown
        "continuing_subword_prefix": None,
        "end_of_word_suffix": None,
        "fuse_unk": False,
        "byte_fallback": False,
        "ignore_merges": True,  # a word that is a token in the vocab is that token, as tiktoken does
        "vocab": {text(t): ranks[t] for t in order},
        "merges": merges,
    }
    return {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "normalizer": None,
        "post_processor": None,
        "added_tokens": [end_of_text],
        "pre_tokenizer": {"type": "Sequence", "pretokenizers": split + [byte_level]},
        "decoder": byte_level,
        "model": bpe,
    }

def main(cfg):
    """Fine-tune (or --merge_lora, --export) per cfg; returns a dict of final metrics."""
    check_config(cfg)
    if cfg.merge_lora or cfg.export:
        return export_main(cfg)
    # cfg settles here, in the shape and vocabulary of --init_from's weights, before train_gpt.py derives anything
    # from it; a resume of this run must also match its adapters and QAT grid (ADAPT_FIELDS)
    rank, world_size, _ = tg.setup_dist(cfg.device)
    tg.prepare_default_data(cfg, rank, world_size, *tg.DEFAULT_DATA)
    meta, tokenizer = tg.token_data(cfg)
    cfg, init = start_from(cfg, meta, tokenizer, rank, world_size)
    return tg.main(cfg, functools.partial(build_student, init=init), ADAPT_FIELDS)

# -----------------------------------------------------------------------------
# Entry point

if __name__ == "__main__":
    main(tg.parse_args(Config, sys.argv[1:]))
