from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kvclient import __version__
from kvclient.cli import main
from reference_server import running_server


def test_help_lists_commands(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["--help"])
    assert exc.value.code == 0
    out = capsys.readouterr().out
    for command in ("demo", "serve", "bench", "contract", "count"):
        assert command in out


def test_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--version"])
    assert __version__ in capsys.readouterr().out


def test_no_command_prints_help_and_fails(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "COMMAND" in capsys.readouterr().out


def test_count_text(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["count", "hello world", "--context-window", "8192"]) == 0
    out = capsys.readouterr().out
    assert "prompt_tokens: 2" in out
    assert "max_tokens:    8190" in out


def test_count_chat_and_overflow(capsys: pytest.CaptureFixture[str]) -> None:
    messages = json.dumps([{"role": "user", "content": "hello world"}])
    assert main(["count", "--chat", messages, "--context-window", "9"]) == 1
    out = capsys.readouterr().out
    assert "prompt_tokens: 9" in out  # 3 framing + "user" 1 + "hello world" 2 + 3 priming
    assert "fills the context" in out


def test_count_bad_chat_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["count", "--chat", "{oops"]) == 2
    assert "not JSON" in capsys.readouterr().err


def test_console_script_entry_point() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvclient", "--help"], capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0
    assert "kvclient" in out.stdout


def test_serve_help_names_itself(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        main(["serve", "--help"])
    assert exc.value.code == 0
    assert capsys.readouterr().out.startswith("usage: kvclient serve ")


def test_count_server_without_a_url_asks_the_one_the_environment_names(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    with running_server(kv_tokens=4096, context_window=2048) as server:
        monkeypatch.setenv("KVCLIENT_BASE_URL", server.base_url)
        before = server.metrics()["kv_http_requests_total"]
        assert main(["count", "hello world", "--server"]) == 0
        assert main(["count", "--server", "hello world"]) == 0  # not a URL: the input
        asked = server.metrics()["kv_http_requests_total"] - before
    assert capsys.readouterr().out.count("prompt_tokens: 2") == 2
    assert asked >= 2  # counted by the server's /tokenize, not here


def test_count_server_without_a_url_or_the_variable_says_what_to_set(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv("KVCLIENT_BASE_URL", raising=False)
    monkeypatch.delenv("OPENAI_BASE_URL", raising=False)
    assert main(["count", "hello world", "--server"]) == 2
    assert "KVCLIENT_BASE_URL" in capsys.readouterr().err
