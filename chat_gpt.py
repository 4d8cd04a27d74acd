"""
chat_gpt.py: fine-tunes train_gpt.py's GPT or GPT-2 to chat (SFT), then chats with the result.

Conversations go into a template of special tokens of its own; the loss is on the assistant's turns only. It imports
train_gpt.py (model, system, optimizers) and finetune_gpt.py (GPT-2's weights, LoRA), as nanochat's chat_sft.py
stands beside its base_train.py.

  python chat_gpt.py --prepare=arithmetic --init_from=out/gpt --data_dir=data/arith_chat   # made here, offline
  python chat_gpt.py --prepare=chats.jsonl --init_from=gpt2 --data_dir=data/my_chat   # {"messages": [...]} a line
  python chat_gpt.py --init_from=out/gpt --data_dir=data/arith_chat --out_dir=out/chat   # SFT, 150 s of training
  python chat_gpt.py --init_from=gpt2 --data_dir=data/my_chat --lora_rank=8 --lr=1e-3    # GPT-2, with LoRA
  python chat_gpt.py --chat --ckpt=out/chat                                              # talk to it
  python chat_gpt.py --chat --ckpt=out/chat --prompt="What is 37 + 48?"                  # one turn, then exit
  torchrun --nproc_per_node=2 chat_gpt.py --init_from=out/gpt --data_dir=data/arith_chat
  python chat_gpt.py -h                                                                  # every flag
"""
import bisect
import dataclasses
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

import finetune_gpt as ft
import prepare_data  # its shard writer, and its cleanup after a preparation that failed
import train_gpt as tg

# -----------------------------------------------------------------------------
# Config
#
# finetune_gpt.py's flags (so train_gpt.py's too, and LoRA's), these, and SFT's own defaults. SFT is short: the base
# model knows the language already and learns a format and a task, from a few thousand conversations.
# --loss_on=all trains on every token, as pretraining does, for comparison: the model then spends capacity on
# learning to write the users' questions too, and its answers count for less of the loss.

@dataclass
class Config(ft.Config):
    prepare: str = ""                  # tokenize this conversations JSONL (arithmetic: made here) into --data_dir
    conversations: int = 4000          # --prepare=arithmetic: how many dialogues
    val_percent: int = 10              # --prepare: conversations held out for val
    loss_on: Literal["answers", "all"] = "answers"  # the assistant's turns (and their end-of-turn), or every token
    eval_turns: int = 200              # val conversations whose last answer is sampled and scored, first and last
    chat: bool = False                 # talk to --ckpt in the terminal; with --prompt, answer one turn and exit
    system: str = ""                   # --chat: a system turn that opens the conversation
    ckpt: str = ""                     # --chat: the SFT checkpoint to talk to; empty = --out_dir
    prompt: str = ""                   # --chat: answer this one message and exit
    # SFT's own defaults: a short run from trained weights, evals of a few hundred conversations
    data_dir: str = "data/arith_chat"  # --prepare's output: token and mask shards, meta.json
    out_dir: str = "out/chat"          # the SFT checkpoint and metrics.jsonl
    init_from: str = "out/gpt"         # the weights to fine-tune: a train_gpt.py checkpoint, gpt2..., a GPT-2 folder
    time_budget: float = 150.0         # seconds of training (eval excluded)
    batch_size: int = 16               # rows per micro-step per rank, each packed with whole conversations
    optimizer: Literal["muon", "adamw"] = "adamw"  # AdamW at a small LR keeps what pretraining taught
    lr: float = 1e-3                   # peak LR
    warmup_steps: int = 10             # linear warmup, in optimizer steps
    eval_every: int = 100              # steps between val-loss evals; 0 = only at the end
    max_new_tokens: int = 200          # --chat: tokens of a reply at most

PRESETS = ft.PRESETS
# the three roles of the messages format: a system turn sets the assistant's behaviour, the user asks, it answers
ROLES = ("system", "user", "assistant")
SPECIALS = ("<|system|>", "<|user|>", "<|assistant|>", "<|end|>")  # a role's turn opens; every turn ends

def check_config(cfg):
    """finetune_gpt.py's checks, then chat's, each a one-line message that names the fix."""
    ft.check_config(cfg)
    if cfg.max_new_tokens < 1:
        tg.die(f"--max_new_tokens must be at least 1, got {cfg.max_new_tokens}")
    if (not 0 < cfg.val_percent < 100
            or cfg.conversations < 2
            or cfg.eval_turns < 0):
        tg.die("need 0 < --val_percent < 100, --conversations >= 2 and --eval_turns >= 0")
    # this loop wraps the model in DDP only, and build() makes no Student or QAT layers (finetune_gpt.py's build_student
    # does): its loss is the masked cross-entropy alone
    if cfg.parallel == "fsdp" or cfg.teacher or cfg.qat:
        tg.die("chat_gpt.py trains with DDP, without --teacher or --qat; drop --parallel=fsdp, --teacher, --qat")

# -----------------------------------------------------------------------------
# The chat template: special tokens in rows that no text reaches
#
# A base model has read documents only. SFT teaches it a format: each turn opens with a token that names who speaks
# and closes with <|end|>. At chat time we write the conversation so far, open the assistant's turn, and sample until
# the model writes <|end|>. The four tokens get new ids after the tokenizer's own, so no text ever encodes to them: a
# user who types "<|end|>" types seven characters, not the end of a turn (nanochat's special tokens work alike).

def make_template(tok, vocab_size):
    """The template of a model of vocab_size tokens: SPECIALS take the ids from vocab_size on (GPT-2's 50,257 are
    padded to 50,304 rows, so its rows exist already; a BPE's too, unless its size is a multiple of 64). A
    conversation opens with end-of-text, as every pretraining document does. A chat model's own is kept."""
    if tok.get("chat"):
        return tok["chat"]
    if tok.get("eot_id") is None:
        tg.die(f"the {tok.get('tokenizer')} tokenizer has no end-of-text token to open a conversation; use a model "
               f"of byte, bpe:N or gpt2 tokens")
    ids = {s: vocab_size + i for i, s in enumerate(SPECIALS)}
    return {"bos": tok["eot_id"], "specials": ids, "vocab_size": vocab_size + len(SPECIALS)}

def render(messages, tpl, encode):
    """(ids, mask): bos, then <|role|> text <|end|> a turn. mask 1: the assistant's text and <|end|> (it learns to
    stop); 2: the first token (a conversation starts); else 0."""
    # The mask is SFT's loss mask: the model is trained to write the assistant's turns, not to predict what users
    # and system prompts say (which it cannot know, and which would teach it to speak as the user). <|end|> is in
    # the loss so that the model learns when to stop. The role tokens are not: the chat writes them itself.
    sp = tpl["specials"]
    ids = [tpl["bos"]]
    mask = [2]
    for m in messages:
        text = encode(m["content"])  # ordinary text only: "<|end|>" in a turn is its characters, never the token
        said = int(m["role"] == "assistant")
        ids += [sp[f"<|{m['role']}|>"], *text, sp["<|end|>"]]
        mask += [0] + [said] * (len(text) + 1)
    return ids, mask

def parse(ids, tpl, decode):
    """The messages of a rendered conversation: render's inverse."""
    roles = {tpl["specials"][f"<|{r}|>"]: r for r in ROLES}  # {a role token's id: its role}
    msgs = []
    for i in ids[1:]:  # after bos
        if i in roles:
            msgs.append({"role": roles[i], "content": []})
        elif i != tpl["specials"]["<|end|>"]:
            msgs[-1]["content"].append(i)
    return [{"role": m["role"], "content": decode(m["content"])} for m in msgs]

# -----------------------------------------------------------------------------
# Data: conversations as token shards with a parallel mask shard
#
# prepare_data.py's shard format, twice: the tokens of all conversations end to end, and beside them a mask shard of
# the same length, one render() mask value a token. Bit 1 marks the tokens in the loss; bit 2 marks where each
# conversation starts, so that the loader cuts them apart again and packs whole ones into rows.

def arithmetic(n, seed):
    """n dialogues of sums and differences of numbers under 100, one to three questions each, some after a system
    turn. Every answer follows from its question, so exact match on held-out ones measures what SFT taught."""
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        msgs = []
        if rng.random() < 0.3:
            msgs.append({"role": "system", "content": "You are a calculator."})
        for _ in range(rng.randint(1, 3)):
            a = rng.randrange(100)
            b = rng.randrange(100)
            op = rng.choice("+-")
            if op == "+":
                c = a + b
            else:
                c = a - b
            msgs.append({"role": "user", "content": f"What is {a} {op} {b}?"})
            msgs.append({"role": "assistant", "content": f"{a} {op} {b} = {c}."})
        out.append({"messages": msgs})
    return out

def read_conversations(path, tpl, encode, seq_len):
    """[(ids, mask)] of a JSONL of {"messages": [{"role", "content"}, ...]} lines (most SFT sets' format)."""
    # the format of OpenAI's chat API and of most SFT sets on the Hugging Face hub; a bad line stops the preparation
    # with its line number, before anything is written
    out = []
    with tg.exit_if_unreadable(path, "pass a JSONL file of conversations"), open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            msgs = json.loads(line)["messages"]
        except (ValueError, KeyError, TypeError):
            tg.die(f'{path}:{i}: not a conversation; each line needs {{"messages": [{{"role": ..., "content": ...}}]}}')
        if not isinstance(msgs, list) or not msgs:
            tg.die(f"{path}:{i}: an empty conversation; give it turns, or drop the line")
        for j, m in enumerate(msgs, 1):
            if (not isinstance(m, dict)
                    or m.get("role") not in ROLES
                    or not isinstance(m.get("content"), str)):
                tg.die(f"{path}:{i}: turn {j} has no role of {'|'.join(ROLES)} or no text content; fix the turn")
        ids, mask = render(msgs, tpl, encode)
        # a row holds T + 1 tokens (inputs and targets shifted by one); a longer conversation would be cut mid-turn
        if len(ids) > seq_len + 1:
            tg.die(f"{path}:{i}: {len(ids)} tokens, longer than --seq_len={seq_len} + 1; raise --seq_len or split "
                   f"the conversation")
        out.append((ids, mask))
    return out

def held_out(n, val_percent, seed):
    """(val, train) indices of n conversations: val_percent of them (at least one) held out at random, in the order
    drawn; the rest in order. rl_gpt.py holds out the same ones."""
    # whole conversations are held out, drawn at random: val then asks questions that training never saw
    order = random.Random(seed).sample(range(n), n)
    n_val = max(1, n * val_percent // 100)  # at least one, so that there is a val loss
    return order[:n_val], sorted(order[n_val:])

def source_tokenizer(where):
    """(tokenizer, vocab size) of --init_from: GPT-2's, or a checkpoint's."""
    if ft.is_gpt2(where):
        if os.path.isdir(where):  # a folder says, in its config.json
            return ft.GPT2_TOKENIZER, ft.gpt2_config(tg.Config(seq_len=0), where)[1]
        return ft.GPT2_TOKENIZER, 50257  # a named GPT-2 has 50,257 tokens
    ckpt = None
    if os.path.exists(where):
        ckpt = tg.load_checkpoint(where)[0]
    if ckpt is None:
        tg.die(f"--init_from={where}: no checkpoint there; train one (python train_gpt.py) or pass gpt2")
    return ckpt["tokenizer"], ckpt["data_info"]["vocab_size"]

def prepare(cfg):
    """--prepare: conversations in --init_from's template, as token and mask shards staged, then moved to --data_dir."""
    ft.check_writable("--data_dir", cfg.data_dir)
    # the data is tokenized for one model: --init_from's tokenizer encodes the text, and its vocabulary size fixes
    # the template's ids (training checks that the two still agree)
    tok, vocab_size = source_tokenizer(cfg.init_from)
    tpl = make_template(tok, vocab_size)
    encode = tg.load_tokenizer(tok)[0]
    if encode is tg.encode_ids:
        tg.die(f"the {tok['tokenizer']} tokenizer did not load (see above); it is needed to tokenize conversations")
    data_dir = os.path.abspath(cfg.data_dir)
    with prepare_data.staging(Path(data_dir), tg.die) as stage:  # built beside data_dir, then moved in
        src = cfg.prepare
        if src == "arithmetic":  # written out, so the data dir shows the format it was made from
            src = os.path.join(stage, "conversations.jsonl")
            dialogues = arithmetic(cfg.conversations, cfg.seed)
            Path(src).write_text("".join(json.dumps(c) + "\n" for c in dialogues))
        convs = read_conversations(src, tpl, encode, cfg.seq_len)
        val, train = held_out(len(convs), cfg.val_percent, cfg.seed)
        if not train:
            tg.die(f"{cfg.prepare}: {len(convs)} conversations leave none to train on; add more or lower --val_percent")
        splits = {}
        for split, part in (("val", val), ("train", train)):
            ids = np.concatenate([convs[i][0] for i in part])
            mask = np.concatenate([convs[i][1] for i in part])
            prepare_data.write_shard(os.path.join(stage, f"{split}_000000.bin"), ids)
            prepare_data.write_shard(os.path.join(stage, f"{split}_mask_000000.bin"), mask)
            splits[split] = dict(
                tokens=len(ids),
                conversations=len(part),
                shards=[f"{split}_000000.bin"],
                masks=[f"{split}_mask_000000.bin"],
                learnt=int((mask & 1).sum()),  # tokens in the loss
            )
        # meta.json as prepare_data.py writes it (the trainers' tokenizer fields), plus the chat template: the model
        # gets it with the data, and its checkpoint keeps it for --chat
        meta = dict(
            format="trainsuite-chat-1",
            source=cfg.prepare,
            tokenizer=tok["tokenizer"],
            vocab_size=tpl["vocab_size"],
            eot_id=tok["eot_id"],
            pat_str=tok.get("pat_str"),
            itos=tok.get("itos"),
            tokenizer_file=None,
            chat=tpl,
            splits=splits,
        )
        if tok.get("ranks"):  # the BPE's ranks travel with the data, as prepare_data.py writes them
            meta["tokenizer_file"] = "tokenizer.tiktoken"
            Path(stage, "tokenizer.tiktoken").write_text(tok["ranks"])
        Path(stage, "meta.json").write_text(json.dumps(meta, indent=2))
        # Swap in the new files: the old meta.json goes first, so a crash midway leaves a folder that no trainer
        # takes for prepared data, and the new one arrives last, when every shard it lists is in place.
        for name in ["meta.json", *os.listdir(data_dir)]:  # meta.json first: without it, the dir is not prepared
            old = os.path.join(data_dir, name)
            if name.endswith((".bin", ".json", ".jsonl", ".tiktoken")) and os.path.exists(old):
                os.remove(old)
        for name in sorted(os.listdir(stage), key=lambda n: n == "meta.json"):  # meta.json last
            os.replace(os.path.join(stage, name), os.path.join(data_dir, name))
    parts = [f"{k} {s['conversations']:,} conversations, {s['tokens']:,} tokens ({s['learnt']:,} learnt)"
             for k, s in splits.items()]
    print(f"wrote {cfg.data_dir} ({tok['tokenizer']}, vocab {vocab_size} + {len(SPECIALS)} chat tokens): "
          + " | ".join(parts))
    return {"data_dir": cfg.data_dir, **{f"{k}_conversations": s["conversations"] for k, s in splits.items()}}

def load_conversations(data_dir, meta, split, loss_on):
    """[(ids, learn)] of a split, cut where its mask marks a conversation's first token. learn: the tokens in the
    loss, the assistant's (--loss_on=answers) or all but the first (all)."""
    s = meta["splits"][split]
    ids = np.concatenate([tg.open_shard(os.path.join(data_dir, f)) for f in s["shards"]])
    mask = np.concatenate([tg.open_shard(os.path.join(data_dir, f)) for f in s["masks"]])
    if loss_on == "answers":
        learn = (mask & 1) > 0
    else:  # all but bos: before it in a row stands another conversation, or nothing
        learn = (mask & 2) == 0
    cuts = [*np.flatnonzero(mask & 2), len(ids)]
    return [(ids[a:b].astype(np.int64), learn[a:b]) for a, b in zip(cuts, cuts[1:])]

def pack(lengths, T, order):
    """Rows (lists of conversation indices) of T + 1 tokens at most, whole conversations from row starts, by best
    fit: each conversation, in order, into the fullest row it fits in, else a new row."""
    # A row of one conversation padded to T + 1 wastes most of it when conversations are short (the arithmetic ones
    # are a tenth of a row). Packing several into a row fills it; none is cut, so every answer is learnt with all
    # of its question in view. Attention is not reset between them: a later conversation sees the earlier ones, as
    # the documents in train_gpt.py's rows do; each opens with bos, which marks where the new one begins.
    rows = []
    free = []  # sorted (room left, row index)
    for i in order:
        k = bisect.bisect_left(free, (lengths[i], -1))  # the row with the least room that still fits it
        if k == len(free):
            rows.append([])
            room = T + 1
            r = len(rows) - 1
        else:
            room, r = free.pop(k)
        rows[r].append(i)
        bisect.insort(free, (room - lengths[i], r))
    return rows

def batch(convs, rows, T, device):
    """(x, y) (B, T) of packed rows; y is -100 (no target) where nothing is learnt: masked out, padding."""
    # -100 is F.cross_entropy's ignore_index: those positions add nothing to the loss or its count
    x = torch.zeros(len(rows), T + 1, dtype=torch.long)  # (B, T + 1)
    y = torch.full((len(rows), T + 1), -100)
    for b, row in enumerate(rows):
        p = 0
        for i in row:
            ids, learn = convs[i]
            x[b, p:p + len(ids)] = torch.from_numpy(ids)
            y[b, p:p + len(ids)] = torch.from_numpy(np.where(learn, ids, -100))
            p += len(ids)
    # the target of position t is the token at t + 1: a token learnt is predicted from everything before it
    return x[:, :-1].to(device), y[:, 1:].to(device)

# -----------------------------------------------------------------------------
# Model: --init_from's weights, with rows for the template's tokens

def build(cfg, init, tpl, device):
    """--init_from's weights, each of the template's new rows in the embedding (and an untied head) the mean of the
    real rows: an average token, not noise or zeros (Hewitt 2021). With LoRA, both train too: new rows must learn."""
    raw = tg.build_model(cfg, tpl["vocab_size"], device)
    sd = init["model"]
    old = init["vocab_size"]  # the base model's real rows
    new = tpl["vocab_size"]  # and the template's four after them
    # At the mean, a new token gets an ordinary logit, and the model's predictions at step 0 stay close to the base
    # model's (Hewitt's argument); noise or zeros can give the new tokens a large share of the softmax at once.
    for k in ("wte.weight", "head.weight"):
        if k in sd and new > old:
            rows = raw.state_dict()[k].shape[0] - sd[k].shape[0]  # more rows, if the padding lacks them
            w = F.pad(sd[k].float(), (0, 0, 0, rows))  # (padded vocab, n_embd)
            w[old:new] = w[:old].mean(0)
            sd[k] = w.to(sd[k].dtype)
    raw.load_state_dict(sd)
    # LoRA freezes the embedding, which would leave the template's rows at the mean for good: the model could not
    # learn what <|user|> or <|end|> mean. So the embedding (and an untied head) train whole, beside the adapters.
    if cfg.lora_rank:
        ft.add_lora(raw, cfg)
        raw.wte.requires_grad_(True)
        if raw.head is not None:
            raw.head.requires_grad_(True)
    return raw

def backward(model, batches, ctx, scaler, z_loss, world_size):
    """One optimizer step's micro-steps: the summed loss of the masked-in targets over the count of them in all
    micro-steps on all ranks (torchtitan's normaliser), so accum 1 or 4, 1 rank or 2, give the same gradient and each
    token weighs alike. An all-masked micro-batch adds exactly 0. Returns the step's mean loss on this rank."""
    # Masks leave a different number of targets in each micro-batch. A mean per micro-batch would weigh a token of a
    # short answer more than one of a long answer, and change the gradient with how the rows fall into micro-steps.
    count = sum((y != -100).sum() for _, y in batches).float()
    if world_size > 1:  # before any backward: every micro-step divides by the step's total
        dist.all_reduce(count)
    norm = world_size / count.clamp(min=1)  # DDP averages the ranks' grads: x world_size makes that a sum
    loss_sum = torch.zeros((), device=count.device)
    for micro, (x, y) in enumerate(batches):
        with tg.grad_sync(model, micro == len(batches) - 1):  # DDP all-reduces on the last micro-step only
            with ctx:
                loss = model(x, y, z_loss, reduction="sum") * norm
            scaler.scale(loss).backward()
        loss_sum += loss.detach().float()
    return loss_sum

def reply(model, ids, end, max_new, temperature, top_k, gen):
    """(reply, whether it ended): ids sampled after ids with the KV cache, 32 at a time, until `end` or max_new."""
    # 32 at a time: the host looks for `end` once a chunk, not once a token (each look is a device sync), and a
    # reply that ended early wastes fewer than 32 tokens
    out = torch.tensor([ids], device=next(model.parameters()).device)  # (1, len(ids)), then longer
    new = []  # the tokens sampled so far
    while len(new) < max_new and end not in new:
        out = model.generate(out, min(32, max_new - len(new)), temperature, top_k, gen)
        new = out[0, len(ids):].tolist()
    if end in new:
        return new[:new.index(end)], True
    return new, False

def evaluate(cfg, model, convs, tpl, ctx, rank, world_size, step, turns):
    """{val_loss}: per masked-in token of the val conversations, packed in order; with turns, {exact, ended}: of
    the first --eval_turns, the share whose last answer, sampled greedily after the turns before it, is the
    reference token for token, and the share that ended with end-of-turn at all. Ranks share the work."""
    # val loss says how well the model predicts answers; exact match says whether it answers, which is what SFT is
    # for. Both are measured before SFT (the base model, which has never seen the template) and at the end.
    B = cfg.batch_size
    T = cfg.seq_len
    device = next(model.parameters()).device
    rows = pack([len(c[0]) for c in convs], T, range(len(convs)))
    sums = torch.zeros(5, device=device)  # loss, targets, exact answers, ended answers, answers scored
    aid = tpl["specials"]["<|assistant|>"]
    end = tpl["specials"]["<|end|>"]
    model.eval()
    with torch.no_grad():
        for i in range(rank * B, len(rows), B * world_size):  # rank r takes every world_size-th batch of rows
            x, y = batch(convs, rows[i:i + B], T, device)
            with ctx:
                sums[0] += model(x, y, reduction="sum").float()
            sums[1] += (y != -100).sum()
    n_scored = cfg.eval_turns if turns else 0
    for ids, _ in convs[:n_scored][rank::world_size]:
        if aid not in ids:  # no assistant turn: nothing to score
            continue
        k = int(np.flatnonzero(ids == aid)[-1]) + 1  # where the last answer starts
        answer = ids[k:k + list(ids[k:]).index(end)].tolist()
        # greedy (temperature 0): the model's best answer, the same on every run; a few tokens of room for <|end|>
        got, ended = reply(model, ids[:k].tolist(), end, len(answer) + 8, 0.0, 0, None)
        sums[2:] += torch.tensor([got == answer and ended, ended, True], device=device)
    model.train()
    if world_size > 1:
        dist.all_reduce(sums)
    # the loss per target; the exact and ended shares per answer scored
    loss, _, exact, ended, _ = (sums / sums[[1, 1, 4, 4, 4]].clamp(min=1)).tolist()
    rec = {"val_loss": loss}
    line = f"eval {step:05d} | val loss {loss:.4f} (answers)"
    if turns and cfg.eval_turns:
        rec.update(exact=exact, ended=ended)
        line += f" | {sums[4]:.0f} held-out last answers: exact {exact:.1%} | ended with <|end|> {ended:.1%}"
    print(line)
    return rec

# -----------------------------------------------------------------------------
# Training loop
#
# train_gpt.py's loop, cut to what a run of minutes needs: no resume, no guard against loss spikes, no checkpoints
# until the one at the end. The model, precision, compile, DDP wrapping and optimizers are train_gpt.py's own. What
# SFT changes is the data: packed rows of whole conversations instead of a token stream, and a loss over the
# assistant's tokens only, normalised over the whole step (backward).

def data_and_model(cfg, rank, world_size):
    """(cfg in --init_from's shape, meta, chat tokenizer, init), the data's tokenizer checked against the model's."""
    ft.check_out_dir(cfg.out_dir, "chat model")  # now, not when it is written after the training
    meta = tg.load_meta(cfg.data_dir)
    if "chat" not in meta:
        tg.die(f"{cfg.data_dir} holds no conversations; make it with python chat_gpt.py --prepare=FILE.jsonl "
               f"--init_from={cfg.init_from} --data_dir={cfg.data_dir}")
    arch, init = ft.load_init(cfg, rank, world_size)
    tok = {**tg.tokenizer_info(cfg.data_dir, meta), "chat": meta["chat"]}
    theirs = init["tokenizer"]
    # the data's ids must mean what the model's do: the same tokenizer, and the template's tokens in the same rows
    if not ft.same_tokenizer(theirs, tok) or make_template(theirs, init["vocab_size"]) != meta["chat"]:
        tg.die(f"{cfg.data_dir} was prepared for another tokenizer or template than --init_from={cfg.init_from}'s; "
               f"prepare it again with --init_from={cfg.init_from}")
    return dataclasses.replace(cfg, **arch), meta, tok, init

def set_lr(cfg, opts, step, train_time, time_budget, max_steps):
    """Set this step's LR in every param group (train_gpt.py's schedule); returns its multiple of the peak."""
    # the schedule runs on the share of the budget spent: of the seconds, or of the steps
    if time_budget:
        progress = train_time / time_budget
    else:
        progress = step / max_steps
    mult = tg.lr_mult(cfg, step, progress)
    for opt in opts:
        for g in opt.param_groups:
            g["lr"] = g["peak_lr"] * mult
    return mult

def train(cfg):
    """Set up, score the model before SFT, then the loop: micro-steps, clip, step, log, eval; then save."""
    rank, world_size, device = tg.setup_dist(cfg.device)
    if rank:  # one rank prints: the others' lines would repeat its own
        sys.stdout = open(os.devnull, "w")
    cfg, meta, tok, init = data_and_model(cfg, rank, world_size)
    dtype, ctx, scaler = tg.setup_precision(device, cfg.dtype)
    cfg = dataclasses.replace(cfg, dtype=str(dtype).removeprefix("torch."))
    raw = build(cfg, init, tok["chat"], device)
    tg.kernels.use(cfg.kernels)  # Triton's or PyTorch's ops, chosen before compile traces the model
    tg.kernels.use_attention(cfg.attention)  # flex: a window skips the tiles it masks
    model, compiled = tg.wrap_model(raw, cfg, device, dtype, world_size)
    opts = tg.build_optimizers(cfg, raw, dtype)
    B = cfg.batch_size
    T = cfg.seq_len
    accum = cfg.grad_accum
    tpl = tok["chat"]
    convs = load_conversations(cfg.data_dir, meta, "train", cfg.loss_on)
    val = load_conversations(cfg.data_dir, meta, "val", "answers")  # val scores the answers, whatever trains
    lengths = [len(c[0]) for c in convs]
    if max(lengths) > T + 1:
        tg.die(f"{cfg.data_dir} has conversations of {max(lengths)} tokens, over --seq_len={T} + 1; raise it")
    # how many rows one epoch packs into; rows a step = B x accum x world_size, as in train_gpt.py
    n_rows = len(pack(lengths, T, range(len(lengths))))
    # best fit's padding, against a conversation a row: what packing saves
    padding = 1 - sum(lengths) / (n_rows * (T + 1))
    padding_one = 1 - sum(lengths) / (len(lengths) * (T + 1))
    # a budget in steps or in seconds of training: --max_steps, when set, wins
    max_steps = cfg.max_steps
    time_budget = 0.0 if cfg.max_steps else cfg.time_budget
    budget = f"{time_budget:.0f} s" if time_budget else f"{max_steps} steps"
    n_train = sum(p.numel() for p in raw.parameters() if p.requires_grad)
    print(f"{n_train / 1e6:.2f}M parameters train | {len(convs)} conversations in {n_rows} rows of {T + 1}: "
          f"{padding:.1%} padding (one a row: {padding_one:.1%}) | loss on {cfg.loss_on} | rows a step: B {B} x accum "
          f"{accum} x world {world_size} | {budget} | {device} {dtype} | compile {compiled}")
    # the base model's scores before any SFT: the end's scores are read against these
    before = evaluate(cfg, raw, val, tpl, ctx, rank, world_size, 0, turns=True)

    # the loop's state is plain names; an epoch is one pass over the train conversations, each packed anew
    step = 0
    train_time = 0.0
    epoch = 0
    rows = []  # the packed rows not trained on yet
    history = [dict(step=0, **before)]
    last_step = False
    t0 = time.perf_counter()
    while not last_step:
        mult = set_lr(cfg, opts, step, train_time, time_budget, max_steps)
        while len(rows) < B * accum * world_size:  # each epoch packed anew, from a new shuffle
            shuffled = random.Random(cfg.seed + epoch).sample(range(len(lengths)), len(lengths))
            rows += pack(lengths, T, shuffled)
            epoch += 1
        # a step takes B rows per micro-step per rank; micro-step m of rank r takes the B rows at (m * world + r) * B
        mine = [rows[(m * world_size + rank) * B:][:B] for m in range(accum)]
        rows = rows[B * accum * world_size:]
        for opt in opts:
            opt.zero_grad(set_to_none=True)
        batches = [batch(convs, r, T, device) for r in mine]
        loss = backward(model, batches, ctx, scaler, cfg.z_loss, world_size)
        for opt in opts:
            scaler.unscale_(opt)  # fp16's loss scale off the grads, before they are clipped
        gnorm = nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip or float("inf"))
        for opt in opts:
            scaler.step(opt)
        scaler.update()  # fp16: the loss scale grows, or shrinks after a step whose grads overflowed
        step += 1
        now = time.perf_counter()
        local = torch.stack([loss, gnorm.float(), loss.new_tensor(train_time + now - t0)])
        # the step's one sync: the ranks agree on the loss, the grad norm and the time, so they stop together
        loss, gnorm, train_time = tg.all_mean(local, world_size).tolist()
        t0 = now
        if time_budget:
            last_step = train_time >= time_budget
        else:
            last_step = step >= max_steps
        if step % cfg.log_every == 0 or last_step:
            history.append(dict(step=step, loss=loss, lr=cfg.lr * mult, gnorm=gnorm, train_time=train_time))
            print(" | ".join(f"{k} {v:.4g}" for k, v in history[-1].items()))
        if last_step or (cfg.eval_every and step % cfg.eval_every == 0):
            after = evaluate(cfg, raw, val, tpl, ctx, rank, world_size, step, turns=last_step)
            history.append(dict(step=step, **after))
            t0 = time.perf_counter()  # evals are not training time

    # a checkpoint as train_gpt.py writes one, so every script reads it; no optimizer state: SFT is not resumed
    if rank == 0:
        tg.write_checkpoint(cfg.out_dir, {
            "model": raw.state_dict(),
            "optim": None,
            "step": step,
            "train_time": train_time,
            "history": history,
            "config": dataclasses.asdict(cfg),
            "data_info": {"vocab_size": tpl["vocab_size"]},
            "tokenizer": tok,  # with its chat template: --chat reads it from here
            "world_size": world_size,
        })
        with open(os.path.join(cfg.out_dir, "metrics.jsonl"), "w") as f:  # the history, a line a record
            f.writelines(json.dumps(h) + "\n" for h in history)
    line = f"done: {step} steps in {train_time:.0f} s | val loss {before['val_loss']:.4f} -> {after['val_loss']:.4f}"
    for k in ("exact", "ended"):
        if k in after:
            line += f" | {k} {before[k]:.1%} -> {after[k]:.1%}"
    print(line + f" | checkpoint in {cfg.out_dir} | python chat_gpt.py --chat --ckpt={cfg.out_dir}")
    return {"steps": step, "train_time": train_time, **after, **{f"{k}_before": v for k, v in before.items()}}

# -----------------------------------------------------------------------------
# Chat

def chat_main(cfg):
    """--chat: a terminal chat with --ckpt that keeps the conversation; --prompt: one turn, then exit."""
    device = tg.setup_dist(cfg.device)[2]
    # what makes a chat model: SFT on --data_dir (after --prepare, if the data is not there yet) into --out_dir
    sft = f"python chat_gpt.py --init_from={cfg.init_from} --data_dir={cfg.data_dir}"
    first = ""
    if not os.path.exists(os.path.join(cfg.data_dir, "meta.json")):
        first = f"{sft} --prepare=arithmetic, then "
    fix = f"train a chat model first: {first}{sft} --out_dir={cfg.out_dir}"
    flag, where = ("--ckpt", cfg.ckpt) if cfg.ckpt else ("--out_dir", cfg.out_dir)
    model, tok, step, path = ft.load_model(where, device, flag, fix)
    if not tok.get("chat"):
        tg.die(f"{path} is no chat model (its tokenizer has no template); {fix}")
    tpl = tok["chat"]
    encode, decode = tg.load_tokenizer(tok)
    msgs = []
    if cfg.system:
        msgs.append({"role": "system", "content": cfg.system})
    # sampled as sample_gpt.py samples, with --temperature and --top_k; a seeded generator: the same seed, the same
    # replies
    gen = torch.Generator(device).manual_seed(cfg.seed)
    header = f"# {path} (step {step})"
    if not cfg.prompt:
        header += ": type a message; an empty line or Ctrl-D ends"
    print(header)
    while True:
        try:
            text = cfg.prompt or input("you> ")
        except (EOFError, KeyboardInterrupt):  # Ctrl-D or Ctrl-C: the chat ends
            text = ""
        if not text:
            return {"messages": msgs}
        msgs.append({"role": "user", "content": text})
        # the whole conversation so far, rendered as in training, then <|assistant|>: the model's turn to speak,
        # until it writes <|end|> as SFT taught it
        ids = render(msgs, tpl, encode)[0] + [tpl["specials"]["<|assistant|>"]]
        got, ended = reply(model, ids, tpl["specials"]["<|end|>"], cfg.max_new_tokens, cfg.temperature,
                           cfg.top_k, gen)
        msgs.append({"role": "assistant", "content": decode(got)})
        note = "" if ended else f" [no <|end|> in {cfg.max_new_tokens} tokens]"
        print(f"assistant> {decode(got)}{note}")
        if cfg.prompt:
            return {"text": decode(got), "ids": got, "ended": ended, "prompt_ids": ids}

def main(cfg):
    """Prepare conversations, fine-tune on them, or chat, per cfg; returns a dict of final metrics."""
    check_config(cfg)
    if cfg.prepare:  # a failed or interrupted one leaves no new folder behind, as prepare_data.py's
        with prepare_data.leaving_nothing_new(cfg.data_dir):
            return prepare(cfg)
    if cfg.chat:
        return chat_main(cfg)
    return train(cfg)

# -----------------------------------------------------------------------------
# Entry point

if __name__ == "__main__":
    main(tg.parse_args(Config, sys.argv[1:]))
