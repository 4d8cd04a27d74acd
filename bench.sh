#!/usr/bin/env bash
# bench.sh: a GPU session's measurements in one command (issue 48). In order: 1 the GPU tests, 2 kernels.py --bench,
# 3 bench.py on each trainer's GPU preset (the default kernels; KERNELS="auto torch triton" adds the others),
# 4 nanoGPT's train.py at the 124M shape (given NANOGPT=a copy), 5 a CUDA-graphs trial (torch.compile's
# reduce-overhead mode) of the ViT and DiT presets, 6 the ViT's imagenet preset with its images read from their
# file against held on the GPU, and 7 sliding-window attention, the masked SDPA against FlexAttention (issue 82,
# kernels.py --bench_window). It ends with Markdown rows for BENCHMARKS.md; logs in $LOGS.
#
#   bash bench.sh                        # one GPU, within BUDGET seconds (570): each stage has a share, and a
#                                        # command that would overrun it is stopped, and its row says so. On a
#                                        # fresh H200 (2026-11-27) compiling ate the shares: 570 s fits the
#                                        # default kernels' three runs, not all nine
#   NANOGPT=../nanoGPT bash bench.sh     # with nanoGPT's row: the same shape, compile on, bf16, random tokens
#   TESTS=tests/ bash bench.sh           # the whole suite first (225 s with -n 14 on an H100, 2026-11-25)
#   bash bench.sh --dry-run              # on a CPU: every command runs, shrunk (tests/test_bench.py)
#   ONLY="1 3 4 7" TRAINERS=gpt bash bench.sh   # some stages, some trainers: the budget is shared among them alone
#   PROFILE=1 bash bench.sh              # the GPT's run adds bench.py --profile: its top kernels, printed at the end
# Issue 82's one call, the GPT against nanoGPT and the window's attention (its four stages' shares of 520 s: 130
# each, and what one leaves the next), with nanoGPT copied into an ignored folder of the checkout the call carries:
#   PYTHON=python3 NANOGPT=.nanogpt ONLY="1 3 4 7" TRAINERS=gpt PROFILE=1 BUDGET=520 LOGS=/tmp/bench bash bench.sh
# A fair time-to-loss race against nanoGPT (compile excluded, nanoGPT's best of three LRs, one evaluator on the
# whole val split) is race.sh beside it, with its own data and budget.
set -uo pipefail
cd "$(dirname "$0")"
PY=${PYTHON:-python} DRY=0 ROWS=() FAILED=0 STAGE_END=0
[ "${1:-}" = --dry-run ] && DRY=1
LOGS=$(mkdir -p "${LOGS:-/tmp/bench}" && cd "${LOGS:-/tmp/bench}" && pwd)
rm -f "$LOGS"/*.log  # an earlier run's, which a stage left out this time would otherwise show as this run's
TESTS=${TESTS:-tests/test_kernels.py tests/test_kernels_ptx.py tests/test_compile.py tests/test_flex.py}  # GPU's
KERNELS=${KERNELS:-auto} BUDGET=${BUDGET:-570} ONLY=${ONLY:-1 2 3 4 5 6 7} TRAINERS=${TRAINERS:-gpt vit diffusion}
PROFILE=${PROFILE:-0}
# each stage's share of the budget, against the others that run: bench.py takes 80 a trainer
SHARE=(0 80 80 $((80 * $(wc -w <<< "$TRAINERS"))) 80 90 100 80)  # 7: four FlexAttention compiles
TOTAL=0
for n in $ONLY; do
  case $n in [1-7]) TOTAL=$((TOTAL + SHARE[n])) ;; *) echo "bench.sh: error: ONLY names stages 1 to 7, not '$n'" >&2
    exit 2 ;; esac
done
GPT_STEPS=${GPT_STEPS:-5} IMG_STEPS=${IMG_STEPS:-20}  # timed steps, after as many warm-up ones (bench.py)
GPT=() IMG=() NANO=() NTOKENS=$((1 << 22))  # what --dry-run appends to shrink each command
if [ $DRY = 1 ]; then
  BUDGET=1500 GPT_STEPS=1 IMG_STEPS=1 NTOKENS=$((1 << 14))
  CPU=(--device=cpu --compile=false --dtype=float32 --n_layer=1 --n_head=2 --n_embd=32)
  GPT=("${CPU[@]}" --seq_len=32 --batch_size=2 --total_batch=0 --vocab_size=512)
  IMG=("${CPU[@]}" --batch_size=4 --image_size=16 --patch_size=4)
  NANO=(--device=cpu --compile=False --dtype=float32 --n_layer=1 --n_head=2 --n_embd=32 --batch_size=2
        --block_size=32 --gradient_accumulation_steps=1)
fi

stage() {  # N TITLE: false if ONLY leaves stage N out; else it may run until its share of BUDGET more is spent,
  # and what earlier ones left
  [[ " $ONLY " == *" $1 "* ]] || return 1
  STAGE_END=$((STAGE_END + SHARE[$1] * BUDGET / TOTAL))
  echo "### $1. $2 (until ${STAGE_END} s; now ${SECONDS} s)"
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
  return $rc
}

row() {  # COMMAND RESULT: a row of the table; a failed one makes the exit status 1
  ROWS+=("| \`$1\` | $2 |")
  case $2 in failed*) FAILED=1 ;; esac
}

bench() {  # NAME LABEL CMD...: a bench.py run, and its row: rate, ms/step, MFU and peak memory of its last line
  local name=$1 label=$2
  shift 2
  run "$name" "$@"
  if grep -q '^benchmark |' "$LOGS/$name.log"; then  # its line counts even when the exit after it ran out of time
    local note=$(grep -m 1 -o "skipping cudagraphs.*" "$LOGS/$name.log" | cut -c 1-100)  # why CUDA graphs were not
    local fields=$(grep '^benchmark |' "$LOGS/$name.log" | awk -F' [|] ' '{print $(NF-3)", "$(NF-2)", "$(NF-1)", "$NF}')
    row "$label" "$fields${note:+ ($note)}"
  else
    row "$label" "failed: $(tail -n 1 "$LOGS/$name.log")"
  fi
}

if stage 1 "tests: $TESTS"; then
XDIST=()
$PY -c "import xdist" 2> /dev/null && XDIST=(-n $(($(nproc) < 14 ? $(nproc) : 14)))  # 63 s with 14 on an H200
if [ $DRY = 1 ]; then
  run pytest $PY -m pytest -q --collect-only $TESTS || row "python -m pytest -q $TESTS" "failed: does not collect"
else
  run pytest $PY -m pytest -q "${XDIST[@]}" $TESTS
  row "python -m pytest -q ${XDIST[*]} $TESTS" "$(tail -n 1 "$LOGS/pytest.log")"
fi
fi

if stage 2 "kernels.py --bench"; then
run kernels $PY kernels.py --bench  # on a CPU: one line, that it needs a GPU, and exit status 1
grep -q "needs a CUDA GPU\|^linear_ce" "$LOGS/kernels.log" || row "python kernels.py --bench" "failed: see kernels.log"
fi

if stage 3 "bench.py on the GPU preset of each of: $TRAINERS, with --kernels= each of: $KERNELS"; then
for k in $KERNELS; do
  for t in $TRAINERS; do
    [ $t = gpt ] && p=gpt2_124m n=$GPT_STEPS shrink=("${GPT[@]}") || p=cifar10 n=$IMG_STEPS shrink=("${IMG[@]}")
    flags="--preset=$p --steps=$n --kernels=$k"
    # 3 steps more, traced: the trace goes to the trainer's --out_dir, here in $LOGS
    [ $t = gpt ] && [ $k = auto ] && [ $PROFILE = 1 ] && flags="$flags --profile --out_dir=$LOGS/profile"
    bench "${t}_$k" "python bench.py train_$t.py ${flags//$LOGS/\$LOGS}" $PY bench.py train_$t.py $flags "${shrink[@]}"
  done
done
fi

if stage 4 "nanoGPT's train.py at GPT-2 124M's shape (B 32 x T 1024 x 16 micro-steps), on random tokens"; then
if [ -n "${NANOGPT:-}" ]; then
  mkdir -p "$LOGS/nanogpt_data"
  $PY -c "import numpy as np; [np.random.default_rng(0).integers(0, 50257, $NTOKENS, dtype=np.uint16).tofile(
    '$LOGS/nanogpt_data/' + s) for s in ('train.bin', 'val.bin')]"
  cmd=(train.py --dataset="$LOGS/nanogpt_data" --batch_size=32 --block_size=1024 --gradient_accumulation_steps=16
       --max_iters=$((GPT_STEPS + 2)) --eval_interval=1000 --eval_iters=1 --dropout=0.0 --out_dir="$LOGS/nanogpt_out")
  if (cd "$NANOGPT" && run nanogpt $PY "${cmd[@]}" "${NANO[@]}"); then
    # ms an iteration: the median after iteration 1 (0 compiles); its MFU is of an A100's 312 TFLOPS: rescaled
    row "cd nanoGPT && python ${cmd[*]//$LOGS/\$LOGS}" "$($PY -c "import re, statistics, torch, train_gpt as tg
log = open('$LOGS/nanogpt.log').read()
its = re.findall(r'iter (\d+): loss \S+, time ([\d.]+)ms, mfu (-?[\d.]+)%', log)
ms = statistics.median(float(t) for i, t, _ in its if int(i) >= min(2, len(its) - 1))
tokens = int(re.search(r'tokens per iteration will be: ([\d,]+)', log)[1].replace(',', ''))
gpu = torch.cuda.get_device_name() if torch.cuda.is_available() else 'none'
peak, mfu = next((v for k, v in tg.PEAK_FLOPS.items() if k in gpu), 0), float(its[-1][2])
print(f'{tokens / ms:.1f}k tok/s, {ms:.1f} ms/iter, mfu ' + (f'{mfu * 312e12 / peak:.1f}%' if
      peak and mfu > 0 else '-'))")"
  else
    row "nanoGPT train.py" "failed: $(tail -n 1 "$LOGS/nanogpt.log")"
  fi
else
  echo "skipped: NANOGPT=path/to/nanoGPT is not set"
fi
fi

if stage 5 "CUDA graphs: the ViT and DiT presets under torch.compile(mode=\"reduce-overhead\")"; then
GRAPHS="import functools, runpy, sys, torch
torch.compile = functools.partial(torch.compile, mode='reduce-overhead')  # CUDA graphs around each compiled graph
sys.argv = sys.argv[1:]
runpy.run_path(sys.argv[0], run_name='__main__')"
flags="--preset=cifar10 --steps=$IMG_STEPS"
for t in vit diffusion; do
  bench "${t}_graphs" "python bench.py train_$t.py $flags, mode reduce-overhead" $PY -c "$GRAPHS" bench.py train_$t.py \
    $flags "${IMG[@]}"
done
fi

if stage 6 "images read from their file: the imagenet preset at batch 256, --loader=host against --loader=device"; then
# 20,000 random images of 224x224 (3 GB: the device path holds them too), the same batches on both paths: where the
# host path's step is no slower, no step waited for data (issue 63). The first log interval holds the compile.
SIZE=224 N=20000 SMALL=()
[ $DRY = 1 ] && SIZE=16 N=64 SMALL=(--translate=4)  # the preset shifts by up to 16 pixels, as many as 16x16 hold
$PY -c "import numpy as np, prepare_data as pd
rng = np.random.default_rng(0)
splits = {s: (rng.integers(0, 256, (n, $SIZE, $SIZE, 3), np.uint8), rng.integers(0, 1000, n)) for s, n in
          (('train', $N), ('val', 256))}
pd.write_images('$LOGS/images', splits, [str(k) for k in range(1000)], 'random')" > /dev/null
for l in device host; do
  flags="--preset=imagenet --loader=$l --batch_size=256 --grad_accum=1 --epochs=0 --max_steps=$((2 * IMG_STEPS))"
  run "loader_$l" $PY train_vit.py $flags --log_every=$IMG_STEPS --eval_every=0 --eval_images=256 \
    --data_dir="$LOGS/images" --out_dir="$LOGS/loader_$l" "${IMG[@]}" "${SMALL[@]}"
  last=$(grep '^step' "$LOGS/loader_$l.log" | tail -n 1)  # its ms a step and img/s, after the compile
  [ -n "$last" ] && row "python train_vit.py $flags" "$(echo "$last" | awk -F' [|] ' '{print $6", "$5}')" ||
    row "python train_vit.py $flags" "failed: $(tail -n 1 "$LOGS/loader_$l.log")"
done
fi

if stage 7 "sliding-window attention, a window of T/4 at T 1,024 and 4,096: the masked SDPA against FlexAttention"; then
# on a CPU (the dry run) the same code at T 256 and 512, FlexAttention forward only: no figures
run window $PY kernels.py --bench_window || row "python kernels.py --bench_window" "failed: see window.log"
fi

$PY -c "import datetime, platform, torch
try:
    import triton; tv = triton.__version__
except ImportError:
    tv = 'none'
gpu = f'On one {torch.cuda.get_device_name()}' if torch.cuda.is_available() else 'Dry run on a CPU (not figures)'
print(f'\n## {gpu}, {datetime.date.today()} (bench.sh, $SECONDS s)\n')
print(f'Python {platform.python_version()}, torch {torch.__version__}, triton {tv}; logs in $LOGS\n')"
printf '%s\n' "| command | result |" "|---|---|" "${ROWS[@]}"
if grep -qs '|' "$LOGS/kernels.log"; then
  printf '\n`python kernels.py --bench`:\n\n```text\n%s\n```\n' "$(grep '^#\||' "$LOGS/kernels.log")"
fi
if grep -qs '^|' "$LOGS/window.log"; then  # a Markdown table already
  printf '\n`python kernels.py --bench_window`, %s\n\n%s\n' "$(grep -m 1 '^# ' "$LOGS/window.log" | cut -c 3-)" \
    "$(grep '^|' "$LOGS/window.log")"
fi
if grep -qs '^profile of ' "$LOGS/gpt_auto.log"; then  # bench.py --profile's table of the top ops
  printf '\n`python bench.py train_gpt.py --profile`, the top ops:\n\n```text\n%s\n```\n' \
    "$(sed -n '/^-\{20,\}/,/^Self CUDA time total\|^Self CPU time total/p' "$LOGS/gpt_auto.log" | head -n 40)"
fi
exit $FAILED
