"""
eval_gpt.py: multiple-choice accuracy of a trained GPT, on HellaSwag (Zellers et al. 2019)
or any JSONL of items in its format: {"ctx": text, "endings": [text, ...], "label": k}.

  python prepare_data.py hellaswag                                  # its 10,042 val items
  python eval_gpt.py --ckpt=out/gpt --items=data/hellaswag
  python eval_gpt.py --ckpt=gpt2 --items=data/hellaswag             # GPT-2 itself (a download)
  python eval_gpt.py --ckpt=out/gpt2_124m --items=data/hellaswag --every_checkpoint   # a curve
  torchrun --nproc_per_node=8 eval_gpt.py --ckpt=out/gpt2_124m --items=data/hellaswag

How an item is scored, as build-nanogpt and llm.c score HellaSwag: each ending follows its
context after a space, the model gives each ending's tokens a loss (the context's tokens are
inputs only), and the item counts as right when the label's ending has the least loss
(`acc`) or the least loss per token (`acc_norm`, which does not favour short endings).
Random guessing gives 25% on four endings; GPT-2 124M reaches about 29.5% acc_norm.

Scoring is a job on a finished checkpoint, so it lives here, beside train_gpt.py, as nanochat
keeps base_eval.py beside base_train.py. To follow the accuracy over a run, keep its
checkpoints (train_gpt.py --milestone_every=N) and score them all with --every_checkpoint.
"""
import json
import math
import os
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist

import finetune_gpt as ft
import train_gpt as tg


@dataclass
class Config:
    ckpt: str = "out/gpt"  # a run's folder (its newest checkpoint), a ckpt_*.pt, gpt2[-medium|-xl...], a HF folder
    items: str = "data/hellaswag"  # a JSONL of items, or a folder holding one (prepare_data.py hellaswag's)
    every_checkpoint: bool = False  # score each checkpoint that --ckpt's folder keeps, oldest first
    batch_items: int = 0  # items a forward; 0 = 1 on a CPU (padding costs more than it saves), 16 on a GPU
    device: Literal["auto", "cpu", "cuda", "mps"] = "auto"  # auto: CUDA, else MPS, else the CPU
    dtype: Literal["auto", "bfloat16", "float16", "float32"] = "auto"  # auto: bf16 where it is fast


PRESETS = {}  # parse_args() offers a trainer's presets; scoring has none


def mc_encoder(tokenizer):
    """The checkpoint's encode function, for the items' text; stops if its tokenizer did not load."""
    encode = tg.load_tokenizer(tokenizer)[0]
    if encode is tg.encode_ids:
        tg.die(f"scoring text needs the model's tokenizer ({tokenizer.get('tokenizer')}), which did not load "
               "(see above)")
    return encode


def read_choices(path, encode, eot=None):
    """[(context ids, [ending ids], label)] of a HellaSwag-format JSONL, or of a folder's one .jsonl."""
    if os.path.isdir(path):
        files = sorted(f for f in os.listdir(path) if f.endswith(".jsonl"))
        if len(files) != 1:
            tg.die(f"--items={path}: {len(files)} .jsonl files there; name one")
        path = os.path.join(path, files[0])
    items = []
    with tg.exit_if_unreadable(path, "pass a JSONL file"), open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            try:
                d = json.loads(line)
                ctx, ends, label = d["ctx"], d["endings"], int(d["label"])
                ok = isinstance(ctx, str) and isinstance(ends, list) and len(ends) > 0
                ok = ok and all(isinstance(e, str) for e in ends)
            except (ValueError, KeyError, TypeError):
                ok = False
            if not ok:
                tg.die(f"{path}:{i}: not a multiple-choice item; each line needs "
                       '{"ctx": text, "endings": [text, ...], "label": index}')
            if not 0 <= label < len(ends):  # an item of the right shape whose answer is not among its endings
                tg.die(f"{path}:{i}: label {label} is not an index of its {len(ends)} endings (0..{len(ends) - 1})")
            # an ending's first token needs a token before it to be predicted from. An empty
            # context starts at the end-of-text token, as lm-evaluation-harness does
            context = encode(ctx)
            if not context and eot is None:
                tg.die(f"{path}:{i}: the context is empty and this tokenizer has no end-of-text token to start "
                       "from; give the item a context")
            endings = [encode(" " + e) for e in ends]
            items.append((context or [eot], endings, label))
    if not items:
        tg.die(f"--items={path}: no items")
    return items


def choice_losses(model, rows, ctx, device):
    """(summed loss, tokens) of each row's ending. rows: [(ids, k)], the ending being the last
    k ids. One forward over all rows, right-padded; only the endings' tokens are targets."""
    # Right padding keeps every row's positions where a lone forward would put them (RoPE
    # and the causal mask see the same prefix), so a padded row scores as an unpadded one;
    # tests/test_choices.py checks this against one plain forward per ending.
    T = max(len(ids) for ids, _ in rows) - 1
    x = torch.zeros(len(rows), T, dtype=torch.long)  # (rows, T): inputs
    y = torch.full((len(rows), T), -100)  # (rows, T): targets; -100 (no target) on the context and padding
    for i, (ids, k) in enumerate(rows):
        n = len(ids) - 1  # position t predicts token t + 1
        x[i, :n] = torch.tensor(ids[:-1])
        y[i, n - k:n] = torch.tensor(ids[-k:])
    with ctx:
        loss = model(x.to(device), y.to(device), reduction="none").float()  # (rows * T,)
    per_row = loss.view(len(rows), T).sum(1)
    return per_row.cpu(), (y != -100).sum(1)


def score_choices(model, items, ctx, seq_len, rank, world_size, device, what, per_batch=0):
    """{mc_acc, mc_acc_norm, mc_items}: is the ending of least loss (acc), or of least loss a
    token (acc_norm), the label? Each rank scores every world_size-th item."""
    # short items first: a batch of similar lengths pads little
    def length(item):
        context, endings, _ = item
        return len(context) + len(endings[0])
    mine = sorted(items[rank::world_size], key=length)
    per_batch = per_batch or (16 if device.type == "cuda" else 1)
    # every rank runs as many forwards, since an FSDP forward is a collective of all ranks
    n_batches = math.ceil(math.ceil(len(items) / world_size) / per_batch)
    hits = torch.zeros(3)  # right by acc, right by acc_norm, items
    model.eval()
    with torch.no_grad():
        for b in range(n_batches):
            batch = mine[b * per_batch:(b + 1) * per_batch]
            rows = []
            for context, ends, _ in batch:
                for e in ends:  # the last seq_len + 1 tokens: an over-long context loses its start
                    rows.append(((context + e)[-seq_len - 1:], min(len(e), seq_len)))
            if not rows:  # this rank has run out of items: a dummy forward keeps it in step
                rows = [([0, 0], 1)]
            total, count = choice_losses(model, rows, ctx, device)
            for _, ends, label in batch:
                loss, tokens = total[:len(ends)], count[:len(ends)]
                total, count = total[len(ends):], count[len(ends):]
                right = loss.argmin() == label
                right_per_token = (loss / tokens).argmin() == label
                hits += torch.tensor([right, right_per_token, 1])
    # each rank counted its own items: the sums over ranks are the whole set's counts
    hits = hits.to(device)
    if world_size > 1:
        dist.all_reduce(hits)
    acc, acc_norm, n = hits.tolist()
    print(f"{what}: acc_norm {acc_norm / n:.2%} | acc {acc / n:.2%} | {n:.0f} items")
    return {"mc_acc": acc / n, "mc_acc_norm": acc_norm / n, "mc_items": int(n)}


def main(cfg):
    """Score cfg.items with cfg.ckpt (or each checkpoint of its folder); returns the (last) {mc_acc, ...}."""
    if cfg.batch_items < 0:
        tg.die(f"--batch_items must be at least 0, got {cfg.batch_items}")
    rank, world_size, device = tg.setup_dist(cfg.device)
    if rank:  # one rank prints: the others' lines would repeat its own
        sys.stdout = open(os.devnull, "w")
    ctx = tg.setup_precision(device, cfg.dtype)[1]
    where = [cfg.ckpt]
    if cfg.every_checkpoint:
        where = [path for _, path in tg.list_checkpoints(cfg.ckpt)]
        if not where:
            tg.die(f"--every_checkpoint: {cfg.ckpt} holds no checkpoints; pass a run's --out_dir")
    # the items are read once, with the first checkpoint's tokenizer (a run keeps its tokenizer)
    items, rec = None, {}
    for ckpt in where:
        model, tokenizer, step, path = ft.load_model(ckpt, device)
        if items is None:
            items = read_choices(cfg.items, mc_encoder(tokenizer), tokenizer.get("eot_id"))
        t0 = time.perf_counter()
        rec = score_choices(model, items, ctx, model.cfg.seq_len, rank, world_size, device,
                            f"# {path} (step {step}) | {cfg.items}", cfg.batch_items)
        print(f"{rec['mc_items']} items in {time.perf_counter() - t0:.1f} s")
    if dist.is_initialized():
        dist.destroy_process_group()
    return rec


if __name__ == "__main__":
    main(tg.parse_args(Config, sys.argv[1:]))
