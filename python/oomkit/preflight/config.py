"""``oomkit estimate --config config.json --trace``: the model built from its config, its step traced.

``oomkit estimate`` runs ``python -m oomkit.preflight.config`` with its
settings in ``OOMKIT_PREFLIGHT_CONFIG`` (JSON); this builds the Hugging
Face model from the config as a script does (``from_pretrained``, which
preflight answers with no download and no weight file read; LoRA through
PEFT; 4-bit through ``BitsAndBytesConfig``), runs the training step the
flags describe through :func:`oomkit.preflight`, and writes the answer (or
the one line why it cannot) to the result file.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import sys
import tempfile
import warnings
from collections.abc import Iterator
from typing import Any

import oomkit
from oomkit.preflight.driver import OPTIMIZERS
from oomkit.preflight.frameworks.huggingface import CONFIG_NAME, model_from_config, random_batch

#: The environment variable carrying the settings from ``oomkit estimate``.
ENV = "OOMKIT_PREFLIGHT_CONFIG"

#: ZeRO stages preflight runs, as what PyTorch keeps the same states with:
#: DDP for stage 0 (nothing sharded), DDP with ZeroRedundancyOptimizer for 1,
#: FSDP's strategies for 2 and 3.
ZERO_SHARDING = {0: "ddp", 1: "zero1", 2: "zero2", 3: "zero3"}

#: The EMA's decay; memory does not depend on it.
EMA_DECAY = 0.999

#: Said in the answer when the step keeps an EMA copy.
EMA_NOTE = "the EMA copy (one more copy of every weight, updated in place after each optimizer step) counts as parameters"


def _with_ema(model: Any) -> Any:
    """Attaches an exponential moving average of ``model``'s weights, as a frozen copy the optimizer's steps update.

    The copy is a submodule, so it is counted with the weights; the update
    (``torch._foreach_lerp_``, in place, as timm's ``ModelEmaV3`` does it)
    runs after each optimizer step, from the hook the optimizer factory of
    :func:`_ema_updating` registers.
    """
    import torch

    live = list(model.parameters())
    holder = torch.nn.Module()
    holder.weights = torch.nn.ParameterList(torch.nn.Parameter(p.detach().clone(), requires_grad=False) for p in live)
    model.oomkit_ema = holder
    model.oomkit_ema_pairs = (list(holder.weights), live)
    return model


def _ema_updating(make: Any, model: Any) -> Any:
    """``make``'s optimizer, which moves ``model``'s EMA copy toward the weights after each step."""
    import torch

    def build(params: Any) -> Any:
        opt = make(params)
        averages, live = model().oomkit_ema_pairs

        @torch.no_grad()
        def update(*_: Any) -> None:
            torch._foreach_lerp_(averages, live, 1 - EMA_DECAY)

        opt.register_step_post_hook(update)
        return opt

    return build


def _quiet_libraries() -> None:
    """No progress bar or deprecation warning from the libraries that build the model: this is
    oomkit's own process, whose output is the estimate's, not a script's."""
    warnings.simplefilter("ignore", FutureWarning)
    try:
        import transformers

        transformers.utils.logging.set_verbosity_error()
        transformers.utils.logging.disable_progress_bar()
    except ImportError:
        # Said where the model is built, in the answer's one line.
        pass


@contextlib.contextmanager
def _model_folder(config: str) -> Iterator[str]:
    """A model folder holding ``config`` as its ``config.json``: its own folder where it is named so
    (a model folder, the hub's cache), else a temporary one with a copy, removed after."""
    if os.path.basename(config) == CONFIG_NAME:
        yield os.path.dirname(os.path.abspath(config))
        return
    with tempfile.TemporaryDirectory(prefix="oomkit-config-") as folder:
        shutil.copyfile(config, os.path.join(folder, CONFIG_NAME))
        yield folder


def _unsupported(s: dict[str, Any]) -> str | None:
    if int(s.get("gpus", 1)) > 1 and int(s.get("zero", 0)) not in ZERO_SHARDING:
        return f"ZeRO stage {s.get('zero', 0)} is not one PyTorch runs"
    if s.get("ema") and int(s.get("gpus", 1)) > 1:
        return "an EMA copy of sharded weights is not traced"
    return None


def main() -> int:
    raw = os.environ.get(ENV)
    if not raw:
        sys.stderr.write(f"{ENV} is not set: this module is run by `oomkit estimate --trace`\n")
        return 2
    s = json.loads(raw)
    result: dict[str, Any]
    why = _unsupported(s)
    if why is not None:
        result = {"error": f"not traced: {why}; the formula's figures stand"}
    else:
        stack = contextlib.ExitStack()
        try:
            import torch

            _quiet_libraries()

            with open(s["config"], encoding="utf-8") as f:
                config = json.load(f)
            folder = stack.enter_context(_model_folder(s["config"]))
            built: list[Any] = []

            def build() -> Any:
                model = model_from_config(folder, s)
                built.append(_with_ema(model) if s.get("ema") else model)
                return built[-1]

            optimizer: Any = {"adamw": "adamw", "sgd": "sgd", "adafactor": "adafactor", "adamw8bit": "adamw8bit"}[s["optimizer"]]
            if s.get("ema"):
                optimizer = _ema_updating(OPTIMIZERS[optimizer], lambda: built[-1])
            autocast = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(s["dtype"]) if s["mixed_precision"] else None

            def batch(b: int) -> Any:
                return random_batch(built[-1], config, int(s["seq"]), b)

            answer = oomkit.preflight(
                build,
                batch,
                micro_batch=int(s["batch"]),
                optimizer=optimizer,
                autocast=autocast,
                capacity=s["capacity"],
                gpus=int(s.get("gpus", 1)),
                sharding=ZERO_SHARDING.get(int(s.get("zero", 0)), "fsdp"),
            )
            if s.get("ema"):
                answer.notes.append(EMA_NOTE)
            result = {"result": answer.as_dict()}
        except ImportError as e:
            result = {"error": f"not traced: {e} (install transformers where oomkit runs)"}
        except (oomkit.OomkitError, ValueError, TypeError, KeyError, AttributeError, OSError) as e:
            result = {"error": f"not traced: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"}
        finally:
            stack.close()
    with open(s["result"], "w", encoding="utf-8") as f:
        json.dump(result, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
