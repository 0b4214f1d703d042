"""A small FSDP runtime over tidearray's plans: units, prefetch, Slot-Reuse, fused AdamW.

:class:`Runtime` shards a model's units over the group, gathers each unit
before it runs and reduces its gradients as soon as its backward is done, and
steps a fused AdamW on the fp32 master shards (the ``tide`` gathers cast them
into the slots; the baselines keep bf16 send shards, which the AdamW writes
too). It knows nothing of autograd: a front end
calls its hooks (see ``docs/fsdp.md``). :class:`UnitComm` is the extension point of
``Runtime(comm=...)``: a comm of one's own (FSDP2's flat path, in the benchmarks).
:class:`State`, :class:`UseToken` and ``BLIND`` are a unit's lifecycle as front ends
(``tidearray.torch``) read it.
"""

from .._adamw import AdamW, ParamGroup
from ._checkpoint import export, load, save
from ._comm import UnitComm
from ._graph import CapturedStep
from ._lifecycle import BLIND, State, UseToken
from ._norm import GradScale, clip_scale
from ._optim import FusedAdamW
from ._options import FrontEnd
from ._runtime import Runtime

__all__ = ["BLIND", "AdamW", "CapturedStep", "FrontEnd", "FusedAdamW", "GradScale", "ParamGroup",
           "Runtime", "State", "UnitComm", "UseToken", "clip_scale", "export", "load", "save"]
