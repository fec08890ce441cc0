"""KV transfer between engines for prefill/decode (P/D) disaggregation.

Disaggregated serving (DistServe, Zhong et al. OSDI 2024; Splitwise, Patel et al. ISCA 2024; as
deployed by llm-d and vLLM's KV connectors) runs a request's prefill on one engine and its decode
on another, so long prompts do not stall other requests' token streams. The prefill engine
computes the prompt (the router sends it with ``max_tokens=1``), and the decode engine pulls the
prompt's KV instead of computing it again.

kvfleet's transport is plain HTTP, through the prefix cache:

1. The prefill engine serves the request as usual; its full prompt blocks land in its prefix
   cache under their chained block hashes (SHA-256, the same in every process: no Python
   ``hash()`` randomisation).
2. The decode engine gets the request with vLLM's ``kv_transfer_params`` naming the prefill engine
   (``{"do_remote_prefill": true, "remote_url": "http://host:port"}``). Before queueing it, it
   posts the prompt's token ids to the prefill engine's ``POST /kvfleet/v1/kv/export``
   (:data:`EXPORT_PATH`); the answer (:func:`encode_kv`) holds a small JSON header (model
   sha256, layers, KV heads, head dim, block size, KV storage dtype and fp8 scales, KV cache
   groups, the exported blocks' hashes) and the raw K/V bytes of the longest cached full-block
   prefix, for every layer.
3. In its engine thread, between steps, the decode engine allocates blocks, writes the K/V into
   them and registers them in its own prefix cache under hashes it computes itself from the
   token ids (:func:`import_kv`); the block hashes in the header must equal them. The
   scheduler then sees an ordinary prefix-cache hit and computes only the rest of the prompt
   (at least its last token). The imported blocks are pinned until the request is first
   scheduled, so they cannot be evicted while it waits.

Anything missing (evicted on the prefill side, a pool too full, a fetch error) is computed
locally: the output is the same, only slower, and the fallback is counted. Mismatched engines
(other weights, dtype, block size, layout) fail with a clear :class:`KVTransferError`.

Models with KV cache groups (Gemma 3's local / global layers) transfer every group's blocks;
fp8 KV caches transfer raw fp8 bytes when both sides use the same per-tensor scales. StreamingLLM
eviction (``--kv-eviction streaming``) is not supported.
"""

from __future__ import annotations

import itertools
import json
import logging
import struct
import sys
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any
from urllib.parse import urlsplit

import torch

from kvfleet.engine.core.kv_cache_manager import hash_block_tokens
from kvfleet.engine.request import Request
from kvfleet.model.layers.kv_cache import FP8KVCache, block_storage, kv_storage_dtype
from kvfleet.sampling_params import SamplingParams

if TYPE_CHECKING:
    import httpx

    from kvfleet.engine.llm_engine import LLMEngine

logger = logging.getLogger("kvfleet.kv_transfer")

#: HTTP path of the export endpoint on every kvfleet engine.
EXPORT_PATH = "/kvfleet/v1/kv/export"
#: first bytes of an export body (format version 1).
MAGIC = b"KVFLKV01"
_HEADER_LEN = struct.Struct("<I")
#: largest JSON header accepted, bytes.
MAX_HEADER_BYTES = 16 * 2**20

_placeholder_ids = itertools.count()


class KVTransferError(ValueError):
    """KV data that cannot be used here: another model or layout, a malformed or truncated body,
    block hashes of other tokens, or an engine configuration without KV transfer support."""


# --------------------------------------------------------------------------- layout


@dataclass(frozen=True)
class KVLayout:
    """What must agree between two engines for their KV blocks to be interchangeable.

    Attributes:
        model_sha256: the weights' fingerprint (GGUF file or safetensors folder).
        num_layers, num_kv_heads, head_dim: the model's KV shape.
        block_size: tokens per KV block.
        kv_dtype: the KV *storage* dtype name (``float32``, ``bfloat16``, ``float8_e4m3fn`` ...).
        fp8_scales: per layer ``(k_scale, v_scale)`` of an fp8 KV cache; empty otherwise.
        groups: the KV cache groups as ``(sliding_window, layers)``; one group of all layers
            for most models.
        compute_dtype: the model's compute dtype name (K/V are computed in it).
        quantization: the engine's weight quantization (``--quantization``; ``none``): the same
            weights quantized differently give different K/V.
    """

    model_sha256: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    kv_dtype: str
    fp8_scales: tuple[tuple[float, float], ...] = ()
    groups: tuple[tuple[int | None, tuple[int, ...]], ...] = ()
    compute_dtype: str = "float32"
    quantization: str = "none"

    @property
    def itemsize(self) -> int:
        """Bytes per stored K or V element."""
        return torch.empty((), dtype=getattr(torch, self.kv_dtype)).element_size()

    @property
    def block_layer_bytes(self) -> int:
        """Bytes of one block's K (or V) in one layer: ``block_size * kv_heads * head_dim * itemsize``."""
        return self.block_size * self.num_kv_heads * self.head_dim * self.itemsize

    def to_json(self) -> dict[str, Any]:
        """A JSON-able dict (the export header's ``layout``)."""
        return {"model_sha256": self.model_sha256, "num_layers": self.num_layers, "num_kv_heads": self.num_kv_heads,
                "head_dim": self.head_dim, "block_size": self.block_size, "kv_dtype": self.kv_dtype,
                "fp8_scales": [list(s) for s in self.fp8_scales],
                "groups": [[w, list(layers)] for w, layers in self.groups], "compute_dtype": self.compute_dtype,
                "quantization": self.quantization}

    @classmethod
    def from_json(cls, d: Any) -> KVLayout:
        """Parse :meth:`to_json`'s dict.

        Raises:
            KVTransferError: a missing or mistyped field, or an unknown dtype.
        """
        try:
            layout = cls(
                model_sha256=str(d["model_sha256"]), num_layers=_int(d["num_layers"]),
                num_kv_heads=_int(d["num_kv_heads"]), head_dim=_int(d["head_dim"]),
                block_size=_int(d["block_size"]), kv_dtype=str(d["kv_dtype"]),
                fp8_scales=tuple((float(k), float(v)) for k, v in d.get("fp8_scales") or ()),
                groups=tuple((None if w is None else _int(w), tuple(_int(x) for x in layers))
                             for w, layers in d.get("groups") or ()),
                compute_dtype=str(d.get("compute_dtype", "float32")), quantization=str(d.get("quantization", "none")))
        except (KeyError, TypeError, ValueError) as e:
            raise KVTransferError(f"malformed KV layout in the export header: {e!r}") from None
        if not isinstance(getattr(torch, layout.kv_dtype, None), torch.dtype):
            raise KVTransferError(f"unknown KV dtype {layout.kv_dtype!r} in the export header")
        if min(layout.num_layers, layout.num_kv_heads, layout.head_dim, layout.block_size) < 1:
            raise KVTransferError("the export header's KV shape has a non-positive size")
        return layout

    def mismatch(self, other: KVLayout) -> str | None:
        """Why KV sent in layout ``other`` cannot be used by an engine of this layout (None when
        it can)."""
        names = {"model_sha256": "model (weights sha256)", "num_layers": "layers", "num_kv_heads": "KV heads",
                 "head_dim": "head dim", "block_size": "block size", "kv_dtype": "KV dtype",
                 "fp8_scales": "fp8 KV scales", "groups": "KV cache groups", "compute_dtype": "compute dtype",
                 "quantization": "weight quantization"}
        for name, what in names.items():
            mine, theirs = getattr(self, name), getattr(other, name)
            if mine != theirs:
                return f"{what} differs: {theirs!r} on the prefill (sending) engine, {mine!r} on the decode engine"
        return None


def _int(x: Any) -> int:
    if isinstance(x, bool) or not isinstance(x, int):
        raise TypeError(f"expected an integer, got {x!r}")
    return x


def check_supported(engine: LLMEngine) -> None:
    """Raise :class:`KVTransferError` when ``engine`` cannot export or import KV: StreamingLLM
    eviction (its cache holds a moving window, not a prompt's prefix) or prefix caching off."""
    if getattr(engine, "streaming", False):
        raise KVTransferError("P/D KV transfer is not supported with --kv-eviction streaming")
    if not engine.kv_cache_manager.enable_prefix_caching:
        raise KVTransferError("P/D KV transfer needs prefix caching (--enable-prefix-caching) on both engines")


def kv_layout(engine: LLMEngine) -> KVLayout:
    """The :class:`KVLayout` of ``engine``'s KV pool."""
    runner = engine.runner
    mc = engine.model_config
    storage = kv_storage_dtype(runner.kv_cache_dtype, runner.dtype)
    scales: tuple[tuple[float, float], ...] = ()
    if runner.kv_cache_dtype != "auto":
        scales = tuple((k.scale, v.scale) for k, v in runner.kv_caches  # type: ignore[union-attr]
                       if isinstance(k, FP8KVCache) and isinstance(v, FP8KVCache))
    return KVLayout(
        model_sha256=str(engine.loaded.sha256), num_layers=mc.num_hidden_layers, num_kv_heads=mc.num_key_value_heads,
        head_dim=mc.head_dim, block_size=engine.block_size, kv_dtype=str(storage).removeprefix("torch."),
        fp8_scales=scales, groups=tuple((g.sliding_window, tuple(g.layers)) for g in engine.kv_cache_groups),
        compute_dtype=str(runner.dtype).removeprefix("torch."),
        quantization=str(getattr(getattr(engine, "config", None), "quantization", "none")))


def chain_hashes(token_ids: Sequence[int], block_size: int, num_blocks: int,
                 cache_salt: str | None = None) -> list[bytes]:
    """The chained block hashes of the first ``num_blocks`` full blocks of ``token_ids``, as the
    KV cache manager computes them for a request with this ``cache_salt`` (SHA-256 digests,
    identical in every process)."""
    extra = None if cache_salt is None else (None, cache_salt)
    out: list[bytes] = []
    for k in range(num_blocks):
        out.append(hash_block_tokens(out[-1] if out else None, token_ids[k * block_size:(k + 1) * block_size], extra))
    return out


def usable_blocks(num_prompt_tokens: int, block_size: int) -> int:
    """Full prompt blocks a decode engine can take from a prefill engine: the last prompt token
    is always computed locally (its logits give the first sampled token), so
    ``(num_prompt_tokens - 1) // block_size``."""
    return max(0, num_prompt_tokens - 1) // block_size


def _placeholder(engine: LLMEngine, token_ids: Sequence[int], cache_salt: str | None, what: str) -> Request:
    req = Request(f"kv-{what}-{next(_placeholder_ids)}", list(token_ids), SamplingParams(max_tokens=1),
                  max_tokens=1)
    req.cache_salt = cache_salt
    return req


def _group_lists(engine: LLMEngine, x: Any) -> list:
    """One entry per KV cache group: the hybrid manager answers per group, the plain one once."""
    return list(x) if len(engine.kv_cache_groups) > 1 else [x]


# --------------------------------------------------------------------------- payload


@dataclass
class KVBlocks:
    """KV blocks of one prompt prefix, in transit between engines.

    Attributes:
        layout: the sender's :class:`KVLayout`.
        start_block: index of the first block carried (the receiver had the ones before).
        block_hashes: the carried blocks' chained hashes (32-byte SHA-256 each).
        keys, values: per layer, ``[num_blocks, block_size, num_kv_heads, head_dim]`` CPU tensors
            in the KV storage dtype (an fp8 cache's bytes may come as ``uint8``).
    """

    layout: KVLayout
    start_block: int
    block_hashes: list[bytes]
    keys: list[torch.Tensor] = field(default_factory=list)
    values: list[torch.Tensor] = field(default_factory=list)

    @property
    def num_blocks(self) -> int:
        """Blocks carried."""
        return len(self.block_hashes)

    @property
    def nbytes(self) -> int:
        """Bytes of K/V carried (all layers)."""
        return 2 * self.layout.num_layers * self.num_blocks * self.layout.block_layer_bytes


def export_kv(engine: LLMEngine, token_ids: Sequence[int], cache_salt: str | None = None,
              start_block: int = 0) -> KVBlocks:
    """The K/V of the longest cached full-block prefix of ``token_ids`` in ``engine``'s prefix
    cache, from block ``start_block`` on (prefill side of P/D disaggregation).

    Must run in the engine's thread between steps (:meth:`AsyncLLM.run_in_engine`): it reads the
    KV pool. The K/V are copied out, so the result stays valid after the engine moves on. At most
    ``(len(token_ids) - 1) // block_size`` blocks are considered (the receiver computes the last
    token itself); a prefix shorter than ``start_block`` gives zero blocks.

    Args:
        engine: the prefill engine.
        token_ids: the prompt's token ids, as the receiver tokenized them.
        cache_salt: the request's prefix-cache namespace (vLLM's ``cache_salt``).
        start_block: first block to export (>= 0).

    Returns:
        :class:`KVBlocks` with ``keys[l]`` / ``values[l]`` of shape ``[n, block_size, kv_heads,
        head_dim]`` in the KV storage dtype (fp8 as raw fp8 bytes).

    Raises:
        KVTransferError: the engine cannot export (:func:`check_supported`).
        ValueError: ``start_block < 0``.
    """
    if start_block < 0:
        raise ValueError(f"start_block must be >= 0, got {start_block}")
    check_supported(engine)
    layout = kv_layout(engine)
    req = _placeholder(engine, token_ids, cache_salt, "export")
    prefix = _group_lists(engine, engine.kv_cache_manager.cached_prefix_blocks(req))
    total = min(len(p) for p in prefix)
    ids = [torch.tensor(p[start_block:total], dtype=torch.long) for p in prefix]
    out = KVBlocks(layout, start_block, chain_hashes(token_ids, engine.block_size, total, cache_salt)[start_block:])
    runner = engine.runner
    for layer, (k, v) in enumerate(runner.kv_caches):
        g = ids[runner.layer_group[layer]]
        ks, vs = block_storage(k), block_storage(v)
        out.keys.append(ks.index_select(0, g.to(ks.device)).cpu())
        out.values.append(vs.index_select(0, g.to(vs.device)).cpu())
    return out


def _raw_bytes(t: torch.Tensor) -> bytes:
    return t.contiguous().view(torch.uint8).numpy().tobytes()


def encode_kv(blocks: KVBlocks) -> bytes:
    """Serialize :class:`KVBlocks`: :data:`MAGIC`, a little-endian uint32 header length, the
    JSON header (layout, start block, block count, hex block hashes, byte order), then per layer
    the raw K bytes and the raw V bytes of all carried blocks."""
    header = json.dumps({"layout": blocks.layout.to_json(), "start_block": blocks.start_block,
                         "num_blocks": blocks.num_blocks, "block_hashes": [h.hex() for h in blocks.block_hashes],
                         "byteorder": sys.byteorder}).encode()
    header += b" " * (-(len(MAGIC) + _HEADER_LEN.size + len(header)) % 16)  # tensors start 16-byte aligned
    parts = [MAGIC, _HEADER_LEN.pack(len(header)), header]
    for k, v in zip(blocks.keys, blocks.values, strict=True):
        parts += [_raw_bytes(k), _raw_bytes(v)]
    return b"".join(parts)


def decode_kv(data: bytes | bytearray | memoryview, expect: KVLayout | None = None) -> KVBlocks:
    """Parse an :func:`encode_kv` body and check it against the receiver's layout.

    Args:
        data: the body.
        expect: the receiver's :class:`KVLayout`; None skips the comparison.

    Returns:
        :class:`KVBlocks` whose tensors are CPU views of one private copy of ``data``.

    Raises:
        KVTransferError: not a kvfleet KV body, an unreadable or oversized header, another byte
            order, a layout that differs from ``expect`` (model, shape, dtype, block size,
            scales, groups), or a body shorter or longer than the header announces.
    """
    buf = bytearray(data)
    n0 = len(MAGIC) + _HEADER_LEN.size
    if len(buf) < n0 or bytes(buf[:len(MAGIC)]) != MAGIC:
        raise KVTransferError("not a kvfleet KV transfer body (bad magic bytes)")
    (hlen,) = _HEADER_LEN.unpack_from(buf, len(MAGIC))
    if hlen > MAX_HEADER_BYTES or n0 + hlen > len(buf):
        raise KVTransferError(f"truncated KV transfer body: header of {hlen} bytes, body of {len(buf)}")
    try:
        header = json.loads(bytes(buf[n0:n0 + hlen]))
        layout = KVLayout.from_json(header["layout"])
        start = _int(header["start_block"])
        count = _int(header["num_blocks"])
        hashes = [bytes.fromhex(h) for h in header["block_hashes"]]
        order = header.get("byteorder", "little")
    except KVTransferError:
        raise
    except (ValueError, KeyError, TypeError) as e:
        raise KVTransferError(f"malformed KV transfer header: {e!r}") from None
    if start < 0 or count < 0 or len(hashes) != count or any(len(h) != 32 for h in hashes):
        raise KVTransferError("malformed KV transfer header: block count, start block and hashes disagree")
    if order != sys.byteorder:
        raise KVTransferError(f"the sending engine is {order}-endian, this one {sys.byteorder}-endian")
    if expect is not None:
        why = expect.mismatch(layout)
        if why is not None:
            raise KVTransferError(f"KV layout mismatch: {why}")
    per = count * layout.block_layer_bytes
    want = n0 + hlen + 2 * layout.num_layers * per
    if len(buf) != want:
        raise KVTransferError(f"{'truncated' if len(buf) < want else 'oversized'} KV transfer body: "
                              f"{len(buf)} bytes, the header announces {want}")
    dtype = getattr(torch, layout.kv_dtype)
    shape = (count, layout.block_size, layout.num_kv_heads, layout.head_dim)
    flat = torch.frombuffer(buf, dtype=torch.uint8) if len(buf) else torch.empty(0, dtype=torch.uint8)
    out = KVBlocks(layout, start, hashes)
    off = n0 + hlen
    aligned = off % 16 == 0
    for _ in range(layout.num_layers):
        for dst in (out.keys, out.values):
            chunk = flat[off:off + per]
            dst.append((chunk if aligned else chunk.clone()).view(dtype).view(shape))
            off += per
    return out


# --------------------------------------------------------------------------- import


@dataclass
class ImportResult:
    """What one KV import did (decode side).

    Attributes:
        num_usable_blocks: full prompt blocks the decode engine could take
            (:func:`usable_blocks`).
        num_local_blocks: of those, already in its own prefix cache before the import.
        num_received_blocks: blocks the prefill engine sent.
        num_imported_blocks: blocks written into the pool (pages, summed over KV cache groups).
        num_bytes: K/V bytes written.
        seconds: wall time of fetch and import.
        fallback: why part of the prompt is computed locally (``prefix_missing``: the prefill
            engine had fewer blocks; ``pool_full``; ``local_evicted``; ``fetch_failed``;
            ``incompatible``), None when the whole usable prefix is cached after the import.
    """

    num_usable_blocks: int = 0
    num_local_blocks: int = 0
    num_received_blocks: int = 0
    num_imported_blocks: int = 0
    num_bytes: int = 0
    seconds: float = 0.0
    fallback: str | None = None


def import_kv(engine: LLMEngine, blocks: KVBlocks, token_ids: Sequence[int], cache_salt: str | None = None,
              pin_for: str | None = None) -> ImportResult:
    """Write received KV blocks into ``engine``'s pool and register them in its prefix cache, so
    that a request for ``token_ids`` finds them as a prefix-cache hit (decode side of P/D).

    Must run in the engine's thread between steps. Blocks the engine has cached already are
    shared, not overwritten. With ``pin_for``, the blocks stay pinned (not evictable) until that
    request is first scheduled or finishes (:meth:`LLMEngine.pin_imported_kv`); without it they
    are released at once and stay in the prefix cache until evicted.

    Args:
        engine: the decode engine.
        blocks: from :func:`decode_kv` (or :func:`export_kv` in-process).
        token_ids: the request's prompt token ids.
        cache_salt: the request's ``cache_salt`` (must match the export's).
        pin_for: request id to pin the blocks for.

    Returns:
        :class:`ImportResult`; a short prefix, a full pool or blocks evicted here meanwhile are
        reported in ``fallback`` (the rest of the prompt is then computed), never raised.

    Raises:
        KVTransferError: the engine cannot import, the layout differs, or the block hashes are
            not those of ``token_ids`` (nothing is changed).
    """
    check_supported(engine)
    why = kv_layout(engine).mismatch(blocks.layout)
    if why is not None:
        raise KVTransferError(f"KV layout mismatch: {why}")
    bs = engine.block_size
    usable = usable_blocks(len(token_ids), bs)
    start, n = blocks.start_block, blocks.num_blocks
    if blocks.block_hashes != chain_hashes(token_ids, bs, start + n, cache_salt)[start:]:
        raise KVTransferError("the received KV blocks' hashes are not those of this prompt "
                              "(different token ids, cache_salt or hashing)")
    if len(blocks.keys) != blocks.layout.num_layers or len(blocks.values) != blocks.layout.num_layers:
        raise KVTransferError(f"expected K and V of {blocks.layout.num_layers} layers, got "
                              f"{len(blocks.keys)} and {len(blocks.values)}")
    end = min(start + n, usable)
    res = ImportResult(num_usable_blocks=usable, num_received_blocks=n)
    kv = engine.kv_cache_manager
    req = _placeholder(engine, token_ids, cache_salt, "import")
    res.num_local_blocks = min(len(p) for p in _group_lists(engine, kv.cached_prefix_blocks(req)))
    if end <= start or res.num_local_blocks >= end:  # nothing new to write
        res.fallback = None if max(end, res.num_local_blocks) >= usable else "prefix_missing"
        return res
    got = kv.begin_import(req, end * bs)
    if got is None:
        res.fallback = "pool_full"
        return res
    reused = _group_lists(engine, got)
    if min(reused) < start:  # blocks before `start` were evicted here since the request asked
        kv.abort_import(req)
        res.fallback = "local_evicted"
        return res
    runner = engine.runner
    tables = kv.get_block_tables(req.request_id)
    try:
        for layer, (k, v) in enumerate(runner.kv_caches):
            gi = runner.layer_group[layer]
            r = reused[gi]
            if r >= end:
                continue
            ks, vs = block_storage(k), block_storage(v)
            dst = torch.tensor(tables[gi][r:end], dtype=torch.long, device=ks.device)
            ks.index_copy_(0, dst, blocks.keys[layer][r - start:end - start].to(ks.device).view(ks.dtype))
            vs.index_copy_(0, dst, blocks.values[layer][r - start:end - start].to(vs.device).view(vs.dtype))
    except (RuntimeError, ValueError, IndexError) as e:
        kv.abort_import(req)
        raise KVTransferError(f"could not write the received KV blocks: {e}") from e
    kv.commit_import(req, end * bs)
    res.num_imported_blocks = sum(end - r for r in reused)
    res.num_bytes = 2 * sum(len(layers) * (end - reused[gi]) for gi, (_, layers) in enumerate(blocks.layout.groups)) \
        * blocks.layout.block_layer_bytes
    if pin_for is not None:
        engine.pin_imported_kv(pin_for, req)
    else:
        kv.free(req)
    if end < usable:
        res.fallback = "prefix_missing"
    return res


def local_hint(engine: LLMEngine, token_ids: Sequence[int], cache_salt: str | None = None) -> int:
    """Leading full prompt blocks the engine most likely holds in its prefix cache, read from
    another thread without locking (dict lookups of the hash index only; 0 with the radix
    index or KV cache groups). Only a hint for which blocks to fetch: :func:`import_kv`
    checks again in the engine thread."""
    kv = engine.kv_cache_manager
    if len(engine.kv_cache_groups) > 1 or getattr(kv, "radix", None) is not None \
            or not kv.enable_prefix_caching:
        return 0
    k = 0
    for h in chain_hashes(token_ids, engine.block_size, usable_blocks(len(token_ids), engine.block_size),
                          cache_salt):
        if kv.pool.get_cached_block(h) is None:
            break
        k += 1
    return k


# --------------------------------------------------------------------------- HTTP client (decode side)


def remote_prefill_url(params: Any) -> str | None:
    """The prefill engine's base URL from a request's ``kv_transfer_params`` (vLLM's field):
    ``remote_url`` when ``do_remote_prefill`` is true, else None.

    Raises:
        KVTransferError: ``do_remote_prefill`` not a boolean, ``remote_url`` not a string, or
            ``do_remote_prefill`` without an http(s) ``remote_url``.
    """
    if not isinstance(params, dict):
        return None
    flag = params.get("do_remote_prefill")
    if flag is not None and not isinstance(flag, bool):
        raise KVTransferError(f"kv_transfer_params.do_remote_prefill must be a boolean, got {flag!r}")
    url = params.get("remote_url")
    if url is not None and not isinstance(url, str):
        raise KVTransferError(f"kv_transfer_params.remote_url must be a string, got {url!r}")
    if flag is not True:
        return None
    parts = urlsplit(url) if isinstance(url, str) else None
    if parts is None or parts.scheme not in ("http", "https") or not parts.hostname:
        raise KVTransferError("kv_transfer_params.remote_url must be the prefill engine's http(s) base URL "
                              "when do_remote_prefill is true")
    return url.rstrip("/")


class KVTransferClient:
    """Decode side of P/D over HTTP: fetches a prompt's KV from the prefill engine and hands the
    engine thread an import to run right before the request is queued.

    Args:
        engine: the :class:`~kvfleet.engine.llm_engine.LLMEngine` the imports go into.
        client: the HTTP client (created on first use when None; closed by :meth:`aclose`).
        timeout_s: seconds for one export request (connect, read).
        on_result: called with every :class:`ImportResult` (from the engine thread for
            completed imports, from the event loop for failed fetches).
    """

    def __init__(self, engine: LLMEngine, client: httpx.AsyncClient | None = None, timeout_s: float = 60.0,
                 on_result: Callable[[ImportResult], None] | None = None) -> None:
        self.engine = engine
        self._client = client
        self._own_client = client is None
        self.timeout_s = timeout_s
        self.on_result = on_result
        self._layout: KVLayout | None = None

    @property
    def layout(self) -> KVLayout:
        """This engine's :class:`KVLayout` (computed once)."""
        if self._layout is None:
            self._layout = kv_layout(self.engine)
        return self._layout

    def _report(self, res: ImportResult) -> None:
        if self.on_result is not None:
            try:
                self.on_result(res)
            except Exception:  # noqa: BLE001 - metrics must not break serving
                logger.exception("KV transfer result callback failed")

    async def fetch(self, remote_url: str, token_ids: Sequence[int], cache_salt: str | None = None,
                    start_block: int = 0) -> KVBlocks:
        """``POST remote_url + EXPORT_PATH`` and decode the answer.

        Raises:
            KVTransferError: the prefill engine refused (its error message is included), or the
                body does not decode against this engine's layout.
            httpx.HTTPError: connection or protocol errors.
        """
        import httpx

        if self._client is None:
            self._client = httpx.AsyncClient(trust_env=False)
        body = {"token_ids": list(token_ids), "cache_salt": cache_salt, "start_block": start_block,
                "layout": self.layout.to_json()}
        r = await self._client.post(remote_url + EXPORT_PATH, json=body,
                                    timeout=httpx.Timeout(self.timeout_s, connect=5.0))
        if r.status_code != 200:
            try:
                msg = r.json()["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = r.text[:300]
            if r.status_code >= 500:
                raise httpx.HTTPStatusError(f"HTTP {r.status_code}: {msg}", request=r.request, response=r)
            raise KVTransferError(f"the prefill engine {remote_url} refused the KV export (HTTP {r.status_code}): "
                                  f"{msg}")
        import asyncio

        return await asyncio.to_thread(decode_kv, r.content, self.layout)

    def before_admit(self, remote_url: str, cache_salt: str | None = None
                     ) -> Callable[[str, list[int]], Awaitable[Callable[[LLMEngine], Any] | None]]:
        """A hook for :meth:`AsyncLLM.add_request_async`: given the request id and prompt token
        ids, fetch the KV this engine lacks from ``remote_url`` and return the import to run in
        the engine thread (None when there is nothing to fetch or the fetch failed; the prompt
        is then computed here, and the failure counted)."""

        async def hook(request_id: str, token_ids: list[int]) -> Callable[[LLMEngine], Any] | None:
            import httpx

            t0 = time.perf_counter()
            usable = usable_blocks(len(token_ids), self.engine.block_size)
            start = min(local_hint(self.engine, token_ids, cache_salt), usable)
            if start >= usable:  # nothing to fetch (a prompt under one block, or all cached here)
                self._report(ImportResult(num_usable_blocks=usable, num_local_blocks=start,
                                          seconds=time.perf_counter() - t0))
                return None
            try:
                blocks = await self.fetch(remote_url, token_ids, cache_salt, start)
            except (httpx.HTTPError, KVTransferError, OSError) as e:
                kind = "incompatible" if isinstance(e, KVTransferError) else "fetch_failed"
                logger.warning("KV transfer from %s failed (%s); computing the prompt here: %s", remote_url, kind, e)
                self._report(ImportResult(num_usable_blocks=usable, num_local_blocks=start, fallback=kind,
                                          seconds=time.perf_counter() - t0))
                return None

            def run(engine: LLMEngine) -> ImportResult:
                try:
                    res = import_kv(engine, blocks, token_ids, cache_salt, pin_for=request_id)
                except KVTransferError as e:
                    logger.warning("KV import from %s failed; computing the prompt here: %s", remote_url, e)
                    res = ImportResult(num_usable_blocks=usable, num_received_blocks=blocks.num_blocks,
                                       fallback="incompatible")
                res.seconds = time.perf_counter() - t0
                self._report(res)
                return res

            return run

        return hook

    async def aclose(self) -> None:
        """Close the HTTP client if this object created it."""
        if self._client is not None and self._own_client:
            await self._client.aclose()
            self._client = None
