"""Incremental detokenization and stop strings.

Decoding token by token is wrong for byte-level tokenizers (a multi-byte character can be split across
tokens) and for SentencePiece ones (a token's leading space depends on its left neighbour); decoding the
whole output every step is right but quadratic. vLLM's `detokenize_incrementally` does neither: it decodes
two short windows of ids, `token_ids[prefix_offset:read_offset]` (already emitted, kept as left context) and
`token_ids[prefix_offset:]`, and emits the difference. While the text ends in U+FFFD (an incomplete UTF-8
sequence) nothing is emitted and the offsets stay, so the character comes out whole once its last byte
arrives. The windows start on the last 5 prompt tokens so the first output token has its context.

Without a tokenizer (the engine's skip_tokenizer_init) there is no text: `update` adds none, `decode` gives ""
and `decode_token` None (Logprob.decoded_token, as vLLM).
"""
_REPLACEMENT_CHAR = "\ufffd"


class Detokenizer:
    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        # The Rust tokenizer's decode is several times faster than the Python wrapper's and does not
        # apply clean_up_tokenization_spaces (which is not stable under concatenation).
        self._backend = getattr(tokenizer, "backend_tokenizer", None)

    def decode(self, token_ids: list[int], skip_special_tokens: bool = True) -> str:
        if self.tokenizer is None:
            return ""
        if self._backend is not None:
            return self._backend.decode(token_ids, skip_special_tokens=skip_special_tokens)
        return self.tokenizer.decode(token_ids, skip_special_tokens=skip_special_tokens,
                                     clean_up_tokenization_spaces=False)

    def decode_token(self, token_id: int) -> str | None:
        """One token on its own (for Logprob.decoded_token)."""
        if self.tokenizer is None:
            return None
        return self.decode([token_id], skip_special_tokens=False)

    def decode_beam(self, token_ids: list[int]) -> str:
        """A finished beam's text, decoded whole (as transformers decodes a beam search's output)."""
        if self.tokenizer is None:
            return ""
        return self.tokenizer.decode(token_ids, skip_special_tokens=True)

    def update(self, seq) -> int:
        """Extend `seq.output_text` with the text of its newest token; returns the number of new characters. `seq`:
        a completion of the output processor (token_ids, prefix_offset, read_offset, output_text, params)."""
        if self.tokenizer is None:
            return 0
        skip = seq.params.skip_special_tokens
        ids = seq.token_ids
        prefix_text = self.decode(ids[seq.prefix_offset:seq.read_offset], skip)
        new_text = self.decode(ids[seq.prefix_offset:], skip)
        if len(new_text) <= len(prefix_text) or new_text.endswith(_REPLACEMENT_CHAR):
            return 0   # nothing printable yet (special token skipped, or a character still incomplete)
        delta = new_text[len(prefix_text):]
        seq.prefix_offset, seq.read_offset = seq.read_offset, len(ids)
        seq.output_text += delta
        return len(delta)


def check_stop_strings(seq, num_new_chars: int) -> str | None:
    """Find a stop string overlapping the newest `num_new_chars` characters of `seq.output_text` (the
    earliest one when several match). On a match the text is cut before it (after it with
    include_stop_str_in_output) and the string is returned."""
    params = seq.params
    if not params.stop or num_new_chars == 0:
        return None
    text = seq.output_text
    # A match must overlap the new characters: search only the new text plus a tail of len(stop) - 1 before it.
    best_index, best_stop = None, None
    for stop in params.stop:
        index = text.find(stop, max(len(text) - num_new_chars - len(stop) + 1, 0))
        if index != -1 and (best_index is None or index < best_index):
            best_index, best_stop = index, stop
    if best_stop is None:
        return None
    end = best_index + len(best_stop) if params.include_stop_str_in_output else best_index
    seq.output_text = text[:end]
    return best_stop
