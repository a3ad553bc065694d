"""The model runner: one paged forward over the scheduled chunks, commits, and sampling.

For a model with a recurrent layer group, chunks are cut at the manager's snapshot points (the
multiples of ``snapshot_interval_blocks`` blocks, and the end of the prompt) and run in waves,
so that every such point is the end of a commit and a state snapshot is kept there for reuse.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

import torch

from kvtier.engine.batch_scheduler import ScheduledChunk
from kvtier.engine.params import SamplingParams
from kvtier.engine.request import Request
from kvtier.manager import KVCacheManager
from kvtier.models import DecoderModel, PagedSequence


@dataclass(slots=True)
class _Piece:
    chunk: ScheduledChunk
    start: int
    end: int


class ModelRunner:
    """Runs ``model`` over a manager's pages."""

    def __init__(self, model: DecoderModel, mgr: KVCacheManager) -> None:
        self.model = model
        self.mgr = mgr
        has_state = any(g.kind.value == "recurrent" for g in mgr.layer_groups)
        self._snapshot_tokens = mgr.config.snapshot_interval_blocks * mgr.tokens_per_block if has_state else 0
        self._generators: dict[int, torch.Generator] = {}

    def run(self, batch: list[ScheduledChunk]) -> tuple[dict[int, int], dict[int, str]]:
        """Compute every chunk, commit it, and sample a token for each request now fully computed.

        Returns (request id -> sampled token, request id -> error). A request whose logits are
        not finite (NaN or inf: broken weights, an overflow in a low precision) gets an error
        instead of a token, since any token sampled from them would be wrong, and its chunk is not
        committed: a non-finite value anywhere in a chunk reaches the last position's logits
        through attention, and the chunk's pages would serve it to every request reusing them.
        """
        waves = self._waves(batch)
        sampled: dict[int, int] = {}
        errors: dict[int, str] = {}
        for wave in waves:
            wave = [piece for piece in wave if piece.chunk.request.request_id not in errors]
            if not wave:
                continue
            seqs = [self._sequence(piece) for piece in wave]
            logits = self.model.forward_paged(seqs, self.mgr.kv_views, "last")
            finite = torch.isfinite(logits).all(dim=-1).tolist()
            for row, piece in enumerate(wave):
                request = piece.chunk.request
                if not finite[row]:
                    errors[request.request_id] = f"the model gave non-finite logits at position {piece.end - 1}"
                    continue
                request.held_cache().commit(request.tokens[piece.start : piece.end])
                request.computed_prompt_tokens += max(0, min(piece.end, len(request.prompt)) - piece.start)
                if piece.end == len(request.tokens):
                    sampled[request.request_id] = self._sample(request, logits[row])
        return sampled, errors

    def forget(self, request: Request) -> None:
        self._generators.pop(request.request_id, None)

    def _waves(self, batch: list[ScheduledChunk]) -> list[list[_Piece]]:
        """Each chunk cut at snapshot points; wave k holds every chunk's k-th piece."""
        cut = [self._cut(chunk) for chunk in batch]
        return [[pieces[k] for pieces in cut if k < len(pieces)] for k in range(max(map(len, cut), default=0))]

    def _cut(self, chunk: ScheduledChunk) -> list[_Piece]:
        start, end = chunk.start, chunk.start + chunk.num_tokens
        if not self._snapshot_tokens:
            return [_Piece(chunk, start, end)]
        points = set(range((start // self._snapshot_tokens + 1) * self._snapshot_tokens, end, self._snapshot_tokens))
        prompt_end = len(chunk.request.prompt)
        if start < prompt_end < end:
            points.add(prompt_end)
        bounds = [start, *sorted(points), end]
        return [_Piece(chunk, a, b) for a, b in itertools.pairwise(bounds)]

    def _sequence(self, piece: _Piece) -> PagedSequence:
        request = piece.chunk.request
        cache = request.held_cache()
        # Host tensors: the model plans and checks the batch on the host and ships it to the
        # device without a synchronisation, so promoted pages can still be landing meanwhile.
        ids = torch.tensor(request.tokens[piece.start : piece.end], dtype=torch.int64)
        pages = tuple(torch.from_numpy(cache.page_indices(g.group_id)).to(torch.int64) for g in self.mgr.layer_groups)
        return PagedSequence(ids, piece.start, pages)

    def _sample(self, request: Request, logits: torch.Tensor) -> int:
        params: SamplingParams = request.params
        if params.temperature == 0:
            return int(logits.argmax())
        generator = self._generators.get(request.request_id)
        if generator is None:
            generator = torch.Generator(device=logits.device)
            generator.manual_seed(params.seed if params.seed is not None else request.request_id)
            self._generators[request.request_id] = generator
        # In float64, shifted so that the largest is 0: any temperature > 0 a float holds (down to
        # 5e-324) gives -inf for the others, never inf or NaN (in float32 one below ~1e-45 is 0).
        logits = logits.double()
        probs = torch.softmax((logits - logits.max()) / params.temperature, dim=-1)
        return int(torch.multinomial(probs, 1, generator=generator))
