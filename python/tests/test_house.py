"""The rules docs/architecture.md states, checked: the fake GPU is undone, no import circles, no import back up the Python side's layers, no long function without a why, every module named.

`scripts/check_deps.py` enforces the circles and the long functions in the
test command; here it is shown to catch each on a small crate and package
made for the purpose, and the repository itself to pass it.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Any

import oomkit
import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]


def _check_deps() -> Any:
    spec = importlib.util.spec_from_file_location("check_deps", ROOT / "scripts" / "check_deps.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# ----- the fake GPU is undone ----------------------------------------------


def _owners() -> list[Any]:
    """Everything the fake GPU's ledger may touch, and more: each is compared whole."""
    import importlib
    import threading

    import torch.amp.autocast_mode as autocast_mode
    import torch.distributed as dist
    import torch.distributed.device_mesh as device_mesh
    import torch.distributed.distributed_c10d as c10d
    import torch.distributed.launcher.api as launcher
    import torch.nn.modules.module as module
    import torch.optim.optimizer as optimizer
    import torch.utils._foreach_utils as foreach_utils
    import torch.utils.checkpoint as checkpoint
    from torch.distributed.pipelining import _utils as pipelining_utils
    from torch.distributed.pipelining import schedules, stage
    from torch.nn.parallel import distributed as ddp

    owners = [
        torch,
        torch.serialization,
        threading.Thread,
        torch.cuda,
        torch.cuda.memory,
        torch.cuda.graphs,
        torch._C,
        torch.amp,
        torch.optim.Optimizer,
        *(importlib.import_module(f"torch.optim.{name}") for name in ("adamw", "adam", "sgd", "adagrad")),
        optimizer,
        foreach_utils,
        checkpoint,
        torch.utils.data.DataLoader,
        torch.UntypedStorage,
        torch.Tensor,
        torch.cuda.random,
        torch.multiprocessing,
        sys.modules["torch.multiprocessing.spawn"],
        torch.profiler,
        sys.modules["torch.profiler.profiler"],
        autocast_mode.autocast,
        dist,
        ddp,
        ddp.DistributedDataParallel,
        device_mesh,
        c10d,
        launcher,
        schedules._PipelineSchedule,
        stage.PipelineStage,
        pipelining_utils.InferenceMode,
        module,
    ]
    accelerator = getattr(torch, "accelerator", None)
    owners += [x for x in (accelerator, getattr(accelerator, "memory", None)) if x is not None]
    owners.append(torch.autograd.graph.saved_tensors_hooks)
    try:
        from triton.runtime import autotuner, jit
    except Exception:  # noqa: BLE001 - without Triton there are no launches to stand in for
        pass
    else:
        owners += [jit.JITFunction, autotuner.Autotuner, autotuner.Heuristics]
    return owners


def _state() -> dict[str, Any]:
    """The identity of every attribute of every owner, the global hooks, the modes in force and the environment."""
    import torch.nn.modules.module as module
    import torch.optim.optimizer as optimizer
    from torch.overrides import _get_current_function_mode_stack
    from torch.utils._python_dispatch import _get_current_dispatch_mode_stack

    state: dict[str, Any] = {}
    for owner in _owners():
        for name, value in list(vars(owner).items()):
            state[f"{getattr(owner, '__name__', owner)}.{name}"] = id(value)
    for hooks in ("_global_forward_pre_hooks", "_global_forward_hooks"):
        state[hooks] = tuple(getattr(module, hooks).keys())
    for hooks in ("_global_optimizer_pre_hooks", "_global_optimizer_post_hooks"):
        state[hooks] = tuple(getattr(optimizer, hooks).keys())
    # A compiled step's capture holds back composites' meta references: all are back.
    state["meta references"] = tuple(
        id(op.py_kernels.get(torch._C.DispatchKey.Meta))
        for op in (torch.ops.aten.nll_loss.default, torch.ops.aten.broadcast_tensors.default, torch.ops.aten.dropout.default)
    )
    # A preflight makes PyTorch's C++ meta kernels current: its Python ones are back.
    state["meta kernels"] = tuple(
        next(line for line in torch._C._dispatch_dump(op).splitlines() if line.startswith("Meta:"))
        for op in ("aten::add.Tensor", "aten::mul.Tensor", "aten::cat")
    )
    state["pytree nodes"] = tuple(sorted(map(str, torch.utils._pytree.SUPPORTED_NODES)))
    state["function modes"] = len(_get_current_function_mode_stack())
    state["dispatch modes"] = len(_get_current_dispatch_mode_stack())
    state["environment"] = tuple(sorted(os.environ.items()))
    state["process group"] = torch.distributed.is_initialized()
    return state


class _Net(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList([torch.nn.Linear(32, 32) for _ in range(2)])

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return x


def _compiled_loss(model: torch.nn.Module, x: torch.Tensor) -> torch.Tensor:
    return torch.compile(model)(x).float().sum()


@pytest.mark.parametrize(("gpus", "compiled"), [(1, False), (2, False), (1, True)])
def test_after_a_preflight_torch_is_as_it_was(gpus: int, compiled: bool) -> None:
    # A first run imports what PyTorch imports lazily (torch._dynamo sets
    # TORCHINDUCTOR_CACHE_DIR, and each import adds an attribute to torch):
    # PyTorch's own doing, not the fake GPU's.
    loss = _compiled_loss if compiled else None
    if compiled and importlib.util.find_spec("transformers") is not None:
        # A compiled step registers Hugging Face's cache as a pytree node where transformers is loaded: taken back too.
        importlib.import_module("transformers.cache_utils")
    oomkit.preflight(_Net, lambda b: torch.zeros(b, 32), micro_batch=4, gpus=gpus, autocast=torch.bfloat16, loss=loss)
    before = _state()
    answer = oomkit.preflight(_Net, lambda b: torch.zeros(b, 32), micro_batch=4, gpus=gpus, autocast=torch.bfloat16, loss=loss)
    assert not compiled or any("torch.compile (inductor) was modelled" in n for n in answer.notes), answer.notes
    assert answer.fits and answer.by_role["parameters"] > 0
    after = _state()
    changed = sorted(k for k in set(before) | set(after) if before.get(k) != after.get(k))
    assert not changed, changed
    # And when the step fails (counts of values the step does not have: no largest size), the same.
    with pytest.raises(oomkit.PreflightError, match="without data"):
        oomkit.preflight(
            _Net, lambda b: torch.zeros(b, 32), micro_batch=4, gpus=gpus, loss=lambda m, x: torch.bincount(m(x).flatten().long()).sum()
        )
    assert _state() == before


def test_the_ledger_names_every_stand_in() -> None:
    from oomkit.preflight.notes import Notes
    from oomkit.preflight.record.recorder import Recorder
    from oomkit.preflight.settings import Settings
    from oomkit.preflight.world.cuda import Autocast, CudaFunctions, cublas_workspace
    from oomkit.preflight.world.fake_gpu import FakeGpu, Hook, StandIn
    from oomkit.preflight.world.memory import MemoryQueries

    rec = Recorder(cublas_workspace("H100"))
    notes = Notes()
    settings = Settings(capacity="H100")
    world = FakeGpu(
        settings=settings,
        recorder=rec,
        memory=MemoryQueries(rec, lambda: None, settings.capacity_bytes, notes),
        autocast=Autocast(),
        functions=CudaFunctions(Autocast()),
        notes=notes,
    )
    ledger = world.ledger()
    assert all(isinstance(e, (StandIn, Hook)) and e.what for e in ledger)
    replaced = {(getattr(e.owner, "__name__", str(e.owner)), e.name) for e in ledger if isinstance(e, StandIn)}
    for want in [
        ("torch.cuda", "is_available"),
        ("torch.cuda", "memory_allocated"),
        ("torch", "compile"),
        ("DataLoader", "__init__"),
        ("UntypedStorage", "resize_"),
        ("autocast", "__enter__"),
        ("torch.distributed", "init_process_group"),
    ]:
        assert want in replaced, (want, sorted(replaced))


# ----- no import circles, no long function without a why ------------------


def test_an_import_circle_in_a_crate_is_found(tmp_path: Path) -> None:
    check = _check_deps()
    src = tmp_path / "crate" / "src"
    (src / "text").mkdir(parents=True)
    (src / "lib.rs").write_text("mod a;\nmod b;\nmod text;\npub use a::A;\n")
    (src / "a.rs").write_text("use crate::b::B;\npub struct A(B);\n")
    (src / "b.rs").write_text("use crate::{a::A, text::t};\npub struct B;\n#[cfg(test)]\nmod tests {\n    use crate::a::A;\n}\n")
    (src / "text" / "mod.rs").write_text("mod t;\npub use t::*;\n")
    (src / "text" / "t.rs").write_text("pub fn t() { super::u(); }\n")
    graph = check.rust_graph(str(tmp_path / "crate"))
    # A group (`crate::{a::A, text::t}`) opened, the test module left out, `super::` followed.
    assert graph["b"] == {"a", "text::t"} and graph["a"] == {"b"} and graph["text::t"] == {"text"}
    assert check.circles(graph) == [["a", "b"]]
    # Without the edge back, none.
    (src / "a.rs").write_text("pub struct A;\n")
    assert check.circles(check.rust_graph(str(tmp_path / "crate"))) == []


def test_an_import_circle_in_the_package_is_found_type_checking_imports_too(tmp_path: Path) -> None:
    check = _check_deps()
    pkg = tmp_path / "pkg"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("from pkg import a\n")
    (pkg / "a.py").write_text("from pkg._b import thing\n")
    (pkg / "_b.py").write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING
            if TYPE_CHECKING:
                from pkg.a import A
            thing = 1
            """
        )
    )
    assert check.circles(check.python_graph(str(pkg))) == [["pkg._b", "pkg.a"]]
    (pkg / "_b.py").write_text("thing = 1\n")
    assert check.circles(check.python_graph(str(pkg))) == []


def test_an_import_back_up_the_python_layers_is_found() -> None:
    check = _check_deps()
    # The driver records and the answer tells: the driver reaching up for the answer is refused.
    graph = {
        "oomkit.preflight.driver": {"oomkit.preflight.record.recorder", "oomkit.preflight.answer"},
        "oomkit.preflight.answer": {"oomkit.preflight.driver"},
        "oomkit.preflight.record.recorder": set(),
        "oomkit.tracker.tracker": {"oomkit.integrations.transformers"},
        "oomkit.integrations.transformers": {"oomkit.tracker.tracker"},
        "oomkit.preflight.elsewhere": set(),
    }
    found = check.layer_violations(graph)
    assert any("oomkit.preflight.driver (preflight's driver and fixes) imports oomkit.preflight.answer" in p for p in found), found
    assert any("oomkit.tracker.tracker (the tracker) imports oomkit.integrations.transformers" in p for p in found), found
    assert any("oomkit.preflight.elsewhere is in no layer" in p for p in found), found
    # The answer reaching down for the driver, and an integration for the tracker, are the layers' order.
    assert len(found) == 3, found
    # And `from pkg import module` is an import of the module, not of the package's face.
    assert "oomkit.tracker" not in check.python_graph(check.PACKAGE)["oomkit.tracker.tracker"]


def test_a_long_function_needs_a_word_on_why(tmp_path: Path) -> None:
    check = _check_deps()
    body = "\n".join(f"    let x{i} = {i};" for i in range(check.LONG_FUNCTION + 5))
    rs = tmp_path / "long.rs"
    rs.write_text(f"/// Adds.\nfn long() {{\n{body}\n}}\n\n/// Adds.\n///\n/// Long on purpose: one table read top to bottom.\nfn kept() {{\n{body}\n}}\n")
    found = {name: why for name, _line, _length, why in check.rust_long_functions(str(rs))}
    assert found == {"long": False, "kept": True}
    py = tmp_path / "long.py"
    lines = "\n".join(f"    x{i} = {i}" for i in range(check.LONG_FUNCTION + 5))
    py.write_text(f'def long():\n{lines}\n\n\ndef kept():\n    """Kept whole: one table."""\n{lines}\n')
    found = {name: why for name, _line, _length, why in check.python_long_functions(str(py))}
    assert found == {"long": False, "kept": True}


def test_the_repository_keeps_the_rules() -> None:
    check = _check_deps()
    assert check.import_circles() == []
    assert check.python_layers() == []
    assert check.long_functions() == []


# ----- docs/architecture.md names every module -----------------------------


def test_the_architecture_names_every_module() -> None:
    # Each crate's row of the table names each of its modules (`name.rs`, `dir/`), and the package's rows each file.
    rows = {}
    for line in (ROOT / "docs" / "architecture.md").read_text().splitlines():
        row = re.match(r"\| `(crates/[a-z-]+|python/oomkit(?:/[a-z_/]+)?)` \|(.*)", line)
        if row:
            rows[row.group(1)] = set(re.findall(r"([A-Za-z0-9_]+)(?:\.rs|\.py|/)", row.group(2)))
    missing = []
    for crate in sorted((ROOT / "crates").iterdir()):
        if not (crate / "src").is_dir():
            continue
        named = rows.get(f"crates/{crate.name}", set())
        for path in sorted((crate / "src").rglob("*.rs")):
            stem = path.stem if path.stem != "mod" else path.parent.name
            if stem not in ("lib", "main", "tests") and path.parent.name != "bin" and stem not in named:
                missing.append(str(path.relative_to(ROOT)))
    # Every folder of the package has its row, naming each of its modules.
    for init in sorted((ROOT / "python" / "oomkit").rglob("__init__.py")):
        folder = str(init.parent.relative_to(ROOT))
        if folder not in rows:
            missing.append(f"{folder}/ (no row)")
            continue
        for path in sorted(init.parent.glob("*.py")):
            if path.stem != "__init__" and path.stem not in rows[folder]:
                missing.append(str(path.relative_to(ROOT)))
    assert not missing, f"docs/architecture.md does not name: {missing}"


if sys.platform == "win32":  # pragma: no cover - oomkit's tests run on Linux
    pytest.skip("Linux only", allow_module_level=True)


def test_a_stand_in_for_a_module_imported_later_is_set_at_its_import_and_taken_back(tmp_path: Path) -> None:
    import importlib
    import sys

    from oomkit.preflight.world.imports import when_imported

    (tmp_path / "later_lib.py").write_text("def kernel():\n    return 'native'\n")
    sys.path.insert(0, str(tmp_path))
    try:
        handle = when_imported("later_lib")(lambda m: [(m, "kernel", lambda: "stand-in"), (m, "extra", 1)])
        module = importlib.import_module("later_lib")
        assert module.kernel() == "stand-in" and module.extra == 1
        handle.remove()
        # The module's own function back, the added name gone, and no finder left behind.
        assert module.kernel() == "native" and not hasattr(module, "extra")
        assert not any(type(f).__name__ == "_Finder" for f in sys.meta_path)
        # A module imported already gets its stand-ins at once.
        handle = when_imported("later_lib")(lambda m: [(m, "kernel", lambda: "again")])
        assert module.kernel() == "again"
        handle.remove()
        assert module.kernel() == "native"
        # Two hooks waiting for one module (bitsandbytes.functional's paged buffers and its 8-bit
        # layers' outliers): each finder leaves the finding to the others, so neither asks the
        # other without end, and both sets of stand-ins are set at its import and taken back.
        sys.modules.pop("later_lib")
        first = when_imported("later_lib")(lambda m: [(m, "kernel", lambda: "first")])
        second = when_imported("later_lib")(lambda m: [(m, "extra", 2)])
        module = importlib.import_module("later_lib")
        assert module.kernel() == "first" and module.extra == 2
        first.remove()
        second.remove()
        assert module.kernel() == "native" and not hasattr(module, "extra")
        assert not any(type(f).__name__ == "_Finder" for f in sys.meta_path)
    finally:
        sys.path.remove(str(tmp_path))
        sys.modules.pop("later_lib", None)


def test_names_a_library_imported_during_a_preflight_do_as_they_did_after_it(tmp_path: Path) -> None:
    # A library imported while a preflight runs in the user's process keeps the stand-ins under
    # the names it imported them by (transformers' ``from safetensors.torch import save_file as
    # safe_save_file``, ``from huggingface_hub import hf_hub_download``). After the preflight, a
    # save through such a name must write, and a load of a missing file must fail as it would.
    (tmp_path / "binds.py").write_text(
        "from safetensors.torch import load_file, save_file\nimport torch\nsave, load = torch.save, torch.load\n"
    )
    code = f"""
import sys, torch, oomkit
sys.path.insert(0, {str(tmp_path)!r})
def net():
    import binds  # imported under the preflight, as a script's libraries are
    return torch.nn.Linear(8, 8)
oomkit.preflight(net, lambda b: torch.zeros(b, 8), micro_batch=2)
import binds
binds.save_file({{"w": torch.ones(2)}}, {str(tmp_path / "w.safetensors")!r})
binds.save({{"w": torch.ones(2)}}, {str(tmp_path / "w.pt")!r})
assert binds.load_file({str(tmp_path / "w.safetensors")!r})["w"].sum() == 2
assert binds.load({str(tmp_path / "w.pt")!r})["w"].sum() == 2
try:
    binds.load_file({str(tmp_path / "missing.safetensors")!r})
except FileNotFoundError:
    print("ok")
"""
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0 and p.stdout.strip() == "ok", p.stderr[-3000:]
