"""
scaling.py: scaling laws for train_gpt.py, from a sweep of small runs to a compute-optimal plan, muP checks, and
tools that read finished runs (their curves, the sharpness of a checkpoint).

  python scaling.py sweep                       # IsoFLOP profiles: 5 model sizes at each of 3e11, 1e12, 3e12 FLOPs
  python scaling.py fit                         # L(N, D) = E + A/N^alpha + B/D^beta, intervals, plots
  python scaling.py plan --flops=1e14           # compute-optimal N, D, loss and batch size for a budget
  python scaling.py coord_check                 # muP: activation size against width, flat under muP (a plot)
  python scaling.py lr_transfer                 # loss against LR at several widths, standard vs muP (a plot)
  python scaling.py compare out/a out/b --metric=val_loss   # any runs' metrics against step, one plot
  python scaling.py sharpness --ckpt=out/gpt --batches=4  # top Hessian eigenvalue of the loss at a checkpoint
  python scaling.py sweep --flops=1e12,1e13 --sizes=7 --optimizer=adamw  # any train_gpt.py flag passes through

`sweep` runs train_gpt.py in this process, once per (N, D), each in its own out_dir, and appends a row to a TSV as
each run ends; run the same command again and it goes on where it stopped. N counts the parameters that do a matmul
per token (all but the input embedding, whose lookup costs nothing), D the training tokens, and C = 6 N D.
`fit` follows Hoffmann et al. 2022 ("Chinchilla"), Approach 3: L-BFGS on a Huber loss (delta 1e-3) of log-space
residuals from every start of a grid, keeping the best; bootstrap intervals over runs; and Approach 2 (a parabola
through each IsoFLOP profile) as a cross-check. `plan` uses the closed form of the fitted law's optimum.
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

import train_gpt as tg

CHINCHILLA = dict(E=1.69, A=406.4, B=410.7, alpha=0.34, beta=0.28)  # Hoffmann et al. 2022, Approach 3
BESIROGLU = dict(E=1.82, A=482.0, B=2085.4, alpha=0.348, beta=0.366)  # the refit of Besiroglu et al. 2024
PUBLISHED = {"chinchilla": CHINCHILLA, "besiroglu": BESIROGLU}
# Hoffmann et al.'s grid of initial values (4,500 starts); e, a, b are the logs of E, A, B
PARAM_GRID = dict(e=[-1, -0.5, 0, 0.5, 1], a=[0, 5, 10, 15, 20, 25], b=[0, 5, 10, 15, 20, 25],
                  alpha=[0, 0.5, 1, 1.5, 2], beta=[0, 0.5, 1, 1.5, 2])
NAMES = ("e", "a", "b", "alpha", "beta")  # the fitted vector: E = exp(e), A = exp(a), B = exp(b)
# model shapes of a sweep, (n_layer, n_embd), growing in depth and width together like a family of real models
LADDER = [(1, 16), (1, 24), (1, 32), (2, 32), (2, 48), (2, 64), (3, 64), (3, 96), (4, 96), (4, 128), (4, 160),
          (5, 192), (6, 192), (6, 256), (8, 256), (8, 320), (8, 384), (10, 448), (12, 512), (12, 640), (12, 768)]
# Chinchilla's own batch (Hoffmann et al., Table 4: 1.5M tokens at 5.76e23 FLOPs) anchors a plan from a published fit
BATCH_ANCHOR = (5.76e23, 1.5e6)
TSV_COLS = ("name", "budget", "n_layer", "n_embd", "n_head", "params", "tokens", "flops", "steps", "lr", "mup",
            "val_loss", "val_bpb", "train_loss", "train_time", "tokens_per_step")

def die(msg):
    """Stop with a one-line error and a non-zero exit."""
    raise SystemExit(f"scaling.py: error: {msg}")

def warn(msg):
    print(f"WARNING: {msg}", file=sys.stderr)

# -----------------------------------------------------------------------------
# Runs: one train_gpt.py run per row, appended to a TSV, so a sweep resumes where it stopped

def head_count(n_embd):
    """Heads for a ladder width: 32-dim heads, fewer for the smallest widths."""
    return max(1, n_embd // 32)

def matmul_params(cfg, vocab):
    """N: the parameters that do a matmul per token, all but the input embedding (a lookup); built on meta, free."""
    with torch.device("meta"):
        model = tg.GPT(cfg, vocab)
    return sum(p.numel() for p in model.parameters()) - model.wte.weight.numel()

def read_tsv(path):
    """Rows of a TSV with a header as dicts of strings ([] if there is no file)."""
    lines = [ln.rstrip("\n").split("\t") for ln in open(path) if ln.strip()] if os.path.exists(path) else []
    return [dict(zip(lines[0], r)) for r in lines[1:]]

def append_tsv(path, row):
    """Append one row (header first if the file is new), flushed to disk before the next run starts."""
    new = not os.path.exists(path) or os.path.getsize(path) == 0
    with open(path, "a") as f:
        if new:
            f.write("\t".join(TSV_COLS) + "\n")
        f.write("\t".join(str(row.get(c, "")) for c in TSV_COLS) + "\n")
        f.flush()
        os.fsync(f.fileno())

def run_one(cfg, log_path):
    """train_gpt.main(cfg) with its output in log_path; resumes an interrupted run from its newest checkpoint."""
    cfg.resume = bool(tg.list_checkpoints(cfg.out_dir))
    os.makedirs(cfg.out_dir, exist_ok=True)
    with open(log_path, "a") as log, contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
        return tg.main(cfg)

def run_rows(plan, base, out_dir, tsv):
    """Train each (name, overrides, extra) of plan not yet in tsv; returns (failed runs, stopped by a signal)."""
    done = {r["name"] for r in read_tsv(tsv)}
    todo = [p for p in plan if p[0] not in done]
    print(f"{len(plan)} runs, {len(plan) - len(todo)} already in {tsv}, {len(todo)} to go")
    failed, t0, work = 0, time.time(), [e["params"] * o["max_steps"] for _, o, e in todo]  # work ~ 6ND per run
    for i, (name, over, extra) in enumerate(todo):
        cfg = dataclasses.replace(base, **over, out_dir=os.path.join(out_dir, "runs", name))
        t1 = time.time()
        try:
            res = run_one(cfg, os.path.join(cfg.out_dir + ".log"))
        except SystemExit as e:  # train_gpt.py's die(): a bad config or data stops this run, not the sweep
            failed += 1
            print(f"[{i + 1}/{len(todo)}] {name}: FAILED: {e} (log in {cfg.out_dir}.log)")
            continue
        if res.get("preempted"):  # Ctrl-C or SIGTERM: the run saved a checkpoint; stop the sweep too
            print(f"[{i + 1}/{len(todo)}] {name}: stopped at step {res['steps']}; run the same command again to "
                  f"continue (this run resumes from its checkpoint)")
            return failed, True
        row = {**extra, "name": name, "n_layer": cfg.n_layer, "n_embd": cfg.n_embd, "n_head": cfg.n_head,
               "tokens": res["tokens"], "steps": res["steps"], "lr": cfg.lr, "mup": int(cfg.mup),
               "val_loss": f"{res['val_loss']:.5f}", "val_bpb": f"{res.get('val_bpb', float('nan')):.5f}",
               "train_loss": f"{res['train_loss']:.5f}", "train_time": f"{res['train_time']:.1f}",
               "tokens_per_step": res["tokens"] // max(res["steps"], 1)}
        row["flops"] = f"{6 * int(row['params']) * res['tokens']:.4g}"
        append_tsv(tsv, row)
        eta = (time.time() - t0) / sum(work[:i + 1]) * sum(work[i + 1:])
        print(f"[{i + 1}/{len(todo)}] {name}: N {int(row['params']):,} D {res['tokens']:,} | val loss "
              f"{res['val_loss']:.4f} | {time.time() - t1:.0f} s | about {eta / 60:.0f} min left")
    return failed, False

def base_config(args, extra_flags):
    """train_gpt.py's Config for the runs: quiet, no mid-run evals or samples, any extra train_gpt.py flag applied."""
    cfg = tg.parse_args(tg.Config, extra_flags)  # unknown flags fail here, with the nearest valid name
    over = dict(data_dir=args.data_dir, time_budget=0.0, tokens="", eval_every=0, sample_tokens=0, log_every=50,
                device="cpu" if args.device == "cpu" else cfg.device)
    given = {a.split("=")[0].lstrip("-") for a in extra_flags if a.startswith("--")}
    return dataclasses.replace(cfg, **{k: v for k, v in over.items() if k not in given})

def vocab_of(cfg):
    """The vocabulary train_gpt.py will use for cfg's data (the data is prepared first if it is the default)."""
    tg.prepare_default_data(cfg, 0, 1, *tg.DEFAULT_DATA)
    return cfg.vocab_size or tg.load_meta(cfg.data_dir)["vocab_size"]

def isoflop_plan(budgets, n_sizes, cfg, vocab, ratio=20.0, min_steps=100):
    """Per budget C, n_sizes ladder models spread evenly in log N over [N0 / 4, 4 N0] around the guess N0 =
    sqrt(C / 6 ratio) (ratio tokens per parameter), each trained for D = C / 6N tokens, and none for fewer than
    min_steps steps (a model trained for too few steps is limited by optimisation, not by size or data).
    Returns [(name, overrides, extra)]."""
    tps = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    shapes = [(matmul_params(dataclasses.replace(cfg, n_layer=L, n_embd=d, n_head=head_count(d), n_kv_head=0), vocab),
               L, d) for L, d in LADDER]
    plan = []
    for C in budgets:
        n0 = math.sqrt(C / (6 * ratio))
        ok = [s for s in shapes if C / (6 * s[0]) / tps >= min_steps]
        if len(ok) < 3:
            die(f"budget {C:.3g} FLOPs leaves fewer than 3 ladder models with {min_steps} steps of {tps} tokens; "
                f"raise --flops or lower --batch_size")
        picked = []
        for target in np.exp(np.linspace(math.log(n0 / 4), math.log(n0 * 4), n_sizes)):
            best = min(ok, key=lambda s: abs(math.log(s[0] / target)))
            if best not in picked:
                picked.append(best)
        for n, L, d in picked:
            steps = max(1, round(C / (6 * n) / tps))
            over = dict(n_layer=L, n_embd=d, n_head=head_count(d), n_kv_head=0, max_steps=steps,
                        warmup_steps=max(1, min(cfg.warmup_steps, steps // 10)))
            plan.append((f"C{C:.0e}_L{L}_d{d}".replace("+", ""), over, {"budget": f"{C:.4g}", "params": n}))
    return plan

def grid_plan(models, tokens, cfg, vocab):
    """A user's grid: every (n_layer x n_embd) model of --models for every token budget of --tokens."""
    tps = cfg.batch_size * cfg.seq_len * cfg.grad_accum
    plan = []
    for m, D in itertools.product(models, tokens):
        try:
            L, d = map(int, m.lower().split("x"))
        except ValueError:
            die(f"--models: {m!r} is not LAYERSxWIDTH, e.g. 4x128")
        steps = max(1, round(D / tps))
        over = dict(n_layer=L, n_embd=d, n_head=head_count(d), n_kv_head=0, max_steps=steps,
                    warmup_steps=max(1, min(cfg.warmup_steps, steps // 10)))
        params = matmul_params(dataclasses.replace(cfg, **over), vocab)
        plan.append((f"D{D:.0e}_L{L}_d{d}".replace("+", ""), over, {"budget": "", "params": params}))
    return plan

def cmd_sweep(args, extra):
    if args.sizes < 1 or not 0 < args.ratio < math.inf or not 0 < args.lr < math.inf:
        die(f"need --sizes >= 1, --ratio > 0 and --lr > 0, got {args.sizes}, {args.ratio} and {args.lr}")
    # the sweep's own LR, that of the sweeps in the docs: train_gpt.py's default (8e-3) was tuned for its 64-wide
    # model in 240 s, and at it the tiny AdamW runs of tests/test_scaling.py fit 7x worse (log residual 0.25)
    cfg = dataclasses.replace(base_config(args, extra), lr=args.lr)
    vocab = vocab_of(cfg)
    if args.models or args.tokens:
        if not (args.models and args.tokens):
            die("a grid needs both --models (e.g. 2x64,4x128) and --tokens (e.g. 1e6,4e6)")
        plan = grid_plan(args.models.split(","), parse_floats(args.tokens, "--tokens"), cfg, vocab)
    else:
        plan = isoflop_plan(parse_floats(args.flops, "--flops"), args.sizes, cfg, vocab, args.ratio, args.min_steps)
    total = sum(6 * e["params"] * o["max_steps"] * cfg.batch_size * cfg.seq_len * cfg.grad_accum for _, o, e in plan)
    print(f"sweep: {len(plan)} runs, {total:.3g} FLOPs (6ND) in all, into {args.out_dir}")
    os.makedirs(args.out_dir, exist_ok=True)
    failed, stopped = run_rows(plan, cfg, args.out_dir, os.path.join(args.out_dir, "sweep.tsv"))
    if stopped:
        return
    if failed:
        die(f"{failed} run(s) failed; see their logs, fix, and run the same command again (finished runs are kept)")
    print(f"done: next, python scaling.py fit --out_dir={args.out_dir}")

def parse_floats(s, flag, example="1e12,3e12"):
    try:
        vals = [float(v) for v in s.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or not all(0 < v < math.inf for v in vals):  # nan is not
        die(f"{flag}={s!r} is not a comma-separated list of positive numbers, e.g. {flag}={example}")
    return vals

# -----------------------------------------------------------------------------
# Fit: L(N, D) = E + A / N^alpha + B / D^beta (Hoffmann et al. 2022, Approach 3)

def predict_log(theta, logN, logD):
    """log L of the law for theta (..., 5) = (e, a, b, alpha, beta) at log N, log D (n,): shape (..., n)."""
    e, a, b, al, be = theta.split(1, dim=-1)  # each (..., 1)
    return torch.logsumexp(torch.stack([a - al * logN, b - be * logD, e.expand_as(a - al * logN)]), dim=0)

def huber(r, delta):
    """Huber loss: quadratic within delta, linear beyond, so a few bad runs cannot dominate the fit."""
    a = r.abs()
    return torch.where(a <= delta, 0.5 * r * r, delta * (a - 0.5 * delta))

def objective(theta, logN, logD, logL, delta, w=None):
    """Sum over runs (weighted by w, the bootstrap counts) of Huber(log L_pred - log L); theta (K, 5) -> (K,)."""
    h = huber(predict_log(theta, logN, logD) - logL, delta)
    return (h * w).sum(-1) if w is not None else h.sum(-1)

def lbfgs(f, x, iters=500, memory=10, tol=1e-12):
    """Minimise each row of x (K, P) independently with L-BFGS and a backtracking (Armijo) line search, all rows
    at once: f maps (K, P) to (K,). The two-loop recursion of Nocedal & Wright, Algorithm 7.4, batched; rows that
    have converged drop out. Returns (x, f(x))."""
    def value_grad(x):
        x = x.detach().requires_grad_(True)
        v = f(x)
        return v.detach(), torch.autograd.grad(v.sum(), x)[0]
    x = x.clone()
    fx, g = value_grad(x)
    S, Y = torch.zeros((memory, *x.shape), dtype=x.dtype), torch.zeros((memory, *x.shape), dtype=x.dtype)
    idx = torch.arange(x.shape[0])  # the rows still moving
    for it in range(iters):
        xi, fi, gi, s_, y_ = x[idx], fx[idx], g[idx], S[:, idx], Y[:, idx]
        sy = (s_ * y_).sum(-1, keepdim=True)  # (memory, k, 1); 0 for a pair not yet filled or skipped
        rho = torch.where(sy > 1e-20, 1 / sy.clamp_min(1e-20), torch.zeros_like(sy))
        q, al = gi.clone(), [None] * memory
        order = [(it - 1 - j) % memory for j in range(min(it, memory))]  # newest pair first
        for j in order:
            al[j] = rho[j] * (s_[j] * q).sum(-1, keepdim=True)
            q = q - al[j] * y_[j]
        if order:  # scale by s.y / y.y of the newest pair: a step of about the right length at once
            j = order[0]
            yy = (y_[j] * y_[j]).sum(-1, keepdim=True)
            q = q * torch.where(sy[j] > 1e-20, sy[j] / yy.clamp_min(1e-30), torch.ones_like(yy))
        for j in reversed(order):
            q = q + s_[j] * (al[j] - rho[j] * (y_[j] * q).sum(-1, keepdim=True))
        d = -q
        slope = (gi * d).sum(-1)
        bad = ~(slope < 0)  # not a descent direction (or NaN): fall back to steepest descent
        d[bad] = -gi[bad]
        slope = (gi * d).sum(-1)
        t = torch.ones(len(idx), dtype=x.dtype)
        for _ in range(40):  # halve each row's step until it decreases f enough (Armijo, c = 1e-4)
            fn = f(xi + t[:, None] * d)
            ok = torch.isfinite(fn) & (fn <= fi + 1e-4 * t * slope)
            if ok.all():
                break
            t = torch.where(ok, t, t / 2)
        xn = torch.where(ok[:, None], xi + t[:, None] * d, xi)
        fn, gn = value_grad(xn)
        S[it % memory, idx], Y[it % memory, idx] = xn - xi, gn - gi
        x[idx], fx[idx], g[idx] = xn, fn, gn
        moving = ok & ((fi - fn).abs() > tol * (1 + fi.abs())) & (gn.abs().amax(-1) > 1e-10)
        idx = idx[moving]
        if len(idx) == 0:
            break
    return x.detach(), fx

def grid_starts(param_grid):
    """Every combination of the grid's initial values, as a (K, 5) float64 tensor in NAMES order."""
    return torch.tensor(list(itertools.product(*(param_grid[k] for k in NAMES))), dtype=torch.float64)

def fit_law(N, D, L, param_grid=None, delta=1e-3, starts=None, w=None):
    """Fit (E, A, B, alpha, beta) to runs (N, D, loss) from every start; returns (params dict, theta, all finals)."""
    logN, logD, logL = torch.as_tensor(np.log([N, D, L]), dtype=torch.float64)
    x0 = starts if starts is not None else grid_starts(param_grid or PARAM_GRID)
    w = torch.as_tensor(w, dtype=torch.float64) if w is not None else None
    theta, fx = lbfgs(lambda t: objective(t, logN, logD, logL, delta, w), x0.clone())
    fx = torch.where(torch.isfinite(fx), fx, torch.full_like(fx, float("inf")))
    best = theta[fx.argmin()]
    return params_of(best), best, (theta, fx)

def params_of(theta):
    e, a, b, al, be = theta.tolist()
    ex = lambda v: math.exp(v) if v < 700 else float("inf")  # noqa: E731  (a degenerate fit can run off)
    return dict(E=ex(e), A=ex(a), B=ex(b), alpha=al, beta=be)

def law(p, N, D):
    """L(N, D) of a fit's params."""
    return p["E"] + p["A"] / np.asarray(N, dtype=float) ** p["alpha"] + p["B"] / np.asarray(D, dtype=float) ** p["beta"]

def optimal_allocation(p, C):
    """Closed form of the law's optimum on the compute budget C = 6 N D (Hoffmann et al., eq. 4): (N_opt, D_opt)."""
    al, be = p["alpha"], p["beta"]
    G = (al * p["A"] / (be * p["B"])) ** (1 / (al + be))
    return G * (C / 6) ** (be / (al + be)), (C / 6) ** (al / (al + be)) / G

def isoflop_minima(rows):
    """Approach 2: a parabola in log N through each budget's profile; [(C, N_opt, loss at N_opt, inside?)]."""
    out = []
    for C in sorted({r["budget"] for r in rows if r["budget"]}):
        prof = sorted((r["params"], r["val_loss"]) for r in rows if r["budget"] == C)
        if len({n for n, _ in prof}) < 3:
            continue
        x, y = np.log([n for n, _ in prof]), np.array([l for _, l in prof])
        c2, c1, c0 = np.polyfit(x, y, 2)
        if c2 <= 0:  # no minimum: the profile is monotone or noisy
            out.append((C, float("nan"), float("nan"), False))
            continue
        xm = -c1 / (2 * c2)
        out.append((C, math.exp(xm), c0 + c1 * xm + c2 * xm * xm, bool(x.min() < xm < x.max())))
    return out

def load_runs(path):
    """Finished runs of a sweep TSV: (rows with numbers, arrays N, D, L); runs with a non-finite loss are dropped."""
    rows = []
    try:  # a ValueError too: a file that is not UTF-8 text
        for r in read_tsv(path):
            rows.append(dict(name=r["name"], budget=float(r["budget"]) if r.get("budget") else None,
                             params=float(r["params"]), tokens=float(r["tokens"]), val_loss=float(r["val_loss"]),
                             tokens_per_step=float(r.get("tokens_per_step") or "nan")))
    except (KeyError, ValueError) as e:
        die(f"{path}: a row is not a sweep row ({e}); it needs name, params, tokens and val_loss columns")
    bad = [r["name"] for r in rows if not math.isfinite(r["val_loss"])]
    if bad:
        warn(f"{len(bad)} run(s) with a non-finite loss left out: {', '.join(bad[:5])}")
    rows = [r for r in rows if math.isfinite(r["val_loss"])]
    return rows, *(np.array([r[k] for r in rows]) for k in ("params", "tokens", "val_loss"))

def diagnose(N, D, theta, param_grid, finals, boot):
    """Reasons to distrust a fit: too few runs, an under-determined grid, a fit at the edge of the start grid,
    near-equal optima far apart, wide intervals. Returns a list of one-line warnings."""
    out = []
    if len(N) < 10:
        out.append(f"only {len(N)} runs for 5 parameters: the fit can pass through every point; run 10 or more")
    for name, v in (("model sizes N", N), ("token counts D", D)):
        if len(np.unique(np.round(np.log(v), 3))) < 3:
            out.append(f"fewer than 3 distinct {name}: the law's {'A/alpha' if name[0] == 'm' else 'B/beta'} term is "
                       f"not determined; spread the grid")
    if len(np.unique(np.round(np.log(6 * N * D), 1))) < 2:
        out.append("every run has the same compute: the grid is one IsoFLOP profile and cannot separate E from the "
                   "rest")
    if min(len(param_grid[k]) for k in NAMES) < 2:
        out.append("the start grid has a single value for some parameter: L-BFGS may stop in a local optimum; "
                   "give --param_grid several values each")
    for i, k in enumerate(NAMES):
        lo, hi = min(param_grid[k]), max(param_grid[k])
        if not lo - 1e-9 <= float(theta[i]) <= hi + 1e-9:
            out.append(f"fitted {k} = {float(theta[i]):.3g} lies outside the start grid [{lo}, {hi}]; widen "
                       f"--param_grid so that the optimum is bracketed")
    th, fx = finals
    near = th[(fx - fx.min()) <= 1e-6 * max(float(fx.min()), 1e-12) + 1e-12]
    spread = (near[:, 3:] - theta[3:]).abs().max().item() if len(near) > 1 else 0.0
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
    if n_boot <= 0:
        return {}
    th, fx = finals
    starts = torch.cat([theta[None], th[torch.argsort(fx)[:n_starts]]])
    rng = np.random.default_rng(seed)
    counts = lambda: np.bincount(rng.integers(0, len(N), len(N)), minlength=len(N)).astype(float)  # noqa: E731
    rows = [fit_law(N, D, L, delta=delta, starts=starts, w=counts())[0] for _ in range(n_boot)]
    return {k: tuple(float(v) for v in np.percentile([r[k] for r in rows], [2.5, 97.5])) for k in rows[0]}

def read_param_grid(spec):
    """--param_grid: a JSON file or inline JSON of {"e": [..], "a": [..], "b": [..], "alpha": [..], "beta": [..]}."""
    if not spec:
        return PARAM_GRID
    try:
        grid = json.loads(open(spec).read() if os.path.exists(spec) else spec)
    except (OSError, json.JSONDecodeError) as e:
        die(f"--param_grid={spec!r} is neither a JSON file nor JSON ({e})")
    missing = [k for k in NAMES if not isinstance(grid.get(k), list) or not grid[k]]
    if missing:
        die(f"--param_grid needs a non-empty list for each of {', '.join(NAMES)}; missing or empty: "
            f"{', '.join(missing)}")
    return {k: [float(v) for v in grid[k]] for k in NAMES}

def cmd_fit(args):
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
    good = [(C, n) for C, n, _, inside in minima if inside]  # Approach 2: N_opt ~ C^a across budgets
    a2 = float(np.polyfit(*np.log(list(zip(*good))), 1)[0]) if len(good) >= 2 else None
    a3 = p["beta"] / (p["alpha"] + p["beta"])
    resid = np.log(law(p, N, D)) - np.log(L)
    res = dict(params=p, interval95=boot, n_runs=int(len(N)), rms_log_residual=float(np.sqrt(np.mean(resid ** 2))),
               n_opt_exponent=a3, isoflop_minima=[dict(flops=C, n_opt=n, loss=l, inside=i) for C, n, l, i in minima],
               isoflop_exponent=a2, max_flops=float((6 * N * D).max()), delta=args.delta,
               tokens_per_step=float(np.nanmax([r["tokens_per_step"] for r in rows])), warnings=warnings, tsv=tsv)
    os.makedirs(args.out_dir, exist_ok=True)
    with open(os.path.join(args.out_dir, "fit.json"), "w") as f:
        json.dump(res, f, indent=2)
    print(f"fit of {len(N)} runs from {len(finals[1])} starts and {args.bootstrap} bootstrap refits in "
          f"{time.time() - t0:.1f} s; rms log residual {res['rms_log_residual']:.4f}")
    print(f"{'':6s} {'fitted':>10s} {'95% interval':>24s} {'Chinchilla':>11s}")
    for k in ("E", "A", "B", "alpha", "beta"):
        lo, hi = boot.get(k, (float("nan"),) * 2)
        print(f"{k:6s} {p[k]:10.4g} {f'[{lo:.4g}, {hi:.4g}]':>24s} {CHINCHILLA[k]:11.4g}")
    print(f"N_opt ~ C^{a3:.3f} (Approach 3)" + (f", C^{a2:.3f} from the IsoFLOP minima (Approach 2)" if a2 else
          " (too few IsoFLOP profiles with an inner minimum for Approach 2)") + "; Chinchilla: C^0.46 and C^0.49")
    for w in warnings:
        warn(w)
    plot_fit(args.out_dir, rows, p, minima)
    print(f"wrote {args.out_dir}/fit.json, isoflop.png and fit.png; next: python scaling.py plan --flops=C")
    return res

def plot_fit(out_dir, rows, p, minima):
    """isoflop.png: loss against N per budget, parabolas, the law and its frontier; fit.png: law against data."""
    import matplotlib.figure  # a Figure of its own, no pyplot: no global state, no display, nothing to close
    N, D, L = np.array([(r["params"], r["tokens"], r["val_loss"]) for r in rows], dtype=float).T
    budgets = sorted({r["budget"] for r in rows if r["budget"]})
    fig = matplotlib.figure.Figure(figsize=(12, 4.8), layout="tight")
    (ax, bx), cmap = fig.subplots(1, 2), matplotlib.colormaps["viridis"]
    for i, C in enumerate(budgets):
        col = cmap(i / max(len(budgets) - 1, 1))
        sel = [r for r in rows if r["budget"] == C]
        n = np.array([r["params"] for r in sel])
        ax.scatter(n, [r["val_loss"] for r in sel], color=col, label=f"{C:.0e} FLOPs", zorder=3)
        ng = np.geomspace(n.min() / 1.5, n.max() * 1.5, 100)
        ax.plot(ng, law(p, ng, C / (6 * ng)), color=col, ls="--", lw=1)
    for C, n, l, inside in minima:
        if math.isfinite(n):
            ax.scatter([n], [l], marker="*", s=160, color="red" if inside else "grey", zorder=4)
    ax.set(xscale="log", xlabel="parameters N (matmul)", ylabel="val loss (nats/token)",
           title="IsoFLOP profiles: runs, the fitted law (dashed), parabola minima (*)")
    if budgets:
        ax.legend(fontsize=8)
    else:  # a user's grid: no IsoFLOP profiles, so the runs alone
        ax.scatter(N, L, color="k", zorder=3)
    C = np.geomspace((6 * N * D).min() / 3, (6 * N * D).max() * 30, 50)
    bx.plot(C, optimal_allocation(p, C)[0], "k--", label="law's optimum (Approach 3)")
    pts = [(c, n) for c, n, _, inside in minima if inside]
    if pts:
        bx.scatter(*zip(*pts), color="red", marker="*", s=160, label="IsoFLOP minima (Approach 2)", zorder=3)
    bx.set(xscale="log", yscale="log", xlabel="compute C = 6ND (FLOPs)", ylabel="compute-optimal N",
           title="Compute-optimal model size")
    bx.legend(fontsize=8)
    fig.savefig(os.path.join(out_dir, "isoflop.png"), dpi=110)
    fig = matplotlib.figure.Figure(figsize=(12, 4.8), layout="tight")
    ax, bx = fig.subplots(1, 2)
    ng, dg = np.geomspace(N.min() / 2, N.max() * 2, 80), np.geomspace(D.min() / 2, D.max() * 2, 80)
    G = law(p, ng[None, :], dg[:, None])
    lv = np.linspace(min(L.min(), G.min()), np.percentile(G, 95), 14)
    cs = ax.contourf(ng, dg, G, levels=lv, cmap="viridis", extend="both")
    ax.scatter(N, D, c=L, cmap="viridis", vmin=lv[0], vmax=lv[-1], edgecolors="white", s=50)
    fig.colorbar(cs, ax=ax, label="loss: law (surface) and runs (dots)")
    cf = np.geomspace(6 * N.min() * D.min(), 6 * N.max() * D.max(), 40)
    ax.plot(*optimal_allocation(p, cf), "r--", label="compute-optimal frontier")
    ax.set(xscale="log", yscale="log", xlim=(ng[0], ng[-1]), ylim=(dg[0], dg[-1]), xlabel="parameters N",
           ylabel="tokens D", title="Fitted L(N, D) against the runs")
    ax.legend(fontsize=8)
    pred = law(p, N, D)
    bx.scatter(pred, L, c=np.log10(D / N), cmap="coolwarm")
    lim = [min(pred.min(), L.min()) * 0.98, max(pred.max(), L.max()) * 1.02]
    bx.plot(lim, lim, "k--", lw=1)
    bx.set(xlabel="predicted loss", ylabel="measured val loss", title="Law against runs (colour: log10 D/N)")
    fig.savefig(os.path.join(out_dir, "fit.png"), dpi=110)

# -----------------------------------------------------------------------------
# Plan: the compute-optimal model for a budget

def plan(p, C, max_flops=None, tokens_per_step=None, force=False):
    """N_opt, D_opt (6 N D = C), the predicted loss and a batch size ~ C^0.25 for budget C; refuses to extrapolate
    beyond twice the largest fitted compute unless force. Returns a dict."""
    if max_flops and C > 2 * max_flops:
        lo = min(2 * max_flops, C / 2)  # budgets up to half of C, a factor of about 3 apart
        nxt = sorted(set(np.geomspace(lo, C / 2, max(2, math.ceil(math.log(C / 2 / lo, 3)) + 1)).round(-6)))
        msg = (f"{C:.3g} FLOPs is {C / max_flops:.0f}x the largest fitted compute ({max_flops:.3g}); a law fitted at "
               f"small scale is only trusted to about 2x beyond it. Sweep further first: python scaling.py sweep "
               f"--flops={','.join(f'{c:.2g}' for c in nxt)}")
        if not force:
            die(msg + " (or pass --force to plan anyway)")
        warn("EXTRAPOLATING: " + msg)
    N, D = optimal_allocation(p, C)
    anchor_c, anchor_b = (max_flops, tokens_per_step) if max_flops and tokens_per_step else BATCH_ANCHOR
    batch = anchor_b * (C / anchor_c) ** 0.25  # critical batch grows slowly with compute (e.g. DeepSeek LLM 2024)
    return dict(flops=C, params=N, tokens=D, tokens_per_param=D / N, loss=float(law(p, N, D)),
                batch_tokens=2 ** round(math.log2(batch)), batch_anchor=(anchor_c, anchor_b))

def cmd_plan(args):
    C = parse_floats(args.flops, "--flops")[0]
    if args.published:
        p, max_flops, tps, src = PUBLISHED[args.published], None, None, f"published {args.published} fit"
    else:
        path = os.path.join(args.out_dir, "fit.json")
        if not os.path.exists(path):
            die(f"no fit at {path}; run 'python scaling.py fit' first, or use --published=chinchilla")
        try:  # a damaged or hand-made fit.json
            with open(path) as f:
                fit = json.load(f)
            p, max_flops = {k: float(fit["params"][k]) for k in CHINCHILLA}, float(fit["max_flops"])
            tps, src, flagged = fit.get("tokens_per_step"), path, list(fit["warnings"])
        except (ValueError, KeyError, TypeError) as e:
            die(f"{path} is not a fit of 'scaling.py fit' ({type(e).__name__}: {e}); run the fit again")
        for w in flagged:
            warn(f"the fit was flagged: {w}")
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

def coord_check(widths=(64, 128, 256, 512), steps=4, lr=1e-2, seeds=3, n_layer=2, seq_len=64, batch_size=8,
                vocab=320, base_width=None, optimizer="adamw", out_dir=None):
    """Mean |coordinate| of each layer's output after each of `steps` steps on one batch, per width, under SP and
    muP (base: the smallest width): {param: {layer: (steps, widths)}} over seeds, and the slopes of log size against
    log width. Under muP each curve is flat in width; under SP the later ones grow (Yang et al.)."""
    base_width = base_width or min(widths)
    out = {}
    for mup in (False, True):
        acc = {}
        for wi, w in enumerate(widths):
            for seed in range(seeds):
                cfg = tg.Config(n_layer=n_layer, n_head=4, n_embd=w, seq_len=seq_len, mup=mup, base_width=base_width,
                                lr=lr, optimizer=optimizer, seed=seed, warmup_steps=0, grad_clip=0.0, weight_decay=0.0)
                model = tg.build_model(cfg, vocab, torch.device("cpu"))
                opts = tg.build_optimizers(cfg, model, torch.device("cpu"))
                g = torch.Generator().manual_seed(1000 + seed)
                x = torch.randint(0, vocab, (batch_size, seq_len + 1), generator=g)
                x, y = x[:, :-1], x[:, 1:]
                layers = [("embedding", model.wte)] + [(f"block {i}", b) for i, b in enumerate(model.blocks)]
                for t in range(steps):
                    model(x, y).backward()
                    for o in opts:
                        o.step()
                        o.zero_grad(set_to_none=True)
                    sizes = {}
                    hooks = [m.register_forward_hook(lambda m, i, o, n=n: sizes.__setitem__(n, o.abs().mean().item()))
                             for n, m in layers]
                    with torch.no_grad():
                        sizes["logits"] = model(x).abs().mean().item()
                    for h in hooks:
                        h.remove()
                    for n, v in sizes.items():
                        acc.setdefault(n, np.zeros((steps, len(widths))))[t, wi] += v / seeds
        out["muP" if mup else "SP"] = acc
    lw = np.log(np.array(widths, dtype=float))
    slopes = {p: {n: float(np.polyfit(lw, np.log(a[-1]), 1)[0]) for n, a in acc.items()} for p, acc in out.items()}
    if out_dir:
        plot_coord_check(out_dir, widths, out, slopes, lr, optimizer)
    return out, slopes

def plot_coord_check(out_dir, widths, out, slopes, lr, optimizer):
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
    os.makedirs(out_dir, exist_ok=True)
    fig.savefig(os.path.join(out_dir, "coord_check.png"), dpi=110)

def cmd_coord_check(args):
    if args.steps < 1 or args.seeds < 1:
        die(f"need --steps >= 1 and --seeds >= 1, got {args.steps} and {args.seeds}")
    widths = [int(w) for w in parse_floats(args.widths, "--widths", "64,128")]
    _, slopes = coord_check(widths, args.steps, args.lr, args.seeds, optimizer=args.optimizer, out_dir=args.out_dir)
    print(f"slope of log mean |activation| against log width after step {args.steps} (0 = flat, 1 = grows like "
          f"width):")
    for param, s in slopes.items():
        print(f"  {param:4s} " + " | ".join(f"{n} {v:+.2f}" for n, v in s.items()))
    print(f"wrote {args.out_dir}/coord_check.png")

def cmd_lr_transfer(args, extra):
    cfg = base_config(args, extra)
    vocab = vocab_of(cfg)
    widths, lrs = [int(w) for w in parse_floats(args.widths, "--widths", "64,128")], parse_floats(args.lrs, "--lrs")
    plan_ = []
    for mup, w, lr in itertools.product((False, True), widths, lrs):
        c = dataclasses.replace(cfg, n_embd=w, n_head=args.n_head, n_layer=args.n_layer)
        over = dict(n_embd=w, n_head=args.n_head, n_layer=args.n_layer, lr=lr, mup=mup, base_width=min(widths),
                    max_steps=args.steps, warmup_steps=max(1, args.steps // 10))
        plan_.append((f"{'mup' if mup else 'sp'}_d{w}_lr{lr:.0e}", over,
                      {"budget": "", "params": matmul_params(c, vocab)}))
    os.makedirs(args.out_dir, exist_ok=True)
    tsv = os.path.join(args.out_dir, "lr_transfer.tsv")
    failed, stopped = run_rows(plan_, cfg, args.out_dir, tsv)
    if stopped:
        return None
    rows = read_tsv(tsv)
    res = {}
    for r in rows:
        res.setdefault("muP" if r["mup"] == "1" else "SP", {}).setdefault(int(r["n_embd"]), {})[float(r["lr"])] = \
            float(r["val_loss"])
    for param, by_w in res.items():
        best = {w: min(d, key=d.get) for w, d in sorted(by_w.items())}
        print(f"{param:4s} best LR per width: " + ", ".join(f"{w}: {lr:.2g} ({by_w[w][lr]:.4f})"
                                                             for w, lr in best.items()))
    plot_lr_transfer(args.out_dir, res)
    print(f"wrote {args.out_dir}/lr_transfer.png")
    if failed:
        die(f"{failed} run(s) failed; run the same command again to retry them")
    return res

def plot_lr_transfer(out_dir, res):
    import matplotlib.figure
    fig = matplotlib.figure.Figure(figsize=(11, 4.2), layout="tight")
    axes = fig.subplots(1, 2, sharey=True)
    for ax, param in zip(axes, ("SP", "muP")):
        by_w = res.get(param, {})
        for i, (w, d) in enumerate(sorted(by_w.items())):
            lr = sorted(d)
            line, = ax.plot(lr, [d[v] for v in lr], marker="o", label=f"width {w}")
            b = min(d, key=d.get)
            ax.scatter([b], [d[b]], s=120, facecolors="none", edgecolors=line.get_color())
        ax.set(xscale="log", xlabel="learning rate", title=f"{param}: val loss against LR (circle: best)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("val loss")
    fig.savefig(os.path.join(out_dir, "lr_transfer.png"), dpi=110)

def cmd_compare(args):
    """Runs' metrics.jsonl (any trainer's) against step: a colour a run, a line style a metric."""
    import matplotlib.figure
    fig = matplotlib.figure.Figure(figsize=(6.4, 4), layout="tight")
    ax = fig.subplots()
    metrics = (args.metric or "loss,val_loss").split(",")
    for (i, run), (j, metric) in itertools.product(enumerate(args.runs), enumerate(metrics)):
        path = os.path.join(run, "metrics.jsonl")
        if not os.path.exists(path):
            die(f"{path} not found: pass the out_dir of a run")
        try:  # a killed run can leave a cut-off last line
            *whole, cut = open(path, encoding="utf-8").read().split("\n")
            rows = [json.loads(line) for line in whole if line.strip()]
        except ValueError as e:  # not JSON lines, or not UTF-8
            die(f"{path}: not a metrics.jsonl ({e}); pass the out_dir of a train_*.py run")
        rows = [r for r in rows if isinstance(r, dict) and "step" in r]  # a step's records
        if cut.strip():
            print(f"warning: {path}: its last line is cut off (a killed run's); skipped")
        pts = [(r["step"], r[metric]) for r in rows if isinstance(r.get(metric), (int, float))]
        if not pts and (args.metric or j == 0):  # the default's val loss may be missing (a benchmark has none)
            keys = sorted({k for r in rows for k, v in r.items() if isinstance(v, (int, float))} - {"step"})
            die(f"{path} has no '{metric}'; pick --metric from {', '.join(keys)}")
        if not pts:
            continue
        label = os.path.basename(os.path.normpath(run)) + (f" {metric}" if len(metrics) > 1 else "")
        ax.plot(*zip(*pts), ("-", "--", ":", "-.")[j % 4], color=f"C{i % 10}", marker=".", markersize=4, label=label)
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

def sharpness(loss_fn, params, iters=10, seed=0):
    """Top eigenvalue of the loss Hessian (the "sharpness" of Cohen et al. 2021) by power iteration. Each
    Hessian-vector product is a central difference of gradients, Hv = (g(w + e v) - g(w - e v)) / 2e, so the fused
    loss needs no double backward (it has none). loss_fn() returns the loss; params and their .grad end unchanged."""
    norm = lambda ts: math.sqrt(sum(t.float().square().sum().item() for t in ts))  # noqa: E731
    w0 = [p.detach().clone() for p in params]
    gen = torch.Generator(params[0].device).manual_seed(seed)  # its own generator: the global RNG stays untouched
    v = [torch.randn(p.shape, device=p.device, generator=gen) for p in params]
    eps, lam = 1e-3 * norm(w0), 0.0
    for _ in range(iters):
        n = norm(v)
        v, grads = [t / n for t in v], []
        for sign in (1.0, -1.0):
            with torch.no_grad():
                for p, w, t in zip(params, w0, v):
                    p.copy_(w + sign * eps * t)
            grads.append([g.float() for g in torch.autograd.grad(loss_fn(), params)])
        hv = [(a - b) / (2 * eps) for a, b in zip(*grads)]
        v, lam = hv, sum((a * b).sum().item() for a, b in zip(v, hv))  # the Rayleigh quotient v.Hv, |v| = 1
    with torch.no_grad():
        for p, w in zip(params, w0):
            p.copy_(w)
    return lam

def cmd_sharpness(args):
    """Top Hessian eigenvalue of a checkpoint's training loss, one per batch: its spread is the batches'."""
    if min(args.batches, args.iters) < 1:
        die("--batches and --iters must be at least 1")
    device = tg.setup_dist(args.device)[2]
    model, tok, step, path = tg.load_model(args.ckpt, device)  # fp32: a finite difference of bf16 gradients is noise
    c, data_dir, B = model.cfg, args.data_dir or model.cfg.data_dir, args.batch_size or model.cfg.batch_size
    meta = tg.load_meta(data_dir)
    if meta["tokenizer"] != tok["tokenizer"] or meta["vocab_size"] > model.vocab_size:
        die(f"{data_dir} holds {meta['tokenizer']} tokens ({meta['vocab_size']}) but {path} reads {tok['tokenizer']} "
            f"tokens ({model.vocab_size}); pass the data it was trained on with --data_dir")
    loader = tg.TokenLoader(tg.find_shards(data_dir, args.split), B, c.seq_len, 0, 1, device, meta["eot_id"],
                            lanes=B, vocab_size=model.vocab_size)  # a lane per row: far-apart documents
    lams = []
    for i in range(args.batches):
        x, y, _ = loader.next()
        lams.append(sharpness(lambda: model(x, y, c.z_loss), list(model.parameters()), args.iters, seed=i))
        print(f"sharpness of {path} (step {step}) | {args.split} batch {i + 1}/{args.batches} of {B}x{c.seq_len} "
              f"tokens | top Hessian eigenvalue {lams[-1]:.4g}")
    mean = sum(lams) / len(lams)
    print(f"mean {mean:.4g} over {len(lams)} batch(es); for plain gradient descent 2/lr = {2 / c.lr:.4g} is the edge "
          f"of stability (Adam's bound is on the preconditioned Hessian, which this does not compute)")
    return {"sharpness": mean, "per_batch": lams, "step": step}

# -----------------------------------------------------------------------------
# Entry point

class Parser(argparse.ArgumentParser):
    def error(self, message):  # argparse's own error prints the usage over several lines
        die(f"{message} (see python scaling.py -h)")

def main(argv=None):
    """Parse argv (sys.argv when None) and run the subcommand; returns its result."""
    parser = Parser(prog="scaling.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                    allow_abbrev=False)
    sub = parser.add_subparsers(dest="command", required=True)
    p = sweep = sub.add_parser("sweep", help="train a grid of runs (IsoFLOP by default); resumable", allow_abbrev=False)
    p.add_argument("--flops", default="3e11,1e12,3e12", help="compute budgets C of the IsoFLOP profiles")
    p.add_argument("--sizes", type=int, default=5, help="model sizes per budget, spread over 16x in N")
    p.add_argument("--ratio", type=float, default=20.0, help="tokens per parameter at the centre of each profile "
                   "(Chinchilla: about 20 for BPE tokens; bytes carry less each, so more)")
    p.add_argument("--min_steps", type=int, default=100, help="leave out models that would train fewer steps")
    p.add_argument("--models", default="", help="a grid instead: LAYERSxWIDTH,... (e.g. 2x64,4x128) with --tokens")
    p.add_argument("--tokens", default="", help="a grid instead: token budgets D (e.g. 1e6,4e6) with --models")
    p.add_argument("--lr", type=float, default=4e-3, help="peak LR of every run (the LR of WORKSHOP.md's and "
                   "docs/scaling.md's sweeps; train_gpt.py's own default, 8e-3, is for its 64-wide model)")
    p = transfer = sub.add_parser("lr_transfer", help="loss vs LR at several widths, SP and muP", allow_abbrev=False)
    p.add_argument("--widths", default="32,64,128,256", help="n_embd values; the smallest is muP's base width")
    p.add_argument("--lrs", default="1e-3,2e-3,4e-3,8e-3,1.6e-2,3.2e-2", help="peak learning rates")
    p.add_argument("--steps", type=int, default=200, help="optimizer steps per run")
    p.add_argument("--n_layer", type=int, default=2)
    p.add_argument("--n_head", type=int, default=4, help="fixed, so the head dim grows with width (muP's 1/d)")
    for p, out in ((sweep, "out/scaling"), (transfer, "out/lr_transfer")):
        p.add_argument("--out_dir", default=out)
        p.add_argument("--data_dir", default=tg.Config.data_dir, help="token shards from prepare_data.py")
        p.add_argument("--device", default="cpu", help="cpu, or auto for the trainer's choice")
    p = sub.add_parser("fit", help="fit L(N, D) to a sweep's runs, with intervals and plots", allow_abbrev=False)
    p.add_argument("--out_dir", default="out/scaling", help="where sweep.tsv is, and fit.json and the plots go")
    p.add_argument("--tsv", default="", help="sweep results to fit (default OUT_DIR/sweep.tsv)")
    p.add_argument("--param_grid", default="", help="initial values: a JSON file or JSON {name: [values]} for "
                   "e, a, b (logs of E, A, B), alpha, beta (default: Hoffmann et al.'s 4,500 starts)")
    p.add_argument("--bootstrap", type=int, default=200, help="refits on resampled runs for the intervals; 0 = off")
    p.add_argument("--delta", type=float, default=1e-3, help="Huber delta on log residuals")
    p = sub.add_parser("plan", help="compute-optimal N, D, loss and batch size for a budget", allow_abbrev=False)
    p.add_argument("--flops", required=True, help="the compute budget C in FLOPs, e.g. 1e14")
    p.add_argument("--out_dir", default="out/scaling", help="where fit.json is")
    p.add_argument("--published", choices=sorted(PUBLISHED), help="plan from a published fit instead of yours")
    p.add_argument("--force", action="store_true", help="plan beyond twice the fitted compute anyway (loud warning)")
    p = sub.add_parser("coord_check", help="muP coordinate check: activation size against width (a plot)",
                       allow_abbrev=False)
    p.add_argument("--widths", default="64,128,256,512", help="n_embd values; the smallest is muP's base width")
    p.add_argument("--steps", type=int, default=4, help="optimizer steps to follow")
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--seeds", type=int, default=3, help="runs averaged per width")
    p.add_argument("--optimizer", default="adamw", choices=("adamw", "muon"))
    p.add_argument("--out_dir", default="out/scaling")
    p = sub.add_parser("sharpness", help="top Hessian eigenvalue of the loss at a checkpoint", allow_abbrev=False)
    p.add_argument("--ckpt", required=True, help="a checkpoint, or a run's out_dir (its newest checkpoint)")
    p.add_argument("--data_dir", default="", help="token shards (default: the checkpoint's own --data_dir)")
    p.add_argument("--split", default="train", choices=("train", "val"), help="the loss trained on, or held out")
    p.add_argument("--batches", type=int, default=1, help="batches, one estimate each, read from the split's start")
    p.add_argument("--batch_size", type=int, default=0, help="sequences per batch (default: the checkpoint's)")
    p.add_argument("--iters", type=int, default=20, help="power iterations, two forward-backward passes each")
    p.add_argument("--device", default="cpu", help="cpu, cuda, or auto for the trainer's choice")
    p = sub.add_parser("compare", help="metrics of several runs against step, in one plot", allow_abbrev=False)
    p.add_argument("runs", nargs="+", metavar="OUT_DIR", help="the out_dirs of train_gpt/vit/diffusion.py runs")
    p.add_argument("--metric", default="", help="keys of metrics.jsonl, comma-separated: loss, val_loss, val_acc, ... "
                   "(default: loss and, where a run has it, val_loss)")
    p.add_argument("--out", default="out/compare.png")
    args, extra = parser.parse_known_args(argv)
    if extra and args.command not in ("sweep", "lr_transfer"):
        die(f"unrecognized arguments: {' '.join(extra)} (see python scaling.py {args.command} -h)")
    cmd = globals()[f"cmd_{args.command}"]  # looked up when called, so a test can stand in for one
    return cmd(args, extra) if args.command in ("sweep", "lr_transfer") else cmd(args)

if __name__ == "__main__":
    main()
