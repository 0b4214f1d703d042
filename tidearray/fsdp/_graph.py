"""A whole training step captured once as a CUDA graph, then replayed.

[Note: captured steps]
A step of :class:`Runtime` (forward and backward through its hooks, the
gathers and reductions they issue, and :meth:`Runtime.step`) issues the
same device work every time, on the same buffers. :class:`CapturedStep` runs
the user's step function once inside a stream capture on the model's stream and
launches the graph at every later step:

* the collectives are captured as they are issued (a capturing stream makes
  the executor fork its lanes from it and join them back: [Note: graph plans] in
  ``_plan``), and the flags take the same values on every replay
  ([Note: replay-safe flags] in ``_arena``);
* what changes from step to step, the step number's bias corrections and the
  learning rate, reaches the optimizer through a device table of its float32
  coefficients (``adamw_table_*`` in ``kernels/adamw.cu``): each replay is
  preceded by one small copy of the next step's table, computed on the host as
  an eager step computes it, so the bits are the eager step's;
* a clip (``max_grad_norm``, or ``clip_grad_norm_`` in the step function) is
  captured too: the norm is device work in a fixed order on every rank, its
  sums exchanged by a gather plan, and the clip factor goes into the table's
  ``grad_scale`` on the device, with the float64 arithmetic the eager step
  does on the host ([Note: clipping] in ``_norm``), so the bits agree; the
  norm the step returns is a device array;
* every array the step allocates comes from a memory pool of its own, kept
  while the captured step lives, so the graph's addresses stay its own; the
  capture is relaxed, so that pool may still grow while capturing.

What the step reads must be in place before each replay: write the next batch
into the same arrays (``CapturedStep`` returns what the step function returned,
arrays the replays overwrite). The model must have stepped eagerly at least
once first (that step builds the plans, uploads their tables and compiles the
kernels).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Sequence, Union

from .._errors import TideInvalid

if TYPE_CHECKING:
    from ._runtime import Runtime


class CapturedStep:
    """``step()`` captured on ``model``'s stream; calling this replays it.

    Args:
        model: a model on the cuda backend that has stepped eagerly at least once.
        step: a function that runs one whole step (every micro-batch's forward and
            backward, then ``model.step()``) and returns what the caller reads
            (the losses, as device arrays).

    Raises:
        TideInvalid: on the host backend, in debug mode, or before any eager step.
    """

    def __init__(self, model: Runtime, step: Callable[[], Any]) -> None:
        if not model.group.backend.graphs:
            raise TideInvalid(f"{type(self).__name__}: expected a model on the cuda backend "
                              f"(a CUDA graph), got the {model.group.backend.name} backend")
        opt = model.optimizer
        if opt.step_count == 0:
            raise TideInvalid(f"{type(self).__name__}: expected a model that has stepped "
                              "eagerly once (its plans and kernels are made by that step), "
                              "got none")
        if model.group.config.debug:
            raise TideInvalid(f"{type(self).__name__}: expected no debug mode (TIDE_DEBUG=1), "
                              "got one: its stamps are checked on the host after each "
                              "collective, which a capture cannot")
        self.model = model
        model.prepare_capture()
        model.synchronize()
        self.pool = model.group.backend.step_pool()  # the graph's own ([Note: captured steps])
        with self.pool.using():  # counts no step: each replay does ([Note: step counts])
            self.graph, self.result = self._capture(step)
        self.grad_scale = model.captured_scale().factor  # what each replay stages

    def _capture(self, step: Callable[[], Any]) -> tuple[Any, Any]:
        """``step()`` captured on the model's stream: the graph, and what step returned."""
        self.stream = self.model.group.backend.stream(self.model.stream)  # None: current
        return self.pool.capture(self.stream, step)

    def _launch(self) -> None:
        self.graph.launch(self.stream)

    def _replay_stream(self) -> Any:
        """The stream the next replay launches on."""
        return self.stream

    def __call__(self, lr: Union[float, Sequence[float], None] = None) -> Any:
        """Replay one step with learning rate ``lr`` (as :meth:`Runtime.step` takes
        it); returns the step function's result, overwritten by this replay."""
        self.model.optimizer.stage_step(lr, self.grad_scale, self._replay_stream())
        self._launch()
        return self.result

    def close(self) -> None:
        """Drop the graph and its memory (after the last replay has finished)."""
        self._replay_stream().synchronize()
        self.graph = self.result = None
        self.pool.free_all_blocks()
