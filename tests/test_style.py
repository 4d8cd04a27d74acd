"""House rules of STYLE.md that a machine can check: shared fences byte-identical, imports without side effects."""
import pathlib
import re
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
SCRIPTS = sorted(ROOT.glob("train_*.py"))


def test_shared_fences_are_byte_identical():
    blocks = {}
    for p in SCRIPTS:
        text = p.read_text()
        assert text.count("# === shared: ") == text.count("# === end shared ==="), p.name
        for m in re.finditer(r"# === shared: (\S+) ===\n(.*?)# === end shared ===", text, re.S):
            blocks.setdefault(m.group(1), {})[p.name] = m.group(2)
    assert blocks, "no shared fences found"
    for name, by_file in blocks.items():
        assert len(set(by_file.values())) == 1, f"shared block {name!r} differs between {sorted(by_file)}"


def test_each_fence_is_in_every_script_that_shares_it():
    """The machinery in every trainer, the images fence in both image trainers: a fence dropped from one file would
    escape the comparison above, and its copy would drift."""
    fences = {p.name: set(re.findall(r"^# === shared: (\S+) ===$", p.read_text(), re.M)) for p in SCRIPTS}
    assert all("machinery" in names for names in fences.values()), fences
    assert {p for p, names in fences.items() if "images" in names} == {"train_vit.py", "train_diffusion.py"}, fences


def test_importing_scripts_has_no_side_effects(tmp_path):
    """Import every script from an empty working dir: nothing is printed, no file is written."""
    names = [p.stem for p in SCRIPTS] + ["finetune_gpt", "prepare_data", "scaling"]
    code = f"import sys; sys.path.insert(0, {str(ROOT)!r}); " + "; ".join(f"import {n}" for n in names)
    p = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    assert p.stdout == "" and list(tmp_path.iterdir()) == []
