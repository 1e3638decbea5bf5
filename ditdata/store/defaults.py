"""The store's write options and their defaults, in one place (stdlib only: command lines
show them in --help without importing numpy)."""

BACKENDS = ("zarr", "wds")  # see backends.py
DEFAULT_BACKEND = "zarr"
# Samples per storage chunk (zarr) or per tar block (wds): large chunks read fast.
CHUNK_SAMPLES = 1024
