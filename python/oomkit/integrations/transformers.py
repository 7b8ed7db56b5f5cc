"""oomkit in the Hugging Face ``Trainer``: one callback for stage memory, the eval phase and OOM capture.

Example::

    from oomkit.integrations.transformers import OomkitCallback, train

    trainer = Trainer(model=model, args=args, train_dataset=data, callbacks=[OomkitCallback()])
    train(trainer)        # or trainer.train(); see "OOM capture" below

What it records, per rank, in ``<output_dir>/oomkit-logs/run-*.jsonl``:

- every optimizer step is a tracker step; the model's forward and the
  backward through its output are found by hooks for each micro-batch, and
  the optimizer stage by the (unwrapped) optimizer's step hooks, so a step
  with gradient accumulation 2 reads forward, backward, forward, backward,
  optimizer;
- evaluation is an ``eval`` phase (opened when the Trainer decides to
  evaluate, closed by ``on_evaluate``);
- OOM capture: the Trainer has no exception event. An OOM in the model's
  forward is recorded by the tracker's forward hook as it happens; on CUDA,
  the allocator's OOM observer records any other. An OOM that ends the
  script is recorded by a ``sys.excepthook`` the callback chains while
  training; ``train(trainer)`` records one that the caller catches.
- under ``oomkit run``, the micro-batch and accumulation that ``oomkit run``
  chose (``OOMKIT_MICRO_BATCH``, ``OOMKIT_GRAD_ACCUM``) replace the script's
  ``per_device_train_batch_size`` and ``gradient_accumulation_steps`` when the
  Trainer is built, and the log and stderr say so.
"""

from __future__ import annotations

import contextlib
import sys
import types
from typing import Any, Optional

import transformers
from transformers import TrainerCallback

from oomkit import _plan
from oomkit.tracker.tracker import Tracker, _integration_writes_plan

__all__ = ["OomkitCallback", "train"]

FRAMEWORK = "transformers"
# How many frames up from a callback event the Trainer that fired it is looked for.
_TRAINER_FRAMES = 12


def _find_trainer() -> Any:
    """The Trainer whose event is being handled, found on the call stack.

    Callbacks are not handed the Trainer (transformers#38181), but
    ``on_init_end`` is called from ``Trainer.__init__``, whose frame holds it.
    """
    frame: Optional[types.FrameType] = sys._getframe(1)
    for _ in range(_TRAINER_FRAMES):
        if frame is None:
            return None
        owner = frame.f_locals.get("self")
        if isinstance(owner, transformers.Trainer):
            return owner
        frame = frame.f_back
    return None


def _loader_batch(loader: Any) -> Optional[int]:
    """The batch size a DataLoader yields, where it says."""
    size = getattr(loader, "batch_size", None)
    if size is None:
        size = getattr(getattr(loader, "batch_sampler", None), "batch_size", None)
    if size is None:  # accelerate's DataLoaderShard keeps the original batch sampler inside
        size = getattr(getattr(getattr(loader, "base_dataloader", None), "batch_sampler", None), "batch_size", None)
    return int(size) if isinstance(size, int) else None


class OomkitCallback(TrainerCallback):
    """A ``TrainerCallback`` that records oomkit's run log: stages per step, the eval phase, components and OOMs.

    ``log_dir`` defaults to ``$OOMKIT_LOG_DIR`` or ``<output_dir>/oomkit-logs``;
    the other keyword arguments go to :class:`oomkit.Tracker` (``grad_every``,
    ``record_history``, ``max_entries``, ``check_duplicates``, ``ema``,
    ``console``). ``apply_plan=False`` leaves the batch settings alone under
    ``oomkit run``.
    """

    def __init__(self, log_dir: Any = None, *, apply_plan: bool = True, **tracker_options: Any) -> None:
        self.log_dir = log_dir
        self.apply_plan = apply_plan
        self.tracker_options = tracker_options
        self.tracker: Optional[Tracker] = None
        self.plan: Optional[_plan.Plan] = None
        self._previous_hook: Any = None

    @property
    def log_path(self) -> Optional[str]:
        """The run log, once training has begun."""
        return self.tracker.log_path if self.tracker is not None else None

    # ----- the plan from `oomkit run` ----------------------------------------

    def on_init_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        stop = _plan.elastic_stop() if self.apply_plan else None
        if stop is not None:
            from oomkit.auto_batch import BatchSizeError

            raise BatchSizeError(stop)
        plan = _plan.handed_down() if self.apply_plan else None
        if plan is None:
            return
        with contextlib.suppress(Exception):
            if apply(_find_trainer(), plan, args):
                self.plan = plan

    # ----- training ----------------------------------------------------------

    def on_train_begin(self, args: Any, state: Any, control: Any, model: Any = None, optimizer: Any = None, **kwargs: Any) -> None:
        try:
            micro = _loader_batch(kwargs.get("train_dataloader")) or args.per_device_train_batch_size
            # A second on_train_begin without on_train_end between them is
            # accelerate's batch finder starting again after an OOM.
            tracker = self.tracker
            retry = tracker is not None and not tracker.closed
            record: dict[str, Any]
            offered = self.plan or (_plan.handed_down() if self.apply_plan else None)
            if offered is not None and not retry:
                # What the Trainer really runs decides whether the plan was applied.
                accum = int(args.gradient_accumulation_steps)
                applied = self.plan is not None and micro == offered.micro_batch and accum == offered.grad_accum
                reason = None
                if not applied:
                    reason = (
                        "the Trainer was not found to apply it"
                        if self.plan is None
                        else f"the Trainer trains with micro-batch {micro} x accumulation {accum}"
                    )
                _plan.report_plan(offered, applied, reason, by="transformers callback")
            if self.plan is not None and self.plan.micro_batch == micro:
                record = self.plan.record(FRAMEWORK)
            else:
                record = _plan.Plan(
                    micro_batch=int(micro),
                    grad_accum=int(args.gradient_accumulation_steps),
                    source="auto_find_batch_size" if retry else "training arguments",
                ).record(FRAMEWORK)
            if retry and tracker is not None:
                # accelerate's batch finder starts the loop again after an OOM
                # with a smaller batch, a new optimizer and a new state.
                tracker.end_step()
                tracker.set_optimizer(optimizer)
            elif model is not None:
                log_dir = self.log_dir or _plan.default_log_dir(args.output_dir)
                options = dict(self.tracker_options)
                options.setdefault("rank", args.process_index)
                with _integration_writes_plan():
                    self.tracker = Tracker(model, optimizer=optimizer, log_dir=log_dir, **options)
                self._chain_excepthook()
            if self.tracker is not None:
                self.tracker.note("plan", **record)
        except Exception as exc:  # noqa: BLE001 - the tracker never stops training
            _plan.say(f"the tracker could not start (training continues): {exc}")

    def on_step_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracker is not None:
            self.tracker.begin_step(state.global_step)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracker is None:
            return
        self.tracker.end_step()
        # DefaultFlowCallback, which runs first, has just decided this.
        if control.should_evaluate:
            self._begin_eval()

    def on_epoch_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracker is not None:
            self.tracker.end_step()
            if control.should_evaluate:
                self._begin_eval()

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        # An evaluation the Trainer did not announce (eval_on_start, or
        # trainer.evaluate() called directly): measure it from here on.
        if self.tracker is not None and not self.tracker.in_step and self.tracker.current_phase is None:
            self._begin_eval()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        if self.tracker is not None and self.tracker.current_phase == "eval":
            self.tracker.end_phase()

    def on_predict(self, args: Any, state: Any, control: Any, metrics: Any = None, **kwargs: Any) -> None:
        self.on_evaluate(args, state, control)

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self.close()

    # ----- OOMs --------------------------------------------------------------

    def record_oom(self, exc: BaseException) -> bool:
        """Records ``exc`` if it is (or was caused by) an OOM; returns whether it is one."""
        return self.tracker.record_oom(exc) if self.tracker is not None else False

    def close(self) -> None:
        """Closes the run log and gives back ``sys.excepthook``."""
        if self.tracker is not None:
            self.tracker.close()
        if self._previous_hook is not None and sys.excepthook == self._excepthook:
            sys.excepthook = self._previous_hook
        self._previous_hook = None

    def _begin_eval(self) -> None:
        if self.tracker is not None and self.tracker.current_phase != "eval":
            self.tracker.begin_phase("eval")

    def _chain_excepthook(self) -> None:
        if self._previous_hook is None:
            self._previous_hook = sys.excepthook
            sys.excepthook = self._excepthook

    def _excepthook(self, kind: Any, exc: BaseException, tb: Any) -> None:
        # The traceback still holds the failed step's tensors: the memory
        # figures and a snapshot are those of the OOM.
        with contextlib.suppress(Exception):
            self.record_oom(exc)
            if self.tracker is not None:
                self.tracker.close()
        previous = self._previous_hook or sys.__excepthook__
        previous(kind, exc, tb)


def apply(trainer: Any, plan: _plan.Plan, args: Any = None) -> bool:
    """Makes ``trainer`` train with ``plan``'s micro-batch and accumulation; returns False when it cannot.

    Sets ``per_device_train_batch_size`` and ``gradient_accumulation_steps``
    of the training arguments, and the batch size the Trainer copied from
    them when it was built. Says so on stderr.
    """
    args = args if args is not None else getattr(trainer, "args", None)
    attempt = f" attempt {plan.attempt}" if plan.attempt else ""
    if args is None or not hasattr(trainer, "_train_batch_size"):
        _plan.say(
            f"{plan.source}{attempt} chose micro-batch {plan.micro_batch} x accumulation {plan.grad_accum}, "
            "but the Trainer was not found to apply it: pass per_device_train_batch_size={batch_size} "
            "and gradient_accumulation_steps={grad_accum} in the command"
        )
        return False
    before = (args.per_device_train_batch_size, args.gradient_accumulation_steps)
    args.per_device_train_batch_size = plan.micro_batch
    args.gradient_accumulation_steps = plan.grad_accum
    trainer._train_batch_size = args.train_batch_size
    if int(transformers.__version__.split(".")[0]) < 5:
        # Before 5.0 the accelerator kept its own copy of the accumulation.
        with contextlib.suppress(Exception):
            trainer.accelerator.gradient_accumulation_steps = plan.grad_accum
    _plan.say(
        f"{plan.source}{attempt}: training with micro-batch {plan.micro_batch} x accumulation "
        f"{plan.grad_accum} (the script asked for {before[0]} x {before[1]})"
    )
    return True


def train(trainer: Any, *args: Any, **kwargs: Any) -> Any:
    """Runs ``trainer.train(*args, **kwargs)``, recording an OOM that leaves it even if the caller catches it.

    Also applies ``oomkit run``'s plan if the callback could not.
    """
    callback = next(
        (c for c in trainer.callback_handler.callbacks if isinstance(c, OomkitCallback)),
        None,
    )
    if callback is not None and callback.apply_plan and callback.plan is None:
        plan = _plan.handed_down()
        if plan is not None and apply(trainer, plan):
            callback.plan = plan
    try:
        return trainer.train(*args, **kwargs)
    except BaseException as exc:
        if callback is not None:
            callback.record_oom(exc)
            callback.close()
        raise
