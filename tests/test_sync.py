"""GPU-ready on the CPU (issue 48): a training step does not wait for the device. The host reads the loss, the grad
norm, the guard's verdicts and the stop signal only at log steps (and at evals and saves), so a GPU's queue stays
full between them. Counted here as a GPU would feel them: every read of a tensor's value by the host."""
import collections

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import test_train_diffusion
import test_train_gpt
import test_train_vit
import train_diffusion as td
import train_gpt as tg
import train_vit as tv
from test_train_vit import shapes  # noqa: F401 (a fixture: its images)

LOG_EVERY = 4


class HostReads(TorchDispatchMode):
    """Counts the ops that make the host wait for a device: .item(), float(t), bool(t) and the like (all
    aten._local_scalar_dense), and .tolist(), .cpu(), .numpy() (patched: on a CPU they dispatch nothing)."""

    def __init__(self, monkeypatch):
        super().__init__()
        self.n = 0
        for name in ("tolist", "cpu", "numpy"):
            monkeypatch.setattr(torch.Tensor, name, self.counted(getattr(torch.Tensor, name)))

    def counted(self, method):
        def read(t, *args, **kw):
            self.n += 1
            return method(t, *args, **kw)
        return read

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.n += func is torch.ops.aten._local_scalar_dense.default
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("mod, tests, extra", [(tg, test_train_gpt, {}), (tv, test_train_vit, {"ema": 0.9,
                         "optimizer": "muon"}), (td, test_train_diffusion, {})], ids=["gpt", "vit", "dit"])
def test_the_host_reads_only_at_log_steps(mod, tests, extra, corpus, shapes, tmp_path, monkeypatch):
    """Over 2 x log_every steps, with Muon and AdamW (and an EMA), the host reads once at each of the 2 log steps,
    and not in any other step: the guard skips a bad step on the device."""
    reads, lr_mult = HostReads(monkeypatch), mod.lr_mult
    at_start = collections.Counter()  # host reads before the start of each step

    def step_starts(c, step, progress):
        at_start[step + 1] = reads.n
        return lr_mult(c, step, progress)

    monkeypatch.setattr(mod, "lr_mult", step_starts)
    flags = dict(max_steps=2 * LOG_EVERY + 1, log_every=LOG_EVERY, eval_every=0, save_every=0, dtype="float32")
    run = tests.tiny(corpus if mod is tg else shapes, tmp_path / "o", **flags, **extra)
    with reads:
        mod.main(run)
    per_step = [at_start[s + 1] - at_start[s] for s in range(1, 2 * LOG_EVERY + 1)]  # steps 1 .. 2 x log_every
    assert per_step == [0, 0, 0, 1] * 2, per_step


def test_a_signal_and_a_rollback_act_at_the_next_sync_and_resume_exactly(corpus, tmp_path):
    """With log_every=4 the host reads at steps 4, 8, ...; SIGTERM at step 5 still saves and exits 0 after step 5
    (the flag is host state, read every step: issue 61), and spikes at steps 24-26 roll back at step 28; each run
    resumes bit-exactly from its checkpoint."""
    import shutil

    import faults
    from test_train_gpt import events, losses
    kw = dict(max_steps=12, log_every=LOG_EVERY)
    whole = tg.main(test_train_gpt.tiny(corpus, tmp_path / "a", **kw))
    with faults.inject(tg, "sigterm@5"):
        stopped = tg.main(test_train_gpt.tiny(corpus, tmp_path / "b", **kw))
    assert stopped["preempted"] and stopped["steps"] == 5
    assert [s for s, _ in tg.list_checkpoints(str(tmp_path / "b"))] == [5]
    resumed = tg.main(test_train_gpt.tiny(corpus, tmp_path / "b", **kw, resume=True))
    assert resumed["val_loss"] == whole["val_loss"] and losses(tmp_path / "a")[12] == losses(tmp_path / "b")[12]

    out, kw = tmp_path / "r", dict(max_steps=40, lr=1e-2, warmup_steps=10, save_every=10, keep_last=5,
                                   rollback_after=3, optimizer="adamw", log_every=LOG_EVERY)
    with faults.inject(tg, "spike@24-26"):
        r = tg.main(test_train_gpt.tiny(corpus, out, **kw))
    assert [e["step"] for e in events(out, "skip")] == [24, 25, 26]
    (rb,) = events(out, "rollback")
    assert rb["step"] == 28 and rb["to_step"] == 20 and r["steps"] == 40
    (tmp_path / "again").mkdir()
    shutil.copy(tg.list_checkpoints(str(out))[-2][1], tmp_path / "again")  # step 30, after the rollback
    again = tg.main(test_train_gpt.tiny(corpus, tmp_path / "again", **kw, resume=True))
    assert again["val_loss"] == r["val_loss"] and losses(tmp_path / "again")[40] == losses(out)[40]


@pytest.mark.parametrize("mod, tests", [(tg, test_train_gpt), (tv, test_train_vit), (td, test_train_diffusion)],
                         ids=["gpt", "vit", "dit"])
def test_sigterm_is_obeyed_after_its_step_whatever_log_every(mod, tests, corpus, shapes, tmp_path, monkeypatch):
    """Issue 61: with --log_every=1000 a SIGTERM at step 10 saves a checkpoint of step 10 and stops there, not at the
    next log step (a scheduler's grace is seconds). The flag is read every step without a device read, which
    test_the_host_reads_only_at_log_steps counts."""
    import faults
    run = tests.tiny(corpus if mod is tg else shapes, tmp_path / "o", max_steps=40, log_every=1000, eval_every=0,
                     save_every=0, dtype="float32")
    with faults.inject(mod, "sigterm@10"):
        stopped = mod.main(run)
    assert stopped["preempted"] and stopped["steps"] == 10, stopped
    assert [s for s, _ in mod.list_checkpoints(str(tmp_path / "o"))] == [10]


def test_sigterm_from_outside_a_process(corpus, tmp_path):
    """The same as a real process: `python tests/faults.py sigterm@10 train_gpt.py --log_every=1000` exits 0 at
    step 10 with its checkpoint, and says how to resume."""
    p = test_train_gpt.run_script(f"--data_dir={corpus}", f"--out_dir={tmp_path}/o", "--n_layer=2", "--n_embd=32",
                                  "--n_head=2", "--seq_len=32", "--batch_size=2", "--max_steps=200", "--time_budget=0",
                                  "--log_every=1000", "--sample_tokens=0", "--device=cpu", "--dtype=float32",
                                  fault="sigterm@10")
    assert p.returncode == 0, p.stderr[-2000:]
    assert "stopped by SIGTERM at step 10" in p.stdout and "--resume" in p.stdout, p.stdout[-2000:]
    assert [s for s, _ in tg.list_checkpoints(str(tmp_path / "o"))] == [10]
