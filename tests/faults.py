"""Fault injection from outside a trainer, to see its guards work: a NaN or spiking loss, SIGTERM, a crashed rank.

    python tests/faults.py nan@120 train_gpt.py --max_steps=200
    python tests/faults.py spike@120-124 train_gpt.py --max_steps=200 --save_every=50
    torchrun --standalone --nproc_per_node=2 --max-restarts=3 tests/faults.py kill@120:1 train_gpt.py --save_every=50

FAULTS is KIND@STEP[-END][:RANK],... with KIND nan (the training loss becomes NaN), spike (the model's output is
multiplied by 10), sigterm (the process gets SIGTERM) or kill (it exits at once, as a crashed worker would, but not
again after torchrun restarts it). A fault fires in each step of its range once (a rollback replays steps, not faults),
on every rank or on RANK only. Tests use `with inject(train_gpt, "nan@12"): train_gpt.main(cfg)`.

It patches the trainer module from outside, so the scripts carry no fault code: lr_mult marks the start of each
optimizer step, a forward hook on the model built by build_model scales the training forwards of that step (those run
with autograd on), and the guard's check, which follows its micro-steps, ends it.
"""
import contextlib
import importlib.util
import os
import re
import signal
import sys

import torch


def parse(spec):
    """[(kind, first step, last step, rank or None)] from KIND@STEP[-END][:RANK],..."""
    faults = []
    for item in filter(None, spec.split(",")):
        m = re.fullmatch(r"(nan|spike|sigterm|kill)@(\d+)(?:-(\d+))?(?::(\d+))?", item)
        if not m:
            raise SystemExit(f"faults.py: error: cannot read {item!r}; write KIND@STEP[-END][:RANK] with KIND "
                             f"nan|spike|sigterm|kill")
        faults.append((m[1], int(m[2]), int(m[3] or m[2]), None if m[4] is None else int(m[4])))
    return faults


@contextlib.contextmanager
def inject(module, spec):
    """Within it, runs of the trainer `module` (train_gpt, train_vit or train_diffusion) meet the faults of spec."""
    faults, fired, active = parse(spec), set(), set()
    rank = int(os.environ.get("RANK", "0"))
    lr_mult, build_model, check = module.lr_mult, module.build_model, module.Guard.check

    def step_starts(cfg, step, progress):
        for kind, first, last, r in faults:
            if first <= step + 1 <= last and r in (None, rank) and (kind, step + 1) not in fired:
                fired.add((kind, step + 1))
                if kind == "sigterm":
                    os.kill(os.getpid(), signal.SIGTERM)
                elif kind == "kill" and os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0":
                    os._exit(1)
                active.add(kind)
        return lr_mult(cfg, step, progress)

    def scale(model, inputs, output):
        if torch.is_grad_enabled() and model.training and active & {"nan", "spike"}:
            return output * (float("nan") if "nan" in active else 10.0)

    def built(*args, **kw):
        model = build_model(*args, **kw)
        model.register_forward_hook(scale)
        return model

    def step_ends(*args):
        active.clear()
        return check(*args)

    module.lr_mult, module.build_model, module.Guard.check = step_starts, built, step_ends
    try:
        yield
    finally:
        module.lr_mult, module.build_model, module.Guard.check = lr_mult, build_model, check


def main(argv):
    """faults.py FAULTS SCRIPT [FLAG ...]: run SCRIPT's main with FLAGs, under the faults."""
    if len(argv) < 2 or argv[0].startswith("-"):
        raise SystemExit(__doc__.strip().split("\n\n")[1])
    parse(argv[0])
    path = os.path.abspath(argv[1])
    name = os.path.splitext(os.path.basename(path))[0]
    spec = importlib.util.spec_from_file_location(name, path)
    module = sys.modules[name] = importlib.util.module_from_spec(spec)
    sys.path.insert(0, os.path.dirname(path))  # the script imports kernels from beside it
    spec.loader.exec_module(module)
    sys.argv = [path, *argv[2:]]  # so its errors and -h name the script
    with inject(module, argv[0]):
        module.main(module.parse_args(module.Config, argv[2:]))


if __name__ == "__main__":
    main(sys.argv[1:])
