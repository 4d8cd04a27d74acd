"""WORKSHOP.md cannot rot: every command in it parses under its script's own parser, and every experiment runs, at a
tiny size (its own commands plus flags that shrink the model and the steps), on small data this test makes."""
import contextlib
import os
import re
import shlex
import shutil
import subprocess
import sys

import pytest

import prepare_data
import scaling
import train_diffusion
import train_gpt
import train_vit
from conftest import write_corpus
from faults import inject, parse

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TRAINERS = {"train_gpt.py": train_gpt, "train_vit.py": train_vit, "train_diffusion.py": train_diffusion}
# appended to each command, so they win over its own flags; the steps and eval cadences of GPT commands are kept
# (the fault experiment fires at step 100), on a model small enough that 150 steps take a second or two
TINY = {train_gpt: "--n_layer=1 --n_head=2 --n_embd=32 --batch_size=4 --seq_len=32 --eval_tokens=1024 --device=cpu",
        train_vit: "--n_layer=1 --n_head=2 --n_embd=32 --batch_size=16 --max_steps=4 --eval_every=2 --eval_images=32 "
                   "--device=cpu",
        train_diffusion: "--n_layer=1 --n_head=2 --n_embd=32 --patch_size=4 --batch_size=16 --max_steps=4 "
                         "--sample_steps=3 --per_class=1 --eval_samples=10 --final_samples=20 --eval_images=32 "
                         "--device=cpu"}
# a sweep of 6-7 runs of about 10-25 steps on the test corpus, and a plan within twice its largest budget
TINY_SCALING = {"sweep": ["--flops=1e9,3e9", "--ratio=1", "--min_steps=5"], "plan": ["--flops=6e9"]}


def sections():
    """{title: [argv, ...]} from the ```bash blocks of WORKSHOP.md, per '## ' section, comments and blanks dropped."""
    out, title, block = {}, None, False
    for line in open(os.path.join(ROOT, "WORKSHOP.md")):
        if line.startswith("## "):
            title = line[3:].strip()
        elif line.startswith("```"):
            block = line.strip() == "```bash" and not block
        elif block and line.strip() and not line.lstrip().startswith("#"):
            out.setdefault(title, []).append(shlex.split(line, comments=True))
    return out


SECTIONS = sections()
EXPERIMENTS = [t for t in SECTIONS if re.match(r"[1-9]\d*\. ", t)]  # section 0 is the setup


def run_command(argv, execute):
    """Parse argv under its script's own parser; with execute, also run it in this process (the cwd is scratch)."""
    env = {}
    while re.fullmatch(r"[A-Z_]+=\S*", argv[0]):
        k, v = argv.pop(0).split("=", 1)
        env[k] = v
    if argv[0] == "rm":
        assert argv[1] == "-rf" and all(not os.path.isabs(p) and ".." not in p for p in argv[2:]), argv
        return execute and [shutil.rmtree(p, ignore_errors=True) for p in argv[2:]]
    assert argv[0] == "python", f"WORKSHOP.md: only python commands run here: {argv}"
    if argv[1] == "-c":
        compile(argv[2], "<workshop>", "exec")
        if execute:
            p = subprocess.run([sys.executable, "-c", argv[2]], env={**os.environ, **env, "PYTHONPATH": ROOT},
                               capture_output=True, text=True, timeout=300)
            assert p.returncode == 0, p.stderr
        return
    if argv[1] == "-m":
        assert argv[2] == "pytest" and os.path.exists(os.path.join(ROOT, argv[3])), argv  # the suite runs it anyway
        return
    script, args = argv[1], argv[2:]
    if script == "tests/faults.py":
        spec, script, args = args[0], args[1], args[2:]
        parse(spec)
    if script in TRAINERS:
        mod = TRAINERS[script]
        cfg = mod.parse_args(mod.Config, args + (TINY[mod].split() if execute else []))
        if execute:
            with inject(mod, spec) if argv[1] == "tests/faults.py" else contextlib.nullcontext():
                mod.main(cfg)
    elif script == "scaling.py":
        args = args + (TINY_SCALING.get(args[0], []) if execute and "--published" not in args else [])
        if not execute:  # stop each subcommand before it does anything; sweep checks its train_gpt.py flags
            names = ("cmd_sweep", "cmd_lr_transfer", "cmd_fit", "cmd_plan", "cmd_coord_check", "cmd_compare")
            saved = {n: getattr(scaling, n) for n in names}
            for n in names:
                setattr(scaling, n, lambda a, extra=(): train_gpt.parse_args(train_gpt.Config, list(extra)))
            try:
                scaling.main(args)
            finally:
                for n, f in saved.items():
                    setattr(scaling, n, f)
        else:
            scaling.main(args)
    elif script == "prepare_data.py":
        args = args + (["--val_size=100"] if args[0] == "shapes" else [])
        if execute:
            prepare_data.main(args)
        else:
            saved = {n: getattr(prepare_data, n) for n in ("prepare_text", "prepare_images", "prepare_fineweb",
                                                           "prepare_gpt2")}
            for n in saved:
                setattr(prepare_data, n, lambda a: None)
            try:
                prepare_data.main(args)
            finally:
                for n, f in saved.items():
                    setattr(prepare_data, n, f)
    else:
        raise AssertionError(f"WORKSHOP.md runs a script this test does not know: {script}")


def test_the_workshop_has_its_experiments():
    """8 to 12 experiments, each with commands, a question, what to see, a result and the code to read."""
    assert 8 <= len(EXPERIMENTS) <= 12, EXPERIMENTS
    text = open(os.path.join(ROOT, "WORKSHOP.md")).read()
    for title in EXPERIMENTS:
        body = text.split("## " + title, 1)[1].split("\n## ", 1)[0]
        assert SECTIONS[title], title
        for part in ("**Question.**", "**What you should see.**", "**Measured**", "**Read**"):
            assert part in body, f"{title}: no {part}"
        for png in re.findall(r"\(assets/([\w.-]+\.png)\)", body):
            assert os.path.exists(os.path.join(ROOT, "assets", png)), png


def test_every_command_parses():
    """Each command line, setup included, is accepted by the parser of the script it runs."""
    for title, cmds in SECTIONS.items():
        for argv in cmds:
            try:
                run_command(list(argv), execute=False)
            except SystemExit as e:
                raise AssertionError(f"{title}: {shlex.join(argv)}: {e}") from None


@pytest.fixture(scope="module")
def scratch(tmp_path_factory):
    """A working directory with small stand-ins for the data the setup section prepares."""
    d = tmp_path_factory.mktemp("workshop")
    write_corpus(d / "data" / "stdlib_bpe")
    for name, rotate in (("shapes", True), ("shapes_upright", False)):
        splits = {s: prepare_data.make_shapes(n, 16, seed, rotate=rotate) for s, n, seed in (("train", 400, 0),
                                                                                            ("val", 64, 1))}
        prepare_data.write_images(d / "data" / name, splits, list(prepare_data.SHAPES), "shapes",
                                  flip_ok=rotate)
    return d


def test_each_experiment_runs_at_a_tiny_size(scratch, monkeypatch):
    """The setup's training (the judge of experiment 9) and every experiment's commands, in order, shrunk: each must
    finish without an error. The setup's data commands are stood in for by the fixture."""
    monkeypatch.chdir(scratch)
    setup = [a for t in SECTIONS if t.startswith("0. ") for a in SECTIONS[t] if "prepare_data.py" not in a]
    assert setup, "WORKSHOP.md: no training command in the setup section"
    for title, cmds in [("0. setup", setup)] + [(t, SECTIONS[t]) for t in EXPERIMENTS]:
        for argv in cmds:
            try:
                run_command(list(argv), execute=True)
            except SystemExit as e:
                raise AssertionError(f"{title}: {shlex.join(argv)}: {e}") from None


def test_the_recommendation_map_names_real_code():
    """Every `file.py:Name` the map cites is a function, class or Class.method of that file, and every row has a
    status: the map cannot point at code that was renamed or removed."""
    import ast
    text = open(os.path.join(ROOT, "WORKSHOP.md")).read()
    rows = [r for r in text.split("## Recommendation map", 1)[1].splitlines() if re.match(r"\| \d+ \|", r)]
    assert len(rows) >= 80, len(rows)
    for r in rows:
        assert re.search(r"\| (done|partly|not done|n/a) \|", r), r
    names = {}
    for f in ("train_gpt.py", "train_vit.py", "train_diffusion.py", "kernels.py", "scaling.py", "prepare_data.py"):
        tree, found = ast.parse(open(os.path.join(ROOT, f)).read()), set()
        for node in ast.walk(tree):
            if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
                found.add(node.name)
                found |= {f"{node.name}.{m.name}" for m in node.body if isinstance(m, ast.FunctionDef)}
        names[f] = found
    cited = re.findall(r"`(\w+\.py):([\w.]+)`", text)
    assert len(cited) >= 50, len(cited)
    missing = [f"{f}:{n}" for f, n in cited if n not in names.get(f, ())]
    assert not missing, f"the map cites code that does not exist: {missing}"
