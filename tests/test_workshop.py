"""WORKSHOP.md cannot rot: every command in it parses under its script's own parser, and every experiment runs, at a
tiny size (its own commands plus flags that shrink the model and the steps), on small data this test makes."""
import os
import re
import shlex

import pytest

from commands import ROOT, commands, run_command, write_scratch_data


def sections():
    """{title: [argv, ...]} from the ```bash blocks of WORKSHOP.md, per '## ' section, comments and blanks dropped."""
    out = {}
    for title, _, argv in commands(os.path.join(ROOT, "WORKSHOP.md")):
        out.setdefault(title, []).append(argv)
    return out


SECTIONS = sections()
EXPERIMENTS = [t for t in SECTIONS if re.match(r"[1-9]\d*\. ", t)]  # section 0 is the setup


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
    return write_scratch_data(tmp_path_factory.mktemp("workshop"))


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
    """Every `file.py:Name` the map (docs/map.md, linked from WORKSHOP.md) cites is a function, class or Class.method
    of that file, and every row has a status: the map cannot point at code that was renamed or removed."""
    import ast
    text = open(os.path.join(ROOT, "docs", "map.md")).read()
    rows = [r for r in text.splitlines() if re.match(r"\| \d+ \|", r)]
    assert len(rows) >= 80, len(rows)
    for r in rows:
        assert re.search(r"\| (done|partly|not done|n/a) \|", r), r
    names = {}
    for f in ("train_gpt.py", "finetune_gpt.py", "train_vit.py", "train_diffusion.py", "kernels.py", "scaling.py",
              "prepare_data.py"):
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
