"""A real vLLM OpenAI server on CPU with the tiny random Llama (tests/vllm_support.py)."""

from __future__ import annotations

from tests.vllm_support import VllmServer, tiny_llama, vllm_server  # noqa: F401  (fixtures)


def test_greedy_completion_is_deterministic(vllm_server: VllmServer) -> None:  # noqa: F811
    prompt = "The cat sees a red ball in the garden, and then"
    first = vllm_server.complete(prompt, max_tokens=16, ignore_eos=True)
    second = vllm_server.complete(prompt, max_tokens=16, ignore_eos=True)
    text = first["choices"][0]["text"]
    assert text.strip()
    assert first["usage"]["completion_tokens"] == 16
    assert second["choices"][0]["text"] == text
    assert vllm_server.metric("vllm:prefix_cache_queries") > 0
