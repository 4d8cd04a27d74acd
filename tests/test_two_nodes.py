"""Two nodes on one machine (issue 80): the README's two-node command, run as two torchrun agents that meet by the
c10d rendezvous on loopback, one rank each (gloo). What a second node adds over a second rank of one node is
torchrun's side: the rendezvous that assigns the node ranks, a master address published by node 0, and the restart
of both nodes' workers when one node's worker dies. The trainer's side is the same, and this checks it: the losses
equal one process's at the same global batch, and a worker killed mid-run comes back, with the other node's, from
the checkpoint."""
import json
import os
import shlex
import socket
import subprocess
import sys

import pytest

import train_gpt as tg
from conftest import ROOT

pytestmark = pytest.mark.slow

COMMON = ["--dtype=float32", "--n_layer=2", "--n_embd=64", "--n_head=4", "--seq_len=32", "--max_steps=6",
          "--time_budget=0", "--log_every=1", "--sample_tokens=0", "--device=cpu", "--warmup_steps=2",
          "--eval_tokens=1024"]


def readme_two_node_command(port):
    """(the environment, torchrun's flags) of the README's two-node command, for one rank a node on this machine's
    loopback."""
    text = open(os.path.join(ROOT, "README.md")).read().replace("\\\n", " ")
    line = next(line for line in text.splitlines() if "--nnodes=2" in line)
    argv = shlex.split(line)
    env = dict(a.split("=", 1) for a in argv[:argv.index("torchrun")])  # VAR=value words before the command
    argv = argv[argv.index("torchrun") + 1:argv.index("train_gpt.py")]  # torchrun's own flags
    assert "--rdzv_backend=c10d" in argv and "--rdzv_endpoint=HOST:29500" in argv, argv
    return env, [a.replace("HOST:29500", f"127.0.0.1:{port}").replace("--nproc_per_node=8", "--nproc_per_node=1")
                 for a in argv]


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(args):
    """Both agents of the README's command, started together as each node's would be: (their exit codes, all they
    printed)."""
    env, flags = readme_two_node_command(free_port())
    cmd = [sys.executable, "-m", "torch.distributed.run", *flags, *args]
    env = {**os.environ, **env, "OMP_NUM_THREADS": "1"}  # two workers on this machine's cores, as on two nodes' own
    agents = [subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT, env=env)
              for _ in range(2)]
    try:
        outs = [a.communicate(timeout=240)[0] for a in agents]
    finally:
        for a in agents:
            a.kill()
    return [a.returncode for a in agents], "".join(outs)


def losses(out_dir):
    """{step: train loss} of a run's metrics.jsonl."""
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        return {r["step"]: r["loss"] for r in map(json.loads, f) if "loss" in r}


def test_two_nodes_match_one_process_and_restart_a_killed_node(corpus, tmp_path):
    common = [*COMMON, f"--data_dir={corpus}"]
    tg.main(tg.parse_args(tg.Config, [*common, "--batch_size=4", f"--out_dir={tmp_path}/one"]))
    script = os.path.join(ROOT, "train_gpt.py")
    codes, out = two_nodes([script, *common, "--batch_size=2", f"--out_dir={tmp_path}/two"])
    assert codes == [0, 0], out[-3000:]
    one, two = losses(tmp_path / "one"), losses(tmp_path / "two")
    assert sorted(one) == sorted(two) == [1, 2, 3, 4, 5, 6]
    for s in one:
        assert two[s] == pytest.approx(one[s], rel=1e-5, abs=1e-5), (s, one[s], two[s])
    # node 1's worker dies at step 4 (tests/faults.py: a crash, once): both nodes' workers restart and resume from
    # the checkpoint of step 2, and the run ends where the uninterrupted one did
    faults = os.path.join(ROOT, "tests", "faults.py")
    codes, out = two_nodes([faults, "kill@4:1", script, *common, "--batch_size=2", "--save_every=2",
                            f"--out_dir={tmp_path}/killed"])  # the README's --max-restarts
    assert codes == [0, 0], out[-3000:]
    assert "resumed from" in out, out[-3000:]
    killed = losses(tmp_path / "killed")
    assert killed[6] == pytest.approx(one[6], rel=1e-5, abs=1e-5)
