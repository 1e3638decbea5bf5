"""Each row's latest status in a URL fetch, read from the shards' parquet files.

img2dataset writes one parquet per shard beside its tar (NNNNN.parquet) with one row per
input URL, failures included: the URL-list columns it was given, `key`, `status`
("success", "failed_to_download", "failed_to_resize") and `error_message` (str() of the
exception, or the resizer's reason). `ditdata fetch --retry-failed` (retries.py) writes
each retried row again, under its own key, into a shard numbered after every earlier
one. So the ledger needs no file of its own: a row's latest status is the one in the
highest-numbered finished shard (one with its stats file) that holds its key. A shard
that never got its stats file is not read, so a killed pass leaves no trace here.

    latest(out, indices, columns)   one row per key, its latest status
    failure_class(status, message)  "transient" (worth another pass) or "permanent"
    summary(rows)                   dataset.json's summary over the latest statuses

The ledger is held in memory (pandas): a few columns of every row, fine for the tens of
millions of rows one person fetches; LAION-400M would want it per original shard.
"""

from __future__ import annotations

import re
from collections import Counter
from functools import lru_cache
from pathlib import Path

from ditdata.common.progress import most_first
from ditdata.errors import DitdataError
from ditdata.imageshards import folder as shards

STATUS_COLUMNS = ("key", "status", "error_message")
SUCCESS = "success"
TRANSIENT, PERMANENT = "transient", "permanent"

# error_message (img2dataset's str() of the exception) -> class; the first match wins and
# a message that matches nothing is PERMANENT: a server is never hammered over an error we
# do not understand. Only "failed_to_download" rows are looked up (a resize failure is about
# the bytes, which a refetch returns unchanged).
FAILURE_CLASSES = (
    # the server is overloaded or down for a while, or rate-limits us: later it may answer
    (re.compile(r"^HTTP Error (5\d\d|429)\b"), TRANSIENT),
    # 404 gone, 403 forbidden, 410, 400...: the same request gets the same answer
    (re.compile(r"^HTTP Error 4\d\d\b"), PERMANENT),
    # our own refusals (non-http schemes, local paths, redirects off http): never fetched
    (re.compile(r"^refused (URL|redirect): "), PERMANENT),
    # the network between us and the server: timeouts, resets, dropped connections
    (re.compile(r"timed out", re.I), TRANSIENT),
    (re.compile(r"Connection (reset|refused|aborted)|Remote end closed|Broken pipe|IncompleteRead"
                r"|Network is unreachable|No route to host", re.I), TRANSIENT),
    # EAI_AGAIN: the resolver could not answer now (NXDOMAIN, "Name or service not known", is final)
    (re.compile(r"Temporary failure in name resolution", re.I), TRANSIENT),
)


@lru_cache(maxsize=4096)
def failure_class(status: str | None, message: str | None) -> str | None:
    """None for a success, else TRANSIENT or PERMANENT (see FAILURE_CLASSES)."""
    if status == SUCCESS:
        return None
    if status != "failed_to_download" or not message:
        return PERMANENT
    return next((cls for pattern, cls in FAILURE_CLASSES if pattern.search(message)), PERMANENT)


def latest(out: Path, indices, columns=()):
    """A pandas DataFrame with one row per key: the STATUS_COLUMNS and COLUMNS of the row in
    the highest of the finished shards INDICES that holds the key, plus `failure` (its
    failure_class) and `shard` (that shard's index)."""
    import pandas as pd
    import pyarrow.parquet as pq

    wanted = list(dict.fromkeys([*STATUS_COLUMNS, *columns]))
    frames = []
    for i in sorted(indices):
        p = Path(out) / f"{shards.shard_name(i)}.parquet"
        try:
            frames.append(pq.read_table(p, columns=wanted).to_pandas().assign(shard=i))
        except (OSError, ValueError, KeyError) as e:
            raise DitdataError(f"{p}: cannot read the shard's per-row statuses ({e}); without it the "
                               "failed rows are unknown (refetch the shard: delete its _stats.json and rerun "
                               "the first `ditdata fetch` command)") from None
    rows = pd.concat(frames, ignore_index=True).drop_duplicates("key", keep="last")  # later shard wins
    rows["failure"] = [failure_class(s, m) for s, m in zip(rows["status"], rows["error_message"], strict=True)]
    return rows.reset_index(drop=True)


def summary(rows) -> dict:
    """shards.summarize_stats' fields, counted over the latest statuses ROWS."""
    total = len(rows)
    ok = rows["status"] == SUCCESS
    reasons = Counter(rows.loc[~ok, "error_message"].fillna("unknown error"))
    successes = int(ok.sum())
    return {
        "total": total,
        "successes": successes,
        "failed": total - successes,
        "success_rate": successes / total if total else 0.0,
        **{k: int((rows["status"] == k).sum()) for k in ("failed_to_download", "failed_to_read", "failed_to_resize")},
        "reasons": most_first(reasons),
    }
