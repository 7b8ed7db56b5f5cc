"""What oomkit's Lightning callback does, shared by the ``lightning.pytorch`` and ``pytorch_lightning`` classes.

Lightning checks callbacks by class per namespace and refuses mixed
imports, so each namespace gets its own class over this one mixin.
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Optional

from oomkit import _plan
from oomkit.tracker.tracker import Tracker, _integration_writes_plan

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
        # Why the plan could not be applied, where oomkit found out; and what the script asked for.
        self._not_applied: Optional[str] = None
        self._batch_before: Optional[int] = None
        self._accum_before: Any = None

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
                self._batch_before = _module_batch_size(self._parsing, pl_module)
                self._apply(trainer, pl_module, plan)

    def _apply(self, trainer: Any, pl_module: Any, plan: _plan.Plan) -> None:
        """Sets the micro-batch where Lightning's batch-size finder would and in the training DataLoader, and accumulate_grad_batches.

        Lightning users keep the batch size on the module, its hparams or the
        datamodule (where Lightning's own finder looks), or only in the
        DataLoader they build: that loader is rebuilt with the new batch
        size as Lightning loads it. Whether it took is checked when training
        starts (``on_train_start``), from the loader Lightning really uses.
        """
        parsing = self._parsing
        with contextlib.suppress(Exception):
            if parsing.lightning_hasattr(pl_module, "batch_size"):
                parsing.lightning_setattr(pl_module, "batch_size", plan.micro_batch)
        self._wrap_train_source(trainer, plan.micro_batch)
        self._accum_before = trainer.accumulate_grad_batches
        trainer.accumulate_grad_batches = plan.grad_accum
        self.plan = plan

    def _wrap_train_source(self, trainer: Any, micro: int) -> None:
        """Has Lightning's training DataLoaders rebuilt with ``micro`` samples a batch when it loads them."""
        source = getattr(getattr(trainer, "fit_loop", None), "_data_source", None)
        load = getattr(source, "dataloader", None)
        if source is None or load is None:
            self._not_applied = "this Lightning version keeps its training data where oomkit does not look"
            return

        def dataloader() -> Any:
            loaders = load()
            if self._batch_before is None:
                self._batch_before = _first_batch_size(loaders)
            try:
                rebuilt = _with_batch_size(loaders, micro)
            except _CannotRebuild as why:
                self._not_applied = str(why)
                return loaders
            return rebuilt

        source.dataloader = dataloader

    def _check_plan(self, trainer: Any) -> None:
        """Writes the plan the training really runs, and tells `oomkit run` whether its own was applied."""
        tracker = self.tracker
        micro = _train_batch_size(trainer)
        accum = int(trainer.accumulate_grad_batches)
        plan = self.plan
        if plan is not None:
            if micro != plan.micro_batch and self._accum_before is not None:
                # Half a plan changes the effective batch: the script's own accumulation stays.
                trainer.accumulate_grad_batches = self._accum_before
                accum = int(self._accum_before)
            applied = micro == plan.micro_batch and accum == plan.grad_accum
            reason = None
            if not applied:
                reason = self._not_applied or (
                    f"the training DataLoader yields {micro if micro is not None else 'batches of unknown size'}"
                    f" x accumulation {accum}"
                )
                _plan.say(
                    f"{plan.source} chose micro-batch {plan.micro_batch} x accumulation {plan.grad_accum}, "
                    f"but it could not be applied ({reason}): give the command {{batch_size}} and {{grad_accum}} instead"
                )
            else:
                _plan.say(
                    f"{plan.source}{f' attempt {plan.attempt}' if plan.attempt else ''}: training with micro-batch "
                    f"{plan.micro_batch} x accumulation {plan.grad_accum} (the script asked for "
                    f"{self._batch_before if self._batch_before is not None else '?'} x {self._accum_before})"
                )
            _plan.report_plan(plan, applied, reason, by="lightning callback")
            record = plan.record(FRAMEWORK) if applied else _plan.Plan(
                micro_batch=micro or 0, grad_accum=accum, attempt=plan.attempt, source="trainer arguments"
            ).record(FRAMEWORK)
            record["applied"] = applied
            if reason:
                record["not_applied"] = reason
        else:
            record = _plan.Plan(micro_batch=micro or 0, grad_accum=accum, source="trainer arguments").record(FRAMEWORK)
        if not record["micro_batch"]:
            record["micro_batch"] = record["effective_batch"] = None
        if tracker is not None and not self._disabled:
            tracker.note("plan", **record)

    def _ensure_tracker(self, trainer: Any, pl_module: Any) -> Optional[Tracker]:
        if self._disabled:
            return None
        if self.tracker is None:
            try:
                log_dir = self.log_dir or _plan.default_log_dir(trainer.default_root_dir)
                options = dict(self.tracker_options)
                options.setdefault("rank", trainer.global_rank)
                optimizers = list(getattr(trainer, "optimizers", None) or [])
                with _integration_writes_plan():
                    self.tracker = Tracker(
                        pl_module,
                        optimizer=optimizers[0] if optimizers else None,
                        log_dir=log_dir,
                        stage_hooks=False,
                        **options,
                    )
                self.log_path = self.tracker.log_path
            except Exception as exc:  # noqa: BLE001 - the tracker never stops training
                self._disabled = True
                _plan.say(f"the tracker could not start (training continues): {exc}")
        return self.tracker

    def _with_tracker(self, call: Callable[[Tracker], Any]) -> None:
        if self.tracker is not None and not self._disabled:
            call(self.tracker)

    # ----- training ----------------------------------------------------------

    def on_fit_start(self, trainer: Any, pl_module: Any) -> None:
        self._ensure_tracker(trainer, pl_module)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        # The training DataLoaders exist from here on: the plan is what they yield.
        if not self._disabled:
            try:
                self._check_plan(trainer)
            except Exception as exc:  # noqa: BLE001 - the tracker never stops training
                _plan.say(f"the plan could not be checked (training continues): {exc}")

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


class _CannotRebuild(Exception):
    """Why a training DataLoader cannot be rebuilt with another batch size."""


def _with_batch_size(loaders: Any, micro: int) -> Any:
    """``loaders`` (a DataLoader, or a list, tuple or dict of them) with every DataLoader rebuilt to yield ``micro`` samples a batch."""
    if isinstance(loaders, dict):
        return {k: _with_batch_size(v, micro) for k, v in loaders.items()}
    if isinstance(loaders, (list, tuple)):
        return type(loaders)(_with_batch_size(v, micro) for v in loaders)
    flattened = getattr(loaders, "flattened", None)
    if isinstance(flattened, list):  # Lightning's CombinedLoader
        loaders.flattened = [_with_batch_size(v, micro) for v in flattened]
        return loaders
    return _rebuilt(loaders, micro)


def _rebuilt(loader: Any, micro: int) -> Any:
    """A plain ``torch.utils.data.DataLoader`` like ``loader`` that yields ``micro`` samples a batch.

    Its dataset, sampler (so shuffling and its generator), workers, collate
    function and the rest are kept; a DataLoader subclass or one given its
    own batch sampler cannot be rebuilt without knowing what it adds.
    """
    import inspect

    from torch.utils.data import DataLoader, IterableDataset

    if not isinstance(loader, DataLoader):
        raise _CannotRebuild(f"the training data is a {type(loader).__name__}, not a DataLoader")
    if loader.batch_size == micro:
        return loader
    if type(loader) is not DataLoader:
        raise _CannotRebuild(f"the training DataLoader is a {type(loader).__name__}, whose arguments oomkit cannot know")
    if loader.batch_size is None:
        raise _CannotRebuild("the training DataLoader has its own batch_sampler")
    wanted = {
        "batch_size": micro,
        "drop_last": loader.drop_last,
        "num_workers": loader.num_workers,
        "collate_fn": loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": loader.worker_init_fn,
        "multiprocessing_context": loader.multiprocessing_context,
        "generator": loader.generator,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": getattr(loader, "pin_memory_device", ""),
        "in_order": getattr(loader, "in_order", True),
    }
    if loader.num_workers > 0:
        wanted["prefetch_factor"] = loader.prefetch_factor
    if not isinstance(loader.dataset, IterableDataset):
        wanted["sampler"] = loader.sampler
    accepted = inspect.signature(DataLoader.__init__).parameters
    return DataLoader(loader.dataset, **{k: v for k, v in wanted.items() if k in accepted})


def _train_batch_size(trainer: Any) -> Optional[int]:
    """The batch size of the first training DataLoader Lightning loaded, where it says."""
    with contextlib.suppress(Exception):
        return _first_batch_size(trainer.train_dataloader)
    return None


def _first_batch_size(loaders: Any) -> Optional[int]:
    """The batch size of the first DataLoader in ``loaders``, where it says."""
    with contextlib.suppress(Exception):
        flattened = getattr(loaders, "flattened", None)
        if isinstance(flattened, list):
            loaders = flattened
        while isinstance(loaders, (list, tuple)) and loaders:
            loaders = loaders[0]
        if isinstance(loaders, dict) and loaders:
            loaders = next(iter(loaders.values()))
        size = getattr(loaders, "batch_size", None)
        if size is None:
            size = getattr(getattr(loaders, "batch_sampler", None), "batch_size", None)
        return size if isinstance(size, int) else None
    return None


def _module_batch_size(parsing: Any, pl_module: Any) -> Optional[int]:
    """The batch size on the module, its hparams or the datamodule, where Lightning's finder looks."""
    with contextlib.suppress(Exception):
        if parsing.lightning_hasattr(pl_module, "batch_size"):
            value = parsing.lightning_getattr(pl_module, "batch_size")
            return value if isinstance(value, int) else None
    return None
