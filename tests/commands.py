"""The commands of the docs, understood: each command line of a ```bash block is parsed under the parser of the
script it runs, or run in this process, shrunk, in a scratch working directory that holds small stand-in data.
tests/test_workshop.py (WORKSHOP.md) and tests/test_readme.py (README.md and docs/*.md) share it, so a new command
form is taught here once."""
import codecs
import contextlib
import functools
import os
import re
import shlex
import shutil
import subprocess
import sys

import bench
import chat_gpt
import eval_gpt
import finetune_gpt
import kernels
import predict_vit
import prepare_data
import rl_gpt
import sample_diffusion
import sample_gpt
import scaling
import train_diffusion
import train_gpt
import train_vit
from conftest import write_corpus
from faults import inject, parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = {"train_gpt.py": train_gpt, "finetune_gpt.py": finetune_gpt, "chat_gpt.py": chat_gpt,
            "rl_gpt.py": rl_gpt,
            "sample_gpt.py": sample_gpt, "eval_gpt.py": eval_gpt, "train_vit.py": train_vit,
            "train_diffusion.py": train_diffusion, "predict_vit.py": predict_vit, "sample_diffusion.py": sample_diffusion}
# a companion: the trainer whose CLI shim and loop (where faults go) it uses
RUNS_ON = {finetune_gpt: train_gpt, chat_gpt: train_gpt, rl_gpt: train_gpt, sample_gpt: train_gpt,
           eval_gpt: train_gpt,
           predict_vit: train_vit, sample_diffusion: train_diffusion}
# appended to each command, so they win over its own flags; the steps and eval cadences of GPT commands are kept
# (the fault experiment fires at step 100), on a model small enough that 150 steps take a second or two
TINY = {train_gpt: "--n_layer=1 --n_head=2 --n_embd=32 --batch_size=4 --seq_len=32 --eval_tokens=1024 --device=cpu",
        finetune_gpt: "--n_layer=1 --n_head=2 --n_embd=32 --batch_size=4 --seq_len=32 --eval_tokens=1024 --device=cpu",
        # a chat model keeps its base's shape; 60 dialogues of bytes, a few steps, 4 answers sampled
        sample_gpt: "--max_new_tokens=16 --device=cpu", eval_gpt: "--device=cpu",
        chat_gpt: "--batch_size=4 --max_steps=6 --conversations=60 --eval_turns=4 --max_new_tokens=16 --device=cpu",
        # RL from such a chat model: 2 prompts a step, 2 answers each, 4 held out; bytes make long prompts
        rl_gpt: "--batch_size=2 --samples=2 --max_steps=3 --conversations=60 --eval_items=4 --pass_k=2 "
                "--max_new_tokens=8 --seq_len=256 --device=cpu",
        train_vit: "--n_layer=1 --n_head=2 --n_embd=32 --batch_size=16 --max_steps=4 --eval_every=2 --eval_images=32 "
                   "--device=cpu",
        train_diffusion: "--n_layer=1 --n_head=2 --n_embd=32 --patch_size=4 --batch_size=16 --max_steps=4 "
                         "--sample_steps=3 --per_class=1 --eval_samples=10 --final_samples=20 --eval_images=32 "
                         "--device=cpu",
        # the companions that read a finished run: its model is already small; fewer, shorter samples
        predict_vit: "--device=cpu",
        sample_diffusion: "--sample_steps=3 --per_class=1 --samples=20 --device=cpu"}
# a sweep of 6-7 runs of about 10-25 steps on the test corpus, its fit with 5 bootstrap refits (the workshop asks 50,
# 13 s here) from 32 starts, not the 4,500 of Hoffmann et al.'s grid (10 s here; test_scaling checks the intervals and
# the fit from the whole grid), and a plan within twice its largest budget
SMALL_GRID = '{"e": [-0.5, 0.5], "a": [5, 15], "b": [5, 15], "alpha": [0.5, 1], "beta": [0.5, 1]}'
TINY_SCALING = {"sweep": ["--flops=1e9,3e9", "--ratio=1", "--min_steps=5"],
                "fit": ["--bootstrap=5", f"--param_grid={SMALL_GRID}"], "plan": ["--flops=6e9"]}
FENCES = ("```bash", "```sh", "```shell")  # the blocks that hold commands; other blocks (output, Python) do not


def split_line(line):
    """The commands of one shell line, each an argv: a leading '$ ' prompt and a trailing '# comment' dropped,
    $'...' (bash's C-style quoting) decoded, and `a && b` split in two."""
    line = re.sub(r"^\s*\$ ", "", line)
    line = re.sub(r"\$'((?:[^'\\]|\\.)*)'", lambda m: shlex.quote(codecs.decode(m[1], "unicode_escape")), line)
    cmds = [[]]
    for word in shlex.split(line, comments=True):
        if word == "&&":
            cmds.append([])
        else:
            cmds[-1].append(word)
    return [c for c in cmds if c]


def commands(path, shown=False):
    """[(section, line number, argv)] for the commands of the ```bash blocks of a markdown file (section: the title
    of the '## ' heading above); a trailing backslash continues a line. With shown, the '$ '-prompted commands of the
    other blocks instead (the commands of sample output)."""
    out, section, fence, start, text = [], "", None, 0, ""
    for n, line in enumerate(open(path), 1):
        if fence is None and line.startswith("## "):
            section = line[3:].strip()
        if line.lstrip().startswith("```"):
            fence = line.strip() if fence is None else None
            continue
        wanted = (fence not in (None, *FENCES) and line.startswith("$ ")) if shown else fence in FENCES
        if not wanted:
            continue
        start, text = start if text else n, text + line.rstrip("\n")
        if text.endswith("\\"):
            text = text[:-1]
            continue
        out += [(section, start, argv) for argv in split_line(text)]
        text = ""
    return out


def split_env(argv):
    """({NAME: value} of the VAR=value words that open a command, the rest of argv)."""
    env, argv = {}, list(argv)
    while argv and re.fullmatch(r"[A-Z_][A-Z0-9_]*=\S*", argv[0]):
        k, v = argv.pop(0).split("=", 1)
        env[k] = v
    return env, argv


@functools.cache
def interpreter_error():
    """Why this triton's interpreter cannot run our kernels, or "" (triton 3.6's cannot: test_kernels.py skips them
    and says why), asked in a subprocess since the interpreter patches triton for its whole process."""
    code = "import test_kernels; print(test_kernels.interpreter_error() or '')"
    env = {**os.environ, "CUDA_VISIBLE_DEVICES": "", "PYTHONPATH": os.pathsep.join([ROOT, f"{ROOT}/tests"])}
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, env=env)
    assert p.returncode == 0, p.stderr
    return p.stdout.strip()


def workshop_tiny(script, args):
    """The flags appended to a command that runs (they win over its own): TINY for a trainer, TINY_SCALING for a
    scaling.py subcommand that trains or plans from its own fit, a small val split for shapes."""
    if script in TRAINERS:  # a GPT command with no budget of its own would train for the default 240 s
        budgets = ("--max_steps", "--tokens", "--time_budget")
        free = TRAINERS[script] is train_gpt and not any(a.startswith(budgets) for a in args)
        return TINY[TRAINERS[script]].split() + ["--max_steps=20"] * free
    if script == "scaling.py":
        return [] if "--published" in args else TINY_SCALING.get(args[0], [])
    if script == "prepare_data.py":
        return ["--val_size=100"] if args[:1] == ["shapes"] else []
    return []


@contextlib.contextmanager
def stubbed(module, names, stub):
    """Within it, module's functions `names` are stub: a command then parses its flags and stops before any work."""
    saved = {n: getattr(module, n) for n in names}
    for n in names:
        setattr(module, n, stub)
    try:
        yield
    finally:
        for n, f in saved.items():
            setattr(module, n, f)


def run_command(argv, execute, tiny=workshop_tiny):
    """Parse argv (one command) under its script's own parser; with execute, also run it in this process (the cwd is
    a scratch dir) with tiny(script, args) appended. Returns a trainer's Config (else None). A command form this
    does not know fails: a new form in the docs has to be taught here."""
    env, argv = split_env(argv)
    head, args = argv[0], argv[1:]
    if head == "rm":
        assert args[0] == "-rf" and all(not os.path.isabs(p) and ".." not in p for p in args[1:]), argv
        for p in args[1:] if execute else ():
            shutil.rmtree(p, ignore_errors=True)
        return None
    if head == "pip":  # an install: its requirements file must exist; it never runs here
        assert args[:1] == ["install"] and not execute, f"pip: only 'pip install', and never run here: {argv}"
        assert "-r" not in args or os.path.exists(os.path.join(ROOT, args[args.index("-r") + 1])), argv
        return None
    if head == "bash":  # bench.sh or race.sh: GPU commands that must parse (tests/test_bench.py runs their --dry-run)
        assert args[:1] in (["bench.sh"], ["race.sh"]) and not execute, f"bash: a GPU script, never run here: {argv}"
        subprocess.run(["bash", "-n", os.path.join(ROOT, args[0])], check=True)
        return None
    if head == "torchrun":  # torchrun's own parser, then the script's part under the script's parser
        from torch.distributed.run import get_args_parser
        assert not execute, f"torchrun starts several processes and is never run here: {argv}"
        p = get_args_parser()
        p.error = lambda msg: sys.exit(f"torchrun: error: {msg}")
        a = p.parse_args(args)
        return run_command(["python", a.training_script, *a.training_script_args], execute=False)
    assert head in ("python", "python3"), f"a command form this test does not know: {shlex.join(argv)}"
    if args[0] == "-c":
        compile(args[1], "<docs>", "exec")
        if execute:  # a failure under Triton's interpreter is excused where the interpreter cannot run our kernels
            p = subprocess.run([sys.executable, "-c", args[1]], env={**os.environ, **env, "PYTHONPATH": ROOT},
                               capture_output=True, text=True, timeout=300)
            assert p.returncode == 0 or (env.get("TRITON_INTERPRET") and interpreter_error()), p.stderr
        return None
    if args[0] == "-m":  # the suite runs pytest anyway; the paths it names must exist
        assert args[1] == "pytest", f"python -m: only pytest is known: {argv}"
        paths = [a.split("::")[0] for a in args[2:] if a.startswith("tests") or a.endswith(".py")]
        missing = [a for a in paths if not os.path.exists(os.path.join(ROOT, a))]
        assert not missing, f"python -m pytest names paths that do not exist: {missing}"
        return None
    script, args = args[0], args[1:]
    if script == "tests/faults.py":
        spec, script, args = args[0], args[1], args[2:]
        parse(spec)
    extra = tiny(script, args) if execute else []
    if script in TRAINERS:
        mod = TRAINERS[script]
        cfg = RUNS_ON.get(mod, mod).parse_args(mod.Config, args + extra)
        if execute:
            with inject(RUNS_ON.get(mod, mod), spec) if argv[1] == "tests/faults.py" else contextlib.nullcontext():
                mod.main(cfg)
        return cfg
    if script == "bench.py":  # the trainer's flags under its own parser, bench.py's --steps and --profile aside
        trainer = TRAINERS[args[0]]
        trainer.parse_args(trainer.Config, [a for a in args[1:] if not a.startswith(("--steps=", "--profile"))])
        if execute:
            bench.main([os.path.join(ROOT, args[0]), *args[1:], *extra])
        return None
    if script == "scaling.py":
        # unless run, stop each subcommand before it does anything; sweep and lr_transfer check their train_gpt.py flags
        names = ("cmd_sweep", "cmd_lr_transfer", "cmd_fit", "cmd_plan", "cmd_coord_check", "cmd_compare",
                 "cmd_sharpness")
        with contextlib.nullcontext() if execute else stubbed(
                scaling, names, lambda a, extra=(): train_gpt.parse_args(train_gpt.Config, list(extra))):
            scaling.main(args + extra)
    elif script == "prepare_data.py":
        names = ("prepare_text", "prepare_images", "prepare_fineweb", "prepare_gpt2", "prepare_hellaswag",
                 "prepare_core")
        with contextlib.nullcontext() if execute else stubbed(prepare_data, names, lambda a: None):
            prepare_data.main(args + extra)
    elif script == "kernels.py":  # its only flag is --bench (a GPU's timings); without it, it prints its docstring
        assert args in ([], ["--bench"]), f"kernels.py takes only --bench: {argv}"
        if execute and args:
            kernels.bench()
        elif execute:
            print(kernels.__doc__)
    else:
        raise AssertionError(f"a script this test does not know: {script}")
    return None


def write_scratch_data(d, n_val=30):
    """Small stand-ins, in d, for the default data: the stdlib corpus (bytes, n_val val documents), rotated and
    upright shapes of 16x16."""
    write_corpus(d / "data" / "stdlib_bpe", n_val=n_val)
    for name, rotate in (("shapes", True), ("shapes_upright", False)):
        splits = {s: prepare_data.make_shapes(n, 16, seed, rotate=rotate) for s, n, seed in (("train", 400, 0),
                                                                                            ("val", 64, 1))}
        prepare_data.write_images(d / "data" / name, splits, list(prepare_data.SHAPES), "shapes", flip_ok=rotate)
    return d
