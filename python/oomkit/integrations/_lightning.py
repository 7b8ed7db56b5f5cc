"""What oomkit's Lightning callback does, shared by the ``lightning.pytorch`` and ``pytorch_lightning`` classes.

Lightning checks callbacks by class per namespace and refuses mixed
imports, so each namespace gets its own class over this one mixin.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

from oomkit import _plan
from oomkit.tracker import Tracker

FRAMEWORK = "lightning"


class OomkitLightningMixin:
    """Stages, phases and OOMs from Lightning's own hooks, and ``oomkit run``'s plan applied in ``setup``.

    Under automatic optimization ``optimizer.step(closure)`` runs the
    forward and backward inside the step, so the optimizer's own hooks would
    mark the stages in the wrong order; the tracker is built with
    ``stage_hooks=False`` and stages come from Lightning's events: forward
    from ``on_train_batch_start``, backward from ``on_before_backward`` to
    ``on_after_backward``, optimizer from ``on_before_optimizer_step`` to the
    end of the batch. A tracker step spans the micro-batches of one optimizer
    step, so ``accumulate_grad_batches=2`` reads forward, backward, forward,
    backward, optimizer.
    """

    # Set by the namespace module: its `lightning_setattr` family.
    _parsing: Any = None

    def __init__(self, log_dir: Any = None, *, apply_plan: bool = True, **tracker_options: Any) -> None:
        super().__init__()
        self.log_dir = log_dir
        self.apply_plan = apply_plan
        self.tracker_options = tracker_options
        self.tracker: Optional[Tracker] = None
        # The latest run log, kept after the tracker closes.
        self.log_path: Optional[str] = None
        self.plan: Optional[_plan.Plan] = None
        # True for the callback Lightning's entry point added under `oomkit run`.
        self.automatic = False
        self._disabled = False
        self._stepped = False

    # ----- set-up ------------------------------------------------------------

    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        if self.automatic and any(
            isinstance(c, OomkitLightningMixin) and c is not self and not c.automatic for c in trainer.callbacks
        ):
            # The user added one already; it does the work.
            self._disabled = True
            return
        if stage == "fit" and self.apply_plan and self.plan is None:
            stop = _plan.elastic_stop()
            if stop is not None:
                from oomkit.auto_batch import BatchSizeError

                raise BatchSizeError(stop)
            plan = _plan.handed_down()
            if plan is not None:
                self._apply(trainer, pl_module, plan)

    def _apply(self, trainer: Any, pl_module: Any, plan: _plan.Plan) -> None:
        """Sets the micro-batch where Lightning's batch-size finder would, and accumulate_grad_batches."""
        parsing = self._parsing
        attempt = f" attempt {plan.attempt}" if plan.attempt else ""
        try:
            before = parsing.lightning_getattr(pl_module, "batch_size")
            parsing.lightning_setattr(pl_module, "batch_size", plan.micro_batch)
        except Exception:  # noqa: BLE001 - no batch_size anywhere Lightning looks
            _plan.say(
                f"{plan.source}{attempt} chose micro-batch {plan.micro_batch}, but neither the LightningModule, "
                "its hparams nor the datamodule has a batch_size attribute to set: give the command "
                "{batch_size} instead"
            )
            return
        accum_before = trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = plan.grad_accum
        self.plan = plan
        _plan.say(
            f"{plan.source}{attempt}: training with micro-batch {plan.micro_batch} x accumulation "
            f"{plan.grad_accum} (the script asked for {before} x {accum_before})"
        )

    def _ensure_tracker(self, trainer: Any, pl_module: Any) -> Optional[Tracker]:
        if self._disabled:
            return None
        if self.tracker is None:
            try:
                log_dir = self.log_dir or _plan.default_log_dir(trainer.default_root_dir)
                options = dict(self.tracker_options)
                options.setdefault("rank", trainer.global_rank)
                optimizers = list(getattr(trainer, "optimizers", None) or [])
                self.tracker = Tracker(
                    pl_module,
                    optimizer=optimizers[0] if optimizers else None,
                    log_dir=log_dir,
                    stage_hooks=False,
                    **options,
                )
                self.log_path = self.tracker.log_path
                record = (
                    self.plan
                    or _plan.Plan(
                        micro_batch=self._batch_size(pl_module) or 0,
                        grad_accum=int(trainer.accumulate_grad_batches),
                        source="trainer arguments",
                    )
                ).record(FRAMEWORK)
                if not record["micro_batch"]:
                    record["micro_batch"] = record["effective_batch"] = None
                self.tracker.note("plan", **record)
            except Exception as exc:  # noqa: BLE001 - the tracker never stops training
                self._disabled = True
                _plan.say(f"the tracker could not start (training continues): {exc}")
        return self.tracker

    def _batch_size(self, pl_module: Any) -> Optional[int]:
        with contextlib.suppress(Exception):
            if self._parsing.lightning_hasattr(pl_module, "batch_size"):
                value = self._parsing.lightning_getattr(pl_module, "batch_size")
                return value if isinstance(value, int) else None
        return None

    def _with_tracker(self, call: Callable[[Tracker], Any]) -> None:
        if self.tracker is not None and not self._disabled:
            call(self.tracker)

    # ----- training ----------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._ensure_tracker(trainer, pl_module)

    def on_train_batch_start(self, trainer: Any, pl_module: Any, batch: Any, batch_idx: int) -> None:
        tracker = self._ensure_tracker(trainer, pl_module)
        if tracker is None:
            return
        if not tracker.in_step:
            # Lightning's batches are micro-batches; global_step counts optimizer steps.
            tracker.begin_step(trainer.global_step)
            self._stepped = False
        tracker.begin_stage("forward")

    def on_before_backward(self, trainer: Any, pl_module: Any, loss: Any) -> None:
        self._with_tracker(lambda t: t.begin_stage("backward"))

    def on_after_backward(self, trainer: Any, pl_module: Any) -> None:
        self._with_tracker(lambda t: t.end_stage())

    def on_before_optimizer_step(self, trainer: Any, pl_module: Any, optimizer: Any) -> None:
        self._stepped = True
        self._with_tracker(lambda t: t.begin_stage("optimizer"))

    def on_train_batch_end(self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int) -> None:
        if self._stepped:
            self._with_tracker(lambda t: t.end_step())
        else:
            self._with_tracker(lambda t: t.end_stage())

    def on_train_epoch_end(self, trainer: Any, pl_module: Any) -> None:
        self._with_tracker(lambda t: t.end_step())

    # ----- evaluation --------------------------------------------------------

    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        name = "sanity_check" if getattr(trainer, "sanity_checking", False) else "eval"
        if self._ensure_tracker(trainer, pl_module) is not None:
            self._with_tracker(lambda t: t.begin_phase(name))

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._with_tracker(lambda t: t.end_phase())

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        if self._ensure_tracker(trainer, pl_module) is not None:
            self._with_tracker(lambda t: t.begin_phase("test"))

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._with_tracker(lambda t: t.end_phase())

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        if self._ensure_tracker(trainer, pl_module) is not None:
            self._with_tracker(lambda t: t.begin_phase("predict"))

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._with_tracker(lambda t: t.end_phase())

    # ----- the end -----------------------------------------------------------

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        # Lightning calls this before unwinding further: the failed step's
        # tensors are still alive, so memory figures and a snapshot are the OOM's.
        self._with_tracker(lambda t: t.record_oom(exception))
        self._close()

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._close()

    def _close(self) -> None:
        if self.tracker is not None:
            self.tracker.close()
            # A later fit() with the same callback starts a new log.
            self.tracker = None


def factory(callback_class: Any) -> Callable[[], list]:
    """The entry-point factory for a namespace: oomkit's callback under ``oomkit run``, nothing otherwise."""

    def callbacks_factory() -> list:
        if not _plan.auto_callback_requested():
            return []
        cb = callback_class()
        cb.automatic = True
        return [cb]

    return callbacks_factory
