"""Step helpers shared by the backends' prefix-reuse tests: prefill a slot in fixed chunks
from a kept prefix, decode greedily, and run a prompt cold in a spare slot (the conformance
suite's own prefill and greedy decode)."""
from dlfp.backends.conformance import chunks_of, greedy_decode
from dlfp.backends.conformance import prefill as prefill_chunks

decode = greedy_decode


def prefill(b, slot, tokens, start=0, chunk=64):
    """Prefill tokens[start:] into `slot` in chunks of `chunk`; the last logits."""
    return prefill_chunks(b, slot, tokens, chunks_of(len(tokens) - start, chunk), start=start)


def cold(b, tokens, n_out=6):
    """First logits and `n_out` greedy tokens of `tokens` prefilled cold in slot 2."""
    b.free_sequence(2)
    first = prefill(b, 2, tokens)
    out = decode(b, 2, first, len(tokens), n_out)
    b.free_sequence(2)
    return first, out
