"""Memory planning: what a model's units will hold per rank, before any rank starts.

Sizes the slot arena and the reduce-scatter's staging for the units of a model on a
cluster you may not have yet, from the planner alone (no group, no device), and sets
them beside stock FSDP2's buffers for the same units::

    python examples/memory_plan.py                              # 8 x 8 ranks
    python examples/memory_plan.py --world 512 --local-size 8 --chunk-mib 16

Each unit here is one layer of a Llama-style decoder (the shapes ``quickstart.py``
uses, at a size you choose). The slot must hold the largest unit; the staging region
(or, with Slot-Reuse, the slot) must hold the largest reduce-scatter's buffers
(docs/memory.md). Runs under ``mpiexec`` too: rank 0 prints.
"""

from __future__ import annotations

import argparse

from tidearray.layout import memory_report

MiB = 1 << 20


def decoder_layer(hidden: int, heads: int, kv_heads: int, ffn: int) -> list[tuple[int, ...]]:
    """q, k, v, o, gate, up, down and the two RMSNorm weights of one layer."""
    head = hidden // heads
    return [(heads * head, hidden), (kv_heads * head, hidden), (kv_heads * head, hidden),
            (hidden, heads * head), (ffn, hidden), (ffn, hidden), (hidden, ffn),
            (hidden,), (hidden,)]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--world", type=int, default=64, help="ranks (default 64)")
    ap.add_argument("--local-size", type=int, default=8, help="ranks per node (default 8)")
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--ffn", type=int, default=14336)
    ap.add_argument("--chunk-mib", type=int, default=32, help="reduce-scatter chunk (32)")
    ap.add_argument("--depth", type=int, default=2, help="reduce-scatter depth (2)")
    args = ap.parse_args()
    try:  # under mpiexec, only rank 0 prints; no group is made
        from mpi4py import MPI

        if MPI.COMM_WORLD.Get_rank():
            return
    except ImportError:
        pass
    shapes = decoder_layer(args.hidden, 32, 8, args.ffn)
    nodes = args.world // args.local_size
    print(f"one decoder layer (hidden {args.hidden}, ffn {args.ffn}, bf16) on "
          f"{args.world} ranks = {nodes} nodes x {args.local_size}, "
          f"chunk {args.chunk_mib} MiB, depth {args.depth}; MiB per rank:")
    rows = []
    per_node = args.local_size
    for world in (per_node, args.world):  # one node, then the whole cluster
        r = memory_report(shapes, 2, world, per_node, args.chunk_mib * MiB, args.depth)
        rows.append((f"{world // per_node} node(s) x {per_node}", r))
    print(f"  {'':16s} {'slot':>9s} {'staging':>9s} {'partial':>9s} {'receive':>9s} "
          f"{'RS total':>9s} {'FSDP2 AG':>9s} {'FSDP2 RS':>9s}")
    for name, r in rows:
        print(f"  {name:16s} {r.slot / MiB:9.1f} {r.staging / MiB:9.1f} "
              f"{r.partial / MiB:9.1f} {r.receive / MiB:9.1f} {r.rs_nbytes / MiB:9.1f} "
              f"{r.stock_ag_output / MiB:9.1f} {r.stock_rs_input / MiB:9.1f}")
    one, many = rows[0][1], rows[1][1]
    print(f"across {nodes} nodes the reduce-scatter holds {many.rs_nbytes / MiB:.0f} MiB "
          f"(one node: {one.rs_nbytes / MiB:.0f}); FSDP2's fp32 input is "
          f"{many.stock_rs_input / MiB:.0f} MiB. Size the slot arena for "
          f"max(slot, RS total) = {max(many.slot, many.rs_nbytes) / MiB:.0f} MiB with "
          "Slot-Reuse.")


if __name__ == "__main__":
    main()
