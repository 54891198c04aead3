"""N-gram (prompt-lookup) proposals for speculative decoding: no model, just the request's own tokens.

For the longest n in [prompt_lookup_min, prompt_lookup_max] such that the last n tokens of the sequence occurred
earlier in it, propose the (up to) k tokens that followed that earlier occurrence (the most recent one: text that
repeats tends to repeat its latest form). Edits, summaries and code rewrites repeat long spans of their input, so
there a match runs for many tokens; in free generation there is often no match, and nothing is proposed.

One numpy pass per candidate n over the sequence (a sliding-window comparison), so a proposal costs O(n * len)
byte comparisons in C, not a Python loop over tokens.
"""
from __future__ import annotations

import numpy as np
from numpy.lib.stride_tricks import sliding_window_view


def propose_ngram(token_ids: np.ndarray, *, num_speculative_tokens: int, prompt_lookup_min: int,
                  prompt_lookup_max: int) -> list[int]:
    """Up to `num_speculative_tokens` proposed next tokens for the sequence `token_ids` (int array, prompt +
    output so far); [] when the last `prompt_lookup_min` tokens never occurred before."""
    length = len(token_ids)
    for n in range(min(prompt_lookup_max, length - 1), prompt_lookup_min - 1, -1):
        pattern = token_ids[length - n:]
        # Windows starting at 0 .. length - n - 1: every earlier occurrence, not the suffix itself.
        windows = sliding_window_view(token_ids[:length - 1], n)
        matches = np.flatnonzero((windows == pattern).all(axis=1))
        if matches.size:
            start = int(matches[-1]) + n   # the tokens after the latest earlier occurrence
            return token_ids[start:start + num_speculative_tokens].tolist()
    return []
