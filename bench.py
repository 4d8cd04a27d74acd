"""
bench.py: how fast a trainer trains, on random data in its own format, through its own main().

  python bench.py train_gpt.py --preset=gpt2_124m             # tok/s, ms a step, MFU, peak memory
  python bench.py train_vit.py --preset=cifar10 --steps=50    # any flag of the trainer, and bench.py's own
  python bench.py train_gpt.py --preset=gpt2_124m --profile   # + trace.json of 3 more steps, and the top ops
  torchrun --nproc_per_node=8 bench.py train_gpt.py --preset=gpt2_124m

Timing is a job of its own, as nanoGPT's bench.py is beside its train.py: this script writes random tokens (of
--vocab_size, GPT-2's 50,257 by default) or random images (of --image_size, 32 by default, in 10 classes) to a
temporary folder, and runs the trainer's main() on them for 2 x --steps steps with a log line every --steps steps.
The first --steps compile, autotune and fill the allocator; the next --steps are timed. A log step is the only
place where the host waits for the device, as in a real run, so the figure is the device's pace with the host
queueing ahead of it, and not that of a loop that waits on every step. Its flags, beside the trainer's:

  --steps=N      steps timed, after as many to warm up (20)
  --profile      3 more steps under torch.profiler: a Chrome trace in --out_dir, and the top ops printed
"""
import dataclasses
import importlib.util
import json
import os
import shutil
import sys
import tempfile

import numpy as np
import torch

import prepare_data

PROFILED = 3  # steps that --profile traces, after the timed ones


def load_trainer(path):
    """The trainer module at path (train_gpt.py, train_vit.py or train_diffusion.py)."""
    name = os.path.splitext(os.path.basename(path))[0]
    if not (os.path.isfile(path) and name in ("train_gpt", "train_vit", "train_diffusion")):
        raise SystemExit(f"bench.py: error: {path!r} is not a trainer; give train_gpt.py, train_vit.py or "
                         f"train_diffusion.py")
    loaded = sys.modules.get(name)
    if loaded and os.path.samefile(loaded.__file__, path):  # imported already (a test's): the same module
        return loaded
    sys.path.insert(0, os.path.dirname(os.path.abspath(path)))  # it imports kernels from beside it
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def random_tokens(data_dir, cfg, world_size):
    """Shards of random token ids for train_gpt.py: a few steps' rows to train on, one batch to evaluate."""
    vocab = cfg.vocab_size or 50257
    rng = np.random.default_rng(0)
    rows = cfg.batch_size * world_size * max(cfg.grad_accum, 1)
    sizes = {"train": 4 * rows * cfg.seq_len + 1, "val": cfg.batch_size * world_size * cfg.seq_len + 1}
    meta = {"format": "trainsuite-text-1", "source": "random", "tokenizer": "ids", "vocab_size": vocab,
            "eot_id": None, "tokenizer_file": None, "splits": {}}
    os.makedirs(data_dir)
    for split, n in sizes.items():
        prepare_data.write_shard(os.path.join(data_dir, f"{split}_000000.bin"), rng.integers(0, vocab, n))
        meta["splits"][split] = {"tokens": n, "bytes": 0, "shards": [f"{split}_000000.bin"]}
    with open(os.path.join(data_dir, "meta.json"), "w") as f:
        json.dump(meta, f)


def random_images(data_dir, cfg, world_size):
    """Random uint8 images of 10 classes for train_vit.py and train_diffusion.py: a few steps' worth, and 64 to
    evaluate."""
    size = cfg.image_size or 32
    rng = np.random.default_rng(0)
    n = 4 * cfg.batch_size * world_size * cfg.grad_accum
    splits = {s: (rng.integers(0, 256, (k, size, size, 3), np.uint8), rng.integers(0, 10, k))
              for s, k in (("train", n), ("val", 64))}
    prepare_data.write_images(data_dir, splits, [str(k) for k in range(10)], "random")


def timed(trainer, cfg, steps, profile):
    """The run's result and its timed log record: main() on cfg for 2 x steps steps (and the profiled ones)."""
    # The trainer's schedule function is called at the start of each step (tests/faults.py finds the steps so too):
    # here it resets the peak memory after the warm-up, and starts and stops the profiler
    lr_mult = trainer.lr_mult

    def at_step(c, step, progress):
        if step == steps and torch.cuda.is_available():
            torch.cuda.reset_peak_memory_stats()  # the timed steps' peak, not the compile's
        if profile and step == 2 * steps:
            profile.start()
        if profile and step == 2 * steps + PROFILED:
            profile.stop()
        return lr_mult(c, step, progress)
    trainer.lr_mult = at_step
    try:
        result = trainer.main(cfg)
    finally:
        trainer.lr_mult = lr_mult
    if result.get("preempted"):
        raise SystemExit(f"bench.py: error: stopped by a signal at step {result['steps']}; nothing measured")
    with open(os.path.join(cfg.out_dir, "metrics.jsonl")) as f:
        logs = [r for r in map(json.loads, f) if "loss" in r]
    return result, next(r for r in logs if r["step"] == 2 * steps)


def main(argv):
    """bench.py TRAINER [--steps=N] [--profile] [TRAINER'S FLAGS]: print the trainer's speed; returns the figures."""
    if not argv or argv[0].startswith("-"):
        raise SystemExit(__doc__.strip().split("\n\n")[0] + "\n\n" + __doc__.strip().split("\n\n")[1])
    trainer = load_trainer(argv[0])
    steps, profile, flags = 20, False, []
    for a in argv[1:]:
        if a.startswith("--steps="):
            steps = int(a.split("=", 1)[1]) if a.split("=", 1)[1].isdigit() else 0
            if steps < 1:
                trainer.die(f"{a}: give the steps to time, a whole number >= 1")
        elif a in ("--profile", "--profile=true"):
            profile = True
        else:
            flags.append(a)
    cfg = trainer.parse_args(trainer.Config, flags)
    world_size = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    # one folder for all the ranks of this machine (FSDP2 writes its shards beside rank 0's files): named by
    # torchrun's process, the parent of every rank
    work = os.path.join(tempfile.gettempdir(), f"trainsuite_bench_{os.getppid() if world_size > 1 else os.getpid()}")
    data_dir = os.path.join(work, f"data_{rank}")  # each rank its own copy: no rank reads a half-written file
    shutil.rmtree(data_dir, ignore_errors=True)
    gpt = trainer.__name__ == "train_gpt"
    (random_tokens if gpt else random_images)(data_dir, cfg, world_size)
    # The run: 2 x steps, a log line (a sync) every steps; no eval but the last one, of a small val split, and no
    # save but the last one, in the temporary folder
    fields = trainer.Config.__dataclass_fields__
    small = dict(eval_images=64, eval_samples=0, final_samples=0, eval_classifier="", fid_weights="",
                 sample_tokens=0, tokens="", epochs=0.0)
    run = dict(data_dir=data_dir, out_dir=os.path.join(work, "out"), max_steps=2 * steps + (PROFILED + 1) * profile,
               log_every=steps, eval_every=0, save_every=0, time_budget=0.0, resume=False, wandb="", description="")
    if getattr(cfg, "n_embd", None) == 0:  # the ViT's auto width: 64 under 10,000 train images, as these are, else
        run["n_embd"] = 128  # 128, which real data of that size gets
    cfg = dataclasses.replace(cfg, **{k: v for k, v in small.items() if k in fields}, **run)
    profiler = torch.profiler.profile() if profile else None
    try:
        result, rec = timed(trainer, cfg, steps, profiler)
        with open(os.path.join(cfg.out_dir, "config.json")) as f:
            dtype = json.load(f)["dtype"]  # the precision the run took (auto: by the device)
    finally:  # the folder goes, with the run's checkpoint and the results.tsv row it wrote beside it
        shutil.rmtree(work if rank == 0 else data_dir, ignore_errors=True)
    unit = "tok" if gpt else "img"
    x = rec[f"{unit}_s"]
    if x >= 1e6:
        rate = f"{x / 1e6:.2f}M"
    elif x >= 1e3:
        rate = f"{x / 1e3:.1f}k"
    else:
        rate = f"{x:.0f}"
    mfu = f"mfu {100 * rec['mfu']:.1f}%" if rec["mfu"] else "mfu -"
    device = torch.cuda.get_device_name() if torch.cuda.is_available() and cfg.device != "cpu" else "cpu"
    what = f"{trainer.__name__}.py {cfg.preset or 'default'} | {result['params'] / 1e6:.1f}M params"
    if gpt:  # the vocabulary sets the head's size, which at a small width is most of the step
        given = trainer.parse_args(trainer.Config, flags).vocab_size
        what += f" | vocab {cfg.vocab_size or 50257}" + ("" if given else " (GPT-2's; --vocab_size= sets it)")
    print(f"benchmark | {what} | {device} {dtype} compile {cfg.compile} | {rate} {unit}/s | {rec['ms']:.1f} ms/step"
          f" | {mfu} | peak mem {result['peak_mem_gb']:.2f} GB")
    if profiler and rank == 0:
        out_dir = trainer.parse_args(trainer.Config, flags).out_dir  # the trainer's own --out_dir
        os.makedirs(out_dir, exist_ok=True)
        profiler.export_chrome_trace(os.path.join(out_dir, "trace.json"))
        key = "self_device_time_total" if torch.cuda.is_available() else "self_cpu_time_total"
        print(profiler.key_averages().table(sort_by=key, row_limit=25, max_name_column_width=60))
        print(f"profile of {PROFILED} steps: {out_dir}/trace.json")
    return {f"{unit}_s": x, "ms_per_step": rec["ms"], "mfu": rec["mfu"], "peak_mem_gb": result["peak_mem_gb"],
            "params": result["params"], "steps": result["steps"]}


if __name__ == "__main__":
    main(sys.argv[1:])
