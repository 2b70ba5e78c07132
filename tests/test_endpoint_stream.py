"""The endpoint client's reading of SSE streams as servers send them (no server needed)."""
import json

from dlfp.bench.endpoint import UNKNOWN_TOKEN, _Stream
from dlfp.sequence import Request


def sse(*chunks):
    return [f"data: {json.dumps(c)}" for c in chunks] + ["data: [DONE]"]


def choice(text, finish=None, **extra):
    return {"choices": [{"index": 0, "text": text, "finish_reason": finish, **extra}]}


def test_llama_server_final_chunk_is_not_a_token():
    """llama.cpp's server: one chunk per token, then finish_reason with empty text, then usage."""
    chunks = [choice(" a", __verbose=None) for _ in range(3)]
    for i, c in enumerate(chunks):
        c["__verbose"] = {"tokens": [100 + i], "content": " a"}
    final = choice("", "length") | {"usage": {"completion_tokens": 3, "prompt_tokens": 50,
                                              "prompt_tokens_details": {"cached_tokens": 40}},
                                    "__verbose": {"tokens": [], "content": ""}}
    s = _Stream()
    s.read(sse(*chunks, final))
    assert s.error is None and len(s.times) == 3 and s.ids == [100, 101, 102]
    rec = s.record(Request(list(range(50)), 3), arrival=0.0)
    assert rec.output_ids == [100, 101, 102] and rec.finish_reason == "length" and rec.cached_prompt_tokens == 40


def test_tokens_without_ids_are_counted_by_their_text():
    s = _Stream()
    s.read(sse(choice("x"), choice("y"), choice("", "length"), {"choices": [], "usage": {"completion_tokens": 2}}))
    rec = s.record(Request([1, 2], 2), arrival=0.0)
    assert len(rec.token_times) == 2 and rec.output_ids == [UNKNOWN_TOKEN] * 2 and rec.cached_prompt_tokens == 0


def test_dlfp_chunks_with_ids_count_even_with_empty_text():
    """dlfp sends empty text while a character is incomplete, but the token id is there."""
    s = _Stream()
    s.read(sse(choice("", token_ids=[7]), choice("é", token_ids=[8]), choice("!", "stop", token_ids=[9])))
    assert s.ids == [7, 8, 9] and len(s.times) == 3 and s.finish_reason == "stop"
