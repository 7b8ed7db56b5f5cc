"""A fake GPU the script cannot tell from a real one: where tensors say they live, under `oomkit preflight`.

Libraries decide what to do by asking a tensor where it is: torchtune's
rotary embedding skips building its cache for a tensor on ``meta``,
Fabric refuses to set up an optimizer over ``meta`` parameters,
FlexAttention and DataParallel check for CUDA. So a tensor on the fake
GPU must answer as a CUDA tensor does, while a tensor the script makes on
``meta`` itself (a model initialised there before ``to_empty``) must go
on saying ``meta``, and holds no memory. Each answer below is what PyTorch
gives on a GPU (``EXPECTED``, from a CUDA machine's run of the same
questions); the script asks them inside a preflight.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from preflight_cli import BLOCK, OOMKIT, preflight_run

#: nn.Linear(1024, 1024)'s weight and bias in float32, as the allocator rounds them.
LINEAR_1024 = 1024 * 1024 * 4 + 1024 * 4

QUESTIONS = """
import json
import torch
from torch import nn

x = torch.randn(4, 4).cuda()
model = nn.Linear(4, 4).cuda()
opt = torch.optim.AdamW(model.parameters())
model(x).sum().backward()
opt.step()
state = opt.state[model.weight]
with torch.device("meta"):
    meta = nn.Linear(4, 4)
host = nn.Linear(4, 4)
said = {
    "device": str(x.device),
    "is_cuda": x.is_cuda,
    "is_meta": x.is_meta,
    "get_device": x.get_device(),
    "index": x.device.index,
    "equals cuda:0": x.device == torch.device("cuda", 0),
    "equals cuda": x.device == torch.device("cuda"),
    "type": x.device.type,
    "parameter": str(model.weight.device),
    "gradient": str(model.weight.grad.device),
    "optimizer state": str(state["exp_avg"].device),
    "step count": str(state["step"].device),
    "output": str(model(x).device),
    "empty_like": str(torch.empty_like(x).device),
    "new_zeros": str(x.new_zeros(3).device),
    "same device": str(torch.zeros(2, device=x.device).device),
    "to cpu": str(x.cpu().device),
    "to meta": str(x.to("meta").device),
    "meta parameter": str(meta.weight.device),
    "meta is_meta": meta.weight.is_meta,
    "meta is_cuda": meta.weight.is_cuda,
    "meta get_device": meta.weight.get_device(),
    "meta output": str(meta(torch.empty(2, 4, device="meta")).device),
    "made from data on meta": str(torch.tensor(0, device="meta").device),
    "made from data on the gpu": str(torch.tensor([1, 2], device="cuda").device),
    "to_empty": str(meta.to_empty(device="cuda").weight.device),
    "host parameter": str(host.weight.device),
    "host is_cuda": host.weight.is_cuda,
    "host is_cpu": host.weight.is_cpu,
    "host is_meta": host.weight.is_meta,
    "host get_device": host.weight.get_device(),
    "host output": str(host(torch.randn(2, 4)).device),
    "host to cpu": str(host.weight.cpu().device),
    "host half": str(host.weight.to("cpu", torch.float16).device),
    "host to another's device": str(nn.Linear(4, 4).weight.to(x).device),
    "host as_tensor": str(torch.as_tensor(nn.Linear(4, 4).weight, device="cuda").device),
    "host moved": str(host.cuda().weight.device),
    "current_device": torch.cuda.current_device(),
}
with torch.device("cuda"):
    said["default in a device context"] = str(torch.get_default_device())
    said["made in a device context"] = str(torch.empty(2).device)
torch.set_default_device("cuda")
said["made by default"] = str(torch.empty(2).device)
torch.set_default_device("cpu")
said["made after"] = str(torch.empty(2).device)
with open("said.json", "w") as f:
    json.dump(said, f)
"""

#: What PyTorch answers on a GPU (a CUDA tensor on the first GPU; a meta one is meta).
EXPECTED = {
    "device": "cuda:0",
    "is_cuda": True,
    "is_meta": False,
    "get_device": 0,
    "index": 0,
    "equals cuda:0": True,
    # A CUDA tensor's device has its index; torch.device("cuda") has none, and they differ.
    "equals cuda": False,
    "type": "cuda",
    "parameter": "cuda:0",
    "gradient": "cuda:0",
    "optimizer state": "cuda:0",
    # AdamW, neither fused nor capturable, counts its steps on the host.
    "step count": "cpu",
    "output": "cuda:0",
    "empty_like": "cuda:0",
    "new_zeros": "cuda:0",
    "same device": "cuda:0",
    "to cpu": "cpu",
    "to meta": "meta",
    "meta parameter": "meta",
    "meta is_meta": True,
    "meta is_cuda": False,
    "meta get_device": -1,
    "meta output": "meta",
    # torch.tensor makes its tensor out of the modes' sight (Fabric's 4-bit layer asks this way).
    "made from data on meta": "meta",
    "made from data on the gpu": "cuda:0",
    "to_empty": "cuda:0",
    # A module built without a device is on the host, until it is moved.
    "host parameter": "cpu",
    "host is_cuda": False,
    "host is_cpu": True,
    "host is_meta": False,
    "host get_device": -1,
    "host output": "cpu",
    "host to cpu": "cpu",
    "host half": "cpu",
    "host to another's device": "cuda:0",
    "host as_tensor": "cuda:0",
    "host moved": "cuda:0",
    "current_device": 0,
    "default in a device context": "cuda:0",
    "made in a device context": "cuda:0",
    "made by default": "cuda:0",
    "made after": "cpu",
}


def _script(tmp_path: Path, name: str, body: str) -> Path:
    path = tmp_path / name
    path.write_text(textwrap.dedent(body))
    return path


def test_a_tensor_on_the_fake_gpu_answers_where_it_lives_as_on_a_gpu(tmp_path: Path) -> None:
    script = _script(tmp_path, "ask.py", QUESTIONS)
    # Its one optimizer step is fewer than preflight's two, so it runs to its end.
    preflight_run(script, cwd=tmp_path)
    said = json.loads((tmp_path / "said.json").read_text())
    assert said == EXPECTED


def test_a_model_initialised_on_meta_holds_no_memory_until_it_is_made_on_the_gpu(tmp_path: Path) -> None:
    # FSDP2's and torchtitan's way: built on meta, then made on the GPU with to_empty and
    # initialised there. The meta model is no memory at all; the GPU one is the weights.
    script = _script(
        tmp_path,
        "meta_init.py",
        """
        import torch
        from torch import nn
        with torch.device("meta"):
            model = nn.Sequential(*[nn.Linear(1024, 1024) for _ in range(4)])
        assert all(p.is_meta for p in model.parameters())
        before = torch.cuda.memory_allocated()
        model.to_empty(device="cuda")
        for layer in model:
            layer.reset_parameters()
        made = torch.cuda.memory_allocated() - before
        assert made == 4 * (1024 * 1024 * 4 + 1024 * 4), made
        assert all(p.is_cuda for p in model.parameters())
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(8, 1024, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        """,
    )
    run = preflight_run(script, cwd=tmp_path)
    assert run["by_role"]["parameters"] == 4 * LINEAR_1024
    assert run["by_role"]["gradients"] == 4 * LINEAR_1024
    # Nothing from the meta model's line: it never held memory.
    assert not [line for line in run["by_line"] if line["line"].startswith("meta_init.py:5 ")], run["by_line"]


#: A feature extractor left on the host (as a data pipeline keeps one: a window and a projection,
#: 16 MiB of weights) beside a head trained on the GPU, fed the features the host computes.
HOST_FEATURES = """
import sys
import torch
from torch import nn

class Features(nn.Module):
    def __init__(self):
        super().__init__()
        self.register_buffer("window", torch.hann_window(4096))
        self.proj = nn.Linear(4096, 1024)

    def forward(self, x):
        return self.proj(x * self.window)

features = Features()
head = nn.Linear(1024, 1024)
head.cuda()
opt = torch.optim.SGD(head.parameters(), lr=0.1)
for step in range(3):
    with torch.no_grad():
        f = features(torch.randn(64, 4096))
    print("FEATURES", f.device, file=sys.stderr)
    head(f.cuda()).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_module_left_on_the_host_holds_no_gpu_memory_and_one_moved_is_its_layers(tmp_path: Path) -> None:
    script = _script(tmp_path, "features.py", HOST_FEATURES)
    p = subprocess.run(
        [OOMKIT, "preflight", "--json", "--no-fixes", "--", sys.executable, str(script)], capture_output=True, text=True, timeout=300, cwd=tmp_path
    )
    assert p.returncode == 0, p.stderr[-2000:]
    assert p.stderr.count("FEATURES cpu") == 2, p.stderr[-2000:]
    run = json.loads(p.stdout)["run"]
    # The head's weights and gradients alone (the features' 16 MiB are the host's), the batch of
    # features uploaded, and cuBLAS's two workspaces: the host's multiply takes none.
    assert run["by_role"]["parameters"] == LINEAR_1024 and run["by_role"]["gradients"] == LINEAR_1024, run["by_role"]
    assert run["by_role"]["inputs"] == 64 * 1024 * 4, run["by_role"]
    assert run["by_role"]["other"] == 2 * (32 << 20), run["by_role"]
    # The head's weights were made by its constructor on the host and moved: said to be made where the layer is.
    params = [x for x in run["by_line"] if x["role"] == "parameters"]
    assert params and params[0]["line"].endswith("features.py:16 (<module>)"), run["by_line"]


def test_a_tensor_sent_from_the_gpu_to_meta_gives_its_memory_back(tmp_path: Path) -> None:
    # Offloading to meta (accelerate's hooks drop weights this way): on a GPU, .to("meta")
    # is a new tensor without data, and the GPU's copy goes when the script lets it go.
    script = _script(
        tmp_path,
        "drop.py",
        """
        import torch
        weights = torch.empty(1 << 20, device="cuda")
        held = torch.cuda.memory_allocated()
        weights = weights.to("meta")
        assert weights.is_meta and not weights.is_cuda
        assert torch.cuda.memory_allocated() == held - (4 << 20), torch.cuda.memory_allocated()
        model = torch.nn.Linear(64, 64).cuda()
        model(torch.randn(2, 64, device="cuda")).sum().backward()
        """,
    )
    preflight_run(script, "--steps", "1", cwd=tmp_path)


def test_a_host_tensors_data_set_to_a_gpu_tensor_moves_it_in_place(tmp_path: Path) -> None:
    # bitsandbytes quantizes a weight as it moves and sets ``param.data`` to the packed result: on
    # CUDA a host tensor may take a GPU tensor's data, and stays the same object, class and attributes.
    script = _script(
        tmp_path,
        "set_data.py",
        """
        import torch

        class Packed(torch.nn.Parameter):
            pass

        weight = Packed(torch.zeros(256, 256), requires_grad=False)
        weight.blocksize = 64
        same = weight
        weight.data = torch.empty(256 * 128, dtype=torch.uint8, device="cuda")
        assert same is weight and type(weight) is Packed and weight.blocksize == 64 and not weight.requires_grad
        assert weight.is_cuda and weight.shape == (256 * 128,) and weight.dtype == torch.uint8
        assert torch.cuda.memory_allocated() == 256 * 128
        model = torch.nn.Linear(64, 64).cuda()
        model(torch.randn(2, 64, device="cuda")).sum().backward()
        """,
    )
    preflight_run(script, "--steps", "1", cwd=tmp_path)


FLOAT8_STEP = """
    import torch

    # Float8 training's matrix multiply, as torchao's Float8Linear makes it: float8 operands, scales, bf16 out.
    model = torch.nn.Linear(256, 256).cuda()
    a = torch.randn(128, 256, device="cuda").to(torch.float8_e4m3fn)
    b = torch.randn(256, 256, device="cuda").to(torch.float8_e4m3fn).t()
    one = torch.tensor(1.0, device="cuda")
    out = torch._scaled_mm(a, b, scale_a=one, scale_b=one, out_dtype=torch.bfloat16)
    assert out.shape == (128, 256) and out.dtype == torch.bfloat16
    model(out.float()).sum().backward()
"""


@pytest.mark.parametrize("call", ["torch._scaled_mm", "torch.ops.aten._scaled_mm.default"])
def test_a_float8_multiply_runs_where_the_gpu_has_float8_and_stops_where_it_has_none(tmp_path: Path, call: str) -> None:
    # Called by name (torchao's float8 tensors, from their own dispatch), or as the ATen operator (a compiled graph's).
    script = _script(tmp_path, "float8.py", FLOAT8_STEP.replace("torch._scaled_mm", call))
    # Hopper and Ada (an L40S, capability 8.9) multiply in float8.
    for capacity in ("H100", "L40S"):
        preflight_run(script, "--steps", "1", "--capacity", capacity, cwd=tmp_path)
    # An A100 (8.0) has no float8 tensor cores: the step stops there, with CUDA's own message.
    p = subprocess.run(
        [OOMKIT, "preflight", "--steps", "1", "--capacity", "A100", "--", sys.executable, str(script)],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 2, p.stderr[-2000:]
    last = p.stderr.strip().splitlines()[-1]
    assert "torch._scaled_mm is only supported on CUDA devices with compute capability >= 9.0 or 8.9" in last, last
    assert "float8.py:9" in last, last


def test_a_cache_built_only_off_meta_is_built_on_the_fake_gpu(tmp_path: Path) -> None:
    # A rotary table built lazily, skipped while the module is on meta (torchtune's RoPE
    # does this, and stops at its forward if the table was never built).
    script = _script(
        tmp_path,
        "rope.py",
        """
        import torch
        from torch import nn

        class Rotary(nn.Module):
            def __init__(self, dim, length):
                super().__init__()
                self.dim, self.length = dim, length
                self.register_buffer("theta", 1.0 / 10000 ** (torch.arange(0, dim, 2).float() / dim), persistent=False)
                self.build()

            def build(self):
                if self.theta.is_meta:
                    return
                angles = torch.outer(torch.arange(self.length, device=self.theta.device).float(), self.theta)
                self.register_buffer("table", torch.stack([angles.cos(), angles.sin()], -1), persistent=False)

            def forward(self, x):
                if not hasattr(self, "table"):
                    raise RuntimeError("the rotary table is not built: call build() first")
                return x * self.table[: x.shape[1], :, 0].repeat(1, 2)

        with torch.device("cuda"):
            model = nn.Sequential(nn.Linear(64, 64), Rotary(64, 4096))
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(2):
            model(torch.randn(2, 128, 64, device="cuda")).sum().backward()
            opt.step()
            opt.zero_grad()
        """,
    )
    run = preflight_run(script, cwd=tmp_path)
    # The table (4096 x 32 x 2 floats) is held as the model's own state, beside the weights and theta.
    table = 4096 * 32 * 2 * 4
    assert run["by_role"]["parameters"] == table + 64 * 64 * 4 + BLOCK + BLOCK


def test_a_tensor_subclass_wrapping_a_gpu_tensor_is_on_the_fake_gpu(tmp_path: Path) -> None:
    # A quantized weight as torchao's NF4Tensor makes one: a wrapper subclass taking its device
    # from the tensor it wraps, whose copy_ moves what is copied in onto that device. Made on
    # CUDA, every operation on it went through CUDA's device guard first ("CUDA driver version is
    # insufficient" as the checkpoint was loaded); on the fake GPU it runs, and holds what it wraps.
    script = _script(
        tmp_path,
        "wrapped.py",
        """
        import torch
        from torch import nn
        from torch.utils._pytree import tree_map

        class Packed(torch.Tensor):
            @staticmethod
            def __new__(cls, data, device):
                # The device the library read off the weight (torchao's NF4Tensor keeps it in its metadata).
                return torch.Tensor._make_wrapper_subclass(cls, data.shape, dtype=data.dtype, device=device)

            def __init__(self, data, device):
                self.data_ = data

            def __tensor_flatten__(self):
                return ["data_"], None

            @staticmethod
            def __tensor_unflatten__(inner, meta, size, stride):
                return Packed(inner["data_"], torch.device("cuda", 0))

            @classmethod
            def __torch_dispatch__(cls, func, types, args, kwargs=None):
                if func is torch.ops.aten.copy_.default:
                    dst, src = args
                    dst.data_.copy_(src.to(dst.device))
                    return dst
                if func is torch.ops.aten.detach.default:
                    return Packed(args[0].data_, torch.device("cuda", 0))
                unwrapped = tree_map(lambda t: t.data_ if isinstance(t, Packed) else t, args)
                return func(*unwrapped, **(kwargs or {}))

        layer = nn.Linear(256, 256, bias=False).cuda()
        layer.weight = nn.Parameter(Packed(layer.weight.detach(), torch.device("cuda", 0)), requires_grad=False)
        assert layer.weight.is_cuda and layer.weight.device == torch.device("cuda", 0)
        layer.load_state_dict({"weight": torch.ones(256, 256)})
        model = nn.Sequential(layer, nn.Linear(256, 8).cuda())
        opt = torch.optim.SGD(model[1].parameters(), lr=0.1)
        for _ in range(2):
            x = torch.randn(4, 256, device="cuda")
            model(x).sum().backward()
            opt.step()
            opt.zero_grad()
        """,
    )
    run = preflight_run(script, cwd=tmp_path)
    assert run["steps"] == 2, run
    # The wrapped weight is held once, as the model's parameters with the head's (and its bias).
    assert run["by_role"]["parameters"] == 256 * 256 * 4 + 8 * 256 * 4 + BLOCK, run["by_role"]


#: Random draws seeded on a CUDA generator, as diffusers' pipelines and timm's EMA make one: a real
#: one would start CUDA. The draws land on the GPU with their sizes; a generator is still one.
CUDA_GENERATOR = """
import sys
import torch

g = torch.Generator("cuda").manual_seed(0)
print("GENERATOR", isinstance(g, torch.Generator), isinstance(torch.default_generator, torch.Generator), g.initial_seed())
model = torch.nn.Linear(1024, 1024).cuda()
opt = torch.optim.SGD(model.parameters(), lr=0.1)
for step in range(3):
    noise = torch.randn(256, 1024, device="cuda", generator=g)
    keep = torch.rand(256, 1024, generator=torch.Generator(device=torch.device("cuda", 0)), device="cuda")
    (model(noise) * keep).sum().backward()
    opt.step()
    opt.zero_grad()
"""


def test_a_cuda_random_generator_draws_onto_the_fake_gpu(tmp_path: Path) -> None:
    script = tmp_path / "draws.py"
    script.write_text(CUDA_GENERATOR)
    p = subprocess.run([OOMKIT, "preflight", "--json", "--no-fixes", "--", sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-2000:]
    # (Under --json the script's own output goes to standard error.)
    assert "GENERATOR True True 0" in p.stderr, p.stderr[-2000:]
    run = json.loads(p.stdout)["run"]
    assert run["steps"] == 2
    # The weights, the batch of noise and the mask (each 256 x 1024 float32) drawn on the GPU, held in forward.
    assert run["phase_peaks"]["forward"] >= LINEAR_1024 + 2 * 256 * 1024 * 4, run["phase_peaks"]
