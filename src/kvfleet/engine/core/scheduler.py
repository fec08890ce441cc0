"""Continuous-batching scheduler with chunked prefill, admission control and recompute preemption.

Techniques: iteration-level scheduling / continuous batching (Orca, Yu et al., OSDI 2022),
chunked prefill that shares a step with decodes (Sarathi / Sarathi-Serve, Agrawal et al.
2023-2024), paged KV blocks and preemption by recompute (vLLM, Kwon et al., SOSP 2023). The
step model follows vLLM v1: there are no prefill and decode phases; each request has
``num_computed_tokens`` (tokens whose KV is cached) and ``num_tokens`` (prompt + output), and a
step gives it up to ``num_tokens - num_computed_tokens`` new tokens within the token budget.

Pure Python, no torch.
"""

from __future__ import annotations

import time
from collections import deque

from kvfleet.config import SchedulerConfig
from kvfleet.engine.core.hybrid_kv_cache_manager import HybridKVCacheManager
from kvfleet.engine.core.kv_cache_manager import KVCacheManager
from kvfleet.engine.core.scheduler_output import ScheduledRequest, SchedulerOutput
from kvfleet.engine.request import Request, RequestStatus
from kvfleet.errors import InvalidRequestError, QueueFullError, RequestTooLongError


class Scheduler:
    """Continuous batching (Orca, Yu et al. 2022) with chunked prefill (Sarathi, Agrawal et al.
    2023) and preemption by recompute, vLLM-v1 style.

    Each :meth:`schedule` call plans one step:

    1. Running requests, oldest first, each get ``min(num_tokens - num_computed_tokens, budget)``
       new tokens (1 for a decode, the next chunk for a request mid-prefill). When the pool is
       short, the newest running request is preempted until the allocation succeeds: by
       recompute (blocks freed, ``num_computed_tokens = 0``) or, with ``preemption_mode="swap"``,
       by moving its blocks to the host swap pool; either way it goes to the front of
       ``waiting``. If the victim is the current request itself, serving running requests stops.
    2. If nothing was preempted, waiting requests are admitted FCFS (or longest prefix match
       first with ``scheduling_policy="lpm"``) while there is token budget, a sequence slot
       (``max_num_seqs``) and blocks. A swapped-out request is swapped back in first; a new
       request starts after its longest cached prefix (prefix caching); choices 1..n-1 of an
       n > 1 request wait until choice 0 has computed the prompt, then fork its blocks
       (copy-on-write) instead of computing the prompt again. Admission never skips the head
       of the queue otherwise, so no request starves.

    The step's block copies (copy-on-write) and swaps are returned in the
    :class:`SchedulerOutput` for the model runner to apply before the forward.

    ``schedule`` advances ``num_computed_tokens`` of every scheduled request; the engine appends
    the sampled token of each request with ``needs_sample`` afterwards (which makes its next
    step a 1-token decode) and calls :meth:`finish_request` when a request ends.

    Progress: admission guarantees every request alone fits in the pool, and preempting the
    newest first means the oldest running request always gets its blocks, so every step with
    unfinished requests schedules at least one token.

    Args:
        config: budgets (``max_num_seqs``, ``max_num_batched_tokens``), queue bound and chunked
            prefill switch.
        kv_cache_manager: the block tables / pool to allocate from.
        max_model_len: longest sequence, prompt + max_tokens, in tokens.

    Attributes:
        waiting: requests not running, in admission order (preempted ones at the front).
        running: running requests, oldest first.
        num_preemptions_total: preemptions since construction (for metrics).

    Raises:
        ValueError: ``max_model_len < 1``.
    """

    def __init__(self, config: SchedulerConfig, kv_cache_manager: KVCacheManager | HybridKVCacheManager,
                 max_model_len: int) -> None:
        if max_model_len < 1:
            raise ValueError(f"max_model_len must be >= 1, got {max_model_len}")
        self.config = config
        self.kv_cache_manager = kv_cache_manager
        self.max_model_len = max_model_len
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.num_preemptions_total = 0
        self.num_swap_outs = 0
        self.num_swap_ins = 0
        self.num_swap_fallbacks = 0  # swap preemptions done by recompute (host pool full, or no progress)
        self._requests: dict[str, Request] = {}
        self._step_start: dict[str, int] = {}  # num_computed_tokens before this step, of scheduled requests
        # Optional longest-prefix-match length of a waiting request, used by the "lpm" policy
        # (set by the engine when a radix index is in use; default: hash-chain matching).
        self.match_len = None

    # ------------------------------------------------------------------ admission

    def add_request(self, request: Request) -> None:
        """Queue a new request (status WAITING) after admission control.

        Raises:
            InvalidRequestError: empty prompt, or a request with the same id is unfinished here.
            RequestTooLongError: prompt + max_tokens exceeds ``max_model_len``, or needs more KV
                blocks than the whole pool, or (chunked prefill disabled) the prompt exceeds
                ``max_num_batched_tokens``.
            QueueFullError: ``config.max_waiting_requests`` requests are already waiting.
        """
        if request.num_prompt_tokens == 0:
            raise InvalidRequestError("the prompt must contain at least one token", param="prompt")
        if request.request_id in self._requests:
            raise InvalidRequestError(f"request id {request.request_id!r} is already in use")
        total = request.num_tokens_with_max_output
        if total > self.max_model_len:
            raise RequestTooLongError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) = "
                f"{total} tokens exceeds max_model_len ({self.max_model_len} tokens)",
                param="max_tokens",
            )
        kv = self.kv_cache_manager
        if not kv.can_ever_fit(total, self.config.max_num_batched_tokens):
            raise RequestTooLongError(
                f"prompt ({request.num_prompt_tokens} tokens) + max_tokens ({request.max_tokens}) = "
                f"{total} tokens needs {kv.max_blocks_held(total, self.config.max_num_batched_tokens)} KV "
                f"blocks of {kv.block_size} tokens, "
                f"but the whole pool has {kv.pool.num_blocks} blocks ({kv.capacity_tokens} tokens)",
                param="max_tokens",
            )
        max_batched = self.config.max_num_batched_tokens
        if not self.config.enable_chunked_prefill and request.num_prompt_tokens > max_batched:
            raise RequestTooLongError(
                f"prompt of {request.num_prompt_tokens} tokens exceeds max_num_batched_tokens "
                f"({max_batched} tokens) and chunked prefill is disabled",
                param="prompt",
            )
        limit = self.config.max_waiting_requests
        if limit is not None and len(self.waiting) >= limit:
            raise QueueFullError(
                f"waiting queue is full: {len(self.waiting)} requests waiting, max_waiting_requests={limit}"
            )
        request.status = RequestStatus.WAITING
        self._requests[request.request_id] = request
        self.waiting.append(request)

    # ------------------------------------------------------------------ scheduling

    def _preempt(self, request: Request, out: SchedulerOutput) -> None:
        """Preempt a running request and put it at the front of ``waiting``.

        ``swap`` mode moves its KV to the host swap pool (it resumes where it stopped), unless
        the host pool is full or the request has made no progress since it was last swapped
        in (the anti-thrashing guard): then, as in ``recompute`` mode, its KV is dropped and
        recomputed on resumption.
        """
        kv = self.kv_cache_manager
        swapped = False
        if self.config.preemption_mode == "swap":
            if self._may_swap_out(request):
                pairs = kv.swap_out(request)
                if pairs is not None:
                    out.swap_out.extend(pairs)
                    self.num_swap_outs += 1
                    swapped = True
            if not swapped:
                self.num_swap_fallbacks += 1
        if not swapped:
            kv.free(request)
            request.num_computed_tokens = 0
        request.status = RequestStatus.PREEMPTED
        request.num_preemptions += 1
        self.num_preemptions_total += 1
        self.waiting.appendleft(request)
        out.preempted.append(request)

    def _may_swap_out(self, request: Request) -> bool:
        """Anti-thrashing guard: a request swapped in must compute at least one block of tokens
        before it may be swapped out again."""
        return (request.progress_at_swap_in < 0
                or request.num_computed_tokens - request.progress_at_swap_in >= self.kv_cache_manager.block_size)

    def _pick_victim(self, i: int) -> Request:
        """Preemption victim among ``running[i:]`` (not yet scheduled this step): the newest; in
        swap mode the newest of ``running[i + 1:]`` that the anti-thrashing guard lets swap out,
        if there is one (the current request ``running[i]`` is only ever the last resort)."""
        if self.config.preemption_mode == "swap":
            for r in reversed(self.running[i + 1:]):
                if self._may_swap_out(r):
                    return r
        return self.running[-1]

    def _fork_ready(self, req: Request) -> bool | None:
        """For a choice that shares its prompt with ``req.fork_of``: True when the parent's KV
        covers the prompt but its last token (fork now), None when it never will (prefill on
        its own), False when it should wait for the parent."""
        parent = req.fork_of
        fork_point = req.num_prompt_tokens - 1
        if parent is None or fork_point < 1 or parent.is_finished:
            return None
        if parent.status == RequestStatus.RUNNING and not parent.swapped_out:
            # Only KV computed in earlier steps can be shared: block copies run before the forward.
            return self._step_start.get(parent.request_id, parent.num_computed_tokens) >= fork_point
        if parent.num_computed_tokens >= fork_point:  # parent swapped out / preempted after prefill
            return None
        return False

    def _lpm_order(self) -> None:
        """Longest-prefix-match-first order of the fresh waiting requests (SGLang's ``lpm``);
        preempted requests keep their place at the front. No-op above ``lpm_max_queue``."""
        if len(self.waiting) > self.config.lpm_max_queue or len(self.waiting) < 2:
            return
        kv = self.kv_cache_manager
        match = self.match_len or kv.match_len
        front = [r for r in self.waiting if r.num_preemptions > 0]
        fresh = [r for r in self.waiting if r.num_preemptions == 0]
        lens = {id(r): match(r) for r in fresh}
        fresh.sort(key=lambda r: -lens[id(r)])  # stable: FCFS among equal matches
        self.waiting = deque(front + fresh)

    def _record(self, request: Request, n: int, out: SchedulerOutput, now: float) -> None:
        start = request.num_computed_tokens
        self._step_start[request.request_id] = start
        tables = self.kv_cache_manager.get_block_tables(request.request_id)
        out.scheduled.append(
            ScheduledRequest(
                request=request,
                start_pos=start,
                num_new_tokens=n,
                block_table=tables[0],
                needs_sample=(start + n == request.num_tokens),
                block_tables=tables if len(tables) > 1 else [],
            )
        )
        request.num_computed_tokens = start + n
        request.status = RequestStatus.RUNNING
        if request.first_scheduled_time is None:
            request.first_scheduled_time = now

    def schedule(self) -> SchedulerOutput:
        """Plan one step (see the class docstring) and advance ``num_computed_tokens``.

        Returns:
            The step's :class:`SchedulerOutput`: scheduled requests in batch order (running ones
            first, then newly admitted ones), and the requests preempted while planning.
            ``num_batched_tokens <= max_num_batched_tokens`` and at most ``max_num_seqs``
            requests are scheduled. Empty only when there are no unfinished requests (or the
            engine left running requests without a token to compute).
        """
        out = SchedulerOutput()
        self._step_start = {}
        now = time.monotonic()
        kv = self.kv_cache_manager
        budget = self.config.max_num_batched_tokens

        # 1. Running requests, oldest first. Victims are popped from the end of `running`, so
        #    they are never requests already scheduled in this step.
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed_tokens, budget)
            if n <= 0:
                i += 1
                continue
            preempted_self = False
            while not kv.allocate_slots(req, n):
                victim = self._pick_victim(i)
                self.running.remove(victim)
                self._preempt(victim, out)
                if victim is req:
                    preempted_self = True
                    break
            if preempted_self:
                break  # the current request was the newest: stop serving running requests
            self._record(req, n, out, now)
            budget -= n
            i += 1

        # 2. Waiting requests, FCFS (or longest prefix first), only if nothing was preempted
        #    (the pool is tight). Choices waiting for the choice they fork from are passed over.
        if not out.preempted:
            if self.config.scheduling_policy == "lpm":
                self._lpm_order()
            chunked = self.config.enable_chunked_prefill
            passed: list[Request] = []
            while self.waiting and budget > 0 and len(self.running) < self.config.max_num_seqs:
                req = self.waiting[0]
                if req.swapped_out:
                    if not self._swap_in(req, out):
                        break
                elif req.fork_of is not None and req.num_computed_tokens == 0:
                    ready = self._fork_ready(req)
                    if ready is False:
                        passed.append(self.waiting.popleft())
                        continue
                    if ready:
                        kv.fork(req.fork_of, req, req.num_prompt_tokens - 1)
                        req.num_computed_tokens = req.num_prompt_tokens - 1
                        if req.num_cached_tokens < 0:
                            req.num_cached_tokens = req.fork_of.num_cached_tokens
                    req.fork_of = None
                computed_blocks, num_cached = kv.get_computed_blocks(req)
                remaining = req.num_tokens - req.num_computed_tokens - num_cached
                n = min(remaining, budget)
                # Without chunked prefill the whole remainder must fit in this step. A resumed
                # (preempted) request can hold more tokens than any step allows; it is chunked
                # anyway, otherwise it could never run again.
                if not chunked and n < remaining and remaining <= self.config.max_num_batched_tokens:
                    break
                fresh = req.num_computed_tokens == 0
                if not kv.allocate_slots(req, n, computed_blocks, num_cached, admission=fresh):
                    break
                req.num_computed_tokens += num_cached
                if req.num_cached_tokens < 0:
                    req.num_cached_tokens = num_cached
                self.waiting.popleft()
                self.running.append(req)
                self._record(req, n, out, now)
                budget -= n
            self.waiting.extendleft(reversed(passed))
        out.block_copies.extend(kv.take_block_copies())
        return out

    def _swap_in(self, req: Request, out: SchedulerOutput) -> bool:
        """Bring a swapped-out request back when its blocks fit with a watermark of one free
        block per running request (so the next decodes do not swap it straight out again)."""
        kv = self.kv_cache_manager
        need = kv.num_blocks_to_swap_in(req) + len(self.running) + 1
        if need > kv.num_free_blocks:
            return False
        pairs = kv.swap_in(req)
        if pairs is None:
            return False
        out.swap_in.extend(pairs)
        self.num_swap_ins += 1
        req.progress_at_swap_in = req.num_computed_tokens
        return True

    # ------------------------------------------------------------------ lifecycle

    def finish_request(self, request: Request, status: RequestStatus) -> None:
        """End a request: set ``status``, remove it from ``waiting`` / ``running`` and free its
        blocks. Works for waiting, running and preempted requests. Idempotent: finishing an
        already finished request changes nothing (its first finish status is kept).

        Raises:
            ValueError: ``status`` is not a FINISHED_* status.
        """
        if not status.finished:
            raise ValueError(f"finish_request needs a FINISHED_* status, got {status.name}")
        if self._requests.get(request.request_id) is not request:
            # Not tracked here (already finished, or never added): it holds no blocks.
            if not request.is_finished:
                request.status = status
            return
        del self._requests[request.request_id]
        request.status = status
        if request in self.running:
            self.running.remove(request)
        else:
            try:
                self.waiting.remove(request)
            except ValueError:
                pass
        self.kv_cache_manager.free(request)

    def get_request(self, request_id: str) -> Request | None:
        """The unfinished request with this id, or None."""
        return self._requests.get(request_id)

    @property
    def num_running(self) -> int:
        """Requests in ``running`` (``vllm:num_requests_running``)."""
        return len(self.running)

    @property
    def num_waiting(self) -> int:
        """Requests in ``waiting``, preempted ones included (``vllm:num_requests_waiting``)."""
        return len(self.waiting)

    def has_unfinished(self) -> bool:
        """True while any request is waiting or running."""
        return bool(self.waiting or self.running)
