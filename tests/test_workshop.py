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
    """8 to 13 experiments, each with commands, a question, what to see, a result and the code to read."""
    assert 8 <= len(EXPERIMENTS) <= 13, EXPERIMENTS
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


STATUSES = ("done", "partly", "partly (untested)", "not done", "n/a")
SOURCES = ("registry", "stability", "cookbook", "recipes", "scaling")


def map_rows():
    """(text of docs/map.md, [(number, source, recommendation, status, where, shown by)] of its rows)."""
    text = open(os.path.join(ROOT, "docs", "map.md")).read()
    rows = [tuple(c.strip() for c in line.strip()[1:-1].split(" | ")) for line in text.splitlines()
            if re.match(r"\| \d+ \|", line)]
    return text, rows


def defined(path):
    """The functions and classes of a Python file, and Class.method for each method."""
    import ast
    found = set()
    for node in ast.walk(ast.parse(open(os.path.join(ROOT, path)).read())):
        if isinstance(node, (ast.FunctionDef, ast.ClassDef)):
            found.add(node.name)
            found |= {f"{node.name}.{m.name}" for m in node.body if isinstance(m, ast.FunctionDef)}
    return found


def test_the_recommendation_map_names_real_code_and_tests():
    """Every `file.py:Name` the map (docs/map.md, linked from WORKSHOP.md) cites is a function, class or Class.method
    of that file, and every `tests/FILE.py::test_name` a test function of that file; every row has a status, and every
    done row names the test that shows it: the map cannot point at code or tests that were renamed or removed."""
    text, rows = map_rows()
    assert len(rows) >= 80 and all(len(r) == 6 for r in rows), [r for r in rows if len(r) != 6][:3]
    assert [int(r[0]) for r in rows] == list(range(1, len(rows) + 1))
    for r in rows:
        assert r[1] in SOURCES and r[3] in STATUSES, r
        assert r[3] != "done" or re.search(r"`tests/\w+\.py::test_\w+`", r[5]), f"row {r[0]} is done but names no test"
    cited = re.findall(r"`(\w+\.py):([\w.]+)`", text)
    assert len(cited) >= 50, len(cited)
    # each file parsed once (it was once per name cited in it: 18 s of the suite)
    names = {f: defined(f) for f in {f for f, _ in cited} if os.path.exists(os.path.join(ROOT, f))}
    missing = [f"{f}:{n}" for f, n in cited if n not in names.get(f, ())]
    assert not missing, f"the map cites code that does not exist: {missing}"
    tests = re.findall(r"`tests/(\w+\.py)::(\w+)`", text)
    assert len(tests) >= 100, len(tests)
    found = {f: defined(os.path.join("tests", f)) for f in {f for f, _ in tests}
             if os.path.exists(os.path.join(ROOT, "tests", f))}
    missing = [f"tests/{f}::{n}" for f, n in tests if not (n.startswith("test_") and n in found.get(f, ()))]
    assert not missing, f"the map names tests that do not exist: {missing}"


def test_the_map_counts_its_rows():
    """The table at the top of the map counts its rows by status and by document, and the README's pointer to the map
    gives the same totals: a row whose status changes changes the counts, or this fails."""
    text, rows = map_rows()
    table = {line.split(" | ")[0][2:]: [int(v) for v in line.strip()[1:-1].split(" | ")[1:]]
             for line in text.splitlines() if re.match(r"\| (done|partly|not done|n/a|all)[ (a-z)]* \| \d", line)}
    want = {s: [sum(r[3] == s and r[1] == src for r in rows) for src in SOURCES] for s in STATUSES}
    want["all"] = [sum(r[1] == src for r in rows) for src in SOURCES]
    assert table == {s: v + [sum(v)] for s, v in want.items()}, table
    readme = " ".join(open(os.path.join(ROOT, "README.md")).read().split())
    m = re.search(r"\(docs/map\.md\):[^[]*? of (\d+) recommendations, (\d+) done .*?, (\d+) partly, (\d+) not done and "
                  r"(\d+) not applicable", readme)
    assert m, "README.md: the pointer to docs/map.md gives no counts"
    n = {s: sum(r[3] == s for r in rows) for s in STATUSES}
    assert [int(v) for v in m.groups()] == [len(rows), n["done"], n["partly"] + n["partly (untested)"], n["not done"],
                                            n["n/a"]]
