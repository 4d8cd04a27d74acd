"""bench.sh, the GPU session's one command, arrives working: its --dry-run runs every command of it on the CPU, shrunk
(the tests only collected, kernels.py --bench to its one line that it needs a GPU), and prints a row for each."""
import os
import subprocess
import sys

import pytest

from commands import ROOT

# nanoGPT's train.py takes --key=value for the globals it defines; a stand-in that checks the names bench.sh passes
# and prints its lines (the real one ran this way on the CPU, 2026-11-25, karpathy/nanoGPT 3adf61e)
NANOGPT_KEYS = {"dataset", "batch_size", "block_size", "gradient_accumulation_steps", "max_iters", "eval_interval",
                "eval_iters", "dropout", "out_dir", "device", "compile", "dtype", "n_layer", "n_head", "n_embd"}
STAND_IN = f"""import sys
for a in sys.argv[1:]:
    assert a.startswith("--") and a[2:].split("=")[0] in {sorted(NANOGPT_KEYS)}, a
print("tokens per iteration will be: 64")
for i in range(4):
    print(f"iter {{i}}: loss 10.0, time {{100 + i}}.00ms, mfu -100.00%")
"""


@pytest.mark.slow
def test_dry_run_runs_every_command(tmp_path):
    """The dry run exits 0 with a row for each of its 8 runs (3 trainers, nanoGPT, 2 with CUDA graphs, the ViT's
    images held on the device and read from their file), each with a rate, and the header of a BENCHMARKS.md section.
    It takes bench.sh's default KERNELS=auto alone: each further choice is the same 3 commands with another
    --kernels=, and 3 more processes (15 s of the suite)."""
    (tmp_path / "nanoGPT").mkdir()
    (tmp_path / "nanoGPT" / "train.py").write_text(STAND_IN)
    env = {**os.environ, "PYTHON": sys.executable, "LOGS": str(tmp_path / "logs"), "NANOGPT": str(tmp_path / "nanoGPT"),
           "CUDA_VISIBLE_DEVICES": "", "KERNELS": "auto"}
    p = subprocess.run(["bash", os.path.join(ROOT, "bench.sh"), "--dry-run"], capture_output=True, text=True, env=env,
                       timeout=1200)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [r for r in p.stdout.splitlines() if r.startswith("| `")]
    assert len(rows) == 8 and all(" tok/s, " in r or " img/s, " in r for r in rows), p.stdout
    assert "## Dry run on a CPU (not figures)" in p.stdout and "102.5 ms/iter" in p.stdout


@pytest.mark.slow
def test_race_dry_run_scores_both_sides(tmp_path):
    """race.sh --dry-run runs the real nanoGPT (NANOGPT=a checkout) at three LRs and ours, shrunk on the CPU,
    scores every saved model of both on the whole val split, and prints a row for each run against nanoGPT's best
    final loss."""
    nanogpt = os.environ.get("NANOGPT", "")
    if not all(os.path.isfile(os.path.join(nanogpt, f)) for f in ("train.py", "model.py", "configurator.py")):
        pytest.skip("set NANOGPT=a checkout of karpathy/nanoGPT (race.sh runs its train.py and model.py)")
    # one thread a process: on 2 busy cores, torch's thread pool made each tiny step 10x slower (1.2 s, not 0.13)
    env = {**os.environ, "PYTHON": sys.executable, "LOGS": str(tmp_path / "logs"), "CUDA_VISIBLE_DEVICES": "",
           "OMP_NUM_THREADS": "1"}
    p = subprocess.run(["bash", os.path.join(ROOT, "race.sh"), "--dry-run"], capture_output=True, text=True, env=env,
                       timeout=600)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    rows = [r.split(" | ") for r in p.stdout.splitlines() if r.startswith("| nanoGPT") or r.startswith("| ours")]
    assert [r[0] for r in rows] == ["| nanoGPT, AdamW lr 6e-4", "| nanoGPT, AdamW lr 1.2e-3",
                                    "| nanoGPT, AdamW lr 1.8e-3", "| ours, Muon lr 4e-3"], p.stdout
    assert all(r[1] == "2" for r in rows), p.stdout  # each run's two saved models were scored
    finals = [float(r[3]) for r in rows]
    best = min(finals[:3])
    assert f"tokens to {best:.4f}" in p.stdout and "## Race: Dry run on a CPU (not figures)" in p.stdout
    curves = (tmp_path / "logs" / "evaluate.log").read_text().splitlines()  # "NAME | step S | val loss L | X s"
    for r in rows:  # a run reached the target if and only if one of its saved models scored at or below it
        losses = [float(c.split(" | ")[2].split()[-1]) for c in curves if c.startswith(r[0][2:] + " | step ")]
        assert len(losses) == 2 and (r[4] != "not reached") == (min(losses) <= best), (r, p.stdout)
