"""
rl_gpt.py: reinforcement learning after chat SFT. The model answers questions whose answer can be checked; each
answer that scores above its group's mean is made likelier, each below it less likely (a GRPO-style policy gradient).

It imports chat_gpt.py (the template, the SFT model, the arithmetic task) and train_gpt.py (model, system,
machinery), as nanochat's chat_rl.py stands beside its chat_sft.py. It starts from an SFT checkpoint.

  python rl_gpt.py --init_from=out/chat --out_dir=out/rl                   # arithmetic prompts, made here, offline
  python rl_gpt.py --init_from=out/chat --prompts=qa.jsonl --out_dir=out/rl_qa    # {"messages": [...], "answer": ...}
  python rl_gpt.py --init_from=out/chat --score_only --out_dir=out/rl_score      # pass@1 and pass@k, no training
  python rl_gpt.py --init_from=out/chat --out_dir=out/rl --resume                 # after a SIGTERM
  torchrun --nproc_per_node=2 rl_gpt.py --init_from=out/chat --out_dir=out/rl_ddp
  python chat_gpt.py --chat --ckpt=out/rl --prompt="What is 37 + 48?"              # talk to the result
  python rl_gpt.py -h                                                              # every flag
"""
import copy
import dataclasses
import json
import os
import random
import re
import shlex
import sys
import time
from dataclasses import dataclass
from typing import Literal

import numpy as np
import torch
import torch.distributed as dist
import torch.nn as nn

import chat_gpt as chat
import finetune_gpt as ft
import train_gpt as tg

# -----------------------------------------------------------------------------
# Config
#
# finetune_gpt.py's flags (so train_gpt.py's, and LoRA's), and RL's own. A step asks --batch_size prompts per
# micro-step per rank, samples --samples answers to each, scores them, and takes one optimizer step.

@dataclass
class Config(ft.Config):
    prompts: str = "arithmetic"        # arithmetic (chat_gpt.py's dialogues, made here) or a JSONL of prompts
    conversations: int = 4000          # --prompts=arithmetic: how many dialogues (as chat_gpt.py --prepare makes)
    val_percent: int = 10              # prompts held out for the evals, as chat_gpt.py holds them out
    data_seed: int = 1337              # of the dialogues and the held-out split: chat_gpt.py --prepare's --seed
    answer_regex: str = r"-?\d+(?:\.\d+)?"  # a reply's final answer: its last match; empty: the whole reply
    samples: int = 8                   # answers sampled for each prompt: the group whose mean is the baseline
    max_new_tokens: int = 32           # tokens of an answer at most; it ends earlier at <|end|>
    temperature: float = 1.0           # of the sampled answers (1: the model's own distribution)
    top_k: int = 0                     # sample from the k likeliest tokens; 0 = all
    std_norm: bool = False             # divide each advantage by its group's std (GRPO) as well
    kl: float = 0.0                    # weight of a KL penalty towards the --init_from model; 0 = off
    eval_items: int = 200              # held-out prompts scored at every eval
    pass_k: int = 8                    # answers sampled for pass@k at an eval; 0 = greedy pass@1 only
    score_only: bool = False           # score --init_from on the held-out prompts and exit
    # RL's own defaults: a short run from an SFT checkpoint
    init_from: str = "out/chat"        # the SFT checkpoint (chat_gpt.py's) to start from
    out_dir: str = "out/rl"            # the RL checkpoints and metrics.jsonl
    batch_size: int = 8                # prompts per micro-step per rank (each answered --samples times)
    optimizer: Literal["muon", "adamw"] = "adamw"  # AdamW at a small LR, as SFT: RL nudges the weights
    # peak LR: of 1e-3, 3e-4, 1e-4 and 3e-5 over 160 steps of the CPU demo, only 3e-5 left held-out pass@1 where it was
    # (seed 1337: 12.5% -> 14.0%; 1e-4: 10.0%, 3e-4: 2.5%, 1e-3: answers that never end; three seeds at 3e-5: 12.0%).
    # More SFT for as long reached 23.7%: BENCHMARKS.md, issue 62
    lr: float = 3e-5                   # peak LR; the best of four on the CPU demo (BENCHMARKS.md)
    warmup_steps: int = 0              # linear warmup, in optimizer steps
    time_budget: float = 150.0         # seconds of training (sampling included; evals excluded)
    eval_every: int = 50               # steps between evals; 0 = only the first and the last
    log_every: int = 10                # steps between log lines
    save_every: int = 50               # steps between checkpoints; 0 = only at the end (and on SIGTERM)

PRESETS = ft.PRESETS

def check_config(cfg):
    """finetune_gpt.py's checks, then RL's, each a one-line message that names the fix."""
    ft.check_config(cfg)
    if (cfg.samples < 2
            or cfg.max_new_tokens < 1
            or cfg.eval_items < 1
            or cfg.pass_k < 0):
        tg.die("need --samples >= 2 (a group to compare), --max_new_tokens >= 1, --eval_items >= 1, --pass_k >= 0")
    if (not 0 < cfg.val_percent < 100
            or cfg.conversations < 2
            or cfg.kl < 0):
        tg.die("need 0 < --val_percent < 100, --conversations >= 2 and --kl >= 0")
    try:
        re.compile(cfg.answer_regex)
    except re.error as e:
        # echoed as it was typed, quoted for the shell (a repr would double each backslash: a different regex)
        tg.die(f"--answer_regex={shlex.quote(cfg.answer_regex)} is no regular expression ({e}); fix it, or pass '' "
               f"to compare whole replies")
    # the loop wraps the model in DDP only, and its loss is the policy gradient alone (no teacher, no QAT)
    if cfg.parallel == "fsdp" or cfg.teacher or cfg.qat:
        tg.die("rl_gpt.py trains with DDP, without --teacher or --qat; drop --parallel=fsdp, --teacher, --qat")

# -----------------------------------------------------------------------------
# Prompts and rewards
#
# An item is (prompt, answer): the prompt's tokens end with <|assistant|>, so the model's turn comes next, and the
# answer is the text its final answer must equal. The reward is 1 when it does and 0 otherwise: no partial credit,
# no reward model to fool. The final answer of a reply is the last match of --answer_regex in it (by default the
# last number, so "37 + 48 = 85." answers 85, and text after it without a number changes nothing); with an empty
# regex, the whole reply, stripped of spaces. nanochat's chat_rl.py rewards GSM8K alike: the number after "####".

def final_answer(text, pattern):
    """The final answer of a reply: the last match of pattern in text (None if none), or all of it stripped."""
    if not pattern:
        return text.strip()
    found = [m.group(0) for m in re.finditer(pattern, text)]
    if not found:
        return None
    return found[-1]

def reward(text, answer, pattern):
    """1.0 if the final answer of text is answer (stripped), else 0.0."""
    return float(final_answer(text, pattern) == answer.strip())

def rewards_of(answers, refs, decode, pattern):
    """The reward of each answer (its tokens) against its reference, as a list."""
    return [reward(decode(a), ref, pattern) for a, ref in zip(answers, refs)]

def prompt_ids(messages, tpl, encode):
    """The tokens of a conversation so far, then <|assistant|>: where the model's answer starts."""
    return chat.render(messages, tpl, encode)[0] + [tpl["specials"]["<|assistant|>"]]

def arithmetic_items(cfg, tpl, encode):
    """(train, val) items of chat_gpt.py's arithmetic dialogues, held out as its --prepare holds them out: every
    answer of a train dialogue is a prompt, and the last answer of each val dialogue, as SFT's evals score it."""
    dialogues = chat.arithmetic(cfg.conversations, cfg.data_seed)
    val, train = chat.held_out(len(dialogues), cfg.val_percent, cfg.data_seed)
    out = ([], [])
    for part, indices in zip(out, (train, val)):
        for i in indices:
            msgs = dialogues[i]["messages"]
            turns = [k for k, m in enumerate(msgs) if m["role"] == "assistant"]
            if part is out[1]:  # val: the last answer only
                turns = turns[-1:]
            for k in turns:  # the reference's final answer is the one to give
                ids = prompt_ids(msgs[:k], tpl, encode)
                part.append((ids, final_answer(msgs[k]["content"], cfg.answer_regex)))
    return out

def read_items(path, tpl, encode, room):
    """[(prompt, answer)] of a JSONL of {"messages": [...], "answer": "..."} lines whose last turn is the user's;
    each prompt at most `room` tokens."""
    fix = 'each line needs {"messages": [{"role": ..., "content": ...}, ...], "answer": "..."}'
    with tg.exit_if_unreadable(path, "pass a JSONL file of prompts"), open(path, encoding="utf-8") as f:
        lines = f.read().splitlines()
    out = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            msgs = item["messages"]
            answer = item["answer"]
        except (ValueError, KeyError, TypeError):
            tg.die(f"{path}:{i}: not a prompt; {fix}")
        turns_ok = isinstance(msgs, list) and all(
            isinstance(m, dict)
            and m.get("role") in chat.ROLES
            and isinstance(m.get("content"), str)
            for m in msgs)
        if not turns_ok or not msgs or msgs[-1]["role"] != "user":
            tg.die(f"{path}:{i}: the messages must be turns of {'|'.join(chat.ROLES)} with text content, the last "
                   f"one the user's; fix the line")
        if not isinstance(answer, str) or not answer.strip():
            tg.die(f'{path}:{i}: "answer" must be a non-empty string, the final answer a reply must give')
        ids = prompt_ids(msgs, tpl, encode)
        if len(ids) > room:  # the prompt and its answer must fit in the model's context
            tg.die(f"{path}:{i}: a prompt of {len(ids)} tokens leaves no room for --max_new_tokens within --seq_len; "
                   f"raise --seq_len or shorten the prompt")
        out.append((ids, answer))
    if len(out) < 2:
        tg.die(f"{path}: {len(out)} prompts; need at least 2, some to train on and some held out")
    return out

def load_items(cfg, tpl, encode):
    """(train, val) items of --prompts; val: the first --eval_items held out."""
    room = cfg.seq_len - cfg.max_new_tokens
    if cfg.prompts == "arithmetic":
        train, val = arithmetic_items(cfg, tpl, encode)
    else:
        items = read_items(cfg.prompts, tpl, encode, room)
        val, train = chat.held_out(len(items), cfg.val_percent, cfg.data_seed)
        train = [items[i] for i in train]
        val = [items[i] for i in val]
    longest = max(len(p) for p, _ in train + val)
    if longest > room:
        tg.die(f"--prompts={cfg.prompts}: a prompt of {longest} tokens and --max_new_tokens={cfg.max_new_tokens} "
               f"exceed --seq_len={cfg.seq_len}; raise --seq_len")
    return train, val[:cfg.eval_items]

# -----------------------------------------------------------------------------
# Sampling: groups of answers, batched through the KV cache
#
# train_gpt.py's model takes positions as one offset for the whole batch (the cache's) and its attention has no
# padding mask (kernels.attention is causal only). A prompt padded on the left would attend to its pads, and one
# padded on the right would make its answer's tokens start at the wrong positions. So rows are batched by the
# length of their prompt: the --samples answers of a prompt always share one batch, and prompts of equal length
# join it. No row is padded; each row's positions are its own.
#
# Each row draws from a generator of its own, seeded from (--seed, step, row): a row samples what it would alone
# (tests check it against chat_gpt.reply, one at a time), whatever else shares its batch or its rank. The step's
# draws depend on the step's number only, so a resumed run samples what an uninterrupted one would.

def seeds(*key, n):
    """n seeds of independent streams for key (NumPy's SeedSequence): one a row."""
    return np.random.SeedSequence(list(key)).generate_state(n, np.uint64).tolist()

def pick(logits, temperature, top_k, gens):
    """The next token of each row of logits (B, V): greedy at temperature 0, else sampled with the row's generator
    as train_gpt.py's generate samples (temperature, top-k, then a multinomial draw)."""
    if temperature == 0:
        return logits.argmax(-1)
    logits = logits / temperature
    if top_k:  # only the k likeliest stay
        kth = torch.topk(logits, min(top_k, logits.size(-1))).values[:, -1:]  # (B, 1)
        logits = logits.masked_fill(logits < kth, -float("inf"))
    probs = torch.softmax(logits, -1)
    drawn = []
    for b, g in enumerate(gens):  # row b's draw, from its own generator
        drawn.append(torch.multinomial(probs[b:b + 1], 1, generator=g))
    return torch.cat(drawn).view(-1)  # (B,)

@torch.no_grad()
def decode_rows(model, prompts, end, max_new, temperature, top_k, gens):
    """[answer tokens] of prompts of one length, (B, P): each up to and including `end`, or max_new tokens."""
    device = next(model.parameters()).device
    idx = torch.tensor(prompts, device=device)  # (B, P)
    cache = tg.KVCache(len(model.blocks), idx.size(1) + max_new)
    logits = model(idx, cache=cache)[:, -1]  # (B, V): the first answer token's
    new = []
    ended = torch.zeros(len(prompts), dtype=torch.bool, device=device)
    while True:
        nxt = pick(logits.float(), temperature, top_k, gens)  # (B,)
        new.append(nxt)
        ended |= nxt == end
        if len(new) == max_new or ended.all():  # the host reads `ended` once a token: a small sync on a CPU
            break
        logits = model(nxt[:, None], cache=cache)[:, -1]  # the next token's, through the cache
    rows = torch.stack(new, 1).tolist()  # (B, n)
    for r in rows:
        if end in r:  # what follows <|end|> was sampled while other rows went on: it is no part of the answer
            del r[r.index(end) + 1:]
    return rows

def sample(model, prompts, row_seeds, end, max_new, temperature, top_k):
    """[answer tokens] of each prompt (lists of ids), sampled in batches of equal prompt length; row_seeds: a seed
    a row (None at temperature 0)."""
    device = next(model.parameters()).device
    answers = [None] * len(prompts)
    by_length = {}
    for i, p in enumerate(prompts):
        by_length.setdefault(len(p), []).append(i)
    with torch.compiler.set_stance("force_eager"):  # a compiled model would recompile for every length
        for rows in by_length.values():
            gens = []
            if temperature:
                gens = [torch.Generator(device).manual_seed(row_seeds[i]) for i in rows]
            same = [prompts[i] for i in rows]
            got = decode_rows(model, same, end, max_new, temperature, top_k, gens)
            for i, a in zip(rows, got):
                answers[i] = a
    return answers

# -----------------------------------------------------------------------------
# The loss: the policy gradient on the sampled answers
#
# REINFORCE with a group baseline (Williams 1992; DeepSeekMath's GRPO, Shao et al. 2024): for each prompt, G
# answers are sampled and scored, and answer i's advantage is A_i = r_i - mean(r), the mean over its group. The
# loss is sum over answer tokens of -A_i log p(token), so a step raises the probability of the answers that did
# better than their siblings and lowers the others'; a group whose answers all score alike teaches nothing (A = 0).
# nanochat's chat_rl.py makes the same choices, which this follows:
# - On-policy, one update a batch: the answers come from the weights being updated, so the ratio p / p_old of PPO
#   and GRPO is 1 and its clipping never acts; there is none here. (GRPO and PPO reuse a batch for several updates,
#   which is what makes the ratio and its clip necessary.)
# - No KL term by default (--kl adds one, towards the --init_from model, with GRPO's k3 estimator): nanochat drops
#   it, and so does DAPO (Yu et al. 2025), since the policy is meant to move away from the SFT model.
# - No division by the group's std by default (--std_norm adds it, as GRPO does): Dr. GRPO (Liu et al. 2025) finds
#   it weighs the groups that are almost all right or all wrong most, and nanochat leaves it out.
# - Token-level normalisation (DAPO): the sum over all answer tokens of the step (all micro-steps, all ranks) over
#   their count, as SFT's loss is: a long answer's tokens weigh as much as a short one's, and the gradient does
#   not change with how the rows fall into micro-steps and ranks.

def advantages(rewards, group, std_norm):
    """A = r - mean(r) over each consecutive group of `group` rewards (and / std, with std_norm), (N,)."""
    r = torch.tensor(rewards, dtype=torch.float32).view(-1, group)  # (prompts, G)
    a = r - r.mean(1, keepdim=True)
    if std_norm:  # a group that scored alike has std 0 and A = 0: the epsilon only avoids 0 / 0
        a = a / (r.std(1, keepdim=True) + 1e-4)
    return a.view(-1)

def rows_of(prompts, answers, adv, device):
    """(x, y, adv) of prompt + answer rows, right-padded: y is each answer token (-100 elsewhere: the prompt, pads)."""
    # right padding is exact here: attention is causal, so no real token sees the pads that come after it
    B = len(prompts)
    L = max(len(p) + len(a) for p, a in zip(prompts, answers))
    x = torch.zeros(B, L, dtype=torch.long)  # (B, L)
    y = torch.full((B, L), -100)
    for b, (p, a) in enumerate(zip(prompts, answers)):
        n = len(p) + len(a)
        x[b, :n] = torch.tensor(p + a)
        y[b, len(p):n] = x[b, len(p):n]
    # the target of position t is the token at t + 1: an answer token is predicted from everything before it
    x = x[:, :-1].to(device)
    y = y[:, 1:].to(device)
    return x, y, adv.to(device)

def backward(model, batches, ctx, scaler, world_size, kl=0.0, ref=None):
    """One optimizer step's micro-steps: sum over answer tokens of A * -log p (+ kl * k3(ref)) over the count of
    answer tokens in all micro-steps on all ranks. Returns the step's loss on this rank."""
    count = sum((y != -100).sum() for _, y, _ in batches).float()
    if world_size > 1:  # before any backward: every micro-step divides by the step's total
        dist.all_reduce(count)
    norm = world_size / count.clamp(min=1)  # DDP averages the ranks' grads: x world_size makes that a sum
    loss_sum = torch.zeros((), device=count.device)
    for micro, (x, y, adv) in enumerate(batches):
        with tg.grad_sync(model, micro == len(batches) - 1):  # DDP all-reduces on the last micro-step only
            with ctx:
                nll = model(x, y, reduction="none").view(y.shape)  # (B, T): -log p of each answer token, else 0
                loss = (nll.float() * adv[:, None]).sum()
                if kl:  # k3 = p_ref / p - log(p_ref / p) - 1 >= 0, an unbiased KL(p || p_ref) (GRPO, Schulman 2020)
                    with torch.no_grad():
                        ref_nll = ref(x, y, reduction="none").view(y.shape).float()
                    d = nll.float() - ref_nll  # log(p_ref / p); 0 where there is no target
                    loss = loss + kl * (d.exp() - d - 1).sum()
                loss = loss * norm
            scaler.scale(loss).backward()
        loss_sum += loss.detach().float()
    return loss_sum

# -----------------------------------------------------------------------------
# Evaluation: pass@1 and pass@k on held-out prompts
#
# pass@1 is the greedy answer's reward: the model's best guess, the same on every run. pass@k samples k answers at
# --temperature and counts a prompt solved if any is right (Chen et al. 2021; with n = k samples the estimate is the
# share solved). RL tends to raise pass@1 by moving probability onto answers the model could already find, so
# pass@k says whether it also finds new ones. The eval's draws are seeded by item, not by step: every eval of a run,
# and every run with that seed, samples with the same noise.

def evaluate(cfg, model, items, end, decode, rank, world_size):
    """{pass1, passk, eval_len}: shares of the held-out items solved greedily, and by any of --pass_k samples; the
    greedy answers' mean length. Ranks share the items."""
    mine = list(range(rank, len(items), world_size))
    prompts = [items[i][0] for i in mine]
    refs = [items[i][1] for i in mine]
    greedy = sample(model, prompts, None, end, cfg.max_new_tokens, 0.0, 0)
    right = rewards_of(greedy, refs, decode, cfg.answer_regex)
    # greedy right, any of k right, greedy answer tokens, items
    sums = torch.tensor([sum(right), 0, sum(map(len, greedy)), len(mine)], dtype=torch.float64)
    k = cfg.pass_k
    if k:  # k rows a prompt, side by side
        row_seeds = []
        for i in mine:
            row_seeds += seeds(cfg.seed, 0, i, n=k)
        many = [p for p in prompts for _ in range(k)]
        got = sample(model, many, row_seeds, end, cfg.max_new_tokens, cfg.temperature, cfg.top_k)
        right = rewards_of(got, [r for r in refs for _ in range(k)], decode, cfg.answer_regex)
        sums[1] = torch.tensor(right).view(-1, k).amax(1).sum()
    if world_size > 1:
        dist.all_reduce(sums)
    pass1, passk, length = (sums[:3] / sums[3].clamp(min=1)).tolist()
    rec = {"pass1": pass1, "eval_len": length}
    if k:
        rec[f"pass{k}"] = passk
    return rec

def eval_line(step, rec, n):
    """The eval's log line."""
    parts = [f"{k.replace('pass', 'pass@')} {v:.1%}" for k, v in rec.items() if k.startswith("pass")]
    return f"eval {step:05d} | {n} held-out prompts | " + " | ".join(parts) + f" | answer {rec['eval_len']:.1f} tokens"

# -----------------------------------------------------------------------------
# Training loop
#
# chat_gpt.py's loop, with two changes: a step's rows are sampled by the model itself, and the run can be stopped
# and resumed (an RL run is slower per step than SFT's, and a preemption should not lose it). The state is train()'s
# locals; a checkpoint is a dict of them, as train_gpt.py writes it, and chat_gpt.py --chat reads it.

def step_prompts(train, step, n, seed):
    """The indices of step's n prompts: passes over the train items, each in a fresh order from (seed, pass)."""
    out = []
    for s in range(step * n, (step + 1) * n):  # the s-th prompt of the run
        n_train = len(train)
        order = random.Random(seed + s // n_train).sample(range(n_train), n_train)  # its pass's order
        out.append(order[s % n_train])
    return out

def start(cfg, rank, world_size):
    """(cfg in --init_from's shape, its tokenizer, init, the checkpoint to resume or None) after the checks."""
    arch, init = ft.load_init(cfg, rank, world_size)
    tok = init["tokenizer"]
    if not tok.get("chat"):
        tg.die(f"--init_from={cfg.init_from} is no chat model (no template in its tokenizer); fine-tune it first: "
               f"python chat_gpt.py --init_from={cfg.init_from} --out_dir=out/chat")
    cfg = dataclasses.replace(cfg, **arch)
    info = {"vocab_size": init["vocab_size"], "samples": cfg.samples, "prompts": cfg.prompts}
    ckpt = None
    if not cfg.score_only:
        ft.check_writable("--out_dir", cfg.out_dir)  # now, not at the first save
        layout = tg.run_layout(dataclasses.asdict(cfg), world_size, info)  # what a resume must share
        # the budget as train() reads it, so that a run which is done already stops here, as the trainers' do
        time_budget = 0.0 if cfg.max_steps else cfg.time_budget
        ckpt = tg.resume_point(cfg.out_dir, cfg.resume, layout, rank == 0, cfg.max_steps, time_budget)[0]
    return cfg, tok, init, info, ckpt

def save(out_dir, ckpt, keep_last):
    """Write the checkpoint (train_gpt.py's atomic write) and the history so far as metrics.jsonl, a line a record,
    atomically too: written whole beside it, then renamed, so a crash mid-write leaves the last log as it was."""
    tg.write_checkpoint(out_dir, ckpt, keep_last)
    path = os.path.join(out_dir, "metrics.jsonl")
    try:
        with open(path + ".tmp", "w") as f:
            f.writelines(json.dumps(h) + "\n" for h in ckpt["history"])
        os.replace(path + ".tmp", path)
    finally:  # a write that failed leaves no half of a log beside the whole one
        if os.path.exists(path + ".tmp"):
            os.remove(path + ".tmp")

def train(cfg, stop):
    """Set up, resume or score the model before RL, then the loop: sample, score, backward, clip, step, log, eval,
    save."""
    rank, world_size, device = tg.setup_dist(cfg.device)
    if rank:  # one rank prints: the others' lines would repeat its own
        sys.stdout = open(os.devnull, "w")
    cfg, tok, init, info, ckpt = start(cfg, rank, world_size)
    dtype, ctx, scaler = tg.setup_precision(device, cfg.dtype, ckpt)
    cfg = dataclasses.replace(cfg, dtype=str(dtype).removeprefix("torch."))
    tpl = tok["chat"]
    encode, decode = tg.load_tokenizer(tok)
    end = tpl["specials"]["<|end|>"]
    items, val = load_items(cfg, tpl, encode)
    raw = chat.build(cfg, init, tpl, device)
    ref = None
    if cfg.kl:  # the --init_from model, frozen: what the KL penalty holds the policy near
        ref = copy.deepcopy(raw).requires_grad_(False).eval()
    tg.kernels.use(cfg.kernels)  # Triton's or PyTorch's ops, chosen before compile traces the model
    tg.kernels.use_attention(cfg.attention)  # flex: a window skips the tiles it masks
    model, compiled = tg.wrap_model(raw, cfg, device, dtype, world_size)
    opts = tg.build_optimizers(cfg, raw, dtype)
    B = cfg.batch_size
    G = cfg.samples
    accum = cfg.grad_accum
    n_prompts = B * accum * world_size  # prompts a step, each answered G times
    # a budget in steps or in seconds of training (sampling is training here): --max_steps, when set, wins
    max_steps = cfg.max_steps
    time_budget = 0.0 if cfg.max_steps else cfg.time_budget
    budget = f"{time_budget:.0f} s" if time_budget else f"{max_steps} steps"
    print(f"{len(items)} train prompts, {len(val)} held out | prompts a step: B {B} x accum {accum} x world "
          f"{world_size}, {G} answers each | {budget} | {device} {dtype} | compile {compiled}")

    # the loop's state is plain names; a resume sets them from the checkpoint, else the first eval opens the history
    step = 0
    train_time = 0.0
    history = []
    if ckpt:
        with tg.exit_if_unreadable(cfg.out_dir, "it is not a checkpoint of this run; pass a new --out_dir"):
            raw.load_state_dict(ckpt["model"])
            for opt, state in zip(opts, ckpt["optim"]):
                opt.load_state_dict(state)
            scaler.load_state_dict(ckpt["scaler"])
            step = int(ckpt["step"])
            train_time = float(ckpt["train_time"])
            history = list(ckpt["history"])
        print(f"--resume: from step {step} of {cfg.out_dir}")
    else:  # the SFT model's scores: RL's are read against these
        rec = evaluate(cfg, raw, val, end, decode, rank, world_size)
        history.append(dict(step=0, **rec))
        print(eval_line(0, history[-1], len(val)))
    if cfg.score_only:
        if dist.is_initialized():
            dist.destroy_process_group()
        return history[-1]
    stopped = False
    last_step = (max_steps and step >= max_steps) or (time_budget and train_time >= time_budget)
    t0 = time.perf_counter()
    while not last_step:
        mult = chat.set_lr(cfg, opts, step, train_time, time_budget, max_steps)
        # the step's prompts and a seed for each of its rows; micro-step m of rank r takes the B prompts from
        # (m * world + r) * B, as chat_gpt.py's rows, and their answers stay together: a group is never split
        picked = step_prompts(items, step, n_prompts, cfg.seed)
        row_seeds = seeds(cfg.seed, 1 + step, n=n_prompts * G)
        batches = []
        rewards = []
        lengths = []
        alike = []  # per group: did its answers all score alike (every A = 0)?
        for m in range(accum):
            first = (m * world_size + rank) * B
            mine = [i for i in picked[first:first + B] for _ in range(G)]  # each prompt G times, side by side
            prompts = [items[i][0] for i in mine]
            with ctx:
                answers = sample(raw, prompts, row_seeds[first * G:], end, cfg.max_new_tokens,
                                 cfg.temperature, cfg.top_k)
            r = rewards_of(answers, [items[i][1] for i in mine], decode, cfg.answer_regex)
            adv = advantages(r, G, cfg.std_norm)
            alike += (adv.view(-1, G) == 0).all(1).tolist()
            batches.append(rows_of(prompts, answers, adv, device))
            rewards += r
            lengths += [len(a) for a in answers]
        # A group whose answers all scored alike has A = 0 and adds nothing to the gradient. When every group of
        # the step (on every rank) is so, the gradient is exactly 0, yet AdamW would still move the weights along
        # its momentum and decay them: a step with nothing to learn from would change the model. So it is skipped,
        # unless --kl pulls the weights back toward the reference, which needs no reward to differ
        no_signal = tg.all_mean(torch.tensor(float(np.mean(alike))), world_size).item()  # the share of such groups
        loss = torch.zeros(())
        gnorm = torch.zeros(())
        if no_signal < 1 or cfg.kl:
            for opt in opts:
                opt.zero_grad(set_to_none=True)
            loss = backward(model, batches, ctx, scaler, world_size, cfg.kl, ref)
            for opt in opts:
                scaler.unscale_(opt)  # fp16's loss scale off the grads, before they are clipped
            gnorm = nn.utils.clip_grad_norm_(raw.parameters(), cfg.grad_clip or float("inf"))
            for opt in opts:
                scaler.step(opt)
            scaler.update()
        step += 1
        now = time.perf_counter()
        local = torch.tensor([
            loss.item(),
            gnorm.item(),
            np.mean(rewards),
            np.mean(lengths),
            train_time + now - t0,
        ])
        # the step's one sync: the ranks agree on the loss, grad norm, reward, answer length and time
        loss, gnorm, mean_reward, answer_len, train_time = tg.all_mean(local, world_size).tolist()
        stopped = stop.requested(world_size)  # a SIGTERM to any rank: every rank saves after this step
        if time_budget:
            last_step = train_time >= time_budget or stopped
        else:
            last_step = step >= max_steps or stopped
        history.append(dict(
            step=step,
            loss=loss,
            reward=mean_reward,  # of this step's sampled answers
            answer_len=answer_len,  # their mean length, in tokens
            no_signal=no_signal,  # the share of groups whose answers all scored alike; 1: the step was skipped
            lr=cfg.lr * mult,
            gnorm=gnorm,
            train_time=train_time,
        ))
        if step % cfg.log_every == 0 or last_step:
            print(" | ".join(f"{k} {v:.4g}" for k, v in history[-1].items()))
        # stop the clock: evals and saves are not training time
        if (last_step and not stopped) or (cfg.eval_every and step % cfg.eval_every == 0):
            rec = evaluate(cfg, raw, val, end, decode, rank, world_size)
            history.append(dict(step=step, **rec))
            print(eval_line(step, history[-1], len(val)))
        if rank == 0 and (last_step or (cfg.save_every and step % cfg.save_every == 0)):
            # a checkpoint as chat_gpt.py writes one (so --chat and --init_from read it), with what a resume needs
            save(cfg.out_dir, {
                "model": raw.state_dict(),
                "optim": [opt.state_dict() for opt in opts],
                "scaler": scaler.state_dict(),
                "step": step,
                "train_time": train_time,
                "history": history,
                "config": dataclasses.asdict(cfg),
                "data_info": info,
                "tokenizer": tok,
                "world_size": world_size,
            }, cfg.keep_last)
        t0 = time.perf_counter()  # start the clock

    if dist.is_initialized():
        dist.destroy_process_group()
    if stopped:  # the checkpoint is saved: exit 0, and --resume goes on
        print(stop.preempted(step, cfg.out_dir))
        return {"preempted": True, "steps": step, "train_time": train_time}
    first = history[0]
    final = history[-1]
    print(f"done: {step} steps in {train_time:.0f} s | pass@1 {first['pass1']:.1%} -> {final['pass1']:.1%} | "
          f"checkpoint in {cfg.out_dir} | python chat_gpt.py --chat --ckpt={cfg.out_dir}")
    result = {"steps": step, "train_time": train_time, **final}
    for k, v in first.items():
        result[f"{k}_before"] = v
    return result

def main(cfg):
    """Score (--score_only) or train per cfg; returns a dict of final metrics."""
    check_config(cfg)
    with tg.StopSignal() as stop:  # SIGTERM or SIGINT: finish the step, save, exit 0
        return train(cfg, stop)

# -----------------------------------------------------------------------------
# Entry point

if __name__ == "__main__":
    main(tg.parse_args(Config, sys.argv[1:]))
