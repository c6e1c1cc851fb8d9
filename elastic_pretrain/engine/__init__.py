"""Training engines: ``megatron`` (train/session.py, the default) and ``deepspeed`` (engine/deepspeed.py).

:func:`build_session` is the one seam: the commands hand it to the trainer (``train(job, build_session)``), which
imports no engine; DeepSpeed is imported only by a deepspeed job.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # annotations only: importing this package loads neither engine
    from elastic_pretrain.job import JobConfig
    from elastic_pretrain.parallel.mesh import Mesh
    from elastic_pretrain.train.session import Session


def build_session(job: JobConfig, mesh: Mesh) -> Session:
    """The run's :class:`~elastic_pretrain.train.session.Session` on the job's engine."""
    if job.engine == "deepspeed":
        from elastic_pretrain.engine.deepspeed import build_session as build_deepspeed

        return build_deepspeed(job, mesh)
    from elastic_pretrain.train.session import build_session as build_megatron

    return build_megatron(job, mesh)
