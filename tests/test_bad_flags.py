"""A sweep of bad flags (issue 51): each stops before any work in one line that names the flag, never a traceback."""
import os
import subprocess
import sys

import pytest
import torch

import predict_vit as pv
import sample_diffusion as sd
import train_diffusion as td
import train_gpt as tg
import train_vit as tv

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = [  # (module, flags, what the line must name)
    (tg, dict(log_every=0), "--log_every must be at least 1"),
    (tv, dict(log_every=0), "--log_every must be at least 1"),
    (td, dict(log_every=0), "--log_every must be at least 1"),
    (tg, dict(max_steps=0, tokens="0", time_budget=0.0), "no training budget"),
    (tg, dict(max_steps=0, tokens="0.0", time_budget=0.0), "no training budget"),
    (tg, dict(tokens="-5"), "--tokens=-5 is neither"),
    (tg, dict(n_kv_head=-1), "--n_kv_head must be at least 0"),
    (tg, dict(top_k=-1), "--top_k must be at least 0"),
    (tg, dict(temperature=-1.0), "--temperature must be at least 0"),
    (tg, dict(eval_every=-1), "--eval_every must be at least 0"),
    (tg, dict(save_every=-2), "--save_every must be at least 0"),
    (tg, dict(n_layer=0), "--n_layer must be at least 1"),
    (tg, dict(lr=0.0), "need --lr > 0"),
    (pv, dict(images="x.png", show=0), "--show must be at least 1"),  # train_vit.py's --top_k, before issue 59
    (pv, dict(), "name the images to classify: --images=FILE_OR_FOLDER"),
    (td, dict(sample_steps=0), "--sample_steps must be at least 1"),
    (sd, dict(sample_steps=0), "--sample_steps must be at least 1"),
    (sd, dict(cfg_scale=-1.0), "--cfg_scale must be at least 0"),
    (sd, dict(out="missing_dir/x.png"), "its folder does not exist"),
]


@pytest.mark.parametrize("mod, flags, line", CASES, ids=[f"{m.__name__}-{f}" for m, f, _ in CASES])
def test_a_bad_flag_stops_in_one_line(mod, flags, line):
    with pytest.raises(SystemExit) as e:
        mod.check_config(mod.Config(**flags))
    msg = str(e.value.code)
    assert line in msg and "\n" not in msg, msg


@pytest.mark.parametrize("mod", [tg, tv, td])
@pytest.mark.parametrize("flag", ["--lr=nan", "--lr=inf", "--time_budget=-inf", "--grad_clip=nan"])
def test_nan_and_infinite_floats_are_refused(mod, flag):
    with pytest.raises(SystemExit, match=f"argument {flag.split('=')[0]}: expected a finite number"):
        mod.parse_args(mod.Config, [flag])


def test_from_the_command_line_one_line_and_exit_1(tmp_path):
    """As a user meets it: exit status 1, one line on stderr, nothing written."""
    p = subprocess.run([sys.executable, os.path.join(ROOT, "train_gpt.py"), "--log_every=0", f"--out_dir={tmp_path}/x"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=120)
    assert p.returncode == 1 and p.stderr.strip().count("\n") == 0, p.stderr
    assert "--log_every must be at least 1" in p.stderr and not (tmp_path / "x").exists()


def test_an_unwritable_results_tsv_warns_and_the_run_ends_well(tmp_path, capsys):
    """results.tsv is a side output: a run whose folder for it cannot be written keeps its result, and warns."""
    (tmp_path / "results.tsv").mkdir()  # a folder where the file goes: open() fails, as on a read-only folder
    log = tg.RunLog(str(tmp_path / "run" / "metrics.jsonl"), 1, "tok", 0, torch.device("cpu"), torch.float32)
    log.result("val_loss", {"val_loss": 1.0, "peak_mem_gb": 0.0, "wall_time": 1.0}, "")
    assert "warning: results.tsv not written" in capsys.readouterr().out


def test_prepare_data_stopped_or_refused_leaves_nothing(tmp_path, monkeypatch):
    """SIGTERM (as Ctrl-C) mid-way through prepare_data.py text, or a data_dir it may not write: one line, exit 1,
    no hidden staging folder left beside data_dir."""
    import signal

    import prepare_data
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a.py").write_text("def f(x):\n    return x * 2\n" * 50)
    (tmp_path / "src" / "b.py").write_text("import math\nprint(math.pi)\n" * 50)
    monkeypatch.setattr(prepare_data, "write_shard", lambda *a: os.kill(os.getpid(), signal.SIGTERM))
    with pytest.raises(SystemExit, match="interrupted: nothing half-written is left; run the command again"):
        prepare_data.main(["text", str(tmp_path / "src"), f"--data_dir={tmp_path / 'out' / 'd'}"])
    assert signal.getsignal(signal.SIGTERM) is not signal.default_int_handler  # put back
    assert not (tmp_path / "out").exists()  # neither the staging folder nor the folders made for data_dir (issue 61)

    def denied(*a, **kw):
        raise PermissionError(13, "Permission denied", str(tmp_path / "ro"))
    monkeypatch.setattr(prepare_data.tempfile, "mkdtemp", denied)
    with pytest.raises(SystemExit, match="ro: permission denied; pass a --data_dir in a folder you can write"):
        prepare_data.main(["text", str(tmp_path / "src"), f"--data_dir={tmp_path / 'ro' / 'd'}"])
    monkeypatch.undo()
    (tmp_path / "latin1.txt").write_bytes("Caf\u00e9 cr\u00e8me br\u00fbl\u00e9e \u00e0 l'\u00e9t\u00e9.\n".encode("latin-1") * 200)
    with pytest.raises(SystemExit, match="files must be UTF-8: iconv -f latin1 -t utf-8 converts"):
        prepare_data.main(["text", str(tmp_path / "latin1.txt"), f"--data_dir={tmp_path / 'l1'}"])
