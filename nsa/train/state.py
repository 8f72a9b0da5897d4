"""The run's checkpointable state: ``Stateful`` components (the ``torch.distributed.checkpoint`` protocol,
``state_dict()`` / ``load_state_dict()``) saved and loaded through one path, :class:`Checkpointable`.

Components and their keys in a checkpoint (format 1, ``nsa.train.checkpoint``): ``model``, ``optimizer``,
``scheduler``, ``train_state`` (the counters), ``loader`` and ``rng`` (one entry per rank: every rank
keeps its own data position and random streams). Loading restores them in that order, the random
streams last, so nothing drawn while restoring shifts them.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, fields
from typing import Any, Protocol

import torch

from nsa.errors import CheckpointError
from nsa.train import distributed as D
from nsa.train.runtime import rng_state, set_rng_state
from nsa.train.schedule import schedule_lrs


class Stateful(Protocol):
    def state_dict(self) -> Any: ...

    def load_state_dict(self, state: Any) -> None: ...


@dataclass
class TrainState:
    """Counters of the run (model/optimizer/loader/RNG travel beside them)."""

    step: int = 0
    tokens_seen: int = 0
    elapsed_s: float = 0.0
    last_loss: float | None = None
    last_val_loss: float | None = None
    best_val_loss: float | None = None

    def state_dict(self) -> dict[str, Any]:
        return asdict(self)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        for f in fields(self):
            setattr(self, f.name, state.get(f.name, f.default))


class OptimizerLR:
    """The LR schedule; after loading, the optimizer takes the new schedule's rates (they differ from the
    saved ones when the run's total steps changed on resume)."""

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler: Any) -> None:
        self.optimizer, self.scheduler = optimizer, scheduler

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = self.scheduler.state_dict()
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.scheduler.load_state_dict(state)
        for group, lr in zip(self.optimizer.param_groups, schedule_lrs(self.scheduler), strict=True):
            group["lr"] = lr


class RandomStreams:
    """Python, NumPy and torch (CPU and CUDA) random states of this process."""

    def state_dict(self) -> dict[str, Any]:
        return rng_state()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_rng_state(state)


class PerRank:
    """A component whose state differs per rank: saved as the list of every rank's state (a collective),
    loaded from this rank's entry. A checkpoint of another number of ranks goes through ``reshard(states,
    rank, world_size)`` (the state this rank continues from); without one it is refused.

    ``every > 1``: ranks in groups of ``every`` share one state (the context-parallel ranks of a sequence
    read the same data): one entry per group is saved, and this rank loads its group's."""

    def __init__(self, inner: Stateful, dist: D.DistInfo,
                 reshard: Callable[[list[Any], int, int], Any] | None = None, every: int = 1) -> None:
        self.inner, self.dist, self.reshard, self.every = inner, dist, reshard, every
        self.saved_by: int | None = None  # entries of the checkpoint last loaded

    @property
    def slot(self) -> tuple[int, int]:
        """This rank's entry and the number of entries."""
        return self.dist.rank // self.every, self.dist.world_size // self.every

    def state_dict(self) -> list[Any]:
        return D.gather_objects(self.inner.state_dict(), self.dist)[:: self.every]

    def load_state_dict(self, state: list[Any]) -> None:
        self.saved_by = len(state)
        mine, count = self.slot
        if len(state) == count:
            self.inner.load_state_dict(state[mine])
            return
        if self.reshard is None:
            raise CheckpointError(f"the checkpoint was written by {len(state)} ranks, this run has "
                                  f"{count}", hint="resume with the same number of ranks")
        self.inner.load_state_dict(self.reshard(state, mine, count))


def by_rank_modulo(states: list[Any], rank: int, world_size: int) -> Any:
    """Rank ``r`` of the new world continues rank ``r % n`` of the ``n`` saved (random streams)."""
    return states[rank % len(states)]


class Checkpointable:
    """Every component of the run, in load order; ``state_dict`` is a collective (all ranks call it).

    A component with ``sharded = True`` (a sharded model and its optimizer) is saved apart, each rank
    its own shards (``torch.distributed.checkpoint``): :meth:`sharded_state_dict` gives those states,
    and :meth:`load_state_dict` fills them through ``load_sharded(template)``, which loads in place."""

    def __init__(self, **components: Stateful) -> None:
        self.components = components

    @property
    def is_sharded(self) -> bool:
        return any(getattr(c, "sharded", False) for c in self.components.values())

    def state_dict(self) -> dict[str, Any]:
        """The components that every checkpoint holds whole (on rank 0)."""
        return {name: c.state_dict() for name,
                c in self.components.items() if not getattr(c, "sharded", False)}

    def sharded_state_dict(self) -> dict[str, Any]:
        return {name: c.state_dict() for name, c in self.components.items() if getattr(c, "sharded", False)}

    def load_state_dict(self, state: dict[str, Any],
                        load_sharded: Callable[[dict[str, Any]], None] | None = None) -> None:
        plain = [name for name, c in self.components.items() if not getattr(c, "sharded", False)]
        missing = [name for name in plain if name not in state]
        if missing:
            raise CheckpointError(f"checkpoint lacks {', '.join(missing)}",
                                  hint="resume from a complete checkpoint")
        for name, c in self.components.items():
            if getattr(c, "sharded", False):
                if load_sharded is None:
                    raise CheckpointError("this run shards its model but the checkpoint holds no shards",
                                          hint="resume with the runtime.parallel setting the run was saved "
                                               "with")
                template = {name: c.state_dict()}
                load_sharded(template)  # in place, each rank its shards
                c.load_state_dict(template[name])
            else:
                c.load_state_dict(state[name])
