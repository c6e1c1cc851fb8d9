"""Errors a user can fix. The CLI prints ``str(err)`` as one line (no traceback) and exits 2."""


class UserError(Exception):
    """Bad input (config, flag, shard, checkpoint, tokenizer file, Slurm option): message names the fix."""
