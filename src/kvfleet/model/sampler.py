"""Batched token sampler: penalties, min_tokens, temperature, top-k / top-p / min-p, seeds, logprobs.

The model runner calls :class:`Sampler` once per step with the last-position logits of every
request that produces a token in that step. Everything is vectorised across the batch (one
``[N, vocab]`` tensor per stage); the only Python loops are over requests (to gather their
token lists and per-request generators), never over the vocabulary.

Order of operations per row (vLLM / Hugging Face order):

1. logprobs are taken from ``log_softmax`` of the **raw** logits (vLLM's default ``raw_logprobs``);
2. ``min_tokens``: EOS and ``stop_token_ids`` masked to ``-inf`` while too few tokens exist;
3. repetition penalty (CTRL, Keskar et al. 2019) over prompt + generated tokens;
4. presence / frequency penalties (OpenAI API semantics) over generated tokens;
5. temperature == 0 (below ``1e-5``): greedy argmax of the penalised logits, done;
6. otherwise divide by temperature, keep the ``top_k`` best, nucleus ``top_p``
   (Holtzman et al. 2020, "The Curious Case of Neural Text Degeneration"), ``min_p``
   (Nguyen et al. 2024, "Turning Up the Heat: Min-p Sampling"), and draw with the
   exponential race (Gumbel-max trick in exponential form).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvfleet.engine.outputs import SampleResult, TokenLogprob
from kvfleet.engine.request import Request

# Temperatures below this are treated as greedy (as vLLM's ``_SAMPLING_EPS``): dividing by them
# would overflow float32 and the distribution is a point mass anyway.
GREEDY_TEMPERATURE_EPS = 1e-5

# Smallest exponential draw allowed: q == 0 would make p / q infinite (or NaN for p == 0).
_MIN_EXP = torch.finfo(torch.float32).tiny


def _is_greedy(request: Request) -> bool:
    return request.sampling_params.temperature < GREEDY_TEMPERATURE_EPS


def _padded_ids(rows: Sequence[Sequence[int]], pad: int, device: torch.device) -> torch.Tensor:
    """Token lists -> ``[len(rows), max_len]`` int64 tensor padded with ``pad`` (max_len >= 1)."""
    width = max(1, max((len(r) for r in rows), default=0))
    out = torch.full((len(rows), width), pad, dtype=torch.long)
    for i, r in enumerate(rows):
        if r:
            out[i, : len(r)] = torch.as_tensor(r, dtype=torch.long)
    return out.to(device)


def _token_counts(rows: Sequence[Sequence[int]], vocab_size: int, device: torch.device) -> torch.Tensor:
    """How often each token occurs in each row: ``[len(rows), vocab_size]`` float32.

    One ``scatter_add_`` over a padded id tensor; the pad id ``vocab_size`` lands in an extra
    column that is dropped. Ids outside ``[0, vocab_size)`` are ignored.
    """
    ids = _padded_ids(rows, vocab_size, device)
    ids = torch.where((ids >= 0) & (ids < vocab_size), ids, torch.full_like(ids, vocab_size))
    counts = torch.zeros((len(rows), vocab_size + 1), dtype=torch.float32, device=device)
    counts.scatter_add_(1, ids, torch.ones_like(ids, dtype=torch.float32))
    return counts[:, :vocab_size]


class Sampler:
    """Turns next-token logits into one sampled token (plus optional logprobs) per request.

    Per-request settings come from ``request.sampling_params`` (see
    :class:`kvfleet.sampling_params.SamplingParams`). Seeded requests draw from their own
    ``torch.Generator`` (created on first use from ``sampling_params.seed`` and kept in
    ``request.generator``), so their tokens do not depend on batch composition or row index;
    unseeded requests share one sampler-wide generator and are drawn in one batched call.

    Args:
        seed: seed of the sampler-wide generator used by unseeded requests (None = random).

    Sampling uses the exponential race: ``argmax_i p_i / q_i`` with ``q_i ~ Exp(1)`` picks
    ``i`` with probability ``p_i`` (equivalent to the Gumbel-max trick).
    """

    def __init__(self, seed: int | None = None) -> None:
        self._seed = seed
        self._generators: dict[torch.device, torch.Generator] = {}

    # ------------------------------------------------------------------ public API

    def __call__(self, logits: torch.Tensor, requests: list[Request]) -> list[SampleResult]:
        """Sample one token per row.

        Args:
            logits: ``[N, vocab]`` next-token logits (float32; other float dtypes are upcast),
                row ``i`` belongs to ``requests[i]``. Not modified.
            requests: the ``N`` requests; their ``sampling_params``, ``prompt_token_ids``,
                ``output_token_ids``, ``eos_token_id`` are read, ``generator`` may be set.

        Returns:
            ``N`` :class:`SampleResult`; ``logprob`` is a :class:`TokenLogprob` (sampled token's
            logprob and the top ``k = sampling_params.logprobs`` pairs, most likely first, from
            ``log_softmax`` of the raw logits) when ``sampling_params.logprobs`` is not None.

        Raises:
            ValueError: ``logits`` is not 2-D or its row count differs from ``len(requests)``.
        """
        self._check(logits, requests)
        if not requests:
            return []
        raw = logits if logits.dtype == torch.float32 else logits.float()
        processed = self.apply_penalties(raw, requests)
        greedy_rows = [i for i, r in enumerate(requests) if _is_greedy(r)]
        if len(greedy_rows) == len(requests):
            tokens = processed.argmax(dim=-1)
        else:
            tokens = self._sample(processed, requests, greedy_rows)
        token_list: list[int] = tokens.tolist()
        logprobs = self._logprobs(raw, requests, tokens)
        return [SampleResult(token_id=t, logprob=logprobs.get(i)) for i, t in enumerate(token_list)]

    def apply_penalties(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Apply min_tokens masking and repetition / presence / frequency penalties.

        Formulas (per row, token ``t``):

        * min_tokens: while ``len(output_token_ids) < min_tokens``, ``eos_token_id`` (unless None)
          and every ``stop_token_ids`` id get ``-inf``;
        * repetition (CTRL, Keskar et al. 2019), for ``t`` in prompt + output:
          ``l / rp`` if ``l > 0`` else ``l * rp``;
        * OpenAI penalties, with ``c`` = count of ``t`` in the output:
          ``l -= presence * (c > 0) + frequency * c``.

        Args:
            logits: ``[N, vocab]`` float32, not modified.
            requests: the ``N`` requests.

        Returns:
            ``[N, vocab]`` float32: ``logits`` itself when no row needs any of these (no copy),
            else a new tensor.

        Raises:
            ValueError: shape mismatch (see :meth:`__call__`).
        """
        self._check(logits, requests)
        n, vocab = logits.shape
        device = logits.device
        min_tok_rows = [
            i for i, r in enumerate(requests)
            if len(r.output_token_ids) < r.sampling_params.min_tokens
        ]
        rep_rows = [i for i, r in enumerate(requests) if r.sampling_params.repetition_penalty != 1.0]
        freq_rows = [
            i for i, r in enumerate(requests)
            if r.sampling_params.presence_penalty != 0.0 or r.sampling_params.frequency_penalty != 0.0
        ]
        if not (min_tok_rows or rep_rows or freq_rows):
            return logits
        out = logits.float().clone()

        if rep_rows:
            idx = torch.tensor(rep_rows, dtype=torch.long, device=device)
            seen = _token_counts([requests[i].all_token_ids for i in rep_rows], vocab, device) > 0
            rp = torch.tensor(
                [requests[i].sampling_params.repetition_penalty for i in rep_rows],
                dtype=torch.float32, device=device,
            ).unsqueeze(1)
            rows = out[idx]
            penalised = torch.where(rows > 0, rows / rp, rows * rp)
            out[idx] = torch.where(seen, penalised, rows)

        if freq_rows:
            idx = torch.tensor(freq_rows, dtype=torch.long, device=device)
            counts = _token_counts([requests[i].output_token_ids for i in freq_rows], vocab, device)
            presence = torch.tensor(
                [requests[i].sampling_params.presence_penalty for i in freq_rows],
                dtype=torch.float32, device=device,
            ).unsqueeze(1)
            frequency = torch.tensor(
                [requests[i].sampling_params.frequency_penalty for i in freq_rows],
                dtype=torch.float32, device=device,
            ).unsqueeze(1)
            out[idx] = out[idx] - (presence * (counts > 0).float() + frequency * counts)

        if min_tok_rows:
            rr: list[int] = []
            cc: list[int] = []
            for i in min_tok_rows:
                r = requests[i]
                banned = set(r.sampling_params.stop_token_ids)
                if r.eos_token_id is not None:
                    banned.add(r.eos_token_id)
                for t in banned:
                    if 0 <= t < vocab:
                        rr.append(i)
                        cc.append(t)
            if rr:
                out[torch.tensor(rr, device=device), torch.tensor(cc, device=device)] = float("-inf")
        return out

    def compute_probs(self, logits: torch.Tensor, requests: list[Request]) -> torch.Tensor:
        """Final sampling distribution of non-greedy rows: temperature, top-k, top-p, min-p.

        Args:
            logits: ``[N, vocab]`` float32 (already penalised), not modified.
            requests: the ``N`` requests; every one must have temperature >= 1e-5.

        Returns:
            ``[N, vocab]`` float32 probabilities (rows sum to 1; filtered tokens are exactly 0).

        Raises:
            ValueError: shape mismatch, or a greedy request is passed.
        """
        self._check(logits, requests)
        if any(_is_greedy(r) for r in requests):
            raise ValueError("compute_probs() is for temperature > 0 rows only")
        n, vocab = logits.shape
        device = logits.device
        sps = [r.sampling_params for r in requests]
        temp = torch.tensor([sp.temperature for sp in sps], dtype=torch.float32, device=device)
        x = logits.float() / temp.unsqueeze(1)

        top_k = [sp.top_k if 0 < sp.top_k < vocab else 0 for sp in sps]
        if any(top_k):
            x = self._top_k(x, torch.tensor(top_k, dtype=torch.long, device=device))
        if any(sp.top_p < 1.0 for sp in sps):
            top_p = torch.tensor(
                [sp.top_p if sp.top_p < 1.0 else float("inf") for sp in sps],
                dtype=torch.float32, device=device,
            )
            x = self._top_p(x, top_p)
        probs = torch.softmax(x, dim=-1)
        if any(sp.min_p > 0.0 for sp in sps):
            min_p = torch.tensor([sp.min_p for sp in sps], dtype=torch.float32, device=device)
            threshold = min_p.unsqueeze(1) * probs.max(dim=-1, keepdim=True).values
            probs = probs.masked_fill(probs < threshold, 0.0)
            probs = probs / probs.sum(dim=-1, keepdim=True)
        return probs

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _check(logits: torch.Tensor, requests: list[Request]) -> None:
        if logits.dim() != 2:
            raise ValueError(f"logits must be [N, vocab], got shape {tuple(logits.shape)}")
        if logits.shape[0] != len(requests):
            raise ValueError(f"{logits.shape[0]} logit rows for {len(requests)} requests")

    @staticmethod
    def _top_k(x: torch.Tensor, k: torch.Tensor) -> torch.Tensor:
        """Keep exactly ``k[i]`` best entries of row ``i`` (``k[i] == 0``: keep all). ``x``: [N, V]."""
        k_max = int(k.max())
        vals, idx = x.topk(k_max, dim=-1)
        keep = torch.arange(k_max, device=x.device).unsqueeze(0) < k.unsqueeze(1)
        filtered = torch.full_like(x, float("-inf"))
        filtered.scatter_(1, idx, vals.masked_fill(~keep, float("-inf")))
        return torch.where((k == 0).unsqueeze(1), x, filtered)

    @staticmethod
    def _top_p(x: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
        """Nucleus filter: keep the smallest most-likely set with mass >= ``top_p[i]`` (the best
        token always stays). ``x``: [N, V] scaled logits; ``top_p``: [N] (inf = off)."""
        sorted_x, order = x.sort(dim=-1, descending=True)
        sorted_p = torch.softmax(sorted_x, dim=-1)
        mass_before = sorted_p.cumsum(dim=-1) - sorted_p
        drop_sorted = mass_before >= top_p.unsqueeze(1)
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        return x.masked_fill(drop, float("-inf"))

    def _shared_generator(self, device: torch.device) -> torch.Generator:
        gen = self._generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            if self._seed is None:
                gen.seed()
            else:
                gen.manual_seed(self._seed)
            self._generators[device] = gen
        return gen

    @staticmethod
    def _request_generator(request: Request, device: torch.device) -> torch.Generator:
        gen = request.generator
        if gen is None or gen.device != device:
            gen = torch.Generator(device=device)
            gen.manual_seed(int(request.sampling_params.seed))
            request.generator = gen
        return gen

    def _sample(self, processed: torch.Tensor, requests: list[Request], greedy_rows: list[int]) -> torch.Tensor:
        """Tokens ``[N]`` int64: argmax for greedy rows, exponential-race draws for the rest."""
        device = processed.device
        tokens = processed.argmax(dim=-1) if greedy_rows else torch.empty(
            processed.shape[0], dtype=torch.long, device=device
        )
        greedy = set(greedy_rows)
        rand_rows = [i for i in range(len(requests)) if i not in greedy]
        idx = torch.tensor(rand_rows, dtype=torch.long, device=device)
        probs = self.compute_probs(processed[idx], [requests[i] for i in rand_rows])
        q = torch.empty_like(probs)
        unseeded = []
        for j, i in enumerate(rand_rows):
            if requests[i].sampling_params.seed is None:
                unseeded.append(j)
            else:
                q[j].exponential_(generator=self._request_generator(requests[i], device))
        if unseeded:
            uidx = torch.tensor(unseeded, dtype=torch.long, device=device)
            q[uidx] = torch.empty(
                (len(unseeded), probs.shape[1]), dtype=probs.dtype, device=device
            ).exponential_(generator=self._shared_generator(device))
        tokens[idx] = (probs / q.clamp_min_(_MIN_EXP)).argmax(dim=-1)
        return tokens

    @staticmethod
    def _logprobs(raw: torch.Tensor, requests: list[Request], tokens: torch.Tensor) -> dict[int, TokenLogprob]:
        rows = [i for i, r in enumerate(requests) if r.sampling_params.logprobs is not None]
        if not rows:
            return {}
        idx = torch.tensor(rows, dtype=torch.long, device=raw.device)
        lp = torch.log_softmax(raw[idx], dim=-1)
        chosen = lp.gather(1, tokens[idx].unsqueeze(1)).squeeze(1).tolist()
        k_max = max(requests[i].sampling_params.logprobs for i in rows)
        top_vals: list[list[float]] = [[] for _ in rows]
        top_ids: list[list[int]] = [[] for _ in rows]
        if k_max > 0:
            vals, ids = lp.topk(min(k_max, lp.shape[1]), dim=-1)
            top_vals, top_ids = vals.tolist(), ids.tolist()
        out: dict[int, TokenLogprob] = {}
        tok_list = tokens[idx].tolist()
        for j, i in enumerate(rows):
            k = requests[i].sampling_params.logprobs
            top = list(zip(top_ids[j][:k], top_vals[j][:k]))
            out[i] = TokenLogprob(token_id=tok_list[j], logprob=chosen[j], top=top)
        return out
