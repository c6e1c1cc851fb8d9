"""One module per experiment analysis; each defines ``EXPERIMENT`` (registered in ``../registry.py``)."""
