"""The hooks that find a step's stages with no user code.

The model's forward pre- and post-hooks, a hook on its outputs for the
backward, and the optimizer's step hooks; and the steps the tracker opens
itself where the code marks none.
"""

from __future__ import annotations

import functools
import sys
from typing import TYPE_CHECKING, Any, Optional

from oomkit.tracker import holdings
from oomkit.tracker.holdings import _is_tensor
from oomkit.tracker.measure import _torch

if TYPE_CHECKING:
    from oomkit.tracker.core import TrackerCore


# How many tensors of a model's output get a hook that marks the start of backward.
_BACKWARD_MARKS = 4


def _grad_tensors(output: Any, depth: int = 4, out: Optional[list[Any]] = None) -> list[Any]:
    """Finds up to a few tensors in a model's output through which backward may pass.

    Several, because the loss a framework backpropagates is not always the
    first tensor of the output (a custom loss on the logits, say); the first
    hook to fire starts the backward stage.
    """
    found: list[Any] = [] if out is None else out
    if depth < 0 or len(found) >= _BACKWARD_MARKS:
        return found
    if _is_tensor(output):
        if output.requires_grad:
            found.append(output)
        return found
    if isinstance(output, dict):
        items = list(output.values())
    elif isinstance(output, (list, tuple)):
        items = list(output)
    elif hasattr(output, "__dict__"):
        items = list(vars(output).values())
    else:
        return found
    for v in items:
        _grad_tensors(v, depth - 1, found)
        if len(found) >= _BACKWARD_MARKS:
            break
    return found


def hooks_mark(tracker: TrackerCore) -> bool:
    """Whether stage hooks should mark a stage now: inside a step, outside any phase."""
    return tracker.stage_hooks and tracker.books.step_open is not None and not tracker.books.phases

# ----- hooks ------------------------------------------------------------

def install_model_hooks(tracker: TrackerCore, model: Any) -> None:
    try:
        if tracker.stage_hooks:
            tracker.books.model_hooks.append(model.register_forward_pre_hook(functools.partial(on_forward_pre, tracker)))
        try:
            # Called also when the forward raises, so an OOM there is
            # recorded before anything unwinds, even if a framework
            # catches it (accelerate's batch finder does).
            tracker.books.model_hooks.append(model.register_forward_hook(functools.partial(on_forward, tracker), always_call=True))
        except TypeError:  # torch without always_call
            tracker.books.model_hooks.append(model.register_forward_hook(functools.partial(on_forward, tracker)))
    except Exception as exc:  # noqa: BLE001
        tracker.report_error("model hooks", exc)

def on_forward_pre(tracker: TrackerCore, module: Any, args: Any) -> None:
    auto_step(tracker, module)
    if hooks_mark(tracker):
        tracker.begin_stage("forward")

def auto_step(tracker: TrackerCore, module: Any) -> None:
    """Opens a step at a training forward when the code marks none, so that its optimizer steps count as steps.

    The step ends at the optimizer's step (``_on_opt_post``); with no
    optimizer tracked, where the next training forward starts after a
    backward. Forwards in eval mode or without gradients open nothing.
    """
    if tracker.books.user_steps or tracker.books.phases or tracker.books.closed:
        return
    try:
        if not getattr(module, "training", True) or not _torch().is_grad_enabled():
            return
        step = tracker.books.step_open
        if step is not None and step.auto and tracker.books.opt_ref is None and tracker.books.auto_backward:
            tracker.end_step()
            step = None
        if step is None:
            tracker.open_step(tracker.books.steps_done, auto=True)
    except Exception as exc:  # noqa: BLE001
        tracker.report_error("automatic step", exc)

def on_forward(tracker: TrackerCore, module: Any, args: Any, output: Any) -> None:
    failing = sys.exc_info()[1]
    if failing is not None and output is None:
        tracker.record_oom(failing)
        return
    tracker.books.seen["forward"] += 1
    # A new forward means any backward before it has ended, even one that raised.
    tracker.books.backward_pending = False
    if hooks_mark(tracker) and tracker.books.stage is not None and tracker.books.stage.name == "forward":
        tracker.end_stage()
    # The backward is watched inside steps, and everywhere while the code
    # marks no step (it may be the only sign of training); a loop that
    # marks its own steps pays nothing for forwards outside them.
    if not tracker.stage_hooks or (tracker.books.user_steps and tracker.books.step_open is None):
        return
    try:
        if _torch().is_grad_enabled():
            for t in _grad_tensors(output):
                t.register_hook(functools.partial(on_backward_start, tracker))
    except Exception as exc:  # noqa: BLE001
        tracker.report_error("forward hook", exc)

def on_backward_start(tracker: TrackerCore, grad: Any) -> None:
    try:
        # Each output's hook fires; the first one of a backward pass marks it.
        if tracker.books.backward_pending:
            return None
        tracker.books.backward_pending = True
        if hooks_mark(tracker) and tracker.books.stage is None:
            tracker.begin_stage("backward")
        from torch.autograd import Variable

        Variable._execution_engine.queue_callback(functools.partial(on_backward_end, tracker))
    except Exception as exc:  # noqa: BLE001
        tracker.report_error("backward hook", exc)
    return None

def on_backward_end(tracker: TrackerCore) -> None:
    tracker.books.backward_pending = False
    tracker.books.seen["backward"] += 1
    tracker.books.auto_backward = True
    if tracker.books.stage is not None and tracker.books.stage.name == "backward":
        tracker.end_stage()
        if tracker.books.opt_ref is None and due(tracker):
            holdings.grad_health(tracker)

def on_opt_pre(tracker: TrackerCore, opt: Any, args: Any, kwargs: Any) -> None:
    if hooks_mark(tracker):
        tracker.begin_stage("optimizer")

def on_opt_post(tracker: TrackerCore, opt: Any, args: Any, kwargs: Any) -> None:
    tracker.books.seen["optimizer"] += 1
    if tracker.books.stage is not None and tracker.books.stage.name == "optimizer":
        tracker.end_stage()
    if tracker.books.step_open is not None and tracker.books.step_open.auto:
        tracker.end_step()

def due(tracker: TrackerCore) -> bool:
    return tracker.books.step_open is not None and (tracker.books.step_open.step or 0) % tracker.grad_every == 0
