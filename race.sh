#!/usr/bin/env bash
# race.sh: a fair time-to-loss race between train_gpt.py and nanoGPT's train.py (issue 64, part 5), in about 5
# minutes of one GPU, compile included. A script beside bench.sh, not a stage of it: it prepares its own corpus and
# has its own budget, and bench.sh's 570 s and this one's would not fit one 600-s command together. The first
# nanoGPT run has the largest share: it fills Inductor's cache, and the two after it compile from there.
#
#   NANOGPT=../nanoGPT bash race.sh            # one GPU, within BUDGET seconds (300); rows for BENCHMARKS.md
#   NANOGPT=../nanoGPT bash race.sh --dry-run  # on a CPU: every command runs, shrunk (tests/test_bench.py)
#
# 1. The corpus: this Python's standard library and installed packages (.py .pyi .md .rst .txt files under 2 MB,
#    CORPUS_MB of them, picked by path hash), tokenized offline by prepare_data.py text (TOKENIZER, gpt2: tiktoken's
#    gpt2 files must be in TIKTOKEN_CACHE_DIR, as there is no network), which drops a file whose text another file
#    has and holds out 2% of the files, whole, as val; written as nanoGPT's raw train.bin / val.bin, read by both.
# 2. nanoGPT at GPT-2 124M (B 32 x T 1024 x 4 = 131,072 tokens a step), AdamW at each LR of LRS, STEPS steps, cosine
#    to LR / 10 after WARMUP steps; its weights saved every EVERY steps (a torch.save wrapper names each file by its
#    step and leaves the optimizer out; nanoGPT's own eval reads one batch and is ignored).
# 3. Ours at --preset=gpt2_124m (Muon lr 4e-3) at the same shape, steps, warmup and final LR, saving as often.
# 4. One evaluator scores every saved model of both sides: the whole val split, cut into windows of T tokens (all but
#    the last < T), the same batches for both, bf16 autocast on a GPU; nanoGPT's weights in nanoGPT's own model class
#    (imported from NANOGPT), ours in ours.
# 5. The rows: the target is the best final val loss of nanoGPT's three LRs; for each run, the tokens and seconds to
#    its first saved model at or below the target. Seconds exclude compilation on both sides by one rule: the sum of
#    the logged step times (nanoGPT's "time Xms" lines, our "ms" in metrics.jsonl, both at a log line a step), where
#    each of the first 5 steps (compile, autotune) and each step that held an eval or a save counts as the run's
#    median step (the rows' "ms/step").
# Each run may use its share of BUDGET (and what earlier ones left); one that would overrun is stopped, and what it
# saved by then is scored. Logs and data in $LOGS.
set -uo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python} DRY=0 FAILED=0 STAGE_END=0
[ "${1:-}" = --dry-run ] && DRY=1
LOGS=$(mkdir -p "${LOGS:-/tmp/race}" && cd "${LOGS:-/tmp/race}" && pwd)
BUDGET=${BUDGET:-300} STEPS=${STEPS:-60} EVERY=${EVERY:-15} WARMUP=${WARMUP:-10} LRS=${LRS:-6e-4 1.2e-3 1.8e-3}
CORPUS_MB=${CORPUS_MB:-60} TOKENIZER=${TOKENIZER:-gpt2}
B=32 T=1024 ACCUM=4
OURS=() NANO=() EVAL_DEVICE=cuda EVAL_B=32  # what --dry-run appends to shrink each command
if [ $DRY = 1 ]; then
  BUDGET=1000 STEPS=2 EVERY=1 WARMUP=1 CORPUS_MB=0.2 TOKENIZER=byte B=2 T=32 ACCUM=2 EVAL_DEVICE=cpu EVAL_B=8
  SMALL=(--n_layer=1 --n_head=2 --n_embd=32)
  OURS=(--device=cpu --compile=false --dtype=float32 "${SMALL[@]}")
  NANO=(--device=cpu --compile=False --dtype=float32 "${SMALL[@]}")
fi
[ -n "${NANOGPT:-}" ] || { echo "race.sh needs NANOGPT=path/to/a/checkout/of/karpathy/nanoGPT"; exit 1; }
NANOGPT=$(cd "$NANOGPT" && pwd)
DATA=$LOGS/data
if [ $TOKENIZER = gpt2 ] && ! $PY -c "import tiktoken; tiktoken.get_encoding('gpt2')" > /dev/null 2>&1; then
  # no network on the GPU machine: without tiktoken's gpt2 files in TIKTOKEN_CACHE_DIR, bytes; both sides still read
  # the same tokens at the same shape (neither writes a vocabulary: both build GPT-2's padded 50,304 rows)
  echo "tiktoken has no gpt2 files here (set TIKTOKEN_CACHE_DIR to a cache that has them): byte tokens instead"
  TOKENIZER=byte
fi

stage() {  # SHARE TITLE: a stage may run until SHARE (of 300) more seconds are spent, and what earlier ones left
  STAGE_END=$((STAGE_END + $1 * BUDGET / 300))
  echo "### $2 (until ${STAGE_END} s; now ${SECONDS} s)"
}

run() {  # NAME CMD...: CMD within its stage's time, its output in $LOGS/NAME.log; 0 if it ran and exited 0
  local name=$1 left=$((STAGE_END - SECONDS)) rc=1
  shift
  echo "skipped: its stage's time was spent" > "$LOGS/$name.log"
  if [ $left -ge 15 ]; then
    timeout -k 10 $left "$@" > "$LOGS/$name.log" 2>&1
    rc=$?
    [ $rc = 124 ] && echo "stopped after $left s: its stage's time was spent" >> "$LOGS/$name.log"
  fi
  echo "$name: rc $rc at ${SECONDS} s | $(tail -n 1 "$LOGS/$name.log")"
  [ $rc = 0 ] || FAILED=1
  return $rc
}

stage 35 "1. the corpus: $CORPUS_MB MB of this Python's files, $TOKENIZER tokens, val 2% of the files"
CORPUS="import os, sys, sysconfig, zlib
from pathlib import Path
out, budget = Path(sys.argv[1]), float(sys.argv[2]) * 1e6
roots = {'stdlib': sysconfig.get_paths()['stdlib'], 'purelib': sysconfig.get_paths()['purelib'],
         'platlib': sysconfig.get_paths()['platlib']}
found, seen = [], set()
for label, root in roots.items():
    root = Path(root).resolve()
    for p in sorted(root.rglob('*')) if root.is_dir() and root not in seen else []:
        rel = p.relative_to(root)
        # the stdlib's own site-packages are purelib's; hidden folders (caches, .git) are not text to learn
        skip = label == 'stdlib' and {'site-packages', 'dist-packages'} & set(rel.parts)
        if p.suffix in ('.py', '.pyi', '.md', '.rst', '.txt') and not skip and not any(
                s.startswith('.') for s in rel.parts) and p.is_file() and p.stat().st_size < 2e6:
            found.append((zlib.crc32(f'{label}/{rel}'.encode()), f'{label}/{rel}', p))
    seen.add(root)
total = 0
for _, name, p in sorted(found):  # by path hash: a mix of every package, not the first ones alphabetically
    if total >= budget:
        break
    (out / name).parent.mkdir(parents=True, exist_ok=True)
    (out / name).symlink_to(p)
    total += p.stat().st_size
print(f'{total / 1e6:.1f} MB of {len(found)} files linked in {out}')"
RAW="import sys, numpy as np, prepare_data as pd
from pathlib import Path
src, out = Path(sys.argv[1]), Path(sys.argv[2])
for split in ('train', 'val'):  # nanoGPT's layout: the shards' tokens, headers dropped, in one raw uint16 file
    tokens = np.concatenate([pd.read_shard(p) for p in sorted(src.glob(split + '_*.bin'))]).astype(np.uint16)
    tokens.tofile(out / f'{split}.bin')
    print(f'{split}.bin: {len(tokens):,} tokens')"
rm -rf "$LOGS/corpus" "$LOGS/prepared" "$DATA" && mkdir -p "$LOGS/corpus" "$DATA"
run corpus $PY -c "$CORPUS" "$LOGS/corpus" $CORPUS_MB &&
  run prepare $PY prepare_data.py text "$LOGS/corpus" --tokenizer=$TOKENIZER --val_percent=2 \
    --data_dir="$LOGS/prepared" &&
  run raw $PY -c "$RAW" "$LOGS/prepared" "$DATA" || { echo "no corpus: see $LOGS"; exit 1; }

# nanoGPT's train.py, with each checkpoint under its own name: it overwrites ckpt.pt at every eval, and the race
# scores every one. Only the weights are kept (the optimizer's state would triple each file's writing time).
NANO_SAVES="import runpy, sys, torch
save = torch.save
def save_each(ckpt, path):
    name = path.replace('ckpt.pt', 'ckpt_%06d.pt' % ckpt['iter_num'])
    save({k: ckpt[k] for k in ('model', 'model_args', 'iter_num')}, name)
torch.save = save_each
sys.argv = ['train.py', *sys.argv[1:]]
runpy.run_path('train.py', run_name='__main__')"
i=0
for lr in $LRS; do
  i=$((i + 1))
  stage $([ $i = 1 ] && echo 70 || echo 45) "2.$i nanoGPT, AdamW lr $lr"
  rm -rf "$LOGS/nano_$lr"
  cmd=(--dataset="$DATA" --out_dir="$LOGS/nano_$lr" --batch_size=$B --block_size=$T --gradient_accumulation_steps=$ACCUM
       --max_iters=$STEPS --lr_decay_iters=$STEPS --warmup_iters=$WARMUP --learning_rate=$lr
       --min_lr=$($PY -c "print($lr / 10)") --eval_interval=$EVERY --eval_iters=1 --log_interval=1 --dropout=0.0)
  # run sets FAILED in the subshell, where it is lost: its status says it here
  (cd "$NANOGPT" && run nano_$lr $PY -c "$NANO_SAVES" "${cmd[@]}" "${NANO[@]}") || FAILED=1
done

stage 80 "3. ours, --preset=gpt2_124m (Muon lr 4e-3)"
rm -rf "$LOGS/ours"
run ours $PY train_gpt.py --preset=gpt2_124m --data_dir="$DATA" --out_dir="$LOGS/ours" --batch_size=$B --seq_len=$T \
  --total_batch=$((B * T * ACCUM)) --max_steps=$STEPS --tokens= --warmup_steps=$WARMUP --final_lr_frac=0.1 \
  --eval_every=0 --save_every=$EVERY --keep_last=0 --log_every=1 --sample_tokens=0 "${OURS[@]}"

stage 25 "4. every saved model of both sides on the whole val split; the rows"
# the rows come even when the runs overran their shares: the scoring gets a minute at least
[ $STAGE_END -lt $((SECONDS + 60)) ] && STAGE_END=$((SECONDS + 60))
EVALUATE="import glob, json, math, os, re, statistics, sys
import numpy as np, torch
import train_gpt as tg
logs, data, nanogpt, device, T, B, every, warm, tokens_per_step = sys.argv[1:10]
T, B, every, warm, tokens_per_step = int(T), int(B), int(every), int(warm), int(tokens_per_step)
sys.path.insert(0, nanogpt)
from model import GPT, GPTConfig  # nanoGPT's own model class, for nanoGPT's weights

val = torch.from_numpy(np.fromfile(os.path.join(data, 'val.bin'), dtype=np.uint16).astype(np.int64))
n = (len(val) - 1) // T  # windows of T tokens, each with its next-token targets; the tail < T is left out
x_all, y_all = val[:n * T].view(n, T), val[1:n * T + 1].view(n, T)  # (windows, T)
amp = torch.autocast('cuda', torch.bfloat16) if device == 'cuda' else torch.autocast('cpu', enabled=False)

def val_loss(forward):
    # the mean over every window's tokens: the same batches for both sides, each batch weighted by its windows
    total = 0.0
    with torch.no_grad(), amp:
        for i in range(0, n, B):
            x, y = x_all[i:i + B].to(device), y_all[i:i + B].to(device)
            total += forward(x, y).float().item() * len(x)
    return total / n

def nano_model(path):
    ckpt = torch.load(path, map_location=device, weights_only=True)
    model = GPT(GPTConfig(**ckpt['model_args']))
    # compiled, nanoGPT saves its model's keys with torch.compile's _orig_mod. prefix
    model.load_state_dict({k.removeprefix('_orig_mod.'): v for k, v in ckpt['model'].items()})
    model.to(device).eval()
    return lambda x, y: model(x, y)[1]

def ours_model(path):
    ckpt = tg.load_checkpoint(path)[0]
    fields = {k: v for k, v in ckpt['config'].items() if k in tg.Config.__dataclass_fields__}
    model = tg.build_model(tg.Config(**fields), ckpt['data_info']['vocab_size'], torch.device(device))
    model.load_state_dict(ckpt['model'])  # a plain run's weights: no QAT grid, no LoRA to merge
    model.eval()
    return lambda x, y: model(x, y)

def step_seconds(ms, held):
    # a step's seconds; the first warm steps (compile, autotune) and those that held an eval or a save: the median
    if not ms:  # the run died before its first step
        return []
    median = statistics.median(ms[warm:] or ms)
    return [median if s < warm or s in held else t for s, t in enumerate(ms)]

def scored(name, saves, ms, held):
    seconds = step_seconds(ms, held)
    curve = []
    for step, path in saves:
        try:
            loss = val_loss(nano_model(path) if name.startswith('nanoGPT') else ours_model(path))
        except Exception as e:  # a file cut short when its run ran out of time
            print(f'{path}: not scored ({type(e).__name__}: {e})')
            continue
        curve.append((step, loss, sum(seconds[:step])))
        print(f'{name} | step {step} | val loss {loss:.4f} | {sum(seconds[:step]):.1f} s')
    return {'name': name, 'curve': curve, 'median_ms': 1e3 * statistics.median(seconds or [0])}

runs = []
for d in sorted(filter(os.path.isdir, glob.glob(os.path.join(logs, 'nano_*'))), key=lambda d: float(d.split('_')[-1])):
    lr = d.split('_')[-1]
    log = open(os.path.join(logs, f'nano_{lr}.log')).read()
    # iteration i's time: from the end of iteration i - 1 (the start, for 0) to the end of its update; one whose
    # number is a multiple of eval_interval began with nanoGPT's eval and save. ckpt_k holds k updates' weights
    ms = [float(t) / 1e3 for t in re.findall(r'iter \d+: loss \S+, time ([\d.]+)ms', log)]
    saves = [(int(re.search(r'(\d+)\.pt\$', p)[1]), p) for p in sorted(glob.glob(os.path.join(d, 'ckpt_*.pt')))]
    runs.append(scored(f'nanoGPT, AdamW lr {lr}', saves, ms, set(range(every, len(ms), every))))
rows = [json.loads(line) for line in open(os.path.join(logs, 'ours', 'metrics.jsonl'))] if os.path.exists(
    os.path.join(logs, 'ours', 'metrics.jsonl')) else []
ms = [r['ms'] / 1e3 for r in rows if 'ms' in r]  # a log line a step: step s's own time, evals and saves outside it
runs.append(scored('ours, Muon lr 4e-3', tg.list_checkpoints(os.path.join(logs, 'ours')), ms, set()))

finals = [r['curve'][-1][1] for r in runs[:-1] if r['curve']]
if not finals or not runs[-1]['curve']:
    print('failed: a side has no scored model; see the logs')
    sys.exit(1)
target = min(finals)
print(f'| run | steps saved | ms/step (median) | final val loss | tokens to {target:.4f} | seconds to {target:.4f} |')
print('|---|---|---|---|---|---|')
reached = {}
for r in runs:
    hit = next(((s, t) for s, loss, t in r['curve'] if loss <= target), None)
    reached[r['name']] = hit
    to = f'{hit[0] * tokens_per_step / 1e6:.1f}M | {hit[1]:.1f} s' if hit else 'not reached | not reached'
    print(f'| {r[\"name\"]} | {r[\"curve\"][-1][0]} | {r[\"median_ms\"]:.0f} | {r[\"curve\"][-1][1]:.4f} | {to} |')
best = min((r for r in runs[:-1] if r['curve']), key=lambda r: r['curve'][-1][1])
theirs, ours = reached[best['name']], reached[runs[-1]['name']]
if ours:
    print(f'\nours / nanoGPT\'s best ({best[\"name\"]}) to val loss {target:.4f}: '
          f'{ours[0] / theirs[0]:.2f}x the tokens, {ours[1] / max(theirs[1], 1e-9):.2f}x the seconds '
          '(the issue\'s target: <= 0.5x)')
else:
    print(f'\nours did not reach {target:.4f} in {runs[-1][\"curve\"][-1][0]} steps')"
run evaluate $PY -c "$EVALUATE" "$LOGS" "$DATA" "$NANOGPT" $EVAL_DEVICE $T $EVAL_B $EVERY 5 $((B * T * ACCUM))
$PY -c "import datetime, platform, torch
gpu = f'On one {torch.cuda.get_device_name()}' if torch.cuda.is_available() else 'Dry run on a CPU (not figures)'
print(f'\n## Race: {gpu}, {datetime.date.today()} (race.sh, $SECONDS s)\n')
print(f'Python {platform.python_version()}, torch {torch.__version__}; $TOKENIZER tokens, {$STEPS} steps a run, '
      f'saved every {$EVERY}; logs in $LOGS\n')"
sed -n '/^| run |/,$p' "$LOGS/evaluate.log"  # the curves behind the rows are in evaluate.log
exit $FAILED
