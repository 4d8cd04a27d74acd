"""Two ranks of a script, started as torchrun starts them but in a fraction of its time, for the parity tests.

    two = ranks.run(["train_gpt.py", "--parallel=fsdp", ...], cwd=ROOT)  # two.returncode, two.stdout, two.stderr

torchrun gives each worker a new Python process: each pays torch's imports (about 4 s here, with torch._dynamo's,
which the optimizers import), and torchrun's own process about 3 s more, so a two-rank run of 5 steps took about
10 s. Here a fork server imports torch and the trainers once for the whole test session, and each rank is a fork
of it: the script runs as __main__ with the environment torchrun gives its workers (RANK, LOCAL_RANK, WORLD_SIZE,
MASTER_ADDR, MASTER_PORT, TORCHELASTIC_RESTART_COUNT, and one thread each, as torchrun sets OMP_NUM_THREADS=1), and
both ranks write to one stdout and one stderr, as torchrun's workers do. The same run takes about 3 s.

The trainers read only that environment, so the parity they show is the parity under torchrun. What torchrun does
itself (restarting crashed workers, passing a signal on) is tested under the real torchrun, in test_train_gpt.py's
test_two_ranks_sigterm_on_one_and_restart_after_a_crash.
"""
import multiprocessing
import os
import runpy
import socket
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRELOAD = ["torch", "torch._dynamo", "torch.distributed", "torch.distributed.fsdp", "torch.distributed.checkpoint",
           "torch.distributed.checkpoint.state_dict", "train_gpt", "train_vit", "train_diffusion"]
_context = None


def context():
    """The fork server's context, started once: it imports PRELOAD (and runs no op, so no thread pool is forked)."""
    global _context
    if _context is None:
        _context = multiprocessing.get_context("forkserver")
        _context.set_forkserver_preload(PRELOAD)
    return _context


def rank_main(rank, world_size, port, argv, cwd, stdout, stderr):
    """One rank: torchrun's environment for it, then `python SCRIPT ARGS` from cwd, in this forked process."""
    os.environ.update(RANK=str(rank), LOCAL_RANK=str(rank), GROUP_RANK="0", WORLD_SIZE=str(world_size),
                      LOCAL_WORLD_SIZE=str(world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                      TORCHELASTIC_RESTART_COUNT="0", OMP_NUM_THREADS="1")
    import torch
    torch.set_num_threads(1)
    for fd, path in ((1, stdout), (2, stderr)):  # both ranks append to one file, as torchrun's workers share its fds
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND), fd)
    os.chdir(cwd)
    script = os.path.abspath(argv[0])
    sys.argv = [script, *argv[1:]]
    sys.path.insert(0, os.path.dirname(script))
    status = 0
    try:
        runpy.run_path(script, run_name="__main__")
    except SystemExit as e:  # sys.exit(message) prints the message and exits 1, sys.exit(n) exits n
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        status = 1 if isinstance(e.code, str) else e.code or 0
    except BaseException:
        import traceback
        traceback.print_exc()
        status = 1
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(status)  # as the process would end, without the test session's exit handlers, which the fork copied


def free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run(argv, cwd=ROOT, world_size=2, timeout=600):
    """`torchrun --standalone --nproc_per_node=2 SCRIPT ARGS` from cwd, forked: a CompletedProcess whose returncode
    is 0 if every rank exited 0, else the first rank's non-zero status (a signal's as -N)."""
    ctx = context()
    with tempfile.TemporaryDirectory() as tmp:
        out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
        open(out, "w").close()
        open(err, "w").close()
        port = free_port()
        procs = [ctx.Process(target=rank_main, args=(r, world_size, port, list(argv), str(cwd), out, err))
                 for r in range(world_size)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout)
        hung = [p for p in procs if p.exitcode is None]
        for p in hung:
            p.kill()
            p.join()
        with open(out) as f, open(err) as g:
            stdout, stderr = f.read(), g.read()
        if hung:
            raise subprocess.TimeoutExpired(argv, timeout, stdout, stderr)
        status = next((p.exitcode for p in procs if p.exitcode), 0)
        return subprocess.CompletedProcess(argv, status, stdout, stderr)
