"""``bench serve --vs-direct-http``: the sim engine behind its own OpenAI HTTP server
(``bench/sim_http.py``) streams completions the openai client reads, refuses bad bodies, and a
tiny run of the comparison writes the documented rows. No timing is asserted."""

from __future__ import annotations

import argparse
import contextlib
import json
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest

from splitbus.bench import serve, system
from splitbus.bench import sim_http as sim_http_module
from splitbus.bench.serve_trace import ServeConfig, Workload
from splitbus.bench.sim_http import MAX_BODY_BYTES, MAX_OUTPUT_TOKENS, BadRequest, parse_request, serving
from splitbus.cli import bench as cli_bench
from splitbus.env import Env
from splitbus.worker import engines

PNG = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def sim_http(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    model = tmp_path_factory.mktemp("tiny")
    engines.get("sim").make_default_model(model)
    with serving(model, "tiny") as base_url:
        yield base_url


async def test_the_server_streams_a_completion_with_its_usage(sim_http: str) -> None:
    client = openai.AsyncOpenAI(base_url=f"{sim_http}/v1", api_key="x", max_retries=0, timeout=30)
    prompt = list(range(40, 80))
    for cached in (0, 32):  # the same prompt again: its two full blocks come from the prefix cache
        stream = await client.completions.create(
            model="tiny",
            prompt=prompt,
            max_tokens=5,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        chunks = [chunk async for chunk in stream]
        texts = [c.choices[0].text for c in chunks if c.choices]
        assert len(texts) == 5 and all(texts)
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
        usage = chunks[-1].usage
        assert usage is not None and (usage.prompt_tokens, usage.completion_tokens) == (40, 5)
        assert usage.prompt_tokens_details is not None and usage.prompt_tokens_details.cached_tokens == cached
    assert [m.id async for m in client.models.list()] == ["tiny"]
    await client.close()


def test_the_server_refuses_a_bad_body_with_the_reason(sim_http: str) -> None:
    response = httpx.post(f"{sim_http}/v1/completions", json={"prompt": [1, 2], "max_tokens": 0}, timeout=10)
    assert response.status_code == 400
    assert response.json()["error"]["message"] == f"max_tokens must be an integer in [1, {MAX_OUTPUT_TOKENS}]"
    huge = httpx.post(f"{sim_http}/v1/completions", content=b"[" * (MAX_BODY_BYTES + 1), timeout=10)
    assert huge.status_code == 413
    body = {"model": "tiny", "prompt": [1] * 4090, "max_tokens": 16, "stream": True}
    long = httpx.post(f"{sim_http}/v1/completions", json=body, timeout=10)
    assert long.status_code == 400
    assert (
        long.json()["error"]["message"] == "4090 prompt tokens + max_tokens 16 exceed the model's context length 4096"
    )
    other = httpx.post(f"{sim_http}/v1/completions", json={**body, "prompt": [1], "model": "llama"}, timeout=10)
    assert other.status_code == 404 and other.json()["error"]["message"] == "the model 'llama' does not exist"


@pytest.mark.parametrize(
    ("body", "reason"),
    [
        (b"{", "the body is not JSON"),
        (b"[1]", "the body must be a JSON object"),
        (b'{"prompt": "text"}', "prompt must be a list of 1 to 32768 token ids"),
        (b'{"prompt": []}', "prompt must be a list of 1 to 32768 token ids"),
        (b'{"prompt": [1, 300]}', "prompt token ids must be integers in [0, 259)"),
        (b'{"prompt": [1, true]}', "prompt token ids must be integers in [0, 259)"),
        (b'{"prompt": [1], "max_tokens": 1.5}', f"max_tokens must be an integer in [1, {MAX_OUTPUT_TOKENS}]"),
    ],
)
def test_a_bad_request_names_what_is_wrong(body: bytes, reason: str) -> None:
    with pytest.raises(BadRequest, match=f"^{re.escape(reason)}$"):
        parse_request(body, 259, "tiny")


@pytest.mark.parametrize(
    ("body", "status", "reason"),
    [
        (b'{"prompt": [1]}', 400, "this server only streams: stream must be true"),
        (b'{"prompt": [1], "stream": false}', 400, "this server only streams: stream must be true"),
        (b'{"prompt": [1], "stream": 1}', 400, "this server only streams: stream must be true"),
        (b'{"prompt": [1], "stream": true, "model": "llama"}', 404, "the model 'llama' does not exist"),
        (b'{"prompt": [1], "stream": true, "model": null}', 404, "the model 'None' does not exist"),
    ],
)
def test_it_only_streams_and_only_its_model(body: bytes, status: int, reason: str) -> None:
    with pytest.raises(BadRequest, match=f"^{re.escape(reason)}$") as refused:
        parse_request(body, 259, "tiny")
    assert refused.value.status == status


def test_a_body_asks_for_the_usage_chunk_by_stream_options() -> None:
    assert parse_request(b'{"prompt": [5], "max_tokens": 3, "stream": true}', 259, "tiny") == ([5], 3, False)
    usage = b'{"prompt": [5], "stream": true, "model": "tiny", "stream_options": {"include_usage": true}}'
    assert parse_request(usage, 259, "tiny") == ([5], 16, True)


def test_a_tiny_comparison_writes_overhead_rows_per_max_concurrency(tmp_path: Path) -> None:
    out = tmp_path / "out"
    args = ["--vs-direct-http", "1", "2", "--num-prompts", "4", "--input-len", "32", "--output-len", "3"]
    proc = _bench_serve(out, args)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (out / "bench_serve.png").read_bytes()[:8] == PNG
    report = json.loads((out / "bench_serve.json").read_text())
    runs = [(r["path"], r["max_concurrency"], r["completed"], r["failed"]) for r in report["runs"]]
    assert runs == [("direct-http", 1, 4, 0), ("direct-http", 2, 4, 0), ("splitbus", 1, 4, 0), ("splitbus", 2, 4, 0)]
    assert all(r["prefix_hit_ratio"] <= r["ideal_prefix_hit_ratio"] for r in report["runs"])
    overhead = report["overhead"]
    assert [(o["path"], o["baseline"], o["max_concurrency"]) for o in overhead] == [
        ("splitbus", "direct-http", 1),
        ("splitbus", "direct-http", 2),
    ]
    assert all(isinstance(o["added_median_ttft_ms"], float) and "added_median_itl_ms" in o for o in overhead)
    assert "added by splitbus over direct-http at max concurrency 2: TTFT p50" in proc.stdout + proc.stderr


def test_a_run_that_finds_its_prompts_already_cached_fails_naming_both_ratios(sim_http: str, tmp_path: Path) -> None:
    """The same requests twice at a server that keeps its cache: the second run's hit ratio is
    over its ideal (0: random prompts share nothing), and the benchmark says so and fails."""
    args = ["--base-url", sim_http, "--request-rate", "inf", "--num-prompts", "3", "--input-len", "48"]
    args += ["--output-len", "2", "--seed", "11", "--data-dir", str(tmp_path / "data")]
    first, second = (_bench_serve(tmp_path / name, args) for name in ("first", "second"))
    assert first.returncode == 0, first.stdout[-2000:] + first.stderr[-2000:]
    assert second.returncode == 1, second.stdout[-2000:] + second.stderr[-2000:]
    assert re.search(
        r"splitbus bench serve: FAILED: http at inf req/s: prefix hit ratio (\d+\.\d+)% exceeds its ideal 0\.000%",
        second.stdout + second.stderr,
    )
    assert (tmp_path / "second" / "bench_serve.json").exists()  # the evidence is kept


def _bench_serve(out: Path, args: list[str]) -> subprocess.CompletedProcess[str]:
    argv = [sys.executable, "-m", "splitbus.cli.main", "bench", "serve", *args, "--out", str(out)]
    return subprocess.run(argv, capture_output=True, text=True, timeout=180, check=False)


@pytest.mark.parametrize(
    ("args", "reason"),
    [
        (["--vs-direct-http", "--base-url", "http://127.0.0.1:1"], "it takes neither --policy nor --base-url"),
        (["--vs-direct-http", "1", "--policy", "mixed"], "it takes neither --policy nor --base-url"),
        (["--vs-direct-http", "1", "0"], "--vs-direct-http's max concurrencies must be >= 1"),
        (["--vs-direct-http", "--dataset", "trace", "t.jsonl"], "it does not take --dataset trace"),
    ],
)
def test_the_comparison_refuses_what_it_cannot_do_before_starting_anything(
    args: list[str], reason: str, tmp_path: Path
) -> None:
    proc = _bench_serve(tmp_path, args)
    assert proc.returncode == 2 and reason in proc.stdout + proc.stderr
    assert not (tmp_path / "bench_serve.json").exists()


def test_each_side_is_warmed_on_a_spare_seed_and_the_config_has_the_levels(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """No server: each side's measure is noted. Before its first level, each side serves
    WARMUP_REQUESTS random requests one at a time on the seed after the levels' (seed + i)."""
    sent: list[tuple[str, int, int, int, str]] = []

    def measure_http(base_url: str, config: ServeConfig, rate: float) -> None:
        sent.append((base_url, config.seed, config.num_prompts, config.max_concurrency, config.workload.dataset))

    @contextlib.contextmanager
    def sim_serving(model_dir: Path, model: str) -> Iterator[str]:
        yield "http://direct"

    class Stack:
        base_url, data_dir = "http://stack", tmp_path

        def __init__(self, *args: str) -> None:
            pass

        def stop(self) -> None:
            pass

    row = dict.fromkeys(serve.OVERHEAD_FIELDS, 1.0)
    monkeypatch.setattr(serve, "measure_http", measure_http)
    monkeypatch.setattr(serve, "measure_memory", lambda url, measured: (row, {}))
    monkeypatch.setattr(sim_http_module, "serving", sim_serving)
    monkeypatch.setattr(system, "LocalSystem", Stack)
    config = ServeConfig(num_prompts=9, seed=5, workload=Workload("prefix"))
    report = serve.run_vs_direct_http(config, (1, 16), lambda _: None)
    warm = serve.WARMUP_REQUESTS
    assert sent == [
        ("http://direct", 7, warm, 1, "random"),
        ("http://direct", 5, 9, 1, "prefix"),
        ("http://direct", 6, 9, 16, "prefix"),
        ("http://stack", 7, warm, 1, "random"),
        ("http://stack", 5, 9, 1, "prefix"),
        ("http://stack", 6, 9, 16, "prefix"),
    ]
    assert report["config"]["vs_direct_http_max_concurrency"] == [1, 16]
    assert report["config"]["warmup_requests"] == warm and report["config"]["num_prompts"] == 9
    assert "rates" not in report["config"] and "max_concurrency" not in report["config"]


def test_a_run_over_its_ideal_is_named_even_where_writing_the_results_fails(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str], tmp_path: Path
) -> None:
    over = {"path": "http", "request_rate": 1.0, "prefix_hit_ratio": 0.5, "ideal_prefix_hit_ratio": 0.0}
    monkeypatch.setattr(cli_bench, "_config", lambda name, make: ServeConfig())
    monkeypatch.setattr(cli_bench, "_serve_result", lambda *args: {"runs": [over]})

    def finish(*args: object) -> int:
        raise OSError("disk full")

    monkeypatch.setattr(cli_bench._Run, "finish", finish)
    args = argparse.Namespace(policy="", base_url="", vs_direct_http=None, dataset=["random"], out=tmp_path)
    with pytest.raises(OSError, match="disk full"):
        cli_bench.run_serve(args, Env())
    assert "FAILED: http at 1.0 req/s: prefix hit ratio 50.000% exceeds its ideal 0.000%" in capsys.readouterr().out
