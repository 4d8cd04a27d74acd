"""
tests/reference.py: the reference curve of a default run, which its trainer prints beside each eval.

  python train_gpt.py
  python tests/reference.py out/gpt --machine="slow AVX2 (2-core AMD EPYC)" --commit=5b97633

reads a finished run's config.json and metrics.jsonl and writes assets/reference_SCRIPT.json: its metrics at each
eval, the steps it ended at, and the machine, dtype and commit they came from, with how far worse than the
reference a run may be before its eval line says what to check (FAR, below). A trainer compares a run with the
file only when the run's config equals the file's, the fields of FREE_FIELDS aside (out_dir, seed, budget...), so
`tests/test_reference.py` fails when a default changes until the run is made again and this is run on it.
--commit names the commit whose trainer made the run: the run's copy of the script must equal that commit's.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# How much worse than the reference a metric may be at the same step before the run is called far off. Wide: under
# the time budget another machine makes other steps and moves the schedule, a second seed moves every figure, and
# the DiT's denoising loss is noisy (0.456, 0.541, 0.437 at steps 2,000, 3,000 and 3,909 of the reference run);
# narrow enough that a wrong data folder, an LR far off or a broken recipe shows (the GPT's first eval after 250
# steps was 1.58 bits per byte against 3.27 at step 0, the ViT's 81% against 12%).
FAR = {
    "train_gpt": {"val_bpb": 0.15},
    "train_vit": {"val_acc": 0.10, "ema_val_acc": 0.10},
    "train_diffusion": {"ema_val_loss": 0.15, "clf_acc": 0.10},
}


def script_of(run):
    """The trainer that made the run: the one train_*.py that start_log copied into it."""
    names = [n for n in os.listdir(run) if n.startswith("train_") and n.endswith(".py")]
    if len(names) != 1:
        sys.exit(f"{run}: expected one train_*.py copied by its trainer, found {names or 'none'}")
    return names[0]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run", help="a finished run's out_dir")
    p.add_argument("--machine", required=True, help="the machine it ran on, in words")
    p.add_argument("--commit", required=True, help="the commit whose trainer made it")
    args = p.parse_args(argv)
    script = script_of(args.run)
    theirs = subprocess.run(["git", "show", f"{args.commit}:{script}"], cwd=ROOT, capture_output=True, text=True)
    with open(os.path.join(args.run, script)) as f:
        if theirs.returncode or theirs.stdout != f.read():
            sys.exit(f"{args.run}/{script} is not {script} of commit {args.commit}: name the commit that made it")
    with open(os.path.join(args.run, "config.json")) as f:
        config = json.load(f)
    name = script[:-3]
    curve, last = {}, None
    with open(os.path.join(args.run, "metrics.jsonl")) as f:
        for line in f:
            rec = json.loads(line)
            got = {k: rec[k] for k in FAR[name] if k in rec}
            if got and "event" not in rec:
                curve[str(rec["step"])] = {k: round(v, 5) for k, v in got.items()}
                last = rec["step"]
    if last is None:
        sys.exit(f"{args.run}/metrics.jsonl holds no eval of {', '.join(FAR[name])}: is the run finished?")
    # the config as the run wrote it: --dtype=auto resolved (float32 on a CPU), so a run in another precision, as a
    # GPU's bf16, compares with nothing
    ref = {"script": script, "machine": args.machine, "dtype": config["dtype"], "commit": args.commit,
           "final_step": last, "far": FAR[name], "config": config, "curve": curve}
    path = os.path.join(ROOT, "assets", f"reference_{name}.json")
    with open(path + ".tmp", "w") as f:
        json.dump(ref, f, indent=1)
        f.write("\n")
    os.replace(path + ".tmp", path)
    print(f"{path}: {len(curve)} evals, the last at step {last}")


if __name__ == "__main__":
    main()
