"""Sample quality (split into modules in the next commit: this one only moves the file)."""

from dittrain.eval.sources import *  # noqa: F403
