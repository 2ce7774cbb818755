"""What the SGLang test modules share: its venv's python, the tiny model,
and SGLang's own cache (no host tier) on the chat, run once a page size."""

import pytest

from engine_env import CHAT_MAX_TOTAL_TOKENS, build_model, run_chat, sglang_server, venv_python


@pytest.fixture(scope="session")
def sglang_python():
    return venv_python("sglang")


@pytest.fixture(scope="session")
def sglang_model(sglang_python, tmp_path_factory):
    return build_model(sglang_python, str(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="session")
def sglang_own_chat(sglang_python, sglang_model, tmp_path_factory):
    """`get(page_size)`: SGLang's own radix cache on the chat, a pool of
    CHAT_MAX_TOTAL_TOKENS: {"turns", "log", "code"}; each page size runs once."""
    runs = {}
    logs = tmp_path_factory.mktemp("sglang-own")

    def get(page_size: int) -> dict:
        if page_size not in runs:
            server = sglang_server(
                sglang_python,
                sglang_model,
                str(logs / f"sglang-p{page_size}.log"),
                None,
                CHAT_MAX_TOTAL_TOKENS,
                page_size,
            )
            turns, code = run_chat(server)
            runs[page_size] = {"turns": turns, "log": server.log(), "code": code}
        return runs[page_size]

    return get
