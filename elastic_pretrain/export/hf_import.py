"""The reverse of ``hf_export``: an exported folder's tensors into a project model of the same shape.

Names map back (``model.<name>`` → ``<name>``, ``lm_head.weight`` → ``output_layer.weight``), the
vocabulary is padded again to the model's (TP-divisible) size with zero rows, and the shape recorded in
``config.json`` must be the model's. Tensors are read with ``safetensors`` (no unpickling). What a
training checkpoint holds beyond the weights (optimizer, data position, schedule, RNGs) is not in an
export, so this fills a model, not a run (docs/export.md).
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from elastic_pretrain.errors import UserError
from elastic_pretrain.export.hf_export import WEIGHTS

if TYPE_CHECKING:  # annotations only
    from elastic_pretrain.model.looped import LoopedMoEModel

# config.json field -> the one-process model's value it must equal
_SHAPE = {
    "vocab_size": lambda n: n.cfg.vocab_size,
    "hidden_size": lambda n: n.cfg.hidden_size,
    "num_attention_heads": lambda n: n.cfg.num_heads,
    "prelude_layers": lambda n: n.cfg.prelude_layers,
    "core_layers": lambda n: n.cfg.core_layers_built,
    "coda_layers": lambda n: n.cfg.coda_layers,
    "num_experts": lambda n: n.cfg.experts_built,
    "max_loops": lambda n: n.cfg.max_loops,
    "attention": lambda n: n.cfg.attention,
    "edge_mlp": lambda n: n.cfg.edge_mlp,
}


def load_export(net: LoopedMoEModel, export_dir: Path) -> None:
    """Load ``export_dir`` into ``net`` (a one-process ``LoopedMoEModel`` built for the same shape).

    Loop-conditioning heads absent from the export (never switched on) keep the model's values and stay
    off; present ones are loaded and switched on. Raises :class:`UserError` on any mismatch."""
    import torch
    from safetensors.torch import load_file

    from elastic_pretrain.export.folder import read_config
    from elastic_pretrain.files import check_regular

    hf = read_config(export_dir)  # bounded, every value checked: the folder may come from elsewhere
    weights = export_dir / WEIGHTS
    check_regular(weights, f"is {export_dir} an elastic-pretrain export folder?")
    for key, ours in _SHAPE.items():
        if hf.get(key) != ours(net):
            raise UserError(
                f"{export_dir}: {key}={hf.get(key)!r} but the model has {ours(net)!r}: "
                "build the model with the export's shape (elastic_pretrain.json holds its config)"
            )
    tensors = load_file(str(weights))
    state = net.state_dict()
    unknown = []
    for key, t in tensors.items():
        name = "output_layer.weight" if key == "lm_head.weight" else key.removeprefix("model.")
        if name not in state:
            unknown.append(key)
            continue
        target = state[name]
        if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
            t = torch.cat([t, t.new_zeros(target.shape[0] - t.shape[0], *t.shape[1:])])
        if t.shape != target.shape:
            raise UserError(f"{export_dir}: {key} has shape {tuple(t.shape)}, the model {tuple(target.shape)}")
        state[name] = t.to(target.dtype)
    exported = {"output_layer.weight" if k == "lm_head.weight" else k.removeprefix("model.") for k in tensors}
    skip = ("_extra_state", "pad_mask_V")
    missing = [
        k for k in state if not k.endswith(skip) and not k.startswith("loop_conditioning.") and k not in exported
    ]
    if unknown or missing:
        raise UserError(f"{export_dir}: tensors do not match the model (unknown {unknown[:3]}, missing {missing[:3]})")
    net.load_state_dict(state, strict=True)
    net.set_modes(conditioning=bool(hf.get("loop_conditioning")) and net.loop_conditioning is not None)
