"""Per-rank RNG states (python, numpy, torch, megatron's TP RNG tracker) as plain tensors.

Saved with ``torch.save`` and loaded with ``torch.load(weights_only=True)``: only tensors, ints,
strings, lists and dicts, so loading cannot instantiate arbitrary objects.
"""

from __future__ import annotations

import io
import random
from pathlib import Path
from typing import Any

import numpy as np
import torch
from megatron.core import tensor_parallel

from elastic_pretrain.errors import UserError
from elastic_pretrain.files import atomic_file, read_bounded


def capture() -> dict[str, Any]:
    version, mt, gauss = random.getstate()
    name, keys, pos, has_gauss, cached = np.random.get_state(legacy=True)  # the 5-tuple form
    return {
        "python": {"version": version, "state": torch.tensor(mt, dtype=torch.int64), "gauss": gauss},
        "numpy": {
            "name": name,
            "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)),
            "pos": int(pos),
            "has_gauss": int(has_gauss),
            "cached": float(cached),
        },
        "torch": torch.get_rng_state(),
        "tracker": {k: v.clone() for k, v in tensor_parallel.get_cuda_rng_tracker().get_states().items()},
    }


def restore(state: dict[str, Any]) -> None:
    py = state["python"]
    random.setstate((py["version"], tuple(int(x) for x in py["state"].tolist()), py["gauss"]))
    n = state["numpy"]
    np.random.set_state((n["name"], n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["cached"]))
    torch.set_rng_state(state["torch"])
    tensor_parallel.get_cuda_rng_tracker().set_states(dict(state["tracker"]))


def save(path: Path, *, root: Path) -> None:
    with atomic_file(path, root=root) as f:
        torch.save(capture(), f)


def load(path: Path) -> dict[str, Any]:
    try:  # a regular file of a bounded size (files.py): not a FIFO, not a link
        return torch.load(io.BytesIO(read_bounded(path, "rng")), weights_only=True)
    except UserError:
        raise
    except Exception as err:  # truncated zip, bad pickle opcode, disallowed global...
        raise UserError(f"{path}: unreadable RNG state ({type(err).__name__}: {str(err).splitlines()[0]})") from None
