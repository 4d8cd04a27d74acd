"""Any CPU: no default depends on bf16 hardware. With --dtype=auto on a CPU (fp32 on every CPU, by a rule of the
device alone: issue 77), no step of any trainer, its optimizers included, multiplies in bf16, nor does
finetune_gpt.py's (LoRA, QAT and a teacher on train_gpt.py's step); with --dtype=bfloat16 the GPT's matmuls and
Muon's iterations do, which shows the check sees bf16 where it is. Whichever precision a run started in, it keeps:
a resume with --dtype=auto takes its checkpoint's."""
import json

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import faults
import finetune_gpt as ft
import train_diffusion as td
import train_gpt as tg
import train_vit as tv
from test_finetune import ft_tiny
from test_train_gpt import tiny as gpt_tiny
from test_train_vit import shapes, tiny as vit_tiny  # noqa: F401 - shapes is a fixture
from test_train_diffusion import tiny as dit_tiny

aten = torch.ops.aten
MATMULS = {aten.mm, aten.bmm, aten.addmm, aten.baddbmm, aten.addmv, aten.mv, aten.dot, aten.convolution,
           aten._scaled_dot_product_flash_attention_for_cpu, aten._scaled_dot_product_attention_math}


class MatmulDtypes(TorchDispatchMode):
    """Records the dtype of every matrix product, and of the ops each optimizer's step runs, below autocast."""

    def __init__(self):
        super().__init__()
        self.seen = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in MATMULS:
            self.seen.add(args[0].dtype)
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("dtype", ["auto", "bfloat16"])
@pytest.mark.parametrize("script", ["gpt", "finetune", "vit", "diffusion"])
def test_no_bf16_matmul_unless_asked(script, dtype, corpus, shapes, tmp_path):  # noqa: F811
    if script == "finetune":  # LoRA on the int8 grid, from a train_gpt.py run that also teaches it
        tg.main(gpt_tiny(corpus, tmp_path / "base", max_steps=1))
    main, cfg = {
        "gpt": lambda: (tg.main, gpt_tiny(corpus, tmp_path / "o", max_steps=2, dtype=dtype, optimizer="muon")),
        "finetune": lambda: (ft.main, ft_tiny(corpus, tmp_path / "o", max_steps=2, dtype=dtype, optimizer="muon",
                                              init_from=str(tmp_path / "base"), lora_rank=2, qat=8,
                                              teacher=str(tmp_path / "base"))),
        "vit": lambda: (tv.main, vit_tiny(shapes, tmp_path / "o", max_steps=2, dtype=dtype, optimizer="muon")),
        "diffusion": lambda: (td.main, dit_tiny(shapes, tmp_path / "o", max_steps=2, dtype=dtype))}[script]()
    with MatmulDtypes() as mode:
        assert main(cfg)["steps"] == 2
    assert torch.float32 in mode.seen
    if dtype == "auto":
        assert torch.bfloat16 not in mode.seen, f"{script}: a bf16 matmul on a CPU under --dtype=auto"
    elif script in ("gpt", "finetune"):
        assert torch.bfloat16 in mode.seen


@pytest.mark.parametrize("script", ["gpt", "vit", "diffusion"])
def test_a_resume_keeps_its_precision_where_auto_would_choose_another(script, corpus, shapes,
                                                                     tmp_path):  # noqa: F811
    """A run's precision is stored with it (its checkpoints, config.json): a run begun in bf16 and stopped at step 2
    goes on in bf16 under --dtype=auto, which on a CPU would choose fp32, and ends as the uninterrupted bf16 run
    does. Another --dtype for it is refused in one line."""
    mod, make = {"gpt": (tg, lambda out, **kw: gpt_tiny(corpus, out, **kw)),
                 "vit": (tv, lambda out, **kw: vit_tiny(shapes, out, **kw)),
                 "diffusion": (td, lambda out, **kw: dit_tiny(shapes, out, **kw))}[script]
    whole = mod.main(make(tmp_path / "a", max_steps=4, dtype="bfloat16"))
    with faults.inject(mod, "sigterm@2"):
        assert mod.main(make(tmp_path / "b", max_steps=4, dtype="bfloat16"))["preempted"]
    resumed = mod.main(make(tmp_path / "b", max_steps=4, dtype="auto", resume=True))
    assert resumed["train_loss"] == whole["train_loss"] and resumed["steps"] == 4
    assert json.loads((tmp_path / "b" / "config.json").read_text())["dtype"] == "bfloat16"
    assert mod.load_checkpoint(str(tmp_path / "b"))[0]["config"]["dtype"] == "bfloat16"
    with pytest.raises(SystemExit, match=r"different config: dtype='bfloat16' \(now 'float32'\)"):
        mod.main(make(tmp_path / "b", max_steps=6, dtype="float32", resume=True))
