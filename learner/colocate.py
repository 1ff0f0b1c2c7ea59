"""Colocated mode: a learner rank generates with its own model, then trains it.

In colocated mode (`--colocate`, launch/colocate.py) the inference engine lives in each learner
rank's process and generates with the rank's own model: the frozen base weights the trainer
holds and the policy adapter as the last optimizer step left it. One copy of the model per
rank, never two; nothing is published to, loaded into or merged into an engine.

The model is sharded (FSDP2): each rank holds a slice of every weight, and a forward pass
gathers each layer's weights from all ranks, a collective every rank must join in the same
order. Generation cannot work that way (ranks generate different episodes, of different
lengths, for different numbers of turns), so `generating` gathers every unit's parameters once,
with all ranks together, keeps them gathered through any number of forward passes (FSDP2's
`set_reshard_after_forward(False)`, meant for evaluation), and shards them again afterwards.
Between the two, a rank's forward passes run no collective at all. The gathered parameters are
FSDP's own unsharded parameters, the ones training's forward uses: while generating, a rank
holds the whole model once (as training does for one layer at a time).
"""

from __future__ import annotations

from contextlib import contextmanager


def fsdp_units(model) -> list:
    """The model's FSDP units (decoder layers, then the root), in module order."""
    from torch.distributed.fsdp import FSDPModule

    return [m for m in model.modules() if isinstance(m, FSDPModule)]


def restore_reshard_after_forward(root) -> None:
    """FSDP2's own reshard-after-forward settings back on the FSDP root `root` and its units, as
    `fully_shard` sets them: every unit reshards after its forward, the root does not (its
    parameters are needed again at once by the backward)."""
    root.set_reshard_after_forward(True)
    root.set_reshard_after_forward(False, recurse=False)


@contextmanager
def generating(model):
    """`model` (an FSDP2-sharded PEFT model) in eval mode with every parameter gathered, for
    forward passes without collectives; sharded again on exit, back in the mode it was in. Every
    rank must enter and leave together (gathering and sharding are collective)."""
    units = fsdp_units(model)
    training = model.training
    for unit in units:
        unit.unshard()
    model.set_reshard_after_forward(False)  # recurses: every unit keeps its parameters gathered
    model.eval()
    try:
        yield model
    finally:
        restore_reshard_after_forward(model)
        for unit in reversed(units):
            unit.reshard()
        model.train(training)
