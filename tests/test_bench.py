"""bench.py times a trainer on random data through its own main() (below); bench.sh, the GPU session's one command,
arrives working: its --dry-run runs every command of it on the CPU, shrunk (the tests only collected, kernels.py
--bench to its one line that it needs a GPU), and prints a row for each."""
import json
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


# ----------------------------------------------------------------------------- bench.py: a trainer's speed

SMALL = {"train_gpt.py": "--n_layer=2 --n_head=2 --n_embd=32 --seq_len=32 --batch_size=4 --vocab_size=257".split(),
         "train_vit.py": "--n_layer=1 --n_head=2 --n_embd=32 --patch_size=8 --batch_size=8".split(),
         "train_diffusion.py": "--n_layer=1 --n_head=2 --n_embd=32 --patch_size=8 --batch_size=8 --sample_steps=2 "
                               "--per_class=1".split()}
CPU = ["--device=cpu", "--compile=false", "--dtype=float32"]


@pytest.mark.parametrize("script", sorted(SMALL))
def test_bench_needs_no_data_and_leaves_nothing(script, tmp_path, monkeypatch, capsys):
    """bench.py runs a trainer's own main() on random data for 2 x --steps steps and times the second half: it needs
    no data, writes nothing where it runs, and removes its temporary folder."""
    import tempfile

    import bench
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    r = bench.main([os.path.join(ROOT, script), "--steps=2", *CPU, *SMALL[script]])
    unit = "tok_s" if script == "train_gpt.py" else "img_s"
    assert r[unit] > 0 and r["ms_per_step"] > 0 and r["mfu"] is None and r["params"] > 0 and r["steps"] == 4
    line = [x for x in capsys.readouterr().out.splitlines() if x.startswith("benchmark | ")]
    assert len(line) == 1 and " ms/step | mfu - | peak mem " in line[0] and "cpu float32" in line[0], line
    assert ("| vocab 257 |" in line[0]) == (script == "train_gpt.py")  # the vocabulary a GPT is timed at
    assert os.listdir(tmp_path) == ["tmp"] and not [n for n in os.listdir(tmp_path / "tmp") if "bench" in n]


def test_bench_says_which_vocabulary_it_times(tmp_path, monkeypatch, capsys):
    """Issue 80: with no --vocab_size, bench.py times GPT-2's 50,257 tokens, and its line says so."""
    import bench
    monkeypatch.chdir(tmp_path)
    flags = [f for f in SMALL["train_gpt.py"] if not f.startswith("--vocab_size")]
    bench.main([os.path.join(ROOT, "train_gpt.py"), "--steps=1", *CPU, *flags, "--seq_len=16", "--batch_size=2"])
    assert "| vocab 50257 (GPT-2's; --vocab_size= sets it) |" in capsys.readouterr().out


def test_bench_stopped_by_a_signal_measures_nothing(tmp_path, monkeypatch):
    import bench
    import faults
    import train_gpt as tg
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit, match="stopped by a signal at step 2; nothing measured"), \
            faults.inject(tg, "sigterm@2"):
        bench.main([os.path.join(ROOT, "train_gpt.py"), "--steps=2", *CPU, *SMALL["train_gpt.py"]])


def test_bench_profile(tmp_path, capsys):
    """--profile: 3 more steps under torch.profiler, a Chrome trace in the trainer's --out_dir and the top ops
    printed; the timed steps stay the same."""
    import bench
    out = tmp_path / "o"
    r = bench.main([os.path.join(ROOT, "train_gpt.py"), "--steps=2", "--profile", f"--out_dir={out}", *CPU,
                    *SMALL["train_gpt.py"]])
    assert r["steps"] == 2 * 2 + 3 + 1 and r["ms_per_step"] > 0
    with open(out / "trace.json") as f:
        assert any(e.get("name") == "aten::mm" for e in json.load(f)["traceEvents"])
    assert "Self CPU time total" in capsys.readouterr().out and os.listdir(out) == ["trace.json"]


@pytest.mark.parametrize("script", sorted(SMALL))
def test_the_trainers_name_bench_for_their_old_flags(script):
    """--benchmark, --bench_steps and --profile were the trainers' until issue 77: each names bench.py's command."""
    import importlib
    mod = importlib.import_module(script[:-3])
    for flag in ("--benchmark", "--bench_steps=5", "--profile"):
        with pytest.raises(SystemExit, match=f"{flag.split('=')[0]} moved: python bench.py {script}"):
            mod.parse_args(mod.Config, [flag])
