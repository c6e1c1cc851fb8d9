"""elastic-pretrain: pretraining elastic-depth looped mixture-of-experts language models on megatron-core."""

from elastic_pretrain import _import_hooks

_import_hooks.install()  # before any module of the package imports megatron-core (the eager_jit_fuser CPU patch)
