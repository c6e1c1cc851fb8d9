"""A load that fails because a peer rank died is not a damaged checkpoint: ``load_sharded`` must re-raise it
(the job fails and Slurm requeues it) instead of a user error, which stops the job for good (found by the
dead-node test: a rank killed during the restart's checkpoint load turned into "use another checkpoint")."""

from __future__ import annotations

import pytest
import torch

from elastic_pretrain.checkpoint.safe_load import is_comm_failure

GLOO_RESET = (
    "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] Read error [127.0.0.1]:4767: "
    "Connection reset by peer. This is typically caused by a remote worker hanging."
)


def _wrapped(cause: BaseException) -> BaseException:
    try:
        try:
            raise cause
        except BaseException as inner:
            raise RuntimeError("CheckpointException ranks:dict_keys([0])") from inner
    except RuntimeError as outer:
        return outer


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError(GLOO_RESET),
        torch.distributed.DistBackendError("NCCL communicator was aborted on rank 1"),
        _wrapped(RuntimeError(GLOO_RESET)),  # DCP wraps each rank's failure
    ],
    ids=["gloo-reset", "dist-backend-error", "wrapped"],
)
def test_a_broken_collective_is_a_comm_failure(err: BaseException) -> None:
    assert is_comm_failure(err)


@pytest.mark.parametrize(
    "err",
    [
        RuntimeError("size mismatch for core.0.passes.0.self_attention.linear_qkv.weight"),
        _wrapped(ValueError("could not find key 'optimizer.exp_avg.embedding.word_embeddings.weight'")),
        pytest.UsageError("unpickling global 'os.system' is refused"),
    ],
    ids=["shape", "missing-key", "refused-global"],
)
def test_a_damaged_checkpoint_is_not_a_comm_failure(err: BaseException) -> None:
    assert not is_comm_failure(err)
