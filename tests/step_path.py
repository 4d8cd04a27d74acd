"""The step path of a trainer: the code a reader must read to follow one training step (issue 77).

    python tests/step_path.py [train_gpt.py train_vit.py train_diffusion.py]   # tokens, places, and the places

The method, the same each time: run the trainer's main() on tiny data for 4 steps that all log (log_every=1, no eval
or save before the end), tracing with sys.settrace which of its definitions run. The path is the union of
  - the Config class, whole;
  - train(), from its def to the end of its loop (what follows the loop is the run's end, not a step);
  - every definition that runs in steps 2 and 3 (a plain step with its sync and log line), wherever it lies, the
    machinery included: a function whole; a method with its class's header line and __init__, where the object's
    state is set;
  - the definitions that train() calls itself before its loop and that lie outside the machinery fence (the setup a
    step reads: the model, the loader, the optimizers, the precision), whole, but not what they call in turn.
Tokens are code tokens as tests/test_style.py and ../shared/tools/readability.py count them (no comments,
docstrings or layout). Places are the separate line ranges of the path, where a gap of up to 30 lines of other code
(a screen a reader scrolls past) does not start a new place, and comments, docstrings and blank lines never do.
"""
import ast
import io
import os
import re
import sys
import tempfile
import tokenize

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCREEN = 30  # lines of other code a reader scrolls past without losing the place
SKIP = {tokenize.COMMENT, tokenize.NL, tokenize.NEWLINE, tokenize.INDENT, tokenize.DEDENT, tokenize.ENCODING,
        tokenize.ENDMARKER}


def code_tokens_by_line(src):
    """{line: code tokens starting there}, docstrings excluded, as readability.py counts."""
    doc = set()
    for node in ast.walk(ast.parse(src)):
        body = getattr(node, "body", None)
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and body:
            first = body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(
                    first.value.value, str):
                doc.update(range(first.lineno, first.end_lineno + 1))
    per_line = {}
    for tok in tokenize.generate_tokens(io.StringIO(src).readline):
        if tok.type not in SKIP and tok.start[0] not in doc:
            per_line[tok.start[0]] = per_line.get(tok.start[0], 0) + 1
    return per_line


def span(node):
    """(first line, last line) of a def or class, its decorators included."""
    first = min([node.lineno] + [d.lineno for d in getattr(node, "decorator_list", [])])
    return first, node.end_lineno


class Defs:
    """The module-level functions and classes of a trainer's source, and the methods of its classes."""

    def __init__(self, src):
        self.tree = ast.parse(src)
        self.top = [n for n in self.tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))]
        m = re.search(r"# === shared: machinery ===\n.*?# === end shared ===\n", src, re.S)
        self.fence = (src[:m.start()].count("\n") + 1, src[:m.end()].count("\n")) if m else (0, -1)

    def owner(self, line):
        """(the module-level def or class holding line, the method of that class holding it or None)."""
        for node in self.top:
            a, b = span(node)
            if a <= line <= b:
                if isinstance(node, ast.ClassDef):
                    for item in node.body:
                        if isinstance(item, ast.FunctionDef) and span(item)[0] <= line <= span(item)[1]:
                            return node, item
                return node, None
        return None, None

    def lines_of(self, node, method):
        """The lines a reader reads for a run of node (a function whole; a method: the class line, __init__, it)."""
        if method is None:
            a, b = span(node)
            return set(range(a, b + 1))
        lines = {node.lineno}
        for item in node.body:
            if isinstance(item, ast.FunctionDef) and item.name == "__init__":
                lines |= set(range(span(item)[0], span(item)[1] + 1))
        lines |= set(range(span(method)[0], span(method)[1] + 1))
        return lines

    def in_machinery(self, node):
        return self.fence[0] <= node.lineno <= self.fence[1]

    def named(self, name):
        return next(n for n in self.top if n.name == name)


def trace_run(module, cfg, path, defs, train_node, loop_line):
    """(definitions run in steps 2 and 3, definitions train() called itself before its loop): sets of
    (node, method) for the trainer file at path."""
    in_steps, setup = set(), set()
    state = {"tops": 0, "loop": False}  # loop tops seen; whether train() has reached its loop
    seen_codes = {}

    def where(code):
        if code not in seen_codes:
            seen_codes[code] = defs.owner(code.co_firstlineno) if code.co_filename == path else (None, None)
        return seen_codes[code]

    def local(frame, event, arg):  # line events of train() itself: count the loop's tops
        if event == "line" and frame.f_lineno == loop_line:
            state["tops"] += 1
            state["loop"] = True
        return local

    def calls(frame, event, arg):
        if event != "call":
            return None
        code = frame.f_code
        if code.co_filename != path:
            return None
        node, method = where(code)
        if node is None:
            return None
        if node is train_node:
            return local
        if 2 <= state["tops"] <= 3:  # the steps from loop top 2 to loop top 4: steps 2 and 3
            in_steps.add((node, method))
        caller = frame.f_back
        if not state["loop"] and caller is not None and where(caller.f_code)[0] is train_node:
            setup.add((node, method))
        return None

    sys.settrace(calls)
    try:
        module.main(cfg)
    finally:
        sys.settrace(None)
    return in_steps, setup


def tiny_config(name, module, data, out):
    """A config of 4 logged steps, no eval or save before the end, on CPU in fp32."""
    common = dict(device="cpu", compile="false", dtype="float32", max_steps=4, log_every=1, eval_every=0,
                  save_every=0, time_budget=0.0, out_dir=out, data_dir=data, n_layer=2, n_head=2, batch_size=8)
    extra = {
        "train_gpt": dict(n_embd=32, seq_len=32, sample_tokens=0),
        "train_vit": dict(n_embd=32, patch_size=4, eval_images=16),
        "train_diffusion": dict(n_embd=32, patch_size=4, eval_images=16, eval_samples=4, final_samples=4,
                                sample_steps=2, per_class=1),
    }[name]
    fields = module.Config.__dataclass_fields__
    return module.Config(**{k: v for k, v in {**common, **extra}.items() if k in fields})


def make_data(name, root):
    """A data dir for the trainer: tiny shards of bytes, or 16x16 shapes."""
    sys.path.insert(0, ROOT)
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import pathlib
    import prepare_data
    if name == "train_gpt":
        from conftest import write_corpus
        return str(write_corpus(pathlib.Path(root) / "corpus", n_train=40, n_val=4))
    d = pathlib.Path(root) / "shapes"
    splits = {"train": prepare_data.make_shapes(256, 16, 0), "val": prepare_data.make_shapes(32, 16, 1)}
    prepare_data.write_images(d, splits, list(prepare_data.SHAPES), "shapes")
    return str(d)


def step_path(script, data=None):
    """{tokens, places, ranges: [(first, last)]} of the trainer script's step path (the method above)."""
    import contextlib
    import importlib
    sys.path.insert(0, ROOT)
    name = os.path.splitext(os.path.basename(script))[0]
    module = importlib.import_module(name)
    path = module.__file__
    src = open(path).read()
    defs = Defs(src)
    train_node = defs.named("train")
    loop = next(n for n in ast.walk(train_node) if isinstance(n, ast.While))
    with tempfile.TemporaryDirectory() as tmp:
        cfg = tiny_config(name, module, data or make_data(name, tmp), os.path.join(tmp, "out"))
        with open(os.devnull, "w") as quiet, contextlib.redirect_stdout(quiet):
            in_steps, setup = trace_run(module, cfg, path, defs, train_node, loop.body[0].lineno)
    lines = defs.lines_of(defs.named("Config"), None)
    lines |= set(range(span(train_node)[0], loop.end_lineno + 1))
    for node, method in in_steps:
        lines |= defs.lines_of(node, method)
    for node, method in setup:
        if not defs.in_machinery(node):
            lines |= defs.lines_of(node, method)
    per_line = code_tokens_by_line(src)
    code = sorted(line for line in lines if line in per_line)  # lines of the path with code on them
    ranges = []
    for line in code:
        if ranges:
            other = sum(1 for g in range(ranges[-1][1] + 1, line) if g in per_line)  # code lines between
            if other <= SCREEN:
                ranges[-1][1] = line
                continue
        ranges.append([line, line])
    return {"tokens": sum(per_line[line] for line in code), "places": len(ranges),
            "ranges": [tuple(r) for r in ranges]}


if __name__ == "__main__":
    for script in sys.argv[1:] or ["train_gpt.py", "train_vit.py", "train_diffusion.py"]:
        r = step_path(script)
        where = ", ".join(f"L{a}-{b}" for a, b in r["ranges"])
        print(f"{script}: {r['tokens']} code tokens in {r['places']} places: {where}")
