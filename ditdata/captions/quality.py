"""What makes a generated caption suspect: the status `ditdata caption` gives it
(ditdata.imageshards.captionsets: "ok", "empty", "repeated", "truncated").

    status(text, hit_limit) -> "ok" | "empty" | "repeated" | "truncated"

The rules, checked in this order (the first that holds names the status):

1. empty: nothing but whitespace (the caption is then stored as null).
2. repeated: the degenerate loop greedy decoding falls into, "a cat on a mat on a mat on a
   mat on a mat": some run of n words (1 <= n <= MAX_PERIOD) follows itself back to back
   so that it appears MIN_COPIES times in a row (MIN_COPIES_SINGLE for a single word, so
   that "very, very good" passes). Words are compared lower-cased with the punctuation at
   their edges stripped, so "The cat. The cat. The cat." loops as much as "the cat the cat
   the cat". It is checked before truncation because a loop usually runs into the token
   limit too, and the loop is the cause worth counting.
3. truncated: generation stopped at max_new_tokens without the model's end-of-sequence
   token: the caption is cut mid-way (the captioner reports it; see ditdata.captions.captioners).

A flagged caption keeps its text in the set (only "empty" is null); readers choose.
"""

from __future__ import annotations

from ditdata.imageshards.captionsets import EMPTY, OK, REPEATED, TRUNCATED

MAX_PERIOD = 16  # longest run of words whose back-to-back copies count as a loop
MIN_COPIES = 3  # a run of 2..MAX_PERIOD words seen this many times in a row is a loop
MIN_COPIES_SINGLE = 4  # a single word, this many times in a row
_EDGE = ".,;:!?\"'()[]{}"


def words(text: str) -> list[str]:
    """The caption's words as the loop rule compares them (module docstring)."""
    out = []
    for w in text.lower().split():
        w = w.strip(_EDGE)
        if w:
            out.append(w)
    return out


def longest_loop(ws: list[str]) -> tuple[int, int]:
    """(period n, copies) of the back-to-back repetition with the most copies in `ws` (ties:
    the shortest period); (0, 0) without any. A run of n words repeats k times in a row
    exactly where ws[j] == ws[j + n] holds for (k - 1) * n consecutive j, so one pass per
    period finds it: O(len * MAX_PERIOD)."""
    best = (0, 0)
    for n in range(1, min(MAX_PERIOD, len(ws) // 2) + 1):
        run = 0
        for j in range(len(ws) - n):
            run = run + 1 if ws[j] == ws[j + n] else 0
            copies = run // n + 1
            if copies > best[1]:
                best = (n, copies)
    return best


def is_loop(text: str) -> bool:
    n, copies = longest_loop(words(text))
    return copies >= (MIN_COPIES_SINGLE if n == 1 else MIN_COPIES)


def status(text: str | None, hit_limit: bool) -> str:
    """The caption's status (module docstring): "empty", "repeated", "truncated" or "ok"."""
    if text is None or not text.strip():
        return EMPTY
    if is_loop(text):
        return REPEATED
    if hit_limit:
        return TRUNCATED
    return OK
