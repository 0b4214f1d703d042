"""``tidearray.torch``: fully sharded ``torch.nn.Module`` training on tidearray's runtime.

An optional front end (``pip install 'tidearray[torch]'``); ``import tidearray``
never imports torch. :func:`shard_module` is to ``fully_shard`` what
:class:`tidearray.fsdp.Runtime` is to FSDP2's runtime: units as FSDP2 makes
them (a root for what no unit owns), hooks where FSDP2 hooks in ([Note: hooks] in
``_hooks``), deferred init of a meta-device model ([Note: deferred init] in
``_init``), state dicts under the model's own names (``_state``), parameter groups
and any torch optimizer over the fp32 shards (``_optimizer``), and a whole step
captured as a CUDA graph (``model.capture_step``, ``_graph``). Like ``fully_shard``,
:func:`shard_module` returns the model itself, its class swapped ([Note: the sharded
class] in ``_module``). [Note: torch front end] in ``_sharding`` names the package's
rooms and what each owns. docs/torch.md moves a ``fully_shard`` script over line by
line.
"""

from ._module import ShardedModule, shard_module

__all__ = ["ShardedModule", "shard_module"]
