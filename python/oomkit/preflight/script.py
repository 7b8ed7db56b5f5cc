"""``oomkit preflight -- python train.py``: the user's unchanged script on meta tensors.

``oomkit preflight`` puts a ``sitecustomize`` module first on the script's
``PYTHONPATH``; at interpreter start it calls :func:`install`, which makes
the script's GPU calls land on ``meta`` tensors (``torch.cuda`` answers as
one GPU of the capacity given, tensors created without a device are
created on ``meta``, so the model's weights are never allocated), records
every allocation, and after the requested number of optimizer steps
writes the answer to the file ``oomkit preflight`` reads and ends the
process. Nothing here runs unless ``OOMKIT_PREFLIGHT`` is set.
"""

from __future__ import annotations

import atexit
import json
import os
import sys
import traceback
import weakref
from dataclasses import dataclass, replace
from typing import Any

import torch

from oomkit import _native
from oomkit._native import PreflightError
from oomkit.preflight.answer import answer, replayed, unsupported
from oomkit.preflight.fixes import INSIDE, Fixer, InScript
from oomkit.preflight.notes import Notes
from oomkit.preflight.record.frames import user_line
from oomkit.preflight.record.out_of_memory import OutOfMemory, Refused, raised_here
from oomkit.preflight.record.recorder import PreflightStopped, Recorder, StepUnsupportedError
from oomkit.preflight.record.recording import INFERENCE, TRAINING, Recording
from oomkit.preflight.record.roles import Known
from oomkit.preflight.settings import DEFAULT_CAPACITY, DEFAULT_STEPS, DEFAULT_TIME_LIMIT, Settings
from oomkit.preflight.world.autocast import Autocast
from oomkit.preflight.world.cuda import CudaFunctions, cublas_workspace
from oomkit.preflight.world.fake_gpu import FakeGpu, Hook, StandIn
from oomkit.preflight.world.imports import when_imported
from oomkit.preflight.world.memory import MemoryQueries
from oomkit.preflight.world.torchrun import TORCHRUN, TorchrunAsRankZero
from oomkit.tracker.measure import PREFLIGHT_DIR_ENV
from oomkit.tracker.tracker import PREFLIGHT_LOGS

#: The environment variable carrying the settings (JSON) from ``oomkit preflight``.
ENV = "OOMKIT_PREFLIGHT"

#: Set for the processes a preflighted script starts: a launcher (``accelerate launch``,
#: ``trl sft``) runs the training script as its child, which is measured in its place.
CHILD_ENV = "OOMKIT_PREFLIGHT_CHILD"

#: PyTorch's allocator settings, which a script may set for itself.
ALLOC_CONF_ENV = "PYTORCH_CUDA_ALLOC_CONF"

#: Steps of the other optimizers after which one that has not stepped is no part of every
#: training step (one made and never used, one stepped every few epochs): a loop's step is
#: each of its optimizers stepped once more (a GAN's two, a critic's five to its generator's one).
OPTIMIZER_LAG = 8

#: What a script that trains on the CPU is told.
ON_THE_CPU = (
    'no parameter of the model is on the GPU: the script trains on the CPU (use_cpu=True, device="cpu"?); '
    "preflight measures what a script puts on the GPU"
)


@dataclass(frozen=True)
class Launch:
    """What ``oomkit preflight`` hands the script (``OOMKIT_PREFLIGHT``, JSON): the preflight's
    settings, and what this runner needs beyond them (where the answer goes, the changes to
    try inside the script, the replay), read once at interpreter start."""

    settings: Settings
    #: The file the answer is written to; its folder is this run's own.
    result: str
    #: Whether ``--alloc-conf`` was given: without it, the script's own ``PYTORCH_CUDA_ALLOC_CONF``
    #: (set before the allocator starts: its first forward here) is what its allocator runs with.
    alloc_conf_given: bool = False
    #: The changes tried inside the script for "what would make it fit" (``fixes.INSIDE``).
    fixes: tuple[str, ...] = ()
    #: Skip, and say, a change that cannot be made here, rather than end the run ("all of the above").
    fixes_skip: bool = False
    #: Allocator settings to replay the recorded step with as well (the expandable-segments fix),
    #: and whether always or only where the step does not fit: ``{"alloc_conf", "always"}``.
    replay: dict[str, Any] | None = None
    #: Whether the script is launched as torchrun launches it (``--gpus``): its ranks' environment.
    #: A script sharded only by the fix runs as written for one GPU.
    torchrun: bool = False
    #: Whether the step's allocations the GPU would refuse raise CUDA's error in the script
    #: (``record/out_of_memory.py``): the command's first run; its searches and fixes measure
    #: each setting whole, refusing nothing.
    refuse: bool = False

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Launch:
        """The launch ``oomkit preflight`` described; ``KeyError`` or ``PreflightError`` where it is bad."""
        limit = doc.get("time_limit", DEFAULT_TIME_LIMIT)
        gpus = int(doc.get("world_size") or 1)
        settings = Settings(
            steps=int(doc.get("steps", DEFAULT_STEPS)),
            capacity=doc.get("capacity") or DEFAULT_CAPACITY,
            snapshot=doc.get("snapshot"),
            alloc_conf=doc.get("alloc_conf"),
            gpus=gpus,
            time_limit=None if limit is None else float(limit),
        )
        return cls(
            settings=settings,
            result=doc["result"],
            alloc_conf_given=bool(doc.get("alloc_conf_given")),
            fixes=tuple(f for f in doc.get("fixes") or [] if f in INSIDE),
            fixes_skip=bool(doc.get("fixes_skip")),
            replay=doc.get("replay"),
            torchrun=bool(doc.get("torchrun", gpus > 1)),
            refuse=doc.get("out_of_memory") == "raise",
        )


class _Session:
    """One script's preflight: the modes, the hooks and the answer at the end."""

    def __init__(self, launch: Launch, child: bool = False) -> None:
        self.launch = launch
        #: A process the command's script started (a launcher's training script): it answers
        #: only where it measured something or failed, so that one that ran no model leaves
        #: the answer to the process that did.
        self.child = child
        s = self.settings = launch.settings
        #: This run's own folder (the answer's), removed by ``oomkit preflight`` after the run.
        self.run_dir = os.path.dirname(os.path.abspath(launch.result))
        #: The allocator settings in force: --alloc-conf, else what the script set before its first forward.
        self.alloc_conf = s.alloc_conf
        self._alloc_conf_fixed = False
        self.rec = Recorder(cublas_workspace(s.capacity), s.time_limit)
        self.notes = Notes()
        #: torch.cuda's memory queries, answered from what is recorded.
        self.memory = MemoryQueries(self.rec, self.allocator_settings, s.capacity_bytes, self.notes)
        self.known = Known()
        self.autocast = Autocast()
        self.functions = CudaFunctions(
            self.autocast, on_upload=self._upload, read_back=self.rec.read_back, host=self.rec.host, placement=self.rec.placement
        )
        self.steps_done = 0
        # Steps taken before the run measured began: a batch-size search's trials (Lightning's finder).
        self._steps_before = 0
        #: Each training step's tokens (batch, sequence), read at its first embedding lookup.
        self.tokens: list[tuple[int, int]] = []
        #: Backward passes run, and whether the script made a torch.optim optimizer: without one,
        #: a step is a backward pass and the update after it (a loop that updates the weights itself).
        self.backwards_done = 0
        self.has_optimizer = False
        #: Whether an optimizer's step is running: the forward and backward of a closure it calls
        #: (Lightning's automatic optimization, LBFGS) are the step's forward and backward.
        self.in_step = False
        # How deep in optimizers' steps the script is: a container's step (torchtitan's
        # OptimizersContainer) runs each of its optimizers' steps inside its own, one step.
        self._step_depth = 0
        # The optimizers the script made and holds, each one's steps (at the loop's level, not
        # inside another's step or in backward) and the most any had taken when it last stepped.
        self._optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._inner_optimizers: weakref.WeakSet[torch.optim.Optimizer] = weakref.WeakSet()
        self._optimizer_steps: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        self._optimizer_seen_at: weakref.WeakKeyDictionary[torch.optim.Optimizer, int] = weakref.WeakKeyDictionary()
        # Whether optimizers stepped inside the backward running now (an optimizer per parameter,
        # stepped from its gradient hook: torchtune's optimizer_in_bwd): that backward's step.
        self._stepped_in_backward = False
        self.finished = False
        # The top-level modules whose later training batches are padded to the longest sequence kept.
        self._padded_modules: set[int] = set()
        self._seen_modules: set[int] = set()
        self._trained_modules: set[int] = set()
        self.fixer = Fixer(list(launch.fixes), self.autocast, self.notes, s.gpus, skip_what_cannot=launch.fixes_skip)
        #: What the script already does of those changes, seen where it runs as written.
        self.in_script = InScript()
        # The script Python was asked to run, where it is not there (told before the script
        # runs: one that changes its directory would make a relative path look missing).
        first = sys.argv[0] if sys.argv else ""
        self._missing = first if first not in ("", "-c", "-m") and not os.path.exists(first) else None
        #: How the script asked to exit (``sys.exit``), where it did before its first step:
        #: the code and the exception being handled then (runpy's failure to import a ``-m`` module).
        self._exited: tuple[Any, BaseException | None] | None = None

    # ---- start ----

    def start(self) -> None:
        s = self.settings
        # A tracker in the script measures meta as the GPU and logs into this run's folder.
        os.environ[PREFLIGHT_DIR_ENV] = self.run_dir
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self.functions.on_backward = self._after_backward
        self.functions.frames_fixed = self.rec.frames_fixed
        # The fake GPU for the life of the process: the script runs in it to its end.
        self.world = FakeGpu(
            settings=self.settings,
            recorder=self.rec,
            memory=self.memory,
            autocast=self.autocast,
            functions=self.functions,
            notes=self.notes,
            # The fix that shards the model needs the process group before the model moves.
            start_process_group="fsdp" in self.launch.fixes,
            torchrun_environment=self.launch.torchrun,
            save_dir=self.run_dir,
            hooks=[
                Hook("the optimizer's step begins its phase", register_optimizer_step_pre_hook, self._before_step),
                Hook("the optimizer's step ends a training step", register_optimizer_step_post_hook, self._after_step),
                Hook("the first forward begins the step", torch.nn.modules.module.register_module_forward_pre_hook, self._before_forward),
                Hook("a fix tried ends with each forward", torch.nn.modules.module.register_module_forward_hook, self._after_forward),
                Hook("torchrun runs its rank 0 alone", when_imported(TORCHRUN), TorchrunAsRankZero(ENV, self.settings.gpus).stand_ins),
            ],
            stand_ins=[
                StandIn(f"a fix tried: {getattr(owner, '__name__', owner)}.{name} replaced", owner, name, value)
                for owner, name, value in self.fixer.stand_ins()
            ],
            on_optimizer_made=self._optimizer_made,
            # Weights moved to the GPU are weights, whether or not their module's forward runs.
            on_module_moved=lambda tensors: self.known.add_params(self.rec, tensors),
        )
        self.world.__enter__()
        self.world.batch_search.on_end = self._search_ended
        if self.launch.refuse:
            oom = OutOfMemory(
                self.rec.trace, self.allocator_settings, self.memory.allowed_bytes, s.capacity_bytes, self.rec.allocation_refused
            )
            oom.give_up = self._gave_up
            oom.on_refused = self._attempt_ran_out
            self.rec.out_of_memory = oom
        # Modules built without a device are built on meta (never allocated),
        # as if built on the CPU and moved; other tensors keep their device.
        self.functions.build_on_meta = True
        atexit.register(self._at_exit)
        previous = sys.excepthook

        def excepthook(kind: type[BaseException], value: BaseException, tb: Any) -> None:
            refused = self._refused()
            if refused is not None and not self.finished and not isinstance(value, (StepUnsupportedError, PreflightStopped)):
                # The GPU ran out and the script stopped, with that error or another after it: the
                # command runs it again refusing nothing, for the figures of the whole step.
                if raised_here(value):
                    self.finish()
                    # Its traceback would run through preflight's own frames; where it stopped is the point.
                    sys.stderr.write(
                        f"oomkit preflight: the script stopped with CUDA out of memory{_at(tb)}; running it again with nothing refused\n"
                    )
                    return
                refused.ended = _error_at(kind, value, tb)
                self.finish()
                previous(kind, value, tb)
                return
            if isinstance(value, StepUnsupportedError):
                self._write({"error": str(unsupported(value))})
            elif isinstance(value, PreflightStopped):
                self._write({"error": value.words(self.steps_done)})
                self.finished = True
                # The line above says it all; PyTorch's frames below it would not.
                return
            elif isinstance(value, PreflightError) and not self.finished:
                # Preflight's own refusal (a fix that cannot apply here), at the user's line.
                self._write({"error": f"{_first_line(value)}{_at(tb)}"})
                self.finished = True
                return
            elif not self.finished:
                # The module whose forward was running, where one was: an
                # extension that refuses tensors without data (a Triton
                # kernel's launcher) fails there, and that names the part.
                module = self.rec.innermost_module()
                where = f" in {module}'s forward" if module else ""
                error = _error_at(kind, value, tb)
                if self._measured_a_step():
                    # What the whole steps before it measured stands; the failure is said beside it.
                    self.finish(failed=f"{where}: {error}")
                elif self.rec.trains_on_host and not self.rec.forwards:
                    # Training on the host of a model without data fails where autograd meets the batch's
                    # real tensors; what it was doing is the answer.
                    self._write({"error": ON_THE_CPU})
                else:
                    self._write({"error": f"the script failed under preflight after {self.steps_done} optimizer step(s){where}: {error}{self._gpus_hint()}"})  # noqa: E501
            self.finished = True
            previous(kind, value, tb)

        sys.excepthook = excepthook
        self._watch_exit()

    def _gpus_hint(self) -> str:
        """What to try where a script that counted the machine's GPUs failed before its first step on a
        machine of one: it may want more (Lightning's ``devices=2`` refuses a machine of one)."""
        if self.settings.gpus > 1 or not self.world.devices_counted:
            return ""
        return "; preflight's machine has 1 GPU unless --gpus N says more: if the script asks for N, run it with --gpus N"

    def _watch_exit(self) -> None:
        """Notes a ``sys.exit`` with a failure before the first step: a script that stops
        early (``python -m pkg.mod`` whose package fails to import, an argument refused)
        is named as what it is, not as a script without an optimizer step."""
        exit_ = sys.exit

        def exit(code: Any = None) -> Any:
            if code not in (None, 0) and self.steps_done == 0 and self.backwards_done == 0 and not self.finished:
                self._exited = (code, sys.exc_info()[1])
            return exit_(code)

        sys.exit = exit

    # ---- during the script ----

    def _begin_step(self) -> None:
        """The step begins: the set-up's storages are allocated, and those told before get their roles."""
        self.rec.begin()
        self.known.step_begins(self.rec)

    def _upload(self, t: torch.Tensor) -> None:
        self.known.add_inputs(self.rec, t)

    def allocator_settings(self) -> str | None:
        """The allocator's settings: --alloc-conf, else PYTORCH_CUDA_ALLOC_CONF as the script left it before its first forward."""
        if not self.launch.alloc_conf_given and not self._alloc_conf_fixed:
            theirs = os.environ.get(ALLOC_CONF_ENV) or None
            if theirs != self.alloc_conf:
                # Checked as PyTorch checks them when the allocator starts: a bad setting stops the script.
                _native.realize_ops([], [], [], theirs, None)
                self.alloc_conf = theirs
        return self.alloc_conf

    def _optimizer_made(self, opt: torch.optim.Optimizer) -> None:
        self.has_optimizer = True
        self._optimizers.add(opt)

    def _after_backward(self) -> None:
        self.backwards_done += 1
        if not self.has_optimizer and self.rec.out_of_memory is not None:
            # (A loop without an optimizer: its step is a backward pass and the update after it.)
            self.rec.out_of_memory.step_done()
        if self._stepped_in_backward:
            # The weights were updated as their gradients came: the step ends with its backward.
            self._stepped_in_backward = False
            self._step_done()
            return
        if not self.has_optimizer or self.in_step:
            # What follows a backward pass without an optimizer is the script's own update, and
            # what follows a closure's backward inside an optimizer's step is that step's update.
            self.rec.phase = "optimizer"

    def _before_forward(self, module: torch.nn.Module, _args: Any) -> None:
        if self.rec.on_host:
            # A data transform run on the host: no forward of the model.
            return
        if isinstance(module, torch.nn.Embedding) and len(self.tokens) == self._measured_steps() and torch.is_grad_enabled():
            # A language model's step: its first lookup of token ids (batch x sequence) says how long its sequences are.
            ids = _args[0] if _args else None
            if isinstance(ids, torch.Tensor) and ids.dim() == 2 and not ids.is_floating_point():
                self.tokens.append((int(ids.shape[0]), int(ids.shape[1])))
        if not self.has_optimizer and self.backwards_done >= self.settings.steps:
            # The forward after the last step's backward: that step's update is done.
            self._stop()
        if not self._alloc_conf_fixed:
            # By the first forward the allocator has started, with what was set by then.
            self.allocator_settings()
            self._alloc_conf_fixed = True
        # The first forward begins the step: what the script built and still holds is on the GPU now.
        self._begin_step()
        # A forward is the forward phase, in a loop without an optimizer (which labels its own
        # update "optimizer" until then) and inside an optimizer's step too: the closure it
        # calls (Lightning's automatic optimization, LBFGS) runs the step's forward and backward.
        self.rec.phase = "forward"
        if self.has_optimizer and not torch.is_grad_enabled() and self.rec.phase == "forward":
            # A forward without gradients in a script that trains: its evaluation, a phase of its own.
            self.rec.phase = "eval"
        if self.rec.module_depth == 1:
            self.in_script.first_forward(module, self.autocast)
            self.fixer.top_forward_begins(module)
            if id(module) not in self._padded_modules and torch.is_grad_enabled():
                # Its later training forwards run at the longest sequence the script keeps, once said
                # (this one has begun: a module's own hooks are read as its call starts; an evaluation
                # before training, LitGPT's sanity check, is no training forward).
                self._padded_modules.add(id(module))
                module.register_forward_pre_hook(self.world.bounds.pad_to_longest, with_kwargs=True, prepend=True)
        else:
            self.in_script.inner_forward(self.autocast)
        training = torch.is_grad_enabled()
        if id(module) not in self._seen_modules or (training and id(module) not in self._trained_modules):
            self._seen_modules.add(id(module))
            if training:
                # Its weights are trained, not a copy kept beside them (an EMA's, evaluated without gradients).
                self._trained_modules.add(id(module))
            # A compiled module runs its submodules inside its graph, their own forwards unseen.
            whole = isinstance(getattr(module, "_orig_mod", None), torch.nn.Module)
            own = list(module.parameters(recurse=whole))
            self.known.add_params(self.rec, own + list(module.buffers(recurse=whole)), trained=training)
            self.known.watch_grads(self.rec, own)

    def _after_forward(self, _module: torch.nn.Module, _args: Any, _out: Any) -> None:
        if not self.rec.forward_open:
            self.fixer.top_forward_ends()
            self.in_script.top_forward_ends()
            if self.rec.out_of_memory is not None and not self.has_optimizer and self.backwards_done == 0:
                # A run without backward (inference, evaluation) goes on with each whole forward.
                self.rec.out_of_memory.step_done()

    def _before_step(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        self._step_depth += 1
        self.in_script.optimizer_steps(opt)
        in_backward = torch._C._current_graph_task_id() != -1
        if in_backward or self._step_depth > 1:
            # Stepped by a gradient hook or by another optimizer: part of a step, never one itself.
            self._inner_optimizers.add(opt)
        if in_backward:
            # Stepped from a gradient hook, inside backward: part of that backward's step.
            self._stepped_in_backward = True
        elif self._step_depth == 1:
            # (A step inside a container's is part of the container's.)
            self.in_step = True
            self._begin_step()
            self.rec.phase = "optimizer"
        params = [p for g in opt.param_groups for p in g["params"]]
        self.known.add_params(self.rec, params, trained=True)
        self.known.add_grad_tensors(self.rec, [p.grad for p in params if p.grad is not None])

    def _after_step(self, opt: torch.optim.Optimizer, *_: Any) -> None:
        self._step_depth -= 1
        self.known.add_state_of(self.rec, opt)
        if torch._C._current_graph_task_id() != -1 or self._step_depth > 0:
            return
        self.in_step = False
        self.rec.phase = "inputs"
        if self._completes_a_step(opt):
            self._step_done()

    def _completes_a_step(self, opt: torch.optim.Optimizer) -> bool:
        """Whether this optimizer's step completes a training step of the loop: every optimizer
        it steps (but one left behind by ``OPTIMIZER_LAG`` steps) has stepped once more."""
        steps, seen_at = self._optimizer_steps, self._optimizer_seen_at
        if opt not in steps and self._measured_steps() == 1 and max(steps.values(), default=0) == 1:
            # Another optimizer of the loop's first step: that step ends with it.
            self.rec.step_ended(later=True)
        steps[opt] = steps.get(opt, 0) + 1
        most = max(steps.values())
        seen_at[opt] = most
        if most <= OPTIMIZER_LAG and any(o not in steps and o not in self._inner_optimizers for o in self._optimizers):
            # An optimizer the script made has yet to step: the loop's step goes on to it.
            return False
        return min(n for o, n in steps.items() if most - seen_at[o] <= OPTIMIZER_LAG) > self._measured_steps()

    def _step_done(self) -> None:
        """A training step ended: counted, and the script stopped after the steps asked for."""
        self.steps_done += 1
        steps = self._measured_steps()
        oom = self.rec.out_of_memory
        if oom is not None:
            oom.step_done()
            # After the GPU ran out, the steps asked for are those at the setting the script went on with.
            steps = min(steps, oom.steps_since(self.steps_done))
        self.rec.step_ended()
        self.rec.phase = "inputs"
        if steps >= self.settings.steps and not self.world.batch_search.depth:
            # (A batch-size search's trials are not the run: it is measured after the search.)
            self._stop()

    def _measured_steps(self) -> int:
        """The optimizer steps of the run measured: those after the script's own batch-size search."""
        return self.steps_done - self._steps_before

    def _search_ended(self) -> None:
        """The script's own batch-size search ended: the run measured begins here, at the batch it found."""
        self._steps_before = self.steps_done
        self.rec.trace.measured_from = len(self.rec.trace.kinds)
        self.tokens.clear()
        # The trials' optimizers are not the run's (a trainer makes its own again for the run).
        self._optimizers = weakref.WeakSet()
        self._optimizer_steps = weakref.WeakKeyDictionary()
        self._optimizer_seen_at = weakref.WeakKeyDictionary()

    def _attempt_ran_out(self) -> None:
        """The GPU ran out: the attempt is no step. An optimizer's step running (its closure's forward,
        Lightning's) ends with the error, its post-hook never called; the next step the script takes
        is one of its loop."""
        self._step_depth = 0
        self.in_step = False
        # The next forward's sequences are the step's.
        del self.tokens[self._measured_steps() :]

    def _refused(self) -> Refused | None:
        """The GPU's refusals where the script did not go on after the last (it must be run again)."""
        oom = self.rec.out_of_memory
        return oom.refused if oom is not None and oom.refused is not None and not oom.refused.went_on else None

    def _gave_up(self) -> None:
        """The script caught error after error without completing a step: it skips what does not fit."""
        refused, oom = self._refused(), self.rec.out_of_memory
        if refused is not None and oom is not None:
            refused.ended = f"it caught {oom.in_a_row} in a row without completing a step (it skips what does not fit)"
        self._stop()

    def _stop(self) -> None:
        self.finish()
        sys.stdout.flush()
        sys.stderr.flush()
        # The answer is written; the rest of the script is not needed.
        os._exit(0)

    # ---- the end ----

    def _at_exit(self) -> None:
        if not self.finished and (self._measured_anything() or not self.child):
            # A process the script started that ran no model says nothing: its parent answers.
            self.finish()

    def _measured_anything(self) -> bool:
        """Whether this process ran any forward of a model on the GPU."""
        return self.rec.forwards > 0 or self.steps_done > 0 or self.backwards_done > 0

    def _measured_a_step(self) -> bool:
        """Whether a whole training step ran: an optimizer's step, or, in a loop without an
        optimizer, a backward pass (its step is what runs after it)."""
        return self.steps_done >= 1 or (not self.has_optimizer and self.backwards_done >= 1)

    def _accumulation(self) -> int:
        """The script's own accumulation: the backward passes it ran per optimizer step."""
        if not self.has_optimizer or self.steps_done < 1:
            return 1
        return max(1, self.backwards_done // self.steps_done)

    def finish(self, failed: str | None = None) -> None:
        """Writes the answer: what ran, served through the allocator model; ``failed`` is where
        and what the error was that ended the script after a whole step, said beside the figures."""
        if self.finished:
            return
        self.finished = True
        self.rec.finish()
        refused = self._refused()
        if refused is not None:
            # Figures of a run stopped by the GPU's limit are not the step's: oomkit preflight runs
            # the script again, refusing nothing, and says where this one ran out.
            self._write({"refused": refused.as_dict()})
            return
        notes = self.notes.said()
        gpus = self.world.gpus_note()
        if gpus is not None:
            notes.append(gpus)
        asked = self.settings.steps
        loop_without_optimizer = not self.has_optimizer and self.backwards_done
        if loop_without_optimizer:
            # A loop that updates the weights itself: its steps are its backward passes.
            self.steps_done = min(self.backwards_done, asked)
        if failed is not None:
            notes.append(f"the script failed under preflight after {self.steps_done} step(s){failed}; the figures are those of what ran before it")  # noqa: E501
        if loop_without_optimizer:
            notes.append(f"the script uses no torch.optim optimizer: each of the {self.steps_done} step(s) measured is a backward pass and what ran after it until the next forward")  # noqa: E501
        mode = TRAINING
        if self.steps_done < asked:
            if self.steps_done == 0 and self._exited is not None:
                self._write({"error": _exited_early(*self._exited)})
                return
            if self.steps_done == 0 and self.rec.forwards == 0 and self._missing is not None:
                # Python itself could not open it (and said so above): nothing of it ran.
                self._write({"error": f"{self._missing}: no such script; Python could not open it"})
                return
            if self.steps_done == 0 and self.rec.forwards == 0:
                self._write({"error": "the script ended before its model's first forward: preflight measures what a model runs on the GPU (a forward, a training step)"})  # noqa: E501
                return
            if self.steps_done == 0:
                # No optimizer step and no backward: inference or evaluation, measured as it ran, to its end.
                mode = INFERENCE
                notes.append(
                    f"no optimizer step and no backward: the script's whole run is measured, {self.rec.forwards} forward(s) "
                    "of its model (inference or evaluation; a generation runs to its length bound)"
                )
            else:
                notes.append(f"the script ended after {self.steps_done} optimizer step(s) of the {asked} asked for")
        measured = self.steps_done - self._steps_before
        searched = self.world.batch_search.note()
        if searched is not None:
            notes.append(searched)
        if mode == TRAINING and self.tokens[:measured]:
            notes.append(_sequence_note(self.tokens[:measured], self.world.bounds.longest))
            padded, bound = self.world.bounds.padded_longest(), self.world.bounds.longest
            if padded is not None and bound is not None:
                kept = f"the longest sequence the script keeps ({bound[0]} tokens, {bound[1]})"
                if max(t for _, t in self.tokens[:measured]) >= bound[0]:
                    notes.append(
                        f"after the first forward, each training batch was padded to {kept}, "
                        f"where its data's own were up to {padded}: the peak is that of its longest batch"
                    )
                else:
                    failed_at = "did not complete a step (the failure above): the figures are at the data's own lengths"
                    notes.append(f"a training batch padded to {kept} {failed_at}")
        if not self.known.params and not self.rec.forwards:
            self._write({"error": ON_THE_CPU})
            return
        if os.path.isdir(os.path.join(self.run_dir, PREFLIGHT_LOGS)):
            notes.append("oomkit.Tracker measured the step from the allocator model; its run log was not kept, since nothing ran on a GPU")
        allowed = self.memory.allowed_bytes()
        if self.memory.fraction is not None:
            notes.append(
                f"the script's set_per_process_memory_fraction({self.memory.fraction}) leaves the allocator "
                f"{self.memory.fraction:.0%} of the capacity: that is what it is measured against"
            )
        conf = self.allocator_settings()
        if not self.launch.alloc_conf_given and conf != self.settings.alloc_conf:
            notes.append(f"the script sets PYTORCH_CUDA_ALLOC_CONF={conf or ''}: the allocator is modelled with it")
        recording = Recording(self.rec, self.known, notes, steps=measured, capacity_bytes=allowed, alloc_conf=conf, mode=mode)
        try:
            result = answer(recording, replace(self.settings, grad_accum=self._accumulation()), {"command": sys.argv})
            oom = self.rec.out_of_memory
            if oom is not None and oom.refused is not None:
                # The script went on after each: the figures are of what it ran after.
                result.out_of_memory = oom.refused.as_dict()
            out = result.as_dict()
            replay = self.launch.replay
            if replay and (replay.get("always") or not result.fits):
                out["replayed"] = replayed(recording, str(replay["alloc_conf"]))
            if self.fixer.skip_what_cannot:
                out["fixes_skipped"] = self.fixer.skipped
            if not self.launch.fixes:
                # Run as written: the changes it already makes are rows saying so, not runs.
                out["in_script"] = self.in_script.said(self.rec.recomputed, conf)
            if self.world.recipe.recipe is not None:
                # A framework's recipe: its own switches are the changes to measure.
                out["recipe"] = self.world.recipe.recipe
        except PreflightError as e:
            self._write({"error": str(e)})
            return
        self._write({"result": out})

    def _write(self, doc: dict[str, Any]) -> None:
        if not self._measured_anything() and os.path.exists(self.launch.result):
            # A process this one started (the training script a launcher runs) answered: its
            # answer stands over this process's, which ran no model.
            return
        try:
            with open(self.launch.result, "w", encoding="utf-8") as f:
                json.dump(doc, f)
        except OSError as e:
            sys.stderr.write(f"oomkit preflight: cannot write {self.launch.result}: {e}\n")


def _at(tb: Any) -> str:
    """The script's line the error came from, as " (at FILE:LINE (FUNCTION))": a bare assert's message alone says nothing."""
    frames = traceback.extract_tb(tb) if tb is not None else []
    if not frames:
        return ""
    # Innermost first; the first line outside PyTorch and oomkit is the script's.
    return f" (at {user_line(tuple((f.filename, f.lineno or 0, f.name) for f in reversed(frames)))})"


def _sequence_note(tokens: list[tuple[int, int]], bound: tuple[int, str] | None) -> str:
    """What the measured steps' sequences were, against the longest the script says it keeps."""
    shown = sorted(set(tokens), key=tokens.index)
    ran = f"each measured step ran at {shown[0][0]} x {shown[0][1]} tokens" if len(shown) == 1 else (
        "the measured steps ran at " + ", ".join(f"{b} x {t}" for b, t in tokens) + " tokens"
    )
    ran += " (batch x sequence, at each step's first embedding lookup)"
    longest = max(t for _, t in tokens)
    if bound is None:
        return f"{ran}; activations grow with the sequence, so a batch of longer sequences than these holds more"
    if longest >= bound[0]:
        return f"{ran}: the longest sequence the script keeps ({bound[0]} tokens, {bound[1]})"
    return (
        f"{ran}, shorter than the longest the script keeps ({bound[0]} tokens, {bound[1]}): a batch of sequences "
        "that long holds more activations than these, and was not measured"
    )


def _exited_early(code: Any, handling: BaseException | None) -> str:
    """The one line for a script that exited with a failure before its first step,
    naming the error it was handling (its first cause) and the user's line it came from."""
    said = f"code {code}" if isinstance(code, int) else repr(str(code).strip().splitlines()[0] if str(code).strip() else "")
    # runpy wraps what failed in its own error, raised "from" it.
    cause = handling
    while cause is not None and cause.__cause__ is not None:
        cause = cause.__cause__
    if cause is None or isinstance(cause, SystemExit):
        return f"the script exited with {said} before its first optimizer step"
    error = f"{type(cause).__name__}: {_first_line(cause)}" if _first_line(cause) else type(cause).__name__
    return f"the script exited before its first optimizer step: {error}{_at(cause.__traceback__)}"


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else ""


def _error_at(kind: type[BaseException], value: BaseException, tb: Any) -> str:
    """An error as one line: its class, its message's first line and the script's line it came from."""
    said = _first_line(value)
    return (f"{kind.__name__}: {said}" if said else kind.__name__) + _at(tb)


def _a_script_of_its_own() -> bool:
    """Whether a process the script started runs a script that may train: not ``python -c``,
    and not one of PyTorch's own (torch.compile's workers), which are its tools, not a run."""
    first = sys.argv[0] if sys.argv else ""
    if first in ("", "-c"):
        return False
    import importlib.util

    spec = importlib.util.find_spec("torch")
    homes = list(spec.submodule_search_locations or []) if spec is not None else []
    where = os.path.abspath(first)
    return not any(where.startswith(os.path.abspath(h) + os.sep) for h in homes)


def _launched_rank() -> tuple[int, int] | None:
    """The rank and world size a launcher gave this process (``RANK`` and ``WORLD_SIZE``, as
    DeepSpeed's launcher sets them for each process it starts), where it started several; else
    None. (Under torchrun only rank 0 is started, with the world the command measures.)"""
    try:
        world = int(os.environ.get("WORLD_SIZE") or 1)
        rank = int(os.environ.get("RANK") or os.environ.get("LOCAL_RANK") or 0)
    except ValueError:
        return None
    return (rank, world) if world > 1 else None


def install() -> None:
    """Starts a preflight of this process if ``oomkit preflight`` asked for one: the command's
    own process, and the Python scripts it starts (a launcher's training script)."""
    raw = os.environ.get(ENV)
    if not raw:
        return
    child = bool(os.environ.get(CHILD_ENV))
    if child and not _a_script_of_its_own():
        return
    os.environ[CHILD_ENV] = "1"
    try:
        doc = json.loads(raw)
        launched = _launched_rank() if child else None
        if launched is not None:
            rank, started = launched
            if rank != 0:
                # Another rank of a launcher's world: rank 0 answers for them all, and this one's
                # figures would be its own again.
                os._exit(0)
            if int(doc.get("world_size") or 1) > 1:
                # The world the command measures (``--gpus``, torchrun's, whose environment this is).
                launched = None
            else:
                doc = dict(doc, world_size=started, torchrun=True)
        session = _Session(Launch.from_json(doc), child=child)
    except (ValueError, KeyError, TypeError, PreflightError) as e:
        sys.stderr.write(f"oomkit preflight: bad settings in {ENV}: {e}\n")
        os._exit(2)
    if launched is not None:
        session.notes.add(
            f"the command's launcher started the script as {launched[1]} ranks (WORLD_SIZE, RANK): rank 0 ran, as rank 0 "
            f"of {launched[1]} GPUs, and the others ended at once"
        )
    try:
        session.start()
    except PreflightError as e:
        # A change that cannot be made here (8-bit AdamW without bitsandbytes): the one
        # line is the answer, before the script runs a line without the fake GPU.
        session._write({"error": str(e)})
        os._exit(2)
