"""Shared fixtures: a tiny byte-level corpus in prepare_data.py's shard format, made fresh for the test session; a
script run as a user runs it, in this process."""
import json
import os
import random
import runpy
import sys

import pytest

import prepare_data

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_like_docs(n, seed):
    """n small Python-looking documents with learnable structure (names, indentation, arithmetic)."""
    rng = random.Random(seed)
    docs = []
    for i in range(n):
        lines = [f"# module {i}", "import math", ""]
        for j in range(rng.randint(2, 5)):
            name, arg, k = rng.choice(["area", "scale", "total", "mean"]), rng.choice("xyz"), rng.randint(1, 9)
            lines += [f"def {name}_{j}({arg}):", f"    return {arg} * {k} + math.sqrt({arg})", ""]
        docs.append("\n".join(lines))
    return docs


def write_corpus(path, n_train=300, n_val=30):
    """Write train/val shards and meta.json for a byte tokenizer (vocab 257, EOT 256 before every document)."""
    path.mkdir(parents=True, exist_ok=True)
    meta = {"format": "trainsuite-text-1", "source": "test", "tokenizer": "byte", "vocab_size": 257, "eot_id": 256,
            "pat_str": None, "tokenizer_file": None, "splits": {}, "val_gzip_bpb": 2.0, "val_xz_bpb": 1.8}
    for split, docs in (("train", python_like_docs(n_train, 0)), ("val", python_like_docs(n_val, 1))):
        tokens = []
        for d in docs:
            tokens += [256] + list(d.encode())
        prepare_data.write_shard(path / f"{split}_000000.bin", tokens)
        meta["splits"][split] = {"tokens": len(tokens), "bytes": sum(len(d.encode()) for d in docs), "docs": len(docs),
                                 "shards": [f"{split}_000000.bin"]}
    (path / "meta.json").write_text(json.dumps(meta))
    return path


@pytest.fixture(scope="session")
def corpus(tmp_path_factory):
    return write_corpus(tmp_path_factory.mktemp("corpus"))


@pytest.fixture
def as_a_user(monkeypatch, capfd):
    """run(SCRIPT, *ARGS, cwd=DIR) runs `python SCRIPT ARGS` from DIR in this process: (its exit status, what it
    wrote to stderr, as the interpreter would print a sys.exit message). A new process would pay torch's imports,
    about 3 s, for a flag that stops in milliseconds; test_bad_flags.py runs one such case in a real process."""
    def run(script, *args, cwd):
        monkeypatch.chdir(cwd)
        monkeypatch.setattr(sys, "argv", [script, *args])
        capfd.readouterr()
        status = 0
        try:
            runpy.run_path(os.path.join(ROOT, script), run_name="__main__")
        except SystemExit as e:  # sys.exit(message) prints the message and exits 1, sys.exit(n) exits n
            if isinstance(e.code, str):
                print(e.code, file=sys.stderr)
            status = 1 if isinstance(e.code, str) else e.code or 0
        return status, capfd.readouterr().err
    return run


def hellaswag_items(n, seed=0):
    """n items in HellaSwag's exact JSONL format (hellaswag_val.jsonl's keys), Python-like so the test corpora's
    tokenizers cover them; label k is the ending that follows its context's pattern."""
    rng, items = random.Random(seed), []
    for i in range(n):
        name, arg, k = rng.choice(["area", "scale", "total", "mean"]), rng.choice("xyz"), rng.randint(1, 9)
        ctx_a, ctx_b = f"def {name}_{i % 7}({arg}):", f"return {arg} *"
        endings = [f"{k} + math.sqrt({arg})", f"{arg}{arg}{arg} ((", f"import import {k}", f"= = {name} def"]
        label = rng.randrange(4)
        endings[0], endings[label] = endings[label], endings[0]
        items.append({"ind": i, "activity_label": "Python", "ctx_a": ctx_a, "ctx_b": ctx_b, "ctx": f"{ctx_a} {ctx_b}",
                      "endings": endings, "source_id": f"test~{i}", "split": "val", "split_type": "indomain",
                      "label": label})
    return items
