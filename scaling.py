"""
Scaling laws for train_gpt.py: sweep small runs, fit L(N, D), plan a compute-optimal run, check muP, read runs.

  python scaling.py sweep                       # IsoFLOP profiles: 5 model sizes at each of 3e11, 1e12, 3e12 FLOPs
  python scaling.py fit                         # L(N, D) = E + A/N^alpha + B/D^beta, intervals, plots
  python scaling.py plan --flops=1e14           # compute-optimal N, D, loss and batch size for a budget
  python scaling.py coord_check                 # muP: activation size against width, flat under muP (a plot)
  python scaling.py lr_transfer                 # loss against LR at several widths, standard vs muP (a plot)
  python scaling.py compare out/a out/b --metric=val_loss   # any runs' metrics against step, one plot
  python scaling.py sharpness --ckpt=out/gpt --batches=4  # top Hessian eigenvalue of the loss at a checkpoint
  python scaling.py sweep --flops=1e12,1e13 --sizes=7 --optimizer=adamw  # any train_gpt.py flag passes through

A scaling law predicts the loss of a model of N parameters trained on D tokens before anyone pays for that run. It
is fitted to many small runs and then read at a budget too large to sweep. The questions it answers: at a compute
budget C, how big should the model be, how many tokens should it see, and what loss will it reach?

`sweep` runs train_gpt.py in this process, once per (N, D), each in its own out_dir, and appends a row to a TSV as
each run ends; run the same command again and it goes on where it stopped. N counts the parameters that do a matmul
per token (all but the input embedding, whose lookup costs nothing), D the training tokens, and C = 6 N D: a matmul
costs 2 FLOPs per parameter per token forward and 4 backward (Kaplan et al. 2020).

`fit` follows Hoffmann et al. 2022 ("Chinchilla"). Their Approach 1 trains each size for several lengths and keeps
the lowest loss reached at each compute; Approach 2 trains several sizes at each fixed C (an IsoFLOP profile) and
takes each profile's minimum; Approach 3 fits one formula to every run. Here Approach 3 is the answer: L-BFGS on a
Huber loss (delta 1e-3) of log-space residuals from every start of a grid, keeping the best, with bootstrap
intervals over runs; Approach 2 (a parabola through each IsoFLOP profile) is its cross-check. `plan` uses the closed
form of the fitted law's optimum.

What makes a sweep worth fitting: three or more budgets, five or more sizes at each, so that every profile has its
minimum inside it (fit warns where one does not); runs of enough steps that size and data, not optimisation, limit
their loss (--min_steps); and one LR that suits every size. With --mup that last one holds by construction, and
`coord_check` and `lr_transfer` show that it does. The law is only as good as the range it was fitted on: `plan`
refuses to read it more than 2x past the largest run unless told to.
"""
import argparse
import contextlib
import dataclasses
import itertools
import json
import math
import os
import sys
import time

import numpy as np
import torch

import finetune_gpt as ft
import train_gpt as tg

# Published fits of L(N, D) = E + A / N^alpha + B / D^beta, in nats per token. E is the loss of a perfect model (the
# entropy of text); the two other terms are what a finite model and a finite dataset add to it.
CHINCHILLA = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. 2022, Approach 3
BESIROGLU = dict(E=1.82, A=482.0, B=2085.4, alpha=0.348, beta=0.366)  # the refit of Besiroglu et al. 2024
# Besiroglu et al. refit Hoffmann et al.'s runs, read back from the paper's figure, and found the published Approach 3
# numbers at odds with Approaches 1 and 2 and their intervals far too narrow; their refit agrees with the other two.
# Either is a prior to compare a fit with, not a law for this suite's data (another tokenizer, another model).
PUBLISHED = {"chinchilla": CHINCHILLA, "besiroglu": BESIROGLU}
# Hoffmann et al.'s grid of initial values (4,500 starts). The fit is not convex: from one start L-BFGS can stop in a
# local optimum, so every start is tried and the best end kept. e, a, b are the logs of E, A, B, so that L-BFGS
# searches over numbers of one scale and E, A, B stay positive.
PARAM_GRID = dict(
    e=[-1, -0.5, 0, 0.5, 1],
    a=[0, 5, 10, 15, 20, 25],
    b=[0, 5, 10, 15, 20, 25],
    alpha=[0, 0.5, 1, 1.5, 2],
    beta=[0, 0.5, 1, 1.5, 2],
)
NAMES = ("e", "a", "b", "alpha", "beta")  # the fitted vector: E = exp(e), A = exp(a), B = exp(b)
# The model shapes of a sweep, (n_layer, n_embd), growing in depth and width together like a family of real models:
# a law fitted to width alone, at one depth, would be a law of that depth.
LADDER = [
    (1, 16), (1, 24), (1, 32),
    (2, 32), (2, 48), (2, 64),
    (3, 64), (3, 96),
    (4, 96), (4, 128), (4, 160),
    (5, 192),
    (6, 192), (6, 256),
    (8, 256), (8, 320), (8, 384),
    (10, 448),
    (12, 512), (12, 640), (12, 768),
]
# Chinchilla's own batch (Hoffmann et al., Table 4: 1.5M tokens at 5.76e23 FLOPs) anchors a plan from a published fit
BATCH_ANCHOR = (5.76e23, 1.5e6)
# the columns of sweep.tsv: a run's name and shape, N (params), D (tokens), C (flops), and what it reached
TSV_COLS = (
    "name", "budget", "n_layer", "n_embd", "n_head",
    "params", "tokens", "flops", "steps", "lr", "mup",
    "val_loss", "val_bpb", "train_loss", "train_time", "tokens_per_step",
)

def die(msg):
    """Stop with a one-line error and a non-zero exit."""
    raise SystemExit(f"scaling.py: error: {msg}")

def make_dir(path):
    """os.makedirs, or one line naming the folder that cannot be made (a file in its way, no permission)."""
    try:
        os.makedirs(path, exist_ok=True)
    except OSError as e:
        die(f"cannot make the folder {path} ({e.strerror}); pass a folder you can write")

def warn(msg):
    """A warning on stderr: the command goes on."""
    print(f"WARNING: {msg}", file=sys.stderr)

# -----------------------------------------------------------------------------
# Runs: one train_gpt.py run per row, appended to a TSV, so a sweep resumes where it stopped
#
# A sweep is a few dozen ordinary train_gpt.py runs that differ in shape and length. They run one after another in this
# process (train_gpt.main(cfg), as a test calls it), each in out_dir/runs/NAME with its log beside it, so that any run
# can be inspected or rerun alone. The TSV is the sweep's memory: a run is in it once it has finished, and a run that
# was cut short resumes from its own checkpoint.

def head_count(n_embd):
    """Heads for a ladder width: 32-dim heads, fewer for the smallest widths."""
    return max(1, n_embd // 32)

def matmul_params(cfg, vocab):
    """N: the parameters that do a matmul per token, all but the input embedding (a lookup); built on meta, free."""
    # Kaplan et al. 2020 found the laws cleaner without the embedding's parameters (Hoffmann et al. counted all); an
    # untied head (the default) is a matmul and counts. On the meta device a tensor has a shape but no storage: any
    # size builds for free.
    with torch.device("meta"):
        model = tg.GPT(cfg, vocab)
    total = sum(p.numel() for p in model.parameters())
    return total - model.wte.weight.numel()

def step_tokens(cfg):
    """Tokens in one optimizer step of one process: sequences x length x micro-steps."""
    return cfg.batch_size * cfg.seq_len * cfg.grad_accum

def read_tsv(path):
    """Rows of a TSV with a header as dicts of strings ([] if there is no file)."""
    if not os.path.exists(path):
        return []
    lines = [ln.rstrip("\n").split("\t") for ln in open(path) if ln.strip()]
    return [dict(zip(lines[0], r)) for r in lines[1:]]

def append_tsv(path, row):
    """Append one row (header first if the file is new), flushed to disk before the next run starts."""
    # a sweep is hours of runs: a row on disk is a run that a crash or Ctrl-C cannot cost again, and the TSV is
    # the sweep's only record of what is done (run_rows skips the names it holds)
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a") as f:
        if new:
            f.write("\t".join(TSV_COLS) + "\n")
        f.write("\t".join(str(row.get(c, "")) for c in TSV_COLS) + "\n")
        f.flush()
        os.fsync(f.fileno())

def run_one(cfg, log_path):
    """train_gpt.main(cfg) with its output in log_path; resumes an interrupted run from its newest checkpoint."""
    # a run stopped half-way goes on from its checkpoint with the same data in the same order, so its point on the
    # curve is the one an uninterrupted run would have given
    cfg.resume = bool(tg.list_checkpoints(cfg.out_dir))
    make_dir(cfg.out_dir)
    with open(log_path, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        return tg.main(cfg)

def run_rows(plan, base, out_dir, tsv):
    """Train each (name, overrides, extra) of plan not yet in tsv; returns (failed runs, stopped by a signal)."""
    done = {r["name"] for r in read_tsv(tsv)}
    todo = [p for p in plan if p[0] not in done]
    print(f"{len(plan)} runs, {len(plan) - len(todo)} already in {tsv}, {len(todo)} to go")
    # The time left is the time so far scaled by the work left. A run costs 6 N D FLOPs, and D is max_steps times
    # the same tokens per step in every run, so N x max_steps weighs each run's share.
    work = [extra["params"] * over["max_steps"] for _, over, extra in todo]
    failed = 0
    t0 = time.time()
    for i, (name, over, extra) in enumerate(todo):
        cfg = dataclasses.replace(base, **over, out_dir=os.path.join(out_dir, "runs", name))
        t1 = time.time()
        try:
            res = run_one(cfg, cfg.out_dir + ".log")
        except SystemExit as e:
            # train_gpt.py's die(): a bad config or data stops this run, not the sweep. One bad shape should not cost
            # the rest of a night's sweep; it is reported, left out of the TSV, and retried by the same command.
            failed += 1
            print(f"[{i + 1}/{len(todo)}] {name}: FAILED: {e} (log in {cfg.out_dir}.log)")
            continue
        if res.get("preempted"):
            # Ctrl-C or SIGTERM: the run saved a checkpoint; stop the sweep too
            print(f"[{i + 1}/{len(todo)}] {name}: stopped at step {res['steps']}; run the same command again to "
                  f"continue (this run resumes from its checkpoint)")
            return failed, True
        # D is what the run really trained on (its steps times its tokens per step), not what the plan asked for
        row = {
            **extra,
            "name": name,
            "n_layer": cfg.n_layer,
            "n_embd": cfg.n_embd,
            "n_head": cfg.n_head,
            "tokens": res["tokens"],
            "flops": f"{6 * int(extra['params']) * res['tokens']:.4g}",
            "steps": res["steps"],
            "lr": cfg.lr,
            "mup": int(cfg.mup),
            "val_loss": f"{res['val_loss']:.5f}",
            "val_bpb": f"{res.get('val_bpb', float('nan')):.5f}",
            "train_loss": f"{res['train_loss']:.5f}",
            "train_time": f"{res['train_time']:.1f}",
            "tokens_per_step": res["tokens"] // max(res["steps"], 1),
        }
        append_tsv(tsv, row)
        eta = (time.time() - t0) / sum(work[:i + 1]) * sum(work[i + 1:])
        print(f"[{i + 1}/{len(todo)}] {name}: N {int(extra['params']):,} D {res['tokens']:,} | val loss "
              f"{res['val_loss']:.4f} | {time.time() - t1:.0f} s | about {eta / 60:.0f} min left")
    return failed, False

def base_config(args, extra_flags):
    """train_gpt.py's Config for the runs: quiet, no mid-run evals or samples, any extra train_gpt.py flag applied."""
    cfg = tg.parse_args(tg.Config, extra_flags)  # unknown flags fail here, with the nearest valid name
    device = cfg.device
    if args.device == "cpu":
        device = "cpu"
    # a run of a sweep ends at its step count (no time budget, no --tokens), since D is what the law is about; the
    # one eval at its end is the point on the curve, and samples are not needed
    ours = dict(
        data_dir=args.data_dir,
        time_budget=0.0,
        tokens="",
        eval_every=0,
        sample_tokens=0,
        log_every=50,
        device=device,
        # N counts the weights of a matmul, and value embeddings are lookup tables that N leaves out: the laws and
        # plans here (WORKSHOP.md's experiment 6) are of models without them; --value_embeds=true adds them
        value_embeds=False,
    )
    given = {a.split("=")[0].lstrip("-") for a in extra_flags if a.startswith("--")}  # a flag given wins over ours
    return dataclasses.replace(cfg, **{k: v for k, v in ours.items() if k not in given})

def vocab_of(cfg):
    """The vocabulary train_gpt.py will use for cfg's data (the data is prepared first if it is the default)."""
    # N counts the head, a vocab x n_embd matmul, so the plan needs the vocabulary before any run starts
    tg.prepare_default_data(cfg, 0, 1, *tg.DEFAULT_DATA)
    return cfg.vocab_size or tg.load_meta(cfg.data_dir)["vocab_size"]

def ladder_overrides(n_layer, n_embd, steps, cfg):
    """The Config fields of one run of a sweep: its shape, its steps, and a warmup of a tenth of them at most."""
    # Every run has full multi-head attention (n_kv_head=0), so that N depends on the shape alone. The warmup is
    # capped at a tenth of the run: a short run that spent half its steps warming up would be judged by its schedule.
    return dict(
        n_layer=n_layer,
        n_embd=n_embd,
        n_head=head_count(n_embd),
        n_kv_head=0,
        max_steps=steps,
        warmup_steps=max(1, min(cfg.warmup_steps, steps // 10)),
    )

def isoflop_plan(budgets, n_sizes, cfg, vocab, ratio=20.0, min_steps=100):
    """Per budget C, n_sizes ladder models spread evenly in log N over [N0 / 4, 4 N0] around the guess N0 =
    sqrt(C / 6 ratio) (ratio tokens per parameter), each trained for D = C / 6N tokens, and none for fewer than
    min_steps steps (a model trained for too few steps is limited by optimisation, not by size or data).
    Returns [(name, overrides, extra)]."""
    # An IsoFLOP profile (Hoffmann et al.'s Approach 2) holds C fixed and trades N against D: too small a model
    # cannot use its data, too large a one sees too few tokens. Its loss is U-shaped in log N, and the bottom is
    # the best N for that C. With C = 6 N D and D = ratio x N, the bottom is near N0 = sqrt(C / 6 ratio); a range of
    # 16x around it should hold the bottom inside it, which cmd_fit checks.
    tps = step_tokens(cfg)
    shapes = []
    for L, d in LADDER:
        shape_cfg = dataclasses.replace(cfg, n_layer=L, n_embd=d, n_head=head_count(d), n_kv_head=0)
        shapes.append((matmul_params(shape_cfg, vocab), L, d))
    plan = []
    for C in budgets:
        n0 = math.sqrt(C / (6 * ratio))
        ok = [s for s in shapes if C / (6 * s[0]) / tps >= min_steps]
        if len(ok) < 3:
            die(f"budget {C:.3g} FLOPs leaves fewer than 3 ladder models with {min_steps} steps of {tps} tokens; "
                f"raise --flops or lower --batch_size")
        picked = []  # the ladder model nearest each target in log N, each once
        for target in np.exp(np.linspace(math.log(n0 / 4), math.log(n0 * 4), n_sizes)):
            best = min(ok, key=lambda s: abs(math.log(s[0] / target)))
            if best not in picked:
                picked.append(best)
        for n, L, d in picked:
            steps = max(1, round(C / (6 * n) / tps))
            # a run's name is its budget and shape: the same command names the same runs, so the TSV knows which
            # are done, and a changed command adds runs instead of overwriting finished ones
            name = f"C{C:.0e}_L{L}_d{d}".replace("+", "")
            plan.append((name, ladder_overrides(L, d, steps, cfg), {"budget": f"{C:.4g}", "params": n}))
    return plan

def grid_plan(models, tokens, cfg, vocab):
    """A user's grid: every (n_layer x n_embd) model of --models for every token budget of --tokens."""
    # Each model trained for several token counts: the data of Hoffmann et al.'s Approach 1, here fitted by Approach 3
    tps = step_tokens(cfg)
    plan = []
    for m, D in itertools.product(models, tokens):
        try:
            L, d = map(int, m.lower().split("x"))
        except ValueError:
            die(f"--models: {m!r} is not LAYERSxWIDTH, e.g. 4x128")
        over = ladder_overrides(L, d, max(1, round(D / tps)), cfg)
        params = matmul_params(dataclasses.replace(cfg, **over), vocab)
        plan.append((f"D{D:.0e}_L{L}_d{d}".replace("+", ""), over, {"budget": "", "params": params}))
    return plan

def cmd_sweep(args, extra):
    """Train an IsoFLOP sweep (or a --models x --tokens grid) and record each finished run in OUT_DIR/sweep.tsv."""
    if (args.sizes < 1
            or not 0 < args.ratio < math.inf
            or not 0 < args.lr < math.inf):
        die(f"need --sizes >= 1, --ratio > 0 and --lr > 0, got {args.sizes}, {args.ratio} and {args.lr}")
    # the sweep's own LR, that of the sweeps in the docs: train_gpt.py's default (8e-3) was tuned for its 64-wide
    # model in 240 s, and at it the tiny AdamW runs of tests/test_scaling.py fit 7x worse (log residual 0.25).
    # One LR for every size is a compromise without --mup: the best LR falls as the width grows, so the wide runs
    # are a little off their best, and a law fitted to them understates what size buys (alpha comes out low).
    cfg = dataclasses.replace(base_config(args, extra), lr=args.lr)
    vocab = vocab_of(cfg)
    if args.models or args.tokens:
        if not (args.models and args.tokens):
            die("a grid needs both --models (e.g. 2x64,4x128) and --tokens (e.g. 1e6,4e6)")
        tokens = parse_floats(args.tokens, "--tokens")
        plan = grid_plan(args.models.split(","), tokens, cfg, vocab)
    else:
        budgets = parse_floats(args.flops, "--flops")
        plan = isoflop_plan(budgets, args.sizes, cfg, vocab, args.ratio, args.min_steps)
    total = sum(6 * extra["params"] * over["max_steps"] * step_tokens(cfg) for _, over, extra in plan)
    print(f"sweep: {len(plan)} runs, {total:.3g} FLOPs (6ND) in all, into {args.out_dir}")
    make_dir(args.out_dir)
    failed, stopped = run_rows(plan, cfg, args.out_dir, os.path.join(args.out_dir, "sweep.tsv"))
    if stopped:
        return
    if failed:
        die(f"{failed} run(s) failed; see their logs, fix, and run the same command again (finished runs are kept)")
    print(f"done: next, python scaling.py fit --out_dir={args.out_dir}")

def parse_floats(s, flag, example="1e12,3e12"):
    """A comma-separated list of positive finite numbers, or a one-line error that shows one."""
    try:
        vals = [float(v) for v in s.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or not all(0 < v < math.inf for v in vals):  # nan is not
        die(f"{flag}={s!r} is not a comma-separated list of positive numbers, e.g. {flag}={example}")
    return vals

# -----------------------------------------------------------------------------
# Fit: L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022, Approach 3)
#
# Why this form: a model of N parameters trained forever on unlimited data still pays A / N^alpha over the entropy E,
# and any model trained on D tokens pays at most B / D^beta for the data it has not seen; the two terms add. The fit
# is in log space (log L_pred - log L), so a run at loss 3 and a run at loss 5 weigh alike, and under a Huber loss with
# a small delta (1e-3), so that a few bad runs pull on the fit linearly, not quadratically. Hoffmann et al. fit the
# same way, with L-BFGS from a grid of starts. In numbers: a run whose loss is 5% off the law pulls on the fit with
# the gradient of a 0.1% miss (delta), 50 times less than a squared error would let it.

def predict_log(theta, logN, logD):
    """log L of the law for theta (..., 5) = (e, a, b, alpha, beta) at log N, log D (n,): shape (..., n)."""
    e, a, b, al, be = theta.split(1, dim=-1)  # each (..., 1)
    # log(E + A/N^alpha + B/D^beta) = logsumexp(e, a - alpha log N, b - beta log D): stable where one term is tiny
    model_term = a - al * logN  # (..., n)
    data_term = b - be * logD  # (..., n)
    terms = torch.stack([model_term, data_term, e.expand_as(model_term)])  # (3, ..., n)
    return torch.logsumexp(terms, dim=0)

def huber(r, delta):
    """Huber loss: quadratic within delta, linear beyond, so a few bad runs cannot dominate the fit."""
    a = r.abs()
    return torch.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))

def objective(theta, logN, logD, logL, delta, w=None):
    """Sum over runs (weighted by w, the bootstrap counts) of Huber(log L_pred - log L); theta (K, 5) -> (K,)."""
    h = huber(predict_log(theta, logN, logD) - logL, delta)  # (K, n)
    if w is not None:
        h = h * w
    return h.sum(-1)

def lbfgs(f, x, iters=500, memory=10, tol=1e-12):
    """Minimise each row of x (K, P) independently with L-BFGS and a backtracking (Armijo) line search, all rows
    at once: f maps (K, P) to (K,). The two-loop recursion of Nocedal & Wright, Algorithm 7.4, batched; rows that
    have converged drop out. Returns (x, f(x))."""
    # torch.optim.LBFGS minimises one vector; the fit needs 4,500 starts, and one batched L-BFGS over all of them
    # does in one tensor op what a Python loop over starts would do 4,500 times. L-BFGS keeps the last `memory`
    # steps s = x' - x and gradient changes y = g' - g, which sketch the inverse Hessian: its step is Newton's
    # without a Hessian. Nocedal & Wright suggest keeping 3 to 20 pairs; with 5 parameters, 10 is plenty.
    # The rows are independent, so the gradient of their sum is each row's own gradient: one backward for all K.
    def value_grad(x):
        x = x.detach().requires_grad_(True)
        v = f(x)
        return v.detach(), torch.autograd.grad(v.sum(), x)[0]
    x = x.clone()
    fx, g = value_grad(x)
    S = torch.zeros((memory, *x.shape), dtype=x.dtype)  # (memory, K, P): the steps s
    Y = torch.zeros((memory, *x.shape), dtype=x.dtype)  # (memory, K, P): the gradient changes y
    idx = torch.arange(x.shape[0])  # the rows still moving
    for it in range(iters):
        xi = x[idx]  # (k, P)
        fi = fx[idx]  # (k,)
        gi = g[idx]  # (k, P)
        s_ = S[:, idx]  # (memory, k, P)
        y_ = Y[:, idx]
        sy = (s_ * y_).sum(-1, keepdim=True)  # (memory, k, 1); 0 for a pair not yet filled or skipped
        rho = torch.where(sy > 1e-20, 1 / sy.clamp_min(1e-20), torch.zeros_like(sy))
        # the two-loop recursion: q = H g, with H the inverse-Hessian estimate of the stored pairs
        q = gi.clone()
        al = [None] * memory
        order = [(it - 1 - j) % memory for j in range(min(it, memory))]  # newest pair first
        for j in order:
            al[j] = rho[j] * (s_[j] * q).sum(-1, keepdim=True)
            q = q - al[j] * y_[j]
        if order:
            # scale by s.y / y.y of the newest pair: a step of about the right length at once
            j = order[0]
            yy = (y_[j] * y_[j]).sum(-1, keepdim=True)  # (k, 1)
            gamma = torch.where(sy[j] > 1e-20, sy[j] / yy.clamp_min(1e-30), torch.ones_like(yy))
            q = q * gamma
        for j in reversed(order):
            be = rho[j] * (y_[j] * q).sum(-1, keepdim=True)  # (k, 1): Nocedal & Wright's beta
            q = q + s_[j] * (al[j] - be)
        d = -q
        slope = (gi * d).sum(-1)
        # not a descent direction (or NaN): fall back to steepest descent
        bad = ~(slope < 0)
        d[bad] = -gi[bad]
        slope = (gi * d).sum(-1)
        # Armijo's condition: the step must lower f by at least a small fraction of what the slope promises. L-BFGS
        # steps are usually about right, so the full step (t = 1) is tried first.
        t = torch.ones(len(idx), dtype=x.dtype)  # (k,)
        ok = torch.zeros(len(idx), dtype=torch.bool)
        trying = torch.arange(len(idx))  # the rows whose step is not yet good: only they are evaluated again
        for _ in range(40):
            # halve each row's step until it decreases f enough (Armijo, c = 1e-4)
            fn = f(xi[trying] + t[trying, None] * d[trying])
            ok[trying] = torch.isfinite(fn) & (fn <= fi[trying] + 1e-4 * t[trying] * slope[trying])
            trying = trying[~ok[trying]]
            if len(trying) == 0:
                break
            t[trying] = t[trying] / 2
        xn = torch.where(ok[:, None], xi + t[:, None] * d, xi)  # a row with no good step stays put
        fn, gn = value_grad(xn)
        S[it % memory, idx] = xn - xi
        Y[it % memory, idx] = gn - gi
        x[idx] = xn
        fx[idx] = fn
        g[idx] = gn
        # a row stops when its step failed, its loss stopped falling, or its gradient vanished
        still_falling = (fi - fn).abs() > tol * (1 + fi.abs())
        not_flat = gn.abs().amax(-1) > 1e-10
        idx = idx[ok & still_falling & not_flat]
        if len(idx) == 0:
            break
    return x.detach(), fx

def grid_starts(param_grid):
    """Every combination of the grid's initial values, as a (K, 5) float64 tensor in NAMES order."""
    combos = itertools.product(*(param_grid[k] for k in NAMES))
    return torch.tensor(list(combos), dtype=torch.float64)

def fit_law(N, D, L, param_grid=None, delta=1e-3, starts=None, w=None):
    """Fit (E, A, B, alpha, beta) to runs (N, D, loss) from every start; returns (params dict, theta, all finals)."""
    logN, logD, logL = torch.as_tensor(np.log([N, D, L]), dtype=torch.float64)  # each (n,)
    x0 = starts
    if x0 is None:
        x0 = grid_starts(param_grid or PARAM_GRID)
    if w is not None:
        w = torch.as_tensor(w, dtype=torch.float64)
    # all starts at once, each its own L-BFGS; the fit is the best of their ends
    theta, fx = lbfgs(lambda t: objective(t, logN, logD, logL, delta, w), x0.clone())  # (K, 5), (K,)
    fx = torch.where(torch.isfinite(fx), fx, torch.full_like(fx, float("inf")))  # a start that blew up never wins
    best = theta[fx.argmin()]
    return params_of(best), best, (theta, fx)

def exp_or_inf(v):
    """exp(v), or inf where it would overflow: a degenerate fit can run off to a huge log A or log B."""
    if v < 700:
        return math.exp(v)
    return float("inf")

def params_of(theta):
    """The fit's parameters as a dict, E, A and B taken out of their logs."""
    e, a, b, al, be = theta.tolist()
    return dict(E=exp_or_inf(e), A=exp_or_inf(a), B=exp_or_inf(b), alpha=al, beta=be)

def law(p, N, D):
    """L(N, D) of a fit's params."""
    model_term = p["A"] / np.asarray(N, dtype=float) ** p["alpha"]
    data_term = p["B"] / np.asarray(D, dtype=float) ** p["beta"]
    return p["E"] + model_term + data_term

def optimal_allocation(p, C):
    """Closed form of the law's optimum on the compute budget C = 6 N D (Hoffmann et al., eq. 4): (N_opt, D_opt)."""
    # Put D = C / 6N into the law and set dL/dN = 0: alpha A / N^alpha = beta B / D^beta. Then N_opt grows like
    # C^(beta / (alpha + beta)) and D_opt like C^(alpha / (alpha + beta)); with Chinchilla's fit both are near 0.5,
    # which is where "20 tokens per parameter" comes from.
    al = p["alpha"]
    be = p["beta"]
    G = (al * p["A"] / (be * p["B"])) ** (1 / (al + be))
    n_opt = G * (C / 6) ** (be / (al + be))
    d_opt = (C / 6) ** (al / (al + be)) / G
    return n_opt, d_opt

def isoflop_minima(rows):
    """Approach 2: a parabola in log N through each budget's profile; [(C, N_opt, loss at N_opt, inside?)]."""
    # Near its bottom any smooth profile is close to a parabola in log N, so three or more sizes give its vertex.
    # The minimum counts only if it lies inside the sizes trained: a parabola's vertex outside them is a guess.
    out = []
    for C in sorted({r["budget"] for r in rows if r["budget"]}):
        prof = sorted((r["params"], r["val_loss"]) for r in rows if r["budget"] == C)
        if len({n for n, _ in prof}) < 3:
            continue
        x = np.log([n for n, _ in prof])
        y = np.array([loss for _, loss in prof])
        c2, c1, c0 = np.polyfit(x, y, 2)
        if c2 <= 0:  # no minimum: the profile is monotone or noisy
            out.append((C, float("nan"), float("nan"), False))
            continue
        xm = -c1 / (2 * c2)
        inside = bool(x.min() < xm < x.max())
        out.append((C, math.exp(xm), c0 + c1 * xm + c2 * xm * xm, inside))
    return out

def load_runs(path):
    """Finished runs of a sweep TSV: (rows with numbers, arrays N, D, L); runs with a non-finite loss are dropped."""
    # L is the val loss at the end of each run: held-out, so it measures the model rather than its memory, and
    # averaged over a whole eval, so it is far less noisy than the last steps' training loss
    rows = []
    try:  # a ValueError too: a file that is not UTF-8 text
        for r in read_tsv(path):
            budget = None
            if r.get("budget"):  # empty in a user's grid: no IsoFLOP profile
                budget = float(r["budget"])
            rows.append(dict(
                name=r["name"],
                budget=budget,
                params=float(r["params"]),
                tokens=float(r["tokens"]),
                val_loss=float(r["val_loss"]),
                tokens_per_step=float(r.get("tokens_per_step") or "nan"),
            ))
    except (KeyError, ValueError) as e:
        die(f"{path}: a row is not a sweep row ({e}); it needs name, params, tokens and val_loss columns")
    bad = [r["name"] for r in rows if not math.isfinite(r["val_loss"])]
    if bad:
        warn(f"{len(bad)} run(s) with a non-finite loss left out: {', '.join(bad[:5])}")
    rows = [r for r in rows if math.isfinite(r["val_loss"])]
    N = np.array([r["params"] for r in rows])
    D = np.array([r["tokens"] for r in rows])
    L = np.array([r["val_loss"] for r in rows])
    return rows, N, D, L

def diagnose(N, D, theta, param_grid, finals, boot):
    """Reasons to distrust a fit: too few runs, an under-determined grid, a fit at the edge of the start grid,
    near-equal optima far apart, wide intervals. Returns a list of one-line warnings."""
    # A fit always returns numbers; these are the ways they can be numbers the data do not support. Each warning
    # goes into fit.json too, and plan repeats them, so a doubtful fit cannot pass into a plan unnoticed.
    out = []
    if len(N) < 10:
        out.append(f"only {len(N)} runs for 5 parameters: the fit can pass through every point; run 10 or more")
    for name, v, term in (("model sizes N", N, "A/alpha"), ("token counts D", D, "B/beta")):
        if len(np.unique(np.round(np.log(v), 3))) < 3:
            out.append(f"fewer than 3 distinct {name}: the law's {term} term is not determined; spread the grid")
    # along one IsoFLOP profile N and D move together (D = C / 6N), so A/N^alpha and B/D^beta trade off against each
    # other and against E: runs at one compute cannot tell the three apart
    if len(np.unique(np.round(np.log(6 * N * D), 1))) < 2:
        out.append("every run has the same compute: the grid is one IsoFLOP profile and cannot separate E from the "
                   "rest")
    if min(len(param_grid[k]) for k in NAMES) < 2:
        out.append("the start grid has a single value for some parameter: L-BFGS may stop in a local optimum; "
                   "give --param_grid several values each")
    for i, k in enumerate(NAMES):
        lo = min(param_grid[k])
        hi = max(param_grid[k])
        if not lo - 1e-9 <= float(theta[i]) <= hi + 1e-9:
            out.append(f"fitted {k} = {float(theta[i]):.3g} lies outside the start grid [{lo}, {hi}]; widen "
                       f"--param_grid so that the optimum is bracketed")
    # starts that end as good as the best but elsewhere: a flat valley, in which the exponents are not pinned down
    th, fx = finals
    tie = 1e-6 * max(float(fx.min()), 1e-12) + 1e-12  # as good as the best, to a relative 1e-6
    near = th[(fx - fx.min()) <= tie]
    spread = 0.0
    if len(near) > 1:
        spread = (near[:, 3:] - theta[3:]).abs().max().item()
    if spread > 0.05:
        out.append(f"starts reach equally good fits with exponents up to {spread:.2f} apart: the data do not pin "
                   f"alpha and beta down")
    for k in ("alpha", "beta"):
        lo, hi = boot.get(k, (float("nan"), float("nan")))
        if math.isfinite(lo) and hi - lo > 0.5 * abs(float(theta[NAMES.index(k)])):
            out.append(f"the 95% interval of {k} ({lo:.3g} to {hi:.3g}) is wider than half its value: "
                       f"more runs, or runs over a wider range of N and D")
    return out

def bootstrap(N, D, L, theta, finals, n_boot, delta, seed=0, n_starts=32):
    """95% percentile intervals of each parameter over n_boot refits on runs resampled with replacement. Each refit
    starts from the full fit and the n_starts best starts of the grid (all 4,500 starts every time would be slow)."""
    # A resample draws n runs from the n with replacement; it is passed as counts (how often each run was drawn)
    # that weigh the objective, which is the same sum without copying rows. The spread of the refits' parameters is
    # how much they depend on which runs happened to be made.
    if n_boot <= 0:
        return {}
    # the refits start where good fits were found: resampling moves the optimum a little, not across the grid
    th, fx = finals
    starts = torch.cat([theta[None], th[torch.argsort(fx)[:n_starts]]])  # (1 + n_starts, 5)
    rng = np.random.default_rng(seed)  # a fixed seed: the same runs give the same intervals
    fits = []
    for _ in range(n_boot):
        drawn = rng.integers(0, len(N), len(N))
        counts = np.bincount(drawn, minlength=len(N)).astype(float)
        fits.append(fit_law(N, D, L, delta=delta, starts=starts, w=counts)[0])
    intervals = {}
    for k in fits[0]:
        lo, hi = np.percentile([f[k] for f in fits], [2.5, 97.5])
        intervals[k] = (float(lo), float(hi))
    return intervals

def read_param_grid(spec):
    """--param_grid: a JSON file or inline JSON of {"e": [..], "a": [..], "b": [..], "alpha": [..], "beta": [..]}."""
    # another grid is for a law in other units or over another range of N and D, whose optimum Hoffmann et al.'s
    # grid may not bracket; diagnose says when the fit ends outside the grid it was given
    if not spec:
        return PARAM_GRID
    text = spec
    try:
        if os.path.exists(spec):
            text = open(spec).read()
        grid = json.loads(text)
    except (OSError, json.JSONDecodeError) as e:
        die(f"--param_grid={spec!r} is neither a JSON file nor JSON ({e})")
    missing = [k for k in NAMES if not isinstance(grid.get(k), list) or not grid[k]]
    if missing:
        die(f"--param_grid needs a non-empty list for each of {', '.join(NAMES)}; missing or empty: "
            f"{', '.join(missing)}")
    return {k: [float(v) for v in grid[k]] for k in NAMES}

def cmd_fit(args):
    """Fit the law to a sweep's runs; write fit.json, isoflop.png and fit.png, and warn where the fit is weak."""
    tsv = args.tsv or os.path.join(args.out_dir, "sweep.tsv")
    if not os.path.exists(tsv):
        die(f"no sweep results at {tsv}; run 'python scaling.py sweep' first or pass --tsv=PATH")
    rows, N, D, L = load_runs(tsv)
    if len(N) < 5:
        die(f"{tsv} has {len(N)} finished runs; a fit of 5 parameters needs at least 5 (10+ to be trusted)")
    grid = read_param_grid(args.param_grid)
    t0 = time.time()
    p, theta, finals = fit_law(N, D, L, grid, args.delta)
    boot = bootstrap(N, D, L, theta, finals, args.bootstrap, args.delta)
    warnings = diagnose(N, D, theta, grid, finals, boot)
    minima = isoflop_minima(rows)
    for C, n, _, inside in minima:
        if not inside:
            warnings.append(f"the IsoFLOP profile at {C:.3g} FLOPs has its minimum at or beyond its largest or "
                            f"smallest model: add sizes on that side")
    # Two estimates of how N_opt grows with C. Approach 2: a line through the profiles' minima in log-log space.
    # Approach 3: the fitted law's exponent beta / (alpha + beta). Where they disagree, trust neither much.
    good = [(C, n) for C, n, _, inside in minima if inside]
    a2 = None
    if len(good) >= 2:
        log_c, log_n = np.log(list(zip(*good)))
        a2 = float(np.polyfit(log_c, log_n, 1)[0])
    a3 = p["beta"] / (p["alpha"] + p["beta"])
    # the rms of the log residuals is the law's typical relative miss: 0.01 means it predicts each run's loss to 1%
    resid = np.log(law(p, N, D)) - np.log(L)
    res = dict(
        params=p,
        interval95=boot,
        n_runs=int(len(N)),
        rms_log_residual=float(np.sqrt(np.mean(resid ** 2))),
        n_opt_exponent=a3,
        isoflop_minima=[dict(flops=C, n_opt=n, loss=loss, inside=i) for C, n, loss, i in minima],
        isoflop_exponent=a2,
        max_flops=float((6 * N * D).max()),  # plan refuses to extrapolate far beyond it
        delta=args.delta,
        tokens_per_step=float(np.nanmax([r["tokens_per_step"] for r in rows])),
        warnings=warnings,
        tsv=tsv,
    )
    make_dir(args.out_dir)
    with open(os.path.join(args.out_dir, "fit.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"fit of {len(N)} runs from {len(finals[1])} starts and {args.bootstrap} bootstrap refits in "
          f"{time.time() - t0:.1f} s; rms log residual {res['rms_log_residual']:.4f}")
    # yours beside Chinchilla's: E, A and B depend on the tokenizer and the data (nats per token of what?), so it is
    # the exponents alpha and beta, and what follows from them, that compare across setups
    print(f"{'':6s} {'fitted':>10s} {'95% interval':>24s} {'Chinchilla':>11s}")
    for k in ("E", "A", "B", "alpha", "beta"):
        lo, hi = boot.get(k, (float("nan"),) * 2)
        print(f"{k:6s} {p[k]:10.4g} {f'[{lo:.4g}, {hi:.4g}]':>24s} {CHINCHILLA[k]:11.4g}")
    if a2:
        approach2 = f", C^{a2:.3f} from the IsoFLOP minima (Approach 2)"
    else:
        approach2 = " (too few IsoFLOP profiles with an inner minimum for Approach 2)"
    print(f"N_opt ~ C^{a3:.3f} (Approach 3){approach2}; Chinchilla: C^0.46 and C^0.49")
    for w in warnings:
        warn(w)
    plot_fit(args.out_dir, rows, p, minima)
    print(f"wrote {args.out_dir}/fit.json, isoflop.png and fit.png; next: python scaling.py plan --flops=C")
    return res

def plot_fit(out_dir, rows, p, minima):
    """isoflop.png: loss against N per budget, parabolas, the law and its frontier; fit.png: law against data."""
    # How to read isoflop.png: each colour is one budget, its runs should make a U whose bottom (a star) moves to
    # larger N as the budget grows, and the law's dashed curve should pass through each U. On the right, Approach 2's
    # stars should lie on Approach 3's line; where they do not, the sweep needs more runs or a wider range.
    # a Figure of its own, no pyplot: no global state, no display, nothing to close
    import matplotlib.figure
    N = np.array([r["params"] for r in rows], dtype=float)  # (n,)
    D = np.array([r["tokens"] for r in rows], dtype=float)  # (n,)
    L = np.array([r["val_loss"] for r in rows], dtype=float)  # (n,)
    budgets = sorted({r["budget"] for r in rows if r["budget"]})
    fig = matplotlib.figure.Figure(figsize=(12, 4.8), layout="tight")
    ax, bx = fig.subplots(1, 2)
    cmap = matplotlib.colormaps["viridis"]
    # left: each IsoFLOP profile's runs, and the law along the same budget (D = C / 6N)
    for i, C in enumerate(budgets):
        col = cmap(i / max(len(budgets) - 1, 1))
        sel = [r for r in rows if r["budget"] == C]
        n = np.array([r["params"] for r in sel])
        loss = [r["val_loss"] for r in sel]
        ax.scatter(n, loss, color=col, label=f"{C:.0e} FLOPs", zorder=3)
        ng = np.geomspace(n.min() / 1.5, n.max() * 1.5, 100)
        ax.plot(ng, law(p, ng, C / (6 * ng)), color=col, ls="--", lw=1)
    for C, n, loss, inside in minima:
        if math.isfinite(n):
            ax.scatter([n], [loss], marker="*", s=160, color="red" if inside else "grey", zorder=4)
    ax.set(
        xscale="log",
        xlabel="parameters N (matmul)",
        ylabel="val loss (nats/token)",
        title="IsoFLOP profiles: runs, the fitted law (dashed), parabola minima (*)",
    )
    if budgets:
        ax.legend(fontsize=8)
    else:  # a user's grid: no IsoFLOP profiles, so the runs alone
        ax.scatter(N, L, color="k", zorder=3)
    # right: N_opt against C, Approach 3's line and Approach 2's points, extrapolated 30x past the largest run
    run_flops = 6 * N * D  # (n,)
    C = np.geomspace(run_flops.min() / 3, run_flops.max() * 30, 50)
    bx.plot(C, optimal_allocation(p, C)[0], "k--", label="law's optimum (Approach 3)")
    pts = [(c, n) for c, n, _, inside in minima if inside]
    if pts:
        label = "IsoFLOP minima (Approach 2)"
        bx.scatter(*zip(*pts), color="red", marker="*", s=160, label=label, zorder=3)
    bx.set(
        xscale="log",
        yscale="log",
        xlabel="compute C = 6ND (FLOPs)",
        ylabel="compute-optimal N",
        title="Compute-optimal model size",
    )
    bx.legend(fontsize=8)
    fig.savefig(os.path.join(out_dir, "isoflop.png"), dpi=110)

    fig = matplotlib.figure.Figure(figsize=(12, 4.8), layout="tight")
    ax, bx = fig.subplots(1, 2)
    # left: the law as a surface over (N, D), the runs on it in the same colours: a run off its colour is a misfit
    ng = np.geomspace(N.min() / 2, N.max() * 2, 80)
    dg = np.geomspace(D.min() / 2, D.max() * 2, 80)
    G = law(p, ng[None, :], dg[:, None])  # (80 D, 80 N)
    lowest = min(L.min(), G.min())
    # the top 5% of the surface, far from every run, saturate
    lv = np.linspace(lowest, np.percentile(G, 95), 14)
    cs = ax.contourf(ng, dg, G, levels=lv, cmap="viridis", extend="both")
    ax.scatter(
        N,
        D,
        c=L,
        cmap="viridis",
        vmin=lv[0],  # the same colour scale as the surface
        vmax=lv[-1],
        edgecolors="white",
        s=50,
    )
    fig.colorbar(cs, ax=ax, label="loss: law (surface) and runs (dots)")
    cf_lo = 6 * N.min() * D.min()
    cf_hi = 6 * N.max() * D.max()
    cf = np.geomspace(cf_lo, cf_hi, 40)
    ax.plot(*optimal_allocation(p, cf), "r--", label="compute-optimal frontier")
    ax.set(
        xscale="log",
        yscale="log",
        xlim=(ng[0], ng[-1]),
        ylim=(dg[0], dg[-1]),
        xlabel="parameters N",
        ylabel="tokens D",
        title="Fitted L(N, D) against the runs",
    )
    ax.legend(fontsize=8)
    # right: predicted against measured; on the diagonal is a perfect fit, and a tilt by D/N is a missing term
    pred = law(p, N, D)
    bx.scatter(pred, L, c=np.log10(D / N), cmap="coolwarm")
    lo = min(pred.min(), L.min())
    hi = max(pred.max(), L.max())
    lim = [lo * 0.98, hi * 1.02]
    bx.plot(lim, lim, "k--", lw=1)
    bx.set(xlabel="predicted loss", ylabel="measured val loss", title="Law against runs (colour: log10 D/N)")
    fig.savefig(os.path.join(out_dir, "fit.png"), dpi=110)

# -----------------------------------------------------------------------------
# Plan: the compute-optimal model for a budget

def plan(p, C, max_flops=None, tokens_per_step=None, force=False):
    """N_opt, D_opt (6 N D = C), the predicted loss and a batch size ~ C^0.25 for budget C; refuses to extrapolate
    beyond twice the largest fitted compute unless force. Returns a dict."""
    # A law fitted between 1e11 and 1e13 FLOPs and read at 1e20 bets that nothing changes over seven orders of
    # magnitude; small errors in alpha and beta grow with every one. Hoffmann et al. fitted up to 1e22 and then
    # trained Chinchilla at 5.8e23, a 50x leap, with a law of 400 runs; a sweep of 15 tiny runs earns far less.
    if max_flops and C > 2 * max_flops:
        # the budgets to sweep first: from twice the largest fitted up to C / 2, a factor of about 3 apart
        lo = min(2 * max_flops, C / 2)
        count = max(2, math.ceil(math.log(C / 2 / lo, 3)) + 1)
        nxt = sorted(set(np.geomspace(lo, C / 2, count).round(-6)))
        flops = ",".join(f"{c:.2g}" for c in nxt)
        msg = (f"{C:.3g} FLOPs is {C / max_flops:.0f}x the largest fitted compute ({max_flops:.3g}); a law fitted at "
               f"small scale is only trusted to about 2x beyond it. Sweep further first: python scaling.py sweep "
               f"--flops={flops}")
        if not force:
            die(msg + " (or pass --force to plan anyway)")
        warn("EXTRAPOLATING: " + msg)
    N, D = optimal_allocation(p, C)
    # The batch: past a "critical batch size" more tokens per step stop buying fewer steps, and that size grows
    # with compute, slowly (DeepSeek LLM 2024 fit about C^0.33; this takes the gentler C^0.25). It is scaled from a
    # known good batch: the sweep's own, at its largest compute, or Chinchilla's for a published fit.
    anchor_c, anchor_b = BATCH_ANCHOR
    if max_flops and tokens_per_step:
        anchor_c, anchor_b = max_flops, tokens_per_step
    batch = anchor_b * (C / anchor_c) ** 0.25
    return dict(
        flops=C,
        params=N,
        tokens=D,
        tokens_per_param=D / N,
        loss=float(law(p, N, D)),
        batch_tokens=2 ** round(math.log2(batch)),  # a power of two: it divides into micro-batches and GPUs
        batch_anchor=(anchor_c, anchor_b),
    )

def cmd_plan(args):
    """Print (and return) the compute-optimal plan for --flops from your fit.json or a published fit."""
    C = parse_floats(args.flops, "--flops")[0]
    if args.published:
        p = PUBLISHED[args.published]
        max_flops = None
        tps = None
        src = f"published {args.published} fit"
    else:
        path = os.path.join(args.out_dir, "fit.json")
        if not os.path.exists(path):
            die(f"no fit at {path}; run 'python scaling.py fit' first, or use --published=chinchilla")
        try:  # a damaged or hand-made fit.json
            with open(path) as f:
                fit = json.load(f)
            p = {k: float(fit["params"][k]) for k in CHINCHILLA}
            max_flops = float(fit["max_flops"])
            tps = fit.get("tokens_per_step")
            flagged = list(fit["warnings"])
        except (ValueError, KeyError, TypeError) as e:
            die(f"{path} is not a fit of 'scaling.py fit' ({type(e).__name__}: {e}); run the fit again")
        src = path
        for w in flagged:
            warn(f"the fit was flagged: {w}")
    # To train the plan: pick n_layer and n_embd whose N (matmul_params) is near params, then pass train_gpt.py
    # --tokens=D and a batch_size x seq_len x grad_accum x GPUs of about batch_tokens.
    r = plan(p, C, max_flops, tps, args.force)
    ac, ab = r["batch_anchor"]
    print(f"plan for C = {C:.3g} FLOPs from the {src}:\n"
          f"  N = {r['params']:.4g} parameters (matmul), D = {r['tokens']:.4g} tokens, "
          f"{r['tokens_per_param']:.1f} tokens per parameter (6ND = {6 * r['params'] * r['tokens']:.4g})\n"
          f"  predicted loss {r['loss']:.4f}; batch about {r['batch_tokens']:,} tokens per step "
          f"({ab:,.0f} tokens at {ac:.3g} FLOPs, times (C / that)^0.25)")
    return r

# -----------------------------------------------------------------------------
# muP checks: coordinate check and LR transfer
#
# A sweep is only worth fitting if each run trained as well as its size allows, and with one LR for every width that
# fails in the standard parametrisation (SP): an update of the same LR moves a wider layer's output more, so the best
# LR falls as the model widens. muP (Yang et al. 2022, Tensor Programs V) rescales the init, the LR and the output
# multiplier per layer with the width (train_gpt.width_mult says which), so that the LR tuned at base_width is the best
# at every width. Two checks that it does, from the paper: the coordinate check (the activations' size after a few
# steps must not change with width) and LR transfer (the best LR must not move with width).

def activation_sizes(model, x):
    """Mean |coordinate| of the embedding's output, each block's and the logits, in one forward pass: {name: size}."""
    # a forward hook sees each module's output as the model runs: the embedding's and each block's (B, T, n_embd)
    sizes = {}

    def recorder(name):
        def hook(module, inputs, output):
            sizes[name] = output.abs().mean().item()
        return hook
    layers = [("embedding", model.wte)] + [(f"block {i}", b) for i, b in enumerate(model.blocks)]
    hooks = [m.register_forward_hook(recorder(n)) for n, m in layers]
    with torch.no_grad():
        sizes["logits"] = model(x).abs().mean().item()  # model(x) without targets: the logits (B, T, vocab)
    for h in hooks:
        h.remove()
    return sizes

def coord_check(widths=(64, 128, 256, 512), steps=4, lr=1e-2, seeds=3, n_layer=2, seq_len=64, batch_size=8,
                vocab=320, base_width=None, optimizer="adamw", out_dir=None):
    """Mean |coordinate| of each layer's output after each of `steps` steps on one batch, per width, under SP and
    muP (base: the smallest width): {param: {layer: (steps, widths)}} over seeds, and the slopes of log size against
    log width. Under muP each curve is flat in width; under SP the later ones grow (Yang et al.)."""
    # At step 0 both parametrisations are flat: each initialises for its width. The difference is the updates: in
    # SP, the change of a layer's output after a step grows with the width, as an update's coordinates all lean the
    # same way and add up over the n_embd inputs; a few steps at a large LR show it. The slope of log size against
    # log width sums it up: 0 is flat, 1 grows like the width.
    # AdamW by default, the optimizer of Tensor Programs V's table; --optimizer=muon checks train_gpt.py's scaling
    # of Muon (its LR / sqrt(m)) the same way.
    base_width = base_width or min(widths)
    cpu = torch.device("cpu")
    out = {}
    for mup in (False, True):
        acc = {}  # {layer: (steps, widths)}, averaged over seeds
        for wi, w in enumerate(widths):
            for seed in range(seeds):
                cfg = tg.Config(
                    n_layer=n_layer,
                    n_head=4,
                    n_embd=w,
                    seq_len=seq_len,
                    mup=mup,
                    base_width=base_width,
                    lr=lr,
                    optimizer=optimizer,
                    seed=seed,
                    # the full LR from the first step, clipping and decay off: nothing hides the update
                    warmup_steps=0,
                    grad_clip=0.0,
                    weight_decay=0.0,
                )
                model = tg.build_model(cfg, vocab, cpu)
                opts = tg.build_optimizers(cfg, model)
                # one batch of random tokens, seen every step: the check is about how big an update is, not about
                # what the model learns, and the same batch at every width keeps the widths comparable
                g = torch.Generator().manual_seed(1000 + seed)
                x = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)  # (B, T + 1): random tokens
                x, y = x[:, :-1], x[:, 1:]  # (B, T) each: the targets are the inputs shifted by one
                for t in range(steps):
                    model(x, y).backward()
                    for o in opts:
                        o.step()
                        o.zero_grad(set_to_none=True)
                    for n, v in activation_sizes(model, x).items():
                        acc.setdefault(n, np.zeros((steps, len(widths))))[t, wi] += v / seeds
        if mup:
            out["muP"] = acc
        else:
            out["SP"] = acc
    log_widths = np.log(np.array(widths, dtype=float))
    slopes = {}
    for param, acc in out.items():
        slopes[param] = {}
        for n, a in acc.items():
            slope, _ = np.polyfit(log_widths, np.log(a[-1]), 1)  # at the last step
            slopes[param][n] = float(slope)
    if out_dir:
        plot_coord_check(out_dir, widths, out, slopes, lr, optimizer)
    return out, slopes

def plot_coord_check(out_dir, widths, out, slopes, lr, optimizer):
    """coord_check.png: a row per parametrisation, a panel per step, a line per layer against width."""
    # How to read it: in the SP row the lines tilt upward from the first step on, most for the logits; in the muP
    # row they stay level across widths (a little wobble from the seeds is noise, a steady tilt is a bug).
    import matplotlib.figure
    steps = next(iter(out["SP"].values())).shape[0]
    fig = matplotlib.figure.Figure(figsize=(3.2 * steps, 6.4), layout="tight")
    axes = fig.subplots(2, steps, sharey="row", squeeze=False)
    for r, param in enumerate(("SP", "muP")):
        for t in range(steps):
            ax = axes[r, t]
            for n, a in out[param].items():
                ax.plot(widths, a[t], marker="o", label=n)
            ax.set(xscale="log", yscale="log", title=f"{param}, after step {t + 1}")
            ax.set_xticks(widths, [str(w) for w in widths])
            ax.xaxis.set_minor_locator(matplotlib.ticker.NullLocator())
            if t == 0:
                ax.set_ylabel("mean |activation|")
            if r == 1:
                ax.set_xlabel("width n_embd")
    axes[0, 0].legend(fontsize=7)
    fig.suptitle(f"Coordinate check ({optimizer}, lr {lr:g}): logits slope vs width at the last step "
                 f"SP {slopes['SP']['logits']:+.2f}, muP {slopes['muP']['logits']:+.2f} (flat is 0)")
    make_dir(out_dir)
    fig.savefig(os.path.join(out_dir, "coord_check.png"), dpi=110)

def cmd_coord_check(args):
    """Run coord_check on CPU and print each layer's slope against width, under SP and muP."""
    if args.steps < 1 or args.seeds < 1:
        die(f"need --steps >= 1 and --seeds >= 1, got {args.steps} and {args.seeds}")
    widths = [int(w) for w in parse_floats(args.widths, "--widths", "64,128")]
    make_dir(args.out_dir)  # now, not after the runs
    _, slopes = coord_check(
        widths,
        args.steps,
        args.lr,
        args.seeds,
        optimizer=args.optimizer,
        out_dir=args.out_dir,
    )
    print(f"slope of log mean |activation| against log width after step {args.steps} (0 = flat, 1 = grows like "
          f"width):")
    for param, s in slopes.items():
        print(f"  {param:4s} " + " | ".join(f"{n} {v:+.2f}" for n, v in s.items()))
    print(f"wrote {args.out_dir}/coord_check.png")

def cmd_lr_transfer(args, extra):
    """Train every (parametrisation, width, LR) once; print each width's best LR and plot loss against LR."""
    # The same LR grid at every width, in SP and in muP, each run a full (short) training run. Read the plot by its
    # minima: in SP the best LR falls as the width grows, so a small model's tuned LR is too high for a large one;
    # in muP the minima line up, and the LR found at the smallest width is the one to use at all of them.
    cfg = base_config(args, extra)
    vocab = vocab_of(cfg)
    widths = [int(w) for w in parse_floats(args.widths, "--widths", "64,128")]
    lrs = parse_floats(args.lrs, "--lrs")
    runs = []
    for mup, w, lr in itertools.product((False, True), widths, lrs):
        over = dict(
            n_embd=w,
            n_head=args.n_head,
            n_layer=args.n_layer,
            lr=lr,
            mup=mup,
            base_width=min(widths),
            max_steps=args.steps,
            warmup_steps=max(1, args.steps // 10),
        )
        params = matmul_params(dataclasses.replace(cfg, **over), vocab)
        runs.append((f"{'mup' if mup else 'sp'}_d{w}_lr{lr:.0e}", over, {"budget": "", "params": params}))
    make_dir(args.out_dir)
    tsv = os.path.join(args.out_dir, "lr_transfer.tsv")
    failed, stopped = run_rows(runs, cfg, args.out_dir, tsv)
    if stopped:
        return None
    res = {}  # {param: {width: {lr: val loss}}}
    for r in read_tsv(tsv):
        param = "muP" if r["mup"] == "1" else "SP"
        by_w = res.setdefault(param, {})
        by_w.setdefault(int(r["n_embd"]), {})[float(r["lr"])] = float(r["val_loss"])
    for param, by_w in res.items():
        best = {w: min(d, key=d.get) for w, d in sorted(by_w.items())}
        listed = ", ".join(f"{w}: {lr:.2g} ({by_w[w][lr]:.4f})" for w, lr in best.items())
        print(f"{param:4s} best LR per width: {listed}")
    plot_lr_transfer(args.out_dir, res)
    print(f"wrote {args.out_dir}/lr_transfer.png")
    if failed:
        die(f"{failed} run(s) failed; run the same command again to retry them")
    return res

def plot_lr_transfer(out_dir, res):
    """lr_transfer.png: val loss against LR, a line per width, SP on the left and muP on the right."""
    # How to read it: a circle marks each width's best LR. In SP the circles move to lower LRs as the width grows;
    # in muP they stand in one column.
    import matplotlib.figure
    fig = matplotlib.figure.Figure(figsize=(11, 4.2), layout="tight")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, param in zip(axes, ("SP", "muP")):
        by_w = res.get(param, {})
        for w, d in sorted(by_w.items()):
            lr = sorted(d)
            line, = ax.plot(lr, [d[v] for v in lr], marker="o", label=f"width {w}")
            b = min(d, key=d.get)
            ax.scatter([b], [d[b]], s=120, facecolors="none", edgecolors=line.get_color())
        ax.set(xscale="log", xlabel="learning rate", title=f"{param}: val loss against LR (circle: best)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("val loss")
    fig.savefig(os.path.join(out_dir, "lr_transfer.png"), dpi=110)

def read_metrics(path):
    """The step records of a metrics.jsonl, and whether its last line was cut off (a killed run's)."""
    if not os.path.exists(path):
        die(f"{path} not found: pass the out_dir of a run")
    try:
        *whole, cut = open(path, encoding="utf-8").read().split("\n")
        rows = [json.loads(line) for line in whole if line.strip()]
    except ValueError as e:  # not JSON lines, or not UTF-8
        die(f"{path}: not a metrics.jsonl ({e}); pass the out_dir of a train_*.py run")
    return [r for r in rows if isinstance(r, dict) and "step" in r], bool(cut.strip())

def cmd_compare(args):
    """Runs' metrics.jsonl (any trainer's) against step: a colour a run, a line style a metric."""
    # every trainer writes metrics.jsonl, a JSON object a line, and the records of its steps carry the step, so
    # runs of any trainers line up on one step axis
    import matplotlib.figure
    fig = matplotlib.figure.Figure(figsize=(6.4, 4), layout="tight")
    ax = fig.subplots()
    metrics = (args.metric or "loss,val_loss").split(",")
    for (i, run), (j, metric) in itertools.product(enumerate(args.runs), enumerate(metrics)):
        path = os.path.join(run, "metrics.jsonl")
        rows, cut = read_metrics(path)
        if cut:
            print(f"warning: {path}: its last line is cut off (a killed run's); skipped")
        number = (int, float)
        pts = [(r["step"], r[metric]) for r in rows if isinstance(r.get(metric), number)]
        if not pts and (args.metric or j == 0):  # the default's val loss may be missing (a benchmark has none)
            keys = {k for r in rows for k, v in r.items() if isinstance(v, number)}
            keys = sorted(keys - {"step"})
            die(f"{path} has no '{metric}'; pick --metric from {', '.join(keys)}")
        if not pts:
            continue
        label = os.path.basename(os.path.normpath(run))
        if len(metrics) > 1:
            label += f" {metric}"
        style = ("-", "--", ":", "-.")[j % 4]
        ax.plot(*zip(*pts), style, color=f"C{i % 10}", marker=".", markersize=4, label=label)
        print(f"{run}: {metric} {pts[-1][1]:.4f} at step {pts[-1][0]}")
    ax.set(xlabel="step", ylabel=", ".join(metrics), title=os.path.basename(args.out))
    ax.legend(fontsize=8)
    try:
        os.makedirs(os.path.dirname(args.out) or ".", exist_ok=True)
        fig.savefig(args.out, dpi=110)
    except (OSError, ValueError) as e:  # a file where a folder goes; a format matplotlib lacks
        die(f"cannot write --out={args.out} ({getattr(e, 'strerror', None) or e}); pass a .png you can write")
    print(f"wrote {args.out}")

# -----------------------------------------------------------------------------
# Sharpness: the top Hessian eigenvalue of the loss at a checkpoint
#
# Cohen et al. 2021 ("Edge of Stability"): under gradient descent at LR eta, the sharpness climbs until it reaches
# 2 / eta and then hovers there, where a quadratic model says training should diverge. Measuring it at checkpoints
# shows how near a run trains to that edge, and how warmup, the LR and the batch size move it. Adam reaches an edge
# too, on the Hessian as its preconditioner sees it (Cohen et al. 2022); this measures the raw one, whose trend along
# a run still shows whether the run sharpens.

def global_norm(ts):
    """The L2 norm of a list of tensors taken as one vector."""
    return math.sqrt(sum(t.float().square().sum().item() for t in ts))

def sharpness(loss_fn, params, iters=10, seed=0):
    """Top eigenvalue of the loss Hessian (the "sharpness" of Cohen et al. 2021) by power iteration. Each
    Hessian-vector product is a central difference of gradients, Hv = (g(w + e v) - g(w - e v)) / 2e, so the fused
    loss needs no double backward (it has none). loss_fn() returns the loss; params and their .grad end unchanged."""
    # Power iteration: v <- Hv / |Hv| turns v toward the eigenvector of the largest |eigenvalue|, and v.Hv with
    # |v| = 1 (the Rayleigh quotient) is then that eigenvalue. The central difference is off by O(e^2); e is 1e-3
    # of the weights' norm, small against them and large against bf16's rounding (the model is fp32 here).
    w0 = [p.detach().clone() for p in params]
    # its own generator: the global RNG stays untouched
    gen = torch.Generator(params[0].device).manual_seed(seed)
    v = [torch.randn(p.shape, device=p.device, generator=gen) for p in params]
    eps = 1e-3 * global_norm(w0)
    lam = 0.0
    for _ in range(iters):
        n = global_norm(v)
        v = [t / n for t in v]
        grads = []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for p, w, t in zip(params, w0, v):
                    p.copy_(w + sign * eps * t)
            grads.append([g.float() for g in torch.autograd.grad(loss_fn(), params)])
        hv = [(a - b) / (2 * eps) for a, b in zip(*grads)]
        lam = sum((a * b).sum().item() for a, b in zip(v, hv))  # the Rayleigh quotient v.Hv, |v| = 1
        v = hv
    with torch.no_grad():
        for p, w in zip(params, w0):
            p.copy_(w)
    return lam

def cmd_sharpness(args):
    """Top Hessian eigenvalue of a checkpoint's training loss, one per batch: its spread is the batches'."""
    if min(args.batches, args.iters) < 1:
        die("--batches and --iters must be at least 1")
    # The Hessian of the training loss at the checkpoint's weights, on batches read from the split's start; each batch
    # gives its own estimate, and how far they spread says how much one batch can be trusted.
    device = tg.setup_dist(args.device)[2]
    # fp32: a finite difference of bf16 gradients is noise
    model, tok, step, path = ft.load_model(args.ckpt, device)
    c = model.cfg
    data_dir = args.data_dir or c.data_dir
    B = args.batch_size or c.batch_size
    meta = tg.load_meta(data_dir)
    if meta["tokenizer"] != tok["tokenizer"] or meta["vocab_size"] > model.vocab_size:
        die(f"{data_dir} holds {meta['tokenizer']} tokens ({meta['vocab_size']}) but {path} reads {tok['tokenizer']} "
            f"tokens ({model.vocab_size}); pass the data it was trained on with --data_dir")
    loader = tg.TokenLoader(
        tg.find_shards(data_dir, args.split),
        B,
        c.seq_len,
        0,  # rank 0 of 1 process
        1,
        device,
        vocab_size=model.vocab_size,
    )
    lams = []
    for i in range(args.batches):
        x, y = loader.next()  # (B, T) each
        params = list(model.parameters())
        lams.append(sharpness(lambda: model(x, y, c.z_loss), params, args.iters, seed=i))
        print(f"sharpness of {path} (step {step}) | {args.split} batch {i + 1}/{args.batches} of {B}x{c.seq_len} "
              f"tokens | top Hessian eigenvalue {lams[-1]:.4g}")
    mean = sum(lams) / len(lams)
    print(f"mean {mean:.4g} over {len(lams)} batch(es); for plain gradient descent 2/lr = {2 / c.lr:.4g} is the edge "
          f"of stability (Adam's bound is on the preconditioned Hessian, which this does not compute)")
    return {"sharpness": mean, "per_batch": lams, "step": step}

# -----------------------------------------------------------------------------
# Entry point: a subcommand per job, each with only the flags it reads

class Parser(argparse.ArgumentParser):
    """argparse with scaling.py's one-line errors."""

    def error(self, message):
        """One line, as every script of the suite fails; argparse's own prints the usage over several lines."""
        die(f"{message} (see python scaling.py -h)")

def main(argv=None):
    """Parse argv (sys.argv when None) and run the subcommand; returns its result."""
    parser = Parser(
        prog="scaling.py",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        allow_abbrev=False,
    )
    sub = parser.add_subparsers(dest="command", required=True)
    # allow_abbrev=False everywhere: a typo such as --flop must fail, not silently become --flops

    p = sweep = sub.add_parser(
        "sweep",
        help="train a grid of runs (IsoFLOP by default); resumable",
        allow_abbrev=False,
    )
    p.add_argument("--flops", default="3e11,1e12,3e12",
                   help="compute budgets C of the IsoFLOP profiles")
    p.add_argument("--sizes", type=int, default=5,
                   help="model sizes per budget, spread over 16x in N")
    p.add_argument("--ratio", type=float, default=20.0,
                   help="tokens per parameter at the centre of each profile "
                   "(Chinchilla: about 20 for BPE tokens; bytes carry less each, so more)")
    p.add_argument("--min_steps", type=int, default=100,
                   help="leave out models that would train fewer steps")
    p.add_argument("--models", default="",
                   help="a grid instead: LAYERSxWIDTH,... (e.g. 2x64,4x128) with --tokens")
    p.add_argument("--tokens", default="",
                   help="a grid instead: token budgets D (e.g. 1e6,4e6) with --models")
    p.add_argument("--lr", type=float, default=4e-3,
                   help="peak LR of every run (the LR of WORKSHOP.md's and docs/scaling.md's sweeps; "
                   "train_gpt.py's own default, 8e-3, is for its 64-wide model)")

    p = transfer = sub.add_parser(
        "lr_transfer",
        help="loss vs LR at several widths, SP and muP",
        allow_abbrev=False,
    )
    p.add_argument("--widths", default="32,64,128,256",
                   help="n_embd values; the smallest is muP's base width")
    p.add_argument("--lrs", default="1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2",
                   help="peak learning rates")
    p.add_argument("--steps", type=int, default=200,
                   help="optimizer steps per run")
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_head", type=int, default=4,
                   help="fixed, so the head dim grows with width (muP's 1/d)")
    # the two subcommands that train share train_gpt.py's data and device flags
    for p, out in ((sweep, "out/scaling"), (transfer, "out/lr_transfer")):
        p.add_argument("--out_dir", default=out)
        p.add_argument("--data_dir", default=tg.Config.data_dir,
                       help="token shards from prepare_data.py")
        p.add_argument("--device", default="cpu",
                       help="cpu, or auto for the trainer's choice")

    p = sub.add_parser(
        "fit",
        help="fit L(N, D) to a sweep's runs, with intervals and plots",
        allow_abbrev=False,
    )
    p.add_argument("--out_dir", default="out/scaling",
                   help="where sweep.tsv is, and fit.json and the plots go")
    p.add_argument("--tsv", default="",
                   help="sweep results to fit (default OUT_DIR/sweep.tsv)")
    p.add_argument("--param_grid", default="",
                   help="initial values: a JSON file or JSON {name: [values]} for "
                   "e, a, b (logs of E, A, B), alpha, beta (default: Hoffmann et al.'s 4,500 starts)")
    p.add_argument("--bootstrap", type=int, default=200,
                   help="refits on resampled runs for the intervals; 0 = off")
    p.add_argument("--delta", type=float, default=1e-3,
                   help="Huber delta on log residuals")

    p = sub.add_parser(
        "plan",
        help="compute-optimal N, D, loss and batch size for a budget",
        allow_abbrev=False,
    )
    p.add_argument("--flops", required=True,
                   help="the compute budget C in FLOPs, e.g. 1e14")
    p.add_argument("--out_dir", default="out/scaling",
                   help="where fit.json is")
    p.add_argument("--published", choices=sorted(PUBLISHED),
                   help="plan from a published fit instead of yours")
    p.add_argument("--force", action="store_true",
                   help="plan beyond twice the fitted compute anyway (loud warning)")

    p = sub.add_parser(
        "coord_check",
        help="muP coordinate check: activation size against width (a plot)",
        allow_abbrev=False,
    )
    p.add_argument("--widths", default="64,128,256,512",
                   help="n_embd values; the smallest is muP's base width")
    p.add_argument("--steps", type=int, default=4,
                   help="optimizer steps to follow")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seeds", type=int, default=3,
                   help="runs averaged per width")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"))
    p.add_argument("--out_dir", default="out/scaling")

    p = sub.add_parser(
        "sharpness",
        help="top Hessian eigenvalue of the loss at a checkpoint",
        allow_abbrev=False,
    )
    p.add_argument("--ckpt", required=True,
                   help="a checkpoint, or a run's out_dir (its newest checkpoint)")
    p.add_argument("--data_dir", default="",
                   help="token shards (default: the checkpoint's own --data_dir)")
    p.add_argument("--split", default="train", choices=("train", "val"),
                   help="the loss trained on, or held out")
    p.add_argument("--batches", type=int, default=1,
                   help="batches, one estimate each, read from the split's start")
    p.add_argument("--batch_size", type=int, default=0,
                   help="sequences per batch (default: the checkpoint's)")
    p.add_argument("--iters", type=int, default=20,
                   help="power iterations, two forward-backward passes each")
    p.add_argument("--device", default="cpu",
                   help="cpu, cuda, or auto for the trainer's choice")

    p = sub.add_parser(
        "compare",
        help="metrics of several runs against step, in one plot",
        allow_abbrev=False,
    )
    p.add_argument("runs", nargs="+", metavar="OUT_DIR",
                   help="the out_dirs of train_gpt/vit/diffusion.py runs")
    p.add_argument("--metric", default="",
                   help="keys of metrics.jsonl, comma-separated: loss, val_loss, val_acc, ... "
                   "(default: loss and, where a run has it, val_loss)")
    p.add_argument("--out", default="out/compare.png")

    # sweep and lr_transfer pass the flags they do not know on to train_gpt.py's Config; the rest take none
    args, extra = parser.parse_known_args(argv)
    trains = args.command in ("sweep", "lr_transfer")
    if extra and not trains:
        die(f"unrecognized arguments: {' '.join(extra)} (see python scaling.py {args.command} -h)")
    # looked up when called, so a test can stand in for one
    cmd = globals()[f"cmd_{args.command}"]
    if trains:
        return cmd(args, extra)
    return cmd(args)

if __name__ == "__main__":
    main()
