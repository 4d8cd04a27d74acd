"""
eval_gpt.py: scores a trained GPT as the field scores one. Two tasks:

--task=hellaswag (the default): multiple-choice accuracy on HellaSwag (Zellers et al. 2019),
or on any JSONL of items in its format: {"ctx": text, "endings": [text, ...], "label": k}.

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

--task=core: CORE, the centred mean accuracy over the 22 tasks of the DCLM paper (Li et al.
2024, arXiv 2406.11794), the number nanochat's leaderboard is measured in. GPT-2 XL scores
0.256525 there: nanochat's published figure, which its "time to GPT-2" must beat.

  python prepare_data.py core                                       # the DCLM eval bundle
  python eval_gpt.py --task=core --ckpt=out/gpt2_124m
  python eval_gpt.py --task=core --ckpt=gpt2-xl                     # GPT-2 XL (a 6 GB download)
  python eval_gpt.py --task=core --ckpt=out/gpt2_124m --every_checkpoint --core_items=500
  torchrun --nproc_per_node=8 eval_gpt.py --task=core --ckpt=out/gpt2_124m

Scoring is a job on a finished checkpoint, so it lives here, beside train_gpt.py, as nanochat
keeps base_eval.py beside base_train.py. To follow the accuracy over a run, keep its
checkpoints (train_gpt.py --milestone_every=N) and score them all with --every_checkpoint.
"""
import csv
import json
import math
import os
import random
import sys
import time
from dataclasses import dataclass
from typing import Literal

import torch
import torch.distributed as dist
import torch.nn.functional as F

import finetune_gpt as ft
import train_gpt as tg


@dataclass
class Config:
    task: Literal["hellaswag", "core"] = "hellaswag"  # multiple choice on --items, or DCLM's 22 tasks (CORE)
    ckpt: str = "out/gpt"  # a run's folder (its newest checkpoint), a ckpt_*.pt, gpt2[-medium|-xl...], a HF folder
    items: str = ""  # hellaswag: a JSONL or a folder of one (default data/hellaswag); core: the bundle (data/core)
    core_items: int = 0  # core: items a task at most, drawn with a fixed seed (a quicker, noisier CORE); 0 = all
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


# -----------------------------------------------------------------------------
# CORE (Li et al. 2024): DCLM's 22 tasks, as nanochat scores them
#
# The bundle (prepare_data.py core) is llm-foundry's layout: core.yaml lists each task's
# label, file, kind, few-shot count and continuation delimiter; eval_data/ holds a JSONL
# per task; eval_meta_data.csv gives each task's random baseline, in percent. A task is of
# one of three kinds, each with its own rule for a right answer:
#   multiple_choice: one context, several continuations; right when the gold one has the
#     least mean loss over its tokens;
#   schema: several contexts, one continuation (Winograd: which noun does "it" mean?);
#     right when the gold context gives the continuation the least mean loss;
#   language_modeling: one context, one continuation; right when greedy decoding gives
#     the continuation exactly: the argmax at every one of its tokens is that token.
# A task's accuracy is centred on its baseline, (acc - baseline) / (1 - baseline): 0 is
# chance and 1 is perfect, so a 2-choice task and a free-answer one weigh alike. CORE is the
# mean of the 22 centred accuracies.
#
# Prompts, few-shot examples and tokens follow nanochat's core_eval.py (itself written to
# match llm-foundry), so that a score here sits on the scale of nanochat's published ones.

GPT2_XL_CORE = 0.256525  # GPT-2 XL (1.5B), nanochat's published figure; not measured here
CORE_SHOTS_SEED = 1234  # nanochat's: item i's few-shot examples are drawn with seed 1234 + i
CORE_ORDER_SEED = 1337  # nanochat's: each task's items are shuffled once with this seed first
# what a line of each kind holds (the bundle's own field names)
CORE_FIELDS = {
    "multiple_choice": '{"query": text, "choices": [text, ...], "gold": index}',
    "schema": '{"context_options": [text, ...], "continuation": text, "gold": index}',
    "language_modeling": '{"context": text, "continuation": text}',
}


def core_item_ok(kind, d):
    """Whether d is a well-formed line of a task of this kind."""
    def texts(v):
        return isinstance(v, list) and len(v) > 0 and all(isinstance(t, str) for t in v)

    def index_of(v):
        return isinstance(d.get("gold"), int) and 0 <= d["gold"] < len(v)

    if kind == "multiple_choice":
        return isinstance(d.get("query"), str) and texts(d.get("choices")) and index_of(d["choices"])
    if kind == "schema":
        options = d.get("context_options")
        return isinstance(d.get("continuation"), str) and texts(options) and index_of(options)
    return isinstance(d.get("context"), str) and isinstance(d.get("continuation"), str)


def read_baselines(path):
    """{task label: random baseline, a fraction} of the bundle's eval_meta_data.csv (given there in percent)."""
    baselines = {}
    with tg.exit_if_unreadable(path, "python prepare_data.py core writes it"), open(path, encoding="utf-8") as f:
        for row in csv.DictReader(f):
            baselines[row["Eval Task"]] = float(row["Random baseline"]) / 100
    return baselines


def read_core_items(path, kind):
    """The items of one task's JSONL, each checked against its kind's fields."""
    items = []
    with tg.exit_if_unreadable(path, "python prepare_data.py core writes it anew"), open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            try:
                d = json.loads(line)
                ok = isinstance(d, dict) and core_item_ok(kind, d)
            except ValueError:
                ok = False
            if not ok:
                tg.die(f"{path}:{i}: not a {kind} item; each line needs {CORE_FIELDS[kind]}")
            items.append(d)
    if len(items) < 2:  # a few-shot example is another item of the task
        tg.die(f"{path}: {len(items)} items; a task needs at least 2")
    return items


def read_core(folder, limit=0):
    """[{label, kind, shots, delimiter, baseline, items}] of the DCLM bundle in folder, each
    task's items in nanochat's order; limit: the first limit of them (0: all)."""
    import yaml  # PyYAML: core.yaml is the bundle's own file
    config = os.path.join(folder, "core.yaml")
    if not os.path.isfile(config):
        tg.die(f"--items={folder}: no core.yaml there; python prepare_data.py core writes data/core")
    fix = "python prepare_data.py core writes the bundle anew"
    with tg.exit_if_unreadable(config, fix), open(config, encoding="utf-8") as f:
        listed = yaml.safe_load(f)["icl_tasks"]
    baselines = read_baselines(os.path.join(folder, "eval_meta_data.csv"))
    tasks = []
    for t in listed:
        with tg.exit_if_unreadable(config, fix):
            label, kind, uri = t["label"], t["icl_task_type"], t["dataset_uri"]
            shots = int(t["num_fewshot"][0])  # a list in llm-foundry's format; CORE uses one count a task
            delimiter = t.get("continuation_delimiter", " ")  # llm-foundry's default: a space
        if kind not in CORE_FIELDS:
            tg.die(f"{config}: task {label} is of kind {kind}; CORE's kinds are {', '.join(CORE_FIELDS)}")
        if not 0 <= baselines.get(label, -1) < 1:
            tg.die(f"{folder}/eval_meta_data.csv: no random baseline (0 to 100) for task {label}; {fix}")
        items = read_core_items(os.path.join(folder, "eval_data", uri), kind)
        # nanochat shuffles each task once with a fixed seed, so a limit takes a fair sample
        # and each item gets the few-shot examples that nanochat's run gave it
        random.Random(CORE_ORDER_SEED).shuffle(items)
        if limit:
            items = items[:limit]
        tasks.append(dict(
            label=label,
            kind=kind,
            shots=shots,
            delimiter=delimiter,
            baseline=baselines[label],
            items=items,
        ))
    if not tasks:
        tg.die(f"{config}: no tasks in its icl_tasks; {fix}")
    return tasks


def few_shot(n_items, i, shots):
    """Indices of the `shots` examples shown before item i: drawn from the task's other items
    with a seed of i's own, so every run, and every rank, shows item i the same examples."""
    if shots == 0:
        return []
    rng = random.Random(CORE_SHOTS_SEED + i)
    # nanochat samples from the list of every index but i. random.sample picks positions in
    # its population, whatever the values, so positions in range(n - 1), with those from i
    # on moved up by one, are the same draw, without a list of n items for each item
    picks = rng.sample(range(n_items - 1), min(shots, n_items - 1))
    return [j + (j >= i) for j in picks]


def core_prompts(kind, item, shots, delimiter):
    """The texts that an item is scored on, its few-shot examples (solved) first, each
    followed by a blank line: one text per choice (multiple_choice), per context option
    (schema), or the context alone and then with its continuation (language_modeling)."""
    shown = ""
    if kind == "multiple_choice":
        for s in shots:
            shown += s["query"] + delimiter + s["choices"][s["gold"]] + "\n\n"
        return [shown + item["query"] + delimiter + c for c in item["choices"]]
    if kind == "schema":
        for s in shots:
            shown += s["context_options"][s["gold"]] + delimiter + s["continuation"] + "\n\n"
        return [shown + c + delimiter + item["continuation"] for c in item["context_options"]]
    # language_modeling: contexts are stripped (some carry stray whitespace), and so is the
    # prompt without its continuation, so that its tokens are a prefix of the full prompt's
    for s in shots:
        shown += s["context"].strip() + delimiter + s["continuation"] + "\n\n"
    prompt = shown + item["context"].strip() + delimiter
    return [prompt.strip(), prompt + item["continuation"]]


def shared_prefix(seqs):
    """How many leading tokens every sequence of seqs has in common."""
    n = 0
    while n < min(map(len, seqs)) and len({s[n] for s in seqs}) == 1:
        n += 1
    return n


def core_rows(kind, prompts, encode, bos, seq_len):
    """[(ids, start)] to score: each prompt's tokens after the start token bos, the
    continuation being ids[start:]. What the continuation is, is found in tokens, not text:
    the tokens after those all prompts share (multiple choice; language modelling, where
    only the full prompt is scored), or the tokens all prompts end with (schema)."""
    seqs = [[bos] + encode(p) for p in prompts]
    if kind == "schema":
        shared = shared_prefix([s[::-1] for s in seqs])
        starts = [len(s) - shared for s in seqs]
    else:
        starts = [shared_prefix(seqs)] * len(seqs)
    if kind == "language_modeling":
        seqs, starts = seqs[1:], starts[1:]
    rows = []
    for ids, start in zip(seqs, starts):
        # a continuation has at least one token, and at least one token before it
        start = min(max(start, 1), len(ids) - 1)
        # the model takes seq_len inputs, so the last seq_len + 1 tokens: a long prompt
        # loses the start of its few-shot examples, never its continuation's end
        cut = max(len(ids) - seq_len - 1, 0)
        rows.append((ids[cut:], max(start - cut, 1)))
    return rows


def continuation_scores(model, rows, ctx, device):
    """([mean loss], [greedy]) of each row's continuation: the mean loss of its tokens, and
    whether the argmax at each of its positions is its token. rows: [(ids, start)]."""
    T = max(len(ids) for ids, _ in rows) - 1
    x = torch.zeros(len(rows), T, dtype=torch.long)  # (rows, T): inputs, right-padded
    y = torch.full((len(rows), T), -100)  # (rows, T): the continuations' tokens; -100 elsewhere
    for i, (ids, start) in enumerate(rows):
        n = len(ids) - 1  # position t predicts token t + 1
        x[i, :n] = torch.tensor(ids[:-1])
        y[i, start - 1:n] = torch.tensor(ids[start:])
    y = y.to(device)
    keep = y != -100  # (rows, T)
    with ctx:
        h, w = model.hidden(x.to(device))  # (rows, T, n_embd)
        # the head runs only where a continuation's token is predicted: a few positions of
        # prompts of up to seq_len tokens, instead of (rows, T, vocab) logits
        logits = model.logits(h[keep], w)  # (targets, vocab), fp32
    targets = y[keep]
    loss = F.cross_entropy(logits, targets, reduction="none")  # (targets,)
    hit = logits.argmax(-1) == targets  # (targets,)
    per_row = keep.sum(1).tolist()  # targets a row
    means = torch.stack([part.mean() for part in loss.split(per_row)])
    greedy = torch.stack([part.all() for part in hit.split(per_row)])
    return means.tolist(), greedy.tolist()


def core_right(kind, item, means, greedy):
    """Whether an item's answer is right, by its kind's rule, from its rows' scores."""
    if kind == "language_modeling":
        return greedy[0]
    # the least mean loss picks the answer; a tie goes to the first, as in nanochat
    best = means.index(min(means))
    return best == item["gold"]


def score_core(model, tasks, encode, bos, ctx, seq_len, rank, world_size, device, what):
    """{core, core_tasks: {label: {acc, centred, items}}}: each task scored item by item,
    each rank taking every world_size-th item; prints a line a task, then CORE."""
    print(what)
    model.eval()
    centred, per_task = [], {}
    for task in tasks:
        kind, items = task["kind"], task["items"]
        right = torch.zeros(1, device=device)
        with torch.no_grad():
            for i in range(rank, len(items), world_size):
                shots = [items[j] for j in few_shot(len(items), i, task["shots"])]
                prompts = core_prompts(kind, items[i], shots, task["delimiter"])
                rows = core_rows(kind, prompts, encode, bos, seq_len)
                means, greedy = continuation_scores(model, rows, ctx, device)
                right += core_right(kind, items[i], means, greedy)
        # the model is whole on every rank, so the ranks need not run in step; this sum of
        # their counts is the one sync a task
        if world_size > 1:
            dist.all_reduce(right)
        acc = right.item() / len(items)
        base = task["baseline"]
        centred.append((acc - base) / (1 - base))
        per_task[task["label"]] = {"acc": acc, "centred": centred[-1], "items": len(items)}
        print(f"{task['label']:<34} {kind:<17} {task['shots']:>2}-shot | acc {acc:.4f} | "
              f"centred {centred[-1]:+.4f} | {len(items)} items")
    core = sum(centred) / len(centred)
    print(f"CORE {core:.4f} over {len(tasks)} tasks | GPT-2 XL: {GPT2_XL_CORE} (nanochat's published figure)")
    return {"core": core, "core_tasks": per_task}


def main(cfg):
    """Score cfg.task with cfg.ckpt (or each checkpoint of its folder); returns the (last)
    record: {mc_acc, mc_acc_norm, mc_items} for hellaswag, {core, core_tasks} for core."""
    if cfg.batch_items < 0:
        tg.die(f"--batch_items must be at least 0, got {cfg.batch_items}")
    if cfg.core_items < 0:
        tg.die(f"--core_items must be at least 0 (0: all), got {cfg.core_items}")
    items_at = cfg.items or f"data/{cfg.task}"
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
        encode, eot = mc_encoder(tokenizer), tokenizer.get("eot_id")
        what = f"# {path} (step {step}) | {items_at}"
        seq_len = model.cfg.seq_len
        t0 = time.perf_counter()
        if cfg.task == "core":
            # CORE starts every prompt at a start token, as nanochat does with its BOS; a
            # GPT-2 tokenizer's is its end-of-text token, which starts each of our documents too
            if eot is None:
                tg.die("--task=core starts each prompt at the end-of-text token, which this tokenizer lacks")
            if items is None:
                items = read_core(items_at, cfg.core_items)
            rec = score_core(model, items, encode, eot, ctx, seq_len, rank, world_size, device, what)
            n = sum(t["items"] for t in rec["core_tasks"].values())
        else:
            if items is None:
                items = read_choices(items_at, encode, eot)
            rec = score_choices(model, items, ctx, seq_len, rank, world_size, device, what, cfg.batch_items)
            n = rec["mc_items"]
        print(f"{n} items in {time.perf_counter() - t0:.1f} s")
    if dist.is_initialized():
        dist.destroy_process_group()
    return rec


if __name__ == "__main__":
    main(tg.parse_args(Config, sys.argv[1:]))
